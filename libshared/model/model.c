/* model.c: loads a GGUF of one of the architectures of model/arch.h into cb_model_t (see model.h).
 *
 * Owns: the GGUF reader (and so the mapping: the weight descriptors point at the stored rows there), f32
 * copies of norm vectors that are not stored as F32, the fingerprint, and the weight set the backends prepare
 * (tensor.h cb_weights_t: the list of matrices and its lock; the prepared copies are a backend's).
 * Fails (NULL + message) on anything it does not understand; never asserts on file content.
 */
#include "model/model.h"
#include "base/alloc.h"

#include <math.h>

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "base/err.h"
#include "base/log.h"
#include "format/quant.h"
#include "model/arch.h"

#define MAX_LAYERS 1024
#define MAX_DIM    (1 << 20)

struct cb_model {
    cb_gguf_t *gguf;
    cb_hparams_t hp;
    cb_layer_weights_t *layers;  /* [n_layer] */
    cb_weight_t tok_embd;        /* [n_vocab][n_embd] */
    cb_weight_t output;          /* [n_vocab][n_embd]; a copy of tok_embd's view when tied */
    const float *output_norm;    /* [n_embd] */
    cb_weights_t weights;        /* the matrices as the backends prepare them (weights.w: [7 n_layer + 1]) */
    bool weights_lock;           /* weights.lock initialised */
    const cb_arch_t *arch;       /* the architecture's table entry */
    float **norm_copies;         /* norm, bias and rope_freqs vectors converted from F16/BF16 (or unaligned) */
    int n_norm_copies;
    uint8_t fingerprint[32];
};

/* ---------------------------------------------------------------- metadata */

/* Reads "<arch>.<suffix>" as a positive int bounded by max. Returns 1 found, 0 absent, -1 bad. */
static int get_dim(const cb_gguf_t *g, const char *arch, const char *suffix, int max, int *out,
                   char *err, size_t errlen) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    if (!cb_gguf_has(g, key)) return 0;
    int64_t v;
    if (!cb_gguf_get_i64(g, key, &v) || v < 1 || v > max) {
        cb_set_err(err, errlen, "metadata %s: not an integer in 1..%d", key, max);
        return -1;
    }
    *out = (int)v;
    return 1;
}

static bool need_dim(const cb_gguf_t *g, const char *arch, const char *suffix, int max, int *out,
                     char *err, size_t errlen) {
    int r = get_dim(g, arch, suffix, max, out, err, errlen);
    if (r == 0) cb_set_err(err, errlen, "metadata %s.%s is missing", arch, suffix);
    return r == 1;
}

static int32_t opt_token_id(const cb_gguf_t *g, const char *key, int n_vocab) {
    int64_t v;
    if (!cb_gguf_get_i64(g, key, &v) || v < 0 || v >= n_vocab) return -1;
    return (int32_t)v;
}

static void add_eog(cb_hparams_t *hp, int32_t id) {
    if (id < 0) return;
    for (int i = 0; i < hp->n_eog; i++)
        if (hp->eog_ids[i] == id) return;
    if (hp->n_eog < CB_MAX_EOG) hp->eog_ids[hp->n_eog++] = id;
}

/* End-of-generation ids: eos, eot, and control tokens whose text names an end of turn or text. */
static void find_eog(const cb_gguf_t *g, cb_hparams_t *hp) {
    add_eog(hp, hp->eos_id);
    add_eog(hp, hp->eot_id);
    static const char *names[] = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>",
                                  "<|end|>", "<end_of_turn>", "</s>",
                                  /* the FIM pad, repo and file-separator tokens (Qwen2.5-Coder), as llama.cpp */
                                  "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"};
    cb_gguf_vtype_t et;
    size_t count;
    const int32_t *types = NULL;
    if (cb_gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &count) && et == CB_GGUF_I32 &&
        count == (size_t)hp->n_vocab)
        types = cb_gguf_arr_data(g, "tokenizer.ggml.token_type");
    for (int id = 0; id < hp->n_vocab; id++) {
        int32_t t = 3;
        if (types) memcpy(&t, (const uint8_t *)types + 4 * (size_t)id, 4);
        if (t != 3) continue; /* control tokens only */
        const char *s;
        size_t len;
        if (!cb_gguf_arr_str(g, "tokenizer.ggml.tokens", (size_t)id, &s, &len)) continue;
        for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
            if (len == strlen(names[k]) && memcmp(s, names[k], len) == 0) add_eog(hp, id);
    }
}

/* Sliding windows (arch.h cb_swa_t): n_swa, and for a periodic architecture the period (or a per-layer
 * pattern, read later by layer_windowed) and the windowed layers' RoPE base. */
static bool read_windows(const cb_gguf_t *g, const cb_arch_t *arch, cb_hparams_t *hp, char *err, size_t errlen) {
    const char *a = hp->arch;
    char key[160];
    snprintf(key, sizeof key, "%s.attention.sliding_window", a);
    const bool have = cb_gguf_has(g, key);
    if (arch->swa == CB_SWA_NONE && have) {
        cb_set_err(err, errlen, "metadata %s: sliding-window attention is not implemented for '%s'", key, a);
        return false;
    }
    if (!have) return true; /* gemma3 without the key: every layer global (as llama.cpp reads it) */
    if (get_dim(g, a, "attention.sliding_window", 1 << 24, &hp->n_swa, err, errlen) < 0) return false;
    if (arch->swa != CB_SWA_PERIODIC) return true;
    hp->swa_period = 6;
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", a);
    cb_gguf_vtype_t et;
    size_t count;
    if (cb_gguf_get_arr(g, key, &et, &count)) {
        if (et != CB_GGUF_BOOL || count != (size_t)hp->n_layer) {
            cb_set_err(err, errlen, "metadata %s: expected an integer period or %d booleans (one per layer)", key,
                       hp->n_layer);
            return false;
        }
        hp->swa_period = 0; /* per layer: layer_windowed reads the array */
    } else if (cb_gguf_has(g, key) && get_dim(g, a, "attention.sliding_window_pattern", MAX_LAYERS,
                                              &hp->swa_period, err, errlen) < 0) {
        return false;
    }
    hp->rope_base_swa = 10000.0f;
    snprintf(key, sizeof key, "%s.rope.freq_base_swa", a);
    if (cb_gguf_has(g, key) && (!cb_gguf_get_f32(g, key, &hp->rope_base_swa) || !(hp->rope_base_swa > 1.0f))) {
        cb_set_err(err, errlen, "metadata %s: must be a float > 1", key);
        return false;
    }
    return true;
}

/* True when layer l attends a sliding window (hp->n_swa > 0): every layer (CB_SWA_ALL), every layer but each
 * period-th, or as the per-layer pattern says. */
static bool layer_windowed(const cb_gguf_t *g, const cb_arch_t *arch, const cb_hparams_t *hp, int l) {
    if (hp->n_swa == 0) return false;
    if (arch->swa == CB_SWA_ALL) return true;
    if (hp->swa_period > 0) return l % hp->swa_period < hp->swa_period - 1;
    char key[160];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", hp->arch);
    const uint8_t *b = cb_gguf_arr_data(g, key); /* [n_layer] bools, checked by read_windows */
    return b && b[l] != 0;
}

static bool read_hparams(const cb_gguf_t *g, cb_hparams_t *hp, const cb_arch_t **arch_out, char *err,
                         size_t errlen) {
    memset(hp, 0, sizeof *hp);
    const char *s;
    size_t len;
    if (!cb_gguf_get_str(g, "general.architecture", &s, &len)) {
        cb_set_err(err, errlen, "metadata general.architecture is missing");
        return false;
    }
    const cb_arch_t *arch = cb_arch_find(s, len);
    if (!arch) {
        cb_set_err(err, errlen, "general.architecture: unsupported architecture '%.*s' (implemented: %s)",
                   (int)(len < 64 ? len : 64), s, cb_arch_names());
        return false;
    }
    *arch_out = arch;
    snprintf(hp->arch, sizeof hp->arch, "%s", arch->name);
    hp->act = arch->act;
    const char *a = hp->arch;
    if (!need_dim(g, a, "block_count", MAX_LAYERS, &hp->n_layer, err, errlen) ||
        !need_dim(g, a, "embedding_length", MAX_DIM, &hp->n_embd, err, errlen) ||
        !need_dim(g, a, "feed_forward_length", MAX_DIM, &hp->n_ff, err, errlen) ||
        !need_dim(g, a, "attention.head_count", MAX_DIM, &hp->n_head, err, errlen) ||
        !need_dim(g, a, "context_length", 1 << 24, &hp->n_ctx_train, err, errlen))
        return false;
    char key[160];
    snprintf(key, sizeof key, "%s.attention.head_count_kv", a);
    if (cb_gguf_has(g, key) && !cb_gguf_get_i64(g, key, &(int64_t){0})) {
        cb_set_err(err, errlen, "metadata %s: must be one integer (per-layer arrays are not supported)", key);
        return false;
    }
    int r = get_dim(g, a, "attention.head_count_kv", MAX_DIM, &hp->n_head_kv, err, errlen);
    if (r < 0) return false;
    if (r == 0) hp->n_head_kv = hp->n_head;
    if (hp->n_embd % hp->n_head != 0) {
        cb_set_err(err, errlen, "n_embd %d is not a multiple of head_count %d", hp->n_embd, hp->n_head);
        return false;
    }
    hp->head_dim = hp->n_embd / hp->n_head;
    int kl = hp->head_dim, vl = hp->head_dim;
    if (get_dim(g, a, "attention.key_length", MAX_DIM, &kl, err, errlen) < 0 ||
        get_dim(g, a, "attention.value_length", MAX_DIM, &vl, err, errlen) < 0)
        return false;
    if (kl != vl) {
        cb_set_err(err, errlen, "attention.key_length %d != value_length %d: not supported", kl, vl);
        return false;
    }
    hp->head_dim = kl;
    if (hp->head_dim % 2 != 0 || hp->head_dim > 1024) {
        cb_set_err(err, errlen, "head_dim %d is not supported (must be even and at most 1024)", hp->head_dim);
        return false;
    }
    if (hp->n_head % hp->n_head_kv != 0) {
        cb_set_err(err, errlen, "head_count %d is not a multiple of head_count_kv %d", hp->n_head, hp->n_head_kv);
        return false;
    }
    hp->n_rot = hp->head_dim;
    r = get_dim(g, a, "rope.dimension_count", MAX_DIM, &hp->n_rot, err, errlen);
    if (r < 0) return false;
    if (hp->n_rot != hp->head_dim) {
        cb_set_err(err, errlen, "rope.dimension_count %d != head_dim %d: partial rotary is not supported",
                   hp->n_rot, hp->head_dim);
        return false;
    }
    hp->rope_base = 10000.0f;
    snprintf(key, sizeof key, "%s.rope.freq_base", a);
    if (cb_gguf_has(g, key) && (!cb_gguf_get_f32(g, key, &hp->rope_base) || !(hp->rope_base > 1.0f))) {
        cb_set_err(err, errlen, "metadata %s: must be a float > 1", key);
        return false;
    }
    /* RoPE scaling: none, or linear (positions times 1/factor); YaRN and the rest are refused */
    hp->rope_freq_scale = 1.0f;
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    if (cb_gguf_has(g, key) && !cb_gguf_get_str(g, key, &s, &len)) {
        cb_set_err(err, errlen, "metadata %s: must be a string", key);
        return false;
    }
    if (cb_gguf_has(g, key) && !(len == 4 && memcmp(s, "none", 4) == 0)) {
        float factor = 1.0f;
        char fkey[160];
        snprintf(fkey, sizeof fkey, "%s.rope.scaling.factor", a);
        const bool linear = len == 6 && memcmp(s, "linear", 6) == 0;
        const bool have_factor = cb_gguf_get_f32(g, fkey, &factor);
        if (!(linear && have_factor && factor >= 1.0f && factor <= 1024.0f) && !(have_factor && factor == 1.0f)) {
            cb_set_err(err, errlen, "metadata %s = '%.*s'%s: not supported (none, or linear with a factor in 1..1024)",
                       key, (int)(len < 32 ? len : 32), s, have_factor ? "" : " without rope.scaling.factor");
            return false;
        }
        if (linear) hp->rope_freq_scale = 1.0f / factor;
    }
    if (!read_windows(g, arch, hp, err, errlen)) return false;
    hp->embd_scale = arch->embd_scale ? sqrtf((float)hp->n_embd) : 1.0f;
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", a);
    if (!cb_gguf_get_f32(g, key, &hp->rms_eps) || !(hp->rms_eps > 0.0f) || hp->rms_eps > 1.0f) {
        cb_set_err(err, errlen, "metadata %s is missing or not a float in (0, 1]", key);
        return false;
    }
    hp->rope_type = arch->rope; /* llama GGUFs: adjacent pairs (the converter permuted Q and K); qwen: NEOX */

    cb_gguf_vtype_t et;
    size_t count;
    if (!cb_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &count) || et != CB_GGUF_STRING || count == 0 ||
        count > (size_t)MAX_DIM * 4) {
        cb_set_err(err, errlen, "metadata tokenizer.ggml.tokens is missing or not a non-empty string array");
        return false;
    }
    hp->n_vocab = (int)count;
    int vs;
    r = get_dim(g, a, "vocab_size", 1 << 24, &vs, err, errlen);
    if (r < 0) return false;
    if (r == 1 && vs != hp->n_vocab) {
        cb_set_err(err, errlen, "%s.vocab_size %d != %d tokens in tokenizer.ggml.tokens", a, vs, hp->n_vocab);
        return false;
    }
    hp->bos_id = opt_token_id(g, "tokenizer.ggml.bos_token_id", hp->n_vocab);
    hp->eos_id = opt_token_id(g, "tokenizer.ggml.eos_token_id", hp->n_vocab);
    hp->eot_id = opt_token_id(g, "tokenizer.ggml.eot_token_id", hp->n_vocab);
    find_eog(g, hp);
    return true;
}

/* ---------------------------------------------------------------- tensors */

static bool is_norm_type(uint32_t t) { return t == CB_TYPE_F32 || t == CB_TYPE_F16 || t == CB_TYPE_BF16; }

static const cb_gguf_tensor_t *need_tensor(const cb_gguf_t *g, const char *name, int64_t ne0, int64_t ne1,
                                           char *err, size_t errlen) {
    const cb_gguf_tensor_t *t = cb_gguf_find_tensor(g, name);
    if (!t) {
        cb_set_err(err, errlen, "tensor %s is missing", name);
        return NULL;
    }
    uint32_t want_dims = ne1 ? 2 : 1;
    bool ok = t->n_dims == want_dims && t->ne[0] == ne0 && t->ne[1] == (ne1 ? ne1 : 1) && t->ne[2] == 1 &&
              t->ne[3] == 1;
    if (!ok) {
        char want[64];
        if (ne1) snprintf(want, sizeof want, "[%lld, %lld]", (long long)ne0, (long long)ne1);
        else snprintf(want, sizeof want, "[%lld]", (long long)ne0);
        cb_set_err(err, errlen, "tensor %s has shape [%lld, %lld, %lld, %lld] (%u dims), expected %s", name,
                   (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3], t->n_dims,
                   want);
        return NULL;
    }
    if (ne1 == 0 && !is_norm_type(t->type)) {
        cb_set_err(err, errlen, "tensor %s has type %s; a norm vector must be F32, F16 or BF16", name,
                   cb_type_name(t->type));
        return NULL;
    }
    size_t be = cb_type_block_elems(t->type);
    if (be == 0 || ne0 % (int64_t)be != 0) {
        cb_set_err(err, errlen, "tensor %s: type %s not supported for a row of %lld elements", name,
                   cb_type_name(t->type), (long long)ne0);
        return NULL;
    }
    return t;
}

/* A vector tensor (norm weight, bias, rope_freqs) of n elements as f32: the stored data where it is aligned
 * F32, else a converted copy the model owns. */
static bool load_vec(cb_model_t *m, const cb_gguf_t *g, const char *name, int n, const float **out, char *err,
                     size_t errlen) {
    const cb_gguf_tensor_t *t = need_tensor(g, name, n, 0, err, errlen);
    if (!t) return false;
    if (t->type == CB_TYPE_F32 && ((uintptr_t)t->data % sizeof(float)) == 0) {
        *out = t->data;
        return true;
    }
    float *c = cb_malloc(sizeof(float) * (size_t)n);
    if (!c) {
        cb_set_err(err, errlen, "out of memory");
        return false;
    }
    m->norm_copies[m->n_norm_copies++] = c;
    if (!cb_dequant(t->type, t->data, c, (size_t)n)) {
        cb_set_err(err, errlen, "tensor %s: cannot convert type %s", name, cb_type_name(t->type));
        return false;
    }
    *out = c;
    return true;
}

static bool load_norm(cb_model_t *m, const cb_gguf_t *g, const char *name, const float **out, char *err,
                      size_t errlen) {
    return load_vec(m, g, name, m->hp.n_embd, out, err, errlen);
}

static bool set_weight(cb_weight_t *w, const cb_gguf_t *g, const char *name, int rows, int cols, char *err,
                       size_t errlen) {
    const cb_gguf_tensor_t *t = need_tensor(g, name, cols, rows, err, errlen);
    if (!t) return false;
    w->name = t->name;
    w->type = t->type;
    w->q = t->data;
    w->rows = rows;
    w->cols = cols;
    w->row_bytes = (size_t)cols / cb_type_block_elems(t->type) * cb_type_block_bytes(t->type);
    w->f32 = NULL;
    if (w->row_bytes * (size_t)rows != t->nbytes) {
        cb_set_err(err, errlen, "tensor %s: %zu data bytes, expected %zu", name, t->nbytes,
                   w->row_bytes * (size_t)rows);
        return false;
    }
    return true;
}

/* Every tensor in the file must be one the architecture has: anything else (a bias it lacks, extra layers)
 * would change the computation in a way this engine does not implement. */
static bool check_known_tensors(const cb_gguf_t *g, const cb_arch_t *arch, int n_layer, char *err, size_t errlen) {
    static const char *block[] = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                  "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                                  "ffn_down.weight"};
    static const char *bias[] = {"attn_q.bias", "attn_k.bias", "attn_v.bias"};
    static const char *qk_norm[] = {"attn_q_norm.weight", "attn_k_norm.weight"};
    static const char *post[] = {"post_attention_norm.weight", "post_ffw_norm.weight"};
    for (size_t i = 0; i < cb_gguf_n_tensors(g); i++) {
        const char *name = cb_gguf_tensor(g, i)->name;
        if (!strcmp(name, "token_embd.weight") || !strcmp(name, "output_norm.weight") ||
            !strcmp(name, "output.weight") || (arch->rope_freqs && !strcmp(name, "rope_freqs.weight")))
            continue;
        int l, off = 0;
        bool ok = false;
        if (sscanf(name, "blk.%d.%n", &l, &off) == 1 && off > 0 && l >= 0 && l < n_layer) {
            const char *rest = name + off;
            for (size_t k = 0; k < sizeof block / sizeof block[0]; k++) ok = ok || !strcmp(rest, block[k]);
            for (size_t k = 0; arch->qkv_bias && k < sizeof bias / sizeof bias[0]; k++) ok = ok || !strcmp(rest, bias[k]);
            for (size_t k = 0; arch->qk_norm && k < 2; k++) ok = ok || !strcmp(rest, qk_norm[k]);
            for (size_t k = 0; arch->post_norms && k < 2; k++) ok = ok || !strcmp(rest, post[k]);
        }
        if (!ok) {
            cb_set_err(err, errlen, "unsupported tensor %s: architecture '%s' has no such tensor in this engine",
                       name, arch->name);
            return false;
        }
    }
    return true;
}

/* ---------------------------------------------------------------- fingerprint */

static void h_u32(crypto_generichash_state *st, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    crypto_generichash_update(st, b, 4);
}
static void h_u64(crypto_generichash_state *st, uint64_t v) {
    h_u32(st, (uint32_t)v);
    h_u32(st, (uint32_t)(v >> 32));
}
static void h_f32(crypto_generichash_state *st, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    h_u32(st, u);
}
static void h_bytes(crypto_generichash_state *st, const void *p, size_t n) {
    h_u64(st, n);
    crypto_generichash_update(st, p, n);
}
static void h_str_key(crypto_generichash_state *st, const cb_gguf_t *g, const char *key) {
    const char *s = "";
    size_t len = 0;
    if (!cb_gguf_get_str(g, key, &s, &len)) s = "", len = 0;
    h_bytes(st, s, len);
}
static void h_str_arr(crypto_generichash_state *st, const cb_gguf_t *g, const char *key) {
    cb_gguf_vtype_t et;
    size_t count = 0;
    if (!cb_gguf_get_arr(g, key, &et, &count) || et != CB_GGUF_STRING) count = 0;
    h_u64(st, count);
    for (size_t i = 0; i < count; i++) {
        const char *s;
        size_t len;
        if (!cb_gguf_arr_str(g, key, i, &s, &len)) s = "", len = 0;
        h_bytes(st, s, len);
    }
}

static int compute_fingerprint(cb_model_t *m) {
    if (sodium_init() < 0) return -1;
    const cb_gguf_t *g = m->gguf;
    const cb_hparams_t *hp = &m->hp;
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, 32);
    static const char tag[] = "cacheblend-model-fingerprint-v1";
    h_bytes(&st, tag, sizeof tag - 1);
    h_bytes(&st, hp->arch, strlen(hp->arch));
    h_u32(&st, (uint32_t)hp->n_layer);
    h_u32(&st, (uint32_t)hp->n_embd);
    h_u32(&st, (uint32_t)hp->n_head);
    h_u32(&st, (uint32_t)hp->n_head_kv);
    h_u32(&st, (uint32_t)hp->head_dim);
    h_u32(&st, (uint32_t)hp->n_ff);
    h_u32(&st, (uint32_t)hp->n_vocab);
    h_u32(&st, (uint32_t)hp->n_rot);
    h_u32(&st, (uint32_t)hp->rope_type);
    h_f32(&st, hp->rope_base);
    h_f32(&st, hp->rms_eps);
    h_u32(&st, hp->tied_output ? 1u : 0u);
    if (hp->rope_freq_scale != 1.0f) h_f32(&st, hp->rope_freq_scale); /* only then: older fingerprints stay */
    if (hp->n_swa > 0) { /* windows (and with them gemma3's other hyperparameters), likewise only then */
        h_u32(&st, (uint32_t)hp->n_swa);
        for (int l = 0; l < hp->n_layer; l++) {
            h_u32(&st, (uint32_t)m->layers[l].window);
            h_f32(&st, m->layers[l].rope.base);
        }
        h_f32(&st, hp->embd_scale);
        h_u32(&st, (uint32_t)hp->act);
    }
    h_str_key(&st, g, "tokenizer.ggml.model");
    h_str_key(&st, g, "tokenizer.ggml.pre");
    h_str_arr(&st, g, "tokenizer.ggml.tokens");
    h_str_arr(&st, g, "tokenizer.ggml.merges");
    for (size_t i = 0; i < cb_gguf_n_tensors(g); i++) {
        const cb_gguf_tensor_t *t = cb_gguf_tensor(g, i);
        h_bytes(&st, t->name, strlen(t->name));
        h_u32(&st, t->type);
        for (int d = 0; d < 4; d++) h_u64(&st, (uint64_t)t->ne[d]);
        h_bytes(&st, t->data, t->nbytes);
    }
    crypto_generichash_final(&st, m->fingerprint, 32);
    return 0;
}

/* ---------------------------------------------------------------- load */

/* Types cb_dequant (and so every backend's dequantization) handles. */
static bool dequant_supported(uint32_t type) {
    switch (type) {
    case CB_TYPE_F32: case CB_TYPE_F16: case CB_TYPE_BF16: case CB_TYPE_Q4_0: case CB_TYPE_Q4_1:
    case CB_TYPE_Q8_0: case CB_TYPE_Q5_0: case CB_TYPE_Q4_K: case CB_TYPE_Q5_K: case CB_TYPE_Q6_K:
        return true;
    default: return false;
    }
}

/* The weight set the backends prepare (tensor.h cb_weights_t): every block matrix in layer order, then the
 * output matrix (the embedding table when tied: then the table is its alias; otherwise the table is only looked
 * up); mode from CB_ENGINE_WEIGHTS (already checked). */
static bool describe_weights(cb_model_t *m, const char *wmode, char *err, size_t errlen) {
    cb_weights_t *ws = &m->weights;
    const int L = m->hp.n_layer;
    ws->w = cb_calloc((size_t)7 * L + 1, sizeof *ws->w);
    if (!ws->w || pthread_mutex_init(&ws->lock, NULL) != 0) {
        cb_set_err(err, errlen, "out of memory");
        return false;
    }
    m->weights_lock = true;
    for (int l = 0; l < L; l++) {
        cb_layer_weights_t *Lw = &m->layers[l];
        cb_weight_t *lw[] = {&Lw->wq, &Lw->wk, &Lw->wv, &Lw->wo, &Lw->w_gate, &Lw->w_up, &Lw->w_down};
        for (size_t k = 0; k < sizeof lw / sizeof lw[0]; k++) ws->w[ws->n++] = lw[k];
    }
    ws->w[ws->n++] = &m->output;
    ws->alias = m->hp.tied_output ? &m->tok_embd : NULL;
    ws->lookup = m->hp.tied_output ? NULL : &m->tok_embd;
    ws->mode = !wmode || !*wmode || !strcmp(wmode, "native") ? CB_WEIGHTS_NATIVE
               : !strcmp(wmode, "f32")                        ? CB_WEIGHTS_F32
                                                              : CB_WEIGHTS_STORED;
    return true;
}

cb_model_t *cb_model_load(const char *path, char *err, size_t errlen) {
    char gerr[256] = "";
    cb_model_t *m = cb_calloc(1, sizeof *m);
    if (!m) {
        cb_set_err(err, errlen, "out of memory");
        return NULL;
    }
    m->gguf = cb_gguf_open(path, gerr, sizeof gerr);
    if (!m->gguf) {
        cb_set_err(err, errlen, "%s: %s", path, gerr);
        goto fail;
    }
    const cb_gguf_t *g = m->gguf;
    cb_hparams_t *hp = &m->hp;
    if (!read_hparams(g, hp, &m->arch, err, errlen)) goto fail;
    if (!check_known_tensors(g, m->arch, hp->n_layer, err, errlen)) goto fail;

    const int E = hp->n_embd, QD = hp->n_head * hp->head_dim, KVD = hp->n_head_kv * hp->head_dim, F = hp->n_ff;
    m->layers = cb_calloc((size_t)hp->n_layer, sizeof *m->layers);
    m->norm_copies = cb_calloc((size_t)hp->n_layer * 9 + 2, sizeof *m->norm_copies); /* 9 vectors a layer at most */
    if (!m->layers || !m->norm_copies) {
        cb_set_err(err, errlen, "out of memory");
        goto fail;
    }
    if (!set_weight(&m->tok_embd, g, "token_embd.weight", hp->n_vocab, E, err, errlen)) goto fail;
    if (!load_norm(m, g, "output_norm.weight", &m->output_norm, err, errlen)) goto fail;
    if (cb_gguf_find_tensor(g, "output.weight")) {
        if (!set_weight(&m->output, g, "output.weight", hp->n_vocab, E, err, errlen)) goto fail;
    } else {
        hp->tied_output = true;
        m->output = m->tok_embd;
    }
    cb_rope_t rope = cb_hparams_rope(hp);
    if (cb_gguf_find_tensor(g, "rope_freqs.weight")) {
        if (!load_vec(m, g, "rope_freqs.weight", hp->n_rot / 2, &rope.freq_factors, err, errlen)) goto fail;
        for (int i = 0; i < hp->n_rot / 2; i++)
            if (!(rope.freq_factors[i] > 0.0f) || !isfinite(rope.freq_factors[i])) {
                cb_set_err(err, errlen, "tensor rope_freqs.weight: element %d is not a positive number", i);
                goto fail;
            }
        hp->rope_freqs = rope.freq_factors;
    }
    char name[96];
    for (int l = 0; l < hp->n_layer; l++) {
        cb_layer_weights_t *L = &m->layers[l];
#define W(field, suffix, rows, cols)                                                         \
        snprintf(name, sizeof name, "blk.%d." suffix ".weight", l);                          \
        if (!set_weight(&L->field, g, name, rows, cols, err, errlen)) goto fail;
        W(wq, "attn_q", QD, E)
        W(wk, "attn_k", KVD, E)
        W(wv, "attn_v", KVD, E)
        W(wo, "attn_output", E, QD)
        W(w_gate, "ffn_gate", F, E)
        W(w_up, "ffn_up", F, E)
        W(w_down, "ffn_down", E, F)
#undef W
        snprintf(name, sizeof name, "blk.%d.attn_norm.weight", l);
        if (!load_norm(m, g, name, &L->attn_norm, err, errlen)) goto fail;
        snprintf(name, sizeof name, "blk.%d.ffn_norm.weight", l);
        if (!load_norm(m, g, name, &L->ffn_norm, err, errlen)) goto fail;
#define V(field, suffix, n)                                                                  \
        snprintf(name, sizeof name, "blk.%d." suffix, l);                                    \
        if (!load_vec(m, g, name, n, &L->field, err, errlen)) goto fail;
        if (m->arch->qkv_bias) {
            V(bq, "attn_q.bias", QD)
            V(bk, "attn_k.bias", KVD)
            V(bv, "attn_v.bias", KVD)
        }
        if (m->arch->qk_norm) {
            V(q_norm, "attn_q_norm.weight", hp->head_dim)
            V(k_norm, "attn_k_norm.weight", hp->head_dim)
        }
        if (m->arch->post_norms) {
            V(post_attn_norm, "post_attention_norm.weight", E)
            V(post_ffn_norm, "post_ffw_norm.weight", E)
        }
#undef V
        L->rope = rope;
        if (layer_windowed(g, m->arch, hp, l)) {
            L->window = hp->n_swa;
            if (m->arch->swa == CB_SWA_PERIODIC) { /* the local layers' own base, unscaled (llama.cpp's gemma3) */
                L->rope.base = hp->rope_base_swa;
                L->rope.freq_scale = 1.0f;
            }
        }
    }

    /* What the backends are to prepare: CB_ENGINE_WEIGHTS (native, the default; stored; f32: the reference) */
    const char *wmode = getenv("CB_ENGINE_WEIGHTS");
    if (wmode && *wmode && strcmp(wmode, "f32") != 0 && strcmp(wmode, "native") != 0 && strcmp(wmode, "stored") != 0) {
        cb_set_err(err, errlen, "CB_ENGINE_WEIGHTS = '%s': expected native, stored or f32", wmode);
        goto fail;
    }
    for (int l = 0; l < hp->n_layer; l++) {
        const cb_layer_weights_t *L = &m->layers[l];
        const cb_weight_t *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t k = 0; k < sizeof ws / sizeof ws[0]; k++)
            if (!dequant_supported(ws[k]->type)) {
                cb_set_err(err, errlen, "tensor %s: cannot dequantize type %s", ws[k]->name, cb_type_name(ws[k]->type));
                goto fail;
            }
    }
    if (!describe_weights(m, wmode, err, errlen)) goto fail;
    if (compute_fingerprint(m) != 0) {
        cb_set_err(err, errlen, "libsodium initialisation failed");
        goto fail;
    }
    CB_DEBUG("model %s: %d layers, n_embd %d, %d/%d heads, head_dim %d, n_ff %d, vocab %d, rope base %g, "
             "eps %g, %s output, weights prepared %s", path, hp->n_layer, hp->n_embd, hp->n_head, hp->n_head_kv,
             hp->head_dim, hp->n_ff, hp->n_vocab, (double)hp->rope_base, (double)hp->rms_eps,
             hp->tied_output ? "tied" : "separate", wmode && *wmode ? wmode : "native");
    return m;
fail:
    cb_model_destroy(&m);
    return NULL;
}

void cb_model_destroy(cb_model_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_model_t *m = *self_p;
    for (int i = 0; i < m->n_norm_copies; i++) free(m->norm_copies[i]);
    free(m->norm_copies);
    if (m->weights_lock) {
        /* every backend gave its reference back (the model outlives its engines); a last one is released */
        if (m->weights.refs > 0) {
            m->weights.refs = 1;
            cb_weights_release(&m->weights);
        }
        pthread_mutex_destroy(&m->weights.lock);
    }
    free(m->weights.w);
    free(m->layers);
    cb_gguf_destroy(&m->gguf);
    free(m);
    *self_p = NULL;
}

const cb_hparams_t *cb_model_hparams(const cb_model_t *self) { return &self->hp; }
const cb_gguf_t *cb_model_gguf(const cb_model_t *self) { return self->gguf; }
const cb_layer_weights_t *cb_model_layer(const cb_model_t *self, int layer) {
    return (layer >= 0 && layer < self->hp.n_layer) ? &self->layers[layer] : NULL;
}
const cb_weight_t *cb_model_tok_embd(const cb_model_t *self) { return &self->tok_embd; }
const cb_weight_t *cb_model_output(const cb_model_t *self) { return &self->output; }
const float *cb_model_output_norm(const cb_model_t *self) { return self->output_norm; }
cb_weights_t *cb_model_weights(const cb_model_t *self) { return (cb_weights_t *)&self->weights; }

bool cb_model_is_eog(const cb_model_t *self, int32_t id) {
    for (int i = 0; i < self->hp.n_eog; i++)
        if (self->hp.eog_ids[i] == id) return true;
    return false;
}

void cb_model_fingerprint(const cb_model_t *self, uint8_t out[32]) { memcpy(out, self->fingerprint, 32); }

int cb_model_check_tokens(const cb_model_t *self, const int32_t *t, int n, const char *what, char *err,
                          size_t errlen) {
    if (!t || n < 1) {
        cb_set_err(err, errlen, "%s is empty", what);
        return -1;
    }
    const int V = cb_model_hparams(self)->n_vocab;
    for (int i = 0; i < n; i++)
        if (t[i] < 0 || t[i] >= V) {
            cb_set_err(err, errlen, "%s token %d = %d outside the vocabulary (%d)", what, i, (int)t[i], V);
            return -1;
        }
    return 0;
}
