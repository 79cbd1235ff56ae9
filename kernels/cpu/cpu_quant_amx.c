/* cpu_quant_amx.c: the x8 copies' products (cpu_quant.h) on the AMX tile unit (AMX-INT8), for calls of 16
 * activation rows or more; and the same with the tile unit emulated in C, so that the kernel's logic is
 * tested on CPUs without AMX.
 *
 * tdpbssd multiplies a tile A of 16 rows of 4K signed bytes by a tile B of K rows of 16 groups of 4 signed
 * bytes into C [16][16] int32: C[m][n] += sum over j of A[m][j] B[j / 4][4n + j % 4]. A is 16 activation
 * rows' int8 q, loaded straight from the quantized rows (one stride apart); B is one block of 16 weight rows
 * (two x8 groups) with the codes unpacked to bytes: B[j][4n + i] = weight row n's code of element 4j + i,
 * which is the x8 interleave itself (group g's vector beside group g + 1's), the nibbles split. One tdpbssd
 * per scale block: 32 elements (the blocks of Q4_0, Q4_1, Q5_0, Q8_0; the sub-blocks of Q4_K and Q5_K) or
 * 16 (Q6_K's), so C holds exactly the integer block dots the other kernels sum (codes 0..63 or Q8_0's int8
 * times int8: every sum exact in int32). C is stored and folded with AVX2 the way the x8 kernels fold theirs:
 * the same exact integer sums, then the same f32 operations in the same order, so the same bits as the
 * scalar kernels.
 * Per call (weight rows [o0, o1), o1 - o0 a multiple of 16; R activation rows, a multiple of 16 up to
 * XROWS): for each tile of 16 weight rows, each block is unpacked once into B and multiplied by the R / 16
 * activation tiles (C tiles 0..3). The per-row accumulators (f32 [R][16], and int32 [R][16] per K
 * super-block) live on the stack. */
#include "cpu/cpu_quant_internal.h"

#include <assert.h>

#include "format/gguf.h"

#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__)
#include <immintrin.h>
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#endif

/* The tile configuration (palette 1): the layout ldtilecfg reads. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg_t;

static void amx_config(amx_cfg_t *c) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int t = 0; t < 4; t++) c->rows[t] = 16, c->colsb[t] = 64; /* C */
    c->rows[4] = 16, c->colsb[4] = 32;                              /* A, blocks of 32 */
    c->rows[5] = 8, c->colsb[5] = 64;                               /* B, blocks of 32 */
    c->rows[6] = 16, c->colsb[6] = 16;                              /* A, blocks of 16 */
    c->rows[7] = 4, c->colsb[7] = 64;                               /* B, blocks of 16 */
}

/* 4 bytes at p, broadcast to the 8 int32 lanes. */
static inline __m256i amx_b4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline void store2(int8_t *dst, __m256i a, __m256i b) {
    _mm256_store_si256((__m256i *)dst, a);
    _mm256_store_si256((__m256i *)(dst + 32), b);
}

/* ---------------------------------------------------------------- b8: Q4_0, Q4_1, Q5_0, Q8_0 */

/* B [8][64] of block gb[0] (weight rows 0..7) beside gb[1] (8..15): row t the elements 4t..4t+3 of every row
 * (4-bit codes: step t's low nibbles to row t, its high nibbles to row 4 + t; Q8_0: step t). */
static inline void b8_unpack(uint32_t type, const uint8_t *const gb[2], int8_t *B) {
    if (type == CB_TYPE_Q8_0) {
        for (int t = 0; t < 8; t++)
            store2(B + 64 * t, _mm256_loadu_si256((const __m256i *)(gb[0] + 16 + 32 * t)),
                   _mm256_loadu_si256((const __m256i *)(gb[1] + 16 + 32 * t)));
        return;
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F), b4bit = _mm256_set1_epi8(0x10);
    const size_t qs = b8_qs_at(type);
    for (int h = 0; h < 2; h++) {
        const uint8_t *g = gb[h];
        const __m256i qh = type == CB_TYPE_Q5_0 ? _mm256_loadu_si256((const __m256i *)(g + B8_QH)) : m4;
        for (int t = 0; t < 4; t++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(g + qs + 32 * t));
            __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (type == CB_TYPE_Q5_0) { /* bit t of each qh byte, and bit 4 + t, to bit 4 */
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - t)), b4bit));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(t)), b4bit));
            }
            _mm256_store_si256((__m256i *)(B + 64 * t + 32 * h), lo);
            _mm256_store_si256((__m256i *)(B + 64 * (4 + t) + 32 * h), hi);
        }
    }
}

/* Block b's dots C [R][16] into the accumulators, as the b8 kernels: acc = fma(sumi - off bs, d_w d_x, acc),
 * Q4_1's accm = fma(m_w, ds_x, accm). */
static inline void b8_fold(uint32_t type, int off, const uint8_t *const gb[2], const xrow_t *x, int R, int b,
                           const int32_t *C, __m256 (*acc)[2], __m256 (*accm)[2]) {
    __m256 d[2], m[2];
    for (int h = 0; h < 2; h++) {
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)gb[h]));
        m[h] = type == CB_TYPE_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb[h] + 16))) : d[h];
    }
    for (int r = 0; r < R; r++) {
        const __m256 dx = _mm256_set1_ps(x[r].d[b]);
        for (int h = 0; h < 2; h++) {
            __m256i si = _mm256_load_si256((const __m256i *)(C + 16 * r + 8 * h));
            if (off) si = _mm256_sub_epi32(si, _mm256_set1_epi32(off * x[r].bs[b]));
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(d[h], dx), acc[r][h]);
            if (type == CB_TYPE_Q4_1) accm[r][h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(x[r].ds[b]), accm[r][h]);
        }
    }
}

/* ---------------------------------------------------------------- k8: Q4_K, Q5_K */

/* B [8][64] of sub-block k (chunk k / 2, its low or high nibbles; Q5_K's fifth bit k): row t the elements
 * 4t..4t+3 of the sub-block. */
static inline void q4k_unpack(bool q5, const uint8_t *const gb[2], int k, int8_t *B) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), b4bit = _mm256_set1_epi8(0x10);
    const __m128i sh = _mm_cvtsi32_si128(k < 4 ? 4 - k : k - 4);
    const size_t qs = q5 ? Q5K_QS : Q4K_QS;
    const int c = k / 2;
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 8; t++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(gb[h] + qs + 256 * c + 32 * t));
            __m256i q = k & 1 ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4) : _mm256_and_si256(raw, m4);
            if (q5) {
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(gb[h] + Q5K_QH + 32 * t));
                const __m256i hb = k < 4 ? _mm256_sll_epi16(qh, sh) : _mm256_srl_epi16(qh, sh);
                q = _mm256_or_si256(q, _mm256_and_si256(hb, b4bit));
            }
            _mm256_store_si256((__m256i *)(B + 64 * t + 32 * h), q);
        }
}

/* si += C times sub-block k's scales (exact in int32, as the k8 kernels' sums). */
static inline void q4k_fold(const uint8_t *const gb[2], int k, int R, const int32_t *C, __m256i (*si)[2]) {
    __m256i sc[2];
    for (int h = 0; h < 2; h++) sc[h] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(gb[h] + Q4K_SC + 8 * k)));
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++)
            si[r][h] = _mm256_add_epi32(si[r][h], _mm256_mullo_epi32(_mm256_load_si256((const __m256i *)(C + 16 * r + 8 * h)), sc[h]));
}

/* Super-block i's sums into acc, as the k8 kernels: acc = fma(sumi, d_w d_x, acc), then
 * acc = fma(-summ, dmin_w d_x, acc) with summ the mins times the activation's sums per 32. */
static inline void q4k_finish(const uint8_t *const gb[2], const xrow_t *x, int R, int i, __m256i (*si)[2],
                              __m256 (*acc)[2]) {
    for (int h = 0; h < 2; h++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb[h] + Q4K_D)));
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb[h] + Q4K_DMIN)));
        for (int r = 0; r < R; r++) {
            __m256i sm = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++)
                sm = _mm256_add_epi32(sm, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(
                                                                (const __m128i *)(gb[h] + Q4K_MN + 16 * p))),
                                                            amx_b4(x[r].kbs32 + 8 * i + 2 * p)));
            const __m256 dx = _mm256_set1_ps(x[r].kd[i]);
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[r][h]), _mm256_mul_ps(d, dx), acc[r][h]);
            acc[r][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(sm), _mm256_mul_ps(dm, dx), acc[r][h]);
        }
    }
}

/* ---------------------------------------------------------------- k8: Q6_K */

/* B [4][64] of group q (16 elements): row u the elements 16q + 4u + b (b = 0..3), codes 0..63. */
static inline void q6k_unpack16(const uint8_t *const gb[2], int q, int8_t *B) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const uint8_t *p = gb[h] + Q6K_Q + 96 * q;
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)p), ql1 = _mm256_loadu_si256((const __m256i *)(p + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 64));
        const __m256i w[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)),
            _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(qh, m30)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30))};
        for (int u = 0; u < 4; u++) _mm256_store_si256((__m256i *)(B + 64 * u + 32 * h), w[u]);
    }
}

/* si += (C - 32 bsum_q) times group q's signed scales (exact in int32). */
static inline void q6k_fold(const uint8_t *const gb[2], const xrow_t *x, int q, int i, int R, const int32_t *C,
                            __m256i (*si)[2]) {
    const __m128i pick = q & 1 ? _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15)
                               : _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    __m256i sc[2];
    for (int h = 0; h < 2; h++)
        sc[h] = _mm256_cvtepi8_epi32(
            _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(gb[h] + Q6K_SC + 16 * (q / 2))), pick));
    for (int r = 0; r < R; r++) {
        const __m256i o = _mm256_set1_epi32(32 * x[r].kbs[16 * i + q]);
        for (int h = 0; h < 2; h++) {
            const __m256i dot = _mm256_sub_epi32(_mm256_load_si256((const __m256i *)(C + 16 * r + 8 * h)), o);
            si[r][h] = _mm256_add_epi32(si[r][h], _mm256_mullo_epi32(dot, sc[h]));
        }
    }
}

/* Super-block i's sums into acc: acc = fma(sumi, d_w d_x, acc). */
static inline void q6k_finish(const uint8_t *const gb[2], const xrow_t *x, int R, int i, __m256i (*si)[2],
                              __m256 (*acc)[2]) {
    for (int h = 0; h < 2; h++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb[h] + Q6K_D)));
        for (int r = 0; r < R; r++)
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(x[r].kd[i])),
                                        acc[r][h]);
    }
}

/* ---------------------------------------------------------------- the tile unit emulated */

/* The 8 tiles of one thread: rows of up to 64 bytes, shaped by the last configuration. */
typedef struct {
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16 * 64];
} amx_emu_t;
static _Thread_local amx_emu_t g_emu;

static void emu_config(const amx_cfg_t *c) {
    memset(&g_emu, 0, sizeof g_emu);
    for (int t = 0; t < 8; t++) g_emu.rows[t] = c->rows[t], g_emu.colsb[t] = c->colsb[t];
}
static void emu_zero(int t) { memset(g_emu.data[t], 0, sizeof g_emu.data[t]); }
static void emu_load(int t, const void *p, size_t stride) {
    for (int r = 0; r < g_emu.rows[t]; r++) memcpy(g_emu.data[t] + 64 * r, (const uint8_t *)p + (size_t)r * stride, g_emu.colsb[t]);
}
static void emu_store(int t, void *p, size_t stride) {
    for (int r = 0; r < g_emu.rows[t]; r++) memcpy((uint8_t *)p + (size_t)r * stride, g_emu.data[t] + 64 * r, g_emu.colsb[t]);
}
/* tdpbssd: C[m][n] += sum over j < colsb(a) of A[m][j] B[j / 4][4n + j % 4], signed bytes, int32 sums. */
static void emu_dpbssd(int c, int a, int b) {
    assert(g_emu.colsb[a] / 4 == g_emu.rows[b] && g_emu.colsb[b] == g_emu.colsb[c] && g_emu.rows[a] == g_emu.rows[c]);
    const int8_t *A = (const int8_t *)g_emu.data[a], *B = (const int8_t *)g_emu.data[b];
    for (int m = 0; m < g_emu.rows[c]; m++)
        for (int n = 0; n < g_emu.colsb[c] / 4; n++) {
            int32_t s;
            memcpy(&s, g_emu.data[c] + 64 * m + 4 * n, 4);
            for (int j = 0; j < g_emu.colsb[a]; j++) s += (int32_t)A[64 * m + j] * B[64 * (j / 4) + 4 * n + j % 4];
            memcpy(g_emu.data[c] + 64 * m + 4 * n, &s, 4);
        }
}

#define AMX_NAME(n) n##_emu
#define AMX_CONFIG(cfg) emu_config(cfg)
#define AMX_RELEASE() ((void)0)
#define AMX_ZERO(t) emu_zero(t)
#define AMX_LOAD(t, p, s) emu_load(t, p, s)
#define AMX_STORE(t, p, s) emu_store(t, p, s)
#define AMX_DPBSSD(c, a, b) emu_dpbssd(c, a, b)
#include "cpu/cpu_quant_amx_isa.h"
#undef AMX_NAME
#undef AMX_CONFIG
#undef AMX_RELEASE
#undef AMX_ZERO
#undef AMX_LOAD
#undef AMX_STORE
#undef AMX_DPBSSD
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

/* ---------------------------------------------------------------- the tile unit (AMX-INT8) */

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,amx-tile,amx-int8"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,amx-tile,amx-int8")
#endif
#define AMX_NAME(n) n
#define AMX_CONFIG(cfg) _tile_loadconfig(cfg)
#define AMX_RELEASE() _tile_release()
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, p, s) _tile_loadd(t, p, s)
#define AMX_STORE(t, p, s) _tile_stored(t, p, s)
#define AMX_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#include "cpu/cpu_quant_amx_isa.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
void cb_cpu_x8_amx(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    (void)w, (void)o0, (void)o1, (void)x, (void)R, (void)y, (void)ldy;
    assert(!"cb_cpu_x8_amx: no AMX on this target");
}
void cb_cpu_x8_amx_emu(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    cb_cpu_x8_amx(w, o0, o1, x, R, y, ldy);
}
#endif
