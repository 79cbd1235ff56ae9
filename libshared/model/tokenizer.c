/* tokenizer.c: GPT-2 byte-level BPE with the "smollm" pre-tokenizer, matching llama.cpp token for token.
 *
 * What llama.cpp does (src/llama-vocab.cpp, src/unicode.cpp) and how this file mirrors it:
 *   - special-token partition on raw bytes: longest special texts first, leftmost occurrences, each
 *     cut fragment tokenized on its own (partition());
 *   - lenient UTF-8 decoding per fragment: a byte that does not start a complete sequence becomes
 *     U+FFFD; overlong forms and surrogates are accepted and re-encoded canonically (normalize());
 *   - two-stage split: every \p{N} code point alone, then the GPT-2 pattern on each piece, where the end
 *     of a piece acts as the end of the text for \s+(?!\S). llama.cpp uses its own Unicode 15.1 tables and
 *     the White_Space set for \s; PCRE2 here (Unicode 14 in Debian 12) gets the same answers through an
 *     explicit whitespace class and the letters/digits assigned after Unicode 14 added to \p{L}/\p{N};
 *   - merge by rank with a min-heap on (rank, left index); a popped pair is stale unless both sides
 *     still have the lengths they had when it was pushed (equivalent to llama.cpp's text compare);
 *   - a final symbol missing from the vocabulary is emitted byte by byte (bytes of its byte-level
 *     text), skipping bytes that are not tokens themselves.
 * Memory: the object owns copies of the vocabulary and merges; encode allocates one workspace per call
 * (sized by the text, grown only for an unusually long word) and frees it before returning.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "model/tokenizer.h"

#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "base/err.h"
#include "base/log.h"
#include "base/utf8.h"

#define MAX_VOCAB (1 << 24)
#define MAX_MERGES (1 << 24)
#define MAX_TOKEN_BYTES 4096
#define MAX_TEXT_LEN ((size_t)INT_MAX / 4) /* every output token covers >= 1/3 input byte */

/* Character classes. WS is llama.cpp's whitespace set (Unicode White_Space). The extra ranges are
 * letters and digits assigned in Unicode 15.0/15.1, which llama.cpp's tables know and PCRE2 10.42
 * (Unicode 14.0.0) does not; with a newer PCRE2 they are redundant. */
#define WS "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
#define LETTER "\\p{L}\\x{1123F}-\\x{11240}\\x{11F02}\\x{11F04}-\\x{11F10}\\x{11F12}-\\x{11F33}\\x{1342F}" \
    "\\x{13441}-\\x{13446}\\x{1B132}\\x{1B155}\\x{1DF25}-\\x{1DF2A}\\x{1E030}-\\x{1E06D}\\x{1E4D0}-\\x{1E4EB}" \
    "\\x{2B739}\\x{2EBF0}-\\x{2EE5D}\\x{31350}-\\x{323AF}"
#define NUMBER "\\p{N}\\x{11F50}-\\x{11F59}\\x{1D2C0}-\\x{1D2D3}\\x{1E4F0}-\\x{1E4F9}"

static const char PAT_DIGIT[] = "[" NUMBER "]";
static const char PAT_GPT2[] =
    "'s|'t|'re|'ve|'m|'ll|'d"
    "| ?[" LETTER "]++"
    "| ?[" NUMBER "]++"
    "| ?[^" WS LETTER NUMBER "]++"
    "|[" WS "]+(?![^" WS "])"
    "|[" WS "]++";

typedef struct {
    pcre2_code *code;
    bool jit;
} regex_t_;

struct cb_tokenizer {
    int n_vocab;
    char *tok_arena;        /* all token texts, each NUL-terminated */
    uint32_t *tok_off;      /* [n_vocab] offset into tok_arena */
    uint32_t *tok_len;      /* [n_vocab] */
    uint8_t *tok_type;      /* [n_vocab] cb_token_type_t */
    char *dec_arena;        /* decoded bytes of every token, NUL-terminated */
    uint32_t *dec_off;      /* [n_vocab] */
    uint32_t *dec_len;      /* [n_vocab] */

    uint64_t *vocab_hash;   /* [vocab_cap] hash of the text in the slot */
    int32_t *vocab_slot;    /* [vocab_cap] token id, -1 = empty */
    size_t vocab_cap;       /* power of two */

    char *merge_arena;      /* first+second of every merge, concatenated, no separator */
    uint32_t *merge_off;    /* [n_merges] */
    uint32_t *merge_len;    /* [n_merges] length of first+second */
    uint32_t *merge_split;  /* [n_merges] length of first */
    int n_merges;
    uint64_t *merge_hash;   /* [merge_cap] */
    int32_t *merge_slot;    /* [merge_cap] merge index = rank, -1 = empty */
    size_t merge_cap;

    char byte_map[256][2];  /* GPT-2 bytes_to_unicode as UTF-8 (1 or 2 bytes) */
    uint8_t byte_map_len[256];
    int16_t unmap[324];     /* code point (< 256 + 68) -> byte, -1 if not in the table */
    int32_t byte_tok[256];  /* id of the 1-byte token text b, -1 if none */

    int32_t *special;       /* ids cut out before BPE, longest text first */
    int n_special;

    regex_t_ re_digit, re_gpt2;
    int32_t bos, eos, eot, pad;
    bool add_bos;
};

/* ---------------------------------------------------------------------------------------------- */
/* small helpers */

static void *xcalloc(size_t n, size_t sz) {
    if (n == 0) n = 1;
    void *p = calloc(n, sz);
    if (!p) {
        CB_ERROR("tokenizer: out of memory (%zu x %zu bytes)", n, sz);
        abort();
    }
    return p;
}

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* llama.cpp's lenient decoder: checks the lead byte's length bits and the continuation bytes' top
 * bits only (overlong forms and surrogates pass). A sequence above U+10FFFF, which llama.cpp cannot
 * re-encode, is treated as invalid here. Returns the code point, or 0xFFFD and *adv = 1 if invalid. */
static uint32_t utf8_get_lenient(const unsigned char *s, size_t n, size_t i, size_t *adv) {
    unsigned b = s[i];
    *adv = 1;
    if (b < 0x80) return b;
    if (!(b & 0x40)) return 0xFFFD;
#define CONT(k) (i + (k) < n && (s[i + (k)] & 0xC0) == 0x80)
    if (!(b & 0x20)) {
        if (!CONT(1)) return 0xFFFD;
        *adv = 2;
        return ((b & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu);
    }
    if (!(b & 0x10)) {
        if (!CONT(1) || !CONT(2)) return 0xFFFD;
        *adv = 3;
        return ((b & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu);
    }
    if (!(b & 0x08)) {
        if (!CONT(1) || !CONT(2) || !CONT(3)) return 0xFFFD;
        uint32_t cp = ((b & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3Fu);
        if (cp > 0x10FFFF) return 0xFFFD;
        *adv = 4;
        return cp;
    }
#undef CONT
    return 0xFFFD;
}

/* ---------------------------------------------------------------------------------------------- */
/* hash tables (open addressing, linear probing; keys compared by bytes after a hash match) */

static uint64_t hash_bytes(const void *p, size_t n, uint64_t seed) { return XXH3_64bits_withSeed(p, n, seed); }

static int32_t vocab_lookup(const cb_tokenizer_t *t, const void *s, size_t n) {
    uint64_t h = hash_bytes(s, n, 0);
    size_t mask = t->vocab_cap - 1;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        int32_t id = t->vocab_slot[i];
        if (id < 0) return -1;
        if (t->vocab_hash[i] == h && t->tok_len[id] == n && memcmp(t->tok_arena + t->tok_off[id], s, n) == 0)
            return id;
    }
}

/* Later duplicates win, as in llama.cpp (token_to_id[text] = i). */
static void vocab_insert(cb_tokenizer_t *t, int32_t id) {
    const char *s = t->tok_arena + t->tok_off[id];
    size_t n = t->tok_len[id];
    uint64_t h = hash_bytes(s, n, 0);
    size_t mask = t->vocab_cap - 1;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        int32_t o = t->vocab_slot[i];
        if (o < 0 || (t->vocab_hash[i] == h && t->tok_len[o] == n && memcmp(t->tok_arena + t->tok_off[o], s, n) == 0)) {
            t->vocab_slot[i] = id;
            t->vocab_hash[i] = h;
            return;
        }
    }
}

/* Rank of merging left = s[0..split) with right = s[split..n), or -1. The pair is hashed as its
 * concatenation seeded with the split point, so a lookup needs no copy (adjacent symbols are
 * contiguous in the mapped word). */
static int32_t merge_lookup(const cb_tokenizer_t *t, const char *s, size_t n, size_t split) {
    uint64_t h = hash_bytes(s, n, split);
    size_t mask = t->merge_cap - 1;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        int32_t r = t->merge_slot[i];
        if (r < 0) return -1;
        if (t->merge_hash[i] == h && t->merge_len[r] == n && t->merge_split[r] == split &&
            memcmp(t->merge_arena + t->merge_off[r], s, n) == 0)
            return r;
    }
}

/* The first occurrence keeps its rank, as in llama.cpp (bpe_ranks.emplace). */
static void merge_insert(cb_tokenizer_t *t, int32_t r) {
    const char *s = t->merge_arena + t->merge_off[r];
    size_t n = t->merge_len[r], split = t->merge_split[r];
    uint64_t h = hash_bytes(s, n, split);
    size_t mask = t->merge_cap - 1;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        int32_t o = t->merge_slot[i];
        if (o < 0) {
            t->merge_slot[i] = r;
            t->merge_hash[i] = h;
            return;
        }
        if (t->merge_hash[i] == h && t->merge_len[o] == n && t->merge_split[o] == split &&
            memcmp(t->merge_arena + t->merge_off[o], s, n) == 0)
            return;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* construction */

static bool regex_compile(regex_t_ *re, const char *pat, char *err, size_t errlen) {
    int ec;
    PCRE2_SIZE eo;
    re->code = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
    if (!re->code) {
        char msg[128];
        pcre2_get_error_message(ec, (PCRE2_UCHAR *)msg, sizeof msg);
        cb_set_err(err, errlen, "tokenizer: cannot compile pre-tokenizer regex: %s", msg);
        return false;
    }
    re->jit = pcre2_jit_compile(re->code, PCRE2_JIT_COMPLETE) == 0;
    return true;
}

static void build_byte_map(cb_tokenizer_t *t) {
    int n = 0;
    for (int i = 0; i < 324; i++) t->unmap[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool direct = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        uint32_t cp = direct ? (uint32_t)b : (uint32_t)(256 + n++);
        unsigned char buf[4];
        size_t l = cb_utf8_encode(cp, buf);
        memcpy(t->byte_map[b], buf, l);
        t->byte_map_len[b] = (uint8_t)l;
        t->unmap[cp] = (int16_t)b;
    }
}

/* Decoded bytes of a normal token: each code point of its text mapped back through the byte table;
 * a code point outside the table (none in SmolLM2's vocabulary) is kept as its UTF-8. */
static size_t decode_token_text(const cb_tokenizer_t *t, const char *s, size_t n, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t adv;
        uint32_t cp = utf8_get_lenient((const unsigned char *)s, n, i, &adv);
        if (cp < 324 && t->unmap[cp] >= 0) {
            out[o++] = (char)t->unmap[cp];
        } else {
            memcpy(out + o, s + i, adv);
            o += adv;
        }
        i += adv;
    }
    return o;
}

static int32_t get_id(const cb_gguf_t *g, const char *key, int n_vocab) {
    uint32_t v;
    if (!cb_gguf_get_u32(g, key, &v)) return -1;
    if (v >= (uint32_t)n_vocab) {
        CB_WARN("tokenizer: %s = %u is outside the vocabulary (%d tokens); ignored", key, v, n_vocab);
        return -1;
    }
    return (int32_t)v;
}

static int cmp_special(const void *a, const void *b, void *ctx) {
    const cb_tokenizer_t *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (t->tok_len[x] != t->tok_len[y]) return t->tok_len[x] > t->tok_len[y] ? -1 : 1;
    return x < y ? -1 : x > y;
}

static bool str_is(const char *s, size_t n, const char *lit) { return n == strlen(lit) && memcmp(s, lit, n) == 0; }

cb_tokenizer_t *cb_tokenizer_new_from_gguf(const cb_gguf_t *g, char *err, size_t errlen) {
    if (err && errlen) err[0] = 0;
    if (!g) {
        cb_set_err(err, errlen, "tokenizer: no GGUF given");
        return NULL;
    }
    const char *s;
    size_t n;
    if (!cb_gguf_get_str(g, "tokenizer.ggml.model", &s, &n)) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.model is missing");
        return NULL;
    }
    if (!str_is(s, n, "gpt2")) {
        char m[64];
        snprintf(m, sizeof m, "%.*s", (int)(n < 40 ? n : 40), s);
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.model is \"%s\"; only \"gpt2\" (byte-level BPE) is supported",
                   m);
        return NULL;
    }
    if (!cb_gguf_get_str(g, "tokenizer.ggml.pre", &s, &n)) {
        cb_set_err(err, errlen,
                   "tokenizer: tokenizer.ggml.pre is missing; only the \"smollm\" pre-tokenizer is supported");
        return NULL;
    }
    if (!str_is(s, n, "smollm")) {
        char m[64];
        snprintf(m, sizeof m, "%.*s", (int)(n < 40 ? n : 40), s);
        cb_set_err(err, errlen,
                   "tokenizer: pre-tokenizer \"%s\" is not supported (only \"smollm\", verified against llama.cpp)", m);
        return NULL;
    }

    cb_gguf_vtype_t et;
    size_t n_tok, n_mrg;
    if (!cb_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n_tok) || et != CB_GGUF_STRING) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.tokens is missing or not a string array");
        return NULL;
    }
    if (n_tok == 0 || n_tok > MAX_VOCAB) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.tokens has an unreasonable count");
        return NULL;
    }
    if (!cb_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &n_mrg) || et != CB_GGUF_STRING) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.merges is missing or not a string array");
        return NULL;
    }
    if (n_mrg > MAX_MERGES) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.merges has an unreasonable count");
        return NULL;
    }
    const unsigned char *types = NULL;
    if (cb_gguf_has(g, "tokenizer.ggml.token_type")) {
        size_t n_ty;
        if (!cb_gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &n_ty) || et != CB_GGUF_I32) {
            cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.token_type is not an int32 array");
            return NULL;
        }
        if (n_ty < n_tok) {
            cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.token_type is shorter than tokenizer.ggml.tokens");
            return NULL;
        }
        types = cb_gguf_arr_data(g, "tokenizer.ggml.token_type");
        if (!types) {
            cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.token_type has no data");
            return NULL;
        }
    }

    cb_tokenizer_t *t = xcalloc(1, sizeof *t);
    t->n_vocab = (int)n_tok;

    /* tokens: sizes first, then copies (an empty text becomes "[EMPTY_<id>]" as in llama.cpp) */
    size_t total = 0;
    for (size_t i = 0; i < n_tok; i++) {
        if (!cb_gguf_arr_str(g, "tokenizer.ggml.tokens", i, &s, &n)) goto bad_tokens;
        if (n > MAX_TOKEN_BYTES) goto bad_tokens;
        total += (n ? n : 32) + 1;
    }
    if (total > UINT32_MAX / 2) goto bad_tokens;
    t->tok_arena = xcalloc(total, 1);
    t->tok_off = xcalloc(n_tok, sizeof *t->tok_off);
    t->tok_len = xcalloc(n_tok, sizeof *t->tok_len);
    t->tok_type = xcalloc(n_tok, 1);
    t->dec_off = xcalloc(n_tok, sizeof *t->dec_off);
    t->dec_len = xcalloc(n_tok, sizeof *t->dec_len);
    t->dec_arena = xcalloc(total * 2, 1); /* a decoded text is never longer than its vocabulary text */
    build_byte_map(t);
    size_t off = 0, doff = 0;
    for (size_t i = 0; i < n_tok; i++) {
        cb_gguf_arr_str(g, "tokenizer.ggml.tokens", i, &s, &n);
        char *dst = t->tok_arena + off;
        if (n == 0) n = (size_t)snprintf(dst, 32, "[EMPTY_%zu]", i);
        else memcpy(dst, s, n);
        dst[n] = 0;
        t->tok_off[i] = (uint32_t)off;
        t->tok_len[i] = (uint32_t)n;
        off += n + 1;
        int32_t ty = CB_TOKEN_NORMAL;
        if (types) memcpy(&ty, types + 4 * i, 4);
        t->tok_type[i] = (ty >= 0 && ty <= CB_TOKEN_BYTE) ? (uint8_t)ty : CB_TOKEN_UNDEFINED;
        /* decoded form */
        char *d = t->dec_arena + doff;
        size_t dn = 0;
        switch (t->tok_type[i]) {
        case CB_TOKEN_NORMAL: case CB_TOKEN_BYTE:
            dn = decode_token_text(t, dst, n, d);
            break;
        case CB_TOKEN_CONTROL: case CB_TOKEN_UNKNOWN: case CB_TOKEN_USER_DEFINED:
            memcpy(d, dst, n);
            dn = n;
            break;
        default:
            break;
        }
        d[dn] = 0;
        t->dec_off[i] = (uint32_t)doff;
        t->dec_len[i] = (uint32_t)dn;
        doff += dn + 1;
    }
    t->vocab_cap = pow2_at_least(n_tok * 2);
    t->vocab_hash = xcalloc(t->vocab_cap, sizeof *t->vocab_hash);
    t->vocab_slot = xcalloc(t->vocab_cap, sizeof *t->vocab_slot);
    memset(t->vocab_slot, 0xFF, t->vocab_cap * sizeof *t->vocab_slot);
    for (size_t i = 0; i < n_tok; i++) vocab_insert(t, (int32_t)i);
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        t->byte_tok[b] = vocab_lookup(t, &c, 1);
    }

    /* merges: "first second", split at the first space after position 0 */
    total = 0;
    for (size_t i = 0; i < n_mrg; i++) {
        if (!cb_gguf_arr_str(g, "tokenizer.ggml.merges", i, &s, &n) || n > 2 * MAX_TOKEN_BYTES) goto bad_merges;
        total += n;
    }
    if (total > UINT32_MAX / 2) goto bad_merges;
    t->merge_arena = xcalloc(total, 1);
    t->merge_off = xcalloc(n_mrg, sizeof *t->merge_off);
    t->merge_len = xcalloc(n_mrg, sizeof *t->merge_len);
    t->merge_split = xcalloc(n_mrg, sizeof *t->merge_split);
    t->n_merges = (int)n_mrg;
    t->merge_cap = pow2_at_least(n_mrg * 2);
    t->merge_hash = xcalloc(t->merge_cap, sizeof *t->merge_hash);
    t->merge_slot = xcalloc(t->merge_cap, sizeof *t->merge_slot);
    memset(t->merge_slot, 0xFF, t->merge_cap * sizeof *t->merge_slot);
    off = 0;
    for (size_t i = 0; i < n_mrg; i++) {
        cb_gguf_arr_str(g, "tokenizer.ggml.merges", i, &s, &n);
        const char *sp = n > 1 ? memchr(s + 1, ' ', n - 1) : NULL;
        size_t split = 0, len = 0;
        if (sp) {   /* without a space llama.cpp stores ("", ""), which never matches: store nothing */
            split = (size_t)(sp - s);
            memcpy(t->merge_arena + off, s, split);
            memcpy(t->merge_arena + off + split, sp + 1, n - split - 1);
            len = n - 1;
        }
        t->merge_off[i] = (uint32_t)off;
        t->merge_len[i] = (uint32_t)len;
        t->merge_split[i] = (uint32_t)split;
        off += len;
        if (sp && split > 0 && len > split) merge_insert(t, (int32_t)i);
    }

    /* special tokens: control, unknown and user-defined, longest text first */
    t->special = xcalloc(n_tok, sizeof *t->special);
    for (size_t i = 0; i < n_tok; i++) {
        uint8_t ty = t->tok_type[i];
        if (ty == CB_TOKEN_CONTROL || ty == CB_TOKEN_UNKNOWN || ty == CB_TOKEN_USER_DEFINED)
            t->special[t->n_special++] = (int32_t)i;
    }
    qsort_r(t->special, (size_t)t->n_special, sizeof *t->special, cmp_special, t);

    t->bos = get_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab);
    t->eos = get_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab);
    t->pad = get_id(g, "tokenizer.ggml.padding_token_id", t->n_vocab);
    t->eot = get_id(g, "tokenizer.ggml.eot_token_id", t->n_vocab);
    /* No eot key: llama.cpp takes the first EOT-looking text in its hash map's order, which for
     * SmolLM2 is <|endoftext|> (0); these candidates, in this order, give the same answer. */
    static const char *const eot_texts[] = {"<|eot_id|>", "<|endoftext|>", "<|im_end|>", "<|end|>", "<end_of_turn>"};
    for (size_t i = 0; t->eot < 0 && i < sizeof eot_texts / sizeof *eot_texts; i++)
        t->eot = vocab_lookup(t, eot_texts[i], strlen(eot_texts[i]));
    bool ab = false;
    t->add_bos = cb_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &ab) && ab;

    if (!regex_compile(&t->re_digit, PAT_DIGIT, err, errlen) || !regex_compile(&t->re_gpt2, PAT_GPT2, err, errlen)) {
        cb_tokenizer_destroy(&t);
        return NULL;
    }
    return t;

bad_tokens:
    cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.tokens has an unreadable or oversized entry");
    cb_tokenizer_destroy(&t);
    return NULL;
bad_merges:
    cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.merges has an unreadable or oversized entry");
    cb_tokenizer_destroy(&t);
    return NULL;
}

void cb_tokenizer_destroy(cb_tokenizer_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_tokenizer_t *t = *self_p;
    free(t->tok_arena); free(t->tok_off); free(t->tok_len); free(t->tok_type);
    free(t->dec_arena); free(t->dec_off); free(t->dec_len);
    free(t->vocab_hash); free(t->vocab_slot);
    free(t->merge_arena); free(t->merge_off); free(t->merge_len); free(t->merge_split);
    free(t->merge_hash); free(t->merge_slot);
    free(t->special);
    pcre2_code_free(t->re_digit.code);
    pcre2_code_free(t->re_gpt2.code);
    free(t);
    *self_p = NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* encoding */

typedef struct { size_t off, len; int32_t id; } frag_t; /* id >= 0: a special token; else raw text */
typedef struct { uint32_t start, n; int32_t prev, next; } sym_t;
typedef struct { int32_t rank, left, right; uint32_t nl, nr; } bigram_t;

typedef struct {
    const cb_tokenizer_t *t;
    int32_t *out;
    int max_out;
    int n_out;                 /* tokens produced so far (may exceed max_out: counting only) */
    unsigned char *norm;       /* [3 * fragment bytes] fragment re-encoded as llama.cpp sees it */
    unsigned char *subj;       /* same, surrogates replaced by U+FFFD (valid UTF-8 for PCRE2) */
    size_t norm_cap;
    char *mapped;              /* [2 * word bytes] word in the byte-level alphabet */
    sym_t *syms;               /* [word bytes] */
    bigram_t *heap;            /* [3 * word bytes] */
    size_t word_cap;
    pcre2_match_data *md;
    bool failed;
} enc_t;

static void emit(enc_t *e, int32_t id) {
    if (e->n_out < e->max_out) e->out[e->n_out] = id;
    e->n_out++;
}

static bool bigram_less(const bigram_t *a, const bigram_t *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(bigram_t *h, size_t *n, bigram_t v) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!bigram_less(&v, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static bigram_t heap_pop(bigram_t *h, size_t *n) {
    bigram_t top = h[0], last = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && bigram_less(&h[c + 1], &h[c])) c++;
        if (!bigram_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (m) h[i] = last;
    return top;
}

static void try_pair(enc_t *e, size_t *hn, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const sym_t *a = &e->syms[l], *b = &e->syms[r];
    int32_t rank = merge_lookup(e->t, e->mapped + a->start, a->n + b->n, a->n);
    if (rank < 0) return;
    heap_push(e->heap, hn, (bigram_t){rank, l, r, a->n, b->n});
}

static bool ensure_word(enc_t *e, size_t n) {
    if (n <= e->word_cap) return true;
    size_t cap = e->word_cap ? e->word_cap : 256;
    while (cap < n) cap *= 2;
    free(e->mapped); free(e->syms); free(e->heap);
    e->mapped = malloc(2 * cap);
    e->syms = malloc(cap * sizeof *e->syms);
    e->heap = malloc(3 * cap * sizeof *e->heap);
    e->word_cap = cap;
    if (!e->mapped || !e->syms || !e->heap) {
        e->word_cap = 0;
        return false;
    }
    return true;
}

/* BPE of one pre-tokenized word w[0..n) (bytes), appending its ids. */
static void bpe_word(enc_t *e, const unsigned char *w, size_t n) {
    const cb_tokenizer_t *t = e->t;
    if (!ensure_word(e, n)) {
        e->failed = true;
        return;
    }
    uint32_t off = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t l = t->byte_map_len[w[i]];
        memcpy(e->mapped + off, t->byte_map[w[i]], l);
        e->syms[i] = (sym_t){off, l, (int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1};
        off += l;
    }
    size_t hn = 0;
    for (size_t i = 1; i < n; i++) try_pair(e, &hn, (int32_t)i - 1, (int32_t)i);
    while (hn) {
        bigram_t b = heap_pop(e->heap, &hn);
        sym_t *L = &e->syms[b.left], *R = &e->syms[b.right];
        if (L->n != b.nl || R->n != b.nr) continue; /* stale: a side has merged since */
        L->n += R->n;
        R->n = 0;
        L->next = R->next;
        if (R->next >= 0) e->syms[R->next].prev = b.left;
        try_pair(e, &hn, L->prev, b.left);
        try_pair(e, &hn, b.left, L->next);
    }
    for (int32_t i = 0; i >= 0; i = e->syms[i].next) {
        const sym_t *s = &e->syms[i];
        int32_t id = vocab_lookup(t, e->mapped + s->start, s->n);
        if (id >= 0) {
            emit(e, id);
            continue;
        }
        for (uint32_t k = 0; k < s->n; k++) {   /* llama.cpp: byte by byte, unknown bytes dropped */
            int32_t bt = t->byte_tok[(unsigned char)e->mapped[s->start + k]];
            if (bt >= 0) emit(e, bt);
        }
    }
}

static int regex_match(enc_t *e, const regex_t_ *re, const unsigned char *s, size_t len, size_t start,
                       size_t *ms, size_t *me) {
    int rc = re->jit ? pcre2_jit_match(re->code, s, len, start, 0, e->md, NULL)
                     : pcre2_match(re->code, s, len, start, PCRE2_NO_UTF_CHECK, e->md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) {
        e->failed = true;
        return -1;
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
    *ms = ov[0];
    *me = ov[1];
    return 1;
}

/* GPT-2 pattern over subj[fs..fe); the end of the piece is the end of the subject. */
static void split_gpt2(enc_t *e, size_t fs, size_t fe) {
    size_t pos = fs;
    while (pos < fe && !e->failed) {
        size_t ms, me;
        int rc = regex_match(e, &e->t->re_gpt2, e->subj, fe, pos, &ms, &me);
        if (rc < 0) return;
        if (rc == 0) { ms = me = fe; }
        if (ms > pos) bpe_word(e, e->norm + pos, ms - pos); /* cannot happen: every char matches */
        if (me > ms) bpe_word(e, e->norm + ms, me - ms);
        if (me <= pos) me = pos + 1; /* defensive: no empty-match loop */
        pos = me;
    }
}

/* One raw fragment (no special tokens inside): normalize, split digits off, split words, BPE. */
static void encode_raw(enc_t *e, const unsigned char *s, size_t n) {
    if (3 * n > e->norm_cap) {
        free(e->norm); free(e->subj);
        e->norm_cap = 3 * n;
        e->norm = malloc(e->norm_cap);
        e->subj = malloc(e->norm_cap);
        if (!e->norm || !e->subj) {
            e->norm_cap = 0;
            e->failed = true;
            return;
        }
    }
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        size_t adv;
        uint32_t cp = utf8_get_lenient(s, n, i, &adv);
        i += adv;
        size_t l = cb_utf8_encode(cp, e->norm + m);
        if (cp >= 0xD800 && cp <= 0xDFFF) memcpy(e->subj + m, CB_UTF8_REPLACEMENT, 3);
        else memcpy(e->subj + m, e->norm + m, l);
        m += l;
    }
    size_t pos = 0;
    while (pos < m && !e->failed) {
        size_t ms, me;
        int rc = regex_match(e, &e->t->re_digit, e->subj, m, pos, &ms, &me);
        if (rc < 0) return;
        if (rc == 0) ms = me = m;
        if (ms > pos) split_gpt2(e, pos, ms);
        if (me > ms) split_gpt2(e, ms, me);
        if (me <= pos) me = pos + 1;
        pos = me;
    }
}

/* Cuts special tokens out of text, as llama.cpp's tokenizer_st_partition: for each special token in
 * order (longest first), every leftmost non-overlapping occurrence inside a still-raw fragment. */
static frag_t *partition(const cb_tokenizer_t *t, const char *text, size_t len, bool parse_special, size_t *n_out) {
    size_t cap = 16, n = 1;
    frag_t *f = malloc(cap * sizeof *f), *g = NULL;
    if (!f) return NULL;
    f[0] = (frag_t){0, len, -1};
    for (int k = 0; k < t->n_special; k++) {
        int32_t id = t->special[k];
        uint8_t ty = t->tok_type[id];
        if (!parse_special && ty != CB_TOKEN_USER_DEFINED) continue;
        const char *st = t->tok_arena + t->tok_off[id];
        size_t sl = t->tok_len[id];
        size_t gcap = n + 16, gn = 0;
        g = malloc(gcap * sizeof *g);
        if (!g) { free(f); return NULL; }
        for (size_t i = 0; i < n; i++) {
            if (f[i].id >= 0 || f[i].len < sl) {
                if (gn == gcap) { gcap *= 2; frag_t *ng = realloc(g, gcap * sizeof *g); if (!ng) goto oom; g = ng; }
                g[gn++] = f[i];
                continue;
            }
            size_t p = f[i].off, end = f[i].off + f[i].len;
            while (p < end) {
                const char *hit = end - p >= sl ? memmem(text + p, end - p, st, sl) : NULL;
                size_t need = 2;
                if (gn + need > gcap) { gcap = 2 * gcap + need; frag_t *ng = realloc(g, gcap * sizeof *g); if (!ng) goto oom; g = ng; }
                if (!hit) { g[gn++] = (frag_t){p, end - p, -1}; break; }
                size_t h = (size_t)(hit - text);
                if (h > p) g[gn++] = (frag_t){p, h - p, -1};
                g[gn++] = (frag_t){h, sl, id};
                p = h + sl;
            }
        }
        free(f);
        f = g;
        n = gn;
        g = NULL;
    }
    *n_out = n;
    return f;
oom:
    free(f);
    free(g);
    return NULL;
}

int cb_tokenizer_encode(const cb_tokenizer_t *self, const char *text, size_t len, bool parse_special,
                        int32_t *out, int max_out) {
    if (!self || (!text && len) || len > MAX_TEXT_LEN || max_out < 0 || (!out && max_out > 0))
        return CB_TOKENIZER_EINVAL;
    if (len == 0) return 0;
    size_t nf;
    frag_t *f = partition(self, text, len, parse_special, &nf);
    if (!f) return CB_TOKENIZER_EINTERNAL;
    enc_t e = {.t = self, .out = out, .max_out = max_out};
    e.md = pcre2_match_data_create(1, NULL);
    if (!e.md) e.failed = true;
    for (size_t i = 0; i < nf && !e.failed; i++) {
        if (f[i].id >= 0) emit(&e, f[i].id);
        else encode_raw(&e, (const unsigned char *)text + f[i].off, f[i].len);
    }
    pcre2_match_data_free(e.md);
    free(e.norm); free(e.subj); free(e.mapped); free(e.syms); free(e.heap);
    free(f);
    if (e.failed) return CB_TOKENIZER_EINTERNAL;
    if (e.n_out > max_out) return -e.n_out;
    return e.n_out;
}

int32_t *cb_tokenizer_encode_alloc(const cb_tokenizer_t *self, const char *text, size_t len,
                                   bool parse_special, int *n_out) {
    if (n_out) *n_out = 0;
    int need = cb_tokenizer_encode(self, text, len, parse_special, NULL, 0);
    if (need == CB_TOKENIZER_EINVAL || need == CB_TOKENIZER_EINTERNAL) return NULL;
    int n = need < 0 ? -need : 0;
    int32_t *ids = malloc((size_t)(n ? n : 1) * sizeof *ids);
    if (!ids) return NULL;
    if (n && cb_tokenizer_encode(self, text, len, parse_special, ids, n) != n) {
        free(ids);
        return NULL;
    }
    if (n_out) *n_out = n;
    return ids;
}

/* ---------------------------------------------------------------------------------------------- */
/* decoding and lookups */

const char *cb_tokenizer_token_bytes(const cb_tokenizer_t *self, int32_t id, bool special, size_t *len) {
    if (len) *len = 0;
    if (!self || id < 0 || id >= self->n_vocab) return NULL;
    uint8_t ty = self->tok_type[id];
    const char *p = self->dec_arena + self->dec_off[id];
    if ((ty == CB_TOKEN_CONTROL || ty == CB_TOKEN_UNKNOWN) && !special) return p + self->dec_len[id]; /* "" */
    if (len) *len = self->dec_len[id];
    return p;
}

int64_t cb_tokenizer_decode(const cb_tokenizer_t *self, const int32_t *ids, size_t n, bool special,
                            char *out, size_t cap) {
    if (!self || (!ids && n) || (!out && cap)) return -1;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        size_t l;
        const char *p = cb_tokenizer_token_bytes(self, ids[i], special, &l);
        if (!p) return -1;
        if (cap && total < cap - 1) {
            size_t c = l < cap - 1 - total ? l : cap - 1 - total;
            memcpy(out + total, p, c);
        }
        total += l;
    }
    if (cap) out[total < cap - 1 ? total : cap - 1] = 0;
    return (int64_t)total;
}

char *cb_tokenizer_decode_alloc(const cb_tokenizer_t *self, const int32_t *ids, size_t n, bool special,
                                size_t *len) {
    if (len) *len = 0;
    int64_t need = cb_tokenizer_decode(self, ids, n, special, NULL, 0);
    if (need < 0) return NULL;
    char *s = malloc((size_t)need + 1);
    if (!s) return NULL;
    cb_tokenizer_decode(self, ids, n, special, s, (size_t)need + 1);
    if (len) *len = (size_t)need;
    return s;
}

int cb_tokenizer_n_vocab(const cb_tokenizer_t *self) { return self ? self->n_vocab : 0; }

const char *cb_tokenizer_token_text(const cb_tokenizer_t *self, int32_t id, size_t *len) {
    if (len) *len = 0;
    if (!self || id < 0 || id >= self->n_vocab) return NULL;
    if (len) *len = self->tok_len[id];
    return self->tok_arena + self->tok_off[id];
}

cb_token_type_t cb_tokenizer_token_type(const cb_tokenizer_t *self, int32_t id) {
    if (!self || id < 0 || id >= self->n_vocab) return CB_TOKEN_UNDEFINED;
    return (cb_token_type_t)self->tok_type[id];
}

int32_t cb_tokenizer_find(const cb_tokenizer_t *self, const char *text, size_t len) {
    if (!self || (!text && len)) return -1;
    return vocab_lookup(self, text ? text : "", len);
}

int32_t cb_tokenizer_bos(const cb_tokenizer_t *self) { return self ? self->bos : -1; }
int32_t cb_tokenizer_eos(const cb_tokenizer_t *self) { return self ? self->eos : -1; }
int32_t cb_tokenizer_eot(const cb_tokenizer_t *self) { return self ? self->eot : -1; }
int32_t cb_tokenizer_pad(const cb_tokenizer_t *self) { return self ? self->pad : -1; }
bool cb_tokenizer_add_bos(const cb_tokenizer_t *self) { return self && self->add_bos; }

/* Texts llama.cpp marks end-of-generation (its EOT/EOG lists plus the FIM pad/repo/separator tokens,
 * which it also adds to the EOG set). */
static const char *const eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<end_of_utterance>", "<|fim_pad|>", "<fim-pad>", "<PAD>", "<|fim_repo|>",
    "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>"};

bool cb_tokenizer_is_eog(const cb_tokenizer_t *self, int32_t id) {
    if (!self || id < 0 || id >= self->n_vocab) return false;
    if (id == self->eos || id == self->eot) return true;
    uint8_t ty = self->tok_type[id];
    if (ty != CB_TOKEN_CONTROL && ty != CB_TOKEN_USER_DEFINED) return false;
    const char *s = self->tok_arena + self->tok_off[id];
    size_t n = self->tok_len[id];
    for (size_t i = 0; i < sizeof eog_texts / sizeof *eog_texts; i++)
        if (str_is(s, n, eog_texts[i])) return true;
    return false;
}
