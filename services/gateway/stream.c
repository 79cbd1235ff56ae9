/* stream: one query to cb-blend, read with bounds. See stream.h. */
#include "stream.h"
#include "base/alloc.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "base/clock.h"

#define POLL_SLICE_MS 200 /* how often a wait looks at `stopping` */

struct gw_stream {
    cb_bus_client_t *client; /* its own DEALER to cb-blend (owned) */
    char id[CB_MSG_MAX_ID + 1];
    gw_stream_opts_t o;
    double t0, deadline;     /* cb_now_ms() at the start; the overall deadline */
    double silence_ms;       /* allowed silence now: first_ms, then 3 heartbeat intervals */
    double last_ms;          /* when cb-blend last said something */
    bool watch_fd;           /* false once the client has sent more bytes (a pipelined request) */
};

bool gw_client_gone(int fd) {
    if (fd < 0) return false;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLERR | POLLNVAL)) return true;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
    return false;
}

gw_stream_t *gw_stream_start(const gw_stream_opts_t *o, const void *data, size_t len, const char *id, cb_err_t *code,
                             char *err, size_t errlen) {
    gw_stream_t *self = cb_calloc(1, sizeof *self);
    if (!self) {
        *code = CB_ERR_INTERNAL;
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    self->o = *o;
    snprintf(self->id, sizeof self->id, "%s", id);
    self->client = cb_bus_client_new(o->endpoint, o->opts, err, errlen);
    if (!self->client || cb_bus_send(self->client, data, len, code, err, errlen) != 0) {
        if (!self->client) *code = CB_ERR_INTERNAL;
        gw_stream_destroy(&self);
        return NULL;
    }
    self->t0 = self->last_ms = cb_now_ms();
    self->deadline = self->t0 + o->total_ms;
    self->silence_ms = o->first_ms < o->total_ms ? o->first_ms : o->total_ms;
    self->watch_fd = true;
    return self;
}

void gw_stream_destroy(gw_stream_t **self_p) {
    if (!self_p || !*self_p) return;
    gw_stream_t *self = *self_p;
    cb_bus_client_destroy(&self->client);
    free(self);
    *self_p = NULL;
}

void gw_stream_watch(gw_stream_t *self, const atomic_int *client_fd, const atomic_bool *cancelled) {
    self->o.client_fd = client_fd;
    self->o.cancelled = cancelled;
}

double gw_stream_elapsed_ms(const gw_stream_t *self) { return cb_now_ms() - self->t0; }

static cb_msg_t *end(gw_stream_end_t *why, gw_stream_end_t w, char *err, size_t errlen, const char *fmt, double ms) {
    *why = w;
    snprintf(err, errlen, fmt, ms);
    return NULL;
}

cb_msg_t *gw_stream_next(gw_stream_t *self, gw_stream_end_t *why, char *err, size_t errlen) {
    for (;;) {
        double now = cb_now_ms();
        if (self->o.cancelled && atomic_load(self->o.cancelled))
            return end(why, GW_STREAM_GONE, err, errlen, "the answer is no longer wanted (%.0f ms in)", now - self->t0);
        if (self->o.stopping && atomic_load(self->o.stopping))
            return end(why, GW_STREAM_STOPPING, err, errlen, "the gateway is shutting down (%.0f ms in)",
                       now - self->t0);
        if (now >= self->deadline)
            return end(why, GW_STREAM_DEADLINE, err, errlen, "no complete answer from cb-blend within %.0f ms",
                       (double)self->o.total_ms);
        if (now - self->last_ms >= self->silence_ms)
            return end(why, GW_STREAM_SILENT, err, errlen, "cb-blend said nothing for %.0f ms", self->silence_ms);
        void *h = cb_bus_client_handle(self->client);
        if (!h) return end(why, GW_STREAM_FAILED, err, errlen, "the connection to cb-blend is closed (%.0f ms in)",
                           now - self->t0);
        double wait = self->deadline - now;
        double quiet = self->last_ms + self->silence_ms - now;
        if (quiet < wait) wait = quiet;
        if (wait > POLL_SLICE_MS) wait = POLL_SLICE_MS;
        int fd = self->o.client_fd ? atomic_load(self->o.client_fd) : -1;
        bool watch = self->watch_fd && fd >= 0;
        zmq_pollitem_t items[2] = {{h, 0, ZMQ_POLLIN, 0}, {NULL, fd, POLLIN, 0}};
        int rc = zmq_poll(items, watch ? 2 : 1, (long)wait + 1);
        if (rc < 0) {
            if (zmq_errno() == EINTR) continue;
            return end(why, GW_STREAM_FAILED, err, errlen, "poll failed after %.0f ms", cb_now_ms() - self->t0);
        }
        if (watch && items[1].revents) {
            if (gw_client_gone(fd))
                return end(why, GW_STREAM_GONE, err, errlen, "the client closed its connection (%.0f ms in)",
                           cb_now_ms() - self->t0);
            self->watch_fd = false; /* bytes of a next request: stop watching rather than spin */
        }
        if (!(items[0].revents & ZMQ_POLLIN)) continue;
        cb_err_t code;
        char e2[256];
        cb_msg_t *m = cb_bus_recv(self->client, self->id, 0, &code, e2, sizeof e2);
        if (!m) continue; /* a stale or invalid message (dropped by the bus) */
        self->last_ms = cb_now_ms();
        int64_t ivl;
        if (cb_msg_is_type(m, "heartbeat") && cb_msg_int_or(m, "interval_ms", 1, 3600000, 1000, &ivl)) {
            double s = 3.0 * (double)ivl;
            self->silence_ms = s < 1000 ? 1000 : s;
        }
        return m;
    }
}
