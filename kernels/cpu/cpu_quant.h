/* cpu_quant: integer dot products on the stored (quantized) weight rows, for the matvecs of decode and of
 * small calls (cpu_ops.c); no f32 copy of a weight is read or made.
 *
 * An activation row is quantized once per call to int8 in blocks of 32 with one f32 scale per block (as
 * ggml's Q8_0 / Q8_1, whose scales are f16): q = round(x / d), d = max|x| / 127 over the block. A weight block times an activation block is an
 * exact integer sum, scaled once by the two block scales in f32; Q4_1 and Q4_K min terms use the block's
 * d * sum(q). Supported weight types: Q4_0, Q4_1, Q8_0 (blocks of 32 along a row), Q4_K and Q6_K
 * (super-blocks of 256; cols must be a multiple of 256).
 *
 * Error against the exact f32 product: the activation rounding only (the weight's own values are used
 * exactly): per element |x - d q| <= d / 2 = max|x_b| / 254, so |y - y_exact| <= sum_b max|x_b| / 254 *
 * sum_j |w_j| over the block, plus f32 rounding (tests/unit/test_qdot.c checks this bound on random and
 * real tensors).
 *
 * ISA: the AVX2 kernels (maddubs / madd integer dots, F16C scales) are compiled with target attributes and
 * chosen at run time when the CPU has AVX2, FMA and F16C; the portable scalar kernels otherwise, or when
 * CB_CPU_ISA=scalar. The two give the same integer block sums and differ only in the order of the f32
 * accumulation (|difference| ~1e-6 relative). The quantization of activations is bit-identical in both.
 * An activation row's result depends only on that row: not on how many rows share the call.
 */
#ifndef CB_CPU_QUANT_H
#define CB_CPU_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

/* Bytes of one quantized activation row of cols elements (cols % 32 == 0), a multiple of 64:
 * int8 q [cols], then f32 d [cols/32] (block scales), then f32 ds [cols/32] (d * sum of the block's q). */
size_t cb_cpu_q8_row_bytes(int cols);
/* Quantizes x [cols] into dst (cb_cpu_q8_row_bytes(cols) bytes, 32-byte aligned). */
void cb_cpu_q8_quantize(const float *x, int cols, void *dst);

/* True when w's type and shape have an integer kernel (the types above, cols a multiple of the block). */
bool cb_cpu_qdot_supported(const cb_weight_t *w);

/* y[r * ldy + o] = w[o] · x[r] for o in [o0, o1) and r < n: xq holds n rows quantized by
 * cb_cpu_q8_quantize, row_bytes = cb_cpu_q8_row_bytes(w->cols) apart. w must be supported. Rows of x go
 * four at a time over each weight block (unpacked once for the four). */
void cb_cpu_qdot_rows(const cb_weight_t *w, int o0, int o1, const void *xq, int n, float *y, int ldy);

/* The kernel set in use: "avx2" or "scalar". cb_cpu_qdot_use selects one for the whole process ("avx2",
 * "scalar" or NULL = best available); 0, or -1 when the CPU cannot run it. Not thread-safe against running
 * kernels: tests call it between runs. */
const char *cb_cpu_qdot_isa(void);
int cb_cpu_qdot_use(const char *isa);
#endif
