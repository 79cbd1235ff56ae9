/* fuzz_tokenizer: libFuzzer target for the BPE tokenizer (libshared/model/tokenizer) on a real vocabulary.
 *
 * The vocabulary is the real model's (CB_FUZZ_MODEL, default models/SmolLM2-135M-Instruct.Q4_1.gguf) when
 * that file is there, else the synthetic one of model/synth.h (a GPT-2 byte-level vocabulary with a few
 * merges). Input: byte 0 selects the mode (bit 0: parse_special; bit 1: decode with special), the rest is the
 * text. For every input:
 *   - the size query (out NULL, max_out 0) and cb_tokenizer_encode_alloc agree on the count, and every id is
 *     in the vocabulary;
 *   - an encode into a buffer one id too small reports -count and writes nothing past its end;
 *   - decode follows snprintf semantics (full length returned, at most cap-1 bytes and a NUL written) and
 *     agrees with cb_tokenizer_decode_alloc;
 *   - the round trip holds where the header promises it: with parse_special false, decode(encode(x)) == x
 *     for well-formed UTF-8 x without the bytes whose byte-level symbol the vocabulary lacks.
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

static cb_tokenizer_t *g_tok;
static bool g_missing[256]; /* bytes whose byte-level symbol is not in the vocabulary */

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

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    char err[512];
    const char *path = getenv("CB_FUZZ_MODEL");
    if (!path) path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    struct stat st;
    cb_gguf_t *g = NULL;
    void *synth = NULL;
    if (stat(path, &st) == 0 && (g = cb_gguf_open(path, err, sizeof err))) {
        fprintf(stderr, "fuzz_tokenizer: vocabulary of %s\n", path);
    } else {
        cb_synth_shape_t s = {.name = "fuzz", .n_layer = 1, .n_embd = 64, .n_head = 2, .n_head_kv = 1, .n_ff = 128,
                              .n_vocab = 512, .n_ctx = 256, .rope_base = 10000.0f, .rms_eps = 1e-5f, .tied = true};
        size_t len;
        if (!(synth = cb_synth_build(&s, CB_SYNTH_F32, 1, &len, err, sizeof err)) ||
            !(g = cb_gguf_open_mem(synth, len, err, sizeof err)))
            die(err);
        fprintf(stderr, "fuzz_tokenizer: no model at %s; synthetic vocabulary\n", path);
    }
    g_tok = cb_tokenizer_new_from_gguf(g, err, sizeof err);
    cb_gguf_destroy(&g);
    free(synth);
    if (!g_tok) die(err);
    int missing = 0;
    for (unsigned b = 0; b < 256; b++) {
        unsigned char u[4];
        size_t n = cb_utf8_encode(byte_symbol(b), u);
        g_missing[b] = cb_tokenizer_find(g_tok, (const char *)u, n) < 0;
        missing += g_missing[b];
    }
    fprintf(stderr, "fuzz_tokenizer: %d tokens, %d bytes without a symbol\n", cb_tokenizer_n_vocab(g_tok), missing);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > FUZZ_MAX_TEXT + 1) return 0;
    bool parse_special = data[0] & 1, special = data[0] & 2;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int needed = cb_tokenizer_encode(g_tok, text, len, parse_special, NULL, 0);
    if (needed > 0 || needed == CB_TOKENIZER_EINVAL || needed == CB_TOKENIZER_EINTERNAL) die("size query");
    int n = 0;
    int32_t *ids = cb_tokenizer_encode_alloc(g_tok, text, len, parse_special, &n);
    if (!ids || n != -needed) die("encode_alloc disagrees with the size query");
    int nv = cb_tokenizer_n_vocab(g_tok);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= nv) die("id outside the vocabulary");
    if (n > 0) { /* one too small: -n back, the canary untouched */
        int32_t *small = malloc(sizeof(int32_t) * (size_t)n);
        if (!small) die("oom");
        small[n - 1] = 0x5a5a5a5a;
        int r = cb_tokenizer_encode(g_tok, text, len, parse_special, small, n - 1);
        if (r != -n || small[n - 1] != 0x5a5a5a5a) die("encode into a short buffer");
        if (n > 1 && memcmp(small, ids, sizeof(int32_t) * (size_t)(n - 1)) != 0) die("short encode differs");
        free(small);
    }
    size_t dlen = 0;
    char *dec = cb_tokenizer_decode_alloc(g_tok, ids, (size_t)n, special, &dlen);
    if (!dec) die("decode_alloc");
    int64_t full = cb_tokenizer_decode(g_tok, ids, (size_t)n, special, NULL, 0);
    if (full != (int64_t)dlen) die("decode length");
    char tiny[8];
    memset(tiny, 0x7e, sizeof tiny);
    int64_t t = cb_tokenizer_decode(g_tok, ids, (size_t)n, special, tiny, 5);
    size_t copied = dlen < 4 ? dlen : 4;
    if (t != (int64_t)dlen || tiny[copied] != 0 || memcmp(tiny, dec, copied) != 0 || tiny[5] != 0x7e)
        die("decode is not snprintf-like");
    for (int i = 0; i < n; i++) {
        size_t bl;
        if (!cb_tokenizer_token_bytes(g_tok, ids[i], special, &bl)) die("token_bytes");
    }
    if (!parse_special && cb_utf8_valid(text, len)) {
        bool clean = true;
        for (size_t i = 0; i < len && clean; i++) clean = !g_missing[(unsigned char)text[i]];
        if (clean && (dlen != len || memcmp(dec, text, len) != 0)) die("decode(encode(x)) != x");
    }
    free(dec);
    free(ids);
    return 0;
}
