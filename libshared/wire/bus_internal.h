/* bus_internal: private to the bus files (bus_socket.c, bus_client.c, bus_service.c, bus_worker.c):
 * what they share beyond bus.h, the one public header. Nothing else includes it. Declarations only (and
 * the service's types, which bus_service.c and bus_worker.c both use); each function is described where
 * it is defined. */
#ifndef CB_BUS_INTERNAL_H
#define CB_BUS_INTERNAL_H

#include "wire/bus.h"

/* bus_socket.c: one int socket option (zmq_setsockopt) */
int cb_bus_set_int(void *h, int opt, int v);

/* bus_socket.c: the handshake monitor of a socket (a PAIR receiving its events) */
zsock_t *cb_bus_monitor_attach(zsock_t *s, int events, char *err, size_t errlen);
void cb_bus_monitor_detach(zsock_t *s, zsock_t **pair_p);
bool cb_bus_monitor_next(zsock_t *pair, uint16_t *event, uint32_t *value);

/* ---------------------------------------------------------------------------------------------- */
/* The service (bus_service.c) and its worker mode (bus_worker.c)                                  */

#define MAX_ROUTES 64

typedef struct {
    char type[CB_MSG_MAX_TYPE + 1];
    cb_bus_handler_fn *fn;
    void *arg;
} route_t;

struct cb_bus_req_s {
    cb_bus_service_t *svc;
    zframe_t *identity;      /* routing id of the requester */
    char user_id[CB_BUS_USER_ID_MAX + 1]; /* ZAP User-Id of its connection ("" when none) */
    bool delimiter;          /* the requester is a REQ socket: an empty frame goes back too */
    char id[CB_MSG_MAX_ID + 1];
    char type[CB_MSG_MAX_TYPE + 1];
    double t0_ms;
    int n_replies;
    cb_err_t code;           /* the last error replied, or CB_ERR_NONE */
    char error[160];         /* its message, for the log line */
    bool send_failed;
    bool detached;           /* (the handler's copy) was detached: the copy owns the outcome */
    const void *body;        /* the request's bytes, during the handler only (NULL in a detached copy) */
    size_t body_len;
    uint64_t epoch;          /* worker mode: the broker connection it came on (svc->epoch) */
    cb_bus_req_t *next, *prev; /* list of detached requests */
};

struct cb_bus_service_s {
    char name[64];
    cb_bus_opts_t o;
    zsock_t *router;
    zloop_t *loop;
    char *endpoint;
    route_t routes[MAX_ROUTES];
    int n_routes;
    cb_bus_stats_fn *stats_fn;
    void *stats_arg;
    cb_bus_health_fn *health_fn;
    void *health_arg;
    cb_diskhealth_t *disk;  /* borrowed: the data disk's state for ping (NULL: status ok) */
    cb_msg_writer_t *w;
    double t0_ms;
    uint64_t requests, errors;
    bool stop;
    cb_bus_req_t *detached; /* head of the list */
    zsock_t *mon;           /* PAIR: the ROUTER's failed handshakes, logged (rate-limited) */
    double mon_last_ms[4];  /* per kind (ZAP denied, mechanism mismatch, other, dropped): last line logged */
    int mon_quiet[4];       /* refusals not logged since */
    /* worker mode (cb_bus_worker_new): `router` is a DEALER connected to the broker, or NULL between
     * connections (Paranoid Pirate: a silent broker is dropped, reconnected after a back-off) */
    bool worker;
    cb_bus_worker_opts_t wo;
    uint64_t epoch;            /* connections made; replies to requests of an older one are refused */
    double last_heard_ms;      /* the broker's last message on this connection (or the connect) */
    double last_beat_ms;       /* our last heartbeat */
    double reconnect_at_ms;    /* while disconnected: when to connect again */
    int backoff_ms;            /* the next back-off */
    bool heard;                /* the broker spoke on this connection */
    bool announced;            /* worker_ready sent on this connection */
    uint64_t reconnects;
    cb_bus_beat_fn *beat_fn;
    void *beat_arg;
};

/* bus_service.c: the built-in `ping` and `stats` handlers, and a request's dispatch to its handler */
cb_bus_handler_fn cb_bus_builtin_ping, cb_bus_builtin_stats;
void cb_bus_dispatch(cb_bus_service_t *svc, cb_bus_req_t *reqp, zframe_t **body_p);

/* bus_worker.c: a reply through the broker, closing the broker connection, the 100 ms worker tick */
int cb_bus_worker_req_send(cb_bus_req_t *req, const void *data, size_t len);
void cb_bus_worker_drop(cb_bus_service_t *svc);
void cb_bus_worker_tick(cb_bus_service_t *svc);

#endif
