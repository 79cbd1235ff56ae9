/* engine: the llama forward pass over a cb_model_t, on sequences whose KV lives in a block pool owned by
 * the backend, for prefill (batched GEMMs) and decode (one token, quantized GEMVs); docs/engine.md.
 *
 * Memory. An engine owns its run state (all buffers allocated once in cb_engine_new; nothing is allocated
 * in the forward pass) and the KV pool: the backend allocates K and V of every layer as fixed-size blocks
 * of block_tokens positions (host memory on the CPU, device memory on CUDA), as many as the byte budget
 * holds. A sequence (cb_seq_t, many per engine) owns a block table: position p of the sequence lives in
 * block table[p / block_tokens]. Blocks are reference counted: cb_seq_share gives a sequence the blocks of
 * another's prefix by reference (a system prompt computed once serves every request); a write into a
 * shared block first copies it (copy on write), so sharing never changes what the other sequence reads.
 * A sequence's blocks return to the pool when it is cleared or destroyed. Pool exhaustion is
 * CB_ENGINE_EPOOL from the call that needed a block, never a crash; nothing is half-allocated then.
 * Callers never see a K/V pointer: rows are written, loaded, read and attended through the calls below.
 *
 * Layer-stage primitives. cb_engine_prefill is literally this composition, per ubatch of rows:
 *
 *     cb_engine_embed(e, tokens, n, x);
 *     for l in 0..n_layer-1:
 *         cb_engine_layer_qkv(e, l, x, n, q, k, v);
 *         cb_engine_rope(e, l, q, n, n_head, pos);
 *         cb_engine_rope(e, l, k, n, n_head_kv, pos);
 *         cb_engine_kv_write(e, seq, l, pos, n, k, v);
 *         cb_engine_layer_attn_mlp(e, seq, l, x, q, n, key_limit);    key_limit[i] = pos[i] + 1
 *     cb_engine_logits(e, x[n-1], logits);
 *
 * so a caller composing the same calls (the blend: other positions, subsets of rows, cached K/V loaded
 * at new positions) gets bit-identical results wherever its inputs and row counts are the same. Every
 * primitive takes at most cb_engine_max_rows(e) rows per call (CB_ENGINE_MAX_ROWS); callers with more rows
 * split them (rows are independent in every primitive). Every primitive goes through the backend table
 * (tensor/tensor.h, via engine/backend.h): nothing here calls a kernel directly.
 *
 * Numerics (CPU backend). Calls of up to 8 rows (decode, small blend steps) run as integer matvecs on the
 * stored rows with the activations quantized to int8 per block of 32 (as llama.cpp does); larger calls
 * (prefill) as f32 sgemm over weight tiles dequantized exactly. So a row's result depends on the row count
 * of its call (<= 8 or more, never on the other rows): SmolLM2's prefill and token-by-token decode logits
 * differ by up to ~0.6 (the int8 rounding; llama.cpp's own moves logits by 0.14-0.85), while with
 * CB_ENGINE_WEIGHTS=f32 (the reference: f32 matvecs too) and an f32 KV pool they agree to ~5e-5 and both
 * agree with a double-precision forward pass to ~2e-5 (tests/unit/test_engine.c). The KV pool holds K and V
 * as binary16 by default (kv_dtype, half the memory; each value rounded to nearest even, relative error
 * <= 2^-11, converted back to f32 inside attention), which moves SmolLM2's logits by ~2e-2 against the f32
 * pool (tests/unit/test_kvf16.c); kv_dtype f32 keeps the f32 reference pool. Every bit-identity promise
 * below holds within one weights mode and pool dtype.
 *
 * Threads: one engine is used by one thread at a time, except cb_engine_kv_load, which one other thread
 * may call concurrently for rows of a sequence that no concurrent call touches and whose blocks the
 * sequence already owns exclusively (cb_seq_reserve + no sharing of those rows; the blend's loader).
 */
#ifndef CB_ENGINE_H
#define CB_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"
#include "format/kvfile.h"
#include "model/model.h"

typedef struct cb_engine cb_engine_t;
typedef struct cb_seq cb_seq_t;

#define CB_ENGINE_MAX_ROWS 512   /* rows per primitive call (= the prefill ubatch) */
#define CB_ENGINE_BLOCK_TOKENS 16 /* positions per KV pool block (default) */

/* Results of the calls that can fail for a reason the caller acts on. */
typedef enum {
    CB_ENGINE_OK = 0,
    CB_ENGINE_EINVAL = -1,   /* bad argument (token, position, sizes): nothing was computed */
    CB_ENGINE_EPOOL = -2,    /* the KV pool has no free block (the service answers `overloaded`) */
    CB_ENGINE_EBACKEND = -3  /* the backend failed (device error) */
} cb_engine_status_t;
const char *cb_engine_status_str(int status);

/* The KV pool's value type (config engine.kv_dtype). DEFAULT (the zero of cb_engine_opts_t) means
 * $CB_ENGINE_KV_DTYPE when it is set (f16 or f32; anything else fails cb_engine_new_opts), else F16. The
 * CUDA backend's pool is bf16 whatever is asked, and it rejects F32. */
typedef enum {
    CB_ENGINE_KV_DEFAULT = 0,
    CB_ENGINE_KV_F16,        /* binary16: 2 bytes per value */
    CB_ENGINE_KV_F32         /* the f32 reference: 4 bytes per value */
} cb_engine_kv_dtype_t;
/* "f16" | "f32" (and "default") -> *out; false for anything else (out untouched). */
bool cb_engine_kv_dtype_parse(const char *s, cb_engine_kv_dtype_t *out);
/* "f16", "f32", "default"; "?" otherwise. */
const char *cb_engine_kv_dtype_name(cb_engine_kv_dtype_t dtype);

/* The arithmetic of prefill attention (config engine.attn; tensor.h cb_attn_math_t). DEFAULT (the zero)
 * means $CB_ENGINE_ATTN when set (auto, bf16, int16 or f32; anything else fails cb_engine_new_opts), else
 * AUTO. BF16: blocks of query rows run their products on bf16 tiles with f32 sums where the CPU has
 * AMX-BF16 (q, K, V as hi/lo bf16 pairs, the softmax weights rounded once; ~1.8x the f32 blocks at 8,000
 * tokens). INT16: on int16 pairs with int32 sums where the CPU has AVX512-VNNI (every operand rounded per
 * row to ~13 bits). AUTO: BF16 where the CPU has AMX, else INT16 where it has VNNI, else f32. Where the CPU
 * lacks the one asked, and on CUDA, the backend's own arithmetic. F32: the f32 reference. */
typedef enum {
    CB_ENGINE_ATTN_DEFAULT = 0,
    CB_ENGINE_ATTN_BF16,
    CB_ENGINE_ATTN_F32,
    CB_ENGINE_ATTN_INT16,
    CB_ENGINE_ATTN_AUTO
} cb_engine_attn_t;
/* "auto" | "bf16" | "int16" | "f32" (and "default") -> *out; false for anything else (out untouched). */
bool cb_engine_attn_parse(const char *s, cb_engine_attn_t *out);

typedef struct {
    int max_ctx;             /* positions per sequence, 1..1<<20 */
    size_t kv_pool_bytes;    /* KV pool budget (K and V of every layer); 0 = kv_pool_seqs sequences of max_ctx */
    int block_tokens;        /* positions per block; 0 = CB_ENGINE_BLOCK_TOKENS */
    int kv_pool_seqs;        /* with kv_pool_bytes 0: sequences of max_ctx the pool holds; 0 = 2 */
    cb_engine_kv_dtype_t kv_dtype; /* the pool's values; DEFAULT = $CB_ENGINE_KV_DTYPE, else f16 */
    cb_engine_attn_t attn;   /* prefill attention's arithmetic; DEFAULT = $CB_ENGINE_ATTN, else auto */
} cb_engine_opts_t;

/* Creates an engine: sequences of up to o->max_ctx positions, a KV pool of floor(kv_pool_bytes /
 * block_bytes) blocks (a budget below one block is an error; a pool smaller than one max_ctx sequence is
 * allowed and gives CB_ENGINE_EPOOL when a request does not fit). Threads: $CB_THREADS if set, else one per online
 * CPU. Memory: the pool (2 * n_layer * n_head_kv * head_dim * value bytes per position: 2 for f16 (the
 * default) and bf16 (CUDA), 4 for f32; SmolLM2: 22.5 KiB per position in f16, 45 KiB in f32; reserved address
 * space, touched as blocks are first used), ~15 MB of scratch and a RoPE table of max_ctx * head_dim floats.
 * The backend prepares the model's weights here (tensor.h prepare_weights: on the CPU the interleaved or f32
 * copies, built by the first engine over the model and shared by the others until the last one is destroyed).
 * NULL + err on failure (also for a kv_dtype the backend does not store, or a bad $CB_ENGINE_KV_DTYPE).
 * Caller owns the result (cb_engine_destroy), and destroys every sequence first; the model outlives it. */
cb_engine_t *cb_engine_new_opts(const cb_model_t *model, const cb_engine_opts_t *o, char *err, size_t errlen);
/* The same with the default pool (kv_pool_bytes 0) and block size. */
cb_engine_t *cb_engine_new(const cb_model_t *model, int max_ctx, char *err, size_t errlen);
void cb_engine_destroy(cb_engine_t **self_p);

void cb_engine_set_threads(cb_engine_t *self, int n_threads); /* >= 1 */
int cb_engine_threads(const cb_engine_t *self);
int cb_engine_max_ctx(const cb_engine_t *self);
int cb_engine_max_rows(const cb_engine_t *self);
const cb_model_t *cb_engine_model(const cb_engine_t *self);
const char *cb_engine_backend_name(const cb_engine_t *self);
/* The pool's value type as resolved at creation: CB_ENGINE_KV_F16 or CB_ENGINE_KV_F32 (F16 on CUDA: bf16). */
cb_engine_kv_dtype_t cb_engine_kv_dtype(const cb_engine_t *self);
/* The prefill attention asked for (DEFAULT resolved): AUTO, BF16, INT16 or F32 (what runs is the backend's:
 * cpu_ops.h cb_cpu_attn_name). */
cb_engine_attn_t cb_engine_attn(const cb_engine_t *self);
/* The backend arithmetic (tensor.h cb_attn_math_t) of an attn value: F32, BF16, I16, or AUTO (for AUTO and
 * DEFAULT). */
cb_attn_math_t cb_engine_attn_math(cb_engine_attn_t attn);

/* Pool accounting. */
typedef struct {
    int n_blocks;            /* blocks in the pool */
    int blocks_used;         /* referenced by at least one sequence */
    int blocks_free;         /* n_blocks - blocks_used */
    int blocks_shared;       /* referenced by more than one sequence */
    int block_tokens;
    size_t block_bytes;      /* K + V of every layer of one block: 2 * n_layer * block_tokens * kv_dim * value
                                bytes (2 for an f16 or bf16 pool, 4 for f32) */
    int n_seqs;              /* live sequences */
} cb_engine_pool_stats_t;
void cb_engine_pool_stats(const cb_engine_t *self, cb_engine_pool_stats_t *out);

/* ---- sequences ---- */

/* A new empty sequence (no blocks). NULL when out of host memory. Caller owns it (cb_seq_destroy), before
 * the engine goes. */
cb_seq_t *cb_seq_new(cb_engine_t *engine);
/* Returns the sequence's blocks to the pool, frees it, nulls *self_p. NULL-safe. */
void cb_seq_destroy(cb_seq_t **self_p);
/* Returns every block (the sequence is empty again). */
void cb_seq_clear(cb_seq_t *self);
/* Drops the blocks past position n_pos (positions >= n_pos are forgotten). */
void cb_seq_truncate(cb_seq_t *self, int n_pos);
/* Positions the sequence's blocks cover (a multiple of block_tokens). */
int cb_seq_capacity(const cb_seq_t *self);
int cb_seq_blocks(const cb_seq_t *self);
/* Makes the sequence own blocks for positions [0, n_pos) (n_pos <= max_ctx), and own exclusively (copied
 * if shared) the blocks of positions [from, n_pos), so that writes there need no allocation and no copy
 * (what a concurrent kv_load needs). CB_ENGINE_OK, _EINVAL or _EPOOL (then nothing changed). */
int cb_seq_reserve(cb_seq_t *self, int from, int n_pos);
/* dst (cleared first) takes src's KV of positions [0, n_pos): the whole blocks by reference, a last
 * partial block copied. Both must be of one engine; n_pos <= cb_seq_capacity(src). Status as above. */
int cb_seq_share(cb_seq_t *dst, const cb_seq_t *src, int n_pos);

/* ---- whole passes ---- */

/* Runs tokens [n] at positions pos0..pos0+n-1 of seq (any n >= 1; internally in ubatches of max_rows),
 * writing K/V at those positions. Attention reads the sequence at positions [0, pos + 1): positions below
 * pos0 must have been filled. logits [n_vocab] receives the last row's logits (NULL: skip the LM head).
 * Returns CB_ENGINE_OK, _EINVAL (token out of range, n < 1, pos0 < 0, pos0 + n > max_ctx; nothing is
 * computed) or _EPOOL (no block for the new positions; nothing is computed). */
int cb_engine_prefill(cb_engine_t *self, cb_seq_t *seq, const int32_t *tokens, int n, int pos0, float *logits);
/* The same, also capturing every layer's pre-RoPE K and its V of the n rows: cap_k[l], cap_v[l] (arrays of
 * n_layer host pointers) each [n][n_head_kv*head_dim] f32 (chunk precompute). */
int cb_engine_prefill_capture(cb_engine_t *self, cb_seq_t *seq, const int32_t *tokens, int n, int pos0,
                              float *const *cap_k, float *const *cap_v, float *logits);
/* The same as cb_engine_prefill, with every row's logits: logits_all [n][n_vocab], row i the logits after
 * tokens[i] (each row's LM head as cb_engine_logits computes the last row's: scoring a text, comparing with
 * another engine position by position). */
int cb_engine_prefill_all(cb_engine_t *self, cb_seq_t *seq, const int32_t *tokens, int n, int pos0,
                          float *logits_all);
/* One token at pos; logits [n_vocab] (may be NULL). Same as prefill with n = 1. */
int cb_engine_decode(cb_engine_t *self, cb_seq_t *seq, int32_t token, int pos, float *logits);
/* One decode step of n sequences at once (1..max_rows, all distinct): token tokens[i] at position pos[i] of
 * seqs[i]. The projections, MLP and LM head run once over the n rows (one product per weight, not one per
 * sequence); each row attends its own sequence. logits [n][n_vocab] (NULL: skip the LM head). On a backend
 * with matmul_rowwise and attention_rows (the CPU backend) every row gets the logits cb_engine_decode gives
 * it alone, bit for bit, at any n; elsewhere rows may differ in the last bits. CB_ENGINE_OK, _EINVAL, or _EPOOL (no block for some row's new
 * position; nothing is computed or allocated then). */
int cb_engine_decode_batch(cb_engine_t *self, cb_seq_t *const *seqs, const int32_t *tokens, const int32_t *pos,
                           int n, float *logits);

/* ---- layer-stage primitives (n <= cb_engine_max_rows rows per call; callers validate tokens) ---- */

/* Host buffers for activations from the backend (zeroed; pinned memory on CUDA). NULL on failure. */
void *cb_engine_alloc(cb_engine_t *self, size_t bytes);
void cb_engine_free(cb_engine_t *self, void *p);

/* x [n][n_embd] = embeddings of tokens [n] (each in 0..n_vocab-1). */
void cb_engine_embed(cb_engine_t *self, const int32_t *tokens, int n, float *x);
/* Attention RMSNorm of x, then the Q/K/V projections with the architecture's biases (qwen2) and per-head Q/K
 * norms (qwen3), no RoPE (so k is the pre-RoPE K a KV file stores):
 *   x [n][n_embd] (read only); q [n][n_head*head_dim]; k, v [n][n_head_kv*head_dim]. */
void cb_engine_layer_qkv(cb_engine_t *self, int layer, const float *x, int n, float *q, float *k, float *v);
/* Layer l's RoPE in place (its pairing, base and scaling: model.h cb_rope_t): x [n][n_heads*head_dim], row i
 * to position pos [n] (>= 0). Angles are computed in double, so rotating cached pre-RoPE K to any position is
 * exact and matches the engine bit for bit. */
void cb_engine_rope(cb_engine_t *self, int layer, float *x, int n, int n_heads, const int32_t *pos);
/* Post-RoPE K and V rows k, v [n][n_head_kv*head_dim] into layer l of seq at positions pos [n] (copying a
 * shared block first; allocating blocks up to the largest position). Status. */
int cb_engine_kv_write(cb_engine_t *self, cb_seq_t *seq, int layer, const int32_t *pos, int n, const float *k,
                       const float *v);
/* A layer load: cached pre-RoPE K and V rows k, v [n][n_head_kv*head_dim] in dtype (host memory: a memory-
 * tier entry, a KV file mapping) into layer l of seq at positions pos0..pos0+n-1, K rotated there. The
 * positions must be reserved and owned (cb_seq_reserve): this call never allocates (see Threads). Status. */
int cb_engine_kv_load(cb_engine_t *self, cb_seq_t *seq, int layer, int pos0, int n, const void *k, const void *v,
                      cb_kv_dtype_t dtype);
/* Whether cb_engine_kv_load and cb_engine_kv_deviation take rows of dtype: the element dtypes always, q8_0
 * where the backend dequantizes it in the load (tensor.h kv_load_q8_0). */
bool cb_engine_kv_load_takes(const cb_engine_t *self, cb_kv_dtype_t dtype);
/* Layer l of seq at positions pos0..pos0+n-1 back as f32 (post-RoPE K): k, v [n][n_head_kv*head_dim] (either
 * may be NULL). For tests and diagnostics. Status. */
int cb_engine_kv_read(cb_engine_t *self, const cb_seq_t *seq, int layer, int pos0, int n, float *k, float *v);
/* Attention of q (post-RoPE) [n][n_head*head_dim] against layer l of seq, row i over positions
 * [0, key_limit[i]) (exact causal = pos+1, never a bottom-right mask; within the sequence's capacity; on a
 * layer with a sliding window only the last window of them), then o_proj (post-norm) + residual into x, FFN
 * RMSNorm, gated MLP (post-norm) + residual into x:  x [n][n_embd] in/out. */
void cb_engine_layer_attn_mlp(cb_engine_t *self, const cb_seq_t *seq, int layer, float *x, const float *q, int n,
                              const int32_t *key_limit);
/* The same over some of seq's blocks: the keys are the positions of blocks blk [n_blk] (indices into seq's
 * block table, each < cb_seq_blocks) laid end to end in that order, block_tokens each; row i attends the
 * first key_limit[i] of them (1..n_blk * block_tokens). K is stored rotated, so the scores are those of the
 * true positions whatever the order. Sparse attention (the blend's sparse_keys); layers without a sliding
 * window only (the key indices here are not positions). */
void cb_engine_layer_attn_mlp_blocks(cb_engine_t *self, const cb_seq_t *seq, int layer, float *x, const float *q,
                                     int n, const int32_t *blk, int n_blk, const int32_t *key_limit);
/* Attention mass of q [n][n_head*head_dim] over layer l of seq (tensor.h attn_mass): mass [>= max
 * key_limit] accumulated. Status. */
int cb_engine_attn_mass(cb_engine_t *self, const cb_seq_t *seq, int layer, const float *q, int n,
                        const int32_t *key_limit, float *mass);
/* cb_engine_layer_attn_mlp of n <= max_rows rows whose attention comes with their mass (as
 * cb_engine_attn_mass adds it) from one backend call (attn_mass with out; on the CPU in f32 whatever
 * engine.attn). Status. */
int cb_engine_layer_attn_mass_mlp(cb_engine_t *self, const cb_seq_t *seq, int layer, float *x, const float *q, int n,
                                  const int32_t *key_limit, float *mass);
/* KV deviation (tensor.h kv_deviation) of fresh [n][n_head_kv*head_dim] against cached row pointers [n]
 * in dtype: dev [n]. Status. */
int cb_engine_kv_deviation(cb_engine_t *self, int n, const float *fresh, const void *const *cached,
                           cb_kv_dtype_t dtype, double *dev);
/* Top-k (tensor.h topk): out [min(k, n)]. Status. */
int cb_engine_topk(cb_engine_t *self, int n, const double *score, int k, int32_t *out);
/* Row compaction (tensor.h compact_rows). */
void cb_engine_compact_rows(cb_engine_t *self, float *x, size_t row_len, const int32_t *keep, int n_keep);
/* Final RMSNorm + LM head of one row: x_row [n_embd] -> logits [n_vocab]. */
void cb_engine_logits(cb_engine_t *self, const float *x_row, float *logits);
#endif
