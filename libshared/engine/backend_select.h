/* backend_select: which compute backend an engine gets (config `backend = auto|cpu|cuda`,
 * `--backend` on the tools and services, $CB_BACKEND).
 *
 * `auto` takes CUDA when the build has it (CB_HAVE_CUDA) and a device is present, and otherwise the
 * CPU backend with one log line saying why. `cuda` fails with a clear error where CUDA is unavailable;
 * `cpu` always works. The choice is process-wide (one engine kind per process); tools set it from
 * their flags before creating engines.
 *
 * Loading (CB_HAVE_CUDA builds): the CUDA backend is not linked into the programs; it is the shared
 * library libcbcuda.so (with cuBLAS and the CUDA runtime behind it, ~150 MB resident once mapped). The
 * first call that needs CUDA asks the driver alone (dlopen libcuda.so.1, cuInit, cuDeviceGetCount) whether
 * a device exists; only then is the library opened, from $CB_CUDA_LIB when set, else
 * <program dir>/../lib/libcbcuda.so (build/lib next to build/bin and build/tests; lib/ next to bin/ in an
 * install), else the plain name through the loader's path, and its entry points resolved. A program
 * that links the CUDA backend itself (cb-bench-gpu, tests/gpu) uses its own copy. So a host without a
 * GPU never maps cuBLAS and keeps the CPU-only build's memory. No driver, no device, no library, a
 * library that does not load or lacks a symbol: each is the "why" of `auto`'s log line and of `cuda`'s
 * error, never a crash. The outcome is decided once per process (thread-safe).
 * The library resolves libshared's symbols against the program, so programs are linked with
 * --export-dynamic (Makefile: CUDA_DL). */
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

/* Number of usable CUDA devices (0 when the build has no CUDA or no device answers). The first call
 * decides, as described above (and, with a device, loads libcbcuda.so). */
int cb_backend_cuda_devices(void);

/* Opens the CUDA backend library without touching a device: path when not NULL, else the search above
 * ($CB_CUDA_LIB, next to the program, the loader's path), with every symbol bound at once (RTLD_NOW), and
 * resolves the entry points cb_backend_select uses. 0 with the path opened in where (may be NULL); -1
 * with the reason in err (always -1 in a build without CUDA). For diagnostics and tests: on success the
 * library, and cuBLAS with it, stays mapped in the process. */
int cb_backend_cuda_lib_check(const char *path, char *where, size_t wherelen, char *err, size_t errlen);

/* A backend of `kind` for geometry hp (see cb_backend_cpu_new for the sizes). *chosen (may be NULL)
 * receives what was actually built. NULL with a message when nothing could be built.
 * Caller owns the result (cb_backend_destroy). */
cb_backend_t *cb_backend_select(cb_backend_kind_t kind, const cb_hparams_t *hp, int max_rows, int max_keys,
                                int n_threads, cb_backend_kind_t *chosen, char *err, size_t errlen);
#endif
