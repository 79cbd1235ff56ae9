/* cpu_backend.c: the CPU backend's table (wrapping kernels/cpu/cpu_ops.c) and backend-independent helpers.
 *
 * The CPU context owns the scratch its kernels need (matvec row buffers, attention score blocks) and a
 * RoPE coefficient table for positions [0, max_keys) of the model's head_dim and base; positions
 * outside the table (or another base) are computed on the fly with the same formula, so results are
 * bit-identical either way.
 */
#include "cpu/cpu_backend.h"

#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu_ops.h"

typedef struct {
    int nt;                 /* threads (pool size) */
    cb_pool_t *pool;        /* nt - 1 workers + the caller */
    int max_rows, max_keys;
    int rope_hd;            /* head_dim the table was built for */
    float rope_base;
    float *rope_cs;         /* [max_keys][rope_hd] (cos, sin) pairs per position */
    float *rope_rows;       /* [max_rows][rope_hd] coefficients of the rows of one call */
    float *mv_scratch;      /* [nt][max_cols] matvec row buffers */
    int max_cols;
    float *att_scratch;     /* cb_cpu_attention_scratch floats */
    cb_attn_geom_t geom;    /* geometry the attention scratch was sized for */
    int scratch_nt;         /* threads the scratch was sized for */
} cpu_ctx_t;

static void cpu_matmul(void *ctx, const cb_weight_t *w, const float *x, int n, float *y, int ldy) {
    cpu_ctx_t *c = ctx;
    if (n <= CB_CPU_MATVEC_MAX_ROWS || !w->f32) {
        for (int i = 0; i < n; i += CB_CPU_MATVEC_MAX_ROWS) {
            int k = n - i < CB_CPU_MATVEC_MAX_ROWS ? n - i : CB_CPU_MATVEC_MAX_ROWS;
            cb_cpu_matvec(w, x + (size_t)i * w->cols, k, y + (size_t)i * ldy, ldy, c->mv_scratch, c->pool);
        }
    } else {
        cb_cpu_gemm(w, x, n, y, ldy, c->pool);
    }
}

static void cpu_matmul_multi(void *ctx, const cb_matmul_part_t *parts, int n_parts, const float *x, int n) {
    cpu_ctx_t *c = ctx;
    bool gemm = n > CB_CPU_MATVEC_MAX_ROWS;
    for (int p = 0; p < n_parts; p++) gemm = gemm && parts[p].w->f32;
    if (gemm || n <= CB_CPU_MATVEC_MAX_ROWS) {
        cb_cpu_matmul_multi(parts, n_parts, x, n, gemm, c->mv_scratch, c->pool);
        return;
    }
    for (int p = 0; p < n_parts; p++) cpu_matmul(ctx, parts[p].w, x, n, parts[p].y, parts[p].ldy);
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

static void cpu_rope(void *ctx, float *x, int n, int n_heads, int head_dim, const int32_t *pos, float base) {
    cpu_ctx_t *c = ctx;
    bool table = head_dim == c->rope_hd && base == c->rope_base && n <= c->max_rows;
    if (!table) {
        cb_cpu_rope(x, n, n_heads, head_dim, pos, base);
        return;
    }
    for (int i = 0; i < n; i++) {
        float *dst = c->rope_rows + (size_t)i * head_dim;
        if (pos[i] >= 0 && pos[i] < c->max_keys)
            memcpy(dst, c->rope_cs + (size_t)pos[i] * head_dim, sizeof(float) * (size_t)head_dim);
        else
            cb_cpu_rope_coeffs(pos[i], head_dim, base, dst);
    }
    cb_cpu_rope_apply(x, n, n_heads, head_dim, c->rope_rows);
}

static void cpu_attention(void *ctx, const cb_attn_geom_t *g, const float *q, int n, const float *kc,
                          const float *vc, const int32_t *key_limit, float *out) {
    cpu_ctx_t *c = ctx;
    cb_cpu_attention(g, q, n, kc, vc, key_limit, out, c->att_scratch, c->max_keys, c->pool);
}

typedef struct {
    const float *gate, *up;
    float *out;
    size_t n, chunk;
} swiglu_job_t;

static void swiglu_task(void *arg, int t, int thread) {
    (void)thread;
    const swiglu_job_t *j = arg;
    size_t a = (size_t)t * j->chunk, b = a + j->chunk < j->n ? a + j->chunk : j->n;
    cb_cpu_swiglu(j->gate + a, j->up + a, b - a, j->out + a);
}

static void cpu_swiglu(void *ctx, const float *gate, const float *up, size_t n, float *out) {
    cpu_ctx_t *c = ctx;
    if (n < 32768 || c->nt == 1) {
        cb_cpu_swiglu(gate, up, n, out);
        return;
    }
    swiglu_job_t j = {gate, up, out, n, (n / (size_t)(4 * c->nt) + 15) / 16 * 16};
    cb_pool_run(c->pool, (int)((n + j.chunk - 1) / j.chunk), swiglu_task, &j);
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

static void cpu_destroy(void *ctx) {
    cpu_ctx_t *c = ctx;
    if (!c) return;
    cb_pool_destroy(&c->pool);
    free(c->rope_cs);
    free(c->rope_rows);
    free(c->mv_scratch);
    free(c->att_scratch);
    free(c);
}

static const cb_backend_ops_t CPU_OPS = {
    .name = "cpu",
    .matmul = cpu_matmul,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .attention = cpu_attention,
    .swiglu = cpu_swiglu,
    .matmul_multi = cpu_matmul_multi,
    .add = cpu_add,
    .embed = cpu_embed,
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
    cb_backend_t *be = calloc(1, sizeof *be);
    cpu_ctx_t *c = calloc(1, sizeof *c);
    if (!be || !c) goto oom;
    be->ops = &CPU_OPS;
    be->ctx = c;
    be->max_rows = max_rows;
    be->max_keys = max_keys;
    c->nt = c->scratch_nt = n_threads;
    c->max_rows = max_rows;
    c->max_keys = max_keys;
    c->rope_hd = hp->head_dim;
    c->rope_base = hp->rope_base;
    c->max_cols = hp->n_ff > hp->n_embd ? hp->n_ff : hp->n_embd;
    if (hp->n_head * hp->head_dim > c->max_cols) c->max_cols = hp->n_head * hp->head_dim;
    c->geom = (cb_attn_geom_t){hp->n_head, hp->n_head_kv, hp->head_dim, 0.0f};
    c->rope_cs = cb_cpu_alloc_huge(sizeof(float) * (size_t)max_keys * hp->head_dim, true);
    c->rope_rows = malloc(sizeof(float) * (size_t)max_rows * hp->head_dim);
    c->mv_scratch = malloc(sizeof(float) * (size_t)n_threads * c->max_cols);
    c->att_scratch = cb_cpu_alloc_huge(sizeof(float) * cb_cpu_attention_scratch(&c->geom, max_rows, max_keys, n_threads), true);
    c->pool = cb_pool_new(n_threads);
    if (!c->rope_cs || !c->rope_rows || !c->mv_scratch || !c->att_scratch || !c->pool) goto oom;
    for (int p = 0; p < max_keys; p++)
        cb_cpu_rope_coeffs(p, hp->head_dim, hp->rope_base, c->rope_cs + (size_t)p * hp->head_dim);
    return be;
oom:
    snprintf(err, errlen, "backend: out of memory");
    cpu_destroy(c);
    free(be);
    return NULL;
}
