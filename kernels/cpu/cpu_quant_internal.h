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

/* The rows of the types with blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0) interleaved by 8 (cpu_quant_b8.c; the
 * layout in cpu_quant.h) and their kernels (o0, o1 multiples of 8), as the K-quants' below. */
size_t cb_cpu_b8_bytes(const cb_weight_t *w);
bool cb_cpu_b8_pack(const cb_weight_t *w, void *dst);
void cb_cpu_b8_dequant_row(const cb_weight_t *w, int row, float *dst);
void cb_cpu_b8_scalar(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_b8_avx2(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);

/* The K-quant rows interleaved by 8 (cpu_quant_k8.c; the layout is in cpu_quant.h). */
size_t cb_cpu_k8_bytes(const cb_weight_t *w);
bool cb_cpu_k8_pack(const cb_weight_t *w, void *dst);
void cb_cpu_k8_dequant_row(const cb_weight_t *w, int row, float *dst);
/* The kernels on w->x8 of a Q4_K / Q5_K / Q6_K weight (o0, o1 multiples of 8): scalar and AVX2 (NULL where the
 * target has no AVX2); the AVX2 ones give the scalar ones' bits. */
void cb_cpu_k8_scalar(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
void cb_cpu_k8_avx2(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy);
#endif
