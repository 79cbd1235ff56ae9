/* jobs: cb-precompute's durable ingest queue, a SQLite database (WAL, synchronous=FULL) with one row per
 * accepted document (a job) and one row per planned chunk.
 *
 * A job's id is content-derived: the hex of BLAKE2b-128("cb-job-v1" || len(doc_id) as u32 LE || doc_id ||
 * text), so pushing the same doc_id with the same text again finds the same job (idempotent ingest).
 * cb_jobs_submit commits the row before it returns, and the caller acknowledges only after that: with
 * synchronous=FULL an acknowledged document survives a crash and a power loss.
 *
 * Job states: queued -> running (the worker picked it; its chunks get planned) -> done | failed. Chunk
 * rows carry a done flag so that a restarted worker resumes a job where it stopped (every step of a chunk
 * is idempotent: content-addressed KV file, idempotent put and index).
 *
 * Fairness: every job records the client that submitted it (a key chosen by the service, ident.h: the
 * authenticated CURVE key, or what an unauthenticated sender declares). The worker takes turns across
 * clients, not in arrival order (cb_jobs_pick: round robin in client-key order, each turn one unit of work
 * of that client's oldest job), so neither one client's big document nor its many small ones hold another
 * client's document back for longer than one unit each; the turn order is rebuilt from the table at any
 * time (nothing of it is kept elsewhere), so a restart keeps it. A job waits while an older unfinished job
 * of the same doc_id exists (versions of a document are processed in order).
 * Limits on what is queued (jobs and bytes), per client and over all clients, are checked in the
 * transaction that records a job.
 *
 * Leases (docs/leases.md): whoever works on a job holds a lease on it, recorded in the job's row (owner,
 * token, expiry in ms of this host's clock), so the lease and the progress live in one table and one
 * transaction: a lease survives a restart of the service, and a pick never returns a job under a live
 * lease. The service's own worker leases each turn (owner "local", released when the turn ends); remote
 * workers lease a whole job (owner "r:" + name) over the wire and renew it. A lease expires when its
 * expiry passes; the job is then pickable again and the next grant replaces the token, after which the old
 * holder's token is stale: every call made with a token checks it in the same transaction as its write.
 * An expired lease nobody took over still holds (a renew revives it). A finished job keeps its holder's
 * token, so a finish sent again by that holder is answered as already finished (finished once).
 *
 * Threads: one cb_jobs_t per thread (each owns its SQLite connection); several connections to the same
 * file (the service's loop and its worker) are fine, busy_timeout absorbs their write contention.
 */
#ifndef CB_JOBS_H
#define CB_JOBS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CB_JOB_ID_LEN 32     /* hex characters of a job id */
#define CB_JOB_CLIENT_MAX 80 /* bytes of a client key */
#define CB_JOB_TOKEN_LEN 32  /* hex characters of a lease token (128 random bits) */
#define CB_JOB_OWNER_MAX 80  /* bytes of a lease owner */

/* The lease owner of this process's own worker thread: its live leases never keep it from a job (a lease
 * it could not release, e.g. on a full disk, is its own); remote workers' owners are "r:" + name. */
#define CB_JOBS_LOCAL_OWNER "local"

typedef struct cb_jobs cb_jobs_t;

typedef enum { CB_JOB_QUEUED = 0, CB_JOB_RUNNING, CB_JOB_DONE, CB_JOB_FAILED, CB_JOB_STATE_COUNT_ } cb_job_state_t;
const char *cb_job_state_name(cb_job_state_t s); /* "queued" ... */

/* Opens (creating the file, its directories and the schema; adding the client columns to a table made by
 * an older version) the database at path. NULL + err. */
cb_jobs_t *cb_jobs_open(const char *path, char *err, size_t errlen);
void cb_jobs_close(cb_jobs_t **self_p);

/* The job id of (doc_id, text) into job[CB_JOB_ID_LEN + 1]. */
void cb_jobs_id(const char *doc_id, size_t doc_len, const char *text, size_t text_len, char job[CB_JOB_ID_LEN + 1]);

/* What may be queued (queued or running jobs): 0 = no limit. Per client: a client with nothing queued may
 * always submit one document (so a limit below the document size limit still lets documents through).
 * Over all clients (the global cap): a hard limit, but for one document into an empty queue. */
typedef struct {
    int64_t max_jobs;        /* per client */
    int64_t max_bytes;
    int64_t max_total_jobs;  /* all clients together */
    int64_t max_total_bytes;
} cb_jobs_limits_t;

/* Records a document durably, in one committed transaction, for client (a key of 1..CB_JOB_CLIENT_MAX
 * bytes). New (doc_id, text): a queued job (*duplicate = false). Already known: the same job, *duplicate =
 * true and *state (may be NULL) its state, unless that job had failed, or is finished but a newer version
 * of the document came after it: then it is queued again (*duplicate = false) for this client. meta_json
 * (may be NULL) is stored as is. Returns 0; 1 when queuing it would take the client over lim (NULL = no
 * limits, per client or over all; nothing recorded, err says which); -1 with err on a database error. */
int cb_jobs_submit(cb_jobs_t *self, const char *doc_id, size_t doc_len, const char *text, size_t text_len,
                   const char *meta_json, const char *client, const cb_jobs_limits_t *lim,
                   char job[CB_JOB_ID_LEN + 1], bool *duplicate, cb_job_state_t *state, char *err, size_t errlen);

/* Queues a done job again (a restore: its document was found missing from the retriever or its KV files),
 * for client, if it is still done and the latest version of its document. *requeued says whether it was.
 * 0, 1 (over lim, as in submit), or -1 with err. */
int cb_jobs_restore(cb_jobs_t *self, const char *job, const char *client, const cb_jobs_limits_t *lim,
                    bool *requeued, char *err, size_t errlen);

typedef struct {
    cb_job_state_t state;
    int64_t chunks_done, chunks_total;
    char error[768]; /* when failed */
    char doc_id[257];
    char owner[CB_JOB_OWNER_MAX + 1]; /* who leased it last ("local", "r:" + a remote worker, "" = never) */
} cb_job_status_t;

/* 1 = found (st filled), 0 = no such job, -1 = database error (err). */
int cb_jobs_status(cb_jobs_t *self, const char *job, cb_job_status_t *st, char *err, size_t errlen);

/* Jobs per state (counts[CB_JOB_STATE_COUNT_]) and chunks done over all jobs. 0 or -1. */
int cb_jobs_counts(cb_jobs_t *self, int64_t counts[CB_JOB_STATE_COUNT_], int64_t *chunks_done, char *err,
                   size_t errlen);
/* Distinct clients with queued or running jobs. 0 or -1. */
int cb_jobs_clients_waiting(cb_jobs_t *self, int64_t *n, char *err, size_t errlen);

/* ---- worker side -------------------------------------------------------------------------------------- */

/* One job as the worker sees it (owned by the caller: cb_job_free). */
typedef struct {
    int64_t seq;                       /* queue order */
    char job[CB_JOB_ID_LEN + 1];
    char client[CB_JOB_CLIENT_MAX + 1];
    char *doc_id;                      /* NUL-terminated */
    char *text;                        /* [text_len] + NUL */
    size_t text_len;
    bool planned;                      /* chunk rows exist */
    bool replaced;                     /* older versions' retriever entries were deleted already */
    bool has_older;                    /* another job for the same doc_id came earlier */
    int64_t chunks_done, chunks_total;
    char token[CB_JOB_TOKEN_LEN + 1];  /* the lease token its holder works under ("" when none) */
} cb_job_t;
void cb_job_free(cb_job_t **job_p);

/* The next turn: the first client after after_client (NULL or "" = from the start) in client-key order,
 * wrapping around, that has a job ready (queued or running, no older unfinished version of its document,
 * under no live lease), and that client's oldest such job. 1 = job and client (client[CB_JOB_CLIENT_MAX + 1]) set, 0 = nothing
 * to do, -1 = error. */
int cb_jobs_pick(cb_jobs_t *self, const char *after_client, char job[CB_JOB_ID_LEN + 1], char *client,
                 char *err, size_t errlen);
/* Loads a queued or running job (marked running). 1 = *out set, 0 = no such job (or finished), -1 = error. */
int cb_jobs_get(cb_jobs_t *self, const char *job, cb_job_t **out, char *err, size_t errlen);

/* A planned chunk: document bytes [off, off + len), its key (hex) and tokens, and whether it is done. */
typedef struct {
    int64_t off, len;
    char key[65];
    int n_tokens;
    bool done;
} cb_job_chunk_t;

/* Records the chunks of a job (one transaction): chunk rows, chunks_total. 0 or -1. */
int cb_jobs_plan(cb_jobs_t *self, const char *job, const cb_job_chunk_t *chunks, int n, char *err, size_t errlen);
/* The planned chunks of a job in order (caller frees *chunks). 0 or -1. */
int cb_jobs_chunks(cb_jobs_t *self, const char *job, cb_job_chunk_t **chunks, int *n, char *err, size_t errlen);
/* The first chunk of a job not done yet: 1 = *idx and *chunk set, 0 = all done, -1 = error. */
int cb_jobs_next_chunk(cb_jobs_t *self, const char *job, int *idx, cb_job_chunk_t *chunk, char *err, size_t errlen);
/* Marks chunk idx done and counts it. 0 or -1. */
int cb_jobs_chunk_done(cb_jobs_t *self, const char *job, int idx, char *err, size_t errlen);
/* Marks that the older versions' retriever entries were deleted. 0 or -1. */
int cb_jobs_set_replaced(cb_jobs_t *self, const char *job, char *err, size_t errlen);
/* Ends a job: done, or failed with a message. 0 or -1. */
int cb_jobs_finish(cb_jobs_t *self, const char *job, bool ok, const char *error, char *err, size_t errlen);

/* ---- leases (see the top of this file) ------------------------------------------------------------------ */

/* A granted lease. */
typedef struct {
    char job[CB_JOB_ID_LEN + 1];
    char client[CB_JOB_CLIENT_MAX + 1];
    char token[CB_JOB_TOKEN_LEN + 1];
    int64_t until_ms;                  /* expiry, ms since the epoch (this host's clock) */
    bool lapsed;                       /* the job had a lease that expired (its holder went silent) */
    char prev_token[CB_JOB_TOKEN_LEN + 1]; /* the token of the lease before this one ("" when none): a holder
                                          whose token it is knows that nobody else had the job since */
} cb_job_lease_t;

/* Picks the next turn as cb_jobs_pick does (round robin after after_client; jobs under a live lease and,
 * when max_text_bytes > 0, jobs with more text are skipped) and leases it to owner for ttl_ms with a new
 * token, marking it running, in one transaction. 1 = *out set, 0 = nothing to lease, 2 = owner holds
 * max_per_owner live leases already (0 = no limit; err says so), -1 = error. */
int cb_jobs_lease(cb_jobs_t *self, const char *after_client, const char *owner, int64_t ttl_ms, int64_t max_text_bytes,
                  int max_per_owner, cb_job_lease_t *out, char *err, size_t errlen);
/* The calls of a lease holder: each checks token in the transaction of its write and renews the lease for
 * ttl_ms. They return 1 = done, 0 = stale (token is not the job's, or the job is finished or gone: the
 * holder must drop the job), -1 = database error (err). */
int cb_jobs_lease_renew(cb_jobs_t *self, const char *job, const char *token, int64_t ttl_ms, char *err,
                        size_t errlen);
/* Records the plan (as cb_jobs_plan) unless the job has one already (then nothing changes: a plan sent
 * again); *chunks_total is the job's. */
int cb_jobs_lease_plan(cb_jobs_t *self, const char *job, const char *token, int64_t ttl_ms,
                       const cb_job_chunk_t *chunks, int n, int64_t *chunks_total, char *err, size_t errlen);
/* Marks that the older versions' retriever entries were deleted. */
int cb_jobs_lease_replaced(cb_jobs_t *self, const char *job, const char *token, int64_t ttl_ms, char *err,
                           size_t errlen);
/* Marks chunk idx done (idempotent: counted once). 2 = the job has no chunk idx (err). */
int cb_jobs_lease_chunk_done(cb_jobs_t *self, const char *job, const char *token, int idx, int64_t ttl_ms, char *err,
                             size_t errlen);
/* Ends the job (done, or failed with error) and its lease. 1 with *already = true when this token finished
 * it before (nothing changes); 2 = ok but not every planned chunk is done, or there is no plan (err). */
int cb_jobs_lease_finish(cb_jobs_t *self, const char *job, const char *token, bool ok, const char *error,
                         bool *already, char *err, size_t errlen);
/* Gives the lease up (the job is pickable at once; the token holds until another grant). 1, 0 or -1. */
int cb_jobs_lease_release(cb_jobs_t *self, const char *job, const char *token, char *err, size_t errlen);
/* Ends every lease of owner (the service's own worker at start: its turns died with the last process).
 * The number released, or -1. */
int cb_jobs_release_owner(cb_jobs_t *self, const char *owner, char *err, size_t errlen);
/* Unfinished jobs under a live lease, and under an expired one not yet taken over. 0 or -1. */
int cb_jobs_lease_counts(cb_jobs_t *self, int64_t *live, int64_t *lapsed, char *err, size_t errlen);
#endif
