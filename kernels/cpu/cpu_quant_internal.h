/* cpu_quant_internal.h: what the integer kernel files (cpu_quant.c, cpu_quant_k8.c) share: the view of one
 * quantized activation row, the kernel signature and the block helpers. Not for use outside kernels/cpu. */
#ifndef CB_CPU_QUANT_INTERNAL_H
#define CB_CPU_QUANT_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "format/quant.h"
#include "tensor/tensor.h"

#define QROWS 4 /* activation rows per pass over a weight row (at most this many per kernel call) */
#define XROWS 64 /* activation rows per call, at most, of the kernels that take many (cb_cpu_x8_amx, cb_cpu_k8_rows_*) */

/* One quantized activation row (views into the cb_cpu_q8_quantize layout). */
typedef struct {
    const int8_t *q;      /* B32: [cols] */
    const float *d;       /* [cols/32] block scales */
    const float *ds;      /* [cols/32] d * sum of the block's q */
    const int16_t *bs;    /* [cols/32] sum of the block's q */
    const int8_t *kq;     /* K: [cols] */
    const float *kd;      /* [cols/256] super-block scales */
    const int16_t *kbs;   /* [cols/16] sums of q per 16 */
    const int16_t *kbs32; /* [cols/32] sums of q per 32 */
} xrow_t;

/* Every kernel: y[r * ldy + o] = w[o] · x[r] for o in [o0, o1), r < R (1..QROWS). */
typedef void (*qdot_fn)(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return cb_f16_to_f32(h);
}

/* The 6-bit scale and min of Q4_K sub-block k (0..7) from the 12 packed scale bytes at s. */
static inline void q4k_scale_min(int k, const uint8_t *s, int *sc, int *mn) {
    if (k < 4) {
        *sc = s[k] & 63;
        *mn = s[k + 4] & 63;
    } else {
        *sc = (s[k + 4] & 0xF) | ((s[k - 4] >> 6) << 4);
        *mn = (s[k + 4] >> 4) | ((s[k] >> 6) << 4);
    }
}

/* The 32 six-bit values (0..63) of Q6_K sub-block k (0..7) of a super-block, element order. */
static inline void q6k_unpack(const uint8_t *blk, int k, uint8_t out[32]) {
    const int h = k / 4, t = k % 4;
    const uint8_t *ql = blk + 64 * h + (t & 1) * 32, *qh = blk + 128 + 32 * h;
    for (int l = 0; l < 32; l++) {
        int lo = t < 2 ? ql[l] & 0xF : ql[l] >> 4;
        out[l] = (uint8_t)(lo | ((qh[l] >> (2 * t)) & 3) << 4);
    }
}

/* True for the K-quant types (super-blocks of 256, the K activation format, the k8 form of x8). */
static inline bool k_quant(uint32_t type) { return type == CB_TYPE_Q4_K || type == CB_TYPE_Q5_K || type == CB_TYPE_Q6_K; }

/* ---------------------------------------------------------------- the x8 group layouts (cpu_quant.h) */

/* b8 (Q4_0, Q4_1, Q5_0, Q8_0). */
/* Group block offsets: f16 d[8] at 0; Q4_1's f16 m[8] at 16; the codes; Q5_0's fifth bits. */
#define B8_Q4_0 144 /* d, qs[4 steps][8 rows][4] */
#define B8_Q4_1 160 /* d, m, qs[4][8][4] */
#define B8_Q5_0 176 /* d, qs[4][8][4], qh[8 rows][4] */
#define B8_Q8_0 272 /* d, q[8 steps][8 rows][4] */
/* 4-bit codes: step t (0..3) holds row s's stored nibble bytes 4t..4t+3: low nibbles elements 4t + j,
 * high nibbles 16 + 4t + j (j = 0..3). Q5_0's fifth bits: byte 4s + j, bit t = element 4t + j's, bit 4 + t
 * = element 16 + 4t + j's. Q8_0: step t (0..7) holds row s's elements 4t..4t+3. */
static inline size_t b8_qs_at(uint32_t type) { return type == CB_TYPE_Q4_1 ? 32 : 16; }
#define B8_QH 144

static inline bool b8_type(uint32_t type) {
    return type == CB_TYPE_Q4_0 || type == CB_TYPE_Q4_1 || type == CB_TYPE_Q5_0 || type == CB_TYPE_Q8_0;
}

static inline size_t b8_blk_bytes(uint32_t type) {
    switch (type) {
    case CB_TYPE_Q4_0: return B8_Q4_0;
    case CB_TYPE_Q4_1: return B8_Q4_1;
    case CB_TYPE_Q5_0: return B8_Q5_0;
    default: return B8_Q8_0;
    }
}

static inline const uint8_t *b8_group_blk(const cb_weight_t *w, int g, int b) {
    return (const uint8_t *)w->x8 + ((size_t)g * (size_t)(w->cols / 32) + (size_t)b) * b8_blk_bytes(w->type);
}

/* The offset of the unsigned codes (taken off through the activation block's sum). */
static inline int b8_code_offset(uint32_t type) { return type == CB_TYPE_Q4_0 ? 8 : type == CB_TYPE_Q5_0 ? 16 : 0; }

/* k8 (Q4_K, Q5_K, Q6_K). */
#define K8_Q4K 1184 /* bytes of one group super-block: 8 x 144 + 32 (the scales and mins unpacked) */
#define K8_Q5K 1440 /* 8 x 176 + 32 */
#define K8_Q6K 1680 /* 8 x 210 */
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

static inline size_t k8_blk_bytes(uint32_t type) {
    return type == CB_TYPE_Q4_K ? K8_Q4K : type == CB_TYPE_Q5_K ? K8_Q5K : K8_Q6K;
}

static inline const uint8_t *k8_group_sb(const cb_weight_t *w, int g, int i) {
    return (const uint8_t *)w->x8 + ((size_t)g * (size_t)(w->cols / 256) + (size_t)i) * k8_blk_bytes(w->type);
}

/* The rows of the types with blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0) interleaved by 8 (cpu_quant_b8.c; the
 * layout in cpu_quant.h) and their kernels (o0, o1 multiples of 8), as the K-quants' below. */
size_t cb_cpu_b8_bytes(const cb_weight_t *w);
bool cb_cpu_b8_pack(const cb_weight_t *w, void *dst);
void cb_cpu_b8_dequant_row(const cb_weight_t *w, int row, float *dst);
void cb_cpu_b8_scalar(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_b8_avx2(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_b8_vnni(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_b8_vnni_emu(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
/* The same for calls of many rows (R up to XROWS; Q5_0 only): a group's blocks unpacked once for all R rows;
 * every row gets the bits the kernels above give it. x86 only (the sets that use them are). */
void cb_cpu_b8_rows_avx2(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_b8_rows_vnni(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_b8_rows_vnni_emu(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);

/* The K-quant rows interleaved by 8 (cpu_quant_k8.c; the layout is in cpu_quant.h). */
size_t cb_cpu_k8_bytes(const cb_weight_t *w);
bool cb_cpu_k8_pack(const cb_weight_t *w, void *dst);
void cb_cpu_k8_dequant_row(const cb_weight_t *w, int row, float *dst);
/* The kernels on w->x8 of a Q4_K / Q5_K / Q6_K weight (o0, o1 multiples of 8): scalar and AVX2 (NULL where the
 * target has no AVX2); the AVX2 ones give the scalar ones' bits. */
void cb_cpu_k8_scalar(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_k8_avx2(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
/* The same on AVX-512 VNNI (vpdpbusd on 256-bit vectors), and its arithmetic emulated with AVX2 (for tests on
 * CPUs without VNNI): the scalar kernels' bits too. */
void cb_cpu_k8_vnni(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_k8_vnni_emu(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
/* The same for calls of many rows of Q5_K (R up to XROWS): each group super-block unpacked once for all R
 * rows; every row gets the bits the kernels above give it. x86 only (the sets that use them are). */
void cb_cpu_k8_rows_avx2(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_k8_rows_vnni(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_k8_rows_vnni_emu(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);

/* The Q4_1 v16 copies (cpu_quant_v16.c; o0, o1 multiples of 16): the scalar kernel (the stored layout's bits)
 * and the AVX-512 VNNI one (CB_V16_ROWS activation rows per pass; the scalar one where the target is not x86). */
#define CB_V16_ROWS 4
void cb_cpu_v16_scalar(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_v16_vnni(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);

/* The x8 copies (any of the seven types) on the AMX tile unit (cpu_quant_amx.c): weight rows [o0, o1) with
 * o1 - o0 a multiple of 16 (o0 of 8), R activation rows a multiple of 16 up to XROWS, the rows' quantized
 * data one stride apart (as cb_cpu_qdot_rows lays them). cb_cpu_x8_amx needs a CPU with AMX-INT8 and the
 * kernel's leave to use it; cb_cpu_x8_amx_emu runs the same code with the tile unit emulated in C (AVX2). Both
 * give the scalar kernels' bits. */
void cb_cpu_x8_amx(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_x8_amx_emu(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
#endif
