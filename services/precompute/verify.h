/* verify: cb-precompute's check of a document ingested again after its job was done, a zactor thread so
 * that the service's loop never waits on cb-retriever. A done job promises that its document is searchable
 * and its chunks cached; a `delete {doc_id}` at cb-retriever, a lost retriever database or KV files gone
 * from kv_dir break that promise without the job table knowing. So when the same document comes again, the
 * loop asks this thread, which
 *   - asks cb-retriever how many chunks the document holds (`count {doc_id}`), against the job's distinct
 *     chunk keys;
 *   - checks that every chunk's KV file is a regular file under kv_dir;
 * and answers `ok`, `missing` (with what is missing: the loop then queues the job again, which re-indexes
 * the chunks and recomputes the missing KV files) or `unknown` (cb-retriever did not answer within
 * timeout_ms: the document is taken as it is, a duplicate). One check at a time, in arrival order; each is
 * bounded by timeout_ms (one attempt) plus the file checks, and after a cb-retriever that did not answer
 * the next 5 s of checks do not ask it (a burst of re-ingests while it is down costs one timeout).
 *
 * A job done by a remote worker (docs/leases.md) has its KV files on that worker's host: then only the
 * retriever count is checked ("remote").
 *
 * Pipe protocol (zmsg frames):
 *   loop -> actor   "CHECK" <token: opaque bytes, echoed> <doc_id> <keys: n x 64 hex, concatenated> ["remote"]
 *                   ($TERM)
 *   actor -> loop   "CHECKED" <token> <"ok" | "missing" | "unknown"> <reason>
 * The args are borrowed and must outlive the actor.
 */
#ifndef PC_VERIFY_H
#define PC_VERIFY_H

#include <czmq.h>

#include "wire/config.h"

typedef struct {
    const cb_config_t *cfg;      /* borrowed: retriever.endpoint and the bus options (section precompute) */
    char kv_dir[4096];
    int timeout_ms;              /* the count request (one attempt) */
} pc_verify_args_t;

/* zactor_new(pc_verify_actor, args). */
void pc_verify_actor(zsock_t *pipe, void *args);

#endif
