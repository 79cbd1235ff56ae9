/* cb-load: a load generator for cb-blend: N client threads (one DEALER socket each) send queries from a
 * file until a total count is reached, and the time to the first token and to the end of each answer is
 * measured at the client. For scripts/bench-stack.sh and scripts/bench-serve.sh.
 *
 *   cb-load [--clients N] [--queries M | --per-client M] [--duration S] [--backoff MS] [--mode M]
 *           [--ratio R] [--max-tokens T] [--timeout MS] [--json] ENDPOINT QUERIES.jsonl
 *
 * QUERIES.jsonl: one object per line {"question": str, "contexts": [str...], "mode": str} (contexts optional:
 * then cb-blend retrieves; mode optional: the line's mode wins over --mode, so one file can mix modes).
 * --backoff MS: a client waits MS after an `overloaded` reply before its next query (a polite client; 0, the
 * default, resends at once).
 * --duration S: no query is started after S seconds (those not sent are counted in "not_sent", neither ok
 * nor errors), so a run is bounded by count and by time. With --queries M (default: as many as the file has), queries are taken in order,
 * round-robin over the file, by whichever client is free, until M were sent. With --per-client M, each
 * client sends M queries of its own, one after the other, starting at its own offset in the file (client c
 * of N at line c * lines / N, then round-robin), so that the clients do not all ask the same one at once;
 * N x M queries in all.
 * Output: a summary line, or with --json one object {"clients", "queries", "ok", "errors", "overloaded"
 * (of the errors, those cb-blend answered `overloaded`: queue full or KV pool full), "no_reply" (of the
 * errors, those that got nothing for --timeout ms or could not be sent: timeouts, not error replies),
 * "not_sent" (--duration ran out first), "wall_s", "qps",
 * "ttft_ms": {"mean", "p50", "p90", "p99", "max"}, "total_ms": {...}, "per_client" (M, or null without
 * --per-client), and from the `done` messages' metrics: "tokens_generated" (sum of n_generated over the
 * answered queries), "tokens_per_s" (tokens_generated / wall_s), "generated_mean" and "prompt_tokens_mean"
 * (means of n_generated and n_prompt_tokens; null when no answer carried them)}.
 * --config PATH and --SECTION.KEY=VALUE flags are read as by cbctl: with common.curve = on, the clients
 * connect as CURVE client `cbctl` (keys in common.keys_dir).
 * Exit: 0 when every query was answered, 1 when some failed, 2 usage.
 */
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/alloc.h"
#include "wire/bus.h"
#include "base/log.h"
#include "wire/msg.h"

#define MAX_CLIENTS 256

typedef struct {
    json_t *queries;   /* array of query objects */
    const char *endpoint, *mode;
    double ratio;
    int max_tokens, timeout_ms, total;
    int per_client;    /* > 0: each client sends this many from its own offset (else the shared counter) */
    int clients;
    atomic_int next;
    double *ttft, *tot; /* [total] per query, -1 when it failed */
    int64_t *gen, *prompt; /* [total] n_generated, n_prompt_tokens of the done metrics; -1 when absent */
    atomic_int errors;
    atomic_int overloaded; /* errors with code `overloaded` */
    atomic_int no_reply;   /* errors without a reply: a send failure or --timeout of silence */
    atomic_int not_sent;   /* slots left when --duration ran out */
    double deadline_ms;    /* cb_now_ms() after which no query starts; 0 = none */
    int backoff_ms;        /* pause after an `overloaded` reply */
} load_t;

typedef struct {
    load_t *L;
    int index; /* this client's number, 0..clients-1 */
    int sent;  /* --per-client: queries taken so far */
} client_arg_t;

/* The next query slot of this client (an index into ttft/tot, and the query's line), or -1 when done. */
static int next_slot(client_arg_t *a, size_t *line) {
    load_t *L = a->L;
    size_t nq = json_array_size(L->queries);
    if (L->per_client > 0) {
        if (a->sent >= L->per_client) return -1;
        size_t off = (size_t)a->index * nq / (size_t)L->clients;
        *line = (off + (size_t)a->sent) % nq;
        return a->index * L->per_client + a->sent++;
    }
    int i = atomic_fetch_add(&L->next, 1);
    if (i >= L->total) return -1;
    *line = (size_t)i % nq;
    return i;
}

static cb_curve_t s_curve; /* common.curve and keys_dir, as CURVE client `cbctl` (read-only in the clients) */

static void *client(void *arg) {
    client_arg_t *A = arg;
    load_t *L = A->L;
    char err[512];
    cb_bus_opts_t o;
    cb_bus_opts_default(&o);
    o.request_timeout_ms = L->timeout_ms;
    o.send_timeout_ms = 5000;
    o.curve = s_curve;
    cb_bus_client_t *c = cb_bus_client_new(L->endpoint, &o, err, sizeof err);
    cb_msg_writer_t *w = cb_msg_writer_new();
    if (!c || !w) {
        fprintf(stderr, "cb-load: %s\n", err);
        cb_bus_client_destroy(&c);
        cb_msg_writer_destroy(&w);
        /* --per-client: nobody else sends this client's share; count it failed (the shared counter's
         * queries go to the other clients) */
        for (size_t line; L->per_client > 0 && next_slot(A, &line) >= 0;) atomic_fetch_add(&L->errors, 1);
        return NULL;
    }
    for (;;) {
        size_t line = 0;
        int i = next_slot(A, &line);
        if (i < 0) break;
        if (L->deadline_ms > 0 && cb_now_ms() > L->deadline_ms) {
            L->ttft[i] = L->tot[i] = -1;
            atomic_fetch_add(&L->not_sent, 1);
            continue;
        }
        json_t *q = json_array_get(L->queries, line);
        char id[32];
        cb_msg_begin(w, "query", cb_bus_new_id(id, sizeof id));
        cb_msg_put_str(w, "question", json_string_value(json_object_get(q, "question")));
        json_t *ctx = json_object_get(q, "contexts");
        if (json_is_array(ctx)) cb_msg_put_json(w, "contexts", ctx);
        json_t *qm = json_object_get(q, "mode");
        if (json_is_string(qm)) cb_msg_put_str(w, "mode", json_string_value(qm));
        else if (L->mode) cb_msg_put_str(w, "mode", L->mode);
        if (L->ratio >= 0) cb_msg_put_double(w, "ratio", L->ratio);
        if (L->max_tokens > 0) cb_msg_put_int(w, "max_tokens", L->max_tokens);
        size_t len;
        const void *d = cb_msg_end(w, &len);
        L->ttft[i] = L->tot[i] = -1;
        L->gen[i] = L->prompt[i] = -1;
        cb_err_t code;
        double t0 = cb_now_ms(), t1 = -1;
        if (!d || cb_bus_send(c, d, len, &code, err, sizeof err) != 0) {
            fprintf(stderr, "cb-load: query %d: %s\n", i, d ? err : cb_msg_writer_error(w));
            atomic_fetch_add(&L->errors, 1);
            if (d) atomic_fetch_add(&L->no_reply, 1);
            continue;
        }
        for (;;) {
            cb_msg_t *m = cb_bus_recv(c, id, L->timeout_ms, &code, err, sizeof err);
            if (!m) {
                fprintf(stderr, "cb-load: query %d: %s\n", i, err);
                atomic_fetch_add(&L->errors, 1);
                atomic_fetch_add(&L->no_reply, 1);
                break;
            }
            if (!cb_msg_ok(m)) {
                fprintf(stderr, "cb-load: query %d: %s: %s\n", i, cb_msg_err_code_name(m), cb_msg_err_message(m));
                atomic_fetch_add(&L->errors, 1);
                bool over = cb_msg_err_code(m) == CB_ERR_OVERLOADED;
                if (over) atomic_fetch_add(&L->overloaded, 1);
                cb_msg_destroy(&m);
                if (over && L->backoff_ms > 0) usleep((useconds_t)L->backoff_ms * 1000);
                break;
            }
            bool done = cb_msg_is_type(m, "done");
            if ((cb_msg_is_type(m, "token") || done) && t1 < 0) t1 = cb_now_ms();
            if (done) {
                L->ttft[i] = t1 - t0;
                L->tot[i] = cb_now_ms() - t0;
                const cb_msg_t *mt = cb_msg_map(m, "metrics");
                int64_t v;
                if (mt && cb_msg_int(mt, "n_generated", 0, INT64_MAX, &v)) L->gen[i] = v;
                if (mt && cb_msg_int(mt, "n_prompt_tokens", 0, INT64_MAX, &v)) L->prompt[i] = v;
                cb_msg_destroy(&m);
                break;
            }
            cb_msg_destroy(&m);
        }
    }
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&c);
    return NULL;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Percentiles of the non-negative values of v[n] (nearest rank). */
static json_t *summary(const double *v, int n) {
    double *s = cb_malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    int k = 0;
    double sum = 0;
    for (int i = 0; i < n; i++)
        if (v[i] >= 0) {
            s[k++] = v[i];
            sum += v[i];
        }
    qsort(s, (size_t)k, sizeof *s, cmp_d);
#define PCT(p) (k ? s[(int)((p) / 100.0 * (k - 1) + 0.5)] : 0.0)
    json_t *o = json_pack("{s:f, s:f, s:f, s:f, s:f}", "mean", k ? sum / k : 0.0, "p50", PCT(50), "p90", PCT(90), "p99",
                          PCT(99), "max", k ? s[k - 1] : 0.0);
#undef PCT
    free(s);
    return o;
}

/* The mean (null when there is none) and, in *sum_out, the sum of the non-negative values of v[n]: the answered
 * queries whose metrics had the field. */
static json_t *mean_or_null(const int64_t *v, int n, int64_t *sum_out) {
    int64_t sum = 0;
    int k = 0;
    for (int i = 0; i < n; i++)
        if (v[i] >= 0) {
            sum += v[i];
            k++;
        }
    if (sum_out) *sum_out = sum;
    return k ? json_real((double)sum / k) : json_null();
}

static int usage(void) {
    fprintf(stderr, "usage: cb-load [--clients N] [--queries M | --per-client M] [--duration S] [--backoff MS]\n"
                    "               [--mode M] [--ratio R] [--max-tokens T] [--timeout MS] [--json] ENDPOINT QUERIES.jsonl\n");
    return 2;
}

int main(int argc, char **argv) {
    cb_log_set_component("cb-load");
    char cerr[1024];
    cb_config_t *cfg = cb_config_new("cbctl", &argc, argv, cerr, sizeof cerr);
    bool curve_ok = cfg && cb_curve_from_config(cfg, "cbctl", &s_curve, cerr, sizeof cerr);
    cb_config_destroy(&cfg);
    if (!curve_ok) {
        fprintf(stderr, "cb-load: %s\n", cerr);
        return 2;
    }
    setenv("ZSYS_SIGHANDLER", "false", 0);
    load_t L = {.ratio = -1, .timeout_ms = 60000};
    int clients = 1, i = 1;
    bool json = false;
    double duration_s = 0;
    L.total = 0;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (!strcmp(argv[i], "--clients") && i + 1 < argc) clients = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--queries") && i + 1 < argc) L.total = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--per-client") && i + 1 < argc) {
            L.per_client = atoi(argv[++i]);
            if (L.per_client < 1) return usage();
        }
        else if (!strcmp(argv[i], "--duration") && i + 1 < argc) {
            duration_s = atof(argv[++i]);
            if (!(duration_s > 0 && duration_s < 1e6)) return usage();
        }
        else if (!strcmp(argv[i], "--backoff") && i + 1 < argc) {
            L.backoff_ms = atoi(argv[++i]);
            if (L.backoff_ms < 0 || L.backoff_ms > 60000) return usage();
        }
        else if (!strcmp(argv[i], "--mode") && i + 1 < argc) L.mode = argv[++i];
        else if (!strcmp(argv[i], "--ratio") && i + 1 < argc) L.ratio = atof(argv[++i]);
        else if (!strcmp(argv[i], "--max-tokens") && i + 1 < argc) L.max_tokens = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--timeout") && i + 1 < argc) L.timeout_ms = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json")) json = true;
        else return usage();
    }
    if (i + 2 != argc || clients < 1 || clients > MAX_CLIENTS || L.timeout_ms < 1) return usage();
    if (L.per_client > 0 && L.total > 0) {
        fprintf(stderr, "cb-load: --queries and --per-client exclude each other\n");
        return usage();
    }
    if (L.per_client > 0 && L.per_client > (1 << 24) / clients) return usage();
    L.clients = clients;
    L.endpoint = argv[i];
    json_t *qs = json_array();
    FILE *f = fopen(argv[i + 1], "r");
    if (!f) {
        perror(argv[i + 1]);
        return 2;
    }
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0) {
        json_t *q = json_loads(line, 0, NULL);
        if (json_is_object(q) && json_is_string(json_object_get(q, "question"))) json_array_append_new(qs, q);
        else json_decref(q);
    }
    free(line);
    fclose(f);
    if (json_array_size(qs) == 0) {
        fprintf(stderr, "cb-load: no queries in %s\n", argv[i + 1]);
        return 2;
    }
    if (L.per_client > 0) L.total = clients * L.per_client;
    else if (L.total <= 0) L.total = (int)json_array_size(qs);
    L.queries = qs;
    L.ttft = cb_calloc((size_t)L.total, sizeof(double));
    L.tot = cb_calloc((size_t)L.total, sizeof(double));
    L.gen = cb_calloc((size_t)L.total, sizeof(int64_t));
    L.prompt = cb_calloc((size_t)L.total, sizeof(int64_t));
    if (!L.ttft || !L.tot || !L.gen || !L.prompt) {
        fprintf(stderr, "cb-load: out of memory\n");
        return 2;
    }
    for (int q = 0; q < L.total; q++) { /* a client that fails to start fills nothing */
        L.ttft[q] = L.tot[q] = -1;
        L.gen[q] = L.prompt[q] = -1;
    }
    atomic_init(&L.next, 0);
    atomic_init(&L.errors, 0);
    atomic_init(&L.overloaded, 0);
    atomic_init(&L.no_reply, 0);
    atomic_init(&L.not_sent, 0);
    zsys_init();
    pthread_t th[MAX_CLIENTS];
    client_arg_t args[MAX_CLIENTS];
    double t0 = cb_now_ms();
    L.deadline_ms = duration_s > 0 ? t0 + duration_s * 1000.0 : 0;
    for (int c = 0; c < clients; c++) {
        args[c] = (client_arg_t){.L = &L, .index = c};
        pthread_create(&th[c], NULL, client, &args[c]);
    }
    for (int c = 0; c < clients; c++) pthread_join(th[c], NULL);
    double wall = (cb_now_ms() - t0) / 1000.0;
    int errors = atomic_load(&L.errors), overloaded = atomic_load(&L.overloaded);
    int no_reply = atomic_load(&L.no_reply), not_sent = atomic_load(&L.not_sent);
    int ok = L.total - errors - not_sent;
    json_t *out = json_pack("{s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:o, s:o}", "clients", clients, "queries", L.total, "ok",
                            ok, "errors", errors, "overloaded", overloaded, "wall_s", wall, "qps", wall > 0 ? ok / wall : 0.0, "ttft_ms",
                            summary(L.ttft, L.total), "total_ms", summary(L.tot, L.total));
    int64_t gen_sum = 0;
    json_t *gen_mean = mean_or_null(L.gen, L.total, &gen_sum);
    json_object_set_new(out, "no_reply", json_integer(no_reply));
    json_object_set_new(out, "not_sent", json_integer(not_sent));
    json_object_set_new(out, "per_client", L.per_client > 0 ? json_integer(L.per_client) : json_null());
    json_object_set_new(out, "tokens_generated", json_integer(gen_sum));
    json_object_set_new(out, "tokens_per_s", json_real(wall > 0 ? (double)gen_sum / wall : 0.0));
    json_object_set_new(out, "generated_mean", gen_mean);
    json_object_set_new(out, "prompt_tokens_mean", mean_or_null(L.prompt, L.total, NULL));
    if (json) {
        json_dumpf(out, stdout, JSON_COMPACT);
        fputc('\n', stdout);
    } else {
        json_t *tt = json_object_get(out, "ttft_ms");
        printf("%d clients, %d queries (%d ok, %d overloaded) in %.2f s: %.3f queries/s, TTFT p50 %.1f ms, p99 %.1f ms\n",
               clients, L.total, ok, overloaded, wall, wall > 0 ? ok / wall : 0.0, json_real_value(json_object_get(tt, "p50")),
               json_real_value(json_object_get(tt, "p99")));
    }
    json_decref(out);
    json_decref(qs);
    free(L.ttft);
    free(L.tot);
    free(L.gen);
    free(L.prompt);
    return errors ? 1 : 0;
}
