/* cb-push: a pipeline producer for cb-precompute's PULL socket: pushes messages written as JSON (one per
 * argument, or one per stdin line with "-"), or raw bytes for malformed-input tests. No replies exist on
 * this path; cb-push only reports whether each message could be handed to a connected peer.
 *
 *   cb-push [--timeout MS] [--raw-hex HEX] ENDPOINT [JSON... | -]
 *     JSON   e.g. '{"type":"ingest","doc_id":"d1","text":"..."}'; "v" and "id" are added when missing.
 *   --timeout MS   how long to wait for the connection before giving up on a message (default 3000)
 *   --config PATH, --SECTION.KEY=VALUE   the configuration (common.curve on: CURVE client `cbctl`)
 * Exit: 0 every message handed over, 2 not connected in time, 3 bad usage or input.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire/bus.h"
#include "base/alloc.h"
#include "base/log.h"
#include "wire/msg.h"

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int usage(void) {
    fprintf(stderr, "usage: cb-push [--timeout MS] [--raw-hex HEX] ENDPOINT [JSON... | -]\n");
    return 3;
}

/* Encodes a JSON object as a message (envelope added when "v" is absent). */
static const void *encode(cb_msg_writer_t *w, const char *js, size_t *len) {
    json_error_t je;
    json_t *o = json_loads(js, 0, &je);
    if (!o || !json_is_object(o)) {
        fprintf(stderr, "cb-push: not a JSON object: %s\n", o ? "" : je.text);
        json_decref(o);
        return NULL;
    }
    const void *d;
    if (json_object_get(o, "v")) {
        cb_msg_begin_bare(w);
    } else {
        char id[32];
        json_t *t = json_object_get(o, "type");
        cb_msg_begin(w, json_is_string(t) ? json_string_value(t) : "ingest", cb_bus_new_id(id, sizeof id));
        json_object_del(o, "type");
        json_object_del(o, "id");
    }
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v) cb_msg_put_json(w, k, v);
    d = cb_msg_end(w, len);
    if (!d) fprintf(stderr, "cb-push: cannot encode: %s\n", cb_msg_writer_error(w));
    json_decref(o);
    return d;
}

int main(int argc, char **argv) {
    cb_log_set_component("cb-push");
    static cb_curve_t curve; /* common.curve and keys_dir, as CURVE client `cbctl` */
    char cerr[1024];
    cb_config_t *cfg = cb_config_new("cbctl", &argc, argv, cerr, sizeof cerr);
    bool curve_ok = cfg && cb_curve_from_config(cfg, "cbctl", &curve, cerr, sizeof cerr);
    cb_config_destroy(&cfg);
    if (!curve_ok) {
        fprintf(stderr, "cb-push: %s\n", cerr);
        return 3;
    }
    int timeout = 3000, i = 1;
    const char *raw = NULL;
    for (; i < argc && argv[i][0] == '-' && argv[i][1]; i++) {
        if (!strcmp(argv[i], "--timeout") && i + 1 < argc) timeout = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--raw-hex") && i + 1 < argc) raw = argv[++i];
        else return usage();
    }
    if (i >= argc) return usage();
    const char *ep = argv[i++];
    cb_bus_opts_t o;
    cb_bus_opts_default(&o);
    o.max_msg_bytes = (int64_t)64 << 20;
    o.send_timeout_ms = timeout > 0 ? timeout : 1;
    o.linger_ms = 5000; /* hand everything over before exit */
    o.curve = curve;
    char err[1024];
    zsys_init();
    cb_bus_conn_t *s = cb_bus_conn_new(ZMQ_PUSH, ep, &o, err, sizeof err);
    if (!s) {
        fprintf(stderr, "cb-push: %s\n", err);
        return 3;
    }
    cb_msg_writer_t *w = cb_msg_writer_new();
    int rc = 0;
    char *line = NULL;
    size_t cap = 0;
    for (int n = 0;; n++) {
        const void *d = NULL;
        size_t len = 0;
        unsigned char *bytes = NULL;
        if (raw) {
            if (n > 0) break;
            size_t hl = strlen(raw);
            if (hl % 2) {
                rc = 3;
                break;
            }
            bytes = cb_malloc(hl / 2 + 1);
            for (size_t j = 0; j < hl / 2; j++) {
                int a = hexval(raw[2 * j]), b = hexval(raw[2 * j + 1]);
                if (a < 0 || b < 0) {
                    free(bytes);
                    bytes = NULL;
                    break;
                }
                bytes[j] = (unsigned char)(a * 16 + b);
            }
            if (!bytes) {
                rc = 3;
                break;
            }
            d = bytes;
            len = hl / 2;
        } else if (i < argc && strcmp(argv[i], "-") != 0) {
            d = encode(w, argv[i++], &len);
            if (!d) {
                rc = 3;
                break;
            }
        } else if (i < argc) {
            ssize_t got = getline(&line, &cap, stdin);
            if (got < 0) break;
            if (got <= 1) continue;
            d = encode(w, line, &len);
            if (!d) {
                rc = 3;
                continue;
            }
        } else {
            break;
        }
        int sent = cb_bus_conn_send(s, d, len, o.send_timeout_ms, err, sizeof err);
        if (sent != 0) {
            if (sent == -2) fprintf(stderr, "cb-push: %s\n", err); /* refused: CURVE/ZAP */
            else fprintf(stderr, "cb-push: %s: not connected within %d ms\n", ep, timeout);
            free(bytes);
            rc = 2;
            break;
        }
        free(bytes);
    }
    free(line);
    cb_msg_writer_destroy(&w);
    cb_bus_conn_destroy(&s);
    return rc;
}
