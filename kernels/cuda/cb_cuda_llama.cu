/* cb_cuda_llama.cu: a GPU-resident llama model and its schedules (see cb_cuda_llama.h), composed only from
 * the public cb_cuda.h calls. Host code; every call's status is checked and propagated. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cb_cuda_llama.h"

typedef struct {
    cb_bf16_t *wqkv;   /* [QD + 2*KVD][E]: q rows, then k rows, then v rows */
    cb_bf16_t *wo;     /* [E][QD] */
    cb_bf16_t *wgu;    /* [2*F][E]: gate rows, then up rows */
    cb_bf16_t *wdown;  /* [E][F] */
    float *attn_norm;  /* [E] */
    float *ffn_norm;   /* [E] */
} cl_layer_t;

struct cb_cuda_llama {
    cb_cuda_t *cu;
    cb_cuda_llama_hp_t hp;
    int max_ctx, R;
    int E, QD, KVD, QKVD, F;
    cb_bf16_t *tok_embd;   /* [V][E] */
    cb_bf16_t *output;     /* [V][E]; = tok_embd when tied */
    float *output_norm;    /* [E] */
    cl_layer_t *L;         /* [n_layer] */
    cb_bf16_t *kv;         /* [n_layer][2][max_ctx][KVD]: K (post-RoPE) then V per layer */
    float *h;              /* [max_ctx][E] residual stream of every row */
    cb_bf16_t *xn;         /* [R][E] normed rows */
    cb_bf16_t *qkv;        /* [R][QKVD] */
    cb_bf16_t *att;        /* [R][QD] */
    cb_bf16_t *gu;         /* [R][2F] */
    cb_bf16_t *act;        /* [R][F] */
    float *logits;         /* [V] */
    int32_t *tokens;       /* [max_ctx] for callers */
    int32_t *pos;          /* [max_ctx] row positions */
    size_t weight_bytes;
};

#define TRY(x) do { int rc_ = (x); if (rc_) return rc_; } while (0)

static cb_bf16_t *cl_kc(cb_cuda_llama_t *m, int l) { return m->kv + (size_t)l * 2 * m->max_ctx * m->KVD; }
static cb_bf16_t *cl_vc(cb_cuda_llama_t *m, int l) { return cl_kc(m, l) + (size_t)m->max_ctx * m->KVD; }

extern "C" void cb_cuda_llama_destroy(cb_cuda_llama_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_cuda_llama_t *m = *self_p;
    cb_cuda_t *cu = m->cu;
    cb_cuda_sync(cu);
    if (m->L) {
        for (int l = 0; l < m->hp.n_layer; l++) {
            cb_cuda_free(cu, m->L[l].wqkv);
            cb_cuda_free(cu, m->L[l].wo);
            cb_cuda_free(cu, m->L[l].wgu);
            cb_cuda_free(cu, m->L[l].wdown);
            cb_cuda_free(cu, m->L[l].attn_norm);
            cb_cuda_free(cu, m->L[l].ffn_norm);
        }
        free(m->L);
    }
    if (m->output != m->tok_embd) cb_cuda_free(cu, m->output);
    cb_cuda_free(cu, m->tok_embd);
    cb_cuda_free(cu, m->output_norm);
    void *bufs[] = {m->kv, m->h, m->xn, m->qkv, m->att, m->gu, m->act, m->logits, m->tokens, m->pos};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cb_cuda_free(cu, bufs[i]);
    free(m);
    *self_p = NULL;
}

extern "C" cb_cuda_llama_t *cb_cuda_llama_new(cb_cuda_t *cu, const cb_cuda_llama_hp_t *hp, int max_ctx, int max_rows,
                                              char *err, size_t errlen) {
    if (!cu || !hp || hp->n_layer < 1 || hp->n_embd < 8 || hp->n_head < 1 || hp->n_head_kv < 1 ||
        hp->n_head % hp->n_head_kv || hp->head_dim < 2 || hp->head_dim % 2 || hp->n_ff < 1 || hp->n_vocab < 1 ||
        max_ctx < 1 || max_rows < 1 || hp->n_embd % 8 || (hp->n_head * hp->head_dim) % 8 || hp->n_ff % 8) {
        snprintf(err, errlen, "cuda llama: bad geometry (dims must be multiples of 8)");
        return NULL;
    }
    cb_cuda_llama_t *m = (cb_cuda_llama_t *)calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, errlen, "cuda llama: out of host memory");
        return NULL;
    }
    m->cu = cu;
    m->hp = *hp;
    m->max_ctx = max_ctx;
    m->R = max_rows < max_ctx ? max_rows : max_ctx;
    m->E = hp->n_embd;
    m->QD = hp->n_head * hp->head_dim;
    m->KVD = hp->n_head_kv * hp->head_dim;
    m->QKVD = m->QD + 2 * m->KVD;
    m->F = hp->n_ff;
    const size_t E = m->E, V = hp->n_vocab, QD = m->QD, KVD = m->KVD, F = m->F, R = m->R, C = max_ctx;
    bool ok = true;
#define ALLOC(ptr, bytes) do { if (ok && !((ptr) = (decltype(ptr))cb_cuda_malloc(cu, (bytes)))) ok = false; } while (0)
    ALLOC(m->tok_embd, V * E * 2);
    if (hp->tied) m->output = m->tok_embd;
    else ALLOC(m->output, V * E * 2);
    ALLOC(m->output_norm, E * 4);
    m->L = (cl_layer_t *)calloc((size_t)hp->n_layer, sizeof *m->L);
    if (!m->L) ok = false;
    for (int l = 0; ok && l < hp->n_layer; l++) {
        ALLOC(m->L[l].wqkv, (QD + 2 * KVD) * E * 2);
        ALLOC(m->L[l].wo, E * QD * 2);
        ALLOC(m->L[l].wgu, 2 * F * E * 2);
        ALLOC(m->L[l].wdown, E * F * 2);
        ALLOC(m->L[l].attn_norm, E * 4);
        ALLOC(m->L[l].ffn_norm, E * 4);
    }
    m->weight_bytes = (hp->tied ? 1 : 2) * V * E * 2 + E * 4 +
                      (size_t)hp->n_layer * (((QD + 2 * KVD) * E + E * QD + 3 * F * E) * 2 + 2 * E * 4);
    ALLOC(m->kv, (size_t)hp->n_layer * 2 * C * KVD * 2);
    ALLOC(m->h, C * E * 4);
    ALLOC(m->xn, R * E * 2);
    ALLOC(m->qkv, R * (QD + 2 * KVD) * 2);
    ALLOC(m->att, R * QD * 2);
    ALLOC(m->gu, R * 2 * F * 2);
    ALLOC(m->act, R * F * 2);
    ALLOC(m->logits, V * 4);
    ALLOC(m->tokens, C * 4);
    ALLOC(m->pos, C * 4);
#undef ALLOC
    if (!ok) {
        snprintf(err, errlen, "cuda llama: %s", cb_cuda_error(cu)[0] ? cb_cuda_error(cu) : "out of host memory");
        cb_cuda_llama_destroy(&m);
        return NULL;
    }
    return m;
}

extern "C" const cb_cuda_llama_hp_t *cb_cuda_llama_hparams(const cb_cuda_llama_t *self) { return &self->hp; }
extern "C" size_t cb_cuda_llama_weight_bytes(const cb_cuda_llama_t *self) { return self->weight_bytes; }
extern "C" int32_t *cb_cuda_llama_tokens(cb_cuda_llama_t *self) { return self->tokens; }
extern "C" float *cb_cuda_llama_logits(cb_cuda_llama_t *self) { return self->logits; }
extern "C" cb_bf16_t *cb_cuda_llama_kcache(cb_cuda_llama_t *self, int layer) {
    return layer >= 0 && layer < self->hp.n_layer ? cl_kc(self, layer) : NULL;
}
extern "C" cb_bf16_t *cb_cuda_llama_vcache(cb_cuda_llama_t *self, int layer) {
    return layer >= 0 && layer < self->hp.n_layer ? cl_vc(self, layer) : NULL;
}

extern "C" void *cb_cuda_llama_weight(cb_cuda_llama_t *m, int layer, cb_cl_kind_t kind, int *rows, int *cols) {
    int r = 0, c = m->E;
    void *p = NULL;
    const bool per_layer = kind >= CB_CL_ATTN_NORM;
    if (per_layer && (layer < 0 || layer >= m->hp.n_layer)) return NULL;
    const cl_layer_t *L = per_layer ? &m->L[layer] : NULL;
    switch (kind) {
    case CB_CL_TOKEN_EMBD: p = m->tok_embd, r = m->hp.n_vocab; break;
    case CB_CL_OUTPUT_NORM: p = m->output_norm, r = 1; break;
    case CB_CL_OUTPUT: p = m->hp.tied ? NULL : m->output, r = m->hp.n_vocab; break;
    case CB_CL_ATTN_NORM: p = L->attn_norm, r = 1; break;
    case CB_CL_FFN_NORM: p = L->ffn_norm, r = 1; break;
    case CB_CL_Q: p = L->wqkv, r = m->QD; break;
    case CB_CL_K: p = L->wqkv + (size_t)m->QD * m->E, r = m->KVD; break;
    case CB_CL_V: p = L->wqkv + (size_t)(m->QD + m->KVD) * m->E, r = m->KVD; break;
    case CB_CL_O: p = L->wo, r = m->E, c = m->QD; break;
    case CB_CL_GATE: p = L->wgu, r = m->F; break;
    case CB_CL_UP: p = L->wgu + (size_t)m->F * m->E, r = m->F; break;
    case CB_CL_DOWN: p = L->wdown, r = m->E, c = m->F; break;
    default: return NULL;
    }
    if (rows) *rows = r;
    if (cols) *cols = c;
    return p;
}

extern "C" int cb_cuda_llama_upload(cb_cuda_llama_t *m, int layer, cb_cl_kind_t kind, uint32_t gguf_type,
                                    const void *host) {
    int rows, cols;
    void *dst = cb_cuda_llama_weight(m, layer, kind, &rows, &cols);
    if (!dst) return CB_CUDA_EINVAL;
    bool norm = kind == CB_CL_OUTPUT_NORM || kind == CB_CL_ATTN_NORM || kind == CB_CL_FFN_NORM;
    return cb_cuda_upload_weights(m->cu, gguf_type, host, (size_t)rows * cols, dst, norm ? CB_CUDA_F32 : CB_CUDA_BF16);
}

/* ------------------------------------------------------------------ layer pieces */

/* Normed QKV of nr rows of residual hr [nr][E] into m->qkv; optional capture of pre-RoPE K and V;
 * then RoPE of q and k at pos [nr] (device). */
static int cl_qkv(cb_cuda_llama_t *m, int l, int nr, const float *hr, const int32_t *pos, cb_bf16_t *cap_k,
                  cb_bf16_t *cap_v) {
    cb_cuda_t *cu = m->cu;
    const cl_layer_t *L = &m->L[l];
    const size_t kvb = (size_t)m->KVD * 2, qkvb = (size_t)m->QKVD * 2;
    TRY(cb_cuda_rmsnorm(cu, nr, m->E, hr, m->E, NULL, L->attn_norm, m->hp.rms_eps, m->xn, m->E));
    TRY(cb_cuda_gemm(cu, nr, m->QKVD, m->E, m->xn, m->E, L->wqkv, m->E, m->qkv, CB_CUDA_BF16, m->QKVD, 0.0f));
    if (cap_k) TRY(cb_cuda_copy_rows(cu, nr, kvb, cap_k, kvb, NULL, m->qkv + m->QD, qkvb, NULL));
    if (cap_v) TRY(cb_cuda_copy_rows(cu, nr, kvb, cap_v, kvb, NULL, m->qkv + m->QD + m->KVD, qkvb, NULL));
    const cb_cuda_rope_t rope = {CB_CUDA_ROPE_NORM, m->hp.rope_base, 1.0f, NULL};   /* llama: plain NORM RoPE */
    TRY(cb_cuda_rope(cu, nr, m->hp.n_head, m->hp.head_dim, m->qkv, m->QKVD, m->qkv, m->QKVD, pos, 0, &rope));
    TRY(cb_cuda_rope(cu, nr, m->hp.n_head_kv, m->hp.head_dim, m->qkv + m->QD, m->QKVD, m->qkv + m->QD, m->QKVD, pos, 0,
                     &rope));
    return CB_CUDA_OK;
}

/* Writes the fresh (rotated) K and V of m->qkv into layer l's cache: at rows kv_rows [nr] (device), or
 * at rows row0.. when kv_rows is NULL. */
static int cl_store_kv(cb_cuda_llama_t *m, int l, int nr, const int32_t *kv_rows, int row0) {
    const size_t kvb = (size_t)m->KVD * 2, qkvb = (size_t)m->QKVD * 2;
    cb_bf16_t *kc = cl_kc(m, l) + (kv_rows ? 0 : (size_t)row0 * m->KVD);
    cb_bf16_t *vc = cl_vc(m, l) + (kv_rows ? 0 : (size_t)row0 * m->KVD);
    TRY(cb_cuda_copy_rows(m->cu, nr, kvb, kc, kvb, kv_rows, m->qkv + m->QD, qkvb, NULL));
    TRY(cb_cuda_copy_rows(m->cu, nr, kvb, vc, kvb, kv_rows, m->qkv + m->QD + m->KVD, qkvb, NULL));
    return CB_CUDA_OK;
}

/* Attention of the nr query rows in m->qkv (row i at position pos[i], keys [0, pos[i]+1) of the
 * cache, n_kv keys in all), o_proj + residual into hr, then the SwiGLU MLP + residual. */
static int cl_attn_mlp(cb_cuda_llama_t *m, int l, int nr, float *hr, const int32_t *pos, int n_kv, int max_limit) {
    cb_cuda_t *cu = m->cu;
    const cl_layer_t *L = &m->L[l];
    cb_cuda_attn_t a;
    memset(&a, 0, sizeof a);
    a.q = m->qkv;
    a.ldq = m->QKVD;
    a.k = cl_kc(m, l);
    a.v = cl_vc(m, l);
    a.ldkv = m->KVD;
    a.out = m->att;
    a.ldo = m->QD;
    a.limit = pos;
    a.limit_add = 1;
    a.n_q = nr;
    a.n_kv = n_kv;
    a.n_heads = m->hp.n_head;
    a.n_kv_heads = m->hp.n_head_kv;
    a.head_dim = m->hp.head_dim;
    a.max_limit = max_limit;
    TRY(cb_cuda_attention(cu, &a, CB_CUDA_ATTN_AUTO));
    TRY(cb_cuda_gemm(cu, nr, m->E, m->QD, m->att, m->QD, L->wo, m->QD, hr, CB_CUDA_F32, m->E, 1.0f));
    TRY(cb_cuda_rmsnorm(cu, nr, m->E, hr, m->E, NULL, L->ffn_norm, m->hp.rms_eps, m->xn, m->E));
    TRY(cb_cuda_gemm(cu, nr, 2 * m->F, m->E, m->xn, m->E, L->wgu, m->E, m->gu, CB_CUDA_BF16, 2 * m->F, 0.0f));
    TRY(cb_cuda_swiglu(cu, nr, m->F, m->gu, m->gu + m->F, 2 * m->F, m->act, m->F));
    TRY(cb_cuda_gemm(cu, nr, m->E, m->F, m->act, m->F, L->wdown, m->F, hr, CB_CUDA_F32, m->E, 1.0f));
    return CB_CUDA_OK;
}

/* Final norm of one residual row, LM head, greedy token. */
static int cl_head(cb_cuda_llama_t *m, const float *row, int32_t *out_token) {
    cb_cuda_t *cu = m->cu;
    TRY(cb_cuda_rmsnorm(cu, 1, m->E, row, m->E, NULL, m->output_norm, m->hp.rms_eps, m->xn, m->E));
    TRY(cb_cuda_gemm(cu, 1, m->hp.n_vocab, m->E, m->xn, m->E, m->output, m->E, m->logits, CB_CUDA_F32,
                     m->hp.n_vocab, 0.0f));
    if (out_token) TRY(cb_cuda_argmax(cu, 1, m->hp.n_vocab, m->logits, m->hp.n_vocab, out_token));
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ prefill */

extern "C" int cb_cuda_llama_prefill(cb_cuda_llama_t *m, const int32_t *tokens, int n, int pos0,
                                     cb_bf16_t *const *cap_k, cb_bf16_t *const *cap_v, int32_t *out_token) {
    cb_cuda_t *cu = m->cu;
    if (n < 1 || pos0 < 0 || pos0 > m->max_ctx - n) {
        fprintf(stderr, "cuda llama: prefill of %d tokens at %d exceeds the cache (%d)\n", n, pos0, m->max_ctx);
        return CB_CUDA_EINVAL;
    }
    TRY(cb_cuda_i32_iota(cu, m->pos, n, pos0));
    TRY(cb_cuda_embed(cu, tokens, n, m->tok_embd, m->hp.n_vocab, m->E, m->h));
    for (int l = 0; l < m->hp.n_layer; l++) {
        for (int r0 = 0; r0 < n; r0 += m->R) {
            int nr = n - r0 < m->R ? n - r0 : m->R;
            float *hr = m->h + (size_t)r0 * m->E;
            TRY(cl_qkv(m, l, nr, hr, m->pos + r0, cap_k ? cap_k[l] + (size_t)r0 * m->KVD : NULL,
                       cap_v ? cap_v[l] + (size_t)r0 * m->KVD : NULL));
            TRY(cl_store_kv(m, l, nr, NULL, pos0 + r0));
            TRY(cl_attn_mlp(m, l, nr, hr, m->pos + r0, pos0 + n, pos0 + n));
        }
    }
    return cl_head(m, m->h + (size_t)(n - 1) * m->E, out_token);
}

/* ------------------------------------------------------------------ decode */

extern "C" int cb_cuda_llama_decode(cb_cuda_llama_t *m, int32_t *token, int32_t *pos, int max_limit,
                                    float temperature, float top_p, uint64_t *rng) {
    cb_cuda_t *cu = m->cu;
    if (max_limit < 1 || max_limit > m->max_ctx) max_limit = m->max_ctx;
    if (temperature > 0.0f && !rng) return CB_CUDA_EINVAL;
    TRY(cb_cuda_embed(cu, token, 1, m->tok_embd, m->hp.n_vocab, m->E, m->h));
    for (int l = 0; l < m->hp.n_layer; l++) {
        TRY(cl_qkv(m, l, 1, m->h, pos, NULL, NULL));
        TRY(cl_store_kv(m, l, 1, pos, 0));
        TRY(cl_attn_mlp(m, l, 1, m->h, pos, m->max_ctx, max_limit));
    }
    TRY(cl_head(m, m->h, temperature > 0.0f ? NULL : token));
    if (temperature > 0.0f)
        TRY(cb_cuda_sample(cu, m->hp.n_vocab, m->logits, temperature, top_p, rng, token));
    return cb_cuda_i32_add(cu, pos, 1, 1);
}
