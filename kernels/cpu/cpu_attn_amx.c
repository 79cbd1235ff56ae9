/* cpu_attn_amx.c: the bf16 prefill blocks of cb_cpu_attention (g->math = CB_ATTN_BF16) on the AMX tile unit,
 * compiled when the build targets AVX-512 (CB_AVX512) for the AMX ISA whatever -march says, and the check
 * that this CPU and kernel allow them (cb_cpu_attn_bf16_supported). Shared helpers: cpu_ops_internal.h.
 */
#include "cpu/cpu_ops.h"
#include "cpu/cpu_ops_internal.h"

#include <math.h>
#include <pthread.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* ---------------------------------------------------------------- bf16 prefill blocks (AMX) */

#if CB_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
/* The block, online softmax and chunking of attn_block_task, with its two products on the AMX tile unit
 * (tdpbf16ps: a 16x32 bf16 tile times a 32x16 one into 16x16 f32 sums, ~15x the f32 FMA rate here): Q·scale,
 * K and V enter as hi/lo bf16 pairs (x = hi + lo, nearest even: f16 K and V exactly, q·scale to 16 bits),
 * the softmax weights are rounded once to bf16, every sum is f32.
 * Once per call, shared by every block (attn_pack_amx_task, in the scratch's shared region), per KV head and
 * chunk of ATT_KEY_CHUNK keys (packed up to the call's largest limit, zero past it):
 *   Kp [hd/2][ATT_KEY_CHUNK][2]  K as dimension pairs, keys across
 *   Vp [ATT_KEY_CHUNK/2][hd][2]  V as key pairs, dimensions across
 * Per block of rows (attn_block_amx_task, in the thread's region), for a chunk of w keys (wp = w rounded up
 * to 32; keys w..wp-1 get zero weight):
 *   Qb [Mp][hd]        Q·scale of the block's M rows (G heads stacked), Mp = M rounded up to 16
 *   S  [Mp][wp] f32    scores;  Pb [Mp][wp]  the rounded weights (amx_softmax_row)
 *   O  [Mp][hd] f32    the output so far
 * Tiles: 0-3 sums, 4 the left operand, 5-7 right operands. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg_t;

static void amx_config(void) {
    amx_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
}

/* f32 of the bf16 words in the low (hi = 0) or high (hi = 1) half of x. */
static inline __m512 bf_widen(__m512i x, int hi) {
    const __m256i h = hi ? _mm512_extracti64x4_epi64(x, 1) : _mm512_castsi512_si256(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* x0, x1 (16 f32 each) as bf16 hi/lo halves: *hi = bf16(x) (x0's low, x1's high), *lo = bf16(x - hi), the
 * same order (hi + lo holds 16 significant bits; an f16 value exactly). */
static inline void bf_split(__m512 x0, __m512 x1, __m512i *hi, __m512i *lo) {
    *hi = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
    *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, bf_widen(*hi, 1)), _mm512_sub_ps(x0, bf_widen(*hi, 0)));
}

/* 32 f32 · a as two bf16 rows hi [32], lo [32]. */
static inline void bf_split32(const float *src, float a, uint16_t *hi, uint16_t *lo) {
    const __m512 va = _mm512_set1_ps(a);
    __m512i h, l;
    bf_split(_mm512_mul_ps(_mm512_loadu_ps(src), va), _mm512_mul_ps(_mm512_loadu_ps(src + 16), va), &h, &l);
    _mm512_storeu_si512(hi, h);
    _mm512_storeu_si512(lo, l);
}

/* The 32 bf16 words of x (a[0..15] low, b[0..15] high) as pairs (a[i], b[i]), i = 0..15. */
static inline __m512i bf_pairs(__m512i x) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, x);
}

/* Kp (hi, then lo: 2 x [hd/2][ATT_KEY_CHUNK][2]) and Vp (hi, then lo: 2 x [ATT_KEY_CHUNK/2][hd][2]) from w f32 rows K, V (ld floats
 * apart); keys w..wp-1 are zero. K: each 16 keys' 16 dimension pairs are a 16x16 transpose of 32-bit pairs,
 * through a buffer. */
static void amx_pack_kv(const float *K, const float *V, int ld, int w, int wp, int hd, uint16_t *Kp, uint16_t *Vp) {
    const int wp_k = ATT_KEY_CHUNK;
    uint16_t *Kl = Kp + (size_t)ATT_KEY_CHUNK * hd;
    uint32_t t[16][16], u[16][16];
    for (int k0 = 0; k0 < wp; k0 += 16)
        for (int d = 0; d < hd; d += 32) {
            for (int k = 0; k < 16; k++) {
                if (k0 + k < w)
                    bf_split32(K + (size_t)(k0 + k) * ld + d, 1.0f, (uint16_t *)(void *)t[k], (uint16_t *)(void *)u[k]);
                else memset(t[k], 0, sizeof t[k]), memset(u[k], 0, sizeof u[k]);
            }
            for (int p = 0; p < 16; p++) {
                uint32_t col[16], col2[16];
                for (int k = 0; k < 16; k++) col[k] = t[k][p], col2[k] = u[k][p];
                memcpy(Kp + ((size_t)(d / 2 + p) * wp_k + k0) * 2, col, sizeof col);
                memcpy(Kl + ((size_t)(d / 2 + p) * wp_k + k0) * 2, col2, sizeof col2);
            }
        }
    for (int k = 0; k < wp; k += 2)
        for (int d = 0; d < hd; d += 16) {
            __m512 a = k < w ? _mm512_loadu_ps(V + (size_t)k * ld + d) : _mm512_setzero_ps();
            __m512 b = k + 1 < w ? _mm512_loadu_ps(V + (size_t)(k + 1) * ld + d) : _mm512_setzero_ps();
            __m512i hi, lo; /* keys k and k + 1 of 16 dimensions, then as (k, k + 1) pairs */
            bf_split(a, b, &hi, &lo);
            _mm512_storeu_si512(Vp + ((size_t)(k / 2) * hd + d) * 2, bf_pairs(hi));
            _mm512_storeu_si512(Vp + (size_t)ATT_KEY_CHUNK * hd + ((size_t)(k / 2) * hd + d) * 2, bf_pairs(lo));
        }
}

/* S [Mp][wp] = Q · Kᵀ from the hi/lo halves (Qh, Ql [Mp][hd]; Kh, Kl [hd/2][ATT_KEY_CHUNK][2]) as
 * Qh·Kh + Qh·Kl + Ql·Kh, all summed in f32 (the dropped Ql·Kl is ~2^-16 of the product): the scores get
 * f32-like precision, which the softmax's exp would otherwise amplify (bf16 Q and K alone move a score of
 * 20 by ~0.1). 16 rows x 32 keys per step (2 sum tiles), 3 x hd / 32 tile products each. */
static void amx_scores(const uint16_t *Qh, const uint16_t *Ql, int Mp, int hd, const uint16_t *Kh,
                       const uint16_t *Kl, int wp, float *S) {
    const int kst = ATT_KEY_CHUNK;
    const size_t qs = (size_t)hd * 2, ks = (size_t)kst * 4, ss = (size_t)wp * 4;
    for (int r0 = 0; r0 < Mp; r0 += 16)
        for (int n0 = 0; n0 < wp; n0 += 32) {
            _tile_zero(0);
            _tile_zero(1);
            for (int d = 0; d < hd; d += 32) {
                const size_t ko = ((size_t)(d / 2) * kst + n0) * 2;
                _tile_loadd(4, Qh + (size_t)r0 * hd + d, qs);
                _tile_loadd(5, Ql + (size_t)r0 * hd + d, qs);
                _tile_loadd(6, Kh + ko, ks);
                _tile_loadd(7, Kh + ko + 32, ks);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(0, 5, 6);
                _tile_dpbf16ps(1, 5, 7);
                _tile_loadd(6, Kl + ko, ks);
                _tile_loadd(7, Kl + ko + 32, ks);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
            }
            _tile_stored(0, S + (size_t)r0 * wp + n0, ss);
            _tile_stored(1, S + (size_t)r0 * wp + n0 + 16, ss);
        }
}

/* O [Mp][hd] (+)= Pb · V, 16 rows x 64 dimensions per step (hd % 64 == 0). */
static void amx_pv(const uint16_t *Pb, int Mp, int wp, const uint16_t *Vp, int hd, bool first, float *O) {
    const uint16_t *Vl = Vp + (size_t)ATT_KEY_CHUNK * hd;
    const size_t ps = (size_t)wp * 2, vs = (size_t)hd * 4, os = (size_t)hd * 4;
    for (int r0 = 0; r0 < Mp; r0 += 16)
        for (int d0 = 0; d0 < hd; d0 += 64) {
            float *o = O + (size_t)r0 * hd + d0;
            if (first) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            } else {
                _tile_loadd(0, o, os);
                _tile_loadd(1, o + 16, os);
                _tile_loadd(2, o + 32, os);
                _tile_loadd(3, o + 48, os);
            }
            for (int k0 = 0; k0 < wp; k0 += 32) {
                const size_t vo = ((size_t)(k0 / 2) * hd + d0) * 2;
                const uint16_t *v = Vp + vo, *vl = Vl + vo;
                _tile_loadd(4, Pb + (size_t)r0 * wp + k0, ps);
                _tile_loadd(5, v, vs);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, vl, vs);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, v + 32, vs);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(5, vl + 32, vs);
                _tile_dpbf16ps(1, 4, 5);
                _tile_loadd(6, v + 64, vs);
                _tile_dpbf16ps(2, 4, 6);
                _tile_loadd(7, vl + 64, vs);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, v + 96, vs);
                _tile_dpbf16ps(3, 4, 5);
                _tile_loadd(6, vl + 96, vs);
                _tile_dpbf16ps(3, 4, 6);
            }
            _tile_stored(0, o, os);
            _tile_stored(1, o + 16, os);
            _tile_stored(2, o + 32, os);
            _tile_stored(3, o + 48, os);
        }
}

/* exp(x) to ~4e-5 relative (x <= 0, as the softmax's s - max): x = n ln2 + r, |r| <= ln2/2, degree-4 Taylor
 * polynomial (its error r^5/120 <= 4.2e-5), 2^n by vscalefps. The weights are rounded to bf16 (2^-8
 * relative) right after, so this is ~100x finer than what is kept. */
static inline __m512 exp16_bf(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24), r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The online-softmax step of one row over a chunk (online_softmax's contract), writing the weights as bf16
 * into p [wp] (zeros past lim) instead of back into s; the sum is that of the rounded weights. */
static float amx_softmax_row(const float *s, int lim, int wp, float *m, float *l, uint16_t *p) {
    if (lim <= 0) {
        memset(p, 0, sizeof(uint16_t) * (size_t)wp);
        return 1.0f;
    }
    if (lim > wp) lim = wp;
    float m_new;
    const float alpha = block_max_step(s, lim, *m, &m_new);
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < wp; k += 32) { /* wp % 32 == 0 */
        const __mmask16 k0 = lim - k >= 16 ? 0xFFFF : lim - k <= 0 ? 0 : (__mmask16)((1u << (lim - k)) - 1u);
        const __mmask16 k1 = lim - k >= 32 ? 0xFFFF : lim - k <= 16 ? 0 : (__mmask16)((1u << (lim - k - 16)) - 1u);
        __m512 e0 = _mm512_maskz_mov_ps(k0, exp16_bf(_mm512_sub_ps(_mm512_maskz_loadu_ps(k0, s + k), vm)));
        __m512 e1 = _mm512_maskz_mov_ps(k1, exp16_bf(_mm512_sub_ps(_mm512_maskz_loadu_ps(k1, s + k + 16), vm)));
        const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
        _mm512_storeu_si512(p + k, b);
        sum = _mm512_add_ps(sum, _mm512_add_ps(bf_widen(b, 0), bf_widen(b, 1)));
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = m_new;
    return alpha;
}

/* Task (KV head, chunk of keys): the chunk's K and V as bf16 tiles into the shared region (j->pack), once per
 * call for every block of rows. */
void attn_pack_amx_task(void *arg, int t, int thread) {
    const attn_job_t *j = arg;
    const cb_attn_geom_t *g = j->g;
    const int hd = g->head_dim, G = g->n_head / g->n_head_kv, kvd = g->n_head_kv * hd;
    const int kvh = t / j->n_chunks, c0 = (t % j->n_chunks) * ATT_KEY_CHUNK;
    const int w = j->max_lim - c0 < ATT_KEY_CHUNK ? j->max_lim - c0 : ATT_KEY_CHUNK, wp = (w + 31) / 32 * 32;
    float *GK = att_gather_k(j->scratch + (size_t)thread * j->per_thread, G, hd);
    float *GV = GK + (size_t)ATT_KEY_CHUNK * hd;
    uint16_t *Kp = j->pack + (size_t)t * 4 * ATT_KEY_CHUNK * hd, *Vp = Kp + (size_t)2 * ATT_KEY_CHUNK * hd;
    int ld;
    const float *K, *V;
    chunk_kv(j->kv, kvh, kvd, hd, c0, w, GK, GV, &K, &V, &ld);
    amx_pack_kv(K, V, ld, w, wp, hd, Kp, Vp);
}

void attn_block_amx_task(void *arg, int t, int thread) {
    const attn_job_t *j = arg;
    const cb_attn_geom_t *g = j->g;
    const int H = g->n_head, HKV = g->n_head_kv, hd = g->head_dim, G = H / HKV, qd = H * hd;
    const int rb = j->rb, blk = t / HKV, kvh = t % HKV;
    const int i0 = blk * rb, nr = i0 + rb <= j->n ? rb : j->n - i0, M = G * nr, Mp = (M + 15) / 16 * 16;
    int L = 0;
    for (int i = 0; i < nr; i++) L = j->key_limit[i0 + i] > L ? j->key_limit[i0 + i] : L;
    float *base = j->scratch + (size_t)thread * j->per_thread;
    uint16_t *Qh = (uint16_t *)(void *)base;                   /* [Mp][hd] hi, in the Q block's place */
    uint16_t *Ql = Qh + (size_t)G * ATT_BLOCK_ROWS * hd;       /* [Mp][hd] lo */
    float *O = base + (size_t)G * ATT_BLOCK_ROWS * hd;         /* [Mp][hd] */
    float *S = O + (size_t)G * ATT_BLOCK_ROWS * hd;            /* [Mp][wp] */
    uint16_t *Pb = (uint16_t *)(void *)(base + j->bf16_offset); /* [Mp][wp] */
    float m[ATT_MAX_G * ATT_BLOCK_ROWS], l[ATT_MAX_G * ATT_BLOCK_ROWS];
    for (int r = 0; r < Mp; r++) {
        uint16_t *dh = Qh + (size_t)r * hd, *dl = Ql + (size_t)r * hd;
        if (r >= M) {
            memset(dh, 0, sizeof(uint16_t) * (size_t)hd);
            memset(dl, 0, sizeof(uint16_t) * (size_t)hd);
            continue;
        }
        const float *src = j->q + (size_t)(i0 + r % nr) * qd + (size_t)(kvh * G + r / nr) * hd;
        for (int d = 0; d < hd; d += 32) bf_split32(src + d, g->scale, dh + d, dl + d);
        m[r] = -INFINITY, l[r] = 0.0f;
    }
    amx_config();
    for (int c0 = 0; c0 < L; c0 += ATT_KEY_CHUNK) {
        const int w = L - c0 < ATT_KEY_CHUNK ? L - c0 : ATT_KEY_CHUNK, wp = (w + 31) / 32 * 32;
        /* the chunk's tiles (packed for the call's largest limit: keys w..wp-1 may hold real keys, which
         * the softmax masks) */
        const uint16_t *Kh = j->pack + ((size_t)kvh * j->n_chunks + (size_t)(c0 / ATT_KEY_CHUNK)) * 4 * ATT_KEY_CHUNK * hd;
        const uint16_t *Kl = Kh + (size_t)ATT_KEY_CHUNK * hd, *Vp = Kl + (size_t)ATT_KEY_CHUNK * hd;
        amx_scores(Qh, Ql, Mp, hd, Kh, Kl, wp, S);
        for (int r = 0; r < Mp; r++) {
            float *s = S + (size_t)r * wp;
            uint16_t *p = Pb + (size_t)r * wp;
            if (r >= M) {
                memset(p, 0, sizeof(uint16_t) * (size_t)wp);
                continue;
            }
            float alpha = amx_softmax_row(s, j->key_limit[i0 + r % nr] - c0, wp, &m[r], &l[r], p);
            if (c0 > 0 && alpha != 1.0f) scale_row(O + (size_t)r * hd, hd, alpha);
        }
        amx_pv(Pb, Mp, wp, Vp, hd, c0 == 0, O);
    }
    _tile_release();
    for (int r = 0; r < M; r++) {
        float *dst = j->out + (size_t)(i0 + r % nr) * qd + (size_t)(kvh * G + r / nr) * hd;
        const float *src = O + (size_t)r * hd, a = 1.0f / l[r];
        for (int d = 0; d < hd; d++) dst[d] = src[d] * a;
    }
}
#pragma GCC pop_options
#endif

/* AMX needs the kernel's leave to use tile data (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, once per process). */
static bool g_attn_bf16;
static pthread_once_t g_attn_bf16_once = PTHREAD_ONCE_INIT;
static void attn_bf16_init(void) {
#if CB_AVX512 && defined(__linux__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
        __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"))
        g_attn_bf16 = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#endif
}
static bool attn_bf16_ok(void) {
    pthread_once(&g_attn_bf16_once, attn_bf16_init);
    return g_attn_bf16;
}

bool cb_cpu_attn_bf16_supported(void) { return attn_bf16_ok(); }
