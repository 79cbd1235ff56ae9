/* worker.c: cb-precompute's job worker thread (see worker.h). */
#include "worker.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include "base/clock.h"
#include "wire/bus.h"
#include "rag/chunker.h"
#include "engine/engine.h"
#include "jobs.h"
#include "format/kvfile.h"
#include "kv/kvstore.h"
#include "base/log.h"
#include "model/model.h"
#include "wire/msg.h"
#include "rag/ragprompt.h"
#include "model/tokenizer.h"

#define BACKOFF_MIN_MS 1000
#define BACKOFF_MAX_MS 30000

typedef struct {
    zsock_t *pipe;
    const pc_worker_args_t *a;
    bool term;                   /* $TERM received */
    cb_model_t *model;
    cb_tokenizer_t *tok;
    cb_ragprompt_t *rp;
    cb_engine_t *engine;
    cb_kvstore_t *store;         /* chunk keys, the context's KV, compute + KV file write */
    cb_chunker_t *chunker;
    cb_jobs_t *jobs;
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
typedef enum { STEP_OK = 0, STEP_FAIL, STEP_TERM, STEP_DONE, STEP_RETRY } step_t;

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
    cb_jobs_close(&w->jobs);
    cb_chunker_destroy(&w->chunker);
    cb_kvstore_destroy(&w->store);
    cb_engine_destroy(&w->engine);
    cb_ragprompt_destroy(&w->rp);
    cb_tokenizer_destroy(&w->tok);
    cb_model_destroy(&w->model);
}

static void free_item(void **item) {
    free(*item);
    *item = NULL;
}

static int worker_init(worker_t *w, char *err, size_t errlen) {
    const pc_worker_args_t *a = w->a;
    if (!(w->model = cb_model_load(a->model_path, err, errlen))) return -1;
    if (!(w->tok = cb_tokenizer_new_from_gguf(cb_model_gguf(w->model), err, errlen))) return -1;
    if (!(w->rp = cb_ragprompt_new(w->tok, a->system_prompt, err, errlen))) return -1;
    w->prefix = cb_ragprompt_prefix(w->rp, &w->n_prefix);
    const cb_hparams_t *hp = cb_model_hparams(w->model);
    /* P + a chunk of chunk_tokens encoded alone + its separator (a few tokens of slack) */
    w->max_ctx = w->n_prefix + a->chunk_tokens + 16;
    if (w->max_ctx > hp->n_ctx_train) {
        snprintf(err, errlen, "precompute context (%d tokens) + chunk_tokens (%d) exceed the model's context (%d)",
                 w->n_prefix, a->chunk_tokens, hp->n_ctx_train);
        return -1;
    }
    if (!(w->engine = cb_engine_new(w->model, w->max_ctx, err, errlen))) return -1;
    if (a->threads > 0) cb_engine_set_threads(w->engine, a->threads);
    if (!(w->store = cb_kvstore_new(w->engine, a->kv_dir, NULL, a->kv_dtype, err, errlen))) return -1;
    cb_kvstore_set_remote(w->store, a->remote); /* ensure: file -> Redis -> compute; refills Redis */
    w->bytes_per_token = 2u * (uint64_t)hp->n_layer * cb_kv_row_bytes(a->kv_dtype, (size_t)hp->n_head_kv * hp->head_dim);
    /* P's KV now, so the first document does not pay for it (and a bad context fails at start) */
    if (cb_kvstore_set_context(w->store, w->prefix, w->n_prefix, err, errlen) != 0) return -1;
    if (!(w->chunker = cb_chunker_new(w->tok, a->chunk_tokens, err, errlen))) return -1;
    if (!(w->jobs = cb_jobs_open(a->db_path, err, errlen))) return -1;
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
    void *copy = malloc(len);
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

/* Whether the file system of dir has less than need bytes (plus 1 MiB) free for us: a failed write there is
 * then the disk being full, not the file's fault. */
static bool disk_full(const char *dir, uint64_t need) {
    struct statvfs vs;
    if (statvfs(dir, &vs) != 0) return false;
    return (uint64_t)vs.f_bavail * (uint64_t)vs.f_frsize < need + (1u << 20);
}

/* Chunks a document and records the plan. */
static step_t plan_job(worker_t *w, cb_job_t *job, char *err, size_t errlen) {
    cb_chunk_span_t *spans = NULL;
    int n = 0;
    if (cb_chunker_split(w->chunker, job->text, job->text_len, &spans, &n, err, errlen) != 0) return STEP_FAIL;
    cb_job_chunk_t *cs = n ? calloc((size_t)n, sizeof *cs) : NULL;
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
    int rc = cb_jobs_plan(w->jobs, job->job, cs, n, err, errlen);
    free(cs);
    if (rc != 0) return STEP_FAIL;
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
            st = disk_full(w->a->kv_dir, (uint64_t)nt * w->bytes_per_token) ? STEP_RETRY : STEP_FAIL;
            break;
        }
        if (src == CB_KVSTORE_COMPUTED)
            cb_log(CB_LOG_DEBUG, job->job, "chunk %d (%d tokens) computed (%s): %s", idx, nt, cb_kv_miss_str(why), hex);
        else
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
    return cb_jobs_chunk_done(w->jobs, job->job, idx, err, errlen) == 0 ? STEP_OK : STEP_FAIL;
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
        if (cb_jobs_set_replaced(w->jobs, job->job, err, errlen) != 0) return STEP_FAIL;
        job->replaced = true;
        return STEP_OK;
    }
    int idx = -1;
    cb_job_chunk_t c;
    int r = cb_jobs_next_chunk(w->jobs, job->job, &idx, &c, err, errlen);
    if (r < 0) return STEP_FAIL;
    if (r == 0) return STEP_DONE;
    doing(w, "job %s (doc '%.64s'): chunk %d of %lld", job->job, job->doc_id, idx + 1, (long long)job->chunks_total);
    return do_chunk(w, job, idx, &c, err, errlen);
}

/* The first turn of a job in this process: remembered (for its time), and a resumed one said so. */
static void job_started(worker_t *w, const cb_job_t *job) {
    if (zhashx_lookup(w->started, job->job)) return;
    double *t0 = malloc(sizeof *t0);
    if (!t0) return;
    *t0 = cb_now_ms();
    zhashx_insert(w->started, job->job, t0);
    if (job->planned && job->chunks_done > 0)
        cb_log(CB_LOG_INFO, job->job, "resumed: %lld of %lld chunks were done already", (long long)job->chunks_done,
               (long long)job->chunks_total);
}

/* A job that ended (done or failed): recorded, logged, told to the loop. -1 when the job table could not
 * record it (e.g. its disk is full): the job is still running there and is retried after a back-off. */
static int job_ended(worker_t *w, const cb_job_t *job, bool ok, const char *why) {
    char e2[256];
    if (cb_jobs_finish(w->jobs, job->job, ok, why, e2, sizeof e2) != 0) {
        cb_log(CB_LOG_ERROR, job->job, "worker: %s", e2);
        return -1;
    }
    const double *t0 = zhashx_lookup(w->started, job->job);
    double ms = t0 ? cb_now_ms() - *t0 : 0.0;
    if (ok) cb_log(CB_LOG_INFO, job->job, "doc '%s' done in %.0f ms", job->doc_id, ms);
    else cb_log(CB_LOG_WARN, job->job, "doc '%s' failed: %s", job->doc_id, why);
    zhashx_delete(w->started, job->job);
    zstr_sendx(w->pipe, "JOB", job->job, ok ? "done" : "failed", NULL);
    return 0;
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
    char last[CB_JOB_CLIENT_MAX + 1] = ""; /* the client whose turn it was */
    cb_job_t *cur = NULL;                  /* the job of the last turn, kept while it keeps its turns */
    int retry_ms = BACKOFF_MIN_MS;         /* the back-off after a storage failure (STEP_RETRY) */
    while (!wait_pipe(&w, 0)) {
        w.busy = cur != NULL;
        beat(&w);
        char id[CB_JOB_ID_LEN + 1], client[CB_JOB_CLIENT_MAX + 1];
        int r = cb_jobs_pick(w.jobs, last, id, client, err, sizeof err);
        if (r < 0) {
            cb_log(CB_LOG_ERROR, NULL, "worker: %s", err);
            poll_pipe(&w, BACKOFF_MIN_MS);
            continue;
        }
        if (r == 0) {
            cb_job_free(&cur);
            w.busy = false;
            last[0] = 0;
            doing(&w, "idle");
            poll_pipe(&w, 1000);
            continue;
        }
        snprintf(last, sizeof last, "%s", client);
        if (!cur || strcmp(cur->job, id) != 0) {
            cb_job_free(&cur);
            int g = cb_jobs_get(w.jobs, id, &cur, err, sizeof err);
            if (g <= 0) {
                if (g < 0) cb_log(CB_LOG_ERROR, id, "worker: %s", err);
                if (g < 0) poll_pipe(&w, BACKOFF_MIN_MS);
                continue;
            }
            job_started(&w, cur);
        }
        w.busy = true;
        beat(&w);
        err[0] = 0;
        step_t st = job_turn(&w, cur, err, sizeof err);
        atomic_fetch_add(&w.st->turns, 1);
        beat(&w);
        if (st == STEP_TERM) {
            cb_log(CB_LOG_INFO, cur->job, "stopping in the middle of doc '%s' (resumes at the next start)", cur->doc_id);
            break;
        }
        if ((st == STEP_DONE || st == STEP_FAIL) && job_ended(&w, cur, st == STEP_DONE, err) != 0) st = STEP_RETRY;
        else if (st == STEP_DONE || st == STEP_FAIL) cb_job_free(&cur);
        if (st == STEP_RETRY) { /* back off (1 s .. 30 s, doubling); nothing is failed or lost for it */
            atomic_fetch_add(&w.st->storage_retries, 1);
            cb_log(CB_LOG_WARN, cur ? cur->job : NULL, "%s; retrying in %d ms", err[0] ? err : "storage failure",
                   retry_ms);
            doing(&w, "waiting for storage");
            if (poll_pipe(&w, retry_ms)) break;
            retry_ms = retry_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : retry_ms * 2;
            cb_job_free(&cur); /* read again from the table: the next turn goes on from what it holds */
            last[0] = 0;
        } else {
            retry_ms = BACKOFF_MIN_MS;
        }
    }
    cb_job_free(&cur);
    w.busy = false;
    beat(&w);
    worker_free(&w);
}
