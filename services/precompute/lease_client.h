/* lease_client: the job source of a remote precompute worker (precompute.lease_from = the master's
 * endpoint; docs/leases.md). It has no job table of its own: it leases one job at a time from the master
 * cb-precompute (`lease`), keeps it in hand until it ends, and reports every step with the lease token:
 * `plan` (when the job had none), `replaced`, `renew` (before each chunk's text goes to cb-retriever),
 * `chunk_done`, `finish`, and `release` when it stops with the job unfinished. A renewer thread (a zactor
 * with its own connection to the master) renews the lease every lease_ms / 3 while a chunk computes, so a
 * long chunk never lets it lapse; when the master answers that the lease is gone (`not_found`: it expired
 * and another worker took the job, or the job ended), the next call of the worker says PC_SRC_STALE and
 * the worker drops the job.
 *
 * A master that does not answer (down, restarting, partitioned) is PC_SRC_RETRY (take: -1): the worker backs
 * off (1 s .. 30 s) and keeps the job; the link state, the last failure and the lease counts are in the
 * worker's stats (pc_worker_stats_t), which cb-precompute's stats and ping report.
 *
 * Every reply of the master is validated before use (sizes, hex ids, chunk spans inside the text), like any
 * wire input. With common.curve on, the master is reached as the `precompute` service (its public key from
 * keys_dir/public/precompute.key), this process connecting with the `precompute` client key pair.
 */
#ifndef PC_LEASE_CLIENT_H
#define PC_LEASE_CLIENT_H

#include <stddef.h>

#include "worker.h"

#define PC_LEASE_WORKER_MAX 64     /* bytes of a worker name on the wire: printable ASCII, no spaces */
#define PC_LEASE_MAX_CHUNKS 65536  /* chunks of one job in a lease reply or a plan */

/* The lease source for the worker thread: a client of a->lease_from (options from section precompute of
 * a->cfg) and its renewer thread. Fills *out (its destroy frees everything); 0, or -1 with err. Args and
 * a->stats are borrowed and must outlive the source. */
int pc_lease_source_new(const pc_worker_args_t *a, pc_source_t *out, char *err, size_t errlen);

/* True when name is a valid worker name (1..PC_LEASE_WORKER_MAX printable ASCII bytes, no spaces). */
bool pc_lease_worker_name_valid(const char *name, size_t len);

#endif
