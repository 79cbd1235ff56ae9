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

#include <assert.h>
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
    cb_kvmem_entry_t *fill;    /* SRC_FILE with a memory tier: entry decoded layer by layer (owned ref) */
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
    char metric;
    bool overlap;
    int n_cand_total;
    float *logits;             /* NULL: skip the LM head (and the last layer's attention/MLP) */
    cb_blend_attn_hook_t hook;
    void *hook_ud;
    bool preloaded;            /* every LOADED row's K/V is already in the sequence, at every layer */
    int probe_rows;            /* > 0: a probe pass (metric 'a'); the last probe_rows active rows add their
                                  attention mass over keys into b->mass at every layer */
    int compute_layers;        /* > 0: layers [compute_layers, L) only place their cached rows (a probe that
                                  stops early; needs logits == NULL); 0 = every layer computes */
    /* out */
    double t_load, t_wait, t_compute, t_select;
    int fail_src;              /* source whose layer failed its checksum (-1 none) */
    cb_kv_miss_t fail_why;
} run_t;

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
    int32_t *order;            /* [max_ctx] scratch for selection */
    int32_t *cand;             /* [max_ctx] scratch for selection */
    uint8_t *keep;             /* [max_ctx] */
    int32_t *ub_lim, *ub_tok;  /* [max_rows] */
    float *mass;               /* [max_ctx] attention mass each row receives in a probe pass (metric 'a') */

    src_t *srcs;               /* [cap_srcs] */
    int n_srcs, cap_srcs;
    cb_blend_chunk_info_t *info; /* [cap_info] the last call's chunks (stats.chunks) */
    int cap_info;

    /* loader synchronisation of a run */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ld_ready;              /* layers the loader has finished */
    int ld_stop, ld_failed;
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
    if (o->lead_tokens < 0) {
        cb_set_err(err, errlen, "blend: lead tokens %d < 0", o->lead_tokens);
        return -1;
    }
    if (o->probe_layers < 0 || o->probe_layers > b->L) {
        cb_set_err(err, errlen, "blend: probe layers %d outside [0, %d] (0 = all)", o->probe_layers, b->L);
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
    cb_blend_t *b = calloc(1, sizeof *b);
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
    b->tok = malloc(sizeof(int32_t) * C);
    b->cls = malloc(C);
    b->src_of = malloc(sizeof(int32_t) * C);
    b->act = malloc(sizeof(int32_t) * C);
    b->dev = malloc(sizeof(double) * C);
    b->order = malloc(sizeof(int32_t) * C);
    b->cand = malloc(sizeof(int32_t) * C);
    b->keep = malloc(C);
    b->ub_lim = malloc(sizeof(int32_t) * R);
    b->ub_tok = malloc(sizeof(int32_t) * R);
    b->mass = malloc(sizeof(float) * C);
    if (!b->x || !b->q || !b->kb || !b->vb || !b->tok || !b->cls || !b->src_of || !b->act || !b->dev || !b->order ||
        !b->cand || !b->keep || !b->ub_lim || !b->ub_tok || !b->mass) {
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
    release_srcs(b);
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
        src_t *p = realloc(b->srcs, sizeof(src_t) * (size_t)cap);
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
    size_t off = (size_t)(r - s->row0) * b->KVD;
    const cb_kvmem_entry_t *e = s->kind == SRC_ENTRY ? s->entry : s->fill;
    if (e) {
        *dt = CB_KV_F32;
        return (which ? cb_kvmem_entry_v(e, l) : cb_kvmem_entry_k(e, l)) + off;
    }
    const uint8_t *raw = which ? s->raw_v[l] : s->raw_k[l];
    *dt = s->dtype;
    return raw + off * cb_kv_dtype_size(s->dtype);
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
        const size_t esz = cb_kv_dtype_size(dt);
        /* contiguous runs of rows that need the cache: one layer load each */
        int i = 0;
        while (i < s->n) {
            if (!row_needs_cache(R, b->cls[s->row0 + i], l)) {
                i++;
                continue;
            }
            int j = i + 1;
            while (j < s->n && row_needs_cache(R, b->cls[s->row0 + j], l)) j++;
            if (cb_engine_kv_load(b->e, b->seq, l, s->row0 + i, j - i, (const uint8_t *)kp + (size_t)i * KVD * esz,
                                  (const uint8_t *)vp + (size_t)i * KVD * esz, dt) != CB_ENGINE_OK)
                return -1;
            i = j;
        }
    }
    return 0;
}

typedef struct {
    cb_blend_t *b;
    run_t *R;
} loader_arg_t;

static void *loader_main(void *arg) {
    loader_arg_t *a = arg;
    cb_blend_t *b = a->b;
    run_t *R = a->R;
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

/* Keeps the forced rows and the `target` most deviating candidates among the active rows (the backend's
 * top-k: NaN first, ties to the lower position); compacts act, x and q (the backend's row compaction).
 * Returns the new active count, or -1 when the backend failed. */
static int select_rows(cb_blend_t *b, int n_act, int target) {
    int m = 0;
    for (int i = 0; i < n_act; i++)
        if (b->cls[b->act[i]] == CB_ROW_CANDIDATE) b->cand[m++] = i;
    if (target >= m) return n_act;
    if (target < 0) target = 0;
    for (int k = 0; k < m; k++) b->dev[k] = b->dev[b->cand[k]]; /* candidates' deviations, ascending rows */
    if (cb_engine_topk(b->e, m, b->dev, target, b->order) != CB_ENGINE_OK) return -1;
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
static int select_by_mass(cb_blend_t *b, int m, int target) {
    if (target > m) target = m;
    if (cb_engine_topk(b->e, m, b->dev, target, b->cand) != CB_ENGINE_OK) return -1;
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
        cb_engine_rope(b->e, q, n, b->hp->n_head, rows);
        cb_engine_rope(b->e, b->kb, n, b->hp->n_head_kv, rows);
        if (cb_engine_kv_write(b->e, b->seq, l, rows, n, b->kb, b->vb) != CB_ENGINE_OK) return -1;
    }
    return 0;
}

/* Attention (exact causal limits) + MLP of active rows [a0, n_act) of layer l. */
static void layer_attn_rows(cb_blend_t *b, const run_t *R, int l, int a0, int n_act) {
    const int MR = b->max_rows;
    for (int i0 = a0; i0 < n_act; i0 += MR) {
        int n = n_act - i0 < MR ? n_act - i0 : MR;
        const int32_t *pos = b->act + i0;
        for (int j = 0; j < n; j++) b->ub_lim[j] = pos[j] + 1;
        if (R->hook) R->hook(R->hook_ud, l, n, pos, b->ub_lim);
        cb_engine_layer_attn_mlp(b->e, b->seq, l, b->x + (size_t)i0 * b->E, b->q + (size_t)i0 * b->QD, n, b->ub_lim);
    }
}

/* Runs the rows b->tok/cls/src_of [R->n] (sources in b->srcs) in b->seq (reserved for [0, R->n)). Returns
 * 0, 1 when a streamed layer failed its checksum (R->fail_src), or -1 on an error (err). On return
 * *n_act_out = active rows at the last layer (b->act). */
static int run_layers(cb_blend_t *b, run_t *R, int *n_act_out, char *err, size_t errlen) {
    const int L = b->L, E = b->E, QD = b->QD, MR = b->max_rows;
    const int CL = R->compute_layers > 0 ? R->compute_layers : L; /* layers that compute */
    assert(CL <= L && (CL == L || !R->logits));
    int n_act = 0;
    for (int r = 0; r < R->n; r++)
        if (b->cls[r] != CB_ROW_LOADED) b->act[n_act++] = r;
    if (n_act == 0 || b->act[n_act - 1] != R->n - 1) {
        cb_set_err(err, errlen, "blend: the last row must be computed");
        return -1;
    }
    R->fail_src = -1;
    R->t_load = R->t_wait = R->t_compute = R->t_select = 0.0;
    double t0 = cb_now_ms();
    for (int i0 = 0; i0 < n_act; i0 += MR) {
        int n = n_act - i0 < MR ? n_act - i0 : MR;
        for (int j = 0; j < n; j++) b->ub_tok[j] = b->tok[b->act[i0 + j]];
        cb_engine_embed(b->e, b->ub_tok, n, b->x + (size_t)i0 * E);
    }
    R->t_compute += cb_now_ms() - t0;

    bool any_src = b->n_srcs > 0 && !R->preloaded;
    bool threaded = R->overlap && any_src;
    pthread_t th;
    loader_arg_t la = {b, R};
    b->ld_ready = 0;
    b->ld_stop = 0;
    b->ld_failed = 0;
    if (threaded && pthread_create(&th, NULL, loader_main, &la) != 0) threaded = false;

    int rc = 0;
    for (int l = 0; l < L; l++) {
        /* 1. cached K/V of layer l in place */
        if (any_src && (rc = await_layer(b, R, l, threaded)) != 0) break;
        if (l >= CL) continue;
        double tc = cb_now_ms(), t_sel = 0.0;
        const bool meas = measuring(R, l);
        /* 2. QKV of every active row; K/V into the sequence before any attention of the layer */
        if (layer_qkv_rows(b, R, l, n_act, meas, &t_sel)) {
            rc = -1;
            break;
        }
        /* 3. selection */
        if (meas) {
            double ts = cb_now_ms();
            n_act = select_rows(b, n_act, target_at(R, l));
            t_sel += cb_now_ms() - ts;
            if (n_act < 0) {
                rc = -1;
                break;
            }
        }
        /* 4. the probe's attention mass; attention + MLP of the active rows; at the last layer only the last
         * row matters (its residual feeds the logits) */
        if (R->probe_rows > 0) {
            int np = R->probe_rows < n_act ? R->probe_rows : n_act;
            for (int j = 0; j < np; j++) b->ub_lim[j] = b->act[n_act - np + j] + 1;
            if (cb_engine_attn_mass(b->e, b->seq, l, b->q + (size_t)(n_act - np) * QD, np, b->ub_lim, b->mass)) {
                rc = -1;
                break;
            }
        }
        int a0 = 0;
        if (l == CL - 1) a0 = R->logits ? n_act - 1 : n_act;
        layer_attn_rows(b, R, l, a0, n_act);
        R->t_select += t_sel;
        R->t_compute += cb_now_ms() - tc - t_sel;
    }
    if (threaded) {
        pthread_mutex_lock(&b->mu);
        b->ld_stop = 1;
        pthread_cond_broadcast(&b->cv);
        pthread_mutex_unlock(&b->mu);
        pthread_join(th, NULL);
    }
    if (rc < 0) cb_set_err(err, errlen, "blend: the backend failed");
    if (rc) return rc;
    if (R->logits) {
        double tl = cb_now_ms();
        cb_engine_logits(b->e, b->x + (size_t)(n_act - 1) * E, R->logits);
        R->t_compute += cb_now_ms() - tl;
    }
    *n_act_out = n_act;
    return 0;
}

/* Metric 'a' (query-aware selection): every candidate and every cached forced row is LOADED for a probe
 * pass in which the last suffix rows measure the attention mass each key receives (summed over heads,
 * rows and layers); the `target` most attended candidates then become COMPUTED (recomputed at every
 * layer) and the others LOADED at every layer: no check layer, so R->blend is cleared. The probe leaves
 * every cached row's K/V in the sequence, so the main pass loads nothing (R->preloaded). No probe when
 * the target is 0 or every candidate. Returns run_layers' code (1: a streamed layer failed; R->fail_*
 * set). */
static int choose_by_attention(cb_blend_t *b, run_t *R, int N, const int32_t *suffix, int n_suffix,
                               const cb_blend_opts_t *opts, cb_blend_stats_t *st,
                               char *err, size_t errlen) {
    const int target = target_at(R, R->check_layer);
    R->blend = false;
    if (target <= 0 || target >= R->n_cand_total) {
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
    const int s0 = N - n_suffix;
    const int n_probe = opts->probe_suffix > 0 && opts->probe_suffix < n_suffix ? opts->probe_suffix : n_suffix;
    const bool moved = n_probe < n_suffix;
    run_t P = *R;
    P.n = s0 + n_probe;
    P.logits = NULL;
    P.probe_rows = n_probe < CB_BLEND_PROBE_ROWS ? n_probe : CB_BLEND_PROBE_ROWS;
    if (opts->probe_layers > 0) P.compute_layers = opts->probe_layers;
    if (moved) memmove(b->tok + s0, b->tok + N - n_probe, sizeof(int32_t) * (size_t)n_probe);
    memset(b->mass, 0, sizeof(float) * (size_t)N);
    double tp = cb_now_ms();
    int n_act = 0, rc = run_layers(b, &P, &n_act, err, errlen);
    if (moved) memcpy(b->tok + s0, suffix, sizeof(int32_t) * (size_t)n_probe); /* the rows the move overwrote */
    st->t_probe_ms += cb_now_ms() - tp;
    st->t_load_ms += P.t_load;
    st->t_load_wait_ms += P.t_wait;
    st->t_compute_ms += P.t_compute;
    if (rc) {
        R->fail_src = P.fail_src;
        R->fail_why = P.fail_why;
        return rc;
    }
    int m = 0;
    for (int i = 0; i < N; i++) {
        if (b->keep[i] == 1) b->order[m++] = i;
        if (b->keep[i] == 2) b->cls[i] = CB_ROW_COMPUTED, b->srcs[b->src_of[i]].n_loaded--;
    }
    for (int i = 0; i < m; i++) b->dev[i] = b->mass[b->order[i]];
    if (select_by_mass(b, m, target)) {
        cb_set_err(err, errlen, "blend: the backend failed (top-k)");
        return -1;
    }
    /* the probe placed every cached row of every layer in the sequence and verified the files: the main
     * pass only overwrites its computed rows */
    R->preloaded = true;
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
                s->raw_k = calloc((size_t)b->L, sizeof(void *));
                s->raw_v = calloc((size_t)b->L, sizeof(void *));
                if (!s->raw_k || !s->raw_v) return -1;
                if (cb_kvstore_mem(b->store)) {
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

int cb_blend_prefill(cb_blend_t *self, cb_seq_t *seq, const int32_t *prefix, int n_prefix,
                     const cb_blend_chunk_t *chunks, int n_chunks, const int32_t *suffix, int n_suffix,
                     const cb_blend_opts_t *opts, float *logits, cb_blend_stats_t *stats, char *err, size_t errlen) {
    double t_start = cb_now_ms();
    cb_blend_t *b = self;
    if (!b || !seq) return CB_ENGINE_EINVAL;
    cb_blend_opts_t def;
    if (!opts) {
        cb_blend_opts_default(&def);
        opts = &def;
    }
    const long long NN = check_request(b, prefix, n_prefix, chunks, n_chunks, suffix, n_suffix, opts, err, errlen);
    if (NN < 0) return CB_ENGINE_EINVAL;
    const int N = (int)NN;
    const cb_blend_mode_t mode = opts->mode;
    /* which chunks need their KV */
    int n_need = mode == CB_BLEND_FULL ? 0 : mode == CB_BLEND_PREFIX ? (n_chunks > 0 ? 1 : 0) : n_chunks;
    cb_kvstore_chunk_t *rs = calloc((size_t)(n_chunks > 0 ? n_chunks : 1), sizeof *rs);
    uint8_t *force = calloc((size_t)(n_chunks > 0 ? n_chunks : 1), 1);
    if (n_chunks > b->cap_info) {
        cb_blend_chunk_info_t *p = realloc(b->info, sizeof *p * (size_t)n_chunks);
        if (p) b->info = p, b->cap_info = n_chunks;
    }
    if (!rs || !force || n_chunks > b->cap_info) {
        free(rs);
        free(force);
        cb_set_err(err, errlen, "blend: out of memory");
        return -1;
    }
    if (n_chunks > 0) memset(b->info, 0, sizeof *b->info * (size_t)n_chunks);
    cb_blend_stats_t st;
    memset(&st, 0, sizeof st);
    st.n_tokens = N;
    int ret = -1, n_act = 0;
    b->seq = seq;
    run_t R;
    for (int attempt = 0;; attempt++) {
        double tr = cb_now_ms();
        /* 1. the context's KV (exact) and the chunk sources */
        if (mode != CB_BLEND_FULL) {
            int rc = cb_kvstore_set_context(b->store, prefix, n_prefix, err, errlen);
            if (rc) {
                ret = rc == CB_ENGINE_EPOOL ? CB_ENGINE_EPOOL : -1;
                goto out;
            }
        }
        for (int c = 0; c < n_need; c++) {
            cb_kvstore_chunk_release(&rs[c]);
            int rrc = cb_kvstore_resolve(b->store, chunks[c].tokens, chunks[c].n, force[c], &rs[c], err, errlen);
            if (rrc) {
                ret = rrc == CB_ENGINE_EPOOL ? CB_ENGINE_EPOOL : -1;
                goto out;
            }
            cb_blend_chunk_info_t *in = &b->info[c];
            memcpy(in->key, rs[c].key, 32);
            if (rs[c].src == CB_KVSTORE_COMPUTED && in->src != CB_KVSTORE_COMPUTED) { /* first computed now */
                in->src = CB_KVSTORE_COMPUTED;
                if (!force[c]) in->why = rs[c].why; /* a forced one keeps the failure that forced it */
            } else if (in->src != CB_KVSTORE_COMPUTED) {
                in->src = rs[c].src;
            }
        }
        st.t_resolve_ms += cb_now_ms() - tr;
        /* 2. rows, classes, sources; the sequence's blocks */
        int n_cand_total = build_rows(b, mode, prefix, n_prefix, chunks, n_chunks, n_need, rs, suffix, n_suffix,
                                      opts->lead_tokens);
        if (n_cand_total < 0) {
            cb_set_err(err, errlen, "blend: out of memory");
            goto out;
        }
        int prc = prepare_seq(b, seq, mode, n_prefix, N, err, errlen);
        if (prc) {
            ret = prc == CB_ENGINE_EPOOL ? CB_ENGINE_EPOOL : -1;
            goto out;
        }
        st.n_candidates = n_cand_total;
        st.n_forced = 0;
        for (int i = 0; i < N; i++) st.n_forced += b->cls[i] == CB_ROW_COMPUTED;
        /* 3. run */
        run_init(&R, N);
        R.blend = mode == CB_BLEND_BLEND && n_cand_total > 0;
        R.check_layer = opts->check_layer;
        R.ratio = opts->ratio;
        R.start_ratio = opts->gradual_ratio != 0.0f ? opts->gradual_ratio : opts->ratio;
        R.grad_end = opts->gradual_ratio != 0.0f ? opts->gradual_end_layer : opts->check_layer;
        R.metric = opts->metric;
        R.overlap = !opts->no_overlap;
        R.n_cand_total = n_cand_total;
        R.logits = logits;
        R.hook = opts->attn_hook;
        R.hook_ud = opts->attn_hook_ud;
        int rc = 0;
        if (R.blend && opts->metric == 'a')
            rc = choose_by_attention(b, &R, N, suffix, n_suffix, opts, &st, err, errlen);
        if (rc == 0) rc = run_layers(b, &R, &n_act, err, errlen);
        st.t_load_ms += R.t_load;
        st.t_load_wait_ms += R.t_wait;
        st.t_compute_ms += R.t_compute;
        st.t_select_ms += R.t_select;
        if (rc < 0) goto out;
        if (rc > 0) {
            /* a streamed layer failed its checksum: that chunk is a miss; recompute, store, start over */
            const src_t *fs = &b->srcs[R.fail_src];
            CB_WARN("blend: chunk %d: KV file miss during the prefill (%s); recomputing", fs->chunk,
                    cb_kv_miss_str(R.fail_why));
            if (force[fs->chunk] || attempt > n_chunks) {
                cb_set_err(err, errlen, "blend: internal error (source %d failed twice)", R.fail_src);
                goto out;
            }
            force[fs->chunk] = 1;
            b->info[fs->chunk].why = R.fail_why;
            st.restarts++;
            release_srcs(b);
            continue;
        }
        /* chunks streamed from files join the memory tier */
        for (int i = 0; i < b->n_srcs; i++)
            if (b->srcs[i].fill) cb_kvstore_remember(b->store, b->srcs[i].key, b->srcs[i].fill);
        ret = CB_ENGINE_OK;
        break;
    }
    st.n_chunks_read = n_need;
    st.chunks = b->info;
    for (int c = 0; c < n_need; c++) {
        if (b->info[c].src == CB_KVSTORE_MEM) st.chunks_mem++;
        else if (b->info[c].src == CB_KVSTORE_FILE) st.chunks_file++;
        else st.chunks_computed++;
    }
    st.tokens_recomputed = n_act;
    st.tokens_reused = N - n_act;
    st.selected = b->act;
    st.t_total_ms = cb_now_ms() - t_start;
    if (stats) *stats = st;
out:
    if (ret != CB_ENGINE_OK) cb_seq_clear(seq);
    for (int c = 0; c < n_chunks; c++) cb_kvstore_chunk_release(&rs[c]);
    release_srcs(b);
    b->seq = NULL;
    free(rs);
    free(force);
    return ret;
}
