/* cpu_backend: the CPU instance of the backend table (engine/backend.h), over the kernels of cpu_ops (f32,
 * attention over an f16 or f32 pool) and cpu_quant (integer products on the quantized weights). With the f32
 * numerics it is the reference every other backend is tested against. Built by cb_backend_select
 * (engine/backend_select.h); tests may build one directly. */
#ifndef CB_CPU_BACKEND_H
#define CB_CPU_BACKEND_H

#include <stddef.h>

#include "engine/backend.h"

/* CPU backend for model geometry hp: calls of up to max_rows rows, attention over up to max_keys keys,
 * n_threads threads (<= 0: one per online CPU), numerics nm (DEFAULT fields are not allowed here: resolve
 * them first, cb_numerics_resolve). Returns NULL with a message on failure. Caller owns the result
 * (cb_backend_destroy). */
cb_backend_t *cb_backend_cpu_new_numerics(const cb_hparams_t *hp, int max_rows, int max_keys, int n_threads,
                                          const cb_numerics_t *nm, char *err, size_t errlen);
/* The same with the f32 reference numerics (f32 weights, f32 pool). */
cb_backend_t *cb_backend_cpu_new(const cb_hparams_t *hp, int max_rows, int max_keys, int n_threads, char *err,
                                 size_t errlen);
#endif
