/* cpu_quant_b8_isa.h: the b8 kernels' vector bodies (Q4_0, Q4_1, Q5_0, Q8_0 on the x8 copies; cpu_quant_b8.c),
 * included once per instruction set by cpu_quant_b8.c inside that set's target region, with the macros of
 * cpu_quant_isa.h (X8_NAME, X8_ACC, X8_FOLD1). Every set does the same exact integer sums and the same f32
 * operations, so they give the same bits. */

/* 4 bytes at p, broadcast to the 8 int32 lanes. */
static inline __m256i X8_NAME(b4)(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#define b4 X8_NAME(b4)

/* One group of 8 weight rows of 4- or 5-bit codes against R activation rows, over nb blocks; out[r] = the 8
 * rows' dot products with activation row r. */
static inline __attribute__((always_inline)) void X8_NAME(v_nib_g)(const uint32_t type, const uint8_t *blk, int nb,
                                                           const xrow_t *x, const int R, __m256 *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), b4bit = _mm256_set1_epi8(0x10);
    const size_t bb = b8_blk_bytes(type), qs = b8_qs_at(type);
    const int off = b8_code_offset(type);
    __m256 acc[QROWS], accm[QROWS]; /* the d terms; Q4_1's min terms (a second chain) */
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, blk += bb) {
        _mm_prefetch((const char *)(blk + B8_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + B8_PREFETCH + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + B8_PREFETCH + 128), _MM_HINT_T0);
        __m256i si[QROWS], s16[QROWS];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) si[r] = s16[r] = _mm256_setzero_si256();
        const __m256i qh = type == CB_TYPE_Q5_0 ? _mm256_loadu_si256((const __m256i *)(blk + B8_QH)) : m4;
        #pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + qs + 32 * t));
            __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (type == CB_TYPE_Q5_0) { /* bit t of each qh byte, and bit 4 + t, to bit 4 */
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4 - t), b4bit));
                hi = _mm256_or_si256(hi, _mm256_and_si256(t == 0 ? qh : _mm256_srli_epi16(qh, t), b4bit));
            }
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r].q + 32 * b;
                s16[r] = X8_ACC(X8_ACC(s16[r], lo, b4(xq + 4 * t)), hi, b4(xq + 16 + 4 * t));
            }
            if (type == CB_TYPE_Q5_0 ? t % 2 == 1 : t == 3) {
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    si[r] = X8_FOLD1(si[r], s16[r]);
                    s16[r] = _mm256_setzero_si256();
                }
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 m = type == CB_TYPE_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : d;
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            if (off) si[r] = _mm256_sub_epi32(si[r], _mm256_set1_epi32(off * x[r].bs[b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[r]), _mm256_mul_ps(d, _mm256_set1_ps(x[r].d[b])), acc[r]);
            if (type == CB_TYPE_Q4_1) accm[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[r].ds[b]), accm[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r] = _mm256_add_ps(acc[r], accm[r]);
}

/* One Q8_0 group against R activation rows (as v_nib_g): |w| times q with w's sign, folded to int32 per
 * step (a pair reaches 2 * 128 * 127). */
static inline __attribute__((always_inline)) void X8_NAME(v_q8_g)(const uint8_t *blk, int nb, const xrow_t *x, const int R,
                                                          __m256 *out) {
    __m256 acc[QROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, blk += B8_Q8_0) {
        for (int k = 0; k < 5; k++) _mm_prefetch((const char *)(blk + B8_PREFETCH + 64 * k), _MM_HINT_T0);
        __m256i si[QROWS];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) si[r] = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m256i wq = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * t)), aw = _mm256_abs_epi8(wq);
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                si[r] = X8_FOLD1(si[r], X8_ACC(_mm256_setzero_si256(), aw,
                                               _mm256_sign_epi8(b4(x[r].q + 32 * b + 4 * t), wq)));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[r]), _mm256_mul_ps(d, _mm256_set1_ps(x[r].d[b])), acc[r]);
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

/* ---- calls of many rows (prefill), Q5_0: a group's codes unpacked once per 8 blocks into bytes, then read by
 * every activation row-quad, so the fifth bits' unpacking is paid once per call instead of once per QROWS
 * rows. (Q4_0 and Q4_1 keep v_nib_g for every call size: their unpacking is one mask or shift per vector, and
 * the same structure measured 7-8 % slower for them; Q8_0 has none to save.) */

/* The codes of nb (<= 8) consecutive Q5_0 group blocks from blk as bytes: buf [nb][8 vectors v][8 rows][4] =
 * the elements 4v..4v+3 of each row (v < 4: step v's low nibbles; v >= 4: step v - 4's high nibbles). */
static inline void X8_NAME(q5_0_unpack)(const uint8_t *blk, int nb, uint8_t *buf) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), b4bit = _mm256_set1_epi8(0x10);
    for (int b = 0; b < nb; b++, blk += B8_Q5_0) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + B8_QH));
        #pragma GCC unroll 4
        for (int t = 0; t < 4; t++) { /* bit t of each qh byte, and bit 4 + t, to bit 4 */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * t));
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4 - t), b4bit));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4),
                                               _mm256_and_si256(t == 0 ? qh : _mm256_srli_epi16(qh, t), b4bit));
            _mm256_store_si256((__m256i *)(buf + 256 * b + 32 * t), lo);
            _mm256_store_si256((__m256i *)(buf + 256 * b + 32 * (4 + t)), hi);
        }
    }
}

/* Q5_0 block b of one group (blk; its codes q [8][32]) against R activation rows, added to acc[r]: the
 * integer sums and f32 steps of v_nib_g, so the same bits. */
static inline __attribute__((always_inline)) void X8_NAME(v_q5_0_blk)(const uint8_t *blk, const uint8_t *q, const xrow_t *x,
                                                                       int b, const int R, __m256 *acc) {
    __m256i si[QROWS], s16[QROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) si[r] = s16[r] = _mm256_setzero_si256();
    #pragma GCC unroll 4
    for (int t = 0; t < 4; t++) {
        const __m256i lo = _mm256_load_si256((const __m256i *)(q + 32 * t));
        const __m256i hi = _mm256_load_si256((const __m256i *)(q + 32 * (4 + t)));
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const int8_t *xq = x[r].q + 32 * b;
            s16[r] = X8_ACC(X8_ACC(s16[r], lo, b4(xq + 4 * t)), hi, b4(xq + 16 + 4 * t));
        }
        if (t % 2 == 1) {
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                si[r] = X8_FOLD1(si[r], s16[r]);
                s16[r] = _mm256_setzero_si256();
            }
        }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        si[r] = _mm256_sub_epi32(si[r], _mm256_set1_epi32(16 * x[r].bs[b]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[r]), _mm256_mul_ps(d, _mm256_set1_ps(x[r].d[b])), acc[r]);
    }
}

#define B8_BLK_CASE(RR)                                                                                  \
    for (int k = 0; k < n; k++)                                                                          \
        X8_NAME(v_q5_0_blk)(blk + k * B8_Q5_0, buf + 256 * k, x + r0, b0 + k, RR, acc + r0);             \
    break;

/* The b8 product of Q5_0 for up to XROWS activation rows (cb_cpu_qdot_rows takes it for calls of more than
 * QROWS): per group, 8 blocks at a time are unpacked once and read by every row-quad; the rows' f32
 * accumulators live on the stack. Every row gets the bits cb_cpu_b8 gives it (its accm chain is zero for
 * Q5_0). */
void X8_NAME(cb_cpu_b8_rows)(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    assert(o0 % 8 == 0 && o1 % 8 == 0 && R >= 1 && R <= XROWS && w->type == CB_TYPE_Q5_0);
    const int nb = w->cols / 32;
    _Alignas(32) uint8_t buf[8 * 256]; /* 8 group blocks' codes [8][8][8][4] */
    __m256 acc[XROWS];
    for (int g = o0 / 8; g < o1 / 8; g++) {
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int b0 = 0; b0 < nb; b0 += 8) {
            const int n = nb - b0 < 8 ? nb - b0 : 8;
            const uint8_t *blk = b8_group_blk(w, g, b0);
            X8_NAME(q5_0_unpack)(blk, n, buf);
            for (int r0 = 0; r0 < R; r0 += QROWS) {
                const int m = R - r0 < QROWS ? R - r0 : QROWS;
                switch (m) {
                case 1: B8_BLK_CASE(1)
                case 2: B8_BLK_CASE(2)
                case 3: B8_BLK_CASE(3)
                default: B8_BLK_CASE(4)
                }
            }
        }
        for (int r = 0; r < R; r++) /* + 0, as v_nib_g's acc + accm: -0 comes out +0 in both */
            _mm256_storeu_ps(y + (size_t)r * ldy + 8 * g, _mm256_add_ps(acc[r], _mm256_setzero_ps()));
    }
}
#undef B8_BLK_CASE

#define B8_CASE(call, RR)                                                                                \
    for (int g = o0 / 8; g < o1 / 8; g++) {                                                              \
        __m256 out[QROWS];                                                                               \
        const uint8_t *blk = b8_group_blk(w, g, 0);                                                         \
        call;                                                                                            \
        for (int r = 0; r < RR; r++) _mm256_storeu_ps(y + (size_t)r * ldy + 8 * g, out[r]);              \
    }                                                                                                    \
    break;
#define B8_SWITCH(fn, ...)                                                                               \
    switch (R) {                                                                                         \
    case 1: B8_CASE(X8_NAME(fn)(__VA_ARGS__, blk, nb, x, 1, out), 1)                                    \
    case 2: B8_CASE(X8_NAME(fn)(__VA_ARGS__, blk, nb, x, 2, out), 2)                                    \
    case 3: B8_CASE(X8_NAME(fn)(__VA_ARGS__, blk, nb, x, 3, out), 3)                                    \
    default: B8_CASE(X8_NAME(fn)(__VA_ARGS__, blk, nb, x, 4, out), 4)                                   \
    }

void X8_NAME(cb_cpu_b8)(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    assert(o0 % 8 == 0 && o1 % 8 == 0 && R >= 1 && R <= QROWS);
    const int nb = w->cols / 32;
    switch (w->type) {
    case CB_TYPE_Q4_0: B8_SWITCH(v_nib_g, CB_TYPE_Q4_0) break;
    case CB_TYPE_Q4_1: B8_SWITCH(v_nib_g, CB_TYPE_Q4_1) break;
    case CB_TYPE_Q5_0: B8_SWITCH(v_nib_g, CB_TYPE_Q5_0) break;
    default:
        switch (R) {
        case 1: B8_CASE(X8_NAME(v_q8_g)(blk, nb, x, 1, out), 1)
        case 2: B8_CASE(X8_NAME(v_q8_g)(blk, nb, x, 2, out), 2)
        case 3: B8_CASE(X8_NAME(v_q8_g)(blk, nb, x, 3, out), 3)
        default: B8_CASE(X8_NAME(v_q8_g)(blk, nb, x, 4, out), 4)
        }
        break;
    }
}
#undef b4
#undef B8_CASE
#undef B8_SWITCH
