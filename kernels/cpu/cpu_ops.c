/* cpu_ops.c: f32 CPU kernels (see cpu_ops.h): RMSNorm, NORM RoPE, SwiGLU, quantized matvec with
 * in-register dequantization, OpenBLAS GEMM, blocked attention with per-row key limits, vector exp.
 * Terse by design; the shapes live in cpu_ops.h.
 */
#include "cpu/cpu_ops.h"
#include "base/alloc.h"

#include <assert.h>
#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "format/gguf.h"
#include "format/quant.h"
#include "base/log.h"
#include "cpu/cpu_quant.h"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define CB_AVX512 1
#else
#define CB_AVX512 0
#endif
/* AVX2 + FMA (and no AVX-512): the same kernels 8 lanes wide. The build is -march=native, so the set is
 * the build machine's; the scalar loops remain for everything else. */
#if !CB_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define CB_AVX2 1
#else
#define CB_AVX2 0
#endif

/* ---------------------------------------------------------------- OpenBLAS setup */

/* Exported by DYNAMIC_ARCH OpenBLAS builds (driver/others/dynamic.c); not in cblas.h. */
void gotoblas_dynamic_init(void) __attribute__((weak));
void gotoblas_dynamic_quit(void) __attribute__((weak));

static pthread_once_t g_init_once = PTHREAD_ONCE_INIT;

static void cpu_init_once(void) {
    const char *core = openblas_get_corename();
    bool old_core = core && (!strcmp(core, "Prescott") || !strcmp(core, "Core2") || !strcmp(core, "Penryn") ||
                             !strcmp(core, "Nehalem") || !strcmp(core, "Dunnington") || !strcmp(core, "Atom"));
    if (old_core && !getenv("OPENBLAS_CORETYPE") && gotoblas_dynamic_init && gotoblas_dynamic_quit) {
        const char *want = NULL;
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
            want = __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
            want = "Haswell";
        if (want) {
            /* Re-run OpenBLAS's own core selection with the documented override variable. */
            setenv("OPENBLAS_CORETYPE", want, 1);
            gotoblas_dynamic_quit();
            gotoblas_dynamic_init();
            unsetenv("OPENBLAS_CORETYPE");
            CB_DEBUG("OpenBLAS detected core %s; switched to %s kernels", core, openblas_get_corename());
        }
    }
    openblas_set_num_threads(1);
}

const char *cb_cpu_init(void) {
    pthread_once(&g_init_once, cpu_init_once);
    return openblas_get_corename();
}

void *cb_cpu_alloc_huge(size_t bytes, bool zero) {
    const size_t huge = (size_t)2 << 20;
    if (bytes == 0) bytes = 1;
    if (bytes > SIZE_MAX - huge) return NULL;
    void *p;
    size_t n;
    if (bytes < 2 * huge) { /* small: cache-line aligned, no rounding to whole huge pages */
        n = (bytes + 63) / 64 * 64;
        p = cb_aligned_alloc(64, n);
    } else {
        n = (bytes + huge - 1) / huge * huge;
        p = cb_aligned_alloc(huge, n);
        if (p) madvise(p, n, MADV_HUGEPAGE); /* advice only: failure is harmless */
    }
    if (p && zero) memset(p, 0, n);
    return p;
}

/* ---------------------------------------------------------------- exp */

#if CB_AVX512
/* exp(x) for a vector: Cody-Waite reduction x = n ln2 + r, degree-6 polynomial (Cephes expf
 * coefficients), scale by 2^n with vscalefps (exact, handles underflow to 0). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.72283f)), _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

#if CB_AVX2
/* exp(x) for 8 lanes: the same reduction and polynomial as exp16; 2^n is built in the exponent field, so
 * x is clamped to at most 88.376, and below ln FLT_MIN the result is 0 (no subnormals). */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3365447505531f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ); /* exp underflows to 0 there, as expf does */
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* The last n < 8 values of a row as one vector (the other lanes `fill`), and back. */
static inline __m256 load_tail8(const float *s, int n, float fill) {
    float t[8] = {fill, fill, fill, fill, fill, fill, fill, fill};
    memcpy(t, s, sizeof(float) * (size_t)n);
    return _mm256_loadu_ps(t);
}
static inline void store_tail8(float *s, int n, __m256 v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    memcpy(s, t, sizeof(float) * (size_t)n);
}

/* max of s[0:n) (n >= 1). */
static inline float max_row8(const float *s, int n) {
    __m256 v = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + j));
    if (j < n) v = _mm256_max_ps(v, load_tail8(s + j, n - j, -INFINITY));
    return hmax8(v);
}

/* s[0:n) = exp(s - m) in place; returns their sum (every value through exp8, whatever its lane). */
static inline float exp_sub_sum8(float *s, int n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (j < n) {
        const __m256 keep = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(n - j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(load_tail8(s + j, n - j, m), vm)), keep);
        store_tail8(s + j, n - j, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum8(sum);
}
#endif

void cb_cpu_exp(const float *src, float *dst, size_t n) {
    size_t i = 0;
#if CB_AVX512
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, exp16(_mm512_loadu_ps(src + i)));
    if (i < n) {
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(dst + i, k, exp16(_mm512_maskz_loadu_ps(k, src + i)));
        i = n;
    }
#elif CB_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, exp8(_mm256_loadu_ps(src + i)));
    if (i < n) {
        store_tail8(dst + i, (int)(n - i), exp8(load_tail8(src + i, (int)(n - i), 0.0f)));
        i = n;
    }
#endif
    for (; i < n; i++) dst[i] = expf(src[i]);
}

/* ---------------------------------------------------------------- small ops */

static inline __attribute__((always_inline)) float dot_f32(const float *a, const float *b, int n) {
    int i = 0;
    float s = 0.0f;
#if CB_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = hsum16(acc);
#elif CB_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    s = hsum8(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

void cb_cpu_rmsnorm(const float *x, const float *w, int n, int dim, float eps, float *y) {
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = y + (size_t)r * dim;
        float ss = dot_f32(xr, xr, dim);
        float scale = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) yr[i] = (xr[i] * scale) * w[i];
    }
}

void cb_cpu_rope_coeffs(int32_t pos, const cb_rope_t *r, float *cs) {
    const int d = r->n_dims;
    for (int i = 0; i < d / 2; i++) {
        double inv_freq = pow((double)r->base, -2.0 * i / (double)d);
        double theta = (double)pos * inv_freq;
        if (r->freq_scale != 1.0f) theta *= (double)r->freq_scale;
        if (r->freq_factors) theta /= (double)r->freq_factors[i];
        cs[2 * i] = (float)cos(theta);
        cs[2 * i + 1] = (float)sin(theta);
    }
}

void cb_cpu_rope_apply(float *x, int n, int n_heads, int head_dim, cb_rope_type_t type, const float *cs) {
    const int half = head_dim / 2;
    for (int r = 0; r < n; r++) {
        const float *c = cs + (size_t)r * head_dim;
        for (int h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)r * n_heads + h) * head_dim;
            if (type == CB_ROPE_NEOX) {
                for (int i = 0; i < half; i++) {
                    float x0 = v[i], x1 = v[i + half], co = c[2 * i], si = c[2 * i + 1];
                    v[i] = x0 * co - x1 * si;
                    v[i + half] = x0 * si + x1 * co;
                }
                continue;
            }
            for (int i = 0; i < head_dim; i += 2) {
                float x0 = v[i], x1 = v[i + 1], co = c[i], si = c[i + 1];
                v[i] = x0 * co - x1 * si;
                v[i + 1] = x0 * si + x1 * co;
            }
        }
    }
}

void cb_cpu_rope(float *x, int n, int n_heads, const int32_t *pos, const cb_rope_t *r) {
    float cs[2048];
    assert(r->n_dims <= 2048);
    for (int i = 0; i < n; i++) {
        cb_cpu_rope_coeffs(pos[i], r, cs);
        cb_cpu_rope_apply(x + (size_t)i * n_heads * r->n_dims, 1, n_heads, r->n_dims, r->type, cs);
    }
}

void cb_cpu_add_bias(float *x, const float *b, int n, int dim) {
    for (int i = 0; i < n; i++) {
        float *xr = x + (size_t)i * dim;
        for (int j = 0; j < dim; j++) xr[j] += b[j];
    }
}

/* out = gate * sigmoid(z) * up with z = gate (SiLU) or z = 2 sqrt(2/pi) (gate + 0.044715 gate^3) (GELU's tanh
 * form: 0.5 g (1 + tanh(u)) = g sigmoid(2u)). */
static void glu(const float *gate, const float *up, size_t n, float *out, bool gelu) {
    const float c1 = gelu ? 1.5957691216057308f : 1.0f, c3 = gelu ? 0.0713548162726009f : 0.0f; /* 2 sqrt(2/pi) (1, 0.044715) */
    size_t i = 0;
#if CB_AVX512
    const __m512 one = _mm512_set1_ps(1.0f), v1 = _mm512_set1_ps(c1), v3 = _mm512_set1_ps(c3);
    for (; i + 16 <= n; i += 16) {
        __m512 g = _mm512_loadu_ps(gate + i);
        __m512 z = gelu ? _mm512_mul_ps(g, _mm512_fmadd_ps(_mm512_mul_ps(g, g), v3, v1)) : g;
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
    }
#elif CB_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), v1 = _mm256_set1_ps(c1), v3 = _mm256_set1_ps(c3);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 z = gelu ? _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), v3, v1)) : g;
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) {
        float e, g = gate[i], mz = gelu ? -g * (g * g * c3 + c1) : -g;
        cb_cpu_exp(&mz, &e, 1);
        out[i] = g / (1.0f + e) * up[i];
    }
}

void cb_cpu_swiglu(const float *gate, const float *up, size_t n, float *out) { glu(gate, up, n, out, false); }
void cb_cpu_geglu(const float *gate, const float *up, size_t n, float *out) { glu(gate, up, n, out, true); }

void cb_cpu_scale(float *x, size_t n, float a) {
    for (size_t i = 0; i < n; i++) x[i] *= a;
}

void cb_cpu_add(float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

/* ---------------------------------------------------------------- dequantization */

#if CB_AVX512
static inline float f16f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return cb_f16_to_f32(h);
#endif
}
#endif

void cb_cpu_dequant_row(const cb_weight_t *w, int row, float *dst) {
    if (w->x8) {
        cb_cpu_x8_dequant_row(w, row, dst);
        return;
    }
    if (w->v16) {
        cb_cpu_v16_dequant_row(w, row, dst);
        return;
    }
    const uint8_t *src = (const uint8_t *)w->q + (size_t)row * w->row_bytes;
    const int nb = w->cols / 32;
#if CB_AVX512
    if (w->type == CB_TYPE_Q4_1) {
        const __m128i m4 = _mm_set1_epi8(0x0F);
        for (int b = 0; b < nb; b++, src += 20) {
            __m512 d = _mm512_set1_ps(f16f(src)), m = _mm512_set1_ps(f16f(src + 2));
            __m128i raw = _mm_loadu_si128((const __m128i *)(src + 4));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, m4)));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), m4)));
            _mm512_storeu_ps(dst + 32 * b, _mm512_add_ps(_mm512_mul_ps(lo, d), m));
            _mm512_storeu_ps(dst + 32 * b + 16, _mm512_add_ps(_mm512_mul_ps(hi, d), m));
        }
        return;
    }
    if (w->type == CB_TYPE_Q8_0) {
        for (int b = 0; b < nb; b++, src += 34) {
            __m512 d = _mm512_set1_ps(f16f(src));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 2))));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 18))));
            _mm512_storeu_ps(dst + 32 * b, _mm512_mul_ps(lo, d));
            _mm512_storeu_ps(dst + 32 * b + 16, _mm512_mul_ps(hi, d));
        }
        return;
    }
#endif
    (void)nb;
    bool ok = cb_dequant(w->type, src, dst, (size_t)w->cols);
    assert(ok); /* types were checked at load */
    (void)ok;
}

void cb_cpu_embed(const cb_weight_t *table, const int32_t *tokens, int n, float *x) {
    for (int i = 0; i < n; i++) cb_cpu_dequant_row(table, tokens[i], x + (size_t)i * table->cols);
}

/* ---------------------------------------------------------------- matvec (decode) */

/* f32 weight rows: the weight's f32 copy (reference numerics), an F32 tensor, or else each row dequantized
 * into buf (types without an integer kernel). Rows [o0, o1) times n activation rows; buf [cols]. */
static void matvec_f32(const cb_weight_t *w, const float *x, int n, float *y, int ldy, int o0, int o1, float *buf) {
    for (int o = o0; o < o1; o++) {
        const float *wr;
        if (w->f32) {
            wr = w->f32 + (size_t)o * w->cols;
        } else if (w->type == CB_TYPE_F32) {
            wr = (const float *)((const uint8_t *)w->q + (size_t)o * w->row_bytes);
        } else {
            cb_cpu_dequant_row(w, o, buf);
            wr = buf;
        }
        for (int r = 0; r < n; r++) y[(size_t)r * ldy + o] = dot_f32(wr, x + (size_t)r * w->cols, w->cols);
    }
}

/* Integer kernels for every quantized weight that has one, unless the model kept an f32 copy. */
static bool use_qdot(const cb_weight_t *w) { return !w->f32 && cb_cpu_qdot_supported(w); }

/* The call's activations, quantized once by the calling thread in the activation formats fmt (a mask of
 * CB_CPU_Q8_*): s->xq [n][cb_cpu_q8_row_bytes(cols)]. */
static const uint8_t *quantize_rows(const cb_cpu_mm_scratch_t *s, const float *x, int n, int cols, unsigned fmt) {
    assert(n <= s->max_rows && cols <= s->max_cols);
    const size_t rb = cb_cpu_q8_row_bytes(cols);
    for (int r = 0; r < n; r++) cb_cpu_q8_quantize(x + (size_t)r * cols, cols, fmt, s->xq + (size_t)r * rb);
    return s->xq;
}

/* Weight rows [o0, o1) times n activation rows: by the integer kernels when xq (x quantized by quantize_rows:
 * use_qdot), else in f32. */
static void matvec_range(const cb_weight_t *w, const float *x, const uint8_t *xq, int n, float *y, int ldy, int o0,
                         int o1, float *buf) {
    if (xq)
        cb_cpu_qdot_rows(w, o0, o1, xq, n, y, ldy);
    else
        matvec_f32(w, x, n, y, ldy, o0, o1, buf);
}

typedef struct {
    const cb_weight_t *w;
    const float *x;
    const uint8_t *xq;
    int n, ldy, chunk;
    float *y;
    const cb_cpu_mm_scratch_t *s;
} matvec_job_t;

static void matvec_task(void *arg, int task, int thread) {
    const matvec_job_t *j = arg;
    const cb_weight_t *w = j->w;
    int o0 = task * j->chunk, o1 = o0 + j->chunk < w->rows ? o0 + j->chunk : w->rows;
    matvec_range(w, j->x, j->xq, j->n, j->y, j->ldy, o0, o1, j->s->rows + (size_t)thread * j->s->max_cols);
}

void cb_cpu_matvec(const cb_weight_t *w, const float *x, int n, float *y, int ldy, const cb_cpu_mm_scratch_t *s,
                   cb_pool_t *pool) {
    assert(n >= 1);
    const uint8_t *xq = use_qdot(w) ? quantize_rows(s, x, n, w->cols, cb_cpu_qdot_format(w)) : NULL;
    /* ~8 tasks per thread (dynamic claiming balances them), in multiples of 16 rows */
    int nt = cb_pool_size(pool);
    int chunk = (w->rows / (8 * nt) + 15) / 16 * 16;
    if (chunk < 16) chunk = 16;
    matvec_job_t j = {w, x, xq, n, ldy, chunk, y, s};
    cb_pool_run(pool, (w->rows + chunk - 1) / chunk, matvec_task, &j);
}

/* ---------------------------------------------------------------- GEMM (prefill) */

/* GEMMs on the v16 layout run its integer kernel over the call's quantized rows (xq), in tiles of this
 * many activation rows (their int8 rows stay in L1/L2 while the slice's weight groups pass). */
#define V16_GEMM_TILE 64

/* Weights whose GEMM is the integer kernel (v16 copy, no f32 reference copy). */
static bool use_v16_gemm(const cb_weight_t *w) { return !w->f32 && w->v16; }

/* Y[:, r0:r1] = X · W[r0:r1]ᵀ: for v16 weights by the integer kernel on xq (x quantized by quantize_rows);
 * else one sgemm over the f32 rows when there are some (f32 copy or F32 tensor), else over tiles of weight
 * rows dequantized into tile [tile_floats] (the thread's), one sgemm per tile. */
static void gemm_range(const cb_weight_t *w, const float *x, const uint8_t *xq, int n, float *y, int ldy, int r0,
                       int r1, float *tile, size_t tile_floats) {
    const int cols = w->cols;
    if (xq) {
        const size_t rb = cb_cpu_q8_row_bytes(cols);
        for (int i0 = 0; i0 < n; i0 += V16_GEMM_TILE) {
            const int m = n - i0 < V16_GEMM_TILE ? n - i0 : V16_GEMM_TILE;
            cb_cpu_qdot_rows(w, r0, r1, xq + (size_t)i0 * rb, m, y + (size_t)i0 * ldy, ldy);
        }
        return;
    }
    const float *f = w->f32 ? w->f32 : w->type == CB_TYPE_F32 ? (const float *)w->q : NULL;
    if (f) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, r1 - r0, cols, 1.0f, x, cols, f + (size_t)r0 * cols,
                    cols, 0.0f, y + r0, ldy);
        return;
    }
    int t_rows = (int)(tile_floats / (size_t)cols);
    assert(t_rows >= 1);
    for (int a = r0; a < r1; a += t_rows) {
        const int b = a + t_rows < r1 ? a + t_rows : r1;
        for (int o = a; o < b; o++) cb_cpu_dequant_row(w, o, tile + (size_t)(o - a) * cols);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, b - a, cols, 1.0f, x, cols, tile, cols, 0.0f, y + a,
                    ldy);
    }
}

typedef struct {
    const cb_weight_t *w;
    const float *x;
    const uint8_t *xq; /* x quantized, for v16 weights */
    int n, ldy, slice;
    float *y;
    const cb_cpu_mm_scratch_t *s;
} gemm_job_t;

static void gemm_task(void *arg, int task, int thread) {
    const gemm_job_t *j = arg;
    const cb_weight_t *w = j->w;
    int c0 = task * j->slice, c1 = c0 + j->slice < w->rows ? c0 + j->slice : w->rows;
    if (c1 > c0)
        gemm_range(w, j->x, j->xq, j->n, j->y, j->ldy, c0, c1, j->s->tiles + (size_t)thread * j->s->tile_floats,
                   j->s->tile_floats);
}

void cb_cpu_gemm(const cb_weight_t *w, const float *x, int n, float *y, int ldy, const cb_cpu_mm_scratch_t *s,
                 cb_pool_t *pool) {
    assert(w->cols <= s->max_cols);
    /* Output columns (weight rows) in 2 slices per thread, multiples of 32; each slice is one
     * single-threaded sgemm (or one per tile), claimed dynamically. */
    int nt = cb_pool_size(pool), n_slices = nt > 1 ? 2 * nt : 1;
    int slice = ((w->rows + n_slices - 1) / n_slices + 31) / 32 * 32;
    const uint8_t *xq = use_v16_gemm(w) ? quantize_rows(s, x, n, w->cols, cb_cpu_qdot_format(w)) : NULL;
    gemm_job_t j = {w, x, xq, n, ldy, slice, y, s};
    cb_pool_run(pool, (w->rows + slice - 1) / slice, gemm_task, &j);
}

/* ---------------------------------------------------------------- several outputs of one x */

#define MULTI_MAX_TASKS 512

typedef struct {
    const cb_matmul_part_t *parts;
    const float *x;
    const uint8_t *xq;
    int n;
    bool gemm;
    const cb_cpu_mm_scratch_t *s;
    int n_tasks;
    struct { int16_t part; int r0, r1; } task[MULTI_MAX_TASKS];
} multi_job_t;

static void multi_task(void *arg, int t, int thread) {
    const multi_job_t *j = arg;
    const cb_matmul_part_t *p = &j->parts[j->task[t].part];
    const cb_weight_t *w = p->w;
    int r0 = j->task[t].r0, r1 = j->task[t].r1;
    if (j->gemm)
        gemm_range(w, j->x, use_v16_gemm(w) ? j->xq : NULL, j->n, p->y, p->ldy, r0, r1,
                   j->s->tiles + (size_t)thread * j->s->tile_floats, j->s->tile_floats);
    else
        matvec_range(w, j->x, use_qdot(w) ? j->xq : NULL, j->n, p->y, p->ldy, r0, r1,
                     j->s->rows + (size_t)thread * j->s->max_cols);
}

void cb_cpu_matmul_multi(const cb_matmul_part_t *parts, int n_parts, const float *x, int n, bool gemm,
                         const cb_cpu_mm_scratch_t *s, cb_pool_t *pool) {
    static __thread multi_job_t j; /* large; one per calling thread */
    j.parts = parts;
    j.x = x;
    j.n = n;
    j.gemm = gemm;
    j.s = s;
    j.n_tasks = 0;
    j.xq = NULL;
    int nt = cb_pool_size(pool), total = 0;
    unsigned done = 0; /* activation formats quantized: each once, whichever parts read it (Q4_K and Q6_K) */
    for (int p = 0; p < n_parts; p++) {
        assert(parts[p].w->cols == parts[0].w->cols); /* one x for every part */
        total += parts[p].w->rows;
        if (gemm ? use_v16_gemm(parts[p].w) : use_qdot(parts[p].w)) {
            const unsigned f = cb_cpu_qdot_format(parts[p].w);
            if (!(done & f)) j.xq = quantize_rows(s, x, n, parts[p].w->cols, f);
            done |= f;
        }
    }
    /* GEMM: ~2 slices per thread over all parts (multiples of 32 rows); matvec: ~8 per thread (16) */
    int align = gemm ? 32 : 16, per = gemm ? 2 : 8;
    int width = (total / (per * nt) + align - 1) / align * align;
    if (width < align) width = align;
    if (nt == 1 && gemm) width = total;
    for (int p = 0; p < n_parts; p++) {
        const int rows = parts[p].w->rows;
        int k = (rows + width - 1) / width; /* slices of this part, evenly sized */
        int w = ((rows + k - 1) / k + align - 1) / align * align;
        for (int r0 = 0; r0 < rows; r0 += w) {
            assert(j.n_tasks < MULTI_MAX_TASKS);
            j.task[j.n_tasks].part = (int16_t)p;
            j.task[j.n_tasks].r0 = r0;
            j.task[j.n_tasks].r1 = r0 + w < rows ? r0 + w : rows;
            j.n_tasks++;
        }
    }
    cb_pool_run(pool, j.n_tasks, multi_task, &j);
}

/* ---------------------------------------------------------------- attention */

#define ATT_BLOCK_ROWS 64  /* query rows per GEMM block (x group size query heads) */
#define ATT_MAX_G 16       /* largest GQA group (n_head / n_head_kv) the block path handles */
#define ATT_KEY_CHUNK 512  /* keys per score tile of the block path */

#define ATT_SPLIT_ROWS 4   /* up to this many rows use the split-key (decode) kernel */
#define ATT_SPLIT_MIN 256  /* smallest key chunk of one split task */
#define ATT_ROWS_MAX 16    /* rows of a decode batch (cb_cpu_attention_rows) per pool run */
#define ATT_ROWS_PIECE 32  /* keys whose K (or V) rows stay in L1 while every head reads them */
#define ATT_ROWS_AHEAD 32  /* keys ahead whose rows a piece prefetches (the hardware prefetchers do not follow
                              reads that use a third of each row per pass) */
#define ATT_F16_PIECE 64   /* f16 pools, split kernel: keys of one KV head converted at a time (L1-sized) */

/* Keys per task when the split kernel runs `rows` rows of largest key limit lim on nt threads. The
 * chunking is part of the numerics: a decode row is chunked as a one-row call would chunk it. */
static int split_chunk(int lim, int rows, int n_head_kv, int nt) {
    const int want = (4 * nt + rows * n_head_kv - 1) / (rows * n_head_kv); /* chunks per (row, KV head) */
    const int chunk = (lim + want - 1) / want;
    return chunk < ATT_SPLIT_MIN ? ATT_SPLIT_MIN : (chunk + 15) / 16 * 16;
}

/* Shared region at the start of the scratch: split-kernel partials [rows][n_head][chunks][2 + head_dim]
 * (ATT_SPLIT_ROWS rows), or those of cb_cpu_attention_rows [tasks][n_head][2 + head_dim] (ATT_ROWS_MAX rows). */
static size_t att_partial_floats(const cb_attn_geom_t *g, int max_keys) {
    const size_t part = (size_t)ATT_ROWS_MAX * g->n_head * (size_t)((max_keys + ATT_SPLIT_MIN - 1) / ATT_SPLIT_MIN) *
                        (size_t)(g->head_dim + 2);
    /* or (bf16 blocks) every KV head's K and V (hi, lo each) in bf16 tiles: [n_head_kv][chunks][4][ATT_KEY_CHUNK][hd] */
    const size_t pack = (size_t)g->n_head_kv * (size_t)((max_keys + ATT_KEY_CHUNK - 1) / ATT_KEY_CHUNK) *
                        ATT_KEY_CHUNK * (size_t)g->head_dim * 2 + 16;
    return part > pack ? part : pack;
}

/* Per-thread region after it: Q and O blocks plus one score tile (or one row of scores), or the scores of
 * every head over one chunk of keys (cb_cpu_attention_rows; the largest chunk is the one-thread one), or
 * (f16 split kernel) the scores of the G query heads of a KV head over a chunk of at most max_keys keys. */
static size_t att_tile_floats(const cb_attn_geom_t *g, int max_keys) {
    const size_t G = (size_t)(g->n_head / g->n_head_kv), rows = G * ATT_BLOCK_ROWS;
    size_t tile = rows * ATT_KEY_CHUNK > (size_t)max_keys ? rows * ATT_KEY_CHUNK : (size_t)max_keys;
    size_t heads = (size_t)g->n_head * (size_t)split_chunk(max_keys, 1, g->n_head_kv, 1);
    tile = heads > tile ? heads : tile;
    return G * (size_t)max_keys > tile ? G * (size_t)max_keys : tile;
}

/* Offset, in a thread's region, of the f32 copy of an f16 piece: [ATT_ROWS_PIECE][kv_dim] (rows kernel),
 * [ATT_F16_PIECE][head_dim] (split kernel) or [head_dim] (one row, one head). */
static size_t att_cvt_offset(const cb_attn_geom_t *g, int max_keys) {
    const size_t rows = (size_t)(g->n_head / g->n_head_kv) * ATT_BLOCK_ROWS;
    /* Q, O, the tile, and K and V of one key chunk gathered (from non-consecutive blocks, or converted from
     * f16): [2][ATT_KEY_CHUNK][head_dim] */
    return rows * (size_t)g->head_dim * 2 + att_tile_floats(g, max_keys) + 2 * (size_t)ATT_KEY_CHUNK * g->head_dim + 16;
}

/* Offset of the bf16 blocks' weights [G * ATT_BLOCK_ROWS][ATT_KEY_CHUNK] bf16 (attn_block_amx_task). */
static size_t att_bf16_offset(const cb_attn_geom_t *g, int max_keys) {
    const size_t kvd = (size_t)g->n_head_kv * g->head_dim, a = ATT_ROWS_PIECE * kvd,
                 b = (size_t)ATT_F16_PIECE * g->head_dim;
    return att_cvt_offset(g, max_keys) + (a > b ? a : b) + 16;
}

static size_t att_thread_floats(const cb_attn_geom_t *g, int max_keys) {
    const size_t G = (size_t)(g->n_head / g->n_head_kv);
    return att_bf16_offset(g, max_keys) + (size_t)ATT_KEY_CHUNK * G * ATT_BLOCK_ROWS / 2 + 16;
}

/* ---------------------------------------------------------------- KV views */

/* Pool row of position p. */
static inline size_t kv_row(const cb_cpu_kv_t *kv, int p) {
    return (size_t)kv->blocks[p / kv->block_tokens] * (size_t)kv->block_tokens + (size_t)(p % kv->block_tokens);
}

/* Positions from p on (up to end) whose rows follow each other in the pool. */
static inline int kv_run(const cb_cpu_kv_t *kv, int p, int end) {
    const int bt = kv->block_tokens;
    int b = p / bt, q = (b + 1) * bt;
    while (q < end && kv->blocks[q / bt] == kv->blocks[b] + (q / bt - b)) q += bt;
    return (q < end ? q : end) - p;
}

/* Value e of K (or V) pool rows of an f32 / f16 pool. */
static inline const float *kv_f32(const void *base, size_t e) { return (const float *)base + e; }
static inline const uint16_t *kv_f16(const void *base, size_t e) { return (const uint16_t *)base + e; }

/* dst[t][0:w) = f32 of src[t * ld][0:w) for t < n: rows of an f16 pool converted (and gathered). */
static void cvt_rows_f16(const uint16_t *src, size_t ld, int n, int w, float *dst, size_t ldd) {
    for (int t = 0; t < n; t++) cb_cpu_kv_to_f32(CB_KV_F16, src + (size_t)t * ld, dst + (size_t)t * ldd, (size_t)w);
}

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

void cb_cpu_kv_to_f32(cb_kv_dtype_t dt, const void *src, float *dst, size_t n) {
    if (dt == CB_KV_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    if (dt == CB_KV_Q8_0) {
        assert(n % 32 == 0);
        cb_dequant(CB_TYPE_Q8_0, src, dst, n); /* kvfile's decoder: the same bits */
        return;
    }
    const uint16_t *h = src;
    size_t i = 0;
    if (dt == CB_KV_F16) {
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(h + i))));
#elif defined(__F16C__) && defined(__AVX__)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(h + i))));
#endif
        for (; i < n; i++) dst[i] = cb_f16_to_f32(h[i]);
    } else {
        for (; i < n; i++) dst[i] = cb_bf16_to_f32(h[i]);
    }
}

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

static void scale_row(float *x, int n, float a) {
    for (int i = 0; i < n; i++) x[i] *= a;
}

/* Row j's head kvh of pool plane base (K or V) as f32: in place, or converted into cvt [hd] (f16). */
static inline const float *head_f32(const cb_cpu_kv_t *kv, const void *base, int j, int kvh, int kvd, int hd,
                                    float *cvt) {
    const size_t e = kv_row(kv, j) * kvd + (size_t)kvh * hd;
    if (kv->dtype != CB_KV_F16) return kv_f32(base, e);
    cb_cpu_kv_to_f32(CB_KV_F16, kv_f16(base, e), cvt, (size_t)hd);
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

typedef struct {
    const cb_attn_geom_t *g;
    const float *q;
    const cb_cpu_kv_t *kv;
    const int32_t *key_limit;
    float *out, *scratch;
    size_t per_thread;     /* floats of each thread's region */
    size_t partial_floats; /* floats of the shared partials region at the start of scratch */
    size_t cvt_offset;     /* f16 pools: offset of the converted piece in each thread's region */
    size_t bf16_offset;    /* bf16 blocks: offset of their weight tiles in each thread's region */
    uint16_t *pack;        /* bf16 blocks: K and V tiles of every (KV head, chunk), in the shared region */
    int max_lim;           /* bf16 blocks: the call's largest key limit */
    int n, rb;
    int chunk, n_chunks;   /* split kernel: keys per task, tasks per (row, KV head) */
} attn_job_t;

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
static float online_softmax(float *s, int lim, int w, float *m, float *l) {
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

/* A thread's gathered K [ATT_KEY_CHUNK][hd] (then V) in its region of the block path: after the Q and O blocks
 * [G * ATT_BLOCK_ROWS][hd] and the score tile [G * ATT_BLOCK_ROWS][ATT_KEY_CHUNK]. */
static inline float *att_gather_k(float *base, int G, int hd) {
    return base + (size_t)G * ATT_BLOCK_ROWS * hd * 2 + (size_t)G * ATT_BLOCK_ROWS * ATT_KEY_CHUNK;
}

/* Keys [c0, c0 + w) of KV head kvh as f32 rows ld floats apart: *K, *V point into the pool when the rows
 * follow each other there (f32 pools), else into GK, GV [w][hd] (gathered, converted from f16 on the way). */
static void chunk_kv(const cb_cpu_kv_t *kv, int kvh, int kvd, int hd, int c0, int w, float *GK, float *GV,
                     const float **K, const float **V, int *ld) {
    if (kv->dtype == CB_KV_F16) { /* converted while gathered, a run of consecutive rows at a time */
        for (int p = c0, n_run; p < c0 + w; p += n_run) {
            n_run = kv_run(kv, p, c0 + w);
            const size_t e = kv_row(kv, p) * kvd + (size_t)kvh * hd;
            cvt_rows_f16(kv_f16(kv->k, e), (size_t)kvd, n_run, hd, GK + (size_t)(p - c0) * hd, (size_t)hd);
            cvt_rows_f16(kv_f16(kv->v, e), (size_t)kvd, n_run, hd, GV + (size_t)(p - c0) * hd, (size_t)hd);
        }
        *K = GK, *V = GV, *ld = hd;
    } else if (kv_run(kv, c0, c0 + w) == w) {
        *K = kv_f32(kv->k, kv_row(kv, c0) * kvd + (size_t)kvh * hd);
        *V = kv_f32(kv->v, kv_row(kv, c0) * kvd + (size_t)kvh * hd);
        *ld = kvd;
    } else {
        for (int p = c0, n_run; p < c0 + w; p += n_run) {
            n_run = kv_run(kv, p, c0 + w);
            const size_t r0 = kv_row(kv, p);
            for (int t2 = 0; t2 < n_run; t2++) {
                memcpy(GK + (size_t)(p - c0 + t2) * hd, kv_f32(kv->k, (r0 + t2) * kvd + (size_t)kvh * hd),
                       sizeof(float) * (size_t)hd);
                memcpy(GV + (size_t)(p - c0 + t2) * hd, kv_f32(kv->v, (r0 + t2) * kvd + (size_t)kvh * hd),
                       sizeof(float) * (size_t)hd);
            }
        }
        *K = GK, *V = GV, *ld = hd;
    }
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

/* The max half of a reduced-precision block's online-softmax step (online_softmax's contract) over the
 * allowed scores s[0, lim), 1 <= lim: *m_new = the running max m with theirs, and the factor the row's
 * output so far is rescaled by (exp(m - *m_new); 0 for the first chunk, m = -inf). */
#if CB_AVX512
static float block_max_step(const float *s, int lim, float m, float *m_new) {
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    int k = 0;
    for (; k + 16 <= lim; k += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + k));
    if (k < lim) {
        const __mmask16 mk = (__mmask16)((1u << (lim - k)) - 1u);
        vmx = _mm512_mask_max_ps(vmx, mk, vmx, _mm512_maskz_loadu_ps(mk, s + k));
    }
    const float mx = _mm512_reduce_max_ps(vmx);
    *m_new = mx > m ? mx : m;
    float alpha = 0.0f;
    if (m != -INFINITY) {
        float d = m - *m_new;
        cb_cpu_exp(&d, &alpha, 1);
    }
    return alpha;
}
#endif

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
static void attn_pack_amx_task(void *arg, int t, int thread) {
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

static void attn_block_amx_task(void *arg, int t, int thread) {
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
static void attn_pack_i16_task(void *arg, int t, int thread) {
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

static void attn_block_i16_task(void *arg, int t, int thread) {
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

cb_attn_math_t cb_cpu_attn_math(cb_attn_math_t asked) {
    switch (asked) {
    case CB_ATTN_BF16: return attn_bf16_ok() ? CB_ATTN_BF16 : CB_ATTN_F32;
    case CB_ATTN_I16: return attn_i16_ok() ? CB_ATTN_I16 : CB_ATTN_F32;
    case CB_ATTN_AUTO: return attn_bf16_ok() ? CB_ATTN_BF16 : attn_i16_ok() ? CB_ATTN_I16 : CB_ATTN_F32;
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

#if CB_AVX512
/* r[i] = sum of the 16 lanes of v[i], for i in 0..15 (a transpose-and-add tree: 45 ops for 16 sums). */
static inline __m512 hsum16x16(const __m512 v[16]) {
    __m512 w[8], u[4], z[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if CB_AVX2
/* r[i] = sum of the 8 lanes of v[i], for i in 0..7. */
static inline __m256 hsum8x8(const __m256 v[8]) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
/* q · key as 8 lane partial sums (q in qv [nd], key kr [8 * nd]): two chains, alternating. */
static inline __m256 key_lanes8(const __m256 *qv, int nd, const float *kr) {
    __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr)), a1 = _mm256_setzero_ps();
    for (int d = 1; d + 1 < nd; d += 2) {
        a1 = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(kr + 8 * d), a1);
        a0 = _mm256_fmadd_ps(qv[d + 1], _mm256_loadu_ps(kr + 8 * d + 8), a0);
    }
    if (nd % 2 == 0) a1 = _mm256_fmadd_ps(qv[nd - 1], _mm256_loadu_ps(kr + 8 * (nd - 1)), a1);
    return _mm256_add_ps(a0, a1);
}
#endif

/* s[j] = scale * q · K[j] for j < cnt (K rows kvd apart; hd a multiple of 16 on the AVX-512 path). */
static void scores_row(const float *q, const float *K, int kvd, int cnt, int hd, float scale, float *s) {
    int j = 0;
#if CB_AVX512
    if (hd % 16 == 0 && hd <= 256) {
        __m512 qv[16], v[16];
        const int nd = hd / 16;
        for (int d = 0; d < nd; d++) qv[d] = _mm512_loadu_ps(q + 16 * d);
        const __m512 vs = _mm512_set1_ps(scale);
        for (; j < cnt; j += 16) {
            int nk = cnt - j < 16 ? cnt - j : 16;
            for (int k = 0; k < 16; k++) {
                __m512 acc = _mm512_setzero_ps();
                if (k < nk) {
                    const float *kr = K + (size_t)(j + k) * kvd;
                    for (int d = 0; d < nd; d++) acc = _mm512_fmadd_ps(qv[d], _mm512_loadu_ps(kr + 16 * d), acc);
                }
                v[k] = acc;
            }
            _mm512_mask_storeu_ps(s + j, (__mmask16)((1u << nk) - 1u), _mm512_mul_ps(hsum16x16(v), vs));
        }
        return;
    }
#elif CB_AVX2
    if (hd % 8 == 0 && hd <= 128) {
        __m256 qv[16], v[8];
        const int nd = hd / 8;
        for (int d = 0; d < nd; d++) qv[d] = _mm256_loadu_ps(q + 8 * d);
        const __m256 vs = _mm256_set1_ps(scale);
        for (; j + 8 <= cnt; j += 8) {
            for (int k = 0; k < 8; k++) v[k] = key_lanes8(qv, nd, K + (size_t)(j + k) * kvd);
            _mm256_storeu_ps(s + j, _mm256_mul_ps(hsum8x8(v), vs));
        }
        for (; j < cnt; j++) { /* the same sums, one key at a time */
            float a[8];
            _mm256_storeu_ps(a, key_lanes8(qv, nd, K + (size_t)j * kvd));
            s[j] = (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))) * scale; /* hsum8x8's order */
        }
        return;
    }
#endif
    for (; j < cnt; j++) s[j] = dot_f32(q, K + (size_t)j * kvd, hd) * scale;
}

/* o[0:hd) += sum_j p[j] V[j] for j < cnt, in j order (o starts at zero: the same sums whether the keys
 * come in one run or several). */
static void pv_row(const float *p, const float *V, int kvd, int cnt, int hd, float *o) {
    int d0 = 0;
#if CB_AVX512
    for (; d0 + 64 <= hd; d0 += 64) {
        __m512 a0 = _mm512_loadu_ps(o + d0), a1 = _mm512_loadu_ps(o + d0 + 16), a2 = _mm512_loadu_ps(o + d0 + 32),
               a3 = _mm512_loadu_ps(o + d0 + 48);
        for (int j = 0; j < cnt; j++) {
            const float *vr = V + (size_t)j * kvd + d0;
            __m512 pj = _mm512_set1_ps(p[j]);
            a0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr), a0);
            a1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16), a1);
            a2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 32), a2);
            a3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 48), a3);
        }
        _mm512_storeu_ps(o + d0, a0);
        _mm512_storeu_ps(o + d0 + 16, a1);
        _mm512_storeu_ps(o + d0 + 32, a2);
        _mm512_storeu_ps(o + d0 + 48, a3);
    }
#elif CB_AVX2
    for (; d0 + 32 <= hd; d0 += 32) {
        __m256 a0 = _mm256_loadu_ps(o + d0), a1 = _mm256_loadu_ps(o + d0 + 8), a2 = _mm256_loadu_ps(o + d0 + 16),
               a3 = _mm256_loadu_ps(o + d0 + 24);
        for (int j = 0; j < cnt; j++) {
            const float *vr = V + (size_t)j * kvd + d0;
            __m256 pj = _mm256_set1_ps(p[j]);
            a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr), a0);
            a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8), a1);
            a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 16), a2);
            a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 24), a3);
        }
        _mm256_storeu_ps(o + d0, a0);
        _mm256_storeu_ps(o + d0 + 8, a1);
        _mm256_storeu_ps(o + d0 + 16, a2);
        _mm256_storeu_ps(o + d0 + 24, a3);
    }
#endif
    for (int d = d0; d < hd; d++) {
        float a = o[d];
        for (int j = 0; j < cnt; j++) a += p[j] * V[(size_t)j * kvd + d];
        o[d] = a;
    }
}

/* attn_split_task on an f16 pool, for row i, KV head kvh, keys [c0, c1) (chunk c): the chunk's K, then its
 * V, converted ATT_F16_PIECE keys (of one run) at a time and read by every query head of the group from L1.
 * Per head the arithmetic is the f32 kernel's: scores per key, the online softmax over the chunk, P·V in key
 * order. s: the thread's region (scores [G][c1 - c0] at its start, the converted piece at cvt_offset). */
static void attn_split_f16(const attn_job_t *j, int i, int kvh, int c, int c0, int c1, float *s) {
    const cb_attn_geom_t *g = j->g;
    const int H = g->n_head, hd = g->head_dim, G = H / g->n_head_kv, qd = H * hd, kvd = g->n_head_kv * hd;
    const int cnt = c1 - c0;
    const cb_cpu_kv_t *kv = j->kv;
    float *cv = s + j->cvt_offset; /* [ATT_F16_PIECE][hd] */
    float *part[ATT_MAX_G];
    for (int hh = 0; hh < G; hh++) {
        part[hh] = j->scratch + (((size_t)i * H + kvh * G + hh) * j->n_chunks + c) * (size_t)(hd + 2);
        part[hh][0] = -INFINITY;
        part[hh][1] = 0.0f;
    }
    if (cnt <= 0) return;
    for (int p = c0, w; p < c1; p += w) {
        w = kv_run(kv, p, p + ATT_F16_PIECE < c1 ? p + ATT_F16_PIECE : c1);
        cvt_rows_f16(kv_f16(kv->k, kv_row(kv, p) * kvd + (size_t)kvh * hd), (size_t)kvd, w, hd, cv, (size_t)hd);
        for (int hh = 0; hh < G; hh++)
            scores_row(j->q + (size_t)i * qd + (size_t)(kvh * G + hh) * hd, cv, hd, w, hd, g->scale,
                       s + (size_t)hh * cnt + (p - c0));
    }
    for (int hh = 0; hh < G; hh++) {
        online_softmax(s + (size_t)hh * cnt, cnt, cnt, &part[hh][0], &part[hh][1]);
        memset(part[hh] + 2, 0, sizeof(float) * (size_t)hd);
    }
    for (int p = c0, w; p < c1; p += w) {
        w = kv_run(kv, p, p + ATT_F16_PIECE < c1 ? p + ATT_F16_PIECE : c1);
        cvt_rows_f16(kv_f16(kv->v, kv_row(kv, p) * kvd + (size_t)kvh * hd), (size_t)kvd, w, hd, cv, (size_t)hd);
        for (int hh = 0; hh < G; hh++) pv_row(s + (size_t)hh * cnt + (p - c0), cv, hd, w, hd, part[hh] + 2);
    }
}

/* Split-key attention for a few rows (decode): task = (row, KV head, chunk of keys). Each task leaves,
 * per query head of the group, the chunk's max m, sum l and unnormalised output o; attn_split_merge
 * combines the chunks (flash-decoding). K and V of a chunk are read once per query head from L2. */
static void attn_split_task(void *arg, int t, int thread) {
    const attn_job_t *j = arg;
    const cb_attn_geom_t *g = j->g;
    const int H = g->n_head, HKV = g->n_head_kv, hd = g->head_dim, G = H / HKV, qd = H * hd, kvd = HKV * hd;
    const int c = t % j->n_chunks, kvh = (t / j->n_chunks) % HKV, i = t / j->n_chunks / HKV;
    const int lim = j->key_limit[i], c0 = cb_attn_key_lo(g, lim) + c * j->chunk;
    const int c1 = c0 + j->chunk < lim ? c0 + j->chunk : lim;
    float *s = j->scratch + j->partial_floats + (size_t)thread * j->per_thread;
    if (j->kv->dtype == CB_KV_F16) {
        attn_split_f16(j, i, kvh, c, c0, c1, s);
        return;
    }
    for (int hh = 0; hh < G; hh++) {
        const int h = kvh * G + hh;
        float *part = j->scratch + (((size_t)i * H + h) * j->n_chunks + c) * (size_t)(hd + 2);
        if (c0 >= c1) {
            part[0] = -INFINITY;
            part[1] = 0.0f;
            continue;
        }
        const cb_cpu_kv_t *kv = j->kv;
        for (int p = c0, w; p < c1; p += w) {
            w = kv_run(kv, p, c1);
            scores_row(j->q + (size_t)i * qd + (size_t)h * hd, kv_f32(kv->k, kv_row(kv, p) * kvd + (size_t)kvh * hd),
                       kvd, w, hd, g->scale, s + (p - c0));
        }
        float m = -INFINITY, l = 0.0f;
        online_softmax(s, c1 - c0, c1 - c0, &m, &l);
        memset(part + 2, 0, sizeof(float) * (size_t)hd);
        for (int p = c0, w; p < c1; p += w) {
            w = kv_run(kv, p, c1);
            pv_row(s + (p - c0), kv_f32(kv->v, kv_row(kv, p) * kvd + (size_t)kvh * hd), kvd, w, hd, part + 2);
        }
        part[0] = m;
        part[1] = l;
    }
}

/* One head of one row from its chunks' partials (part + c * stride for chunk c: m, l, o[hd]): o [hd]. */
static void split_merge_head(const float *part, size_t stride, int n_chunks, int hd, float *o) {
    float M = -INFINITY, L = 0.0f;
    for (int c = 0; c < n_chunks; c++) M = part[c * stride] > M ? part[c * stride] : M;
    memset(o, 0, sizeof(float) * (size_t)hd);
    for (int c = 0; c < n_chunks; c++) {
        const float *pc = part + (size_t)c * stride;
        if (pc[0] == -INFINITY) continue;
        float d = pc[0] - M, a;
        cb_cpu_exp(&d, &a, 1);
        L += a * pc[1];
        for (int k = 0; k < hd; k++) o[k] += a * pc[2 + k];
    }
    scale_row(o, hd, 1.0f / L);
}

static void attn_split_merge(const attn_job_t *j) {
    const int H = j->g->n_head, hd = j->g->head_dim, qd = H * hd;
    for (int i = 0; i < j->n; i++)
        for (int h = 0; h < H; h++)
            split_merge_head(j->scratch + ((size_t)i * H + h) * j->n_chunks * (size_t)(hd + 2), (size_t)(hd + 2),
                             j->n_chunks, hd, j->out + (size_t)i * qd + (size_t)h * hd);
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

/* Decode rows of different sequences (cb_cpu_attention_rows): task = (row, chunk of its keys), for every head,
 * the chunking a one-row call gives the row. The chunk's K rows, then its V rows, are read front to back in
 * pieces of ATT_ROWS_PIECE keys that every head uses from L1 (the split kernel's (row, KV head, chunk) tasks
 * read a third of each row per pass, at about half the memory bandwidth). Per head the arithmetic is the
 * split kernel's: scores (the same bits in any grouping of keys), the online softmax over the whole chunk,
 * P·V in key order, and the same merge. */
typedef struct {
    const cb_attn_geom_t *g;
    const float *q;           /* [n][n_head*head_dim] */
    const cb_cpu_kv_t *pool;  /* the layer's pool (its blocks unused) */
    const cb_kv_table_t *t;   /* [n] */
    const int32_t *key_limit; /* [n] */
    int bt, nr;               /* block tokens; rows of this run */
    int chunk[ATT_ROWS_MAX];  /* keys per task of each row */
    int task0[ATT_ROWS_MAX + 1]; /* first task of each row; task0[nr] = tasks */
    float *partial;           /* [tasks][n_head][2 + head_dim] */
    float *scratch;           /* per thread: [n_head][chunk] scores; an f16 piece's f32 copy at cvt_offset */
    size_t per_thread, cvt_offset;
} attn_rows_job_t;

static inline void prefetch_bytes(const char *p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
}

static void attn_rows_task(void *arg, int t, int thread) {
    const attn_rows_job_t *j = arg;
    const cb_attn_geom_t *g = j->g;
    const int H = g->n_head, hd = g->head_dim, G = H / g->n_head_kv, kvd = g->n_head_kv * hd;
    int i = 0;
    while (t >= j->task0[i + 1]) i++;
    const int cs = j->chunk[i], lim = j->key_limit[i], c0 = cb_attn_key_lo(g, lim) + (t - j->task0[i]) * cs;
    const int c1 = c0 + cs < lim ? c0 + cs : lim;
    const cb_cpu_kv_t kv = {j->pool->k, j->pool->v, j->t[i].blocks, j->bt, j->pool->dtype};
    const bool f16 = kv.dtype == CB_KV_F16;
    const size_t esz = f16 ? sizeof(uint16_t) : sizeof(float);
    const float *q = j->q + (size_t)i * H * hd;
    float *s = j->scratch + (size_t)thread * j->per_thread, *part = j->partial + (size_t)t * H * (hd + 2);
    float *cv = s + j->cvt_offset; /* f16: [ATT_ROWS_PIECE][kvd] */
    /* each head's pass over a piece prefetches its share of the piece ATT_ROWS_AHEAD keys on */
    const size_t slice = ((size_t)ATT_ROWS_PIECE * kvd * esz / (size_t)H + 63) / 64 * 64;
    for (int p = c0, w; p < c1; p += w) { /* runs of consecutive pool rows, in pieces */
        w = kv_run(&kv, p, p + ATT_ROWS_PIECE < c1 ? p + ATT_ROWS_PIECE : c1);
        const float *K = f16 ? cv : kv_f32(kv.k, kv_row(&kv, p) * kvd);
        if (f16) cb_cpu_kv_to_f32(CB_KV_F16, kv_f16(kv.k, kv_row(&kv, p) * kvd), cv, (size_t)w * kvd);
        const char *next =
            p + ATT_ROWS_AHEAD < c1 ? (const char *)kv.k + kv_row(&kv, p + ATT_ROWS_AHEAD) * kvd * esz : NULL;
        for (int h = 0; h < H; h++) {
            if (next) prefetch_bytes(next + (size_t)h * slice, slice);
            scores_row(q + (size_t)h * hd, K + (size_t)(h / G) * hd, kvd, w, hd, g->scale, s + (size_t)h * cs + (p - c0));
        }
    }
    for (int h = 0; h < H; h++) {
        float *ph = part + (size_t)h * (hd + 2);
        ph[0] = -INFINITY, ph[1] = 0.0f;
        online_softmax(s + (size_t)h * cs, c1 - c0, c1 - c0, &ph[0], &ph[1]);
        memset(ph + 2, 0, sizeof(float) * (size_t)hd);
    }
    for (int p = c0, w; p < c1; p += w) {
        w = kv_run(&kv, p, p + ATT_ROWS_PIECE < c1 ? p + ATT_ROWS_PIECE : c1);
        const float *V = f16 ? cv : kv_f32(kv.v, kv_row(&kv, p) * kvd);
        if (f16) cb_cpu_kv_to_f32(CB_KV_F16, kv_f16(kv.v, kv_row(&kv, p) * kvd), cv, (size_t)w * kvd);
        const char *next =
            p + ATT_ROWS_AHEAD < c1 ? (const char *)kv.v + kv_row(&kv, p + ATT_ROWS_AHEAD) * kvd * esz : NULL;
        for (int h = 0; h < H; h++) {
            if (next) prefetch_bytes(next + (size_t)h * slice, slice);
            pv_row(s + (size_t)h * cs + (p - c0), V + (size_t)(h / G) * hd, kvd, w, hd, part + (size_t)h * (hd + 2) + 2);
        }
    }
}

void cb_cpu_attention_rows(const cb_attn_geom_t *g, const float *q, int n, const cb_cpu_kv_t *kvp,
                           const cb_kv_table_t *t, const int32_t *key_limit, float *out, float *scratch, int max_keys,
                           cb_pool_t *pool) {
    const int H = g->n_head, hd = g->head_dim, qd = H * hd, nt = cb_pool_size(pool);
    if (H / g->n_head_kv > ATT_MAX_G) { /* the one-row path, row by row */
        for (int i = 0; i < n; i++) {
            const cb_cpu_kv_t kv = {kvp->k, kvp->v, t[i].blocks, kvp->block_tokens, kvp->dtype};
            cb_cpu_attention(g, q + (size_t)i * qd, 1, &kv, &key_limit[i], out + (size_t)i * qd, scratch, max_keys, pool);
        }
        return;
    }
    attn_rows_job_t j = {.g = g, .pool = kvp, .bt = kvp->block_tokens, .partial = scratch,
                         .scratch = scratch + att_partial_floats(g, max_keys), .per_thread = att_thread_floats(g, max_keys),
                         .cvt_offset = att_cvt_offset(g, max_keys)};
    const int slots = ATT_ROWS_MAX * ((max_keys + ATT_SPLIT_MIN - 1) / ATT_SPLIT_MIN); /* tasks the partials hold */
    for (int i0 = 0; i0 < n; i0 += j.nr) {
        j.q = q + (size_t)i0 * qd, j.t = t + i0, j.key_limit = key_limit + i0;
        j.nr = 0;
        j.task0[0] = 0;
        while (j.nr < ATT_ROWS_MAX && i0 + j.nr < n) {
            const int lim = key_limit[i0 + j.nr], span = lim - cb_attn_key_lo(g, lim);
            assert(lim >= 1 && lim <= max_keys);
            const int cs = split_chunk(span, 1, g->n_head_kv, nt), tasks = (span + cs - 1) / cs;
            if (j.task0[j.nr] + tasks > slots) break;
            j.chunk[j.nr] = cs;
            j.task0[j.nr + 1] = j.task0[j.nr] + tasks;
            j.nr++;
        }
        cb_pool_run(pool, j.task0[j.nr], attn_rows_task, &j);
        for (int i = 0; i < j.nr; i++)
            for (int h = 0; h < H; h++)
                split_merge_head(j.partial + ((size_t)j.task0[i] * H + h) * (hd + 2), (size_t)H * (hd + 2),
                                 j.task0[i + 1] - j.task0[i], hd, out + (size_t)(i0 + i) * qd + (size_t)h * hd);
    }
}

/* ---------------------------------------------------------------- host-side CacheBlend operations */

int cb_cpu_kv_deviation(int n, int width, const float *fresh, const void *const *cached, cb_kv_dtype_t dtype,
                        double *dev, float *row) {
    if (!cb_kv_dtype_size(dtype) && !(dtype == CB_KV_Q8_0 && width % 32 == 0)) return -1;
    for (int i = 0; i < n; i++) {
        cb_cpu_kv_to_f32(dtype, cached[i], row, (size_t)width);
        const float *a = fresh + (size_t)i * width;
        double s = 0.0;
        for (int j = 0; j < width; j++) {
            double d = (double)a[j] - (double)row[j];
            s += d * d;
        }
        dev[i] = s;
    }
    return 0;
}

/* Descending score (NaN first), then ascending index: a strict total order, so one answer. */
static int cmp_score(const void *pa, const void *pb, void *arg) {
    const double *sc = arg;
    int ia = *(const int32_t *)pa, ib = *(const int32_t *)pb;
    double da = sc[ia], db = sc[ib];
    bool na = isnan(da), nb = isnan(db);
    if (na != nb) return na ? -1 : 1;
    if (!na && da != db) return da > db ? -1 : 1;
    return ia < ib ? -1 : ia > ib;
}

void cb_cpu_topk(int n, const double *score, int k, int32_t *out, int32_t *idx) {
    if (k > n) k = n;
    if (k <= 0) return;
    for (int i = 0; i < n; i++) idx[i] = i;
    qsort_r(idx, (size_t)n, sizeof(int32_t), cmp_score, (void *)score);
    memcpy(out, idx, sizeof(int32_t) * (size_t)k);
}

void cb_cpu_compact_rows(float *x, size_t row_len, const int32_t *keep, int n_keep) {
    for (int i = 0; i < n_keep; i++)
        if (keep[i] != i) memmove(x + (size_t)i * row_len, x + (size_t)keep[i] * row_len, sizeof(float) * row_len);
}
