/* cpu_backend.c: the CPU backend's table (wrapping the kernels of cpu_ops.h) and backend-independent helpers.
 *
 * The CPU context owns the scratch its kernels need (matvec row buffers, attention score blocks) and a
 * RoPE coefficient table for positions [0, max_keys) of the model's head_dim and base; positions
 * outside the table (or another base) are computed on the fly with the same formula, so results are
 * bit-identical either way.
 *
 * The KV pool holds f32 or binary16 values (kv_pool_init's dtype): writes round f32 to nearest even
 * (cb_cpu_f32_to_f16), loads convert the file's dtype to f32, rotate K there and round once, reads and the
 * attention kernels convert back to f32 (exactly).
 */
#include "cpu/cpu_backend.h"
#include "base/alloc.h"

#include <math.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu/cpu_ops.h"
#include "cpu/cpu_quant.h"

typedef struct {
    int nt;                 /* threads (pool size) */
    cb_pool_t *pool;        /* nt - 1 workers + the caller */
    int max_rows, max_keys;
    int rope_hd;            /* head_dim the table was built for */
    cb_rope_t rope;         /* the rotation the table holds: the model's (freq_factors borrowed from the model,
                               which outlives the backend, so the layers' ropes match it by pointer) */
    float *rope_cs;         /* [max_keys][rope_hd] (cos, sin) pairs per position */
    float *rope_rows;       /* [max_rows][rope_hd] coefficients of the rows of one call */
    cb_cpu_mm_scratch_t mm; /* matvec row buffers, quantized activations, GEMM weight tiles */
    int max_cols;
    float *att_scratch;     /* cb_cpu_attention_scratch floats */
    cb_attn_geom_t geom;    /* geometry the attention scratch was sized for */
    int scratch_nt;         /* threads the scratch was sized for */
    float *mass_scratch;    /* cb_cpu_attn_mass_scratch(geom, max_keys) floats */
    int32_t *topk_idx;      /* [max_keys] selection order */
    /* the KV pool (kv_pool_init): per layer [n_blocks * bt][kvd] K values of dtype, then the same for V */
    uint8_t *kpool, *vpool;
    size_t pool_map;        /* bytes of each mapping */
    cb_kv_dtype_t dtype;    /* CB_KV_F32 or CB_KV_F16 */
    size_t esz;             /* bytes per value: 4 or 2 */
    int n_layer, kvd, bt, n_blocks;
    cb_backend_t *be;       /* the table this context belongs to (kv_value_bytes is set at pool init) */
    cb_weights_t *weights;  /* the model's weights this backend prepared (a reference, given back at destroy) */
} cpu_ctx_t;

/* ---------------------------------------------------------------- the KV pool */

static uint8_t *pool_layer(const cpu_ctx_t *c, uint8_t *base, int layer) {
    return base + (size_t)layer * c->n_blocks * c->bt * c->kvd * c->esz;
}

/* Pool row r of a layer plane (K or V). */
static uint8_t *pool_at(const cpu_ctx_t *c, uint8_t *plane, size_t r) { return plane + r * (size_t)c->kvd * c->esz; }

static cb_cpu_kv_t kv_view(const cpu_ctx_t *c, int layer, const cb_kv_table_t *t) {
    return (cb_cpu_kv_t){pool_layer(c, c->kpool, layer), pool_layer(c, c->vpool, layer), t ? t->blocks : NULL, c->bt,
                         c->dtype};
}

/* Pool row of position p of table t (p < t->n_pos, checked by the callers). */
static size_t pool_row(const cpu_ctx_t *c, const cb_kv_table_t *t, int p) {
    return (size_t)t->blocks[p / c->bt] * c->bt + (size_t)(p % c->bt);
}

static int cpu_kv_pool_init(void *ctx, int n_layer, int kv_dim, int block_tokens, int n_blocks, cb_kv_dtype_t dtype,
                            char *err, size_t errlen) {
    cpu_ctx_t *c = ctx;
    if (c->kpool) {
        snprintf(err, errlen, "cpu backend: KV pool already initialised");
        return -1;
    }
    if (dtype != CB_KV_F32 && dtype != CB_KV_F16) {
        snprintf(err, errlen, "cpu backend: KV pool dtype %s not supported (f32 or f16)", cb_kv_dtype_name(dtype));
        return -1;
    }
    const size_t esz = cb_kv_dtype_size(dtype);
    if (n_layer < 1 || kv_dim < 1 || block_tokens < 1 || n_blocks < 1 ||
        (size_t)n_blocks * block_tokens > SIZE_MAX / esz / (size_t)kv_dim / (size_t)n_layer) {
        snprintf(err, errlen, "cpu backend: bad KV pool geometry");
        return -1;
    }
    size_t bytes = esz * (size_t)n_layer * n_blocks * block_tokens * kv_dim;
    /* anonymous mappings: zero pages, backed only as blocks are first written (4 KiB pages) */
    void *k = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    void *v = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (k == MAP_FAILED || v == MAP_FAILED) {
        if (k != MAP_FAILED) munmap(k, bytes);
        if (v != MAP_FAILED) munmap(v, bytes);
        snprintf(err, errlen, "cpu backend: cannot map a KV pool of 2 x %zu MB", bytes >> 20);
        return -1;
    }
    /* no MADV_HUGEPAGE here: each layer's K and V region would take a 2 MiB page on its first write (about
     * 120 MB for SmolLM2 with a short prompt) for no measured speed-up */
    c->kpool = k;
    c->vpool = v;
    c->pool_map = bytes;
    c->dtype = dtype;
    c->esz = esz;
    c->be->kv_value_bytes = (int)esz;
    c->n_layer = n_layer;
    c->kvd = kv_dim;
    c->bt = block_tokens;
    c->n_blocks = n_blocks;
    return 0;
}

static int cpu_kv_copy_block(void *ctx, int dst, int src) {
    cpu_ctx_t *c = ctx;
    if (!c->kpool || dst < 0 || src < 0 || dst >= c->n_blocks || src >= c->n_blocks) return -1;
    const size_t per = (size_t)c->bt * c->kvd * c->esz; /* bytes of one block of one layer */
    for (int l = 0; l < c->n_layer; l++) {
        memcpy(pool_layer(c, c->kpool, l) + dst * per, pool_layer(c, c->kpool, l) + src * per, per);
        memcpy(pool_layer(c, c->vpool, l) + dst * per, pool_layer(c, c->vpool, l) + src * per, per);
    }
    return 0;
}

static int cpu_kv_write(void *ctx, int layer, const cb_kv_table_t *t, const int32_t *pos, int n, const float *k,
                        const float *v) {
    cpu_ctx_t *c = ctx;
    if (!c->kpool || layer < 0 || layer >= c->n_layer) return -1;
    uint8_t *kp = pool_layer(c, c->kpool, layer), *vp = pool_layer(c, c->vpool, layer);
    const size_t kvd = (size_t)c->kvd;
    for (int i = 0; i < n; i++)
        if (pos[i] < 0 || pos[i] >= t->n_pos) return -1;
    for (int i = 0; i < n; i++) {
        size_t r = pool_row(c, t, pos[i]);
        if (c->dtype == CB_KV_F16) {
            cb_cpu_f32_to_f16(k + (size_t)i * kvd, (uint16_t *)(void *)pool_at(c, kp, r), kvd);
            cb_cpu_f32_to_f16(v + (size_t)i * kvd, (uint16_t *)(void *)pool_at(c, vp, r), kvd);
        } else {
            memcpy(pool_at(c, kp, r), k + (size_t)i * kvd, sizeof(float) * kvd);
            memcpy(pool_at(c, vp, r), v + (size_t)i * kvd, sizeof(float) * kvd);
        }
    }
    return 0;
}

#define LOAD_TMP_FLOATS 4096 /* kv_load into an f16 pool: f32 values converted at a time (on the caller's stack);
                              * a multiple of the Q8_0 block */

/* Heads of a row that load_rows_f16 converts at a time (whole heads, at most LOAD_TMP_FLOATS values). */
static int load_heads(const cpu_ctx_t *c) {
    const int hd = c->rope_hd, nkv = c->kvd / hd;
    return LOAD_TMP_FLOATS / hd < nkv ? LOAD_TMP_FLOATS / hd : nkv;
}


/* kv_load into an f16 pool, rows of positions p..p+w-1 at kdst, vdst (consecutive pool rows) from ksrc, vsrc
 * (dtype): each row converted to f32 on the stack (load_heads whole heads at a time: whole Q8_0 blocks, as
 * cpu_kv_load checks), K rotated there as the f32 pool does it (the table's coefficients, or the same ones computed),
 * then rounded to f16 once; V from an f16 source copied as is (converting it to f32 and back is the
 * identity). */
static void load_rows_f16(const cpu_ctx_t *c, uint16_t *kdst, uint16_t *vdst, int p, int w, const uint8_t *ksrc,
                          const uint8_t *vsrc, cb_kv_dtype_t dtype, const cb_rope_t *rope, bool table) {
    const size_t kvd = (size_t)c->kvd;
    const int hd = c->rope_hd, nkv = c->kvd / hd, hs = load_heads(c);
    float tmp[LOAD_TMP_FLOATS], cs_row[CB_KV_MAX_HEAD_DIM];
    for (int j = 0; j < w; j++) {
        const int32_t pj = p + j;
        const float *cs = c->rope_cs + (size_t)pj * hd;
        if (!table || pj >= c->max_keys) {
            cb_cpu_rope_coeffs(pj, rope, cs_row);
            cs = cs_row;
        }
        for (int h0 = 0; h0 < nkv; h0 += hs) { /* whole heads at a time */
            const int nh = nkv - h0 < hs ? nkv - h0 : hs;
            const size_t e = (size_t)j * kvd + (size_t)h0 * hd, cnt = (size_t)nh * hd;
            cb_cpu_kv_to_f32(dtype, ksrc + cb_kv_row_bytes(dtype, e), tmp, cnt); /* the bytes of e values */
            cb_cpu_rope_apply(tmp, 1, nh, hd, rope->type, cs);
            cb_cpu_f32_to_f16(tmp, kdst + e, cnt);
        }
    }
    if (dtype == CB_KV_F16) {
        memcpy(vdst, vsrc, (size_t)w * kvd * sizeof(uint16_t));
        return;
    }
    for (size_t e = 0, all = (size_t)w * kvd; e < all; e += LOAD_TMP_FLOATS) {
        const size_t cnt = all - e < LOAD_TMP_FLOATS ? all - e : LOAD_TMP_FLOATS;
        cb_cpu_kv_to_f32(dtype, vsrc + cb_kv_row_bytes(dtype, e), tmp, cnt);
        cb_cpu_f32_to_f16(tmp, vdst + e, cnt);
    }
}

/* Thread-safe (the loader thread): touches only the pool rows named, the read-only RoPE table and its own
 * stack. */
static int cpu_kv_load(void *ctx, int layer, const cb_kv_table_t *t, int pos0, int n, const void *k, const void *v,
                       cb_kv_dtype_t dtype, const cb_rope_t *rope) {
    cpu_ctx_t *c = ctx;
    if (!c->kpool || layer < 0 || layer >= c->n_layer || pos0 < 0 || n < 0 || pos0 > t->n_pos - n) return -1;
    const size_t kvd = (size_t)c->kvd, rowb = cb_kv_row_bytes(dtype, kvd); /* bytes of a source row */
    const int hd = c->rope_hd, nkv = c->kvd / hd, hs = load_heads(c);
    if (!rowb) return -1; /* not a dtype, or a Q8_0 row of kvd % 32 != 0 */
    if (dtype == CB_KV_Q8_0 && hs < nkv && (hs * hd) % 32) return -1; /* no such model */
    if (!rope || rope->n_dims != hd) return -1;
    const bool table = cb_rope_equal(rope, &c->rope);
    uint8_t *kpl = pool_layer(c, c->kpool, layer), *vpl = pool_layer(c, c->vpool, layer);
    if (c->dtype == CB_KV_F16 && hd > CB_KV_MAX_HEAD_DIM) return -1;
    for (int p = pos0, w; p < pos0 + n; p += w) {
        /* positions p..p+w-1 of one block: consecutive pool rows, converted in place and K rotated there */
        w = c->bt - p % c->bt;
        if (w > pos0 + n - p) w = pos0 + n - p;
        size_t r = pool_row(c, t, p), i = (size_t)(p - pos0);
        if (c->dtype == CB_KV_F16) {
            load_rows_f16(c, (uint16_t *)(void *)pool_at(c, kpl, r), (uint16_t *)(void *)pool_at(c, vpl, r), p, w,
                          (const uint8_t *)k + i * rowb, (const uint8_t *)v + i * rowb, dtype, rope, table);
            continue;
        }
        float *kp = (float *)(void *)kpl, *vp = (float *)(void *)vpl;
        cb_cpu_kv_to_f32(dtype, (const uint8_t *)k + i * rowb, kp + r * kvd, (size_t)w * kvd);
        cb_cpu_kv_to_f32(dtype, (const uint8_t *)v + i * rowb, vp + r * kvd, (size_t)w * kvd);
        if (table && p + w <= c->max_keys) {
            cb_cpu_rope_apply(kp + r * kvd, w, nkv, hd, rope->type, c->rope_cs + (size_t)p * hd);
        } else {
            for (int j = 0; j < w; j++) {
                int32_t pj = p + j;
                cb_cpu_rope(kp + (r + (size_t)j) * kvd, 1, nkv, &pj, rope);
            }
        }
    }
    return 0;
}

static int cpu_kv_read(void *ctx, int layer, const cb_kv_table_t *t, int pos0, int n, float *k, float *v) {
    cpu_ctx_t *c = ctx;
    if (!c->kpool || layer < 0 || layer >= c->n_layer || pos0 < 0 || n < 0 || pos0 > t->n_pos - n) return -1;
    uint8_t *kp = pool_layer(c, c->kpool, layer), *vp = pool_layer(c, c->vpool, layer);
    const size_t kvd = (size_t)c->kvd;
    for (int i = 0; i < n; i++) {
        size_t r = pool_row(c, t, pos0 + i);
        if (k) cb_cpu_kv_to_f32(c->dtype, pool_at(c, kp, r), k + (size_t)i * kvd, kvd);
        if (v) cb_cpu_kv_to_f32(c->dtype, pool_at(c, vp, r), v + (size_t)i * kvd, kvd);
    }
    return 0;
}

/* ---------------------------------------------------------------- CacheBlend operations */

static int cpu_attn_mass(void *ctx, const cb_attn_geom_t *g, const float *q, int n, int layer, const cb_kv_table_t *t,
                         const int32_t *key_limit, float *mass, float *out) {
    cpu_ctx_t *c = ctx;
    if (!c->kpool || layer < 0 || layer >= c->n_layer || g->n_head_kv != c->geom.n_head_kv ||
        g->n_head != c->geom.n_head || g->head_dim != c->geom.head_dim)
        return -1;
    for (int i = 0; i < n; i++)
        if (key_limit[i] < 1 || key_limit[i] > t->n_pos || key_limit[i] > c->max_keys) return -1;
    cb_cpu_kv_t kv = kv_view(c, layer, t);
    cb_cpu_attn_mass(g, q, n, &kv, key_limit, mass, out, c->mass_scratch, c->pool);
    return 0;
}

static int cpu_kv_deviation(void *ctx, int n, int width, const float *fresh, const void *const *cached,
                            cb_kv_dtype_t dtype, double *dev) {
    cpu_ctx_t *c = ctx;
    if (width > c->max_cols) return -1;
    return cb_cpu_kv_deviation(n, width, fresh, cached, dtype, dev, c->mm.rows); /* the compute thread's */
}

static int cpu_topk(void *ctx, int n, const double *score, int k, int32_t *out) {
    cpu_ctx_t *c = ctx;
    if (n < 0 || n > c->max_keys) return -1;
    cb_cpu_topk(n, score, k, out, c->topk_idx);
    return 0;
}

static void cpu_compact_rows(void *ctx, float *x, size_t row_len, const int32_t *keep, int n_keep) {
    (void)ctx;
    cb_cpu_compact_rows(x, row_len, keep, n_keep);
}

static void *cpu_host_alloc(void *ctx, size_t bytes) {
    (void)ctx;
    return cb_cpu_alloc_huge(bytes, true);
}

static void cpu_host_free(void *ctx, void *p) {
    (void)ctx;
    free(p);
}

static void cpu_matmul(void *ctx, const cb_weight_t *w, const float *x, int n, float *y, int ldy) {
    cpu_ctx_t *c = ctx;
    if (n <= CB_CPU_MATVEC_MAX_ROWS)
        cb_cpu_matvec(w, x, n, y, ldy, &c->mm, c->pool);
    else
        cb_cpu_gemm(w, x, n, y, ldy, &c->mm, c->pool);
}

static void cpu_matmul_multi(void *ctx, const cb_matmul_part_t *parts, int n_parts, const float *x, int n) {
    cpu_ctx_t *c = ctx;
    cb_cpu_matmul_multi(parts, n_parts, x, n, n > CB_CPU_MATVEC_MAX_ROWS, &c->mm, c->pool);
}

/* Decode batches: matvec for any n (each row with its own accumulators: what n = 1 gives it). */
static void cpu_matmul_rowwise(void *ctx, const cb_matmul_part_t *parts, int n_parts, const float *x, int n) {
    cpu_ctx_t *c = ctx;
    cb_cpu_matmul_multi(parts, n_parts, x, n, false, &c->mm, c->pool);
}

typedef struct {
    const float *x, *w;
    float *y;
    int dim, rows_per_task, n;
    float eps;
} rms_job_t;

static void rms_task(void *arg, int t, int thread) {
    (void)thread;
    const rms_job_t *j = arg;
    int r0 = t * j->rows_per_task, r1 = r0 + j->rows_per_task < j->n ? r0 + j->rows_per_task : j->n;
    cb_cpu_rmsnorm(j->x + (size_t)r0 * j->dim, j->w, r1 - r0, j->dim, j->eps, j->y + (size_t)r0 * j->dim);
}

static void cpu_rmsnorm(void *ctx, const float *x, const float *w, int n, int dim, float eps, float *y) {
    cpu_ctx_t *c = ctx;
    if (n < 16 || c->nt == 1) {
        cb_cpu_rmsnorm(x, w, n, dim, eps, y);
        return;
    }
    rms_job_t j = {x, w, y, dim, (n + 4 * c->nt - 1) / (4 * c->nt), n, eps};
    cb_pool_run(c->pool, (n + j.rows_per_task - 1) / j.rows_per_task, rms_task, &j);
}

static void cpu_rope(void *ctx, float *x, int n, int n_heads, const int32_t *pos, const cb_rope_t *r) {
    cpu_ctx_t *c = ctx;
    const int hd = r->n_dims;
    bool table = cb_rope_equal(r, &c->rope) && n <= c->max_rows;
    if (!table) {
        cb_cpu_rope(x, n, n_heads, pos, r);
        return;
    }
    for (int i = 0; i < n; i++) {
        float *dst = c->rope_rows + (size_t)i * hd;
        if (pos[i] >= 0 && pos[i] < c->max_keys)
            memcpy(dst, c->rope_cs + (size_t)pos[i] * hd, sizeof(float) * (size_t)hd);
        else
            cb_cpu_rope_coeffs(pos[i], r, dst);
    }
    cb_cpu_rope_apply(x, n, n_heads, hd, r->type, c->rope_rows);
}

static void cpu_add_bias(void *ctx, float *x, const float *b, int n, int dim) {
    (void)ctx;
    cb_cpu_add_bias(x, b, n, dim);
}

static void cpu_attention(void *ctx, const cb_attn_geom_t *g, const float *q, int n, int layer, const cb_kv_table_t *t,
                          const int32_t *key_limit, float *out) {
    cpu_ctx_t *c = ctx;
    cb_cpu_kv_t kv = kv_view(c, layer, t);
    cb_cpu_attention(g, q, n, &kv, key_limit, out, c->att_scratch, c->max_keys, c->pool);
}

static void cpu_attention_rows(void *ctx, const cb_attn_geom_t *g, const float *q, int n, int layer,
                               const cb_kv_table_t *t, const int32_t *key_limit, float *out) {
    cpu_ctx_t *c = ctx;
    cb_cpu_kv_t kv = kv_view(c, layer, NULL);
    cb_cpu_attention_rows(g, q, n, &kv, t, key_limit, out, c->att_scratch, c->max_keys, c->pool);
}

typedef struct {
    const float *gate, *up;
    float *out;
    size_t n, chunk;
    bool gelu;
} glu_job_t;

static void glu_task(void *arg, int t, int thread) {
    (void)thread;
    const glu_job_t *j = arg;
    size_t a = (size_t)t * j->chunk, b = a + j->chunk < j->n ? a + j->chunk : j->n;
    (j->gelu ? cb_cpu_geglu : cb_cpu_swiglu)(j->gate + a, j->up + a, b - a, j->out + a);
}

static void cpu_glu(cpu_ctx_t *c, const float *gate, const float *up, size_t n, float *out, bool gelu) {
    if (n < 32768 || c->nt == 1) {
        (gelu ? cb_cpu_geglu : cb_cpu_swiglu)(gate, up, n, out);
        return;
    }
    glu_job_t j = {gate, up, out, n, (n / (size_t)(4 * c->nt) + 15) / 16 * 16, gelu};
    cb_pool_run(c->pool, (int)((n + j.chunk - 1) / j.chunk), glu_task, &j);
}

static void cpu_swiglu(void *ctx, const float *gate, const float *up, size_t n, float *out) {
    cpu_glu(ctx, gate, up, n, out, false);
}

static void cpu_geglu(void *ctx, const float *gate, const float *up, size_t n, float *out) {
    cpu_glu(ctx, gate, up, n, out, true);
}

static void cpu_scale(void *ctx, float *x, size_t n, float a) {
    (void)ctx;
    cb_cpu_scale(x, n, a);
}

static void cpu_add(void *ctx, float *x, const float *y, size_t n) {
    (void)ctx;
    cb_cpu_add(x, y, n);
}

static void cpu_embed(void *ctx, const cb_weight_t *table, const int32_t *tokens, int n, float *x) {
    (void)ctx;
    cb_cpu_embed(table, tokens, n, x);
}

static void cpu_set_threads(void *ctx, int n_threads) {
    cpu_ctx_t *c = ctx;
    if (n_threads < 1) n_threads = 1;
    if (n_threads > c->scratch_nt) n_threads = c->scratch_nt; /* scratch was sized for scratch_nt */
    if (n_threads == c->nt) return;
    cb_pool_t *p = cb_pool_new(n_threads);
    if (!p) return; /* keep the old pool */
    cb_pool_destroy(&c->pool);
    c->pool = p;
    c->nt = n_threads;
}

/* The interleaved (or f32) copies of the model's weights, built by the first CPU backend over the model and
 * shared by the later ones (cb_weights_prepare). */
static int cpu_prepare_weights(void *ctx, cb_weights_t *ws, char *err, size_t errlen) {
    cpu_ctx_t *c = ctx;
    if (c->weights) {
        snprintf(err, errlen, "cpu backend: weights already prepared");
        return -1;
    }
    if (cb_weights_prepare(ws, "cpu", cb_cpu_weights_build, NULL, err, errlen) != 0) return -1;
    c->weights = ws;
    return 0;
}

static void cpu_destroy(void *ctx) {
    cpu_ctx_t *c = ctx;
    if (!c) return;
    cb_weights_release(c->weights);
    cb_pool_destroy(&c->pool);
    free(c->rope_cs);
    free(c->rope_rows);
    free(c->mm.rows);
    free(c->mm.xq);
    free(c->mm.tiles);
    free(c->att_scratch);
    free(c->mass_scratch);
    free(c->topk_idx);
    if (c->kpool) munmap(c->kpool, c->pool_map);
    if (c->vpool) munmap(c->vpool, c->pool_map);
    free(c);
}

static const cb_backend_ops_t CPU_OPS = {
    .name = "cpu",
    .prepare_weights = cpu_prepare_weights,
    .matmul = cpu_matmul,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .add_bias = cpu_add_bias,
    .attention = cpu_attention,
    .attention_rows = cpu_attention_rows,
    .swiglu = cpu_swiglu,
    .geglu = cpu_geglu,
    .scale = cpu_scale,
    .matmul_multi = cpu_matmul_multi,
    .matmul_rowwise = cpu_matmul_rowwise,
    .add = cpu_add,
    .embed = cpu_embed,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_host_free,
    .kv_pool_init = cpu_kv_pool_init,
    .kv_copy_block = cpu_kv_copy_block,
    .kv_write = cpu_kv_write,
    .kv_load = cpu_kv_load,
    .kv_load_q8_0 = true,
    .kv_read = cpu_kv_read,
    .attn_mass = cpu_attn_mass,
    .kv_deviation = cpu_kv_deviation,
    .topk = cpu_topk,
    .compact_rows = cpu_compact_rows,
    .set_threads = cpu_set_threads,
    .destroy = cpu_destroy,
};

cb_backend_t *cb_backend_cpu_new(const cb_hparams_t *hp, int max_rows, int max_keys, int n_threads, char *err,
                                 size_t errlen) {
    cb_cpu_init();
    if (max_rows < 1 || max_keys < 1) {
        snprintf(err, errlen, "backend: max_rows and max_keys must be >= 1");
        return NULL;
    }
    if (n_threads <= 0) n_threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n_threads < 1) n_threads = 1;
    if (n_threads > 256) n_threads = 256;
    cb_backend_t *be = cb_calloc(1, sizeof *be);
    cpu_ctx_t *c = cb_calloc(1, sizeof *c);
    if (!be || !c) goto oom;
    be->ops = &CPU_OPS;
    be->ctx = c;
    be->max_rows = max_rows;
    be->max_keys = max_keys;
    be->kv_value_bytes = 4;  /* f32 until kv_pool_init picks the pool's dtype */
    c->be = be;
    c->nt = c->scratch_nt = n_threads;
    c->max_rows = max_rows;
    c->max_keys = max_keys;
    c->rope_hd = hp->head_dim;
    c->rope = cb_hparams_rope(hp);
    if (c->rope.n_dims != hp->head_dim) {
        snprintf(err, errlen, "backend: partial rotary (%d of %d dims) is not supported", c->rope.n_dims, hp->head_dim);
        cpu_destroy(c);
        free(be);
        return NULL;
    }
    c->max_cols = hp->n_ff > hp->n_embd ? hp->n_ff : hp->n_embd;
    if (hp->n_head * hp->head_dim > c->max_cols) c->max_cols = hp->n_head * hp->head_dim;
    c->geom = (cb_attn_geom_t){hp->n_head, hp->n_head_kv, hp->head_dim, 0.0f, CB_ATTN_F32, 0};
    c->rope_cs = cb_cpu_alloc_huge(sizeof(float) * (size_t)max_keys * hp->head_dim, true);
    c->rope_rows = cb_malloc(sizeof(float) * (size_t)max_rows * hp->head_dim);
    c->mm = (cb_cpu_mm_scratch_t){.max_rows = max_rows, .max_cols = c->max_cols, .tile_floats = CB_CPU_TILE_FLOATS};
    if (c->mm.tile_floats < (size_t)c->max_cols) c->mm.tile_floats = (size_t)c->max_cols;
    c->mm.rows = cb_malloc(sizeof(float) * (size_t)n_threads * c->max_cols);
    c->mm.xq = cb_cpu_alloc_huge(cb_cpu_q8_row_bytes(c->max_cols) * (size_t)max_rows, false);
    c->mm.tiles = cb_cpu_alloc_huge(sizeof(float) * c->mm.tile_floats * (size_t)n_threads, false);
    c->att_scratch = cb_cpu_alloc_huge(sizeof(float) * cb_cpu_attention_scratch(&c->geom, max_rows, max_keys, n_threads), true);
    c->pool = cb_pool_new(n_threads);
    c->geom.scale = 1.0f / sqrtf((float)hp->head_dim);
    c->mass_scratch = cb_malloc(sizeof(float) * cb_cpu_attn_mass_scratch(&c->geom, max_keys));
    c->topk_idx = cb_malloc(sizeof(int32_t) * (size_t)max_keys);
    if (!c->mass_scratch || !c->topk_idx) goto oom;
    if (!c->rope_cs || !c->rope_rows || !c->mm.rows || !c->mm.xq || !c->mm.tiles || !c->att_scratch || !c->pool) goto oom;
    for (int p = 0; p < max_keys; p++)
        cb_cpu_rope_coeffs(p, &c->rope, c->rope_cs + (size_t)p * hp->head_dim);
    return be;
oom:
    snprintf(err, errlen, "backend: out of memory");
    cpu_destroy(c);
    free(be);
    return NULL;
}
