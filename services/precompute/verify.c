/* verify.c: cb-precompute's re-ingest check (see verify.h). */
#include "verify.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "base/clock.h"
#include "base/log.h"
#include "format/kvfile.h"
#include "wire/bus.h"
#include "wire/msg.h"

typedef struct {
    zsock_t *pipe;
    const pc_verify_args_t *a;
    cb_bus_client_t *retriever;
    cb_msg_writer_t *w;
    double down_until;       /* cb-retriever did not answer: not asked again before this (cb_now_ms) */
} verifier_t;

#define DOWN_PAUSE_MS 5000.0 /* a burst of re-ingests while cb-retriever is down costs one timeout, not one each */

/* The distinct keys among keys[n * 64]: counted into *distinct; KV files missing (or not regular files)
 * into *missing. */
static void check_files(const verifier_t *v, const char *keys, size_t n, bool files, int *distinct, int *missing) {
    *distinct = *missing = 0;
    for (size_t i = 0; i < n; i++) {
        const char *k = keys + 64 * i;
        bool dup = false;
        for (size_t j = 0; j < i && !dup; j++) dup = memcmp(keys + 64 * j, k, 64) == 0;
        if (dup) continue;
        (*distinct)++;
        if (!files) continue;
        uint8_t key[32];
        char hex[CB_KV_HEX_BYTES], path[4096 + 80];
        memcpy(hex, k, 64);
        hex[64] = 0;
        struct stat st;
        if (cb_kvfile_unhex(hex, key) != 0 || cb_kvfile_path(v->a->kv_dir, key, path, sizeof path) != 0 ||
            lstat(path, &st) != 0 || !S_ISREG(st.st_mode))
            (*missing)++;
    }
}

/* One check: the verdict and its reason. */
static const char *check(verifier_t *v, const char *doc, const char *keys, size_t n, bool files, char *why,
                         size_t whylen) {
    int distinct, missing;
    check_files(v, keys, n, files, &distinct, &missing);
    char e[512] = "not asked: it did not answer a moment ago";
    cb_msg_t *r = NULL;
    int64_t have = -1;
    if (cb_now_ms() >= v->down_until) {
        char id[32];
        cb_msg_begin(v->w, "count", cb_bus_new_id(id, sizeof id));
        cb_msg_put_str(v->w, "doc_id", doc);
        cb_err_t code = CB_ERR_NONE;
        r = cb_bus_call_ok(v->retriever, v->w, &code, e, sizeof e);
        if (!r && (code == CB_ERR_TIMEOUT || code == CB_ERR_UNAVAILABLE)) v->down_until = cb_now_ms() + DOWN_PAUSE_MS;
    }
    if (!r || !cb_msg_int(r, "chunks", 0, INT64_MAX, &have)) {
        cb_msg_destroy(&r);
        if (missing > 0) {
            snprintf(why, whylen, "%d of %d KV files missing (cb-retriever not asked: %.200s)", missing, distinct, e);
            return "missing";
        }
        snprintf(why, whylen, "cb-retriever: %.300s", r ? "invalid count reply" : e);
        return "unknown";
    }
    cb_msg_destroy(&r);
    if (have < distinct || missing > 0) {
        snprintf(why, whylen, "cb-retriever holds %lld of its %d chunks, %d of %d KV files missing", (long long)have,
                 distinct, missing, distinct);
        return "missing";
    }
    snprintf(why, whylen, "all %d chunks indexed and cached", distinct);
    return "ok";
}

void pc_verify_actor(zsock_t *pipe, void *args) {
    verifier_t v = {.pipe = pipe, .a = args};
    char err[512];
    v.w = cb_msg_writer_new();
    v.retriever = cb_bus_client_from_config(v.a->cfg, "precompute", "retriever", err, sizeof err);
    if (v.retriever) cb_bus_client_set_timeout(v.retriever, v.a->timeout_ms, 0);
    else cb_log(CB_LOG_ERROR, NULL, "verifier: %s (re-ingested documents are not checked)", err);
    zsock_signal(pipe, 0);
    for (;;) {
        zmsg_t *m = zmsg_recv(pipe);
        if (!m) break;
        char *cmd = zmsg_popstr(m);
        bool term = !cmd || strcmp(cmd, "$TERM") == 0;
        if (!term && strcmp(cmd, "CHECK") == 0 && (zmsg_size(m) == 3 || zmsg_size(m) == 4)) {
            zframe_t *token = zmsg_pop(m);
            char *doc = zmsg_popstr(m);
            zframe_t *keys = zmsg_pop(m);
            char *where = zmsg_popstr(m); /* "remote": its KV files are on another host */
            bool files = !where || strcmp(where, "remote") != 0;
            zstr_free(&where);
            char why[512] = "";
            const char *verdict = "unknown";
            if (!v.w || !v.retriever || !doc)
                snprintf(why, sizeof why, "the verifier cannot run");
            else if (zframe_size(keys) % 64 != 0)
                snprintf(why, sizeof why, "bad key list");
            else
                verdict = check(&v, doc, (const char *)zframe_data(keys), zframe_size(keys) / 64, files, why,
                                sizeof why);
            zmsg_t *out = zmsg_new();
            zmsg_addstr(out, "CHECKED");
            zmsg_append(out, &token);
            zmsg_addstr(out, verdict);
            zmsg_addstr(out, why);
            zmsg_send(&out, pipe);
            zstr_free(&doc);
            zframe_destroy(&keys);
        }
        zstr_free(&cmd);
        zmsg_destroy(&m);
        if (term) break;
    }
    cb_bus_client_destroy(&v.retriever);
    cb_msg_writer_destroy(&v.w);
}
