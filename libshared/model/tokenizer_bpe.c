/* tokenizer_bpe.c: byte-level BPE ("smollm", "qwen2", "llama-bpe"): the pre-tokenizer regexes (PCRE2),
 * the lenient UTF-8 normalisation of a fragment, its split into words, and the merge of each word by rank
 * with a min-heap. Part of the tokenizer (tokenizer_internal.h; the file comment of tokenizer.c says how
 * each step mirrors llama.cpp). */
#include "model/tokenizer_internal.h"

#include "base/err.h"
#include "base/utf8.h"

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

/* smollm: the digit splitter and the GPT-2 pattern; qwen2, llama-bpe: one pattern; SentencePiece: none. */
bool cb_tokenizer_compile_pretokenizer(cb_tokenizer_t *t, char *err, size_t errlen) {
    if (t->pre == PRE_SMOLLM) {
        if (!regex_compile(&t->re_digit, PAT_DIGIT, err, errlen) || !regex_compile(&t->re_main, PAT_GPT2, err, errlen))
            return false;
    } else if (t->pre == PRE_QWEN2 || t->pre == PRE_LLAMA3) {
        if (!regex_compile(&t->re_main, t->pre == PRE_QWEN2 ? PAT_QWEN2 : PAT_LLAMA3, err, errlen)) return false;
    }
    return true;
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
    int32_t rank = cb_tokenizer_merge_lookup(e->t, e->mapped + a->start, a->n + b->n, a->n);
    if (rank < 0) return;
    heap_push(e->heap, hn, (bigram_t){rank, l, r, a->n, b->n});
}

/* BPE of one pre-tokenized word w[0..n) (bytes), appending its ids. */
static void bpe_word(enc_t *e, const unsigned char *w, size_t n) {
    const cb_tokenizer_t *t = e->t;
    if (!cb_tokenizer_ensure_word(e, n)) {
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
        int32_t id = cb_tokenizer_lookup_text(e, e->mapped, off);
        if (id >= 0) {
            cb_tokenizer_emit(e, id);
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
        int32_t id = cb_tokenizer_lookup_text(e, e->mapped + s->start, s->n);
        if (id >= 0) {
            cb_tokenizer_emit(e, id);
            continue;
        }
        for (uint32_t k = 0; k < s->n; k++) {   /* llama.cpp: byte by byte, unknown bytes dropped */
            int32_t bt = t->byte_tok[(unsigned char)e->mapped[s->start + k]];
            if (bt >= 0 && !(!e->parse_special && (t->tok_attr[bt] & A_HIDDEN))) cb_tokenizer_emit(e, bt);
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

/* One raw BPE fragment (no special tokens inside): normalize, split (digits first for smollm), BPE. */
void cb_tokenizer_encode_bpe(enc_t *e, const unsigned char *s, size_t n) {
    if (!cb_tokenizer_ensure_norm(e, n)) {
        e->failed = true;
        return;
    }
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        size_t adv;
        uint32_t cp = cb_tokenizer_utf8_get_lenient(s, n, i, &adv);
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
