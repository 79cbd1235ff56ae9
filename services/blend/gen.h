/* gen: cb-blend's generation worker, a zactor thread that owns the engine (and its KV pool), the chunk
 * store, the blend, the running queries (blend.max_seqs slots, each with its own engine sequence and
 * sampler) and the cache-index notifier (notify.h), and serves them with
 * continuous batching: a step loop in which every step
 *   1. ends the queries whose client went away (their blocks go back to the pool now);
 *   2. admits queued queries (FIFO) into free slots: the prompt pieces (ragprompt.h) of their contexts
 *      (a query sent without contexts comes with cb-retriever's top k, from the fetch thread: fetch.h);
 *   3. runs one slice of the fused prefill of the oldest admitted query (cb_blend_step: about
 *      blend.max_batch_tokens tokens of prefill compute; a blend is one call in slices, its KV loads
 *      overlapped by the blend's loader thread, so a long blend delays the others' next token by one slice
 *      at most); when it ends, the query samples its first token and joins the batch;
 *   4. runs one decode step of every query in the batch as one cb_engine_decode_batch (one product per
 *      weight over all rows), each query sampling with its own sampler (its frequency and presence
 *      penalties count the query's own tokens) and streaming its text.
 * A query ends with finish_reason "stop" at an end-of-generation token or when its answer contains one
 * of its stop sequences (the sequence and what follows are never sent: text that could still become
 * one is held back until it is resolved), "length" at max_tokens or a full context; either way its slot
 * and blocks are free for the next.
 * Pool exhaustion: a query whose blend cannot get its blocks waits, first in line, while other queries
 * hold blocks, and ends with `overloaded` when none does (the pool cannot hold it); when a decode step
 * finds no block for some row's next position, the newest query of the batch ends with `overloaded` and
 * the step runs without it. Chunk KV comes from the store (kvstore.h: memory tier, then its KV file; a
 * chunk that is not there, or whose file fails any check, is computed and written). Nothing waits for
 * cb-cacheindex: once a query's first token has gone out, the notifier is told to `touch` the chunks read
 * and `put` the ones computed now. The step loop waits on no socket. Metrics: docs/protocol.md §7.
 *
 * Threads and ownership: the loop thread allocates a gen_query_t, sends its pointer to the actor
 * ("QUERY"), and keeps ownership: it frees the query only after the actor's "DONE" for it (or after the
 * actor is destroyed). The actor reads the query's fields (immutable once sent) and the atomic `cancelled`
 * flag, which the loop sets when the client is gone; a cancelled query leaves its slot at the next step.
 * The actor never touches a socket of the loop: stream messages go back over the pipe as bytes. The
 * counters (gen_stats_t) are atomics the actor writes and the loop reads.
 *
 * Pipe protocol (zmsg frames):
 *   loop -> actor   "QUERY" <gen_query_t *>                        ($TERM ends the actor)
 *   actor -> loop   "READY"  |  "FATAL" <message>
 *                   "START" <q>                                    the query left the queue (a slot took it)
 *                   "SEND" <q> <msgpack bytes>                     a `token` message to relay
 *                   "DONE" <q> <msgpack bytes, or empty if cancelled>  the final `done` message
 */
#ifndef CB_GEN_H
#define CB_GEN_H

#include <czmq.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "blend/blend.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "kv/kvmem.h"
#include "kv/kvremote.h"
#include "svc/session.h"
#include "wire/bus.h"
#include "wire/config.h"
#include "wire/diskhealth.h"
#include "wire/query.h"

typedef struct gen_query {
    /* set by the loop before "QUERY"; read-only afterwards */
    char id[CB_MSG_MAX_ID + 1];
    char *question;                          /* NUL-terminated */
    bool retrieve;                           /* neither `contexts` nor `retrieved`: cb-retriever's k chunks
                                                (fetch.h) */
    int n_contexts;
    char *contexts[CB_QUERY_MAX_CONTEXTS];        /* [n_contexts] each NUL-terminated (no NUL inside): the query's
                                                own, cb-router's (`retrieved`), or, when retrieve, filled by
                                                the fetch thread before "QUERY" */
    size_t context_lens[CB_QUERY_MAX_CONTEXTS];
    double retrieve_ms;                      /* set by the fetch thread, or cb-router's `retrieve_ms` */
    int k;
    cb_blend_opts_t opts;                    /* the service's blend options (blend.*), with the query's mode and
                                                ratio; ratio = "auto" when opts.auto_target > 0 */
    double ratio;                            /* the ratio as asked or configured (opts.ratio is its float), for
                                                the metrics */
    int max_tokens;
    cb_sampler_params_t sampling;            /* blend.temperature, top_p, seed and penalties, with the query's */
    int n_stop;                              /* stop sequences: the answer ends before the first one */
    char stop[CB_QUERY_MAX_STOP][CB_QUERY_MAX_STOP_BYTES + 1]; /* [n_stop] NUL-terminated UTF-8, no NUL inside */
    size_t stop_lens[CB_QUERY_MAX_STOP];          /* [n_stop] 1..CB_QUERY_MAX_STOP_BYTES */
    double t_recv_ms;                        /* cb_now_ms() when the loop received it */
    /* shared */
    atomic_bool cancelled;                   /* set by the loop: the client is gone */
    /* loop-only */
    cb_bus_req_t *req;
    bool started;
    double last_sent_ms;
    struct gen_query *next;
} gen_query_t;

void gen_query_free(gen_query_t **q_p);

/* Counters the actor updates and the loop reads (stats). */
typedef struct {
    atomic_uint_fast64_t queries_done, queries_failed, queries_cancelled;
    atomic_uint_fast64_t queries_overloaded; /* failed with `overloaded`: the KV pool had no room (also failed) */
    atomic_uint_fast64_t tokens_generated;
    atomic_uint_fast64_t cache_hits, cache_misses, cache_corrupt;
    atomic_uint_fast64_t index_unavailable;  /* touches/puts that could not reach cb-cacheindex */
    atomic_uint_fast64_t index_dropped;      /* cache-index notices dropped (the notifier's pipe was full) */
    atomic_uint_fast64_t kv_write_failed;    /* KV files of computed chunks that could not be written (no put) */
    /* the engine's KV pool (cb_engine_pool_stats), as of the worker's last update: after its start, after
     * each prefill and at the end of each query */
    atomic_int pool_blocks, pool_blocks_used, pool_blocks_free, pool_blocks_shared, pool_block_tokens;
    atomic_int pool_blocks_peak;             /* the most blocks used at any of those points */
    /* the step loop */
    atomic_bool busy;                        /* it has work (a slot taken or a query queued) */
    atomic_uint_fast64_t beat_ms;            /* cb_now_ms() at the top of its last step (or when it went idle) */
    atomic_uint_fast64_t steps;
    atomic_uint_fast64_t prefill_slices, prefill_us, prefill_tokens; /* blend slices, their time, prompts done */
    atomic_uint_fast64_t decode_steps, decode_us, decode_tokens;     /* batched decode steps, time, rows */
    atomic_int batch_peak;                   /* the largest decode batch */
    atomic_uint_fast64_t queries_preempted;  /* ended `overloaded` mid-answer: no block for the next token */
} gen_stats_t;

typedef struct {
    const cb_config_t *cfg;      /* borrowed; read-only lookups */
    cb_session_opts_t session;   /* the model, prompt, engine and tiers (svc/session.h; strings borrowed from cfg):
                                    session.kv_dir is kv_dir below, session.mem the in-memory tier and
                                    session.remote the shared tier on Redis (kvremote.h; NULL = off), both
                                    borrowed and thread-safe; kv_pool_seqs is the worker's (max_seqs + 1) */
    char kv_dir[4096];           /* must exist; KV files of session.kv_dtype for misses */
    int max_seqs;                /* queries running at once (slots), >= 1 */
    int max_batch_tokens;        /* prefill compute per step, in tokens (cb_blend_step's budget), >= 1 */
    int fault_step_delay_ms;     /* fault injection (tests): every busy step first sleeps this long; 0 = off */
    bool store_misses;           /* `put` computed chunks into cb-cacheindex */
    int cacheindex_timeout_ms;   /* per touch/put of the notifier (one attempt) */
    gen_stats_t *stats;          /* borrowed */
    cb_diskhealth_t *disk;       /* borrowed, thread-safe: told of KV files that could not be written for lack
                                  of room in kv_dir, and of those written (the service's ping); NULL = none */
} gen_args_t;

/* zactor_new(gen_actor, args): args (gen_args_t *) must outlive the actor. */
void gen_actor(zsock_t *pipe, void *args);

#endif
