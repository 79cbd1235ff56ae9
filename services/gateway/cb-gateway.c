/* cb-gateway: the stack's HTTP face. An OpenAI-compatible chat-completions API, document ingest, health,
 * Prometheus metrics and a web page, served over HTTP/1.1 (libmicrohttpd) and answered by the other
 * services over the same ZeroMQ protocol as cbctl. It holds no model and no state beyond its counters.
 *
 * Configuration: section `gateway` (config/cacheblend.cfg; docs/gateway.md), the services' endpoints
 * from their sections. Stops cleanly on SIGINT/SIGTERM.
 */
#include <czmq.h>
#include <stdio.h>
#include <string.h>

#include "base/log.h"
#include "server.h"
#include "wire/bus.h"
#include "wire/config.h"

#define SECTION "gateway"

static void usage(FILE *f) {
    fprintf(f, "usage: cb-gateway [--config PATH] [--gateway.KEY=VALUE | --KEY VALUE]...\n"
               "  Serves HTTP on gateway.listen (default 127.0.0.1:8000): POST /v1/chat/completions, GET /v1/models,\n"
               "  POST /v1/documents, GET /v1/documents/jobs/ID, GET /health, GET /metrics, GET / (docs/gateway.md).\n"
               "  Keys: listen, api_key, max_body_bytes, max_connections, max_connections_per_ip, max_requests,\n"
               "  http_threads, max_headers, header_bytes, idle_timeout_s, request_timeout_s, auth_fail_limit,\n"
               "  auth_fail_window_s, auth_lockout_s, first_timeout_ms, query_timeout_ms, health_timeout_ms, and\n"
               "  common.* (request_timeout_ms, ...).\n"
               "  The services are reached at retriever/cacheindex/precompute/blend.endpoint.\n"
               "  Environment CB_GATEWAY_<KEY> overrides the file.\n");
}

int main(int argc, char **argv) {
    cb_bus_init("cb-gateway");
    int exit_code;
    cb_config_t *cfg = cb_bus_service_config(SECTION, &argc, argv, usage, &exit_code);
    if (!cfg) return exit_code;
    char err[1024];
    gw_server_opts_t o = {0};
    int64_t body, conns, per_ip, reqs, threads, headers, hbytes, idle, req_s, fails, window, lockout, first, total,
        health;
    static const char *const defaults[4] = {"tcp://127.0.0.1:5551", "tcp://127.0.0.1:5552", "tcp://127.0.0.1:5553",
                                            "tcp://127.0.0.1:5555"};
    static const char *const sections[4] = {"retriever", "cacheindex", "precompute", "blend"};
    bool ok = cb_config_str(cfg, SECTION, "listen", "127.0.0.1:8000", &o.listen, err, sizeof err) &&
              cb_config_str(cfg, SECTION, "api_key", "", &o.api_key, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "max_body_bytes", 1024, 1LL << 30, 8 << 20, &body, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "max_connections", 1, 1 << 20, 4096, &conns, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "max_connections_per_ip", 0, 1 << 20, 64, &per_ip, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "max_requests", 1, 1024, 256, &reqs, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "http_threads", 1, 64, 2, &threads, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "max_headers", 1, 10000, 100, &headers, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "header_bytes", 4096, 1 << 24, 64 << 10, &hbytes, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "idle_timeout_s", 1, 86400, 60, &idle, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "request_timeout_s", 1, 3600, 30, &req_s, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "auth_fail_limit", 0, 1000, 10, &fails, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "auth_fail_window_s", 1, 86400, 60, &window, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "auth_lockout_s", 1, 86400, 60, &lockout, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "first_timeout_ms", 100, 3600000, 10000, &first, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "query_timeout_ms", 100, 86400000, 300000, &total, err, sizeof err) &&
              cb_config_int(cfg, SECTION, "health_timeout_ms", 10, 600000, 1000, &health, err, sizeof err) &&
              cb_bus_opts_from_config(cfg, SECTION, &o.bus, err, sizeof err);
    for (int i = 0; ok && i < 4; i++) {
        ok = cb_config_endpoint(cfg, sections[i], "endpoint", defaults[i], &o.endpoints[i], err, sizeof err);
    }
    if (!ok) {
        cb_log(CB_LOG_ERROR, NULL, "config: %s", err);
        cb_config_destroy(&cfg);
        return 1;
    }
    o.max_body_bytes = (size_t)body;
    o.max_connections = (unsigned)conns;
    o.max_connections_per_ip = (unsigned)per_ip;
    o.max_requests = (unsigned)reqs;
    o.http_threads = (unsigned)threads;
    o.request_timeout_s = (unsigned)req_s;
    o.auth_fail_limit = (unsigned)fails;
    o.auth_fail_window_s = (unsigned)window;
    o.auth_lockout_s = (unsigned)lockout;
    o.max_headers = (unsigned)headers;
    o.header_bytes = (size_t)hbytes;
    o.idle_timeout_s = (unsigned)idle;
    o.first_ms = (int)first;
    o.query_timeout_ms = (int)total;
    o.health_timeout_ms = (int)health;
    cb_config_log(cfg, SECTION);
    gw_server_t *srv = gw_server_new(&o, err, sizeof err);
    if (!srv) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        cb_config_destroy(&cfg);
        return 1;
    }
    cb_log(CB_LOG_INFO, NULL, "listening on %s (port %d)%s; cb-blend at %s, cb-precompute at %s", o.listen,
           gw_server_port(srv), o.api_key[0] ? ", API key required on /v1/" : "", o.endpoints[3], o.endpoints[2]);
    if (o.api_key[0] == 0 && strncmp(o.listen, "127.", 4) && strncmp(o.listen, "localhost:", 10) &&
        strncmp(o.listen, "[::1]:", 6))
        cb_log(CB_LOG_WARN, NULL, "gateway.listen = %s is not a loopback address and no gateway.api_key is set: anyone "
               "who reaches it can query and ingest", o.listen);
    while (!zsys_interrupted) zclock_sleep(100);
    cb_log(CB_LOG_INFO, NULL, "stopping");
    gw_server_destroy(&srv);
    cb_config_destroy(&cfg);
    return 0;
}
