/* cpu_attn.c: f32 attention of cpu_ops.h: the KV views' conversions (cb_cpu_kv_to_f32, cb_cpu_f32_to_f16),
 * the attention scratch's size, the softmax steps, the attention mass (cb_cpu_attn_mass), the one-row path
 * (GQA groups larger than ATT_MAX_G), the flash-style blocks of rows (sgemm over chunks of keys with an
 * online softmax), the choice of the blocks' arithmetic (cb_cpu_attn_math) and cb_cpu_attention, which
 * dispatches a call to the split-key decode kernel (cpu_attn_decode.c), the bf16 (cpu_attn_amx.c) or int16
 * (cpu_attn_i16.c) blocks, or the f32 blocks here. The layout of the scratch, the KV views and the job the
 * kernels share are in cpu_ops_internal.h.
 */
#include "cpu/cpu_ops.h"
#include "cpu/cpu_ops_internal.h"

#include <assert.h>
#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <string.h>

#include "format/quant.h"

/* ---------------------------------------------------------------- KV views */

void cb_cpu_f32_to_f16(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(void *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(void *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) dst[i] = cb_f32_to_f16(src[i]);
}

void cb_cpu_kv_to_f32(cb_kv_dtype_t dt, const void *src, float *dst, size_t n) { kv_to_f32(dt, src, dst, n); }

/* ---------------------------------------------------------------- attention */

size_t cb_cpu_attention_scratch(const cb_attn_geom_t *g, int max_rows, int max_keys, int nt) {
    (void)max_rows;
    return att_partial_floats(g, max_keys) + att_thread_floats(g, max_keys) * (size_t)(nt < 1 ? 1 : nt);
}

/* Unnormalised softmax of s[0:lim) in place (exp(s - max)), zeros in s[lim:L); returns 1 / sum. */
static float softmax_row(float *s, int lim, int L) {
    float mx = -INFINITY, sum = 0.0f;
    int j = 0;
#if CB_AVX512
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= lim; j += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + j));
    if (j < lim) { /* masked load: nothing is read past lim */
        __mmask16 k = (__mmask16)((1u << (lim - j)) - 1u);
        vmx = _mm512_mask_max_ps(vmx, k, vmx, _mm512_maskz_loadu_ps(k, s + j));
    }
    mx = _mm512_reduce_max_ps(vmx);
    vmx = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (j = 0; j + 16 <= lim; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmx));
        _mm512_storeu_ps(s + j, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (j < lim) {
        __mmask16 k = (__mmask16)((1u << (lim - j)) - 1u);
        __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vmx)));
        _mm512_mask_storeu_ps(s + j, k, e);
        vsum = _mm512_add_ps(vsum, e);
        j = lim;
    }
    sum = hsum16(vsum);
#elif CB_AVX2
    (void)j;
    mx = max_row8(s, lim);
    sum = exp_sub_sum8(s, lim, mx);
#else
    for (j = 0; j < lim; j++) mx = s[j] > mx ? s[j] : mx;
    for (j = 0; j < lim; j++) {
        float d = s[j] - mx;
        cb_cpu_exp(&d, &s[j], 1);
        sum += s[j];
    }
#endif
    if (L > lim) memset(s + lim, 0, sizeof(float) * (size_t)(L - lim));
    return 1.0f / sum;
}

/* Per KV head (one task each): Q block [G*R][hd], scores [G*R][keys], one KV head's K (then V) rows
 * gathered [keys][hd], and the head's mass [keys]. */
static size_t mass_task_floats(const cb_attn_geom_t *g, int max_keys) {
    size_t rows = (size_t)CB_CPU_MASS_ROWS * (size_t)(g->n_head / g->n_head_kv), keys = max_keys > 0 ? max_keys : 1;
    return rows * (size_t)g->head_dim + rows * keys + keys * (size_t)g->head_dim + keys;
}

size_t cb_cpu_attn_mass_scratch(const cb_attn_geom_t *g, int max_keys) {
    return (size_t)g->n_head_kv * mass_task_floats(g, max_keys);
}

/* One KV head's rows [L][hd] of pool plane base (K or V) as f32 (ld *ldx): in place when f32 and one run,
 * else gathered (converted from f16) into buf [L][hd]. */
static const float *mass_head_rows(const cb_cpu_kv_t *kv, const void *base, int kvh, int kvd, int hd, int L,
                                   float *buf, int *ldx) {
    if (kv->dtype == CB_KV_F16) {
        for (int p = 0, w; p < L; p += w) {
            w = kv_run(kv, p, L);
            cvt_rows_f16(kv_f16(base, kv_row(kv, p) * kvd + (size_t)kvh * hd), (size_t)kvd, w, hd,
                         buf + (size_t)p * hd, (size_t)hd);
        }
    } else if (kv_run(kv, 0, L) < L) {
        for (int p = 0; p < L; p++)
            memcpy(buf + (size_t)p * hd, kv_f32(base, kv_row(kv, p) * kvd + (size_t)kvh * hd), sizeof(float) * (size_t)hd);
    } else {
        *ldx = kvd;
        return kv_f32(base, kv_row(kv, 0) * kvd + (size_t)kvh * hd);
    }
    *ldx = hd;
    return buf;
}

typedef struct {
    const cb_attn_geom_t *g;
    const float *q;           /* [n][n_head*head_dim] */
    const cb_cpu_kv_t *kv;
    const int32_t *key_limit; /* [n] */
    int n, max_lim;
    float *out;               /* NULL, or [n][n_head*head_dim] */
    float *scratch;           /* [n_head_kv][mass_task_floats] */
    size_t task_floats;
} mass_job_t;

/* KV head kvh: every row block's scores as one GEMM over keys [0, L) (the same bits whatever the placement),
 * the softmax per row and head into the head's mass, and with out the probabilities' GEMM with V. */
static void mass_task(void *arg, int kvh, int thread) {
    (void)thread;
    const mass_job_t *j = arg;
    const cb_attn_geom_t *g = j->g;
    const int G = g->n_head / g->n_head_kv, hd = g->head_dim, qd = g->n_head * hd, kvd = g->n_head_kv * hd;
    float *Q = j->scratch + (size_t)kvh * j->task_floats;  /* [G*nr][hd] */
    float *S = Q + (size_t)CB_CPU_MASS_ROWS * G * hd;     /* [G*nr][L] */
    float *GX = S + (size_t)CB_CPU_MASS_ROWS * G * j->max_lim; /* [L][hd] */
    float *mass = GX + (size_t)j->max_lim * hd;           /* [L] */
    memset(mass, 0, sizeof(float) * (size_t)j->max_lim);
    for (int i0 = 0; i0 < j->n; i0 += CB_CPU_MASS_ROWS) {
        int nr = j->n - i0 < CB_CPU_MASS_ROWS ? j->n - i0 : CB_CPU_MASS_ROWS, M = G * nr, L = 0, ld;
        for (int i = 0; i < nr; i++) L = j->key_limit[i0 + i] > L ? j->key_limit[i0 + i] : L;
        for (int hh = 0; hh < G; hh++)
            for (int i = 0; i < nr; i++)
                memcpy(Q + ((size_t)hh * nr + i) * hd, j->q + (size_t)(i0 + i) * qd + (size_t)(kvh * G + hh) * hd,
                       sizeof(float) * (size_t)hd);
        const float *K = mass_head_rows(j->kv, j->kv->k, kvh, kvd, hd, L, GX, &ld);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, L, hd, g->scale, Q, hd, K, ld, 0.0f, S, L);
        for (int r = 0; r < M; r++) {
            float *s = S + (size_t)r * L;
            const int lim = j->key_limit[i0 + r % nr], lo = cb_attn_key_lo(g, lim);
            memset(s, 0, sizeof(float) * (size_t)lo); /* keys before the window: probability 0 */
            float inv = softmax_row(s + lo, lim - lo, L - lo); /* zeros in [lim, L) */
            for (int k = lo; k < lim; k++) {
                s[k] *= inv; /* the probabilities, for P·V too */
                mass[k] += s[k];
            }
        }
        if (!j->out) continue;
        const float *V = mass_head_rows(j->kv, j->kv->v, kvh, kvd, hd, L, GX, &ld);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, hd, L, 1.0f, S, L, V, ld, 0.0f, Q, hd);
        for (int hh = 0; hh < G; hh++)
            for (int i = 0; i < nr; i++)
                memcpy(j->out + (size_t)(i0 + i) * qd + (size_t)(kvh * G + hh) * hd, Q + ((size_t)hh * nr + i) * hd,
                       sizeof(float) * (size_t)hd);
    }
}

void cb_cpu_attn_mass(const cb_attn_geom_t *g, const float *q, int n, const cb_cpu_kv_t *kv, const int32_t *key_limit,
                      float *mass, float *out, float *scratch, cb_pool_t *pool) {
    if (n < 1) return;
    int L = 0;
    for (int i = 0; i < n; i++) L = key_limit[i] > L ? key_limit[i] : L;
    /* the tasks' areas laid out for L keys: within the max_keys layout the scratch was sized for */
    mass_job_t j = {g, q, kv, key_limit, n, L, out, scratch, mass_task_floats(g, L)};
    if (pool) cb_pool_run(pool, g->n_head_kv, mass_task, &j);
    else
        for (int t = 0; t < g->n_head_kv; t++) mass_task(&j, t, 0);
    for (int t = 0; t < g->n_head_kv; t++) { /* the heads' masses in head order: the same bits on any pool */
        const float *m = scratch + (size_t)t * j.task_floats + j.task_floats - (size_t)L;
        for (int k = 0; k < L; k++) mass[k] += m[k];
    }
}

/* Row j's head kvh of pool plane base (K or V) as f32: in place, or converted into cvt [hd] (f16). */
static inline const float *head_f32(const cb_cpu_kv_t *kv, const void *base, int j, int kvh, int kvd, int hd,
                                    float *cvt) {
    const size_t e = kv_row(kv, j) * kvd + (size_t)kvh * hd;
    if (kv->dtype != CB_KV_F16) return kv_f32(base, e);
    kv_to_f32(CB_KV_F16, kv_f16(base, e), cvt, (size_t)hd);
    return cvt;
}

/* One query row, one head (kv head kvh): out[hd] = softmax(q·K[lo:lim)ᵀ·scale) · V, lo the window's first key.
 * s: [lim] scratch; cvt: [hd] (f16 pools). */
static void attend_row(const cb_attn_geom_t *g, const float *q, const cb_cpu_kv_t *kv, int kvh, int kvd, int lim,
                       float *s, float *cvt, float *out) {
    const int hd = g->head_dim, lo = cb_attn_key_lo(g, lim);
    for (int j = lo; j < lim; j++) s[j - lo] = dot_f32(q, head_f32(kv, kv->k, j, kvh, kvd, hd, cvt), hd) * g->scale;
    float inv = softmax_row(s, lim - lo, lim - lo);
    memset(out, 0, sizeof(float) * (size_t)hd);
    for (int j = lo; j < lim; j++) {
        const float *v = head_f32(kv, kv->v, j, kvh, kvd, hd, cvt);
        float p = s[j - lo];
        for (int d = 0; d < hd; d++) out[d] += p * v[d];
    }
    scale_row(out, hd, inv);
}

static void attn_row_task(void *arg, int t, int thread) {
    const attn_job_t *j = arg;
    const cb_attn_geom_t *g = j->g;
    const int H = g->n_head, hd = g->head_dim, G = H / g->n_head_kv, qd = H * hd, kvd = g->n_head_kv * hd;
    int i = t / H, h = t % H, kvh = h / G;
    float *s = j->scratch + (size_t)thread * j->per_thread;
    attend_row(g, j->q + (size_t)i * qd + (size_t)h * hd, j->kv, kvh, kvd, j->key_limit[i], s, s + j->cvt_offset,
               j->out + (size_t)i * qd + (size_t)h * hd);
}

/* Online-softmax step over one chunk of keys: s[0:w) are the chunk's scores, of which [0, lim) are
 * allowed (lim <= 0: none). Updates the row's running max *m and sum *l, replaces s by
 * exp(s - max) (zeros past lim) and returns the factor by which the row's output so far must be
 * rescaled (exp(old max - new max)). */
float online_softmax(float *s, int lim, int w, float *m, float *l) {
    if (lim <= 0) {
        memset(s, 0, sizeof(float) * (size_t)w);
        return 1.0f;
    }
    if (lim > w) lim = w;
    float mx = -INFINITY;
    int j = 0;
#if CB_AVX512
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= lim; j += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + j));
    if (j < lim) { /* masked load: nothing is read past lim */
        __mmask16 k = (__mmask16)((1u << (lim - j)) - 1u);
        vmx = _mm512_mask_max_ps(vmx, k, vmx, _mm512_maskz_loadu_ps(k, s + j));
    }
    mx = _mm512_reduce_max_ps(vmx);
#elif CB_AVX2
    mx = max_row8(s, lim);
#else
    for (; j < lim; j++) mx = s[j] > mx ? s[j] : mx;
#endif
    float m_new = mx > *m ? mx : *m, alpha = 0.0f;
    if (*m != -INFINITY) {
        float d = *m - m_new;
        cb_cpu_exp(&d, &alpha, 1);
    }
    float sum = 0.0f;
    j = 0;
#if CB_AVX512
    __m512 vm = _mm512_set1_ps(m_new), vsum = _mm512_setzero_ps();
    for (; j + 16 <= lim; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
        _mm512_storeu_ps(s + j, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (j < lim) {
        __mmask16 k = (__mmask16)((1u << (lim - j)) - 1u);
        __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vm)));
        _mm512_mask_storeu_ps(s + j, k, e);
        vsum = _mm512_add_ps(vsum, e);
        j = lim;
    }
    sum = hsum16(vsum);
#elif CB_AVX2
    (void)j;
    sum = exp_sub_sum8(s, lim, m_new);
#else
    for (; j < lim; j++) {
        float d = s[j] - m_new;
        cb_cpu_exp(&d, &s[j], 1);
        sum += s[j];
    }
#endif
    if (w > lim) memset(s + lim, 0, sizeof(float) * (size_t)(w - lim));
    *l = *l * alpha + sum;
    *m = m_new;
    return alpha;
}

/* Block of rb rows x one KV head (its G query heads stacked as M rows), flash-style over chunks of
 * ATT_KEY_CHUNK keys so the score tile stays in L2: S = scale·Qg·K[c0:c1]ᵀ (sgemm), online softmax
 * per row with its own key limit, O = O·alpha + S·V[c0:c1] (sgemm, beta = 1); finally O / sum. */
static void attn_block_task(void *arg, int t, int thread) {
    const attn_job_t *j = arg;
    const cb_attn_geom_t *g = j->g;
    const int H = g->n_head, HKV = g->n_head_kv, hd = g->head_dim, G = H / HKV, qd = H * hd, kvd = HKV * hd;
    const int rb = j->rb, blk = t / HKV, kvh = t % HKV;
    int i0 = blk * rb, nr = i0 + rb <= j->n ? rb : j->n - i0, M = G * nr;
    int L = 0, Lo = INT_MAX; /* keys [Lo, L): every row's window */
    for (int i = 0; i < nr; i++) {
        const int lim = j->key_limit[i0 + i], lo = cb_attn_key_lo(g, lim);
        L = lim > L ? lim : L;
        Lo = lo < Lo ? lo : Lo;
    }
    float *Q = j->scratch + (size_t)thread * j->per_thread; /* [G*rb][hd] */
    float *O = Q + (size_t)G * ATT_BLOCK_ROWS * hd;          /* [G*rb][hd] */
    float *S = O + (size_t)G * ATT_BLOCK_ROWS * hd;          /* [G*rb][ATT_KEY_CHUNK] */
    float *GK = att_gather_k(Q, G, hd);                     /* [ATT_KEY_CHUNK][hd] gathered K, after S */
    float *GV = GK + (size_t)ATT_KEY_CHUNK * hd;             /* [ATT_KEY_CHUNK][hd] gathered V */
    float m[ATT_MAX_G * ATT_BLOCK_ROWS], l[ATT_MAX_G * ATT_BLOCK_ROWS];
    for (int hh = 0; hh < G; hh++)
        for (int i = 0; i < nr; i++)
            memcpy(Q + ((size_t)hh * nr + i) * hd, j->q + (size_t)(i0 + i) * qd + (size_t)(kvh * G + hh) * hd,
                   sizeof(float) * (size_t)hd);
    for (int r = 0; r < M; r++) m[r] = -INFINITY, l[r] = 0.0f;
    const cb_cpu_kv_t *kv = j->kv;
    for (int c0 = Lo; c0 < L; c0 += ATT_KEY_CHUNK) {
        int w = L - c0 < ATT_KEY_CHUNK ? L - c0 : ATT_KEY_CHUNK, ld;
        const float *K, *V;
        chunk_kv(kv, kvh, kvd, hd, c0, w, GK, GV, &K, &V, &ld);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, w, hd, g->scale, Q, hd, K, ld, 0.0f, S, w);
        for (int r = 0; r < M; r++) {
            const int lim = j->key_limit[i0 + r % nr] - c0, lo = cb_attn_key_lo(g, lim + c0) - c0;
            float *sr = S + (size_t)r * w, alpha = 1.0f;
            if (lo <= 0) {
                alpha = online_softmax(sr, lim, w, &m[r], &l[r]);
            } else { /* keys before the row's window: weight 0 */
                memset(sr, 0, sizeof(float) * (size_t)(lo < w ? lo : w));
                if (lo < w) alpha = online_softmax(sr + lo, lim - lo, w - lo, &m[r], &l[r]);
            }
            if (c0 > Lo && alpha != 1.0f) scale_row(O + (size_t)r * hd, hd, alpha);
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, hd, w, 1.0f, S, w, V, ld, c0 > Lo ? 1.0f : 0.0f, O,
                    hd);
    }
    for (int hh = 0; hh < G; hh++)
        for (int i = 0; i < nr; i++) {
            float *dst = j->out + (size_t)(i0 + i) * qd + (size_t)(kvh * G + hh) * hd;
            const float *src = O + ((size_t)hh * nr + i) * hd, a = 1.0f / l[hh * nr + i];
            for (int d = 0; d < hd; d++) dst[d] = src[d] * a;
        }
}

cb_attn_math_t cb_cpu_attn_math(cb_attn_math_t asked) {
    switch (asked) {
    case CB_ATTN_BF16: return cb_cpu_attn_bf16_supported() ? CB_ATTN_BF16 : CB_ATTN_F32;
    case CB_ATTN_I16: return cb_cpu_attn_i16_supported() ? CB_ATTN_I16 : CB_ATTN_F32;
    case CB_ATTN_AUTO:
        return cb_cpu_attn_bf16_supported() ? CB_ATTN_BF16 : cb_cpu_attn_i16_supported() ? CB_ATTN_I16 : CB_ATTN_F32;
    default: return CB_ATTN_F32;
    }
}

const char *cb_cpu_attn_name(cb_attn_math_t asked) {
    switch (cb_cpu_attn_math(asked)) {
    case CB_ATTN_BF16: return "bf16 (AMX)";
    case CB_ATTN_I16: return "int16 (VNNI)";
    default:
        return asked == CB_ATTN_BF16  ? "f32 (no AMX)"
               : asked == CB_ATTN_I16 ? "f32 (no VNNI)"
               : asked == CB_ATTN_AUTO ? "f32 (no AMX or VNNI)"
                                       : "f32";
    }
}

void cb_cpu_attention(const cb_attn_geom_t *g, const float *q, int n, const cb_cpu_kv_t *kv, const int32_t *key_limit,
                      float *out, float *scratch, int max_keys, cb_pool_t *pool) {
    const int H = g->n_head, HKV = g->n_head_kv, nt = cb_pool_size(pool);
    int max_lim = 0, max_span = 0; /* span: keys a row sees (its window) */
    for (int i = 0; i < n; i++) {
        assert(key_limit[i] >= 1 && key_limit[i] <= max_keys);
        const int span = key_limit[i] - cb_attn_key_lo(g, key_limit[i]);
        max_lim = key_limit[i] > max_lim ? key_limit[i] : max_lim;
        max_span = span > max_span ? span : max_span;
    }
    attn_job_t j = {g, q, kv, key_limit, out, scratch, att_thread_floats(g, max_keys),
                    att_partial_floats(g, max_keys), att_cvt_offset(g, max_keys), att_bf16_offset(g, max_keys),
                    NULL, 0, n, ATT_BLOCK_ROWS, 0, 0};
    float *thread_scratch = scratch + j.partial_floats;
    if (H / HKV > ATT_MAX_G) { /* one task per (row, head) */
        j.scratch = thread_scratch;
        cb_pool_run(pool, n * H, attn_row_task, &j);
        return;
    }
    if (n <= ATT_SPLIT_ROWS) { /* decode: split the keys so that every thread has work */
        j.chunk = split_chunk(max_span, n, HKV, nt);
        j.n_chunks = (max_span + j.chunk - 1) / j.chunk;
        cb_pool_run(pool, n * HKV * j.n_chunks, attn_split_task, &j);
        attn_split_merge(&j);
        return;
    }
    j.scratch = thread_scratch;
    while (j.rb > 8 && ((n + j.rb - 1) / j.rb) * HKV < 4 * nt) j.rb /= 2;
#if CB_AVX512
    /* the reduced-precision blocks have no window: a windowed call takes the f32 blocks */
    const cb_attn_math_t math = max_span < max_lim ? CB_ATTN_F32 : cb_cpu_attn_math(g->math);
    if (math == CB_ATTN_I16 && g->head_dim % 64 == 0 && g->head_dim <= 256) {
        j.pack = (uint16_t *)(void *)scratch;
        j.max_lim = max_lim;
        j.n_chunks = (max_lim + ATT_KEY_CHUNK - 1) / ATT_KEY_CHUNK;
        cb_pool_run(pool, HKV * j.n_chunks, attn_pack_i16_task, &j);
        cb_pool_run(pool, ((n + j.rb - 1) / j.rb) * HKV, attn_block_i16_task, &j);
        return;
    }
    if (math == CB_ATTN_BF16 && g->head_dim % 64 == 0) {
        j.pack = (uint16_t *)(void *)scratch;
        j.max_lim = max_lim;
        j.n_chunks = (max_lim + ATT_KEY_CHUNK - 1) / ATT_KEY_CHUNK;
        cb_pool_run(pool, HKV * j.n_chunks, attn_pack_amx_task, &j);
        cb_pool_run(pool, ((n + j.rb - 1) / j.rb) * HKV, attn_block_amx_task, &j);
        return;
    }
#endif
    cb_pool_run(pool, ((n + j.rb - 1) / j.rb) * HKV, attn_block_task, &j);
}
