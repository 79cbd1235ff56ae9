/* engine.c: run state, KV cache and the llama forward pass as a composition of layer-stage
 * primitives over a backend (see engine.h). Owns every buffer below; borrows the model.
 */
#include "engine/engine.h"

#include <assert.h>
#include <math.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/backend_select.h"
#include "cpu/cpu_ops.h"
#include "base/log.h"

struct cb_engine {
    const cb_model_t *model;
    const cb_hparams_t *hp;
    cb_backend_t *be;
    cb_attn_geom_t geom;
    int max_ctx, max_rows, nt, nt_max; /* threads in use; most the scratch allows */
    int E, QD, KVD, F;       /* n_embd, n_head*head_dim, n_head_kv*head_dim, n_ff */

    float *kcache;           /* [n_layer][max_ctx][KVD] post-RoPE K */
    float *vcache;           /* [n_layer][max_ctx][KVD] V */

    /* prefill composition (cb_engine_prefill only) */
    float *x;                /* [max_rows][E] residual stream */
    float *q;                /* [max_rows][QD] */
    float *k;                /* [max_rows][KVD] */
    float *v;                /* [max_rows][KVD] */
    int32_t *pos;            /* [max_rows] positions of the ubatch */
    int32_t *limit;          /* [max_rows] key limits (pos + 1) */

    /* primitives' private scratch (never handed out) */
    float *xb;               /* [max_rows][E] normed input; also the logits row's norm */
    float *att;              /* [max_rows][QD] attention output */
    float *proj;             /* [max_rows][E] o_proj / down_proj output */
    float *gate;             /* [max_rows][F] gate, then silu(gate) * up */
    float *up;               /* [max_rows][F] */
};

static int env_threads(void) {
    const char *s = getenv("CB_THREADS");
    if (s && *s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (*end == 0 && v >= 1 && v <= 256) return (int)v;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 256 ? 256 : (int)n;
}

cb_engine_t *cb_engine_new(const cb_model_t *model, int max_ctx, char *err, size_t errlen) {
    char berr[128] = "";
    if (!model) {
        snprintf(err, errlen, "engine: no model");
        return NULL;
    }
    if (max_ctx < 1 || max_ctx > (1 << 20)) {
        snprintf(err, errlen, "engine: max_ctx %d out of range 1..%d", max_ctx, 1 << 20);
        return NULL;
    }
    cb_engine_t *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(err, errlen, "engine: out of memory");
        return NULL;
    }
    const cb_hparams_t *hp = cb_model_hparams(model);
    e->model = model;
    e->hp = hp;
    e->max_ctx = max_ctx;
    e->max_rows = CB_ENGINE_MAX_ROWS;
    e->nt = env_threads();
    e->nt_max = e->nt > (int)sysconf(_SC_NPROCESSORS_ONLN) ? e->nt : (int)sysconf(_SC_NPROCESSORS_ONLN);
    e->E = hp->n_embd;
    e->QD = hp->n_head * hp->head_dim;
    e->KVD = hp->n_head_kv * hp->head_dim;
    e->F = hp->n_ff;
    e->geom = (cb_attn_geom_t){hp->n_head, hp->n_head_kv, hp->head_dim, 1.0f / sqrtf((float)hp->head_dim)};
    e->be = cb_backend_select(cb_backend_default_kind(), hp, e->max_rows, max_ctx, e->nt_max, NULL, berr, sizeof berr);
    if (!e->be) {
        snprintf(err, errlen, "engine: %s", berr);
        goto fail;
    }
    e->be->ops->set_threads(e->be->ctx, e->nt);
    const size_t R = (size_t)e->max_rows, kv = (size_t)hp->n_layer * max_ctx * e->KVD;
    e->kcache = cb_cpu_alloc_huge(sizeof(float) * kv, true);
    e->vcache = cb_cpu_alloc_huge(sizeof(float) * kv, true);
    e->x = cb_cpu_alloc_huge(sizeof(float) * R * e->E, true);
    e->q = cb_cpu_alloc_huge(sizeof(float) * R * e->QD, true);
    e->k = cb_cpu_alloc_huge(sizeof(float) * R * e->KVD, true);
    e->v = cb_cpu_alloc_huge(sizeof(float) * R * e->KVD, true);
    e->pos = calloc(R, sizeof(int32_t));
    e->limit = calloc(R, sizeof(int32_t));
    e->xb = cb_cpu_alloc_huge(sizeof(float) * R * e->E, true);
    e->att = cb_cpu_alloc_huge(sizeof(float) * R * e->QD, true);
    e->proj = cb_cpu_alloc_huge(sizeof(float) * R * e->E, true);
    e->gate = cb_cpu_alloc_huge(sizeof(float) * R * e->F, true);
    e->up = cb_cpu_alloc_huge(sizeof(float) * R * e->F, true);
    if (!e->kcache || !e->vcache || !e->x || !e->q || !e->k || !e->v || !e->pos || !e->limit || !e->xb ||
        !e->att || !e->proj || !e->gate || !e->up) {
        snprintf(err, errlen, "engine: out of memory (KV cache %zu MB for %d positions)",
                 2 * sizeof(float) * kv >> 20, max_ctx);
        goto fail;
    }
    return e;
fail:
    cb_engine_destroy(&e);
    return NULL;
}

void cb_engine_destroy(cb_engine_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_engine_t *e = *self_p;
    cb_backend_destroy(&e->be);
    free(e->kcache);
    free(e->vcache);
    free(e->x);
    free(e->q);
    free(e->k);
    free(e->v);
    free(e->pos);
    free(e->limit);
    free(e->xb);
    free(e->att);
    free(e->proj);
    free(e->gate);
    free(e->up);
    free(e);
    *self_p = NULL;
}

void cb_engine_set_threads(cb_engine_t *self, int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > self->nt_max) n_threads = self->nt_max;
    self->be->ops->set_threads(self->be->ctx, n_threads);
    self->nt = n_threads;
}
int cb_engine_threads(const cb_engine_t *self) { return self->nt; }
int cb_engine_max_ctx(const cb_engine_t *self) { return self->max_ctx; }
int cb_engine_max_rows(const cb_engine_t *self) { return self->max_rows; }
const cb_model_t *cb_engine_model(const cb_engine_t *self) { return self->model; }

float *cb_engine_kcache(cb_engine_t *self, int layer) {
    assert(layer >= 0 && layer < self->hp->n_layer);
    return self->kcache + (size_t)layer * self->max_ctx * self->KVD;
}
float *cb_engine_vcache(cb_engine_t *self, int layer) {
    assert(layer >= 0 && layer < self->hp->n_layer);
    return self->vcache + (size_t)layer * self->max_ctx * self->KVD;
}

/* ---------------------------------------------------------------- primitives */

/* Several products of the same x: one backend call when it offers matmul_multi. */
static void matmul_parts(cb_engine_t *e, const cb_matmul_part_t *parts, int n_parts, const float *x, int n) {
    if (e->be->ops->matmul_multi) {
        e->be->ops->matmul_multi(e->be->ctx, parts, n_parts, x, n);
        return;
    }
    for (int p = 0; p < n_parts; p++) e->be->ops->matmul(e->be->ctx, parts[p].w, x, n, parts[p].y, parts[p].ldy);
}

void cb_engine_embed(cb_engine_t *self, const int32_t *tokens, int n, float *x) {
    assert(n >= 0 && n <= self->max_rows);
    self->be->ops->embed(self->be->ctx, cb_model_tok_embd(self->model), tokens, n, x);
}

void cb_engine_layer_qkv(cb_engine_t *self, int layer, const float *x, int n, float *q, float *k, float *v) {
    assert(n >= 1 && n <= self->max_rows);
    const cb_backend_ops_t *ops = self->be->ops;
    void *ctx = self->be->ctx;
    const cb_layer_weights_t *L = cb_model_layer(self->model, layer);
    assert(L);
    ops->rmsnorm(ctx, x, L->attn_norm, n, self->E, self->hp->rms_eps, self->xb);
    cb_matmul_part_t parts[3] = {{&L->wq, q, self->QD}, {&L->wk, k, self->KVD}, {&L->wv, v, self->KVD}};
    matmul_parts(self, parts, 3, self->xb, n);
}

void cb_engine_layer_attn_mlp(cb_engine_t *self, int layer, float *x, const float *q, int n,
                              const int32_t *key_limit) {
    assert(n >= 1 && n <= self->max_rows);
    const cb_backend_ops_t *ops = self->be->ops;
    void *ctx = self->be->ctx;
    const cb_layer_weights_t *L = cb_model_layer(self->model, layer);
    assert(L);
    const size_t nE = (size_t)n * self->E;
    ops->attention(ctx, &self->geom, q, n, cb_engine_kcache(self, layer), cb_engine_vcache(self, layer), key_limit,
                   self->att);
    ops->matmul(ctx, &L->wo, self->att, n, self->proj, self->E);
    ops->add(ctx, x, self->proj, nE);
    ops->rmsnorm(ctx, x, L->ffn_norm, n, self->E, self->hp->rms_eps, self->xb);
    cb_matmul_part_t parts[2] = {{&L->w_gate, self->gate, self->F}, {&L->w_up, self->up, self->F}};
    matmul_parts(self, parts, 2, self->xb, n);
    ops->swiglu(ctx, self->gate, self->up, (size_t)n * self->F, self->gate);
    ops->matmul(ctx, &L->w_down, self->gate, n, self->proj, self->E);
    ops->add(ctx, x, self->proj, nE);
}

void cb_engine_logits(cb_engine_t *self, const float *x_row, float *logits) {
    const cb_backend_ops_t *ops = self->be->ops;
    ops->rmsnorm(self->be->ctx, x_row, cb_model_output_norm(self->model), 1, self->E, self->hp->rms_eps, self->xb);
    const cb_weight_t *w = cb_model_output(self->model);
    ops->matmul(self->be->ctx, w, self->xb, 1, logits, w->rows);
}

void cb_rope(float *x, int n, int n_heads, int head_dim, const int32_t *pos, float base) {
    cb_cpu_rope(x, n, n_heads, head_dim, pos, base);
}

/* ---------------------------------------------------------------- prefill / decode */

/* One ubatch of n <= max_rows rows at positions pos0.. (validated by the caller). */
static void forward_ubatch(cb_engine_t *e, const int32_t *tokens, int n, int pos0, float *logits) {
    const cb_hparams_t *hp = e->hp;
    const cb_backend_ops_t *ops = e->be->ops;
    for (int i = 0; i < n; i++) {
        e->pos[i] = pos0 + i;
        e->limit[i] = pos0 + i + 1;
    }
    cb_engine_embed(e, tokens, n, e->x);
    for (int l = 0; l < hp->n_layer; l++) {
        cb_engine_layer_qkv(e, l, e->x, n, e->q, e->k, e->v);
        ops->rope(e->be->ctx, e->q, n, hp->n_head, hp->head_dim, e->pos, hp->rope_base);
        ops->rope(e->be->ctx, e->k, n, hp->n_head_kv, hp->head_dim, e->pos, hp->rope_base);
        /* rows pos0..pos0+n-1 are contiguous in the cache */
        memcpy(cb_engine_kcache(e, l) + (size_t)pos0 * e->KVD, e->k, sizeof(float) * (size_t)n * e->KVD);
        memcpy(cb_engine_vcache(e, l) + (size_t)pos0 * e->KVD, e->v, sizeof(float) * (size_t)n * e->KVD);
        cb_engine_layer_attn_mlp(e, l, e->x, e->q, n, e->limit);
    }
    if (logits) cb_engine_logits(e, e->x + (size_t)(n - 1) * e->E, logits);
}

int cb_engine_prefill(cb_engine_t *self, const int32_t *tokens, int n, int pos0, float *logits) {
    if (!self || !tokens || n < 1 || pos0 < 0 || pos0 > self->max_ctx - n) return -1;
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= self->hp->n_vocab) return -1;
    for (int i = 0; i < n; i += self->max_rows) {
        int k = n - i < self->max_rows ? n - i : self->max_rows;
        forward_ubatch(self, tokens + i, k, pos0 + i, i + k == n ? logits : NULL);
    }
    return 0;
}

int cb_engine_decode(cb_engine_t *self, int32_t token, int pos, float *logits) {
    return cb_engine_prefill(self, &token, 1, pos, logits);
}
