/* test_blend_golden: the four blend modes give today the logits they gave before the sequences/KV pool
 * redesign, on the real model.
 *
 * tests/fixtures/blend_modes.txt was written by tests/fixtures/blend_modes_gen.c built against commit
 * 34607c8 (the engine's single host KV cache, the blend calling CPU kernels itself): for one fixed prompt
 * (45-token prefix, chunks of 300/250/310 tokens, 40-token suffix, ids from srand(7)) and the modes full,
 * prefix, reuse, blend (metric a), blend (metric v) and blend (metric a, chunks now from their KV files),
 * the rows recomputed, a hash of the selected positions, then for 4 greedy steps the argmax and every
 * 97th logit. This test runs the same prompt through the new API and requires the same selections and
 * argmaxes and every logit within a bound (at the commit it was written, the difference was 0; since the
 * int8 kernels, the f32 matvec's dot product is compiled with FMA contraction: 3e-5). The
 * bound is 5e-4: OpenBLAS picks its sgemm kernel per CPU model, and on an AVX-512 Sapphire-Rapids-class
 * Xeon commit ef1f21d already gives 1.34e-4 (f32 reassociation through 30 layers; logits ~10-20). Selections and
 * argmaxes must still be the same. The
 * fixture holds f32 numerics, so the test runs on the f32 reference weights (CB_ENGINE_WEIGHTS=f32): it
 * checks the blend's bookkeeping, which the int8 decode numerics would hide. The kernels' summation order
 * depends on the vector ISA (AVX-512 or not: the fixture's first line), so on another ISA the test skips.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "blend/blend.h"
#include "engine/engine.h"
#include "kv/kvstore.h"
#include "model/model.h"
#include "test.h"

#define N_MODES 6
#define N_STEPS 4

TEST(test_modes_match_before) {
    const char *path = test_model_path();
    if (!path) SKIP("model not found (make model)");
    FILE *fx = fopen("tests/fixtures/blend_modes.txt", "r");
    if (!fx) SKIP("tests/fixtures/blend_modes.txt not found (run from the repository root)");
    int isa = -1;
#if defined(__AVX512F__)
    const int here = 1;
#else
    const int here = 0;
#endif
    if (fscanf(fx, "avx512 %d\n", &isa) != 1 || isa != here) {
        fclose(fx);
        SKIP("the fixture was made on another vector ISA (AVX-512 or not)");
    }
    char err[256];
    setenv("CB_ENGINE_WEIGHTS", "f32", 1);
    cb_model_t *m = cb_model_load(path, err, sizeof err);
    unsetenv("CB_ENGINE_WEIGHTS");
    CHECK_MSG(m, "%s", err);
    const cb_hparams_t *hp = cb_model_hparams(m);
    /* the fixture holds the f32 KV pool's logits (tests/fixtures/blend_modes_gen.c) */
    const cb_engine_opts_t eo = {.max_ctx = 2048, .kv_dtype = CB_ENGINE_KV_F32, .attn = CB_ENGINE_ATTN_F32};
    cb_engine_t *e = cb_engine_new_opts(m, &eo, err, sizeof err);
    CHECK_MSG(e, "%s", err);
    char dir[] = "/tmp/cb_test_golden_XXXXXX";
    CHECK(mkdtemp(dir));
    cb_kvstore_t *ks = cb_kvstore_new(e, dir, NULL, CB_KV_F16, err, sizeof err);
    cb_blend_t *b = ks ? cb_blend_new(ks, err, sizeof err) : NULL;
    cb_seq_t *seq = cb_seq_new(e);
    CHECK_MSG(b && seq, "%s", err);
    srand(7);
    int32_t pre[45], c1[300], c2[250], c3[310], suf[40];
    for (int i = 0; i < 45; i++) pre[i] = 100 + rand() % 20000;
    for (int i = 0; i < 300; i++) c1[i] = 100 + rand() % 20000;
    for (int i = 0; i < 250; i++) c2[i] = 100 + rand() % 20000;
    for (int i = 0; i < 310; i++) c3[i] = 100 + rand() % 20000;
    for (int i = 0; i < 40; i++) suf[i] = 100 + rand() % 20000;
    cb_blend_chunk_t ch[3] = {{c1, 300}, {c2, 250}, {c3, 310}};
    float *lg = malloc(sizeof(float) * (size_t)hp->n_vocab);
    CHECK(lg);
    double worst = 0.0;
    int failed = 0;
    /* under sanitizers: full and blend (metric a) only, to keep the ASan run short */
    const int n_modes = TEST_SANITIZED ? 4 : N_MODES;
    for (int t = 0; t < n_modes && !failed; t++) {
        if (TEST_SANITIZED && (t == 1 || t == 2)) { /* skip prefix and reuse, but keep the fixture in step */
            char line[65536];
            if (fscanf(fx, " ") != 0) failed = 1; /* the newline the last logit left */
            for (int k = 0; k < 1 + N_STEPS; k++)
                if (!fgets(line, sizeof line, fx)) failed = 1;
            continue;
        }
        cb_blend_opts_t o;
        cb_blend_opts_default(&o);
        o.mode = t == 0 ? CB_BLEND_FULL : t == 1 ? CB_BLEND_PREFIX : t == 2 ? CB_BLEND_REUSE : CB_BLEND_BLEND;
        if (t == 4) o.metric = 'v';
        o.sparse_keys = 0.0f; /* the fixture predates sparse keys: the dense blend */
        cb_blend_stats_t st;
        int rc = cb_blend_prefill(b, seq, pre, 45, ch, 3, suf, 40, &o, lg, &st, err, sizeof err);
        if (rc) {
            fprintf(stderr, "  mode %d: %s\n", t, err);
            failed = 1;
            break;
        }
        unsigned long h = 0;
        for (int i = 0; i < st.tokens_recomputed; i++) h = h * 31 + (unsigned)st.selected[i];
        char name[32];
        int want_rec = -1;
        unsigned long want_h = 0;
        if (fscanf(fx, "%31s recomputed %d sel_hash %lu\n", name, &want_rec, &want_h) != 3 ||
            want_rec != st.tokens_recomputed || want_h != h) {
            fprintf(stderr, "  %s: recomputed %d (want %d), selection hash %lu (want %lu)\n", name,
                    st.tokens_recomputed, want_rec, h, want_h);
            failed = 1;
            break;
        }
        for (int d = 0; d < N_STEPS && !failed; d++) {
            int best = 0, step = -1, want_best = -1;
            for (int v = 1; v < hp->n_vocab; v++)
                if (lg[v] > lg[best]) best = v;
            if (fscanf(fx, "%31s step %d argmax %d logits", name, &step, &want_best) != 3 || step != d ||
                want_best != best) {
                fprintf(stderr, "  %s step %d: argmax %d, want %d\n", name, d, best, want_best);
                failed = 1;
                break;
            }
            for (int v = 0; v < hp->n_vocab; v += 97) {
                double want;
                if (fscanf(fx, "%lf", &want) != 1) {
                    failed = 1;
                    break;
                }
                double dd = fabs(want - lg[v]);
                worst = dd > worst ? dd : worst;
            }
            if (cb_engine_decode(e, seq, best, st.n_tokens + d, lg) != CB_ENGINE_OK) failed = 1;
        }
    }
    fprintf(stderr, "  largest |logit - before| over the modes and steps: %.3g\n", worst);
    free(lg);
    fclose(fx);
    cb_seq_destroy(&seq);
    cb_blend_destroy(&b);
    cb_kvstore_destroy(&ks);
    cb_engine_destroy(&e);
    cb_model_destroy(&m);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "  could not remove %s\n", dir);
    CHECK(!failed);
    CHECK(worst <= 5e-4);
}

int main(void) {
    RUN(test_modes_match_before);
    return test_summary();
}
