/* cb_cuda_attn.cu: attention with an exact per-row causal limit and an optional sliding
 * window: row r sees keys [lo_r, L_r), L_r its clamped limit, lo_r = L_r - window when window > 0 and
 * L_r > window, else 0 (cb_row_lo; every path applies the same rule).
 *
 *  flash   FlashAttention-2 style prefill: a block owns 64 query rows of one head (4 warps x 16 rows);
 *          K/V tiles of 64 keys are double-buffered in shared memory with cp.async; S = Q K^T and
 *          O += P V run on tensor cores (mma.sync m16n8k16 bf16, f32 accumulate); online softmax in
 *          the log2 domain. Scores outside [lo_r, L_r) are masked to -inf; the block loads only the tiles
 *          between its rows' lowest first key and largest limit (keys outside that range are zero-filled,
 *          never read), and a warp skips tiles outside its own rows' range. Blocks are launched heaviest
 *          first (reverse row order) for load balance under a causal mask.
 *  splitk  decode: the row's key range [lo_r, L_r) is split into chunks from lo_r; a block handles one
 *          (row, kv head, chunk) for all query heads of the GQA group (K/V read once per group), writes a
 *          partial (max, sum, unnormalized O) to the scratch area; a second kernel merges the chunks.
 *  simple  one warp per (row, head) on CUDA cores; any head_dim <= 256; the fallback.
 *  mass    the blend's attention mass (metric 'a'): per (row, kv head) the softmax max and sum of every
 *          head of the group (one read of K), then one thread per key summing the probabilities over
 *          heads and rows in a fixed order (deterministic, no atomics).
 */
#include <limits.h>
#include <math.h>
#include <string.h>

#include "cuda/cb_cuda_impl.h"

#define CB_LOG2E 1.4426950408889634f

/* ------------------------------------------------------------------ PTX helpers */

__device__ __forceinline__ uint32_t cb_smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cb_cp_async16(void *smem, const void *gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(cb_smem_u32(smem)), "l"(gmem),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cb_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cb_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void cb_ldsm_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(cb_smem_u32(p)));
}
__device__ __forceinline__ void cb_ldsm_x4_t(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(cb_smem_u32(p)));
}
/* D[16x8] += A[16x16] * B[16x8]; fragments as in the PTX ISA (m16n8k16, .bf16): with g = lane/4,
 * t = lane%4: A regs {(g,2t..), (g+8,2t..), (g,2t+8..), (g+8,2t+8..)}, B regs {(k=2t..,n=g),
 * (k=2t+8..,n=g)}, C {(g,2t), (g,2t+1), (g+8,2t), (g+8,2t+1)}. */
__device__ __forceinline__ void cb_mma(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t cb_pack_bf2(float lo, float hi) {
    return (uint32_t)cb_f2bf(lo) | ((uint32_t)cb_f2bf(hi) << 16);
}

struct cb_attn_p {
    const uint16_t *q, *k, *v;
    uint16_t *out;
    const int32_t *limit;
    int ldq, ldkv, ldo, limit_add;
    int n_q, n_kv, n_heads, group;   /* group = n_heads / n_kv_heads */
    int window;                      /* sliding window, <= 0: none */
    float scale_log2;                /* softmax scale * log2(e) */
};

__device__ __forceinline__ int cb_row_limit(const cb_attn_p &p, int row) {
    if (row >= p.n_q) return 0;
    long long l = (long long)p.limit[row] + p.limit_add;
    return l < 0 ? 0 : (l > p.n_kv ? p.n_kv : (int)l);
}

/* The first key a row of (clamped) limit lim sees: lim - window under a window it exceeds, else 0. */
__device__ __forceinline__ int cb_row_lo(const cb_attn_p &p, int lim) {
    return p.window > 0 && lim > p.window ? lim - p.window : 0;
}

/* ------------------------------------------------------------------ flash (prefill) */

#define FA_BR 64      /* query rows per block (4 warps x 16) */
#define FA_BC 64      /* keys per tile */
#define FA_THREADS 128

template <int D> constexpr int fa_smem_bytes() { return 2 /*K,V*/ * 2 /*buffers*/ * FA_BC * (D + 8) * 2; }

template <int D>
__global__ void __launch_bounds__(FA_THREADS) k_flash(cb_attn_p p) {
    constexpr int LDS = D + 8;                  /* smem row stride (elements): +16 bytes, no bank conflicts */
    constexpr int KSTEPS = D / 16;              /* k-steps of S = Q K^T */
    constexpr int NDT = D / 8;                  /* n-tiles of O */
    extern __shared__ __align__(16) uint16_t fa_smem[];
    uint16_t *Ks = fa_smem;                     /* [2][FA_BC][LDS] */
    uint16_t *Vs = fa_smem + 2 * FA_BC * LDS;   /* [2][FA_BC][LDS] */
    __shared__ int s_lim[FA_BR], s_lo[FA_BR];
    __shared__ int s_wmax[4], s_wmin[4];   /* per warp: largest limit, lowest first key of its rows that see any */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, kvh = h / p.group;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * FA_BR;   /* heaviest (last) rows first */

    if (tid < FA_BR) {
        const int lim = cb_row_limit(p, r0 + tid);
        s_lim[tid] = lim;
        s_lo[tid] = cb_row_lo(p, lim);
    }
    __syncthreads();
    if (lane == 0) {
        int m = 0, lo = INT_MAX;   /* INT_MAX: no row of the warp sees a key */
        for (int i = 0; i < 16; i++) {
            const int lim = s_lim[warp * 16 + i];
            m = max(m, lim);
            if (lim > 0) lo = min(lo, s_lo[warp * 16 + i]);
        }
        s_wmax[warp] = m;
        s_wmin[warp] = lo;
    }
    __syncthreads();
    const int kmax = max(max(s_wmax[0], s_wmax[1]), max(s_wmax[2], s_wmax[3]));
    const int kmin = min(min(s_wmin[0], s_wmin[1]), min(s_wmin[2], s_wmin[3]));   /* < kmax when kmax > 0 */
    const int wmax = s_wmax[warp], wmin = s_wmin[warp];
    const int row_a = r0 + warp * 16 + g, row_b = row_a + 8;
    const int lim_a = s_lim[warp * 16 + g], lim_b = s_lim[warp * 16 + g + 8];
    const int lo_a = s_lo[warp * 16 + g], lo_b = s_lo[warp * 16 + g + 8];

    /* Q fragments, straight from global memory (read once). */
    uint32_t qa[KSTEPS][4];
    {
        const uint16_t *qra = p.q + (size_t)row_a * p.ldq + h * D;
        const uint16_t *qrb = p.q + (size_t)row_b * p.ldq + h * D;
        bool va = row_a < p.n_q, vb = row_b < p.n_q;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
            int c = kk * 16 + 2 * t;
            qa[kk][0] = va ? *(const uint32_t *)(qra + c) : 0u;
            qa[kk][1] = vb ? *(const uint32_t *)(qrb + c) : 0u;
            qa[kk][2] = va ? *(const uint32_t *)(qra + c + 8) : 0u;
            qa[kk][3] = vb ? *(const uint32_t *)(qrb + c + 8) : 0u;
        }
    }

    float o[NDT][4];
#pragma unroll
    for (int i = 0; i < NDT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

    /* tiles [kt0, n_tiles) hold every key a row of the block sees (none when kmax is 0) */
    const int n_tiles = (kmax + FA_BC - 1) / FA_BC, kt0 = kmax > 0 ? kmin / FA_BC : 0;
    const uint16_t *kbase = p.k + kvh * D, *vbase = p.v + kvh * D;
    auto load_tile = [&](int kt, int buf) {
        constexpr int CHUNKS = D / 8;   /* 16-byte pieces per row */
        for (int idx = tid; idx < FA_BC * CHUNKS; idx += FA_THREADS) {
            int r = idx / CHUNKS, c = idx % CHUNKS;
            int key = kt * FA_BC + r;
            bool ok = key >= kmin && key < kmax;   /* keys no row of the block sees: zeros, not read */
            size_t off = ok ? (size_t)key * p.ldkv + c * 8 : 0;
            cb_cp_async16(Ks + (buf * FA_BC + r) * LDS + c * 8, kbase + off, ok);
            cb_cp_async16(Vs + (buf * FA_BC + r) * LDS + c * 8, vbase + off, ok);
        }
        cb_cp_commit();
    };

    if (kt0 < n_tiles) load_tile(kt0, 0);
    for (int kt = kt0; kt < n_tiles; kt++) {
        const int buf = (kt - kt0) & 1;
        if (kt + 1 < n_tiles) {
            load_tile(kt + 1, buf ^ 1);
            cb_cp_wait<1>();
        } else {
            cb_cp_wait<0>();
        }
        __syncthreads();
        if (kt * FA_BC < wmax && (kt + 1) * FA_BC > wmin) {   /* the tile meets the warp's key range */
            const uint16_t *Kt = Ks + buf * FA_BC * LDS, *Vt = Vs + buf * FA_BC * LDS;
            /* S = Q K^T: 16 rows x 64 keys per warp, 8 n-tiles of 8 keys. */
            float s[8][4];
#pragma unroll
            for (int j = 0; j < 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            const int mi = lane >> 3, rr = lane & 7;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk++) {
#pragma unroll
                for (int jp = 0; jp < 4; jp++) {
                    uint32_t b0, b1, b2, b3;
                    cb_ldsm_x4(b0, b1, b2, b3, Kt + (8 * (2 * jp + (mi >> 1)) + rr) * LDS + kk * 16 + (mi & 1) * 8);
                    cb_mma(s[2 * jp], qa[kk], b0, b1);
                    cb_mma(s[2 * jp + 1], qa[kk], b2, b3);
                }
            }
            /* mask (each row's keys [lo, limit): exact causal limit and window), scale, row max. A row with no
             * key in this tile has max -inf; the exponent base below is then 0, so exp2 gives 0, never NaN. */
            float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                int key = kt * FA_BC + 8 * j + 2 * t;
                s[j][0] = key >= lo_a && key < lim_a ? s[j][0] * p.scale_log2 : -INFINITY;
                s[j][1] = key + 1 >= lo_a && key + 1 < lim_a ? s[j][1] * p.scale_log2 : -INFINITY;
                s[j][2] = key >= lo_b && key < lim_b ? s[j][2] * p.scale_log2 : -INFINITY;
                s[j][3] = key + 1 >= lo_b && key + 1 < lim_b ? s[j][3] * p.scale_log2 : -INFINITY;
                mx_a = fmaxf(mx_a, fmaxf(s[j][0], s[j][1]));
                mx_b = fmaxf(mx_b, fmaxf(s[j][2], s[j][3]));
            }
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
            const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
            const float base_a = mn_a == -INFINITY ? 0.0f : mn_a, base_b = mn_b == -INFINITY ? 0.0f : mn_b;
            const float al_a = exp2f(m_a - base_a), al_b = exp2f(m_b - base_b);
            m_a = mn_a;
            m_b = mn_b;
            float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                s[j][0] = exp2f(s[j][0] - base_a);
                s[j][1] = exp2f(s[j][1] - base_a);
                s[j][2] = exp2f(s[j][2] - base_b);
                s[j][3] = exp2f(s[j][3] - base_b);
                sum_a += s[j][0] + s[j][1];
                sum_b += s[j][2] + s[j][3];
            }
            l_a = l_a * al_a + sum_a;
            l_b = l_b * al_b + sum_b;
#pragma unroll
            for (int nd = 0; nd < NDT; nd++) {
                o[nd][0] *= al_a;
                o[nd][1] *= al_a;
                o[nd][2] *= al_b;
                o[nd][3] *= al_b;
            }
            /* O += P V: the S accumulators are re-packed as the A operand (keys 16ks..16ks+15). */
#pragma unroll
            for (int ks = 0; ks < 4; ks++) {
                uint32_t pa[4];
                pa[0] = cb_pack_bf2(s[2 * ks][0], s[2 * ks][1]);
                pa[1] = cb_pack_bf2(s[2 * ks][2], s[2 * ks][3]);
                pa[2] = cb_pack_bf2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
                pa[3] = cb_pack_bf2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
                for (int ndp = 0; ndp < NDT / 2; ndp++) {
                    uint32_t b0, b1, b2, b3;
                    cb_ldsm_x4_t(b0, b1, b2, b3, Vt + (16 * ks + (mi & 1) * 8 + rr) * LDS + 8 * (2 * ndp + (mi >> 1)));
                    cb_mma(o[2 * ndp], pa, b0, b1);
                    cb_mma(o[2 * ndp + 1], pa, b2, b3);
                }
            }
        }
        __syncthreads();   /* the next iteration overwrites the other buffer; this one is free after */
    }

    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f, inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
    if (row_a < p.n_q) {
        uint16_t *orow = p.out + (size_t)row_a * p.ldo + h * D;
#pragma unroll
        for (int nd = 0; nd < NDT; nd++)
            *(uint32_t *)(orow + nd * 8 + 2 * t) = cb_pack_bf2(o[nd][0] * inv_a, o[nd][1] * inv_a);
    }
    if (row_b < p.n_q) {
        uint16_t *orow = p.out + (size_t)row_b * p.ldo + h * D;
#pragma unroll
        for (int nd = 0; nd < NDT; nd++)
            *(uint32_t *)(orow + nd * 8 + 2 * t) = cb_pack_bf2(o[nd][2] * inv_b, o[nd][3] * inv_b);
    }
}

template <int D> static int cb_flash_launch(cb_cuda_t *self, const cb_attn_p &p) {
    const int smem = fa_smem_bytes<D>();
    const int bit = D == 64 ? 1 : 2;
    if (!(self->flash_attr_done & bit)) {
        if ((size_t)smem > self->smem_optin)
            return cb_cuda_inval_(self, "flash attention needs %d bytes of shared memory (device has %zu)", smem,
                                  self->smem_optin);
        CB_CU(self, cudaFuncSetAttribute(k_flash<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        self->flash_attr_done |= bit;
    }
    dim3 grid((p.n_q + FA_BR - 1) / FA_BR, p.n_heads);
    k_flash<D><<<grid, FA_THREADS, smem, self->stream>>>(p);
    CB_LAUNCHED(self, "flash attention kernel");
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ split-K (decode) */

#define SK_THREADS 128
#define SK_MAX_CHUNK 256
#define SK_MAX_GROUP 16

/* Partial record per (row, head, split): [m, l, o[D]] floats. */
__global__ void __launch_bounds__(SK_THREADS) k_splitk(cb_attn_p p, int D, int chunk, int n_splits, float *ws) {
    extern __shared__ float sk_smem[];
    const int G = p.group;
    float *q_s = sk_smem;                 /* [G][D] */
    float *sc = sk_smem + G * D;          /* [G][chunk] */
    const int kvh = blockIdx.x, split = blockIdx.y, row = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int lim = cb_row_limit(p, row);
    const int start = cb_row_lo(p, lim) + split * chunk, end = min(start + chunk, lim);   /* chunks from lo */
    const size_t rec = (size_t)D + 2;
    float *wrow = ws + ((size_t)row * p.n_heads + (size_t)kvh * G) * n_splits * rec;   /* head kvh*G + g */
    if (start >= end) {
        if (tid < G) {
            float *r = wrow + ((size_t)tid * n_splits + split) * rec;
            r[0] = -INFINITY;
            r[1] = 0.0f;
        }
        return;
    }
    const int n = end - start;
    for (int i = tid; i < G * D; i += SK_THREADS) {
        int gg = i / D, d = i % D;
        q_s[i] = cb_bf2f(p.q[(size_t)row * p.ldq + (size_t)(kvh * G + gg) * D + d]);
    }
    __syncthreads();
    /* scores: one thread per key, all G heads at once */
    for (int j = tid; j < n; j += SK_THREADS) {
        const uint16_t *kr = p.k + (size_t)(start + j) * p.ldkv + (size_t)kvh * D;
        float acc[SK_MAX_GROUP];
#pragma unroll
        for (int gg = 0; gg < SK_MAX_GROUP; gg++) acc[gg] = 0.0f;
        for (int d = 0; d < D; d += 2) {
            uint32_t kv2 = *(const uint32_t *)(kr + d);
            float k0 = __uint_as_float(kv2 << 16), k1 = __uint_as_float(kv2 & 0xffff0000u);
#pragma unroll
            for (int gg = 0; gg < SK_MAX_GROUP; gg++)
                if (gg < G) acc[gg] += k0 * q_s[gg * D + d] + k1 * q_s[gg * D + d + 1];
        }
#pragma unroll
        for (int gg = 0; gg < SK_MAX_GROUP; gg++)
            if (gg < G) sc[gg * chunk + j] = acc[gg] * p.scale_log2;
    }
    __syncthreads();
    /* per head: max, exp2, sum (one warp per head) */
    for (int gg = warp; gg < G; gg += SK_THREADS / 32) {
        float mx = -INFINITY;
        for (int j = lane; j < n; j += 32) mx = fmaxf(mx, sc[gg * chunk + j]);
        mx = cb_warp_max(mx);
        float sum = 0.0f;
        for (int j = lane; j < n; j += 32) {
            float e = exp2f(sc[gg * chunk + j] - mx);
            sc[gg * chunk + j] = e;
            sum += e;
        }
        sum = cb_warp_sum(sum);
        if (lane == 0) {
            float *r = wrow + ((size_t)gg * n_splits + split) * rec;
            r[0] = mx;
            r[1] = sum;
        }
    }
    __syncthreads();
    /* unnormalized O = sum_j p_j V_j; threads over (head, dim) so V reads are coalesced */
    for (int i = tid; i < G * D; i += SK_THREADS) {
        int gg = i / D, d = i % D;
        const float *pr = sc + gg * chunk;
        const uint16_t *vc = p.v + (size_t)start * p.ldkv + (size_t)kvh * D + d;
        float acc = 0.0f;
        for (int j = 0; j < n; j++) acc += pr[j] * cb_bf2f(vc[(size_t)j * p.ldkv]);
        wrow[((size_t)gg * n_splits + split) * rec + 2 + d] = acc;
    }
}

/* The vectorized variant (head_dim 64/128, GQA group <= 8, 16-byte aligned K/V rows): a key's row is
 * read by D/8 lanes with one 16-byte load each, q of the group's heads stays in registers (pre-scaled),
 * and P.V gives every thread 8 consecutive output dims of one head, the keys split over thread phases. */
#define SK2_GMAX 8
template <int D>
__global__ void __launch_bounds__(SK_THREADS) k_splitk2(cb_attn_p p, int chunk, int n_splits, float *ws) {
    constexpr int TPK = D / 8;          /* lanes per key */
    constexpr int KPW = 32 / TPK;       /* keys per warp step */
    extern __shared__ float sk_smem[];
    const int G = p.group;
    float *sc = sk_smem;                /* [G][chunk] scores, then probabilities */
    float *po = sk_smem + G * chunk;    /* [nphase][G*D] partial outputs */
    const int kvh = blockIdx.x, split = blockIdx.y, row = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int lim = cb_row_limit(p, row);
    const int start = cb_row_lo(p, lim) + split * chunk, end = min(start + chunk, lim);   /* chunks from lo */
    const size_t rec = (size_t)D + 2;
    float *wrow = ws + ((size_t)row * p.n_heads + (size_t)kvh * G) * n_splits * rec;
    if (start >= end) {
        if (tid < G) {
            float *r = wrow + ((size_t)tid * n_splits + split) * rec;
            r[0] = -INFINITY;
            r[1] = 0.0f;
        }
        return;
    }
    const int n = end - start;
    const int sub = lane / TPK, part = lane % TPK;
    float q8[SK2_GMAX][8];
#pragma unroll
    for (int g = 0; g < SK2_GMAX; g++) {
        const uint16_t *qr = p.q + (size_t)row * p.ldq + (size_t)(kvh * G + (g < G ? g : 0)) * D + part * 8;
#pragma unroll
        for (int e = 0; e < 8; e++) q8[g][e] = g < G ? cb_bf2f(qr[e]) * p.scale_log2 : 0.0f;
    }
    /* scores, log2 domain */
    for (int j0 = warp * KPW; j0 < n; j0 += (SK_THREADS / 32) * KPW) {
        const int j = j0 + sub;
        float acc[SK2_GMAX];
#pragma unroll
        for (int g = 0; g < SK2_GMAX; g++) acc[g] = 0.0f;
        if (j < n) {
            const uint4 kv = *(const uint4 *)(p.k + (size_t)(start + j) * p.ldkv + (size_t)kvh * D + part * 8);
            const uint32_t w4[4] = {kv.x, kv.y, kv.z, kv.w};
            float kf[8];
#pragma unroll
            for (int t = 0; t < 4; t++) kf[2 * t] = __uint_as_float(w4[t] << 16), kf[2 * t + 1] = __uint_as_float(w4[t] & 0xffff0000u);
#pragma unroll
            for (int g = 0; g < SK2_GMAX; g++)
#pragma unroll
                for (int e = 0; e < 8; e++) acc[g] += kf[e] * q8[g][e];
        }
#pragma unroll
        for (int g = 0; g < SK2_GMAX; g++) {
            if (g >= G) break;   /* G is uniform: every lane takes the same shuffles */
#pragma unroll
            for (int o = TPK / 2; o > 0; o >>= 1) acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], o);
        }
        if (part == 0 && j < n)
            for (int g = 0; g < G; g++) sc[g * chunk + j] = acc[g];
    }
    __syncthreads();
    for (int gg = warp; gg < G; gg += SK_THREADS / 32) {
        float mx = -INFINITY;
        for (int j = lane; j < n; j += 32) mx = fmaxf(mx, sc[gg * chunk + j]);
        mx = cb_warp_max(mx);
        float sum = 0.0f;
        for (int j = lane; j < n; j += 32) {
            float e = exp2f(sc[gg * chunk + j] - mx);
            sc[gg * chunk + j] = e;
            sum += e;
        }
        sum = cb_warp_sum(sum);
        if (lane == 0) {
            float *r = wrow + ((size_t)gg * n_splits + split) * rec;
            r[0] = mx;
            r[1] = sum;
        }
    }
    __syncthreads();
    /* unnormalized O: slot = (head g, 8 dims), phases split the keys */
    const int nslots = G * (D / 8);
    const int nphase = nslots <= SK_THREADS ? SK_THREADS / nslots : 1;
    for (int s0 = 0; s0 < nslots; s0 += SK_THREADS) {
        const int slot = nphase > 1 ? tid % nslots : s0 + tid, ph = nphase > 1 ? tid / nslots : 0;
        float o8[8];
#pragma unroll
        for (int e = 0; e < 8; e++) o8[e] = 0.0f;
        const bool active = slot < nslots && ph < nphase;
        if (active) {
            const int g = slot / (D / 8), dp = slot % (D / 8);
            const float *pr = sc + g * chunk;
            const uint16_t *vb = p.v + (size_t)start * p.ldkv + (size_t)kvh * D + dp * 8;
            for (int j = ph; j < n; j += nphase) {
                const uint4 vv = *(const uint4 *)(vb + (size_t)j * p.ldkv);
                const uint32_t w4[4] = {vv.x, vv.y, vv.z, vv.w};
                const float pj = pr[j];
#pragma unroll
                for (int t = 0; t < 4; t++) {
                    o8[2 * t] += pj * __uint_as_float(w4[t] << 16);
                    o8[2 * t + 1] += pj * __uint_as_float(w4[t] & 0xffff0000u);
                }
            }
        }
        if (nphase == 1) {
            if (active) {
                float *dst = wrow + ((size_t)(slot / (D / 8)) * n_splits + split) * rec + 2 + (slot % (D / 8)) * 8;
#pragma unroll
                for (int e = 0; e < 8; e++) dst[e] = o8[e];
            }
            continue;
        }
        if (active)
#pragma unroll
            for (int e = 0; e < 8; e++) po[((size_t)ph * nslots + slot) * 8 + e] = o8[e];
        __syncthreads();
        for (int i = tid; i < G * D; i += SK_THREADS) {   /* i = g*D + d = slot*8 + e */
            float acc = 0.0f;
            for (int q = 0; q < nphase; q++) acc += po[(size_t)q * nslots * 8 + i];
            wrow[((size_t)(i / D) * n_splits + split) * rec + 2 + (i % D)] = acc;
        }
        break;   /* nphase > 1 means nslots <= SK_THREADS: one pass */
    }
}

__global__ void k_splitk_reduce(cb_attn_p p, int D, int n_splits, const float *ws) {
    const int row = blockIdx.x / p.n_heads, h = blockIdx.x % p.n_heads;
    const size_t rec = (size_t)D + 2;
    const float *base = ws + ((size_t)row * p.n_heads + h) * n_splits * rec;
    float M = -INFINITY;
    for (int s = 0; s < n_splits; s++)
        if (base[s * rec + 1] > 0.0f) M = fmaxf(M, base[s * rec]);
    float L = 0.0f;
    for (int s = 0; s < n_splits; s++)
        if (base[s * rec + 1] > 0.0f) L += base[s * rec + 1] * exp2f(base[s * rec] - M);
    uint16_t *orow = p.out + (size_t)row * p.ldo + (size_t)h * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < n_splits; s++)
            if (base[s * rec + 1] > 0.0f) acc += base[s * rec + 2 + d] * exp2f(base[s * rec] - M);
        orow[d] = cb_f2bf(L > 0.0f ? acc / L : 0.0f);
    }
}

static int cb_splitk_plan(cb_cuda_t *self, const cb_cuda_attn_t *a, int *chunk, int *n_splits) {
    int maxlim = a->max_limit > 0 && a->max_limit < a->n_kv ? a->max_limit : a->n_kv;
    if (a->window > 0 && a->window < maxlim) maxlim = a->window;   /* a row's keys: L - lo <= min(L, window) */
    if (maxlim < 1) maxlim = 1;
    long long want = (4LL * self->sm_count + (long long)a->n_kv_heads * a->n_q - 1) / ((long long)a->n_kv_heads * a->n_q);
    if (want < 1) want = 1;
    long long c = (maxlim + want - 1) / want;
    c = (c + 31) / 32 * 32;
    if (c < 64) c = 64;
    if (c > SK_MAX_CHUNK) c = SK_MAX_CHUNK;
    long long s = (maxlim + c - 1) / c;
    size_t need = (size_t)a->n_q * a->n_heads * (size_t)s * ((size_t)a->head_dim + 2) * sizeof(float);
    if (need > self->ws_bytes) return 0;
    *chunk = (int)c;
    *n_splits = (int)s;
    return 1;
}

static int cb_splitk_launch(cb_cuda_t *self, const cb_cuda_attn_t *a, const cb_attn_p &p) {
    int chunk, n_splits;
    if (!cb_splitk_plan(self, a, &chunk, &n_splits))
        return cb_cuda_inval_(self, "split-K attention: %d rows x %d heads x %d keys do not fit the scratch area",
                              a->n_q, a->n_heads, a->n_kv);
    if (p.group > SK_MAX_GROUP) return cb_cuda_inval_(self, "split-K attention: GQA group %d > %d", p.group, SK_MAX_GROUP);
    if (a->n_q > 65535 || n_splits > 65535) return cb_cuda_inval_(self, "split-K attention: grid too large");
    dim3 grid(a->n_kv_heads, n_splits, a->n_q);
    const bool vec = (a->head_dim == 64 || a->head_dim == 128) && p.group <= SK2_GMAX && a->ldkv % 8 == 0 &&
                     ((uintptr_t)a->k & 15) == 0 && ((uintptr_t)a->v & 15) == 0;
    if (vec) {
        int nslots = p.group * (a->head_dim / 8), nphase = nslots <= SK_THREADS ? SK_THREADS / nslots : 1;
        size_t smem = ((size_t)p.group * chunk + (nphase > 1 ? (size_t)nphase * nslots * 8 : 0)) * sizeof(float);
        if (a->head_dim == 64)
            k_splitk2<64><<<grid, SK_THREADS, smem, self->stream>>>(p, chunk, n_splits, (float *)self->ws);
        else
            k_splitk2<128><<<grid, SK_THREADS, smem, self->stream>>>(p, chunk, n_splits, (float *)self->ws);
    } else {
        size_t smem = ((size_t)p.group * a->head_dim + (size_t)p.group * chunk) * sizeof(float);
        if (smem > 48 * 1024) return cb_cuda_inval_(self, "split-K attention: %zu bytes of shared memory", smem);
        k_splitk<<<grid, SK_THREADS, smem, self->stream>>>(p, a->head_dim, chunk, n_splits, (float *)self->ws);
    }
    CB_LAUNCHED(self, "split-K attention kernel");
    k_splitk_reduce<<<a->n_q * a->n_heads, a->head_dim < 128 ? 64 : 128, 0, self->stream>>>(p, a->head_dim, n_splits,
                                                                                           (const float *)self->ws);
    CB_LAUNCHED(self, "split-K reduce kernel");
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ simple (fallback) */

#define SIMPLE_MAX_D 256

__global__ void k_attn_simple(cb_attn_p p, int D) {
    const int row = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const int kvh = h / p.group;
    const int lim = cb_row_limit(p, row), lo = cb_row_lo(p, lim);
    constexpr int PER = SIMPLE_MAX_D / 32;
    float qv[PER], ov[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        int d = lane + 32 * i;
        qv[i] = d < D ? cb_bf2f(p.q[(size_t)row * p.ldq + (size_t)h * D + d]) : 0.0f;
        ov[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int j = lo; j < lim; j++) {
        const uint16_t *kr = p.k + (size_t)j * p.ldkv + (size_t)kvh * D;
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            int d = lane + 32 * i;
            if (d < D) dot += qv[i] * cb_bf2f(kr[d]);
        }
        float s = cb_warp_sum(dot) * p.scale_log2;
        float mn = fmaxf(m, s);
        float al = exp2f(m - mn), e = exp2f(s - mn);
        l = l * al + e;
        const uint16_t *vr = p.v + (size_t)j * p.ldkv + (size_t)kvh * D;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            int d = lane + 32 * i;
            if (d < D) ov[i] = ov[i] * al + e * cb_bf2f(vr[d]);
        }
        m = mn;
    }
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        int d = lane + 32 * i;
        if (d < D) p.out[(size_t)row * p.ldo + (size_t)h * D + d] = cb_f2bf(ov[i] * inv);
    }
}

/* ------------------------------------------------------------------ dispatch */

extern "C" int cb_cuda_attention(cb_cuda_t *self, const cb_cuda_attn_t *a, cb_cuda_attn_algo_t algo) {
    if (!a || a->n_q < 0 || a->n_kv < 0 || a->n_heads <= 0 || a->n_kv_heads <= 0 || a->head_dim <= 0 ||
        a->n_heads % a->n_kv_heads || a->ldq < a->n_heads * a->head_dim || a->ldo < a->n_heads * a->head_dim ||
        a->ldkv < a->n_kv_heads * a->head_dim || !a->q || !a->k || !a->v || !a->out || !a->limit)
        return cb_cuda_inval_(self, "attention: bad shapes (n_q %d, n_kv %d, heads %d/%d, head_dim %d)",
                              a ? a->n_q : 0, a ? a->n_kv : 0, a ? a->n_heads : 0, a ? a->n_kv_heads : 0,
                              a ? a->head_dim : 0);
    if (a->n_q == 0) return CB_CUDA_OK;
    if (a->n_q > 0x7fffffff / 64 || a->n_heads > 65535) return cb_cuda_inval_(self, "attention: too many rows/heads");
    cb_attn_p p;
    p.q = a->q;
    p.k = a->k;
    p.v = a->v;
    p.out = a->out;
    p.limit = a->limit;
    p.ldq = a->ldq;
    p.ldkv = a->ldkv;
    p.ldo = a->ldo;
    p.limit_add = a->limit_add;
    p.n_q = a->n_q;
    p.n_kv = a->n_kv;
    p.n_heads = a->n_heads;
    p.group = a->n_heads / a->n_kv_heads;
    p.window = a->window;
    p.scale_log2 = (a->scale > 0.0f ? a->scale : 1.0f / sqrtf((float)a->head_dim)) * CB_LOG2E;

    /* flash needs 16-byte aligned K/V rows (cp.async) and 4-byte aligned Q/O pairs */
    const bool flash_ok = (a->head_dim == 64 || a->head_dim == 128) && a->ldkv % 8 == 0 &&
                          ((uintptr_t)a->k & 15) == 0 && ((uintptr_t)a->v & 15) == 0 && a->ldq % 2 == 0 &&
                          a->ldo % 2 == 0 && ((uintptr_t)a->q & 3) == 0 && ((uintptr_t)a->out & 3) == 0;
    const bool splitk_ok = a->head_dim % 2 == 0 && a->ldkv % 2 == 0 && ((uintptr_t)a->k & 3) == 0 &&
                           p.group <= SK_MAX_GROUP && a->head_dim <= 256;
    if (algo == CB_CUDA_ATTN_AUTO) {
        int chunk, splits;
        if (flash_ok && a->n_q >= 16) algo = CB_CUDA_ATTN_FLASH;
        else if (splitk_ok && cb_splitk_plan(self, a, &chunk, &splits)) algo = CB_CUDA_ATTN_SPLITK;
        else if (flash_ok) algo = CB_CUDA_ATTN_FLASH;
        else algo = CB_CUDA_ATTN_SIMPLE;
    }
    switch (algo) {
    case CB_CUDA_ATTN_FLASH:
        if (!flash_ok) return cb_cuda_inval_(self, "flash attention needs head_dim 64/128 and aligned rows");
        return a->head_dim == 64 ? cb_flash_launch<64>(self, p) : cb_flash_launch<128>(self, p);
    case CB_CUDA_ATTN_SPLITK:
        if (!splitk_ok) return cb_cuda_inval_(self, "split-K attention needs even head_dim <= 256, group <= 16");
        return cb_splitk_launch(self, a, p);
    case CB_CUDA_ATTN_SIMPLE:
    default:
        if (a->head_dim > SIMPLE_MAX_D) return cb_cuda_inval_(self, "attention: head_dim %d > 256", a->head_dim);
        k_attn_simple<<<dim3(a->n_q, a->n_heads), 32, 0, self->stream>>>(p, a->head_dim);
        CB_LAUNCHED(self, "simple attention kernel");
        return CB_CUDA_OK;
    }
}

/* ------------------------------------------------------------------ attention mass (blend metric 'a') */

#define AM_THREADS 128
#define AM_ROWS 16        /* query rows per shared-memory tile of the per-key pass */
#define AM_MAX_D 256
#define AM_MAX_G 16

/* q (f32, shared) . k (bf16 row) in sequential order with explicit FMAs: both passes must get the very
 * same score for a (row, head, key). */
__device__ __forceinline__ float cb_am_score(const float *q, const uint16_t *k, int D, float scale_log2) {
    float acc = 0.0f;
    for (int d = 0; d < D; d += 2) {
        uint32_t w = *(const uint32_t *)(k + d);
        acc = __fmaf_rn(q[d], __uint_as_float(w << 16), acc);
        acc = __fmaf_rn(q[d + 1], __uint_as_float(w & 0xffff0000u), acc);
    }
    return __fmul_rn(acc, scale_log2);
}

/* One block per (row, kv head): every head of the group, each thread an online (max, sum) over its keys
 * (j = lo + tid, lo + tid + 128, ... below the limit), merged in thread order:
 * stats[(row * n_heads + h) * 2] = (max, sum). */
__global__ void __launch_bounds__(AM_THREADS) k_mass_stats(cb_attn_p p, int D, float *stats) {
    extern __shared__ float am_smem[];
    const int G = p.group;
    float *qs = am_smem;                          /* [G][D] */
    float *sm = am_smem + G * D;                  /* [G][AM_THREADS] per-thread max */
    float *sl = sm + G * AM_THREADS;              /* [G][AM_THREADS] per-thread sum */
    const int row = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x;
    const int lim = cb_row_limit(p, row), lo = cb_row_lo(p, lim);
    for (int i = tid; i < G * D; i += AM_THREADS) {
        int g = i / D, d = i % D;
        qs[i] = cb_bf2f(p.q[(size_t)row * p.ldq + (size_t)(kvh * G + g) * D + d]);
    }
    __syncthreads();
    float m[AM_MAX_G], l[AM_MAX_G];
#pragma unroll
    for (int g = 0; g < AM_MAX_G; g++) m[g] = -INFINITY, l[g] = 0.0f;
    const uint16_t *kb = p.k + (size_t)kvh * D;
    for (int j = lo + tid; j < lim; j += AM_THREADS) {
        const uint16_t *kr = kb + (size_t)j * p.ldkv;
#pragma unroll
        for (int g = 0; g < AM_MAX_G; g++) {
            if (g >= G) break;
            float s = cb_am_score(qs + g * D, kr, D, p.scale_log2);
            if (s > m[g]) {
                l[g] = l[g] * exp2f(m[g] - s) + 1.0f;
                m[g] = s;
            } else {
                l[g] += exp2f(s - m[g]);
            }
        }
    }
#pragma unroll
    for (int g = 0; g < AM_MAX_G; g++) {
        if (g >= G) break;
        sm[g * AM_THREADS + tid] = m[g];
        sl[g * AM_THREADS + tid] = l[g];
    }
    __syncthreads();
    if (tid < G) {
        float M = -INFINITY, L = 0.0f;
        for (int t = 0; t < AM_THREADS; t++) M = fmaxf(M, sm[tid * AM_THREADS + t]);
        for (int t = 0; t < AM_THREADS; t++) {
            float lt = sl[tid * AM_THREADS + t];
            if (lt > 0.0f) L += lt * exp2f(sm[tid * AM_THREADS + t] - M);
        }
        float *st = stats + ((size_t)row * p.n_heads + (size_t)kvh * G + tid) * 2;
        st[0] = M;
        st[1] = L;
    }
}

/* One thread per key j: mass[j] = sum over heads h, then rows r (both ascending) of exp2(s - max) / sum, over
 * the rows that see key j. */
__global__ void __launch_bounds__(AM_THREADS) k_mass_sum(cb_attn_p p, int D, int n_keys, const float *stats,
                                                         float *mass) {
    __shared__ float qs[AM_ROWS][AM_MAX_D];
    __shared__ int lims[AM_ROWS], los[AM_ROWS];
    __shared__ float st[AM_ROWS][2];
    const int tid = threadIdx.x, j = blockIdx.x * AM_THREADS + tid;
    float acc = 0.0f;
    for (int h = 0; h < p.n_heads; h++) {
        const uint16_t *kr = p.k + (size_t)(j < n_keys ? j : 0) * p.ldkv + (size_t)(h / p.group) * D;
        for (int r0 = 0; r0 < p.n_q; r0 += AM_ROWS) {
            const int nr = min(AM_ROWS, p.n_q - r0);
            __syncthreads();   /* the previous tile is no longer read */
            for (int i = tid; i < nr * D; i += AM_THREADS) {
                int rr = i / D, d = i % D;
                qs[rr][d] = cb_bf2f(p.q[(size_t)(r0 + rr) * p.ldq + (size_t)h * D + d]);
            }
            if (tid < nr) {
                const float *s2 = stats + ((size_t)(r0 + tid) * p.n_heads + h) * 2;
                lims[tid] = cb_row_limit(p, r0 + tid);
                los[tid] = cb_row_lo(p, lims[tid]);
                st[tid][0] = s2[0];
                st[tid][1] = s2[1];
            }
            __syncthreads();
            if (j < n_keys)
                for (int rr = 0; rr < nr; rr++)
                    if (j >= los[rr] && j < lims[rr] && st[rr][1] > 0.0f) {
                        float s = cb_am_score(qs[rr], kr, D, p.scale_log2);
                        acc += __fdiv_rn(exp2f(__fsub_rn(s, st[rr][0])), st[rr][1]);
                    }
        }
    }
    if (j < n_keys) mass[j] = acc;
}

extern "C" int cb_cuda_attn_mass(cb_cuda_t *self, const cb_cuda_attn_t *a, float *mass) {
    if (!a || a->n_q < 0 || a->n_kv < 0 || a->n_heads <= 0 || a->n_kv_heads <= 0 || a->head_dim <= 0 ||
        a->head_dim % 2 || a->head_dim > AM_MAX_D || a->n_heads % a->n_kv_heads ||
        a->n_heads / a->n_kv_heads > AM_MAX_G || a->ldq < a->n_heads * a->head_dim ||
        a->ldkv < a->n_kv_heads * a->head_dim || a->ldkv % 2 || !a->q || !a->k || !a->limit || !mass ||
        ((uintptr_t)a->k & 3))
        return cb_cuda_inval_(self, "attn_mass: bad shapes (n_q %d, n_kv %d, heads %d/%d, head_dim %d; even head_dim "
                              "<= %d, GQA group <= %d, 4-byte aligned K rows)", a ? a->n_q : 0, a ? a->n_kv : 0,
                              a ? a->n_heads : 0, a ? a->n_kv_heads : 0, a ? a->head_dim : 0, AM_MAX_D, AM_MAX_G);
    const int n_keys = a->max_limit > 0 && a->max_limit < a->n_kv ? a->max_limit : a->n_kv;
    if (n_keys == 0) return CB_CUDA_OK;
    if (a->n_q == 0) {
        CB_CU(self, cudaMemsetAsync(mass, 0, sizeof(float) * (size_t)n_keys, self->stream));
        return CB_CUDA_OK;
    }
    if ((size_t)a->n_q * a->n_heads * 2 * sizeof(float) > self->ws_bytes || a->n_kv_heads > 65535)
        return cb_cuda_inval_(self, "attn_mass: %d rows x %d heads exceed the scratch area", a->n_q, a->n_heads);
    cb_attn_p p;
    memset(&p, 0, sizeof p);
    p.q = a->q;
    p.k = a->k;
    p.limit = a->limit;
    p.ldq = a->ldq;
    p.ldkv = a->ldkv;
    p.limit_add = a->limit_add;
    p.n_q = a->n_q;
    p.n_kv = a->n_kv;
    p.n_heads = a->n_heads;
    p.group = a->n_heads / a->n_kv_heads;
    p.window = a->window;
    p.scale_log2 = (a->scale > 0.0f ? a->scale : 1.0f / sqrtf((float)a->head_dim)) * CB_LOG2E;
    float *stats = (float *)self->ws;
    const size_t smem = ((size_t)p.group * a->head_dim + 2 * (size_t)p.group * AM_THREADS) * sizeof(float);
    k_mass_stats<<<dim3(a->n_q, a->n_kv_heads), AM_THREADS, smem, self->stream>>>(p, a->head_dim, stats);
    CB_LAUNCHED(self, "attn_mass stats kernel");
    k_mass_sum<<<cb_blocks((size_t)n_keys, AM_THREADS), AM_THREADS, 0, self->stream>>>(p, a->head_dim, n_keys, stats,
                                                                                       mass);
    CB_LAUNCHED(self, "attn_mass sum kernel");
    return CB_CUDA_OK;
}
