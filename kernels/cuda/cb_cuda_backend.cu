/* cb_cuda_backend.cu: the CUDA instance of backend.h's table (see cb_cuda_backend.h): each operation copies
 * its host inputs to device scratch, converts f32 -> bf16, runs the cb_cuda kernel and copies the result
 * back as f32. Scratch is allocated once at creation for max_rows rows and max_keys keys. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unordered_map>

#include "cuda/cb_cuda.h"
#include "cuda/cb_cuda_backend.h"

namespace {

struct be_ctx {
    cb_cuda_t *cu;
    int max_rows, max_keys, kvd, max_dim;
    size_t cap_in, cap_out;   /* elements of the input / output scratch */
    float *d_in, *d_in2;      /* f32 [cap_in] */
    cb_bf16_t *b_in, *b_in2;  /* bf16 [cap_in] */
    float *d_out;             /* f32 [cap_out] */
    cb_bf16_t *b_out;         /* bf16 [cap_out] */
    float *d_w;               /* f32 [max_dim] norm weights */
    int32_t *d_i;             /* int32 [max_rows] tokens, positions, limits */
    float *d_kv;              /* f32 [max_keys][kvd] staging */
    cb_bf16_t *b_k, *b_v;     /* bf16 [max_keys][kvd] */
    std::unordered_map<const void *, cb_bf16_t *> *wcache;
    bool failed;
};

#define BE(ctx) ((be_ctx *)(ctx))

bool be_fail(be_ctx *c, const char *what) {
    if (!c->failed) fprintf(stderr, "cuda backend: %s failed: %s\n", what, cb_cuda_error(c->cu));
    c->failed = true;
    return false;
}
#define TRYB(x) do { if (c->failed || (x) != 0) { be_fail(c, #x); goto bad; } } while (0)

void nan_fill(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = NAN;
}

/* Host f32 [n] -> device bf16 via the f32 staging buffer. */
int up_bf16(be_ctx *c, const float *h, size_t n, float *stage, cb_bf16_t *dst) {
    int rc = cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, stage, h, n * sizeof(float));
    if (!rc) rc = cb_cuda_convert(c->cu, stage, CB_CUDA_F32, dst, CB_CUDA_BF16, n);
    return rc;
}

/* Device bf16 [n] -> host f32 through d_out. */
int down_f32(be_ctx *c, const cb_bf16_t *src, size_t n, float *h) {
    int rc = cb_cuda_convert(c->cu, src, CB_CUDA_BF16, c->d_out, CB_CUDA_F32, n);
    if (!rc) rc = cb_cuda_d2h(c->cu, h, c->d_out, n * sizeof(float));
    return rc;
}

/* The bf16 device copy of a weight, uploaded on first use. */
const cb_bf16_t *weight(be_ctx *c, const cb_weight_t *w) {
    auto it = c->wcache->find(w->q);
    if (it != c->wcache->end()) return it->second;
    size_t n = (size_t)w->rows * (size_t)w->cols;
    cb_bf16_t *d = (cb_bf16_t *)cb_cuda_malloc(c->cu, n * 2);
    if (!d) return NULL;
    if (cb_cuda_upload_weights(c->cu, w->type, w->q, n, d, CB_CUDA_BF16) != 0) {
        cb_cuda_free(c->cu, d);
        return NULL;
    }
    (*c->wcache)[w->q] = d;
    return d;
}

void be_matmul(void *ctx, const cb_weight_t *w, const float *x, int n, float *y, int ldy) {
    be_ctx *c = BE(ctx);
    const size_t nin = (size_t)n * w->cols, nout = (size_t)n * w->rows;
    const cb_bf16_t *dw = NULL;
    if (n < 1 || nin > c->cap_in || nout > c->cap_out || ldy < w->rows) {
        fprintf(stderr, "cuda backend: matmul of %d x %d x %d exceeds the scratch\n", n, w->rows, w->cols);
        c->failed = true;
        goto bad;
    }
    dw = weight(c, w);
    if (!dw) { be_fail(c, "weight upload"); goto bad; }
    TRYB(up_bf16(c, x, nin, c->d_in, c->b_in));
    TRYB(cb_cuda_gemm(c->cu, n, w->rows, w->cols, c->b_in, w->cols, dw, w->cols, c->d_out, CB_CUDA_F32, w->rows, 0.0f));
    TRYB(cb_cuda_copy_2d(c->cu, CB_CUDA_STREAM_COMPUTE, y, (size_t)ldy * 4, c->d_out, (size_t)w->rows * 4,
                         (size_t)w->rows * 4, (size_t)n));
    TRYB(cb_cuda_sync(c->cu));
    return;
bad:
    for (int i = 0; i < n; i++) nan_fill(y + (size_t)i * ldy, (size_t)w->rows);
}

void be_rmsnorm(void *ctx, const float *x, const float *w, int n, int dim, float eps, float *y) {
    be_ctx *c = BE(ctx);
    const size_t ne = (size_t)n * dim;
    if (n < 1 || ne > c->cap_in || dim > c->max_dim) { c->failed = true; goto bad; }
    TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_in, x, ne * 4));
    TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_w, w, (size_t)dim * 4));
    TRYB(cb_cuda_rmsnorm(c->cu, n, dim, c->d_in, dim, NULL, c->d_w, eps, c->b_out, dim));
    TRYB(down_f32(c, c->b_out, ne, y));
    return;
bad:
    nan_fill(y, ne);
}

void be_rope(void *ctx, float *x, int n, int n_heads, int head_dim, const int32_t *pos, float base) {
    be_ctx *c = BE(ctx);
    const size_t ne = (size_t)n * n_heads * head_dim;
    if (n < 1 || ne > c->cap_in || n > c->max_rows) { c->failed = true; goto bad; }
    TRYB(up_bf16(c, x, ne, c->d_in, c->b_in));
    TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_i, pos, (size_t)n * 4));
    TRYB(cb_cuda_rope(c->cu, n, n_heads, head_dim, c->b_in, n_heads * head_dim, c->b_in, n_heads * head_dim, c->d_i, 0,
                      base));
    TRYB(down_f32(c, c->b_in, ne, x));
    return;
bad:
    nan_fill(x, ne);
}

void be_attention(void *ctx, const cb_attn_geom_t *g, const float *q, int n, const float *kc, const float *vc,
                  const int32_t *key_limit, float *out) {
    be_ctx *c = BE(ctx);
    const int qd = g->n_head * g->head_dim, kvd = g->n_head_kv * g->head_dim;
    const size_t nq = (size_t)n * qd;
    int maxlim = 0;
    for (int i = 0; i < n; i++) maxlim = key_limit[i] > maxlim ? key_limit[i] : maxlim;
    if (n < 1 || n > c->max_rows || nq > c->cap_in || nq > c->cap_out || maxlim > c->max_keys || kvd > c->kvd) {
        c->failed = true;
        goto bad;
    }
    {
        const size_t nkv = (size_t)maxlim * kvd;
        if (nkv) {
            TRYB(up_bf16(c, kc, nkv, c->d_kv, c->b_k));
            TRYB(up_bf16(c, vc, nkv, c->d_kv, c->b_v));
        }
        TRYB(up_bf16(c, q, nq, c->d_in, c->b_in));
        TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_i, key_limit, (size_t)n * 4));
        cb_cuda_attn_t a;
        memset(&a, 0, sizeof a);
        a.q = c->b_in, a.ldq = qd, a.k = c->b_k, a.v = c->b_v, a.ldkv = kvd, a.out = c->b_out, a.ldo = qd;
        a.limit = c->d_i, a.limit_add = 0, a.n_q = n, a.n_kv = maxlim, a.n_heads = g->n_head;
        a.n_kv_heads = g->n_head_kv, a.head_dim = g->head_dim, a.max_limit = maxlim, a.scale = g->scale;
        TRYB(cb_cuda_attention(c->cu, &a, CB_CUDA_ATTN_AUTO));
        TRYB(down_f32(c, c->b_out, nq, out));
    }
    return;
bad:
    nan_fill(out, nq);
}

void be_swiglu(void *ctx, const float *gate, const float *up, size_t n, float *out) {
    be_ctx *c = BE(ctx);
    if (n < 1 || n > c->cap_in || n > 0x7fffffff) { c->failed = true; goto bad; }
    TRYB(up_bf16(c, gate, n, c->d_in, c->b_in));
    TRYB(up_bf16(c, up, n, c->d_in2, c->b_in2));
    TRYB(cb_cuda_swiglu(c->cu, 1, (int)n, c->b_in, c->b_in2, (int)n, c->b_out, (int)n));
    TRYB(down_f32(c, c->b_out, n, out));
    return;
bad:
    nan_fill(out, n);
}

void be_add(void *ctx, float *x, const float *y, size_t n) {
    be_ctx *c = BE(ctx);
    if (n < 1 || n > c->cap_in || n > 0x7fffffff) { c->failed = true; goto bad; }
    TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_in, x, n * 4));
    TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_in2, y, n * 4));
    TRYB(cb_cuda_add(c->cu, 1, (int)n, c->d_in, (int)n, c->d_in2, CB_CUDA_F32, (int)n));
    TRYB(cb_cuda_d2h(c->cu, x, c->d_in, n * 4));
    return;
bad:
    nan_fill(x, n);
}

void be_embed(void *ctx, const cb_weight_t *table, const int32_t *tokens, int n, float *x) {
    be_ctx *c = BE(ctx);
    const size_t ne = (size_t)n * table->cols;
    const cb_bf16_t *dt = NULL;
    if (n < 1 || n > c->max_rows || ne > c->cap_out) { c->failed = true; goto bad; }
    dt = weight(c, table);
    if (!dt) { be_fail(c, "embedding upload"); goto bad; }
    TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_i, tokens, (size_t)n * 4));
    TRYB(cb_cuda_embed(c->cu, c->d_i, n, dt, table->rows, table->cols, c->d_out));
    TRYB(cb_cuda_d2h(c->cu, x, c->d_out, ne * 4));
    return;
bad:
    nan_fill(x, ne);
}

void be_set_threads(void *ctx, int n_threads) {
    (void)ctx;
    (void)n_threads;
}

void be_destroy(void *ctx) {
    be_ctx *c = BE(ctx);
    if (!c) return;
    if (c->cu) {
        if (c->wcache)
            for (auto &kv : *c->wcache) cb_cuda_free(c->cu, kv.second);
        cb_cuda_destroy(&c->cu);   /* frees the scratch too */
    }
    delete c->wcache;
    free(c);
}

cb_backend_ops_t make_ops() {
    cb_backend_ops_t o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.matmul = be_matmul;
    o.rmsnorm = be_rmsnorm;
    o.rope = be_rope;
    o.attention = be_attention;
    o.swiglu = be_swiglu;
    o.add = be_add;
    o.embed = be_embed;
    o.set_threads = be_set_threads;
    o.destroy = be_destroy;
    return o;
}
const cb_backend_ops_t CUDA_OPS = make_ops();

} // namespace

extern "C" cb_backend_t *cb_backend_cuda_new(const cb_hparams_t *hp, int max_rows, int max_keys, int device, char *err,
                                             size_t errlen) {
    if (!hp || max_rows < 1 || max_keys < 1) {
        snprintf(err, errlen, "cuda backend: bad arguments");
        return NULL;
    }
    be_ctx *c = (be_ctx *)calloc(1, sizeof *c);
    cb_backend_t *be = (cb_backend_t *)calloc(1, sizeof *be);
    if (!c || !be) {
        free(c);
        free(be);
        snprintf(err, errlen, "cuda backend: out of host memory");
        return NULL;
    }
    c->wcache = new std::unordered_map<const void *, cb_bf16_t *>();
    c->cu = cb_cuda_new(device, err, errlen);
    if (!c->cu) {
        be_destroy(c);
        free(be);
        return NULL;
    }
    const int qd = hp->n_head * hp->head_dim;
    c->kvd = hp->n_head_kv * hp->head_dim;
    c->max_rows = max_rows;
    c->max_keys = max_keys;
    c->max_dim = hp->n_embd > hp->n_ff ? hp->n_embd : hp->n_ff;
    if (qd > c->max_dim) c->max_dim = qd;
    c->cap_in = (size_t)max_rows * c->max_dim;
    c->cap_out = c->cap_in > (size_t)hp->n_vocab ? c->cap_in : (size_t)hp->n_vocab;
    if ((size_t)max_rows * (size_t)hp->n_embd > c->cap_out) c->cap_out = (size_t)max_rows * hp->n_embd;
    const size_t kv = (size_t)max_keys * c->kvd;
    bool ok = (c->d_in = (float *)cb_cuda_malloc(c->cu, c->cap_in * 4)) && (c->d_in2 = (float *)cb_cuda_malloc(c->cu, c->cap_in * 4)) &&
              (c->b_in = (cb_bf16_t *)cb_cuda_malloc(c->cu, c->cap_in * 2)) &&
              (c->b_in2 = (cb_bf16_t *)cb_cuda_malloc(c->cu, c->cap_in * 2)) &&
              (c->d_out = (float *)cb_cuda_malloc(c->cu, c->cap_out * 4)) &&
              (c->b_out = (cb_bf16_t *)cb_cuda_malloc(c->cu, c->cap_out * 2)) &&
              (c->d_w = (float *)cb_cuda_malloc(c->cu, (size_t)c->max_dim * 4)) &&
              (c->d_i = (int32_t *)cb_cuda_malloc(c->cu, (size_t)max_rows * 4)) &&
              (c->d_kv = (float *)cb_cuda_malloc(c->cu, kv * 4)) && (c->b_k = (cb_bf16_t *)cb_cuda_malloc(c->cu, kv * 2)) &&
              (c->b_v = (cb_bf16_t *)cb_cuda_malloc(c->cu, kv * 2));
    if (!ok) {
        snprintf(err, errlen, "cuda backend: %s", cb_cuda_error(c->cu));
        be_destroy(c);
        free(be);
        return NULL;
    }
    be->ops = &CUDA_OPS;
    be->ctx = c;
    be->max_rows = max_rows;
    be->max_keys = max_keys;
    return be;
}

extern "C" bool cb_backend_cuda_failed(const cb_backend_t *be) {
    return be && be->ops == &CUDA_OPS && ((const be_ctx *)be->ctx)->failed;
}
