/* test_tokenizer: libshared/tokenizer against llama.cpp's golden ids (tests/fixtures/tokenizer.jsonl,
 * made by scripts/make-fixtures), plus model-free checks on a tiny synthetic GGUF built in memory:
 * BPE merge order, special-token parsing on/off, invalid UTF-8, buffer-size errors, bad metadata. */
#include <jansson.h>
#include <stdint.h>

#include "base/clock.h"
#include "format/gguf.h"
#include "test.h"
#include "model/tokenizer.h"

#define FIXTURE "tests/fixtures/tokenizer.jsonl"

/* ---------------------------------------------------------------------------------------------- */
/* a tiny GGUF writer (metadata only, no tensors) */

typedef struct { unsigned char *p; size_t n, cap; } buf_t;

static void put(buf_t *b, const void *s, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 256;
        b->p = realloc(b->p, b->cap);
        if (!b->p) abort();
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}
static void put_u32(buf_t *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(buf_t *b, uint64_t v) { put(b, &v, 8); }
static void put_gstr(buf_t *b, const char *s) { put_u64(b, strlen(s)); put(b, s, strlen(s)); }
static void kv_str(buf_t *b, const char *k, const char *v) { put_gstr(b, k); put_u32(b, CB_GGUF_STRING); put_gstr(b, v); }
static void kv_u32(buf_t *b, const char *k, uint32_t v) { put_gstr(b, k); put_u32(b, CB_GGUF_U32); put_u32(b, v); }
static void kv_strs(buf_t *b, const char *k, char **v, size_t n) {
    put_gstr(b, k); put_u32(b, CB_GGUF_ARRAY); put_u32(b, CB_GGUF_STRING); put_u64(b, n);
    for (size_t i = 0; i < n; i++) put_gstr(b, v[i]);
}
static void kv_i32s(buf_t *b, const char *k, const int32_t *v, size_t n) {
    put_gstr(b, k); put_u32(b, CB_GGUF_ARRAY); put_u32(b, CB_GGUF_I32); put_u64(b, n);
    put(b, v, 4 * n);
}

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
    cb_gguf_t *g = make_gguf("gpt2", "llama-bpe", &b, true);
    CHECK(g);
    cb_tokenizer_t *t = cb_tokenizer_new_from_gguf(g, err, sizeof err);
    cb_gguf_destroy(&g);
    CHECK(t == NULL);
    CHECK_MSG(strstr(err, "llama-bpe") && strstr(err, "not supported"), "err: %s", err);
    g = make_gguf("llama", "smollm", &b, true);
    CHECK(g);
    t = cb_tokenizer_new_from_gguf(g, err, sizeof err);
    cb_gguf_destroy(&g);
    CHECK(t == NULL && strstr(err, "gpt2"));
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

TEST(golden_fixtures) {
    cb_tokenizer_t *t = model_tokenizer();
    if (!t) SKIP("model not available");
    const char *path = getenv("CB_TOKENIZER_FIXTURE"); /* another golden file, e.g. a big random one */
    if (!path || !*path) path = FIXTURE;
    FILE *f = fopen(path, "r");
    if (!f) { cb_tokenizer_destroy(&t); CHECK_MSG(0, "cannot open %s", path); }
    char *line = NULL;
    size_t cap = 0;
    int n_cases = 0, n_bad = 0, n_rt = 0, n_rt_bad = 0, n_flag_bad = 0;
    int32_t *ids = malloc(sizeof(int32_t) * 65536);
    while (getline(&line, &cap, f) > 0) {
        json_error_t je;
        json_t *o = json_loads(line, JSON_ALLOW_NUL, &je);
        if (!o) { n_bad++; fprintf(stderr, "  bad fixture line: %s\n", je.text); continue; }
        size_t len = 0;
        char *text = fixture_bytes(o, &len);
        bool special = json_is_true(json_object_get(o, "special"));
        bool roundtrip = json_is_true(json_object_get(o, "roundtrip"));
        json_t *want = json_object_get(o, "ids");
        n_cases++;
        int n = text ? cb_tokenizer_encode(t, text, len, special, ids, 65536) : -1;
        bool same = n >= 0 && (size_t)n == json_array_size(want);
        for (int i = 0; same && i < n; i++) same = ids[i] == json_integer_value(json_array_get(want, (size_t)i));
        if (!same) {
            n_bad++;
            if (n_bad <= 20) {
                fprintf(stderr, "  MISMATCH special=%d text=\"", special);
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
                fprintf(stderr, "  round-trip %s, llama.cpp %s: \"", ok ? "exact" : "lossy", roundtrip ? "exact" : "lossy");
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
    cb_tokenizer_destroy(&t);
    printf("# tokenizer fixtures: %d cases, %d mismatches; %d non-special round trips, %d failed\n",
           n_cases, n_bad, n_rt, n_rt_bad);
    CHECK(n_cases >= 300);
    CHECK(n_bad == 0);
    CHECK(n_rt_bad == 0);
    CHECK(n_flag_bad == 0);
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
    RUN(invalid_utf8_synthetic);
    RUN(golden_fixtures);
    RUN(model_special_tokens);
    RUN(model_invalid_utf8);
    RUN(model_speed_100k);
    return test_summary();
}
