/* cb-rag: one RAG query answered in process, with the same prompt (ragprompt.h), configuration (the
 * `blend`, `engine` and `common` sections, read by svc/svcconfig.h as cb-blend reads them) and code path
 * (the RAG session of svc/session.h: kvstore.h + blend.h; sampler.h) as cb-blend, but without any service:
 * the reference the stack is
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
 * reuse them (warm). The prompt's prefix is computed once at start, as cb-blend does. Output: the answer of the last run on stdout; with --json one line {"text",
 * "ttft_ms": [per run], "prefill_ms": [...], "n_prompt", "n_generated", "tokens_recomputed", "mode",
 * "ratio"}. TTFT = from the start of a run (tokenizing the contexts) to the first sampled token.
 * Exit: 0 ok, 1 runtime error, 2 usage.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/alloc.h"
#include "base/clock.h"
#include "base/log.h"
#include "blend/blend.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "model/model.h"
#include "model/tokenizer.h"
#include "rag/ragprompt.h"
#include "svc/session.h"
#include "svc/svcconfig.h"
#include "wire/config.h"
#include "wire/db.h"

#define MAX_CTX 32
#define MAX_RUNS 1000

/* The command line (the configuration flags already taken out). */
typedef struct {
    const char *contexts[MAX_CTX];
    int n_ctx;
    const char *question, *files;
    int repeat;
    bool json;
} rag_args_t;

/* A session, the blend options and sampling of every run, and what the last run gave. */
typedef struct {
    cb_session_t *s;
    cb_svc_blend_config_t bc;
    cb_blend_opts_t o;          /* bc's, auto_target 0 unless blend.ratio = auto */
    cb_seq_t *seq;
    cb_sampler_t *sampler;
    float *logits;              /* [n_vocab] */
    int32_t ids[4096];          /* [n_gen] the last run's answer tokens */
    int N, n_gen;               /* prompt tokens, answer tokens */
    cb_blend_stats_t st;
    char *text;                 /* the last run's answer (owned) */
    json_t *ttfts, *prefills;   /* per run */
} rag_t;

static int usage(const char *why) {
    if (why) fprintf(stderr, "cb-rag: %s\n", why);
    fprintf(stderr, "usage: cb-rag [--config PATH] [--blend.KEY=VALUE | --KEY VALUE]... [--context TEXT]... [--files DIR]\n"
                    "              [--repeat N] [--json] QUESTION\n"
                    "  e.g. cb-rag --mode blend --ratio 0.15 --max-tokens 32 --context \"...\" \"question?\"\n");
    return 2;
}

/* 0, or the exit code of a usage error (printed). */
static int parse_args(int argc, char **argv, rag_args_t *a) {
    memset(a, 0, sizeof *a);
    a->repeat = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--context") && i + 1 < argc) {
            if (a->n_ctx >= MAX_CTX) return usage("at most 32 contexts");
            a->contexts[a->n_ctx++] = argv[++i];
        } else if (!strcmp(argv[i], "--files") && i + 1 < argc) {
            a->files = argv[++i];
        } else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) {
            a->repeat = atoi(argv[++i]);
            if (a->repeat < 1 || a->repeat > MAX_RUNS) return usage("--repeat: 1..1000");
        } else if (!strcmp(argv[i], "--json")) {
            a->json = true;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            return usage(NULL);
        } else if (argv[i][0] == '-' && argv[i][1]) {
            char why[256];
            snprintf(why, sizeof why, "unknown option %s", argv[i]);
            return usage(why);
        } else if (!a->question) {
            a->question = argv[i];
        } else {
            return usage("one QUESTION");
        }
    }
    if (!a->question || !*a->question) return usage("no QUESTION");
    return 0;
}

/* The session as cb-blend builds its own (the blend section, with --files as the KV-file tier), the
 * sequence, the sampler and the logits. 0, or -1 with err; 2 for a bad configuration. */
static int rag_open(rag_t *r, const cb_config_t *cfg, const rag_args_t *a, char *err, size_t errlen) {
    cb_session_opts_t so;
    if (cb_svc_session_config(cfg, "blend", &so, err, errlen) != 0 ||
        cb_svc_blend_config(cfg, MAX_CTX, &r->bc, &so, err, errlen) != 0)
        return 2;
    cb_svc_blend_request_opts(&r->bc, &r->o);
    if (a->files && cb_db_mkdirs(a->files, err, errlen) != 0) return -1;
    so.kv_dir = a->files;
    err[0] = 0;
    if (!(r->s = cb_session_new(&so, err, errlen))) return -1;
    const int n_vocab = cb_session_hparams(r->s)->n_vocab;
    cb_sampler_params_t sp = {.temperature = (float)r->bc.temperature, .top_k = 0, .top_p = (float)r->bc.top_p,
                              .seed = r->bc.seed, .frequency_penalty = (float)r->bc.frequency_penalty,
                              .presence_penalty = (float)r->bc.presence_penalty};
    if (!(r->seq = cb_seq_new(cb_session_engine(r->s))) || !(r->logits = cb_malloc((size_t)n_vocab * sizeof(float))) ||
        !(r->sampler = cb_sampler_new(&sp, n_vocab)) || !(r->ttfts = json_array()) || !(r->prefills = json_array())) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    return 0;
}

static void rag_close(rag_t *r) {
    json_decref(r->ttfts);
    json_decref(r->prefills);
    free(r->text);
    free(r->logits);
    cb_sampler_destroy(&r->sampler);
    cb_seq_destroy(&r->seq);
    cb_session_destroy(&r->s);
}

/* The prompt's pieces and the fused prefill into r->seq, r->logits; the prefill's time into *prefill_ms.
 * 0, or -1 with err. */
static int rag_prefill(rag_t *r, const rag_args_t *a, double *prefill_ms, char *err, size_t errlen) {
    const cb_ragprompt_t *rp = cb_session_prompt(r->s);
    int n_prefix;
    const int32_t *prefix = cb_session_prefix(r->s, &n_prefix);
    const int max_ctx = cb_engine_max_ctx(cb_session_engine(r->s));
    int32_t *ct[MAX_CTX] = {0};
    cb_blend_chunk_t chunks[MAX_CTX];
    int n_suffix = 0;
    int32_t *suffix = NULL;
    bool ok = true;
    r->N = n_prefix;
    for (int i = 0; i < a->n_ctx && ok; i++) {
        ct[i] = cb_ragprompt_chunk(rp, a->contexts[i], strlen(a->contexts[i]), &chunks[i].n);
        chunks[i].tokens = ct[i];
        ok = ct[i] != NULL;
        if (ok) r->N += chunks[i].n;
    }
    if (ok && !(suffix = cb_ragprompt_suffix(rp, a->question, &n_suffix))) ok = false;
    r->N += n_suffix;
    if (ok && r->N >= max_ctx) {
        snprintf(err, errlen, "the prompt has %d tokens; blend.ctx_size allows %d", r->N, max_ctx - 1);
        ok = false;
    } else if (!ok) {
        snprintf(err, errlen, "cannot tokenize the prompt");
    }
    double tp = cb_now_ms();
    if (ok && cb_blend_prefill(cb_session_blend(r->s), r->seq, prefix, n_prefix, chunks, a->n_ctx, suffix, n_suffix,
                               &r->o, r->logits, &r->st, err, errlen) != CB_ENGINE_OK)
        ok = false;
    *prefill_ms = cb_now_ms() - tp;
    for (int i = 0; i < a->n_ctx; i++) free(ct[i]);
    free(suffix);
    return ok ? 0 : -1;
}

/* Decodes from the first sampled token t: the same loop as cb-blend (stop at end-of-generation, max_tokens
 * or the context; no stop sequences here); the answer into r->ids, r->n_gen and r->text. 0, or -1 with err. */
static int rag_decode(rag_t *r, int32_t t, char *err, size_t errlen) {
    cb_engine_t *eng = cb_session_engine(r->s);
    const int max_ctx = cb_engine_max_ctx(eng);
    const int max_tokens = r->bc.max_tokens < (int)(sizeof r->ids / sizeof r->ids[0]) ? r->bc.max_tokens : 4096;
    int max_new = max_tokens < max_ctx - r->N ? max_tokens : max_ctx - r->N;
    r->n_gen = 0;
    for (;;) {
        if (cb_model_is_eog(cb_session_model(r->s), t) || cb_tokenizer_is_eog(cb_session_tokenizer(r->s), t)) break;
        r->ids[r->n_gen++] = t;
        cb_sampler_accept(r->sampler, t); /* as cb-blend: the penalties count every token of the answer */
        if (r->n_gen >= max_new) break;
        int ds = cb_engine_decode(eng, r->seq, t, r->N + r->n_gen - 1, r->logits);
        if (ds != CB_ENGINE_OK) {
            snprintf(err, errlen, "decode failed: %s", cb_engine_status_str(ds));
            return -1;
        }
        t = cb_sampler_sample(r->sampler, r->logits);
    }
    free(r->text);
    size_t tl;
    if (!(r->text = cb_tokenizer_decode_alloc(cb_session_tokenizer(r->s), r->ids, (size_t)r->n_gen, false, &tl))) {
        snprintf(err, errlen, "cannot decode the answer");
        return -1;
    }
    return 0;
}

/* One run: prefill, first token (its TTFT), decode. 0, or -1 with err. */
static int rag_run(rag_t *r, const rag_args_t *a, char *err, size_t errlen) {
    double t0 = cb_now_ms(), prefill_ms;
    if (rag_prefill(r, a, &prefill_ms, err, errlen) != 0) return -1;
    cb_sampler_reset(r->sampler, r->bc.seed);
    int32_t t = cb_sampler_sample(r->sampler, r->logits);
    json_array_append_new(r->ttfts, json_real(cb_now_ms() - t0));
    json_array_append_new(r->prefills, json_real(prefill_ms));
    return rag_decode(r, t, err, errlen);
}

/* The last answer on stdout: its text, or with --json one line of it and the runs' figures. */
static void rag_print(const rag_t *r, const rag_args_t *a) {
    if (!a->json) {
        printf("%s\n", r->text);
        return;
    }
    const char *mode = cb_blend_mode_str(r->o.mode);
    double ratio = r->bc.ratio_auto ? (double)r->st.ratio_chosen : (double)r->bc.blend.ratio;
    json_t *o = json_pack("{s:s, s:O, s:O, s:i, s:i, s:i, s:s, s:f}", "text", r->text, "ttft_ms", r->ttfts,
                          "prefill_ms", r->prefills, "n_prompt", r->N, "n_generated", r->n_gen, "tokens_recomputed",
                          r->st.tokens_recomputed, "mode", mode, "ratio", ratio);
    if (!o) {
        /* text that is not valid UTF-8 (a character cut at max_tokens): print it escaped by bytes */
        json_t *bytes = json_stringn_nocheck(r->text, strlen(r->text));
        o = json_pack("{s:o, s:O, s:O, s:i, s:i, s:i, s:s, s:f}", "text", bytes, "ttft_ms", r->ttfts, "prefill_ms",
                      r->prefills, "n_prompt", r->N, "n_generated", r->n_gen, "tokens_recomputed",
                      r->st.tokens_recomputed, "mode", mode, "ratio", (double)r->bc.blend.ratio);
    }
    json_dumpf(o, stdout, JSON_COMPACT);
    fputc('\n', stdout);
    json_decref(o);
}

int main(int argc, char **argv) {
    cb_log_set_component("cb-rag");
    char err[1024];
    cb_config_t *cfg = cb_config_new("blend", &argc, argv, err, sizeof err);
    if (!cfg) {
        fprintf(stderr, "cb-rag: %s\n", err);
        return 2;
    }
    rag_args_t a;
    int rc = parse_args(argc, argv, &a);
    if (rc != 0) {
        cb_config_destroy(&cfg);
        return rc;
    }
    static rag_t r;
    rc = rag_open(&r, cfg, &a, err, sizeof err);
    for (int run = 0; rc == 0 && run < a.repeat; run++) rc = rag_run(&r, &a, err, sizeof err) == 0 ? 0 : 1;
    if (rc == 0) rag_print(&r, &a);
    else fprintf(stderr, "cb-rag: %s\n", err[0] ? err : "out of memory");
    rc = rc == 0 ? 0 : rc == 2 ? 2 : 1;
    rag_close(&r);
    cb_config_destroy(&cfg);
    return rc;
}
