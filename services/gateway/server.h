/* server: cb-gateway's HTTP/1.1 server (libmicrohttpd, one thread per connection), its routes and limits.
 *
 *   POST /v1/chat/completions       OpenAI chat completions, plain or streamed (SSE)   -> cb-blend
 *   GET  /v1/models                 the served model (file name, fingerprint)          -> cb-blend ping
 *   POST /v1/documents              acknowledged ingest, one job per document           -> cb-precompute
 *   GET  /v1/documents/jobs/{job}   a job's state                                       -> cb-precompute
 *   GET  /health                    200 when every service answers, else 503 with those that do not
 *   GET  /metrics                   Prometheus text (metrics.h)
 *   GET  /                          the web page (one static HTML file, built in)
 *
 * Every connection thread makes its own ZeroMQ sockets (one query = one DEALER, closed when the query
 * ends or its client goes away, which cancels it in cb-blend). Limits: body bytes (413), header count
 * and header bytes (431 / closed), connections (refused beyond), an idle timeout; an optional bearer
 * key on /v1/ (401). docs/gateway.md is the user's reference.
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
    unsigned max_connections;      /* beyond: new connections refused */
    unsigned max_headers;          /* beyond: 431 */
    size_t header_bytes;           /* a connection's buffer for the request line and headers */
    unsigned idle_timeout_s;       /* an idle connection is closed after this */
    int first_ms;                  /* a query: silence allowed before cb-blend's first message */
    int query_timeout_ms;          /* a query: the whole answer */
    int health_timeout_ms;         /* /health, /metrics, /v1/models: the services' answers */
} gw_server_opts_t;

/* Starts the server (threads running on return). NULL with err (cannot bind, bad listen address). */
gw_server_t *gw_server_new(const gw_server_opts_t *o, char *err, size_t errlen);
/* Stops accepting, ends running streams (they see the shutdown within ~200 ms), joins the threads. */
void gw_server_destroy(gw_server_t **self_p);
/* The port listened on (useful with port 0). */
int gw_server_port(const gw_server_t *self);

#endif
