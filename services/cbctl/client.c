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

bool cbctl_client_opts(cbctl_t *ctl, int timeout_ms, int retries, cb_bus_opts_t *o, char *err, size_t errlen) {
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
    if (!cbctl_client_opts(ctl, timeout_ms, retries, &o, err, errlen)) return NULL;
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
    char e2[512];
    cb_msg_t *m = cb_bus_call(c, w, code, e2, sizeof e2);
    if (!m) snprintf(err, errlen, "%s: %s", name, e2);
    cb_bus_client_destroy(&c);
    return m;
}

/* The services' endpoints from the config, then one cb_bus_fanout (its results copied with the names). */
void cbctl_fanout(cbctl_t *ctl, const char *type, const char *const *names, int n, int connect_ms, int timeout_ms,
                  cbctl_result_t *results) {
    if (n > CB_BUS_FANOUT_MAX) n = CB_BUS_FANOUT_MAX;
    const char *eps[CB_BUS_FANOUT_MAX];
    cb_bus_result_t br[CB_BUS_FANOUT_MAX];
    cb_bus_opts_t o;
    char err[256];
    bool opts_ok = cbctl_client_opts(ctl, timeout_ms, 0, &o, err, sizeof err);
    for (int i = 0; i < n; i++) {
        cbctl_result_t *r = &results[i];
        memset(r, 0, sizeof *r);
        r->name = names[i];
        eps[i] = NULL;
        if (!opts_ok) {
            snprintf(r->error, sizeof r->error, "%s", err);
            r->code = CB_ERR_INTERNAL;
        } else if (!cb_config_endpoint(ctl->cfg, names[i], "endpoint", NULL, &eps[i], r->error, sizeof r->error) ||
                   !eps[i]) {
            if (!eps[i] && !r->error[0]) snprintf(r->error, sizeof r->error, "no endpoint configured (%s.endpoint)", names[i]);
            r->code = CB_ERR_BAD_REQUEST;
            eps[i] = NULL;
        }
    }
    if (opts_ok) cb_bus_fanout(&o, type, eps, n, connect_ms, timeout_ms, br);
    for (int i = 0; i < n; i++) {
        cbctl_result_t *r = &results[i];
        if (!opts_ok || !eps[i]) continue;
        r->endpoint = eps[i];
        r->reply = br[i].reply;
        r->code = br[i].code;
        r->latency_ms = br[i].latency_ms;
        const cbctl_service_t *svc = cbctl_service_find(r->name);
        if (!r->reply && r->code == CB_ERR_UNAVAILABLE && !br[i].refused && svc)
            snprintf(r->error, sizeof r->error, "unavailable: no connection to %s within %d ms (is %s running?)", eps[i],
                     connect_ms > 0 && connect_ms <= timeout_ms ? connect_ms : timeout_ms, svc->program);
        else
            snprintf(r->error, sizeof r->error, "%s", br[i].error);
    }
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
