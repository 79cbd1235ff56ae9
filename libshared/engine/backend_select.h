/* backend_select: which compute backend an engine gets (config `backend = auto|cpu|cuda`,
 * `--backend` on the tools and services, $CB_BACKEND).
 *
 * `auto` takes CUDA when the build has it (CB_HAVE_CUDA) and a device is present, and otherwise the
 * CPU backend with one log line saying why. `cuda` fails with a clear error where CUDA is unavailable;
 * `cpu` always works. The choice is process-wide (one engine kind per process); tools set it from
 * their flags before creating engines. */
#ifndef CB_BACKEND_SELECT_H
#define CB_BACKEND_SELECT_H

#include <stdbool.h>
#include <stddef.h>

#include "engine/backend.h"

typedef enum { CB_BACKEND_AUTO = 0, CB_BACKEND_CPU, CB_BACKEND_CUDA } cb_backend_kind_t;

/* "auto" | "cpu" | "cuda" -> kind; false for anything else. */
bool cb_backend_kind_parse(const char *s, cb_backend_kind_t *out);
const char *cb_backend_kind_name(cb_backend_kind_t kind);

/* The process-wide choice: set explicitly, else $CB_BACKEND (when valid), else auto. */
void cb_backend_set_default_kind(cb_backend_kind_t kind);
cb_backend_kind_t cb_backend_default_kind(void);

/* Number of usable CUDA devices (0 when the build has no CUDA or no device answers). */
int cb_backend_cuda_devices(void);

/* A backend of `kind` for geometry hp (see cb_backend_cpu_new for the sizes). *chosen (may be NULL)
 * receives what was actually built. NULL with a message when nothing could be built.
 * Caller owns the result (cb_backend_destroy). */
cb_backend_t *cb_backend_select(cb_backend_kind_t kind, const cb_hparams_t *hp, int max_rows, int max_keys,
                                int n_threads, cb_backend_kind_t *chosen, char *err, size_t errlen);
#endif
