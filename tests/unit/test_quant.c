/* test_quant: dequantization of hand-built blocks of every supported type (expected values computed
 * independently here, from the packing side), Q5_0 against gguf-py's quantizer and dequantizer (a fixture
 * embedded below), the reference quantizer cb_quant of every type (error within the type's step on each
 * element, zero and constant blocks, idempotence), fp16/bf16 conversions (exhaustive round trip, rounding,
 * subnormals, inf, NaN), argument checks, and the dequant speed over the real model when present. */
#include <stdint.h>
#include <string.h>

#include "base/clock.h"
#include "format/gguf.h"
#include "format/quant.h"
#include "test.h"

static uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

TEST(test_f16_known) {
    CHECK(cb_f16_to_f32(0x3C00) == 1.0f);
    CHECK(cb_f16_to_f32(0xC000) == -2.0f);
    CHECK(cb_f16_to_f32(0x7BFF) == 65504.0f);
    CHECK(cb_f16_to_f32(0x0001) == ldexpf(1.0f, -24));       /* smallest subnormal */
    CHECK(cb_f16_to_f32(0x03FF) == 1023.0f * ldexpf(1.0f, -24)); /* largest subnormal */
    CHECK(cb_f16_to_f32(0x0400) == ldexpf(1.0f, -14));       /* smallest normal */
    CHECK(cb_f16_to_f32(0x3555) == 0.333251953125f);
    CHECK(isinf(cb_f16_to_f32(0x7C00)) && cb_f16_to_f32(0x7C00) > 0);
    CHECK(isinf(cb_f16_to_f32(0xFC00)) && cb_f16_to_f32(0xFC00) < 0);
    CHECK(isnan(cb_f16_to_f32(0x7E00)) && isnan(cb_f16_to_f32(0xFC01)));
    CHECK(fbits(cb_f16_to_f32(0x8000)) == 0x80000000u); /* -0 */
    CHECK(cb_f32_to_f16(1.0f) == 0x3C00 && cb_f32_to_f16(-2.0f) == 0xC000);
    CHECK(cb_f32_to_f16(-0.0f) == 0x8000 && cb_f32_to_f16(0.0f) == 0);
    CHECK(cb_f32_to_f16(INFINITY) == 0x7C00 && cb_f32_to_f16(-INFINITY) == 0xFC00);
    uint16_t n = cb_f32_to_f16(NAN);
    CHECK((n & 0x7C00) == 0x7C00 && (n & 0x3FF) != 0);
}

TEST(test_f16_rounding) {
    /* ties to even in the normal range */
    CHECK(cb_f32_to_f16(1.0f + ldexpf(1, -11)) == 0x3C00);      /* halfway 1 .. 1+2^-10: even is 1 */
    CHECK(cb_f32_to_f16(1.0f + 3 * ldexpf(1, -11)) == 0x3C02);  /* halfway 0x3C01 .. 0x3C02: even 0x3C02 */
    CHECK(cb_f32_to_f16(1.0f + ldexpf(1, -11) + ldexpf(1, -20)) == 0x3C01); /* just above half */
    CHECK(cb_f32_to_f16(65504.0f) == 0x7BFF);
    CHECK(cb_f32_to_f16(65519.0f) == 0x7BFF);
    CHECK(cb_f32_to_f16(65520.0f) == 0x7C00); /* tie with odd 0x7BFF rounds up to inf */
    CHECK(cb_f32_to_f16(1e9f) == 0x7C00 && cb_f32_to_f16(-1e9f) == 0xFC00);
    /* subnormals */
    CHECK(cb_f32_to_f16(ldexpf(1, -24)) == 0x0001);
    CHECK(cb_f32_to_f16(ldexpf(1, -25)) == 0x0000);            /* tie to even 0 */
    CHECK(cb_f32_to_f16(1.5f * ldexpf(1, -25)) == 0x0001);
    CHECK(cb_f32_to_f16(3 * ldexpf(1, -25)) == 0x0002);        /* 1.5 units: tie to even 2 */
    CHECK(cb_f32_to_f16(5 * ldexpf(1, -25)) == 0x0002);        /* 2.5 units: tie to even 2 */
    CHECK(cb_f32_to_f16(-ldexpf(1, -30)) == 0x8000);
    CHECK(cb_f32_to_f16(1023.5f * ldexpf(1, -24)) == 0x0400);  /* tie rounds up into the normals */
    CHECK(cb_f32_to_f16(ldexpf(1, -14) * 0.99999f) == 0x0400);
    CHECK(cb_f32_to_f16(bitsf(1)) == 0);                       /* f32 subnormal */
}

TEST(test_f16_round_trip_exhaustive) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = cb_f16_to_f32((uint16_t)h);
        if (isnan(f)) {
            CHECK_MSG(isnan(cb_f16_to_f32(cb_f32_to_f16(f))), "h=0x%04x", h);
            continue;
        }
        CHECK_MSG(cb_f32_to_f16(f) == h, "h=0x%04x -> %g -> 0x%04x", h, (double)f, cb_f32_to_f16(f));
    }
}

#ifdef __FLT16_MAX__
/* Against the compiler's _Float16 conversions (round to nearest even) on many f32 bit patterns. */
TEST(test_f16_vs_compiler) {
    uint32_t x = 12345;
    int n = TEST_SANITIZED ? 200000 : 2000000;
    for (int i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        /* bias towards the interesting exponent range 2^-26 .. 2^17 */
        uint32_t e = 101 + (x >> 8) % 44;
        uint32_t bits = (x & 0x80000000u) | (e << 23) | ((x * 2654435761u) & 0x7FFFFFu);
        if (i % 7 == 0) bits = x; /* and some fully random ones */
        float f = bitsf(bits);
        if (isnan(f)) continue;
        _Float16 ref = (_Float16)f;
        uint16_t rb;
        memcpy(&rb, &ref, 2);
        CHECK_MSG(cb_f32_to_f16(f) == rb, "f=%a bits=0x%08x got 0x%04x want 0x%04x", (double)f, bits,
                  cb_f32_to_f16(f), rb);
    }
}
#endif

TEST(test_bf16) {
    CHECK(cb_f32_to_bf16(1.0f) == 0x3F80);
    CHECK(cb_bf16_to_f32(0x3F80) == 1.0f);
    CHECK(cb_bf16_to_f32(0xC040) == -3.0f);
    CHECK(cb_f32_to_bf16(bitsf(0x3F808000u)) == 0x3F80); /* tie, even stays */
    CHECK(cb_f32_to_bf16(bitsf(0x3F818000u)) == 0x3F82); /* tie, odd rounds up */
    CHECK(cb_f32_to_bf16(bitsf(0x3F808001u)) == 0x3F81);
    CHECK(cb_f32_to_bf16(INFINITY) == 0x7F80 && cb_f32_to_bf16(-INFINITY) == 0xFF80);
    CHECK(cb_f32_to_bf16(bitsf(0x7F7FFFFFu)) == 0x7F80); /* FLT_MAX rounds to inf */
    uint16_t n = cb_f32_to_bf16(bitsf(0x7F800001u));      /* NaN with a low payload stays NaN */
    CHECK(isnan(cb_bf16_to_f32(n)));
    for (uint32_t b = 0; b < 65536; b++) {
        float f = cb_bf16_to_f32((uint16_t)b);
        if (!isnan(f)) CHECK_MSG(cb_f32_to_bf16(f) == b, "b=0x%04x", b);
    }
}

TEST(test_dequant_f32_f16_bf16) {
    float src[4] = {1.5f, -2.0f, 0.0f, 1e-3f}, dst[4];
    CHECK(cb_dequant(CB_TYPE_F32, src, dst, 4));
    CHECK(memcmp(src, dst, sizeof src) == 0);
    uint8_t h[2 * 4 + 1];
    put16(h + 1, 0x3C00); put16(h + 3, 0xC000); put16(h + 5, 0x0001); put16(h + 7, 0x7BFF);
    CHECK(cb_dequant(CB_TYPE_F16, h + 1, dst, 4)); /* unaligned source */
    CHECK(dst[0] == 1.0f && dst[1] == -2.0f && dst[2] == ldexpf(1, -24) && dst[3] == 65504.0f);
    put16(h + 1, 0x3F80); put16(h + 3, 0xC040); put16(h + 5, 0x0000); put16(h + 7, 0x4120);
    CHECK(cb_dequant(CB_TYPE_BF16, h + 1, dst, 4));
    CHECK(dst[0] == 1.0f && dst[1] == -3.0f && dst[2] == 0.0f && dst[3] == 10.0f);
}

TEST(test_dequant_q4_0) {
    uint8_t blk[2 * 18 + 1], *b = blk + 1; /* two blocks, unaligned */
    for (int k = 0; k < 2; k++) {
        uint8_t *p = b + 18 * k;
        put16(p, k ? 0xB800 : 0x3800); /* d = 0.5, then -0.5 */
        for (int j = 0; j < 16; j++) p[2 + j] = (uint8_t)((j + k) % 16 | (((15 - j) % 16) << 4));
    }
    float y[64];
    CHECK(cb_dequant(CB_TYPE_Q4_0, b, y, 64));
    /* literal spot checks of the nibble order */
    CHECK(y[0] == (0 - 8) * 0.5f);  /* low nibble of qs[0] = 0 */
    CHECK(y[16] == (15 - 8) * 0.5f); /* high nibble of qs[0] = 15 */
    CHECK(y[1] == (1 - 8) * 0.5f && y[17] == (14 - 8) * 0.5f);
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 16; j++) {
            float d = k ? -0.5f : 0.5f;
            CHECK(y[32 * k + j] == (float)((j + k) % 16 - 8) * d);
            CHECK(y[32 * k + j + 16] == (float)((15 - j) - 8) * d);
        }
}

TEST(test_dequant_q4_1) {
    uint8_t b[20];
    put16(b, 0x3400);     /* d = 0.25 */
    put16(b + 2, 0xBC00); /* m = -1.0 (added) */
    for (int j = 0; j < 16; j++) b[4 + j] = (uint8_t)(j | ((j ^ 5) << 4));
    float y[32];
    CHECK(cb_dequant(CB_TYPE_Q4_1, b, y, 32));
    CHECK(y[0] == -1.0f);                  /* 0 * 0.25 - 1 */
    CHECK(y[16] == 5 * 0.25f - 1.0f);      /* high nibble of qs[0] = 5 */
    for (int j = 0; j < 16; j++) {
        CHECK(y[j] == (float)j * 0.25f - 1.0f);
        CHECK(y[j + 16] == (float)(j ^ 5) * 0.25f - 1.0f);
    }
}

/* Q5_0: hand-built blocks from their codes u = q + 16 (0..31): element j < 16 in the low nibble of qs[j],
 * j + 16 in its high nibble, bit j of the little-endian u32 qh the fifth bit of element j. */
static void pack_q5_0(uint8_t *b, uint16_t d, const int u[32]) {
    put16(b, d);
    uint32_t qh = 0;
    for (int j = 0; j < 32; j++) qh |= (uint32_t)(u[j] >> 4) << j;
    for (int k = 0; k < 4; k++) b[2 + k] = (uint8_t)(qh >> (8 * k));
    for (int j = 0; j < 16; j++) b[6 + j] = (uint8_t)((u[j] & 15) | (u[j + 16] & 15) << 4);
}

TEST(test_dequant_q5_0) {
    enum { NB = 5 };
    uint8_t buf[22 * NB + 1], *b = buf + 1; /* unaligned */
    const uint16_t ds[NB] = {0x3800 /* 0.5 */, 0xB400 /* -0.25 */, 0x0000 /* 0 */, 0x3C00 /* 1 */, 0xC000 /* -2 */};
    int u[NB][32];
    for (int j = 0; j < 32; j++) {
        u[0][j] = (j * 7 + 3) % 32;  /* every code, mixed fifth bits */
        u[1][j] = 31 - j;            /* a ramp down: the fifth bit set on the first half */
        u[2][j] = (j * 13) % 32;     /* d = 0: all zeros whatever the codes */
        u[3][j] = 16 + (j & 15);     /* all fifth bits set: qh = 0xFFFFFFFF */
        u[4][j] = j & 15;            /* no fifth bit: codes 0..15, values -16 d .. -d */
    }
    for (int k = 0; k < NB; k++) pack_q5_0(b + 22 * k, ds[k], u[k]);
    CHECK(b[22 * 3 + 2] == 0xFF && b[22 * 3 + 5] == 0xFF && b[22 * 4 + 2] == 0 && b[22 * 4 + 5] == 0);
    float y[32 * NB];
    CHECK(cb_dequant(CB_TYPE_Q5_0, b, y, 32 * NB));
    /* literal spot checks of the bit and nibble order */
    CHECK(y[0] == (3 - 16) * 0.5f);          /* code 3: low nibble 3, fifth bit 0 */
    CHECK(y[2] == (17 - 16) * 0.5f);         /* code 17: low nibble 1, fifth bit 1 (bit 2 of qh) */
    CHECK(y[16] == (19 - 16) * 0.5f);        /* element 16: code (16 * 7 + 3) % 32 = 19, high nibble of qs[0] */
    CHECK(y[32] == 15 * -0.25f && y[63] == -16 * -0.25f);
    CHECK(y[96] == 0.0f && y[96 + 15] == 15.0f && y[128] == 32.0f && y[159] == 2.0f);
    for (int k = 0; k < NB; k++) {
        const float d = cb_f16_to_f32(ds[k]);
        for (int j = 0; j < 32; j++)
            CHECK_MSG(y[32 * k + j] == (float)(u[k][j] - 16) * d, "block %d element %d: %g", k, j,
                      (double)y[32 * k + j]);
    }
}

/* gguf-py 0.19.0 (gguf.quants.quantize / dequantize, GGMLQuantizationType.Q5_0) on three blocks: 32 normal
 * values of sd 0.3 and 32 uniform in [-2, 2] with a positive maximum 2.5 (so d < 0) from numpy's
 * default_rng(20240607), then 32 values on a grid of 1/64 with the maximum -1 (d = 1/16, exact in f16, no
 * code at a rounding tie). */
static const float Q5_0_X[96] = {
    -0.025656005f, -0.12863572f, -0.86204594f, 0.9735484f, 0.044005167f, 0.3934726f, 0.10527766f, -0.21613409f,
    0.24496117f, -0.6352653f, 0.088163145f, 0.16918875f, -0.29366606f, -0.30042177f, 0.17145707f, 0.17771526f,
    -0.34257206f, -0.4324286f, 0.6280445f, 0.15395248f, 0.0088356435f, -0.3504334f, -0.26658434f, -0.16750519f,
    -0.16761023f, -0.17204945f, 0.61739874f, 0.17346421f, -0.42524156f, 0.13992843f, -0.58554167f, -0.25808334f,
    -0.2830135f, -0.61696684f, -1.0121375f, 1.5407311f, 0.5298335f, 0.38460007f, -0.31806025f, 2.5f,
    1.503026f, 0.8784771f, -1.3860315f, 1.6080788f, 0.67456824f, -0.07844595f, -0.6049495f, -0.97268605f,
    0.17545445f, -0.23674785f, 0.890527f, -0.9580371f, 1.9159743f, -0.67284244f, 1.9427847f, -1.9153503f,
    0.641238f, -0.03642489f, 0.40222895f, 0.83540815f, 1.6558406f, -0.9356768f, -1.8170155f, 1.6433547f,
    -0.921875f, 0.234375f, -0.515625f, 0.640625f, -0.109375f, -0.859375f, 0.296875f, -0.453125f,
    0.703125f, -0.046875f, -0.796875f, -1.0f, -0.390625f, 0.765625f, 0.015625f, -0.734375f,
    0.421875f, -0.328125f, 0.828125f, 0.078125f, -0.671875f, 0.484375f, -0.265625f, 0.890625f,
    0.140625f, -0.609375f, 0.546875f, -0.203125f, 0.953125f, 0.203125f, -0.546875f, 0.609375f};
static const uint8_t Q5_0_Q[66] = {
    0xca, 0xab, 0x87, 0x32, 0xf3, 0xd3, 0x60, 0x72, 0x6e, 0xd0, 0x0f,
    0x6a, 0x4e, 0x34, 0x3c, 0x3a, 0x6f, 0xdd, 0x75, 0xe5, 0xad, 0x4d,
    0x00, 0xb1, 0x47, 0xe4, 0xaa, 0x62, 0xf2, 0x24, 0xa6, 0x66, 0x4d,
    0x4e, 0x42, 0xc0, 0xc6, 0x0a, 0xd9, 0xb6, 0x5c, 0x61, 0xc4, 0x56,
    0x00, 0x2c, 0x4a, 0x61, 0xad, 0xb5, 0x71, 0xb4, 0xd8, 0x1a, 0x5e,
    0x82, 0xc5, 0xe9, 0x2b, 0x6f, 0x93, 0xd0, 0xfa, 0x3c, 0x70, 0xa4};
static const float Q5_0_Y[96] = {
    -0.0f, -0.1217041f, -0.8519287f, 0.9736328f, 0.06085205f, 0.3651123f, 0.1217041f, -0.2434082f,
    0.2434082f, -0.6085205f, 0.06085205f, 0.18255615f, -0.30426025f, -0.30426025f, 0.18255615f, 0.18255615f,
    -0.3651123f, -0.42596436f, 0.6085205f, 0.18255615f, -0.0f, -0.3651123f, -0.2434082f, -0.18255615f,
    -0.18255615f, -0.18255615f, 0.6085205f, 0.18255615f, -0.42596436f, 0.1217041f, -0.6085205f, -0.2434082f,
    -0.3125f, -0.625f, -0.9375f, 1.5625f, 0.46875f, 0.3125f, -0.3125f, 2.5f,
    1.5625f, 0.9375f, -1.40625f, 1.5625f, 0.625f, -0.15625f, -0.625f, -0.9375f,
    0.15625f, -0.3125f, 0.9375f, -0.9375f, 1.875f, -0.625f, 1.875f, -1.875f,
    0.625f, -0.0f, 0.46875f, 0.78125f, 1.71875f, -0.9375f, -1.875f, 1.71875f,
    -0.9375f, 0.25f, -0.5f, 0.625f, -0.125f, -0.875f, 0.3125f, -0.4375f,
    0.6875f, -0.0625f, -0.8125f, -1.0f, -0.375f, 0.75f, 0.0f, -0.75f,
    0.4375f, -0.3125f, 0.8125f, 0.0625f, -0.6875f, 0.5f, -0.25f, 0.875f,
    0.125f, -0.625f, 0.5625f, -0.1875f, 0.9375f, 0.1875f, -0.5625f, 0.625f};

TEST(test_q5_0_gguf_py) {
    float y[96];
    CHECK(cb_dequant(CB_TYPE_Q5_0, Q5_0_Q, y, 96));
    for (int j = 0; j < 96; j++) /* bit for bit, the signs of zero included */
        CHECK_MSG(fbits(y[j]) == fbits(Q5_0_Y[j]), "element %d: %a, gguf-py %a", j, (double)y[j], (double)Q5_0_Y[j]);
    /* the third block's scale is exact in f16, so both quantizers take the same codes (gguf-py rounds with the
     * f32 scale, this one with the f16 scale it stores; elsewhere they may differ by one code) */
    uint8_t q[66];
    CHECK(cb_quant(CB_TYPE_Q5_0, Q5_0_X, q, 96));
    CHECK(memcmp(q + 44, Q5_0_Q + 44, 22) == 0);
    CHECK(memcmp(q, Q5_0_Q, 2) == 0 && memcmp(q + 22, Q5_0_Q + 22, 2) == 0); /* the same d in the others */
    float y2[96];
    CHECK(cb_dequant(CB_TYPE_Q5_0, q, y2, 96));
    for (int j = 0; j < 96; j++) /* nearest code: no worse than gguf-py's */
        CHECK(fabsf(y2[j] - Q5_0_X[j]) <= fabsf(Q5_0_Y[j] - Q5_0_X[j]) + 1e-6f);
}

TEST(test_dequant_q8_0) {
    uint8_t b[34];
    put16(b, 0x4000); /* d = 2 */
    for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)(j * 8 - 128);
    float y[32];
    CHECK(cb_dequant(CB_TYPE_Q8_0, b, y, 32));
    CHECK(y[0] == -256.0f && y[31] == (31 * 8 - 128) * 2.0f);
    for (int j = 0; j < 32; j++) CHECK(y[j] == (float)(j * 8 - 128) * 2.0f);
}

/* Packs 8 six-bit scales and mins into the 12 bytes s (zeroed) the way ggml's quantizer does. */
static void pack_scale_min(const uint8_t sc[8], const uint8_t mn[8], uint8_t *s) {
    for (int k = 0; k < 8; k++) {
        if (k < 4) {
            s[k] |= sc[k];
            s[k + 4] |= mn[k];
        } else {
            s[k + 4] = (uint8_t)((sc[k] & 0xF) | ((mn[k] & 0xF) << 4));
            s[k - 4] |= (uint8_t)((sc[k] >> 4) << 6);
            s[k] |= (uint8_t)((mn[k] >> 4) << 6);
        }
    }
}

TEST(test_dequant_q4_k) {
    /* choose 6-bit scales and mins, pack them the way ggml's quantizer does, check the decode */
    uint8_t sc[8] = {1, 63, 17, 32, 45, 7, 60, 33}, mn[8] = {0, 5, 63, 40, 19, 48, 2, 61};
    uint8_t b[144] = {0};
    put16(b, 0x3800);     /* d = 0.5 */
    put16(b + 2, 0x3400); /* dmin = 0.25 (subtracted) */
    uint8_t *s = b + 4, *qs = b + 16;
    pack_scale_min(sc, mn, s);
    uint8_t q[256];
    for (int e = 0; e < 256; e++) q[e] = (uint8_t)((e * 7 + e / 32) & 15);
    /* chunk c of 64: low nibbles = elements 64c..64c+31, high nibbles = 64c+32..64c+63 */
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) qs[32 * c + l] = (uint8_t)(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
    float y[256];
    CHECK(cb_dequant(CB_TYPE_Q4_K, b, y, 256));
    for (int e = 0; e < 256; e++) {
        int sub = e / 32;
        float want = 0.5f * (float)sc[sub] * (float)q[e] - 0.25f * (float)mn[sub];
        CHECK_MSG(y[e] == want, "e=%d got %g want %g", e, (double)y[e], (double)want);
    }
}

/* Q5_K: Q4_K's scales and mins (the same 12 bytes), nibbles as Q4_K's, the fifth bit of element l of
 * sub-block k in bit k of qh[l]. */
TEST(test_dequant_q5_k) {
    uint8_t sc[8] = {63, 1, 30, 17, 8, 45, 2, 60}, mn[8] = {12, 63, 0, 33, 7, 21, 50, 4};
    uint8_t b[176] = {0};
    put16(b, 0x3800);     /* d = 0.5 */
    put16(b + 2, 0x3400); /* dmin = 0.25 */
    uint8_t *s = b + 4, *qh = b + 16, *qs = b + 48;
    pack_scale_min(sc, mn, s);
    uint8_t q[256];
    for (int e = 0; e < 256; e++) q[e] = (uint8_t)((e * 13 + e / 32 + 5) & 31);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) qs[32 * c + l] = (uint8_t)((q[64 * c + l] & 15) | ((q[64 * c + 32 + l] & 15) << 4));
    for (int l = 0; l < 32; l++)
        for (int k = 0; k < 8; k++) qh[l] |= (uint8_t)((q[32 * k + l] >> 4) << k);
    float y[256];
    CHECK(cb_dequant(CB_TYPE_Q5_K, b, y, 256));
    for (int e = 0; e < 256; e++) {
        int sub = e / 32;
        float want = 0.5f * (float)sc[sub] * (float)q[e] - 0.25f * (float)mn[sub];
        CHECK_MSG(y[e] == want, "e=%d got %g want %g", e, (double)y[e], (double)want);
    }
    CHECK(cb_type_block_elems(CB_TYPE_Q5_K) == 256 && cb_type_block_bytes(CB_TYPE_Q5_K) == 176);
}

TEST(test_dequant_q6_k) {
    uint8_t b[210] = {0};
    uint8_t *ql = b, *qh = b + 128;
    int8_t scales[16] = {1, -2, 3, -4, 5, -6, 7, -8, 127, -128, 11, -12, 13, -14, 15, -16};
    memcpy(b + 192, scales, 16);
    put16(b + 208, 0x3800); /* d = 0.5, stored last */
    uint8_t q[256];
    for (int e = 0; e < 256; e++) q[e] = (uint8_t)((e * 37 + 11) & 63);
    /* pack: half h, l in 0..31, quarter t: element 128h + 32t + l */
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *v = q + 128 * h;
            ql[64 * h + l] = (uint8_t)((v[l] & 15) | ((v[l + 64] & 15) << 4));
            ql[64 * h + l + 32] = (uint8_t)((v[l + 32] & 15) | ((v[l + 96] & 15) << 4));
            qh[32 * h + l] = (uint8_t)((v[l] >> 4) | ((v[l + 32] >> 4) << 2) | ((v[l + 64] >> 4) << 4) |
                                       ((v[l + 96] >> 4) << 6));
        }
    float y[256];
    CHECK(cb_dequant(CB_TYPE_Q6_K, b, y, 256));
    for (int e = 0; e < 256; e++) {
        float want = 0.5f * (float)scales[e / 16] * (float)((int)q[e] - 32);
        CHECK_MSG(y[e] == want, "e=%d got %g want %g", e, (double)y[e], (double)want);
    }
}

TEST(test_dequant_args) {
    uint8_t b[64] = {0};
    float y[64];
    CHECK(!cb_dequant(CB_TYPE_Q4_0, b, y, 31));  /* not a multiple of the block */
    CHECK(!cb_dequant(CB_TYPE_Q4_K, b, y, 32));
    CHECK(!cb_dequant(7 /* Q5_1, unsupported */, b, y, 32));
    CHECK(cb_dequant(CB_TYPE_Q5_0, b, y, 64) && !cb_dequant(CB_TYPE_Q5_0, b, y, 48));
    CHECK(cb_type_block_elems(CB_TYPE_Q5_0) == 32 && cb_type_block_bytes(CB_TYPE_Q5_0) == 22);
    CHECK(!cb_dequant(999, b, y, 32));
    CHECK(cb_dequant(CB_TYPE_Q4_1, b, y, 0));
    CHECK(cb_type_block_elems(CB_TYPE_Q4_K) == 256 && cb_type_block_bytes(CB_TYPE_Q6_K) == 210);
}

/* ---------------------------------------------------------------- cb_quant */

static const uint32_t QTYPES[] = {CB_TYPE_F32, CB_TYPE_F16, CB_TYPE_BF16, CB_TYPE_Q4_0, CB_TYPE_Q4_1,
                                  CB_TYPE_Q5_0, CB_TYPE_Q8_0, CB_TYPE_Q4_K, CB_TYPE_Q5_K, CB_TYPE_Q6_K};
enum { N_QTYPES = sizeof QTYPES / sizeof QTYPES[0] };

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static double urand(void) { /* [0, 1) */
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) / 9007199254740992.0;
}

static float rd16(const uint8_t *p) { return cb_f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

/* The grid of element e in a quantized row q (this test's own reading of the layouts): its value is
 * step * code + off for an integer code in [lo, hi]; *d1 and *d2 get the type's super-scales (Q4_K: d,
 * dmin; Q6_K: d) for the bounds. */
typedef struct { float step, off; int lo, hi; float d1, d2; } grid_t;
static grid_t grid_of(uint32_t t, const uint8_t *q, size_t e) {
    grid_t g = {0};
    switch (t) {
    case CB_TYPE_Q4_0: g = (grid_t){rd16(q + 18 * (e / 32)), 0, -8, 7, 0, 0}; break;
    case CB_TYPE_Q5_0: g = (grid_t){rd16(q + 22 * (e / 32)), 0, -16, 15, 0, 0}; break;
    case CB_TYPE_Q8_0: g = (grid_t){rd16(q + 34 * (e / 32)), 0, -127, 127, 0, 0}; break;
    case CB_TYPE_Q4_1: {
        const uint8_t *b = q + 20 * (e / 32);
        g = (grid_t){rd16(b), rd16(b + 2), 0, 15, 0, 0};
        break;
    }
    case CB_TYPE_Q4_K:
    case CB_TYPE_Q5_K: {
        const uint8_t *b = q + (t == CB_TYPE_Q4_K ? 144 : 176) * (e / 256), *s = b + 4;
        const int k = (int)(e % 256) / 32;
        const int sc = k < 4 ? s[k] & 63 : (s[k + 4] & 0xF) | (s[k - 4] >> 6) << 4;
        const int mn = k < 4 ? s[k + 4] & 63 : (s[k + 4] >> 4) | (s[k] >> 6) << 4;
        const float d = rd16(b), dmin = rd16(b + 2);
        g = (grid_t){d * (float)sc, -dmin * (float)mn, 0, t == CB_TYPE_Q4_K ? 15 : 31, d, dmin};
        break;
    }
    case CB_TYPE_Q6_K: {
        const uint8_t *b = q + 210 * (e / 256);
        const float d = rd16(b + 208);
        g = (grid_t){d * (float)(int8_t)b[192 + (e % 256) / 16], 0, -32, 31, d, 0};
        break;
    }
    }
    return g;
}

/* Half the f16 spacing at |v| (2^-25 in the subnormals): the most an f16 rounding of v moves it. */
static double h16(double v) {
    int e;
    frexp(fabs(v), &e);
    return fabs(v) < 0x1p-14 ? 0x1p-25 : ldexp(1.0, e - 12);
}

/* Checks the dequantized row y of x (n elements, type t, quantized q) element by element against the bounds
 * format/quant.h states for cb_quant, h(v) being half the f16 spacing at a stored scale v:
 *   Q8_0 d/2 + 127 h(d); Q4_0, Q5_0 d/2 inside the grid, d beyond it, + 8 (16) h(d); Q4_1 d/2 + h(m) +
 *   15 h(d) (+ 2^-10 max|x| for a block stored as a constant); Q4_K (Q5_K) max(d sc/2, 15 d (31 d), dmin,
 *   945 h(d) (1953 h(d)), 63 h(dmin)); Q6_K |d sc|/2 inside the grid, |d sc| + 32 |d| + 4096 h(d) beyond it;
 * and that y is the grid point nearest to x, up to those h terms (the f16 rounding of a scale can move a
 * block's extreme element, whose code is fixed, off the nearest point) and f32 rounding. Returns the
 * number of failures (the first few printed). */
static int check_quant_error(uint32_t t, const float *x, const uint8_t *q, const float *y, size_t n) {
    const size_t be = cb_type_block_elems(t);
    int bad = 0;
    for (size_t e = 0; e < n; e++) {
        const double xe = x[e], err = fabs(xe - (double)y[e]);
        double amax = 0, bound, nearest = 0;
        for (size_t j = e / be * be; j < e / be * be + be; j++) amax = fmax(amax, fabs((double)x[j]));
        if (be == 1) { /* F32 exact; F16 / BF16 half an ulp (2^-25 at the f16 subnormals) */
            bound = t == CB_TYPE_F32 ? 0 : t == CB_TYPE_F16 ? fabs(xe) * 0x1p-11 + 0x1p-25 : fabs(xe) * 0x1p-8;
        } else {
            const grid_t g = grid_of(t, q, e);
            const double step = fabs((double)g.step), u = g.step != 0 ? (xe - g.off) / g.step : 0;
            const double near = g.step != 0 ? fmin(fmax(round(u), g.lo), g.hi) : 0;
            const bool inside = g.step != 0 && u >= g.lo - 0.5 && u <= g.hi + 0.5;
            double fixed; /* what the f16 rounding of the scales can add at a block's extreme elements */
            switch (t) {
            case CB_TYPE_Q8_0: fixed = 127 * h16(g.step); bound = 0.5 * step; break;
            case CB_TYPE_Q4_0: fixed = 8 * h16(g.step); bound = (inside ? 0.5 : 1.0) * step; break;
            case CB_TYPE_Q5_0: fixed = 16 * h16(g.step); bound = (inside ? 0.5 : 1.0) * step; break;
            case CB_TYPE_Q4_1:
                fixed = h16(g.off) + 15 * h16(g.step);
                bound = step != 0 ? 0.5 * step : 0x1p-10 * amax;
                break;
            case CB_TYPE_Q4_K:
            case CB_TYPE_Q5_K:
                fixed = 63 * g.hi * h16(g.d1) + 63 * h16(g.d2);
                bound = fmax(fmax(0.5 * step, g.hi * g.d1), g.d2);
                break;
            default: /* Q6_K */
                fixed = 4096 * h16(g.d1);
                bound = inside ? 0.5 * step : step + 32.0 * fabs(g.d1);
                break;
            }
            const double tiny = 1e-6 * amax + 1e-30;
            bound += fixed + tiny;
            nearest = fabs(xe - (near * g.step + g.off)) + fixed + tiny;
        }
        if (!(err <= bound) || (be > 1 && !(err <= nearest))) {
            if (bad++ < 5)
                fprintf(stderr, "  %s element %zu: x %.9g y %.9g error %.3g, bound %.3g, nearest point at %.3g\n",
                        cb_type_name(t), e, xe, (double)y[e], err, bound, nearest);
        }
    }
    return bad;
}

/* Test rows: blocks of 256 of one kind each, at a scale from 1e-3 to 1e3. */
static void fill_blocks(float *x, size_t n) {
    for (size_t b = 0; b < n / 256; b++) {
        float *xb = x + 256 * b;
        const double sc = pow(10.0, -3.0 + 6.0 * urand()), off = (urand() - 0.5) * 4.0 * sc;
        const int kind = (int)(b % 8);
        for (int j = 0; j < 256; j++) {
            double v;
            switch (kind) {
            case 0: v = (2 * urand() - 1) * sc; break;                                      /* uniform */
            case 1: v = sqrt(-2 * log(1 - urand())) * cos(6.283185307179586 * urand()) * sc; break; /* normal */
            case 2: v = (2 * urand() - 1) * sc * pow(10.0, -2.0 * (j / 16 % 3 == 1));  break; /* varied groups */
            case 3: v = off + (2 * urand() - 1) * sc; break;                                /* offset */
            case 4: v = (j % 11 == 0 ? 30.0 : 1.0) * (2 * urand() - 1) * sc; break;        /* outliers */
            case 5: v = urand() < 0.6 ? 0.0 : (2 * urand() - 1) * sc; break;                /* sparse */
            case 6: v = urand() * sc; break;                                                 /* positive */
            default: v = -urand() * sc; break;                                               /* negative */
            }
            xb[j] = (float)v;
        }
    }
}

/* Quantizes x [n] to t, dequantizes, checks each element's error, and that quantizing the dequantized row
 * gives the same bytes (idempotence). Returns false on a failure (reported). */
static bool quant_round_trip(uint32_t t, const float *x, size_t n, const char *what) {
    const size_t nb = cb_quant_row_bytes(t, n);
    uint8_t *q = malloc(nb), *q2 = malloc(nb);
    float *y = malloc(sizeof(float) * n);
    bool ok = q && q2 && y && cb_quant(t, x, q, n) && cb_dequant(t, q, y, n);
    const int bad = ok ? check_quant_error(t, x, q, y, n) : -1;
    ok = ok && bad == 0 && cb_quant(t, y, q2, n);
    if (ok && memcmp(q, q2, nb) != 0) {
        size_t k = 0;
        while (q[k] == q2[k]) k++;
        fprintf(stderr, "  %s %s: quantize(dequantize(q)) differs at byte %zu (block %zu)\n", cb_type_name(t), what, k,
                k / cb_type_block_bytes(t));
        ok = false;
    }
    if (!ok) fprintf(stderr, "  %s %s: %d element errors\n", cb_type_name(t), what, bad);
    free(q);
    free(q2);
    free(y);
    return ok;
}

TEST(test_quant_random) {
    enum { N = 256 * 64 };
    float *x = malloc(sizeof(float) * N);
    CHECK(x);
    for (int rep = 0; rep < (TEST_SANITIZED ? 2 : 8); rep++) {
        fill_blocks(x, N);
        for (int i = 0; i < N_QTYPES; i++) CHECK_MSG(quant_round_trip(QTYPES[i], x, N, "random"), "rep %d", rep);
    }
    free(x);
}

/* All-zero blocks give zero values (and zero scales); constant blocks give one value within 2^-8 of the
 * constant (BF16's half ulp; + 2^-13 for the K types' f16 subnormal super-scales at 1e-3); both are
 * idempotent. */
TEST(test_quant_zero_constant) {
    enum { N = 512 };
    const float consts[] = {0.0f, 0.7f, -0.7f, 1e-3f, -123.25f, 3.0f};
    float x[N], y[N];
    uint8_t q[N * 4];
    for (size_t c = 0; c < sizeof consts / sizeof consts[0]; c++) {
        for (int j = 0; j < N; j++) x[j] = consts[c];
        for (int i = 0; i < N_QTYPES; i++) {
            const uint32_t t = QTYPES[i];
            CHECK(quant_round_trip(t, x, N, consts[c] == 0 ? "zeros" : "constant"));
            CHECK(cb_quant(t, x, q, N) && cb_dequant(t, q, y, N));
            for (int j = 0; j < N; j++) {
                CHECK_MSG(y[j] == y[0], "%s %g: element %d %g, element 0 %g", cb_type_name(t), (double)consts[c], j,
                          (double)y[j], (double)y[0]);
                CHECK_MSG(fabsf(y[j] - consts[c]) <= fabsf(consts[c]) * 0x1p-8f + 0x1p-13f, "%s %g: %g",
                          cb_type_name(t), (double)consts[c], (double)y[j]);
            }
            if (consts[c] == 0) /* no stray bits: zero scales (and -0 nowhere) */
                for (int j = 0; j < N; j++) CHECK_MSG(fbits(y[j]) == 0, "%s zeros: element %d", cb_type_name(t), j);
        }
    }
    /* one zero block among others stays zero */
    for (int j = 0; j < N; j++) x[j] = j >= 256 && j < 288 ? 0.0f : (float)sin(j);
    for (int i = 0; i < N_QTYPES; i++) {
        CHECK(cb_quant(QTYPES[i], x, q, N) && cb_dequant(QTYPES[i], q, y, N));
        for (int j = 256; j < 288; j++) CHECK(y[j] == 0.0f);
    }
}

/* Blocks at the edges of the rules: ties, the largest |x| on either sign, a Q4_1 block whose spread f16
 * cannot resolve, Q4_K sub-blocks with mins and without, Q6_K groups whose scale is far below the largest,
 * tiny blocks with subnormal f16 scales, and Q8_0's -128 (never written). */
TEST(test_quant_edges) {
    enum { N = 256 };
    float x[N];
    /* the largest |x| positive: Q4_0 / Q5_0 d < 0, the element maps to -8 / -16 */
    for (int j = 0; j < N; j++) x[j] = j % 32 == 5 ? 1.0f : -0.5f + (float)(j % 32) / 64.0f;
    for (int i = 0; i < N_QTYPES; i++) CHECK(quant_round_trip(QTYPES[i], x, N, "positive max"));
    uint8_t q[N * 4];
    float y[N];
    CHECK(cb_quant(CB_TYPE_Q4_0, x, q, 32) && rd16(q) == -0.125f && (q[2 + 5] & 0xF) == 0);
    CHECK(cb_quant(CB_TYPE_Q5_0, x, q, 32) && rd16(q) == -0.0625f && (q[6 + 5] & 0xF) == 0 && !(q[2] & 0x20));
    /* exact ties x / d = k + 1/2 */
    for (int j = 0; j < N; j++) x[j] = j % 32 == 0 ? 8.0f : (float)(j % 16) - 7.5f;
    for (int i = 0; i < N_QTYPES; i++) CHECK(quant_round_trip(QTYPES[i], x, N, "ties"));
    /* a Q4_1 block of spread 1e-4 at 10: stored as a constant; one of spread 1 at 10: the full grid */
    for (int j = 0; j < 64; j++) x[j] = j < 32 ? 10.0f + 1e-4f * (float)j / 32.0f : 10.0f + (float)(j - 32) / 32.0f;
    CHECK(cb_quant(CB_TYPE_Q4_1, x, q, 64) && rd16(q) == 0.0f && rd16(q + 20) > 0.0f);
    CHECK(quant_round_trip(CB_TYPE_Q4_1, x, 64, "narrow"));
    /* Q4_K / Q6_K: sub-blocks 100x apart, all-positive and all-negative ones, one of zeros */
    for (int j = 0; j < N; j++) {
        const int k = j / 32;
        const float a = (float)sin(0.7 * j + 1.0);
        x[j] = k == 0 ? 100.0f * a : k == 1 ? fabsf(a) : k == 2 ? -fabsf(a) - 2.0f : k == 3 ? 0.0f
             : k == 4 ? 0.01f * a : a;
    }
    for (int i = 0; i < N_QTYPES; i++) CHECK(quant_round_trip(QTYPES[i], x, N, "mixed sub-blocks"));
    /* tiny blocks: f16 scales in the subnormals or zero (the K types' super-scales underflow: their error is
     * up to 945 or 4096 times 2^-25, as stated) */
    for (int j = 0; j < N; j++) x[j] = 1e-5f * (float)sin(1.3 * j);
    for (int i = 0; i < N_QTYPES; i++) {
        CHECK(quant_round_trip(QTYPES[i], x, N, "tiny"));
        CHECK(cb_quant(QTYPES[i], x, q, N) && cb_dequant(QTYPES[i], q, y, N));
        for (int j = 0; j < N; j++) CHECK(isfinite(y[j]) && fabsf(y[j] - x[j]) <= 1.3e-4f);
    }
    /* Q8_0 never writes -128 (the x8 kernels need |q| <= 127) */
    for (int j = 0; j < 32; j++) x[j] = j == 3 ? -1.0f : 0.999f * (float)cos(j);
    CHECK(cb_quant(CB_TYPE_Q8_0, x, q, 32));
    for (int j = 0; j < 32; j++) CHECK((int8_t)q[2 + j] >= -127);
    CHECK((int8_t)q[2 + 3] == -127);
}

TEST(test_quant_args) {
    float x[256] = {0};
    uint8_t q[1024 + 1], q2[1024];
    CHECK(!cb_quant(CB_TYPE_Q4_0, x, q, 31));
    CHECK(!cb_quant(CB_TYPE_Q4_K, x, q, 32));
    CHECK(!cb_quant(7 /* Q5_1 */, x, q, 32) && !cb_quant(999, x, q, 32));
    CHECK(!cb_quant(CB_TYPE_Q8_0, NULL, q, 32) && !cb_quant(CB_TYPE_Q8_0, x, NULL, 32));
    CHECK(cb_quant(CB_TYPE_Q6_K, NULL, NULL, 0));
    CHECK(cb_quant_row_bytes(CB_TYPE_Q5_0, 64) == 44 && cb_quant_row_bytes(CB_TYPE_Q4_K, 512) == 288);
    CHECK(cb_quant_row_bytes(CB_TYPE_Q6_K, 256) == 210 && cb_quant_row_bytes(CB_TYPE_F16, 3) == 6);
    CHECK(cb_quant_row_bytes(CB_TYPE_Q4_1, 33) == 0 && cb_quant_row_bytes(999, 32) == 0);
    /* dst needs no alignment */
    for (int j = 0; j < 256; j++) x[j] = (float)j / 256.0f - 0.3f;
    for (int i = 0; i < N_QTYPES; i++) {
        const size_t nb = cb_quant_row_bytes(QTYPES[i], 256);
        CHECK(cb_quant(QTYPES[i], x, q + 1, 256) && cb_quant(QTYPES[i], x, q2, 256));
        CHECK(memcmp(q + 1, q2, nb) == 0);
    }
}

/* Dequantizes every tensor of the real model and reports the time (speed target: well under 1 s). */
TEST(test_dequant_real_model) {
    const char *path = test_model_path();
    if (!path) SKIP("model not present");
    if (TEST_SANITIZED) SKIP("timing only in the optimized build");
    char err[256];
    cb_gguf_t *g = cb_gguf_open(path, err, sizeof err);
    CHECK_MSG(g, "%s", err);
    size_t max_el = 0, total = 0;
    for (size_t i = 0; i < cb_gguf_n_tensors(g); i++) {
        const cb_gguf_tensor_t *t = cb_gguf_tensor(g, i);
        size_t n = (size_t)(t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]);
        if (n > max_el) max_el = n;
    }
    float *buf = malloc(max_el * sizeof *buf);
    CHECK(buf);
    double t0 = cb_now_ms();
    bool ok = true, finite = true;
    for (size_t i = 0; i < cb_gguf_n_tensors(g); i++) {
        const cb_gguf_tensor_t *t = cb_gguf_tensor(g, i);
        size_t n = (size_t)(t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]);
        ok &= cb_dequant(t->type, t->data, buf, n);
        finite &= isfinite(buf[0]) && isfinite(buf[n - 1]);
        total += n;
    }
    double s = (cb_now_ms() - t0) / 1e3;
    fprintf(stderr, "  dequantized %zu weights in %.3f s (%.0f M/s, first touch of the mapping included)\n",
            total, s, (double)total / s / 1e6);
    free(buf);
    cb_gguf_destroy(&g);
    CHECK(ok && finite);
    CHECK(total > 130000000 && total < 140000000);
}

int main(void) {
    RUN(test_f16_known);
    RUN(test_f16_rounding);
    RUN(test_f16_round_trip_exhaustive);
#ifdef __FLT16_MAX__
    RUN(test_f16_vs_compiler);
#endif
    RUN(test_bf16);
    RUN(test_dequant_f32_f16_bf16);
    RUN(test_dequant_q4_0);
    RUN(test_dequant_q4_1);
    RUN(test_dequant_q5_0);
    RUN(test_q5_0_gguf_py);
    RUN(test_dequant_q8_0);
    RUN(test_dequant_q4_k);
    RUN(test_dequant_q5_k);
    RUN(test_dequant_q6_k);
    RUN(test_dequant_args);
    RUN(test_quant_random);
    RUN(test_quant_zero_constant);
    RUN(test_quant_edges);
    RUN(test_quant_args);
    RUN(test_dequant_real_model);
    return test_summary();
}
