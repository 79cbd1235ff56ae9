/* cb_cuda: the CUDA compute layer of cacheblend, as a plain C API (callable from C11).
 *
 * What it owns: one device context (a compute stream, a copy stream for host->device loads, a cuBLAS
 * handle with its workspace, a kernel scratch area and a small ring of pinned staging buffers), the
 * device memory it hands out, and the kernels of a llama-style forward pass plus CacheBlend's own
 * kernels (KV deviation, top-k selection, row gather/scatter) and a device-resident LRU of chunk KV.
 *
 * Build: these declarations are always visible; the implementation (the .cu files of kernels/cuda, built as
 * libcbcuda.so and libcbcuda.a) exists only when the build defines CB_HAVE_CUDA=1. Callers guard their calls
 * with `#if CB_HAVE_CUDA`. The regular programs reach the backend only through engine/backend_select.c,
 * which dlopens libcbcuda.so where a device is; only programs that call this API directly (cb-bench-gpu,
 * tests/gpu) link libcbcuda.a and the CUDA libraries.
 *
 * Conventions
 *  - Every function that can fail returns an int: CB_CUDA_OK (0) or a negative CB_CUDA_E* code, and
 *    leaves a message naming the failed call and the CUDA/cuBLAS error string in cb_cuda_error().
 *    Out of device memory is CB_CUDA_EOOM and never aborts; the context stays usable afterwards.
 *    A kernel fault (illegal address) is sticky in CUDA: the context is then unusable, every call
 *    returns CB_CUDA_ERR, and the owner should destroy it and fall back to the CPU backend.
 *  - Pointers documented as "device" must come from cb_cuda_malloc (or point inside such a block).
 *    Shapes are given in comments as [rows][cols]; "ld" is a row stride in elements.
 *  - All compute functions enqueue work on the context's compute stream and return without waiting
 *    (no host round trip, no device-wide synchronization). Results are visible to the host after
 *    cb_cuda_d2h (which waits for the compute stream) or cb_cuda_sync.
 *  - bf16 is stored as its 16 raw bits (cb_bf16_t), the top half of an IEEE f32.
 *  - A context is used by one host thread at a time (the caller serializes).
 */
#ifndef CB_CUDA_H
#define CB_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef uint16_t cb_bf16_t;                 /* raw bfloat16 bits */
typedef struct cb_cuda cb_cuda_t;           /* one device context */
typedef struct cb_cuda_event cb_cuda_event_t;
typedef struct cb_cuda_graph cb_cuda_graph_t;
typedef struct cb_cuda_kvpool cb_cuda_kvpool_t;

enum {
    CB_CUDA_OK = 0,
    CB_CUDA_ERR = -1,     /* a CUDA or cuBLAS call failed (message in cb_cuda_error) */
    CB_CUDA_EOOM = -2,    /* out of device (or pinned host) memory */
    CB_CUDA_EINVAL = -3,  /* bad argument (shape, alignment, type) */
    CB_CUDA_ENODEV = -4,  /* no CUDA device */
    CB_CUDA_EBUSY = -5    /* every KV pool slot is in use */
};

typedef enum { CB_CUDA_F32 = 0, CB_CUDA_BF16 = 1 } cb_cuda_dtype_t;
typedef enum { CB_CUDA_STREAM_COMPUTE = 0, CB_CUDA_STREAM_COPY = 1 } cb_cuda_stream_t;

/* ---------------------------------------------------------------- context and memory */

/* Number of usable CUDA devices; 0 when there is no driver or no device (never fails). */
int cb_cuda_device_count(void);

/* Creates a context on `device`. Returns NULL with a message in err when there is no such device or
 * setup fails (e.g. out of memory for the workspaces). Caller owns it; destroy with cb_cuda_destroy. */
cb_cuda_t *cb_cuda_new(int device, char *err, size_t errlen);
/* Waits for outstanding work, frees everything the context allocated, nulls *self_p. NULL-safe. */
void cb_cuda_destroy(cb_cuda_t **self_p);

const char *cb_cuda_error(const cb_cuda_t *self);   /* last error message ("" when none) */
const char *cb_cuda_device_name(const cb_cuda_t *self);
int cb_cuda_sm_count(const cb_cuda_t *self);

/* Waits until both streams are idle; returns the first error a kernel raised. */
int cb_cuda_sync(cb_cuda_t *self);
/* Free and total device memory as the driver reports it. */
int cb_cuda_mem_info(cb_cuda_t *self, size_t *free_bytes, size_t *total_bytes);
/* Bytes currently allocated through cb_cuda_malloc (and the context's own buffers), and the peak
 * since creation or the last reset. */
size_t cb_cuda_mem_allocated(const cb_cuda_t *self);
size_t cb_cuda_mem_peak(const cb_cuda_t *self);
void cb_cuda_mem_reset_peak(cb_cuda_t *self);

/* Device memory, 256-byte aligned. NULL on failure (CB_CUDA_EOOM message in cb_cuda_error). bytes=0
 * returns NULL without error. cb_cuda_free is NULL-safe and, like cudaFree, waits for the device:
 * allocate and free at setup/teardown, never per layer or per token. */
void *cb_cuda_malloc(cb_cuda_t *self, size_t bytes);
void cb_cuda_free(cb_cuda_t *self, void *dev);

/* Page-locked host memory (for async copies). NULL on failure. */
void *cb_cuda_host_alloc(cb_cuda_t *self, size_t bytes);
void cb_cuda_host_free(cb_cuda_t *self, void *host);
/* Pins (registers) / unpins existing host memory, e.g. an in-memory KV chunk cache. */
int cb_cuda_host_register(cb_cuda_t *self, void *host, size_t bytes);
int cb_cuda_host_unregister(cb_cuda_t *self, void *host);

/* Copies. h2d and d2d enqueue on `stream` and return at once when src is pinned; a pageable src is
 * staged through the context's pinned ring (the host may wait for a ring slot, never for compute).
 * d2h waits for the compute stream, then copies (the result is in dst on return). */
int cb_cuda_h2d(cb_cuda_t *self, cb_cuda_stream_t stream, void *dev_dst, const void *host_src, size_t bytes);
int cb_cuda_d2h(cb_cuda_t *self, void *host_dst, const void *dev_src, size_t bytes);
int cb_cuda_d2d(cb_cuda_t *self, cb_cuda_stream_t stream, void *dev_dst, const void *dev_src, size_t bytes);
int cb_cuda_memset(cb_cuda_t *self, void *dev_dst, int byte, size_t bytes);     /* compute stream */
/* Strided 2-D copy between any two of host/device (rows of row_bytes, pitches in bytes). */
int cb_cuda_copy_2d(cb_cuda_t *self, cb_cuda_stream_t stream, void *dst, size_t dst_pitch,
                    const void *src, size_t src_pitch, size_t row_bytes, size_t rows);

/* ---------------------------------------------------------------- events and graphs */

/* Events order the two streams without host waits: enqueue loads on the copy stream, record an event
 * there, make the compute stream wait on it before the layer that needs the data. */
cb_cuda_event_t *cb_cuda_event_new(cb_cuda_t *self, bool timing);     /* NULL on failure */
void cb_cuda_event_destroy(cb_cuda_t *self, cb_cuda_event_t **ev_p);
int cb_cuda_event_record(cb_cuda_t *self, cb_cuda_event_t *ev, cb_cuda_stream_t stream);
int cb_cuda_stream_wait(cb_cuda_t *self, cb_cuda_stream_t stream, cb_cuda_event_t *ev);
int cb_cuda_event_sync(cb_cuda_t *self, cb_cuda_event_t *ev);         /* host waits */
/* Milliseconds between two timing events (both recorded and complete). */
int cb_cuda_event_elapsed(cb_cuda_t *self, cb_cuda_event_t *start, cb_cuda_event_t *end, float *ms);

/* Stream capture of the compute stream into a replayable graph (decode steps). Between begin and
 * end only compute-stream functions may be called; no copies from pageable memory, no d2h, no sync.
 * The graph reads its inputs (tokens, positions) from device memory at replay. */
int cb_cuda_graph_begin(cb_cuda_t *self);
cb_cuda_graph_t *cb_cuda_graph_end(cb_cuda_t *self);                  /* NULL on failure */
int cb_cuda_graph_launch(cb_cuda_t *self, cb_cuda_graph_t *g);
void cb_cuda_graph_destroy(cb_cuda_graph_t **g_p);

/* ---------------------------------------------------------------- weights */

/* Dequantizes n elements of a GGUF tensor (type = ggml type id: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0,
 * Q4_K, Q6_K) from host memory (e.g. the mmapped file) into device dst as bf16 or f32. n must be a
 * multiple of the type's block size. Synchronous (load time): returns when dst is written. */
int cb_cuda_upload_weights(cb_cuda_t *self, uint32_t gguf_type, const void *host_src, size_t n,
                           void *dev_dst, cb_cuda_dtype_t dst_dtype);
/* Same from raw GGUF bytes already on the device (compute stream, asynchronous). */
int cb_cuda_dequant(cb_cuda_t *self, uint32_t gguf_type, const void *dev_src, size_t n,
                    void *dev_dst, cb_cuda_dtype_t dst_dtype);
/* Element-wise conversion f32 <-> bf16 (or copy when the types match). */
int cb_cuda_convert(cb_cuda_t *self, const void *src, cb_cuda_dtype_t src_dtype, void *dst,
                    cb_cuda_dtype_t dst_dtype, size_t n);
/* Deterministic synthetic weights, bit-identical to libshared/synth.h's cb_synth_value():
 * dst[i] = bf16_rne(scale * u(seed, tensor_id, first + i)), u in [-1, 1). */
int cb_cuda_synth_fill(cb_cuda_t *self, cb_bf16_t *dev_dst, size_t n, uint64_t seed, uint32_t tensor_id,
                       uint64_t first, float scale);

/* ---------------------------------------------------------------- dense ops (compute stream) */

/* y[n][m] = x[n][k] . w[m][k]^T (+ beta * y). x, w bf16; y f32 or bf16 (beta must be 0 for bf16).
 * f32 accumulation. w is row-major [out][in] exactly as GGUF stores it. n == 1 uses a bandwidth-bound
 * GEMV kernel; otherwise cuBLAS (bf16 in, f32 compute). ldx >= k, ldw >= k, ldy >= m. */
int cb_cuda_gemm(cb_cuda_t *self, int n, int m, int k, const cb_bf16_t *x, int ldx, const cb_bf16_t *w,
                 int ldw, void *y, cb_cuda_dtype_t y_dtype, int ldy, float beta);

/* out[i][:] = f32(table[tokens[i]][:]); tokens device int32 [n]; ids outside [0, vocab) give zeros. */
int cb_cuda_embed(cb_cuda_t *self, const int32_t *dev_tokens, int n, const cb_bf16_t *table, int vocab,
                  int dim, float *out);

/* out[i] = bf16(x[row_i] / sqrt(mean(x[row_i]^2) + eps) * w), row_i = rows ? rows[i] : i.
 * x f32 [*][ldx], w f32 [dim], out bf16 [n][ldo]; rows optional device int32 [n] (a gather). */
int cb_cuda_rmsnorm(cb_cuda_t *self, int n, int dim, const float *x, int ldx, const int32_t *rows,
                    const float *w, float eps, cb_bf16_t *out, int ldo);

/* RoPE pairing of cb_cuda_rope (the values of tensor.h's cb_rope_type_t). */
typedef enum { CB_CUDA_ROPE_NORM = 0, CB_CUDA_ROPE_NEOX = 2 } cb_cuda_rope_mode_t;

/* How cb_cuda_rope turns a head of head_dim values: pair i (0 <= i < head_dim/2) at position p by
 *     theta_i = p * freq_scale * base^(-2i/head_dim) / (freq_factors ? freq_factors[i] : 1).
 * {CB_CUDA_ROPE_NORM, base, 1, NULL} is plain llama RoPE. */
typedef struct {
    cb_cuda_rope_mode_t mode;   /* NORM: pair i is (x[2i], x[2i+1]); NEOX: (x[i], x[i + head_dim/2]) */
    float base;                 /* > 0 (<arch>.rope.freq_base) */
    float freq_scale;           /* > 0; 1 = no scaling (1 / rope.scaling.factor for linear scaling) */
    const float *freq_factors;  /* device f32 [head_dim/2] (rope_freqs, Llama 3), or NULL */
} cb_cuda_rope_t;

/* RoPE as r says: each pair (x0, x1) of each head becomes (x0 cos - x1 sin, x0 sin + x1 cos) at angle
 * theta_i (cb_cuda_rope_t). in/out bf16 [n][ld] with n_heads heads of head_dim at columns h*head_dim;
 * in == out allowed (in place). Positions: pos device int32 [n] when non-NULL, else pos0 + i. Positions
 * may be negative: rotating post-RoPE K by (p' - p) moves it from p to p' (rotations compose); rotating
 * pre-RoPE K by p' places it at p'. Angles are reduced in double precision, so positions up to 2^31 keep
 * full f32 accuracy. head_dim even; ld_in, ld_out even and rows 4-byte aligned (NORM reads pairs as
 * 32-bit words). */
int cb_cuda_rope(cb_cuda_t *self, int n, int n_heads, int head_dim, const cb_bf16_t *in, int ld_in,
                 cb_bf16_t *out, int ld_out, const int32_t *pos, int pos0, const cb_cuda_rope_t *r);

/* out[i][j] = bf16(silu(gate[i][j]) * up[i][j]); gate/up bf16 rows of stride ld_in (they may be the
 * two halves of one fused [n][2*ffn] buffer), out bf16 [n][ldo]. */
int cb_cuda_swiglu(cb_cuda_t *self, int n, int ffn, const cb_bf16_t *gate, const cb_bf16_t *up, int ld_in,
                   cb_bf16_t *out, int ldo);

/* out[i][j] = bf16(gelu(gate[i][j]) * up[i][j]), GELU's tanh form 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
 * (gemma3's FFN); operands as cb_cuda_swiglu. */
int cb_cuda_geglu(cb_cuda_t *self, int n, int ffn, const cb_bf16_t *gate, const cb_bf16_t *up, int ld_in,
                  cb_bf16_t *out, int ldo);

/* x[i] *= a over n f32 values (one f32 rounding each: the CPU's bits). */
int cb_cuda_scale(cb_cuda_t *self, float *x, size_t n, float a);

/* h[i][j] += y[i][j]; h f32 [n][ldh], y f32 or bf16 [n][ldy]. ldy = 0 adds y's one row [dim] to every row
 * of h (a projection's bias). */
int cb_cuda_add(cb_cuda_t *self, int n, int dim, float *h, int ldh, const void *y, cb_cuda_dtype_t y_dtype,
                int ldy);

/* Row copy, the blend's gather/scatter: for i in [0,n): dst row (dst_rows ? dst_rows[i] : i) =
 * src row (src_rows ? src_rows[i] : i); rows of row_bytes, pitches in bytes; index arrays device
 * int32 [n]. Rows must not overlap between src and dst. */
int cb_cuda_copy_rows(cb_cuda_t *self, int n, size_t row_bytes, void *dst, size_t dst_pitch,
                      const int32_t *dst_rows, const void *src, size_t src_pitch, const int32_t *src_rows);

/* Adds delta to n device int32 values (advances positions/limits inside a captured decode graph). */
int cb_cuda_i32_add(cb_cuda_t *self, int32_t *dev, int n, int32_t delta);
/* dev[i] = v0 + i (positions, identity row lists). */
int cb_cuda_i32_iota(cb_cuda_t *self, int32_t *dev, int n, int32_t v0);

/* ---------------------------------------------------------------- attention */

typedef enum {
    CB_CUDA_ATTN_AUTO = 0,    /* flash for many query rows, split-K for a few (decode) */
    CB_CUDA_ATTN_FLASH = 1,   /* tiled, tensor cores (mma.sync bf16), online softmax; head_dim 64/128 */
    CB_CUDA_ATTN_SPLITK = 2,  /* split over the key sequence + reduction; for decode-sized n_q */
    CB_CUDA_ATTN_SIMPLE = 3   /* one warp per (row, head), CUDA cores; any head_dim <= 256 (fallback) */
} cb_cuda_attn_algo_t;

/* Exact causal attention of an arbitrary subset of query rows against the full fused KV.
 * Query row r (0 <= r < n_q) sees keys [lo_r, L_r): L_r = limit[r] + limit_add clamped to [0, n_kv], and
 * lo_r = L_r - window when window > 0 and L_r > window, else 0 (a sliding window: the last `window` keys
 * below the limit; tensor.h's cb_attn_key_lo of L_r). For a token at fused position p the exact causal
 * rule is limit = p + 1. A row whose limit is <= 0 gets zeros. GQA: query head h reads
 * kv head h / (n_heads / n_kv_heads).
 * Contract: K/V rows [min lo_r, max L_r) (over the rows with L_r > 0) are initialized (finite); rows outside
 * may hold anything (never read, or read as zeros). */
typedef struct {
    const cb_bf16_t *q; int ldq;       /* device [n_q][ldq]; head h at columns h*head_dim (post-RoPE) */
    const cb_bf16_t *k; const cb_bf16_t *v; int ldkv;  /* device [n_kv][ldkv]; kv head g at g*head_dim */
    cb_bf16_t *out; int ldo;           /* device [n_q][ldo]; head h at columns h*head_dim */
    const int32_t *limit;              /* device int32 [n_q] */
    int limit_add;                     /* added to every limit (1 when limit holds positions) */
    int n_q, n_kv, n_heads, n_kv_heads, head_dim;
    int max_limit;                     /* host upper bound of the effective limits (<= n_kv); 0 = n_kv.
                                          Sizes split-K; a graph-captured decode passes its capacity. */
    float scale;                       /* 0 = 1/sqrt(head_dim) */
    int window;                        /* sliding window (keys a row sees below its limit); <= 0: none */
} cb_cuda_attn_t;

int cb_cuda_attention(cb_cuda_t *self, const cb_cuda_attn_t *a, cb_cuda_attn_algo_t algo);

/* Attention mass (the blend's query-aware selection, metric 'a'): for every query row r and head h, the
 * softmax probabilities p_rh(j) of q_rh over keys [lo_r, L_r) (as cb_cuda_attention: the limit, and the
 * window when a->window > 0; scores as attention computes them: bf16 q and K, f32 dot products, times
 * scale) summed over rows and heads (a key no row sees gets 0):
 *     mass[j] = sum_h sum_r p_rh(j)   for j < n_keys = (max_limit ? max_limit : n_kv);
 * mass device f32 [n_keys] (written, not accumulated). Uses q, ldq, k, ldkv, limit, limit_add, n_q, n_kv,
 * n_heads, n_kv_heads, head_dim, max_limit, scale and window of a (v and out are not read). Deterministic: one
 * pass takes each (row, head)'s max and sum with a fixed per-thread order and a fixed merge, a second
 * gives one thread per key that sums heads then rows in order; no atomics. head_dim even <= 256, GQA
 * group <= 16; scratch: 8 * n_q * n_heads bytes of the context's workspace. */
int cb_cuda_attn_mass(cb_cuda_t *self, const cb_cuda_attn_t *a, float *mass);

/* ---------------------------------------------------------------- blend kernels */

/* dev[i] = sum_j (f32(a[i][j]) - f32(b[r_i][j]))^2 over j < width, r_i = b_rows ? b_rows[i] : i, f32
 * accumulation in a fixed order (deterministic). a bf16 [n][lda] (fresh rows), b bf16 [*][ldb] (the
 * cache, rows gathered by b_rows, device int32 [n] or NULL); dev f32 [n]. Compare pre-RoPE K with
 * pre-RoPE K (the K metric) or V with V. */
int cb_cuda_kv_deviation(cb_cuda_t *self, int n, int width, const cb_bf16_t *a, int lda, const cb_bf16_t *b,
                         int ldb, const int32_t *b_rows, float *dev);

/* Top-k selection on the device. mask (device uint8 [n], NULL = all candidates): 0 = candidate,
 * 1 = forced (always selected: query suffix, uncached spans), 2 = excluded. Selects the k candidates
 * with the largest score (ties: lower index first; NaN counts as -inf), unions the forced rows, and
 * writes the selected row indices in ascending order to out_rows (device int32 [n]); the count
 * (min(k, candidates) + forced) goes to out_count (device int32, may be NULL). Deterministic: the
 * same inputs give the same output bit for bit. n <= 2^24. Uses one thread block. */
int cb_cuda_topk_select(cb_cuda_t *self, int n, const float *score, const uint8_t *mask, int k,
                        int32_t *out_rows, int32_t *out_count);

/* ---------------------------------------------------------------- sampling */

/* out[i] = argmax_j logits[i][j] (lowest index on ties; NaN never wins). logits f32 [n][ld]. */
int cb_cuda_argmax(cb_cuda_t *self, int n, int vocab, const float *logits, int ld, int32_t *out);
/* One token from logits f32 [vocab]: greedy when temperature <= 0 or top_p <= 0; otherwise softmax
 * at the temperature, restricted to the smallest set of top tokens whose mass reaches top_p (ties at
 * the threshold included), sampled with u = hash(*rng_state) and *rng_state advanced by one — all on
 * the device, so a captured graph can replay it. Probabilities are fixed-point (2^-24 of the top
 * token's), so the choice is deterministic. rng_state device uint64 [1]; out device int32 [1]. */
int cb_cuda_sample(cb_cuda_t *self, int vocab, const float *logits, float temperature, float top_p,
                   uint64_t *rng_state, int32_t *out);

/* ---------------------------------------------------------------- device KV pool (LRU) */

/* A device-resident LRU of chunk KV under a byte budget: fixed-size slots of slot_tokens tokens,
 * each holding all layers: per layer K [slot_tokens][kv_dim] then V [slot_tokens][kv_dim], bf16.
 * Loads run on the copy stream; overwriting a slot waits (on the device) for the last compute that
 * read it. Returns NULL when the budget holds no slot or memory is short. */
cb_cuda_kvpool_t *cb_cuda_kvpool_new(cb_cuda_t *self, size_t budget_bytes, int n_layers, int kv_dim,
                                     int slot_tokens, char *err, size_t errlen);
void cb_cuda_kvpool_destroy(cb_cuda_kvpool_t **pool_p);
int cb_cuda_kvpool_slots(const cb_cuda_kvpool_t *pool);
/* Finds key (32 bytes, e.g. the chunk hash); on a hit *hit = true; on a miss takes a free slot or the
 * least recently used unreferenced one, *hit = false, and the caller loads every layer before use.
 * Takes a reference. Returns the slot, or CB_CUDA_EBUSY / CB_CUDA_EINVAL (n_tokens > slot_tokens). */
int cb_cuda_kvpool_acquire(cb_cuda_kvpool_t *pool, const uint8_t key[32], int n_tokens, bool *hit);
/* Enqueues the copy of one layer (host K and V, each [n_tokens][kv_dim] bf16; pinned memory copies
 * asynchronously, pageable memory is staged) on the copy stream. */
int cb_cuda_kvpool_load_layer(cb_cuda_kvpool_t *pool, int slot, int layer, const cb_bf16_t *host_k,
                              const cb_bf16_t *host_v);
/* Makes the compute stream wait until every copy enqueued so far (all slots) is complete. */
int cb_cuda_kvpool_wait_loads(cb_cuda_kvpool_t *pool);
/* Device pointers of a slot's layer: [slot_tokens][kv_dim] bf16. */
cb_bf16_t *cb_cuda_kvpool_k(cb_cuda_kvpool_t *pool, int slot, int layer);
cb_bf16_t *cb_cuda_kvpool_v(cb_cuda_kvpool_t *pool, int slot, int layer);
int cb_cuda_kvpool_n_tokens(const cb_cuda_kvpool_t *pool, int slot);
/* Drops the reference; the slot stays cached (LRU) and is evicted only after the compute enqueued
 * so far has finished reading it. valid=false forgets the key (e.g. a load failed). */
int cb_cuda_kvpool_release(cb_cuda_kvpool_t *pool, int slot, bool valid);
typedef struct { uint64_t hits, misses, evictions; int slots, used; size_t slot_bytes; } cb_cuda_kvpool_stats_t;
void cb_cuda_kvpool_stats(const cb_cuda_kvpool_t *pool, cb_cuda_kvpool_stats_t *out);

#ifdef __cplusplus
}
#endif
#endif
