/* cpu_quant_k8.c: Q4_K, Q5_K and Q6_K weight rows interleaved by 8 ("k8", the x8 form of the K-quants; layout in
 * cpu_quant.h) and their integer kernels, scalar and AVX2.
 *
 * Each 32-byte vector of a group holds 4 consecutive elements of each of the 8 rows (row slot s at bytes
 * 4s..4s+3), so one maddubs against the activation's matching 4 bytes, broadcast, gives every row its pair
 * sums at once: no horizontal sums, and one unpacked weight vector serves up to K8_ROWS activation rows.
 * Integer sums per super-block and row are exact (as cpu_quant.c's): Q4_K sums sc_k dot_k over its 8
 * sub-blocks (each sub-block's 8 maddubs results added in int16 first: per lane <= 8 * 2 * 15 * 127 =
 * 30480; Q5_K's codes 0..31 in two halves of 4, <= 4 * 2 * 31 * 127 = 31496) and mn_k bsum32_k apart; Q6_K sums sc_g (dot_g - 32 bsum_g) over its 16 groups (two maddubs
 * results added in int16: <= 2 * 2 * 63 * 127 = 32004). Then per super-block and row, in f32:
 * acc = fma(sumi, d_w d_x, acc), and for Q4_K / Q5_K acc = fma(-summ, dmin_w d_x, acc). The scalar kernels do the
 * same operations in the same order, so both sets give the same bits. */
#include "cpu/cpu_quant_internal.h"

#include <assert.h>
#include <math.h>

#include "format/gguf.h"

#ifndef K8_TUNROLL
#define K8_TUNROLL 2
#endif
#ifndef K8_GUNROLL
#define K8_GUNROLL 2
#endif
#define K8_PRAGMA(x) _Pragma(#x)
#define K8_UNROLL(n) K8_PRAGMA(GCC unroll n)
#define K8_Q4K 1184 /* bytes of one group super-block: 8 x 144 + 32 (the scales and mins unpacked) */
#define K8_Q5K 1440 /* 8 x 176 + 32 */
#define K8_Q6K 1680 /* 8 x 210 */
#ifndef K8_ROWS
#define K8_ROWS 4 /* activation rows per pass over a group */
#endif

/* Q4_K group super-block: f16 d[8], f16 dmin[8], u8 sc[8 sub-blocks][8 rows], u8 mn[4 pairs][8 rows][2],
 * then qs[4 chunks][8 steps][8 rows][4]: row s's stored qs bytes 32c + 4t .. +3 (low nibbles: elements
 * 64c + 4t.., sub-block 2c; high: 64c + 32 + 4t.., sub-block 2c + 1). */
#define Q4K_D 0
#define Q4K_DMIN 16
#define Q4K_SC 32
#define Q4K_MN 96
#define Q4K_QS 160
/* Q5_K group super-block: Q4_K's first 160 bytes, then qh[8 steps t][8 rows][4]: row s's stored qh bytes
 * 4t..4t+3 (bit k of qh[l]: the fifth bit of element l of sub-block k), then qs as Q4_K's. */
#define Q5K_QH 160
#define Q5K_QS 416
/* Q6_K group super-block: f16 d[8], i8 sc[8 pairs][8 rows][2], then per group of 16 elements g (0..15) 96
 * bytes: ql0, ql1, qh of 32 bytes (4 per row): ql0's low nibbles are elements 16g + b (b = 0..3) of the
 * row, its high nibbles 16g + 4 + b; ql1's 16g + 8 + b and 16g + 12 + b; qh's bit pairs 0-1, 2-3, 4-5, 6-7
 * the top two bits of 16g + b, 16g + 4 + b, 16g + 8 + b, 16g + 12 + b. */
#define Q6K_D 0
#define Q6K_SC 16
#define Q6K_Q 144

static size_t blk_bytes(uint32_t type) {
    return type == CB_TYPE_Q4_K ? K8_Q4K : type == CB_TYPE_Q5_K ? K8_Q5K : K8_Q6K;
}


static const uint8_t *group_sb(const cb_weight_t *w, int g, int i) {
    return (const uint8_t *)w->x8 + ((size_t)g * (size_t)(w->cols / 256) + (size_t)i) * blk_bytes(w->type);
}

size_t cb_cpu_k8_bytes(const cb_weight_t *w) {
    if (!k_quant(w->type)) return 0;
    if (w->rows <= 0 || w->rows % 8 || w->cols <= 0 || w->cols % 256) return 0;
    return (size_t)(w->rows / 8) * (size_t)(w->cols / 256) * blk_bytes(w->type);
}

/* Q4_K (q5 false) or Q5_K row slot s of the stored super-block src into dst. */
static void pack_q4k(const bool q5, const uint8_t *src, int s, uint8_t *dst) {
    memcpy(dst + Q4K_D + 2 * s, src, 2);
    memcpy(dst + Q4K_DMIN + 2 * s, src + 2, 2);
    for (int k = 0; k < 8; k++) {
        int sc, mn;
        q4k_scale_min(k, src + 4, &sc, &mn);
        dst[Q4K_SC + 8 * k + s] = (uint8_t)sc;
        dst[Q4K_MN + 16 * (k / 2) + 2 * s + (k & 1)] = (uint8_t)mn;
    }
    const size_t qs = q5 ? Q5K_QS : Q4K_QS, sq = q5 ? 48 : 16;
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 8; t++) memcpy(dst + qs + 256 * c + 32 * t + 4 * s, src + sq + 32 * c + 4 * t, 4);
    if (q5)
        for (int t = 0; t < 8; t++) memcpy(dst + Q5K_QH + 32 * t + 4 * s, src + 16 + 4 * t, 4);
}

static void pack_q6k(const uint8_t *src, int s, uint8_t *dst) {
    memcpy(dst + Q6K_D + 2 * s, src + 208, 2);
    for (int g = 0; g < 16; g++) dst[Q6K_SC + 16 * (g / 2) + 2 * s + (g & 1)] = src[192 + g];
    uint8_t q[256];
    for (int k = 0; k < 8; k++) q6k_unpack(src, k, q + 32 * k);
    for (int g = 0; g < 16; g++) {
        uint8_t *o = dst + Q6K_Q + 96 * g + 4 * s;
        for (int b = 0; b < 4; b++) {
            const uint8_t *e = q + 16 * g + b; /* e[0], e[4], e[8], e[12] */
            o[b] = (uint8_t)((e[0] & 0xF) | (e[4] & 0xF) << 4);
            o[32 + b] = (uint8_t)((e[8] & 0xF) | (e[12] & 0xF) << 4);
            o[64 + b] = (uint8_t)(e[0] >> 4 | (e[4] >> 4) << 2 | (e[8] >> 4) << 4 | (e[12] >> 4) << 6);
        }
    }
}

bool cb_cpu_k8_pack(const cb_weight_t *w, void *dst) {
    if (!cb_cpu_k8_bytes(w)) return false;
    const int nsb = w->cols / 256;
    const size_t sb = (size_t)cb_type_block_bytes(w->type);
    /* groups in parallel: the copy's first touch (page faults, zeroing) is most of the cost */
    #pragma omp parallel for schedule(static)
    for (int g = 0; g < w->rows / 8; g++)
        for (int i = 0; i < nsb; i++) {
            uint8_t *o = (uint8_t *)dst + ((size_t)g * (size_t)nsb + (size_t)i) * blk_bytes(w->type);
            for (int s = 0; s < 8; s++) {
                const uint8_t *src = (const uint8_t *)w->q + (size_t)(8 * g + s) * w->row_bytes + sb * (size_t)i;
                if (w->type != CB_TYPE_Q6_K)
                    pack_q4k(w->type == CB_TYPE_Q5_K, src, s, o);
                else
                    pack_q6k(src, s, o);
            }
        }
    return true;
}

/* Element e (0..255) of row slot s in a group super-block: the 4-bit Q4_K nibble, the 5-bit Q5_K code, or
 * the 6-bit Q6_K q. */
static inline int q4k_at(const bool q5, const uint8_t *blk, int s, int e) {
    const int c = e / 64, h = (e % 64) / 32, t = (e % 32) / 4, b = e % 4;
    const uint8_t v = blk[(q5 ? Q5K_QS : Q4K_QS) + 256 * c + 32 * t + 4 * s + b];
    const int hb = q5 ? ((blk[Q5K_QH + 32 * t + 4 * s + b] >> (e / 32)) & 1) << 4 : 0;
    return (h ? v >> 4 : v & 0xF) | hb;
}
static inline int q6k_at(const uint8_t *blk, int s, int e) {
    const int g = e / 16, u = (e % 16) / 4, b = e % 4; /* u: quarter of the group */
    const uint8_t *o = blk + Q6K_Q + 96 * g + 4 * s + b;
    const int lo = u == 0 ? o[0] & 0xF : u == 1 ? o[0] >> 4 : u == 2 ? o[32] & 0xF : o[32] >> 4;
    return lo | ((o[64] >> (2 * u)) & 3) << 4;
}

/* Bit-identical to cb_dequant of the stored row (format/quant.c's expressions). */
void cb_cpu_k8_dequant_row(const cb_weight_t *w, int row, float *dst) {
    const int g = row / 8, s = row % 8;
    for (int i = 0; i < w->cols / 256; i++) {
        const uint8_t *blk = group_sb(w, g, i);
        float *y = dst + 256 * i;
        if (w->type != CB_TYPE_Q6_K) {
            const bool q5 = w->type == CB_TYPE_Q5_K;
            const float d = f16_at(blk + Q4K_D + 2 * s), dmin = f16_at(blk + Q4K_DMIN + 2 * s);
            for (int k = 0; k < 8; k++) {
                const float d1 = d * blk[Q4K_SC + 8 * k + s], m1 = dmin * blk[Q4K_MN + 16 * (k / 2) + 2 * s + (k & 1)];
                for (int l = 0; l < 32; l++) y[32 * k + l] = d1 * (float)q4k_at(q5, blk, s, 32 * k + l) - m1;
            }
        } else {
            const float d = f16_at(blk + Q6K_D + 2 * s);
            for (int e = 0; e < 256; e++) {
                const int8_t sc = (int8_t)blk[Q6K_SC + 16 * (e / 32) + 2 * s + (e / 16) % 2];
                y[e] = d * (float)sc * (float)(q6k_at(blk, s, e) - 32);
            }
        }
    }
}

/* ---------------------------------------------------------------- scalar */

static void s_q4k_sb(const bool q5, const uint8_t *blk, int s, const xrow_t *x, int i, float *acc) {
    int sumi = 0, summ = 0;
    for (int k = 0; k < 8; k++) {
        const int8_t *xq = x->kq + 256 * i + 32 * k;
        int dot = 0;
        for (int l = 0; l < 32; l++) dot += q4k_at(q5, blk, s, 32 * k + l) * xq[l];
        sumi += blk[Q4K_SC + 8 * k + s] * dot;
        summ += blk[Q4K_MN + 16 * (k / 2) + 2 * s + (k & 1)] * x->kbs32[8 * i + k];
    }
    const float dx = x->kd[i];
    *acc = fmaf((float)sumi, f16_at(blk + Q4K_D + 2 * s) * dx, *acc);
    *acc = fmaf(-(float)summ, f16_at(blk + Q4K_DMIN + 2 * s) * dx, *acc);
}

static void s_q6k_sb(const uint8_t *blk, int s, const xrow_t *x, int i, float *acc) {
    int sumi = 0;
    for (int g = 0; g < 16; g++) {
        const int8_t *xq = x->kq + 256 * i + 16 * g;
        int dot = 0;
        for (int l = 0; l < 16; l++) dot += q6k_at(blk, s, 16 * g + l) * xq[l];
        const int sc = (int8_t)blk[Q6K_SC + 16 * (g / 2) + 2 * s + (g & 1)];
        sumi += sc * (dot - 32 * x->kbs[16 * i + g]);
    }
    *acc = fmaf((float)sumi, f16_at(blk + Q6K_D + 2 * s) * x->kd[i], *acc);
}

void cb_cpu_k8_scalar(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    assert(o0 % 8 == 0 && o1 % 8 == 0 && R >= 1 && R <= QROWS);
    for (int o = o0; o < o1; o++)
        for (int r = 0; r < R; r++) {
            float acc = 0.0f;
            for (int i = 0; i < w->cols / 256; i++) {
                if (w->type != CB_TYPE_Q6_K)
                    s_q4k_sb(w->type == CB_TYPE_Q5_K, group_sb(w, o / 8, i), o % 8, &x[r], i, &acc);
                else
                    s_q6k_sb(group_sb(w, o / 8, i), o % 8, &x[r], i, &acc);
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

/* Decode streams each weight from DRAM once per token: prefetch n cache lines this far ahead of p (the
 * same distance as the stored-row kernels; a hint, so the address may lie past the copy's end). */
#define K8_PREFETCH 4096
static inline void v_prefetch(const uint8_t *p, int n) {
    const uintptr_t a = (uintptr_t)p + K8_PREFETCH;
    for (int k = 0; k < n; k++) _mm_prefetch((const char *)(a + 64 * (uintptr_t)k), _MM_HINT_T0);
}

/* 4 bytes at p, broadcast to the 8 int32 lanes. */
static inline __m256i b4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* One Q4_K group (8 weight rows) against R activation rows, over nsb super-blocks; out[r] = the 8 rows'
 * dot products with activation row r. */
/* One Q4_K or Q5_K (q5) group (8 weight rows) against R activation rows, over nsb super-blocks; out[r] = the
 * 8 rows' dot products with activation row r. Q5_K's fifth bits come from its qh vectors (bit k of each
 * byte, k = the sub-block, moved to bit 4); its int16 sums are folded every 4 steps. */
static inline __attribute__((always_inline)) void v_q4k_g(const bool q5, const uint8_t *blk, int nsb, const xrow_t *x,
                                                           const int R, __m256 *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m256 acc[K8_ROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const size_t qs = q5 ? Q5K_QS : Q4K_QS;
    for (int i = 0; i < nsb; i++, blk += q5 ? K8_Q5K : K8_Q4K) {
        __m256i si[K8_ROWS];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) si[r] = _mm256_setzero_si256();
        if (q5) v_prefetch(blk + Q5K_QH, 4);
        for (int c = 0; c < 4; c++) {
            v_prefetch(blk + qs + 256 * c, 4);
            #pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int k = 2 * c + h;
                const __m256i sc = _mm256_cvtepu8_epi16(
                    _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(blk + Q4K_SC + 8 * k)), dup));
                __m256i s16[K8_ROWS];
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();
                K8_UNROLL(K8_TUNROLL)
                for (int t = 0; t < 8; t++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + qs + 256 * c + 32 * t));
                    __m256i q = h ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4) : _mm256_and_si256(raw, m4);
                    if (q5) {
                        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + Q5K_QH + 32 * t));
                        const __m256i hb = k < 4 ? _mm256_slli_epi16(qh, 4 - k) : k > 4 ? _mm256_srli_epi16(qh, k - 4) : qh;
                        q = _mm256_or_si256(q, _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
                    }
                    #pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
                        s16[r] = _mm256_add_epi16(
                            s16[r], _mm256_maddubs_epi16(q, b4(x[r].kq + 256 * i + 64 * c + 32 * h + 4 * t)));
                    if (q5 && t == 3) { /* Q5_K: two int16 sums of 4 steps */
                        #pragma GCC unroll 4
                        for (int r = 0; r < R; r++) {
                            si[r] = _mm256_add_epi32(si[r], _mm256_madd_epi16(s16[r], sc));
                            s16[r] = _mm256_setzero_si256();
                        }
                    }
                }
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++) si[r] = _mm256_add_epi32(si[r], _mm256_madd_epi16(s16[r], sc));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + Q4K_D)));
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + Q4K_DMIN)));
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m256i sm = _mm256_setzero_si256();
            #pragma GCC unroll 4
            for (int p = 0; p < 4; p++)
                sm = _mm256_add_epi32(sm, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(
                                                                (const __m128i *)(blk + Q4K_MN + 16 * p))),
                                                            b4(x[r].kbs32 + 8 * i + 2 * p)));
            const __m256 dx = _mm256_set1_ps(x[r].kd[i]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[r]), _mm256_mul_ps(d, dx), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(sm), _mm256_mul_ps(dm, dx), acc[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

static inline __attribute__((always_inline)) void v_q4k_g4(const uint8_t *blk, int nsb, const xrow_t *x, const int R,
                                                            __m256 *out) {
    v_q4k_g(false, blk, nsb, x, R, out);
}
static inline __attribute__((always_inline)) void v_q4k_g5(const uint8_t *blk, int nsb, const xrow_t *x, const int R,
                                                            __m256 *out) {
    v_q4k_g(true, blk, nsb, x, R, out);
}

/* One Q6_K group against R activation rows (as v_q4k_g). */
static inline __attribute__((always_inline)) void v_q6k_g(const uint8_t *blk, int nsb, const xrow_t *x, const int R,
                                                           __m256 *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m128i dup0 = _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
    const __m128i dup1 = _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15);
    __m256 acc[K8_ROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int i = 0; i < nsb; i++, blk += K8_Q6K) {
        __m256i si[K8_ROWS];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) si[r] = _mm256_setzero_si256();
        K8_UNROLL(K8_GUNROLL)
        for (int g = 0; g < 16; g++) {
            const uint8_t *q = blk + Q6K_Q + 96 * g;
            v_prefetch(q, 2);
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)q);
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(q + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(q + 64));
            const __m256i w0 = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
            const __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                               _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
            const __m256i w2 = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(qh, m30));
            const __m256i w3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
            const __m128i sp = _mm_loadu_si128((const __m128i *)(blk + Q6K_SC + 16 * (g / 2)));
            const __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sp, g & 1 ? dup1 : dup0));
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r].kq + 256 * i + 16 * g;
                const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(w0, b4(xq)), _mm256_maddubs_epi16(w1, b4(xq + 4)));
                const __m256i b = _mm256_add_epi16(_mm256_maddubs_epi16(w2, b4(xq + 8)), _mm256_maddubs_epi16(w3, b4(xq + 12)));
                si[r] = _mm256_add_epi32(si[r], _mm256_add_epi32(_mm256_madd_epi16(a, sc), _mm256_madd_epi16(b, sc)));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + Q6K_D)));
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m256i off = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int p = 0; p < 8; p++)
                off = _mm256_add_epi32(off, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(
                                                                  (const __m128i *)(blk + Q6K_SC + 16 * p))),
                                                              b4(x[r].kbs + 16 * i + 2 * p)));
            const __m256i s = _mm256_sub_epi32(si[r], _mm256_slli_epi32(off, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(x[r].kd[i])), acc[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

#define K8_CASE(fn, RR)                                                                                  \
    for (int g = o0 / 8; g < o1 / 8; g++) {                                                              \
        __m256 out[K8_ROWS];                                                                             \
        fn(group_sb(w, g, 0), nsb, x + r0, RR, out);                                                     \
        for (int r = 0; r < RR; r++) _mm256_storeu_ps(y + (size_t)(r0 + r) * ldy + 8 * g, out[r]);       \
    }                                                                                                    \
    break;
#if K8_ROWS == 2
#define K8_SWITCH(fn) switch (m) { case 1: K8_CASE(fn, 1) default: K8_CASE(fn, 2) }
#elif K8_ROWS == 3
#define K8_SWITCH(fn) switch (m) { case 1: K8_CASE(fn, 1) case 2: K8_CASE(fn, 2) default: K8_CASE(fn, 3) }
#else
#define K8_SWITCH(fn) switch (m) { case 1: K8_CASE(fn, 1) case 2: K8_CASE(fn, 2) case 3: K8_CASE(fn, 3) default: K8_CASE(fn, 4) }
#endif

void cb_cpu_k8_avx2(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    assert(o0 % 8 == 0 && o1 % 8 == 0 && R >= 1 && R <= QROWS);
    const int nsb = w->cols / 256;
    for (int r0 = 0; r0 < R; r0 += K8_ROWS) {
        const int m = R - r0 < K8_ROWS ? R - r0 : K8_ROWS;
        if (w->type == CB_TYPE_Q4_K) {
            K8_SWITCH(v_q4k_g4)
        } else if (w->type == CB_TYPE_Q5_K) {
            K8_SWITCH(v_q4k_g5)
        } else {
            K8_SWITCH(v_q6k_g)
        }
    }
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
void cb_cpu_k8_avx2(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    cb_cpu_k8_scalar(w, o0, o1, x, R, y, ldy);
}
#endif
