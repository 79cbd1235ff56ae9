/* cb-blend: the query service. A ROUTER socket (or, with blend.router set, a DEALER connected to cb-router
 * as one of its workers: docs/router.md; the handlers are the same) takes `query` requests (docs/protocol.md §7); each is
 * validated here (sampling: temperature, top_p, seed, frequency/presence penalties; stop sequences), queued (FIFO, at most blend.max_queue waiting: beyond that `overloaded`), and answered
 * by the generation worker thread (gen.h) as a stream of `token` messages and a final `done` with metrics.
 * The loop relays the worker's messages, so it keeps answering `ping` and `stats` while a query runs, and
 * sends a `heartbeat` to every query that has heard nothing for blend.heartbeat_ms, so a client can tell
 * a slow answer from a dead service. A client that went away (a send fails: ROUTER_MANDATORY gives
 * EHOSTUNREACH, a full pipe EAGAIN after the send timeout) has its query cancelled: it never stalls the
 * others. A query the engine's KV pool (blend.kv_pool_bytes) cannot hold also ends with `overloaded` (in
 * its `done`), and the service goes on. `stats` adds the queue, the counters of gen.h and the KV pool.
 * `cancel` {query_id} stops a query of the same client. As a worker, each heartbeat to the router carries
 * the load (running, waiting, capacity) and the chunk keys of recent answers still in the memory tier.
 * `ping` says `degraded` while kv_dir's disk is full (diskhealth.h): the answers go on, computed chunks are
 * used from memory without their files.
 *
 *   cb-blend [--config PATH] [--blend.KEY=VALUE | --KEY VALUE]...
 *
 * Exit: 0 after SIGINT/SIGTERM, 1 on a startup failure or when the worker cannot run.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/alloc.h"
#include "engine/backend_select.h"
#include "blend/blend.h"
#include "engine/sampler.h"
#include "wire/bus.h"
#include "wire/config.h"
#include "wire/db.h"
#include "fetch.h"
#include "gen.h"
#include "kv/kvmem.h"
#include "svc/kvremote_config.h"
#include "svc/svcconfig.h"
#include "base/log.h"
#include "wire/msg.h"
#include "wire/query.h"

#define SECTION "blend"

typedef struct {
    cb_bus_service_t *svc;
    zactor_t *worker;
    zactor_t *fetcher;         /* retrieval for queries without contexts (fetch.h) */
    cb_kvmem_t *mem;
    cb_kvremote_t *remote;    /* the shared KV tier (common.kv_remote), or NULL */
    cb_diskhealth_t *disk;    /* kv_dir's disk, for ping: ok or degraded (diskhealth.h) */
    gen_stats_t stats;
    cb_svc_blend_config_t def; /* the service's defaults (blend.*, svcconfig.h): the blend options, k,
                                  max_tokens and sampling each query copies before its own fields */
    int64_t max_queue;
    int max_seqs;
    int64_t heartbeat_ms;
    int64_t stuck_ms;          /* health: a busy step loop (or retrieval) silent this long is stuck */
    fetch_args_t *fa;          /* the retrieval thread's args (its liveness) */
    gen_query_t *head, *tail;  /* in flight, arrival order */
    int n_inflight;
    uint64_t accepted, rejected;
    bool worker_ready, fatal;
    const char *model_path;    /* common.model (borrowed from the config) */
    char model_fp[65];         /* the loaded model's fingerprint (hex), "" until the worker is ready */
    /* worker mode (blend.router): the chunk keys of recent answers, the candidates for the resident keys
     * each heartbeat reports (those still in the memory tier); a ring of resident_max, oldest replaced */
    uint8_t (*recent)[32];
    int resident_max, n_recent, recent_next;
} blendsvc_t;

static int n_waiting(const blendsvc_t *b) {
    int n = 0;
    for (const gen_query_t *q = b->head; q; q = q->next) n += !q->started;
    return n;
}

static void list_remove(blendsvc_t *b, gen_query_t *q) {
    gen_query_t **pp = &b->head, *prev = NULL;
    while (*pp && *pp != q) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    if (!*pp) return;
    *pp = q->next;
    if (b->tail == q) b->tail = prev;
    b->n_inflight--;
}

/* Hands q (still ours) to the worker or the fetch thread: "QUERY" <q>. */
static void to_actor(zactor_t *a, gen_query_t *q) {
    zmsg_t *zm = zmsg_new();
    zmsg_addstr(zm, "QUERY");
    zmsg_addmem(zm, &q, sizeof q);
    zmsg_send(&zm, a);
}

/* Parses and validates a query (query.h) into a new gen_query_t: the service's defaults, then what the
 * query sets; NULL with a code and reason. */
static gen_query_t *parse_query(blendsvc_t *b, const cb_msg_t *m, cb_err_t *code, char *why, size_t whylen) {
    *code = CB_ERR_BAD_REQUEST;
    cb_query_t in;
    if (!cb_query_decode(m, &in, why, whylen)) return NULL;
    *code = CB_ERR_INTERNAL;
    gen_query_t *q = cb_calloc(1, sizeof *q);
    if (!q) goto oom;
    atomic_init(&q->cancelled, false);
    snprintf(q->id, sizeof q->id, "%s", cb_msg_id(m));
    if (!(q->question = cb_strndup(in.question, in.question_len))) goto oom;
    /* the contexts: the query's own, or those cb-router retrieved for it; neither: the fetch thread's */
    const bool routed = in.set & CB_QUERY_RETRIEVED;
    const char *const *texts = routed ? in.retrieved : in.contexts;
    const size_t *lens = routed ? in.retrieved_lens : in.context_lens;
    const int n = routed ? in.n_retrieved : in.n_contexts;
    q->retrieve = !routed && !(in.set & CB_QUERY_CONTEXTS);
    q->retrieve_ms = routed ? in.retrieve_ms : 0.0;
    for (int i = 0; i < n; i++) {
        if (!(q->contexts[i] = cb_strndup(texts[i], lens[i]))) goto oom;
        q->context_lens[i] = lens[i];
        q->n_contexts = i + 1;
    }
    const unsigned set = in.set;
    q->k = set & CB_QUERY_K ? in.k : b->def.k;
    q->max_tokens = set & CB_QUERY_MAX_TOKENS ? in.max_tokens : b->def.max_tokens;
    q->opts = b->def.blend;
    q->ratio = b->def.ratio;
    if (set & CB_QUERY_MODE) q->opts.mode = (cb_blend_mode_t)cb_blend_mode_parse(in.mode); /* validated */
    if ((set & CB_QUERY_RATIO) && in.ratio_auto) {
        q->opts.auto_target = b->def.auto_target;
    } else if (set & CB_QUERY_RATIO) {
        q->ratio = in.ratio;
        q->opts.ratio = (float)in.ratio;
        q->opts.auto_target = 0.0f;
    }
    cb_sampler_params_t *sp = &q->sampling;
    *sp = b->def.sampling;
    if (set & CB_QUERY_TEMPERATURE) sp->temperature = (float)in.temperature;
    if (set & CB_QUERY_TOP_P) sp->top_p = (float)in.top_p;
    if (set & CB_QUERY_SEED) sp->seed = (uint64_t)in.seed;
    if (set & CB_QUERY_FREQUENCY_PENALTY) sp->frequency_penalty = (float)in.frequency_penalty;
    if (set & CB_QUERY_PRESENCE_PENALTY) sp->presence_penalty = (float)in.presence_penalty;
    for (int i = 0; i < in.n_stop; i++) {
        memcpy(q->stop[i], in.stop[i], in.stop_lens[i]);
        q->stop[i][in.stop_lens[i]] = 0;
        q->stop_lens[i] = in.stop_lens[i];
    }
    q->n_stop = in.n_stop;
    q->t_recv_ms = cb_now_ms();
    return q;
oom:
    snprintf(why, whylen, "out of memory");
    gen_query_free(&q);
    return NULL;
}

static void on_query(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    (void)svc;
    blendsvc_t *b = arg;
    cb_err_t code;
    char why[512];
    gen_query_t *q = parse_query(b, m, &code, why, sizeof why);
    if (!q) {
        cb_bus_reply_error(req, code, "%s", why);
        return;
    }
    int waiting = n_waiting(b);
    if (waiting >= b->max_queue) {
        b->rejected++;
        gen_query_free(&q);
        cb_bus_reply_error(req, CB_ERR_OVERLOADED, "%d queries waiting (blend.max_queue = %lld); retry later", waiting,
                           (long long)b->max_queue);
        return;
    }
    if (!(q->req = cb_bus_req_detach(req))) {
        gen_query_free(&q);
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "out of memory");
        return;
    }
    q->last_sent_ms = q->t_recv_ms;
    if (b->tail) b->tail->next = q;
    else b->head = q;
    b->tail = q;
    b->n_inflight++;
    b->accepted++;
    to_actor(q->retrieve ? b->fetcher : b->worker, q); /* without contexts: retrieval first */
}

/* `cancel` {query_id}: the requester's own query of that id (same routing id: behind cb-router, the same
 * client) stops at the next step, and its stream ends without a `done`. Replies {cancelled: bool}. */
static void on_cancel(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    blendsvc_t *b = arg;
    const char *qid;
    size_t ql, pl;
    if (!cb_msg_str(m, "query_id", CB_MSG_MAX_ID, &qid, &ql)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    const uint8_t *peer = cb_bus_req_peer(req, &pl);
    bool found = false;
    for (gen_query_t *q = b->head; q && !found; q = q->next) {
        size_t ol;
        const uint8_t *owner = cb_bus_req_peer(q->req, &ol);
        if (strlen(q->id) != ql || memcmp(q->id, qid, ql) != 0 || ol != pl || memcmp(owner, peer, pl) != 0) continue;
        found = !atomic_exchange(&q->cancelled, true);
        if (found) cb_log(CB_LOG_INFO, q->id, "query cancelled by its client (%s)", q->started ? "running" : "queued");
    }
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_bool(w, "cancelled", found);
    cb_bus_reply(req, w);
}

/* Worker mode: the heartbeat's load and the chunk keys resident in the memory tier (docs/router.md). */
static void beat(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg) {
    (void)svc;
    blendsvc_t *b = arg;
    const gen_stats_t *s = &b->stats;
    int waiting = n_waiting(b);
    cb_kvmem_stats_t ms;
    cb_kvmem_stats(b->mem, &ms);
    cb_msg_put_bool(w, "worker_ready", b->worker_ready);
    cb_msg_put_int(w, "running", b->n_inflight - waiting);
    cb_msg_put_int(w, "waiting", waiting);
    cb_msg_put_int(w, "capacity", b->max_seqs);
    cb_msg_put_int(w, "max_queue", b->max_queue);
    cb_msg_put_str(w, "model_fingerprint", b->model_fp);
    cb_msg_put_uint(w, "queries", b->accepted);
    cb_msg_put_uint(w, "rejected", b->rejected);
    cb_msg_put_uint(w, "queries_done", atomic_load(&s->queries_done));
    cb_msg_put_uint(w, "queries_failed", atomic_load(&s->queries_failed));
    cb_msg_put_uint(w, "queries_cancelled", atomic_load(&s->queries_cancelled));
    cb_msg_put_uint(w, "tokens_generated", atomic_load(&s->tokens_generated));
    cb_msg_put_uint(w, "cache_hits", atomic_load(&s->cache_hits));
    cb_msg_put_uint(w, "cache_misses", atomic_load(&s->cache_misses));
    cb_msg_put_uint(w, "hot_hits", ms.hits);
    cb_msg_put_uint(w, "hot_misses", ms.misses);
    cb_msg_put_uint(w, "hot_entries", ms.entries);
    cb_msg_begin_array(w, "resident");
    for (int i = 0; i < b->n_recent; i++) {
        /* newest first: a router that keeps fewer keeps the hottest */
        int j = ((b->recent_next - 1 - i) % b->resident_max + b->resident_max) % b->resident_max;
        if (cb_kvmem_contains(b->mem, b->recent[j]) != 1) continue;
        char hex[CB_KV_HEX_BYTES];
        cb_msg_put_str(w, NULL, cb_kvfile_hex(b->recent[j], hex));
    }
    cb_msg_end_array(w);
}

/* Relays a stream message; a failed send cancels the query. */
static void relay(gen_query_t *q, const void *data, size_t len) {
    if (atomic_load(&q->cancelled)) return;
    if (cb_bus_reply_bytes(q->req, data, len) != 0) atomic_store(&q->cancelled, true);
    else q->last_sent_ms = cb_now_ms();
}

/* "FATAL" <message> from a thread the service cannot run without: log it and stop. Returns -1. */
static int thread_fatal(blendsvc_t *b, zmsg_t *zm, const char *who) {
    char *msg = zmsg_popstr(zm);
    cb_log(CB_LOG_ERROR, NULL, "the %s cannot run (%s): exiting", who, msg ? msg : "?");
    zstr_free(&msg);
    b->fatal = true;
    cb_bus_service_stop(b->svc);
    return -1;
}

/* The <gen_query_t *> frame of a thread's message, or NULL. */
static gen_query_t *pop_query(zmsg_t *zm) {
    zframe_t *f = zmsg_pop(zm);
    gen_query_t *q = NULL;
    if (f && zframe_size(f) == sizeof q) memcpy(&q, zframe_data(f), sizeof q);
    zframe_destroy(&f);
    return q;
}

/* Worker mode: the chunk keys of a `done` (its chunk_ids) into the ring of recent keys. */
static void note_chunks(blendsvc_t *b, const void *done, size_t len) {
    if (!b->recent || b->resident_max <= 0) return;
    cb_msg_t *m = cb_msg_decode_ex(done, len, len + 1, NULL);
    size_t n = 0;
    if (m && cb_msg_ok(m) && cb_msg_array_len(m, "chunk_ids", CB_QUERY_MAX_CONTEXTS, &n)) {
        for (size_t i = 0; i < n; i++) {
            const char *hex;
            size_t hl;
            uint8_t key[32];
            if (!cb_msg_at_hex(m, "chunk_ids", i, 64, 64, &hex, &hl)) continue;
            char buf[65];
            memcpy(buf, hex, 64);
            buf[64] = 0;
            if (cb_kvfile_unhex(buf, key) != 0) continue;
            bool seen = false;
            for (int j = 0; j < b->n_recent && !seen; j++) seen = memcmp(b->recent[j], key, 32) == 0;
            if (seen) continue;
            memcpy(b->recent[b->recent_next], key, 32);
            b->recent_next = (b->recent_next + 1) % b->resident_max;
            if (b->n_recent < b->resident_max) b->n_recent++;
        }
    }
    cb_msg_destroy(&m);
}

/* The query's last message (body: its `done`, or empty when cancelled) relayed; the query freed. */
static void end_query(blendsvc_t *b, gen_query_t *q, zframe_t *body) {
    if (body && zframe_size(body) > 0 && b->recent) note_chunks(b, zframe_data(body), zframe_size(body));
    if (body && zframe_size(body) > 0) relay(q, zframe_data(body), zframe_size(body));
    list_remove(b, q);
    cb_bus_req_destroy(&q->req);
    gen_query_free(&q);
}

static int on_worker(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    blendsvc_t *b = arg;
    zmsg_t *zm = zmsg_recv(sock);
    if (!zm) return zsys_interrupted ? -1 : 0;
    char *what = zmsg_popstr(zm);
    int rc = 0;
    if (!what) {
    } else if (strcmp(what, "READY") == 0) {
        char *fp = zmsg_popstr(zm);
        if (fp) snprintf(b->model_fp, sizeof b->model_fp, "%s", fp);
        zstr_free(&fp);
        b->worker_ready = true;
    } else if (strcmp(what, "FATAL") == 0) {
        rc = thread_fatal(b, zm, "worker");
    } else {
        gen_query_t *q = pop_query(zm);
        zframe_t *body = zmsg_pop(zm);
        if (q && strcmp(what, "START") == 0) q->started = true;
        else if (q && strcmp(what, "SEND") == 0 && body) relay(q, zframe_data(body), zframe_size(body));
        else if (q && strcmp(what, "DONE") == 0) end_query(b, q, body);
        zframe_destroy(&body);
    }
    zstr_free(&what);
    zmsg_destroy(&zm);
    return rc;
}

/* The fetch thread: a query with its retrieved contexts goes on to the worker; a failed one ends here. */
static int on_fetch(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    blendsvc_t *b = arg;
    zmsg_t *zm = zmsg_recv(sock);
    if (!zm) return zsys_interrupted ? -1 : 0;
    char *what = zmsg_popstr(zm);
    int rc = 0;
    if (what && strcmp(what, "FATAL") == 0) {
        rc = thread_fatal(b, zm, "retrieval thread");
    } else if (what && strcmp(what, "FETCHED") == 0) {
        gen_query_t *q = pop_query(zm);
        if (q) to_actor(b->worker, q);
    } else if (what && strcmp(what, "FAILED") == 0) {
        gen_query_t *q = pop_query(zm);
        zframe_t *body = zmsg_pop(zm);
        if (q) {
            atomic_fetch_add(&b->stats.queries_failed, 1);
            end_query(b, q, body);
        }
        zframe_destroy(&body);
    }
    zstr_free(&what);
    zmsg_destroy(&zm);
    return rc;
}

/* Every query silent for heartbeat_ms gets {type: heartbeat, state, position}. */
static int on_heartbeat(zloop_t *loop, int timer_id, void *arg) {
    (void)loop;
    (void)timer_id;
    blendsvc_t *b = arg;
    double now = cb_now_ms();
    cb_msg_writer_t *w = cb_bus_service_writer(b->svc);
    int position = 0;
    for (gen_query_t *q = b->head; q; q = q->next) {
        int pos = q->started ? 0 : ++position;
        if (atomic_load(&q->cancelled) || now - q->last_sent_ms < (double)b->heartbeat_ms) continue;
        cb_msg_begin_reply_as(w, "heartbeat", q->id);
        cb_msg_put_str(w, "state", q->started ? "running" : "queued");
        cb_msg_put_int(w, "position", pos);
        cb_msg_put_int(w, "interval_ms", b->heartbeat_ms);
        size_t len;
        const void *d = cb_msg_end(w, &len);
        if (d) relay(q, d, len);
        if (atomic_load(&q->cancelled))
            cb_log(CB_LOG_INFO, q->id, "the client went away: query cancelled");
    }
    return 0;
}

/* How long the busy step loop has been silent (0 when it is idle). */
static double step_age_ms(const blendsvc_t *b) {
    if (!atomic_load(&b->stats.busy)) return 0.0;
    double age = cb_now_ms() - (double)atomic_load(&b->stats.beat_ms);
    return age > 0.0 ? age : 0.0;
}

/* How long the retrieval thread has been in one search (0 when it is not in one). */
static double fetch_age_ms(const blendsvc_t *b) {
    if (!b->fa || !atomic_load(&b->fa->busy)) return 0.0;
    double age = cb_now_ms() - (double)atomic_load(&b->fa->beat_ms);
    return age > 0.0 ? age : 0.0;
}

/* The served model: `model` (its file name), `model_path`, `model_fingerprint` (hex; "" until ready). */
static void put_model(const blendsvc_t *b, cb_msg_writer_t *w) {
    const char *slash = b->model_path ? strrchr(b->model_path, '/') : NULL;
    cb_msg_put_str(w, "model", slash ? slash + 1 : b->model_path ? b->model_path : "");
    cb_msg_put_str(w, "model_path", b->model_path ? b->model_path : "");
    cb_msg_put_str(w, "model_fingerprint", b->model_fp);
}

/* Health (`ping`): the worker is up and its step loop not stuck. */
static const char *health(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg, char *why, size_t whylen) {
    (void)svc;
    blendsvc_t *b = arg;
    double age = step_age_ms(b);
    cb_msg_put_bool(w, "worker_ready", b->worker_ready);
    cb_msg_put_double(w, "step_age_ms", age);
    put_model(b, w);
    if (!b->worker_ready) {
        snprintf(why, whylen, "the worker is not ready (loading the model)");
        return why;
    }
    if (age > (double)b->stuck_ms) {
        snprintf(why, whylen, "the step loop is stuck: no step for %.0f ms with %d queries in flight (blend.stuck_ms "
                 "= %lld)", age, b->n_inflight, (long long)b->stuck_ms);
        return why;
    }
    double fage = fetch_age_ms(b);
    cb_msg_put_double(w, "retrieval_age_ms", fage);
    if (fage > (double)b->stuck_ms) {
        snprintf(why, whylen, "the retrieval thread is stuck: one cb-retriever search for %.0f ms (blend.stuck_ms = "
                 "%lld)", fage, (long long)b->stuck_ms);
        return why;
    }
    return NULL;
}

static void stats_extra(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg) {
    (void)svc;
    blendsvc_t *b = arg;
    gen_stats_t *s = &b->stats;
    int waiting = n_waiting(b);
    put_model(b, w);
    cb_msg_put_uint(w, "queries", b->accepted);
    cb_msg_put_int(w, "queue", waiting);
    cb_msg_put_int(w, "running", b->n_inflight - waiting);
    cb_msg_put_uint(w, "rejected", b->rejected);
    cb_msg_put_uint(w, "queries_done", atomic_load(&s->queries_done));
    cb_msg_put_uint(w, "queries_failed", atomic_load(&s->queries_failed));
    cb_msg_put_uint(w, "queries_cancelled", atomic_load(&s->queries_cancelled));
    cb_msg_put_uint(w, "tokens_generated", atomic_load(&s->tokens_generated));
    cb_msg_put_uint(w, "cache_hits", atomic_load(&s->cache_hits));
    cb_msg_put_uint(w, "cache_misses", atomic_load(&s->cache_misses));
    cb_msg_put_uint(w, "cache_corrupt", atomic_load(&s->cache_corrupt));
    cb_msg_put_uint(w, "queries_overloaded", atomic_load(&s->queries_overloaded));
    cb_msg_put_uint(w, "cacheindex_unavailable", atomic_load(&s->index_unavailable));
    cb_msg_put_uint(w, "cacheindex_dropped", atomic_load(&s->index_dropped));
    cb_msg_put_uint(w, "kv_write_failed", atomic_load(&s->kv_write_failed));
    cb_msg_put_int(w, "pool_blocks_total", atomic_load(&s->pool_blocks));
    cb_msg_put_int(w, "pool_blocks_used", atomic_load(&s->pool_blocks_used));
    cb_msg_put_int(w, "pool_blocks_free", atomic_load(&s->pool_blocks_free));
    cb_msg_put_int(w, "pool_blocks_shared", atomic_load(&s->pool_blocks_shared));
    cb_msg_put_int(w, "pool_blocks_peak", atomic_load(&s->pool_blocks_peak));
    cb_msg_put_int(w, "pool_block_tokens", atomic_load(&s->pool_block_tokens));
    /* the step loop (gen.h) */
    uint64_t dsteps = atomic_load(&s->decode_steps), dtok = atomic_load(&s->decode_tokens);
    cb_msg_put_int(w, "waiting", waiting);
    cb_msg_put_int(w, "max_seqs", b->max_seqs);
    cb_msg_put_uint(w, "steps", atomic_load(&s->steps));
    cb_msg_put_uint(w, "prefill_slices", atomic_load(&s->prefill_slices));
    cb_msg_put_double(w, "prefill_ms", (double)atomic_load(&s->prefill_us) / 1000.0);
    cb_msg_put_uint(w, "prefill_tokens", atomic_load(&s->prefill_tokens));
    cb_msg_put_uint(w, "decode_steps", dsteps);
    cb_msg_put_uint(w, "decode_tokens", dtok);
    cb_msg_put_double(w, "decode_ms", (double)atomic_load(&s->decode_us) / 1000.0);
    cb_msg_put_double(w, "tokens_per_step", dsteps ? (double)dtok / (double)dsteps : 0.0);
    cb_msg_put_int(w, "batch_peak", atomic_load(&s->batch_peak));
    cb_msg_put_uint(w, "queries_preempted", atomic_load(&s->queries_preempted));
    cb_msg_put_double(w, "step_age_ms", step_age_ms(b));
    cb_kvmem_stats_t ms;
    cb_kvmem_stats(b->mem, &ms);
    cb_msg_put_uint(w, "hot_entries", ms.entries);
    cb_msg_put_uint(w, "hot_bytes", ms.bytes);
    cb_msg_put_uint(w, "hot_hits", ms.hits);
    cb_msg_put_uint(w, "hot_misses", ms.misses);
    cb_kvremote_put_stats(w, b->remote);
    cb_msg_put_bool(w, "worker_ready", b->worker_ready);
}

/* blend.ratio: a number in [0, 1], or "auto" (chosen per request from blend.auto_target/floor/ceil). */
static void usage(FILE *f) {
    fprintf(f, "usage: cb-blend [--config PATH] [--blend.KEY=VALUE | --KEY VALUE]...\n"
               "  Serves query/ping/stats (docs/protocol.md §7) on blend.endpoint. Keys: endpoint, bind, mode, ratio,\n"
               "  check_layer, metric, leading_tokens, k, max_tokens, temperature, top_p, seed, frequency_penalty,\n"
               "  presence_penalty, ctx_size, max_queue, max_seqs, max_batch_tokens, stuck_ms, fault_step_delay_ms (tests),\n"
               "  hot_cache_bytes, kv_pool_bytes, store_misses, system_prompt, heartbeat_ms, retriever_timeout_ms,\n"
               "  cacheindex_timeout_ms, router (worker of a cb-router), router_liveness, router_reconnect_max_ms,\n"
               "  router_resident_keys, common.* (data_dir, kv_dir, model, threads, min_free_mb, disk_full_hold_s, ...)\n"
               "  and engine.kv_dtype (f16|f32), engine.attn (auto|bf16|int16|f32).\n"
               "  Environment CB_BLEND_<KEY> overrides the file.\n");
}

int main(int argc, char **argv) {
    cb_bus_init("cb-blend");
    char err[1024];
    int exit_code;
    cb_config_t *cfg = cb_bus_service_config(SECTION, &argc, argv, usage, &exit_code);
    if (!cfg) return exit_code;
    static blendsvc_t b;
    static gen_args_t ga;
    int rc = 1;
    const char *backend;
    int64_t rt, ct, max_seqs, max_batch, fault_delay, resident;
    bool store;
    if (cb_svc_session_config(cfg, SECTION, &ga.session, err, sizeof err) != 0 ||
        cb_svc_blend_config(cfg, &b.def, &ga.session, err, sizeof err) != 0 ||
        !cb_config_int(cfg, SECTION, "max_queue", 0, 100000, 16, &b.max_queue, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "heartbeat_ms", 50, 600000, 1000, &b.heartbeat_ms, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "router_resident_keys", 0, 4096, 256, &resident, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_seqs", 1, 256, 16, &max_seqs, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_batch_tokens", 1, 1 << 20, 512, &max_batch, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "stuck_ms", 100, 3600000, 30000, &b.stuck_ms, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "fault_step_delay_ms", 0, 600000, 0, &fault_delay, err, sizeof err) ||
        !cb_config_str(cfg, SECTION, "backend", "auto", &backend, err, sizeof err) ||
        !cb_config_bool(cfg, SECTION, "store_misses", true, &store, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "retriever_timeout_ms", 1, 3600000, 5000, &rt, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "cacheindex_timeout_ms", 1, 3600000, 2000, &ct, err, sizeof err) ||
        !cb_config_data_path(cfg, SECTION, "kv_dir", "kv", ga.kv_dir, sizeof ga.kv_dir, err, sizeof err)) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    cb_backend_kind_t bk;
    if (!cb_backend_kind_parse(backend, &bk)) {
        cb_log(CB_LOG_ERROR, NULL, "config blend.backend = '%s': expected auto, cpu or cuda", backend);
        goto out;
    }
    cb_backend_set_default_kind(bk);
    ga.cfg = cfg;
    b.model_path = ga.session.model_path;
    ga.session.kv_dir = ga.kv_dir;
    ga.max_seqs = b.max_seqs = (int)max_seqs;
    ga.max_batch_tokens = (int)max_batch;
    ga.fault_step_delay_ms = (int)fault_delay;
    if (fault_delay > 0) cb_log(CB_LOG_WARN, NULL, "fault injection: every busy step sleeps %lld ms", (long long)fault_delay);
    ga.store_misses = store;
    static fetch_args_t fa;
    b.fa = &fa;
    fa.cfg = cfg;
    fa.timeout_ms = (int)rt;
    ga.cacheindex_timeout_ms = (int)ct;
    ga.stats = &b.stats;
    cb_config_log(cfg, SECTION);
    if (cb_db_mkdirs(ga.kv_dir, err, sizeof err) != 0 ||
        !(b.disk = cb_diskhealth_from_config(cfg, SECTION, err, sizeof err))) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    cb_diskhealth_watch(b.disk, "KV dir", ga.kv_dir);
    ga.disk = b.disk;
    if (!(b.mem = cb_kvmem_new(ga.session.mem_bytes))) {
        cb_log(CB_LOG_ERROR, NULL, "out of memory");
        goto out;
    }
    ga.session.mem = b.mem;
    if (cb_kvremote_from_config(cfg, SECTION, &b.remote, err, sizeof err) != 0) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    ga.session.remote = b.remote;
    b.svc = cb_bus_service_from_config("cb-blend", cfg, SECTION, err, sizeof err);
    if (!b.svc) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    if (!(b.worker = zactor_new(gen_actor, &ga))) {
        cb_log(CB_LOG_ERROR, NULL, "cannot start the worker thread");
        goto out;
    }
    if (!(b.fetcher = zactor_new(fetch_actor, &fa))) {
        cb_log(CB_LOG_ERROR, NULL, "cannot start the retrieval thread");
        goto out;
    }
    zloop_t *loop = cb_bus_service_loop(b.svc);
    zloop_reader(loop, (zsock_t *)b.worker, on_worker, &b);
    zloop_reader(loop, (zsock_t *)b.fetcher, on_fetch, &b);
    zloop_timer(loop, (size_t)(b.heartbeat_ms < 100 ? b.heartbeat_ms : 100), 0, on_heartbeat, &b);
    cb_bus_service_on(b.svc, "query", on_query, &b);
    cb_bus_service_on(b.svc, "cancel", on_cancel, &b);
    if (cb_bus_service_is_worker(b.svc)) {
        b.resident_max = (int)resident;
        if (resident > 0 && !(b.recent = cb_calloc((size_t)resident, 32))) {
            cb_log(CB_LOG_ERROR, NULL, "out of memory");
            goto out;
        }
        cb_bus_service_set_beat(b.svc, beat, &b);
    }
    cb_bus_service_set_stats(b.svc, stats_extra, &b);
    cb_bus_service_set_health(b.svc, health, &b);
    cb_bus_service_set_disk(b.svc, b.disk);
    rc = cb_bus_service_run(b.svc) == 0 && !b.fatal ? 0 : 1;
out:
    zactor_destroy(&b.fetcher); /* $TERM: it stops after the call in progress (SIGTERM interrupts that) */
    zactor_destroy(&b.worker);  /* $TERM: the worker stops at the next step */
    while (b.head) {
        gen_query_t *q = b.head;
        b.head = q->next;
        cb_bus_req_destroy(&q->req);
        gen_query_free(&q);
    }
    cb_bus_service_destroy(&b.svc);
    free(b.recent);
    cb_kvmem_destroy(&b.mem);
    cb_kvremote_destroy(&b.remote);
    cb_diskhealth_destroy(&b.disk); /* after the worker and the service, its users */
    cb_config_destroy(&cfg);
    if (rc == 0) cb_log(CB_LOG_INFO, NULL, "bye");
    return rc;
}
