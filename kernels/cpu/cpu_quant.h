/* cpu_quant: integer dot products on the stored (quantized) weight rows, for the matvecs of decode and of
 * small calls (cpu_ops.c); no f32 copy of a weight is read or made.
 *
 * An activation row is quantized once per call, in the format(s) its weights read, to int8 with f32
 * scales: q = round(x / d), d = max|x| / 127 over the scale's block, |q| <= 127.
 *   B32 (Q4_0, Q4_1, Q5_0, Q8_0; as ggml's Q8_0 / Q8_1, whose scales are f16): one d per block of 32, and
 *       ds = d * sum(q) per block. A weight block times an activation block is an exact integer sum, scaled
 *       once by the two block scales in f32; the Q4_1 min term uses ds.
 *   K (Q4_K, Q5_K, Q6_K; as ggml's Q8_K): one d per super-block of 256 and the integer sum of q per 16. A weight
 *       super-block times an activation super-block is one exact integer sum: the sub-block dots times the
 *       weight's 6- or 8-bit sub-block scales, less the Q4_K / Q5_K mins times the activation's sums per 32 (and
 *       the Q6_K offset 32 times its sums per 16), scaled once by d_w * d_x in f32.
 * Supported weight types: Q4_0, Q4_1, Q5_0, Q8_0 (blocks of 32 along a row), Q4_K, Q5_K and Q6_K
 * (super-blocks of 256; cols must be a multiple of 256). Q5_0's codes are signed 5-bit (-16..15) and its block dot is the
 * exact integer sum of (q - 16) * q_x, as Q4_0's.
 *
 * Error against the exact f32 product: the activation rounding only (the weight's own values are used
 * exactly): per element |x - d q| <= d / 2 = max|x_b| / 254 over the element's scale block b (32 elements
 * in B32, 256 in K), so |y - y_exact| <= sum_b max|x_b| / 254 * sum_{j in b} |w_j|, plus f32 rounding
 * (tests/unit/test_qdot.c checks this bound on random and real tensors). The K bound is coarser: a block
 * of 256 takes the scale of its largest element (ggml's choice for these types too). Measured on
 * Qwen2.5-Coder-1.5B Q4_K_M: decode logits within 0.39 of the f32 prefill's (test_engine, 25 tokens; 0.14
 * with B32 activations), KL to llama.cpp over 2,048 tokens 0.0032 (0.0031).
 *
 * ISA: the AVX2 kernels (maddubs / madd integer dots, F16C scales) are compiled with target attributes and
 * chosen at run time when the CPU has AVX2, FMA and F16C; the portable scalar kernels otherwise, or when
 * CB_CPU_ISA=scalar. The two give the same integer block (super-block) sums and differ only in how they
 * are converted to and accumulated in f32 (|difference| ~1e-7 of sum |w x|: a K super-block's integer sum
 * can pass f32's 24 bits). The quantization of activations is bit-identical in both.
 * An activation row's result depends only on that row: not on how many rows share the call.
 */
#ifndef CB_CPU_QUANT_H
#define CB_CPU_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tensor/tensor.h"

/* Activation formats (bit masks): blocks of 32, super-blocks of 256. */
#define CB_CPU_Q8_B32 1u
#define CB_CPU_Q8_K 2u

/* Bytes of one quantized activation row of cols elements (cols % 32 == 0), a multiple of 64 and
 * non-decreasing in cols: room for both formats. B32 at offset 0: int8 q [cols], then f32 d [cols/32]
 * (block scales), then f32 ds [cols/32] (d * sum of the block's q), then int16 bs [cols/32] (the sums). K (cols % 256 == 0) at the next
 * multiple of 64: int8 q [cols], then f32 d [cols/256], then int16 bsum [cols/16] and int16 bsum32 [cols/32]
 * (sums of q per 16 and per 32). */
size_t cb_cpu_q8_row_bytes(int cols);
/* Quantizes x [cols] into dst (cb_cpu_q8_row_bytes(cols) bytes, 32-byte aligned) in the formats of fmt (a
 * mask of CB_CPU_Q8_*; K only when cols % 256 == 0); the other format's bytes are left as they are. */
void cb_cpu_q8_quantize(const float *x, int cols, unsigned fmt, void *dst);

/* True when w's type and shape have an integer kernel (the types above, cols a multiple of the block). */
bool cb_cpu_qdot_supported(const cb_weight_t *w);
/* The activation format w's kernels read (CB_CPU_Q8_B32 or CB_CPU_Q8_K); w must be supported. */
unsigned cb_cpu_qdot_format(const cb_weight_t *w);

/* y[r * ldy + o] = w[o] · x[r] for o in [o0, o1) and r < n: xq holds n rows quantized by
 * cb_cpu_q8_quantize in (at least) cb_cpu_qdot_format(w), row_bytes = cb_cpu_q8_row_bytes(w->cols) apart.
 * w must be supported. Rows of x go four at a time over each weight block (unpacked once for the four); on the
 * K-quants' x8 copies, a call of more than four rows unpacks each group super-block once for 16 rows; under
 * the amx set, x8 copies take the tile unit for 16 rows or more. Every path gives a row the same bits. */
void cb_cpu_qdot_rows(const cb_weight_t *w, int o0, int o1, const void *xq, int n, float *y, int ldy);

/* Interleaved rows ("x8"), the layout the integer kernels read fastest: weights with rows % 8 == 0 of the
 * types Q4_0, Q4_1, Q5_0, Q8_0 (cols % 32 == 0) and Q4_K, Q5_K, Q6_K (cols % 256 == 0), copied so that one block
 * (super-block) position of 8 consecutive rows is one contiguous group block, in which every 32-byte
 * vector holds 4 consecutive elements of each of the 8 rows (row slot s at bytes 4s..4s+3): one maddubs
 * against the activation's matching 4 bytes, broadcast, multiplies all 8 rows, with no horizontal sums.
 * Group g (rows 8g..8g+7), block b at (g * blocks per row + b) * group block bytes:
 *   Q4_0 (144 = 8 x 18): f16 d[8], then qs[4 steps t][8 rows][4]: row s's stored nibble bytes 4t..4t+3
 *         (low nibbles: elements 4t.., high: 16 + 4t..);
 *   Q4_1 (160 = 8 x 20): f16 d[8], f16 m[8], then qs as Q4_0's;
 *   Q5_0 (176 = 8 x 22): f16 d[8], qs as Q4_0's, then qh[8 rows][4]: byte 4s + j holds the fifth bits of
 *         row s's elements 4t + j (bit t) and 16 + 4t + j (bit 4 + t), t = 0..3;
 *   Q8_0 (272 = 8 x 34): f16 d[8], then q[8 steps t][8 rows][4]: row s's elements 4t..4t+3;
 *   Q4_K (1184 = 8 x 144 + 32), Q5_K (1440 = 8 x 176 + 32) and Q6_K (1680 = 8 x 210): cpu_quant_k8.c
 *         (the 6-bit scales and mins unpacked to bytes).
 * The integer sums per block are the stored rows' (the same exact integers), so results are the stored
 * layout's within f32 reordering, and the scalar and AVX2 kernels on a copy give the same bits.
 * cb_cpu_x8_bytes: the copy's size, or 0 when w has no x8 form (type, rows % 8, cols).
 * cb_cpu_x8_pack: writes w's rows (w->q) interleaved into dst (cb_cpu_x8_bytes(w) bytes); false when w has
 * no x8 form.
 * A weight with w->x8 set is read there by cb_cpu_qdot_rows (ranges aligned to 8 rows) and by
 * cb_cpu_x8_dequant_row (bit-identical to dequantizing the stored row). */
size_t cb_cpu_x8_bytes(const cb_weight_t *w);
bool cb_cpu_x8_pack(const cb_weight_t *w, void *dst);
void cb_cpu_x8_dequant_row(const cb_weight_t *w, int row, float *dst);

/* The 16-row VNNI layout ("v16") of Q4_1 weights with rows % 16 == 0, for CPUs with AVX-512 VNNI. Group g
 * (rows 16g..16g+15), block b at (g * cols/32 + b) * 320: f16 d[16], f16 m[16], then 4 quads of 64 bytes:
 * quad t = bytes 4t..4t+3 of each of the 16 rows' nibble bytes (row slot s at 4s). A quad's low nibbles
 * are elements 4t..4t+3 and its high nibbles 16+4t..16+4t+3, so one vpdpbusd against the activation's
 * matching 4 bytes (broadcast) adds 4 products to each row's int32 lane: no horizontal sums. The same
 * kernel serves every call size (decode to prefill: a row's result does not depend on the call).
 * cb_cpu_v16_bytes: the copy's size, or 0 (type, shape). cb_cpu_v16_pack: as cb_cpu_x8_pack.
 * cb_cpu_v16_preferred: true when the kernel set in use has the VNNI kernel (the model then packs Q4_1 as
 * v16 rather than x8). cb_cpu_v16_dequant_row: bit-identical to dequantizing the stored row. A weight has
 * at most one of x8 and v16. */
size_t cb_cpu_v16_bytes(const cb_weight_t *w);
bool cb_cpu_v16_pack(const cb_weight_t *w, void *dst);
bool cb_cpu_v16_preferred(void);
void cb_cpu_v16_dequant_row(const cb_weight_t *w, int row, float *dst);

/* True when w's GEMMs (prefill) should run the integer kernel rather than f32 sgemm over dequantized rows:
 * a v16 weight, or an x8 weight where the AVX2 kernels run; never with an f32 copy. */
bool cb_cpu_qdot_gemm(const cb_weight_t *w);

/* The kernel set in use: "avx512vnni" (vpdpbusd kernels for the x8 and v16 copies, AVX2 for the stored rows),
 * "avx2", "scalar", or "avx512vnni-emulated" (the avx512vnni set's x8 kernels with vpdpbusd emulated in AVX2,
 * Q4_1 in x8: for testing that set's arithmetic on CPUs without VNNI; never chosen by default); "amx" (the x8
 * products of 16 activation rows or more on the AMX-INT8 tile unit, the rest as avx512vnni, Q4_1 in x8; not
 * chosen by default until its speed is measured) and "amx-emulated" (that kernel with the tile unit emulated in
 * C: for tests). Every set
 * gives the scalar set's bits on the x8 copies. cb_cpu_qdot_use selects one for the whole process (one of
 * those names, or NULL = the best available); 0, or -1 when the CPU cannot run it. Not thread-safe against
 * running kernels: tests call it between runs. */
const char *cb_cpu_qdot_isa(void);
int cb_cpu_qdot_use(const char *isa);

/* The CPU backend's copies of a model's weights (cpu_weights.c), a cb_weights_build_fn (tensor.h) that the
 * backend's prepare_weights runs once per model: as ws->mode says, the x8 or v16 copy of every matrix that has
 * one (native: v16 for Q4_1 where cb_cpu_v16_preferred, else x8; the stored pages of each copied matrix, and of
 * an untied embedding table, given back to the mapping), f32 copies of every matrix (f32), or nothing (stored).
 * arg is unused. 0, or -1 with err. */
int cb_cpu_weights_build(cb_weights_t *ws, void *arg, char *err, size_t errlen);
#endif
