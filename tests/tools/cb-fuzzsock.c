/* cb-fuzzsock: a bounded "fuzz over the socket" runner. For every request template (one JSON object a line,
 * a valid request of some type), it sends N mutated copies to a running service and checks that each gets
 * a well-formed reply (or, on a PULL socket, is taken) and that the service stays up. The services'
 * request handlers (field validation, limits) are static inside each service, so this is how they are
 * reached: through the real socket, the real decoder and the real handler (tests/faults/fuzz.sh).
 *
 *   cb-fuzzsock [--seed S] [--n N] [--timeout MS] [--stream-ms MS] [--push --ping ENDPOINT] [--json]
 *               [--curve-client KEY_SECRET_FILE --curve-server PUBLIC_KEY_FILE] ENDPOINT TEMPLATES.jsonl
 *
 * Mutations (the generator is seeded: the same seed sends the same bytes):
 *   - structural, on the JSON before encoding: a field dropped, or replaced by a value of another type
 *     (boundary integers, huge and non-finite-looking numbers, empty/long/invalid-hex/unicode strings,
 *     arrays, nested maps), an unknown field added, the type or version changed;
 *   - raw entries appended to the encoded top-level map: a duplicate key, NaN and infinity, an ext type,
 *     0xc1, a nesting chain deeper than the decoder allows, a str32/array32 header claiming more than the
 *     frame holds, a bin;
 *   - bytes of the encoded frame: bit flips, interesting bytes written over, truncation, insertion,
 *     trailing garbage.
 * The first message of each template is the template itself (a baseline that must be answered ok).
 *
 * Each message is sent on a DEALER; the replies are read until a non-stream reply, a stream's `done`, an
 * error, or --timeout ms of silence (heartbeats count as talk). A stream still running after --stream-ms
 * is abandoned (the socket is closed, which cb-blend treats as a client that went away). After a message
 * without a reply the service is pinged; a service that no longer answers ping ends the run.
 * With --push the messages go to a PULL socket (cb-precompute's ingest pipeline): no replies; the service
 * at --ping must still answer afterwards.
 *
 * CURVE (a stack with common.curve = on, docs/protocol.md §1.1): --curve-client names the client key pair
 * to connect as (a zcert secret file, e.g. KEYS/client/cbctl.key_secret: its public key must be in the
 * service's allowed/) and --curve-server the service's public key (KEYS/public/<service>.key; with --push,
 * the same key serves ENDPOINT and --ping: both are cb-precompute's). The files are the ones `cbctl keys
 * init` makes (wire/curve.h). Every socket (requests, pings, PUSH) is then a CURVE client; a handshake the
 * service refuses (a key not allowed, the wrong server key, a plaintext service) is reported with its
 * reason before any message is sent (exit 2), so a secured run never passes without reaching the handlers.
 * The service must answer ping before fuzzing starts (else exit 2).
 *
 * Output: one summary line, or with --json one object {"endpoint", "curve", "templates", "sent", "ok",
 * "error_replies", "codes": {code: count}, "dropped" (no reply), "bad_replies" (a reply our decoder
 * rejects, or one with another id than a readable request's), "long_streams", "hung" (a stream silent
 * for --timeout without a terminal message), "alive"}.
 * Exit: 0 the service is alive and every reply was well-formed, none hung; 1 otherwise; 2 usage, unreadable
 * keys or templates, or a service that does not answer (or refuses the handshake) before fuzzing.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/alloc.h"
#include "base/log.h"
#include "wire/bus.h"
#include "wire/msg.h"

#define MAX_TEMPLATES 64
#define MAX_FRAME (1u << 20) /* our mutated frames stay below this (services allow 8 MiB) */
#define MAX_STREAM_MSGS 100000

typedef struct {
    uint64_t s;
} rng_t;

/* xorshift64*: small, seedable, good enough to pick mutations. */
static uint64_t rnd(rng_t *r) {
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545F4914F6CDD1DULL;
}
static size_t rnd_below(rng_t *r, size_t n) { return n ? (size_t)(rnd(r) % n) : 0; }

typedef struct {
    long sent, ok, err_replies, dropped, bad_replies, long_streams, hung;
    json_t *codes;
    bool alive;
} tally_t;

/* ------------------------------------------------------------------ structural mutations */

static json_t *random_string(rng_t *r) {
    static const char *const fixed[] = {"", "x", "0", "-1", "ff", "0123456789abcdef", "ZZZZZZZZZZZZZZZZ",
                                        "../../etc/passwd", "aa/../b.kv", "\xc3\xa9t\xc3\xa9", "\xe2\x80\x8b",
                                        "NEAR(a b)", "\"quoted\" OR x*", "a\tb\nc", "query", "done"};
    size_t pick = rnd_below(r, sizeof fixed / sizeof *fixed + 3);
    if (pick < sizeof fixed / sizeof *fixed) return json_string(fixed[pick]);
    /* a long run of one character: 300 B .. 300 KB (over most per-field limits) */
    size_t n = pick == sizeof fixed / sizeof *fixed ? 300 : pick == sizeof fixed / sizeof *fixed + 1 ? 5000 : 300000;
    char *s = cb_malloc(n + 1);
    if (!s) return json_string("");
    memset(s, rnd_below(r, 2) ? 'a' : '7', n);
    s[n] = 0;
    json_t *j = json_stringn(s, n);
    free(s);
    return j;
}

static json_t *random_value(rng_t *r, int depth) {
    static const json_int_t ints[] = {0, 1, -1, 2, 3, 5, 17, 50, 51, 255, 256, 1024, 4096, 4097, 65536,
                                      2147483647LL, -2147483648LL, 4294967296LL, INT64_MAX, INT64_MIN};
    static const double reals[] = {0.0, -0.0, 0.5, 1.5, -1.0, 1e-310, 1e308, -1e308, 2.0000001, 5.0, 0.15};
    switch (rnd_below(r, depth > 3 ? 5 : 7)) {
    case 0: return json_integer(ints[rnd_below(r, sizeof ints / sizeof *ints)]);
    case 1: return json_real(reals[rnd_below(r, sizeof reals / sizeof *reals)]);
    case 2: return random_string(r);
    case 3: return rnd_below(r, 2) ? json_true() : json_false();
    case 4: return json_null();
    case 5: {
        json_t *a = json_array();
        size_t n = rnd_below(r, 6) == 0 ? 300 : rnd_below(r, 5);
        for (size_t i = 0; i < n; i++) json_array_append_new(a, rnd_below(r, 2) ? random_string(r) : random_value(r, depth + 1));
        return a;
    }
    default: {
        json_t *o = json_object();
        size_t n = rnd_below(r, 4);
        for (size_t i = 0; i < n; i++) {
            char k[16];
            snprintf(k, sizeof k, "k%zu", i);
            json_object_set_new(o, k, random_value(r, depth + 1));
        }
        return o;
    }
    }
}

/* A mutated deep copy of the template (which has v, type and id). */
static json_t *mutate_json(rng_t *r, const json_t *tpl) {
    json_t *o = json_deep_copy(tpl);
    const char *keys[64];
    size_t nk = 0;
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v) if (nk < 64) keys[nk++] = k;
    int rounds = 1 + (int)rnd_below(r, 3);
    for (int i = 0; i < rounds && nk > 0; i++) {
        const char *key = keys[rnd_below(r, nk)];
        switch (rnd_below(r, 6)) {
        case 0: /* drop a field; keys[] may then point to a freed name: stop here */
            json_object_del(o, key);
            return o;
        case 1:
        case 2: json_object_set_new(o, key, random_value(r, 0)); break;
        case 3: json_object_set_new(o, "unknown_field", random_value(r, 0)); return o;
        case 4: json_object_set_new(o, "type", random_string(r)); return o;
        default: json_object_set_new(o, "v", random_value(r, 0)); return o;
        }
    }
    return o;
}

/* ------------------------------------------------------------------ byte-level mutations */

typedef struct {
    unsigned char *p;
    size_t n, cap;
} buf_t;

static bool buf_reserve(buf_t *b, size_t extra) {
    if (b->n + extra <= b->cap) return true;
    if (b->n + extra > MAX_FRAME) return false;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + extra && cap < MAX_FRAME) cap *= 2;
    unsigned char *q = cb_realloc(b->p, cap);
    if (!q) return false;
    b->p = q;
    b->cap = cap;
    return true;
}

static void buf_put(buf_t *b, const void *p, size_t n) {
    if (!buf_reserve(b, n)) return;
    memcpy(b->p + b->n, p, n);
    b->n += n;
}

/* Appends one raw entry to a top-level fixmap (count < 15), or does nothing. */
static void append_raw_entry(rng_t *r, buf_t *b) {
    if (b->n < 1 || b->p[0] < 0x80 || b->p[0] >= 0x8f) return;
    b->p[0]++;
    static const unsigned char k_type[] = {0xa4, 't', 'y', 'p', 'e'}, k_x[] = {0xa2, 'z', 'z'};
    static const unsigned char nan64[] = {0xcb, 0x7f, 0xf8, 0, 0, 0, 0, 0, 0};
    static const unsigned char inf32[] = {0xca, 0x7f, 0x80, 0, 0};
    static const unsigned char ext[] = {0xd4, 0x01, 0x00};
    static const unsigned char never[] = {0xc1};
    static const unsigned char str32[] = {0xdb, 0x7f, 0xff, 0xff, 0xff, 'a'};
    static const unsigned char arr32[] = {0xdd, 0xff, 0xff, 0xff, 0xff};
    static const unsigned char map32[] = {0xdf, 0x00, 0x10, 0x00, 0x00};
    static const unsigned char bin8[] = {0xc4, 0x03, 1, 2, 3};
    static const unsigned char neg[] = {0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0};
    switch (rnd_below(r, 10)) {
    case 0: buf_put(b, k_type, sizeof k_type); buf_put(b, k_type, sizeof k_type); break; /* duplicate key */
    case 1: buf_put(b, k_x, sizeof k_x); buf_put(b, nan64, sizeof nan64); break;
    case 2: buf_put(b, k_x, sizeof k_x); buf_put(b, inf32, sizeof inf32); break;
    case 3: buf_put(b, k_x, sizeof k_x); buf_put(b, ext, sizeof ext); break;
    case 4: buf_put(b, k_x, sizeof k_x); buf_put(b, never, sizeof never); break;
    case 5: buf_put(b, k_x, sizeof k_x); buf_put(b, str32, sizeof str32); break;
    case 6: buf_put(b, k_x, sizeof k_x); buf_put(b, arr32, sizeof arr32); break;
    case 7: buf_put(b, k_x, sizeof k_x); buf_put(b, map32, sizeof map32); break;
    case 8: { /* 1..40 nested one-element arrays */
        buf_put(b, k_x, sizeof k_x);
        size_t depth = 1 + rnd_below(r, 40);
        for (size_t i = 0; i < depth; i++) buf_put(b, "\x91", 1);
        buf_put(b, "\x01", 1);
        break;
    }
    default:
        buf_put(b, k_x, sizeof k_x);
        buf_put(b, rnd_below(r, 2) ? bin8 : neg, rnd_below(r, 2) ? sizeof bin8 : sizeof neg);
        break;
    }
}

static void mutate_bytes(rng_t *r, buf_t *b) {
    static const unsigned char interesting[] = {0x00, 0xff, 0xc1, 0xc0, 0xd4, 0xdd, 0xdf, 0xdb, 0x7f, 0x80,
                                                0x8f, 0x9f, 0xbf, 0xcb, 0xde, 0xdc};
    int rounds = 1 + (int)rnd_below(r, 4);
    for (int i = 0; i < rounds && b->n > 0; i++) {
        size_t at = rnd_below(r, b->n);
        switch (rnd_below(r, 6)) {
        case 0: b->p[at] ^= (unsigned char)(1u << rnd_below(r, 8)); break;
        case 1: b->p[at] = interesting[rnd_below(r, sizeof interesting)]; break;
        case 2: b->n = at; break; /* truncate */
        case 3:                   /* insert 1..8 random bytes */
            if (buf_reserve(b, 8)) {
                size_t k = 1 + rnd_below(r, 8);
                memmove(b->p + at + k, b->p + at, b->n - at);
                for (size_t j = 0; j < k; j++) b->p[at + j] = (unsigned char)rnd(r);
                b->n += k;
            }
            break;
        case 4: { /* trailing garbage */
            unsigned char g = interesting[rnd_below(r, sizeof interesting)];
            buf_put(b, &g, 1);
            break;
        }
        default: b->p[at] = (unsigned char)rnd(r); break;
        }
    }
}

/* ------------------------------------------------------------------ sending */

static bool encode(const json_t *o, buf_t *b) {
    cb_msg_writer_t *w = cb_msg_writer_new();
    if (!w) return false;
    cb_msg_begin_bare(w);
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)o, k, v) cb_msg_put_json(w, k, v);
    size_t len;
    const void *d = cb_msg_end(w, &len);
    b->n = 0;
    if (d) buf_put(b, d, len);
    cb_msg_writer_destroy(&w);
    return d != NULL && b->n == len;
}

/* The CURVE client state (off unless --curve-client/--curve-server): every socket of the run uses it. */
static cb_curve_t s_curve;

/* Turns s_curve on: the client pair from client_file, the server's public key from server_file for each
 * of the endpoints eps[n]. False with err naming the file. */
static bool curve_setup(const char *client_file, const char *server_file, const char *const *eps, int n, char *err,
                        size_t errlen) {
    memset(&s_curve, 0, sizeof s_curve);
    char server_pub[CB_CURVE_TXT];
    if (!cb_curve_read(client_file, s_curve.public_txt, s_curve.secret_txt, err, errlen)) return false;
    if (!cb_curve_read(server_file, server_pub, NULL, err, errlen)) return false;
    s_curve.on = true;
    snprintf(s_curve.identity, sizeof s_curve.identity, "cb-fuzzsock");
    /* the bus names KEYS/public/<peer>.key in a refusal: KEYS and the name of a server file laid out so */
    char name[16] = "fuzzed";
    size_t len = strlen(server_file);
    const char *base = strrchr(server_file, '/');
    base = base ? base + 1 : server_file;
    size_t dir_len = (size_t)(base - server_file), stem = strlen(base) >= 4 ? strlen(base) - 4 : 0;
    if (len > 4 && !strcmp(server_file + len - 4, ".key") && stem > 0 && stem < sizeof name && dir_len >= 8 &&
        !strncmp(base - 8, "/public/", 8) && dir_len - 8 < sizeof s_curve.keys_dir) {
        snprintf(name, sizeof name, "%.*s", (int)stem, base);
        snprintf(s_curve.keys_dir, sizeof s_curve.keys_dir, "%.*s", (int)(dir_len - 8), server_file);
    } else {
        snprintf(s_curve.keys_dir, sizeof s_curve.keys_dir, "?");
    }
    for (int i = 0; i < n && s_curve.n_peers < CB_CURVE_MAX_PEERS; i++) {
        if (cb_curve_peer(&s_curve, eps[i])) continue;
        cb_curve_peer_t *p = &s_curve.peers[s_curve.n_peers];
        if (strlen(eps[i]) >= sizeof p->endpoint) {
            snprintf(err, errlen, "endpoint too long: %s", eps[i]);
            return false;
        }
        snprintf(p->endpoint, sizeof p->endpoint, "%s", eps[i]);
        snprintf(p->name, sizeof p->name, "%s", name);
        memcpy(p->public_txt, server_pub, CB_CURVE_TXT);
        s_curve.n_peers++;
    }
    return true;
}

/* Whether the service at ep answers ping (3 s x 2 attempts); why not in err (may be NULL). */
static bool ping(const char *ep, char *err, size_t errlen) {
    cb_bus_opts_t o;
    cb_bus_opts_default(&o);
    o.request_timeout_ms = 3000;
    o.request_retries = 1;
    o.curve = s_curve;
    char e[512] = "";
    cb_bus_client_t *c = cb_bus_client_new(ep, &o, e, sizeof e);
    cb_msg_writer_t *w = cb_msg_writer_new();
    bool up = false;
    if (c && w) {
        char id[32];
        cb_msg_begin(w, "ping", cb_bus_new_id(id, sizeof id));
        cb_err_t code;
        cb_msg_t *m = cb_bus_call(c, w, &code, e, sizeof e);
        up = m && cb_msg_ok(m);
        if (m && !up) snprintf(e, sizeof e, "ping refused: %s: %s", cb_msg_err_code_name(m), cb_msg_err_message(m));
        cb_msg_destroy(&m);
    }
    cb_msg_writer_destroy(&w);
    cb_bus_client_destroy(&c);
    if (err && errlen) snprintf(err, errlen, "%s", e);
    return up;
}

static void count_code(tally_t *t, const char *code) {
    json_t *c = json_object_get(t->codes, code);
    json_object_set_new(t->codes, code, json_integer(c ? json_integer_value(c) + 1 : 1));
}

/* Sends one frame on c and reads its reply (or stream). Returns false when c must be reopened. */
static bool exchange(cb_bus_client_t *c, const buf_t *b, int timeout_ms, int stream_ms, bool baseline, tally_t *t,
                     const char *label) {
    char err[512];
    if (cb_bus_send_raw(c, b->p, b->n, err, sizeof err) != 0) {
        t->dropped++;
        fprintf(stderr, "cb-fuzzsock: %s: send failed: %s\n", label, err);
        return false;
    }
    t->sent++;
    /* the id our request carries, when it is readable, for the reply check */
    cb_msg_error_t me;
    cb_msg_t *req = cb_msg_decode_ex(b->p, b->n, MAX_FRAME, &me);
    char want_id[CB_MSG_MAX_ID + 1] = "";
    if (req) snprintf(want_id, sizeof want_id, "%s", cb_msg_id(req));
    cb_msg_destroy(&req);
    double start = cb_now_ms(), last = start;
    bool got_any = false;
    for (int i = 0; i < MAX_STREAM_MSGS; i++) {
        double now = cb_now_ms();
        if (now - start > stream_ms) {
            t->long_streams++;
            return false; /* abandon the stream: a new socket */
        }
        int left = timeout_ms - (int)(now - last);
        zframe_t *f = left > 0 ? cb_bus_recv_raw(c, left) : NULL;
        if (!f) {
            if (got_any) {
                t->hung++;
                fprintf(stderr, "cb-fuzzsock: %s: stream silent for %d ms without done\n", label, timeout_ms);
            } else {
                t->dropped++;
                if (baseline) fprintf(stderr, "cb-fuzzsock: %s: the valid template got no reply\n", label);
            }
            return false;
        }
        got_any = true;
        last = cb_now_ms();
        cb_msg_error_t e;
        cb_msg_t *m = cb_msg_decode_ex(zframe_data(f), zframe_size(f), CB_MSG_DEFAULT_MAX_BYTES, &e);
        zframe_destroy(&f);
        if (!m || !cb_msg_is_reply(m)) {
            t->bad_replies++;
            fprintf(stderr, "cb-fuzzsock: %s: malformed reply (%s)\n", label, m ? "not a reply" : e.message);
            cb_msg_destroy(&m);
            return false;
        }
        if (want_id[0] && strcmp(cb_msg_id(m), want_id) != 0 && strcmp(cb_msg_type(m), "error") != 0) {
            t->bad_replies++;
            fprintf(stderr, "cb-fuzzsock: %s: reply id '%s' for request id '%s'\n", label, cb_msg_id(m), want_id);
            cb_msg_destroy(&m);
            return false;
        }
        if (!cb_msg_ok(m)) {
            t->err_replies++;
            count_code(t, cb_msg_err_code_name(m)[0] ? cb_msg_err_code_name(m) : "?");
            if (baseline) fprintf(stderr, "cb-fuzzsock: %s: the valid template was refused: %s: %s\n", label,
                                  cb_msg_err_code_name(m), cb_msg_err_message(m));
            cb_msg_destroy(&m);
            return true;
        }
        const char *type = cb_msg_type(m);
        bool stream_part = !strcmp(type, "token") || !strcmp(type, "heartbeat");
        bool end = !stream_part;
        if (end) {
            t->ok++;
            count_code(t, "ok");
        }
        cb_msg_destroy(&m);
        if (end) return true;
    }
    t->long_streams++;
    return false;
}

static int usage(void) {
    fprintf(stderr, "usage: cb-fuzzsock [--seed S] [--n N] [--timeout MS] [--stream-ms MS] [--push --ping ENDPOINT] [--json]\n"
                    "                   [--curve-client KEY_SECRET_FILE --curve-server PUBLIC_KEY_FILE]\n"
                    "                   ENDPOINT TEMPLATES.jsonl\n");
    return 2;
}

int main(int argc, char **argv) {
    cb_log_set_component("cb-fuzzsock");
    setenv("ZSYS_SIGHANDLER", "false", 0);
    uint64_t seed = 1;
    long n = 100;
    int timeout_ms = 5000, stream_ms = 20000, i = 1;
    bool push = false, json = false;
    const char *ping_ep = NULL, *curve_client = NULL, *curve_server = NULL;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--n") && i + 1 < argc) n = atol(argv[++i]);
        else if (!strcmp(argv[i], "--timeout") && i + 1 < argc) timeout_ms = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--stream-ms") && i + 1 < argc) stream_ms = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--push")) push = true;
        else if (!strcmp(argv[i], "--ping") && i + 1 < argc) ping_ep = argv[++i];
        else if (!strcmp(argv[i], "--json")) json = true;
        else if (!strcmp(argv[i], "--curve-client") && i + 1 < argc) curve_client = argv[++i];
        else if (!strcmp(argv[i], "--curve-server") && i + 1 < argc) curve_server = argv[++i];
        else return usage();
    }
    if (i + 2 != argc || n < 1 || n > 1000000 || timeout_ms < 1 || stream_ms < 1 || (push && !ping_ep) ||
        !curve_client != !curve_server)
        return usage();
    const char *ep = argv[i];
    if (!ping_ep) ping_ep = ep;
    FILE *f = fopen(argv[i + 1], "r");
    if (!f) {
        perror(argv[i + 1]);
        return 2;
    }
    json_t *tpl[MAX_TEMPLATES];
    int nt = 0;
    char *line = NULL;
    size_t cap = 0;
    for (int ln = 0; ln < 10000 && nt < MAX_TEMPLATES && getline(&line, &cap, f) > 0; ln++) {
        json_t *o = json_loads(line, 0, NULL);
        if (!json_is_object(o)) {
            json_decref(o);
            continue;
        }
        if (!json_object_get(o, "v")) json_object_set_new(o, "v", json_integer(1));
        tpl[nt++] = o;
    }
    free(line);
    fclose(f);
    if (nt == 0) {
        fprintf(stderr, "cb-fuzzsock: no templates in %s\n", argv[i + 1]);
        return 2;
    }
    zsys_init();
    char err[512];
    if (curve_client) {
        const char *eps[2] = {ep, ping_ep};
        if (!curve_setup(curve_client, curve_server, eps, 2, err, sizeof err)) {
            fprintf(stderr, "cb-fuzzsock: curve: %s\n", err);
            for (int k = 0; k < nt; k++) json_decref(tpl[k]);
            return 2;
        }
    }
    /* a service that cannot be reached (or refuses our handshake) now would make every message "dropped" */
    if (!ping(ping_ep, err, sizeof err)) {
        fprintf(stderr, "cb-fuzzsock: %s does not answer ping before fuzzing: %s", ping_ep, err);
        if (s_curve.on) fprintf(stderr, " [CURVE: client key %s, server key %s]", curve_client, curve_server);
        fputc('\n', stderr);
        for (int k = 0; k < nt; k++) json_decref(tpl[k]);
        return 2;
    }
    rng_t r = {seed * 0x9E3779B97F4A7C15ULL + 1};
    tally_t t = {.codes = json_object(), .alive = true};
    cb_bus_opts_t o;
    cb_bus_opts_default(&o);
    o.max_msg_bytes = 64 << 20;
    o.send_timeout_ms = 3000;
    o.curve = s_curve;
    cb_bus_client_t *c = NULL;
    zsock_t *pushs = NULL;
    if (push && !(pushs = cb_bus_socket(ZMQ_PUSH, ep, false, &o, err, sizeof err))) {
        fprintf(stderr, "cb-fuzzsock: %s\n", err);
        return 2;
    }
    buf_t b = {0};
    for (int k = 0; k < nt && t.alive; k++) {
        const char *type = json_string_value(json_object_get(tpl[k], "type"));
        for (long j = 0; j < n && t.alive; j++) {
            char label[96];
            snprintf(label, sizeof label, "%s #%ld", type ? type : "?", j);
            json_t *m = j == 0 ? json_deep_copy(tpl[k]) : mutate_json(&r, tpl[k]);
            if (!json_object_get(m, "id") || j > 0) {
                /* a fresh readable id, unless a mutation made it something else */
                json_t *id = json_object_get(m, "id");
                if (!id || json_is_string(id)) {
                    char idb[48];
                    snprintf(idb, sizeof idb, "fz-%d-%ld", k, j);
                    json_object_set_new(m, "id", json_string(idb));
                }
            }
            bool ok = encode(m, &b);
            json_decref(m);
            if (!ok) { /* the writer refused (e.g. too deep): send the template's bytes mutated instead */
                json_t *base = json_deep_copy(tpl[k]);
                ok = encode(base, &b);
                json_decref(base);
                if (!ok) continue;
            }
            if (j > 0) {
                size_t how = rnd_below(&r, 3);
                if (how == 1) append_raw_entry(&r, &b);
                else if (how == 2) mutate_bytes(&r, &b);
            }
            if (push) {
                if (zmq_send(zsock_resolve(pushs), b.p, b.n, 0) < 0) {
                    t.dropped++;
                    if (!ping(ping_ep, NULL, 0)) t.alive = false;
                } else {
                    t.sent++;
                }
                continue;
            }
            if (!c && !(c = cb_bus_client_new(ep, &o, err, sizeof err))) {
                fprintf(stderr, "cb-fuzzsock: %s\n", err);
                return 2;
            }
            if (!exchange(c, &b, timeout_ms, stream_ms, j == 0, &t, label)) {
                cb_bus_client_destroy(&c); /* late replies must not be read as the next one's */
                if (!ping(ping_ep, NULL, 0)) {
                    fprintf(stderr, "cb-fuzzsock: %s: the service does not answer ping any more\n", label);
                    t.alive = false;
                }
            }
        }
    }
    cb_bus_client_destroy(&c);
    zsock_destroy(&pushs);
    if (t.alive && !ping(ping_ep, NULL, 0)) t.alive = false;
    for (int k = 0; k < nt; k++) json_decref(tpl[k]);
    free(b.p);
    json_t *out = json_pack("{s:s, s:b, s:i, s:I, s:I, s:I, s:O, s:I, s:I, s:I, s:I, s:b}", "endpoint", ep, "curve",
                            s_curve.on, "templates", nt, "sent", (json_int_t)t.sent, "ok", (json_int_t)t.ok,
                            "error_replies", (json_int_t)t.err_replies, "codes", t.codes, "dropped", (json_int_t)t.dropped,
                            "bad_replies", (json_int_t)t.bad_replies, "long_streams", (json_int_t)t.long_streams, "hung",
                            (json_int_t)t.hung, "alive", t.alive);
    if (json) {
        json_dumpf(out, stdout, JSON_COMPACT);
        fputc('\n', stdout);
    } else {
        printf("%s%s: %d templates, %ld sent: %ld ok, %ld error replies, %ld dropped, %ld bad replies, %ld hung; %s\n",
               ep, s_curve.on ? " (CURVE)" : "", nt, t.sent, t.ok, t.err_replies, t.dropped, t.bad_replies, t.hung,
               t.alive ? "alive" : "DOWN");
    }
    json_decref(out);
    json_decref(t.codes);
    return t.alive && t.bad_replies == 0 && t.hung == 0 ? 0 : 1;
}
