/* diskhealth: a service's data disk, full or not, for its ping. See diskhealth.h. */
#include "wire/diskhealth.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include "base/alloc.h"
#include "base/clock.h"
#include "base/log.h"
#include "base/utf8.h"

#define WHAT_MAX 48
#define MSG_MAX 320
#define MIB ((int64_t)1 << 20)

typedef struct {
    char what[WHAT_MAX];
    char dir[4096];
} watch_t;

typedef struct {
    char what[WHAT_MAX];
    char msg[MSG_MAX];
    double t_ms;
} failure_t;

struct cb_diskhealth_s {
    int64_t min_free, hold_ms;
    watch_t watch[CB_DISKHEALTH_MAX];
    int n_watch;
    pthread_mutex_t mu; /* guards fails, n_fails, degraded */
    failure_t fails[CB_DISKHEALTH_MAX];
    int n_fails;
    int degraded;       /* the last check's verdict: -1 none yet, 0 ok, 1 degraded (for the log) */
};

cb_diskhealth_t *cb_diskhealth_new(int64_t min_free_bytes, int64_t hold_ms) {
    cb_diskhealth_t *dh = cb_calloc(1, sizeof *dh);
    if (!dh) return NULL;
    dh->min_free = min_free_bytes > 0 ? min_free_bytes : 0;
    dh->hold_ms = hold_ms > 0 ? hold_ms : 0;
    dh->degraded = -1;
    pthread_mutex_init(&dh->mu, NULL);
    return dh;
}

cb_diskhealth_t *cb_diskhealth_from_config(const cb_config_t *cfg, const char *section, char *err, size_t errlen) {
    int64_t mb, hold_s;
    if (!cb_config_int(cfg, section, "min_free_mb", 0, (int64_t)1 << 30, CB_DISKHEALTH_MIN_FREE_MB_DEFAULT, &mb, err,
                       errlen) ||
        !cb_config_int(cfg, section, "disk_full_hold_s", 0, 86400, CB_DISKHEALTH_HOLD_S_DEFAULT, &hold_s, err, errlen))
        return NULL;
    cb_diskhealth_t *dh = cb_diskhealth_new(mb * MIB, hold_s * 1000);
    if (!dh) snprintf(err, errlen, "out of memory");
    return dh;
}

void cb_diskhealth_destroy(cb_diskhealth_t **self_p) {
    if (!self_p || !*self_p) return;
    pthread_mutex_destroy(&(*self_p)->mu);
    free(*self_p);
    *self_p = NULL;
}

int cb_diskhealth_watch(cb_diskhealth_t *dh, const char *what, const char *dir) {
    if (!dh) return 0;
    if (dh->n_watch >= CB_DISKHEALTH_MAX || !dir || !dir[0]) return -1;
    watch_t *w = &dh->watch[dh->n_watch++];
    snprintf(w->what, sizeof w->what, "%s", what ? what : "data");
    snprintf(w->dir, sizeof w->dir, "%s", dir);
    return 0;
}

int cb_diskhealth_watch_file(cb_diskhealth_t *dh, const char *what, const char *path) {
    if (!dh) return 0;
    if (!path || !path[0]) return -1;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == dir) dir[1] = 0; /* "/x.db": the root */
    else *slash = 0;
    return cb_diskhealth_watch(dh, what, dir);
}

bool cb_diskhealth_full_errno(int e) {
#ifdef EDQUOT
    if (e == EDQUOT) return true;
#endif
    return e == ENOSPC;
}

bool cb_diskhealth_full_msg(const char *msg) {
    if (!msg || !msg[0]) return false;
    static const char *const marks[] = {"No space left on device", "Disk quota exceeded", "database or disk is full"};
    for (size_t i = 0; i < sizeof marks / sizeof *marks; i++)
        if (strstr(msg, marks[i])) return true;
    return false;
}

/* The failure slot of kind what (mu held): the existing one, or a new one, or NULL when none is free. */
static failure_t *fail_slot(cb_diskhealth_t *dh, const char *what, bool add) {
    for (int i = 0; i < dh->n_fails; i++)
        if (!strncmp(dh->fails[i].what, what, WHAT_MAX - 1)) return &dh->fails[i];
    if (!add || dh->n_fails >= CB_DISKHEALTH_MAX) return NULL;
    failure_t *f = &dh->fails[dh->n_fails++];
    snprintf(f->what, sizeof f->what, "%s", what);
    return f;
}

void cb_diskhealth_failed(cb_diskhealth_t *dh, const char *what, const char *msg) {
    if (!dh) return;
    if (!what) what = "data";
    pthread_mutex_lock(&dh->mu);
    failure_t *f = fail_slot(dh, what, true);
    if (f) {
        snprintf(f->msg, sizeof f->msg, "%s", msg && msg[0] ? msg : "the disk is full");
        f->t_ms = cb_now_ms();
    }
    pthread_mutex_unlock(&dh->mu);
}

bool cb_diskhealth_note(cb_diskhealth_t *dh, const char *what, const char *msg) {
    if (!dh || !cb_diskhealth_full_msg(msg)) return false;
    cb_diskhealth_failed(dh, what, msg);
    return true;
}

void cb_diskhealth_ok(cb_diskhealth_t *dh, const char *what) {
    if (!dh) return;
    if (!what) what = "data";
    pthread_mutex_lock(&dh->mu);
    failure_t *f = fail_slot(dh, what, false);
    if (f) { /* forgotten: the last slot takes its place */
        *f = dh->fails[dh->n_fails - 1];
        dh->n_fails--;
    }
    pthread_mutex_unlock(&dh->mu);
}

/* The bytes a writer that is not root can still write on dir's file system; false when statvfs fails. */
static bool free_bytes_of(const char *dir, uint64_t *out) {
    struct statvfs vs;
    if (!dir || statvfs(dir, &vs) != 0) return false;
    *out = (uint64_t)vs.f_bavail * (uint64_t)vs.f_frsize;
    return true;
}

bool cb_diskhealth_room(const char *dir, uint64_t need, uint64_t *avail) {
    uint64_t a = UINT64_MAX;
    const bool known = free_bytes_of(dir, &a);
    if (avail) *avail = a;
    return !known || a >= need + (uint64_t)MIB;
}

/* "0 bytes", "812 bytes", "3.4 KiB", "60.0 MiB", "2.1 GiB". */
static void human(int64_t b, char *out, size_t len) {
    if (b < 1024) snprintf(out, len, "%lld bytes", (long long)b);
    else if (b < MIB) snprintf(out, len, "%.1f KiB", (double)b / 1024.0);
    else if (b < 1024 * MIB) snprintf(out, len, "%.1f MiB", (double)b / (double)MIB);
    else snprintf(out, len, "%.1f GiB", (double)b / (double)(1024 * MIB));
}

/* Appends to out [len] at *pos, never past its end (a cut is repaired by the caller). */
static void add(char *out, size_t len, size_t *pos, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void add(char *out, size_t len, size_t *pos, const char *fmt, ...) {
    if (*pos + 1 >= len) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(out + *pos, len - *pos, fmt, ap);
    va_end(ap);
    if (n > 0) *pos = *pos + (size_t)n < len ? *pos + (size_t)n : len - 1;
}

/* Every byte that does not start a well-formed UTF-8 sequence (a path's, or a character cut at the end)
 * becomes '?': the reason goes into msgpack strings, which must be UTF-8. */
static void utf8_fix(char *s) {
    size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        size_t k = cb_utf8_seq_len((const unsigned char *)s + i, n - i);
        if (k == 0) {
            s[i++] = '?';
            continue;
        }
        i += k;
    }
}

bool cb_diskhealth_check(cb_diskhealth_t *dh, char *reason, size_t len, int64_t *free_bytes) {
    if (len) reason[0] = 0;
    if (free_bytes) *free_bytes = -1;
    if (!dh) return false;
    int64_t least = -1;
    int64_t avail[CB_DISKHEALTH_MAX];
    dev_t dev[CB_DISKHEALTH_MAX];
    bool read[CB_DISKHEALTH_MAX];
    for (int i = 0; i < dh->n_watch; i++) {
        struct stat st;
        uint64_t a = 0;
        read[i] = free_bytes_of(dh->watch[i].dir, &a) && stat(dh->watch[i].dir, &st) == 0;
        if (!read[i]) continue;
        avail[i] = (int64_t)a;
        dev[i] = st.st_dev;
        if (least < 0 || avail[i] < least) least = avail[i];
    }
    if (free_bytes) *free_bytes = least;
    char buf[2048];
    size_t pos = 0;
    bool bad = false;
    /* the file systems under the threshold, each once (the first directory on it leads) */
    for (int i = 0; i < dh->n_watch && dh->min_free > 0; i++) {
        if (!read[i] || avail[i] >= dh->min_free) continue;
        bool seen = false;
        for (int j = 0; j < i && !seen; j++) seen = read[j] && dev[j] == dev[i];
        if (seen) continue;
        char h[32];
        human(avail[i], h, sizeof h);
        add(buf, sizeof buf, &pos, "%s%s free on the file system of the %s %s", bad ? "; " : "", h, dh->watch[i].what,
            dh->watch[i].dir);
        for (int j = i + 1; j < dh->n_watch; j++)
            if (read[j] && dev[j] == dev[i])
                add(buf, sizeof buf, &pos, " and the %s %s", dh->watch[j].what, dh->watch[j].dir);
        add(buf, sizeof buf, &pos, " (statvfs; under min_free_mb = %lld)", (long long)(dh->min_free / MIB));
        bad = true;
    }
    /* the writes that failed on a full disk, within hold_ms */
    double now = cb_now_ms();
    pthread_mutex_lock(&dh->mu);
    for (int i = 0; i < dh->n_fails && dh->hold_ms > 0; i++) {
        const failure_t *f = &dh->fails[i];
        double age = now - f->t_ms;
        if (age > (double)dh->hold_ms) continue;
        add(buf, sizeof buf, &pos, "%sa write to the %s failed %.0f s ago: %s", bad ? "; " : "", f->what,
            age / 1000.0, f->msg);
        bad = true;
    }
    int was = dh->degraded;
    dh->degraded = bad;
    pthread_mutex_unlock(&dh->mu);
    if (bad && len) {
        snprintf(reason, len, "data disk full: %s", buf);
        utf8_fix(reason);
    }
    if (bad && was != 1) cb_log(CB_LOG_WARN, NULL, "degraded: data disk full: %s", buf);
    else if (!bad && was == 1) cb_log(CB_LOG_INFO, NULL, "the data disk has room again: status ok");
    return bad;
}

void cb_diskhealth_put(cb_diskhealth_t *dh, cb_msg_writer_t *w) {
    char reason[1024];
    int64_t fb = -1;
    bool bad = cb_diskhealth_check(dh, reason, sizeof reason, &fb);
    cb_msg_put_str(w, "status", bad ? "degraded" : "ok");
    if (bad) cb_msg_put_str(w, "reason", reason);
    if (fb >= 0) cb_msg_put_int(w, "disk_free_bytes", fb);
}
