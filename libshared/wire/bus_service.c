/* bus_service: the service (a ROUTER in a zloop): construction (a worker when configured so), routes,
 * replies and detached requests, the built-in ping and stats, dispatch, the handshake log, the run loop
 * and a service's main() setup. Worker mode is in bus_worker.c. See bus.h. */
#include "wire/bus.h"
#include "wire/bus_internal.h"
#include "base/alloc.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"

/* ---------------------------------------------------------------------------------------------- */
/* Service                                                                                         */

cb_bus_service_t *cb_bus_service_new(const char *name, const char *endpoint, const cb_bus_opts_t *o, char *err,
                                     size_t errlen) {
    cb_bus_service_t *svc = cb_calloc(1, sizeof *svc);
    if (!svc) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    snprintf(svc->name, sizeof svc->name, "%s", name ? name : "cb");
    if (o) svc->o = *o;
    else cb_bus_opts_default(&svc->o);
    svc->t0_ms = cb_now_ms();
    svc->w = cb_msg_writer_new();
    svc->loop = zloop_new();
    if (!svc->w || !svc->loop) {
        snprintf(err, errlen, "out of memory");
        cb_bus_service_destroy(&svc);
        return NULL;
    }
    svc->router = cb_bus_socket(ZMQ_ROUTER, endpoint, true, &svc->o, err, errlen);
    if (!svc->router) {
        cb_bus_service_destroy(&svc);
        return NULL;
    }
    char *last = zsock_last_endpoint(svc->router);
    svc->endpoint = last ? last : cb_strdup(endpoint);
    if (!(svc->mon = cb_bus_monitor_attach(svc->router, ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                                        ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                                                        ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL, err, errlen))) {
        cb_bus_service_destroy(&svc);
        return NULL;
    }
    cb_bus_service_on(svc, "ping", cb_bus_builtin_ping, NULL);
    cb_bus_service_on(svc, "stats", cb_bus_builtin_stats, NULL);
    return svc;
}

cb_bus_service_t *cb_bus_service_from_config(const char *name, const cb_config_t *cfg, const char *section,
                                             char *err, size_t errlen) {
    cb_bus_opts_t o;
    const char *ep = NULL, *bind = NULL, *lvl;
    if (!cb_bus_opts_from_config(cfg, section, &o, err, errlen)) return NULL;
    const char *broker = NULL;
    if (!cb_config_endpoint(cfg, section, "router", NULL, &broker, err, errlen)) return NULL;
    if (!cb_config_endpoint(cfg, section, "endpoint", NULL, &ep, err, errlen)) return NULL;
    if (!cb_config_endpoint(cfg, section, "bind", NULL, &bind, err, errlen)) return NULL;
    if (!bind) bind = ep;
    if (!bind && !broker) {
        snprintf(err, errlen, "config %s.endpoint is not set", section);
        return NULL;
    }
    if (!getenv("CB_LOG_LEVEL") && cb_config_str(cfg, section, "log_level", "info", &lvl, err, errlen)) {
        static const char *names[] = {"debug", "info", "warn", "error"};
        for (int i = 0; i < 4; i++)
            if (strcmp(lvl, names[i]) == 0) cb_log_set_level((cb_log_level_t)i);
    }
    if (broker) {
        cb_bus_worker_opts_t wo;
        cb_bus_worker_opts_default(&wo);
        int64_t hb, live, rmax;
        if (!cb_config_int(cfg, section, "heartbeat_ms", 10, 600000, wo.heartbeat_ms, &hb, err, errlen) ||
            !cb_config_int(cfg, section, "router_liveness", 1, 100, wo.liveness, &live, err, errlen) ||
            !cb_config_int(cfg, section, "router_reconnect_max_ms", 1, 3600000, wo.reconnect_max_ms, &rmax, err,
                           errlen))
            return NULL;
        wo.heartbeat_ms = (int)hb;
        wo.liveness = (int)live;
        wo.reconnect_max_ms = (int)rmax;
        if (wo.reconnect_min_ms > wo.reconnect_max_ms) wo.reconnect_min_ms = wo.reconnect_max_ms;
        /* the broker stands in for this service: it has this service's server key */
        if (o.curve.on && !cb_curve_add_peer(&o.curve, broker, section, err, errlen)) return NULL;
        return cb_bus_worker_new(name, broker, &wo, &o, err, errlen);
    }
    return cb_bus_service_new(name, bind, &o, err, errlen);
}

static void req_free(cb_bus_req_t *r) {
    zframe_destroy(&r->identity);
    free(r);
}

void cb_bus_service_destroy(cb_bus_service_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_bus_service_t *svc = *self_p;
    while (svc->detached) {
        cb_bus_req_t *r = svc->detached;
        svc->detached = r->next;
        req_free(r);
    }
    if (svc->worker) cb_bus_worker_drop(svc);
    zloop_destroy(&svc->loop);
    cb_bus_monitor_detach(svc->router, &svc->mon);
    zsock_destroy(&svc->router);
    cb_msg_writer_destroy(&svc->w);
    free(svc->endpoint);
    free(svc);
    *self_p = NULL;
}

int cb_bus_service_on(cb_bus_service_t *svc, const char *type, cb_bus_handler_fn *fn, void *arg) {
    if (!type || !fn || strlen(type) > CB_MSG_MAX_TYPE) return -1;
    for (int i = 0; i < svc->n_routes; i++)
        if (strcmp(svc->routes[i].type, type) == 0) {
            svc->routes[i].fn = fn;
            svc->routes[i].arg = arg;
            return 0;
        }
    if (svc->n_routes >= MAX_ROUTES) return -1;
    route_t *r = &svc->routes[svc->n_routes++];
    snprintf(r->type, sizeof r->type, "%s", type);
    r->fn = fn;
    r->arg = arg;
    return 0;
}

void cb_bus_service_set_stats(cb_bus_service_t *svc, cb_bus_stats_fn *fn, void *arg) {
    svc->stats_fn = fn;
    svc->stats_arg = arg;
}

void cb_bus_service_set_health(cb_bus_service_t *svc, cb_bus_health_fn *fn, void *arg) {
    svc->health_fn = fn;
    svc->health_arg = arg;
}

void cb_bus_service_set_disk(cb_bus_service_t *svc, cb_diskhealth_t *dh) { svc->disk = dh; }

zloop_t *cb_bus_service_loop(cb_bus_service_t *svc) { return svc->loop; }
const char *cb_bus_service_endpoint(const cb_bus_service_t *svc) { return svc->endpoint; }
const cb_bus_opts_t *cb_bus_service_opts(const cb_bus_service_t *svc) { return &svc->o; }
cb_msg_writer_t *cb_bus_service_writer(cb_bus_service_t *svc) { return svc->w; }
void cb_bus_service_stop(cb_bus_service_t *svc) { svc->stop = true; }

const char *cb_bus_req_id(const cb_bus_req_t *req) { return req->id; }
const char *cb_bus_req_type(const cb_bus_req_t *req) { return req->type; }
const char *cb_bus_req_user_id(const cb_bus_req_t *req) { return req->user_id; }
const uint8_t *cb_bus_req_peer(const cb_bus_req_t *req, size_t *len) {
    *len = req->identity ? zframe_size(req->identity) : 0;
    return req->identity ? zframe_data(req->identity) : (const uint8_t *)"";
}

/* Sends [identity, (empty,) body] on the ROUTER. */
static int req_send(cb_bus_req_t *req, const void *data, size_t len) {
    req->n_replies++;
    if (req->svc->worker) return cb_bus_worker_req_send(req, data, len);
    void *h = zsock_resolve(req->svc->router);
    if (zmq_send(h, zframe_data(req->identity), zframe_size(req->identity), ZMQ_SNDMORE) < 0 ||
        (req->delimiter && zmq_send(h, "", 0, ZMQ_SNDMORE) < 0) || zmq_send(h, data, len, 0) < 0) {
        if (!req->send_failed)
            cb_log(CB_LOG_WARN, req->id, "%s: cannot reply: %s (the client went away?)", req->type,
                   zmq_strerror(zmq_errno()));
        req->send_failed = true;
        return -1;
    }
    return 0;
}

int cb_bus_reply_bytes(cb_bus_req_t *req, const void *data, size_t len) { return req_send(req, data, len); }

static int reply_errorv(cb_bus_req_t *req, cb_err_t code, const char *fmt, va_list ap) {
    size_t len;
    va_list ap2;
    va_copy(ap2, ap);
    vsnprintf(req->error, sizeof req->error, fmt, ap2);
    va_end(ap2);
    req->code = code == CB_ERR_NONE ? CB_ERR_INTERNAL : code;
    req->svc->errors++;
    const void *data = cb_msg_write_errorv(req->svc->w, req->type, req->id, req->code, &len, fmt, ap);
    if (!data) return -1;
    return req_send(req, data, len);
}

int cb_bus_reply_error(cb_bus_req_t *req, cb_err_t code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int rc = reply_errorv(req, code, fmt, ap);
    va_end(ap);
    return rc;
}

int cb_bus_reply(cb_bus_req_t *req, cb_msg_writer_t *w) {
    size_t len;
    const void *data = cb_msg_end(w, &len);
    if (!data) {
        char why[160];
        snprintf(why, sizeof why, "%s", cb_msg_writer_error(w) ? cb_msg_writer_error(w) : "?");
        return cb_bus_reply_error(req, CB_ERR_INTERNAL, "cannot encode the reply: %s", why);
    }
    return req_send(req, data, len);
}

/* The log line for a finished request. */
static void req_log(const cb_bus_req_t *r) {
    double ms = cb_now_ms() - r->t0_ms;
    if (r->n_replies == 0)
        cb_log(CB_LOG_WARN, r->id[0] ? r->id : NULL, "%s finished without a reply (%.2f ms)", r->type, ms);
    else if (r->code == CB_ERR_NONE)
        cb_log(CB_LOG_INFO, r->id[0] ? r->id : NULL, "%s ok %.2f ms%s", r->type, ms, r->send_failed ? " (reply not delivered)" : "");
    else
        cb_log(CB_LOG_WARN, r->id[0] ? r->id : NULL, "%s %s: %s (%.2f ms)%s", r->type, cb_err_name(r->code), r->error, ms,
               r->send_failed ? " (reply not delivered)" : "");
}

cb_bus_req_t *cb_bus_req_detach(cb_bus_req_t *req) {
    cb_bus_req_t *r = cb_malloc(sizeof *r);
    if (!r) return NULL;
    *r = *req;
    r->identity = zframe_dup(req->identity);
    if (!r->identity) {
        free(r);
        return NULL;
    }
    r->detached = false;
    r->body = NULL;
    r->body_len = 0;
    r->prev = NULL;
    r->next = req->svc->detached;
    if (r->next) r->next->prev = r;
    req->svc->detached = r;
    req->detached = true;
    return r;
}

void cb_bus_req_destroy(cb_bus_req_t **req_p) {
    if (!req_p || !*req_p) return;
    cb_bus_req_t *r = *req_p;
    req_log(r);
    if (r->prev) r->prev->next = r->next;
    else r->svc->detached = r->next;
    if (r->next) r->next->prev = r->prev;
    req_free(r);
    *req_p = NULL;
}

void cb_bus_builtin_ping(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *msg, void *arg) {
    (void)arg;
    cb_msg_writer_t *w = svc->w;
    cb_msg_begin_reply(w, msg);
    cb_msg_put_str(w, "service", svc->name);
    cb_msg_put_str(w, "version", CB_BUS_VERSION);
    cb_msg_put_int(w, "pid", getpid());
    cb_msg_put_double(w, "uptime_s", (cb_now_ms() - svc->t0_ms) / 1000.0);
    char why[512];
    const char *bad = svc->health_fn ? svc->health_fn(svc, w, svc->health_arg, why, sizeof why) : NULL;
    if (bad) {
        cb_bus_reply_error(req, CB_ERR_UNAVAILABLE, "%s", bad);
        return;
    }
    cb_diskhealth_put(svc->disk, w); /* status: ok, or degraded with the reason (a full data disk) */
    cb_bus_reply(req, w);
}

void cb_bus_builtin_stats(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *msg, void *arg) {
    (void)arg;
    cb_msg_writer_t *w = svc->w;
    cb_msg_begin_reply(w, msg);
    cb_msg_put_str(w, "service", svc->name);
    cb_msg_put_double(w, "uptime_s", (cb_now_ms() - svc->t0_ms) / 1000.0);
    cb_msg_put_uint(w, "requests", svc->requests);
    cb_msg_put_uint(w, "errors", svc->errors);
    if (svc->stats_fn) svc->stats_fn(svc, w, svc->stats_arg);
    cb_bus_reply(req, w);
}

zmsg_t *cb_bus_recv_zmsg(zsock_t *sock, char *user_id, size_t size) {
    if (size) user_id[0] = 0;
    zmsg_t *msg = zmsg_recv(sock);
    /* The metadata of the connection rides on the parts libzmq received from it: a ROUTER's routing-id
     * part, made by the socket, carries none when zmq_poll had prefetched the message (as zloop does), so
     * the first part that has a User-Id is read (the body always has). */
    for (zframe_t *f = msg ? zmsg_first(msg) : NULL; f && size; f = zmsg_next(msg)) {
        const char *u = zframe_meta(f, "User-Id");
        size_t n = u ? strlen(u) : 0;
        if (n == 0) continue;
        if (n < size) memcpy(user_id, u, n + 1); /* longer than the caller keeps: none */
        break;
    }
    return msg;
}

/* One message on the ROUTER: [identity, (empty,) body]. */
static int s_on_router(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    cb_bus_service_t *svc = arg;
    cb_bus_req_t req = {.svc = svc, .t0_ms = cb_now_ms(), .code = CB_ERR_NONE};
    zmsg_t *msg = cb_bus_recv_zmsg(sock, req.user_id, sizeof req.user_id);
    if (!msg) return zsys_interrupted ? -1 : 0;
    size_t nf = zmsg_size(msg);
    zframe_t *body = NULL;
    req.identity = zmsg_pop(msg);
    if (nf == 3) {
        zframe_t *d = zmsg_pop(msg);
        req.delimiter = zframe_size(d) == 0;
        zframe_destroy(&d);
    }
    if ((nf == 2 || (nf == 3 && req.delimiter)) && req.identity) body = zmsg_pop(msg);
    zmsg_destroy(&msg);
    if (!body) {
        cb_log(CB_LOG_WARN, NULL, "dropped a message of %zu frames (expected one body frame)", nf ? nf - 1 : 0);
        zframe_destroy(&req.identity);
        return svc->stop ? -1 : 0;
    }
    cb_bus_dispatch(svc, &req, &body);
    return svc->stop ? -1 : 0;
}

/* One request (req's identity set; body taken): decoded, routed to its handler or answered with an error,
 * logged; the identity frame is destroyed after. */
void cb_bus_dispatch(cb_bus_service_t *svc, cb_bus_req_t *reqp, zframe_t **body_p) {
    cb_bus_req_t req = *reqp;
    zframe_t *body = *body_p;
    *body_p = NULL;
    req.epoch = svc->epoch;
    svc->requests++;
    cb_msg_error_t e;
    cb_msg_t *m = cb_msg_decode_ex(zframe_data(body), zframe_size(body), (size_t)svc->o.max_msg_bytes, &e);
    req.body = zframe_data(body);
    req.body_len = zframe_size(body);
    if (!m) {
        snprintf(req.id, sizeof req.id, "%s", e.id);
        snprintf(req.type, sizeof req.type, "%s", "error");
        cb_bus_reply_error(&req, e.code, "%s", e.message);
    } else {
        snprintf(req.id, sizeof req.id, "%s", cb_msg_id(m));
        snprintf(req.type, sizeof req.type, "%s", cb_msg_type(m));
        route_t *route = NULL;
        for (int i = 0; i < svc->n_routes; i++)
            if (strcmp(svc->routes[i].type, req.type) == 0) route = &svc->routes[i];
        if (!route) {
            cb_bus_reply_error(&req, CB_ERR_UNKNOWN_TYPE, "%s does not handle message type '%s'", svc->name, req.type);
        } else if (cb_msg_is_reply(m)) {
            cb_bus_reply_error(&req, CB_ERR_BAD_REQUEST, "a request must not carry 'ok'");
        } else {
            route->fn(svc, &req, m, route->arg);
            if (!req.detached && req.n_replies == 0)
                cb_bus_reply_error(&req, CB_ERR_INTERNAL, "the handler for '%s' sent no reply", req.type);
        }
        cb_msg_destroy(&m);
    }
    zframe_destroy(&body);
    if (!req.detached) req_log(&req);
    zframe_destroy(&req.identity);
}

/* A client's handshake failed on the ROUTER: one warning per kind per 10 s (a refused client may retry). */
static int s_on_monitor(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    cb_bus_service_t *svc = arg;
    uint16_t ev;
    uint32_t val;
    while (cb_bus_monitor_next(sock, &ev, &val)) {
        int kind = ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ? 0
                   : ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && val == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH ? 1
                   : ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ? 2
                   : ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL ? 3
                   : -1;
        if (kind < 0) continue;
        double now = cb_now_ms();
        if (svc->mon_last_ms[kind] > 0 && now - svc->mon_last_ms[kind] < 10000) {
            svc->mon_quiet[kind]++;
            continue;
        }
        char more[64] = "";
        if (svc->mon_quiet[kind]) snprintf(more, sizeof more, " (and %d more since the last such line)", svc->mon_quiet[kind]);
        const cb_curve_t *cv = &svc->o.curve;
        if (kind == 0)
            cb_log(CB_LOG_WARN, NULL, "refused a client on %s: its CURVE key is not in %s/allowed (ZAP status %u; "
                   "log_level = debug shows the key)%s", svc->endpoint, cv->keys_dir, (unsigned)val, more);
        else if (kind == 1)
            cb_log(CB_LOG_WARN, NULL, "refused a client on %s: it connects %s and this service %s%s", svc->endpoint,
                   cv->on ? "in plaintext" : "with CURVE", cv->on ? "requires CURVE" : "has common.curve off", more);
        else if (kind == 2)
            cb_log(CB_LOG_WARN, NULL, "refused a client on %s: %s handshake failed (ZMTP error 0x%x%s)%s", svc->endpoint,
                   cv->on ? "CURVE" : "ZeroMQ", (unsigned)val,
                   val == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC ? ": the client has another key for this server?" : "",
                   more);
        else /* the client hung up first: it saw a mismatch itself, gave up, or does not speak ZeroMQ */
            cb_log(CB_LOG_INFO, NULL, "a client on %s dropped its handshake (common.curve set otherwise on its side, a "
                   "client that gave up, or not a ZeroMQ peer)%s", svc->endpoint, more);
        svc->mon_last_ms[kind] = now;
        svc->mon_quiet[kind] = 0;
    }
    return svc->stop ? -1 : 0;
}

const void *cb_bus_req_body(const cb_bus_req_t *req, size_t *len) {
    *len = req->body ? req->body_len : 0;
    return req->body;
}

void cb_bus_req_note(cb_bus_req_t *req, cb_err_t code, const char *message) {
    req->code = code;
    snprintf(req->error, sizeof req->error, "%s", message ? message : "");
    if (code != CB_ERR_NONE) req->svc->errors++;
}

/* Wakes the loop every 100 ms: a signal that lands between zloop's check of zsys_interrupted and its
 * zmq_poll would otherwise go unnoticed until the next message (the poll would sleep on). */
static int s_tick(zloop_t *loop, int timer_id, void *arg) {
    (void)loop, (void)timer_id;
    cb_bus_service_t *svc = arg;
    if (svc->worker && !zsys_interrupted && !svc->stop) cb_bus_worker_tick(svc);
    return zsys_interrupted || svc->stop ? -1 : 0;
}

int cb_bus_service_run(cb_bus_service_t *svc) {
    svc->stop = false;
    int tick = zloop_timer(svc->loop, 100, 0, s_tick, svc);
    if (tick < 0 || (!svc->worker && (zloop_reader(svc->loop, svc->router, s_on_router, svc) != 0 ||
                                      zloop_reader(svc->loop, svc->mon, s_on_monitor, svc) != 0))) {
        cb_log(CB_LOG_ERROR, NULL, "cannot register the service socket in the loop");
        return -1;
    }
    if (svc->worker) cb_log(CB_LOG_INFO, NULL, "serving as a worker of the router at %s", svc->endpoint);
    else cb_log(CB_LOG_INFO, NULL, "listening on %s", svc->endpoint);
    int rc = zloop_start(svc->loop);
    if (!svc->worker) {
        zloop_reader_end(svc->loop, svc->router);
        zloop_reader_end(svc->loop, svc->mon);
    }
    zloop_timer_end(svc->loop, tick);
    if (zsys_interrupted) cb_log(CB_LOG_INFO, NULL, "interrupted, shutting down");
    else if (svc->stop) cb_log(CB_LOG_INFO, NULL, "stopped");
    else if (rc != 0) return -1;
    return 0;
}

cb_config_t *cb_bus_service_config(const char *section, int *argc, char **argv, void (*usage)(FILE *f),
                                   int *exit_code) {
    char err[512];
    *exit_code = 1;
    for (int i = 1; i < *argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            *exit_code = 0;
            return NULL;
        }
    cb_config_t *cfg = cb_config_new(section, argc, argv, err, sizeof err);
    if (!cfg) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        return NULL;
    }
    if (*argc > 1) {
        cb_log(CB_LOG_ERROR, NULL, "unknown argument '%s'", argv[1]);
        usage(stderr);
        cb_config_destroy(&cfg);
        return NULL;
    }
    return cfg;
}
