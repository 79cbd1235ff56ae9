/* test_qmatmul: the integer kernels of kernels/cpu/cpu_quant.c (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K weights x int8
 * activations), every code path this CPU runs (scalar always; avx2, avxvnni, avx512 when present), on random
 * blocks and on the real model's tensors when the model file is there.
 *
 * Per output y[r][o] three checks, with these tolerances:
 *   1. the kernel against the same quantized product evaluated exactly (double): sum_j w_j * d_b q_j with w_j
 *      the exactly dequantized weight (cb_dequant) and d_b, q_j read back from the activation buffer. Only
 *      f32 rounding separates them: each block's scale term and min term (w_j = a_j + c_j, c_j the value of a
 *      zero quant: Q4_1's m, Q4_K's -dmin mn, which the kernels add separately) and the running sum round a
 *      few times (relative 2^-24 each), so |y - exact| <= 4 nb 2^-24 sum_j (|w_j| + |c_j|) |d_b q_j| (+1e-30).
 *      Anything wrong in a layout (a nibble order, a permute, a scale lane) is an O(1) relative error.
 *   2. against the f32 reference (f32 activations, exactly dequantized weights): the only difference is the
 *      activation rounding |x_j - d_b q_j| <= d_b / 2, so |y - sum_j w_j x_j| <= sum_b d_b / 2 * sum_{j in b}
 *      |w_j| (a rigorous bound), plus the f32 slack of check 1. The test also reports the measured RMS error
 *      against that bound (it is far below: the rounding errors are independent and cancel).
 *   3. row-exactness: row r computed in a call of n rows (1..19, so 1..3 passes of 8) is the same bits as
 *      row r alone, and the threaded driver (cb_cpu_qmatmul, several parts) gives the same bits as one-part,
 *      one-thread calls.
 * Also: the quantization is the same bits on every path (the SIMD quantizer against the scalar one), so check 1
 * on each path also bounds the paths' differences (twice its slack); zero, tiny and huge activation blocks.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu_quant.h"
#include "format/gguf.h"
#include "format/quant.h"
#include "model/model.h"
#include "test.h"

static uint32_t g_rng = 7;
static uint32_t rnd(void) {
    g_rng = g_rng * 1664525u + 1013904223u;
    return g_rng >> 8;
}
static float frnd(void) { return (float)(rnd() & 0xFFFFFF) / 16777216.0f * 2.0f - 1.0f; }

static size_t block_bytes(uint32_t t) { return cb_type_block_bytes(t); }
static size_t block_elems(uint32_t t) { return cb_type_block_elems(t); }

static void put_f16(uint8_t *p, float v) {
    uint16_t h = cb_f32_to_f16(v);
    memcpy(p, &h, 2);
}

/* A random weight of type t, rows x cols: random quants, scales of realistic size (all finite). */
static uint8_t *random_weight(cb_weight_t *w, uint32_t t, int rows, int cols) {
    const size_t nb = (size_t)rows * cols / block_elems(t), bb = block_bytes(t);
    uint8_t *buf = malloc(nb * bb);
    for (size_t b = 0; b < nb; b++) {
        uint8_t *p = buf + b * bb;
        for (size_t j = 0; j < bb; j++) p[j] = (uint8_t)rnd();
        switch (t) {
        case CB_TYPE_Q4_0: put_f16(p, 0.002f + 0.02f * fabsf(frnd())); break;
        case CB_TYPE_Q4_1: put_f16(p, 0.002f + 0.02f * fabsf(frnd())); put_f16(p + 2, -0.15f * fabsf(frnd())); break;
        case CB_TYPE_Q8_0: put_f16(p, 0.0002f + 0.002f * fabsf(frnd())); break;
        case CB_TYPE_Q4_K: put_f16(p, 0.0005f + 0.002f * fabsf(frnd())); put_f16(p + 2, 0.0005f + 0.002f * fabsf(frnd())); break;
        case CB_TYPE_Q6_K: put_f16(p + 208, 0.0002f + 0.002f * fabsf(frnd())); break;
        }
    }
    *w = (cb_weight_t){.name = "w", .type = t, .q = buf, .row_bytes = (size_t)cols / block_elems(t) * bb, .rows = rows,
                       .cols = cols};
    return buf;
}

/* Activations: per block a random magnitude over 6 decades, one all-zero block, one block with one outlier. */
static void random_x(float *x, int n, int cols) {
    for (int r = 0; r < n; r++)
        for (int b = 0; b < cols / 32; b++) {
            float *xb = x + (size_t)r * cols + 32 * b;
            const float mag = powf(10.0f, -3.0f + 6.0f * (float)(rnd() % 1000) / 1000.0f);
            for (int j = 0; j < 32; j++) xb[j] = frnd() * mag;
            if ((r + b) % 7 == 3) memset(xb, 0, 32 * sizeof(float));
            if ((r + b) % 5 == 1) xb[rnd() % 32] = 1000.0f * mag;
        }
}

/* Quant j of activation row r (reconstructed from the group buffer): d_b and q_j. */
static void act_elem(const cb_q8_group_t *a, int ga, int r, int j, double *d, int *q) {
    const cb_q8_group_t *G = a + (size_t)r * ga + j / 128;
    const int b = (j / 32) % 4, e = j % 32;
    *d = G->dl[4 * b];
    *q = G->qs[(e < 16 ? 0 : 64) + 16 * b + e % 16];
}

typedef struct {
    double worst1, worst2_ratio, rms_ratio; /* check 1 error / slack, check 2 error / bound, RMS error / RMS bound */
    int failed;
} stats_t;

/* The value of a zero quant of every element (c_j above): w's blocks with their quant bytes zeroed, dequantized.
 * wz [rows][cols]. */
static void zero_quant_values(const cb_weight_t *w, float *wz) {
    const size_t nb = (size_t)w->rows * w->cols / block_elems(w->type), bb = block_bytes(w->type);
    uint8_t *z = malloc(nb * bb);
    memcpy(z, w->q, nb * bb);
    size_t q0 = 0, q1 = 0; /* quant bytes [q0, q1) of a block */
    switch (w->type) {
    case CB_TYPE_Q4_0: q0 = 2, q1 = 18; break;
    case CB_TYPE_Q4_1: q0 = 4, q1 = 20; break;
    case CB_TYPE_Q8_0: q0 = 2, q1 = 34; break;
    case CB_TYPE_Q4_K: q0 = 16, q1 = 144; break;
    case CB_TYPE_Q6_K: q0 = 0, q1 = 192; break;
    }
    for (size_t b = 0; b < nb; b++) memset(z + b * bb + q0, 0, q1 - q0);
    if (!cb_dequant(w->type, z, wz, (size_t)w->rows * w->cols)) memset(wz, 0, sizeof(float) * (size_t)w->rows * w->cols);
    free(z);
}

/* Checks 1 and 2 on y [n][rows] computed from x with act (path isa); wd: the dequantized weight [rows][cols]. */
static void check_outputs(const cb_weight_t *w, const float *wd, const float *x, const cb_q8_group_t *a, int n,
                          const float *y, stats_t *st, const char *what) {
    float *wz = malloc(sizeof(float) * (size_t)w->rows * w->cols);
    zero_quant_values(w, wz);
    const int cols = w->cols, ga = cb_q8_groups(cols), nb = cols / 32;
    double se = 0, sb = 0;
    for (int r = 0; r < n; r++)
        for (int o = 0; o < w->rows; o++) {
            const float *wr = wd + (size_t)o * cols, *zr = wz + (size_t)o * cols;
            const float *xr = x + (size_t)r * cols;
            double exact = 0, mag = 0, ref = 0, bound = 0;
            for (int b = 0; b < nb; b++) {
                double d = 0, wabs = 0;
                int q;
                for (int j = 32 * b; j < 32 * b + 32; j++) {
                    act_elem(a, ga, r, j, &d, &q);
                    exact += (double)wr[j] * d * q;
                    mag += (fabs((double)wr[j]) + fabs((double)zr[j])) * fabs(d * q);
                    ref += (double)wr[j] * xr[j];
                    wabs += fabs((double)wr[j]);
                }
                bound += d / 2 * wabs;
            }
            const double slack = 4.0 * nb * ldexp(1.0, -24) * mag + 1e-30;
            const double e1 = fabs(y[(size_t)r * w->rows + o] - exact), e2 = fabs(y[(size_t)r * w->rows + o] - ref);
            st->worst1 = fmax(st->worst1, e1 / slack);
            if (bound > 0) st->worst2_ratio = fmax(st->worst2_ratio, e2 / (bound + slack));
            se += (ref - exact) * (ref - exact), sb += bound * bound;
            if (e1 > slack || e2 > bound + slack) {
                if (st->failed < 5)
                    fprintf(stderr, "  %s: y[%d][%d] = %.9g, exact %.9g (|d| %.3g, slack %.3g), f32 ref %.9g (|d| %.3g, bound %.3g)\n",
                            what, r, o, y[(size_t)r * w->rows + o], exact, e1, slack, ref, e2, bound);
                st->failed++;
            }
        }
    if (sb > 0) st->rms_ratio = fmax(st->rms_ratio, sqrt(se / sb));
    free(wz);
}

static const uint32_t TYPES[] = {CB_TYPE_Q4_0, CB_TYPE_Q4_1, CB_TYPE_Q8_0, CB_TYPE_Q4_K, CB_TYPE_Q6_K};

/* One weight type and shape on every path: checks 1-3 and the quantization equal across paths. */
static int check_shape(uint32_t t, int rows, int cols, int n) {
    cb_weight_t w;
    uint8_t *buf = random_weight(&w, t, rows, cols);
    const int ga = cb_q8_groups(cols);
    float *wd = malloc(sizeof(float) * (size_t)rows * cols), *x = malloc(sizeof(float) * (size_t)n * cols);
    float *y = malloc(sizeof(float) * (size_t)n * rows), *y1 = malloc(sizeof(float) * rows);
    cb_q8_group_t *a = aligned_alloc(64, sizeof(cb_q8_group_t) * (size_t)n * ga);
    cb_q8_group_t *as = aligned_alloc(64, sizeof(cb_q8_group_t) * (size_t)n * ga);
    int ok = cb_dequant(t, buf, wd, (size_t)rows * cols);
    random_x(x, n, cols);
    char what[96];
    /* the scalar quantization: every path's must be the same bits */
    cb_cpu_q8_quantize(CB_CPU_ISA_SCALAR, t, x, n, cols, as, NULL);
    for (int isa = CB_CPU_ISA_SCALAR; isa <= CB_CPU_ISA_AVX512 && ok; isa++) {
        if (!cb_cpu_isa_supported((cb_cpu_isa_t)isa)) continue;
        snprintf(what, sizeof what, "%s %dx%d n=%d %s", cb_type_name(t), rows, cols, n, cb_cpu_isa_name((cb_cpu_isa_t)isa));
        cb_cpu_q8_quantize((cb_cpu_isa_t)isa, t, x, n, cols, a, NULL);
        for (size_t g = 0; g < (size_t)n * ga && ok; g++) { /* the same quantization on every path */
            const int same_il = t != CB_TYPE_Q8_0 || (isa >= CB_CPU_ISA_AVXVNNI) == 0;
            if (memcmp(a[g].qs, as[g].qs, 128) || memcmp(a[g].dl, as[g].dl, 64) || memcmp(a[g].ml, as[g].ml, 64) ||
                (same_il && memcmp(a[g].il, as[g].il, 128))) {
                fprintf(stderr, "  %s: group %zu quantized differently from the scalar path\n", what, g);
                ok = 0;
            }
        }
        cb_cpu_qdot((cb_cpu_isa_t)isa, &w, a, n, y, rows, 0, rows);
        stats_t st = {0};
        check_outputs(&w, wd, x, a, n, y, &st, what);
        ok &= st.failed == 0;
        for (int r = 0; r < n && ok; r++) { /* 3: alone = in the batch, bit for bit */
            cb_cpu_qdot((cb_cpu_isa_t)isa, &w, a + (size_t)r * ga, 1, y1, rows, 0, rows);
            if (memcmp(y1, y + (size_t)r * rows, sizeof(float) * rows)) {
                fprintf(stderr, "  %s: row %d alone differs from the batch\n", what, r);
                ok = 0;
            }
        }
        if (n >= 8 && ok)
            fprintf(stderr, "  %-34s worst |y - exact| / slack %.3f, |y - f32| / bound %.3f, RMS error / RMS bound %.4f\n",
                    what, st.worst1, st.worst2_ratio, st.rms_ratio);
    }
    free(buf); free(wd); free(x); free(y); free(y1); free(a); free(as);
    return ok;
}

TEST(test_isa) {
    const cb_cpu_isa_t best = cb_cpu_isa_detect();
    fprintf(stderr, "  paths here:");
    for (int i = 0; i <= CB_CPU_ISA_AVX512; i++)
        if (cb_cpu_isa_supported((cb_cpu_isa_t)i)) fprintf(stderr, " %s", cb_cpu_isa_name((cb_cpu_isa_t)i));
    fprintf(stderr, "; in use: %s\n", cb_cpu_isa_name(best));
    CHECK(cb_cpu_isa_supported(CB_CPU_ISA_SCALAR) && cb_cpu_isa_supported(best));
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++) CHECK(cb_cpu_qtype_supported(TYPES[i]));
    CHECK(!cb_cpu_qtype_supported(CB_TYPE_F32) && !cb_cpu_qtype_supported(CB_TYPE_F16));
}

TEST(test_random_shapes) {
    /* 32-element types: 1, 2, 3 blocks (partial groups), 4.5 groups (576), 12 groups (1536) */
    static const int cols32[] = {32, 64, 96, 160, 576, 1536}, cols256[] = {256, 512, 768};
    const int n = TEST_SANITIZED ? 9 : 19;
    for (size_t t = 0; t < sizeof TYPES / sizeof TYPES[0]; t++) {
        const bool k = TYPES[t] == CB_TYPE_Q4_K || TYPES[t] == CB_TYPE_Q6_K;
        const int *cols = k ? cols256 : cols32, nc = k ? 3 : 6;
        for (int c = 0; c < nc; c++) CHECK_MSG(check_shape(TYPES[t], 37, cols[c], c % 2 ? n : 8), "%s cols %d",
                                               cb_type_name(TYPES[t]), cols[c]);
    }
}

/* The threaded driver: several parts (Q|K|V-like, two types among them), n rows, 1 and 2 threads: the same
 * bits as one cb_cpu_qdot per part. */
TEST(test_qmatmul_driver) {
    enum { COLS = 576, N = 70 };
    const int rows[3] = {576, 192, 100};
    const uint32_t types[3] = {CB_TYPE_Q4_1, CB_TYPE_Q4_1, CB_TYPE_Q8_0};
    cb_weight_t w[3];
    uint8_t *buf[3];
    float *y[3], *yr[3], *x = malloc(sizeof(float) * N * COLS);
    const int ga = cb_q8_groups(COLS);
    cb_q8_group_t *a = aligned_alloc(64, sizeof(cb_q8_group_t) * N * ga);
    random_x(x, N, COLS);
    cb_matmul_part_t parts[3];
    for (int p = 0; p < 3; p++) {
        buf[p] = random_weight(&w[p], types[p], rows[p], COLS);
        y[p] = malloc(sizeof(float) * N * rows[p]);
        yr[p] = malloc(sizeof(float) * N * rows[p]);
        parts[p] = (cb_matmul_part_t){&w[p], y[p], rows[p]};
    }
    const cb_cpu_isa_t isa = cb_cpu_isa_detect();
    for (int p = 0; p < 3; p++) {
        cb_cpu_q8_quantize(isa, types[p], x, N, COLS, a, NULL);
        cb_cpu_qdot(isa, &w[p], a, N, yr[p], rows[p], 0, rows[p]);
    }
    for (int nt = 1; nt <= 2; nt++)
        for (int n = 1; n <= N; n += 23) {
            cb_pool_t *pool = cb_pool_new(nt);
            cb_cpu_qmatmul(isa, parts, 3, x, n, a, pool);
            cb_pool_destroy(&pool);
            for (int p = 0; p < 3; p++) CHECK(!memcmp(y[p], yr[p], sizeof(float) * (size_t)n * rows[p]));
        }
    for (int p = 0; p < 3; p++) free(buf[p]), free(y[p]), free(yr[p]);
    free(x);
    free(a);
}

/* The real model's tensors (Q4_1 projections, the Q8_0 embedding / LM head) with activations taken from
 * embedding rows (the real input distribution of layer 0), each value scaled by a random factor in [0.5, 1.5]
 * (an unscaled Q8_0 embedding block would quantize exactly), checks 1-3 on the path in use. */
TEST(test_real_tensors) {
    const char *path = test_model_path();
    if (!path) SKIP("model not present");
    char err[256];
    cb_model_t *m = cb_model_load(path, err, sizeof err);
    CHECK_MSG(m, "%s", err);
    const cb_hparams_t *hp = cb_model_hparams(m);
    const cb_weight_t *emb = cb_model_tok_embd(m);
    enum { N = 9 };
    const cb_layer_weights_t *L0 = cb_model_layer(m, 0), *L29 = cb_model_layer(m, hp->n_layer - 1);
    const cb_weight_t *ws[] = {&L0->wq, &L0->wk, &L0->w_gate, &L29->w_down, &L29->wo, emb};
    int failed = 0;
    const cb_cpu_isa_t isa = cb_cpu_isa_detect();
    for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) {
        const cb_weight_t *full = ws[i];
        /* the first 256 rows (the LM head: rows 0.. of the vocabulary) */
        cb_weight_t w = *full;
        w.rows = full->rows < 256 ? full->rows : 256;
        const int cols = w.cols, ga = cb_q8_groups(cols);
        float *wd = malloc(sizeof(float) * (size_t)w.rows * cols), *x = malloc(sizeof(float) * N * cols);
        float *y = malloc(sizeof(float) * N * w.rows), *y1 = malloc(sizeof(float) * w.rows);
        cb_q8_group_t *a = aligned_alloc(64, sizeof(cb_q8_group_t) * N * ga);
        CHECK(cb_dequant(w.type, w.q, wd, (size_t)w.rows * cols));
        float *row = malloc(sizeof(float) * hp->n_embd);
        for (int r = 0; r < N; r++) /* embedding rows, tiled to cols (w_down has cols n_ff) */
            for (int j = 0; j < cols; j += hp->n_embd) {
                CHECK(cb_dequant(emb->type, (const uint8_t *)emb->q + (size_t)(1000 + 37 * r + j) * emb->row_bytes, row,
                                 (size_t)hp->n_embd));
                memcpy(x + (size_t)r * cols + j, row, sizeof(float) * (size_t)(cols - j < hp->n_embd ? cols - j : hp->n_embd));
            }
        for (int j = 0; j < N * cols; j++) x[j] *= 1.0f + 0.5f * frnd();
        cb_cpu_q8_quantize(isa, w.type, x, N, cols, a, NULL);
        cb_cpu_qdot(isa, &w, a, N, y, w.rows, 0, w.rows);
        stats_t st = {0};
        check_outputs(&w, wd, x, a, N, y, &st, full->name);
        for (int r = 0; r < N; r++) {
            cb_cpu_qdot(isa, &w, a + (size_t)r * ga, 1, y1, w.rows, 0, w.rows);
            if (memcmp(y1, y + (size_t)r * w.rows, sizeof(float) * w.rows)) st.failed++;
        }
        fprintf(stderr, "  %-26s %s %4dx%-4d %s: worst |y - exact| / slack %.3f, |y - f32| / bound %.3f, RMS %.4f\n",
                full->name, cb_type_name(w.type), w.rows, cols, cb_cpu_isa_name(isa), st.worst1, st.worst2_ratio,
                st.rms_ratio);
        failed += st.failed;
        free(wd); free(x); free(y); free(y1); free(a); free(row);
    }
    cb_model_destroy(&m);
    CHECK(failed == 0);
}

int main(void) {
    RUN(test_isa);
    RUN(test_random_shapes);
    RUN(test_qmatmul_driver);
    RUN(test_real_tensors);
    return test_summary();
}
