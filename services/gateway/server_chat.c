/* server_chat.c: /v1/chat/completions: the request mapped to a cb-blend query, then one JSON answer or a
 * stream of server-sent events fed by the request's job thread while libmicrohttpd's thread hands them to
 * the client. Part of the HTTP side (server_internal.h). */
#include "server_internal.h"
#include "base/alloc.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "base/log.h"
#include "openai.h"
#include "stream.h"

#define SSE_HIGH_WATER 16384 /* SSE bytes made and not yet sent beyond which the stream stops reading cb-blend */

static void new_query_id(char *buf, size_t size) { cb_bus_new_id(buf, size); }

/* ---------------------------------------------------------------------------------------------- */
/* Chat completions                                                                                */

/* A streamed answer. Two threads share it: the request's job thread (the pump) reads cb-blend and turns
 * its messages into SSE bytes in out[off..len); libmicrohttpd's thread (sse_read) hands those bytes to
 * the connection, and when there are none yet suspends the connection (it costs no thread while it
 * waits) until the pump has more and resumes it. The pump stops reading cb-blend while SSE_HIGH_WATER
 * bytes wait for a client that does not read, so cb-blend's send times out and drops the query as it
 * did before. Freed by the last of the two to let go (refs). */
struct sse {
    gw_server_t *s;
    struct MHD_Connection *mc;
    int fd;               /* the connection's socket */
    pthread_mutex_t mu;   /* guards out, off, len, cap, suspended, finished, gone, refs */
    pthread_cond_t drained;
    char *out;            /* bytes made and not yet given to MHD: out[off..len) */
    size_t len, off, cap;
    bool suspended;       /* sse_read suspended the connection: only the pump resumes it */
    bool finished;        /* no more bytes will be made */
    bool gone;            /* the client went away: end the response with an error (close) */
    int refs;             /* the response (sse_free) and the pump */
    atomic_int watch_fd;  /* fd while suspended (the pump may poll it), else -1 */
    atomic_bool abandoned; /* libmicrohttpd let the response go (the connection closed) */
    /* the pump's own */
    gw_stream_t *st;
    gw_chat_t req;
    char cid[96];
    char model[300];
    int64_t created;
    double t0, ttft_ms;   /* arrival; first token made (-1: none) */
    bool role_sent;
    gw_outcome_t outcome;
    gw_mode_t mode;
    cb_msg_t *done;       /* kept for the metrics */
};

static bool out_append(sse_t *x, const char *data, size_t n) {
    if (x->len + n + 1 > x->cap) {
        size_t cap = x->cap ? x->cap : 1024;
        while (cap < x->len + n + 1) cap *= 2;
        char *p = cb_realloc(x->out, cap);
        if (!p) return false;
        x->out = p;
        x->cap = cap;
    }
    memcpy(x->out + x->len, data, n);
    x->len += n;
    x->out[x->len] = 0;
    return true;
}

/* Appends "data: <json>\n\n" (the reference to j is taken). */
static bool out_event(sse_t *x, json_t *j) {
    char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!text) return false;
    bool ok = out_append(x, "data: ", 6) && out_append(x, text, strlen(text)) && out_append(x, "\n\n", 2);
    free(text);
    return ok;
}

static gw_mode_t done_mode(const cb_msg_t *done, gw_mode_t asked) {
    const cb_msg_t *mt = done ? cb_msg_map(done, "metrics") : NULL;
    char mode[16];
    if (mt && cb_msg_str_copy(mt, "mode", 15, mode, sizeof mode)) return gw_mode_parse(mode);
    return asked;
}

/* Turns one message of the query into SSE events; false at the end of the stream. Under x->mu once the
 * response is out. */
static bool sse_message(sse_t *x, cb_msg_t *m) {
    if (!cb_msg_ok(m)) {
        http_err_t he = gw_server_map_err(cb_msg_err_code(m));
        x->outcome = he.outcome;
        out_event(x, gw_error_json(cb_msg_err_message(m), he.type, NULL, he.code));
        return false;
    }
    if (!x->role_sent && (cb_msg_is_type(m, "token") || cb_msg_is_type(m, "done"))) {
        out_event(x, gw_chunk(x->cid, x->created, x->model, "assistant", "", 0, NULL));
        x->role_sent = true;
    }
    if (cb_msg_is_type(m, "heartbeat")) {
        out_append(x, ": keep-alive\n\n", 14); /* an SSE comment: clients skip it; a closed client shows */
        return true;
    }
    if (cb_msg_is_type(m, "token")) {
        const char *t;
        size_t tl;
        if (cb_msg_str(m, "text", 1 << 20, &t, &tl) && tl > 0) {
            if (x->ttft_ms < 0) x->ttft_ms = cb_now_ms() - x->t0;
            out_event(x, gw_chunk(x->cid, x->created, x->model, NULL, t, tl, NULL));
        }
        return true;
    }
    if (cb_msg_is_type(m, "done")) {
        if (x->ttft_ms < 0) x->ttft_ms = cb_now_ms() - x->t0;
        json_t *last = gw_chunk(x->cid, x->created, x->model, NULL, NULL, 0, gw_finish_reason(m, gw_chat_max_tokens(&x->req)));
        json_object_set_new(last, "usage", gw_usage(m));
        json_object_set_new(last, "cacheblend", gw_cacheblend_ext(m));
        out_event(x, last);
        if (x->req.include_usage) {
            json_t *u = json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", x->cid, "object", "chat.completion.chunk",
                                  "created", (json_int_t)x->created, "model", x->model, "choices", "usage", gw_usage(m));
            out_event(x, u);
        }
        out_append(x, "data: [DONE]\n\n", 14);
        x->outcome = GW_OUT_OK;
        x->mode = done_mode(m, x->mode);
        x->done = m;
        return false;
    }
    return true; /* an unknown stream message: skipped */
}

static void sse_unref(sse_t *x) {
    pthread_mutex_lock(&x->mu);
    int left = --x->refs;
    pthread_mutex_unlock(&x->mu);
    if (left > 0) return;
    gw_stream_destroy(&x->st);
    cb_msg_destroy(&x->done);
    gw_chat_clear(&x->req);
    pthread_cond_destroy(&x->drained);
    pthread_mutex_destroy(&x->mu);
    free(x->out);
    free(x);
}

/* libmicrohttpd's side: the bytes made so far, or 0 with the connection suspended until there are more. */
static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    sse_t *x = cls;
    ssize_t rc;
    pthread_mutex_lock(&x->mu);
    if (x->off < x->len) {
        size_t n = x->len - x->off < max ? x->len - x->off : max;
        memcpy(buf, x->out + x->off, n);
        x->off += n;
        if (x->off == x->len) x->off = x->len = 0;
        pthread_cond_signal(&x->drained);
        rc = (ssize_t)n;
    } else if (x->finished) {
        rc = x->gone ? MHD_CONTENT_READER_END_WITH_ERROR : MHD_CONTENT_READER_END_OF_STREAM;
    } else {
        x->suspended = true;
        atomic_store(&x->watch_fd, x->fd);
        MHD_suspend_connection(x->mc);
        rc = 0;
    }
    pthread_mutex_unlock(&x->mu);
    return rc;
}

/* libmicrohttpd let the response go (sent, or the connection closed). */
static void sse_free(void *cls) {
    sse_t *x = cls;
    atomic_store(&x->abandoned, true);
    pthread_mutex_lock(&x->mu);
    pthread_cond_signal(&x->drained);
    pthread_mutex_unlock(&x->mu);
    sse_unref(x);
}

/* The job thread's side, after the response is queued: reads cb-blend to the end of the answer. */
void gw_server_sse_pump(sse_t *x) {
    for (;;) {
        pthread_mutex_lock(&x->mu);
        while (!x->finished && x->len - x->off >= SSE_HIGH_WATER && !atomic_load(&x->abandoned) &&
               !atomic_load(&x->s->stopping)) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 200 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
            pthread_cond_timedwait(&x->drained, &x->mu, &ts);
        }
        bool finished = x->finished;
        pthread_mutex_unlock(&x->mu);
        if (finished || atomic_load(&x->abandoned)) break;
        gw_stream_end_t why;
        char err[256];
        cb_msg_t *m = gw_stream_next(x->st, &why, err, sizeof err);
        pthread_mutex_lock(&x->mu);
        if (!m) {
            x->finished = true;
            if (why == GW_STREAM_GONE) {
                x->gone = true;
                x->outcome = GW_OUT_CANCELLED;
            } else {
                http_err_t he = gw_server_map_err(why == GW_STREAM_STOPPING || why == GW_STREAM_FAILED
                                                      ? CB_ERR_UNAVAILABLE
                                                      : CB_ERR_TIMEOUT);
                x->outcome = he.outcome;
                out_event(x, gw_error_json(err, he.type, NULL, he.code));
            }
        } else {
            if (!sse_message(x, m)) x->finished = true;
            if (m != x->done) cb_msg_destroy(&m);
        }
        bool wake = x->suspended;
        x->suspended = false;
        if (wake) atomic_store(&x->watch_fd, -1);
        pthread_mutex_unlock(&x->mu);
        if (wake) MHD_resume_connection(x->mc); /* suspended: the connection cannot have closed */
    }
    pthread_mutex_lock(&x->mu);
    if (!x->finished) x->outcome = GW_OUT_CANCELLED; /* MHD gave up on the connection */
    pthread_mutex_unlock(&x->mu);
    gw_stream_destroy(&x->st); /* closes the DEALER: cb-blend drops a query still running */
    double e2e = cb_now_ms() - x->t0;
    gw_metrics_query(x->s->metrics, x->mode, x->outcome, x->ttft_ms >= 0 ? x->ttft_ms / 1e3 : -1, e2e / 1e3, x->done);
    cb_log(x->outcome == GW_OUT_OK ? CB_LOG_INFO : CB_LOG_WARN, x->cid + 9, "chat completion (stream) %s in %.1f ms",
           gw_outcome_name(x->outcome), e2e);
    sse_unref(x);
}

/* Waits for the query's first message that is not a heartbeat (NULL with *why, err). */
static cb_msg_t *first_message(gw_stream_t *st, gw_stream_end_t *why, char *err, size_t errlen) {
    for (;;) {
        cb_msg_t *m = gw_stream_next(st, why, err, errlen);
        if (!m || !cb_msg_is_type(m, "heartbeat")) return m;
        cb_msg_destroy(&m);
    }
}

/* A streamed answer whose first message is m (taken): the SSE response, and r->pump for the job thread. */
static enum MHD_Result chat_stream(gw_server_t *s, req_t *r, gw_stream_t *st, gw_chat_t *req, cb_msg_t *m,
                                   const char *cid, const char *model, int64_t created, gw_mode_t asked) {
    sse_t *x = cb_calloc(1, sizeof *x);
    if (!x) {
        cb_msg_destroy(&m);
        gw_stream_destroy(&st);
        gw_chat_clear(req);
        return gw_server_send_error(s, r, 500, "server_error", NULL, "internal", "out of memory");
    }
    x->s = s;
    x->mc = r->mc;
    x->fd = r->fd;
    pthread_mutex_init(&x->mu, NULL);
    pthread_cond_init(&x->drained, NULL);
    atomic_init(&x->watch_fd, -1);
    atomic_init(&x->abandoned, false);
    x->st = st;
    x->req = *req;
    snprintf(x->cid, sizeof x->cid, "%s", cid);
    snprintf(x->model, sizeof x->model, "%s", model);
    x->created = created;
    x->t0 = r->t0;
    x->ttft_ms = -1;
    x->mode = asked;
    x->outcome = GW_OUT_ERROR;
    x->refs = 2;
    gw_stream_watch(st, &x->watch_fd, &x->abandoned);
    if (!sse_message(x, m)) x->finished = true;
    if (m != x->done) cb_msg_destroy(&m);
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, sse_read, x, sse_free);
    if (!resp) {
        x->refs = 1;
        atomic_store(&x->abandoned, true);
        gw_server_sse_pump(x); /* ends at once: metrics, log, free */
        gw_server_set_reply(r, 0, NULL);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    gw_server_set_reply(r, 200, resp);
    r->pump = x;
    return MHD_YES;
}

enum MHD_Result gw_server_chat(gw_server_t *s, req_t *r) {
    gw_chat_t req;
    char err[512];
    const char *param;
    if (!gw_chat_parse(r->body ? r->body : "", r->len, &req, err, sizeof err, &param)) {
        gw_metrics_query(s->metrics, GW_MODE_DEFAULT, GW_OUT_BAD_REQUEST, -1, 0, NULL);
        return gw_server_send_error(s, r, 400, "invalid_request_error", param,
                                    param ? "invalid_value" : "invalid_json", "%s", err);
    }
    gw_mode_t asked = gw_mode_parse(gw_chat_mode(&req));
    char id[32];
    new_query_id(id, sizeof id);
    cb_msg_writer_t *w = cb_msg_writer_new();
    size_t len = 0;
    const void *data = NULL;
    if (w) {
        gw_chat_query(&req, id, w);
        data = cb_msg_end(w, &len);
    }
    if (!data) {
        cb_msg_writer_destroy(&w);
        gw_chat_clear(&req);
        return gw_server_send_error(s, r, 500, "server_error", NULL, "internal", "cannot encode the query");
    }
    /* the connection is suspended while this runs: its socket stays open, so it may be watched */
    gw_stream_opts_t so = {.endpoint = s->o.endpoints[SVC_BLEND], .opts = &s->o.bus, .first_ms = s->o.first_ms,
                           .total_ms = s->o.query_timeout_ms, .client_fd = &r->watch_fd, .stopping = &s->stopping};
    cb_err_t code;
    gw_stream_t *st = gw_stream_start(&so, data, len, id, &code, err, sizeof err);
    cb_msg_writer_destroy(&w);
    if (!st) {
        http_err_t he = gw_server_map_err(code);
        gw_metrics_query(s->metrics, asked, he.outcome, -1, (cb_now_ms() - r->t0) / 1e3, NULL);
        gw_chat_clear(&req);
        return gw_server_send_error(s, r, he.status, he.type, NULL, he.code, "cb-blend: %s", err);
    }
    gw_stream_end_t why;
    cb_msg_t *m = first_message(st, &why, err, sizeof err);
    if (!m || !cb_msg_ok(m)) { /* before any byte of the answer: a plain HTTP error */
        http_err_t he = gw_server_map_err(m ? cb_msg_err_code(m)
                                  : why == GW_STREAM_STOPPING || why == GW_STREAM_FAILED ? CB_ERR_UNAVAILABLE
                                                                                          : CB_ERR_TIMEOUT);
        bool gone = !m && why == GW_STREAM_GONE;
        if (gone) he.outcome = GW_OUT_CANCELLED;
        char msg[1100];
        snprintf(msg, sizeof msg, "%s", m ? cb_msg_err_message(m) : err);
        cb_msg_destroy(&m);
        gw_stream_destroy(&st);
        gw_metrics_query(s->metrics, asked, he.outcome, -1, (cb_now_ms() - r->t0) / 1e3, NULL);
        gw_chat_clear(&req);
        if (gone) return MHD_NO; /* nobody to answer */
        return gw_server_send_error(s, r, he.status, he.type, NULL, he.code, "%s", msg);
    }
    char cid[96];
    snprintf(cid, sizeof cid, "chatcmpl-%s", id);
    const char *model = gw_chat_model(&req, "cacheblend");
    int64_t created = (int64_t)time(NULL);
    if (req.stream) return chat_stream(s, r, st, &req, m, cid, model, created, asked);
    /* Not streamed: collect the answer, then one response. */
    double ttft = cb_now_ms() - r->t0;
    while (m && cb_msg_ok(m) && !cb_msg_is_type(m, "done")) {
        cb_msg_destroy(&m);
        m = gw_stream_next(st, &why, err, sizeof err);
    }
    gw_stream_destroy(&st);
    enum MHD_Result rc;
    if (m && cb_msg_ok(m)) {
        gw_metrics_query(s->metrics, done_mode(m, asked), GW_OUT_OK, ttft / 1e3, (cb_now_ms() - r->t0) / 1e3, m);
        cb_log(CB_LOG_INFO, id, "chat completion ok in %.1f ms", cb_now_ms() - r->t0);
        rc = gw_server_send_json(s, r, 200, gw_completion(cid, created, model, m, gw_chat_max_tokens(&req)));
    } else {
        http_err_t he = gw_server_map_err(m ? cb_msg_err_code(m) : why == GW_STREAM_STOPPING || why == GW_STREAM_FAILED
                                                               ? CB_ERR_UNAVAILABLE
                                                               : CB_ERR_TIMEOUT);
        if (!m && why == GW_STREAM_GONE) he.outcome = GW_OUT_CANCELLED;
        gw_metrics_query(s->metrics, asked, he.outcome, ttft / 1e3, (cb_now_ms() - r->t0) / 1e3, NULL);
        cb_log(CB_LOG_WARN, id, "chat completion %s: %s", gw_outcome_name(he.outcome), m ? cb_msg_err_message(m) : err);
        rc = !m && why == GW_STREAM_GONE
                 ? MHD_NO
                 : gw_server_send_error(s, r, he.status, he.type, NULL, he.code, "%s", m ? cb_msg_err_message(m) : err);
    }
    cb_msg_destroy(&m);
    gw_chat_clear(&req);
    return rc;
}
