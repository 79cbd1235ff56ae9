/* bus: ZeroMQ socket helpers for cacheblend processes (docs/protocol.md §1):
 *   - sockets created with the configured ZMQ_MAXMSGSIZE, linger, HWMs and send timeout;
 *   - a client (DEALER) with a Lazy Pirate request: wait, close, reconnect, resend, give up with a
 *     clear "timeout" (sent, no reply) or "unavailable" (could not even send: nothing listening);
 *     plus send/recv for streams (cb-blend's token stream);
 *   - a service: a ROUTER socket in a zloop, dispatch by message `type` to handlers, built-in `ping`
 *     and `stats`, error replies for undecodable/unknown messages, one log line per request with its
 *     id, and a clean exit on SIGINT/SIGTERM.
 *
 * Threads: a client or a service belongs to the thread that created it (ZeroMQ sockets are not
 * thread-safe). Worker threads reach the service's loop through their own pipes (zactor), added with
 * zloop_reader(cb_bus_service_loop(svc), ...); a deferred request (cb_bus_req_detach) is answered from
 * the loop's thread.
 *
 * Sources: bus_socket.c (options, sockets, handshake monitors), bus_client.c (connection, Lazy Pirate
 * client, fan-out), bus_service.c (the ROUTER service), bus_worker.c (worker mode); bus_internal.h is
 * private to them.
 */
#ifndef CB_BUS_H
#define CB_BUS_H

#include <czmq.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdint.h>

#include "wire/config.h"
#include "wire/curve.h"
#include "wire/diskhealth.h"
#include "wire/msg.h"

#define CB_BUS_VERSION "0.1.0"

/* Socket and client options (all from config: see cb_bus_opts_from_config). */
typedef struct {
    int64_t max_msg_bytes;  /* ZMQ_MAXMSGSIZE and the decoder's cap */
    int linger_ms;          /* ZMQ_LINGER */
    int sndhwm, rcvhwm;     /* ZMQ_SNDHWM / ZMQ_RCVHWM (messages) */
    int send_timeout_ms;    /* ZMQ_SNDTIMEO */
    int request_timeout_ms; /* client: wait for a reply this long per attempt */
    int request_retries;    /* client: resends after a timeout (0 = one attempt) */
    cb_curve_t curve;       /* transport security: off, or this process's keys (wire/curve.h) */
} cb_bus_opts_t;

/* Built-in defaults (8 MiB, 1000 ms linger, 1000/1000 HWM, 1000 ms send, 2500 ms x 2 retries, CURVE
 * off). */
void cb_bus_opts_default(cb_bus_opts_t *o);
/* Reads common.{max_msg_bytes, linger_ms, sndhwm, rcvhwm, send_timeout_ms, request_timeout_ms,
 * request_retries, curve, keys_dir} with section-level overrides. `section` also names the process's
 * CURVE identity: its client key pair, and its server key pair when it is a service (cb_curve_from_config;
 * tools use "cbctl"). False with err on a bad value, or with curve on, a key that cannot be read. */
bool cb_bus_opts_from_config(const cb_config_t *cfg, const char *section, cb_bus_opts_t *o, char *err,
                             size_t errlen);

/* Process setup for a service or client program: log component name, CZMQ init (which installs the
 * SIGINT/SIGTERM handler that sets zsys_interrupted), CZMQ log ident. Call first in main. */
void cb_bus_init(const char *program_name);

/* A socket of `type` (ZMQ_ROUTER, ZMQ_DEALER, ZMQ_PULL, ...) with the options set before it binds
 * (bind=true) or connects to endpoint (NULL: neither). With o->curve on, a bound socket is a CURVE server
 * (the process's ZAP handler admits the allowed client keys) and a connected one a CURVE client of the
 * service at endpoint; a socket bound to a non-loopback TCP address without CURVE logs a warning.
 * Caller owns (zsock_destroy). */
zsock_t *cb_bus_socket(int type, const char *endpoint, bool bind, const cb_bus_opts_t *o, char *err,
                       size_t errlen);

/* A connecting socket (DEALER, PUSH) with a monitor of its handshakes, which tells "refused" (ZAP denied
 * our key, CURVE on one side only, the server's key is not the one we have) from "nothing there". */
typedef struct cb_bus_conn_s cb_bus_conn_t;
/* cb_bus_socket(type, endpoint, false, o) plus the monitor. Caller owns; cb_bus_conn_destroy. */
cb_bus_conn_t *cb_bus_conn_new(int type, const char *endpoint, const cb_bus_opts_t *o, char *err, size_t errlen);
void cb_bus_conn_destroy(cb_bus_conn_t **self_p);
zsock_t *cb_bus_conn_sock(cb_bus_conn_t *c);
/* The monitor's handle, to poll for ZMQ_POLLIN beside the socket (then call cb_bus_conn_refused). */
void *cb_bus_conn_monitor(cb_bus_conn_t *c);
/* Reads the monitor's pending events: true once a handshake was refused, with the reason ("refused by
 * tcp://...: our CURVE key is not in the server's allowed clients (ZAP)") in err. Sticky. */
bool cb_bus_conn_refused(cb_bus_conn_t *c, char *err, size_t errlen);
/* Sends one frame: at once when the connection is up, else waiting up to timeout_ms for it. 0; -1 with
 * err "... unavailable: no connection within N ms ..."; -2 when refused (err: the reason, at once). */
int cb_bus_conn_send(cb_bus_conn_t *c, const void *data, size_t len, int timeout_ms, char *err, size_t errlen);

/* Writes a fresh request id "<pid>-<n>" into buf (size >= 32); thread-safe. Returns buf. */
const char *cb_bus_new_id(char *buf, size_t size);

/* ---------------------------------------------------------------------------------------------- */
/* Client                                                                                          */

typedef struct cb_bus_client_s cb_bus_client_t;

/* A client of the service at endpoint (connects lazily, with ZMQ_IMMEDIATE so that a send to a dead
 * endpoint fails instead of queueing). Caller owns; cb_bus_client_destroy. */
cb_bus_client_t *cb_bus_client_new(const char *endpoint, const cb_bus_opts_t *o, char *err, size_t errlen);
/* Endpoint from <target>.endpoint, options from <section> (the caller's section, then common). */
cb_bus_client_t *cb_bus_client_from_config(const cb_config_t *cfg, const char *section, const char *target,
                                           char *err, size_t errlen);
void cb_bus_client_destroy(cb_bus_client_t **self_p);
const char *cb_bus_client_endpoint(const cb_bus_client_t *c);
/* Changes the per-attempt timeout and the number of retries. */
void cb_bus_client_set_timeout(cb_bus_client_t *c, int timeout_ms, int retries);

/* Lazy Pirate request: sends the message (which must carry an id), waits for the reply with the same
 * id (stale replies are dropped), retrying as configured. Returns the decoded reply (caller owns;
 * cb_msg_destroy), which may be an error reply (check cb_msg_ok); or NULL with *code set to
 * CB_ERR_TIMEOUT, CB_ERR_UNAVAILABLE, CB_ERR_BAD_REQUEST (our own message is invalid) or
 * CB_ERR_INTERNAL (invalid reply, interrupted) and a message in err naming the endpoint. A refused
 * handshake (cb_bus_conn_refused) is CB_ERR_UNAVAILABLE with its reason, at once, without retries. */
cb_msg_t *cb_bus_request(cb_bus_client_t *c, const void *data, size_t len, cb_err_t *code, char *err,
                         size_t errlen);
/* cb_msg_end(w) + cb_bus_request. */
cb_msg_t *cb_bus_call(cb_bus_client_t *c, cb_msg_writer_t *w, cb_err_t *code, char *err, size_t errlen);
/* Like cb_bus_call, but an error reply also returns NULL, with *code and err taken from it. */
cb_msg_t *cb_bus_call_ok(cb_bus_client_t *c, cb_msg_writer_t *w, cb_err_t *code, char *err, size_t errlen);

/* Streams: send once (no retry), then receive messages with that id until the caller sees "done" or
 * an error. cb_bus_send returns 0, or -1 with CB_ERR_UNAVAILABLE (not connected in time, or refused:
 * the reason in err). cb_bus_recv returns the next
 * message with the given id (others are dropped), or NULL with CB_ERR_TIMEOUT after timeout_ms. */
int cb_bus_send(cb_bus_client_t *c, const void *data, size_t len, cb_err_t *code, char *err, size_t errlen);
cb_msg_t *cb_bus_recv(cb_bus_client_t *c, const char *id, int timeout_ms, cb_err_t *code, char *err,
                      size_t errlen);
/* Fan-out: sends a request of `type` (no fields) to several endpoints at once and waits for every reply
 * until one common deadline (timeout_ms). An endpoint not connected within connect_ms (<= timeout_ms) is
 * reported unavailable; one that refused the handshake, unavailable with refused set and the reason;
 * one that got the request but did not answer, timeout. results[i] is for
 * endpoints[i]; n <= CB_BUS_FANOUT_MAX (more are ignored). Thread: the caller's (its own sockets). */
#define CB_BUS_FANOUT_MAX 16
typedef struct {
    const char *endpoint; /* borrowed from the caller */
    cb_msg_t *reply;      /* NULL when the endpoint did not answer (owned; cb_bus_results_free) */
    cb_err_t code;        /* why not (timeout, unavailable), or the reply's error code */
    char error[320];
    bool refused;         /* the handshake was refused (CURVE/ZAP): error says why */
    double latency_ms;
} cb_bus_result_t;
void cb_bus_fanout(const cb_bus_opts_t *o, const char *type, const char *const *endpoints, int n, int connect_ms,
                   int timeout_ms, cb_bus_result_t *results);
void cb_bus_results_free(cb_bus_result_t *results, int n);

/* The client's ZeroMQ socket handle, to poll it with other descriptors (zmq_pollitem_t.socket; then
 * cb_bus_recv with timeout 0 reads what came), or NULL while no connection is open (before the first
 * send, after a failed one). Owned by the client. */
void *cb_bus_client_handle(cb_bus_client_t *c);
/* Sends raw bytes as one frame, no validation (tests: malformed input). 0 or -1. */
int cb_bus_send_raw(cb_bus_client_t *c, const void *data, size_t len, char *err, size_t errlen);
/* Receives one frame (any content) into a new zframe (caller owns), or NULL after timeout_ms. */
zframe_t *cb_bus_recv_raw(cb_bus_client_t *c, int timeout_ms);

/* ---------------------------------------------------------------------------------------------- */
/* Service                                                                                         */

typedef struct cb_bus_service_s cb_bus_service_t;
typedef struct cb_bus_req_s cb_bus_req_t;

/* A request handler. Reply with cb_bus_reply / cb_bus_reply_error (several replies make a stream),
 * or take the request with cb_bus_req_detach to answer later. A handler that returns without replying
 * or detaching gets an "internal: no reply" sent for it. msg is valid during the call only. */
typedef void(cb_bus_handler_fn)(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *msg, void *arg);
/* Adds service-specific fields to the open `stats` reply map in w. */
typedef void(cb_bus_stats_fn)(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg);

/* A service named name (e.g. "cb-retriever") with a ROUTER bound to endpoint (worker mode: below). */
cb_bus_service_t *cb_bus_service_new(const char *name, const char *endpoint, const cb_bus_opts_t *o, char *err,
                                     size_t errlen);
/* Binds <section>.bind when set, else <section>.endpoint; options from <section>/common. With
 * <section>.router set, a worker of that broker instead (cb_bus_worker_new). */
cb_bus_service_t *cb_bus_service_from_config(const char *name, const cb_config_t *cfg, const char *section,
                                             char *err, size_t errlen);
/* Destroys the service, its socket and loop, and every detached request not yet destroyed. */
void cb_bus_service_destroy(cb_bus_service_t **self_p);
/* Routes messages of `type` to fn (replaces an existing route; "ping" and "stats" are built in but
 * may be replaced). Returns 0, or -1 when the table is full (64 types) or the type is invalid. */
int cb_bus_service_on(cb_bus_service_t *svc, const char *type, cb_bus_handler_fn *fn, void *arg);
void cb_bus_service_set_stats(cb_bus_service_t *svc, cb_bus_stats_fn *fn, void *arg);
/* The service's own health, asked at every `ping`: fn may add fields to the open reply map in w and
 * returns NULL when healthy, or a reason (written into why [whylen]), which makes the ping answer an
 * `unavailable` error with that reason (cbctl health: DOWN). */
typedef const char *(cb_bus_health_fn)(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg, char *why,
                                       size_t whylen);
void cb_bus_service_set_health(cb_bus_service_t *svc, cb_bus_health_fn *fn, void *arg);
/* The data disk's state (diskhealth.h; borrowed, it must outlive the service): a ping that passes the
 * health fn carries `status` "ok" or "degraded" with its `reason`, and `disk_free_bytes`. Without one
 * (the default) a ping says `status` "ok". */
void cb_bus_service_set_disk(cb_bus_service_t *svc, cb_diskhealth_t *dh);
/* The reactor, to add readers (worker pipes, a PULL socket) and timers before cb_bus_service_run. */
zloop_t *cb_bus_service_loop(cb_bus_service_t *svc);
/* The endpoint actually bound (e.g. with the port chosen for tcp://127.0.0.1:*). */
const char *cb_bus_service_endpoint(const cb_bus_service_t *svc);
const cb_bus_opts_t *cb_bus_service_opts(const cb_bus_service_t *svc);
/* A writer for replies (loop thread only). */
cb_msg_writer_t *cb_bus_service_writer(cb_bus_service_t *svc);
/* Runs the loop until SIGINT/SIGTERM (zsys_interrupted) or cb_bus_service_stop. Returns 0 on a clean
 * stop, -1 if the loop failed. */
int cb_bus_service_run(cb_bus_service_t *svc);
/* Makes cb_bus_service_run return after the current event (call from a handler or timer). */
void cb_bus_service_stop(cb_bus_service_t *svc);

/* The request being handled. */
const char *cb_bus_req_id(const cb_bus_req_t *req);
const char *cb_bus_req_type(const cb_bus_req_t *req);
/* The requester's ZeroMQ routing id (the ROUTER's identity frame: libzmq makes one per connection unless
 * the client sets ZMQ_ROUTING_ID): *len bytes (0..255) at the returned pointer, valid while req is. */
const uint8_t *cb_bus_req_peer(const cb_bus_req_t *req, size_t *len);
/* The ZAP User-Id of the connection the request came on: with CURVE on, the client's public key as
 * Z85 text (40 characters; the process's ZAP handler sets it, wire/curve.h), authenticated by the
 * handshake; "" without CURVE, in worker mode (behind a broker the client's key is the broker's to see)
 * or when it is longer than CB_BUS_USER_ID_MAX. Valid while req is (a detached copy keeps it). */
#define CB_BUS_USER_ID_MAX 127
const char *cb_bus_req_user_id(const cb_bus_req_t *req);
/* Receives one whole message from sock, as zmsg_recv does, and the ZAP User-Id of the connection it
 * came on into user_id [size] ("" when there is none, as above; size >= CB_BUS_USER_ID_MAX + 1 keeps
 * every one). For sockets read outside the service's ROUTER (cb-precompute's PULL). Caller owns the
 * message; NULL when interrupted or on a receive error. */
zmsg_t *cb_bus_recv_zmsg(zsock_t *sock, char *user_id, size_t size);
/* Sends the message finished in w (cb_msg_end is called here) to the requester. When the writer
 * failed, an internal error reply is sent instead. Returns 0, or -1 when the requester is gone. */
int cb_bus_reply(cb_bus_req_t *req, cb_msg_writer_t *w);
/* Sends raw message bytes to the requester (a stream message built elsewhere). */
int cb_bus_reply_bytes(cb_bus_req_t *req, const void *data, size_t len);
/* Sends an error reply {type, id, ok: false, error: {code, message}}. */
int cb_bus_reply_error(cb_bus_req_t *req, cb_err_t code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Keeps the request beyond the handler: returns a copy (owned by the service until
 * cb_bus_req_destroy, which logs the request's outcome). Replies go out from the loop's thread. */
cb_bus_req_t *cb_bus_req_detach(cb_bus_req_t *req);
void cb_bus_req_destroy(cb_bus_req_t **req_p);


/* The request's encoded bytes (the body frame), e.g. to forward it: valid during the handler only
 * (NULL, *len = 0, in a detached copy). */
const void *cb_bus_req_body(const cb_bus_req_t *req, size_t *len);
/* Records the request's outcome for its log line (and the service's error count) without sending
 * anything: for replies relayed as bytes (cb_bus_reply_bytes) that were errors. */
void cb_bus_req_note(cb_bus_req_t *req, cb_err_t code, const char *message);

/* ---------------------------------------------------------------------------------------------- */
/* Worker mode (docs/router.md): the same service, its handlers unchanged, but its socket is a DEALER */
/* connected to a broker (cb-router) instead of a bound ROUTER. The broker forwards requests as      */
/* [client identity, body]; replies go back the same way, and the broker relays them to the client. */
/* Paranoid Pirate: the worker sends a heartbeat every heartbeat_ms (the first on each connection is */
/* `worker_ready`), carrying its load through the beat callback; a broker silent for liveness        */
/* intervals is taken for dead: the connection is closed (requests that came on it can no longer be  */
/* answered: their replies fail, so a stream is cancelled) and a new one made after a back-off that  */
/* doubles from reconnect_min_ms up to reconnect_max_ms (reset once the broker speaks).              */

typedef struct {
    int heartbeat_ms;      /* our heartbeat interval, and the broker's expected one (1000) */
    int liveness;          /* silent intervals before the broker counts as dead (3) */
    int reconnect_min_ms;  /* the first back-off (1000) */
    int reconnect_max_ms;  /* the longest (8000) */
} cb_bus_worker_opts_t;
void cb_bus_worker_opts_default(cb_bus_worker_opts_t *wo);
/* A service named name that connects to the broker at `broker` (with o->curve on, as a CURVE client
 * that must already know the broker's key: cb_curve_add_peer). cb_bus_service_from_config makes one
 * when <section>.router is set (heartbeat <section>.heartbeat_ms, liveness <section>.router_liveness,
 * <section>.router_reconnect_max_ms; the broker has <section>'s server key). Caller owns. */
cb_bus_service_t *cb_bus_worker_new(const char *name, const char *broker, const cb_bus_worker_opts_t *wo,
                                    const cb_bus_opts_t *o, char *err, size_t errlen);
/* Adds the service's load (e.g. running, waiting, capacity) to the open heartbeat map in w. */
typedef void(cb_bus_beat_fn)(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg);
void cb_bus_service_set_beat(cb_bus_service_t *svc, cb_bus_beat_fn *fn, void *arg);
bool cb_bus_service_is_worker(const cb_bus_service_t *svc);
/* False in worker mode while the broker has not spoken on the current connection; true otherwise. */
bool cb_bus_service_connected(const cb_bus_service_t *svc);

/* The start of every service's main(): `--help`/`-h` prints usage(stdout) and returns NULL with
 * *exit_code = 0; otherwise loads the configuration for `section` (consuming the config flags from argv)
 * and returns it; a load error or an argument left over is logged (with usage(stderr)) and gives NULL
 * with *exit_code = 1. Caller owns the result (cb_config_destroy). */
cb_config_t *cb_bus_service_config(const char *section, int *argc, char **argv, void (*usage)(FILE *f),
                                   int *exit_code);

#endif
