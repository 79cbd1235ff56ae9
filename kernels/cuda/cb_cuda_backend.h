/* cb_cuda_backend: a CUDA instance of engine/backend.h's operation table (cb_backend_ops_t).
 *
 * What lives on the device: the KV pool (kv_pool_init: bf16, K and V each [n_layer][n_blocks]
 * [block_tokens][kv_dim], so the blocks of one layer are contiguous), the bf16 weights (dequantized once,
 * on first use, cached by their storage address cb_weight_t.q, which must stay valid: the model outlives
 * the backend) and fixed scratch sized at creation for max_rows rows and max_keys keys (plus, at
 * kv_pool_init, a gather area of max_keys rows). K/V never cross the host on the hot path: kv_write and
 * kv_load scatter rows into the pool (kv_load converts f32/f16/bf16 and rotates pre-RoPE K on the device),
 * attention and attn_mass read a layer's rows in place when the table's blocks are consecutive and
 * otherwise through one device-to-device gather of its blocks (under a sliding window, only the blocks from
 * the one holding the call's lowest first key on); kv_copy_block is device to device.
 *
 * What still round-trips: activations. The table's contract keeps them in host buffers (host_alloc gives
 * pinned memory), so every dense operation (matmul, rmsnorm, rope, attention's q and output, swiglu, geglu,
 * scale, add, add_bias, embed) copies its inputs in and its outputs out, computing in bf16 operands with f32
 * accumulation (the CUDA backend's precision; add, add_bias and scale are f32 throughout).
 * Weights of F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K are dequantized to bf16. rope and kv_load's
 * re-rotation take the layer's cb_rope_t (NORM or NEOX pairing, base, linear scaling, Llama 3 frequency
 * factors); the factors, a host tensor of the model, are copied to the device once per tensor address, so,
 * like the weights, they must outlive the backend. kv_deviation, topk and compact_rows run on the host: their
 * inputs are host memory by that same contract (see the .cu for why that is also the cheaper place), and
 * there they give the CPU reference's results bit for bit. The fully device-resident schedules (prefill,
 * decode) are cb_cuda_llama.h.
 *
 * Every operation ends synchronized: outputs are in host memory and host inputs have been read when it
 * returns. Threads: one mutex serializes the operations, so kv_load may come from the blend's loader
 * thread while another thread runs the others (backend.h); the device is made current on each call.
 *
 * Failure: void operations print the CUDA error once to stderr, fill their outputs with NaN and make
 * cb_backend_cuda_failed() true; int operations return -1 (bad arguments leave the backend usable; a
 * device error marks it failed). After a failure the owner should destroy the backend and fall back to
 * the CPU one. kv_pool_init reports a pool that does not fit the device with its size and the driver's
 * out-of-memory message. Available only when CB_HAVE_CUDA.
 */
#ifndef CB_CUDA_BACKEND_H
#define CB_CUDA_BACKEND_H

#include <stdbool.h>
#include <stddef.h>

#include "tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A CUDA backend on `device` for model geometry hp: up to max_rows rows per call, attention over up to
 * max_keys keys. NULL with a message when there is no device or memory is short. The pool comes later
 * (ops->kv_pool_init). Caller owns the result: cb_backend_destroy (backend.h). */
cb_backend_t *cb_backend_cuda_new(const cb_hparams_t *hp, int max_rows, int max_keys, int device, char *err,
                                  size_t errlen);
/* True once any operation of this (CUDA) backend has failed. */
bool cb_backend_cuda_failed(const cb_backend_t *be);

#ifdef __cplusplus
}
#endif
#endif
