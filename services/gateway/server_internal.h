/* server_internal.h: what the gateway's HTTP side shares between its files; not for use outside
 * services/gateway.
 *   server.c           the server's lifetime, request intake (headers, body, limits, API key) and routing;
 *   server_reply.c     the answers: JSON and error bodies, queueing, cacheblend errors as HTTP;
 *   server_chat.c      /v1/chat/completions, plain and streamed (SSE);
 *   server_handlers.c  /v1/models, /health, /metrics, /v1/documents and its jobs.
 * Here: the server and request state, and the functions one file defines for another. */
#ifndef GW_SERVER_INTERNAL_H
#define GW_SERVER_INTERNAL_H

#include "server.h"

#include <jansson.h>
#include <microhttpd.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "admit.h"
#include "keyguard.h"
#include "metrics.h"

enum { SVC_RETRIEVER, SVC_CACHEINDEX, SVC_PRECOMPUTE, SVC_BLEND };

struct gw_server {
    gw_server_opts_t o;
    char listen[256], api_key[256];
    struct MHD_Daemon *daemon;
    gw_admit_t *admit;
    gw_keyguard_t *keyguard;
    gw_metrics_t *metrics;
    atomic_bool stopping;
    atomic_int jobs;          /* requests being answered by their own thread */
    int port;
};

/* A request's answer, made by a job thread (the connection suspended meanwhile) or on libmicrohttpd's
 * thread, and queued by gw_server_deliver(). */
typedef enum { JOB_NONE, JOB_RUNNING, JOB_DONE } job_state_t;

typedef struct sse sse_t;
typedef struct req req_t;
typedef enum MHD_Result (*handler_fn)(gw_server_t *s, req_t *r);

/* One HTTP request's state (MHD's per-request pointer), from its request line to its completion. */
struct req {
    gw_server_t *s;
    struct MHD_Connection *mc;
    void *conn;           /* the connection's admission record (gw_admit hooks) */
    const char *handler;  /* metrics label, set when routed */
    char *url;            /* the path (copied: a job reads it) */
    char *body;           /* the request body [len] (cap bytes allocated), NUL-terminated */
    size_t len, cap;
    bool started;         /* the headers are in (first access-handler call done) */
    bool too_large;       /* the body went past max_body_bytes: 413 at the end */
    bool answered;        /* a response was queued (or a job started) */
    double t0;            /* arrival (cb_now_ms) */
    int fd;               /* the connection's socket */
    atomic_int watch_fd;  /* fd while a job waits (the connection is suspended), for gw_stream */
    uint8_t key[16];      /* client address (gw_addr_key) */
    char client[64];      /* "gw:" + address (logs; the ingest client is gw_ingest_client) */
    /* the answer */
    handler_fn fn;        /* the job's handler */
    job_state_t job;
    struct MHD_Response *resp;
    int status;
    sse_t *pump;          /* a streamed answer: the job thread goes on feeding it after the response is queued */
};

/* How a cacheblend error code reads over HTTP. */
typedef struct {
    int status;
    const char *type, *code;
    gw_outcome_t outcome;
} http_err_t;


/* server_reply.c: each handler sets r's answer; gw_server_deliver() queues it. */
void gw_server_set_reply(req_t *r, int status, struct MHD_Response *resp);
/* Returns MHD_NO (the connection is closed, nothing is answered) when out of memory. */
enum MHD_Result gw_server_send_buf(gw_server_t *s, req_t *r, int status, const char *type, char *buf, size_t len,
                         bool must_free);
/* Sends j (its reference is taken) as the JSON body. */
enum MHD_Result gw_server_send_json(gw_server_t *s, req_t *r, int status, json_t *j);
enum MHD_Result gw_server_send_error(gw_server_t *s, req_t *r, int status, const char *type, const char *param,
                           const char *code, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
/* Adds a header to the answer set (if any). */
void gw_server_reply_header(req_t *r, const char *name, const char *value);
/* Queues r's answer (on libmicrohttpd's thread); MHD_NO closes the connection. */
enum MHD_Result gw_server_deliver(gw_server_t *s, struct MHD_Connection *c, req_t *r);
/* How a cacheblend error code reads over HTTP. */
http_err_t gw_server_map_err(cb_err_t e);

/* server_chat.c */
enum MHD_Result gw_server_chat(gw_server_t *s, req_t *r);
/* The job thread's side of a streamed answer, after the response is queued: reads cb-blend to the end. */
void gw_server_sse_pump(sse_t *x);

/* server_handlers.c */
enum MHD_Result gw_server_models(gw_server_t *s, req_t *r);
enum MHD_Result gw_server_health(gw_server_t *s, req_t *r);
enum MHD_Result gw_server_metrics(gw_server_t *s, req_t *r);
enum MHD_Result gw_server_documents(gw_server_t *s, req_t *r);
enum MHD_Result gw_server_job_status(gw_server_t *s, req_t *r);

#endif
