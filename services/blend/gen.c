/* gen.c: cb-blend's generation worker (see gen.h). */
#include "gen.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/clock.h"
#include "base/utf8.h"
#include "engine/engine.h"
#include "format/kvfile.h"
#include "base/log.h"
#include "model/model.h"
#include "wire/msg.h"
#include "rag/ragprompt.h"
#include "engine/sampler.h"
#include "model/tokenizer.h"

#define MAX_CONTEXT_BYTES 262144

void gen_query_free(gen_query_t **q_p) {
    if (!q_p || !*q_p) return;
    gen_query_t *q = *q_p;
    free(q->question);
    for (int i = 0; i < q->n_contexts; i++) free(q->contexts[i]);
    free(q);
    *q_p = NULL;
}

typedef struct {
    zsock_t *pipe;
    const gen_args_t *a;
    bool term;
    zlist_t *fifo;                /* gen_query_t * received, not started */
    cb_model_t *model;
    cb_tokenizer_t *tok;
    cb_ragprompt_t *rp;
    cb_engine_t *engine;
    cb_blend_t *blend;
    cb_bus_client_t *retriever, *cacheindex;
    cb_msg_writer_t *w;
    const int32_t *prefix;        /* [n_prefix] P */
    int n_prefix;
    int n_vocab;
    float *logits;                /* [n_vocab] */
    char fp_hex[CB_KV_HEX_BYTES];
} gen_t;

/* ---- pipe ------------------------------------------------------------------------------------------ */

/* Reads pipe messages for up to wait_ms (-1 = until one arrives): queries go to the FIFO. True on $TERM. */
static bool poll_pipe(gen_t *g, int wait_ms) {
    if (g->term) return true;
    void *h = zsock_resolve(g->pipe);
    for (;;) {
        zmq_pollitem_t it = {h, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&it, 1, wait_ms);
        if (rc < 0) {
            if (errno == EINTR) continue;
            g->term = true;
            return true;
        }
        if (rc == 0) return false;
        zmsg_t *m = zmsg_recv(g->pipe);
        char *cmd = m ? zmsg_popstr(m) : NULL;
        if (!cmd || strcmp(cmd, "$TERM") == 0) {
            zstr_free(&cmd);
            zmsg_destroy(&m);
            g->term = true;
            return true;
        }
        if (strcmp(cmd, "QUERY") == 0) {
            zframe_t *f = zmsg_pop(m);
            gen_query_t *q = NULL;
            if (f && zframe_size(f) == sizeof q) {
                memcpy(&q, zframe_data(f), sizeof q);
                zlist_append(g->fifo, q);
            }
            zframe_destroy(&f);
        }
        zstr_free(&cmd);
        zmsg_destroy(&m);
        wait_ms = 0;
    }
}

/* Sends "<what>" <q> [bytes] to the loop. */
static void to_loop(gen_t *g, const char *what, gen_query_t *q, const void *data, size_t len) {
    zmsg_t *m = zmsg_new();
    zmsg_addstr(m, what);
    zmsg_addmem(m, &q, sizeof q);
    if (data) zmsg_addmem(m, data, len);
    zmsg_send(&m, g->pipe);
}

/* ---- setup ----------------------------------------------------------------------------------------- */

static void gen_free(gen_t *g) {
    cb_bus_client_destroy(&g->retriever);
    cb_bus_client_destroy(&g->cacheindex);
    cb_msg_writer_destroy(&g->w);
    cb_blend_destroy(&g->blend);
    cb_engine_destroy(&g->engine);
    cb_ragprompt_destroy(&g->rp);
    cb_tokenizer_destroy(&g->tok);
    cb_model_destroy(&g->model);
    free(g->logits);
    zlist_destroy(&g->fifo);
}

static int gen_init(gen_t *g, char *err, size_t errlen) {
    const gen_args_t *a = g->a;
    if (!(g->model = cb_model_load(a->model_path, err, errlen))) return -1;
    if (!(g->tok = cb_tokenizer_new_from_gguf(cb_model_gguf(g->model), err, errlen))) return -1;
    if (!(g->rp = cb_ragprompt_new(g->tok, a->system_prompt, err, errlen))) return -1;
    g->prefix = cb_ragprompt_prefix(g->rp, &g->n_prefix);
    const cb_hparams_t *hp = cb_model_hparams(g->model);
    int ctx = a->ctx_size < hp->n_ctx_train ? a->ctx_size : hp->n_ctx_train;
    if (ctx <= g->n_prefix + 16) {
        snprintf(err, errlen, "blend.ctx_size %d is too small for the prompt prefix (%d tokens)", ctx, g->n_prefix);
        return -1;
    }
    if (!(g->engine = cb_engine_new(g->model, ctx, err, errlen))) return -1;
    if (a->threads > 0) cb_engine_set_threads(g->engine, a->threads);
    if (!(g->blend = cb_blend_new(g->engine, a->kv_dir, a->mem, CB_KV_F16, err, errlen))) return -1;
    if (!(g->retriever = cb_bus_client_from_config(a->cfg, "blend", "retriever", err, errlen))) return -1;
    if (!(g->cacheindex = cb_bus_client_from_config(a->cfg, "blend", "cacheindex", err, errlen))) return -1;
    /* queries wait on these: one attempt each for the cache index (degrade to files + recompute), one
     * retry for the retriever */
    cb_bus_client_set_timeout(g->retriever, a->retriever_timeout_ms, 1);
    cb_bus_client_set_timeout(g->cacheindex, a->cacheindex_timeout_ms, 0);
    g->n_vocab = hp->n_vocab;
    g->w = cb_msg_writer_new();
    g->logits = malloc((size_t)g->n_vocab * sizeof(float));
    g->fifo = zlist_new();
    if (!g->w || !g->logits || !g->fifo) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    uint8_t fp[32];
    cb_model_fingerprint(g->model, fp);
    cb_kvfile_hex(fp, g->fp_hex);
    /* compute P's KV now, so the first query does not pay for it */
    int32_t tok0 = g->prefix[0];
    cb_blend_opts_t o;
    cb_blend_opts_default(&o);
    o.mode = CB_BLEND_REUSE;
    if (cb_blend_prefill(g->blend, g->prefix, g->n_prefix, NULL, 0, &tok0, 1, &o, NULL, NULL, err, errlen) != 0)
        return -1;
    return 0;
}

/* ---- UTF-8 streaming: hold an incomplete trailing sequence, replace invalid bytes with U+FFFD ------- */

typedef struct {
    unsigned char pend[4];
    int npend;
} utf8_stream_t;

/* Appends the pending bytes and in[n] (n <= 1024) to out (capacity >= 3 * (n + 4)), returning the bytes
 * written: valid sequences as they are, invalid bytes as U+FFFD; an incomplete sequence at the end stays
 * pending unless final. */
static size_t utf8_feed(utf8_stream_t *u, const unsigned char *in, size_t n, bool final, char *out) {
    unsigned char buf[4 + 1024];
    if (n > 1024) n = 1024;
    size_t len = (size_t)u->npend;
    memcpy(buf, u->pend, len);
    if (n) memcpy(buf + len, in, n);
    len += n;
    u->npend = 0;
    size_t i = 0, o = 0;
    while (i < len) {
        size_t L = cb_utf8_lead_len(buf[i]);
        if (L && i + L > len) {
            bool cont = true;
            for (size_t j = i + 1; j < len; j++)
                if ((buf[j] & 0xC0) != 0x80) cont = false;
            if (cont && !final) {
                u->npend = (int)(len - i);
                memcpy(u->pend, buf + i, (size_t)u->npend);
                return o;
            }
        }
        size_t l = cb_utf8_seq_len(buf + i, len - i); /* 0 for a sequence cut by the end, too */
        if (l) {
            memcpy(out + o, buf + i, l);
            o += l;
            i += l;
        } else {
            memcpy(out + o, CB_UTF8_REPLACEMENT, 3);
            o += 3;
            i++;
        }
    }
    return o;
}

/* ---- one query ------------------------------------------------------------------------------------- */

typedef struct {
    double queue_ms, retrieve_ms, lookup_ms, load_ms, blend_ms, decode_ms, ttft_ms;
    int hits, misses, corrupt, n_prompt, n_gen, n_chunks;
    cb_blend_stats_t bs;
} qmetrics_t;

static void send_error(gen_t *g, gen_query_t *q, cb_err_t code, const char *msg) {
    size_t len;
    const void *d = cb_msg_write_error(g->w, "done", q->id, code, &len, "%s", msg);
    atomic_fetch_add(&g->a->stats->queries_failed, 1);
    cb_log(CB_LOG_WARN, q->id, "query failed: %s: %s", cb_err_name(code), msg);
    to_loop(g, "DONE", q, d, d ? len : 0);
}

/* Asks cb-retriever for the top k chunks. Fills texts/lens (caller frees each text). Returns the count,
 * or -1 with *code and err. */
static int retrieve(gen_t *g, gen_query_t *q, char **texts, size_t *lens, cb_err_t *code, char *err, size_t errlen) {
    char id[CB_MSG_MAX_ID + 1];
    snprintf(id, sizeof id, "%.40s.r", q->id);
    cb_msg_begin(g->w, "search", id);
    cb_msg_put_str(g->w, "query", q->question);
    cb_msg_put_int(g->w, "k", q->k);
    char e[512];
    cb_msg_t *r = cb_bus_call_ok(g->retriever, g->w, code, e, sizeof e);
    if (!r) {
        snprintf(err, errlen, "cb-retriever: %s", e);
        if (*code != CB_ERR_TIMEOUT && *code != CB_ERR_UNAVAILABLE) *code = CB_ERR_UNAVAILABLE;
        return -1;
    }
    size_t n = 0;
    if (!cb_msg_array_len(r, "hits", (size_t)q->k, &n)) {
        snprintf(err, errlen, "cb-retriever: invalid reply: %s", cb_msg_last_error(r));
        *code = CB_ERR_INTERNAL;
        cb_msg_destroy(&r);
        return -1;
    }
    int got = 0;
    for (size_t i = 0; i < n; i++) {
        const cb_msg_t *h = cb_msg_at_map(r, "hits", i);
        const char *s;
        size_t len;
        if (!h || !cb_msg_str(h, "text", MAX_CONTEXT_BYTES, &s, &len)) continue;
        texts[got] = malloc(len + 1);
        if (!texts[got]) break;
        memcpy(texts[got], s, len);
        texts[got][len] = 0;
        lens[got++] = len;
    }
    cb_msg_destroy(&r);
    return got;
}

/* Registers a chunk's KV file with cb-cacheindex (best effort). */
static void put_chunk(gen_t *g, gen_query_t *q, const char *hex, int n_tokens) {
    char rel[CB_KV_HEX_BYTES + 8], path[4400];
    snprintf(rel, sizeof rel, "%.2s/%.64s.kv", hex, hex);
    snprintf(path, sizeof path, "%s/%s", g->a->kv_dir, rel);
    struct stat sb;
    if (stat(path, &sb) != 0) {
        cb_log(CB_LOG_WARN, q->id, "chunk %.16s: no KV file to register (%s)", hex, strerror(errno));
        return;
    }
    char id[CB_MSG_MAX_ID + 1];
    snprintf(id, sizeof id, "%.40s.p", q->id);
    cb_msg_begin(g->w, "put", id);
    cb_msg_put_str(g->w, "key", hex);
    cb_msg_put_str(g->w, "path", rel);
    cb_msg_put_int(g->w, "bytes", (int64_t)sb.st_size);
    cb_msg_put_int(g->w, "tokens", n_tokens);
    cb_msg_put_str(g->w, "fingerprint", g->fp_hex);
    cb_err_t code;
    char e[512];
    cb_msg_t *r = cb_bus_call_ok(g->cacheindex, g->w, &code, e, sizeof e);
    if (!r) {
        if (code == CB_ERR_TIMEOUT || code == CB_ERR_UNAVAILABLE) atomic_fetch_add(&g->a->stats->index_unavailable, 1);
        cb_log(CB_LOG_WARN, q->id, "chunk %.16s: put: %s", hex, e);
    }
    cb_msg_destroy(&r);
}

/* Looks the needed keys up in cb-cacheindex (which marks them used for its LRU); in_index[i] says
 * whether the index knows chunk i. The blend itself checks the memory tier and the files, so the index
 * only informs the LRU, the metrics and which chunks to register. Returns -1 when unreachable. */
static int lookup(gen_t *g, gen_query_t *q, char (*hex)[CB_KV_HEX_BYTES], const bool *need, int n, bool *in_index) {
    char id[CB_MSG_MAX_ID + 1];
    snprintf(id, sizeof id, "%.40s.l", q->id);
    cb_msg_begin(g->w, "lookup", id);
    cb_msg_begin_array(g->w, "keys");
    int nk = 0;
    for (int i = 0; i < n; i++) {
        in_index[i] = false;
        if (need[i]) {
            cb_msg_put_str(g->w, NULL, hex[i]);
            nk++;
        }
    }
    cb_msg_end_array(g->w);
    if (nk == 0) return 0;
    cb_err_t code;
    char e[512];
    cb_msg_t *r = cb_bus_call_ok(g->cacheindex, g->w, &code, e, sizeof e);
    if (!r) {
        if (code == CB_ERR_TIMEOUT || code == CB_ERR_UNAVAILABLE) atomic_fetch_add(&g->a->stats->index_unavailable, 1);
        cb_log(CB_LOG_WARN, q->id, "lookup: %s (going on with the KV files)", e);
        return -1;
    }
    size_t nh = 0;
    cb_msg_array_len(r, "hits", 256, &nh);
    for (size_t h = 0; h < nh; h++) {
        const cb_msg_t *hm = cb_msg_at_map(r, "hits", h);
        const char *k;
        size_t kl;
        if (!hm || !cb_msg_str(hm, "key", 128, &k, &kl)) continue;
        for (int i = 0; i < n; i++)
            if (need[i] && kl == 64 && memcmp(k, hex[i], 64) == 0) in_index[i] = true;
    }
    cb_msg_destroy(&r);
    return (int)nh;
}

static void run_query(gen_t *g, gen_query_t *q) {
    const gen_args_t *a = g->a;
    qmetrics_t mt = {0};
    double t_start = cb_now_ms();
    mt.queue_ms = t_start - q->t_recv_ms;
    char err[1024];
    cb_err_t code = CB_ERR_INTERNAL;
    char *rtexts[GEN_MAX_CONTEXTS] = {0};
    size_t rlens[GEN_MAX_CONTEXTS] = {0};
    int32_t *ctoks[GEN_MAX_CONTEXTS] = {0};
    int cn[GEN_MAX_CONTEXTS] = {0};
    char hex[GEN_MAX_CONTEXTS][CB_KV_HEX_BYTES];
    bool need[GEN_MAX_CONTEXTS] = {0};
    int32_t *suffix = NULL;
    cb_sampler_t *sampler = NULL;
    char *text = NULL;
    size_t text_len = 0, text_cap = 0;

    /* 1. the contexts: given, or retrieved */
    char **texts = q->contexts;
    size_t *lens = q->context_lens;
    int n = q->n_contexts;
    if (q->retrieve) {
        double t = cb_now_ms();
        n = retrieve(g, q, rtexts, rlens, &code, err, sizeof err);
        mt.retrieve_ms = cb_now_ms() - t;
        if (n < 0) goto fail;
        texts = rtexts;
        lens = rlens;
    }
    mt.n_chunks = n;
    /* 2. the prompt pieces */
    int n_suffix = 0, N = g->n_prefix;
    for (int i = 0; i < n; i++) {
        if (!(ctoks[i] = cb_ragprompt_chunk(g->rp, texts[i], lens[i], &cn[i]))) {
            snprintf(err, sizeof err, "cannot tokenize context %d", i);
            goto fail;
        }
        N += cn[i];
    }
    if (!(suffix = cb_ragprompt_suffix(g->rp, q->question, &n_suffix))) {
        snprintf(err, sizeof err, "cannot tokenize the question");
        goto fail;
    }
    N += n_suffix;
    mt.n_prompt = N;
    int max_ctx = cb_engine_max_ctx(g->engine);
    if (N >= max_ctx) {
        code = CB_ERR_TOO_LARGE;
        snprintf(err, sizeof err, "the prompt has %d tokens; blend.ctx_size allows %d", N, max_ctx - 1);
        goto fail;
    }
    int max_new = q->max_tokens < max_ctx - N ? q->max_tokens : max_ctx - N;
    /* 3. which chunks the mode reads from the cache; their keys; the index lookup */
    for (int i = 0; i < n; i++) {
        need[i] = q->mode == CB_BLEND_REUSE || q->mode == CB_BLEND_BLEND || (q->mode == CB_BLEND_PREFIX && i == 0);
        uint8_t key[32];
        cb_blend_chunk_key(g->blend, g->prefix, g->n_prefix, ctoks[i], cn[i], key);
        cb_kvfile_hex(key, hex[i]);
    }
    bool in_index[GEN_MAX_CONTEXTS] = {0};
    int index_rc;
    {
        double t = cb_now_ms();
        index_rc = lookup(g, q, hex, need, n, in_index);
        mt.lookup_ms = cb_now_ms() - t;
    }
    /* 4. the fused prefill: it takes each needed chunk from the memory tier, else streams its KV file
     * (checked layer by layer, loading overlapped with compute), else computes it and writes the file; a
     * file that fails any check is a miss */
    if (atomic_load(&q->cancelled)) goto cancelled;
    cb_blend_chunk_t chunks[GEN_MAX_CONTEXTS];
    for (int i = 0; i < n; i++) chunks[i] = (cb_blend_chunk_t){ctoks[i], cn[i]};
    cb_blend_opts_t o;
    cb_blend_opts_default(&o);
    o.mode = q->mode;
    o.ratio = (float)q->ratio;
    o.check_layer = a->check_layer;
    o.metric = a->metric;
    o.lead_tokens = a->lead_tokens;
    double t_blend = cb_now_ms();
    if (cb_blend_prefill(g->blend, g->prefix, g->n_prefix, chunks, n, suffix, n_suffix, &o, g->logits, &mt.bs, err,
                         sizeof err) != 0)
        goto fail;
    mt.blend_ms = cb_now_ms() - t_blend;
    mt.hits = mt.bs.chunks_mem + mt.bs.chunks_file;
    mt.misses = mt.bs.chunks_computed;
    mt.load_ms = mt.bs.t_load_ms;
    if (mt.misses > 0) {
        /* chunks computed now: register their files. A chunk the index knew but that had to be computed had
         * a file that failed its checks (rewritten now): count it and register it again. */
        int index_misses = 0;
        for (int i = 0; i < n; i++) index_misses += need[i] && !in_index[i];
        if (index_rc >= 0 && mt.misses > index_misses) {
            mt.corrupt = mt.misses - index_misses;
            cb_log(CB_LOG_WARN, q->id, "%d chunk file(s) rejected (corrupt or stale): recomputed and rewritten",
                   mt.corrupt);
        }
        if (a->store_misses)
            for (int i = 0; i < n; i++)
                if (need[i] && (!in_index[i] || mt.corrupt > 0 || index_rc < 0)) put_chunk(g, q, hex[i], cn[i]);
    } else {
        for (int i = 0; i < n; i++)
            if (need[i] && !in_index[i] && index_rc >= 0 && a->store_misses) put_chunk(g, q, hex[i], cn[i]);
    }
    /* 6. decode, streaming */
    cb_sampler_params_t sp = {.temperature = (float)q->temperature, .top_k = 0, .top_p = (float)q->top_p, .seed = q->seed};
    if (!(sampler = cb_sampler_new(&sp, g->n_vocab))) {
        snprintf(err, sizeof err, "cannot create the sampler");
        goto fail;
    }
    double t_dec = cb_now_ms();
    utf8_stream_t u = {0};
    char piece[3 * (1024 + 4)];
    int index = 0;
    int32_t tok = cb_sampler_sample(sampler, g->logits);
    mt.ttft_ms = cb_now_ms() - q->t_recv_ms;
    for (;;) {
        bool eog = cb_model_is_eog(g->model, tok) || cb_tokenizer_is_eog(g->tok, tok);
        size_t blen = 0;
        const char *bytes = eog ? NULL : cb_tokenizer_token_bytes(g->tok, tok, false, &blen);
        if (blen > 1024) blen = 1024; /* vocabulary strings are short; bound the scratch anyway */
        if (!eog) mt.n_gen++;
        bool last = eog || mt.n_gen >= max_new;
        size_t pl = utf8_feed(&u, (const unsigned char *)(bytes ? bytes : ""), blen, last, piece);
        if (pl > 0) {
            if (text_len + pl + 1 > text_cap) {
                size_t cap = text_cap ? text_cap * 2 : 1024;
                while (cap < text_len + pl + 1) cap *= 2;
                char *t2 = realloc(text, cap);
                if (!t2) {
                    snprintf(err, sizeof err, "out of memory");
                    goto fail;
                }
                text = t2;
                text_cap = cap;
            }
            memcpy(text + text_len, piece, pl);
            text_len += pl;
            text[text_len] = 0;
            cb_msg_begin_reply_as(g->w, "token", q->id);
            cb_msg_put_strn(g->w, "text", piece, pl);
            cb_msg_put_int(g->w, "index", index++);
            size_t len;
            const void *d = cb_msg_end(g->w, &len);
            if (d) to_loop(g, "SEND", q, d, len);
        }
        if (last) break;
        if (poll_pipe(g, 0)) goto term;
        if (atomic_load(&q->cancelled)) goto cancelled;
        if (cb_engine_decode(g->engine, tok, N + mt.n_gen - 1, g->logits) != 0) {
            snprintf(err, sizeof err, "decode failed at position %d", N + mt.n_gen - 1);
            goto fail;
        }
        tok = cb_sampler_sample(sampler, g->logits);
    }
    mt.decode_ms = cb_now_ms() - t_dec;
    atomic_fetch_add(&a->stats->tokens_generated, (uint64_t)mt.n_gen);
    atomic_fetch_add(&a->stats->cache_hits, (uint64_t)mt.hits);
    atomic_fetch_add(&a->stats->cache_misses, (uint64_t)mt.misses);
    atomic_fetch_add(&a->stats->cache_corrupt, (uint64_t)mt.corrupt);
    atomic_fetch_add(&a->stats->queries_done, 1);
    /* 7. done */
    cb_msg_writer_t *w = g->w;
    cb_msg_begin_reply_as(w, "done", q->id);
    cb_msg_put_strn(w, "text", text ? text : "", text_len);
    cb_msg_begin_map(w, "metrics");
    cb_msg_put_str(w, "mode", cb_blend_mode_str(q->mode));
    cb_msg_put_double(w, "ratio", q->ratio);
    cb_msg_put_double(w, "ttft_ms", mt.ttft_ms);
    cb_msg_put_double(w, "queue_ms", mt.queue_ms);
    cb_msg_put_double(w, "retrieve_ms", mt.retrieve_ms);
    cb_msg_put_double(w, "lookup_ms", mt.lookup_ms);
    cb_msg_put_double(w, "load_ms", mt.load_ms);
    cb_msg_put_double(w, "load_wait_ms", mt.bs.t_load_wait_ms);
    cb_msg_put_double(w, "resolve_ms", mt.bs.t_resolve_ms);
    cb_msg_put_double(w, "compute_ms", mt.bs.t_compute_ms);
    cb_msg_put_double(w, "blend_ms", mt.blend_ms);
    cb_msg_put_double(w, "decode_ms", mt.decode_ms);
    cb_msg_put_double(w, "total_ms", cb_now_ms() - q->t_recv_ms);
    cb_msg_put_int(w, "tokens_reused", mt.bs.tokens_reused);
    cb_msg_put_int(w, "tokens_recomputed", mt.bs.tokens_recomputed);
    cb_msg_put_int(w, "cache_hits", mt.hits);
    cb_msg_put_int(w, "cache_misses", mt.misses);
    cb_msg_put_int(w, "cache_corrupt", mt.corrupt);
    cb_msg_put_int(w, "n_chunks", mt.n_chunks);
    cb_msg_put_int(w, "n_prompt_tokens", mt.n_prompt);
    cb_msg_put_int(w, "n_generated", mt.n_gen);
    cb_msg_end_map(w);
    cb_msg_begin_array(w, "chunk_ids");
    for (int i = 0; i < n; i++) cb_msg_put_str(w, NULL, hex[i]);
    cb_msg_end_array(w);
    size_t len;
    const void *d = cb_msg_end(w, &len);
    if (!d) {
        snprintf(err, sizeof err, "cannot encode the done message: %s", cb_msg_writer_error(w));
        goto fail;
    }
    cb_log(CB_LOG_INFO, q->id,
           "query %s r=%.2f: %d chunks (%d hits: %d memory, %d file; %d misses%s), %d prompt tokens (%d recomputed), "
           "ttft %.1f ms (queue %.1f, retrieve %.1f, lookup %.1f, blend %.1f: resolve %.1f, load %.1f), %d tokens in "
           "%.1f ms",
           cb_blend_mode_str(q->mode), q->ratio, n, mt.hits, mt.bs.chunks_mem, mt.bs.chunks_file, mt.misses,
           mt.corrupt ? ", rejected files" : "", N, mt.bs.tokens_recomputed, mt.ttft_ms, mt.queue_ms, mt.retrieve_ms,
           mt.lookup_ms, mt.blend_ms, mt.bs.t_resolve_ms, mt.load_ms, mt.n_gen, mt.decode_ms);
    to_loop(g, "DONE", q, d, len);
    goto out;

fail:
    send_error(g, q, code, err);
    goto out;
cancelled:
    atomic_fetch_add(&a->stats->queries_cancelled, 1);
    cb_log(CB_LOG_INFO, q->id, "query cancelled (the client went away) after %d tokens", mt.n_gen);
    to_loop(g, "DONE", q, NULL, 0);
    goto out;
term:
    cb_log(CB_LOG_INFO, q->id, "query interrupted by shutdown after %d tokens", mt.n_gen);
out:
    for (int i = 0; i < GEN_MAX_CONTEXTS; i++) {
        free(rtexts[i]);
        free(ctoks[i]);
    }
    free(suffix);
    free(text);
    cb_sampler_destroy(&sampler);
}

void gen_actor(zsock_t *pipe, void *args) {
    gen_t g = {.pipe = pipe, .a = args};
    zsock_signal(pipe, 0);
    char err[1024];
    if (gen_init(&g, err, sizeof err) != 0) {
        cb_log(CB_LOG_ERROR, NULL, "worker: %s", err);
        zstr_sendx(pipe, "FATAL", err, NULL);
        gen_free(&g);
        while (!g.term) poll_pipe(&g, 1000);
        return;
    }
    cb_log(CB_LOG_INFO, NULL, "worker ready: prompt prefix %d tokens, context %d, kv_dir %s", g.n_prefix,
           cb_engine_max_ctx(g.engine), g.a->kv_dir);
    zstr_send(pipe, "READY");
    while (!g.term) {
        gen_query_t *q = zlist_pop(g.fifo);
        if (!q) {
            poll_pipe(&g, -1);
            continue;
        }
        if (atomic_load(&q->cancelled)) {
            atomic_fetch_add(&g.a->stats->queries_cancelled, 1);
            to_loop(&g, "DONE", q, NULL, 0);
            continue;
        }
        to_loop(&g, "START", q, NULL, 0);
        run_query(&g, q);
        poll_pipe(&g, 0);
    }
    gen_free(&g);
}
