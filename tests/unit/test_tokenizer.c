/* test_tokenizer: libshared/model/tokenizer against llama.cpp's golden ids, one file per vocabulary
 * (tests/fixtures/tokenizer.jsonl for SmolLM2, tokenizer-<vocab>.jsonl for Qwen2.5, llama-bpe, Llama 3,
 * Gemma 3 and the Llama 2 SentencePiece vocabulary; made by scripts/make-fixtures; a file whose vocabulary
 * GGUF is absent is skipped: scripts/fetch-model.sh --vocab-only all), plus model-free checks on tiny
 * synthetic GGUFs built in memory: BPE merge order, the qwen2/llama-bpe pre-tokenizers, SentencePiece
 * score order, byte fallback and space prefix, special-token parsing on/off, invalid UTF-8, buffer-size
 * errors, bad metadata. */
#include <jansson.h>
#include <stdint.h>

#include "base/clock.h"
#include "format/gguf.h"
#include "test.h"
#include "model/tokenizer.h"

#define FIXTURE "tests/fixtures/tokenizer.jsonl"

/* ---------------------------------------------------------------------------------------------- */
/* a tiny GGUF writer (metadata only, no tensors) */

#include "gguf_writer.h"

/* GPT-2 byte-to-unicode code point of byte b. */
static unsigned byte_cp(int b) {
    int n = 0;
    for (int c = 0; c < 256; c++) {
        bool direct = (c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
        if (c == b) return direct ? (unsigned)c : 256u + (unsigned)n;
        if (!direct) n++;
    }
    return 0;
}

static void cp_utf8(unsigned cp, char *o) {
    if (cp < 0x80) { o[0] = (char)cp; o[1] = 0; }
    else { o[0] = (char)(0xC0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3F)); o[2] = 0; }
}

/* Synthetic vocabulary: 3 control tokens, the 256 byte symbols except byte 0x04, a few merges.
 * ids: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>, 3..257 byte symbols, then merged tokens. */
static const char *const MERGES[] = {"h e", "Ġ t", "Ġt he", "l l", "e ll", "he ll", "hell o", "Ġ Ġ"};
static const char *const MERGED[] = {"he", "Ġt", "Ġthe", "ll", "ell", "hell", "hello", "ĠĠ"};

static cb_gguf_t *make_gguf(const char *model, const char *pre, buf_t *b, bool with_types) {
    char *toks[300];
    int32_t types[300];
    size_t n = 0;
    toks[n] = strdup("<|endoftext|>"); types[n++] = 3;
    toks[n] = strdup("<|im_start|>"); types[n++] = 3;
    toks[n] = strdup("<|im_end|>"); types[n++] = 3;
    for (int c = 0; c < 256; c++) {
        if (c == 4) continue;
        toks[n] = malloc(4);
        cp_utf8(byte_cp(c), toks[n]);
        types[n++] = 1;
    }
    for (size_t i = 0; i < sizeof MERGED / sizeof *MERGED; i++) { toks[n] = strdup(MERGED[i]); types[n++] = 1; }
    b->n = 0;
    put(b, "GGUF", 4);
    put_u32(b, 3);
    put_u64(b, 0);                       /* tensors */
    put_u64(b, with_types ? 7 : 6);      /* kv pairs */
    kv_str(b, "tokenizer.ggml.model", model);
    kv_str(b, "tokenizer.ggml.pre", pre);
    kv_strs(b, "tokenizer.ggml.tokens", toks, n);
    if (with_types) kv_i32s(b, "tokenizer.ggml.token_type", types, n);
    kv_strs(b, "tokenizer.ggml.merges", (char **)MERGES, sizeof MERGES / sizeof *MERGES);
    kv_u32(b, "tokenizer.ggml.bos_token_id", 1);
    kv_u32(b, "tokenizer.ggml.eos_token_id", 2);
    for (size_t i = 0; i < n; i++) free(toks[i]);
    char err[256];
    cb_gguf_t *g = cb_gguf_open_mem(b->p, b->n, err, sizeof err);
    if (!g) fprintf(stderr, "  synthetic gguf: %s\n", err);
    return g;
}

static cb_tokenizer_t *synthetic(buf_t *b) {
    cb_gguf_t *g = make_gguf("gpt2", "smollm", b, true);
    if (!g) return NULL;
    char err[256];
    cb_tokenizer_t *t = cb_tokenizer_new_from_gguf(g, err, sizeof err);
    if (!t) fprintf(stderr, "  synthetic tokenizer: %s\n", err);
    cb_gguf_destroy(&g);
    return t;
}

static int32_t id_of(const cb_tokenizer_t *t, const char *s) { return cb_tokenizer_find(t, s, strlen(s)); }

/* ---------------------------------------------------------------------------------------------- */
/* model-free tests */

TEST(synthetic_merges) {
    buf_t b = {0};
    cb_tokenizer_t *t = synthetic(&b);
    CHECK(t);
    int32_t ids[64];
    int n = cb_tokenizer_encode(t, " the", 4, false, ids, 64);
    CHECK(n == 1 && ids[0] == id_of(t, "Ġthe"));
    n = cb_tokenizer_encode(t, "hello the", 9, false, ids, 64);
    CHECK_MSG(n == 2 && ids[0] == id_of(t, "hello") && ids[1] == id_of(t, "Ġthe"), "n=%d", n);
    /* rank order: "he" (rank 0) beats "ll" (3): h e l l o -> he l l o -> he ll o -> hell o -> hello */
    n = cb_tokenizer_encode(t, "thello", 6, false, ids, 64);
    CHECK(n == 2 && ids[0] == id_of(t, "t") && ids[1] == id_of(t, "hello"));
    /* digits split one by one; whitespace run keeps its last space for the word */
    n = cb_tokenizer_encode(t, "12  the", 7, false, ids, 64);
    CHECK_MSG(n == 4 && ids[0] == id_of(t, "1") && ids[1] == id_of(t, "2") && ids[2] == id_of(t, "Ġ") &&
              ids[3] == id_of(t, "Ġthe"), "n=%d", n);
    /* byte 0x04 has no symbol token: dropped, as llama.cpp does */
    n = cb_tokenizer_encode(t, "a\x04" "b", 3, false, ids, 64);
    CHECK(n == 2 && ids[0] == id_of(t, "a") && ids[1] == id_of(t, "b"));
    CHECK(cb_tokenizer_bos(t) == 1 && cb_tokenizer_eos(t) == 2 && cb_tokenizer_eot(t) == 0);
    CHECK(cb_tokenizer_is_eog(t, 0) && cb_tokenizer_is_eog(t, 2) && !cb_tokenizer_is_eog(t, 1));
    CHECK(!cb_tokenizer_add_bos(t));
    cb_tokenizer_destroy(&t);
    CHECK(t == NULL);
    cb_tokenizer_destroy(&t);
    cb_tokenizer_destroy(NULL);
    free(b.p);
}

TEST(special_on_off) {
    buf_t b = {0};
    cb_tokenizer_t *t = synthetic(&b);
    CHECK(t);
    const char *s = "x<|im_start|>the<|im_end|><|endoftext|>";
    int32_t ids[128];
    int n = cb_tokenizer_encode(t, s, strlen(s), true, ids, 128);
    CHECK_MSG(n == 6 && ids[0] == id_of(t, "x") && ids[1] == 1 && ids[2] == id_of(t, "t") &&
              ids[3] == id_of(t, "he") && ids[4] == 2 && ids[5] == 0, "n=%d", n);
    n = cb_tokenizer_encode(t, s, strlen(s), true, ids, 128);
    int n2 = cb_tokenizer_encode(t, s, strlen(s), false, ids, 128);
    CHECK(n2 > n);
    for (int i = 0; i < n2; i++) CHECK_MSG(ids[i] > 2, "special id %d at %d with parse_special off", ids[i], i);
    /* decoding: control text only when asked */
    int32_t seq[3] = {1, id_of(t, "hello"), 2};
    char out[64];
    CHECK(cb_tokenizer_decode(t, seq, 3, false, out, sizeof out) == 5 && !strcmp(out, "hello"));
    CHECK(cb_tokenizer_decode(t, seq, 3, true, out, sizeof out) == 27 &&
          !strcmp(out, "<|im_start|>hello<|im_end|>"));
    cb_tokenizer_destroy(&t);
    free(b.p);
}

TEST(buffer_sizes_and_errors) {
    buf_t b = {0};
    cb_tokenizer_t *t = synthetic(&b);
    CHECK(t);
    const char *s = "hello the hello the 123";
    int need = cb_tokenizer_encode(t, s, strlen(s), false, NULL, 0);
    CHECK(need < 0 && need > CB_TOKENIZER_EINTERNAL);
    need = -need;
    int32_t ids[64];
    for (int i = 0; i < 64; i++) ids[i] = -7;
    int r = cb_tokenizer_encode(t, s, strlen(s), false, ids, need - 1);
    CHECK(r == -need);
    CHECK_MSG(ids[need - 1] == -7, "wrote past max_out");
    CHECK(cb_tokenizer_encode(t, s, strlen(s), false, ids, need) == need);
    CHECK(cb_tokenizer_encode(NULL, s, 1, false, ids, 64) == CB_TOKENIZER_EINVAL);
    CHECK(cb_tokenizer_encode(t, NULL, 1, false, ids, 64) == CB_TOKENIZER_EINVAL);
    CHECK(cb_tokenizer_encode(t, NULL, 0, false, ids, 64) == 0);
    CHECK(cb_tokenizer_encode(t, s, 1, false, NULL, 5) == CB_TOKENIZER_EINVAL);
    CHECK(cb_tokenizer_encode(t, "", 0, true, ids, 0) == 0);
    /* decode: snprintf semantics, bad ids */
    char out[4];
    int32_t h[1] = {id_of(t, "hello")};
    CHECK(cb_tokenizer_decode(t, h, 1, false, out, sizeof out) == 5 && !strcmp(out, "hel"));
    CHECK(cb_tokenizer_decode(t, h, 1, false, NULL, 0) == 5);
    int32_t bad[2] = {0, 999999};
    CHECK(cb_tokenizer_decode(t, bad, 2, false, out, sizeof out) == -1);
    bad[1] = -1;
    CHECK(cb_tokenizer_decode(t, bad, 2, false, out, sizeof out) == -1);
    CHECK(cb_tokenizer_token_bytes(t, -1, false, NULL) == NULL);
    CHECK(cb_tokenizer_token_bytes(t, cb_tokenizer_n_vocab(t), false, NULL) == NULL);
    cb_tokenizer_destroy(&t);
    free(b.p);
}

TEST(rejects_bad_metadata) {
    buf_t b = {0};
    char err[256];
    cb_gguf_t *g = make_gguf("gpt2", "deepseek-llm", &b, true);
    CHECK(g);
    cb_tokenizer_t *t = cb_tokenizer_new_from_gguf(g, err, sizeof err);
    cb_gguf_destroy(&g);
    CHECK(t == NULL);
    CHECK_MSG(strstr(err, "tokenizer.ggml.pre") && strstr(err, "deepseek-llm") && strstr(err, "not supported"),
              "err: %s", err);
    g = make_gguf("bert", "smollm", &b, true);
    CHECK(g);
    t = cb_tokenizer_new_from_gguf(g, err, sizeof err);
    cb_gguf_destroy(&g);
    CHECK_MSG(t == NULL && strstr(err, "tokenizer.ggml.model") && strstr(err, "bert") && strstr(err, "gpt2"),
              "err: %s", err);
    g = make_gguf("gpt2", "smollm", &b, false);   /* no token types: all normal, no specials */
    CHECK(g);
    t = cb_tokenizer_new_from_gguf(g, err, sizeof err);
    cb_gguf_destroy(&g);
    CHECK(t);
    int32_t ids[64];
    int n = cb_tokenizer_encode(t, "<|im_start|>", 12, true, ids, 64);
    CHECK(n > 1);
    cb_tokenizer_destroy(&t);
    CHECK(cb_tokenizer_new_from_gguf(NULL, err, sizeof err) == NULL);
    /* an unknown chat template name fails construction; a missing template does not */
    g = make_gguf("gpt2", "smollm", &b, true);
    CHECK(g);
    t = cb_tokenizer_new_from_gguf_opts(g, "vicuna", err, sizeof err);
    CHECK_MSG(t == NULL && strstr(err, "vicuna") && strstr(err, "chatml"), "err: %s", err);
    t = cb_tokenizer_new_from_gguf(g, err, sizeof err);
    CHECK(t && cb_tokenizer_chat_template_name(t) == NULL && strstr(cb_tokenizer_chat_template_error(t), "chat_template"));
    cb_tokenizer_destroy(&t);
    t = cb_tokenizer_new_from_gguf_opts(g, "chatml", err, sizeof err);
    CHECK(t && !strcmp(cb_tokenizer_chat_template_name(t), "chatml") && !*cb_tokenizer_chat_template_error(t));
    cb_tokenizer_destroy(&t);
    cb_gguf_destroy(&g);
    free(b.p);
}

/* ---------------------------------------------------------------------------------------------- */
/* the qwen2 and llama-bpe pre-tokenizers on a synthetic vocabulary */

/* The synthetic BPE vocabulary plus whole-word tokens no merge reaches ("123", "xyz"). */
static cb_tokenizer_t *synthetic_pre(const char *pre, buf_t *b) {
    char *toks[300];
    int32_t types[300];
    size_t n = 0;
    toks[n] = strdup("<|endoftext|>"); types[n++] = 3;
    for (int c = 0; c < 256; c++) {
        toks[n] = malloc(4);
        cp_utf8(byte_cp(c), toks[n]);
        types[n++] = 1;
    }
    toks[n] = strdup("123"); types[n++] = 1;
    toks[n] = strdup("xyz"); types[n++] = 1;
    toks[n] = strdup("Ġt"); types[n++] = 1;
    static const char *const merges[] = {"Ġ t"};
    b->n = 0;
    put(b, "GGUF", 4);
    put_u32(b, 3);
    put_u64(b, 0);
    put_u64(b, 5);
    kv_str(b, "tokenizer.ggml.model", "gpt2");
    kv_str(b, "tokenizer.ggml.pre", pre);
    kv_strs(b, "tokenizer.ggml.tokens", toks, n);
    kv_i32s(b, "tokenizer.ggml.token_type", types, n);
    kv_strs(b, "tokenizer.ggml.merges", (char **)merges, 1);
    for (size_t i = 0; i < n; i++) free(toks[i]);
    char err[256];
    cb_gguf_t *g = cb_gguf_open_mem(b->p, b->n, err, sizeof err);
    cb_tokenizer_t *t = g ? cb_tokenizer_new_from_gguf(g, err, sizeof err) : NULL;
    if (!t) fprintf(stderr, "  synthetic %s: %s\n", pre, err);
    cb_gguf_destroy(&g);
    return t;
}

static bool ids_are(const cb_tokenizer_t *t, const char *text, const char *const *want, int n_want) {
    int32_t ids[64];
    int n = cb_tokenizer_encode(t, text, strlen(text), false, ids, 64);
    if (n != n_want) {
        fprintf(stderr, "  \"%s\": %d ids, want %d\n", text, n, n_want);
        return false;
    }
    for (int i = 0; i < n; i++)
        if (ids[i] != id_of(t, want[i])) {
            fprintf(stderr, "  \"%s\": id %d is %d, want \"%s\"\n", text, i, ids[i], want[i]);
            return false;
        }
    return true;
}

TEST(qwen2_and_llama_bpe_pretokenizers) {
    buf_t b = {0};
    cb_tokenizer_t *q = synthetic_pre("qwen2", &b);
    CHECK(q);
    cb_tokenizer_t *l = synthetic_pre("llama-bpe", &b);
    CHECK(l);
    cb_tokenizer_t *l3 = synthetic_pre("llama3", &b);   /* an alias llama.cpp accepts */
    CHECK(l3);
    CHECK(!strcmp(cb_tokenizer_pre_name(q), "qwen2") && !strcmp(cb_tokenizer_pre_name(l), "llama-bpe") &&
          !strcmp(cb_tokenizer_pre_name(l3), "llama-bpe") && !strcmp(cb_tokenizer_model_name(q), "gpt2"));
    /* digits: qwen2 one by one; llama-bpe in runs of up to three, and a run that is a token stays whole */
    CHECK(ids_are(q, "12345", (const char *const[]){"1", "2", "3", "4", "5"}, 5));
    CHECK(ids_are(l, "12345", (const char *const[]){"123", "4", "5"}, 3));
    /* a word that is a token: llama-bpe emits it (ignore_merges), qwen2 merges (no merge here) */
    CHECK(ids_are(l, "xyz", (const char *const[]){"xyz"}, 1));
    CHECK(ids_are(q, "xyz", (const char *const[]){"x", "y", "z"}, 3));
    /* " t" merges across the space; "\n\n" stays one word; a letter run takes one leading non-letter */
    CHECK(ids_are(q, "a t", (const char *const[]){"a", "Ġt"}, 2));
    CHECK(ids_are(q, ".t", (const char *const[]){".", "t"}, 2));
    CHECK(!cb_tokenizer_add_bos(q) && cb_tokenizer_add_bos(l));   /* llama.cpp's defaults without the key */
    cb_tokenizer_destroy(&q);
    cb_tokenizer_destroy(&l);
    cb_tokenizer_destroy(&l3);
    free(b.p);
}

/* ---------------------------------------------------------------------------------------------- */
/* SentencePiece on a synthetic vocabulary */

/* ids: 0 <unk>, 1 <s>, 2 </s>, 3..258 <0x00>..<0xFF>, then the pieces below (score in brackets). */
static const struct { const char *text; float score; int type; } SPM_PIECES[] = {
    {"\xE2\x96\x81", -1, 1}, {"a", -2, 1}, {"b", -2, 1}, {"c", -2, 1}, {"x", -2, 1}, {"y", -2, 1},
    {"\xE2\x96\x81" "a", -3, 1}, {"ab", -5, 1}, {"bc", -4, 1}, {"aa", -6, 1}, {"\xE2\x96\x81" "ab", -7, 1},
    {"<", -2, 1}, {"s", -2, 1}, {">", -2, 1}, {"<s", -3, 1}, {"<u>", 0, 4},
};

static cb_tokenizer_t *synthetic_spm(buf_t *b, int add_space_prefix /* -1: no key */) {
    char *toks[300];
    int32_t types[300];
    float scores[300];
    size_t n = 0;
    toks[n] = strdup("<unk>"); types[n] = 2; scores[n++] = 0;
    toks[n] = strdup("<s>"); types[n] = 3; scores[n++] = 0;
    toks[n] = strdup("</s>"); types[n] = 3; scores[n++] = 0;
    for (int c = 0; c < 256; c++) {
        toks[n] = malloc(8);
        snprintf(toks[n], 8, "<0x%02X>", c);
        types[n] = 6;
        scores[n++] = 0;
    }
    for (size_t i = 0; i < sizeof SPM_PIECES / sizeof *SPM_PIECES; i++) {
        toks[n] = strdup(SPM_PIECES[i].text);
        types[n] = SPM_PIECES[i].type;
        scores[n++] = SPM_PIECES[i].score;
    }
    b->n = 0;
    put(b, "GGUF", 4);
    put_u32(b, 3);
    put_u64(b, 0);
    put_u64(b, add_space_prefix < 0 ? 6 : 7);
    kv_str(b, "tokenizer.ggml.model", "llama");
    kv_strs(b, "tokenizer.ggml.tokens", toks, n);
    kv_i32s(b, "tokenizer.ggml.token_type", types, n);
    put_gstr(b, "tokenizer.ggml.scores"); put_u32(b, CB_GGUF_ARRAY); put_u32(b, CB_GGUF_F32); put_u64(b, n);
    put(b, scores, 4 * n);
    kv_u32(b, "tokenizer.ggml.bos_token_id", 1);
    kv_u32(b, "tokenizer.ggml.eos_token_id", 2);
    if (add_space_prefix >= 0) {
        put_gstr(b, "tokenizer.ggml.add_space_prefix"); put_u32(b, CB_GGUF_BOOL);
        uint8_t v = (uint8_t)add_space_prefix;
        put(b, &v, 1);
    }
    for (size_t i = 0; i < n; i++) free(toks[i]);
    char err[256];
    cb_gguf_t *g = cb_gguf_open_mem(b->p, b->n, err, sizeof err);
    cb_tokenizer_t *t = g ? cb_tokenizer_new_from_gguf(g, err, sizeof err) : NULL;
    if (!t) fprintf(stderr, "  synthetic spm: %s\n", err);
    cb_gguf_destroy(&g);
    return t;
}

#define SP "\xE2\x96\x81"

TEST(spm_synthetic) {
    buf_t b = {0};
    cb_tokenizer_t *t = synthetic_spm(&b, 0);   /* no space prefix (Gemma's setting) */
    CHECK(t);
    CHECK(!strcmp(cb_tokenizer_model_name(t), "llama") && !cb_tokenizer_add_space_prefix(t) && cb_tokenizer_add_bos(t));
    /* score order: "bc" (-4) beats "ab" (-5); nothing merges a + bc */
    CHECK(ids_are(t, "abc", (const char *const[]){"a", "bc"}, 2));
    /* equal scores: the leftmost pair first */
    CHECK(ids_are(t, "aaa", (const char *const[]){"aa", "a"}, 2));
    /* spaces become U+2581 and merge like any symbol */
    CHECK(ids_are(t, "x ab", (const char *const[]){"x", SP "ab"}, 2));
    /* byte fallback: a character without a token, and invalid UTF-8, become <0xNN> */
    CHECK(ids_are(t, "\xC3\xA9", (const char *const[]){"<0xC3>", "<0xA9>"}, 2));
    CHECK(ids_are(t, "a\xFF", (const char *const[]){"a", "<0xFF>"}, 2));
    /* a user-defined token is cut out even with special parsing off */
    CHECK(ids_are(t, "x<u>y", (const char *const[]){"x", "<u>", "y"}, 3));
    /* the control token <s> is never built from plain text (llama.cpp's merge would: "<s" + ">") */
    int32_t ids[16];
    int n = cb_tokenizer_encode(t, "<s>", 3, false, ids, 16);
    CHECK_MSG(n == 2 && ids[0] == id_of(t, "<s") && ids[1] == id_of(t, ">"), "n=%d", n);
    n = cb_tokenizer_encode(t, "<s>", 3, true, ids, 16);
    CHECK(n == 1 && ids[0] == 1);
    CHECK(cb_tokenizer_is_control(t, 1) && !cb_tokenizer_is_control(t, id_of(t, "<u>")) &&
          cb_tokenizer_is_special(t, id_of(t, "<u>")));
    /* decoding: U+2581 back to a space, byte tokens to bytes */
    char out[32];
    int32_t seq[3] = {id_of(t, "x"), id_of(t, SP "ab"), id_of(t, "<0xC3>")};
    CHECK(cb_tokenizer_decode(t, seq, 3, false, out, sizeof out) == 5 && !memcmp(out, "x ab\xC3", 5));
    cb_tokenizer_destroy(&t);

    t = synthetic_spm(&b, -1);   /* no key: llama.cpp's default for this model is a space prefix */
    CHECK(t && cb_tokenizer_add_space_prefix(t));
    CHECK(ids_are(t, "ab", (const char *const[]){SP "ab"}, 1));
    CHECK(ids_are(t, "a", (const char *const[]){SP "a"}, 1));
    /* each fragment after a special token gets its own prefix */
    n = cb_tokenizer_encode(t, "a</s>a", 6, true, ids, 16);
    CHECK(n == 3 && ids[0] == id_of(t, SP "a") && ids[1] == 2 && ids[2] == id_of(t, SP "a"));
    /* decode drops the first token's leading space, so one encode round-trips */
    n = cb_tokenizer_encode(t, "ab ab", 5, false, ids, 16);
    CHECK(n == 2 && cb_tokenizer_decode(t, ids, 2, false, out, sizeof out) == 5 && !strcmp(out, "ab ab"));
    CHECK(cb_tokenizer_decode(t, ids, 1, false, NULL, 0) == 2);
    cb_tokenizer_destroy(&t);
    free(b.p);
}

/* Deterministic pseudo-random bytes (no libc rand state shared with others). */
static uint32_t lcg(uint32_t *s) { *s = *s * 1664525u + 1013904223u; return *s >> 8; }

static void invalid_utf8_on(const cb_tokenizer_t *t, int rounds) {
    uint32_t seed = 12345;
    unsigned char buf[80];
    int32_t ids[256];
    for (int r = 0; r < rounds; r++) {
        size_t n = lcg(&seed) % sizeof buf;
        for (size_t i = 0; i < n; i++) {
            uint32_t x = lcg(&seed);
            buf[i] = (x & 3) ? (unsigned char)(0x80 | (x >> 8)) : (unsigned char)(x >> 8);
        }
        int k = cb_tokenizer_encode(t, (const char *)buf, n, (r & 1) != 0, ids, 256);
        if (k < 0) { fprintf(stderr, "  round %d: encode returned %d\n", r, k); abort(); }
        for (int i = 0; i < k; i++)
            if (ids[i] < 0 || ids[i] >= cb_tokenizer_n_vocab(t)) { fprintf(stderr, "  bad id\n"); abort(); }
        char out[1024];
        if (cb_tokenizer_decode(t, ids, (size_t)k, true, out, sizeof out) < 0) abort();
    }
    /* every single byte, and the > U+10FFFF forms llama.cpp itself aborts on */
    for (int c = 0; c < 256; c++) {
        char s[1] = {(char)c};
        if (cb_tokenizer_encode(t, s, 1, false, ids, 256) < 0) abort();
    }
    const char *odd[] = {"\xF5\x80\x80\x80", "\xF7\xBF\xBF\xBF", "\xF4\x90\x80\x80", "\xED\xA0\x80", "\xC0\x80"};
    for (size_t i = 0; i < sizeof odd / sizeof *odd; i++)
        if (cb_tokenizer_encode(t, odd[i], strlen(odd[i]), false, ids, 256) < 0) abort();
}

TEST(invalid_utf8_synthetic) {
    buf_t b = {0};
    cb_tokenizer_t *t = synthetic(&b);
    CHECK(t);
    invalid_utf8_on(t, TEST_SANITIZED ? 2000 : 20000);
    cb_tokenizer_destroy(&t);
    free(b.p);
}

/* ---------------------------------------------------------------------------------------------- */
/* golden tests with the real model */

static cb_tokenizer_t *model_tokenizer(void) {
    const char *path = test_model_path();
    if (!path) return NULL;
    char err[256];
    cb_gguf_t *g = cb_gguf_open(path, err, sizeof err);
    if (!g) { fprintf(stderr, "  %s\n", err); return NULL; }
    cb_tokenizer_t *t = cb_tokenizer_new_from_gguf(g, err, sizeof err);
    if (!t) fprintf(stderr, "  %s\n", err);
    cb_gguf_destroy(&g);
    return t;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Fixture text as bytes (text, or text_hex); returns malloc'd buffer and its length. */
static char *fixture_bytes(json_t *o, size_t *len) {
    json_t *tx = json_object_get(o, "text");
    if (json_is_string(tx)) {
        *len = json_string_length(tx);
        char *s = malloc(*len + 1);
        memcpy(s, json_string_value(tx), *len + 1);
        return s;
    }
    const char *h = json_string_value(json_object_get(o, "text_hex"));
    if (!h) return NULL;
    size_t n = strlen(h) / 2;
    char *s = malloc(n + 1);
    for (size_t i = 0; i < n; i++) s[i] = (char)(hexval(h[2 * i]) * 16 + hexval(h[2 * i + 1]));
    s[n] = 0;
    *len = n;
    return s;
}

static void print_escaped(const char *s, size_t n) {
    for (size_t i = 0; i < n && i < 120; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != 0x7f && c != '\\') fputc(c, stderr);
        else fprintf(stderr, "\\x%02x", c);
    }
}

/* Runs one golden file against t: ids equal on every line, decoding byte-exact exactly where the fixture
 * says it is, and no control token from text encoded with special parsing off. A {"meta": ...} line holds
 * llama.cpp's view of the vocabulary (bos, eos, eot, eog, add_bos, n_vocab), checked too. Returns false
 * (with messages) on any difference; *n_cases, *n_bad get the counts. */
static bool run_golden(const cb_tokenizer_t *t, const char *path, const char *label, int *n_cases_out, int *n_bad_out) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "  cannot open %s\n", path);
        return false;
    }
    char *line = NULL;
    size_t cap = 0;
    int n_cases = 0, n_bad = 0, n_rt = 0, n_rt_bad = 0, n_flag_bad = 0, n_ctl = 0, n_meta_bad = 0;
    int32_t *ids = malloc(sizeof(int32_t) * 65536);
    while (getline(&line, &cap, f) > 0) {
        json_error_t je;
        json_t *o = json_loads(line, JSON_ALLOW_NUL, &je);
        if (!o) { n_bad++; fprintf(stderr, "  bad fixture line: %s\n", je.text); continue; }
        json_t *meta = json_object_get(o, "meta");
        if (meta) {
            /* llama.cpp's ids; its eot is the first EOT-looking text in its hash map's order, which we do not
             * reproduce where a vocabulary has two candidates (Qwen: <|endoftext|> here, <|im_end|> there):
             * then both must end generation */
            int32_t eot = (int32_t)json_integer_value(json_object_get(meta, "eot"));
            bool eot_ok = cb_tokenizer_eot(t) == eot || (cb_tokenizer_is_eog(t, eot) && cb_tokenizer_is_eog(t, cb_tokenizer_eot(t)));
            json_t *eog = json_object_get(meta, "eog");
            int32_t ours[64];
            int n_eog = cb_tokenizer_eog_ids(t, ours, 64);
            bool eog_ok = n_eog == (int)json_array_size(eog);
            for (int i = 0; eog_ok && i < n_eog; i++) eog_ok = ours[i] == json_integer_value(json_array_get(eog, (size_t)i));
            bool ok = cb_tokenizer_n_vocab(t) == json_integer_value(json_object_get(meta, "n_vocab")) &&
                      cb_tokenizer_bos(t) == json_integer_value(json_object_get(meta, "bos")) &&
                      cb_tokenizer_eos(t) == json_integer_value(json_object_get(meta, "eos")) && eot_ok && eog_ok &&
                      cb_tokenizer_add_bos(t) == json_is_true(json_object_get(meta, "add_bos"));
            if (!ok) {
                n_meta_bad++;
                fprintf(stderr, "  %s: vocabulary facts differ from llama.cpp's (bos %d eos %d eot %d, %d eog ids)\n",
                        label, cb_tokenizer_bos(t), cb_tokenizer_eos(t), cb_tokenizer_eot(t), n_eog);
            }
            json_decref(o);
            continue;
        }
        size_t len = 0;
        char *text = fixture_bytes(o, &len);
        bool special = json_is_true(json_object_get(o, "special"));
        bool roundtrip = json_is_true(json_object_get(o, "roundtrip"));
        json_t *want = json_object_get(o, "ids");
        n_cases++;
        int n = text ? cb_tokenizer_encode(t, text, len, special, ids, 65536) : -1;
        bool same = n >= 0 && (size_t)n == json_array_size(want);
        for (int i = 0; same && i < n; i++) same = ids[i] == json_integer_value(json_array_get(want, (size_t)i));
        for (int i = 0; !special && i < n; i++) n_ctl += cb_tokenizer_is_control(t, ids[i]);
        if (!same) {
            n_bad++;
            if (n_bad <= 20) {
                fprintf(stderr, "  %s MISMATCH special=%d text=\"", label, special);
                print_escaped(text, len);
                fprintf(stderr, "\"\n    want:");
                for (size_t i = 0; i < json_array_size(want) && i < 40; i++)
                    fprintf(stderr, " %lld", (long long)json_integer_value(json_array_get(want, i)));
                fprintf(stderr, "\n    got: ");
                for (int i = 0; i < n && i < 40; i++) fprintf(stderr, " %d", ids[i]);
                fprintf(stderr, "\n");
            }
        } else {
            /* decode: byte-exact where llama.cpp round-trips, and lossy exactly where it is */
            size_t dl;
            char *back = cb_tokenizer_decode_alloc(t, ids, (size_t)n, special, &dl);
            bool ok = back && dl == len && memcmp(back, text, len) == 0;
            if (ok != roundtrip) {
                n_flag_bad++;
                fprintf(stderr, "  %s round-trip %s, llama.cpp %s: \"", label, ok ? "exact" : "lossy",
                        roundtrip ? "exact" : "lossy");
                print_escaped(text, len);
                fprintf(stderr, "\"\n");
            }
            if (!special && roundtrip) { n_rt++; if (!ok) n_rt_bad++; }
            free(back);
        }
        free(text);
        json_decref(o);
    }
    free(line);
    free(ids);
    fclose(f);
    printf("# %s: ids equal on %d of %d lines; %d non-special round trips, %d failed\n", label, n_cases - n_bad,
           n_cases, n_rt, n_rt_bad);
    if (n_ctl) fprintf(stderr, "  %s: %d control tokens from text with special parsing off\n", label, n_ctl);
    *n_cases_out = n_cases;
    *n_bad_out = n_bad;
    return n_bad == 0 && n_rt_bad == 0 && n_flag_bad == 0 && n_ctl == 0 && n_meta_bad == 0;
}

TEST(golden_fixtures) {
    cb_tokenizer_t *t = model_tokenizer();
    if (!t) SKIP("model not available");
    const char *path = getenv("CB_TOKENIZER_FIXTURE"); /* another golden file, e.g. a big random one */
    if (!path || !*path) path = FIXTURE;
    int n_cases = 0, n_bad = 0;
    bool ok = run_golden(t, path, "tokenizer.jsonl (smollm2)", &n_cases, &n_bad);
    cb_tokenizer_destroy(&t);
    CHECK(n_cases >= 300);
    CHECK(ok);
}

/* The vocabularies of the other golden files: the first GGUF present of each list (the metadata-only file
 * of scripts/fetch-model.sh --vocab-only, or the whole model). */
typedef struct {
    const char *name, *fixture, *template_name;
    const char *paths[3];
} vocab_t;

static const vocab_t VOCABS[] = {
    {"qwen2", "tests/fixtures/tokenizer-qwen2.jsonl", NULL,
     {"models/vocab/qwen2.gguf", "models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", NULL}},
    {"llama-bpe", "tests/fixtures/tokenizer-llama-bpe.jsonl", NULL, {"models/vocab/llama-bpe.gguf", NULL, NULL}},
    {"llama3", "tests/fixtures/tokenizer-llama3.jsonl", "llama3", {"models/vocab/llama3.gguf", NULL, NULL}},
    {"gemma3", "tests/fixtures/tokenizer-gemma3.jsonl", "gemma",
     {"models/vocab/gemma3.gguf", NULL, NULL}}, /* the whole model has Q5_0 tensors gguf.c refuses */
    {"llama-spm", "tests/fixtures/tokenizer-llama-spm.jsonl", "mistral", {"models/vocab/llama-spm.gguf", NULL, NULL}},
};

static const vocab_t *vocab_named(const char *name) {
    for (size_t i = 0; i < sizeof VOCABS / sizeof *VOCABS; i++)
        if (!strcmp(VOCABS[i].name, name)) return &VOCABS[i];
    return NULL;
}

/* The tokenizer of a vocabulary (with its chat template name when given), or NULL (and *path NULL)
 * when none of its GGUFs is there. */
static cb_tokenizer_t *vocab_tokenizer(const vocab_t *v, bool with_template, const char **path) {
    *path = NULL;
    for (int i = 0; i < 3 && v->paths[i]; i++) {
        FILE *f = fopen(v->paths[i], "rb");
        if (!f) continue;
        fclose(f);
        *path = v->paths[i];
        char err[256];
        cb_gguf_t *g = cb_gguf_open(v->paths[i], err, sizeof err);
        if (!g) { fprintf(stderr, "  %s\n", err); return NULL; }
        cb_tokenizer_t *t = cb_tokenizer_new_from_gguf_opts(g, with_template ? v->template_name : NULL, err, sizeof err);
        if (!t) fprintf(stderr, "  %s: %s\n", v->paths[i], err);
        cb_gguf_destroy(&g);
        return t;
    }
    return NULL;
}

static void golden_vocab(const char *name) {
    const vocab_t *v = vocab_named(name);
    const char *path;
    cb_tokenizer_t *t = vocab_tokenizer(v, false, &path);
    if (!path) {
        char why[160];
        snprintf(why, sizeof why, "%s absent (scripts/fetch-model.sh --vocab-only all)", v->paths[0]);
        SKIP(why);
    }
    CHECK_MSG(t, "no tokenizer for %s", path);
    char label[96];
    snprintf(label, sizeof label, "%s (%s)", v->fixture + strlen("tests/fixtures/"), name);
    int n_cases = 0, n_bad = 0;
    bool ok = run_golden(t, v->fixture, label, &n_cases, &n_bad);
    cb_tokenizer_destroy(&t);
    CHECK(n_cases >= 300);
    CHECK(ok);
}

TEST(golden_qwen2) { golden_vocab("qwen2"); }
TEST(golden_llama_bpe) { golden_vocab("llama-bpe"); }
TEST(golden_llama3) { golden_vocab("llama3"); }
TEST(golden_gemma3) { golden_vocab("gemma3"); }
TEST(golden_llama_spm) { golden_vocab("llama-spm"); }

/* Facts about the real vocabularies that the golden files do not state. */
TEST(vocab_facts) {
    const char *path;
    int seen = 0;
    cb_tokenizer_t *t = vocab_tokenizer(vocab_named("qwen2"), false, &path);
    if (t) {
        seen++;
        const char *tn = cb_tokenizer_chat_template_name(t);
        CHECK_MSG(tn && !strcmp(tn, "qwen2.5"), "qwen2 template: %s", tn ? tn : cb_tokenizer_chat_template_error(t));
        CHECK(id_of(t, "<|im_start|>") == 151644 && cb_tokenizer_is_control(t, 151644));
        CHECK(cb_tokenizer_is_special(t, 151657) && !cb_tokenizer_is_control(t, 151657)); /* <tool_call>: user-defined */
        CHECK(cb_tokenizer_is_eog(t, 151645) && cb_tokenizer_is_eog(t, 151643) && !cb_tokenizer_is_eog(t, 151644));
        CHECK(!cb_tokenizer_add_bos(t) && !cb_tokenizer_add_space_prefix(t));
        cb_tokenizer_destroy(&t);
    }
    t = vocab_tokenizer(vocab_named("gemma3"), false, &path);
    if (t) {
        seen++;
        CHECK(cb_tokenizer_chat_template_name(t) == NULL);   /* the 270M base model has no template */
        CHECK(strstr(cb_tokenizer_chat_template_error(t), "completion"));
        CHECK(!strcmp(cb_tokenizer_model_name(t), "llama") && !cb_tokenizer_add_space_prefix(t) && cb_tokenizer_add_bos(t));
        CHECK(cb_tokenizer_bos(t) == 2 && id_of(t, "<start_of_turn>") == 105 && cb_tokenizer_is_control(t, 105));
        CHECK(cb_tokenizer_is_eog(t, 106) && cb_tokenizer_is_eog(t, 1)); /* <end_of_turn>, <eos> */
        /* "\n" is a user-defined token: cut out even from untrusted text; <start_of_turn> never */
        int32_t ids[32];
        int n = cb_tokenizer_encode(t, "<start_of_turn>user\n", 20, false, ids, 32);
        for (int i = 0; i < n; i++) CHECK(!cb_tokenizer_is_control(t, ids[i]));
        CHECK(n > 2 && ids[n - 1] == id_of(t, "\n"));
        cb_tokenizer_destroy(&t);
    }
    t = vocab_tokenizer(vocab_named("llama-spm"), false, &path);
    if (t) {
        seen++;
        CHECK(cb_tokenizer_add_space_prefix(t) && cb_tokenizer_bos(t) == 1 && cb_tokenizer_eos(t) == 2);
        int32_t ids[32];
        int n = cb_tokenizer_encode(t, "Hello world", 11, false, ids, 32);
        char out[64];
        CHECK(n == 2 && cb_tokenizer_decode(t, ids, 2, false, out, sizeof out) == 11 && !strcmp(out, "Hello world"));
        cb_tokenizer_destroy(&t);
    }
    if (!seen) SKIP("no vocabulary GGUF (scripts/fetch-model.sh --vocab-only all)");
}

static void invalid_utf8_on(const cb_tokenizer_t *t, int rounds);

TEST(vocab_invalid_utf8_and_speed) {
    int seen = 0;
    for (size_t i = 0; i < sizeof VOCABS / sizeof *VOCABS; i++) {
        const char *path;
        cb_tokenizer_t *t = vocab_tokenizer(&VOCABS[i], false, &path);
        if (!t) continue;
        seen++;
        invalid_utf8_on(t, TEST_SANITIZED ? 300 : 3000);
        const char *para =
            "The southern maryland electric cooperative (smeco) is an electric distribution cooperative which is "
            "headquartered in Hughesville, Maryland. It serves approximately 161,000 customers in 4 counties; "
            "its rules don't allow markup — café, naïve, Привет, 你好 👍🏽.\n\n  def f(x): return x**2 + 3.14159\n";
        size_t pl = strlen(para), n = 100 * 1024;
        char *doc = malloc(n);
        for (size_t k = 0; k < n; k++) doc[k] = para[k % pl];
        int32_t *ids = malloc(sizeof(int32_t) * n);
        double t0 = cb_now_ms();
        int k = cb_tokenizer_encode(t, doc, n, false, ids, (int)n);
        double ms = cb_now_ms() - t0;
        printf("# %s: tokenize 100 KiB: %d tokens in %.1f ms%s\n", VOCABS[i].name, k, ms,
               TEST_SANITIZED ? " (sanitized build)" : "");
        free(ids);
        free(doc);
        cb_tokenizer_destroy(&t);
        CHECK(k > 10000);
        if (!TEST_SANITIZED) CHECK_MSG(ms < 1000, "%.1f ms", ms);
    }
    if (!seen) SKIP("no vocabulary GGUF (scripts/fetch-model.sh --vocab-only all)");
}

TEST(model_special_tokens) {
    cb_tokenizer_t *t = model_tokenizer();
    if (!t) SKIP("model not available");
    int32_t ids[64];
    const char *s = "<|im_start|>user\nhi<|im_end|>";
    int n = cb_tokenizer_encode(t, s, strlen(s), true, ids, 64);
    bool ok = n == 5 && ids[0] == 1 && ids[4] == 2;
    int n2 = cb_tokenizer_encode(t, s, strlen(s), false, ids, 64);
    for (int i = 0; i < n2; i++) ok = ok && ids[i] > 16;
    CHECK(cb_tokenizer_n_vocab(t) == 49152);
    CHECK(cb_tokenizer_bos(t) == 1 && cb_tokenizer_eos(t) == 2 && cb_tokenizer_pad(t) == 2);
    CHECK(cb_tokenizer_eot(t) == 0); /* what llama_vocab_eot() reports for this GGUF */
    CHECK(cb_tokenizer_is_eog(t, 0) && cb_tokenizer_is_eog(t, 2) && cb_tokenizer_is_eog(t, 4));
    CHECK(!cb_tokenizer_is_eog(t, 1) && !cb_tokenizer_is_eog(t, 3) && !cb_tokenizer_is_eog(t, 100));
    CHECK(cb_tokenizer_token_type(t, 1) == CB_TOKEN_CONTROL && cb_tokenizer_token_type(t, 100) == CB_TOKEN_NORMAL);
    size_t l;
    CHECK(cb_tokenizer_token_bytes(t, 1, false, &l) && l == 0);
    const char *p = cb_tokenizer_token_bytes(t, 1, true, &l);
    CHECK(p && l == 12 && !memcmp(p, "<|im_start|>", 12));
    CHECK_MSG(ok, "special parsing on/off");
    cb_tokenizer_destroy(&t);
}

TEST(model_invalid_utf8) {
    cb_tokenizer_t *t = model_tokenizer();
    if (!t) SKIP("model not available");
    invalid_utf8_on(t, TEST_SANITIZED ? 1000 : 10000);
    cb_tokenizer_destroy(&t);
}

TEST(model_speed_100k) {
    cb_tokenizer_t *t = model_tokenizer();
    if (!t) SKIP("model not available");
    const char *para =
        "The southern maryland electric cooperative (smeco) is an electric distribution cooperative which is "
        "headquartered in Hughesville, Maryland. It serves approximately 161,000 customers in 4 counties; "
        "its rules don't allow markup — café, naïve, Привет, 你好 👍🏽.\n\n  def f(x): return x**2 + 3.14159\n";
    size_t pl = strlen(para), n = 100 * 1024;
    char *doc = malloc(n);
    for (size_t i = 0; i < n; i++) doc[i] = para[i % pl];
    int max = (int)n;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)max);
    double t0 = cb_now_ms();
    int k = cb_tokenizer_encode(t, doc, n, false, ids, max);
    double ms = cb_now_ms() - t0;
    printf("# tokenize 100 KiB: %d tokens in %.1f ms%s\n", k, ms, TEST_SANITIZED ? " (sanitized build)" : "");
    size_t dl;
    char *back = cb_tokenizer_decode_alloc(t, ids, k > 0 ? (size_t)k : 0, false, &dl);
    bool same = back && dl == n && memcmp(back, doc, n) == 0;
    free(back);
    free(ids);
    free(doc);
    cb_tokenizer_destroy(&t);
    CHECK(k > 10000);
    CHECK(same);
    if (!TEST_SANITIZED) CHECK_MSG(ms < 500, "%.1f ms", ms); /* target well under 100 ms; 500 allows a busy box */
}

int main(void) {
    RUN(synthetic_merges);
    RUN(special_on_off);
    RUN(buffer_sizes_and_errors);
    RUN(rejects_bad_metadata);
    RUN(qwen2_and_llama_bpe_pretokenizers);
    RUN(spm_synthetic);
    RUN(invalid_utf8_synthetic);
    RUN(golden_fixtures);
    RUN(golden_qwen2);
    RUN(golden_llama_bpe);
    RUN(golden_llama3);
    RUN(golden_gemma3);
    RUN(golden_llama_spm);
    RUN(vocab_facts);
    RUN(vocab_invalid_utf8_and_speed);
    RUN(model_special_tokens);
    RUN(model_invalid_utf8);
    RUN(model_speed_100k);
    return test_summary();
}
