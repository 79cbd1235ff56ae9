/* cpu_ops_internal.h: private to the kernels/cpu files that implement cpu_ops.h (cpu_ops.c, cpu_attn.c,
 * cpu_attn_decode.c, cpu_attn_amx.c, cpu_attn_i16.c); not part of any API, included by nothing else.
 * What they share: the ISA switches (CB_AVX512, CB_AVX2), the vector exp and horizontal sums, dot_f32, the
 * attention's constants and scratch layout, the KV views, the attention job and the helpers that several
 * attention kernels call. Every helper here is static inline, so each file inlines what the single file
 * they came from inlined; the few functions one file defines for another are declared at the end. */
#ifndef CB_CPU_OPS_INTERNAL_H
#define CB_CPU_OPS_INTERNAL_H

#include "cpu/cpu_ops.h"

#include <assert.h>
#include <math.h>
#include <string.h>

#include "format/gguf.h"
#include "format/quant.h"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define CB_AVX512 1
#else
#define CB_AVX512 0
#endif
/* AVX2 + FMA (and no AVX-512): the same kernels 8 lanes wide. The build is -march=native, so the set is
 * the build machine's; the scalar loops remain for everything else. */
#if !CB_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define CB_AVX2 1
#else
#define CB_AVX2 0
#endif

/* ---------------------------------------------------------------- exp */

#if CB_AVX512
/* exp(x) for a vector: Cody-Waite reduction x = n ln2 + r, degree-6 polynomial (Cephes expf
 * coefficients), scale by 2^n with vscalefps (exact, handles underflow to 0). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.72283f)), _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

#if CB_AVX2
/* exp(x) for 8 lanes: the same reduction and polynomial as exp16; 2^n is built in the exponent field, so
 * x is clamped to at most 88.376, and below ln FLT_MIN the result is 0 (no subnormals). */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3365447505531f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ); /* exp underflows to 0 there, as expf does */
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* The last n < 8 values of a row as one vector (the other lanes `fill`), and back. */
static inline __m256 load_tail8(const float *s, int n, float fill) {
    float t[8] = {fill, fill, fill, fill, fill, fill, fill, fill};
    memcpy(t, s, sizeof(float) * (size_t)n);
    return _mm256_loadu_ps(t);
}
static inline void store_tail8(float *s, int n, __m256 v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    memcpy(s, t, sizeof(float) * (size_t)n);
}

/* max of s[0:n) (n >= 1). */
static inline float max_row8(const float *s, int n) {
    __m256 v = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + j));
    if (j < n) v = _mm256_max_ps(v, load_tail8(s + j, n - j, -INFINITY));
    return hmax8(v);
}

/* s[0:n) = exp(s - m) in place; returns their sum (every value through exp8, whatever its lane). */
static inline __attribute__((always_inline)) float exp_sub_sum8(float *s, int n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (j < n) {
        const __m256 keep = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(n - j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(load_tail8(s + j, n - j, m), vm)), keep);
        store_tail8(s + j, n - j, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum8(sum);
}
#endif

/* ---------------------------------------------------------------- dot product */

static inline __attribute__((always_inline)) float dot_f32(const float *a, const float *b, int n) {
    int i = 0;
    float s = 0.0f;
#if CB_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = hsum16(acc);
#elif CB_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    s = hsum8(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* ---------------------------------------------------------------- attention */

#define ATT_BLOCK_ROWS 64  /* query rows per GEMM block (x group size query heads) */
#define ATT_MAX_G 16       /* largest GQA group (n_head / n_head_kv) the block path handles */
#define ATT_KEY_CHUNK 512  /* keys per score tile of the block path */

#define ATT_SPLIT_ROWS 4   /* up to this many rows use the split-key (decode) kernel */
#define ATT_SPLIT_MIN 256  /* smallest key chunk of one split task */
#define ATT_ROWS_MAX 16    /* rows of a decode batch (cb_cpu_attention_rows) per pool run */
#define ATT_ROWS_PIECE 32  /* keys whose K (or V) rows stay in L1 while every head reads them */
#define ATT_ROWS_AHEAD 32  /* keys ahead whose rows a piece prefetches (the hardware prefetchers do not follow
                              reads that use a third of each row per pass) */
#define ATT_F16_PIECE 64   /* f16 pools, split kernel: keys of one KV head converted at a time (L1-sized) */

/* Keys per task when the split kernel runs `rows` rows of largest key limit lim on nt threads. The
 * chunking is part of the numerics: a decode row is chunked as a one-row call would chunk it. */
static inline int split_chunk(int lim, int rows, int n_head_kv, int nt) {
    const int want = (4 * nt + rows * n_head_kv - 1) / (rows * n_head_kv); /* chunks per (row, KV head) */
    const int chunk = (lim + want - 1) / want;
    return chunk < ATT_SPLIT_MIN ? ATT_SPLIT_MIN : (chunk + 15) / 16 * 16;
}

/* Shared region at the start of the scratch: split-kernel partials [rows][n_head][chunks][2 + head_dim]
 * (ATT_SPLIT_ROWS rows), or those of cb_cpu_attention_rows [tasks][n_head][2 + head_dim] (ATT_ROWS_MAX rows). */
static inline size_t att_partial_floats(const cb_attn_geom_t *g, int max_keys) {
    const size_t part = (size_t)ATT_ROWS_MAX * g->n_head * (size_t)((max_keys + ATT_SPLIT_MIN - 1) / ATT_SPLIT_MIN) *
                        (size_t)(g->head_dim + 2);
    /* or (bf16 blocks) every KV head's K and V (hi, lo each) in bf16 tiles: [n_head_kv][chunks][4][ATT_KEY_CHUNK][hd] */
    const size_t pack = (size_t)g->n_head_kv * (size_t)((max_keys + ATT_KEY_CHUNK - 1) / ATT_KEY_CHUNK) *
                        ATT_KEY_CHUNK * (size_t)g->head_dim * 2 + 16;
    return part > pack ? part : pack;
}

/* Per-thread region after it: Q and O blocks plus one score tile (or one row of scores), or the scores of
 * every head over one chunk of keys (cb_cpu_attention_rows; the largest chunk is the one-thread one), or
 * (f16 split kernel) the scores of the G query heads of a KV head over a chunk of at most max_keys keys. */
static inline size_t att_tile_floats(const cb_attn_geom_t *g, int max_keys) {
    const size_t G = (size_t)(g->n_head / g->n_head_kv), rows = G * ATT_BLOCK_ROWS;
    size_t tile = rows * ATT_KEY_CHUNK > (size_t)max_keys ? rows * ATT_KEY_CHUNK : (size_t)max_keys;
    size_t heads = (size_t)g->n_head * (size_t)split_chunk(max_keys, 1, g->n_head_kv, 1);
    tile = heads > tile ? heads : tile;
    return G * (size_t)max_keys > tile ? G * (size_t)max_keys : tile;
}

/* Offset, in a thread's region, of the f32 copy of an f16 piece: [ATT_ROWS_PIECE][kv_dim] (rows kernel),
 * [ATT_F16_PIECE][head_dim] (split kernel) or [head_dim] (one row, one head). */
static inline size_t att_cvt_offset(const cb_attn_geom_t *g, int max_keys) {
    const size_t rows = (size_t)(g->n_head / g->n_head_kv) * ATT_BLOCK_ROWS;
    /* Q, O, the tile, and K and V of one key chunk gathered (from non-consecutive blocks, or converted from
     * f16): [2][ATT_KEY_CHUNK][head_dim] */
    return rows * (size_t)g->head_dim * 2 + att_tile_floats(g, max_keys) + 2 * (size_t)ATT_KEY_CHUNK * g->head_dim + 16;
}

/* Offset of the bf16 blocks' weights [G * ATT_BLOCK_ROWS][ATT_KEY_CHUNK] bf16 (attn_block_amx_task). */
static inline size_t att_bf16_offset(const cb_attn_geom_t *g, int max_keys) {
    const size_t kvd = (size_t)g->n_head_kv * g->head_dim, a = ATT_ROWS_PIECE * kvd,
                 b = (size_t)ATT_F16_PIECE * g->head_dim;
    return att_cvt_offset(g, max_keys) + (a > b ? a : b) + 16;
}

static inline size_t att_thread_floats(const cb_attn_geom_t *g, int max_keys) {
    const size_t G = (size_t)(g->n_head / g->n_head_kv);
    return att_bf16_offset(g, max_keys) + (size_t)ATT_KEY_CHUNK * G * ATT_BLOCK_ROWS / 2 + 16;
}

/* ---------------------------------------------------------------- KV views */

/* Pool row of position p. */
static inline size_t kv_row(const cb_cpu_kv_t *kv, int p) {
    return (size_t)kv->blocks[p / kv->block_tokens] * (size_t)kv->block_tokens + (size_t)(p % kv->block_tokens);
}

/* Positions from p on (up to end) whose rows follow each other in the pool. */
static inline int kv_run(const cb_cpu_kv_t *kv, int p, int end) {
    const int bt = kv->block_tokens;
    int b = p / bt, q = (b + 1) * bt;
    while (q < end && kv->blocks[q / bt] == kv->blocks[b] + (q / bt - b)) q += bt;
    return (q < end ? q : end) - p;
}

/* Value e of K (or V) pool rows of an f32 / f16 pool. */
static inline const float *kv_f32(const void *base, size_t e) { return (const float *)base + e; }
static inline const uint16_t *kv_f16(const void *base, size_t e) { return (const uint16_t *)base + e; }

/* n values of a KV payload (dtype) as f32: cb_cpu_kv_to_f32 (cpu_ops.h), here so that the kernels' f16
 * conversions are inlined in every attention file. */
static inline void kv_to_f32(cb_kv_dtype_t dt, const void *src, float *dst, size_t n) {
    if (dt == CB_KV_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    if (dt == CB_KV_Q8_0) {
        assert(n % 32 == 0);
        cb_dequant(CB_TYPE_Q8_0, src, dst, n); /* kvfile's decoder: the same bits */
        return;
    }
    const uint16_t *h = src;
    size_t i = 0;
    if (dt == CB_KV_F16) {
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(h + i))));
#elif defined(__F16C__) && defined(__AVX__)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(h + i))));
#endif
        for (; i < n; i++) dst[i] = cb_f16_to_f32(h[i]);
    } else {
        for (; i < n; i++) dst[i] = cb_bf16_to_f32(h[i]);
    }
}

/* dst[t][0:w) = f32 of src[t * ld][0:w) for t < n: rows of an f16 pool converted (and gathered). */
static inline void cvt_rows_f16(const uint16_t *src, size_t ld, int n, int w, float *dst, size_t ldd) {
    for (int t = 0; t < n; t++) kv_to_f32(CB_KV_F16, src + (size_t)t * ld, dst + (size_t)t * ldd, (size_t)w);
}

/* ---------------------------------------------------------------- shared by the attention kernels */

static inline void scale_row(float *x, int n, float a) {
    for (int i = 0; i < n; i++) x[i] *= a;
}

/* One cb_cpu_attention call as its pool tasks see it (f32 rows and blocks, split kernel, bf16 and int16 blocks). */
typedef struct {
    const cb_attn_geom_t *g;
    const float *q;
    const cb_cpu_kv_t *kv;
    const int32_t *key_limit;
    float *out, *scratch;
    size_t per_thread;     /* floats of each thread's region */
    size_t partial_floats; /* floats of the shared partials region at the start of scratch */
    size_t cvt_offset;     /* f16 pools: offset of the converted piece in each thread's region */
    size_t bf16_offset;    /* bf16 blocks: offset of their weight tiles in each thread's region */
    uint16_t *pack;        /* bf16 blocks: K and V tiles of every (KV head, chunk), in the shared region */
    int max_lim;           /* bf16 blocks: the call's largest key limit */
    int n, rb;
    int chunk, n_chunks;   /* split kernel: keys per task, tasks per (row, KV head) */
} attn_job_t;

/* A thread's gathered K [ATT_KEY_CHUNK][hd] (then V) in its region of the block path: after the Q and O blocks
 * [G * ATT_BLOCK_ROWS][hd] and the score tile [G * ATT_BLOCK_ROWS][ATT_KEY_CHUNK]. */
static inline float *att_gather_k(float *base, int G, int hd) {
    return base + (size_t)G * ATT_BLOCK_ROWS * hd * 2 + (size_t)G * ATT_BLOCK_ROWS * ATT_KEY_CHUNK;
}

/* Keys [c0, c0 + w) of KV head kvh as f32 rows ld floats apart: *K, *V point into the pool when the rows
 * follow each other there (f32 pools), else into GK, GV [w][hd] (gathered, converted from f16 on the way). */
static inline void chunk_kv(const cb_cpu_kv_t *kv, int kvh, int kvd, int hd, int c0, int w, float *GK, float *GV,
                            const float **K, const float **V, int *ld) {
    if (kv->dtype == CB_KV_F16) { /* converted while gathered, a run of consecutive rows at a time */
        for (int p = c0, n_run; p < c0 + w; p += n_run) {
            n_run = kv_run(kv, p, c0 + w);
            const size_t e = kv_row(kv, p) * kvd + (size_t)kvh * hd;
            cvt_rows_f16(kv_f16(kv->k, e), (size_t)kvd, n_run, hd, GK + (size_t)(p - c0) * hd, (size_t)hd);
            cvt_rows_f16(kv_f16(kv->v, e), (size_t)kvd, n_run, hd, GV + (size_t)(p - c0) * hd, (size_t)hd);
        }
        *K = GK, *V = GV, *ld = hd;
    } else if (kv_run(kv, c0, c0 + w) == w) {
        *K = kv_f32(kv->k, kv_row(kv, c0) * kvd + (size_t)kvh * hd);
        *V = kv_f32(kv->v, kv_row(kv, c0) * kvd + (size_t)kvh * hd);
        *ld = kvd;
    } else {
        for (int p = c0, n_run; p < c0 + w; p += n_run) {
            n_run = kv_run(kv, p, c0 + w);
            const size_t r0 = kv_row(kv, p);
            for (int t2 = 0; t2 < n_run; t2++) {
                memcpy(GK + (size_t)(p - c0 + t2) * hd, kv_f32(kv->k, (r0 + t2) * kvd + (size_t)kvh * hd),
                       sizeof(float) * (size_t)hd);
                memcpy(GV + (size_t)(p - c0 + t2) * hd, kv_f32(kv->v, (r0 + t2) * kvd + (size_t)kvh * hd),
                       sizeof(float) * (size_t)hd);
            }
        }
        *K = GK, *V = GV, *ld = hd;
    }
}

/* The max half of a reduced-precision block's online-softmax step (online_softmax's contract) over the
 * allowed scores s[0, lim), 1 <= lim: *m_new = the running max m with theirs, and the factor the row's
 * output so far is rescaled by (exp(m - *m_new); 0 for the first chunk, m = -inf). */
#if CB_AVX512
static inline float block_max_step(const float *s, int lim, float m, float *m_new) {
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    int k = 0;
    for (; k + 16 <= lim; k += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + k));
    if (k < lim) {
        const __mmask16 mk = (__mmask16)((1u << (lim - k)) - 1u);
        vmx = _mm512_mask_max_ps(vmx, mk, vmx, _mm512_maskz_loadu_ps(mk, s + k));
    }
    const float mx = _mm512_reduce_max_ps(vmx);
    *m_new = mx > m ? mx : m;
    float alpha = 0.0f;
    if (m != -INFINITY) {
        float d = m - *m_new;
        cb_cpu_exp(&d, &alpha, 1);
    }
    return alpha;
}
#endif

/* ---------------------------------------------------------------- defined in one file, called from another */

/* cpu_attn.c: the f32 kernels' online-softmax step over one chunk of keys (its contract there). */
float online_softmax(float *s, int lim, int w, float *m, float *l);

/* cpu_attn_decode.c: the split-key decode kernel (cb_cpu_attention's calls of up to ATT_SPLIT_ROWS rows):
 * its pool task and the merge of its chunks' partials. */
void attn_split_task(void *arg, int t, int thread);
void attn_split_merge(const attn_job_t *j);

#if CB_AVX512
/* cpu_attn_amx.c: the bf16 (AMX) prefill blocks' pool tasks: K and V packed once per call, then the blocks. */
void attn_pack_amx_task(void *arg, int t, int thread);
void attn_block_amx_task(void *arg, int t, int thread);
/* cpu_attn_i16.c: the int16 (AVX512-VNNI) prefill blocks' pool tasks, likewise. */
void attn_pack_i16_task(void *arg, int t, int thread);
void attn_block_i16_task(void *arg, int t, int thread);
#endif

#endif
