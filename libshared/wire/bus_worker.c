/* bus_worker: worker mode, the Paranoid Pirate side of a service: its socket is a DEALER connected to
 * a broker (cb-router), with heartbeats, a liveness check and reconnection with back-off. See bus.h. */
#include "wire/bus.h"
#include "wire/bus_internal.h"
#include "base/alloc.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"

/* ---------------------------------------------------------------------------------------------- */
/* Worker mode: the service's socket is a DEALER connected to a broker (cb-router, docs/router.md)   */
/*                                                                                                 */
/*   broker -> worker   [client identity, request body]      a request, handled as on the ROUTER   */
/*                      [control body]                       {type: router_heartbeat}              */
/*   worker -> broker   [client identity, reply body]        a reply (several for a stream)        */
/*                      [control body]                       {type: worker_ready | worker_heartbeat */
/*                                                            , service, pid, interval_ms, ...load} */

static int worker_connect(cb_bus_service_t *svc, char *err, size_t errlen);
static int s_on_worker(zloop_t *loop, zsock_t *sock, void *arg);
static int s_on_worker_monitor(zloop_t *loop, zsock_t *sock, void *arg);

void cb_bus_worker_opts_default(cb_bus_worker_opts_t *wo) {
    memset(wo, 0, sizeof *wo);
    wo->heartbeat_ms = 1000;
    wo->liveness = 3;
    wo->reconnect_min_ms = 1000;
    wo->reconnect_max_ms = 8000;
}

cb_bus_service_t *cb_bus_worker_new(const char *name, const char *broker, const cb_bus_worker_opts_t *wo,
                                    const cb_bus_opts_t *o, char *err, size_t errlen) {
    if (!broker || !cb_config_endpoint_valid(broker)) {
        snprintf(err, errlen, "invalid broker endpoint '%s'", broker ? broker : "(null)");
        return NULL;
    }
    cb_bus_service_t *svc = cb_calloc(1, sizeof *svc);
    if (!svc) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    snprintf(svc->name, sizeof svc->name, "%s", name ? name : "cb");
    if (o) svc->o = *o;
    else cb_bus_opts_default(&svc->o);
    if (wo) svc->wo = *wo;
    else cb_bus_worker_opts_default(&svc->wo);
    if (svc->wo.heartbeat_ms < 10) svc->wo.heartbeat_ms = 10;
    if (svc->wo.liveness < 1) svc->wo.liveness = 1;
    if (svc->wo.reconnect_min_ms < 1) svc->wo.reconnect_min_ms = 1;
    if (svc->wo.reconnect_max_ms < svc->wo.reconnect_min_ms) svc->wo.reconnect_max_ms = svc->wo.reconnect_min_ms;
    svc->worker = true;
    svc->backoff_ms = svc->wo.reconnect_min_ms;
    svc->t0_ms = cb_now_ms();
    svc->w = cb_msg_writer_new();
    svc->loop = zloop_new();
    svc->endpoint = cb_strdup(broker);
    if (!svc->w || !svc->loop || !svc->endpoint) {
        snprintf(err, errlen, "out of memory");
        cb_bus_service_destroy(&svc);
        return NULL;
    }
    if (worker_connect(svc, err, errlen) != 0) {
        cb_bus_service_destroy(&svc);
        return NULL;
    }
    cb_bus_service_on(svc, "ping", cb_bus_builtin_ping, NULL);
    cb_bus_service_on(svc, "stats", cb_bus_builtin_stats, NULL);
    return svc;
}

/* Worker mode: [client identity, body] on the DEALER, never blocking (at the HWM the reply fails, as a
 * slow client's would); a request of an earlier broker connection cannot be answered any more. */
int cb_bus_worker_req_send(cb_bus_req_t *req, const void *data, size_t len) {
    cb_bus_service_t *svc = req->svc;
    const char *why = NULL;
    if (!svc->router || req->epoch != svc->epoch) why = "the connection to the router was reset";
    else {
        void *h = zsock_resolve(svc->router);
        if (zmq_send(h, zframe_data(req->identity), zframe_size(req->identity), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
            zmq_send(h, data, len, ZMQ_DONTWAIT) < 0)
            why = zmq_strerror(zmq_errno());
    }
    if (!why) return 0;
    if (!req->send_failed) cb_log(CB_LOG_WARN, req->id, "%s: cannot reply through the router: %s", req->type, why);
    req->send_failed = true;
    return -1;
}

/* Our heartbeat (worker_ready first on each connection): never blocks; a full pipe skips one beat. */
static void worker_beat(cb_bus_service_t *svc) {
    if (!svc->router) return;
    cb_msg_writer_t *w = svc->w;
    char id[32];
    snprintf(id, sizeof id, "%d", (int)getpid());
    cb_msg_begin(w, svc->announced ? "worker_heartbeat" : "worker_ready", id);
    cb_msg_put_str(w, "service", svc->name);
    cb_msg_put_int(w, "pid", getpid());
    cb_msg_put_int(w, "interval_ms", svc->wo.heartbeat_ms);
    cb_msg_put_int(w, "liveness", svc->wo.liveness);
    cb_msg_put_uint(w, "epoch", svc->epoch);
    if (svc->beat_fn) svc->beat_fn(svc, w, svc->beat_arg);
    size_t len;
    const void *data = cb_msg_end(w, &len);
    if (!data) {
        cb_log(CB_LOG_ERROR, NULL, "cannot encode the heartbeat: %s", cb_msg_writer_error(w));
        return;
    }
    svc->last_beat_ms = cb_now_ms();
    if (zmq_send(zsock_resolve(svc->router), data, len, ZMQ_DONTWAIT) >= 0) svc->announced = true;
}

/* A fresh DEALER to the broker (ZMQ_IMMEDIATE off: what we send before the connection is up waits in
 * its pipe, so worker_ready reaches a broker that starts after us), registered in the loop. */
static int worker_connect(cb_bus_service_t *svc, char *err, size_t errlen) {
    zsock_t *s = cb_bus_socket(ZMQ_DEALER, NULL, false, &svc->o, err, errlen);
    if (!s) return -1;
    void *h = zsock_resolve(s);
    if (cb_bus_set_int(h, ZMQ_IMMEDIATE, 0) != 0) {
        snprintf(err, errlen, "cannot set socket options: %s", zmq_strerror(zmq_errno()));
        zsock_destroy(&s);
        return -1;
    }
    zsock_t *mon = cb_bus_monitor_attach(s, ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                                            ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL, err, errlen);
    bool ok = mon && cb_curve_apply(&svc->o.curve, s, false, svc->endpoint, err, errlen) == 0;
    if (ok && zsock_connect(s, "%s", svc->endpoint) != 0) {
        snprintf(err, errlen, "cannot connect to %s: %s", svc->endpoint, zmq_strerror(zmq_errno()));
        ok = false;
    }
    if (!ok) {
        cb_bus_monitor_detach(s, &mon);
        zsock_destroy(&s);
        return -1;
    }
    if (zloop_reader(svc->loop, s, s_on_worker, svc) != 0 || zloop_reader(svc->loop, mon, s_on_worker_monitor, svc) != 0) {
        snprintf(err, errlen, "cannot register the worker socket in the loop");
        zloop_reader_end(svc->loop, s);
        cb_bus_monitor_detach(s, &mon);
        zsock_destroy(&s);
        return -1;
    }
    svc->router = s;
    svc->mon = mon;
    svc->epoch++;
    svc->heard = svc->announced = false;
    svc->last_heard_ms = cb_now_ms();
    worker_beat(svc);
    cb_log(CB_LOG_INFO, NULL, "worker of the router at %s (connection %llu; heartbeat %d ms, liveness %d)",
           svc->endpoint, (unsigned long long)svc->epoch, svc->wo.heartbeat_ms, svc->wo.liveness);
    return 0;
}

/* Closes the broker connection (unsent messages dropped); requests of it can no longer be answered. */
void cb_bus_worker_drop(cb_bus_service_t *svc) {
    if (!svc->router) return;
    zloop_reader_end(svc->loop, svc->router);
    if (svc->mon) zloop_reader_end(svc->loop, svc->mon);
    cb_bus_monitor_detach(svc->router, &svc->mon);
    zsock_set_linger(svc->router, 0);
    zsock_destroy(&svc->router);
}

/* A message from the broker: a request [identity, body], or a control frame (its heartbeat). */
static int s_on_worker(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    cb_bus_service_t *svc = arg;
    zmsg_t *msg = zmsg_recv(sock);
    if (!msg) return zsys_interrupted ? -1 : 0;
    svc->last_heard_ms = cb_now_ms();
    svc->backoff_ms = svc->wo.reconnect_min_ms;
    if (!svc->heard) cb_log(CB_LOG_INFO, NULL, "the router at %s answers", svc->endpoint);
    svc->heard = true;
    size_t nf = zmsg_size(msg);
    if (nf == 1) { /* control: anything well-formed counts as life; only its heartbeat is defined */
        zframe_t *f = zmsg_first(msg);
        cb_msg_t *m = cb_msg_decode_ex(zframe_data(f), zframe_size(f), (size_t)svc->o.max_msg_bytes, NULL);
        if (!m || !cb_msg_is_type(m, "router_heartbeat"))
            cb_log(CB_LOG_DEBUG, NULL, "ignored a control message from the router (%s)", m ? cb_msg_type(m) : "invalid");
        cb_msg_destroy(&m);
        zmsg_destroy(&msg);
        return svc->stop ? -1 : 0;
    }
    cb_bus_req_t req = {.svc = svc, .t0_ms = cb_now_ms(), .code = CB_ERR_NONE};
    req.identity = nf == 2 ? zmsg_pop(msg) : NULL;
    zframe_t *body = nf == 2 ? zmsg_pop(msg) : NULL;
    zmsg_destroy(&msg);
    if (!body || zframe_size(req.identity) == 0 || zframe_size(req.identity) > 255) {
        cb_log(CB_LOG_WARN, NULL, "dropped a message of %zu frames from the router (expected identity + body)", nf);
        zframe_destroy(&req.identity);
        zframe_destroy(&body);
        return svc->stop ? -1 : 0;
    }
    cb_bus_dispatch(svc, &req, &body);
    return svc->stop ? -1 : 0;
}

/* The broker refused our handshake: one warning per 10 s. */
static int s_on_worker_monitor(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    cb_bus_service_t *svc = arg;
    uint16_t ev;
    uint32_t val;
    while (cb_bus_monitor_next(sock, &ev, &val)) {
        double now = cb_now_ms();
        if (svc->mon_last_ms[0] > 0 && now - svc->mon_last_ms[0] < 10000) continue;
        svc->mon_last_ms[0] = now;
        cb_log(CB_LOG_WARN, NULL, "the router at %s refused our handshake (%s, value 0x%x): common.curve must be the "
               "same on both sides, and the router must have this service's server key (%s)", svc->endpoint,
               ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ? "ZAP denied our key" : ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL
               ? "protocol error" : "dropped", (unsigned)val, svc->o.curve.on ? "CURVE on here" : "CURVE off here");
    }
    return svc->stop ? -1 : 0;
}

/* Every 100 ms in worker mode: our heartbeat when due; a broker silent for liveness intervals is
 * dropped; while disconnected, a new connection once the back-off (doubling up to the max) is over. */
void cb_bus_worker_tick(cb_bus_service_t *svc) {
    double now = cb_now_ms();
    const double hb = svc->wo.heartbeat_ms;
    if (svc->router) {
        if (now - svc->last_heard_ms > hb * svc->wo.liveness) {
            svc->reconnects++;
            cb_log(CB_LOG_WARN, NULL, "no word from the router at %s for %.0f ms (%d heartbeats): reconnecting in %d ms",
                   svc->endpoint, now - svc->last_heard_ms, svc->wo.liveness, svc->backoff_ms);
            cb_bus_worker_drop(svc);
            svc->reconnect_at_ms = now + svc->backoff_ms;
            svc->backoff_ms = svc->backoff_ms * 2 > svc->wo.reconnect_max_ms ? svc->wo.reconnect_max_ms : svc->backoff_ms * 2;
        } else if (now - svc->last_beat_ms >= hb) {
            worker_beat(svc);
        }
    } else if (now >= svc->reconnect_at_ms) {
        char err[512];
        if (worker_connect(svc, err, sizeof err) != 0) {
            cb_log(CB_LOG_ERROR, NULL, "cannot reconnect to the router: %s", err);
            svc->reconnect_at_ms = now + svc->backoff_ms;
        }
    }
}

void cb_bus_service_set_beat(cb_bus_service_t *svc, cb_bus_beat_fn *fn, void *arg) {
    svc->beat_fn = fn;
    svc->beat_arg = arg;
}

bool cb_bus_service_is_worker(const cb_bus_service_t *svc) { return svc->worker; }
bool cb_bus_service_connected(const cb_bus_service_t *svc) { return !svc->worker || (svc->router && svc->heard); }
