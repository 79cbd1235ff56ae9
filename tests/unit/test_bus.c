/* test_bus: libshared/bus: a service in a thread (zactor) on a loopback port, and clients: ping,
 * dispatch, error replies for malformed/unknown/oversized input, streams, Lazy Pirate timeout and
 * unavailable endpoints, REQ-socket compatibility. */
#include <arpa/inet.h>
#include <czmq.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "wire/bus.h"
#include "test.h"

static void h_echo(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    (void)arg;
    const char *s;
    size_t n;
    if (!cb_msg_str(m, "text", 100, &s, &n)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_strn(w, "text", s, n);
    cb_bus_reply(req, w);
}

static void h_stream(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    (void)arg;
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    for (int i = 0; i < 3; i++) {
        cb_msg_begin_reply_as(w, "token", cb_msg_id(m));
        cb_msg_put_int(w, "index", i);
        cb_bus_reply(req, w);
    }
    cb_msg_begin_reply_as(w, "done", cb_msg_id(m));
    cb_bus_reply(req, w);
}

static cb_bus_req_t *s_hung;
static void h_hang(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    (void)svc, (void)m, (void)arg;
    cb_bus_req_destroy(&s_hung); /* an older one */
    s_hung = cb_bus_req_detach(req); /* never answered */
}

static void h_silent(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    (void)svc, (void)req, (void)m, (void)arg; /* forgets to reply: the bus answers internal */
}

static void stats_extra(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg) {
    (void)svc, (void)arg;
    cb_msg_put_int(w, "widgets", 42);
}

static int on_pipe(zloop_t *loop, zsock_t *pipe, void *arg) {
    (void)loop, (void)arg;
    char *cmd = zstr_recv(pipe);
    int stop = !cmd || strcmp(cmd, "$TERM") == 0;
    zstr_free(&cmd);
    return stop ? -1 : 0;
}

static void service_actor(zsock_t *pipe, void *args) {
    (void)args;
    char err[256];
    cb_bus_opts_t o;
    cb_bus_opts_default(&o);
    o.max_msg_bytes = 4096;
    cb_bus_service_t *svc = cb_bus_service_new("cb-test", "tcp://127.0.0.1:*", &o, err, sizeof err);
    if (!svc) {
        fprintf(stderr, "service: %s\n", err);
        zsock_signal(pipe, 1);
        return;
    }
    cb_bus_service_on(svc, "echo", h_echo, NULL);
    cb_bus_service_on(svc, "stream", h_stream, NULL);
    cb_bus_service_on(svc, "hang", h_hang, NULL);
    cb_bus_service_on(svc, "silent", h_silent, NULL);
    cb_bus_service_set_stats(svc, stats_extra, NULL);
    zloop_reader(cb_bus_service_loop(svc), pipe, on_pipe, NULL);
    zsock_signal(pipe, 0);
    zstr_send(pipe, cb_bus_service_endpoint(svc));
    cb_bus_service_run(svc);
    s_hung = NULL; /* freed with the service */
    cb_bus_service_destroy(&svc);
}

static char s_ep[256];

static cb_bus_client_t *client(int timeout_ms, int retries) {
    char err[256];
    cb_bus_opts_t o;
    cb_bus_opts_default(&o);
    o.request_timeout_ms = timeout_ms;
    o.request_retries = retries;
    o.send_timeout_ms = 300;
    o.max_msg_bytes = 1 << 20;
    return cb_bus_client_new(s_ep, &o, err, sizeof err);
}

static cb_msg_t *call(cb_bus_client_t *c, const char *type, const char *text, cb_err_t *code) {
    cb_msg_writer_t *w = cb_msg_writer_new();
    char id[32], err[256];
    cb_msg_begin(w, type, cb_bus_new_id(id, sizeof id));
    if (text) cb_msg_put_str(w, "text", text);
    cb_msg_t *m = cb_bus_call(c, w, code, err, sizeof err);
    cb_msg_writer_destroy(&w);
    return m;
}

TEST(ping_stats_echo) {
    cb_bus_client_t *c = client(2000, 0);
    CHECK(c);
    cb_err_t code;
    cb_msg_t *m = call(c, "ping", NULL, &code);
    CHECK(m && cb_msg_ok(m));
    const char *s;
    size_t n;
    CHECK(cb_msg_str(m, "service", 64, &s, &n) && n == 7 && memcmp(s, "cb-test", 7) == 0);
    /* no data disk watched (cb_bus_service_set_disk): status ok, no reason */
    CHECK(cb_msg_str(m, "status", 16, &s, &n) && n == 2 && memcmp(s, "ok", 2) == 0 && !cb_msg_has(m, "reason"));
    cb_msg_destroy(&m);
    m = call(c, "echo", "hello", &code);
    CHECK(m && cb_msg_ok(m) && cb_msg_str(m, "text", 64, &s, &n) && n == 5);
    cb_msg_destroy(&m);
    m = call(c, "echo", NULL, &code); /* missing field */
    CHECK(m && !cb_msg_ok(m) && cb_msg_err_code(m) == CB_ERR_BAD_REQUEST);
    CHECK(strstr(cb_msg_err_message(m), "text"));
    cb_msg_destroy(&m);
    m = call(c, "frobnicate", NULL, &code);
    CHECK(m && !cb_msg_ok(m) && cb_msg_err_code(m) == CB_ERR_UNKNOWN_TYPE);
    cb_msg_destroy(&m);
    m = call(c, "silent", NULL, &code);
    CHECK(m && !cb_msg_ok(m) && cb_msg_err_code(m) == CB_ERR_INTERNAL);
    cb_msg_destroy(&m);
    m = call(c, "stats", NULL, &code);
    int64_t v;
    CHECK(m && cb_msg_ok(m) && cb_msg_int(m, "widgets", 0, 100, &v) && v == 42);
    CHECK(cb_msg_int(m, "requests", 1, 1000, &v) && v >= 5);
    CHECK(cb_msg_int(m, "errors", 1, 1000, &v) && v >= 3);
    cb_msg_destroy(&m);
    cb_bus_client_destroy(&c);
}

TEST(malformed_input) {
    cb_bus_client_t *c = client(2000, 0);
    char err[256];
    /* garbage bytes */
    CHECK(cb_bus_send_raw(c, "\xdd\xff\xff\xff\xff", 5, err, sizeof err) == 0);
    zframe_t *f = cb_bus_recv_raw(c, 2000);
    CHECK(f);
    cb_msg_t *m = cb_msg_decode(zframe_data(f), zframe_size(f), NULL, 0);
    zframe_destroy(&f);
    CHECK(m && !cb_msg_ok(m) && cb_msg_err_code(m) == CB_ERR_BAD_REQUEST && cb_msg_is_type(m, "error"));
    cb_msg_destroy(&m);
    /* deep nesting with a readable id: the reply carries the id */
    unsigned char deep[64];
    size_t n = 0;
    const char *hdr = "\x84\xa1v\x01\xa4type\xa4ping\xa2id\xa3" "abc\xa1x";
    memcpy(deep, hdr, strlen(hdr));
    n = strlen(hdr);
    for (int i = 0; i < 12; i++) deep[n++] = 0x91;
    deep[n++] = 0x01;
    CHECK(cb_bus_send_raw(c, deep, n, err, sizeof err) == 0);
    f = cb_bus_recv_raw(c, 2000);
    CHECK(f);
    m = cb_msg_decode(zframe_data(f), zframe_size(f), NULL, 0);
    zframe_destroy(&f);
    CHECK(m && !cb_msg_ok(m) && strstr(cb_msg_err_message(m), "nesting"));
    cb_msg_destroy(&m);
    /* a request that carries ok */
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_begin_reply_as(w, "ping", "x1");
    cb_err_t code;
    m = cb_bus_call(c, w, &code, err, sizeof err);
    CHECK(m && !cb_msg_ok(m) && cb_msg_err_code(m) == CB_ERR_BAD_REQUEST);
    cb_msg_destroy(&m);
    /* cb_bus_call_ok folds error replies */
    cb_msg_begin(w, "nope", "x2");
    m = cb_bus_call_ok(c, w, &code, err, sizeof err);
    CHECK(!m && code == CB_ERR_UNKNOWN_TYPE && strstr(err, "unknown_type"));
    /* an invalid request is refused locally */
    m = cb_bus_request(c, "\x01", 1, &code, err, sizeof err);
    CHECK(!m && code == CB_ERR_BAD_REQUEST);
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&c);
}

TEST(oversized_message_disconnects) {
    cb_bus_client_t *c = client(500, 0);
    size_t big = 8192; /* the service caps at 4096 */
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_begin(w, "echo", "big1");
    char *text = malloc(big);
    memset(text, 'a', big - 1);
    text[big - 1] = 0;
    cb_msg_put_str(w, "text", text);
    free(text);
    cb_err_t code;
    char err[256];
    cb_msg_t *m = cb_bus_call(c, w, &code, err, sizeof err);
    CHECK(!m && (code == CB_ERR_TIMEOUT || code == CB_ERR_UNAVAILABLE));
    /* the service still answers (this client and others) */
    cb_bus_client_t *c2 = client(2000, 0);
    m = call(c2, "ping", NULL, &code);
    CHECK(m && cb_msg_ok(m));
    cb_msg_destroy(&m);
    cb_bus_client_set_timeout(c, 2000, 0);
    m = call(c, "ping", NULL, &code);
    CHECK(m && cb_msg_ok(m));
    cb_msg_destroy(&m);
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&c);
    cb_bus_client_destroy(&c2);
}

TEST(stream) {
    cb_bus_client_t *c = client(2000, 0);
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_begin(w, "stream", "s1");
    size_t len;
    const void *data = cb_msg_end(w, &len);
    cb_err_t code;
    char err[256];
    CHECK(cb_bus_send(c, data, len, &code, err, sizeof err) == 0);
    int tokens = 0, done = 0;
    for (;;) {
        cb_msg_t *m = cb_bus_recv(c, "s1", 2000, &code, err, sizeof err);
        CHECK(m);
        if (cb_msg_is_type(m, "token")) {
            int64_t i;
            CHECK(cb_msg_int(m, "index", 0, 10, &i) && i == tokens);
            tokens++;
        }
        done = cb_msg_is_type(m, "done");
        cb_msg_destroy(&m);
        if (done) break;
    }
    CHECK(tokens == 3 && done);
    CHECK(!cb_bus_recv(c, "s1", 100, &code, err, sizeof err) && code == CB_ERR_TIMEOUT);
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&c);
}

TEST(lazy_pirate_timeout) {
    cb_bus_client_t *c = client(200, 2);
    cb_err_t code;
    char err[256];
    double t0 = (double)zclock_mono();
    cb_msg_t *m = call(c, "hang", NULL, &code);
    double dt = (double)zclock_mono() - t0;
    CHECK(!m && code == CB_ERR_TIMEOUT);
    CHECK_MSG(dt >= 550 && dt < 3000, "took %.0f ms", dt);
    /* the next request on the same client works (fresh socket) */
    m = call(c, "ping", NULL, &code);
    CHECK(m && cb_msg_ok(m));
    cb_msg_destroy(&m);
    (void)err;
    cb_bus_client_destroy(&c);
}

TEST(unavailable) {
    char err[256];
    cb_bus_opts_t o;
    cb_bus_opts_default(&o);
    o.send_timeout_ms = 200;
    o.request_timeout_ms = 200;
    o.request_retries = 1;
    /* a port nothing listens on: a random one that a plain socket can bind (closed synchronously,
     * unlike a ZeroMQ socket), below the kernel's ephemeral range, where a connect to a free port
     * could connect to itself (TCP simultaneous open) */
    int port = 0;
    srand((unsigned)getpid());
    for (int tries = 0; tries < 200 && !port; tries++) {
        int p = 20000 + rand() % 12000;
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)p)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0) port = p;
        if (fd >= 0) close(fd);
    }
    CHECK(port);
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    cb_bus_client_t *c = cb_bus_client_new(ep, &o, err, sizeof err);
    CHECK(c);
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_begin(w, "ping", "u1");
    cb_err_t code;
    cb_msg_t *m = cb_bus_call(c, w, &code, err, sizeof err);
    CHECK_MSG(!m && code == CB_ERR_UNAVAILABLE, "reply %p, code %s: %s", (void *)m, cb_err_name(code), err);
    CHECK_MSG(strstr(err, ep) && strstr(err, "unavailable"), "%s", err);
    CHECK(!cb_bus_client_new("nonsense", &o, err, sizeof err));
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&c);
}

TEST(req_socket_compat) {
    zsock_t *req = zsock_new_req(s_ep);
    CHECK(req);
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_begin(w, "echo", "r1");
    cb_msg_put_str(w, "text", "via req");
    size_t len;
    const void *data = cb_msg_end(w, &len);
    zframe_t *f = zframe_new(data, len);
    zframe_send(&f, req, 0);
    zsock_set_rcvtimeo(req, 2000);
    f = zframe_recv(req);
    CHECK(f);
    cb_msg_t *m = cb_msg_decode(zframe_data(f), zframe_size(f), NULL, 0);
    zframe_destroy(&f);
    CHECK(m && cb_msg_ok(m) && strcmp(cb_msg_id(m), "r1") == 0);
    cb_msg_destroy(&m);
    cb_msg_writer_destroy(&w);
    zsock_destroy(&req);
}

int main(void) {
    setenv("ZSYS_SIGHANDLER", "false", 1);
    zactor_t *svc = zactor_new(service_actor, NULL);
    if (!svc) {
        fprintf(stderr, "cannot start the service actor\n");
        return 1;
    }
    char *ep = zstr_recv(svc);
    snprintf(s_ep, sizeof s_ep, "%s", ep ? ep : "");
    zstr_free(&ep);
    RUN(ping_stats_echo);
    RUN(malformed_input);
    RUN(oversized_message_disconnects);
    RUN(stream);
    RUN(lazy_pirate_timeout);
    RUN(unavailable);
    RUN(req_socket_compat);
    zactor_destroy(&svc);
    return test_summary();
}
