/* test_curve: CURVE and ZAP on the bus (wire/curve, wire/bus): key sets made by cb_curve_keys_init
 * (idempotent, 0600 secrets, bad files refused), then a CURVE service in a thread (zactor) and its
 * clients in-process: a listed key is served; an unlisted key, a wrong server key, a plaintext client,
 * a CURVE client of a plaintext service are refused with a clear reason long before the Lazy Pirate
 * timeouts would end (request, stream send, fan-out). The ZAP User-Id a service reads for a request (and
 * for a PULL message) is the client's public key, and empty in plaintext. */
#include <czmq.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/clock.h"
#include "wire/bus.h"
#include "wire/curve.h"
#include "test.h"

static char s_tmp[256], s_keys[300], s_keys2[300], s_keys3[300];
static char s_ep[256], s_plain_ep[256];

/* Request/send timeouts far above the refusal bound the tests check. */
#define SLOW_MS 3000
#define REFUSAL_BOUND_MS 1500.0

static void h_echo(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    (void)arg;
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_str(w, "text", "hello");
    cb_msg_put_str(w, "user_id", cb_bus_req_user_id(req));
    cb_bus_reply(req, w);
}

static int on_pipe(zloop_t *loop, zsock_t *pipe, void *arg) {
    (void)loop, (void)arg;
    char *cmd = zstr_recv(pipe);
    int stop = !cmd || strcmp(cmd, "$TERM") == 0;
    zstr_free(&cmd);
    return stop ? -1 : 0;
}

/* A service with the given options (a cb_bus_opts_t *) on a loopback port; sends its endpoint. */
static void service_actor(zsock_t *pipe, void *args) {
    char err[1024];
    cb_bus_service_t *svc = cb_bus_service_new("cb-test", "tcp://127.0.0.1:*", args, err, sizeof err);
    if (!svc) {
        fprintf(stderr, "service: %s\n", err);
        zsock_signal(pipe, 1);
        return;
    }
    cb_bus_service_on(svc, "echo", h_echo, NULL);
    zloop_reader(cb_bus_service_loop(svc), pipe, on_pipe, NULL);
    zsock_signal(pipe, 0);
    zstr_send(pipe, cb_bus_service_endpoint(svc));
    cb_bus_service_run(svc);
    cb_bus_service_destroy(&svc);
}

static zactor_t *start_service(cb_bus_opts_t *o, char *ep, size_t epsz) {
    zactor_t *a = zactor_new(service_actor, o);
    char *e = a ? zstr_recv(a) : NULL;
    snprintf(ep, epsz, "%s", e ? e : "");
    zstr_free(&e);
    return a;
}

/* CURVE options of `identity` from a configuration with curve on and keys_dir (NULL: curve off). */
static bool opts_for(const char *keys, const char *identity, cb_bus_opts_t *o, char *err, size_t errlen) {
    char e[1024];
    cb_config_t *cfg = cb_config_load(NULL, identity, e, sizeof e);
    if (!cfg) return false;
    if (keys) {
        cb_config_set(cfg, "common", "curve", "on");
        cb_config_set(cfg, "common", "keys_dir", keys);
    }
    bool ok = cb_bus_opts_from_config(cfg, identity, o, err, errlen);
    cb_config_destroy(&cfg);
    o->request_timeout_ms = SLOW_MS;
    o->request_retries = 2;
    o->send_timeout_ms = SLOW_MS;
    return ok;
}

/* A client of the test service as `identity` of keys (NULL: plaintext), knowing blend's key for ep. */
static cb_bus_client_t *client_for(const char *keys, const char *identity, const char *ep, cb_bus_opts_t *o) {
    char err[1024];
    if (!opts_for(keys, identity, o, err, sizeof err)) {
        fprintf(stderr, "  opts: %s\n", err);
        return NULL;
    }
    if (keys && !cb_curve_add_peer(&o->curve, ep, "blend", err, sizeof err)) {
        fprintf(stderr, "  peer: %s\n", err);
        return NULL;
    }
    return cb_bus_client_new(ep, o, err, sizeof err);
}

/* One echo request; the reply (caller destroys) or NULL with code/err and the time it took. */
static cb_msg_t *echo(cb_bus_client_t *c, cb_err_t *code, char *err, size_t errlen, double *ms) {
    cb_msg_writer_t *w = cb_msg_writer_new();
    char id[32];
    cb_msg_begin(w, "echo", cb_bus_new_id(id, sizeof id));
    double t0 = cb_now_ms();
    cb_msg_t *m = cb_bus_call(c, w, code, err, errlen);
    *ms = cb_now_ms() - t0;
    cb_msg_writer_destroy(&w);
    return m;
}

static int copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = a ? fopen(to, "wb") : NULL;
    char buf[4096];
    size_t n;
    int rc = a && b ? 0 : -1;
    while (rc == 0 && (n = fread(buf, 1, sizeof buf, a)) > 0) rc = fwrite(buf, 1, n, b) == n ? 0 : -1;
    if (a) fclose(a);
    if (b && fclose(b) != 0) rc = -1;
    return rc;
}

static int write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fputs(text, f);
    return fclose(f);
}

/* ---------------------------------------------------------------------------------------------- */

TEST(keys_init) {
    char err[1024], path[1024];
    CHECK_MSG(cb_curve_keys_init(s_keys, false, err, sizeof err) == 1, "%s", err);
    CHECK(cb_curve_keys_init(s_keys, false, err, sizeof err) == 0); /* complete: left alone */
    struct stat st;
    for (int i = 0; i < CB_CURVE_N_SERVICES; i++) {
        CHECK(cb_curve_path(path, sizeof path, s_keys, CB_CURVE_SERVER, cb_curve_services[i]));
        CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600);
        CHECK(cb_curve_path(path, sizeof path, s_keys, CB_CURVE_PUBLIC, cb_curve_services[i]));
        CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0644);
    }
    char pub[CB_CURVE_TXT], sec[CB_CURVE_TXT], pub2[CB_CURVE_TXT];
    for (int i = 0; i < CB_CURVE_N_CLIENTS; i++) {
        CHECK(cb_curve_path(path, sizeof path, s_keys, CB_CURVE_CLIENT, cb_curve_clients[i]));
        CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600);
        CHECK_MSG(cb_curve_read(path, pub, sec, err, sizeof err), "%s", err);
        CHECK(strlen(pub) == 40 && strlen(sec) == 40);
        CHECK(cb_curve_path(path, sizeof path, s_keys, CB_CURVE_ALLOWED, cb_curve_clients[i]));
        CHECK(cb_curve_read(path, pub2, NULL, err, sizeof err) && strcmp(pub, pub2) == 0);
        CHECK(!cb_curve_read(path, pub2, sec, err, sizeof err) && strstr(err, "no secret key")); /* public only */
    }
    snprintf(path, sizeof path, "%s/server/blend.key_secret", s_keys);
    CHECK(stat(path, &st) == 0);
    /* a partial set is refused without --force; --force makes a new one */
    snprintf(path, sizeof path, "%s/partial", s_tmp);
    CHECK(cb_curve_keys_init(path, false, err, sizeof err) == 1);
    char victim[1100];
    snprintf(victim, sizeof victim, "%s/allowed/gateway.key", path);
    CHECK(unlink(victim) == 0);
    CHECK(cb_curve_keys_init(path, false, err, sizeof err) == -1 && strstr(err, "incomplete") && strstr(err, "--force"));
    CHECK(cb_curve_keys_init(path, true, err, sizeof err) == 1 && access(victim, R_OK) == 0);
    /* files that are not keys */
    snprintf(victim, sizeof victim, "%s/junk.key", s_tmp);
    CHECK(write_file(victim, "not a key\n") == 0);
    CHECK(!cb_curve_read(victim, pub, NULL, err, sizeof err) && strstr(err, "not a CURVE key file"));
    snprintf(victim, sizeof victim, "%s/missing.key", s_tmp);
    CHECK(!cb_curve_read(victim, pub, NULL, err, sizeof err) && strstr(err, "cannot read") && strstr(err, victim));
    CHECK(cb_curve_keys_init(s_keys2, false, err, sizeof err) == 1);
    CHECK(cb_curve_keys_init(s_keys3, false, err, sizeof err) == 1);
}

TEST(config_errors) {
    char err[1024];
    cb_bus_opts_t o;
    char nowhere[400];
    snprintf(nowhere, sizeof nowhere, "%s/no-keys-here", s_tmp);
    CHECK(!opts_for(nowhere, "cbctl", &o, err, sizeof err));
    CHECK_MSG(strstr(err, "client/cbctl.key_secret") && strstr(err, "cbctl keys init"), "%s", err);
    CHECK(!opts_for(s_keys, "nobody", &o, err, sizeof err) && strstr(err, "client/nobody.key_secret"));
    CHECK_MSG(opts_for(s_keys, "blend", &o, err, sizeof err), "%s", err);
    CHECK(o.curve.on && !strcmp(o.curve.service, "blend") && o.curve.n_peers == 5);
    CHECK(cb_curve_peer(&o.curve, "tcp://127.0.0.1:5551") && !strcmp(cb_curve_peer(&o.curve, "tcp://127.0.0.1:5551")->name, "retriever"));
    CHECK(opts_for(NULL, "cbctl", &o, err, sizeof err) && !o.curve.on);
    /* a client cannot serve, and needs the server's key */
    CHECK(opts_for(s_keys, "cbctl", &o, err, sizeof err));
    zsock_t *s = cb_bus_socket(ZMQ_ROUTER, "tcp://127.0.0.1:*", true, &o, err, sizeof err);
    CHECK_MSG(!s && strstr(err, "no server key"), "%s", err);
    s = cb_bus_socket(ZMQ_DEALER, "tcp://127.0.0.1:1", false, &o, err, sizeof err);
    CHECK_MSG(!s && strstr(err, "no server key for tcp://127.0.0.1:1"), "%s", err);
    CHECK(cb_curve_endpoint_public("tcp://*:5551") && cb_curve_endpoint_public("tcp://0.0.0.0:1") &&
          cb_curve_endpoint_public("tcp://10.1.2.3:1") && cb_curve_endpoint_public("tcp://blend:5555"));
    CHECK(!cb_curve_endpoint_public("tcp://127.0.0.1:5551") && !cb_curve_endpoint_public("tcp://localhost:1") &&
          !cb_curve_endpoint_public("tcp://[::1]:1") && !cb_curve_endpoint_public("ipc:///tmp/x") &&
          !cb_curve_endpoint_public("inproc://x"));
}

/* Runs before any CURVE server of this process exists (the ZAP handler starts once). */
TEST(allowed_list_checked) {
    char err[1024], dir[400], path[1100], from[1100];
    snprintf(dir, sizeof dir, "%s/dup", s_tmp);
    CHECK(cb_curve_keys_init(dir, false, err, sizeof err) == 1);
    snprintf(from, sizeof from, "%s/allowed/cbctl.key", dir);
    snprintf(path, sizeof path, "%s/allowed/laptop.key", dir);
    CHECK(copy_file(from, path) == 0); /* the same key twice: CZMQ's store would abort on it */
    CHECK(!cb_curve_zap_start(dir, err, sizeof err));
    CHECK_MSG(strstr(err, "repeats the key"), "%s", err);
    CHECK(unlink(path) == 0 && write_file(path, "curve\n    public-key = \"short\"\n") == 0);
    CHECK(!cb_curve_zap_start(dir, err, sizeof err) && strstr(err, "laptop.key"));
    snprintf(path, sizeof path, "%s/empty", s_tmp);
    CHECK(mkdir(path, 0755) == 0);
    snprintf(from, sizeof from, "%s/empty/allowed", s_tmp);
    CHECK(mkdir(from, 0755) == 0);
    CHECK(!cb_curve_zap_start(path, err, sizeof err) && strstr(err, "no client keys"));
}

TEST(listed_client_served) {
    cb_bus_opts_t o;
    cb_bus_client_t *c = client_for(s_keys, "cbctl", s_ep, &o);
    CHECK(c);
    cb_err_t code;
    char err[1024];
    double ms;
    cb_msg_t *m = echo(c, &code, err, sizeof err, &ms);
    CHECK_MSG(m && cb_msg_ok(m), "%s", err);
    cb_msg_destroy(&m);
    m = echo(c, &code, err, sizeof err, &ms); /* the same connection again */
    CHECK(m && cb_msg_ok(m));
    cb_msg_destroy(&m);
    cb_bus_client_destroy(&c);
    /* the gateway's identity too */
    c = client_for(s_keys, "gateway", s_ep, &o);
    CHECK(c);
    m = echo(c, &code, err, sizeof err, &ms);
    CHECK_MSG(m && cb_msg_ok(m), "%s", err);
    cb_msg_destroy(&m);
    cb_bus_client_destroy(&c);
}

TEST(unlisted_client_refused) {
    /* keys3: its own client keys, but the real service's public key (so only ZAP can refuse it) */
    char err[1024], from[1100], to[1100];
    snprintf(from, sizeof from, "%s/public/blend.key", s_keys);
    snprintf(to, sizeof to, "%s/public/blend.key", s_keys3);
    CHECK(copy_file(from, to) == 0);
    cb_bus_opts_t o;
    cb_bus_client_t *c = client_for(s_keys3, "cbctl", s_ep, &o);
    CHECK(c);
    cb_err_t code;
    double ms;
    cb_msg_t *m = echo(c, &code, err, sizeof err, &ms);
    CHECK(!m);
    CHECK_MSG(code == CB_ERR_UNAVAILABLE && strstr(err, "refused by") && strstr(err, s_ep) &&
              strstr(err, "our CURVE key is not in the server's allowed clients (ZAP"), "%s: %s", cb_err_name(code), err);
    CHECK_MSG(ms < REFUSAL_BOUND_MS, "refused after %.0f ms", ms);
    /* a stream send says the same */
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_begin(w, "echo", "s1");
    size_t len;
    const void *d = cb_msg_end(w, &len);
    double t0 = cb_now_ms();
    CHECK(cb_bus_send(c, d, len, &code, err, sizeof err) == -1 && code == CB_ERR_UNAVAILABLE);
    CHECK_MSG(strstr(err, "allowed clients (ZAP") && cb_now_ms() - t0 < REFUSAL_BOUND_MS, "%s", err);
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&c);
    /* and the fan-out (cbctl health, the gateway's /health) */
    const char *eps[2] = {s_ep, s_ep};
    cb_bus_result_t res[2];
    t0 = cb_now_ms();
    cb_bus_fanout(&o, "ping", eps, 2, SLOW_MS, SLOW_MS, res);
    CHECK(cb_now_ms() - t0 < REFUSAL_BOUND_MS);
    for (int i = 0; i < 2; i++)
        CHECK_MSG(!res[i].reply && res[i].refused && res[i].code == CB_ERR_UNAVAILABLE &&
                  strstr(res[i].error, "allowed clients (ZAP"), "%s", res[i].error);
    cb_bus_results_free(res, 2);
    /* the listed one in the same fan-out still answers */
    cb_bus_opts_t ok;
    cb_bus_client_t *c2 = client_for(s_keys, "cbctl", s_ep, &ok);
    CHECK(c2);
    cb_bus_client_destroy(&c2);
    cb_bus_fanout(&ok, "ping", eps, 1, SLOW_MS, SLOW_MS, res);
    CHECK_MSG(res[0].reply && cb_msg_ok(res[0].reply) && !res[0].refused, "%s", res[0].error);
    cb_bus_results_free(res, 1);
}

TEST(wrong_server_key_refused) {
    cb_bus_opts_t o;
    cb_bus_client_t *c = client_for(s_keys2, "cbctl", s_ep, &o); /* another set altogether */
    CHECK(c);
    cb_err_t code;
    char err[1024];
    double ms;
    cb_msg_t *m = echo(c, &code, err, sizeof err, &ms);
    CHECK(!m);
    CHECK_MSG(code == CB_ERR_UNAVAILABLE && strstr(err, "refused by") && strstr(err, "probably not its key"), "%s: %s",
              cb_err_name(code), err);
    CHECK_MSG(ms < REFUSAL_BOUND_MS, "refused after %.0f ms", ms);
    cb_bus_client_destroy(&c);
}

TEST(plaintext_client_refused) {
    cb_bus_opts_t o;
    cb_bus_client_t *c = client_for(NULL, "cbctl", s_ep, &o);
    CHECK(c);
    cb_err_t code;
    char err[1024];
    double ms;
    cb_msg_t *m = echo(c, &code, err, sizeof err, &ms);
    CHECK(!m);
    CHECK_MSG(code == CB_ERR_UNAVAILABLE && strstr(err, "requires CURVE") && strstr(err, "common.curve = on"), "%s",
              err);
    CHECK_MSG(ms < REFUSAL_BOUND_MS, "refused after %.0f ms", ms);
    cb_bus_client_destroy(&c);
}

TEST(curve_client_of_plaintext_service_refused) {
    cb_bus_opts_t o;
    cb_bus_client_t *c = client_for(s_keys, "cbctl", s_plain_ep, &o);
    CHECK(c);
    cb_err_t code;
    char err[1024];
    double ms;
    cb_msg_t *m = echo(c, &code, err, sizeof err, &ms);
    CHECK(!m);
    CHECK_MSG(code == CB_ERR_UNAVAILABLE && strstr(err, "does not use CURVE"), "%s", err);
    CHECK_MSG(ms < REFUSAL_BOUND_MS, "refused after %.0f ms", ms);
    cb_bus_client_destroy(&c);
    /* plaintext to plaintext still works */
    c = client_for(NULL, "cbctl", s_plain_ep, &o);
    CHECK(c);
    m = echo(c, &code, err, sizeof err, &ms);
    CHECK_MSG(m && cb_msg_ok(m), "%s", err);
    cb_msg_destroy(&m);
    cb_bus_client_destroy(&c);
}

/* The user id the echo service read for c's request. */
static bool echo_user_id(cb_bus_client_t *c, char *out, size_t size) {
    cb_err_t code;
    char err[1024];
    double ms;
    cb_msg_t *m = echo(c, &code, err, sizeof err, &ms);
    bool ok = m && cb_msg_ok(m) && cb_msg_str_copy(m, "user_id", size - 1, out, size);
    if (!ok) fprintf(stderr, "  echo: %s\n", m ? cb_msg_last_error(m) : err);
    cb_msg_destroy(&m);
    return ok;
}

TEST(zap_user_id_is_the_key) {
    cb_bus_opts_t o, o2;
    char u1[CB_BUS_USER_ID_MAX + 1], u2[CB_BUS_USER_ID_MAX + 1], u3[CB_BUS_USER_ID_MAX + 1];
    cb_bus_client_t *c = client_for(s_keys, "cbctl", s_ep, &o), *g = client_for(s_keys, "gateway", s_ep, &o2);
    CHECK(c && g);
    CHECK(echo_user_id(c, u1, sizeof u1) && echo_user_id(g, u2, sizeof u2));
    CHECK_MSG(strlen(u1) == 40 && !strcmp(u1, o.curve.public_txt), "'%s' vs '%s'", u1, o.curve.public_txt);
    CHECK(!strcmp(u2, o2.curve.public_txt) && strcmp(u1, u2) != 0);
    cb_bus_client_destroy(&c);
    cb_bus_client_destroy(&g);
    c = client_for(NULL, "cbctl", s_plain_ep, &o); /* plaintext: no User-Id */
    CHECK(c && echo_user_id(c, u3, sizeof u3) && u3[0] == 0);
    cb_bus_client_destroy(&c);
    /* a PULL socket (cb-precompute's) read with cb_bus_recv_zmsg: the PUSH's key */
    char err[1024], ep[300];
    cb_bus_opts_t so;
    CHECK_MSG(opts_for(s_keys, "blend", &so, err, sizeof err), "%s", err);
    zsock_t *pull = cb_bus_socket(ZMQ_PULL, "tcp://127.0.0.1:*", true, &so, err, sizeof err);
    CHECK_MSG(pull, "%s", err);
    snprintf(ep, sizeof ep, "%s", zsock_endpoint(pull));
    CHECK(opts_for(s_keys, "cbctl", &o, err, sizeof err) && cb_curve_add_peer(&o.curve, ep, "blend", err, sizeof err));
    cb_bus_conn_t *p = cb_bus_conn_new(ZMQ_PUSH, ep, &o, err, sizeof err);
    CHECK_MSG(p && cb_bus_conn_send(p, "doc", 3, SLOW_MS, err, sizeof err) == 0, "%s", err);
    zpoller_t *poller = zpoller_new(pull, NULL);
    bool ready = zpoller_wait(poller, SLOW_MS) == pull;
    zpoller_destroy(&poller);
    zmsg_t *zm = ready ? cb_bus_recv_zmsg(pull, u3, sizeof u3) : NULL;
    bool got = zm && zmsg_size(zm) == 1 && zframe_size(zmsg_first(zm)) == 3;
    zmsg_destroy(&zm);
    cb_bus_conn_destroy(&p);
    zsock_destroy(&pull);
    CHECK(got);
    CHECK_MSG(!strcmp(u3, o.curve.public_txt), "'%s'", u3);
}

TEST(push_refused) {
    /* a PUSH (cb-push, the fire-and-forget ingest path) through cb_bus_conn: refused at once too */
    char err[1024];
    cb_bus_opts_t o;
    CHECK(opts_for(NULL, "cbctl", &o, err, sizeof err));
    cb_bus_conn_t *p = cb_bus_conn_new(ZMQ_PUSH, s_ep, &o, err, sizeof err);
    CHECK(p);
    double t0 = cb_now_ms();
    int rc = cb_bus_conn_send(p, "x", 1, SLOW_MS, err, sizeof err);
    CHECK_MSG(rc == -2 && strstr(err, "requires CURVE") && cb_now_ms() - t0 < REFUSAL_BOUND_MS, "%d %s", rc, err);
    CHECK(cb_bus_conn_refused(p, NULL, 0));
    cb_bus_conn_destroy(&p);
    CHECK(!p);
}

int main(void) {
    setenv("ZSYS_SIGHANDLER", "false", 1);
    snprintf(s_tmp, sizeof s_tmp, "/tmp/test_curve.XXXXXX");
    if (!mkdtemp(s_tmp)) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(s_keys, sizeof s_keys, "%s/keys", s_tmp);
    snprintf(s_keys2, sizeof s_keys2, "%s/keys2", s_tmp);
    snprintf(s_keys3, sizeof s_keys3, "%s/keys3", s_tmp);
    RUN(keys_init);
    RUN(config_errors);
    RUN(allowed_list_checked);
    static cb_bus_opts_t curve_opts, plain_opts;
    char err[1024];
    zactor_t *svc = NULL, *plain = NULL;
    if (opts_for(s_keys, "blend", &curve_opts, err, sizeof err)) svc = start_service(&curve_opts, s_ep, sizeof s_ep);
    else fprintf(stderr, "service options: %s\n", err);
    cb_bus_opts_default(&plain_opts);
    plain = start_service(&plain_opts, s_plain_ep, sizeof s_plain_ep);
    if (!svc || !s_ep[0] || !plain || !s_plain_ep[0]) {
        fprintf(stderr, "cannot start the services\n");
        return 1;
    }
    RUN(listed_client_served);
    RUN(unlisted_client_refused);
    RUN(wrong_server_key_refused);
    RUN(plaintext_client_refused);
    RUN(curve_client_of_plaintext_service_refused);
    RUN(push_refused);
    RUN(zap_user_id_is_the_key);
    zactor_destroy(&svc);
    zactor_destroy(&plain);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", s_tmp);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", s_tmp);
    return test_summary();
}
