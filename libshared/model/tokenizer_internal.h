/* tokenizer_internal.h: what the tokenizer's source files share; not for use outside libshared/model.
 *   tokenizer.c           loading a GGUF vocabulary, decoding, the lookups (the object's lifetime);
 *   tokenizer_specials.c  the special ids, the control attribute and the end-of-generation set;
 *   tokenizer_encode.c    encoding: the special-token partition and the per-call workspace;
 *   tokenizer_bpe.c       byte-level BPE: the pre-tokenizer regexes and merging by rank;
 *   tokenizer_spm.c       SentencePiece: merging by score, byte fallback.
 * Here: the limits, the token attributes, the object's layout, the encoder's workspace, and the small
 * helpers several of them call (static inline, as they were in the one file they came from). */
#ifndef CB_TOKENIZER_INTERNAL_H
#define CB_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include "model/tokenizer.h"

#include <pcre2.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <xxhash.h>

#define MAX_VOCAB (1 << 24)
#define MAX_MERGES (1 << 24)
#define MAX_TOKEN_BYTES 4096
#define MAX_TEXT_LEN ((size_t)INT_MAX / 4) /* every output token covers >= 1/3 input byte */

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

#define SPM_SPACE "\xE2\x96\x81" /* U+2581 LOWER ONE EIGHTH BLOCK, SentencePiece's space */

/* ---------------------------------------------------------------------------------------------- */
/* small helpers */

/* llama.cpp's lenient decoder: checks the lead byte's length bits and the continuation bytes' top
 * bits only (overlong forms and surrogates pass). A sequence above U+10FFFF, which llama.cpp cannot
 * re-encode, is treated as invalid here. Returns the code point, or 0xFFFD and *adv = 1 if invalid. */
static inline uint32_t cb_tokenizer_utf8_get_lenient(const unsigned char *s, size_t n, size_t i, size_t *adv) {
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

static inline uint64_t cb_tokenizer_hash(const void *p, size_t n, uint64_t seed) {
    return XXH3_64bits_withSeed(p, n, seed);
}

static inline int32_t cb_tokenizer_vocab_lookup(const cb_tokenizer_t *t, const void *s, size_t n) {
    uint64_t h = cb_tokenizer_hash(s, n, 0);
    size_t mask = t->vocab_cap - 1;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        int32_t id = t->vocab_slot[i];
        if (id < 0) return -1;
        if (t->vocab_hash[i] == h && t->tok_len[id] == n && memcmp(t->tok_arena + t->tok_off[id], s, n) == 0)
            return id;
    }
}

static inline int32_t cb_tokenizer_vocab_lookup_str(const cb_tokenizer_t *t, const char *s) {
    return cb_tokenizer_vocab_lookup(t, s, strlen(s));
}

/* Rank of merging left = s[0..split) with right = s[split..n), or -1. The pair is hashed as its
 * concatenation seeded with the split point, so a lookup needs no copy (adjacent symbols are
 * contiguous in the mapped word). */
static inline int32_t cb_tokenizer_merge_lookup(const cb_tokenizer_t *t, const char *s, size_t n, size_t split) {
    uint64_t h = cb_tokenizer_hash(s, n, split);
    size_t mask = t->merge_cap - 1;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        int32_t r = t->merge_slot[i];
        if (r < 0) return -1;
        if (t->merge_hash[i] == h && t->merge_len[r] == n && t->merge_split[r] == split &&
            memcmp(t->merge_arena + t->merge_off[r], s, n) == 0)
            return r;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* encoding (tokenizer_encode.c, tokenizer_bpe.c, tokenizer_spm.c) */

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

static inline void cb_tokenizer_emit(enc_t *e, int32_t id) {
    if (e->n_out < e->max_out) e->out[e->n_out] = id;
    e->n_out++;
}

/* A vocabulary lookup for a merge, a whole word or a final symbol: untrusted text never yields a
 * control or unknown token (see tokenizer.c's file comment). */
static inline int32_t cb_tokenizer_lookup_text(const enc_t *e, const char *s, size_t n) {
    int32_t id = cb_tokenizer_vocab_lookup(e->t, s, n);
    if (id >= 0 && !e->parse_special && (e->t->tok_attr[id] & A_HIDDEN)) return -1;
    return id;
}

/* Word workspace for n symbols (the heap holds at most n initial pairs plus two per merge); fragment
 * workspace for n input bytes (3 output bytes per input byte, plus a 3-byte space prefix). False when out
 * of memory. */
bool cb_tokenizer_ensure_word(enc_t *e, size_t n);
bool cb_tokenizer_ensure_norm(enc_t *e, size_t n);
/* One raw fragment (no special tokens inside), its ids appended (tokenizer_bpe.c, tokenizer_spm.c). */
void cb_tokenizer_encode_bpe(enc_t *e, const unsigned char *s, size_t n);
void cb_tokenizer_encode_spm(enc_t *e, const unsigned char *s, size_t n, bool prefix_space);

/* ---------------------------------------------------------------------------------------------- */
/* construction (tokenizer_specials.c, tokenizer_bpe.c) */

/* Attributes, special ids and the end-of-generation set, after llama.cpp's load(). */
void cb_tokenizer_find_specials(cb_tokenizer_t *t, const cb_gguf_t *g);
/* The pre-tokenizer regexes of t->pre (none for SentencePiece). False with err when one does not compile. */
bool cb_tokenizer_compile_pretokenizer(cb_tokenizer_t *t, char *err, size_t errlen);

#endif
