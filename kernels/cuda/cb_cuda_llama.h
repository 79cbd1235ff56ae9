/* cb_cuda_llama: a llama model resident on one GPU (bf16 weights with fused QKV and gate/up matrices,
 * a bf16 KV cache, activations sized once) and its forward schedules, composed from cb_cuda.h:
 *
 *   prefill      full prefill of n tokens (layer by layer, rows in chunks of max_rows), optionally
 *                capturing each layer's pre-RoPE K and V;
 *   decode       one token at a device-resident position, greedy or top-p on the device; every call
 *                is graph-capturable (cb_cuda_graph_begin/end around it).
 *
 * These are the device-resident reference schedules the GPU benchmark measures against the hardware
 * (prefill vs the cuBLAS GEMM rate, decode vs the HBM bound). CacheBlend is not here: the one CacheBlend
 * is libshared/blend, which runs on the GPU through the CUDA backend (cb_cuda_backend.h).
 *
 * Everything is enqueued on the context's compute stream; results (tokens, logits) are device memory.
 * One model is used by one thread at a time. Available only when CB_HAVE_CUDA.
 */
#ifndef CB_CUDA_LLAMA_H
#define CB_CUDA_LLAMA_H

#include "cuda/cb_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cb_cuda_llama cb_cuda_llama_t;

typedef struct {
    int n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab;
    float rope_base, rms_eps;   /* RoPE is llama's plain NORM rotation of that base (no scaling, no factors) */
    bool tied;              /* the LM head is token_embd */
} cb_cuda_llama_hp_t;

/* Weight kinds (same order as libshared/synth.h's cb_synth_kind_t). */
typedef enum {
    CB_CL_TOKEN_EMBD = 0, CB_CL_OUTPUT_NORM, CB_CL_OUTPUT,
    CB_CL_ATTN_NORM, CB_CL_Q, CB_CL_K, CB_CL_V, CB_CL_O, CB_CL_FFN_NORM, CB_CL_GATE, CB_CL_UP, CB_CL_DOWN
} cb_cl_kind_t;

/* Allocates weights (uninitialized), a KV cache of max_ctx positions, residual streams of max_ctx rows
 * and GEMM activations of max_rows rows. NULL with a message on failure (CB_CUDA_EOOM included). */
cb_cuda_llama_t *cb_cuda_llama_new(cb_cuda_t *cu, const cb_cuda_llama_hp_t *hp, int max_ctx, int max_rows,
                                   char *err, size_t errlen);
void cb_cuda_llama_destroy(cb_cuda_llama_t **self_p);
const cb_cuda_llama_hp_t *cb_cuda_llama_hparams(const cb_cuda_llama_t *self);
size_t cb_cuda_llama_weight_bytes(const cb_cuda_llama_t *self);   /* device bytes of all weights */

/* Where a weight lives: matrices are bf16 [rows][cols] (row-major [out][in]), norms f32 [n_embd].
 * Returns the device pointer (NULL for an unknown kind/layer, or OUTPUT of a tied model) and its dims.
 * Fill matrices with cb_cuda_synth_fill or cb_cuda_llama_upload. */
void *cb_cuda_llama_weight(cb_cuda_llama_t *self, int layer, cb_cl_kind_t kind, int *rows, int *cols);
/* Dequantizes a GGUF tensor (host data, ggml type) into a weight (synchronous). */
int cb_cuda_llama_upload(cb_cuda_llama_t *self, int layer, cb_cl_kind_t kind, uint32_t gguf_type, const void *host);

/* Device buffers a caller may use for requests: tokens int32 [max_ctx]. */
int32_t *cb_cuda_llama_tokens(cb_cuda_llama_t *self);
/* The KV cache of a layer: K (post-RoPE) and V, bf16 [max_ctx][n_head_kv*head_dim]. */
cb_bf16_t *cb_cuda_llama_kcache(cb_cuda_llama_t *self, int layer);
cb_bf16_t *cb_cuda_llama_vcache(cb_cuda_llama_t *self, int layer);
/* Logits of the last computed row: device f32 [n_vocab]. */
float *cb_cuda_llama_logits(cb_cuda_llama_t *self);

/* Full prefill of tokens (device int32 [n]) at positions pos0..pos0+n-1; K/V rows [0, pos0) must hold
 * earlier context. Writes K/V, the last row's logits and its greedy token to out_token (device int32,
 * may be NULL). cap_k/cap_v (host arrays of n_layer device pointers, or NULL): each layer's pre-RoPE K
 * and its V are also written there, [n][n_head_kv*head_dim] (chunk precompute). */
int cb_cuda_llama_prefill(cb_cuda_llama_t *self, const int32_t *tokens, int n, int pos0, cb_bf16_t *const *cap_k,
                          cb_bf16_t *const *cap_v, int32_t *out_token);

/* One decode step: token (device int32 [1]) at position pos (device int32 [1]); writes K/V at pos,
 * samples the next token into token (greedy when temperature <= 0; rng device uint64 [1], may be NULL
 * for greedy) and increments pos. max_limit: host upper bound of pos+1 (sizes split-K; a captured graph
 * passes the cache capacity). */
int cb_cuda_llama_decode(cb_cuda_llama_t *self, int32_t *token, int32_t *pos, int max_limit, float temperature,
                         float top_p, uint64_t *rng);

#ifdef __cplusplus
}
#endif
#endif
