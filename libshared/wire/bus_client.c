/* bus_client: a connection (a connecting socket with its handshake monitor), request ids, the Lazy
 * Pirate client with its streams and raw frames, and the fan-out. See bus.h. */
#include "wire/bus.h"
#include "wire/bus_internal.h"
#include "base/alloc.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"

/* ---------------------------------------------------------------------------------------------- */
/* Connections                                                                                     */

/* The events a connection's monitor receives (cb_bus_conn_refused reads them). */
#define HANDSHAKE_EVENTS \
    (ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | \
     ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

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
    if (c->sock) c->mon = cb_bus_monitor_attach(c->sock, HANDSHAKE_EVENTS, err, errlen);
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
    cb_bus_monitor_detach(c->sock, &c->mon);
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
    while (!c->refused && cb_bus_monitor_next(c->mon, &ev, &val)) {
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
