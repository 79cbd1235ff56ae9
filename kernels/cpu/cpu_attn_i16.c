/* cpu_attn_i16.c: the int16 prefill blocks of cb_cpu_attention (g->math = CB_ATTN_I16) on AVX512-VNNI,
 * compiled when the build targets AVX-512 (CB_AVX512) for the VNNI ISA whatever -march says, and the check
 * that this CPU runs them (cb_cpu_attn_i16_supported). Shared helpers: cpu_ops_internal.h.
 */
#include "cpu/cpu_ops.h"
#include "cpu/cpu_ops_internal.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

/* ---------------------------------------------------------------- int16 prefill blocks (AVX512-VNNI) */

#if CB_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
/* The block, online softmax and chunking of attn_block_task with both products as int16 pairs summed in
 * int32 by vpdpwssd (32 multiply-adds an instruction, twice the f32 FMA's at the same rate on CPUs without
 * AMX). Every operand is rounded to an integer grid scaled per row:
 *   q·scale and K: per query row / per key, |x| <= i16_qk_max(hd) (5792 for head_dim 64: hd products of
 *     two such never leave int32), so the score's only error is each operand's rounding, <= 2^-13.5 of the
 *     row's largest |value| (f16, which llama.cpp rounds q to, keeps 2^-11 of each value);
 *   V: per key, |v| <= I16_PV_MAX; its scale folds into the weight: p'[k] = exp(s[k] - m) · vscale[k];
 *   p': per row and chunk, 0..I16_PV_MAX of the row's largest p' in the chunk; P·V's int32 sums move to
 *     f32 every I16_PV_FLUSH keys (64 · 5792² < 2^31).
 * The weights' sum l is the f32 sum of the unrounded exp.
 * Once per call, shared by every block (attn_pack_i16_task), per KV head and chunk of ATT_KEY_CHUNK keys,
 * in the bf16 blocks' place (4 · ATT_KEY_CHUNK · hd uint16 a chunk):
 *   Kq [hd/2][ATT_KEY_CHUNK][2] int16   K as dimension pairs, keys across
 *   Vq [ATT_KEY_CHUNK/2][hd][2] int16   V as key pairs, dimensions across
 *   ks, vs [ATT_KEY_CHUNK] f32          each key's K and V scale (0 past the call's largest limit)
 * Per block of rows (attn_block_i16_task), for a chunk of w keys (wp = w rounded up to 32):
 *   Qq [Mp][hd] int16, qs [Mp]   q·scale and its row scales (M rows, G heads stacked; Mp = M rounded up
 *                                to 4, the pad rows zero)
 *   S  [Mp][wp] f32              scores, then the exp in place; P [Mp][wp] int16, ps [Mp] the weights
 *   O  [Mp][hd] f32              the output so far */
#define I16_PV_MAX 5792
#define I16_PV_FLUSH 64

/* Largest |integer| of q and k for head_dim hd: hd · m² < 2^31. */
static int i16_qk_max(int hd) { return (int)floor(sqrt(2147483647.0 / hd)); }

/* dst[0:n) = round(x · a / scale) with scale = max |x · a| / m (n % 16 == 0, a > 0); returns scale (0 for
 * a zero row, whose dst is zero). Stores only through intrinsics (dst may be read as int32 pairs). */
static float i16_row(const float *x, int n, float a, int m, int16_t *dst) {
    __m512 mx = _mm512_setzero_ps();
    for (int d = 0; d < n; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
    const float amax = _mm512_reduce_max_ps(mx) * a;
    const __m512 f = _mm512_set1_ps(amax > 0.0f ? a * (float)m / amax : 0.0f);
    for (int d = 0; d < n; d += 16)
        _mm256_storeu_si256((__m256i *)(void *)(dst + d),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + d), f))));
    return amax > 0.0f ? amax / (float)m : 0.0f;
}

/* Task (KV head, chunk of keys): the chunk's Kq, Vq, ks, vs into the shared region, once per call. */
void attn_pack_i16_task(void *arg, int t, int thread) {
    const attn_job_t *j = arg;
    const cb_attn_geom_t *g = j->g;
    const int hd = g->head_dim, G = g->n_head / g->n_head_kv, kvd = g->n_head_kv * hd, qk = i16_qk_max(hd);
    const int kvh = t / j->n_chunks, c0 = (t % j->n_chunks) * ATT_KEY_CHUNK;
    const int w = j->max_lim - c0 < ATT_KEY_CHUNK ? j->max_lim - c0 : ATT_KEY_CHUNK, wp = (w + 31) / 32 * 32;
    float *GK = att_gather_k(j->scratch + (size_t)thread * j->per_thread, G, hd);
    float *GV = GK + (size_t)ATT_KEY_CHUNK * hd;
    uint16_t *base = j->pack + (size_t)t * 4 * ATT_KEY_CHUNK * hd;
    uint32_t *Kq = (uint32_t *)(void *)base;                       /* [hd/2][ATT_KEY_CHUNK] pairs */
    int16_t *Vq = (int16_t *)(void *)(base + (size_t)ATT_KEY_CHUNK * hd); /* [ATT_KEY_CHUNK/2][hd][2] */
    float *ks = (float *)(void *)(base + (size_t)2 * ATT_KEY_CHUNK * hd), *vs = ks + ATT_KEY_CHUNK;
    int ld;
    const float *K, *V;
    chunk_kv(j->kv, kvh, kvd, hd, c0, w, GK, GV, &K, &V, &ld);
    uint32_t row[128]; /* one key's K as int16 pairs (hd <= 256) */
    int16_t va[256], vb[256];
    for (int k = 0; k < wp; k++) {
        if (k < w) ks[k] = i16_row(K + (size_t)k * ld, hd, 1.0f, qk, (int16_t *)(void *)row);
        else ks[k] = 0.0f, memset(row, 0, sizeof row);
        for (int d2 = 0; d2 < hd / 2; d2++) Kq[(size_t)d2 * ATT_KEY_CHUNK + k] = row[d2];
    }
    __m512i ilo = _mm512_setzero_si512(), ihi = ilo; /* (a[i], b[i]) for i = 0..15, then 16..31 */
    {
        int16_t lo[32], hi[32];
        for (int i = 0; i < 32; i++) lo[i] = (int16_t)((i >> 1) | ((i & 1) << 5)), hi[i] = (int16_t)(lo[i] + 16);
        ilo = _mm512_loadu_si512(lo), ihi = _mm512_loadu_si512(hi);
    }
    for (int k = 0; k < wp; k += 2) {
        if (k < w) vs[k] = i16_row(V + (size_t)k * ld, hd, 1.0f, I16_PV_MAX, va);
        else vs[k] = 0.0f, memset(va, 0, sizeof va);
        if (k + 1 < w) vs[k + 1] = i16_row(V + (size_t)(k + 1) * ld, hd, 1.0f, I16_PV_MAX, vb);
        else vs[k + 1] = 0.0f, memset(vb, 0, sizeof vb);
        int16_t *dst = Vq + (size_t)(k / 2) * hd * 2;
        for (int d = 0; d < hd; d += 32) {
            const __m512i a = _mm512_loadu_si512(va + d), b = _mm512_loadu_si512(vb + d);
            _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(a, ilo, b));
            _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(a, ihi, b));
        }
    }
}

/* acc + the pairwise products of a and b (vpdpwssd). Through asm: gcc 12 compiles the intrinsic with a
 * copy and a spill of every accumulator per instruction in these kernels (measured: slower than the f32
 * blocks); the "+v" operand keeps each accumulator in its register. */
static inline __m512i i16_dp(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* The micro-kernels below name their accumulators one by one (an array of them, even fully unrolled, is
 * spilled by gcc): I16_R4 / I16_R12 / I16_R2 / I16_R6 apply X to each row index of a tile. */
#define I16_R2(X) X(0) X(1)
#define I16_R4(X) X(0) X(1) X(2) X(3)
#define I16_R6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define I16_R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

/* S[r][n0 + 0:32) for rows r0..r0+R-1 (R = 12 or 4, as EACH): R x 32 keys of scores, hd/2 dimension pairs
 * of vpdpwssd each, then scaled by qs[r] · ks[k]. */
#define I16_SC_ZERO(r) __m512i a##r##0 = _mm512_setzero_si512(), a##r##1 = a##r##0;
#define I16_SC_STEP(r)                                                                                         \
    {                                                                                                          \
        int32_t qp;                                                                                            \
        memcpy(&qp, q0 + (size_t)(r) * hd + 2 * d2, sizeof qp);                                                \
        const __m512i b = _mm512_set1_epi32(qp);                                                               \
        a##r##0 = i16_dp(a##r##0, b, k0);                                                         \
        a##r##1 = i16_dp(a##r##1, b, k1);                                                         \
    }
#define I16_SC_STORE(r)                                                                                        \
    {                                                                                                          \
        const __m512 q = _mm512_set1_ps(qs[r0 + (r)]);                                                         \
        float *s = S + (size_t)(r0 + (r)) * wp + n0;                                                           \
        _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_cvtepi32_ps(a##r##0), _mm512_mul_ps(q, s0)));                 \
        _mm512_storeu_ps(s + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(a##r##1), _mm512_mul_ps(q, s1)));            \
    }
#define I16_SCORES_TILE(NAME, EACH)                                                                            \
    static void NAME(const int16_t *Qq, const float *qs, int r0, int hd, const int16_t *Kq, const float *ks,    \
                     int n0, int wp, float *S) {                                                               \
        const int16_t *q0 = Qq + (size_t)r0 * hd;                                                              \
        EACH(I16_SC_ZERO)                                                                                      \
        for (int d2 = 0; d2 < hd / 2; d2++) {                                                                  \
            const int16_t *kp = Kq + ((size_t)d2 * ATT_KEY_CHUNK + n0) * 2;                                    \
            const __m512i k0 = _mm512_loadu_si512(kp), k1 = _mm512_loadu_si512(kp + 32);                       \
            EACH(I16_SC_STEP)                                                                                  \
        }                                                                                                      \
        const __m512 s0 = _mm512_loadu_ps(ks + n0), s1 = _mm512_loadu_ps(ks + n0 + 16);                        \
        EACH(I16_SC_STORE)                                                                                     \
    }
I16_SCORES_TILE(i16_scores_12, I16_R12)
I16_SCORES_TILE(i16_scores_4, I16_R4)

/* S [Mp][wp] = (Qq·Kqᵀ) · qs[r] · ks[k] (Mp % 4 == 0, wp % 32 == 0). */
static void i16_scores(const int16_t *Qq, const float *qs, int Mp, int hd, const int16_t *Kq, const float *ks, int wp,
                       float *S) {
    for (int n0 = 0; n0 < wp; n0 += 32) {
        int r0 = 0;
        for (; r0 + 12 <= Mp; r0 += 12) i16_scores_12(Qq, qs, r0, hd, Kq, ks, n0, wp, S);
        for (; r0 < Mp; r0 += 4) i16_scores_4(Qq, qs, r0, hd, Kq, ks, n0, wp, S);
    }
}

/* O[r][d0 + 0:64) += ps[r] · sum_k P[r][k] Vq[k][d0 + .] for rows r0..r0+R-1 (R = 6 or 2, as EACH), the
 * int32 sums moved to f32 every I16_PV_FLUSH keys. */
#define I16_PV_ZERO(r) a##r##0 = a##r##1 = a##r##2 = a##r##3 = _mm512_setzero_si512();
#define I16_PV_DECL(r) __m512i a##r##0, a##r##1, a##r##2, a##r##3;
#define I16_PV_STEP(r)                                                                                         \
    {                                                                                                          \
        int32_t pp;                                                                                            \
        memcpy(&pp, p0 + (size_t)(r) * wp + 2 * k2, sizeof pp);                                                \
        const __m512i b = _mm512_set1_epi32(pp);                                                               \
        a##r##0 = i16_dp(a##r##0, b, v0);                                                         \
        a##r##1 = i16_dp(a##r##1, b, v1);                                                         \
        a##r##2 = i16_dp(a##r##2, b, v2);                                                         \
        a##r##3 = i16_dp(a##r##3, b, v3);                                                         \
    }
#define I16_PV_FLUSH_ROW(r)                                                                                    \
    {                                                                                                          \
        const __m512 a = _mm512_set1_ps(ps[r0 + (r)]);                                                         \
        float *o = O + (size_t)(r0 + (r)) * hd + d0;                                                           \
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##r##0), a, _mm512_loadu_ps(o)));              \
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##r##1), a, _mm512_loadu_ps(o + 16)));    \
        _mm512_storeu_ps(o + 32, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##r##2), a, _mm512_loadu_ps(o + 32)));    \
        _mm512_storeu_ps(o + 48, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##r##3), a, _mm512_loadu_ps(o + 48)));    \
    }
#define I16_PV_TILE(NAME, EACH)                                                                                \
    static void NAME(const int16_t *P, const float *ps, int r0, int wp, const int16_t *Vq, int hd, int d0,      \
                     float *O) {                                                                               \
        const int16_t *p0 = P + (size_t)r0 * wp;                                                               \
        EACH(I16_PV_DECL)                                                                                      \
        for (int f0 = 0; f0 < wp / 2; f0 += I16_PV_FLUSH / 2) {                                                \
            const int f1 = f0 + I16_PV_FLUSH / 2 < wp / 2 ? f0 + I16_PV_FLUSH / 2 : wp / 2;                    \
            EACH(I16_PV_ZERO)                                                                                  \
            for (int k2 = f0; k2 < f1; k2++) {                                                                 \
                const int16_t *vp = Vq + ((size_t)k2 * hd + d0) * 2;                                           \
                const __m512i v0 = _mm512_loadu_si512(vp), v1 = _mm512_loadu_si512(vp + 32);                   \
                const __m512i v2 = _mm512_loadu_si512(vp + 64), v3 = _mm512_loadu_si512(vp + 96);              \
                EACH(I16_PV_STEP)                                                                              \
            }                                                                                                  \
            EACH(I16_PV_FLUSH_ROW)                                                                             \
        }                                                                                                      \
    }
I16_PV_TILE(i16_pv_6, I16_R6)
I16_PV_TILE(i16_pv_2, I16_R2)

/* O [Mp][hd] += ps · P · Vq (Mp % 2 == 0, hd % 64 == 0). */
static void i16_pv(const int16_t *P, const float *ps, int Mp, int wp, const int16_t *Vq, int hd, float *O) {
    for (int d0 = 0; d0 < hd; d0 += 64) {
        int r0 = 0;
        for (; r0 + 6 <= Mp; r0 += 6) i16_pv_6(P, ps, r0, wp, Vq, hd, d0, O);
        for (; r0 < Mp; r0 += 2) i16_pv_2(P, ps, r0, wp, Vq, hd, d0, O);
    }
}

/* The online-softmax step of one row over a chunk (online_softmax's contract) with the weights
 * p'[k] = exp(s[k] - m) · vs[k] rounded onto 0..I16_PV_MAX of their largest: p [wp] int16, *psc their scale
 * (0 when every weight is 0). s [wp] gets the exp (zeros past lim). */
static float i16_softmax_row(float *s, int lim, int wp, const float *vs, float *m, float *l, int16_t *p, float *psc) {
    if (lim <= 0) {
        memset(p, 0, sizeof(int16_t) * (size_t)wp);
        *psc = 0.0f;
        return 1.0f;
    }
    if (lim > wp) lim = wp;
    float m_new;
    const float alpha = block_max_step(s, lim, *m, &m_new);
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps(), wmax = _mm512_setzero_ps();
    for (int k = 0; k < wp; k += 16) { /* wp % 16 == 0 */
        const __mmask16 mk = lim - k >= 16 ? 0xFFFF : lim - k <= 0 ? 0 : (__mmask16)((1u << (lim - k)) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + k), vm)));
        _mm512_storeu_ps(s + k, e);
        sum = _mm512_add_ps(sum, e);
        wmax = _mm512_max_ps(wmax, _mm512_mul_ps(e, _mm512_loadu_ps(vs + k)));
    }
    const float top = _mm512_reduce_max_ps(wmax);
    const __m512 f = _mm512_set1_ps(top > 0.0f ? (float)I16_PV_MAX / top : 0.0f);
    for (int k = 0; k < wp; k += 16)
        _mm256_storeu_si256((__m256i *)(void *)(p + k),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(
                                _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(s + k), _mm512_loadu_ps(vs + k)), f))));
    *psc = top > 0.0f ? top / (float)I16_PV_MAX : 0.0f;
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = m_new;
    return alpha;
}

void attn_block_i16_task(void *arg, int t, int thread) {
    const attn_job_t *j = arg;
    const cb_attn_geom_t *g = j->g;
    const int H = g->n_head, HKV = g->n_head_kv, hd = g->head_dim, G = H / HKV, qd = H * hd, qk = i16_qk_max(hd);
    const int rb = j->rb, blk = t / HKV, kvh = t % HKV;
    const int i0 = blk * rb, nr = i0 + rb <= j->n ? rb : j->n - i0, M = G * nr, Mp = (M + 3) / 4 * 4;
    int L = 0;
    for (int i = 0; i < nr; i++) L = j->key_limit[i0 + i] > L ? j->key_limit[i0 + i] : L;
    float *base = j->scratch + (size_t)thread * j->per_thread;
    int16_t *Qq = (int16_t *)(void *)base;                 /* [Mp][hd], in the Q block's first half */
    float *qs = base + (size_t)G * ATT_BLOCK_ROWS * hd / 2; /* [Mp], in its second half */
    float *ps = qs + (size_t)G * ATT_BLOCK_ROWS;            /* [Mp] */
    float *O = base + (size_t)G * ATT_BLOCK_ROWS * hd;      /* [Mp][hd] */
    float *S = O + (size_t)G * ATT_BLOCK_ROWS * hd;         /* [Mp][wp] */
    int16_t *P = (int16_t *)(void *)(base + j->bf16_offset); /* [Mp][wp] */
    float m[ATT_MAX_G * ATT_BLOCK_ROWS], l[ATT_MAX_G * ATT_BLOCK_ROWS];
    for (int r = 0; r < Mp; r++) {
        if (r >= M) {
            memset(Qq + (size_t)r * hd, 0, sizeof(int16_t) * (size_t)hd);
            qs[r] = 0.0f;
            continue;
        }
        const float *src = j->q + (size_t)(i0 + r % nr) * qd + (size_t)(kvh * G + r / nr) * hd;
        qs[r] = i16_row(src, hd, g->scale, qk, Qq + (size_t)r * hd);
        m[r] = -INFINITY, l[r] = 0.0f;
    }
    memset(O, 0, sizeof(float) * (size_t)Mp * hd);
    for (int c0 = 0; c0 < L; c0 += ATT_KEY_CHUNK) {
        const int w = L - c0 < ATT_KEY_CHUNK ? L - c0 : ATT_KEY_CHUNK, wp = (w + 31) / 32 * 32;
        /* the chunk's pack (for the call's largest limit: keys w..wp-1 may hold real keys, which the
         * softmax masks) */
        const uint16_t *pk = j->pack + ((size_t)kvh * j->n_chunks + (size_t)(c0 / ATT_KEY_CHUNK)) * 4 * ATT_KEY_CHUNK * hd;
        const int16_t *Kq = (const int16_t *)(const void *)pk, *Vq = Kq + (size_t)ATT_KEY_CHUNK * hd;
        const float *ks = (const float *)(const void *)(pk + (size_t)2 * ATT_KEY_CHUNK * hd), *vs = ks + ATT_KEY_CHUNK;
        i16_scores(Qq, qs, Mp, hd, Kq, ks, wp, S);
        for (int r = 0; r < Mp; r++) {
            float *s = S + (size_t)r * wp;
            int16_t *p = P + (size_t)r * wp;
            if (r >= M) {
                memset(p, 0, sizeof(int16_t) * (size_t)wp);
                ps[r] = 0.0f;
                continue;
            }
            float alpha = i16_softmax_row(s, j->key_limit[i0 + r % nr] - c0, wp, vs, &m[r], &l[r], p, &ps[r]);
            if (c0 > 0 && alpha != 1.0f) scale_row(O + (size_t)r * hd, hd, alpha);
        }
        i16_pv(P, ps, Mp, wp, Vq, hd, O);
    }
    for (int r = 0; r < M; r++) {
        float *dst = j->out + (size_t)(i0 + r % nr) * qd + (size_t)(kvh * G + r / nr) * hd;
        const float *src = O + (size_t)r * hd, a = 1.0f / l[r];
        for (int d = 0; d < hd; d++) dst[d] = src[d] * a;
    }
}
#pragma GCC pop_options
#endif

static bool g_attn_i16;
static pthread_once_t g_attn_i16_once = PTHREAD_ONCE_INIT;
static void attn_i16_init(void) {
#if CB_AVX512
    __builtin_cpu_init();
    g_attn_i16 = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl");
#endif
}
static bool attn_i16_ok(void) {
    pthread_once(&g_attn_i16_once, attn_i16_init);
    return g_attn_i16;
}

bool cb_cpu_attn_i16_supported(void) { return attn_i16_ok(); }
