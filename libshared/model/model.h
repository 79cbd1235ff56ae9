/* model: a decoder-only transformer loaded from a GGUF file (docs/models.md).
 *
 * cb_model_load opens the file (mmap, via gguf.h), reads every hyperparameter from the metadata (never
 * hard-coded), checks that every tensor the forward pass needs is present with the right type and
 * shape, and points each weight matrix at its stored (usually quantized) rows in the mapping: the CPU
 * kernels read those directly (integer matvecs, GEMMs over tiles dequantized on the fly:
 * kernels/cpu/cpu_ops.h), so the weights cost their file size and nothing more. With CB_ENGINE_WEIGHTS=f32
 * (the f32 reference of the tests and benchmarks) the block matrices and the output matrix also get an f32
 * copy, dequantized once at load with cb_dequant, and the CPU kernels then compute in f32 over the copies.
 *
 * Which tensors, norms, RoPE and windows an architecture has is one table (model/arch.h): llama (SmolLM2,
 * Llama 3 with rope_freqs, Mistral with its sliding window), qwen2 (Q/K/V biases, NEOX RoPE), qwen3 (per-head
 * Q/K RMSNorm, NEOX RoPE) and gemma3 (post-norms, GELU, windowed layers with their own RoPE base). Anything we
 * cannot run faithfully is rejected with a clear error naming the key instead of being run wrongly: another
 * architecture, partial rotary, RoPE scaling other than none/linear, a window on qwen2/qwen3, tensors the
 * architecture does not have.
 *
 * The model is immutable after load, so one model may be shared (read-only) by several engines and
 * threads. Memory: the mapping (file size) plus 4 bytes per block-weight parameter (plus 8 bytes per
 * 32 Q4_1 weights and 4 per 32 Q8_0 weights of scale copies).
 */
#ifndef CB_MODEL_H
#define CB_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "format/gguf.h"

typedef struct cb_model cb_model_t;

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
bool cb_rope_equal(const cb_rope_t *a, const cb_rope_t *b);

/* The feed-forward gate's activation: out = act(gate) * up. */
typedef enum { CB_ACT_SILU = 0, CB_ACT_GELU_TANH = 1 } cb_act_t;

#define CB_MAX_EOG 8 /* end-of-generation ids kept per model */

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

/* One weight matrix, row-major [rows = out][cols = in] (GGUF {ne0 = in, ne1 = out}). Borrowed from
 * the model; valid until cb_model_destroy. */
typedef struct {
    const char *name;        /* GGUF tensor name */
    uint32_t type;           /* storage type of q (cb_type_t) */
    const void *q;           /* [rows] stored rows of row_bytes each (in the mapping) */
    size_t row_bytes;        /* bytes of one stored row */
    int rows, cols;          /* out, in */
    const float *f32;        /* [rows][cols] dequantized copy, or NULL (the default: CB_ENGINE_WEIGHTS=f32
                                keeps copies of the block matrices, the f32 reference numerics) */
    const void *x8;          /* the rows interleaved by 8 (cpu/cpu_quant.h), or NULL; when set, the CPU
                                kernels read only this copy (the default for Q4_1/Q8_0, see cb_model_load) */
    const void *v16;         /* the rows in the 16-row VNNI layout (cpu/cpu_quant.h), or NULL; at most one of
                                x8 and v16 is set */
} cb_weight_t;

typedef struct {
    const float *attn_norm;  /* [n_embd] */
    const float *bq;         /* [n_head*head_dim] bias of Q, or NULL (qwen2 has Q, K and V biases) */
    const float *bk;         /* [n_head_kv*head_dim] or NULL */
    const float *bv;         /* [n_head_kv*head_dim] or NULL */
    const float *q_norm;     /* [head_dim] RMSNorm weight of each Q head before RoPE, or NULL (qwen3) */
    const float *k_norm;     /* [head_dim] the same for K, or NULL */
    cb_rope_t rope;          /* this layer's rotation */
    cb_weight_t wq;          /* [n_head*head_dim][n_embd]   (rows permuted for NORM RoPE by the converter) */
    cb_weight_t wk;          /* [n_head_kv*head_dim][n_embd] */
    cb_weight_t wv;          /* [n_head_kv*head_dim][n_embd] */
    cb_weight_t wo;          /* [n_embd][n_head*head_dim] */
    const float *post_attn_norm; /* [n_embd] RMSNorm of the attention output before the residual add, or NULL */
    int window;              /* keys a row of this layer sees (sliding window, backend.h), 0 = all */
    const float *ffn_norm;   /* [n_embd] */
    cb_weight_t w_gate;      /* [n_ff][n_embd] */
    cb_weight_t w_up;        /* [n_ff][n_embd] */
    cb_weight_t w_down;      /* [n_embd][n_ff] */
    const float *post_ffn_norm; /* [n_embd] RMSNorm of the FFN output before the residual add, or NULL */
} cb_layer_weights_t;

/* The model-wide rotation the hyperparameters describe (every layer's, for the architectures of arch.h). */
cb_rope_t cb_hparams_rope(const cb_hparams_t *hp);

/* Loads path. Returns NULL on failure with a message in err (errlen bytes) naming the problem
 * (missing key, unsupported architecture or RoPE, missing tensor, wrong type or shape, out of memory).
 * Caller owns the result; free with cb_model_destroy. */
cb_model_t *cb_model_load(const char *path, char *err, size_t errlen);
/* Frees the model and nulls *self_p; NULL-safe. No engine may still use it. */
void cb_model_destroy(cb_model_t **self_p);

const cb_hparams_t *cb_model_hparams(const cb_model_t *self);
/* Checks token ids from outside: t [n] with n >= 1, each in 0..n_vocab-1. 0, or -1 with err ("<what> is
 * empty" / "<what> token i = id outside the vocabulary (n)"). */
int cb_model_check_tokens(const cb_model_t *self, const int32_t *t, int n, const char *what, char *err,
                          size_t errlen);
/* The underlying GGUF reader (borrowed; lives as long as the model), e.g. to build the tokenizer. */
const cb_gguf_t *cb_model_gguf(const cb_model_t *self);
const cb_layer_weights_t *cb_model_layer(const cb_model_t *self, int layer);
const cb_weight_t *cb_model_tok_embd(const cb_model_t *self);  /* [n_vocab][n_embd], stored form only */
const cb_weight_t *cb_model_output(const cb_model_t *self);    /* [n_vocab][n_embd]; = tok_embd when tied */
const float *cb_model_output_norm(const cb_model_t *self);     /* [n_embd] */
/* True when id ends generation (one of hparams.eog_ids). */
bool cb_model_is_eog(const cb_model_t *self, int32_t id);

/* Model fingerprint, computed once at load: BLAKE2b-256 (libsodium crypto_generichash) over, in order,
 *   the tag "cacheblend-model-fingerprint-v1";
 *   general.architecture;
 *   the hyperparameters that change KV values or logits, each as a little-endian u32 (floats by their
 *   bit pattern): n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_rot, rope_type,
 *   rope_base, rms_eps, tied_output; then rope_freq_scale when not 1; then, when the model has sliding
 *   windows, n_swa, every layer's window and RoPE base, embd_scale and act;
 *   tokenizer.ggml.model, tokenizer.ggml.pre (empty if absent), then every string of
 *   tokenizer.ggml.tokens and tokenizer.ggml.merges as stored (each prefixed by its u64 length, each
 *   array by its u64 count);
 *   for every tensor in file order: name, type, the four ne as u64, then its data bytes.
 * Two files that differ in any of these get different fingerprints; metadata that cannot change a
 * computed value (general.name, license, chat template) does not count. */
void cb_model_fingerprint(const cb_model_t *self, uint8_t out[32]);

/* Bytes of f32 copies held by the model (for memory accounting; 0 unless CB_ENGINE_WEIGHTS=f32). */
size_t cb_model_f32_bytes(const cb_model_t *self);
#endif
