/* cpu_quant_k8_isa.h: the k8 kernels' vector bodies (Q4_K, Q5_K, Q6_K on the x8 copies; cpu_quant_k8.c),
 * included once per instruction set by cpu_quant_k8.c inside that set's target region, with the macros of cpu_quant_isa.h:
 *   X8_NAME(n)                n suffixed with the set's name (avx2, vnni, vnni_emu);
 *   X8_ACC(acc, w, x)         acc plus the products of u8 w and s8 x, 4 bytes at a time (AVX2: int16 pair
 *                             sums by maddubs; VNNI: int32 by vpdpbusd);
 *   X8_FOLD(si, acc, sc)      si (int32 per row) plus acc times the rows' scales sc;
 *   X8_SCALES_U8(p)           the 8 rows' unsigned byte scales at p in the form X8_FOLD takes;
 *   X8_SCALES_I8_PAIRS(v, o)  the signed byte scales at bytes 2s + o of v (row s), likewise.
 * Every set does the same exact integer sums and the same f32 operations, so they give the same bits. */

/* Prefetches n cache lines K8_PREFETCH bytes ahead of p. */
static inline void X8_NAME(v_prefetch)(const uint8_t *p, int n) {
    const uintptr_t a = (uintptr_t)p + K8_PREFETCH;
    for (int k = 0; k < n; k++) _mm_prefetch((const char *)(a + 64 * (uintptr_t)k), _MM_HINT_T0);
}

/* 4 bytes at p, broadcast to the 8 int32 lanes. */
static inline __m256i X8_NAME(b4)(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#define b4 X8_NAME(b4)
#define v_prefetch X8_NAME(v_prefetch)

/* The end of a Q4_K / Q5_K super-block i of one group (blk) for R activation rows, given their integer sums
 * si[r] of sc_k dot_k: acc = fma(sumi, d_w d_x, acc), then acc = fma(-summ, dmin_w d_x, acc) with summ the
 * mins times the activation's sums per 32. */
static inline __attribute__((always_inline)) void X8_NAME(q4k_sb_end)(const uint8_t *blk, const xrow_t *x, int i, const int R,
                                                                       const __m256i *si, __m256 *acc) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + Q4K_D)));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + Q4K_DMIN)));
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        __m256i sm = _mm256_setzero_si256();
        #pragma GCC unroll 4
        for (int p = 0; p < 4; p++)
            sm = _mm256_add_epi32(sm, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(
                                                            (const __m128i *)(blk + Q4K_MN + 16 * p))),
                                                        b4(x[r].kbs32 + 8 * i + 2 * p)));
        const __m256 dx = _mm256_set1_ps(x[r].kd[i]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[r]), _mm256_mul_ps(d, dx), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(sm), _mm256_mul_ps(dm, dx), acc[r]);
    }
}

/* One Q4_K or Q5_K (q5) group (8 weight rows) against R activation rows, over nsb super-blocks; out[r] = the
 * 8 rows' dot products with activation row r. Q5_K's fifth bits come from its qh vectors (bit k of each
 * byte, k = the sub-block, moved to bit 4); its int16 sums are folded every 4 steps. */
static inline __attribute__((always_inline)) void X8_NAME(v_q4k_g)(const bool q5, const uint8_t *blk, int nsb, const xrow_t *x,
                                                           const int R, __m256 *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[K8_ROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const size_t qs = q5 ? Q5K_QS : Q4K_QS;
    for (int i = 0; i < nsb; i++, blk += q5 ? K8_Q5K : K8_Q4K) {
        __m256i si[K8_ROWS];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) si[r] = _mm256_setzero_si256();
        if (q5) v_prefetch(blk + Q5K_QH, 4);
        #pragma GCC unroll 4 /* c constant: Q5_K's bit positions 2c, 2c + 1 become immediate shifts */
        for (int c = 0; c < 4; c++) {
            v_prefetch(blk + qs + 256 * c, 4);
            #pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int k = 2 * c + h;
                const __m256i sc = X8_SCALES_U8(blk + Q4K_SC + 8 * k);
                __m256i s16[K8_ROWS];
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();
                K8_UNROLL(K8_TUNROLL)
                for (int t = 0; t < 8; t++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + qs + 256 * c + 32 * t));
                    __m256i q = h ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4) : _mm256_and_si256(raw, m4);
                    if (q5) {
                        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + Q5K_QH + 32 * t));
                        const __m256i hb = k < 4 ? _mm256_slli_epi16(qh, 4 - k) : k > 4 ? _mm256_srli_epi16(qh, k - 4) : qh;
                        q = _mm256_or_si256(q, _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
                    }
                    #pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
                        s16[r] = X8_ACC(s16[r], q, b4(x[r].kq + 256 * i + 64 * c + 32 * h + 4 * t));
                    if (q5 && t == 3) { /* Q5_K: two int16 sums of 4 steps */
                        #pragma GCC unroll 4
                        for (int r = 0; r < R; r++) {
                            si[r] = X8_FOLD(si[r], s16[r], sc);
                            s16[r] = _mm256_setzero_si256();
                        }
                    }
                }
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++) si[r] = X8_FOLD(si[r], s16[r], sc);
            }
        }
        X8_NAME(q4k_sb_end)(blk, x, i, R, si, acc);
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

static inline __attribute__((always_inline)) void X8_NAME(v_q4k_g4)(const uint8_t *blk, int nsb, const xrow_t *x,
                                                                     const int R, __m256 *out) {
    X8_NAME(v_q4k_g)(false, blk, nsb, x, R, out);
}
static inline __attribute__((always_inline)) void X8_NAME(v_q4k_g5)(const uint8_t *blk, int nsb, const xrow_t *x,
                                                                     const int R, __m256 *out) {
    X8_NAME(v_q4k_g)(true, blk, nsb, x, R, out);
}

/* One Q6_K group against R activation rows (as v_q4k_g). */
static inline __attribute__((always_inline)) void X8_NAME(v_q6k_g)(const uint8_t *blk, int nsb, const xrow_t *x, const int R,
                                                           __m256 *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[K8_ROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int i = 0; i < nsb; i++, blk += K8_Q6K) {
        __m256i si[K8_ROWS];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) si[r] = _mm256_setzero_si256();
        K8_UNROLL(K8_GUNROLL)
        for (int g = 0; g < 16; g++) {
            const uint8_t *q = blk + Q6K_Q + 96 * g;
            v_prefetch(q, 2);
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)q);
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(q + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(q + 64));
            const __m256i w0 = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
            const __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                               _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
            const __m256i w2 = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(qh, m30));
            const __m256i w3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
            const __m128i sp = _mm_loadu_si128((const __m128i *)(blk + Q6K_SC + 16 * (g / 2)));
            const __m256i sc = X8_SCALES_I8_PAIRS(sp, g & 1);
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r].kq + 256 * i + 16 * g;
                const __m256i z = _mm256_setzero_si256();
                const __m256i a = X8_ACC(X8_ACC(z, w0, b4(xq)), w1, b4(xq + 4));
                const __m256i b = X8_ACC(X8_ACC(z, w2, b4(xq + 8)), w3, b4(xq + 12));
                si[r] = X8_FOLD(X8_FOLD(si[r], a, sc), b, sc);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + Q6K_D)));
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m256i off = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int p = 0; p < 8; p++)
                off = _mm256_add_epi32(off, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(
                                                                  (const __m128i *)(blk + Q6K_SC + 16 * p))),
                                                              b4(x[r].kbs + 16 * i + 2 * p)));
            const __m256i s = _mm256_sub_epi32(si[r], _mm256_slli_epi32(off, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(x[r].kd[i])), acc[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

/* ---- calls of many rows (prefill), Q5_K: each group super-block's codes are unpacked once into bytes, then
 * every activation row-quad reads them, so the fifth bits' unpacking (a load, shift, mask and OR per vector)
 * is paid once per call instead of once per K8_ROWS rows. */

/* The 5-bit codes of Q5_K group super-block blk as bytes: buf [64 vectors v][8 rows][4] = the elements
 * 4v..4v+3 of each row (sub-block v / 8). */
static inline void X8_NAME(q5k_unpack)(const uint8_t *blk, uint8_t *buf) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), b4bit = _mm256_set1_epi8(0x10);
    #pragma GCC unroll 4 /* c constant: the fifth bits' shifts become immediates */
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 8; t++) { /* chunk c: sub-blocks 2c (low nibbles, qh bit 2c) and 2c + 1 */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + Q5K_QS + 256 * c + 32 * t));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + Q5K_QH + 32 * t));
            const int k = 2 * c;
            const __m256i hl = k < 4 ? _mm256_slli_epi16(qh, 4 - k) : k > 4 ? _mm256_srli_epi16(qh, k - 4) : qh;
            const __m256i hh = k + 1 < 4 ? _mm256_slli_epi16(qh, 3 - k) : _mm256_srli_epi16(qh, k - 3);
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, m4), _mm256_and_si256(hl, b4bit));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), _mm256_and_si256(hh, b4bit));
            _mm256_store_si256((__m256i *)(buf + 256 * k + 32 * t), lo);
            _mm256_store_si256((__m256i *)(buf + 256 * (k + 1) + 32 * t), hi);
        }
}

/* Q5_K super-block i of one group (blk, its codes in buf) against R activation rows, added to acc[r]: the
 * integer sums and f32 steps of v_q4k_g, so the same bits. */
static inline __attribute__((always_inline)) void X8_NAME(v_q5k_sb)(const uint8_t *blk, const uint8_t *buf, const xrow_t *x,
                                                                     int i, const int R, __m256 *acc) {
    __m256i si[K8_ROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) si[r] = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
        const __m256i sc = X8_SCALES_U8(blk + Q4K_SC + 8 * k);
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* two int16 sums of 4 steps (4 x 2 x 31 x 127 < 2^15) */
            __m256i s16[K8_ROWS];
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();
            #pragma GCC unroll 4
            for (int t = 4 * h; t < 4 * h + 4; t++) {
                const __m256i q = _mm256_load_si256((const __m256i *)(buf + 256 * k + 32 * t));
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++) s16[r] = X8_ACC(s16[r], q, b4(x[r].kq + 256 * i + 32 * k + 4 * t));
            }
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) si[r] = X8_FOLD(si[r], s16[r], sc);
        }
    }
    X8_NAME(q4k_sb_end)(blk, x, i, R, si, acc);
}

#define K8_SB_CASE(RR) X8_NAME(v_q5k_sb)(blk, buf, x + r0, i, RR, acc + r0); break;

/* The Q5_K product for up to XROWS activation rows (cb_cpu_qdot_rows takes it for calls of more than QROWS):
 * per group, each super-block is unpacked once (q5k_unpack) and read by every row-quad; the rows' f32
 * accumulators live on the stack. Every row gets the bits cb_cpu_k8 gives it. */
void X8_NAME(cb_cpu_k8_rows)(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    assert(o0 % 8 == 0 && o1 % 8 == 0 && R >= 1 && R <= XROWS && K8_ROWS == 4 && w->type == CB_TYPE_Q5_K);
    const int nsb = w->cols / 256;
    _Alignas(32) uint8_t buf[2048]; /* one group super-block's codes [64][8][4] */
    __m256 acc[XROWS];
    for (int g = o0 / 8; g < o1 / 8; g++) {
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int i = 0; i < nsb; i++) {
            const uint8_t *blk = k8_group_sb(w, g, i);
            X8_NAME(q5k_unpack)(blk, buf);
            for (int r0 = 0; r0 < R; r0 += 4) {
                switch (R - r0 < 4 ? R - r0 : 4) {
                case 1: K8_SB_CASE(1)
                case 2: K8_SB_CASE(2)
                case 3: K8_SB_CASE(3)
                default: K8_SB_CASE(4)
                }
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (size_t)r * ldy + 8 * g, acc[r]);
    }
}
#undef K8_SB_CASE

#define K8_CASE(fn, RR)                                                                                  \
    for (int g = o0 / 8; g < o1 / 8; g++) {                                                              \
        __m256 out[K8_ROWS];                                                                             \
        X8_NAME(fn)(k8_group_sb(w, g, 0), nsb, x + r0, RR, out);                                                     \
        for (int r = 0; r < RR; r++) _mm256_storeu_ps(y + (size_t)(r0 + r) * ldy + 8 * g, out[r]);       \
    }                                                                                                    \
    break;
#if K8_ROWS == 2
#define K8_SWITCH(fn) switch (m) { case 1: K8_CASE(fn, 1) default: K8_CASE(fn, 2) }
#elif K8_ROWS == 3
#define K8_SWITCH(fn) switch (m) { case 1: K8_CASE(fn, 1) case 2: K8_CASE(fn, 2) default: K8_CASE(fn, 3) }
#else
#define K8_SWITCH(fn) switch (m) { case 1: K8_CASE(fn, 1) case 2: K8_CASE(fn, 2) case 3: K8_CASE(fn, 3) default: K8_CASE(fn, 4) }
#endif

void X8_NAME(cb_cpu_k8)(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    assert(o0 % 8 == 0 && o1 % 8 == 0 && R >= 1 && R <= QROWS);
    const int nsb = w->cols / 256;
    for (int r0 = 0; r0 < R; r0 += K8_ROWS) {
        const int m = R - r0 < K8_ROWS ? R - r0 : K8_ROWS;
        if (w->type == CB_TYPE_Q4_K) {
            K8_SWITCH(v_q4k_g4)
        } else if (w->type == CB_TYPE_Q5_K) {
            K8_SWITCH(v_q4k_g5)
        } else {
            K8_SWITCH(v_q6k_g)
        }
    }
}
#undef b4
#undef v_prefetch
#undef K8_CASE
#undef K8_SWITCH
