/* gen: cb-blend's generation worker, a zactor thread that owns the engine, the blend and the clients of
 * cb-retriever and cb-cacheindex, and answers queries one at a time in arrival order (FIFO).
 *
 * For each query: retrieve the top k chunks when the query has no contexts; build the prompt pieces
 * (ragprompt.h); look the chunk keys up in cb-cacheindex; load each chunk the mode needs through the
 * memory tier, then its KV file (kvmem.h, kvfile.h via blend.h cb_blend_load_chunk); a chunk that is not
 * there, or whose file fails any check (a corrupted file is a miss), is computed, written and `put`; then
 * the fused prefill (cb_blend_prefill) and the decode loop, streaming each piece of text as it is made.
 * Metrics: docs/protocol.md §7.
 *
 * Threads and ownership: the loop thread allocates a gen_query_t, sends its pointer to the actor
 * ("QUERY"), and keeps ownership: it frees the query only after the actor's "DONE" for it (or after the
 * actor is destroyed). The actor reads the query's fields (immutable once sent) and the atomic `cancelled`
 * flag, which the loop sets when the client is gone; a cancelled query is skipped or stopped at the next
 * token. The actor never touches a socket of the loop: stream messages go back over the pipe as bytes.
 *
 * Pipe protocol (zmsg frames):
 *   loop -> actor   "QUERY" <gen_query_t *>                        ($TERM ends the actor)
 *   actor -> loop   "READY"  |  "FATAL" <message>
 *                   "START" <q>                                    the query left the queue
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
#include "wire/bus.h"
#include "wire/config.h"
#include "kv/kvmem.h"

#define GEN_MAX_CONTEXTS 32

typedef struct gen_query {
    /* set by the loop before "QUERY"; read-only afterwards */
    char id[CB_MSG_MAX_ID + 1];
    char *question;                          /* NUL-terminated */
    bool retrieve;                           /* no `contexts` field: ask cb-retriever for k chunks */
    int n_contexts;
    char *contexts[GEN_MAX_CONTEXTS];        /* [n_contexts] each NUL-terminated (no NUL inside) */
    size_t context_lens[GEN_MAX_CONTEXTS];
    int k;
    cb_blend_mode_t mode;
    double ratio;
    int max_tokens;
    double temperature, top_p;
    uint64_t seed;
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
    atomic_uint_fast64_t tokens_generated;
    atomic_uint_fast64_t cache_hits, cache_misses, cache_corrupt;
    atomic_uint_fast64_t index_unavailable;  /* lookups/puts that could not reach cb-cacheindex */
} gen_stats_t;

typedef struct {
    const cb_config_t *cfg;      /* borrowed; read-only lookups */
    char model_path[4096];
    char kv_dir[4096];           /* must exist */
    char system_prompt[2048];
    int ctx_size;
    int threads;
    int check_layer;
    char metric;                 /* 'a', 'k' or 'v' (blend.h) */
    int lead_tokens;
    bool store_misses;           /* `put` computed chunks into cb-cacheindex */
    int retriever_timeout_ms;
    int cacheindex_timeout_ms;
    cb_kvmem_t *mem;             /* borrowed, thread-safe: the in-memory tier */
    gen_stats_t *stats;          /* borrowed */
} gen_args_t;

/* zactor_new(gen_actor, args): args (gen_args_t *) must outlive the actor. */
void gen_actor(zsock_t *pipe, void *args);

#endif
