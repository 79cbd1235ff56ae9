/* pool: cb-router's tables, without sockets: the workers it knows (their heartbeats: load, resident chunk
 * keys; liveness) and the requests in flight (who asked, which worker holds each, whether its answer has
 * started), and the routing policy that picks a worker for a request (docs/router.md).
 *
 * Both tables are fixed arrays allocated once by rt_pool_new (max_workers workers with up to max_resident
 * keys each, max_inflight requests): nothing here allocates afterwards except a request's body copy.
 * Lookups are linear scans: the tables are small (tens of workers, hundreds of requests), and a scan of
 * 256 ids costs less than decoding the message that asked for it.
 *
 * Policies (rt_pool_pick), over the live and ready workers that are not excluded:
 *   round_robin   the next one after the last pick;
 *   least_loaded  the fewest requests in flight from us (then the fewest waiting by its own report, then
 *                 round robin);
 *   cache         among the workers within max_imbalance in-flight requests of the least loaded one, the
 *                 one holding the most of the request's chunk keys in memory (its last heartbeat); ties
 *                 between holders go to the less loaded; when nobody holds any, rendezvous hashing on the
 *                 first key decides (so a chunk set goes to the same worker every time, and is found
 *                 there next time); without keys, least_loaded.
 *
 * Threads: one (cb-router's loop). Errors: rt_pool_new returns NULL when out of memory; adds return NULL
 * or -1 when a table is full.
 */
#ifndef CB_ROUTER_POOL_H
#define CB_ROUTER_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "wire/msg.h"
#include "wire/query.h"

#define RT_MAX_IDENT 255   /* a ZeroMQ routing id */

typedef enum { RT_POLICY_CACHE = 0, RT_POLICY_LEAST_LOADED, RT_POLICY_ROUND_ROBIN } rt_policy_t;
/* "cache", "least_loaded", "round_robin" -> 0, or -1. */
int rt_policy_parse(const char *s, rt_policy_t *out);
const char *rt_policy_name(rt_policy_t p);

typedef struct {
    bool used;
    bool ready;                     /* its last heartbeat said worker_ready */
    uint8_t ident[RT_MAX_IDENT];    /* routing id on the back ROUTER */
    size_t ident_len;
    char name[64];                  /* "<pid>" of its heartbeats, for logs and stats */
    double joined_ms, last_seen_ms;
    /* its own report (last heartbeat) */
    int running, waiting, capacity;
    uint64_t queries_done, queries_failed, cache_hits, cache_misses, hot_hits, hot_misses, tokens_generated;
    /* ours */
    int inflight;                   /* requests dispatched to it and not finished */
    uint64_t dispatched;            /* requests ever dispatched to it */
    int n_resident;
    uint8_t (*resident)[32];        /* [max_resident] chunk keys in its memory tier (its last heartbeat) */
} rt_worker_t;

typedef struct {
    bool used;
    uint8_t client[RT_MAX_IDENT];   /* the client's routing id on the front ROUTER */
    size_t client_len;
    char id[CB_MSG_MAX_ID + 1];     /* the request id */
    bool stream;                    /* a query: replies until `done` or an error; else one reply */
    int worker;                     /* index of the worker holding it, -1 while waiting for one */
    int excluded;                   /* a worker not to pick again (the one that died under it), or -1 */
    int attempts;                   /* dispatches so far */
    bool started;                   /* its first token has been relayed: never retried from here */
    bool searching;                 /* waiting for cb-retriever's chunk ids (cache policy) */
    uint64_t search_seq;            /* the id of that search */
    double t_recv_ms, t_search_ms, last_sent_ms;
    double t_wait_ms;               /* since when it has been waiting for a worker (arrival or retry) */
    int n_keys;
    uint8_t keys[CB_QUERY_MAX_CONTEXTS][32]; /* [n_keys] chunk keys for the cache policy: the request's contexts,
                                                or the chunks retrieved for it */
    void *body;                     /* a copy of the request (owned; freed once started or finished) */
    size_t body_len;
    void *user;                     /* the front's detached request (cb_bus_req_t *), owned by the caller */
} rt_flight_t;

typedef struct rt_pool rt_pool_t;

/* Tables for max_workers workers (each with up to max_resident keys) and max_inflight requests. Caller
 * owns; rt_pool_destroy. NULL when out of memory or a size is not positive. */
rt_pool_t *rt_pool_new(int max_workers, int max_inflight, int max_resident);
/* Frees the tables and every body copy (not the `user` pointers); nulls *self_p. NULL-safe. */
void rt_pool_destroy(rt_pool_t **self_p);

int rt_pool_max_workers(const rt_pool_t *self);
int rt_pool_max_inflight(const rt_pool_t *self);
int rt_pool_max_resident(const rt_pool_t *self);

/* ---- workers ---- */

/* The worker with that routing id, or -1. */
int rt_pool_worker_find(const rt_pool_t *self, const uint8_t *ident, size_t len);
/* The worker with that routing id, added when new (*added set); last_seen = now. -1 when the table is
 * full (or len is 0 or > RT_MAX_IDENT). */
int rt_pool_worker_seen(rt_pool_t *self, const uint8_t *ident, size_t len, double now, bool *added);
rt_worker_t *rt_pool_worker(rt_pool_t *self, int i); /* NULL when i is not a worker */
/* Replaces its resident keys (at most max_resident are kept: the first ones). */
void rt_pool_worker_set_resident(rt_pool_t *self, int i, const uint8_t (*keys)[32], int n);
/* Forgets worker i. Requests it holds must have been dealt with first (their `worker` is not changed). */
void rt_pool_worker_remove(rt_pool_t *self, int i);
/* The first worker silent for more than timeout_ms at now, or -1: call, deal with it, remove, repeat. */
int rt_pool_worker_expired(const rt_pool_t *self, double now, double timeout_ms);
/* Live workers, and how many of them are ready. */
int rt_pool_n_workers(const rt_pool_t *self, int *n_ready);
/* How many of keys[n] worker i holds in memory. */
int rt_pool_worker_score(const rt_pool_t *self, int i, const uint8_t (*keys)[32], int n);

/* A worker for a request with these chunk keys (n may be 0), never `exclude` (-1: none), among the
 * ready ones; -1 when there is none. Round robin advances its cursor. */
int rt_pool_pick(rt_pool_t *self, rt_policy_t policy, const uint8_t (*keys)[32], int n, int exclude,
                 int max_imbalance);

/* ---- requests in flight ---- */

/* A new entry (zeroed but for used = true, worker = excluded = -1), or NULL when max_inflight are in
 * flight. */
rt_flight_t *rt_pool_flight_add(rt_pool_t *self);
/* The request `id` of that client, or NULL. */
rt_flight_t *rt_pool_flight_find(rt_pool_t *self, const uint8_t *client, size_t len, const char *id);
/* The request waiting for search `seq`, or NULL. */
rt_flight_t *rt_pool_flight_find_search(rt_pool_t *self, uint64_t seq);
/* Entry i of the table (0 <= i < max_inflight), used or not: to iterate. */
rt_flight_t *rt_pool_flight_at(rt_pool_t *self, int i);
/* Assigns f to worker w (its inflight count +1, dispatched +1, f->attempts +1). */
void rt_pool_flight_assign(rt_pool_t *self, rt_flight_t *f, int w);
/* Takes f off its worker (inflight -1); f->worker = -1. */
void rt_pool_flight_unassign(rt_pool_t *self, rt_flight_t *f);
/* Unassigns, frees its body copy, frees the entry. */
void rt_pool_flight_remove(rt_pool_t *self, rt_flight_t *f);
/* Frees f's body copy (once its answer started, it is never sent again). */
void rt_pool_flight_drop_body(rt_flight_t *f);
/* Keeps a copy of the request's bytes in f, replacing the one it had. -1 when out of memory (f unchanged). */
int rt_pool_flight_set_body(rt_flight_t *f, const void *data, size_t len);
int rt_pool_n_inflight(const rt_pool_t *self);

#endif
