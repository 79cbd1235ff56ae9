/* quant: dequantization of the GGUF tensor types the engine supports, and half-float conversions.
 * Block layouts follow REFERENCE.md §3 (ggml's packed little-endian blocks). */
#ifndef CB_QUANT_H
#define CB_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Dequantizes n elements of `type` (gguf.h cb_type_t id) from src into dst[n] (f32).
 * n must be a multiple of the type's block size. Returns false for an unknown type or bad n. */
bool cb_dequant(uint32_t type, const void *src, float *dst, size_t n);

/* IEEE binary16 and bfloat16 <-> f32 (subnormals, inf and NaN handled; f32->f16 rounds to nearest even). */
float cb_f16_to_f32(uint16_t h);
uint16_t cb_f32_to_f16(float f);
float cb_bf16_to_f32(uint16_t b);
uint16_t cb_f32_to_bf16(float f);
#endif
