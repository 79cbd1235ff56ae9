/* cb_cuda_backend.cu: the CUDA instance of backend.h's table (see cb_cuda_backend.h).
 *
 * Dense operations copy their host inputs to device scratch, convert f32 -> bf16, run the cb_cuda kernel
 * and copy the result back as f32 (add, add_bias and scale stay f32). RoPE takes the layer's cb_rope_t
 * (pairing, base, linear scaling, frequency factors, the last uploaded once per tensor); kv_load's
 * re-rotation of pre-RoPE K runs the same kernel with the same descriptor. The KV pool lives on the device
 * (bf16, [n_layer][n_blocks][bt][kv_dim] for K and the same for V): writes and layer loads scatter into it,
 * attention and attention mass read it in place (consecutive blocks) or through one device-to-device
 * gather of the table's blocks. Under a sliding window (cb_attn_geom_t.window) they read only the blocks
 * from the one holding the call's lowest first key (cb_attn_key_lo) up to its largest limit, and the
 * kernels mask each row to its own keys [lo, limit). Everything runs on the context's compute stream and
 * every operation ends synchronized (its outputs, or its inputs read, before it returns), under one mutex
 * (the blend's loader thread calls kv_load). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <new>
#include <unordered_map>

#include <cuda_runtime.h>

#include "cpu/cpu_ops.h"   /* the host-side CacheBlend operations, shared with the CPU backend */
#include "cuda/cb_cuda.h"
#include "cuda/cb_cuda_backend.h"

namespace {

struct be_ctx {
    std::mutex mu;                 /* one operation at a time (cb_cuda_t is single-threaded) */
    cb_cuda_t *cu = nullptr;
    int device = 0;
    int max_rows = 0, max_keys = 0, kvd = 0, max_dim = 0, n_head = 0, n_head_kv = 0, head_dim = 0;
    size_t cap_in = 0, cap_out = 0;    /* elements of the input / output scratch */
    float *d_in = nullptr, *d_in2 = nullptr;      /* f32 [cap_in] (also raw bytes of a layer load) */
    cb_bf16_t *b_in = nullptr, *b_in2 = nullptr;  /* bf16 [cap_in] */
    float *d_out = nullptr;                       /* f32 [cap_out] */
    cb_bf16_t *b_out = nullptr;                   /* bf16 [cap_out] */
    float *d_w = nullptr;                         /* f32 [max_dim] norm weights */
    int32_t *d_i = nullptr;                       /* int32 [max_rows] tokens, positions, limits */
    float *d_mass = nullptr;                      /* f32 [max_keys] attention mass of one call */
    float *h_mass = nullptr;                      /* host [max_keys] */
    int32_t *topk_idx = nullptr;                  /* host [max_keys] */
    float *dev_row = nullptr;                     /* host [kvd] one cached row as f32 (kv_deviation) */
    /* the KV pool (kv_pool_init) */
    int n_layer = 0, bt = 0, n_blocks = 0;
    size_t plane = 0;                             /* elements of one layer: n_blocks * bt * kvd */
    cb_bf16_t *pool_k = nullptr, *pool_v = nullptr;  /* [n_layer][n_blocks][bt][kvd] */
    int g_blocks = 0;                             /* ceil(max_keys / bt) */
    cb_bf16_t *g_k = nullptr, *g_v = nullptr;     /* gather scratch [g_blocks * bt][kvd] */
    int idx_cap = 0;
    int32_t *d_idx = nullptr;                     /* device [idx_cap] block ids / pool rows */
    int32_t *h_idx = nullptr;                     /* host (pageable: h2d copies it before returning) */
    std::unordered_map<const void *, cb_bf16_t *> wcache;   /* weight storage address -> bf16 copy */
    /* RoPE frequency factors (cb_rope_t.freq_factors, a host tensor of the model) -> device f32 [n] copy */
    struct ff_copy { float *d; int n; };
    std::unordered_map<const float *, ff_copy> ffcache;
    bool failed = false;
};

#define BE(ctx) ((be_ctx *)(ctx))

/* Locks the context for one operation and makes its device current on the calling thread (the loader
 * thread's current device is not necessarily ours). */
struct be_lock {
    std::lock_guard<std::mutex> g;
    explicit be_lock(be_ctx *c) : g(c->mu) {
        int cur = -1;
        if (cudaGetDevice(&cur) != cudaSuccess || cur != c->device) cudaSetDevice(c->device);
    }
};

bool be_fail(be_ctx *c, const char *what) {
    if (!c->failed) fprintf(stderr, "cuda backend: %s failed: %s\n", what, cb_cuda_error(c->cu));
    c->failed = true;
    return false;
}
/* void operations: jump to `bad` (NaN outputs) on a failed call or an earlier failure */
#define TRYB(x) do { if (c->failed || (x) != 0) { be_fail(c, #x); goto bad; } } while (0)
/* int operations: -1 on a failed call (the backend is then marked failed) */
#define TRYI(x) do { if ((x) != 0) { be_fail(c, #x); return -1; } } while (0)

void nan_fill(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = NAN;
}

/* Host f32 [n] -> device bf16 via the f32 staging buffer. */
int up_bf16(be_ctx *c, const float *h, size_t n, float *stage, cb_bf16_t *dst) {
    int rc = cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, stage, h, n * sizeof(float));
    if (!rc) rc = cb_cuda_convert(c->cu, stage, CB_CUDA_F32, dst, CB_CUDA_BF16, n);
    return rc;
}

/* Device bf16 [n] -> host f32 through f32 scratch f (>= n). Returns after the copy (d2h waits). */
int down_f32(be_ctx *c, const cb_bf16_t *src, size_t n, float *f, float *h) {
    int rc = cb_cuda_convert(c->cu, src, CB_CUDA_BF16, f, CB_CUDA_F32, n);
    if (!rc) rc = cb_cuda_d2h(c->cu, h, f, n * sizeof(float));
    return rc;
}

/* The bf16 device copy of a weight, uploaded on first use. */
const cb_bf16_t *weight(be_ctx *c, const cb_weight_t *w) {
    auto it = c->wcache.find(w->q);
    if (it != c->wcache.end()) return it->second;
    size_t n = (size_t)w->rows * (size_t)w->cols;
    cb_bf16_t *d = (cb_bf16_t *)cb_cuda_malloc(c->cu, n * 2);
    if (!d) return NULL;
    if (cb_cuda_upload_weights(c->cu, w->type, w->q, n, d, CB_CUDA_BF16) != 0) {
        cb_cuda_free(c->cu, d);
        return NULL;
    }
    c->wcache[w->q] = d;
    return d;
}

/* True when r is a rotation the kernel takes for heads of head_dim values: NORM or NEOX pairing, n_dims =
 * head_dim (even, > 0), base and freq_scale finite and > 0. */
bool rope_ok(const cb_rope_t *r, int head_dim) {
    return r && (r->type == CB_ROPE_NORM || r->type == CB_ROPE_NEOX) && r->n_dims == head_dim && head_dim > 0 &&
           head_dim % 2 == 0 && r->base > 0.0f && !std::isinf(r->base) && r->freq_scale > 0.0f &&
           !std::isinf(r->freq_scale);
}

/* r (checked by rope_ok) as cb_cuda_rope takes it. Its frequency factors, a host tensor [n_dims/2] of the
 * model, get a device copy on first use, cached by their address like the weights (so the model must
 * outlive the backend); later calls allocate and copy nothing. */
int rope_dev(be_ctx *c, const cb_rope_t *r, cb_cuda_rope_t *out) {
    out->mode = r->type == CB_ROPE_NEOX ? CB_CUDA_ROPE_NEOX : CB_CUDA_ROPE_NORM;
    out->base = r->base;
    out->freq_scale = r->freq_scale;
    out->freq_factors = NULL;
    if (!r->freq_factors) return 0;
    const int half = r->n_dims / 2;
    auto it = c->ffcache.find(r->freq_factors);
    if (it != c->ffcache.end()) {
        if (it->second.n != half) return -1;   /* the same tensor read as another head size */
        out->freq_factors = it->second.d;
        return 0;
    }
    float *d = (float *)cb_cuda_malloc(c->cu, (size_t)half * sizeof(float));
    if (!d) return -1;
    /* pageable source: staged, in compute-stream order before the kernels that read it */
    int rc = cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, d, r->freq_factors, (size_t)half * sizeof(float));
    if (rc != 0) {
        cb_cuda_free(c->cu, d);
        return rc;
    }
    c->ffcache[r->freq_factors] = {d, half};
    out->freq_factors = d;
    return 0;
}

/* ------------------------------------------------------------------ dense operations */

/* One upload of x for several weights (Q|K|V, gate|up), the parts' GEMMs and copies back in stream order;
 * rows go in pieces that fit the output scratch (the LM head of a decode batch: n x n_vocab). */
void be_matmul_multi(void *ctx, const cb_matmul_part_t *parts, int n_parts, const float *x, int n) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    const int cols = n_parts > 0 ? parts[0].w->cols : 0;
    size_t piece = n > 0 && cols > 0 ? c->cap_in / (size_t)cols : 0; /* rows per upload */
    bool ok = n >= 1 && n_parts >= 1 && cols > 0;
    for (int p = 0; ok && p < n_parts; p++) {
        ok = parts[p].w->cols == cols && parts[p].ldy >= parts[p].w->rows;
        if (ok) piece = std::min(piece, c->cap_out / (size_t)parts[p].w->rows);
    }
    if (!ok || piece < 1) {
        fprintf(stderr, "cuda backend: matmul of %d parts x %d rows does not fit the scratch\n", n_parts, n);
        c->failed = true;
        goto bad;
    }
    for (int r0 = 0; r0 < n; r0 += (int)piece) {
        const int nr = (int)std::min(piece, (size_t)(n - r0));
        TRYB(up_bf16(c, x + (size_t)r0 * cols, (size_t)nr * cols, c->d_in, c->b_in));
        for (int p = 0; p < n_parts; p++) {
            const cb_weight_t *w = parts[p].w;
            const cb_bf16_t *dw = weight(c, w);
            if (!dw) { be_fail(c, "weight upload"); goto bad; }
            TRYB(cb_cuda_gemm(c->cu, nr, w->rows, cols, c->b_in, cols, dw, cols, c->d_out, CB_CUDA_F32, w->rows, 0.0f));
            TRYB(cb_cuda_copy_2d(c->cu, CB_CUDA_STREAM_COMPUTE, parts[p].y + (size_t)r0 * parts[p].ldy,
                                 (size_t)parts[p].ldy * 4, c->d_out, (size_t)w->rows * 4, (size_t)w->rows * 4,
                                 (size_t)nr));
        }
        TRYB(cb_cuda_sync(c->cu)); /* d_out and b_in are reused by the next piece */
    }
    return;
bad:
    for (int p = 0; p < n_parts && n > 0; p++)
        for (int i = 0; i < n; i++) nan_fill(parts[p].y + (size_t)i * parts[p].ldy, (size_t)parts[p].w->rows);
}

void be_matmul(void *ctx, const cb_weight_t *w, const float *x, int n, float *y, int ldy) {
    const cb_matmul_part_t part = {w, y, ldy};
    be_matmul_multi(ctx, &part, 1, x, n);
}

void be_rmsnorm(void *ctx, const float *x, const float *w, int n, int dim, float eps, float *y) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    const size_t ne = (size_t)(n > 0 ? n : 0) * dim;
    if (n < 1 || ne > c->cap_in || ne > c->cap_out || dim > c->max_dim) { c->failed = true; goto bad; }
    TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_in, x, ne * 4));
    TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_w, w, (size_t)dim * 4));
    TRYB(cb_cuda_rmsnorm(c->cu, n, dim, c->d_in, dim, NULL, c->d_w, eps, c->b_out, dim));
    TRYB(down_f32(c, c->b_out, ne, c->d_out, y));
    return;
bad:
    nan_fill(y, ne);
}

void be_rope(void *ctx, float *x, int n, int n_heads, const int32_t *pos, const cb_rope_t *r) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    const int hd = r ? r->n_dims : 0;   /* rotated dims of a head: x is [n][n_heads * hd] */
    const size_t ne = (size_t)(n > 0 ? n : 0) * (size_t)(n_heads > 0 ? n_heads : 0) * (size_t)(hd > 0 ? hd : 0);
    cb_cuda_rope_t cr;
    if (n < 1 || n_heads < 1 || !rope_ok(r, hd) || !pos || ne > c->cap_in || ne > c->cap_out || n > c->max_rows) {
        c->failed = true;
        goto bad;
    }
    TRYB(rope_dev(c, r, &cr));
    TRYB(up_bf16(c, x, ne, c->d_in, c->b_in));
    TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_i, pos, (size_t)n * 4));
    TRYB(cb_cuda_rope(c->cu, n, n_heads, hd, c->b_in, n_heads * hd, c->b_in, n_heads * hd, c->d_i, 0, &cr));
    TRYB(down_f32(c, c->b_in, ne, c->d_out, x));
    return;
bad:
    nan_fill(x, ne);
}

/* In f32 (as add): x goes up in row pieces that fit the input scratch, b once into the second one. */
void be_add_bias(void *ctx, float *x, const float *b, int n, int dim) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    const size_t ne = (size_t)(n > 0 ? n : 0) * (size_t)(dim > 0 ? dim : 0);
    const int piece = dim > 0 ? (int)std::min(c->cap_in / (size_t)dim, (size_t)0x7fffffff) : 0; /* rows per upload */
    if (n < 1 || dim < 1 || piece < 1 || !b) { c->failed = true; goto bad; }
    TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_in2, b, (size_t)dim * 4));
    for (int r0 = 0; r0 < n; r0 += piece) {
        const int nr = std::min(piece, n - r0);
        float *xr = x + (size_t)r0 * dim;
        TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_in, xr, (size_t)nr * dim * 4));
        TRYB(cb_cuda_add(c->cu, nr, dim, c->d_in, dim, c->d_in2, CB_CUDA_F32, 0));
        TRYB(cb_cuda_d2h(c->cu, xr, c->d_in, (size_t)nr * dim * 4));   /* waits: d_in is free again */
    }
    return;
bad:
    nan_fill(x, ne);
}

void be_swiglu(void *ctx, const float *gate, const float *up, size_t n, float *out) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    if (n < 1 || n > c->cap_in || n > c->cap_out || n > 0x7fffffff) { c->failed = true; goto bad; }
    TRYB(up_bf16(c, gate, n, c->d_in, c->b_in));
    TRYB(up_bf16(c, up, n, c->d_in2, c->b_in2));
    TRYB(cb_cuda_swiglu(c->cu, 1, (int)n, c->b_in, c->b_in2, (int)n, c->b_out, (int)n));
    TRYB(down_f32(c, c->b_out, n, c->d_out, out));
    return;
bad:
    nan_fill(out, n);
}

void be_geglu(void *ctx, const float *gate, const float *up, size_t n, float *out) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    if (n < 1 || n > c->cap_in || n > c->cap_out || n > 0x7fffffff) { c->failed = true; goto bad; }
    TRYB(up_bf16(c, gate, n, c->d_in, c->b_in));
    TRYB(up_bf16(c, up, n, c->d_in2, c->b_in2));
    TRYB(cb_cuda_geglu(c->cu, 1, (int)n, c->b_in, c->b_in2, (int)n, c->b_out, (int)n));
    TRYB(down_f32(c, c->b_out, n, c->d_out, out));
    return;
bad:
    nan_fill(out, n);
}

/* In f32 (as add): one rounding of each product, the CPU's bits. */
void be_scale(void *ctx, float *x, size_t n, float a) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    if (n < 1 || n > c->cap_in) { c->failed = true; goto bad; }
    TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_in, x, n * 4));
    TRYB(cb_cuda_scale(c->cu, c->d_in, n, a));
    TRYB(cb_cuda_d2h(c->cu, x, c->d_in, n * 4));
    return;
bad:
    nan_fill(x, n);
}

void be_add(void *ctx, float *x, const float *y, size_t n) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
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
    be_lock lk(c);
    const size_t ne = (size_t)(n > 0 ? n : 0) * table->cols;
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

/* ------------------------------------------------------------------ host buffers */

void *be_host_alloc(void *ctx, size_t bytes) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    /* pinned (page-aligned, so 64-byte aligned): the copies of every operation DMA from/to it directly */
    void *p = cb_cuda_host_alloc(c->cu, bytes ? bytes : 1);
    if (p) memset(p, 0, bytes ? bytes : 1);
    return p;
}

void be_host_free(void *ctx, void *p) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    cb_cuda_host_free(c->cu, p);
}

/* ------------------------------------------------------------------ the KV pool */

cb_bf16_t *plane_k(be_ctx *c, int layer) { return c->pool_k + (size_t)layer * c->plane; }
cb_bf16_t *plane_v(be_ctx *c, int layer) { return c->pool_v + (size_t)layer * c->plane; }

int be_kv_pool_init(void *ctx, int n_layer, int kv_dim, int block_tokens, int n_blocks, cb_kv_dtype_t dtype, char *err,
                    size_t errlen) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    if (c->pool_k) {
        snprintf(err, errlen, "cuda backend: KV pool already initialised");
        return -1;
    }
    /* the pool is bf16: a 16-bit request (f16, bf16) gets it; f32 is the CPU backend's reference pool */
    if (dtype != CB_KV_F16 && dtype != CB_KV_BF16) {
        snprintf(err, errlen, "cuda backend: KV pool dtype %s not supported (the CUDA pool is bf16: engine.kv_dtype = "
                 "f16, or backend = cpu for an f32 pool)", cb_kv_dtype_name(dtype));
        return -1;
    }
    if (n_layer < 1 || block_tokens < 1 || n_blocks < 1 || kv_dim != c->kvd ||
        (long long)n_blocks * block_tokens > 0x7fffffffLL) {
        snprintf(err, errlen, "cuda backend: bad KV pool geometry (%d layers, kv_dim %d (model %d), %d blocks of %d)",
                 n_layer, kv_dim, c->kvd, n_blocks, block_tokens);
        return -1;
    }
    const size_t plane = (size_t)n_blocks * block_tokens * kv_dim;
    const size_t bytes = plane * (size_t)n_layer * sizeof(cb_bf16_t);
    const int g_blocks = (c->max_keys + block_tokens - 1) / block_tokens;
    const size_t g_elems = (size_t)g_blocks * block_tokens * kv_dim;
    const int idx_cap = std::max(std::max(g_blocks, c->max_rows), (int)(c->cap_in / (size_t)kv_dim));
    c->pool_k = (cb_bf16_t *)cb_cuda_malloc(c->cu, bytes);
    c->pool_v = c->pool_k ? (cb_bf16_t *)cb_cuda_malloc(c->cu, bytes) : NULL;
    if (!c->pool_k || !c->pool_v) {
        snprintf(err, errlen,
                 "cuda backend: the KV pool (%d blocks x %d positions x %d layers, K and V: 2 x %.2f GiB bf16) does not "
                 "fit the device: %s",
                 n_blocks, block_tokens, n_layer, (double)bytes / (1u << 30), cb_cuda_error(c->cu));
        goto fail;
    }
    c->g_k = (cb_bf16_t *)cb_cuda_malloc(c->cu, g_elems * 2);
    c->g_v = (cb_bf16_t *)cb_cuda_malloc(c->cu, g_elems * 2);
    c->d_idx = (int32_t *)cb_cuda_malloc(c->cu, (size_t)idx_cap * 4);
    c->h_idx = (int32_t *)malloc((size_t)idx_cap * 4);
    if (!c->g_k || !c->g_v || !c->d_idx || !c->h_idx) {
        snprintf(err, errlen, "cuda backend: KV gather scratch (2 x %.1f MB): %s", (double)g_elems * 2 / 1e6,
                 c->h_idx ? cb_cuda_error(c->cu) : "out of host memory");
        goto fail;
    }
    /* zeros: a row never written reads as 0, not as whatever the allocation held */
    if (cb_cuda_memset(c->cu, c->pool_k, 0, bytes) != 0 || cb_cuda_memset(c->cu, c->pool_v, 0, bytes) != 0 ||
        cb_cuda_sync(c->cu) != 0) {
        snprintf(err, errlen, "cuda backend: clearing the KV pool: %s", cb_cuda_error(c->cu));
        goto fail;
    }
    c->n_layer = n_layer;
    c->bt = block_tokens;
    c->n_blocks = n_blocks;
    c->plane = plane;
    c->g_blocks = g_blocks;
    c->idx_cap = idx_cap;
    return 0;
fail:
    cb_cuda_free(c->cu, c->pool_k), cb_cuda_free(c->cu, c->pool_v);
    cb_cuda_free(c->cu, c->g_k), cb_cuda_free(c->cu, c->g_v), cb_cuda_free(c->cu, c->d_idx);
    free(c->h_idx);
    c->pool_k = c->pool_v = c->g_k = c->g_v = NULL;
    c->d_idx = c->h_idx = NULL;
    return -1;
}

/* c->h_idx[i] = pool row (within a layer) of position pos[i] (pos != NULL) or pos0 + i; false when a
 * position is outside the table or the table names a block outside the pool. n <= idx_cap. */
bool table_rows(be_ctx *c, const cb_kv_table_t *t, const int32_t *pos, int pos0, int n) {
    if (!t || !t->blocks || n > c->idx_cap) return false;
    for (int i = 0; i < n; i++) {
        const int p = pos ? pos[i] : pos0 + i;
        if (p < 0 || p >= t->n_pos) return false;
        const int32_t b = t->blocks[p / c->bt];
        if (b < 0 || b >= c->n_blocks) return false;
        c->h_idx[i] = b * c->bt + p % c->bt;
    }
    return true;
}

/* Device K and V rows of positions [b0 * bt, n_keys) of a layer in position order, [n_keys - b0 * bt][kvd]
 * (row 0 = position b0 * bt): the pool itself when the table's blocks there are consecutive ids, else a
 * gather of whole blocks into g_k/g_v (device to device; the K/V never cross the host). n_keys in
 * 1..min(max_keys, t->n_pos), b0 a block below n_keys (0, or the block of a window's lowest first key). */
int kv_view(be_ctx *c, int layer, const cb_kv_table_t *t, int b0, int n_keys, const cb_bf16_t **k,
            const cb_bf16_t **v) {
    const int nb = (n_keys + c->bt - 1) / c->bt;   /* blocks b0..nb-1 */
    if (!t || !t->blocks || n_keys < 1 || n_keys > t->n_pos || nb > c->g_blocks || b0 < 0 || b0 >= nb) return -1;
    bool consecutive = true;
    for (int j = b0; j < nb; j++) {
        const int32_t b = t->blocks[j];
        if (b < 0 || b >= c->n_blocks) return -1;
        consecutive = consecutive && b == t->blocks[b0] + (j - b0);
        c->h_idx[j - b0] = b;
    }
    const size_t off = (size_t)t->blocks[b0] * c->bt * c->kvd, blk = (size_t)c->bt * c->kvd * 2;
    if (consecutive) {
        *k = plane_k(c, layer) + off;
        *v = plane_v(c, layer) + off;
        return 0;
    }
    TRYI(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_idx, c->h_idx, (size_t)(nb - b0) * 4));
    TRYI(cb_cuda_copy_rows(c->cu, nb - b0, blk, c->g_k, blk, NULL, plane_k(c, layer), blk, c->d_idx));
    TRYI(cb_cuda_copy_rows(c->cu, nb - b0, blk, c->g_v, blk, NULL, plane_v(c, layer), blk, c->d_idx));
    *k = c->g_k;
    *v = c->g_v;
    return 0;
}

int be_kv_copy_block(void *ctx, int dst, int src) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    if (!c->pool_k || c->failed || dst < 0 || src < 0 || dst >= c->n_blocks || src >= c->n_blocks) return -1;
    if (dst == src) return 0;
    /* one device copy per layer and half (a 2-D copy with the layer as pitch would exceed the driver's pitch
     * limit, 2^31 bytes, for a large pool); copy on write is rare: a shared partial block */
    const size_t blk = (size_t)c->bt * c->kvd;
    for (int l = 0; l < c->n_layer; l++) {
        cb_bf16_t *kp = plane_k(c, l), *vp = plane_v(c, l);
        TRYI(cb_cuda_d2d(c->cu, CB_CUDA_STREAM_COMPUTE, kp + (size_t)dst * blk, kp + (size_t)src * blk, blk * 2));
        TRYI(cb_cuda_d2d(c->cu, CB_CUDA_STREAM_COMPUTE, vp + (size_t)dst * blk, vp + (size_t)src * blk, blk * 2));
    }
    TRYI(cb_cuda_sync(c->cu));
    return 0;
}

int be_kv_write(void *ctx, int layer, const cb_kv_table_t *t, const int32_t *pos, int n, const float *k,
                const float *v) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    if (!c->pool_k || c->failed || layer < 0 || layer >= c->n_layer || n < 0 || !pos || !k || !v) return -1;
    const size_t rb = (size_t)c->kvd * 2;
    const int piece = (int)std::min(c->cap_in / (size_t)c->kvd, (size_t)c->idx_cap);
    for (int r0 = 0; r0 < n; r0 += piece) {
        const int nr = std::min(piece, n - r0);
        if (!table_rows(c, t, pos + r0, 0, nr)) return -1;
        const size_t ne = (size_t)nr * c->kvd;
        TRYI(up_bf16(c, k + (size_t)r0 * c->kvd, ne, c->d_in, c->b_in));
        TRYI(up_bf16(c, v + (size_t)r0 * c->kvd, ne, c->d_in2, c->b_in2));
        TRYI(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_idx, c->h_idx, (size_t)nr * 4));
        TRYI(cb_cuda_copy_rows(c->cu, nr, rb, plane_k(c, layer), rb, c->d_idx, c->b_in, rb, NULL));
        TRYI(cb_cuda_copy_rows(c->cu, nr, rb, plane_v(c, layer), rb, c->d_idx, c->b_in2, rb, NULL));
    }
    TRYI(cb_cuda_sync(c->cu));   /* k and v are read before the caller reuses them */
    return 0;
}

/* The raw rows (f32, f16 or bf16: the ggml type ids of the same dtypes) are copied to the device as they
 * are and converted there (cb_cuda_dequant), then K is rotated from position 0 to pos0 + i in bf16 by r,
 * with the kernel and arguments the rope operation uses. */
int be_kv_load(void *ctx, int layer, const cb_kv_table_t *t, int pos0, int n, const void *k, const void *v,
               cb_kv_dtype_t dtype, const cb_rope_t *r) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    if (!c->pool_k || c->failed || layer < 0 || layer >= c->n_layer || n < 0 || pos0 < 0 || !t ||
        pos0 > t->n_pos - n || !k || !v || !rope_ok(r, c->head_dim))
        return -1;
    const size_t esz = cb_kv_dtype_size(dtype), rb = (size_t)c->kvd * 2;
    if (!esz) return -1;
    cb_cuda_rope_t cr;
    TRYI(rope_dev(c, r, &cr));
    const int piece = (int)std::min(c->cap_in / (size_t)c->kvd, (size_t)c->idx_cap);
    for (int r0 = 0; r0 < n; r0 += piece) {
        const int nr = std::min(piece, n - r0);
        if (!table_rows(c, t, NULL, pos0 + r0, nr)) return -1;
        const size_t ne = (size_t)nr * c->kvd, off = (size_t)r0 * c->kvd * esz;
        TRYI(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_in, (const char *)k + off, ne * esz));
        TRYI(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_in2, (const char *)v + off, ne * esz));
        TRYI(cb_cuda_dequant(c->cu, (uint32_t)dtype, c->d_in, ne, c->b_in, CB_CUDA_BF16));
        TRYI(cb_cuda_dequant(c->cu, (uint32_t)dtype, c->d_in2, ne, c->b_in2, CB_CUDA_BF16));
        TRYI(cb_cuda_rope(c->cu, nr, c->n_head_kv, c->head_dim, c->b_in, c->kvd, c->b_in, c->kvd, NULL, pos0 + r0,
                          &cr));
        TRYI(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_idx, c->h_idx, (size_t)nr * 4));
        TRYI(cb_cuda_copy_rows(c->cu, nr, rb, plane_k(c, layer), rb, c->d_idx, c->b_in, rb, NULL));
        TRYI(cb_cuda_copy_rows(c->cu, nr, rb, plane_v(c, layer), rb, c->d_idx, c->b_in2, rb, NULL));
    }
    TRYI(cb_cuda_sync(c->cu));   /* the source (a memory-tier entry, a file mapping) may go after return */
    return 0;
}

int be_kv_read(void *ctx, int layer, const cb_kv_table_t *t, int pos0, int n, float *k, float *v) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    if (!c->pool_k || c->failed || layer < 0 || layer >= c->n_layer || n < 0 || pos0 < 0 || !t || pos0 > t->n_pos - n)
        return -1;
    const size_t rb = (size_t)c->kvd * 2;
    const int piece = (int)std::min(std::min(c->cap_out / (size_t)c->kvd, (size_t)c->g_blocks * c->bt),
                                    (size_t)c->idx_cap);
    for (int r0 = 0; r0 < n; r0 += piece) {
        const int nr = std::min(piece, n - r0);
        if (!table_rows(c, t, NULL, pos0 + r0, nr)) return -1;
        const size_t ne = (size_t)nr * c->kvd;
        TRYI(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_idx, c->h_idx, (size_t)nr * 4));
        for (int half = 0; half < 2; half++) {
            float *dst = half ? v : k;
            if (!dst) continue;
            TRYI(cb_cuda_copy_rows(c->cu, nr, rb, c->g_k, rb, NULL, half ? plane_v(c, layer) : plane_k(c, layer), rb,
                                   c->d_idx));
            TRYI(down_f32(c, c->g_k, ne, c->d_out, dst + (size_t)r0 * c->kvd));
        }
    }
    TRYI(cb_cuda_sync(c->cu));
    return 0;
}

/* ------------------------------------------------------------------ attention over the pool */

bool geom_ok(const be_ctx *c, const cb_attn_geom_t *g) {
    return g && g->n_head == c->n_head && g->n_head_kv == c->n_head_kv && g->head_dim == c->head_dim;
}

/* Largest key limit, or -1 when a limit is outside 1..min(max_keys, t->n_pos). */
int max_limit(const be_ctx *c, const cb_kv_table_t *t, const int32_t *key_limit, int n) {
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (key_limit[i] < 1 || key_limit[i] > c->max_keys || !t || key_limit[i] > t->n_pos) return -1;
        m = key_limit[i] > m ? key_limit[i] : m;
    }
    return m;
}

/* The first position of the call's key view: the start of the block holding the lowest first key of its
 * rows (cb_attn_key_lo; 0 without a window). Keys below it are seen by no row and never read. */
int view_first(const be_ctx *c, const cb_attn_geom_t *g, const int32_t *key_limit, int n) {
    int lo = 0x7fffffff;
    for (int i = 0; i < n; i++) lo = std::min(lo, cb_attn_key_lo(g, key_limit[i]));
    return n > 0 ? lo / c->bt * c->bt : 0;
}

/* The kernels' arguments for n rows of the layer's view [first, maxlim) (kv_view): limits shifted by -first,
 * so row i sees view rows [lo_i - first, key_limit[i] - first), the window rule giving the same lo there
 * (first <= every lo_i). */
void attn_args(const be_ctx *c, const cb_attn_geom_t *g, const cb_bf16_t *dk, const cb_bf16_t *dv, int n, int first,
               int maxlim, cb_bf16_t *out, cb_cuda_attn_t *a) {
    const int qd = c->n_head * c->head_dim;
    memset(a, 0, sizeof *a);
    a->q = c->b_in, a->ldq = qd, a->k = dk, a->v = dv, a->ldkv = c->kvd, a->out = out, a->ldo = qd;
    a->limit = c->d_i, a->limit_add = -first, a->n_q = n, a->n_kv = maxlim - first, a->n_heads = g->n_head;
    a->n_kv_heads = g->n_head_kv, a->head_dim = g->head_dim, a->max_limit = maxlim - first, a->scale = g->scale;
    a->window = g->window > 0 ? g->window : 0;
}

void be_attention(void *ctx, const cb_attn_geom_t *g, const float *q, int n, int layer, const cb_kv_table_t *t,
                  const int32_t *key_limit, float *out) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    const int qd = c->n_head * c->head_dim; /* g is checked against it below */
    const size_t nq = (size_t)(n > 0 ? n : 0) * qd;
    const int maxlim = n > 0 ? max_limit(c, t, key_limit, n) : -1;
    const cb_bf16_t *dk = NULL, *dv = NULL;
    int first = 0;
    if (n < 1 || n > c->max_rows || nq > c->cap_in || nq > c->cap_out || maxlim < 1 || !geom_ok(c, g) || !c->pool_k ||
        layer < 0 || layer >= c->n_layer) {
        if (!c->failed)
            fprintf(stderr, "cuda backend: attention of %d rows (layer %d, max key limit %d) is outside its limits\n",
                    n, layer, maxlim);
        c->failed = true;
        goto bad;
    }
    first = view_first(c, g, key_limit, n);
    TRYB(kv_view(c, layer, t, first / c->bt, maxlim, &dk, &dv));
    TRYB(up_bf16(c, q, nq, c->d_in, c->b_in));
    TRYB(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_i, key_limit, (size_t)n * 4));
    {
        cb_cuda_attn_t a;
        attn_args(c, g, dk, dv, n, first, maxlim, c->b_out, &a);
        TRYB(cb_cuda_attention(c->cu, &a, CB_CUDA_ATTN_AUTO));
    }
    TRYB(down_f32(c, c->b_out, nq, c->d_out, out));
    return;
bad:
    nan_fill(out, nq);
}

int be_attn_mass(void *ctx, const cb_attn_geom_t *g, const float *q, int n, int layer, const cb_kv_table_t *t,
                 const int32_t *key_limit, float *mass, float *out) {
    if (out && n > 0) be_attention(ctx, g, q, n, layer, t, key_limit, out); /* its own call (and lock); a failure
                                                                             marks the context, checked below */
    be_ctx *c = BE(ctx);
    be_lock lk(c);
    if (n == 0) return 0;
    const int qd = c->n_head * c->head_dim; /* g is checked against it below */
    const size_t nq = (size_t)(n > 0 ? n : 0) * qd;
    const int maxlim = n > 0 ? max_limit(c, t, key_limit, n) : -1;
    if (n < 0 || n > c->max_rows || nq > c->cap_in || maxlim < 1 || !geom_ok(c, g) || !c->pool_k || c->failed ||
        layer < 0 || layer >= c->n_layer || !mass)
        return -1;
    const cb_bf16_t *dk = NULL, *dv = NULL;
    const int first = view_first(c, g, key_limit, n);   /* keys below it get no mass */
    if (kv_view(c, layer, t, first / c->bt, maxlim, &dk, &dv) != 0) return -1;
    TRYI(up_bf16(c, q, nq, c->d_in, c->b_in));
    TRYI(cb_cuda_h2d(c->cu, CB_CUDA_STREAM_COMPUTE, c->d_i, key_limit, (size_t)n * 4));
    cb_cuda_attn_t a;
    attn_args(c, g, dk, dv, n, first, maxlim, NULL, &a);
    TRYI(cb_cuda_attn_mass(c->cu, &a, c->d_mass));
    TRYI(cb_cuda_d2h(c->cu, c->h_mass, c->d_mass, (size_t)(maxlim - first) * 4));
    for (int j = first; j < maxlim; j++) mass[j] += c->h_mass[j - first];   /* accumulated, as the table says */
    return 0;
}

/* ------------------------------------------------------------------ host-side CacheBlend operations
 *
 * kv_deviation, topk and compact_rows run on the host. Their inputs are host memory by the table's
 * contract (activations and scores are host buffers; the cached rows of kv_deviation are memory-tier
 * entries or KV file mappings), each is a few microseconds of arithmetic over n rows, and a device pass
 * would add two copies and a synchronization to move the same bytes. On the host they give the CPU
 * reference's results bit for bit (the same double accumulation in j order, the same order of ranks), so
 * which rows a blend selects does not depend on the backend beyond the fresh K/V it measured. */

int be_kv_deviation(void *ctx, int n, int width, const float *fresh, const void *const *cached, cb_kv_dtype_t dtype,
                    double *dev) {
    be_ctx *c = BE(ctx);   /* host only; dev_row is the compute thread's (the loader never calls this) */
    if (n < 0 || width < 0 || width > c->kvd || (n && (!fresh || !cached || !dev))) return -1;
    return cb_cpu_kv_deviation(n, width, fresh, cached, dtype, dev, c->dev_row);
}

int be_topk(void *ctx, int n, const double *score, int k, int32_t *out) {
    be_ctx *c = BE(ctx);
    be_lock lk(c);   /* topk_idx is the context's */
    if (n < 0 || n > c->max_keys || (k > 0 && n > 0 && (!score || !out))) return -1;
    cb_cpu_topk(n, score, k, out, c->topk_idx);
    return 0;
}

void be_compact_rows(void *ctx, float *x, size_t row_len, const int32_t *keep, int n_keep) {
    (void)ctx;   /* host only */
    cb_cpu_compact_rows(x, row_len, keep, n_keep);
}

/* ------------------------------------------------------------------ lifetime */

void be_set_threads(void *ctx, int n_threads) {
    (void)ctx;
    (void)n_threads;
}

void be_destroy(void *ctx) {
    be_ctx *c = BE(ctx);
    if (!c) return;
    if (c->cu) {
        for (auto &kv : c->wcache) cb_cuda_free(c->cu, kv.second);
        for (auto &kv : c->ffcache) cb_cuda_free(c->cu, kv.second.d);
        cb_cuda_destroy(&c->cu);   /* frees the scratch and the pool too */
    }
    free(c->h_mass);
    free(c->topk_idx);
    free(c->dev_row);
    free(c->h_idx);
    delete c;
}

cb_backend_ops_t make_ops() {
    cb_backend_ops_t o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    /* prepare_weights stays NULL: each weight is uploaded (dequantized to bf16) from its stored rows on first
     * use (weight()), so a CUDA run builds no host copies of the weights */
    o.matmul = be_matmul;
    o.rmsnorm = be_rmsnorm;
    o.rope = be_rope;
    o.add_bias = be_add_bias;
    o.attention = be_attention;
    o.swiglu = be_swiglu;
    o.geglu = be_geglu;
    o.scale = be_scale;
    o.add = be_add;
    o.embed = be_embed;
    o.matmul_multi = be_matmul_multi;
    /* matmul_rowwise and attention_rows stay NULL: cuBLAS picks its kernels by shape, so rows would not get
     * the bits of one-row calls; a decode batch runs through matmul_multi and one attention call per row */
    o.host_alloc = be_host_alloc;
    o.host_free = be_host_free;
    o.kv_pool_init = be_kv_pool_init;
    o.kv_copy_block = be_kv_copy_block;
    o.kv_write = be_kv_write;
    o.kv_load = be_kv_load;
    o.kv_read = be_kv_read;
    o.attn_mass = be_attn_mass;
    o.kv_deviation = be_kv_deviation;
    o.topk = be_topk;
    o.compact_rows = be_compact_rows;
    o.set_threads = be_set_threads;
    o.destroy = be_destroy;
    return o;
}
const cb_backend_ops_t CUDA_OPS = make_ops();

} // namespace

extern "C" cb_backend_t *cb_backend_cuda_new(const cb_hparams_t *hp, int max_rows, int max_keys, int device, char *err,
                                             size_t errlen) {
    if (!hp || max_rows < 1 || max_keys < 1 || hp->n_head < 1 || hp->n_head_kv < 1 || hp->head_dim < 2 ||
        hp->head_dim % 2 || hp->n_head % hp->n_head_kv || hp->head_dim > 256 || hp->n_head / hp->n_head_kv > 16) {
        snprintf(err, errlen, "cuda backend: bad arguments or a geometry its kernels do not take (head_dim <= 256, "
                              "even; n_head / n_head_kv <= 16)");
        return NULL;
    }
    be_ctx *c = new (std::nothrow) be_ctx();
    cb_backend_t *be = (cb_backend_t *)calloc(1, sizeof *be);
    if (!c || !be) {
        delete c;
        free(be);
        snprintf(err, errlen, "cuda backend: out of host memory");
        return NULL;
    }
    c->cu = cb_cuda_new(device, err, errlen);
    if (!c->cu) {
        be_destroy(c);
        free(be);
        return NULL;
    }
    c->device = device;
    const int qd = hp->n_head * hp->head_dim;
    c->n_head = hp->n_head;
    c->n_head_kv = hp->n_head_kv;
    c->head_dim = hp->head_dim;
    c->kvd = hp->n_head_kv * hp->head_dim;
    c->max_rows = max_rows;
    c->max_keys = max_keys;
    c->max_dim = hp->n_embd > hp->n_ff ? hp->n_embd : hp->n_ff;
    if (qd > c->max_dim) c->max_dim = qd;
    c->cap_in = (size_t)max_rows * c->max_dim;
    c->cap_out = c->cap_in > (size_t)hp->n_vocab ? c->cap_in : (size_t)hp->n_vocab;
    if ((size_t)max_rows * (size_t)hp->n_embd > c->cap_out) c->cap_out = (size_t)max_rows * hp->n_embd;
    bool ok = (c->d_in = (float *)cb_cuda_malloc(c->cu, c->cap_in * 4)) &&
              (c->d_in2 = (float *)cb_cuda_malloc(c->cu, c->cap_in * 4)) &&
              (c->b_in = (cb_bf16_t *)cb_cuda_malloc(c->cu, c->cap_in * 2)) &&
              (c->b_in2 = (cb_bf16_t *)cb_cuda_malloc(c->cu, c->cap_in * 2)) &&
              (c->d_out = (float *)cb_cuda_malloc(c->cu, c->cap_out * 4)) &&
              (c->b_out = (cb_bf16_t *)cb_cuda_malloc(c->cu, c->cap_out * 2)) &&
              (c->d_w = (float *)cb_cuda_malloc(c->cu, (size_t)c->max_dim * 4)) &&
              (c->d_i = (int32_t *)cb_cuda_malloc(c->cu, (size_t)max_rows * 4)) &&
              (c->d_mass = (float *)cb_cuda_malloc(c->cu, (size_t)max_keys * 4));
    if (!ok) {
        snprintf(err, errlen, "cuda backend: %s", cb_cuda_error(c->cu));
        be_destroy(c);
        free(be);
        return NULL;
    }
    c->h_mass = (float *)malloc((size_t)max_keys * 4);
    c->topk_idx = (int32_t *)malloc((size_t)max_keys * 4);
    c->dev_row = (float *)malloc((size_t)c->kvd * 4);
    if (!c->h_mass || !c->topk_idx || !c->dev_row) {
        snprintf(err, errlen, "cuda backend: out of host memory");
        be_destroy(c);
        free(be);
        return NULL;
    }
    be->ops = &CUDA_OPS;
    be->ctx = c;
    be->max_rows = max_rows;
    be->max_keys = max_keys;
    be->kv_value_bytes = 2;   /* bf16 pool */
    return be;
}

extern "C" bool cb_backend_cuda_failed(const cb_backend_t *be) {
    if (!be || be->ops != &CUDA_OPS) return false;
    be_ctx *c = (be_ctx *)be->ctx;
    std::lock_guard<std::mutex> g(c->mu);
    return c->failed;
}
