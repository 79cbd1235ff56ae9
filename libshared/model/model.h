/* model: a decoder-only transformer loaded from a GGUF file (docs/models.md).
 *
 * cb_model_load opens the file (mmap, via gguf.h), reads every hyperparameter from the metadata (never
 * hard-coded), checks that every tensor the forward pass needs is present with the right type and
 * shape, and describes each weight matrix (tensor.h cb_weight_t) by its stored (usually quantized) rows in the
 * mapping. The model builds no other layout: the backend an engine runs on prepares the weights it reads
 * (cb_model_weights, the operation prepare_weights: the CPU backend's interleaved copies by default, f32 copies
 * with CB_ENGINE_WEIGHTS=f32, the file's rows with CB_ENGINE_WEIGHTS=stored; the CUDA backend uploads them).
 *
 * Which tensors, norms, RoPE and windows an architecture has is one table (model/arch.h): llama (SmolLM2,
 * Llama 3 with rope_freqs, Mistral with its sliding window), qwen2 (Q/K/V biases, NEOX RoPE), qwen3 (per-head
 * Q/K RMSNorm, NEOX RoPE) and gemma3 (post-norms, GELU, windowed layers with their own RoPE base). Anything we
 * cannot run faithfully is rejected with a clear error naming the key instead of being run wrongly: another
 * architecture, partial rotary, RoPE scaling other than none/linear, a window on qwen2/qwen3, tensors the
 * architecture does not have.
 *
 * The model is immutable after load but for its weights' prepared layouts (cb_model_weights), so one model
 * may be shared by several engines and threads. Memory: the mapping (file size), and what the backends
 * prepare (the CPU's interleaved copies take the place of the stored pages they were made from).
 */
#ifndef CB_MODEL_H
#define CB_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "format/gguf.h"
#include "tensor/tensor.h"

typedef struct cb_model cb_model_t;

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
    int window;              /* keys a row of this layer sees (sliding window, tensor.h cb_attn_geom_t), 0 = all */
    const float *ffn_norm;   /* [n_embd] */
    cb_weight_t w_gate;      /* [n_ff][n_embd] */
    cb_weight_t w_up;        /* [n_ff][n_embd] */
    cb_weight_t w_down;      /* [n_embd][n_ff] */
    const float *post_ffn_norm; /* [n_embd] RMSNorm of the FFN output before the residual add, or NULL */
} cb_layer_weights_t;

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

/* The model's weight matrices as the backends prepare them (tensor.h cb_weights_t): the one part of a loaded
 * model that changes, and only through cb_weights_prepare / cb_weights_release (under its lock), so the model
 * may still be shared by engines on several threads. Its mode is CB_ENGINE_WEIGHTS at load. Lives as long as
 * the model. */
cb_weights_t *cb_model_weights(const cb_model_t *self);
#endif
