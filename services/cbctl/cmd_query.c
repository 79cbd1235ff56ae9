/* cbctl query: asks cb-blend a question and streams the answer to stdout as it is generated.
 *
 *   cbctl query [--mode M] [--ratio R|auto] [--k K] [--context TEXT]... [--max-tokens N] [--temperature T]
 *               [--top-p P] [--seed S] [--frequency-penalty F] [--presence-penalty F] [--stop S]...
 *               [--json] QUESTION
 *
 * Without --context, cb-blend retrieves the top K chunks from cb-retriever. The penalties (-2..2, OpenAI
 * semantics) and up to 4 stop sequences (1..256 bytes each; the answer ends before the first one, which
 * is not printed) go into the query as frequency_penalty, presence_penalty and stop. --json: after the
 * streamed answer, one line with the final object {"text", "finish_reason" ("stop" or "length"),
 * "metrics", "chunk_ids", "client": {"ttft_ms", "total_ms"}} (client-side timings include the
 * messaging).
 *
 * Liveness: cb-blend sends a heartbeat to a query that has heard nothing for a while (its interval is in
 * the heartbeat), so the client gives up after 3 silent intervals (at least 1 s) once it has heard one;
 * before the first message it waits cbctl.request_timeout_ms. And the whole query, from the send to the
 * `done`, is bounded by cbctl.query_timeout_ms whatever arrives meanwhile (a stuck cb-blend that keeps
 * sending heartbeats, or a very slow answer): past it cbctl gives up with a clear error (exit 3); cb-blend
 * drops the query when its next message finds the client gone.
 * Exit: 0 answered, 1 cb-blend answered with an error, 2 usage, 3 cb-blend unreachable, silent, overloaded
 * or past the query deadline.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cbctl.h"
#include "client.h"
#include "base/clock.h"
#include "wire/query.h"

static int usage(cbctl_t *ctl, const char *why) {
    cbctl_error(ctl, "%s\nusage: cbctl query [--mode full|prefix|reuse|blend] [--ratio R|auto] [--k K] [--context TEXT]...\n"
                     "                   [--max-tokens N] [--temperature T] [--top-p P] [--seed S]\n"
                     "                   [--frequency-penalty F] [--presence-penalty F] [--stop S]... [--json] QUESTION\n"
                     "  penalties -2..2 (default blend.*_penalty, 0); at most 4 --stop of 1..256 bytes",
                why);
    return CBCTL_EXIT_USAGE;
}

static bool parse_num(const char *s, double lo, double hi, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !(v >= lo && v <= hi)) return false;
    *out = v;
    return true;
}

/* The flags into q (its strings point into argv); 0, or the usage exit after printing why. */
static int parse_flags(cbctl_t *ctl, int argc, char **argv, cb_query_t *q, bool *json) {
    cb_query_init(q);
    double v;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_val = i + 1 < argc;
#define NUM(flag, lo, hi, bit, assign)                                                            \
    if (!strcmp(a, flag)) {                                                                       \
        if (!has_val || !parse_num(argv[++i], lo, hi, &v)) return usage(ctl, "bad value for " flag); \
        assign;                                                                                   \
        q->set |= bit;                                                                            \
        continue;                                                                                 \
    }
        if (!strcmp(a, "--ratio") && has_val && !strcmp(argv[i + 1], "auto")) {
            q->ratio_auto = true;
            q->set |= CB_QUERY_RATIO;
            i++;
            continue;
        }
        NUM("--ratio", 0, CB_QUERY_RATIO_MAX, CB_QUERY_RATIO, (q->ratio = v, q->ratio_auto = false))
        NUM("--k", CB_QUERY_K_MIN, CB_QUERY_K_MAX, CB_QUERY_K, q->k = (int)v)
        NUM("--max-tokens", CB_QUERY_MAX_TOKENS_MIN, CB_QUERY_MAX_TOKENS_MAX, CB_QUERY_MAX_TOKENS, q->max_tokens = (int)v)
        NUM("--temperature", 0, CB_QUERY_TEMPERATURE_MAX, CB_QUERY_TEMPERATURE, q->temperature = v)
        NUM("--top-p", CB_QUERY_TOP_P_MIN, CB_QUERY_TOP_P_MAX, CB_QUERY_TOP_P, q->top_p = v)
        NUM("--seed", 0, 9.2e18, CB_QUERY_SEED, q->seed = (int64_t)v)
        NUM("--frequency-penalty", -CB_QUERY_PENALTY_MAX, CB_QUERY_PENALTY_MAX, CB_QUERY_FREQUENCY_PENALTY,
            q->frequency_penalty = v)
        NUM("--presence-penalty", -CB_QUERY_PENALTY_MAX, CB_QUERY_PENALTY_MAX, CB_QUERY_PRESENCE_PENALTY,
            q->presence_penalty = v)
#undef NUM
        if (!strcmp(a, "--mode")) {
            if (!has_val) return usage(ctl, "--mode needs a value");
            if (!cb_query_mode_valid(argv[++i])) return usage(ctl, "--mode: expected full, prefix, reuse or blend");
            snprintf(q->mode, sizeof q->mode, "%s", argv[i]);
            q->set |= CB_QUERY_MODE;
        } else if (!strcmp(a, "--context")) {
            if (!has_val) return usage(ctl, "--context needs a value");
            if (q->n_contexts >= CB_QUERY_MAX_CONTEXTS) return usage(ctl, "at most 32 --context");
            q->contexts[q->n_contexts] = argv[++i];
            q->context_lens[q->n_contexts++] = strlen(argv[i]);
            q->set |= CB_QUERY_CONTEXTS;
        } else if (!strcmp(a, "--stop")) {
            if (!has_val) return usage(ctl, "--stop needs a value");
            if (q->n_stop >= CB_QUERY_MAX_STOP) return usage(ctl, "at most 4 --stop");
            size_t sl = strlen(argv[i + 1]);
            if (sl == 0 || sl > CB_QUERY_MAX_STOP_BYTES) return usage(ctl, "--stop: a stop sequence has 1..256 bytes");
            q->stop[q->n_stop] = argv[++i];
            q->stop_lens[q->n_stop++] = sl;
            q->set |= CB_QUERY_STOP;
        } else if (!strcmp(a, "--json")) {
            *json = true;
        } else if (!strcmp(a, "--")) {
            if (i + 1 < argc) q->question = argv[++i];
            break;
        } else if (a[0] == '-' && a[1]) {
            char why[128];
            snprintf(why, sizeof why, "unknown option %s", a);
            return usage(ctl, why);
        } else if (!q->question) {
            q->question = a;
        } else {
            return usage(ctl, "one QUESTION (quote it)");
        }
    }
    if (!q->question || !*q->question) return usage(ctl, "no QUESTION");
    q->question_len = strlen(q->question);
    return 0;
}

static int run_query(cbctl_t *ctl, int argc, char **argv) {
    cb_query_t q;
    bool json = false;
    int urc = parse_flags(ctl, argc, argv, &q, &json);
    if (urc != 0) return urc;

    char err[512];
    int64_t first_ms, cap_ms;
    if (!cb_config_int(ctl->cfg, "cbctl", "request_timeout_ms", 1, 3600000, 5000, &first_ms, err, sizeof err) ||
        !cb_config_int(ctl->cfg, "cbctl", "query_timeout_ms", 1, 86400000, 120000, &cap_ms, err, sizeof err)) {
        cbctl_error(ctl, "%s", err);
        return CBCTL_EXIT_USAGE;
    }
    cb_bus_client_t *c = cbctl_client(ctl, "blend", (int)first_ms, 0, err, sizeof err);
    if (!c) {
        cbctl_error(ctl, "%s", err);
        return CBCTL_EXIT_USAGE;
    }
    cb_msg_writer_t *w = cb_msg_writer_new();
    char id[32];
    cb_bus_new_id(id, sizeof id);
    cb_query_encode(&q, id, w);
    size_t len;
    const void *data = cb_msg_end(w, &len);
    int rc = CBCTL_EXIT_OK;
    cb_err_t code;
    double t0 = cb_now_ms(), ttft = -1;
    if (!data) {
        cbctl_error(ctl, "cannot encode the query: %s", cb_msg_writer_error(w));
        rc = CBCTL_EXIT_USAGE;
        goto out;
    }
    if (cb_bus_send(c, data, len, &code, err, sizeof err) != 0) {
        cbctl_error(ctl, "blend: %s", err);
        rc = cbctl_exit_for(code);
        goto out;
    }
    bool newline = true; /* the output ends with a newline */
    int silence = (int)(first_ms < cap_ms ? first_ms : cap_ms);
    const double deadline = t0 + (double)cap_ms; /* the whole query, heartbeats or not */
    for (;;) {
        double left = deadline - cb_now_ms();
        int wait = left <= 0 ? 0 : left < (double)silence ? (int)left + 1 : silence;
        cb_msg_t *m = left <= 0 ? NULL : cb_bus_recv(c, id, wait, &code, err, sizeof err);
        if (!m && cb_now_ms() >= deadline) {
            if (!newline) fputc('\n', stdout);
            cbctl_error(ctl, "the query took longer than cbctl.query_timeout_ms (%lld ms) at %s: giving up",
                        (long long)cap_ms, cb_bus_client_endpoint(c));
            rc = CBCTL_EXIT_UNAVAILABLE;
            break;
        }
        if (!m) {
            if (!newline) fputc('\n', stdout);
            cbctl_error(ctl, "no answer from cb-blend at %s for %d ms (is it running?): %s", cb_bus_client_endpoint(c),
                        wait, err);
            rc = CBCTL_EXIT_UNAVAILABLE;
            break;
        }
        if (!cb_msg_ok(m)) {
            if (!newline) fputc('\n', stdout);
            cb_err_t ec = cb_msg_err_code(m);
            cbctl_error(ctl, "query failed: %s: %s", cb_msg_err_code_name(m), cb_msg_err_message(m));
            rc = ec == CB_ERR_OVERLOADED ? CBCTL_EXIT_UNAVAILABLE : cbctl_exit_for(ec);
            cb_msg_destroy(&m);
            break;
        }
        if (cb_msg_is_type(m, "heartbeat")) {
            int64_t ivl = 0;
            if (cb_msg_int_or(m, "interval_ms", 1, 3600000, 1000, &ivl)) {
                int s = (int)(3 * ivl < 1000 ? 1000 : 3 * ivl);
                silence = s < cap_ms ? s : (int)cap_ms;
            }
        } else if (cb_msg_is_type(m, "token")) {
            const char *s;
            size_t sl;
            if (ttft < 0) ttft = cb_now_ms() - t0;
            if (cb_msg_str(m, "text", 1 << 20, &s, &sl) && sl > 0 && !ctl->quiet) {
                fwrite(s, 1, sl, stdout);
                fflush(stdout);
                newline = s[sl - 1] == '\n';
            }
        } else if (cb_msg_is_type(m, "done")) {
            if (!newline && !ctl->quiet) fputc('\n', stdout);
            if (json && !ctl->quiet) {
                json_t *o = cb_msg_to_json(m);
                const char *skip[] = {"v", "type", "id", "ok"};
                for (size_t i = 0; i < sizeof skip / sizeof skip[0]; i++) json_object_del(o, skip[i]);
                json_t *cl = json_object();
                json_object_set_new(cl, "ttft_ms", json_real(ttft < 0 ? cb_now_ms() - t0 : ttft));
                json_object_set_new(cl, "total_ms", json_real(cb_now_ms() - t0));
                json_object_set_new(o, "client", cl);
                json_dumpf(o, stdout, JSON_COMPACT);
                fputc('\n', stdout);
                json_decref(o);
            }
            cb_msg_destroy(&m);
            break;
        }
        cb_msg_destroy(&m);
    }
out:
    fflush(stdout);
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&c);
    return rc;
}

CBCTL_COMMAND(query, "query [--mode M] [--ratio R|auto] [--k K] [--context TEXT]... [--stop S]... [--json] Q",
              "ask cb-blend; the answer streams to stdout", run_query)
