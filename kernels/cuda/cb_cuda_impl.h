/* cb_cuda_impl.h: internals shared by the kernels/cuda .cu files (C++ only; not part of the API).
 * The context struct, error helpers and small device utilities. */
#ifndef CB_CUDA_IMPL_H
#define CB_CUDA_IMPL_H

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include <unordered_map>

#include "cuda/cb_cuda.h"

#define CB_STAGE_N 4                          /* pinned staging ring: slots */
#define CB_STAGE_BYTES ((size_t)8 << 20)      /* bytes per staging slot */
#define CB_WS_BYTES ((size_t)64 << 20)        /* kernel scratch (split-K partials, ...) */
#define CB_BLAS_WS_BYTES ((size_t)32 << 20)   /* cuBLAS workspace (set explicitly: graph capture) */

struct cb_cuda {
    int device;
    char name[256];
    int sm_count;
    size_t smem_optin;            /* max dynamic shared memory per block (opt-in) */
    cudaStream_t stream;          /* compute */
    cudaStream_t copy;            /* host->device loads */
    cublasHandle_t blas;
    void *blas_ws;
    void *ws;                     /* [CB_WS_BYTES] scratch for kernels (single stream: no overlap) */
    size_t ws_bytes;
    void *stage[CB_STAGE_N];      /* pinned [CB_STAGE_BYTES] each */
    cudaEvent_t stage_ev[CB_STAGE_N];
    bool stage_used[CB_STAGE_N];
    int stage_next;
    std::unordered_map<void *, size_t> *allocs;   /* live cb_cuda_malloc blocks -> bytes */
    size_t mem_cur, mem_peak;
    bool capturing;
    int flash_attr_done;          /* bit mask: flash kernels whose smem attribute is set */
    char err[512];
};

struct cb_cuda_event { cudaEvent_t ev; };

/* Records a CUDA failure in self->err and maps it to a CB_CUDA_E* code. */
int cb_cuda_fail_(cb_cuda_t *self, cudaError_t e, const char *what, const char *file, int line);
int cb_cuda_blas_fail_(cb_cuda_t *self, cublasStatus_t s, const char *what, const char *file, int line);
int cb_cuda_inval_(cb_cuda_t *self, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define CB_CU(self, call) do { cudaError_t e_ = (call); \
    if (e_ != cudaSuccess) return cb_cuda_fail_((self), e_, #call, __FILE__, __LINE__); } while (0)
#define CB_BLAS(self, call) do { cublasStatus_t s_ = (call); \
    if (s_ != CUBLAS_STATUS_SUCCESS) return cb_cuda_blas_fail_((self), s_, #call, __FILE__, __LINE__); } while (0)
/* After a kernel launch: reports launch errors (bad config) and earlier sticky faults. */
#define CB_LAUNCHED(self, name) do { cudaError_t e_ = cudaGetLastError(); \
    if (e_ != cudaSuccess) return cb_cuda_fail_((self), e_, name, __FILE__, __LINE__); } while (0)

static inline unsigned cb_blocks(size_t n, unsigned per) {
    size_t b = (n + per - 1) / per;
    return (unsigned)(b > 0x7fffffffu ? 0x7fffffffu : (b ? b : 1));
}

/* ---- device helpers ---- */
__device__ __forceinline__ float cb_bf2f(uint16_t b) { return __uint_as_float((uint32_t)b << 16); }
__device__ __forceinline__ uint16_t cb_f2bf(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
__device__ __forceinline__ float cb_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float cb_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Counter-based generator shared with libshared/synth.c (must stay bit-identical). */
__host__ __device__ __forceinline__ uint64_t cb_synth_mix(uint64_t seed, uint32_t tensor_id, uint64_t i) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + (uint64_t)tensor_id * 0xD1B54A32D192ED03ull +
                 i * 0x94D049BB133111EBull + 0x2545F4914F6CDD1Dull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Internal entry points implemented in other .cu files. */
int cb_cuda_gemv_(cb_cuda_t *self, int m, int k, const cb_bf16_t *x, const cb_bf16_t *w, int ldw, void *y,
                  cb_cuda_dtype_t y_dtype, float beta);
#endif
