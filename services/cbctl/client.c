/* cbctl client helpers: service table, configured clients, calls, parallel fan-out, output. See client.h. */
#include "client.h"

#include <jansson.h>
#include <stdarg.h>
#include <string.h>

#include "base/clock.h"

const cbctl_service_t cbctl_services[CBCTL_N_SERVICES] = {
    {"retriever", "cb-retriever"},
    {"cacheindex", "cb-cacheindex"},
    {"precompute", "cb-precompute"},
    {"blend", "cb-blend"},
};

const cbctl_service_t *cbctl_service_find(const char *name) {
    for (int i = 0; i < CBCTL_N_SERVICES; i++)
        if (!strcmp(name, cbctl_services[i].name) || !strcmp(name, cbctl_services[i].program)) return &cbctl_services[i];
    return NULL;
}

void cbctl_error(const cbctl_t *ctl, const char *fmt, ...) {
    if (ctl && ctl->quiet) return;
    va_list ap;
    va_start(ap, fmt);
    fputs("cbctl: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

int cbctl_exit_for(cb_err_t code) {
    return code == CB_ERR_TIMEOUT || code == CB_ERR_UNAVAILABLE ? CBCTL_EXIT_UNAVAILABLE : CBCTL_EXIT_FAIL;
}

/* Options of the cbctl section, with the send timeout bounded by the request timeout. */
static bool client_opts(cbctl_t *ctl, int timeout_ms, int retries, cb_bus_opts_t *o, char *err, size_t errlen) {
    if (!cb_bus_opts_from_config(ctl->cfg, "cbctl", o, err, errlen)) return false;
    if (timeout_ms > 0) o->request_timeout_ms = timeout_ms;
    if (retries >= 0) o->request_retries = retries;
    if (o->send_timeout_ms > o->request_timeout_ms) o->send_timeout_ms = o->request_timeout_ms;
    return true;
}

cb_bus_client_t *cbctl_client(cbctl_t *ctl, const char *name, int timeout_ms, int retries, char *err,
                              size_t errlen) {
    cb_bus_opts_t o;
    const char *ep;
    if (!client_opts(ctl, timeout_ms, retries, &o, err, errlen)) return NULL;
    if (!cb_config_endpoint(ctl->cfg, name, "endpoint", NULL, &ep, err, errlen)) return NULL;
    if (!ep) {
        snprintf(err, errlen, "no endpoint configured for %s (%s.endpoint)", name, name);
        return NULL;
    }
    return cb_bus_client_new(ep, &o, err, errlen);
}

cb_msg_t *cbctl_call(cbctl_t *ctl, const char *name, cb_msg_writer_t *w, cb_err_t *code, char *err,
                     size_t errlen) {
    cb_bus_client_t *c = cbctl_client(ctl, name, 0, -1, err, errlen);
    if (!c) {
        if (code) *code = CB_ERR_BAD_REQUEST;
        return NULL;
    }
    char e2[256];
    cb_msg_t *m = cb_bus_call(c, w, code, e2, sizeof e2);
    if (!m) snprintf(err, errlen, "%s: %s", name, e2);
    cb_bus_client_destroy(&c);
    return m;
}

/* Fan-out with one DEALER per service (ZMQ_IMMEDIATE): a socket becomes writable only once its
 * connection is up, so "unavailable" (never connected) and "timeout" (sent, no answer) are told apart
 * while all services are tried at the same time. */
void cbctl_fanout(cbctl_t *ctl, const char *type, const char *const *names, int n, int connect_ms, int timeout_ms,
                  cbctl_result_t *results) {
    zsock_t *socks[CBCTL_N_SERVICES * 4] = {0};
    char ids[CBCTL_N_SERVICES * 4][32];
    bool sent[CBCTL_N_SERVICES * 4] = {0}, done[CBCTL_N_SERVICES * 4] = {0};
    double t_sent[CBCTL_N_SERVICES * 4] = {0};
    if (n > CBCTL_N_SERVICES * 4) n = CBCTL_N_SERVICES * 4;
    cb_bus_opts_t o;
    char err[256];
    bool opts_ok = client_opts(ctl, timeout_ms, 0, &o, err, sizeof err);
    cb_msg_writer_t *w = cb_msg_writer_new();
    int pending = 0;
    for (int i = 0; i < n; i++) {
        cbctl_result_t *r = &results[i];
        memset(r, 0, sizeof *r);
        r->name = names[i];
        r->code = CB_ERR_UNAVAILABLE;
        const char *ep = NULL;
        if (!opts_ok || !w) {
            snprintf(r->error, sizeof r->error, "%s", w ? err : "out of memory");
            r->code = CB_ERR_INTERNAL;
            done[i] = true;
            continue;
        }
        if (!cb_config_endpoint(ctl->cfg, names[i], "endpoint", NULL, &ep, r->error, sizeof r->error) || !ep) {
            if (!ep && !r->error[0]) snprintf(r->error, sizeof r->error, "no endpoint configured (%s.endpoint)", names[i]);
            r->code = CB_ERR_BAD_REQUEST;
            done[i] = true;
            continue;
        }
        r->endpoint = ep;
        socks[i] = cb_bus_socket(ZMQ_DEALER, ep, false, &o, r->error, sizeof r->error);
        if (!socks[i]) {
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
        zmq_pollitem_t items[CBCTL_N_SERVICES * 4];
        int map[CBCTL_N_SERVICES * 4], k = 0;
        for (int i = 0; i < n; i++) {
            if (done[i]) continue;
            items[k] = (zmq_pollitem_t){zsock_resolve(socks[i]), 0, (short)(sent[i] ? ZMQ_POLLIN : ZMQ_POLLOUT), 0};
            map[k++] = i;
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
            int i = map[j];
            cbctl_result_t *r = &results[i];
            if ((items[j].revents & ZMQ_POLLOUT) && !sent[i]) {
                cb_msg_begin(w, type, ids[i]);
                size_t len;
                const void *data = cb_msg_end(w, &len);
                if (data && zmq_send(zsock_resolve(socks[i]), data, len, ZMQ_DONTWAIT) >= 0) {
                    sent[i] = true;
                    t_sent[i] = cb_now_ms();
                }
            } else if (items[j].revents & ZMQ_POLLIN) {
                zmsg_t *zm = zmsg_recv(socks[i]);
                zframe_t *f = zm ? zmsg_last(zm) : NULL;
                cb_msg_error_t e;
                cb_msg_t *m = f ? cb_msg_decode_ex(zframe_data(f), zframe_size(f), (size_t)o.max_msg_bytes, &e) : NULL;
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
        cbctl_result_t *r = &results[i];
        if (!r->reply && socks[i]) {
            if (sent[i]) {
                r->code = CB_ERR_TIMEOUT;
                snprintf(r->error, sizeof r->error, "timeout: no answer from %s within %d ms", r->endpoint, timeout_ms);
            } else {
                r->code = CB_ERR_UNAVAILABLE;
                snprintf(r->error, sizeof r->error, "unavailable: no connection to %s within %d ms (is %s running?)",
                         r->endpoint, connect_ms, cbctl_service_find(r->name) ? cbctl_service_find(r->name)->program : r->name);
            }
        }
        if (socks[i]) {
            zsock_set_linger(socks[i], 0);
            zsock_destroy(&socks[i]);
        }
    }
    cb_msg_writer_destroy(&w);
}

void cbctl_results_free(cbctl_result_t *results, int n) {
    for (int i = 0; i < n; i++) cb_msg_destroy(&results[i].reply);
}

void cbctl_print_json(FILE *f, const cb_msg_t *m, const char *const *skip, bool pretty) {
    json_t *j = cb_msg_to_json(m);
    if (!j) return;
    for (int i = 0; skip && skip[i]; i++) json_object_del(j, skip[i]);
    json_dumpf(j, f, pretty ? JSON_INDENT(2) : JSON_COMPACT);
    fputc('\n', f);
    json_decref(j);
}

/* Parses [--json] [SERVICE...] into names (all services when none); returns n, or -1 on bad usage. */
int cbctl_parse_services(cbctl_t *ctl, int argc, char **argv, bool *json, const char **names, int max) {
    int n = 0;
    *json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) { *json = true; continue; }
        const cbctl_service_t *s = argv[i][0] != '-' ? cbctl_service_find(argv[i]) : NULL;
        if (!s) {
            cbctl_error(ctl, "%s: unknown %s '%s' (services: retriever, cacheindex, precompute, blend)", argv[0],
                        argv[i][0] == '-' ? "option" : "service", argv[i]);
            return -1;
        }
        if (n < max) names[n++] = s->name;
    }
    if (n == 0)
        for (int i = 0; i < CBCTL_N_SERVICES && n < max; i++) names[n++] = cbctl_services[i].name;
    return n;
}
