/* worker.c: cb-precompute's job worker thread (see worker.h). */
#include "worker.h"
#include "base/alloc.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/clock.h"
#include "wire/bus.h"
#include "rag/chunker.h"
#include "engine/engine.h"
#include "jobs.h"
#include "lease_client.h"
#include "format/kvfile.h"
#include "kv/kvstore.h"
#include "base/log.h"
#include "model/model.h"
#include "wire/msg.h"
#include "rag/ragprompt.h"
#include "svc/session.h"
#include "model/tokenizer.h"

#define BACKOFF_MIN_MS 1000
#define BACKOFF_MAX_MS 30000

/* ---- the local source: this service's job table --------------------------------------------------------- */

#define LOCAL_OWNER CB_JOBS_LOCAL_OWNER

typedef struct {
    cb_jobs_t *jobs;
    int64_t ttl_ms;                       /* a turn's lease */
    char last[CB_JOB_CLIENT_MAX + 1];     /* the client whose turn it was */
    cb_diskhealth_t *disk;                /* told of table writes that failed on a full disk (may be NULL) */
} local_src_t;

/* 1 -> OK, 0 -> STALE, 2 (the table refuses: a bug) -> RETRY (the next turn reads the table again), -1 -> f. */
static pc_src_rc_t local_rc(int r, pc_src_rc_t on_error) {
    return r == 1 ? PC_SRC_OK : r == 0 ? PC_SRC_STALE : r == 2 ? PC_SRC_RETRY : on_error;
}

static int local_take(void *ctx, cb_job_t **job, char *err, size_t errlen) {
    local_src_t *l = ctx;
    cb_job_lease_t lease;
    int r = cb_jobs_lease(l->jobs, l->last, LOCAL_OWNER, l->ttl_ms, 0, 0, &lease, err, errlen);
    if (r < 0) cb_diskhealth_note(l->disk, "job table", err);
    if (r != 1) {
        cb_job_free(job);
        l->last[0] = 0;
        return r < 0 ? -1 : 0;
    }
    snprintf(l->last, sizeof l->last, "%s", lease.client);
    if (*job && strcmp((*job)->job, lease.job) == 0 && strcmp((*job)->token, lease.prev_token) == 0) {
        /* the same job as our last turn and nobody had it since: what we hold of it is current */
        snprintf((*job)->token, sizeof (*job)->token, "%s", lease.token);
        return 1;
    }
    cb_job_free(job);
    int g = cb_jobs_get(l->jobs, lease.job, job, err, errlen);
    if (g <= 0) {
        char e2[64];
        cb_jobs_lease_release(l->jobs, lease.job, lease.token, e2, sizeof e2);
        return g < 0 ? -1 : 0;
    }
    return 1;
}

static pc_src_rc_t local_next_chunk(void *ctx, cb_job_t *job, int *idx, cb_job_chunk_t *c, char *err, size_t errlen) {
    local_src_t *l = ctx;
    int r = cb_jobs_next_chunk(l->jobs, job->job, idx, c, err, errlen);
    if (r == 0) *idx = -1;
    return r < 0 ? PC_SRC_FAIL : PC_SRC_OK;
}

static pc_src_rc_t local_plan(void *ctx, cb_job_t *job, const cb_job_chunk_t *cs, int n, char *err, size_t errlen) {
    local_src_t *l = ctx;
    int64_t total = 0;
    int r = cb_jobs_lease_plan(l->jobs, job->job, job->token, l->ttl_ms, cs, n, &total, err, errlen);
    if (r < 0) cb_diskhealth_note(l->disk, "job table", err);
    return local_rc(r, PC_SRC_FAIL);
}

static pc_src_rc_t local_replaced(void *ctx, cb_job_t *job, char *err, size_t errlen) {
    local_src_t *l = ctx;
    return local_rc(cb_jobs_lease_replaced(l->jobs, job->job, job->token, l->ttl_ms, err, errlen), PC_SRC_FAIL);
}

static pc_src_rc_t local_renew(void *ctx, cb_job_t *job, char *err, size_t errlen) {
    local_src_t *l = ctx;
    return local_rc(cb_jobs_lease_renew(l->jobs, job->job, job->token, l->ttl_ms, err, errlen), PC_SRC_RETRY);
}

static pc_src_rc_t local_chunk_done(void *ctx, cb_job_t *job, int idx, char *err, size_t errlen) {
    local_src_t *l = ctx;
    int r = cb_jobs_lease_chunk_done(l->jobs, job->job, job->token, idx, l->ttl_ms, err, errlen);
    if (r < 0) cb_diskhealth_note(l->disk, "job table", err);
    return local_rc(r, PC_SRC_FAIL);
}

static pc_src_rc_t local_finish(void *ctx, cb_job_t *job, bool ok, const char *why, char *err, size_t errlen) {
    local_src_t *l = ctx;
    bool already = false;
    return local_rc(cb_jobs_lease_finish(l->jobs, job->job, job->token, ok, why, &already, err, errlen),
                    PC_SRC_RETRY);
}

static void local_release(void *ctx, cb_job_t *job) {
    local_src_t *l = ctx;
    char e[256];
    if (cb_jobs_lease_release(l->jobs, job->job, job->token, e, sizeof e) < 0) cb_log(CB_LOG_WARN, job->job, "%s", e);
}

static void local_destroy(void **ctx_p) {
    local_src_t *l = *ctx_p;
    if (!l) return;
    cb_jobs_close(&l->jobs);
    free(l);
    *ctx_p = NULL;
}

/* The local source over the job table at db_path (opened here: this thread's connection). 0 or -1. */
static int pc_local_source_new(const char *db_path, int64_t ttl_ms, cb_diskhealth_t *disk, pc_source_t *out, char *err,
                               size_t errlen) {
    local_src_t *l = cb_calloc(1, sizeof *l);
    if (!l) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    l->ttl_ms = ttl_ms > 0 ? ttl_ms : 120000;
    l->disk = disk;
    if (!(l->jobs = cb_jobs_open(db_path, err, errlen))) {
        free(l);
        return -1;
    }
    *out = (pc_source_t){.ctx = l, .name = "local", .keeps_job = false, .take = local_take,
                         .next_chunk = local_next_chunk, .plan = local_plan, .replaced = local_replaced,
                         .renew = local_renew, .chunk_done = local_chunk_done, .finish = local_finish,
                         .release = local_release, .destroy = local_destroy};
    return 0;
}

typedef struct {
    zsock_t *pipe;
    const pc_worker_args_t *a;
    bool term;                   /* $TERM received */
    cb_session_t *session;       /* model, tokenizer, prompt, engine and store (svc/session.h); the pointers
                                    below are its objects, borrowed */
    cb_model_t *model;
    cb_tokenizer_t *tok;
    const cb_ragprompt_t *rp;
    cb_engine_t *engine;
    cb_kvstore_t *store;         /* chunk keys, the context's KV, compute + KV file write */
    cb_chunker_t *chunker;
    pc_source_t src;             /* where jobs come from: the job table or a master (the one seam) */
    cb_bus_client_t *retriever, *cacheindex;
    cb_msg_writer_t *w;
    const int32_t *prefix;       /* [n_prefix] the precompute context P */
    int n_prefix;
    int max_ctx;
    uint64_t bytes_per_token;    /* a KV file's payload per token (all layers, K and V) */
    char fp_hex[CB_KV_HEX_BYTES];
    pc_worker_stats_t *st;       /* borrowed from the args */
    bool busy;                   /* a job in hand */
    zhashx_t *started;           /* job id -> double *: when this process first took a turn of it */
} worker_t;

/* STEP_RETRY: a local resource failed for now (the KV dir's disk is full, cb-cacheindex could not store
 * the row): the job keeps its state and is tried again after a back-off, never failed for it. */
typedef enum { STEP_OK = 0, STEP_FAIL, STEP_TERM, STEP_DONE, STEP_RETRY, STEP_STALE } step_t;

/* A source call's outcome as a step (STEP_STALE: the lease is gone, the job is dropped). */
static step_t src_step(pc_src_rc_t rc) {
    switch (rc) {
    case PC_SRC_OK: return STEP_OK;
    case PC_SRC_STALE: return STEP_STALE;
    case PC_SRC_RETRY: return STEP_RETRY;
    default: return STEP_FAIL;
    }
}

/* A sign of progress (the loop's health check reads it). */
static void beat(worker_t *w) {
    atomic_store(&w->st->busy, w->busy);
    atomic_store(&w->st->beat_ms, (uint64_t)cb_now_ms());
}

static void doing(worker_t *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void doing(worker_t *w, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&w->st->mu);
    vsnprintf(w->st->what, sizeof w->st->what, fmt, ap);
    pthread_mutex_unlock(&w->st->mu);
    va_end(ap);
}

/* Reads pipe commands for up to wait_ms (0 = just drain) without a sign of progress. True on $TERM. */
static bool wait_pipe(worker_t *w, int wait_ms) {
    if (w->term) return true;
    void *h = zsock_resolve(w->pipe);
    for (;;) {
        zmq_pollitem_t it = {h, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&it, 1, wait_ms);
        if (rc < 0) {
            if (errno == EINTR) continue;
            w->term = true; /* context terminated */
            return true;
        }
        if (rc == 0) return false;
        char *cmd = zstr_recv(w->pipe);
        if (!cmd || strcmp(cmd, "$TERM") == 0) {
            zstr_free(&cmd);
            w->term = true;
            return true;
        }
        zstr_free(&cmd); /* "WORK": just a wake-up */
        wait_ms = 0;     /* drain the rest without waiting */
    }
}

/* The same, as a deliberate wait (idle, or a back-off): a sign of progress before and after. */
static bool poll_pipe(worker_t *w, int wait_ms) {
    beat(w);
    bool term = wait_pipe(w, wait_ms);
    beat(w);
    return term;
}

static void worker_free(worker_t *w) {
    zhashx_destroy(&w->started);
    cb_bus_client_destroy(&w->retriever);
    cb_bus_client_destroy(&w->cacheindex);
    cb_msg_writer_destroy(&w->w);
    if (w->src.destroy) w->src.destroy(&w->src.ctx);
    cb_chunker_destroy(&w->chunker);
    cb_session_destroy(&w->session);
}

static void free_item(void **item) {
    free(*item);
    *item = NULL;
}

static int worker_init(worker_t *w, char *err, size_t errlen) {
    const pc_worker_args_t *a = w->a;
    /* the engine holds P + a chunk of chunk_tokens encoded alone + its separator (a few tokens of slack);
     * the store (file -> Redis -> compute; it refills Redis) has P's KV from the start, so the first
     * document does not pay for it (and a bad context fails at start) */
    cb_session_opts_t so = a->session;
    so.ctx_after_prefix = a->chunk_tokens + 16;
    so.no_blend = true;
    if (!(w->session = cb_session_new(&so, err, errlen))) return -1;
    w->model = cb_session_model(w->session);
    w->tok = cb_session_tokenizer(w->session);
    w->rp = cb_session_prompt(w->session);
    w->engine = cb_session_engine(w->session);
    w->store = cb_session_store(w->session);
    w->prefix = cb_session_prefix(w->session, &w->n_prefix);
    w->max_ctx = cb_engine_max_ctx(w->engine);
    const cb_hparams_t *hp = cb_model_hparams(w->model);
    w->bytes_per_token = 2u * (uint64_t)hp->n_layer * cb_kv_row_bytes(so.kv_dtype, (size_t)hp->n_head_kv * hp->head_dim);
    if (!(w->chunker = cb_chunker_new(w->tok, a->chunk_tokens, err, errlen))) return -1;
    if ((a->lease_from[0] ? pc_lease_source_new(a, &w->src, err, errlen)
                          : pc_local_source_new(a->db_path, a->local_lease_ms, a->disk, &w->src, err, errlen)) != 0)
        return -1;
    if (!(w->retriever = cb_bus_client_from_config(a->cfg, "precompute", "retriever", err, errlen))) return -1;
    if (!(w->cacheindex = cb_bus_client_from_config(a->cfg, "precompute", "cacheindex", err, errlen))) return -1;
    cb_bus_client_set_timeout(w->retriever, a->retriever_timeout_ms, -1);
    cb_bus_client_set_timeout(w->cacheindex, a->cacheindex_timeout_ms, -1);
    if (!(w->w = cb_msg_writer_new()) || !(w->started = zhashx_new())) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    zhashx_set_destructor(w->started, free_item); /* values: malloc'd doubles */
    uint8_t fp[32];
    cb_model_fingerprint(w->model, fp);
    cb_kvfile_hex(fp, w->fp_hex);
    return 0;
}

/* Sends the message finished in w->w to c, retrying transient failures (timeout, unavailable, overloaded)
 * with back-off until it gets a reply. STEP_OK with *reply (ok reply, caller owns), STEP_FAIL with err and
 * *code (an error reply: permanent; CB_ERR_INTERNAL when the message could not be made), STEP_TERM.
 * code may be NULL. */
static step_t call_retry(worker_t *w, cb_bus_client_t *c, const char *job, const char *what, cb_msg_t **reply,
                         cb_err_t *code_out, char *err, size_t errlen) {
    cb_err_t dummy;
    if (!code_out) code_out = &dummy;
    *code_out = CB_ERR_INTERNAL;
    *reply = NULL;
    size_t len;
    const void *data = cb_msg_end(w->w, &len);
    if (!data) {
        snprintf(err, errlen, "cannot encode %s: %s", what, cb_msg_writer_error(w->w));
        return STEP_FAIL;
    }
    /* the writer's buffer is reused by nothing until we return: keep a copy anyway (logging may not, but
     * future code might) */
    void *copy = cb_malloc(len);
    if (!copy) {
        snprintf(err, errlen, "out of memory");
        return STEP_FAIL;
    }
    memcpy(copy, data, len);
    int backoff = BACKOFF_MIN_MS;
    for (;;) {
        cb_err_t code;
        char e[512];
        cb_msg_t *m = cb_bus_request(c, copy, len, &code, e, sizeof e);
        if (m && cb_msg_ok(m)) {
            free(copy);
            *reply = m;
            return STEP_OK;
        }
        if (m) {
            code = cb_msg_err_code(m);
            snprintf(e, sizeof e, "%s: %s", cb_msg_err_code_name(m), cb_msg_err_message(m));
            cb_msg_destroy(&m);
            if (code != CB_ERR_OVERLOADED && code != CB_ERR_UNAVAILABLE && code != CB_ERR_TIMEOUT) {
                snprintf(err, errlen, "%s refused by %s: %s", what, cb_bus_client_endpoint(c), e);
                *code_out = code;
                free(copy);
                return STEP_FAIL;
            }
        }
        if (zsys_interrupted) {
            free(copy);
            return STEP_TERM;
        }
        cb_log(CB_LOG_WARN, job, "%s: %s; retrying in %d ms", what, e, backoff);
        if (poll_pipe(w, backoff)) {
            free(copy);
            return STEP_TERM;
        }
        backoff = backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff * 2;
    }
}

/* Chunks a document and records the plan. */
static step_t plan_job(worker_t *w, cb_job_t *job, char *err, size_t errlen) {
    cb_chunk_span_t *spans = NULL;
    int n = 0;
    if (cb_chunker_split(w->chunker, job->text, job->text_len, &spans, &n, err, errlen) != 0) return STEP_FAIL;
    cb_job_chunk_t *cs = n ? cb_calloc((size_t)n, sizeof *cs) : NULL;
    if (n && !cs) {
        free(spans);
        snprintf(err, errlen, "out of memory");
        return STEP_FAIL;
    }
    for (int i = 0; i < n; i++) {
        int nt = 0;
        int32_t *toks = cb_ragprompt_chunk(w->rp, job->text + spans[i].off, spans[i].len, &nt);
        if (!toks) {
            free(spans);
            free(cs);
            snprintf(err, errlen, "cannot tokenize chunk %d", i);
            return STEP_FAIL;
        }
        uint8_t key[32];
        cb_kvstore_chunk_key(w->store, w->prefix, w->n_prefix, toks, nt, key);
        free(toks);
        cs[i].off = (int64_t)spans[i].off;
        cs[i].len = (int64_t)spans[i].len;
        cs[i].n_tokens = nt;
        cb_kvfile_hex(key, cs[i].key);
    }
    free(spans);
    step_t rc = src_step(w->src.plan(w->src.ctx, job, cs, n, err, errlen));
    free(cs);
    if (rc != STEP_OK) return rc;
    job->planned = true;
    job->chunks_total = n;
    cb_log(CB_LOG_INFO, job->job, "doc '%s': %zu bytes -> %d chunks", job->doc_id, job->text_len, n);
    return STEP_OK;
}

/* One chunk: its KV (cb_kvstore_ensure: a file that verifies, else computed after P and written), the
 * cacheindex put, the retriever index. */
static step_t do_chunk(worker_t *w, cb_job_t *job, int idx, const cb_job_chunk_t *c, char *err, size_t errlen) {
    const char *text = job->text + c->off;
    size_t len = (size_t)c->len;
    int nt = 0;
    int32_t *toks = cb_ragprompt_chunk(w->rp, text, len, &nt);
    if (!toks) {
        snprintf(err, errlen, "cannot tokenize chunk %d", idx);
        return STEP_FAIL;
    }
    if (w->n_prefix + nt > w->max_ctx) {
        free(toks);
        snprintf(err, errlen, "chunk %d has %d tokens: more than the context allows (%d)", idx, nt,
                 w->max_ctx - w->n_prefix);
        return STEP_FAIL;
    }
    if (w->a->fault_chunk_delay_ms > 0 && wait_pipe(w, w->a->fault_chunk_delay_ms)) { /* tests only */
        free(toks);
        return STEP_TERM;
    }
    uint8_t key[32];
    char hex[CB_KV_HEX_BYTES], path[4400], rel[CB_KV_REL_PATH_BYTES];
    cb_kvstore_chunk_key(w->store, w->prefix, w->n_prefix, toks, nt, key);
    cb_kvfile_hex(key, hex);
    if (c->key[0] && strcmp(c->key, hex) != 0) { /* planned elsewhere (another worker) with another context */
        free(toks);
        snprintf(err, errlen, "chunk %d: key %.16s... here, %.16s... in the plan: this worker's model or precompute "
                 "context (blend.system_prompt, chunk_tokens) differs from the planner's", idx, hex, c->key);
        return STEP_FAIL;
    }
    if (cb_kvstore_path(w->store, key, path, sizeof path) != 0 || cb_kvfile_rel_path(key, rel, sizeof rel) != 0) {
        snprintf(err, errlen, "no KV file path under %.200s for this chunk", w->a->kv_dir);
        free(toks);
        return STEP_FAIL;
    }
    step_t st = STEP_OK;
    for (int attempt = 0; attempt < 2; attempt++) {
        cb_kvstore_src_t src;
        cb_kv_miss_t why = CB_KV_OK;
        int erc = cb_kvstore_ensure(w->store, w->prefix, w->n_prefix, toks, nt, &src, &why, err, errlen);
        atomic_store(&w->st->kv_write_failed, cb_kvstore_write_failures(w->store));
        if (erc != 0) { /* the KV file could not be written: no put for it */
            /* a full disk is transient (retried with back-off, the job kept); an obstacle at the path (a
             * non-empty directory) is not: the job fails with the reason */
            const bool full = !cb_diskhealth_room(w->a->kv_dir, (uint64_t)nt * w->bytes_per_token, NULL);
            st = full ? STEP_RETRY : STEP_FAIL;
            if (full || cb_diskhealth_full_msg(err)) /* the service's ping says degraded */
                cb_diskhealth_failed(w->a->disk, "KV dir", err);
            break;
        }
        if (src == CB_KVSTORE_COMPUTED) {
            cb_diskhealth_ok(w->a->disk, "KV dir"); /* a KV file was written */
            cb_log(CB_LOG_DEBUG, job->job, "chunk %d (%d tokens) computed (%s): %s", idx, nt, cb_kv_miss_str(why), hex);
        } else
            cb_log(CB_LOG_DEBUG, job->job, "chunk %d (%d tokens) already on disk: %s", idx, nt, hex);
        struct stat sb;
        if (lstat(path, &sb) != 0) {
            snprintf(err, errlen, "KV file %.200s missing after it was written: %s", path, strerror(errno));
            st = STEP_FAIL;
            break;
        }
        if (!S_ISREG(sb.st_mode)) {
            snprintf(err, errlen, "KV file %.200s is not a regular file after it was written", path);
            st = STEP_FAIL;
            break;
        }
        cb_msg_writer_t *wr = w->w;
        char id[32];
        cb_msg_begin(wr, "put", cb_bus_new_id(id, sizeof id));
        cb_msg_put_str(wr, "key", hex);
        cb_msg_put_str(wr, "path", rel);
        cb_msg_put_int(wr, "bytes", (int64_t)sb.st_size);
        cb_msg_put_int(wr, "tokens", nt);
        cb_msg_put_str(wr, "fingerprint", w->fp_hex);
        cb_msg_t *r = NULL;
        cb_err_t code;
        st = call_retry(w, w->cacheindex, job->job, "put", &r, &code, err, errlen);
        cb_msg_destroy(&r);
        if (st == STEP_FAIL && code == CB_ERR_INTERNAL) st = STEP_RETRY; /* e.g. its database's disk is full */
        /* a put refused because the file vanished or changed in between (gc, eviction): write it again once */
        if (st == STEP_FAIL && attempt == 0 && (code == CB_ERR_NOT_FOUND || code == CB_ERR_BAD_REQUEST)) {
            cb_log(CB_LOG_WARN, job->job, "chunk %d: %s; writing the file again", idx, err);
            continue;
        }
        break;
    }
    free(toks);
    if (st != STEP_OK) return st;
    /* the lease still ours, just before the text goes to the retriever (a holder that lost it stops here) */
    if ((st = src_step(w->src.renew(w->src.ctx, job, err, errlen))) != STEP_OK) return st;
    char id[32];
    cb_msg_writer_t *wr = w->w;
    cb_msg_begin(wr, "index", cb_bus_new_id(id, sizeof id));
    cb_msg_put_str(wr, "chunk_id", hex);
    cb_msg_put_str(wr, "doc_id", job->doc_id);
    cb_msg_put_strn(wr, "text", text, len);
    cb_msg_t *r = NULL;
    st = call_retry(w, w->retriever, job->job, "index", &r, NULL, err, errlen);
    cb_msg_destroy(&r);
    if (st != STEP_OK) return st;
    return src_step(w->src.chunk_done(w->src.ctx, job, idx, err, errlen));
}

/* One unit of a job: its plan, the deletion of an older version's chunks, or its next chunk. STEP_OK (more
 * to do), STEP_DONE (nothing left: the job is done), STEP_FAIL (err), STEP_TERM. */
static step_t job_turn(worker_t *w, cb_job_t *job, char *err, size_t errlen) {
    step_t st;
    if (!job->planned) {
        doing(w, "job %s (doc '%.64s'): chunking %zu bytes", job->job, job->doc_id, job->text_len);
        return plan_job(w, job, err, errlen);
    }
    if (job->has_older && !job->replaced) {
        /* a new version of a document: its older chunks leave the retriever before the new ones come */
        doing(w, "job %s (doc '%.64s'): deleting the older version at cb-retriever", job->job, job->doc_id);
        char id[32];
        cb_msg_begin(w->w, "delete", cb_bus_new_id(id, sizeof id));
        cb_msg_put_str(w->w, "doc_id", job->doc_id);
        cb_msg_t *r = NULL;
        if ((st = call_retry(w, w->retriever, job->job, "delete", &r, NULL, err, errlen)) != STEP_OK) return st;
        int64_t deleted = 0;
        cb_msg_int(r, "deleted", 0, INT64_MAX, &deleted);
        cb_msg_destroy(&r);
        cb_log(CB_LOG_INFO, job->job, "doc '%s' replaced: %" PRId64 " old chunks removed from the retriever",
               job->doc_id, deleted);
        if ((st = src_step(w->src.replaced(w->src.ctx, job, err, errlen))) != STEP_OK) return st;
        job->replaced = true;
        return STEP_OK;
    }
    int idx = -1;
    cb_job_chunk_t c;
    if ((st = src_step(w->src.next_chunk(w->src.ctx, job, &idx, &c, err, errlen))) != STEP_OK) return st;
    if (idx < 0) return STEP_DONE;
    doing(w, "job %s (doc '%.64s'): chunk %d of %lld", job->job, job->doc_id, idx + 1, (long long)job->chunks_total);
    return do_chunk(w, job, idx, &c, err, errlen);
}

/* The first turn of a job in this process: remembered (for its time), and a resumed one said so. */
static void job_started(worker_t *w, const cb_job_t *job) {
    if (zhashx_lookup(w->started, job->job)) return;
    double *t0 = cb_malloc(sizeof *t0);
    if (!t0) return;
    *t0 = cb_now_ms();
    zhashx_insert(w->started, job->job, t0);
    if (job->planned && job->chunks_done > 0)
        cb_log(CB_LOG_INFO, job->job, "resumed: %lld of %lld chunks were done already", (long long)job->chunks_done,
               (long long)job->chunks_total);
}

/* A job that ended (done or failed): recorded by the source, logged, told to the loop. STEP_OK, or
 * STEP_RETRY when it could not be recorded (the table's disk is full, the master is unreachable): the job
 * is still running there and is retried after a back-off; STEP_STALE when the lease was gone. */
static step_t job_ended(worker_t *w, cb_job_t *job, bool ok, const char *why) {
    char e2[256];
    step_t st = src_step(w->src.finish(w->src.ctx, job, ok, why, e2, sizeof e2));
    if (st == STEP_FAIL) { /* refused for good (a master that does not take it): give the job back */
        cb_log(CB_LOG_ERROR, job->job, "worker: %s; giving the job back", e2);
        w->src.release(w->src.ctx, job);
        return STEP_STALE;
    }
    bool local = !w->a->lease_from[0]; /* the job table is ours (not a master's, across the network) */
    if (st != STEP_OK) {
        if (st == STEP_RETRY) cb_log(CB_LOG_ERROR, job->job, "worker: %s", e2);
        if (st == STEP_RETRY && local) cb_diskhealth_note(w->a->disk, "job table", e2);
        return st;
    }
    if (local) cb_diskhealth_ok(w->a->disk, "job table");
    const double *t0 = zhashx_lookup(w->started, job->job);
    double ms = t0 ? cb_now_ms() - *t0 : 0.0;
    if (ok) cb_log(CB_LOG_INFO, job->job, "doc '%s' done in %.0f ms", job->doc_id, ms);
    else cb_log(CB_LOG_WARN, job->job, "doc '%s' failed: %s", job->doc_id, why);
    zhashx_delete(w->started, job->job);
    zstr_sendx(w->pipe, "JOB", job->job, ok ? "done" : "failed", NULL);
    return STEP_OK;
}

void pc_worker_actor(zsock_t *pipe, void *args) {
    worker_t w = {.pipe = pipe, .a = args};
    w.st = w.a->stats;
    zsock_signal(pipe, 0);
    char err[1024];
    if (worker_init(&w, err, sizeof err) != 0) {
        cb_log(CB_LOG_ERROR, NULL, "worker: %s", err);
        zstr_sendx(pipe, "FATAL", err, NULL);
        worker_free(&w);
        /* wait for $TERM (the actor protocol) */
        while (!poll_pipe(&w, 1000)) {
        }
        return;
    }
    cb_log(CB_LOG_INFO, NULL, "worker ready: precompute context %d tokens, chunks of <= %d tokens, kv_dir %s",
           w.n_prefix, w.a->chunk_tokens, w.a->kv_dir);
    zstr_send(pipe, "READY");
    cb_job_t *cur = NULL;                  /* the job in hand (local: the last turn's, kept while it keeps its turns) */
    int retry_ms = BACKOFF_MIN_MS;         /* the back-off after a storage failure (STEP_RETRY) */
    int take_ms = 0;                       /* the back-off while the source fails (0: it answers) */
    while (!wait_pipe(&w, 0)) {
        w.busy = cur != NULL;
        beat(&w);
        int r = w.src.take(w.src.ctx, &cur, err, sizeof err);
        if (r < 0) { /* the table or the master failed for now: back off, one log line per doubling */
            int next = take_ms ? (take_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : take_ms * 2) : BACKOFF_MIN_MS;
            if (next != take_ms)
                cb_log(CB_LOG_WARN, NULL, "worker: %s; retrying every %d ms at most", err, next);
            take_ms = next;
            doing(&w, "waiting for the job source: %.150s", err);
            poll_pipe(&w, take_ms);
            continue;
        }
        if (take_ms) cb_log(CB_LOG_INFO, NULL, "worker: the job source answers again");
        take_ms = 0;
        if (r == 0) {
            w.busy = false;
            doing(&w, "idle");
            poll_pipe(&w, 1000);
            continue;
        }
        job_started(&w, cur);
        w.busy = true;
        beat(&w);
        err[0] = 0;
        step_t st = job_turn(&w, cur, err, sizeof err);
        atomic_fetch_add(&w.st->turns, 1);
        beat(&w);
        if (st == STEP_TERM) {
            cb_log(CB_LOG_INFO, cur->job, "stopping in the middle of doc '%s' (%s)", cur->doc_id,
                   w.src.keeps_job ? "its lease is given back" : "resumes at the next start");
            break;
        }
        bool ended = false;
        if (st == STEP_DONE || st == STEP_FAIL) {
            st = job_ended(&w, cur, st == STEP_DONE, err);
            ended = st == STEP_OK;
        }
        if (!ended && !w.src.keeps_job && st != STEP_STALE) w.src.release(w.src.ctx, cur); /* the turn ended */
        if (st == STEP_STALE) { /* someone else has the job now: nothing of it is ours */
            cb_log(CB_LOG_WARN, cur->job, "doc '%s': %s; dropping the job", cur->doc_id,
                   err[0] ? err : "the lease is gone");
            zhashx_delete(w.started, cur->job);
            cb_job_free(&cur);
            continue;
        }
        if (ended) cb_job_free(&cur);
        if (st == STEP_RETRY) { /* back off (1 s .. 30 s, doubling); nothing is failed or lost for it */
            atomic_fetch_add(&w.st->storage_retries, 1);
            cb_log(CB_LOG_WARN, cur ? cur->job : NULL, "%s; retrying in %d ms", err[0] ? err : "storage failure",
                   retry_ms);
            doing(&w, "waiting to retry: %.160s", err[0] ? err : "storage failure");
            if (poll_pipe(&w, retry_ms)) break;
            retry_ms = retry_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : retry_ms * 2;
            if (!w.src.keeps_job) cb_job_free(&cur); /* read again from the table: the next turn goes on from it */
        } else {
            retry_ms = BACKOFF_MIN_MS;
        }
    }
    if (cur) w.src.release(w.src.ctx, cur);
    cb_job_free(&cur);
    w.busy = false;
    beat(&w);
    worker_free(&w);
}
