/* kvremote.c: the Redis tier (see kvremote.h). hiredis makes the connection (redisConnect*NonBlock), formats
 * commands (redisFormatCommandArgv) and parses replies (a redisReader with our own reply objects); the bytes
 * move here, non-blocking, against a deadline. Owns: the option copies, the connection and its reader.
 *
 * Every reply is checked before hiredis parses it: its first line must be one of the top-level types our
 * commands can get ('+', '-', ':', '$'; never an array), a bulk length must be -1 or 0..max_value_bytes,
 * and the bytes read for one reply are bounded by that length. A reply that breaks any of this drops the
 * connection.
 */
#include "kv/kvremote.h"
#include "base/alloc.h"

#include <errno.h>
#include <hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "base/clock.h"
#include "base/err.h"
#include "base/log.h"
#include "format/kvfile.h"

#define KVREMOTE_MAX_VALUE ((size_t)512 << 20) /* Redis' own default proto-max-bulk-len */
#define KVREMOTE_HDR_MAX 64                     /* bytes of a reply's first line, CRLF included */
#define KVREMOTE_RECV_CHUNK 65536
#define KVREMOTE_ERR_LOG_MS 60000.0             /* error replies: one warning a minute */

/* A reply as our reader builds it (only top-level values: createArray refuses). */
typedef struct {
    int type;          /* REDIS_REPLY_STRING | STATUS | ERROR | INTEGER | NIL */
    long long integer; /* INTEGER */
    char *str;         /* STRING, STATUS, ERROR: [len] bytes + NUL (malloc'd) */
    size_t len;
} reply_t;

struct cb_kvremote {
    char *url;                  /* as given, for logs */
    char *host;                 /* TCP, or NULL */
    int port;
    char *unix_path;            /* Unix socket, or NULL */
    char *password;             /* NULL = no AUTH */
    char *prefix;
    int connect_timeout_ms, timeout_ms, recovery_ms;
    size_t max_value;

    pthread_mutex_t mu;         /* the fields below */
    redisContext *c;            /* NULL: not connected */
    redisReader *reader;        /* with c: our reply objects */
    bool fresh;                 /* c has not carried a command yet */
    bool down;                  /* marked down (skipped until retry_at) */
    double down_since_ms, retry_at_ms;
    double err_logged_ms;       /* last error-reply warning */

    atomic_uint_fast64_t hits, misses, errors, corrupt, skipped, puts, bytes_read, bytes_written, downs;
    atomic_bool up;
};

/* ---------------------------------------------------------------- reply objects */

static void *reply_new(int type) {
    reply_t *r = cb_calloc(1, sizeof *r);
    if (r) r->type = type;
    return r;
}

static void *create_string(const redisReadTask *task, char *str, size_t len) {
    if (task->parent) return NULL; /* never: arrays are refused */
    reply_t *r = reply_new(task->type);
    if (!r) return NULL;
    if (!(r->str = cb_malloc(len + 1))) {
        free(r);
        return NULL;
    }
    memcpy(r->str, str, len);
    r->str[len] = '\0';
    r->len = len;
    return r;
}

static void *create_array(const redisReadTask *task, int elements) {
    (void)task, (void)elements;
    return NULL; /* our commands never get one: the reader fails ("out of memory") */
}

static void *create_integer(const redisReadTask *task, long long value) {
    if (task->parent) return NULL;
    reply_t *r = reply_new(REDIS_REPLY_INTEGER);
    if (r) r->integer = value;
    return r;
}

static void *create_nil(const redisReadTask *task) {
    if (task->parent) return NULL;
    return reply_new(REDIS_REPLY_NIL);
}

static void reply_free(void *p) {
    reply_t *r = p;
    if (!r) return;
    free(r->str);
    free(r);
}

static redisReplyObjectFunctions REPLY_FNS = {create_string, create_array, create_integer, create_nil, reply_free};

/* ---------------------------------------------------------------- options */

void cb_kvremote_opts_default(cb_kvremote_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->connect_timeout_ms = 500;
    o->timeout_ms = 1000;
    o->recovery_ms = 5000;
    o->prefix = "cb";
    o->max_value_bytes = (size_t)64 << 20;
}

const char *cb_kvremote_rc_str(cb_kvremote_rc_t rc) {
    switch (rc) {
    case CB_KVREMOTE_OK: return "ok";
    case CB_KVREMOTE_MISS: return "miss";
    case CB_KVREMOTE_DOWN: return "down";
    case CB_KVREMOTE_ERROR: return "error";
    case CB_KVREMOTE_TOO_LARGE: return "too_large";
    }
    return "?";
}

static bool prefix_ok(const char *p) {
    size_t n = strlen(p);
    if (n == 0 || n > CB_KVREMOTE_MAX_PREFIX) return false;
    for (size_t i = 0; i < n; i++) {
        char ch = p[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
              ch == '-' || ch == '.'))
            return false;
    }
    return true;
}

/* "redis://HOST[:PORT][/]" or "unix:///PATH" into s->host/port or s->unix_path. 0, or -1 (err). */
static int parse_url(cb_kvremote_t *s, const char *url, char *err, size_t errlen) {
    if (!strncmp(url, "unix://", 7)) {
        const char *p = url + 7;
        if (p[0] != '/' || strlen(p) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
            cb_set_err(err, errlen, "kvremote: '%s': expected unix:///PATH (absolute, under 108 bytes)", url);
            return -1;
        }
        if (!(s->unix_path = cb_strdup(p))) goto oom;
        return 0;
    }
    if (strncmp(url, "redis://", 8) != 0) {
        cb_set_err(err, errlen, "kvremote: '%s': expected redis://HOST:PORT or unix:///PATH", url);
        return -1;
    }
    const char *h = url + 8, *end;
    size_t hl;
    if (*h == '[') { /* [IPv6] */
        const char *cl = strchr(h, ']');
        if (!cl) goto bad;
        h++;
        hl = (size_t)(cl - h);
        end = cl + 1;
    } else {
        end = h + strcspn(h, ":/");
        hl = (size_t)(end - h);
    }
    if (hl == 0 || hl > 255 || memchr(h, '@', hl)) goto bad; /* the password is its own option */
    long port = 6379;
    if (*end == ':') {
        char *q;
        errno = 0;
        port = strtol(end + 1, &q, 10);
        if (q == end + 1 || errno || port < 1 || port > 65535) goto bad;
        end = q;
    }
    if (*end == '/') end++;
    if (*end != '\0') goto bad;
    if (!(s->host = cb_strndup(h, hl))) goto oom;
    s->port = (int)port;
    return 0;
oom:
    cb_set_err(err, errlen, "kvremote: out of memory");
    return -1;
bad:
    cb_set_err(err, errlen, "kvremote: '%s': expected redis://HOST[:PORT] (PORT 1..65535; no user or password "
               "in the URL, no database path)", url);
    return -1;
}

/* ---------------------------------------------------------------- lifetime */

static void drop_conn(cb_kvremote_t *s) {
    if (s->reader) redisReaderFree(s->reader);
    s->reader = NULL;
    if (s->c) redisFree(s->c);
    s->c = NULL;
}

static cb_kvremote_rc_t connect_now(cb_kvremote_t *s, char *err, size_t errlen);
static void mark_down(cb_kvremote_t *s, const char *why);
static void mark_up(cb_kvremote_t *s);

cb_kvremote_t *cb_kvremote_new(const cb_kvremote_opts_t *o, char *err, size_t errlen) {
    if (!o || !o->url || !*o->url) {
        cb_set_err(err, errlen, "kvremote: no URL");
        return NULL;
    }
    const char *prefix = o->prefix && *o->prefix ? o->prefix : "cb";
    if (!prefix_ok(prefix)) {
        cb_set_err(err, errlen, "kvremote: key prefix '%.80s': expected 1..%d of [A-Za-z0-9_.-]", prefix,
                   CB_KVREMOTE_MAX_PREFIX);
        return NULL;
    }
    if (o->connect_timeout_ms < 1 || o->connect_timeout_ms > 600000 || o->timeout_ms < 1 || o->timeout_ms > 600000 ||
        o->recovery_ms < 1 || o->recovery_ms > 86400000) {
        cb_set_err(err, errlen, "kvremote: timeouts out of range (connect %d, command %d: 1..600000 ms; recovery %d: "
                   "1..86400000 ms)", o->connect_timeout_ms, o->timeout_ms, o->recovery_ms);
        return NULL;
    }
    if (o->max_value_bytes < 1 || o->max_value_bytes > KVREMOTE_MAX_VALUE) {
        cb_set_err(err, errlen, "kvremote: max value bytes %zu: expected 1..%zu", o->max_value_bytes,
                   KVREMOTE_MAX_VALUE);
        return NULL;
    }
    cb_kvremote_t *s = cb_calloc(1, sizeof *s);
    if (!s) goto oom;
    pthread_mutex_init(&s->mu, NULL);
    s->connect_timeout_ms = o->connect_timeout_ms;
    s->timeout_ms = o->timeout_ms;
    s->recovery_ms = o->recovery_ms;
    s->max_value = o->max_value_bytes;
    if (!(s->url = cb_strdup(o->url)) || !(s->prefix = cb_strdup(prefix))) goto oom;
    if (o->password && *o->password && !(s->password = cb_strdup(o->password))) goto oom;
    if (parse_url(s, o->url, err, errlen) != 0) {
        cb_kvremote_destroy(&s);
        return NULL;
    }
    /* the first connect: a server that is not there yet starts the tier down (logged), not an error */
    pthread_mutex_lock(&s->mu);
    char cerr[256] = "";
    if (connect_now(s, cerr, sizeof cerr) == CB_KVREMOTE_OK) {
        atomic_store(&s->up, true);
        CB_INFO("kvremote: connected to %s (key prefix %s, timeout %d ms, recovery %d ms)", s->url, s->prefix,
                s->timeout_ms, s->recovery_ms);
    } else {
        atomic_fetch_add(&s->errors, 1);
        mark_down(s, cerr);
    }
    pthread_mutex_unlock(&s->mu);
    return s;
oom:
    cb_set_err(err, errlen, "kvremote: out of memory");
    cb_kvremote_destroy(&s);
    return NULL;
}

void cb_kvremote_destroy(cb_kvremote_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_kvremote_t *s = *self_p;
    drop_conn(s);
    pthread_mutex_destroy(&s->mu);
    free(s->url);
    free(s->host);
    free(s->unix_path);
    if (s->password) {
        memset(s->password, 0, strlen(s->password));
        free(s->password);
    }
    free(s->prefix);
    free(s);
    *self_p = NULL;
}

/* ---------------------------------------------------------------- bounded I/O */

/* Waits until fd is ready for events or the deadline passes. 0 ready, -1 (err: timeout or poll failure). */
static int wait_fd(int fd, short events, double deadline_ms, char *err, size_t errlen) {
    for (;;) {
        double left = deadline_ms - cb_now_ms();
        if (left <= 0) {
            cb_set_err(err, errlen, "timed out");
            return -1;
        }
        struct pollfd p = {.fd = fd, .events = events};
        int rc = poll(&p, 1, (int)left + 1);
        if (rc < 0 && errno == EINTR) continue;
        if (rc < 0) {
            cb_set_err(err, errlen, "poll: %s", strerror(errno));
            return -1;
        }
        if (rc > 0) return 0; /* readable, writable, or an error/hangup the next call reports */
    }
}

/* Sends buf [n] before the deadline. 0, or -1 (err; *peer_gone when the peer had closed the connection). */
static int send_all(int fd, const char *buf, size_t n, double deadline_ms, bool *peer_gone, char *err,
                    size_t errlen) {
    while (n > 0) {
        ssize_t k = send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            buf += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (wait_fd(fd, POLLOUT, deadline_ms, err, errlen) != 0) return -1;
            continue;
        }
        *peer_gone = k < 0 && (errno == EPIPE || errno == ECONNRESET);
        cb_set_err(err, errlen, "send: %s", k < 0 ? strerror(errno) : "nothing sent");
        return -1;
    }
    return 0;
}

/* Checks a reply's first line hdr [n] (CRLF at its end): a type our commands get, a bulk length in
 * -1..max. 0, or -1 (err). *body: the bytes of the reply after its first line (a bulk's length + CRLF). */
static int check_header(const char *hdr, size_t n, size_t max, size_t *body, char *err, size_t errlen) {
    *body = 0;
    switch (hdr[0]) {
    case '+':
    case '-':
    case ':':
        return 0;
    case '$': {
        char num[KVREMOTE_HDR_MAX];
        memcpy(num, hdr + 1, n - 3);
        num[n - 3] = '\0';
        char *q;
        errno = 0;
        long long len = strtoll(num, &q, 10);
        if (q == num || *q || errno || len < -1) break;
        if (len > 0 && (unsigned long long)len > max) {
            cb_set_err(err, errlen, "a value of %lld bytes (over the bound of %zu)", len, max);
            return -2;
        }
        *body = len < 0 ? 0 : (size_t)len + 2;
        return 0;
    }
    default:
        break;
    }
    cb_set_err(err, errlen, "not a reply this client expects (first byte 0x%02x)", (unsigned char)hdr[0]);
    return -1;
}

/* Reads one reply before the deadline into *out (caller frees with reply_free). 0; -1 (err; *peer_gone:
 * closed by the peer); -2: a bulk over max (err). */
static int read_reply(cb_kvremote_t *s, double deadline_ms, size_t max, reply_t **out, bool *peer_gone,
                      char *err, size_t errlen) {
    char buf[KVREMOTE_RECV_CHUNK];
    char hdr[KVREMOTE_HDR_MAX];
    size_t hdr_n = 0, total = 0, expect = 0; /* expect: the reply's whole size once its header is known */
    bool hdr_ok = false;
    *out = NULL;
    for (;;) {
        void *r = NULL;
        if (redisReaderGetReply(s->reader, &r) != REDIS_OK) {
            cb_set_err(err, errlen, "protocol error: %s", s->reader->errstr);
            return -1;
        }
        if (r) {
            *out = r;
            return 0;
        }
        if (hdr_ok && total >= expect) { /* all its bytes are in and hiredis still has no reply */
            cb_set_err(err, errlen, "protocol error: a malformed reply");
            return -1;
        }
        if (wait_fd(s->c->fd, POLLIN, deadline_ms, err, errlen) != 0) return -1;
        size_t want = sizeof buf;
        if (hdr_ok && expect - total < want) want = expect - total; /* never read past this reply */
        ssize_t k = recv(s->c->fd, buf, want, MSG_DONTWAIT);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (k <= 0) {
            *peer_gone = k == 0 || errno == ECONNRESET;
            cb_set_err(err, errlen, "%s", k == 0 ? "connection closed by the server" : strerror(errno));
            return -1;
        }
        if (!hdr_ok) { /* the first line, checked before hiredis sees it */
            size_t take = (size_t)k < sizeof hdr - hdr_n ? (size_t)k : sizeof hdr - hdr_n;
            memcpy(hdr + hdr_n, buf, take);
            hdr_n += take;
            char *lf = memchr(hdr, '\n', hdr_n);
            if (!lf && hdr_n == sizeof hdr) {
                cb_set_err(err, errlen, "protocol error: a reply line longer than %d bytes", KVREMOTE_HDR_MAX);
                return -1;
            }
            if (lf) {
                size_t line = (size_t)(lf - hdr) + 1, body;
                if (line < 3 || hdr[line - 2] != '\r') {
                    cb_set_err(err, errlen, "protocol error: a reply line without CRLF");
                    return -1;
                }
                int hc = check_header(hdr, line, max, &body, err, errlen);
                if (hc) return hc;
                hdr_ok = true;
                expect = line + body; /* status, error, integer: the line alone */
                if (total + (size_t)k > expect) {
                    cb_set_err(err, errlen, "protocol error: bytes after the reply");
                    return -1;
                }
            }
        }
        total += (size_t)k;
        if (redisReaderFeed(s->reader, buf, (size_t)k) != REDIS_OK) {
            cb_set_err(err, errlen, "protocol error: %s", s->reader->errstr);
            return -1;
        }
    }
}

/* One command on the current connection: sent, its reply read (*out, caller frees). 0; -1 I/O, timeout or
 * protocol failure (*peer_gone: the peer had closed it); -2 a bulk reply over max. The connection is
 * dropped on any failure. */
static int roundtrip(cb_kvremote_t *s, int argc, const char **argv, const size_t *argvlen, size_t max,
                     double deadline_ms, reply_t **out, bool *peer_gone, char *err, size_t errlen) {
    char *cmd = NULL;
    int n = redisFormatCommandArgv(&cmd, argc, argv, argvlen);
    if (n < 0 || !cmd) {
        cb_set_err(err, errlen, "out of memory (formatting a command)");
        return -1;
    }
    *peer_gone = false;
    int rc = send_all(s->c->fd, cmd, (size_t)n, deadline_ms, peer_gone, err, errlen);
    redisFreeCommand(cmd);
    if (rc == 0) rc = read_reply(s, deadline_ms, max, out, peer_gone, err, errlen);
    if (rc != 0) drop_conn(s);
    s->fresh = false;
    return rc;
}

/* Connects (and AUTHs) within connect_timeout_ms. CB_KVREMOTE_OK, or CB_KVREMOTE_ERROR (err). */
static cb_kvremote_rc_t connect_now(cb_kvremote_t *s, char *err, size_t errlen) {
    drop_conn(s);
    const double deadline = cb_now_ms() + s->connect_timeout_ms;
    redisContext *c = s->unix_path ? redisConnectUnixNonBlock(s->unix_path) : redisConnectNonBlock(s->host, s->port);
    if (!c) {
        cb_set_err(err, errlen, "connect: out of memory");
        return CB_KVREMOTE_ERROR;
    }
    if (c->err) {
        cb_set_err(err, errlen, "connect: %s", c->errstr);
        redisFree(c);
        return CB_KVREMOTE_ERROR;
    }
    if (wait_fd(c->fd, POLLOUT, deadline, err, errlen) != 0) { /* an in-progress connect completes */
        char e2[128];
        snprintf(e2, sizeof e2, "connect: %s", err ? err : "timed out");
        cb_set_err(err, errlen, "%s", e2);
        redisFree(c);
        return CB_KVREMOTE_ERROR;
    }
    int soerr = 0;
    socklen_t sl = sizeof soerr;
    if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0 || soerr) {
        cb_set_err(err, errlen, "connect: %s", strerror(soerr ? soerr : errno));
        redisFree(c);
        return CB_KVREMOTE_ERROR;
    }
    if (!(s->reader = redisReaderCreateWithFunctions(&REPLY_FNS))) {
        cb_set_err(err, errlen, "connect: out of memory");
        redisFree(c);
        return CB_KVREMOTE_ERROR;
    }
    s->c = c;
    s->fresh = true;
    if (s->password) {
        const char *argv[2] = {"AUTH", s->password};
        size_t lens[2] = {4, strlen(s->password)};
        reply_t *r = NULL;
        bool gone;
        if (roundtrip(s, 2, argv, lens, 0, deadline, &r, &gone, err, errlen) != 0) return CB_KVREMOTE_ERROR;
        bool ok = r->type == REDIS_REPLY_STATUS && !strcmp(r->str, "OK");
        if (!ok) {
            cb_set_err(err, errlen, "AUTH refused: %.120s", r->str ? r->str : "(not a status reply)");
            drop_conn(s);
        }
        reply_free(r);
        if (!ok) return CB_KVREMOTE_ERROR;
        s->fresh = true;
    }
    return CB_KVREMOTE_OK;
}

/* ---------------------------------------------------------------- health */

/* Under mu. The connection is dropped; the tier is skipped for recovery_ms; one warning at the transition. */
static void mark_down(cb_kvremote_t *s, const char *why) {
    drop_conn(s);
    double now = cb_now_ms();
    s->retry_at_ms = now + s->recovery_ms;
    if (s->down) {
        CB_DEBUG("kvremote: %s still down: %s", s->url, why);
        return;
    }
    s->down = true;
    s->down_since_ms = now;
    atomic_store(&s->up, false);
    atomic_fetch_add(&s->downs, 1);
    CB_WARN("kvremote: %s is down (%s): the shared KV tier is skipped (chunks computed instead) and retried every "
            "%d ms", s->url, why, s->recovery_ms);
}

/* Under mu: a connect worked. */
static void mark_up(cb_kvremote_t *s) {
    if (s->down)
        CB_INFO("kvremote: %s is back (down for %.1f s)", s->url, (cb_now_ms() - s->down_since_ms) / 1000.0);
    s->down = false;
    atomic_store(&s->up, true);
}

/* One command, under mu: connects first when needed (unless the tier is down and its recovery interval is
 * not over: CB_KVREMOTE_DOWN); a connection that turns out to have been closed by the server (a restart)
 * is replaced once. Failures mark the tier down, except error replies (the server answered) and over-size
 * bulks (TOO_LARGE). On CB_KVREMOTE_OK *out is the reply (never an error reply; caller frees). */
static cb_kvremote_rc_t call(cb_kvremote_t *s, int argc, const char **argv, const size_t *argvlen, size_t max,
                             reply_t **out, char *err, size_t errlen) {
    *out = NULL;
    char e[256] = "";
    for (int attempt = 0; attempt < 2; attempt++) {
        if (!s->c) {
            if (s->down && cb_now_ms() < s->retry_at_ms) {
                atomic_fetch_add(&s->skipped, 1);
                cb_set_err(err, errlen, "kvremote: %s is down", s->url);
                return CB_KVREMOTE_DOWN;
            }
            if (connect_now(s, e, sizeof e) != CB_KVREMOTE_OK) {
                atomic_fetch_add(&s->errors, 1);
                mark_down(s, e);
                cb_set_err(err, errlen, "kvremote: %s: %s", s->url, e);
                return CB_KVREMOTE_ERROR;
            }
            mark_up(s);
        }
        bool reused = !s->fresh, gone = false;
        int rc = roundtrip(s, argc, argv, argvlen, max, cb_now_ms() + s->timeout_ms, out, &gone, e, sizeof e);
        if (rc == -2) {
            cb_set_err(err, errlen, "kvremote: %s: %s", s->url, e);
            return CB_KVREMOTE_TOO_LARGE;
        }
        if (rc != 0) {
            if (gone && reused && attempt == 0) continue; /* a stale connection (the server restarted): once more */
            atomic_fetch_add(&s->errors, 1);
            char what[300];
            snprintf(what, sizeof what, "%s: %s", argv[0], e);
            mark_down(s, what);
            cb_set_err(err, errlen, "kvremote: %s: %s", s->url, e);
            return CB_KVREMOTE_ERROR;
        }
        break;
    }
    reply_t *r = *out;
    if (r->type == REDIS_REPLY_ERROR) {
        atomic_fetch_add(&s->errors, 1);
        double now = cb_now_ms();
        if (now - s->err_logged_ms >= KVREMOTE_ERR_LOG_MS || s->err_logged_ms == 0) {
            s->err_logged_ms = now;
            CB_WARN("kvremote: %s answered %s with an error: %.200s (logged once a minute)", s->url, argv[0], r->str);
        }
        cb_set_err(err, errlen, "kvremote: %s: %s: %.200s", s->url, argv[0], r->str);
        reply_free(r);
        *out = NULL;
        return CB_KVREMOTE_ERROR;
    }
    return CB_KVREMOTE_OK;
}

/* A reply of an unexpected type: counted as an error; the connection is dropped (it may be out of step). */
static cb_kvremote_rc_t unexpected(cb_kvremote_t *s, const char *cmd, reply_t **r, char *err, size_t errlen) {
    atomic_fetch_add(&s->errors, 1);
    cb_set_err(err, errlen, "kvremote: %s: unexpected reply type %d to %s", s->url, (*r)->type, cmd);
    reply_free(*r);
    *r = NULL;
    drop_conn(s);
    return CB_KVREMOTE_ERROR;
}

/* ---------------------------------------------------------------- commands */

char *cb_kvremote_key(const cb_kvremote_t *self, const uint8_t model_fp[32], const uint8_t key[32], char *buf,
                      size_t cap) {
    char fh[CB_KV_HEX_BYTES], kh[CB_KV_HEX_BYTES];
    snprintf(buf, cap, "%s:%s:%s", self->prefix, cb_kvfile_hex(model_fp, fh), cb_kvfile_hex(key, kh));
    return buf;
}

cb_kvremote_rc_t cb_kvremote_get(cb_kvremote_t *self, const uint8_t model_fp[32], const uint8_t key[32],
                                 uint8_t **value, size_t *len, char *err, size_t errlen) {
    *value = NULL;
    *len = 0;
    char k[CB_KVREMOTE_MAX_KEY];
    cb_kvremote_key(self, model_fp, key, k, sizeof k);
    const char *argv[2] = {"GET", k};
    size_t lens[2] = {3, strlen(k)};
    reply_t *r;
    pthread_mutex_lock(&self->mu);
    cb_kvremote_rc_t rc = call(self, 2, argv, lens, self->max_value, &r, err, errlen);
    if (rc == CB_KVREMOTE_TOO_LARGE) atomic_fetch_add(&self->corrupt, 1);
    if (rc == CB_KVREMOTE_OK && r->type != REDIS_REPLY_STRING && r->type != REDIS_REPLY_NIL)
        rc = unexpected(self, "GET", &r, err, errlen);
    pthread_mutex_unlock(&self->mu);
    if (rc != CB_KVREMOTE_OK) return rc;
    if (r->type == REDIS_REPLY_NIL || r->len == 0) {
        atomic_fetch_add(&self->misses, 1);
        reply_free(r);
        return CB_KVREMOTE_MISS;
    }
    atomic_fetch_add(&self->hits, 1);
    atomic_fetch_add(&self->bytes_read, r->len);
    *value = (uint8_t *)r->str; /* malloc'd by create_string: the caller frees it */
    *len = r->len;
    r->str = NULL;
    reply_free(r);
    return CB_KVREMOTE_OK;
}

cb_kvremote_rc_t cb_kvremote_put(cb_kvremote_t *self, const uint8_t model_fp[32], const uint8_t key[32],
                                 const void *value, size_t len, char *err, size_t errlen) {
    if (!value || len == 0) {
        cb_set_err(err, errlen, "kvremote: an empty value");
        return CB_KVREMOTE_ERROR;
    }
    if (len > self->max_value) {
        cb_set_err(err, errlen, "kvremote: a value of %zu bytes is over max_value_bytes (%zu): not stored", len,
                   self->max_value);
        return CB_KVREMOTE_TOO_LARGE;
    }
    char k[CB_KVREMOTE_MAX_KEY];
    cb_kvremote_key(self, model_fp, key, k, sizeof k);
    const char *argv[3] = {"SET", k, value};
    size_t lens[3] = {3, strlen(k), len};
    reply_t *r;
    pthread_mutex_lock(&self->mu);
    cb_kvremote_rc_t rc = call(self, 3, argv, lens, 0, &r, err, errlen);
    if (rc == CB_KVREMOTE_OK && r->type != REDIS_REPLY_STATUS) rc = unexpected(self, "SET", &r, err, errlen);
    pthread_mutex_unlock(&self->mu);
    if (rc != CB_KVREMOTE_OK) return rc;
    reply_free(r);
    atomic_fetch_add(&self->puts, 1);
    atomic_fetch_add(&self->bytes_written, len);
    return CB_KVREMOTE_OK;
}

/* EXISTS or DEL of one key: the integer reply into *n. */
static cb_kvremote_rc_t int_command(cb_kvremote_t *self, const char *cmd, const uint8_t model_fp[32],
                                    const uint8_t key[32], long long *n, char *err, size_t errlen) {
    char k[CB_KVREMOTE_MAX_KEY];
    cb_kvremote_key(self, model_fp, key, k, sizeof k);
    const char *argv[2] = {cmd, k};
    size_t lens[2] = {strlen(cmd), strlen(k)};
    reply_t *r;
    pthread_mutex_lock(&self->mu);
    cb_kvremote_rc_t rc = call(self, 2, argv, lens, 0, &r, err, errlen);
    if (rc == CB_KVREMOTE_OK && r->type != REDIS_REPLY_INTEGER) rc = unexpected(self, cmd, &r, err, errlen);
    pthread_mutex_unlock(&self->mu);
    if (rc != CB_KVREMOTE_OK) return rc;
    *n = r->integer;
    reply_free(r);
    return CB_KVREMOTE_OK;
}

cb_kvremote_rc_t cb_kvremote_exists(cb_kvremote_t *self, const uint8_t model_fp[32], const uint8_t key[32],
                                    char *err, size_t errlen) {
    long long n = 0;
    cb_kvremote_rc_t rc = int_command(self, "EXISTS", model_fp, key, &n, err, errlen);
    if (rc != CB_KVREMOTE_OK) return rc;
    return n > 0 ? CB_KVREMOTE_OK : CB_KVREMOTE_MISS;
}

cb_kvremote_rc_t cb_kvremote_del(cb_kvremote_t *self, const uint8_t model_fp[32], const uint8_t key[32], char *err,
                                 size_t errlen) {
    long long n = 0;
    return int_command(self, "DEL", model_fp, key, &n, err, errlen);
}

void cb_kvremote_reject(cb_kvremote_t *self, const uint8_t model_fp[32], const uint8_t key[32], const char *why) {
    atomic_fetch_add(&self->corrupt, 1);
    char k[CB_KVREMOTE_MAX_KEY], err[256] = "";
    cb_kvremote_key(self, model_fp, key, k, sizeof k);
    cb_kvremote_rc_t rc = cb_kvremote_del(self, model_fp, key, err, sizeof err);
    if (rc == CB_KVREMOTE_OK)
        CB_WARN("kvremote: value %.100s rejected (%s): deleted", k, why);
    else
        CB_WARN("kvremote: value %.100s rejected (%s); not deleted: %s", k, why, err);
}

/* ---------------------------------------------------------------- stats */

void cb_kvremote_stats(const cb_kvremote_t *self, cb_kvremote_stats_t *o) {
    memset(o, 0, sizeof *o);
    if (!self) return;
    cb_kvremote_t *s = (cb_kvremote_t *)self; /* atomics only */
    o->hits = atomic_load(&s->hits);
    o->misses = atomic_load(&s->misses);
    o->errors = atomic_load(&s->errors);
    o->corrupt = atomic_load(&s->corrupt);
    o->skipped = atomic_load(&s->skipped);
    o->puts = atomic_load(&s->puts);
    o->bytes_read = atomic_load(&s->bytes_read);
    o->bytes_written = atomic_load(&s->bytes_written);
    o->downs = atomic_load(&s->downs);
    o->up = atomic_load(&s->up);
}

bool cb_kvremote_up(const cb_kvremote_t *self) { return self && atomic_load(&((cb_kvremote_t *)self)->up); }
const char *cb_kvremote_url(const cb_kvremote_t *self) { return self->url; }
size_t cb_kvremote_max_value_bytes(const cb_kvremote_t *self) { return self->max_value; }
