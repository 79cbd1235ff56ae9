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
 * acc = fma(sumi, d_w d_x, acc), and for Q4_1 accm = fma(m_w, ds_x, accm) (a second chain, so that a
 * block's two FMAs do not wait on each other), y = acc + accm. The scalar kernels do the same
 * operations in the same order, so both sets give the same bits. */
#include "cpu/cpu_quant_internal.h"

#include <assert.h>
#include <math.h>

#include "format/gguf.h"

size_t cb_cpu_b8_bytes(const cb_weight_t *w) {
    if (!b8_type(w->type)) return 0;
    if (w->rows <= 0 || w->rows % 8 || w->cols <= 0 || w->cols % 32) return 0;
    return (size_t)(w->rows / 8) * (size_t)(w->cols / 32) * b8_blk_bytes(w->type);
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
            uint8_t *o = (uint8_t *)dst + ((size_t)g * (size_t)nb + (size_t)b) * b8_blk_bytes(w->type);
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
    const uint8_t v = blk[b8_qs_at(type) + 32 * (size_t)t + 4 * (size_t)s + (size_t)j];
    int c = hi ? v >> 4 : v & 0xF;
    if (type == CB_TYPE_Q5_0) c |= ((blk[B8_QH + 4 * s + j] >> (4 * hi + t)) & 1) << 4;
    return c;
}

/* Bit-identical to cb_dequant of the stored row (format/quant.c's expressions). */
void cb_cpu_b8_dequant_row(const cb_weight_t *w, int row, float *dst) {
    const int g = row / 8, s = row % 8;
    for (int b = 0; b < w->cols / 32; b++) {
        const uint8_t *blk = b8_group_blk(w, g, b);
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


/* ---------------------------------------------------------------- scalar */

void cb_cpu_b8_scalar(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    assert(o0 % 8 == 0 && o1 % 8 == 0 && R >= 1 && R <= QROWS);
    const int off = b8_code_offset(w->type);
    for (int o = o0; o < o1; o++)
        for (int r = 0; r < R; r++) {
            const int s = o % 8;
            float acc = 0.0f, accm = 0.0f; /* the d terms; Q4_1's min terms */
            for (int b = 0; b < w->cols / 32; b++) {
                const uint8_t *blk = b8_group_blk(w, o / 8, b);
                const int8_t *xq = x[r].q + 32 * b;
                int sumi = 0;
                for (int e = 0; e < 32; e++) sumi += code_at(w->type, blk, s, e) * xq[e];
                sumi -= off * x[r].bs[b];
                acc = fmaf((float)sumi, f16_at(blk + 2 * s) * x[r].d[b], acc);
                if (w->type == CB_TYPE_Q4_1) accm = fmaf(f16_at(blk + 16 + 2 * s), x[r].ds[b], accm);
            }
            y[(size_t)r * ldy + o] = acc + accm;
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

/* Decode streams each weight from DRAM once per token: prefetch this far ahead (a hint: the address may lie
 * past the copy's end). */
#define B8_PREFETCH 4096

#define X8_ISA_AVX2
#include "cpu/cpu_quant_isa.h"
#include "cpu/cpu_quant_b8_isa.h"
#undef X8_ISA_AVX2
#define X8_ISA_VNNI_EMU
#include "cpu/cpu_quant_isa.h"
#include "cpu/cpu_quant_b8_isa.h"
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
#include "cpu/cpu_quant_b8_isa.h"
#undef X8_ISA_VNNI
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
void cb_cpu_b8_avx2(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    cb_cpu_b8_scalar(w, o0, o1, x, R, y, ldy);
}
void cb_cpu_b8_vnni(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    cb_cpu_b8_scalar(w, o0, o1, x, R, y, ldy);
}
void cb_cpu_b8_vnni_emu(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    cb_cpu_b8_scalar(w, o0, o1, x, R, y, ldy);
}
#endif
