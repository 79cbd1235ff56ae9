/* cb-precompute: the ingest service. Documents arrive on a ROUTER (`ingest`, acknowledged after the
 * document is committed to the job table) and on a PULL socket (pipeline producers, no reply); `status`
 * reports a job's progress; `ping` and `stats` are built in (bus.h). A worker thread (worker.h) turns
 * queued documents into chunk KV files, cache-index entries and retriever entries.
 *
 *   cb-precompute [--config PATH] [--precompute.KEY=VALUE | --KEY VALUE]...
 *
 * Each document belongs to a client (ident.h): with CURVE on, the key the handshake authenticated (or, for a
 * trusted forwarder such as cb-gateway, the client it names in `on_behalf_of`); without CURVE, the declared
 * `client` field, else the connection, else "pull". The worker takes turns across clients (jobs.h); a client
 * over its queued limits, or any document past the global cap on queued work, is refused `overloaded`. A
 * document whose job is done, ingested again, is checked by the verifier thread (verify.h) and queued again
 * when it is missing from cb-retriever or its KV files are gone (`restored`). `ping` fails while the worker
 * has work and no progress for stuck_ms, and says `degraded` while the disk of the job table or the KV dir
 * is full (diskhealth.h: free space under min_free_mb, or a write that failed on a full disk).
 *
 * Past one machine (docs/leases.md): remote workers lease jobs from this table over the same endpoint
 * (lease_server.h); precompute.workers = 0 runs no worker thread here (no model is loaded: the service only
 * records documents and leases them). With precompute.lease_from = tcp://MASTER:PORT the process is a remote
 * worker instead (lease_client.h): no job table, no ingest; its worker leases jobs from the master, writes
 * KV files to this host's kv_dir, puts them at the cb-cacheindex and indexes them at the cb-retriever of its
 * configuration; its own endpoint answers ping and stats (role, master link, leases).
 *
 * Keys (section precompute, then common): endpoint, bind, pull_endpoint, pull_bind, db, chunk_tokens,
 * max_doc_bytes, max_queued_jobs_per_client, max_queued_bytes_per_client, max_queued_jobs, max_queued_bytes,
 * trusted_forwarders, retriever_timeout_ms,
 * cacheindex_timeout_ms, verify_timeout_ms, stuck_ms, workers, lease_ms, max_leases_per_worker,
 * max_lease_text_bytes, lease_from, worker_name, fault_chunk_delay_ms (tests); common: data_dir, kv_dir,
 * model, threads, min_free_mb, disk_full_hold_s, and the socket options; blend.system_prompt fixes the
 * precompute context (it must be cb-blend's).
 * Exit: 0 after SIGINT/SIGTERM, 1 on a startup failure or when the worker cannot run.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/alloc.h"
#include "engine/backend_select.h"
#include "wire/bus.h"
#include "wire/config.h"
#include "wire/db.h"
#include "svc/kvremote_config.h"
#include "svc/svcconfig.h"
#include "ident.h"
#include "jobs.h"
#include "lease_client.h"
#include "lease_server.h"
#include "base/log.h"
#include "wire/msg.h"
#include "verify.h"
#include "worker.h"

#define SECTION "precompute"
#define MAX_DOC_ID 256
#define MAX_META_ENTRIES 64
#define MAX_CHECKS 1024       /* re-ingest checks waiting for the verifier; beyond it, not checked */

/* A re-ingest of a done job waiting for the verifier (verify.h). */
typedef struct check_s {
    cb_bus_req_t *req;        /* detached; NULL for a PULL message (no reply) */
    char job[CB_JOB_ID_LEN + 1];
    char client[CB_JOB_CLIENT_MAX + 1];
    char doc_id[MAX_DOC_ID + 1];
    struct check_s *next;
} check_t;

typedef struct {
    cb_bus_service_t *svc;
    cb_jobs_t *jobs;          /* NULL in the remote role */
    pc_lease_server_t *leases; /* the master's side of the lease protocol (NULL in the remote role) */
    const char *lease_from;   /* the remote role: the master's endpoint (NULL: this is the master) */
    int64_t n_workers;        /* worker threads here (0 or 1) */
    zactor_t *worker;
    zactor_t *verifier;       /* re-ingest checks (verify.h) */
    zsock_t *pull;
    int64_t max_doc_bytes;
    cb_jobs_limits_t limits;  /* per client, and over all */
    pc_ident_t *ident;        /* who an ingest comes from (ident.h) */
    int64_t stuck_ms;         /* health: a worker with work and no progress this long is stuck */
    pc_worker_stats_t *wst;   /* the worker's (worker.h) */
    cb_kvremote_t *remote;    /* the shared KV tier (common.kv_remote), or NULL */
    cb_diskhealth_t *disk;    /* the data disk (job table, KV dir) for ping: ok or degraded (diskhealth.h) */
    check_t *checks;          /* waiting for the verifier */
    int n_checks;
    bool worker_ready;
    bool fatal;
    uint64_t pulled, pull_dropped, overloaded, restored;
} precompute_t;

/* Validates an ingest message and records it for client. Returns CB_ERR_NONE with job, duplicate and state
 * (of a duplicate) set, or a code with a reason in why. */
static cb_err_t ingest(precompute_t *p, const cb_msg_t *m, const char *client, char job[CB_JOB_ID_LEN + 1],
                       bool *duplicate, cb_job_state_t *state, char *why, size_t whylen) {
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
    int rc = cb_jobs_submit(p->jobs, doc, doc_len, text, text_len, meta, client, &p->limits, job, duplicate, state,
                            err, sizeof err);
    free(meta);
    if (rc == 1) {
        p->overloaded++;
        snprintf(why, whylen, "%.400s", err);
        return CB_ERR_OVERLOADED;
    }
    if (rc != 0) {
        snprintf(why, whylen, "cannot record the document: %.400s", err);
        cb_diskhealth_note(p->disk, "job table", why); /* ping: degraded while the disk is full */
        return CB_ERR_INTERNAL;
    }
    if (!*duplicate) cb_diskhealth_ok(p->disk, "job table"); /* it was written */
    if (!*duplicate && p->worker) zstr_send(p->worker, "WORK");
    return CB_ERR_NONE;
}

/* The reply to an ingest: {job, duplicate, restored, client}. */
static void reply_ingest(precompute_t *p, cb_bus_req_t *req, const char *job, bool dup, bool restored,
                         const char *client) {
    cb_msg_writer_t *w = cb_bus_service_writer(p->svc);
    cb_msg_begin_reply_as(w, "ingest", cb_bus_req_id(req));
    cb_msg_put_str(w, "job", job);
    cb_msg_put_bool(w, "duplicate", dup);
    cb_msg_put_bool(w, "restored", restored);
    cb_msg_put_str(w, "client", client);
    cb_bus_reply(req, w);
}

/* A document ingested again after its job was done: asks the verifier whether it is still indexed and
 * cached (verify.h); the answer (and the reply, for a request) comes in on_verifier. False when it cannot be
 * asked (then it is a plain duplicate). req: detached by the caller on success, or NULL (PULL). */
static bool start_check(precompute_t *p, cb_bus_req_t *req, const char *job, const char *client) {
    if (!p->verifier || p->n_checks >= MAX_CHECKS) return false;
    cb_job_status_t st;
    cb_job_chunk_t *cs = NULL;
    int n = 0;
    char err[256];
    if (cb_jobs_status(p->jobs, job, &st, err, sizeof err) != 1 || st.state != CB_JOB_DONE ||
        cb_jobs_chunks(p->jobs, job, &cs, &n, err, sizeof err) != 0)
        return false;
    char *keys = cb_malloc((size_t)n * 64 + 1);
    check_t *c = cb_calloc(1, sizeof *c);
    if (!keys || !c) {
        free(keys);
        free(c);
        free(cs);
        return false;
    }
    for (int i = 0; i < n; i++) memcpy(keys + 64 * i, cs[i].key, 64);
    free(cs);
    snprintf(c->job, sizeof c->job, "%s", job);
    snprintf(c->client, sizeof c->client, "%s", client);
    snprintf(c->doc_id, sizeof c->doc_id, "%s", st.doc_id);
    if (req && !(c->req = cb_bus_req_detach(req))) {
        free(keys);
        free(c);
        return false;
    }
    zmsg_t *zm = zmsg_new();
    zmsg_addstr(zm, "CHECK");
    zmsg_addmem(zm, &c, sizeof c);
    zmsg_addstr(zm, st.doc_id);
    zmsg_addmem(zm, keys, (size_t)n * 64);
    if (strncmp(st.owner, "r:", 2) == 0) zmsg_addstr(zm, "remote"); /* its KV files are on the worker's host */
    free(keys);
    c->next = p->checks;
    p->checks = c;
    p->n_checks++;
    zmsg_send(&zm, p->verifier);
    return true;
}

/* The verifier's answer: a document found missing is queued again (restored), else it is a duplicate. */
static int on_verifier(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    precompute_t *p = arg;
    zmsg_t *zm = zmsg_recv(sock);
    if (!zm) return zsys_interrupted ? -1 : 0;
    char *what = zmsg_popstr(zm);
    zframe_t *tok = zmsg_pop(zm);
    char *verdict = zmsg_popstr(zm), *why = zmsg_popstr(zm);
    check_t *c = NULL, **pp = &p->checks;
    if (what && !strcmp(what, "CHECKED") && tok && zframe_size(tok) == sizeof c) {
        memcpy(&c, zframe_data(tok), sizeof c);
        while (*pp && *pp != c) pp = &(*pp)->next;
        if (*pp) {
            *pp = c->next;
            p->n_checks--;
        } else {
            c = NULL; /* not ours */
        }
    }
    if (c) {
        const char *rid = c->req ? cb_bus_req_id(c->req) : NULL;
        bool dup = true, restored = false;
        if (verdict && !strcmp(verdict, "missing")) {
            char err[512];
            int rc = cb_jobs_restore(p->jobs, c->job, c->client, &p->limits, &restored, err, sizeof err);
            if (rc == 1) {
                p->overloaded++;
                if (c->req) cb_bus_reply_error(c->req, CB_ERR_OVERLOADED, "%s", err);
                cb_log(CB_LOG_WARN, rid, "doc '%s' (job %s) is missing (%s) but not restored: %s", c->doc_id, c->job,
                       why ? why : "?", err);
                goto done;
            }
            if (rc < 0) cb_log(CB_LOG_ERROR, rid, "restore of job %s: %s", c->job, err);
            if (restored) {
                dup = false;
                p->restored++;
                if (p->worker) zstr_send(p->worker, "WORK");
                cb_log(CB_LOG_INFO, rid, "doc '%s' ingested again, its job %s was done but %s: queued again (restored)",
                       c->doc_id, c->job, why ? why : "?");
            }
        } else if (verdict && !strcmp(verdict, "unknown")) {
            cb_log(CB_LOG_WARN, rid, "doc '%s' ingested again: cannot check that it is still indexed (%s); taken as a "
                   "duplicate", c->doc_id, why ? why : "?");
        }
        if (c->req) reply_ingest(p, c->req, c->job, dup, restored, c->client);
    done:
        cb_bus_req_destroy(&c->req);
        free(c);
    }
    zstr_free(&what);
    zstr_free(&verdict);
    zstr_free(&why);
    zframe_destroy(&tok);
    zmsg_destroy(&zm);
    return 0;
}

static void on_ingest(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    (void)svc;
    precompute_t *p = arg;
    char job[CB_JOB_ID_LEN + 1], why[512];
    bool dup = false;
    cb_job_state_t state = CB_JOB_QUEUED;
    size_t plen;
    const uint8_t *peer = cb_bus_req_peer(req, &plen);
    pc_who_t who;
    cb_err_t code = pc_ident_resolve(p->ident, m, cb_bus_req_user_id(req), peer, plen, &who, why, sizeof why);
    if (code != CB_ERR_NONE) {
        cb_bus_reply_error(req, code, "%s", why);
        return;
    }
    code = ingest(p, m, who.principal, job, &dup, &state, why, sizeof why);
    if (code != CB_ERR_NONE) {
        if (code == CB_ERR_OVERLOADED)
            cb_log(CB_LOG_INFO, cb_bus_req_id(req), "ingest from %s refused: %s", who.identity, why);
        cb_bus_reply_error(req, code, "%s", why);
        return;
    }
    cb_log(CB_LOG_DEBUG, cb_bus_req_id(req), "ingest from %s -> job %s%s", who.identity, job, dup ? " (duplicate)" : "");
    if (dup && state == CB_JOB_DONE && start_check(p, req, job, who.principal)) return; /* answered in on_verifier */
    reply_ingest(p, req, job, dup, false, who.principal);
}

/* The remote role has no job table: documents go to the master. */
static void on_not_master(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    (void)svc;
    (void)m;
    precompute_t *p = arg;
    cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "this cb-precompute is a remote worker (precompute.lease_from): send "
                       "'%s' to the master at %s", cb_bus_req_type(req), p->lease_from);
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

/* How long the worker has had work without a sign of progress (0 when it has none). */
static double worker_age_ms(const precompute_t *p) {
    if (!atomic_load(&p->wst->busy)) return 0.0;
    double age = cb_now_ms() - (double)atomic_load(&p->wst->beat_ms);
    return age > 0.0 ? age : 0.0;
}

/* The remote role's fields (stats and ping): the master link and the leases. */
static void remote_fields(precompute_t *p, cb_msg_writer_t *w) {
    cb_msg_put_str(w, "master", p->lease_from);
    cb_msg_put_bool(w, "master_up", atomic_load(&p->wst->link_up));
    cb_msg_put_uint(w, "leases_held", atomic_load(&p->wst->leases_held));
    char e[sizeof p->wst->link_error];
    pthread_mutex_lock(&p->wst->mu);
    snprintf(e, sizeof e, "%s", p->wst->link_error);
    pthread_mutex_unlock(&p->wst->mu);
    if (e[0]) cb_msg_put_str(w, "master_error", e);
}

static void stats_extra(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg) {
    (void)svc;
    precompute_t *p = arg;
    int64_t counts[CB_JOB_STATE_COUNT_], chunks = 0;
    char err[256];
    cb_msg_put_str(w, "role", p->lease_from ? "remote" : "master");
    cb_msg_put_int(w, "workers", p->n_workers);
    if (p->lease_from) {
        remote_fields(p, w);
        cb_msg_put_uint(w, "leases_taken", atomic_load(&p->wst->leases_taken));
        cb_msg_put_uint(w, "leases_lost", atomic_load(&p->wst->leases_lost));
        cb_msg_put_uint(w, "master_errors", atomic_load(&p->wst->link_errors));
        cb_msg_put_uint(w, "kv_write_failed", atomic_load(&p->wst->kv_write_failed));
        cb_msg_put_uint(w, "storage_retries", atomic_load(&p->wst->storage_retries));
        cb_msg_put_uint(w, "turns", atomic_load(&p->wst->turns));
        cb_msg_put_double(w, "worker_age_ms", worker_age_ms(p));
        cb_msg_put_bool(w, "worker_ready", p->worker_ready);
        return;
    }
    if (p->leases) pc_lease_server_stats(p->leases, w);
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
    int64_t clients = 0;
    if (cb_jobs_clients_waiting(p->jobs, &clients, err, sizeof err) != 0) cb_log(CB_LOG_WARN, NULL, "stats: %s", err);
    cb_msg_put_int(w, "clients_waiting", clients);
    cb_msg_put_uint(w, "overloaded", p->overloaded);
    cb_msg_put_uint(w, "restored", p->restored);
    cb_msg_put_uint(w, "kv_write_failed", atomic_load(&p->wst->kv_write_failed));
    cb_msg_put_uint(w, "storage_retries", atomic_load(&p->wst->storage_retries));
    cb_msg_put_uint(w, "turns", atomic_load(&p->wst->turns));
    cb_msg_put_double(w, "worker_age_ms", worker_age_ms(p));
    cb_msg_put_bool(w, "worker_ready", p->worker_ready);
    cb_kvremote_put_stats(w, p->remote);
}

/* Health (`ping`): the worker is not stuck (work in hand, no progress for stuck_ms). */
static const char *health(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg, char *why, size_t whylen) {
    (void)svc;
    precompute_t *p = arg;
    double age = worker_age_ms(p);
    cb_msg_put_str(w, "role", p->lease_from ? "remote" : "master");
    if (p->lease_from) remote_fields(p, w);
    cb_msg_put_bool(w, "worker_ready", p->worker_ready);
    cb_msg_put_double(w, "worker_age_ms", age);
    if (age > (double)p->stuck_ms) {
        char what[sizeof p->wst->what];
        pthread_mutex_lock(&p->wst->mu);
        snprintf(what, sizeof what, "%s", p->wst->what);
        pthread_mutex_unlock(&p->wst->mu);
        snprintf(why, whylen, "the worker is stuck: no progress for %.0f ms (precompute.stuck_ms = %lld) on %s", age,
                 (long long)p->stuck_ms, what);
        return why;
    }
    return NULL;
}

/* A document on the PULL socket: same validation, no reply; invalid ones are logged and dropped. */
static int on_pull(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    precompute_t *p = arg;
    char user_id[CB_BUS_USER_ID_MAX + 1];
    zmsg_t *zm = cb_bus_recv_zmsg(sock, user_id, sizeof user_id);
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
    bool dup = false;
    cb_job_state_t state = CB_JOB_QUEUED;
    pc_who_t who;
    cb_err_t code = pc_ident_resolve(p->ident, m, user_id, NULL, 0, &who, why, sizeof why);
    if (code == CB_ERR_NONE) code = ingest(p, m, who.principal, job, &dup, &state, why, sizeof why);
    if (code != CB_ERR_NONE) {
        cb_log(CB_LOG_WARN, cb_msg_id(m), "pull: dropped ingest: %s: %s", cb_err_name(code), why);
        p->pull_dropped++;
    } else {
        cb_log(CB_LOG_INFO, cb_msg_id(m), "pull ingest from %s -> job %s%s", who.identity, job, dup ? " (duplicate)" : "");
        if (dup && state == CB_JOB_DONE) start_check(p, NULL, job, who.principal);
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
               "  chunk_tokens, max_doc_bytes, max_queued_jobs_per_client, max_queued_bytes_per_client,\n"
               "  max_queued_jobs, max_queued_bytes, trusted_forwarders (docs/protocol.md section 6),\n"
               "  retriever_timeout_ms, cacheindex_timeout_ms, verify_timeout_ms, stuck_ms, workers, lease_ms,\n"
               "  max_leases_per_worker, max_lease_text_bytes, lease_from (run as a remote worker of that master),\n"
               "  worker_name, fault_chunk_delay_ms (tests), and common.* (data_dir, kv_dir, model, threads,\n"
               "  min_free_mb, disk_full_hold_s, ...);\n"
               "  blend.system_prompt; engine.kv_dtype (f16|f32), engine.attn (auto|bf16|int16|f32). Leases: docs/leases.md.\n"
               "  Environment CB_PRECOMPUTE_<KEY> overrides the file.\n");
}

int main(int argc, char **argv) {
    cb_bus_init("cb-precompute");
    char err[1024];
    int exit_code;
    cb_config_t *cfg = cb_bus_service_config(SECTION, &argc, argv, usage, &exit_code);
    if (!cfg) return exit_code;
    precompute_t p = {0};
    static pc_worker_args_t wa;
    static pc_worker_stats_t wst;
    static pc_verify_args_t va;
    pthread_mutex_init(&wst.mu, NULL);
    snprintf(wst.what, sizeof wst.what, "loading the model");
    p.wst = &wst;
    wa.stats = &wst;
    int rc = 1;
    int64_t chunk_tokens, rt, ct, vt, fault_delay, lease_ms, max_leases, max_lease_text;
    const char *backend, *pull_ep = NULL, *pull_bind = NULL, *worker_name = "";
    const char *forwarders = "gateway";
    wa.cfg = cfg;
    if (!cb_config_int(cfg, SECTION, "chunk_tokens", 16, 8192, 512, &chunk_tokens, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_doc_bytes", 1, (int64_t)1 << 30, 4 << 20, &p.max_doc_bytes, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "retriever_timeout_ms", 1, 3600000, 5000, &rt, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "cacheindex_timeout_ms", 1, 3600000, 5000, &ct, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "verify_timeout_ms", 1, 60000, 1000, &vt, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_queued_jobs_per_client", 0, INT64_MAX, 10000, &p.limits.max_jobs, err,
                       sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_queued_bytes_per_client", 0, INT64_MAX, (int64_t)64 << 20,
                       &p.limits.max_bytes, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_queued_jobs", 0, INT64_MAX, 50000, &p.limits.max_total_jobs, err,
                       sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_queued_bytes", 0, INT64_MAX, (int64_t)1 << 30, &p.limits.max_total_bytes,
                       err, sizeof err) ||
        !cb_config_str(cfg, SECTION, "trusted_forwarders", "gateway", &forwarders, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "stuck_ms", 100, 86400000, 120000, &p.stuck_ms, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "fault_chunk_delay_ms", 0, 3600000, 0, &fault_delay, err, sizeof err) ||
        !cb_config_str(cfg, SECTION, "backend", "auto", &backend, err, sizeof err) ||
        !cb_config_endpoint(cfg, SECTION, "pull_endpoint", NULL, &pull_ep, err, sizeof err) ||
        !cb_config_endpoint(cfg, SECTION, "pull_bind", NULL, &pull_bind, err, sizeof err) ||
        !cb_config_data_path(cfg, SECTION, "db", "precompute.db", wa.db_path, sizeof wa.db_path, err, sizeof err) ||
        !cb_config_data_path(cfg, SECTION, "kv_dir", "kv", wa.kv_dir, sizeof wa.kv_dir, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "workers", 0, 1, 1, &p.n_workers, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "lease_ms", 100, 3600000, 15000, &lease_ms, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_leases_per_worker", 0, 1024, 2, &max_leases, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_lease_text_bytes", 0, (int64_t)1 << 30, 0, &max_lease_text, err,
                       sizeof err) ||
        !cb_config_endpoint(cfg, SECTION, "lease_from", NULL, &p.lease_from, err, sizeof err) ||
        !cb_config_str(cfg, SECTION, "worker_name", "", &worker_name, err, sizeof err)) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    if (cb_svc_session_config(cfg, SECTION, &wa.session, err, sizeof err) != 0) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    wa.session.kv_dir = wa.kv_dir;
    cb_backend_kind_t bk;
    if (!cb_backend_kind_parse(backend, &bk)) {
        cb_log(CB_LOG_ERROR, NULL, "config precompute.backend = '%s': expected auto, cpu or cuda", backend);
        goto out;
    }
    cb_backend_set_default_kind(bk);
    if (p.max_doc_bytes > (int64_t)1 << 30) p.max_doc_bytes = (int64_t)1 << 30;
    wa.chunk_tokens = (int)chunk_tokens;
    wa.retriever_timeout_ms = (int)rt;
    wa.cacheindex_timeout_ms = (int)ct;
    wa.fault_chunk_delay_ms = (int)fault_delay;
    if (fault_delay > 0)
        cb_log(CB_LOG_WARN, NULL, "fault injection: every chunk waits %lld ms first", (long long)fault_delay);
    va.cfg = cfg;
    va.timeout_ms = (int)vt;
    cb_config_log(cfg, SECTION);
    wa.local_lease_ms = p.stuck_ms; /* a local turn that long is stuck: its job may go to a remote worker */
    wa.max_doc_bytes = p.max_doc_bytes;
    if (p.lease_from) {
        if (p.n_workers == 0) {
            cb_log(CB_LOG_ERROR, NULL, "precompute.lease_from is set (a remote worker) but precompute.workers = 0");
            goto out;
        }
        snprintf(wa.lease_from, sizeof wa.lease_from, "%s", p.lease_from);
        if (worker_name[0]) {
            snprintf(wa.worker_name, sizeof wa.worker_name, "%s", worker_name);
        } else { /* host-pid: unique per process, so a restarted worker never inherits a stale lease's limit */
            char host[64] = "worker";
            gethostname(host, sizeof host - 1);
            host[sizeof host - 1] = 0;
            for (char *c = host; *c; c++)
                if (*c <= 0x20 || *c > 0x7e) *c = '_';
            snprintf(wa.worker_name, sizeof wa.worker_name, "%.40s-%d", host, (int)getpid());
        }
        if (cb_db_mkdirs(wa.kv_dir, err, sizeof err) != 0) {
            cb_log(CB_LOG_ERROR, NULL, "%s", err);
            goto out;
        }
        cb_log(CB_LOG_INFO, NULL, "remote worker '%s': leasing jobs from %s, KV files in %s", wa.worker_name,
               p.lease_from, wa.kv_dir);
    } else {
        if (cb_db_mkdirs(wa.kv_dir, err, sizeof err) != 0 || !(p.jobs = cb_jobs_open(wa.db_path, err, sizeof err)) ||
            cb_jobs_release_owner(p.jobs, "local", err, sizeof err) < 0) { /* our last run's turns */
            cb_log(CB_LOG_ERROR, NULL, "%s", err);
            goto out;
        }
        int64_t counts[CB_JOB_STATE_COUNT_], chunks, live = 0, lapsed = 0;
        if (cb_jobs_counts(p.jobs, counts, &chunks, err, sizeof err) == 0 &&
            cb_jobs_lease_counts(p.jobs, &live, &lapsed, err, sizeof err) == 0)
            cb_log(CB_LOG_INFO, NULL, "job table %s: %lld queued, %lld unfinished (%lld leased), %lld done, %lld failed",
                   wa.db_path, (long long)counts[0], (long long)counts[1], (long long)live, (long long)counts[2],
                   (long long)counts[3]);
    }
    p.svc = cb_bus_service_from_config("cb-precompute", cfg, SECTION, err, sizeof err);
    if (!p.svc) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    if (!p.lease_from) {
        const cb_curve_t *cv = &cb_bus_service_opts(p.svc)->curve;
        if (!(p.ident = pc_ident_new(cv, cb_bus_service_is_worker(p.svc), forwarders, err, sizeof err))) {
            cb_log(CB_LOG_ERROR, NULL, "%s", err);
            goto out;
        }
        if (cv->on)
            cb_log(CB_LOG_INFO, NULL, "ingest clients are their CURVE keys; %d trusted forwarder(s) may send "
                   "on_behalf_of (precompute.trusted_forwarders = \"%s\")", pc_ident_forwarders(p.ident), forwarders);
        else
            cb_log(CB_LOG_INFO, NULL, "ingest clients are what they declare (common.curve = off: nothing is "
                   "authenticated); at most %lld documents, %lld bytes queued in all", (long long)p.limits.max_total_jobs,
                   (long long)p.limits.max_total_bytes);
    }
    if (!p.lease_from) {
        /* a lease carries the text and the plan in one message: leave room for the plan */
        int64_t fit = cb_bus_service_opts(p.svc)->max_msg_bytes / 4;
        if (max_lease_text == 0 || max_lease_text > fit) max_lease_text = fit;
        if (p.n_workers == 0 && p.max_doc_bytes > max_lease_text) {
            cb_log(CB_LOG_WARN, NULL, "no worker here (precompute.workers = 0): documents are limited to what a lease "
                   "carries, %lld bytes (max_msg_bytes / 4), not max_doc_bytes = %lld", (long long)max_lease_text,
                   (long long)p.max_doc_bytes);
            p.max_doc_bytes = max_lease_text;
        }
        pc_lease_opts_t lo = {.lease_ms = lease_ms, .max_per_worker = (int)max_leases, .max_text_bytes = max_lease_text,
                              .max_doc_bytes = p.max_doc_bytes};
        if (!(p.leases = pc_lease_server_new(p.svc, p.jobs, &lo, err, sizeof err))) {
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
        cb_log(CB_LOG_INFO, NULL, "leasing jobs to remote workers: leases of %lld ms, at most %lld per worker, "
               "documents up to %lld bytes", (long long)lease_ms, (long long)max_leases, (long long)max_lease_text);
    }
    if (cb_kvremote_from_config(cfg, SECTION, &p.remote, err, sizeof err) != 0) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    wa.session.remote = p.remote;
    if (!(p.disk = cb_diskhealth_from_config(cfg, SECTION, err, sizeof err))) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    if (!p.lease_from) cb_diskhealth_watch_file(p.disk, "job table", wa.db_path);
    cb_diskhealth_watch(p.disk, "KV dir", wa.kv_dir);
    wa.disk = p.disk;
    cb_bus_service_set_disk(p.svc, p.disk);
    if (p.n_workers > 0) {
        p.worker = zactor_new(pc_worker_actor, &wa);
        if (!p.worker) {
            cb_log(CB_LOG_ERROR, NULL, "cannot start the worker thread");
            goto out;
        }
    } else {
        p.worker_ready = true; /* nothing to load: jobs wait for remote workers */
        cb_log(CB_LOG_INFO, NULL, "no worker thread here (precompute.workers = 0): remote workers do the jobs");
    }
    snprintf(va.kv_dir, sizeof va.kv_dir, "%s", wa.kv_dir);
    if (!p.lease_from && !(p.verifier = zactor_new(pc_verify_actor, &va)))
        cb_log(CB_LOG_WARN, NULL, "cannot start the verifier thread: re-ingested documents are not checked");
    zloop_t *loop = cb_bus_service_loop(p.svc);
    if (p.worker) zloop_reader(loop, (zsock_t *)p.worker, on_worker, &p);
    if (p.verifier) zloop_reader(loop, (zsock_t *)p.verifier, on_verifier, &p);
    if (p.pull) zloop_reader(loop, p.pull, on_pull, &p);
    cb_bus_service_on(p.svc, "ingest", p.lease_from ? on_not_master : on_ingest, &p);
    cb_bus_service_on(p.svc, "status", p.lease_from ? on_not_master : on_status, &p);
    cb_bus_service_set_stats(p.svc, stats_extra, &p);
    cb_bus_service_set_health(p.svc, health, &p);
    rc = cb_bus_service_run(p.svc) == 0 && !p.fatal ? 0 : 1;
out:
    zactor_destroy(&p.verifier); /* $TERM: after the check in progress (bounded by verify_timeout_ms) */
    while (p.checks) {           /* their requests go with the service */
        check_t *c = p.checks;
        p.checks = c->next;
        free(c);
    }
    zactor_destroy(&p.worker); /* $TERM: the worker stops after its current step */
    zsock_destroy(&p.pull);
    cb_bus_service_destroy(&p.svc);
    pc_lease_server_destroy(&p.leases);
    cb_jobs_close(&p.jobs);
    pc_ident_destroy(&p.ident);
    cb_kvremote_destroy(&p.remote);
    cb_diskhealth_destroy(&p.disk); /* after the worker and the service, its users */
    cb_config_destroy(&cfg);
    if (rc == 0) cb_log(CB_LOG_INFO, NULL, "bye");
    return rc;
}
