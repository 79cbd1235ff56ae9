/* quant.c: dequantization of F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K blocks to f32, their
 * reference quantization (cb_quant), and binary16 / bfloat16 conversions (ggml's block layouts). Pure functions,
 * no allocation, no state.
 *
 * Block structs mirror ggml's packed little-endian layouts; their sizes are pinned by _Static_assert.
 * Sources may be unaligned (a caller's buffer, or any block inside a tensor), so the structs are
 * packed and fp16 fields are read with memcpy.
 */
#include "format/quant.h"

#include <math.h>
#include <string.h>

#include "format/gguf.h"

/* Packed (alignment 1) so any source address is valid; fp16 fields are read through rd_f16(void *). */
#define PACKED __attribute__((packed))
typedef struct PACKED { uint16_t d; uint8_t qs[16]; } block_q4_0;                /* d fp16 */
typedef struct PACKED { uint16_t d, m; uint8_t qs[16]; } block_q4_1;             /* d, m fp16 */
typedef struct PACKED { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } block_q5_0;  /* d fp16; qh a LE u32 */
typedef struct PACKED { uint16_t d; int8_t qs[32]; } block_q8_0;                 /* d fp16 */
typedef struct PACKED { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } block_q4_k;
typedef struct PACKED { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } block_q5_k;
typedef struct PACKED { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } block_q6_k; /* d last */
_Static_assert(sizeof(block_q4_0) == 18, "Q4_0 block is 18 bytes");
_Static_assert(sizeof(block_q4_1) == 20, "Q4_1 block is 20 bytes");
_Static_assert(sizeof(block_q5_0) == 22, "Q5_0 block is 22 bytes");
_Static_assert(sizeof(block_q8_0) == 34, "Q8_0 block is 34 bytes");
_Static_assert(sizeof(block_q4_k) == 144, "Q4_K block is 144 bytes");
_Static_assert(sizeof(block_q5_k) == 176, "Q5_K block is 176 bytes");
_Static_assert(sizeof(block_q6_k) == 210, "Q6_K block is 210 bytes");
_Static_assert(sizeof(float) == 4, "f32 is 4 bytes");

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float cb_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in f32 */
        float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7F800000u | (mant << 13)); /* inf, NaN (payload kept) */
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t cb_f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7FFFFFFFu;
    if (x >= 0x7F800000u) /* inf or NaN (NaN stays a quiet NaN, top payload bits kept) */
        return (uint16_t)(sign | 0x7C00u | (x > 0x7F800000u ? 0x200u | ((x >> 13) & 0x3FFu) : 0u));
    if (x >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520 rounds to inf */
    if (x >= 0x38800000u) { /* normal half range: rebias exponent, round 13 dropped bits to even */
        uint32_t base = (x - 0x38000000u) >> 13, rem = x & 0x1FFFu;
        if (rem > 0x1000u || (rem == 0x1000u && (base & 1u))) base++;
        return (uint16_t)(sign | base);
    }
    /* subnormal half (or zero): value / 2^-24 = mant * 2^(e - 126), rounded to even */
    uint32_t e = x >> 23;
    if (e < 102) return sign; /* below 2^-25: rounds to 0 (exactly 2^-25 ties to even 0 below) */
    uint32_t mant = (x & 0x7FFFFFu) | 0x800000u, s = 126u - e; /* s in 14..24 */
    uint32_t q = mant >> s, rem = mant & ((1u << s) - 1u), half = 1u << (s - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

float cb_bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

uint16_t cb_f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

static inline float rd_f16(const void *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return cb_f16_to_f32(h);
}

/* ---------------------------------------------------------------- per type */

static void dq_q4_0(const block_q4_0 *b, float *y, size_t nb) {
    for (size_t i = 0; i < nb; i++, y += 32) {
        float d = rd_f16(&b[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((b[i].qs[j] & 0xF) - 8) * d;       /* low nibble: element j */
            y[j + 16] = (float)((b[i].qs[j] >> 4) - 8) * d;   /* high nibble: element j+16 */
        }
    }
}

static void dq_q4_1(const block_q4_1 *b, float *y, size_t nb) {
    for (size_t i = 0; i < nb; i++, y += 32) {
        float d = rd_f16(&b[i].d), m = rd_f16(&b[i].m);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(b[i].qs[j] & 0xF) * d + m;          /* min added */
            y[j + 16] = (float)(b[i].qs[j] >> 4) * d + m;
        }
    }
}

/* The 32 fifth bits of a Q5_0 block: bit j = element j (little-endian, whatever the host). */
static inline uint32_t q5_hbits(const uint8_t qh[4]) {
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

static void dq_q5_0(const block_q5_0 *b, float *y, size_t nb) {
    for (size_t i = 0; i < nb; i++, y += 32) {
        float d = rd_f16(&b[i].d);
        uint32_t qh = q5_hbits(b[i].qh);
        for (int j = 0; j < 16; j++) {
            int lo = (b[i].qs[j] & 0xF) | (int)((qh >> j) & 1u) << 4;        /* element j */
            int hi = (b[i].qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4;  /* element j+16 */
            y[j] = (float)(lo - 16) * d;
            y[j + 16] = (float)(hi - 16) * d;
        }
    }
}

static void dq_q8_0(const block_q8_0 *b, float *y, size_t nb) {
    for (size_t i = 0; i < nb; i++, y += 32) {
        float d = rd_f16(&b[i].d);
        for (int j = 0; j < 32; j++) y[j] = (float)b[i].qs[j] * d;
    }
}

/* 6-bit scale and min of sub-block k (0..7) from the 12 packed bytes (ggml get_scale_min_k4). */
static inline void scale_min_k4(int k, const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    if (k < 4) {
        *sc = q[k] & 63;
        *mn = q[k + 4] & 63;
    } else {
        *sc = (uint8_t)((q[k + 4] & 0xF) | ((q[k - 4] >> 6) << 4));
        *mn = (uint8_t)((q[k + 4] >> 4) | ((q[k] >> 6) << 4));
    }
}

static void dq_q4_k(const block_q4_k *b, float *y, size_t nb) {
    for (size_t i = 0; i < nb; i++) {
        float d = rd_f16(&b[i].d), dmin = rd_f16(&b[i].dmin);
        const uint8_t *q = b[i].qs;
        for (int c = 0; c < 4; c++, q += 32) { /* 64-element chunk: sub-blocks 2c (low), 2c+1 (high) */
            uint8_t sc, mn;
            scale_min_k4(2 * c, b[i].scales, &sc, &mn);
            float d1 = d * sc, m1 = dmin * mn;
            scale_min_k4(2 * c + 1, b[i].scales, &sc, &mn);
            float d2 = d * sc, m2 = dmin * mn;
            for (int l = 0; l < 32; l++) y[l] = d1 * (float)(q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) y[l + 32] = d2 * (float)(q[l] >> 4) - m2;
            y += 64;
        }
    }
}

/* Q5_K: Q4_K's sub-blocks, scales and mins, with a fifth bit per element: bit k of qh[l] is element l of
 * sub-block k's (w = d sc q - dmin mn, q = nibble | bit << 4, 0..31). */
static void dq_q5_k(const block_q5_k *b, float *y, size_t nb) {
    for (size_t i = 0; i < nb; i++) {
        float d = rd_f16(&b[i].d), dmin = rd_f16(&b[i].dmin);
        const uint8_t *q = b[i].qs, *qh = b[i].qh;
        for (int c = 0; c < 4; c++, q += 32) {
            uint8_t sc, mn;
            scale_min_k4(2 * c, b[i].scales, &sc, &mn);
            float d1 = d * sc, m1 = dmin * mn;
            scale_min_k4(2 * c + 1, b[i].scales, &sc, &mn);
            float d2 = d * sc, m2 = dmin * mn;
            for (int l = 0; l < 32; l++) y[l] = d1 * (float)((q[l] & 0xF) | ((qh[l] >> (2 * c)) & 1) << 4) - m1;
            for (int l = 0; l < 32; l++) y[l + 32] = d2 * (float)((q[l] >> 4) | ((qh[l] >> (2 * c + 1)) & 1) << 4) - m2;
            y += 64;
        }
    }
}

static void dq_q6_k(const block_q6_k *b, float *y, size_t nb) {
    for (size_t i = 0; i < nb; i++) {
        float d = rd_f16(&b[i].d);
        const uint8_t *ql = b[i].ql, *qh = b[i].qh;
        const int8_t *sc = b[i].scales;
        for (int half = 0; half < 2; half++) {
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is + 0] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
            y += 128;
            ql += 64;
            qh += 32;
            sc += 8;
        }
    }
}

bool cb_dequant(uint32_t type, const void *src, float *dst, size_t n) {
    size_t blck = cb_type_block_elems(type);
    if (blck == 0 || n % blck != 0 || (n && (!src || !dst))) return false;
    size_t nb = n / blck;
    switch (type) {
    case CB_TYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        return true;
    case CB_TYPE_F16: {
        const uint8_t *s = src;
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = cb_f16_to_f32(h);
        }
        return true;
    }
    case CB_TYPE_BF16: {
        const uint8_t *s = src;
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = cb_bf16_to_f32(h);
        }
        return true;
    }
    case CB_TYPE_Q4_0: dq_q4_0(src, dst, nb); return true;
    case CB_TYPE_Q4_1: dq_q4_1(src, dst, nb); return true;
    case CB_TYPE_Q5_0: dq_q5_0(src, dst, nb); return true;
    case CB_TYPE_Q8_0: dq_q8_0(src, dst, nb); return true;
    case CB_TYPE_Q4_K: dq_q4_k(src, dst, nb); return true;
    case CB_TYPE_Q5_K: dq_q5_k(src, dst, nb); return true;
    case CB_TYPE_Q6_K: dq_q6_k(src, dst, nb); return true;
    default: return false;
    }
}

/* ---------------------------------------------------------------- quantization (cb_quant)
 *
 * Round to nearest on each block's grid, with one pass of scales (no error search). The rules are chosen
 * so that dequantizing and quantizing again gives the same bits: a block's extreme elements are put on the
 * ends of its grid (their codes set outright where the f16 rounding of a scale could move them off), so
 * the dequantized block has the same extremes in grid units and gives back the same scales. Products of
 * an f16 scale and a 6- or 8-bit code are exact in f32, which the K types' rules lean on; where an f32
 * sum of dequantized values rounds, the floors of the K sub-scales leave a margin (the factor 1 + 2^-10). */

static inline void wr_f16(void *p, uint16_t h) { memcpy(p, &h, 2); }

/* binary16 of v rounded to nearest, saturated at +-65504 (a scale never becomes inf). */
static uint16_t f16_sat(float v) {
    uint16_t h = cb_f32_to_f16(v);
    return (h & 0x7FFFu) >= 0x7C00u ? (uint16_t)((h & 0x8000u) | 0x7BFFu) : h;
}

/* round(v) clamped to [lo, hi] (v may be huge; NaN gives lo). */
static inline int round_clamp(float v, int lo, int hi) {
    if (!(v > (float)lo)) return lo;
    if (v >= (float)hi) return hi;
    return (int)roundf(v);
}

/* Index of the first element of largest |x|. */
static int argmax_abs(const float *x, int n) {
    int k = 0;
    for (int j = 1; j < n; j++)
        if (fabsf(x[j]) > fabsf(x[k])) k = j;
    return k;
}

/* The symmetric blocks of 32 (Q4_0, Q5_0, Q8_0): q[j] in [qmin, qmax], value q d; returns d (f16 bits).
 * Q4_0 / Q5_0 (sign_max): d = v / qmin for the element v of largest |x|, so v maps to qmin (the long end)
 * with its own sign; Q8_0: d = |v| / qmax. v's code is set to the end it maps to: rounding d to f16 moves
 * it by far less than half a step except for a subnormal d, and the dequantized block then has the same
 * largest element, which gives back the same d exactly. */
static uint16_t q_sym(const float *x, int qmin, int qmax, bool sign_max, int *q) {
    const int k = argmax_abs(x, 32);
    const float v = x[k];
    uint16_t h = f16_sat(sign_max ? v / (float)qmin : fabsf(v) / (float)qmax);
    if ((h & 0x7FFFu) == 0) h = 0; /* +0, not -0: a zero block dequantizes to +0 */
    const float d = cb_f16_to_f32(h);
    for (int j = 0; j < 32; j++) q[j] = d != 0.0f ? round_clamp(x[j] / d, qmin, qmax) : 0;
    if (d != 0.0f) q[k] = sign_max ? qmin : v < 0 ? -qmax : qmax;
    return h;
}

static void qz_q4_0(const float *x, block_q4_0 *b, size_t nb) {
    for (size_t i = 0; i < nb; i++, x += 32) {
        int q[32];
        b[i].d = q_sym(x, -8, 7, true, q);
        for (int j = 0; j < 16; j++) b[i].qs[j] = (uint8_t)((q[j] + 8) | (q[j + 16] + 8) << 4);
    }
}

static void qz_q5_0(const float *x, block_q5_0 *b, size_t nb) {
    for (size_t i = 0; i < nb; i++, x += 32) {
        int q[32];
        b[i].d = q_sym(x, -16, 15, true, q);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            const int lo = q[j] + 16, hi = q[j + 16] + 16; /* 0..31 */
            b[i].qs[j] = (uint8_t)((lo & 0xF) | (hi & 0xF) << 4);
            qh |= (uint32_t)(lo >> 4) << j | (uint32_t)(hi >> 4) << (j + 16);
        }
        for (int k = 0; k < 4; k++) b[i].qh[k] = (uint8_t)(qh >> (8 * k));
    }
}

static void qz_q8_0(const float *x, block_q8_0 *b, size_t nb) {
    for (size_t i = 0; i < nb; i++, x += 32) {
        int q[32];
        b[i].d = q_sym(x, -127, 127, false, q);
        for (int j = 0; j < 32; j++) b[i].qs[j] = (int8_t)q[j];
    }
}

/* Q4_1: m = min x and d = (max x - m) / 15, each rounded to f16; the min element's code is 0 and the max's 15
 * (their ends of the grid, whatever the f16 roundings). A block whose spread 15 d is within 2^-10 of its
 * magnitude (below what f16 m and d resolve) is stored as a constant: m = its midpoint, d = 0. */
static void qz_q4_1(const float *x, block_q4_1 *b, size_t nb) {
    for (size_t i = 0; i < nb; i++, x += 32) {
        int kmin = 0, kmax = 0;
        for (int j = 1; j < 32; j++) {
            if (x[j] < x[kmin]) kmin = j;
            if (x[j] > x[kmax]) kmax = j;
        }
        const float lo = x[kmin], hi = x[kmax];
        uint16_t hm = f16_sat(lo), hd = f16_sat((hi - cb_f16_to_f32(hm)) / 15.0f);
        if (hd & 0x8000u) hd = 0; /* hi - m < 0: m rounded above every element */
        const float m = cb_f16_to_f32(hm), d = cb_f16_to_f32(hd);
        int q[32] = {0};
        if (!(15.0f * d > fmaxf(fabsf(m), fabsf(m + 15.0f * d)) * 0x1p-10f)) {
            hm = f16_sat(lo * 0.5f + hi * 0.5f); /* constant block */
            hd = 0;
        } else {
            for (int j = 0; j < 32; j++) q[j] = round_clamp((x[j] - m) / d, 0, 15);
            q[kmin] = 0;
            q[kmax] = 15;
        }
        b[i].d = hd;
        b[i].m = hm;
        for (int j = 0; j < 16; j++) b[i].qs[j] = (uint8_t)(q[j] | q[j + 16] << 4);
    }
}

/* Q4_K and Q5_K, per super-block of 8 sub-blocks of 32 (w = d sc q - dmin mn, q in 0..Q with Q = 15 or 31):
 *   mins: m_k = -min(0, min x_k); dmin = max m_k / 63 rounded to f16; a sub-block with the largest m_k
 *     takes mn = 63 and its min elements code 0; the others the largest mn_k <= 63 with dmin mn_k <= m_k,
 *     so their grid starts at or above their min (whose code is then 0);
 *   scales: r_k = max x_k + dmin mn_k (the range above the grid's start); d = max r_k / (Q * 63) rounded
 *     to f16; a sub-block with the largest r_k takes sc = 63 and its max elements code Q; the others
 *     sc_k = floor(r_k / (Q d) (1 + 2^-10)), at most 63, so their grid ends at or just below their max
 *     (whose code is then Q).
 * Dequantized, sub-block k spans exactly -dmin mn_k .. Q d sc_k - dmin mn_k (up to the f32 rounding of
 * that top), and these rules give back the same dmin, mn_k, d and sc_k: the largest span is 63 dmin
 * (63 Q d) again, and the floors of the exact ratios mn_k, sc_k (1 + 2^-10) are mn_k and sc_k.
 * qz_kminmax writes one super-block's f16 d and dmin, its 12 packed scale bytes and its 256 codes. */
static void qz_kminmax(const float *x, int Q, uint16_t *d_out, uint16_t *dmin_out, uint8_t s[12], uint8_t q[256]) {
    float mneg[8], hi[8], mmax = 0.0f;
    int kmin[8], kmax[8];
    for (int k = 0; k < 8; k++) {
        const float *xs = x + 32 * k;
        kmin[k] = kmax[k] = 0;
        for (int l = 1; l < 32; l++) {
            if (xs[l] < xs[kmin[k]]) kmin[k] = l;
            if (xs[l] > xs[kmax[k]]) kmax[k] = l;
        }
        mneg[k] = xs[kmin[k]] < 0.0f ? -xs[kmin[k]] : 0.0f;
        hi[k] = xs[kmax[k]];
        mmax = fmaxf(mmax, mneg[k]);
    }
    const uint16_t hdm = f16_sat(mmax / 63.0f);
    const float dmin = cb_f16_to_f32(hdm);
    int mn[8], sc[8];
    float off[8], rng[8], rmax = 0.0f;
    for (int k = 0; k < 8; k++) {
        int c = 0;
        if (dmin > 0.0f && mneg[k] == mmax) {
            c = 63;
        } else if (dmin > 0.0f) {
            c = (int)fminf(63.0f, floorf(mneg[k] / dmin));
            while (c > 0 && dmin * (float)c > mneg[k]) c--;
            while (c < 63 && dmin * (float)(c + 1) <= mneg[k]) c++;
        }
        mn[k] = c;
        off[k] = dmin * (float)c;
        rng[k] = fmaxf(0.0f, hi[k] + off[k]);
        rmax = fmaxf(rmax, rng[k]);
    }
    const uint16_t hd = f16_sat(rmax / (float)(63 * Q));
    const float d = cb_f16_to_f32(hd);
    for (int k = 0; k < 8; k++) {
        if (d == 0.0f) sc[k] = 0;
        else if (rng[k] == rmax) sc[k] = 63;
        else sc[k] = (int)fminf(63.0f, floorf(rng[k] / ((float)Q * d) * (1.0f + 0x1p-10f)));
    }
    *d_out = hd;
    *dmin_out = hdm;
    memset(s, 0, 12);
    for (int k = 0; k < 8; k++) { /* the inverse of scale_min_k4 */
        if (k < 4) {
            s[k] |= (uint8_t)sc[k];
            s[k + 4] |= (uint8_t)mn[k];
        } else {
            s[k + 4] = (uint8_t)((sc[k] & 0xF) | (mn[k] & 0xF) << 4);
            s[k - 4] |= (uint8_t)((sc[k] >> 4) << 6);
            s[k] |= (uint8_t)((mn[k] >> 4) << 6);
        }
    }
    for (int k = 0; k < 8; k++) {
        const float step = d * (float)sc[k];
        for (int l = 0; l < 32; l++) {
            int c = step > 0.0f ? round_clamp((x[32 * k + l] + off[k]) / step, 0, Q) : 0;
            if (step > 0.0f && rng[k] == rmax && x[32 * k + l] == hi[k]) c = Q;
            if (mn[k] && mneg[k] == mmax && x[32 * k + l] == -mneg[k]) c = 0;
            q[32 * k + l] = (uint8_t)c;
        }
    }
}

static void qz_q4_k(const float *x, block_q4_k *b, size_t nb) {
    for (size_t i = 0; i < nb; i++, x += 256) {
        uint8_t q[256];
        uint16_t d, dmin;
        qz_kminmax(x, 15, &d, &dmin, b[i].scales, q);
        b[i].d = d;
        b[i].dmin = dmin;
        for (int c = 0; c < 4; c++) /* chunk c: sub-block 2c in the low nibbles, 2c+1 in the high */
            for (int l = 0; l < 32; l++) b[i].qs[32 * c + l] = (uint8_t)(q[64 * c + l] | q[64 * c + 32 + l] << 4);
    }
}

static void qz_q5_k(const float *x, block_q5_k *b, size_t nb) {
    for (size_t i = 0; i < nb; i++, x += 256) {
        uint8_t q[256];
        uint16_t d, dmin;
        qz_kminmax(x, 31, &d, &dmin, b[i].scales, q);
        b[i].d = d;
        b[i].dmin = dmin;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                b[i].qs[32 * c + l] = (uint8_t)((q[64 * c + l] & 0xF) | (q[64 * c + 32 + l] & 0xF) << 4);
        for (int l = 0; l < 32; l++) {
            unsigned h = 0;
            for (int k = 0; k < 8; k++) h |= (unsigned)(q[32 * k + l] >> 4) << k;
            b[i].qh[l] = (uint8_t)h;
        }
    }
}

/* Q6_K, per super-block of 16 groups of 16 (w = d sc (q - 32), sc int8): group k's first element v_k of
 * largest |x| gives s_k = v_k / -32; S = the largest |s_k| with its sign; d = -S / 128 rounded to f16, so
 * that a group with s_k = S takes sc = -128 and v_k the code -32; the other groups take
 * sc_k = sign(s_k / d) floor(|s_k / d| (1 + 2^-10)), at most 127 (128 when negative), so |d sc_k| <= |s_k|
 * and v_k's code is -32 again. Dequantized, group k's largest element is -32 d sc_k exactly, which gives
 * back the same s_k = d sc_k, d and sc_k. */
static void qz_q6_k(const float *x, block_q6_k *b, size_t nb) {
    for (size_t i = 0; i < nb; i++, x += 256) {
        float s[16];
        int kv[16], kS = 0;
        for (int k = 0; k < 16; k++) {
            kv[k] = 16 * k + argmax_abs(x + 16 * k, 16);
            s[k] = x[kv[k]] / -32.0f;
            if (fabsf(s[k]) > fabsf(s[kS])) kS = k;
        }
        const float S = s[kS];
        uint16_t hd = f16_sat(fabsf(S) / 128.0f);
        if (hd && S > 0.0f) hd |= 0x8000u; /* d of the opposite sign to S */
        const float d = cb_f16_to_f32(hd);
        int sc[16];
        for (int k = 0; k < 16; k++) {
            sc[k] = 0;
            if (d == 0.0f) continue;
            const float t = s[k] / d;
            const float mag = floorf(fabsf(t) * (1.0f + 0x1p-10f));
            sc[k] = s[k] == S ? -128 : t < 0.0f ? -(int)fminf(mag, 128.0f) : (int)fminf(mag, 127.0f);
        }
        uint8_t u[256]; /* q + 32, 0..63 */
        for (int e = 0; e < 256; e++) {
            const float step = d * (float)sc[e / 16];
            u[e] = (uint8_t)((step != 0.0f ? round_clamp(x[e] / step, -32, 31) : 0) + 32);
        }
        for (int k = 0; k < 16; k++)
            if (sc[k] == -128) u[kv[k]] = 0; /* code -32 */
        for (int h = 0; h < 2; h++) { /* the inverse of dq_q6_k's unpacking */
            const uint8_t *v = u + 128 * h;
            for (int l = 0; l < 32; l++) {
                b[i].ql[64 * h + l] = (uint8_t)((v[l] & 0xF) | (v[l + 64] & 0xF) << 4);
                b[i].ql[64 * h + l + 32] = (uint8_t)((v[l + 32] & 0xF) | (v[l + 96] & 0xF) << 4);
                b[i].qh[32 * h + l] =
                    (uint8_t)((v[l] >> 4) | (v[l + 32] >> 4) << 2 | (v[l + 64] >> 4) << 4 | (v[l + 96] >> 4) << 6);
            }
        }
        for (int k = 0; k < 16; k++) b[i].scales[k] = (int8_t)sc[k];
        b[i].d = hd;
    }
}

bool cb_quant(uint32_t type, const float *src, void *dst, size_t n) {
    size_t blck = cb_type_block_elems(type);
    if (blck == 0 || n % blck != 0 || (n && (!src || !dst))) return false;
    size_t nb = n / blck;
    uint8_t *out = dst;
    switch (type) {
    case CB_TYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        return true;
    case CB_TYPE_F16:
        for (size_t i = 0; i < n; i++) wr_f16(out + 2 * i, cb_f32_to_f16(src[i]));
        return true;
    case CB_TYPE_BF16:
        for (size_t i = 0; i < n; i++) wr_f16(out + 2 * i, cb_f32_to_bf16(src[i]));
        return true;
    case CB_TYPE_Q4_0: qz_q4_0(src, dst, nb); return true;
    case CB_TYPE_Q4_1: qz_q4_1(src, dst, nb); return true;
    case CB_TYPE_Q5_0: qz_q5_0(src, dst, nb); return true;
    case CB_TYPE_Q8_0: qz_q8_0(src, dst, nb); return true;
    case CB_TYPE_Q4_K: qz_q4_k(src, dst, nb); return true;
    case CB_TYPE_Q5_K: qz_q5_k(src, dst, nb); return true;
    case CB_TYPE_Q6_K: qz_q6_k(src, dst, nb); return true;
    default: return false;
    }
}

size_t cb_quant_row_bytes(uint32_t type, size_t n) {
    size_t blck = cb_type_block_elems(type);
    return blck && n % blck == 0 ? n / blck * cb_type_block_bytes(type) : 0;
}
