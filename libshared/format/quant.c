/* quant.c: dequantization of F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K and Q6_K blocks to f32, and
 * binary16 / bfloat16 conversions (REFERENCE.md §3). Pure functions, no allocation, no state.
 *
 * Block structs mirror ggml's packed little-endian layouts; their sizes are pinned by _Static_assert.
 * Sources may be unaligned (a caller's buffer, or any block inside a tensor), so the structs are
 * packed and fp16 fields are read with memcpy.
 */
#include "format/quant.h"

#include <string.h>

#include "format/gguf.h"

/* Packed (alignment 1) so any source address is valid; fp16 fields are read through rd_f16(void *). */
#define PACKED __attribute__((packed))
typedef struct PACKED { uint16_t d; uint8_t qs[16]; } block_q4_0;                /* d fp16 */
typedef struct PACKED { uint16_t d, m; uint8_t qs[16]; } block_q4_1;             /* d, m fp16 */
typedef struct PACKED { uint16_t d; int8_t qs[32]; } block_q8_0;                 /* d fp16 */
typedef struct PACKED { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } block_q4_k;
typedef struct PACKED { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } block_q6_k; /* d last */
_Static_assert(sizeof(block_q4_0) == 18, "Q4_0 block is 18 bytes");
_Static_assert(sizeof(block_q4_1) == 20, "Q4_1 block is 20 bytes");
_Static_assert(sizeof(block_q8_0) == 34, "Q8_0 block is 34 bytes");
_Static_assert(sizeof(block_q4_k) == 144, "Q4_K block is 144 bytes");
_Static_assert(sizeof(block_q6_k) == 210, "Q6_K block is 210 bytes");
_Static_assert(sizeof(float) == 4, "f32 is 4 bytes");

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float cb_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in f32 */
        float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7F800000u | (mant << 13)); /* inf, NaN (payload kept) */
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t cb_f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7FFFFFFFu;
    if (x >= 0x7F800000u) /* inf or NaN (NaN stays a quiet NaN, top payload bits kept) */
        return (uint16_t)(sign | 0x7C00u | (x > 0x7F800000u ? 0x200u | ((x >> 13) & 0x3FFu) : 0u));
    if (x >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520 rounds to inf */
    if (x >= 0x38800000u) { /* normal half range: rebias exponent, round 13 dropped bits to even */
        uint32_t base = (x - 0x38000000u) >> 13, rem = x & 0x1FFFu;
        if (rem > 0x1000u || (rem == 0x1000u && (base & 1u))) base++;
        return (uint16_t)(sign | base);
    }
    /* subnormal half (or zero): value / 2^-24 = mant * 2^(e - 126), rounded to even */
    uint32_t e = x >> 23;
    if (e < 102) return sign; /* below 2^-25: rounds to 0 (exactly 2^-25 ties to even 0 below) */
    uint32_t mant = (x & 0x7FFFFFu) | 0x800000u, s = 126u - e; /* s in 14..24 */
    uint32_t q = mant >> s, rem = mant & ((1u << s) - 1u), half = 1u << (s - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

float cb_bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

uint16_t cb_f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

static inline float rd_f16(const void *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return cb_f16_to_f32(h);
}

/* ---------------------------------------------------------------- per type */

static void dq_q4_0(const block_q4_0 *b, float *y, size_t nb) {
    for (size_t i = 0; i < nb; i++, y += 32) {
        float d = rd_f16(&b[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((b[i].qs[j] & 0xF) - 8) * d;       /* low nibble: element j */
            y[j + 16] = (float)((b[i].qs[j] >> 4) - 8) * d;   /* high nibble: element j+16 */
        }
    }
}

static void dq_q4_1(const block_q4_1 *b, float *y, size_t nb) {
    for (size_t i = 0; i < nb; i++, y += 32) {
        float d = rd_f16(&b[i].d), m = rd_f16(&b[i].m);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(b[i].qs[j] & 0xF) * d + m;          /* min added */
            y[j + 16] = (float)(b[i].qs[j] >> 4) * d + m;
        }
    }
}

static void dq_q8_0(const block_q8_0 *b, float *y, size_t nb) {
    for (size_t i = 0; i < nb; i++, y += 32) {
        float d = rd_f16(&b[i].d);
        for (int j = 0; j < 32; j++) y[j] = (float)b[i].qs[j] * d;
    }
}

/* 6-bit scale and min of sub-block k (0..7) from the 12 packed bytes (ggml get_scale_min_k4). */
static inline void scale_min_k4(int k, const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    if (k < 4) {
        *sc = q[k] & 63;
        *mn = q[k + 4] & 63;
    } else {
        *sc = (uint8_t)((q[k + 4] & 0xF) | ((q[k - 4] >> 6) << 4));
        *mn = (uint8_t)((q[k + 4] >> 4) | ((q[k] >> 6) << 4));
    }
}

static void dq_q4_k(const block_q4_k *b, float *y, size_t nb) {
    for (size_t i = 0; i < nb; i++) {
        float d = rd_f16(&b[i].d), dmin = rd_f16(&b[i].dmin);
        const uint8_t *q = b[i].qs;
        for (int c = 0; c < 4; c++, q += 32) { /* 64-element chunk: sub-blocks 2c (low), 2c+1 (high) */
            uint8_t sc, mn;
            scale_min_k4(2 * c, b[i].scales, &sc, &mn);
            float d1 = d * sc, m1 = dmin * mn;
            scale_min_k4(2 * c + 1, b[i].scales, &sc, &mn);
            float d2 = d * sc, m2 = dmin * mn;
            for (int l = 0; l < 32; l++) y[l] = d1 * (float)(q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) y[l + 32] = d2 * (float)(q[l] >> 4) - m2;
            y += 64;
        }
    }
}

static void dq_q6_k(const block_q6_k *b, float *y, size_t nb) {
    for (size_t i = 0; i < nb; i++) {
        float d = rd_f16(&b[i].d);
        const uint8_t *ql = b[i].ql, *qh = b[i].qh;
        const int8_t *sc = b[i].scales;
        for (int half = 0; half < 2; half++) {
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is + 0] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
            y += 128;
            ql += 64;
            qh += 32;
            sc += 8;
        }
    }
}

bool cb_dequant(uint32_t type, const void *src, float *dst, size_t n) {
    size_t blck = cb_type_block_elems(type);
    if (blck == 0 || n % blck != 0 || (n && (!src || !dst))) return false;
    size_t nb = n / blck;
    switch (type) {
    case CB_TYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        return true;
    case CB_TYPE_F16: {
        const uint8_t *s = src;
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = cb_f16_to_f32(h);
        }
        return true;
    }
    case CB_TYPE_BF16: {
        const uint8_t *s = src;
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = cb_bf16_to_f32(h);
        }
        return true;
    }
    case CB_TYPE_Q4_0: dq_q4_0(src, dst, nb); return true;
    case CB_TYPE_Q4_1: dq_q4_1(src, dst, nb); return true;
    case CB_TYPE_Q8_0: dq_q8_0(src, dst, nb); return true;
    case CB_TYPE_Q4_K: dq_q4_k(src, dst, nb); return true;
    case CB_TYPE_Q6_K: dq_q6_k(src, dst, nb); return true;
    default: return false;
    }
}
