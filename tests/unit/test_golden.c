/* test_golden: our engine against llama.cpp on the same GGUF (tests/fixtures/logits.jsonl, made by
 * scripts/make-fixtures with llama-cpp-python, plain ggml-cpu kernels).
 *
 * Per prompt: prefill the fixture's ids, then
 *   - each of llama.cpp's top-10 logits at the last prompt position within GOLDEN_LOGIT_TOL of ours;
 *   - 32 greedy steps (argmax, no EOS stop; step 0 is the prompt's top-1) compared with llama.cpp's.
 *     A divergence is accepted only at a near-tie: llama.cpp's own top-1/top-2 gap there and our
 *     margin between the two tokens both below GOLDEN_TIE_GAP. Every divergence is printed.
 *     At least half of the prompts must match all 32 steps.
 *
 * Why these tolerances (measured, see the engine report): llama.cpp quantizes every matmul's
 * activations to Q8_1/Q8_0 (int8 per element, one f16 scale per 32) and keeps K/V, Q·K and the softmax
 * weights in f16; we compute in f32 with exactly dequantized weights. Our logits agree with an
 * independent double-precision forward pass to < 5e-5 on these prompts, while a double-precision
 * forward that emulates llama.cpp's activation quantization moves the top-10 logits by 0.14-0.85 from
 * the exact ones. Our measured difference to llama.cpp is of that same size (0.18-0.67), so
 * GOLDEN_LOGIT_TOL = 1.0. A wrong RoPE pairing, norm, mask or dequantization moves logits by whole units
 * and changes the greedy text at once, which this test would catch. The same quantization noise flips
 * near-ties: on "chat_capital" llama.cpp's top-2 gap is 0.089 and both llama.cpp and the emulation pick
 * token 60 where the exact computation (and we) pick 504.
 * Under ASan only the first two prompts and 8 greedy steps run.
 *
 * Decode runs integer matvecs on int8 activations (engine.h) while prefill stays f32, so
 * the greedy runs follow llama.cpp's noise at some steps and ours at others: the test runs twice. With the
 * native weights every prompt must meet the logit tolerance and every divergence must be at a near-tie
 * (measured: worst top-10 error 0.75, 3-4 of 10 greedy runs identical, every divergence a near-tie); with
 * the f32 reference weights (CB_ENGINE_WEIGHTS=f32) also at least half of the runs must be identical.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "model/model.h"
#include "engine/sampler.h"
#include "test.h"

#define GOLDEN_LOGIT_TOL 1.0
#define GOLDEN_TIE_GAP 0.5
#define GOLDEN_STEPS 32

static const char *fixture_path(void) {
    const char *p = getenv("CB_GOLDEN_FIXTURE");
    return p && *p ? p : "tests/fixtures/logits.jsonl";
}

/* One pass over the fixture with the native weights (f32 = false) or the f32 reference weights. */
static void golden(bool f32) {
    const char *mp = test_model_path();
    if (!mp) SKIP("model not present");
    FILE *f = fopen(fixture_path(), "r");
    if (!f) SKIP("tests/fixtures/logits.jsonl not present");
    char err[256];
    if (f32) setenv("CB_ENGINE_WEIGHTS", "f32", 1);
    cb_model_t *m = cb_model_load(mp, err, sizeof err);
    unsetenv("CB_ENGINE_WEIGHTS");
    CHECK_MSG(m, "%s", err);
    fprintf(stderr, "  %s weights:\n", f32 ? "f32 reference" : "native (int8 matvecs)");
    const int V = cb_model_hparams(m)->n_vocab;
    float *lg = malloc(sizeof(float) * (size_t)V);
    cb_engine_t *e = NULL;
    cb_seq_t *seq = NULL;
    int n_prompts = 0, n_full = 0, failed = 0;
    double worst = 0.0;
    char *line = NULL;
    size_t cap = 0;
    const int max_prompts = TEST_SANITIZED ? 2 : 1000, steps = TEST_SANITIZED ? 8 : GOLDEN_STEPS;
    while (getline(&line, &cap, f) > 0 && n_prompts < max_prompts) {
        json_error_t jerr;
        json_t *o = json_loads(line, 0, &jerr);
        if (!o) continue;
        const char *name = json_string_value(json_object_get(o, "name"));
        json_t *ids = json_object_get(o, "ids"), *top = json_object_get(o, "top10"), *greedy = json_object_get(o, "greedy");
        json_t *gaps = json_object_get(o, "gaps");
        int n = (int)json_array_size(ids);
        if (!name || n < 1 || json_array_size(top) < 1 || json_array_size(greedy) < (size_t)steps) {
            json_decref(o);
            failed = 1;
            fprintf(stderr, "  malformed fixture line\n");
            break;
        }
        int32_t *tok = malloc(sizeof(int32_t) * (size_t)(n + GOLDEN_STEPS));
        for (int i = 0; i < n; i++) tok[i] = (int32_t)json_integer_value(json_array_get(ids, (size_t)i));
        if (!e || cb_engine_max_ctx(e) < n + GOLDEN_STEPS) {
            cb_seq_destroy(&seq);
            cb_engine_destroy(&e);
            e = cb_engine_new(m, n + GOLDEN_STEPS < 2048 ? 2048 : n + GOLDEN_STEPS, err, sizeof err);
            seq = e ? cb_seq_new(e) : NULL;
        }
        if (!seq || cb_engine_prefill(e, seq, tok, n, 0, lg) != CB_ENGINE_OK) {
            fprintf(stderr, "  %s: prefill failed %s\n", name, e ? "" : err);
            failed = 1;
            free(tok);
            json_decref(o);
            break;
        }
        /* top-1 and top-10 logits */
        int32_t ref_top1 = (int32_t)json_integer_value(json_array_get(json_array_get(top, 0), 0));
        int32_t our_top1 = cb_argmax(lg, V);
        double md = 0.0;
        for (size_t i = 0; i < json_array_size(top); i++) {
            json_t *pair = json_array_get(top, i);
            int32_t id = (int32_t)json_integer_value(json_array_get(pair, 0));
            double ref = json_number_value(json_array_get(pair, 1));
            if (id >= 0 && id < V) md = fmax(md, fabs(lg[id] - ref));
        }
        worst = fmax(worst, md);
        /* greedy continuation */
        int diverge = -1;
        double our_margin = 0.0;
        int32_t t = our_top1;
        for (int st = 0; st < steps; st++) {
            int32_t ref = (int32_t)json_integer_value(json_array_get(greedy, (size_t)st));
            if (t != ref) {
                diverge = st;
                our_margin = lg[t] - lg[ref];
                break;
            }
            if (st + 1 < steps && cb_engine_decode(e, seq, t, n + st, lg) != CB_ENGINE_OK) {
                failed = 1;
                break;
            }
            t = cb_argmax(lg, V);
        }
        double gap = diverge >= 0 && gaps ? json_number_value(json_array_get(gaps, (size_t)diverge)) : -1.0;
        fprintf(stderr, "  %-18s %5d tokens: top1 %s, max|top10 diff| %.4f, greedy %s", name, n,
                our_top1 == ref_top1 ? "same" : "differs", md, diverge < 0 ? "identical (32)" : "diverges");
        if (diverge >= 0)
            fprintf(stderr, " at step %d: llama.cpp gap %.4f, our margin %.4f%s", diverge, gap, our_margin,
                    gap >= 0 && gap < GOLDEN_TIE_GAP && our_margin < GOLDEN_TIE_GAP ? " (near-tie)" : " NOT A TIE");
        fputc('\n', stderr);
        if (md > GOLDEN_LOGIT_TOL) failed = 1;
        if (diverge >= 0 && !(gap >= 0 && gap < GOLDEN_TIE_GAP && our_margin < GOLDEN_TIE_GAP)) failed = 1;
        if (diverge < 0) n_full++;
        n_prompts++;
        free(tok);
        json_decref(o);
    }
    free(line);
    fclose(f);
    free(lg);
    cb_seq_destroy(&seq);
    cb_engine_destroy(&e);
    cb_model_destroy(&m);
    if (n_prompts == 0) SKIP("fixture has no prompts yet");
    fprintf(stderr, "  %d prompts: %d fully identical greedy runs, worst top-10 logit error %.4f (tol %.2f)\n",
            n_prompts, n_full, worst, GOLDEN_LOGIT_TOL);
    CHECK(!failed);
    if (f32) CHECK(n_full * 2 >= n_prompts);
}

TEST(test_golden_llamacpp) { golden(false); }
TEST(test_golden_llamacpp_f32) { golden(true); }

int main(void) {
    RUN(test_golden_llamacpp);
    RUN(test_golden_llamacpp_f32);
    return test_summary();
}
