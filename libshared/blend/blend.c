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
 * Owns: every buffer below, the loader thread of a run. Borrows: the store (and its engine), the sequence
 * of a call.
 */
#include "blend/blend.h"
#include "base/alloc.h"

#include <assert.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/err.h"
#include "base/log.h"

/* ---------------------------------------------------------------- types */

enum { SRC_ENTRY = 0, SRC_FILE = 1 };

typedef struct {
    int kind;                  /* SRC_ENTRY: decoded f32; SRC_FILE: streamed from a KV file */
    int row0, n;               /* fused rows [row0, row0 + n) */
    int chunk;                 /* chunk index */
    cb_kvmem_entry_t *entry;   /* SRC_ENTRY: our reference */
    cb_kvfile_t *file;         /* SRC_FILE: open handle (owned) */
    cb_kvmem_entry_t *fill;    /* SRC_FILE with a memory tier or a dtype the backend does not load: entry decoded
                                * layer by layer (owned ref) */
    cb_kv_dtype_t dtype;       /* SRC_FILE: payload dtype */
    const void **raw_k;        /* SRC_FILE without fill: [n_layer] layer's K/V in the mapping (set by the loader) */
    const void **raw_v;
    uint8_t key[32];
    int n_loaded, n_cand;      /* rows of each class in this source (set with the classes) */
} src_t;

typedef struct {
    int n;                     /* rows N */
    bool blend;                /* candidates exist: measuring layers apply */
    int check_layer;
    int grad_end;              /* last measuring layer (= check_layer when gradual is off) */
    float ratio, start_ratio;
    float auto_target, auto_floor, auto_ceil; /* ratio = auto (auto_target > 0) */
    float auto_cost_keys;      /* ratio = auto, metric a: rank by mass per cost (0 = by mass) */
    int n_chosen;              /* candidates kept by the (last) selection; -1 before one */
    char metric;
    bool overlap;
    int n_cand_total;
    float *logits;             /* NULL: skip the LM head (and the last layer's attention/MLP) */
    cb_blend_attn_hook_t hook;
    cb_blend_sparse_hook_t sparse_hook;
    void *hook_ud;
    bool preloaded;            /* every LOADED row's K/V is already in the sequence, at every layer */
    int probe_rows;            /* > 0: a probe pass (metric 'a'); the last probe_rows active rows add their
                                  attention mass over keys into b->mass at every layer */
    int compute_layers;        /* > 0: layers [compute_layers, L) only place their cached rows (a probe that
                                  stops early; needs logits == NULL); 0 = every layer computes */
    /* the pass in progress (run_begin .. run_end) */
    int l_next;                /* the next layer to run */
    int n_act;                 /* active rows (b->act) */
    bool any_src;              /* some LOADED row is still to be placed (the loader has work) */
    /* out */
    double t_load, t_wait, t_compute, t_select;
    int fail_src;              /* source whose layer failed its checksum (-1 none) */
    cb_kv_miss_t fail_why;
} run_t;

typedef enum { PH_IDLE = 0, PH_RESOLVE, PH_PROBE, PH_MAIN } phase_t;

/* A fused prefill in progress (cb_blend_start .. the cb_blend_step that ends it). */
typedef struct {
    phase_t ph;
    cb_seq_t *seq;             /* borrowed for the call */
    const int32_t *prefix, *suffix; /* [n_prefix], [n_suffix] borrowed for the call */
    int n_prefix, n_suffix;
    cb_blend_chunk_t *chunks;  /* [cap_chunks] a copy of the caller's list (the tokens stay borrowed) */
    cb_kvstore_chunk_t *rs;    /* [cap_chunks] the chunks resolved in this attempt */
    uint8_t *force;            /* [cap_chunks] 1: the chunk's file failed mid-stream; compute it */
    int n_chunks, cap_chunks;
    cb_blend_opts_t opts;
    float *logits;             /* [n_vocab] borrowed, or NULL */
    int N, n_need;             /* prompt rows; chunks the mode reads from the store (the first n_need) */
    int attempt, c_next;       /* restarts so far; the next chunk to resolve */
    bool ctx_ok;               /* the store's context is set for this attempt */
    run_t R, P;                /* the main pass; metric a's probe pass */
    run_t *cur;                /* the pass running (&R or &P), NULL before the first */
    int n_probe;               /* probe: the suffix rows it computes */
    bool moved;                /* probe: they were moved up to follow the chunks */
    cb_blend_stats_t st;
} job_t;

struct cb_blend {
    cb_kvstore_t *store;       /* borrowed */
    cb_engine_t *e;            /* the store's */
    cb_seq_t *seq;             /* the sequence of the current call (borrowed) */
    const cb_hparams_t *hp;
    int L, E, QD, KVD, HD, max_ctx, max_rows;

    float *x;                  /* [max_ctx][E] residual stream of the active rows (compact, ascending) */
    float *q;                  /* [max_ctx][QD] post-RoPE queries of the active rows */
    float *kb, *vb;            /* [max_rows][KVD] one ubatch's fresh K (pre-RoPE, then rotated) and V */
    int32_t *tok;              /* [max_ctx] prompt tokens */
    uint8_t *cls;              /* [max_ctx] CB_ROW_* */
    int32_t *src_of;           /* [max_ctx] source index or -1 */
    int32_t *act;              /* [max_ctx] active rows (positions), ascending */
    double *dev;               /* [max_ctx] deviation of active index i (candidates) */
    double *wdev;              /* [max_ctx] the candidates' ranking score (auto_cost_keys) */
    int32_t *order;            /* [max_ctx] scratch for selection */
    int32_t *cand;             /* [max_ctx] scratch for selection */
    uint8_t *keep;             /* [max_ctx] */
    int32_t *ub_lim, *ub_tok;  /* [max_rows] */
    float *mass;               /* [max_ctx] attention mass each row receives in a probe pass (metric 'a') */
    uint8_t *sparse;           /* [max_ctx] 1: the row attends sparsely in the main pass (opts.sparse_keys; all 0
                                  before the probe, so the probe pass is dense) */
    uint8_t *blk_keep;         /* [max_ctx] per KV block: 1 = every sparse row before it attends it */
    int32_t *blk_list;         /* [max_ctx] a sparse call's gathered block indices */
    double *blk_mass;          /* [max_ctx] per KV block: probe mass */
    int bt;                    /* engine positions per KV block */

    src_t *srcs;               /* [cap_srcs] */
    int n_srcs, cap_srcs;
    cb_blend_chunk_info_t *info; /* [cap_info] the last call's chunks (stats.chunks) */
    int cap_info;

    /* loader synchronisation of a run */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ld_ready;              /* layers the loader has finished */
    int ld_stop, ld_failed;
    run_t *ld_run;             /* the pass it loads for */
    pthread_t ld_th;
    bool ld_on;                /* the loader thread is running (joined by run_stop_loader) */

    job_t job;                 /* the call in progress */
};

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

static void release_srcs(cb_blend_t *b) {
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

void cb_blend_destroy(cb_blend_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_blend_t *b = *self_p;
    cb_blend_cancel(b);
    release_srcs(b);
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

/* ---------------------------------------------------------------- the loader */

static bool measuring(const run_t *R, int l) { return R->blend && l >= R->check_layer && l <= R->grad_end; }

/* Does a row of class c need its cached K/V in the sequence at layer l? */
static bool row_needs_cache(const run_t *R, int c, int l) {
    return c == CB_ROW_LOADED || (c == CB_ROW_CANDIDATE && l > R->check_layer);
}

/* Pre-RoPE cached K or V row (which: 0 = K, 1 = V) of fused row r at layer l (valid once the loader has
 * done layer l), in host memory of dtype *dt. */
static const void *cached_row(const cb_blend_t *b, int r, int l, int which, cb_kv_dtype_t *dt) {
    const src_t *s = &b->srcs[b->src_of[r]];
    const size_t i = (size_t)(r - s->row0); /* the row within its chunk */
    const cb_kvmem_entry_t *e = s->kind == SRC_ENTRY ? s->entry : s->fill;
    if (e) {
        *dt = CB_KV_F32;
        return (which ? cb_kvmem_entry_v(e, l) : cb_kvmem_entry_k(e, l)) + i * (size_t)b->KVD;
    }
    const uint8_t *raw = which ? s->raw_v[l] : s->raw_k[l];
    *dt = s->dtype;
    return raw + i * cb_kv_row_bytes(s->dtype, (size_t)b->KVD);
}

/* Places layer l's cached K/V of every row that needs them into the sequence (the backend's layer load: K
 * rotated to the row's position). Streams file layers (checksum verified) first. 0; 1 with R->fail_src/why
 * set when a file layer failed; -1 when the backend failed. */
static int load_layer(cb_blend_t *b, run_t *R, int l) {
    const int KVD = b->KVD;
    for (int si = 0; si < b->n_srcs; si++) {
        src_t *s = &b->srcs[si];
        bool need_rows = s->n_loaded > 0 || (s->n_cand > 0 && l > R->check_layer);
        bool need_pre = s->n_cand > 0 && measuring(R, l);
        const void *kp, *vp;             /* source rows of this layer, in dtype dt */
        cb_kv_dtype_t dt = CB_KV_F32;
        if (s->kind == SRC_ENTRY) {
            if (!need_rows) continue;
            kp = cb_kvmem_entry_k(s->entry, l);
            vp = cb_kvmem_entry_v(s->entry, l);
        } else if (s->fill) {
            /* decode every layer: the entry joins the memory tier after the prefill */
            float *dk = cb_kvmem_entry_k_mut(s->fill, l), *dv = cb_kvmem_entry_v_mut(s->fill, l);
            cb_kv_miss_t w = cb_kvfile_read_layer(s->file, l, dk, dv);
            if (w != CB_KV_OK) {
                R->fail_src = si;
                R->fail_why = w;
                return 1;
            }
            if (!need_rows) continue;
            kp = dk;
            vp = dv;
        } else {
            if (!need_rows && !need_pre) continue;
            cb_kv_miss_t w = cb_kvfile_layer_raw(s->file, l, &kp, &vp); /* checksum verified here */
            if (w != CB_KV_OK) {
                R->fail_src = si;
                R->fail_why = w;
                return 1;
            }
            s->raw_k[l] = kp;
            s->raw_v[l] = vp;
            dt = s->dtype;
            if (!need_rows) continue;
        }
        const size_t rowb = cb_kv_row_bytes(dt, (size_t)KVD); /* bytes of a source row */
        /* contiguous runs of rows that need the cache: one layer load each */
        int i = 0;
        while (i < s->n) {
            if (!row_needs_cache(R, b->cls[s->row0 + i], l)) {
                i++;
                continue;
            }
            int j = i + 1;
            while (j < s->n && row_needs_cache(R, b->cls[s->row0 + j], l)) j++;
            if (cb_engine_kv_load(b->e, b->seq, l, s->row0 + i, j - i, (const uint8_t *)kp + (size_t)i * rowb,
                                  (const uint8_t *)vp + (size_t)i * rowb, dt) != CB_ENGINE_OK)
                return -1;
            i = j;
        }
    }
    return 0;
}

static void *loader_main(void *arg) {
    cb_blend_t *b = arg;
    run_t *R = b->ld_run;
    for (int l = 0; l < b->L; l++) {
        pthread_mutex_lock(&b->mu);
        int stop = b->ld_stop;
        pthread_mutex_unlock(&b->mu);
        if (stop) break;
        double t0 = cb_now_ms();
        int rc = load_layer(b, R, l);
        R->t_load += cb_now_ms() - t0;
        pthread_mutex_lock(&b->mu);
        if (rc) {
            b->ld_failed = rc;
        } else {
            b->ld_ready = l + 1;
        }
        pthread_cond_broadcast(&b->cv);
        pthread_mutex_unlock(&b->mu);
        if (rc) break;
    }
    return NULL;
}

/* ---------------------------------------------------------------- the layer loop */

/* ratio = auto's count for scores s [m] (>= 0; NaN and negative count as 0) whose order best first is
 * order [m]: the fewest leading candidates whose scores sum to at least `target` of the total, clamped to
 * [floor(fl * m), ceil(ce * m)]; target >= 1: m. Deterministic: the order is the backend's top-k (ties to
 * the lower position). A total of 0 (no signal) gives the floor. */
static int auto_count(const double *s, const int32_t *order, int m, float target, float fl, float ce) {
    if (m <= 0) return 0;
    if (target >= 1.0f) return m;
    int lo = (int)floor((double)fl * m + 1e-9), hi = (int)ceil((double)ce * m - 1e-9);
    if (hi > m) hi = m;
    if (lo > hi) lo = hi;
    double total = 0.0;
    for (int i = 0; i < m; i++) total += s[i] > 0.0 ? s[i] : 0.0; /* NaN > 0 is false */
    int k = 0;
    if (total > 0.0) {
        double want = (double)target * total, acc = 0.0;
        while (k < m && acc < want) {
            double v = s[order[k]];
            acc += v > 0.0 ? v : 0.0;
            k++;
        }
    }
    return k < lo ? lo : k > hi ? hi : k;
}

/* ratio = auto over the candidates' scores b->dev [m]: sorts them all into b->order (best first) and
 * returns the count to keep, or -1 when the backend failed. */
static int auto_target_count(cb_blend_t *b, const run_t *R, int m) {
    if (R->auto_target >= 1.0f || m <= 0) return m;
    if (cb_engine_topk(b->e, m, b->dev, m, b->order) != CB_ENGINE_OK) return -1;
    return auto_count(b->dev, b->order, m, R->auto_target, R->auto_floor, R->auto_ceil);
}

/* Keeps the forced rows and the `target` most deviating candidates among the active rows (the backend's
 * top-k: NaN first, ties to the lower position); compacts act, x and q (the backend's row compaction).
 * Returns the new active count, or -1 when the backend failed. */
static int select_rows(cb_blend_t *b, run_t *R, int n_act, int target) {
    int m = 0;
    for (int i = 0; i < n_act; i++)
        if (b->cls[b->act[i]] == CB_ROW_CANDIDATE) b->cand[m++] = i;
    for (int k = 0; k < m; k++) b->dev[k] = b->dev[b->cand[k]]; /* candidates' deviations, ascending rows */
    bool sorted = false;
    if (R->auto_target > 0.0f && (target = auto_target_count(b, R, m)) < 0) return -1;
    sorted = R->auto_target > 0.0f && R->auto_target < 1.0f && m > 0; /* b->order holds all m, best first */
    if (target < 0) target = 0;
    R->n_chosen = target < m ? target : m;
    if (target >= m) return n_act;
    if (!sorted && cb_engine_topk(b->e, m, b->dev, target, b->order) != CB_ENGINE_OK) return -1;
    for (int i = 0; i < n_act; i++) b->keep[i] = b->cls[b->act[i]] != CB_ROW_CANDIDATE;
    for (int j = 0; j < target; j++) b->keep[b->cand[b->order[j]]] = 1;
    int k = 0;
    for (int i = 0; i < n_act; i++)
        if (b->keep[i]) b->cand[k++] = i; /* the kept active indices, ascending */
    for (int j = 0; j < k; j++) b->act[j] = b->act[b->cand[j]];
    cb_engine_compact_rows(b->e, b->x, (size_t)b->E, b->cand, k);
    cb_engine_compact_rows(b->e, b->q, (size_t)b->QD, b->cand, k);
    return k;
}

/* Metric 'a': b->order [m] holds the candidate rows (ascending), b->dev [m] their attention mass. Makes
 * the `target` most attended (ties: lower position first) COMPUTED; the others stay LOADED. 0 or -1. */
static int select_by_mass(cb_blend_t *b, int m, int target, const double *rank) {
    if (target > m) target = m;
    if (cb_engine_topk(b->e, m, rank, target, b->cand) != CB_ENGINE_OK) return -1;
    for (int j = 0; j < target; j++) {
        int r = b->order[b->cand[j]];
        b->cls[r] = CB_ROW_COMPUTED;
        b->srcs[b->src_of[r]].n_loaded--;
    }
    return 0;
}

/* Target count of candidates kept at measuring layer l. */
static int target_at(const run_t *R, int l) {
    double r = R->ratio;
    if (R->grad_end > R->check_layer) {
        double f = (double)(l - R->check_layer) / (double)(R->grad_end - R->check_layer);
        r = R->start_ratio + ((double)R->ratio - R->start_ratio) * f;
    }
    return (int)floor(r * (double)R->n_cand_total + 1e-6);
}

/* Waits for (threaded) or does (serial) the loader's layer l. 0, 1 (a file layer failed), -1 (backend). */
static int await_layer(cb_blend_t *b, run_t *R, int l, bool threaded) {
    double tw = cb_now_ms();
    if (threaded) {
        pthread_mutex_lock(&b->mu);
        while (b->ld_ready < l + 1 && !b->ld_failed) pthread_cond_wait(&b->cv, &b->mu);
        int failed = b->ld_ready < l + 1 ? b->ld_failed : 0;
        pthread_mutex_unlock(&b->mu);
        R->t_wait += cb_now_ms() - tw;
        return failed;
    }
    int rc = load_layer(b, R, l);
    double dt = cb_now_ms() - tw;
    R->t_load += dt;
    R->t_wait += dt;
    return rc;
}

/* QKV of every active row of layer l, the candidates' deviation on a measuring layer (into b->dev), RoPE,
 * and the rows' K/V into the sequence before any attention of the layer. t_sel gets the deviation time.
 * 0, or -1 (backend / pool). */
static int layer_qkv_rows(cb_blend_t *b, const run_t *R, int l, int n_act, bool meas, double *t_sel) {
    const int E = b->E, QD = b->QD, MR = b->max_rows, KVD = b->KVD;
    for (int i0 = 0; i0 < n_act; i0 += MR) {
        int n = n_act - i0 < MR ? n_act - i0 : MR;
        const int32_t *rows = b->act + i0; /* = their positions */
        float *q = b->q + (size_t)i0 * QD;
        cb_engine_layer_qkv(b->e, l, b->x + (size_t)i0 * E, n, q, b->kb, b->vb);
        if (meas) {
            double ts = cb_now_ms();
            const int which = R->metric == 'k' ? 0 : 1;
            const float *fresh = which ? b->vb : b->kb;
            for (int j = 0; j < n; j++) {
                int r = rows[j];
                if (b->cls[r] != CB_ROW_CANDIDATE) continue;
                cb_kv_dtype_t dt;
                const void *cached = cached_row(b, r, l, which, &dt);
                if (cb_engine_kv_deviation(b->e, 1, fresh + (size_t)j * KVD, &cached, dt, &b->dev[i0 + j]))
                    return -1;
            }
            *t_sel += cb_now_ms() - ts;
        }
        cb_engine_rope(b->e, l, q, n, b->hp->n_head, rows);
        cb_engine_rope(b->e, l, b->kb, n, b->hp->n_head_kv, rows);
        if (cb_engine_kv_write(b->e, b->seq, l, rows, n, b->kb, b->vb) != CB_ENGINE_OK) return -1;
    }
    return 0;
}

/* Sparse attention + MLP of active rows [i0, i0 + n), all sparse and of the chunk whose rows start at c0:
 * their keys are the kept blocks before the chunk's first block, then every block from it to the last
 * row's (ascending), each row up to itself. */
static void attn_sparse(cb_blend_t *b, const run_t *R, int l, int i0, int n, int c0) {
    const int bt = b->bt, first = c0 / bt, last = b->act[i0 + n - 1] / bt;
    int nb = 0;
    for (int k = 0; k < first; k++)
        if (b->blk_keep[k]) b->blk_list[nb++] = k;
    const int before = nb;
    for (int k = first; k <= last; k++) b->blk_list[nb++] = k;
    for (int j = 0; j < n; j++) b->ub_lim[j] = (before - first) * bt + b->act[i0 + j] + 1;
    if (R->sparse_hook) R->sparse_hook(R->hook_ud, l, n, b->act + i0, b->ub_lim, b->blk_list, nb, bt);
    cb_engine_layer_attn_mlp_blocks(b->e, b->seq, l, b->x + (size_t)i0 * b->E, b->q + (size_t)i0 * b->QD, n,
                                    b->blk_list, nb, b->ub_lim);
}

/* Which attention call row r joins: -1 dense, else the first row of its chunk (a sparse row). */
static int attn_group(const cb_blend_t *b, int r) { return b->sparse[r] ? b->srcs[b->src_of[r]].row0 : -1; }

/* b->ub_lim [n] of the dense active rows [i0, i0 + n): every earlier key; with attend, the hook is told of
 * their attention call. Their positions. */
static const int32_t *dense_limits(cb_blend_t *b, const run_t *R, int l, int i0, int n, bool attend) {
    const int32_t *pos = b->act + i0;
    for (int j = 0; j < n; j++) b->ub_lim[j] = pos[j] + 1;
    if (attend && R->hook) R->hook(R->hook_ud, l, n, pos, b->ub_lim);
    return pos;
}

/* Attention (exact causal limits) + MLP of active rows [a0, n_act) of layer l: runs of dense rows in
 * ubatches over every earlier key; runs of one chunk's sparse rows over their gathered blocks. On a layer
 * with a sliding window every row is dense: it sees only the keys of its window, which a gathered table
 * (whose key indices are not positions) could not bound. */
static void layer_attn_rows(cb_blend_t *b, const run_t *R, int l, int a0, int n_act) {
    const int MR = b->max_rows;
    const bool windowed = cb_model_layer(cb_engine_model(b->e), l)->window > 0;
    int i0 = a0;
    while (i0 < n_act) {
        const int c0 = windowed ? -1 : attn_group(b, b->act[i0]);
        int n = 1;
        while (n < MR && i0 + n < n_act && (windowed ? -1 : attn_group(b, b->act[i0 + n])) == c0) n++;
        if (c0 >= 0) {
            attn_sparse(b, R, l, i0, n, c0);
        } else {
            dense_limits(b, R, l, i0, n, true);
            cb_engine_layer_attn_mlp(b->e, b->seq, l, b->x + (size_t)i0 * b->E, b->q + (size_t)i0 * b->QD, n,
                                     b->ub_lim);
        }
        i0 += n;
    }
}

/* Begins a pass over the rows b->tok/cls/src_of [R->n] (sources in b->srcs) in b->seq (reserved for
 * [0, R->n)): the active rows (b->act) and their embeddings (b->x), and the loader thread that places the
 * cached rows layer by layer ahead of the compute (it keeps going between the caller's slices). 0, or -1
 * with err. */
static int run_begin(cb_blend_t *b, run_t *R, char *err, size_t errlen) {
    const int E = b->E, MR = b->max_rows;
    int n_act = 0;
    for (int r = 0; r < R->n; r++)
        if (b->cls[r] != CB_ROW_LOADED) b->act[n_act++] = r;
    if (n_act == 0 || b->act[n_act - 1] != R->n - 1) {
        cb_set_err(err, errlen, "blend: the last row must be computed");
        return -1;
    }
    R->n_act = n_act;
    R->l_next = 0;
    R->fail_src = -1;
    R->t_load = R->t_wait = R->t_compute = R->t_select = 0.0;
    double t0 = cb_now_ms();
    for (int i0 = 0; i0 < n_act; i0 += MR) {
        int n = n_act - i0 < MR ? n_act - i0 : MR;
        for (int j = 0; j < n; j++) b->ub_tok[j] = b->tok[b->act[i0 + j]];
        cb_engine_embed(b->e, b->ub_tok, n, b->x + (size_t)i0 * E);
    }
    R->t_compute += cb_now_ms() - t0;
    R->any_src = b->n_srcs > 0 && !R->preloaded;
    b->ld_ready = 0;
    b->ld_stop = 0;
    b->ld_failed = 0;
    b->ld_run = R;
    b->ld_on = R->overlap && R->any_src && pthread_create(&b->ld_th, NULL, loader_main, b) == 0;
    return 0;
}

/* Stops and joins the loader thread, if one runs. */
static void run_stop_loader(cb_blend_t *b) {
    if (!b->ld_on) return;
    pthread_mutex_lock(&b->mu);
    b->ld_stop = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    pthread_join(b->ld_th, NULL);
    b->ld_on = false;
}

/* Layer R->l_next of a begun pass: wait for its cached rows; QKV of the active rows, K/V into the sequence
 * before any attention of the layer; on a measuring layer the selection; the probe's attention mass;
 * attention + MLP (at the last computing layer only the last row, whose residual feeds the logits). 0, 1
 * (a streamed layer failed its checksum: R->fail_*), or -1 (backend). */
static int run_layer(cb_blend_t *b, run_t *R) {
    const int QD = b->QD;
    const int CL = R->compute_layers > 0 ? R->compute_layers : b->L; /* layers that compute */
    assert(CL <= b->L && (CL == b->L || !R->logits));
    const int l = R->l_next++;
    int n_act = R->n_act, rc;
    if (R->any_src && (rc = await_layer(b, R, l, b->ld_on)) != 0) return rc;
    if (l >= CL) return 0;
    double tc = cb_now_ms(), t_sel = 0.0;
    const bool meas = measuring(R, l);
    if (layer_qkv_rows(b, R, l, n_act, meas, &t_sel)) return -1;
    if (meas) {
        double ts = cb_now_ms();
        n_act = select_rows(b, R, n_act, target_at(R, l));
        t_sel += cb_now_ms() - ts;
        if (n_act < 0) return -1;
        R->n_act = n_act;
    }
    int a0 = 0;
    if (l == CL - 1) a0 = R->logits ? n_act - 1 : n_act;
    if (R->probe_rows > 0) {
        /* the probe rows (the last active ones: suffix rows, dense) add their attention mass; where they also
         * attend (every probe layer but the last), one call gives both, from the same probabilities */
        const int np = R->probe_rows < n_act ? R->probe_rows : n_act, p0 = n_act - np;
        const bool attend = a0 <= p0;
        assert(attn_group(b, b->act[p0]) < 0);
        layer_attn_rows(b, R, l, a0, attend ? p0 : n_act);
        dense_limits(b, R, l, p0, np, attend);
        const float *q = b->q + (size_t)p0 * QD;
        rc = attend ? cb_engine_layer_attn_mass_mlp(b->e, b->seq, l, b->x + (size_t)p0 * b->E, q, np, b->ub_lim, b->mass)
                    : cb_engine_attn_mass(b->e, b->seq, l, q, np, b->ub_lim, b->mass);
        if (rc != CB_ENGINE_OK) return -1;
    } else {
        layer_attn_rows(b, R, l, a0, n_act);
    }
    R->t_select += t_sel;
    R->t_compute += cb_now_ms() - tc - t_sel;
    return 0;
}

/* Ends a pass whose layers returned rc: the loader joined; on success the last row's logits. Returns rc
 * (-1 with err). */
static int run_end(cb_blend_t *b, run_t *R, int rc, char *err, size_t errlen) {
    run_stop_loader(b);
    if (rc < 0) cb_set_err(err, errlen, "blend: the backend failed");
    if (rc) return rc;
    if (R->logits) {
        double tl = cb_now_ms();
        cb_engine_logits(b->e, b->x + (size_t)(R->n_act - 1) * b->E, R->logits);
        R->t_compute += cb_now_ms() - tl;
    }
    return 0;
}

/* Metric 'a' (query-aware selection): every candidate and every cached forced row is LOADED for a probe
 * pass in which the last suffix rows measure the attention mass each key receives (summed over heads,
 * rows and layers); the `target` most attended candidates then become COMPUTED (recomputed at every
 * layer) and the others LOADED at every layer: no check layer, so R->blend is cleared. The probe leaves
 * every cached row's K/V in the sequence, so the main pass loads nothing (R->preloaded). No probe when
 * the target is 0 or every candidate. This sets the probe up (J->P); 1 when it is to run, 0 when not. */
static int probe_setup(cb_blend_t *b, job_t *J) {
    run_t *R = &J->R;
    const int N = J->N;
    const int target = R->auto_target > 0.0f ? (R->auto_target >= 1.0f ? R->n_cand_total : 1) /* decided after the probe */
                                              : target_at(R, R->check_layer);
    R->blend = false;
    if (target <= 0 || target >= R->n_cand_total) {
        R->n_chosen = target > 0 ? R->n_cand_total : 0;
        for (int i = 0; i < N; i++)
            if (b->cls[i] == CB_ROW_CANDIDATE) {
                src_t *s = &b->srcs[b->src_of[i]];
                s->n_cand--;
                if (target > 0) b->cls[i] = CB_ROW_COMPUTED;
                else b->cls[i] = CB_ROW_LOADED, s->n_loaded++;
            }
        return 0;
    }
    /* keep: 1 = candidate, 2 = forced row with cached KV (both LOADED during the probe), 0 = unchanged */
    for (int i = 0; i < N; i++) {
        b->keep[i] = b->cls[i] == CB_ROW_CANDIDATE ? 1 : b->cls[i] == CB_ROW_COMPUTED && b->src_of[i] >= 0 ? 2 : 0;
        if (b->keep[i]) b->cls[i] = CB_ROW_LOADED, b->srcs[b->src_of[i]].n_loaded++;
    }
    for (int i = 0; i < b->n_srcs; i++) b->srcs[i].n_cand = 0;
    /* a short probe runs only the last probe_suffix suffix rows, moved to the rows right after the chunks
     * (their positions shift down by the rows left out; the main pass recomputes the whole suffix) */
    const int s0 = N - J->n_suffix, ps = J->opts.probe_suffix;
    J->n_probe = ps > 0 && ps < J->n_suffix ? ps : J->n_suffix;
    J->moved = J->n_probe < J->n_suffix;
    run_t *P = &J->P;
    *P = *R;
    P->n = s0 + J->n_probe;
    P->logits = NULL;
    P->probe_rows = J->n_probe < CB_BLEND_PROBE_ROWS ? J->n_probe : CB_BLEND_PROBE_ROWS;
    if (J->opts.probe_layers > 0) P->compute_layers = J->opts.probe_layers;
    if (J->moved) memmove(b->tok + s0, b->tok + N - J->n_probe, sizeof(int32_t) * (size_t)J->n_probe);
    memset(b->mass, 0, sizeof(float) * (size_t)N);
    return 1;
}

/* opts.sparse_keys after the selection: the chosen candidates (b->order maps candidate -> row, and
 * b->cand [n_chosen] the chosen ones' indices) attend sparsely; the KV blocks wholly inside the chunks are
 * ranked by their rows' probe mass and the top share kept (the prefix's blocks always). 0, or -1 (backend). */
static int sparse_setup(cb_blend_t *b, job_t *J) {
    const int bt = b->bt, s0 = J->N - J->n_suffix;
    const int p_end = (J->n_prefix + bt - 1) / bt, c_end = s0 / bt; /* chunk blocks [p_end, c_end) */
    for (int j = 0; j < J->R.n_chosen; j++) b->sparse[b->order[b->cand[j]]] = 1;
    memset(b->blk_keep, 0, (size_t)(c_end > p_end ? c_end : p_end));
    memset(b->blk_keep, 1, (size_t)p_end);
    const int nc = c_end - p_end;
    if (nc <= 0) return 0;
    for (int k = 0; k < nc; k++) {
        double sm = 0.0;
        for (int r = (p_end + k) * bt; r < (p_end + k + 1) * bt; r++) sm += b->mass[r];
        b->blk_mass[k] = sm;
    }
    int keep = (int)ceil((double)J->opts.sparse_keys * nc - 1e-9);
    if (keep > nc) keep = nc;
    if (keep <= 0) return 0;
    if (cb_engine_topk(b->e, nc, b->blk_mass, keep, b->blk_list) != CB_ENGINE_OK) return -1;
    for (int k = 0; k < keep; k++) b->blk_keep[p_end + b->blk_list[k]] = 1;
    return 0;
}

/* After a successful probe pass: the most attended candidates COMPUTED, the rest LOADED; the main pass
 * only overwrites its computed rows (the probe placed every cached row of every layer and verified the
 * files). 0, or -1 with err. */
static int probe_finish(cb_blend_t *b, job_t *J, char *err, size_t errlen) {
    run_t *R = &J->R;
    const int N = J->N;
    int m = 0;
    for (int i = 0; i < N; i++) {
        if (b->keep[i] == 1) b->order[m++] = i;
        if (b->keep[i] == 2) b->cls[i] = CB_ROW_COMPUTED, b->srcs[b->src_of[i]].n_loaded--;
    }
    for (int i = 0; i < m; i++) b->dev[i] = b->mass[b->order[i]];
    const double *rank = b->dev;
    const double p0 = R->auto_cost_keys;
    if (R->auto_target > 0.0f && p0 > 0.0) { /* mass per unit cost: later rows attend over more keys */
        for (int i = 0; i < m; i++) b->wdev[i] = b->dev[i] / (1.0 + (double)b->order[i] / p0);
        rank = b->wdev;
    }
    int target = target_at(R, R->check_layer);
    if (R->auto_target > 0.0f) {
        /* auto: the count from the sorted masses; b->order still maps candidate index -> row, so sort into cand */
        if (R->auto_target >= 1.0f) target = m;
        else if (cb_engine_topk(b->e, m, rank, m, b->cand) != CB_ENGINE_OK) target = -1;
        else target = auto_count(b->dev, b->cand, m, R->auto_target, R->auto_floor, R->auto_ceil);
    }
    R->n_chosen = target < m ? target : m;
    if (target < 0 || select_by_mass(b, m, target, rank)) {
        cb_set_err(err, errlen, "blend: the backend failed (top-k)");
        return -1;
    }
    R->preloaded = true;
    if (J->opts.sparse_keys > 0.0f && sparse_setup(b, J) != 0) {
        cb_set_err(err, errlen, "blend: the backend failed (top-k)");
        return -1;
    }
    return 0;
}

static void run_init(run_t *R, int n) {
    memset(R, 0, sizeof *R);
    R->n = n;
    R->check_layer = 0;
    R->grad_end = -1;
    R->metric = 'v';
    R->overlap = true;
    R->fail_src = -1;
    R->n_chosen = -1;
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

/* The chunk sources (b->srcs, taking over the resolved chunks' entries and files) and every row's token,
 * class and source. The prefix rows are LOADED without a source in every mode but full: the sequence
 * shares them. Returns the number of candidate rows, or -1 (out of memory). */
static int build_rows(cb_blend_t *b, cb_blend_mode_t mode, const int32_t *prefix, int n_prefix,
                      const cb_blend_chunk_t *chunks, int n_chunks, int n_need, cb_kvstore_chunk_t *rs,
                      const int32_t *suffix, int n_suffix, int lead_tokens) {
    release_srcs(b);
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
static int prepare_seq(cb_blend_t *b, cb_seq_t *seq, cb_blend_mode_t mode, int n_prefix, int N, char *err,
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
    run_stop_loader(b);
    if (!ok) cb_seq_clear(J->seq);
    for (int c = 0; c < J->n_chunks; c++) cb_kvstore_chunk_release(&J->rs[c]);
    release_srcs(b);
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
    int n_cand_total = build_rows(b, o->mode, J->prefix, J->n_prefix, J->chunks, J->n_chunks, J->n_need, J->rs,
                                  J->suffix, J->n_suffix, o->lead_tokens);
    if (n_cand_total < 0) {
        cb_set_err(err, errlen, "blend: out of memory");
        return -1;
    }
    int prc = prepare_seq(b, J->seq, o->mode, J->n_prefix, N, err, errlen);
    if (prc) return prc == CB_ENGINE_EPOOL ? CB_ENGINE_EPOOL : -1;
    J->st.n_candidates = n_cand_total;
    J->st.n_forced = 0;
    for (int i = 0; i < N; i++) J->st.n_forced += b->cls[i] == CB_ROW_COMPUTED;
    run_t *R = &J->R;
    run_init(R, N);
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
    J->cur = R->blend && o->metric == 'a' && probe_setup(b, J) ? &J->P : R;
    J->ph = J->cur == &J->P ? PH_PROBE : PH_MAIN;
    return run_begin(b, J->cur, err, errlen);
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
    release_srcs(b);
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
        int rc = run_layer(b, R);
        cost += n_act > 0 ? n_act : 1;
        if (ph == PH_PROBE) J->st.t_probe_ms += cb_now_ms() - tu;
        if (rc == 0 && R->l_next < b->L) continue;
        rc = run_end(b, R, rc, err, errlen);
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
            if (probe_finish(b, J, err, errlen) || run_begin(b, &J->R, err, errlen)) {
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
