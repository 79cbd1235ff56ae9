/* quant: dequantization and reference quantization of the GGUF tensor types the engine supports (F32, F16,
 * BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), and half-float conversions. Pure functions: no allocation,
 * no state, safe from any thread. Block layouts are ggml's (its packed little-endian blocks;
 * Q5_0 = {f16 d; u8 qh[4]; u8 qs[16]}, element j = d * ((nibble | (bit j of qh) << 4) - 16), the nibble
 * order of Q4_0; Q5_K = Q4_K's fields with u8 qh[32] before qs, element l of sub-block k taking bit k of
 * qh[l] as its fifth bit, w = d sc q - dmin mn with q in 0..31). */
#ifndef CB_QUANT_H
#define CB_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Dequantizes n elements of `type` (gguf.h cb_type_t id) from src into dst[n] (f32).
 * n must be a multiple of the type's block size. Returns false for an unknown type or bad n. */
bool cb_dequant(uint32_t type, const void *src, float *dst, size_t n);

/* Quantizes src[n] into dst, cb_quant_row_bytes(type, n) bytes of `type` blocks (dst need not be aligned).
 * n must be a multiple of the type's block size. Returns false for an unsupported type or bad n. For
 * writing synthetic models and test data: round to nearest on each block's grid, with one pass of
 * max-abs (Q4_0, Q5_0, Q8_0, Q6_K) or min-max (Q4_1, Q4_K, Q5_K) scales and no error search (simpler and a
 * little less accurate than ggml's quantizers).
 *
 * Each element is dequantized to its block's grid point nearest to it (clamped to the grid's ends; a
 * block's extreme elements may instead sit on the end they define, by the f16 rounding of a scale). With
 * d, m the stored f16 scales (d sc a K sub-block's step) and h(v) half the f16 spacing at v (2^-11 |v|,
 * or 2^-25 once v is subnormal), |x - y| is at most:
 *   F32 0; F16, BF16 half an ulp (round to nearest even);
 *   Q8_0        d/2 + 127 h(d)  (d = max|x| / 127);
 *   Q4_0, Q5_0  d/2 inside the grid, d beyond it, + 8 h(d) (16 h(d)): the element of largest |x| maps to
 *               -8 (-16) with its own sign (ggml's choice), so one of the other sign may lie up to a step
 *               beyond the grid's short end at +7 d (+15 d);
 *   Q4_1        d/2 + h(m) + 15 h(d)  (m = min x, d = (max x - min x) / 15; a block whose spread is within
 *               2^-10 of its magnitude, below what f16 m and d resolve, is its midpoint instead, within
 *               2^-10 max|x|);
 *   Q4_K        max(d sc/2, 15 d, dmin, 945 h(d), 63 h(dmin)): the 6-bit scale and min codes round down
 *               (but for the largest sub-block), so a sub-block's grid starts less than dmin above its min
 *               and ends at most 15 d below its max;
 *   Q5_K        as Q4_K with 31 d and 1953 h(d) (codes 0..31);
 *   Q6_K        |d sc|/2 inside the grid, |d sc| + 32 |d| + 4096 h(d) beyond it: the 8-bit sub-scales
 *               round down in magnitude, so each group of 16's largest element takes code -32.
 * The K types' f16 super-scale is subnormal for blocks with max|x| below ~0.06 (Q4_K; ~0.12 for Q5_K) or
 * ~0.25 (Q6_K); the h(d) terms then reach 945 (1953, 4096) * 2^-25, and a block far smaller still (max|x| ~1e-5) comes out zero.
 * Idempotent: cb_quant(cb_dequant(q)) == q bit for bit, for every block of every type, except Q4_K and Q5_K
 * blocks with a sub-block whose offset (dmin mn) exceeds some 10^3 to 10^4 times its range (the f32 rounding of its
 * dequantized top then reaches the margin of the scale rule; such a sub-block is poorly represented
 * anyway). Inputs are finite and within the f16 reach of the scales (|x| up to ~65504 times the largest
 * code). */
bool cb_quant(uint32_t type, const float *src, void *dst, size_t n);
/* Bytes of n elements of `type`: n / block elements * block bytes; 0 for an unsupported type or when n is
 * not a multiple of the block size (and for n = 0). */
size_t cb_quant_row_bytes(uint32_t type, size_t n);

/* IEEE binary16 and bfloat16 <-> f32 (subnormals, inf and NaN handled; f32->f16 rounds to nearest even). */
float cb_f16_to_f32(uint16_t h);
uint16_t cb_f32_to_f16(float f);
float cb_bf16_to_f32(uint16_t b);
uint16_t cb_f32_to_bf16(float f);
#endif
