/* lease_server.c: the lease messages of the master cb-precompute (see lease_server.h). */
#include "lease_server.h"
#include "base/alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "lease_client.h"

struct pc_lease_server {
    cb_bus_service_t *svc;
    cb_jobs_t *jobs;
    pc_lease_opts_t o;
    char last[CB_JOB_CLIENT_MAX + 1]; /* the client whose turn the last grant was */
    uint64_t granted, expired, renewed, stale, released, finished, over_limit;
};

/* The stale-token answer: the worker drops the job. */
static void reply_stale(pc_lease_server_t *s, cb_bus_req_t *req, const char *job) {
    s->stale++;
    cb_bus_reply_error(req, CB_ERR_NOT_FOUND, "lease gone: job %s is not leased with this token (it expired and was "
                       "granted again, or the job ended)", job);
}

/* The outcome r of a token-checked job-table call (1 done, 0 stale, 2 refused: err, -1 database error:
 * err): true when it is done, else the error reply is sent. */
static bool lease_done(pc_lease_server_t *s, cb_bus_req_t *req, const char *job, int r, const char *err) {
    if (r == 1) return true;
    if (r == 0) reply_stale(s, req, job);
    else cb_bus_reply_error(req, r < 0 ? CB_ERR_INTERNAL : CB_ERR_BAD_REQUEST, "%s", err);
    return false;
}

/* Reads {job, token} of a request into job/token. False after an error reply. */
static bool job_token(cb_bus_req_t *req, const cb_msg_t *m, char job[CB_JOB_ID_LEN + 1],
                      char token[CB_JOB_TOKEN_LEN + 1]) {
    const char *s;
    size_t n;
    if (!cb_msg_hex(m, "job", CB_JOB_ID_LEN, CB_JOB_ID_LEN, &s, &n)) goto bad;
    memcpy(job, s, n);
    job[n] = 0;
    if (!cb_msg_hex(m, "token", CB_JOB_TOKEN_LEN, CB_JOB_TOKEN_LEN, &s, &n)) goto bad;
    memcpy(token, s, n);
    token[n] = 0;
    return true;
bad:
    cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
    return false;
}

/* The reply to a granted lease: the job, its text and its plan. 0, or -1 when it does not fit a message
 * (err; nothing sent). */
static int reply_lease(pc_lease_server_t *s, cb_bus_req_t *req, const cb_msg_t *m, const cb_job_lease_t *l,
                       const cb_job_t *job, const cb_job_chunk_t *cs, int n, char *err, size_t errlen) {
    cb_msg_writer_t *w = cb_bus_service_writer(s->svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_str(w, "job", job->job);
    cb_msg_put_str(w, "token", l->token);
    cb_msg_put_int(w, "lease_ms", s->o.lease_ms);
    cb_msg_put_str(w, "doc_id", job->doc_id);
    cb_msg_put_strn(w, "text", job->text, job->text_len);
    cb_msg_put_str(w, "client", job->client);
    cb_msg_put_bool(w, "planned", job->planned);
    cb_msg_put_bool(w, "replaced", job->replaced);
    cb_msg_put_bool(w, "has_older", job->has_older);
    cb_msg_put_int(w, "chunks_done", job->chunks_done);
    if (job->planned) {
        static const char *const fields[] = {"off", "len", "tokens", "keys", "done"};
        for (int f = 0; f < 5; f++) {
            cb_msg_begin_array(w, fields[f]);
            for (int i = 0; i < n; i++) {
                if (f == 0) cb_msg_put_int(w, NULL, cs[i].off);
                else if (f == 1) cb_msg_put_int(w, NULL, cs[i].len);
                else if (f == 2) cb_msg_put_int(w, NULL, cs[i].n_tokens);
                else if (f == 3) cb_msg_put_str(w, NULL, cs[i].key);
                else cb_msg_put_int(w, NULL, cs[i].done ? 1 : 0);
            }
            cb_msg_end_array(w);
        }
    }
    size_t len;
    const void *data = cb_msg_end(w, &len);
    if (!data || (int64_t)len > cb_bus_service_opts(s->svc)->max_msg_bytes) {
        snprintf(err, errlen, "the lease of this job does not fit a message (%s; max_msg_bytes = %lld)",
                 data ? "too large" : cb_msg_writer_error(w), (long long)cb_bus_service_opts(s->svc)->max_msg_bytes);
        return -1;
    }
    cb_bus_reply_bytes(req, data, len);
    return 0;
}

static void on_lease(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    (void)svc;
    pc_lease_server_t *s = arg;
    const char *name;
    size_t n;
    if (!cb_msg_str(m, "worker", PC_LEASE_WORKER_MAX, &name, &n)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    if (!pc_lease_worker_name_valid(name, n)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "field 'worker': 1..%d printable ASCII characters, no spaces",
                           PC_LEASE_WORKER_MAX);
        return;
    }
    char owner[CB_JOB_OWNER_MAX + 1], err[768], after[CB_JOB_CLIENT_MAX + 1];
    snprintf(owner, sizeof owner, "r:%.*s", (int)n, name);
    snprintf(after, sizeof after, "%s", s->last);
    cb_job_lease_t l;
    int r = cb_jobs_lease(s->jobs, after, owner, s->o.lease_ms, s->o.max_text_bytes, s->o.max_per_worker, &l, err,
                          sizeof err);
    if (r == 2) {
        s->over_limit++;
        cb_bus_reply_error(req, CB_ERR_OVERLOADED, "%s", err);
        return;
    }
    if (r < 0) {
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "%s", err);
        return;
    }
    if (r == 0) {
        cb_msg_writer_t *w = cb_bus_service_writer(s->svc);
        cb_msg_begin_reply(w, m);
        cb_msg_put_bool(w, "none", true);
        cb_bus_reply(req, w);
        return;
    }
    snprintf(s->last, sizeof s->last, "%s", l.client);
    cb_job_t *job = NULL;
    cb_job_chunk_t *cs = NULL;
    int nch = 0;
    int g = cb_jobs_get(s->jobs, l.job, &job, err, sizeof err);
    if (g == 1 && job->planned && cb_jobs_chunks(s->jobs, l.job, &cs, &nch, err, sizeof err) != 0) g = -1;
    if (g != 1) {
        char e2[128];
        cb_jobs_lease_release(s->jobs, l.job, l.token, e2, sizeof e2);
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "%s", g < 0 ? err : "the job ended meanwhile");
        cb_job_free(&job);
        return;
    }
    if (reply_lease(s, req, m, &l, job, cs, nch, err, sizeof err) != 0) {
        /* cannot be leased, and with no local worker nobody else can do it: it fails with the reason */
        bool already;
        char e2[128];
        cb_log(CB_LOG_ERROR, l.job, "doc '%s': %s: failed", job->doc_id, err);
        cb_jobs_lease_finish(s->jobs, l.job, l.token, false, err, &already, e2, sizeof e2);
        cb_bus_reply_error(req, CB_ERR_TOO_LARGE, "%s", err);
    } else {
        s->granted++;
        if (l.lapsed) s->expired++;
        cb_log(CB_LOG_INFO, l.job, "doc '%s' leased to %s for %lld ms%s", job->doc_id, owner, (long long)s->o.lease_ms,
               l.lapsed ? " (its last lease had expired)" : "");
    }
    free(cs);
    cb_job_free(&job);
}

static void on_renew(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    pc_lease_server_t *s = arg;
    char job[CB_JOB_ID_LEN + 1], token[CB_JOB_TOKEN_LEN + 1], err[256];
    if (!job_token(req, m, job, token)) return;
    int r = cb_jobs_lease_renew(s->jobs, job, token, s->o.lease_ms, err, sizeof err);
    if (!lease_done(s, req, job, r, err)) return;
    s->renewed++;
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_int(w, "lease_ms", s->o.lease_ms);
    cb_bus_reply(req, w);
}

static void on_plan(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    pc_lease_server_t *s = arg;
    char job[CB_JOB_ID_LEN + 1], token[CB_JOB_TOKEN_LEN + 1], err[256];
    if (!job_token(req, m, job, token)) return;
    size_t n = 0, n2, n3, n4;
    if (!cb_msg_array_len(m, "off", PC_LEASE_MAX_CHUNKS, &n) || !cb_msg_array_len(m, "len", n, &n2) ||
        !cb_msg_array_len(m, "tokens", n, &n3) || !cb_msg_array_len(m, "keys", n, &n4)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    if (n2 != n || n3 != n || n4 != n) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "fields 'off', 'len', 'tokens', 'keys': arrays of one length");
        return;
    }
    cb_job_chunk_t *cs = n ? cb_calloc(n, sizeof *cs) : NULL;
    if (n && !cs) {
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "out of memory");
        return;
    }
    for (size_t i = 0; i < n; i++) {
        int64_t off, len, toks;
        const char *key;
        size_t nkey;
        if (!cb_msg_at_int(m, "off", i, 0, s->o.max_doc_bytes - 1, &off) ||
            !cb_msg_at_int(m, "len", i, 1, s->o.max_doc_bytes - off, &len) ||
            !cb_msg_at_int(m, "tokens", i, 0, 1 << 20, &toks) || !cb_msg_at_hex(m, "keys", i, 64, 64, &key, &nkey)) {
            free(cs);
            cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
            return;
        }
        cs[i] = (cb_job_chunk_t){.off = off, .len = len, .n_tokens = (int)toks};
        memcpy(cs[i].key, key, 64);
        cs[i].key[64] = 0;
    }
    int64_t total = 0;
    int r = cb_jobs_lease_plan(s->jobs, job, token, s->o.lease_ms, cs, (int)n, &total, err, sizeof err);
    free(cs);
    if (!lease_done(s, req, job, r, err)) return;
    cb_log(CB_LOG_INFO, job, "planned by a remote worker: %lld chunks", (long long)total);
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_int(w, "chunks_total", total);
    cb_bus_reply(req, w);
}

static void on_replaced(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    pc_lease_server_t *s = arg;
    char job[CB_JOB_ID_LEN + 1], token[CB_JOB_TOKEN_LEN + 1], err[256];
    if (!job_token(req, m, job, token)) return;
    int r = cb_jobs_lease_replaced(s->jobs, job, token, s->o.lease_ms, err, sizeof err);
    if (!lease_done(s, req, job, r, err)) return;
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_bus_reply(req, w);
}

static void on_chunk_done(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    pc_lease_server_t *s = arg;
    char job[CB_JOB_ID_LEN + 1], token[CB_JOB_TOKEN_LEN + 1], err[256];
    if (!job_token(req, m, job, token)) return;
    int64_t idx;
    if (!cb_msg_int(m, "idx", 0, PC_LEASE_MAX_CHUNKS - 1, &idx)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    int r = cb_jobs_lease_chunk_done(s->jobs, job, token, (int)idx, s->o.lease_ms, err, sizeof err);
    if (!lease_done(s, req, job, r, err)) return;
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_int(w, "lease_ms", s->o.lease_ms);
    cb_bus_reply(req, w);
}

static void on_finish(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    pc_lease_server_t *s = arg;
    char job[CB_JOB_ID_LEN + 1], token[CB_JOB_TOKEN_LEN + 1], err[256];
    if (!job_token(req, m, job, token)) return;
    bool ok;
    const char *why = NULL;
    size_t nwhy = 0;
    if (!cb_msg_bool(m, "done", &ok) || (cb_msg_has(m, "why") && !cb_msg_str(m, "why", 700, &why, &nwhy))) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    char whybuf[701];
    snprintf(whybuf, sizeof whybuf, "%.*s", (int)nwhy, why ? why : "");
    bool already = false;
    int r = cb_jobs_lease_finish(s->jobs, job, token, ok, ok ? NULL : (whybuf[0] ? whybuf : "failed on a remote worker"),
                                 &already, err, sizeof err);
    if (!lease_done(s, req, job, r, err)) return;
    if (!already) {
        s->finished++;
        if (ok) cb_log(CB_LOG_INFO, job, "done by a remote worker");
        else cb_log(CB_LOG_WARN, job, "failed on a remote worker: %s", whybuf);
    }
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_bool(w, "already", already);
    cb_bus_reply(req, w);
}

static void on_release(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    pc_lease_server_t *s = arg;
    char job[CB_JOB_ID_LEN + 1], token[CB_JOB_TOKEN_LEN + 1], err[256];
    if (!job_token(req, m, job, token)) return;
    int r = cb_jobs_lease_release(s->jobs, job, token, err, sizeof err);
    if (r < 0) {
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "%s", err);
        return;
    }
    if (r == 1) {
        s->released++;
        cb_log(CB_LOG_INFO, job, "lease given back by its worker");
    }
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_bool(w, "released", r == 1);
    cb_bus_reply(req, w);
}

pc_lease_server_t *pc_lease_server_new(cb_bus_service_t *svc, cb_jobs_t *jobs, const pc_lease_opts_t *o, char *err,
                                       size_t errlen) {
    pc_lease_server_t *s = cb_calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    s->svc = svc;
    s->jobs = jobs;
    s->o = *o;
    struct {
        const char *type;
        cb_bus_handler_fn *fn;
    } routes[] = {{"lease", on_lease},           {"renew", on_renew},   {"plan", on_plan},
                  {"replaced", on_replaced},     {"chunk_done", on_chunk_done},
                  {"finish", on_finish},         {"release", on_release}};
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (cb_bus_service_on(svc, routes[i].type, routes[i].fn, s) != 0) {
            snprintf(err, errlen, "cannot route '%s'", routes[i].type);
            free(s);
            return NULL;
        }
    return s;
}

void pc_lease_server_destroy(pc_lease_server_t **self_p) {
    if (!self_p || !*self_p) return;
    free(*self_p);
    *self_p = NULL;
}

void pc_lease_server_stats(pc_lease_server_t *s, cb_msg_writer_t *w) {
    int64_t live = 0, lapsed = 0;
    char err[256];
    if (cb_jobs_lease_counts(s->jobs, &live, &lapsed, err, sizeof err) != 0) cb_log(CB_LOG_WARN, NULL, "stats: %s", err);
    cb_msg_put_uint(w, "leases_granted", s->granted);
    cb_msg_put_uint(w, "leases_expired", s->expired);
    cb_msg_put_uint(w, "leases_renewed", s->renewed);
    cb_msg_put_uint(w, "leases_stale", s->stale);
    cb_msg_put_uint(w, "leases_released", s->released);
    cb_msg_put_uint(w, "leases_finished", s->finished);
    cb_msg_put_uint(w, "leases_over_limit", s->over_limit);
    cb_msg_put_int(w, "leases_live", live);
    cb_msg_put_int(w, "leases_lapsed", lapsed);
    cb_msg_put_int(w, "lease_ms", s->o.lease_ms);
}
