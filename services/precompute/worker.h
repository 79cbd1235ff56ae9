/* worker: cb-precompute's job worker, a zactor thread that owns the engine and the chunk store. It takes
 * turns over the durable queue (jobs.h cb_jobs_pick: round robin across the clients that have work, each
 * turn one unit of that client's oldest job), so a big document of one client and the small ones of others
 * are interleaved chunk by chunk. The units of a job: chunk the document (chunker.h) and record the plan;
 * for a new version of a document, delete the old version's chunks at cb-retriever; then each chunk: its KV
 * after the precompute context (ragprompt.h prefix) with the store (kvstore.h cb_kvstore_ensure: a KV file
 * that verifies is kept, else a plain prefill of the chunk after P captures its K/V and writes the
 * content-addressed KV file; no blend is involved), registered with cb-cacheindex (`put`, only for a file
 * that is there), its text sent to cb-retriever (`index`), recorded as done; when no chunk is left, the job.
 * A restarted worker resumes unfinished jobs, skipping finished chunks; every step is idempotent, so a step
 * repeated after a crash changes nothing, and the turn order is rebuilt from the job table.
 *
 * Transient failures (a peer service down or slow) are retried with exponential back-off (1 s .. 30 s)
 * without failing the job; permanent ones (an error reply, a chunk longer than the context, a KV file that
 * cannot be written) fail the job with a message.
 *
 * Liveness: the worker publishes (pc_worker_stats_t) whether it has work and when it last made progress (a
 * turn began or ended, a back-off or idle wait), and what it is doing; the service's `ping` fails when it
 * has had work and no progress for precompute.stuck_ms (a chunk compute or a peer call that hangs).
 *
 * Pipe protocol (strings): loop -> worker "WORK" (a job was queued), "$TERM" (stop after the current
 * unit); worker -> loop "READY" (model loaded) or "FATAL" + message (the worker cannot run; the service
 * should exit), "JOB" + job id + state after each finished job.
 */
#ifndef PC_WORKER_H
#define PC_WORKER_H

#include <czmq.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "format/kvfile.h"
#include "kv/kvremote.h"
#include "wire/config.h"

/* What the worker tells the loop (stats, health): atomics it writes and the loop reads; `what` under mu. */
typedef struct {
    atomic_bool busy;                  /* it has work in hand */
    atomic_uint_fast64_t beat_ms;      /* cb_now_ms() at its last sign of progress */
    atomic_uint_fast64_t turns;        /* units of work done */
    atomic_uint_fast64_t kv_write_failed; /* KV files that could not be written (no put for them) */
    atomic_uint_fast64_t storage_retries; /* turns backed off because storage failed for now (a full disk) */
    pthread_mutex_t mu;
    char what[192];                    /* what it is doing now, for the health reason */
} pc_worker_stats_t;

typedef struct {
    const cb_config_t *cfg;      /* borrowed (read-only lookups are thread-safe); outlives the actor */
    char model_path[4096];
    char kv_dir[4096];           /* must exist */
    cb_kv_dtype_t kv_dtype;      /* the KV files' payload (kv_dtype: f16, bf16, f32 or q8_0) */
    char db_path[4096];
    char system_prompt[2048];
    int chunk_tokens;
    int threads;
    int retriever_timeout_ms;
    int cacheindex_timeout_ms;
    int fault_chunk_delay_ms;    /* fault injection (tests): each chunk first waits this long, without a sign of
                                    progress; 0 = off */
    pc_worker_stats_t *stats;    /* borrowed; mu initialized by the owner */
    cb_kvremote_t *remote;       /* borrowed, thread-safe: the shared tier on Redis (kvremote.h); NULL = off */
} pc_worker_args_t;

/* zactor_new(pc_worker_actor, args): args (pc_worker_args_t *) must outlive the actor. */
void pc_worker_actor(zsock_t *pipe, void *args);

#endif
