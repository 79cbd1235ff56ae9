/* notify: cb-blend's cache-index notifier, a zactor thread that owns the cb-cacheindex client, so that no
 * cache-index round trip sits on a query's path to its first token or between its tokens.
 *
 * The KV of a query's chunks is found by the store itself (kvstore.h: memory tier, then the KV file, else
 * computed and written), so cb-cacheindex is only told afterwards what was used: once a query's first
 * token has gone out (or the query ended before that), the generation worker (gen.h) posts one notice
 * with the query's chunks, and this thread
 *   - sends one `touch` {keys, hit: true} for the chunks read from the memory tier or a KV file (LRU order
 *     and hit counts in cb-cacheindex);
 *   - `put`s each chunk computed now (its new KV file; as cb-precompute does), and each touched key the
 *     index does not know (the reply's `unknown`: e.g. a file written while cb-cacheindex was down) whose
 *     file exists, when puts are enabled (blend.store_misses).
 * All of it is best effort: one attempt per request, waiting at most cacheindex_timeout_ms; failures are
 * logged and counted (args->unavailable), never reported to the client.
 *
 * Threads and ownership: notify_post is called by the thread that owns the zactor (cb-blend's generation
 * worker) and never blocks: the notice is copied into one pipe message; when the pipe is full (cb-cacheindex
 * slow or down for long) the notice is dropped and notify_post says so. The args are borrowed and must
 * outlive the actor.
 *
 * Pipe protocol: owner -> actor  "NOTE" <notify_note_t bytes (header + n chunks)>, $TERM. Nothing goes the
 * other way after the zactor handshake. Shutdown: the owner sets args->stopping before destroying the actor,
 * so the notices still queued are dropped without a request each and $TERM is reached at once.
 */
#ifndef CB_NOTIFY_H
#define CB_NOTIFY_H

#include <czmq.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "format/kvfile.h"
#include "wire/bus.h"
#include "wire/msg.h"

#define NOTIFY_MAX_CHUNKS 32

typedef enum {
    NOTIFY_TOUCH = 0,  /* read from the memory tier or its KV file */
    NOTIFY_PUT         /* computed now: its KV file is new (or rewritten) */
} notify_kind_t;

typedef struct {
    uint8_t key[32];                 /* the chunk key (its file: cb_kvfile_rel_path under kv_dir) */
    int32_t tokens;                  /* chunk tokens */
    notify_kind_t kind;
} notify_chunk_t;

/* One query's notice. Only the first n chunks are sent over the pipe. */
typedef struct {
    char id[CB_MSG_MAX_ID + 1];      /* the query's id: log lines and the ids of the requests made for it */
    int n;                           /* 0..NOTIFY_MAX_CHUNKS */
    notify_chunk_t chunks[NOTIFY_MAX_CHUNKS];
} notify_note_t;

typedef struct {
    cb_bus_client_t *index;          /* the cb-cacheindex client, made by the owner; the actor takes it over */
    char kv_dir[4096];               /* rel paths are under it */
    char fp_hex[CB_KV_HEX_BYTES];    /* the model fingerprint, for `put` */
    int timeout_ms;                  /* per request (one attempt) */
    bool store;                      /* `put` computed and unknown chunks (blend.store_misses) */
    atomic_uint_fast64_t *unavailable; /* borrowed counter: requests cb-cacheindex did not answer */
    atomic_uint_fast64_t *dropped;   /* borrowed counter: notices dropped */
    atomic_bool stopping;            /* set by the owner before $TERM: queued notices are dropped */
} notify_args_t;

/* zactor_new(notify_actor, args): args (notify_args_t *) must outlive the actor; the actor owns and
 * destroys args->index from then on. */
void notify_actor(zsock_t *pipe, void *args);

/* Posts note (copied) to the actor without blocking. False when it could not be queued (pipe full, or
 * note->n out of range): the notice is dropped. */
bool notify_post(zactor_t *actor, const notify_note_t *note);

#endif
