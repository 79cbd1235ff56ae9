/* fuzz_tokenizer: libFuzzer target for the tokenizers (libshared/model/tokenizer) on real vocabularies.
 *
 * Vocabularies: CB_FUZZ_MODEL names one GGUF (a model or a metadata-only vocabulary file); CB_FUZZ_MODEL=all
 * loads every one of these that is present and runs each input on all of them:
 *   models/SmolLM2-135M-Instruct.Q4_1.gguf   (BPE, smollm)      models/vocab/qwen2.gguf     (BPE, qwen2)
 *   models/vocab/llama-bpe.gguf              (BPE, llama-bpe)   models/vocab/llama3.gguf    (BPE, llama-bpe)
 *   models/vocab/gemma3.gguf                 (SentencePiece)    models/vocab/llama-spm.gguf (SentencePiece,
 *                                                                                            space prefix)
 * (scripts/fetch-model.sh --vocab-only all). Default: the SmolLM2 model when it is there, else the synthetic
 * vocabulary of model/synth.h (a GPT-2 byte-level vocabulary with a few merges).
 * Input: byte 0 selects the mode (bit 0: parse_special; bit 1: decode with special), the rest is the text.
 * For every input and vocabulary:
 *   - the size query (out NULL, max_out 0) and cb_tokenizer_encode_alloc agree on the count, and every id is
 *     in the vocabulary;
 *   - with parse_special false, no id is a control or unknown token (cb_tokenizer_is_control);
 *   - an encode into a buffer one id too small reports -count and writes nothing past its end;
 *   - decode follows snprintf semantics (full length returned, at most cap-1 bytes and a NUL written) and
 *     agrees with cb_tokenizer_decode_alloc;
 *   - the round trip holds where the header promises it: with parse_special false, decode(encode(x)) == x
 *     for well-formed UTF-8 x; BPE: without the bytes whose byte-level symbol the vocabulary lacks;
 *     SentencePiece: without U+2581 (it decodes to a space) and, with a space prefix, when no user-defined
 *     token split the text into fragments.
 * Any violation aborts (a crash for libFuzzer). Inputs are capped at 4 KiB so every run stays fast.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/utf8.h"
#include "format/gguf.h"
#include "model/synth.h"
#include "model/tokenizer.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_MAX_TEXT 4096
#define MAX_TOKS 8

typedef struct {
    cb_tokenizer_t *tok;
    bool spm;
    bool missing[256]; /* BPE: bytes whose byte-level symbol is not in the vocabulary */
} fuzz_vocab_t;

static fuzz_vocab_t g_v[MAX_TOKS];
static int g_n;

static const char *const ALL[] = {"models/SmolLM2-135M-Instruct.Q4_1.gguf", "models/vocab/qwen2.gguf",
                                  "models/vocab/llama-bpe.gguf", "models/vocab/llama3.gguf",
                                  "models/vocab/gemma3.gguf", "models/vocab/llama-spm.gguf"};

/* GPT-2's byte-to-unicode table: printable Latin-1 bytes map to themselves, the others (in byte order) to
 * U+0100 onwards. */
static uint32_t byte_symbol(unsigned b) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) return b;
    uint32_t n = 0;
    for (unsigned c = 0; c < b; c++)
        if (!((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || (c >= 174 && c <= 255))) n++;
    return 256 + n;
}

static void die(const char *what) {
    fprintf(stderr, "fuzz_tokenizer: %s\n", what);
    abort();
}

static void add_vocab(cb_gguf_t *g, const char *what) {
    char err[512];
    fuzz_vocab_t *v = &g_v[g_n];
    if (!(v->tok = cb_tokenizer_new_from_gguf(g, err, sizeof err))) die(err);
    v->spm = !strcmp(cb_tokenizer_model_name(v->tok), "llama");
    int missing = 0;
    for (unsigned b = 0; b < 256 && !v->spm; b++) {
        unsigned char u[4];
        size_t n = cb_utf8_encode(byte_symbol(b), u);
        v->missing[b] = cb_tokenizer_find(v->tok, (const char *)u, n) < 0;
        missing += v->missing[b];
    }
    fprintf(stderr, "fuzz_tokenizer: vocabulary of %s: %d tokens, %s/%s, %d bytes without a symbol\n", what,
            cb_tokenizer_n_vocab(v->tok), cb_tokenizer_model_name(v->tok), cb_tokenizer_pre_name(v->tok), missing);
    g_n++;
}

static bool load_path(const char *path) {
    struct stat st;
    char err[512];
    cb_gguf_t *g;
    if (stat(path, &st) != 0 || !(g = cb_gguf_open(path, err, sizeof err))) return false;
    add_vocab(g, path);
    cb_gguf_destroy(&g);
    return true;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *want = getenv("CB_FUZZ_MODEL");
    if (want && !strcmp(want, "all")) {
        for (size_t i = 0; i < sizeof ALL / sizeof *ALL; i++) load_path(ALL[i]);
    } else if (want && *want) {
        if (!load_path(want)) fprintf(stderr, "fuzz_tokenizer: cannot open %s\n", want);
    } else {
        load_path(ALL[0]);
    }
    if (g_n == 0) {
        char err[512];
        cb_synth_shape_t s = {.name = "fuzz", .n_layer = 1, .n_embd = 64, .n_head = 2, .n_head_kv = 1, .n_ff = 128,
                              .n_vocab = 512, .n_ctx = 256, .rope_base = 10000.0f, .rms_eps = 1e-5f, .tied = true};
        size_t len;
        void *synth = NULL;
        cb_gguf_t *g = NULL;
        if (!(synth = cb_synth_build(&s, CB_SYNTH_F32, 1, &len, err, sizeof err)) ||
            !(g = cb_gguf_open_mem(synth, len, err, sizeof err)))
            die(err);
        add_vocab(g, "the synthetic model");
        cb_gguf_destroy(&g);
        free(synth);
    }
    return 0;
}

static void check_one(const fuzz_vocab_t *v, const char *text, size_t len, bool parse_special, bool special) {
    const cb_tokenizer_t *tok = v->tok;
    int needed = cb_tokenizer_encode(tok, text, len, parse_special, NULL, 0);
    if (needed > 0 || needed == CB_TOKENIZER_EINVAL || needed == CB_TOKENIZER_EINTERNAL) die("size query");
    int n = 0;
    int32_t *ids = cb_tokenizer_encode_alloc(tok, text, len, parse_special, &n);
    if (!ids || n != -needed) die("encode_alloc disagrees with the size query");
    int nv = cb_tokenizer_n_vocab(tok);
    bool user_defined = false;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= nv) die("id outside the vocabulary");
        if (!parse_special && cb_tokenizer_is_control(tok, ids[i])) die("control token from text, special parsing off");
        user_defined |= cb_tokenizer_is_special(tok, ids[i]);
    }
    if (n > 0) { /* one too small: -n back, the canary untouched */
        int32_t *small = malloc(sizeof(int32_t) * (size_t)n);
        if (!small) die("oom");
        small[n - 1] = 0x5a5a5a5a;
        int r = cb_tokenizer_encode(tok, text, len, parse_special, small, n - 1);
        if (r != -n || small[n - 1] != 0x5a5a5a5a) die("encode into a short buffer");
        if (n > 1 && memcmp(small, ids, sizeof(int32_t) * (size_t)(n - 1)) != 0) die("short encode differs");
        free(small);
    }
    size_t dlen = 0;
    char *dec = cb_tokenizer_decode_alloc(tok, ids, (size_t)n, special, &dlen);
    if (!dec) die("decode_alloc");
    int64_t full = cb_tokenizer_decode(tok, ids, (size_t)n, special, NULL, 0);
    if (full != (int64_t)dlen) die("decode length");
    char tiny[8];
    memset(tiny, 0x7e, sizeof tiny);
    int64_t t = cb_tokenizer_decode(tok, ids, (size_t)n, special, tiny, 5);
    size_t copied = dlen < 4 ? dlen : 4;
    if (t != (int64_t)dlen || tiny[copied] != 0 || memcmp(tiny, dec, copied) != 0 || tiny[5] != 0x7e)
        die("decode is not snprintf-like");
    for (int i = 0; i < n; i++) {
        size_t bl;
        if (!cb_tokenizer_token_bytes(tok, ids[i], special, &bl)) die("token_bytes");
    }
    if (!parse_special && cb_utf8_valid(text, len)) {
        bool clean = true;
        for (size_t i = 0; i < len && clean && !v->spm; i++) clean = !v->missing[(unsigned char)text[i]];
        if (v->spm && cb_tokenizer_add_space_prefix(tok)) clean = !user_defined;
        if (v->spm && memmem(text, len, "\xE2\x96\x81", 3)) clean = false; /* U+2581 decodes to a space */
        if (clean && (dlen != len || memcmp(dec, text, len) != 0)) die("decode(encode(x)) != x");
    }
    free(dec);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > FUZZ_MAX_TEXT + 1) return 0;
    for (int k = 0; k < g_n; k++) check_one(&g_v[k], (const char *)data + 1, size - 1, data[0] & 1, data[0] & 2);
    return 0;
}
