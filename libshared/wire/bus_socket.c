/* bus_socket: socket options, process setup, sockets, and the handshake monitors that the other bus
 * files attach to their sockets (bus_internal.h). See bus.h. */
#include "wire/bus.h"
#include "wire/bus_internal.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"

/* ---------------------------------------------------------------------------------------------- */
/* Options, setup, sockets                                                                         */

void cb_bus_opts_default(cb_bus_opts_t *o) {
    memset(o, 0, sizeof *o); /* CURVE off */
    o->max_msg_bytes = CB_MSG_DEFAULT_MAX_BYTES;
    o->linger_ms = 1000;
    o->sndhwm = 1000;
    o->rcvhwm = 1000;
    o->send_timeout_ms = 1000;
    o->request_timeout_ms = 2500;
    o->request_retries = 2;
}

bool cb_bus_opts_from_config(const cb_config_t *cfg, const char *section, cb_bus_opts_t *o, char *err,
                             size_t errlen) {
    cb_bus_opts_default(o);
    int64_t v;
    if (!cb_config_int(cfg, section, "max_msg_bytes", 256, (int64_t)1 << 31, o->max_msg_bytes, &v, err, errlen))
        return false;
    o->max_msg_bytes = v;
#define GETI(name, min, max)                                                                   \
    do {                                                                                       \
        if (!cb_config_int(cfg, section, #name, min, max, o->name, &v, err, errlen)) return false; \
        o->name = (int)v;                                                                      \
    } while (0)
    GETI(linger_ms, 0, 600000);
    GETI(sndhwm, 0, 10000000);
    GETI(rcvhwm, 0, 10000000);
    GETI(send_timeout_ms, 1, 600000);
    GETI(request_timeout_ms, 1, 3600000);
    GETI(request_retries, 0, 100);
#undef GETI
    return cb_curve_from_config(cfg, section, &o->curve, err, errlen);
}

void cb_bus_init(const char *program_name) {
    cb_log_set_component(program_name);
    zsys_init(); /* installs the SIGINT/SIGTERM handler that sets zsys_interrupted */
    zsys_set_logident(program_name);
}

int cb_bus_set_int(void *h, int opt, int v) { return zmq_setsockopt(h, opt, &v, sizeof v); }

zsock_t *cb_bus_socket(int type, const char *endpoint, bool bind, const cb_bus_opts_t *o, char *err,
                       size_t errlen) {
    cb_bus_opts_t def;
    if (!o) {
        cb_bus_opts_default(&def);
        o = &def;
    }
    if (endpoint && !cb_config_endpoint_valid(endpoint)) {
        snprintf(err, errlen, "invalid endpoint '%s'", endpoint);
        return NULL;
    }
    zsock_t *s = zsock_new(type);
    if (!s) {
        snprintf(err, errlen, "cannot create a ZeroMQ socket: %s", zmq_strerror(zmq_errno()));
        return NULL;
    }
    void *h = zsock_resolve(s);
    int64_t maxmsg = o->max_msg_bytes;
    int rc = zmq_setsockopt(h, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    rc |= cb_bus_set_int(h, ZMQ_LINGER, o->linger_ms);
    rc |= cb_bus_set_int(h, ZMQ_SNDHWM, o->sndhwm);
    rc |= cb_bus_set_int(h, ZMQ_RCVHWM, o->rcvhwm);
    rc |= cb_bus_set_int(h, ZMQ_SNDTIMEO, o->send_timeout_ms);
    if (type == ZMQ_ROUTER) rc |= cb_bus_set_int(h, ZMQ_ROUTER_MANDATORY, 1);
    if (type == ZMQ_DEALER || type == ZMQ_PUSH || type == ZMQ_REQ) rc |= cb_bus_set_int(h, ZMQ_IMMEDIATE, 1);
    if (rc != 0) {
        snprintf(err, errlen, "cannot set socket options: %s", zmq_strerror(zmq_errno()));
        zsock_destroy(&s);
        return NULL;
    }
    if (endpoint) {
        /* CURVE options must be set before the bind or connect they apply to */
        if (cb_curve_apply(&o->curve, s, bind, endpoint, err, errlen) != 0) {
            zsock_destroy(&s);
            return NULL;
        }
        rc = bind ? zsock_bind(s, "%s", endpoint) : zsock_connect(s, "%s", endpoint);
        if (rc < 0) {
            snprintf(err, errlen, "cannot %s %s: %s", bind ? "bind" : "connect to", endpoint,
                     zmq_strerror(zmq_errno()));
            zsock_destroy(&s);
            return NULL;
        }
        if (bind && o->curve.on)
            cb_log(CB_LOG_INFO, NULL, "curve: %s is a CURVE server (key %s/server/%s.key_secret)", endpoint,
                   o->curve.keys_dir, o->curve.service);
        else if (bind && cb_curve_endpoint_public(endpoint))
            cb_log(CB_LOG_WARN, NULL, "%s is bound to a non-loopback address without CURVE: anyone who reaches it can "
                   "use it (set common.curve = on: docs/protocol.md section 1.1)", endpoint);
    }
    return s;
}

/* ---------------------------------------------------------------------------------------------- */
/* Handshake monitors                                                                              */

/* A PAIR socket receiving s's `events` (zmq_socket_monitor on a fresh inproc name), or NULL. */
zsock_t *cb_bus_monitor_attach(zsock_t *s, int events, char *err, size_t errlen) {
    static atomic_uint_fast64_t counter;
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://cb-bus-monitor-%d-%llu", (int)getpid(),
             (unsigned long long)(atomic_fetch_add(&counter, 1) + 1));
    if (zmq_socket_monitor(zsock_resolve(s), ep, events) != 0) {
        snprintf(err, errlen, "cannot monitor a socket: %s", zmq_strerror(zmq_errno()));
        return NULL;
    }
    zsock_t *pair = zsock_new(ZMQ_PAIR);
    if (!pair || zsock_connect(pair, "%s", ep) != 0) {
        snprintf(err, errlen, "cannot monitor a socket: %s", zmq_strerror(zmq_errno()));
        zsock_destroy(&pair);
        zmq_socket_monitor(zsock_resolve(s), NULL, 0);
        return NULL;
    }
    return pair;
}

/* Stops the monitor of s and closes its PAIR. */
void cb_bus_monitor_detach(zsock_t *s, zsock_t **pair_p) {
    if (!*pair_p) return;
    if (s) zmq_socket_monitor(zsock_resolve(s), NULL, 0);
    zsock_destroy(pair_p);
}

/* The next pending event (libzmq 4.x: a 6-byte frame {u16 event, u32 value}, then the endpoint). */
bool cb_bus_monitor_next(zsock_t *pair, uint16_t *event, uint32_t *value) {
    void *h = zsock_resolve(pair);
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, h, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&m);
        return false;
    }
    bool ok = zmq_msg_size(&m) >= 6;
    if (ok) {
        memcpy(event, zmq_msg_data(&m), 2);
        memcpy(value, (const char *)zmq_msg_data(&m) + 2, 4);
    }
    while (zmq_msg_more(&m)) { /* the endpoint frame */
        zmq_msg_close(&m);
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, h, ZMQ_DONTWAIT) < 0) break;
    }
    zmq_msg_close(&m);
    return ok;
}
