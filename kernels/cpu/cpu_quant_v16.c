/* cpu_quant_v16.c: the 16-row VNNI layout of Q4_1 weights ("v16", cpu_quant.h): the copy, its dequantization,
 * the scalar kernel (the stored layout's arithmetic and bits) and the AVX-512 VNNI kernel. */
#include "cpu/cpu_quant.h"
#include "cpu/cpu_quant_internal.h"

#include "format/gguf.h"

/* ---------------------------------------------------------------- 16-row VNNI layout (v16) */

#define V16_BLK 320 /* 16 x 20 */
static inline const uint8_t *v16_block(const cb_weight_t *w, int g, int b) {
    return (const uint8_t *)w->v16 + ((size_t)g * (size_t)(w->cols / 32) + (size_t)b) * V16_BLK;
}
/* Nibble byte j (0..15) of row slot s (0..15) in a v16 block. */
static inline size_t v16_nib(int s, int j) { return 64 + 64 * (size_t)(j / 4) + 4 * (size_t)s + (size_t)(j % 4); }

size_t cb_cpu_v16_bytes(const cb_weight_t *w) {
    if (w->type != CB_TYPE_Q4_1 || w->rows <= 0 || w->rows % 16 || w->cols <= 0 || w->cols % 32) return 0;
    return (size_t)w->rows * w->row_bytes;
}

bool cb_cpu_v16_pack(const cb_weight_t *w, void *dst) {
    if (!cb_cpu_v16_bytes(w)) return false;
    const int nb = w->cols / 32;
    for (int g = 0; g < w->rows / 16; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *blk = (uint8_t *)dst + ((size_t)g * (size_t)nb + (size_t)b) * V16_BLK;
            for (int s = 0; s < 16; s++) {
                const uint8_t *src = (const uint8_t *)w->q + (size_t)(16 * g + s) * w->row_bytes + 20 * (size_t)b;
                memcpy(blk + 2 * s, src, 2);
                memcpy(blk + 32 + 2 * s, src + 2, 2);
                for (int t = 0; t < 4; t++) memcpy(blk + v16_nib(s, 4 * t), src + 4 + 4 * t, 4);
            }
        }
    return true;
}

static void s_v16_dequant_row(const cb_weight_t *w, int row, float *dst) {
    const int g = row / 16, s = row % 16;
    for (int b = 0; b < w->cols / 32; b++) {
        const uint8_t *blk = v16_block(w, g, b);
        const float d = f16_at(blk + 2 * s), m = f16_at(blk + 32 + 2 * s);
        for (int j = 0; j < 16; j++) {
            const uint8_t q = blk[v16_nib(s, j)];
            dst[32 * b + j] = (float)(q & 0xF) * d + m;
            dst[32 * b + j + 16] = (float)(q >> 4) * d + m;
        }
    }
}

void cb_cpu_v16_dequant_row(const cb_weight_t *w, int row, float *dst) { s_v16_dequant_row(w, row, dst); }

/* s_q4_1_row's arithmetic on the v16 blocks (the stored layout's bits). o0, o1 multiples of 16. */
void cb_cpu_v16_scalar(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    for (int o = o0; o < o1; o++)
        for (int r = 0; r < R; r++) {
            const int s = o % 16;
            float acc = 0.0f;
            for (int b = 0; b < w->cols / 32; b++) {
                const uint8_t *blk = v16_block(w, o / 16, b);
                const int8_t *xq = x[r].q + 32 * b;
                int sum = 0;
                for (int j = 0; j < 16; j++) sum += (blk[v16_nib(s, j)] & 0xF) * xq[j] + (blk[v16_nib(s, j)] >> 4) * xq[j + 16];
                acc += f16_at(blk + 2 * s) * x[r].d[b] * (float)sum + f16_at(blk + 32 + 2 * s) * x[r].ds[b];
            }
            y[(size_t)r * ldy + o] = acc;
        }
}

/* ---------------------------------------------------------------- AVX-512 VNNI kernel (v16) */

#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__)
#include <immintrin.h>
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#include <immintrin.h>
#endif
/* One group of 16 weight rows against R activation rows: per block, the 4 loads of 64 bytes (16 rows x 4
 * nibble bytes) unpack to 8 vectors of u8 weights, each met by the activation's matching 4 bytes broadcast
 * (vpdpbusd: u8 weight x s8 activation, 4 products per int32 lane), so each lane accumulates one row's
 * exact block sum; then one convert and two FMAs per row and block (d_w d_x, and the min term m_w ds_x). */
static inline __attribute__((always_inline)) void w16_g(const uint8_t *blk, int nb, const xrow_t *x, const int R,
                                                         __m512 *out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[CB_V16_ROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, blk += V16_BLK) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        __m512i lo[4], hi[4];
        #pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(blk + 64 + 64 * t));
            lo[t] = _mm512_and_si512(raw, m4);
            hi[t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        }
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const int8_t *xq = x[r].q + 32 * b;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            #pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                int32_t a, c;
                memcpy(&a, xq + 4 * t, 4);      /* elements 4t..4t+3: the low nibbles */
                memcpy(&c, xq + 16 + 4 * t, 4); /* elements 16+4t..: the high nibbles */
                s0 = _mm512_dpbusd_epi32(s0, lo[t], _mm512_set1_epi32(a));
                s1 = _mm512_dpbusd_epi32(s1, hi[t], _mm512_set1_epi32(c));
            }
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, _mm512_set1_ps(x[r].d[b])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[r].ds[b]), acc[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

#define W16_CASE(RR)                                                                                     \
    for (int g = o0 / 16; g < o1 / 16; g++) {                                                            \
        __m512 out[CB_V16_ROWS];                                                                         \
        w16_g(v16_block(w, g, 0), w->cols / 32, x, RR, out);                                             \
        for (int r = 0; r < RR; r++) _mm512_storeu_ps(y + (size_t)r * ldy + 16 * g, out[r]);             \
    }                                                                                                    \
    break;
void cb_cpu_v16_vnni(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    switch (R) {
    case 1: W16_CASE(1)
    case 2: W16_CASE(2)
    case 3: W16_CASE(3)
    default: W16_CASE(4)
    }
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
void cb_cpu_v16_vnni(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    cb_cpu_v16_scalar(w, o0, o1, x, R, y, ldy);
}
#endif
