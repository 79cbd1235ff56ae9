/* engine: the llama forward pass over a cb_model_t, with a KV cache, for prefill (batched GEMMs) and
 * decode (one token, quantized GEMVs); REFERENCE.md §12.
 *
 * An engine owns its run state (all buffers allocated once in cb_engine_new; nothing is allocated in
 * the forward pass) and a KV cache of max_ctx positions per layer holding post-RoPE K and V in f32.
 * The model is borrowed and must outlive the engine. One engine is used by one thread at a time (the
 * calls themselves run on the engine's own pool of cb_engine_set_threads threads).
 *
 * Layer-stage primitives. cb_engine_prefill is literally this composition, per ubatch of rows:
 *
 *     cb_engine_embed(e, tokens, n, x);
 *     for l in 0..n_layer-1:
 *         cb_engine_layer_qkv(e, l, x, n, q, k, v);
 *         cb_rope(q, n, n_head, head_dim, pos, rope_base);
 *         cb_rope(k, n, n_head_kv, head_dim, pos, rope_base);
 *         copy k[i], v[i] into cb_engine_kcache(e, l), cb_engine_vcache(e, l) at row pos[i];
 *         cb_engine_layer_attn_mlp(e, l, x, q, n, key_limit);    key_limit[i] = pos[i] + 1
 *     cb_engine_logits(e, x[n-1], logits);
 *
 * so a caller composing the same calls (the blend: other positions, subsets of rows, cached K/V
 * rotated to new positions) gets bit-identical results wherever its inputs and row counts are the same.
 * Every primitive takes at most cb_engine_max_rows(e) rows per call (CB_ENGINE_MAX_ROWS); callers
 * with more rows split them (rows are independent in every primitive).
 *
 * Numerics: f32 throughout, weights dequantized exactly. Calls of up to 8 rows run as matvecs over
 * the quantized rows, larger ones as sgemm over f32 copies, so a row's result can differ in the last
 * bits with the row count of its call: prefill and token-by-token decode logits agree to ~5e-5, and
 * both agree with a double-precision forward pass to ~4e-5 (tests/unit/test_engine.c).
 */
#ifndef CB_ENGINE_H
#define CB_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

typedef struct cb_engine cb_engine_t;

#define CB_ENGINE_MAX_ROWS 512 /* rows per primitive call (= the prefill ubatch) */

/* Creates an engine with a KV cache of max_ctx positions (1..n_ctx_train is sensible; up to 1<<20
 * accepted). Threads: $CB_THREADS if set, else one per online CPU. Memory: 2 * n_layer * max_ctx *
 * n_head_kv * head_dim * 4 bytes of KV (45 KiB per position for SmolLM2: 369 MB at 8192) plus ~15 MB
 * of scratch and a RoPE table of max_ctx * head_dim floats. NULL + err on failure.
 * Caller owns the result (cb_engine_destroy). */
cb_engine_t *cb_engine_new(const cb_model_t *model, int max_ctx, char *err, size_t errlen);
void cb_engine_destroy(cb_engine_t **self_p);

void cb_engine_set_threads(cb_engine_t *self, int n_threads); /* >= 1 */
int cb_engine_threads(const cb_engine_t *self);
int cb_engine_max_ctx(const cb_engine_t *self);
int cb_engine_max_rows(const cb_engine_t *self);
const cb_model_t *cb_engine_model(const cb_engine_t *self);

/* Runs tokens [n] at positions pos0..pos0+n-1 (any n >= 1; internally in ubatches of max_rows),
 * writing K/V at those positions. Attention reads the cache at positions [0, pos + 1): positions below
 * pos0 must have been filled (by earlier calls or by the caller). logits [n_vocab] receives the last
 * row's logits (NULL: skip the LM head). Returns 0, or -1 on a bad argument (token out of range,
 * n < 1, pos0 < 0, pos0 + n > max_ctx): nothing is computed then. */
int cb_engine_prefill(cb_engine_t *self, const int32_t *tokens, int n, int pos0, float *logits);
/* One token at pos; logits [n_vocab] (may be NULL). Same as prefill with n = 1. 0 or -1. */
int cb_engine_decode(cb_engine_t *self, int32_t token, int pos, float *logits);

/* KV cache of layer l: [max_ctx][n_head_kv*head_dim] f32, row p = position p; K is post-RoPE.
 * Owned by the engine; callers may read and write rows (the blend fills reused rows here). */
float *cb_engine_kcache(cb_engine_t *self, int layer);
float *cb_engine_vcache(cb_engine_t *self, int layer);

/* ---- layer-stage primitives (n <= cb_engine_max_rows rows per call; callers validate tokens) ---- */

/* x [n][n_embd] = embeddings of tokens [n] (each in 0..n_vocab-1). */
void cb_engine_embed(cb_engine_t *self, const int32_t *tokens, int n, float *x);
/* Attention RMSNorm of x, then the Q/K/V projections (no RoPE):
 *   x [n][n_embd] (read only); q [n][n_head*head_dim]; k, v [n][n_head_kv*head_dim]. */
void cb_engine_layer_qkv(cb_engine_t *self, int layer, const float *x, int n, float *q, float *k, float *v);
/* Attention of q (post-RoPE) [n][n_head*head_dim] against layer l's KV cache, row i over cache rows
 * [0, key_limit[i]) (1..max_ctx; exact causal = pos+1, never a bottom-right mask), then o_proj +
 * residual into x, FFN RMSNorm, SwiGLU MLP + residual into x:  x [n][n_embd] in/out. */
void cb_engine_layer_attn_mlp(cb_engine_t *self, int layer, float *x, const float *q, int n,
                              const int32_t *key_limit);
/* Final RMSNorm + LM head of one row: x_row [n_embd] -> logits [n_vocab]. */
void cb_engine_logits(cb_engine_t *self, const float *x_row, float *logits);

/* NORM ("adjacent pair", llama GGUF; REFERENCE.md §6) RoPE in place: x [n][n_heads*head_dim], pair
 * (x[2i], x[2i+1]) of each head rotated by pos[r] * base^(-2i/head_dim). Angles are computed in
 * double, so rotating cached pre-RoPE K to any position is exact and matches the engine bit for bit. */
void cb_rope(float *x, int n, int n_heads, int head_dim, const int32_t *pos, float base);
#endif
