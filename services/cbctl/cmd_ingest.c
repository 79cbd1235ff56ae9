/* cbctl ingest: sends documents to cb-precompute (acknowledged ingest) with a progress bar on stderr.
 *
 *   cbctl ingest [--wait [--timeout MS]] [--prefix ID_PREFIX] PATH...
 *
 * What becomes a document:
 *   - a .txt or .md file: one document, doc_id = the path as given (or found under a directory);
 *   - a directory: its .txt, .md and .jsonl files, recursively, in name order (other files are skipped);
 *   - a .jsonl file, one JSON object per line: {"id", "text"} is one document (doc_id = id, a string or an
 *     integer; without id, "<path>:<line>"); a MuSiQue line {"id", "ctxs": [{"title", "text"}, ...]}
 *     gives one document per passage, doc_id "<id>/<i>", text "{title}\n\n{text}" (ragprompt.h).
 * --prefix prepends a string to every doc_id.
 *
 * Every document is acknowledged by cb-precompute only once it is durably recorded; requests are retried
 * (Lazy Pirate, cbctl.request_timeout_ms x request_retries; an ingest of the same doc_id and text is
 * idempotent). Every ingest carries `client: "cbctl-<host>-<pid>"` (cb-precompute's fairness and per-client
 * limits see one client per run); a document refused `overloaded` (this client has too much queued) is
 * sent again after a wait (0.2 s doubling to 5 s), for up to cbctl.ingest_timeout_ms. With --wait, cbctl then
 * polls each job's status until all are processed, failing when nothing progresses for
 * cbctl.ingest_timeout_ms, or (--timeout MS) when they are not all processed MS after the wait began. A
 * status poll that gets no answer (cb-precompute restarting, say) is retried, 0.2 s doubling to 2 s apart,
 * until that deadline; only then is its last error reported (exit 3).
 * Exit: 0 every document acknowledged (and with --wait processed), 1 some document was refused or
 * failed, 2 usage or unreadable input, 3 cb-precompute unreachable or silent.
 */
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cbctl.h"
#include "base/alloc.h"
#include "client.h"
#include "base/clock.h"
#include "rag/ragprompt.h"

#define MAX_FILE_BYTES ((size_t)256 << 20)

typedef struct {
    char *doc_id;
    char job[65];
    bool acked, finished, failed;
} doc_t;

typedef struct {
    cbctl_t *ctl;
    cb_bus_client_t *c;
    cb_msg_writer_t *w;
    const char *prefix;
    doc_t *docs;
    size_t n, cap;
    int n_errors;       /* refused documents and unreadable input */
    bool unavailable;   /* cb-precompute could not be reached: stop */
    bool tty;
    double t0;
    int64_t stall_ms;   /* cbctl.ingest_timeout_ms: also how long a document refused `overloaded` is retried */
    char client[64];    /* the `client` field of every ingest: this run, across reconnects */
    size_t total_hint;  /* for the bar: documents found so far */
    bool bar_open;      /* the bar's line is not ended yet */
    int req_timeout_ms; /* cbctl.request_timeout_ms and request_retries: one status poll, at most */
    int req_retries;
    double polls_failing; /* when the status polls began to fail (cb_now_ms), 0 while they are answered */
} ingest_t;

/* The progress bar (a terminal only: redrawn in place). */
static void bar(ingest_t *in, const char *what, size_t done, size_t total, const char *extra) {
    if (in->ctl->quiet || !in->tty) return;
    if (total < done) total = done;
    int width = 30, fill = total ? (int)((double)done / (double)total * width) : width;
    fprintf(stderr, "\r%-8s [", what);
    for (int i = 0; i < width; i++) fputc(i < fill ? '=' : i == fill ? '>' : ' ', stderr);
    fprintf(stderr, "] %zu/%zu %s (%.1f s)\033[K", done, total, extra ? extra : "", (cb_now_ms() - in->t0) / 1000.0);
    fflush(stderr);
    in->bar_open = true;
}

/* Ends the bar's line (before a message or at the end). */
static void bar_end(ingest_t *in) {
    if (in->bar_open) fputc('\n', stderr);
    in->bar_open = false;
}

static char *read_file(const char *path, size_t *len, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode) || (size_t)st.st_size > MAX_FILE_BYTES) {
        snprintf(err, errlen, "%s: not a regular file of at most %zu bytes", path, MAX_FILE_BYTES);
        fclose(f);
        return NULL;
    }
    char *buf = cb_malloc((size_t)st.st_size + 1);
    size_t got = buf ? fread(buf, 1, (size_t)st.st_size, f) : 0;
    fclose(f);
    if (!buf || got != (size_t)st.st_size) {
        free(buf);
        snprintf(err, errlen, "%s: cannot read", path);
        return NULL;
    }
    buf[got] = 0;
    *len = got;
    return buf;
}

/* Sends one document; records it. */
static void send_doc(ingest_t *in, const char *doc_id, const char *text, size_t len) {
    if (in->unavailable) return;
    char full_id[512];
    snprintf(full_id, sizeof full_id, "%s%s", in->prefix, doc_id);
    if (in->n == in->cap) {
        size_t cap = in->cap ? in->cap * 2 : 64;
        doc_t *d = cb_realloc(in->docs, cap * sizeof *d);
        if (!d) {
            cbctl_error(in->ctl, "out of memory");
            in->n_errors++;
            return;
        }
        in->docs = d;
        in->cap = cap;
    }
    doc_t *d = &in->docs[in->n];
    memset(d, 0, sizeof *d);
    if (!(d->doc_id = cb_strdup(full_id))) return;
    in->n++;
    if (!cb_msg_utf8_valid(text, len) || memchr(text, 0, len)) {
        bar_end(in);
        cbctl_error(in->ctl, "%s: not UTF-8 text (skipped)", full_id);
        d->failed = d->finished = true;
        in->n_errors++;
        return;
    }
    cb_err_t code;
    char err[512];
    cb_msg_t *r = NULL;
    /* cb-precompute refuses a document `overloaded` while this client has too much queued: wait for the
     * worker to take some, then send it again (at most ingest_timeout_ms in all) */
    double until = cb_now_ms() + (double)in->stall_ms;
    for (int backoff = 200;; backoff = backoff * 2 > 5000 ? 5000 : backoff * 2) {
        char id[32];
        cb_msg_begin(in->w, "ingest", cb_bus_new_id(id, sizeof id));
        cb_msg_put_str(in->w, "doc_id", full_id);
        cb_msg_put_strn(in->w, "text", text, len);
        cb_msg_put_str(in->w, "client", in->client);
        r = cb_bus_call(in->c, in->w, &code, err, sizeof err);
        if (!r || cb_msg_ok(r) || cb_msg_err_code(r) != CB_ERR_OVERLOADED || cb_now_ms() + backoff > until) break;
        cb_msg_destroy(&r);
        bar(in, "ingest", in->n - 1, in->total_hint > in->n ? in->total_hint : in->n, "waiting (overloaded)");
        zclock_sleep(backoff);
    }
    if (!r) {
        bar_end(in);
        cbctl_error(in->ctl, "precompute: %s", err);
        d->failed = d->finished = true;
        if (code == CB_ERR_TIMEOUT || code == CB_ERR_UNAVAILABLE) in->unavailable = true;
        else in->n_errors++;
        return;
    }
    if (!cb_msg_ok(r)) {
        bar_end(in);
        cbctl_error(in->ctl, "%s: refused: %s: %s", full_id, cb_msg_err_code_name(r), cb_msg_err_message(r));
        d->failed = d->finished = true;
        in->n_errors++;
    } else if (!cb_msg_str_copy(r, "job", 64, d->job, sizeof d->job)) {
        cbctl_error(in->ctl, "%s: invalid reply: %s", full_id, cb_msg_last_error(r));
        d->failed = d->finished = true;
        in->n_errors++;
    } else {
        d->acked = true;
    }
    cb_msg_destroy(&r);
    size_t acked = 0;
    for (size_t i = 0; i < in->n; i++) acked += in->docs[i].acked;
    bar(in, "ingest", acked, in->total_hint > in->n ? in->total_hint : in->n, "acknowledged");
}

static void ingest_jsonl(ingest_t *in, const char *path) {
    size_t len;
    char err[512];
    char *buf = read_file(path, &len, err, sizeof err);
    if (!buf) {
        cbctl_error(in->ctl, "%s", err);
        in->n_errors++;
        return;
    }
    int lineno = 0;
    for (char *line = buf, *next; line && *line && !in->unavailable; line = next) {
        lineno++;
        next = strchr(line, '\n');
        size_t ll = next ? (size_t)(next - line) : strlen(line);
        if (next) next++;
        while (ll > 0 && (line[ll - 1] == '\r' || line[ll - 1] == ' ')) ll--;
        if (ll == 0) continue;
        json_error_t je;
        json_t *o = json_loadb(line, ll, JSON_REJECT_DUPLICATES, &je);
        if (!o || !json_is_object(o)) {
            cbctl_error(in->ctl, "%s:%d: not a JSON object%s%s", path, lineno, o ? "" : ": ", o ? "" : je.text);
            json_decref(o);
            in->n_errors++;
            continue;
        }
        char idbuf[256];
        json_t *jid = json_object_get(o, "id");
        if (json_is_string(jid)) snprintf(idbuf, sizeof idbuf, "%s", json_string_value(jid));
        else if (json_is_integer(jid)) snprintf(idbuf, sizeof idbuf, "%lld", (long long)json_integer_value(jid));
        else snprintf(idbuf, sizeof idbuf, "%s:%d", path, lineno);
        json_t *text = json_object_get(o, "text"), *ctxs = json_object_get(o, "ctxs");
        if (json_is_string(text)) {
            send_doc(in, idbuf, json_string_value(text), json_string_length(text));
        } else if (json_is_array(ctxs)) {
            size_t i;
            json_t *c;
            in->total_hint += json_array_size(ctxs);
            json_array_foreach(ctxs, i, c) {
                json_t *t = json_object_get(c, "text"), *ti = json_object_get(c, "title");
                if (!json_is_string(t) || (ti && !json_is_string(ti))) {
                    cbctl_error(in->ctl, "%s:%d: ctxs[%zu]: expected {title, text} strings", path, lineno, i);
                    in->n_errors++;
                    continue;
                }
                char *p = cb_ragprompt_passage(ti ? json_string_value(ti) : "", json_string_value(t));
                char did[300];
                snprintf(did, sizeof did, "%s/%zu", idbuf, i);
                if (p) send_doc(in, did, p, strlen(p));
                free(p);
            }
        } else {
            cbctl_error(in->ctl, "%s:%d: expected a \"text\" string or a \"ctxs\" array", path, lineno);
            in->n_errors++;
        }
        json_decref(o);
    }
    free(buf);
}

static bool has_ext(const char *p, const char *ext) {
    size_t a = strlen(p), b = strlen(ext);
    return a > b && strcmp(p + a - b, ext) == 0;
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void ingest_path(ingest_t *in, const char *path, bool explicit, int depth) {
    if (in->unavailable) return;
    struct stat st;
    if (stat(path, &st) != 0) {
        cbctl_error(in->ctl, "%s: %s", path, strerror(errno));
        in->n_errors++;
        return;
    }
    if (S_ISDIR(st.st_mode)) {
        if (depth > 32) return;
        DIR *d = opendir(path);
        if (!d) {
            cbctl_error(in->ctl, "%s: %s", path, strerror(errno));
            in->n_errors++;
            return;
        }
        char **names = NULL;
        size_t n = 0, cap = 0;
        struct dirent *e;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            if (n == cap) {
                cap = cap ? cap * 2 : 32;
                char **nn = cb_realloc(names, cap * sizeof *nn);
                if (!nn) break;
                names = nn;
            }
            size_t pl = strlen(path) + strlen(e->d_name) + 2;
            names[n] = cb_malloc(pl);
            if (!names[n]) break;
            snprintf(names[n++], pl, "%s%s%s", path, has_ext(path, "/") ? "" : "/", e->d_name);
        }
        closedir(d);
        qsort(names, n, sizeof *names, by_name);
        for (size_t i = 0; i < n; i++) {
            ingest_path(in, names[i], false, depth + 1);
            free(names[i]);
        }
        free(names);
        return;
    }
    if (has_ext(path, ".jsonl")) {
        ingest_jsonl(in, path);
    } else if (has_ext(path, ".txt") || has_ext(path, ".md") || explicit) {
        size_t len;
        char err[512];
        char *text = read_file(path, &len, err, sizeof err);
        if (!text) {
            cbctl_error(in->ctl, "%s", err);
            in->n_errors++;
            return;
        }
        in->total_hint++;
        send_doc(in, path, text, len);
        free(text);
    }
}

/* One status poll of d's job. A poll that cb-precompute does not answer (timeout, or unavailable: it is
 * restarting) is sent again after a wait (0.2 s doubling to 2 s), each attempt bounded by what is left
 * until deadline (cb_now_ms), the first failure of an outage said once on stderr. Returns the reply (caller
 * owns; it may be an error reply), or NULL with *code and err: the last failure when deadline passed, or
 * at once one that retrying cannot cure (our own request is invalid, an invalid reply). */
static cb_msg_t *poll_status(ingest_t *in, const doc_t *d, double deadline, size_t finished, cb_err_t *code,
                             char *err, size_t errlen) {
    for (int backoff = 200;; backoff = backoff * 2 > 2000 ? 2000 : backoff * 2) {
        /* one attempt (with its Lazy Pirate retries) ends by the deadline */
        double left = deadline - cb_now_ms();
        int per_try = in->req_timeout_ms, retries = in->req_retries;
        if (left < (double)per_try * (retries + 1)) {
            per_try = left < (double)per_try ? (left > 100 ? (int)left : 100) : per_try;
            retries = 0;
        }
        cb_bus_client_set_timeout(in->c, per_try, retries);
        char id[32];
        cb_msg_begin(in->w, "status", cb_bus_new_id(id, sizeof id));
        cb_msg_put_str(in->w, "job", d->job);
        double sent = cb_now_ms();
        cb_msg_t *r = cb_bus_call(in->c, in->w, code, err, errlen);
        if (r) {
            if (in->polls_failing) {
                bar_end(in);
                cbctl_error(in->ctl, "precompute answers again (status polls failed for %.1f s)",
                            (cb_now_ms() - in->polls_failing) / 1000.0);
                in->polls_failing = 0;
            }
            return r;
        }
        if (*code != CB_ERR_TIMEOUT && *code != CB_ERR_UNAVAILABLE) return NULL;
        if (!in->polls_failing) {
            in->polls_failing = sent;
            bar_end(in);
            cbctl_error(in->ctl, "precompute: %s; retrying status polls for up to %.1f s", err,
                        (deadline - cb_now_ms()) / 1000.0);
        }
        if (cb_now_ms() + backoff >= deadline) return NULL;
        bar(in, "process", finished, in->n, "precompute unreachable: retrying");
        zclock_sleep(backoff);
    }
}

/* Polls job status until every acknowledged job finished. Gives up when nothing progresses for stall_ms,
 * or when total_ms > 0 have passed since the wait began; a status poll that fails is retried until then
 * (poll_status). Returns an exit code. */
static int wait_jobs(ingest_t *in, int64_t stall_ms, int64_t total_ms) {
    size_t first = 0, finished = 0;
    for (size_t i = 0; i < in->n; i++) finished += in->docs[i].finished;
    double start = cb_now_ms(), last_progress = start;
    double end = total_ms > 0 ? start + (double)total_ms : 0;
    int64_t last_chunks = -1;
    char extra[96] = "processed";
    while (finished < in->n) {
        while (first < in->n && in->docs[first].finished) first++;
        /* ask the oldest unfinished jobs (the worker goes in order) */
        bool progressed = false;
        int asked = 0;
        for (size_t i = first; i < in->n && asked < 8; i++) {
            doc_t *d = &in->docs[i];
            if (d->finished) continue;
            asked++;
            char err[512];
            cb_err_t code;
            double deadline = last_progress + (double)stall_ms;
            if (end > 0 && end < deadline) deadline = end;
            cb_msg_t *r = poll_status(in, d, deadline, finished, &code, err, sizeof err);
            if (!r) {
                bar_end(in);
                if (in->polls_failing)
                    cbctl_error(in->ctl, "precompute: %s; status polls failed for %.1f s: gave up at the %s deadline",
                                err, (cb_now_ms() - in->polls_failing) / 1000.0,
                                deadline == end ? "--timeout" : "cbctl.ingest_timeout_ms");
                else
                    cbctl_error(in->ctl, "precompute: %s", err);
                return cbctl_exit_for(code);
            }
            char state[16] = "";
            int64_t cd = 0, ct = 0;
            if (cb_msg_ok(r)) {
                cb_msg_str_copy(r, "state", 15, state, sizeof state);
                cb_msg_int(r, "chunks_done", 0, INT64_MAX, &cd);
                cb_msg_int(r, "chunks_total", 0, INT64_MAX, &ct);
            }
            if (!cb_msg_ok(r) || !strcmp(state, "failed")) {
                bar_end(in);
                const char *why = "";
                size_t wl = 0;
                if (cb_msg_ok(r)) cb_msg_str(r, "error", 1024, &why, &wl);
                cbctl_error(in->ctl, "%s: processing failed: %.*s%s", d->doc_id, (int)wl, why,
                            cb_msg_ok(r) ? "" : cb_msg_err_message(r));
                d->failed = d->finished = true;
                in->n_errors++;
                finished++;
                progressed = true;
            } else if (!strcmp(state, "done")) {
                d->finished = true;
                finished++;
                progressed = true;
            } else {
                if (cd != last_chunks) progressed = true;
                last_chunks = cd;
                snprintf(extra, sizeof extra, "processed (current: %s, chunk %lld/%lld)", state, (long long)cd,
                         (long long)ct);
                cb_msg_destroy(&r);
                break; /* later jobs wait behind this one */
            }
            cb_msg_destroy(&r);
        }
        if (progressed) last_progress = cb_now_ms();
        if (finished == in->n) snprintf(extra, sizeof extra, "processed");
        bar(in, "process", finished, in->n, extra);
        if (finished == in->n) break;
        if (cb_now_ms() - last_progress > (double)stall_ms) {
            bar_end(in);
            cbctl_error(in->ctl, "no progress for %lld ms (cbctl.ingest_timeout_ms): %zu of %zu documents processed",
                        (long long)stall_ms, finished, in->n);
            return CBCTL_EXIT_UNAVAILABLE;
        }
        if (end > 0 && cb_now_ms() >= end) {
            bar_end(in);
            cbctl_error(in->ctl, "not processed within --timeout %lld ms: %zu of %zu documents processed",
                        (long long)total_ms, finished, in->n);
            return CBCTL_EXIT_UNAVAILABLE;
        }
        zclock_sleep(200);
    }
    return CBCTL_EXIT_OK;
}

static int run_ingest(cbctl_t *ctl, int argc, char **argv) {
    bool wait = false;
    const char *prefix = "";
    int64_t total_ms = 0;
    int first_path = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--wait")) wait = true;
        else if (!strcmp(argv[i], "--prefix") && i + 1 < argc) prefix = argv[++i];
        else if (!strcmp(argv[i], "--timeout") && i + 1 < argc) {
            char *end = NULL;
            long long v = strtoll(argv[++i], &end, 10);
            if (end == argv[i] || *end || v < 1 || v > 86400000LL * 7) {
                cbctl_error(ctl, "--timeout %s: expected milliseconds, 1 to 604800000", argv[i]);
                return CBCTL_EXIT_USAGE;
            }
            total_ms = v;
        }
        else if (!strcmp(argv[i], "--")) {
            first_path = i + 1;
            break;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            cbctl_error(ctl, "unknown option %s\nusage: cbctl ingest [--wait [--timeout MS]] [--prefix ID_PREFIX] PATH...",
                        argv[i]);
            return CBCTL_EXIT_USAGE;
        } else {
            first_path = i;
            break;
        }
    }
    if (first_path == 0 || first_path >= argc) {
        cbctl_error(ctl, "no PATH\nusage: cbctl ingest [--wait [--timeout MS]] [--prefix ID_PREFIX] PATH...");
        return CBCTL_EXIT_USAGE;
    }
    char err[512];
    int64_t stall;
    if (!cb_config_int(ctl->cfg, "cbctl", "ingest_timeout_ms", 1, 86400000, 30000, &stall, err, sizeof err)) {
        cbctl_error(ctl, "%s", err);
        return CBCTL_EXIT_USAGE;
    }
    cb_bus_opts_t opts;
    if (!cbctl_client_opts(ctl, 0, -1, &opts, err, sizeof err)) {
        cbctl_error(ctl, "%s", err);
        return CBCTL_EXIT_USAGE;
    }
    ingest_t in = {.ctl = ctl, .prefix = prefix, .tty = isatty(2) != 0, .t0 = cb_now_ms(), .stall_ms = stall,
                   .req_timeout_ms = opts.request_timeout_ms, .req_retries = opts.request_retries};
    char host[32] = "";
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = 0;
    for (char *h = host; *h; h++)
        if (*h < 0x21 || *h > 0x7e) *h = '_';
    snprintf(in.client, sizeof in.client, "cbctl-%.31s-%ld", host, (long)getpid());
    if (!(in.c = cbctl_client(ctl, "precompute", 0, -1, err, sizeof err)) || !(in.w = cb_msg_writer_new())) {
        cbctl_error(ctl, "%s", err);
        cb_bus_client_destroy(&in.c);
        return CBCTL_EXIT_USAGE;
    }
    for (int i = first_path; i < argc && !in.unavailable; i++) {
        if (i > first_path && !strcmp(argv[i], "--wait")) {
            wait = true;
            continue;
        }
        ingest_path(&in, argv[i], true, 0);
    }
    size_t acked = 0;
    for (size_t i = 0; i < in.n; i++) acked += in.docs[i].acked;
    int rc = CBCTL_EXIT_OK;
    if (in.unavailable) rc = CBCTL_EXIT_UNAVAILABLE;
    else if (in.n == 0 && in.n_errors == 0) {
        cbctl_error(ctl, "no documents found (.txt, .md, .jsonl)");
        rc = CBCTL_EXIT_USAGE;
    } else {
        bar_end(&in);
        if (wait && acked > 0) rc = wait_jobs(&in, stall, total_ms);
        if (rc == CBCTL_EXIT_OK && in.n_errors > 0) rc = CBCTL_EXIT_FAIL;
    }
    bar_end(&in);
    if (!ctl->quiet)
        fprintf(stderr, "%zu document%s acknowledged%s, %d error%s\n", acked, acked == 1 ? "" : "s",
                wait && rc == CBCTL_EXIT_OK ? " and processed" : "", in.n_errors, in.n_errors == 1 ? "" : "s");
    for (size_t i = 0; i < in.n; i++) free(in.docs[i].doc_id);
    free(in.docs);
    cb_msg_writer_destroy(&in.w);
    cb_bus_client_destroy(&in.c);
    return rc;
}

CBCTL_COMMAND(ingest, "ingest [--wait [--timeout MS]] [--prefix P] PATH...",
              "send documents (.txt .md .jsonl, dirs) to cb-precompute", run_ingest)
