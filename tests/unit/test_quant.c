/* test_quant: dequantization of hand-built blocks of every supported type (expected values computed
 * independently here, from the packing side), fp16/bf16 conversions (exhaustive round trip, rounding,
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

TEST(test_dequant_q8_0) {
    uint8_t b[34];
    put16(b, 0x4000); /* d = 2 */
    for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)(j * 8 - 128);
    float y[32];
    CHECK(cb_dequant(CB_TYPE_Q8_0, b, y, 32));
    CHECK(y[0] == -256.0f && y[31] == (31 * 8 - 128) * 2.0f);
    for (int j = 0; j < 32; j++) CHECK(y[j] == (float)(j * 8 - 128) * 2.0f);
}

TEST(test_dequant_q4_k) {
    /* choose 6-bit scales and mins, pack them the way ggml's quantizer does, check the decode */
    uint8_t sc[8] = {1, 63, 17, 32, 45, 7, 60, 33}, mn[8] = {0, 5, 63, 40, 19, 48, 2, 61};
    uint8_t b[144] = {0};
    put16(b, 0x3800);     /* d = 0.5 */
    put16(b + 2, 0x3400); /* dmin = 0.25 (subtracted) */
    uint8_t *s = b + 4, *qs = b + 16;
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
    CHECK(!cb_dequant(6 /* Q5_0, unsupported */, b, y, 32));
    CHECK(!cb_dequant(999, b, y, 32));
    CHECK(cb_dequant(CB_TYPE_Q4_1, b, y, 0));
    CHECK(cb_type_block_elems(CB_TYPE_Q4_K) == 256 && cb_type_block_bytes(CB_TYPE_Q6_K) == 210);
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
    RUN(test_dequant_q8_0);
    RUN(test_dequant_q4_k);
    RUN(test_dequant_q6_k);
    RUN(test_dequant_args);
    RUN(test_dequant_real_model);
    return test_summary();
}
