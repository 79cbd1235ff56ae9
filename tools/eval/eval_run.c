/* eval_run.c: a cb-eval run: the RAG session and the other chunk stores, each example's prompt pieces as
 * the served path builds them, the missing chunk files precomputed, every mode's prefill (timed) and
 * greedy answer, scored against the gold answers and full's, one results line each (eval.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/alloc.h"
#include "base/clock.h"
#include "base/utf8.h"
#include "engine/sampler.h"
#include "eval.h"

/* CPU time of the whole process (all threads): the work done, whatever else runs on the machine. */
static double cpu_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

/* One example's prompt pieces (ragprompt.h). */
typedef struct {
    int nc;
    int32_t *chunk_tok[CB_QA_MAX_CTXS];
    int chunk_n[CB_QA_MAX_CTXS];
    int32_t *suffix;
    int n_suffix;
    long long total;                     /* prompt tokens */
} pieces_t;

/* The full-mode lines of an earlier results.jsonl, by id; NULL with a message. */
json_t *eval_load_ref(const char *path) {
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
int eval_open(eval_t *ev) {
    const eval_args_t *a = ev->a;
    if (eval_mkdir_p(a->kv_dir) != 0 || eval_mkdir_p(a->out) != 0) {
        fprintf(stderr, "cb-eval: cannot create %s or %s: %s\n", a->kv_dir, a->out, strerror(errno));
        return -1;
    }
    cb_session_opts_t so;
    cb_session_opts_default(&so);
    so.model_path = a->model_path;
    so.chat_template = a->chat_tmpl;
    so.system_prompt = a->system_prompt;
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
            eval_mkdir_p(dir) != 0) {
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

void eval_close(eval_t *ev) {
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
int eval_open_results(eval_t *ev) {
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
    json_object_set_new(c, "system_prompt", json_string(a->system_prompt ? a->system_prompt : ""));
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
int eval_examples(eval_t *ev, const cb_qa_set_t *set, int first, int last) {
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
        if (rc == 0 && eval_write_summaries(ev->a->out, ev->vs, ev->nv, ev->config) != 0)
            fprintf(stderr, "cb-eval: writing the summary failed\n");
    }
    return 0;
}

