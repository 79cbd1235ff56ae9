/* cpu_ops.c: the CPU kernels of cpu_ops.h outside attention: OpenBLAS setup and buffer allocation, vector
 * exp, RMSNorm, RoPE, SwiGLU / GeGLU and the other small element-wise ops, row dequantization and the
 * matrix products (quantized matvec with the integer kernels of cpu_quant.h, OpenBLAS GEMM, several outputs
 * of one x in one pool run). Attention lives in cpu_attn*.c, the host-side CacheBlend operations in
 * cpu_blend_host.c, the helpers they share in cpu_ops_internal.h.
 * Terse by design; the shapes live in cpu_ops.h.
 */
#include "cpu/cpu_ops.h"
#include "base/alloc.h"
#include "cpu/cpu_ops_internal.h"

#include <assert.h>
#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "format/gguf.h"
#include "format/quant.h"
#include "base/log.h"
#include "cpu/cpu_quant.h"

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

/* Weights whose GEMM is the integer kernel (cpu_quant.h). */
static bool use_v16_gemm(const cb_weight_t *w) { return cb_cpu_qdot_gemm(w); }

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
