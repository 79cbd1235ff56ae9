/* fetch.c: cb-blend's retrieval thread (see fetch.h). */
#include "fetch.h"
#include "base/alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/log.h"
#include "wire/bus.h"
#include "wire/msg.h"
#include "wire/query.h"

typedef struct {
    zsock_t *pipe;
    cb_bus_client_t *retriever;
    cb_msg_writer_t *w;
} fetch_t;

/* Asks cb-retriever for q's top k chunks into q->contexts. 0, or -1 with *code and err. */
static int retrieve(fetch_t *f, gen_query_t *q, cb_err_t *code, char *err, size_t errlen) {
    char id[CB_MSG_MAX_ID + 1];
    snprintf(id, sizeof id, "%.40s.r", q->id);
    cb_msg_begin(f->w, "search", id);
    cb_msg_put_str(f->w, "query", q->question);
    cb_msg_put_int(f->w, "k", q->k);
    char e[512];
    cb_msg_t *r = cb_bus_call_ok(f->retriever, f->w, code, e, sizeof e);
    if (!r) {
        snprintf(err, errlen, "cb-retriever: %s", e);
        if (*code != CB_ERR_TIMEOUT && *code != CB_ERR_UNAVAILABLE) *code = CB_ERR_UNAVAILABLE;
        return -1;
    }
    size_t n = 0;
    if (!cb_msg_array_len(r, "hits", (size_t)q->k < CB_QUERY_MAX_CONTEXTS ? (size_t)q->k : CB_QUERY_MAX_CONTEXTS, &n)) {
        snprintf(err, errlen, "cb-retriever: invalid reply: %s", cb_msg_last_error(r));
        *code = CB_ERR_INTERNAL;
        cb_msg_destroy(&r);
        return -1;
    }
    int got = 0;
    for (size_t i = 0; i < n; i++) {
        const cb_msg_t *h = cb_msg_at_map(r, "hits", i);
        const char *s;
        size_t len;
        if (!h || !cb_msg_str(h, "text", CB_QUERY_MAX_CONTEXT_BYTES, &s, &len)) continue;
        if (!(q->contexts[got] = cb_strndup(s, len))) break;
        q->context_lens[got++] = len;
    }
    q->n_contexts = got;
    cb_msg_destroy(&r);
    return 0;
}

/* Retrieves q's contexts (unless it was cancelled) and sends it back. */
static void fetch_one(fetch_t *f, gen_query_t *q) {
    zmsg_t *m = zmsg_new();
    char err[640];
    cb_err_t code = CB_ERR_INTERNAL;
    double t = cb_now_ms();
    if (atomic_load(&q->cancelled) || retrieve(f, q, &code, err, sizeof err) == 0) {
        q->retrieve_ms = cb_now_ms() - t;
        zmsg_addstr(m, "FETCHED");
        zmsg_addmem(m, &q, sizeof q);
    } else {
        size_t len = 0;
        const void *d = cb_msg_write_error(f->w, "done", q->id, code, &len, "%s", err);
        cb_log(CB_LOG_WARN, q->id, "query failed: %s: %s", cb_err_name(code), err);
        zmsg_addstr(m, "FAILED");
        zmsg_addmem(m, &q, sizeof q);
        zmsg_addmem(m, d, d ? len : 0);
    }
    zmsg_send(&m, f->pipe);
}

void fetch_actor(zsock_t *pipe, void *args) {
    fetch_args_t *a = args;
    fetch_t f = {.pipe = pipe};
    zsock_signal(pipe, 0);
    char err[512];
    f.w = cb_msg_writer_new();
    f.retriever = cb_bus_client_from_config(a->cfg, "blend", "retriever", err, sizeof err);
    if (!f.w || !f.retriever) {
        if (!f.w) snprintf(err, sizeof err, "out of memory");
        zstr_sendx(pipe, "FATAL", err, NULL);
    } else {
        cb_bus_client_set_timeout(f.retriever, a->timeout_ms, 1); /* queries wait on it: one retry */
        zstr_send(pipe, "READY");
    }
    for (;;) {
        zmsg_t *m = zmsg_recv(pipe);
        char *cmd = m ? zmsg_popstr(m) : NULL;
        bool term = !cmd || strcmp(cmd, "$TERM") == 0;
        if (!term && f.retriever && strcmp(cmd, "QUERY") == 0) {
            zframe_t *fr = zmsg_pop(m);
            gen_query_t *q = NULL;
            if (fr && zframe_size(fr) == sizeof q) memcpy(&q, zframe_data(fr), sizeof q);
            zframe_destroy(&fr);
            if (q) {
                atomic_store(&a->beat_ms, (uint64_t)cb_now_ms());
                atomic_store(&a->busy, true);
                fetch_one(&f, q);
                atomic_store(&a->busy, false);
                atomic_store(&a->beat_ms, (uint64_t)cb_now_ms());
            }
        }
        zstr_free(&cmd);
        zmsg_destroy(&m);
        if (term) break;
    }
    cb_bus_client_destroy(&f.retriever);
    cb_msg_writer_destroy(&f.w);
}
