/* test_kvf16: the engine's KV pool in binary16 (engine.kv_dtype = f16, the default) against the f32 pool.
 *
 *   - the pool's f32 -> f16 conversion (F16C / AVX-512 and the scalar tail) is bit for bit cb_f32_to_f16;
 *   - the attention kernels on an f16 pool give the bits the same kernels give on an f32 pool holding the
 *     f16-rounded values (every path: split, blocked, decode-batch rows, the row fallback, attention mass),
 *     whatever the placement of the blocks;
 *   - the backend's kv_write / kv_read / kv_load / kv_copy_block on an f16 pool hold the f16 rounding of
 *     what an f32 pool holds;
 *   - whole-model logits of the two pools agree within a measured bound (tiny synthetic model and SmolLM2),
 *     and sharing / copy-on-write of blocks keeps its bit-for-bit promises on f16;
 *   - the option and $CB_ENGINE_KV_DTYPE.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu/cpu_backend.h"
#include "cpu/cpu_ops.h"
#include "engine/backend.h"
#include "engine/engine.h"
#include "format/quant.h"
#include "model/model.h"
#include "test.h"
#include "tiny_model.h"

static unsigned rng = 7;
static uint32_t urand(void) { rng = rng * 1664525u + 1013904223u; return rng; }
static float frand(void) { return (float)((urand() >> 8) & 0xFFFFFF) / 16777216.0f * 2.0f - 1.0f; }
static void fill(float *x, size_t n, float scale) { for (size_t i = 0; i < n; i++) x[i] = frand() * scale; }
static float r16(float x) { return cb_f16_to_f32(cb_f32_to_f16(x)); }
static double maxdiff(const float *a, const float *b, size_t n) {
    double d = 0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - (double)b[i]));
    return d;
}

static char tiny_path[64];
static cb_model_t *load_tiny(char *err, size_t errlen) {
    snprintf(tiny_path, sizeof tiny_path, "/tmp/cb_tiny_kvf16_%d.gguf", (int)getpid());
    if (tiny_model_write(tiny_path, NULL) != 0) {
        snprintf(err, errlen, "cannot write %s", tiny_path);
        return NULL;
    }
    cb_model_t *m = cb_model_load(tiny_path, err, errlen);
    unlink(tiny_path);
    return m;
}

static cb_engine_t *engine_dt(const cb_model_t *m, int max_ctx, cb_engine_kv_dtype_t dt, char *err, size_t errlen) {
    cb_engine_opts_t o = {.max_ctx = max_ctx, .kv_dtype = dt};
    return cb_engine_new_opts(m, &o, err, errlen);
}

/* ---------------------------------------------------------------- conversion */

/* Every sign / exponent / top-10-mantissa pattern (2^19) with low bits around the rounding point (ties
 * to even up and down, just below and above), plus random patterns; the vector path on whole groups of
 * 8 (16), the scalar tail on odd lengths; NaN and infinity included. */
TEST(test_f32_to_f16_bits) {
    enum { N = 1 << 16 };
    static const uint32_t low[] = {0x0000u, 0x0001u, 0x0FFFu, 0x1000u, 0x1001u, 0x1FFFu, 0x0800u};
    const int n_low = (int)(sizeof low / sizeof low[0]) + 1;
    float *src = malloc(sizeof(float) * N);
    uint16_t *dst = malloc(sizeof(uint16_t) * N);
    CHECK(src && dst);
    long bad = 0, total = 0;
    int fill_n = 0;
    for (uint32_t hi = 0; hi < (1u << 19); hi++)
        for (int li = 0; li < n_low; li++) {
            uint32_t bits = hi << 13 | (li < n_low - 1 ? low[li] : (urand() & 0x1FFFu));
            memcpy(&src[fill_n++], &bits, 4);
            if (fill_n == N || (hi == (1u << 19) - 1 && li == n_low - 1)) {
                int n = fill_n - (int)(hi & 7); /* mostly whole vectors; sometimes a scalar tail */
                cb_cpu_f32_to_f16(src, dst, (size_t)n);
                for (int i = 0; i < n; i++) bad += dst[i] != cb_f32_to_f16(src[i]);
                total += n;
                fill_n = 0;
            }
        }
    /* the scalar tail alone: lengths 1..7 */
    for (int n = 1; n < 8; n++) {
        fill(src, (size_t)n, 70000.0f);
        src[0] = -0.0f;
        cb_cpu_f32_to_f16(src, dst, (size_t)n);
        for (int i = 0; i < n; i++) bad += dst[i] != cb_f32_to_f16(src[i]);
    }
    free(src);
    free(dst);
    CHECK_MSG(bad == 0, "%ld of %ld conversions differ from cb_f32_to_f16", bad, total);
    CHECK(total > 4000000);
}

/* ---------------------------------------------------------------- kernels */

/* One layer's pool in both types: nb_pool blocks of bt rows, the same f16-representable values in each;
 * table tab[0..] (shuffled when asked); unused rows NaN (f16: 0x7E00). */
typedef struct {
    float *k32, *v32;
    uint16_t *k16, *v16;
    int32_t *tab;
    cb_cpu_kv_t kv32, kv16;
} pools_t;

static void pools_make(pools_t *p, int keys, int kvd, int bt, int n_pool, int shuffled) {
    const size_t rows = (size_t)n_pool * bt, nv = rows * kvd;
    p->k32 = malloc(sizeof(float) * nv), p->v32 = malloc(sizeof(float) * nv);
    p->k16 = malloc(sizeof(uint16_t) * nv), p->v16 = malloc(sizeof(uint16_t) * nv);
    p->tab = malloc(sizeof(int32_t) * (size_t)n_pool);
    for (size_t i = 0; i < nv; i++) p->k32[i] = p->v32[i] = NAN, p->k16[i] = p->v16[i] = 0x7E00u;
    for (int b = 0; b < n_pool; b++) p->tab[b] = b;
    if (shuffled)
        for (int b = n_pool - 1; b > 0; b--) {
            int j = (int)((urand() >> 8) % (unsigned)(b + 1));
            int32_t t = p->tab[b];
            p->tab[b] = p->tab[j], p->tab[j] = t;
        }
    for (int j = 0; j < keys; j++) {
        size_t r = ((size_t)p->tab[j / bt] * bt + (size_t)(j % bt)) * kvd;
        for (int d = 0; d < kvd; d++) {
            p->k32[r + d] = r16(frand() * 2.0f);
            p->v32[r + d] = r16(frand());
            p->k16[r + d] = cb_f32_to_f16(p->k32[r + d]);
            p->v16[r + d] = cb_f32_to_f16(p->v32[r + d]);
        }
    }
    p->kv32 = (cb_cpu_kv_t){p->k32, p->v32, p->tab, bt, CB_KV_F32};
    p->kv16 = (cb_cpu_kv_t){p->k16, p->v16, p->tab, bt, CB_KV_F16};
}

static void pools_free(pools_t *p) {
    free(p->k32); free(p->v32); free(p->k16); free(p->v16); free(p->tab);
}

/* cb_cpu_attention and cb_cpu_attn_mass on the f16 pool == on the f32 pool of the same values, on a
 * contiguous and on a shuffled table (so also: f16 results do not depend on placement). */
static int check_kernels(int H, int HKV, int hd, int n, int keys, int nt, int bt) {
    cb_attn_geom_t g = {H, HKV, hd, 1.0f / sqrtf((float)hd), CB_ATTN_F32, 0};
    const int kvd = HKV * hd, nb = (keys + bt - 1) / bt;
    const size_t qn = (size_t)n * H * hd;
    float *q = malloc(qn * 4), *o32 = malloc(qn * 4), *o16 = malloc(qn * 4), *o16s = malloc(qn * 4);
    float *m32 = calloc((size_t)keys, 4), *m16 = calloc((size_t)keys, 4), *m16s = calloc((size_t)keys, 4);
    int32_t *lim = malloc(sizeof(int32_t) * (size_t)n);
    float *scr = malloc(sizeof(float) * cb_cpu_attention_scratch(&g, n, keys, nt));
    float *mscr = malloc(sizeof(float) * cb_cpu_attn_mass_scratch(&g, keys));
    fill(q, qn, 2.0f);
    for (int i = 0; i < n; i++) {
        lim[i] = (i % 5 == 3) ? 1 + (int)((frand() + 1) * 0.5f * (keys - 1)) : keys - n + i + 1;
        if (lim[i] < 1) lim[i] = 1;
    }
    lim[0] = 1;
    pools_t pc, ps;
    pools_make(&pc, keys, kvd, bt, nb, 0);
    pools_make(&ps, keys, kvd, bt, nb + 3, 1);
    for (int j = 0; j < keys; j++) { /* the shuffle drew from rng: copy pc's rows over */
        size_t rc = ((size_t)pc.tab[j / bt] * bt + (size_t)(j % bt)) * kvd, rs = ((size_t)ps.tab[j / bt] * bt + (size_t)(j % bt)) * kvd;
        memcpy(ps.k32 + rs, pc.k32 + rc, sizeof(float) * kvd), memcpy(ps.v32 + rs, pc.v32 + rc, sizeof(float) * kvd);
        memcpy(ps.k16 + rs, pc.k16 + rc, 2 * (size_t)kvd), memcpy(ps.v16 + rs, pc.v16 + rc, 2 * (size_t)kvd);
    }
    cb_pool_t *pool = cb_pool_new(nt);
    cb_cpu_attention(&g, q, n, &pc.kv32, lim, o32, scr, keys, pool);
    cb_cpu_attention(&g, q, n, &pc.kv16, lim, o16, scr, keys, pool);
    cb_cpu_attention(&g, q, n, &ps.kv16, lim, o16s, scr, keys, pool);
    int ok = !memcmp(o32, o16, qn * 4) && !memcmp(o16, o16s, qn * 4);
    if (!ok)
        fprintf(stderr, "  attention H%d/%d hd%d n%d keys%d bt%d: f16 vs f32 max %g, shuffled max %g\n", H, HKV, hd, n,
                keys, bt, maxdiff(o32, o16, qn), maxdiff(o16, o16s, qn));
    const int mn = n < 20 ? n : 20;
    cb_cpu_attn_mass(&g, q, mn, &pc.kv32, lim, m32, NULL, mscr, NULL);
    cb_cpu_attn_mass(&g, q, mn, &pc.kv16, lim, m16, NULL, mscr, NULL);
    cb_cpu_attn_mass(&g, q, mn, &ps.kv16, lim, m16s, NULL, mscr, NULL);
    if (memcmp(m32, m16, (size_t)keys * 4) || memcmp(m16, m16s, (size_t)keys * 4)) {
        fprintf(stderr, "  attn_mass H%d/%d keys%d bt%d: f16 vs f32 max %g, shuffled max %g\n", H, HKV, keys, bt,
                maxdiff(m32, m16, (size_t)keys), maxdiff(m16, m16s, (size_t)keys));
        ok = 0;
    }
    cb_pool_destroy(&pool);
    pools_free(&pc);
    pools_free(&ps);
    free(q); free(o32); free(o16); free(o16s); free(m32); free(m16); free(m16s); free(lim); free(scr); free(mscr);
    return ok;
}

TEST(test_f16_attention_kernels) {
    CHECK(check_kernels(4, 2, 16, 1, 30, 1, 16));     /* split (decode) path */
    CHECK(check_kernels(9, 3, 64, 3, 700, 3, 16));    /* split path, several rows and chunks */
    CHECK(check_kernels(9, 3, 64, 1, 1300, 2, 5));    /* split, runs broken every 5 keys */
    CHECK(check_kernels(9, 3, 64, 70, 1300, 2, 16));  /* blocked path over several 512-key chunks */
    CHECK(check_kernels(9, 3, 64, 130, 200, 2, 48));  /* blocked, partial last block */
    CHECK(check_kernels(4, 1, 32, 2, 300, 2, 7));     /* head_dim 32 */
    CHECK(check_kernels(4, 2, 16, 9, 40, 1, 1));      /* a block per row */
    CHECK(check_kernels(34, 1, 16, 3, 300, 2, 16));   /* group of 34: the row-per-head fallback */
}

/* cb_cpu_attention_rows on f16: each row bit for bit its one-row f16 call and its f32-pool call. */
static int check_rows(int H, int HKV, int hd, int n, int keys, int nt, int bt) {
    cb_attn_geom_t g = {H, HKV, hd, 1.0f / sqrtf((float)hd), CB_ATTN_F32, 0};
    const int kvd = HKV * hd, nb = (keys + bt - 1) / bt, n_pool = n * nb + 5;
    const size_t qn = (size_t)n * H * hd;
    float *q = malloc(qn * 4), *o16 = malloc(qn * 4), *o32 = malloc(qn * 4), *o1 = malloc((size_t)H * hd * 4);
    int32_t *lim = malloc(sizeof(int32_t) * (size_t)n);
    cb_kv_table_t *t = malloc(sizeof(cb_kv_table_t) * (size_t)n);
    float *scr = malloc(sizeof(float) * cb_cpu_attention_scratch(&g, n, keys, nt));
    pools_t p;
    pools_make(&p, n_pool * bt, kvd, bt, n_pool, 1); /* every row filled; the tables are slices of one shuffle */
    fill(q, qn, 2.0f);
    for (int i = 0; i < n; i++) {
        t[i] = (cb_kv_table_t){p.tab + (size_t)i * nb, nb * bt};
        lim[i] = i == 0 ? 1 : i % 4 == 1 ? keys : 1 + (int)((frand() + 1) * 0.5f * (keys - 1));
    }
    cb_pool_t *pool = cb_pool_new(nt);
    const cb_cpu_kv_t t16 = {p.k16, p.v16, NULL, bt, CB_KV_F16}, t32 = {p.k32, p.v32, NULL, bt, CB_KV_F32};
    cb_cpu_attention_rows(&g, q, n, &t16, t, lim, o16, scr, keys, pool);
    cb_cpu_attention_rows(&g, q, n, &t32, t, lim, o32, scr, keys, pool);
    int ok = !memcmp(o16, o32, qn * 4);
    if (!ok) fprintf(stderr, "  attention_rows H%d/%d n%d keys%d: f16 vs f32 max %g\n", H, HKV, n, keys, maxdiff(o16, o32, qn));
    for (int i = 0; i < n && ok; i++) {
        const cb_cpu_kv_t kv = {p.k16, p.v16, t[i].blocks, bt, CB_KV_F16};
        cb_cpu_attention(&g, q + (size_t)i * H * hd, 1, &kv, &lim[i], o1, scr, keys, pool);
        ok = !memcmp(o1, o16 + (size_t)i * H * hd, (size_t)H * hd * 4);
        if (!ok) fprintf(stderr, "  attention_rows f16 row %d (limit %d) differs from its one-row call\n", i, lim[i]);
    }
    cb_pool_destroy(&pool);
    pools_free(&p);
    free(q); free(o16); free(o32); free(o1); free(lim); free(t); free(scr);
    return ok;
}

TEST(test_f16_attention_rows) {
    CHECK(check_rows(9, 3, 64, 16, 1300, 2, 16));
    CHECK(check_rows(9, 3, 64, 21, 700, 2, 5));
    CHECK(check_rows(9, 3, 64, 5, 2100, 1, 16));
    CHECK(check_rows(4, 1, 32, 6, 600, 2, 7));
    CHECK(check_rows(34, 1, 16, 3, 300, 2, 16)); /* the one-row fallback */
}

/* ---------------------------------------------------------------- backend row operations */

/* The row-operation tests' pool: BT positions a block, NB blocks, a RoPE table of MAXK positions, N rows
 * loaded; the block table has breaks (logical block i is pool block ROW_BLOCKS[i]). */
enum { BT = 4, NB = 12, MAXK = 32, N = 10 };
static const int32_t ROW_BLOCKS[NB] = {5, 6, 2, 9, 10, 11, 0, 1, 3, 4, 7, 8};

/* kv_write then kv_read gives the f16 rounding; kv_load (f32, f16, bf16 sources; positions inside and past
 * the RoPE table, another base) holds the f16 rounding of what an f32 pool holds after the same load;
 * kv_copy_block copies it. */
TEST(test_f16_backend_rows) {
    char err[256];
    cb_model_t *m = load_tiny(err, sizeof err);
    CHECK_MSG(m, "%s", err);
    const cb_hparams_t *hp = cb_model_hparams(m);
    const int kvd = hp->n_head_kv * hp->head_dim, nl = hp->n_layer;
    cb_backend_t *b16 = cb_backend_cpu_new(hp, 16, MAXK, 1, err, sizeof err);
    cb_backend_t *b32 = cb_backend_cpu_new(hp, 16, MAXK, 1, err, sizeof err);
    CHECK_MSG(b16 && b32, "%s", err);
    CHECK(b16->ops->kv_pool_init(b16->ctx, nl, kvd, BT, NB, CB_KV_BF16, err, sizeof err) == -1); /* not stored */
    CHECK(b16->ops->kv_pool_init(b16->ctx, nl, kvd, BT, NB, CB_KV_F16, err, sizeof err) == 0);
    CHECK(b32->ops->kv_pool_init(b32->ctx, nl, kvd, BT, NB, CB_KV_F32, err, sizeof err) == 0);
    CHECK(b16->kv_value_bytes == 2 && b32->kv_value_bytes == 4);
    const cb_kv_table_t t = {ROW_BLOCKS, NB * BT};
    float k[N * 256], v[N * 256], kr[N * 256], vr[N * 256], k32[N * 256], v32[N * 256];
    uint16_t h[2][N * 256];
    CHECK(kvd <= 256);
    int32_t pos[N];
    for (int i = 0; i < N; i++) pos[i] = 3 * i + 1;
    fill(k, (size_t)N * kvd, 3.0f);
    fill(v, (size_t)N * kvd, 1.0f);
    k[0] = 1e-6f, v[0] = 70000.0f, k[1] = -0.0f; /* an f16 subnormal, an overflow to inf, a signed zero */
    CHECK(b16->ops->kv_write(b16->ctx, 1, &t, pos, N, k, v) == 0);
    int ok = 1;
    for (int i = 0; i < N; i++) {
        CHECK(b16->ops->kv_read(b16->ctx, 1, &t, pos[i], 1, kr + (size_t)i * kvd, vr + (size_t)i * kvd) == 0);
        for (int d = 0; d < kvd; d++) {
            const size_t e = (size_t)i * kvd + d;
            ok = ok && !memcmp(&kr[e], &(float){r16(k[e])}, 4) && !memcmp(&vr[e], &(float){r16(v[e])}, 4);
        }
    }
    CHECK_MSG(ok, "kv_read of a written row is not its f16 rounding");
    CHECK(isinf(vr[0]) && kr[0] != 0.0f && kr[0] == r16(1e-6f) && signbit(kr[1]));
    /* loads: pre-RoPE rows at positions 18..27 (the table covers 0..31 = MAXK), and past it, other base */
    const cb_kv_dtype_t dts[3] = {CB_KV_F32, CB_KV_F16, CB_KV_BF16};
    for (int di = 0; di < 3; di++)
        for (int variant = 0; variant < 2; variant++) {
            const void *ks = k, *vs = v;
            if (dts[di] != CB_KV_F32) {
                for (int e = 0; e < N * kvd; e++) {
                    h[0][e] = dts[di] == CB_KV_F16 ? cb_f32_to_f16(k[e]) : cb_f32_to_bf16(k[e]);
                    h[1][e] = dts[di] == CB_KV_F16 ? cb_f32_to_f16(v[e]) : cb_f32_to_bf16(v[e]);
                }
                ks = h[0], vs = h[1];
            }
            const int pos0 = variant ? 30 : 18; /* 30..39: past the table (and the positions' blocks wrap) */
            const cb_kv_table_t tl = {ROW_BLOCKS, NB * BT};
            cb_rope_t rope = cb_hparams_rope(hp);
            if (variant) rope.base = 5000.0f;
            CHECK(b16->ops->kv_load(b16->ctx, 0, &tl, pos0, N, ks, vs, dts[di], &rope) == 0);
            CHECK(b32->ops->kv_load(b32->ctx, 0, &tl, pos0, N, ks, vs, dts[di], &rope) == 0);
            CHECK(b16->ops->kv_read(b16->ctx, 0, &tl, pos0, N, kr, vr) == 0);
            CHECK(b32->ops->kv_read(b32->ctx, 0, &tl, pos0, N, k32, v32) == 0);
            for (int e = 0; e < N * kvd; e++) ok = ok && kr[e] == r16(k32[e]) && vr[e] == r16(v32[e]);
            CHECK_MSG(ok, "kv_load from %s (variant %d): f16 pool is not the f16 rounding of the f32 pool",
                      cb_kv_dtype_name(dts[di]), variant);
        }
    /* copy a block (logical block 1 = pool block 6) to a free one (pool block 8 is logical 11: unused) */
    CHECK(b16->ops->kv_copy_block(b16->ctx, 8, 6) == 0);
    const int32_t blocks2[2] = {5, 8};
    const cb_kv_table_t t2 = {blocks2, 2 * BT};
    float kc[BT * 256], vc[BT * 256];
    CHECK(b16->ops->kv_read(b16->ctx, 1, &t, BT, BT, kr, vr) == 0);
    CHECK(b16->ops->kv_read(b16->ctx, 1, &t2, BT, BT, kc, vc) == 0);
    CHECK(!memcmp(kr, kc, sizeof(float) * BT * kvd) && !memcmp(vr, vc, sizeof(float) * BT * kvd));
    cb_backend_destroy(&b16);
    cb_backend_destroy(&b32);
    cb_model_destroy(&m);
}

/* Q8_0 rows of x [n] (n % 32 == 0) into q [n / 32 * 34]: any valid block will do here (the loads are checked
 * against cb_dequant of the same bytes), so the scale is max|x| / 127 rounded to f16 and q = rint(x / d). */
static void q8_encode(const float *x, size_t n, uint8_t *q) {
    for (size_t b = 0; b < n / 32; b++, x += 32, q += 34) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        uint16_t dh = cb_f32_to_f16(amax / 127.0f);
        float d = cb_f16_to_f32(dh);
        memcpy(q, &dh, 2);
        for (int i = 0; i < 32; i++) q[2 + i] = (uint8_t)(int8_t)(d > 0.0f ? rintf(x[i] / d) : 0.0f);
    }
}

/* kv_load of Q8_0 rows (a q8_0 KV file's mapping) puts in the pool exactly what kv_load of the same rows
 * decoded to f32 puts there, on an f16 and an f32 pool, inside and past the RoPE table; kv_deviation against
 * Q8_0 rows equals it against the decoded rows. */
TEST(test_q8_0_backend_rows) {
    char err[256];
    cb_model_t *m = load_tiny(err, sizeof err);
    CHECK_MSG(m, "%s", err);
    const cb_hparams_t *hp = cb_model_hparams(m);
    const int kvd = hp->n_head_kv * hp->head_dim, nl = hp->n_layer;
    CHECK(kvd % 32 == 0 && kvd <= 256);
    const size_t nv = (size_t)N * kvd;
    const cb_kv_dtype_t pools[2] = {CB_KV_F16, CB_KV_F32};
    float k[N * 256], v[N * 256], kd[N * 256], vd[N * 256], kq[N * 256], vq[N * 256], kf[N * 256], vf[N * 256];
    uint8_t qk[N * 256 / 32 * 34], qv[N * 256 / 32 * 34];
    fill(k, nv, 3.0f);
    fill(v, nv, 1.0f);
    q8_encode(k, nv, qk);
    q8_encode(v, nv, qv);
    CHECK(cb_dequant(CB_TYPE_Q8_0, qk, kd, nv) && cb_dequant(CB_TYPE_Q8_0, qv, vd, nv));
    const cb_kv_table_t t = {ROW_BLOCKS, NB * BT};
    for (int pi = 0; pi < 2; pi++) {
        cb_backend_t *b = cb_backend_cpu_new(hp, 16, MAXK, 1, err, sizeof err);
        CHECK_MSG(b, "%s", err);
        CHECK(b->ops->kv_load_q8_0);
        CHECK(b->ops->kv_pool_init(b->ctx, nl, kvd, BT, NB, pools[pi], err, sizeof err) == 0);
        for (int variant = 0; variant < 2; variant++) {
            const int pos0 = variant ? 30 : 18; /* 30..39: past the RoPE table */
            cb_rope_t rope = cb_hparams_rope(hp);
            if (variant) rope.base = 5000.0f;
            CHECK(b->ops->kv_load(b->ctx, 0, &t, pos0, N, qk, qv, CB_KV_Q8_0, &rope) == 0);
            CHECK(b->ops->kv_read(b->ctx, 0, &t, pos0, N, kq, vq) == 0);
            CHECK(b->ops->kv_load(b->ctx, 1, &t, pos0, N, kd, vd, CB_KV_F32, &rope) == 0);
            CHECK(b->ops->kv_read(b->ctx, 1, &t, pos0, N, kf, vf) == 0);
            CHECK_MSG(!memcmp(kq, kf, sizeof(float) * nv) && !memcmp(vq, vf, sizeof(float) * nv),
                      "kv_load of Q8_0 rows (%s pool, variant %d) is not the load of their f32 decoding",
                      cb_kv_dtype_name(pools[pi]), variant);
        }
        /* deviation: fresh rows k against the cached Q8_0 rows, and against their decoding */
        const void *cq[N], *cf[N];
        double dq[N], df[N];
        for (int i = 0; i < N; i++) cq[i] = qk + (size_t)i * (kvd / 32 * 34), cf[i] = kd + (size_t)i * kvd;
        CHECK(b->ops->kv_deviation(b->ctx, N, kvd, k, cq, CB_KV_Q8_0, dq) == 0);
        CHECK(b->ops->kv_deviation(b->ctx, N, kvd, k, cf, CB_KV_F32, df) == 0);
        CHECK(!memcmp(dq, df, sizeof dq) && dq[0] > 0.0);
        cb_backend_destroy(&b);
    }
    cb_model_destroy(&m);
}

/* ---------------------------------------------------------------- whole model */

/* Prefill n tokens, then decode n_dec greedy steps, on an f32 and an f16 pool. Returns the max |logit
 * difference| over the prefill's last row and every decode step; *same_tokens: the greedy tokens agree. */
static double logits_f16_vs_f32(const cb_model_t *m, const int32_t *tok, int n, int n_dec, double *scale,
                                int *same_tokens) {
    char err[256];
    const int V = cb_model_hparams(m)->n_vocab;
    cb_engine_t *e[2] = {engine_dt(m, n + n_dec + 1, CB_ENGINE_KV_F32, err, sizeof err),
                         engine_dt(m, n + n_dec + 1, CB_ENGINE_KV_F16, err, sizeof err)};
    cb_seq_t *s[2] = {e[0] ? cb_seq_new(e[0]) : NULL, e[1] ? cb_seq_new(e[1]) : NULL};
    float *lg[2] = {malloc(sizeof(float) * (size_t)V), malloc(sizeof(float) * (size_t)V)};
    double d = 0, mx = 0;
    *same_tokens = 1;
    if (!s[0] || !s[1] || cb_engine_kv_dtype(e[1]) != CB_ENGINE_KV_F16) d = 1e30;
    for (int x = 0; x < 2 && d < 1e30; x++)
        if (cb_engine_prefill(e[x], s[x], tok, n, 0, lg[x]) != CB_ENGINE_OK) d = 1e30;
    int32_t next[2] = {0, 0};
    for (int step = 0; step <= n_dec && d < 1e30; step++) {
        d = fmax(d, maxdiff(lg[0], lg[1], (size_t)V));
        for (int x = 0; x < 2; x++) {
            int best = 0;
            for (int i = 1; i < V; i++) best = lg[x][i] > lg[x][best] ? i : best;
            next[x] = best;
        }
        for (int i = 0; i < V; i++) mx = fmax(mx, fabs(lg[0][i]));
        *same_tokens = *same_tokens && next[0] == next[1];
        if (step == n_dec) break;
        for (int x = 0; x < 2 && d < 1e30; x++) /* both continue with the f32 pool's token */
            if (cb_engine_decode(e[x], s[x], next[0], n + step, lg[x]) != CB_ENGINE_OK) d = 1e30;
    }
    *scale = mx;
    for (int x = 0; x < 2; x++) cb_seq_destroy(&s[x]), cb_engine_destroy(&e[x]), free(lg[x]);
    return d;
}

/* The logit comparisons run on the f32 reference weights (CB_ENGINE_WEIGHTS=f32): with the native int8
 * matvecs of decode (engine.h) a K/V difference of one f16 ulp can flip an activation's int8 rounding,
 * which later layers amplify (measured 0.14 tiny, 1.17 SmolLM2): that is the int8 noise, not the pool's. */
TEST(test_f16_logits_tiny) {
    char err[256];
    setenv("CB_ENGINE_WEIGHTS", "f32", 1);
    cb_model_t *m = load_tiny(err, sizeof err);
    unsetenv("CB_ENGINE_WEIGHTS");
    CHECK_MSG(m, "%s", err);
    int32_t tok[120];
    for (int i = 0; i < 120; i++) tok[i] = (i * 29 + 3) % 80;
    double scale;
    int same;
    double d = logits_f16_vs_f32(m, tok, 120, 16, &scale, &same);
    fprintf(stderr, "  tiny model: max|f16 pool - f32 pool| logits %.3g (logits up to %.3g), greedy tokens %s\n", d,
            scale, same ? "agree" : "differ");
    /* K, V rounded to 2^-11 = 4.9e-4 relative per element; through 2 layers to logits up to ~30 the
     * measured difference is 1.15e-3 (120 tokens + 16 decode steps, f16 ulps of the logits' size); bound
     * 5e-3, ~4x margin (a broken conversion gives differences of order 1) */
    CHECK(d < 5e-3);
    cb_model_destroy(&m);
}

TEST(test_f16_logits_real) {
    const char *path = test_model_path();
    if (!path) SKIP("model not present");
    char err[256];
    setenv("CB_ENGINE_WEIGHTS", "f32", 1);
    cb_model_t *m = cb_model_load(path, err, sizeof err);
    unsetenv("CB_ENGINE_WEIGHTS");
    CHECK_MSG(m, "%s", err);
    /* "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n" ... */
    static const int32_t tok[] = {1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
                                  504, 3575, 282, 4649, 314, 7042, 30, 2, 198};
    const int n = TEST_SANITIZED ? 6 : (int)(sizeof tok / sizeof tok[0]), n_dec = TEST_SANITIZED ? 2 : 16;
    double scale;
    int same;
    double d = logits_f16_vs_f32(m, tok, n, n_dec, &scale, &same);
    fprintf(stderr, "  SmolLM2: max|f16 pool - f32 pool| logits %.3g (logits up to %.3g), greedy tokens %s\n", d, scale,
            same ? "agree" : "differ");
    /* per element 2^-11 = 4.9e-4 relative on K and V; through 30 layers to logits up to ~37 the measured
     * difference is 0.024 over 25 prompt tokens + 16 decode steps; bound 0.25 (~10x margin, under 1 % of
     * the logit range; a broken conversion gives differences of order 1-10), and the greedy tokens agree */
    CHECK(d < 0.25);
    CHECK(same);
    cb_model_destroy(&m);
}

/* Shared blocks and copy-on-write on f16 pools: a shared sequence continues bit for bit as a private one,
 * and a write into a shared block leaves the other sequence's rows as they were. */
TEST(test_f16_share_cow) {
    char err[256];
    cb_model_t *m = load_tiny(err, sizeof err);
    CHECK_MSG(m, "%s", err);
    cb_engine_t *e = engine_dt(m, 128, CB_ENGINE_KV_F16, err, sizeof err);
    CHECK_MSG(e, "%s", err);
    enum { KVD = TINY_HKV * TINY_HD };
    const int bt = CB_ENGINE_BLOCK_TOKENS, nA = 3 * bt + 3, np = 2 * bt + 5, n = 5 * bt;
    int32_t tok[128];
    for (int i = 0; i < n; i++) tok[i] = (i * 13 + 5) % 80;
    float la[80], lb[80], lf[80];
    static float before[128 * KVD * 2], after[128 * KVD * 2];
    cb_seq_t *a = cb_seq_new(e), *b = cb_seq_new(e), *f = cb_seq_new(e);
    CHECK(a && b && f);
    CHECK(cb_engine_prefill(e, a, tok, nA, 0, la) == CB_ENGINE_OK);
    for (int l = 0; l < TINY_L; l++)
        CHECK(cb_engine_kv_read(e, a, l, 0, nA, before + (size_t)l * nA * KVD, NULL) == CB_ENGINE_OK);
    CHECK(cb_seq_share(b, a, np) == CB_ENGINE_OK);
    cb_engine_pool_stats_t st;
    cb_engine_pool_stats(e, &st);
    CHECK(st.blocks_shared == np / bt && st.block_bytes == (size_t)2 * TINY_L * KVD * 2 * bt);
    CHECK(cb_engine_prefill(e, b, tok + np, n - np, np, lb) == CB_ENGINE_OK); /* writes into the copied block */
    CHECK(cb_engine_prefill(e, f, tok, nA, 0, NULL) == CB_ENGINE_OK);
    CHECK(cb_engine_prefill(e, f, tok + np, n - np, np, lf) == CB_ENGINE_OK);
    CHECK_MSG(!memcmp(lb, lf, sizeof lb), "shared vs private continuation: max %g", maxdiff(lb, lf, 80));
    /* a write into a shared block (position 3, layer 0 of b) copies it; a's rows stay */
    float krow[KVD], vrow[KVD], kb[KVD];
    fill(krow, KVD, 1.0f);
    fill(vrow, KVD, 1.0f);
    int32_t p3 = 3;
    CHECK(cb_engine_kv_write(e, b, 0, &p3, 1, krow, vrow) == CB_ENGINE_OK);
    CHECK(cb_engine_kv_read(e, b, 0, 3, 1, kb, NULL) == CB_ENGINE_OK);
    for (int i = 0; i < KVD; i++) CHECK(kb[i] == r16(krow[i]));
    for (int l = 0; l < TINY_L; l++)
        CHECK(cb_engine_kv_read(e, a, l, 0, nA, after + (size_t)l * nA * KVD, NULL) == CB_ENGINE_OK);
    CHECK(!memcmp(before, after, sizeof(float) * (size_t)TINY_L * nA * KVD));
    cb_seq_destroy(&a); cb_seq_destroy(&b); cb_seq_destroy(&f);
    cb_engine_destroy(&e);
    cb_model_destroy(&m);
}

/* ---------------------------------------------------------------- the option */

TEST(test_kv_dtype_option) {
    char err[256];
    cb_model_t *m = load_tiny(err, sizeof err);
    CHECK_MSG(m, "%s", err);
    cb_engine_kv_dtype_t d = CB_ENGINE_KV_F32;
    CHECK(cb_engine_kv_dtype_parse("f16", &d) && d == CB_ENGINE_KV_F16);
    CHECK(cb_engine_kv_dtype_parse("f32", &d) && d == CB_ENGINE_KV_F32);
    CHECK(!cb_engine_kv_dtype_parse("bf16", &d) && !cb_engine_kv_dtype_parse("F16", &d) && d == CB_ENGINE_KV_F32);
    const char *saved = getenv("CB_ENGINE_KV_DTYPE");
    char saved_copy[32] = "";
    if (saved) snprintf(saved_copy, sizeof saved_copy, "%s", saved);
    unsetenv("CB_ENGINE_KV_DTYPE");
    cb_engine_opts_t o = {.max_ctx = 32}; /* zero-initialised: the default */
    cb_engine_t *e = cb_engine_new_opts(m, &o, err, sizeof err);
    CHECK_MSG(e && cb_engine_kv_dtype(e) == CB_ENGINE_KV_F16, "%s", err);
    cb_engine_destroy(&e);
    setenv("CB_ENGINE_KV_DTYPE", "f32", 1); /* the environment decides the default */
    e = cb_engine_new_opts(m, &o, err, sizeof err);
    CHECK(e && cb_engine_kv_dtype(e) == CB_ENGINE_KV_F32);
    cb_engine_pool_stats_t st;
    cb_engine_pool_stats(e, &st);
    CHECK(st.block_bytes == (size_t)2 * TINY_L * TINY_HKV * TINY_HD * 4 * st.block_tokens);
    cb_engine_destroy(&e);
    o.kv_dtype = CB_ENGINE_KV_F16; /* ... but not an explicit choice */
    e = cb_engine_new_opts(m, &o, err, sizeof err);
    CHECK(e && cb_engine_kv_dtype(e) == CB_ENGINE_KV_F16);
    cb_engine_destroy(&e);
    o.kv_dtype = CB_ENGINE_KV_DEFAULT;
    setenv("CB_ENGINE_KV_DTYPE", "f8", 1);
    e = cb_engine_new_opts(m, &o, err, sizeof err);
    CHECK_MSG(!e && strstr(err, "CB_ENGINE_KV_DTYPE"), "%s", err);
    if (saved_copy[0]) setenv("CB_ENGINE_KV_DTYPE", saved_copy, 1);
    else unsetenv("CB_ENGINE_KV_DTYPE");
    cb_model_destroy(&m);
}

int main(void) {
    RUN(test_f32_to_f16_bits);
    RUN(test_f16_attention_kernels);
    RUN(test_f16_attention_rows);
    RUN(test_f16_backend_rows);
    RUN(test_q8_0_backend_rows);
    RUN(test_f16_logits_tiny);
    RUN(test_f16_logits_real);
    RUN(test_f16_share_cow);
    RUN(test_kv_dtype_option);
    return test_summary();
}
