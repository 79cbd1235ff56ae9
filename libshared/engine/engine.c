/* engine.c: run state, the KV pool's block accounting, sequences, and the llama forward pass as a
 * composition of layer-stage primitives over a backend (see engine.h). Owns every buffer below and the
 * backend (which owns the pool's memory); borrows the model.
 *
 * Block accounting: refs[b] counts the sequences whose table holds block b (0 = free). A sequence that grows
 * takes the block after its last one when it is free, else the first run of free blocks long enough for the
 * whole growth, else the lowest free blocks: tables stay runs of consecutive blocks, which the kernels read
 * as one strided range (a break costs a gather of the attention tiles that span it).
 */
#include "engine/engine.h"
#include "base/alloc.h"

#include <assert.h>
#include <math.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/backend_select.h"
#include "base/err.h"
#include "base/log.h"

struct cb_seq {
    cb_engine_t *e;
    int32_t *blocks;         /* [max_blocks_per_seq] block table */
    int n_blocks;            /* blocks in the table */
};

struct cb_engine {
    const cb_model_t *model;
    const cb_hparams_t *hp;
    cb_backend_t *be;
    cb_attn_geom_t geom;
    cb_engine_attn_t attn;   /* asked for, DEFAULT resolved (geom.math is its backend arithmetic) */
    int max_ctx, max_rows, nt, nt_max; /* threads in use; most the scratch allows */
    int E, QD, KVD, F;       /* n_embd, n_head*head_dim, n_head_kv*head_dim, n_ff */

    /* the KV pool (memory in the backend) */
    cb_engine_kv_dtype_t kv_dtype; /* F16 or F32 (resolved) */
    int bt;                  /* positions per block */
    int n_blocks;            /* blocks in the pool */
    int seq_max_blocks;      /* ceil(max_ctx / bt): a sequence's largest table */
    size_t block_bytes;      /* K + V of every layer of one block */
    int32_t *refs;           /* [n_blocks] sequences holding each block */
    int32_t free_lo;         /* no block below it is free */
    int n_free, n_shared, n_seqs;

    /* prefill composition (cb_engine_prefill only) */
    float *x;                /* [max_rows][E] residual stream */
    float *q;                /* [max_rows][QD] */
    float *k;                /* [max_rows][KVD] */
    float *v;                /* [max_rows][KVD] */
    int32_t *pos;            /* [max_rows] positions of the ubatch */
    int32_t *limit;          /* [max_rows] key limits (pos + 1) */
    cb_kv_table_t *tables;   /* [max_rows] block tables of a decode batch's rows */
    int32_t *gather;         /* [seq_max_blocks] a gathered block table (cb_engine_layer_attn_mlp_blocks) */

    /* primitives' private scratch (never handed out) */
    float *xb;               /* [max_rows][E] normed input; also the logits row's norm */
    float *att;              /* [max_rows][QD] attention output */
    float *proj;             /* [max_rows][E] o_proj / down_proj output */
    float *gate;             /* [max_rows][F] gate, then silu(gate) * up */
    float *up;               /* [max_rows][F] */
};

const char *cb_engine_status_str(int status) {
    switch (status) {
    case CB_ENGINE_OK: return "ok";
    case CB_ENGINE_EINVAL: return "bad argument";
    case CB_ENGINE_EPOOL: return "KV pool exhausted";
    case CB_ENGINE_EBACKEND: return "backend failure";
    default: return "error";
    }
}

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

bool cb_engine_kv_dtype_parse(const char *s, cb_engine_kv_dtype_t *out) {
    if (!s) return false;
    cb_engine_kv_dtype_t d;
    if (!strcmp(s, "f16")) d = CB_ENGINE_KV_F16;
    else if (!strcmp(s, "f32")) d = CB_ENGINE_KV_F32;
    else if (!strcmp(s, "default")) d = CB_ENGINE_KV_DEFAULT;
    else return false;
    *out = d;
    return true;
}

const char *cb_engine_kv_dtype_name(cb_engine_kv_dtype_t dtype) {
    switch (dtype) {
    case CB_ENGINE_KV_DEFAULT: return "default";
    case CB_ENGINE_KV_F16: return "f16";
    case CB_ENGINE_KV_F32: return "f32";
    default: return "?";
    }
}

/* The pool dtype asked for: opts, else $CB_ENGINE_KV_DTYPE, else f16. false (err) for a bad value. */
static bool resolve_kv_dtype(cb_engine_kv_dtype_t asked, cb_engine_kv_dtype_t *out, char *err, size_t errlen) {
    if (asked == CB_ENGINE_KV_F16 || asked == CB_ENGINE_KV_F32) {
        *out = asked;
        return true;
    }
    if (asked != CB_ENGINE_KV_DEFAULT) {
        cb_set_err(err, errlen, "engine: kv_dtype %d is not f16 or f32", (int)asked);
        return false;
    }
    const char *s = getenv("CB_ENGINE_KV_DTYPE");
    cb_engine_kv_dtype_t d = CB_ENGINE_KV_F16;
    if (s && *s && !cb_engine_kv_dtype_parse(s, &d)) {
        cb_set_err(err, errlen, "engine: CB_ENGINE_KV_DTYPE = '%.32s': expected f16 or f32", s);
        return false;
    }
    *out = d == CB_ENGINE_KV_DEFAULT ? CB_ENGINE_KV_F16 : d;
    return true;
}

bool cb_engine_attn_parse(const char *s, cb_engine_attn_t *out) {
    if (!s) return false;
    if (!strcmp(s, "bf16")) *out = CB_ENGINE_ATTN_BF16;
    else if (!strcmp(s, "f32")) *out = CB_ENGINE_ATTN_F32;
    else if (!strcmp(s, "int16")) *out = CB_ENGINE_ATTN_INT16;
    else if (!strcmp(s, "auto")) *out = CB_ENGINE_ATTN_AUTO;
    else if (!strcmp(s, "default")) *out = CB_ENGINE_ATTN_DEFAULT;
    else return false;
    return true;
}

cb_attn_math_t cb_engine_attn_math(cb_engine_attn_t attn) {
    switch (attn) {
    case CB_ENGINE_ATTN_F32: return CB_ATTN_F32;
    case CB_ENGINE_ATTN_BF16: return CB_ATTN_BF16;
    case CB_ENGINE_ATTN_INT16: return CB_ATTN_I16;
    default: return CB_ATTN_AUTO;
    }
}

/* The attention arithmetic asked for: opts, else $CB_ENGINE_ATTN, else auto (*out: never DEFAULT). false
 * (err) for a bad value. */
static bool resolve_attn(cb_engine_attn_t asked, cb_engine_attn_t *out, char *err, size_t errlen) {
    if (asked < CB_ENGINE_ATTN_DEFAULT || asked > CB_ENGINE_ATTN_AUTO) {
        cb_set_err(err, errlen, "engine: attn %d is not auto, bf16, int16 or f32", (int)asked);
        return false;
    }
    const char *s = getenv("CB_ENGINE_ATTN");
    if (asked == CB_ENGINE_ATTN_DEFAULT && s && *s && !cb_engine_attn_parse(s, &asked)) {
        cb_set_err(err, errlen, "engine: CB_ENGINE_ATTN = '%.32s': expected auto, bf16, int16 or f32", s);
        return false;
    }
    *out = asked == CB_ENGINE_ATTN_DEFAULT ? CB_ENGINE_ATTN_AUTO : asked;
    return true;
}

static void *buf(cb_engine_t *e, size_t bytes) { return e->be->ops->host_alloc(e->be->ctx, bytes); }

cb_engine_t *cb_engine_new_opts(const cb_model_t *model, const cb_engine_opts_t *o, char *err, size_t errlen) {
    char berr[128] = "";
    if (!model || !o) {
        cb_set_err(err, errlen, "engine: no model");
        return NULL;
    }
    const int max_ctx = o->max_ctx, bt = o->block_tokens ? o->block_tokens : CB_ENGINE_BLOCK_TOKENS;
    if (max_ctx < 1 || max_ctx > (1 << 20)) {
        cb_set_err(err, errlen, "engine: max_ctx %d out of range 1..%d", max_ctx, 1 << 20);
        return NULL;
    }
    if (bt < 1 || bt > 4096) {
        cb_set_err(err, errlen, "engine: block_tokens %d out of range 1..4096", bt);
        return NULL;
    }
    cb_engine_kv_dtype_t kv_dtype;
    if (!resolve_kv_dtype(o->kv_dtype, &kv_dtype, err, errlen)) return NULL;
    cb_engine_attn_t attn;
    if (!resolve_attn(o->attn, &attn, err, errlen)) return NULL;
    cb_engine_t *e = cb_calloc(1, sizeof *e);
    if (!e) {
        cb_set_err(err, errlen, "engine: out of memory");
        return NULL;
    }
    e->kv_dtype = kv_dtype;
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
    e->geom = (cb_attn_geom_t){hp->n_head, hp->n_head_kv, hp->head_dim, 1.0f / sqrtf((float)hp->head_dim),
                              cb_engine_attn_math(attn), 0};
    e->attn = attn;
    e->be = cb_backend_select(cb_backend_default_kind(), hp, e->max_rows, max_ctx, e->nt_max, NULL, berr, sizeof berr);
    if (!e->be) {
        cb_set_err(err, errlen, "engine: %s", berr);
        goto fail;
    }
    e->be->ops->set_threads(e->be->ctx, e->nt);
    /* the weights in the layouts the backend reads (once per model: later engines share them) */
    if (e->be->ops->prepare_weights &&
        e->be->ops->prepare_weights(e->be->ctx, cb_model_weights(model), berr, sizeof berr) != 0) {
        cb_set_err(err, errlen, "engine: %s", berr);
        goto fail;
    }
    /* the pool: as many blocks as the budget holds (default: two sequences of max_ctx) */
    e->bt = bt;
    e->seq_max_blocks = (max_ctx + bt - 1) / bt;
    const cb_kv_dtype_t pool_dtype = kv_dtype == CB_ENGINE_KV_F32 ? CB_KV_F32 : CB_KV_F16;
    const size_t vb = cb_kv_dtype_size(pool_dtype); /* 2 also for CUDA's bf16 pool */
    e->block_bytes = 2 * vb * (size_t)hp->n_layer * bt * e->KVD;
    const size_t seqs = o->kv_pool_seqs > 0 ? (size_t)o->kv_pool_seqs : 2;
    size_t nb = o->kv_pool_bytes ? o->kv_pool_bytes / e->block_bytes : seqs * (size_t)e->seq_max_blocks + 1;
    if (nb < 1) {
        cb_set_err(err, errlen, "engine: KV pool budget %zu bytes is below one block (%zu bytes)", o->kv_pool_bytes,
                 e->block_bytes);
        goto fail;
    }
    if (nb > (1u << 30)) nb = 1u << 30;
    e->n_blocks = (int)nb;
    if (e->be->ops->kv_pool_init(e->be->ctx, hp->n_layer, e->KVD, bt, e->n_blocks, pool_dtype, berr, sizeof berr) !=
        0) {
        cb_set_err(err, errlen, "engine: %s", berr);
        goto fail;
    }
    assert(e->be->kv_value_bytes == (int)vb);
    e->refs = cb_calloc((size_t)e->n_blocks, sizeof(int32_t));
    if (!e->refs) goto oom;
    e->n_free = e->n_blocks;
    const size_t R = (size_t)e->max_rows;
    e->x = buf(e, sizeof(float) * R * e->E);
    e->q = buf(e, sizeof(float) * R * e->QD);
    e->k = buf(e, sizeof(float) * R * e->KVD);
    e->v = buf(e, sizeof(float) * R * e->KVD);
    e->pos = cb_calloc(R, sizeof(int32_t));
    e->limit = cb_calloc(R, sizeof(int32_t));
    e->tables = cb_calloc(R, sizeof(cb_kv_table_t));
    e->gather = cb_calloc((size_t)e->seq_max_blocks, sizeof(int32_t));
    e->xb = buf(e, sizeof(float) * R * e->E);
    e->att = buf(e, sizeof(float) * R * e->QD);
    e->proj = buf(e, sizeof(float) * R * e->E);
    e->gate = buf(e, sizeof(float) * R * e->F);
    e->up = buf(e, sizeof(float) * R * e->F);
    if (!e->x || !e->q || !e->k || !e->v || !e->pos || !e->limit || !e->tables || !e->gather || !e->xb || !e->att ||
        !e->proj || !e->gate || !e->up)
        goto oom;
    return e;
oom:
    cb_set_err(err, errlen, "engine: out of memory");
fail:
    cb_engine_destroy(&e);
    return NULL;
}

cb_engine_t *cb_engine_new(const cb_model_t *model, int max_ctx, char *err, size_t errlen) {
    cb_engine_opts_t o = {.max_ctx = max_ctx};
    return cb_engine_new_opts(model, &o, err, errlen);
}

void cb_engine_destroy(cb_engine_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_engine_t *e = *self_p;
    if (e->n_seqs) CB_WARN("engine: destroyed with %d live sequences", e->n_seqs);
    if (e->be) {
        void (*hf)(void *, void *) = e->be->ops->host_free;
        void *ctx = e->be->ctx;
        float *bufs[] = {e->x, e->q, e->k, e->v, e->xb, e->att, e->proj, e->gate, e->up};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            if (bufs[i]) hf(ctx, bufs[i]);
    }
    cb_backend_destroy(&e->be);
    free(e->refs);
    free(e->pos);
    free(e->limit);
    free(e->tables);
    free(e->gather);
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
const char *cb_engine_backend_name(const cb_engine_t *self) { return self->be->ops->name; }
cb_engine_kv_dtype_t cb_engine_kv_dtype(const cb_engine_t *self) { return self->kv_dtype; }
cb_engine_attn_t cb_engine_attn(const cb_engine_t *self) { return self->attn; }

void cb_engine_pool_stats(const cb_engine_t *self, cb_engine_pool_stats_t *out) {
    memset(out, 0, sizeof *out);
    out->n_blocks = self->n_blocks;
    out->blocks_free = self->n_free;
    out->blocks_used = self->n_blocks - self->n_free;
    out->blocks_shared = self->n_shared;
    out->block_tokens = self->bt;
    out->block_bytes = self->block_bytes;
    out->n_seqs = self->n_seqs;
}

/* ---------------------------------------------------------------- blocks and sequences */

/* Takes block want when it is free, else the lowest free block (there is one). */
static int32_t block_take(cb_engine_t *e, int32_t want) {
    assert(e->n_free > 0);
    int32_t b = want;
    if (b < 0 || b >= e->n_blocks || e->refs[b] != 0) {
        b = e->free_lo;
        while (e->refs[b] != 0) b++;
        e->free_lo = b + 1;
    }
    e->refs[b] = 1;
    e->n_free--;
    return b;
}

/* The first block of the lowest run of k free blocks, or -1. */
static int32_t free_run(const cb_engine_t *e, int k) {
    for (int32_t b = e->free_lo, len = 0; b < e->n_blocks; b++) {
        len = e->refs[b] == 0 ? len + 1 : 0;
        if (len == k) return b - k + 1;
    }
    return -1;
}

/* Whether blocks [b, b + k) are all free. */
static bool all_free(const cb_engine_t *e, int32_t b, int k) {
    if (b < 0 || b > e->n_blocks - k) return false;
    for (int i = 0; i < k; i++)
        if (e->refs[b + i] != 0) return false;
    return true;
}

static void block_ref(cb_engine_t *e, int32_t b) {
    assert(e->refs[b] > 0);
    if (++e->refs[b] == 2) e->n_shared++;
}

static void block_unref(cb_engine_t *e, int32_t b) {
    assert(e->refs[b] > 0);
    if (--e->refs[b] == 1) e->n_shared--;
    if (e->refs[b] == 0) {
        e->n_free++;
        if (b < e->free_lo) e->free_lo = b;
    }
}

static cb_kv_table_t table_of(const cb_seq_t *s) {
    return (cb_kv_table_t){s->blocks, s->n_blocks * s->e->bt};
}

cb_seq_t *cb_seq_new(cb_engine_t *engine) {
    if (!engine) return NULL;
    cb_seq_t *s = cb_calloc(1, sizeof *s);
    if (!s) return NULL;
    s->blocks = cb_malloc(sizeof(int32_t) * (size_t)engine->seq_max_blocks);
    if (!s->blocks) {
        free(s);
        return NULL;
    }
    s->e = engine;
    engine->n_seqs++;
    return s;
}

void cb_seq_truncate(cb_seq_t *self, int n_pos) {
    if (!self) return;
    int keep = n_pos <= 0 ? 0 : (n_pos + self->e->bt - 1) / self->e->bt;
    while (self->n_blocks > keep) block_unref(self->e, self->blocks[--self->n_blocks]);
}

void cb_seq_clear(cb_seq_t *self) { cb_seq_truncate(self, 0); }

void cb_seq_destroy(cb_seq_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_seq_t *s = *self_p;
    cb_seq_clear(s);
    s->e->n_seqs--;
    free(s->blocks);
    free(s);
    *self_p = NULL;
}

int cb_seq_capacity(const cb_seq_t *self) { return self->n_blocks * self->e->bt; }
int cb_seq_blocks(const cb_seq_t *self) { return self->n_blocks; }

/* Blocks of positions [from, to) that another sequence also holds. */
static int shared_in(const cb_seq_t *s, int from, int to) {
    const int bt = s->e->bt;
    int n = 0, b1 = (to + bt - 1) / bt;
    for (int b = from / bt; b < b1 && b < s->n_blocks; b++) n += s->e->refs[s->blocks[b]] > 1;
    return n;
}

int cb_seq_reserve(cb_seq_t *self, int from, int n_pos) {
    if (!self || from < 0 || n_pos < 0 || n_pos > self->e->max_ctx) return CB_ENGINE_EINVAL;
    cb_engine_t *e = self->e;
    if (from >= n_pos) from = n_pos;
    const int need = (n_pos + e->bt - 1) / e->bt, grow = need > self->n_blocks ? need - self->n_blocks : 0;
    const int copies = shared_in(self, from, n_pos);
    if (grow + copies > e->n_free) return CB_ENGINE_EPOOL;
    /* copy on write: a shared block of [from, n_pos) becomes this sequence's own copy */
    for (int b = from / e->bt; b < self->n_blocks && b * e->bt < n_pos; b++) {
        int32_t old = self->blocks[b];
        if (e->refs[old] < 2) continue;
        int32_t nb = block_take(e, -1);
        if (e->be->ops->kv_copy_block(e->be->ctx, nb, old) != 0) {
            block_unref(e, nb);
            return CB_ENGINE_EBACKEND;
        }
        self->blocks[b] = nb;
        block_unref(e, old);
    }
    if (grow > 0) {
        /* right after the last block, else the first run that holds the whole growth, else anywhere */
        int32_t want = self->n_blocks > 0 ? self->blocks[self->n_blocks - 1] + 1 : -1;
        if (!all_free(e, want, grow)) want = free_run(e, grow);
        while (self->n_blocks < need) {
            int32_t b = block_take(e, want);
            self->blocks[self->n_blocks++] = b;
            want = b + 1;
        }
    }
    return CB_ENGINE_OK;
}

int cb_seq_share(cb_seq_t *dst, const cb_seq_t *src, int n_pos) {
    if (!dst || !src || dst == src || dst->e != src->e || n_pos < 0 || n_pos > cb_seq_capacity(src))
        return CB_ENGINE_EINVAL;
    cb_engine_t *e = dst->e;
    cb_seq_clear(dst);
    const int full = n_pos / e->bt, part = n_pos % e->bt != 0;
    if (part > e->n_free) return CB_ENGINE_EPOOL;
    for (int b = 0; b < full; b++) {
        block_ref(e, src->blocks[b]);
        dst->blocks[dst->n_blocks++] = src->blocks[b];
    }
    if (part) {
        int32_t nb = block_take(e, -1);
        dst->blocks[dst->n_blocks++] = nb;
        if (e->be->ops->kv_copy_block(e->be->ctx, nb, src->blocks[full]) != 0) {
            cb_seq_clear(dst);
            return CB_ENGINE_EBACKEND;
        }
    }
    return CB_ENGINE_OK;
}

/* ---------------------------------------------------------------- primitives */

void *cb_engine_alloc(cb_engine_t *self, size_t bytes) { return buf(self, bytes); }
void cb_engine_free(cb_engine_t *self, void *p) {
    if (p) self->be->ops->host_free(self->be->ctx, p);
}

/* Several products of the same x: one backend call when it offers matmul_multi. rowwise (a decode batch):
 * matmul_rowwise when the backend offers it, so that every row gets the bits it gets alone. */
static void matmul_parts(cb_engine_t *e, const cb_matmul_part_t *parts, int n_parts, const float *x, int n,
                         bool rowwise) {
    const cb_backend_ops_t *ops = e->be->ops;
    if (rowwise && ops->matmul_rowwise) {
        ops->matmul_rowwise(e->be->ctx, parts, n_parts, x, n);
        return;
    }
    if (ops->matmul_multi) {
        ops->matmul_multi(e->be->ctx, parts, n_parts, x, n);
        return;
    }
    for (int p = 0; p < n_parts; p++) ops->matmul(e->be->ctx, parts[p].w, x, n, parts[p].y, parts[p].ldy);
}

/* One product y [n][ldy] = x [n][w->cols] · wᵀ (rowwise as above). */
static void matmul_one(cb_engine_t *e, const cb_weight_t *w, const float *x, int n, float *y, int ldy, bool rowwise) {
    if (rowwise && e->be->ops->matmul_rowwise) {
        const cb_matmul_part_t part = {w, y, ldy};
        e->be->ops->matmul_rowwise(e->be->ctx, &part, 1, x, n);
        return;
    }
    e->be->ops->matmul(e->be->ctx, w, x, n, y, ldy);
}

void cb_engine_embed(cb_engine_t *self, const int32_t *tokens, int n, float *x) {
    assert(n >= 0 && n <= self->max_rows);
    self->be->ops->embed(self->be->ctx, cb_model_tok_embd(self->model), tokens, n, x);
    if (self->hp->embd_scale != 1.0f) self->be->ops->scale(self->be->ctx, x, (size_t)n * self->E, self->hp->embd_scale);
}

/* The attention geometry of a layer: the engine's, with the layer's sliding window. */
static cb_attn_geom_t layer_geom(const cb_engine_t *e, int layer) {
    cb_attn_geom_t g = e->geom;
    g.window = cb_model_layer(e->model, layer)->window;
    return g;
}

static void layer_qkv(cb_engine_t *self, int layer, const float *x, int n, float *q, float *k, float *v,
                      bool rowwise) {
    assert(n >= 1 && n <= self->max_rows);
    const cb_layer_weights_t *L = cb_model_layer(self->model, layer);
    assert(L);
    self->be->ops->rmsnorm(self->be->ctx, x, L->attn_norm, n, self->E, self->hp->rms_eps, self->xb);
    cb_matmul_part_t parts[3] = {{&L->wq, q, self->QD}, {&L->wk, k, self->KVD}, {&L->wv, v, self->KVD}};
    matmul_parts(self, parts, 3, self->xb, n, rowwise);
    const cb_backend_ops_t *ops = self->be->ops;
    if (L->bq) { /* qwen2: the projections' biases */
        ops->add_bias(self->be->ctx, q, L->bq, n, self->QD);
        ops->add_bias(self->be->ctx, k, L->bk, n, self->KVD);
        ops->add_bias(self->be->ctx, v, L->bv, n, self->KVD);
    }
    if (L->q_norm) { /* qwen3: RMSNorm of every head of Q and K, rows of head_dim */
        const int hd = self->hp->head_dim;
        ops->rmsnorm(self->be->ctx, q, L->q_norm, n * self->hp->n_head, hd, self->hp->rms_eps, q);
        ops->rmsnorm(self->be->ctx, k, L->k_norm, n * self->hp->n_head_kv, hd, self->hp->rms_eps, k);
    }
}

void cb_engine_layer_qkv(cb_engine_t *self, int layer, const float *x, int n, float *q, float *k, float *v) {
    layer_qkv(self, layer, x, n, q, k, v, false);
}

void cb_engine_rope(cb_engine_t *self, int layer, float *x, int n, int n_heads, const int32_t *pos) {
    const cb_layer_weights_t *L = cb_model_layer(self->model, layer);
    assert(L);
    self->be->ops->rope(self->be->ctx, x, n, n_heads, pos, &L->rope);
}

/* K/V rows into positions the sequence already owns exclusively (reserved by the caller). */
static int write_reserved(cb_engine_t *e, const cb_seq_t *s, int layer, const int32_t *pos, int n, const float *k,
                          const float *v) {
    cb_kv_table_t t = table_of(s);
    return e->be->ops->kv_write(e->be->ctx, layer, &t, pos, n, k, v) ? CB_ENGINE_EBACKEND : CB_ENGINE_OK;
}

int cb_engine_kv_write(cb_engine_t *self, cb_seq_t *seq, int layer, const int32_t *pos, int n, const float *k,
                       const float *v) {
    if (!seq || seq->e != self || layer < 0 || layer >= self->hp->n_layer || n < 0) return CB_ENGINE_EINVAL;
    int lo = self->max_ctx, hi = -1;
    for (int i = 0; i < n; i++) {
        if (pos[i] < 0 || pos[i] >= self->max_ctx) return CB_ENGINE_EINVAL;
        lo = pos[i] < lo ? pos[i] : lo;
        hi = pos[i] > hi ? pos[i] : hi;
    }
    if (n == 0) return CB_ENGINE_OK;
    if (hi >= cb_seq_capacity(seq) || shared_in(seq, lo, hi + 1)) {
        int rc = cb_seq_reserve(seq, lo, hi + 1);
        if (rc) return rc;
    }
    return write_reserved(self, seq, layer, pos, n, k, v);
}

bool cb_engine_kv_load_takes(const cb_engine_t *self, cb_kv_dtype_t dtype) {
    return cb_kv_dtype_size(dtype) || (dtype == CB_KV_Q8_0 && self->be->ops->kv_load_q8_0);
}

int cb_engine_kv_load(cb_engine_t *self, cb_seq_t *seq, int layer, int pos0, int n, const void *k, const void *v,
                      cb_kv_dtype_t dtype) {
    if (!seq || seq->e != self || layer < 0 || layer >= self->hp->n_layer || n < 0 || pos0 < 0 ||
        pos0 > cb_seq_capacity(seq) - n)
        return CB_ENGINE_EINVAL; /* never allocates: the caller reserved the rows */
    cb_kv_table_t t = table_of(seq);
    return self->be->ops->kv_load(self->be->ctx, layer, &t, pos0, n, k, v, dtype, &cb_model_layer(self->model, layer)->rope)
               ? CB_ENGINE_EBACKEND
               : CB_ENGINE_OK;
}

int cb_engine_kv_read(cb_engine_t *self, const cb_seq_t *seq, int layer, int pos0, int n, float *k, float *v) {
    if (!seq || seq->e != self || layer < 0 || layer >= self->hp->n_layer || n < 0 || pos0 < 0 ||
        pos0 > cb_seq_capacity(seq) - n)
        return CB_ENGINE_EINVAL;
    cb_kv_table_t t = table_of(seq);
    return self->be->ops->kv_read(self->be->ctx, layer, &t, pos0, n, k, v) ? CB_ENGINE_EBACKEND : CB_ENGINE_OK;
}

/* o_proj + residual into x, FFN RMSNorm, SwiGLU MLP + residual into x, from the attention output in
 * self->att:  x [n][n_embd] in/out. rowwise: a decode batch (see matmul_parts). */
static void layer_post_attn(cb_engine_t *self, int layer, float *x, int n, bool rowwise) {
    const cb_backend_ops_t *ops = self->be->ops;
    void *ctx = self->be->ctx;
    const cb_layer_weights_t *L = cb_model_layer(self->model, layer);
    assert(L);
    const size_t nE = (size_t)n * self->E;
    const float eps = self->hp->rms_eps;
    matmul_one(self, &L->wo, self->att, n, self->proj, self->E, rowwise);
    if (L->post_attn_norm) ops->rmsnorm(ctx, self->proj, L->post_attn_norm, n, self->E, eps, self->proj);
    ops->add(ctx, x, self->proj, nE);
    ops->rmsnorm(ctx, x, L->ffn_norm, n, self->E, eps, self->xb);
    cb_matmul_part_t parts[2] = {{&L->w_gate, self->gate, self->F}, {&L->w_up, self->up, self->F}};
    matmul_parts(self, parts, 2, self->xb, n, rowwise);
    if (self->hp->act == CB_ACT_GELU_TANH) ops->geglu(ctx, self->gate, self->up, (size_t)n * self->F, self->gate);
    else ops->swiglu(ctx, self->gate, self->up, (size_t)n * self->F, self->gate);
    matmul_one(self, &L->w_down, self->gate, n, self->proj, self->E, rowwise);
    if (L->post_ffn_norm) ops->rmsnorm(ctx, self->proj, L->post_ffn_norm, n, self->E, eps, self->proj);
    ops->add(ctx, x, self->proj, nE);
}

/* Attention of q over table t (row i over its first key_limit[i] keys), then layer_post_attn into x. */
static void attn_mlp_table(cb_engine_t *self, const cb_kv_table_t *t, int layer, float *x, const float *q, int n,
                           const int32_t *key_limit) {
    assert(n >= 1 && n <= self->max_rows);
    for (int i = 0; i < n; i++) assert(key_limit[i] >= 1 && key_limit[i] <= t->n_pos);
    const cb_attn_geom_t g = layer_geom(self, layer);
    self->be->ops->attention(self->be->ctx, &g, q, n, layer, t, key_limit, self->att);
    layer_post_attn(self, layer, x, n, false);
}

void cb_engine_layer_attn_mlp(cb_engine_t *self, const cb_seq_t *seq, int layer, float *x, const float *q, int n,
                              const int32_t *key_limit) {
    assert(seq && seq->e == self);
    cb_kv_table_t t = table_of(seq);
    attn_mlp_table(self, &t, layer, x, q, n, key_limit);
}

void cb_engine_layer_attn_mlp_blocks(cb_engine_t *self, const cb_seq_t *seq, int layer, float *x, const float *q,
                                     int n, const int32_t *blk, int n_blk, const int32_t *key_limit) {
    assert(seq && seq->e == self && n_blk >= 1 && n_blk <= seq->n_blocks);
    assert(cb_model_layer(self->model, layer)->window == 0); /* gathered key indices are not positions */
    for (int i = 0; i < n_blk; i++) {
        assert(blk[i] >= 0 && blk[i] < seq->n_blocks);
        self->gather[i] = seq->blocks[blk[i]];
    }
    cb_kv_table_t t = {self->gather, n_blk * self->bt};
    attn_mlp_table(self, &t, layer, x, q, n, key_limit);
}

/* The backend's attn_mass over layer l of seq; out NULL or self->att (then n <= max_rows). Status. */
static int attn_mass_call(cb_engine_t *self, const cb_seq_t *seq, int layer, const float *q, int n,
                          const int32_t *key_limit, float *mass, float *out) {
    if (!seq || seq->e != self || layer < 0 || layer >= self->hp->n_layer || (out && (n < 1 || n > self->max_rows)))
        return CB_ENGINE_EINVAL;
    cb_kv_table_t t = table_of(seq);
    const cb_attn_geom_t g = layer_geom(self, layer);
    return self->be->ops->attn_mass(self->be->ctx, &g, q, n, layer, &t, key_limit, mass, out)
               ? CB_ENGINE_EBACKEND
               : CB_ENGINE_OK;
}

int cb_engine_attn_mass(cb_engine_t *self, const cb_seq_t *seq, int layer, const float *q, int n,
                        const int32_t *key_limit, float *mass) {
    return attn_mass_call(self, seq, layer, q, n, key_limit, mass, NULL);
}

int cb_engine_layer_attn_mass_mlp(cb_engine_t *self, const cb_seq_t *seq, int layer, float *x, const float *q, int n,
                                  const int32_t *key_limit, float *mass) {
    int rc = attn_mass_call(self, seq, layer, q, n, key_limit, mass, self->att);
    if (rc == CB_ENGINE_OK) layer_post_attn(self, layer, x, n, false);
    return rc;
}

int cb_engine_kv_deviation(cb_engine_t *self, int n, const float *fresh, const void *const *cached,
                           cb_kv_dtype_t dtype, double *dev) {
    return self->be->ops->kv_deviation(self->be->ctx, n, self->KVD, fresh, cached, dtype, dev) ? CB_ENGINE_EBACKEND
                                                                                               : CB_ENGINE_OK;
}

int cb_engine_topk(cb_engine_t *self, int n, const double *score, int k, int32_t *out) {
    return self->be->ops->topk(self->be->ctx, n, score, k, out) ? CB_ENGINE_EBACKEND : CB_ENGINE_OK;
}

void cb_engine_compact_rows(cb_engine_t *self, float *x, size_t row_len, const int32_t *keep, int n_keep) {
    self->be->ops->compact_rows(self->be->ctx, x, row_len, keep, n_keep);
}

void cb_engine_logits(cb_engine_t *self, const float *x_row, float *logits) {
    const cb_backend_ops_t *ops = self->be->ops;
    ops->rmsnorm(self->be->ctx, x_row, cb_model_output_norm(self->model), 1, self->E, self->hp->rms_eps, self->xb);
    const cb_weight_t *w = cb_model_output(self->model);
    ops->matmul(self->be->ctx, w, self->xb, 1, logits, w->rows);
}

/* ---------------------------------------------------------------- prefill / decode */

/* One ubatch of n <= max_rows rows at positions pos0.. (validated, blocks reserved and owned); capture:
 * the rows' pre-RoPE K and V of each layer into cap_k[l], cap_v[l] + row0 (NULL: none). logits: the last row's
 * [n_vocab], or with all every row's [n][n_vocab]. */
static int forward_ubatch(cb_engine_t *e, cb_seq_t *s, const int32_t *tokens, int n, int pos0, float *const *cap_k,
                          float *const *cap_v, int row0, float *logits, bool all) {
    const cb_hparams_t *hp = e->hp;
    for (int i = 0; i < n; i++) {
        e->pos[i] = pos0 + i;
        e->limit[i] = pos0 + i + 1;
    }
    cb_engine_embed(e, tokens, n, e->x);
    for (int l = 0; l < hp->n_layer; l++) {
        cb_engine_layer_qkv(e, l, e->x, n, e->q, e->k, e->v);
        if (cap_k) {
            memcpy(cap_k[l] + (size_t)row0 * e->KVD, e->k, sizeof(float) * (size_t)n * e->KVD);
            memcpy(cap_v[l] + (size_t)row0 * e->KVD, e->v, sizeof(float) * (size_t)n * e->KVD);
        }
        cb_engine_rope(e, l, e->q, n, hp->n_head, e->pos);
        cb_engine_rope(e, l, e->k, n, hp->n_head_kv, e->pos);
        int rc = write_reserved(e, s, l, e->pos, n, e->k, e->v);
        if (rc) return rc;
        if (l == hp->n_layer - 1 && !logits) break; /* the last layer's output feeds only the logits */
        cb_engine_layer_attn_mlp(e, s, l, e->x, e->q, n, e->limit);
    }
    if (logits && all)
        for (int i = 0; i < n; i++) cb_engine_logits(e, e->x + (size_t)i * e->E, logits + (size_t)i * hp->n_vocab);
    else if (logits)
        cb_engine_logits(e, e->x + (size_t)(n - 1) * e->E, logits);
    return CB_ENGINE_OK;
}

static int prefill(cb_engine_t *self, cb_seq_t *seq, const int32_t *tokens, int n, int pos0, float *const *cap_k,
                   float *const *cap_v, float *logits, bool all) {
    if (!self || !seq || seq->e != self || !tokens || n < 1 || pos0 < 0 || pos0 > self->max_ctx - n ||
        (!cap_k) != (!cap_v))
        return CB_ENGINE_EINVAL;
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= self->hp->n_vocab) return CB_ENGINE_EINVAL;
    int rc = cb_seq_reserve(seq, pos0, pos0 + n); /* every block first: EPOOL before any compute */
    if (rc) return rc;
    for (int i = 0; i < n; i += self->max_rows) {
        int k = n - i < self->max_rows ? n - i : self->max_rows;
        float *lg = all ? logits + (size_t)i * self->hp->n_vocab : i + k == n ? logits : NULL;
        rc = forward_ubatch(self, seq, tokens + i, k, pos0 + i, cap_k, cap_v, i, lg, all);
        if (rc) return rc;
    }
    return CB_ENGINE_OK;
}

int cb_engine_prefill_capture(cb_engine_t *self, cb_seq_t *seq, const int32_t *tokens, int n, int pos0,
                              float *const *cap_k, float *const *cap_v, float *logits) {
    return prefill(self, seq, tokens, n, pos0, cap_k, cap_v, logits, false);
}

int cb_engine_prefill_all(cb_engine_t *self, cb_seq_t *seq, const int32_t *tokens, int n, int pos0,
                          float *logits_all) {
    if (!logits_all) return CB_ENGINE_EINVAL;
    return prefill(self, seq, tokens, n, pos0, NULL, NULL, logits_all, true);
}

int cb_engine_prefill(cb_engine_t *self, cb_seq_t *seq, const int32_t *tokens, int n, int pos0, float *logits) {
    return cb_engine_prefill_capture(self, seq, tokens, n, pos0, NULL, NULL, logits);
}

int cb_engine_decode(cb_engine_t *self, cb_seq_t *seq, int32_t token, int pos, float *logits) {
    return cb_engine_prefill(self, seq, &token, 1, pos, logits);
}

/* Blocks the batch's new positions need (growth and copies of shared blocks), all or nothing. */
static int reserve_batch(cb_engine_t *e, cb_seq_t *const *seqs, const int32_t *pos, int n) {
    int need = 0;
    for (int i = 0; i < n; i++) {
        const int nb = pos[i] / e->bt + 1;
        need += (nb > seqs[i]->n_blocks ? nb - seqs[i]->n_blocks : 0) + shared_in(seqs[i], pos[i], pos[i] + 1);
    }
    if (need > e->n_free) return CB_ENGINE_EPOOL;
    for (int i = 0; i < n; i++) {
        int rc = cb_seq_reserve(seqs[i], pos[i], pos[i] + 1);
        if (rc) return rc; /* only a backend failure of a copy can get here */
    }
    return CB_ENGINE_OK;
}

int cb_engine_decode_batch(cb_engine_t *self, cb_seq_t *const *seqs, const int32_t *tokens, const int32_t *pos,
                           int n, float *logits) {
    if (!self || !seqs || !tokens || !pos || n < 1 || n > self->max_rows) return CB_ENGINE_EINVAL;
    for (int i = 0; i < n; i++) {
        if (!seqs[i] || seqs[i]->e != self || tokens[i] < 0 || tokens[i] >= self->hp->n_vocab || pos[i] < 0 ||
            pos[i] >= self->max_ctx)
            return CB_ENGINE_EINVAL;
        for (int j = 0; j < i; j++)
            if (seqs[j] == seqs[i]) return CB_ENGINE_EINVAL; /* one token per sequence and step */
    }
    int rc = reserve_batch(self, seqs, pos, n);
    if (rc) return rc;
    const cb_hparams_t *hp = self->hp;
    const cb_backend_ops_t *ops = self->be->ops;
    for (int i = 0; i < n; i++) {
        self->tables[i] = table_of(seqs[i]);
        self->limit[i] = pos[i] + 1;
    }
    cb_engine_embed(self, tokens, n, self->x);
    for (int l = 0; l < hp->n_layer; l++) {
        layer_qkv(self, l, self->x, n, self->q, self->k, self->v, true); /* one product per weight */
        cb_engine_rope(self, l, self->q, n, hp->n_head, pos);
        cb_engine_rope(self, l, self->k, n, hp->n_head_kv, pos);
        for (int i = 0; i < n; i++) {
            rc = write_reserved(self, seqs[i], l, &pos[i], 1, self->k + (size_t)i * self->KVD,
                                self->v + (size_t)i * self->KVD);
            if (rc) return rc;
        }
        if (l == hp->n_layer - 1 && !logits) break;
        /* each row attends its own sequence: one call for all rows when the backend has attention_rows */
        const cb_attn_geom_t g = layer_geom(self, l);
        if (ops->attention_rows)
            ops->attention_rows(self->be->ctx, &g, self->q, n, l, self->tables, self->limit, self->att);
        else
            for (int i = 0; i < n; i++)
                ops->attention(self->be->ctx, &g, self->q + (size_t)i * self->QD, 1, l, &self->tables[i],
                               &self->limit[i], self->att + (size_t)i * self->QD);
        layer_post_attn(self, l, self->x, n, true);
    }
    if (logits) {
        ops->rmsnorm(self->be->ctx, self->x, cb_model_output_norm(self->model), n, self->E, hp->rms_eps, self->xb);
        const cb_weight_t *w = cb_model_output(self->model);
        matmul_one(self, w, self->xb, n, logits, w->rows, true);
    }
    return CB_ENGINE_OK;
}
