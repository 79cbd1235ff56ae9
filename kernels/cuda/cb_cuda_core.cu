/* cb_cuda_core.cu: the host side of cb_cuda.h — context, device and pinned memory, copies (with a pinned
 * staging ring for pageable sources), events, graph capture, weight upload, cuBLAS GEMM, and the
 * device KV pool (LRU of chunk KV slots). Kernels live in cb_cuda_ops.cu and cb_cuda_attn.cu.
 * Every CUDA/cuBLAS call is checked; failures return CB_CUDA_E* with the error string in self->err. */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cb_cuda_impl.h"

/* ------------------------------------------------------------------ errors */

static void cb_set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void cb_set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

int cb_cuda_fail_(cb_cuda_t *self, cudaError_t e, const char *what, const char *file, int line) {
    const char *base = strrchr(file, '/');
    if (self)
        snprintf(self->err, sizeof self->err, "cuda: %s failed: %s (%s) at %s:%d", what, cudaGetErrorString(e),
                 cudaGetErrorName(e), base ? base + 1 : file, line);
    return e == cudaErrorMemoryAllocation ? CB_CUDA_EOOM : CB_CUDA_ERR;
}

int cb_cuda_blas_fail_(cb_cuda_t *self, cublasStatus_t s, const char *what, const char *file, int line) {
    const char *base = strrchr(file, '/');
    if (self)
        snprintf(self->err, sizeof self->err, "cublas: %s failed: %s (%s) at %s:%d", what, cublasGetStatusString(s),
                 cublasGetStatusName(s), base ? base + 1 : file, line);
    return s == CUBLAS_STATUS_ALLOC_FAILED ? CB_CUDA_EOOM : CB_CUDA_ERR;
}

int cb_cuda_inval_(cb_cuda_t *self, const char *fmt, ...) {
    if (self) {
        va_list ap;
        va_start(ap, fmt);
        int off = snprintf(self->err, sizeof self->err, "cuda: invalid argument: ");
        vsnprintf(self->err + off, sizeof self->err - (size_t)off, fmt, ap);
        va_end(ap);
    }
    return CB_CUDA_EINVAL;
}

extern "C" const char *cb_cuda_error(const cb_cuda_t *self) { return self ? self->err : "no cuda context"; }
extern "C" const char *cb_cuda_device_name(const cb_cuda_t *self) { return self ? self->name : ""; }
extern "C" int cb_cuda_sm_count(const cb_cuda_t *self) { return self ? self->sm_count : 0; }

/* ------------------------------------------------------------------ context */

extern "C" int cb_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();   /* clear: "no driver" is not an error for the caller */
        return 0;
    }
    return n;
}

static void *cb_track_(cb_cuda_t *self, void *p, size_t bytes) {
    (*self->allocs)[p] = bytes;
    self->mem_cur += bytes;
    if (self->mem_cur > self->mem_peak) self->mem_peak = self->mem_cur;
    return p;
}

extern "C" void *cb_cuda_malloc(cb_cuda_t *self, size_t bytes) {
    if (!self || !bytes) return NULL;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();   /* an allocation failure is not sticky: clear it */
        char what[96];
        snprintf(what, sizeof what, "cudaMalloc(%zu bytes = %.2f GiB)", bytes, (double)bytes / (1u << 30));
        cb_cuda_fail_(self, e, what, __FILE__, __LINE__);
        return NULL;
    }
    return cb_track_(self, p, bytes);
}

extern "C" void cb_cuda_free(cb_cuda_t *self, void *dev) {
    if (!self || !dev) return;
    auto it = self->allocs->find(dev);
    if (it != self->allocs->end()) {
        self->mem_cur -= it->second;
        self->allocs->erase(it);
    }
    cudaFree(dev);
}

extern "C" void *cb_cuda_host_alloc(cb_cuda_t *self, size_t bytes) {
    if (!self || !bytes) return NULL;
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        cudaGetLastError();
        char what[96];
        snprintf(what, sizeof what, "cudaHostAlloc(%zu bytes)", bytes);
        cb_cuda_fail_(self, e, what, __FILE__, __LINE__);
        return NULL;
    }
    return p;
}

extern "C" void cb_cuda_host_free(cb_cuda_t *self, void *host) {
    (void)self;
    if (host) cudaFreeHost(host);
}

extern "C" int cb_cuda_host_register(cb_cuda_t *self, void *host, size_t bytes) {
    CB_CU(self, cudaHostRegister(host, bytes, cudaHostRegisterPortable));
    return CB_CUDA_OK;
}

extern "C" int cb_cuda_host_unregister(cb_cuda_t *self, void *host) {
    CB_CU(self, cudaHostUnregister(host));
    return CB_CUDA_OK;
}

extern "C" void cb_cuda_destroy(cb_cuda_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_cuda_t *self = *self_p;
    cudaSetDevice(self->device);
    if (self->stream) cudaStreamSynchronize(self->stream);
    if (self->copy) cudaStreamSynchronize(self->copy);
    for (int i = 0; i < CB_STAGE_N; i++) {
        if (self->stage_ev[i]) cudaEventDestroy(self->stage_ev[i]);
        if (self->stage[i]) cudaFreeHost(self->stage[i]);
    }
    if (self->blas) cublasDestroy(self->blas);
    if (self->allocs) {
        for (auto &kv : *self->allocs) cudaFree(kv.first);   /* ws, blas_ws and anything the caller leaked */
        delete self->allocs;
    }
    if (self->stream) cudaStreamDestroy(self->stream);
    if (self->copy) cudaStreamDestroy(self->copy);
    cudaGetLastError();
    free(self);
    *self_p = NULL;
}

extern "C" cb_cuda_t *cb_cuda_new(int device, char *err, size_t errlen) {
    int n = cb_cuda_device_count();
    if (n <= 0) {
        cb_set_err(err, errlen, "cuda: no CUDA device (cudaGetDeviceCount found none)");
        return NULL;
    }
    if (device < 0 || device >= n) {
        cb_set_err(err, errlen, "cuda: device %d does not exist (%d found)", device, n);
        return NULL;
    }
    cb_cuda_t *self = (cb_cuda_t *)calloc(1, sizeof *self);
    if (!self) {
        cb_set_err(err, errlen, "cuda: out of host memory");
        return NULL;
    }
    self->device = device;
    self->allocs = new std::unordered_map<void *, size_t>();
    cudaDeviceProp prop;
    cudaError_t e;
#define CB_NEW_CU(call) do { e = (call); if (e != cudaSuccess) { cb_cuda_fail_(self, e, #call, __FILE__, __LINE__); goto fail; } } while (0)
    CB_NEW_CU(cudaSetDevice(device));
    CB_NEW_CU(cudaGetDeviceProperties(&prop, device));
    snprintf(self->name, sizeof self->name, "%.200s (sm_%d%d, %d SMs, %.1f GiB)", prop.name, prop.major, prop.minor,
             prop.multiProcessorCount, (double)prop.totalGlobalMem / (1u << 30));
    self->sm_count = prop.multiProcessorCount;
    self->smem_optin = prop.sharedMemPerBlockOptin;
    if (prop.major < 8) {
        snprintf(self->err, sizeof self->err, "cuda: %s has compute capability %d.%d; bf16 kernels need >= 8.0",
                 prop.name, prop.major, prop.minor);
        goto fail;
    }
    CB_NEW_CU(cudaStreamCreateWithFlags(&self->stream, cudaStreamNonBlocking));
    CB_NEW_CU(cudaStreamCreateWithFlags(&self->copy, cudaStreamNonBlocking));
    for (int i = 0; i < CB_STAGE_N; i++) {
        CB_NEW_CU(cudaHostAlloc(&self->stage[i], CB_STAGE_BYTES, cudaHostAllocPortable));
        CB_NEW_CU(cudaEventCreateWithFlags(&self->stage_ev[i], cudaEventDisableTiming));
    }
    self->ws_bytes = CB_WS_BYTES;
    if (!(self->ws = cb_cuda_malloc(self, self->ws_bytes))) goto fail;
    if (!(self->blas_ws = cb_cuda_malloc(self, CB_BLAS_WS_BYTES))) goto fail;
    {
        cublasStatus_t s = cublasCreate(&self->blas);
        if (s != CUBLAS_STATUS_SUCCESS) { cb_cuda_blas_fail_(self, s, "cublasCreate", __FILE__, __LINE__); goto fail; }
        s = cublasSetStream(self->blas, self->stream);
        if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetWorkspace(self->blas, self->blas_ws, CB_BLAS_WS_BYTES);
        if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetMathMode(self->blas, CUBLAS_DEFAULT_MATH);
        if (s != CUBLAS_STATUS_SUCCESS) { cb_cuda_blas_fail_(self, s, "cublas setup", __FILE__, __LINE__); goto fail; }
    }
#undef CB_NEW_CU
    self->mem_peak = self->mem_cur;
    self->err[0] = 0;
    return self;
fail:
    cb_set_err(err, errlen, "%s", self->err);
    cb_cuda_destroy(&self);
    return NULL;
}

extern "C" int cb_cuda_sync(cb_cuda_t *self) {
    CB_CU(self, cudaStreamSynchronize(self->copy));
    CB_CU(self, cudaStreamSynchronize(self->stream));
    CB_CU(self, cudaGetLastError());
    return CB_CUDA_OK;
}

extern "C" int cb_cuda_mem_info(cb_cuda_t *self, size_t *free_bytes, size_t *total_bytes) {
    size_t f = 0, t = 0;
    CB_CU(self, cudaMemGetInfo(&f, &t));
    if (free_bytes) *free_bytes = f;
    if (total_bytes) *total_bytes = t;
    return CB_CUDA_OK;
}

extern "C" size_t cb_cuda_mem_allocated(const cb_cuda_t *self) { return self ? self->mem_cur : 0; }
extern "C" size_t cb_cuda_mem_peak(const cb_cuda_t *self) { return self ? self->mem_peak : 0; }
extern "C" void cb_cuda_mem_reset_peak(cb_cuda_t *self) { if (self) self->mem_peak = self->mem_cur; }

/* ------------------------------------------------------------------ copies */

static cudaStream_t cb_stream_(cb_cuda_t *self, cb_cuda_stream_t s) {
    return s == CB_CUDA_STREAM_COPY ? self->copy : self->stream;
}

static bool cb_is_pinned_(const void *p) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeHost || a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

extern "C" int cb_cuda_h2d(cb_cuda_t *self, cb_cuda_stream_t stream, void *dev_dst, const void *host_src,
                           size_t bytes) {
    if (!bytes) return CB_CUDA_OK;
    if (!dev_dst || !host_src) return cb_cuda_inval_(self, "h2d: NULL pointer");
    cudaStream_t st = cb_stream_(self, stream);
    if (cb_is_pinned_(host_src)) {
        CB_CU(self, cudaMemcpyAsync(dev_dst, host_src, bytes, cudaMemcpyHostToDevice, st));
        return CB_CUDA_OK;
    }
    if (self->capturing) return cb_cuda_inval_(self, "h2d from pageable memory during graph capture");
    /* Pageable: copy through the pinned ring; wait (host) only for a ring slot's previous copy. */
    const char *src = (const char *)host_src;
    char *dst = (char *)dev_dst;
    for (size_t off = 0; off < bytes; off += CB_STAGE_BYTES) {
        size_t piece = bytes - off < CB_STAGE_BYTES ? bytes - off : CB_STAGE_BYTES;
        int s = self->stage_next;
        self->stage_next = (s + 1) % CB_STAGE_N;
        if (self->stage_used[s]) CB_CU(self, cudaEventSynchronize(self->stage_ev[s]));
        memcpy(self->stage[s], src + off, piece);
        CB_CU(self, cudaMemcpyAsync(dst + off, self->stage[s], piece, cudaMemcpyHostToDevice, st));
        CB_CU(self, cudaEventRecord(self->stage_ev[s], st));
        self->stage_used[s] = true;
    }
    return CB_CUDA_OK;
}

extern "C" int cb_cuda_d2h(cb_cuda_t *self, void *host_dst, const void *dev_src, size_t bytes) {
    if (!bytes) return CB_CUDA_OK;
    if (!host_dst || !dev_src) return cb_cuda_inval_(self, "d2h: NULL pointer");
    CB_CU(self, cudaMemcpyAsync(host_dst, dev_src, bytes, cudaMemcpyDeviceToHost, self->stream));
    CB_CU(self, cudaStreamSynchronize(self->stream));
    return CB_CUDA_OK;
}

extern "C" int cb_cuda_d2d(cb_cuda_t *self, cb_cuda_stream_t stream, void *dev_dst, const void *dev_src,
                           size_t bytes) {
    if (!bytes) return CB_CUDA_OK;
    CB_CU(self, cudaMemcpyAsync(dev_dst, dev_src, bytes, cudaMemcpyDeviceToDevice, cb_stream_(self, stream)));
    return CB_CUDA_OK;
}

extern "C" int cb_cuda_memset(cb_cuda_t *self, void *dev_dst, int byte, size_t bytes) {
    if (!bytes) return CB_CUDA_OK;
    CB_CU(self, cudaMemsetAsync(dev_dst, byte, bytes, self->stream));
    return CB_CUDA_OK;
}

extern "C" int cb_cuda_copy_2d(cb_cuda_t *self, cb_cuda_stream_t stream, void *dst, size_t dst_pitch,
                               const void *src, size_t src_pitch, size_t row_bytes, size_t rows) {
    if (!rows || !row_bytes) return CB_CUDA_OK;
    if (row_bytes > dst_pitch || row_bytes > src_pitch) return cb_cuda_inval_(self, "copy_2d: row wider than pitch");
    CB_CU(self, cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, cudaMemcpyDefault,
                                  cb_stream_(self, stream)));
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ events, graphs */

extern "C" cb_cuda_event_t *cb_cuda_event_new(cb_cuda_t *self, bool timing) {
    cb_cuda_event_t *ev = (cb_cuda_event_t *)calloc(1, sizeof *ev);
    if (!ev) return NULL;
    cudaError_t e = cudaEventCreateWithFlags(&ev->ev, timing ? cudaEventDefault : cudaEventDisableTiming);
    if (e != cudaSuccess) {
        cb_cuda_fail_(self, e, "cudaEventCreate", __FILE__, __LINE__);
        free(ev);
        return NULL;
    }
    return ev;
}

extern "C" void cb_cuda_event_destroy(cb_cuda_t *self, cb_cuda_event_t **ev_p) {
    (void)self;
    if (!ev_p || !*ev_p) return;
    cudaEventDestroy((*ev_p)->ev);
    free(*ev_p);
    *ev_p = NULL;
}

extern "C" int cb_cuda_event_record(cb_cuda_t *self, cb_cuda_event_t *ev, cb_cuda_stream_t stream) {
    CB_CU(self, cudaEventRecord(ev->ev, cb_stream_(self, stream)));
    return CB_CUDA_OK;
}

extern "C" int cb_cuda_stream_wait(cb_cuda_t *self, cb_cuda_stream_t stream, cb_cuda_event_t *ev) {
    CB_CU(self, cudaStreamWaitEvent(cb_stream_(self, stream), ev->ev, 0));
    return CB_CUDA_OK;
}

extern "C" int cb_cuda_event_sync(cb_cuda_t *self, cb_cuda_event_t *ev) {
    CB_CU(self, cudaEventSynchronize(ev->ev));
    return CB_CUDA_OK;
}

extern "C" int cb_cuda_event_elapsed(cb_cuda_t *self, cb_cuda_event_t *start, cb_cuda_event_t *end, float *ms) {
    CB_CU(self, cudaEventElapsedTime(ms, start->ev, end->ev));
    return CB_CUDA_OK;
}

struct cb_cuda_graph { cudaGraph_t graph; cudaGraphExec_t exec; };

extern "C" int cb_cuda_graph_begin(cb_cuda_t *self) {
    if (self->capturing) return cb_cuda_inval_(self, "graph capture already running");
    CB_CU(self, cudaStreamBeginCapture(self->stream, cudaStreamCaptureModeThreadLocal));
    self->capturing = true;
    return CB_CUDA_OK;
}

extern "C" cb_cuda_graph_t *cb_cuda_graph_end(cb_cuda_t *self) {
    if (!self->capturing) {
        cb_cuda_inval_(self, "graph_end without graph_begin");
        return NULL;
    }
    self->capturing = false;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(self->stream, &g);
    if (e != cudaSuccess || !g) {
        cb_cuda_fail_(self, e != cudaSuccess ? e : cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture",
                      __FILE__, __LINE__);
        cudaGetLastError();
        if (g) cudaGraphDestroy(g);
        return NULL;
    }
    cb_cuda_graph_t *out = (cb_cuda_graph_t *)calloc(1, sizeof *out);
    if (!out) {
        cudaGraphDestroy(g);
        return NULL;
    }
    out->graph = g;
    e = cudaGraphInstantiate(&out->exec, g, 0);
    if (e != cudaSuccess) {
        cb_cuda_fail_(self, e, "cudaGraphInstantiate", __FILE__, __LINE__);
        cudaGetLastError();
        cudaGraphDestroy(g);
        free(out);
        return NULL;
    }
    return out;
}

extern "C" int cb_cuda_graph_launch(cb_cuda_t *self, cb_cuda_graph_t *g) {
    CB_CU(self, cudaGraphLaunch(g->exec, self->stream));
    return CB_CUDA_OK;
}

extern "C" void cb_cuda_graph_destroy(cb_cuda_graph_t **g_p) {
    if (!g_p || !*g_p) return;
    cudaGraphExecDestroy((*g_p)->exec);
    cudaGraphDestroy((*g_p)->graph);
    free(*g_p);
    *g_p = NULL;
}

/* ------------------------------------------------------------------ weights */

/* ggml block traits for the types we dequantize (libcbcuda does not link libshared). */
static bool cb_type_traits_(uint32_t type, size_t *blk_elems, size_t *blk_bytes) {
    switch (type) {
    case 0: *blk_elems = 1; *blk_bytes = 4; return true;      /* F32 */
    case 1: *blk_elems = 1; *blk_bytes = 2; return true;      /* F16 */
    case 30: *blk_elems = 1; *blk_bytes = 2; return true;     /* BF16 */
    case 2: *blk_elems = 32; *blk_bytes = 18; return true;    /* Q4_0 */
    case 3: *blk_elems = 32; *blk_bytes = 20; return true;    /* Q4_1 */
    case 6: *blk_elems = 32; *blk_bytes = 22; return true;    /* Q5_0 */
    case 8: *blk_elems = 32; *blk_bytes = 34; return true;    /* Q8_0 */
    case 12: *blk_elems = 256; *blk_bytes = 144; return true; /* Q4_K */
    case 13: *blk_elems = 256; *blk_bytes = 176; return true; /* Q5_K */
    case 14: *blk_elems = 256; *blk_bytes = 210; return true; /* Q6_K */
    default: return false;
    }
}

extern "C" int cb_cuda_upload_weights(cb_cuda_t *self, uint32_t gguf_type, const void *host_src, size_t n,
                                      void *dev_dst, cb_cuda_dtype_t dst_dtype) {
    size_t be, bb;
    if (!cb_type_traits_(gguf_type, &be, &bb)) return cb_cuda_inval_(self, "upload: unsupported ggml type %u", gguf_type);
    if (n % be) return cb_cuda_inval_(self, "upload: %zu elements is not a multiple of the block size %zu", n, be);
    if (!n) return CB_CUDA_OK;
    /* Pieces of whole blocks through a raw device scratch (the kernel scratch area), each staged,
     * copied and dequantized in stream order. */
    size_t blocks_per_piece = (self->ws_bytes / 2) / bb;
    size_t total_blocks = n / be;
    size_t esz = dst_dtype == CB_CUDA_F32 ? 4 : 2;
    for (size_t b0 = 0; b0 < total_blocks; b0 += blocks_per_piece) {
        size_t nb = total_blocks - b0 < blocks_per_piece ? total_blocks - b0 : blocks_per_piece;
        int rc = cb_cuda_h2d(self, CB_CUDA_STREAM_COMPUTE, self->ws, (const char *)host_src + b0 * bb, nb * bb);
        if (rc) return rc;
        rc = cb_cuda_dequant(self, gguf_type, self->ws, nb * be, (char *)dev_dst + b0 * be * esz, dst_dtype);
        if (rc) return rc;
    }
    CB_CU(self, cudaStreamSynchronize(self->stream));
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ GEMM */

extern "C" int cb_cuda_gemm(cb_cuda_t *self, int n, int m, int k, const cb_bf16_t *x, int ldx, const cb_bf16_t *w,
                            int ldw, void *y, cb_cuda_dtype_t y_dtype, int ldy, float beta) {
    if (n < 0 || m <= 0 || k <= 0 || ldx < k || ldw < k || ldy < m)
        return cb_cuda_inval_(self, "gemm: n=%d m=%d k=%d ldx=%d ldw=%d ldy=%d", n, m, k, ldx, ldw, ldy);
    if (y_dtype == CB_CUDA_BF16 && beta != 0.0f) return cb_cuda_inval_(self, "gemm: beta != 0 needs an f32 output");
    if (n == 0) return CB_CUDA_OK;
    if (n == 1) return cb_cuda_gemv_(self, m, k, x, w, ldw, y, y_dtype, beta);
    const float alpha = 1.0f;
    CB_BLAS(self, cublasGemmEx(self->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, w, CUDA_R_16BF, ldw, x,
                               CUDA_R_16BF, ldx, &beta, y, y_dtype == CB_CUDA_F32 ? CUDA_R_32F : CUDA_R_16BF, ldy,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return CB_CUDA_OK;
}

/* ------------------------------------------------------------------ KV pool */

struct cb_kvslot {
    uint8_t key[32];
    bool valid;              /* holds (or is loading) the chunk named by key */
    int refs;
    int n_tokens;
    uint64_t last_use;       /* LRU tick */
    cudaEvent_t last_read;   /* recorded on the compute stream at release */
    bool has_read;
};

struct cb_cuda_kvpool {
    cb_cuda_t *cu;
    int n_layers, kv_dim, slot_tokens, n_slots;
    size_t layer_bytes;      /* one K or V plane of a slot: slot_tokens * kv_dim * 2 */
    size_t slot_bytes;
    char *mem;               /* device [n_slots][n_layers][2][slot_tokens][kv_dim] bf16 */
    cb_kvslot *slots;
    cudaEvent_t loads_ev;    /* recorded on the copy stream by wait_loads */
    bool loads_pending;
    uint64_t tick, hits, misses, evictions;
};

extern "C" cb_cuda_kvpool_t *cb_cuda_kvpool_new(cb_cuda_t *self, size_t budget_bytes, int n_layers, int kv_dim,
                                                int slot_tokens, char *err, size_t errlen) {
    if (n_layers <= 0 || kv_dim <= 0 || slot_tokens <= 0) {
        cb_set_err(err, errlen, "kvpool: bad geometry (layers %d, kv_dim %d, slot tokens %d)", n_layers, kv_dim,
                   slot_tokens);
        return NULL;
    }
    size_t layer_bytes = (size_t)slot_tokens * (size_t)kv_dim * 2;
    size_t slot_bytes = layer_bytes * 2 * (size_t)n_layers;
    size_t n_slots = budget_bytes / slot_bytes;
    if (n_slots == 0) {
        cb_set_err(err, errlen, "kvpool: budget %zu bytes holds no slot of %zu bytes", budget_bytes, slot_bytes);
        return NULL;
    }
    if (n_slots > 1000000) n_slots = 1000000;
    cb_cuda_kvpool_t *p = (cb_cuda_kvpool_t *)calloc(1, sizeof *p);
    if (!p) return NULL;
    p->cu = self;
    p->n_layers = n_layers;
    p->kv_dim = kv_dim;
    p->slot_tokens = slot_tokens;
    p->n_slots = (int)n_slots;
    p->layer_bytes = layer_bytes;
    p->slot_bytes = slot_bytes;
    p->slots = (cb_kvslot *)calloc(n_slots, sizeof *p->slots);
    p->mem = (char *)cb_cuda_malloc(self, slot_bytes * n_slots);
    if (!p->slots || !p->mem) {
        cb_set_err(err, errlen, "kvpool: %s", p->mem ? "out of host memory" : self->err);
        cb_cuda_kvpool_destroy(&p);
        return NULL;
    }
    cudaError_t e = cudaEventCreateWithFlags(&p->loads_ev, cudaEventDisableTiming);
    for (size_t i = 0; e == cudaSuccess && i < n_slots; i++)
        e = cudaEventCreateWithFlags(&p->slots[i].last_read, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        cb_cuda_fail_(self, e, "cudaEventCreate", __FILE__, __LINE__);
        cb_set_err(err, errlen, "kvpool: %s", self->err);
        cb_cuda_kvpool_destroy(&p);
        return NULL;
    }
    return p;
}

extern "C" void cb_cuda_kvpool_destroy(cb_cuda_kvpool_t **pool_p) {
    if (!pool_p || !*pool_p) return;
    cb_cuda_kvpool_t *p = *pool_p;
    cudaStreamSynchronize(p->cu->copy);
    cudaStreamSynchronize(p->cu->stream);
    if (p->slots) {
        for (int i = 0; i < p->n_slots; i++)
            if (p->slots[i].last_read) cudaEventDestroy(p->slots[i].last_read);
        free(p->slots);
    }
    if (p->loads_ev) cudaEventDestroy(p->loads_ev);
    cb_cuda_free(p->cu, p->mem);
    free(p);
    *pool_p = NULL;
}

extern "C" int cb_cuda_kvpool_slots(const cb_cuda_kvpool_t *pool) { return pool ? pool->n_slots : 0; }

extern "C" int cb_cuda_kvpool_wait_loads(cb_cuda_kvpool_t *p) {
    if (!p->loads_pending) return CB_CUDA_OK;
    CB_CU(p->cu, cudaEventRecord(p->loads_ev, p->cu->copy));
    CB_CU(p->cu, cudaStreamWaitEvent(p->cu->stream, p->loads_ev, 0));
    p->loads_pending = false;
    return CB_CUDA_OK;
}

extern "C" int cb_cuda_kvpool_acquire(cb_cuda_kvpool_t *p, const uint8_t key[32], int n_tokens, bool *hit) {
    cb_cuda_t *self = p->cu;
    if (n_tokens <= 0 || n_tokens > p->slot_tokens)
        return cb_cuda_inval_(self, "kvpool: chunk of %d tokens does not fit a slot of %d", n_tokens, p->slot_tokens);
    int free_slot = -1, lru = -1;
    for (int i = 0; i < p->n_slots; i++) {
        cb_kvslot *s = &p->slots[i];
        if (s->valid && s->n_tokens == n_tokens && memcmp(s->key, key, 32) == 0) {
            /* A hit may still be loading (enqueued by an earlier acquire): order compute after it. */
            int rc = cb_cuda_kvpool_wait_loads(p);
            if (rc) return rc;
            s->refs++;
            s->last_use = ++p->tick;
            p->hits++;
            if (hit) *hit = true;
            return i;
        }
        if (s->refs) continue;
        if (!s->valid) { if (free_slot < 0) free_slot = i; }
        else if (lru < 0 || s->last_use < p->slots[lru].last_use) lru = i;
    }
    int i = free_slot >= 0 ? free_slot : lru;
    if (i < 0) {
        snprintf(self->err, sizeof self->err, "kvpool: all %d slots are in use", p->n_slots);
        return CB_CUDA_EBUSY;
    }
    cb_kvslot *s = &p->slots[i];
    if (s->valid) p->evictions++;
    /* The copies that will overwrite this slot wait (on the device) for the last compute that read it. */
    if (s->has_read) CB_CU(self, cudaStreamWaitEvent(self->copy, s->last_read, 0));
    memcpy(s->key, key, 32);
    s->valid = true;
    s->refs = 1;
    s->n_tokens = n_tokens;
    s->last_use = ++p->tick;
    p->misses++;
    if (hit) *hit = false;
    return i;
}

extern "C" cb_bf16_t *cb_cuda_kvpool_k(cb_cuda_kvpool_t *p, int slot, int layer) {
    if (slot < 0 || slot >= p->n_slots || layer < 0 || layer >= p->n_layers) return NULL;
    return (cb_bf16_t *)(p->mem + (size_t)slot * p->slot_bytes + (size_t)layer * 2 * p->layer_bytes);
}

extern "C" cb_bf16_t *cb_cuda_kvpool_v(cb_cuda_kvpool_t *p, int slot, int layer) {
    if (slot < 0 || slot >= p->n_slots || layer < 0 || layer >= p->n_layers) return NULL;
    return (cb_bf16_t *)(p->mem + (size_t)slot * p->slot_bytes + ((size_t)layer * 2 + 1) * p->layer_bytes);
}

extern "C" int cb_cuda_kvpool_n_tokens(const cb_cuda_kvpool_t *p, int slot) {
    return slot >= 0 && slot < p->n_slots ? p->slots[slot].n_tokens : 0;
}

extern "C" int cb_cuda_kvpool_load_layer(cb_cuda_kvpool_t *p, int slot, int layer, const cb_bf16_t *host_k,
                                         const cb_bf16_t *host_v) {
    if (slot < 0 || slot >= p->n_slots || layer < 0 || layer >= p->n_layers || !p->slots[slot].refs)
        return cb_cuda_inval_(p->cu, "kvpool: load of slot %d layer %d (not acquired or out of range)", slot, layer);
    size_t bytes = (size_t)p->slots[slot].n_tokens * (size_t)p->kv_dim * 2;
    int rc = cb_cuda_h2d(p->cu, CB_CUDA_STREAM_COPY, cb_cuda_kvpool_k(p, slot, layer), host_k, bytes);
    if (!rc) rc = cb_cuda_h2d(p->cu, CB_CUDA_STREAM_COPY, cb_cuda_kvpool_v(p, slot, layer), host_v, bytes);
    p->loads_pending = true;
    return rc;
}

extern "C" int cb_cuda_kvpool_release(cb_cuda_kvpool_t *p, int slot, bool valid) {
    if (slot < 0 || slot >= p->n_slots || p->slots[slot].refs <= 0)
        return cb_cuda_inval_(p->cu, "kvpool: release of slot %d that is not acquired", slot);
    cb_kvslot *s = &p->slots[slot];
    s->refs--;
    CB_CU(p->cu, cudaEventRecord(s->last_read, p->cu->stream));
    s->has_read = true;
    if (!valid && s->refs == 0) s->valid = false;
    return CB_CUDA_OK;
}

extern "C" void cb_cuda_kvpool_stats(const cb_cuda_kvpool_t *p, cb_cuda_kvpool_stats_t *out) {
    memset(out, 0, sizeof *out);
    if (!p) return;
    out->hits = p->hits;
    out->misses = p->misses;
    out->evictions = p->evictions;
    out->slots = p->n_slots;
    out->slot_bytes = p->slot_bytes;
    for (int i = 0; i < p->n_slots; i++) out->used += p->slots[i].valid;
}
