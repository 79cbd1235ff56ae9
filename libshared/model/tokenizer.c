/* tokenizer.c: byte-level BPE ("smollm", "qwen2", "llama-bpe") and SentencePiece-style ("llama") GGUF
 * vocabularies, matching llama.cpp token for token (see tokenizer.h).
 *
 * What llama.cpp does (src/llama-vocab.cpp, src/unicode.cpp) and how this file mirrors it:
 *   - token attributes: the GGUF's token types, then the tokens llama.cpp finds by text (EOT/EOM, FIM
 *     markers, the EOG list) get the control attribute added; that attribute decides what parse_special
 *     = false leaves as text and what decoding hides (attr_of());
 *   - special-token partition on raw bytes: longest special texts first, leftmost occurrences, each
 *     cut fragment tokenized on its own (partition());
 *   - BPE: lenient UTF-8 decoding per fragment: a byte that does not start a complete sequence becomes
 *     U+FFFD; overlong forms and surrogates are accepted and re-encoded canonically (encode_bpe());
 *   - BPE splitting: "smollm" splits every \p{N} code point off, then runs the GPT-2 pattern on each
 *     piece (the end of a piece acts as the end of the text for \s+(?!\S)); "qwen2" and "llama-bpe" run
 *     one pattern each, the same answers as llama.cpp's hand-written matchers for those regexes
 *     (unicode_regex_split_custom_qwen2/_llama3). llama.cpp uses its own Unicode 15.1 tables and the
 *     White_Space set for \s; PCRE2 here (Unicode 14 in Debian 12) gets the same answers through an
 *     explicit whitespace class and the letters/digits assigned after Unicode 14 added to \p{L}/\p{N};
 *   - BPE merge by rank with a min-heap on (rank, left index); a popped pair is stale unless both sides
 *     still have the lengths they had when it was pushed (equivalent to llama.cpp's text compare);
 *     "llama-bpe" first looks the whole word up (ignore_merges); a final symbol missing from the
 *     vocabulary is emitted byte by byte (bytes of its byte-level text), skipping bytes that are not
 *     tokens themselves;
 *   - SentencePiece (llm_tokenizer_spm_session): optional leading space, spaces to U+2581, symbols cut at
 *     UTF-8 lead-byte lengths without validation, every adjacent pair whose concatenation is a token goes
 *     into a max-heap on (score, -left index), merged until the heap is empty; a final symbol that is
 *     not a token becomes its bytes' <0xNN> tokens.
 * The one deliberate difference: with parse_special = false, no merge or whole-word lookup may produce a
 * control or unknown token (llama.cpp's SentencePiece merge would build, e.g., Gemma's <start_of_turn>
 * out of the plain text "<start_of_turn>" when the vocabulary holds the pieces); such a token is treated
 * as absent. No golden line of the supported vocabularies depends on it except the ones that test it.
 * Memory: the object owns copies of the vocabulary, scores and merges; encode allocates one workspace per
 * call (sized by the text, grown only for an unusually long word) and frees it before returning.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "model/tokenizer.h"
#include "base/alloc.h"

#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "base/err.h"
#include "base/log.h"
#include "base/utf8.h"
#include "model/chat.h"

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
/* qwen2 and llama-bpe differ only in the digit branch: \p{N} vs \p{N}{1,3}. */
#define PAT_QWEN2_LIKE(DIGITS)                                                     \
    "'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]"                         \
    "|[^\\r\\n" LETTER NUMBER "]?[" LETTER "]++"                                   \
    "|[" NUMBER "]" DIGITS                                                         \
    "| ?[^" WS LETTER NUMBER "]++[\\r\\n]*+"                                        \
    "|[" WS "]*[\\r\\n]++"                                                         \
    "|[" WS "]+(?![^" WS "])"                                                      \
    "|[" WS "]++"
static const char PAT_QWEN2[] = PAT_QWEN2_LIKE("");
static const char PAT_LLAMA3[] = PAT_QWEN2_LIKE("{1,3}");

typedef enum { KIND_BPE = 1, KIND_SPM = 2 } kind_t;
typedef enum { PRE_DEFAULT = 0, PRE_SMOLLM, PRE_QWEN2, PRE_LLAMA3 } pre_t;

/* Token attributes as llama.cpp keeps them (llama_token_attr, the subset that matters here). */
enum { A_UNKNOWN = 1, A_UNUSED = 2, A_NORMAL = 4, A_CONTROL = 8, A_USER = 16, A_BYTE = 32 };
#define A_SPECIAL (A_UNKNOWN | A_CONTROL | A_USER) /* cut out of text by the partition */
#define A_HIDDEN (A_UNKNOWN | A_CONTROL)           /* never from untrusted text; decoded only with special */

typedef struct {
    pcre2_code *code;
    bool jit;
} regex_t_;

struct cb_tokenizer {
    kind_t kind;
    pre_t pre;
    int n_vocab;
    char *tok_arena;        /* all token texts, each NUL-terminated */
    uint32_t *tok_off;      /* [n_vocab] offset into tok_arena */
    uint32_t *tok_len;      /* [n_vocab] */
    uint8_t *tok_type;      /* [n_vocab] cb_token_type_t as stored */
    uint8_t *tok_attr;      /* [n_vocab] A_* after llama.cpp's overrides */
    uint8_t *tok_eog;       /* [n_vocab] 1 = end of generation */
    float *score;           /* [n_vocab] SentencePiece scores (0 when the GGUF has none); NULL for BPE */
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
    int32_t byte_tok[256];  /* BPE: id of the 1-byte token text b; SPM: <0xNN> (or the 1-byte text); -1 */

    int32_t *special;       /* ids cut out before BPE, longest text first */
    int n_special;

    regex_t_ re_digit, re_main; /* smollm: both; qwen2, llama-bpe: re_main only; SPM: none */
    bool ignore_merges;     /* llama-bpe: a whole word that is a token is emitted as it is */
    bool add_space_prefix;  /* SPM */
    int32_t bos, eos, eot, eom, pad;
    bool add_bos;

    int chat_kind;          /* cb_chat_kind_t, 0 = none */
    char chat_err[200];     /* why chat_kind is 0 */
};

/* ---------------------------------------------------------------------------------------------- */
/* small helpers */

/* calloc of at least one element; NULL when out of memory (the caller fails with oom()). */
static void *xcalloc(size_t n, size_t sz) { return cb_calloc(n ? n : 1, sz); }

static bool oom(char *err, size_t errlen) {
    cb_set_err(err, errlen, "tokenizer: out of memory");
    return false;
}

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

static bool str_is(const char *s, size_t n, const char *lit) { return n == strlen(lit) && memcmp(s, lit, n) == 0; }

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

/* llama.cpp's unicode_len_utf8: the length a lead byte announces, from its top four bits only
 * (continuation bytes count 1, F8..FF count 4). SentencePiece symbols are cut with it, unvalidated. */
static size_t lead_len(unsigned char c) {
    static const uint8_t len[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return len[c >> 4];
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

static int32_t vocab_lookup_str(const cb_tokenizer_t *t, const char *s) { return vocab_lookup(t, s, strlen(s)); }

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

/* Decoded bytes of a normal BPE token: each code point of its text mapped back through the byte table;
 * a code point outside the table (none in the supported vocabularies) is kept as its UTF-8. */
static size_t decode_bpe_text(const cb_tokenizer_t *t, const char *s, size_t n, char *out) {
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

#define SPM_SPACE "\xE2\x96\x81" /* U+2581 LOWER ONE EIGHTH BLOCK, SentencePiece's space */

/* A normal SentencePiece token's text with U+2581 turned back into spaces. */
static size_t decode_spm_text(const char *s, size_t n, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        if (i + 3 <= n && memcmp(s + i, SPM_SPACE, 3) == 0) {
            out[o++] = ' ';
            i += 3;
        } else {
            out[o++] = s[i++];
        }
    }
    return o;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The byte of a "<0xNN>" token text, or -1 when the text is not of that form. */
static int byte_token_value(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int hi = hexval(s[3]), lo = hexval(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
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

/* The texts llama.cpp (llama_vocab::impl::load) recognises, by category. */
static const char *const EOT_TEXTS[] = {"<|eot_id|>", "<|endoftext|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                                        "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
                                        "<\xEF\xBD\x9C" "end\xE2\x96\x81" "of\xE2\x96\x81" "sentence\xEF\xBD\x9C>",
                                        "<end_of_utterance>", NULL};
static const char *const EOM_TEXTS[] = {"<|eom_id|>", NULL};
static const char *const FIM_PRE_TEXTS[] = {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                                            "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "begin\xEF\xBD\x9C>", "<PRE>",
                                            "\xE2\x96\x81<PRE>", "<|code_prefix|>", "<|prefix|>", NULL};
static const char *const FIM_SUF_TEXTS[] = {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                                            "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "hole\xEF\xBD\x9C>", "<SUF>",
                                            "\xE2\x96\x81<SUF>", "<|code_suffix|>", "<|suffix|>", NULL};
static const char *const FIM_MID_TEXTS[] = {"<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                                            "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "end\xEF\xBD\x9C>", "<MID>",
                                            "\xE2\x96\x81<MID>", "<|code_middle|>", "<|middle|>", NULL};
static const char *const FIM_PAD_TEXTS[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", NULL};
static const char *const FIM_REP_TEXTS[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
                                            NULL};
static const char *const FIM_SEP_TEXTS[] = {"<|file_sep|>", NULL};
static const char *const EOG_TEXTS[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
                                        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
                                        "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
                                        "<turn|>", "<|tool_response>",
                                        "<\xEF\xBD\x9C" "end\xE2\x96\x81" "of\xE2\x96\x81" "sentence\xEF\xBD\x9C>",
                                        "[e~[", NULL};

/* First id among texts (in this order) present in the vocabulary, -1 if none. llama.cpp takes the first
 * match in its hash map's iteration order; the orders here give the same answers on the supported
 * vocabularies, which hold at most one candidate of a category, except SmolLM2/Qwen's EOT (checked by
 * test_tokenizer against llama_vocab_eot). */
static int32_t first_of(const cb_tokenizer_t *t, const char *const *texts) {
    for (int i = 0; texts[i]; i++) {
        int32_t id = vocab_lookup_str(t, texts[i]);
        if (id >= 0) return id;
    }
    return -1;
}

static void add_control(cb_tokenizer_t *t, int32_t id) {
    if (id >= 0) t->tok_attr[id] |= A_CONTROL;
}

/* An optional id key, else the first text match; a match found by text is promoted to control, as
 * llama.cpp does ("control-looking token ... was not control-type"). */
static int32_t special_by_key_or_text(cb_tokenizer_t *t, const cb_gguf_t *g, const char *key,
                                      const char *const *texts) {
    int32_t id = key ? get_id(g, key, t->n_vocab) : -1;
    if (id >= 0) return id;
    id = first_of(t, texts);
    add_control(t, id);
    return id;
}

/* Attributes, special ids and the end-of-generation set, after llama.cpp's load(). */
static void find_specials(cb_tokenizer_t *t, const cb_gguf_t *g) {
    t->bos = get_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab);
    t->eos = get_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab);
    t->pad = get_id(g, "tokenizer.ggml.padding_token_id", t->n_vocab);
    if (t->kind == KIND_SPM) { /* llama.cpp's SPM defaults when the keys are absent: <s> 1, </s> 2 */
        if (t->bos < 0 && !cb_gguf_has(g, "tokenizer.ggml.bos_token_id") && t->n_vocab > 1) t->bos = 1;
        if (t->eos < 0 && !cb_gguf_has(g, "tokenizer.ggml.eos_token_id") && t->n_vocab > 2) t->eos = 2;
    }
    t->eot = special_by_key_or_text(t, g, "tokenizer.ggml.eot_token_id", EOT_TEXTS);
    t->eom = special_by_key_or_text(t, g, "tokenizer.ggml.eom_token_id", EOM_TEXTS);
    special_by_key_or_text(t, g, "tokenizer.ggml.fim_pre_token_id", FIM_PRE_TEXTS);
    special_by_key_or_text(t, g, "tokenizer.ggml.fim_suf_token_id", FIM_SUF_TEXTS);
    special_by_key_or_text(t, g, "tokenizer.ggml.fim_mid_token_id", FIM_MID_TEXTS);
    int32_t fim_pad = special_by_key_or_text(t, g, "tokenizer.ggml.fim_pad_token_id", FIM_PAD_TEXTS);
    int32_t fim_rep = special_by_key_or_text(t, g, "tokenizer.ggml.fim_rep_token_id", FIM_REP_TEXTS);
    int32_t fim_sep = special_by_key_or_text(t, g, "tokenizer.ggml.fim_sep_token_id", FIM_SEP_TEXTS);
    int32_t eog[] = {fim_pad, fim_rep, fim_sep, t->eos, t->eot, t->eom};
    for (size_t i = 0; i < sizeof eog / sizeof *eog; i++)
        if (eog[i] >= 0) t->tok_eog[eog[i]] = 1;
    for (int i = 0; EOG_TEXTS[i]; i++) {
        int32_t id = vocab_lookup_str(t, EOG_TEXTS[i]);
        if (id < 0) continue;
        t->tok_eog[id] = 1;
        add_control(t, id);
    }
    /* Not mirrored (no supported vocabulary has them): gpt-oss's <|end|> and gemma4/plamo's </s> removals. */
}

static const char *pre_name(pre_t p) {
    switch (p) {
    case PRE_SMOLLM: return "smollm";
    case PRE_QWEN2: return "qwen2";
    case PRE_LLAMA3: return "llama-bpe";
    default: return "default";
    }
}

/* tokenizer.ggml.model and .pre -> kind and pre-tokenizer, or a message. */
static bool pick_model(cb_tokenizer_t *t, const cb_gguf_t *g, char *err, size_t errlen) {
    const char *s;
    size_t n;
    char m[64];
    if (!cb_gguf_get_str(g, "tokenizer.ggml.model", &s, &n)) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.model is missing");
        return false;
    }
    snprintf(m, sizeof m, "%.*s", (int)(n < 40 ? n : 40), s);
    if (str_is(s, n, "llama")) {
        t->kind = KIND_SPM; /* SentencePiece: llama.cpp ignores tokenizer.ggml.pre for it */
        t->pre = PRE_DEFAULT;
        return true;
    }
    if (!str_is(s, n, "gpt2")) {
        cb_set_err(err, errlen,
                   "tokenizer: tokenizer.ggml.model is \"%s\"; supported: \"gpt2\" (byte-level BPE) and \"llama\" "
                   "(SentencePiece)", m);
        return false;
    }
    t->kind = KIND_BPE;
    if (!cb_gguf_get_str(g, "tokenizer.ggml.pre", &s, &n)) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.pre is missing (model \"gpt2\"); supported: \"smollm\", "
                                "\"qwen2\", \"llama-bpe\"");
        return false;
    }
    snprintf(m, sizeof m, "%.*s", (int)(n < 40 ? n : 40), s);
    if (str_is(s, n, "smollm")) t->pre = PRE_SMOLLM;
    else if (str_is(s, n, "qwen2")) t->pre = PRE_QWEN2;
    else if (str_is(s, n, "llama-bpe") || str_is(s, n, "llama3") || str_is(s, n, "llama-v3")) t->pre = PRE_LLAMA3;
    else {
        cb_set_err(err, errlen,
                   "tokenizer: tokenizer.ggml.pre \"%s\" is not supported (supported: \"smollm\", \"qwen2\", "
                   "\"llama-bpe\", each verified against llama.cpp)", m);
        return false;
    }
    t->ignore_merges = t->pre == PRE_LLAMA3;
    return true;
}

/* tokenizer.ggml.scores (f32 or i32, at least n_vocab long) into t->score; absent = all 0. */
static bool read_scores(cb_tokenizer_t *t, const cb_gguf_t *g, char *err, size_t errlen) {
    t->score = xcalloc((size_t)t->n_vocab, sizeof *t->score);
    if (!t->score) return oom(err, errlen);
    if (!cb_gguf_has(g, "tokenizer.ggml.scores")) return true;
    cb_gguf_vtype_t et;
    size_t n;
    const unsigned char *p = NULL;
    if (!cb_gguf_get_arr(g, "tokenizer.ggml.scores", &et, &n) || (et != CB_GGUF_F32 && et != CB_GGUF_I32) ||
        !(p = cb_gguf_arr_data(g, "tokenizer.ggml.scores"))) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.scores is not an f32 or i32 array");
        return false;
    }
    if (n < (size_t)t->n_vocab) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.scores has %zu entries for %d tokens", n, t->n_vocab);
        return false;
    }
    for (int i = 0; i < t->n_vocab; i++) {
        if (et == CB_GGUF_F32) {
            memcpy(&t->score[i], p + 4 * (size_t)i, 4);
        } else {
            int32_t v;
            memcpy(&v, p + 4 * (size_t)i, 4);
            t->score[i] = (float)v;
        }
    }
    return true;
}

static bool read_merges(cb_tokenizer_t *t, const cb_gguf_t *g, char *err, size_t errlen) {
    cb_gguf_vtype_t et;
    size_t n_mrg, n;
    const char *s;
    if (!cb_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &n_mrg) || et != CB_GGUF_STRING) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.merges is missing or not a string array");
        return false;
    }
    if (n_mrg > MAX_MERGES) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.merges has an unreasonable count");
        return false;
    }
    /* merges: "first second", split at the first space after position 0 */
    size_t total = 0;
    for (size_t i = 0; i < n_mrg; i++) {
        if (!cb_gguf_arr_str(g, "tokenizer.ggml.merges", i, &s, &n) || n > 2 * MAX_TOKEN_BYTES) goto bad;
        total += n;
    }
    if (total > UINT32_MAX / 2) goto bad;
    t->merge_arena = xcalloc(total, 1);
    t->merge_off = xcalloc(n_mrg, sizeof *t->merge_off);
    t->merge_len = xcalloc(n_mrg, sizeof *t->merge_len);
    t->merge_split = xcalloc(n_mrg, sizeof *t->merge_split);
    t->n_merges = (int)n_mrg;
    t->merge_cap = pow2_at_least(n_mrg * 2);
    t->merge_hash = xcalloc(t->merge_cap, sizeof *t->merge_hash);
    t->merge_slot = xcalloc(t->merge_cap, sizeof *t->merge_slot);
    if (!t->merge_arena || !t->merge_off || !t->merge_len || !t->merge_split || !t->merge_hash || !t->merge_slot)
        return oom(err, errlen);
    memset(t->merge_slot, 0xFF, t->merge_cap * sizeof *t->merge_slot);
    size_t off = 0;
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
    return true;
bad:
    cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.merges has an unreadable or oversized entry");
    return false;
}

/* The decoded bytes of token i into d (room for its text's length); returns the length. */
static size_t decoded_form(const cb_tokenizer_t *t, int32_t i, char *d) {
    const char *s = t->tok_arena + t->tok_off[i];
    size_t n = t->tok_len[i];
    uint8_t a = t->tok_attr[i];
    if (a & A_SPECIAL) {
        memcpy(d, s, n);
        return n;
    }
    if (a & A_NORMAL) return t->kind == KIND_SPM ? decode_spm_text(s, n, d) : decode_bpe_text(t, s, n, d);
    if (a & A_BYTE) {
        if (t->kind == KIND_BPE) return decode_bpe_text(t, s, n, d);
        int b = byte_token_value(s, n);
        if (b < 0) return 0;
        d[0] = (char)b;
        return 1;
    }
    return 0; /* unused, undefined */
}

static uint8_t attr_of_type(uint8_t ty) {
    switch (ty) {
    case CB_TOKEN_NORMAL: return A_NORMAL;
    case CB_TOKEN_UNKNOWN: return A_UNKNOWN;
    case CB_TOKEN_CONTROL: return A_CONTROL;
    case CB_TOKEN_USER_DEFINED: return A_USER;
    case CB_TOKEN_UNUSED: return A_UNUSED;
    case CB_TOKEN_BYTE: return A_BYTE;
    default: return 0;
    }
}

cb_tokenizer_t *cb_tokenizer_new_from_gguf_opts(const cb_gguf_t *g, const char *chat_template, char *err,
                                                size_t errlen) {
    if (err && errlen) err[0] = 0;
    if (!g) {
        cb_set_err(err, errlen, "tokenizer: no GGUF given");
        return NULL;
    }
    int named = 0;
    if (chat_template && *chat_template && !(named = (int)cb_chat_kind_from_name(chat_template))) {
        cb_set_err(err, errlen, "tokenizer: unknown chat template name \"%.40s\" (known: %s)", chat_template,
                   cb_chat_kind_names());
        return NULL;
    }
    cb_tokenizer_t *t = xcalloc(1, sizeof *t);
    if (!t) {
        oom(err, errlen);
        return NULL;
    }
    if (!pick_model(t, g, err, errlen)) {
        free(t);
        return NULL;
    }
    const char *s;
    size_t n;
    cb_gguf_vtype_t et;
    size_t n_tok;
    if (!cb_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n_tok) || et != CB_GGUF_STRING) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.tokens is missing or not a string array");
        goto fail;
    }
    if (n_tok == 0 || n_tok > MAX_VOCAB) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.tokens has an unreasonable count");
        goto fail;
    }
    const unsigned char *types = NULL;
    if (cb_gguf_has(g, "tokenizer.ggml.token_type")) {
        size_t n_ty;
        if (!cb_gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &n_ty) || et != CB_GGUF_I32) {
            cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.token_type is not an int32 array");
            goto fail;
        }
        if (n_ty < n_tok) {
            cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.token_type is shorter than tokenizer.ggml.tokens");
            goto fail;
        }
        types = cb_gguf_arr_data(g, "tokenizer.ggml.token_type");
        if (!types) {
            cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.token_type has no data");
            goto fail;
        }
    }
    t->n_vocab = (int)n_tok;

    /* tokens: sizes first, then copies (an empty text becomes "[EMPTY_<id>]" as in llama.cpp) */
    size_t total = 0;
    for (size_t i = 0; i < n_tok; i++) {
        if (!cb_gguf_arr_str(g, "tokenizer.ggml.tokens", i, &s, &n) || n > MAX_TOKEN_BYTES) {
            cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.tokens has an unreadable or oversized entry");
            goto fail;
        }
        total += (n ? n : 32) + 1;
    }
    if (total > UINT32_MAX / 2) {
        cb_set_err(err, errlen, "tokenizer: tokenizer.ggml.tokens is too large");
        goto fail;
    }
    t->tok_arena = xcalloc(total, 1);
    t->tok_off = xcalloc(n_tok, sizeof *t->tok_off);
    t->tok_len = xcalloc(n_tok, sizeof *t->tok_len);
    t->tok_type = xcalloc(n_tok, 1);
    t->tok_attr = xcalloc(n_tok, 1);
    t->tok_eog = xcalloc(n_tok, 1);
    if (!t->tok_arena || !t->tok_off || !t->tok_len || !t->tok_type || !t->tok_attr || !t->tok_eog) {
        oom(err, errlen);
        goto fail;
    }
    size_t off = 0;
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
        t->tok_attr[i] = attr_of_type(t->tok_type[i]);
    }
    t->vocab_cap = pow2_at_least(n_tok * 2);
    t->vocab_hash = xcalloc(t->vocab_cap, sizeof *t->vocab_hash);
    t->vocab_slot = xcalloc(t->vocab_cap, sizeof *t->vocab_slot);
    if (!t->vocab_hash || !t->vocab_slot) {
        oom(err, errlen);
        goto fail;
    }
    memset(t->vocab_slot, 0xFF, t->vocab_cap * sizeof *t->vocab_slot);
    for (size_t i = 0; i < n_tok; i++) vocab_insert(t, (int32_t)i);

    if (t->kind == KIND_BPE) {
        build_byte_map(t);
        for (int b = 0; b < 256; b++) {
            char c = (char)b;
            t->byte_tok[b] = vocab_lookup(t, &c, 1);
        }
        if (!read_merges(t, g, err, errlen)) goto fail;
    } else {
        if (!read_scores(t, g, err, errlen)) goto fail;
        for (int b = 0; b < 256; b++) { /* llama.cpp's byte_to_token: <0xNN>, else the 1-byte text */
            char hex[8], c = (char)b;
            snprintf(hex, sizeof hex, "<0x%02X>", b);
            t->byte_tok[b] = vocab_lookup_str(t, hex);
            if (t->byte_tok[b] < 0) t->byte_tok[b] = vocab_lookup(t, &c, 1);
        }
    }

    find_specials(t, g);

    /* decoded forms (after the attribute overrides, which decide raw vs mapped text) */
    t->dec_off = xcalloc(n_tok, sizeof *t->dec_off);
    t->dec_len = xcalloc(n_tok, sizeof *t->dec_len);
    t->dec_arena = xcalloc(total, 1); /* a decoded text is never longer than its vocabulary text */
    if (!t->dec_off || !t->dec_len || !t->dec_arena) {
        oom(err, errlen);
        goto fail;
    }
    size_t doff = 0;
    for (size_t i = 0; i < n_tok; i++) {
        char *d = t->dec_arena + doff;
        size_t dn = decoded_form(t, (int32_t)i, d);
        d[dn] = 0;
        t->dec_off[i] = (uint32_t)doff;
        t->dec_len[i] = (uint32_t)dn;
        doff += dn + 1;
    }

    /* special tokens: control, unknown and user-defined, longest text first */
    t->special = xcalloc(n_tok, sizeof *t->special);
    if (!t->special) {
        oom(err, errlen);
        goto fail;
    }
    for (size_t i = 0; i < n_tok; i++)
        if (t->tok_attr[i] & A_SPECIAL) t->special[t->n_special++] = (int32_t)i;
    qsort_r(t->special, (size_t)t->n_special, sizeof *t->special, cmp_special, t);

    bool flag = false;
    if (t->kind == KIND_SPM) t->add_bos = true;
    else t->add_bos = t->pre == PRE_LLAMA3;
    if (cb_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &flag)) t->add_bos = flag;
    t->add_space_prefix = t->kind == KIND_SPM;
    if (cb_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &flag) && t->kind == KIND_SPM) t->add_space_prefix = flag;

    if (t->pre == PRE_SMOLLM) {
        if (!regex_compile(&t->re_digit, PAT_DIGIT, err, errlen) || !regex_compile(&t->re_main, PAT_GPT2, err, errlen))
            goto fail;
    } else if (t->pre == PRE_QWEN2 || t->pre == PRE_LLAMA3) {
        if (!regex_compile(&t->re_main, t->pre == PRE_QWEN2 ? PAT_QWEN2 : PAT_LLAMA3, err, errlen)) goto fail;
    }

    /* the chat template: named, else recognised from the GGUF (a failure is remembered, not fatal) */
    if (named) {
        t->chat_kind = named;
    } else if (cb_gguf_get_str(g, "tokenizer.chat_template", &s, &n)) {
        t->chat_kind = (int)cb_chat_template_detect(s, n, t->chat_err, sizeof t->chat_err);
    } else {
        snprintf(t->chat_err, sizeof t->chat_err,
                 "the GGUF has no tokenizer.chat_template; name one (e.g. \"completion\" for a base model)");
    }
    return t;

fail:
    cb_tokenizer_destroy(&t);
    return NULL;
}

cb_tokenizer_t *cb_tokenizer_new_from_gguf(const cb_gguf_t *g, char *err, size_t errlen) {
    return cb_tokenizer_new_from_gguf_opts(g, NULL, err, errlen);
}

void cb_tokenizer_destroy(cb_tokenizer_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_tokenizer_t *t = *self_p;
    free(t->tok_arena); free(t->tok_off); free(t->tok_len); free(t->tok_type); free(t->tok_attr);
    free(t->tok_eog); free(t->score);
    free(t->dec_arena); free(t->dec_off); free(t->dec_len);
    free(t->vocab_hash); free(t->vocab_slot);
    free(t->merge_arena); free(t->merge_off); free(t->merge_len); free(t->merge_split);
    free(t->merge_hash); free(t->merge_slot);
    free(t->special);
    pcre2_code_free(t->re_digit.code);
    pcre2_code_free(t->re_main.code);
    free(t);
    *self_p = NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* encoding */

typedef struct { size_t off, len; int32_t id; } frag_t; /* id >= 0: a special token; else raw text */
typedef struct { uint32_t start, n; int32_t prev, next; } sym_t;
typedef struct { int32_t rank, left, right; uint32_t nl, nr; } bigram_t;        /* BPE */
typedef struct { float score; int32_t left, right; uint32_t size; } spm_bigram_t; /* SentencePiece */

typedef struct {
    const cb_tokenizer_t *t;
    bool parse_special;
    int32_t *out;
    int max_out;
    int n_out;                 /* tokens produced so far (may exceed max_out: counting only) */
    unsigned char *norm;       /* [3 * fragment bytes (+3)] BPE: fragment as llama.cpp sees it; SPM: escaped */
    unsigned char *subj;       /* [same] BPE: surrogates replaced by U+FFFD (valid UTF-8 for PCRE2) */
    size_t norm_cap;
    char *mapped;              /* [2 * word bytes] word in the byte-level alphabet */
    sym_t *syms;               /* [word bytes] */
    void *heap;                /* [3 * word bytes] bigram_t or spm_bigram_t */
    size_t word_cap;
    pcre2_match_data *md;
    bool failed;
} enc_t;

static void emit(enc_t *e, int32_t id) {
    if (e->n_out < e->max_out) e->out[e->n_out] = id;
    e->n_out++;
}

/* A vocabulary lookup for a merge, a whole word or a final symbol: untrusted text never yields a
 * control or unknown token (see the file comment). */
static int32_t lookup_text(const enc_t *e, const char *s, size_t n) {
    int32_t id = vocab_lookup(e->t, s, n);
    if (id >= 0 && !e->parse_special && (e->t->tok_attr[id] & A_HIDDEN)) return -1;
    return id;
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

/* Word workspace for n symbols (the heap holds at most n initial pairs plus two per merge). */
static bool ensure_word(enc_t *e, size_t n) {
    if (n <= e->word_cap) return true;
    size_t cap = e->word_cap ? e->word_cap : 256;
    while (cap < n) cap *= 2;
    size_t hsz = sizeof(bigram_t) > sizeof(spm_bigram_t) ? sizeof(bigram_t) : sizeof(spm_bigram_t);
    free(e->mapped); free(e->syms); free(e->heap);
    e->mapped = cb_malloc(2 * cap);
    e->syms = cb_malloc(cap * sizeof *e->syms);
    e->heap = cb_malloc(3 * cap * hsz);
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
    if (t->ignore_merges) { /* llama-bpe: a word that is a token stays whole */
        int32_t id = lookup_text(e, e->mapped, off);
        if (id >= 0) {
            emit(e, id);
            return;
        }
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
        int32_t id = lookup_text(e, e->mapped + s->start, s->n);
        if (id >= 0) {
            emit(e, id);
            continue;
        }
        for (uint32_t k = 0; k < s->n; k++) {   /* llama.cpp: byte by byte, unknown bytes dropped */
            int32_t bt = t->byte_tok[(unsigned char)e->mapped[s->start + k]];
            if (bt >= 0 && !(!e->parse_special && (t->tok_attr[bt] & A_HIDDEN))) emit(e, bt);
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

/* The words of subj[fs..fe) by the main pattern (the end of the piece is the end of the subject), each
 * merged. Every character matches some branch of the supported patterns, so gaps cannot occur; one
 * would still be merged as a word. */
static void split_words(enc_t *e, size_t fs, size_t fe) {
    size_t pos = fs;
    while (pos < fe && !e->failed) {
        size_t ms, me;
        int rc = regex_match(e, &e->t->re_main, e->subj, fe, pos, &ms, &me);
        if (rc < 0) return;
        if (rc == 0) { ms = me = fe; }
        if (ms > pos) bpe_word(e, e->norm + pos, ms - pos);
        if (me > ms) bpe_word(e, e->norm + ms, me - ms);
        if (me <= pos) me = pos + 1; /* defensive: no empty-match loop */
        pos = me;
    }
}

/* Fragment workspace for n input bytes (3 output bytes per input byte, plus a 3-byte space prefix). */
static bool ensure_norm(enc_t *e, size_t n) {
    if (3 * n + 3 <= e->norm_cap) return true;
    free(e->norm); free(e->subj);
    e->norm_cap = 3 * n + 3;
    e->norm = cb_malloc(e->norm_cap);
    e->subj = cb_malloc(e->norm_cap);
    if (!e->norm || !e->subj) {
        e->norm_cap = 0;
        return false;
    }
    return true;
}

/* One raw BPE fragment (no special tokens inside): normalize, split (digits first for smollm), BPE. */
static void encode_bpe(enc_t *e, const unsigned char *s, size_t n) {
    if (!ensure_norm(e, n)) {
        e->failed = true;
        return;
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
    if (e->t->pre != PRE_SMOLLM) {
        split_words(e, 0, m);
        return;
    }
    size_t pos = 0;
    while (pos < m && !e->failed) {
        size_t ms, me;
        int rc = regex_match(e, &e->t->re_digit, e->subj, m, pos, &ms, &me);
        if (rc < 0) return;
        if (rc == 0) ms = me = m;
        if (ms > pos) split_words(e, pos, ms);
        if (me > ms) split_words(e, ms, me);
        if (me <= pos) me = pos + 1;
        pos = me;
    }
}

/* SentencePiece max-heap order: higher score first, then the leftmost pair. */
static bool spm_before(const spm_bigram_t *a, const spm_bigram_t *b) {
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static void spm_push(spm_bigram_t *h, size_t *n, spm_bigram_t v) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!spm_before(&v, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static spm_bigram_t spm_pop(spm_bigram_t *h, size_t *n) {
    spm_bigram_t top = h[0], last = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && spm_before(&h[c + 1], &h[c])) c++;
        if (!spm_before(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (m) h[i] = last;
    return top;
}

static void spm_try_pair(enc_t *e, size_t *hn, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const sym_t *a = &e->syms[l], *b = &e->syms[r];
    uint32_t size = a->n + b->n;
    int32_t id = lookup_text(e, (const char *)e->norm + a->start, size);
    if (id < 0) return;
    spm_push(e->heap, hn, (spm_bigram_t){e->t->score[id], l, r, size});
}

/* One raw SentencePiece fragment: [space] + text with spaces escaped, merged by score, byte fallback. */
static void encode_spm(enc_t *e, const unsigned char *s, size_t n, bool prefix_space) {
    const cb_tokenizer_t *t = e->t;
    if (!ensure_norm(e, n)) {
        e->failed = true;
        return;
    }
    size_t m = 0;
    if (prefix_space) {
        memcpy(e->norm, SPM_SPACE, 3);
        m = 3;
    }
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            memcpy(e->norm + m, SPM_SPACE, 3);
            m += 3;
        } else {
            e->norm[m++] = s[i];
        }
    }
    if (m == 0) return;
    size_t n_sym = 0;
    for (size_t i = 0; i < m; n_sym++) i += lead_len(e->norm[i]) < m - i ? lead_len(e->norm[i]) : m - i;
    if (!ensure_word(e, n_sym)) {
        e->failed = true;
        return;
    }
    size_t k = 0;
    for (size_t i = 0; i < m; k++) {
        size_t l = lead_len(e->norm[i]) < m - i ? lead_len(e->norm[i]) : m - i;
        e->syms[k] = (sym_t){(uint32_t)i, (uint32_t)l, (int32_t)k - 1, i + l < m ? (int32_t)k + 1 : -1};
        i += l;
    }
    size_t hn = 0;
    for (size_t i = 1; i < n_sym; i++) spm_try_pair(e, &hn, (int32_t)i - 1, (int32_t)i);
    while (hn) {
        spm_bigram_t b = spm_pop(e->heap, &hn);
        sym_t *L = &e->syms[b.left], *R = &e->syms[b.right];
        if (L->n == 0 || R->n == 0 || L->n + R->n != b.size) continue; /* stale */
        L->n += R->n;
        R->n = 0;
        L->next = R->next;
        if (R->next >= 0) e->syms[R->next].prev = b.left;
        spm_try_pair(e, &hn, L->prev, b.left);
        spm_try_pair(e, &hn, b.left, L->next);
    }
    for (int32_t i = 0; i >= 0; i = e->syms[i].next) {
        const sym_t *sy = &e->syms[i];
        int32_t id = lookup_text(e, (const char *)e->norm + sy->start, sy->n);
        if (id >= 0) {
            emit(e, id);
            continue;
        }
        for (uint32_t j = 0; j < sy->n; j++) { /* byte fallback; a byte without a token is dropped */
            int32_t bt = t->byte_tok[e->norm[sy->start + j]];
            if (bt >= 0) emit(e, bt);
        }
    }
}

/* True when every byte pair of s[0..n) (its byte, for n == 1) occurs in the text whose pairs are in bits
 * (65536 bits, bit a*256+b for the pair a b; bit c*256+c for a lone byte c): a cheap "cannot occur" test
 * that spares a scan of the text for most of a large vocabulary's special tokens (Gemma: 6,400). */
static bool pairs_present(const uint64_t *bits, const unsigned char *s, size_t n) {
    if (n == 1) return bits[(s[0] * 257u) >> 6] >> ((s[0] * 257u) & 63) & 1;
    for (size_t i = 0; i + 1 < n; i++) {
        unsigned p = s[i] * 256u + s[i + 1];
        if (!(bits[p >> 6] >> (p & 63) & 1)) return false;
    }
    return true;
}

/* Cuts special tokens out of text, as llama.cpp's tokenizer_st_partition: for each special token in
 * order (longest first), every leftmost non-overlapping occurrence inside a still-raw fragment. */
static frag_t *partition(const cb_tokenizer_t *t, const char *text, size_t len, bool parse_special, size_t *n_out) {
    size_t cap = 16, n = 1;
    frag_t *f = cb_malloc(cap * sizeof *f), *g = NULL;
    uint64_t *bits = cb_calloc(65536 / 64, sizeof *bits);
    if (!f || !bits) { free(f); free(bits); return NULL; }
    f[0] = (frag_t){0, len, -1};
    const unsigned char *u = (const unsigned char *)text;
    for (size_t i = 0; i < len; i++) {
        unsigned solo = u[i] * 257u, pair = i + 1 < len ? u[i] * 256u + u[i + 1] : solo;
        bits[solo >> 6] |= 1ull << (solo & 63);
        bits[pair >> 6] |= 1ull << (pair & 63);
    }
    for (int k = 0; k < t->n_special; k++) {
        int32_t id = t->special[k];
        if (!parse_special && (t->tok_attr[id] & A_HIDDEN)) continue;
        const char *st = t->tok_arena + t->tok_off[id];
        size_t sl = t->tok_len[id];
        if (sl > len || !pairs_present(bits, (const unsigned char *)st, sl)) continue;
        bool any = false;
        for (size_t i = 0; i < n && !any; i++)
            any = f[i].id < 0 && f[i].len >= sl && memmem(text + f[i].off, f[i].len, st, sl);
        if (!any) continue;
        size_t gcap = n + 16, gn = 0;
        g = cb_malloc(gcap * sizeof *g);
        if (!g) goto oom;
        for (size_t i = 0; i < n; i++) {
            if (f[i].id >= 0 || f[i].len < sl) {
                if (gn == gcap) { gcap *= 2; frag_t *ng = cb_realloc(g, gcap * sizeof *g); if (!ng) goto oom; g = ng; }
                g[gn++] = f[i];
                continue;
            }
            size_t p = f[i].off, end = f[i].off + f[i].len;
            while (p < end) {
                const char *hit = end - p >= sl ? memmem(text + p, end - p, st, sl) : NULL;
                size_t need = 2;
                if (gn + need > gcap) { gcap = 2 * gcap + need; frag_t *ng = cb_realloc(g, gcap * sizeof *g); if (!ng) goto oom; g = ng; }
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
    free(bits);
    *n_out = n;
    return f;
oom:
    free(f);
    free(g);
    free(bits);
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
    enc_t e = {.t = self, .parse_special = parse_special, .out = out, .max_out = max_out};
    if (self->kind == KIND_BPE) {
        e.md = pcre2_match_data_create(1, NULL);
        if (!e.md) e.failed = true;
    }
    bool prev_special = true; /* SentencePiece: the first fragment and each one after a special token */
    for (size_t i = 0; i < nf && !e.failed; i++) {
        if (f[i].id >= 0) {
            emit(&e, f[i].id);
            prev_special = true;
        } else if (self->kind == KIND_SPM) {
            encode_spm(&e, (const unsigned char *)text + f[i].off, f[i].len, self->add_space_prefix && prev_special);
            prev_special = false;
        } else {
            encode_bpe(&e, (const unsigned char *)text + f[i].off, f[i].len);
        }
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
    int32_t *ids = cb_malloc((size_t)(n ? n : 1) * sizeof *ids);
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
    const char *p = self->dec_arena + self->dec_off[id];
    if ((self->tok_attr[id] & A_HIDDEN) && !special) return p + self->dec_len[id]; /* "" */
    if (len) *len = self->dec_len[id];
    return p;
}

int64_t cb_tokenizer_decode(const cb_tokenizer_t *self, const int32_t *ids, size_t n, bool special,
                            char *out, size_t cap) {
    if (!self || (!ids && n) || (!out && cap)) return -1;
    size_t total = 0;
    bool strip = self->add_space_prefix; /* llama_detokenize: the first token loses one leading space */
    for (size_t i = 0; i < n; i++) {
        size_t l;
        const char *p = cb_tokenizer_token_bytes(self, ids[i], special, &l);
        if (!p) return -1;
        if (strip && l > 0 && p[0] == ' ') { p++; l--; }
        strip = false;
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
    char *s = cb_malloc((size_t)need + 1);
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

bool cb_tokenizer_is_special(const cb_tokenizer_t *self, int32_t id) {
    return self && id >= 0 && id < self->n_vocab && (self->tok_attr[id] & A_SPECIAL);
}

bool cb_tokenizer_is_control(const cb_tokenizer_t *self, int32_t id) {
    return self && id >= 0 && id < self->n_vocab && (self->tok_attr[id] & A_HIDDEN);
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

bool cb_tokenizer_is_eog(const cb_tokenizer_t *self, int32_t id) {
    return self && id >= 0 && id < self->n_vocab && self->tok_eog[id];
}

int cb_tokenizer_eog_ids(const cb_tokenizer_t *self, int32_t *out, int max_out) {
    if (!self || max_out < 0 || (!out && max_out > 0)) return 0;
    int n = 0;
    for (int32_t i = 0; i < self->n_vocab; i++) {
        if (!self->tok_eog[i]) continue;
        if (n < max_out) out[n] = i;
        n++;
    }
    return n;
}

const char *cb_tokenizer_model_name(const cb_tokenizer_t *self) {
    if (!self) return NULL;
    return self->kind == KIND_SPM ? "llama" : "gpt2";
}

const char *cb_tokenizer_pre_name(const cb_tokenizer_t *self) { return self ? pre_name(self->pre) : NULL; }

bool cb_tokenizer_add_space_prefix(const cb_tokenizer_t *self) { return self && self->add_space_prefix; }

const char *cb_tokenizer_chat_template_name(const cb_tokenizer_t *self) {
    return self && self->chat_kind ? cb_chat_kind_name((cb_chat_kind_t)self->chat_kind) : NULL;
}

const char *cb_tokenizer_chat_template_error(const cb_tokenizer_t *self) {
    if (!self) return "no tokenizer";
    return self->chat_kind ? "" : self->chat_err;
}

int cb_tokenizer_chat_template(const cb_tokenizer_t *self) { return self ? self->chat_kind : 0; }
