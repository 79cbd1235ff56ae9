/* test_blend: the CacheBlend fused prefill on the real model with small synthetic prompts (prefix + a few
 * chunks + suffix, ~200 tokens; smaller under sanitizers): exactness of full/prefix/reuse/blend(1.0)
 * against full, re-positioning of pre-RoPE K, selection (forced rows, determinism, counts, gradual),
 * exact causal key limits (hook and a behavioural check), the loader overlap, KV file misses
 * (missing, corrupt payload, truncated) and the memory tier. Skips without the model.
 *
 * Tolerance: logits that must be "the same" may differ only by the summation order of GEMMs over
 * different row batches (rows computed in another ubatch composition) and the 1-row GEMV of the last
 * layer; we require max |logit diff| <= LOGIT_TOL (logits are O(10)). Runs that must be identical
 * (same inputs, overlap on/off, repeated runs) are compared bit for bit.
 */
#include "blend/blend.h"
#include "engine/engine.h"
#include "format/kvfile.h"
#include "kv/kvmem.h"
#include "model/model.h"
#include "test.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#define LOGIT_TOL 2e-3

static cb_model_t *g_model;
static cb_engine_t *g_eng;
static const cb_hparams_t *g_hp;
static int g_np, g_nc, g_k, g_ns; /* prefix, chunk length, chunks, suffix */

static int32_t g_prefix[64], g_chunks[4][128], g_suffix[32];
static cb_blend_chunk_t g_ch[4];

static uint32_t g_rng = 12345;
static int32_t rnd_tok(void) {
    g_rng = g_rng * 1664525u + 1013904223u;
    return (int32_t)(300 + (g_rng >> 8) % 15000);
}

static int setup(void) {
    if (g_eng) return 1;
    const char *path = test_model_path();
    if (!path) return 0;
    char err[256];
    g_model = cb_model_load(path, err, sizeof err);
    if (!g_model) {
        fprintf(stderr, "  %s\n", err);
        return 0;
    }
    g_hp = cb_model_hparams(g_model);
    g_eng = cb_engine_new(g_model, 320, err, sizeof err);
    if (!g_eng) return 0;
    cb_engine_set_threads(g_eng, 1); /* tiny batches: one thread avoids OpenMP barriers on a busy machine */
    g_np = TEST_SANITIZED ? 6 : 16;
    g_nc = TEST_SANITIZED ? 16 : 40;
    g_k = 3;
    g_ns = TEST_SANITIZED ? 4 : 10;
    for (int i = 0; i < g_np; i++) g_prefix[i] = rnd_tok();
    for (int c = 0; c < g_k; c++) {
        for (int i = 0; i < g_nc; i++) g_chunks[c][i] = rnd_tok();
        g_ch[c].tokens = g_chunks[c];
        g_ch[c].n = g_nc;
    }
    for (int i = 0; i < g_ns; i++) g_suffix[i] = rnd_tok();
    return 1;
}

static int n_total(int k) { return g_np + k * g_nc + g_ns; }

static double max_diff(const float *a, const float *b, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= m)) m = d; /* NaN propagates */
    }
    return m;
}

static char g_dir[256];
static const char *make_dir(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/test_blend.XXXXXX");
    return mkdtemp(g_dir);
}
static void rm_dir(const char *dir) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "  cleanup of %s failed\n", dir);
}

static cb_blend_opts_t opts_mode(cb_blend_mode_t m) {
    cb_blend_opts_t o;
    cb_blend_opts_default(&o);
    o.mode = m;
    return o;
}

/* Runs one prefill; 0 on success. */
static int run(cb_blend_t *b, int k, const cb_blend_opts_t *o, float *logits, cb_blend_stats_t *st) {
    char err[256] = "";
    int rc = cb_blend_prefill(b, g_prefix, g_np, g_ch, k, g_suffix, g_ns, o, logits, st, err, sizeof err);
    if (rc) fprintf(stderr, "  prefill: %s\n", err);
    return rc;
}

static int ensure_all(cb_blend_t *b, int k) {
    char err[256] = "";
    for (int c = 0; c < k; c++)
        if (cb_blend_ensure_chunk(b, g_prefix, g_np, g_ch[c].tokens, g_ch[c].n, NULL, NULL, err, sizeof err)) {
            fprintf(stderr, "  ensure: %s\n", err);
            return -1;
        }
    return 0;
}

/* full through the blend path = the engine's own prefill; the fused KV then serves decoding */
TEST(test_full_equals_engine_prefill) {
    if (!setup()) SKIP("no model");
    int V = g_hp->n_vocab, N = n_total(g_k);
    float *a = malloc(sizeof(float) * V), *b2 = malloc(sizeof(float) * V), *d1 = malloc(sizeof(float) * V),
          *d2 = malloc(sizeof(float) * V);
    int32_t *all = malloc(sizeof(int32_t) * (N + 1));
    int r = 0;
    for (int i = 0; i < g_np; i++) all[r++] = g_prefix[i];
    for (int c = 0; c < g_k; c++)
        for (int i = 0; i < g_nc; i++) all[r++] = g_chunks[c][i];
    for (int i = 0; i < g_ns; i++) all[r++] = g_suffix[i];
    all[N] = 1234;
    char err[256];
    cb_blend_t *b = cb_blend_new(g_eng, NULL, NULL, CB_KV_F16, err, sizeof err);
    CHECK(b);
    CHECK(cb_engine_prefill(g_eng, all, N, 0, a) == 0);
    CHECK(cb_engine_decode(g_eng, all[N], N, d1) == 0);
    cb_blend_opts_t o = opts_mode(CB_BLEND_FULL);
    cb_blend_stats_t st;
    CHECK(run(b, g_k, &o, b2, &st) == 0);
    CHECK(st.tokens_recomputed == N && st.tokens_reused == 0 && st.n_tokens == N);
    double d = max_diff(a, b2, V);
    fprintf(stderr, "  full vs engine prefill: max |dlogit| = %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    CHECK(cb_engine_decode(g_eng, all[N], N, d2) == 0);
    d = max_diff(d1, d2, V);
    fprintf(stderr, "  decode after full blend vs after prefill: %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    cb_blend_destroy(&b);
    cb_blend_destroy(&b);
    free(a), free(b2), free(d1), free(d2), free(all);
}

/* blend at ratio 1.0 recomputes every chunk row: the same as full (f16 files; cached values only rank) */
TEST(test_blend_ratio1_equals_full) {
    if (!setup()) SKIP("no model");
    int V = g_hp->n_vocab;
    const char *dir = make_dir();
    CHECK(dir);
    char err[256];
    cb_blend_t *b = cb_blend_new(g_eng, dir, NULL, CB_KV_F16, err, sizeof err);
    CHECK(b);
    CHECK(ensure_all(b, g_k) == 0);
    float *full = malloc(sizeof(float) * V), *bl = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_FULL);
    CHECK(run(b, g_k, &o, full, NULL) == 0);
    o = opts_mode(CB_BLEND_BLEND);
    o.ratio = 1.0f;
    cb_blend_stats_t st;
    CHECK(run(b, g_k, &o, bl, &st) == 0);
    CHECK(st.chunks_file == g_k && st.chunks_computed == 0);
    CHECK(st.tokens_recomputed == n_total(g_k) - g_np); /* everything but the (exact) prefix */
    double d = max_diff(full, bl, V);
    fprintf(stderr, "  blend(1.0) vs full: max |dlogit| = %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    /* the attention metric at ratio 1.0 is exact too (its probe pass only chooses rows) */
    o.metric = 'a';
    CHECK(run(b, g_k, &o, bl, &st) == 0);
    CHECK(st.tokens_recomputed == n_total(g_k) - g_np);
    CHECK(st.t_probe_ms == 0.0); /* nothing to choose: no probe */
    d = max_diff(full, bl, V);
    fprintf(stderr, "  blend(1.0, metric a) vs full: max |dlogit| = %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    o.metric = 'v';
    /* and with gradual filtering from 1.0 down to 1.0 is not allowed (start must exceed ratio) */
    o.gradual_ratio = 1.0f;
    o.gradual_end_layer = 3;
    CHECK(cb_blend_prefill(b, g_prefix, g_np, g_ch, g_k, g_suffix, g_ns, &o, bl, NULL, err, sizeof err) == -1);
    cb_blend_destroy(&b);
    rm_dir(dir);
    free(full), free(bl);
}

/* reuse with one chunk precomputed right after the prefix is exact (f32 files) */
TEST(test_reuse_single_chunk_equals_full) {
    if (!setup()) SKIP("no model");
    int V = g_hp->n_vocab;
    const char *dir = make_dir();
    CHECK(dir);
    char err[256];
    cb_blend_t *b = cb_blend_new(g_eng, dir, NULL, CB_KV_F32, err, sizeof err);
    CHECK(b);
    float *full = malloc(sizeof(float) * V), *re = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_FULL);
    CHECK(run(b, 1, &o, full, NULL) == 0);
    o = opts_mode(CB_BLEND_REUSE);
    cb_blend_stats_t st;
    CHECK(run(b, 1, &o, re, &st) == 0); /* the miss is computed, stored, then used */
    CHECK(st.chunks_computed == 1 && st.tokens_recomputed == g_ns);
    double d = max_diff(full, re, V);
    fprintf(stderr, "  reuse(1 chunk, computed now) vs full: %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    CHECK(run(b, 1, &o, re, &st) == 0); /* now from the file */
    CHECK(st.chunks_file == 1 && st.chunks_computed == 0);
    d = max_diff(full, re, V);
    fprintf(stderr, "  reuse(1 chunk, from file) vs full: %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    /* so is blend with the attention metric whatever it selects, also when its probe stops after the
     * first layer: the probe must still place every layer's cached rows, or the main pass reads what the
     * previous prompt left there */
    int L = g_hp->n_layer;
    for (int pl = 0; pl <= L; pl += L > 1 ? L - 1 : 1) {
        for (int pl2 = pl; pl2 <= pl + 1 && pl2 <= L; pl2++) {
            o = opts_mode(CB_BLEND_FULL); /* other tokens into the cache rows the chunk will occupy */
            CHECK(cb_blend_prefill(b, g_prefix, g_np, g_ch + 1, 1, g_suffix, g_ns, &o, re, NULL, err, sizeof err) == 0);
            o = opts_mode(CB_BLEND_BLEND);
            o.metric = 'a';
            o.ratio = 0.3f;
            o.probe_layers = pl2;
            o.no_overlap = pl2 % 2; /* the loader thread and the serial loads */
            CHECK(run(b, 1, &o, re, &st) == 0);
            CHECK(st.t_probe_ms > 0.0 && st.tokens_recomputed > g_ns && st.tokens_reused > 0);
            d = max_diff(full, re, V);
            fprintf(stderr, "  blend(1 chunk, metric a, probe layers %d) vs full: %.3g\n", pl2, d);
            CHECK_NEAR(d, 0, LOGIT_TOL);
        }
    }
    /* and when the probe runs only the last suffix rows (moved up to follow the chunk): the main pass must
     * still compute the whole suffix at its own positions */
    const int psufs[3] = {1, g_ns - 1, g_ns + 3};
    for (int i = 0; i < 3; i++) {
        o = opts_mode(CB_BLEND_FULL);
        CHECK(cb_blend_prefill(b, g_prefix, g_np, g_ch + 1, 1, g_suffix, g_ns, &o, re, NULL, err, sizeof err) == 0);
        o = opts_mode(CB_BLEND_BLEND);
        o.metric = 'a';
        o.ratio = 0.3f;
        o.probe_suffix = psufs[i];
        CHECK(run(b, 1, &o, re, &st) == 0);
        CHECK(st.t_probe_ms > 0.0 && st.tokens_recomputed > g_ns && st.tokens_reused > 0);
        d = max_diff(full, re, V);
        fprintf(stderr, "  blend(1 chunk, metric a, probe suffix %d) vs full: %.3g\n", psufs[i], d);
        CHECK_NEAR(d, 0, LOGIT_TOL);
    }
    /* with several chunks reuse is not exact (each chunk saw only the prefix) */
    CHECK(ensure_all(b, g_k) == 0);
    float *full3 = malloc(sizeof(float) * V);
    o = opts_mode(CB_BLEND_FULL);
    CHECK(run(b, g_k, &o, full3, NULL) == 0);
    o = opts_mode(CB_BLEND_REUSE);
    CHECK(run(b, g_k, &o, re, NULL) == 0);
    fprintf(stderr, "  reuse(%d chunks) vs full: %.3g (expected > 0)\n", g_k, max_diff(full3, re, V));
    CHECK(max_diff(full3, re, V) > LOGIT_TOL);
    cb_blend_destroy(&b);
    rm_dir(dir);
    free(full), free(re), free(full3);
}

/* prefix mode (P and C1 loaded, the rest computed) is exact */
TEST(test_prefix_equals_full) {
    if (!setup()) SKIP("no model");
    int V = g_hp->n_vocab;
    const char *dir = make_dir();
    CHECK(dir);
    char err[256];
    cb_blend_t *b = cb_blend_new(g_eng, dir, NULL, CB_KV_F32, err, sizeof err);
    CHECK(b);
    CHECK(ensure_all(b, g_k) == 0);
    float *full = malloc(sizeof(float) * V), *pf = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_FULL);
    CHECK(run(b, g_k, &o, full, NULL) == 0);
    o = opts_mode(CB_BLEND_PREFIX);
    cb_blend_stats_t st;
    CHECK(run(b, g_k, &o, pf, &st) == 0);
    CHECK(st.chunks_file == 1 && st.tokens_reused == g_np + g_nc);
    double d = max_diff(full, pf, V);
    fprintf(stderr, "  prefix vs full: %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    cb_blend_destroy(&b);
    rm_dir(dir);
    free(full), free(pf);
}

/* pre-RoPE K computed at position p, rotated to q, equals K computed at q */
TEST(test_repositioning) {
    if (!setup()) SKIP("no model");
    char err[256];
    cb_blend_t *b = cb_blend_new(g_eng, NULL, NULL, CB_KV_F32, err, sizeof err);
    CHECK(b);
    const int n = g_nc, KVD = g_hp->n_head_kv * g_hp->head_dim, L = g_hp->n_layer;
    /* the chunk computed after the prefix: positions g_np.. */
    cb_kvmem_entry_t *ent = cb_blend_precompute_chunk(b, g_prefix, g_np, g_chunks[0], n, false, err, sizeof err);
    CHECK_MSG(ent, "%s", err);
    CHECK(cb_kvmem_entry_n_tokens(ent) == n);
    float *k = malloc(sizeof(float) * n * KVD);
    int32_t *pos = malloc(sizeof(int32_t) * n);
    /* (a) the engine's prefill of prefix + chunk holds rope(K_pre, p) at every layer */
    int32_t all[256];
    for (int i = 0; i < g_np; i++) all[i] = g_prefix[i];
    for (int i = 0; i < n; i++) all[g_np + i] = g_chunks[0][i];
    CHECK(cb_engine_prefill(g_eng, all, g_np + n, 0, NULL) == 0);
    double worst = 0;
    for (int l = 0; l < L; l++) {
        memcpy(k, cb_kvmem_entry_k(ent, l), sizeof(float) * n * KVD);
        for (int i = 0; i < n; i++) pos[i] = g_np + i;
        cb_blend_rotate_k(b, k, n, pos);
        double d = max_diff(k, cb_engine_kcache(g_eng, l) + (size_t)g_np * KVD, n * KVD);
        if (d > worst) worst = d;
        CHECK(max_diff(cb_kvmem_entry_v(ent, l), cb_engine_vcache(g_eng, l) + (size_t)g_np * KVD, n * KVD) < 1e-3);
    }
    fprintf(stderr, "  rope(K_pre, p) vs engine K at p, all layers: %.3g\n", worst);
    CHECK(worst < 1e-3);
    /* (b) layer-0 pre-RoPE K depends on the token only: computed at p = g_np + i, rotated to q = 100 + i,
     * equals the engine's K computed at q (the chunk prefilled at pos0 = 100 after other tokens) */
    int32_t filler[100];
    for (int i = 0; i < 100; i++) filler[i] = (int32_t)(500 + i);
    CHECK(cb_engine_prefill(g_eng, filler, 100, 0, NULL) == 0);
    CHECK(cb_engine_prefill(g_eng, g_chunks[0], n, 100, NULL) == 0);
    memcpy(k, cb_kvmem_entry_k(ent, 0), sizeof(float) * n * KVD);
    for (int i = 0; i < n; i++) pos[i] = 100 + i;
    cb_blend_rotate_k(b, k, n, pos);
    double d = max_diff(k, cb_engine_kcache(g_eng, 0) + (size_t)100 * KVD, n * KVD);
    fprintf(stderr, "  layer 0: K at p rotated to q vs K computed at q: %.3g\n", d);
    CHECK(d < 1e-4);
    /* (c) rotations compose: rope(rope(k, p), q - p) = rope(k, q) */
    float *k2 = malloc(sizeof(float) * n * KVD);
    memcpy(k, cb_kvmem_entry_k(ent, 5), sizeof(float) * n * KVD);
    memcpy(k2, k, sizeof(float) * n * KVD);
    for (int i = 0; i < n; i++) pos[i] = 37 + i;
    cb_blend_rotate_k(b, k, n, pos);
    for (int i = 0; i < n; i++) pos[i] = 200;
    cb_blend_rotate_k(b, k, n, pos);
    for (int i = 0; i < n; i++) pos[i] = 237 + i;
    cb_blend_rotate_k(b, k2, n, pos);
    d = max_diff(k, k2, n * KVD);
    fprintf(stderr, "  rotation composition: %.3g\n", d);
    CHECK(d < 1e-3);
    cb_kvmem_entry_release(&ent);
    cb_blend_destroy(&b);
    free(k), free(k2), free(pos);
}

static int in_list(const int32_t *l, int n, int v) {
    for (int i = 0; i < n; i++)
        if (l[i] == v) return 1;
    return 0;
}

/* the selected set holds every suffix row and forced lead rows; its size is forced + floor(r * cand);
 * selection and logits are deterministic, with or without the loader thread */
TEST(test_selection) {
    if (!setup()) SKIP("no model");
    int V = g_hp->n_vocab, N = n_total(g_k);
    const char *dir = make_dir();
    CHECK(dir);
    char err[256];
    cb_blend_t *b = cb_blend_new(g_eng, dir, NULL, CB_KV_F16, err, sizeof err);
    CHECK(b);
    CHECK(ensure_all(b, g_k) == 0);
    float *l1 = malloc(sizeof(float) * V), *l2 = malloc(sizeof(float) * V);
    int32_t *sel = malloc(sizeof(int32_t) * N);
    for (int metric = 0; metric < 3; metric++) {
        cb_blend_opts_t o = opts_mode(CB_BLEND_BLEND);
        o.ratio = 0.2f;
        o.lead_tokens = 2;
        o.metric = "vka"[metric];
        cb_blend_stats_t st;
        CHECK(run(b, g_k, &o, l1, &st) == 0);
        int cand = g_k * (g_nc - 2), forced = g_k * 2 + g_ns;
        CHECK(st.n_candidates == cand && st.n_forced == forced);
        CHECK(st.tokens_recomputed == forced + (int)floor(0.2 * cand + 1e-6));
        int n_sel = st.tokens_recomputed;
        memcpy(sel, st.selected, sizeof(int32_t) * n_sel);
        for (int i = 1; i < n_sel; i++) CHECK(sel[i] > sel[i - 1]);
        for (int i = N - g_ns; i < N; i++) CHECK(in_list(sel, n_sel, i));
        for (int c = 0; c < g_k; c++)
            for (int i = 0; i < 2; i++) CHECK(in_list(sel, n_sel, g_np + c * g_nc + i));
        for (int i = 0; i < g_np; i++) CHECK(!in_list(sel, n_sel, i));
        CHECK((o.metric == 'a') == (st.t_probe_ms > 0.0));
        o.no_overlap = true;
        CHECK(run(b, g_k, &o, l2, &st) == 0);
        CHECK(st.tokens_recomputed == n_sel && !memcmp(st.selected, sel, sizeof(int32_t) * n_sel));
        CHECK(!memcmp(l1, l2, sizeof(float) * V));
        o.no_overlap = false;
        CHECK(run(b, g_k, &o, l2, &st) == 0);
        CHECK(!memcmp(st.selected, sel, sizeof(int32_t) * n_sel));
        CHECK(!memcmp(l1, l2, sizeof(float) * V));
        fprintf(stderr, "  metric %c: %d of %d rows recomputed, load %.1f ms (wait %.1f), select %.2f ms\n", o.metric,
                n_sel, N, st.t_load_ms, st.t_load_wait_ms, st.t_select_ms);
    }
    /* ratio 0: only the forced rows */
    cb_blend_opts_t o = opts_mode(CB_BLEND_BLEND);
    o.ratio = 0.0f;
    o.lead_tokens = 0;
    cb_blend_stats_t st;
    CHECK(run(b, g_k, &o, l1, &st) == 0);
    CHECK(st.tokens_recomputed == g_ns);
    /* gradual filtering (a deviation metric) ends at the same count */
    o.metric = 'v';
    o.ratio = 0.1f;
    o.gradual_ratio = 0.5f;
    o.gradual_end_layer = 5;
    CHECK(run(b, g_k, &o, l1, &st) == 0);
    CHECK(st.tokens_recomputed == g_ns + (int)floor(0.1 * g_k * g_nc + 1e-6));
    CHECK(isfinite(l1[0]));
    cb_blend_destroy(&b);
    rm_dir(dir);
    free(l1), free(l2), free(sel);
}

typedef struct {
    int calls, bad, rows;
} hook_state_t;

static void key_hook(void *ud, int layer, int n, const int32_t *pos, const int32_t *lim) {
    hook_state_t *h = ud;
    (void)layer;
    h->calls++;
    h->rows += n;
    for (int i = 0; i < n; i++)
        if (lim[i] != pos[i] + 1) h->bad++;
}

/* a selected row never attends to a later position: every key limit is pos + 1, and changing the
 * suffix (same length) leaves the fused KV of every earlier row bit-identical */
TEST(test_causal_limits) {
    if (!setup()) SKIP("no model");
    int V = g_hp->n_vocab, N = n_total(g_k), L = g_hp->n_layer, KVD = g_hp->n_head_kv * g_hp->head_dim;
    const char *dir = make_dir();
    CHECK(dir);
    char err[256];
    cb_blend_t *b = cb_blend_new(g_eng, dir, NULL, CB_KV_F16, err, sizeof err);
    CHECK(b);
    CHECK(ensure_all(b, g_k) == 0);
    float *lg = malloc(sizeof(float) * V);
    hook_state_t h = {0, 0, 0};
    cb_blend_opts_t o = opts_mode(CB_BLEND_BLEND);
    o.ratio = 0.3f;
    o.attn_hook = key_hook;
    o.attn_hook_ud = &h;
    cb_blend_stats_t st;
    /* metric a: probe pass and main pass both use exact limits */
    o.metric = 'a';
    o.probe_suffix = 0; /* the whole suffix */
    CHECK(run(b, g_k, &o, lg, &st) == 0);
    CHECK(h.calls >= 2 * L - 1 && h.bad == 0); /* the probe skips the last layer's attention */
    /* a probe of the last 2 suffix rows computes g_ns - 2 rows fewer in each of its L - 1 layers, with exact
     * limits at their moved-up positions */
    int rows_all = h.rows;
    o.probe_suffix = 2;
    h = (hook_state_t){0, 0, 0};
    CHECK(run(b, g_k, &o, lg, &st) == 0);
    CHECK(h.bad == 0);
    CHECK_MSG(rows_all - h.rows == (g_ns - 2) * (L - 1), "probe rows: %d with the whole suffix, %d with 2 of %d",
              rows_all, h.rows, g_ns);
    /* a deviation metric chooses rows from earlier rows only, so the suffix cannot change them */
    o.metric = 'v';
    h = (hook_state_t){0, 0, 0};
    CHECK(run(b, g_k, &o, lg, &st) == 0);
    CHECK(h.calls >= L && h.bad == 0);
    int m = N - g_ns; /* rows before the suffix */
    size_t per = (size_t)m * KVD;
    float *kv = malloc(sizeof(float) * per * 2 * L);
    for (int l = 0; l < L; l++) {
        memcpy(kv + (size_t)2 * l * per, cb_engine_kcache(g_eng, l), sizeof(float) * per);
        memcpy(kv + (size_t)(2 * l + 1) * per, cb_engine_vcache(g_eng, l), sizeof(float) * per);
    }
    int32_t save[32];
    memcpy(save, g_suffix, sizeof(int32_t) * g_ns);
    for (int i = 0; i < g_ns; i++) g_suffix[i] = (int32_t)(7000 + i);
    CHECK(run(b, g_k, &o, lg, &st) == 0);
    memcpy(g_suffix, save, sizeof(int32_t) * g_ns);
    int same = 1;
    for (int l = 0; l < L; l++) {
        same &= !memcmp(kv + (size_t)2 * l * per, cb_engine_kcache(g_eng, l), sizeof(float) * per);
        same &= !memcmp(kv + (size_t)(2 * l + 1) * per, cb_engine_vcache(g_eng, l), sizeof(float) * per);
    }
    CHECK_MSG(same, "the fused KV of rows before the suffix depends on the suffix");
    cb_blend_destroy(&b);
    rm_dir(dir);
    free(lg), free(kv);
}

/* Path of chunk c's file. */
static void chunk_path(cb_blend_t *b, const char *dir, int c, char *path, size_t len) {
    uint8_t key[32];
    cb_blend_chunk_key(b, g_prefix, g_np, g_ch[c].tokens, g_ch[c].n, key);
    CHECK(cb_kvfile_path(dir, key, path, len) == 0);
}

static int flip_byte(const char *path, long off_from_end) {
    int fd = open(path, O_RDWR);
    if (fd < 0) return -1;
    struct stat s;
    fstat(fd, &s);
    off_t off = s.st_size - off_from_end;
    unsigned char c;
    int ok = pread(fd, &c, 1, off) == 1;
    c ^= 0x40;
    ok = ok && pwrite(fd, &c, 1, off) == 1;
    close(fd);
    return ok ? 0 : -1;
}

/* a corrupt (payload or header), truncated or missing chunk file is a miss: recomputed, stored, and the
 * result equals the one with good files */
TEST(test_file_miss_recomputed) {
    if (!setup()) SKIP("no model");
    int V = g_hp->n_vocab;
    const char *dir = make_dir();
    CHECK(dir);
    char err[256], path[512];
    cb_blend_t *b = cb_blend_new(g_eng, dir, NULL, CB_KV_F16, err, sizeof err);
    CHECK(b);
    CHECK(ensure_all(b, g_k) == 0);
    float *good = malloc(sizeof(float) * V), *lg = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_BLEND);
    cb_blend_stats_t st;
    CHECK(run(b, g_k, &o, good, &st) == 0);
    CHECK(st.chunks_file == g_k && st.restarts == 0);
    /* payload corruption in the last layer: found while streaming, the prefill restarts */
    chunk_path(b, dir, 1, path, sizeof path);
    CHECK(flip_byte(path, 10) == 0);
    CHECK(run(b, g_k, &o, lg, &st) == 0);
    CHECK(st.restarts == 1 && st.chunks_computed == 1);
    CHECK(!memcmp(good, lg, sizeof(float) * V));
    CHECK(run(b, g_k, &o, lg, &st) == 0); /* rewritten: a hit again */
    CHECK(st.chunks_file == g_k && st.restarts == 0 && st.chunks_computed == 0);
    /* header corruption: a miss at open */
    chunk_path(b, dir, 0, path, sizeof path);
    struct stat s;
    CHECK(stat(path, &s) == 0);
    CHECK(flip_byte(path, s.st_size - 20) == 0);
    CHECK(run(b, g_k, &o, lg, &st) == 0);
    CHECK(st.chunks_computed == 1 && st.restarts == 0);
    CHECK(!memcmp(good, lg, sizeof(float) * V));
    /* truncated */
    chunk_path(b, dir, 2, path, sizeof path);
    CHECK(truncate(path, 100) == 0);
    CHECK(run(b, g_k, &o, lg, &st) == 0);
    CHECK(st.chunks_computed == 1);
    CHECK(!memcmp(good, lg, sizeof(float) * V));
    /* missing */
    chunk_path(b, dir, 1, path, sizeof path);
    CHECK(unlink(path) == 0);
    CHECK(run(b, g_k, &o, lg, &st) == 0);
    CHECK(st.chunks_computed == 1);
    CHECK(!memcmp(good, lg, sizeof(float) * V));
    /* ensure_chunk reports the reason of a miss */
    CHECK(flip_byte(path, 10) == 0);
    cb_blend_src_t src;
    cb_kv_miss_t why;
    CHECK(cb_blend_ensure_chunk(b, g_prefix, g_np, g_ch[1].tokens, g_ch[1].n, &src, &why, err, sizeof err) == 0);
    CHECK(src == CB_BLEND_SRC_COMPUTED && why == CB_KV_MISS_PAYLOAD_CHECKSUM);
    CHECK(cb_blend_ensure_chunk(b, g_prefix, g_np, g_ch[1].tokens, g_ch[1].n, &src, &why, err, sizeof err) == 0);
    CHECK(src == CB_BLEND_SRC_FILE && why == CB_KV_OK);
    cb_blend_destroy(&b);
    rm_dir(dir);
    free(good), free(lg);
}

/* the memory tier: files stream into it, the next prefill hits it, results are identical (bf16 files:
 * the blend's own conversion of streamed rows equals kvfile's decoding into the tier) */
TEST(test_memory_tier) {
    if (!setup()) SKIP("no model");
    int V = g_hp->n_vocab;
    const char *dir = make_dir();
    CHECK(dir);
    char err[256];
    cb_blend_t *b0 = cb_blend_new(g_eng, dir, NULL, CB_KV_BF16, err, sizeof err);
    CHECK(b0);
    CHECK(ensure_all(b0, g_k) == 0);
    float *a = malloc(sizeof(float) * V), *c = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_BLEND);
    CHECK(run(b0, g_k, &o, a, NULL) == 0);
    cb_blend_destroy(&b0);
    cb_kvmem_t *mem = cb_kvmem_new(64u << 20);
    cb_blend_t *b = cb_blend_new(g_eng, dir, mem, CB_KV_BF16, err, sizeof err);
    CHECK(b);
    cb_blend_stats_t st;
    CHECK(run(b, g_k, &o, c, &st) == 0);
    CHECK(st.chunks_file == g_k);
    CHECK(!memcmp(a, c, sizeof(float) * V));
    CHECK(run(b, g_k, &o, c, &st) == 0);
    CHECK(st.chunks_mem == g_k && st.chunks_file == 0);
    CHECK(!memcmp(a, c, sizeof(float) * V));
    cb_kvmem_entry_t *e = cb_blend_load_chunk(b, g_prefix, g_np, g_ch[0].tokens, g_ch[0].n, NULL, NULL, err, sizeof err);
    CHECK(e && cb_kvmem_entry_n_tokens(e) == g_nc);
    cb_kvmem_entry_release(&e);
    cb_blend_destroy(&b);
    cb_kvmem_destroy(&mem);
    rm_dir(dir);
    free(a), free(c);
}

TEST(test_bad_args) {
    if (!setup()) SKIP("no model");
    char err[256];
    CHECK(cb_blend_new(NULL, NULL, NULL, CB_KV_F16, err, sizeof err) == NULL);
    CHECK(cb_blend_new(g_eng, "/nonexistent/dir", NULL, CB_KV_F16, err, sizeof err) == NULL);
    CHECK(cb_blend_new(g_eng, NULL, NULL, (cb_kv_dtype_t)7, err, sizeof err) == NULL);
    cb_blend_t *b = cb_blend_new(g_eng, NULL, NULL, CB_KV_F16, err, sizeof err);
    CHECK(b);
    float *lg = malloc(sizeof(float) * g_hp->n_vocab);
    cb_blend_opts_t o = opts_mode(CB_BLEND_FULL);
    int32_t bad[2] = {1, g_hp->n_vocab};
    CHECK(cb_blend_prefill(b, g_prefix, g_np, NULL, 0, bad, 2, &o, lg, NULL, err, sizeof err) == -1);
    CHECK(strstr(err, "vocabulary"));
    CHECK(cb_blend_prefill(b, g_prefix, g_np, NULL, 0, g_suffix, 0, &o, lg, NULL, err, sizeof err) == -1);
    cb_blend_chunk_t big[24];
    for (int i = 0; i < 24; i++) big[i] = g_ch[0];
    CHECK(cb_blend_prefill(b, g_prefix, g_np, big, 24, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == -1);
    CHECK(strstr(err, "max_ctx"));
    cb_blend_chunk_t empty = {g_chunks[0], 0};
    CHECK(cb_blend_prefill(b, g_prefix, g_np, &empty, 1, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == -1);
    o.ratio = 1.5f;
    CHECK(cb_blend_prefill(b, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == -1);
    o = opts_mode(CB_BLEND_BLEND);
    o.check_layer = g_hp->n_layer;
    CHECK(cb_blend_prefill(b, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == -1);
    o = opts_mode(CB_BLEND_BLEND);
    o.metric = 'q';
    CHECK(cb_blend_prefill(b, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == -1);
    o = opts_mode(CB_BLEND_BLEND);
    o.metric = 'a'; /* gradual filtering re-measures a deviation: not with the attention metric */
    o.ratio = 0.1f;
    o.gradual_ratio = 0.5f;
    o.gradual_end_layer = 3;
    CHECK(cb_blend_prefill(b, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == -1);
    CHECK(strstr(err, "gradual"));
    o = opts_mode(CB_BLEND_BLEND);
    o.probe_layers = g_hp->n_layer + 1;
    CHECK(cb_blend_prefill(b, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == -1);
    CHECK(strstr(err, "probe layers"));
    o.probe_layers = -1;
    CHECK(cb_blend_prefill(b, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == -1);
    o = opts_mode(CB_BLEND_BLEND);
    o.probe_suffix = -1;
    CHECK(cb_blend_prefill(b, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == -1);
    CHECK(strstr(err, "probe suffix"));
    o = opts_mode(CB_BLEND_BLEND);
    o.mode = (cb_blend_mode_t)9;
    CHECK(cb_blend_prefill(b, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == -1);
    CHECK(cb_blend_precompute_chunk(b, g_prefix, g_np, bad, 2, false, err, sizeof err) == NULL);
    CHECK(cb_blend_mode_parse("blend") == CB_BLEND_BLEND && cb_blend_mode_parse("x") == -1);
    CHECK(cb_blend_metric_parse("a") == 'a' && cb_blend_metric_parse("v") == 'v' && cb_blend_metric_parse("k") == 'k');
    CHECK(!cb_blend_metric_parse("q") && !cb_blend_metric_parse("") && !cb_blend_metric_parse("kv") && !cb_blend_metric_parse(NULL));
    CHECK(!strcmp(cb_blend_mode_str(CB_BLEND_REUSE), "reuse"));
    /* no chunks at all: prefix + suffix works in every mode */
    o = opts_mode(CB_BLEND_BLEND);
    CHECK(cb_blend_prefill(b, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == 0);
    cb_blend_destroy(&b);
    free(lg);
}

int main(void) {
    RUN(test_full_equals_engine_prefill);
    RUN(test_blend_ratio1_equals_full);
    RUN(test_reuse_single_chunk_equals_full);
    RUN(test_prefix_equals_full);
    RUN(test_repositioning);
    RUN(test_selection);
    RUN(test_causal_limits);
    RUN(test_file_miss_recomputed);
    RUN(test_memory_tier);
    RUN(test_bad_args);
    cb_engine_destroy(&g_eng);
    cb_model_destroy(&g_model);
    return test_summary();
}
