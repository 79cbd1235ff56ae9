/* blend.c: CacheBlend fused prefill over the engine's layer-stage primitives (see blend.h).
 *
 * One code path: every mode is a run over the rows of a prompt in the request's sequence, each row LOADED,
 * COMPUTED or CANDIDATE. The prefix rows are the store's context, shared by reference (no source, nothing
 * to load). A run:
 *   1. active set A = rows not LOADED (ascending positions); x[A] = embeddings;
 *   2. per layer l: wait until the loader has placed layer l's cached K/V (LOADED rows at every layer,
 *      CANDIDATE rows at layers > check_layer) in the sequence; QKV of A (ubatches), deviation
 *      of the candidates on measuring layers (fresh pre-RoPE K or V vs the cached ones), RoPE, K/V of A
 *      into the sequence; on measuring layers narrow A (and x, q) to the forced rows + the most deviating
 *      candidates; attention (key limit pos + 1) + MLP for A; at the last layer only the last row (its
 *      residual feeds the logits; the K/V of every active row are already in the sequence);
 *   3. logits of the last row.
 * The loader (a thread, or inline with no_overlap) runs ahead of the compute layer by layer: it hands the
 * cached K/V of a layer straight from the source (an f32 entry, or the KV file's mapping in its dtype) to
 * the backend's layer load (cb_engine_kv_load: converted into the sequence's pool rows, K rotated there,
 * one pass, no staging copy); the compute of layer l waits only for the loader's layer l. Deviation rows of
 * streamed files are read from the mapping in their dtype (pointers published by the loader with the
 * layer). Every step goes through the engine's primitives, which go through the backend table.
 *
 * Owns: every buffer of struct cb_blend (blend_internal.h), the loader thread of a run. Borrows: the store
 * (and its engine), the sequence of a call.
 *
 * The files: this one holds the options, the object's lifetime, the request checks and a call in slices
 * (resolve, then the passes, restarts on a file miss); blend_rows.c builds the rows and sources,
 * blend_loader.c places the cached K/V, blend_select.c chooses the recomputed rows, blend_pass.c runs a
 * pass over the layers; blend_internal.h holds what they share.
 */
#include "blend/blend_internal.h"
#include "base/alloc.h"

#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/err.h"
#include "base/log.h"

/* ---------------------------------------------------------------- options */

void cb_blend_opts_default(cb_blend_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->mode = CB_BLEND_BLEND;
    o->ratio = CB_BLEND_DEFAULT_RATIO;
    o->check_layer = CB_BLEND_DEFAULT_CHECK_LAYER;
    o->metric = CB_BLEND_DEFAULT_METRIC;
    o->lead_tokens = CB_BLEND_DEFAULT_LEAD;
    o->probe_layers = CB_BLEND_DEFAULT_PROBE_LAYERS;
    o->probe_suffix = CB_BLEND_DEFAULT_PROBE_SUFFIX;
    o->auto_floor = CB_BLEND_DEFAULT_AUTO_FLOOR;
    o->auto_ceil = CB_BLEND_DEFAULT_AUTO_CEIL;
    o->auto_cost_keys = CB_BLEND_DEFAULT_AUTO_COST_KEYS;
    o->sparse_keys = CB_BLEND_DEFAULT_SPARSE_KEYS;
}

static const char *const MODE_NAMES[CB_BLEND_MODE_COUNT_] = {"full", "prefix", "reuse", "blend"};

const char *cb_blend_mode_str(cb_blend_mode_t m) {
    return (int)m >= 0 && m < CB_BLEND_MODE_COUNT_ ? MODE_NAMES[m] : "?";
}

int cb_blend_mode_parse(const char *s) {
    if (!s) return -1;
    for (int i = 0; i < CB_BLEND_MODE_COUNT_; i++)
        if (!strcmp(s, MODE_NAMES[i])) return i;
    return -1;
}

char cb_blend_metric_parse(const char *s) {
    return s && s[0] && !s[1] && strchr("akv", s[0]) ? s[0] : 0;
}

static int check_opts(const cb_blend_t *b, const cb_blend_opts_t *o, char *err, size_t errlen) {
    if ((int)o->mode < 0 || o->mode >= CB_BLEND_MODE_COUNT_) {
        cb_set_err(err, errlen, "blend: unknown mode %d", (int)o->mode);
        return -1;
    }
    if (!(o->ratio >= 0.0f && o->ratio <= 1.0f)) {
        cb_set_err(err, errlen, "blend: ratio %g outside [0, 1]", (double)o->ratio);
        return -1;
    }
    if (!(o->auto_target >= 0.0f && o->auto_target <= 1.0f) ||
        !(o->auto_floor >= 0.0f && o->auto_floor <= o->auto_ceil && o->auto_ceil <= 1.0f)) {
        cb_set_err(err, errlen, "blend: ratio = auto needs 0 <= target <= 1 and 0 <= floor <= ceil <= 1 (got %g, %g, %g)",
                   (double)o->auto_target, (double)o->auto_floor, (double)o->auto_ceil);
        return -1;
    }
    if (o->auto_target > 0.0f && o->gradual_ratio != 0.0f) {
        cb_set_err(err, errlen, "blend: ratio = auto and gradual filtering do not combine");
        return -1;
    }
    if (o->check_layer < 0 || o->check_layer >= b->L) {
        cb_set_err(err, errlen, "blend: check layer %d outside [0, %d]", o->check_layer, b->L - 1);
        return -1;
    }
    if (!cb_blend_metric_parse((const char[]){o->metric, 0})) {
        cb_set_err(err, errlen, "blend: metric must be 'k', 'v' or 'a'");
        return -1;
    }
    if (o->metric == 'a' && o->gradual_ratio != 0.0f) {
        cb_set_err(err, errlen, "blend: gradual filtering needs a deviation metric ('k' or 'v')");
        return -1;
    }
    if (o->gradual_ratio != 0.0f) {
        if (!(o->gradual_ratio > o->ratio && o->gradual_ratio <= 1.0f)) {
            cb_set_err(err, errlen, "blend: gradual start ratio %g must be in (ratio %g, 1]", (double)o->gradual_ratio,
                    (double)o->ratio);
            return -1;
        }
        if (o->gradual_end_layer <= o->check_layer || o->gradual_end_layer >= b->L) {
            cb_set_err(err, errlen, "blend: gradual end layer %d must be in (check layer %d, %d]", o->gradual_end_layer,
                    o->check_layer, b->L - 1);
            return -1;
        }
    }
    if (!(o->auto_cost_keys >= 0.0f && o->auto_cost_keys <= CB_BLEND_AUTO_COST_KEYS_MAX)) {
        cb_set_err(err, errlen, "blend: auto cost keys %g not in 0..%g (0 = off)", (double)o->auto_cost_keys,
                   (double)CB_BLEND_AUTO_COST_KEYS_MAX);
        return -1;
    }
    if (o->lead_tokens < 0) {
        cb_set_err(err, errlen, "blend: lead tokens %d < 0", o->lead_tokens);
        return -1;
    }
    if (o->probe_layers < 0 || o->probe_layers > b->L) {
        cb_set_err(err, errlen, "blend: probe layers %d outside [0, %d] (0 = all)", o->probe_layers, b->L);
        return -1;
    }
    if (!(o->sparse_keys >= 0.0f && o->sparse_keys <= 1.0f)) {
        cb_set_err(err, errlen, "blend: sparse keys %g outside [0, 1] (0 = dense)", (double)o->sparse_keys);
        return -1;
    }
    if (o->probe_suffix < 0) {
        cb_set_err(err, errlen, "blend: probe suffix rows %d < 0 (0 = all)", o->probe_suffix);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- lifetime */

cb_blend_t *cb_blend_new(cb_kvstore_t *store, char *err, size_t errlen) {
    if (!store) {
        cb_set_err(err, errlen, "blend: no store");
        return NULL;
    }
    cb_blend_t *b = cb_calloc(1, sizeof *b);
    if (!b) {
        cb_set_err(err, errlen, "blend: out of memory");
        return NULL;
    }
    b->store = store;
    b->e = cb_kvstore_engine(store);
    b->hp = cb_model_hparams(cb_engine_model(b->e));
    b->L = b->hp->n_layer;
    b->E = b->hp->n_embd;
    b->HD = b->hp->head_dim;
    b->QD = b->hp->n_head * b->HD;
    b->KVD = b->hp->n_head_kv * b->HD;
    b->max_ctx = cb_engine_max_ctx(b->e);
    b->max_rows = cb_engine_max_rows(b->e);
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    const size_t C = (size_t)b->max_ctx, R = (size_t)b->max_rows;
    b->x = cb_engine_alloc(b->e, sizeof(float) * C * b->E);
    b->q = cb_engine_alloc(b->e, sizeof(float) * C * b->QD);
    b->kb = cb_engine_alloc(b->e, sizeof(float) * R * b->KVD);
    b->vb = cb_engine_alloc(b->e, sizeof(float) * R * b->KVD);
    b->tok = cb_malloc(sizeof(int32_t) * C);
    b->cls = cb_malloc(C);
    b->src_of = cb_malloc(sizeof(int32_t) * C);
    b->act = cb_malloc(sizeof(int32_t) * C);
    b->dev = cb_malloc(sizeof(double) * C);
    b->order = cb_malloc(sizeof(int32_t) * C);
    b->cand = cb_malloc(sizeof(int32_t) * C);
    b->keep = cb_malloc(C);
    b->ub_lim = cb_malloc(sizeof(int32_t) * R);
    b->ub_tok = cb_malloc(sizeof(int32_t) * R);
    b->mass = cb_malloc(sizeof(float) * C);
    b->wdev = cb_malloc(sizeof(double) * C);
    b->sparse = cb_calloc(C, 1);
    b->blk_keep = cb_malloc(C);
    b->blk_list = cb_malloc(sizeof(int32_t) * C);
    b->blk_mass = cb_malloc(sizeof(double) * C);
    cb_engine_pool_stats_t ps;
    cb_engine_pool_stats(b->e, &ps);
    b->bt = ps.block_tokens;
    if (!b->x || !b->q || !b->kb || !b->vb || !b->tok || !b->cls || !b->src_of || !b->act || !b->dev || !b->order ||
        !b->cand || !b->keep || !b->ub_lim || !b->ub_tok || !b->mass || !b->wdev ||
        !b->sparse || !b->blk_keep || !b->blk_list || !b->blk_mass) {
        cb_set_err(err, errlen, "blend: out of memory (%d positions)", b->max_ctx);
        cb_blend_destroy(&b);
        return NULL;
    }
    return b;
}

cb_kvstore_t *cb_blend_store(const cb_blend_t *self) { return self->store; }

void cb_blend_destroy(cb_blend_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_blend_t *b = *self_p;
    cb_blend_cancel(b);
    cb_blend_release_srcs(b);
    free(b->job.chunks);
    free(b->job.rs);
    free(b->job.force);
    free(b->srcs);
    free(b->info);
    cb_engine_free(b->e, b->x);
    cb_engine_free(b->e, b->q);
    cb_engine_free(b->e, b->kb);
    cb_engine_free(b->e, b->vb);
    free(b->tok);
    free(b->cls);
    free(b->src_of);
    free(b->act);
    free(b->dev);
    free(b->order);
    free(b->cand);
    free(b->keep);
    free(b->ub_lim);
    free(b->ub_tok);
    free(b->mass);
    free(b->wdev);
    free(b->sparse);
    free(b->blk_keep);
    free(b->blk_list);
    free(b->blk_mass);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b);
    *self_p = NULL;
}

/* ---------------------------------------------------------------- small helpers */

static int check_tokens(const cb_blend_t *b, const int32_t *t, int n, const char *what, char *err, size_t errlen) {
    char w[48];
    snprintf(w, sizeof w, "blend: %s", what);
    return cb_model_check_tokens(cb_engine_model(b->e), t, n, w, err, errlen);
}

/* ---------------------------------------------------------------- the fused prefill */

/* Validates a request; the prompt length N, or -1 with err (CB_ENGINE_EINVAL to the caller). */
static long long check_request(const cb_blend_t *b, const int32_t *prefix, int n_prefix,
                               const cb_blend_chunk_t *chunks, int n_chunks, const int32_t *suffix, int n_suffix,
                               const cb_blend_opts_t *opts, char *err, size_t errlen) {
    if (check_opts(b, opts, err, errlen)) return -1;
    if (n_chunks < 0 || (n_chunks > 0 && !chunks)) {
        cb_set_err(err, errlen, "blend: bad chunk list");
        return -1;
    }
    if (check_tokens(b, prefix, n_prefix, "prefix", err, errlen) ||
        check_tokens(b, suffix, n_suffix, "suffix", err, errlen))
        return -1;
    long long N = (long long)n_prefix + n_suffix;
    for (int c = 0; c < n_chunks; c++) {
        char what[32];
        snprintf(what, sizeof what, "chunk %d", c);
        if (check_tokens(b, chunks[c].tokens, chunks[c].n, what, err, errlen)) return -1;
        if (chunks[c].n > CB_KV_MAX_TOKENS) {
            cb_set_err(err, errlen, "blend: chunk %d of %d tokens exceeds the KV file limit", c, chunks[c].n);
            return -1;
        }
        N += chunks[c].n;
    }
    if (N > b->max_ctx) {
        cb_set_err(err, errlen, "blend: prompt of %lld tokens exceeds max_ctx %d", N, b->max_ctx);
        return -1;
    }
    return N;
}

/* ---------------------------------------------------------------- a call in slices */

static void add_pass_times(cb_blend_stats_t *st, const run_t *R) {
    st->t_load_ms += R->t_load;
    st->t_load_wait_ms += R->t_wait;
    st->t_compute_ms += R->t_compute;
    st->t_select_ms += R->t_select;
}

/* Ends the call: the loader joined, the chunks and sources released; on failure the sequence cleared. */
static void job_end(cb_blend_t *b, bool ok) {
    job_t *J = &b->job;
    cb_blend_run_stop_loader(b);
    if (!ok) cb_seq_clear(J->seq);
    for (int c = 0; c < J->n_chunks; c++) cb_kvstore_chunk_release(&J->rs[c]);
    cb_blend_release_srcs(b);
    b->seq = NULL;
    J->seq = NULL;
    J->cur = NULL;
    J->ph = PH_IDLE;
}

/* Grows the per-chunk arrays to n chunks. 0, or -1 (out of memory; nothing lost). */
static int job_reserve(cb_blend_t *b, int n) {
    job_t *J = &b->job;
    if (n <= J->cap_chunks && n <= b->cap_info) return 0;
    cb_blend_chunk_t *c = cb_realloc(J->chunks, sizeof *c * (size_t)n);
    if (c) J->chunks = c;
    cb_kvstore_chunk_t *rs = cb_realloc(J->rs, sizeof *rs * (size_t)n);
    if (rs) J->rs = rs;
    uint8_t *f = cb_realloc(J->force, (size_t)n);
    if (f) J->force = f;
    cb_blend_chunk_info_t *in = cb_realloc(b->info, sizeof *in * (size_t)n);
    if (in) b->info = in;
    if (!c || !rs || !f || !in) return -1;
    J->cap_chunks = b->cap_info = n;
    return 0;
}

int cb_blend_start(cb_blend_t *self, cb_seq_t *seq, const int32_t *prefix, int n_prefix,
                   const cb_blend_chunk_t *chunks, int n_chunks, const int32_t *suffix, int n_suffix,
                   const cb_blend_opts_t *opts, float *logits, char *err, size_t errlen) {
    double t0 = cb_now_ms();
    cb_blend_t *b = self;
    if (!b || !seq) return CB_ENGINE_EINVAL;
    job_t *J = &b->job;
    if (J->ph != PH_IDLE) {
        cb_set_err(err, errlen, "blend: a call is in progress");
        return CB_ENGINE_EINVAL;
    }
    cb_blend_opts_t def;
    if (!opts) {
        cb_blend_opts_default(&def);
        opts = &def;
    }
    const long long N = check_request(b, prefix, n_prefix, chunks, n_chunks, suffix, n_suffix, opts, err, errlen);
    if (N < 0) return CB_ENGINE_EINVAL;
    if (job_reserve(b, n_chunks > 0 ? n_chunks : 1)) {
        cb_set_err(err, errlen, "blend: out of memory");
        return -1;
    }
    if (n_chunks > 0) {
        memcpy(J->chunks, chunks, sizeof *chunks * (size_t)n_chunks);
        memset(J->rs, 0, sizeof *J->rs * (size_t)n_chunks);
        memset(J->force, 0, (size_t)n_chunks);
        memset(b->info, 0, sizeof *b->info * (size_t)n_chunks);
    }
    J->seq = seq;
    J->prefix = prefix;
    J->n_prefix = n_prefix;
    J->suffix = suffix;
    J->n_suffix = n_suffix;
    J->n_chunks = n_chunks;
    J->opts = *opts;
    J->logits = logits;
    J->N = (int)N;
    J->n_need = opts->mode == CB_BLEND_FULL ? 0 : opts->mode == CB_BLEND_PREFIX ? (n_chunks > 0 ? 1 : 0) : n_chunks;
    J->attempt = 0;
    J->c_next = 0;
    J->ctx_ok = false;
    J->cur = NULL;
    memset(&J->st, 0, sizeof J->st);
    J->st.n_tokens = (int)N;
    b->seq = seq;
    J->ph = PH_RESOLVE;
    J->st.t_total_ms = cb_now_ms() - t0;
    return CB_ENGINE_OK;
}

bool cb_blend_busy(const cb_blend_t *self) { return self && self->job.ph != PH_IDLE; }

void cb_blend_cancel(cb_blend_t *self) {
    if (cb_blend_busy(self)) job_end(self, false);
}

/* Resolve phase, one unit: the store's context (first in an attempt), then chunk J->c_next. The cost in
 * row-layers of what it computed; < 0 on failure (CB_ENGINE_EPOOL, or -1 with err). */
static long long resolve_unit(cb_blend_t *b, job_t *J, char *err, size_t errlen) {
    if (!J->ctx_ok) {
        J->ctx_ok = true;
        if (J->opts.mode == CB_BLEND_FULL) return 0;
        int rc = cb_kvstore_set_context(b->store, J->prefix, J->n_prefix, err, errlen);
        return rc == CB_ENGINE_OK ? 0 : rc == CB_ENGINE_EPOOL ? CB_ENGINE_EPOOL : -1;
    }
    const int c = J->c_next++;
    const cb_blend_chunk_t *ch = &J->chunks[c];
    cb_kvstore_chunk_t *rs = &J->rs[c];
    cb_kvstore_chunk_release(rs);
    int rrc = cb_kvstore_resolve(b->store, ch->tokens, ch->n, J->force[c], rs, err, errlen);
    if (rrc) return rrc == CB_ENGINE_EPOOL ? CB_ENGINE_EPOOL : -1;
    cb_blend_chunk_info_t *in = &b->info[c];
    memcpy(in->key, rs->key, 32);
    if (rs->src == CB_KVSTORE_COMPUTED) in->stored = in->stored || rs->stored; /* its KV file was written */
    if (rs->src == CB_KVSTORE_COMPUTED && in->src != CB_KVSTORE_COMPUTED) { /* first computed now */
        in->src = CB_KVSTORE_COMPUTED;
        if (!J->force[c]) in->why = rs->why; /* a forced one keeps the failure that forced it */
    } else if (in->src != CB_KVSTORE_COMPUTED) {
        in->src = rs->src;
    }
    return rs->src == CB_KVSTORE_COMPUTED ? (long long)ch->n * b->L : 0;
}

/* Every chunk resolved: rows, classes, sources, the sequence's blocks, and the first pass begun (metric
 * a's probe, or the main pass). 0, CB_ENGINE_EPOOL, or -1 with err. */
static int begin_passes(cb_blend_t *b, job_t *J, char *err, size_t errlen) {
    const cb_blend_opts_t *o = &J->opts;
    const int N = J->N;
    memset(b->sparse, 0, (size_t)N);
    int n_cand_total = cb_blend_build_rows(b, o->mode, J->prefix, J->n_prefix, J->chunks, J->n_chunks, J->n_need, J->rs,
                                  J->suffix, J->n_suffix, o->lead_tokens);
    if (n_cand_total < 0) {
        cb_set_err(err, errlen, "blend: out of memory");
        return -1;
    }
    int prc = cb_blend_prepare_seq(b, J->seq, o->mode, J->n_prefix, N, err, errlen);
    if (prc) return prc == CB_ENGINE_EPOOL ? CB_ENGINE_EPOOL : -1;
    J->st.n_candidates = n_cand_total;
    J->st.n_forced = 0;
    for (int i = 0; i < N; i++) J->st.n_forced += b->cls[i] == CB_ROW_COMPUTED;
    run_t *R = &J->R;
    cb_blend_run_init(R, N);
    R->blend = o->mode == CB_BLEND_BLEND && n_cand_total > 0;
    R->check_layer = o->check_layer;
    R->ratio = o->ratio;
    R->auto_target = o->auto_target;
    R->auto_floor = o->auto_floor;
    R->auto_cost_keys = o->auto_cost_keys;
    R->auto_ceil = o->auto_ceil;
    R->start_ratio = o->gradual_ratio != 0.0f ? o->gradual_ratio : o->ratio;
    R->grad_end = o->gradual_ratio != 0.0f ? o->gradual_end_layer : o->check_layer;
    R->metric = o->metric;
    R->overlap = !o->no_overlap;
    R->n_cand_total = n_cand_total;
    R->logits = J->logits;
    R->hook = o->attn_hook;
    R->sparse_hook = o->sparse_hook;
    R->hook_ud = o->attn_hook_ud;
    J->cur = R->blend && o->metric == 'a' && cb_blend_probe_setup(b, J) ? &J->P : R;
    J->ph = J->cur == &J->P ? PH_PROBE : PH_MAIN;
    return cb_blend_run_begin(b, J->cur, err, errlen);
}

/* A streamed layer failed its checksum in the pass that just ended: that chunk is a miss; it is computed
 * and stored, and the call starts over. 0, or -1 with err (the same source failed twice). */
static int restart(cb_blend_t *b, job_t *J, char *err, size_t errlen) {
    const src_t *fs = &b->srcs[J->cur->fail_src];
    CB_WARN("blend: chunk %d: KV file miss during the prefill (%s); recomputing", fs->chunk,
            cb_kv_miss_str(J->cur->fail_why));
    if (J->force[fs->chunk] || J->attempt > J->n_chunks) {
        cb_set_err(err, errlen, "blend: internal error (source %d failed twice)", J->cur->fail_src);
        return -1;
    }
    J->force[fs->chunk] = 1;
    b->info[fs->chunk].why = J->cur->fail_why;
    J->st.restarts++;
    cb_blend_release_srcs(b);
    J->attempt++;
    J->c_next = 0;
    J->ctx_ok = false;
    J->cur = NULL;
    J->ph = PH_RESOLVE;
    return 0;
}

/* The main pass ended well: chunks streamed from files join the memory tier; the stats. */
static void finish(cb_blend_t *b, job_t *J, cb_blend_stats_t *stats) {
    cb_blend_stats_t *st = &J->st;
    for (int i = 0; i < b->n_srcs; i++)
        if (b->srcs[i].fill) cb_kvstore_remember(b->store, b->srcs[i].key, b->srcs[i].fill);
    st->n_chunks_read = J->n_need;
    st->chunks = b->info;
    for (int c = 0; c < J->n_need; c++) {
        if (b->info[c].src == CB_KVSTORE_MEM) st->chunks_mem++;
        else if (b->info[c].src == CB_KVSTORE_FILE) st->chunks_file++;
        else st->chunks_computed++;
    }
    st->tokens_recomputed = J->R.n_act;
    st->n_chosen = J->R.n_chosen >= 0 ? J->R.n_chosen : 0;
    st->ratio_chosen = st->n_candidates > 0 ? (float)st->n_chosen / (float)st->n_candidates : 0.0f;
    st->tokens_reused = J->N - J->R.n_act;
    st->selected = b->act;
    if (stats) *stats = *st;
}

int cb_blend_step(cb_blend_t *self, int budget_tokens, cb_blend_stats_t *stats, char *err, size_t errlen) {
    cb_blend_t *b = self;
    if (!cb_blend_busy(b)) {
        cb_set_err(err, errlen, "blend: no call in progress");
        return CB_ENGINE_EINVAL;
    }
    job_t *J = &b->job;
    const double t0 = cb_now_ms();
    const long long limit = budget_tokens > 0 ? (long long)budget_tokens * b->L : LLONG_MAX;
    long long cost = 0;
    int ret = CB_BLEND_MORE;
    J->st.n_slices++;
    while (cost < limit) {
        const double tu = cb_now_ms();
        const phase_t ph = J->ph;
        if (ph == PH_RESOLVE) {
            long long c = J->ctx_ok && J->c_next >= J->n_need ? 0 : resolve_unit(b, J, err, errlen);
            if (c >= 0 && J->ctx_ok && J->c_next >= J->n_need) c = begin_passes(b, J, err, errlen);
            J->st.t_resolve_ms += cb_now_ms() - tu;
            if (c < 0) {
                ret = (int)c;
                break;
            }
            cost += c;
            continue;
        }
        run_t *R = J->cur;
        const int n_act = R->n_act;
        int rc = cb_blend_run_layer(b, R);
        cost += n_act > 0 ? n_act : 1;
        if (ph == PH_PROBE) J->st.t_probe_ms += cb_now_ms() - tu;
        if (rc == 0 && R->l_next < b->L) continue;
        rc = cb_blend_run_end(b, R, rc, err, errlen);
        add_pass_times(&J->st, R);
        if (ph == PH_PROBE && J->moved) /* the rows the move overwrote */
            memcpy(b->tok + (J->N - J->n_suffix), J->suffix, sizeof(int32_t) * (size_t)J->n_probe);
        if (rc < 0) {
            ret = -1;
            break;
        }
        if (rc > 0) {
            if (restart(b, J, err, errlen)) {
                ret = -1;
                break;
            }
            continue;
        }
        if (ph == PH_PROBE) {
            if (cb_blend_probe_finish(b, J, err, errlen) || cb_blend_run_begin(b, &J->R, err, errlen)) {
                ret = -1;
                break;
            }
            J->cur = &J->R;
            J->ph = PH_MAIN;
            continue;
        }
        ret = CB_ENGINE_OK;
        break;
    }
    J->st.t_total_ms += cb_now_ms() - t0;
    if (ret == CB_ENGINE_OK) finish(b, J, stats);
    if (ret != CB_BLEND_MORE) job_end(b, ret == CB_ENGINE_OK);
    return ret;
}

int cb_blend_prefill(cb_blend_t *self, cb_seq_t *seq, const int32_t *prefix, int n_prefix,
                     const cb_blend_chunk_t *chunks, int n_chunks, const int32_t *suffix, int n_suffix,
                     const cb_blend_opts_t *opts, float *logits, cb_blend_stats_t *stats, char *err, size_t errlen) {
    int rc = cb_blend_start(self, seq, prefix, n_prefix, chunks, n_chunks, suffix, n_suffix, opts, logits, err, errlen);
    if (rc != CB_ENGINE_OK) return rc;
    do rc = cb_blend_step(self, 0, stats, err, errlen); /* one slice: the whole call */
    while (rc == CB_BLEND_MORE);
    return rc;
}

