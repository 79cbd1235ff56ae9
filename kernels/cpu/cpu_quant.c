/* cpu_quant.c: integer matrix products on quantized weights (see cpu_quant.h): ISA detection, activation
 * quantization, one kernel per (weight type, code path), and the threaded driver.
 *
 * Every kernel computes, per output (o, r), the sum over the row's groups of 4 blocks of the same lane-wise
 * operations, then one horizontal sum; the number of activation rows R per pass (1..8, a compile-time
 * constant in each instance, so the accumulators stay in registers) only decides how often a weight group is
 * unpacked, never the arithmetic of an output. Terse by design; the layouts are in cpu_quant.h.
 */
#include "cpu/cpu_quant.h"

#include <assert.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "format/gguf.h"
#include "format/quant.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define CB_X86 1
#else
#define CB_X86 0
#endif

#define QMAX_R 8 /* activation rows per pass over a weight row */
#define INL static inline __attribute__((always_inline))

/* ---------------------------------------------------------------- ISA */

static int g_isa = -1;
static pthread_once_t g_isa_once = PTHREAD_ONCE_INIT;

bool cb_cpu_isa_supported(cb_cpu_isa_t isa) {
#if CB_X86
    __builtin_cpu_init();
    switch (isa) {
    case CB_CPU_ISA_SCALAR: return true;
    case CB_CPU_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case CB_CPU_ISA_AVXVNNI: return cb_cpu_isa_supported(CB_CPU_ISA_AVX2) && __builtin_cpu_supports("avxvnni");
    case CB_CPU_ISA_AVX512:
        return cb_cpu_isa_supported(CB_CPU_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni") &&
               __builtin_cpu_supports("avx512vbmi");
    }
    return false;
#else
    return isa == CB_CPU_ISA_SCALAR;
#endif
}

const char *cb_cpu_isa_name(cb_cpu_isa_t isa) {
    static const char *names[] = {"scalar", "avx2", "avxvnni", "avx512"};
    return (unsigned)isa < 4 ? names[isa] : "?";
}

static void isa_once(void) {
    int best = CB_CPU_ISA_SCALAR;
    for (int i = CB_CPU_ISA_AVX512; i > CB_CPU_ISA_SCALAR; i--)
        if (cb_cpu_isa_supported((cb_cpu_isa_t)i)) {
            best = i;
            break;
        }
    const char *cap = getenv("CB_CPU_ISA");
    if (cap && *cap)
        for (int i = 0; i < 4; i++)
            if (!strcmp(cap, cb_cpu_isa_name((cb_cpu_isa_t)i)) && i < best) best = i;
    g_isa = best;
}

cb_cpu_isa_t cb_cpu_isa_detect(void) {
    pthread_once(&g_isa_once, isa_once);
    return (cb_cpu_isa_t)g_isa;
}

bool cb_cpu_qtype_supported(uint32_t type) {
    return type == CB_TYPE_Q4_0 || type == CB_TYPE_Q4_1 || type == CB_TYPE_Q8_0 || type == CB_TYPE_Q4_K ||
           type == CB_TYPE_Q6_K;
}

static inline float rd_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return cb_f16_to_f32(h);
}

/* Constant offset a type's quants carry (value = (q - offset) * scale), as the VNNI paths see them. */
static int type_offset(uint32_t wtype, cb_cpu_isa_t isa) {
    switch (wtype) {
    case CB_TYPE_Q4_0: return 8;
    case CB_TYPE_Q8_0: return isa >= CB_CPU_ISA_AVXVNNI ? 128 : 0; /* signed weights as (w ^ 0x80) = w + 128 */
    case CB_TYPE_Q6_K: return 32;
    default: return 0;
    }
}

/* ---------------------------------------------------------------- activation quantization */

/* The lane vectors of a group from its quants and block scales (scalar; the same values the vector code
 * computes, bit for bit: integer sums and the same f32 operations in the same order). */
static void group_lanes(cb_q8_group_t *G, const float d[4], int off, bool split) {
    int32_t ls[2][16];
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 16; l++) {
            const int8_t *q = G->qs + 64 * h + 4 * l;
            ls[h][l] = q[0] + q[1] + q[2] + q[3];
        }
    for (int k = 0; k < 4; k++) {
        int32_t s = 0;
        for (int l = 4 * k; l < 4 * k + 4; l++) s += ls[0][l] + ls[1][l];
        for (int l = 4 * k; l < 4 * k + 4; l++) {
            G->dl[l] = d[k];
            G->ml[l] = (float)s * d[k] * 0.25f;
        }
    }
    for (int l = 0; l < 16; l++) {
        G->il[0][l] = split ? -off * ls[0][l] : -off * (ls[0][l] + ls[1][l]);
        G->il[1][l] = split ? -off * ls[1][l] : 0;
    }
}

static void q8_row_scalar(const float *x, int cols, int off, bool split, cb_q8_group_t *g0) {
    const int nb = cols / 32, ng = cb_q8_groups(cols);
    for (int g = 0; g < ng; g++) {
        cb_q8_group_t *G = g0 + g;
        float d[4] = {0, 0, 0, 0};
        for (int k = 0; k < 4; k++) {
            const int b = 4 * g + k;
            if (b >= nb) {
                memset(G->qs + 16 * k, 0, 16);
                memset(G->qs + 64 + 16 * k, 0, 16);
                continue;
            }
            const float *xb = x + 32 * b;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
            d[k] = amax / 127.0f;
            const float id = d[k] != 0.0f ? 1.0f / d[k] : 0.0f;
            for (int j = 0; j < 32; j++) {
                int8_t q = (int8_t)nearbyintf(xb[j] * id);
                G->qs[(j < 16 ? 0 : 64) + 16 * k + (j & 15)] = q;
            }
        }
        group_lanes(G, d, off, split);
    }
}

#if CB_X86
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")))

T512 static void q8_row_512(const float *x, int cols, int off, bool split, cb_q8_group_t *g0) {
    const int nb = cols / 32, ng = cb_q8_groups(cols);
    const __m512i rep4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i ones = _mm512_set1_epi8(1), voff = _mm512_set1_epi32(-off);
    for (int g = 0; g < ng; g++) {
        cb_q8_group_t *G = g0 + g;
        __m128i qx[4], qy[4];
        float d[4];
        for (int k = 0; k < 4; k++) {
            const int b = 4 * g + k;
            if (b >= nb) {
                qx[k] = qy[k] = _mm_setzero_si128();
                d[k] = 0.0f;
                continue;
            }
            const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            d[k] = amax / 127.0f;
            const __m512 id = _mm512_set1_ps(d[k] != 0.0f ? 1.0f / d[k] : 0.0f);
            qx[k] = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, id)));
            qy[k] = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, id)));
        }
        __m512i X = _mm512_castsi128_si512(qx[0]), Y = _mm512_castsi128_si512(qy[0]);
        X = _mm512_inserti32x4(X, qx[1], 1), Y = _mm512_inserti32x4(Y, qy[1], 1);
        X = _mm512_inserti32x4(X, qx[2], 2), Y = _mm512_inserti32x4(Y, qy[2], 2);
        X = _mm512_inserti32x4(X, qx[3], 3), Y = _mm512_inserti32x4(Y, qy[3], 3);
        _mm512_store_si512(G->qs, X);
        _mm512_store_si512(G->qs + 64, Y);
        const __m512 dl = _mm512_permutexvar_ps(rep4, _mm512_castps128_ps512(_mm_loadu_ps(d)));
        const __m512i lx = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, X);
        const __m512i ly = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, Y);
        __m512i t = _mm512_add_epi32(lx, ly);
        t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
        t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB)); /* the slot's sum in its 4 lanes */
        _mm512_store_ps(G->dl, dl);
        _mm512_store_ps(G->ml, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t), dl), _mm512_set1_ps(0.25f)));
        _mm512_store_si512(G->il[0], _mm512_mullo_epi32(voff, split ? lx : _mm512_add_epi32(lx, ly)));
        _mm512_store_si512(G->il[1], split ? _mm512_mullo_epi32(voff, ly) : _mm512_setzero_si512());
    }
}
#endif

#if CB_X86
/* AVX2 (any 256-bit path): the blocks' quants vectorised, the lane vectors by group_lanes (the same bits as
 * the scalar quantizer: the same f32 operations per value). */
__attribute__((target("avx2,fma,f16c"))) static void q8_row_256(const float *x, int cols, int off, bool split,
                                                                 cb_q8_group_t *g0) {
    const int nb = cols / 32, ng = cb_q8_groups(cols);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int g = 0; g < ng; g++) {
        cb_q8_group_t *G = g0 + g;
        float d[4] = {0, 0, 0, 0};
        for (int k = 0; k < 4; k++) {
            const int b = 4 * g + k;
            if (b >= nb) {
                memset(G->qs + 16 * k, 0, 16);
                memset(G->qs + 64 + 16 * k, 0, 16);
                continue;
            }
            const float *xb = x + 32 * b;
            __m256 v[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) m = _mm256_max_ps(m, _mm256_and_ps(v[i] = _mm256_loadu_ps(xb + 8 * i), absmask));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            d[k] = _mm_cvtss_f32(h) / 127.0f;
            const __m256 id = _mm256_set1_ps(d[k] != 0.0f ? 1.0f / d[k] : 0.0f);
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
            /* packs interleave 128-bit halves: (0..3, 8..11, 4..7, 12..15) after the first, fixed by `order` */
            const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
            const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
            _mm_storeu_si128((__m128i *)(void *)(G->qs + 16 * k), _mm256_castsi256_si128(p8));
            _mm_storeu_si128((__m128i *)(void *)(G->qs + 64 + 16 * k), _mm256_extracti128_si256(p8, 1));
        }
        group_lanes(G, d, off, split);
    }
}
#endif

typedef struct {
    cb_cpu_isa_t isa;
    const float *x;
    int cols, off, rows_per_task, n;
    bool split;
    cb_q8_group_t *act;
} q8_job_t;

static void q8_rows(const q8_job_t *j, int r0, int r1) {
    const int ng = cb_q8_groups(j->cols);
    for (int r = r0; r < r1; r++) {
        const float *x = j->x + (size_t)r * j->cols;
        cb_q8_group_t *a = j->act + (size_t)r * ng;
#if CB_X86
        if (j->isa == CB_CPU_ISA_AVX512) {
            q8_row_512(x, j->cols, j->off, j->split, a);
            continue;
        }
        if (j->isa == CB_CPU_ISA_AVX2 || j->isa == CB_CPU_ISA_AVXVNNI) {
            q8_row_256(x, j->cols, j->off, j->split, a);
            continue;
        }
#endif
        q8_row_scalar(x, j->cols, j->off, j->split, a);
    }
}

static void q8_task(void *arg, int t, int thread) {
    (void)thread;
    const q8_job_t *j = arg;
    const int r0 = t * j->rows_per_task, r1 = r0 + j->rows_per_task < j->n ? r0 + j->rows_per_task : j->n;
    q8_rows(j, r0, r1);
}

void cb_cpu_q8_quantize(cb_cpu_isa_t isa, uint32_t wtype, const float *x, int n, int cols, cb_q8_group_t *act,
                        cb_pool_t *pool) {
    assert(cols % 32 == 0);
    q8_job_t j = {isa, x, cols, type_offset(wtype, isa), 0, n, wtype == CB_TYPE_Q6_K, act};
    const int nt = cb_pool_size(pool);
    if (nt == 1 || (size_t)n * cols < 32768) {
        q8_rows(&j, 0, n);
        return;
    }
    j.rows_per_task = (n + 4 * nt - 1) / (4 * nt);
    cb_pool_run(pool, (n + j.rows_per_task - 1) / j.rows_per_task, q8_task, &j);
}

/* ---------------------------------------------------------------- scalar kernels */

/* Quant of element e (0..31) of slot k of a group. */
#define AQ(G, k, e) ((G)->qs[((e) < 16 ? 0 : 48) + 16 * (k) + (e)])

static float sdot_q4_0(const uint8_t *row, int nb, const cb_q8_group_t *a) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = row + 18 * (size_t)b;
        const cb_q8_group_t *G = a + b / 4;
        const int k = b % 4;
        int32_t s = 0;
        for (int i = 0; i < 16; i++) s += ((p[2 + i] & 15) - 8) * AQ(G, k, i) + ((p[2 + i] >> 4) - 8) * AQ(G, k, i + 16);
        acc += rd_f16(p) * G->dl[4 * k] * (float)s;
    }
    return acc;
}

static float sdot_q4_1(const uint8_t *row, int nb, const cb_q8_group_t *a) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = row + 20 * (size_t)b;
        const cb_q8_group_t *G = a + b / 4;
        const int k = b % 4;
        int32_t s = 0;
        for (int i = 0; i < 16; i++) s += (p[4 + i] & 15) * AQ(G, k, i) + (p[4 + i] >> 4) * AQ(G, k, i + 16);
        acc += rd_f16(p) * G->dl[4 * k] * (float)s + rd_f16(p + 2) * G->ml[4 * k] * 4.0f;
    }
    return acc;
}

static float sdot_q8_0(const uint8_t *row, int nb, const cb_q8_group_t *a) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = row + 34 * (size_t)b;
        const cb_q8_group_t *G = a + b / 4;
        const int k = b % 4;
        int32_t s = 0;
        for (int i = 0; i < 32; i++) s += (int8_t)p[2 + i] * AQ(G, k, i);
        acc += rd_f16(p) * G->dl[4 * k] * (float)s;
    }
    return acc;
}

/* Q4_K's 6-bit scales and mins of the 8 sub-blocks from the 12 packed bytes (REFERENCE.md §3). */
static void q4_k_scales(const uint8_t *q, uint8_t sc[8], uint8_t mn[8]) {
    for (int k = 0; k < 8; k++) {
        if (k < 4) {
            sc[k] = q[k] & 63;
            mn[k] = q[k + 4] & 63;
        } else {
            sc[k] = (uint8_t)((q[k + 4] & 0xF) | ((q[k - 4] >> 6) << 4));
            mn[k] = (uint8_t)((q[k + 4] >> 4) | ((q[k] >> 6) << 4));
        }
    }
}

static float sdot_q4_k(const uint8_t *row, int nb, const cb_q8_group_t *a) {
    float acc = 0.0f;
    for (int sb = 0; sb < nb / 8; sb++) {
        const uint8_t *p = row + 144 * (size_t)sb, *qs = p + 16;
        const float d = rd_f16(p), dmin = rd_f16(p + 2);
        uint8_t sc[8], mn[8];
        q4_k_scales(p + 4, sc, mn);
        for (int j = 0; j < 8; j++) { /* sub-block j = activation block 8 sb + j */
            const int b = 8 * sb + j, k = b % 4, sh = (j & 1) * 4;
            const cb_q8_group_t *G = a + b / 4;
            const uint8_t *q = qs + 32 * (j / 2);
            int32_t s = 0;
            for (int e = 0; e < 32; e++) s += ((q[e] >> sh) & 15) * AQ(G, k, e);
            acc += d * (float)sc[j] * G->dl[4 * k] * (float)s - dmin * (float)mn[j] * G->ml[4 * k] * 4.0f;
        }
    }
    return acc;
}

static float sdot_q6_k(const uint8_t *row, int nb, const cb_q8_group_t *a) {
    float acc = 0.0f;
    for (int sb = 0; sb < nb / 8; sb++) {
        const uint8_t *p = row + 210 * (size_t)sb;
        const float d = rd_f16(p + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = p + 64 * h, *qh = p + 128 + 32 * h;
            const int8_t *sc = (const int8_t *)(p + 192 + 8 * h);
            const cb_q8_group_t *G = a + 2 * sb + h;
            for (int sub = 0; sub < 8; sub++) { /* 16 elements e = 16 sub .. of the half */
                int32_t s = 0;
                for (int e = 16 * sub; e < 16 * sub + 16; e++) {
                    const int l = e % 32, t = e / 32; /* quarter t: ql[l] / ql[l+32], low / high nibble */
                    const int lo = (t & 1) ? ql[l + 32] : ql[l];
                    const int q = (((t & 2) ? lo >> 4 : lo) & 15) | (((qh[l] >> (2 * t)) & 3) << 4);
                    s += (q - 32) * AQ(G, t, l);
                }
                acc += d * (float)sc[sub] * G->dl[4 * (sub / 2)] * (float)s;
            }
        }
    }
    return acc;
}

static void qdot_scalar(const cb_weight_t *w, const cb_q8_group_t *act, int n, float *y, int ldy, int o0, int o1) {
    const int nb = w->cols / 32, ga = cb_q8_groups(w->cols);
    float (*f)(const uint8_t *, int, const cb_q8_group_t *) =
        w->type == CB_TYPE_Q4_0 ? sdot_q4_0 : w->type == CB_TYPE_Q4_1 ? sdot_q4_1 : w->type == CB_TYPE_Q8_0 ? sdot_q8_0
        : w->type == CB_TYPE_Q4_K ? sdot_q4_k : sdot_q6_k;
    for (int r0 = 0; r0 < n; r0 += QMAX_R) { /* the same blocking as the SIMD paths (weights reused from cache) */
        const int R = n - r0 < QMAX_R ? n - r0 : QMAX_R;
        for (int o = o0; o < o1; o++) {
            const uint8_t *row = (const uint8_t *)w->q + (size_t)o * w->row_bytes;
            for (int r = r0; r < r0 + R; r++) y[(size_t)r * ldy + o] = f(row, nb, act + (size_t)r * ga);
        }
    }
}

/* ---------------------------------------------------------------- AVX-512 VNNI kernels */

#if CB_X86
/* One weight group unpacked: X, Y the unsigned quants in the activation layout; s (and s2, Q6_K's Y half) the
 * lane scales; m the lane mins. */
typedef struct {
    __m512i x, y;
    __m512 s, s2, m;
} wg512_t;

/* Byte-index tables for vpermt2b over two loaded registers (128 source bytes). */
typedef struct {
    uint8_t q4_0_qs[64], q4_0_d[64], q4_1_qs[64], q4_1_dm[64], q8_0_p1[64], q8_0_p2[64], q8_0_d[64];
} idx512_t;
static idx512_t g_idx;
static pthread_once_t g_idx_once = PTHREAD_ONCE_INIT;

static void idx_once(void) {
    for (int j = 0; j < 64; j++) {
        const int k = j / 16, i = j % 16;       /* slot, byte of the slot's 16 */
        const int hk = (j % 32) / 8, hb = j % 2; /* for the 16 halves of a scale row: slot, byte of the half */
        g_idx.q4_0_qs[j] = (uint8_t)(18 * k + 2 + i);
        g_idx.q4_0_d[j] = (uint8_t)(18 * hk + hb);
        g_idx.q4_1_qs[j] = (uint8_t)(20 * k + 4 + i);
        g_idx.q4_1_dm[j] = (uint8_t)(20 * hk + (j < 32 ? 0 : 2) + hb);
        /* Q8_0, two blocks per permute: P = [A 0..15, B 0..15, A 16..31, B 16..31] */
        const int pk = (j / 16) % 2, pe = (j / 32) * 16 + i;
        g_idx.q8_0_p1[j] = (uint8_t)(34 * pk + 2 + pe);      /* blocks 0, 1 from bytes [0, 128) */
        g_idx.q8_0_p2[j] = (uint8_t)(34 * pk + 2 + pe + 4);  /* blocks 2, 3 from bytes [64, 192) */
        g_idx.q8_0_d[j] = (uint8_t)(34 * hk + hb);
    }
}

static inline uint64_t bytes_mask(int n) { return n >= 64 ? ~0ULL : n <= 0 ? 0 : (1ULL << n) - 1; }

/* Activation side of one group for output (o, r), three forms (cpu_quant.h): A = zero start, scale and min
 * (Q4_1, Q4_K); B = offset start, scale (Q4_0, Q8_0); C = X and Y halves with their own starts and scales
 * (Q6_K: sub-blocks of 16). */
T512 INL void row_a(const wg512_t *w, const cb_q8_group_t *G, __m512 *acc) {
    __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w->x, _mm512_load_si512(G->qs));
    t = _mm512_dpbusd_epi32(t, w->y, _mm512_load_si512(G->qs + 64));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(w->s, _mm512_load_ps(G->dl)), *acc);
    *acc = _mm512_fmadd_ps(w->m, _mm512_load_ps(G->ml), *acc);
}

T512 INL void row_b(const wg512_t *w, const cb_q8_group_t *G, __m512 *acc) {
    __m512i t = _mm512_dpbusd_epi32(_mm512_load_si512(G->il[0]), w->x, _mm512_load_si512(G->qs));
    t = _mm512_dpbusd_epi32(t, w->y, _mm512_load_si512(G->qs + 64));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(w->s, _mm512_load_ps(G->dl)), *acc);
}

T512 INL void row_c(const wg512_t *w, const cb_q8_group_t *G, __m512 *acc) {
    const __m512i tx = _mm512_dpbusd_epi32(_mm512_load_si512(G->il[0]), w->x, _mm512_load_si512(G->qs));
    const __m512i ty = _mm512_dpbusd_epi32(_mm512_load_si512(G->il[1]), w->y, _mm512_load_si512(G->qs + 64));
    const __m512 dl = _mm512_load_ps(G->dl);
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tx), _mm512_mul_ps(w->s, dl), *acc);
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ty), _mm512_mul_ps(w->s2, dl), *acc);
}

/* Weight groups. nblk (1..4) blocks from p; slots past nblk are zero (their activations are zero too). */
T512 INL void grp512_q4_0(const uint8_t *p, int nblk, wg512_t *w) {
    const int n = 18 * nblk;
    const __m512i z0 = _mm512_maskz_loadu_epi8(bytes_mask(n), p), z1 = _mm512_maskz_loadu_epi8(bytes_mask(n - 64), p + 64);
    const __m512i qs = _mm512_maskz_permutex2var_epi8(bytes_mask(16 * nblk), z0, _mm512_loadu_si512(g_idx.q4_0_qs), z1);
    const __m512i m4 = _mm512_set1_epi8(15);
    w->x = _mm512_and_si512(qs, m4);
    w->y = _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4);
    const __m512i d = _mm512_maskz_permutex2var_epi8(bytes_mask(8 * nblk), z0, _mm512_loadu_si512(g_idx.q4_0_d), z1);
    w->s = _mm512_cvtph_ps(_mm512_castsi512_si256(d));
}

T512 INL void grp512_q4_1(const uint8_t *p, int nblk, wg512_t *w) {
    const int n = 20 * nblk;
    const __m512i z0 = _mm512_maskz_loadu_epi8(bytes_mask(n), p), z1 = _mm512_maskz_loadu_epi8(bytes_mask(n - 64), p + 64);
    const __m512i qs = _mm512_maskz_permutex2var_epi8(bytes_mask(16 * nblk), z0, _mm512_loadu_si512(g_idx.q4_1_qs), z1);
    const __m512i m4 = _mm512_set1_epi8(15);
    w->x = _mm512_and_si512(qs, m4);
    w->y = _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4);
    const uint64_t km = bytes_mask(8 * nblk) | (bytes_mask(8 * nblk) << 32);
    const __m512i dm = _mm512_maskz_permutex2var_epi8(km, z0, _mm512_loadu_si512(g_idx.q4_1_dm), z1);
    w->s = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    w->m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
}

T512 INL void grp512_q8_0(const uint8_t *p, int nblk, wg512_t *w) {
    const int n = 34 * nblk;
    const __m512i z0 = _mm512_maskz_loadu_epi8(bytes_mask(n), p);
    const __m512i z1 = _mm512_maskz_loadu_epi8(bytes_mask(n - 64), p + 64);
    const __m512i z2 = _mm512_maskz_loadu_epi8(bytes_mask(n - 128), p + 128);
    /* slot k's bytes in P: 16 at 16 (k % 2) and 16 at 32 + 16 (k % 2) */
    const uint64_t k1 = nblk >= 2 ? ~0ULL : 0x0000FFFF0000FFFFULL, k2 = nblk >= 4 ? ~0ULL : nblk == 3 ? 0x0000FFFF0000FFFFULL : 0;
    const __m512i p1 = _mm512_maskz_permutex2var_epi8(k1, z0, _mm512_loadu_si512(g_idx.q8_0_p1), z1);
    const __m512i p2 = _mm512_maskz_permutex2var_epi8(k2, z1, _mm512_loadu_si512(g_idx.q8_0_p2), z2);
    const __m512i sgn = _mm512_set1_epi8((char)0x80); /* w + 128: unsigned; the start values take 128 sum(x) off */
    w->x = _mm512_xor_si512(_mm512_shuffle_i64x2(p1, p2, _MM_SHUFFLE(1, 0, 1, 0)), sgn);
    w->y = _mm512_xor_si512(_mm512_shuffle_i64x2(p1, p2, _MM_SHUFFLE(3, 2, 3, 2)), sgn);
    const __m512i d = _mm512_maskz_permutex2var_epi8(bytes_mask(8 * nblk), z0, _mm512_loadu_si512(g_idx.q8_0_d), z1);
    w->s = _mm512_cvtph_ps(_mm512_castsi512_si256(d));
}

/* Q4_K super-block: lane scales d * sc and mins -dmin * mn of both groups; then group h's quants. */
T512 INL void sb512_q4_k(const uint8_t *p, __m512 s[2], __m512 m[2]) {
    uint32_t u0, u1, u2;
    memcpy(&u0, p + 4, 4);
    memcpy(&u1, p + 8, 4);
    memcpy(&u2, p + 12, 4);
    const uint64_t sc = (uint64_t)(u0 & 0x3F3F3F3Fu) |
                        (uint64_t)((u2 & 0x0F0F0F0Fu) | (((u0 >> 6) & 0x03030303u) << 4)) << 32;
    const uint64_t mn = (uint64_t)(u1 & 0x3F3F3F3Fu) |
                        (uint64_t)(((u2 >> 4) & 0x0F0F0F0Fu) | (((u1 >> 6) & 0x03030303u) << 4)) << 32;
    const __m512 scf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)));
    const __m512 mnf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn)));
    const __m512 ds = _mm512_mul_ps(_mm512_set1_ps(rd_f16(p)), scf), dm = _mm512_mul_ps(_mm512_set1_ps(-rd_f16(p + 2)), mnf);
    const __m512i i0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(4));
    s[0] = _mm512_permutexvar_ps(i0, ds), s[1] = _mm512_permutexvar_ps(i1, ds);
    m[0] = _mm512_permutexvar_ps(i0, dm), m[1] = _mm512_permutexvar_ps(i1, dm);
}

T512 INL void grp512_q4_k(const uint8_t *p, int h, wg512_t *w) {
    const __m512i a = _mm512_loadu_si512(p + 16 + 64 * h), m4 = _mm512_set1_epi8(15);
    const __m512i lo = _mm512_and_si512(a, m4), hi = _mm512_and_si512(_mm512_srli_epi16(a, 4), m4);
    /* lo = [sub 4h e0-15, 4h e16-31, 4h+2 e0-15, 4h+2 e16-31], hi the same for 4h+1, 4h+3 */
    w->x = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi);
    w->y = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15), hi);
}

T512 INL void grp512_q6_k(const uint8_t *p, int h, wg512_t *w) {
    const uint8_t *ql = p + 64 * h, *qh = p + 128 + 32 * h;
    const __m512i QL = _mm512_loadu_si512(ql), m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3);
    /* X slots: elements 0-15 of the half's quarters 0..3 = ql[0..15] lo, ql[32..47] lo, ql[0..15] hi, ql[32..47] hi */
    const __m512i xl = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 4, 5, 0, 1, 4, 5), QL);
    const __m512i yl = _mm512_permutexvar_epi64(_mm512_setr_epi64(2, 3, 6, 7, 2, 3, 6, 7), QL);
    const __m512i shl = _mm512_setr_epi64(0, 0, 0, 0, 0x0004000400040004LL, 0x0004000400040004LL,
                                          0x0004000400040004LL, 0x0004000400040004LL);
    const __m512i shh = _mm512_setr_epi64(0, 0, 0x0002000200020002LL, 0x0002000200020002LL, 0x0004000400040004LL,
                                          0x0004000400040004LL, 0x0006000600060006LL, 0x0006000600060006LL);
    const __m512i hx = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)qh));
    const __m512i hy = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(qh + 16)));
    w->x = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi16(xl, shl), m4),
                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hx, shh), m3), 4));
    w->y = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi16(yl, shl), m4),
                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hy, shh), m3), 4));
    /* X slot k = sub-block 2k of the half, Y slot k = 2k + 1 */
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 192 + 8 * h))));
    const __m512 d = _mm512_set1_ps(rd_f16(p + 208));
    w->s = _mm512_mul_ps(d, _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), sc));
    w->s2 = _mm512_mul_ps(d, _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7), sc));
}

typedef struct {
    const uint8_t *q;          /* weight rows */
    size_t rb;                 /* bytes per weight row */
    int nb, ga;                /* blocks per row; activation groups per row */
    const cb_q8_group_t *a;    /* activation rows [R][ga] */
    float *y;                  /* [R][ldy] */
    int ldy;
} qk_t;

/* One pass (R = 1, a matvec) streams the weights once from memory: each block of rows asks for the rows
 * QK_PREFETCH bytes ahead. */
#define QK_PREFETCH 2048
INL void prefetch_rows(const uint8_t *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T0);
}

/* W weight rows from o times R activation rows (W, R constants at each instance; W * R <= 8 accumulators).
 * With R = 1 (decode) four weight rows go side by side: one row's accumulator chain is two dependent FMAs
 * per group, so rows one at a time would wait on it. Each output's operations are the same whatever W. */
#define QK_BEGIN(W, R)                                                                                     \
    const uint8_t *row[4];                                                                                 \
    __m512 acc[4][QMAX_R];                                                                                 \
    _Pragma("GCC unroll 4") for (int w = 0; w < W; w++) {                                                  \
        row[w] = k->q + (size_t)(o + w) * k->rb;                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[w][r] = _mm512_setzero_ps();               \
    }                                                                                                      \
    if (R == 1) prefetch_rows(k->q + (size_t)o * k->rb + QK_PREFETCH, (size_t)W * k->rb);
#define QK_GROUP(W, R, DECODE, FORM, g)                                                                    \
    {                                                                                                      \
        wg512_t wg[4];                                                                                     \
        _Pragma("GCC unroll 4") for (int w = 0; w < W; w++) DECODE;                                        \
        _Pragma("GCC unroll 4") for (int w = 0; w < W; w++)                                                \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                            \
                FORM(&wg[w], k->a + (size_t)r * k->ga + (g), &acc[w][r]);                                  \
    }
#define QK_END(W, R)                                                                                       \
    _Pragma("GCC unroll 4") for (int w = 0; w < W; w++)                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                \
            k->y[(size_t)r * k->ldy + o + w] = _mm512_reduce_add_ps(acc[w][r]);

T512 INL void k512_q4_0(const qk_t *k, const int W, const int R, int o) {
    QK_BEGIN(W, R)
    int b = 0, g = 0;
    for (; b + 4 <= k->nb; b += 4, g++) QK_GROUP(W, R, grp512_q4_0(row[w] + 18 * b, 4, &wg[w]), row_b, g)
    if (b < k->nb) QK_GROUP(W, R, grp512_q4_0(row[w] + 18 * b, k->nb - b, &wg[w]), row_b, g)
    QK_END(W, R)
}

T512 INL void k512_q4_1(const qk_t *k, const int W, const int R, int o) {
    QK_BEGIN(W, R)
    int b = 0, g = 0;
    for (; b + 4 <= k->nb; b += 4, g++) QK_GROUP(W, R, grp512_q4_1(row[w] + 20 * b, 4, &wg[w]), row_a, g)
    if (b < k->nb) QK_GROUP(W, R, grp512_q4_1(row[w] + 20 * b, k->nb - b, &wg[w]), row_a, g)
    QK_END(W, R)
}

T512 INL void k512_q8_0(const qk_t *k, const int W, const int R, int o) {
    QK_BEGIN(W, R)
    int b = 0, g = 0;
    for (; b + 4 <= k->nb; b += 4, g++) QK_GROUP(W, R, grp512_q8_0(row[w] + 34 * b, 4, &wg[w]), row_b, g)
    if (b < k->nb) QK_GROUP(W, R, grp512_q8_0(row[w] + 34 * b, k->nb - b, &wg[w]), row_b, g)
    QK_END(W, R)
}

T512 INL void k512_q4_k(const qk_t *k, const int W, const int R, int o) {
    QK_BEGIN(W, R)
    for (int sb = 0; sb < k->nb / 8; sb++) {
        __m512 s[4][2], m[4][2];
        _Pragma("GCC unroll 4") for (int w = 0; w < W; w++) sb512_q4_k(row[w] + 144 * sb, s[w], m[w]);
        for (int h = 0; h < 2; h++)
            QK_GROUP(W, R, (grp512_q4_k(row[w] + 144 * sb, h, &wg[w]), wg[w].s = s[w][h], wg[w].m = m[w][h]), row_a,
                     2 * sb + h)
    }
    QK_END(W, R)
}

T512 INL void k512_q6_k(const qk_t *k, const int W, const int R, int o) {
    QK_BEGIN(W, R)
    for (int sb = 0; sb < k->nb / 8; sb++)
        for (int h = 0; h < 2; h++) QK_GROUP(W, R, grp512_q6_k(row[w] + 210 * sb, h, &wg[w]), row_c, 2 * sb + h)
    QK_END(W, R)
}

/* Weight rows [o0, o1) times R activation rows: quads of rows for R = 1, one row at a time otherwise. */
#define R_SWITCH(fn, k, R, o0, o1)                                                                         \
    if (R == 1) {                                                                                          \
        int o = o0;                                                                                        \
        for (; o + 4 <= o1; o += 4) fn(k, 4, 1, o);                                                        \
        for (; o < o1; o++) fn(k, 1, 1, o);                                                                \
    } else                                                                                                 \
        for (int o = o0; o < o1; o++) switch (R) {                                                         \
            case 2: fn(k, 1, 2, o); break; case 3: fn(k, 1, 3, o); break; case 4: fn(k, 1, 4, o); break;   \
            case 5: fn(k, 1, 5, o); break; case 6: fn(k, 1, 6, o); break; case 7: fn(k, 1, 7, o); break;   \
            case 8: fn(k, 1, 8, o); break; default: assert(0);                                             \
            }

T512 static void q512_q4_0(const qk_t *k, int R, int o0, int o1) { R_SWITCH(k512_q4_0, k, R, o0, o1) }
T512 static void q512_q4_1(const qk_t *k, int R, int o0, int o1) { R_SWITCH(k512_q4_1, k, R, o0, o1) }
T512 static void q512_q8_0(const qk_t *k, int R, int o0, int o1) { R_SWITCH(k512_q8_0, k, R, o0, o1) }
T512 static void q512_q4_k(const qk_t *k, int R, int o0, int o1) { R_SWITCH(k512_q4_k, k, R, o0, o1) }
T512 static void q512_q6_k(const qk_t *k, int R, int o0, int o1) { R_SWITCH(k512_q6_k, k, R, o0, o1) }

/* The 256-bit paths: AVX-VNNI and AVX2 instances of one source. */
#define Q256_T __attribute__((target("avx2,fma,f16c,avxvnni")))
#define Q256(name) vnni_##name
#define Q256_VNNI 1
#include "cpu/cpu_quant_256.inc"
#undef Q256_T
#undef Q256
#undef Q256_VNNI
#define Q256_T __attribute__((target("avx2,fma,f16c")))
#define Q256(name) avx2_##name
#define Q256_VNNI 0
#include "cpu/cpu_quant_256.inc"
#undef Q256_T
#undef Q256
#undef Q256_VNNI

static void qdot_512(const cb_weight_t *w, const cb_q8_group_t *act, int n, float *y, int ldy, int o0, int o1) {
    pthread_once(&g_idx_once, idx_once);
    void (*f)(const qk_t *, int, int, int) =
        w->type == CB_TYPE_Q4_0 ? q512_q4_0 : w->type == CB_TYPE_Q4_1 ? q512_q4_1 : w->type == CB_TYPE_Q8_0 ? q512_q8_0
        : w->type == CB_TYPE_Q4_K ? q512_q4_k : q512_q6_k;
    const int ga = cb_q8_groups(w->cols);
    for (int r0 = 0; r0 < n; r0 += QMAX_R) {
        const qk_t k = {w->q, w->row_bytes, w->cols / 32, ga, act + (size_t)r0 * ga, y + (size_t)r0 * ldy, ldy};
        f(&k, n - r0 < QMAX_R ? n - r0 : QMAX_R, o0, o1);
    }
}
#endif

void cb_cpu_qdot(cb_cpu_isa_t isa, const cb_weight_t *w, const cb_q8_group_t *act, int n, float *y, int ldy, int o0,
                 int o1) {
    assert(cb_cpu_qtype_supported(w->type) && w->cols % 32 == 0);
    assert((w->type != CB_TYPE_Q4_K && w->type != CB_TYPE_Q6_K) || w->cols % 256 == 0);
#if CB_X86
    if (isa == CB_CPU_ISA_AVX512) {
        qdot_512(w, act, n, y, ldy, o0, o1);
        return;
    }
    if (isa == CB_CPU_ISA_AVXVNNI) {
        vnni_qdot(w, act, n, y, ldy, o0, o1);
        return;
    }
    if (isa == CB_CPU_ISA_AVX2) {
        avx2_qdot(w, act, n, y, ldy, o0, o1);
        return;
    }
#endif
    (void)isa;
    qdot_scalar(w, act, n, y, ldy, o0, o1);
}

/* ---------------------------------------------------------------- threaded driver */

#define QM_MAX_TASKS 1024
#define QM_ROW_BLOCK 64 /* activation rows per task (a multiple of QMAX_R) */

typedef struct {
    cb_cpu_isa_t isa;
    const cb_matmul_part_t *parts;
    const cb_q8_group_t *act;
    int n, ga, n_tasks;
    struct { int16_t part; int o0, o1, r0, r1; } task[QM_MAX_TASKS];
} qm_job_t;

static void qm_task(void *arg, int t, int thread) {
    (void)thread;
    const qm_job_t *j = arg;
    const cb_matmul_part_t *p = &j->parts[j->task[t].part];
    const int r0 = j->task[t].r0;
    cb_cpu_qdot(j->isa, p->w, j->act + (size_t)r0 * j->ga, j->task[t].r1 - r0, p->y + (size_t)r0 * p->ldy, p->ldy,
                j->task[t].o0, j->task[t].o1);
}

void cb_cpu_qmatmul(cb_cpu_isa_t isa, const cb_matmul_part_t *parts, int n_parts, const float *x, int n,
                    cb_q8_group_t *act, cb_pool_t *pool) {
    static __thread qm_job_t j; /* large; one per calling thread */
    assert(n >= 1 && n_parts >= 1);
    const int cols = parts[0].w->cols, nt = cb_pool_size(pool);
    bool done[16] = {false};
    assert(n_parts <= 16);
    for (int first = 0; first < n_parts; first++) { /* one quantization and one pool run per weight type */
        if (done[first]) continue;
        const uint32_t type = parts[first].w->type;
        cb_cpu_q8_quantize(isa, type, x, n, cols, act, pool);
        j.isa = isa, j.parts = parts, j.act = act, j.n = n, j.ga = cb_q8_groups(cols), j.n_tasks = 0;
        const int rblocks = (n + QM_ROW_BLOCK - 1) / QM_ROW_BLOCK;
        int total = 0;
        for (int p = first; p < n_parts; p++)
            if (parts[p].w->type == type) total += parts[p].w->rows;
        /* weight-row slices: ~8 tasks per thread over all (slice, row block) pairs, multiples of 16 rows */
        int width = (int)(((long)total * rblocks / (8L * nt) + 15) / 16 * 16);
        if (width < 16) width = 16;
        if (width > 256) width = 256;
        for (int p = first; p < n_parts; p++) {
            if (parts[p].w->type != type) continue;
            done[p] = true;
            assert(parts[p].w->cols == cols);
            const int rows = parts[p].w->rows;
            for (int o0 = 0; o0 < rows; o0 += width)
                for (int rb = 0; rb < rblocks; rb++) {
                    if (j.n_tasks == QM_MAX_TASKS) { /* flush (only for very large calls) */
                        cb_pool_run(pool, j.n_tasks, qm_task, &j);
                        j.n_tasks = 0;
                    }
                    j.task[j.n_tasks].part = (int16_t)p;
                    j.task[j.n_tasks].o0 = o0;
                    j.task[j.n_tasks].o1 = o0 + width < rows ? o0 + width : rows;
                    j.task[j.n_tasks].r0 = rb * QM_ROW_BLOCK;
                    j.task[j.n_tasks].r1 = (rb + 1) * QM_ROW_BLOCK < n ? (rb + 1) * QM_ROW_BLOCK : n;
                    j.n_tasks++;
                }
        }
        cb_pool_run(pool, j.n_tasks, qm_task, &j);
    }
}
