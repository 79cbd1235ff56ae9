/* stream: one query to cb-blend and its streamed answer, read by the thread that answers the HTTP request,
 * with the bounds a client needs: how long cb-blend may stay silent (before its first message, then 3
 * heartbeat intervals), one overall deadline, the gateway stopping, and the HTTP client going away (its
 * socket is polled with the query's while the caller says it may be: a closed connection ends the wait at
 * once; or the caller's `cancelled` flag is set).
 *
 * Destroying the stream closes its socket; cb-blend's next message to it then fails and cb-blend drops
 * the query (docs/protocol.md §7), so a client that goes away cancels its query.
 * A stream belongs to the thread that created it (gw_stream_watch aside, called by that thread too).
 */
#ifndef GW_STREAM_H
#define GW_STREAM_H

#include <stdatomic.h>
#include <stdbool.h>

#include "wire/bus.h"
#include "wire/msg.h"

typedef struct gw_stream gw_stream_t;

typedef struct {
    const char *endpoint;         /* cb-blend's (borrowed) */
    const cb_bus_opts_t *opts;    /* socket options (borrowed) */
    int first_ms;                 /* silence allowed before cb-blend's first message */
    int total_ms;                 /* the whole query, first byte to `done` */
    /* The HTTP connection's socket to watch, read before each wait: -1 (or NULL) = not now. Another thread
     * may change it from -1 to the socket at any time (the socket must then stay open until this thread
     * sets it back to -1 or the stream ends); only the stream's thread may set it back. */
    const atomic_int *client_fd;
    const atomic_bool *stopping;  /* set when the gateway shuts down (may be NULL) */
    const atomic_bool *cancelled; /* set when the answer is no longer wanted: ends as GW_STREAM_GONE (may be NULL) */
} gw_stream_opts_t;

/* Why gw_stream_next returned NULL. */
typedef enum {
    GW_STREAM_SILENT = 1, /* cb-blend said nothing for too long */
    GW_STREAM_DEADLINE,   /* total_ms passed */
    GW_STREAM_GONE,       /* the HTTP client closed its connection (or `cancelled` was set) */
    GW_STREAM_STOPPING,   /* the gateway is shutting down */
    GW_STREAM_FAILED      /* a socket error */
} gw_stream_end_t;

/* Sends the query (finished message data [len], which carries id) to cb-blend. NULL with *code
 * (CB_ERR_UNAVAILABLE when nothing listens, CB_ERR_BAD_REQUEST for an invalid message) and err. */
gw_stream_t *gw_stream_start(const gw_stream_opts_t *o, const void *data, size_t len, const char *id, cb_err_t *code,
                             char *err, size_t errlen);
void gw_stream_destroy(gw_stream_t **self_p);

/* The next message of the query (token, heartbeat, done, or an error reply; caller owns), or NULL with
 * *why and a message in err. Heartbeats are returned too (they lengthen the silence allowed). */
cb_msg_t *gw_stream_next(gw_stream_t *self, gw_stream_end_t *why, char *err, size_t errlen);

/* Replaces the client socket and cancel flag to watch (o->client_fd, o->cancelled; either may be NULL). */
void gw_stream_watch(gw_stream_t *self, const atomic_int *client_fd, const atomic_bool *cancelled);

/* Milliseconds since gw_stream_start. */
double gw_stream_elapsed_ms(const gw_stream_t *self);

/* True when fd's peer has closed the connection (a read would return 0) or it failed; data waiting to be
 * read (a pipelined request) is not a close. Never blocks. */
bool gw_client_gone(int fd);

#endif
