/* notify.c: cb-blend's cache-index notifier thread (see notify.h). */
#include "notify.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"
#include "wire/bus.h"

#define NOTE_HEADER_BYTES offsetof(notify_note_t, chunks)

typedef struct {
    zsock_t *pipe;
    notify_args_t *a;
    cb_bus_client_t *index;   /* taken over from the args */
    cb_msg_writer_t *w;       /* NULL when out of memory: notices are dropped */
} notifier_t;

/* A chunk's key as hex and its KV file under kv_dir. */
typedef struct {
    char hex[CB_KV_HEX_BYTES];
    char rel[CB_KV_REL_PATH_BYTES];
} chunk_names_t;

static chunk_names_t names_of(const notify_chunk_t *c) {
    chunk_names_t nm;
    cb_kvfile_hex(c->key, nm.hex);
    cb_kvfile_rel_path(c->key, nm.rel, sizeof nm.rel);
    return nm;
}

static bool stopping(const notifier_t *n) { return atomic_load(&n->a->stopping); }

/* A request that failed: counted when cb-cacheindex did not answer, logged either way. */
static void request_failed(notifier_t *n, const char *qid, const char *what, cb_err_t code, const char *e) {
    if (code == CB_ERR_TIMEOUT || code == CB_ERR_UNAVAILABLE) atomic_fetch_add(n->a->unavailable, 1);
    cb_log(CB_LOG_WARN, qid, "cache index %s: %s", what, e);
}

/* `put` of one chunk's KV file (it must exist: a chunk whose file went meanwhile is logged and skipped). */
static void put_chunk(notifier_t *n, const char *qid, const notify_chunk_t *c) {
    if (stopping(n)) return;
    chunk_names_t nm = names_of(c);
    char path[4096 + CB_KV_REL_PATH_BYTES + 2];
    snprintf(path, sizeof path, "%s/%s", n->a->kv_dir, nm.rel);
    struct stat sb;
    if (lstat(path, &sb) != 0) {
        cb_log(CB_LOG_WARN, qid, "chunk %.16s: no KV file to register (%s)", nm.hex, strerror(errno));
        return;
    }
    if (!S_ISREG(sb.st_mode)) {
        cb_log(CB_LOG_WARN, qid, "chunk %.16s: not a regular file at its KV path: not registered", nm.hex);
        return;
    }
    char id[CB_MSG_MAX_ID + 1];
    snprintf(id, sizeof id, "%.40s.p", qid);
    cb_msg_begin(n->w, "put", id);
    cb_msg_put_str(n->w, "key", nm.hex);
    cb_msg_put_str(n->w, "path", nm.rel);
    cb_msg_put_int(n->w, "bytes", (int64_t)sb.st_size);
    cb_msg_put_int(n->w, "tokens", c->tokens);
    cb_msg_put_str(n->w, "fingerprint", n->a->fp_hex);
    cb_err_t code;
    char e[512];
    cb_msg_t *r = cb_bus_call_ok(n->index, n->w, &code, e, sizeof e);
    if (!r) request_failed(n, qid, "put", code, e);
    cb_msg_destroy(&r);
}

/* The note's TOUCH chunk whose key is the hex k [kl] (from the reply), or NULL. */
static const notify_chunk_t *find_touched(const notify_note_t *note, const char *k, size_t kl) {
    for (int i = 0; i < note->n; i++) {
        const notify_chunk_t *c = &note->chunks[i];
        if (c->kind != NOTIFY_TOUCH) continue;
        chunk_names_t nm = names_of(c);
        if (strlen(nm.hex) == kl && memcmp(nm.hex, k, kl) == 0) return c;
    }
    return NULL;
}

/* One `touch` {keys, hit: true} of the note's TOUCH chunks; then a put of every one the index did not
 * know (reply field `unknown`), when puts are on. */
static void touch_chunks(notifier_t *n, const notify_note_t *note) {
    int nk = 0;
    for (int i = 0; i < note->n; i++) nk += note->chunks[i].kind == NOTIFY_TOUCH;
    if (nk == 0) return;
    char id[CB_MSG_MAX_ID + 1];
    snprintf(id, sizeof id, "%.40s.t", note->id);
    cb_msg_begin(n->w, "touch", id);
    cb_msg_begin_array(n->w, "keys");
    for (int i = 0; i < note->n; i++)
        if (note->chunks[i].kind == NOTIFY_TOUCH) cb_msg_put_str(n->w, NULL, names_of(&note->chunks[i]).hex);
    cb_msg_end_array(n->w);
    cb_msg_put_bool(n->w, "hit", true);
    cb_err_t code;
    char e[512];
    cb_msg_t *r = cb_bus_call_ok(n->index, n->w, &code, e, sizeof e);
    if (!r) {
        request_failed(n, note->id, "touch", code, e);
        return;
    }
    size_t nu = 0;
    if (n->a->store && cb_msg_has(r, "unknown") && cb_msg_array_len(r, "unknown", NOTIFY_MAX_CHUNKS, &nu)) {
        for (size_t u = 0; u < nu; u++) {
            const char *k;
            size_t kl;
            const notify_chunk_t *c;
            if (cb_msg_at_str(r, "unknown", u, CB_KV_HEX_BYTES, &k, &kl) && (c = find_touched(note, k, kl))) {
                cb_log(CB_LOG_INFO, note->id, "chunk %.16s: a KV file the cache index did not know: put", k);
                put_chunk(n, note->id, c);
            }
        }
    }
    cb_msg_destroy(&r);
}

static void handle_note(notifier_t *n, zframe_t *f) {
    notify_note_t note;
    size_t len = f ? zframe_size(f) : 0;
    if (len < NOTE_HEADER_BYTES || len > sizeof note) return;
    memcpy(&note, zframe_data(f), len);
    if (note.n < 0 || note.n > NOTIFY_MAX_CHUNKS || len != NOTE_HEADER_BYTES + (size_t)note.n * sizeof(notify_chunk_t))
        return;
    note.id[sizeof note.id - 1] = 0;
    if (stopping(n)) return;
    if (!n->w) { /* out of memory at start: the notice is lost, and counted */
        atomic_fetch_add(n->a->dropped, 1);
        return;
    }
    touch_chunks(n, &note);
    if (!n->a->store) return;
    for (int i = 0; i < note.n; i++)
        if (note.chunks[i].kind == NOTIFY_PUT) put_chunk(n, note.id, &note.chunks[i]);
}

void notify_actor(zsock_t *pipe, void *args) {
    notifier_t n = {.pipe = pipe, .a = args};
    n.index = n.a->index;
    n.a->index = NULL;
    if (!(n.w = cb_msg_writer_new()))
        cb_log(CB_LOG_ERROR, NULL, "cache index notifier: out of memory: cb-cacheindex will not hear of this "
                                   "service's chunks");
    cb_bus_client_set_timeout(n.index, n.a->timeout_ms, 0);
    zsock_signal(pipe, 0);
    for (;;) {
        zmsg_t *m = zmsg_recv(pipe);
        if (!m) break; /* interrupted, or the context is going */
        char *cmd = zmsg_popstr(m);
        bool term = !cmd || strcmp(cmd, "$TERM") == 0;
        if (!term && strcmp(cmd, "NOTE") == 0) {
            zframe_t *f = zmsg_pop(m);
            handle_note(&n, f);
            zframe_destroy(&f);
        }
        zstr_free(&cmd);
        zmsg_destroy(&m);
        if (term) break;
    }
    cb_msg_writer_destroy(&n.w);
    cb_bus_client_destroy(&n.index);
}

bool notify_post(zactor_t *actor, const notify_note_t *note) {
    if (!actor || !note || note->n < 0 || note->n > NOTIFY_MAX_CHUNKS) return false;
    void *h = zsock_resolve(actor);
    size_t len = NOTE_HEADER_BYTES + (size_t)note->n * sizeof(notify_chunk_t);
    /* a two-part message is queued whole or not at all: the high-water mark is checked on the first part */
    if (zmq_send(h, "NOTE", 4, ZMQ_SNDMORE | ZMQ_DONTWAIT) != 4) return false;
    return zmq_send(h, note, len, ZMQ_DONTWAIT) == (int)len;
}
