/* synth: deterministic synthetic models of every architecture the engine runs (model/arch.h), written as
 * GGUF v3 (to a file or to memory).
 *
 * Weights come from a counter-based generator: element i of tensor t under seed s is
 *     u(s, t, i) in [-1, 1)     (a 64-bit mix of (s, t, i); the top 24 bits, exact in f32)
 *     value = scale(kind) * u   for matrices;   1 + 0.1 * u   for norm vectors.
 * Any element can be computed on its own, so the same model can be produced piecewise on the CPU
 * (cb_synth_fill), written to a file (cb_synth_write), built in memory (cb_synth_build, for
 * cb_gguf_open_mem) or generated on a GPU (cb_cuda_synth_fill gives the bf16 values bit for bit).
 *
 * Scales (u has variance 1/3; inputs of every matrix are RMS-normalized to ~1):
 *   attn_q, attn_k   3/sqrt(n_embd): each q/k component has variance 3, so scores q.k/sqrt(d) have a
 *                    standard deviation of ~3 and attention is peaked, not uniform;
 *   attn_v, ffn_gate, ffn_up   sqrt(3/n_embd) (unit variance outputs);
 *   attn_output      sqrt(0.75/(n_head*head_dim)), ffn_down sqrt(0.75/n_ff) (residual updates ~0.5);
 *   token_embd, output   4*sqrt(3/n_embd): logits with a standard deviation of ~4 (a peaked
 *                    next-token distribution, so greedy decoding is stable across backends).
 *
 * Storage by dtype: bf16 = matrices BF16, norms F32; f32 = everything F32; q4_1 = block matrices Q4_1,
 * token_embd and output Q8_0 (as a real SmolLM2 Q4_1 file has), norms F32; q4_k_m = the types a real Q4_K_M
 * file mixes (llama.cpp's Qwen2.5 and Gemma 3 files): attn_q and attn_k Q5_0, attn_v and token_embd Q8_0,
 * attn_output, ffn_gate and ffn_up Q4_K, ffn_down and output Q6_K (format/quant.h cb_quant rounding).
 *
 * Tokenizer metadata: a minimal GPT-2 byte-level BPE vocabulary that the tokenizer module accepts
 * (model "gpt2", pre "smollm"): ids 0..2 are <|endoftext|>, <|im_start|> (BOS), <|im_end|> (EOS), then
 * the 256 byte symbols, then a few dozen merges of common English letter pairs, then filler tokens
 * "<synN>" up to n_vocab. A ChatML chat template is included. mistral and gemma3 get a SentencePiece
 * vocabulary instead (model "llama"): <unk>, <s> (BOS), </s> (EOS), <start_of_turn>, <end_of_turn>, the
 * byte tokens <0x00>..<0xFF>, the same pieces ("▁" for the space) scored by rank, fillers; and their
 * family's chat template ([INST], Gemma turns).
 */
#ifndef CB_SYNTH_H
#define CB_SYNTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { CB_SYNTH_BF16 = 0, CB_SYNTH_Q4_1 = 1, CB_SYNTH_F32 = 2, CB_SYNTH_QMIX = 3 } cb_synth_dtype_t;

/* Architectures: the GGUF's general.architecture and the tensors it adds to the llama block. */
typedef enum {
    CB_SYNTH_LLAMA = 0,      /* "llama" */
    CB_SYNTH_LLAMA3,         /* "llama" with rope_freqs.weight (Llama 3.1's frequency factors) */
    CB_SYNTH_QWEN2,          /* "qwen2": biases of Q, K and V */
    CB_SYNTH_QWEN3,          /* "qwen3": RMSNorm weights of the Q and K heads */
    CB_SYNTH_MISTRAL,        /* "llama" with a SentencePiece vocabulary (tokenizer.ggml.model "llama"), as Mistral */
    CB_SYNTH_GEMMA3          /* "gemma3": Q/K head norms, norms after attention and after the FFN, GELU FFN,
                                embeddings times sqrt(n_embd), sliding-window layers (window, every sixth
                                layer global), NEOX RoPE with base 1e4 on windowed layers */
} cb_synth_arch_t;

typedef struct {
    char name[32];           /* shape name, written to general.name as "synthetic-<name>" */
    cb_synth_arch_t arch;    /* default (0) llama */
    int n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, n_ctx;
    int head_dim;            /* 0: n_embd / n_head (gemma3 has its own, written as attention.key_length) */
    int window;              /* gemma3: attention.sliding_window (0: gemma3 gets 32) */
    float rope_base, rms_eps;
    bool tied;               /* no output.weight: the LM head is token_embd (SmolLM2) */
} cb_synth_shape_t;

/* Tensor kinds. Global tensors use layer -1. */
typedef enum {
    CB_SYNTH_TOKEN_EMBD = 0, CB_SYNTH_OUTPUT_NORM, CB_SYNTH_OUTPUT,
    CB_SYNTH_ATTN_NORM, CB_SYNTH_ATTN_Q, CB_SYNTH_ATTN_K, CB_SYNTH_ATTN_V, CB_SYNTH_ATTN_OUTPUT,
    CB_SYNTH_FFN_NORM, CB_SYNTH_FFN_GATE, CB_SYNTH_FFN_UP, CB_SYNTH_FFN_DOWN,
    CB_SYNTH_ATTN_Q_BIAS, CB_SYNTH_ATTN_K_BIAS, CB_SYNTH_ATTN_V_BIAS,   /* qwen2: 0.5u */
    CB_SYNTH_ATTN_Q_NORM, CB_SYNTH_ATTN_K_NORM,                        /* qwen3: [head_dim], 1 + 0.1u */
    CB_SYNTH_ROPE_FREQS,                                               /* llama3, global: [head_dim/2], 1 + 3.5(u+1) */
    CB_SYNTH_POST_ATTN_NORM, CB_SYNTH_POST_FFN_NORM                    /* gemma3: [n_embd], 1 + 0.1u */
} cb_synth_kind_t;

/* "llama" | "llama3" | "qwen2" | "qwen3" | "mistral" | "gemma3" -> *out; false for anything else. */
bool cb_synth_arch_parse(const char *name, cb_synth_arch_t *out);

/* Named shapes: "smollm2-135m" (30 x 576, 9/3 heads, ffn 1536, vocab 49152, tied, base 1e5),
 * "llama3-8b" (32 x 4096, 32/8 heads, ffn 14336, vocab 128256, base 5e5), "mistral-7b" (32 x 4096,
 * 32/8 heads, ffn 14336, vocab 32000, base 1e6). False for an unknown name. */
bool cb_synth_shape_named(const char *name, cb_synth_shape_t *out);
/* Checks a shape for dtype (divisibility, ranges). False with a message in err. */
bool cb_synth_shape_check(const cb_synth_shape_t *s, cb_synth_dtype_t dtype, char *err, size_t errlen);

/* The generator's tensor id of (layer, kind): 0..2 for the global tensors (3 for rope_freqs), 16 + 16*layer +
 * kind for the llama block's, 2^24 + 16*layer + (kind - ATTN_Q_BIAS) for the other architectures' (so the llama
 * tensors of every architecture have the same values). */
uint32_t cb_synth_tensor_id(int layer, cb_synth_kind_t kind);
/* The matrix scale of a kind (0 for norm kinds, whose values are 1 + 0.1u). */
float cb_synth_scale(const cb_synth_shape_t *s, cb_synth_kind_t kind);
/* u(seed, tensor_id, i) in [-1, 1): a multiple of 2^-23. */
float cb_synth_u(uint64_t seed, uint32_t tensor_id, uint64_t i);
/* out[j] = the f32 value (before any storage rounding) of elements [first, first+n) of a tensor,
 * row-major [rows = out][cols = in] as GGUF stores it. */
void cb_synth_fill(const cb_synth_shape_t *s, uint64_t seed, int layer, cb_synth_kind_t kind, uint64_t first,
                   size_t n, float *out);
/* Rows and columns of a tensor kind (vectors: 1 x their length). */
void cb_synth_dims(const cb_synth_shape_t *s, cb_synth_kind_t kind, int *rows, int *cols);

/* Writes a GGUF v3 file (via a temporary name, then rename). Returns 0, or -1 with a message. */
int cb_synth_write(const char *path, const cb_synth_shape_t *s, cb_synth_dtype_t dtype, uint64_t seed, char *err,
                   size_t errlen);
/* Builds the same bytes in memory: returns a malloc'd buffer (caller frees) and its length, for
 * cb_gguf_open_mem; NULL with a message on failure (e.g. out of memory). */
void *cb_synth_build(const cb_synth_shape_t *s, cb_synth_dtype_t dtype, uint64_t seed, size_t *len, char *err,
                     size_t errlen);
/* Parses "bf16" | "q4_1" | "f32" | "q4_k_m". */
bool cb_synth_dtype_parse(const char *name, cb_synth_dtype_t *out);
#endif
