/* server: the HTTP side of cb-gateway. See server.h. This file: the server's lifetime, each request's intake
 * (headers, API key, body, limits) and its routing to a handler, run in its own thread when it asks a
 * service; server_reply.c, server_chat.c and server_handlers.c make the answers (server_internal.h). */
#include "server_internal.h"
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

#define FDS_PER_REQUEST 4    /* file descriptors a request being answered may hold (ZeroMQ sockets, /health: 4) */
#define FDS_SPARE 256        /* the process's other descriptors (ZeroMQ's, logs, libraries) */

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
    enum MHD_Result rc = gw_server_send_error(s, r, 405, "invalid_request_error", NULL, "method_not_allowed", "method not allowed");
    gw_server_reply_header(r, MHD_HTTP_HEADER_ALLOW, allow);
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
    if (r->fn(s, r) == MHD_NO) gw_server_set_reply(r, 0, NULL);
    sse_t *pump = r->pump;
    r->pump = NULL;
    r->job = JOB_DONE;
    MHD_resume_connection(mc); /* from here r is libmicrohttpd's thread's again: on_request delivers */
    if (pump) gw_server_sse_pump(pump);
    gw_metrics_active(s->metrics, -1);
    atomic_fetch_sub(&s->jobs, 1);
    return NULL;
}

static enum MHD_Result start_job(gw_server_t *s, struct MHD_Connection *c, req_t *r, handler_fn fn) {
    if (atomic_fetch_add(&s->jobs, 1) >= (int)s->o.max_requests) {
        atomic_fetch_sub(&s->jobs, 1);
        gw_metrics_refused(s->metrics, GW_REFUSED_BUSY);
        gw_server_send_error(s, r, 503, "service_unavailable", NULL, "overloaded",
                   "the gateway is answering %u requests (gateway.max_requests)", s->o.max_requests);
        gw_server_reply_header(r, "Retry-After", "1");
        return gw_server_deliver(s, c, r);
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
        gw_server_send_error(s, r, 503, "service_unavailable", NULL, "overloaded", "the gateway cannot start a thread");
        gw_server_reply_header(r, "Retry-After", "1");
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
    } jobs[] = {{"chat", gw_server_chat, true},         {"documents", gw_server_documents, true},
                {"models", gw_server_models, false},    {"jobs", gw_server_job_status, false},
                {"health", gw_server_health, false},    {"metrics", gw_server_metrics, false}};
    for (size_t i = 0; i < sizeof jobs / sizeof jobs[0]; i++) {
        if (strcmp(h, jobs[i].name)) continue;
        if (jobs[i].post ? post : get) return start_job(s, c, r, jobs[i].fn);
        method_not_allowed(s, r, jobs[i].post ? "POST" : "GET");
        return gw_server_deliver(s, c, r);
    }
    if (!strcmp(h, "page")) {
        if (!get) method_not_allowed(s, r, "GET");
        else {
            size_t len;
            const char *page = gw_page(&len);
            gw_server_send_buf(s, r, 200, "text/html; charset=utf-8", (char *)page, len, false);
        }
        return gw_server_deliver(s, c, r);
    }
    gw_server_send_error(s, r, 404, "invalid_request_error", NULL, "not_found", "no route for %s %.200s", method,
                         r->url);
    return gw_server_deliver(s, c, r);
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
        gw_server_send_error(s, r, 431, "invalid_request_error", NULL, "too_many_headers",
                             "%u header fields; at most %u", n_headers, s->o.max_headers);
        return gw_server_deliver(s, c, r);
    }
    if (!strncmp(url, "/v1/", 4) && s->api_key[0]) {
        unsigned wait = gw_keyguard_locked(s->keyguard, r->key);
        if (wait) { /* locked out: the key is not even looked at */
            gw_metrics_refused(s->metrics, GW_REFUSED_API_KEY);
            gw_server_send_error(s, r, 429, "rate_limit_error", NULL, "too_many_failed_keys",
                       "too many wrong API keys from this address; retry in %u s", wait);
            char ra[16];
            snprintf(ra, sizeof ra, "%u", wait);
            gw_server_reply_header(r, "Retry-After", ra);
            return gw_server_deliver(s, c, r);
        }
        if (!authorized(s, c)) {
            if (gw_keyguard_failed(s->keyguard, r->key))
                cb_log(CB_LOG_WARN, NULL, "%s: %u wrong API keys within %u s: its /v1/ requests get 429 for %u s",
                       r->client + 3, s->o.auth_fail_limit, s->o.auth_fail_window_s, s->o.auth_lockout_s);
            gw_server_send_error(s, r, 401, "invalid_request_error", NULL, "invalid_api_key",
                       "a valid API key is required (Authorization: Bearer KEY)");
            return gw_server_deliver(s, c, r);
        }
    }
    const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl && strtoull(cl, NULL, 10) > s->o.max_body_bytes) {
        gw_server_send_error(s, r, 413, "invalid_request_error", NULL, "body_too_large",
                             "the body is %s bytes; at most %zu", cl, s->o.max_body_bytes);
        return gw_server_deliver(s, c, r);
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
        return gw_server_deliver(s, c, r);
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
        gw_server_send_error(s, r, 413, "invalid_request_error", NULL, "body_too_large", "the body is over %zu bytes",
                   s->o.max_body_bytes);
        return gw_server_deliver(s, c, r);
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

