/* server: cb-gateway's HTTP/1.1 server (libmicrohttpd, event-driven), its routes and limits.
 *
 *   POST /v1/chat/completions       OpenAI chat completions, plain or streamed (SSE)   -> cb-blend
 *   GET  /v1/models                 the served model (file name, fingerprint)          -> cb-blend ping
 *   POST /v1/documents              acknowledged ingest, one job per document           -> cb-precompute
 *   GET  /v1/documents/jobs/{job}   a job's state                                       -> cb-precompute
 *   GET  /health                    200 when every service answers, else 503 with those that do not
 *   GET  /metrics                   Prometheus text (metrics.h)
 *   GET  /                          the web page (one static HTML file, built in)
 *
 * Threads: gw_admit's accept thread takes every connection, enforces the connection limits (total and per
 * address), checks the first request line (400 at once) and the request deadline (408), and hands good
 * connections to libmicrohttpd, which reads and writes them with `http_threads` epoll threads: an idle or
 * slow connection costs a record and a socket, no thread. A request that asks a service (chat, documents,
 * models, health, metrics) is answered by a thread of its own, at most `max_requests` at once (503 beyond),
 * while its connection is suspended; a streamed answer keeps that thread to read cb-blend, and the
 * connection is suspended whenever no bytes are ready (docs/gateway.md, "Connections and limits").
 * Each request thread makes its own ZeroMQ sockets (one query = one DEALER, closed when the query ends or
 * its client goes away, which cancels it in cb-blend). Limits: body bytes (413), header count and header
 * bytes (431 / closed), connections (503 / 429 at accept), a whole-request deadline (408), an idle
 * timeout; an optional bearer key on /v1/ (401), with wrong keys counted per address (429 for a lockout).
 * docs/gateway.md is the user's reference.
 */
#ifndef GW_SERVER_H
#define GW_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "wire/bus.h"
#include "wire/config.h"

typedef struct gw_server gw_server_t;

typedef struct {
    const char *listen;            /* "HOST:PORT" ([v6]:PORT too); port 0 picks a free one */
    const char *api_key;           /* "" or NULL: no key */
    const char *endpoints[4];      /* retriever, cacheindex, precompute, blend (borrowed) */
    cb_bus_opts_t bus;             /* socket options and the Lazy Pirate timeouts for calls */
    size_t max_body_bytes;         /* request bodies beyond: 413 */
    unsigned max_connections;      /* open connections; beyond: 503 and closed at accept */
    unsigned max_connections_per_ip; /* open connections per client address (0: no cap); beyond: 429, closed */
    unsigned max_requests;         /* requests answered at once (one thread each); beyond: 503 */
    unsigned http_threads;         /* libmicrohttpd's epoll threads */
    unsigned max_headers;          /* beyond: 431 */
    size_t header_bytes;           /* a connection's buffer for the request line and headers */
    unsigned idle_timeout_s;       /* an idle connection is closed after this */
    unsigned request_timeout_s;    /* a whole request (line, headers, body) must arrive within this: 408 */
    unsigned auth_fail_limit;      /* wrong API keys per address within auth_fail_window_s before a lockout (0: off) */
    unsigned auth_fail_window_s;
    unsigned auth_lockout_s;       /* a locked-out address's /v1/ requests get 429 this long */
    int first_ms;                  /* a query: silence allowed before cb-blend's first message */
    int query_timeout_ms;          /* a query: the whole answer */
    int health_timeout_ms;         /* /health, /metrics, /v1/models: the services' answers */
} gw_server_opts_t;

/* Starts the server (threads running on return); raises the open-file limit to what max_connections and
 * max_requests need. NULL with err (cannot bind, bad listen address, the hard open-file limit too low). */
gw_server_t *gw_server_new(const gw_server_opts_t *o, char *err, size_t errlen);
/* Stops accepting, ends running streams and requests (they see the shutdown within ~200 ms; an ingest
 * within one call to cb-precompute), then libmicrohttpd. */
void gw_server_destroy(gw_server_t **self_p);
/* The port listened on (useful with port 0). */
int gw_server_port(const gw_server_t *self);

#endif
