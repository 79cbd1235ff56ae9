/* cbctl health [--json] [SERVICE...]: pings the services (all four by default) in parallel and prints
 * each one's status: ok, degraded (it answers, but its data disk is full: the ping's `status` and `reason`,
 * docs/protocol.md §3) or DOWN. Exit 0 only when every service asked answers ok; 3 when one is down or
 * silent (1 when one answered its ping with an error); else 4 when one is degraded. */
#include <jansson.h>
#include <string.h>

#include "cbctl.h"
#include "client.h"

static const char *const s_skip[] = {"v", "type", "id", "ok", NULL};

static int run_health(cbctl_t *ctl, int argc, char **argv) {
    const char *names[CBCTL_N_SERVICES * 4];
    bool json;
    int n = cbctl_parse_services(ctl, argc, argv, &json, names, CBCTL_N_SERVICES * 4);
    if (n < 0) return CBCTL_EXIT_USAGE;
    int64_t timeout;
    char err[256];
    if (!cb_config_int(ctl->cfg, "cbctl", "health_timeout_ms", 1, 600000, 1000, &timeout, err, sizeof err)) {
        cbctl_error(ctl, "%s", err);
        return CBCTL_EXIT_USAGE;
    }
    cbctl_result_t res[CBCTL_N_SERVICES * 4];
    cbctl_fanout(ctl, "ping", names, n, (int)timeout, (int)timeout, res);
    int up = 0, degraded = 0, rc = CBCTL_EXIT_OK;
    json_t *jservices = json_array();
    for (int i = 0; i < n; i++) {
        cbctl_result_t *r = &res[i];
        bool ok = r->reply && cb_msg_ok(r->reply);
        up += ok;
        if (!ok) rc = r->reply ? (rc == CBCTL_EXIT_OK ? CBCTL_EXIT_FAIL : rc) : CBCTL_EXIT_UNAVAILABLE;
        /* answers, but degraded (a full data disk): the ping says why */
        char status[16] = "ok";
        const char *reason = "";
        size_t reason_len = 0;
        if (ok) {
            cb_msg_str_copy(r->reply, "status", sizeof status - 1, status, sizeof status);
            if (!cb_msg_str(r->reply, "reason", 8192, &reason, &reason_len)) reason_len = 0;
        }
        bool bad = ok && !strcmp(status, "degraded");
        degraded += bad;
        if (json) {
            json_t *o = r->reply && ok ? cb_msg_to_json(r->reply) : json_object();
            for (int k = 0; s_skip[k]; k++) json_object_del(o, s_skip[k]);
            json_object_set_new(o, "name", json_string(r->name));
            json_object_set_new(o, "ok", json_boolean(ok));
            if (!ok) json_object_set_new(o, "status", json_string("down"));
            else if (!json_object_get(o, "status")) json_object_set_new(o, "status", json_string("ok"));
            json_object_set_new(o, "endpoint", r->endpoint ? json_string(r->endpoint) : json_null());
            if (ok) json_object_set_new(o, "latency_ms", json_real(r->latency_ms));
            else {
                json_object_set_new(o, "error", json_string(r->error));
                json_object_set_new(o, "code", json_string(cb_err_name(r->code)));
            }
            json_array_append_new(jservices, o);
        } else if (!ctl->quiet) {
            if (ok) {
                int64_t pid = 0;
                double up_s = 0;
                const char *ver = "?";
                size_t vl = 1;
                cb_msg_int(r->reply, "pid", 0, INT64_MAX, &pid);
                cb_msg_double(r->reply, "uptime_s", 0, 1e12, &up_s);
                cb_msg_str(r->reply, "version", 64, &ver, &vl);
                if (bad)
                    printf("%-11s degraded %-24s %7.1f ms  pid %lld, up %.0f s, version %.*s: %.*s\n", r->name,
                           r->endpoint, r->latency_ms, (long long)pid, up_s, (int)vl, ver,
                           reason_len ? (int)reason_len : 17, reason_len ? reason : "(no reason given)");
                else
                    printf("%-11s ok    %-24s %7.1f ms  pid %lld, up %.0f s, version %.*s\n", r->name, r->endpoint,
                           r->latency_ms, (long long)pid, up_s, (int)vl, ver);
            } else {
                printf("%-11s DOWN  %-24s %s\n", r->name, r->endpoint ? r->endpoint : "-", r->error);
            }
        }
    }
    if (rc == CBCTL_EXIT_OK && degraded > 0) rc = CBCTL_EXIT_DEGRADED; /* all answer, not all ok */
    if (json && !ctl->quiet) {
        json_t *top = json_pack("{s:b, s:s, s:i, s:i, s:i, s:o}", "ok", up == n, "status",
                                up < n ? "down" : degraded ? "degraded" : "ok", "up", up, "degraded", degraded,
                                "total", n, "services", jservices);
        json_dumpf(top, stdout, JSON_INDENT(2));
        fputc('\n', stdout);
        json_decref(top);
    } else {
        json_decref(jservices);
        if (!ctl->quiet) {
            if (degraded) printf("%d of %d services answer, %d degraded\n", up, n, degraded);
            else printf("%d of %d services answer\n", up, n);
        }
    }
    cbctl_results_free(res, n);
    return rc;
}

CBCTL_COMMAND(health, "health [--json] [SERVICE...]", "ping the services; exit 0 only when all answer ok", run_health)
