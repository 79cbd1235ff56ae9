/* admit: cb-gateway's front door. It owns the listening socket and decides, before libmicrohttpd reads a
 * byte, which connections get in and how long they may take to send a request:
 *
 *   - a cap on open connections (max_connections: 503 and closed beyond) and on connections per client
 *     address (max_per_ip: 429 and closed beyond), counted from accept to close, whichever stage;
 *   - the first request line of every connection is checked here, by peeking at the socket (nothing is
 *     consumed): a line that cannot be HTTP/1.x ("GARBAGE", a TLS hello, binary) gets a 400 at once and
 *     is closed; a line that passes is handed to libmicrohttpd (MHD_add_connection), which reads it again;
 *   - a deadline for a whole request (line, headers and body), from the accept or, on a kept-alive
 *     connection, from its next request line, which does not restart with each byte as the idle timeout
 *     does: past it the connection gets a 408 and is shut down (libmicrohttpd then closes it);
 *     a kept-alive connection must send its next request line within idle_timeout_s however it trickles.
 *
 * One thread (epoll) accepts, checks request lines and sweeps the deadlines every 250 ms; libmicrohttpd's
 * worker threads report each connection's progress through the gw_admit_conn_* hooks below (called from
 * the server's MHD callbacks). A connection being answered (a response queued, a query running) has no
 * deadline: the query's own timeouts and libmicrohttpd's idle timeout bound it.
 *
 * Memory: one small record per open connection, one per client address with connections open.
 */
#ifndef GW_ADMIT_H
#define GW_ADMIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "metrics.h"

struct MHD_Daemon;
struct MHD_Connection;

typedef struct gw_admit gw_admit_t;

typedef struct {
    unsigned max_connections;   /* open connections, both stages; beyond: 503 and closed */
    unsigned max_per_ip;        /* open connections per client address; 0: no cap; beyond: 429 and closed */
    unsigned request_timeout_s; /* a whole request must arrive within this (408 and closed) */
    unsigned idle_timeout_s;    /* a kept-alive connection's next request line must arrive within this */
    size_t line_bytes;          /* the first request line is checked over at most this many bytes */
    gw_metrics_t *metrics;      /* borrowed: connections gauge and refusal counters */
} gw_admit_opts_t;

/* Binds and listens on addr (port 0 picks one). No thread yet. NULL with err (cannot bind, no memory). */
gw_admit_t *gw_admit_new(const gw_admit_opts_t *o, const struct sockaddr *addr, socklen_t addrlen, char *err,
                         size_t errlen);
/* Starts accepting; good connections go to daemon (started with MHD_USE_NO_LISTEN_SOCKET and
 * MHD_USE_ITC, and a connection limit above max_connections). False with err. */
bool gw_admit_start(gw_admit_t *self, struct MHD_Daemon *daemon, char *err, size_t errlen);
/* Stops the thread, closes the listening socket and the connections not yet handed over. Call it before
 * MHD_stop_daemon; the records of handed-over connections are freed by gw_admit_conn_closed (which
 * MHD_stop_daemon triggers), so destroy self only after the daemon is stopped (gw_admit_destroy). */
void gw_admit_stop(gw_admit_t *self);
/* Frees self (after gw_admit_stop and MHD_stop_daemon). Safe on NULL. */
void gw_admit_destroy(gw_admit_t **self_p);
int gw_admit_port(const gw_admit_t *self);

/* Hooks, from libmicrohttpd's threads. ctx is the connection's socket context (MHD's NOTIFY_CONNECTION
 * pointer, set by gw_admit_conn_started; NULL is accepted everywhere and ignored). */
void gw_admit_conn_started(gw_admit_t *self, struct MHD_Connection *c, void **ctx);
void gw_admit_conn_closed(gw_admit_t *self, void **ctx);
/* A request line was parsed: on a kept-alive connection its request deadline starts now. */
void gw_admit_conn_request_line(gw_admit_t *self, void *ctx);
/* The request is in (or answered early): no deadline while it is answered. */
void gw_admit_conn_answering(gw_admit_t *self, void *ctx);
/* The response is complete: the connection waits for its next request (idle_timeout_s). */
void gw_admit_conn_idle(gw_admit_t *self, void *ctx);

/* The client address of sa as 16 bytes (IPv4 as ::ffff:a.b.c.d; anything else zeros): the key of the
 * per-address limits. */
void gw_addr_key(const struct sockaddr *sa, uint8_t key[16]);
/* The key as text (IPv4 dotted, else IPv6). */
void gw_addr_key_str(const uint8_t key[16], char *out, size_t cap);

/* The first request line check, on the bytes received so far (data[len]). */
typedef enum {
    GW_LINE_OK,   /* a complete request line that can be HTTP/1.x */
    GW_LINE_MORE, /* a valid beginning: wait for more */
    GW_LINE_BAD   /* cannot be a request line: 400 */
} gw_line_t;
gw_line_t gw_request_line_check(const char *data, size_t len);

#endif
