/* cb-rag: one RAG query answered in process, with the same prompt (ragprompt.h), configuration (the
 * `blend` section: mode, ratio, check_layer, metric, leading_tokens, max_tokens, temperature, top_p, seed,
 * frequency_penalty, presence_penalty, ctx_size, hot_cache_bytes, kv_pool_bytes, system_prompt; common: model, threads) and code path
 * (kvstore.h + blend.h + sampler.h) as cb-blend, but without any service: the reference the stack is
 * compared with (integration tests: the streamed answer must equal this one; scripts/bench-stack.sh: the
 * stack's added latency).
 *
 *   cb-rag [--config PATH] [--blend.KEY=VALUE | --KEY VALUE]... [--context TEXT]... [--files DIR]
 *          [--repeat N] [--json] QUESTION
 *
 * Each --context is one chunk text (as cbctl query --context). Chunk KV lives in an in-memory tier
 * (blend.hot_cache_bytes); --files DIR adds a KV-file tier in DIR (created if missing); both belong to one
 * chunk store under the blend, and every run blends into one engine sequence (KV pool: blend.kv_pool_bytes,
 * 0 = the engine's default). --repeat N asks N times: the first run computes the chunks, the later ones
 * reuse them (warm). Output: the answer of the last run on stdout; with --json one line {"text",
 * "ttft_ms": [per run], "prefill_ms": [...], "n_prompt", "n_generated", "tokens_recomputed", "mode",
 * "ratio"}. TTFT = from the start of a run (tokenizing the contexts) to the first sampled token.
 * Exit: 0 ok, 1 runtime error, 2 usage.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/alloc.h"
#include "blend/blend.h"
#include "wire/config.h"
#include "wire/db.h"
#include "wire/query.h"
#include "engine/engine.h"
#include "kv/kvmem.h"
#include "kv/kvstore.h"
#include "base/log.h"
#include "model/model.h"
#include "rag/ragprompt.h"
#include "engine/sampler.h"
#include "model/tokenizer.h"

#define MAX_CTX 32
#define MAX_RUNS 1000

static int usage(const char *why) {
    if (why) fprintf(stderr, "cb-rag: %s\n", why);
    fprintf(stderr, "usage: cb-rag [--config PATH] [--blend.KEY=VALUE | --KEY VALUE]... [--context TEXT]... [--files DIR]\n"
                    "              [--repeat N] [--json] QUESTION\n"
                    "  e.g. cb-rag --mode blend --ratio 0.15 --max-tokens 32 --context \"...\" \"question?\"\n");
    return 2;
}

int main(int argc, char **argv) {
    cb_log_set_component("cb-rag");
    char err[1024];
    cb_config_t *cfg = cb_config_new("blend", &argc, argv, err, sizeof err);
    if (!cfg) {
        fprintf(stderr, "cb-rag: %s\n", err);
        return 2;
    }
    const char *contexts[MAX_CTX], *question = NULL, *files = NULL;
    int n_ctx = 0, repeat = 1;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--context") && i + 1 < argc) {
            if (n_ctx >= MAX_CTX) return usage("at most 32 contexts");
            contexts[n_ctx++] = argv[++i];
        } else if (!strcmp(argv[i], "--files") && i + 1 < argc) {
            files = argv[++i];
        } else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) {
            repeat = atoi(argv[++i]);
            if (repeat < 1 || repeat > MAX_RUNS) return usage("--repeat: 1..1000");
        } else if (!strcmp(argv[i], "--json")) {
            json = true;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            return usage(NULL);
        } else if (argv[i][0] == '-' && argv[i][1]) {
            char why[256];
            snprintf(why, sizeof why, "unknown option %s", argv[i]);
            return usage(why);
        } else if (!question) {
            question = argv[i];
        } else {
            return usage("one QUESTION");
        }
    }
    if (!question || !*question) return usage("no QUESTION");

    const char *mode_s, *metric, *model_path, *sys, *chat_tmpl = "";
    double ratio = CB_BLEND_DEFAULT_RATIO, temp, top_p, freq_pen, pres_pen, auto_t, auto_f, auto_c, auto_k, sparse;
    const char *ratio_raw = cb_config_raw(cfg, "blend", "ratio", NULL, NULL); /* a number, or "auto" */
    bool ratio_auto = ratio_raw && !strcmp(ratio_raw, "auto");
    int64_t max_tokens, seed, check, lead, ctx_size, hot, threads, pool_bytes;
    if (!cb_config_str(cfg, "blend", "mode", "blend", &mode_s, err, sizeof err) ||
        (!ratio_auto && !cb_config_double(cfg, "blend", "ratio", 0, 1, 0.15, &ratio, err, sizeof err)) ||
        !cb_config_double(cfg, "blend", "auto_target", 1e-6, 1, CB_BLEND_DEFAULT_AUTO_TARGET, &auto_t, err, sizeof err) ||
        !cb_config_double(cfg, "blend", "auto_floor", 0, 1, CB_BLEND_DEFAULT_AUTO_FLOOR, &auto_f, err, sizeof err) ||
        !cb_config_double(cfg, "blend", "auto_ceil", 0, 1, CB_BLEND_DEFAULT_AUTO_CEIL, &auto_c, err, sizeof err) ||
        !cb_config_double(cfg, "blend", "auto_cost_keys", 0, CB_BLEND_AUTO_COST_KEYS_MAX,
                          CB_BLEND_DEFAULT_AUTO_COST_KEYS, &auto_k, err, sizeof err) ||
        !cb_config_double(cfg, "blend", "sparse_keys", 0, 1, CB_BLEND_DEFAULT_SPARSE_KEYS, &sparse, err, sizeof err) ||
        !cb_config_int(cfg, "blend", "max_tokens", CB_QUERY_MAX_TOKENS_MIN, CB_QUERY_MAX_TOKENS_MAX, 64, &max_tokens, err,
                       sizeof err) ||
        !cb_config_double(cfg, "blend", "temperature", 0, 5, 0, &temp, err, sizeof err) ||
        !cb_config_double(cfg, "blend", "top_p", 1e-9, 1, 1, &top_p, err, sizeof err) ||
        !cb_config_int(cfg, "blend", "seed", 0, INT64_MAX, 0, &seed, err, sizeof err) ||
        !cb_config_double(cfg, "blend", "frequency_penalty", -CB_SAMPLER_PENALTY_MAX, CB_SAMPLER_PENALTY_MAX, 0,
                          &freq_pen, err, sizeof err) ||
        !cb_config_double(cfg, "blend", "presence_penalty", -CB_SAMPLER_PENALTY_MAX, CB_SAMPLER_PENALTY_MAX, 0,
                          &pres_pen, err, sizeof err) ||
        !cb_config_int(cfg, "blend", "check_layer", 0, 1024, CB_BLEND_DEFAULT_CHECK_LAYER, &check, err, sizeof err) ||
        !cb_config_str(cfg, "blend", "metric", CB_BLEND_DEFAULT_METRIC_NAME, &metric, err, sizeof err) ||
        !cb_config_int(cfg, "blend", "leading_tokens", 0, 1 << 20, CB_BLEND_DEFAULT_LEAD, &lead, err, sizeof err) ||
        !cb_config_int(cfg, "blend", "ctx_size", 64, 1 << 20, 2048, &ctx_size, err, sizeof err) ||
        !cb_config_int(cfg, "blend", "hot_cache_bytes", 0, INT64_MAX, (int64_t)256 << 20, &hot, err, sizeof err) ||
        !cb_config_int(cfg, "blend", "kv_pool_bytes", 0, INT64_MAX, 0, &pool_bytes, err, sizeof err) ||
        !cb_config_int(cfg, "blend", "threads", 1, 1024, 2, &threads, err, sizeof err) ||
        !cb_config_str(cfg, "blend", "system_prompt", "", &sys, err, sizeof err) ||
        !cb_config_str(cfg, "blend", "model", "models/SmolLM2-135M-Instruct.Q4_1.gguf", &model_path, err, sizeof err) ||
        !cb_config_str(cfg, "engine", "chat_template", "", &chat_tmpl, err, sizeof err)) {
        fprintf(stderr, "cb-rag: %s\n", err);
        cb_config_destroy(&cfg);
        return 2;
    }
    int mode = cb_blend_mode_parse(mode_s);
    if (mode < 0 || !cb_blend_metric_parse(metric)) {
        cb_config_destroy(&cfg);
        return usage("blend.mode must be full|prefix|reuse|blend and blend.metric a|k|v");
    }
    int rc = 1;
    cb_model_t *model = NULL;
    cb_tokenizer_t *tok = NULL;
    cb_ragprompt_t *rp = NULL;
    cb_engine_t *eng = NULL;
    cb_kvmem_t *mem = NULL;
    cb_kvstore_t *store = NULL;
    cb_blend_t *blend = NULL;
    cb_seq_t *seq = NULL;
    cb_sampler_t *sampler = NULL;
    float *logits = NULL;
    char *text = NULL;
    json_t *ttfts = json_array(), *prefills = json_array();
    if (!(model = cb_model_load(model_path, err, sizeof err)) ||
        !(tok = cb_tokenizer_new_from_gguf_opts(cb_model_gguf(model), chat_tmpl, err, sizeof err)) ||
        !(rp = cb_ragprompt_new(tok, sys, err, sizeof err))) {
        fprintf(stderr, "cb-rag: %s\n", err);
        goto out;
    }
    const cb_hparams_t *hp = cb_model_hparams(model);
    int max_ctx = (int)(ctx_size < hp->n_ctx_train ? ctx_size : hp->n_ctx_train);
    if (files && cb_db_mkdirs(files, err, sizeof err) != 0) {
        fprintf(stderr, "cb-rag: %s\n", err);
        goto out;
    }
    err[0] = 0;
    cb_engine_opts_t eo = {.max_ctx = max_ctx, .kv_pool_bytes = (size_t)pool_bytes, .block_tokens = 0};
    if (!(eng = cb_engine_new_opts(model, &eo, err, sizeof err)) || !(mem = cb_kvmem_new((size_t)hot)) ||
        !(store = cb_kvstore_new(eng, files, mem, CB_KV_F16, err, sizeof err)) ||
        !(blend = cb_blend_new(store, err, sizeof err)) || !(seq = cb_seq_new(eng))) {
        fprintf(stderr, "cb-rag: %s\n", err[0] ? err : "out of memory");
        goto out;
    }
    cb_engine_set_threads(eng, (int)threads);
    logits = cb_malloc((size_t)hp->n_vocab * sizeof(float));
    cb_sampler_params_t sp = {.temperature = (float)temp, .top_k = 0, .top_p = (float)top_p, .seed = (uint64_t)seed,
                              .frequency_penalty = (float)freq_pen, .presence_penalty = (float)pres_pen};
    if (!logits || !(sampler = cb_sampler_new(&sp, hp->n_vocab))) {
        fprintf(stderr, "cb-rag: out of memory\n");
        goto out;
    }
    int n_prefix;
    const int32_t *prefix = cb_ragprompt_prefix(rp, &n_prefix);
    cb_blend_opts_t o;
    cb_blend_opts_default(&o);
    o.mode = (cb_blend_mode_t)mode;
    o.ratio = (float)ratio;
    o.auto_target = ratio_auto ? (float)auto_t : 0.0f; /* blend.ratio = auto, as cb-blend */
    o.auto_floor = (float)auto_f;
    o.auto_ceil = (float)auto_c;
    o.auto_cost_keys = (float)auto_k;
    o.sparse_keys = (float)sparse;
    o.check_layer = (int)check;
    o.metric = metric[0];
    o.lead_tokens = (int)lead;
    int N = 0, n_gen = 0;
    cb_blend_stats_t st = {0};
    for (int run = 0; run < repeat; run++) {
        double t0 = cb_now_ms();
        int32_t *ct[MAX_CTX] = {0};
        cb_blend_chunk_t chunks[MAX_CTX];
        int n_suffix = 0;
        int32_t *suffix = NULL;
        bool ok = true;
        N = n_prefix;
        for (int i = 0; i < n_ctx && ok; i++) {
            ct[i] = cb_ragprompt_chunk(rp, contexts[i], strlen(contexts[i]), &chunks[i].n);
            chunks[i].tokens = ct[i];
            ok = ct[i] != NULL;
            if (ok) N += chunks[i].n;
        }
        if (ok && !(suffix = cb_ragprompt_suffix(rp, question, &n_suffix))) ok = false;
        N += n_suffix;
        if (ok && N >= max_ctx) {
            snprintf(err, sizeof err, "the prompt has %d tokens; blend.ctx_size allows %d", N, max_ctx - 1);
            ok = false;
        } else if (!ok) {
            snprintf(err, sizeof err, "cannot tokenize the prompt");
        }
        double tp = cb_now_ms();
        if (ok && cb_blend_prefill(blend, seq, prefix, n_prefix, chunks, n_ctx, suffix, n_suffix, &o, logits, &st, err,
                                   sizeof err) != CB_ENGINE_OK)
            ok = false;
        double prefill_ms = cb_now_ms() - tp;
        for (int i = 0; i < n_ctx; i++) free(ct[i]);
        free(suffix);
        if (!ok) {
            fprintf(stderr, "cb-rag: %s\n", err);
            goto out;
        }
        cb_sampler_reset(sampler, (uint64_t)seed);
        int32_t t = cb_sampler_sample(sampler, logits);
        json_array_append_new(ttfts, json_real(cb_now_ms() - t0));
        json_array_append_new(prefills, json_real(prefill_ms));
        /* decode: the same loop as cb-blend (stop at end-of-generation or max_tokens or the context; no stop
         * sequences here) */
        int max_new = (int)(max_tokens < max_ctx - N ? max_tokens : max_ctx - N);
        int32_t ids[CB_QUERY_MAX_TOKENS_MAX];
        n_gen = 0;
        for (;;) {
            if (cb_model_is_eog(model, t) || cb_tokenizer_is_eog(tok, t)) break;
            ids[n_gen++] = t;
            cb_sampler_accept(sampler, t); /* as cb-blend: the penalties count every token of the answer */
            if (n_gen >= max_new) break;
            int ds = cb_engine_decode(eng, seq, t, N + n_gen - 1, logits);
            if (ds != CB_ENGINE_OK) {
                fprintf(stderr, "cb-rag: decode failed: %s\n", cb_engine_status_str(ds));
                goto out;
            }
            t = cb_sampler_sample(sampler, logits);
        }
        free(text);
        size_t tl;
        text = cb_tokenizer_decode_alloc(tok, ids, (size_t)n_gen, false, &tl);
        if (!text) {
            fprintf(stderr, "cb-rag: cannot decode the answer\n");
            goto out;
        }
    }
    if (json) {
        json_t *o2 = json_pack("{s:s, s:O, s:O, s:i, s:i, s:i, s:s, s:f}", "text", text, "ttft_ms", ttfts, "prefill_ms",
                               prefills, "n_prompt", N, "n_generated", n_gen, "tokens_recomputed", st.tokens_recomputed,
                               "mode", cb_blend_mode_str((cb_blend_mode_t)mode), "ratio",
                               ratio_auto ? (double)st.ratio_chosen : ratio);
        if (!o2) {
            /* text that is not valid UTF-8 (a character cut at max_tokens): print it escaped by bytes */
            json_t *bytes = json_stringn_nocheck(text, strlen(text));
            o2 = json_pack("{s:o, s:O, s:O, s:i, s:i, s:i, s:s, s:f}", "text", bytes, "ttft_ms", ttfts, "prefill_ms",
                           prefills, "n_prompt", N, "n_generated", n_gen, "tokens_recomputed", st.tokens_recomputed,
                           "mode", cb_blend_mode_str((cb_blend_mode_t)mode), "ratio", ratio);
        }
        json_dumpf(o2, stdout, JSON_COMPACT);
        fputc('\n', stdout);
        json_decref(o2);
    } else {
        printf("%s\n", text);
    }
    rc = 0;
out:
    json_decref(ttfts);
    json_decref(prefills);
    free(text);
    free(logits);
    cb_sampler_destroy(&sampler);
    cb_seq_destroy(&seq);
    cb_blend_destroy(&blend);
    cb_kvstore_destroy(&store);
    cb_kvmem_destroy(&mem);
    cb_engine_destroy(&eng);
    cb_ragprompt_destroy(&rp);
    cb_tokenizer_destroy(&tok);
    cb_model_destroy(&model);
    cb_config_destroy(&cfg);
    return rc;
}
