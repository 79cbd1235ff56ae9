/* blend.c: CacheBlend fused prefill over the engine's layer-stage primitives (see blend.h).
 *
 * One code path: every prefill (the four modes, the prefix KV, chunk precompute) is a run over the rows of a
 * prompt, each row LOADED, COMPUTED or CANDIDATE, with an optional capture of the pre-RoPE K/V of a row
 * range. A run:
 *   1. active set A = rows not LOADED (ascending positions); x[A] = embeddings;
 *   2. per layer l: wait until the loader has placed layer l's cached K/V (LOADED rows at every layer,
 *      CANDIDATE rows at layers > check_layer) in the engine's cache rows; QKV of A (ubatches), deviation
 *      of the candidates on measuring layers (fresh pre-RoPE K or V vs the cached ones), RoPE, K/V of A
 *      into the cache rows; on measuring layers narrow A (and x, q) to the forced rows + the most deviating
 *      candidates; attention (key limit pos + 1) + MLP for A; at the last layer only the last row (its
 *      residual feeds the logits; the K/V of every active row are already in the cache);
 *   3. logits of the last row.
 * The loader (a thread, or inline with no_overlap) runs ahead of the compute layer by layer: it converts
 * the cached K/V of a layer straight from the source (an f32 entry, or the KV file's mapping, f16/bf16
 * converted with F16C where available) into the engine's cache rows and rotates K there, one pass, no
 * staging copy; the compute of layer l waits only for the loader's layer l. Deviation rows of streamed
 * files are converted on demand from the mapping (pointers published by the loader with the layer).
 *
 * Owns: every buffer below, the cached prefix KV, the loader thread of a run. Borrows: engine, memory tier.
 */
#include "blend/blend.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "cpu/cpu_ops.h"
#include "base/log.h"
#include "format/quant.h"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* ---------------------------------------------------------------- types */

enum { SRC_ENTRY = 0, SRC_FILE = 1 };

typedef struct {
    int kind;                  /* SRC_ENTRY: decoded f32; SRC_FILE: streamed from a KV file */
    int row0, n;               /* fused rows [row0, row0 + n) */
    int chunk;                 /* chunk index, -1 for the prefix */
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
    cb_kvmem_entry_t *capture; /* capture pre-RoPE K/V of rows [cap_row0, cap_row0 + tokens) (or NULL) */
    int cap_row0;
    float *logits;             /* NULL: skip the LM head (and the last layer's attention/MLP) */
    cb_blend_attn_hook_t hook;
    void *hook_ud;
    bool preloaded;            /* every LOADED row's K/V is already in the cache rows of every layer */
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
    cb_engine_t *e;
    const cb_model_t *model;
    const cb_hparams_t *hp;
    cb_kvmem_t *mem;           /* borrowed, may be NULL */
    char *kv_dir;              /* owned copy, may be NULL */
    cb_kv_dtype_t dtype;
    uint8_t model_fp[32];
    int L, E, QD, KVD, HD, max_ctx, max_rows;

    float *rope_cs;            /* [max_ctx][HD] RoPE (cos, sin) pairs of every position */
    float *cs_rows;            /* [max_rows][HD] coefficients of one ubatch's rows */
    float *x;                  /* [max_ctx][E] residual stream of the active rows (compact, ascending) */
    float *q;                  /* [max_ctx][QD] post-RoPE queries of the active rows */
    float *kb, *vb;            /* [max_rows][KVD] one ubatch's fresh K (pre-RoPE, then rotated) and V */
    float *dev_row;            /* [KVD] one cached row converted to f32 (compute thread) */
    int32_t *tok;              /* [max_ctx] prompt tokens */
    uint8_t *cls;              /* [max_ctx] CB_ROW_* */
    int32_t *src_of;           /* [max_ctx] source index or -1 */
    int32_t *act;              /* [max_ctx] active rows (positions), ascending */
    double *dev;               /* [max_ctx] deviation of active index i (candidates) */
    int32_t *order;            /* [max_ctx] scratch for selection */
    uint8_t *keep;             /* [max_ctx] */
    int32_t *ub_pos, *ub_lim, *ub_tok; /* [max_rows] */
    cb_attn_geom_t geom;
    float *mass;               /* [max_ctx] attention mass each row receives in a probe pass (metric 'a') */
    float *mass_scratch;       /* [cb_cpu_attn_mass_scratch(geom, max_ctx)] */

    src_t *srcs;               /* [cap_srcs] */
    int n_srcs, cap_srcs;

    /* cached prefix (precompute context) KV */
    int32_t *p_tokens;         /* [p_n] */
    int p_n;
    cb_kvmem_entry_t *p_entry;
    uint8_t p_ctx_fp[32];

    /* loader synchronisation of a run */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ld_ready;              /* layers the loader has finished */
    int ld_stop, ld_failed;
};

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

static void set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

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
        set_err(err, errlen, "blend: unknown mode %d", (int)o->mode);
        return -1;
    }
    if (!(o->ratio >= 0.0f && o->ratio <= 1.0f)) {
        set_err(err, errlen, "blend: ratio %g outside [0, 1]", (double)o->ratio);
        return -1;
    }
    if (o->check_layer < 0 || o->check_layer >= b->L) {
        set_err(err, errlen, "blend: check layer %d outside [0, %d]", o->check_layer, b->L - 1);
        return -1;
    }
    if (!cb_blend_metric_parse((const char[]){o->metric, 0})) {
        set_err(err, errlen, "blend: metric must be 'k', 'v' or 'a'");
        return -1;
    }
    if (o->metric == 'a' && o->gradual_ratio != 0.0f) {
        set_err(err, errlen, "blend: gradual filtering needs a deviation metric ('k' or 'v')");
        return -1;
    }
    if (o->gradual_ratio != 0.0f) {
        if (!(o->gradual_ratio > o->ratio && o->gradual_ratio <= 1.0f)) {
            set_err(err, errlen, "blend: gradual start ratio %g must be in (ratio %g, 1]", (double)o->gradual_ratio,
                    (double)o->ratio);
            return -1;
        }
        if (o->gradual_end_layer <= o->check_layer || o->gradual_end_layer >= b->L) {
            set_err(err, errlen, "blend: gradual end layer %d must be in (check layer %d, %d]", o->gradual_end_layer,
                    o->check_layer, b->L - 1);
            return -1;
        }
    }
    if (o->lead_tokens < 0) {
        set_err(err, errlen, "blend: lead tokens %d < 0", o->lead_tokens);
        return -1;
    }
    if (o->probe_layers < 0 || o->probe_layers > b->L) {
        set_err(err, errlen, "blend: probe layers %d outside [0, %d] (0 = all)", o->probe_layers, b->L);
        return -1;
    }
    if (o->probe_suffix < 0) {
        set_err(err, errlen, "blend: probe suffix rows %d < 0 (0 = all)", o->probe_suffix);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- lifetime */

cb_blend_t *cb_blend_new(cb_engine_t *engine, const char *kv_dir, cb_kvmem_t *mem, cb_kv_dtype_t dtype, char *err,
                         size_t errlen) {
    if (!engine) {
        set_err(err, errlen, "blend: no engine");
        return NULL;
    }
    if (dtype != CB_KV_F32 && dtype != CB_KV_F16 && dtype != CB_KV_BF16) {
        set_err(err, errlen, "blend: unknown KV dtype %d", (int)dtype);
        return NULL;
    }
    if (kv_dir) {
        struct stat st;
        if (stat(kv_dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
            set_err(err, errlen, "blend: kv dir %s: not a directory", kv_dir);
            return NULL;
        }
    }
    cb_blend_t *b = calloc(1, sizeof *b);
    if (!b) {
        set_err(err, errlen, "blend: out of memory");
        return NULL;
    }
    b->e = engine;
    b->model = cb_engine_model(engine);
    b->hp = cb_model_hparams(b->model);
    b->mem = mem;
    b->dtype = dtype;
    cb_model_fingerprint(b->model, b->model_fp);
    b->L = b->hp->n_layer;
    b->E = b->hp->n_embd;
    b->HD = b->hp->head_dim;
    b->QD = b->hp->n_head * b->HD;
    b->KVD = b->hp->n_head_kv * b->HD;
    b->max_ctx = cb_engine_max_ctx(engine);
    b->max_rows = cb_engine_max_rows(engine);
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    if (b->L > CB_KV_MAX_LAYERS || b->hp->n_head_kv > CB_KV_MAX_HEADS_KV || b->HD > CB_KV_MAX_HEAD_DIM ||
        b->KVD > CB_KV_MAX_KV_DIM || (b->HD & 1)) {
        set_err(err, errlen, "blend: model geometry outside the KV file limits");
        goto fail;
    }
    const size_t C = (size_t)b->max_ctx, R = (size_t)b->max_rows;
    if (kv_dir && !(b->kv_dir = strdup(kv_dir))) goto oom;
    b->rope_cs = cb_cpu_alloc_huge(sizeof(float) * C * b->HD, false);
    b->cs_rows = malloc(sizeof(float) * R * b->HD);
    b->x = cb_cpu_alloc_huge(sizeof(float) * C * b->E, false);
    b->q = cb_cpu_alloc_huge(sizeof(float) * C * b->QD, false);
    b->kb = malloc(sizeof(float) * R * b->KVD);
    b->vb = malloc(sizeof(float) * R * b->KVD);
    b->dev_row = malloc(sizeof(float) * (size_t)b->KVD);
    b->tok = malloc(sizeof(int32_t) * C);
    b->cls = malloc(C);
    b->src_of = malloc(sizeof(int32_t) * C);
    b->act = malloc(sizeof(int32_t) * C);
    b->dev = malloc(sizeof(double) * C);
    b->order = malloc(sizeof(int32_t) * C);
    b->keep = malloc(C);
    b->ub_pos = malloc(sizeof(int32_t) * R);
    b->ub_lim = malloc(sizeof(int32_t) * R);
    b->ub_tok = malloc(sizeof(int32_t) * R);
    b->geom = (cb_attn_geom_t){b->hp->n_head, b->hp->n_head_kv, b->HD, 1.0f / sqrtf((float)b->HD)};
    b->mass = malloc(sizeof(float) * C);
    b->mass_scratch = malloc(sizeof(float) * cb_cpu_attn_mass_scratch(&b->geom, b->max_ctx));
    if (!b->mass || !b->mass_scratch) goto oom;
    if (!b->rope_cs || !b->cs_rows || !b->x || !b->q || !b->kb || !b->vb || !b->dev_row || !b->tok || !b->cls || !b->src_of || !b->act || !b->dev || !b->order ||
        !b->keep || !b->ub_pos || !b->ub_lim || !b->ub_tok)
        goto oom;
    for (int p = 0; p < b->max_ctx; p++) cb_cpu_rope_coeffs(p, b->HD, b->hp->rope_base, b->rope_cs + (size_t)p * b->HD);
    return b;
oom:
    set_err(err, errlen, "blend: out of memory (%d positions)", b->max_ctx);
fail:
    cb_blend_destroy(&b);
    return NULL;
}

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
    cb_kvmem_entry_release(&b->p_entry);
    free(b->p_tokens);
    free(b->kv_dir);
    free(b->rope_cs);
    free(b->cs_rows);
    free(b->x);
    free(b->q);
    free(b->kb);
    free(b->vb);
    free(b->dev_row);
    free(b->tok);
    free(b->cls);
    free(b->src_of);
    free(b->act);
    free(b->dev);
    free(b->order);
    free(b->keep);
    free(b->ub_pos);
    free(b->ub_lim);
    free(b->ub_tok);
    free(b->mass);
    free(b->mass_scratch);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b);
    *self_p = NULL;
}

/* ---------------------------------------------------------------- small helpers */

void cb_blend_rotate_k(cb_blend_t *self, float *k, int n, const int32_t *pos) {
    for (int i = 0; i < n; i++) {
        float *row = k + (size_t)i * self->KVD;
        if (pos[i] >= 0 && pos[i] < self->max_ctx)
            cb_cpu_rope_apply(row, 1, self->hp->n_head_kv, self->HD, self->rope_cs + (size_t)pos[i] * self->HD);
        else
            cb_cpu_rope(row, 1, self->hp->n_head_kv, self->HD, &pos[i], self->hp->rope_base);
    }
}

static void ctx_fp_of(const cb_blend_t *b, const int32_t *ctx, int n_ctx, uint8_t fp[32]) {
    cb_kvfile_ctx_fp(b->model_fp, ctx, n_ctx, fp);
}

void cb_blend_chunk_key(cb_blend_t *self, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n,
                        uint8_t key[32]) {
    uint8_t fp[32];
    ctx_fp_of(self, ctx, n_ctx, fp);
    cb_kvfile_key(self->model_fp, fp, tokens, n, key);
}

static int check_tokens(const cb_blend_t *b, const int32_t *t, int n, const char *what, char *err, size_t errlen) {
    if (!t || n < 1) {
        set_err(err, errlen, "blend: %s is empty", what);
        return -1;
    }
    for (int i = 0; i < n; i++)
        if (t[i] < 0 || t[i] >= b->hp->n_vocab) {
            set_err(err, errlen, "blend: %s token %d = %d outside the vocabulary (%d)", what, i, (int)t[i],
                    b->hp->n_vocab);
            return -1;
        }
    return 0;
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

/* Does a row of class c need its cached K/V in the cache rows of layer l? */
static bool row_needs_cache(const run_t *R, int c, int l) {
    return c == CB_ROW_LOADED || (c == CB_ROW_CANDIDATE && l > R->check_layer);
}

/* n values of a KV payload (dtype) as f32; bit-identical to kvfile's conversion. */
static void kv_to_f32(cb_kv_dtype_t dt, const void *src, float *dst, size_t n) {
    if (dt == CB_KV_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    const uint16_t *h = src;
    size_t i = 0;
    if (dt == CB_KV_F16) {
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(h + i))));
#elif defined(__F16C__) && defined(__AVX__)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(h + i))));
#endif
        for (; i < n; i++) dst[i] = cb_f16_to_f32(h[i]);
    } else {
        for (; i < n; i++) dst[i] = cb_bf16_to_f32(h[i]);
    }
}

static size_t dtype_bytes(cb_kv_dtype_t dt) { return dt == CB_KV_F32 ? 4 : 2; }

/* Pre-RoPE cached K or V row (which: 0 = K, 1 = V) of fused row r at layer l (valid once the loader has
 * done layer l); streamed rows are converted into b->dev_row. */
static const float *cached_row(const cb_blend_t *b, int r, int l, int which) {
    const src_t *s = &b->srcs[b->src_of[r]];
    size_t off = (size_t)(r - s->row0) * b->KVD;
    const cb_kvmem_entry_t *e = s->kind == SRC_ENTRY ? s->entry : s->fill;
    if (e) return (which ? cb_kvmem_entry_v(e, l) : cb_kvmem_entry_k(e, l)) + off;
    const uint8_t *raw = which ? s->raw_v[l] : s->raw_k[l];
    kv_to_f32(s->dtype, raw + off * dtype_bytes(s->dtype), b->dev_row, (size_t)b->KVD);
    return b->dev_row;
}

/* Places layer l's cached K/V of every row that needs them into the engine's cache rows (K rotated to the
 * row's position). Streams file layers (checksum verified) first. 0, or -1 with R->fail_src/why set. */
static int load_layer(cb_blend_t *b, run_t *R, int l) {
    float *kc = cb_engine_kcache(b->e, l), *vc = cb_engine_vcache(b->e, l);
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
                return -1;
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
                return -1;
            }
            s->raw_k[l] = kp;
            s->raw_v[l] = vp;
            dt = s->dtype;
            if (!need_rows) continue;
        }
        const size_t esz = dtype_bytes(dt);
        /* contiguous runs of rows that need the cache: convert into the cache rows, rotate K there */
        int i = 0;
        while (i < s->n) {
            if (!row_needs_cache(R, b->cls[s->row0 + i], l)) {
                i++;
                continue;
            }
            int j = i + 1;
            while (j < s->n && row_needs_cache(R, b->cls[s->row0 + j], l)) j++;
            int a = s->row0 + i, cnt = j - i;
            kv_to_f32(dt, (const uint8_t *)kp + (size_t)i * KVD * esz, kc + (size_t)a * KVD, (size_t)cnt * KVD);
            kv_to_f32(dt, (const uint8_t *)vp + (size_t)i * KVD * esz, vc + (size_t)a * KVD, (size_t)cnt * KVD);
            cb_cpu_rope_apply(kc + (size_t)a * KVD, cnt, b->hp->n_head_kv, b->HD, b->rope_cs + (size_t)a * b->HD);
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
        double t0 = now_ms();
        int rc = load_layer(b, R, l);
        R->t_load += now_ms() - t0;
        pthread_mutex_lock(&b->mu);
        if (rc) {
            b->ld_failed = 1;
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

typedef struct {
    const double *dev;
    const int32_t *act;
} sort_ctx_t;

/* Descending deviation (NaN first: recompute what cannot be measured), then ascending position. */
static int cmp_dev(const void *pa, const void *pb, void *ctx) {
    const sort_ctx_t *c = ctx;
    int ia = *(const int32_t *)pa, ib = *(const int32_t *)pb;
    double da = c->dev[ia], db = c->dev[ib];
    bool na = isnan(da), nb = isnan(db);
    if (na != nb) return na ? -1 : 1;
    if (!na && da != db) return da > db ? -1 : 1;
    return c->act[ia] < c->act[ib] ? -1 : c->act[ia] > c->act[ib];
}

/* Keeps the forced rows and the `target` most deviating candidates among the active rows; compacts act,
 * x and q. Returns the new active count. */
static int select_rows(cb_blend_t *b, int n_act, int target) {
    int m = 0;
    for (int i = 0; i < n_act; i++)
        if (b->cls[b->act[i]] == CB_ROW_CANDIDATE) b->order[m++] = i;
    if (target >= m) return n_act;
    if (target < 0) target = 0;
    sort_ctx_t c = {b->dev, b->act};
    qsort_r(b->order, (size_t)m, sizeof(int32_t), cmp_dev, &c);
    for (int i = 0; i < n_act; i++) b->keep[i] = b->cls[b->act[i]] != CB_ROW_CANDIDATE;
    for (int j = 0; j < target; j++) b->keep[b->order[j]] = 1;
    int k = 0;
    for (int i = 0; i < n_act; i++) {
        if (!b->keep[i]) continue;
        if (k != i) {
            b->act[k] = b->act[i];
            memcpy(b->x + (size_t)k * b->E, b->x + (size_t)i * b->E, sizeof(float) * (size_t)b->E);
            memcpy(b->q + (size_t)k * b->QD, b->q + (size_t)i * b->QD, sizeof(float) * (size_t)b->QD);
        }
        k++;
    }
    return k;
}

static double sqdiff(const float *a, const float *c, int n) {
    double s = 0.0;
    for (int i = 0; i < n; i++) {
        double d = (double)a[i] - (double)c[i];
        s += d * d;
    }
    return s;
}

/* Metric 'a': b->order [m] holds the candidate rows (ascending), b->dev [m] their attention mass. Makes
 * the `target` most attended (ties: lower position first) COMPUTED; the others stay LOADED. */
static void select_by_mass(cb_blend_t *b, int m, int target) {
    for (int i = 0; i < m; i++) b->act[i] = b->order[i];
    for (int i = 0; i < m; i++) b->order[i] = i;
    sort_ctx_t c = {b->dev, b->act};
    qsort_r(b->order, (size_t)m, sizeof(int32_t), cmp_dev, &c);
    for (int j = 0; j < target && j < m; j++) {
        int r = b->act[b->order[j]];
        b->cls[r] = CB_ROW_COMPUTED;
        b->srcs[b->src_of[r]].n_loaded--;
    }
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

/* Runs the rows b->tok/cls/src_of [R->n] (sources in b->srcs). Returns 0, 1 when a streamed layer failed
 * its checksum (R->fail_src), or -1 on an internal error (err). On return *n_act_out = active rows at the
 * last layer (b->act). */
static int run_layers(cb_blend_t *b, run_t *R, int *n_act_out, char *err, size_t errlen) {
    cb_engine_t *e = b->e;
    const int L = b->L, E = b->E, QD = b->QD, KVD = b->KVD, HD = b->HD, MR = b->max_rows;
    const int nh = b->hp->n_head, nkv = b->hp->n_head_kv;
    const int CL = R->compute_layers > 0 ? R->compute_layers : L; /* layers that compute */
    assert(CL <= L && (CL == L || !R->logits));
    int n_act = 0;
    for (int r = 0; r < R->n; r++)
        if (b->cls[r] != CB_ROW_LOADED) b->act[n_act++] = r;
    if (n_act == 0 || b->act[n_act - 1] != R->n - 1) {
        set_err(err, errlen, "blend: the last row must be computed");
        return -1;
    }
    R->fail_src = -1;
    R->t_load = R->t_wait = R->t_compute = R->t_select = 0.0;
    double t0 = now_ms();
    for (int i0 = 0; i0 < n_act; i0 += MR) {
        int n = n_act - i0 < MR ? n_act - i0 : MR;
        for (int j = 0; j < n; j++) b->ub_tok[j] = b->tok[b->act[i0 + j]];
        cb_engine_embed(e, b->ub_tok, n, b->x + (size_t)i0 * E);
    }
    R->t_compute += now_ms() - t0;

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
        if (any_src) {
            double tw = now_ms();
            if (threaded) {
                pthread_mutex_lock(&b->mu);
                while (b->ld_ready < l + 1 && !b->ld_failed) pthread_cond_wait(&b->cv, &b->mu);
                int failed = b->ld_failed && b->ld_ready < l + 1;
                pthread_mutex_unlock(&b->mu);
                R->t_wait += now_ms() - tw;
                if (failed) {
                    rc = 1;
                    break;
                }
            } else {
                int lr = load_layer(b, R, l);
                double dt = now_ms() - tw;
                R->t_load += dt;
                R->t_wait += dt;
                if (lr) {
                    rc = 1;
                    break;
                }
            }
        }
        if (l >= CL) continue;
        double tc = now_ms();
        float *kc = cb_engine_kcache(e, l), *vc = cb_engine_vcache(e, l);
        const bool meas = measuring(R, l);
        double t_sel = 0.0;
        /* 2. QKV of every active row; K/V into the cache before any attention of the layer */
        for (int i0 = 0; i0 < n_act; i0 += MR) {
            int n = n_act - i0 < MR ? n_act - i0 : MR;
            const int32_t *rows = b->act + i0;
            float *q = b->q + (size_t)i0 * QD;
            cb_engine_layer_qkv(e, l, b->x + (size_t)i0 * E, n, q, b->kb, b->vb);
            if (R->capture) {
                int cn = cb_kvmem_entry_n_tokens(R->capture);
                float *ck = cb_kvmem_entry_k_mut(R->capture, l), *cv = cb_kvmem_entry_v_mut(R->capture, l);
                for (int j = 0; j < n; j++) {
                    int cr = rows[j] - R->cap_row0;
                    if (cr < 0 || cr >= cn) continue;
                    memcpy(ck + (size_t)cr * KVD, b->kb + (size_t)j * KVD, sizeof(float) * KVD);
                    memcpy(cv + (size_t)cr * KVD, b->vb + (size_t)j * KVD, sizeof(float) * KVD);
                }
            }
            if (meas) {
                double ts = now_ms();
                for (int j = 0; j < n; j++) {
                    int r = rows[j];
                    if (b->cls[r] != CB_ROW_CANDIDATE) continue;
                    const int which = R->metric == 'k' ? 0 : 1;
                    const float *cached = cached_row(b, r, l, which);
                    b->dev[i0 + j] = sqdiff((which ? b->vb : b->kb) + (size_t)j * KVD, cached, KVD);
                }
                t_sel += now_ms() - ts;
            }
            for (int j = 0; j < n; j++)
                memcpy(b->cs_rows + (size_t)j * HD, b->rope_cs + (size_t)rows[j] * HD, sizeof(float) * HD);
            cb_cpu_rope_apply(q, n, nh, HD, b->cs_rows);
            cb_cpu_rope_apply(b->kb, n, nkv, HD, b->cs_rows);
            for (int j = 0; j < n; j++) {
                memcpy(kc + (size_t)rows[j] * KVD, b->kb + (size_t)j * KVD, sizeof(float) * KVD);
                memcpy(vc + (size_t)rows[j] * KVD, b->vb + (size_t)j * KVD, sizeof(float) * KVD);
            }
        }
        /* 3. selection */
        if (meas) {
            double ts = now_ms();
            n_act = select_rows(b, n_act, target_at(R, l));
            t_sel += now_ms() - ts;
        }
        /* 4. attention (exact causal limits) + MLP of the active rows; at the last layer only the last row
         * matters (its residual feeds the logits) */
        if (R->probe_rows > 0) {
            int np = R->probe_rows < n_act ? R->probe_rows : n_act;
            for (int j = 0; j < np; j++) b->ub_lim[j] = b->act[n_act - np + j] + 1;
            cb_cpu_attn_mass(&b->geom, b->q + (size_t)(n_act - np) * QD, np, kc, b->ub_lim, b->mass, b->mass_scratch);
        }
        int a0 = 0;
        if (l == CL - 1) a0 = R->logits ? n_act - 1 : n_act;
        for (int i0 = a0; i0 < n_act; i0 += MR) {
            int n = n_act - i0 < MR ? n_act - i0 : MR;
            for (int j = 0; j < n; j++) {
                b->ub_pos[j] = b->act[i0 + j];
                b->ub_lim[j] = b->act[i0 + j] + 1;
            }
            if (R->hook) R->hook(R->hook_ud, l, n, b->ub_pos, b->ub_lim);
            cb_engine_layer_attn_mlp(e, l, b->x + (size_t)i0 * E, b->q + (size_t)i0 * QD, n, b->ub_lim);
        }
        R->t_select += t_sel;
        R->t_compute += now_ms() - tc - t_sel;
    }
    if (threaded) {
        pthread_mutex_lock(&b->mu);
        b->ld_stop = 1;
        pthread_cond_broadcast(&b->cv);
        pthread_mutex_unlock(&b->mu);
        pthread_join(th, NULL);
    }
    if (rc) return rc;
    if (R->logits) {
        double tl = now_ms();
        cb_engine_logits(e, b->x + (size_t)(n_act - 1) * E, R->logits);
        R->t_compute += now_ms() - tl;
    }
    *n_act_out = n_act;
    return 0;
}

/* Metric 'a' (query-aware selection): every candidate and every cached forced row is LOADED for a probe
 * pass in which the last suffix rows measure the attention mass each key receives (summed over heads,
 * rows and layers); the `target` most attended candidates then become COMPUTED (recomputed at every
 * layer) and the others LOADED at every layer: no check layer, so R->blend is cleared. The probe leaves
 * every cached row's K/V in the cache, so the main pass loads nothing (R->preloaded). No probe when
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
    double tp = now_ms();
    int n_act = 0, rc = run_layers(b, &P, &n_act, err, errlen);
    if (moved) memcpy(b->tok + s0, suffix, sizeof(int32_t) * (size_t)n_probe); /* the rows the move overwrote */
    st->t_probe_ms += now_ms() - tp;
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
    select_by_mass(b, m, target);
    /* the probe placed every cached row of every layer in the cache and verified the files: the main
     * pass only overwrites its computed rows */
    R->preloaded = true;
    return 0;
}

/* ---------------------------------------------------------------- prefix KV and chunk precompute */

static void run_init(run_t *R, int n) {
    memset(R, 0, sizeof *R);
    R->n = n;
    R->check_layer = 0;
    R->grad_end = -1;
    R->metric = 'v';
    R->overlap = true;
    R->fail_src = -1;
}

/* Computes tokens [n] at positions 0.. with everything COMPUTED, capturing all rows. */
static cb_kvmem_entry_t *compute_exact(cb_blend_t *b, const int32_t *tokens, int n, char *err, size_t errlen) {
    cb_kvmem_entry_t *ent = cb_kvmem_entry_new(b->L, b->hp->n_head_kv, b->HD, n);
    if (!ent) {
        set_err(err, errlen, "blend: out of memory (prefix KV of %d tokens)", n);
        return NULL;
    }
    memcpy(cb_kvmem_entry_tokens_mut(ent), tokens, sizeof(int32_t) * (size_t)n);
    release_srcs(b);
    for (int r = 0; r < n; r++) {
        b->tok[r] = tokens[r];
        b->cls[r] = CB_ROW_COMPUTED;
        b->src_of[r] = -1;
    }
    run_t R;
    run_init(&R, n);
    R.capture = ent;
    R.cap_row0 = 0;
    int n_act;
    if (run_layers(b, &R, &n_act, err, errlen) != 0) {
        cb_kvmem_entry_release(&ent);
        return NULL;
    }
    return ent;
}

/* Makes b->p_entry the exact KV of ctx [n_ctx] (computed unless it is the cached one). */
static int ensure_prefix(cb_blend_t *b, const int32_t *ctx, int n_ctx, char *err, size_t errlen) {
    if (b->p_entry && b->p_n == n_ctx && !memcmp(b->p_tokens, ctx, sizeof(int32_t) * (size_t)n_ctx)) return 0;
    cb_kvmem_entry_release(&b->p_entry);
    free(b->p_tokens);
    b->p_tokens = NULL;
    b->p_n = 0;
    int32_t *copy = malloc(sizeof(int32_t) * (size_t)n_ctx);
    if (!copy) {
        set_err(err, errlen, "blend: out of memory");
        return -1;
    }
    memcpy(copy, ctx, sizeof(int32_t) * (size_t)n_ctx);
    cb_kvmem_entry_t *ent = compute_exact(b, copy, n_ctx, err, errlen);
    if (!ent) {
        free(copy);
        return -1;
    }
    b->p_entry = ent;
    b->p_tokens = copy;
    b->p_n = n_ctx;
    ctx_fp_of(b, copy, n_ctx, b->p_ctx_fp);
    return 0;
}

/* Stores an entry as a KV file (if kv_dir) and in the memory tier (if mem). 0, or -1 when the file write
 * failed (err). */
static int store_entry(cb_blend_t *b, const uint8_t key[32], const uint8_t ctx_fp[32], cb_kvmem_entry_t *ent,
                       char *err, size_t errlen) {
    int rc = 0;
    if (b->kv_dir) {
        char path[4096];
        if (cb_kvfile_path(b->kv_dir, key, path, sizeof path) != 0) {
            set_err(err, errlen, "blend: kv dir path too long");
            rc = -1;
        } else {
            cb_kv_meta_t meta;
            memset(&meta, 0, sizeof meta);
            memcpy(meta.model_fp, b->model_fp, 32);
            memcpy(meta.ctx_fp, ctx_fp, 32);
            meta.n_layer = b->L;
            meta.n_head_kv = b->hp->n_head_kv;
            meta.head_dim = b->HD;
            meta.dtype = b->dtype;
            const float **kp = malloc(sizeof(float *) * (size_t)b->L), **vp = malloc(sizeof(float *) * (size_t)b->L);
            if (!kp || !vp) {
                set_err(err, errlen, "blend: out of memory");
                rc = -1;
            } else {
                for (int l = 0; l < b->L; l++) {
                    kp[l] = cb_kvmem_entry_k(ent, l);
                    vp[l] = cb_kvmem_entry_v(ent, l);
                }
                char werr[256] = "";
                int w = cb_kvfile_write_layers(path, &meta, cb_kvmem_entry_tokens(ent), cb_kvmem_entry_n_tokens(ent),
                                               kp, vp, werr, sizeof werr);
                if (w != 0) {
                    set_err(err, errlen, "blend: writing %s: %s", path, werr);
                    rc = -1;
                }
            }
            free(kp);
            free(vp);
        }
    }
    if (b->mem) cb_kvmem_put(b->mem, key, ent);
    return rc;
}

/* Rounds an entry's K/V through the storage dtype, so that a chunk computed now gives exactly what the same
 * chunk read back from its file gives. */
static void round_to_dtype(const cb_blend_t *b, cb_kvmem_entry_t *ent) {
    if (b->dtype == CB_KV_F32) return;
    size_t cnt = (size_t)cb_kvmem_entry_n_tokens(ent) * b->KVD;
    for (int l = 0; l < b->L; l++) {
        float *p[2] = {cb_kvmem_entry_k_mut(ent, l), cb_kvmem_entry_v_mut(ent, l)};
        for (int t = 0; t < 2; t++)
            for (size_t i = 0; i < cnt; i++)
                p[t][i] = b->dtype == CB_KV_F16 ? cb_f16_to_f32(cb_f32_to_f16(p[t][i]))
                                                : cb_bf16_to_f32(cb_f32_to_bf16(p[t][i]));
    }
}

/* Computes chunk tokens [n] after the cached prefix (b->p_entry, rows 0..p_n-1), rounded to the dtype. */
static cb_kvmem_entry_t *compute_chunk(cb_blend_t *b, const int32_t *tokens, int n, char *err, size_t errlen) {
    const int np = b->p_n, N = np + n;
    cb_kvmem_entry_t *ent = cb_kvmem_entry_new(b->L, b->hp->n_head_kv, b->HD, n);
    if (!ent) {
        set_err(err, errlen, "blend: out of memory (chunk KV of %d tokens)", n);
        return NULL;
    }
    memcpy(cb_kvmem_entry_tokens_mut(ent), tokens, sizeof(int32_t) * (size_t)n);
    release_srcs(b);
    src_t *s;
    if (add_src(b, &s) != 0) {
        cb_kvmem_entry_release(&ent);
        set_err(err, errlen, "blend: out of memory");
        return NULL;
    }
    s->kind = SRC_ENTRY;
    s->row0 = 0;
    s->n = np;
    s->chunk = -1;
    s->entry = cb_kvmem_entry_ref(b->p_entry);
    s->n_loaded = np;
    for (int r = 0; r < N; r++) {
        b->tok[r] = r < np ? b->p_tokens[r] : tokens[r - np];
        b->cls[r] = r < np ? CB_ROW_LOADED : CB_ROW_COMPUTED;
        b->src_of[r] = r < np ? 0 : -1;
    }
    run_t R;
    run_init(&R, N);
    R.capture = ent;
    R.cap_row0 = np;
    int n_act;
    int rc = run_layers(b, &R, &n_act, err, errlen);
    release_srcs(b);
    if (rc != 0) {
        if (rc > 0) set_err(err, errlen, "blend: internal error (prefix source failed)");
        cb_kvmem_entry_release(&ent);
        return NULL;
    }
    round_to_dtype(b, ent);
    return ent;
}

static int check_ctx_chunk(cb_blend_t *b, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n, char *err,
                           size_t errlen) {
    if (check_tokens(b, ctx, n_ctx, "context", err, errlen) || check_tokens(b, tokens, n, "chunk", err, errlen))
        return -1;
    if (n_ctx > b->max_ctx || n > b->max_ctx - n_ctx) {
        set_err(err, errlen, "blend: context %d + chunk %d tokens exceed max_ctx %d", n_ctx, n, b->max_ctx);
        return -1;
    }
    if (n > CB_KV_MAX_TOKENS) {
        set_err(err, errlen, "blend: chunk of %d tokens exceeds the KV file limit", n);
        return -1;
    }
    return 0;
}

cb_kvmem_entry_t *cb_blend_precompute_chunk(cb_blend_t *self, const int32_t *ctx, int n_ctx, const int32_t *tokens,
                                            int n, bool store, char *err, size_t errlen) {
    if (!self) return NULL;
    if (check_ctx_chunk(self, ctx, n_ctx, tokens, n, err, errlen)) return NULL;
    if (ensure_prefix(self, ctx, n_ctx, err, errlen)) return NULL;
    cb_kvmem_entry_t *ent = compute_chunk(self, tokens, n, err, errlen);
    if (!ent) return NULL;
    if (store) {
        uint8_t key[32];
        cb_kvfile_key(self->model_fp, self->p_ctx_fp, tokens, n, key);
        if (store_entry(self, key, self->p_ctx_fp, ent, err, errlen) != 0) {
            cb_kvmem_entry_release(&ent);
            return NULL;
        }
    }
    return ent;
}

/* Opens key's file against this model, context and tokens. NULL = miss (*why). */
static cb_kvfile_t *open_chunk_file(cb_blend_t *b, const uint8_t key[32], const int32_t *tokens, int n,
                                    cb_kv_miss_t *why) {
    char path[4096];
    if (!b->kv_dir || cb_kvfile_path(b->kv_dir, key, path, sizeof path) != 0) {
        *why = CB_KV_MISS_NOT_FOUND;
        return NULL;
    }
    cb_kv_expect_t ex;
    memset(&ex, 0, sizeof ex);
    memcpy(ex.model_fp, b->model_fp, 32);
    memcpy(ex.ctx_fp, b->p_ctx_fp, 32);
    ex.n_layer = b->L;
    ex.n_head_kv = b->hp->n_head_kv;
    ex.head_dim = b->HD;
    ex.tokens = tokens;
    ex.n_tokens = n;
    char err[256] = "";
    cb_kvfile_t *f = cb_kvfile_open(path, &ex, why, err, sizeof err);
    if (!f && *why != CB_KV_MISS_NOT_FOUND) CB_WARN("blend: chunk file miss (%s): %s", cb_kv_miss_str(*why), err);
    return f;
}

/* Whether a memory-tier entry fits this model and these tokens (the key makes a mismatch unlikely; an entry
 * that does not fit is dropped and counts as a miss). */
static bool entry_fits(const cb_blend_t *b, const cb_kvmem_entry_t *e, const int32_t *tokens, int n) {
    return cb_kvmem_entry_n_layer(e) == b->L && cb_kvmem_entry_n_head_kv(e) == b->hp->n_head_kv &&
           cb_kvmem_entry_head_dim(e) == b->HD && cb_kvmem_entry_n_tokens(e) == n &&
           !memcmp(cb_kvmem_entry_tokens(e), tokens, sizeof(int32_t) * (size_t)n);
}

/* The memory tier's entry for key, validated (NULL: miss). */
static cb_kvmem_entry_t *mem_get(cb_blend_t *b, const uint8_t key[32], const int32_t *tokens, int n) {
    if (!b->mem) return NULL;
    cb_kvmem_entry_t *e = cb_kvmem_get(b->mem, key);
    if (e && !entry_fits(b, e, tokens, n)) {
        CB_WARN("blend: memory-tier entry does not fit its key; dropped");
        cb_kvmem_remove(b->mem, key);
        cb_kvmem_entry_release(&e);
    }
    return e;
}

/* Shared by ensure/load: find (mem, file) or compute + store. With want_entry the decoded KV is returned. */
static int find_chunk(cb_blend_t *b, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n, bool want_entry,
                      cb_kvmem_entry_t **out, cb_blend_src_t *src, cb_kv_miss_t *why, char *err, size_t errlen) {
    cb_kv_miss_t w = CB_KV_MISS_NOT_FOUND;
    if (check_ctx_chunk(b, ctx, n_ctx, tokens, n, err, errlen)) return -1;
    if (ensure_prefix(b, ctx, n_ctx, err, errlen)) return -1;
    uint8_t key[32];
    cb_kvfile_key(b->model_fp, b->p_ctx_fp, tokens, n, key);
    {
        cb_kvmem_entry_t *ent = mem_get(b, key, tokens, n);
        if (ent) {
            if (src) *src = CB_BLEND_SRC_MEM;
            if (why) *why = CB_KV_OK;
            if (want_entry) *out = ent;
            else cb_kvmem_entry_release(&ent);
            return 0;
        }
    }
    cb_kvfile_t *f = open_chunk_file(b, key, tokens, n, &w);
    if (f) {
        if (want_entry || b->mem) {
            cb_kvmem_entry_t *ent = cb_kvmem_entry_from_file(f, &w);
            if (ent) {
                if (b->mem) cb_kvmem_put(b->mem, key, ent);
                cb_kvfile_destroy(&f);
                if (src) *src = CB_BLEND_SRC_FILE;
                if (why) *why = CB_KV_OK;
                if (want_entry) *out = ent;
                else cb_kvmem_entry_release(&ent);
                return 0;
            }
        } else {
            w = cb_kvfile_verify(f);
            if (w == CB_KV_OK) {
                cb_kvfile_destroy(&f);
                if (src) *src = CB_BLEND_SRC_FILE;
                if (why) *why = CB_KV_OK;
                return 0;
            }
        }
        CB_WARN("blend: chunk file miss (%s)", cb_kv_miss_str(w));
        cb_kvfile_destroy(&f);
    }
    if (why) *why = w;
    cb_kvmem_entry_t *ent = compute_chunk(b, tokens, n, err, errlen);
    if (!ent) return -1;
    if (store_entry(b, key, b->p_ctx_fp, ent, err, errlen) != 0) {
        cb_kvmem_entry_release(&ent);
        return -1;
    }
    if (src) *src = CB_BLEND_SRC_COMPUTED;
    if (want_entry) *out = ent;
    else cb_kvmem_entry_release(&ent);
    return 0;
}

int cb_blend_ensure_chunk(cb_blend_t *self, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n,
                          cb_blend_src_t *src, cb_kv_miss_t *why, char *err, size_t errlen) {
    if (!self) return -1;
    return find_chunk(self, ctx, n_ctx, tokens, n, false, NULL, src, why, err, errlen);
}

cb_kvmem_entry_t *cb_blend_load_chunk(cb_blend_t *self, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n,
                                      cb_blend_src_t *src, cb_kv_miss_t *why, char *err, size_t errlen) {
    cb_kvmem_entry_t *ent = NULL;
    if (!self || find_chunk(self, ctx, n_ctx, tokens, n, true, &ent, src, why, err, errlen) != 0) return NULL;
    return ent;
}

/* ---------------------------------------------------------------- the fused prefill */

/* Resolves chunk c (tokens [n]) into a source (mem entry, streamed file, or computed now and stored).
 * force: skip the file (it failed mid-stream). Appends to b->srcs; *kind_out = CB_BLEND_SRC_*. */
typedef struct {
    int chunk;
    int kind;                  /* CB_BLEND_SRC_* */
    cb_kvmem_entry_t *entry;   /* mem or computed */
    cb_kvfile_t *file;
    uint8_t key[32];
} resolved_t;

static int resolve_chunk(cb_blend_t *b, const int32_t *tokens, int n, bool force, resolved_t *rs, char *err,
                         size_t errlen) {
    cb_kvfile_key(b->model_fp, b->p_ctx_fp, tokens, n, rs->key);
    rs->entry = NULL;
    rs->file = NULL;
    if (!force) {
        rs->entry = mem_get(b, rs->key, tokens, n);
        if (rs->entry) {
            rs->kind = CB_BLEND_SRC_MEM;
            return 0;
        }
    }
    if (!force) {
        cb_kv_miss_t w;
        rs->file = open_chunk_file(b, rs->key, tokens, n, &w);
        if (rs->file) {
            rs->kind = CB_BLEND_SRC_FILE;
            return 0;
        }
    }
    if (b->mem && force) cb_kvmem_remove(b->mem, rs->key);
    rs->entry = compute_chunk(b, tokens, n, err, errlen);
    if (!rs->entry) return -1;
    char serr[256] = "";
    if (store_entry(b, rs->key, b->p_ctx_fp, rs->entry, serr, sizeof serr) != 0)
        CB_WARN("%s (the chunk is used from memory)", serr);
    rs->kind = CB_BLEND_SRC_COMPUTED;
    return 0;
}

int cb_blend_prefill(cb_blend_t *self, const int32_t *prefix, int n_prefix, const cb_blend_chunk_t *chunks,
                     int n_chunks, const int32_t *suffix, int n_suffix, const cb_blend_opts_t *opts, float *logits,
                     cb_blend_stats_t *stats, char *err, size_t errlen) {
    double t_start = now_ms();
    cb_blend_t *b = self;
    if (!b) return -1;
    cb_blend_opts_t def;
    if (!opts) {
        cb_blend_opts_default(&def);
        opts = &def;
    }
    if (check_opts(b, opts, err, errlen)) return -1;
    if (n_chunks < 0 || (n_chunks > 0 && !chunks)) {
        set_err(err, errlen, "blend: bad chunk list");
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
            set_err(err, errlen, "blend: chunk %d of %d tokens exceeds the KV file limit", c, chunks[c].n);
            return -1;
        }
        N += chunks[c].n;
    }
    if (N > b->max_ctx) {
        set_err(err, errlen, "blend: prompt of %lld tokens exceeds max_ctx %d", N, b->max_ctx);
        return -1;
    }
    const cb_blend_mode_t mode = opts->mode;
    /* which chunks need their KV */
    int n_need = mode == CB_BLEND_FULL ? 0 : mode == CB_BLEND_PREFIX ? (n_chunks > 0 ? 1 : 0) : n_chunks;
    resolved_t *rs = calloc((size_t)(n_chunks > 0 ? n_chunks : 1), sizeof *rs);
    uint8_t *force = calloc((size_t)(n_chunks > 0 ? n_chunks : 1), 1);
    if (!rs || !force) {
        free(rs);
        free(force);
        set_err(err, errlen, "blend: out of memory");
        return -1;
    }
    cb_blend_stats_t st;
    memset(&st, 0, sizeof st);
    st.n_tokens = (int)N;
    int ret = -1, n_act = 0;
    run_t R;
    for (int attempt = 0;; attempt++) {
        double tr = now_ms();
        /* 1. prefix KV (exact) and chunk sources */
        if (mode != CB_BLEND_FULL && ensure_prefix(b, prefix, n_prefix, err, errlen)) goto out;
        st.chunks_mem = st.chunks_file = 0;
        for (int c = 0; c < n_need; c++) {
            if (resolve_chunk(b, chunks[c].tokens, chunks[c].n, force[c], &rs[c], err, errlen)) goto out;
            rs[c].chunk = c;
            if (rs[c].kind == CB_BLEND_SRC_MEM) st.chunks_mem++;
            else if (rs[c].kind == CB_BLEND_SRC_FILE) st.chunks_file++;
            else st.chunks_computed++;
        }
        st.t_resolve_ms += now_ms() - tr;
        /* 2. rows, classes, sources */
        release_srcs(b);
        int r = 0;
        src_t *s;
        const int p_cls = mode == CB_BLEND_FULL ? CB_ROW_COMPUTED : CB_ROW_LOADED;
        int p_src = -1;
        if (mode != CB_BLEND_FULL) {
            if (add_src(b, &s)) goto oom;
            s->kind = SRC_ENTRY;
            s->row0 = 0;
            s->n = n_prefix;
            s->chunk = -1;
            s->entry = cb_kvmem_entry_ref(b->p_entry);
            s->n_loaded = n_prefix;
            p_src = 0;
        }
        for (int i = 0; i < n_prefix; i++, r++) {
            b->tok[r] = prefix[i];
            b->cls[r] = (uint8_t)p_cls;
            b->src_of[r] = p_src;
        }
        int n_cand_total = 0;
        for (int c = 0; c < n_chunks; c++) {
            int si = -1;
            if (c < n_need) {
                if (add_src(b, &s)) goto oom;
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
                    if (!s->raw_k || !s->raw_v) goto oom;
                    if (b->mem) {
                        s->fill = cb_kvmem_entry_new(b->L, b->hp->n_head_kv, b->HD, s->n);
                        if (!s->fill) goto oom;
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
                    if (mode == CB_BLEND_BLEND) cl = i < opts->lead_tokens ? CB_ROW_COMPUTED : CB_ROW_CANDIDATE;
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
        assert(r == N);
        st.n_candidates = n_cand_total;
        st.n_forced = 0;
        for (int i = 0; i < (int)N; i++) st.n_forced += b->cls[i] == CB_ROW_COMPUTED;
        /* 3. run */
        run_init(&R, (int)N);
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
            rc = choose_by_attention(b, &R, (int)N, suffix, n_suffix, opts, &st, err, errlen);
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
            if (fs->chunk < 0 || force[fs->chunk] || attempt > n_chunks) {
                set_err(err, errlen, "blend: internal error (source %d failed twice)", R.fail_src);
                goto out;
            }
            force[fs->chunk] = 1;
            st.restarts++;
            release_srcs(b);
            continue;
        }
        /* chunks streamed from files join the memory tier */
        if (b->mem)
            for (int i = 0; i < b->n_srcs; i++)
                if (b->srcs[i].fill) cb_kvmem_put(b->mem, b->srcs[i].key, b->srcs[i].fill);
        ret = 0;
        break;
    }
    st.tokens_recomputed = n_act;
    st.tokens_reused = (int)N - n_act;
    st.selected = b->act;
    st.t_total_ms = now_ms() - t_start;
    if (stats) *stats = st;
    goto out;
oom:
    set_err(err, errlen, "blend: out of memory");
out:
    for (int c = 0; c < n_chunks; c++) {
        cb_kvmem_entry_release(&rs[c].entry);
        cb_kvfile_destroy(&rs[c].file);
    }
    release_srcs(b);
    free(rs);
    free(force);
    return ret;
}
