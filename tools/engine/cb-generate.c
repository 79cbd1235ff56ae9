/* cb-generate: one prompt in, a completion out, on the CPU engine (model + engine + sampler).
 *
 *   cb-generate [--model PATH] [--chat-template NAME] (--prompt TEXT | --ids "ID ID ...") [--chat] [--system TEXT] [-n N]
 *               [--temp T] [--top-p P] [--top-k K] [--seed S] [--threads N] [--ctx N] [--json]
 *               [--dump-logits K]
 *
 * --prompt text is tokenized with special-token parsing on (it is the operator's own text, so
 * "<|im_start|>" means the control token), after a BOS where the vocabulary adds one (Gemma, Llama 3,
 * SentencePiece models, as llama.cpp does); --chat wraps it as one user turn of the model's chat template
 * (with its default system prompt, or --system), where the text is tokenized with special parsing off.
 * Sampling defaults to greedy (--temp 0). Generation stops at the model's end-of-generation ids
 * (<|im_end|> and <|endoftext|> for SmolLM2, from the GGUF metadata) or after -n tokens.
 * Output: the completion streamed to stdout, or with --json one object
 *   {"text", "tokens", "n_prompt", "n_gen", "stop", "prefill_ms", "prefill_tok_s", "decode_ms",
 *    "decode_tok_s", "top_logits"?}
 * --dump-logits K (debugging / golden tests) prints the K largest logits of the last prompt position
 * as "id logit" lines on stdout before the completion (in --json: "top_logits": [[id, logit], ...]).
 * The prompt and its completion are one engine sequence (engine.h) in the default KV pool.
 * Model: --model, else $CB_MODEL, else the default model (svc/svcconfig.h). Chat template: the GGUF's (recognised), or
 * --chat-template NAME (smollm2, chatml, qwen2.5, llama3, mistral, gemma, completion).
 * Exit: 0 ok, 1 runtime error (model, prompt too long), 2 bad arguments (usage on stderr).
 */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "svc/svcconfig.h"
#include "base/alloc.h"
#include "base/clock.h"
#include "model/chat.h"
#include "engine/backend_select.h"
#include "engine/engine.h"
#include "base/log.h"
#include "base/utf8.h"
#include "model/model.h"
#include "engine/sampler.h"
#include "model/tokenizer.h"

static int usage(const char *why) {
    if (why) fprintf(stderr, "cb-generate: %s\n", why);
    fprintf(stderr,
            "usage: cb-generate [--model PATH] [--chat-template NAME] (--prompt TEXT | --ids \"ID ID ...\") [options]\n"
            "  --chat            wrap the prompt as a ChatML user turn (SmolLM2 template)\n"
            "  --system TEXT     system prompt for --chat (default: the model's default line)\n"
            "  -n N              maximum new tokens (default 128)\n"
            "  --temp T          temperature (default 0 = greedy)\n"
            "  --top-k K         top-k filter (default 0 = off)\n"
            "  --top-p P         top-p filter (default 1 = off)\n"
            "  --seed S          sampling seed (default 0)\n"
            "  --threads N       threads (default $CB_THREADS or all cores)\n"
            "  --backend B       auto|cpu|cuda (default $CB_BACKEND or auto: CUDA when a device is present)\n"
            "  --ctx N           KV cache positions (default prompt + n, capped at the model's)\n"
            "  --json            print one JSON object with text, tokens and timings\n"
            "  --dump-logits K   print the K largest logits of the last prompt position\n"
            "  model default: $CB_MODEL or " CB_SVC_DEFAULT_MODEL "\n");
    return 2;
}

/* "1 2 3" (spaces, tabs, commas, newlines). Returns the count, -1 on a malformed or negative id. */
static long parse_ids(const char *s, int32_t **ids_out) {
    size_t cap = 64, n = 0;
    int32_t *ids = cb_malloc(cap * sizeof *ids);
    if (!ids) return -1;
    for (const char *p = s;;) {
        while (*p == ' ' || *p == '\t' || *p == '\n' || *p == ',') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && !strchr(" \t\n,", *end))) {
            free(ids);
            return -1;
        }
        if (n == cap) {
            int32_t *ni = cap < ((size_t)1 << 26) ? cb_realloc(ids, 2 * cap * sizeof *ids) : NULL;
            if (!ni) {
                free(ids);
                return -1;
            }
            ids = ni;
            cap *= 2;
        }
        ids[n++] = (int32_t)v;
        p = end;
    }
    *ids_out = ids;
    return (long)n;
}

typedef struct { int32_t id; float logit; } top_t;

/* The k largest logits, descending (ties: lower id first). top: [k]. */
static void top_logits(const float *l, int n, int k, top_t *top) {
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (m == k && !(l[i] > top[k - 1].logit)) continue;
        int j = m < k ? m++ : k - 1;
        while (j > 0 && l[i] > top[j - 1].logit) {
            top[j] = top[j - 1];
            j--;
        }
        top[j] = (top_t){i, l[i]};
    }
}

int main(int argc, char **argv) {
    cb_log_set_component("cb-generate");
    const char *model_path = cb_svc_model_path(NULL);
    const char *chat_tmpl = NULL; /* --chat-template NAME; NULL = the GGUF's */
    const char *prompt = NULL, *ids_arg = NULL, *system = NULL;
    bool chat = false, json = false;
    long n_gen = 128, top_k = 0, seed = 0, threads = 0, ctx = 0, dump = 0;
    float temp = 0.0f, top_p = 1.0f;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool has_v = true;
        if (!strcmp(a, "--chat")) chat = true, has_v = false;
        else if (!strcmp(a, "--json")) json = true, has_v = false;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else if (!v) return usage("missing value after an option");
        else if (!strcmp(a, "--model")) model_path = v;
        else if (!strcmp(a, "--chat-template")) chat_tmpl = v;
        else if (!strcmp(a, "--prompt")) prompt = v;
        else if (!strcmp(a, "--ids")) ids_arg = v;
        else if (!strcmp(a, "--system")) system = v;
        else if (!strcmp(a, "-n")) { if (!parse_long(v, 0, 1 << 20, &n_gen)) return usage("bad -n"); }
        else if (!strcmp(a, "--temp")) { if (!parse_float(v, 0.0f, 100.0f, &temp)) return usage("bad --temp"); }
        else if (!strcmp(a, "--top-p")) { if (!parse_float(v, 0.0f, 1.0f, &top_p)) return usage("bad --top-p"); }
        else if (!strcmp(a, "--top-k")) { if (!parse_long(v, 0, INT_MAX, &top_k)) return usage("bad --top-k"); }
        else if (!strcmp(a, "--seed")) { if (!parse_long(v, 0, LONG_MAX, &seed)) return usage("bad --seed"); }
        else if (!strcmp(a, "--threads")) { if (!parse_long(v, 1, 256, &threads)) return usage("bad --threads"); }
        else if (!strcmp(a, "--backend")) {
            cb_backend_kind_t bk;
            if (!cb_backend_kind_parse(v, &bk)) return usage("bad --backend (auto|cpu|cuda)");
            cb_backend_set_default_kind(bk);
        }
        else if (!strcmp(a, "--ctx")) { if (!parse_long(v, 1, 1 << 20, &ctx)) return usage("bad --ctx"); }
        else if (!strcmp(a, "--dump-logits")) { if (!parse_long(v, 1, 1000, &dump)) return usage("bad --dump-logits"); }
        else return usage("unknown option");
        if (has_v) i++;
    }
    if ((prompt == NULL) == (ids_arg == NULL)) return usage("give exactly one of --prompt and --ids");
    if (chat && !prompt) return usage("--chat needs --prompt");
    if (system && !chat) return usage("--system needs --chat");

    int rc = 1;
    char err[512] = "";
    cb_model_t *model = NULL;
    cb_tokenizer_t *tok = NULL;
    cb_engine_t *eng = NULL;
    cb_seq_t *seq = NULL;
    cb_sampler_t *smp = NULL;
    int32_t *ids = NULL, *gen = NULL;
    float *logits = NULL;
    top_t *top = NULL;
    long n_prompt = 0;

    model = cb_model_load(model_path, err, sizeof err);
    if (!model) {
        fprintf(stderr, "cb-generate: %s\n", err);
        goto done;
    }
    const cb_hparams_t *hp = cb_model_hparams(model);
    tok = cb_tokenizer_new_from_gguf_opts(cb_model_gguf(model), chat_tmpl, err, sizeof err);
    if (!tok && prompt) {
        fprintf(stderr, "cb-generate: tokenizer: %s\n", err);
        goto done;
    }
    if (ids_arg) {
        n_prompt = parse_ids(ids_arg, &ids);
        if (n_prompt < 0) {
            rc = usage("bad --ids list");
            goto done;
        }
        for (long i = 0; i < n_prompt; i++)
            if (ids[i] >= hp->n_vocab) {
                fprintf(stderr, "cb-generate: token id %d out of range (vocabulary %d)\n", ids[i], hp->n_vocab);
                rc = 2;
                goto done;
            }
    } else {
        int n;
        if (chat) {
            n = cb_chat_encode_user_turn(tok, system, prompt, NULL, 0);
            if (n < 0 && n > -INT_MAX) {
                ids = cb_malloc(sizeof(int32_t) * (size_t)-n);
                if (ids) n = cb_chat_encode_user_turn(tok, system, prompt, ids, -n);
            }
        } else {
            ids = cb_tokenizer_encode_alloc(tok, prompt, strlen(prompt), true, &n);
            if (ids && n >= 0 && cb_tokenizer_add_bos(tok) && cb_tokenizer_bos(tok) >= 0) { /* as llama.cpp does */
                int32_t *b = cb_realloc(ids, sizeof(int32_t) * ((size_t)n + 1));
                if (b) {
                    memmove(b + 1, b, sizeof(int32_t) * (size_t)n);
                    b[0] = cb_tokenizer_bos(tok);
                    n++;
                }
                ids = b ? b : ids;
                if (!b) n = -1;
            }
        }
        if (!ids || n < 0) {
            fprintf(stderr, "cb-generate: cannot tokenize the prompt\n");
            goto done;
        }
        n_prompt = n;
    }
    if (n_prompt < 1) {
        rc = usage("empty prompt");
        goto done;
    }
    long max_ctx = ctx ? ctx : n_prompt + n_gen;
    if (!ctx && max_ctx > hp->n_ctx_train) max_ctx = hp->n_ctx_train;
    if (n_prompt > max_ctx) {
        fprintf(stderr, "cb-generate: prompt of %ld tokens does not fit a context of %ld\n", n_prompt, max_ctx);
        goto done;
    }
    eng = cb_engine_new(model, (int)max_ctx, err, sizeof err);
    if (!eng) {
        fprintf(stderr, "cb-generate: %s\n", err);
        goto done;
    }
    if (threads) cb_engine_set_threads(eng, (int)threads);
    if (!(seq = cb_seq_new(eng))) {
        fprintf(stderr, "cb-generate: out of memory\n");
        goto done;
    }
    cb_sampler_params_t sp = {.temperature = temp, .top_k = (int)top_k, .top_p = top_p, .seed = (uint64_t)seed};
    smp = cb_sampler_new(&sp, hp->n_vocab);
    logits = cb_malloc(sizeof(float) * (size_t)hp->n_vocab);
    gen = cb_malloc(sizeof(int32_t) * (size_t)(n_gen + 1));
    top = dump ? cb_malloc(sizeof(top_t) * (size_t)dump) : NULL;
    if (!smp || !logits || !gen || (dump && !top)) {
        fprintf(stderr, "cb-generate: out of memory\n");
        goto done;
    }

    double t0 = cb_now_ms();
    int st = cb_engine_prefill(eng, seq, ids, (int)n_prompt, 0, logits);
    if (st != CB_ENGINE_OK) {
        fprintf(stderr, "cb-generate: prefill failed: %s\n", cb_engine_status_str(st));
        goto done;
    }
    double prefill_s = (cb_now_ms() - t0) / 1e3;
    if (dump) {
        top_logits(logits, hp->n_vocab, (int)dump, top);
        if (!json)
            for (long i = 0; i < dump; i++) printf("%d %.6f\n", top[i].id, (double)top[i].logit);
    }
    const char *stop = "length";
    long n_out = 0, pos = n_prompt, n_decode = 0;
    double decode_s = 0.0;
    while (n_out < n_gen) {
        int32_t t = cb_sampler_sample(smp, logits);
        if (cb_model_is_eog(model, t) || (tok && cb_tokenizer_is_eog(tok, t))) {
            stop = "eog";
            break;
        }
        gen[n_out++] = t;
        if (!json && tok) {
            size_t len;
            const char *b = cb_tokenizer_token_bytes(tok, t, false, &len);
            if (b) fwrite(b, 1, len, stdout);
            fflush(stdout);
        } else if (!json) {
            printf("%d ", t);
            fflush(stdout);
        }
        if (n_out == n_gen) break;
        if (pos >= max_ctx) {
            stop = "context";
            break;
        }
        double t1 = cb_now_ms();
        if ((st = cb_engine_decode(eng, seq, t, (int)pos, logits)) != CB_ENGINE_OK) {
            fprintf(stderr, "cb-generate: decode failed at position %ld: %s\n", pos, cb_engine_status_str(st));
            goto done;
        }
        decode_s += (cb_now_ms() - t1) / 1e3;
        n_decode++;
        pos++;
    }
    if (json) {
        json_t *o = json_object(), *ta = json_array();
        for (long i = 0; i < n_out; i++) json_array_append_new(ta, json_integer(gen[i]));
        size_t tl = 0, sl = 0;
        char *text = tok ? cb_tokenizer_decode_alloc(tok, gen, (size_t)n_out, false, &tl) : NULL;
        char *safe = cb_utf8_repair_n(text, text ? tl : 0, &sl); /* JSON strings must be valid UTF-8 */
        json_object_set_new(o, "text", json_stringn(safe ? safe : "", safe ? sl : 0));
        free(text);
        free(safe);
        json_object_set_new(o, "tokens", ta);
        json_object_set_new(o, "n_prompt", json_integer(n_prompt));
        json_object_set_new(o, "n_gen", json_integer(n_out));
        json_object_set_new(o, "stop", json_string(stop));
        json_object_set_new(o, "prefill_ms", json_real(prefill_s * 1e3));
        json_object_set_new(o, "prefill_tok_s", json_real(prefill_s > 0 ? n_prompt / prefill_s : 0));
        json_object_set_new(o, "decode_ms", json_real(decode_s * 1e3));
        json_object_set_new(o, "decode_tok_s", json_real(decode_s > 0 ? n_decode / decode_s : 0));
        json_object_set_new(o, "threads", json_integer(cb_engine_threads(eng)));
        if (dump) {
            json_t *tl_arr = json_array();
            for (long i = 0; i < dump; i++) {
                json_t *pair = json_array();
                json_array_append_new(pair, json_integer(top[i].id));
                json_array_append_new(pair, json_real(top[i].logit));
                json_array_append_new(tl_arr, pair);
            }
            json_object_set_new(o, "top_logits", tl_arr);
        }
        char *s = json_dumps(o, JSON_COMPACT);
        if (s) puts(s);
        free(s);
        json_decref(o);
    } else {
        putchar('\n');
    }
    rc = 0;
done:
    free(top);
    free(gen);
    free(logits);
    free(ids);
    cb_sampler_destroy(&smp);
    cb_seq_destroy(&seq);
    cb_engine_destroy(&eng);
    cb_tokenizer_destroy(&tok);
    cb_model_destroy(&model);
    return rc;
}
