/* cb-eval: quality and speed of the four reuse modes (full, prefix, reuse, blend) on MuSiQue (docs/eval.md).
 *
 *   cb-eval [--model PATH] [--chat-template NAME] [--system-prompt TEXT] --data FILE.jsonl [--limit N] [--skip N] [--modes LIST] [--ratio R|auto] [--metric k|v|a]
 *           [--check-layer L] [--gradual R1:L] [--lead N] [--probe-layers N] [--probe-suffix N] [--no-overlap]
 *           [--kv-dir DIR] [--kv-dtype f16|f32|bf16] [--mem-mb N] [--out DIR] [--threads N] [--max-new N]
 *           [--ref RESULTS.jsonl]
 *
 * The served path: the model, prompt, engine, chunk store and blend are a RAG session (svc/session.h), the
 * one cb-blend builds, and the prompt is ragprompt.h's: for each example prefix P = the chat template's
 * system turn (the template's default system prompt, or --system-prompt's: cb-blend's is blend.system_prompt)
 * + user-turn opening + the anchors' instruction ending in
 * "Passages:\n"; the 10 chunks "{title}\n\n{text}\n\n"; suffix S = the anchors' query text
 * "...Question:{q}?\nAnswer:" + end of the user turn + assistant opening; each piece tokenized on its own and
 * concatenated (never the concatenated text). Missing chunk KV files are precomputed first (not timed). Then for each mode: the prefill from the files, greedy decoding of at most --max-new (32) tokens,
 * stopping at end-of-generation or at a newline after the first line's text. TTFT = from the start of the
 * request (chunk lookups and KV loads included) to the first sampled token.
 *
 * --modes is a comma list of mode names, each optionally with overrides, e.g.
 *   full,prefix,reuse,blend,blend:r=0.05,blend:metric=k,blend:gradual=0.3/6,blend:lead=4,blend:overlap=0
 * (keys: r (a ratio or auto), t (auto's target), cost, floor, ceil, metric, check, gradual R1/L, lead, probe
 * (layers), psuf (probe suffix rows), overlap 0|1, kv (the chunk files' dtype: f16|f32|bf16|q8_0, kept in
 * KV_DIR/<dtype> when it is not --kv-dtype's, so e.g. `blend,blend:kv=q8_0` compares two file dtypes against
 * the same full in one run)); the token is the mode's label. Plain `blend` takes --ratio, --metric, --check-layer, --gradual, --lead, --probe-layers,
 * --probe-suffix, --no-overlap.
 *
 * Output: OUT/results.jsonl (one line per example and mode: id, mode, answer, f1, agree_f1,
 * first_token_match, ttft_ms, tokens_reused, tokens_recomputed, plus n_tokens, output, timings) and
 * OUT/summary.json {"modes": {label: {n, f1, agree_f1, first_token_match, ttft_ms, ttft_ratio, recompute_frac,
 * ...}}, "config": {...}}, rewritten after every example; with several blend variants also one
 * OUT/summary-<label>.json per variant (the non-blend modes + that variant as "blend", its ratio in config)
 * for scripts/plot-eval. The summary is printed as a table at the end; progress goes to stderr.
 * cb-eval --summarize [--out DIR] [blend flags] RESULTS.jsonl... recomputes summary.json (and the per-variant
 * summaries) from results files, e.g. to merge a run resumed with --skip; the mode labels are parsed again
 * (pass the same blend flags as the runs); of each file only examples with a line for every mode count;
 * --modes (before --summarize) keeps only those labels.
 * --ref takes the full-prefill answers, first tokens and TTFTs of an earlier run's results.jsonl instead of
 * running full again (when full is not among the modes): a "full" row is then filled from that file, and
 * agree_f1 / first_token_match / ttft_ratio are against it (TTFTs of two runs: a rougher ratio).
 * Model: --model, else $CB_MODEL, else the default model (svc/svcconfig.h). Chat template: the GGUF's (recognised), or
 * --chat-template NAME (smollm2, chatml, qwen2.5, llama3, mistral, gemma, completion).
 * Exit: 0 ok, 1 runtime error, 2 bad arguments.
 */
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "base/log.h"
#include "engine/backend_select.h"
#include "eval.h"
#include "svc/svcconfig.h"
#include "wire/query.h"

static int usage(const char *why) {
    if (why) fprintf(stderr, "cb-eval: %s\n", why);
    fprintf(stderr,
            "usage: cb-eval [--model PATH] [--chat-template NAME] [--system-prompt TEXT] --data FILE.jsonl [options]\n"
            "  --system-prompt S  the system turn's text (default \"\": the template's own line; cb-blend's is\n"
            "                     blend.system_prompt)\n"
            "  --limit N          first N examples (after --skip; default all)\n"
            "  --skip N           skip the first N examples\n"
            "  --modes LIST       comma list (default full,prefix,reuse,blend); a token may carry overrides,\n"
            "                     blend:r=0.05:metric=k:check=1:gradual=0.3/6:lead=4:probe=15:psuf=16:overlap=0,\n"
            "                     blend:r=auto (ratio = auto), blend:t=0.6:floor=0.02:ceil=0.4 (auto with that target),\n"
            "                     blend:r=auto:cost=3000 (auto ranking by mass per cost, 1 + pos / 3000)\n"
            "                     blend:kv=q8_0 (chunk files of that dtype, in KV_DIR/q8_0)\n"
            "                     blend:sparse=0.25 (chosen rows attend the prefix, their chunk and that share of\n"
            "                     the other earlier key blocks, by probe mass; 0 = dense)\n"
            "  --ratio R|auto     blend recompute ratio (default %.2f), or auto: chosen per example\n"
            "  --auto-target T    ratio = auto's share of the candidates' score to cover (implies auto)\n"
            "  --metric k|v|a     selection metric: K or V deviation, or attention from the question (default %c)\n"
            "  --check-layer L    check layer (default %d)\n"
            "  --gradual R1:L     gradual filtering from ratio R1 at the check layer to R at layer L\n"
            "  --lead N           leading tokens of each chunk always recomputed (default %d)\n"
            "  --probe-layers N   metric a: layers the probe pass measures (default %d; 0 = all)\n"
            "  --probe-suffix N   metric a: last suffix rows the probe pass computes (default %d; 0 = all)\n"
            "  --sparse-keys S    blend, metric a: share of earlier key blocks the chosen rows attend (default %.2f;\n"
            "                     0 = dense)\n"
            "  --no-overlap       load each layer's KV serially (no loader thread)\n"
            "  --kv-dir DIR       chunk KV files (default var/kv; created)\n"
            "  --kv-dtype T       f16 (default), bf16, f32 or q8_0 (int8 blocks) for new files\n"
            "  --mem-mb N         in-memory KV tier of N MiB (default 0: every mode streams from files)\n"
            "  --out DIR          results directory (default results/eval; created)\n"
            "  --threads N        engine threads (default $CB_THREADS or all cores)\n"
            "  --backend B        auto|cpu|cuda (default $CB_BACKEND or auto)\n"
            "  --max-new N        new tokens at most (default 32)\n"
            "  --ref FILE         full-mode answers and TTFTs from an earlier results.jsonl (instead of running full)\n"
            "  --summarize F...   only rebuild OUT/summary*.json from results.jsonl files (merging runs)\n"
            "  --dump-prompt      print the first example's prompt (pieces separated by |) and exit\n"
            "  model default: $CB_MODEL or " CB_SVC_DEFAULT_MODEL "\n",
            (double)CB_BLEND_DEFAULT_RATIO, CB_BLEND_DEFAULT_METRIC, CB_BLEND_DEFAULT_CHECK_LAYER,
            CB_BLEND_DEFAULT_LEAD, CB_BLEND_DEFAULT_PROBE_LAYERS, CB_BLEND_DEFAULT_PROBE_SUFFIX,
            (double)CB_BLEND_DEFAULT_SPARSE_KEYS);
    return 2;
}

/* 0, or the exit code of a usage error (printed). */
static int parse_args(int argc, char **argv, eval_args_t *a) {
    memset(a, 0, sizeof *a);
    a->model_path = cb_svc_model_path(NULL);
    a->modes_arg = "full,prefix,reuse,blend";
    a->kv_dir = "var/kv";
    a->out = "results/eval";
    a->limit = -1;
    a->max_new = 32;
    a->dtype = CB_KV_F16;
    cb_blend_opts_default(&a->base);
    cb_blend_opts_t *b = &a->base;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool has_v = true;
        long l;
        if (!strcmp(o, "--no-overlap")) b->no_overlap = true, has_v = false;
        else if (!strcmp(o, "--dump-prompt")) a->dump_prompt = true, has_v = false;
        else if (!strcmp(o, "--summarize")) {
            a->summarize_from = i + 1;
            if (a->summarize_from >= argc) return usage("--summarize needs results files");
            return 0;
        }
        else if (!strcmp(o, "-h") || !strcmp(o, "--help")) return usage(NULL);
        else if (!v) return usage("missing value after an option");
        else if (!strcmp(o, "--model")) a->model_path = v;
        else if (!strcmp(o, "--chat-template")) a->chat_tmpl = v;
        else if (!strcmp(o, "--system-prompt")) a->system_prompt = v;
        else if (!strcmp(o, "--data")) a->data = v;
        else if (!strcmp(o, "--limit")) { if (!parse_long(v, 0, INT_MAX, &a->limit)) return usage("bad --limit"); }
        else if (!strcmp(o, "--skip")) { if (!parse_long(v, 0, INT_MAX, &a->skip)) return usage("bad --skip"); }
        else if (!strcmp(o, "--modes")) a->modes_arg = v, a->modes_given = true;
        else if (!strcmp(o, "--ratio") && !strcmp(v, "auto")) b->auto_target = CB_BLEND_DEFAULT_AUTO_TARGET;
        else if (!strcmp(o, "--ratio")) { if (!parse_float(v, 0.0f, 1.0f, &b->ratio)) return usage("bad --ratio"); }
        else if (!strcmp(o, "--auto-target")) { if (!parse_float(v, 1e-6f, 1.0f, &b->auto_target)) return usage("bad --auto-target"); }
        else if (!strcmp(o, "--metric")) {
            if (!cb_blend_metric_parse(v)) return usage("bad --metric");
            b->metric = v[0];
        } else if (!strcmp(o, "--check-layer")) {
            if (!parse_long(v, 0, 4096, &l)) return usage("bad --check-layer");
            b->check_layer = (int)l;
        } else if (!strcmp(o, "--gradual")) {
            if (!eval_parse_gradual(v, ':', &b->gradual_ratio, &b->gradual_end_layer)) return usage("bad --gradual");
        } else if (!strcmp(o, "--lead")) {
            if (!parse_long(v, 0, 1 << 20, &l)) return usage("bad --lead");
            b->lead_tokens = (int)l;
        } else if (!strcmp(o, "--probe-layers")) {
            if (!parse_long(v, 0, 4096, &l)) return usage("bad --probe-layers");
            b->probe_layers = (int)l;
        } else if (!strcmp(o, "--probe-suffix")) {
            if (!parse_long(v, 0, 4096, &l)) return usage("bad --probe-suffix");
            b->probe_suffix = (int)l;
        } else if (!strcmp(o, "--sparse-keys")) {
            if (!parse_float(v, 0.0f, 1.0f, &b->sparse_keys)) return usage("bad --sparse-keys");
        } else if (!strcmp(o, "--kv-dir")) a->kv_dir = v;
        else if (!strcmp(o, "--kv-dtype")) {
            int dt = cb_kv_dtype_parse(v);
            if (dt < 0) return usage("bad --kv-dtype");
            a->dtype = (cb_kv_dtype_t)dt;
        } else if (!strcmp(o, "--mem-mb")) { if (!parse_long(v, 0, 1 << 20, &a->mem_mb)) return usage("bad --mem-mb"); }
        else if (!strcmp(o, "--out")) a->out = v;
        else if (!strcmp(o, "--ref")) a->ref_path = v;
        else if (!strcmp(o, "--threads")) { if (!parse_long(v, 1, 256, &a->threads)) return usage("bad --threads"); }
        else if (!strcmp(o, "--backend")) {
            cb_backend_kind_t bk;
            if (!cb_backend_kind_parse(v, &bk)) return usage("bad --backend (auto|cpu|cuda)");
            cb_backend_set_default_kind(bk);
        }
        else if (!strcmp(o, "--max-new")) {
            if (!parse_long(v, CB_QUERY_MAX_TOKENS_MIN, CB_QUERY_MAX_TOKENS_MAX, &a->max_new)) return usage("bad --max-new");
        }
        else return usage("unknown option");
        if (has_v) i++;
    }
    if (!a->data) return usage("--data is required");
    return 0;
}

/* The variants of --modes (a "full" first: the others are scored against its answer; with --ref one read
 * from that file), each with its chunk store's index. 0, or the exit code of a usage error. */
static int build_variants(eval_t *ev) {
    const eval_args_t *a = ev->a;
    variant_t *vs = ev->vs;
    memset(ev->vs, 0, sizeof ev->vs);
    int nv = 0;
    char buf[2048];
    if (snprintf(buf, sizeof buf, "%s", a->modes_arg) >= (int)sizeof buf) return usage("--modes too long");
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (nv == MAX_VARIANTS) return usage("too many modes");
        if (!eval_parse_variant(t, &a->base, &vs[nv])) {
            fprintf(stderr, "cb-eval: bad mode \"%s\"\n", t);
            return usage(NULL);
        }
        for (int j = 0; j < nv; j++)
            if (!strcmp(vs[j].label, vs[nv].label)) return usage("a mode is listed twice");
        nv++;
    }
    if (nv == 0) return usage("no modes");
    if (a->ref_path) {
        bool has_full = false;
        for (int i = 0; i < nv; i++) has_full |= vs[i].o.mode == CB_BLEND_FULL;
        if (has_full) return usage("--ref replaces the full mode: do not list full");
        if (nv == MAX_VARIANTS) return usage("too many modes");
        memmove(&vs[1], &vs[0], sizeof(variant_t) * (size_t)nv);
        memset(&vs[0], 0, sizeof vs[0]);
        snprintf(vs[0].label, sizeof vs[0].label, "full");
        vs[0].o = a->base;
        vs[0].o.mode = CB_BLEND_FULL;
        vs[0].kv_dtype = -1;
        nv++;
    }
    for (int i = 1; i < nv; i++)
        if (vs[i].o.mode == CB_BLEND_FULL && vs[0].o.mode != CB_BLEND_FULL) {
            variant_t t = vs[0];
            vs[0] = vs[i];
            vs[i] = t;
        }
    /* one chunk store per chunk-file dtype in use, [0] --kv-dtype's */
    ev->store_dt[0] = a->dtype;
    ev->n_stores = 1;
    for (int i = 0; i < nv; i++) {
        int dt = vs[i].kv_dtype < 0 ? (int)a->dtype : vs[i].kv_dtype, si = 0;
        while (si < ev->n_stores && (int)ev->store_dt[si] != dt) si++;
        if (si == ev->n_stores) ev->store_dt[ev->n_stores++] = (cb_kv_dtype_t)dt; /* at most one per dtype */
        vs[i].store = si;
    }
    ev->nv = nv;
    return 0;
}

int main(int argc, char **argv) {
    cb_log_set_component("cb-eval");
    static eval_args_t a;
    int rc = parse_args(argc, argv, &a);
    if (rc != 0) return rc;
    if (a.summarize_from)
        return eval_summarize(a.out, &a.base, a.modes_given ? a.modes_arg : NULL, argv + a.summarize_from,
                         argc - a.summarize_from);
    static eval_t ev;
    ev.a = &a;
    if ((rc = build_variants(&ev)) != 0) return rc;
    rc = 1;
    cb_qa_set_t *set = NULL;
    if (a.ref_path && !(ev.ref = eval_load_ref(a.ref_path))) goto done;
    if (!(set = cb_qa_set_load(a.data, ev.err, sizeof ev.err))) {
        fprintf(stderr, "cb-eval: %s\n", ev.err);
        goto done;
    }
    if (eval_open(&ev) != 0 || eval_open_results(&ev) != 0) goto done;
    int n_set = cb_qa_set_size(set);
    int first = (int)(a.skip < n_set ? a.skip : n_set);
    int last = a.limit < 0 ? n_set : (int)(first + a.limit < n_set ? first + a.limit : n_set);
    int er = eval_examples(&ev, set, first, last);
    if (er == 2) {
        rc = 0;
        goto done;
    }
    if (er != 0) goto done;
    if (eval_write_summaries(a.out, ev.vs, ev.nv, ev.config) != 0) {
        fprintf(stderr, "cb-eval: writing the summary failed\n");
        goto done;
    }
    eval_print_table(stdout, ev.vs, ev.nv);
    rc = 0;
done:
    if (rc && ev.err[0] == 0) fprintf(stderr, "cb-eval: failed (out of memory?)\n");
    eval_close(&ev);
    cb_qa_set_destroy(&set);
    return rc;
}

