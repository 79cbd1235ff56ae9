/* metrics: counters, histograms and the Prometheus exposition. See metrics.h. */
#include "metrics.h"
#include "base/alloc.h"

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Histogram bucket upper bounds (seconds); +Inf is implicit. */
static const double TTFT_BUCKETS[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80};
static const double E2E_BUCKETS[] = {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320};
#define N_TTFT (sizeof TTFT_BUCKETS / sizeof TTFT_BUCKETS[0])
#define N_E2E (sizeof E2E_BUCKETS / sizeof E2E_BUCKETS[0])
#define N_BUCKETS_MAX 13

typedef struct {
    uint64_t counts[N_BUCKETS_MAX + 1]; /* per bucket (not cumulative); the last is +Inf */
    uint64_t n;
    double sum;
} hist_t;

/* HTTP responses by handler and status class. */
static const char *const HANDLERS[] = {"chat", "models", "documents", "jobs", "health", "metrics", "page", "other"};
#define N_HANDLERS (sizeof HANDLERS / sizeof HANDLERS[0])
static const int STATUSES[] = {200, 400, 401, 404, 405, 408, 413, 429, 431, 500, 503, 504};
#define N_STATUSES (sizeof STATUSES / sizeof STATUSES[0])

typedef struct {
    hist_t ttft[GW_N_MODES], e2e[GW_N_MODES];
    uint64_t requests[GW_N_MODES][GW_N_OUTCOMES];
    uint64_t prompt_tokens, generation_tokens, tokens_reused, tokens_recomputed, chunk_hits, chunk_misses;
    uint64_t http[N_HANDLERS][N_STATUSES + 1]; /* the last column: any other status */
    int64_t connections, active;
    uint64_t refused[GW_N_REFUSED];
} counts_t;

struct gw_metrics {
    pthread_mutex_t mu;
    counts_t c; /* under mu */
};

static const char *const MODE_NAMES[GW_N_MODES] = {"full", "prefix", "reuse", "blend", "default"};
static const char *const OUTCOME_NAMES[GW_N_OUTCOMES] = {"ok",        "bad_request", "overloaded", "unavailable",
                                                          "timeout",   "too_large",   "cancelled",  "error"};

gw_metrics_t *gw_metrics_new(void) {
    gw_metrics_t *self = cb_calloc(1, sizeof *self);
    if (!self) return NULL;
    pthread_mutex_init(&self->mu, NULL);
    return self;
}

void gw_metrics_destroy(gw_metrics_t **self_p) {
    if (!self_p || !*self_p) return;
    pthread_mutex_destroy(&(*self_p)->mu);
    free(*self_p);
    *self_p = NULL;
}

gw_mode_t gw_mode_parse(const char *name) {
    for (int m = 0; name && m < GW_MODE_DEFAULT; m++)
        if (!strcmp(name, MODE_NAMES[m])) return (gw_mode_t)m;
    return GW_MODE_DEFAULT;
}

const char *gw_mode_name(gw_mode_t m) { return m < GW_N_MODES ? MODE_NAMES[m] : "default"; }
const char *gw_outcome_name(gw_outcome_t o) { return o < GW_N_OUTCOMES ? OUTCOME_NAMES[o] : "error"; }

static void hist_add(hist_t *h, const double *bounds, size_t nb, double v) {
    size_t i = 0;
    while (i < nb && v > bounds[i]) i++;
    h->counts[i]++;
    h->n++;
    h->sum += v;
}

/* A count from the done message's metrics (0 when absent or invalid). */
static uint64_t metric_count(const cb_msg_t *metrics, const char *key) {
    int64_t v = 0;
    if (metrics && cb_msg_int(metrics, key, 0, INT64_MAX, &v)) return (uint64_t)v;
    return 0;
}

void gw_metrics_query(gw_metrics_t *self, gw_mode_t mode, gw_outcome_t outcome, double ttft_s, double e2e_s,
                      const cb_msg_t *done) {
    if (mode >= GW_N_MODES) mode = GW_MODE_DEFAULT;
    if (outcome >= GW_N_OUTCOMES) outcome = GW_OUT_ERROR;
    const cb_msg_t *mt = done ? cb_msg_map(done, "metrics") : NULL;
    uint64_t prompt = metric_count(mt, "n_prompt_tokens"), gen = metric_count(mt, "n_generated");
    uint64_t reused = metric_count(mt, "tokens_reused"), recomputed = metric_count(mt, "tokens_recomputed");
    uint64_t hits = metric_count(mt, "cache_hits"), misses = metric_count(mt, "cache_misses");
    pthread_mutex_lock(&self->mu);
    self->c.requests[mode][outcome]++;
    if (ttft_s >= 0) hist_add(&self->c.ttft[mode], TTFT_BUCKETS, N_TTFT, ttft_s);
    if (outcome == GW_OUT_OK) hist_add(&self->c.e2e[mode], E2E_BUCKETS, N_E2E, e2e_s);
    self->c.prompt_tokens += prompt;
    self->c.generation_tokens += gen;
    self->c.tokens_reused += reused;
    self->c.tokens_recomputed += recomputed;
    self->c.chunk_hits += hits;
    self->c.chunk_misses += misses;
    pthread_mutex_unlock(&self->mu);
}

void gw_metrics_http(gw_metrics_t *self, const char *handler, int status) {
    size_t h = N_HANDLERS - 1, s = N_STATUSES;
    for (size_t i = 0; i < N_HANDLERS; i++)
        if (handler && !strcmp(handler, HANDLERS[i])) h = i;
    for (size_t i = 0; i < N_STATUSES; i++)
        if (STATUSES[i] == status) s = i;
    pthread_mutex_lock(&self->mu);
    self->c.http[h][s]++;
    pthread_mutex_unlock(&self->mu);
}

void gw_metrics_connection(gw_metrics_t *self, int delta) {
    pthread_mutex_lock(&self->mu);
    self->c.connections += delta;
    pthread_mutex_unlock(&self->mu);
}

static const char *const REFUSAL_NAMES[GW_N_REFUSED] = {"connection_limit", "per_ip_limit", "bad_request_line",
                                                        "request_deadline", "api_key_lockout", "request_limit"};

void gw_metrics_refused(gw_metrics_t *self, gw_refusal_t reason) {
    if (reason >= GW_N_REFUSED) return;
    pthread_mutex_lock(&self->mu);
    self->c.refused[reason]++;
    pthread_mutex_unlock(&self->mu);
}

void gw_metrics_active(gw_metrics_t *self, int delta) {
    pthread_mutex_lock(&self->mu);
    self->c.active += delta;
    pthread_mutex_unlock(&self->mu);
}

/* ---------------------------------------------------------------------------------------------- */
/* Exposition                                                                                      */

static void family(FILE *f, const char *name, const char *type, const char *help) {
    fprintf(f, "# HELP cacheblend_%s %s\n# TYPE cacheblend_%s %s\n", name, help, name, type);
}

static void hist_render(FILE *f, const char *name, const hist_t *hs, const double *bounds, size_t nb) {
    for (int m = 0; m < GW_N_MODES; m++) {
        const hist_t *h = &hs[m];
        uint64_t cum = 0;
        for (size_t i = 0; i < nb; i++) {
            cum += h->counts[i];
            fprintf(f, "cacheblend_%s_bucket{mode=\"%s\",le=\"%g\"} %llu\n", name, MODE_NAMES[m], bounds[i],
                    (unsigned long long)cum);
        }
        fprintf(f, "cacheblend_%s_bucket{mode=\"%s\",le=\"+Inf\"} %llu\n", name, MODE_NAMES[m], (unsigned long long)h->n);
        fprintf(f, "cacheblend_%s_sum{mode=\"%s\"} %.6f\n", name, MODE_NAMES[m], h->sum);
        fprintf(f, "cacheblend_%s_count{mode=\"%s\"} %llu\n", name, MODE_NAMES[m], (unsigned long long)h->n);
    }
}

/* A service's stats field exported as one metric (no labels). */
typedef struct {
    const char *service, *key, *name, *type, *help;
} stat_metric_t;

static const stat_metric_t STAT_METRICS[] = {
    {"blend", "running", "num_requests_running", "gauge", "Queries cb-blend is running now (prefill or decode)."},
    {"blend", "queue", "num_requests_waiting", "gauge", "Queries waiting for a cb-blend slot (queue depth)."},
    {"blend", "max_seqs", "max_num_seqs", "gauge", "Queries cb-blend runs at once (blend.max_seqs)."},
    {"blend", "queries", "blend_queries_total", "counter", "Queries cb-blend accepted (every client)."},
    {"blend", "rejected", "blend_queries_rejected_total", "counter", "Queries refused because the queue was full."},
    {"blend", "queries_done", "blend_queries_done_total", "counter", "Queries cb-blend answered."},
    {"blend", "queries_failed", "blend_queries_failed_total", "counter", "Queries cb-blend ended with an error."},
    {"blend", "queries_cancelled", "blend_queries_cancelled_total", "counter", "Queries whose client went away."},
    {"blend", "queries_preempted", "blend_queries_preempted_total", "counter",
     "Queries ended overloaded because the KV pool had no block for their next token."},
    {"blend", "tokens_generated", "blend_generation_tokens_total", "counter", "Tokens cb-blend generated (every client)."},
    {"blend", "prefill_tokens", "blend_prefill_tokens_total", "counter", "Prompt tokens of the fused prefills done."},
    {"blend", "decode_tokens", "blend_decode_rows_total", "counter", "Rows of cb-blend's decode steps."},
    {"blend", "steps", "blend_steps_total", "counter", "Steps of cb-blend's continuous-batching loop."},
    {"blend", "batch_peak", "blend_batch_peak", "gauge", "The largest decode batch so far."},
    {"blend", "cache_hits", "chunk_cache_hits_total", "counter",
     "Chunks whose KV cb-blend took from a cache tier (memory or file)."},
    {"blend", "cache_misses", "chunk_cache_misses_total", "counter", "Chunks cb-blend had to compute."},
    {"blend", "cache_corrupt", "chunk_cache_corrupt_total", "counter",
     "Of the misses, chunks whose KV file failed a check and was rewritten."},
    {"blend", "hot_entries", "kv_memory_tier_entries", "gauge", "Chunks in cb-blend's in-memory KV tier."},
    {"blend", "hot_bytes", "kv_memory_tier_bytes", "gauge", "Bytes in cb-blend's in-memory KV tier."},
    {"blend", "hot_hits", "kv_memory_tier_hits_total", "counter", "Hits of the in-memory KV tier."},
    {"blend", "hot_misses", "kv_memory_tier_misses_total", "counter", "Misses of the in-memory KV tier."},
    {"blend", "pool_blocks_total", "kv_pool_blocks_total", "gauge", "Blocks of the engine's KV pool."},
    {"blend", "pool_blocks_used", "kv_pool_blocks_used", "gauge", "Blocks of the KV pool in use."},
    {"blend", "pool_blocks_peak", "kv_pool_blocks_peak", "gauge", "The most KV pool blocks in use so far."},
    {"cacheindex", "entries", "kv_cache_entries", "gauge", "Chunk KV files in the cache index."},
    {"cacheindex", "bytes", "kv_cache_bytes", "gauge", "Bytes of the chunk KV files in the cache index."},
    {"cacheindex", "budget", "kv_cache_budget_bytes", "gauge", "The KV file tier's byte budget (LRU beyond it)."},
    {"cacheindex", "hits", "kv_cache_hits_total", "counter", "Cache-index lookups that found the chunk's file."},
    {"cacheindex", "misses", "kv_cache_misses_total", "counter", "Cache-index lookups that did not."},
    {"cacheindex", "evictions", "kv_cache_evictions_total", "counter", "KV files evicted for the budget."},
    {"precompute", "chunks_done", "ingest_chunks_done", "gauge", "Chunks precomputed (job table)."},
    {"precompute", "pulled", "ingest_pulled_total", "counter", "Documents taken from the PULL socket."},
    {"precompute", "pull_dropped", "ingest_pull_dropped_total", "counter", "Invalid PULL messages dropped."},
    {"retriever", "chunks", "retriever_chunks", "gauge", "Chunks indexed for retrieval."},
    {"retriever", "docs", "retriever_docs", "gauge", "Documents indexed for retrieval."},
};
#define N_STAT_METRICS (sizeof STAT_METRICS / sizeof STAT_METRICS[0])

/* The reply of `service` among the results, or NULL. */
static const cb_msg_t *reply_of(const char *service, const char *const *names, const cb_bus_result_t *r, int n) {
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], service)) return r[i].reply && cb_msg_ok(r[i].reply) ? r[i].reply : NULL;
    return NULL;
}

static bool stat_value(const cb_msg_t *m, const char *key, double *v) {
    int64_t i;
    if (cb_msg_int(m, key, INT64_MIN, INT64_MAX, &i)) {
        *v = (double)i;
        return true;
    }
    return cb_msg_double(m, key, -1e300, 1e300, v);
}

/* The shared KV tier's counters (docs/kvremote.md), one series per service that uses it (cb-blend,
 * cb-precompute: each has its own client), labelled service="blend" | "precompute". Absent when no service
 * has the tier on (kv_remote empty). */
static void render_kv_remote(FILE *f, const char *const *names, const cb_bus_result_t *r, int n) {
    static const char *const users[] = {"blend", "precompute"};
    static const struct {
        const char *key, *name, *type, *help;
    } km[] = {
        {"kv_remote_hits", "kv_remote_hits_total", "counter", "Chunk KV values found in the Redis tier."},
        {"kv_remote_misses", "kv_remote_misses_total", "counter", "Chunk KV lookups the Redis tier did not have."},
        {"kv_remote_errors", "kv_remote_errors_total", "counter",
         "Redis tier calls that failed (connect, I/O, timeout, error reply); the chunk was computed."},
        {"kv_remote_corrupt", "kv_remote_corrupt_total", "counter",
         "Redis values rejected by the KV file checks (a miss; deleted from Redis)."},
        {"kv_remote_skipped", "kv_remote_skipped_total", "counter", "Redis tier calls skipped while it was down."},
        {"kv_remote_puts", "kv_remote_puts_total", "counter", "Chunk KV values stored in the Redis tier."},
        {"kv_remote_bytes_read", "kv_remote_read_bytes_total", "counter", "Value bytes read from the Redis tier."},
        {"kv_remote_bytes_written", "kv_remote_written_bytes_total", "counter", "Value bytes written to the Redis tier."},
        {"kv_remote_up", "kv_remote_up", "gauge", "1 while the Redis tier is up, 0 while it is down (skipped)."},
    };
    for (size_t k = 0; k < sizeof km / sizeof km[0]; k++) {
        bool fam = false;
        for (size_t u = 0; u < sizeof users / sizeof users[0]; u++) {
            const cb_msg_t *m = reply_of(users[u], names, r, n);
            double v;
            if (!m || !stat_value(m, km[k].key, &v)) continue;
            if (!fam) family(f, km[k].name, km[k].type, km[k].help);
            fam = true;
            fprintf(f, "cacheblend_%s{service=\"%s\"} %.17g\n", km[k].name, users[u], v);
        }
    }
}

static void render_services(FILE *f, const char *const *names, const cb_bus_result_t *r, int n) {
    family(f, "service_up", "gauge", "1 when the service answered the gateway's stats request.");
    for (int i = 0; i < n; i++)
        fprintf(f, "cacheblend_service_up{service=\"%s\"} %d\n", names[i], r[i].reply && cb_msg_ok(r[i].reply));
    static const struct {
        const char *key, *name, *type, *help;
    } common[] = {
        {"uptime_s", "service_uptime_seconds", "gauge", "Seconds since the service started."},
        {"requests", "service_requests_total", "counter", "Requests the service handled (all types)."},
        {"errors", "service_errors_total", "counter", "Error replies the service sent."},
    };
    for (size_t c = 0; c < sizeof common / sizeof common[0]; c++) {
        family(f, common[c].name, common[c].type, common[c].help);
        for (int i = 0; i < n; i++) {
            double v;
            if (r[i].reply && cb_msg_ok(r[i].reply) && stat_value(r[i].reply, common[c].key, &v))
                fprintf(f, "cacheblend_%s{service=\"%s\"} %.17g\n", common[c].name, names[i], v);
        }
    }
    for (size_t s = 0; s < N_STAT_METRICS; s++) {
        const stat_metric_t *sm = &STAT_METRICS[s];
        const cb_msg_t *m = reply_of(sm->service, names, r, n);
        double v;
        if (!m || !stat_value(m, sm->key, &v)) continue;
        family(f, sm->name, sm->type, sm->help);
        fprintf(f, "cacheblend_%s %.17g\n", sm->name, v);
    }
    render_kv_remote(f, names, r, n);
    const cb_msg_t *bl = reply_of("blend", names, r, n);
    double total, used;
    if (bl && stat_value(bl, "pool_blocks_total", &total) && stat_value(bl, "pool_blocks_used", &used) && total > 0) {
        family(f, "kv_cache_usage_perc", "gauge", "Share of the engine's KV pool in use (0..1).");
        fprintf(f, "cacheblend_kv_cache_usage_perc %.6f\n", used / total);
    }
    const cb_msg_t *pc = reply_of("precompute", names, r, n);
    if (pc) {
        static const char *const states[] = {"queued", "running", "done", "failed"};
        family(f, "ingest_jobs", "gauge", "Ingest jobs in cb-precompute's job table, by state.");
        for (size_t i = 0; i < 4; i++) {
            char key[32];
            snprintf(key, sizeof key, "jobs_%s", states[i]);
            double v;
            if (stat_value(pc, key, &v)) fprintf(f, "cacheblend_ingest_jobs{state=\"%s\"} %.17g\n", states[i], v);
        }
    }
}

char *gw_metrics_render(gw_metrics_t *self, const char *const *names, const cb_bus_result_t *services, int n,
                        size_t *len) {
    char *buf = NULL;
    size_t sz = 0;
    FILE *f = open_memstream(&buf, &sz);
    if (!f) return NULL;
    counts_t c; /* a snapshot */
    pthread_mutex_lock(&self->mu);
    c = self->c;
    pthread_mutex_unlock(&self->mu);

    family(f, "time_to_first_token_seconds", "histogram",
           "Time from the chat request's arrival at the gateway to its first token sent.");
    hist_render(f, "time_to_first_token_seconds", c.ttft, TTFT_BUCKETS, N_TTFT);
    family(f, "e2e_request_latency_seconds", "histogram", "Time from the chat request's arrival to its last byte.");
    hist_render(f, "e2e_request_latency_seconds", c.e2e, E2E_BUCKETS, N_E2E);
    family(f, "requests_total", "counter", "Chat completions by requested mode and outcome.");
    for (int m = 0; m < GW_N_MODES; m++)
        for (int o = 0; o < GW_N_OUTCOMES; o++)
            fprintf(f, "cacheblend_requests_total{mode=\"%s\",outcome=\"%s\"} %llu\n", MODE_NAMES[m], OUTCOME_NAMES[o],
                    (unsigned long long)c.requests[m][o]);
    static const struct {
        const char *name, *help;
        size_t off;
    } tok[] = {
        {"prompt_tokens_total", "Prompt tokens of the gateway's chat completions.", offsetof(counts_t, prompt_tokens)},
        {"generation_tokens_total", "Tokens generated for the gateway's chat completions.",
         offsetof(counts_t, generation_tokens)},
        {"tokens_reused_total", "Prompt tokens whose KV was reused (not recomputed).", offsetof(counts_t, tokens_reused)},
        {"tokens_recomputed_total", "Prompt tokens recomputed.", offsetof(counts_t, tokens_recomputed)},
        {"request_chunk_hits_total", "Chunks of the gateway's queries served from a KV cache tier.",
         offsetof(counts_t, chunk_hits)},
        {"request_chunk_misses_total", "Chunks of the gateway's queries computed.", offsetof(counts_t, chunk_misses)},
    };
    for (size_t i = 0; i < sizeof tok / sizeof tok[0]; i++) {
        family(f, tok[i].name, "counter", tok[i].help);
        uint64_t v;
        memcpy(&v, (const char *)&c + tok[i].off, sizeof v);
        fprintf(f, "cacheblend_%s %llu\n", tok[i].name, (unsigned long long)v);
    }
    family(f, "http_responses_total", "counter", "HTTP responses of the gateway by handler and status code.");
    for (size_t h = 0; h < N_HANDLERS; h++)
        for (size_t s = 0; s <= N_STATUSES; s++) {
            if (!c.http[h][s]) continue;
            if (s < N_STATUSES)
                fprintf(f, "cacheblend_http_responses_total{handler=\"%s\",code=\"%d\"} %llu\n", HANDLERS[h], STATUSES[s],
                        (unsigned long long)c.http[h][s]);
            else
                fprintf(f, "cacheblend_http_responses_total{handler=\"%s\",code=\"other\"} %llu\n", HANDLERS[h],
                        (unsigned long long)c.http[h][s]);
        }
    family(f, "gateway_connections", "gauge", "HTTP connections open at the gateway.");
    fprintf(f, "cacheblend_gateway_connections %lld\n", (long long)c.connections);
    family(f, "gateway_requests_active", "gauge", "HTTP requests the gateway is answering now (one thread each).");
    fprintf(f, "cacheblend_gateway_requests_active %lld\n", (long long)c.active);
    family(f, "gateway_refused_total", "counter",
           "Connections or requests refused or cut before an answer, by reason (docs/gateway.md, Limits).");
    for (int r = 0; r < GW_N_REFUSED; r++)
        fprintf(f, "cacheblend_gateway_refused_total{reason=\"%s\"} %llu\n", REFUSAL_NAMES[r],
                (unsigned long long)c.refused[r]);
    render_services(f, names, services, n);
    if (fclose(f) != 0) {
        free(buf);
        return NULL;
    }
    *len = sz;
    return buf;
}
