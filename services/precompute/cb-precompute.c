/* cb-precompute: the ingest service. Documents arrive on a ROUTER (`ingest`, acknowledged after the
 * document is committed to the job table) and on a PULL socket (pipeline producers, no reply); `status`
 * reports a job's progress; `ping` and `stats` are built in (bus.h). A worker thread (worker.h) turns
 * queued documents into chunk KV files, cache-index entries and retriever entries.
 *
 *   cb-precompute [--config PATH] [--precompute.KEY=VALUE | --KEY VALUE]...
 *
 * Keys (section precompute, then common): endpoint, bind, pull_endpoint, pull_bind, db, chunk_tokens,
 * max_doc_bytes, retriever_timeout_ms, cacheindex_timeout_ms; common: data_dir, kv_dir, model, threads,
 * and the socket options; blend.system_prompt fixes the precompute context (it must be cb-blend's).
 * Exit: 0 after SIGINT/SIGTERM, 1 on a startup failure or when the worker cannot run.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend_select.h"
#include "wire/bus.h"
#include "wire/config.h"
#include "wire/db.h"
#include "jobs.h"
#include "base/log.h"
#include "wire/msg.h"
#include "worker.h"

#define SECTION "precompute"
#define MAX_DOC_ID 256
#define MAX_META_ENTRIES 64

typedef struct {
    cb_bus_service_t *svc;
    cb_jobs_t *jobs;
    zactor_t *worker;
    zsock_t *pull;
    int64_t max_doc_bytes;
    bool worker_ready;
    bool fatal;
    uint64_t pulled, pull_dropped;
} precompute_t;

/* Validates an ingest message and records it. Returns CB_ERR_NONE with job/duplicate set, or a code with
 * a reason in why. */
static cb_err_t ingest(precompute_t *p, const cb_msg_t *m, char job[CB_JOB_ID_LEN + 1], bool *duplicate, char *why,
                       size_t whylen) {
    const char *doc, *text;
    size_t doc_len, text_len;
    if (!cb_msg_str(m, "doc_id", MAX_DOC_ID, &doc, &doc_len) || doc_len == 0) {
        snprintf(why, whylen, "%s", doc_len == 0 && cb_msg_has(m, "doc_id") ? "field 'doc_id': empty" : cb_msg_last_error(m));
        return CB_ERR_BAD_REQUEST;
    }
    if (!cb_msg_str(m, "text", SIZE_MAX, &text, &text_len)) {
        snprintf(why, whylen, "%s", cb_msg_last_error(m));
        return CB_ERR_BAD_REQUEST;
    }
    if (text_len == 0) {
        snprintf(why, whylen, "field 'text': empty");
        return CB_ERR_BAD_REQUEST;
    }
    if ((int64_t)text_len > p->max_doc_bytes) {
        snprintf(why, whylen, "field 'text': %zu bytes, more than precompute.max_doc_bytes (%lld)", text_len,
                 (long long)p->max_doc_bytes);
        return CB_ERR_TOO_LARGE;
    }
    char *meta = NULL;
    if (cb_msg_has(m, "meta")) {
        const cb_msg_t *mm = cb_msg_map(m, "meta");
        if (!mm) {
            snprintf(why, whylen, "%s", cb_msg_last_error(m));
            return CB_ERR_BAD_REQUEST;
        }
        json_t *js = cb_msg_to_json(mm);
        if (!js) {
            snprintf(why, whylen, "field 'meta': out of memory");
            return CB_ERR_INTERNAL;
        }
        if (json_object_size(js) > MAX_META_ENTRIES) {
            json_decref(js);
            snprintf(why, whylen, "field 'meta': more than %d entries", MAX_META_ENTRIES);
            return CB_ERR_BAD_REQUEST;
        }
        const char *k;
        json_t *v;
        json_object_foreach(js, k, v) {
            if (!json_is_string(v) && !json_is_number(v) && !json_is_boolean(v)) {
                snprintf(why, whylen, "field 'meta.%.64s': expected a string, number or boolean", k);
                json_decref(js);
                return CB_ERR_BAD_REQUEST;
            }
        }
        meta = json_dumps(js, JSON_COMPACT | JSON_SORT_KEYS);
        json_decref(js);
    }
    char err[512];
    int rc = cb_jobs_submit(p->jobs, doc, doc_len, text, text_len, meta, job, duplicate, err, sizeof err);
    free(meta);
    if (rc != 0) {
        snprintf(why, whylen, "cannot record the document: %.400s", err);
        return CB_ERR_INTERNAL;
    }
    if (!*duplicate) zstr_send(p->worker, "WORK");
    return CB_ERR_NONE;
}

static void on_ingest(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    precompute_t *p = arg;
    char job[CB_JOB_ID_LEN + 1], why[512];
    bool dup = false;
    cb_err_t code = ingest(p, m, job, &dup, why, sizeof why);
    if (code != CB_ERR_NONE) {
        cb_bus_reply_error(req, code, "%s", why);
        return;
    }
    cb_log(CB_LOG_DEBUG, cb_bus_req_id(req), "ingest -> job %s%s", job, dup ? " (duplicate)" : "");
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_str(w, "job", job);
    cb_msg_put_bool(w, "duplicate", dup);
    cb_bus_reply(req, w);
}

static void on_status(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    precompute_t *p = arg;
    char job[65], err[256];
    if (!cb_msg_str_copy(m, "job", 64, job, sizeof job) || !job[0]) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", job[0] ? cb_msg_last_error(m) : "field 'job': empty");
        return;
    }
    cb_job_status_t st;
    int r = cb_jobs_status(p->jobs, job, &st, err, sizeof err);
    if (r < 0) {
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "%s", err);
        return;
    }
    if (r == 0) {
        cb_bus_reply_error(req, CB_ERR_NOT_FOUND, "no job '%s'", job);
        return;
    }
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_str(w, "state", cb_job_state_name(st.state));
    cb_msg_put_int(w, "chunks_done", st.chunks_done);
    cb_msg_put_int(w, "chunks_total", st.chunks_total);
    if (st.state == CB_JOB_FAILED) cb_msg_put_str(w, "error", st.error);
    cb_bus_reply(req, w);
}

static void stats_extra(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg) {
    (void)svc;
    precompute_t *p = arg;
    int64_t counts[CB_JOB_STATE_COUNT_], chunks = 0;
    char err[256];
    if (cb_jobs_counts(p->jobs, counts, &chunks, err, sizeof err) != 0) {
        cb_log(CB_LOG_WARN, NULL, "stats: %s", err);
        return;
    }
    cb_msg_put_int(w, "jobs_queued", counts[CB_JOB_QUEUED]);
    cb_msg_put_int(w, "jobs_running", counts[CB_JOB_RUNNING]);
    cb_msg_put_int(w, "jobs_done", counts[CB_JOB_DONE]);
    cb_msg_put_int(w, "jobs_failed", counts[CB_JOB_FAILED]);
    cb_msg_put_int(w, "chunks_done", chunks);
    cb_msg_put_uint(w, "pulled", p->pulled);
    cb_msg_put_uint(w, "pull_dropped", p->pull_dropped);
    cb_msg_put_bool(w, "worker_ready", p->worker_ready);
}

/* A document on the PULL socket: same validation, no reply; invalid ones are logged and dropped. */
static int on_pull(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    precompute_t *p = arg;
    zmsg_t *zm = zmsg_recv(sock);
    if (!zm) return zsys_interrupted ? -1 : 0;
    p->pulled++;
    if (zmsg_size(zm) != 1) {
        cb_log(CB_LOG_WARN, NULL, "pull: dropped a message of %zu frames", zmsg_size(zm));
        p->pull_dropped++;
        zmsg_destroy(&zm);
        return 0;
    }
    zframe_t *f = zmsg_first(zm);
    cb_msg_error_t e;
    cb_msg_t *m = cb_msg_decode_ex(zframe_data(f), zframe_size(f),
                                   (size_t)cb_bus_service_opts(p->svc)->max_msg_bytes, &e);
    zmsg_destroy(&zm);
    if (!m) {
        cb_log(CB_LOG_WARN, e.id[0] ? e.id : NULL, "pull: dropped an invalid message: %s", e.message);
        p->pull_dropped++;
        return 0;
    }
    if (!cb_msg_is_type(m, "ingest") || cb_msg_is_reply(m)) {
        cb_log(CB_LOG_WARN, cb_msg_id(m), "pull: dropped a '%s' message (only 'ingest' requests)", cb_msg_type(m));
        p->pull_dropped++;
        cb_msg_destroy(&m);
        return 0;
    }
    char job[CB_JOB_ID_LEN + 1], why[512];
    bool dup;
    cb_err_t code = ingest(p, m, job, &dup, why, sizeof why);
    if (code != CB_ERR_NONE) {
        cb_log(CB_LOG_WARN, cb_msg_id(m), "pull: dropped ingest: %s: %s", cb_err_name(code), why);
        p->pull_dropped++;
    } else {
        cb_log(CB_LOG_INFO, cb_msg_id(m), "pull ingest -> job %s%s", job, dup ? " (duplicate)" : "");
    }
    cb_msg_destroy(&m);
    return 0;
}

/* Messages from the worker thread. */
static int on_worker(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    precompute_t *p = arg;
    zmsg_t *zm = zmsg_recv(sock);
    if (!zm) return zsys_interrupted ? -1 : 0;
    char *what = zmsg_popstr(zm);
    int rc = 0;
    if (what && strcmp(what, "READY") == 0) {
        p->worker_ready = true;
    } else if (what && strcmp(what, "FATAL") == 0) {
        char *msg = zmsg_popstr(zm);
        cb_log(CB_LOG_ERROR, NULL, "the worker cannot run (%s): exiting", msg ? msg : "?");
        zstr_free(&msg);
        p->fatal = true;
        cb_bus_service_stop(p->svc);
        rc = -1;
    }
    zstr_free(&what);
    zmsg_destroy(&zm);
    return rc;
}

static void usage(FILE *f) {
    fprintf(f, "usage: cb-precompute [--config PATH] [--precompute.KEY=VALUE | --KEY VALUE]...\n"
               "  Serves ingest/status/ping/stats (docs/protocol.md §6) on precompute.endpoint and takes ingest\n"
               "  messages on precompute.pull_endpoint. Keys: endpoint, bind, pull_endpoint, pull_bind, db,\n"
               "  chunk_tokens, max_doc_bytes, retriever_timeout_ms, cacheindex_timeout_ms, and common.* (data_dir,\n"
               "  kv_dir, model, threads, ...); blend.system_prompt. Environment CB_PRECOMPUTE_<KEY> overrides the file.\n");
}

int main(int argc, char **argv) {
    cb_bus_init("cb-precompute");
    char err[1024];
    int exit_code;
    cb_config_t *cfg = cb_bus_service_config(SECTION, &argc, argv, usage, &exit_code);
    if (!cfg) return exit_code;
    precompute_t p = {0};
    static pc_worker_args_t wa;
    int rc = 1;
    int64_t chunk_tokens, threads, rt, ct;
    const char *model, *sys, *backend, *pull_ep = NULL, *pull_bind = NULL;
    wa.cfg = cfg;
    if (!cb_config_int(cfg, SECTION, "chunk_tokens", 16, 8192, 512, &chunk_tokens, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_doc_bytes", 1, (int64_t)1 << 30, 4 << 20, &p.max_doc_bytes, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "threads", 1, 1024, 2, &threads, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "retriever_timeout_ms", 1, 3600000, 5000, &rt, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "cacheindex_timeout_ms", 1, 3600000, 5000, &ct, err, sizeof err) ||
        !cb_config_str(cfg, SECTION, "model", "models/SmolLM2-135M-Instruct.Q4_1.gguf", &model, err, sizeof err) ||
        !cb_config_str(cfg, "blend", "system_prompt", "", &sys, err, sizeof err) ||
        !cb_config_str(cfg, SECTION, "backend", "auto", &backend, err, sizeof err) ||
        !cb_config_endpoint(cfg, SECTION, "pull_endpoint", NULL, &pull_ep, err, sizeof err) ||
        !cb_config_endpoint(cfg, SECTION, "pull_bind", NULL, &pull_bind, err, sizeof err) ||
        !cb_config_data_path(cfg, SECTION, "db", "precompute.db", wa.db_path, sizeof wa.db_path, err, sizeof err) ||
        !cb_config_data_path(cfg, SECTION, "kv_dir", "kv", wa.kv_dir, sizeof wa.kv_dir, err, sizeof err)) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    cb_backend_kind_t bk;
    if (!cb_backend_kind_parse(backend, &bk)) {
        cb_log(CB_LOG_ERROR, NULL, "config precompute.backend = '%s': expected auto, cpu or cuda", backend);
        goto out;
    }
    cb_backend_set_default_kind(bk);
    if (!cb_config_numerics(cfg, err, sizeof err)) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    if (p.max_doc_bytes > (int64_t)1 << 30) p.max_doc_bytes = (int64_t)1 << 30;
    wa.chunk_tokens = (int)chunk_tokens;
    wa.threads = (int)threads;
    wa.retriever_timeout_ms = (int)rt;
    wa.cacheindex_timeout_ms = (int)ct;
    snprintf(wa.model_path, sizeof wa.model_path, "%s", model);
    snprintf(wa.system_prompt, sizeof wa.system_prompt, "%s", sys);
    cb_config_log(cfg, SECTION);
    if (cb_db_mkdirs(wa.kv_dir, err, sizeof err) != 0 || !(p.jobs = cb_jobs_open(wa.db_path, err, sizeof err))) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    {
        int64_t counts[CB_JOB_STATE_COUNT_], chunks;
        if (cb_jobs_counts(p.jobs, counts, &chunks, err, sizeof err) == 0)
            cb_log(CB_LOG_INFO, NULL, "job table %s: %lld queued, %lld unfinished, %lld done, %lld failed", wa.db_path,
                   (long long)counts[0], (long long)counts[1], (long long)counts[2], (long long)counts[3]);
    }
    p.svc = cb_bus_service_from_config("cb-precompute", cfg, SECTION, err, sizeof err);
    if (!p.svc) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    if (!pull_bind) pull_bind = pull_ep;
    if (pull_bind) {
        p.pull = cb_bus_socket(ZMQ_PULL, pull_bind, true, cb_bus_service_opts(p.svc), err, sizeof err);
        if (!p.pull) {
            cb_log(CB_LOG_ERROR, NULL, "pull socket: %s", err);
            goto out;
        }
        cb_log(CB_LOG_INFO, NULL, "pull socket on %s", pull_bind);
    }
    p.worker = zactor_new(pc_worker_actor, &wa);
    if (!p.worker) {
        cb_log(CB_LOG_ERROR, NULL, "cannot start the worker thread");
        goto out;
    }
    zloop_t *loop = cb_bus_service_loop(p.svc);
    zloop_reader(loop, (zsock_t *)p.worker, on_worker, &p);
    if (p.pull) zloop_reader(loop, p.pull, on_pull, &p);
    cb_bus_service_on(p.svc, "ingest", on_ingest, &p);
    cb_bus_service_on(p.svc, "status", on_status, &p);
    cb_bus_service_set_stats(p.svc, stats_extra, &p);
    rc = cb_bus_service_run(p.svc) == 0 && !p.fatal ? 0 : 1;
out:
    zactor_destroy(&p.worker); /* $TERM: the worker stops after its current step */
    zsock_destroy(&p.pull);
    cb_bus_service_destroy(&p.svc);
    cb_jobs_close(&p.jobs);
    cb_config_destroy(&cfg);
    if (rc == 0) cb_log(CB_LOG_INFO, NULL, "bye");
    return rc;
}
