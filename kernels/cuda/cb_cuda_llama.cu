/* cb_cuda_llama.cu: a GPU-resident llama model and its schedules (see cb_cuda_llama.h), composed only from
 * the public cb_cuda.h calls. Host code; every call's status is checked and propagated. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cb_cuda_llama.h"

#define CL_LOOKAHEAD 2 /* layers of cached KV enqueued ahead of the compute */

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
    float *h2;             /* [max_ctx][E] residual of the selected rows (blend) */
    cb_bf16_t *xn;         /* [R][E] normed rows */
    cb_bf16_t *qkv;        /* [R][QKVD] */
    cb_bf16_t *att;        /* [R][QD] */
    cb_bf16_t *gu;         /* [R][2F] */
    cb_bf16_t *act;        /* [R][F] */
    float *logits;         /* [V] */
    int32_t *tokens;       /* [max_ctx] for callers */
    int32_t *pos;          /* [max_ctx] row positions (blend: of the rows active up to the check layer) */
    int32_t *sel;          /* [max_ctx] selected rows (blend: indices into pos) */
    int32_t *psel;         /* [max_ctx] positions of the selected rows */
    int32_t *tok2;         /* [max_ctx] tokens of the active rows */
    uint8_t *mask;         /* [max_ctx] 0 candidate, 1 computed (top-k mask over the active rows) */
    float *dev;            /* [max_ctx] KV deviation */
    uint8_t *host_cls;     /* host [max_ctx] row classes */
    uint8_t *host_cov;     /* host [max_ctx] 1 = inside a span */
    uint8_t *host_am;      /* host [max_ctx] top-k mask of the active rows */
    int32_t *host_pos;     /* host [max_ctx] positions of the active rows */
    cb_cuda_event_t **ev;  /* [n_layer] "this layer's cached KV has arrived" (copy stream) */
    cb_cuda_event_t *ev_start;   /* compute stream: the copies of a request start after earlier compute */
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
    void *bufs[] = {m->kv, m->h, m->h2, m->xn, m->qkv, m->att, m->gu, m->act, m->logits, m->tokens, m->pos, m->sel,
                    m->psel, m->tok2, m->mask, m->dev};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cb_cuda_free(cu, bufs[i]);
    if (m->ev) {
        for (int l = 0; l < m->hp.n_layer; l++) cb_cuda_event_destroy(cu, &m->ev[l]);
        free(m->ev);
    }
    cb_cuda_event_destroy(cu, &m->ev_start);
    free(m->host_cls);
    free(m->host_cov);
    free(m->host_am);
    free(m->host_pos);
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
    m->ev = (cb_cuda_event_t **)calloc((size_t)hp->n_layer, sizeof *m->ev);
    m->host_cls = (uint8_t *)malloc(C);
    m->host_cov = (uint8_t *)malloc(C);
    m->host_am = (uint8_t *)malloc(C);
    m->host_pos = (int32_t *)malloc(C * 4);
    if (!m->L || !m->ev || !m->host_cls || !m->host_cov || !m->host_am || !m->host_pos) ok = false;
    for (int l = 0; ok && l < hp->n_layer; l++) {
        ALLOC(m->L[l].wqkv, (QD + 2 * KVD) * E * 2);
        ALLOC(m->L[l].wo, E * QD * 2);
        ALLOC(m->L[l].wgu, 2 * F * E * 2);
        ALLOC(m->L[l].wdown, E * F * 2);
        ALLOC(m->L[l].attn_norm, E * 4);
        ALLOC(m->L[l].ffn_norm, E * 4);
        if (ok && !(m->ev[l] = cb_cuda_event_new(cu, false))) ok = false;
    }
    m->weight_bytes = (hp->tied ? 1 : 2) * V * E * 2 + E * 4 +
                      (size_t)hp->n_layer * (((QD + 2 * KVD) * E + E * QD + 3 * F * E) * 2 + 2 * E * 4);
    ALLOC(m->kv, (size_t)hp->n_layer * 2 * C * KVD * 2);
    ALLOC(m->h, C * E * 4);
    ALLOC(m->h2, C * E * 4);
    ALLOC(m->xn, R * E * 2);
    ALLOC(m->qkv, R * (QD + 2 * KVD) * 2);
    ALLOC(m->att, R * QD * 2);
    ALLOC(m->gu, R * 2 * F * 2);
    ALLOC(m->act, R * F * 2);
    ALLOC(m->logits, V * 4);
    ALLOC(m->tokens, C * 4);
    ALLOC(m->pos, C * 4);
    ALLOC(m->sel, C * 4);
    ALLOC(m->psel, C * 4);
    ALLOC(m->tok2, C * 4);
    ALLOC(m->mask, C);
    ALLOC(m->dev, C * 4);
#undef ALLOC
    if (ok && !(m->ev_start = cb_cuda_event_new(cu, false))) ok = false;
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
 * then (rope) RoPE of q and k at pos [nr] (device). */
static int cl_qkv(cb_cuda_llama_t *m, int l, int nr, const float *hr, const int32_t *pos, cb_bf16_t *cap_k,
                  cb_bf16_t *cap_v, bool rope = true) {
    cb_cuda_t *cu = m->cu;
    const cl_layer_t *L = &m->L[l];
    const size_t kvb = (size_t)m->KVD * 2, qkvb = (size_t)m->QKVD * 2;
    TRY(cb_cuda_rmsnorm(cu, nr, m->E, hr, m->E, NULL, L->attn_norm, m->hp.rms_eps, m->xn, m->E));
    TRY(cb_cuda_gemm(cu, nr, m->QKVD, m->E, m->xn, m->E, L->wqkv, m->E, m->qkv, CB_CUDA_BF16, m->QKVD, 0.0f));
    if (cap_k) TRY(cb_cuda_copy_rows(cu, nr, kvb, cap_k, kvb, NULL, m->qkv + m->QD, qkvb, NULL));
    if (cap_v) TRY(cb_cuda_copy_rows(cu, nr, kvb, cap_v, kvb, NULL, m->qkv + m->QD + m->KVD, qkvb, NULL));
    if (!rope) return CB_CUDA_OK;
    TRY(cb_cuda_rope(cu, nr, m->hp.n_head, m->hp.head_dim, m->qkv, m->QKVD, m->qkv, m->QKVD, pos, 0, m->hp.rope_base));
    TRY(cb_cuda_rope(cu, nr, m->hp.n_head_kv, m->hp.head_dim, m->qkv + m->QD, m->QKVD, m->qkv + m->QD, m->QKVD, pos, 0,
                     m->hp.rope_base));
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

/* ------------------------------------------------------------------ blend */

/* Enqueues the cached KV of layer l for every span into the fused cache (host spans on the copy stream,
 * then the layer's event; device spans on the compute stream). Below the check layer only spans holding
 * LOADED rows are needed (every other row is recomputed there). */
static int cl_load_layer(cb_cuda_llama_t *m, const cb_cuda_blend_req_t *q, int l) {
    cb_cuda_t *cu = m->cu;
    for (int s = 0; s < q->n_spans; s++) {
        const cb_cuda_kv_span_t *sp = &q->spans[s];
        if (l < q->check_layer && !memchr(m->host_cls + sp->row0, CB_CL_ROW_LOADED, (size_t)sp->n)) continue;
        size_t bytes = (size_t)sp->n * m->KVD * 2;
        cb_bf16_t *kd = cl_kc(m, l) + (size_t)sp->row0 * m->KVD, *vd = cl_vc(m, l) + (size_t)sp->row0 * m->KVD;
        const cb_bf16_t *ks = sp->k + (size_t)l * sp->layer_stride, *vs = sp->v + (size_t)l * sp->layer_stride;
        if (sp->host) {
            TRY(cb_cuda_h2d(cu, CB_CUDA_STREAM_COPY, kd, ks, bytes));
            TRY(cb_cuda_h2d(cu, CB_CUDA_STREAM_COPY, vd, vs, bytes));
        } else {
            TRY(cb_cuda_d2d(cu, CB_CUDA_STREAM_COMPUTE, kd, ks, bytes));
            TRY(cb_cuda_d2d(cu, CB_CUDA_STREAM_COMPUTE, vd, vs, bytes));
        }
    }
    return cb_cuda_event_record(cu, m->ev[l], CB_CUDA_STREAM_COPY);
}

extern "C" int cb_cuda_llama_blend(cb_cuda_llama_t *m, const cb_cuda_blend_req_t *q) {
    cb_cuda_t *cu = m->cu;
    const int n = q->n, NL = m->hp.n_layer, check = q->check_layer;
    if (n < 1 || n > m->max_ctx || check < 0 || check >= NL || !(q->ratio >= 0.0f) || q->ratio > 1.0f ||
        q->n_spans < 0 || (q->n_spans && !q->spans) || !q->tokens) {
        fprintf(stderr, "cuda llama: bad blend request (n %d, check layer %d, ratio %g)\n", n, check, (double)q->ratio);
        return CB_CUDA_EINVAL;
    }
    /* Host side: each row's class; the rows active up to the check layer (A) and their top-k mask. */
    memset(m->host_cov, 0, (size_t)n);
    for (int s = 0; s < q->n_spans; s++) {
        const cb_cuda_kv_span_t *sp = &q->spans[s];
        if (sp->row0 < 0 || sp->n < 0 || sp->row0 > n - sp->n || !sp->k || !sp->v) {
            fprintf(stderr, "cuda llama: blend span %d [%d, +%d) outside the prompt of %d rows\n", s, sp->row0, sp->n, n);
            return CB_CUDA_EINVAL;
        }
        memset(m->host_cov + sp->row0, 1, (size_t)sp->n);
    }
    int n_act = 0, n_cand = 0, n_comp = 0;
    for (int i = 0; i < n; i++) {
        int c = q->row_class ? (int)q->row_class[i] : (m->host_cov[i] ? (int)CB_CL_ROW_CANDIDATE : (int)CB_CL_ROW_COMPUTED);
        if (c > CB_CL_ROW_CANDIDATE) {
            fprintf(stderr, "cuda llama: blend row %d has class %d\n", i, c);
            return CB_CUDA_EINVAL;
        }
        if ((c != CB_CL_ROW_COMPUTED && !m->host_cov[i]) || i == n - 1) c = CB_CL_ROW_COMPUTED;
        m->host_cls[i] = (uint8_t)c;
        if (c == CB_CL_ROW_LOADED) continue;
        m->host_pos[n_act] = i;
        m->host_am[n_act++] = c == CB_CL_ROW_COMPUTED;
        n_cand += c == CB_CL_ROW_CANDIDATE;
        n_comp += c == CB_CL_ROW_COMPUTED;
    }
    const int k = (int)((double)q->ratio * n_cand);
    const int n_sel = (k < n_cand ? k : n_cand) + n_comp;
    const size_t Eb = (size_t)m->E * 4;

    TRY(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, m->pos, m->host_pos, (size_t)n_act * 4));
    TRY(cb_cuda_h2d(cu, CB_CUDA_STREAM_COMPUTE, m->mask, m->host_am, (size_t)n_act));
    TRY(cb_cuda_copy_rows(cu, n_act, 4, m->tok2, 4, NULL, q->tokens, 4, m->pos));
    TRY(cb_cuda_embed(cu, m->tok2, n_act, m->tok_embd, m->hp.n_vocab, m->E, m->h));
    /* Copies into the fused cache must not overtake compute still reading it (an earlier request). */
    TRY(cb_cuda_event_record(cu, m->ev_start, CB_CUDA_STREAM_COMPUTE));
    TRY(cb_cuda_stream_wait(cu, CB_CUDA_STREAM_COPY, m->ev_start));
    int next_load = 0;
    for (; next_load < NL && next_load < CL_LOOKAHEAD; next_load++) TRY(cl_load_layer(m, q, next_load));

    for (int l = 0; l < NL; l++) {
        if (next_load < NL) TRY(cl_load_layer(m, q, next_load++));
        TRY(cb_cuda_stream_wait(cu, CB_CUDA_STREAM_COMPUTE, m->ev[l]));
        /* cached pre-RoPE K -> fused positions 0..n-1, in place (rows recomputed below are overwritten;
         * at the check layer this runs after the fresh pre-RoPE rows are stored, for the deviation) */
        if (l != check)
            TRY(cb_cuda_rope(cu, n, m->hp.n_head_kv, m->hp.head_dim, cl_kc(m, l), m->KVD, cl_kc(m, l), m->KVD, NULL,
                             0, m->hp.rope_base));
        if (l < check) {          /* every active row */
            for (int r0 = 0; r0 < n_act; r0 += m->R) {
                int nr = n_act - r0 < m->R ? n_act - r0 : m->R;
                float *hr = m->h + (size_t)r0 * m->E;
                TRY(cl_qkv(m, l, nr, hr, m->pos + r0, NULL, NULL));
                TRY(cl_store_kv(m, l, nr, m->pos + r0, 0));
                TRY(cl_attn_mlp(m, l, nr, hr, m->pos + r0, n, n));
            }
        } else if (l == check) {
            /* QKV of every active row; deviation of the fresh pre-RoPE K (or V) from the cached rows;
             * the fresh pre-RoPE K and V replace the cached rows; then the whole layer is rotated. */
            for (int r0 = 0; r0 < n_act; r0 += m->R) {
                int nr = n_act - r0 < m->R ? n_act - r0 : m->R;
                TRY(cl_qkv(m, l, nr, m->h + (size_t)r0 * m->E, m->pos + r0, NULL, NULL, false));
                const cb_bf16_t *fresh = m->qkv + m->QD + (q->metric_k ? 0 : m->KVD);
                const cb_bf16_t *cached = q->metric_k ? cl_kc(m, l) : cl_vc(m, l);
                TRY(cb_cuda_kv_deviation(cu, nr, m->KVD, fresh, m->QKVD, cached, m->KVD, m->pos + r0, m->dev + r0));
                TRY(cl_store_kv(m, l, nr, m->pos + r0, 0));
            }
            TRY(cb_cuda_rope(cu, n, m->hp.n_head_kv, m->hp.head_dim, cl_kc(m, l), m->KVD, cl_kc(m, l), m->KVD, NULL, 0,
                             m->hp.rope_base));
            TRY(cb_cuda_topk_select(cu, n_act, m->dev, m->mask, k, m->sel, NULL));
            TRY(cb_cuda_copy_rows(cu, n_sel, 4, m->psel, 4, NULL, m->pos, 4, m->sel));
            TRY(cb_cuda_copy_rows(cu, n_sel, Eb, m->h2, Eb, NULL, m->h, Eb, m->sel));
            for (int c0 = 0; c0 < n_sel; c0 += m->R) {
                int nc = n_sel - c0 < m->R ? n_sel - c0 : m->R;
                float *hr = m->h2 + (size_t)c0 * m->E;
                /* q of the selected rows only (their K/V are already in the cache) */
                TRY(cb_cuda_rmsnorm(cu, nc, m->E, hr, m->E, NULL, m->L[l].attn_norm, m->hp.rms_eps, m->xn, m->E));
                TRY(cb_cuda_gemm(cu, nc, m->QD, m->E, m->xn, m->E, m->L[l].wqkv, m->E, m->qkv, CB_CUDA_BF16, m->QKVD,
                                 0.0f));
                TRY(cb_cuda_rope(cu, nc, m->hp.n_head, m->hp.head_dim, m->qkv, m->QKVD, m->qkv, m->QKVD, m->psel + c0,
                                 0, m->hp.rope_base));
                TRY(cl_attn_mlp(m, l, nc, hr, m->psel + c0, n, n));
            }
        } else {
            /* the selected rows only; their fresh K/V overwrite the cached rows. Rows are ascending, so
             * every key a chunk's rows may see was written by this or an earlier chunk. */
            for (int c0 = 0; c0 < n_sel; c0 += m->R) {
                int nc = n_sel - c0 < m->R ? n_sel - c0 : m->R;
                float *hr = m->h2 + (size_t)c0 * m->E;
                TRY(cl_qkv(m, l, nc, hr, m->psel + c0, NULL, NULL));
                TRY(cl_store_kv(m, l, nc, m->psel + c0, 0));
                TRY(cl_attn_mlp(m, l, nc, hr, m->psel + c0, n, n));
            }
        }
    }
    /* The last selected row is row n-1 (always COMPUTED, the largest position). */
    TRY(cl_head(m, m->h2 + (size_t)(n_sel - 1) * m->E, q->out_token));
    if (q->out_selected) TRY(cb_cuda_d2d(cu, CB_CUDA_STREAM_COMPUTE, q->out_selected, m->psel, (size_t)n_sel * 4));
    if (q->n_selected) *q->n_selected = n_sel;
    return CB_CUDA_OK;
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
