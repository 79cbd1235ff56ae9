/* cb_cuda_ops.cu: element-wise and row kernels of cb_cuda.h — dequantization (GGUF blocks -> bf16/f32),
 * synthetic weights, embedding, RMSNorm, RoPE (adjacent pairs), SwiGLU, GeGLU, scaling, residual add, row
 * gather/scatter,
 * the bandwidth-bound GEMV of decode, the blend's KV deviation and top-k selection, argmax and top-p
 * sampling. All launches go to the compute stream; every launch is checked. */
#include <math.h>

#include "cuda/cb_cuda_impl.h"

#define CB_FULL 0xffffffffu

/* ------------------------------------------------------------------ dequantization */

__device__ __forceinline__ float cb_h2f(const uint8_t *p) {   /* little-endian binary16 at p (2-aligned) */
    return __half2float(__ushort_as_half(*(const uint16_t *)p));
}

template <typename T> __device__ __forceinline__ void cb_store(T *dst, size_t i, float v);
template <> __device__ __forceinline__ void cb_store<float>(float *dst, size_t i, float v) { dst[i] = v; }
template <> __device__ __forceinline__ void cb_store<uint16_t>(uint16_t *dst, size_t i, float v) { dst[i] = cb_f2bf(v); }

template <typename T>
__global__ void k_dequant_scalar(uint32_t type, const uint8_t *src, size_t n, T *dst) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v;
        if (type == 0) v = ((const float *)src)[i];
        else if (type == 1) v = cb_h2f(src + 2 * i);
        else v = cb_bf2f(((const uint16_t *)src)[i]);   /* BF16 */
        cb_store<T>(dst, i, v);
    }
}

/* One thread per 32-element block (Q4_0, Q4_1, Q5_0, Q8_0): format/quant.h; nibble j / j+16 order. */
template <typename T>
__global__ void k_dequant_q32(uint32_t type, const uint8_t *src, size_t n_blocks, T *dst) {
    for (size_t b = blockIdx.x * (size_t)blockDim.x + threadIdx.x; b < n_blocks; b += (size_t)gridDim.x * blockDim.x) {
        T *y = dst + b * 32;
        if (type == 2) {            /* Q4_0: d, qs[16]; (nibble - 8) * d */
            const uint8_t *p = src + b * 18;
            float d = cb_h2f(p);
            const uint8_t *qs = p + 2;
            for (int j = 0; j < 16; j++) {
                cb_store<T>(y, j, (float)((int)(qs[j] & 0xF) - 8) * d);
                cb_store<T>(y, j + 16, (float)((int)(qs[j] >> 4) - 8) * d);
            }
        } else if (type == 3) {     /* Q4_1: d, m, qs[16]; nibble * d + m */
            const uint8_t *p = src + b * 20;
            float d = cb_h2f(p), m = cb_h2f(p + 2);
            const uint8_t *qs = p + 4;
            for (int j = 0; j < 16; j++) {
                cb_store<T>(y, j, __fadd_rn(__fmul_rn((float)(qs[j] & 0xF), d), m));
                cb_store<T>(y, j + 16, __fadd_rn(__fmul_rn((float)(qs[j] >> 4), d), m));
            }
        } else if (type == 6) {     /* Q5_0: d, qh[4] (bit j of the LE u32: 5th bit of element j), qs[16];
                                       ((nibble | hbit << 4) - 16) * d */
            const uint8_t *p = src + b * 22;
            float d = cb_h2f(p);
            const uint32_t qh =
                (uint32_t)p[2] | ((uint32_t)p[3] << 8) | ((uint32_t)p[4] << 16) | ((uint32_t)p[5] << 24);
            const uint8_t *qs = p + 6;
            for (int j = 0; j < 16; j++) {
                const int x0 = (int)((qs[j] & 0xF) | (((qh >> j) & 1u) << 4)) - 16;
                const int x1 = (int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
                cb_store<T>(y, j, (float)x0 * d);
                cb_store<T>(y, j + 16, (float)x1 * d);
            }
        } else {                    /* Q8_0: d, qs[32] int8 */
            const uint8_t *p = src + b * 34;
            float d = cb_h2f(p);
            const int8_t *qs = (const int8_t *)(p + 2);
            for (int j = 0; j < 32; j++) cb_store<T>(y, j, (float)qs[j] * d);
        }
    }
}

/* One thread per 256-element super-block (Q4_K, Q5_K, Q6_K). */
template <typename T>
__global__ void k_dequant_k(uint32_t type, const uint8_t *src, size_t n_blocks, T *dst) {
    for (size_t b = blockIdx.x * (size_t)blockDim.x + threadIdx.x; b < n_blocks; b += (size_t)gridDim.x * blockDim.x) {
        T *y = dst + b * 256;
        if (type == 12 || type == 13) { /* Q4_K: d, dmin, scales[12], qs[128]; Q5_K: qh[32] before qs */
            const bool q5 = type == 13;
            const uint8_t *p = src + b * (q5 ? 176 : 144);
            float d = cb_h2f(p), dmin = cb_h2f(p + 2);
            const uint8_t *sc = p + 4, *qh = p + 16, *qs = p + (q5 ? 48 : 16);
            for (int c = 0; c < 4; c++) {
                float dd[2], mm[2];
                for (int h = 0; h < 2; h++) {
                    int j = 2 * c + h, s, m;
                    if (j < 4) { s = sc[j] & 63; m = sc[j + 4] & 63; }
                    else { s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4); m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4); }
                    dd[h] = d * (float)s;
                    mm[h] = dmin * (float)m;
                }
                for (int l = 0; l < 32; l++) {
                    uint8_t q = qs[c * 32 + l];
                    int h0 = q5 ? ((qh[l] >> (2 * c)) & 1) << 4 : 0, h1 = q5 ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
                    cb_store<T>(y, c * 64 + l, dd[0] * (float)((q & 0xF) | h0) - mm[0]);
                    cb_store<T>(y, c * 64 + 32 + l, dd[1] * (float)((q >> 4) | h1) - mm[1]);
                }
            }
        } else {                    /* Q6_K: ql[128], qh[64], scales[16] int8, d */
            const uint8_t *p = src + b * 210;
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *sc = (const int8_t *)(p + 192);
            float d = cb_h2f(p + 208);
            for (int half = 0; half < 2; half++) {
                for (int l = 0; l < 32; l++) {
                    int is = l / 16;
                    int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    cb_store<T>(y, l, d * (float)sc[is + 0] * (float)q1);
                    cb_store<T>(y, l + 32, d * (float)sc[is + 2] * (float)q2);
                    cb_store<T>(y, l + 64, d * (float)sc[is + 4] * (float)q3);
                    cb_store<T>(y, l + 96, d * (float)sc[is + 6] * (float)q4);
                }
                y += 128;
                ql += 64;
                qh += 32;
                sc += 8;
            }
        }
    }
}

template <typename T>
static int cb_dequant_t(cb_cuda_t *self, uint32_t type, const void *src, size_t n, T *dst) {
    const uint8_t *s = (const uint8_t *)src;
    switch (type) {
    case 0: case 1: case 30:
        k_dequant_scalar<T><<<cb_blocks(n, 256) > 65535 ? 65535 : cb_blocks(n, 256), 256, 0, self->stream>>>(type, s, n, dst);
        break;
    case 2: case 3: case 6: case 8:   /* Q4_0, Q4_1, Q5_0, Q8_0 */
        if (n % 32) return cb_cuda_inval_(self, "dequant: n %% 32 != 0");
        k_dequant_q32<T><<<cb_blocks(n / 32, 128) > 65535 ? 65535 : cb_blocks(n / 32, 128), 128, 0, self->stream>>>(
            type, s, n / 32, dst);
        break;
    case 12: case 13: case 14:        /* Q4_K, Q5_K, Q6_K */
        if (n % 256) return cb_cuda_inval_(self, "dequant: n %% 256 != 0");
        k_dequant_k<T><<<cb_blocks(n / 256, 64) > 65535 ? 65535 : cb_blocks(n / 256, 64), 64, 0, self->stream>>>(
            type, s, n / 256, dst);
        break;
    default:
        return cb_cuda_inval_(self, "dequant: unsupported ggml type %u", type);
    }
    CB_LAUNCHED(self, "dequant kernel");
    return CB_CUDA_OK;
}

extern "C" int cb_cuda_dequant(cb_cuda_t *self, uint32_t gguf_type, const void *dev_src, size_t n, void *dev_dst,
                               cb_cuda_dtype_t dst_dtype) {
    if (!n) return CB_CUDA_OK;
    if (dst_dtype == CB_CUDA_F32) return cb_dequant_t<float>(self, gguf_type, dev_src, n, (float *)dev_dst);
    return cb_dequant_t<uint16_t>(self, gguf_type, dev_src, n, (uint16_t *)dev_dst);
}

__global__ void k_convert(const void *src, int src_f32, void *dst, int dst_f32, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = src_f32 ? ((const float *)src)[i] : cb_bf2f(((const uint16_t *)src)[i]);
        if (dst_f32) ((float *)dst)[i] = v;
        else ((uint16_t *)dst)[i] = cb_f2bf(v);
    }
}

extern "C" int cb_cuda_convert(cb_cuda_t *self, const void *src, cb_cuda_dtype_t src_dtype, void *dst,
                               cb_cuda_dtype_t dst_dtype, size_t n) {
    if (!n) return CB_CUDA_OK;
    unsigned g = cb_blocks(n, 256);
    k_convert<<<g > 65535 ? 65535 : g, 256, 0, self->stream>>>(src, src_dtype == CB_CUDA_F32, dst,
                                                                dst_dtype == CB_CUDA_F32, n);
    CB_LAUNCHED(self, "convert kernel");
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ synthetic weights */

__global__ void k_synth_fill(uint16_t *dst, size_t n, uint64_t seed, uint32_t tid, uint64_t first, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = cb_synth_mix(seed, tid, first + i);
        int32_t v = (int32_t)(z >> 40) - 8388608;          /* [-2^23, 2^23), exact in f32 */
        float u = __fmul_rn((float)v, 1.0f / 8388608.0f);  /* exact */
        dst[i] = cb_f2bf(__fmul_rn(scale, u));
    }
}

extern "C" int cb_cuda_synth_fill(cb_cuda_t *self, cb_bf16_t *dev_dst, size_t n, uint64_t seed, uint32_t tensor_id,
                                  uint64_t first, float scale) {
    if (!n) return CB_CUDA_OK;
    unsigned g = cb_blocks(n, 256);
    k_synth_fill<<<g > 65535 ? 65535 : g, 256, 0, self->stream>>>(dev_dst, n, seed, tensor_id, first, scale);
    CB_LAUNCHED(self, "synth_fill kernel");
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ embedding, norm, rope, swiglu, add */

__global__ void k_embed(const int32_t *tokens, const uint16_t *table, int vocab, int dim, float *out) {
    int i = blockIdx.x;
    int t = tokens[i];
    float *o = out + (size_t)i * dim;
    if (t < 0 || t >= vocab) {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = 0.0f;
        return;
    }
    const uint16_t *e = table + (size_t)t * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = cb_bf2f(e[j]);
}

extern "C" int cb_cuda_embed(cb_cuda_t *self, const int32_t *dev_tokens, int n, const cb_bf16_t *table, int vocab,
                             int dim, float *out) {
    if (n < 0 || vocab <= 0 || dim <= 0) return cb_cuda_inval_(self, "embed: n=%d vocab=%d dim=%d", n, vocab, dim);
    if (!n) return CB_CUDA_OK;
    k_embed<<<n, 256, 0, self->stream>>>(dev_tokens, table, vocab, dim, out);
    CB_LAUNCHED(self, "embed kernel");
    return CB_CUDA_OK;
}

/* One block per row: sum of squares in f32 (fixed reduction order), then scale and round to bf16. */
__global__ void k_rmsnorm(int dim, const float *x, int ldx, const int32_t *rows, const float *w, float eps,
                          uint16_t *out, int ldo) {
    __shared__ float s_part[32];
    int i = blockIdx.x;
    const float *xr = x + (size_t)(rows ? rows[i] : i) * ldx;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) ss += xr[j] * xr[j];
    ss = cb_warp_sum(ss);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) s_part[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float v = lane < (int)(blockDim.x >> 5) ? s_part[lane] : 0.0f;
        v = cb_warp_sum(v);
        if (lane == 0) s_part[0] = v;
    }
    __syncthreads();
    float r = rsqrtf(s_part[0] / (float)dim + eps);
    uint16_t *o = out + (size_t)i * ldo;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = cb_f2bf(xr[j] * r * w[j]);
}

extern "C" int cb_cuda_rmsnorm(cb_cuda_t *self, int n, int dim, const float *x, int ldx, const int32_t *rows,
                               const float *w, float eps, cb_bf16_t *out, int ldo) {
    if (n < 0 || dim <= 0 || ldx < dim || ldo < dim) return cb_cuda_inval_(self, "rmsnorm: n=%d dim=%d", n, dim);
    if (!n) return CB_CUDA_OK;
    k_rmsnorm<<<n, 256, 0, self->stream>>>(dim, x, ldx, rows, w, eps, out, ldo);
    CB_LAUNCHED(self, "rmsnorm kernel");
    return CB_CUDA_OK;
}

/* One block per row: the row's cos/sin table (head_dim/2 pairs) is built once in shared memory with the
 * angle reduced modulo 2*pi in double, then applied to every head. The angle of pair j is p * inv_j with
 * inv_j = base^(-2j/head_dim) * freq_scale / ff[j], each factor applied in double; freq_scale 1 and no
 * factors multiply by 1 exactly, so plain NORM RoPE keeps the bits it had before scaling existed. */
__global__ void k_rope(int n_heads, int head_dim, const uint16_t *in, int ld_in, uint16_t *out, int ld_out,
                       const int32_t *pos, int pos0, float base, float freq_scale, const float *ff, int neox) {
    extern __shared__ float s_cs[];   /* [head_dim/2][2]: cos, sin */
    int i = blockIdx.x;
    int half = head_dim / 2;
    double p = pos ? (double)pos[i] : (double)pos0 + (double)i;
    const double two_pi = 6.283185307179586476925286766559;
    const double lb = log2((double)base);
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        double inv = exp2(-2.0 * (double)j / (double)head_dim * lb);
        inv *= (double)freq_scale;
        if (ff) inv /= (double)ff[j];
        double a = p * inv;
        a -= rint(a / two_pi) * two_pi;
        float s, c;
        sincosf((float)a, &s, &c);
        s_cs[2 * j] = c;
        s_cs[2 * j + 1] = s;
    }
    __syncthreads();
    int n_pairs = n_heads * half;
    if (!neox) {
        const uint32_t *src = (const uint32_t *)(in + (size_t)i * ld_in);   /* pairs as 32-bit words */
        uint32_t *dst = (uint32_t *)(out + (size_t)i * ld_out);
        for (int q = threadIdx.x; q < n_pairs; q += blockDim.x) {
            int j = q % half;
            uint32_t wv = src[q];
            float x0 = __uint_as_float(wv << 16), x1 = __uint_as_float(wv & 0xffff0000u);
            float c = s_cs[2 * j], s = s_cs[2 * j + 1];
            float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
            dst[q] = (uint32_t)cb_f2bf(y0) | ((uint32_t)cb_f2bf(y1) << 16);
        }
        return;
    }
    /* NEOX: pair j of head h is (x[h*head_dim + j], x[h*head_dim + j + half]); each thread reads both
     * halves of its pairs before writing them, so in place is safe */
    const uint16_t *src = in + (size_t)i * ld_in;
    uint16_t *dst = out + (size_t)i * ld_out;
    for (int q = threadIdx.x; q < n_pairs; q += blockDim.x) {
        int h = q / half, j = q % half;
        size_t e0 = (size_t)h * head_dim + j, e1 = e0 + half;
        float x0 = cb_bf2f(src[e0]), x1 = cb_bf2f(src[e1]);
        float c = s_cs[2 * j], s = s_cs[2 * j + 1];
        float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
        dst[e0] = cb_f2bf(y0);
        dst[e1] = cb_f2bf(y1);
    }
}

extern "C" int cb_cuda_rope(cb_cuda_t *self, int n, int n_heads, int head_dim, const cb_bf16_t *in, int ld_in,
                            cb_bf16_t *out, int ld_out, const int32_t *pos, int pos0, const cb_cuda_rope_t *r) {
    if (n < 0 || n_heads <= 0 || head_dim <= 0 || head_dim % 2 || ld_in < n_heads * head_dim ||
        ld_out < n_heads * head_dim || ld_in % 2 || ld_out % 2 || ((uintptr_t)in & 3) || ((uintptr_t)out & 3))
        return cb_cuda_inval_(self, "rope: n=%d heads=%d head_dim=%d ld %d/%d (even strides, 4-byte aligned rows)", n,
                              n_heads, head_dim, ld_in, ld_out);
    if (!r || (r->mode != CB_CUDA_ROPE_NORM && r->mode != CB_CUDA_ROPE_NEOX) || !(r->base > 0.0f) ||
        !(r->freq_scale > 0.0f) || isinf(r->base) || isinf(r->freq_scale))
        return cb_cuda_inval_(self, "rope: bad rotation (mode %d, base %g, freq_scale %g)", r ? (int)r->mode : -1,
                              r ? (double)r->base : 0.0, r ? (double)r->freq_scale : 0.0);
    if (!n) return CB_CUDA_OK;
    k_rope<<<n, 128, (size_t)head_dim * sizeof(float), self->stream>>>(
        n_heads, head_dim, in, ld_in, out, ld_out, pos, pos0, r->base, r->freq_scale, r->freq_factors,
        r->mode == CB_CUDA_ROPE_NEOX);
    CB_LAUNCHED(self, "rope kernel");
    return CB_CUDA_OK;
}

__global__ void k_swiglu(int ffn, const uint16_t *gate, const uint16_t *up, int ld_in, uint16_t *out, int ldo) {
    int i = blockIdx.y;
    const uint16_t *g = gate + (size_t)i * ld_in, *u = up + (size_t)i * ld_in;
    uint16_t *o = out + (size_t)i * ldo;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < ffn; j += gridDim.x * blockDim.x) {
        float gv = cb_bf2f(g[j]), uv = cb_bf2f(u[j]);
        o[j] = cb_f2bf(gv / (1.0f + expf(-gv)) * uv);
    }
}

extern "C" int cb_cuda_swiglu(cb_cuda_t *self, int n, int ffn, const cb_bf16_t *gate, const cb_bf16_t *up, int ld_in,
                              cb_bf16_t *out, int ldo) {
    if (n < 0 || ffn <= 0 || ldo < ffn || n > 65535 * 1024) return cb_cuda_inval_(self, "swiglu: n=%d ffn=%d", n, ffn);
    if (!n) return CB_CUDA_OK;
    /* blockIdx.y indexes rows (max 65535): split large n into several launches. */
    for (int r0 = 0; r0 < n; r0 += 65535) {
        int rows = n - r0 < 65535 ? n - r0 : 65535;
        dim3 grid(cb_blocks(ffn, 256) > 64 ? 64 : cb_blocks(ffn, 256), rows);
        k_swiglu<<<grid, 256, 0, self->stream>>>(ffn, gate + (size_t)r0 * ld_in, up + (size_t)r0 * ld_in, ld_in,
                                                 out + (size_t)r0 * ldo, ldo);
        CB_LAUNCHED(self, "swiglu kernel");
    }
    return CB_CUDA_OK;
}

/* GELU, tanh form (gemma3's gelu_pytorch_tanh), in f32. */
__device__ __forceinline__ float cb_gelu_tanh(float g) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

__global__ void k_geglu(int ffn, const uint16_t *gate, const uint16_t *up, int ld_in, uint16_t *out, int ldo) {
    int i = blockIdx.y;
    const uint16_t *g = gate + (size_t)i * ld_in, *u = up + (size_t)i * ld_in;
    uint16_t *o = out + (size_t)i * ldo;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < ffn; j += gridDim.x * blockDim.x)
        o[j] = cb_f2bf(cb_gelu_tanh(cb_bf2f(g[j])) * cb_bf2f(u[j]));
}

extern "C" int cb_cuda_geglu(cb_cuda_t *self, int n, int ffn, const cb_bf16_t *gate, const cb_bf16_t *up, int ld_in,
                             cb_bf16_t *out, int ldo) {
    if (n < 0 || ffn <= 0 || ldo < ffn || n > 65535 * 1024) return cb_cuda_inval_(self, "geglu: n=%d ffn=%d", n, ffn);
    for (int r0 = 0; r0 < n; r0 += 65535) {   /* blockIdx.y indexes rows (max 65535) */
        int rows = n - r0 < 65535 ? n - r0 : 65535;
        dim3 grid(cb_blocks(ffn, 256) > 64 ? 64 : cb_blocks(ffn, 256), rows);
        k_geglu<<<grid, 256, 0, self->stream>>>(ffn, gate + (size_t)r0 * ld_in, up + (size_t)r0 * ld_in, ld_in,
                                                out + (size_t)r0 * ldo, ldo);
        CB_LAUNCHED(self, "geglu kernel");
    }
    return CB_CUDA_OK;
}

__global__ void k_scale(float *x, size_t n, float a) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = __fmul_rn(x[i], a);
}

extern "C" int cb_cuda_scale(cb_cuda_t *self, float *x, size_t n, float a) {
    if (!n) return CB_CUDA_OK;
    unsigned g = cb_blocks(n, 256);
    k_scale<<<g > 65535 ? 65535 : g, 256, 0, self->stream>>>(x, n, a);
    CB_LAUNCHED(self, "scale kernel");
    return CB_CUDA_OK;
}

__global__ void k_add(int dim, float *h, int ldh, const void *y, int y_f32, int ldy) {
    int i = blockIdx.y;
    float *hr = h + (size_t)i * ldh;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < dim; j += gridDim.x * blockDim.x) {
        float v = y_f32 ? ((const float *)y)[(size_t)i * ldy + j] : cb_bf2f(((const uint16_t *)y)[(size_t)i * ldy + j]);
        hr[j] += v;
    }
}

extern "C" int cb_cuda_add(cb_cuda_t *self, int n, int dim, float *h, int ldh, const void *y, cb_cuda_dtype_t y_dtype,
                           int ldy) {
    if (n < 0 || dim <= 0 || ldh < dim || (ldy < dim && ldy != 0))   /* ldy 0: one row broadcast (a bias) */
        return cb_cuda_inval_(self, "add: n=%d dim=%d ldh=%d ldy=%d", n, dim, ldh, ldy);
    for (int r0 = 0; r0 < n; r0 += 65535) {
        int rows = n - r0 < 65535 ? n - r0 : 65535;
        size_t esz = y_dtype == CB_CUDA_F32 ? 4 : 2;
        dim3 grid(cb_blocks(dim, 256) > 64 ? 64 : cb_blocks(dim, 256), rows);
        k_add<<<grid, 256, 0, self->stream>>>(dim, h + (size_t)r0 * ldh, ldh,
                                              (const char *)y + (size_t)r0 * ldy * esz, y_dtype == CB_CUDA_F32, ldy);
        CB_LAUNCHED(self, "add kernel");
    }
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ row copies (gather/scatter) */

template <typename V>
__global__ void k_copy_rows(size_t row_words, char *dst, size_t dst_pitch, const int32_t *dst_rows, const char *src,
                            size_t src_pitch, const int32_t *src_rows) {
    int i = blockIdx.x;
    const V *s = (const V *)(src + (size_t)(src_rows ? src_rows[i] : i) * src_pitch);
    V *d = (V *)(dst + (size_t)(dst_rows ? dst_rows[i] : i) * dst_pitch);
    for (size_t j = threadIdx.x; j < row_words; j += blockDim.x) d[j] = s[j];
}

extern "C" int cb_cuda_copy_rows(cb_cuda_t *self, int n, size_t row_bytes, void *dst, size_t dst_pitch,
                                 const int32_t *dst_rows, const void *src, size_t src_pitch, const int32_t *src_rows) {
    if (n < 0 || (n && (row_bytes > dst_pitch || row_bytes > src_pitch)))
        return cb_cuda_inval_(self, "copy_rows: n=%d row_bytes=%zu pitches %zu/%zu", n, row_bytes, dst_pitch, src_pitch);
    if (!n || !row_bytes) return CB_CUDA_OK;
    uintptr_t a = (uintptr_t)dst | (uintptr_t)src | dst_pitch | src_pitch | row_bytes;
    {
        const int rows = n;   /* one block per row (grid.x allows 2^31 - 1) */
        if (a % 16 == 0)
            k_copy_rows<uint4><<<rows, 128, 0, self->stream>>>(row_bytes / 16, (char *)dst, dst_pitch, dst_rows,
                                                               (const char *)src, src_pitch, src_rows);
        else if (a % 4 == 0)
            k_copy_rows<uint32_t><<<rows, 128, 0, self->stream>>>(row_bytes / 4, (char *)dst, dst_pitch, dst_rows,
                                                                   (const char *)src, src_pitch, src_rows);
        else if (a % 2 == 0)
            k_copy_rows<uint16_t><<<rows, 128, 0, self->stream>>>(row_bytes / 2, (char *)dst, dst_pitch, dst_rows,
                                                                   (const char *)src, src_pitch, src_rows);
        else
            k_copy_rows<uint8_t><<<rows, 128, 0, self->stream>>>(row_bytes, (char *)dst, dst_pitch, dst_rows,
                                                                  (const char *)src, src_pitch, src_rows);
        CB_LAUNCHED(self, "copy_rows kernel");
    }
    return CB_CUDA_OK;
}

__global__ void k_i32_add(int32_t *p, int n, int32_t delta) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] += delta;
}
__global__ void k_i32_iota(int32_t *p, int n, int32_t v0) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v0 + i;
}

extern "C" int cb_cuda_i32_add(cb_cuda_t *self, int32_t *dev, int n, int32_t delta) {
    if (n <= 0) return CB_CUDA_OK;
    k_i32_add<<<cb_blocks(n, 256), 256, 0, self->stream>>>(dev, n, delta);
    CB_LAUNCHED(self, "i32_add kernel");
    return CB_CUDA_OK;
}

extern "C" int cb_cuda_i32_iota(cb_cuda_t *self, int32_t *dev, int n, int32_t v0) {
    if (n <= 0) return CB_CUDA_OK;
    k_i32_iota<<<cb_blocks(n, 256), 256, 0, self->stream>>>(dev, n, v0);
    CB_LAUNCHED(self, "i32_iota kernel");
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ GEMV (decode, n == 1) */

/* y[r] = sum_j w[r][j] * x[j] (+ beta*y[r]); one warp per row, 16-byte loads, f32 accumulation. */
template <bool VEC>
__global__ void __launch_bounds__(256) k_gemv(int m, int k, const uint16_t *__restrict__ x,
                                              const uint16_t *__restrict__ w, int ldw, void *y, int y_f32, float beta) {
    int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= m) return;
    const uint16_t *wr = w + (size_t)row * ldw;
    float acc = 0.0f;
    if (VEC) {
        const uint4 *w4 = (const uint4 *)wr, *x4 = (const uint4 *)x;
        int k8 = k / 8;
#pragma unroll 4
        for (int c = lane; c < k8; c += 32) {
            uint4 a = __ldg(w4 + c), b = __ldg(x4 + c);
            const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int t = 0; t < 4; t++) {
                acc += __uint_as_float(av[t] << 16) * __uint_as_float(bv[t] << 16);
                acc += __uint_as_float(av[t] & 0xffff0000u) * __uint_as_float(bv[t] & 0xffff0000u);
            }
        }
    } else {
        for (int j = lane; j < k; j += 32) acc += cb_bf2f(wr[j]) * cb_bf2f(x[j]);
    }
    acc = cb_warp_sum(acc);
    if (lane == 0) {
        if (y_f32) {
            float *yf = (float *)y;
            yf[row] = beta != 0.0f ? acc + beta * yf[row] : acc;
        } else {
            ((uint16_t *)y)[row] = cb_f2bf(acc);
        }
    }
}

int cb_cuda_gemv_(cb_cuda_t *self, int m, int k, const cb_bf16_t *x, const cb_bf16_t *w, int ldw, void *y,
                  cb_cuda_dtype_t y_dtype, float beta) {
    bool vec = k % 8 == 0 && ldw % 8 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)w & 15) == 0;
    if (vec)
        k_gemv<true><<<cb_blocks(m, 8), 256, 0, self->stream>>>(m, k, x, w, ldw, y, y_dtype == CB_CUDA_F32, beta);
    else
        k_gemv<false><<<cb_blocks(m, 8), 256, 0, self->stream>>>(m, k, x, w, ldw, y, y_dtype == CB_CUDA_F32, beta);
    CB_LAUNCHED(self, "gemv kernel");
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ KV deviation */

/* One warp per row; each lane sums a fixed stride of columns, then a fixed butterfly: deterministic. */
__global__ void k_kv_dev(int n, int width, const uint16_t *a, int lda, const uint16_t *b, int ldb,
                         const int32_t *b_rows, float *dev) {
    int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= n) return;
    const uint16_t *ar = a + (size_t)row * lda, *br = b + (size_t)(b_rows ? b_rows[row] : row) * ldb;
    float acc = 0.0f;
    for (int j = lane; j < width; j += 32) {
        float d = cb_bf2f(ar[j]) - cb_bf2f(br[j]);
        acc += d * d;
    }
    acc = cb_warp_sum(acc);
    if (lane == 0) dev[row] = acc;
}

extern "C" int cb_cuda_kv_deviation(cb_cuda_t *self, int n, int width, const cb_bf16_t *a, int lda,
                                    const cb_bf16_t *b, int ldb, const int32_t *b_rows, float *dev) {
    if (n < 0 || width <= 0 || lda < width || ldb < width)
        return cb_cuda_inval_(self, "kv_deviation: n=%d width=%d", n, width);
    if (!n) return CB_CUDA_OK;
    k_kv_dev<<<cb_blocks(n, 8), 256, 0, self->stream>>>(n, width, a, lda, b, ldb, b_rows, dev);
    CB_LAUNCHED(self, "kv_deviation kernel");
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ top-k selection */

/* Monotonic map f32 -> u32 (larger float, larger key); NaN -> 0, below -inf. */
__device__ __forceinline__ uint32_t cb_fkey(float x) {
    if (isnan(x)) return 0u;
    uint32_t b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* Exclusive block scan of a 0/1 flag (blockDim.x a multiple of 32, <= 1024); s_buf[32] = total. */
__device__ __forceinline__ int cb_scan01(int flag, int *s_buf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    unsigned b = __ballot_sync(CB_FULL, flag);
    int before = __popc(b & ((1u << lane) - 1u));
    __syncthreads();
    if (lane == 0) s_buf[warp] = __popc(b);
    __syncthreads();
    if (warp == 0) {
        int v = lane < nw ? s_buf[lane] : 0, inc = v;
        for (int o = 1; o < 32; o <<= 1) {
            int t = __shfl_up_sync(CB_FULL, inc, o);
            if (lane >= o) inc += t;
        }
        if (lane < nw) s_buf[lane] = inc - v;
        if (lane == 31) s_buf[32] = inc;
    }
    __syncthreads();
    return s_buf[warp] + before;
}

#define CB_TOPK_THREADS 1024

__global__ void __launch_bounds__(CB_TOPK_THREADS) k_topk(int n, const float *score, const uint8_t *mask, int k,
                                                          int32_t *out_rows, int32_t *out_count) {
    __shared__ unsigned s_hist[256];
    __shared__ int s_buf[33];
    __shared__ uint32_t s_prefix;
    __shared__ int s_kk, s_ncand;
    const int tid = threadIdx.x;
    /* candidates */
    int cnt = 0;
    for (int i = tid; i < n; i += blockDim.x) cnt += (mask ? mask[i] : 0) == 0;
    for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(CB_FULL, cnt, o);
    if (tid == 0) s_ncand = 0;
    __syncthreads();
    if ((tid & 31) == 0) atomicAdd(&s_ncand, cnt);
    __syncthreads();
    const int ncand = s_ncand;
    const bool take_all = k >= ncand, take_none = k <= 0;
    uint32_t T = 0;
    int kk = 0;
    if (!take_all && !take_none) {
        /* Radix select, 8 bits at a time from the top: the k-th largest key T, and kk = how many keys
         * equal to T belong to the top k. */
        uint32_t prefix = 0, pmask = 0;
        kk = k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += blockDim.x) s_hist[b] = 0;
            __syncthreads();
            for (int i = tid; i < n; i += blockDim.x) {
                if ((mask ? mask[i] : 0) != 0) continue;
                uint32_t key = cb_fkey(score[i]);
                if ((key & pmask) == prefix) atomicAdd(&s_hist[(key >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                unsigned cum = 0;
                int b = 255;
                for (; b > 0; b--) {
                    if (cum + s_hist[b] >= (unsigned)kk) break;
                    cum += s_hist[b];
                }
                s_prefix = prefix | ((uint32_t)b << shift);
                s_kk = kk - (int)cum;
            }
            __syncthreads();
            prefix = s_prefix;
            kk = s_kk;
            pmask |= 255u << shift;
            __syncthreads();
        }
        T = prefix;
    }
    /* Compaction in index order: selected = forced, or candidate with key > T, or key == T among the
     * first kk such (by index). The output is therefore sorted ascending. */
    int run_eq = 0, run_sel = 0;
    for (int base = 0; base < n; base += blockDim.x) {
        int i = base + tid;
        int c = i < n ? (mask ? mask[i] : 0) : 2;
        uint32_t key = (c == 0 && !take_all && !take_none) ? cb_fkey(score[i]) : 0u;
        int eq = c == 0 && !take_all && !take_none && key == T;
        int rank = cb_scan01(eq, s_buf) + run_eq;
        run_eq += s_buf[32];
        int sel = c == 1 || (c == 0 && (take_all || (!take_none && (key > T || (eq && rank < kk)))));
        int pos = cb_scan01(sel, s_buf) + run_sel;
        run_sel += s_buf[32];
        if (sel) out_rows[pos] = i;
    }
    if (tid == 0 && out_count) *out_count = run_sel;
}

extern "C" int cb_cuda_topk_select(cb_cuda_t *self, int n, const float *score, const uint8_t *mask, int k,
                                   int32_t *out_rows, int32_t *out_count) {
    if (n < 0 || n > (1 << 24)) return cb_cuda_inval_(self, "topk_select: n=%d (max 2^24)", n);
    if (n == 0) {
        if (out_count) CB_CU(self, cudaMemsetAsync(out_count, 0, sizeof(int32_t), self->stream));
        return CB_CUDA_OK;
    }
    k_topk<<<1, CB_TOPK_THREADS, 0, self->stream>>>(n, score, mask, k, out_rows, out_count);
    CB_LAUNCHED(self, "topk kernel");
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ argmax and sampling */

/* (value, index) pairs: larger value wins, lower index on ties; NaN never wins (value -inf, index n). */
__device__ __forceinline__ void cb_best(float &v, int &i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

__device__ void cb_block_argmax(const float *x, int n, float *out_v, int *out_i) {
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float xv = x[j];
        if (!isnan(xv)) cb_best(v, idx, xv, j);
    }
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(CB_FULL, v, o);
        int i2 = __shfl_xor_sync(CB_FULL, idx, o);
        cb_best(v, idx, v2, i2);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { s_v[warp] = v; s_i[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        v = lane < nw ? s_v[lane] : -INFINITY;
        idx = lane < nw ? s_i[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float v2 = __shfl_xor_sync(CB_FULL, v, o);
            int i2 = __shfl_xor_sync(CB_FULL, idx, o);
            cb_best(v, idx, v2, i2);
        }
        if (lane == 0) { s_v[0] = v; s_i[0] = idx; }
    }
    __syncthreads();
    *out_v = s_v[0];
    *out_i = s_i[0] == 0x7fffffff ? 0 : s_i[0];   /* all NaN: token 0 */
    __syncthreads();
}

__global__ void k_argmax(int vocab, const float *logits, int ld, int32_t *out) {
    float v;
    int i;
    cb_block_argmax(logits + (size_t)blockIdx.x * ld, vocab, &v, &i);
    if (threadIdx.x == 0) out[blockIdx.x] = i;
}

extern "C" int cb_cuda_argmax(cb_cuda_t *self, int n, int vocab, const float *logits, int ld, int32_t *out) {
    if (n < 0 || vocab <= 0 || ld < vocab) return cb_cuda_inval_(self, "argmax: n=%d vocab=%d ld=%d", n, vocab, ld);
    if (!n) return CB_CUDA_OK;
    k_argmax<<<n, 1024, 0, self->stream>>>(vocab, logits, ld, out);
    CB_LAUNCHED(self, "argmax kernel");
    return CB_CUDA_OK;
}

/* Inclusive block scan of u64 (blockDim.x multiple of 32); s_buf[32] = block total. */
__device__ __forceinline__ unsigned long long cb_scan_u64(unsigned long long v, unsigned long long *s_buf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    unsigned long long inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        unsigned long long t = __shfl_up_sync(CB_FULL, inc, o);
        if (lane >= o) inc += t;
    }
    __syncthreads();
    if (lane == 31) s_buf[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        unsigned long long w = lane < nw ? s_buf[lane] : 0ull, wi = w;
        for (int o = 1; o < 32; o <<= 1) {
            unsigned long long t = __shfl_up_sync(CB_FULL, wi, o);
            if (lane >= o) wi += t;
        }
        if (lane < nw) s_buf[lane] = wi - w;
        if (lane == 31) s_buf[32] = wi;
    }
    __syncthreads();
    return inc + s_buf[warp];
}

/* Fixed-point weight of a token: round(exp((l - max) / T) * 2^24); 0 for NaN. */
__device__ __forceinline__ unsigned long long cb_weight(float l, float mx, float inv_t) {
    if (isnan(l)) return 0ull;
    float e = expf((l - mx) * inv_t);
    return (unsigned long long)__float2uint_rn(e * 16777216.0f);
}

__global__ void __launch_bounds__(1024) k_sample(int vocab, const float *logits, float temperature, float top_p,
                                                 uint64_t *rng_state, int32_t *out) {
    __shared__ unsigned long long s_hist[256];
    __shared__ unsigned long long s_buf[33];
    __shared__ uint32_t s_prefix;
    __shared__ unsigned long long s_rem;
    const int tid = threadIdx.x;
    float mx;
    int amax;
    cb_block_argmax(logits, vocab, &mx, &amax);
    uint64_t state = *rng_state;
    if (temperature <= 0.0f || top_p <= 0.0f || !isfinite(mx)) {
        if (tid == 0) { *out = amax; *rng_state = state + 1; }
        return;
    }
    const float inv_t = 1.0f / temperature;
    /* total mass Z */
    unsigned long long part = 0;
    for (int j = tid; j < vocab; j += blockDim.x) part += cb_weight(logits[j], mx, inv_t);
    cb_scan_u64(part, s_buf);
    const unsigned long long Z = s_buf[32];
    /* nucleus threshold: the largest key T such that the mass of keys >= T reaches top_p * Z */
    uint32_t T = 0;
    if (top_p < 1.0f) {
        unsigned long long target = (unsigned long long)ceil((double)top_p * (double)Z);
        if (target < 1) target = 1;
        uint32_t prefix = 0, pmask = 0;
        unsigned long long rem = target;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += blockDim.x) s_hist[b] = 0;
            __syncthreads();
            for (int j = tid; j < vocab; j += blockDim.x) {
                uint32_t key = cb_fkey(logits[j]);
                if ((key & pmask) != prefix) continue;
                unsigned long long wv = cb_weight(logits[j], mx, inv_t);
                if (wv) atomicAdd(&s_hist[(key >> shift) & 255u], wv);
            }
            __syncthreads();
            if (tid == 0) {
                unsigned long long cum = 0;
                int b = 255;
                for (; b > 0; b--) {
                    if (cum + s_hist[b] >= rem) break;
                    cum += s_hist[b];
                }
                s_prefix = prefix | ((uint32_t)b << shift);
                s_rem = rem - cum;
            }
            __syncthreads();
            prefix = s_prefix;
            rem = s_rem;
            pmask |= 255u << shift;
            __syncthreads();
        }
        T = prefix;
    }
    /* mass of the nucleus, then the token where the running sum (index order) passes u * M */
    part = 0;
    for (int j = tid; j < vocab; j += blockDim.x)
        if (cb_fkey(logits[j]) >= T) part += cb_weight(logits[j], mx, inv_t);
    cb_scan_u64(part, s_buf);
    const unsigned long long M = s_buf[32];
    uint64_t z = cb_synth_mix(state, 0x5A4D504Cu, 0);
    double u = (double)(z >> 11) * (1.0 / 9007199254740992.0);   /* [0, 1) */
    unsigned long long r = (unsigned long long)(u * (double)M);
    if (r >= M) r = M - 1;
    __shared__ int s_pick;
    if (tid == 0) s_pick = amax;
    unsigned long long run = 0;
    for (int base = 0; base < vocab; base += blockDim.x) {
        int j = base + tid;
        unsigned long long wv = (j < vocab && cb_fkey(logits[j]) >= T) ? cb_weight(logits[j], mx, inv_t) : 0ull;
        unsigned long long inc = cb_scan_u64(wv, s_buf) + run;
        run += s_buf[32];
        if (wv && inc - wv <= r && r < inc) s_pick = j;   /* exactly one thread over the whole loop */
    }
    __syncthreads();
    if (tid == 0) { *out = s_pick; *rng_state = state + 1; }
}

extern "C" int cb_cuda_sample(cb_cuda_t *self, int vocab, const float *logits, float temperature, float top_p,
                              uint64_t *rng_state, int32_t *out) {
    if (vocab <= 0) return cb_cuda_inval_(self, "sample: vocab=%d", vocab);
    k_sample<<<1, 1024, 0, self->stream>>>(vocab, logits, temperature, top_p, rng_state, out);
    CB_LAUNCHED(self, "sample kernel");
    return CB_CUDA_OK;
}
