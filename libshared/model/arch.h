/* arch: the one table of the transformer architectures the engine runs, read by the model loader.
 *
 * An architecture is named by a GGUF's general.architecture. Its entry says which tensors a layer has
 * beyond the llama block (Q/K/V biases, per-head Q/K norms), how RoPE pairs a head's dimensions, whether
 * a rope_freqs tensor may scale the frequencies, and the FFN gate's activation. Hyperparameters (sizes,
 * RoPE base, epsilon) are never here: they come from the file's metadata.
 *
 *   llama   SmolLM2, Llama 2/3 (rope_freqs: Llama 3.1+'s frequency factors), Mistral 7B: NORM pairing;
 *           a declared attention.sliding_window applies to every layer (Mistral 7B v0.1)
 *   qwen2   Qwen2, Qwen2.5, Qwen2.5-Coder: biases on Q, K and V; NEOX pairing
 *   qwen3   Qwen3 dense: RMSNorm of each Q and K head (attn_q_norm, attn_k_norm) before RoPE; NEOX
 *   gemma3  Gemma 3 (text): embeddings times sqrt(n_embd); Q/K head norms; RMSNorm after attention and after
 *           the FFN too (post_attention_norm, post_ffw_norm); GELU (tanh) gate; NEOX; windowed layers
 *           (attention.sliding_window keys, RoPE base rope.freq_base_swa or 1e4, no RoPE scaling) with every
 *           sixth layer global (attention.sliding_window_pattern overrides the period)
 * The converters store Gemma's norm weights with the 1 already added (x (1 + w) is x w' in the file), so
 * every norm here is the plain RMSNorm.
 */
#ifndef CB_ARCH_H
#define CB_ARCH_H

#include <stdbool.h>
#include <stddef.h>

#include "model/model.h"

/* Sliding windows: refused, applied to every layer when the file declares one, or to the layers of a
 * repeating pattern (required then). */
typedef enum { CB_SWA_NONE = 0, CB_SWA_ALL, CB_SWA_PERIODIC } cb_swa_t;

typedef struct {
    const char *name;        /* general.architecture */
    cb_rope_type_t rope;     /* pairing of every layer */
    cb_act_t act;            /* the FFN gate's activation */
    bool qkv_bias;           /* blk.N.attn_{q,k,v}.bias, required */
    bool qk_norm;            /* blk.N.attn_{q,k}_norm.weight [head_dim], required */
    bool rope_freqs;         /* rope_freqs.weight [n_rot/2] may be present */
    bool post_norms;         /* blk.N.post_attention_norm.weight, blk.N.post_ffw_norm.weight [n_embd], required */
    bool embd_scale;         /* embeddings times sqrt(n_embd) */
    cb_swa_t swa;            /* what attention.sliding_window means */
} cb_arch_t;

/* The entry named name[0..len), or NULL. */
const cb_arch_t *cb_arch_find(const char *name, size_t len);
/* "llama, qwen2, qwen3": the names, for error messages (static storage). */
const char *cb_arch_names(void);
#endif
