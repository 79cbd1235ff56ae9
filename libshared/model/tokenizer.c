/* tokenizer.c: byte-level BPE ("smollm", "qwen2", "llama-bpe") and SentencePiece-style ("llama") GGUF
 * vocabularies, matching llama.cpp token for token (see tokenizer.h).
 *
 * What llama.cpp does (src/llama-vocab.cpp, src/unicode.cpp) and how the tokenizer mirrors it:
 *   - token attributes: the GGUF's token types, then the tokens llama.cpp finds by text (EOT/EOM, FIM
 *     markers, the EOG list) get the control attribute added; that attribute decides what parse_special
 *     = false leaves as text and what decoding hides (attr_of());
 *   - special-token partition on raw bytes: longest special texts first, leftmost occurrences, each
 *     cut fragment tokenized on its own (partition());
 *   - BPE: lenient UTF-8 decoding per fragment: a byte that does not start a complete sequence becomes
 *     U+FFFD; overlong forms and surrogates are accepted and re-encoded canonically
 *     (cb_tokenizer_encode_bpe());
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
 *
 * The files: this one loads a vocabulary from a GGUF (the object's lifetime), decodes and answers the
 * lookups; tokenizer_specials.c finds the special ids and the end-of-generation set; tokenizer_encode.c
 * partitions the text and runs each fragment through tokenizer_bpe.c (the pre-tokenizer regexes, merging
 * by rank) or tokenizer_spm.c (merging by score); tokenizer_internal.h holds what they share.
 */
#include "model/tokenizer_internal.h"
#include "base/alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "base/log.h"
#include "base/utf8.h"
#include "model/chat.h"

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

/* ---------------------------------------------------------------------------------------------- */
/* hash table inserts (the lookups are in tokenizer_internal.h) */

/* Later duplicates win, as in llama.cpp (token_to_id[text] = i). */
static void vocab_insert(cb_tokenizer_t *t, int32_t id) {
    const char *s = t->tok_arena + t->tok_off[id];
    size_t n = t->tok_len[id];
    uint64_t h = cb_tokenizer_hash(s, n, 0);
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

/* The first occurrence keeps its rank, as in llama.cpp (bpe_ranks.emplace). */
static void merge_insert(cb_tokenizer_t *t, int32_t r) {
    const char *s = t->merge_arena + t->merge_off[r];
    size_t n = t->merge_len[r], split = t->merge_split[r];
    uint64_t h = cb_tokenizer_hash(s, n, split);
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
        uint32_t cp = cb_tokenizer_utf8_get_lenient((const unsigned char *)s, n, i, &adv);
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

static int cmp_special(const void *a, const void *b, void *ctx) {
    const cb_tokenizer_t *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (t->tok_len[x] != t->tok_len[y]) return t->tok_len[x] > t->tok_len[y] ? -1 : 1;
    return x < y ? -1 : x > y;
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
            t->byte_tok[b] = cb_tokenizer_vocab_lookup(t, &c, 1);
        }
        if (!read_merges(t, g, err, errlen)) goto fail;
    } else {
        if (!read_scores(t, g, err, errlen)) goto fail;
        for (int b = 0; b < 256; b++) { /* llama.cpp's byte_to_token: <0xNN>, else the 1-byte text */
            char hex[8], c = (char)b;
            snprintf(hex, sizeof hex, "<0x%02X>", b);
            t->byte_tok[b] = cb_tokenizer_vocab_lookup_str(t, hex);
            if (t->byte_tok[b] < 0) t->byte_tok[b] = cb_tokenizer_vocab_lookup(t, &c, 1);
        }
    }

    cb_tokenizer_find_specials(t, g);

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

    if (!cb_tokenizer_compile_pretokenizer(t, err, errlen)) goto fail;

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
    return cb_tokenizer_vocab_lookup(self, text ? text : "", len);
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

