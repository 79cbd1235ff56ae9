/* blend_rows.c: a request's rows for the fused prefill: every row's token, class (LOADED, COMPUTED,
 * CANDIDATE) and source, the chunk sources taking over the resolved entries and files, and the request's
 * sequence (the context's blocks shared). Part of blend (blend_internal.h). */
#include "blend/blend_internal.h"
#include "base/alloc.h"

#include <stdlib.h>
#include <string.h>

#include "base/err.h"

static int add_src(cb_blend_t *b, src_t **out) {
    if (b->n_srcs == b->cap_srcs) {
        int cap = b->cap_srcs ? b->cap_srcs * 2 : 16;
        src_t *p = cb_realloc(b->srcs, sizeof(src_t) * (size_t)cap);
        if (!p) return -1;
        b->srcs = p;
        b->cap_srcs = cap;
    }
    *out = &b->srcs[b->n_srcs++];
    memset(*out, 0, sizeof **out);
    return 0;
}

void cb_blend_release_srcs(cb_blend_t *b) {
    for (int i = 0; i < b->n_srcs; i++) {
        src_t *s = &b->srcs[i];
        cb_kvmem_entry_release(&s->entry);
        cb_kvmem_entry_release(&s->fill);
        cb_kvfile_destroy(&s->file);
        free(s->raw_k);
        free(s->raw_v);
        s->raw_k = s->raw_v = NULL;
    }
    b->n_srcs = 0;
}

/* The chunk sources (b->srcs, taking over the resolved chunks' entries and files) and every row's token,
 * class and source. The prefix rows are LOADED without a source in every mode but full: the sequence
 * shares them. Returns the number of candidate rows, or -1 (out of memory). */
int cb_blend_build_rows(cb_blend_t *b, cb_blend_mode_t mode, const int32_t *prefix, int n_prefix,
                      const cb_blend_chunk_t *chunks, int n_chunks, int n_need, cb_kvstore_chunk_t *rs,
                      const int32_t *suffix, int n_suffix, int lead_tokens) {
    cb_blend_release_srcs(b);
    int r = 0, n_cand_total = 0;
    for (int i = 0; i < n_prefix; i++, r++) {
        b->tok[r] = prefix[i];
        b->cls[r] = mode == CB_BLEND_FULL ? CB_ROW_COMPUTED : CB_ROW_LOADED;
        b->src_of[r] = -1;
    }
    for (int c = 0; c < n_chunks; c++) {
        int si = -1;
        if (c < n_need) {
            src_t *s;
            if (add_src(b, &s)) return -1;
            si = b->n_srcs - 1;
            s->row0 = r;
            s->n = chunks[c].n;
            s->chunk = c;
            memcpy(s->key, rs[c].key, 32);
            if (rs[c].file) {
                s->kind = SRC_FILE;
                s->file = rs[c].file;
                rs[c].file = NULL;
                s->dtype = cb_kvfile_meta(s->file)->dtype;
                s->raw_k = cb_calloc((size_t)b->L, sizeof(void *));
                s->raw_v = cb_calloc((size_t)b->L, sizeof(void *));
                if (!s->raw_k || !s->raw_v) return -1;
                /* with a memory tier the file is decoded into an entry that joins it; a block dtype (q8_0)
                 * that the backend's row load does not take is decoded into one in any case */
                if (cb_kvstore_mem(b->store) || !cb_engine_kv_load_takes(b->e, s->dtype)) {
                    s->fill = cb_kvmem_entry_new(b->L, b->hp->n_head_kv, b->HD, s->n);
                    if (!s->fill) return -1;
                    memcpy(cb_kvmem_entry_tokens_mut(s->fill), chunks[c].tokens, sizeof(int32_t) * (size_t)s->n);
                }
            } else {
                s->kind = SRC_ENTRY;
                s->entry = rs[c].entry;
                rs[c].entry = NULL;
            }
        }
        for (int i = 0; i < chunks[c].n; i++, r++) {
            int cl = CB_ROW_COMPUTED;
            if (si >= 0) {
                if (mode == CB_BLEND_BLEND) cl = i < lead_tokens ? CB_ROW_COMPUTED : CB_ROW_CANDIDATE;
                else cl = CB_ROW_LOADED;
            }
            b->tok[r] = chunks[c].tokens[i];
            b->cls[r] = (uint8_t)cl;
            b->src_of[r] = si; /* -1 when the chunk has no cached KV */
            if (si >= 0) {
                if (cl == CB_ROW_LOADED) b->srcs[si].n_loaded++;
                if (cl == CB_ROW_CANDIDATE) b->srcs[si].n_cand++, n_cand_total++;
            }
        }
    }
    for (int i = 0; i < n_suffix; i++, r++) {
        b->tok[r] = suffix[i];
        b->cls[r] = CB_ROW_COMPUTED;
        b->src_of[r] = -1;
    }
    return n_cand_total;
}

/* The request's sequence: the context's blocks shared (every mode but full), the rest of [0, N) owned. */
int cb_blend_prepare_seq(cb_blend_t *b, cb_seq_t *seq, cb_blend_mode_t mode, int n_prefix, int N, char *err,
                       size_t errlen) {
    cb_seq_clear(seq);
    int rc = CB_ENGINE_OK, from = 0;
    if (mode != CB_BLEND_FULL) {
        rc = cb_seq_share(seq, cb_kvstore_context_seq(b->store), n_prefix);
        from = n_prefix;
    }
    if (rc == CB_ENGINE_OK) rc = cb_seq_reserve(seq, from, N);
    if (rc) {
        cb_seq_clear(seq);
        cb_set_err(err, errlen, "blend: %s for a prompt of %d tokens", cb_engine_status_str(rc), N);
    }
    return rc;
}
