/* tensor: the types every layer above format/ shares with the kernels, and the backend operation table
 * (docs/engine.md).
 *
 * This is the floor the compute stands on: the model (model/) describes its weights and geometry with these
 * types, the engine (engine/) drives a backend through cb_backend_ops_t, and the backends (kernels/cpu,
 * kernels/cuda) implement the table over the same types, including nothing above this layer but base/ and
 * format/ (scripts/check-layers). The type ids of stored tensors are format/'s (gguf.h cb_type_t).
 *
 * Backends: a backend is a struct of function pointers (cb_backend_ops_t) plus a context. Activations (x, q, k,
 * v, logits, scores) are host buffers from the backend's own host_alloc (plain memory on the CPU, pinned memory
 * on CUDA, where every operation copies its inputs in and its outputs out); shapes are in the comments. The KV
 * cache is not a host buffer: the backend owns it as a pool of fixed-size blocks in its own memory (host memory
 * on the CPU, device memory on CUDA), sized once by kv_pool_init; a sequence's rows are reached through a block
 * table (cb_kv_table_t), never through a pointer, so attention on a device reads K/V where they already are.
 * The weights are the model's, in the file's layout; a backend reads them in the layout it prefers once it has
 * prepared them (prepare_weights: the CPU backend's interleaved or f32 copies; the CUDA backend uploads each
 * weight on first use and prepares nothing). The CPU backend (kernels/cpu) computes in f32 and is the
 * reference: other backends are tested against it within tolerances (tests/gpu). The pool's value type is
 * chosen at kv_pool_init (engine.kv_dtype): the CPU backend stores f32 (the reference) or binary16 and attends
 * in f32 either way; the CUDA backend stores bf16.
 *
 * Everything CacheBlend needs is an operation here (RoPE, KV writes and layer loads with re-rotation,
 * attention, attention mass, deviation, top-k, row compaction), so blend/ runs the same algorithm on every
 * backend. Operations never allocate (but prepare_weights, once): scratch is reserved when the backend is
 * created for a maximum number of rows per call and keys per attention row. Operations returning int give 0,
 * or -1 when they failed (bad argument, device error); void ones report failure through the backend's own
 * state (the CUDA backend fills outputs with NaN and says so once).
 *
 * Threads: one thread calls the operations, except kv_load, which one other thread (the blend's layer loader)
 * may call at the same time for rows no concurrent operation touches.
 */
#ifndef CB_TENSOR_H
#define CB_TENSOR_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "format/gguf.h"   /* cb_type_t: the type ids of stored tensors */
#include "format/kvfile.h" /* cb_kv_dtype_t: the KV pool's value types */

#ifdef __cplusplus
extern "C" { /* the CUDA backend (C++) implements the table */
#endif

/* ---------------------------------------------------------------- rotation and geometry */

/* RoPE pairing: NORM rotates adjacent pairs (x[2i], x[2i+1]) (llama GGUFs: the converter permuted Q and K);
 * NEOX rotates (x[i], x[i + n_dims/2]) (qwen2, qwen3, gemma3). Pair i turns by the same angle either way. */
typedef enum { CB_ROPE_NORM = 0, CB_ROPE_NEOX = 2 } cb_rope_type_t;

/* How one layer rotates Q and K. The forward pass and the blend's re-rotation of cached K use the same
 * descriptor, so a chunk's K is moved with its own layer's pairing, base and scaling. Pair i of a head at
 * position p turns by theta_i = p * freq_scale * base^(-2i / n_dims) / freq_factors[i]. */
typedef struct {
    cb_rope_type_t type;
    int n_dims;                 /* rotated dims of a head (= head_dim: partial rotary is rejected at load) */
    float base;                 /* <arch>.rope.freq_base (default 10000) */
    float freq_scale;           /* 1 / <arch>.rope.scaling.factor for linear scaling, else 1 */
    const float *freq_factors;  /* [n_dims / 2] rope_freqs.weight (Llama 3's frequency scaling), or NULL */
} cb_rope_t;

/* True when a and b rotate identically (same fields; factors compared by value). */
static inline bool cb_rope_equal(const cb_rope_t *a, const cb_rope_t *b) {
    if (a->type != b->type || a->n_dims != b->n_dims || a->base != b->base || a->freq_scale != b->freq_scale ||
        (!a->freq_factors) != (!b->freq_factors))
        return false;
    return !a->freq_factors || a->freq_factors == b->freq_factors ||
           memcmp(a->freq_factors, b->freq_factors, sizeof(float) * (size_t)(a->n_dims / 2)) == 0;
}

/* The feed-forward gate's activation: out = act(gate) * up. */
typedef enum { CB_ACT_SILU = 0, CB_ACT_GELU_TANH = 1 } cb_act_t;

#define CB_MAX_EOG 8 /* end-of-generation ids kept per model */

/* A decoder's hyperparameters, as the model reads them from its file (model/model.h); the backends are built
 * for the geometry they give. */
typedef struct {
    char arch[32];           /* general.architecture: llama, qwen2, qwen3 or gemma3 (model/arch.h) */
    int n_layer;             /* <arch>.block_count */
    int n_embd;              /* <arch>.embedding_length */
    int n_head;              /* <arch>.attention.head_count */
    int n_head_kv;           /* <arch>.attention.head_count_kv (default n_head) */
    int head_dim;            /* <arch>.attention.key_length (default n_embd / n_head) */
    int n_ff;                /* <arch>.feed_forward_length */
    int n_vocab;             /* length of tokenizer.ggml.tokens (= token_embd rows) */
    int n_ctx_train;         /* <arch>.context_length */
    int n_rot;               /* <arch>.rope.dimension_count; = head_dim (partial rotary rejected) */
    float rope_base;         /* <arch>.rope.freq_base (default 10000) */
    float rms_eps;           /* <arch>.attention.layer_norm_rms_epsilon */
    cb_rope_type_t rope_type;
    float rope_freq_scale;   /* 1 / <arch>.rope.scaling.factor (linear scaling), else 1 */
    const float *rope_freqs; /* [n_rot / 2] rope_freqs.weight as f32 (borrowed from the model), or NULL */
    cb_act_t act;            /* the FFN gate's activation (the architecture's) */
    float embd_scale;        /* the embeddings are multiplied by it: sqrt(n_embd) for gemma3, else 1 */
    int n_swa;               /* <arch>.attention.sliding_window: keys a windowed layer sees, 0 = no windows */
    int swa_period;          /* gemma3: layer l is windowed unless l % swa_period == swa_period - 1 (6) */
    float rope_base_swa;     /* the windowed layers' RoPE base (gemma3: <arch>.rope.freq_base_swa, 10000) */
    bool tied_output;        /* no output.weight: the LM head is token_embd */
    int32_t bos_id;          /* tokenizer.ggml.bos_token_id, -1 if absent */
    int32_t eos_id;          /* tokenizer.ggml.eos_token_id, -1 if absent */
    int32_t eot_id;          /* tokenizer.ggml.eot_token_id, -1 if absent */
    int n_eog;               /* end-of-generation ids: eos, eot and control tokens named like
                                <|endoftext|>, <|im_end|>, <|eot_id|> (llama.cpp's auto-detection) */
    int32_t eog_ids[CB_MAX_EOG];
} cb_hparams_t;

/* The model-wide rotation the hyperparameters describe (every layer's, for the architectures of arch.h). */
static inline cb_rope_t cb_hparams_rope(const cb_hparams_t *hp) {
    float scale = hp->rope_freq_scale > 0.0f ? hp->rope_freq_scale : 1.0f; /* 0: a zeroed hparams */
    return (cb_rope_t){hp->rope_type, hp->n_rot ? hp->n_rot : hp->head_dim, hp->rope_base, scale, hp->rope_freqs};
}

/* ---------------------------------------------------------------- weights */

/* One weight matrix, row-major [rows = out][cols = in] (GGUF {ne0 = in, ne1 = out}). The model describes it
 * (name, type, q, row_bytes, rows, cols: its stored rows in the file mapping); the layout slots (f32, x8,
 * v16) are empty until a backend prepares the model's weights (prepare_weights, cb_weights_t) and empty
 * again once the last backend that prepared them is gone. Borrowed from the model; valid until the model is
 * destroyed. */
typedef struct {
    const char *name;        /* GGUF tensor name */
    uint32_t type;           /* storage type of q (gguf.h cb_type_t) */
    const void *q;           /* [rows] stored rows of row_bytes each (in the mapping) */
    size_t row_bytes;        /* bytes of one stored row */
    int rows, cols;          /* out, in */
    const float *f32;        /* [rows][cols] dequantized copy, or NULL (the CPU backend's f32 reference numerics,
                                CB_ENGINE_WEIGHTS=f32) */
    const void *x8;          /* the rows interleaved by 8 (kernels/cpu/cpu_quant.h), or NULL; when set, the CPU
                                kernels read only this copy */
    const void *v16;         /* the rows in the 16-row VNNI layout (kernels/cpu/cpu_quant.h), or NULL; at most one
                                of x8 and v16 is set */
} cb_weight_t;

/* What a backend prepares of a model's weights (CB_ENGINE_WEIGHTS, read when the model loads). */
typedef enum {
    CB_WEIGHTS_NATIVE = 0,   /* the layouts the backend's kernels read fastest (the default; CPU: x8/v16 copies) */
    CB_WEIGHTS_STORED = 1,   /* the file's rows only */
    CB_WEIGHTS_F32 = 2       /* f32 copies of the matrices (the CPU's f32 reference numerics) */
} cb_weight_mode_t;

/* A model's weight matrices as the backends prepare them (model.h cb_model_weights; ops->prepare_weights).
 * The model fills the description (w, n, alias, lookup, mode) at load. The prepared state below it belongs to
 * whichever backend prepared the set, under lock: the first backend to prepare builds its copies (into memory
 * it allocates, mem, freed by free_mem), fills the descriptors' layout slots and takes the first reference;
 * every later backend of the same kind over the same model only takes a reference, so the weights are
 * prepared once per model however many engines share it; each backend gives its reference back when it is
 * destroyed (cb_weights_release), and the last one frees the copies and empties the slots. */
typedef struct cb_weights cb_weights_t;
struct cb_weights {
    cb_weight_t **w;         /* [n] the matrices a backend may prepare: every layer's q, k, v, o, gate, up, down
                                in layer order, then the output matrix */
    int n;
    cb_weight_t *alias;      /* another descriptor of w[n - 1]'s rows (the embedding table of a tied model), which
                                gets w[n - 1]'s x8/v16 slots (not its f32 copy: lookups read the stored rows), or
                                NULL */
    const cb_weight_t *lookup; /* a matrix only looked up a few rows at a time (an untied embedding table), whose
                                stored pages a backend may give back, or NULL */
    cb_weight_mode_t mode;
    /* the prepared state (cb_weights_prepare, cb_weights_release) */
    pthread_mutex_t lock;
    int refs;                /* backends holding the prepared state */
    const char *by;          /* ops->name of the backend kind that prepared it, or NULL */
    void *mem;               /* that backend's copies, freed by free_mem(mem) with the last reference */
    void (*free_mem)(void *mem);
    size_t bytes;            /* bytes of the copies (memory accounting) */
};

/* Builds a backend's copies of ws's weights: fills the slots, ws->mem, ws->free_mem and ws->bytes. 0, or -1 with
 * err (and nothing to free). */
typedef int (*cb_weights_build_fn)(cb_weights_t *ws, void *arg, char *err, size_t errlen);

/* Takes a reference on ws's prepared state for backend kind `by` (ops->name), building it with build(ws, arg)
 * when no backend holds one. 0, or -1 with err: build failed, or another backend kind holds the weights
 * prepared its way. Thread-safe. */
int cb_weights_prepare(cb_weights_t *ws, const char *by, cb_weights_build_fn build, void *arg, char *err,
                       size_t errlen);
/* Gives one reference back; the last frees the copies and empties every slot. NULL-safe. */
void cb_weights_release(cb_weights_t *ws);

/* ---------------------------------------------------------------- the KV block table and attention */

/* One sequence's KV rows in the pool: position p lives in pool block blocks[p / block_tokens] at row
 * p % block_tokens; every layer uses the same table. Built by the engine (engine.h); borrowed by the
 * operations for the call. */
typedef struct {
    const int32_t *blocks;  /* [n_pos / block_tokens] block ids in 0..n_blocks-1 */
    int n_pos;              /* positions the table covers (a multiple of block_tokens) */
} cb_kv_table_t;

/* Arithmetic of the products of prefill attention (blocks of query rows; decode rows are always f32). */
typedef enum {
    CB_ATTN_F32 = 0,        /* f32 operands (what a zero-initialised geometry means) */
    CB_ATTN_BF16 = 1,       /* products on bf16 tiles summed in f32: q, K, V as hi/lo bf16 pairs, the softmax
                               weights rounded once to bf16 (CPU with AMX-BF16; elsewhere f32) */
    CB_ATTN_I16 = 2,        /* products as int16 pairs summed in int32: q·scale, K, V and the softmax weights
                               rounded per row to ~13 bits (CPU with AVX512-VNNI; elsewhere f32) */
    CB_ATTN_AUTO = 3        /* the fastest of these the CPU has: BF16, else I16, else F32 */
} cb_attn_math_t;

/* Attention geometry (GQA: query head h reads KV head h / (n_head / n_head_kv)). */
typedef struct {
    int n_head, n_head_kv, head_dim;
    float scale;            /* usually 1/sqrt(head_dim) */
    cb_attn_math_t math;    /* prefill blocks' products */
    int window;             /* sliding window (a windowed layer, model.h): a row with key limit lim sees keys
                               [lim - window, lim) only (those >= 0); 0: every key below its limit */
} cb_attn_geom_t;

/* The first key a row of key limit lim sees under g's window (0 without one). */
static inline int cb_attn_key_lo(const cb_attn_geom_t *g, int lim) {
    return g->window > 0 && lim > g->window ? lim - g->window : 0;
}

/* ---------------------------------------------------------------- the backend operation table */

/* One output of matmul_multi. */
typedef struct {
    const cb_weight_t *w;
    float *y;               /* [n][ldy] */
    int ldy;
} cb_matmul_part_t;

typedef struct {
    const char *name;
    /* Optional (NULL: the backend reads the weights as stored, or prepares them itself on first use): prepares
     * the weights it will read, once per model (cb_weights_prepare: the CPU backend builds its x8/v16 or f32
     * copies as ws->mode says and gives the stored pages back); the backend keeps its reference until destroy.
     * The engine calls it once, before the first operation that reads a weight. 0, or -1 with err. */
    int (*prepare_weights)(void *ctx, cb_weights_t *ws, char *err, size_t errlen);
    /* y[i][o] = sum_j x[i][j] w[o][j]:  x [n][w->cols], y [n][ldy] (ldy >= w->rows); n <= max_rows. */
    void (*matmul)(void *ctx, const cb_weight_t *w, const float *x, int n, float *y, int ldy);
    /* y = x / sqrt(mean(x^2) + eps) * w per row:  x, y [n][dim] (may alias), w [dim]. */
    void (*rmsnorm)(void *ctx, const float *x, const float *w, int n, int dim, float eps, float *y);
    /* RoPE in place as r says (pairing, base, scaling; cb_rope_t):  x [n][n_heads*r->n_dims],
     * pos [n] (any positions >= 0). */
    void (*rope)(void *ctx, float *x, int n, int n_heads, const int32_t *pos, const cb_rope_t *r);
    /* x[i][j] += b[j]:  x [n][dim], b [dim] (a projection's bias). */
    void (*add_bias)(void *ctx, float *x, const float *b, int n, int dim);
    /* out[i] = softmax(q[i] K[lo_i:key_limit[i])ᵀ · scale) V per head, K/V = layer's pool rows of table t,
     * lo_i = cb_attn_key_lo(g, key_limit[i]) (0 unless g->window): q, out [n][n_head*head_dim]; key_limit [n]
     * in 1..min(max_keys, t->n_pos). */
    void (*attention)(void *ctx, const cb_attn_geom_t *g, const float *q, int n, int layer, const cb_kv_table_t *t,
                      const int32_t *key_limit, float *out);
    /* Optional (NULL: the engine calls attention once per row): rows of different sequences (a decode
     * batch), row i over keys [lo_i, key_limit[i]) (as attention) of the layer's rows of its own table t[i]:
     * q, out [n][n_head*head_dim]; t, key_limit [n]. Each row gets the bits a one-row attention call gives it. */
    void (*attention_rows)(void *ctx, const cb_attn_geom_t *g, const float *q, int n, int layer,
                           const cb_kv_table_t *t, const int32_t *key_limit, float *out);
    /* out = silu(gate) * up elementwise over n (out may alias either input). */
    void (*swiglu)(void *ctx, const float *gate, const float *up, size_t n, float *out);
    /* out = gelu(gate) * up elementwise over n, GELU's tanh form 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
     * (gemma3's FFN; out may alias either input). */
    void (*geglu)(void *ctx, const float *gate, const float *up, size_t n, float *out);
    /* x *= a elementwise over n (gemma3's embeddings times sqrt(n_embd)). */
    void (*scale)(void *ctx, float *x, size_t n, float a);
    /* x += y elementwise over n. */
    void (*add)(void *ctx, float *x, const float *y, size_t n);
    /* x[i] = row tokens[i] of table (dequantized):  x [n][table->cols]; tokens already validated. */
    void (*embed)(void *ctx, const cb_weight_t *table, const int32_t *tokens, int n, float *x);
    /* Optional (NULL: the engine calls matmul once per part): the products of one x with several
     * weights (Q|K|V, gate|up) in one call, so a backend can schedule them together. Each part is
     * y [n][ldy] = x [n][w->cols] · wᵀ, all parts with the same cols. */
    void (*matmul_multi)(void *ctx, const cb_matmul_part_t *parts, int n_parts, const float *x, int n);
    /* Optional (NULL: the engine uses matmul_multi and matmul): the products of a decode batch, as
     * matmul_multi, computed so that every row gets the bits a one-row matmul gives it, whatever n and
     * whichever rows share the call (so a sequence decodes to the same logits alone or in any batch).
     * matmul and matmul_multi promise that only up to a backend-chosen row count, if at all. */
    void (*matmul_rowwise)(void *ctx, const cb_matmul_part_t *parts, int n_parts, const float *x, int n);

    /* ---- host buffers ---- */
    /* Host memory for activations: zeroed, 64-byte aligned (pinned on CUDA). NULL on failure. */
    void *(*host_alloc)(void *ctx, size_t bytes);
    void (*host_free)(void *ctx, void *p);

    /* ---- the KV pool ---- */
    /* Allocates the pool once: K and V of n_blocks blocks of block_tokens positions x kv_dim, every layer, of
     * values of dtype: CB_KV_F32 or CB_KV_F16 (the CPU backend stores either; the CUDA backend takes
     * CB_KV_F16 as "16-bit", stores bf16, and rejects CB_KV_F32). Sets kv_value_bytes. 0, or -1 with err. */
    int (*kv_pool_init)(void *ctx, int n_layer, int kv_dim, int block_tokens, int n_blocks, cb_kv_dtype_t dtype,
                        char *err, size_t errlen);
    /* Block dst := block src, K and V of every layer (copy-on-write of a shared block). */
    int (*kv_copy_block)(void *ctx, int dst, int src);
    /* Post-RoPE K and V rows k, v [n][kv_dim] (f32 host) into the layer's rows pos [n] of table t, converted
     * to the pool's type (f16: round to nearest even). */
    int (*kv_write)(void *ctx, int layer, const cb_kv_table_t *t, const int32_t *pos, int n, const float *k,
                    const float *v);
    /* A layer load: n cached rows for positions pos0..pos0+n-1 of table t from host memory k, v
     * [n][kv_dim] in dtype (f32, f16 or bf16, and q8_0 where kv_load_q8_0; a memory-tier entry or a KV
     * file's mapping), converted to the pool's type, pre-RoPE K rotated to its position by r (the layer's
     * rotation, as the rope operation does it) on the way. */
    int (*kv_load)(void *ctx, int layer, const cb_kv_table_t *t, int pos0, int n, const void *k, const void *v,
                   cb_kv_dtype_t dtype, const cb_rope_t *r);
    /* kv_load and kv_deviation also take CB_KV_Q8_0 rows (kvfile's blocks: kv_dim / 32 blocks of 34 bytes a
     * row), dequantized on the way; false: the caller decodes them first. */
    bool kv_load_q8_0;
    /* Rows pos0..pos0+n-1 of the layer back as f32: k, v [n][kv_dim] (post-RoPE K; either may be NULL): the
     * values the pool holds (an f16 pool gives a written row back rounded to f16). */
    int (*kv_read)(void *ctx, int layer, const cb_kv_table_t *t, int pos0, int n, float *k, float *v);

    /* ---- CacheBlend ---- */
    /* Attention mass (metric 'a'): for each row i and head, the softmax probabilities of q[i] over keys
     * [lo_i, key_limit[i]) of the layer (as attention computes them, window included) are added to mass [key]:
     * q [n][n_head*head_dim] post-RoPE, mass [>= max key_limit] accumulated, not cleared; out NULL, or
     * [n][n_head*head_dim] the rows' attention output as well (the CPU computes it from the same
     * probabilities in f32, whatever engine.attn, so it differs from the attention operation's by that
     * operation's rounding; CUDA runs its attention). */
    int (*attn_mass)(void *ctx, const cb_attn_geom_t *g, const float *q, int n, int layer, const cb_kv_table_t *t,
                     const int32_t *key_limit, float *mass, float *out);
    /* KV deviation: dev[i] = sum_j (fresh[i][j] - cached_i[j])^2 over j < width, in double; fresh f32
     * [n][width] (pre-RoPE K or V just computed), cached [n] row pointers into host memory of dtype. */
    int (*kv_deviation)(void *ctx, int n, int width, const float *fresh, const void *const *cached,
                        cb_kv_dtype_t dtype, double *dev);
    /* Top-k: out [min(k, n)] = indices of the k largest score [n] (NaN first: what cannot be measured is
     * recomputed; ties: lower index first), in that order. */
    int (*topk)(void *ctx, int n, const double *score, int k, int32_t *out);
    /* Row compaction (gather): x[i] = x[keep[i]] for i < n_keep, rows of row_len floats; keep ascending
     * with keep[i] >= i. */
    void (*compact_rows)(void *ctx, float *x, size_t row_len, const int32_t *keep, int n_keep);

    /* Threads used by later calls (>= 1). */
    void (*set_threads)(void *ctx, int n_threads);
    /* Frees the context (and gives back its reference on prepared weights). */
    void (*destroy)(void *ctx);
} cb_backend_ops_t;

typedef struct {
    const cb_backend_ops_t *ops;
    void *ctx;
    int max_rows;           /* rows per call the scratch was sized for */
    int max_keys;           /* keys per attention row */
    int kv_value_bytes;     /* bytes of one K or V value in the pool, as kv_pool_init made it (CPU: 4 = f32,
                               2 = f16; CUDA: 2 = bf16; 0 is read as 4) */
} cb_backend_t;

/* Destroys a backend of any kind (ops->destroy), nulls *self_p; NULL-safe. (Constructors: cb_backend_select in
 * engine/backend_select.h; kernels/cpu/cpu_backend.h and kernels/cuda/cb_cuda_backend.h build one kind.) */
void cb_backend_destroy(cb_backend_t **self_p);

#ifdef __cplusplus
}
#endif
#endif
