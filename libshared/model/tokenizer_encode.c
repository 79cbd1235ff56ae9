/* tokenizer_encode.c: encoding text to ids: the special-token partition (llama.cpp's
 * tokenizer_st_partition), then each raw fragment through BPE (tokenizer_bpe.c) or SentencePiece
 * (tokenizer_spm.c), in one workspace per call. Part of the tokenizer (tokenizer_internal.h). */
#include "model/tokenizer_internal.h"
#include "base/alloc.h"

#include <stdlib.h>
#include <string.h>

/* Word workspace for n symbols (the heap holds at most n initial pairs plus two per merge). */
bool cb_tokenizer_ensure_word(enc_t *e, size_t n) {
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

/* Fragment workspace for n input bytes (3 output bytes per input byte, plus a 3-byte space prefix). */
bool cb_tokenizer_ensure_norm(enc_t *e, size_t n) {
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
            cb_tokenizer_emit(&e, f[i].id);
            prev_special = true;
        } else if (self->kind == KIND_SPM) {
            cb_tokenizer_encode_spm(&e, (const unsigned char *)text + f[i].off, f[i].len, self->add_space_prefix && prev_special);
            prev_special = false;
        } else {
            cb_tokenizer_encode_bpe(&e, (const unsigned char *)text + f[i].off, f[i].len);
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
