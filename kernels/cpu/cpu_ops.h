/* cpu_ops: the f32 CPU kernels of the engine (the reference backend, see tensor/tensor.h); the KV pool they read
 * holds f32 or binary16 values (cb_cpu_kv_t), the arithmetic is f32 either way.
 *
 * Plain functions over host buffers; every shape is in the comment. Threading: functions with a `pool`
 * argument split their work into tasks on that cpu_pool (NULL = the calling thread only); BLAS calls run
 * on one OpenBLAS thread each (cb_cpu_init sets this), so the only threads are the pool's.
 * AVX-512 paths are compiled when the compiler targets AVX-512 (-march=native here), with portable
 * scalar code otherwise; both compute the same values up to summation order.
 * Implemented by cpu_ops.c (setup, small ops, dequantization, matrix products), cpu_attn.c (f32 attention,
 * KV conversions, attention mass), cpu_attn_decode.c (split-key decode, decode batches), cpu_attn_amx.c and
 * cpu_attn_i16.c (the bf16 and int16 prefill blocks) and cpu_blend_host.c (the host-side CacheBlend
 * operations), which share the private cpu_ops_internal.h.
 */
#ifndef CB_CPU_OPS_H
#define CB_CPU_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "format/kvfile.h"
#include "cpu/cpu_pool.h"
#include "tensor/tensor.h"

#ifdef __cplusplus
extern "C" { /* the CUDA backend shares the host-side operations below */
#endif

/* One-time process setup, idempotent and thread-safe: picks an AVX-512/AVX2 OpenBLAS kernel set when
 * OpenBLAS's runtime detection does not know this CPU (0.3.21 falls back to Prescott kernels on
 * Emerald Rapids, 4-5x slower) and OPENBLAS_CORETYPE is not set, and makes OpenBLAS single-threaded
 * (we parallelise around it with OpenMP). Returns the OpenBLAS core name in use. */
const char *cb_cpu_init(void);

/* Buffer allocation for weights, KV cache and scratch: from 4 MiB up 2 MiB aligned and advised for
 * transparent huge pages (fewer page faults and TLB misses), smaller ones 64-byte aligned; zero-filled
 * when zero is true. Free with free(). NULL on failure. */
void *cb_cpu_alloc_huge(size_t bytes, bool zero);

/* y[i][:] = x[i][:] / sqrt(mean(x[i]^2) + eps) * w[:]; x [n][dim], w [dim], y [n][dim] (y may be x). */
void cb_cpu_rmsnorm(const float *x, const float *w, int n, int dim, float eps, float *y);

/* RoPE coefficients of one position under r (tensor.h cb_rope_t): cs[2i] = cos(theta_i), cs[2i+1] = sin(theta_i),
 * theta_i = pos * freq_scale * base^(-2i/n_dims) / freq_factors[i], for i in 0..n_dims/2-1; computed in double
 * then rounded, so every caller gets bit-identical values. */
void cb_cpu_rope_coeffs(int32_t pos, const cb_rope_t *r, float *cs /* [r->n_dims] */);
/* Rotation of x [n][n_heads*head_dim] in place with per-row coefficients cs [n][head_dim] (from
 * cb_cpu_rope_coeffs): pair i is (x[2i], x[2i+1]) for NORM, (x[i], x[i + head_dim/2]) for NEOX. */
void cb_cpu_rope_apply(float *x, int n, int n_heads, int head_dim, cb_rope_type_t type, const float *cs);
/* Convenience: coefficients computed per row from pos [n] (same values as a table would hold);
 * x [n][n_heads*r->n_dims]. */
void cb_cpu_rope(float *x, int n, int n_heads, const int32_t *pos, const cb_rope_t *r);
/* x[i][j] += b[j]:  x [n][dim], b [dim]. */
void cb_cpu_add_bias(float *x, const float *b, int n, int dim);

/* out[i] = silu(gate[i]) * up[i] over n elements (out may alias gate or up). */
void cb_cpu_swiglu(const float *gate, const float *up, size_t n, float *out);
/* out = gelu(gate) * up, GELU's tanh form (tensor.h geglu); out may alias either input. */
void cb_cpu_geglu(const float *gate, const float *up, size_t n, float *out);
/* x *= a over n. */
void cb_cpu_scale(float *x, size_t n, float a);
/* x[i] += y[i] over n elements. */
void cb_cpu_add(float *x, const float *y, size_t n);

/* Dequantizes one stored row of w into dst [w->cols]; bit-identical to cb_dequant. */
void cb_cpu_dequant_row(const cb_weight_t *w, int row, float *dst);
/* Embedding gather: x[i][:] = dequantized row tokens[i] of table; x [n][table->cols]. Tokens must be
 * valid row indices (checked by the caller). */
void cb_cpu_embed(const cb_weight_t *table, const int32_t *tokens, int n, float *x);

/* Scratch of the matrix products, owned by the caller (the backend context), sized for max_rows activation
 * rows of up to max_cols columns on nt pool threads. */
typedef struct {
    float *rows;             /* [nt][max_cols] row buffers (dequantized rows of types without an integer kernel) */
    uint8_t *xq;             /* [max_rows][cb_cpu_q8_row_bytes(max_cols)] the call's quantized activations */
    int max_rows, max_cols;
    float *tiles;            /* [nt][tile_floats] dequantized weight tiles of the GEMMs */
    size_t tile_floats;      /* >= max_cols */
} cb_cpu_mm_scratch_t;
/* Default tile of dequantized weight rows per thread: 2 MiB of floats (the GEMM packs it anyway; smaller
 * tiles measured slower, larger no faster). */
#define CB_CPU_TILE_FLOATS ((size_t)512 * 1024)

/* y[i][o] = sum_j w[o][j] x[i][j] for n rows (1..s->max_rows): with the integer kernels of cpu_quant.h on
 * the stored rows (x quantized per block to int8 once per call) for every type that has one, else in f32
 * over w->f32 (when the model kept a copy: the f32 reference), an F32 tensor, or rows dequantized one at a
 * time.
 * A row's result is the same bits whatever n and whichever rows share the call. x [n][cols], y [n][ldy]. */
void cb_cpu_matvec(const cb_weight_t *w, const float *x, int n, float *y, int ldy, const cb_cpu_mm_scratch_t *s,
                   cb_pool_t *pool);
/* The backend's matmul runs calls of up to CB_CPU_MATVEC_MAX_ROWS rows as matvecs and larger ones as GEMMs
 * (prefill and the blend keep their numerics by this split); its matmul_rowwise (decode batches) is matvec
 * for any n. */
#define CB_CPU_MATVEC_MAX_ROWS 8
/* Y = X · Wᵀ in f32 by OpenBLAS sgemm: over w->f32 when the model kept it, else over tiles of s->tile_floats
 * dequantized weight rows per thread (the exact weight values: no copy of the matrix is kept), the pool's
 * threads each computing slices of the output columns. x [n][cols], y [n][ldy] (ldy >= rows). */
void cb_cpu_gemm(const cb_weight_t *w, const float *x, int n, float *y, int ldy, const cb_cpu_mm_scratch_t *s,
                 cb_pool_t *pool);

/* Several products of one x [n][cols] in one pool run (every part has the same cols): parts[i].y [n][ldy] =
 * x · parts[i].wᵀ, as cb_cpu_gemm (gemm = true) or as cb_cpu_matvec (any n up to s->max_rows). */
void cb_cpu_matmul_multi(const cb_matmul_part_t *parts, int n_parts, const float *x, int n, bool gemm,
                         const cb_cpu_mm_scratch_t *s, cb_pool_t *pool);

/* A sequence's K/V of one layer in the pool: position p is row blocks[p / block_tokens] * block_tokens +
 * p % block_tokens of k and v (rows of n_head_kv*head_dim values of dtype, post-RoPE K). Kernels walk runs
 * of positions whose rows follow each other (consecutive block ids) as one strided range, so a sequence whose
 * blocks are consecutive costs nothing extra; results do not depend on how the rows are placed.
 * dtype CB_KV_F32: the kernels read the rows in place. CB_KV_F16 (binary16): they convert K and V to f32
 * inside the kernel, a chunk of keys at a time into the thread's scratch (while gathering the rows), and run
 * the f32 arithmetic on the converted values: the conversion is exact, so every promise below (rows
 * independent, bits independent of placement and of the other rows of a decode batch) holds for f16 too, and
 * an f16 pool gives the bits an f32 pool holding the same f16-rounded values would give. */
typedef struct {
    const void *k, *v;         /* the layer's pool: [n_blocks * block_tokens][kv_dim] of dtype */
    const int32_t *blocks;     /* block table: [>= ceil(max key_limit / block_tokens)] */
    int block_tokens;
    cb_kv_dtype_t dtype;       /* CB_KV_F32 (0, what a zero-initialised view means) or CB_KV_F16 */
} cb_cpu_kv_t;

/* n values of a KV payload (dtype) as f32 (F16C / AVX-512 conversion where available); bit-identical to
 * kvfile's conversion. CB_KV_Q8_0: src starts at a block (f16 d, 32 int8: 34 bytes) and n % 32 == 0. */
void cb_cpu_kv_to_f32(cb_kv_dtype_t dtype, const void *src, float *dst, size_t n);
/* n f32 values to binary16, rounding to nearest even (F16C / AVX-512 where available, the portable
 * cb_f32_to_f16 for the rest): bit-identical to cb_f32_to_f16 (format/quant.h) for every input, NaN included. */
void cb_cpu_f32_to_f16(const float *src, uint16_t *dst, size_t n);

/* True when this CPU runs the bf16 prefill blocks (g->math = CB_ATTN_BF16: AVX512-BF16, a build with AVX-512).
 * Elsewhere, and for head_dim % 32 != 0, CB_ATTN_BF16 calls run the f32 blocks. */
bool cb_cpu_attn_bf16_supported(void);
/* True when this CPU runs the int16 prefill blocks (g->math = CB_ATTN_I16: AVX512-VNNI and -BW, a build with
 * AVX-512). Elsewhere, and for head_dim % 64 != 0 or > 256, CB_ATTN_I16 calls run the f32 blocks. */
bool cb_cpu_attn_i16_supported(void);
/* What an asked arithmetic runs as on this CPU (CB_ATTN_AUTO resolved: bf16 where AMX-BF16 is, else int16
 * where AVX512-VNNI is, else f32; an unsupported one as f32), and its name ("bf16 (AMX)", "int16 (VNNI)",
 * "f32", or "f32 (no AMX)", "f32 (no VNNI)", "f32 (no AMX or VNNI)" for a faster one asked that this CPU
 * lacks). */
cb_attn_math_t cb_cpu_attn_math(cb_attn_math_t asked);
const char *cb_cpu_attn_name(cb_attn_math_t asked);

/* Scratch floats needed by cb_cpu_attention for max_rows rows against max_keys keys with nt pool threads. */
size_t cb_cpu_attention_scratch(const cb_attn_geom_t *g, int max_rows, int max_keys, int nt);
/* out[i] = softmax(q[i]·Kᵀ · scale over keys [0, key_limit[i])) · V, per head:
 *   q   [n][n_head*head_dim]      (post-RoPE)
 *   kv  the layer's keys and values: position j through the block table
 *   key_limit [n], each in 1..max_keys
 *   out [n][n_head*head_dim]
 * Rows are independent: any limits, in any order (exact causal = pos+1). Blocks of rows run as
 * GEMMs (Q·Kᵀ, P·V) over chunks of 512 keys up to the largest limit in the block, masked per row (a chunk
 * spanning non-consecutive pool blocks is gathered first: the same values, bit for bit; an f16 pool's chunk
 * is always gathered, converted to f32 on the way).
 * g->math = CB_ATTN_BF16 (and cb_cpu_attn_bf16_supported()): the blocks (calls of more than 4 rows) run
 * their products on the AMX tile unit, every sum in f32: q·scale, K and V as hi/lo bf16 pairs (K and V, f16
 * or f32 values, to 16 bits: f16 exactly), the softmax weights rounded once to bf16 (8 significant bits,
 * nearest even; the weights' sum is that of the rounded weights). Against the exact attention a row's output
 * differs by at most ~2^-8 · max |v| (the weights' rounding) plus ~2^-10 · max |v| (the scores' 2^-16)
 * plus f32 rounding (tests/unit/test_engine.c checks this bound). Rows stay independent, and their bits do not depend on
 * placement, but they do depend on the call's size (1-4 rows run f32).
 * g->math = CB_ATTN_I16 (or AUTO without AMX; cb_cpu_attn_i16_supported()): the blocks run both products as
 * int16 pairs with int32 sums (vpdpwssd): q·scale and K rounded per row to floor(sqrt(2^31 / head_dim))
 * steps of the row's largest |value|, V per key and the softmax weights per row and chunk to 5792 steps;
 * the weights' sum is the f32 sum of the unrounded exp (bounds: test_attention_i16). Independence and
 * placement as for bf16. */
void cb_cpu_attention(const cb_attn_geom_t *g, const float *q, int n, const cb_cpu_kv_t *kv, const int32_t *key_limit,
                      float *out, float *scratch, int max_keys, cb_pool_t *pool);

/* Decode rows of different sequences: row i attends its own block table t[i] of the layer's pool (pool->k,
 * pool->v, pool->dtype, pool->block_tokens; pool->blocks is not used) over keys [0, key_limit[i]), each in
 * 1..max_keys; q, out [n][n_head*head_dim]. Row i gets the bits a one-row cb_cpu_attention call on the same
 * pool and threads gives it, whatever the other rows; the work of up to 16 rows is one pool run, each chunk
 * of keys read once for all heads (an f16 piece converted once for all heads). Same scratch as
 * cb_cpu_attention. */
void cb_cpu_attention_rows(const cb_attn_geom_t *g, const float *q, int n, const cb_cpu_kv_t *pool,
                           const cb_kv_table_t *t, const int32_t *key_limit, float *out, float *scratch, int max_keys,
                           cb_pool_t *pool_threads);

/* Attention mass, for query-aware selection (blend.h, metric 'a'): for each of the n query rows and each
 * head, the softmax probabilities over keys [0, key_limit[i]) (as cb_cpu_attention computes them) are
 * added to mass [key], so every row adds n_head in all; with out, also the rows' attention output (those
 * probabilities times V, f32 GEMMs whatever g->math).
 *   q [n][n_head*head_dim] (post-RoPE), kv the layer's keys and values (post-RoPE K),
 *   key_limit [n], mass [>= max key_limit] (accumulated, not cleared), out NULL or [n][n_head*head_dim]
 *   scratch: cb_cpu_attn_mass_scratch(g, max_keys) floats; pool: NULL (this thread) or the threads
 * One task per KV head: rows go CB_CPU_MASS_ROWS at a time as one GEMM over keys [0, max limit) (in place,
 * or gathered when the rows are not one run or the pool is f16, converted on the way); the heads' masses
 * are added in head order, so the bits do not depend on the pool. */
#define CB_CPU_MASS_ROWS 16
size_t cb_cpu_attn_mass_scratch(const cb_attn_geom_t *g, int max_keys);
void cb_cpu_attn_mass(const cb_attn_geom_t *g, const float *q, int n, const cb_cpu_kv_t *kv, const int32_t *key_limit,
                      float *mass, float *out, float *scratch, cb_pool_t *pool);

/* The host-side CacheBlend operations of the backend table (tensor.h: kv_deviation, topk, compact_rows),
 * written once for every backend whose scores and activations are host buffers.
 * dev[i] = sum_j (fresh[i][j] - f32(cached[i][j]))^2 over j < width in double, j in order; fresh [n][width],
 * cached [n] row pointers in dtype (CB_KV_Q8_0: rows of width % 32 == 0, each starting at a block); row: [width]
 * floats of scratch. 0, or -1 for a bad dtype. */
int cb_cpu_kv_deviation(int n, int width, const float *fresh, const void *const *cached, cb_kv_dtype_t dtype,
                        double *dev, float *row);
/* out [min(k, n)] = indices of the k largest score [n], NaN first, ties to the lower index; idx: [n] scratch. */
void cb_cpu_topk(int n, const double *score, int k, int32_t *out, int32_t *idx);
/* x[i] = x[keep[i]] for i < n_keep (rows of row_len floats; keep ascending, keep[i] >= i). */
void cb_cpu_compact_rows(float *x, size_t row_len, const int32_t *keep, int n_keep);

/* Vectorised expf used by the kernels (exposed for tests): dst[i] = exp(src[i]), |rel err| < 2e-7. */
void cb_cpu_exp(const float *src, float *dst, size_t n);
#ifdef __cplusplus
}
#endif
#endif
