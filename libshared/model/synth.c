/* synth.c: deterministic synthetic llama models and a small streaming GGUF v3 writer (see synth.h).
 * Tensors are generated and written in pieces, so memory stays small even for 8B-class shapes when
 * writing a file. */
#include "model/synth.h"
#include "base/alloc.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/err.h"
#include "base/utf8.h"
#include "format/gguf.h"
#include "format/quant.h"

#define SYN_ALIGN 32
#define SYN_PIECE 65536 /* elements generated per step (a multiple of every block size) */

/* ---------------------------------------------------------------- shapes */

bool cb_synth_shape_named(const char *name, cb_synth_shape_t *out) {
    cb_synth_shape_t s;
    memset(&s, 0, sizeof s);
    s.rms_eps = 1e-5f;
    if (!name) return false;
    if (!strcmp(name, "smollm2-135m")) {
        s.n_layer = 30, s.n_embd = 576, s.n_head = 9, s.n_head_kv = 3, s.n_ff = 1536, s.n_vocab = 49152;
        s.n_ctx = 8192, s.rope_base = 100000.0f, s.tied = true;
    } else if (!strcmp(name, "llama3-8b")) {
        s.n_layer = 32, s.n_embd = 4096, s.n_head = 32, s.n_head_kv = 8, s.n_ff = 14336, s.n_vocab = 128256;
        s.n_ctx = 8192, s.rope_base = 500000.0f;
    } else if (!strcmp(name, "mistral-7b")) {
        s.n_layer = 32, s.n_embd = 4096, s.n_head = 32, s.n_head_kv = 8, s.n_ff = 14336, s.n_vocab = 32000;
        s.n_ctx = 32768, s.rope_base = 1000000.0f;
    } else {
        return false;
    }
    snprintf(s.name, sizeof s.name, "%s", name);
    *out = s;
    return true;
}

#define SYN_N_SPECIAL 3
#define SYN_N_BASE (SYN_N_SPECIAL + 256)
#define SPM_N_SPECIAL 5 /* <unk>, <s>, </s>, <start_of_turn>, <end_of_turn> */
#define SPM_N_BASE (SPM_N_SPECIAL + 256)

static int syn_head_dim(const cb_synth_shape_t *s) { return s->head_dim ? s->head_dim : s->n_embd / s->n_head; }
/* SentencePiece vocabularies (tokenizer.ggml.model "llama") for mistral and gemma3, GPT-2 BPE for the rest. */
static bool syn_spm(const cb_synth_shape_t *s) { return s->arch == CB_SYNTH_MISTRAL || s->arch == CB_SYNTH_GEMMA3; }

bool cb_synth_shape_check(const cb_synth_shape_t *s, cb_synth_dtype_t dtype, char *err, size_t errlen) {
    if (!s) {
        cb_set_err(err, errlen, "synth: no shape");
        return false;
    }
    if (s->n_layer < 1 || s->n_layer > 1024 || s->n_embd < 2 || s->n_embd > 65536 || s->n_head < 1 ||
        s->n_head > 1024 || s->n_head_kv < 1 || s->n_ff < 1 || s->n_ff > 1 << 20 || s->n_ctx < 1 ||
        s->n_vocab > 1 << 22) {
        cb_set_err(err, errlen,
                   "synth: dimension out of range (layers %d, dim %d, heads %d/%d, ffn %d, vocab %d, ctx %d)",
                   s->n_layer, s->n_embd, s->n_head, s->n_head_kv, s->n_ff, s->n_vocab, s->n_ctx);
        return false;
    }
    if (s->n_vocab < (syn_spm(s) ? SPM_N_BASE : SYN_N_BASE)) {
        cb_set_err(err, errlen, "synth: vocab %d is smaller than the %d special and byte tokens", s->n_vocab,
                   syn_spm(s) ? SPM_N_BASE : SYN_N_BASE);
        return false;
    }
    if (s->head_dim ? s->head_dim < 2 || s->head_dim > 1024 || s->head_dim % 2
                    : s->n_embd % s->n_head || (s->n_embd / s->n_head) % 2) {
        cb_set_err(err, errlen, "synth: dim %d (head_dim %d) must split into %d heads of an even size", s->n_embd,
                   s->head_dim, s->n_head);
        return false;
    }
    if (s->window < 0 || (s->window && s->arch != CB_SYNTH_GEMMA3 && s->arch != CB_SYNTH_MISTRAL)) {
        cb_set_err(err, errlen, "synth: a window is for the mistral and gemma3 architectures");
        return false;
    }
    if (s->n_head % s->n_head_kv) {
        cb_set_err(err, errlen, "synth: heads %d is not a multiple of kv heads %d", s->n_head, s->n_head_kv);
        return false;
    }
    const int qd = s->n_head * syn_head_dim(s);
    if (dtype == CB_SYNTH_Q4_1 && (s->n_embd % 32 || s->n_ff % 32 || qd % 32)) {
        cb_set_err(err, errlen, "synth: q4_1 needs dim, ffn and heads x head_dim divisible by 32 (dim %d, ffn %d)",
                   s->n_embd, s->n_ff);
        return false;
    }
    if (dtype == CB_SYNTH_QMIX && (s->n_embd % 256 || s->n_ff % 256 || qd % 256)) {
        cb_set_err(err, errlen, "synth: q4_k_m needs dim, ffn and heads x head_dim divisible by 256 (dim %d, ffn %d)",
                   s->n_embd, s->n_ff);
        return false;
    }
    if (!(s->rope_base > 1.0f) || !(s->rms_eps > 0.0f) || s->rms_eps > 1.0f) {
        cb_set_err(err, errlen, "synth: rope base must be > 1 and eps in (0, 1]");
        return false;
    }
    if (dtype != CB_SYNTH_BF16 && dtype != CB_SYNTH_Q4_1 && dtype != CB_SYNTH_F32 && dtype != CB_SYNTH_QMIX) {
        cb_set_err(err, errlen, "synth: unknown dtype %d", (int)dtype);
        return false;
    }
    return true;
}

bool cb_synth_arch_parse(const char *name, cb_synth_arch_t *out) {
    static const char *names[] = {"llama", "llama3", "qwen2", "qwen3", "mistral", "gemma3"};
    for (size_t i = 0; name && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i])) {
            *out = (cb_synth_arch_t)i;
            return true;
        }
    return false;
}

bool cb_synth_dtype_parse(const char *name, cb_synth_dtype_t *out) {
    if (!name) return false;
    if (!strcmp(name, "bf16")) *out = CB_SYNTH_BF16;
    else if (!strcmp(name, "q4_1")) *out = CB_SYNTH_Q4_1;
    else if (!strcmp(name, "f32")) *out = CB_SYNTH_F32;
    else if (!strcmp(name, "q4_k_m")) *out = CB_SYNTH_QMIX;
    else return false;
    return true;
}

/* ---------------------------------------------------------------- generator */

/* Must stay bit-identical to cb_synth_mix in kernels/cuda/cb_cuda_impl.h. */
static inline uint64_t syn_mix(uint64_t seed, uint32_t tensor_id, uint64_t i) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + (uint64_t)tensor_id * 0xD1B54A32D192ED03ull +
                 i * 0x94D049BB133111EBull + 0x2545F4914F6CDD1Dull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

float cb_synth_u(uint64_t seed, uint32_t tensor_id, uint64_t i) {
    int32_t v = (int32_t)(syn_mix(seed, tensor_id, i) >> 40) - 8388608; /* [-2^23, 2^23) */
    return (float)v * (1.0f / 8388608.0f);                               /* exact */
}

uint32_t cb_synth_tensor_id(int layer, cb_synth_kind_t kind) {
    if (kind <= CB_SYNTH_OUTPUT) return (uint32_t)kind;
    if (kind == CB_SYNTH_ROPE_FREQS) return 3u;
    if (kind >= CB_SYNTH_POST_ATTN_NORM) return (1u << 24) + 16u * (uint32_t)layer + 5u + (uint32_t)(kind - CB_SYNTH_POST_ATTN_NORM);
    if (kind >= CB_SYNTH_ATTN_Q_BIAS) return (1u << 24) + 16u * (uint32_t)layer + (uint32_t)(kind - CB_SYNTH_ATTN_Q_BIAS);
    return 16u + 16u * (uint32_t)layer + (uint32_t)kind;
}

/* Norm weights: 1 + 0.1u. */
static bool syn_is_norm(cb_synth_kind_t k) {
    return k == CB_SYNTH_OUTPUT_NORM || k == CB_SYNTH_ATTN_NORM || k == CB_SYNTH_FFN_NORM || k == CB_SYNTH_ATTN_Q_NORM ||
           k == CB_SYNTH_ATTN_K_NORM || k == CB_SYNTH_POST_ATTN_NORM || k == CB_SYNTH_POST_FFN_NORM;
}

/* One-dimensional tensors (always stored F32). */
static bool syn_is_vec(cb_synth_kind_t k) {
    return syn_is_norm(k) || k == CB_SYNTH_ATTN_Q_BIAS || k == CB_SYNTH_ATTN_K_BIAS || k == CB_SYNTH_ATTN_V_BIAS ||
           k == CB_SYNTH_ROPE_FREQS;
}

float cb_synth_scale(const cb_synth_shape_t *s, cb_synth_kind_t kind) {
    const float E = (float)s->n_embd, QD = (float)(s->n_head * syn_head_dim(s)), F = (float)s->n_ff;
    switch (kind) {
    case CB_SYNTH_TOKEN_EMBD: case CB_SYNTH_OUTPUT: return 4.0f * sqrtf(3.0f / E);
    case CB_SYNTH_ATTN_Q: case CB_SYNTH_ATTN_K: return 3.0f / sqrtf(E);
    case CB_SYNTH_ATTN_V: case CB_SYNTH_FFN_GATE: case CB_SYNTH_FFN_UP: return sqrtf(3.0f / E);
    case CB_SYNTH_ATTN_OUTPUT: return sqrtf(0.75f / QD);
    case CB_SYNTH_FFN_DOWN: return sqrtf(0.75f / F);
    default: return 0.0f;
    }
}

void cb_synth_dims(const cb_synth_shape_t *s, cb_synth_kind_t kind, int *rows, int *cols) {
    const int E = s->n_embd, hd = syn_head_dim(s), QD = s->n_head * hd, KVD = s->n_head_kv * hd, F = s->n_ff;
    int r = 1, c = E;
    switch (kind) {
    case CB_SYNTH_TOKEN_EMBD: case CB_SYNTH_OUTPUT: r = s->n_vocab; break;
    case CB_SYNTH_ATTN_Q: r = QD; break;
    case CB_SYNTH_ATTN_OUTPUT: r = E, c = QD; break;
    case CB_SYNTH_ATTN_K: case CB_SYNTH_ATTN_V: r = KVD; break;
    case CB_SYNTH_FFN_GATE: case CB_SYNTH_FFN_UP: r = F; break;
    case CB_SYNTH_FFN_DOWN: r = E, c = F; break;
    case CB_SYNTH_ATTN_Q_BIAS: c = QD; break;
    case CB_SYNTH_ATTN_K_BIAS: case CB_SYNTH_ATTN_V_BIAS: c = KVD; break;
    case CB_SYNTH_ATTN_Q_NORM: case CB_SYNTH_ATTN_K_NORM: c = hd; break;
    case CB_SYNTH_ROPE_FREQS: c = hd / 2; break;
    default: break; /* norms: 1 x E */
    }
    *rows = r;
    *cols = c;
}

void cb_synth_fill(const cb_synth_shape_t *s, uint64_t seed, int layer, cb_synth_kind_t kind, uint64_t first,
                   size_t n, float *out) {
    uint32_t id = cb_synth_tensor_id(layer, kind);
    if (syn_is_norm(kind)) {
        for (size_t j = 0; j < n; j++) {
            float t = 0.1f * cb_synth_u(seed, id, first + j);
            out[j] = 1.0f + t;
        }
        return;
    }
    if (kind == CB_SYNTH_ROPE_FREQS) {
        for (size_t j = 0; j < n; j++) out[j] = 1.0f + 3.5f * (cb_synth_u(seed, id, first + j) + 1.0f);
        return;
    }
    if (kind >= CB_SYNTH_ATTN_Q_BIAS && kind <= CB_SYNTH_ATTN_V_BIAS) {
        for (size_t j = 0; j < n; j++) out[j] = 0.5f * cb_synth_u(seed, id, first + j);
        return;
    }
    const float sc = cb_synth_scale(s, kind);
    for (size_t j = 0; j < n; j++) out[j] = sc * cb_synth_u(seed, id, first + j);
}

/* ---------------------------------------------------------------- quantizers (for q4_1 files) */

static void syn_put_f16(uint8_t *p, float f) {
    uint16_t h = cb_f32_to_f16(f);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

/* Q4_1 block (REFERENCE §3): d = (max - min) / 15, m = min, nibble j | nibble j+16 << 4. */
static void syn_q4_1(const float *x, uint8_t *blk) {
    float mn = x[0], mx = x[0];
    for (int j = 1; j < 32; j++) {
        if (x[j] < mn) mn = x[j];
        if (x[j] > mx) mx = x[j];
    }
    float d = (mx - mn) / 15.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    syn_put_f16(blk, d);
    syn_put_f16(blk + 2, mn);
    for (int j = 0; j < 16; j++) {
        int a = (int)((x[j] - mn) * id + 0.5f), b = (int)((x[j + 16] - mn) * id + 0.5f);
        a = a > 15 ? 15 : a;
        b = b > 15 ? 15 : b;
        blk[4 + j] = (uint8_t)(a | (b << 4));
    }
}

/* Q8_0 block: d = max|x| / 127, q = round(x / d). */
static void syn_q8_0(const float *x, uint8_t *blk) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    syn_put_f16(blk, d);
    for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t)(int8_t)lroundf(x[j] * id);
}

/* ---------------------------------------------------------------- GGUF writer */

typedef struct {
    FILE *f;            /* file sink, or NULL for memory */
    uint8_t *buf;       /* memory sink */
    size_t len, cap;
    uint64_t pos;       /* bytes written so far */
    bool failed;
} syn_w_t;

static void w_bytes(syn_w_t *w, const void *p, size_t n) {
    if (w->failed || !n) return;
    if (w->f) {
        if (fwrite(p, 1, n, w->f) != n) w->failed = true;
    } else {
        if (w->len + n > w->cap) {
            size_t cap = w->cap ? w->cap : 1 << 20;
            while (cap < w->len + n) cap *= 2;
            uint8_t *nb = cb_realloc(w->buf, cap);
            if (!nb) {
                w->failed = true;
                return;
            }
            w->buf = nb;
            w->cap = cap;
        }
        memcpy(w->buf + w->len, p, n);
        w->len += n;
    }
    w->pos += n;
}
static void w_u32(syn_w_t *w, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    w_bytes(w, b, 4);
}
static void w_u64(syn_w_t *w, uint64_t v) {
    w_u32(w, (uint32_t)v);
    w_u32(w, (uint32_t)(v >> 32));
}
static void w_f32(syn_w_t *w, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    w_u32(w, u);
}
static void w_str(syn_w_t *w, const char *s, size_t n) {
    w_u64(w, n);
    w_bytes(w, s, n);
}
static void w_pad(syn_w_t *w) {
    static const uint8_t zeros[SYN_ALIGN];
    size_t r = (size_t)(w->pos % SYN_ALIGN);
    if (r) w_bytes(w, zeros, SYN_ALIGN - r);
}
/* metadata key + typed value */
static void kv_str(syn_w_t *w, const char *k, const char *v) {
    w_str(w, k, strlen(k));
    w_u32(w, 8);
    w_str(w, v, strlen(v));
}
static void kv_u32(syn_w_t *w, const char *k, uint32_t v) {
    w_str(w, k, strlen(k));
    w_u32(w, 4);
    w_u32(w, v);
}
static void kv_f32(syn_w_t *w, const char *k, float v) {
    w_str(w, k, strlen(k));
    w_u32(w, 6);
    w_f32(w, v);
}
static void kv_bool(syn_w_t *w, const char *k, bool v) {
    w_str(w, k, strlen(k));
    w_u32(w, 7);
    uint8_t b = v ? 1 : 0;
    w_bytes(w, &b, 1);
}

/* ---------------------------------------------------------------- vocabulary */

/* GPT-2 byte-to-unicode: printable bytes map to themselves, the other 68 to U+0100.. in order. */
static int syn_byte_cp(int b) {
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) return b;
    int k = 0;
    for (int c = 0; c < b; c++)
        if (!((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF))) k++;
    return 256 + k;
}

/* Merges as "left right" in the byte-level alphabet; "G" stands for the space symbol U+0120. */
static const char *const SYN_MERGES[] = {
    "G t", "G a", "G s", "G w", "G c", "G b", "G o", "G i", "G m", "G f", "G p", "G d", "G h", "G l", "G r",
    "G e", "G n", "G g", "G u", "G y", "t h", "h e", "i n", "e r", "a n", "r e", "o n", "a t", "e n", "n d",
    "t i", "e s", "o r", "t e", "o f", "e d", "i s", "i t", "a l", "a r", "s t", "t o", "n t", "n g", "s e",
    "h a", "a s", "o u", "i o", "l e", "v e", "c o", "m e", "d e", "h i", "r i", "r o", "i c", "n e", "e a",
    "Gt he", "Ga nd", "Go f", "Gt o", "Gi n", "Gi s", "Gi t",
};
#define SYN_N_MERGES (sizeof SYN_MERGES / sizeof SYN_MERGES[0])

/* Expands "G" to the UTF-8 of U+0120 ("Ġ"). out has room for 2 * strlen(in) + 1 bytes. */
static size_t syn_expand(const char *in, char *out) {
    size_t n = 0;
    for (; *in; in++) {
        if (*in == 'G') n += cb_utf8_encode(0x120, (unsigned char *)out + n);
        else out[n++] = *in;
    }
    out[n] = 0;
    return n;
}

static const char SYN_TEMPLATE[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

static void syn_write_vocab(syn_w_t *w, const cb_synth_shape_t *s) {
    int n_merge = (int)SYN_N_MERGES;
    if (n_merge > s->n_vocab - SYN_N_BASE) n_merge = s->n_vocab - SYN_N_BASE;
    static const char *const special[SYN_N_SPECIAL] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    char buf[64], tmp[64];
    /* tokens */
    w_str(w, "tokenizer.ggml.tokens", strlen("tokenizer.ggml.tokens"));
    w_u32(w, 9);
    w_u32(w, 8);
    w_u64(w, (uint64_t)s->n_vocab);
    for (int i = 0; i < s->n_vocab; i++) {
        size_t n;
        if (i < SYN_N_SPECIAL) {
            n = strlen(special[i]);
            memcpy(buf, special[i], n);
        } else if (i < SYN_N_BASE) {
            n = cb_utf8_encode((uint32_t)syn_byte_cp(i - SYN_N_SPECIAL), (unsigned char *)buf);
        } else if (i < SYN_N_BASE + n_merge) {
            /* the merged token: the merge text without its separating space (split after position 0) */
            size_t m = syn_expand(SYN_MERGES[i - SYN_N_BASE], tmp);
            const char *sp = memchr(tmp + 1, ' ', m - 1);
            size_t a = (size_t)(sp - tmp);
            memcpy(buf, tmp, a);
            memcpy(buf + a, sp + 1, m - a - 1);
            n = m - 1;
        } else {
            n = (size_t)snprintf(buf, sizeof buf, "<syn%d>", i);
        }
        w_str(w, buf, n);
    }
    /* token types: control for the specials, normal for the rest */
    w_str(w, "tokenizer.ggml.token_type", strlen("tokenizer.ggml.token_type"));
    w_u32(w, 9);
    w_u32(w, 5);
    w_u64(w, (uint64_t)s->n_vocab);
    for (int i = 0; i < s->n_vocab; i++) w_u32(w, i < SYN_N_SPECIAL ? 3u : 1u);
    /* merges */
    w_str(w, "tokenizer.ggml.merges", strlen("tokenizer.ggml.merges"));
    w_u32(w, 9);
    w_u32(w, 8);
    w_u64(w, (uint64_t)n_merge);
    for (int i = 0; i < n_merge; i++) {
        size_t m = syn_expand(SYN_MERGES[i], tmp);
        w_str(w, tmp, m);
    }
}

static const char SYN_TEMPLATE_MISTRAL[] =
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}";
static const char SYN_TEMPLATE_GEMMA[] =
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' + "
    "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

/* A SentencePiece vocabulary: the specials, the byte tokens, the merges' pieces with "▁" for the space
 * (score -rank), fillers (score -1e4). */
static void syn_write_vocab_spm(syn_w_t *w, const cb_synth_shape_t *s) {
    int n_piece = (int)SYN_N_MERGES;
    if (n_piece > s->n_vocab - SPM_N_BASE) n_piece = s->n_vocab - SPM_N_BASE;
    static const char *const special[SPM_N_SPECIAL] = {"<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"};
    char buf[64];
    w_str(w, "tokenizer.ggml.tokens", strlen("tokenizer.ggml.tokens"));
    w_u32(w, 9);
    w_u32(w, 8);
    w_u64(w, (uint64_t)s->n_vocab);
    for (int i = 0; i < s->n_vocab; i++) {
        size_t n = 0;
        if (i < SPM_N_SPECIAL) {
            n = (size_t)snprintf(buf, sizeof buf, "%s", special[i]);
        } else if (i < SPM_N_BASE) {
            n = (size_t)snprintf(buf, sizeof buf, "<0x%02X>", i - SPM_N_SPECIAL);
        } else if (i < SPM_N_BASE + n_piece) {
            for (const char *c = SYN_MERGES[i - SPM_N_BASE]; *c; c++) {
                if (*c == ' ') continue;
                if (*c == 'G') n += cb_utf8_encode(0x2581, (unsigned char *)buf + n); /* ▁ */
                else buf[n++] = *c;
            }
        } else {
            n = (size_t)snprintf(buf, sizeof buf, "<syn%d>", i);
        }
        w_str(w, buf, n);
    }
    w_str(w, "tokenizer.ggml.scores", strlen("tokenizer.ggml.scores"));
    w_u32(w, 9);
    w_u32(w, 6);
    w_u64(w, (uint64_t)s->n_vocab);
    for (int i = 0; i < s->n_vocab; i++)
        w_f32(w, i >= SPM_N_BASE && i < SPM_N_BASE + n_piece ? -(float)(i - SPM_N_BASE) : i < SPM_N_BASE ? 0.0f : -1e4f);
    w_str(w, "tokenizer.ggml.token_type", strlen("tokenizer.ggml.token_type"));
    w_u32(w, 9);
    w_u32(w, 5);
    w_u64(w, (uint64_t)s->n_vocab);
    for (int i = 0; i < s->n_vocab; i++) w_u32(w, i == 0 ? 2u : i < SPM_N_SPECIAL ? 3u : i < SPM_N_BASE ? 6u : 1u);
}

/* ---------------------------------------------------------------- tensors */

typedef struct {
    char name[64];
    int layer;
    cb_synth_kind_t kind;
    uint32_t type;      /* ggml type id */
    int rows, cols;
    uint64_t bytes, offset;
} syn_tensor_t;

static uint32_t syn_type(cb_synth_dtype_t dt, cb_synth_kind_t kind) {
    if (syn_is_vec(kind) || dt == CB_SYNTH_F32) return CB_TYPE_F32;
    if (dt == CB_SYNTH_BF16) return CB_TYPE_BF16;
    if (dt == CB_SYNTH_Q4_1) return (kind == CB_SYNTH_TOKEN_EMBD || kind == CB_SYNTH_OUTPUT) ? CB_TYPE_Q8_0 : CB_TYPE_Q4_1;
    switch (kind) { /* q4_k_m */
    case CB_SYNTH_ATTN_Q: case CB_SYNTH_ATTN_K: return CB_TYPE_Q5_0;
    case CB_SYNTH_ATTN_V: case CB_SYNTH_TOKEN_EMBD: return CB_TYPE_Q8_0;
    case CB_SYNTH_FFN_DOWN: case CB_SYNTH_OUTPUT: return CB_TYPE_Q6_K;
    default: return CB_TYPE_Q4_K;
    }
}

static uint64_t syn_bytes(uint32_t type, uint64_t n) {
    return n / cb_type_block_elems(type) * cb_type_block_bytes(type);
}

static int syn_list(const cb_synth_shape_t *s, cb_synth_dtype_t dt, syn_tensor_t *t) {
    static const struct { cb_synth_kind_t k; const char *n; } per_layer[] = {
        {CB_SYNTH_ATTN_NORM, "attn_norm"}, {CB_SYNTH_ATTN_Q, "attn_q"},       {CB_SYNTH_ATTN_K, "attn_k"},
        {CB_SYNTH_ATTN_V, "attn_v"},       {CB_SYNTH_ATTN_OUTPUT, "attn_output"}, {CB_SYNTH_FFN_NORM, "ffn_norm"},
        {CB_SYNTH_FFN_GATE, "ffn_gate"},   {CB_SYNTH_FFN_UP, "ffn_up"},       {CB_SYNTH_FFN_DOWN, "ffn_down"},
    };
    int n = 0;
#define ADD(nm, ly, kd) do { snprintf(t[n].name, sizeof t[n].name, "%s", nm); t[n].layer = ly; t[n].kind = kd; n++; } while (0)
    static const struct { cb_synth_kind_t k; const char *n; } qwen2[] = {
        {CB_SYNTH_ATTN_Q_BIAS, "attn_q.bias"}, {CB_SYNTH_ATTN_K_BIAS, "attn_k.bias"}, {CB_SYNTH_ATTN_V_BIAS, "attn_v.bias"},
    }, qwen3[] = {
        {CB_SYNTH_ATTN_Q_NORM, "attn_q_norm.weight"}, {CB_SYNTH_ATTN_K_NORM, "attn_k_norm.weight"},
    }, gemma3[] = {
        {CB_SYNTH_POST_ATTN_NORM, "post_attention_norm.weight"}, {CB_SYNTH_POST_FFN_NORM, "post_ffw_norm.weight"},
    };
    const bool qk_norm = s->arch == CB_SYNTH_QWEN3 || s->arch == CB_SYNTH_GEMMA3;
    ADD("token_embd.weight", -1, CB_SYNTH_TOKEN_EMBD);
    ADD("output_norm.weight", -1, CB_SYNTH_OUTPUT_NORM);
    if (!s->tied) ADD("output.weight", -1, CB_SYNTH_OUTPUT);
    if (s->arch == CB_SYNTH_LLAMA3) ADD("rope_freqs.weight", -1, CB_SYNTH_ROPE_FREQS);
    for (int l = 0; l < s->n_layer; l++) {
        char nm[64];
        for (size_t k = 0; k < sizeof per_layer / sizeof per_layer[0]; k++) {
            snprintf(nm, sizeof nm, "blk.%d.%s.weight", l, per_layer[k].n);
            ADD(nm, l, per_layer[k].k);
        }
        for (size_t k = 0; s->arch == CB_SYNTH_QWEN2 && k < 3; k++) {
            snprintf(nm, sizeof nm, "blk.%d.%s", l, qwen2[k].n);
            ADD(nm, l, qwen2[k].k);
        }
        for (size_t k = 0; qk_norm && k < 2; k++) {
            snprintf(nm, sizeof nm, "blk.%d.%s", l, qwen3[k].n);
            ADD(nm, l, qwen3[k].k);
        }
        for (size_t k = 0; s->arch == CB_SYNTH_GEMMA3 && k < 2; k++) {
            snprintf(nm, sizeof nm, "blk.%d.%s", l, gemma3[k].n);
            ADD(nm, l, gemma3[k].k);
        }
    }
#undef ADD
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        cb_synth_dims(s, t[i].kind, &t[i].rows, &t[i].cols);
        t[i].type = syn_type(dt, t[i].kind);
        t[i].bytes = syn_bytes(t[i].type, (uint64_t)t[i].rows * (uint64_t)t[i].cols);
        t[i].offset = off;
        off += (t[i].bytes + SYN_ALIGN - 1) / SYN_ALIGN * SYN_ALIGN;
    }
    return n;
}

static bool syn_write_data(syn_w_t *w, const cb_synth_shape_t *s, uint64_t seed, const syn_tensor_t *t) {
    float *x = cb_malloc(sizeof(float) * SYN_PIECE);
    uint8_t *out = cb_malloc((size_t)SYN_PIECE * 4);
    if (!x || !out) {
        free(x);
        free(out);
        return false;
    }
    uint64_t total = (uint64_t)t->rows * (uint64_t)t->cols;
    for (uint64_t first = 0; first < total && !w->failed; first += SYN_PIECE) {
        size_t n = total - first < SYN_PIECE ? (size_t)(total - first) : SYN_PIECE;
        cb_synth_fill(s, seed, t->layer, t->kind, first, n, x);
        size_t nb = 0;
        switch (t->type) {
        case CB_TYPE_F32:
            for (size_t j = 0; j < n; j++) {
                uint32_t u;
                memcpy(&u, &x[j], 4);
                out[4 * j] = (uint8_t)u, out[4 * j + 1] = (uint8_t)(u >> 8);
                out[4 * j + 2] = (uint8_t)(u >> 16), out[4 * j + 3] = (uint8_t)(u >> 24);
            }
            nb = n * 4;
            break;
        case CB_TYPE_BF16:
            for (size_t j = 0; j < n; j++) {
                uint16_t b = cb_f32_to_bf16(x[j]);
                out[2 * j] = (uint8_t)b, out[2 * j + 1] = (uint8_t)(b >> 8);
            }
            nb = n * 2;
            break;
        case CB_TYPE_Q4_1:
            for (size_t j = 0; j < n; j += 32) syn_q4_1(x + j, out + j / 32 * 20);
            nb = n / 32 * 20;
            break;
        case CB_TYPE_Q8_0:
            for (size_t j = 0; j < n; j += 32) syn_q8_0(x + j, out + j / 32 * 34);
            nb = n / 32 * 34;
            break;
        default: /* Q5_0, Q4_K, Q6_K: n is a multiple of 256 (a piece, or a whole tensor of such rows) */
            if (!cb_quant(t->type, x, out, n)) w->failed = true;
            nb = (size_t)syn_bytes(t->type, n);
            break;
        }
        w_bytes(w, out, nb);
    }
    free(x);
    free(out);
    w_pad(w);
    return !w->failed;
}

static bool syn_emit(syn_w_t *w, const cb_synth_shape_t *s, cb_synth_dtype_t dt, uint64_t seed, char *err,
                     size_t errlen) {
    int max_t = 4 + 14 * s->n_layer;
    syn_tensor_t *t = cb_calloc((size_t)max_t, sizeof *t);
    if (!t) {
        cb_set_err(err, errlen, "synth: out of memory");
        return false;
    }
    int nt = syn_list(s, dt, t);
    const int hd = syn_head_dim(s);
    const bool spm = syn_spm(s);
    const int window = s->window ? s->window : s->arch == CB_SYNTH_GEMMA3 ? 32 : 0;
    const uint32_t n_kv = 25 + (s->head_dim ? 2 : 0) + (window ? 1 : 0) + (spm ? 1 : 0);
    /* header */
    w_bytes(w, "GGUF", 4);
    w_u32(w, 3);
    w_u64(w, (uint64_t)nt);
    w_u64(w, n_kv);
    /* metadata (n_kv entries) */
    char name[64];
    snprintf(name, sizeof name, "synthetic-%s", s->name[0] ? s->name : "custom");
    const char *A = s->arch == CB_SYNTH_QWEN2    ? "qwen2"
                    : s->arch == CB_SYNTH_QWEN3  ? "qwen3"
                    : s->arch == CB_SYNTH_GEMMA3 ? "gemma3"
                                                 : "llama";
    char kbuf[96];
#define K(suffix) (snprintf(kbuf, sizeof kbuf, "%s." suffix, A), kbuf)
    kv_str(w, "general.architecture", A);                                                  /* 1 */
    kv_str(w, "general.name", name);                                                     /* 2 */
    kv_u32(w, "general.alignment", SYN_ALIGN);                                           /* 3 */
    kv_u32(w, "general.file_type", dt == CB_SYNTH_F32 ? 0u : dt == CB_SYNTH_BF16 ? 32u : dt == CB_SYNTH_Q4_1 ? 3u : 15u);
                                                                                         /* 4 */
    kv_u32(w, "general.quantization_version", 2);                                        /* 5 */
    kv_u32(w, K("context_length"), (uint32_t)s->n_ctx);                               /* 6 */
    kv_u32(w, K("embedding_length"), (uint32_t)s->n_embd);                            /* 7 */
    kv_u32(w, K("block_count"), (uint32_t)s->n_layer);                                /* 8 */
    kv_u32(w, K("feed_forward_length"), (uint32_t)s->n_ff);                           /* 9 */
    kv_u32(w, K("attention.head_count"), (uint32_t)s->n_head);                        /* 10 */
    kv_u32(w, K("attention.head_count_kv"), (uint32_t)s->n_head_kv);                  /* 11 */
    kv_f32(w, K("attention.layer_norm_rms_epsilon"), s->rms_eps);                     /* 12 */
    kv_f32(w, K("rope.freq_base"), s->rope_base);                                     /* 13 */
    kv_u32(w, K("rope.dimension_count"), (uint32_t)hd);                               /* 14 */
    kv_u32(w, K("vocab_size"), (uint32_t)s->n_vocab);                                 /* 15 */
    kv_str(w, "tokenizer.ggml.model", spm ? "llama" : "gpt2");                           /* 16 */
    kv_str(w, "tokenizer.ggml.pre", spm ? "default" : "smollm");                         /* 17 */
    if (spm) syn_write_vocab_spm(w, s);                                                  /* 18, 19, 20 */
    else syn_write_vocab(w, s);
    kv_u32(w, "tokenizer.ggml.bos_token_id", 1);                                         /* 21 */
    kv_u32(w, "tokenizer.ggml.eos_token_id", 2);                                         /* 22 */
    kv_u32(w, "tokenizer.ggml.padding_token_id", spm ? 0 : 2);                           /* 23 */
    kv_bool(w, "tokenizer.ggml.add_bos_token", spm);                                     /* 24 */
    kv_str(w, "tokenizer.chat_template", s->arch == CB_SYNTH_GEMMA3    ? SYN_TEMPLATE_GEMMA
                                         : s->arch == CB_SYNTH_MISTRAL ? SYN_TEMPLATE_MISTRAL
                                                                       : SYN_TEMPLATE); /* 25 */
    if (spm) kv_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    if (s->head_dim) {
        kv_u32(w, K("attention.key_length"), (uint32_t)hd);
        kv_u32(w, K("attention.value_length"), (uint32_t)hd);
    }
    if (window) kv_u32(w, K("attention.sliding_window"), (uint32_t)window);
    /* (n_kv counts the entries above: keep it in sync when adding keys) */
#undef K
    /* tensor infos */
    for (int i = 0; i < nt; i++) {
        w_str(w, t[i].name, strlen(t[i].name));
        bool mat = !syn_is_vec(t[i].kind);
        w_u32(w, mat ? 2 : 1);
        w_u64(w, (uint64_t)t[i].cols);
        if (mat) w_u64(w, (uint64_t)t[i].rows);
        w_u32(w, t[i].type);
        w_u64(w, t[i].offset);
    }
    w_pad(w);
    for (int i = 0; i < nt && !w->failed; i++)
        if (!syn_write_data(w, s, seed, &t[i])) break;
    free(t);
    if (w->failed) {
        cb_set_err(err, errlen, "synth: %s", w->f ? strerror(errno ? errno : EIO) : "out of memory");
        return false;
    }
    return true;
}

int cb_synth_write(const char *path, const cb_synth_shape_t *s, cb_synth_dtype_t dtype, uint64_t seed, char *err,
                   size_t errlen) {
    if (!path || !cb_synth_shape_check(s, dtype, err, errlen)) {
        if (!path) cb_set_err(err, errlen, "synth: no output path");
        return -1;
    }
    size_t pl = strlen(path);
    char *tmp = cb_malloc(pl + 16);
    if (!tmp) {
        cb_set_err(err, errlen, "synth: out of memory");
        return -1;
    }
    snprintf(tmp, pl + 16, "%s.tmp%d", path, (int)getpid());
    syn_w_t w = {0};
    w.f = fopen(tmp, "wb");
    if (!w.f) {
        cb_set_err(err, errlen, "synth: cannot create %s: %s", tmp, strerror(errno));
        free(tmp);
        return -1;
    }
    bool ok = syn_emit(&w, s, dtype, seed, err, errlen);
    if (fflush(w.f) != 0 || fsync(fileno(w.f)) != 0) {
        if (ok) cb_set_err(err, errlen, "synth: writing %s: %s", tmp, strerror(errno));
        ok = false;
    }
    if (fclose(w.f) != 0 && ok) {
        cb_set_err(err, errlen, "synth: closing %s: %s", tmp, strerror(errno));
        ok = false;
    }
    if (ok && rename(tmp, path) != 0) {
        cb_set_err(err, errlen, "synth: rename %s -> %s: %s", tmp, path, strerror(errno));
        ok = false;
    }
    if (!ok) unlink(tmp);
    free(tmp);
    return ok ? 0 : -1;
}

void *cb_synth_build(const cb_synth_shape_t *s, cb_synth_dtype_t dtype, uint64_t seed, size_t *len, char *err,
                     size_t errlen) {
    if (!cb_synth_shape_check(s, dtype, err, errlen)) return NULL;
    syn_w_t w = {0};
    if (!syn_emit(&w, s, dtype, seed, err, errlen)) {
        free(w.buf);
        return NULL;
    }
    if (len) *len = w.len;
    return w.buf;
}
