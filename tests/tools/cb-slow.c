/* cb-slow: a client that never reads its stream (tests/faults/slow.sh, docs/reliability.md). It connects a
 * raw DEALER with a tiny receive queue and socket buffer, sends one request (a cb-blend query, typically with
 * a large max_tokens), holds the socket open for --hold ms without receiving anything, and then reports
 * what had piled up for it: the service either kept the stream within its high-water mark and dropped this
 * client (the stream just stops: no `done`), or finished the answer into the buffers (`done` seen).
 *
 *   cb-slow [--hold MS] [--drain MS] [--rcvhwm N] [--rcvbuf BYTES] ENDPOINT JSON
 *     JSON   e.g. '{"type":"query","question":"...","max_tokens":4096}'; "v" and "id" are added
 *
 * Output: one JSON object {"sent", "held_ms", "received" (messages with the request's id), "tokens",
 * "heartbeats", "done" (a done arrived), "error" (the code of an error message, or null)}.
 * Exit: 0 sent (whatever came back), 2 could not send, 3 bad usage or input.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"
#include "wire/bus.h"
#include "wire/msg.h"

#define MAX_DRAIN_MSGS 1000000

static int usage(void) {
    fprintf(stderr, "usage: cb-slow [--hold MS] [--drain MS] [--rcvhwm N] [--rcvbuf BYTES] ENDPOINT JSON\n");
    return 3;
}

int main(int argc, char **argv) {
    cb_log_set_component("cb-slow");
    setenv("ZSYS_SIGHANDLER", "false", 0);
    int hold_ms = 10000, drain_ms = 500, rcvhwm = 1, rcvbuf = 1024, i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (!strcmp(argv[i], "--hold") && i + 1 < argc) hold_ms = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--drain") && i + 1 < argc) drain_ms = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rcvhwm") && i + 1 < argc) rcvhwm = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rcvbuf") && i + 1 < argc) rcvbuf = atoi(argv[++i]);
        else return usage();
    }
    if (i + 2 != argc || hold_ms < 0 || hold_ms > 3600000 || drain_ms < 0 || drain_ms > 600000 || rcvhwm < 0 ||
        rcvbuf < 0)
        return usage();
    const char *ep = argv[i];
    json_error_t je;
    json_t *o = json_loads(argv[i + 1], 0, &je);
    if (!json_is_object(o)) {
        fprintf(stderr, "cb-slow: not a JSON object: %s\n", je.text);
        return 3;
    }
    zsys_init();
    char id[32], err[512];
    cb_bus_new_id(id, sizeof id);
    cb_msg_writer_t *w = cb_msg_writer_new();
    json_t *t = json_object_get(o, "type");
    cb_msg_begin(w, json_is_string(t) ? json_string_value(t) : "query", id);
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v) if (strcmp(k, "type") && strcmp(k, "id") && strcmp(k, "v")) cb_msg_put_json(w, k, v);
    size_t len;
    const void *d = cb_msg_end(w, &len);
    if (!d) {
        fprintf(stderr, "cb-slow: cannot encode: %s\n", cb_msg_writer_error(w));
        return 3;
    }
    cb_bus_opts_t opts;
    cb_bus_opts_default(&opts);
    opts.rcvhwm = rcvhwm;
    opts.send_timeout_ms = 3000;
    opts.linger_ms = 0;
    zsock_t *s = cb_bus_socket(ZMQ_DEALER, NULL, false, &opts, err, sizeof err);
    if (!s) {
        fprintf(stderr, "cb-slow: %s\n", err);
        return 2;
    }
    /* the kernel buffer before the connection exists, so the window stays small */
    if (rcvbuf > 0) zsock_set_rcvbuf(s, rcvbuf);
    if (zsock_connect(s, "%s", ep) < 0 || zmq_send(zsock_resolve(s), d, len, 0) < 0) {
        fprintf(stderr, "cb-slow: cannot send to %s: %s\n", ep, zmq_strerror(zmq_errno()));
        zsock_destroy(&s);
        return 2;
    }
    double t0 = cb_now_ms();
    /* hold: never receive (bounded sleeps) */
    for (int slept = 0; slept < hold_ms; slept += 100) usleep(100 * 1000);
    double held = cb_now_ms() - t0;
    long received = 0, tokens = 0, heartbeats = 0;
    bool done = false;
    const char *error = NULL;
    char errbuf[64] = "";
    void *h = zsock_resolve(s);
    double end = cb_now_ms() + drain_ms;
    for (int n = 0; n < MAX_DRAIN_MSGS && !done && !error; n++) {
        double left = end - cb_now_ms();
        if (left <= 0) break;
        zmq_pollitem_t it = {h, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, (long)left) <= 0) break;
        zmsg_t *zm = zmsg_recv(s);
        if (!zm) break;
        zframe_t *f = zmsg_last(zm);
        cb_msg_error_t e;
        cb_msg_t *m = f ? cb_msg_decode_ex(zframe_data(f), zframe_size(f), CB_MSG_DEFAULT_MAX_BYTES, &e) : NULL;
        if (m && !strcmp(cb_msg_id(m), id)) {
            received++;
            if (!cb_msg_ok(m)) {
                snprintf(errbuf, sizeof errbuf, "%s", cb_msg_err_code_name(m));
                error = errbuf;
            } else if (cb_msg_is_type(m, "token")) tokens++;
            else if (cb_msg_is_type(m, "heartbeat")) heartbeats++;
            else if (cb_msg_is_type(m, "done")) done = true;
        }
        cb_msg_destroy(&m);
        zmsg_destroy(&zm);
    }
    zsock_destroy(&s);
    json_t *out = json_pack("{s:b, s:f, s:i, s:i, s:i, s:b}", "sent", 1, "held_ms", held, "received", (int)received,
                            "tokens", (int)tokens, "heartbeats", (int)heartbeats, "done", done);
    json_object_set_new(out, "error", error ? json_string(error) : json_null());
    json_dumpf(out, stdout, JSON_COMPACT);
    fputc('\n', stdout);
    json_decref(out);
    json_decref(o);
    cb_msg_writer_destroy(&w);
    return 0;
}
