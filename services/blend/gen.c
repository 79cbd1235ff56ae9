/* gen.c: cb-blend's generation worker (see gen.h). */
#include "gen.h"
#include "base/alloc.h"

#include <errno.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/utf8.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "format/kvfile.h"
#include "kv/kvstore.h"
#include "model/model.h"
#include "model/tokenizer.h"
#include "notify.h"
#include "rag/ragprompt.h"
#include "svc/session.h"
#include "wire/msg.h"

_Static_assert(NOTIFY_MAX_CHUNKS >= CB_QUERY_MAX_CONTEXTS, "one notice holds every chunk of a query");

void gen_query_free(gen_query_t **q_p) {
    if (!q_p || !*q_p) return;
    gen_query_t *q = *q_p;
    free(q->question);
    for (int i = 0; i < q->n_contexts; i++) free(q->contexts[i]);
    free(q);
    *q_p = NULL;
}

typedef struct {
    unsigned char pend[4];
    int npend;
} utf8_stream_t;

typedef struct {
    double queue_ms, retrieve_ms, lookup_ms, load_ms, blend_ms, decode_ms, ttft_ms;
    int hits, misses, corrupt, n_prompt, n_gen, n_chunks;
    cb_blend_stats_t bs;
} qmetrics_t;

typedef enum {
    SLOT_FREE = 0,
    SLOT_WAITING,  /* admitted, prompt built: its blend waits for its turn (or for pool blocks) */
    SLOT_PREFILL,  /* its blend runs, a slice a step */
    SLOT_DECODE    /* in the decode batch */
} slot_state_t;

/* One running query, from its pieces to its `done`, in a slot of the step loop. */
typedef struct query {
    slot_state_t state;
    cb_seq_t *seq;                           /* the query's KV: the slot's (kept), cleared after each query */
    /* the rest is per query (query_reset) */
    gen_query_t *q;
    uint64_t order;                          /* admission number: the newest is preempted first */
    qmetrics_t mt;
    char **texts;                            /* [n] the contexts (q's) */
    size_t *lens;
    int n;
    int32_t *ctoks[CB_QUERY_MAX_CONTEXTS];        /* [n] chunk tokens (owned) */
    int cn[CB_QUERY_MAX_CONTEXTS];
    int32_t *suffix;                         /* [n_suffix] S (owned) */
    int n_suffix;
    int N;                                   /* prompt tokens */
    int max_new;
    char hex[CB_QUERY_MAX_CONTEXTS][CB_KV_HEX_BYTES]; /* chunk keys (kvstore.h), for `chunk_ids` */
    notify_note_t note;                      /* what cb-cacheindex is told */
    bool prefilled, noted, noticed;
    char *text;                              /* the answer so far (owned) [text_cap], text_len bytes + NUL */
    size_t text_len, text_cap;
    size_t sent;                             /* text[0..sent) has been streamed; text[sent..text_len) is held
                                                back: it may be the start of a stop sequence */
    const char *finish;                      /* finish_reason once it ended: "stop" or "length" */
    cb_sampler_t *sampler;                   /* the query's own sampler state (owned) */
    utf8_stream_t u;                         /* an incomplete UTF-8 sequence held back */
    int index;                               /* `token` messages sent */
    int32_t tok;                             /* the last token sampled, not yet decoded */
    double t_blend0, t_dec0;
} query_t;

typedef struct {
    zsock_t *pipe;
    const gen_args_t *a;
    bool term;
    zlist_t *fifo;                /* gen_query_t * received, not started */
    cb_session_t *session;        /* model, tokenizer, prompt, engine, store and blend (svc/session.h); the
                                     pointers below are its objects, borrowed */
    cb_model_t *model;
    cb_tokenizer_t *tok;
    const cb_ragprompt_t *rp;
    cb_engine_t *engine;          /* owns the KV pool */
    cb_kvstore_t *store;          /* chunk KV: memory tier -> KV files (a->kv_dir) -> Redis -> compute */
    cb_blend_t *blend;            /* one blend at a time, in slices (g->prefilling's) */
    query_t *slots;          /* [n_slots] the running queries (blend.max_seqs) */
    int n_slots;
    query_t *prefilling;     /* the slot whose blend is in progress, or NULL */
    bool pool_wait;               /* the next blend waits for blocks until a query ends */
    uint64_t n_admitted;
    /* one decode step: row j is slot b_slot[j] */
    int *b_slot;                  /* [n_slots] */
    cb_seq_t **b_seq;             /* [n_slots] */
    int32_t *b_tok, *b_pos;       /* [n_slots] */
    float *b_logits;              /* [n_slots][n_vocab] */
    notify_args_t na;             /* the notifier's arguments (it borrows them) */
    zactor_t *notifier;           /* cache-index touches and puts, off the token path (notify.h) */
    cb_msg_writer_t *w;
    const int32_t *prefix;        /* [n_prefix] P, the store's precompute context */
    int n_prefix;
    int n_vocab;
    uint64_t kv_bytes_per_token;  /* a KV file's payload per token (all layers, K and V) */
    float *logits;                /* [n_vocab] the blend's last row */
} gen_t;

static void query_reset(query_t *r);

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

/* Publishes the KV pool's accounting for the loop's `stats`. */
static void publish_pool(gen_t *g) {
    cb_engine_pool_stats_t ps;
    cb_engine_pool_stats(g->engine, &ps);
    gen_stats_t *s = g->a->stats;
    atomic_store(&s->pool_blocks, ps.n_blocks);
    atomic_store(&s->pool_blocks_used, ps.blocks_used);
    atomic_store(&s->pool_blocks_free, ps.blocks_free);
    atomic_store(&s->pool_blocks_shared, ps.blocks_shared);
    atomic_store(&s->pool_block_tokens, ps.block_tokens);
    if (ps.blocks_used > atomic_load(&s->pool_blocks_peak)) atomic_store(&s->pool_blocks_peak, ps.blocks_used);
}

static void gen_free(gen_t *g) {
    atomic_store(&g->na.stopping, true); /* the queued notices are dropped, not sent one by one */
    zactor_destroy(&g->notifier);
    cb_bus_client_destroy(&g->na.index); /* when the actor never took it over */
    cb_msg_writer_destroy(&g->w);
    if (g->blend) cb_blend_cancel(g->blend); /* a call in progress ends before its sequence goes */
    for (int i = 0; g->slots && i < g->n_slots; i++) {
        query_reset(&g->slots[i]);
        cb_seq_destroy(&g->slots[i].seq);
    }
    free(g->slots);
    free(g->b_slot);
    free(g->b_seq);
    free(g->b_tok);
    free(g->b_pos);
    free(g->b_logits);
    cb_session_destroy(&g->session); /* after every sequence of its engine */
    free(g->logits);
    zlist_destroy(&g->fifo);
}

/* The cache-index notifier (notify.h), with the model's fingerprint for its puts. */
static int start_notifier(gen_t *g, char *err, size_t errlen) {
    const gen_args_t *a = g->a;
    notify_args_t *na = &g->na;
    if (!(na->index = cb_bus_client_from_config(a->cfg, "blend", "cacheindex", err, errlen))) return -1;
    snprintf(na->kv_dir, sizeof na->kv_dir, "%s", a->kv_dir);
    uint8_t fp[32];
    cb_model_fingerprint(g->model, fp);
    cb_kvfile_hex(fp, na->fp_hex);
    na->timeout_ms = a->cacheindex_timeout_ms;
    na->store = a->store_misses;
    na->unavailable = &a->stats->index_unavailable;
    na->dropped = &a->stats->index_dropped;
    if (!(g->notifier = zactor_new(notify_actor, na))) {
        snprintf(err, errlen, "cannot start the cache-index notifier thread");
        return -1;
    }
    return 0;
}

static int gen_init(gen_t *g, char *err, size_t errlen) {
    const gen_args_t *a = g->a;
    /* default pool: every slot a whole context, and one more for the store's context and chunk misses
     * (address space; pages are touched as blocks are first used); P's KV is computed now (its blocks are
     * shared into every query's sequence), so the first query does not pay */
    cb_session_opts_t so = a->session;
    so.kv_pool_seqs = a->max_seqs + 1;
    if (!(g->session = cb_session_new(&so, err, errlen))) return -1;
    g->model = cb_session_model(g->session);
    g->tok = cb_session_tokenizer(g->session);
    g->rp = cb_session_prompt(g->session);
    g->engine = cb_session_engine(g->session);
    g->store = cb_session_store(g->session);
    g->blend = cb_session_blend(g->session);
    g->prefix = cb_session_prefix(g->session, &g->n_prefix);
    const cb_hparams_t *hp = cb_model_hparams(g->model);
    g->n_vocab = hp->n_vocab;
    g->kv_bytes_per_token =
        2u * (uint64_t)hp->n_layer * cb_kv_row_bytes(a->session.kv_dtype, (size_t)hp->n_head_kv * hp->head_dim);
    g->w = cb_msg_writer_new();
    g->logits = cb_malloc((size_t)g->n_vocab * sizeof(float));
    g->fifo = zlist_new();
    const int S = g->n_slots = a->max_seqs;
    g->slots = cb_calloc((size_t)S, sizeof *g->slots);
    g->b_slot = cb_malloc(sizeof(int) * (size_t)S);
    g->b_seq = cb_malloc(sizeof(cb_seq_t *) * (size_t)S);
    g->b_tok = cb_malloc(sizeof(int32_t) * (size_t)S);
    g->b_pos = cb_malloc(sizeof(int32_t) * (size_t)S);
    g->b_logits = cb_malloc(sizeof(float) * (size_t)S * (size_t)g->n_vocab);
    if (!g->w || !g->logits || !g->fifo || !g->slots || !g->b_slot || !g->b_seq || !g->b_tok || !g->b_pos ||
        !g->b_logits) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (int i = 0; i < S; i++)
        if (!(g->slots[i].seq = cb_seq_new(g->engine))) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
    if (start_notifier(g, err, errlen) != 0) return -1;
    publish_pool(g);
    return 0;
}

/* ---- UTF-8 streaming: hold an incomplete trailing sequence, replace invalid bytes with U+FFFD ------- */


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

/* ---- one query: a slot ------------------------------------------------------------------------------ */


/* Frees what the query owns and clears it; the slot keeps its (empty) sequence. */
static void query_reset(query_t *r) {
    for (int i = 0; i < CB_QUERY_MAX_CONTEXTS; i++) free(r->ctoks[i]);
    free(r->suffix);
    free(r->text);
    cb_sampler_destroy(&r->sampler);
    cb_seq_t *seq = r->seq;
    memset(r, 0, sizeof *r);
    r->seq = seq;
}

static void send_error(gen_t *g, gen_query_t *q, cb_err_t code, const char *msg) {
    size_t len;
    const void *d = cb_msg_write_error(g->w, "done", q->id, code, &len, "%s", msg);
    atomic_fetch_add(&g->a->stats->queries_failed, 1);
    if (code == CB_ERR_OVERLOADED) atomic_fetch_add(&g->a->stats->queries_overloaded, 1);
    cb_log(CB_LOG_WARN, q->id, "query failed: %s: %s", cb_err_name(code), msg);
    to_loop(g, "DONE", q, d, d ? len : 0);
}

/* 1. The contexts: the query's own, or those cb-retriever gave it (fetch.h). */
static void gather_contexts(query_t *r) {
    gen_query_t *q = r->q;
    r->texts = q->contexts;
    r->lens = q->context_lens;
    r->n = q->n_contexts;
    r->mt.retrieve_ms = q->retrieve_ms;
    r->mt.n_chunks = r->n;
}

/* 2. The prompt pieces (P is the store's context): chunk and suffix tokens, N, the decode budget. 0, or -1
 * with *code and err. */
static int build_prompt(gen_t *g, query_t *r, cb_err_t *code, char *err, size_t errlen) {
    r->N = g->n_prefix;
    for (int i = 0; i < r->n; i++) {
        if (!(r->ctoks[i] = cb_ragprompt_chunk(g->rp, r->texts[i], r->lens[i], &r->cn[i]))) {
            snprintf(err, errlen, "cannot tokenize context %d", i);
            return -1;
        }
        r->N += r->cn[i];
    }
    if (!(r->suffix = cb_ragprompt_suffix(g->rp, r->q->question, &r->n_suffix))) {
        snprintf(err, errlen, "cannot tokenize the question");
        return -1;
    }
    r->N += r->n_suffix;
    r->mt.n_prompt = r->N;
    int max_ctx = cb_engine_max_ctx(g->engine);
    if (r->N >= max_ctx) {
        *code = CB_ERR_TOO_LARGE;
        snprintf(err, errlen, "the prompt has %d tokens; blend.ctx_size allows %d", r->N, max_ctx - 1);
        return -1;
    }
    r->max_new = r->q->max_tokens < max_ctx - r->N ? r->q->max_tokens : max_ctx - r->N;
    return 0;
}

/* 3. The fused prefill starts (cb_blend_start): it then runs a slice per step (prefill_slice). 0, or -1
 * with err (bad arguments, out of memory: internal). */
static int prefill_start(gen_t *g, query_t *r, char *err, size_t errlen) {
    cb_blend_chunk_t chunks[CB_QUERY_MAX_CONTEXTS];
    for (int i = 0; i < r->n; i++) chunks[i] = (cb_blend_chunk_t){r->ctoks[i], r->cn[i]};
    r->t_blend0 = cb_now_ms();
    return cb_blend_start(g->blend, r->seq, g->prefix, g->n_prefix, chunks, r->n, r->suffix, r->n_suffix,
                          &r->q->opts, g->logits, err, errlen) == CB_ENGINE_OK ? 0 : -1;
}

/* A chunk computed because its file failed a content check (corrupt bytes, another model's or context's
 * file), not because there was none or it was cut short: cache_corrupt. */
static bool rejected(const cb_blend_chunk_info_t *c) {
    return c->src == CB_KVSTORE_COMPUTED && c->why != CB_KV_OK && c->why != CB_KV_MISS_NOT_FOUND &&
           c->why != CB_KV_MISS_TRUNCATED;
}

/* A computed chunk's KV file, written or not, for the ping's disk state: a file that could not be written
 * while kv_dir has less room than it (and 1 MiB) is a write that failed on a full disk (the store counts
 * and logs the failure; an obstacle at the path with room on the disk is not the disk's fault). */
static void disk_note(gen_t *g, bool stored, int n_tokens) {
    if (!g->a->disk) return;
    if (stored) {
        cb_diskhealth_ok(g->a->disk, "KV dir");
        return;
    }
    uint64_t need = (uint64_t)n_tokens * g->kv_bytes_per_token, avail = 0;
    if (cb_diskhealth_room(g->a->kv_dir, need, &avail)) return;
    char msg[256];
    snprintf(msg, sizeof msg, "a KV file of about %llu bytes could not be written with %llu bytes free in the KV dir",
             (unsigned long long)need, (unsigned long long)avail);
    cb_diskhealth_failed(g->a->disk, "KV dir", msg);
}

/* 4. After the prefill, from the blend's own record of each chunk it read (stats.chunks): the chunk ids,
 * the notice (a chunk computed now is `put`, one read from memory or its file is touched; each key once)
 * and cache_corrupt. Once per query; no I/O (but a statvfs of kv_dir when a computed chunk's file could not be
 * written: disk_note). */
static void chunk_note(gen_t *g, query_t *r) {
    if (r->noted || !r->prefilled) return;
    r->noted = true;
    double t = cb_now_ms();
    const cb_blend_stats_t *bs = &r->mt.bs;
    notify_note_t *nt = &r->note;
    snprintf(nt->id, sizeof nt->id, "%s", r->q->id);
    nt->n = 0;
    r->mt.corrupt = 0;
    for (int i = 0; i < r->n; i++) {
        uint8_t key[32];
        const cb_blend_chunk_info_t *c = i < bs->n_chunks_read ? &bs->chunks[i] : NULL;
        if (c) memcpy(key, c->key, 32);
        else cb_kvstore_chunk_key(g->store, g->prefix, g->n_prefix, r->ctoks[i], r->cn[i], key);
        cb_kvfile_hex(key, r->hex[i]);
        if (!c) continue; /* the mode did not read it: nothing to tell */
        bool seen = false;
        for (int j = 0; j < nt->n && !seen; j++) seen = memcmp(nt->chunks[j].key, key, 32) == 0;
        if (seen) continue;
        r->mt.corrupt += rejected(c);
        if (c->src == CB_KVSTORE_COMPUTED) disk_note(g, c->stored, r->cn[i]);
        if (c->src == CB_KVSTORE_COMPUTED && !c->stored) continue; /* no file was written: nothing to put */
        notify_chunk_t *nc = &nt->chunks[nt->n++];
        memcpy(nc->key, key, 32);
        nc->tokens = r->cn[i];
        nc->kind = c->src == CB_KVSTORE_COMPUTED ? NOTIFY_PUT : NOTIFY_TOUCH;
    }
    if (r->mt.corrupt > 0)
        cb_log(CB_LOG_WARN, r->q->id, "%d chunk file(s) rejected (corrupt or stale): recomputed and rewritten",
               r->mt.corrupt);
    r->mt.lookup_ms = cb_now_ms() - t;
}

/* Hands the query's notice to the notifier (once; never blocks). */
static void notify_index(gen_t *g, query_t *r) {
    if (r->noticed || !r->prefilled) return;
    r->noticed = true;
    chunk_note(g, r);
    if (r->note.n == 0) return;
    if (!notify_post(g->notifier, &r->note)) {
        atomic_fetch_add(&g->a->stats->index_dropped, 1);
        cb_log(CB_LOG_WARN, r->q->id, "cache index notice dropped (the notifier is behind)");
    }
}

/* Appends a piece of the answer to r->text. 0, or -1 when out of memory. */
static int append_text(query_t *r, const char *piece, size_t pl) {
    if (r->text_len + pl + 1 > r->text_cap) {
        size_t cap = r->text_cap ? r->text_cap * 2 : 1024;
        while (cap < r->text_len + pl + 1) cap *= 2;
        char *t2 = cb_realloc(r->text, cap);
        if (!t2) return -1;
        r->text = t2;
        r->text_cap = cap;
    }
    memcpy(r->text + r->text_len, piece, pl);
    r->text_len += pl;
    r->text[r->text_len] = 0;
    return 0;
}

/* 5. Stop sequences, on the answer's (valid UTF-8) text. No stop sequence can start before r->sent
 * (each position there was found to mismatch every one of them), so only text[sent..text_len) is
 * searched. Returns true when a whole stop sequence is there, *at = where the earliest starts (the answer
 * is cut there); otherwise false and *at = the start of the earliest tail that is a proper prefix of some
 * stop sequence (text_len when none): the bytes before it are final and may be sent, the tail is held
 * back until more text resolves it. Each stop sequence is valid UTF-8, so *at is a character boundary.
 * O((text_len - sent) * n_stop * CB_QUERY_MAX_STOP_BYTES) at most; nothing is allocated. */
static bool stop_scan(const query_t *r, size_t *at) {
    const gen_query_t *q = r->q;
    size_t hold = r->text_len;
    for (size_t p = r->sent; q->n_stop > 0 && p < r->text_len; p++) {
        const size_t left = r->text_len - p;
        for (int i = 0; i < q->n_stop; i++) {
            const size_t n = q->stop_lens[i];
            if (left >= n) {
                if (memcmp(r->text + p, q->stop[i], n) == 0) {
                    *at = p;
                    return true;
                }
            } else if (hold == r->text_len && memcmp(r->text + p, q->stop[i], left) == 0) {
                hold = p; /* keep looking: a whole one may start later */
            }
        }
    }
    *at = hold;
    return false;
}

/* 6. The `done` message with the answer and the metrics (docs/protocol.md §7). 0, or -1 with err. */
static int send_done(gen_t *g, query_t *r, char *err, size_t errlen) {
    const gen_args_t *a = g->a;
    gen_query_t *q = r->q;
    chunk_note(g, r); /* done by the first token already, unless there was none */
    const qmetrics_t *mt = &r->mt;
    atomic_fetch_add(&a->stats->tokens_generated, (uint64_t)mt->n_gen);
    atomic_fetch_add(&a->stats->cache_hits, (uint64_t)mt->hits);
    atomic_fetch_add(&a->stats->cache_misses, (uint64_t)mt->misses);
    atomic_fetch_add(&a->stats->cache_corrupt, (uint64_t)mt->corrupt);
    atomic_fetch_add(&a->stats->queries_done, 1);
    cb_msg_writer_t *w = g->w;
    cb_msg_begin_reply_as(w, "done", q->id);
    cb_msg_put_strn(w, "text", r->text ? r->text : "", r->text_len);
    cb_msg_put_str(w, "finish_reason", r->finish ? r->finish : "length");
    cb_msg_begin_map(w, "metrics");
    const bool ratio_auto = q->opts.auto_target > 0.0f;
    cb_msg_put_str(w, "mode", cb_blend_mode_str(q->opts.mode));
    cb_msg_put_double(w, "ratio", ratio_auto ? (double)mt->bs.ratio_chosen : q->ratio); /* auto: what it chose */
    cb_msg_put_bool(w, "ratio_auto", ratio_auto);
    cb_msg_put_double(w, "ratio_chosen", (double)mt->bs.ratio_chosen);
    cb_msg_put_int(w, "n_candidates", mt->bs.n_candidates);
    cb_msg_put_double(w, "ttft_ms", mt->ttft_ms);
    cb_msg_put_double(w, "queue_ms", mt->queue_ms);
    cb_msg_put_double(w, "retrieve_ms", mt->retrieve_ms);
    cb_msg_put_double(w, "lookup_ms", mt->lookup_ms);
    cb_msg_put_double(w, "load_ms", mt->load_ms);
    cb_msg_put_double(w, "load_wait_ms", mt->bs.t_load_wait_ms);
    cb_msg_put_double(w, "resolve_ms", mt->bs.t_resolve_ms);
    cb_msg_put_double(w, "compute_ms", mt->bs.t_compute_ms);
    cb_msg_put_double(w, "blend_ms", mt->blend_ms);
    cb_msg_put_double(w, "decode_ms", mt->decode_ms);
    cb_msg_put_double(w, "total_ms", cb_now_ms() - q->t_recv_ms);
    cb_msg_put_int(w, "tokens_reused", mt->bs.tokens_reused);
    cb_msg_put_int(w, "tokens_recomputed", mt->bs.tokens_recomputed);
    cb_msg_put_int(w, "cache_hits", mt->hits);
    cb_msg_put_int(w, "cache_misses", mt->misses);
    cb_msg_put_int(w, "cache_corrupt", mt->corrupt);
    cb_msg_put_int(w, "n_chunks", mt->n_chunks);
    cb_msg_put_int(w, "n_prompt_tokens", mt->n_prompt);
    cb_msg_put_int(w, "n_generated", mt->n_gen);
    cb_msg_end_map(w);
    cb_msg_begin_array(w, "chunk_ids");
    for (int i = 0; i < r->n; i++) cb_msg_put_str(w, NULL, r->hex[i]);
    cb_msg_end_array(w);
    size_t len;
    const void *d = cb_msg_end(w, &len);
    if (!d) {
        snprintf(err, errlen, "cannot encode the done message: %s", cb_msg_writer_error(w));
        return -1;
    }
    cb_log(CB_LOG_INFO, q->id,
           "query %s r=%.2f: %d chunks (%d hits: %d memory, %d file; %d misses%s), %d prompt tokens (%d recomputed), "
           "ttft %.1f ms (queue %.1f, retrieve %.1f, files %.1f, blend %.1f: resolve %.1f, load %.1f), %d tokens in "
           "%.1f ms (%s)",
           cb_blend_mode_str(q->opts.mode), q->ratio, r->n, mt->hits, mt->bs.chunks_mem, mt->bs.chunks_file, mt->misses,
           mt->corrupt ? ", rejected files" : "", r->N, mt->bs.tokens_recomputed, mt->ttft_ms, mt->queue_ms,
           mt->retrieve_ms, mt->lookup_ms, mt->blend_ms, mt->bs.t_resolve_ms, mt->load_ms, mt->n_gen, mt->decode_ms,
           r->finish ? r->finish : "length");
    to_loop(g, "DONE", q, d, len);
    return 0;
}

/* ---- the step loop ---------------------------------------------------------------------------------- */

static bool slot_holds_blocks(const query_t *r) { return r->state == SLOT_PREFILL || r->state == SLOT_DECODE; }

/* The query leaves its slot: the cache index hears of its chunks (a prefilled query's chunks were used
 * even when its answer was not sent), its blocks go back to the pool (P's shared ones stay with the
 * store), what it owns is freed. */
static void slot_end(gen_t *g, query_t *r) {
    if (g->prefilling == r) {
        cb_blend_cancel(g->blend);
        g->prefilling = NULL;
    }
    notify_index(g, r);
    cb_seq_clear(r->seq);
    query_reset(r);
    g->pool_wait = false; /* blocks came back: a query waiting for them may try again */
}

/* (The cache-index notice is made before the "DONE": after it, the loop may free the query.) */
static void slot_fail(gen_t *g, query_t *r, cb_err_t code, const char *msg) {
    notify_index(g, r);
    send_error(g, r->q, code, msg);
    slot_end(g, r);
}

static void slot_cancelled(gen_t *g, query_t *r) {
    notify_index(g, r);
    atomic_fetch_add(&g->a->stats->queries_cancelled, 1);
    cb_log(CB_LOG_INFO, r->q->id, "query cancelled (the client went away) after %d tokens", r->mt.n_gen);
    to_loop(g, "DONE", r->q, NULL, 0);
    slot_end(g, r);
}

/* Streams the slot's last sampled token (r->tok); after the first, the cache index hears of the chunks.
 * The token's text joins the answer; what is final of it goes out as one `token` message: everything up
 * to a stop sequence that is now complete (the query then ends, the sequence and what follows dropped),
 * else everything but a tail that may still begin one (all of it at the last token). Returns true when
 * the query ended (its `done` sent, the slot free). */
static bool emit(gen_t *g, query_t *r) {
    gen_query_t *q = r->q;
    char piece[3 * (1024 + 4)];
    const int32_t tok = r->tok;
    bool eog = cb_model_is_eog(g->model, tok) || cb_tokenizer_is_eog(g->tok, tok);
    size_t blen = 0;
    const char *bytes = eog ? NULL : cb_tokenizer_token_bytes(g->tok, tok, false, &blen);
    if (blen > 1024) blen = 1024; /* vocabulary strings are short; bound the scratch anyway */
    if (!eog) {
        r->mt.n_gen++;
        cb_sampler_accept(r->sampler, tok); /* the penalties of the next tokens count it */
    }
    bool last = eog || r->mt.n_gen >= r->max_new;
    size_t pl = utf8_feed(&r->u, (const unsigned char *)(bytes ? bytes : ""), blen, last, piece);
    if (pl > 0 && append_text(r, piece, pl) != 0) {
        slot_fail(g, r, CB_ERR_INTERNAL, "out of memory");
        return true;
    }
    size_t upto;
    bool stopped = stop_scan(r, &upto);
    if (stopped) {
        r->text_len = upto; /* the stop sequence and what follows are not part of the answer */
        r->text[upto] = 0;
    } else if (last) {
        upto = r->text_len; /* a held tail that never became a stop sequence is answer text */
    }
    if (upto > r->sent) {
        cb_msg_begin_reply_as(g->w, "token", q->id);
        cb_msg_put_strn(g->w, "text", r->text + r->sent, upto - r->sent);
        cb_msg_put_int(g->w, "index", r->index++);
        size_t len;
        const void *d = cb_msg_end(g->w, &len);
        if (d) to_loop(g, "SEND", q, d, len);
        r->sent = upto;
    }
    notify_index(g, r); /* after the first token: a no-op from then on */
    if (!last && !stopped) return false;
    r->finish = eog || stopped ? "stop" : "length";
    r->mt.decode_ms = cb_now_ms() - r->t_dec0;
    char err[256];
    if (send_done(g, r, err, sizeof err) != 0) {
        slot_fail(g, r, CB_ERR_INTERNAL, err);
        return true;
    }
    slot_end(g, r);
    return true;
}

/* Queries whose client went away leave their slots (and blocks) now. */
static void reap_cancelled(gen_t *g) {
    for (int i = 0; i < g->n_slots; i++) {
        query_t *r = &g->slots[i];
        if (r->state != SLOT_FREE && atomic_load(&r->q->cancelled)) slot_cancelled(g, r);
    }
}

/* Free slots take queued queries in arrival order: their contexts and prompt pieces; the blend waits for
 * its turn. */
static void admit(gen_t *g) {
    int i = 0;
    while (zlist_size(g->fifo) > 0) {
        while (i < g->n_slots && g->slots[i].state != SLOT_FREE) i++;
        if (i == g->n_slots) return;
        query_t *r = &g->slots[i];
        gen_query_t *q = zlist_pop(g->fifo);
        if (atomic_load(&q->cancelled)) {
            atomic_fetch_add(&g->a->stats->queries_cancelled, 1);
            to_loop(g, "DONE", q, NULL, 0);
            continue;
        }
        to_loop(g, "START", q, NULL, 0);
        r->q = q;
        r->order = ++g->n_admitted;
        r->mt.queue_ms = cb_now_ms() - q->t_recv_ms;
        gather_contexts(r);
        char err[1024] = "";
        cb_err_t code = CB_ERR_INTERNAL;
        if (build_prompt(g, r, &code, err, sizeof err) != 0) {
            send_error(g, q, code, err);
            query_reset(r); /* the slot stays free */
            continue;
        }
        r->state = SLOT_WAITING;
    }
}

/* The first token of a prefilled query: its sampler, TTFT, the token streamed; it joins the batch. */
static void first_token(gen_t *g, query_t *r) {
    gen_query_t *q = r->q;
    gen_stats_t *s = g->a->stats;
    r->prefilled = true;
    r->mt.blend_ms = cb_now_ms() - r->t_blend0;
    r->mt.hits = r->mt.bs.chunks_mem + r->mt.bs.chunks_file;
    r->mt.misses = r->mt.bs.chunks_computed;
    r->mt.load_ms = r->mt.bs.t_load_ms;
    atomic_fetch_add(&s->prefill_tokens, (uint64_t)r->N);
    if (!(r->sampler = cb_sampler_new(&q->sampling, g->n_vocab))) {
        slot_fail(g, r, CB_ERR_INTERNAL, "cannot create the sampler");
        return;
    }
    r->t_dec0 = cb_now_ms();
    r->tok = cb_sampler_sample(r->sampler, g->logits);
    r->mt.ttft_ms = cb_now_ms() - q->t_recv_ms;
    r->state = SLOT_DECODE;
    emit(g, r);
}

/* One slice of the running blend, or the start of the oldest waiting query's. A query the KV pool cannot
 * hold now waits while others hold blocks (they return them as they end), and gets `overloaded` when
 * none does. */
static void prefill_slice(gen_t *g) {
    query_t *r = g->prefilling;
    char err[1024] = "";
    if (!r) {
        if (g->pool_wait) return;
        for (int i = 0; i < g->n_slots; i++) {
            query_t *c = &g->slots[i];
            if (c->state == SLOT_WAITING && (!r || c->order < r->order)) r = c;
        }
        if (!r) return;
        if (prefill_start(g, r, err, sizeof err) != 0) {
            slot_fail(g, r, CB_ERR_INTERNAL, err);
            return;
        }
        r->state = SLOT_PREFILL;
        g->prefilling = r;
    }
    double t = cb_now_ms();
    int st = cb_blend_step(g->blend, g->a->max_batch_tokens, &r->mt.bs, err, sizeof err);
    gen_stats_t *s = g->a->stats;
    atomic_fetch_add(&s->prefill_slices, 1);
    atomic_fetch_add(&s->prefill_us, (uint64_t)((cb_now_ms() - t) * 1000.0));
    if (st == CB_BLEND_MORE) return;
    g->prefilling = NULL; /* the call ended */
    if (st == CB_ENGINE_OK) {
        publish_pool(g);
        first_token(g, r);
        return;
    }
    if (st == CB_ENGINE_EPOOL) {
        bool others = false;
        for (int i = 0; i < g->n_slots; i++) others = others || (&g->slots[i] != r && slot_holds_blocks(&g->slots[i]));
        if (others) {
            r->state = SLOT_WAITING; /* first in line when blocks come back */
            g->pool_wait = true;
            return;
        }
        cb_engine_pool_stats_t ps;
        cb_engine_pool_stats(g->engine, &ps);
        snprintf(err, sizeof err, "the KV pool has no room for a %d-token prompt (%d blocks of %d tokens, %d free); "
                 "retry later", r->N, ps.n_blocks, ps.block_tokens, ps.blocks_free);
        slot_fail(g, r, CB_ERR_OVERLOADED, err);
        return;
    }
    slot_fail(g, r, CB_ERR_INTERNAL, err);
}

/* One decode step of every query in the batch: one cb_engine_decode_batch, then each samples with its own
 * sampler and streams. When the pool has no block for some row's next position, the newest query in the
 * batch ends with `overloaded` (its blocks freed) and the step runs again without it. */
static void decode_step(gen_t *g) {
    const gen_args_t *a = g->a;
    int n;
    int st;
    double t = cb_now_ms();
    for (;;) {
        n = 0;
        for (int i = 0; i < g->n_slots; i++) {
            query_t *r = &g->slots[i];
            if (r->state != SLOT_DECODE) continue;
            g->b_slot[n] = i;
            g->b_seq[n] = r->seq;
            g->b_tok[n] = r->tok;
            g->b_pos[n] = r->N + r->mt.n_gen - 1;
            n++;
        }
        if (n == 0) return;
        st = cb_engine_decode_batch(g->engine, g->b_seq, g->b_tok, g->b_pos, n, g->b_logits);
        if (st != CB_ENGINE_EPOOL) break;
        query_t *newest = NULL;
        for (int j = 0; j < n; j++) {
            query_t *r = &g->slots[g->b_slot[j]];
            if (!newest || r->order > newest->order) newest = r;
        }
        char err[256];
        snprintf(err, sizeof err, "the KV pool ran out of blocks at position %d (the newest of %d running queries "
                 "gives way); retry later", newest->N + newest->mt.n_gen, n);
        atomic_fetch_add(&a->stats->queries_preempted, 1);
        slot_fail(g, newest, CB_ERR_OVERLOADED, err);
    }
    gen_stats_t *s = a->stats;
    atomic_fetch_add(&s->decode_steps, 1);
    atomic_fetch_add(&s->decode_us, (uint64_t)((cb_now_ms() - t) * 1000.0));
    if (n > atomic_load(&s->batch_peak)) atomic_store(&s->batch_peak, n);
    if (st == CB_ENGINE_OK) atomic_fetch_add(&s->decode_tokens, (uint64_t)n);
    for (int j = 0; j < n; j++) {
        query_t *r = &g->slots[g->b_slot[j]];
        if (st != CB_ENGINE_OK) {
            char err[256];
            snprintf(err, sizeof err, "decode failed at position %d: %s", g->b_pos[j], cb_engine_status_str(st));
            slot_fail(g, r, CB_ERR_INTERNAL, err);
            continue;
        }
        r->tok = cb_sampler_sample(r->sampler, g->b_logits + (size_t)j * g->n_vocab);
        emit(g, r);
    }
}

/* A slot is taken or a query queued. */
static bool has_work(const gen_t *g) {
    if (zlist_size(g->fifo) > 0) return true;
    for (int i = 0; i < g->n_slots; i++)
        if (g->slots[i].state != SLOT_FREE) return true;
    return false;
}

/* The loop's view of the worker (stats, health). */
static void publish_loop(gen_t *g, bool busy) {
    gen_stats_t *s = g->a->stats;
    atomic_store(&s->busy, busy);
    atomic_store(&s->beat_ms, (uint64_t)cb_now_ms());
    atomic_store(&s->kv_write_failed, cb_kvstore_write_failures(g->store));
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
    cb_engine_pool_stats_t ps;
    cb_engine_pool_stats(g.engine, &ps);
    cb_log(CB_LOG_INFO, NULL,
           "worker ready: prompt prefix %d tokens, context %d, KV pool %d blocks of %d tokens (%zu bytes each) on %s, "
           "%d queries at once, prefill slices of %d tokens, kv_dir %s",
           g.n_prefix, cb_engine_max_ctx(g.engine), ps.n_blocks, ps.block_tokens, ps.block_bytes,
           cb_engine_backend_name(g.engine), g.n_slots, g.a->max_batch_tokens, g.a->kv_dir);
    uint8_t fp[32];
    char fp_hex[65];
    cb_model_fingerprint(g.model, fp);
    sodium_bin2hex(fp_hex, sizeof fp_hex, fp, sizeof fp);
    zstr_sendx(pipe, "READY", fp_hex, NULL); /* the model's fingerprint, for stats and ping */
    while (!g.term) {
        bool busy = has_work(&g);
        publish_loop(&g, busy); /* idle while it waits for a query */
        if (poll_pipe(&g, busy ? 0 : -1)) break;
        publish_loop(&g, has_work(&g)); /* the step starts */
        if (g.a->fault_step_delay_ms > 0 && has_work(&g)) zclock_sleep(g.a->fault_step_delay_ms); /* tests only */
        atomic_fetch_add(&g.a->stats->steps, 1);
        reap_cancelled(&g);
        admit(&g);
        prefill_slice(&g);
        decode_step(&g);
        publish_pool(&g);
    }
    for (int i = 0; i < g.n_slots; i++) {
        query_t *r = &g.slots[i];
        if (r->state == SLOT_FREE) continue;
        cb_log(CB_LOG_INFO, r->q->id, "query interrupted by shutdown after %d tokens", r->mt.n_gen);
        slot_end(&g, r);
    }
    publish_loop(&g, false);
    gen_free(&g);
}
