/* server: the HTTP side of cb-gateway. See server.h. */
#include "server.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netdb.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "base/log.h"
#include "metrics.h"
#include "openai.h"
#include "page.h"
#include "stream.h"

static const char *const SERVICE_NAMES[4] = {"retriever", "cacheindex", "precompute", "blend"};
enum { SVC_RETRIEVER, SVC_CACHEINDEX, SVC_PRECOMPUTE, SVC_BLEND };

#define MAX_INGEST_DOCS 1000

struct gw_server {
    gw_server_opts_t o;
    char listen[256], api_key[256];
    struct MHD_Daemon *daemon;
    gw_metrics_t *metrics;
    atomic_bool stopping;
    int port;
};

/* One HTTP request's state (MHD's per-request pointer), from its first call to its completion. */
typedef struct {
    const char *handler;  /* metrics label, set when routed */
    char *body;           /* the request body [len] (cap bytes allocated), NUL-terminated */
    size_t len, cap;
    bool too_large;       /* the body went past max_body_bytes: 413 at the end */
    bool answered;        /* a response was queued early (limit errors) */
    double t0;            /* arrival (cb_now_ms) */
} req_t;

/* ---------------------------------------------------------------------------------------------- */
/* Responses                                                                                       */

static enum MHD_Result send_buf(gw_server_t *s, struct MHD_Connection *c, req_t *r, int status, const char *type,
                                char *buf, size_t len, bool must_free) {
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, buf, must_free ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!resp) {
        if (must_free) free(buf);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (status == MHD_HTTP_UNAUTHORIZED) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    enum MHD_Result rc = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    gw_metrics_http(s->metrics, r->handler, status);
    return rc;
}

/* Sends j (its reference is taken) as the JSON body. */
static enum MHD_Result send_json(gw_server_t *s, struct MHD_Connection *c, req_t *r, int status, json_t *j) {
    char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!text) {
        static char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}";
        return send_buf(s, c, r, 500, "application/json", oom, sizeof oom - 1, false);
    }
    return send_buf(s, c, r, status, "application/json", text, strlen(text), true);
}

static enum MHD_Result send_error(gw_server_t *s, struct MHD_Connection *c, req_t *r, int status, const char *type,
                                  const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));
static enum MHD_Result send_error(gw_server_t *s, struct MHD_Connection *c, req_t *r, int status, const char *type,
                                  const char *param, const char *code, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return send_json(s, c, r, status, gw_error_json(msg, type, param, code));
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

static int connection_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

/* The ingest `client` of an HTTP request (cb-precompute's fairness and per-client limits): "gw:" + the peer's
 * address, so that one HTTP client is one client whatever connections it opens. */
static void ingest_client(struct MHD_Connection *c, char *out, size_t cap) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    char addr[INET6_ADDRSTRLEN] = "?";
    const struct sockaddr *sa = ci ? ci->client_addr : NULL;
    if (sa && sa->sa_family == AF_INET)
        inet_ntop(AF_INET, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, addr, sizeof addr);
    else if (sa && sa->sa_family == AF_INET6)
        inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr, addr, sizeof addr);
    snprintf(out, cap, "gw:%s", addr);
}

static void new_query_id(char *buf, size_t size) { cb_bus_new_id(buf, size); }

/* ---------------------------------------------------------------------------------------------- */
/* Chat completions                                                                                */

/* A streamed answer: the SSE reader's state (MHD calls sse_read until it returns end of stream). */
typedef struct {
    gw_server_t *s;
    gw_stream_t *st;
    gw_chat_t req;
    cb_msg_t *first;      /* the first message, received before the response began */
    char cid[96];
    char model[300];
    int64_t created;
    double t0, ttft_ms;   /* arrival; first token sent (-1: none) */
    char *out;            /* bytes made and not yet given to MHD: out[off..len) */
    size_t len, off, cap;
    bool role_sent, finished;
    gw_outcome_t outcome;
    gw_mode_t mode;
    cb_msg_t *done;       /* kept for the metrics */
} sse_t;

static bool out_append(sse_t *x, const char *data, size_t n) {
    if (x->len + n + 1 > x->cap) {
        size_t cap = x->cap ? x->cap : 1024;
        while (cap < x->len + n + 1) cap *= 2;
        char *p = realloc(x->out, cap);
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

/* Turns one message of the query into SSE events; false at the end of the stream. */
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
        json_t *last = gw_chunk(x->cid, x->created, x->model, NULL, NULL, 0, gw_finish_reason(m, x->req.max_tokens));
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

static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    sse_t *x = cls;
    while (x->off == x->len) {
        x->off = x->len = 0;
        if (x->finished) return MHD_CONTENT_READER_END_OF_STREAM;
        cb_msg_t *m = x->first;
        x->first = NULL;
        if (!m) {
            gw_stream_end_t why;
            char err[256];
            m = gw_stream_next(x->st, &why, err, sizeof err);
            if (!m) {
                x->finished = true;
                if (why == GW_STREAM_GONE) {
                    x->outcome = GW_OUT_CANCELLED;
                    return MHD_CONTENT_READER_END_WITH_ERROR;
                }
                http_err_t he = map_err(why == GW_STREAM_STOPPING || why == GW_STREAM_FAILED ? CB_ERR_UNAVAILABLE
                                                                                             : CB_ERR_TIMEOUT);
                x->outcome = he.outcome;
                out_event(x, gw_error_json(err, he.type, NULL, he.code));
                continue;
            }
        }
        bool more = sse_message(x, m);
        if (m != x->done) cb_msg_destroy(&m);
        if (!more) x->finished = true;
    }
    size_t n = x->len - x->off < max ? x->len - x->off : max;
    memcpy(buf, x->out + x->off, n);
    x->off += n;
    return (ssize_t)n;
}

static void sse_free(void *cls) {
    sse_t *x = cls;
    if (!x->finished) x->outcome = GW_OUT_CANCELLED; /* MHD gave up on the connection */
    double e2e = cb_now_ms() - x->t0;
    gw_metrics_query(x->s->metrics, x->mode, x->outcome, x->ttft_ms >= 0 ? x->ttft_ms / 1e3 : -1, e2e / 1e3, x->done);
    cb_log(x->outcome == GW_OUT_OK ? CB_LOG_INFO : CB_LOG_WARN, x->cid + 9, "chat completion (stream) %s in %.1f ms",
           gw_outcome_name(x->outcome), e2e);
    gw_stream_destroy(&x->st); /* closes the DEALER: cb-blend drops a query still running */
    cb_msg_destroy(&x->first);
    cb_msg_destroy(&x->done);
    gw_chat_clear(&x->req);
    free(x->out);
    free(x);
}

/* Waits for the query's first message that is not a heartbeat (NULL with *why, err). */
static cb_msg_t *first_message(gw_stream_t *st, gw_stream_end_t *why, char *err, size_t errlen) {
    for (;;) {
        cb_msg_t *m = gw_stream_next(st, why, err, errlen);
        if (!m || !cb_msg_is_type(m, "heartbeat")) return m;
        cb_msg_destroy(&m);
    }
}

static enum MHD_Result chat(gw_server_t *s, struct MHD_Connection *c, req_t *r) {
    gw_chat_t req;
    char err[512];
    const char *param;
    if (!gw_chat_parse(r->body ? r->body : "", r->len, &req, err, sizeof err, &param)) {
        gw_metrics_query(s->metrics, GW_MODE_DEFAULT, GW_OUT_BAD_REQUEST, -1, 0, NULL);
        return send_error(s, c, r, 400, "invalid_request_error", param, param ? "invalid_value" : "invalid_json", "%s",
                          err);
    }
    gw_mode_t asked = gw_mode_parse(req.mode);
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
        return send_error(s, c, r, 500, "server_error", NULL, "internal", "cannot encode the query");
    }
    gw_stream_opts_t so = {.endpoint = s->o.endpoints[SVC_BLEND], .opts = &s->o.bus, .first_ms = s->o.first_ms,
                           .total_ms = s->o.query_timeout_ms, .client_fd = connection_fd(c), .stopping = &s->stopping};
    cb_err_t code;
    gw_stream_t *st = gw_stream_start(&so, data, len, id, &code, err, sizeof err);
    cb_msg_writer_destroy(&w);
    if (!st) {
        http_err_t he = map_err(code);
        gw_metrics_query(s->metrics, asked, he.outcome, -1, (cb_now_ms() - r->t0) / 1e3, NULL);
        gw_chat_clear(&req);
        return send_error(s, c, r, he.status, he.type, NULL, he.code, "cb-blend: %s", err);
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
        return send_error(s, c, r, he.status, he.type, NULL, he.code, "%s", msg);
    }
    char cid[96];
    snprintf(cid, sizeof cid, "chatcmpl-%s", id);
    const char *model = gw_chat_model(&req, "cacheblend");
    int64_t created = (int64_t)time(NULL);
    if (req.stream) {
        sse_t *x = calloc(1, sizeof *x);
        if (!x) {
            cb_msg_destroy(&m);
            gw_stream_destroy(&st);
            gw_chat_clear(&req);
            return send_error(s, c, r, 500, "server_error", NULL, "internal", "out of memory");
        }
        x->s = s;
        x->st = st;
        x->req = req;
        x->first = m;
        snprintf(x->cid, sizeof x->cid, "%s", cid);
        snprintf(x->model, sizeof x->model, "%s", model);
        x->created = created;
        x->t0 = r->t0;
        x->ttft_ms = -1;
        x->mode = asked;
        x->outcome = GW_OUT_ERROR;
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, sse_read, x, sse_free);
        if (!resp) {
            sse_free(x);
            return MHD_NO;
        }
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        enum MHD_Result rc = MHD_queue_response(c, MHD_HTTP_OK, resp);
        MHD_destroy_response(resp);
        gw_metrics_http(s->metrics, r->handler, 200);
        return rc;
    }
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
        rc = send_json(s, c, r, 200, gw_completion(cid, created, model, m, req.max_tokens));
    } else {
        http_err_t he = map_err(m ? cb_msg_err_code(m) : why == GW_STREAM_STOPPING || why == GW_STREAM_FAILED
                                                               ? CB_ERR_UNAVAILABLE
                                                               : CB_ERR_TIMEOUT);
        if (!m && why == GW_STREAM_GONE) he.outcome = GW_OUT_CANCELLED;
        gw_metrics_query(s->metrics, asked, he.outcome, ttft / 1e3, (cb_now_ms() - r->t0) / 1e3, NULL);
        cb_log(CB_LOG_WARN, id, "chat completion %s: %s", gw_outcome_name(he.outcome), m ? cb_msg_err_message(m) : err);
        rc = !m && why == GW_STREAM_GONE
                 ? MHD_NO
                 : send_error(s, c, r, he.status, he.type, NULL, he.code, "%s", m ? cb_msg_err_message(m) : err);
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

static enum MHD_Result models(gw_server_t *s, struct MHD_Connection *c, req_t *r) {
    cb_bus_result_t res[1];
    int which[1] = {SVC_BLEND};
    fanout(s, "ping", which, 1, res);
    enum MHD_Result rc;
    char name[512] = "", fp[80] = "";
    if (res[0].reply && cb_msg_str_copy(res[0].reply, "model", 500, name, sizeof name) && name[0]) {
        cb_msg_str_copy(res[0].reply, "model_fingerprint", 70, fp, sizeof fp);
        json_t *m = json_pack("{s:s, s:s, s:i, s:s, s:s}", "id", name, "object", "model", "created", 0, "owned_by",
                              "cacheblend", "fingerprint", fp);
        rc = send_json(s, c, r, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", m));
    } else {
        rc = send_error(s, c, r, 503, "service_unavailable", NULL, "unavailable", "cb-blend does not answer: %s",
                        res[0].reply ? cb_msg_err_message(res[0].reply) : res[0].error);
    }
    cb_bus_results_free(res, 1);
    return rc;
}

static enum MHD_Result health(gw_server_t *s, struct MHD_Connection *c, req_t *r) {
    cb_bus_result_t res[4];
    int which[4] = {0, 1, 2, 3};
    fanout(s, "ping", which, 4, res);
    json_t *svcs = json_object(), *down = json_array();
    for (int i = 0; i < 4; i++) {
        bool ok = res[i].reply && cb_msg_ok(res[i].reply);
        json_t *e = json_pack("{s:s, s:s}", "status", ok ? "ok" : "down", "endpoint", s->o.endpoints[i]);
        if (ok) json_object_set_new(e, "latency_ms", json_real(res[i].latency_ms));
        else {
            json_object_set_new(e, "error", json_string(res[i].reply ? cb_msg_err_message(res[i].reply) : res[i].error));
            json_array_append_new(down, json_string(SERVICE_NAMES[i]));
        }
        json_object_set_new(svcs, SERVICE_NAMES[i], e);
    }
    cb_bus_results_free(res, 4);
    bool all = json_array_size(down) == 0;
    json_t *j = json_pack("{s:s, s:o, s:o}", "status", all ? "ok" : "unavailable", "services", svcs, "down", down);
    return send_json(s, c, r, all ? 200 : 503, j);
}

static enum MHD_Result metrics(gw_server_t *s, struct MHD_Connection *c, req_t *r) {
    cb_bus_result_t res[4];
    int which[4] = {0, 1, 2, 3};
    fanout(s, "stats", which, 4, res);
    size_t len;
    char *text = gw_metrics_render(s->metrics, SERVICE_NAMES, res, 4, &len);
    cb_bus_results_free(res, 4);
    if (!text) return send_error(s, c, r, 500, "server_error", NULL, "internal", "out of memory");
    return send_buf(s, c, r, 200, "text/plain; version=0.0.4; charset=utf-8", text, len, true);
}

/* ---------------------------------------------------------------------------------------------- */
/* Documents                                                                                       */

static cb_bus_client_t *precompute_client(gw_server_t *s, char *err, size_t errlen) {
    return cb_bus_client_new(s->o.endpoints[SVC_PRECOMPUTE], &s->o.bus, err, errlen);
}

static enum MHD_Result documents(gw_server_t *s, struct MHD_Connection *c, req_t *r) {
    json_error_t je;
    json_t *root = json_loadb(r->body ? r->body : "", r->len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return send_error(s, c, r, 400, "invalid_request_error", NULL, "invalid_json", "the body is not valid JSON: %s",
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
        return send_error(s, c, r, 400, "invalid_request_error", "documents", "invalid_value", "%s", why);
    }
    char err[512];
    cb_bus_client_t *pc = precompute_client(s, err, sizeof err);
    cb_msg_writer_t *w = cb_msg_writer_new();
    json_t *data = json_array();
    enum MHD_Result rc = MHD_YES;
    bool failed = !pc || !w;
    if (failed) rc = send_error(s, c, r, 500, "server_error", NULL, "internal", "%s", pc ? "out of memory" : err);
    char client[64];
    ingest_client(c, client, sizeof client);
    for (size_t i = 0; !failed && i < n; i++) {
        json_t *d = json_array_get(docs, i), *meta = json_object_get(d, "meta");
        char id[32];
        cb_bus_new_id(id, sizeof id);
        cb_msg_begin(w, "ingest", id);
        cb_msg_put_str(w, "doc_id", json_string_value(json_object_get(d, "id")));
        cb_msg_put_strn(w, "text", json_string_value(json_object_get(d, "text")),
                        json_string_length(json_object_get(d, "text")));
        if (json_is_object(meta)) cb_msg_put_json(w, "meta", meta);
        cb_msg_put_str(w, "client", client);
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
            rc = send_json(s, c, r, he.status, e);
        }
        cb_msg_destroy(&m);
    }
    if (!failed) {
        cb_log(CB_LOG_INFO, NULL, "ingest: %zu documents acknowledged", n);
        rc = send_json(s, c, r, 200, json_pack("{s:s, s:O}", "object", "list", "data", data));
    }
    json_decref(data);
    json_decref(root);
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&pc);
    return rc;
}

static enum MHD_Result job_status(gw_server_t *s, struct MHD_Connection *c, req_t *r, const char *job) {
    size_t jl = strlen(job);
    bool valid = jl > 0 && jl <= 64;
    for (size_t i = 0; valid && i < jl; i++) valid = (job[i] >= '0' && job[i] <= '9') || (job[i] >= 'a' && job[i] <= 'f');
    if (!valid) return send_error(s, c, r, 404, "invalid_request_error", "job", "not_found", "no such job");
    char err[512];
    cb_bus_client_t *pc = precompute_client(s, err, sizeof err);
    cb_msg_writer_t *w = cb_msg_writer_new();
    if (!pc || !w) {
        cb_msg_writer_destroy(&w);
        cb_bus_client_destroy(&pc);
        return send_error(s, c, r, 500, "server_error", NULL, "internal", "%s", pc ? "out of memory" : err);
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
        rc = send_json(s, c, r, 200, j);
    } else {
        http_err_t he = map_err(code);
        rc = send_error(s, c, r, he.status, he.type, code == CB_ERR_NOT_FOUND ? "job" : NULL, he.code, "%s", err);
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

static enum MHD_Result method_not_allowed(gw_server_t *s, struct MHD_Connection *c, req_t *r, const char *allow) {
    json_t *j = gw_error_json("method not allowed", "invalid_request_error", NULL, "method_not_allowed");
    char *text = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    struct MHD_Response *resp = text ? MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE) : NULL;
    if (!resp) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result rc = MHD_queue_response(c, MHD_HTTP_METHOD_NOT_ALLOWED, resp);
    MHD_destroy_response(resp);
    gw_metrics_http(s->metrics, r->handler, 405);
    return rc;
}

/* The route of (method, url): sets r->handler; returns whether a body is expected (POST). */
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

static enum MHD_Result dispatch(gw_server_t *s, struct MHD_Connection *c, req_t *r, const char *url,
                                const char *method) {
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
    const char *h = r->handler;
    if (!strcmp(h, "chat")) return post ? chat(s, c, r) : method_not_allowed(s, c, r, "POST");
    if (!strcmp(h, "documents")) return post ? documents(s, c, r) : method_not_allowed(s, c, r, "POST");
    if (!strcmp(h, "models")) return get ? models(s, c, r) : method_not_allowed(s, c, r, "GET");
    if (!strcmp(h, "jobs")) return get ? job_status(s, c, r, url + 19) : method_not_allowed(s, c, r, "GET");
    if (!strcmp(h, "health")) return get ? health(s, c, r) : method_not_allowed(s, c, r, "GET");
    if (!strcmp(h, "metrics")) return get ? metrics(s, c, r) : method_not_allowed(s, c, r, "GET");
    if (!strcmp(h, "page")) {
        if (!get) return method_not_allowed(s, c, r, "GET");
        size_t len;
        const char *page = gw_page(&len);
        return send_buf(s, c, r, 200, "text/html; charset=utf-8", (char *)page, len, false);
    }
    return send_error(s, c, r, 404, "invalid_request_error", NULL, "not_found", "no route for %s %.200s", method, url);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **req_cls) {
    (void)version;
    gw_server_t *s = cls;
    req_t *r = *req_cls;
    if (!r) { /* the headers are in: checks that need no body */
        if (!(r = calloc(1, sizeof *r))) return MHD_NO;
        *req_cls = r;
        r->t0 = cb_now_ms();
        r->handler = route_of(url);
        unsigned n_headers = 0;
        MHD_get_connection_values(c, MHD_HEADER_KIND, count_header, &n_headers);
        if (n_headers > s->o.max_headers) {
            r->answered = true;
            return send_error(s, c, r, 431, "invalid_request_error", NULL, "too_many_headers",
                              "%u header fields; at most %u", n_headers, s->o.max_headers);
        }
        if (!strncmp(url, "/v1/", 4) && !authorized(s, c)) {
            r->answered = true;
            return send_error(s, c, r, 401, "invalid_request_error", NULL, "invalid_api_key",
                              "a valid API key is required (Authorization: Bearer KEY)");
        }
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoull(cl, NULL, 10) > s->o.max_body_bytes) {
            r->answered = true;
            return send_error(s, c, r, 413, "invalid_request_error", NULL, "body_too_large",
                              "the body is %s bytes; at most %zu", cl, s->o.max_body_bytes);
        }
        return MHD_YES;
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
            char *p = realloc(r->body, cap);
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
    r->answered = true;
    if (r->too_large)
        return send_error(s, c, r, 413, "invalid_request_error", NULL, "body_too_large", "the body is over %zu bytes",
                          s->o.max_body_bytes);
    return dispatch(s, c, r, url, method);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **req_cls, enum MHD_RequestTerminationCode toe) {
    (void)cls, (void)c, (void)toe;
    req_t *r = *req_cls;
    if (!r) return;
    free(r->body);
    free(r);
    *req_cls = NULL;
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_ctx, enum MHD_ConnectionNotificationCode t) {
    (void)c, (void)socket_ctx;
    gw_server_t *s = cls;
    gw_metrics_connection(s->metrics, t == MHD_CONNECTION_NOTIFY_STARTED ? 1 : -1);
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = 0;
    cb_log(CB_LOG_WARN, NULL, "http: %s", msg);
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

gw_server_t *gw_server_new(const gw_server_opts_t *o, char *err, size_t errlen) {
    gw_server_t *s = calloc(1, sizeof *s);
    if (!s || !(s->metrics = gw_metrics_new())) {
        snprintf(err, errlen, "out of memory");
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
    if (!parse_listen(o->listen, &ss, &sl, &v6, err, errlen)) {
        gw_server_destroy(&s);
        return NULL;
    }
    (void)sl;
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL | MHD_USE_ERROR_LOG |
                     (v6 ? MHD_USE_IPv6 : 0);
    s->daemon = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, s,
                                 MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                                 MHD_OPTION_CONNECTION_LIMIT, o->max_connections, MHD_OPTION_CONNECTION_TIMEOUT,
                                 o->idle_timeout_s, MHD_OPTION_CONNECTION_MEMORY_LIMIT, o->header_bytes,
                                 MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_NOTIFY_CONNECTION,
                                 on_connection, s, MHD_OPTION_LISTENING_ADDRESS_REUSE, 1u, MHD_OPTION_END);
    if (!s->daemon) {
        snprintf(err, errlen, "cannot listen on %s (in use? a valid local address?)", o->listen);
        gw_server_destroy(&s);
        return NULL;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : 0;
    return s;
}

void gw_server_destroy(gw_server_t **self_p) {
    if (!self_p || !*self_p) return;
    gw_server_t *s = *self_p;
    atomic_store(&s->stopping, true);
    if (s->daemon) MHD_stop_daemon(s->daemon);
    gw_metrics_destroy(&s->metrics);
    free(s);
    *self_p = NULL;
}

int gw_server_port(const gw_server_t *self) { return self->port; }
