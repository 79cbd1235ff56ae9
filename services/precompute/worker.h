/* worker: cb-precompute's job worker, a zactor thread that owns the engine and the chunk store. It takes
 * jobs from the durable queue (jobs.h) in order, tokenizes and chunks each document (chunker.h), computes
 * every chunk's KV after the precompute context (ragprompt.h prefix) with the store (kvstore.h
 * cb_kvstore_ensure: a KV file that verifies is kept, else a plain prefill of the chunk after P captures its
 * K/V and writes the content-addressed KV file; no blend is involved), registers the file with
 * cb-cacheindex (`put`), sends the chunk text to cb-retriever (`index`), records each chunk as done, then
 * the job. A restarted worker resumes unfinished jobs, skipping finished
 * chunks; every step is idempotent, so a step repeated after a crash changes nothing.
 *
 * Transient failures (a peer service down or slow) are retried with exponential back-off (1 s .. 30 s)
 * without failing the job; permanent ones (an error reply, a chunk longer than the context, a disk write
 * failure) fail the job with a message.
 *
 * Pipe protocol (strings): loop -> worker "WORK" (a job was queued), "$TERM" (stop after the current
 * step); worker -> loop "READY" (model loaded) or "FATAL" + message (the worker cannot run; the service
 * should exit), "JOB" + job id + state after each finished job.
 */
#ifndef PC_WORKER_H
#define PC_WORKER_H

#include <czmq.h>

#include "wire/config.h"

typedef struct {
    const cb_config_t *cfg;      /* borrowed (read-only lookups are thread-safe); outlives the actor */
    char model_path[4096];
    char kv_dir[4096];           /* must exist */
    char db_path[4096];
    char system_prompt[2048];
    int chunk_tokens;
    int threads;
    int retriever_timeout_ms;
    int cacheindex_timeout_ms;
} pc_worker_args_t;

/* zactor_new(pc_worker_actor, args): args (pc_worker_args_t *) must outlive the actor. */
void pc_worker_actor(zsock_t *pipe, void *args);

#endif
