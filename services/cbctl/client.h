/* cbctl client helpers shared by the subcommands: the table of services, clients configured from the
 * "cbctl" section (timeouts, retries) and each service's endpoint, one-shot calls, a fan-out of one
 * request type to several services in parallel, and output helpers.
 */
#ifndef CBCTL_CLIENT_H
#define CBCTL_CLIENT_H

#include <stdio.h>

#include "wire/bus.h"
#include "cbctl.h"
#include "wire/msg.h"

/* The four services of the stack, in display order. */
typedef struct {
    const char *name;    /* "retriever": also its config section */
    const char *program; /* "cb-retriever" */
} cbctl_service_t;

#define CBCTL_N_SERVICES 4
extern const cbctl_service_t cbctl_services[CBCTL_N_SERVICES];

/* The service named name ("retriever", "cb-retriever", ...), or NULL. */
const cbctl_service_t *cbctl_service_find(const char *name);

/* The bus options of the cbctl section (request timeout and retries, CURVE keys), with the send timeout
 * bounded by the request timeout; timeout_ms > 0 and retries >= 0 override the configured ones. False
 * with err. */
bool cbctl_client_opts(cbctl_t *ctl, int timeout_ms, int retries, cb_bus_opts_t *o, char *err, size_t errlen);

/* A client of service `name` with cbctl's options; timeout_ms > 0 overrides cbctl.request_timeout_ms
 * (retries < 0 keeps cbctl.request_retries). Caller owns (cb_bus_client_destroy); NULL with err. */
cb_bus_client_t *cbctl_client(cbctl_t *ctl, const char *name, int timeout_ms, int retries, char *err,
                              size_t errlen);

/* One request to a service (Lazy Pirate): returns the reply (may be an error reply; caller owns) or
 * NULL with *code (timeout/unavailable/...) and err. */
cb_msg_t *cbctl_call(cbctl_t *ctl, const char *name, cb_msg_writer_t *w, cb_err_t *code, char *err,
                     size_t errlen);

/* Sends a request of `type` (no fields) to several services at once and waits for all replies until
 * one common deadline (timeout_ms). A service not connected within connect_ms (<= timeout_ms) is
 * reported unavailable; one that got the request but did not answer, timeout. results[i] is for
 * names[i]. */
typedef struct {
    const char *name;
    const char *endpoint; /* borrowed from the config */
    cb_msg_t *reply;      /* NULL when the service did not answer (owned; cbctl_results_free) */
    cb_err_t code;        /* why not (timeout, unavailable), or the reply's error code */
    char error[320];      /* with the reason when the service refused our handshake (CURVE/ZAP) */
    double latency_ms;
} cbctl_result_t;
void cbctl_fanout(cbctl_t *ctl, const char *type, const char *const *names, int n, int connect_ms, int timeout_ms,
                  cbctl_result_t *results);
void cbctl_results_free(cbctl_result_t *results, int n);

/* Parses "[--json] [SERVICE...]" (argv[0] is the command): names gets the services asked for (all four
 * when none); returns their number, or -1 after printing a usage error. */
int cbctl_parse_services(cbctl_t *ctl, int argc, char **argv, bool *json, const char **names, int max);

/* Maps a transport error to an exit code (CBCTL_EXIT_UNAVAILABLE for timeout/unavailable, else FAIL). */
int cbctl_exit_for(cb_err_t code);

/* Prints m (root or view) as one JSON line (compact) or indented; skip (NULL-terminated, may be NULL)
 * lists keys to leave out. */
void cbctl_print_json(FILE *f, const cb_msg_t *m, const char *const *skip, bool pretty);

/* Error message to stderr, prefixed "cbctl: " (unless ctl->quiet). */
void cbctl_error(const cbctl_t *ctl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
