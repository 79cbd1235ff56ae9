/* cb-send: sends one request, written as JSON, to a cacheblend service and prints every reply as one
 * JSON line on stdout. For debugging and for integration tests (tests/integration).
 *
 *   cb-send [options] ENDPOINT [JSON|-]
 *     JSON      a JSON object: {"type": "search", "query": "x", "k": 3}; "-" or nothing: read stdin.
 *               "v" and "id" are added when missing (v=1, a fresh id). When the object has "v", it is
 *               sent exactly as written (no envelope added): use this to send invalid envelopes.
 *               Binaries are written {"$bin": "<hex>"} (in replies too).
 *   --timeout MS     per-attempt reply timeout (default 3000)
 *   --retries N      Lazy Pirate resends after a timeout (default 0)
 *   --stream         keep reading messages with the request's id until "done" or an error
 *   --raw-hex HEX    send these bytes as the frame instead of JSON (malformed-input tests)
 *   --raw-file PATH  send the file's bytes as the frame
 *   --max-bytes N    ZMQ_MAXMSGSIZE of this client (default 64 MiB, so it can send oversized frames)
 *   --repeat N       send the request N times, one after the other on one connection (not with --stream);
 *                    prints the last reply, and the round-trip times (mean, p50, p99 in ms) on stderr
 *   --fresh          with --repeat: a new connection (and handshake) for every request
 *   --config PATH, --SECTION.KEY=VALUE   the configuration: with common.curve = on, cb-send connects as
 *                    CURVE client `cbctl` (keys in common.keys_dir), to a configured service endpoint
 *
 * Exit status: 0 ok reply (for --stream: the stream ended with ok "done"), 1 error reply, 2 no reply
 * (timeout, unavailable, or the service dropped the connection), 3 bad usage or input.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/alloc.h"
#include "wire/bus.h"
#include "base/log.h"
#include "wire/msg.h"

#define CBSEND_MAX_INPUT (256u << 20)

static void usage(FILE *f) {
    fprintf(f, "usage: cb-send [--timeout MS] [--retries N] [--stream] [--raw-hex HEX | --raw-file PATH]\n"
               "               [--max-bytes N] [--repeat N [--fresh]] ENDPOINT [JSON|-]\n"
               "exit: 0 ok reply, 1 error reply, 2 no reply, 3 bad usage or input\n");
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Reads all of f (at most CBSEND_MAX_INPUT bytes); caller frees. */
static char *read_all(FILE *f, size_t *len) {
    size_t cap = 1 << 16, n = 0;
    char *buf = cb_malloc(cap + 1);
    while (buf) {
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (n < cap) break;
        if (cap >= CBSEND_MAX_INPUT) {
            free(buf);
            return NULL;
        }
        cap *= 2;
        char *nb = cb_realloc(buf, cap + 1);
        if (!nb) free(buf);
        buf = nb;
    }
    if (!buf) return NULL;
    buf[n] = 0;
    *len = n;
    return buf;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Prints a frame as a JSON line: the decoded message, or {"$invalid": reason, "$raw": hex}. */
static int print_frame(const void *data, size_t len, cb_msg_t **out) {
    cb_msg_error_t e;
    cb_msg_t *m = cb_msg_decode_ex(data, len, CBSEND_MAX_INPUT, &e);
    if (!m) {
        json_t *j = json_object();
        json_object_set_new(j, "$invalid", json_string(e.message));
        char *dump = json_dumps(j, JSON_COMPACT);
        printf("%s\n", dump ? dump : "{}");
        free(dump);
        json_decref(j);
        return -1;
    }
    json_t *j = cb_msg_to_json(m);
    char *dump = j ? json_dumps(j, JSON_COMPACT | JSON_ENSURE_ASCII) : NULL;
    printf("%s\n", dump ? dump : "{}");
    fflush(stdout);
    free(dump);
    json_decref(j);
    *out = m;
    return 0;
}

int main(int argc, char **argv) {
    cb_log_set_component("cb-send");
    /* the CURVE settings (common.curve, keys_dir) and identity of cbctl; --config, --SECTION.KEY=V */
    static cb_curve_t curve;
    char cerr[1024];
    cb_config_t *cfg = cb_config_new("cbctl", &argc, argv, cerr, sizeof cerr);
    bool curve_ok = cfg && cb_curve_from_config(cfg, "cbctl", &curve, cerr, sizeof cerr);
    cb_config_destroy(&cfg);
    if (!curve_ok) {
        fprintf(stderr, "cb-send: %s\n", cerr);
        return 3;
    }
    int timeout = 3000, retries = 0, repeat = 1;
    bool stream = false, fresh = false;
    const char *raw_hex = NULL, *raw_file = NULL, *endpoint = NULL, *json_arg = NULL;
    int64_t max_bytes = 64 << 20;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); return 0; }
        else if (!strcmp(a, "--timeout") && i + 1 < argc) timeout = atoi(argv[++i]);
        else if (!strcmp(a, "--retries") && i + 1 < argc) retries = atoi(argv[++i]);
        else if (!strcmp(a, "--stream")) stream = true;
        else if (!strcmp(a, "--raw-hex") && i + 1 < argc) raw_hex = argv[++i];
        else if (!strcmp(a, "--raw-file") && i + 1 < argc) raw_file = argv[++i];
        else if (!strcmp(a, "--max-bytes") && i + 1 < argc) max_bytes = atoll(argv[++i]);
        else if (!strcmp(a, "--repeat") && i + 1 < argc) repeat = atoi(argv[++i]);
        else if (!strcmp(a, "--fresh")) fresh = true;
        else if (a[0] == '-' && a[1] == '-') { fprintf(stderr, "cb-send: unknown option %s\n", a); usage(stderr); return 3; }
        else if (!endpoint) endpoint = a;
        else if (!json_arg) json_arg = a;
        else { usage(stderr); return 3; }
    }
    if (!endpoint || timeout <= 0 || retries < 0 || max_bytes < 256 || repeat < 1 || repeat > 10000000 ||
        (repeat > 1 && stream)) {
        usage(stderr);
        return 3;
    }
    zsys_init();
    char err[512];
    cb_bus_opts_t o;
    cb_bus_opts_default(&o);
    o.request_timeout_ms = timeout;
    o.request_retries = retries;
    o.max_msg_bytes = max_bytes;
    o.send_timeout_ms = timeout < 2000 ? timeout : 2000;
    o.curve = curve;
    cb_bus_client_t *c = cb_bus_client_new(endpoint, &o, err, sizeof err);
    if (!c) {
        fprintf(stderr, "cb-send: %s\n", err);
        return 3;
    }
    int rc = 3;
    unsigned char *raw = NULL;
    char *input = NULL;
    json_t *j = NULL;
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_t *m = NULL;

    if (raw_hex || raw_file) {
        size_t n = 0;
        if (raw_hex) {
            size_t hl = strlen(raw_hex);
            raw = cb_malloc(hl / 2 + 1);
            for (size_t i = 0; raw && i + 1 < hl; i += 2) {
                int hi = hexval(raw_hex[i]), lo = hexval(raw_hex[i + 1]);
                if (hi < 0 || lo < 0) { fprintf(stderr, "cb-send: --raw-hex: not hex\n"); goto out; }
                raw[n++] = (unsigned char)(hi * 16 + lo);
            }
            if (hl % 2) { fprintf(stderr, "cb-send: --raw-hex: odd length\n"); goto out; }
        } else {
            FILE *f = fopen(raw_file, "rb");
            if (!f) { fprintf(stderr, "cb-send: cannot open %s\n", raw_file); goto out; }
            raw = (unsigned char *)read_all(f, &n);
            fclose(f);
            if (!raw) { fprintf(stderr, "cb-send: cannot read %s\n", raw_file); goto out; }
        }
        if (cb_bus_send_raw(c, raw, n, err, sizeof err) != 0) {
            fprintf(stderr, "cb-send: %s\n", err);
            rc = 2;
            goto out;
        }
        zframe_t *f = cb_bus_recv_raw(c, timeout);
        if (!f) {
            fprintf(stderr, "cb-send: no reply from %s in %d ms (connection dropped?)\n", endpoint, timeout);
            rc = 2;
            goto out;
        }
        int prc = print_frame(zframe_data(f), zframe_size(f), &m);
        zframe_destroy(&f);
        rc = prc != 0 ? 1 : cb_msg_ok(m) ? 0 : 1;
        goto out;
    }

    size_t ilen;
    if (!json_arg || !strcmp(json_arg, "-")) {
        input = read_all(stdin, &ilen);
        if (!input) { fprintf(stderr, "cb-send: cannot read stdin\n"); goto out; }
    } else {
        input = cb_strdup(json_arg);
    }
    json_error_t je;
    j = json_loads(input, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    if (!j || !json_is_object(j)) {
        fprintf(stderr, "cb-send: invalid JSON object: %s (line %d)\n", j ? "not an object" : je.text, je.line);
        goto out;
    }
    char idbuf[32];
    const char *id;
    if (json_object_get(j, "v")) { /* as written */
        cb_msg_begin_bare(w);
        const char *k;
        json_t *v;
        json_object_foreach(j, k, v) cb_msg_put_json(w, k, v);
        json_t *jid = json_object_get(j, "id");
        id = json_is_string(jid) ? json_string_value(jid) : "";
    } else {
        json_t *jt = json_object_get(j, "type"), *jid = json_object_get(j, "id");
        if (!json_is_string(jt)) { fprintf(stderr, "cb-send: the request needs a \"type\" string\n"); goto out; }
        id = json_is_string(jid) ? json_string_value(jid) : cb_bus_new_id(idbuf, sizeof idbuf);
        cb_msg_begin(w, json_string_value(jt), id);
        const char *k;
        json_t *v;
        json_object_foreach(j, k, v) {
            if (strcmp(k, "type") && strcmp(k, "id")) cb_msg_put_json(w, k, v);
        }
    }
    size_t len;
    const void *data = cb_msg_end(w, &len);
    if (!data) {
        fprintf(stderr, "cb-send: cannot encode: %s\n", cb_msg_writer_error(w));
        goto out;
    }
    cb_err_t code;
    if (!stream) {
        /* a request with an invalid envelope cannot go through cb_bus_request (which validates);
         * send it raw and print whatever comes back */
        cb_msg_t *self = cb_msg_decode_ex(data, len, (size_t)max_bytes, NULL);
        if (!self) {
            if (cb_bus_send_raw(c, data, len, err, sizeof err) != 0) { fprintf(stderr, "cb-send: %s\n", err); rc = 2; goto out; }
            zframe_t *f = cb_bus_recv_raw(c, timeout);
            if (!f) { fprintf(stderr, "cb-send: no reply from %s in %d ms\n", endpoint, timeout); rc = 2; goto out; }
            int prc = print_frame(zframe_data(f), zframe_size(f), &m);
            zframe_destroy(&f);
            rc = prc != 0 ? 1 : cb_msg_ok(m) ? 0 : 1;
            goto out;
        }
        cb_msg_destroy(&self);
        double *rtt = repeat > 1 ? cb_malloc((size_t)repeat * sizeof *rtt) : NULL;
        cb_msg_t *rep = NULL;
        for (int r = 0; r < repeat; r++) { /* the same bytes, the same id: each reply comes before the next send */
            cb_msg_destroy(&rep);
            double t0 = cb_now_ms();
            if (fresh && r > 0) {
                cb_bus_client_destroy(&c);
                if (!(c = cb_bus_client_new(endpoint, &o, err, sizeof err))) {
                    code = CB_ERR_INTERNAL;
                    break;
                }
            }
            if (!(rep = cb_bus_request(c, data, len, &code, err, sizeof err))) break;
            if (rtt) rtt[r] = cb_now_ms() - t0;
        }
        if (rep && rtt) {
            qsort(rtt, (size_t)repeat, sizeof *rtt, cmp_double);
            double sum = 0;
            for (int r = 0; r < repeat; r++) sum += rtt[r];
            fprintf(stderr, "cb-send: %d requests to %s: round trip mean %.4f ms, p50 %.4f ms, p99 %.4f ms\n", repeat,
                    endpoint, sum / repeat, rtt[repeat / 2], rtt[(int)(0.99 * (repeat - 1))]);
        }
        free(rtt);
        if (!rep) {
            fprintf(stderr, "cb-send: %s: %s\n", cb_err_name(code), err);
            rc = code == CB_ERR_TIMEOUT || code == CB_ERR_UNAVAILABLE ? 2 : 3;
            goto out;
        }
        json_t *rj = cb_msg_to_json(rep);
        char *dump = rj ? json_dumps(rj, JSON_COMPACT | JSON_ENSURE_ASCII) : NULL;
        printf("%s\n", dump ? dump : "{}");
        free(dump);
        json_decref(rj);
        rc = cb_msg_ok(rep) ? 0 : 1;
        cb_msg_destroy(&rep);
        goto out;
    }
    if (cb_bus_send(c, data, len, &code, err, sizeof err) != 0) {
        fprintf(stderr, "cb-send: %s: %s\n", cb_err_name(code), err);
        rc = code == CB_ERR_UNAVAILABLE ? 2 : 3;
        goto out;
    }
    for (;;) {
        cb_msg_t *msg = cb_bus_recv(c, id, timeout, &code, err, sizeof err);
        if (!msg) {
            fprintf(stderr, "cb-send: %s\n", err);
            rc = 2;
            break;
        }
        json_t *rj = cb_msg_to_json(msg);
        char *dump = rj ? json_dumps(rj, JSON_COMPACT | JSON_ENSURE_ASCII) : NULL;
        printf("%s\n", dump ? dump : "{}");
        fflush(stdout);
        free(dump);
        json_decref(rj);
        bool end = !cb_msg_ok(msg) || cb_msg_is_type(msg, "done");
        rc = cb_msg_ok(msg) ? 0 : 1;
        cb_msg_destroy(&msg);
        if (end) break;
    }
out:
    cb_msg_destroy(&m);
    cb_msg_writer_destroy(&w);
    json_decref(j);
    free(input);
    free(raw);
    cb_bus_client_destroy(&c);
    return rc;
}
