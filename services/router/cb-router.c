/* cb-router: the load-balancing front of many cb-blend workers (docs/router.md).
 *
 * Two ROUTER sockets in one zloop: the front (router.endpoint; a cb_bus service, so clients talk to it
 * exactly as to cb-blend, and it answers `ping` and `stats` itself) and the back (router.workers_endpoint),
 * which cb-blend workers (blend.router) connect to. A worker says `worker_ready`, then heartbeats every
 * router.heartbeat_ms with its load and the chunk keys resident in its memory tier; the router heartbeats
 * every worker at the same interval. Paranoid Pirate: a worker silent for router.liveness intervals, or one
 * whose connection is gone (a send to it fails: ROUTER_MANDATORY), is taken out, and the requests it held:
 *   - a query whose first token had not been relayed is sent once more, to another worker (router.retry
 *     times at most; logged, counted as `retried`): the client saw only heartbeats, so nothing repeats;
 *   - a query whose answer had started ends with a `done` error (`unavailable`): it is never retried, since
 *     the client would see the first tokens twice;
 *   - other requests (cancel) end with an `unavailable` error.
 * A query waits in the router while no worker is ready, up to router.queue_timeout_ms, then ends with
 * `unavailable`; while it waits (or while its worker is silent) the router itself sends the client a
 * heartbeat every heartbeat_ms, so the client's silence rule never fires before the router has decided.
 * `cancel` {query_id} goes to the worker holding the query (or ends a waiting one here). A client that went
 * away (a relay fails) has its query cancelled at its worker.
 *
 * Routing (router.policy): cache (default), least_loaded or round_robin (pool.h). For `cache`, a query
 * without contexts is first looked up in cb-retriever (the same search cb-blend makes, bounded by
 * router.retriever_timeout_ms; when it fails or is late the query is routed by load), and the workers are
 * scored by how many of its chunk ids they hold in memory; the chunks found go to the worker with the
 * query (its `retrieved` and `retrieve_ms` fields, wire/query.h), so the worker does not search again. A
 * query with contexts is routed by rendezvous hashing of its contexts' texts, so the same contexts go to
 * the same worker.
 *
 *   cb-router [--config PATH] [--router.KEY=VALUE | --KEY VALUE]...
 *
 * It speaks as cb-blend on the wire: its socket options and its CURVE identity (common.curve on: both
 * sockets are CURVE servers with blend's server key; its search client uses blend's client key) are
 * blend's. Exit: 0 after SIGINT/SIGTERM, 1 on a startup failure.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "base/clock.h"
#include "base/alloc.h"
#include "base/log.h"
#include "format/kvfile.h"
#include "pool.h"
#include "wire/bus.h"
#include "wire/config.h"
#include "wire/msg.h"
#include "wire/query.h"

#define SECTION "router"
#define MAX_WORKERS 64

typedef struct {
    cb_bus_service_t *svc;     /* the front */
    zsock_t *back;             /* ROUTER: the workers */
    cb_bus_conn_t *retr;       /* DEALER to cb-retriever (policy cache), or NULL */
    rt_pool_t *pool;
    cb_msg_writer_t *w;        /* messages the router makes (the front's writer serves the handlers) */
    uint8_t (*tmp_keys)[32];   /* [max_resident]: a heartbeat's keys, parsed */
    /* configuration */
    rt_policy_t policy;
    int hb_ms, liveness, retry, max_imbalance, k_default;
    int queue_timeout_ms, retriever_timeout_ms;
    int64_t max_msg_bytes;
    double last_hb_ms;
    uint64_t seq;              /* ids of the router's own messages (searches, cancels) */
    /* counters (stats) */
    uint64_t queries, dispatched, retried, lost_started, unavailable, cancelled, clients_gone, overloaded;
    uint64_t workers_joined, workers_lost, searches, search_failed, search_late;
    uint64_t searches_carried;  /* searches whose chunks went to the worker with the query (not searched again) */
    uint64_t routed_with_keys, routed_to_holder; /* cache policy: queries with keys, sent to a worker holding one */
} router_t;

/* ---- sending --------------------------------------------------------------------------------------- */

/* [worker identity, (client identity,) body] on the back ROUTER, never blocking. 0, or -1 (errno in
 * zmq_errno: EHOSTUNREACH = that worker's connection is gone, EAGAIN = its pipe is full). */
static int to_worker(router_t *r, int wi, const uint8_t *client, size_t clen, const void *body, size_t len) {
    rt_worker_t *w = rt_pool_worker(r->pool, wi);
    if (!w) {
        errno = EHOSTUNREACH;
        return -1;
    }
    void *h = zsock_resolve(r->back);
    if (zmq_send(h, w->ident, w->ident_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) return -1;
    if (client && zmq_send(h, client, clen, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) return -1;
    return zmq_send(h, body, len, ZMQ_DONTWAIT) < 0 ? -1 : 0;
}

/* Asks worker wi to cancel the client's query qid (its reply is dropped: no request is in flight for it). */
static void cancel_at_worker(router_t *r, int wi, const uint8_t *client, size_t clen, const char *qid) {
    char id[32];
    snprintf(id, sizeof id, "rc%llu", (unsigned long long)++r->seq);
    cb_msg_begin(r->w, "cancel", id);
    cb_msg_put_str(r->w, "query_id", qid);
    size_t len;
    const void *d = cb_msg_end(r->w, &len);
    if (d) to_worker(r, wi, client, clen, d, len);
}

/* The request is over: its outcome logged by the front, its entry freed. */
static void finish(router_t *r, rt_flight_t *f) {
    cb_bus_req_t *req = f->user;
    cb_bus_req_destroy(&req);
    rt_pool_flight_remove(r->pool, f);
}

/* Ends f with an error of the router's own: a stream's last message is a `done` with the error, other
 * requests get an error reply of their type. */
static void fail(router_t *r, rt_flight_t *f, cb_err_t code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void fail(router_t *r, rt_flight_t *f, cb_err_t code, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    cb_bus_req_t *req = f->user;
    size_t len;
    const void *d = cb_msg_write_error(r->w, f->stream ? "done" : cb_bus_req_type(req), f->id, code, &len, "%s", msg);
    if (d) cb_bus_reply_bytes(req, d, len);
    cb_bus_req_note(req, code, msg);
    finish(r, f);
}

/* ---- routing ---------------------------------------------------------------------------------------- */

static void worker_lost(router_t *r, int wi, const char *why);

/* Sends f to the worker the policy picks; f stays waiting when no worker is ready or the chosen one's pipe
 * is full (the tick tries again). */
static void dispatch(router_t *r, rt_flight_t *f) {
    for (int tries = 0; tries < MAX_WORKERS && f->used && f->worker < 0; tries++) {
        int wi = rt_pool_pick(r->pool, r->policy, (const uint8_t(*)[32])f->keys, f->n_keys, f->excluded,
                              r->max_imbalance);
        if (wi < 0) return;
        if (to_worker(r, wi, f->client, f->client_len, f->body, f->body_len) == 0) {
            rt_worker_t *w = rt_pool_worker(r->pool, wi);
            if (f->n_keys > 0 && r->policy == RT_POLICY_CACHE && f->stream) {
                r->routed_with_keys++;
                r->routed_to_holder += rt_pool_worker_score(r->pool, wi, (const uint8_t(*)[32])f->keys, f->n_keys) > 0;
            }
            rt_pool_flight_assign(r->pool, f, wi);
            r->dispatched++;
            cb_log(CB_LOG_DEBUG, f->id, "to worker %s (%d in flight there)", w->name, w->inflight);
            return;
        }
        if (zmq_errno() != EHOSTUNREACH) return; /* a full pipe: later */
        worker_lost(r, wi, "its connection is gone");
    }
}

/* Takes worker wi out: the requests it held are retried (not started yet) or failed (started). */
static void worker_lost(router_t *r, int wi, const char *why) {
    rt_worker_t *w = rt_pool_worker(r->pool, wi);
    if (!w) return;
    char name[64];
    snprintf(name, sizeof name, "%s", w->name);
    cb_log(CB_LOG_WARN, NULL, "worker %s lost (%s) with %d requests in flight", name, why, w->inflight);
    r->workers_lost++;
    double now = cb_now_ms();
    for (int i = 0; i < rt_pool_max_inflight(r->pool); i++) {
        rt_flight_t *f = rt_pool_flight_at(r->pool, i);
        if (!f->used || f->worker != wi) continue;
        rt_pool_flight_unassign(r->pool, f);
        if (!f->stream) {
            fail(r, f, CB_ERR_UNAVAILABLE, "the cb-blend worker %s handling it was lost (%s)", name, why);
        } else if (!f->started && f->body && f->attempts <= r->retry) {
            f->excluded = wi;
            f->t_wait_ms = now;
            r->retried++;
            cb_log(CB_LOG_WARN, f->id, "worker %s died before the first token: retrying on another worker (attempt %d "
                   "of %d)", name, f->attempts + 1, r->retry + 1);
        } else {
            r->lost_started++;
            fail(r, f, CB_ERR_UNAVAILABLE, "the cb-blend worker %s died %s (%s); the query is not retried%s", name,
                 f->started ? "after the answer had started" : "before the first token", why,
                 f->started ? " (its first tokens would be sent twice)" : " again (router.retry)");
        }
    }
    rt_pool_worker_remove(r->pool, wi);
    for (int i = 0; i < rt_pool_max_inflight(r->pool); i++) {
        rt_flight_t *f = rt_pool_flight_at(r->pool, i);
        if (f->used && f->worker < 0 && !f->searching && f->excluded == wi) dispatch(r, f);
    }
}

/* Chunk keys of the contexts' texts (a query that carries contexts): only for rendezvous hashing, since
 * the workers' keys are of token ids the router does not have. */
static void context_keys(rt_flight_t *f, const cb_query_t *q) {
    for (int i = 0; i < q->n_contexts && f->n_keys < CB_QUERY_MAX_CONTEXTS; i++) {
        const char *s = q->contexts[i];
        size_t len = q->context_lens[i];
        XXH128_hash_t a = XXH3_128bits_withSeed(s, len, 1), b = XXH3_128bits_withSeed(s, len, 2);
        memcpy(f->keys[f->n_keys], &a, 16);
        memcpy(f->keys[f->n_keys] + 16, &b, 16);
        f->n_keys++;
    }
}

/* The k of a query: its own, else blend.k (the workers' default). */
static int query_k(const router_t *r, const cb_query_t *q) { return q->set & CB_QUERY_K ? q->k : r->k_default; }

/* Asks cb-retriever for the chunk ids of a query without contexts (policy cache), the search its worker
 * would make. False when it cannot even be sent. */
static bool start_search(router_t *r, rt_flight_t *f, const cb_query_t *q) {
    if (!r->retr) return false;
    char id[32];
    uint64_t seq = ++r->seq;
    snprintf(id, sizeof id, "s%llu", (unsigned long long)seq);
    cb_msg_begin(r->w, "search", id);
    cb_msg_put_strn(r->w, "query", q->question, q->question_len);
    cb_msg_put_int(r->w, "k", query_k(r, q));
    size_t len;
    const void *d = cb_msg_end(r->w, &len);
    r->searches++;
    if (!d || zmq_send(zsock_resolve(cb_bus_conn_sock(r->retr)), d, len, ZMQ_DONTWAIT) < 0) {
        r->search_failed++;
        return false;
    }
    f->searching = true;
    f->search_seq = seq;
    f->t_search_ms = cb_now_ms();
    return true;
}

/* ---- the front ------------------------------------------------------------------------------------- */

/* A new entry for req (copying the request's bytes), or NULL after replying with the reason. */
static rt_flight_t *track(router_t *r, cb_bus_req_t *req, bool stream) {
    size_t plen, blen;
    const uint8_t *peer = cb_bus_req_peer(req, &plen);
    const void *body = cb_bus_req_body(req, &blen);
    if (plen == 0 || plen > RT_MAX_IDENT || !body) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "cannot route a request without a routing id");
        return NULL;
    }
    if (rt_pool_flight_find(r->pool, peer, plen, cb_bus_req_id(req))) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "request id '%s' is already in flight from this client",
                           cb_bus_req_id(req));
        return NULL;
    }
    rt_flight_t *f = rt_pool_flight_add(r->pool);
    if (!f) {
        r->overloaded++;
        cb_bus_reply_error(req, CB_ERR_OVERLOADED, "%d requests in flight (router.max_inflight); retry later",
                           rt_pool_max_inflight(r->pool));
        return NULL;
    }
    memcpy(f->client, peer, plen);
    f->client_len = plen;
    snprintf(f->id, sizeof f->id, "%s", cb_bus_req_id(req));
    f->stream = stream;
    f->t_recv_ms = f->t_wait_ms = f->last_sent_ms = cb_now_ms();
    if (rt_pool_flight_set_body(f, body, blen) != 0 || !(f->user = cb_bus_req_detach(req))) {
        rt_pool_flight_remove(r->pool, f);
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "out of memory");
        return NULL;
    }
    return f;
}

static void on_query(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    (void)svc;
    router_t *r = arg;
    rt_flight_t *f = track(r, req, true);
    if (!f) return;
    r->queries++;
    cb_query_t q;
    char why[256];
    /* a bad query goes to a worker as it is: it answers with the precise error */
    if (r->policy == RT_POLICY_CACHE && cb_query_decode(m, &q, why, sizeof why)) {
        if (q.set & CB_QUERY_CONTEXTS) context_keys(f, &q);
        else if (!(q.set & CB_QUERY_RETRIEVED) && start_search(r, f, &q))
            return; /* dispatched when the chunk ids come (or are late) */
    }
    dispatch(r, f);
}

static void on_cancel(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    router_t *r = arg;
    char qid[CB_MSG_MAX_ID + 1];
    if (!cb_msg_str_copy(m, "query_id", CB_MSG_MAX_ID, qid, sizeof qid)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    size_t plen;
    const uint8_t *peer = cb_bus_req_peer(req, &plen);
    rt_flight_t *q = rt_pool_flight_find(r->pool, peer, plen, qid);
    if (q && q->stream && q->worker >= 0) { /* the worker holding it answers the cancel */
        int wi = q->worker;
        finish(r, q);
        r->cancelled++;
        rt_flight_t *c = track(r, req, false);
        if (!c) return;
        if (to_worker(r, wi, c->client, c->client_len, c->body, c->body_len) == 0) {
            rt_pool_flight_assign(r->pool, c, wi);
            return;
        }
        cb_bus_req_t *dr = c->user;
        rt_pool_flight_remove(r->pool, c); /* the worker is gone: the query is over anyway */
        cb_msg_writer_t *w = cb_bus_service_writer(svc);
        cb_msg_begin_reply_as(w, "cancel", cb_bus_req_id(dr));
        cb_msg_put_bool(w, "cancelled", true);
        cb_bus_reply(dr, w);
        cb_bus_req_destroy(&dr);
        return;
    }
    bool found = q && q->stream;
    if (found) { /* still here: waiting for a worker or for its chunk ids */
        r->cancelled++;
        finish(r, q);
    }
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_bool(w, "cancelled", found);
    cb_bus_reply(req, w);
}

/* ---- the back -------------------------------------------------------------------------------------- */

/* A worker's `worker_ready` / `worker_heartbeat`: its load, counters and resident keys. */
static void worker_beat(router_t *r, int wi, const cb_msg_t *m) {
    rt_worker_t *w = rt_pool_worker(r->pool, wi);
    int64_t v;
    bool ready = false;
    snprintf(w->name, sizeof w->name, "%s", cb_msg_id(m));
    if (cb_msg_bool_or(m, "worker_ready", false, &ready)) w->ready = ready;
#define GETI(field)                                                          \
    if (cb_msg_int_or(m, #field, 0, INT32_MAX, w->field, &v)) w->field = (int)v
    GETI(running);
    GETI(waiting);
    GETI(capacity);
#undef GETI
#define GETU(field)                                                               \
    if (cb_msg_int_or(m, #field, 0, INT64_MAX, (int64_t)w->field, &v)) w->field = (uint64_t)v
    GETU(queries_done);
    GETU(queries_failed);
    GETU(cache_hits);
    GETU(cache_misses);
    GETU(hot_hits);
    GETU(hot_misses);
    GETU(tokens_generated);
#undef GETU
    size_t n = 0;
    if (!cb_msg_has(m, "resident") || !cb_msg_array_len(m, "resident", SIZE_MAX, &n)) return;
    int max = rt_pool_max_resident(r->pool), got = 0;
    for (size_t i = 0; i < n && got < max; i++) {
        const char *hex;
        size_t hl;
        char buf[65];
        if (!cb_msg_at_hex(m, "resident", i, 64, 64, &hex, &hl)) continue;
        memcpy(buf, hex, 64);
        buf[64] = 0;
        if (cb_kvfile_unhex(buf, r->tmp_keys[got]) == 0) got++;
    }
    rt_pool_worker_set_resident(r->pool, wi, (const uint8_t(*)[32])r->tmp_keys, got);
}

/* A control frame from a worker (`worker_ready`, `worker_heartbeat`): it joins, or is alive. */
static void on_control(router_t *r, zframe_t *wid, zframe_t *body) {
    cb_msg_error_t e;
    cb_msg_t *m = cb_msg_decode_ex(zframe_data(body), zframe_size(body), (size_t)r->max_msg_bytes, &e);
    if (!m || !(cb_msg_is_type(m, "worker_ready") || cb_msg_is_type(m, "worker_heartbeat"))) {
        cb_log(CB_LOG_WARN, NULL, "dropped a control message from a worker: %s", m ? cb_msg_type(m) : e.message);
        cb_msg_destroy(&m);
        return;
    }
    bool added;
    int wi = rt_pool_worker_seen(r->pool, zframe_data(wid), zframe_size(wid), cb_now_ms(), &added);
    if (wi < 0) {
        cb_log(CB_LOG_WARN, NULL, "a worker (pid %s) cannot join: %d workers already", cb_msg_id(m), MAX_WORKERS);
        cb_msg_destroy(&m);
        return;
    }
    worker_beat(r, wi, m);
    if (added) {
        r->workers_joined++;
        for (int i = 0; i < rt_pool_max_inflight(r->pool); i++) { /* a slot reused: no stale exclusion */
            rt_flight_t *f = rt_pool_flight_at(r->pool, i);
            if (f->used && f->excluded == wi) f->excluded = -1;
        }
        rt_worker_t *w = rt_pool_worker(r->pool, wi);
        cb_log(CB_LOG_INFO, NULL, "worker %s joined (%s, capacity %d)", w->name, w->ready ? "ready" : "loading",
               w->capacity);
    }
    cb_msg_destroy(&m);
}

/* A worker's reply for a client: relayed, and the request's state advanced. */
static void on_reply(router_t *r, zframe_t *wid, zframe_t *client, zframe_t *body) {
    int wi = rt_pool_worker_find(r->pool, zframe_data(wid), zframe_size(wid));
    if (wi < 0) return; /* a worker taken out: what it held was retried or failed; it joins again by heartbeat */
    rt_worker_t *w = rt_pool_worker(r->pool, wi);
    double now = cb_now_ms();
    w->last_seen_ms = now;
    cb_msg_error_t e;
    cb_msg_t *m = cb_msg_decode_ex(zframe_data(body), zframe_size(body), (size_t)r->max_msg_bytes, &e);
    if (!m) {
        cb_log(CB_LOG_WARN, e.id[0] ? e.id : NULL, "dropped an invalid reply from worker %s: %s", w->name, e.message);
        return;
    }
    bool stream_msg = cb_msg_is_type(m, "token") || cb_msg_is_type(m, "heartbeat");
    rt_flight_t *f = rt_pool_flight_find(r->pool, zframe_data(client), zframe_size(client), cb_msg_id(m));
    if (!f || f->worker != wi) { /* an orphan: its client went away, cancelled it, or it was moved */
        if (stream_msg) cancel_at_worker(r, wi, zframe_data(client), zframe_size(client), cb_msg_id(m));
        cb_msg_destroy(&m);
        return;
    }
    bool ok = cb_msg_ok(m);
    if (!ok && cb_msg_err_code(m) == CB_ERR_OVERLOADED && f->stream && !f->started && f->attempts <= r->retry &&
        rt_pool_pick(r->pool, r->policy, (const uint8_t(*)[32])f->keys, f->n_keys, wi, 1 << 20) >= 0) {
        /* its queue is full but another worker may have room (the pick above moved the round-robin cursor) */
        rt_pool_flight_unassign(r->pool, f);
        f->excluded = wi;
        r->retried++;
        cb_log(CB_LOG_INFO, f->id, "worker %s is overloaded: trying another", w->name);
        cb_msg_destroy(&m);
        dispatch(r, f);
        return;
    }
    if (cb_msg_is_type(m, "token") && !f->started) {
        f->started = true;
        rt_pool_flight_drop_body(f); /* never sent again */
    }
    bool terminal = !ok || !f->stream || cb_msg_is_type(m, "done");
    if (cb_bus_reply_bytes(f->user, zframe_data(body), zframe_size(body)) != 0) {
        r->clients_gone++;
        if (!terminal) cancel_at_worker(r, wi, f->client, f->client_len, f->id);
        finish(r, f);
    } else {
        f->last_sent_ms = now;
        if (terminal) {
            if (!ok) cb_bus_req_note(f->user, cb_msg_err_code(m), cb_msg_err_message(m));
            finish(r, f);
        }
    }
    cb_msg_destroy(&m);
}

static int on_back(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    router_t *r = arg;
    zmsg_t *zm = zmsg_recv(sock);
    if (!zm) return zsys_interrupted ? -1 : 0;
    size_t nf = zmsg_size(zm);
    zframe_t *wid = zmsg_pop(zm), *a = zmsg_pop(zm), *b = zmsg_pop(zm);
    if (nf == 2 && a) on_control(r, wid, a);
    else if (nf == 3 && b && zframe_size(a) > 0 && zframe_size(a) <= RT_MAX_IDENT) on_reply(r, wid, a, b);
    else cb_log(CB_LOG_WARN, NULL, "dropped a message of %zu frames from a worker", nf);
    zframe_destroy(&wid);
    zframe_destroy(&a);
    zframe_destroy(&b);
    zmsg_destroy(&zm);
    return 0;
}

/* The search's hits into the query f carries, as its `retrieved` chunks and `retrieve_ms`, so that its
 * worker does not search again: the chunks the worker's own search (services/blend/fetch.c) would take,
 * every hit of at most k. Any hit the query cannot carry as it is leaves the query unchanged (the worker
 * then searches itself), as does a query grown past max_msg_bytes. */
static void carry_hits(router_t *r, rt_flight_t *f, const cb_msg_t *hits_msg, size_t n) {
    cb_msg_t *body = cb_msg_decode_ex(f->body, f->body_len, (size_t)r->max_msg_bytes, NULL);
    cb_query_t q;
    char why[256];
    if (!body || !cb_query_decode(body, &q, why, sizeof why) || n > (size_t)query_k(r, &q)) goto out;
    for (size_t i = 0; i < n; i++) {
        const cb_msg_t *h = cb_msg_at_map(hits_msg, "hits", i);
        if (!h || !cb_msg_hex(h, "chunk_id", CB_QUERY_CHUNK_ID_MIN, CB_QUERY_CHUNK_ID_MAX, &q.retrieved_ids[i],
                              &q.retrieved_id_lens[i]) ||
            !cb_msg_str(h, "text", CB_QUERY_MAX_CONTEXT_BYTES, &q.retrieved[i], &q.retrieved_lens[i]))
            goto out;
    }
    q.n_retrieved = (int)n;
    q.retrieve_ms = cb_now_ms() - f->t_search_ms;
    q.set |= CB_QUERY_RETRIEVED | CB_QUERY_RETRIEVE_MS;
    cb_query_encode(&q, f->id, r->w);
    size_t len;
    const void *d = cb_msg_end(r->w, &len);
    if (d && len <= (size_t)r->max_msg_bytes && rt_pool_flight_set_body(f, d, len) == 0) r->searches_carried++;
out:
    cb_msg_destroy(&body);
}

/* cb-retriever's answer to a search: the query's chunk ids (and chunks, carried to the worker), then the
 * query goes to a worker. */
static int on_retriever(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    router_t *r = arg;
    zmsg_t *zm = zmsg_recv(sock);
    if (!zm) return zsys_interrupted ? -1 : 0;
    zframe_t *last = zmsg_last(zm);
    cb_msg_t *m = last ? cb_msg_decode_ex(zframe_data(last), zframe_size(last), (size_t)r->max_msg_bytes, NULL) : NULL;
    zmsg_destroy(&zm);
    const char *id = m ? cb_msg_id(m) : "";
    char *end;
    uint64_t seq = id[0] == 's' ? strtoull(id + 1, &end, 10) : 0;
    rt_flight_t *f = seq ? rt_pool_flight_find_search(r->pool, seq) : NULL;
    if (!f) { /* late (already routed by load) or not ours */
        cb_msg_destroy(&m);
        return 0;
    }
    f->searching = false;
    size_t n = 0;
    if (cb_msg_ok(m) && cb_msg_array_len(m, "hits", SIZE_MAX, &n)) {
        for (size_t i = 0; i < n && f->n_keys < CB_QUERY_MAX_CONTEXTS; i++) {
            const cb_msg_t *h = cb_msg_at_map(m, "hits", i);
            const char *hex;
            size_t hl;
            char buf[65];
            if (!h || !cb_msg_hex(h, "chunk_id", 64, 64, &hex, &hl)) continue;
            memcpy(buf, hex, 64);
            buf[64] = 0;
            if (cb_kvfile_unhex(buf, f->keys[f->n_keys]) == 0) f->n_keys++;
        }
        carry_hits(r, f, m, n);
    } else {
        r->search_failed++;
    }
    cb_msg_destroy(&m);
    dispatch(r, f);
    return 0;
}

/* ---- the clock ------------------------------------------------------------------------------------- */

/* Every 100 ms: heartbeats to the workers, dead workers out, late searches, waiting queries (dispatch or
 * `unavailable`), heartbeats to clients that have heard nothing for heartbeat_ms. */
static int on_tick(zloop_t *loop, int timer_id, void *arg) {
    (void)loop, (void)timer_id;
    router_t *r = arg;
    double now = cb_now_ms();
    if (now - r->last_hb_ms >= r->hb_ms) {
        r->last_hb_ms = now;
        cb_msg_begin(r->w, "router_heartbeat", "");
        size_t len;
        const void *d = cb_msg_end(r->w, &len);
        uint8_t beat[64]; /* a copy: worker_lost writes other messages with the writer */
        if (d && len <= sizeof beat) memcpy(beat, d, len);
        for (int i = 0; d && len <= sizeof beat && i < rt_pool_max_workers(r->pool); i++)
            if (rt_pool_worker(r->pool, i) && to_worker(r, i, NULL, 0, beat, len) != 0 && zmq_errno() == EHOSTUNREACH)
                worker_lost(r, i, "its connection is gone");
    }
    int wi;
    while ((wi = rt_pool_worker_expired(r->pool, now, (double)r->hb_ms * r->liveness)) >= 0) {
        char why[64];
        snprintf(why, sizeof why, "silent for %d heartbeats", r->liveness);
        worker_lost(r, wi, why);
    }
    int n_ready, n_workers = rt_pool_n_workers(r->pool, &n_ready);
    for (int i = 0; i < rt_pool_max_inflight(r->pool); i++) {
        rt_flight_t *f = rt_pool_flight_at(r->pool, i);
        if (!f->used) continue;
        if (f->searching && now - f->t_search_ms > r->retriever_timeout_ms) {
            f->searching = false;
            r->search_late++;
            dispatch(r, f);
        }
        if (f->used && f->worker < 0 && !f->searching) {
            dispatch(r, f);
            if (f->used && f->worker < 0 && now - f->t_wait_ms > r->queue_timeout_ms) {
                r->unavailable++;
                fail(r, f, CB_ERR_UNAVAILABLE, "no cb-blend worker could take the query within %d ms (%d connected, %d "
                     "ready; router.queue_timeout_ms)", r->queue_timeout_ms, n_workers, n_ready);
            }
        }
        if (f->used && f->stream && now - f->last_sent_ms >= r->hb_ms) {
            cb_msg_begin_reply_as(r->w, "heartbeat", f->id);
            cb_msg_put_str(r->w, "state", f->worker < 0 ? "queued" : f->started ? "running" : "dispatched");
            cb_msg_put_int(r->w, "position", 0);
            cb_msg_put_int(r->w, "interval_ms", r->hb_ms);
            cb_msg_put_bool(r->w, "router", true);
            size_t len;
            const void *d = cb_msg_end(r->w, &len);
            if (d && cb_bus_reply_bytes(f->user, d, len) != 0) {
                r->clients_gone++;
                if (f->worker >= 0) cancel_at_worker(r, f->worker, f->client, f->client_len, f->id);
                finish(r, f);
            } else {
                f->last_sent_ms = now;
            }
        }
    }
    return 0;
}

/* ---- ping, stats ----------------------------------------------------------------------------------- */

static const char *health(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg, char *why, size_t whylen) {
    (void)svc;
    router_t *r = arg;
    int n_ready, n = rt_pool_n_workers(r->pool, &n_ready);
    cb_msg_put_str(w, "role", "router");
    cb_msg_put_int(w, "workers", n);
    cb_msg_put_int(w, "workers_ready", n_ready);
    cb_msg_put_bool(w, "worker_ready", n_ready > 0);
    if (n_ready > 0) return NULL;
    snprintf(why, whylen, "no cb-blend worker is ready (%d connected to %s)", n, "router.workers_endpoint");
    return why;
}

static void stats(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg) {
    (void)svc;
    router_t *r = arg;
    int n_ready, n = rt_pool_n_workers(r->pool, &n_ready), waiting = 0;
    for (int i = 0; i < rt_pool_max_inflight(r->pool); i++) {
        rt_flight_t *f = rt_pool_flight_at(r->pool, i);
        waiting += f->used && f->worker < 0;
    }
    double now = cb_now_ms();
    cb_msg_put_str(w, "role", "router");
    cb_msg_put_str(w, "policy", rt_policy_name(r->policy));
    cb_msg_put_bool(w, "worker_ready", n_ready > 0);
    cb_msg_put_int(w, "workers", n);
    cb_msg_put_int(w, "workers_ready", n_ready);
    cb_msg_put_int(w, "inflight", rt_pool_n_inflight(r->pool));
    cb_msg_put_int(w, "waiting", waiting);
    cb_msg_put_int(w, "max_inflight", rt_pool_max_inflight(r->pool));
    cb_msg_put_uint(w, "queries", r->queries);
    cb_msg_put_uint(w, "dispatched", r->dispatched);
    cb_msg_put_uint(w, "retried", r->retried);
    cb_msg_put_uint(w, "failed_worker_lost", r->lost_started);
    cb_msg_put_uint(w, "unavailable", r->unavailable);
    cb_msg_put_uint(w, "overloaded", r->overloaded);
    cb_msg_put_uint(w, "cancelled", r->cancelled);
    cb_msg_put_uint(w, "clients_gone", r->clients_gone);
    cb_msg_put_uint(w, "workers_joined", r->workers_joined);
    cb_msg_put_uint(w, "workers_lost", r->workers_lost);
    cb_msg_put_uint(w, "searches", r->searches);
    cb_msg_put_uint(w, "searches_failed", r->search_failed);
    cb_msg_put_uint(w, "searches_late", r->search_late);
    cb_msg_put_uint(w, "searches_carried", r->searches_carried);
    cb_msg_put_uint(w, "routed_with_keys", r->routed_with_keys);
    cb_msg_put_uint(w, "routed_to_holder", r->routed_to_holder);
    /* the live workers' own counters, summed (a worker that leaves takes its share with it) */
    uint64_t done = 0, failed = 0, hits = 0, misses = 0, hot_hits = 0, hot_misses = 0, tokens = 0;
    for (int i = 0; i < rt_pool_max_workers(r->pool); i++) {
        rt_worker_t *wk = rt_pool_worker(r->pool, i);
        if (!wk) continue;
        done += wk->queries_done, failed += wk->queries_failed, hits += wk->cache_hits, misses += wk->cache_misses;
        hot_hits += wk->hot_hits, hot_misses += wk->hot_misses, tokens += wk->tokens_generated;
    }
    cb_msg_put_uint(w, "queries_done", done);
    cb_msg_put_uint(w, "queries_failed", failed);
    cb_msg_put_uint(w, "cache_hits", hits);
    cb_msg_put_uint(w, "cache_misses", misses);
    cb_msg_put_uint(w, "hot_hits", hot_hits);
    cb_msg_put_uint(w, "hot_misses", hot_misses);
    cb_msg_put_uint(w, "tokens_generated", tokens);
    cb_msg_begin_array(w, "worker_list");
    for (int i = 0; i < rt_pool_max_workers(r->pool); i++) {
        rt_worker_t *wk = rt_pool_worker(r->pool, i);
        if (!wk) continue;
        cb_msg_begin_map(w, NULL);
        cb_msg_put_str(w, "pid", wk->name);
        cb_msg_put_bool(w, "ready", wk->ready);
        cb_msg_put_int(w, "inflight", wk->inflight);
        cb_msg_put_int(w, "running", wk->running);
        cb_msg_put_int(w, "waiting", wk->waiting);
        cb_msg_put_int(w, "capacity", wk->capacity);
        cb_msg_put_uint(w, "dispatched", wk->dispatched);
        cb_msg_put_uint(w, "queries_done", wk->queries_done);
        cb_msg_put_uint(w, "hot_hits", wk->hot_hits);
        cb_msg_put_uint(w, "hot_misses", wk->hot_misses);
        cb_msg_put_int(w, "resident", wk->n_resident);
        cb_msg_put_double(w, "up_s", (now - wk->joined_ms) / 1000.0);
        cb_msg_put_double(w, "silent_ms", now - wk->last_seen_ms);
        cb_msg_end_map(w);
    }
    cb_msg_end_array(w);
}

/* ---- setup ----------------------------------------------------------------------------------------- */

static void usage(FILE *f) {
    fprintf(f, "usage: cb-router [--config PATH] [--router.KEY=VALUE | --KEY VALUE]...\n"
               "  The front of many cb-blend workers (docs/router.md): clients connect to router.endpoint as to\n"
               "  cb-blend; workers (blend.router) to router.workers_endpoint. Keys: endpoint, bind, workers_endpoint,\n"
               "  workers_bind, heartbeat_ms, liveness, policy (cache | least_loaded | round_robin), max_inflight,\n"
               "  retry, queue_timeout_ms, retriever_timeout_ms, cache_max_imbalance, resident_keys.\n"
               "  Environment CB_ROUTER_<KEY> overrides the file.\n");
}

/* Reads [router] into r; the endpoints into *front and *back. False with err. */
static bool configure(router_t *r, const cb_config_t *cfg, const char **front, const char **back, int *resident,
                      int *max_inflight, char *err, size_t errlen) {
    const char *ep, *bind, *wep, *wbind, *policy;
    int64_t hb, live, inflight, retry, qt, rt, imb, res, k;
    if (!cb_config_endpoint(cfg, SECTION, "endpoint", "tcp://127.0.0.1:5556", &ep, err, errlen) ||
        !cb_config_endpoint(cfg, SECTION, "bind", NULL, &bind, err, errlen) ||
        !cb_config_endpoint(cfg, SECTION, "workers_endpoint", "tcp://127.0.0.1:5557", &wep, err, errlen) ||
        !cb_config_endpoint(cfg, SECTION, "workers_bind", NULL, &wbind, err, errlen) ||
        !cb_config_int(cfg, SECTION, "heartbeat_ms", 10, 600000, 1000, &hb, err, errlen) ||
        !cb_config_int(cfg, SECTION, "liveness", 1, 100, 3, &live, err, errlen) ||
        !cb_config_str(cfg, SECTION, "policy", "cache", &policy, err, errlen) ||
        !cb_config_int(cfg, SECTION, "max_inflight", 1, 100000, 256, &inflight, err, errlen) ||
        !cb_config_int(cfg, SECTION, "retry", 0, 10, 1, &retry, err, errlen) ||
        !cb_config_int(cfg, SECTION, "queue_timeout_ms", 0, 3600000, 5000, &qt, err, errlen) ||
        !cb_config_int(cfg, SECTION, "retriever_timeout_ms", 1, 600000, 500, &rt, err, errlen) ||
        !cb_config_int(cfg, SECTION, "cache_max_imbalance", 0, 100000, 2, &imb, err, errlen) ||
        !cb_config_int(cfg, SECTION, "resident_keys", 0, 4096, 256, &res, err, errlen) ||
        !cb_config_int(cfg, "blend", "k", CB_QUERY_K_MIN, CB_QUERY_K_MAX, 3, &k, err, errlen))
        return false;
    if (rt_policy_parse(policy, &r->policy) != 0) {
        snprintf(err, errlen, "config router.policy = '%s': expected cache, least_loaded or round_robin", policy);
        return false;
    }
    *front = bind ? bind : ep;
    *back = wbind ? wbind : wep;
    r->hb_ms = (int)hb;
    r->liveness = (int)live;
    r->retry = (int)retry;
    r->queue_timeout_ms = (int)qt;
    r->retriever_timeout_ms = (int)rt;
    r->max_imbalance = (int)imb;
    r->k_default = (int)k;
    *resident = (int)res;
    *max_inflight = (int)inflight;
    return true;
}

int main(int argc, char **argv) {
    cb_bus_init("cb-router");
    int exit_code;
    cb_config_t *cfg = cb_bus_service_config(SECTION, &argc, argv, usage, &exit_code);
    if (!cfg) return exit_code;
    static router_t r;
    char err[1024];
    int rc = 1, resident = 0, max_inflight = 0;
    const char *front, *back, *lvl, *rep = NULL;
    cb_bus_opts_t o;
    if (!configure(&r, cfg, &front, &back, &resident, &max_inflight, err, sizeof err) ||
        !cb_bus_opts_from_config(cfg, "blend", &o, err, sizeof err) ||
        !cb_config_endpoint(cfg, "retriever", "endpoint", NULL, &rep, err, sizeof err)) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    if (!getenv("CB_LOG_LEVEL") && cb_config_str(cfg, SECTION, "log_level", "info", &lvl, err, sizeof err)) {
        static const char *names[] = {"debug", "info", "warn", "error"};
        for (int i = 0; i < 4; i++)
            if (strcmp(lvl, names[i]) == 0) cb_log_set_level((cb_log_level_t)i);
    }
    r.max_msg_bytes = o.max_msg_bytes;
    cb_config_log(cfg, SECTION);
    r.pool = rt_pool_new(MAX_WORKERS, max_inflight, resident);
    r.w = cb_msg_writer_new();
    r.tmp_keys = cb_calloc((size_t)(resident ? resident : 1), 32);
    if (!r.pool || !r.w || !r.tmp_keys) {
        cb_log(CB_LOG_ERROR, NULL, "out of memory");
        goto out;
    }
    if (!(r.svc = cb_bus_service_new("cb-router", front, &o, err, sizeof err)) ||
        !(r.back = cb_bus_socket(ZMQ_ROUTER, back, true, &o, err, sizeof err))) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    if (r.policy == RT_POLICY_CACHE && rep && !(r.retr = cb_bus_conn_new(ZMQ_DEALER, rep, &o, err, sizeof err)))
        cb_log(CB_LOG_WARN, NULL, "cache policy without chunk ids (cannot reach cb-retriever: %s)", err);
    zloop_t *loop = cb_bus_service_loop(r.svc);
    if (zloop_reader(loop, r.back, on_back, &r) != 0 ||
        (r.retr && zloop_reader(loop, cb_bus_conn_sock(r.retr), on_retriever, &r) != 0) ||
        zloop_timer(loop, 100, 0, on_tick, &r) < 0) {
        cb_log(CB_LOG_ERROR, NULL, "cannot register the router's sockets in the loop");
        goto out;
    }
    cb_bus_service_on(r.svc, "query", on_query, &r);
    cb_bus_service_on(r.svc, "cancel", on_cancel, &r);
    cb_bus_service_set_stats(r.svc, stats, &r);
    cb_bus_service_set_health(r.svc, health, &r);
    cb_log(CB_LOG_INFO, NULL, "workers connect to %s; policy %s, heartbeat %d ms x %d, retry %d, max_inflight %d",
           back, rt_policy_name(r.policy), r.hb_ms, r.liveness, r.retry, max_inflight);
    rc = cb_bus_service_run(r.svc) == 0 ? 0 : 1;
out:
    for (int i = 0; r.pool && i < rt_pool_max_inflight(r.pool); i++) {
        rt_flight_t *f = rt_pool_flight_at(r.pool, i);
        if (f->used) finish(&r, f);
    }
    if (r.svc && r.back) zloop_reader_end(cb_bus_service_loop(r.svc), r.back);
    if (r.svc && r.retr) zloop_reader_end(cb_bus_service_loop(r.svc), cb_bus_conn_sock(r.retr));
    cb_bus_conn_destroy(&r.retr);
    zsock_destroy(&r.back);
    cb_bus_service_destroy(&r.svc);
    rt_pool_destroy(&r.pool);
    cb_msg_writer_destroy(&r.w);
    free(r.tmp_keys);
    cb_config_destroy(&cfg);
    if (rc == 0) cb_log(CB_LOG_INFO, NULL, "bye");
    return rc;
}
