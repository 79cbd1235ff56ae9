/* test_gpu: every cb_cuda kernel against a straightforward CPU reference on random inputs, plus the blend
 * kernels' semantics (exact causal limit, sliding windows, deterministic top-k and attention mass),
 * out-of-memory handling, the chunk KV pool, copy stream events, graph capture; the backend table op by op,
 * CUDA against the CPU reference backend (dense operations, GeGLU and scale, Q5_0 weights in matmul and embed,
 * RoPE with NORM and NEOX pairing, linear scaling and frequency factors, projection biases; the device KV pool
 * through shuffled and consecutive block tables: writes, layer loads in f32/f16/bf16 under two rotations,
 * reads, block copies, attention, attention_rows and attention mass with and without a sliding window; and the
 * host-side deviation, top-k and compaction); whole forwards of a synthetic SmolLM2-shaped model (the
 * device-resident cb_cuda_llama) against the CPU engine; and the cross-backend test: the one
 * CacheBlend (libshared/blend) in every mode on a CPU engine and a CUDA engine, for every synthetic
 * architecture (gemma3's windowed layers included), comparing selected rows, logits and greedy tokens
 * (test_blend_backends states its rules). Built by tests/run-gpu.sh (mk/cuda.mk); exits 0 with a "skip"
 * line when there is no GPU.
 *
 * Tolerances (bf16 keeps 8 significant bits: rounding to bf16 has a relative error <= 2^-9 ~ 2e-3;
 * every accumulation is f32, whose error is negligible next to that):
 *   - dequantization: the same f32 arithmetic as the CPU, so f32 outputs agree to f32 rounding
 *     (1e-6 relative) and bf16 outputs to one bf16 rounding (2^-8 relative, one unit in the last place);
 *   - GEMM: inputs are exactly bf16 on both sides; f32 output <= 1e-4 * sum|x w| (f32 accumulation of k
 *     terms, any order); bf16 output adds one rounding (4e-3 * |ref|);
 *   - norm, RoPE, SwiGLU: one bf16 rounding of the output (4e-3 relative, 2 ulps) plus f32 noise; GeGLU the
 *     same plus f32 tanh's error where 1 + tanh cancels (a few f32 ulps of 1 times |g u|: 1e-6 * (1 + |g u|));
 *   - scale: f32 on both sides, one rounding of each product: bit-identical;
 *   - attention: P is rounded to bf16 before P.V (each weight 2^-9 relative), so |error| <= 2^-9 * max|v|
 *     over the keys the row sees, plus the output rounding: tolerance 8e-3 * max|v| + 4e-3 * |ref|. With a
 *     sliding window the same, over the row's keys [lim - window, lim); keys outside every row's range are
 *     NaN (any read of them would poison an output), and a row's output must not change by one bit when the
 *     keys outside its own range change;
 *   - top-k and argmax: exact (integer keys, fixed tie rule);
 *   - whole forward (30 layers, bf16 activations vs the f32 CPU engine): the hidden state picks up ~2^-9
 *     relative error at each of ~7 roundings per layer, a random walk of ~sqrt(210) * 2e-3 ~ 3%, so the
 *     logits' RMS difference must stay under 6% of their standard deviation; greedy tokens must agree
 *     unless the CPU's top two logits are closer than the observed difference (a tie, reported).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if !CB_HAVE_CUDA
int main(void) {
    printf("skip tests/gpu/test_gpu.c:all (built without CUDA: CB_HAVE_CUDA is not set)\n");
    return 0;
}
#else

#include "blend/blend.h"
#include "cpu/cpu_backend.h"
#include "cuda/cb_cuda.h"
#include "cuda/cb_cuda_backend.h"
#include "cuda/cb_cuda_llama.h"
#include "engine/backend.h"
#include "engine/backend_select.h"
#include "engine/engine.h"
#include "format/quant.h"
#include "kv/kvmem.h"
#include "kv/kvstore.h"
#include "model/model.h"
#include "model/synth.h"
#include "test.h"

static cb_cuda_t *cu;
static uint64_t rs = 0x9E3779B97F4A7C15ull;

static double urand(void) {   /* xorshift64*, [0, 1) */
    rs ^= rs >> 12;
    rs ^= rs << 25;
    rs ^= rs >> 27;
    return (double)((rs * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}
static float frand(float a) { return (float)((urand() * 2.0 - 1.0) * a); }
static uint16_t bf(float x) { return cb_f32_to_bf16(x); }
static float fb(uint16_t b) { return cb_bf16_to_f32(b); }
static void fill_bf(uint16_t *x, size_t n, float a) { for (size_t i = 0; i < n; i++) x[i] = bf(frand(a)); }

static void *dev_dup(const void *h, size_t bytes) {
    void *d = cb_cuda_malloc(cu, bytes);
    if (d && cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, d, h, bytes) != 0) {
        cb_cuda_free(cu, d);
        return NULL;
    }
    return d;
}
static int get(void *h, const void *d, size_t bytes) { return cb_cuda_d2h(cu, h, d, bytes); }

/* Q5_0 rows for the backend tests, blocks of 32 {f16 d; u8 qh[4]; u8 qs[16]}: element j is
 * d * ((nibble | (bit j of qh) << 4) - 16), low nibbles of qs for j < 16, high ones for j + 16, qh a little-endian
 * u32. ggml's rounding: d = the block's value of largest magnitude / -16, q = round(x / d) + 16 clamped to 31.
 * n a multiple of 32. */
static void q5_0_quantize(const float *x, size_t n, uint8_t *dst) {
    for (size_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f, vmax = 0.0f;
        for (int j = 0; j < 32; j++)
            if (fabsf(xb[j]) > amax) amax = fabsf(xb[j]), vmax = xb[j];
        const float d = vmax / -16.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        uint8_t *p = dst + b * 22;
        const uint16_t h = cb_f32_to_f16(d);
        memcpy(p, &h, 2);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            int x0 = (int)(xb[j] * id + 16.5f), x1 = (int)(xb[j + 16] * id + 16.5f);
            x0 = x0 < 0 ? 0 : x0 > 31 ? 31 : x0;
            x1 = x1 < 0 ? 0 : x1 > 31 ? 31 : x1;
            p[6 + j] = (uint8_t)((x0 & 0xF) | (x1 & 0xF) << 4);
            qh |= (uint32_t)(x0 >> 4) << j | (uint32_t)(x1 >> 4) << (j + 16);
        }
        for (int i = 0; i < 4; i++) p[2 + i] = (uint8_t)(qh >> (8 * i));
    }
}

/* ---------------------------------------------------------------- dequantization */

static size_t raw_bytes(uint32_t t, size_t n) {
    switch (t) {
    case CB_TYPE_F32: return n * 4;
    case CB_TYPE_F16: case CB_TYPE_BF16: return n * 2;
    case CB_TYPE_Q4_0: return n / 32 * 18;
    case CB_TYPE_Q4_1: return n / 32 * 20;
    case CB_TYPE_Q5_0: return n / 32 * 22;
    case CB_TYPE_Q8_0: return n / 32 * 34;
    case CB_TYPE_Q4_K: return n / 256 * 144;
    default: return n / 256 * 210;   /* Q6_K */
    }
}

/* Random raw data of a type whose f16 scales are finite. */
static void raw_fill(uint32_t t, uint8_t *p, size_t n) {
    size_t bytes = raw_bytes(t, n);
    for (size_t i = 0; i < bytes; i++) p[i] = (uint8_t)(urand() * 256);
    uint16_t h;
    switch (t) {
    case CB_TYPE_F32:
        for (size_t i = 0; i < n; i++) { float f = frand(3.0f); memcpy(p + 4 * i, &f, 4); }
        break;
    case CB_TYPE_F16:
        for (size_t i = 0; i < n; i++) { h = cb_f32_to_f16(frand(3.0f)); memcpy(p + 2 * i, &h, 2); }
        break;
    case CB_TYPE_BF16:
        for (size_t i = 0; i < n; i++) { h = bf(frand(3.0f)); memcpy(p + 2 * i, &h, 2); }
        break;
    case CB_TYPE_Q4_0: case CB_TYPE_Q5_0: case CB_TYPE_Q8_0:
        for (size_t b = 0; b < n / 32; b++) { h = cb_f32_to_f16(frand(0.1f)); memcpy(p + b * raw_bytes(t, 32), &h, 2); }
        break;
    case CB_TYPE_Q4_1:
        for (size_t b = 0; b < n / 32; b++) {
            h = cb_f32_to_f16(frand(0.1f)); memcpy(p + b * 20, &h, 2);
            h = cb_f32_to_f16(frand(1.0f)); memcpy(p + b * 20 + 2, &h, 2);
        }
        break;
    case CB_TYPE_Q4_K:
        for (size_t b = 0; b < n / 256; b++) {
            h = cb_f32_to_f16(frand(0.01f)); memcpy(p + b * 144, &h, 2);
            h = cb_f32_to_f16(frand(0.01f)); memcpy(p + b * 144 + 2, &h, 2);
        }
        break;
    default:
        for (size_t b = 0; b < n / 256; b++) { h = cb_f32_to_f16(frand(0.01f)); memcpy(p + b * 210 + 208, &h, 2); }
        break;
    }
}

TEST(test_dequant) {
    const uint32_t types[] = {CB_TYPE_F32, CB_TYPE_F16, CB_TYPE_BF16, CB_TYPE_Q4_0, CB_TYPE_Q4_1, CB_TYPE_Q5_0,
                              CB_TYPE_Q8_0, CB_TYPE_Q4_K, CB_TYPE_Q6_K};
    enum { N = 256 * 40 };
    uint8_t *raw = malloc(N * 4);
    float *ref = malloc(N * 4), *g32 = malloc(N * 4);
    uint16_t *g16 = malloc(N * 2);
    float *d32 = cb_cuda_malloc(cu, N * 4);
    uint16_t *d16 = cb_cuda_malloc(cu, N * 2);
    CHECK(raw && ref && g32 && g16 && d32 && d16);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        uint32_t t = types[ti];
        raw_fill(t, raw, N);
        CHECK(cb_dequant(t, raw, ref, N));
        CHECK_MSG(cb_cuda_upload_weights(cu, t, raw, N, d32, CB_CUDA_F32) == 0, "%s", cb_cuda_error(cu));
        CHECK_MSG(cb_cuda_upload_weights(cu, t, raw, N, d16, CB_CUDA_BF16) == 0, "%s", cb_cuda_error(cu));
        CHECK(get(g32, d32, N * 4) == 0 && get(g16, d16, N * 2) == 0);
        double amax = 0;
        for (int i = 0; i < N; i++) amax = fmax(amax, fabs(ref[i]));
        for (int i = 0; i < N; i++) {
            CHECK_MSG(fabs(g32[i] - ref[i]) <= 1e-6 * amax, "%s f32 [%d]: %g vs %g", cb_type_name(t), i, g32[i], ref[i]);
            CHECK_MSG(fabs(fb(g16[i]) - ref[i]) <= fabs(ref[i]) / 128 + 1e-6 * amax, "%s bf16 [%d]: %g vs %g",
                      cb_type_name(t), i, fb(g16[i]), ref[i]);
        }
    }
    CHECK(cb_cuda_upload_weights(cu, 99, raw, 32, d32, CB_CUDA_F32) == CB_CUDA_EINVAL);
    CHECK(cb_cuda_upload_weights(cu, CB_TYPE_Q4_1, raw, 33, d32, CB_CUDA_F32) == CB_CUDA_EINVAL);
    CHECK(cb_cuda_upload_weights(cu, CB_TYPE_Q5_0, raw, 48, d32, CB_CUDA_F32) == CB_CUDA_EINVAL);
    cb_cuda_free(cu, d32);
    cb_cuda_free(cu, d16);
    free(raw), free(ref), free(g32), free(g16);
}

/* ---------------------------------------------------------------- GEMM */

static int gemm_case(int n, int m, int k, int ldx, int ldw, int ldy, cb_cuda_dtype_t yt, float beta) {
    uint16_t *x = malloc((size_t)n * ldx * 2), *w = malloc((size_t)m * ldw * 2);
    float *y0 = malloc((size_t)n * ldy * 4), *gy = malloc((size_t)n * ldy * 4);
    uint16_t *gy16 = malloc((size_t)n * ldy * 2);
    fill_bf(x, (size_t)n * ldx, 1.0f);
    fill_bf(w, (size_t)m * ldw, 0.1f);
    for (size_t i = 0; i < (size_t)n * ldy; i++) y0[i] = frand(1.0f);
    void *dx = dev_dup(x, (size_t)n * ldx * 2), *dw = dev_dup(w, (size_t)m * ldw * 2);
    void *dy = yt == CB_CUDA_F32 ? dev_dup(y0, (size_t)n * ldy * 4) : cb_cuda_malloc(cu, (size_t)n * ldy * 2);
    int bad = !dx || !dw || !dy;
    if (!bad) bad = cb_cuda_gemm(cu, n, m, k, dx, ldx, dw, ldw, dy, yt, ldy, beta) != 0;
    if (!bad) bad = yt == CB_CUDA_F32 ? get(gy, dy, (size_t)n * ldy * 4) : get(gy16, dy, (size_t)n * ldy * 2);
    for (int i = 0; i < n && !bad; i++)
        for (int o = 0; o < m && !bad; o++) {
            double acc = 0, mag = 0;
            for (int j = 0; j < k; j++) {
                double t = (double)fb(x[(size_t)i * ldx + j]) * fb(w[(size_t)o * ldw + j]);
                acc += t, mag += fabs(t);
            }
            if (yt == CB_CUDA_F32) {
                acc += beta * y0[(size_t)i * ldy + o];
                double g = gy[(size_t)i * ldy + o];
                if (fabs(g - acc) > 1e-4 * mag + 1e-6) {
                    fprintf(stderr, "  gemm n=%d m=%d k=%d f32 [%d][%d]: %g vs %g\n", n, m, k, i, o, g, acc);
                    bad = 1;
                }
            } else {
                double g = fb(gy16[(size_t)i * ldy + o]);
                if (fabs(g - acc) > 4e-3 * fabs(acc) + 1e-4 * mag + 1e-6) {
                    fprintf(stderr, "  gemm n=%d m=%d k=%d bf16 [%d][%d]: %g vs %g\n", n, m, k, i, o, g, acc);
                    bad = 1;
                }
            }
        }
    if (bad && cb_cuda_error(cu)[0]) fprintf(stderr, "  %s\n", cb_cuda_error(cu));
    cb_cuda_free(cu, dx), cb_cuda_free(cu, dw), cb_cuda_free(cu, dy);
    free(x), free(w), free(y0), free(gy), free(gy16);
    return bad;
}

TEST(test_gemm) {
    CHECK(!gemm_case(1, 96, 256, 256, 256, 96, CB_CUDA_F32, 0.0f));      /* GEMV, vector path */
    CHECK(!gemm_case(1, 130, 264, 264, 264, 130, CB_CUDA_F32, 1.0f));    /* GEMV, accumulate */
    CHECK(!gemm_case(1, 77, 100, 100, 100, 77, CB_CUDA_BF16, 0.0f));     /* GEMV, scalar path */
    CHECK(!gemm_case(7, 96, 256, 256, 256, 96, CB_CUDA_F32, 0.0f));
    CHECK(!gemm_case(64, 192, 576, 600, 576, 200, CB_CUDA_BF16, 0.0f));  /* strided x and y */
    CHECK(!gemm_case(300, 128, 1536, 1536, 1536, 128, CB_CUDA_F32, 1.0f)); /* residual accumulate */
    CHECK(cb_cuda_gemm(cu, 4, 8, 16, NULL, 8, NULL, 16, NULL, CB_CUDA_F32, 8, 0.0f) == CB_CUDA_EINVAL);
    CHECK(cb_cuda_gemm(cu, 4, 8, 16, NULL, 16, NULL, 16, NULL, CB_CUDA_BF16, 8, 1.0f) == CB_CUDA_EINVAL);
}

/* ---------------------------------------------------------------- element-wise kernels */

TEST(test_embed_norm_swiglu_add) {
    enum { V = 50, E = 200, N = 9, F = 333 };
    uint16_t table[V * E];
    fill_bf(table, V * E, 1.0f);
    int32_t tok[N] = {0, 49, 7, -1, 50, 3, 3, 12, 48};
    float x[N * E], w[E];
    for (int i = 0; i < N * E; i++) x[i] = frand(2.0f);
    for (int i = 0; i < E; i++) w[i] = 1.0f + frand(0.5f);
    int32_t rows[4] = {8, 0, 5, 5};
    void *dt = dev_dup(table, sizeof table), *dtok = dev_dup(tok, sizeof tok), *dx = dev_dup(x, sizeof x);
    void *dw = dev_dup(w, sizeof w), *drows = dev_dup(rows, sizeof rows);
    float *de = cb_cuda_malloc(cu, N * E * 4);
    uint16_t *dn = cb_cuda_malloc(cu, N * (E + 8) * 2);
    CHECK(dt && dtok && dx && dw && drows && de && dn);
    CHECK(cb_cuda_embed(cu, dtok, N, dt, V, E, de) == 0);
    float ge[N * E];
    CHECK(get(ge, de, sizeof ge) == 0);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < E; j++) {
            float want = tok[i] >= 0 && tok[i] < V ? fb(table[tok[i] * E + j]) : 0.0f;
            CHECK(ge[i * E + j] == want);
        }
    /* RMSNorm, with and without a row gather, into a strided output */
    for (int pass = 0; pass < 2; pass++) {
        int n = pass ? 4 : N;
        CHECK(cb_cuda_rmsnorm(cu, n, E, dx, E, pass ? drows : NULL, dw, 1e-5f, dn, E + 8) == 0);
        uint16_t gn[N * (E + 8)];
        CHECK(get(gn, dn, (size_t)n * (E + 8) * 2) == 0);
        for (int i = 0; i < n; i++) {
            int r = pass ? rows[i] : i;
            double ss = 0;
            for (int j = 0; j < E; j++) ss += (double)x[r * E + j] * x[r * E + j];
            double sc = 1.0 / sqrt(ss / E + 1e-5);
            for (int j = 0; j < E; j++) {
                double want = x[r * E + j] * sc * w[j];
                CHECK_MSG(fabs(fb(gn[i * (E + 8) + j]) - want) <= 4e-3 * fabs(want) + 1e-6, "norm [%d][%d]", i, j);
            }
        }
    }
    /* SwiGLU over a fused [n][2F] buffer, and the residual add from bf16 and f32 */
    uint16_t gu[N * 2 * F], out[N * F];
    fill_bf(gu, N * 2 * F, 4.0f);
    void *dgu = dev_dup(gu, sizeof gu);
    uint16_t *dout = cb_cuda_malloc(cu, sizeof out);
    CHECK(dgu && dout && cb_cuda_swiglu(cu, N, F, dgu, (uint16_t *)dgu + F, 2 * F, dout, F) == 0);
    CHECK(get(out, dout, sizeof out) == 0);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < F; j++) {
            double g = fb(gu[i * 2 * F + j]), u = fb(gu[i * 2 * F + F + j]);
            double want = g / (1.0 + exp(-g)) * u;
            CHECK_MSG(fabs(fb(out[i * F + j]) - want) <= 4e-3 * fabs(want) + 1e-6, "swiglu [%d][%d]", i, j);
        }
    /* GeGLU (GELU's tanh form) over the same buffer, into its own output */
    uint16_t out_gg[N * F];
    uint16_t *dout_gg = cb_cuda_malloc(cu, sizeof out_gg);
    CHECK(dout_gg && cb_cuda_geglu(cu, N, F, dgu, (uint16_t *)dgu + F, 2 * F, dout_gg, F) == 0);
    CHECK(get(out_gg, dout_gg, sizeof out_gg) == 0);
    cb_cuda_free(cu, dout_gg);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < F; j++) {
            double g = fb(gu[i * 2 * F + j]), u = fb(gu[i * 2 * F + F + j]);
            double want = 0.5 * g * (1.0 + tanh(sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g))) * u;
            CHECK_MSG(fabs(fb(out_gg[i * F + j]) - want) <= 4e-3 * fabs(want) + 1e-6 * (1.0 + fabs(g * u)),
                      "geglu [%d][%d]: %g vs %g", i, j, fb(out_gg[i * F + j]), want);
        }
    /* scale: f32, one rounding per value, so exactly what the host's f32 product gives */
    {
        float xs[N * E];
        float *dxs = dev_dup(x, sizeof x);
        CHECK(dxs && cb_cuda_scale(cu, dxs, N * E, 11.3137085f) == 0 && get(xs, dxs, sizeof xs) == 0);
        cb_cuda_free(cu, dxs);
        for (int i = 0; i < N * E; i++) CHECK_MSG(xs[i] == x[i] * 11.3137085f, "scale [%d]", i);
    }
    CHECK(cb_cuda_add(cu, N, F, de, E, dout, CB_CUDA_BF16, F) == 0 && cb_cuda_add(cu, N, E, de, E, dx, CB_CUDA_F32, E) == 0);
    CHECK(get(ge, de, sizeof ge) == 0);
    float ge2[N * E];
    CHECK(cb_cuda_embed(cu, dtok, N, dt, V, E, de) == 0 && get(ge2, de, sizeof ge2) == 0);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < E; j++) {
            float want = ge2[i * E + j] + (j < F ? fb(out[i * F + j]) : 0.0f);
            want += x[i * E + j];
            CHECK_MSG(fabs(ge[i * E + j] - want) <= 1e-5f * (1 + fabsf(want)), "add [%d][%d]", i, j);
        }
    void *bufs[] = {dt, dtok, dx, dw, drows, de, dn, dgu, dout};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cb_cuda_free(cu, bufs[i]);
}

/* RoPE of one row in double: H heads of D values, pair i (adjacent for NORM, (i, i + D/2) for NEOX) at
 * theta_i = p * fs * base^(-2i/D) / (ff ? ff[i] : 1). in bf16 [H*D], out [H*D]. */
static void rope_ref_ex(const uint16_t *in, double *out, int H, int D, double p, double base, int neox, double fs,
                        const float *ff) {
    for (int h = 0; h < H; h++)
        for (int i = 0; i < D / 2; i++) {
            double th = p * fs * pow(base, -2.0 * i / D) / (ff ? ff[i] : 1.0);
            int e0 = h * D + (neox ? i : 2 * i), e1 = neox ? e0 + D / 2 : e0 + 1;
            double x0 = fb(in[e0]), x1 = fb(in[e1]);
            out[e0] = x0 * cos(th) - x1 * sin(th);
            out[e1] = x0 * sin(th) + x1 * cos(th);
        }
}
static void rope_ref(const uint16_t *in, double *out, int H, int D, double p, double base) {
    rope_ref_ex(in, out, H, D, p, base, 0, 1.0, NULL);
}

TEST(test_rope) {
    enum { N = 6, H = 3, D = 64, LD = H * D + 16 };
    uint16_t x[N * LD], y[N * LD], z[N * LD];
    fill_bf(x, N * LD, 2.0f);
    int32_t pos[N] = {0, 1, 511, 8191, 65535, -300};
    void *dx = dev_dup(x, sizeof x), *dpos = dev_dup(pos, sizeof pos);
    uint16_t *dy = cb_cuda_malloc(cu, sizeof y);
    CHECK(dx && dpos && dy);
    const cb_cuda_rope_t norm = {CB_CUDA_ROPE_NORM, 500000.0f, 1.0f, NULL};
    CHECK(cb_cuda_rope(cu, N, H, D, dx, LD, dy, LD, dpos, 0, &norm) == 0 && get(y, dy, sizeof y) == 0);
    double ref[H * D];
    for (int i = 0; i < N; i++) {
        rope_ref(x + i * LD, ref, H, D, pos[i], 500000.0);
        for (int j = 0; j < H * D; j++)
            CHECK_MSG(fabs(fb(y[i * LD + j]) - ref[j]) <= 4e-3 * fabs(ref[j]) + 2e-3, "rope pos %d [%d]: %g vs %g",
                      pos[i], j, fb(y[i * LD + j]), ref[j]);
    }
    /* pos0 form, in place: rows at 100..105 */
    CHECK(cb_cuda_d2d(cu, CB_CUDA_STREAM_COMPUTE, dy, dx, sizeof x) == 0);
    CHECK(cb_cuda_rope(cu, N, H, D, dy, LD, dy, LD, NULL, 100, &norm) == 0 && get(z, dy, sizeof z) == 0);
    for (int i = 0; i < N; i++) {
        rope_ref(x + i * LD, ref, H, D, 100 + i, 500000.0);
        for (int j = 0; j < H * D; j++) CHECK(fabs(fb(z[i * LD + j]) - ref[j]) <= 4e-3 * fabs(ref[j]) + 2e-3);
    }
    /* re-rotation composes: rope(rope(x, 100+i), delta) ~ rope(x, 100+i+delta) */
    int32_t delta[N] = {5, -5, 1000, 0, 30000, -100};
    void *dd = dev_dup(delta, sizeof delta);
    CHECK(dd && cb_cuda_rope(cu, N, H, D, dy, LD, dy, LD, dd, 0, &norm) == 0 && get(z, dy, sizeof z) == 0);
    for (int i = 0; i < N; i++) {
        rope_ref(x + i * LD, ref, H, D, 100 + i + delta[i], 500000.0);
        for (int j = 0; j < H * D; j++) CHECK(fabs(fb(z[i * LD + j]) - ref[j]) <= 8e-3 * fabs(ref[j]) + 4e-3);
    }
    /* factors of 1 and freq_scale 1 multiply and divide by 1 exactly: the bits of plain NORM RoPE */
    float ones[D / 2], ff[D / 2];
    for (int i = 0; i < D / 2; i++) ones[i] = 1.0f, ff[i] = 1.0f + 31.0f * (float)i / (D / 2 - 1);  /* 1..32 */
    float *dones = dev_dup(ones, sizeof ones), *dff = dev_dup(ff, sizeof ff);
    CHECK(dones && dff);
    const cb_cuda_rope_t norm1 = {CB_CUDA_ROPE_NORM, 500000.0f, 1.0f, dones};
    CHECK(cb_cuda_rope(cu, N, H, D, dx, LD, dy, LD, dpos, 0, &norm1) == 0 && get(z, dy, sizeof z) == 0);
    for (int i = 0; i < N; i++) CHECK(!memcmp(z + i * LD, y + i * LD, sizeof(uint16_t) * H * D));
    /* NEOX pairing, linear scaling and frequency factors, each and together, in place */
    const cb_cuda_rope_t vars[3] = {{CB_CUDA_ROPE_NEOX, 1e6f, 1.0f, NULL},
                                    {CB_CUDA_ROPE_NORM, 500000.0f, 0.5f, dff},
                                    {CB_CUDA_ROPE_NEOX, 1e6f, 0.25f, dff}};
    for (int v = 0; v < 3; v++) {
        CHECK(cb_cuda_d2d(cu, CB_CUDA_STREAM_COMPUTE, dy, dx, sizeof x) == 0);
        CHECK(cb_cuda_rope(cu, N, H, D, dy, LD, dy, LD, dpos, 0, &vars[v]) == 0 && get(z, dy, sizeof z) == 0);
        for (int i = 0; i < N; i++) {
            rope_ref_ex(x + i * LD, ref, H, D, pos[i], vars[v].base, vars[v].mode == CB_CUDA_ROPE_NEOX,
                        vars[v].freq_scale, vars[v].freq_factors ? ff : NULL);
            for (int j = 0; j < H * D; j++)
                CHECK_MSG(fabs(fb(z[i * LD + j]) - ref[j]) <= 4e-3 * fabs(ref[j]) + 2e-3,
                          "rope variant %d pos %d [%d]: %g vs %g", v, pos[i], j, fb(z[i * LD + j]), ref[j]);
        }
    }
    const cb_cuda_rope_t bad_mode = {(cb_cuda_rope_mode_t)1, 1e4f, 1.0f, NULL};
    const cb_cuda_rope_t bad_scale = {CB_CUDA_ROPE_NEOX, 1e4f, 0.0f, NULL};
    CHECK(cb_cuda_rope(cu, N, H, 63, dx, LD, dy, LD, NULL, 0, &norm) == CB_CUDA_EINVAL);
    CHECK(cb_cuda_rope(cu, N, H, D, dx, LD, dy, LD, NULL, 0, NULL) == CB_CUDA_EINVAL);
    CHECK(cb_cuda_rope(cu, N, H, D, dx, LD, dy, LD, NULL, 0, &bad_mode) == CB_CUDA_EINVAL);
    CHECK(cb_cuda_rope(cu, N, H, D, dx, LD, dy, LD, NULL, 0, &bad_scale) == CB_CUDA_EINVAL);
    cb_cuda_free(cu, dx), cb_cuda_free(cu, dpos), cb_cuda_free(cu, dy), cb_cuda_free(cu, dd);
    cb_cuda_free(cu, dones), cb_cuda_free(cu, dff);
}

TEST(test_copy_rows_deviation) {
    enum { N = 40, W = 96, LD = 104 };
    uint16_t a[N * LD], b[N * LD], out[N * LD];
    fill_bf(a, N * LD, 1.0f);
    fill_bf(b, N * LD, 1.0f);
    int32_t perm[N];
    for (int i = 0; i < N; i++) perm[i] = (i * 7 + 3) % N;
    void *da = dev_dup(a, sizeof a), *db = dev_dup(b, sizeof b), *dp = dev_dup(perm, sizeof perm);
    uint16_t *dout = cb_cuda_malloc(cu, sizeof out);
    float *ddev = cb_cuda_malloc(cu, N * 4);
    CHECK(da && db && dp && dout && ddev);
    /* gather: out[i] = a[perm[i]]; scatter: out[perm[i]] = b[i] (16-byte path); then 14-byte rows (2-byte path) */
    CHECK(cb_cuda_copy_rows(cu, N, W * 2, dout, LD * 2, NULL, da, LD * 2, dp) == 0 && get(out, dout, sizeof out) == 0);
    for (int i = 0; i < N; i++) CHECK(!memcmp(out + i * LD, a + perm[i] * LD, W * 2));
    CHECK(cb_cuda_copy_rows(cu, N, W * 2, dout, LD * 2, dp, db, LD * 2, NULL) == 0 && get(out, dout, sizeof out) == 0);
    for (int i = 0; i < N; i++) CHECK(!memcmp(out + perm[i] * LD, b + i * LD, W * 2));
    CHECK(cb_cuda_copy_rows(cu, N, 7 * 2, dout, LD * 2, NULL, da, LD * 2, NULL) == 0 && get(out, dout, sizeof out) == 0);
    for (int i = 0; i < N; i++) CHECK(!memcmp(out + i * LD, a + i * LD, 14));
    /* deviation */
    float dev[N];
    for (int pass = 0; pass < 2; pass++) {   /* b rows in order, then gathered through perm */
        CHECK(cb_cuda_kv_deviation(cu, N, W, da, LD, db, LD, pass ? dp : NULL, ddev) == 0 && get(dev, ddev, sizeof dev) == 0);
        for (int i = 0; i < N; i++) {
            int r = pass ? perm[i] : i;
            double s = 0;
            for (int j = 0; j < W; j++) {
                double d = (double)fb(a[i * LD + j]) - fb(b[r * LD + j]);
                s += d * d;
            }
            CHECK_MSG(fabs(dev[i] - s) <= 1e-5 * s + 1e-7, "dev[%d] %g vs %g", i, dev[i], s);
        }
    }
    /* int helpers */
    int32_t iv[N];
    CHECK(cb_cuda_i32_iota(cu, dp, N, -3) == 0 && cb_cuda_i32_add(cu, dp, N, 10) == 0 && get(iv, dp, sizeof iv) == 0);
    for (int i = 0; i < N; i++) CHECK(iv[i] == i + 7);
    cb_cuda_free(cu, da), cb_cuda_free(cu, db), cb_cuda_free(cu, dp), cb_cuda_free(cu, dout), cb_cuda_free(cu, ddev);
}

/* ---------------------------------------------------------------- top-k */

static uint32_t fkey(float x) {
    uint32_t b;
    if (isnan(x)) return 0;
    memcpy(&b, &x, 4);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
static const float *g_sc;
static int cmp_rank(const void *pa, const void *pb) {
    int a = *(const int *)pa, b = *(const int *)pb;
    uint32_t ka = fkey(g_sc[a]), kb = fkey(g_sc[b]);
    if (ka != kb) return ka > kb ? -1 : 1;
    return a < b ? -1 : 1;
}
static int cmp_int(const void *pa, const void *pb) {
    int a = *(const int *)pa, b = *(const int *)pb;
    return (a > b) - (a < b);
}

/* CPU reference: top k candidates by (score desc, index asc), union forced, ascending. */
static int topk_ref(int n, const float *sc, const uint8_t *mask, int k, int *out) {
    int *cand = malloc(sizeof(int) * (size_t)n), nc = 0, no = 0;
    for (int i = 0; i < n; i++)
        if (!mask || mask[i] == 0) cand[nc++] = i;
    g_sc = sc;
    qsort(cand, (size_t)nc, sizeof(int), cmp_rank);
    for (int i = 0; i < nc && i < k; i++) out[no++] = cand[i];
    for (int i = 0; i < n; i++)
        if (mask && mask[i] == 1) out[no++] = i;
    qsort(out, (size_t)no, sizeof(int), cmp_int);
    free(cand);
    return no;
}

static int topk_case(int n, int k, int ties, int with_mask) {
    float *sc = malloc(sizeof(float) * (size_t)n);
    uint8_t *mask = malloc((size_t)n);
    int *ref = malloc(sizeof(int) * (size_t)n), *got = malloc(sizeof(int) * (size_t)n), *got2 = malloc(sizeof(int) * (size_t)n);
    for (int i = 0; i < n; i++) {
        sc[i] = ties ? (float)(int)(urand() * 5) : (float)urand() * 100.0f;
        mask[i] = !with_mask ? 0 : (urand() < 0.05 ? 1 : urand() < 0.03 ? 2 : 0);
    }
    if (n > 10) sc[3] = NAN, sc[5] = -INFINITY, sc[7] = INFINITY;
    int nref = topk_ref(n, sc, with_mask ? mask : NULL, k, ref);
    void *dsc = dev_dup(sc, sizeof(float) * (size_t)n), *dm = dev_dup(mask, (size_t)n);
    int32_t *drows = cb_cuda_malloc(cu, sizeof(int32_t) * (size_t)n), *dcnt = cb_cuda_malloc(cu, 4);
    int cnt = -1, bad = !dsc || !dm || !drows || !dcnt;
    for (int rep = 0; rep < 3 && !bad; rep++) {
        bad = cb_cuda_topk_select(cu, n, dsc, with_mask ? dm : NULL, k, drows, dcnt) != 0 || get(&cnt, dcnt, 4) != 0;
        if (!bad) bad = cnt != nref || get(rep ? got2 : got, drows, sizeof(int) * (size_t)cnt) != 0;
        if (!bad) bad = memcmp(rep ? got2 : got, ref, sizeof(int) * (size_t)cnt) != 0;   /* exact, every run */
        if (bad) fprintf(stderr, "  topk n=%d k=%d ties=%d mask=%d rep %d: count %d vs %d\n", n, k, ties, with_mask,
                         rep, cnt, nref);
    }
    cb_cuda_free(cu, dsc), cb_cuda_free(cu, dm), cb_cuda_free(cu, drows), cb_cuda_free(cu, dcnt);
    free(sc), free(mask), free(ref), free(got), free(got2);
    return bad;
}

TEST(test_topk) {
    CHECK(!topk_case(5000, 700, 0, 1));
    CHECK(!topk_case(5000, 700, 1, 1));    /* heavy ties: lowest index first, deterministic */
    CHECK(!topk_case(65536, 9830, 1, 1));  /* 64K rows at r = 0.15 */
    CHECK(!topk_case(65536, 3276, 0, 0));
    CHECK(!topk_case(1000, 0, 0, 1));      /* forced only */
    CHECK(!topk_case(1000, 5000, 0, 1));   /* k >= candidates: all of them */
    CHECK(!topk_case(3, 1, 0, 0));
}

/* ---------------------------------------------------------------- attention */

/* The first key a row of clamped limit L sees under a sliding window (cb_cuda_attn_t.window; 0: none). */
static int win_lo(int L, int window) { return window > 0 && L > window ? L - window : 0; }

/* out [nq][H*D] (double) for bf16 q/k/v, row r over keys [win_lo(L), L); returns per-row max |v| over the keys
 * it sees in vmax. */
static void attn_ref(const uint16_t *q, int ldq, const uint16_t *k, const uint16_t *v, int ldkv, const int32_t *lim,
                     int add, int nq, int nkv, int H, int Hkv, int D, int window, double *out, double *vmax) {
    double *s = malloc(sizeof(double) * (size_t)(nkv ? nkv : 1));
    for (int r = 0; r < nq; r++) {
        int L = lim[r] + add;
        L = L < 0 ? 0 : L > nkv ? nkv : L;
        const int lo = win_lo(L, window);
        vmax[r] = 0;
        for (int h = 0; h < H; h++) {
            int g = h / (H / Hkv);
            double *o = out + ((size_t)r * H + h) * D;
            for (int d = 0; d < D; d++) o[d] = 0;
            if (!L) continue;
            double mx = -INFINITY, sum = 0;
            for (int j = lo; j < L; j++) {
                double acc = 0;
                for (int d = 0; d < D; d++) acc += (double)fb(q[(size_t)r * ldq + h * D + d]) * fb(k[(size_t)j * ldkv + g * D + d]);
                s[j] = acc / sqrt((double)D);
                mx = fmax(mx, s[j]);
            }
            for (int j = lo; j < L; j++) {
                double p = exp(s[j] - mx);
                sum += p;
                for (int d = 0; d < D; d++) {
                    double vv = fb(v[(size_t)j * ldkv + g * D + d]);
                    o[d] += p * vv;
                    vmax[r] = fmax(vmax[r], fabs(vv));
                }
            }
            for (int d = 0; d < D; d++) o[d] /= sum;
        }
    }
    free(s);
}

/* lim_mode: 0 causal (row i at position i), 1 sorted random subset, 2 unsorted random limits incl. 0. window:
 * 0 none, > 0 a sliding window, -1 one equal to the largest limit of the rows drawn. */
static int attn_case(int D, int H, int Hkv, int nkv, int nq, int lim_mode, cb_cuda_attn_algo_t algo, int poison,
                     int window) {
    const int ldq = H * D + 8, ldkv = Hkv * D + (D == 64 ? 8 : 0), ldo = H * D;
    uint16_t *q = malloc((size_t)nq * ldq * 2), *k = malloc((size_t)nkv * ldkv * 2), *v = malloc((size_t)nkv * ldkv * 2);
    uint16_t *o = malloc((size_t)nq * ldo * 2);
    int32_t *lim = malloc(sizeof(int32_t) * (size_t)nq);
    double *ref = malloc(sizeof(double) * (size_t)nq * H * D), *vmax = malloc(sizeof(double) * (size_t)nq);
    fill_bf(q, (size_t)nq * ldq, 1.5f);
    fill_bf(k, (size_t)nkv * ldkv, 1.5f);
    fill_bf(v, (size_t)nkv * ldkv, 1.0f);
    int maxlim = 0;
    for (int r = 0; r < nq; r++) {
        if (lim_mode == 0) lim[r] = r;                                          /* position r: keys [0, r] */
        else if (lim_mode == 1) lim[r] = (int)((double)(r + urand()) * (nkv - 1) / nq);
        else lim[r] = (int)(urand() * (nkv + 1)) - 1;                           /* -1 .. nkv-1 */
        int L = lim[r] + 1 > nkv ? nkv : lim[r] + 1;
        maxlim = L > maxlim ? L : maxlim;
    }
    if (window < 0) window = maxlim;
    int minlo = nkv;   /* the lowest first key of the rows that see any */
    for (int r = 0; r < nq; r++) {
        int L = lim[r] + 1 > nkv ? nkv : lim[r] + 1;
        if (L > 0 && win_lo(L, window) < minlo) minlo = win_lo(L, window);
    }
    if (poison) {   /* keys no row may see: NaN, which would poison any output that read them */
        for (int j = maxlim; j < nkv; j++)
            for (int d = 0; d < ldkv; d++) k[(size_t)j * ldkv + d] = v[(size_t)j * ldkv + d] = 0x7FC0;
        for (int j = 0; j < minlo && j < maxlim; j++)   /* below every row's window */
            for (int d = 0; d < ldkv; d++) k[(size_t)j * ldkv + d] = v[(size_t)j * ldkv + d] = 0x7FC0;
        /* and a huge value at the largest allowed key: rows with smaller limits must not see it */
        if (maxlim > 0)
            for (int d = 0; d < ldkv; d++) v[(size_t)(maxlim - 1) * ldkv + d] = bf(1000.0f);
    }
    attn_ref(q, ldq, k, v, ldkv, lim, 1, nq, nkv, H, Hkv, D, window, ref, vmax);
    void *dq = dev_dup(q, (size_t)nq * ldq * 2), *dk = dev_dup(k, (size_t)nkv * ldkv * 2);
    void *dv = dev_dup(v, (size_t)nkv * ldkv * 2), *dl = dev_dup(lim, sizeof(int32_t) * (size_t)nq);
    void *dout = cb_cuda_malloc(cu, (size_t)nq * ldo * 2);
    int bad = !dq || !dk || !dv || !dl || !dout;
    if (!bad) {
        cb_cuda_attn_t a = {dq, ldq, dk, dv, ldkv, dout, ldo, dl, 1, nq, nkv, H, Hkv, D, 0, 0.0f, window};
        a.max_limit = poison ? maxlim : 0;
        bad = cb_cuda_attention(cu, &a, algo) != 0 || get(o, dout, (size_t)nq * ldo * 2) != 0;
        if (bad) fprintf(stderr, "  attention: %s\n", cb_cuda_error(cu));
    }
    double worst = 0;
    for (int r = 0; r < nq && !bad; r++)
        for (int j = 0; j < H * D; j++) {
            double g = fb(o[(size_t)r * ldo + j]), want = ref[(size_t)r * H * D + j];
            double err = fabs(g - want), tol = 8e-3 * vmax[r] + 4e-3 * fabs(want) + 1e-6;
            if (!(err <= tol)) {
                fprintf(stderr, "  attention D=%d H=%d/%d nkv=%d nq=%d mode=%d algo=%d window=%d: row %d (limit %d) "
                        "[%d]: %g vs %g\n", D, H, Hkv, nkv, nq, lim_mode, (int)algo, window, r, lim[r] + 1, j, g, want);
                bad = 1;
                break;
            }
            worst = fmax(worst, err / tol);
        }
    cb_cuda_free(cu, dq), cb_cuda_free(cu, dk), cb_cuda_free(cu, dv), cb_cuda_free(cu, dl), cb_cuda_free(cu, dout);
    free(q), free(k), free(v), free(o), free(lim), free(ref), free(vmax);
    return bad;
}

TEST(test_attention) {
    const cb_cuda_attn_algo_t algos[] = {CB_CUDA_ATTN_FLASH, CB_CUDA_ATTN_SPLITK, CB_CUDA_ATTN_SIMPLE, CB_CUDA_ATTN_AUTO};
    for (int ai = 0; ai < 4; ai++) {
        cb_cuda_attn_algo_t al = algos[ai];
        int nq_small = al == CB_CUDA_ATTN_SPLITK ? 3 : 0;
        /* SmolLM2 geometry (D 64, 9/3 heads) and Llama-3 geometry (D 128, GQA 4) */
        CHECK(!attn_case(64, 9, 3, 200, nq_small ? nq_small : 200, 0, al, 0, 0));        /* causal prefill */
        CHECK(!attn_case(64, 9, 3, 700, nq_small ? nq_small : 100, 1, al, 1, 0));        /* blend rows, poison */
        CHECK(!attn_case(128, 8, 2, 333, nq_small ? nq_small : 150, 2, al, 1, 0));       /* any limits, 0 too */
        CHECK(!attn_case(128, 8, 2, 1000, nq_small ? nq_small : 64, 1, al, 0, 0));
        /* sliding windows, keys outside every row's range poisoned: smaller than the limits (one key, part of
         * a 64-key tile, a tile, several tiles), equal to the largest limit, larger than every limit */
        const int wins[4] = {1, 37, 64, 150};
        for (int wi = 0; wi < 4; wi++) CHECK(!attn_case(64, 9, 3, 700, nq_small ? nq_small : 100, 1, al, 1, wins[wi]));
        CHECK(!attn_case(64, 9, 3, 200, nq_small ? nq_small : 200, 0, al, 1, 50));       /* causal prefill, window */
        CHECK(!attn_case(128, 8, 2, 333, nq_small ? nq_small : 150, 2, al, 1, 100));     /* any limits, 0 too */
        CHECK(!attn_case(128, 8, 2, 333, nq_small ? nq_small : 150, 1, al, 1, -1));      /* = the largest limit */
        CHECK(!attn_case(128, 8, 2, 333, nq_small ? nq_small : 150, 2, al, 1, 5000));    /* larger than any */
    }
    CHECK(!attn_case(128, 32, 8, 4100, 1, 1, CB_CUDA_ATTN_AUTO, 1, 0));                  /* decode, long */
    CHECK(!attn_case(128, 32, 8, 4100, 1, 1, CB_CUDA_ATTN_AUTO, 1, 1024));               /* decode, windowed */
    CHECK(!attn_case(64, 4, 4, 17, 5, 2, CB_CUDA_ATTN_FLASH, 1, 0));                     /* tiny, MHA */
    CHECK(!attn_case(64, 4, 4, 17, 5, 2, CB_CUDA_ATTN_FLASH, 1, 3));
    CHECK(!attn_case(32, 4, 2, 300, 3, 2, CB_CUDA_ATTN_SPLITK, 1, 0));                   /* generic split-K kernel */
    CHECK(!attn_case(32, 4, 2, 300, 3, 2, CB_CUDA_ATTN_SPLITK, 1, 20));
    CHECK(!attn_case(32, 4, 2, 300, 40, 1, CB_CUDA_ATTN_AUTO, 0, 0));                    /* head_dim 32: no flash */
    CHECK(!attn_case(32, 4, 2, 300, 40, 1, CB_CUDA_ATTN_AUTO, 1, 33));
}

/* The exact causal limit, directly: a row with limit L must give the same output whatever follows L. */
TEST(test_causal_limit) {
    enum { D = 128, H = 4, HKV = 2, NKV = 256, NQ = 64 };
    const int ld = HKV * D;
    uint16_t *q = malloc(NQ * H * D * 2), *k = malloc(NKV * ld * 2), *v = malloc(NKV * ld * 2);
    uint16_t *o1 = malloc(NQ * H * D * 2), *o2 = malloc(NQ * H * D * 2);
    int32_t lim[NQ];
    fill_bf(q, NQ * H * D, 1.0f);
    fill_bf(k, NKV * ld, 1.0f);
    fill_bf(v, NKV * ld, 1.0f);
    for (int r = 0; r < NQ; r++) lim[r] = 3 * r + 1;     /* keys [0, 3r+1); the block's max is 190 */
    void *dq = dev_dup(q, NQ * H * D * 2), *dk = dev_dup(k, NKV * ld * 2), *dv = dev_dup(v, NKV * ld * 2);
    void *dl = dev_dup(lim, sizeof lim), *dout = cb_cuda_malloc(cu, NQ * H * D * 2);
    CHECK(dq && dk && dv && dl && dout);
    cb_cuda_attn_t a = {dq, H * D, dk, dv, ld, dout, H * D, dl, 0, NQ, NKV, H, HKV, D, 0, 0.0f, 0};
    for (int al = CB_CUDA_ATTN_FLASH; al <= CB_CUDA_ATTN_SIMPLE; al++) {
        CHECK(cb_cuda_attention(cu, &a, (cb_cuda_attn_algo_t)al) == 0 && get(o1, dout, NQ * H * D * 2) == 0);
        /* change every key/value at or after each row's limit, one row's limit at a time */
        for (int r = 0; r < NQ; r += 9) {
            uint16_t *k2 = malloc(NKV * ld * 2), *v2 = malloc(NKV * ld * 2);
            memcpy(k2, k, NKV * ld * 2);
            memcpy(v2, v, NKV * ld * 2);
            for (int j = lim[r]; j < NKV; j++)
                for (int d = 0; d < ld; d++) k2[j * ld + d] = bf(frand(5.0f)), v2[j * ld + d] = bf(frand(50.0f));
            CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dk, k2, NKV * ld * 2) == 0);
            CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dv, v2, NKV * ld * 2) == 0);
            CHECK(cb_cuda_attention(cu, &a, (cb_cuda_attn_algo_t)al) == 0 && get(o2, dout, NQ * H * D * 2) == 0);
            CHECK_MSG(!memcmp(o1 + r * H * D, o2 + r * H * D, H * D * 2), "algo %d: row %d saw keys >= its limit %d",
                      al, r, lim[r]);
            free(k2), free(v2);
        }
        CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dk, k, NKV * ld * 2) == 0);
        CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dv, v, NKV * ld * 2) == 0);
    }
    cb_cuda_free(cu, dq), cb_cuda_free(cu, dk), cb_cuda_free(cu, dv), cb_cuda_free(cu, dl), cb_cuda_free(cu, dout);
    free(q), free(k), free(v), free(o1), free(o2);
}

/* The sliding window, directly: a row with keys [lo, L) must give the same output, bit for bit, whatever
 * precedes lo or follows L (window 40: rows 0..13 start at key 0, the others inside the block's tiles). */
TEST(test_window_limit) {
    enum { D = 128, H = 4, HKV = 2, NKV = 256, NQ = 64, W = 40 };
    const int ld = HKV * D;
    uint16_t *q = malloc(NQ * H * D * 2), *k = malloc(NKV * ld * 2), *v = malloc(NKV * ld * 2);
    uint16_t *k2 = malloc(NKV * ld * 2), *v2 = malloc(NKV * ld * 2);
    uint16_t *o1 = malloc(NQ * H * D * 2), *o2 = malloc(NQ * H * D * 2);
    int32_t lim[NQ];
    CHECK(q && k && v && k2 && v2 && o1 && o2);
    fill_bf(q, NQ * H * D, 1.0f);
    fill_bf(k, NKV * ld, 1.0f);
    fill_bf(v, NKV * ld, 1.0f);
    for (int r = 0; r < NQ; r++) lim[r] = 3 * r + 1;     /* keys [max(0, 3r+1-40), 3r+1) */
    void *dq = dev_dup(q, NQ * H * D * 2), *dk = dev_dup(k, NKV * ld * 2), *dv = dev_dup(v, NKV * ld * 2);
    void *dl = dev_dup(lim, sizeof lim), *dout = cb_cuda_malloc(cu, NQ * H * D * 2);
    CHECK(dq && dk && dv && dl && dout);
    cb_cuda_attn_t a = {dq, H * D, dk, dv, ld, dout, H * D, dl, 0, NQ, NKV, H, HKV, D, 0, 0.0f, W};
    for (int al = CB_CUDA_ATTN_FLASH; al <= CB_CUDA_ATTN_SIMPLE; al++) {
        CHECK(cb_cuda_attention(cu, &a, (cb_cuda_attn_algo_t)al) == 0 && get(o1, dout, NQ * H * D * 2) == 0);
        /* change every key/value outside one row's [lo, L) at a time */
        for (int r = 0; r < NQ; r += 7) {
            const int lo = win_lo(lim[r], W);
            memcpy(k2, k, NKV * ld * 2);
            memcpy(v2, v, NKV * ld * 2);
            for (int j = 0; j < NKV; j++)
                if (j < lo || j >= lim[r])
                    for (int d = 0; d < ld; d++) k2[j * ld + d] = bf(frand(5.0f)), v2[j * ld + d] = bf(frand(50.0f));
            CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dk, k2, NKV * ld * 2) == 0);
            CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dv, v2, NKV * ld * 2) == 0);
            CHECK(cb_cuda_attention(cu, &a, (cb_cuda_attn_algo_t)al) == 0 && get(o2, dout, NQ * H * D * 2) == 0);
            CHECK_MSG(!memcmp(o1 + r * H * D, o2 + r * H * D, H * D * 2),
                      "algo %d: row %d saw keys outside its window [%d, %d)", al, r, lo, lim[r]);
        }
        CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dk, k, NKV * ld * 2) == 0);
        CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dv, v, NKV * ld * 2) == 0);
    }
    cb_cuda_free(cu, dq), cb_cuda_free(cu, dk), cb_cuda_free(cu, dv), cb_cuda_free(cu, dl), cb_cuda_free(cu, dout);
    free(q), free(k), free(v), free(k2), free(v2), free(o1), free(o2);
}

/* cb_cuda_attn_mass against a double-precision reference on the same bf16 inputs (the scores are f32
 * dot products of 64-128 terms: ~1e-6 relative, so the summed probabilities agree to 1e-4 relative), rows
 * with different limits (1, mid, full), GQA groups 3 and 4; and the same bits on a second run. With a sliding
 * window (window > 0, or -1: equal to the largest limit), row r over keys [win_lo(lim), lim): the keys below
 * every row's first key are NaN and must get exactly 0. */
static int mass_case(int D, int H, int Hkv, int nkv, int nq, int window) {
    const int ldq = H * D, ldkv = Hkv * D + 2;
    uint16_t *q = malloc((size_t)nq * ldq * 2), *k = malloc((size_t)nkv * ldkv * 2);
    int32_t *lim = malloc(sizeof(int32_t) * (size_t)nq);
    double *ref = calloc((size_t)nkv, sizeof(double)), *s = malloc(sizeof(double) * (size_t)nkv);
    float *got = malloc(sizeof(float) * (size_t)nkv), *got2 = malloc(sizeof(float) * (size_t)nkv);
    fill_bf(q, (size_t)nq * ldq, 2.0f);
    fill_bf(k, (size_t)nkv * ldkv, 2.0f);
    int maxlim = 0;
    for (int r = 0; r < nq; r++) {
        if (window) /* limits in the upper half: a window below nkv / 2 leaves keys no row sees */
            lim[r] = r == 1 ? nkv : nkv / 2 + 1 + (int)(urand() * (nkv - nkv / 2));
        else
            lim[r] = r == 0 ? 1 : r == 1 ? nkv : 1 + (int)(urand() * nkv);
        maxlim = lim[r] > maxlim ? lim[r] : maxlim;
    }
    if (window < 0) window = maxlim;
    int minlo = nkv;
    for (int r = 0; r < nq; r++) minlo = win_lo(lim[r], window) < minlo ? win_lo(lim[r], window) : minlo;
    for (int j = 0; j < minlo; j++)
        for (int d = 0; d < ldkv; d++) k[(size_t)j * ldkv + d] = 0x7FC0;   /* NaN: no row sees these keys */
    const double scale = 1.0 / sqrt((double)D);
    for (int r = 0; r < nq; r++)
        for (int h = 0; h < H; h++) {
            int g = h / (H / Hkv), lo = win_lo(lim[r], window);
            double mx = -INFINITY, sum = 0;
            for (int j = lo; j < lim[r]; j++) {
                double acc = 0;
                for (int d = 0; d < D; d++) acc += (double)fb(q[(size_t)r * ldq + h * D + d]) * fb(k[(size_t)j * ldkv + g * D + d]);
                s[j] = acc * scale;
                mx = fmax(mx, s[j]);
            }
            for (int j = lo; j < lim[r]; j++) sum += exp(s[j] - mx);
            for (int j = lo; j < lim[r]; j++) ref[j] += exp(s[j] - mx) / sum;
        }
    void *dq = dev_dup(q, (size_t)nq * ldq * 2), *dk = dev_dup(k, (size_t)nkv * ldkv * 2);
    void *dl = dev_dup(lim, sizeof(int32_t) * (size_t)nq);
    float *dm = cb_cuda_malloc(cu, sizeof(float) * (size_t)nkv);
    int bad = !dq || !dk || !dl || !dm;
    for (int rep = 0; rep < 2 && !bad; rep++) {
        cb_cuda_attn_t a = {dq, ldq, dk, dk, ldkv, NULL, ldq, dl, 0, nq, nkv, H, Hkv, D, maxlim, 0.0f, window};
        bad = cb_cuda_attn_mass(cu, &a, dm) != 0 || get(rep ? got2 : got, dm, sizeof(float) * (size_t)maxlim) != 0;
        if (bad) fprintf(stderr, "  attn_mass: %s\n", cb_cuda_error(cu));
    }
    double total = 0;
    for (int j = 0; j < maxlim && !bad; j++) {
        total += got[j];
        if (!(fabs(got[j] - ref[j]) <= 1e-4 * ref[j] + 1e-6) || (j < minlo && got[j] != 0.0f)) {
            fprintf(stderr, "  attn_mass D=%d H=%d/%d keys %d rows %d window %d: key %d: %g vs %g\n", D, H, Hkv, nkv,
                    nq, window, j, got[j], ref[j]);
            bad = 1;
        }
    }
    if (!bad && memcmp(got, got2, sizeof(float) * (size_t)maxlim)) {
        fprintf(stderr, "  attn_mass: a second run gave other bits\n");
        bad = 1;
    }
    if (!bad && fabs(total - (double)nq * H) > 1e-4 * nq * H) {
        fprintf(stderr, "  attn_mass: total %g, want %d\n", total, nq * H);
        bad = 1;
    }
    cb_cuda_free(cu, dq), cb_cuda_free(cu, dk), cb_cuda_free(cu, dl), cb_cuda_free(cu, dm);
    free(q), free(k), free(lim), free(ref), free(s), free(got), free(got2);
    return bad;
}

TEST(test_attn_mass) {
    CHECK(!mass_case(64, 9, 3, 700, 16, 0));      /* SmolLM2 geometry, a probe's 16 rows */
    CHECK(!mass_case(128, 32, 8, 3000, 5, 0));    /* Llama-3 geometry */
    CHECK(!mass_case(64, 4, 4, 40, 37, 0));       /* more rows than one tile of 16 */
    /* sliding windows: one key, smaller than most limits, equal to the largest, larger than any */
    CHECK(!mass_case(64, 9, 3, 700, 16, 1));
    CHECK(!mass_case(64, 9, 3, 700, 16, 100));
    CHECK(!mass_case(128, 32, 8, 3000, 5, 512));
    CHECK(!mass_case(64, 4, 4, 40, 37, 9));
    CHECK(!mass_case(64, 4, 4, 40, 37, -1));
    CHECK(!mass_case(64, 4, 4, 40, 37, 1000));
    cb_cuda_attn_t a = {NULL, 64, NULL, NULL, 64, NULL, 64, NULL, 0, 1, 1, 1, 1, 63, 0, 0.0f, 0};
    float *dm = cb_cuda_malloc(cu, 16);
    CHECK(dm && cb_cuda_attn_mass(cu, &a, dm) == CB_CUDA_EINVAL);   /* odd head_dim, NULL pointers */
    cb_cuda_free(cu, dm);
}

/* ---------------------------------------------------------------- sampling */

TEST(test_sampling) {
    enum { V = 1000, R = 3 };
    float lg[R * V];
    for (int i = 0; i < R * V; i++) lg[i] = frand(4.0f);
    lg[10] = 9.0f, lg[900] = 9.0f;            /* row 0: tie -> 10 */
    lg[V + 5] = NAN, lg[V + 6] = 20.0f;       /* row 1: NaN ignored -> 6 */
    for (int i = 0; i < V; i++) lg[2 * V + i] = -1.0f;
    lg[2 * V + V - 1] = 0.0f;                 /* row 2: the last */
    void *dl = dev_dup(lg, sizeof lg);
    int32_t *dout = cb_cuda_malloc(cu, 4 * R);
    uint64_t *drng = cb_cuda_malloc(cu, 8);
    CHECK(dl && dout && drng);
    int32_t got[R];
    CHECK(cb_cuda_argmax(cu, R, V, dl, V, dout) == 0 && get(got, dout, sizeof got) == 0);
    CHECK(got[0] == 10 && got[1] == V + 6 - V && got[2] == V - 1);
    /* temperature sampling over 8 tokens: frequencies match the softmax */
    float small[8] = {1.0f, 2.0f, 0.5f, 3.0f, -1.0f, 2.5f, 0.0f, 1.5f};
    double p[8], z = 0;
    for (int i = 0; i < 8; i++) z += p[i] = exp(small[i] / 0.8);
    for (int i = 0; i < 8; i++) p[i] /= z;
    CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dl, small, sizeof small) == 0);
    uint64_t st = 12345;
    CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, drng, &st, 8) == 0);
    enum { DRAWS = 4000 };
    int cnt[8] = {0};
    for (int d = 0; d < DRAWS; d++) {
        int32_t t = -1;
        CHECK(cb_cuda_sample(cu, 8, dl, 0.8f, 1.0f, drng, dout) == 0 && get(&t, dout, 4) == 0);
        CHECK(t >= 0 && t < 8);
        cnt[t]++;
    }
    for (int i = 0; i < 8; i++) {
        double f = (double)cnt[i] / DRAWS, sd = sqrt(p[i] * (1 - p[i]) / DRAWS);
        CHECK_MSG(fabs(f - p[i]) <= 5 * sd + 0.003, "token %d: frequency %g, probability %g", i, f, p[i]);
    }
    uint64_t st2;
    CHECK(get(&st2, drng, 8) == 0 && st2 == st + DRAWS);
    /* top-p 0.6: at T 0.8 the probabilities are 0.469 (token 3), 0.251 (5), 0.134 (1), ...: the nucleus
     * is {3, 5} (0.72 >= 0.6), sampled 0.469 : 0.251 */
    int n3 = 0;
    for (int d = 0; d < 1000; d++) {
        int32_t t = -1;
        CHECK(cb_cuda_sample(cu, 8, dl, 0.8f, 0.6f, drng, dout) == 0 && get(&t, dout, 4) == 0);
        CHECK_MSG(t == 3 || t == 5, "token %d outside the nucleus", t);
        n3 += t == 3;
    }
    CHECK_MSG(fabs(n3 / 1000.0 - 0.469 / 0.720) < 0.06, "token 3 drawn %d / 1000 times in the nucleus", n3);
    /* same state, same token; greedy ignores the state */
    int32_t t1, t2;
    CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, drng, &st, 8) == 0 && cb_cuda_sample(cu, 8, dl, 1.0f, 0.9f, drng, dout) == 0);
    CHECK(get(&t1, dout, 4) == 0 && cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, drng, &st, 8) == 0);
    CHECK(cb_cuda_sample(cu, 8, dl, 1.0f, 0.9f, drng, dout) == 0 && get(&t2, dout, 4) == 0 && t1 == t2);
    CHECK(cb_cuda_sample(cu, 8, dl, 0.0f, 0.9f, drng, dout) == 0 && get(&t1, dout, 4) == 0 && t1 == 3);
    cb_cuda_free(cu, dl), cb_cuda_free(cu, dout), cb_cuda_free(cu, drng);
}

/* ---------------------------------------------------------------- memory, pool, streams, graphs */

TEST(test_oom) {
    size_t fr = 0, total = 0;
    CHECK(cb_cuda_mem_info(cu, &fr, &total) == 0 && total > 0);
    void *p = cb_cuda_malloc(cu, total + ((size_t)1 << 30));
    CHECK(p == NULL);
    CHECK_MSG(strstr(cb_cuda_error(cu), "out of memory") != NULL, "message: %s", cb_cuda_error(cu));
    /* a model that cannot fit: a clear error, and the context keeps working */
    cb_cuda_llama_hp_t hp = {32, 4096, 32, 8, 128, 14336, 128256, 5e5f, 1e-5f, false};
    char err[512] = "";
    cb_cuda_llama_t *m = cb_cuda_llama_new(cu, &hp, 4 << 20, 4096, err, sizeof err);
    CHECK(m == NULL);
    CHECK_MSG(strstr(err, "out of memory") != NULL, "message: %s", err);
    uint8_t *d = cb_cuda_malloc(cu, 4096), h[4096];
    CHECK_MSG(d != NULL, "%s", cb_cuda_error(cu));
    CHECK(cb_cuda_memset(cu, d, 0x5A, 4096) == 0 && get(h, d, 4096) == 0 && h[0] == 0x5A && h[4095] == 0x5A);
    CHECK(cb_cuda_sync(cu) == 0);
    cb_cuda_free(cu, d);
}

TEST(test_kvpool) {
    enum { L = 2, KVD = 64, T = 16 };
    size_t slot = (size_t)L * 2 * T * KVD * 2;
    char err[256] = "";
    cb_cuda_kvpool_t *p = cb_cuda_kvpool_new(cu, 3 * slot + 100, L, KVD, T, err, sizeof err);
    CHECK_MSG(p != NULL, "%s", err);
    CHECK(cb_cuda_kvpool_slots(p) == 3);
    uint16_t *hk = cb_cuda_host_alloc(cu, 4 * L * T * KVD * 2), *hv = cb_cuda_host_alloc(cu, 4 * L * T * KVD * 2);
    CHECK(hk && hv);
    fill_bf(hk, 4 * L * T * KVD, 1.0f);
    fill_bf(hv, 4 * L * T * KVD, 1.0f);
    uint8_t key[4][32];
    memset(key, 0, sizeof key);
    for (int c = 0; c < 4; c++) key[c][0] = (uint8_t)(c + 1);
    int s[4];
    bool hit;
    for (int c = 0; c < 3; c++) {
        s[c] = cb_cuda_kvpool_acquire(p, key[c], T - c, &hit);
        CHECK(s[c] >= 0 && !hit);
        for (int l = 0; l < L; l++)
            CHECK(cb_cuda_kvpool_load_layer(p, s[c], l, hk + (size_t)(c * L + l) * T * KVD, hv + (size_t)(c * L + l) * T * KVD) == 0);
    }
    CHECK(cb_cuda_kvpool_acquire(p, key[3], T, &hit) == CB_CUDA_EBUSY);   /* all referenced */
    CHECK(cb_cuda_kvpool_wait_loads(p) == 0);
    uint16_t back[T * KVD];
    for (int c = 0; c < 3; c++)
        for (int l = 0; l < L; l++) {
            CHECK(get(back, cb_cuda_kvpool_v(p, s[c], l), (size_t)(T - c) * KVD * 2) == 0);
            CHECK(!memcmp(back, hv + (size_t)(c * L + l) * T * KVD, (size_t)(T - c) * KVD * 2));
        }
    for (int c = 0; c < 3; c++) CHECK(cb_cuda_kvpool_release(p, s[c], true) == 0);
    /* touch chunk 0 (a hit), then chunk 3 evicts the least recently used: chunk 1 */
    int h0 = cb_cuda_kvpool_acquire(p, key[0], T, &hit);
    CHECK(h0 == s[0] && hit);
    CHECK(cb_cuda_kvpool_release(p, h0, true) == 0);
    int s3 = cb_cuda_kvpool_acquire(p, key[3], T, &hit);
    CHECK(s3 == s[1] && !hit);
    CHECK(cb_cuda_kvpool_release(p, s3, false) == 0);      /* load "failed": forgotten */
    CHECK(cb_cuda_kvpool_acquire(p, key[1], T - 1, &hit) >= 0 && !hit);
    CHECK(cb_cuda_kvpool_acquire(p, key[0], T + 1, &hit) == CB_CUDA_EINVAL);
    cb_cuda_kvpool_stats_t st;
    cb_cuda_kvpool_stats(p, &st);
    CHECK(st.hits == 1 && st.misses == 5 && st.evictions == 1 && st.slots == 3 && st.used == 3);
    cb_cuda_kvpool_destroy(&p);
    CHECK(p == NULL);
    cb_cuda_host_free(cu, hk), cb_cuda_host_free(cu, hv);
}

TEST(test_streams_and_graph) {
    enum { N = 1 << 20, PG = 40 * N + 17 };   /* PG: more than the whole pinned staging ring (4 x 8 MiB) */
    uint8_t *pinned = cb_cuda_host_alloc(cu, N), *pageable = malloc(PG), *back = malloc(PG);
    uint8_t *d = cb_cuda_malloc(cu, PG), *d2 = cb_cuda_malloc(cu, PG);
    cb_cuda_event_t *ev = cb_cuda_event_new(cu, false);
    CHECK(pinned && pageable && back && d && d2 && ev);
    for (int i = 0; i < N; i++) pinned[i] = (uint8_t)(i * 7);
    for (int i = 0; i < PG; i++) pageable[i] = (uint8_t)(i * 13 + 1 + (i >> 20));
    /* copy stream -> event -> compute stream consumes */
    CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COPY, d, pinned, N) == 0 && cb_cuda_event_record(cu, ev, CB_CUDA_STREAM_COPY) == 0);
    CHECK(cb_cuda_stream_wait(cu, CB_CUDA_STREAM_COMPUTE, ev) == 0);
    CHECK(cb_cuda_d2d(cu, CB_CUDA_STREAM_COMPUTE, d2, d, N) == 0 && get(back, d2, N) == 0 && !memcmp(back, pinned, N));
    /* pageable, larger than the staging ring (staged in pieces) */
    CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COPY, d, pageable, PG) == 0);
    CHECK(cb_cuda_event_record(cu, ev, CB_CUDA_STREAM_COPY) == 0 && cb_cuda_event_sync(cu, ev) == 0);
    CHECK(get(back, d, PG) == 0 && !memcmp(back, pageable, PG));
    /* a captured graph replays against current device data */
    int32_t *dv = cb_cuda_malloc(cu, 64), hv[16];
    CHECK(dv && cb_cuda_i32_iota(cu, dv, 16, 0) == 0 && cb_cuda_sync(cu) == 0);
    CHECK(cb_cuda_graph_begin(cu) == 0);
    CHECK(cb_cuda_i32_add(cu, dv, 16, 3) == 0);
    cb_cuda_graph_t *g = cb_cuda_graph_end(cu);
    CHECK_MSG(g != NULL, "%s", cb_cuda_error(cu));
    for (int i = 0; i < 5; i++) CHECK(cb_cuda_graph_launch(cu, g) == 0);
    CHECK(get(hv, dv, 64) == 0);
    for (int i = 0; i < 16; i++) CHECK(hv[i] == i + 15);
    cb_cuda_graph_destroy(&g);
    CHECK(g == NULL);
    cb_cuda_free(cu, dv), cb_cuda_free(cu, d), cb_cuda_free(cu, d2);
    cb_cuda_event_destroy(cu, &ev);
    cb_cuda_host_free(cu, pinned);
    free(pageable), free(back);
}

TEST(test_synth_fill) {
    cb_synth_shape_t s;
    CHECK(cb_synth_shape_named("llama3-8b", &s));
    enum { N = 100000 };
    uint16_t *d = cb_cuda_malloc(cu, N * 2), *h = malloc(N * 2);
    float *ref = malloc(N * 4);
    CHECK(d && h && ref);
    const cb_synth_kind_t kinds[] = {CB_SYNTH_ATTN_Q, CB_SYNTH_FFN_DOWN, CB_SYNTH_TOKEN_EMBD};
    for (int i = 0; i < 3; i++) {
        int layer = kinds[i] == CB_SYNTH_TOKEN_EMBD ? -1 : 7;
        uint64_t first = 123456789;
        CHECK(cb_cuda_synth_fill(cu, d, N, 42, cb_synth_tensor_id(layer, kinds[i]), first, cb_synth_scale(&s, kinds[i])) == 0);
        CHECK(get(h, d, N * 2) == 0);
        cb_synth_fill(&s, 42, layer, kinds[i], first, N, ref);
        for (int j = 0; j < N; j++) CHECK_MSG(h[j] == bf(ref[j]), "kind %d [%d]: %04x vs %g", kinds[i], j, h[j], ref[j]);
    }
    cb_cuda_free(cu, d);
    free(h), free(ref);
}


/* ---------------------------------------------------------------- the backend table, CUDA vs CPU */

/* max |a - b| <= tol_rel * scale[i] + tol_abs for every element, else print the first miss. */
static int close_enough(const char *what, const float *a, const float *b, size_t n, const double *scale, double tol_rel,
                        double tol_abs) {
    for (size_t i = 0; i < n; i++) {
        double tol = tol_rel * (scale ? scale[i] : fabs(b[i])) + tol_abs;
        if (!(fabs((double)a[i] - b[i]) <= tol)) {
            fprintf(stderr, "  %s [%zu]: cuda %g vs cpu %g (tolerance %g)\n", what, i, a[i], b[i], tol);
            return 0;
        }
    }
    return 1;
}

/* The geometry of the backend-table tests: GQA 2, head_dim 32 (no flash: split-K and the simple kernel). */
static cb_hparams_t be_hp(void) {
    cb_hparams_t hp;
    memset(&hp, 0, sizeof hp);
    hp.n_layer = 2, hp.n_embd = 128, hp.n_head = 4, hp.n_head_kv = 2, hp.head_dim = 32, hp.n_ff = 192;
    hp.n_vocab = 300, hp.rope_base = 10000.0f, hp.rms_eps = 1e-5f;
    return hp;
}

/* Every dense operation of cb_backend_cuda_new against cb_backend_cpu_new on the same random inputs. The
 * CUDA backend rounds its operands to bf16, so the tolerances are those of bf16 inputs: a product of two
 * rounded numbers is off by <= 2^-8 relative, hence matmul within 6e-3 * sum|x w|. */
TEST(test_backend_ops) {
    cb_hparams_t hp = be_hp();
    char err[256] = "";
    cb_backend_t *cpu = cb_backend_cpu_new(&hp, 64, 256, 2, err, sizeof err);
    CHECK_MSG(cpu != NULL, "%s", err);
    cb_backend_t *gpu = cb_backend_cuda_new(&hp, 64, 256, 0, err, sizeof err);
    CHECK_MSG(gpu != NULL, "%s", err);
    CHECK(!strcmp(gpu->ops->name, "cuda") && gpu->kv_value_bytes == 2);
    enum { N = 20, E = 128, F = 192, V = 300, LDY = 200, QD = 128 };
    float *wd = malloc(sizeof(float) * F * E), *wd2 = malloc(sizeof(float) * F * E), *tab = malloc(sizeof(float) * V * E);
    float *x = malloc(sizeof(float) * N * F), *y1 = malloc(sizeof(float) * N * LDY), *y2 = malloc(sizeof(float) * N * LDY);
    float *z1 = malloc(sizeof(float) * N * LDY), *z2 = malloc(sizeof(float) * N * LDY);
    double *sc = malloc(sizeof(double) * N * LDY);
    void *q5_keep[2] = {NULL, NULL};   /* the Q5_0 weights, freed after the backends */
    CHECK(wd && wd2 && tab && x && y1 && y2 && z1 && z2 && sc);
    for (int i = 0; i < F * E; i++) wd[i] = frand(0.1f), wd2[i] = frand(0.1f);
    for (int i = 0; i < V * E; i++) tab[i] = frand(1.0f);
    for (int i = 0; i < N * F; i++) x[i] = frand(1.0f);
    cb_weight_t w = {"w", CB_TYPE_F32, wd, sizeof(float) * E, F, E, wd, NULL, NULL};
    cb_weight_t w2 = {"w2", CB_TYPE_F32, wd2, sizeof(float) * E, F, E, wd2, NULL, NULL};
    cb_weight_t t = {"tok", CB_TYPE_F32, tab, sizeof(float) * E, V, E, tab, NULL, NULL};
    /* matmul (n > 1 and n = 1) */
    for (int n = N; n >= 1; n -= N - 1) {
        for (int i = 0; i < N * LDY; i++) y1[i] = y2[i] = 0.0f, sc[i] = 0.0;
        cpu->ops->matmul(cpu->ctx, &w, x, n, y1, LDY);
        gpu->ops->matmul(gpu->ctx, &w, x, n, y2, LDY);
        for (int i = 0; i < n; i++)
            for (int o = 0; o < F; o++)
                for (int j = 0; j < E; j++) sc[i * LDY + o] += fabs((double)x[i * E + j] * wd[o * E + j]);
        CHECK(close_enough("matmul", y2, y1, (size_t)n * LDY, sc, 6e-3, 1e-6));
    }
    /* matmul_multi: two weights, one x; each part as matmul gives it */
    {
        cb_matmul_part_t pc[2] = {{&w, y1, LDY}, {&w2, z1, LDY}}, pg[2] = {{&w, y2, LDY}, {&w2, z2, LDY}};
        for (int i = 0; i < N * LDY; i++) y1[i] = y2[i] = z1[i] = z2[i] = 0.0f;
        CHECK(gpu->ops->matmul_multi != NULL);
        if (cpu->ops->matmul_multi) cpu->ops->matmul_multi(cpu->ctx, pc, 2, x, N);
        else cpu->ops->matmul(cpu->ctx, &w, x, N, y1, LDY), cpu->ops->matmul(cpu->ctx, &w2, x, N, z1, LDY);
        gpu->ops->matmul_multi(gpu->ctx, pg, 2, x, N);
        for (int i = 0; i < N * LDY; i++) sc[i] = 0.0;
        for (int i = 0; i < N; i++)
            for (int o = 0; o < F; o++)
                for (int j = 0; j < E; j++) sc[i * LDY + o] += fabs((double)x[i * E + j] * wd2[o * E + j]);
        CHECK(close_enough("matmul_multi part 2", z2, z1, (size_t)N * LDY, sc, 6e-3, 1e-6));
        float *y3 = malloc(sizeof(float) * N * LDY);
        CHECK(y3 != NULL);
        for (int i = 0; i < N * LDY; i++) y3[i] = 0.0f;
        gpu->ops->matmul(gpu->ctx, &w, x, N, y3, LDY);
        int same = !memcmp(y3, y2, sizeof(float) * N * LDY);
        free(y3);
        CHECK_MSG(same, "matmul_multi part 1 differs from matmul of the same weight");
    }
    /* rmsnorm, in place on the GPU side */
    float nw[E];
    for (int i = 0; i < E; i++) nw[i] = 1.0f + frand(0.2f);
    memcpy(y2, x, sizeof(float) * N * E);
    cpu->ops->rmsnorm(cpu->ctx, x, nw, N, E, 1e-5f, y1);
    gpu->ops->rmsnorm(gpu->ctx, y2, nw, N, E, 1e-5f, y2);
    CHECK(close_enough("rmsnorm", y2, y1, N * E, NULL, 4e-3, 1e-6));
    /* rope: the model's rotation (NORM), then NEOX pairing, frequency factors (Llama 3's rope_freqs, two
     * tensors: the CUDA backend caches each by address), linear scaling 0.5, and all of them together */
    int32_t pos[N];
    for (int i = 0; i < N; i++) pos[i] = i * 37 + (i == 5 ? 1000 : 0);
    float ffa[16], ffb[16];
    for (int i = 0; i < 16; i++) ffa[i] = 1.0f + 7.0f * (float)i / 15.0f, ffb[i] = i < 8 ? 1.0f : 8.0f;
    const cb_rope_t r0 = cb_hparams_rope(&hp);
    CHECK(r0.type == CB_ROPE_NORM && r0.n_dims == hp.head_dim && r0.freq_scale == 1.0f && !r0.freq_factors);
    cb_rope_t ropes[6] = {r0, r0, r0, r0, r0, r0};
    ropes[1].type = CB_ROPE_NEOX;
    ropes[2].freq_factors = ffa;
    ropes[3].freq_scale = 0.5f;
    ropes[4].type = CB_ROPE_NEOX, ropes[4].base = 1e6f, ropes[4].freq_scale = 0.5f, ropes[4].freq_factors = ffb;
    ropes[5].freq_factors = ffa;   /* the cached copy of ffa again */
    const char *rope_names[6] = {"rope norm", "rope neox", "rope freq_factors", "rope freq_scale 0.5",
                                 "rope neox + factors + scale", "rope factors (cached)"};
    for (int v = 0; v < 6; v++) {
        memcpy(y1, x, sizeof(float) * N * QD);
        memcpy(y2, x, sizeof(float) * N * QD);
        cpu->ops->rope(cpu->ctx, y1, N, hp.n_head, pos, &ropes[v]);
        gpu->ops->rope(gpu->ctx, y2, N, hp.n_head, pos, &ropes[v]);
        CHECK_MSG(close_enough(rope_names[v], y2, y1, N * QD, NULL, 8e-3, 8e-3), "%s", rope_names[v]);
    }
    /* add_bias: f32 on both backends, so the same bits (a bias of Q: [n_head*head_dim]) */
    float bias[QD];
    for (int i = 0; i < QD; i++) bias[i] = frand(0.5f);
    memcpy(y1, x, sizeof(float) * N * QD);
    memcpy(y2, x, sizeof(float) * N * QD);
    cpu->ops->add_bias(cpu->ctx, y1, bias, N, QD);
    CHECK(gpu->ops->add_bias != NULL);
    gpu->ops->add_bias(gpu->ctx, y2, bias, N, QD);
    CHECK(close_enough("add_bias", y2, y1, N * QD, NULL, 0.0, 0.0));
    for (int i = 0; i < QD; i++) CHECK(y2[(N - 1) * QD + i] == x[(N - 1) * QD + i] + bias[i]);
    /* swiglu, add, embed */
    cpu->ops->swiglu(cpu->ctx, x, x + N * E / 2, N * E / 2, y1);
    gpu->ops->swiglu(gpu->ctx, x, x + N * E / 2, N * E / 2, y2);
    CHECK(close_enough("swiglu", y2, y1, N * E / 2, NULL, 1.2e-2, 1e-5));
    memcpy(y1, x, sizeof(float) * N * E);
    memcpy(y2, x, sizeof(float) * N * E);
    cpu->ops->add(cpu->ctx, y1, x + 7, N * E);
    gpu->ops->add(gpu->ctx, y2, x + 7, N * E);
    CHECK(close_enough("add", y2, y1, N * E, NULL, 0.0, 0.0));
    int32_t tk[N];
    for (int i = 0; i < N; i++) tk[i] = (i * 53) % V;
    cpu->ops->embed(cpu->ctx, &t, tk, N, y1);
    gpu->ops->embed(gpu->ctx, &t, tk, N, y2);
    CHECK(close_enough("embed", y2, y1, N * E, NULL, 4e-3, 0.0));
    /* geglu (as swiglu: bf16 operands and output), scale (f32 on both: the same bits; gemma3's sqrt(n_embd)) */
    CHECK(cpu->ops->geglu && gpu->ops->geglu && cpu->ops->scale && gpu->ops->scale);
    cpu->ops->geglu(cpu->ctx, x, x + N * E / 2, N * E / 2, y1);
    gpu->ops->geglu(gpu->ctx, x, x + N * E / 2, N * E / 2, y2);
    CHECK(close_enough("geglu", y2, y1, N * E / 2, NULL, 1.2e-2, 1e-5));
    memcpy(y1, x, sizeof(float) * N * E);
    memcpy(y2, x, sizeof(float) * N * E);
    cpu->ops->scale(cpu->ctx, y1, N * E, sqrtf((float)E));
    gpu->ops->scale(gpu->ctx, y2, N * E, sqrtf((float)E));
    CHECK(close_enough("scale", y2, y1, N * E, NULL, 0.0, 0.0));
    /* Q5_0 weights (gemma3's GGUFs), quantized here from wd and tab: matmul (n > 1 and n = 1) and embed. With the
     * weight's f32 copy the CPU multiplies the exact dequantized values, so matmul is within 6e-3 * sum|x w| as
     * above; without it the CPU runs its own Q5_0 path, which may round x to 8 bits per block of 32 (the B32
     * activations of cpu_quant.h: <= amax of the block / 254 per value), so sum_j |w_j| amax_blk(j) / 254 more.
     * embed: one bf16 rounding of the dequantized value. */
    {
        const size_t rb = E / 32 * 22;
        uint8_t *q5 = malloc((size_t)F * rb), *t5 = malloc((size_t)V * rb);
        float *w5 = malloc(sizeof(float) * F * E);
        CHECK(q5 && t5 && w5);
        q5_0_quantize(wd, (size_t)F * E, q5);
        CHECK(cb_dequant(CB_TYPE_Q5_0, q5, w5, (size_t)F * E));
        q5_0_quantize(tab, (size_t)V * E, t5);
        cb_weight_t wq5 = {"w5", CB_TYPE_Q5_0, q5, rb, F, E, w5, NULL, NULL};
        const cb_weight_t tq5 = {"tok5", CB_TYPE_Q5_0, t5, rb, V, E, NULL, NULL, NULL};
        int q5_ok = 1;
        for (int pass = 0; pass < 2 && q5_ok; pass++) {
            wq5.f32 = pass ? NULL : w5;
            for (int n = N; n >= 1 && q5_ok; n -= N - 1) {
                for (int i = 0; i < N * LDY; i++) y1[i] = y2[i] = 0.0f, sc[i] = 0.0;
                cpu->ops->matmul(cpu->ctx, &wq5, x, n, y1, LDY);
                gpu->ops->matmul(gpu->ctx, &wq5, x, n, y2, LDY);
                for (int i = 0; i < n; i++)
                    for (int o = 0; o < F; o++)
                        for (int b = 0; b < E / 32; b++) {
                            double amax = 0.0, ab = 0.0;
                            for (int j = 32 * b; j < 32 * b + 32; j++) amax = fmax(amax, fabs(x[i * E + j]));
                            for (int j = 32 * b; j < 32 * b + 32; j++) {
                                const double wv = fabs(w5[o * E + j]);
                                ab += 6e-3 * fabs((double)x[i * E + j]) * wv + (pass ? wv * amax / 254.0 : 0.0);
                            }
                            sc[i * LDY + o] += ab;
                        }
                q5_ok = close_enough(pass ? "matmul Q5_0 (the CPU's own path)" : "matmul Q5_0 (f32 copy)", y2, y1,
                                     (size_t)n * LDY, sc, 1.0, 1e-6);
                if (!q5_ok) fprintf(stderr, "  Q5_0 matmul of %d rows\n", n);
            }
        }
        if (q5_ok) {
            cpu->ops->embed(cpu->ctx, &tq5, tk, N, y1);
            gpu->ops->embed(gpu->ctx, &tq5, tk, N, y2);
            q5_ok = close_enough("embed Q5_0", y2, y1, N * E, NULL, 4e-3, 0.0);
        }
        free(w5);
        q5_keep[0] = q5, q5_keep[1] = t5;   /* freed after the backends: the CUDA weight cache is keyed by address */
        CHECK(q5_ok);
    }
    /* host buffers: pinned, zeroed, aligned */
    uint8_t *hb = gpu->ops->host_alloc(gpu->ctx, 100000);
    CHECK(hb != NULL && ((uintptr_t)hb & 63) == 0);
    int zero = 1;
    for (int i = 0; i < 100000; i++) zero = zero && hb[i] == 0;
    gpu->ops->host_free(gpu->ctx, hb);
    CHECK(zero);
    CHECK(!cb_backend_cuda_failed(gpu));
    cb_backend_destroy(&gpu);
    cb_backend_destroy(&cpu);
    CHECK(gpu == NULL && cpu == NULL);
    free(q5_keep[0]), free(q5_keep[1]);
    free(wd), free(wd2), free(tab), free(x), free(y1), free(y2), free(z1), free(z2), free(sc);
}

/* max |a - b| over n, and whether they are bit-identical */
static double vmax_diff(const float *a, const float *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= m)) m = d;
    }
    return m;
}

/* The KV pool and the CacheBlend operations of the table, CUDA vs CPU, through a shuffled block table
 * (pool blocks {3, 0, 5, 1, 9, 11, 2, 7, 4, 10}: the CUDA backend gathers them on the device) and a
 * consecutive one (blocks 0..9 of layer 1: read in place), in a pool of 14 blocks. Tolerances: the pool
 * holds bf16 on CUDA, so a row read back is within one bf16 rounding (2^-9 relative; 4e-3 allowed); a
 * loaded K is rounded to bf16, rotated and rounded again: 8e-3 of its rotation pair's magnitude; attention
 * as test_backend_ops' note (scores of unit values over 32 dims move by ~1e-2: 3e-2 absolute); attention
 * mass sums probabilities that move by ~1e-3 relative: 3e-2 relative allowed, and every row and head adds
 * 1 (1e-3). kv_deviation, topk and compact_rows run on the host on both backends: bit-identical results
 * required. */
enum { KV_NL = 2, KV_D = 64, KV_BT = 16, KV_NB = 14, KV_NK = 150, KV_N = 20, KV_QD = 128 };
static const int32_t g_shuf[10] = {3, 0, 5, 1, 9, 11, 2, 7, 4, 10}, g_cons[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};

typedef struct {
    cb_hparams_t hp;
    cb_backend_t *cpu, *gpu;
    cb_kv_table_t ts, tc;    /* shuffled (layer 0), consecutive (layer 1); 160 positions each */
    float *kw, *vw;          /* [KV_NK][KV_D]: what both layers hold at positions 0..KV_NK-1 */
} kvfix_t;

static void kvfix_close(kvfix_t *f) {
    cb_backend_destroy(&f->gpu);
    cb_backend_destroy(&f->cpu);
    free(f->kw), free(f->vw);
    f->kw = f->vw = NULL;
}

/* Both backends with a pool each, and the same random K/V written to positions [0, KV_NK) of both layers
 * (in a scrambled order, 64 + 64 + 22 rows per call). 0, or -1 with a message. */
static int kvfix_open(kvfix_t *f) {
    char err[256] = "";
    memset(f, 0, sizeof *f);
    f->hp = be_hp();
    f->ts = (cb_kv_table_t){g_shuf, 10 * KV_BT};
    f->tc = (cb_kv_table_t){g_cons, 10 * KV_BT};
    f->cpu = cb_backend_cpu_new(&f->hp, 64, 256, 2, err, sizeof err);
    if (f->cpu) f->gpu = cb_backend_cuda_new(&f->hp, 64, 256, 0, err, sizeof err);
    f->kw = malloc(sizeof(float) * KV_NK * KV_D);
    f->vw = malloc(sizeof(float) * KV_NK * KV_D);
    float *ko = malloc(sizeof(float) * KV_NK * KV_D), *vo = malloc(sizeof(float) * KV_NK * KV_D);
    int rc = -1;
    if (!f->gpu || !f->kw || !f->vw || !ko || !vo) goto done;
    if (f->cpu->ops->kv_pool_init(f->cpu->ctx, KV_NL, KV_D, KV_BT, KV_NB, CB_KV_F32, err, sizeof err) != 0 ||
        f->gpu->ops->kv_pool_init(f->gpu->ctx, KV_NL, KV_D, KV_BT, KV_NB, CB_KV_F16, err, sizeof err) != 0)
        goto done;
    for (int i = 0; i < KV_NK * KV_D; i++) f->kw[i] = frand(1.0f), f->vw[i] = frand(1.0f);
    int32_t order[KV_NK];
    for (int i = 0; i < KV_NK; i++) order[i] = (i * 61 + 17) % KV_NK;   /* 61 is prime to 150: a permutation */
    for (int i = 0; i < KV_NK; i++) {
        memcpy(ko + (size_t)i * KV_D, f->kw + (size_t)order[i] * KV_D, sizeof(float) * KV_D);
        memcpy(vo + (size_t)i * KV_D, f->vw + (size_t)order[i] * KV_D, sizeof(float) * KV_D);
    }
    cb_backend_t *bes[2] = {f->cpu, f->gpu};
    for (int bi = 0; bi < 2; bi++)
        for (int l = 0; l < KV_NL; l++)
            for (int r0 = 0; r0 < KV_NK; r0 += 64) {
                int n = KV_NK - r0 < 64 ? KV_NK - r0 : 64;
                if (bes[bi]->ops->kv_write(bes[bi]->ctx, l, l ? &f->tc : &f->ts, order + r0, n, ko + (size_t)r0 * KV_D,
                                           vo + (size_t)r0 * KV_D) != 0) {
                    snprintf(err, sizeof err, "%s: kv_write failed", bes[bi]->ops->name);
                    goto done;
                }
            }
    rc = 0;
done:
    if (rc) fprintf(stderr, "  fixture: %s\n", err[0] ? err : "out of memory");
    free(ko), free(vo);
    return rc;
}

/* Writes, reads, layer loads in every dtype, block copies, bad arguments, and an oversized pool. */
/* A matmul whose n x rows output is larger than the backend's output scratch (the LM head of a decode batch:
 * n x n_vocab) goes in row pieces and gives what the CPU gives. */
TEST(test_backend_matmul_pieces) {
    cb_hparams_t hp = be_hp();
    char err[256] = "";
    cb_backend_t *cpu = cb_backend_cpu_new(&hp, 64, 256, 2, err, sizeof err);
    CHECK_MSG(cpu != NULL, "%s", err);
    cb_backend_t *gpu = cb_backend_cuda_new(&hp, 64, 256, 0, err, sizeof err);
    CHECK_MSG(gpu != NULL, "%s", err);
    enum { N = 40, E = 128, R = 1 << 16 }; /* 2.6M outputs: more than any scratch be_hp sizes */
    float *wd = malloc(sizeof(float) * (size_t)R * E), *x = malloc(sizeof(float) * N * E);
    float *y1 = malloc(sizeof(float) * (size_t)N * R), *y2 = malloc(sizeof(float) * (size_t)N * R);
    double *sc = malloc(sizeof(double) * (size_t)N * R);
    CHECK(wd && x && y1 && y2 && sc);
    for (size_t i = 0; i < (size_t)R * E; i++) wd[i] = frand(0.1f);
    for (int i = 0; i < N * E; i++) x[i] = frand(1.0f);
    cb_weight_t w = {"head", CB_TYPE_F32, wd, sizeof(float) * E, R, E, wd, NULL, NULL};
    cpu->ops->matmul(cpu->ctx, &w, x, N, y1, R);
    gpu->ops->matmul(gpu->ctx, &w, x, N, y2, R);
    CHECK_MSG(!cb_backend_cuda_failed(gpu), "the CUDA backend failed on a matmul larger than its scratch");
    for (int i = 0; i < N; i++)
        for (int o = 0; o < R; o++) {
            double a = 0.0;
            for (int j = 0; j < E; j++) a += fabs((double)x[i * E + j] * wd[(size_t)o * E + j]);
            sc[(size_t)i * R + o] = a;
        }
    CHECK(close_enough("matmul in pieces", y2, y1, (size_t)N * R, sc, 6e-3, 1e-6));
    free(wd), free(x), free(y1), free(y2), free(sc);
    cb_backend_destroy(&cpu);
    cb_backend_destroy(&gpu);
}

TEST(test_backend_pool) {
    kvfix_t f;
    if (kvfix_open(&f) != 0) {
        kvfix_close(&f);
        CHECK(0);
    }
    enum { NK = KV_NK, KVD = KV_D, BT = KV_BT };
    char err[256] = "";
    cb_backend_t *cpu = f.cpu, *gpu = f.gpu;
    float *k1 = malloc(sizeof(float) * NK * KVD), *v1 = malloc(sizeof(float) * NK * KVD);
    float *k2 = malloc(sizeof(float) * NK * KVD), *v2 = malloc(sizeof(float) * NK * KVD);
    double *sc = malloc(sizeof(double) * NK * KVD);
    uint16_t *h16 = malloc(2 * NK * KVD * 2);
    int ok = k1 && v1 && k2 && v2 && sc && h16;
    /* the pool is made once; bad arguments fail without marking the backend failed */
    int32_t bad_pos = 10 * BT;
    ok = ok && gpu->ops->kv_pool_init(gpu->ctx, KV_NL, KVD, BT, KV_NB, CB_KV_F16, err, sizeof err) == -1;
    ok = ok && gpu->ops->kv_write(gpu->ctx, 0, &f.ts, &bad_pos, 1, f.kw, f.vw) == -1;        /* outside the table */
    ok = ok && gpu->ops->kv_write(gpu->ctx, KV_NL, &f.ts, &bad_pos, 0, f.kw, f.vw) == -1;    /* no such layer */
    const cb_rope_t rope = cb_hparams_rope(&f.hp);
    cb_rope_t rope_bad = rope;
    rope_bad.n_dims = f.hp.head_dim / 2;   /* partial rotary: not taken */
    ok = ok && gpu->ops->kv_load(gpu->ctx, 1, &f.tc, 10 * BT - 5, 6, f.kw, f.vw, CB_KV_F32, &rope) == -1;
    ok = ok && gpu->ops->kv_load(gpu->ctx, 1, &f.tc, 0, 1, f.kw, f.vw, (cb_kv_dtype_t)7, &rope) == -1;
    ok = ok && gpu->ops->kv_load(gpu->ctx, 1, &f.tc, 0, 1, f.kw, f.vw, CB_KV_F32, NULL) == -1;
    ok = ok && gpu->ops->kv_load(gpu->ctx, 1, &f.tc, 0, 1, f.kw, f.vw, CB_KV_F32, &rope_bad) == -1;
    ok = ok && gpu->ops->kv_copy_block(gpu->ctx, KV_NB, 0) == -1 && !cb_backend_cuda_failed(gpu);
    if (!ok) goto out;
    /* kv_read: CPU exact, CUDA one bf16 rounding */
    double rd_max = 0;
    for (int l = 0; l < KV_NL && ok; l++) {
        const cb_kv_table_t *t = l ? &f.tc : &f.ts;
        ok = cpu->ops->kv_read(cpu->ctx, l, t, 0, NK, k1, v1) == 0 && gpu->ops->kv_read(gpu->ctx, l, t, 0, NK, k2, v2) == 0;
        ok = ok && !memcmp(k1, f.kw, sizeof(float) * NK * KVD) && !memcmp(v1, f.vw, sizeof(float) * NK * KVD);
        ok = ok && close_enough("kv_read K", k2, f.kw, NK * KVD, NULL, 4e-3, 1e-7) &&
             close_enough("kv_read V", v2, f.vw, NK * KVD, NULL, 4e-3, 1e-7);
        rd_max = fmax(rd_max, fmax(vmax_diff(k2, f.kw, NK * KVD), vmax_diff(v2, f.vw, NK * KVD)));
    }
    ok = ok && gpu->ops->kv_read(gpu->ctx, 0, &f.ts, 5, 7, NULL, v2) == 0;   /* one half only */
    if (!ok) goto out;
    /* kv_load of pre-RoPE rows at positions 20..89 of layer 1, in each dtype, rotated by the model's RoPE and
     * by a NEOX one with linear scaling and frequency factors (qwen2-like pairing, Llama 3-like factors); read
     * back and compared */
    enum { P0 = 20, NLD = 70 };
    const cb_kv_dtype_t dts[3] = {CB_KV_F32, CB_KV_F16, CB_KV_BF16};
    float kv_ff[16];   /* [head_dim / 2] (be_hp: head_dim 32) */
    for (int i = 0; i < 16; i++) kv_ff[i] = 1.0f + (float)(i % 5);
    cb_rope_t kv_ropes[2] = {rope, rope};
    kv_ropes[1].type = CB_ROPE_NEOX, kv_ropes[1].freq_scale = 0.5f, kv_ropes[1].freq_factors = kv_ff;
    ok = ok && f.hp.head_dim == 32;
    for (int case_i = 0; case_i < 2 * 3 && ok; case_i++) {
        const int ri = case_i / 3, di = case_i % 3;   /* rope, dtype */
        const cb_rope_t *rr = &kv_ropes[ri];
        const void *sk = f.kw, *sv = f.vw;
        if (dts[di] != CB_KV_F32) {
            for (int i = 0; i < NLD * KVD; i++) {
                h16[i] = dts[di] == CB_KV_F16 ? cb_f32_to_f16(f.kw[i]) : bf(f.kw[i]);
                h16[NLD * KVD + i] = dts[di] == CB_KV_F16 ? cb_f32_to_f16(f.vw[i]) : bf(f.vw[i]);
            }
            sk = h16, sv = h16 + NLD * KVD;
        }
        ok = cpu->ops->kv_load(cpu->ctx, 1, &f.tc, P0, NLD, sk, sv, dts[di], rr) == 0 &&
             gpu->ops->kv_load(gpu->ctx, 1, &f.tc, P0, NLD, sk, sv, dts[di], rr) == 0 &&
             cpu->ops->kv_read(cpu->ctx, 1, &f.tc, P0, NLD, k1, v1) == 0 &&
             gpu->ops->kv_read(gpu->ctx, 1, &f.tc, P0, NLD, k2, v2) == 0;
        const int hd = f.hp.head_dim, half = hd / 2;
        for (int i = 0; i < NLD * KVD; i++) {   /* the rotation pair: adjacent (NORM) or half a head away (NEOX) */
            const int partner = rr->type == CB_ROPE_NEOX ? i - i % hd + (i % hd + half) % hd : i ^ 1;
            sc[i] = fabs(k1[i]) + fabs(k1[partner]);
        }
        ok = ok && close_enough("kv_load K", k2, k1, NLD * KVD, sc, 8e-3, 1e-6) &&
             close_enough("kv_load V", v2, v1, NLD * KVD, NULL, 4e-3, 1e-7);
        if (!ok) fprintf(stderr, "  kv_load of dtype %d, rope %s\n", (int)dts[di], ri ? "neox+scaled" : "model");
    }
    /* kv_copy_block: block 5 -> 12 (unused by both tables), every layer; the tables with 12 in 5's place
     * read the same rows, bit for bit on each backend */
    int32_t shuf2[10], cons2[10];
    memcpy(shuf2, g_shuf, sizeof shuf2), memcpy(cons2, g_cons, sizeof cons2);
    shuf2[2] = 12, cons2[5] = 12;
    const cb_kv_table_t ts2 = {shuf2, 10 * BT}, tc2 = {cons2, 10 * BT};
    cb_backend_t *bes[2] = {cpu, gpu};
    for (int bi = 0; bi < 2 && ok; bi++) {
        cb_backend_t *be = bes[bi];
        ok = be->ops->kv_copy_block(be->ctx, 12, 5) == 0;
        for (int l = 0; l < KV_NL && ok; l++) {
            ok = be->ops->kv_read(be->ctx, l, l ? &f.tc : &f.ts, 0, NK, k1, v1) == 0 &&
                 be->ops->kv_read(be->ctx, l, l ? &tc2 : &ts2, 0, NK, k2, v2) == 0 &&
                 !memcmp(k1, k2, sizeof(float) * NK * KVD) && !memcmp(v1, v2, sizeof(float) * NK * KVD);
            if (!ok) fprintf(stderr, "  %s: layer %d differs after kv_copy_block\n", be->ops->name, l);
        }
    }
    ok = ok && !cb_backend_cuda_failed(gpu);
    /* a pool larger than the device: a clear error, and the backend can still make a pool */
    if (ok) {
        cb_backend_t *g2 = cb_backend_cuda_new(&f.hp, 64, 256, 0, err, sizeof err);
        int rc = g2 ? g2->ops->kv_pool_init(g2->ctx, KV_NL, KVD, BT, 100000000, CB_KV_F16, err, sizeof err) : 0; /* 2 x 205 GB */
        int msg_ok = strstr(err, "KV pool") && strstr(err, "out of memory");
        fprintf(stderr, "  oversized pool: %s\n", err);
        int rc2 = g2 ? g2->ops->kv_pool_init(g2->ctx, KV_NL, KVD, BT, KV_NB, CB_KV_F16, err, sizeof err) : -1;
        cb_backend_destroy(&g2);
        ok = rc == -1 && msg_ok && rc2 == 0;
        if (!ok) fprintf(stderr, "  oversized pool: rc %d, then %d: %s\n", rc, rc2, err);
    }
    fprintf(stderr, "  backend pool: kv_read max |d| %.2e\n", rd_max);
out:
    free(k1), free(v1), free(k2), free(v2), free(sc), free(h16);
    kvfix_close(&f);
    CHECK(ok);
}

/* n rows over tables t[i] of one layer: the backend's attention_rows, or one attention call per row (what the
 * engine does where a backend has none; CUDA's is NULL). */
static void rows_attention(cb_backend_t *be, const cb_attn_geom_t *g, const float *q, int n, int layer,
                           const cb_kv_table_t *t, const int32_t *lim, float *out) {
    const int qd = g->n_head * g->head_dim;
    if (be->ops->attention_rows) {
        be->ops->attention_rows(be->ctx, g, q, n, layer, t, lim, out);
        return;
    }
    for (int i = 0; i < n; i++)
        be->ops->attention(be->ctx, g, q + (size_t)i * qd, 1, layer, &t[i], &lim[i], out + (size_t)i * qd);
}

/* Attention, attention_rows and attention mass under a sliding window of w keys (each row over
 * [cb_attn_key_lo, limit)), CUDA against the CPU with the tolerances of test_backend_attention: the shuffled
 * table against the consecutive one (the same bits: both views start at the block of the lowest first key),
 * 3 short rows, rows alternating between two tables of layer 0 (the consecutive table reads layer 0's blocks
 * 0..9, whatever they hold: zeros where the shuffled writes left none), and the mass (exactly 0 below every
 * row's first key; each row and head adds 1). */
static int window_case(kvfix_t *f, const float *q, const int32_t *lim, int w, float *o1, float *o2, float *o3) {
    enum { N = KV_N, QD = KV_QD, NK = KV_NK };
    cb_backend_t *cpu = f->cpu, *gpu = f->gpu;
    cb_attn_geom_t g = {f->hp.n_head, f->hp.n_head_kv, f->hp.head_dim, 1.0f / sqrtf((float)f->hp.head_dim),
                        CB_ATTN_F32, w};
    char what[80];
    cpu->ops->attention(cpu->ctx, &g, q, N, 0, &f->ts, lim, o1);
    gpu->ops->attention(gpu->ctx, &g, q, N, 0, &f->ts, lim, o2);
    gpu->ops->attention(gpu->ctx, &g, q, N, 1, &f->tc, lim, o3);
    snprintf(what, sizeof what, "attention (window %d)", w);
    if (!close_enough(what, o2, o1, N * QD, NULL, 0.0, 3e-2)) return 0;
    if (memcmp(o2, o3, sizeof(float) * N * QD)) {
        fprintf(stderr, "  window %d: attention over the consecutive table differs from the gathered one\n", w);
        return 0;
    }
    const int32_t lim2[3] = {1, 17, 33};
    cpu->ops->attention(cpu->ctx, &g, q, 3, 0, &f->ts, lim2, o1);
    gpu->ops->attention(gpu->ctx, &g, q, 3, 0, &f->ts, lim2, o2);
    snprintf(what, sizeof what, "attention (window %d, 3 rows)", w);
    if (!close_enough(what, o2, o1, 3 * QD, NULL, 0.0, 3e-2)) return 0;
    cb_kv_table_t tr[N];
    int32_t lim3[N];
    for (int i = 0; i < N; i++) tr[i] = i % 2 ? f->tc : f->ts, lim3[i] = 1 + (i * 37) % NK;
    rows_attention(cpu, &g, q, N, 0, tr, lim3, o1);
    rows_attention(gpu, &g, q, N, 0, tr, lim3, o2);
    snprintf(what, sizeof what, "attention_rows (window %d)", w);
    if (!close_enough(what, o2, o1, N * QD, NULL, 0.0, 3e-2)) return 0;
    float m1[NK], m2[NK];
    double sum2 = 0;
    int lo_min = NK;
    for (int i = 0; i < N; i++) lo_min = cb_attn_key_lo(&g, lim[i]) < lo_min ? cb_attn_key_lo(&g, lim[i]) : lo_min;
    for (int j = 0; j < NK; j++) m1[j] = m2[j] = 0.0f;
    if (cpu->ops->attn_mass(cpu->ctx, &g, q, N, 0, &f->ts, lim, m1, NULL) != 0 ||
        gpu->ops->attn_mass(gpu->ctx, &g, q, N, 0, &f->ts, lim, m2, NULL) != 0) {
        fprintf(stderr, "  window %d: attn_mass failed\n", w);
        return 0;
    }
    snprintf(what, sizeof what, "attn_mass (window %d)", w);
    if (!close_enough(what, m2, m1, NK, NULL, 3e-2, 2e-4)) return 0;
    for (int j = 0; j < NK; j++) sum2 += m2[j];
    for (int j = 0; j < lo_min; j++)
        if (m1[j] != 0.0f || m2[j] != 0.0f) {
            fprintf(stderr, "  window %d: attn_mass of key %d below every row's first key %d: cpu %g, cuda %g\n", w, j,
                    lo_min, m1[j], m2[j]);
            return 0;
        }
    if (!(fabs(sum2 - N * f->hp.n_head) <= 1e-3 * N * f->hp.n_head)) {
        fprintf(stderr, "  window %d: attn_mass sums to %g, not %d\n", w, sum2, N * f->hp.n_head);
        return 0;
    }
    return !cb_backend_cuda_failed(gpu);
}

/* Attention and attention mass over the pool: gathered (shuffled table) and in place (consecutive). */
TEST(test_backend_attention) {
    kvfix_t f;
    if (kvfix_open(&f) != 0) {
        kvfix_close(&f);
        CHECK(0);
    }
    enum { N = KV_N, QD = KV_QD, NK = KV_NK };
    cb_backend_t *cpu = f.cpu, *gpu = f.gpu;
    float *q = malloc(sizeof(float) * N * QD), *o1 = malloc(sizeof(float) * N * QD);
    float *o2 = malloc(sizeof(float) * N * QD), *o3 = malloc(sizeof(float) * N * QD);
    int ok = q && o1 && o2 && o3;
    for (int i = 0; ok && i < N * QD; i++) q[i] = frand(1.0f);
    /* rows at positions 130..149 over the layer's keys (exact causal limits), both layers (the same data) */
    int32_t lim[N];
    for (int i = 0; i < N; i++) lim[i] = NK - N + i + 1;
    cb_attn_geom_t g = {f.hp.n_head, f.hp.n_head_kv, f.hp.head_dim, 1.0f / sqrtf((float)f.hp.head_dim), CB_ATTN_F32,
                        0};
    if (ok) {
        cpu->ops->attention(cpu->ctx, &g, q, N, 0, &f.ts, lim, o1);
        gpu->ops->attention(gpu->ctx, &g, q, N, 0, &f.ts, lim, o2);
        gpu->ops->attention(gpu->ctx, &g, q, N, 1, &f.tc, lim, o3);
        ok = close_enough("attention (shuffled table)", o2, o1, N * QD, NULL, 0.0, 3e-2);
        /* the gathered copy and the pool in place give the same bits */
        if (ok && memcmp(o2, o3, sizeof(float) * N * QD)) {
            fprintf(stderr, "  attention over the consecutive table differs from the gathered one\n");
            ok = 0;
        }
    }
    /* a few rows, short limits (decode-like) */
    int32_t lim2[3] = {1, 17, 33};
    if (ok) {
        cpu->ops->attention(cpu->ctx, &g, q, 3, 0, &f.ts, lim2, o1);
        gpu->ops->attention(gpu->ctx, &g, q, 3, 0, &f.ts, lim2, o2);
        ok = close_enough("attention (3 rows)", o2, o1, 3 * QD, NULL, 0.0, 3e-2);
    }
    /* attention mass, accumulated over 0.25; deterministic on a second run */
    float m1[NK], m2[NK], m3[NK], m4[NK];
    for (int j = 0; j < NK; j++) m1[j] = m2[j] = 0.25f, m3[j] = m4[j] = 0.0f;
    double sum2 = 0;
    if (ok) {
        ok = cpu->ops->attn_mass(cpu->ctx, &g, q, N, 0, &f.ts, lim, m1, NULL) == 0 &&
             gpu->ops->attn_mass(gpu->ctx, &g, q, N, 0, &f.ts, lim, m2, NULL) == 0 &&
             gpu->ops->attn_mass(gpu->ctx, &g, q, N, 0, &f.ts, lim, m3, NULL) == 0 &&
             gpu->ops->attn_mass(gpu->ctx, &g, q, N, 1, &f.tc, lim, m4, NULL) == 0;
        for (int j = 0; j < NK; j++) m1[j] -= 0.25f, m2[j] -= 0.25f, sum2 += m2[j];
        ok = ok && close_enough("attn_mass", m2, m1, NK, NULL, 3e-2, 2e-4);
        if (ok && !(fabs(sum2 - N * f.hp.n_head) <= 1e-3 * N * f.hp.n_head)) {
            fprintf(stderr, "  attn_mass sums to %g, not %d\n", sum2, N * f.hp.n_head);
            ok = 0;
        }
        if (ok && memcmp(m3, m4, sizeof m3)) {
            fprintf(stderr, "  attn_mass: the consecutive table (or a second run) gives other bits\n");
            ok = 0;
        }
    }
    ok = ok && !cb_backend_cuda_failed(gpu);
    fprintf(stderr, "  backend attention: attention max |d| %.2e, attn_mass max |d| %.2e (sum %.6f of %d)\n",
            vmax_diff(o1, o2, 3 * QD), vmax_diff(m1, m2, NK), sum2, N * f.hp.n_head);
    /* sliding windows (limits 131..150): 1 key, inside a block of 16, a block, 40, the largest limit, more
     * than any limit; and no window again, through the same paths */
    const int wins[7] = {1, 7, KV_BT, 40, NK, 500, 0};
    for (int wi = 0; wi < 7 && ok; wi++) ok = window_case(&f, q, lim, wins[wi], o1, o2, o3);
    free(q), free(o1), free(o2), free(o3);
    kvfix_close(&f);
    CHECK(ok);
}

/* kv_deviation, topk and compact_rows: host operations on both backends, bit-identical. */
TEST(test_backend_host_ops) {
    cb_hparams_t hp = be_hp();
    char err[256] = "";
    cb_backend_t *cpu = cb_backend_cpu_new(&hp, 64, 256, 2, err, sizeof err);
    CHECK_MSG(cpu != NULL, "%s", err);
    cb_backend_t *gpu = cb_backend_cuda_new(&hp, 64, 256, 0, err, sizeof err);
    if (!gpu) cb_backend_destroy(&cpu);
    CHECK_MSG(gpu != NULL, "%s", err);
    int ok = 1;
    /* kv_deviation: fresh rows against cached rows of each dtype, through shuffled row pointers */
    enum { ND = 12, KVD = KV_D };
    float fresh[ND * KVD], cf[ND * KVD];
    uint16_t c16[ND * KVD], cbf[ND * KVD];
    for (int i = 0; i < ND * KVD; i++) {
        fresh[i] = frand(2.0f);
        cf[i] = fresh[i] + frand(0.3f);
        c16[i] = cb_f32_to_f16(cf[i]);
        cbf[i] = bf(cf[i]);
    }
    c16[5] = 0x0001, c16[6] = 0x83ff, c16[7] = 0x7c00;   /* f16 subnormals and inf */
    const cb_kv_dtype_t dts[3] = {CB_KV_F32, CB_KV_F16, CB_KV_BF16};
    for (int di = 0; di < 3 && ok; di++) {
        const void *rows[ND];
        for (int i = 0; i < ND; i++) {
            int r = (i * 5 + 3) % ND;
            rows[i] = di == 0 ? (const void *)(cf + r * KVD) : di == 1 ? (const void *)(c16 + r * KVD)
                                                                        : (const void *)(cbf + r * KVD);
        }
        double d1[ND], d2[ND];
        ok = cpu->ops->kv_deviation(cpu->ctx, ND, KVD, fresh, rows, dts[di], d1) == 0 &&
             gpu->ops->kv_deviation(gpu->ctx, ND, KVD, fresh, rows, dts[di], d2) == 0 && !memcmp(d1, d2, sizeof d1);
        if (!ok) fprintf(stderr, "  kv_deviation of dtype %d differs from the CPU\n", (int)dts[di]);
    }
    /* topk: ties, NaN, infinities, k beyond n */
    enum { NT = 200 };
    double s[NT];
    for (int i = 0; i < NT; i++) s[i] = (double)(int)(urand() * 9);
    s[3] = NAN, s[77] = NAN, s[100] = INFINITY, s[101] = -INFINITY;
    const int ks[5] = {0, 1, 37, NT, NT + 5};
    for (int ki = 0; ki < 5 && ok; ki++) {
        int32_t a1[NT], a2[NT];
        memset(a1, 0xff, sizeof a1), memset(a2, 0xff, sizeof a2);
        ok = cpu->ops->topk(cpu->ctx, NT, s, ks[ki], a1) == 0 && gpu->ops->topk(gpu->ctx, NT, s, ks[ki], a2) == 0 &&
             !memcmp(a1, a2, sizeof a1);
        if (!ok) fprintf(stderr, "  topk k=%d differs from the CPU\n", ks[ki]);
    }
    /* compact_rows */
    float x1[10 * 7], x2[10 * 7];
    for (int i = 0; i < 70; i++) x1[i] = x2[i] = (float)i;
    const int32_t keep[5] = {0, 2, 3, 7, 9};
    cpu->ops->compact_rows(cpu->ctx, x1, 7, keep, 5);
    gpu->ops->compact_rows(gpu->ctx, x2, 7, keep, 5);
    ok = ok && !memcmp(x1, x2, sizeof x1) && x2[7] == 14.0f && x2[4 * 7 + 6] == 69.0f;
    ok = ok && !cb_backend_cuda_failed(gpu);
    cb_backend_destroy(&gpu);
    cb_backend_destroy(&cpu);
    CHECK(ok);
}

/* ---------------------------------------------------------------- whole forwards */

static cb_model_t *g_model;
static cb_cuda_llama_t *g_llama;
static char g_path[128];

/* A synthetic SmolLM2-shaped bf16 model, loaded on both backends (the GPU gets the file's tensors). */
static int setup_models(void) {
    if (g_llama) return 0;
    cb_synth_shape_t s;
    char err[512] = "";
    cb_synth_shape_named("smollm2-135m", &s);
    snprintf(g_path, sizeof g_path, "/tmp/cb_test_gpu_%d.gguf", (int)getpid());
    if (cb_synth_write(g_path, &s, CB_SYNTH_BF16, 42, err, sizeof err) != 0) goto fail;
    g_model = cb_model_load(g_path, err, sizeof err);
    unlink(g_path);
    if (!g_model) goto fail;
    const cb_hparams_t *hp = cb_model_hparams(g_model);
    cb_cuda_llama_hp_t ch = {hp->n_layer, hp->n_embd, hp->n_head, hp->n_head_kv, hp->head_dim, hp->n_ff, hp->n_vocab,
                             hp->rope_base, hp->rms_eps, hp->tied_output};
    g_llama = cb_cuda_llama_new(cu, &ch, 2048, 512, err, sizeof err);
    if (!g_llama) goto fail;
    int rc = 0;
    const cb_weight_t *w = cb_model_tok_embd(g_model);
    rc |= cb_cuda_llama_upload(g_llama, -1, CB_CL_TOKEN_EMBD, w->type, w->q);
    if (!hp->tied_output) rc |= cb_cuda_llama_upload(g_llama, -1, CB_CL_OUTPUT, cb_model_output(g_model)->type, cb_model_output(g_model)->q);
    rc |= cb_cuda_llama_upload(g_llama, -1, CB_CL_OUTPUT_NORM, CB_TYPE_F32, cb_model_output_norm(g_model));
    for (int l = 0; l < hp->n_layer && !rc; l++) {
        const cb_layer_weights_t *L = cb_model_layer(g_model, l);
        rc |= cb_cuda_llama_upload(g_llama, l, CB_CL_ATTN_NORM, CB_TYPE_F32, L->attn_norm);
        rc |= cb_cuda_llama_upload(g_llama, l, CB_CL_FFN_NORM, CB_TYPE_F32, L->ffn_norm);
        rc |= cb_cuda_llama_upload(g_llama, l, CB_CL_Q, L->wq.type, L->wq.q);
        rc |= cb_cuda_llama_upload(g_llama, l, CB_CL_K, L->wk.type, L->wk.q);
        rc |= cb_cuda_llama_upload(g_llama, l, CB_CL_V, L->wv.type, L->wv.q);
        rc |= cb_cuda_llama_upload(g_llama, l, CB_CL_O, L->wo.type, L->wo.q);
        rc |= cb_cuda_llama_upload(g_llama, l, CB_CL_GATE, L->w_gate.type, L->w_gate.q);
        rc |= cb_cuda_llama_upload(g_llama, l, CB_CL_UP, L->w_up.type, L->w_up.q);
        rc |= cb_cuda_llama_upload(g_llama, l, CB_CL_DOWN, L->w_down.type, L->w_down.q);
    }
    if (rc) {
        snprintf(err, sizeof err, "upload: %s", cb_cuda_error(cu));
        goto fail;
    }
    return 0;
fail:
    fprintf(stderr, "  model setup: %s\n", err);
    return -1;
}

static int argmax_f(const float *x, int n, float *gap) {
    int b = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[b]) b = i;
    float second = -INFINITY;
    for (int i = 0; i < n; i++) if (i != b && x[i] > second) second = x[i];
    *gap = x[b] - second;
    return b;
}

/* rms(a - b) / std(b), max|a - b| / std(b), and max|a - b| itself */
static double g_abs_max;
static void logit_diff(const float *a, const float *b, int n, double *rel_rms, double *rel_max) {
    double mean = 0, var = 0, d2 = 0, dm = 0;
    for (int i = 0; i < n; i++) mean += b[i];
    mean /= n;
    for (int i = 0; i < n; i++) {
        var += (b[i] - mean) * (b[i] - mean);
        d2 += (double)(a[i] - b[i]) * (a[i] - b[i]);
        dm = fmax(dm, fabs(a[i] - b[i]));
    }
    double sd = sqrt(var / n);
    g_abs_max = dm;
    *rel_rms = sqrt(d2 / n) / sd;
    *rel_max = dm / sd;
}

TEST(test_forward_vs_cpu) {
    if (setup_models() != 0) CHECK(0);
    const cb_hparams_t *hp = cb_model_hparams(g_model);
    const int V = hp->n_vocab, N = 120, STEPS = 16;
    char err[256] = "";
    cb_backend_set_default_kind(CB_BACKEND_CPU);
    cb_engine_t *e = cb_engine_new(g_model, 512, err, sizeof err);
    CHECK_MSG(e != NULL, "%s", err);
    cb_seq_t *seq = cb_seq_new(e);
    CHECK(seq != NULL);
    int32_t tok[N];
    for (int i = 0; i < N; i++) tok[i] = 3 + (int32_t)(urand() * (V - 3));
    float *lc = malloc(sizeof(float) * V), *lg = malloc(sizeof(float) * V);
    int32_t *dtok = cb_cuda_llama_tokens(g_llama), *dnext = cb_cuda_malloc(cu, 8), *dpos = dnext + 1;
    CHECK(lc && lg && dnext);
    CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dtok, tok, sizeof tok) == 0);
    CHECK_MSG(cb_cuda_llama_prefill(g_llama, dtok, N, 0, NULL, NULL, dnext) == 0, "%s", cb_cuda_error(cu));
    CHECK(cb_engine_prefill(e, seq, tok, N, 0, lc) == 0);
    int32_t pos = N;
    CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dpos, &pos, 4) == 0);
    double worst_rms = 0, worst_max = 0;
    int ties = 0;
    for (int s = 0; s < STEPS; s++) {
        int32_t gt;
        CHECK(get(lg, cb_cuda_llama_logits(g_llama), sizeof(float) * V) == 0 && get(&gt, dnext, 4) == 0);
        double rr, rm;
        logit_diff(lg, lc, V, &rr, &rm);
        worst_rms = fmax(worst_rms, rr), worst_max = fmax(worst_max, rm);
        float gap;
        int ct = argmax_f(lc, V, &gap);
        CHECK_MSG(rr <= 0.06, "step %d: logits differ by %.3f std (rms)", s, rr);
        if (gt != ct) {
            /* a tie within the observed error (the CPU's top two closer than twice the largest logit
             * difference): a justified difference; the sequences part here, so stop comparing */
            CHECK_MSG(gap <= 2.0 * g_abs_max, "step %d: GPU token %d vs CPU %d (CPU gap %.4f, max diff %.4f)", s, gt,
                      ct, gap, g_abs_max);
            ties++;
            fprintf(stderr, "  step %d: tie between tokens %d and %d (CPU gap %.4f)\n", s, gt, ct, gap);
            break;
        }
        if (s + 1 == STEPS) break;
        CHECK(cb_engine_decode(e, seq, ct, N + s, lc) == 0);
        CHECK_MSG(cb_cuda_llama_decode(g_llama, dnext, dpos, N + s + 1, 0.0f, 0.0f, NULL) == 0, "%s", cb_cuda_error(cu));
    }
    fprintf(stderr, "  forward vs CPU: logits rms %.4f, max %.4f (in CPU logit std), ties %d\n", worst_rms, worst_max, ties);
    cb_seq_destroy(&seq);
    cb_engine_destroy(&e);
    cb_cuda_free(cu, dnext);
    free(lc), free(lg);
}

/* ---------------------------------------------------------------- one CacheBlend, two backends */

/* The cross-backend test of the one CacheBlend (libshared/blend): a small synthetic model with bf16
 * weights (both backends compute with the very same weights; 6 layers, 384 wide, 6/2 heads of 64 so the
 * CUDA flash and split-K kernels run, GQA 3), two engines over it, one CPU and one CUDA, each with its own
 * chunk store and memory tier (so each backend also computes its own chunk KV), and the same prompt
 * (prefix 24 + 4 chunks of 96 + suffix 24 tokens) through every mode: full, prefix, reuse, blend with the
 * default metric ('a') and blend with metric 'v'. Compared per mode:
 *   - the counts (rows, candidates, forced, recomputed) must be equal: they follow from the row classes;
 *   - the selected rows: equal for full, prefix and reuse (fixed by the classes); for blend the two
 *     backends rank scores computed in bf16 vs f32, so a row near the cut-off can change places, and the
 *     overlap |CPU ∩ CUDA| / |CPU| (reported) must be >= 0.9 for metric 'a' (sums of attention
 *     probabilities: ~1e-3 relative noise) and >= 0.8 for metric 'v' (a squared difference of fresh and
 *     cached V, both sides carrying their own bf16 noise on CUDA: a few percent at the cut-off);
 *   - the logits: the CUDA backend rounds activations to bf16 (~2^-9 relative per rounding, ~7 per layer:
 *     a random walk of ~sqrt(42) * 2e-3 ~ 1.3 % over 6 layers), so rms(d) / std(CPU logits) <= 0.06 and
 *     max|d| <= 0.1 * (max - min of the CPU logits); 0.10 rms when the selected rows differ;
 *   - greedy decoding of 4 tokens after the prefill (cb_engine_decode on the blended sequence): the same
 *     tokens, unless the CPU's top two logits are closer than twice the largest logit difference seen (a
 *     tie within the error, reported; the comparison stops there). */
typedef struct {
    cb_engine_t *e;
    cb_kvmem_t *mem;
    cb_kvstore_t *store;
    cb_blend_t *b;
    cb_seq_t *seq;
} xb_side_t;

static void xb_close(xb_side_t *x) {
    cb_seq_destroy(&x->seq);
    cb_blend_destroy(&x->b);
    cb_kvstore_destroy(&x->store);
    cb_kvmem_destroy(&x->mem);
    cb_engine_destroy(&x->e);
}

static int xb_open(xb_side_t *x, const cb_model_t *m, cb_backend_kind_t kind, char *err, size_t errlen) {
    memset(x, 0, sizeof *x);
    cb_backend_set_default_kind(kind);
    x->e = cb_engine_new(m, 1024, err, errlen);
    if (!x->e) return -1;
    const char *want = kind == CB_BACKEND_CUDA ? "cuda" : "cpu";
    if (strcmp(cb_engine_backend_name(x->e), want) != 0) {
        snprintf(err, errlen, "engine got backend %s, not %s", cb_engine_backend_name(x->e), want);
        return -1;
    }
    if (!(x->mem = cb_kvmem_new((size_t)256 << 20))) {
        snprintf(err, errlen, "memory tier: out of memory");
        return -1;
    }
    if (!(x->store = cb_kvstore_new(x->e, NULL, x->mem, CB_KV_F16, err, errlen))) return -1;
    if (!(x->b = cb_blend_new(x->store, err, errlen))) return -1;
    if (!(x->seq = cb_seq_new(x->e))) {
        snprintf(err, errlen, "no sequence");
        return -1;
    }
    return 0;
}

static cb_model_t *xb_model(cb_synth_arch_t arch, char *err, size_t errlen) {
    cb_synth_shape_t s;
    memset(&s, 0, sizeof s);
    snprintf(s.name, sizeof s.name, "test-gpu-blend");
    s.arch = arch;
    s.n_layer = 6, s.n_embd = 384, s.n_head = 6, s.n_head_kv = 2, s.n_ff = 1024, s.n_vocab = 4096;
    s.n_ctx = 2048, s.rope_base = 10000.0f, s.rms_eps = 1e-5f, s.tied = true;
    char path[128];
    snprintf(path, sizeof path, "/tmp/cb_test_gpu_blend_%d.gguf", (int)getpid());
    cb_model_t *m = NULL;
    if (cb_synth_write(path, &s, CB_SYNTH_BF16, 7, err, errlen) == 0) m = cb_model_load(path, err, errlen);
    unlink(path);
    return m;
}

/* |a ∩ b| of two ascending lists */
static int overlap(const int32_t *a, int na, const int32_t *b, int nb) {
    int i = 0, j = 0, n = 0;
    while (i < na && j < nb) {
        if (a[i] == b[j]) n++, i++, j++;
        else if (a[i] < b[j]) i++;
        else j++;
    }
    return n;
}

/* Every blend mode on the CPU and on CUDA over one synthetic model of architecture arch. */
static void blend_backends(cb_synth_arch_t arch) {
    char err[256] = "";
    static const char *arch_names[] = {"llama", "llama3", "qwen2", "qwen3", "mistral", "gemma3"};
    fprintf(stderr, "  %s:\n", arch_names[arch]);
    cb_model_t *m = xb_model(arch, err, sizeof err);
    CHECK_MSG(m != NULL, "model: %s", err);
    xb_side_t cpu, gpu;
    memset(&gpu, 0, sizeof gpu);
    if (xb_open(&cpu, m, CB_BACKEND_CPU, err, sizeof err) != 0 || xb_open(&gpu, m, CB_BACKEND_CUDA, err, sizeof err) != 0) {
        xb_close(&cpu), xb_close(&gpu);
        cb_model_destroy(&m);
        CHECK_MSG(0, "setup: %s", err);
    }
    enum { NP = 24, NCH = 4, NC = 96, NS = 24, NT = NP + NCH * NC + NS, STEPS = 4 };
    const int V = cb_model_hparams(m)->n_vocab;
    int32_t prefix[NP], chunks[NCH][NC], suffix[NS];
    cb_blend_chunk_t ch[NCH];
    for (int i = 0; i < NP; i++) prefix[i] = 3 + (int32_t)(urand() * (V - 3));
    for (int c = 0; c < NCH; c++) {
        for (int i = 0; i < NC; i++) chunks[c][i] = 3 + (int32_t)(urand() * (V - 3));
        ch[c].tokens = chunks[c], ch[c].n = NC;
    }
    for (int i = 0; i < NS; i++) suffix[i] = 3 + (int32_t)(urand() * (V - 3));
    float *lc = malloc(sizeof(float) * V), *lg = malloc(sizeof(float) * V);
    int32_t *selc = malloc(sizeof(int32_t) * NT);
    CHECK(lc && lg && selc);
    const struct { cb_blend_mode_t mode; char metric; } cases[] = {
        {CB_BLEND_FULL, 0}, {CB_BLEND_PREFIX, 0}, {CB_BLEND_REUSE, 0}, {CB_BLEND_BLEND, 0}, {CB_BLEND_BLEND, 'v'}};
    int failed = 0;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0] && !failed; ci++) {
        cb_blend_opts_t o;
        cb_blend_opts_default(&o);
        o.mode = cases[ci].mode;
        if (cases[ci].metric) o.metric = cases[ci].metric;
        cb_blend_stats_t sc, sg;
        memset(&sc, 0, sizeof sc), memset(&sg, 0, sizeof sg);
        int rc = cb_blend_prefill(cpu.b, cpu.seq, prefix, NP, ch, NCH, suffix, NS, &o, lc, &sc, err, sizeof err);
        if (rc) { fprintf(stderr, "  cpu %s: %s\n", cb_blend_mode_str(o.mode), err); failed = 1; break; }
        memcpy(selc, sc.selected, sizeof(int32_t) * (size_t)sc.tokens_recomputed);
        rc = cb_blend_prefill(gpu.b, gpu.seq, prefix, NP, ch, NCH, suffix, NS, &o, lg, &sg, err, sizeof err);
        if (rc) { fprintf(stderr, "  cuda %s: %s\n", cb_blend_mode_str(o.mode), err); failed = 1; break; }
        char name[32];
        snprintf(name, sizeof name, "%s%s%c", cb_blend_mode_str(o.mode), o.mode == CB_BLEND_BLEND ? " metric " : "",
                 o.mode == CB_BLEND_BLEND ? o.metric : ' ');
        /* counts */
        if (sc.n_tokens != NT || sg.n_tokens != NT || sc.tokens_recomputed != sg.tokens_recomputed ||
            sc.n_candidates != sg.n_candidates || sc.n_forced != sg.n_forced) {
            fprintf(stderr, "  %s: counts differ: rows %d/%d, recomputed %d/%d, candidates %d/%d, forced %d/%d\n", name,
                    sc.n_tokens, sg.n_tokens, sc.tokens_recomputed, sg.tokens_recomputed, sc.n_candidates,
                    sg.n_candidates, sc.n_forced, sg.n_forced);
            failed = 1;
            break;
        }
        /* selected rows */
        const int nsel = sc.tokens_recomputed, ov = overlap(selc, nsel, sg.selected, nsel);
        const double frac = nsel ? (double)ov / nsel : 1.0;
        const bool exact_classes = o.mode != CB_BLEND_BLEND;
        const double min_frac = o.metric == 'a' ? 0.9 : 0.8;
        if (exact_classes ? ov != nsel : frac < min_frac) {
            fprintf(stderr, "  %s: selected rows overlap %d of %d (%.3f)\n", name, ov, nsel, frac);
            failed = 1;
            break;
        }
        /* logits */
        double rr, rm, lo = lc[0], hi = lc[0];
        for (int i = 1; i < V; i++) lo = fmin(lo, lc[i]), hi = fmax(hi, lc[i]);
        logit_diff(lg, lc, V, &rr, &rm);
        const double rms_tol = ov == nsel ? 0.06 : 0.10;
        if (!(rr <= rms_tol) || !(g_abs_max <= 0.1 * (hi - lo))) {
            fprintf(stderr, "  %s: logits differ: rms %.4f std (tolerance %.2f), max %.4f of a range %.3f\n", name, rr,
                    rms_tol, g_abs_max, hi - lo);
            failed = 1;
            break;
        }
        const double first_rr = rr, first_max = g_abs_max;
        /* greedy decode on both blended sequences */
        int agree = 0, tie = 0;
        for (int st = 0; st < STEPS; st++) {
            float gap, gap_g;
            const int tc = argmax_f(lc, V, &gap), tg = argmax_f(lg, V, &gap_g);
            if (tc != tg) {
                if (gap <= 2.0 * g_abs_max) {
                    tie = 1;
                    fprintf(stderr, "  %s: step %d: tie between tokens %d and %d (CPU gap %.4f)\n", name, st, tc, tg, gap);
                    break;
                }
                fprintf(stderr, "  %s: step %d: CUDA token %d vs CPU %d (CPU gap %.4f, max diff %.4f)\n", name, st, tg,
                        tc, gap, g_abs_max);
                failed = 1;
                break;
            }
            agree++;
            if (st + 1 == STEPS) break;
            if (cb_engine_decode(cpu.e, cpu.seq, tc, NT + st, lc) != 0 ||
                cb_engine_decode(gpu.e, gpu.seq, tg, NT + st, lg) != 0) {
                fprintf(stderr, "  %s: decode failed\n", name);
                failed = 1;
                break;
            }
            logit_diff(lg, lc, V, &rr, &rm);
        }
        fprintf(stderr, "  %-16s %3d rows recomputed, selected overlap %.3f, logits rms %.4f std, max %.4f (range %.2f),"
                        " %d/%d greedy tokens agree%s\n", name, nsel, frac, first_rr, first_max, hi - lo, agree, STEPS,
                tie ? " (then a tie)" : "");
    }
    free(lc), free(lg), free(selc);
    xb_close(&gpu);
    xb_close(&cpu);
    cb_model_destroy(&m);
    CHECK(!failed);
}

/* ... for every architecture the engine runs (biases, NEOX RoPE, Q/K norms, rope_freqs, a SentencePiece
 * vocabulary, and gemma3's GeGLU, scaled embeddings, extra norms and sliding-window layers on the GPU). */
TEST(test_blend_backends) {
    const cb_synth_arch_t archs[] = {CB_SYNTH_LLAMA, CB_SYNTH_LLAMA3, CB_SYNTH_QWEN2, CB_SYNTH_QWEN3,
                                     CB_SYNTH_MISTRAL, CB_SYNTH_GEMMA3};
    for (size_t i = 0; i < sizeof archs / sizeof archs[0] && !test_failed_; i++) blend_backends(archs[i]);
}

/* Decode captured as a graph replays exactly what the direct calls compute. */
TEST(test_decode_graph) {
    if (setup_models() != 0) CHECK(0);
    enum { N = 50, STEPS = 8 };
    const int V = cb_cuda_llama_hparams(g_llama)->n_vocab;
    int32_t tok[N], direct[STEPS], graphed[STEPS];
    for (int i = 0; i < N; i++) tok[i] = 3 + (int32_t)(urand() * (V - 3));
    int32_t *dtok = cb_cuda_llama_tokens(g_llama), *dst = cb_cuda_malloc(cu, 8), *dpos = dst + 1;
    CHECK(dst != NULL);
    for (int pass = 0; pass < 2; pass++) {
        CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dtok, tok, sizeof tok) == 0);
        CHECK(cb_cuda_llama_prefill(g_llama, dtok, N, 0, NULL, NULL, dst) == 0);
        int32_t p = N;
        CHECK(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, dpos, &p, 4) == 0 && cb_cuda_sync(cu) == 0);
        cb_cuda_graph_t *g = NULL;
        if (pass) {
            CHECK(cb_cuda_graph_begin(cu) == 0);
            int rc = cb_cuda_llama_decode(g_llama, dst, dpos, 2048, 0.0f, 0.0f, NULL);
            g = cb_cuda_graph_end(cu);
            CHECK_MSG(rc == 0 && g != NULL, "capture: %s", cb_cuda_error(cu));
        }
        for (int s = 0; s < STEPS; s++) {
            if (pass) CHECK(cb_cuda_graph_launch(cu, g) == 0);
            else CHECK(cb_cuda_llama_decode(g_llama, dst, dpos, 2048, 0.0f, 0.0f, NULL) == 0);
            CHECK(get(pass ? &graphed[s] : &direct[s], dst, 4) == 0);
        }
        cb_cuda_graph_destroy(&g);
    }
    CHECK(!memcmp(direct, graphed, sizeof direct));
    cb_cuda_free(cu, dst);
}

int main(void) {
    int n = cb_cuda_device_count();
    if (n <= 0) {
        printf("skip tests/gpu/test_gpu.c:all (no CUDA device)\n");
        return 0;
    }
    char err[512] = "";
    cu = cb_cuda_new(0, err, sizeof err);
    if (!cu) {
        printf("FAIL tests/gpu/test_gpu.c:setup (%s)\n", err);
        return 1;
    }
    fprintf(stderr, "device: %s\n", cb_cuda_device_name(cu));
    RUN(test_dequant);
    RUN(test_gemm);
    RUN(test_embed_norm_swiglu_add);
    RUN(test_rope);
    RUN(test_copy_rows_deviation);
    RUN(test_topk);
    RUN(test_attention);
    RUN(test_causal_limit);
    RUN(test_window_limit);
    RUN(test_sampling);
    RUN(test_oom);
    RUN(test_kvpool);
    RUN(test_streams_and_graph);
    RUN(test_synth_fill);
    RUN(test_attn_mass);
    RUN(test_backend_ops);
    RUN(test_backend_matmul_pieces);
    RUN(test_backend_pool);
    RUN(test_backend_attention);
    RUN(test_backend_host_ops);
    RUN(test_forward_vs_cpu);
    RUN(test_blend_backends);
    RUN(test_decode_graph);
    cb_cuda_llama_destroy(&g_llama);
    cb_model_destroy(&g_model);
    cb_cuda_destroy(&cu);
    return test_summary();
}
#endif
