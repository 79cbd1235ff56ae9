/* server_reply.c: the gateway's answers: a request's response set (JSON, OpenAI-style errors, raw bytes),
 * queued on libmicrohttpd's thread, and how a cacheblend error code reads over HTTP. Part of the HTTP
 * side (server_internal.h). */
#include "server_internal.h"
#include "base/alloc.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "openai.h"

/* ---------------------------------------------------------------------------------------------- */
/* Responses: each handler sets r's answer; gw_server_deliver() queues it                                    */

void gw_server_set_reply(req_t *r, int status, struct MHD_Response *resp) {
    if (r->resp) MHD_destroy_response(r->resp);
    r->resp = resp;
    r->status = status;
}

/* Returns MHD_NO (the connection is closed, nothing is answered) when out of memory. */
enum MHD_Result gw_server_send_buf(gw_server_t *s, req_t *r, int status, const char *type, char *buf, size_t len,
                                bool must_free) {
    (void)s;
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, buf, must_free ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!resp) {
        if (must_free) free(buf);
        gw_server_set_reply(r, 0, NULL);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (status == MHD_HTTP_UNAUTHORIZED) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    gw_server_set_reply(r, status, resp);
    return MHD_YES;
}

/* Sends j (its reference is taken) as the JSON body. */
enum MHD_Result gw_server_send_json(gw_server_t *s, req_t *r, int status, json_t *j) {
    char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!text) {
        static char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}";
        return gw_server_send_buf(s, r, 500, "application/json", oom, sizeof oom - 1, false);
    }
    return gw_server_send_buf(s, r, status, "application/json", text, strlen(text), true);
}

enum MHD_Result gw_server_send_error(gw_server_t *s, req_t *r, int status, const char *type, const char *param,
                                  const char *code, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return gw_server_send_json(s, r, status, gw_error_json(msg, type, param, code));
}

/* Adds a header to the answer set (if any). */
void gw_server_reply_header(req_t *r, const char *name, const char *value) {
    if (r->resp) MHD_add_response_header(r->resp, name, value);
}

/* Queues r's answer (on libmicrohttpd's thread); MHD_NO closes the connection (no answer: the client went
 * away, or out of memory). */
enum MHD_Result gw_server_deliver(gw_server_t *s, struct MHD_Connection *c, req_t *r) {
    r->answered = true;
    gw_admit_conn_answering(s->admit, r->conn);
    struct MHD_Response *resp = r->resp;
    r->resp = NULL;
    if (!resp) return MHD_NO;
    enum MHD_Result rc = MHD_queue_response(c, (unsigned)r->status, resp);
    MHD_destroy_response(resp);
    gw_metrics_http(s->metrics, r->handler, r->status);
    return rc;
}

http_err_t gw_server_map_err(cb_err_t e) {
    switch (e) {
    case CB_ERR_BAD_REQUEST:
    case CB_ERR_UNKNOWN_TYPE: return (http_err_t){400, "invalid_request_error", "bad_request", GW_OUT_BAD_REQUEST};
    case CB_ERR_TOO_LARGE:
        return (http_err_t){400, "invalid_request_error", "context_length_exceeded", GW_OUT_TOO_LARGE};
    case CB_ERR_NOT_FOUND: return (http_err_t){404, "invalid_request_error", "not_found", GW_OUT_BAD_REQUEST};
    case CB_ERR_UNAVAILABLE: return (http_err_t){503, "service_unavailable", "unavailable", GW_OUT_UNAVAILABLE};
    case CB_ERR_OVERLOADED: return (http_err_t){503, "service_unavailable", "overloaded", GW_OUT_OVERLOADED};
    case CB_ERR_TIMEOUT: return (http_err_t){504, "timeout", "timeout", GW_OUT_TIMEOUT};
    default: return (http_err_t){500, "server_error", "internal", GW_OUT_ERROR};
    }
}
