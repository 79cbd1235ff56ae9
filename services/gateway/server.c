/* server: the HTTP side of cb-gateway. See server.h. */
#include "server.h"
#include "base/alloc.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "admit.h"
#include "base/clock.h"
#include "base/log.h"
#include "keyguard.h"
#include "metrics.h"
#include "openai.h"
#include "page.h"
#include "stream.h"

static const char *const SERVICE_NAMES[4] = {"retriever", "cacheindex", "precompute", "blend"};
enum { SVC_RETRIEVER, SVC_CACHEINDEX, SVC_PRECOMPUTE, SVC_BLEND };

#define MAX_INGEST_DOCS 1000
#define SSE_HIGH_WATER 16384 /* SSE bytes made and not yet sent beyond which the stream stops reading cb-blend */
#define FDS_PER_REQUEST 4    /* file descriptors a request being answered may hold (ZeroMQ sockets, /health: 4) */
#define FDS_SPARE 256        /* the process's other descriptors (ZeroMQ's, logs, libraries) */

struct gw_server {
    gw_server_opts_t o;
    char listen[256], api_key[256];
    struct MHD_Daemon *daemon;
    gw_admit_t *admit;
    gw_keyguard_t *keyguard;
    gw_metrics_t *metrics;
    atomic_bool stopping;
    atomic_int jobs;          /* requests being answered by their own thread */
    int port;
};

/* A request's answer, made by a job thread (the connection suspended meanwhile) or on libmicrohttpd's
 * thread, and queued by deliver(). */
typedef enum { JOB_NONE, JOB_RUNNING, JOB_DONE } job_state_t;

typedef struct sse sse_t;
typedef struct req req_t;
typedef enum MHD_Result (*handler_fn)(gw_server_t *s, req_t *r);

/* One HTTP request's state (MHD's per-request pointer), from its request line to its completion. */
struct req {
    gw_server_t *s;
    struct MHD_Connection *mc;
    void *conn;           /* the connection's admission record (gw_admit hooks) */
    const char *handler;  /* metrics label, set when routed */
    char *url;            /* the path (copied: a job reads it) */
    char *body;           /* the request body [len] (cap bytes allocated), NUL-terminated */
    size_t len, cap;
    bool started;         /* the headers are in (first access-handler call done) */
    bool too_large;       /* the body went past max_body_bytes: 413 at the end */
    bool answered;        /* a response was queued (or a job started) */
    double t0;            /* arrival (cb_now_ms) */
    int fd;               /* the connection's socket */
    atomic_int watch_fd;  /* fd while a job waits (the connection is suspended), for gw_stream */
    uint8_t key[16];      /* client address (gw_addr_key) */
    char client[64];      /* "gw:" + address (logs; the ingest client is gw_ingest_client) */
    /* the answer */
    handler_fn fn;        /* the job's handler */
    job_state_t job;
    struct MHD_Response *resp;
    int status;
    sse_t *pump;          /* a streamed answer: the job thread goes on feeding it after the response is queued */
};

/* ---------------------------------------------------------------------------------------------- */
/* Responses: each handler sets r's answer; deliver() queues it                                    */

static void set_reply(req_t *r, int status, struct MHD_Response *resp) {
    if (r->resp) MHD_destroy_response(r->resp);
    r->resp = resp;
    r->status = status;
}

/* Returns MHD_NO (the connection is closed, nothing is answered) when out of memory. */
static enum MHD_Result send_buf(gw_server_t *s, req_t *r, int status, const char *type, char *buf, size_t len,
                                bool must_free) {
    (void)s;
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, buf, must_free ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!resp) {
        if (must_free) free(buf);
        set_reply(r, 0, NULL);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (status == MHD_HTTP_UNAUTHORIZED) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    set_reply(r, status, resp);
    return MHD_YES;
}

/* Sends j (its reference is taken) as the JSON body. */
static enum MHD_Result send_json(gw_server_t *s, req_t *r, int status, json_t *j) {
    char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!text) {
        static char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}";
        return send_buf(s, r, 500, "application/json", oom, sizeof oom - 1, false);
    }
    return send_buf(s, r, status, "application/json", text, strlen(text), true);
}

static enum MHD_Result send_error(gw_server_t *s, req_t *r, int status, const char *type, const char *param,
                                  const char *code, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
static enum MHD_Result send_error(gw_server_t *s, req_t *r, int status, const char *type, const char *param,
                                  const char *code, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return send_json(s, r, status, gw_error_json(msg, type, param, code));
}

/* Adds a header to the answer set (if any). */
static void reply_header(req_t *r, const char *name, const char *value) {
    if (r->resp) MHD_add_response_header(r->resp, name, value);
}

/* Queues r's answer (on libmicrohttpd's thread); MHD_NO closes the connection (no answer: the client went
 * away, or out of memory). */
static enum MHD_Result deliver(gw_server_t *s, struct MHD_Connection *c, req_t *r) {
    r->answered = true;
    gw_admit_conn_answering(s->admit, r->conn);
    struct MHD_Response *resp = r->resp;
    r->resp = NULL;
    if (!resp) return MHD_NO;
    enum MHD_Result rc = MHD_queue_response(c, (unsigned)r->status, resp);
    MHD_destroy_response(resp);
    gw_metrics_http(s->metrics, r->handler, r->status);
    return rc;
}

/* How a cacheblend error code reads over HTTP. */
typedef struct {
    int status;
    const char *type, *code;
    gw_outcome_t outcome;
} http_err_t;

static http_err_t map_err(cb_err_t e) {
    switch (e) {
    case CB_ERR_BAD_REQUEST:
    case CB_ERR_UNKNOWN_TYPE: return (http_err_t){400, "invalid_request_error", "bad_request", GW_OUT_BAD_REQUEST};
    case CB_ERR_TOO_LARGE:
        return (http_err_t){400, "invalid_request_error", "context_length_exceeded", GW_OUT_TOO_LARGE};
    case CB_ERR_NOT_FOUND: return (http_err_t){404, "invalid_request_error", "not_found", GW_OUT_BAD_REQUEST};
    case CB_ERR_UNAVAILABLE: return (http_err_t){503, "service_unavailable", "unavailable", GW_OUT_UNAVAILABLE};
    case CB_ERR_OVERLOADED: return (http_err_t){503, "service_unavailable", "overloaded", GW_OUT_OVERLOADED};
    case CB_ERR_TIMEOUT: return (http_err_t){504, "timeout", "timeout", GW_OUT_TIMEOUT};
    default: return (http_err_t){500, "server_error", "internal", GW_OUT_ERROR};
    }
}

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
        http_err_t he = map_err(cb_msg_err_code(m));
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
static void sse_pump(sse_t *x) {
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
                http_err_t he = map_err(why == GW_STREAM_STOPPING || why == GW_STREAM_FAILED ? CB_ERR_UNAVAILABLE
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
        return send_error(s, r, 500, "server_error", NULL, "internal", "out of memory");
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
        sse_pump(x); /* ends at once: metrics, log, free */
        set_reply(r, 0, NULL);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    set_reply(r, 200, resp);
    r->pump = x;
    return MHD_YES;
}

static enum MHD_Result chat(gw_server_t *s, req_t *r) {
    gw_chat_t req;
    char err[512];
    const char *param;
    if (!gw_chat_parse(r->body ? r->body : "", r->len, &req, err, sizeof err, &param)) {
        gw_metrics_query(s->metrics, GW_MODE_DEFAULT, GW_OUT_BAD_REQUEST, -1, 0, NULL);
        return send_error(s, r, 400, "invalid_request_error", param, param ? "invalid_value" : "invalid_json", "%s",
                          err);
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
        return send_error(s, r, 500, "server_error", NULL, "internal", "cannot encode the query");
    }
    /* the connection is suspended while this runs: its socket stays open, so it may be watched */
    gw_stream_opts_t so = {.endpoint = s->o.endpoints[SVC_BLEND], .opts = &s->o.bus, .first_ms = s->o.first_ms,
                           .total_ms = s->o.query_timeout_ms, .client_fd = &r->watch_fd, .stopping = &s->stopping};
    cb_err_t code;
    gw_stream_t *st = gw_stream_start(&so, data, len, id, &code, err, sizeof err);
    cb_msg_writer_destroy(&w);
    if (!st) {
        http_err_t he = map_err(code);
        gw_metrics_query(s->metrics, asked, he.outcome, -1, (cb_now_ms() - r->t0) / 1e3, NULL);
        gw_chat_clear(&req);
        return send_error(s, r, he.status, he.type, NULL, he.code, "cb-blend: %s", err);
    }
    gw_stream_end_t why;
    cb_msg_t *m = first_message(st, &why, err, sizeof err);
    if (!m || !cb_msg_ok(m)) { /* before any byte of the answer: a plain HTTP error */
        http_err_t he = map_err(m ? cb_msg_err_code(m)
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
        return send_error(s, r, he.status, he.type, NULL, he.code, "%s", msg);
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
        rc = send_json(s, r, 200, gw_completion(cid, created, model, m, gw_chat_max_tokens(&req)));
    } else {
        http_err_t he = map_err(m ? cb_msg_err_code(m) : why == GW_STREAM_STOPPING || why == GW_STREAM_FAILED
                                                               ? CB_ERR_UNAVAILABLE
                                                               : CB_ERR_TIMEOUT);
        if (!m && why == GW_STREAM_GONE) he.outcome = GW_OUT_CANCELLED;
        gw_metrics_query(s->metrics, asked, he.outcome, ttft / 1e3, (cb_now_ms() - r->t0) / 1e3, NULL);
        cb_log(CB_LOG_WARN, id, "chat completion %s: %s", gw_outcome_name(he.outcome), m ? cb_msg_err_message(m) : err);
        rc = !m && why == GW_STREAM_GONE
                 ? MHD_NO
                 : send_error(s, r, he.status, he.type, NULL, he.code, "%s", m ? cb_msg_err_message(m) : err);
    }
    cb_msg_destroy(&m);
    gw_chat_clear(&req);
    return rc;
}

/* ---------------------------------------------------------------------------------------------- */
/* Models, health, metrics                                                                         */

static void fanout(gw_server_t *s, const char *type, const int *which, int n, cb_bus_result_t *res) {
    const char *eps[4];
    for (int i = 0; i < n; i++) eps[i] = s->o.endpoints[which[i]];
    cb_bus_fanout(&s->o.bus, type, eps, n, s->o.health_timeout_ms, s->o.health_timeout_ms, res);
}

static enum MHD_Result models(gw_server_t *s, req_t *r) {
    cb_bus_result_t res[1];
    int which[1] = {SVC_BLEND};
    fanout(s, "ping", which, 1, res);
    enum MHD_Result rc;
    char name[512] = "", fp[80] = "";
    if (res[0].reply && cb_msg_str_copy(res[0].reply, "model", 500, name, sizeof name) && name[0]) {
        cb_msg_str_copy(res[0].reply, "model_fingerprint", 70, fp, sizeof fp);
        json_t *m = json_pack("{s:s, s:s, s:i, s:s, s:s}", "id", name, "object", "model", "created", 0, "owned_by",
                              "cacheblend", "fingerprint", fp);
        rc = send_json(s, r, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", m));
    } else {
        rc = send_error(s, r, 503, "service_unavailable", NULL, "unavailable", "cb-blend does not answer: %s",
                        res[0].reply ? cb_msg_err_message(res[0].reply) : res[0].error);
    }
    cb_bus_results_free(res, 1);
    return rc;
}

static enum MHD_Result health(gw_server_t *s, req_t *r) {
    cb_bus_result_t res[4];
    int which[4] = {0, 1, 2, 3};
    fanout(s, "ping", which, 4, res);
    json_t *svcs = json_object(), *down = json_array(), *degraded = json_array();
    for (int i = 0; i < 4; i++) {
        bool ok = res[i].reply && cb_msg_ok(res[i].reply);
        /* a service that answers may be degraded (its data disk is full): its ping's status and reason */
        char st[16] = "ok";
        const char *why = NULL;
        size_t why_len = 0;
        if (ok) {
            cb_msg_str_copy(res[i].reply, "status", sizeof st - 1, st, sizeof st);
            if (!cb_msg_str(res[i].reply, "reason", 8192, &why, &why_len)) why = NULL;
        }
        bool bad = ok && !strcmp(st, "degraded");
        json_t *e = json_pack("{s:s, s:s}", "status", !ok ? "down" : bad ? "degraded" : "ok", "endpoint",
                              s->o.endpoints[i]);
        if (ok) json_object_set_new(e, "latency_ms", json_real(res[i].latency_ms));
        else {
            json_object_set_new(e, "error", json_string(res[i].reply ? cb_msg_err_message(res[i].reply) : res[i].error));
            json_array_append_new(down, json_string(SERVICE_NAMES[i]));
        }
        if (bad) {
            json_object_set_new(e, "reason", why ? json_stringn(why, why_len) : json_string("degraded"));
            json_array_append_new(degraded, json_string(SERVICE_NAMES[i]));
        }
        int64_t free_bytes;
        if (ok && cb_msg_int(res[i].reply, "disk_free_bytes", 0, INT64_MAX, &free_bytes))
            json_object_set_new(e, "disk_free_bytes", json_integer((json_int_t)free_bytes));
        json_object_set_new(svcs, SERVICE_NAMES[i], e);
    }
    cb_bus_results_free(res, 4);
    /* 503 only when a service does not answer; degraded (every service answers, one or more with a full data
     * disk) is 200 with status "degraded": the gateway still serves, an operator must make room */
    bool all = json_array_size(down) == 0;
    const char *status = !all ? "unavailable" : json_array_size(degraded) ? "degraded" : "ok";
    json_t *j = json_pack("{s:s, s:o, s:o, s:o}", "status", status, "services", svcs, "down", down, "degraded",
                          degraded);
    return send_json(s, r, all ? 200 : 503, j);
}

static enum MHD_Result metrics(gw_server_t *s, req_t *r) {
    cb_bus_result_t res[4];
    int which[4] = {0, 1, 2, 3};
    fanout(s, "stats", which, 4, res);
    size_t len;
    char *text = gw_metrics_render(s->metrics, SERVICE_NAMES, res, 4, &len);
    cb_bus_results_free(res, 4);
    if (!text) return send_error(s, r, 500, "server_error", NULL, "internal", "out of memory");
    return send_buf(s, r, 200, "text/plain; version=0.0.4; charset=utf-8", text, len, true);
}

/* ---------------------------------------------------------------------------------------------- */
/* Documents                                                                                       */

static cb_bus_client_t *precompute_client(gw_server_t *s, char *err, size_t errlen) {
    return cb_bus_client_new(s->o.endpoints[SVC_PRECOMPUTE], &s->o.bus, err, errlen);
}

static enum MHD_Result documents(gw_server_t *s, req_t *r) {
    json_error_t je;
    json_t *root = json_loadb(r->body ? r->body : "", r->len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return send_error(s, r, 400, "invalid_request_error", NULL, "invalid_json", "the body is not valid JSON: %s",
                          je.text);
    json_t *docs = json_object_get(root, "documents");
    size_t n = json_is_array(docs) ? json_array_size(docs) : 0;
    const char *why = NULL;
    if (!json_is_object(root) || !json_is_array(docs) || n == 0) why = "'documents' must be a non-empty array";
    else if (n > MAX_INGEST_DOCS) why = "at most 1000 documents per request";
    for (size_t i = 0; !why && i < n; i++) {
        json_t *d = json_array_get(docs, i), *id = json_object_get(d, "id"), *text = json_object_get(d, "text");
        json_t *meta = json_object_get(d, "meta");
        if (!json_is_object(d) || !json_is_string(id) || json_string_length(id) == 0 || json_string_length(id) > 256)
            why = "every document needs an 'id' string of 1 to 256 bytes";
        else if (!json_is_string(text) || json_string_length(text) == 0)
            why = "every document needs a non-empty 'text' string";
        else if (meta && !json_is_null(meta) && !json_is_object(meta))
            why = "a document's 'meta' must be an object";
    }
    if (why) {
        json_decref(root);
        return send_error(s, r, 400, "invalid_request_error", "documents", "invalid_value", "%s", why);
    }
    char err[512], who[GW_INGEST_CLIENT_MAX];
    gw_ingest_client(s->api_key, r->client + 3, who, sizeof who); /* r->client: "gw:" + address */
    cb_bus_client_t *pc = precompute_client(s, err, sizeof err);
    cb_msg_writer_t *w = cb_msg_writer_new();
    json_t *data = json_array();
    enum MHD_Result rc = MHD_YES;
    bool failed = !pc || !w;
    if (failed) rc = send_error(s, r, 500, "server_error", NULL, "internal", "%s", pc ? "out of memory" : err);
    for (size_t i = 0; !failed && i < n; i++) {
        if (atomic_load(&s->stopping)) { /* each document can take a send timeout: stop between them */
            failed = true;
            json_t *e = gw_error_json("the gateway is shutting down", "service_unavailable", "documents", "unavailable");
            json_object_set_new(json_object_get(e, "error"), "index", json_integer((json_int_t)i));
            json_object_set(e, "data", data);
            rc = send_json(s, r, 503, e);
            break;
        }
        json_t *d = json_array_get(docs, i), *meta = json_object_get(d, "meta");
        char id[32];
        cb_bus_new_id(id, sizeof id);
        cb_msg_begin(w, "ingest", id);
        cb_msg_put_str(w, "doc_id", json_string_value(json_object_get(d, "id")));
        cb_msg_put_strn(w, "text", json_string_value(json_object_get(d, "text")),
                        json_string_length(json_object_get(d, "text")));
        if (json_is_object(meta)) cb_msg_put_json(w, "meta", meta);
        cb_msg_put_str(w, "on_behalf_of", who); /* hashed API key or address (docs/gateway.md) */
        cb_err_t code;
        cb_msg_t *m = cb_bus_call_ok(pc, w, &code, err, sizeof err);
        const char *job;
        size_t jl;
        bool dup = false, restored = false;
        if (m && cb_msg_str(m, "job", 64, &job, &jl)) {
            cb_msg_bool_or(m, "duplicate", false, &dup);
            cb_msg_bool_or(m, "restored", false, &restored);
            json_array_append_new(data, json_pack("{s:O, s:s%, s:b, s:b}", "id", json_object_get(d, "id"), "job", job,
                                                  jl, "duplicate", dup, "restored", restored));
        } else {
            failed = true;
            http_err_t he = map_err(m ? CB_ERR_INTERNAL : code);
            if (code == CB_ERR_TOO_LARGE) he.status = 413;
            json_t *e = gw_error_json(m ? "cb-precompute sent an invalid reply" : err, he.type, "documents", he.code);
            json_object_set_new(json_object_get(e, "error"), "index", json_integer((json_int_t)i));
            json_object_set(e, "data", data); /* the documents acknowledged before this one */
            rc = send_json(s, r, he.status, e);
        }
        cb_msg_destroy(&m);
    }
    if (!failed) {
        cb_log(CB_LOG_INFO, NULL, "ingest: %zu documents acknowledged", n);
        rc = send_json(s, r, 200, json_pack("{s:s, s:O}", "object", "list", "data", data));
    }
    json_decref(data);
    json_decref(root);
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&pc);
    return rc;
}

static enum MHD_Result job_status(gw_server_t *s, req_t *r) {
    const char *job = r->url + 19; /* after "/v1/documents/jobs/" */
    size_t jl = strlen(job);
    bool valid = jl > 0 && jl <= 64;
    for (size_t i = 0; valid && i < jl; i++) valid = (job[i] >= '0' && job[i] <= '9') || (job[i] >= 'a' && job[i] <= 'f');
    if (!valid) return send_error(s, r, 404, "invalid_request_error", "job", "not_found", "no such job");
    char err[512];
    cb_bus_client_t *pc = precompute_client(s, err, sizeof err);
    cb_msg_writer_t *w = cb_msg_writer_new();
    if (!pc || !w) {
        cb_msg_writer_destroy(&w);
        cb_bus_client_destroy(&pc);
        return send_error(s, r, 500, "server_error", NULL, "internal", "%s", pc ? "out of memory" : err);
    }
    char id[32];
    cb_bus_new_id(id, sizeof id);
    cb_msg_begin(w, "status", id);
    cb_msg_put_str(w, "job", job);
    cb_err_t code;
    cb_msg_t *m = cb_bus_call_ok(pc, w, &code, err, sizeof err);
    enum MHD_Result rc;
    if (m) {
        json_t *j = cb_msg_to_json(m);
        const char *skip[] = {"v", "type", "id", "ok"};
        for (size_t i = 0; i < sizeof skip / sizeof skip[0]; i++) json_object_del(j, skip[i]);
        json_object_set_new(j, "id", json_string(job));
        json_object_set_new(j, "object", json_string("ingest.job"));
        rc = send_json(s, r, 200, j);
    } else {
        http_err_t he = map_err(code);
        rc = send_error(s, r, he.status, he.type, code == CB_ERR_NOT_FOUND ? "job" : NULL, he.code, "%s", err);
    }
    cb_msg_destroy(&m);
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&pc);
    return rc;
}

/* ---------------------------------------------------------------------------------------------- */
/* Routing                                                                                         */

static enum MHD_Result count_header(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    (void)kind, (void)key, (void)value;
    (*(unsigned *)cls)++;
    return MHD_YES;
}

static bool authorized(gw_server_t *s, struct MHD_Connection *c) {
    if (!s->api_key[0]) return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncmp(h, "Bearer ", 7)) return false;
    const char *key = h + 7;
    size_t kl = strlen(key), want = strlen(s->api_key);
    return kl == want && sodium_memcmp(key, s->api_key, want) == 0; /* constant time */
}

static enum MHD_Result method_not_allowed(gw_server_t *s, req_t *r, const char *allow) {
    enum MHD_Result rc = send_error(s, r, 405, "invalid_request_error", NULL, "method_not_allowed", "method not allowed");
    reply_header(r, MHD_HTTP_HEADER_ALLOW, allow);
    return rc;
}

/* The route of a path (the metrics label `handler`). */
static const char *route_of(const char *url) {
    if (!strcmp(url, "/v1/chat/completions")) return "chat";
    if (!strcmp(url, "/v1/models")) return "models";
    if (!strcmp(url, "/v1/documents")) return "documents";
    if (!strncmp(url, "/v1/documents/jobs/", 19)) return "jobs";
    if (!strcmp(url, "/health")) return "health";
    if (!strcmp(url, "/metrics")) return "metrics";
    if (!strcmp(url, "/") || !strcmp(url, "/index.html")) return "page";
    return "other";
}

/* A job: the request's handler in its own thread, the connection suspended (it holds no libmicrohttpd
 * thread) until the answer is made; then, for a stream, the same thread feeds it. */
static void *job_main(void *arg) {
    req_t *r = arg;
    gw_server_t *s = r->s;
    struct MHD_Connection *mc = r->mc;
    if (r->fn(s, r) == MHD_NO) set_reply(r, 0, NULL);
    sse_t *pump = r->pump;
    r->pump = NULL;
    r->job = JOB_DONE;
    MHD_resume_connection(mc); /* from here r is libmicrohttpd's thread's again: on_request delivers */
    if (pump) sse_pump(pump);
    gw_metrics_active(s->metrics, -1);
    atomic_fetch_sub(&s->jobs, 1);
    return NULL;
}

static enum MHD_Result start_job(gw_server_t *s, struct MHD_Connection *c, req_t *r, handler_fn fn) {
    if (atomic_fetch_add(&s->jobs, 1) >= (int)s->o.max_requests) {
        atomic_fetch_sub(&s->jobs, 1);
        gw_metrics_refused(s->metrics, GW_REFUSED_BUSY);
        send_error(s, r, 503, "service_unavailable", NULL, "overloaded",
                   "the gateway is answering %u requests (gateway.max_requests)", s->o.max_requests);
        reply_header(r, "Retry-After", "1");
        return deliver(s, c, r);
    }
    gw_metrics_active(s->metrics, 1);
    r->fn = fn;
    r->job = JOB_RUNNING;
    r->answered = true;
    gw_admit_conn_answering(s->admit, r->conn);
    MHD_suspend_connection(c);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    int rc = pthread_create(&t, &attr, job_main, r);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        gw_metrics_active(s->metrics, -1);
        atomic_fetch_sub(&s->jobs, 1);
        cb_log(CB_LOG_WARN, NULL, "cannot start a request thread: %s", strerror(rc));
        send_error(s, r, 503, "service_unavailable", NULL, "overloaded", "the gateway cannot start a thread");
        reply_header(r, "Retry-After", "1");
        r->job = JOB_DONE;
        MHD_resume_connection(c); /* delivered when libmicrohttpd calls on_request again */
    }
    return MHD_YES;
}

/* The whole request is in: its answer, made here (the page, errors) or by a job (what asks a service). */
static enum MHD_Result dispatch(gw_server_t *s, struct MHD_Connection *c, req_t *r, const char *method) {
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
    const char *h = r->handler;
    static const struct {
        const char *name;
        handler_fn fn;
        bool post;
    } jobs[] = {{"chat", chat, true},     {"documents", documents, true}, {"models", models, false},
                {"jobs", job_status, false}, {"health", health, false},     {"metrics", metrics, false}};
    for (size_t i = 0; i < sizeof jobs / sizeof jobs[0]; i++) {
        if (strcmp(h, jobs[i].name)) continue;
        if (jobs[i].post ? post : get) return start_job(s, c, r, jobs[i].fn);
        method_not_allowed(s, r, jobs[i].post ? "POST" : "GET");
        return deliver(s, c, r);
    }
    if (!strcmp(h, "page")) {
        if (!get) method_not_allowed(s, r, "GET");
        else {
            size_t len;
            const char *page = gw_page(&len);
            send_buf(s, r, 200, "text/html; charset=utf-8", (char *)page, len, false);
        }
        return deliver(s, c, r);
    }
    send_error(s, r, 404, "invalid_request_error", NULL, "not_found", "no route for %s %.200s", method, r->url);
    return deliver(s, c, r);
}

/* The connection's admission record (NULL when it has none). */
static void *conn_ctx(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

static req_t *req_new(gw_server_t *s, struct MHD_Connection *c) {
    req_t *r = cb_calloc(1, sizeof *r);
    if (!r) return NULL;
    r->s = s;
    r->mc = c;
    r->t0 = cb_now_ms();
    r->conn = conn_ctx(c);
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    r->fd = ci ? ci->connect_fd : -1;
    atomic_init(&r->watch_fd, r->fd);
    ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    gw_addr_key(ci ? ci->client_addr : NULL, r->key);
    char addr[INET6_ADDRSTRLEN];
    gw_addr_key_str(r->key, addr, sizeof addr);
    snprintf(r->client, sizeof r->client, "gw:%s", addr);
    return r;
}

/* The headers are in: the checks that need no body. Returns MHD_YES with nothing queued to go on. */
static enum MHD_Result on_headers(gw_server_t *s, struct MHD_Connection *c, req_t *r, const char *url) {
    unsigned n_headers = 0;
    MHD_get_connection_values(c, MHD_HEADER_KIND, count_header, &n_headers);
    if (n_headers > s->o.max_headers) {
        send_error(s, r, 431, "invalid_request_error", NULL, "too_many_headers", "%u header fields; at most %u",
                   n_headers, s->o.max_headers);
        return deliver(s, c, r);
    }
    if (!strncmp(url, "/v1/", 4) && s->api_key[0]) {
        unsigned wait = gw_keyguard_locked(s->keyguard, r->key);
        if (wait) { /* locked out: the key is not even looked at */
            gw_metrics_refused(s->metrics, GW_REFUSED_API_KEY);
            send_error(s, r, 429, "rate_limit_error", NULL, "too_many_failed_keys",
                       "too many wrong API keys from this address; retry in %u s", wait);
            char ra[16];
            snprintf(ra, sizeof ra, "%u", wait);
            reply_header(r, "Retry-After", ra);
            return deliver(s, c, r);
        }
        if (!authorized(s, c)) {
            if (gw_keyguard_failed(s->keyguard, r->key))
                cb_log(CB_LOG_WARN, NULL, "%s: %u wrong API keys within %u s: its /v1/ requests get 429 for %u s",
                       r->client + 3, s->o.auth_fail_limit, s->o.auth_fail_window_s, s->o.auth_lockout_s);
            send_error(s, r, 401, "invalid_request_error", NULL, "invalid_api_key",
                       "a valid API key is required (Authorization: Bearer KEY)");
            return deliver(s, c, r);
        }
    }
    const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl && strtoull(cl, NULL, 10) > s->o.max_body_bytes) {
        send_error(s, r, 413, "invalid_request_error", NULL, "body_too_large", "the body is %s bytes; at most %zu", cl,
                   s->o.max_body_bytes);
        return deliver(s, c, r);
    }
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **req_cls) {
    (void)version;
    gw_server_t *s = cls;
    req_t *r = *req_cls;
    if (!r && !(r = *req_cls = req_new(s, c))) return MHD_NO;
    if (r->job == JOB_DONE) { /* resumed: the job's answer */
        r->job = JOB_NONE;
        return deliver(s, c, r);
    }
    if (!r->started) {
        r->started = true;
        if (!(r->url = cb_strdup(url))) return MHD_NO;
        r->handler = route_of(url);
        return on_headers(s, c, r, url);
    }
    if (*upload_size > 0) { /* a piece of the body */
        size_t n = *upload_size;
        *upload_size = 0;
        if (r->answered || r->too_large) return MHD_YES;
        if (r->len + n > s->o.max_body_bytes) {
            r->too_large = true;
            free(r->body);
            r->body = NULL;
            r->len = r->cap = 0;
            return MHD_YES;
        }
        if (r->len + n + 1 > r->cap) {
            size_t cap = r->cap ? r->cap : 4096;
            while (cap < r->len + n + 1) cap *= 2;
            char *p = cb_realloc(r->body, cap);
            if (!p) return MHD_NO;
            r->body = p;
            r->cap = cap;
        }
        memcpy(r->body + r->len, upload, n);
        r->len += n;
        r->body[r->len] = 0;
        return MHD_YES;
    }
    if (r->answered) return MHD_YES;
    if (r->too_large) {
        send_error(s, r, 413, "invalid_request_error", NULL, "body_too_large", "the body is over %zu bytes",
                   s->o.max_body_bytes);
        return deliver(s, c, r);
    }
    return dispatch(s, c, r, method);
}

/* A request line was parsed (before its headers): the request's state, and its deadline on a kept-alive
 * connection. Its return value is the request's *req_cls. */
static void *on_request_line(void *cls, const char *uri, struct MHD_Connection *c) {
    (void)uri; /* raw, with its query string: the route is taken from on_request's url */
    gw_server_t *s = cls;
    req_t *r = req_new(s, c);
    gw_admit_conn_request_line(s->admit, r ? r->conn : conn_ctx(c));
    return r;
}

static void on_completed(void *cls, struct MHD_Connection *c, void **req_cls, enum MHD_RequestTerminationCode toe) {
    (void)toe;
    gw_server_t *s = cls;
    req_t *r = *req_cls;
    gw_admit_conn_idle(s->admit, r ? r->conn : conn_ctx(c));
    if (!r) return;
    if (r->resp) MHD_destroy_response(r->resp);
    free(r->url);
    free(r->body);
    free(r);
    *req_cls = NULL;
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_ctx, enum MHD_ConnectionNotificationCode t) {
    gw_server_t *s = cls;
    if (t == MHD_CONNECTION_NOTIFY_STARTED) gw_admit_conn_started(s->admit, c, socket_ctx);
    else gw_admit_conn_closed(s->admit, socket_ctx);
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = 0;
    /* a client that closes (or is closed at the request deadline, counted in gw_admit's summary line) mid-request:
     * one line each would flood the log under a connection flood */
    bool closure = strstr(msg, "connection closure") || strstr(msg, "closed by remote");
    cb_log(closure ? CB_LOG_DEBUG : CB_LOG_WARN, NULL, "http: %s", msg);
}

/* ---------------------------------------------------------------------------------------------- */

/* Splits "HOST:PORT" / "[V6]:PORT" and resolves it (numeric or a name) into *ss. */
static bool parse_listen(const char *listen, struct sockaddr_storage *ss, socklen_t *sl, bool *v6, char *err,
                         size_t errlen) {
    char host[256];
    const char *colon = strrchr(listen, ':');
    if (!colon || colon == listen || strlen(listen) >= sizeof host) {
        snprintf(err, errlen, "gateway.listen = '%s': expected HOST:PORT", listen);
        return false;
    }
    size_t hl = (size_t)(colon - listen);
    memcpy(host, listen, hl);
    host[hl] = 0;
    if (host[0] == '[' && hl >= 2 && host[hl - 1] == ']') {
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = 0;
    }
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (*end || end == colon + 1 || port < 0 || port > 65535) {
        snprintf(err, errlen, "gateway.listen = '%s': the port must be 0..65535", listen);
        return false;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    int rc = getaddrinfo(!strcmp(host, "*") ? NULL : host, colon + 1, &hints, &ai);
    if (rc != 0 || !ai) {
        snprintf(err, errlen, "gateway.listen = '%s': %s", listen, gai_strerror(rc));
        return false;
    }
    memcpy(ss, ai->ai_addr, ai->ai_addrlen);
    *sl = ai->ai_addrlen;
    *v6 = ai->ai_family == AF_INET6;
    freeaddrinfo(ai);
    return true;
}


/* Raises the soft limit on open files to what the limits need; false with err when the hard limit is lower. */
static bool raise_fd_limit(const gw_server_opts_t *o, char *err, size_t errlen) {
    rlim_t need = (rlim_t)o->max_connections + (rlim_t)FDS_PER_REQUEST * o->max_requests + FDS_SPARE;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return true;
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur >= need) return true;
    if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < need) {
        snprintf(err, errlen,
                 "gateway.max_connections = %u and gateway.max_requests = %u need about %llu open files, but the "
                 "limit is %llu (ulimit -Hn): lower them or raise the limit",
                 o->max_connections, o->max_requests, (unsigned long long)need, (unsigned long long)rl.rlim_max);
        return false;
    }
    rl.rlim_cur = need;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
        snprintf(err, errlen, "cannot raise the open-file limit to %llu: %s", (unsigned long long)need, strerror(errno));
        return false;
    }
    return true;
}

gw_server_t *gw_server_new(const gw_server_opts_t *o, char *err, size_t errlen) {
    gw_server_t *s = cb_calloc(1, sizeof *s);
    if (!s || !(s->metrics = gw_metrics_new()) ||
        !(s->keyguard = gw_keyguard_new(o->auth_fail_limit, o->auth_fail_window_s, o->auth_lockout_s))) {
        snprintf(err, errlen, "out of memory");
        if (s) gw_metrics_destroy(&s->metrics);
        free(s);
        return NULL;
    }
    s->o = *o;
    snprintf(s->listen, sizeof s->listen, "%s", o->listen);
    snprintf(s->api_key, sizeof s->api_key, "%s", o->api_key ? o->api_key : "");
    s->o.listen = s->listen;
    s->o.api_key = s->api_key;
    struct sockaddr_storage ss;
    socklen_t sl;
    bool v6;
    if (!parse_listen(o->listen, &ss, &sl, &v6, err, errlen) || !raise_fd_limit(o, err, errlen)) {
        gw_server_destroy(&s);
        return NULL;
    }
    gw_admit_opts_t ao = {.max_connections = o->max_connections, .max_per_ip = o->max_connections_per_ip,
                          .request_timeout_s = o->request_timeout_s, .idle_timeout_s = o->idle_timeout_s,
                          .line_bytes = o->header_bytes, .metrics = s->metrics};
    char e2[256];
    if (!(s->admit = gw_admit_new(&ao, (struct sockaddr *)&ss, sl, e2, sizeof e2))) {
        snprintf(err, errlen, "cannot listen on %s: %s", o->listen, e2);
        gw_server_destroy(&s);
        return NULL;
    }
    /* Connections come from gw_admit (MHD_add_connection), so libmicrohttpd's own limit sits above ours: ours
     * counts a connection until libmicrohttpd's close notification, a moment before libmicrohttpd does. */
    unsigned mhd_limit = o->max_connections + 64 * o->http_threads;
    unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_USE_NO_LISTEN_SOCKET | MHD_ALLOW_SUSPEND_RESUME |
                     MHD_USE_ERROR_LOG;
    s->daemon = MHD_start_daemon(
        flags, 0, NULL, NULL, on_request, s, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, s, MHD_OPTION_THREAD_POOL_SIZE,
        o->http_threads, MHD_OPTION_CONNECTION_LIMIT, mhd_limit, MHD_OPTION_CONNECTION_TIMEOUT, o->idle_timeout_s,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, o->header_bytes, MHD_OPTION_STRICT_FOR_CLIENT, 0,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
        MHD_OPTION_URI_LOG_CALLBACK, on_request_line, s, MHD_OPTION_END);
    if (!s->daemon) {
        snprintf(err, errlen, "cannot start the HTTP server (libmicrohttpd, %u threads)", o->http_threads);
        gw_server_destroy(&s);
        return NULL;
    }
    if (!gw_admit_start(s->admit, s->daemon, err, errlen)) {
        gw_server_destroy(&s);
        return NULL;
    }
    s->port = gw_admit_port(s->admit);
    return s;
}

void gw_server_destroy(gw_server_t **self_p) {
    if (!self_p || !*self_p) return;
    gw_server_t *s = *self_p;
    atomic_store(&s->stopping, true);
    gw_admit_stop(s->admit); /* no new connections */
    /* Jobs see `stopping` within 200 ms (a document ingest within one call): libmicrohttpd must not be
     * stopped while one holds a suspended connection. */
    while (atomic_load(&s->jobs) > 0) usleep(10000);
    if (s->daemon) MHD_stop_daemon(s->daemon);
    gw_admit_destroy(&s->admit);
    gw_keyguard_destroy(&s->keyguard);
    gw_metrics_destroy(&s->metrics);
    free(s);
    *self_p = NULL;
}

int gw_server_port(const gw_server_t *self) { return self->port; }
