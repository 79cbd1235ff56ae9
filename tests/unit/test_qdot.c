/* test_qdot: the integer matvec kernels (kernels/cpu/cpu_quant.h) against the f32 reference (each weight
 * row dequantized exactly by cb_dequant, products summed in double), for every supported type (Q4_0, Q4_1,
 * Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), on random blocks, on Q5_0 blocks of extreme codes, and on the real models'
 * tensors (the default SmolLM2 Q4_1 / Q8_0 model, and Qwen2.5-Coder-1.5B Q4_K_M's Q4_K / Q6_K ones when
 * present), in every kernel set this CPU can run (scalar, AVX2).
 *
 * Tolerance, per output: the activation rounding bound of cpu_quant.h, sum over the activation's scale
 * blocks b (32 elements for Q4_0 / Q4_1 / Q5_0 / Q8_0, 256 for Q4_K / Q6_K) of max|x_b| / 254 * sum_j |w_j|
 * (q = round(x / d) is off by d/2 at most), plus 1e-5 of sum |w||x| for the f32 accumulation. The
 * measured worst ratio of error to bound is printed: ~0.1-0.3 (the bound is a worst case over independent
 * roundings).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu_backend.h"
#include "cpu/cpu_ops.h"
#include "cpu/cpu_pool.h"
#include "cpu/cpu_quant.h"
#include "format/gguf.h"
#include "format/quant.h"
#include "model/model.h"
#include "test.h"

static uint64_t g_rng = 88172645463325252ull;
static uint32_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 11);
}
static float frand(void) { return (float)((double)rnd() / 4294967296.0 * 2.0 - 1.0); } /* [-1, 1] */

static void put_f16(uint8_t *p, float f) {
    uint16_t h = cb_f32_to_f16(f);
    memcpy(p, &h, 2);
}

/* A random weight of rows x cols of type t, blocks with sane scales; *buf owned by the caller. */
static cb_weight_t random_weight(uint32_t t, int rows, int cols, uint8_t **buf) {
    const size_t be = cb_type_block_elems(t), bb = cb_type_block_bytes(t), nb = (size_t)rows * cols / be;
    uint8_t *p = malloc(nb * bb);
    for (size_t i = 0; i < nb * bb; i++) p[i] = (uint8_t)rnd();
    for (size_t b = 0; b < nb; b++) {
        uint8_t *blk = p + b * bb;
        float d = 0.002f + 0.02f * fabsf(frand());
        switch (t) {
        case CB_TYPE_Q4_0: put_f16(blk, d); break;
        case CB_TYPE_Q5_0: put_f16(blk, d / 2); break; /* random qh: every fifth-bit pattern */
        case CB_TYPE_Q4_1: put_f16(blk, d); put_f16(blk + 2, -0.1f * fabsf(frand())); break;
        case CB_TYPE_Q8_0: put_f16(blk, d / 8); break;
        case CB_TYPE_Q4_K: put_f16(blk, d / 16); put_f16(blk + 2, d / 32); break;
        case CB_TYPE_Q5_K: put_f16(blk, d / 32); put_f16(blk + 2, d / 32); break;
        case CB_TYPE_Q6_K: put_f16(blk + 208, d / 64); break;
        }
    }
    *buf = p;
    return (cb_weight_t){.name = "w", .type = t, .q = p, .row_bytes = (size_t)cols / be * bb, .rows = rows,
                         .cols = cols};
}

/* Activations: mostly [-1, 1), some blocks scaled up 30x (outliers), some all zero. */
static void random_x(float *x, int n) {
    for (int b = 0; b < n / 32; b++) {
        int kind = (int)(rnd() % 8);
        float s = kind == 0 ? 0.0f : kind == 1 ? 30.0f : 1.0f;
        for (int j = 0; j < 32; j++) x[32 * b + j] = frand() * s;
    }
}

/* Checks y [n][ldy] (rows o0..o1 of w) against the reference; returns the worst error / bound ratio, or
 * a value > 1 on failure. */
static double check_against_ref(const cb_weight_t *w, const float *x, int n, int o0, int o1, const float *y, int ldy) {
    float *row = malloc(sizeof(float) * (size_t)w->cols);
    const int bl = cb_cpu_qdot_format(w) == CB_CPU_Q8_K ? 256 : 32; /* the activation's scale block */
    double worst = 0;
    for (int o = o0; o < o1; o++) {
        if (!cb_dequant(w->type, (const uint8_t *)w->q + (size_t)o * w->row_bytes, row, (size_t)w->cols)) return 1e9;
        for (int r = 0; r < n; r++) {
            const float *xr = x + (size_t)r * w->cols;
            double ref = 0, bound = 0, mag = 0;
            for (int b = 0; b < w->cols / bl; b++) {
                double amax = 0, wsum = 0;
                for (int j = bl * b; j < bl * b + bl; j++) {
                    ref += (double)row[j] * xr[j];
                    mag += fabs((double)row[j] * xr[j]);
                    amax = fmax(amax, fabs(xr[j]));
                    wsum += fabs(row[j]);
                }
                bound += amax / 254 * wsum;
            }
            bound += 1e-5 * mag + 1e-30;
            double err = fabs(y[(size_t)r * ldy + o] - ref);
            if (err / bound > worst) worst = err / bound;
            if (!(err <= bound)) {
                fprintf(stderr, "  %s row %d x %d: got %.9g, reference %.9g, bound %.3g\n", cb_type_name(w->type), o, r,
                        (double)y[(size_t)r * ldy + o], ref, bound);
                free(row);
                return 2.0;
            }
        }
    }
    free(row);
    return worst;
}

/* mag [n][rows]: sum_j |w_oj x_rj| of each output, the scale of its f32 rounding. */
static void out_mags(const cb_weight_t *w, const float *x, int n, double *mag) {
    float *row = malloc(sizeof(float) * (size_t)w->cols);
    for (int o = 0; o < w->rows; o++) {
        cb_dequant(w->type, (const uint8_t *)w->q + (size_t)o * w->row_bytes, row, (size_t)w->cols);
        for (int r = 0; r < n; r++) {
            double m = 0;
            for (int j = 0; j < w->cols; j++) m += fabs((double)row[j] * x[(size_t)r * w->cols + j]);
            mag[(size_t)r * w->rows + o] = m;
        }
    }
    free(row);
}

/* y [n][rows] = w · x for n rows of x, by the kernels. xq: scratch of n quantized rows. */
static void qmatvec(const cb_weight_t *w, const float *x, int n, float *y, uint8_t *xq) {
    const size_t rb = cb_cpu_q8_row_bytes(w->cols);
    for (int r = 0; r < n; r++)
        cb_cpu_q8_quantize(x + (size_t)r * w->cols, w->cols, cb_cpu_qdot_format(w), xq + (size_t)r * rb);
    cb_cpu_qdot_rows(w, 0, w->rows, xq, n, y, w->rows);
}

static const char *const ISAS[] = {"scalar", "avx2", "avx512vnni", "avx512vnni-emulated", "amx", "amx-emulated"};
enum { N_ISAS = 6 };

TEST(test_quantize_row) {
    enum { C = 2048 };
    float x[C];
    random_x(x, C);
    x[5] = 1e-30f; /* tiny values and exact ties (x / d = k + 0.5 rounds to even) */
    for (int j = 64; j < 96; j++) x[j] = (float)(j - 80) * 0.5f; /* amax 8: d = 8/127, x/d = ±127 at the ends */
    uint8_t *q = aligned_alloc(64, cb_cpu_q8_row_bytes(C));
    cb_cpu_q8_quantize(x, C, CB_CPU_Q8_B32, q);
    const int8_t *qs = (const int8_t *)q;
    const float *d = (const float *)(q + C), *ds = d + C / 32;
    const int16_t *bs = (const int16_t *)(ds + C / 32);
    for (int b = 0; b < C / 32; b++) {
        float amax = 0;
        int sum = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[32 * b + j]));
        CHECK(d[b] == amax / 127.0f);
        const float id = amax > 0 ? 1.0f / (amax / 127.0f) : 0.0f;
        for (int j = 0; j < 32; j++) { /* the exact rule, whichever kernel set quantized */
            const float v = nearbyintf(x[32 * b + j] * id);
            CHECK(qs[32 * b + j] == (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v));
        }
        for (int j = 0; j < 32; j++) {
            CHECK(qs[32 * b + j] >= -127 && qs[32 * b + j] <= 127);
            CHECK(fabsf(x[32 * b + j] - d[b] * qs[32 * b + j]) <= amax / 254.0f * 1.0001f + 1e-30f);
            sum += qs[32 * b + j];
        }
        CHECK(ds[b] == amax / 127.0f * (float)sum);
        CHECK(bs[b] == sum);
    }
    free(q);
}

/* The K format (one scale per 256, sums per 16 and 32), the row layout of cpu_quant.h, and a format
 * quantized alone leaving the other's bytes as they were. */
TEST(test_quantize_row_k) {
    enum { C = 2048 };
    float x[C];
    random_x(x, C);
    for (int j = 256; j < 512; j++) x[j] = 0.0f;                   /* a zero super-block: d = 0, q = 0 */
    for (int j = 512; j < 768; j++) x[j] = (float)(j - 640) * 0.25f; /* a ramp from -32 = -amax: q = -127 */
    const size_t rb = cb_cpu_q8_row_bytes(C), kofs = (C + 10 * (C / 32) + 63) / 64 * 64;
    CHECK(rb % 64 == 0 && rb >= kofs + C + 4 * (C / 256) + 2 * (C / 16) + 2 * (C / 32));
    uint8_t *q = aligned_alloc(64, rb), *q2 = aligned_alloc(64, rb);
    cb_cpu_q8_quantize(x, C, CB_CPU_Q8_B32 | CB_CPU_Q8_K, q);
    const int8_t *qs = (const int8_t *)(q + kofs);
    const float *d = (const float *)(q + kofs + C);
    const int16_t *bs = (const int16_t *)(d + C / 256), *bs32 = bs + C / 16;
    for (int i = 0; i < C / 256; i++) {
        float amax = 0;
        for (int j = 256 * i; j < 256 * i + 256; j++) amax = fmaxf(amax, fabsf(x[j]));
        CHECK(d[i] == amax / 127.0f);
        const float id = amax > 0 ? 1.0f / (amax / 127.0f) : 0.0f;
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int j = 256 * i + 16 * g; j < 256 * i + 16 * g + 16; j++) {
                const float v = nearbyintf(x[j] * id);
                CHECK(qs[j] == (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v));
                CHECK(fabsf(x[j] - d[i] * qs[j]) <= amax / 254.0f * 1.0001f + 1e-30f);
                sum += qs[j];
            }
            CHECK(bs[16 * i + g] == sum);
        }
        for (int k = 0; k < 8; k++) CHECK(bs32[8 * i + k] == bs[16 * i + 2 * k] + bs[16 * i + 2 * k + 1]);
    }
    /* each format alone: its bytes as above, the rest untouched */
    const unsigned fmts[2] = {CB_CPU_Q8_B32, CB_CPU_Q8_K};
    for (int f = 0; f < 2; f++) {
        memset(q2, 0xA5, rb);
        cb_cpu_q8_quantize(x, C, fmts[f], q2);
        const size_t a = f ? kofs : 0;
        const size_t used = f ? kofs + C + 4 * (C / 256) + 2 * (C / 16) + 2 * (C / 32) : (size_t)C + 10 * (C / 32);
        CHECK(memcmp(q2 + a, q + a, used - a) == 0);
        for (size_t k = 0; k < rb; k++)
            if (k < a || k >= used) CHECK(q2[k] == 0xA5);
    }
    /* cols without the K format: nothing written there */
    memset(q2, 0xA5, rb);
    cb_cpu_q8_quantize(x, 288, CB_CPU_Q8_K, q2);
    for (size_t k = 0; k < cb_cpu_q8_row_bytes(288); k++) CHECK(q2[k] == 0xA5);
    /* the row size never shrinks as cols grow (scratch sized for the widest call covers every call) */
    for (int c = 64; c <= 20480; c += 32) CHECK(cb_cpu_q8_row_bytes(c) >= cb_cpu_q8_row_bytes(c - 32));
    free(q);
    free(q2);
}

TEST(test_qdot_random) {
    const uint32_t types[] = {CB_TYPE_Q4_0, CB_TYPE_Q4_1, CB_TYPE_Q5_0, CB_TYPE_Q8_0, CB_TYPE_Q4_K, CB_TYPE_Q5_K, CB_TYPE_Q6_K};
    enum { R = 37, C = 768, N = 7 };
    float *x = malloc(sizeof(float) * N * C), *y = malloc(sizeof(float) * N * R), *ys = malloc(sizeof(float) * N * R);
    float *y1 = malloc(sizeof(float) * R);
    double *mag = malloc(sizeof(double) * N * R);
    uint8_t *xq = aligned_alloc(64, cb_cpu_q8_row_bytes(C) * N);
    random_x(x, N * C);
    for (int j = 256; j < 512; j++) x[2 * C + j] = 0.0f; /* a zero super-block (K scale 0) */
    int n_isa = 0;
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        uint8_t *buf;
        cb_weight_t w = random_weight(types[t], R, C, &buf);
        CHECK(cb_cpu_qdot_supported(&w));
        out_mags(&w, x, N, mag);
        for (size_t i = 0; i < N_ISAS; i++) {
            if (cb_cpu_qdot_use(ISAS[i]) != 0) continue; /* this CPU cannot run it */
            n_isa += t == 0;
            qmatvec(&w, x, N, y, xq);
            double worst = check_against_ref(&w, x, N, 0, R, y, R);
            fprintf(stderr, "  %-5s %-6s worst error / bound %.3f\n", cb_type_name(w.type), ISAS[i], worst);
            CHECK(worst <= 1.0);
            /* a row's result does not depend on the rows sharing the call */
            for (int r = 0; r < N; r++) {
                cb_cpu_qdot_rows(&w, 0, R, xq + (size_t)r * cb_cpu_q8_row_bytes(C), 1, y1, R);
                CHECK(memcmp(y1, y + (size_t)r * R, sizeof(float) * R) == 0);
            }
            /* a sub-range of weight rows writes those outputs only */
            float sub[N * R];
            for (int k = 0; k < N * R; k++) sub[k] = -7.0f;
            cb_cpu_qdot_rows(&w, 5, 9, xq, N, sub, R);
            for (int r = 0; r < N; r++)
                for (int o = 0; o < R; o++)
                    CHECK(sub[r * R + o] == (o >= 5 && o < 9 ? y[r * R + o] : -7.0f));
            if (i == 0) memcpy(ys, y, sizeof(float) * N * R);
            else /* the same integer sums, converted and accumulated in f32 in another order: a few roundings
                  * of terms up to sum |w x| (a K super-block's sum reaches 2^28, past f32's 24 bits) */
                for (int k = 0; k < N * R; k++) CHECK(fabs((double)y[k] - ys[k]) <= 1e-6 * mag[k] + 1e-6);
        }
        free(buf);
    }
    CHECK(n_isa >= 1);
    fprintf(stderr, "  kernel sets run: %d (default here: ", n_isa);
    cb_cpu_qdot_use(NULL);
    fprintf(stderr, "%s)\n", cb_cpu_qdot_isa());
    /* shapes without a kernel */
    cb_weight_t odd = {.type = CB_TYPE_Q4_K, .cols = 288, .rows = 1};
    CHECK(!cb_cpu_qdot_supported(&odd));
    odd.type = CB_TYPE_F16;
    odd.cols = 256;
    CHECK(!cb_cpu_qdot_supported(&odd));
    CHECK(cb_cpu_qdot_use("no-such-isa") == -1);
    free(x); free(y); free(ys); free(y1); free(xq); free(mag);
}

/* Q5_0 at the ends of its codes: all -16 (every fifth bit clear, nibbles 0), all 15 (every fifth bit set,
 * nibbles 15), alternating, and d < 0, against activations at +-127 (the largest integer block sums,
 * 32 * 16 * 127), in every kernel set: the same integer sums as the reference, so the results agree within
 * f32 rounding of sum |w x|; on the stored rows and on the x8 copy (its fifth bits regrouped). */
TEST(test_qdot_q5_0_extremes) {
    enum { R = 8, C = 128, N = 5 };
    uint8_t *buf = malloc((size_t)R * (C / 32) * 22);
    for (int o = 0; o < R; o++)
        for (int b = 0; b < C / 32; b++) {
            uint8_t *blk = buf + ((size_t)o * (C / 32) + b) * 22;
            put_f16(blk, o & 1 ? -0.03125f : 0.0625f);
            const int kind = (o / 2 + b) % 4; /* codes: 0 (-16), 31 (15), alternating 0 / 31, 16 / 15 */
            const uint8_t qh = kind == 1 ? 0xFF : kind == 2 ? 0xAA : kind == 3 ? 0x55 : 0x00;
            const uint8_t qs = kind == 1 ? 0xFF : kind == 2 ? 0xF0 : kind == 3 ? 0xF0 : 0x00;
            memset(blk + 2, qh, 4);
            memset(blk + 6, qs, 16);
        }
    cb_weight_t w = {.name = "q5", .type = CB_TYPE_Q5_0, .q = buf, .row_bytes = (size_t)(C / 32) * 22, .rows = R,
                     .cols = C};
    CHECK(cb_cpu_qdot_supported(&w) && cb_cpu_qdot_format(&w) == CB_CPU_Q8_B32);
    CHECK(cb_cpu_x8_bytes(&w) == (size_t)R * w.row_bytes);
    uint8_t *x8 = aligned_alloc(64, cb_cpu_x8_bytes(&w));
    CHECK(cb_cpu_x8_pack(&w, x8));
    float x[N * C], y[N * R];
    for (int r = 0; r < N; r++)
        for (int j = 0; j < C; j++) /* rows 0..2 +-1: every q is +-127, exactly x * 127 */
            x[r * C + j] = r == 0 ? 1.0f : r == 1 ? -1.0f : r == 2 ? (j & 1 ? 1.0f : -1.0f)
                         : r == 3 ? (j < 64 ? 2.0f : -3.0f) : (float)((j * 7) % 5) - 2.0f;
    uint8_t *xq = aligned_alloc(64, cb_cpu_q8_row_bytes(C) * N);
    for (size_t i = 0; i < 2 * N_ISAS; i++) {
        if (cb_cpu_qdot_use(ISAS[i % N_ISAS]) != 0) continue;
        w.x8 = i < N_ISAS ? NULL : x8;
        qmatvec(&w, x, N, y, xq);
        CHECK(check_against_ref(&w, x, N, 0, R, y, R) <= 1.0);
        float row[C];
        for (int o = 0; o < R; o++) { /* x = +-1 is quantized exactly: the result is the exact dot */
            CHECK(cb_dequant(CB_TYPE_Q5_0, buf + (size_t)o * w.row_bytes, row, C));
            for (int r = 0; r < 3; r++) {
                double ref = 0;
                for (int j = 0; j < C; j++) ref += (double)row[j] * x[r * C + j];
                CHECK_MSG(fabs(y[r * R + o] - ref) <= 1e-6 * fabs(ref) + 1e-6, "%s%s row %d x %d: %g vs %g",
                          ISAS[i % N_ISAS], w.x8 ? " x8" : "", o, r, (double)y[r * R + o], ref);
            }
        }
    }
    cb_cpu_qdot_use(NULL);
    free(xq);
    free(x8);
    free(buf);
}

/* The interleaved copies (x8) of the types with blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0, with Q8_0's -128):
 * the stored size; exact dequantization; the same bits in the scalar and AVX2 sets; within the bound of the
 * f32 reference and within f32 reordering of the stored rows' kernel; a row's bits not depending on the rows
 * beside it or on the call size; the aligned sub-ranges on the copy, the unaligned ones on the stored rows;
 * the shapes without a copy. */
TEST(test_qdot_x8) {
    const uint32_t types[] = {CB_TYPE_Q4_0, CB_TYPE_Q4_1, CB_TYPE_Q5_0, CB_TYPE_Q8_0};
    enum { R = 40, C = 512, N = 7 };
    float *x = malloc(sizeof(float) * N * C), *y = malloc(sizeof(float) * N * R), *ys = malloc(sizeof(float) * N * R);
    float *y0 = malloc(sizeof(float) * N * R), *y1 = malloc(sizeof(float) * R), *row = malloc(sizeof(float) * C);
    float *ref = malloc(sizeof(float) * C);
    double *mag = malloc(sizeof(double) * N * R);
    uint8_t *xq = aligned_alloc(64, cb_cpu_q8_row_bytes(C) * N);
    random_x(x, N * C);
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        uint8_t *buf;
        cb_weight_t w = random_weight(types[t], R, C, &buf);
        if (types[t] == CB_TYPE_Q8_0) buf[34 * 3 + 2 + 17] = 0x80; /* at least one -128 */
        const size_t nb = cb_cpu_x8_bytes(&w);
        CHECK(nb == (size_t)R * w.row_bytes);
        uint8_t *x8 = aligned_alloc(64, (nb + 63) / 64 * 64);
        CHECK(cb_cpu_x8_pack(&w, x8));
        out_mags(&w, x, N, mag);
        cb_weight_t wx = w;
        wx.x8 = x8;
        int n_run = 0;
        for (size_t i = 0; i < N_ISAS; i++) {
            if (cb_cpu_qdot_use(ISAS[i]) != 0) continue;
            n_run++;
            for (int o = 0; o < R; o++) { /* bit-identical dequantization */
                cb_cpu_x8_dequant_row(&wx, o, row);
                CHECK(cb_dequant(w.type, buf + (size_t)o * w.row_bytes, ref, C));
                CHECK(memcmp(row, ref, sizeof(float) * C) == 0);
            }
            qmatvec(&w, x, N, ys, xq);
            qmatvec(&wx, x, N, y, xq);
            double worst = check_against_ref(&wx, x, N, 0, R, y, R);
            fprintf(stderr, "  %-5s x8 %-6s worst error / bound %.3f\n", cb_type_name(w.type), ISAS[i], worst);
            CHECK(worst <= 1.0);
            for (int k = 0; k < N * R; k++) {
                CHECK(fabs((double)y[k] - ys[k]) <= 1e-6 * mag[k] + 1e-6); /* f32 reordering */
                if (i == 0) y0[k] = y[k];
                else CHECK(y[k] == y0[k]); /* every set: the scalar set's bits */
            }
            for (int r = 0; r < N; r++) { /* a row alone gets the bits it gets among others */
                cb_cpu_qdot_rows(&wx, 0, R, xq + (size_t)r * cb_cpu_q8_row_bytes(C), 1, y1, R);
                CHECK(memcmp(y1, y + (size_t)r * R, sizeof(float) * R) == 0);
            }
            float sub[N * R];
            const int ranges[2][2] = {{8, 24}, {5, 9}}; /* aligned: the copy; unaligned: the stored rows */
            for (int g = 0; g < 2; g++) {
                for (int k = 0; k < N * R; k++) sub[k] = -7.0f;
                const int a = ranges[g][0], e = ranges[g][1];
                cb_cpu_qdot_rows(&wx, a, e, xq, N, sub, R);
                for (int r = 0; r < N; r++)
                    for (int o = 0; o < R; o++)
                        CHECK(sub[r * R + o] == (o < a || o >= e ? -7.0f : g == 0 ? y[r * R + o] : ys[r * R + o]));
            }
        }
        fprintf(stderr, "  %-5s x8 kernel sets run: %d\n", cb_type_name(w.type), n_run);
        cb_weight_t odd = w;
        odd.rows = R - 3;
        CHECK(cb_cpu_x8_bytes(&odd) == 0 && !cb_cpu_x8_pack(&odd, x8));
        free(x8);
        free(buf);
    }
    uint8_t *buf;
    cb_weight_t f16 = random_weight(CB_TYPE_Q4_0, 8, 256, &buf);
    f16.type = CB_TYPE_F16;
    CHECK(cb_cpu_x8_bytes(&f16) == 0 && !cb_cpu_x8_pack(&f16, buf));
    free(buf);
    free(mag);
    cb_cpu_qdot_use(NULL);
    free(x); free(y); free(ys); free(y0); free(y1); free(row); free(ref); free(xq);
}

/* The K-quants' interleaved copies (x8 of Q4_K and Q6_K): exact dequantization; the same bits in the scalar
 * and AVX2 sets; within the bound of the f32 reference and within f32 reordering of the stored rows' kernel;
 * a row's bits not depending on the rows beside it or on the call size (decode = prefill); the aligned
 * sub-ranges on the copy, the unaligned ones on the stored rows; the shapes without a copy. */
TEST(test_qdot_k8) {
    const uint32_t types[] = {CB_TYPE_Q4_K, CB_TYPE_Q5_K, CB_TYPE_Q6_K};
    enum { R = 40, C = 768, N = 7 };
    float *x = malloc(sizeof(float) * N * C), *y = malloc(sizeof(float) * N * R), *ys = malloc(sizeof(float) * N * R);
    float *y0 = malloc(sizeof(float) * N * R), *y1 = malloc(sizeof(float) * R), *row = malloc(sizeof(float) * C);
    float *ref = malloc(sizeof(float) * C);
    double *mag = malloc(sizeof(double) * N * R);
    uint8_t *xq = aligned_alloc(64, cb_cpu_q8_row_bytes(C) * N);
    random_x(x, N * C);
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        uint8_t *buf;
        cb_weight_t w = random_weight(types[t], R, C, &buf);
        const size_t nb = cb_cpu_x8_bytes(&w);
        /* Q4_K, Q5_K: 32 bytes more per 8 rows and super-block (scales and mins unpacked); Q6_K: the stored size */
        CHECK(nb == (size_t)R * w.row_bytes + (types[t] != CB_TYPE_Q6_K ? 32 * (size_t)(R / 8) * (C / 256) : 0));
        uint8_t *x8 = aligned_alloc(64, (nb + 63) / 64 * 64);
        CHECK(cb_cpu_x8_pack(&w, x8));
        out_mags(&w, x, N, mag);
        cb_weight_t wx = w;
        wx.x8 = x8;
        int n_run = 0;
        for (size_t i = 0; i < N_ISAS; i++) {
            if (cb_cpu_qdot_use(ISAS[i]) != 0) continue;
            n_run++;
            for (int o = 0; o < R; o++) { /* bit-identical dequantization */
                cb_cpu_x8_dequant_row(&wx, o, row);
                CHECK(cb_dequant(w.type, buf + (size_t)o * w.row_bytes, ref, C));
                CHECK(memcmp(row, ref, sizeof(float) * C) == 0);
            }
            qmatvec(&w, x, N, ys, xq);
            qmatvec(&wx, x, N, y, xq);
            double worst = check_against_ref(&wx, x, N, 0, R, y, R);
            fprintf(stderr, "  %-5s k8 %-6s worst error / bound %.3f\n", cb_type_name(w.type), ISAS[i], worst);
            CHECK(worst <= 1.0);
            for (int k = 0; k < N * R; k++) {
                CHECK(fabs((double)y[k] - ys[k]) <= 1e-6 * mag[k] + 1e-6); /* f32 reordering */
                if (i == 0) y0[k] = y[k];
                else CHECK(y[k] == y0[k]); /* every set: the scalar set's bits */
            }
            for (int r = 0; r < N; r++) { /* a row alone gets the bits it gets among others */
                cb_cpu_qdot_rows(&wx, 0, R, xq + (size_t)r * cb_cpu_q8_row_bytes(C), 1, y1, R);
                CHECK(memcmp(y1, y + (size_t)r * R, sizeof(float) * R) == 0);
            }
            float sub[N * R];
            const int ranges[2][2] = {{8, 24}, {5, 9}}; /* aligned: the copy; unaligned: the stored rows */
            for (int g = 0; g < 2; g++) {
                for (int k = 0; k < N * R; k++) sub[k] = -7.0f;
                const int a = ranges[g][0], e = ranges[g][1];
                cb_cpu_qdot_rows(&wx, a, e, xq, N, sub, R);
                for (int r = 0; r < N; r++)
                    for (int o = 0; o < R; o++)
                        CHECK(sub[r * R + o] == (o < a || o >= e ? -7.0f : g == 0 ? y[r * R + o] : ys[r * R + o]));
            }
        }
        fprintf(stderr, "  %-5s k8 kernel sets run: %d\n", cb_type_name(w.type), n_run);
        cb_weight_t odd = w;
        odd.rows = R - 3;
        CHECK(cb_cpu_x8_bytes(&odd) == 0 && !cb_cpu_x8_pack(&odd, x8));
        odd = w;
        odd.cols = C - 32;
        CHECK(cb_cpu_x8_bytes(&odd) == 0);
        free(x8);
        free(buf);
    }
    free(mag);
    cb_cpu_qdot_use(NULL);
    free(x); free(y); free(ys); free(y0); free(y1); free(row); free(ref); free(xq);
}

/* The 16-row VNNI layout (v16, Q4_1): the stored rows' results (bit for bit in the scalar set, within f32
 * reordering in the VNNI kernel), every call size giving a row the same bits (decode = prefill), aligned
 * and unaligned sub-ranges, the exact dequantization, shapes without the form. */
TEST(test_qdot_v16) {
    enum { R = 48, C = 576, N = 11 };
    float *x = malloc(sizeof(float) * N * C), *y = malloc(sizeof(float) * N * R), *ys = malloc(sizeof(float) * N * R);
    float *y1 = malloc(sizeof(float) * R), *row = malloc(sizeof(float) * C), *ref = malloc(sizeof(float) * C);
    uint8_t *xq = aligned_alloc(64, cb_cpu_q8_row_bytes(C) * N);
    random_x(x, N * C);
    uint8_t *buf;
    cb_weight_t w = random_weight(CB_TYPE_Q4_1, R, C, &buf);
    const size_t nb = cb_cpu_v16_bytes(&w);
    CHECK(nb == (size_t)R * w.row_bytes);
    uint8_t *v16 = aligned_alloc(64, (nb + 63) / 64 * 64);
    CHECK(cb_cpu_v16_pack(&w, v16));
    cb_weight_t wv = w;
    wv.v16 = v16;
    for (int o = 0; o < R; o++) {
        cb_cpu_v16_dequant_row(&wv, o, row);
        CHECK(cb_dequant(w.type, buf + (size_t)o * w.row_bytes, ref, C));
        CHECK(memcmp(row, ref, sizeof(float) * C) == 0);
    }
    int n_run = 0;
    for (size_t i = 0; i < N_ISAS; i++) {
        if (cb_cpu_qdot_use(ISAS[i]) != 0) continue;
        n_run++;
        qmatvec(&w, x, N, ys, xq);
        qmatvec(&wv, x, N, y, xq);
        double worst = check_against_ref(&wv, x, N, 0, R, y, R);
        fprintf(stderr, "  Q4_1  v16 %-10s worst error / bound %.3f\n", ISAS[i], worst);
        CHECK(worst <= 1.0);
        for (int k = 0; k < N * R; k++)
            CHECK(i == 0 ? y[k] == ys[k] : fabsf(y[k] - ys[k]) <= 1e-5f * (1.0f + fabsf(ys[k])));
        for (int r = 0; r < N; r++) {
            cb_cpu_qdot_rows(&wv, 0, R, xq + (size_t)r * cb_cpu_q8_row_bytes(C), 1, y1, R);
            CHECK(memcmp(y1, y + (size_t)r * R, sizeof(float) * R) == 0);
        }
        float sub[N * R];
        const int ranges[2][2] = {{16, 32}, {8, 24}}; /* aligned: v16 kernel; unaligned: the stored rows */
        for (int g = 0; g < 2; g++) {
            for (int k = 0; k < N * R; k++) sub[k] = -7.0f;
            const int a = ranges[g][0], e = ranges[g][1];
            cb_cpu_qdot_rows(&wv, a, e, xq, N, sub, R);
            for (int r = 0; r < N; r++)
                for (int o = 0; o < R; o++)
                    CHECK(sub[r * R + o] == (o < a || o >= e ? -7.0f : g == 0 ? y[r * R + o] : ys[r * R + o]));
        }
    }
    fprintf(stderr, "  v16 kernel sets run: %d\n", n_run);
    cb_cpu_qdot_use(NULL);
    cb_weight_t odd = w;
    odd.rows = 40;
    CHECK(cb_cpu_v16_bytes(&odd) == 0 && !cb_cpu_v16_pack(&odd, v16));
    odd = w;
    odd.type = CB_TYPE_Q8_0;
    CHECK(cb_cpu_v16_bytes(&odd) == 0);
    free(v16);
    free(buf);
    free(x); free(y); free(ys); free(y1); free(row); free(ref); free(xq);
}

/* cb_cpu_matmul_multi over parts that read different activation formats (Q4_K, Q6_K: K; Q8_0, Q4_1, Q5_0: B32)
 * in one call, in either order: each part gets the bits cb_cpu_matvec gives it alone (each format
 * quantized once per call into the shared scratch), for n = 1 (decode) and n = 6 (row groups of 4 and 2:
 * with test_qdot_random's 4 and 3 every kernel width runs), on 1 and 2 threads. */
TEST(test_qdot_multi_formats) {
    enum { C = 512, N = 6, P = 5 };
    const uint32_t types[P] = {CB_TYPE_Q4_K, CB_TYPE_Q8_0, CB_TYPE_Q6_K, CB_TYPE_Q4_1, CB_TYPE_Q5_0};
    const int rows[P] = {48, 32, 40, 64, 24};
    uint8_t *buf[P];
    cb_weight_t w[P];
    float *x = malloc(sizeof(float) * N * C), *y[P], *ref[P];
    random_x(x, N * C);
    for (int p = 0; p < P; p++) {
        w[p] = random_weight(types[p], rows[p], C, &buf[p]);
        y[p] = malloc(sizeof(float) * N * rows[p]);
        ref[p] = malloc(sizeof(float) * N * rows[p]);
    }
    cb_cpu_mm_scratch_t s = {.max_rows = N, .max_cols = C, .tile_floats = C};
    s.rows = malloc(sizeof(float) * 2 * C);
    s.xq = malloc(cb_cpu_q8_row_bytes(C) * N);
    s.tiles = malloc(sizeof(float) * 2 * C);
    for (int nt = 1; nt <= 2; nt++) {
        cb_pool_t *pool = cb_pool_new(nt);
        CHECK(pool);
        for (int n = 1; n <= N; n += N - 1)
            for (int order = 0; order < 2; order++) {
                cb_matmul_part_t parts[P];
                for (int k = 0; k < P; k++) {
                    const int p = order ? P - 1 - k : k;
                    parts[k] = (cb_matmul_part_t){&w[p], y[p], rows[p]};
                    cb_cpu_matvec(&w[p], x, n, ref[p], rows[p], &s, pool);
                }
                cb_cpu_matmul_multi(parts, P, x, n, false, &s, pool);
                for (int p = 0; p < P; p++) CHECK(memcmp(y[p], ref[p], sizeof(float) * (size_t)n * rows[p]) == 0);
                for (int p = 0; p < P; p++) CHECK(check_against_ref(&w[p], x, n, 0, rows[p], y[p], rows[p]) <= 1.0);
            }
        cb_pool_destroy(&pool);
    }
    for (int p = 0; p < P; p++) {
        free(buf[p]);
        free(y[p]);
        free(ref[p]);
    }
    free(s.rows); free(s.xq); free(s.tiles); free(x);
}

/* Checks weights of a real model against the reference with random activations of the real scale
 * (rms-normalised: |x| ~ 1, outliers included), on at most max_rows rows of each, in each form the CPU
 * backend gave it (x8 / v16, then the stored rows) and every kernel set. */
static void check_real_weights(const cb_weight_t *const *ws, int n_ws, int max_rows) {
    for (int k = 0; k < n_ws; k++) {
        cb_weight_t w = *ws[k];
        CHECK(cb_cpu_qdot_supported(&w));
        if (w.rows > max_rows) w.rows = max_rows; /* a slice of a large output matrix */
        enum { N = 3 };
        float *x = malloc(sizeof(float) * N * w.cols), *y = malloc(sizeof(float) * N * w.rows);
        uint8_t *xq = aligned_alloc(64, cb_cpu_q8_row_bytes(w.cols) * N);
        random_x(x, N * w.cols);
        double worst_all = 0;
        for (int form = w.x8 || w.v16 ? 0 : 1; form < 2; form++) { /* interleaved, then the stored rows */
            if (form == 1) w.x8 = w.v16 = NULL;
            for (size_t i = 0; i < N_ISAS; i++) {
                if (cb_cpu_qdot_use(ISAS[i]) != 0) continue;
                qmatvec(&w, x, N, y, xq);
                double worst = check_against_ref(&w, x, N, 0, w.rows, y, w.rows);
                fprintf(stderr, "  %-24s %-5s %-6s %-6s worst error / bound %.3f\n", w.name, cb_type_name(w.type),
                        form ? "stored" : ws[k]->v16 ? "v16" : "x8", ISAS[i], worst);
                worst_all = fmax(worst_all, worst);
            }
        }
        free(x); free(y); free(xq);
        CHECK(worst_all <= 1.0);
    }
    cb_cpu_qdot_use(NULL);
}

/* A CPU backend that has prepared m's weights (the interleaved copies the kernels read), or NULL. */
static cb_backend_t *prepared_backend(const cb_model_t *m) {
    char err[256];
    cb_backend_t *be = cb_backend_cpu_new(cb_model_hparams(m), 4, 16, 1, err, sizeof err);
    if (be && be->ops->prepare_weights(be->ctx, cb_model_weights(m), err, sizeof err) != 0) cb_backend_destroy(&be);
    if (!be) fprintf(stderr, "  cpu backend: %s\n", err);
    return be;
}

/* The default model's matrices (SmolLM2 Q4_1: a Q4_1 FFN matrix, the Q4_1 attention output and the Q8_0
 * embedding = tied output rows), as loaded (interleaved) and stored. */
TEST(test_qdot_real_model) {
    const char *p = test_model_path();
    if (!p) SKIP("model not present");
    char err[256];
    cb_model_t *m = cb_model_load(p, err, sizeof err);
    CHECK_MSG(m, "%s", err);
    const int nl = cb_model_hparams(m)->n_layer;
    const cb_layer_weights_t *L0 = cb_model_layer(m, 0), *Lm = cb_model_layer(m, nl / 3);
    const cb_weight_t *ws[] = {&L0->w_gate, &Lm->w_down, &Lm->wo, cb_model_output(m)};
    CHECK(!L0->w_gate.x8 && !L0->w_gate.v16); /* the model prepares nothing; the CPU backend does */
    cb_backend_t *be = prepared_backend(m);
    for (size_t k = 0; k < sizeof ws / sizeof ws[0]; k++) /* the default preparation interleaves Q4_1 and Q8_0 */
        if (ws[k]->type == CB_TYPE_Q4_1 || ws[k]->type == CB_TYPE_Q8_0)
            CHECK(ws[k]->type == CB_TYPE_Q4_1 && cb_cpu_v16_preferred() ? ws[k]->v16 && !ws[k]->x8
                                                                         : ws[k]->x8 && !ws[k]->v16);
    check_real_weights(ws, (int)(sizeof ws / sizeof ws[0]), 2048);
    cb_backend_destroy(&be);
    cb_model_destroy(&m);
}

/* Qwen2.5-Coder-1.5B-Instruct Q4_K_M (models/, when fetched; CB_QWEN_MODEL overrides): its Q4_K (gate, up,
 * q, k, o) and Q6_K (down, v, output) matrices, the K-format kernels against the reference. */
TEST(test_qdot_real_kquant) {
    const char *p = getenv("CB_QWEN_MODEL");
    if (!p || !*p) p = "models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf";
    FILE *f = fopen(p, "rb");
    if (!f) SKIP("Qwen2.5-Coder Q4_K_M not present");
    fclose(f);
    char err[256];
    cb_model_t *m = cb_model_load(p, err, sizeof err);
    CHECK_MSG(m, "%s", err);
    const int nl = cb_model_hparams(m)->n_layer;
    const cb_layer_weights_t *L0 = cb_model_layer(m, 0), *Lm = cb_model_layer(m, nl / 2);
    const cb_weight_t *ws[] = {&L0->w_gate, &L0->w_down, &L0->wv, &Lm->w_up, &Lm->wq, &Lm->wk,
                               &Lm->wo, &Lm->w_down, cb_model_output(m)};
    int n_k = 0;
    for (size_t k = 0; k < sizeof ws / sizeof ws[0]; k++)
        n_k += ws[k]->type == CB_TYPE_Q4_K || ws[k]->type == CB_TYPE_Q6_K;
    CHECK(n_k >= 6);
    cb_backend_t *be = prepared_backend(m);
    check_real_weights(ws, (int)(sizeof ws / sizeof ws[0]), TEST_SANITIZED ? 256 : 2048);
    cb_backend_destroy(&be);
    cb_model_destroy(&m);
}

/* The AMX kernel (cb_cpu_x8_amx; on this CPU, or its emulation) on the x8 copies of all seven types: calls of
 * 83 activation rows (tiles of 64 and 16, 3 rows left to the x8 kernel) over 40 weight rows (two 16-row tiles,
 * one group left): every set's bits are the scalar set's, within the f32 reference's bound; sub-ranges (two
 * tiles; one tile and a group; one group alone) give the same bits as the whole. */
TEST(test_qdot_amx) {
    const uint32_t types[] = {CB_TYPE_Q4_0, CB_TYPE_Q4_1, CB_TYPE_Q5_0, CB_TYPE_Q8_0, CB_TYPE_Q4_K, CB_TYPE_Q5_K, CB_TYPE_Q6_K};
    enum { R = 40, C = 768, N = 83 };
    float *x = malloc(sizeof(float) * N * C), *y = malloc(sizeof(float) * N * R), *y0 = malloc(sizeof(float) * N * R);
    float *sub = malloc(sizeof(float) * N * R);
    uint8_t *xq = aligned_alloc(64, cb_cpu_q8_row_bytes(C) * N);
    random_x(x, N * C);
    int n_amx = 0;
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        uint8_t *buf;
        cb_weight_t w = random_weight(types[t], R, C, &buf);
        uint8_t *x8 = aligned_alloc(64, (cb_cpu_x8_bytes(&w) + 63) / 64 * 64);
        CHECK(cb_cpu_x8_pack(&w, x8));
        w.x8 = x8;
        for (size_t i = 0; i < N_ISAS; i++) {
            if (cb_cpu_qdot_use(ISAS[i]) != 0) continue;
            qmatvec(&w, x, N, y, xq);
            if (i == 0) {
                memcpy(y0, y, sizeof(float) * N * R);
                CHECK(check_against_ref(&w, x, N, 0, R, y, R) <= 1.0);
                continue;
            }
            CHECK_MSG(memcmp(y, y0, sizeof(float) * N * R) == 0, "%s %s: not the scalar bits", cb_type_name(w.type), ISAS[i]);
            if (strncmp(ISAS[i], "amx", 3)) continue;
            n_amx++;
            const int ranges[3][2] = {{8, 40}, {0, 24}, {16, 24}};
            for (int g = 0; g < 3; g++) {
                for (int k = 0; k < N * R; k++) sub[k] = -7.0f;
                const int a = ranges[g][0], e = ranges[g][1];
                cb_cpu_qdot_rows(&w, a, e, xq, N, sub, R);
                for (int r = 0; r < N; r++)
                    for (int o = 0; o < R; o++) CHECK(sub[r * R + o] == (o < a || o >= e ? -7.0f : y0[r * R + o]));
            }
        }
        free(x8);
        free(buf);
    }
    fprintf(stderr, "  AMX kernel sets run: %d of 2 (amx needs AMX-INT8)\n", n_amx / 7);
    CHECK(n_amx >= 7); /* the emulated set runs on every AVX2 CPU */
    cb_cpu_qdot_use(NULL);
    free(x); free(y); free(y0); free(sub); free(xq);
}

int main(void) {
    RUN(test_quantize_row);
    RUN(test_quantize_row_k);
    RUN(test_qdot_random);
    RUN(test_qdot_q5_0_extremes);
    RUN(test_qdot_x8);
    RUN(test_qdot_k8);
    RUN(test_qdot_v16);
    RUN(test_qdot_amx);
    RUN(test_qdot_multi_formats);
    RUN(test_qdot_real_model);
    RUN(test_qdot_real_kquant);
    return test_summary();
}
