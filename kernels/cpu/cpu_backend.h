/* cpu_backend: the CPU instance of the backend table (engine/backend.h), over the f32 kernels of cpu_ops.
 * The reference every other backend is tested against. Built by cb_backend_select (engine/backend_select.h);
 * tests may build one directly. */
#ifndef CB_CPU_BACKEND_H
#define CB_CPU_BACKEND_H

#include <stddef.h>

#include "tensor/tensor.h"

/* CPU backend for model geometry hp: calls of up to max_rows rows, attention over up to max_keys keys,
 * n_threads threads (<= 0: one per online CPU). Returns NULL with a message on failure. hp->rope_freqs (the
 * model's, or NULL) is borrowed: it must outlive the backend, as the model outlives its engines.
 * Caller owns the result (cb_backend_destroy). */
cb_backend_t *cb_backend_cpu_new(const cb_hparams_t *hp, int max_rows, int max_keys, int n_threads, char *err,
                                 size_t errlen);
#endif
