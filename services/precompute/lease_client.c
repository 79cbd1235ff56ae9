/* lease_client.c: a remote precompute worker's job source, leased from the master (see lease_client.h). */
#include "lease_client.h"
#include "base/alloc.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "wire/bus.h"
#include "wire/msg.h"

#define MAX_DOC_ID 256
#define RENEW_MIN_MS 100

/* The lease in hand, shared with the renewer thread (under mu; lost is read without it). */
typedef struct {
    pthread_mutex_t mu;
    bool holding;
    char job[CB_JOB_ID_LEN + 1], token[CB_JOB_TOKEN_LEN + 1];
    int64_t every_ms;            /* renew this often (lease_ms / 3) */
    atomic_bool lost;            /* the master said the lease is gone */
} hold_t;

typedef struct {
    const pc_worker_args_t *a;
    pc_worker_stats_t *st;
    cb_bus_opts_t opts;          /* section precompute, plus the master's key when CURVE is on */
    cb_bus_client_t *master;
    cb_msg_writer_t *w;
    cb_job_chunk_t *chunks;      /* [n_chunks] the plan of the job in hand, with done flags */
    int n_chunks;
    hold_t hold;
    zactor_t *renewer;
} lease_src_t;

bool pc_lease_worker_name_valid(const char *name, size_t len) {
    if (!name || len == 0 || len > PC_LEASE_WORKER_MAX) return false;
    for (size_t i = 0; i < len; i++)
        if (name[i] <= 0x20 || name[i] > 0x7e) return false;
    return true;
}

static void link_state(lease_src_t *l, bool up, const char *why) {
    atomic_store(&l->st->link_up, up);
    pthread_mutex_lock(&l->st->mu);
    snprintf(l->st->link_error, sizeof l->st->link_error, "%s", up ? "" : why);
    pthread_mutex_unlock(&l->st->mu);
}

/* Sends the message finished in l->w to the master. PC_SRC_OK with *reply (caller owns); PC_SRC_STALE
 * (`not_found`: the lease is gone); PC_SRC_RETRY (no answer, or overloaded/unavailable/timeout); PC_SRC_FAIL
 * (any other error reply, or a message that cannot be sent). err says why. */
static pc_src_rc_t call(lease_src_t *l, const char *what, cb_msg_t **reply, char *err, size_t errlen) {
    *reply = NULL;
    size_t len;
    const void *data = cb_msg_end(l->w, &len);
    if (!data) {
        snprintf(err, errlen, "cannot encode %s: %s", what, cb_msg_writer_error(l->w));
        return PC_SRC_FAIL;
    }
    if ((int64_t)len > l->opts.max_msg_bytes) {
        snprintf(err, errlen, "%s: %zu bytes, more than max_msg_bytes (%lld)", what, len,
                 (long long)l->opts.max_msg_bytes);
        return PC_SRC_FAIL;
    }
    cb_err_t code = CB_ERR_NONE;
    char e[512];
    cb_msg_t *m = cb_bus_request(l->master, data, len, &code, e, sizeof e);
    if (!m) {
        atomic_fetch_add(&l->st->link_errors, 1);
        snprintf(err, errlen, "master %s: %s: %s", l->a->lease_from, what, e);
        link_state(l, false, err);
        return PC_SRC_RETRY;
    }
    link_state(l, true, NULL);
    if (cb_msg_ok(m)) {
        *reply = m;
        return PC_SRC_OK;
    }
    code = cb_msg_err_code(m);
    snprintf(err, errlen, "master: %s: %s: %s", what, cb_msg_err_code_name(m), cb_msg_err_message(m));
    cb_msg_destroy(&m);
    if (code == CB_ERR_NOT_FOUND) return PC_SRC_STALE;
    if (code == CB_ERR_OVERLOADED || code == CB_ERR_UNAVAILABLE || code == CB_ERR_TIMEOUT || code == CB_ERR_INTERNAL)
        return PC_SRC_RETRY;
    return PC_SRC_FAIL;
}

/* The start of a request about job: {job, token}. */
static void begin_job(lease_src_t *l, const char *type, const cb_job_t *job) {
    char id[32];
    cb_msg_begin(l->w, type, cb_bus_new_id(id, sizeof id));
    cb_msg_put_str(l->w, "job", job->job);
    cb_msg_put_str(l->w, "token", job->token);
}

static void hold_set(lease_src_t *l, const cb_job_t *job, int64_t lease_ms) {
    pthread_mutex_lock(&l->hold.mu);
    l->hold.holding = job != NULL;
    if (job) {
        snprintf(l->hold.job, sizeof l->hold.job, "%s", job->job);
        snprintf(l->hold.token, sizeof l->hold.token, "%s", job->token);
        l->hold.every_ms = lease_ms / 3 > RENEW_MIN_MS ? lease_ms / 3 : RENEW_MIN_MS;
    }
    atomic_store(&l->hold.lost, false);
    pthread_mutex_unlock(&l->hold.mu);
    atomic_store(&l->st->leases_held, job ? 1 : 0);
    zstr_send(l->renewer, "WAKE");
}

/* The job in hand is over for us (finished, lost or given back). */
static void let_go(lease_src_t *l) {
    hold_set(l, NULL, 0);
    free(l->chunks);
    l->chunks = NULL;
    l->n_chunks = 0;
}

/* ---- the renewer thread --------------------------------------------------------------------------------- */

static void renewer_actor(zsock_t *pipe, void *args) {
    lease_src_t *l = args;
    zsock_signal(pipe, 0);
    char err[512];
    cb_bus_client_t *c = cb_bus_client_new(l->a->lease_from, &l->opts, err, sizeof err);
    cb_msg_writer_t *w = cb_msg_writer_new();
    if (!c || !w) cb_log(CB_LOG_ERROR, NULL, "lease renewer: %s", c ? "out of memory" : err);
    if (c) cb_bus_client_set_timeout(c, 2000, 0); /* one attempt: the next one comes a third of a lease later */
    zpoller_t *poller = zpoller_new(pipe, NULL);
    int64_t wait_ms = 1000;
    while (poller) {
        void *which = zpoller_wait(poller, (int)wait_ms);
        if (which == pipe) {
            char *cmd = zstr_recv(pipe);
            bool term = !cmd || strcmp(cmd, "$TERM") == 0;
            zstr_free(&cmd);
            if (term) break;
            /* WAKE: the lease changed; the next renewal is a third of a lease from now */
        } else if (zpoller_terminated(poller)) {
            break;
        }
        char job[CB_JOB_ID_LEN + 1], token[CB_JOB_TOKEN_LEN + 1];
        pthread_mutex_lock(&l->hold.mu);
        bool holding = l->hold.holding && !atomic_load(&l->hold.lost);
        snprintf(job, sizeof job, "%s", l->hold.job);
        snprintf(token, sizeof token, "%s", l->hold.token);
        wait_ms = holding ? l->hold.every_ms : 1000;
        pthread_mutex_unlock(&l->hold.mu);
        if (!holding || which == pipe || !c || !w) continue;
        char id[32];
        cb_msg_begin(w, "renew", cb_bus_new_id(id, sizeof id));
        cb_msg_put_str(w, "job", job);
        cb_msg_put_str(w, "token", token);
        cb_err_t code = CB_ERR_NONE;
        cb_msg_t *r = cb_bus_call(c, w, &code, err, sizeof err);
        if (r && !cb_msg_ok(r) && cb_msg_err_code(r) == CB_ERR_NOT_FOUND) {
            pthread_mutex_lock(&l->hold.mu);
            if (l->hold.holding && strcmp(l->hold.token, token) == 0) atomic_store(&l->hold.lost, true);
            pthread_mutex_unlock(&l->hold.mu);
            cb_log(CB_LOG_WARN, job, "lease renewal refused: %s", cb_msg_err_message(r));
        } else if (!r) {
            cb_log(CB_LOG_DEBUG, job, "lease renewal: %s", err); /* the worker's own calls log the link state */
        }
        cb_msg_destroy(&r);
    }
    zpoller_destroy(&poller);
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&c);
}

/* ---- the source --------------------------------------------------------------------------------------- */

/* Reads the job of a lease reply into a new cb_job_t and l's plan. NULL with err when any field is wrong. */
static cb_job_t *read_lease(lease_src_t *l, const cb_msg_t *m, int64_t *lease_ms, char *err, size_t errlen) {
    const char *s, *doc, *text, *client = "";
    size_t n, ndoc, ntext, nclient = 0;
    cb_job_t *job = cb_calloc(1, sizeof *job);
    size_t nch = 0;
    bool planned = false;
    if (!job) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (!cb_msg_hex(m, "job", CB_JOB_ID_LEN, CB_JOB_ID_LEN, &s, &n)) goto bad;
    memcpy(job->job, s, n);
    if (!cb_msg_hex(m, "token", CB_JOB_TOKEN_LEN, CB_JOB_TOKEN_LEN, &s, &n)) goto bad;
    memcpy(job->token, s, n);
    if (!cb_msg_str(m, "doc_id", MAX_DOC_ID, &doc, &ndoc) || !cb_msg_str(m, "text", (size_t)l->a->max_doc_bytes, &text,
                                                                         &ntext) ||
        (cb_msg_has(m, "client") && !cb_msg_str(m, "client", CB_JOB_CLIENT_MAX, &client, &nclient)) ||
        !cb_msg_int(m, "lease_ms", 1, 86400000, lease_ms) || !cb_msg_bool(m, "planned", &planned) ||
        !cb_msg_bool_or(m, "replaced", false, &job->replaced) || !cb_msg_bool_or(m, "has_older", false, &job->has_older))
        goto bad;
    if (ndoc == 0 || ntext == 0) {
        snprintf(err, errlen, "lease reply: empty doc_id or text");
        goto fail;
    }
    if (!(job->doc_id = cb_malloc(ndoc + 1)) || !(job->text = cb_malloc(ntext + 1))) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    memcpy(job->doc_id, doc, ndoc);
    job->doc_id[ndoc] = 0;
    memcpy(job->text, text, ntext);
    job->text[ntext] = 0;
    job->text_len = ntext;
    memcpy(job->client, client, nclient);
    job->planned = planned;
    if (planned) {
        size_t n2, n3, n4, n5;
        if (!cb_msg_array_len(m, "off", PC_LEASE_MAX_CHUNKS, &nch) || !cb_msg_array_len(m, "len", nch, &n2) ||
            !cb_msg_array_len(m, "tokens", nch, &n3) || !cb_msg_array_len(m, "keys", nch, &n4) ||
            !cb_msg_array_len(m, "done", nch, &n5))
            goto bad;
        if (n2 != nch || n3 != nch || n4 != nch || n5 != nch) {
            snprintf(err, errlen, "lease reply: the plan's arrays differ in length");
            goto fail;
        }
        l->chunks = nch ? cb_calloc(nch, sizeof *l->chunks) : NULL;
        if (nch && !l->chunks) {
            snprintf(err, errlen, "out of memory");
            goto fail;
        }
        for (size_t i = 0; i < nch; i++) {
            int64_t off, len, toks, done;
            const char *key;
            size_t nkey;
            if (!cb_msg_at_int(m, "off", i, 0, (int64_t)ntext - 1, &off) ||
                !cb_msg_at_int(m, "len", i, 1, (int64_t)ntext - off, &len) ||
                !cb_msg_at_int(m, "tokens", i, 0, 1 << 20, &toks) || !cb_msg_at_hex(m, "keys", i, 64, 64, &key, &nkey) ||
                !cb_msg_at_int(m, "done", i, 0, 1, &done))
                goto bad;
            l->chunks[i] = (cb_job_chunk_t){.off = off, .len = len, .n_tokens = (int)toks, .done = done != 0};
            memcpy(l->chunks[i].key, key, 64);
            l->chunks[i].key[64] = 0;
            job->chunks_done += done != 0;
        }
        l->n_chunks = (int)nch;
        job->chunks_total = (int64_t)nch;
    }
    return job;
bad:
    snprintf(err, errlen, "invalid lease reply: %s", cb_msg_last_error(m));
fail:
    free(l->chunks);
    l->chunks = NULL;
    l->n_chunks = 0;
    cb_job_free(&job);
    return NULL;
}

static int lease_take(void *ctx, cb_job_t **job, char *err, size_t errlen) {
    lease_src_t *l = ctx;
    if (*job) return 1; /* the job in hand, until it ends (a lost lease shows at the next call) */
    char id[32];
    cb_msg_begin(l->w, "lease", cb_bus_new_id(id, sizeof id));
    cb_msg_put_str(l->w, "worker", l->a->worker_name);
    cb_msg_t *r = NULL;
    pc_src_rc_t rc = call(l, "lease", &r, err, errlen);
    if (rc != PC_SRC_OK) return -1;
    bool none = false;
    if (cb_msg_bool_or(r, "none", false, &none) && none) {
        cb_msg_destroy(&r);
        return 0;
    }
    int64_t lease_ms = 0;
    cb_job_t *j = read_lease(l, r, &lease_ms, err, errlen);
    cb_msg_destroy(&r);
    if (!j) return -1;
    *job = j;
    hold_set(l, j, lease_ms);
    atomic_fetch_add(&l->st->leases_taken, 1);
    cb_log(CB_LOG_INFO, j->job, "leased doc '%s' (%zu bytes, %lld of %lld chunks done) from %s for %lld ms", j->doc_id,
           j->text_len, (long long)j->chunks_done, (long long)j->chunks_total, l->a->lease_from, (long long)lease_ms);
    return 1;
}

/* PC_SRC_STALE when the renewer heard that the lease is gone (the job is let go). */
static pc_src_rc_t check_lost(lease_src_t *l, char *err, size_t errlen) {
    if (!atomic_load(&l->hold.lost)) return PC_SRC_OK;
    snprintf(err, errlen, "the master says the lease is gone (it expired and another worker has the job, or the job "
             "ended)");
    atomic_fetch_add(&l->st->leases_lost, 1);
    let_go(l);
    return PC_SRC_STALE;
}

/* A call's outcome: a stale one lets the job go and counts it. */
static pc_src_rc_t outcome(lease_src_t *l, pc_src_rc_t rc) {
    if (rc == PC_SRC_STALE) {
        atomic_fetch_add(&l->st->leases_lost, 1);
        let_go(l);
    }
    return rc;
}

static pc_src_rc_t lease_next_chunk(void *ctx, cb_job_t *job, int *idx, cb_job_chunk_t *c, char *err, size_t errlen) {
    lease_src_t *l = ctx;
    (void)job;
    pc_src_rc_t rc = check_lost(l, err, errlen);
    if (rc != PC_SRC_OK) return rc;
    *idx = -1;
    for (int i = 0; i < l->n_chunks; i++)
        if (!l->chunks[i].done) {
            *idx = i;
            *c = l->chunks[i];
            break;
        }
    return PC_SRC_OK;
}

static pc_src_rc_t lease_plan(void *ctx, cb_job_t *job, const cb_job_chunk_t *cs, int n, char *err, size_t errlen) {
    lease_src_t *l = ctx;
    pc_src_rc_t rc = check_lost(l, err, errlen);
    if (rc != PC_SRC_OK) return rc;
    if (n > PC_LEASE_MAX_CHUNKS) {
        snprintf(err, errlen, "%d chunks: more than a plan may have (%d)", n, PC_LEASE_MAX_CHUNKS);
        return PC_SRC_FAIL;
    }
    begin_job(l, "plan", job);
    static const char *const fields[] = {"off", "len", "tokens", "keys"};
    for (int f = 0; f < 4; f++) {
        cb_msg_begin_array(l->w, fields[f]);
        for (int i = 0; i < n; i++) {
            if (f == 0) cb_msg_put_int(l->w, NULL, cs[i].off);
            else if (f == 1) cb_msg_put_int(l->w, NULL, cs[i].len);
            else if (f == 2) cb_msg_put_int(l->w, NULL, cs[i].n_tokens);
            else cb_msg_put_str(l->w, NULL, cs[i].key);
        }
        cb_msg_end_array(l->w);
    }
    cb_msg_t *r = NULL;
    if ((rc = outcome(l, call(l, "plan", &r, err, errlen))) != PC_SRC_OK) return rc;
    int64_t total = -1;
    bool same = cb_msg_int(r, "chunks_total", 0, INT64_MAX, &total) && total == n;
    cb_msg_destroy(&r);
    if (!same) { /* someone planned it otherwise: our view is wrong, drop it (a new lease brings the plan) */
        snprintf(err, errlen, "the master holds another plan for this job (%lld chunks, ours %d)", (long long)total, n);
        return outcome(l, PC_SRC_STALE);
    }
    free(l->chunks);
    l->chunks = n ? cb_malloc((size_t)n * sizeof *l->chunks) : NULL;
    if (n && !l->chunks) {
        snprintf(err, errlen, "out of memory");
        l->n_chunks = 0;
        return PC_SRC_FAIL;
    }
    for (int i = 0; i < n; i++) {
        l->chunks[i] = cs[i];
        l->chunks[i].done = false;
    }
    l->n_chunks = n;
    return PC_SRC_OK;
}

static pc_src_rc_t lease_replaced(void *ctx, cb_job_t *job, char *err, size_t errlen) {
    lease_src_t *l = ctx;
    pc_src_rc_t rc = check_lost(l, err, errlen);
    if (rc != PC_SRC_OK) return rc;
    begin_job(l, "replaced", job);
    cb_msg_t *r = NULL;
    rc = outcome(l, call(l, "replaced", &r, err, errlen));
    cb_msg_destroy(&r);
    return rc;
}

static pc_src_rc_t lease_renew(void *ctx, cb_job_t *job, char *err, size_t errlen) {
    lease_src_t *l = ctx;
    pc_src_rc_t rc = check_lost(l, err, errlen);
    if (rc != PC_SRC_OK) return rc;
    begin_job(l, "renew", job);
    cb_msg_t *r = NULL;
    rc = outcome(l, call(l, "renew", &r, err, errlen));
    cb_msg_destroy(&r);
    return rc;
}

static pc_src_rc_t lease_chunk_done(void *ctx, cb_job_t *job, int idx, char *err, size_t errlen) {
    lease_src_t *l = ctx;
    pc_src_rc_t rc = check_lost(l, err, errlen);
    if (rc != PC_SRC_OK) return rc;
    if (idx < 0 || idx >= l->n_chunks) {
        snprintf(err, errlen, "chunk %d is not in the plan (%d chunks)", idx, l->n_chunks);
        return PC_SRC_FAIL;
    }
    begin_job(l, "chunk_done", job);
    cb_msg_put_int(l->w, "idx", idx);
    cb_msg_t *r = NULL;
    rc = outcome(l, call(l, "chunk_done", &r, err, errlen));
    cb_msg_destroy(&r);
    if (rc == PC_SRC_OK && !l->chunks[idx].done) {
        l->chunks[idx].done = true;
        job->chunks_done++;
    }
    return rc;
}

static pc_src_rc_t lease_finish(void *ctx, cb_job_t *job, bool ok, const char *why, char *err, size_t errlen) {
    lease_src_t *l = ctx;
    pc_src_rc_t rc = check_lost(l, err, errlen);
    if (rc != PC_SRC_OK) return rc;
    begin_job(l, "finish", job);
    cb_msg_put_bool(l->w, "done", ok);
    if (!ok && why) cb_msg_put_strn(l->w, "why", why, strnlen(why, 700));
    cb_msg_t *r = NULL;
    rc = outcome(l, call(l, "finish", &r, err, errlen));
    cb_msg_destroy(&r);
    if (rc == PC_SRC_OK) let_go(l);
    return rc;
}

static void lease_release(void *ctx, cb_job_t *job) {
    lease_src_t *l = ctx;
    if (!atomic_load(&l->hold.lost) && l->hold.holding) {
        begin_job(l, "release", job);
        cb_msg_t *r = NULL;
        char err[512];
        size_t len;
        const void *data;
        if (zsys_interrupted && (data = cb_msg_end(l->w, &len))) {
            /* stopping on a signal: requests end at the interrupt, so the release goes out without waiting for
             * its answer (the socket's linger delivers it) */
            if (cb_bus_send(l->master, data, len, NULL, err, sizeof err) == 0)
                cb_log(CB_LOG_INFO, job->job, "lease given back to %s", l->a->lease_from);
            else
                cb_log(CB_LOG_WARN, job->job, "release: %s (the lease expires by itself)", err);
            let_go(l);
            return;
        }
        cb_bus_client_set_timeout(l->master, 1000, 0); /* best effort: the lease expires anyway */
        if (call(l, "release", &r, err, sizeof err) == PC_SRC_OK)
            cb_log(CB_LOG_INFO, job->job, "lease given back to %s", l->a->lease_from);
        else
            cb_log(CB_LOG_WARN, job->job, "%s (the lease expires by itself)", err);
        cb_msg_destroy(&r);
        cb_bus_client_set_timeout(l->master, l->opts.request_timeout_ms, l->opts.request_retries);
    }
    let_go(l);
}

static void lease_destroy(void **ctx_p) {
    lease_src_t *l = *ctx_p;
    if (!l) return;
    zactor_destroy(&l->renewer);
    cb_bus_client_destroy(&l->master);
    cb_msg_writer_destroy(&l->w);
    free(l->chunks);
    pthread_mutex_destroy(&l->hold.mu);
    free(l);
    *ctx_p = NULL;
}

int pc_lease_source_new(const pc_worker_args_t *a, pc_source_t *out, char *err, size_t errlen) {
    if (!pc_lease_worker_name_valid(a->worker_name, strlen(a->worker_name))) {
        snprintf(err, errlen, "precompute.worker_name '%.80s': 1..%d printable ASCII characters without spaces",
                 a->worker_name, PC_LEASE_WORKER_MAX);
        return -1;
    }
    lease_src_t *l = cb_calloc(1, sizeof *l);
    if (!l) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    l->a = a;
    l->st = a->stats;
    pthread_mutex_init(&l->hold.mu, NULL);
    atomic_init(&l->hold.lost, false);
    void *p = l;
    if (!cb_bus_opts_from_config(a->cfg, "precompute", &l->opts, err, errlen) ||
        (l->opts.curve.on && !cb_curve_add_peer(&l->opts.curve, a->lease_from, "precompute", err, errlen)) ||
        !(l->master = cb_bus_client_new(a->lease_from, &l->opts, err, errlen)))
        goto fail;
    if (!(l->w = cb_msg_writer_new()) || !(l->renewer = zactor_new(renewer_actor, l))) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    *out = (pc_source_t){.ctx = l, .name = "lease", .keeps_job = true, .take = lease_take,
                         .next_chunk = lease_next_chunk, .plan = lease_plan, .replaced = lease_replaced,
                         .renew = lease_renew, .chunk_done = lease_chunk_done, .finish = lease_finish,
                         .release = lease_release, .destroy = lease_destroy};
    return 0;
fail:
    lease_destroy(&p);
    return -1;
}
