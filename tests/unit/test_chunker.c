/* test_chunker: chunk boundaries (paragraph > sentence > budget), budget respected, content addressing
 * (a chunk's tokens do not depend on its neighbours), whitespace rules, hostile inputs; and the RAG
 * prompt pieces (ragprompt.h) against the anchors' strings. Uses the real model's tokenizer (skips
 * without it). */
#include <stdint.h>
#include <string.h>

#include "rag/chunker.h"
#include "format/gguf.h"
#include "rag/qa.h"
#include "rag/ragprompt.h"
#include "test.h"
#include "model/tokenizer.h"

static cb_gguf_t *g_gguf;
static cb_tokenizer_t *g_tok;

static int ntok(const char *s, size_t len) {
    int n = 0;
    int32_t *ids = cb_tokenizer_encode_alloc(g_tok, s, len, false, &n);
    free(ids);
    return n;
}

/* Common checks on a split: spans in order, inside the text, non-empty, within budget, counts exact. */
static int check_spans(const char *text, size_t len, const cb_chunk_span_t *sp, int n, int budget) {
    size_t prev_end = 0;
    for (int i = 0; i < n; i++) {
        if (sp[i].off < prev_end || sp[i].off + sp[i].len > len || sp[i].len == 0) return 0;
        if (sp[i].n_tokens > budget) return 0;
        if (sp[i].n_tokens != ntok(text + sp[i].off, sp[i].len)) return 0;
        prev_end = sp[i].off + sp[i].len;
    }
    return 1;
}

static char *repeat_sentences(int n, const char *fmt) {
    size_t cap = (size_t)n * 128 + 1, len = 0;
    char *s = malloc(cap);
    for (int i = 0; i < n; i++) len += (size_t)snprintf(s + len, cap - len, fmt, i, i * 7);
    return s;
}

TEST(small_document_is_one_verbatim_chunk) {
    if (!g_tok) SKIP("no model");
    char err[256];
    cb_chunker_t *c = cb_chunker_new(g_tok, 512, err, sizeof err);
    CHECK(c);
    const char *doc = "\n\nThe Amazon river flows through Brazil.\nIt is long.\n\n";
    cb_chunk_span_t *sp;
    int n;
    CHECK(cb_chunker_split(c, doc, strlen(doc), &sp, &n, err, sizeof err) == 0);
    CHECK(n == 1);
    /* leading white space kept, trailing dropped */
    CHECK(sp[0].off == 0);
    CHECK(sp[0].len == strlen(doc) - 2);
    free(sp);
    /* blank and empty documents: no chunks */
    CHECK(cb_chunker_split(c, " \n\t\n ", 5, &sp, &n, err, sizeof err) == 0 && n == 0 && sp == NULL);
    CHECK(cb_chunker_split(c, "", 0, &sp, &n, err, sizeof err) == 0 && n == 0);
    cb_chunker_destroy(&c);
    CHECK(c == NULL);
    cb_chunker_destroy(&c);
}

TEST(bad_arguments) {
    if (!g_tok) SKIP("no model");
    char err[256];
    CHECK(cb_chunker_new(g_tok, 1, err, sizeof err) == NULL);
    CHECK(strstr(err, "budget"));
    CHECK(cb_chunker_new(NULL, 64, err, sizeof err) == NULL);
}

TEST(paragraph_ends_preferred) {
    if (!g_tok) SKIP("no model");
    char err[256];
    /* paragraphs of ~30 tokens; budget 80: two paragraphs per chunk, each chunk ends at a paragraph end */
    char doc[8192];
    size_t len = 0;
    for (int p = 0; p < 8; p++) {
        len += (size_t)snprintf(doc + len, sizeof doc - len,
                                "Paragraph %d talks about topic %d. It has a second sentence here. And a third one "
                                "closes it.%s",
                                p, p * 3, p < 7 ? "\n\n" : "\n");
    }
    cb_chunker_t *c = cb_chunker_new(g_tok, 80, err, sizeof err);
    cb_chunk_span_t *sp;
    int n;
    CHECK(cb_chunker_split(c, doc, len, &sp, &n, err, sizeof err) == 0);
    CHECK(n >= 3);
    CHECK(check_spans(doc, len, sp, n, 80));
    for (int i = 0; i < n; i++) {
        /* every chunk starts at a paragraph start and ends at a paragraph end */
        CHECK_MSG(strncmp(doc + sp[i].off, "Paragraph", 9) == 0, "chunk %d starts '%.20s'", i, doc + sp[i].off);
        CHECK(doc[sp[i].off + sp[i].len - 1] == '.');
        size_t e = sp[i].off + sp[i].len;
        CHECK(e == len - 1 || (doc[e] == '\n' && doc[e + 1] == '\n'));
    }
    free(sp);
    cb_chunker_destroy(&c);
}

TEST(sentence_ends_when_no_paragraph) {
    if (!g_tok) SKIP("no model");
    char err[256];
    char *doc = repeat_sentences(60, "Sentence number %d mentions the value %d here. ");
    size_t len = strlen(doc);
    cb_chunker_t *c = cb_chunker_new(g_tok, 64, err, sizeof err);
    cb_chunk_span_t *sp;
    int n;
    CHECK(cb_chunker_split(c, doc, len, &sp, &n, err, sizeof err) == 0);
    CHECK(n > 5);
    CHECK(check_spans(doc, len, sp, n, 64));
    for (int i = 0; i < n; i++) {
        CHECK(strncmp(doc + sp[i].off, "Sentence", 8) == 0);
        CHECK(doc[sp[i].off + sp[i].len - 1] == '.');
    }
    /* every byte but the white space at split points is covered, in order */
    size_t covered = 0;
    for (int i = 0; i < n; i++) covered += sp[i].len;
    CHECK(covered + (size_t)n >= len - 1 && covered < len);
    free(sp);
    cb_chunker_destroy(&c);
    free(doc);
}

TEST(long_sentence_split_at_budget) {
    if (!g_tok) SKIP("no model");
    char err[256];
    /* one "sentence" without terminators: split at word boundaries under the budget */
    char *doc = repeat_sentences(80, "word%d and%d ");
    size_t len = strlen(doc);
    cb_chunker_t *c = cb_chunker_new(g_tok, 32, err, sizeof err);
    cb_chunk_span_t *sp;
    int n;
    CHECK(cb_chunker_split(c, doc, len, &sp, &n, err, sizeof err) == 0);
    CHECK(n > 3);
    CHECK(check_spans(doc, len, sp, n, 32));
    for (int i = 0; i < n; i++) {
        CHECK(sp[i].n_tokens >= 16); /* greedy: chunks are well filled */
        CHECK(strncmp(doc + sp[i].off, "word", 4) == 0 || strncmp(doc + sp[i].off, "and", 3) == 0);
    }
    free(sp);
    free(doc);
    /* no white space at all, multi-byte characters: cut at UTF-8 boundaries */
    size_t cap = 3 * 400 + 1;
    char *cjk = malloc(cap);
    for (int i = 0; i < 400; i++) memcpy(cjk + 3 * i, "\xe4\xb8\xad", 3); /* 中 */
    CHECK(cb_chunker_split(c, cjk, 1200, &sp, &n, err, sizeof err) == 0);
    CHECK(n > 1);
    CHECK(check_spans(cjk, 1200, sp, n, 32));
    for (int i = 0; i < n; i++) CHECK(sp[i].off % 3 == 0 && sp[i].len % 3 == 0);
    free(sp);
    free(cjk);
    cb_chunker_destroy(&c);
}

TEST(content_addressing) {
    if (!g_tok) SKIP("no model");
    char err[256];
    /* paragraphs of ~17 tokens under a budget of 24: one paragraph per chunk, so two documents sharing
     * paragraphs share those chunk texts exactly (and their tokens, encoded alone), whatever follows */
    const char *p1 = "Marie Curie researched radioactivity and won two Nobel prizes. She was born in Warsaw.";
    const char *p2 = "The Amazon river flows through Brazil into the Atlantic Ocean, carrying much water.";
    char a[2048], b[2048];
    snprintf(a, sizeof a, "%s\n\n%s\n\nA different ending about volcanoes in Tanzania and lava.\n", p1, p2);
    snprintf(b, sizeof b, "%s\n\n%s\n\nSaturn has prominent rings made mostly of ice particles.", p1, p2);
    cb_chunker_t *c = cb_chunker_new(g_tok, 24, err, sizeof err);
    cb_chunk_span_t *sa, *sb;
    int na, nb;
    CHECK(cb_chunker_split(c, a, strlen(a), &sa, &na, err, sizeof err) == 0);
    CHECK(cb_chunker_split(c, b, strlen(b), &sb, &nb, err, sizeof err) == 0);
    CHECK(na == 3 && nb == 3);
    for (int i = 0; i < 2; i++) {
        const char *want = i == 0 ? p1 : p2;
        CHECK(sa[i].len == strlen(want) && memcmp(a + sa[i].off, want, sa[i].len) == 0);
        CHECK(sb[i].len == strlen(want) && memcmp(b + sb[i].off, want, sb[i].len) == 0);
        CHECK(sa[i].n_tokens == sb[i].n_tokens);
    }
    free(sa);
    free(sb);
    cb_chunker_destroy(&c);
}

TEST(hostile_bytes) {
    if (!g_tok) SKIP("no model");
    char err[256];
    cb_chunker_t *c = cb_chunker_new(g_tok, 16, err, sizeof err);
    /* invalid UTF-8, NUL bytes, control characters, lone terminators */
    unsigned char junk[3000];
    uint32_t x = 12345;
    for (size_t i = 0; i < sizeof junk; i++) {
        x = x * 1103515245u + 12345u;
        junk[i] = (unsigned char)(x >> 16);
    }
    cb_chunk_span_t *sp;
    int n;
    CHECK(cb_chunker_split(c, (const char *)junk, TEST_SANITIZED ? 600 : sizeof junk, &sp, &n, err, sizeof err) == 0);
    CHECK(n > 0);
    size_t len = TEST_SANITIZED ? 600 : sizeof junk;
    for (int i = 0; i < n; i++) CHECK(sp[i].off + sp[i].len <= len && sp[i].n_tokens <= 16);
    free(sp);
    const char *dots = "... !!! ??? . . . \n\n\n\n .";
    CHECK(cb_chunker_split(c, dots, strlen(dots), &sp, &n, err, sizeof err) == 0);
    CHECK(check_spans(dots, strlen(dots), sp, n, 16));
    free(sp);
    cb_chunker_destroy(&c);
}

TEST(ragprompt_pieces) {
    if (!g_tok) SKIP("no model");
    char err[256];
    cb_ragprompt_t *r = cb_ragprompt_new(g_tok, "Be brief.", err, sizeof err);
    CHECK_MSG(r, "%s", err);
    int np;
    const int32_t *p = cb_ragprompt_prefix(r, &np);
    char *ptxt = cb_tokenizer_decode_alloc(g_tok, p, (size_t)np, true, NULL);
    char want[1024];
    snprintf(want, sizeof want, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n%s", cb_ragprompt_instruction());
    CHECK_MSG(strcmp(ptxt, want) == 0, "prefix '%s'", ptxt);
    free(ptxt);
    /* a passage chunk is exactly the anchors' cb_qa_chunk_text */
    char *pass = cb_ragprompt_passage("", "Some passage text.");
    CHECK(strcmp(pass, "\n\nSome passage text.") == 0);
    int nc;
    int32_t *ct = cb_ragprompt_chunk(r, pass, strlen(pass), &nc);
    char *qa = cb_ragprompt_chunk_text("", "Some passage text.");
    CHECK(nc == ntok(qa, strlen(qa)));
    int32_t *ref = cb_tokenizer_encode_alloc(g_tok, qa, strlen(qa), false, &np);
    CHECK(memcmp(ref, ct, (size_t)nc * sizeof(int32_t)) == 0);
    free(ref);
    free(qa);
    free(ct);
    free(pass);
    /* control-token text in a chunk is plain text */
    ct = cb_ragprompt_chunk(r, "<|im_end|>", 10, &nc);
    for (int i = 0; i < nc; i++) CHECK(ct[i] != 2 && ct[i] != 1);
    free(ct);
    int ns;
    int32_t *s = cb_ragprompt_suffix(r, "Who wrote Hamlet", &ns);
    char *stxt = cb_tokenizer_decode_alloc(g_tok, s, (size_t)ns, true, NULL);
    CHECK_MSG(strstr(stxt, "\nQuestion:who wrote Hamlet?\nAnswer:<|im_end|>\n<|im_start|>assistant\n"), "'%s'", stxt);
    free(stxt);
    free(s);
    cb_ragprompt_destroy(&r);
    CHECK(r == NULL);
    /* default system line */
    r = cb_ragprompt_new(g_tok, NULL, err, sizeof err);
    p = cb_ragprompt_prefix(r, &np);
    ptxt = cb_tokenizer_decode_alloc(g_tok, p, (size_t)np, true, NULL);
    CHECK(strstr(ptxt, "You are a helpful AI assistant named SmolLM"));
    free(ptxt);
    cb_ragprompt_destroy(&r);
}

int main(void) {
    const char *path = test_model_path();
    char err[256];
    if (path) {
        g_gguf = cb_gguf_open(path, err, sizeof err);
        if (g_gguf) g_tok = cb_tokenizer_new_from_gguf(g_gguf, err, sizeof err);
    }
    RUN(small_document_is_one_verbatim_chunk);
    RUN(bad_arguments);
    RUN(paragraph_ends_preferred);
    RUN(sentence_ends_when_no_paragraph);
    RUN(long_sentence_split_at_budget);
    RUN(content_addressing);
    RUN(hostile_bytes);
    RUN(ragprompt_pieces);
    cb_tokenizer_destroy(&g_tok);
    cb_gguf_destroy(&g_gguf);
    return test_summary();
}
