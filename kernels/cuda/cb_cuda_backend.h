/* cb_cuda_backend: a CUDA instance of libshared/backend.h's operation table (cb_backend_ops_t).
 *
 * The table's contract is host memory: the engine owns f32 buffers and its KV cache in host memory and
 * passes them to every operation. This backend therefore copies each operation's inputs to the device,
 * computes with the cb_cuda kernels (bf16 operands, f32 accumulation — the CUDA backend's precision per
 * DESIGN.md §5) and copies the outputs back: a drop-in for correctness (the GPU tests run it against the
 * CPU backend op by op), not for speed. Weight matrices are dequantized to bf16 on the device once, on
 * first use, and cached by their storage address (cb_weight_t.q), which must stay valid (the model
 * outlives the backend). The fast path keeps every buffer on the device: cb_cuda_llama.h (whole forward
 * and blend on the GPU), or a future table with device buffers (see the report in the issue notes).
 *
 * Operations return void (the table's signature): a CUDA failure is printed once to stderr, the
 * operation's outputs are filled with NaN, and cb_backend_cuda_failed() turns true; the owner should
 * then destroy the backend and fall back to the CPU one. Available only when CB_HAVE_CUDA.
 */
#ifndef CB_CUDA_BACKEND_H
#define CB_CUDA_BACKEND_H

#include <stdbool.h>
#include <stddef.h>

#include "engine/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A CUDA backend on `device` for model geometry hp: up to max_rows rows per call, attention over up to
 * max_keys keys. NULL with a message when there is no device or memory is short. Destroy with
 * cb_backend_destroy (backend.h). */
cb_backend_t *cb_backend_cuda_new(const cb_hparams_t *hp, int max_rows, int max_keys, int device, char *err,
                                  size_t errlen);
/* True once any operation of this (CUDA) backend has failed. */
bool cb_backend_cuda_failed(const cb_backend_t *be);

#ifdef __cplusplus
}
#endif
#endif
