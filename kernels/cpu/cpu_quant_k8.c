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
#ifndef K8_ROWS
#define K8_ROWS 4 /* activation rows per pass over a group */
#endif

size_t cb_cpu_k8_bytes(const cb_weight_t *w) {
    if (!k_quant(w->type)) return 0;
    if (w->rows <= 0 || w->rows % 8 || w->cols <= 0 || w->cols % 256) return 0;
    return (size_t)(w->rows / 8) * (size_t)(w->cols / 256) * k8_blk_bytes(w->type);
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
            uint8_t *o = (uint8_t *)dst + ((size_t)g * (size_t)nsb + (size_t)i) * k8_blk_bytes(w->type);
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
        const uint8_t *blk = k8_group_sb(w, g, i);
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
                    s_q4k_sb(w->type == CB_TYPE_Q5_K, k8_group_sb(w, o / 8, i), o % 8, &x[r], i, &acc);
                else
                    s_q6k_sb(k8_group_sb(w, o / 8, i), o % 8, &x[r], i, &acc);
            }
            y[(size_t)r * ldy + o] = acc;
        }
}

/* ---------------------------------------------------------------- AVX2 (and the VNNI arithmetic emulated) */

#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__)
#include <immintrin.h>
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#endif

/* Decode streams each weight from DRAM once per token: the kernels prefetch this far ahead (the same distance
 * as the stored-row kernels; a hint, so the address may lie past the copy's end). */
#define K8_PREFETCH 4096

#define X8_ISA_AVX2
#include "cpu/cpu_quant_isa.h"
#include "cpu/cpu_quant_k8_isa.h"
#undef X8_ISA_AVX2
#define X8_ISA_VNNI_EMU
#include "cpu/cpu_quant_isa.h"
#include "cpu/cpu_quant_k8_isa.h"
#undef X8_ISA_VNNI_EMU
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

/* ---------------------------------------------------------------- AVX-512 VNNI (256-bit vectors) */

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#endif
#define X8_ISA_VNNI
#include "cpu/cpu_quant_isa.h"
#include "cpu/cpu_quant_k8_isa.h"
#undef X8_ISA_VNNI
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
void cb_cpu_k8_avx2(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    cb_cpu_k8_scalar(w, o0, o1, x, R, y, ldy);
}
void cb_cpu_k8_vnni(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    cb_cpu_k8_scalar(w, o0, o1, x, R, y, ldy);
}
void cb_cpu_k8_vnni_emu(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    cb_cpu_k8_scalar(w, o0, o1, x, R, y, ldy);
}
#endif
