/* cb-eval: quality and speed of the four reuse modes (full, prefix, reuse, blend) on MuSiQue (docs/eval.md).
 *
 *   cb-eval [--model PATH] [--chat-template NAME] --data FILE.jsonl [--limit N] [--skip N] [--modes LIST] [--ratio R|auto] [--metric k|v|a]
 *           [--check-layer L] [--gradual R1:L] [--lead N] [--probe-layers N] [--probe-suffix N] [--no-overlap]
 *           [--kv-dir DIR] [--kv-dtype f16|f32|bf16] [--mem-mb N] [--out DIR] [--threads N] [--max-new N]
 *           [--ref RESULTS.jsonl]
 *
 * The served path: the model, prompt, engine, chunk store and blend are a RAG session (svc/session.h), the
 * one cb-blend builds, and the prompt is ragprompt.h's: for each example prefix P = the chat template's
 * system turn (default system prompt) + user-turn opening + the anchors' instruction ending in
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
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "args.h"
#include "base/alloc.h"
#include "base/clock.h"
#include "engine/backend_select.h"
#include "blend/blend.h"
#include "engine/engine.h"
#include "kv/kvmem.h"
#include "kv/kvstore.h"
#include "base/log.h"
#include "base/utf8.h"
#include "model/model.h"
#include "rag/qa.h"
#include "rag/ragprompt.h"
#include "svc/session.h"
#include "svc/svcconfig.h"
#include "engine/sampler.h"
#include "model/tokenizer.h"

#define MAX_VARIANTS 32
#define MAX_STORES 4 /* chunk-file dtypes: f32, f16, bf16, q8_0 */

typedef struct {
    char label[64];
    cb_blend_opts_t o;
    int kv_dtype;              /* the chunk files' dtype (mode key kv=); -1: the run's --kv-dtype */
    int store;                 /* index of its chunk store (stores[], one per dtype in use) */
    /* sums over examples */
    int n, n_agree, n_ftm, n_kl;
    double f1, agree, ftm, kl, ttft, ttft_cpu, rfrac, load, wait, sel, comp, resolve;
    double rchosen;            /* sum of the blend's ratio_chosen (ratio = auto: what each example chose) */
} variant_t;

static int usage(const char *why) {
    if (why) fprintf(stderr, "cb-eval: %s\n", why);
    fprintf(stderr,
            "usage: cb-eval [--model PATH] [--chat-template NAME] --data FILE.jsonl [options]\n"
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

/* CPU time of the whole process (all threads): the work done, whatever else runs on the machine. */
static double cpu_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

/* "R1<sep>L" into ratio and layer. */
static bool parse_gradual(const char *s, char sep, float *r1, int *layer) {
    const char *p = strchr(s, sep);
    if (!p || p == s) return false;
    char a[32];
    size_t n = (size_t)(p - s);
    if (n >= sizeof a) return false;
    memcpy(a, s, n);
    a[n] = 0;
    long l;
    if (!parse_float(a, 0.0f, 1.0f, r1) || !parse_long(p + 1, 0, 4096, &l)) return false;
    *layer = (int)l;
    return true;
}

/* One --modes token ("blend:r=0.1:metric=k") on top of base. */
static bool parse_variant(const char *tok, const cb_blend_opts_t *base, variant_t *v) {
    if (strlen(tok) >= sizeof v->label || !*tok) return false;
    snprintf(v->label, sizeof v->label, "%s", tok);
    char buf[64];
    snprintf(buf, sizeof buf, "%s", tok);
    char *save = NULL, *name = strtok_r(buf, ":", &save);
    int m = cb_blend_mode_parse(name);
    if (m < 0) return false;
    v->o = *base;
    v->o.mode = (cb_blend_mode_t)m;
    v->kv_dtype = -1;
    for (char *kv = strtok_r(NULL, ":", &save); kv; kv = strtok_r(NULL, ":", &save)) {
        char *eq = strchr(kv, '=');
        if (!eq) return false;
        *eq = 0;
        const char *k = kv, *val = eq + 1;
        long l;
        if (!strcmp(k, "r") && !strcmp(val, "auto")) {
            if (v->o.auto_target == 0.0f) v->o.auto_target = CB_BLEND_DEFAULT_AUTO_TARGET;
        } else if (!strcmp(k, "r")) {
            if (!parse_float(val, 0.0f, 1.0f, &v->o.ratio)) return false;
            v->o.auto_target = 0.0f;
        } else if (!strcmp(k, "t")) { /* ratio = auto with this target */
            if (!parse_float(val, 1e-6f, 1.0f, &v->o.auto_target)) return false;
        } else if (!strcmp(k, "cost")) { /* ratio = auto ranks by mass per cost, 1 + pos / cost */
            if (!parse_float(val, 0.0f, CB_BLEND_AUTO_COST_KEYS_MAX, &v->o.auto_cost_keys)) return false;
        } else if (!strcmp(k, "floor")) {
            if (!parse_float(val, 0.0f, 1.0f, &v->o.auto_floor)) return false;
        } else if (!strcmp(k, "ceil")) {
            if (!parse_float(val, 0.0f, 1.0f, &v->o.auto_ceil)) return false;
        } else if (!strcmp(k, "metric")) {
            if (!cb_blend_metric_parse(val)) return false;
            v->o.metric = val[0];
        } else if (!strcmp(k, "check")) {
            if (!parse_long(val, 0, 4096, &l)) return false;
            v->o.check_layer = (int)l;
        } else if (!strcmp(k, "gradual")) {
            if (!strcmp(val, "0")) v->o.gradual_ratio = 0.0f;
            else if (!parse_gradual(val, '/', &v->o.gradual_ratio, &v->o.gradual_end_layer)) return false;
        } else if (!strcmp(k, "lead")) {
            if (!parse_long(val, 0, 1 << 20, &l)) return false;
            v->o.lead_tokens = (int)l;
        } else if (!strcmp(k, "probe")) {
            if (!parse_long(val, 0, 4096, &l)) return false;
            v->o.probe_layers = (int)l;
        } else if (!strcmp(k, "sparse")) { /* sparse attention for the chosen rows: share of blocks kept */
            if (!parse_float(val, 0.0f, 1.0f, &v->o.sparse_keys)) return false;
        } else if (!strcmp(k, "psuf")) {
            if (!parse_long(val, 0, 4096, &l)) return false;
            v->o.probe_suffix = (int)l;
        } else if (!strcmp(k, "overlap")) {
            if (strcmp(val, "0") && strcmp(val, "1")) return false;
            v->o.no_overlap = val[0] == '0';
        } else if (!strcmp(k, "kv")) { /* this mode's chunk files in another dtype (their own store) */
            if ((v->kv_dtype = cb_kv_dtype_parse(val)) < 0) return false;
        } else {
            return false;
        }
    }
    return true;
}

static int mkdir_p(const char *path) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return -1;
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
    return 0;
}

static json_t *summary_mode(const variant_t *v, const variant_t *full) {
    json_t *m = json_object();
    double n = v->n > 0 ? v->n : 1;
    json_object_set_new(m, "n", json_integer(v->n));
    json_object_set_new(m, "f1", json_real(v->f1 / n));
    json_object_set_new(m, "agree_f1", v->n_agree ? json_real(v->agree / v->n_agree) : json_null());
    json_object_set_new(m, "first_token_match", v->n_ftm ? json_real(v->ftm / v->n_ftm) : json_null());
    json_object_set_new(m, "kl_first", v->n_kl ? json_real(v->kl / v->n_kl) : json_null());
    json_object_set_new(m, "ttft_ms", json_real(v->ttft / n));
    json_object_set_new(m, "ttft_ratio",
                        full && full->n > 0 && full->ttft > 0 ? json_real((v->ttft / n) / (full->ttft / full->n))
                                                              : json_null());
    json_object_set_new(m, "ttft_cpu_ms", json_real(v->ttft_cpu / n));
    json_object_set_new(m, "ttft_cpu_ratio", full && full->n > 0 && full->ttft_cpu > 0
                                                 ? json_real((v->ttft_cpu / n) / (full->ttft_cpu / full->n))
                                                 : json_null());
    json_object_set_new(m, "recompute_frac", json_real(v->rfrac / n));
    json_object_set_new(m, "ratio_chosen", json_real(v->rchosen / n));
    json_object_set_new(m, "load_ms", json_real(v->load / n));
    json_object_set_new(m, "load_wait_ms", json_real(v->wait / n));
    json_object_set_new(m, "select_ms", json_real(v->sel / n));
    json_object_set_new(m, "compute_ms", json_real(v->comp / n));
    json_object_set_new(m, "resolve_ms", json_real(v->resolve / n));
    json_t *c = json_object();
    json_object_set_new(c, "mode", json_string(cb_blend_mode_str(v->o.mode)));
    if (v->o.mode == CB_BLEND_BLEND) {
        json_object_set_new(c, "ratio", json_real(v->o.ratio));
        json_object_set_new(c, "auto_target", json_real(v->o.auto_target));
        json_object_set_new(c, "auto_cost_keys", json_real(v->o.auto_cost_keys));
        char mt[2] = {v->o.metric, 0};
        json_object_set_new(c, "metric", json_string(mt));
        json_object_set_new(c, "check_layer", json_integer(v->o.check_layer));
        json_object_set_new(c, "gradual_ratio", json_real(v->o.gradual_ratio));
        json_object_set_new(c, "gradual_end_layer", json_integer(v->o.gradual_ratio != 0.0f ? v->o.gradual_end_layer : 0));
        json_object_set_new(c, "lead_tokens", json_integer(v->o.lead_tokens));
        json_object_set_new(c, "probe_layers", json_integer(v->o.probe_layers));
        json_object_set_new(c, "probe_suffix", json_integer(v->o.probe_suffix));
        json_object_set_new(c, "sparse_keys", json_real(v->o.sparse_keys));
    }
    json_object_set_new(c, "overlap", json_boolean(!v->o.no_overlap));
    json_object_set_new(m, "config", c);
    return m;
}

static int write_json(const char *path, json_t *j) {
    char tmp[4400];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) return -1;
    if (json_dump_file(j, tmp, JSON_INDENT(2) | JSON_REAL_PRECISION(6)) != 0) return -1;
    return rename(tmp, path);
}

/* summary.json (all variants) and, with several blend variants, summary-<label>.json per variant. */
static int write_summaries(const char *out, variant_t *vs, int nv, json_t *config) {
    const variant_t *full = NULL;
    int n_blend = 0;
    for (int i = 0; i < nv; i++) {
        if (!full && vs[i].o.mode == CB_BLEND_FULL) full = &vs[i];
        n_blend += vs[i].o.mode == CB_BLEND_BLEND;
    }
    char path[4200];
    json_t *root = json_object(), *modes = json_object();
    for (int i = 0; i < nv; i++) json_object_set_new(modes, vs[i].label, summary_mode(&vs[i], full));
    json_object_set_new(root, "modes", modes);
    json_object_set(root, "config", config);
    snprintf(path, sizeof path, "%s/summary.json", out);
    int rc = write_json(path, root);
    json_decref(root);
    if (n_blend < 2) return rc;
    for (int i = 0; i < nv; i++) {
        if (vs[i].o.mode != CB_BLEND_BLEND) continue;
        json_t *r = json_object(), *m = json_object();
        for (int j = 0; j < nv; j++)
            if (vs[j].o.mode != CB_BLEND_BLEND && !strcmp(vs[j].label, cb_blend_mode_str(vs[j].o.mode)))
                json_object_set_new(m, vs[j].label, summary_mode(&vs[j], full));
        json_object_set_new(m, "blend", summary_mode(&vs[i], full));
        json_object_set_new(r, "modes", m);
        json_t *c = json_deep_copy(config);
        json_object_set_new(c, "ratio", json_real(vs[i].o.ratio));
        json_object_set_new(c, "variant", json_string(vs[i].label));
        json_object_set_new(r, "config", c);
        char name[80];
        snprintf(name, sizeof name, "%s", vs[i].label);
        for (char *p = name; *p; p++)
            if (*p == ':' || *p == '/' || *p == '=') *p = '_';
        snprintf(path, sizeof path, "%s/summary-%s.json", out, name);
        rc |= write_json(path, r);
        json_decref(r);
    }
    return rc;
}

static void print_table(FILE *f, const variant_t *vs, int nv) {
    const variant_t *full = NULL;
    for (int i = 0; i < nv; i++)
        if (vs[i].o.mode == CB_BLEND_FULL) {
            full = &vs[i];
            break;
        }
    fprintf(f, "%-28s %4s %7s %9s %7s %8s %10s %10s %10s %8s %8s %8s\n", "mode", "n", "f1", "agree_f1", "ftm", "kl",
            "ttft_ms", "ttft_ratio", "cpu_ratio", "recomp", "load_ms", "wait_ms");
    for (int i = 0; i < nv; i++) {
        const variant_t *v = &vs[i];
        double n = v->n > 0 ? v->n : 1;
        char ag[16] = "-", ft[16] = "-", tr[16] = "-", cr[16] = "-", kl[16] = "-";
        if (v->n_kl) snprintf(kl, sizeof kl, "%.4f", v->kl / v->n_kl);
        if (v->n_agree) {
            snprintf(ag, sizeof ag, "%.3f", v->agree / v->n_agree);
            if (v->n_ftm) snprintf(ft, sizeof ft, "%.3f", v->ftm / v->n_ftm);
        }
        if (full && full->n > 0 && full->ttft > 0) {
            snprintf(tr, sizeof tr, "%.3f", (v->ttft / n) / (full->ttft / full->n));
            snprintf(cr, sizeof cr, "%.3f", (v->ttft_cpu / n) / (full->ttft_cpu / full->n));
        }
        fprintf(f, "%-28s %4d %7.3f %9s %7s %8s %10.1f %10s %10s %8.3f %8.1f %8.1f\n", v->label, v->n, v->f1 / n, ag, ft,
                kl, v->ttft / n, tr, cr, v->rfrac / n, v->load / n, v->wait / n);
    }
}

/* Adds one results line to its variant (created from the label on first sight). 0, or -1 (bad label/line). */
static int summarize_line(json_t *j, const cb_blend_opts_t *base, const char *only, variant_t *vs, int *nv) {
    const char *label = json_string_value(json_object_get(j, "mode"));
    if (!label) return -1;
    if (only) { /* comma list of labels to keep */
        size_t n = strlen(label);
        const char *p = only;
        bool found = false;
        while (!found && (p = strstr(p, label)) != NULL) {
            found = (p == only || p[-1] == ',') && (p[n] == ',' || p[n] == 0);
            p += n;
        }
        if (!found) return 0;
    }
    variant_t *v = NULL;
    for (int i = 0; i < *nv; i++)
        if (!strcmp(vs[i].label, label)) v = &vs[i];
    if (!v) {
        if (*nv == MAX_VARIANTS) return -1;
        v = &vs[*nv];
        memset(v, 0, sizeof *v);
        if (!parse_variant(label, base, v)) return -1;
        (*nv)++;
    }
    double n_tok = json_number_value(json_object_get(j, "n_tokens"));
    v->n++;
    v->f1 += json_number_value(json_object_get(j, "f1"));
    json_t *a = json_object_get(j, "agree_f1"), *ft = json_object_get(j, "first_token_match"),
           *kl = json_object_get(j, "kl_first");
    if (json_is_number(a)) v->n_agree++, v->agree += json_number_value(a);
    if (json_is_boolean(ft)) v->n_ftm++, v->ftm += json_is_true(ft);
    if (json_is_number(kl)) v->n_kl++, v->kl += json_number_value(kl);
    v->ttft += json_number_value(json_object_get(j, "ttft_ms"));
    v->ttft_cpu += json_number_value(json_object_get(j, "ttft_cpu_ms"));
    v->rfrac += n_tok > 0 ? json_number_value(json_object_get(j, "tokens_recomputed")) / n_tok : 0.0;
    v->load += json_number_value(json_object_get(j, "load_ms"));
    v->wait += json_number_value(json_object_get(j, "load_wait_ms"));
    v->sel += json_number_value(json_object_get(j, "select_ms"));
    v->comp += json_number_value(json_object_get(j, "compute_ms"));
    v->resolve += json_number_value(json_object_get(j, "resolve_ms"));
    return 0;
}

/* --summarize: rebuild the summaries from results files. */
static int summarize(const char *out, const cb_blend_opts_t *base, const char *only, char **files, int n_files) {
    static variant_t vs[MAX_VARIANTS];
    int nv = 0, n_ex = 0;
    for (int f = 0; f < n_files; f++) {
        json_t *arr = json_array(), *count = json_object();
        FILE *fp = fopen(files[f], "r");
        if (!fp) {
            fprintf(stderr, "cb-eval: %s: %s\n", files[f], strerror(errno));
            return 1;
        }
        char *line = NULL;
        size_t cap = 0;
        int max_per_id = 0;
        while (getline(&line, &cap, fp) > 0) {
            json_error_t je;
            json_t *j = json_loads(line, 0, &je);
            const char *id = j ? json_string_value(json_object_get(j, "id")) : NULL;
            if (!id) {
                fprintf(stderr, "cb-eval: %s: bad line skipped\n", files[f]);
                json_decref(j);
                continue;
            }
            json_int_t c = json_integer_value(json_object_get(count, id)) + 1;
            json_object_set_new(count, id, json_integer(c));
            if (c > max_per_id) max_per_id = (int)c;
            json_array_append_new(arr, j);
        }
        free(line);
        fclose(fp);
        size_t i;
        json_t *j;
        json_array_foreach(arr, i, j) {
            const char *id = json_string_value(json_object_get(j, "id"));
            if (json_integer_value(json_object_get(count, id)) != max_per_id) continue; /* incomplete example */
            if (summarize_line(j, base, only, vs, &nv)) {
                fprintf(stderr, "cb-eval: %s: bad mode label\n", files[f]);
                return 1;
            }
        }
        const char *k;
        json_t *c;
        json_object_foreach(count, k, c) n_ex += json_integer_value(c) == max_per_id;
        json_decref(arr);
        json_decref(count);
    }
    /* full first, as in a run */
    for (int i = 1; i < nv; i++)
        if (vs[i].o.mode == CB_BLEND_FULL && vs[0].o.mode != CB_BLEND_FULL) {
            variant_t t = vs[0];
            vs[0] = vs[i];
            vs[i] = t;
        }
    if (mkdir_p(out) != 0) return 1;
    json_t *config = json_object(), *src = json_array();
    for (int f = 0; f < n_files; f++) json_array_append_new(src, json_string(files[f]));
    json_object_set_new(config, "merged_from", src);
    json_object_set_new(config, "examples", json_integer(n_ex));
    json_object_set_new(config, "ratio", json_real(base->ratio));
    int rc = write_summaries(out, vs, nv, config);
    json_decref(config);
    if (rc) {
        fprintf(stderr, "cb-eval: writing the summary failed\n");
        return 1;
    }
    print_table(stdout, vs, nv);
    return 0;
}

/* The command line. */
typedef struct {
    const char *model_path, *chat_tmpl;   /* chat_tmpl NULL = the GGUF's */
    const char *data, *modes_arg, *kv_dir, *out, *ref_path;
    long limit, skip, threads, mem_mb, max_new;
    cb_kv_dtype_t dtype;
    bool dump_prompt, modes_given;
    int summarize_from;                  /* argv index of the first results file (--summarize), else 0 */
    cb_blend_opts_t base;                /* the options of plain `blend` */
} eval_args_t;

/* The run: the session (model, prompt, engine, the first chunk store and its blend), the other stores
 * (one per further chunk-file dtype in use), buffers and the output. */
typedef struct {
    const eval_args_t *a;
    variant_t vs[MAX_VARIANTS];
    int nv;
    cb_session_t *s;
    const cb_ragprompt_t *rp;
    cb_tokenizer_t *tok;
    cb_engine_t *eng;
    int n_vocab;
    const int32_t *prefix;               /* [n_prefix] P, the session's */
    int n_prefix;
    /* [0] the session's store (--kv-dtype's files in kv_dir); the others (mode key kv=) in kv_dir/<dtype>,
     * since a file's name does not depend on its dtype, each with its own memory tier */
    cb_kvmem_t *mem[MAX_STORES];
    cb_kvstore_t *store[MAX_STORES];
    cb_blend_t *bl[MAX_STORES];
    cb_kv_dtype_t store_dt[MAX_STORES];
    int n_stores;
    cb_seq_t *seq;
    float *logits;                       /* [n_vocab] */
    double *lp_full, *lp_mode;           /* [n_vocab] first-token log-distributions */
    int32_t *gen;                        /* [max_new] */
    FILE *res;
    json_t *config, *ref;                /* ref: id -> full line of the reference run */
    char err[512];
} eval_t;

/* One example's prompt pieces (ragprompt.h). */
typedef struct {
    int nc;
    int32_t *chunk_tok[CB_QA_MAX_CTXS];
    int chunk_n[CB_QA_MAX_CTXS];
    int32_t *suffix;
    int n_suffix;
    long long total;                     /* prompt tokens */
} pieces_t;

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
            if (!parse_gradual(v, ':', &b->gradual_ratio, &b->gradual_end_layer)) return usage("bad --gradual");
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
        else if (!strcmp(o, "--max-new")) { if (!parse_long(v, 1, 4096, &a->max_new)) return usage("bad --max-new"); }
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
        if (!parse_variant(t, &a->base, &vs[nv])) {
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

/* The full-mode lines of an earlier results.jsonl, by id; NULL with a message. */
static json_t *load_ref(const char *path) {
    FILE *rf = fopen(path, "r");
    if (!rf) {
        fprintf(stderr, "cb-eval: %s: %s\n", path, strerror(errno));
        return NULL;
    }
    json_t *ref = json_object();
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, rf) > 0) {
        json_t *j = json_loads(line, 0, NULL);
        const char *id = j ? json_string_value(json_object_get(j, "id")) : NULL;
        const char *md = j ? json_string_value(json_object_get(j, "mode")) : NULL;
        if (id && md && !strcmp(md, "full") && json_is_string(json_object_get(j, "answer")) &&
            json_is_number(json_object_get(j, "ttft_ms")))
            json_object_set(ref, id, j);
        json_decref(j);
    }
    free(line);
    fclose(rf);
    if (json_object_size(ref) == 0) {
        fprintf(stderr, "cb-eval: %s: no full-mode lines\n", path);
        json_decref(ref);
        return NULL;
    }
    return ref;
}

/* The session (the served path's objects, over the model's whole context), the other chunk stores, the
 * sequence and the buffers. 0, or -1 with a message. */
static int eval_open(eval_t *ev) {
    const eval_args_t *a = ev->a;
    if (mkdir_p(a->kv_dir) != 0 || mkdir_p(a->out) != 0) {
        fprintf(stderr, "cb-eval: cannot create %s or %s: %s\n", a->kv_dir, a->out, strerror(errno));
        return -1;
    }
    cb_session_opts_t so;
    cb_session_opts_default(&so);
    so.model_path = a->model_path;
    so.chat_template = a->chat_tmpl;
    so.threads = (int)a->threads;
    so.kv_dir = a->kv_dir;
    so.kv_dtype = ev->store_dt[0];
    so.mem_bytes = (size_t)a->mem_mb << 20;
    if (!(ev->s = cb_session_new(&so, ev->err, sizeof ev->err))) {
        fprintf(stderr, "cb-eval: %s: %s\n", a->model_path, ev->err);
        return -1;
    }
    ev->rp = cb_session_prompt(ev->s);
    ev->tok = cb_session_tokenizer(ev->s);
    ev->eng = cb_session_engine(ev->s);
    ev->n_vocab = cb_session_hparams(ev->s)->n_vocab;
    ev->prefix = cb_session_prefix(ev->s, &ev->n_prefix);
    ev->store[0] = cb_session_store(ev->s);
    ev->bl[0] = cb_session_blend(ev->s);
    for (int si = 1; si < ev->n_stores; si++) {
        char dir[4096];
        if (snprintf(dir, sizeof dir, "%s/%s", a->kv_dir, cb_kv_dtype_name(ev->store_dt[si])) >= (int)sizeof dir ||
            mkdir_p(dir) != 0) {
            fprintf(stderr, "cb-eval: cannot create %s/%s\n", a->kv_dir, cb_kv_dtype_name(ev->store_dt[si]));
            return -1;
        }
        if (a->mem_mb > 0 && !(ev->mem[si] = cb_kvmem_new((size_t)a->mem_mb << 20))) return -1;
        if (!(ev->store[si] = cb_kvstore_new(ev->eng, dir, ev->mem[si], ev->store_dt[si], ev->err, sizeof ev->err)) ||
            !(ev->bl[si] = cb_blend_new(ev->store[si], ev->err, sizeof ev->err))) {
            fprintf(stderr, "cb-eval: %s\n", ev->err);
            return -1;
        }
    }
    const size_t V = (size_t)ev->n_vocab;
    if (!(ev->seq = cb_seq_new(ev->eng)) || !(ev->logits = cb_malloc(sizeof(float) * V)) ||
        !(ev->gen = cb_malloc(sizeof(int32_t) * (size_t)a->max_new)) || !(ev->lp_full = cb_malloc(sizeof(double) * V)) ||
        !(ev->lp_mode = cb_malloc(sizeof(double) * V)))
        return -1;
    return 0;
}

static void eval_close(eval_t *ev) {
    if (ev->res) fclose(ev->res);
    json_decref(ev->config);
    json_decref(ev->ref);
    free(ev->gen);
    free(ev->logits);
    free(ev->lp_full);
    free(ev->lp_mode);
    cb_seq_destroy(&ev->seq);
    for (int si = 1; si < MAX_STORES; si++) {
        cb_blend_destroy(&ev->bl[si]);
        cb_kvstore_destroy(&ev->store[si]);
        cb_kvmem_destroy(&ev->mem[si]);
    }
    cb_session_destroy(&ev->s);
}

/* OUT/results.jsonl opened and the run's configuration (summary.json's "config"). 0, or -1. */
static int open_results(eval_t *ev) {
    const eval_args_t *a = ev->a;
    const cb_blend_opts_t *b = &a->base;
    char path[4200];
    snprintf(path, sizeof path, "%s/results.jsonl", a->out);
    if (!(ev->res = fopen(path, "w"))) {
        snprintf(ev->err, sizeof ev->err, "%s", strerror(errno));
        fprintf(stderr, "cb-eval: %s: %s\n", path, ev->err);
        return -1;
    }
    json_t *c = ev->config = json_object();
    json_object_set_new(c, "model", json_string(a->model_path));
    json_object_set_new(c, "data", json_string(a->data));
    json_object_set_new(c, "skip", json_integer(a->skip));
    json_object_set_new(c, "limit", json_integer(a->limit));
    json_object_set_new(c, "modes", json_string(a->modes_arg));
    json_object_set_new(c, "ratio", json_real(b->ratio));
    char mt[2] = {b->metric, 0};
    json_object_set_new(c, "metric", json_string(mt));
    json_object_set_new(c, "check_layer", json_integer(b->check_layer));
    json_object_set_new(c, "gradual_ratio", json_real(b->gradual_ratio));
    json_object_set_new(c, "gradual_end_layer", json_integer(b->gradual_ratio != 0.0f ? b->gradual_end_layer : 0));
    json_object_set_new(c, "lead_tokens", json_integer(b->lead_tokens));
    json_object_set_new(c, "probe_layers", json_integer(b->probe_layers));
    json_object_set_new(c, "probe_suffix", json_integer(b->probe_suffix));
    json_object_set_new(c, "overlap", json_boolean(!b->no_overlap));
    json_object_set_new(c, "threads", json_integer(cb_engine_threads(ev->eng)));
    json_object_set_new(c, "kv_dtype", json_string(cb_kv_dtype_name(a->dtype)));
    json_object_set_new(c, "mem_mb", json_integer(a->mem_mb));
    json_object_set_new(c, "max_new_tokens", json_integer(a->max_new));
    json_object_set_new(c, "prefix_tokens", json_integer(ev->n_prefix));
    json_object_set_new(c, "ref", a->ref_path ? json_string(a->ref_path) : json_null());
    return 0;
}

static void pieces_free(pieces_t *p) {
    for (int c = 0; c < CB_QA_MAX_CTXS; c++) free(p->chunk_tok[c]);
    free(p->suffix);
    memset(p, 0, sizeof *p);
}

/* An example's chunks and suffix as the served path builds them (ragprompt.h: a passage's chunk text is
 * "{title}\n\n{text}"). True when every piece tokenized. */
static bool example_pieces(const eval_t *ev, const cb_qa_example_t *ex, pieces_t *p) {
    p->nc = ex->n_ctxs;
    p->total = ev->n_prefix;
    bool ok = true;
    for (int c = 0; c < p->nc; c++) {
        char *t = cb_ragprompt_passage(ex->ctxs[c].title, ex->ctxs[c].text);
        p->chunk_tok[c] = t ? cb_ragprompt_chunk(ev->rp, t, strlen(t), &p->chunk_n[c]) : NULL;
        free(t);
        if (!p->chunk_tok[c] || p->chunk_n[c] < 1) ok = false;
        else p->total += p->chunk_n[c];
    }
    if (!(p->suffix = cb_ragprompt_suffix(ev->rp, ex->question, &p->n_suffix))) ok = false;
    p->total += p->n_suffix;
    return ok;
}

/* --dump-prompt: the pieces decoded, separated by '|', and their sizes. */
static void dump_prompt(const eval_t *ev, const pieces_t *p) {
    char *t = cb_tokenizer_decode_alloc(ev->tok, ev->prefix, (size_t)ev->n_prefix, true, NULL);
    printf("%s", t ? t : "");
    free(t);
    for (int c = 0; c < p->nc; c++) {
        t = cb_tokenizer_decode_alloc(ev->tok, p->chunk_tok[c], (size_t)p->chunk_n[c], true, NULL);
        printf("|%s", t ? t : "");
        free(t);
    }
    t = cb_tokenizer_decode_alloc(ev->tok, p->suffix, (size_t)p->n_suffix, true, NULL);
    printf("|%s\n[prefix %d tokens, chunks", t ? t : "", ev->n_prefix);
    free(t);
    for (int c = 0; c < p->nc; c++) printf(" %d", p->chunk_n[c]);
    printf(", suffix %d, total %lld]\n", p->n_suffix, p->total);
}

/* The missing chunk files of every store computed (not timed); the number computed, or -1 with a message. */
static int precompute(eval_t *ev, const cb_qa_example_t *ex, const pieces_t *p) {
    int n_computed = 0;
    for (int si = 0; si < ev->n_stores; si++)
        for (int c = 0; c < p->nc; c++) {
            cb_kvstore_src_t src;
            if (cb_kvstore_ensure(ev->store[si], ev->prefix, ev->n_prefix, p->chunk_tok[c], p->chunk_n[c], &src, NULL,
                                  ev->err, sizeof ev->err)) {
                fprintf(stderr, "cb-eval: %s: chunk %d (%s): %s\n", ex->id, c, cb_kv_dtype_name(ev->store_dt[si]), ev->err);
                return -1;
            }
            n_computed += src == CB_KVSTORE_COMPUTED;
        }
    return n_computed;
}

/* The full answer and first token of the reference run for ex into *answer (owned) and *first (-2: none
 * recorded), its figures added to the "full" variant. False when ex is not in the reference run. */
static bool ref_full(eval_t *ev, const cb_qa_example_t *ex, char **answer, int32_t *first) {
    json_t *r = json_object_get(ev->ref, ex->id);
    if (!r) return false;
    *answer = cb_strdup(json_string_value(json_object_get(r, "answer")));
    json_t *ft = json_object_get(r, "first_token");
    *first = json_is_integer(ft) ? (int32_t)json_integer_value(ft) : -2;
    variant_t *fv = &ev->vs[0];
    fv->n++;
    fv->n_agree++;
    fv->agree += 1.0;
    if (*first != -2) fv->n_ftm++, fv->ftm += 1.0;
    fv->f1 += json_number_value(json_object_get(r, "f1"));
    fv->ttft += json_number_value(json_object_get(r, "ttft_ms"));
    fv->ttft_cpu += json_number_value(json_object_get(r, "ttft_cpu_ms"));
    fv->rfrac += 1.0;
    return true;
}

/* What one mode answered for one example. */
typedef struct {
    cb_blend_stats_t bst;
    double ttft, ttft_cpu, kl;           /* kl < 0: no full distribution to compare with */
    int ng;                              /* tokens generated (ev->gen) */
    char *clean;                         /* the output, valid UTF-8 (owned) */
} answer_t;

/* The prefill of v's blend (its first token greedy, timed) and the greedy decoding that follows: stop at end
 * of generation or at a newline after the first line's text. 0, or -1 with a message. */
static int answer(eval_t *ev, const char *id, const variant_t *v, const pieces_t *p, bool *have_full_lp, answer_t *r) {
    cb_blend_chunk_t chunks[CB_QA_MAX_CTXS];
    for (int c = 0; c < p->nc; c++) chunks[c] = (cb_blend_chunk_t){p->chunk_tok[c], p->chunk_n[c]};
    double t0 = cb_now_ms(), c0 = cpu_ms();
    if (cb_blend_prefill(ev->bl[v->store], ev->seq, ev->prefix, ev->n_prefix, chunks, p->nc, p->suffix, p->n_suffix,
                         &v->o, ev->logits, &r->bst, ev->err, sizeof ev->err) != CB_ENGINE_OK) {
        fprintf(stderr, "cb-eval: %s: %s: %s\n", id, v->label, ev->err);
        return -1;
    }
    int32_t t = cb_argmax(ev->logits, ev->n_vocab);
    r->ttft = cb_now_ms() - t0;
    r->ttft_cpu = cpu_ms() - c0;
    /* first-token distribution vs full's (same process only) */
    r->kl = -1.0;
    if (v->o.mode == CB_BLEND_FULL && !*have_full_lp) {
        cb_log_softmax(ev->logits, ev->n_vocab, ev->lp_full);
        *have_full_lp = true;
    }
    if (*have_full_lp) {
        cb_log_softmax(ev->logits, ev->n_vocab, ev->lp_mode);
        r->kl = cb_kl_div(ev->lp_full, ev->lp_mode, ev->n_vocab);
    }
    int ng = 0;
    char *text = NULL;
    size_t tlen = 0;
    int pos = (int)p->total;
    for (;;) {
        if (cb_tokenizer_is_eog(ev->tok, t)) break;
        ev->gen[ng++] = t;
        free(text);
        text = cb_tokenizer_decode_alloc(ev->tok, ev->gen, (size_t)ng, false, &tlen);
        if (!text) return -1;
        size_t a = 0;
        while (a < tlen && text[a] == '\n') a++;
        if (memchr(text + a, '\n', tlen - a) || ng >= ev->a->max_new) break;
        if (cb_engine_decode(ev->eng, ev->seq, t, pos++, ev->logits) != CB_ENGINE_OK) {
            free(text);
            return -1;
        }
        t = cb_argmax(ev->logits, ev->n_vocab);
    }
    /* a NUL byte (a <0x00> token) would end the C string early: made an invalid byte, it becomes U+FFFD
     * like the others */
    for (size_t b = 0; text && b < tlen; b++)
        if (text[b] == '\0') text[b] = (char)0xFF;
    r->clean = cb_utf8_repair_n(text, text ? tlen : 0, NULL);
    free(text);
    r->ng = ng;
    return r->clean ? 0 : -1;
}

/* One results line (and its progress line on stderr). */
static void write_line(eval_t *ev, const cb_qa_example_t *ex, const variant_t *v, const answer_t *r, const char *ans,
                       double f1, double agree, int ftm) {
    const cb_blend_stats_t *b = &r->bst;
    json_t *line = json_object();
    json_object_set_new(line, "id", json_string(ex->id));
    json_object_set_new(line, "mode", json_string(v->label));
    json_object_set_new(line, "answer", json_string(ans));
    json_object_set_new(line, "f1", json_real(f1));
    json_object_set_new(line, "agree_f1", agree >= 0 ? json_real(agree) : json_null());
    json_object_set_new(line, "first_token_match", ftm >= 0 ? json_boolean(ftm) : json_null());
    json_object_set_new(line, "ttft_ms", json_real(r->ttft));
    json_object_set_new(line, "ttft_cpu_ms", json_real(r->ttft_cpu));
    json_object_set_new(line, "first_token", json_integer(r->ng > 0 ? ev->gen[0] : -1));
    json_object_set_new(line, "kl_first", r->kl >= 0 ? json_real(r->kl) : json_null());
    json_object_set_new(line, "tokens_reused", json_integer(b->tokens_reused));
    json_object_set_new(line, "tokens_recomputed", json_integer(b->tokens_recomputed));
    json_object_set_new(line, "ratio_chosen", json_real(b->ratio_chosen));
    json_object_set_new(line, "n_tokens", json_integer(b->n_tokens));
    json_object_set_new(line, "output", json_string(r->clean));
    json_object_set_new(line, "load_ms", json_real(b->t_load_ms));
    json_object_set_new(line, "load_wait_ms", json_real(b->t_load_wait_ms));
    json_object_set_new(line, "select_ms", json_real(b->t_select_ms));
    json_object_set_new(line, "probe_ms", json_real(b->t_probe_ms));
    json_object_set_new(line, "compute_ms", json_real(b->t_compute_ms));
    json_object_set_new(line, "resolve_ms", json_real(b->t_resolve_ms));
    json_object_set_new(line, "restarts", json_integer(b->restarts));
    char *s = json_dumps(line, JSON_COMPACT | JSON_REAL_PRECISION(6));
    json_decref(line);
    if (s) {
        fprintf(ev->res, "%s\n", s);
        fflush(ev->res);
        free(s);
    }
    fprintf(stderr, "    %-24s ttft %8.1f ms  recomputed %5d/%d  f1 %.2f  agree %5.2f  \"%s\"\n", v->label, r->ttft,
            b->tokens_recomputed, b->n_tokens, f1, agree, ans);
}

/* Adds one answer to its variant's sums. */
static void tally(variant_t *v, const answer_t *r, double f1, double agree, int ftm) {
    v->n++;
    v->f1 += f1;
    if (agree >= 0) v->n_agree++, v->agree += agree;
    if (r->kl >= 0) v->n_kl++, v->kl += r->kl;
    if (ftm >= 0) v->n_ftm++, v->ftm += ftm;
    v->ttft += r->ttft;
    v->ttft_cpu += r->ttft_cpu;
    v->rfrac += (double)r->bst.tokens_recomputed / (double)r->bst.n_tokens;
    v->rchosen += r->bst.ratio_chosen;
    v->load += r->bst.t_load_ms;
    v->wait += r->bst.t_load_wait_ms;
    v->sel += r->bst.t_select_ms;
    v->comp += r->bst.t_compute_ms;
    v->resolve += r->bst.t_resolve_ms;
}

/* Every mode on one example (pieces built, chunk files present). 0, 1 (skipped), or -1 with a message. */
static int eval_modes(eval_t *ev, const cb_qa_example_t *ex, const pieces_t *p) {
    char *full_answer = NULL;
    int32_t full_first = -1;
    bool have_full_lp = false;
    if (ev->ref && !ref_full(ev, ex, &full_answer, &full_first)) {
        fprintf(stderr, "cb-eval: %s: not in the reference run; skipped\n", ex->id);
        return 1;
    }
    int rc = 0;
    for (int vi = ev->ref ? 1 : 0; vi < ev->nv && rc == 0; vi++) {
        variant_t *v = &ev->vs[vi];
        answer_t r = {0};
        if (answer(ev, ex->id, v, p, &have_full_lp, &r) != 0) {
            free(r.clean);
            rc = -1;
            break;
        }
        char *ans = cb_qa_parse_generation(r.clean);
        double f1 = cb_qa_score(r.clean, (const char *const *)ex->answers, ex->n_answers), agree = -1;
        int ftm = -1;
        if (v->o.mode == CB_BLEND_FULL && !full_answer) {
            full_answer = cb_strdup(ans);
            full_first = r.ng > 0 ? ev->gen[0] : -1;
        }
        if (full_answer) {
            agree = cb_qa_f1(ans, full_answer);
            ftm = full_first == -2 ? -1 : (r.ng > 0 ? ev->gen[0] : -1) == full_first;
        }
        tally(v, &r, f1, agree, ftm);
        write_line(ev, ex, v, &r, ans, f1, agree, ftm);
        free(ans);
        free(r.clean);
    }
    free(full_answer);
    return rc;
}

/* Examples [first, last): pieces, precompute, every mode, the summaries rewritten after each. 0, 2 (the
 * prompt dumped), or -1. */
static int eval_examples(eval_t *ev, const cb_qa_set_t *set, int first, int last) {
    const int max_ctx = cb_engine_max_ctx(ev->eng);
    for (int ei = first; ei < last; ei++) {
        const cb_qa_example_t *ex = cb_qa_set_get(set, ei);
        pieces_t p = {0};
        bool ok = example_pieces(ev, ex, &p);
        if (!ok || p.total + ev->a->max_new > max_ctx) {
            fprintf(stderr, "cb-eval: %s: skipped (%s, %lld tokens)\n", ex->id, ok ? "too long" : "tokenization failed",
                    p.total);
            pieces_free(&p);
            continue;
        }
        if (ev->a->dump_prompt) {
            dump_prompt(ev, &p);
            pieces_free(&p);
            return 2;
        }
        double tp = cb_now_ms();
        int n_computed = precompute(ev, ex, &p);
        if (n_computed >= 0)
            fprintf(stderr, "[%d/%d] %s: %lld tokens, %d chunks (%d precomputed in %.1f s)\n", ei - first + 1,
                    last - first, ex->id, p.total, p.nc, n_computed, (cb_now_ms() - tp) / 1e3);
        int rc = n_computed < 0 ? -1 : eval_modes(ev, ex, &p);
        pieces_free(&p);
        if (rc < 0) return -1;
        if (rc == 0 && write_summaries(ev->a->out, ev->vs, ev->nv, ev->config) != 0)
            fprintf(stderr, "cb-eval: writing the summary failed\n");
    }
    return 0;
}

int main(int argc, char **argv) {
    cb_log_set_component("cb-eval");
    static eval_args_t a;
    int rc = parse_args(argc, argv, &a);
    if (rc != 0) return rc;
    if (a.summarize_from)
        return summarize(a.out, &a.base, a.modes_given ? a.modes_arg : NULL, argv + a.summarize_from,
                         argc - a.summarize_from);
    static eval_t ev;
    ev.a = &a;
    if ((rc = build_variants(&ev)) != 0) return rc;
    rc = 1;
    cb_qa_set_t *set = NULL;
    if (a.ref_path && !(ev.ref = load_ref(a.ref_path))) goto done;
    if (!(set = cb_qa_set_load(a.data, ev.err, sizeof ev.err))) {
        fprintf(stderr, "cb-eval: %s\n", ev.err);
        goto done;
    }
    if (eval_open(&ev) != 0 || open_results(&ev) != 0) goto done;
    int n_set = cb_qa_set_size(set);
    int first = (int)(a.skip < n_set ? a.skip : n_set);
    int last = a.limit < 0 ? n_set : (int)(first + a.limit < n_set ? first + a.limit : n_set);
    int er = eval_examples(&ev, set, first, last);
    if (er == 2) {
        rc = 0;
        goto done;
    }
    if (er != 0) goto done;
    if (write_summaries(a.out, ev.vs, ev.nv, ev.config) != 0) {
        fprintf(stderr, "cb-eval: writing the summary failed\n");
        goto done;
    }
    print_table(stdout, ev.vs, ev.nv);
    rc = 0;
done:
    if (rc && ev.err[0] == 0) fprintf(stderr, "cb-eval: failed (out of memory?)\n");
    eval_close(&ev);
    cb_qa_set_destroy(&set);
    return rc;
}
