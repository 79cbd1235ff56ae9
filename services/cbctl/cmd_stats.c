/* cbctl stats [--json] [SERVICE...]: every service's statistics (all four by default), asked in
 * parallel. Services that do not answer are reported (exit 3); the others are still printed. In the text
 * form, cb-blend's KV pool fields and its step loop are also summed up in a line each ("kv pool", "step
 * loop"). */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "cbctl.h"
#include "client.h"

static const char *const s_skip[] = {"v", "type", "id", "ok", NULL};

/* "kv pool  U of T blocks used (P%), S shared, peak K; B tokens per block" from the pool_* fields. */
static void print_pool(json_t *o) {
    json_t *total = json_object_get(o, "pool_blocks_total");
    if (!json_is_integer(total)) return;
    json_int_t t = json_integer_value(total), u = json_integer_value(json_object_get(o, "pool_blocks_used"));
    printf("  %-20s %lld of %lld blocks used (%.1f%%), %lld shared, peak %lld; %lld tokens per block\n", "kv pool",
           (long long)u, (long long)t, t > 0 ? 100.0 * (double)u / (double)t : 0.0,
           (long long)json_integer_value(json_object_get(o, "pool_blocks_shared")),
           (long long)json_integer_value(json_object_get(o, "pool_blocks_peak")),
           (long long)json_integer_value(json_object_get(o, "pool_block_tokens")));
}

static long long jint(json_t *o, const char *k) { return (long long)json_integer_value(json_object_get(o, k)); }
static double jnum(json_t *o, const char *k) { return json_number_value(json_object_get(o, k)); }

/* "step loop  R of S running, W waiting; D decode steps, X tokens a step (peak B), T tok/s in decode; P
 * prefill slices" from cb-blend's step-loop fields (gen.h). */
static void print_steps(json_t *o) {
    if (!json_is_integer(json_object_get(o, "decode_steps"))) return;
    double dms = jnum(o, "decode_ms");
    printf("  %-20s %lld of %lld running, %lld waiting; %lld decode steps, %.2f tokens a step (peak %lld), "
           "%.1f tok/s in decode; %lld prefill slices (%.0f ms)\n",
           "step loop", jint(o, "running"), jint(o, "max_seqs"), jint(o, "waiting"), jint(o, "decode_steps"),
           jnum(o, "tokens_per_step"), jint(o, "batch_peak"),
           dms > 0 ? 1000.0 * (double)jint(o, "decode_tokens") / dms : 0.0, jint(o, "prefill_slices"),
           jnum(o, "prefill_ms"));
}

static int run_stats(cbctl_t *ctl, int argc, char **argv) {
    const char *names[CBCTL_N_SERVICES * 4];
    bool json;
    int n = cbctl_parse_services(ctl, argc, argv, &json, names, CBCTL_N_SERVICES * 4);
    if (n < 0) return CBCTL_EXIT_USAGE;
    int64_t timeout, connect;
    char err[256];
    if (!cb_config_int(ctl->cfg, "cbctl", "request_timeout_ms", 1, 3600000, 5000, &timeout, err, sizeof err) ||
        !cb_config_int(ctl->cfg, "cbctl", "health_timeout_ms", 1, 600000, 1000, &connect, err, sizeof err)) {
        cbctl_error(ctl, "%s", err);
        return CBCTL_EXIT_USAGE;
    }
    cbctl_result_t res[CBCTL_N_SERVICES * 4];
    cbctl_fanout(ctl, "stats", names, n, (int)connect, (int)timeout, res);
    int rc = CBCTL_EXIT_OK;
    json_t *top = json_object();
    for (int i = 0; i < n; i++) {
        cbctl_result_t *r = &res[i];
        bool ok = r->reply && cb_msg_ok(r->reply);
        if (!ok) rc = r->reply ? (rc == CBCTL_EXIT_OK ? CBCTL_EXIT_FAIL : rc) : CBCTL_EXIT_UNAVAILABLE;
        json_t *o = ok ? cb_msg_to_json(r->reply) : json_object();
        for (int k = 0; s_skip[k]; k++) json_object_del(o, s_skip[k]);
        if (!ok && json) {
            json_object_set_new(o, "error", json_string(r->error));
            json_object_set_new(o, "code", json_string(cb_err_name(r->code)));
        }
        if (json) {
            json_object_set_new(top, r->name, o);
            continue;
        }
        if (!ctl->quiet) {
            printf("%s (%s)%s\n", r->name, r->endpoint ? r->endpoint : "-", ok ? "" : ": not available (see below)");
            const char *k;
            json_t *v;
            json_object_foreach(o, k, v) {
                if (json_is_string(v)) printf("  %-20s %s\n", k, json_string_value(v));
                else if (json_is_real(v)) printf("  %-20s %.3f\n", k, json_real_value(v));
                else {
                    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
                    printf("  %-20s %s\n", k, s ? s : "?");
                    free(s);
                }
            }
            print_pool(o);
            print_steps(o);
        }
        json_decref(o);
    }
    if (json && !ctl->quiet) {
        json_dumpf(top, stdout, JSON_INDENT(2));
        fputc('\n', stdout);
    }
    json_decref(top);
    for (int i = 0; i < n && !ctl->quiet && !json; i++)
        if (!res[i].reply) cbctl_error(ctl, "%s: %s", res[i].name, res[i].error);
    cbctl_results_free(res, n);
    return rc;
}

CBCTL_COMMAND(stats, "stats [--json] [SERVICE...]", "statistics of the services", run_stats)
