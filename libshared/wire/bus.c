/* bus: ZeroMQ socket helpers, Lazy Pirate client, ROUTER service loop. See bus.h. */
#include "wire/bus.h"
#include "base/alloc.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
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

static int set_int(void *h, int opt, int v) { return zmq_setsockopt(h, opt, &v, sizeof v); }

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
    rc |= set_int(h, ZMQ_LINGER, o->linger_ms);
    rc |= set_int(h, ZMQ_SNDHWM, o->sndhwm);
    rc |= set_int(h, ZMQ_RCVHWM, o->rcvhwm);
    rc |= set_int(h, ZMQ_SNDTIMEO, o->send_timeout_ms);
    if (type == ZMQ_ROUTER) rc |= set_int(h, ZMQ_ROUTER_MANDATORY, 1);
    if (type == ZMQ_DEALER || type == ZMQ_PUSH || type == ZMQ_REQ) rc |= set_int(h, ZMQ_IMMEDIATE, 1);
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

#define HANDSHAKE_EVENTS \
    (ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | \
     ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

/* A PAIR socket receiving s's `events` (zmq_socket_monitor on a fresh inproc name), or NULL. */
static zsock_t *monitor_attach(zsock_t *s, int events, char *err, size_t errlen) {
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
static void monitor_detach(zsock_t *s, zsock_t **pair_p) {
    if (!*pair_p) return;
    if (s) zmq_socket_monitor(zsock_resolve(s), NULL, 0);
    zsock_destroy(pair_p);
}

/* The next pending event (libzmq 4.x: a 6-byte frame {u16 event, u32 value}, then the endpoint). */
static bool monitor_next(zsock_t *pair, uint16_t *event, uint32_t *value) {
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

/* ---------------------------------------------------------------------------------------------- */
/* Connections                                                                                     */

struct cb_bus_conn_s {
    zsock_t *sock;
    zsock_t *mon;        /* PAIR: sock's handshake events */
    char *endpoint;
    bool curve;          /* this link uses CURVE */
    char identity[32];   /* our CURVE identity and keys dir, and the peer's key file, for the messages */
    char keys_dir[512];
    char peer[16];
    int n_no_detail;     /* handshakes dropped without a reason since the last success */
    bool refused;
    char why[1024];
};

cb_bus_conn_t *cb_bus_conn_new(int type, const char *endpoint, const cb_bus_opts_t *o, char *err, size_t errlen) {
    cb_bus_opts_t def;
    if (!o) {
        cb_bus_opts_default(&def);
        o = &def;
    }
    if (!endpoint || !cb_config_endpoint_valid(endpoint)) {
        snprintf(err, errlen, "invalid endpoint '%s'", endpoint ? endpoint : "(null)");
        return NULL;
    }
    cb_bus_conn_t *c = cb_calloc(1, sizeof *c);
    if (!c || !(c->endpoint = cb_strdup(endpoint))) {
        free(c);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    c->curve = o->curve.on;
    if (c->curve) {
        const cb_curve_peer_t *p = cb_curve_peer(&o->curve, endpoint);
        snprintf(c->identity, sizeof c->identity, "%s", o->curve.identity);
        snprintf(c->keys_dir, sizeof c->keys_dir, "%s", o->curve.keys_dir);
        snprintf(c->peer, sizeof c->peer, "%s", p ? p->name : "?");
    }
    /* the monitor must be listening before the connection starts: socket first, then connect */
    c->sock = cb_bus_socket(type, NULL, false, o, err, errlen);
    if (c->sock) c->mon = monitor_attach(c->sock, HANDSHAKE_EVENTS, err, errlen);
    if (!c->mon || cb_curve_apply(&o->curve, c->sock, false, endpoint, err, errlen) != 0) {
        cb_bus_conn_destroy(&c);
        return NULL;
    }
    if (zsock_connect(c->sock, "%s", endpoint) != 0) {
        snprintf(err, errlen, "cannot connect to %s: %s", endpoint, zmq_strerror(zmq_errno()));
        cb_bus_conn_destroy(&c);
        return NULL;
    }
    return c;
}

void cb_bus_conn_destroy(cb_bus_conn_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_bus_conn_t *c = *self_p;
    monitor_detach(c->sock, &c->mon);
    zsock_destroy(&c->sock);
    free(c->endpoint);
    free(c);
    *self_p = NULL;
}

zsock_t *cb_bus_conn_sock(cb_bus_conn_t *c) { return c->sock; }
void *cb_bus_conn_monitor(cb_bus_conn_t *c) { return zsock_resolve(c->mon); }

static void conn_refuse(cb_bus_conn_t *c, uint16_t event, uint32_t value) {
    const char *ep = c->endpoint;
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH && value == 400)
        snprintf(c->why, sizeof c->why, "refused by %s: our CURVE key is not in the server's allowed clients (ZAP; we "
                 "are '%s' of %s)", ep, c->identity, c->keys_dir);
    else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
        snprintf(c->why, sizeof c->why, "refused by %s: the server's authentication failed (ZAP status %u)", ep,
                 (unsigned)value);
    else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
        snprintf(c->why, sizeof c->why, c->curve
                 ? "refused by %s: the server does not use CURVE and we do (common.curve must be the same on both sides)"
                 : "refused by %s: the server requires CURVE and we connect in plaintext (set common.curve = on and "
                   "common.keys_dir)", ep);
    else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL)
        snprintf(c->why, sizeof c->why, "refused by %s: the %s handshake failed (ZMTP error 0x%x)", ep,
                 c->curve ? "CURVE" : "ZeroMQ", (unsigned)value);
    /* a dropped handshake: the server saw something it rejects (a mismatch is seen by both sides, but
     * the side that closes first may leave the other with no reason) */
    else if (c->curve)
        snprintf(c->why, sizeof c->why, "refused by %s: the server drops our CURVE handshake: the server key we have "
                 "(%s/public/%s.key) is probably not its key (keys from another `cbctl keys init`?), or it does not "
                 "use CURVE (common.curve must be the same on both sides)", ep, c->keys_dir, c->peer);
    else
        snprintf(c->why, sizeof c->why, "refused by %s: the server drops our plaintext handshake: it probably "
                 "requires CURVE (set common.curve = on and common.keys_dir)", ep);
    c->refused = true;
}

bool cb_bus_conn_refused(cb_bus_conn_t *c, char *err, size_t errlen) {
    uint16_t ev;
    uint32_t val;
    while (!c->refused && monitor_next(c->mon, &ev, &val)) {
        if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) c->n_no_detail = 0;
        else if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH || ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) conn_refuse(c, ev, val);
        else if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL && ++c->n_no_detail >= 2) conn_refuse(c, ev, val);
        /* one dropped handshake may be a server going down; two in a row are a pattern */
    }
    if (c->refused && err) snprintf(err, errlen, "%s", c->why);
    return c->refused;
}

int cb_bus_conn_send(cb_bus_conn_t *c, const void *data, size_t len, int timeout_ms, char *err, size_t errlen) {
    void *h = zsock_resolve(c->sock);
    double deadline = cb_now_ms() + timeout_ms;
    if (c->refused) {
        snprintf(err, errlen, "%s", c->why);
        return -2;
    }
    for (;;) {
        if (zmq_send(h, data, len, ZMQ_DONTWAIT) >= 0) return 0; /* connected: the monitor is not read */
        int e = zmq_errno();
        if (e != EAGAIN) {
            snprintf(err, errlen, "cannot send to %s: %s", c->endpoint, zmq_strerror(e));
            return -1;
        }
        if (cb_bus_conn_refused(c, err, errlen)) return -2;
        double left = deadline - cb_now_ms();
        if (left <= 0) break;
        /* not connected (ZMQ_IMMEDIATE) or at the HWM: wait for room, or for the handshake to fail */
        zmq_pollitem_t items[2] = {{h, 0, ZMQ_POLLOUT, 0}, {zsock_resolve(c->mon), 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, 2, (long)left + 1) < 0 && (zmq_errno() != EINTR || zsys_interrupted)) {
            snprintf(err, errlen, "interrupted");
            return -1;
        }
    }
    if (cb_bus_conn_refused(c, err, errlen)) return -2;
    snprintf(err, errlen, "%s is unavailable: no connection within %d ms (is the service running?)", c->endpoint,
             timeout_ms);
    return -1;
}

const char *cb_bus_new_id(char *buf, size_t size) {
    static atomic_uint_fast64_t counter;
    uint64_t n = atomic_fetch_add(&counter, 1) + 1;
    snprintf(buf, size, "%d-%llu", (int)getpid(), (unsigned long long)n);
    return buf;
}

/* ---------------------------------------------------------------------------------------------- */
/* Client                                                                                          */

struct cb_bus_client_s {
    char *endpoint;
    cb_bus_opts_t o;
    cb_bus_conn_t *conn; /* NULL until used, and after a timeout (Lazy Pirate) */
};

cb_bus_client_t *cb_bus_client_new(const char *endpoint, const cb_bus_opts_t *o, char *err, size_t errlen) {
    if (!endpoint || !cb_config_endpoint_valid(endpoint)) {
        snprintf(err, errlen, "invalid endpoint '%s'", endpoint ? endpoint : "(null)");
        return NULL;
    }
    cb_bus_client_t *c = cb_calloc(1, sizeof *c);
    if (!c || !(c->endpoint = cb_strdup(endpoint))) {
        free(c);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (o) c->o = *o;
    else cb_bus_opts_default(&c->o);
    return c;
}

cb_bus_client_t *cb_bus_client_from_config(const cb_config_t *cfg, const char *section, const char *target,
                                           char *err, size_t errlen) {
    cb_bus_opts_t o;
    const char *ep;
    if (!cb_bus_opts_from_config(cfg, section, &o, err, errlen)) return NULL;
    if (!cb_config_endpoint(cfg, target, "endpoint", NULL, &ep, err, errlen)) return NULL;
    if (!ep) {
        snprintf(err, errlen, "config %s.endpoint is not set", target);
        return NULL;
    }
    return cb_bus_client_new(ep, &o, err, errlen);
}

static void client_close(cb_bus_client_t *c) {
    if (c->conn) {
        /* unsent messages are dropped: a retry must not deliver the old copy later */
        zsock_set_linger(cb_bus_conn_sock(c->conn), 0);
        cb_bus_conn_destroy(&c->conn);
    }
}

void cb_bus_client_destroy(cb_bus_client_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_bus_client_t *c = *self_p;
    client_close(c);
    free(c->endpoint);
    free(c);
    *self_p = NULL;
}

const char *cb_bus_client_endpoint(const cb_bus_client_t *c) { return c->endpoint; }

void cb_bus_client_set_timeout(cb_bus_client_t *c, int timeout_ms, int retries) {
    if (timeout_ms > 0) c->o.request_timeout_ms = timeout_ms;
    if (retries >= 0) c->o.request_retries = retries;
}

static int client_open(cb_bus_client_t *c, char *err, size_t errlen) {
    if (c->conn) return 0;
    c->conn = cb_bus_conn_new(ZMQ_DEALER, c->endpoint, &c->o, err, errlen);
    return c->conn ? 0 : -1;
}

/* One frame, waiting up to send_timeout_ms for the connection (ZMQ_IMMEDIATE: fails when nothing is
 * connected). 0, -1, or -2 when the handshake was refused (err: why). */
static int client_send(cb_bus_client_t *c, const void *data, size_t len, char *err, size_t errlen) {
    if (client_open(c, err, errlen) != 0) return -1;
    int rc = cb_bus_conn_send(c->conn, data, len, c->o.send_timeout_ms, err, errlen);
    if (rc != 0) client_close(c);
    return rc;
}

/* Waits up to timeout_ms for one message; returns its last frame, or NULL (timeout/interrupt). */
static zframe_t *client_recv_frame(cb_bus_client_t *c, double deadline, bool *interrupted) {
    *interrupted = false;
    if (!c->conn) return NULL;
    zsock_t *sock = cb_bus_conn_sock(c->conn);
    void *h = zsock_resolve(sock);
    for (;;) {
        double left = deadline - cb_now_ms(); /* <= 0: one look at what is there already */
        zmq_pollitem_t item = {h, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&item, 1, left > 0 ? (long)(left + 1) : 0);
        if (rc < 0) {
            if (zmq_errno() == EINTR && !zsys_interrupted) continue;
            *interrupted = true;
            return NULL;
        }
        if (rc == 0 || !(item.revents & ZMQ_POLLIN)) {
            if (deadline - cb_now_ms() <= 0) return NULL;
            continue;
        }
        zmsg_t *m = zmsg_recv(sock);
        if (!m) continue;
        zframe_t *last = zmsg_last(m);
        zframe_t *f = last ? zframe_dup(last) : NULL;
        zmsg_destroy(&m);
        if (f) return f;
    }
}

/* Waits for a message with the given id until deadline; drops others. */
static cb_msg_t *client_wait(cb_bus_client_t *c, const char *id, double deadline, bool *interrupted) {
    for (;;) {
        zframe_t *f = client_recv_frame(c, deadline, interrupted);
        if (!f) return NULL;
        cb_msg_error_t e;
        cb_msg_t *m = cb_msg_decode_ex(zframe_data(f), zframe_size(f), (size_t)c->o.max_msg_bytes, &e);
        zframe_destroy(&f);
        if (!m) {
            cb_log(CB_LOG_WARN, id, "dropped an invalid reply from %s: %s", c->endpoint, e.message);
            continue;
        }
        if (!cb_msg_is_reply(m)) { /* e.g. our own request echoed by a TCP self-connection */
            cb_log(CB_LOG_WARN, id, "dropped a message from %s that is not a reply", c->endpoint);
            cb_msg_destroy(&m);
            continue;
        }
        if (strcmp(cb_msg_id(m), id) == 0) return m;
        cb_log(CB_LOG_DEBUG, id, "dropped a stale reply (id %s) from %s", cb_msg_id(m), c->endpoint);
        cb_msg_destroy(&m);
    }
}

/* Reads the id of our own outgoing message (validating it). */
static bool own_id(const cb_bus_client_t *c, const void *data, size_t len, char *id, cb_err_t *code, char *err,
                   size_t errlen) {
    cb_msg_error_t e;
    cb_msg_t *m = cb_msg_decode_ex(data, len, (size_t)c->o.max_msg_bytes, &e);
    if (!m) {
        *code = e.code == CB_ERR_TOO_LARGE ? CB_ERR_TOO_LARGE : CB_ERR_BAD_REQUEST;
        snprintf(err, errlen, "invalid request: %s", e.message);
        return false;
    }
    snprintf(id, CB_MSG_MAX_ID + 1, "%s", cb_msg_id(m));
    cb_msg_destroy(&m);
    return true;
}

cb_msg_t *cb_bus_request(cb_bus_client_t *c, const void *data, size_t len, cb_err_t *code, char *err,
                         size_t errlen) {
    cb_err_t dummy;
    if (!code) code = &dummy;
    *code = CB_ERR_NONE;
    char id[CB_MSG_MAX_ID + 1];
    if (!own_id(c, data, len, id, code, err, errlen)) return NULL;
    bool sent_any = false, refused = false;
    char last[400] = "";
    for (int attempt = 0; attempt <= c->o.request_retries && !refused; attempt++) {
        if (zsys_interrupted) break;
        int rc = client_send(c, data, len, last, sizeof last);
        refused = rc == -2; /* a retry would be refused the same way */
        if (rc != 0) continue;
        sent_any = true;
        bool intr;
        cb_msg_t *m = client_wait(c, id, cb_now_ms() + c->o.request_timeout_ms, &intr);
        if (m) return m;
        if (intr) break;
        cb_log(CB_LOG_DEBUG, id, "no reply from %s in %d ms (attempt %d of %d)", c->endpoint,
               c->o.request_timeout_ms, attempt + 1, c->o.request_retries + 1);
        client_close(c); /* Lazy Pirate: a fresh socket for the retry */
    }
    if (zsys_interrupted) {
        *code = CB_ERR_INTERNAL;
        snprintf(err, errlen, "interrupted");
    } else if (sent_any && !refused) {
        *code = CB_ERR_TIMEOUT;
        snprintf(err, errlen, "timeout: no reply from %s after %d attempt%s of %d ms", c->endpoint,
                 c->o.request_retries + 1, c->o.request_retries ? "s" : "", c->o.request_timeout_ms);
    } else {
        *code = CB_ERR_UNAVAILABLE;
        snprintf(err, errlen, "%s", last);
    }
    return NULL;
}

cb_msg_t *cb_bus_call(cb_bus_client_t *c, cb_msg_writer_t *w, cb_err_t *code, char *err, size_t errlen) {
    size_t len;
    const void *data = cb_msg_end(w, &len);
    if (!data) {
        if (code) *code = CB_ERR_BAD_REQUEST;
        snprintf(err, errlen, "cannot encode the request: %s", cb_msg_writer_error(w));
        return NULL;
    }
    return cb_bus_request(c, data, len, code, err, errlen);
}

cb_msg_t *cb_bus_call_ok(cb_bus_client_t *c, cb_msg_writer_t *w, cb_err_t *code, char *err, size_t errlen) {
    cb_msg_t *m = cb_bus_call(c, w, code, err, errlen);
    if (m && !cb_msg_ok(m)) {
        if (code) *code = cb_msg_err_code(m);
        snprintf(err, errlen, "%s: %s", cb_msg_err_code_name(m), cb_msg_err_message(m));
        cb_msg_destroy(&m);
    }
    return m;
}

int cb_bus_send(cb_bus_client_t *c, const void *data, size_t len, cb_err_t *code, char *err, size_t errlen) {
    char id[CB_MSG_MAX_ID + 1];
    cb_err_t dummy;
    if (!code) code = &dummy;
    if (!own_id(c, data, len, id, code, err, errlen)) return -1;
    if (client_send(c, data, len, err, errlen) != 0) {
        *code = CB_ERR_UNAVAILABLE;
        return -1;
    }
    *code = CB_ERR_NONE;
    return 0;
}

cb_msg_t *cb_bus_recv(cb_bus_client_t *c, const char *id, int timeout_ms, cb_err_t *code, char *err,
                      size_t errlen) {
    bool intr;
    cb_msg_t *m = client_wait(c, id, cb_now_ms() + timeout_ms, &intr);
    if (code) *code = m ? CB_ERR_NONE : intr ? CB_ERR_INTERNAL : CB_ERR_TIMEOUT;
    if (!m) {
        if (intr) snprintf(err, errlen, "interrupted");
        else snprintf(err, errlen, "timeout: nothing from %s for %d ms", c->endpoint, timeout_ms);
    }
    return m;
}

void *cb_bus_client_handle(cb_bus_client_t *c) { return c->conn ? zsock_resolve(cb_bus_conn_sock(c->conn)) : NULL; }

int cb_bus_send_raw(cb_bus_client_t *c, const void *data, size_t len, char *err, size_t errlen) {
    return client_send(c, data, len, err, errlen) == 0 ? 0 : -1;
}

zframe_t *cb_bus_recv_raw(cb_bus_client_t *c, int timeout_ms) {
    bool intr;
    return client_recv_frame(c, cb_now_ms() + timeout_ms, &intr);
}

/* Fan-out with one DEALER per endpoint (ZMQ_IMMEDIATE): a socket becomes writable only once its
 * connection is up, so "unavailable" (never connected) and "timeout" (sent, no answer) are told apart
 * while all services are tried at the same time; each socket's monitor reports a refused handshake. */
void cb_bus_fanout(const cb_bus_opts_t *opts, const char *type, const char *const *endpoints, int n, int connect_ms,
                   int timeout_ms, cb_bus_result_t *results) {
    cb_bus_conn_t *conns[CB_BUS_FANOUT_MAX] = {0};
    char ids[CB_BUS_FANOUT_MAX][32];
    bool sent[CB_BUS_FANOUT_MAX] = {0}, done[CB_BUS_FANOUT_MAX] = {0};
    double t_sent[CB_BUS_FANOUT_MAX] = {0};
    if (n > CB_BUS_FANOUT_MAX) n = CB_BUS_FANOUT_MAX;
    cb_bus_opts_t *o = cb_malloc(sizeof *o); /* a few KiB with the CURVE keys: not on the stack */
    if (o) {
        *o = *opts;
        o->request_timeout_ms = timeout_ms;
        if (o->send_timeout_ms > timeout_ms) o->send_timeout_ms = timeout_ms;
    }
    cb_msg_writer_t *w = o ? cb_msg_writer_new() : NULL;
    int pending = 0;
    for (int i = 0; i < n; i++) {
        cb_bus_result_t *r = &results[i];
        memset(r, 0, sizeof *r);
        r->endpoint = endpoints[i];
        r->code = CB_ERR_UNAVAILABLE;
        if (!w) {
            snprintf(r->error, sizeof r->error, "out of memory");
            r->code = CB_ERR_INTERNAL;
            done[i] = true;
            continue;
        }
        if (!endpoints[i]) {
            snprintf(r->error, sizeof r->error, "no endpoint configured");
            r->code = CB_ERR_BAD_REQUEST;
            done[i] = true;
            continue;
        }
        conns[i] = cb_bus_conn_new(ZMQ_DEALER, endpoints[i], o, r->error, sizeof r->error);
        if (!conns[i]) {
            done[i] = true;
            continue;
        }
        cb_bus_new_id(ids[i], sizeof ids[i]);
        pending++;
    }
    if (connect_ms > timeout_ms || connect_ms <= 0) connect_ms = timeout_ms;
    int64_t t0 = zclock_mono(), deadline = t0 + timeout_ms, connect_deadline = t0 + connect_ms;
    while (pending > 0 && !zsys_interrupted) {
        int64_t now = zclock_mono();
        if (now >= connect_deadline) /* give up on services that never connected */
            for (int i = 0; i < n; i++)
                if (!done[i] && !sent[i]) {
                    done[i] = true;
                    pending--;
                }
        if (pending == 0) break;
        zmq_pollitem_t items[2 * CB_BUS_FANOUT_MAX];
        int map[2 * CB_BUS_FANOUT_MAX], k = 0;
        for (int i = 0; i < n; i++) {
            if (done[i]) continue;
            void *h = zsock_resolve(cb_bus_conn_sock(conns[i]));
            items[k] = (zmq_pollitem_t){h, 0, (short)(sent[i] ? ZMQ_POLLIN : ZMQ_POLLOUT), 0};
            map[k++] = i;
            if (!sent[i]) { /* still connecting: its handshake may be refused */
                items[k] = (zmq_pollitem_t){cb_bus_conn_monitor(conns[i]), 0, ZMQ_POLLIN, 0};
                map[k++] = -1 - i;
            }
        }
        int64_t left = deadline - zclock_mono();
        bool connecting = false;
        for (int i = 0; i < n; i++) connecting |= !done[i] && !sent[i];
        if (connecting && connect_deadline - zclock_mono() < left) left = connect_deadline - zclock_mono();
        if (left <= 0) {
            if (zclock_mono() >= deadline) break;
            continue;
        }
        if (zmq_poll(items, k, (long)left) < 0) {
            if (zmq_errno() == EINTR) continue;
            break;
        }
        for (int j = 0; j < k; j++) {
            int i = map[j] < 0 ? -1 - map[j] : map[j];
            cb_bus_result_t *r = &results[i];
            if (done[i]) continue;
            if (map[j] < 0) {
                if ((items[j].revents & ZMQ_POLLIN) && cb_bus_conn_refused(conns[i], r->error, sizeof r->error)) {
                    r->refused = true;
                    done[i] = true;
                    pending--;
                }
                continue;
            }
            zsock_t *sock = cb_bus_conn_sock(conns[i]);
            if ((items[j].revents & ZMQ_POLLOUT) && !sent[i]) {
                cb_msg_begin(w, type, ids[i]);
                size_t len;
                const void *data = cb_msg_end(w, &len);
                if (data && zmq_send(zsock_resolve(sock), data, len, ZMQ_DONTWAIT) >= 0) {
                    sent[i] = true;
                    t_sent[i] = cb_now_ms();
                }
            } else if (items[j].revents & ZMQ_POLLIN) {
                zmsg_t *zm = zmsg_recv(sock);
                zframe_t *f = zm ? zmsg_last(zm) : NULL;
                cb_msg_error_t e;
                cb_msg_t *m = f ? cb_msg_decode_ex(zframe_data(f), zframe_size(f), (size_t)o->max_msg_bytes, &e) : NULL;
                zmsg_destroy(&zm);
                if (!m || !cb_msg_is_reply(m) || strcmp(cb_msg_id(m), ids[i]) != 0) {
                    cb_msg_destroy(&m); /* not our answer: keep waiting */
                    continue;
                }
                r->latency_ms = cb_now_ms() - t_sent[i];
                r->reply = m;
                r->code = cb_msg_err_code(m);
                if (!cb_msg_ok(m)) snprintf(r->error, sizeof r->error, "%s: %s", cb_msg_err_code_name(m), cb_msg_err_message(m));
                done[i] = true;
                pending--;
            }
        }
    }
    for (int i = 0; i < n; i++) {
        cb_bus_result_t *r = &results[i];
        if (!r->reply && !r->refused && conns[i]) {
            if (sent[i]) {
                r->code = CB_ERR_TIMEOUT;
                snprintf(r->error, sizeof r->error, "timeout: no answer from %s within %d ms", r->endpoint, timeout_ms);
            } else if (cb_bus_conn_refused(conns[i], r->error, sizeof r->error)) {
                r->refused = true;
            } else {
                r->code = CB_ERR_UNAVAILABLE;
                snprintf(r->error, sizeof r->error, "unavailable: no connection to %s within %d ms (is it running?)",
                         r->endpoint, connect_ms);
            }
        }
        if (conns[i]) {
            zsock_set_linger(cb_bus_conn_sock(conns[i]), 0);
            cb_bus_conn_destroy(&conns[i]);
        }
    }
    cb_msg_writer_destroy(&w);
    free(o);
}

void cb_bus_results_free(cb_bus_result_t *results, int n) {
    for (int i = 0; i < n; i++) cb_msg_destroy(&results[i].reply);
}

/* ---------------------------------------------------------------------------------------------- */
/* Service                                                                                         */

#define MAX_ROUTES 64

typedef struct {
    char type[CB_MSG_MAX_TYPE + 1];
    cb_bus_handler_fn *fn;
    void *arg;
} route_t;

struct cb_bus_req_s {
    cb_bus_service_t *svc;
    zframe_t *identity;      /* routing id of the requester */
    char user_id[CB_BUS_USER_ID_MAX + 1]; /* ZAP User-Id of its connection ("" when none) */
    bool delimiter;          /* the requester is a REQ socket: an empty frame goes back too */
    char id[CB_MSG_MAX_ID + 1];
    char type[CB_MSG_MAX_TYPE + 1];
    double t0_ms;
    int n_replies;
    cb_err_t code;           /* the last error replied, or CB_ERR_NONE */
    char error[160];         /* its message, for the log line */
    bool send_failed;
    bool detached;           /* (the handler's copy) was detached: the copy owns the outcome */
    const void *body;        /* the request's bytes, during the handler only (NULL in a detached copy) */
    size_t body_len;
    uint64_t epoch;          /* worker mode: the broker connection it came on (svc->epoch) */
    cb_bus_req_t *next, *prev; /* list of detached requests */
};

struct cb_bus_service_s {
    char name[64];
    cb_bus_opts_t o;
    zsock_t *router;
    zloop_t *loop;
    char *endpoint;
    route_t routes[MAX_ROUTES];
    int n_routes;
    cb_bus_stats_fn *stats_fn;
    void *stats_arg;
    cb_bus_health_fn *health_fn;
    void *health_arg;
    cb_diskhealth_t *disk;  /* borrowed: the data disk's state for ping (NULL: status ok) */
    cb_msg_writer_t *w;
    double t0_ms;
    uint64_t requests, errors;
    bool stop;
    cb_bus_req_t *detached; /* head of the list */
    zsock_t *mon;           /* PAIR: the ROUTER's failed handshakes, logged (rate-limited) */
    double mon_last_ms[4];  /* per kind (ZAP denied, mechanism mismatch, other, dropped): last line logged */
    int mon_quiet[4];       /* refusals not logged since */
    /* worker mode (cb_bus_worker_new): `router` is a DEALER connected to the broker, or NULL between
     * connections (Paranoid Pirate: a silent broker is dropped, reconnected after a back-off) */
    bool worker;
    cb_bus_worker_opts_t wo;
    uint64_t epoch;            /* connections made; replies to requests of an older one are refused */
    double last_heard_ms;      /* the broker's last message on this connection (or the connect) */
    double last_beat_ms;       /* our last heartbeat */
    double reconnect_at_ms;    /* while disconnected: when to connect again */
    int backoff_ms;            /* the next back-off */
    bool heard;                /* the broker spoke on this connection */
    bool announced;            /* worker_ready sent on this connection */
    uint64_t reconnects;
    cb_bus_beat_fn *beat_fn;
    void *beat_arg;
};

static cb_bus_handler_fn s_ping, s_stats;
static int worker_connect(cb_bus_service_t *svc, char *err, size_t errlen);
static void worker_drop(cb_bus_service_t *svc);

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
    if (!(svc->mon = monitor_attach(svc->router, ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                                                     ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL, err, errlen))) {
        cb_bus_service_destroy(&svc);
        return NULL;
    }
    cb_bus_service_on(svc, "ping", s_ping, NULL);
    cb_bus_service_on(svc, "stats", s_stats, NULL);
    return svc;
}

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
    cb_bus_service_on(svc, "ping", s_ping, NULL);
    cb_bus_service_on(svc, "stats", s_stats, NULL);
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
    if (svc->worker) worker_drop(svc);
    zloop_destroy(&svc->loop);
    monitor_detach(svc->router, &svc->mon);
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

/* Worker mode: [client identity, body] on the DEALER, never blocking (at the HWM the reply fails, as a
 * slow client's would); a request of an earlier broker connection cannot be answered any more. */
static int worker_req_send(cb_bus_req_t *req, const void *data, size_t len) {
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

/* Sends [identity, (empty,) body] on the ROUTER. */
static int req_send(cb_bus_req_t *req, const void *data, size_t len) {
    req->n_replies++;
    if (req->svc->worker) return worker_req_send(req, data, len);
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

static void s_ping(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *msg, void *arg) {
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

static void s_stats(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *msg, void *arg) {
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

static void dispatch(cb_bus_service_t *svc, cb_bus_req_t *reqp, zframe_t **body_p);

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
    dispatch(svc, &req, &body);
    return svc->stop ? -1 : 0;
}

/* One request (req's identity set; body taken): decoded, routed to its handler or answered with an error,
 * logged; the identity frame is destroyed after. */
static void dispatch(cb_bus_service_t *svc, cb_bus_req_t *reqp, zframe_t **body_p) {
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
    while (monitor_next(sock, &ev, &val)) {
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

/* ---------------------------------------------------------------------------------------------- */
/* Worker mode: the service's socket is a DEALER connected to a broker (cb-router, docs/router.md)   */
/*                                                                                                 */
/*   broker -> worker   [client identity, request body]      a request, handled as on the ROUTER   */
/*                      [control body]                       {type: router_heartbeat}              */
/*   worker -> broker   [client identity, reply body]        a reply (several for a stream)        */
/*                      [control body]                       {type: worker_ready | worker_heartbeat */
/*                                                            , service, pid, interval_ms, ...load} */

static int s_on_worker(zloop_t *loop, zsock_t *sock, void *arg);
static int s_on_worker_monitor(zloop_t *loop, zsock_t *sock, void *arg);

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
    if (set_int(h, ZMQ_IMMEDIATE, 0) != 0) {
        snprintf(err, errlen, "cannot set socket options: %s", zmq_strerror(zmq_errno()));
        zsock_destroy(&s);
        return -1;
    }
    zsock_t *mon = monitor_attach(s, ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                                         ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL, err, errlen);
    bool ok = mon && cb_curve_apply(&svc->o.curve, s, false, svc->endpoint, err, errlen) == 0;
    if (ok && zsock_connect(s, "%s", svc->endpoint) != 0) {
        snprintf(err, errlen, "cannot connect to %s: %s", svc->endpoint, zmq_strerror(zmq_errno()));
        ok = false;
    }
    if (!ok) {
        monitor_detach(s, &mon);
        zsock_destroy(&s);
        return -1;
    }
    if (zloop_reader(svc->loop, s, s_on_worker, svc) != 0 || zloop_reader(svc->loop, mon, s_on_worker_monitor, svc) != 0) {
        snprintf(err, errlen, "cannot register the worker socket in the loop");
        zloop_reader_end(svc->loop, s);
        monitor_detach(s, &mon);
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
static void worker_drop(cb_bus_service_t *svc) {
    if (!svc->router) return;
    zloop_reader_end(svc->loop, svc->router);
    if (svc->mon) zloop_reader_end(svc->loop, svc->mon);
    monitor_detach(svc->router, &svc->mon);
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
    dispatch(svc, &req, &body);
    return svc->stop ? -1 : 0;
}

/* The broker refused our handshake: one warning per 10 s. */
static int s_on_worker_monitor(zloop_t *loop, zsock_t *sock, void *arg) {
    (void)loop;
    cb_bus_service_t *svc = arg;
    uint16_t ev;
    uint32_t val;
    while (monitor_next(sock, &ev, &val)) {
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
static void worker_tick(cb_bus_service_t *svc) {
    double now = cb_now_ms();
    const double hb = svc->wo.heartbeat_ms;
    if (svc->router) {
        if (now - svc->last_heard_ms > hb * svc->wo.liveness) {
            svc->reconnects++;
            cb_log(CB_LOG_WARN, NULL, "no word from the router at %s for %.0f ms (%d heartbeats): reconnecting in %d ms",
                   svc->endpoint, now - svc->last_heard_ms, svc->wo.liveness, svc->backoff_ms);
            worker_drop(svc);
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
    if (svc->worker && !zsys_interrupted && !svc->stop) worker_tick(svc);
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
