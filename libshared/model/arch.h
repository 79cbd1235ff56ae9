/* arch: the one table of the transformer architectures the engine runs, read by the model loader.
 *
 * An architecture is named by a GGUF's general.architecture. Its entry says which tensors a layer has
 * beyond the llama block (Q/K/V biases, per-head Q/K norms), how RoPE pairs a head's dimensions, whether
 * a rope_freqs tensor may scale the frequencies, and the FFN gate's activation. Hyperparameters (sizes,
 * RoPE base, epsilon) are never here: they come from the file's metadata.
 *
 *   llama   SmolLM2, Llama 2/3 (rope_freqs: Llama 3.1+'s frequency factors), Mistral 7B: NORM pairing
 *   qwen2   Qwen2, Qwen2.5, Qwen2.5-Coder: biases on Q, K and V; NEOX pairing
 *   qwen3   Qwen3 dense: RMSNorm of each Q and K head (attn_q_norm, attn_k_norm) before RoPE; NEOX
 */
#ifndef CB_ARCH_H
#define CB_ARCH_H

#include <stdbool.h>
#include <stddef.h>

#include "model/model.h"

typedef struct {
    const char *name;        /* general.architecture */
    cb_rope_type_t rope;     /* pairing of every layer */
    cb_act_t act;            /* the FFN gate's activation */
    bool qkv_bias;           /* blk.N.attn_{q,k,v}.bias, required */
    bool qk_norm;            /* blk.N.attn_{q,k}_norm.weight [head_dim], required */
    bool rope_freqs;         /* rope_freqs.weight [n_rot/2] may be present */
} cb_arch_t;

/* The entry named name[0..len), or NULL. */
const cb_arch_t *cb_arch_find(const char *name, size_t len);
/* "llama, qwen2, qwen3": the names, for error messages (static storage). */
const char *cb_arch_names(void);
#endif
