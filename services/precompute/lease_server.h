/* lease_server: the master's side of the lease protocol (docs/leases.md), on cb-precompute's own ROUTER:
 *
 *   lease      {worker}                          -> {none: true} | {job, token, lease_ms, doc_id, text, client,
 *                                                   planned, replaced, has_older, chunks_done,
 *                                                   off[], len[], tokens[], keys[], done[] (when planned)}
 *   renew      {job, token}                      -> {lease_ms}
 *   plan       {job, token, off[], len[], tokens[], keys[]} -> {chunks_total}
 *   replaced   {job, token}                      -> {}
 *   chunk_done {job, token, idx}                 -> {lease_ms}
 *   finish     {job, token, done, why?}          -> {already}   (done: true = done, false = failed)
 *   release    {job, token}                      -> {released}
 *
 * The job table (jobs.h) is the one source of truth: every call is one transaction there, and every call
 * made with a token checks it in that transaction. A token that is not the job's (the lease expired and
 * was granted again, or the job ended) is answered `not_found` ("the lease is gone"): the worker drops the
 * job. Grants take turns across clients (the same round robin as the service's own worker, with its own
 * cursor), skip jobs under a live lease and jobs with more than max_text_bytes of text, and give a worker at
 * most max_per_worker live leases (more: `overloaded`). Every field is validated before use.
 *
 * Runs on the service's loop thread (it uses the loop's cb_jobs_t connection, borrowed).
 */
#ifndef PC_LEASE_SERVER_H
#define PC_LEASE_SERVER_H

#include <stdint.h>

#include "jobs.h"
#include "wire/bus.h"

typedef struct {
    int64_t lease_ms;          /* a lease lasts this long after its grant or last renewal */
    int max_per_worker;        /* live leases one worker may hold (0 = no limit) */
    int64_t max_text_bytes;    /* the largest document a lease carries (bigger ones stay local) */
    int64_t max_doc_bytes;     /* precompute.max_doc_bytes: bounds the plan's spans */
} pc_lease_opts_t;

typedef struct pc_lease_server pc_lease_server_t;

/* Registers the lease messages on svc, over jobs (both borrowed; they must outlive the server). NULL + err. */
pc_lease_server_t *pc_lease_server_new(cb_bus_service_t *svc, cb_jobs_t *jobs, const pc_lease_opts_t *o, char *err,
                                       size_t errlen);
void pc_lease_server_destroy(pc_lease_server_t **self_p);

/* Adds the lease counters to an open `stats` map: leases_granted, leases_expired (grants of a job whose
 * lease had lapsed), leases_renewed, leases_stale (calls refused for a stale token), leases_released,
 * leases_finished, leases_live and leases_lapsed (now), lease_ms. */
void pc_lease_server_stats(pc_lease_server_t *self, cb_msg_writer_t *w);

#endif
