/* test_blend: the CacheBlend fused prefill with small synthetic prompts (prefix + a few chunks + suffix,
 * ~200 tokens; smaller under sanitizers): exactness of full/prefix/reuse/blend(1.0) against full,
 * re-positioning of pre-RoPE K, selection (forced rows, determinism, counts, gradual), exact causal key
 * limits (hook and a behavioural check), the loader overlap, KV file misses (missing, corrupt payload,
 * truncated), the memory tier, the prefix's blocks shared by reference between the store's context
 * sequence and the request's, and a full KV pool (CB_ENGINE_EPOOL).
 *
 * Model: the real SmolLM2 model (test_model_path()) when present, else a synthetic llama model
 * (model/synth.h, Q4_1 like the real file: 6 layers, 3/1 heads of 64, vocabulary 16384 so the prompts' token
 * ids exist) written to a temporary directory; CB_TEST_SYNTH=1 forces the synthetic model. Every assertion
 * runs on both: they are about structure and exactness, not about the real model's numbers.
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
#include "kv/kvstore.h"
#include "model/model.h"
#include "model/synth.h"
#include "engine/sampler.h"
#include "test.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#define LOGIT_TOL 2e-3
#define MAX_CTX 320

static cb_model_t *g_model;
static cb_engine_t *g_eng;
static const cb_hparams_t *g_hp;
static int g_synth;            /* the synthetic model stands in for the real one */
static char g_setup_err[512];
static int g_np, g_nc, g_k, g_ns; /* prefix, chunk length, chunks, suffix */

static int32_t g_prefix[64], g_chunks[4][128], g_suffix[32];
static cb_blend_chunk_t g_ch[4];

static uint32_t g_rng = 12345;
static int32_t rnd_tok(void) {
    g_rng = g_rng * 1664525u + 1013904223u;
    return (int32_t)(300 + (g_rng >> 8) % 15000);
}

static int synth_forced(void) {
    const char *s = getenv("CB_TEST_SYNTH");
    return s && *s && strcmp(s, "0") != 0;
}

/* The synthetic stand-in (llama, or $CB_TEST_ARCH): small, but with the real model's GQA ratio, head size and weight types, enough
 * layers for the check/gradual/probe layers the tests name, and every token id the prompts use
 * (rnd_tok: 300..15299). Written to a temporary directory, loaded, and the file removed. */
static cb_model_t *synth_model(char *err, size_t errlen) {
    cb_synth_shape_t s;
    memset(&s, 0, sizeof s);
    snprintf(s.name, sizeof s.name, "test-blend");
    s.n_layer = 6, s.n_embd = 192, s.n_head = 3, s.n_head_kv = 1, s.n_ff = 256, s.n_vocab = 16384;
    s.n_ctx = 2 * MAX_CTX, s.rope_base = 100000.0f, s.rms_eps = 1e-5f, s.tied = true;
    /* CB_TEST_ARCH=llama3|qwen2|qwen3 (tests/run.sh): the same tests on another architecture's layer */
    const char *arch = getenv("CB_TEST_ARCH");
    if (arch && *arch && !cb_synth_arch_parse(arch, &s.arch)) {
        snprintf(err, errlen, "CB_TEST_ARCH='%s': not a synthetic architecture", arch);
        return NULL;
    }
    char dir[64], path[128];
    snprintf(dir, sizeof dir, "/tmp/test_blend_model.XXXXXX");
    if (!mkdtemp(dir)) {
        snprintf(err, errlen, "mkdtemp: %s", strerror(errno));
        return NULL;
    }
    snprintf(path, sizeof path, "%s/synth.gguf", dir);
    cb_model_t *m = NULL;
    if (cb_synth_write(path, &s, CB_SYNTH_Q4_1, 2024, err, errlen) == 0) m = cb_model_load(path, err, errlen);
    unlink(path);
    rmdir(dir);
    return m;
}

/* Loads the model (once) and makes the engine and the prompts; 0 with g_setup_err on failure. */
static int setup(void) {
    if (g_eng) return 1;
    if (g_setup_err[0]) return 0; /* failed before */
    char err[256] = "";
    const char *path = synth_forced() ? NULL : test_model_path();
    /* the f32 reference numerics unless CB_TEST_NUMERICS=native: the tests compare runs that do the same
     * computation through different calls (full blend = prefill, split loads, ...), which the int8 matvecs
     * of calls of <= 8 rows (engine.h) would move by ~0.5 and hide the bookkeeping they check */
    const char *num = getenv("CB_TEST_NUMERICS");
    const bool native = num && !strcmp(num, "native");
    if (!native) setenv("CB_ENGINE_WEIGHTS", "f32", 1);
    if (path) {
        g_model = cb_model_load(path, err, sizeof err);
        if (!g_model) {
            snprintf(g_setup_err, sizeof g_setup_err, "load %s: %s", path, err);
            return 0;
        }
    } else {
        g_synth = 1;
        g_model = synth_model(err, sizeof err);
        if (!g_model) {
            snprintf(g_setup_err, sizeof g_setup_err, "synthetic model: %s", err);
            return 0;
        }
    }
    unsetenv("CB_ENGINE_WEIGHTS");
    g_hp = cb_model_hparams(g_model);
    fprintf(stderr, "  model: %s (%d layers, vocabulary %d)\n", g_synth ? "synthetic" : path, g_hp->n_layer,
            g_hp->n_vocab);
    /* room for a few sequences of MAX_CTX at once (the store's context and chunk sequences, requests). An f32
     * KV pool and f32 prefill attention: the tolerances here (LOGIT_TOL, the KV comparisons) are those of the
     * f32 reference numerics (bf16 attention's are test_engine.c's);
     * the f16 pool's own numerics are tests/unit/test_kvf16.c's (on f16, blend(1.0) vs full measured 3.5e-3,
     * prefix vs full 4.6e-3) */
    const size_t per_pos = (size_t)2 * g_hp->n_layer * g_hp->n_head_kv * g_hp->head_dim * sizeof(float);
    cb_engine_opts_t eo = {.max_ctx = MAX_CTX, .kv_pool_bytes = 6 * MAX_CTX * per_pos, .block_tokens = 0,
                           .kv_dtype = CB_ENGINE_KV_F32, .attn = CB_ENGINE_ATTN_F32};
    g_eng = cb_engine_new_opts(g_model, &eo, err, sizeof err);
    if (!g_eng) {
        snprintf(g_setup_err, sizeof g_setup_err, "engine: %s", err);
        return 0;
    }
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

#define SETUP() CHECK_MSG(setup(), "setup: %s", g_setup_err)

/* A store, a blend over it and a request sequence. */
typedef struct {
    cb_kvstore_t *store;
    cb_blend_t *b;
    cb_seq_t *seq;
} fix_t;

static int fix_open(fix_t *f, const char *dir, cb_kvmem_t *mem, cb_kv_dtype_t dtype) {
    char err[256] = "";
    memset(f, 0, sizeof *f);
    f->store = cb_kvstore_new(g_eng, dir, mem, dtype, err, sizeof err);
    if (f->store) f->b = cb_blend_new(f->store, err, sizeof err);
    if (f->b) f->seq = cb_seq_new(g_eng);
    if (!f->seq) fprintf(stderr, "  fixture: %s\n", err[0] ? err : "no sequence");
    return f->seq ? 0 : -1;
}

static void fix_close(fix_t *f) {
    cb_seq_destroy(&f->seq);
    cb_blend_destroy(&f->b);
    cb_kvstore_destroy(&f->store);
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

/* Runs one prefill of the fixture's blend into its sequence; 0 on success. */
static int run(fix_t *f, int k, const cb_blend_opts_t *o, float *logits, cb_blend_stats_t *st) {
    char err[256] = "";
    int rc = cb_blend_prefill(f->b, f->seq, g_prefix, g_np, g_ch, k, g_suffix, g_ns, o, logits, st, err, sizeof err);
    if (rc) fprintf(stderr, "  prefill: %s (%s)\n", err, cb_engine_status_str(rc));
    return rc;
}

static int ensure_all(fix_t *f, int k) {
    char err[256] = "";
    for (int c = 0; c < k; c++)
        if (cb_kvstore_ensure(f->store, g_prefix, g_np, g_ch[c].tokens, g_ch[c].n, NULL, NULL, err, sizeof err)) {
            fprintf(stderr, "  ensure: %s\n", err);
            return -1;
        }
    return 0;
}

/* A new directory with f16 files of every chunk, and a fixture over it: the directory, or NULL. */
static const char *fix_ready(fix_t *f) {
    const char *dir = make_dir();
    if (!dir) return NULL;
    if (fix_open(f, dir, NULL, CB_KV_F16) != 0 || ensure_all(f, g_k) != 0) {
        fix_close(f);
        rm_dir(dir);
        return NULL;
    }
    return dir;
}

/* full through the blend path = the engine's own prefill; the fused KV then serves decoding */
TEST(test_full_equals_engine_prefill) {
    SETUP();
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
    fix_t f;
    CHECK(fix_open(&f, NULL, NULL, CB_KV_F16) == 0);
    CHECK(cb_blend_store(f.b) == f.store && cb_kvstore_engine(f.store) == g_eng);
    CHECK(cb_engine_prefill(g_eng, f.seq, all, N, 0, a) == CB_ENGINE_OK);
    CHECK(cb_engine_decode(g_eng, f.seq, all[N], N, d1) == CB_ENGINE_OK);
    cb_blend_opts_t o = opts_mode(CB_BLEND_FULL);
    cb_blend_stats_t st;
    CHECK(run(&f, g_k, &o, b2, &st) == 0); /* into the same sequence: cleared first */
    CHECK(st.tokens_recomputed == N && st.tokens_reused == 0 && st.n_tokens == N);
    double d = max_diff(a, b2, V);
    fprintf(stderr, "  full vs engine prefill: max |dlogit| = %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    CHECK(cb_engine_decode(g_eng, f.seq, all[N], N, d2) == CB_ENGINE_OK);
    d = max_diff(d1, d2, V);
    fprintf(stderr, "  decode after full blend vs after prefill: %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    cb_blend_destroy(&f.b);
    cb_blend_destroy(&f.b); /* NULL-safe */
    fix_close(&f);
    free(a), free(b2), free(d1), free(d2), free(all);
}

/* blend at ratio 1.0 recomputes every chunk row: the same as full (f16 files; cached values only rank) */
TEST(test_blend_ratio1_equals_full) {
    SETUP();
    int V = g_hp->n_vocab;
    const char *dir = make_dir();
    CHECK(dir);
    char err[256];
    fix_t f;
    CHECK(fix_open(&f, dir, NULL, CB_KV_F16) == 0);
    CHECK(ensure_all(&f, g_k) == 0);
    float *full = malloc(sizeof(float) * V), *bl = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_FULL);
    CHECK(run(&f, g_k, &o, full, NULL) == 0);
    o = opts_mode(CB_BLEND_BLEND);
    o.ratio = 1.0f;
    cb_blend_stats_t st;
    CHECK(run(&f, g_k, &o, bl, &st) == 0);
    CHECK(st.chunks_file == g_k && st.chunks_computed == 0);
    CHECK(st.tokens_recomputed == n_total(g_k) - g_np); /* everything but the (exact) prefix */
    double d = max_diff(full, bl, V);
    fprintf(stderr, "  blend(1.0) vs full: max |dlogit| = %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    /* the attention metric at ratio 1.0 is exact too (its probe pass only chooses rows) */
    o.metric = 'a';
    CHECK(run(&f, g_k, &o, bl, &st) == 0);
    CHECK(st.tokens_recomputed == n_total(g_k) - g_np);
    CHECK(st.t_probe_ms == 0.0); /* nothing to choose: no probe */
    d = max_diff(full, bl, V);
    fprintf(stderr, "  blend(1.0, metric a) vs full: max |dlogit| = %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    o.metric = 'v';
    /* and with gradual filtering from 1.0 down to 1.0 is not allowed (start must exceed ratio) */
    o.gradual_ratio = 1.0f;
    o.gradual_end_layer = 3;
    CHECK(cb_blend_prefill(f.b, f.seq, g_prefix, g_np, g_ch, g_k, g_suffix, g_ns, &o, bl, NULL, err, sizeof err) ==
          CB_ENGINE_EINVAL);
    fix_close(&f);
    rm_dir(dir);
    free(full), free(bl);
}

/* The candidate rows (positions below `lim`) the main pass computes: a pass's layer-0 calls after any call at
 * a later layer start a new pass, so the last pass's counts remain. */
typedef struct {
    int lim, last_layer, n;
    double sum;
} pos_state_t;

static void pos_hook(void *ud, int layer, int n, const int32_t *pos, const int32_t *lim) {
    pos_state_t *p = ud;
    (void)lim;
    if (layer == 0 && p->last_layer > 0) p->n = 0, p->sum = 0.0;
    p->last_layer = layer;
    if (layer != 0) return;
    for (int i = 0; i < n; i++)
        if (pos[i] < p->lim) p->n++, p->sum += pos[i];
}

/* What the sparse hook saw in the last main pass (layer-0 calls after a later layer start a new pass). */
typedef struct {
    float share;               /* opts.sparse_keys */
    int last_layer, rows, calls, bad;
} sparse_state_t;

static void sparse_hook(void *ud, int layer, int n, const int32_t *pos, const int32_t *lim, const int32_t *blk,
                        int n_blk, int bt) {
    sparse_state_t *st = ud;
    if (layer == 0 && st->last_layer > 0) st->rows = 0, st->calls = 0;
    st->last_layer = layer;
    st->calls++;
    if (layer == 0) st->rows += n;
    const int p_end = (g_np + bt - 1) / bt, c_end = (n_total(g_k) - g_ns) / bt;
    const int kept_max = (int)ceil((double)st->share * (c_end - p_end) - 1e-9);
    for (int i = 0; i < n; i++) {
        const int p = pos[i], c0 = g_np + (p - g_np) / g_nc * g_nc; /* the row's chunk starts at c0 */
        if (p < g_np || p >= n_total(g_k) - g_ns || lim[i] < 1 || lim[i] > n_blk * bt) {
            st->bad++;
            continue;
        }
        /* the keys row i attends: strictly rising, ending at itself, the whole prefix and its chunk up to itself */
        int prev = -1, n_pre = 0, n_own = 0, mid = 0, last_mid = -1;
        for (int k = 0; k < lim[i]; k++) {
            const int kp = blk[k / bt] * bt + k % bt;
            if (kp <= prev || kp > p) st->bad++;
            prev = kp;
            n_pre += kp < g_np;
            n_own += kp >= c0;
            if (kp / bt >= p_end && kp / bt < c0 / bt && kp / bt != last_mid) mid++, last_mid = kp / bt;
        }
        if (prev != p || n_pre != g_np || n_own != p - c0 + 1 || mid > kept_max) st->bad++;
    }
}

/* opts.sparse_keys: the chosen rows attend the prefix, their own chunk up to themselves and at most the
 * asked share of the other chunk blocks (the hook checks every call); deterministic; every block kept is
 * the dense blend within LOGIT_TOL; out-of-range shares are refused; metrics without a probe ignore it */
TEST(test_sparse_keys) {
    SETUP();
    int V = g_hp->n_vocab;
    fix_t f;
    const char *dir = fix_ready(&f);
    CHECK(dir);
    float *dense = malloc(sizeof(float) * V), *a = malloc(sizeof(float) * V), *b2 = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_BLEND);
    o.ratio = 0.5f;
    o.sparse_keys = 0.0f; /* the dense reference */
    const bool win0 = cb_model_layer(cb_engine_model(g_eng), 0)->window > 0;
    cb_blend_stats_t sd, s1, s2;
    CHECK(run(&f, g_k, &o, dense, &sd) == 0);
    const float shares[] = {1.0f, 0.5f, 0.25f, 0.01f};
    for (size_t i = 0; i < sizeof shares / sizeof shares[0]; i++) {
        sparse_state_t st = {.share = shares[i]};
        o.sparse_keys = shares[i];
        o.sparse_hook = sparse_hook;
        o.attn_hook_ud = &st;
        CHECK(run(&f, g_k, &o, a, &s1) == 0);
        CHECK(run(&f, g_k, &o, b2, &s2) == 0);
        double d = max_diff(dense, a, V);
        fprintf(stderr, "  sparse keys %.2f: %d calls, %d rows at layer 0 (%d chosen), max |dlogit| vs dense %.3g\n",
                (double)shares[i], st.calls, st.rows, s1.n_chosen, d);
        CHECK(st.bad == 0);
        if (win0) /* windowed layers attend densely (blend.c): gemma3's synthetic layers 0-4; 5 computes the last row */
            CHECK(s1.n_chosen == sd.n_chosen && st.rows == 0);
        else
            CHECK(st.rows == s1.n_chosen && s1.n_chosen == sd.n_chosen && st.rows > 0); /* every chosen row, sparse */
        CHECK(max_diff(a, b2, V) == 0.0);                                           /* deterministic */
        CHECK(s1.tokens_recomputed == sd.tokens_recomputed);
        if (shares[i] == 1.0f) CHECK_NEAR(d, 0, LOGIT_TOL);
    }
    /* auto chooses the same rows with and without sparse keys (they change the main pass only) */
    o.sparse_hook = NULL;
    o.attn_hook_ud = NULL;
    o.auto_target = 0.6f;
    o.sparse_keys = 0.0f;
    CHECK(run(&f, g_k, &o, a, &s1) == 0);
    o.sparse_keys = 0.25f;
    CHECK(run(&f, g_k, &o, a, &s2) == 0);
    CHECK(s1.n_chosen == s2.n_chosen);
    char err[256];
    o = opts_mode(CB_BLEND_BLEND);
    const float bad[] = {-0.1f, 1.5f, NAN};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        o.sparse_keys = bad[i];
        CHECK(cb_blend_prefill(f.b, f.seq, g_prefix, g_np, g_ch, g_k, g_suffix, g_ns, &o, a, NULL, err, sizeof err) ==
              CB_ENGINE_EINVAL);
    }
    /* metrics without a probe ignore it: the dense blend, bit for bit */
    o.metric = 'v';
    o.sparse_keys = 0.0f;
    CHECK(run(&f, g_k, &o, dense, NULL) == 0);
    sparse_state_t st = {.share = 0.25f};
    o.sparse_keys = 0.25f;
    o.sparse_hook = sparse_hook;
    o.attn_hook_ud = &st;
    CHECK(run(&f, g_k, &o, a, NULL) == 0);
    CHECK(st.calls == 0 && max_diff(dense, a, V) == 0.0);
    fix_close(&f);
    rm_dir(dir);
    free(dense), free(a), free(b2);
}

/* ratio = auto: deterministic; never below the floor nor above the ceiling; easy targets choose fewer
 * rows than hard ones; target 1.0 chooses every candidate and then equals full; both metrics */
TEST(test_ratio_auto) {
    SETUP();
    int V = g_hp->n_vocab;
    fix_t f;
    const char *dir = fix_ready(&f);
    CHECK(dir);
    float *full = malloc(sizeof(float) * V), *a = malloc(sizeof(float) * V), *b2 = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_FULL);
    CHECK(run(&f, g_k, &o, full, NULL) == 0);
    const char metrics[3] = {'a', 'v', 'a'};
    const float costs[3] = {0.0f, 0.0f, 4.0f}; /* the last: metric a ranked by mass per cost */
    for (int mi = 0; mi < 3; mi++) {
        o = opts_mode(CB_BLEND_BLEND);
        o.metric = metrics[mi];
        o.auto_cost_keys = costs[mi];
        o.ratio = 0.77f; /* not used with auto */
        o.auto_floor = 0.05f;
        o.auto_ceil = 0.5f;
        cb_blend_stats_t s1, s2;
        int prev = -1;
        const float targets[] = {0.05f, 0.3f, 0.6f, 0.9f, 0.999f};
        for (size_t t = 0; t < sizeof targets / sizeof targets[0]; t++) {
            o.auto_target = targets[t];
            CHECK(run(&f, g_k, &o, a, &s1) == 0);
            CHECK(run(&f, g_k, &o, b2, &s2) == 0);
            int m = s1.n_candidates, lo = (int)floor(0.05 * m + 1e-9), hi = (int)ceil(0.5 * m - 1e-9);
            fprintf(stderr, "  metric %c, cost %g, auto target %.3f: %d of %d candidates (ratio %.3f), %d recomputed\n",
                    o.metric, (double)o.auto_cost_keys, (double)targets[t], s1.n_chosen, m, (double)s1.ratio_chosen,
                    s1.tokens_recomputed);
            CHECK(m > 0);
            CHECK(s1.n_chosen == s2.n_chosen && s1.tokens_recomputed == s2.tokens_recomputed); /* deterministic */
            CHECK(max_diff(a, b2, V) == 0.0);
            CHECK(s1.n_chosen >= lo && s1.n_chosen <= hi); /* floor and ceiling */
            CHECK(s1.n_chosen >= prev);                     /* a higher target never chooses fewer */
            CHECK_NEAR(s1.ratio_chosen, (double)s1.n_chosen / m, 1e-6);
            prev = s1.n_chosen;
        }
        CHECK(prev == (int)ceil(0.5 * s1.n_candidates - 1e-9)); /* 0.999 of the mass needs more than half: the ceiling */
        o.auto_target = 1e-6f;
        CHECK(run(&f, g_k, &o, a, &s1) == 0);
        CHECK(s1.n_chosen == (int)floor(0.05 * s1.n_candidates + 1e-9)); /* a tiny target: the floor */
        o.auto_target = 1.0f;
        CHECK(run(&f, g_k, &o, a, &s1) == 0);
        CHECK(s1.n_chosen == s1.n_candidates && s1.ratio_chosen == 1.0f);
        CHECK(s1.tokens_recomputed == n_total(g_k) - g_np);
        double d = max_diff(full, a, V);
        fprintf(stderr, "  metric %c, auto target 1.0 vs full: max |dlogit| = %.3g\n", o.metric, d);
        CHECK_NEAR(d, 0, LOGIT_TOL);
    }
    /* ranked by mass per cost (1 + pos / 4 keys), auto covers the same share of the mass with earlier rows */
    double mean[2];
    for (int c = 0; c < 2; c++) {
        o = opts_mode(CB_BLEND_BLEND);
        o.auto_target = 0.6f;
        o.auto_cost_keys = c ? 4.0f : 0.0f;
        o.sparse_keys = 0.0f; /* every chosen row in the dense calls the hook sees */
        pos_state_t ps = {n_total(g_k) - g_ns, 0, 0, 0.0};
        o.attn_hook = pos_hook;
        o.attn_hook_ud = &ps;
        cb_blend_stats_t sc;
        CHECK(run(&f, g_k, &o, a, &sc) == 0);
        CHECK(ps.n == sc.n_chosen && ps.n > 0);
        mean[c] = ps.sum / ps.n;
        fprintf(stderr, "  auto target 0.6, cost %g: %d chosen, mean position %.1f\n", (double)o.auto_cost_keys,
                sc.n_chosen, mean[c]);
    }
    CHECK(mean[1] < mean[0]);
    o = opts_mode(CB_BLEND_BLEND);
    o.auto_target = 0.5f;
    o.auto_cost_keys = -1.0f;
    char cerr[256];
    CHECK(cb_blend_prefill(f.b, f.seq, g_prefix, g_np, g_ch, g_k, g_suffix, g_ns, &o, a, NULL, cerr, sizeof cerr) ==
          CB_ENGINE_EINVAL);
    /* a fixed ratio reports what it chose too */
    o = opts_mode(CB_BLEND_BLEND);
    cb_blend_stats_t st;
    CHECK(run(&f, g_k, &o, a, &st) == 0);
    CHECK(st.n_chosen == (int)floor(CB_BLEND_DEFAULT_RATIO * st.n_candidates + 1e-6));
    /* bad auto options */
    char err[256];
    o.auto_target = 1.5f;
    CHECK(cb_blend_prefill(f.b, f.seq, g_prefix, g_np, g_ch, g_k, g_suffix, g_ns, &o, a, NULL, err, sizeof err) ==
          CB_ENGINE_EINVAL);
    o.auto_target = 0.5f;
    o.auto_floor = 0.6f;
    o.auto_ceil = 0.5f;
    CHECK(cb_blend_prefill(f.b, f.seq, g_prefix, g_np, g_ch, g_k, g_suffix, g_ns, &o, a, NULL, err, sizeof err) ==
          CB_ENGINE_EINVAL);
    o = opts_mode(CB_BLEND_BLEND);
    o.metric = 'v';
    o.auto_target = 0.5f;
    o.gradual_ratio = 0.5f;
    o.gradual_end_layer = 3;
    CHECK(cb_blend_prefill(f.b, f.seq, g_prefix, g_np, g_ch, g_k, g_suffix, g_ns, &o, a, NULL, err, sizeof err) ==
          CB_ENGINE_EINVAL);
    fix_close(&f);
    rm_dir(dir);
    free(full), free(a), free(b2);
}

/* q8_0 (int8 per 32-value block) chunk files: blend and reuse read them and stay close to the same modes
 * over f16 files (what the int8 error costs). Without a memory tier the CPU backend's row load dequantizes
 * the file's mapping itself; with one the file is decoded into an f32 entry first: the same logits, bit for
 * bit. */
TEST(test_q8_files) {
    SETUP();
    if ((g_hp->n_head_kv * g_hp->head_dim) % 32) {
        fprintf(stderr, "  skip: kv_dim %d is not a multiple of 32\n", g_hp->n_head_kv * g_hp->head_dim);
        return;
    }
    int V = g_hp->n_vocab;
    const char *dirs[2];
    char d16[256], d8[256];
    snprintf(d16, sizeof d16, "%s", make_dir());
    snprintf(d8, sizeof d8, "%s", make_dir());
    dirs[0] = d16, dirs[1] = d8;
    float *l16 = malloc(sizeof(float) * V), *l8 = malloc(sizeof(float) * V);
    /* [mode] without a memory tier; the third mode is blend with metric v (its deviation reads the cached
     * rows themselves) */
    float *l8raw[3] = {malloc(sizeof(float) * V), malloc(sizeof(float) * V), malloc(sizeof(float) * V)};
    const cb_blend_mode_t modes[3] = {CB_BLEND_BLEND, CB_BLEND_REUSE, CB_BLEND_BLEND};
    for (int with_mem = 0; with_mem < 2; with_mem++)
        for (int mi = 0; mi < 3; mi++) {
            cb_kvmem_t *mem = with_mem ? cb_kvmem_new(64 << 20) : NULL;
            fix_t f16, f8;
            CHECK(fix_open(&f16, dirs[0], NULL, CB_KV_F16) == 0 && fix_open(&f8, dirs[1], mem, CB_KV_Q8_0) == 0);
            CHECK(ensure_all(&f16, g_k) == 0 && ensure_all(&f8, g_k) == 0);
            cb_blend_opts_t o = opts_mode(modes[mi]);
            if (mi == 2) o.metric = 'v';
            /* dense keys: with sparse keys the q8_0 rounding of the probe's mass may pick another block when two
             * are close (the sanitized prompt has two), which on the random synthetic model can flip the argmax */
            o.sparse_keys = 0.0f;
            cb_blend_stats_t s16, s8;
            CHECK(run(&f16, g_k, &o, l16, &s16) == 0);
            CHECK(run(&f8, g_k, &o, l8, &s8) == 0);
            CHECK(s8.chunks_file + s8.chunks_mem == g_k && s8.chunks_computed == 0);
            double d = max_diff(l16, l8, V);
            int a16 = cb_argmax(l16, V), a8 = cb_argmax(l8, V);
            fprintf(stderr, "  %s%s over q8_0 vs f16 files (%s memory tier): max |dlogit| %.3g, argmax %s\n",
                    cb_blend_mode_str(modes[mi]), mi == 2 ? " (metric v)" : "", with_mem ? "with a" : "no", d, a16 == a8 ? "same" : "differs");
            /* int8 at 1/254 of each block's range: the logits move by less than 1.5 (measured: 0.06 on the real
             * model's 40-token chunks, 0.4-0.8 on 16-token chunks and on the random synthetic model, where
             * reuse's own distance from full is of the same order) and the first token stays the same. Metric v's
             * selection reads the q8_0 rows themselves, so the rounding can change which rows are recomputed:
             * measured 1.99 on the qwen2 synthetic layer (its V biases widen every block's range), hence 3 there */
            CHECK_MSG(d < (mi == 2 ? 3.0 : 1.5), "max |dlogit| %.3g", d);
            CHECK(a16 == a8);
            if (!with_mem) memcpy(l8raw[mi], l8, sizeof(float) * V);
            else CHECK_MSG(max_diff(l8raw[mi], l8, V) == 0.0, "q8_0 rows loaded raw and decoded first differ");
            if (with_mem) { /* a second run from the memory tier: the same as the first */
                CHECK(run(&f8, g_k, &o, l16, &s8) == 0);
                CHECK(s8.chunks_mem == g_k && max_diff(l16, l8, V) == 0.0);
            }
            fix_close(&f16);
            fix_close(&f8);
            cb_kvmem_destroy(&mem);
        }
    rm_dir(d16);
    rm_dir(d8);
    free(l16), free(l8), free(l8raw[0]), free(l8raw[1]), free(l8raw[2]);
}

/* reuse with one chunk precomputed right after the prefix is exact (f32 files) */
TEST(test_reuse_single_chunk_equals_full) {
    SETUP();
    int V = g_hp->n_vocab;
    const char *dir = make_dir();
    CHECK(dir);
    char err[256];
    fix_t f;
    CHECK(fix_open(&f, dir, NULL, CB_KV_F32) == 0);
    float *full = malloc(sizeof(float) * V), *re = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_FULL);
    CHECK(run(&f, 1, &o, full, NULL) == 0);
    o = opts_mode(CB_BLEND_REUSE);
    cb_blend_stats_t st;
    CHECK(run(&f, 1, &o, re, &st) == 0); /* the miss is computed, stored, then used */
    CHECK(st.chunks_computed == 1 && st.tokens_recomputed == g_ns);
    double d = max_diff(full, re, V);
    fprintf(stderr, "  reuse(1 chunk, computed now) vs full: %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    CHECK(run(&f, 1, &o, re, &st) == 0); /* now from the file */
    CHECK(st.chunks_file == 1 && st.chunks_computed == 0);
    d = max_diff(full, re, V);
    fprintf(stderr, "  reuse(1 chunk, from file) vs full: %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    /* so is blend with the attention metric whatever it selects, also when its probe stops after the
     * first layer: the probe must still place every layer's cached rows, or the main pass reads what the
     * previous prompt left there (the same sequence: its blocks go back to the pool and come out again) */
    int L = g_hp->n_layer;
    for (int pl = 0; pl <= L; pl += L > 1 ? L - 1 : 1) {
        for (int pl2 = pl; pl2 <= pl + 1 && pl2 <= L; pl2++) {
            o = opts_mode(CB_BLEND_FULL); /* other tokens into the cache rows the chunk will occupy */
            CHECK(cb_blend_prefill(f.b, f.seq, g_prefix, g_np, g_ch + 1, 1, g_suffix, g_ns, &o, re, NULL, err,
                                   sizeof err) == CB_ENGINE_OK);
            o = opts_mode(CB_BLEND_BLEND);
            o.metric = 'a';
            o.ratio = 0.3f;
            o.probe_layers = pl2;
            o.no_overlap = pl2 % 2; /* the loader thread and the serial loads */
            CHECK(run(&f, 1, &o, re, &st) == 0);
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
        CHECK(cb_blend_prefill(f.b, f.seq, g_prefix, g_np, g_ch + 1, 1, g_suffix, g_ns, &o, re, NULL, err, sizeof err) ==
              CB_ENGINE_OK);
        o = opts_mode(CB_BLEND_BLEND);
        o.metric = 'a';
        o.ratio = 0.3f;
        o.probe_suffix = psufs[i];
        CHECK(run(&f, 1, &o, re, &st) == 0);
        CHECK(st.t_probe_ms > 0.0 && st.tokens_recomputed > g_ns && st.tokens_reused > 0);
        d = max_diff(full, re, V);
        fprintf(stderr, "  blend(1 chunk, metric a, probe suffix %d) vs full: %.3g\n", psufs[i], d);
        CHECK_NEAR(d, 0, LOGIT_TOL);
    }
    /* with several chunks reuse is not exact (each chunk saw only the prefix) */
    CHECK(ensure_all(&f, g_k) == 0);
    float *full3 = malloc(sizeof(float) * V);
    o = opts_mode(CB_BLEND_FULL);
    CHECK(run(&f, g_k, &o, full3, NULL) == 0);
    o = opts_mode(CB_BLEND_REUSE);
    CHECK(run(&f, g_k, &o, re, NULL) == 0);
    fprintf(stderr, "  reuse(%d chunks) vs full: %.3g (expected > 0)\n", g_k, max_diff(full3, re, V));
    CHECK(max_diff(full3, re, V) > LOGIT_TOL);
    fix_close(&f);
    rm_dir(dir);
    free(full), free(re), free(full3);
}

/* prefix mode (P and C1 loaded, the rest computed) is exact */
TEST(test_prefix_equals_full) {
    SETUP();
    int V = g_hp->n_vocab;
    const char *dir = make_dir();
    CHECK(dir);
    fix_t f;
    CHECK(fix_open(&f, dir, NULL, CB_KV_F32) == 0);
    CHECK(ensure_all(&f, g_k) == 0);
    float *full = malloc(sizeof(float) * V), *pf = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_FULL);
    CHECK(run(&f, g_k, &o, full, NULL) == 0);
    o = opts_mode(CB_BLEND_PREFIX);
    cb_blend_stats_t st;
    CHECK(run(&f, g_k, &o, pf, &st) == 0);
    CHECK(st.chunks_file == 1 && st.tokens_reused == g_np + g_nc);
    double d = max_diff(full, pf, V);
    fprintf(stderr, "  prefix vs full: %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    fix_close(&f);
    rm_dir(dir);
    free(full), free(pf);
}

/* pre-RoPE K computed at position p, rotated to q, equals K computed at q */
TEST(test_repositioning) {
    SETUP();
    char err[256];
    fix_t f;
    CHECK(fix_open(&f, NULL, NULL, CB_KV_F32) == 0);
    const int n = g_nc, KVD = g_hp->n_head_kv * g_hp->head_dim, L = g_hp->n_layer, HKV = g_hp->n_head_kv;
    /* the chunk computed after the prefix: positions g_np.. */
    cb_kvmem_entry_t *ent = cb_kvstore_compute(f.store, g_prefix, g_np, g_chunks[0], n, false, err, sizeof err);
    CHECK_MSG(ent, "%s", err);
    CHECK(cb_kvmem_entry_n_tokens(ent) == n);
    float *k = malloc(sizeof(float) * n * KVD), *ek = malloc(sizeof(float) * n * KVD), *ev = malloc(sizeof(float) * n * KVD);
    int32_t *pos = malloc(sizeof(int32_t) * n);
    /* (a) the engine's prefill of prefix + chunk holds rope(K_pre, p) at every layer */
    int32_t all[256];
    for (int i = 0; i < g_np; i++) all[i] = g_prefix[i];
    for (int i = 0; i < n; i++) all[g_np + i] = g_chunks[0][i];
    CHECK(cb_engine_prefill(g_eng, f.seq, all, g_np + n, 0, NULL) == CB_ENGINE_OK);
    double worst = 0;
    for (int l = 0; l < L; l++) {
        memcpy(k, cb_kvmem_entry_k(ent, l), sizeof(float) * n * KVD);
        for (int i = 0; i < n; i++) pos[i] = g_np + i;
        cb_engine_rope(g_eng, l, k, n, HKV, pos);
        CHECK(cb_engine_kv_read(g_eng, f.seq, l, g_np, n, ek, ev) == CB_ENGINE_OK);
        double d = max_diff(k, ek, n * KVD);
        if (d > worst) worst = d;
        CHECK(max_diff(cb_kvmem_entry_v(ent, l), ev, n * KVD) < 1e-3);
    }
    fprintf(stderr, "  rope(K_pre, p) vs engine K at p, all layers: %.3g\n", worst);
    CHECK(worst < 1e-3);
    /* (b) layer-0 pre-RoPE K depends on the token only: computed at p = g_np + i, rotated to q = 100 + i,
     * equals the engine's K computed at q (the chunk prefilled at pos0 = 100 after other tokens) */
    int32_t filler[100];
    for (int i = 0; i < 100; i++) filler[i] = (int32_t)(500 + i);
    CHECK(cb_engine_prefill(g_eng, f.seq, filler, 100, 0, NULL) == CB_ENGINE_OK);
    CHECK(cb_engine_prefill(g_eng, f.seq, g_chunks[0], n, 100, NULL) == CB_ENGINE_OK);
    memcpy(k, cb_kvmem_entry_k(ent, 0), sizeof(float) * n * KVD);
    for (int i = 0; i < n; i++) pos[i] = 100 + i;
    cb_engine_rope(g_eng, 0, k, n, HKV, pos);
    CHECK(cb_engine_kv_read(g_eng, f.seq, 0, 100, n, ek, NULL) == CB_ENGINE_OK);
    double d = max_diff(k, ek, n * KVD);
    fprintf(stderr, "  layer 0: K at p rotated to q vs K computed at q: %.3g\n", d);
    CHECK(d < 1e-4);
    /* (c) rotations compose: rope(rope(k, p), q - p) = rope(k, q) */
    float *k2 = malloc(sizeof(float) * n * KVD);
    memcpy(k, cb_kvmem_entry_k(ent, L > 5 ? 5 : L - 1), sizeof(float) * n * KVD);
    memcpy(k2, k, sizeof(float) * n * KVD);
    for (int i = 0; i < n; i++) pos[i] = 37 + i;
    cb_engine_rope(g_eng, L > 5 ? 5 : L - 1, k, n, HKV, pos);
    for (int i = 0; i < n; i++) pos[i] = 200;
    cb_engine_rope(g_eng, L > 5 ? 5 : L - 1, k, n, HKV, pos);
    for (int i = 0; i < n; i++) pos[i] = 237 + i;
    cb_engine_rope(g_eng, L > 5 ? 5 : L - 1, k2, n, HKV, pos);
    d = max_diff(k, k2, n * KVD);
    fprintf(stderr, "  rotation composition: %.3g\n", d);
    CHECK(d < 1e-3);
    cb_kvmem_entry_release(&ent);
    fix_close(&f);
    free(k), free(k2), free(ek), free(ev), free(pos);
}

static int in_list(const int32_t *l, int n, int v) {
    for (int i = 0; i < n; i++)
        if (l[i] == v) return 1;
    return 0;
}

/* the selected set holds every suffix row and forced lead rows; its size is forced + floor(r * cand);
 * selection and logits are deterministic, with or without the loader thread */
TEST(test_selection) {
    SETUP();
    int V = g_hp->n_vocab, N = n_total(g_k);
    const char *dir = make_dir();
    CHECK(dir);
    fix_t f;
    CHECK(fix_open(&f, dir, NULL, CB_KV_F16) == 0);
    CHECK(ensure_all(&f, g_k) == 0);
    float *l1 = malloc(sizeof(float) * V), *l2 = malloc(sizeof(float) * V);
    int32_t *sel = malloc(sizeof(int32_t) * N);
    for (int metric = 0; metric < 3; metric++) {
        cb_blend_opts_t o = opts_mode(CB_BLEND_BLEND);
        o.ratio = 0.2f;
        o.lead_tokens = 2;
        o.metric = "vka"[metric];
        cb_blend_stats_t st;
        CHECK(run(&f, g_k, &o, l1, &st) == 0);
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
        CHECK(run(&f, g_k, &o, l2, &st) == 0);
        CHECK(st.tokens_recomputed == n_sel && !memcmp(st.selected, sel, sizeof(int32_t) * n_sel));
        CHECK(!memcmp(l1, l2, sizeof(float) * V));
        o.no_overlap = false;
        CHECK(run(&f, g_k, &o, l2, &st) == 0);
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
    CHECK(run(&f, g_k, &o, l1, &st) == 0);
    CHECK(st.tokens_recomputed == g_ns);
    /* gradual filtering (a deviation metric) ends at the same count */
    o.metric = 'v';
    o.ratio = 0.1f;
    o.gradual_ratio = 0.5f;
    o.gradual_end_layer = 5;
    CHECK(run(&f, g_k, &o, l1, &st) == 0);
    CHECK(st.tokens_recomputed == g_ns + (int)floor(0.1 * g_k * g_nc + 1e-6));
    CHECK(isfinite(l1[0]));
    fix_close(&f);
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
    SETUP();
    int V = g_hp->n_vocab, N = n_total(g_k), L = g_hp->n_layer, KVD = g_hp->n_head_kv * g_hp->head_dim;
    const char *dir = make_dir();
    CHECK(dir);
    fix_t f;
    CHECK(fix_open(&f, dir, NULL, CB_KV_F16) == 0);
    CHECK(ensure_all(&f, g_k) == 0);
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
    CHECK(run(&f, g_k, &o, lg, &st) == 0);
    CHECK(h.calls >= 2 * L - 1 && h.bad == 0); /* the probe skips the last layer's attention */
    /* a probe of the last 2 suffix rows computes g_ns - 2 rows fewer in each of its L - 1 layers, with exact
     * limits at their moved-up positions */
    int rows_all = h.rows;
    o.probe_suffix = 2;
    h = (hook_state_t){0, 0, 0};
    CHECK(run(&f, g_k, &o, lg, &st) == 0);
    CHECK(h.bad == 0);
    CHECK_MSG(rows_all - h.rows == (g_ns - 2) * (L - 1), "probe rows: %d with the whole suffix, %d with 2 of %d",
              rows_all, h.rows, g_ns);
    /* a deviation metric chooses rows from earlier rows only, so the suffix cannot change them */
    o.metric = 'v';
    h = (hook_state_t){0, 0, 0};
    CHECK(run(&f, g_k, &o, lg, &st) == 0);
    CHECK(h.calls >= L && h.bad == 0);
    int m = N - g_ns; /* rows before the suffix */
    size_t per = (size_t)m * KVD;
    float *kv = malloc(sizeof(float) * per * 2 * L), *kv2 = malloc(sizeof(float) * per * 2 * L);
    for (int l = 0; l < L; l++)
        CHECK(cb_engine_kv_read(g_eng, f.seq, l, 0, m, kv + (size_t)2 * l * per, kv + (size_t)(2 * l + 1) * per) ==
              CB_ENGINE_OK);
    int32_t save[32];
    memcpy(save, g_suffix, sizeof(int32_t) * g_ns);
    for (int i = 0; i < g_ns; i++) g_suffix[i] = (int32_t)(7000 + i);
    CHECK(run(&f, g_k, &o, lg, &st) == 0);
    memcpy(g_suffix, save, sizeof(int32_t) * g_ns);
    for (int l = 0; l < L; l++)
        CHECK(cb_engine_kv_read(g_eng, f.seq, l, 0, m, kv2 + (size_t)2 * l * per, kv2 + (size_t)(2 * l + 1) * per) ==
              CB_ENGINE_OK);
    int same = !memcmp(kv, kv2, sizeof(float) * per * 2 * L);
    CHECK_MSG(same, "the fused KV of rows before the suffix depends on the suffix");
    fix_close(&f);
    rm_dir(dir);
    free(lg), free(kv), free(kv2);
}

/* Path of chunk c's file. */
static void chunk_path(const fix_t *f, const char *dir, int c, char *path, size_t len) {
    uint8_t key[32];
    cb_kvstore_chunk_key(f->store, g_prefix, g_np, g_ch[c].tokens, g_ch[c].n, key);
    CHECK(cb_kvstore_path(f->store, key, path, len) == 0);
    char old[512]; /* the store names files as kvfile does */
    CHECK(cb_kvfile_path(dir, key, old, sizeof old) == 0 && !strcmp(old, path));
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
    SETUP();
    int V = g_hp->n_vocab;
    const char *dir = make_dir();
    CHECK(dir);
    char err[256], path[512];
    fix_t f;
    CHECK(fix_open(&f, dir, NULL, CB_KV_F16) == 0);
    CHECK(ensure_all(&f, g_k) == 0);
    float *good = malloc(sizeof(float) * V), *lg = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_BLEND);
    cb_blend_stats_t st;
    CHECK(run(&f, g_k, &o, good, &st) == 0);
    CHECK(st.chunks_file == g_k && st.restarts == 0);
    /* payload corruption in the last layer: found while streaming, the prefill restarts */
    chunk_path(&f, dir, 1, path, sizeof path);
    CHECK(flip_byte(path, 10) == 0);
    CHECK(run(&f, g_k, &o, lg, &st) == 0);
    CHECK(st.restarts == 1 && st.chunks_computed == 1);
    CHECK(!memcmp(good, lg, sizeof(float) * V));
    CHECK(run(&f, g_k, &o, lg, &st) == 0); /* rewritten: a hit again */
    CHECK(st.chunks_file == g_k && st.restarts == 0 && st.chunks_computed == 0);
    /* header corruption: a miss at open */
    chunk_path(&f, dir, 0, path, sizeof path);
    struct stat s;
    CHECK(stat(path, &s) == 0);
    CHECK(flip_byte(path, s.st_size - 20) == 0);
    CHECK(run(&f, g_k, &o, lg, &st) == 0);
    CHECK(st.chunks_computed == 1 && st.restarts == 0);
    CHECK(!memcmp(good, lg, sizeof(float) * V));
    /* truncated */
    chunk_path(&f, dir, 2, path, sizeof path);
    CHECK(truncate(path, 100) == 0);
    CHECK(run(&f, g_k, &o, lg, &st) == 0);
    CHECK(st.chunks_computed == 1);
    CHECK(!memcmp(good, lg, sizeof(float) * V));
    /* missing */
    chunk_path(&f, dir, 1, path, sizeof path);
    CHECK(unlink(path) == 0);
    CHECK(run(&f, g_k, &o, lg, &st) == 0);
    CHECK(st.chunks_computed == 1);
    CHECK(!memcmp(good, lg, sizeof(float) * V));
    /* ensure_chunk reports the reason of a miss */
    CHECK(flip_byte(path, 10) == 0);
    cb_kvstore_src_t src;
    cb_kv_miss_t why;
    CHECK(cb_kvstore_ensure(f.store, g_prefix, g_np, g_ch[1].tokens, g_ch[1].n, &src, &why, err, sizeof err) == 0);
    CHECK(src == CB_KVSTORE_COMPUTED && why == CB_KV_MISS_PAYLOAD_CHECKSUM);
    CHECK(cb_kvstore_ensure(f.store, g_prefix, g_np, g_ch[1].tokens, g_ch[1].n, &src, &why, err, sizeof err) == 0);
    CHECK(src == CB_KVSTORE_FILE && why == CB_KV_OK);
    fix_close(&f);
    rm_dir(dir);
    free(good), free(lg);
}

static int is_regular(const char *path) {
    struct stat s;
    return lstat(path, &s) == 0 && S_ISREG(s.st_mode);
}

/* Something other than a file at a chunk's KV path (the probe's findings): a FIFO or a link to one is a miss
 * at once (never a hang), the chunk is computed (the same logits) and the path healed; a non-empty directory
 * stays, the chunk is used from memory, the failed write counted and the chunk reported not stored (no put);
 * a strict store (cb-precompute's ensure) fails with the reason. */
TEST(test_special_files_at_kv_path) {
    SETUP();
    int V = g_hp->n_vocab;
    const char *dir = make_dir();
    CHECK(dir);
    char err[512], path[512], fifo[600], inner[600];
    fix_t f;
    CHECK(fix_open(&f, dir, NULL, CB_KV_F16) == 0);
    CHECK(ensure_all(&f, g_k) == 0);
    float *good = malloc(sizeof(float) * V), *lg = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_BLEND);
    cb_blend_stats_t st;
    CHECK(run(&f, g_k, &o, good, &st) == 0 && st.chunks_file == g_k);
    chunk_path(&f, dir, 1, path, sizeof path);
    snprintf(fifo, sizeof fifo, "%s/a.fifo", dir);
    for (int kind = 0; kind < 2; kind++) {
        CHECK(unlink(path) == 0);
        if (kind == 0) CHECK(mkfifo(path, 0644) == 0);
        else CHECK(mkfifo(fifo, 0644) == 0 && symlink(fifo, path) == 0);
        CHECK(run(&f, g_k, &o, lg, &st) == 0);
        CHECK(st.chunks_computed == 1 && st.chunks_file == g_k - 1);
        CHECK(st.chunks[1].src == CB_KVSTORE_COMPUTED && st.chunks[1].why == CB_KV_MISS_NOT_REGULAR && st.chunks[1].stored);
        CHECK(!memcmp(good, lg, sizeof(float) * V));
        CHECK(is_regular(path));
    }
    uint64_t w0 = cb_kvstore_write_failures(f.store);
    CHECK(unlink(path) == 0 && mkdir(path, 0755) == 0);
    snprintf(inner, sizeof inner, "%s/keep", path);
    CHECK(mkdir(inner, 0755) == 0);
    for (int i = 0; i < 2; i++) {
        CHECK(run(&f, g_k, &o, lg, &st) == 0);
        CHECK(st.chunks[1].src == CB_KVSTORE_COMPUTED && !st.chunks[1].stored);
        CHECK(!memcmp(good, lg, sizeof(float) * V));
    }
    CHECK(cb_kvstore_write_failures(f.store) == w0 + 2);
    cb_kvstore_src_t src;
    CHECK(cb_kvstore_ensure(f.store, g_prefix, g_np, g_ch[1].tokens, g_ch[1].n, &src, NULL, err, sizeof err) != 0);
    CHECK_MSG(strstr(err, "not empty") != NULL, "%s", err);
    CHECK(cb_kvstore_write_failures(f.store) == w0 + 3);
    CHECK(rmdir(inner) == 0); /* empty now: the next write replaces it */
    CHECK(cb_kvstore_ensure(f.store, g_prefix, g_np, g_ch[1].tokens, g_ch[1].n, &src, NULL, err, sizeof err) == 0);
    CHECK(src == CB_KVSTORE_COMPUTED && is_regular(path));
    unlink(fifo);
    fix_close(&f);
    rm_dir(dir);
    free(good), free(lg);
}

/* the memory tier: files stream into it, the next prefill hits it, results are identical (bf16 files:
 * the blend's own conversion of streamed rows equals kvfile's decoding into the tier) */
TEST(test_memory_tier) {
    SETUP();
    int V = g_hp->n_vocab;
    const char *dir = make_dir();
    CHECK(dir);
    char err[256];
    fix_t f0, f;
    CHECK(fix_open(&f0, dir, NULL, CB_KV_BF16) == 0);
    CHECK(ensure_all(&f0, g_k) == 0);
    float *a = malloc(sizeof(float) * V), *c = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_BLEND);
    CHECK(run(&f0, g_k, &o, a, NULL) == 0);
    fix_close(&f0);
    cb_kvmem_t *mem = cb_kvmem_new(64u << 20);
    CHECK(fix_open(&f, dir, mem, CB_KV_BF16) == 0);
    CHECK(cb_kvstore_mem(f.store) == mem && cb_kvstore_dtype(f.store) == CB_KV_BF16);
    cb_blend_stats_t st;
    CHECK(run(&f, g_k, &o, c, &st) == 0);
    CHECK(st.chunks_file == g_k);
    CHECK(!memcmp(a, c, sizeof(float) * V));
    CHECK(run(&f, g_k, &o, c, &st) == 0);
    CHECK(st.chunks_mem == g_k && st.chunks_file == 0);
    CHECK(!memcmp(a, c, sizeof(float) * V));
    cb_kvstore_src_t src;
    cb_kvmem_entry_t *e = cb_kvstore_load(f.store, g_prefix, g_np, g_ch[0].tokens, g_ch[0].n, &src, NULL, err, sizeof err);
    CHECK(e && cb_kvmem_entry_n_tokens(e) == g_nc && src == CB_KVSTORE_MEM);
    cb_kvmem_entry_release(&e);
    fix_close(&f);
    cb_kvmem_destroy(&mem);
    rm_dir(dir);
    free(a), free(c);
}

TEST(test_bad_args) {
    SETUP();
    char err[256];
    CHECK(cb_blend_new(NULL, err, sizeof err) == NULL);
    CHECK(cb_kvstore_new(NULL, NULL, NULL, CB_KV_F16, err, sizeof err) == NULL);
    CHECK(cb_kvstore_new(g_eng, "/nonexistent/dir", NULL, CB_KV_F16, err, sizeof err) == NULL);
    CHECK(cb_kvstore_new(g_eng, NULL, NULL, (cb_kv_dtype_t)7, err, sizeof err) == NULL);
    fix_t f;
    CHECK(fix_open(&f, NULL, NULL, CB_KV_F16) == 0);
    cb_blend_t *b = f.b;
    cb_seq_t *q = f.seq;
    float *lg = malloc(sizeof(float) * g_hp->n_vocab);
    cb_blend_opts_t o = opts_mode(CB_BLEND_FULL);
    int32_t bad[2] = {1, g_hp->n_vocab};
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, NULL, 0, bad, 2, &o, lg, NULL, err, sizeof err) == CB_ENGINE_EINVAL);
    CHECK(strstr(err, "vocabulary"));
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, NULL, 0, g_suffix, 0, &o, lg, NULL, err, sizeof err) == CB_ENGINE_EINVAL);
    CHECK(cb_blend_prefill(b, NULL, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) ==
          CB_ENGINE_EINVAL); /* no sequence */
    cb_blend_chunk_t big[24];
    for (int i = 0; i < 24; i++) big[i] = g_ch[0];
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, big, 24, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) ==
          CB_ENGINE_EINVAL);
    CHECK(strstr(err, "max_ctx"));
    cb_blend_chunk_t empty = {g_chunks[0], 0};
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, &empty, 1, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) ==
          CB_ENGINE_EINVAL);
    o.ratio = 1.5f;
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == CB_ENGINE_EINVAL);
    o = opts_mode(CB_BLEND_BLEND);
    o.check_layer = g_hp->n_layer;
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == CB_ENGINE_EINVAL);
    o = opts_mode(CB_BLEND_BLEND);
    o.metric = 'q';
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == CB_ENGINE_EINVAL);
    o = opts_mode(CB_BLEND_BLEND);
    o.metric = 'a'; /* gradual filtering re-measures a deviation: not with the attention metric */
    o.ratio = 0.1f;
    o.gradual_ratio = 0.5f;
    o.gradual_end_layer = 3;
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == CB_ENGINE_EINVAL);
    CHECK(strstr(err, "gradual"));
    o = opts_mode(CB_BLEND_BLEND);
    o.probe_layers = g_hp->n_layer + 1;
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == CB_ENGINE_EINVAL);
    CHECK(strstr(err, "probe layers"));
    o.probe_layers = -1;
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == CB_ENGINE_EINVAL);
    o = opts_mode(CB_BLEND_BLEND);
    o.probe_suffix = -1;
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == CB_ENGINE_EINVAL);
    CHECK(strstr(err, "probe suffix"));
    o = opts_mode(CB_BLEND_BLEND);
    o.mode = (cb_blend_mode_t)9;
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == CB_ENGINE_EINVAL);
    CHECK(cb_kvstore_compute(f.store, g_prefix, g_np, bad, 2, false, err, sizeof err) == NULL);
    CHECK(cb_kvstore_set_context(f.store, g_prefix, 0, err, sizeof err) == -1);
    CHECK(cb_kvstore_set_context(f.store, bad, 2, err, sizeof err) == -1);
    CHECK(cb_blend_mode_parse("blend") == CB_BLEND_BLEND && cb_blend_mode_parse("x") == -1);
    CHECK(cb_blend_metric_parse("a") == 'a' && cb_blend_metric_parse("v") == 'v' && cb_blend_metric_parse("k") == 'k');
    CHECK(!cb_blend_metric_parse("q") && !cb_blend_metric_parse("") && !cb_blend_metric_parse("kv") && !cb_blend_metric_parse(NULL));
    CHECK(!strcmp(cb_blend_mode_str(CB_BLEND_REUSE), "reuse"));
    CHECK(!strcmp(cb_kvstore_src_str(CB_KVSTORE_FILE), "file"));
    /* no chunks at all: prefix + suffix works in every mode */
    o = opts_mode(CB_BLEND_BLEND);
    CHECK(cb_blend_prefill(b, q, g_prefix, g_np, NULL, 0, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == CB_ENGINE_OK);
    fix_close(&f);
    free(lg);
}

/* The prefix's whole blocks are the store's context sequence's, shared by reference into the request's
 * sequence during and after a blend (not loaded or computed again); when the request's sequence goes, only
 * the context's blocks stay in use. */
typedef struct {
    cb_engine_t *eng;
    int calls, min_shared;
} share_probe_t;

static void share_hook(void *ud, int layer, int n, const int32_t *pos, const int32_t *lim) {
    share_probe_t *p = ud;
    (void)layer, (void)n, (void)pos, (void)lim;
    cb_engine_pool_stats_t st;
    cb_engine_pool_stats(p->eng, &st);
    p->calls++;
    if (st.blocks_shared < p->min_shared) p->min_shared = st.blocks_shared;
}

TEST(test_prefix_blocks_shared) {
    SETUP();
    const int V = g_hp->n_vocab, L = g_hp->n_layer, KVD = g_hp->n_head_kv * g_hp->head_dim;
    cb_engine_pool_stats_t st0, st;
    cb_engine_pool_stats(g_eng, &st0);
    const int bt = st0.block_tokens, np = 2 * bt + bt / 2; /* a prefix of 2.5 blocks */
    CHECK(np <= 64);
    if (st0.blocks_used) fprintf(stderr, "  %d blocks in use before the test (an earlier failure)\n", st0.blocks_used);
    int32_t prefix[64];
    for (int i = 0; i < np; i++) prefix[i] = rnd_tok();
    char err[256] = "";
    fix_t f;
    CHECK(fix_open(&f, NULL, NULL, CB_KV_F32) == 0); /* f32: the prefix-mode check below is exact */
    float *lg = malloc(sizeof(float) * V), *lf = malloc(sizeof(float) * V);
    share_probe_t pr = {g_eng, 0, INT_MAX};
    for (int mode = 0; mode < 2; mode++) { /* blend (metric a: a probe pass, then the main pass), and reuse */
        cb_blend_opts_t o = opts_mode(mode ? CB_BLEND_REUSE : CB_BLEND_BLEND);
        o.ratio = 0.3f;
        o.attn_hook = share_hook;
        o.attn_hook_ud = &pr;
        cb_blend_stats_t bs;
        CHECK_MSG(cb_blend_prefill(f.b, f.seq, prefix, np, g_ch, 2, g_suffix, g_ns, &o, lg, &bs, err, sizeof err) ==
                      CB_ENGINE_OK, "%s", err);
        const cb_seq_t *ctx = cb_kvstore_context_seq(f.store);
        CHECK(ctx && cb_kvstore_context_len(f.store) == np && cb_seq_capacity(ctx) >= np);
        CHECK_MSG(pr.calls > 0 && pr.min_shared >= np / bt, "%s: %d attention calls, fewest shared blocks %d",
                  cb_blend_mode_str(o.mode), pr.calls, pr.min_shared);
        cb_engine_pool_stats(g_eng, &st);
        CHECK_MSG(st.blocks_shared - st0.blocks_shared == np / bt, "%d blocks shared after the blend, want %d",
                  st.blocks_shared - st0.blocks_shared, np / bt);
        CHECK_MSG(st.blocks_used - st0.blocks_used == cb_seq_blocks(ctx) + cb_seq_blocks(f.seq) - np / bt,
                  "%d blocks used: context %d, request %d", st.blocks_used - st0.blocks_used, cb_seq_blocks(ctx),
                  cb_seq_blocks(f.seq));
        CHECK(cb_seq_blocks(f.seq) == (bs.n_tokens + bt - 1) / bt);
        /* the request reads the context's rows of the prefix, bit for bit */
        float *a = malloc(sizeof(float) * (size_t)np * KVD * 2), *c = malloc(sizeof(float) * (size_t)np * KVD * 2);
        int same = 1;
        for (int l = 0; l < L; l++) {
            same &= cb_engine_kv_read(g_eng, ctx, l, 0, np, a, a + (size_t)np * KVD) == CB_ENGINE_OK;
            same &= cb_engine_kv_read(g_eng, f.seq, l, 0, np, c, c + (size_t)np * KVD) == CB_ENGINE_OK;
            same &= !memcmp(a, c, sizeof(float) * (size_t)np * KVD * 2);
        }
        free(a);
        free(c);
        CHECK_MSG(same, "the request's prefix rows differ from the context's");
        pr.calls = 0, pr.min_shared = INT_MAX;
    }
    /* the request goes: only the context's blocks stay */
    const int ctx_blocks = cb_seq_blocks(cb_kvstore_context_seq(f.store));
    cb_seq_destroy(&f.seq);
    cb_engine_pool_stats(g_eng, &st);
    CHECK_MSG(st.blocks_used - st0.blocks_used == ctx_blocks && st.blocks_shared == st0.blocks_shared,
              "%d blocks used (context: %d), %d shared", st.blocks_used - st0.blocks_used, ctx_blocks, st.blocks_shared);
    /* a new request over the same context shares again, and prefix mode over it is exact */
    f.seq = cb_seq_new(g_eng);
    CHECK(f.seq);
    cb_blend_opts_t o = opts_mode(CB_BLEND_FULL);
    CHECK(cb_blend_prefill(f.b, f.seq, prefix, np, g_ch, 2, g_suffix, g_ns, &o, lf, NULL, err, sizeof err) == CB_ENGINE_OK);
    o = opts_mode(CB_BLEND_PREFIX);
    CHECK(cb_blend_prefill(f.b, f.seq, prefix, np, g_ch, 2, g_suffix, g_ns, &o, lg, NULL, err, sizeof err) == CB_ENGINE_OK);
    cb_engine_pool_stats(g_eng, &st);
    CHECK(st.blocks_shared - st0.blocks_shared == np / bt);
    double d = max_diff(lf, lg, V);
    fprintf(stderr, "  prefix (2.5 shared blocks) vs full: %.3g\n", d);
    CHECK_NEAR(d, 0, LOGIT_TOL);
    fix_close(&f);
    cb_engine_pool_stats(g_eng, &st);
    CHECK(st.blocks_used == st0.blocks_used && st.n_seqs == st0.n_seqs);
    free(lg), free(lf);
}

/* A full KV pool is CB_ENGINE_EPOOL from the blend (the service's `overloaded`), with nothing held by the
 * request; once blocks come back the same blend succeeds with the same logits. */
TEST(test_pool_full) {
    SETUP();
    const int V = g_hp->n_vocab, max_ctx = 128;
    char err[256] = "";
    cb_engine_pool_stats_t st;
    cb_engine_pool_stats(g_eng, &st); /* the block size of this backend */
    /* a pool of one sequence of max_ctx */
    cb_engine_opts_t eo = {.max_ctx = max_ctx, .kv_pool_bytes = (size_t)max_ctx / st.block_tokens * st.block_bytes,
                           .kv_dtype = CB_ENGINE_KV_F32, .attn = CB_ENGINE_ATTN_F32}; /* g_eng's pool type, whose block_bytes this uses */
    cb_engine_t *e = cb_engine_new_opts(g_model, &eo, err, sizeof err);
    CHECK_MSG(e, "%s", err);
    cb_engine_set_threads(e, 1);
    cb_engine_pool_stats(e, &st);
    CHECK(st.n_blocks == max_ctx / st.block_tokens && st.blocks_free == st.n_blocks);
    cb_kvmem_t *mem = cb_kvmem_new(64u << 20); /* the chunk stays here: no recompute needs blocks later */
    cb_kvstore_t *store = cb_kvstore_new(e, NULL, mem, CB_KV_F16, err, sizeof err);
    cb_blend_t *b = store ? cb_blend_new(store, err, sizeof err) : NULL;
    cb_seq_t *r = cb_seq_new(e), *hog = cb_seq_new(e);
    CHECK_MSG(b && r && hog, "%s", err);
    float *l0 = malloc(sizeof(float) * V), *l1 = malloc(sizeof(float) * V);
    cb_blend_opts_t o = opts_mode(CB_BLEND_REUSE);
    CHECK(n_total(1) <= max_ctx);
    CHECK_MSG(cb_blend_prefill(b, r, g_prefix, g_np, g_ch, 1, g_suffix, g_ns, &o, l0, NULL, err, sizeof err) ==
                  CB_ENGINE_OK, "%s", err);
    cb_seq_clear(r);
    /* another sequence takes every block the context leaves */
    cb_engine_pool_stats(e, &st);
    int32_t filler[128];
    for (int i = 0; i < 128; i++) filler[i] = (int32_t)(500 + i);
    CHECK(cb_engine_prefill(e, hog, filler, st.blocks_free * st.block_tokens, 0, NULL) == CB_ENGINE_OK);
    cb_engine_pool_stats(e, &st);
    CHECK(st.blocks_free == 0);
    const int used = st.blocks_used;
    err[0] = 0;
    int rc = cb_blend_prefill(b, r, g_prefix, g_np, g_ch, 1, g_suffix, g_ns, &o, l1, NULL, err, sizeof err);
    CHECK_MSG(rc == CB_ENGINE_EPOOL, "blend into a full pool: %d (%s)", rc, err);
    CHECK(err[0] != 0);
    cb_engine_pool_stats(e, &st);
    CHECK(cb_seq_blocks(r) == 0 && st.blocks_used == used);
    /* blocks back: the same blend works, bit for bit as before */
    cb_seq_destroy(&hog);
    CHECK_MSG(cb_blend_prefill(b, r, g_prefix, g_np, g_ch, 1, g_suffix, g_ns, &o, l1, NULL, err, sizeof err) ==
                  CB_ENGINE_OK, "%s", err);
    CHECK(!memcmp(l0, l1, sizeof(float) * V));
    cb_seq_destroy(&r);
    cb_blend_destroy(&b);
    cb_kvstore_destroy(&store);
    cb_kvmem_destroy(&mem);
    cb_engine_pool_stats(e, &st);
    CHECK(st.blocks_used == 0 && st.n_seqs == 0);
    cb_engine_destroy(&e);
    free(l0), free(l1);
}

static int argmax(const float *v, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

/* The call in slices: cb_blend_start + cb_blend_step with the smallest budget (one unit of work a slice)
 * gives the logits of cb_blend_prefill bit for bit in every mode, from KV files (the loader runs between
 * slices) and from the memory tier; one call at a time; a cancelled call returns its blocks. */
TEST(test_slices) {
    SETUP();
    const int V = g_hp->n_vocab;
    const char *dir = make_dir();
    CHECK(dir != NULL);
    float *l0 = malloc(sizeof(float) * V), *l1 = malloc(sizeof(float) * V);
    CHECK(l0 && l1);
    for (int tier = 0; tier < 2; tier++) {
        cb_kvmem_t *mem = tier ? cb_kvmem_new(64u << 20) : NULL;
        fix_t f;
        CHECK(fix_open(&f, dir, mem, CB_KV_F16) == 0);
        CHECK(ensure_all(&f, g_k) == 0);
        struct { cb_blend_mode_t m; char metric; } cases[] = {
            {CB_BLEND_FULL, 'a'}, {CB_BLEND_PREFIX, 'a'}, {CB_BLEND_REUSE, 'a'}, {CB_BLEND_BLEND, 'a'},
            {CB_BLEND_BLEND, 'v'}};
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            cb_blend_opts_t o = opts_mode(cases[c].m);
            o.metric = cases[c].metric;
            cb_blend_stats_t s0, s1;
            CHECK(run(&f, g_k, &o, l0, &s0) == 0);
            CHECK(s0.n_slices == 1);
            char err[256] = "";
            int rc = cb_blend_start(f.b, f.seq, g_prefix, g_np, g_ch, g_k, g_suffix, g_ns, &o, l1, err, sizeof err);
            CHECK_MSG(rc == CB_ENGINE_OK, "%s", err);
            CHECK(cb_blend_busy(f.b));
            CHECK(cb_blend_start(f.b, f.seq, g_prefix, g_np, g_ch, g_k, g_suffix, g_ns, &o, l1, err, sizeof err) ==
                  CB_ENGINE_EINVAL);
            int slices = 0;
            while ((rc = cb_blend_step(f.b, 1, &s1, err, sizeof err)) == CB_BLEND_MORE) slices++;
            CHECK_MSG(rc == CB_ENGINE_OK, "%s", err);
            CHECK(!cb_blend_busy(f.b));
            CHECK_MSG(memcmp(l0, l1, sizeof(float) * V) == 0, "%s (metric %c): sliced logits differ by %g",
                      cb_blend_mode_str(cases[c].m), cases[c].metric, max_diff(l0, l1, V));
            CHECK(s1.n_slices == slices + 1 && s1.n_slices > 2);
            CHECK(s1.tokens_recomputed == s0.tokens_recomputed && s1.chunks_computed == 0);
        }
        /* cancel half way: the sequence is empty and the pool as before; the next call works */
        cb_engine_pool_stats_t p0, p1;
        cb_seq_clear(f.seq);
        cb_engine_pool_stats(g_eng, &p0);
        cb_blend_opts_t o = opts_mode(CB_BLEND_BLEND);
        char err[256] = "";
        CHECK(cb_blend_start(f.b, f.seq, g_prefix, g_np, g_ch, g_k, g_suffix, g_ns, &o, l1, err, sizeof err) == 0);
        for (int i = 0; i < 5; i++) CHECK(cb_blend_step(f.b, 1, NULL, err, sizeof err) == CB_BLEND_MORE);
        CHECK(cb_seq_blocks(f.seq) > 0);
        cb_blend_cancel(f.b);
        cb_engine_pool_stats(g_eng, &p1);
        CHECK(!cb_blend_busy(f.b) && cb_seq_blocks(f.seq) == 0 && p1.blocks_used == p0.blocks_used);
        CHECK(cb_blend_step(f.b, 1, NULL, err, sizeof err) == CB_ENGINE_EINVAL);
        CHECK(run(&f, g_k, &o, l1, NULL) == 0);
        fix_close(&f);
        cb_kvmem_destroy(&mem);
    }
    free(l0);
    free(l1);
    rm_dir(dir);
}

/* A blend that joins a running batch: sequences decoding greedily, one cb_engine_decode_batch a step,
 * produce the same tokens (and logits, bit for bit) when a blend runs in slices between their steps (its
 * loader placing KV files meanwhile), and the blend gives the logits it gives alone. */
TEST(test_blend_joins_batch) {
    SETUP();
    const int V = g_hp->n_vocab, NS = 3, T = TEST_SANITIZED ? 6 : 24, P0 = 20;
    const char *dir = make_dir();
    CHECK(dir != NULL);
    fix_t f;
    CHECK(fix_open(&f, dir, NULL, CB_KV_F16) == 0);
    CHECK(ensure_all(&f, g_k) == 0);
    cb_blend_opts_t o = opts_mode(CB_BLEND_BLEND);
    float *lb0 = malloc(sizeof(float) * V), *lb1 = malloc(sizeof(float) * V);
    float *lg = malloc(sizeof(float) * V * NS), *ref = malloc(sizeof(float) * V * NS * T);
    int32_t prompts[3][20], toks[3][64];
    cb_seq_t *seqs[3];
    CHECK(lb0 && lb1 && lg && ref);
    for (int i = 0; i < NS; i++) {
        for (int j = 0; j < P0; j++) prompts[i][j] = rnd_tok();
        CHECK((seqs[i] = cb_seq_new(g_eng)) != NULL);
    }
    CHECK(run(&f, g_k, &o, lb0, NULL) == 0);
    for (int pass = 0; pass < 2; pass++) {
        int32_t tok[3], pos[3];
        for (int i = 0; i < NS; i++) {
            cb_seq_clear(seqs[i]);
            CHECK(cb_engine_prefill(g_eng, seqs[i], prompts[i], P0, 0, lg + (size_t)i * V) == CB_ENGINE_OK);
            tok[i] = argmax(lg + (size_t)i * V, V);
            pos[i] = P0;
        }
        char err[256] = "";
        int brc = CB_ENGINE_OK;
        if (pass == 1) {
            cb_seq_clear(f.seq);
            CHECK(cb_blend_start(f.b, f.seq, g_prefix, g_np, g_ch, g_k, g_suffix, g_ns, &o, lb1, err, sizeof err) == 0);
            brc = CB_BLEND_MORE;
        }
        for (int t = 0; t < T; t++) {
            if (brc == CB_BLEND_MORE) brc = cb_blend_step(f.b, 1, NULL, err, sizeof err);
            CHECK(cb_engine_decode_batch(g_eng, seqs, tok, pos, NS, lg) == CB_ENGINE_OK);
            for (int i = 0; i < NS; i++) {
                const float *li = lg + (size_t)i * V;
                if (pass == 0) memcpy(ref + ((size_t)t * NS + i) * V, li, sizeof(float) * V);
                else CHECK_MSG(memcmp(li, ref + ((size_t)t * NS + i) * V, sizeof(float) * V) == 0,
                               "sequence %d step %d: logits changed by the blend (%g)", i, t,
                               max_diff(li, ref + ((size_t)t * NS + i) * V, V));
                if (pass == 0) toks[i][t] = tok[i];
                else CHECK(toks[i][t] == tok[i]);
                tok[i] = argmax(li, V);
                pos[i]++;
            }
        }
        while (brc == CB_BLEND_MORE) brc = cb_blend_step(f.b, 1, NULL, err, sizeof err);
        CHECK_MSG(brc == CB_ENGINE_OK, "%s", err);
    }
    CHECK_MSG(memcmp(lb0, lb1, sizeof(float) * V) == 0, "the blend beside the batch differs by %g",
              max_diff(lb0, lb1, V));
    for (int i = 0; i < NS; i++) cb_seq_destroy(&seqs[i]);
    fix_close(&f);
    free(lb0);
    free(lb1);
    free(lg);
    free(ref);
    rm_dir(dir);
}

int main(void) {
    RUN(test_full_equals_engine_prefill);
    RUN(test_blend_ratio1_equals_full);
    RUN(test_ratio_auto);
    RUN(test_sparse_keys);
    RUN(test_q8_files);
    RUN(test_reuse_single_chunk_equals_full);
    RUN(test_prefix_equals_full);
    RUN(test_repositioning);
    RUN(test_selection);
    RUN(test_causal_limits);
    RUN(test_file_miss_recomputed);
    RUN(test_special_files_at_kv_path);
    RUN(test_memory_tier);
    RUN(test_bad_args);
    RUN(test_prefix_blocks_shared);
    RUN(test_pool_full);
    RUN(test_slices);
    RUN(test_blend_joins_batch);
    cb_engine_destroy(&g_eng);
    cb_model_destroy(&g_model);
    return test_summary();
}
