/* admit: accept, limits per address, the first request line, request deadlines. See admit.h. */
#include "admit.h"
#include "base/alloc.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"

#define SWEEP_MS 250          /* how often deadlines are checked (and the stop flag) */
#define LINE_PEEK_MAX 8192    /* the first request line is checked over at most this many bytes */
#define HANDOFF_STALE_MS 30000 /* a handed-over connection libmicrohttpd never started: forgotten after */
#define REPORT_MS 5000        /* refusals are logged as one summary line at most this often */
#define IP_BUCKETS 4096       /* per-address counts: hash buckets (a power of two) */
#define MAX_FDS (1 << 20)

/* Where a connection is. */
enum { ST_CHECK, ST_HANDOFF, ST_LIVE };
/* What a live connection is doing (its deadline depends on it). */
enum { PH_RECEIVING, PH_ANSWERING, PH_IDLE };

typedef struct {
    int fd;
    uint8_t key[16];             /* client address (gw_addr_key) */
    struct sockaddr_storage addr;
    socklen_t addrlen;
    int stage, phase;
    bool killed;                 /* shut down by the sweep; libmicrohttpd closes it soon */
    double deadline;             /* cb_now_ms(); 0: none */
    double t_handoff;
} conn_t;

typedef struct ip_node {
    struct ip_node *next;
    uint8_t key[16];
    unsigned n;
} ip_node_t;

/* Canned responses written straight to a socket (the connection is closed after). */
typedef struct {
    char text[512];
    size_t len;
} canned_t;

struct gw_admit {
    gw_admit_opts_t o;
    int listen_fd, ep, port;
    struct MHD_Daemon *daemon;
    pthread_t thread;
    bool started;
    atomic_bool stop;
    bool listen_paused;          /* out of file descriptors: accept paused until paused_until */
    double paused_until;
    canned_t r400, r408, r429, r503;
    pthread_mutex_t mu;          /* guards the fields below and every conn_t */
    conn_t **by_fd;              /* [n_fd]: the open connections by socket */
    size_t n_fd;
    int max_fd;                  /* the highest fd ever registered */
    unsigned total;              /* open connections */
    ip_node_t *ips[IP_BUCKETS];
    /* counts for the summary log line (the accept thread's; kills too) */
    unsigned n_limit, n_per_ip, n_bad, n_deadline;
    double last_report;
};

/* ---------------------------------------------------------------------------------------------- */
/* Addresses and per-address counts                                                               */

void gw_addr_key(const struct sockaddr *sa, uint8_t key[16]) {
    memset(key, 0, 16);
    if (sa && sa->sa_family == AF_INET) {
        key[10] = key[11] = 0xff;
        memcpy(key + 12, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, 4);
    } else if (sa && sa->sa_family == AF_INET6) {
        memcpy(key, &((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr, 16);
    }
}

void gw_addr_key_str(const uint8_t key[16], char *out, size_t cap) {
    static const uint8_t v4[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    char buf[INET6_ADDRSTRLEN] = "?";
    if (!memcmp(key, v4, 12)) inet_ntop(AF_INET, key + 12, buf, sizeof buf);
    else inet_ntop(AF_INET6, key, buf, sizeof buf);
    snprintf(out, cap, "%s", buf);
}

static unsigned ip_hash(const uint8_t key[16]) {
    uint32_t h = 2166136261u;
    for (int i = 0; i < 16; i++) h = (h ^ key[i]) * 16777619u;
    return h & (IP_BUCKETS - 1);
}

static ip_node_t *ip_find(gw_admit_t *a, const uint8_t key[16]) {
    for (ip_node_t *p = a->ips[ip_hash(key)]; p; p = p->next)
        if (!memcmp(p->key, key, 16)) return p;
    return NULL;
}

/* +1 for key (false when out of memory). */
static bool ip_inc(gw_admit_t *a, const uint8_t key[16]) {
    ip_node_t *p = ip_find(a, key);
    if (!p) {
        if (!(p = cb_calloc(1, sizeof *p))) return false;
        memcpy(p->key, key, 16);
        unsigned h = ip_hash(key);
        p->next = a->ips[h];
        a->ips[h] = p;
    }
    p->n++;
    return true;
}

static void ip_dec(gw_admit_t *a, const uint8_t key[16]) {
    ip_node_t **pp = &a->ips[ip_hash(key)];
    for (; *pp; pp = &(*pp)->next) {
        ip_node_t *p = *pp;
        if (memcmp(p->key, key, 16)) continue;
        if (--p->n == 0) {
            *pp = p->next;
            free(p);
        }
        return;
    }
}

/* Forgets c (under mu): its slot, its counts, the gauge. Does not close its socket. */
static void drop_locked(gw_admit_t *a, conn_t *c) {
    if (c->fd >= 0 && (size_t)c->fd < a->n_fd && a->by_fd[c->fd] == c) a->by_fd[c->fd] = NULL;
    ip_dec(a, c->key);
    a->total--;
    gw_metrics_connection(a->o.metrics, -1);
    free(c);
}

/* ---------------------------------------------------------------------------------------------- */
/* The first request line                                                                          */

static bool is_method_char(unsigned char c) { return (c >= 'A' && c <= 'Z') || c == '-' || c == '_'; }
static bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static bool is_alpha(unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

/* METHOD SP TARGET SP HTTP/d.d CRLF (or LF), after at most 4 empty lines (RFC 9112 §2.2). METHOD: upper
 * case letters, '-' and '_' (every registered method), at most 24; TARGET starts with '/', '*' or a
 * letter (origin, asterisk, absolute or authority form) and holds visible ASCII only. Stricter than
 * libmicrohttpd, which waits for a line end however long the garbage before it (up to header_bytes). */
gw_line_t gw_request_line_check(const char *data, size_t len) {
    const unsigned char *p = (const unsigned char *)data;
    size_t i = 0;
    for (int k = 0; k < 4 && i < len && (p[i] == '\r' || p[i] == '\n'); k++) {
        if (p[i] == '\r') {
            if (i + 1 == len) return GW_LINE_MORE;
            if (p[i + 1] != '\n') return GW_LINE_BAD;
            i++;
        }
        i++;
    }
    size_t m0 = i;
    while (i < len && is_method_char(p[i])) {
        if (++i - m0 > 24) return GW_LINE_BAD;
    }
    if (i == len) return GW_LINE_MORE;
    if (i == m0 || p[i++] != ' ') return GW_LINE_BAD;
    if (i == len) return GW_LINE_MORE;
    if (p[i] != '/' && p[i] != '*' && !is_alpha(p[i])) return GW_LINE_BAD;
    while (i < len && p[i] > 0x20 && p[i] < 0x7f) i++;
    if (i == len) return GW_LINE_MORE;
    if (p[i++] != ' ') return GW_LINE_BAD;
    static const char version[] = "HTTP/d.d";
    for (size_t k = 0; k < sizeof version - 1; k++, i++) {
        if (i == len) return GW_LINE_MORE;
        bool ok = version[k] == 'd' ? is_digit(p[i]) : p[i] == (unsigned char)version[k];
        if (!ok) return GW_LINE_BAD;
    }
    if (i == len) return GW_LINE_MORE;
    if (p[i] == '\n') return GW_LINE_OK;
    if (p[i++] != '\r') return GW_LINE_BAD;
    if (i == len) return GW_LINE_MORE;
    return p[i] == '\n' ? GW_LINE_OK : GW_LINE_BAD;
}

/* ---------------------------------------------------------------------------------------------- */
/* The accept thread                                                                               */

static void canned(canned_t *c, int status, const char *reason, const char *type, const char *code,
                   const char *extra_header, const char *message) {
    char body[300];
    int bl = snprintf(body, sizeof body,
                      "{\"error\":{\"message\":\"%s\",\"type\":\"%s\",\"param\":null,\"code\":\"%s\"}}", message,
                      type, code);
    int n = snprintf(c->text, sizeof c->text,
                     "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%sConnection: "
                     "close\r\n\r\n%s",
                     status, reason, bl, extra_header, body);
    c->len = n > 0 && (size_t)n < sizeof c->text ? (size_t)n : 0;
}

/* Reads and drops what the client sent (so that the close is a FIN rather than a reset that could discard
 * the answer before the client reads it), writes r (may be NULL), closes. Never blocks. */
static void close_with(int fd, const canned_t *r) {
    char sink[4096];
    for (int k = 0; k < 16 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; k++) {}
    if (r && r->len) {
        ssize_t n = send(fd, r->text, r->len, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)n;
    }
    shutdown(fd, SHUT_WR);
    close(fd);
}

static void admit_one(gw_admit_t *a, int fd, const struct sockaddr_storage *ss, socklen_t sl) {
    uint8_t key[16];
    gw_addr_key((const struct sockaddr *)ss, key);
    const canned_t *refuse = NULL;
    pthread_mutex_lock(&a->mu);
    ip_node_t *ip = ip_find(a, key);
    if ((size_t)fd >= a->n_fd || a->total >= a->o.max_connections) {
        refuse = &a->r503;
        a->n_limit++;
        gw_metrics_refused(a->o.metrics, GW_REFUSED_LIMIT);
    } else if (a->o.max_per_ip && ip && ip->n >= a->o.max_per_ip) {
        refuse = &a->r429;
        a->n_per_ip++;
        gw_metrics_refused(a->o.metrics, GW_REFUSED_PER_IP);
    } else {
        /* a slot still taken by this fd number is stale (libmicrohttpd closed it without telling) */
        if (a->by_fd[fd]) drop_locked(a, a->by_fd[fd]);
        conn_t *c = cb_calloc(1, sizeof *c);
        if (!c || !ip_inc(a, key)) {
            free(c);
            refuse = &a->r503;
        } else {
            c->fd = fd;
            memcpy(c->key, key, 16);
            memcpy(&c->addr, ss, sl);
            c->addrlen = sl;
            c->stage = ST_CHECK;
            c->phase = PH_RECEIVING;
            c->deadline = cb_now_ms() + 1000.0 * a->o.request_timeout_s;
            a->by_fd[fd] = c;
            if (fd > a->max_fd) a->max_fd = fd;
            a->total++;
            gw_metrics_connection(a->o.metrics, 1);
        }
    }
    pthread_mutex_unlock(&a->mu);
    if (refuse) {
        close_with(fd, refuse);
        return;
    }
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.u64 = (uint64_t)fd};
    if (epoll_ctl(a->ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
        pthread_mutex_lock(&a->mu);
        if (a->by_fd[fd]) drop_locked(a, a->by_fd[fd]);
        pthread_mutex_unlock(&a->mu);
        close_with(fd, &a->r503);
    }
}

static void accept_all(gw_admit_t *a) {
    for (;;) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = accept4(a->listen_fd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
            admit_one(a, fd, &ss, sl);
            continue;
        }
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            /* out of descriptors: pause accepting (the backlog holds the clients) rather than spin */
            cb_log(CB_LOG_WARN, NULL, "accept: %s; pausing new connections for 100 ms", strerror(errno));
            epoll_ctl(a->ep, EPOLL_CTL_DEL, a->listen_fd, NULL);
            a->listen_paused = true;
            a->paused_until = cb_now_ms() + 100;
        }
        return; /* EAGAIN: all taken */
    }
}

/* Closes a connection still being checked (the accept thread's own). */
static void close_checking(gw_admit_t *a, int fd, const canned_t *r) {
    pthread_mutex_lock(&a->mu);
    conn_t *c = (size_t)fd < a->n_fd ? a->by_fd[fd] : NULL;
    if (c && c->stage == ST_CHECK) drop_locked(a, c);
    pthread_mutex_unlock(&a->mu);
    close_with(fd, r);
}

static void handoff(gw_admit_t *a, int fd) {
    epoll_ctl(a->ep, EPOLL_CTL_DEL, fd, NULL);
    struct sockaddr_storage ss;
    socklen_t sl = 0;
    pthread_mutex_lock(&a->mu);
    conn_t *c = (size_t)fd < a->n_fd ? a->by_fd[fd] : NULL;
    if (c) {
        c->stage = ST_HANDOFF;
        c->t_handoff = cb_now_ms();
        memcpy(&ss, &c->addr, c->addrlen);
        sl = c->addrlen;
    }
    pthread_mutex_unlock(&a->mu);
    if (!c) {
        close_with(fd, &a->r503);
        return;
    }
    /* From here the connection is libmicrohttpd's: c may be freed (closed) by its threads at any time. */
    if (MHD_add_connection(a->daemon, fd, (struct sockaddr *)&ss, sl) != MHD_YES) {
        /* refused; it closed fd without a notification: forget the record */
        pthread_mutex_lock(&a->mu);
        if ((size_t)fd < a->n_fd && a->by_fd[fd] == c) drop_locked(a, c);
        a->n_limit++;
        pthread_mutex_unlock(&a->mu);
        gw_metrics_refused(a->o.metrics, GW_REFUSED_LIMIT);
    }
}

/* New bytes (or a close) on a connection whose first request line is being checked. */
static void check_line(gw_admit_t *a, int fd, uint32_t events) {
    char buf[LINE_PEEK_MAX];
    size_t cap = a->o.line_bytes < sizeof buf ? a->o.line_bytes : sizeof buf;
    ssize_t n = recv(fd, buf, cap, MSG_PEEK | MSG_DONTWAIT);
    bool hup = (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0;
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        close_checking(a, fd, NULL); /* the client went away */
        return;
    }
    if (n < 0) {
        if (hup) close_checking(a, fd, NULL);
        return;
    }
    gw_line_t v = gw_request_line_check(buf, (size_t)n);
    if (v == GW_LINE_MORE && (size_t)n == cap) v = GW_LINE_OK; /* a long target: libmicrohttpd bounds it */
    if (v == GW_LINE_MORE && hup) {                            /* the client stopped sending mid-line */
        close_checking(a, fd, NULL);
        return;
    }
    if (v == GW_LINE_OK) {
        handoff(a, fd);
    } else if (v == GW_LINE_BAD) {
        a->n_bad++;
        gw_metrics_refused(a->o.metrics, GW_REFUSED_BAD_LINE);
        close_checking(a, fd, &a->r400);
    }
}

/* Deadlines: connections still being checked are closed here (408); live ones are shut down, and
 * libmicrohttpd, reading end of file, closes them. Under mu: the socket of a live connection stays open
 * until gw_admit_conn_closed, which takes mu. */
static void sweep(gw_admit_t *a, double now) {
    pthread_mutex_lock(&a->mu);
    for (int fd = 0; fd <= a->max_fd; fd++) {
        conn_t *c = a->by_fd[fd];
        if (!c) continue;
        if (c->stage == ST_CHECK && now >= c->deadline) {
            drop_locked(a, c);
            close_with(fd, &a->r408); /* also leaves the epoll set */
            a->n_deadline++;
            gw_metrics_refused(a->o.metrics, GW_REFUSED_DEADLINE);
        } else if (c->stage == ST_HANDOFF && now - c->t_handoff > HANDOFF_STALE_MS) {
            drop_locked(a, c);
        } else if (c->stage == ST_LIVE && !c->killed && c->deadline > 0 && now >= c->deadline &&
                   c->phase != PH_ANSWERING) {
            if (c->phase == PH_RECEIVING) {
                ssize_t n = send(fd, a->r408.text, a->r408.len, MSG_NOSIGNAL | MSG_DONTWAIT);
                (void)n;
                a->n_deadline++;
                gw_metrics_refused(a->o.metrics, GW_REFUSED_DEADLINE);
            }
            shutdown(fd, SHUT_RDWR);
            c->killed = true;
        }
    }
    unsigned total = a->total;
    pthread_mutex_unlock(&a->mu);
    if ((a->n_limit || a->n_per_ip || a->n_bad || a->n_deadline) && now - a->last_report >= REPORT_MS) {
        cb_log(CB_LOG_WARN, NULL,
               "connections refused or closed in the last %.0f s: %u at gateway.max_connections, %u over "
               "gateway.max_connections_per_ip, %u bad request lines (400), %u past gateway.request_timeout_s "
               "(408); %u open",
               (now - a->last_report) / 1000, a->n_limit, a->n_per_ip, a->n_bad, a->n_deadline, total);
        a->n_limit = a->n_per_ip = a->n_bad = a->n_deadline = 0;
        a->last_report = now;
    }
}

static void *run(void *arg) {
    gw_admit_t *a = arg;
    struct epoll_event evs[128];
    double next_sweep = cb_now_ms() + SWEEP_MS;
    a->last_report = cb_now_ms();
    while (!atomic_load(&a->stop)) {
        double wait = next_sweep - cb_now_ms();
        int n = epoll_wait(a->ep, evs, 128, wait > 0 ? (int)wait + 1 : 0);
        if (n < 0 && errno != EINTR) {
            cb_log(CB_LOG_ERROR, NULL, "epoll_wait: %s", strerror(errno));
            usleep(10000);
        }
        for (int i = 0; i < n; i++) {
            int fd = (int)evs[i].data.u64;
            if (fd == a->listen_fd) accept_all(a);
            else check_line(a, fd, evs[i].events);
        }
        double now = cb_now_ms();
        if (a->listen_paused && now >= a->paused_until) {
            struct epoll_event ev = {.events = EPOLLIN, .data.u64 = (uint64_t)a->listen_fd};
            if (epoll_ctl(a->ep, EPOLL_CTL_ADD, a->listen_fd, &ev) == 0) a->listen_paused = false;
            else a->paused_until = now + 100;
        }
        if (now >= next_sweep) {
            sweep(a, now);
            next_sweep = now + SWEEP_MS;
        }
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* Life cycle                                                                                      */

gw_admit_t *gw_admit_new(const gw_admit_opts_t *o, const struct sockaddr *addr, socklen_t addrlen, char *err,
                         size_t errlen) {
    gw_admit_t *a = cb_calloc(1, sizeof *a);
    if (!a) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    a->o = *o;
    a->listen_fd = a->ep = -1;
    pthread_mutex_init(&a->mu, NULL);
    struct rlimit rl;
    a->n_fd = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY ? (size_t)rl.rlim_cur : MAX_FDS;
    if (a->n_fd > MAX_FDS) a->n_fd = MAX_FDS;
    if (!(a->by_fd = cb_calloc(a->n_fd, sizeof *a->by_fd))) {
        snprintf(err, errlen, "out of memory");
        gw_admit_destroy(&a);
        return NULL;
    }
    char msg[160];
    canned(&a->r400, 400, "Bad Request", "invalid_request_error", "bad_request_line", "",
           "the request line is not HTTP/1.x");
    snprintf(msg, sizeof msg, "the request did not arrive within %u s (gateway.request_timeout_s)",
             o->request_timeout_s);
    canned(&a->r408, 408, "Request Timeout", "invalid_request_error", "request_timeout", "", msg);
    snprintf(msg, sizeof msg, "more than %u connections from this address (gateway.max_connections_per_ip)",
             o->max_per_ip);
    canned(&a->r429, 429, "Too Many Requests", "rate_limit_error", "too_many_connections", "Retry-After: 1\r\n",
           msg);
    canned(&a->r503, 503, "Service Unavailable", "service_unavailable", "too_many_connections",
           "Retry-After: 1\r\n", "the gateway is at gateway.max_connections");
    a->listen_fd = socket(addr->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    if (a->listen_fd < 0 || setsockopt(a->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        bind(a->listen_fd, addr, addrlen) != 0 || listen(a->listen_fd, 1024) != 0) {
        snprintf(err, errlen, "%s", strerror(errno));
        gw_admit_destroy(&a);
        return NULL;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(a->listen_fd, (struct sockaddr *)&ss, &sl) == 0)
        a->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                 : ((struct sockaddr_in *)&ss)->sin_port);
    a->ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = (uint64_t)a->listen_fd};
    if (a->ep < 0 || epoll_ctl(a->ep, EPOLL_CTL_ADD, a->listen_fd, &ev) != 0) {
        snprintf(err, errlen, "epoll: %s", strerror(errno));
        gw_admit_destroy(&a);
        return NULL;
    }
    return a;
}

bool gw_admit_start(gw_admit_t *self, struct MHD_Daemon *daemon, char *err, size_t errlen) {
    self->daemon = daemon;
    int rc = pthread_create(&self->thread, NULL, run, self);
    if (rc != 0) {
        snprintf(err, errlen, "cannot start the accept thread: %s", strerror(rc));
        return false;
    }
    self->started = true;
    return true;
}

void gw_admit_stop(gw_admit_t *self) {
    if (!self) return;
    atomic_store(&self->stop, true);
    if (self->started) pthread_join(self->thread, NULL);
    self->started = false;
    if (self->listen_fd >= 0) close(self->listen_fd);
    self->listen_fd = -1;
    pthread_mutex_lock(&self->mu);
    for (int fd = 0; fd <= self->max_fd; fd++) {
        conn_t *c = self->by_fd[fd];
        if (c && c->stage == ST_CHECK) {
            drop_locked(self, c);
            close(fd);
        }
    }
    pthread_mutex_unlock(&self->mu);
}

void gw_admit_destroy(gw_admit_t **self_p) {
    if (!self_p || !*self_p) return;
    gw_admit_t *a = *self_p;
    gw_admit_stop(a);
    for (size_t fd = 0; a->by_fd && fd < a->n_fd; fd++) free(a->by_fd[fd]); /* stale hand-offs only */
    free(a->by_fd);
    for (int h = 0; h < IP_BUCKETS; h++) {
        for (ip_node_t *p = a->ips[h], *next; p; p = next) {
            next = p->next;
            free(p);
        }
    }
    if (a->ep >= 0) close(a->ep);
    pthread_mutex_destroy(&a->mu);
    free(a);
    *self_p = NULL;
}

int gw_admit_port(const gw_admit_t *self) { return self->port; }

/* ---------------------------------------------------------------------------------------------- */
/* Hooks from libmicrohttpd's threads                                                              */

void gw_admit_conn_started(gw_admit_t *self, struct MHD_Connection *mc, void **ctx) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    int fd = ci ? ci->connect_fd : -1;
    *ctx = NULL;
    pthread_mutex_lock(&self->mu);
    conn_t *c = fd >= 0 && (size_t)fd < self->n_fd ? self->by_fd[fd] : NULL;
    if (c && c->stage == ST_HANDOFF) {
        c->stage = ST_LIVE;
        *ctx = c;
    }
    pthread_mutex_unlock(&self->mu);
}

void gw_admit_conn_closed(gw_admit_t *self, void **ctx) {
    conn_t *c = *ctx;
    if (!c) return;
    *ctx = NULL;
    pthread_mutex_lock(&self->mu);
    drop_locked(self, c);
    pthread_mutex_unlock(&self->mu);
}

static void set_phase(gw_admit_t *self, void *ctx, int phase, double deadline_s, bool only_from_idle) {
    conn_t *c = ctx;
    if (!c) return;
    pthread_mutex_lock(&self->mu);
    if (!only_from_idle || c->phase == PH_IDLE) {
        c->phase = phase;
        c->deadline = deadline_s > 0 ? cb_now_ms() + 1000.0 * deadline_s : 0;
    }
    pthread_mutex_unlock(&self->mu);
}

void gw_admit_conn_request_line(gw_admit_t *self, void *ctx) {
    set_phase(self, ctx, PH_RECEIVING, self->o.request_timeout_s, true);
}

void gw_admit_conn_answering(gw_admit_t *self, void *ctx) { set_phase(self, ctx, PH_ANSWERING, 0, false); }

void gw_admit_conn_idle(gw_admit_t *self, void *ctx) { set_phase(self, ctx, PH_IDLE, self->o.idle_timeout_s, false); }
