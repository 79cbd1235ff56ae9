/* fetch: cb-blend's retrieval thread, a zactor that asks cb-retriever for the top k chunks of every query
 * sent without contexts, so that the generation worker's step loop (gen.h) never waits on the network: a
 * slow or stopped cb-retriever delays only the queries that need it, never the streams already running.
 *
 * The loop sends it the queries whose `retrieve` is set and gets each one back, with the retrieved chunks
 * as its contexts (owned by the query, freed by gen_query_free) and retrieve_ms set, to queue for the
 * worker; or, when retrieval failed (cb-retriever down, timed out, an invalid reply), with the bytes of
 * the query's final `done` error to relay. One call at a time, in arrival order; a query cancelled
 * meanwhile goes back untouched (the worker drops it). The loop keeps ownership of every query, as with
 * the worker; the actor reads the query's fields and writes its contexts until it sends it back.
 *
 * Pipe protocol (zmsg frames):
 *   loop -> actor   "QUERY" <gen_query_t *>                        ($TERM ends the actor)
 *   actor -> loop   "READY"  |  "FATAL" <message>
 *                   "FETCHED" <q>                                  contexts filled: queue it for the worker
 *                   "FAILED" <q> <msgpack bytes>                   the query's `done` error, to relay
 */
#ifndef CB_FETCH_H
#define CB_FETCH_H

#include <czmq.h>
#include <stdatomic.h>

#include "gen.h"
#include "wire/config.h"

typedef struct {
    const cb_config_t *cfg;      /* borrowed: blend.retriever_endpoint and the bus options */
    int timeout_ms;              /* per attempt (one retry) */
    /* liveness, for the service's health (written here, read by the loop): busy while a retrieval is in
     * progress, beat_ms when it began or ended. Each retrieval is bounded (2 x timeout_ms), so a busy thread
     * silent for blend.stuck_ms is stuck. */
    atomic_bool busy;
    atomic_uint_fast64_t beat_ms;
} fetch_args_t;

/* zactor_new(fetch_actor, args): args (fetch_args_t *) must outlive the actor. */
void fetch_actor(zsock_t *pipe, void *args);

#endif
