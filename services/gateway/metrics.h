/* metrics: the gateway's own counters and latency histograms, and the Prometheus text exposition of
 * /metrics (format 0.0.4), which adds the other services' `stats` replies as gauges and counters.
 *
 * Names are prefixed `cacheblend_` and follow what users of vLLM look for (docs/gateway.md lists them):
 * time_to_first_token_seconds and e2e_request_latency_seconds histograms by mode, requests_total by mode
 * and outcome, prompt/generation/reused/recomputed token counters (from the gateway's queries), and from
 * the services: running and waiting queries, the KV pool, the KV cache tiers, ingest jobs by state.
 *
 * Thread-safe: every thread of the gateway records into one gw_metrics_t (one mutex, held for a few
 * additions); rendering copies under the same mutex.
 */
#ifndef GW_METRICS_H
#define GW_METRICS_H

#include <stdbool.h>
#include <stdint.h>

#include "wire/bus.h"
#include "wire/msg.h"

typedef struct gw_metrics gw_metrics_t;

/* Modes a request can ask for (the label `mode`); GW_MODE_DEFAULT is a request that named none. */
typedef enum { GW_MODE_FULL, GW_MODE_PREFIX, GW_MODE_REUSE, GW_MODE_BLEND, GW_MODE_DEFAULT, GW_N_MODES } gw_mode_t;
/* Outcomes of a chat completion (the label `outcome`). */
typedef enum {
    GW_OUT_OK,
    GW_OUT_BAD_REQUEST, /* 400: our validation or cb-blend's */
    GW_OUT_OVERLOADED,  /* 503 (cb-blend's queue or KV pool) */
    GW_OUT_UNAVAILABLE, /* 503: cb-blend (or what it needs) down */
    GW_OUT_TIMEOUT,     /* 504 */
    GW_OUT_TOO_LARGE,   /* 400: the prompt exceeds the context */
    GW_OUT_CANCELLED,   /* the client went away */
    GW_OUT_ERROR,       /* anything else (500) */
    GW_N_OUTCOMES
} gw_outcome_t;

/* NULL when out of memory. Caller owns; gw_metrics_destroy. */
gw_metrics_t *gw_metrics_new(void);
void gw_metrics_destroy(gw_metrics_t **self_p);

gw_mode_t gw_mode_parse(const char *name); /* NULL or unknown: GW_MODE_DEFAULT */
const char *gw_mode_name(gw_mode_t m);
const char *gw_outcome_name(gw_outcome_t o);

/* One finished chat completion. ttft_s < 0: no token was sent. done: its `done` message (NULL when it
 * ended before one): its metrics add to the token counters. */
void gw_metrics_query(gw_metrics_t *self, gw_mode_t mode, gw_outcome_t outcome, double ttft_s, double e2e_s,
                      const cb_msg_t *done);
/* One HTTP response (the label `code`, by handler name: "chat", "models", "documents", "jobs",
 * "health", "metrics", "page", "other"). */
void gw_metrics_http(gw_metrics_t *self, const char *handler, int status);
/* Connections open now (+1 on accept, -1 on close). */
void gw_metrics_connection(gw_metrics_t *self, int delta);

/* Why the gateway refused or cut a connection or request before answering it (the label `reason`). */
typedef enum {
    GW_REFUSED_LIMIT,        /* "connection_limit": gateway.max_connections (503, closed) */
    GW_REFUSED_PER_IP,       /* "per_ip_limit": gateway.max_connections_per_ip (429, closed) */
    GW_REFUSED_BAD_LINE,     /* "bad_request_line": the first request line is not HTTP/1.x (400, closed) */
    GW_REFUSED_DEADLINE,     /* "request_deadline": gateway.request_timeout_s passed (408, closed) */
    GW_REFUSED_API_KEY,      /* "api_key_lockout": too many wrong API keys from the address (429) */
    GW_REFUSED_BUSY,         /* "request_limit": gateway.max_requests being answered (503) */
    GW_N_REFUSED
} gw_refusal_t;
void gw_metrics_refused(gw_metrics_t *self, gw_refusal_t reason);
/* Requests being answered now (one thread each; +1 when one starts, -1 when it ends). */
void gw_metrics_active(gw_metrics_t *self, int delta);

/* The exposition: the gateway's metrics, then each service's from its stats reply (services[i] named
 * names[i]; a result without a reply gives cacheblend_service_up{service} 0 and nothing else). Returns
 * a malloc'd NUL-terminated text (caller frees) with its length in *len, or NULL when out of memory. */
char *gw_metrics_render(gw_metrics_t *self, const char *const *names, const cb_bus_result_t *services, int n,
                        size_t *len);

#endif
