/* tokenizer_spm.c: SentencePiece-style encoding ("llama" vocabularies), as llm_tokenizer_spm_session: an
 * optional leading space, spaces to U+2581, symbols cut at UTF-8 lead-byte lengths, adjacent pairs merged
 * by score with a max-heap, byte fallback for a final symbol that is not a token. Part of the tokenizer
 * (tokenizer_internal.h). */
#include "model/tokenizer_internal.h"

#include <string.h>

/* llama.cpp's unicode_len_utf8: the length a lead byte announces, from its top four bits only
 * (continuation bytes count 1, F8..FF count 4). SentencePiece symbols are cut with it, unvalidated. */
static size_t lead_len(unsigned char c) {
    static const uint8_t len[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return len[c >> 4];
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
    int32_t id = cb_tokenizer_lookup_text(e, (const char *)e->norm + a->start, size);
    if (id < 0) return;
    spm_push(e->heap, hn, (spm_bigram_t){e->t->score[id], l, r, size});
}

/* One raw SentencePiece fragment: [space] + text with spaces escaped, merged by score, byte fallback. */
void cb_tokenizer_encode_spm(enc_t *e, const unsigned char *s, size_t n, bool prefix_space) {
    const cb_tokenizer_t *t = e->t;
    if (!cb_tokenizer_ensure_norm(e, n)) {
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
    if (!cb_tokenizer_ensure_word(e, n_sym)) {
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
        int32_t id = cb_tokenizer_lookup_text(e, (const char *)e->norm + sy->start, sy->n);
        if (id >= 0) {
            cb_tokenizer_emit(e, id);
            continue;
        }
        for (uint32_t j = 0; j < sy->n; j++) { /* byte fallback; a byte without a token is dropped */
            int32_t bt = t->byte_tok[e->norm[sy->start + j]];
            if (bt >= 0) cb_tokenizer_emit(e, bt);
        }
    }
}
