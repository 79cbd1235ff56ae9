/* backend: the table of operations the engine runs, so that a CUDA backend can slot in behind the
 * same calls as the CPU one (STYLE.md habit 10, REFERENCE.md §12.2).
 *
 * A backend is a struct of function pointers (cb_backend_ops_t) plus a context. All buffers passed to
 * the operations live where the backend computes (host memory for the CPU backend); shapes are in the
 * comments. The CPU backend (kernels/cpu/cpu_ops.c) computes in f32 and is the reference: other
 * backends are tested against it within tolerances.
 *
 * Operations never allocate: whatever scratch they need is reserved when the backend is created for a
 * maximum number of rows per call and keys per attention row.
 */
#ifndef CB_BACKEND_H
#define CB_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

/* Attention geometry (GQA: query head h reads KV head h / (n_head / n_head_kv)). */
typedef struct {
    int n_head, n_head_kv, head_dim;
    float scale;            /* usually 1/sqrt(head_dim) */
} cb_attn_geom_t;

/* One output of matmul_multi. */
typedef struct {
    const cb_weight_t *w;
    float *y;               /* [n][ldy] */
    int ldy;
} cb_matmul_part_t;

typedef struct {
    const char *name;
    /* y[i][o] = sum_j x[i][j] w[o][j]:  x [n][w->cols], y [n][ldy] (ldy >= w->rows); n <= max_rows. */
    void (*matmul)(void *ctx, const cb_weight_t *w, const float *x, int n, float *y, int ldy);
    /* y = x / sqrt(mean(x^2) + eps) * w per row:  x, y [n][dim] (may alias), w [dim]. */
    void (*rmsnorm)(void *ctx, const float *x, const float *w, int n, int dim, float eps, float *y);
    /* NORM RoPE in place:  x [n][n_heads*head_dim], pos [n] (any positions >= 0), base = rope base. */
    void (*rope)(void *ctx, float *x, int n, int n_heads, int head_dim, const int32_t *pos, float base);
    /* out[i] = softmax(q[i] K[0:key_limit[i])ᵀ · scale) V per head:  q, out [n][n_head*head_dim];
     * kc, vc [>= max key_limit][n_head_kv*head_dim]; key_limit [n] in 1..max_keys. */
    void (*attention)(void *ctx, const cb_attn_geom_t *g, const float *q, int n, const float *kc,
                      const float *vc, const int32_t *key_limit, float *out);
    /* out = silu(gate) * up elementwise over n (out may alias either input). */
    void (*swiglu)(void *ctx, const float *gate, const float *up, size_t n, float *out);
    /* x += y elementwise over n. */
    void (*add)(void *ctx, float *x, const float *y, size_t n);
    /* x[i] = row tokens[i] of table (dequantized):  x [n][table->cols]; tokens already validated. */
    void (*embed)(void *ctx, const cb_weight_t *table, const int32_t *tokens, int n, float *x);
    /* Optional (NULL: the engine calls matmul once per part): the products of one x with several
     * weights (Q|K|V, gate|up) in one call, so a backend can schedule them together. Each part is
     * y [n][ldy] = x [n][w->cols] · wᵀ, all parts with the same cols. */
    void (*matmul_multi)(void *ctx, const cb_matmul_part_t *parts, int n_parts, const float *x, int n);
    /* Threads used by later calls (>= 1). */
    void (*set_threads)(void *ctx, int n_threads);
    void (*destroy)(void *ctx);
} cb_backend_ops_t;

typedef struct {
    const cb_backend_ops_t *ops;
    void *ctx;
    int max_rows;           /* rows per call the scratch was sized for */
    int max_keys;           /* keys per attention row */
} cb_backend_t;

/* Destroys a backend of any kind (ops->destroy), nulls *self_p; NULL-safe. (Constructors: cb_backend_select in
 * engine/backend_select.h; kernels/cpu/cpu_backend.h and kernels/cuda/cb_cuda_backend.h build one kind.) */
void cb_backend_destroy(cb_backend_t **self_p);

#endif
