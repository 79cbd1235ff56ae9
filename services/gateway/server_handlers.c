/* server_handlers.c: the gateway's other routes: /v1/models and /health (a ping to the services),
 * /metrics (the gateway's own and the services' stats), /v1/documents (each document an ingest to
 * cb-precompute) and /v1/documents/jobs/<job>. Part of the HTTP side (server_internal.h). */
#include "server_internal.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "openai.h"

static const char *const SERVICE_NAMES[4] = {"retriever", "cacheindex", "precompute", "blend"};

#define MAX_INGEST_DOCS 1000

/* ---------------------------------------------------------------------------------------------- */
/* Models, health, metrics                                                                         */

static void fanout(gw_server_t *s, const char *type, const int *which, int n, cb_bus_result_t *res) {
    const char *eps[4];
    for (int i = 0; i < n; i++) eps[i] = s->o.endpoints[which[i]];
    cb_bus_fanout(&s->o.bus, type, eps, n, s->o.health_timeout_ms, s->o.health_timeout_ms, res);
}

enum MHD_Result gw_server_models(gw_server_t *s, req_t *r) {
    cb_bus_result_t res[1];
    int which[1] = {SVC_BLEND};
    fanout(s, "ping", which, 1, res);
    enum MHD_Result rc;
    char name[512] = "", fp[80] = "";
    if (res[0].reply && cb_msg_str_copy(res[0].reply, "model", 500, name, sizeof name) && name[0]) {
        cb_msg_str_copy(res[0].reply, "model_fingerprint", 70, fp, sizeof fp);
        json_t *m = json_pack("{s:s, s:s, s:i, s:s, s:s}", "id", name, "object", "model", "created", 0, "owned_by",
                              "cacheblend", "fingerprint", fp);
        rc = gw_server_send_json(s, r, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", m));
    } else {
        rc = gw_server_send_error(s, r, 503, "service_unavailable", NULL, "unavailable", "cb-blend does not answer: %s",
                        res[0].reply ? cb_msg_err_message(res[0].reply) : res[0].error);
    }
    cb_bus_results_free(res, 1);
    return rc;
}

enum MHD_Result gw_server_health(gw_server_t *s, req_t *r) {
    cb_bus_result_t res[4];
    int which[4] = {0, 1, 2, 3};
    fanout(s, "ping", which, 4, res);
    json_t *svcs = json_object(), *down = json_array(), *degraded = json_array();
    for (int i = 0; i < 4; i++) {
        bool ok = res[i].reply && cb_msg_ok(res[i].reply);
        /* a service that answers may be degraded (its data disk is full): its ping's status and reason */
        char st[16] = "ok";
        const char *why = NULL;
        size_t why_len = 0;
        if (ok) {
            cb_msg_str_copy(res[i].reply, "status", sizeof st - 1, st, sizeof st);
            if (!cb_msg_str(res[i].reply, "reason", 8192, &why, &why_len)) why = NULL;
        }
        bool bad = ok && !strcmp(st, "degraded");
        json_t *e = json_pack("{s:s, s:s}", "status", !ok ? "down" : bad ? "degraded" : "ok", "endpoint",
                              s->o.endpoints[i]);
        if (ok) json_object_set_new(e, "latency_ms", json_real(res[i].latency_ms));
        else {
            json_object_set_new(e, "error", json_string(res[i].reply ? cb_msg_err_message(res[i].reply) : res[i].error));
            json_array_append_new(down, json_string(SERVICE_NAMES[i]));
        }
        if (bad) {
            json_object_set_new(e, "reason", why ? json_stringn(why, why_len) : json_string("degraded"));
            json_array_append_new(degraded, json_string(SERVICE_NAMES[i]));
        }
        int64_t free_bytes;
        if (ok && cb_msg_int(res[i].reply, "disk_free_bytes", 0, INT64_MAX, &free_bytes))
            json_object_set_new(e, "disk_free_bytes", json_integer((json_int_t)free_bytes));
        json_object_set_new(svcs, SERVICE_NAMES[i], e);
    }
    cb_bus_results_free(res, 4);
    /* 503 only when a service does not answer; degraded (every service answers, one or more with a full data
     * disk) is 200 with status "degraded": the gateway still serves, an operator must make room */
    bool all = json_array_size(down) == 0;
    const char *status = !all ? "unavailable" : json_array_size(degraded) ? "degraded" : "ok";
    json_t *j = json_pack("{s:s, s:o, s:o, s:o}", "status", status, "services", svcs, "down", down, "degraded",
                          degraded);
    return gw_server_send_json(s, r, all ? 200 : 503, j);
}

enum MHD_Result gw_server_metrics(gw_server_t *s, req_t *r) {
    cb_bus_result_t res[4];
    int which[4] = {0, 1, 2, 3};
    fanout(s, "stats", which, 4, res);
    size_t len;
    char *text = gw_metrics_render(s->metrics, SERVICE_NAMES, res, 4, &len);
    cb_bus_results_free(res, 4);
    if (!text) return gw_server_send_error(s, r, 500, "server_error", NULL, "internal", "out of memory");
    return gw_server_send_buf(s, r, 200, "text/plain; version=0.0.4; charset=utf-8", text, len, true);
}

/* ---------------------------------------------------------------------------------------------- */
/* Documents                                                                                       */

static cb_bus_client_t *precompute_client(gw_server_t *s, char *err, size_t errlen) {
    return cb_bus_client_new(s->o.endpoints[SVC_PRECOMPUTE], &s->o.bus, err, errlen);
}

enum MHD_Result gw_server_documents(gw_server_t *s, req_t *r) {
    json_error_t je;
    json_t *root = json_loadb(r->body ? r->body : "", r->len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return gw_server_send_error(s, r, 400, "invalid_request_error", NULL, "invalid_json",
                                    "the body is not valid JSON: %s", je.text);
    json_t *docs = json_object_get(root, "documents");
    size_t n = json_is_array(docs) ? json_array_size(docs) : 0;
    const char *why = NULL;
    if (!json_is_object(root) || !json_is_array(docs) || n == 0) why = "'documents' must be a non-empty array";
    else if (n > MAX_INGEST_DOCS) why = "at most 1000 documents per request";
    for (size_t i = 0; !why && i < n; i++) {
        json_t *d = json_array_get(docs, i), *id = json_object_get(d, "id"), *text = json_object_get(d, "text");
        json_t *meta = json_object_get(d, "meta");
        if (!json_is_object(d) || !json_is_string(id) || json_string_length(id) == 0 || json_string_length(id) > 256)
            why = "every document needs an 'id' string of 1 to 256 bytes";
        else if (!json_is_string(text) || json_string_length(text) == 0)
            why = "every document needs a non-empty 'text' string";
        else if (meta && !json_is_null(meta) && !json_is_object(meta))
            why = "a document's 'meta' must be an object";
    }
    if (why) {
        json_decref(root);
        return gw_server_send_error(s, r, 400, "invalid_request_error", "documents", "invalid_value", "%s", why);
    }
    char err[512], who[GW_INGEST_CLIENT_MAX];
    gw_ingest_client(s->api_key, r->client + 3, who, sizeof who); /* r->client: "gw:" + address */
    cb_bus_client_t *pc = precompute_client(s, err, sizeof err);
    cb_msg_writer_t *w = cb_msg_writer_new();
    json_t *data = json_array();
    enum MHD_Result rc = MHD_YES;
    bool failed = !pc || !w;
    if (failed) rc = gw_server_send_error(s, r, 500, "server_error", NULL, "internal", "%s",
                                          pc ? "out of memory" : err);
    for (size_t i = 0; !failed && i < n; i++) {
        if (atomic_load(&s->stopping)) { /* each document can take a send timeout: stop between them */
            failed = true;
            json_t *e = gw_error_json("the gateway is shutting down", "service_unavailable", "documents", "unavailable");
            json_object_set_new(json_object_get(e, "error"), "index", json_integer((json_int_t)i));
            json_object_set(e, "data", data);
            rc = gw_server_send_json(s, r, 503, e);
            break;
        }
        json_t *d = json_array_get(docs, i), *meta = json_object_get(d, "meta");
        char id[32];
        cb_bus_new_id(id, sizeof id);
        cb_msg_begin(w, "ingest", id);
        cb_msg_put_str(w, "doc_id", json_string_value(json_object_get(d, "id")));
        cb_msg_put_strn(w, "text", json_string_value(json_object_get(d, "text")),
                        json_string_length(json_object_get(d, "text")));
        if (json_is_object(meta)) cb_msg_put_json(w, "meta", meta);
        cb_msg_put_str(w, "on_behalf_of", who); /* hashed API key or address (docs/gateway.md) */
        cb_err_t code;
        cb_msg_t *m = cb_bus_call_ok(pc, w, &code, err, sizeof err);
        const char *job;
        size_t jl;
        bool dup = false, restored = false;
        if (m && cb_msg_str(m, "job", 64, &job, &jl)) {
            cb_msg_bool_or(m, "duplicate", false, &dup);
            cb_msg_bool_or(m, "restored", false, &restored);
            json_array_append_new(data, json_pack("{s:O, s:s%, s:b, s:b}", "id", json_object_get(d, "id"), "job", job,
                                                  jl, "duplicate", dup, "restored", restored));
        } else {
            failed = true;
            http_err_t he = gw_server_map_err(m ? CB_ERR_INTERNAL : code);
            if (code == CB_ERR_TOO_LARGE) he.status = 413;
            json_t *e = gw_error_json(m ? "cb-precompute sent an invalid reply" : err, he.type, "documents", he.code);
            json_object_set_new(json_object_get(e, "error"), "index", json_integer((json_int_t)i));
            json_object_set(e, "data", data); /* the documents acknowledged before this one */
            rc = gw_server_send_json(s, r, he.status, e);
        }
        cb_msg_destroy(&m);
    }
    if (!failed) {
        cb_log(CB_LOG_INFO, NULL, "ingest: %zu documents acknowledged", n);
        rc = gw_server_send_json(s, r, 200, json_pack("{s:s, s:O}", "object", "list", "data", data));
    }
    json_decref(data);
    json_decref(root);
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&pc);
    return rc;
}

enum MHD_Result gw_server_job_status(gw_server_t *s, req_t *r) {
    const char *job = r->url + 19; /* after "/v1/documents/jobs/" */
    size_t jl = strlen(job);
    bool valid = jl > 0 && jl <= 64;
    for (size_t i = 0; valid && i < jl; i++) valid = (job[i] >= '0' && job[i] <= '9') || (job[i] >= 'a' && job[i] <= 'f');
    if (!valid) return gw_server_send_error(s, r, 404, "invalid_request_error", "job", "not_found", "no such job");
    char err[512];
    cb_bus_client_t *pc = precompute_client(s, err, sizeof err);
    cb_msg_writer_t *w = cb_msg_writer_new();
    if (!pc || !w) {
        cb_msg_writer_destroy(&w);
        cb_bus_client_destroy(&pc);
        return gw_server_send_error(s, r, 500, "server_error", NULL, "internal", "%s", pc ? "out of memory" : err);
    }
    char id[32];
    cb_bus_new_id(id, sizeof id);
    cb_msg_begin(w, "status", id);
    cb_msg_put_str(w, "job", job);
    cb_err_t code;
    cb_msg_t *m = cb_bus_call_ok(pc, w, &code, err, sizeof err);
    enum MHD_Result rc;
    if (m) {
        json_t *j = cb_msg_to_json(m);
        const char *skip[] = {"v", "type", "id", "ok"};
        for (size_t i = 0; i < sizeof skip / sizeof skip[0]; i++) json_object_del(j, skip[i]);
        json_object_set_new(j, "id", json_string(job));
        json_object_set_new(j, "object", json_string("ingest.job"));
        rc = gw_server_send_json(s, r, 200, j);
    } else {
        http_err_t he = gw_server_map_err(code);
        rc = gw_server_send_error(s, r, he.status, he.type, code == CB_ERR_NOT_FOUND ? "job" : NULL, he.code, "%s",
                                  err);
    }
    cb_msg_destroy(&m);
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&pc);
    return rc;
}
