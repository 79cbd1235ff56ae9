/* cpu_quant_b8.c: Q4_0, Q4_1, Q5_0 and Q8_0 weight rows interleaved by 8 ("b8", the x8 form of the types
 * with blocks of 32; layout in cpu_quant.h) and their integer kernels, scalar and AVX2.
 *
 * As the K-quants' k8 form (cpu_quant_k8.c): each 32-byte vector of a group block holds 4 consecutive
 * elements of each of the 8 rows (row slot s at bytes 4s..4s+3), so one maddubs against the activation's
 * matching 4 bytes, broadcast, gives every row its pair sums: no horizontal sums, and one unpacked weight
 * vector serves up to QROWS activation rows. The codes are multiplied unsigned (Q4_0 nibbles 0..15, Q5_0
 * codes 0..31, Q4_1 nibbles) and the offset is taken off through the activation block's integer sum:
 * sumi = sum_j u_j q_j - 8 bs (Q4_0) or - 16 bs (Q5_0), exact in int32. Q8_0 multiplies |w| by q with w's
 * sign (|w| <= 128, so a pair is at most 2 * 128 * 127 and -128 needs no special case).
 * int16 partial sums before the int32 fold: 4-bit codes, 8 maddubs (<= 8 * 2 * 15 * 127 = 30480); Q5_0, 4
 * (<= 4 * 2 * 31 * 127 = 31496); Q8_0, 1. Then per block and row, in f32:
 * acc = fma(sumi, d_w d_x, acc), and for Q4_1 acc = fma(m_w, ds_x, acc). The scalar kernels do the same
 * operations in the same order, so both sets give the same bits. */
#include "cpu/cpu_quant_internal.h"

#include <assert.h>
#include <math.h>

#include "format/gguf.h"

/* Group block offsets: f16 d[8] at 0; Q4_1's f16 m[8] at 16; the codes; Q5_0's fifth bits. */
#define B8_Q4_0 144 /* d, qs[4 steps][8 rows][4] */
#define B8_Q4_1 160 /* d, m, qs[4][8][4] */
#define B8_Q5_0 176 /* d, qs[4][8][4], qh[8 rows][4] */
#define B8_Q8_0 272 /* d, q[8 steps][8 rows][4] */
/* 4-bit codes: step t (0..3) holds row s's stored nibble bytes 4t..4t+3: low nibbles elements 4t + j,
 * high nibbles 16 + 4t + j (j = 0..3). Q5_0's fifth bits: byte 4s + j, bit t = element 4t + j's, bit 4 + t
 * = element 16 + 4t + j's. Q8_0: step t (0..7) holds row s's elements 4t..4t+3. */
static size_t qs_at(uint32_t type) { return type == CB_TYPE_Q4_1 ? 32 : 16; }
#define B8_QH 144

static bool b8_type(uint32_t type) {
    return type == CB_TYPE_Q4_0 || type == CB_TYPE_Q4_1 || type == CB_TYPE_Q5_0 || type == CB_TYPE_Q8_0;
}

static size_t blk_bytes(uint32_t type) {
    switch (type) {
    case CB_TYPE_Q4_0: return B8_Q4_0;
    case CB_TYPE_Q4_1: return B8_Q4_1;
    case CB_TYPE_Q5_0: return B8_Q5_0;
    default: return B8_Q8_0;
    }
}

static const uint8_t *group_blk(const cb_weight_t *w, int g, int b) {
    return (const uint8_t *)w->x8 + ((size_t)g * (size_t)(w->cols / 32) + (size_t)b) * blk_bytes(w->type);
}

size_t cb_cpu_b8_bytes(const cb_weight_t *w) {
    if (!b8_type(w->type)) return 0;
    if (w->rows <= 0 || w->rows % 8 || w->cols <= 0 || w->cols % 32) return 0;
    return (size_t)(w->rows / 8) * (size_t)(w->cols / 32) * blk_bytes(w->type);
}

/* Row slot s of the stored block src into the group block dst. */
static void pack_blk(uint32_t type, const uint8_t *src, int s, uint8_t *dst) {
    memcpy(dst + 2 * s, src, 2); /* d */
    switch (type) {
    case CB_TYPE_Q4_0:
        for (int t = 0; t < 4; t++) memcpy(dst + 16 + 32 * t + 4 * s, src + 2 + 4 * t, 4);
        break;
    case CB_TYPE_Q4_1:
        memcpy(dst + 16 + 2 * s, src + 2, 2); /* m */
        for (int t = 0; t < 4; t++) memcpy(dst + 32 + 32 * t + 4 * s, src + 4 + 4 * t, 4);
        break;
    case CB_TYPE_Q5_0: {
        const uint32_t h = (uint32_t)src[2] | (uint32_t)src[3] << 8 | (uint32_t)src[4] << 16 | (uint32_t)src[5] << 24;
        for (int t = 0; t < 4; t++) memcpy(dst + 16 + 32 * t + 4 * s, src + 6 + 4 * t, 4);
        for (int j = 0; j < 4; j++) {
            unsigned v = 0;
            for (int t = 0; t < 4; t++) v |= ((h >> (4 * t + j)) & 1u) << t | ((h >> (16 + 4 * t + j)) & 1u) << (4 + t);
            dst[B8_QH + 4 * s + j] = (uint8_t)v;
        }
        break;
    }
    default: /* Q8_0 */
        for (int t = 0; t < 8; t++) memcpy(dst + 16 + 32 * t + 4 * s, src + 2 + 4 * t, 4);
        break;
    }
}

bool cb_cpu_b8_pack(const cb_weight_t *w, void *dst) {
    if (!cb_cpu_b8_bytes(w)) return false;
    const int nb = w->cols / 32;
    const size_t sb = (size_t)cb_type_block_bytes(w->type);
    /* groups in parallel: the copy's first touch (page faults, zeroing) is most of the cost */
    #pragma omp parallel for schedule(static)
    for (int g = 0; g < w->rows / 8; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *o = (uint8_t *)dst + ((size_t)g * (size_t)nb + (size_t)b) * blk_bytes(w->type);
            for (int s = 0; s < 8; s++)
                pack_blk(w->type, (const uint8_t *)w->q + (size_t)(8 * g + s) * w->row_bytes + sb * (size_t)b, s, o);
        }
    return true;
}

/* Element e (0..31) of row slot s in a group block: the code as the kernels multiply it (Q4_0 and Q4_1
 * nibbles 0..15, Q5_0 codes 0..31, Q8_0 int8). */
static inline int code_at(uint32_t type, const uint8_t *blk, int s, int e) {
    if (type == CB_TYPE_Q8_0) return (int8_t)blk[16 + 32 * (e / 4) + 4 * s + e % 4];
    const int hi = e >= 16, t = (e % 16) / 4, j = e % 4;
    const uint8_t v = blk[qs_at(type) + 32 * (size_t)t + 4 * (size_t)s + (size_t)j];
    int c = hi ? v >> 4 : v & 0xF;
    if (type == CB_TYPE_Q5_0) c |= ((blk[B8_QH + 4 * s + j] >> (4 * hi + t)) & 1) << 4;
    return c;
}

/* Bit-identical to cb_dequant of the stored row (format/quant.c's expressions). */
void cb_cpu_b8_dequant_row(const cb_weight_t *w, int row, float *dst) {
    const int g = row / 8, s = row % 8;
    for (int b = 0; b < w->cols / 32; b++) {
        const uint8_t *blk = group_blk(w, g, b);
        const float d = f16_at(blk + 2 * s);
        float *y = dst + 32 * b;
        switch (w->type) {
        case CB_TYPE_Q4_0:
            for (int e = 0; e < 32; e++) y[e] = (float)(code_at(w->type, blk, s, e) - 8) * d;
            break;
        case CB_TYPE_Q4_1: {
            const float m = f16_at(blk + 16 + 2 * s);
            for (int e = 0; e < 32; e++) y[e] = (float)code_at(w->type, blk, s, e) * d + m;
            break;
        }
        case CB_TYPE_Q5_0:
            for (int e = 0; e < 32; e++) y[e] = (float)(code_at(w->type, blk, s, e) - 16) * d;
            break;
        default:
            for (int e = 0; e < 32; e++) y[e] = (float)code_at(w->type, blk, s, e) * d;
            break;
        }
    }
}

/* The offset of the unsigned codes (taken off through the activation block's sum). */
static inline int code_offset(uint32_t type) { return type == CB_TYPE_Q4_0 ? 8 : type == CB_TYPE_Q5_0 ? 16 : 0; }

/* ---------------------------------------------------------------- scalar */

void cb_cpu_b8_scalar(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    assert(o0 % 8 == 0 && o1 % 8 == 0 && R >= 1 && R <= QROWS);
    const int off = code_offset(w->type);
    for (int o = o0; o < o1; o++)
        for (int r = 0; r < R; r++) {
            const int s = o % 8;
            float acc = 0.0f;
            for (int b = 0; b < w->cols / 32; b++) {
                const uint8_t *blk = group_blk(w, o / 8, b);
                const int8_t *xq = x[r].q + 32 * b;
                int sumi = 0;
                for (int e = 0; e < 32; e++) sumi += code_at(w->type, blk, s, e) * xq[e];
                sumi -= off * x[r].bs[b];
                acc = fmaf((float)sumi, f16_at(blk + 2 * s) * x[r].d[b], acc);
                if (w->type == CB_TYPE_Q4_1) acc = fmaf(f16_at(blk + 16 + 2 * s), x[r].ds[b], acc);
            }
            y[(size_t)r * ldy + o] = acc;
        }
}

/* ---------------------------------------------------------------- AVX2 */

#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__)
#include <immintrin.h>
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#endif

/* 4 bytes at p, broadcast to the 8 int32 lanes. */
static inline __m256i b4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Decode streams each weight from DRAM once per token: prefetch this far ahead (a hint: the address may lie
 * past the copy's end). */
#define B8_PREFETCH 4096

/* One group of 8 weight rows of 4- or 5-bit codes against R activation rows, over nb blocks; out[r] = the 8
 * rows' dot products with activation row r. */
static inline __attribute__((always_inline)) void v_nib_g(const uint32_t type, const uint8_t *blk, int nb,
                                                           const xrow_t *x, const int R, __m256 *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), b4bit = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
    const size_t bb = blk_bytes(type), qs = qs_at(type);
    const int off = code_offset(type);
    __m256 acc[QROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, blk += bb) {
        _mm_prefetch((const char *)(blk + B8_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + B8_PREFETCH + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + B8_PREFETCH + 128), _MM_HINT_T0);
        __m256i si[QROWS], s16[QROWS];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) si[r] = s16[r] = _mm256_setzero_si256();
        const __m256i qh = type == CB_TYPE_Q5_0 ? _mm256_loadu_si256((const __m256i *)(blk + B8_QH)) : m4;
        #pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + qs + 32 * t));
            __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (type == CB_TYPE_Q5_0) { /* bit t of each qh byte, and bit 4 + t, to bit 4 */
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4 - t), b4bit));
                hi = _mm256_or_si256(hi, _mm256_and_si256(t == 0 ? qh : _mm256_srli_epi16(qh, t), b4bit));
            }
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r].q + 32 * b;
                s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, b4(xq + 4 * t)),
                                                                   _mm256_maddubs_epi16(hi, b4(xq + 16 + 4 * t))));
            }
            if (type == CB_TYPE_Q5_0 ? t % 2 == 1 : t == 3) {
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    si[r] = _mm256_add_epi32(si[r], _mm256_madd_epi16(s16[r], ones));
                    s16[r] = _mm256_setzero_si256();
                }
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            if (off) si[r] = _mm256_sub_epi32(si[r], _mm256_set1_epi32(off * x[r].bs[b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[r]), _mm256_mul_ps(d, _mm256_set1_ps(x[r].d[b])), acc[r]);
            if (type == CB_TYPE_Q4_1)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))),
                                         _mm256_set1_ps(x[r].ds[b]), acc[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

/* One Q8_0 group against R activation rows (as v_nib_g): |w| times q with w's sign, folded to int32 per
 * step (a pair reaches 2 * 128 * 127). */
static inline __attribute__((always_inline)) void v_q8_g(const uint8_t *blk, int nb, const xrow_t *x, const int R,
                                                          __m256 *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[QROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, blk += B8_Q8_0) {
        for (int k = 0; k < 5; k++) _mm_prefetch((const char *)(blk + B8_PREFETCH + 64 * k), _MM_HINT_T0);
        __m256i si[QROWS];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) si[r] = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m256i wq = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * t)), aw = _mm256_abs_epi8(wq);
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                si[r] = _mm256_add_epi32(
                    si[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(b4(x[r].q + 32 * b + 4 * t), wq)),
                                             ones));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[r]), _mm256_mul_ps(d, _mm256_set1_ps(x[r].d[b])), acc[r]);
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

#define B8_CASE(call, RR)                                                                                \
    for (int g = o0 / 8; g < o1 / 8; g++) {                                                              \
        __m256 out[QROWS];                                                                               \
        const uint8_t *blk = group_blk(w, g, 0);                                                         \
        call;                                                                                            \
        for (int r = 0; r < RR; r++) _mm256_storeu_ps(y + (size_t)r * ldy + 8 * g, out[r]);              \
    }                                                                                                    \
    break;
#define B8_SWITCH(fn, ...)                                                                               \
    switch (R) {                                                                                         \
    case 1: B8_CASE(fn(__VA_ARGS__, blk, nb, x, 1, out), 1)                                             \
    case 2: B8_CASE(fn(__VA_ARGS__, blk, nb, x, 2, out), 2)                                             \
    case 3: B8_CASE(fn(__VA_ARGS__, blk, nb, x, 3, out), 3)                                             \
    default: B8_CASE(fn(__VA_ARGS__, blk, nb, x, 4, out), 4)                                            \
    }

void cb_cpu_b8_avx2(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    assert(o0 % 8 == 0 && o1 % 8 == 0 && R >= 1 && R <= QROWS);
    const int nb = w->cols / 32;
    switch (w->type) {
    case CB_TYPE_Q4_0: B8_SWITCH(v_nib_g, CB_TYPE_Q4_0) break;
    case CB_TYPE_Q4_1: B8_SWITCH(v_nib_g, CB_TYPE_Q4_1) break;
    case CB_TYPE_Q5_0: B8_SWITCH(v_nib_g, CB_TYPE_Q5_0) break;
    default:
        switch (R) {
        case 1: B8_CASE(v_q8_g(blk, nb, x, 1, out), 1)
        case 2: B8_CASE(v_q8_g(blk, nb, x, 2, out), 2)
        case 3: B8_CASE(v_q8_g(blk, nb, x, 3, out), 3)
        default: B8_CASE(v_q8_g(blk, nb, x, 4, out), 4)
        }
        break;
    }
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
void cb_cpu_b8_avx2(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    cb_cpu_b8_scalar(w, o0, o1, x, R, y, ldy);
}
#endif
