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
 * Where jobs come from is one seam, pc_source_t (below): the service's job table (the local source: each
 * turn leases the round robin's next job as owner "local" and releases it when the turn ends, so remote
 * workers never get the job of a turn in progress) or a master cb-precompute (precompute.lease_from: the
 * lease client, lease.h, which keeps one leased job in hand until it is finished, reports each step and
 * renews the lease from a thread of its own while a chunk computes). The chunk code is the same for both.
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

#include "engine/engine.h"
#include "format/kvfile.h"
#include "jobs.h"
#include "kv/kvremote.h"
#include "svc/session.h"
#include "wire/config.h"
#include "wire/diskhealth.h"

/* What the worker tells the loop (stats, health): atomics it writes and the loop reads; `what` under mu. */
typedef struct {
    atomic_bool busy;                  /* it has work in hand */
    atomic_uint_fast64_t beat_ms;      /* cb_now_ms() at its last sign of progress */
    atomic_uint_fast64_t turns;        /* units of work done */
    atomic_uint_fast64_t kv_write_failed; /* KV files that could not be written (no put for them) */
    atomic_uint_fast64_t storage_retries; /* turns backed off because storage failed for now (a full disk) */
    /* remote role (lease_from): the master link and the leases */
    atomic_bool link_up;               /* the master answered the last request */
    atomic_uint_fast64_t leases_taken; /* jobs leased from the master */
    atomic_uint_fast64_t leases_lost;  /* jobs dropped because the master said the lease was gone */
    atomic_uint_fast64_t leases_held;  /* 0 or 1 */
    atomic_uint_fast64_t link_errors;  /* requests to the master that got no answer */
    pthread_mutex_t mu;
    char what[192];                    /* what it is doing now, for the health reason */
    char link_error[256];              /* the last master link failure ("" when none) */
} pc_worker_stats_t;

/* What a source call says: done; the lease is gone (drop the job, nothing of it is ours any more); failed
 * for now (the master or the table is unreachable: back off, keep the job, redo the turn); failed (the
 * job fails with err). */
typedef enum { PC_SRC_OK = 0, PC_SRC_STALE, PC_SRC_RETRY, PC_SRC_FAIL } pc_src_rc_t;

/* A job source: a table of functions over ctx (created and used on the worker thread only). Jobs given out
 * by take are owned by the worker (cb_job_free); every call names the job it is about. */
typedef struct {
    void *ctx;
    const char *name;   /* "local" | "lease" */
    bool keeps_job;     /* true: a taken job stays in hand across turns until it ends (released on $TERM);
                           false: take is asked every turn and release is called after each one */
    /* The next job to work on into *job (which may hold the last turn's job: kept when it is the same one,
     * else freed and replaced). 1 = *job set, 0 = nothing to do (*job freed), -1 = failed for now (err). */
    int (*take)(void *ctx, cb_job_t **job, char *err, size_t errlen);
    /* The first chunk not done: PC_SRC_OK with *idx >= 0 and c set, or *idx = -1 when all are done. */
    pc_src_rc_t (*next_chunk)(void *ctx, cb_job_t *job, int *idx, cb_job_chunk_t *c, char *err, size_t errlen);
    pc_src_rc_t (*plan)(void *ctx, cb_job_t *job, const cb_job_chunk_t *chunks, int n, char *err, size_t errlen);
    pc_src_rc_t (*replaced)(void *ctx, cb_job_t *job, char *err, size_t errlen);
    /* The lease still holds (renewed): asked before a chunk's text goes to cb-retriever. */
    pc_src_rc_t (*renew)(void *ctx, cb_job_t *job, char *err, size_t errlen);
    pc_src_rc_t (*chunk_done)(void *ctx, cb_job_t *job, int idx, char *err, size_t errlen);
    pc_src_rc_t (*finish)(void *ctx, cb_job_t *job, bool ok, const char *why, char *err, size_t errlen);
    /* Gives the job's lease up (best effort; the job stays with the caller, who frees it). */
    void (*release)(void *ctx, cb_job_t *job);
    void (*destroy)(void **ctx_p);
} pc_source_t;

typedef struct {
    const cb_config_t *cfg;      /* borrowed (read-only lookups are thread-safe); outlives the actor */
    cb_session_opts_t session;   /* the model, prompt, engine and store (svc/session.h; strings borrowed from cfg):
                                    session.kv_dir is kv_dir below, session.kv_dtype the KV files' payload,
                                    session.remote the shared tier on Redis (kvremote.h; borrowed, thread-safe;
                                    NULL = off); the worker sets the context (P + chunk_tokens + 16) */
    char kv_dir[4096];           /* must exist */
    char db_path[4096];          /* local source: the job table */
    char lease_from[256];        /* remote role: the master's endpoint ("" = the local source) */
    char worker_name[CB_JOB_OWNER_MAX - 1]; /* remote role: how the master knows this worker */
    int64_t local_lease_ms;      /* local source: a turn's lease (precompute.stuck_ms: a turn that long is stuck) */
    int64_t max_doc_bytes;       /* remote role: the largest text a lease reply may carry */
    int chunk_tokens;
    int retriever_timeout_ms;
    int cacheindex_timeout_ms;
    int fault_chunk_delay_ms;    /* fault injection (tests): each chunk first waits this long, without a sign of
                                    progress; 0 = off */
    pc_worker_stats_t *stats;    /* borrowed; mu initialized by the owner */
    cb_diskhealth_t *disk;       /* borrowed, thread-safe: told of KV file and job table writes that failed on a
                                    full disk and of those that succeeded (the service's ping); NULL = none */
} pc_worker_args_t;

/* zactor_new(pc_worker_actor, args): args (pc_worker_args_t *) must outlive the actor. */
void pc_worker_actor(zsock_t *pipe, void *args);

#endif
