/* cpu_quant.c: the integer kernels of cpu_quant.h over the stored rows (a portable scalar set and an AVX2
 * set), the activation quantizers and the dispatch among the kernel sets; the copies' kernels are in
 * cpu_quant_b8.c (x8, blocks of 32), cpu_quant_k8.c (x8, K-quants), cpu_quant_v16.c (Q4_1's v16) and
 * cpu_quant_amx.c (x8 on the AMX tile unit).
 *
 * Block layouts (format/quant.h, ggml's blocks): Q4_0 {f16 d; u8 qs[16]} w = (nibble - 8) d; Q4_1 {f16 d,
 * m; u8 qs[16]} w = nibble d + m (low nibbles are elements 0..15, high 16..31); Q5_0 {f16 d; u8 qh[4];
 * u8 qs[16]} w = ((nibble | bit j of the little-endian u32 qh << 4) - 16) d; Q8_0 {f16 d; i8 qs[32]};
 * Q4_K {f16 d, dmin; u8 scales[12]; u8 qs[128]}: 8 sub-blocks of 32 with 6-bit scale sc and min mn,
 * w = d sc nibble - dmin mn, chunk c of 32 bytes holds sub-block 2c in its low and 2c+1 in its high
 * nibbles; Q5_K {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}: Q4_K's with a fifth bit, bit k of qh[l]
 * for element l of sub-block k (codes 0..31); Q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}: 16 scales of 16 elements, w = d sc (q - 32).
 *
 * Q4_0, Q4_1, Q5_0, Q8_0 read the B32 activations: a product of one weight block and one activation block is
 * an exact integer sum (|sum| < 2^23; Q5_0's signed 5-bit codes -16..15: |sum| <= 32 * 16 * 127 < 2^16),
 * scaled by d_w * d_x in f32 and accumulated in f32 (the avx512vnni set runs the AVX2 kernels of all types
 * but Q4_1's v16). Q4_K, Q5_K and Q6_K read the K activations: per super-block, the
 * integer sum of sc_k * dot_k over its sub-blocks (Q4_K: |sum| <= 8 * 63 * 32 * 15 * 127 < 2^25,
 * Q5_K with 31 < 2^26; Q6_K,
 * whose unsigned q = w / (d sc) + 32 is multiplied as is and 32 * sum_g sc_g * bsum_g taken off:
 * |sum| <= 16 * 128 * 16 * 32 * 127 < 2^28) and, for Q4_K / Q5_K,
 * sum_k mn_k * bsum32_k, each converted to f32 once and scaled by d_x d (d_x dmin). The K kernels also
 * prefetch the weight rows ahead (K_PREFETCH). The AVX2 kernels on stored rows keep 8 lanes of partial sums per row
 * and add them at the end; the x8 and v16 kernels keep one lane per weight row (8 or 16 rows per vector)
 * and add block by block, as the scalar kernels do.
 */
#include "cpu/cpu_quant.h"
#include "cpu/cpu_quant_internal.h"

#include <assert.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "format/gguf.h"
#include "format/quant.h"

static size_t b32_bytes(int cols) { return ((size_t)cols + 10 * (size_t)(cols / 32) + 63) / 64 * 64; }
static size_t k_bytes(int cols) {
    return ((size_t)cols + 4 * (size_t)(cols / 256) + 2 * (size_t)(cols / 16) + 2 * (size_t)(cols / 32) + 63) / 64 * 64;
}

size_t cb_cpu_q8_row_bytes(int cols) { return b32_bytes(cols) + k_bytes(cols); }

static xrow_t xrow(const void *base, int cols, int r) {
    const uint8_t *p = (const uint8_t *)base + (size_t)r * cb_cpu_q8_row_bytes(cols), *k = p + b32_bytes(cols);
    const float *d = (const float *)(p + cols), *kd = (const float *)(k + cols);
    const int16_t *kbs = (const int16_t *)(kd + cols / 256);
    return (xrow_t){(const int8_t *)p, d, d + cols / 32, (const int16_t *)(d + 2 * (cols / 32)), (const int8_t *)k, kd, kbs,
                    kbs + cols / 16};
}

/* Scalar in every kernel set, so that the quantized activations are the same bits everywhere:
 * q = nearbyint(x / d) in the default rounding mode (to nearest even, as ggml's x86 quantizer), |q| <= 127,
 * d = max|x| / 127. Unlike ggml's Q8_0 / Q8_1, d and ds stay f32: an f16 d loses small blocks (max|x| below
 * ~1e-5 rounds d to 0) and an f16 ds overflows once max|x| > 2047 (outlier activations of large models). */
static void s_q8_quantize(const float *x, int cols, void *dst) {
    int8_t *q = dst;
    float *d = (float *)((uint8_t *)dst + cols), *ds = d + cols / 32;
    int16_t *bs = (int16_t *)(ds + cols / 32);
    for (int b = 0; b < cols / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float db = amax / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            int v = (int)nearbyintf(xb[j] * id);
            v = v > 127 ? 127 : v < -127 ? -127 : v; /* x * (1/d) can round a hair above 127 */
            q[32 * b + j] = (int8_t)v;
            sum += v;
        }
        d[b] = db;
        ds[b] = db * (float)sum;
        bs[b] = (int16_t)sum;
    }
}

/* The K format into dst (the row's K part): the rule above with one d per 256, and the exact sums of q per
 * 16 and per 32 (|sum| <= 32 * 127). */
static void s_q8k_quantize(const float *x, int cols, void *dst) {
    int8_t *q = dst;
    float *d = (float *)((uint8_t *)dst + cols);
    int16_t *bs = (int16_t *)(d + cols / 256), *bs32 = bs + cols / 16;
    for (int i = 0; i < cols / 256; i++) {
        const float *xb = x + 256 * i;
        float amax = 0.0f;
        for (int j = 0; j < 256; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float db = amax / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int j = 16 * g; j < 16 * g + 16; j++) {
                int v = (int)nearbyintf(xb[j] * id);
                v = v > 127 ? 127 : v < -127 ? -127 : v;
                q[256 * i + j] = (int8_t)v;
                sum += v;
            }
            bs[16 * i + g] = (int16_t)sum;
        }
        for (int k = 0; k < 8; k++) bs32[8 * i + k] = (int16_t)(bs[16 * i + 2 * k] + bs[16 * i + 2 * k + 1]);
        d[i] = db;
    }
}

static void (*g_quantize)(const float *x, int cols, void *dst);   /* B32 */
static void (*g_quantize_k)(const float *x, int cols, void *dst); /* K, into the row's K part */
static pthread_once_t g_quantize_once = PTHREAD_ONCE_INIT;
static void quantize_init(void);

void cb_cpu_q8_quantize(const float *x, int cols, unsigned fmt, void *dst) {
    pthread_once(&g_quantize_once, quantize_init);
    if (fmt & CB_CPU_Q8_B32) g_quantize(x, cols, dst);
    if ((fmt & CB_CPU_Q8_K) && cols % 256 == 0) g_quantize_k(x, cols, (uint8_t *)dst + b32_bytes(cols));
}

/* The 32 fifth bits of a Q5_0 block (bit j = element j), from the 4 little-endian qh bytes at p. */
static inline uint32_t q5_hbits(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* 6-bit scale and min of Q4_K sub-block k (0..7) from the 12 packed bytes. */
/* ---------------------------------------------------------------- scalar kernels */


/* The range form of a one-row kernel fn##_row(w row, cols, x, R, out[R]). */
#define ROWS_LOOP(fn)                                                                                    \
    static void fn(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {   \
        for (int o = o0; o < o1; o++) {                                                                  \
            float out[QROWS];                                                                            \
            fn##_row((const uint8_t *)w->q + (size_t)o * w->row_bytes, w->cols, x, R, out);             \
            for (int r = 0; r < R; r++) y[(size_t)r * ldy + o] = out[r];                                 \
        }                                                                                                \
    }

static void s_q4_0_row(const uint8_t *w, int cols, const xrow_t *x, int R, float *out) {
    for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int b = 0; b < cols / 32; b++) {
            const uint8_t *blk = w + 18 * b;
            const int8_t *xq = x[r].q + 32 * b;
            int s = 0;
            for (int j = 0; j < 16; j++) s += ((blk[2 + j] & 0xF) - 8) * xq[j] + ((blk[2 + j] >> 4) - 8) * xq[j + 16];
            acc += f16_at(blk) * x[r].d[b] * (float)s;
        }
        out[r] = acc;
    }
}

static void s_q4_1_row(const uint8_t *w, int cols, const xrow_t *x, int R, float *out) {
    for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int b = 0; b < cols / 32; b++) {
            const uint8_t *blk = w + 20 * b;
            const int8_t *xq = x[r].q + 32 * b;
            int s = 0;
            for (int j = 0; j < 16; j++) s += (blk[4 + j] & 0xF) * xq[j] + (blk[4 + j] >> 4) * xq[j + 16];
            acc += f16_at(blk) * x[r].d[b] * (float)s + f16_at(blk + 2) * x[r].ds[b];
        }
        out[r] = acc;
    }
}

/* Q5_0: the signed codes q - 16 (q = nibble | fifth bit << 4) against the activation's int8, as Q4_0. */
static void s_q5_0_row(const uint8_t *w, int cols, const xrow_t *x, int R, float *out) {
    for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int b = 0; b < cols / 32; b++) {
            const uint8_t *blk = w + 22 * b, *qs = blk + 6;
            const uint32_t qh = q5_hbits(blk + 2);
            const int8_t *xq = x[r].q + 32 * b;
            int s = 0;
            for (int j = 0; j < 16; j++) {
                const int lo = (qs[j] & 0xF) | (int)((qh >> j) & 1u) << 4;        /* element j */
                const int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4;  /* element j + 16 */
                s += (lo - 16) * xq[j] + (hi - 16) * xq[j + 16];
            }
            acc += f16_at(blk) * x[r].d[b] * (float)s;
        }
        out[r] = acc;
    }
}

static void s_q8_0_row(const uint8_t *w, int cols, const xrow_t *x, int R, float *out) {
    for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int b = 0; b < cols / 32; b++) {
            const uint8_t *blk = w + 34 * b;
            const int8_t *wq = (const int8_t *)(blk + 2), *xq = x[r].q + 32 * b;
            int s = 0;
            for (int j = 0; j < 32; j++) s += wq[j] * xq[j];
            acc += f16_at(blk) * x[r].d[b] * (float)s;
        }
        out[r] = acc;
    }
}

/* Q4_K (Q5_K: q5, the fifth bits from qh) on the K activations: per super-block sumi = sum_k sc_k dot_k and summ = sum_k mn_k bsum32_k in
 * int32; y = sum_i d_x d sumi - sum_i d_x dmin summ. */
static inline void s_qk_row(const bool q5, const uint8_t *w, int cols, const xrow_t *x, int R, float *out) {
    for (int r = 0; r < R; r++) {
        float acc = 0.0f, accm = 0.0f;
        for (int i = 0; i < cols / 256; i++) {
            const uint8_t *blk = w + (q5 ? 176 : 144) * i, *qs = blk + (q5 ? 48 : 16), *qh = blk + 16;
            const int16_t *bs = x[r].kbs32 + 8 * i;
            int sumi = 0, summ = 0;
            for (int k = 0; k < 8; k++) {
                const uint8_t *q = qs + 32 * (k / 2);
                const int8_t *xq = x[r].kq + 256 * i + 32 * k;
                const int shift = 4 * (k & 1);
                int sc, mn, s = 0;
                q4k_scale_min(k, blk + 4, &sc, &mn);
                for (int l = 0; l < 32; l++) s += (((q[l] >> shift) & 0xF) | (q5 ? ((qh[l] >> k) & 1) << 4 : 0)) * xq[l];
                sumi += sc * s;
                summ += mn * bs[k];
            }
            acc += x[r].kd[i] * f16_at(blk) * (float)sumi;
            accm += x[r].kd[i] * f16_at(blk + 2) * (float)summ;
        }
        out[r] = acc - accm;
    }
}
static void s_q4_k_row(const uint8_t *w, int cols, const xrow_t *x, int R, float *out) { s_qk_row(false, w, cols, x, R, out); }
static void s_q5_k_row(const uint8_t *w, int cols, const xrow_t *x, int R, float *out) { s_qk_row(true, w, cols, x, R, out); }

/* Q6_K on the K activations: per super-block sumi = sum_g sc_g (dot_g(q) - 32 bsum_g) over its 16 groups
 * of 16 (q the unsigned 6-bit value) in int32; y = sum_i d_x d sumi. */
static void s_q6_k_row(const uint8_t *w, int cols, const xrow_t *x, int R, float *out) {
    for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int i = 0; i < cols / 256; i++) {
            const uint8_t *blk = w + 210 * i;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const int16_t *bs = x[r].kbs + 16 * i;
            int sumi = 0;
            for (int k = 0; k < 8; k++) {
                uint8_t q[32];
                q6k_unpack(blk, k, q);
                const int8_t *xq = x[r].kq + 256 * i + 32 * k;
                int sa = 0, sb = 0;
                for (int l = 0; l < 16; l++) sa += q[l] * xq[l];
                for (int l = 16; l < 32; l++) sb += q[l] * xq[l];
                /* groups 2k, 2k+1: elements 0..15 and 16..31 of sub-block k */
                sumi += sc[2 * k] * (sa - 32 * bs[2 * k]) + sc[2 * k + 1] * (sb - 32 * bs[2 * k + 1]);
            }
            acc += x[r].kd[i] * f16_at(blk + 208) * (float)sumi;
        }
        out[r] = acc;
    }
}

ROWS_LOOP(s_q4_0)
ROWS_LOOP(s_q4_1)
ROWS_LOOP(s_q5_0)
ROWS_LOOP(s_q8_0)
ROWS_LOOP(s_q4_k)
ROWS_LOOP(s_q5_k)
ROWS_LOOP(s_q6_k)

/* ---------------------------------------------------------------- interleaved rows (x8) */

size_t cb_cpu_x8_bytes(const cb_weight_t *w) { return k_quant(w->type) ? cb_cpu_k8_bytes(w) : cb_cpu_b8_bytes(w); }

bool cb_cpu_x8_pack(const cb_weight_t *w, void *dst) {
    return k_quant(w->type) ? cb_cpu_k8_pack(w, dst) : cb_cpu_b8_pack(w, dst);
}

void cb_cpu_x8_dequant_row(const cb_weight_t *w, int row, float *dst) {
    if (k_quant(w->type))
        cb_cpu_k8_dequant_row(w, row, dst);
    else
        cb_cpu_b8_dequant_row(w, row, dst);
}

/* ---------------------------------------------------------------- AVX2 kernels */

#if defined(__x86_64__) || defined(__i386__)
#define CB_HAVE_X86 1
#include <cpuid.h>
/* Each kernel set is compiled for its ISA whatever -march says; clang (the fuzz build) has no GCC target
 * pragmas, so it gives every function of the region the same target attribute instead. */
#if defined(__clang__)
#include <immintrin.h>
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#endif

static inline float v_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float v_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum over pairs of u8 u times i8 s (|u| <= 128, |s| <= 127: no int16 saturation), as 8 f32 lanes. */
static inline __m256 v_dot_us(__m256i u, __m256i s) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
/* The same for two signed vectors: |a| times s with a's sign moved onto s. */
static inline __m256 v_dot_ss(__m256i a, __m256i s) { return v_dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(s, a)); }

/* 16 bytes of nibbles as 32 bytes: low nibbles (elements 0..15), then high ones (16..31). */
static inline __m256i v_nibbles(const uint8_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
}

static inline __m256i v_load(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* The kernels are written for R (1..QROWS) rows and inlined with R constant in the row loop of each case
 * of V_ROWS_SWITCH, so the accumulators stay in registers and each weight block is unpacked once for the
 * R rows. */
#define V_ROWS_CASE(fn, RR)                                                                              \
    for (int o = o0; o < o1; o++) {                                                                      \
        float out[QROWS];                                                                                \
        fn##_r((const uint8_t *)w->q + (size_t)o * w->row_bytes, w->cols, x, RR, out);                  \
        for (int r = 0; r < RR; r++) y[(size_t)r * ldy + o] = out[r];                                    \
    }                                                                                                    \
    break;
#define V_ROWS_SWITCH(fn)                                                                                \
    static void fn(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {   \
        switch (R) {                                                                                     \
        case 1: V_ROWS_CASE(fn, 1)                                                                       \
        case 2: V_ROWS_CASE(fn, 2)                                                                       \
        case 3: V_ROWS_CASE(fn, 3)                                                                       \
        default: V_ROWS_CASE(fn, 4)                                                                      \
        }                                                                                                \
    }

static inline __attribute__((always_inline)) void v_q4_0_r(const uint8_t *w, int cols, const xrow_t *x, const int R,
                                                            float *out) {
    __m256 acc[QROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < cols / 32; b++) {
        const uint8_t *blk = w + 18 * b;
        const __m256i wq = _mm256_sub_epi8(v_nibbles(blk + 2), _mm256_set1_epi8(8));
        const float d = v_f16(blk);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), v_dot_ss(wq, v_load(x[r].q + 32 * b)), acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = v_hsum(acc[r]);
}
V_ROWS_SWITCH(v_q4_0)

/* The 32 fifth bits of a Q5_0 block as bytes: 0x10 where bit j of the little-endian u32 at qh is set, else 0
 * (byte j of a broadcast of qh's byte j / 8, tested against its bit j % 8). */
static inline __m256i v_q5_hbits(const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    const __m256i idx = _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll, 0x0303030303030303ll);
    const __m256i rep = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), idx); /* in-lane: each lane holds h */
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit), _mm256_set1_epi8(0x10));
}

/* Q5_0: the 32 codes q - 16 (-16..15) as int8, then v_q4_0_r's signed dot. */
static inline __attribute__((always_inline)) void v_q5_0_r(const uint8_t *w, int cols, const xrow_t *x, const int R,
                                                            float *out) {
    __m256 acc[QROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < cols / 32; b++) {
        const uint8_t *blk = w + 22 * b;
        const __m256i u = _mm256_or_si256(v_nibbles(blk + 6), v_q5_hbits(blk + 2)); /* codes 0..31 */
        const __m256i wq = _mm256_sub_epi8(u, _mm256_set1_epi8(16));
        const float d = v_f16(blk);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), v_dot_ss(wq, v_load(x[r].q + 32 * b)), acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = v_hsum(acc[r]);
}
V_ROWS_SWITCH(v_q5_0)

/* Q4_1 and Q8_0 (the default model's types) take two blocks per step into two accumulators per row, so
 * consecutive blocks' multiply-adds do not wait on each other (indexing the accumulators by block parity
 * instead made GCC keep them on the stack). */
static inline __attribute__((always_inline)) __m256 v_q4_1_blk(const uint8_t *blk, const xrow_t *x, int b, __m256 acc,
                                                                float *accm) {
    const float d = v_f16(blk), m = v_f16(blk + 2);
    *accm += m * x->ds[b];
    return _mm256_fmadd_ps(_mm256_set1_ps(d * x->d[b]), v_dot_us(v_nibbles(blk + 4), v_load(x->q + 32 * b)), acc);
}

static inline __attribute__((always_inline)) void v_q4_1_r(const uint8_t *w, int cols, const xrow_t *x, const int R,
                                                            float *out) {
    __m256 a0[QROWS], a1[QROWS];
    float m0[QROWS], m1[QROWS];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps(), m0[r] = m1[r] = 0.0f;
    const int nb = cols / 32;
    int b = 0;
    for (; b + 1 < nb; b += 2)
        for (int r = 0; r < R; r++) {
            a0[r] = v_q4_1_blk(w + 20 * b, &x[r], b, a0[r], &m0[r]);
            a1[r] = v_q4_1_blk(w + 20 * (b + 1), &x[r], b + 1, a1[r], &m1[r]);
        }
    for (; b < nb; b++)
        for (int r = 0; r < R; r++) a0[r] = v_q4_1_blk(w + 20 * b, &x[r], b, a0[r], &m0[r]);
    for (int r = 0; r < R; r++) out[r] = v_hsum(_mm256_add_ps(a0[r], a1[r])) + (m0[r] + m1[r]);
}
V_ROWS_SWITCH(v_q4_1)

static inline __attribute__((always_inline)) __m256 v_q8_0_blk(const uint8_t *blk, const xrow_t *x, int b, __m256 acc) {
    const __m256i wq = _mm256_loadu_si256((const __m256i *)(blk + 2));
    return _mm256_fmadd_ps(_mm256_set1_ps(v_f16(blk) * x->d[b]), v_dot_ss(wq, v_load(x->q + 32 * b)), acc);
}

static inline __attribute__((always_inline)) void v_q8_0_r(const uint8_t *w, int cols, const xrow_t *x, const int R,
                                                            float *out) {
    __m256 a0[QROWS], a1[QROWS];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    const int nb = cols / 32;
    int b = 0;
    for (; b + 1 < nb; b += 2)
        for (int r = 0; r < R; r++) {
            a0[r] = v_q8_0_blk(w + 34 * b, &x[r], b, a0[r]);
            a1[r] = v_q8_0_blk(w + 34 * (b + 1), &x[r], b + 1, a1[r]);
        }
    for (; b < nb; b++)
        for (int r = 0; r < R; r++) a0[r] = v_q8_0_blk(w + 34 * b, &x[r], b, a0[r]);
    for (int r = 0; r < R; r++) out[r] = v_hsum(_mm256_add_ps(a0[r], a1[r]));
}
V_ROWS_SWITCH(v_q8_0)

/* The 12 packed scale bytes of a Q4_K super-block (at s; 16 bytes are read) as 16 bytes in each 128-bit
 * lane: the 8 six-bit scales, then the 8 mins (q4k_scale_min). Sub-blocks 0..3 take the low 6 bits of
 * bytes 0..3 (scales) and 4..7 (mins); 4..7 a nibble of bytes 8..11 and, as bits 4..5, the top 2 bits of
 * bytes 0..3 / 4..7. */
static inline __m256i v_q4k_scales(const uint8_t *s) {
#define V_LANES2(v) _mm256_set_m128i(v, v)
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)s));
    const __m256i a = _mm256_shuffle_epi8(raw, V_LANES2(_mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11)));
    const __m256i b = _mm256_shuffle_epi8(raw, V_LANES2(_mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7)));
    const __m256i lo = _mm256_and_si256(a, V_LANES2(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(a, 4),
                                        V_LANES2(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
    const __m256i top = _mm256_and_si256(_mm256_srli_epi16(b, 2), _mm256_set1_epi8(0x30)); /* (byte >> 6) << 4 */
    return _mm256_or_si256(_mm256_or_si256(lo, hi), top);
#undef V_LANES2
}

/* The K kernels prefetch the weight bytes this far ahead of the super-block they read (rows are contiguous,
 * so this runs into the next rows). A decode streams every weight from DRAM once per token: with the
 * hardware prefetchers alone one thread read Q4_K / Q6_K rows at ~12 GB/s, with this ~17 (2-8 KiB ahead
 * all alike, 1 KiB ~13; a plain read loop gets ~19 here). */
#define K_PREFETCH 4096

/* Prefetches n cache lines from K_PREFETCH bytes past p (a hint: no fault, whatever the address; formed as
 * an integer since it may lie past the weight's end). */
static inline void v_prefetch_ahead(const uint8_t *p, int n) {
    const uintptr_t a = (uintptr_t)p + K_PREFETCH;
    for (int k = 0; k < n; k++) _mm_prefetch((const char *)(a + 64 * (uintptr_t)k), _MM_HINT_T0);
}

/* Each byte's bit k (0..7) moved to bit 4 (other bits are garbage: mask with 0x10). */
static inline __m256i v_bit_to4(__m256i v, int k) {
    return k < 4 ? _mm256_slli_epi16(v, 4 - k) : k > 4 ? _mm256_srli_epi16(v, k - 4) : v;
}

/* pshufb pattern broadcasting int16 lane l (0..7) of a 128-bit lane. */
#define V_LANE16(l) ((short)(((2 * (l) + 1) << 8) | (2 * (l))))

/* Q4_K (and Q5_K, its fifth bits ORed in from qh): per super-block, the 4 chunks of 32 nibble bytes (sub-blocks 2c low, 2c+1 high) against the
 * activation's int8 (maddubs: u8 x s8 pairs, |pair| <= 2 * 15 * 127), then madd with the sub-block's scale
 * as int16, so each row's 8 int32 lanes sum sc_k dot_k exactly (per lane < 2^22); one conversion and one
 * FMA by d_x d per super-block. The mins: one madd of the 8 mins with the activation's 8 sums per 32
 * (4 lanes), one conversion and FMA by d_x dmin. */
static inline __attribute__((always_inline)) void v_qk_r(const bool q5, const uint8_t *w, int cols, const xrow_t *x,
                                                          const int R, float *out) {
    __m256 acc[QROWS];
    __m128 accm[QROWS];
    const __m256i m4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), accm[r] = _mm_setzero_ps();
    for (int i = 0; i < cols / 256; i++) {
        const uint8_t *blk = w + (q5 ? 176 : 144) * i;
        v_prefetch_ahead(blk, 3);
        uint32_t dpair;
        memcpy(&dpair, blk, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dpair)); /* d, dmin */
        const __m256i sm = v_q4k_scales(blk + 4);
        const __m256i sc = _mm256_unpacklo_epi8(sm, zero);                         /* 8 scales, int16, per lane */
        const __m128i mn = _mm256_castsi256_si128(_mm256_unpackhi_epi8(sm, zero)); /* 8 mins */
        __m256i sumi[QROWS];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
        #pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + (q5 ? 48 : 16) + 32 * c));
            __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (q5) { /* bits 2c and 2c + 1 of qh[l] to bit 4 */
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16)), b4 = _mm256_set1_epi8(0x10);
                lo = _mm256_or_si256(lo, _mm256_and_si256(v_bit_to4(qh, 2 * c), b4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(v_bit_to4(qh, 2 * c + 1), b4));
            }
            const __m256i sl = _mm256_shuffle_epi8(sc, _mm256_set1_epi16(V_LANE16(2 * c)));
            const __m256i sh = _mm256_shuffle_epi8(sc, _mm256_set1_epi16(V_LANE16(2 * c + 1)));
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r].kq + 256 * i + 64 * c;
                const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, v_load(xq)), sl);
                const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, v_load(xq + 32)), sh);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m128 f = _mm_mul_ps(dm, _mm_set1_ps(x[r].kd[i])); /* d_x d, d_x dmin */
            acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(f), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            const __m128i pm = _mm_madd_epi16(mn, _mm_loadu_si128((const __m128i *)(x[r].kbs32 + 8 * i)));
            accm[r] = _mm_fmadd_ps(_mm_permute_ps(f, 0x55), _mm_cvtepi32_ps(pm), accm[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        __m128 m = _mm_add_ps(accm[r], _mm_movehl_ps(accm[r], accm[r]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[r] = v_hsum(acc[r]) - _mm_cvtss_f32(m);
    }
}
static inline __attribute__((always_inline)) void v_q4_k_r(const uint8_t *w, int cols, const xrow_t *x, const int R,
                                                            float *out) {
    v_qk_r(false, w, cols, x, R, out);
}
static inline __attribute__((always_inline)) void v_q5_k_r(const uint8_t *w, int cols, const xrow_t *x, const int R,
                                                            float *out) {
    v_qk_r(true, w, cols, x, R, out);
}
V_ROWS_SWITCH(v_q4_k)
V_ROWS_SWITCH(v_q5_k)

/* Q6_K: per super-block, the 8 sub-blocks of 32 unsigned 6-bit q (ql nibble | 2 qh bits << 4) against the
 * activation's int8 (maddubs, |pair| <= 2 * 63 * 127), then madd with the two groups' scales (lanes 0..7:
 * group 2k, 8..15: 2k+1, from the 16 scales as int16 by one shuffle); the offset 32 sum_g sc_g bsum_g is one
 * madd of the 16 scales with the 16 sums. One conversion and one FMA by d_x d per super-block. */
static inline __attribute__((always_inline)) void v_q6_k_r(const uint8_t *w, int cols, const xrow_t *x, const int R,
                                                            float *out) {
    __m256 acc[QROWS];
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int i = 0; i < cols / 256; i++) {
        const uint8_t *blk = w + 210 * i;
        v_prefetch_ahead(blk, 4);
        const float d = v_f16(blk + 208);
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m256i sa = _mm256_permute4x64_epi64(s16, 0x44), sb = _mm256_permute4x64_epi64(s16, 0xEE);
        __m256i sumi[QROWS];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i qla = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i qlb = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            #pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                const __m256i ql = t & 1 ? qlb : qla;
                const __m256i lo = t < 2 ? _mm256_and_si256(ql, m4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
                /* bits 2t, 2t+1 of qh to bits 4, 5 (masked first: nothing crosses a byte) */
                const __m256i hm = _mm256_and_si256(qh, _mm256_set1_epi8((char)(3 << (2 * t))));
                const __m256i hb = t == 0 ? _mm256_slli_epi16(hm, 4) : t == 1 ? _mm256_slli_epi16(hm, 2)
                                 : t == 2 ? hm : _mm256_srli_epi16(hm, 2);
                const __m256i q = _mm256_or_si256(lo, hb);
                /* scales of groups 2k, 2k+1 (k = 4h + t): int16 lanes 2t, 2t+1 of half h of the 16 */
                const __m256i scv = _mm256_shuffle_epi8(
                    h ? sb : sa, _mm256_set_m128i(_mm_set1_epi16(V_LANE16(2 * t + 1)), _mm_set1_epi16(V_LANE16(2 * t))));
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const __m256i xq = v_load(x[r].kq + 256 * i + 32 * (4 * h + t));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), scv));
                }
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(x[r].kbs + 16 * i));
            const __m256i s = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(_mm256_madd_epi16(s16, bs), 5));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r].kd[i] * d), _mm256_cvtepi32_ps(s), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = v_hsum(acc[r]);
}
V_ROWS_SWITCH(v_q6_k)

/* s_q8k_quantize with 8 lanes, the same bits (as v_q8_quantize); the sums per 16 and 32 are exact. */
static void v_q8k_quantize(const float *x, int cols, void *dst) {
    int8_t *q = dst;
    float *d = (float *)((uint8_t *)dst + cols);
    int16_t *bs = (int16_t *)(d + cols / 256), *bs32 = bs + cols / 16;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    for (int i = 0; i < cols / 256; i++) {
        const float *xb = x + 256 * i;
        __m256 am = _mm256_setzero_ps();
        for (int k = 0; k < 32; k++) am = _mm256_max_ps(am, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * k)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float db = amax / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
        const __m256 idv = _mm256_set1_ps(id);
        for (int b = 0; b < 8; b++) { /* 32 elements: two groups of 16 */
            __m256i iv[4];
            for (int k = 0; k < 4; k++) {
                const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 32 * b + 8 * k), idv),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                iv[k] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(r), lim), nlim);
            }
            const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
            _mm256_storeu_si256((__m256i *)(q + 256 * i + 32 * b),
                                _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            /* lanes 0 and 1 of the last sum: elements 0..15 and 16..31 */
            __m256i h = _mm256_hadd_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
            h = _mm256_hadd_epi32(h, h);
            const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            bs[16 * i + 2 * b] = (int16_t)_mm_cvtsi128_si32(s);
            bs[16 * i + 2 * b + 1] = (int16_t)_mm_extract_epi32(s, 1);
            bs32[8 * i + b] = (int16_t)(bs[16 * i + 2 * b] + bs[16 * i + 2 * b + 1]);
        }
        d[i] = db;
    }
}

/* s_q8_quantize with 8 lanes, the same bits: max|x| is exact in any order, d and 1/d are the same scalar
 * divisions, round-to-nearest-even is nearbyintf in the default mode, and the clamp and the integer sum
 * are exact. */
static void v_q8_quantize(const float *x, int cols, void *dst) {
    int8_t *q = dst;
    float *d = (float *)((uint8_t *)dst + cols), *ds = d + cols / 32;
    int16_t *bs = (int16_t *)(ds + cols / 32);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    for (int b = 0; b < cols / 32; b++) {
        const float *xb = x + 32 * b;
        __m256 v[4], am = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(xb + 8 * k);
            am = _mm256_max_ps(am, _mm256_andnot_ps(sign, v[k]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float db = amax / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
        const __m256 idv = _mm256_set1_ps(id);
        __m256i iv[4], sum = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            iv[k] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(r), lim), nlim);
            sum = _mm256_add_epi32(sum, iv[k]);
        }
        /* int32 -> int8 (values fit): packs, then undo the lane interleave of the two 256-bit packs */
        const __m256i p16a = _mm256_packs_epi32(iv[0], iv[1]), p16b = _mm256_packs_epi32(iv[2], iv[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        _mm256_storeu_si256((__m256i *)(q + 32 * b),
                            _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        d[b] = db;
        ds[b] = db * (float)_mm_cvtsi128_si32(s4);
        bs[b] = (int16_t)_mm_cvtsi128_si32(s4);
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif

/* ---------------------------------------------------------------- dispatch */

typedef struct {
    const char *name;
    qdot_fn q4_0, q4_1, q5_0, q8_0, q4_k, q5_k, q6_k;
    qdot_fn b8, k8; /* interleaved weights (w->x8): Q4_0 / Q4_1 / Q5_0 / Q8_0, K-quants; QROWS rows per call */
    qdot_fn q4_1v16; /* the 16-row layout (w->v16) */
    int v16_rows;
    qdot_fn k8_rows, b8_rows; /* Q5_K's and Q5_0's x8 kernels for calls of more than QROWS rows; NULL: none */
    qdot_fn x8_amx;  /* w->x8 in tiles of 16 weight rows by 16..XROWS activation rows; NULL: none */
} qdot_set_t;

static const qdot_set_t SCALAR = {"scalar", s_q4_0, s_q4_1, s_q5_0, s_q8_0, s_q4_k, s_q5_k, s_q6_k, cb_cpu_b8_scalar, cb_cpu_k8_scalar,
                                   cb_cpu_v16_scalar, QROWS, NULL, NULL, NULL};
#ifdef CB_HAVE_X86
static const qdot_set_t AVX2 = {"avx2", v_q4_0, v_q4_1, v_q5_0, v_q8_0, v_q4_k, v_q5_k, v_q6_k, cb_cpu_b8_avx2, cb_cpu_k8_avx2,
                                 cb_cpu_v16_scalar, QROWS, cb_cpu_k8_rows_avx2, cb_cpu_b8_rows_avx2, NULL};
/* AVX-512 VNNI for the interleaved layouts (x8 on 256-bit vectors, v16 on 512-bit ones), AVX2 for the stored
 * rows */
static const qdot_set_t VNNI = {"avx512vnni", v_q4_0, v_q4_1, v_q5_0, v_q8_0, v_q4_k, v_q5_k, v_q6_k, cb_cpu_b8_vnni, cb_cpu_k8_vnni,
                                cb_cpu_v16_vnni, CB_V16_ROWS, cb_cpu_k8_rows_vnni, cb_cpu_b8_rows_vnni, NULL};
/* The x8 kernels of the VNNI set with their vpdpbusd emulated in AVX2 (and Q4_1 in x8, as v16 needs VNNI):
 * for testing that set's arithmetic on any AVX2 CPU. */
static const qdot_set_t VNNI_EMU = {"avx512vnni-emulated", v_q4_0, v_q4_1, v_q5_0, v_q8_0, v_q4_k, v_q5_k, v_q6_k,
                                    cb_cpu_b8_vnni_emu, cb_cpu_k8_vnni_emu, cb_cpu_v16_scalar, QROWS,
                                    cb_cpu_k8_rows_vnni_emu, cb_cpu_b8_rows_vnni_emu, NULL};
/* AMX-INT8 tiles for the x8 copies' products of 16 activation rows or more (prefill), the VNNI set's x8
 * kernels for fewer (decode) and for what the 16-row tiles leave. Q4_1 is copied as x8 (no v16) so that its
 * prefill takes the tiles too. */
static const qdot_set_t AMX = {"amx", v_q4_0, v_q4_1, v_q5_0, v_q8_0, v_q4_k, v_q5_k, v_q6_k, cb_cpu_b8_vnni, cb_cpu_k8_vnni,
                               cb_cpu_v16_scalar, QROWS, cb_cpu_k8_rows_vnni, cb_cpu_b8_rows_vnni, cb_cpu_x8_amx};
/* The amx set's kernel with the tile unit emulated in C, the AVX2 x8 kernels beside it: for testing its logic
 * on any AVX2 CPU (slow: the emulation is plain loops). */
static const qdot_set_t AMX_EMU = {"amx-emulated", v_q4_0, v_q4_1, v_q5_0, v_q8_0, v_q4_k, v_q5_k, v_q6_k, cb_cpu_b8_avx2,
                                   cb_cpu_k8_avx2, cb_cpu_v16_scalar, QROWS, cb_cpu_k8_rows_avx2, cb_cpu_b8_rows_avx2,
                                   cb_cpu_x8_amx_emu};
#endif

static const qdot_set_t *g_set;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static bool have_vnni(void) {
#ifdef CB_HAVE_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
}

/* AMX-INT8 (CPUID.(7,0):EDX bits 24 and 25) with the kernel's leave to use the tile data (Linux: arch_prctl
 * ARCH_REQ_XCOMP_PERM, asked once per process), beside the VNNI set the amx set falls back on. */
static bool g_amx;
static pthread_once_t g_amx_once = PTHREAD_ONCE_INIT;
static void amx_init(void) {
#if defined(CB_HAVE_X86) && defined(__linux__)
    unsigned a, b, c, d;
    if (have_vnni() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1))
        g_amx = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#endif
}
static bool have_amx(void) {
    pthread_once(&g_amx_once, amx_init);
    return g_amx;
}

static bool have_avx2(void) {
#ifdef CB_HAVE_X86
    __builtin_cpu_init();
#if defined(__clang__)
    /* clang's __builtin_cpu_supports knows no "f16c": CPUID.1:ECX bit 29 (the AVX2 test covers the OS's YMM state) */
    unsigned a, b, c, d;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __get_cpuid(1, &a, &b, &c, &d) &&
           (c & bit_F16C);
#else
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
#else
    return false;
#endif
}

static void quantize_init(void) {
#ifdef CB_HAVE_X86
    const char *e = getenv("CB_CPU_ISA");
    const bool v = have_avx2() && !(e && !strcmp(e, "scalar"));
    g_quantize = v ? v_q8_quantize : s_q8_quantize;
    g_quantize_k = v ? v_q8k_quantize : s_q8k_quantize;
#else
    g_quantize = s_q8_quantize;
    g_quantize_k = s_q8k_quantize;
#endif
}

static void init_once(void) {
    const char *e = getenv("CB_CPU_ISA");
    if (cb_cpu_qdot_use(e && *e ? e : NULL) != 0) cb_cpu_qdot_use(NULL);
}

int cb_cpu_qdot_use(const char *isa) {
    if (!isa) {
#ifdef CB_HAVE_X86
        g_set = have_avx2() && have_vnni() ? &VNNI : have_avx2() ? &AVX2 : &SCALAR; /* amx: opt-in until measured */
#else
        g_set = &SCALAR;
#endif
        return 0;
    }
    if (!strcmp(isa, "scalar")) {
        g_set = &SCALAR;
        return 0;
    }
#ifdef CB_HAVE_X86
    if (!strcmp(isa, "avx2") && have_avx2()) {
        g_set = &AVX2;
        return 0;
    }
    if (!strcmp(isa, "avx512vnni") && have_avx2() && have_vnni()) {
        g_set = &VNNI;
        return 0;
    }
    if (!strcmp(isa, "avx512vnni-emulated") && have_avx2()) {
        g_set = &VNNI_EMU;
        return 0;
    }
    if (!strcmp(isa, "amx") && have_avx2() && have_amx()) {
        g_set = &AMX;
        return 0;
    }
    if (!strcmp(isa, "amx-emulated") && have_avx2()) {
        g_set = &AMX_EMU;
        return 0;
    }
#endif
    return -1;
}

static const qdot_set_t *kernels(void) {
    pthread_once(&g_once, init_once);
    return g_set;
}

const char *cb_cpu_qdot_isa(void) { return kernels()->name; }

bool cb_cpu_v16_preferred(void) { return kernels()->q4_1v16 != cb_cpu_v16_scalar; }

bool cb_cpu_qdot_gemm(const cb_weight_t *w) {
    if (w->f32) return false;
    if (w->v16) return true;
    return w->x8 && kernels()->k8 != cb_cpu_k8_scalar;
}

static qdot_fn kernel_of(const qdot_set_t *k, uint32_t type) {
    switch (type) {
    case CB_TYPE_Q4_0: return k->q4_0;
    case CB_TYPE_Q4_1: return k->q4_1;
    case CB_TYPE_Q5_0: return k->q5_0;
    case CB_TYPE_Q8_0: return k->q8_0;
    case CB_TYPE_Q4_K: return k->q4_k;
    case CB_TYPE_Q5_K: return k->q5_k;
    case CB_TYPE_Q6_K: return k->q6_k;
    default: return NULL;
    }
}

unsigned cb_cpu_qdot_format(const cb_weight_t *w) {
    return k_quant(w->type) ? CB_CPU_Q8_K : CB_CPU_Q8_B32;
}

bool cb_cpu_qdot_supported(const cb_weight_t *w) {
    const int blk = k_quant(w->type) ? 256 : 32;
    return kernel_of(&SCALAR, w->type) && w->cols > 0 && w->cols % blk == 0;
}

/* Rows [r0, r1) of a call by fn, step rows at a time (at most XROWS). */
static void run_rows(qdot_fn fn, int step, const cb_weight_t *w, int o0, int o1, const void *xq, int r0, int r1, float *y,
                     int ldy) {
    assert(step <= XROWS);
    for (; r0 < r1; r0 += step) {
        const int R = r1 - r0 < step ? r1 - r0 : step;
        xrow_t xs[XROWS];
        for (int r = 0; r < R; r++) xs[r] = xrow(xq, w->cols, r0 + r);
        fn(w, o0, o1, xs, R, y + (size_t)r0 * ldy, ldy);
    }
}

/* Activation rows per call of the many-row x8 kernels (the 5-bit types, Q5_K and Q5_0): each group
 * super-block (or 8 blocks) is unpacked once for this many rows, whose int8 data (X8_MANY x cols bytes) stays
 * in L2 while the slice's groups pass (64 rows measured slower on 8960 columns, the activations then coming
 * from L3). */
#define X8_MANY 16

/* Rows [r0, r1) of an x8 call over [o0, o1): for more than QROWS rows of Q5_K or Q5_0, the set's many-row
 * kernel (their fifth bits unpacked once per X8_MANY rows); else its x8 kernel QROWS rows at a time. (The
 * same structure gave Q4_K, Q6_K, Q4_0 and Q4_1 nothing or less: their unpacking is a mask or shift per
 * vector.) */
static void x8_rows(const qdot_set_t *k, const cb_weight_t *w, int o0, int o1, const void *xq, int r0, int r1, float *y,
                    int ldy) {
    const bool kq = k_quant(w->type);
    const qdot_fn many = w->type == CB_TYPE_Q5_K ? k->k8_rows : w->type == CB_TYPE_Q5_0 ? k->b8_rows : NULL;
    if (many && r1 - r0 > QROWS) run_rows(many, X8_MANY, w, o0, o1, xq, r0, r1, y, ldy);
    else run_rows(kq ? k->k8 : k->b8, QROWS, w, o0, o1, xq, r0, r1, y, ldy);
}

void cb_cpu_qdot_rows(const cb_weight_t *w, int o0, int o1, const void *xq, int n, float *y, int ldy) {
    const qdot_set_t *k = kernels();
    assert(cb_cpu_qdot_supported(w));
    if (w->v16 && o0 % 16 == 0 && o1 % 16 == 0) {
        run_rows(k->q4_1v16, k->v16_rows, w, o0, o1, xq, 0, n, y, ldy);
    } else if (w->x8 && o0 % 8 == 0 && o1 % 8 == 0) {
        if (k->x8_amx && n >= 16 && o1 - o0 >= 16) { /* tiles of 16 x 16; the rest by the x8 kernels */
            const int n16 = n / 16 * 16, om = o0 + (o1 - o0) / 16 * 16;
            run_rows(k->x8_amx, XROWS, w, o0, om, xq, 0, n16, y, ldy);
            if (om < o1) x8_rows(k, w, om, o1, xq, 0, n16, y, ldy);
            x8_rows(k, w, o0, o1, xq, n16, n, y, ldy);
        } else {
            x8_rows(k, w, o0, o1, xq, 0, n, y, ldy);
        }
    } else {
        run_rows(kernel_of(k, w->type), QROWS, w, o0, o1, xq, 0, n, y, ldy);
    }
}
