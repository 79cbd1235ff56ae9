/* gen_corpora: writes the seed corpora of the libFuzzer targets (tests/fuzz/make-corpora.sh runs it):
 *
 *   gen_corpora OUTDIR
 *     OUTDIR/corpus_msg/        every request and reply type of docs/protocol.md, encoded by the real writer,
 *                               plus a few hostile frames (deep nesting, huge counts, ext types, bad UTF-8)
 *     OUTDIR/corpus_kvfile/     KV files written by the real writer (tiny and SmolLM2 geometry), with the
 *                               fuzzer's mode byte in front, and truncated copies
 *     OUTDIR/corpus_gguf/       synthetic GGUF models (model/synth.h) of tiny shapes (synth_*.seed)
 *     OUTDIR/corpus_tokenizer/  texts with the fuzzer's mode byte: tests/fixtures/tokenizer.jsonl lines,
 *                               special-token text, scripts, invalid UTF-8
 *     OUTDIR/corpus_qa/         MuSiQue-like jsonl lines (short, hand-written) and broken ones
 *
 * Deterministic: the same build writes the same bytes (no clocks, fixed seeds), so the committed corpora
 * change only when a format does. Files are small (the largest, a one-token SmolLM2-geometry KV file, is
 * about 23 KB). Exit 0, or 1 with a message.
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "format/kvfile.h"
#include "model/synth.h"
#include "wire/msg.h"

static const char *g_out;
static int g_files;

static int mkdirs(const char *sub) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", g_out, sub);
    if (mkdir(g_out, 0755) != 0 && errno != EEXIST) return -1;
    if (mkdir(p, 0755) != 0 && errno != EEXIST) return -1;
    return 0;
}

static int put(const char *sub, const char *name, const void *p, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/%s", g_out, sub, name);
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(p, 1, n, f) != n) || fclose(f) != 0) {
        fprintf(stderr, "gen_corpora: cannot write %s\n", path);
        return -1;
    }
    g_files++;
    return 0;
}

/* ------------------------------------------------------------------ corpus_msg */

/* One message from JSON (the envelope v/type/id as written). */
static int put_json_msg(const char *name, const char *js) {
    json_error_t je;
    json_t *o = json_loads(js, 0, &je);
    if (!o) {
        fprintf(stderr, "gen_corpora: bad JSON for %s: %s\n", name, je.text);
        return -1;
    }
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_begin_bare(w);
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v) cb_msg_put_json(w, k, v);
    size_t len;
    const void *d = cb_msg_end(w, &len);
    int rc = d ? put("corpus_msg", name, d, len) : -1;
    if (!d) fprintf(stderr, "gen_corpora: cannot encode %s: %s\n", name, cb_msg_writer_error(w));
    cb_msg_writer_destroy(&w);
    json_decref(o);
    return rc;
}

#define KEY64 "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

static int gen_msg(void) {
    static const char *const msgs[][2] = {
        {"ping.msg", "{\"v\":1,\"type\":\"ping\",\"id\":\"1-1\"}"},
        {"stats.msg", "{\"v\":1,\"type\":\"stats\",\"id\":\"1-2\"}"},
        {"index.msg", "{\"v\":1,\"type\":\"index\",\"id\":\"1-3\",\"chunk_id\":\"" KEY64 "\",\"doc_id\":\"d1\",\"text\":\"The lighthouse was built in 1871.\"}"},
        {"delete_chunk.msg", "{\"v\":1,\"type\":\"delete\",\"id\":\"1-4\",\"chunk_id\":\"" KEY64 "\"}"},
        {"delete_doc.msg", "{\"v\":1,\"type\":\"delete\",\"id\":\"1-5\",\"doc_id\":\"d1\"}"},
        {"search.msg", "{\"v\":1,\"type\":\"search\",\"id\":\"1-6\",\"query\":\"lighthouse NEAR(a b) OR *\",\"k\":5}"},
        {"put.msg", "{\"v\":1,\"type\":\"put\",\"id\":\"1-7\",\"key\":\"" KEY64 "\",\"path\":\"01/" KEY64 ".kv\",\"bytes\":23296,\"tokens\":1,\"fingerprint\":\"ab12\"}"},
        {"lookup.msg", "{\"v\":1,\"type\":\"lookup\",\"id\":\"1-8\",\"keys\":[\"" KEY64 "\",\"00112233445566778899aabbccddeeff\"]}"},
        {"touch.msg", "{\"v\":1,\"type\":\"touch\",\"id\":\"1-9\",\"keys\":[\"" KEY64 "\"],\"hit\":true}"},
        {"gc.msg", "{\"v\":1,\"type\":\"gc\",\"id\":\"1-10\"}"},
        {"ingest.msg", "{\"v\":1,\"type\":\"ingest\",\"id\":\"1-11\",\"doc_id\":\"doc-7\",\"text\":\"Para one.\\n\\nPara two.\",\"meta\":{\"src\":\"a\",\"n\":3,\"f\":0.5,\"b\":true}}"},
        {"status.msg", "{\"v\":1,\"type\":\"status\",\"id\":\"1-12\",\"job\":\"00112233445566778899aabbccddeeff\"}"},
        {"query_full.msg", "{\"v\":1,\"type\":\"query\",\"id\":\"1-13\",\"question\":\"Who built it?\",\"contexts\":[\"c1\",\"c2\"],\"mode\":\"full\",\"max_tokens\":16,\"temperature\":0.7,\"top_p\":0.9,\"seed\":42}"},
        {"query_blend.msg", "{\"v\":1,\"type\":\"query\",\"id\":\"1-14\",\"question\":\"Who?\",\"k\":3,\"mode\":\"blend\",\"ratio\":0.15,\"frequency_penalty\":0.5,\"presence_penalty\":-0.5,\"stop\":[\"\\n\",\"END\"]}"},
        {"query_stop_str.msg", "{\"v\":1,\"type\":\"query\",\"id\":\"1-15\",\"question\":\"Q\",\"stop\":\"x\"}"},
        {"reply_ping.msg", "{\"v\":1,\"type\":\"ping\",\"id\":\"1-1\",\"ok\":true,\"service\":\"cb-blend\",\"version\":\"0.1.0\",\"pid\":12,\"uptime_s\":1.5,\"worker_ready\":true,\"step_age_ms\":0.0}"},
        {"reply_search.msg", "{\"v\":1,\"type\":\"search\",\"id\":\"1-6\",\"ok\":true,\"hits\":[{\"chunk_id\":\"" KEY64 "\",\"doc_id\":\"d1\",\"score\":3.25,\"text\":\"t\"}]}"},
        {"reply_lookup.msg", "{\"v\":1,\"type\":\"lookup\",\"id\":\"1-8\",\"ok\":true,\"hits\":[{\"key\":\"" KEY64 "\",\"path\":\"01/x.kv\",\"bytes\":1,\"tokens\":1,\"fingerprint\":\"ab\"}],\"misses\":[]}"},
        {"reply_ingest.msg", "{\"v\":1,\"type\":\"ingest\",\"id\":\"1-11\",\"ok\":true,\"job\":\"00112233445566778899aabbccddeeff\",\"duplicate\":false}"},
        {"reply_status.msg", "{\"v\":1,\"type\":\"status\",\"id\":\"1-12\",\"ok\":true,\"state\":\"failed\",\"chunks_done\":1,\"chunks_total\":3,\"error\":\"disk full\"}"},
        {"token.msg", "{\"v\":1,\"type\":\"token\",\"id\":\"1-13\",\"ok\":true,\"text\":\"Hel\",\"index\":0}"},
        {"heartbeat.msg", "{\"v\":1,\"type\":\"heartbeat\",\"id\":\"1-13\",\"ok\":true,\"state\":\"queued\",\"position\":2,\"interval_ms\":1000}"},
        {"done.msg", "{\"v\":1,\"type\":\"done\",\"id\":\"1-13\",\"ok\":true,\"text\":\"Hello\",\"finish_reason\":\"stop\",\"metrics\":{\"mode\":\"blend\",\"ratio\":0.15,\"ttft_ms\":12.5,\"n_chunks\":2,\"cache_hits\":1},\"chunk_ids\":[\"" KEY64 "\"]}"},
        {"error.msg", "{\"v\":1,\"type\":\"query\",\"id\":\"1-13\",\"ok\":false,\"error\":{\"code\":\"overloaded\",\"message\":\"queue full\"}}"},
        {"error_unknown_code.msg", "{\"v\":1,\"type\":\"error\",\"id\":\"\",\"ok\":false,\"error\":{\"code\":\"weird\",\"message\":\"\"}}"},
        {"bin.msg", "{\"v\":1,\"type\":\"put\",\"id\":\"b\",\"blob\":{\"$bin\":\"00ff10\"},\"n\":null,\"neg\":-9223372036854775807}"},
        {"nested.msg", "{\"v\":1,\"type\":\"x\",\"id\":\"n\",\"a\":{\"b\":{\"c\":{\"d\":{\"e\":[1,[2]]}}}}}"},
        {"version2.msg", "{\"v\":2,\"type\":\"ping\",\"id\":\"v2\"}"},
        {"unicode.msg", "{\"v\":1,\"type\":\"search\",\"id\":\"u\",\"query\":\"caf\\u00e9 \\u4e16\\u754c \\ud83d\\ude00\"}"},
    };
    for (size_t i = 0; i < sizeof msgs / sizeof *msgs; i++)
        if (put_json_msg(msgs[i][0], msgs[i][1]) != 0) return -1;
    /* hostile frames, byte by byte (docs/protocol.md 2.1) */
    static const unsigned char array32[] = {0x83, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa4, 'p', 'i', 'n', 'g',
                                            0xa2, 'i', 'd', 0xdd, 0xff, 0xff, 0xff, 0xff};
    static const unsigned char map32[] = {0xdf, 0xff, 0xff, 0xff, 0xff};
    static const unsigned char str32[] = {0x84, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa4, 'p', 'i', 'n', 'g',
                                          0xa2, 'i', 'd', 0xa1, 'x', 0xa1, 'x', 0xdb, 0x7f, 0xff, 0xff, 0xff, 0x41};
    static const unsigned char ext[] = {0x84, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa4, 'p', 'i', 'n', 'g',
                                        0xa2, 'i', 'd', 0xa1, 'x', 0xa1, 'x', 0xd4, 0x01, 0x00};
    static const unsigned char dupkey[] = {0x84, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa4, 'p', 'i', 'n', 'g',
                                           0xa2, 'i', 'd', 0xa1, 'x', 0xa4, 't', 'y', 'p', 'e', 0xa2, 'g', 'c'};
    static const unsigned char badutf8[] = {0x83, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa4, 'p', 'i', 'n', 'g',
                                            0xa2, 'i', 'd', 0xa3, 0xed, 0xa0, 0x80};
    static const unsigned char nan64[] = {0x84, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa4, 'p', 'i', 'n', 'g',
                                          0xa2, 'i', 'd', 0xa1, 'x', 0xa1, 'r', 0xcb, 0x7f, 0xf8, 0, 0, 0, 0, 0, 0};
    static const unsigned char never[] = {0xc1};
    static const unsigned char trailing[] = {0x83, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa4, 'p', 'i', 'n', 'g',
                                             0xa2, 'i', 'd', 0xa1, 'x', 0xc0};
    static const unsigned char truncated[] = {0x83, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa4, 'p', 'i'};
    struct {
        const char *name;
        const unsigned char *p;
        size_t n;
    } raw[] = {{"raw_array32.msg", array32, sizeof array32}, {"raw_map32.msg", map32, sizeof map32},
               {"raw_str32.msg", str32, sizeof str32},       {"raw_ext.msg", ext, sizeof ext},
               {"raw_dupkey.msg", dupkey, sizeof dupkey},    {"raw_surrogate.msg", badutf8, sizeof badutf8},
               {"raw_nan.msg", nan64, sizeof nan64},         {"raw_c1.msg", never, sizeof never},
               {"raw_trailing.msg", trailing, sizeof trailing}, {"raw_truncated.msg", truncated, sizeof truncated},
               {"raw_empty.msg", truncated, 0}};
    for (size_t i = 0; i < sizeof raw / sizeof *raw; i++)
        if (put("corpus_msg", raw[i].name, raw[i].p, raw[i].n) != 0) return -1;
    /* 41 levels of one-element arrays inside a valid envelope */
    unsigned char deep[96];
    size_t n = 0;
    static const unsigned char head[] = {0x84, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa4, 'p', 'i', 'n', 'g',
                                         0xa2, 'i', 'd', 0xa1, 'x', 0xa1, 'd'};
    memcpy(deep, head, sizeof head);
    n = sizeof head;
    for (int i = 0; i < 41; i++) deep[n++] = 0x91;
    deep[n++] = 0x01;
    return put("corpus_msg", "raw_deep41.msg", deep, n);
}

/* ------------------------------------------------------------------ corpus_kvfile */

/* Writes a KV file through the real writer into a temporary directory, reads it back and stores it with
 * the fuzzer's mode byte in front (and a truncated copy). */
static int kv_seed(const char *tmpdir, const char *name, int n_layer, int n_head_kv, int head_dim,
                   cb_kv_dtype_t dtype, int n_tokens, unsigned char mode, bool truncated_too) {
    cb_kv_meta_t meta;
    memset(&meta, 0, sizeof meta);
    meta.n_layer = n_layer;
    meta.n_head_kv = n_head_kv;
    meta.head_dim = head_dim;
    meta.dtype = dtype;
    int32_t tokens[8];
    for (int i = 0; i < n_tokens; i++) tokens[i] = 100 + 7 * i;
    uint8_t key[32];
    cb_kvfile_key(meta.model_fp, meta.ctx_fp, tokens, n_tokens, key);
    char path[4096];
    if (cb_kvfile_path(tmpdir, key, path, sizeof path) != 0) return -1;
    size_t nf = (size_t)n_layer * (size_t)n_tokens * (size_t)(n_head_kv * head_dim);
    float *k = malloc(nf * sizeof(float) + 1), *v = malloc(nf * sizeof(float) + 1);
    if (!k || !v) return -1;
    for (size_t i = 0; i < nf; i++) {
        k[i] = (float)((int)(i % 17) - 8) * 0.125f;
        v[i] = (float)((int)(i % 11) - 5) * 0.25f;
    }
    char err[512];
    int rc = cb_kvfile_write(path, &meta, tokens, n_tokens, k, v, err, sizeof err);
    free(k);
    free(v);
    if (rc != 0) {
        fprintf(stderr, "gen_corpora: kvfile write: %s\n", err);
        return -1;
    }
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc((size_t)sz + 1);
    if (!buf || fread(buf + 1, 1, (size_t)sz, f) != (size_t)sz) {
        fclose(f);
        free(buf);
        return -1;
    }
    fclose(f);
    remove(path);
    buf[0] = mode;
    rc = put("corpus_kvfile", name, buf, (size_t)sz + 1);
    if (rc == 0 && truncated_too) {
        char tname[128];
        snprintf(tname, sizeof tname, "trunc_%s", name);
        rc = put("corpus_kvfile", tname, buf, (size_t)sz / 2 + 1);
        snprintf(tname, sizeof tname, "header_%s", name);
        if (rc == 0) rc = put("corpus_kvfile", tname, buf, sz > 257 ? 257 : (size_t)sz + 1);
    }
    free(buf);
    return rc;
}

static int gen_kvfile(const char *tmpdir) {
    if (mkdir(tmpdir, 0755) != 0 && errno != EEXIST) return -1;
    struct {
        const char *name;
        int L, H, D;
        cb_kv_dtype_t dt;
        int n;
        unsigned char mode;
        bool trunc;
    } seeds[] = {
        {"tiny_f32_m0.kv", 2, 1, 4, CB_KV_F32, 1, 0, true},  {"tiny_f16_m0.kv", 2, 1, 4, CB_KV_F16, 3, 0, true},
        {"tiny_bf16_m0.kv", 2, 1, 4, CB_KV_BF16, 2, 0, true}, {"tiny_f16_m1.kv", 3, 2, 2, CB_KV_F16, 4, 1, false},
        {"tiny_f32_m1.kv", 1, 1, 2, CB_KV_F32, 8, 1, true},  {"one_token_m0.kv", 2, 1, 4, CB_KV_F16, 1, 0, false},
        {"smollm_f16_m2.kv", 30, 3, 64, CB_KV_F16, 1, 2, true}, {"smollm_f16_m3.kv", 30, 3, 64, CB_KV_F16, 1, 3, false},
        {"smollm_f32_m2.kv", 30, 3, 64, CB_KV_F32, 1, 2, false}, {"tiny_f16_m3.kv", 2, 1, 4, CB_KV_F16, 2, 3, false},
    };
    for (size_t i = 0; i < sizeof seeds / sizeof *seeds; i++)
        if (kv_seed(tmpdir, seeds[i].name, seeds[i].L, seeds[i].H, seeds[i].D, seeds[i].dt, seeds[i].n, seeds[i].mode,
                    seeds[i].trunc) != 0)
            return -1;
    static const unsigned char junk[] = {0, 'C', 'B', 'K', 'V', 0, 0, 0, 1};
    if (put("corpus_kvfile", "junk_magic.kv", junk, sizeof junk) != 0) return -1;
    return put("corpus_kvfile", "empty.kv", junk, 1);
}

/* ------------------------------------------------------------------ corpus_gguf */

static int gen_gguf(void) {
    struct {
        const char *name;
        int L, E, H, HKV, F, V;
        cb_synth_dtype_t dt;
        bool tied;
        cb_synth_arch_t arch;
    } shapes[] = {
        {"synth_f32_tiny.seed", 1, 8, 2, 1, 16, 300, CB_SYNTH_F32, true, CB_SYNTH_LLAMA},
        {"synth_f32_untied.seed", 1, 8, 2, 2, 16, 300, CB_SYNTH_F32, false, CB_SYNTH_LLAMA},
        {"synth_bf16_tiny.seed", 2, 8, 2, 1, 16, 300, CB_SYNTH_BF16, true, CB_SYNTH_LLAMA},
        {"synth_q4_1_tiny.seed", 1, 32, 2, 1, 32, 300, CB_SYNTH_Q4_1, true, CB_SYNTH_LLAMA},
        /* the other architectures' tensors and keys (biases, Q/K norms, rope_freqs, qwen2.* / qwen3.*) */
        {"synth_llama3_tiny.seed", 1, 8, 2, 1, 16, 300, CB_SYNTH_F32, false, CB_SYNTH_LLAMA3},
        {"synth_qwen2_tiny.seed", 1, 8, 2, 1, 16, 300, CB_SYNTH_F32, true, CB_SYNTH_QWEN2},
        {"synth_qwen3_tiny.seed", 1, 8, 2, 1, 16, 300, CB_SYNTH_F32, true, CB_SYNTH_QWEN3},
        /* SentencePiece vocabularies, a window key, gemma3's post-norms; the Q5_0/Q4_K/Q6_K types */
        {"synth_mistral_tiny.seed", 1, 8, 2, 1, 16, 300, CB_SYNTH_F32, false, CB_SYNTH_MISTRAL},
        {"synth_gemma3_tiny.seed", 2, 8, 2, 1, 16, 300, CB_SYNTH_F32, true, CB_SYNTH_GEMMA3},
        {"synth_qmix_tiny.seed", 1, 256, 2, 1, 256, 300, CB_SYNTH_QMIX, true, CB_SYNTH_LLAMA},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        cb_synth_shape_t s;
        memset(&s, 0, sizeof s);
        snprintf(s.name, sizeof s.name, "seed%zu", i);
        s.n_layer = shapes[i].L, s.n_embd = shapes[i].E, s.n_head = shapes[i].H, s.n_head_kv = shapes[i].HKV;
        s.n_ff = shapes[i].F, s.n_vocab = shapes[i].V, s.n_ctx = 64, s.rope_base = 10000.0f, s.rms_eps = 1e-5f;
        s.tied = shapes[i].tied;
        s.arch = shapes[i].arch;
        char err[512];
        if (!cb_synth_shape_check(&s, shapes[i].dt, err, sizeof err)) {
            fprintf(stderr, "gen_corpora: %s: %s\n", shapes[i].name, err);
            return -1;
        }
        size_t len;
        void *buf = cb_synth_build(&s, shapes[i].dt, 7, &len, err, sizeof err);
        if (!buf) {
            fprintf(stderr, "gen_corpora: %s: %s\n", shapes[i].name, err);
            return -1;
        }
        int rc = put("corpus_gguf", shapes[i].name, buf, len);
        char tname[96];
        snprintf(tname, sizeof tname, "trunc_%s", shapes[i].name);
        if (rc == 0 && i == 0) rc = put("corpus_gguf", tname, buf, len / 3);
        free(buf);
        if (rc != 0) return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ corpus_tokenizer */

static int put_text(const char *sub, int idx, unsigned char mode, const char *s, size_t n) {
    char name[64];
    snprintf(name, sizeof name, "t%03d_m%u.txt", idx, mode);
    unsigned char *b = malloc(n + 1);
    if (!b) return -1;
    b[0] = mode;
    memcpy(b + 1, s, n);
    int rc = put(sub, name, b, n + 1);
    free(b);
    return rc;
}

static int gen_tokenizer(const char *fixtures) {
    int idx = 0;
    FILE *f = fopen(fixtures, "r");
    if (f) { /* every 24th fixture text (about 28 of 666) */
        char *line = NULL;
        size_t cap = 0;
        for (int ln = 0; ln < 100000 && getline(&line, &cap, f) > 0; ln++) {
            if (ln % 24) continue;
            json_t *o = json_loads(line, 0, NULL);
            json_t *t = json_object_get(o, "text");
            if (json_is_string(t)) {
                bool sp = json_is_true(json_object_get(o, "special"));
                if (put_text("corpus_tokenizer", idx++, sp ? 1 : 0, json_string_value(t), json_string_length(t)) != 0) {
                    json_decref(o);
                    free(line);
                    fclose(f);
                    return -1;
                }
            }
            json_decref(o);
        }
        free(line);
        fclose(f);
    }
    static const char *const texts[] = {
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|><|im_end|><|im_start|>",
        "   leading and trailing spaces   \n\n\t\ttabs",
        "numbers 1234567890 3.14159 -42 1e10 0x1F",
        "I'm you're they've we'll she'd it's 'quoted'",
        "caf\xc3\xa9 na\xc3\xafve \xc3\xbc\xc3\xb6\xc3\xa4 \xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x98\x80\xf0\x9f\x91\x8d",
        "\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 \xd9\x85\xd8\xb1\xd8\xad\xd8\xa8\xd8\xa7 \xe0\xa4\xa8\xe0\xa4\xae",
        "\xc0\xaf overlong \xe0\x80\xaf and \xed\xa0\x80 surrogate",
        "\xff\xfe\xfd bytes \x80\x81 cut \xe2\x82",
        "control \x01\x02\x04\x06\x13\x14\x16\x1d\x7f",
        "",
        "a",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "https://example.com/path?q=1&r=2#frag <tag attr=\"v\">",
    };
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
        size_t n = strlen(texts[i]);
        if (put_text("corpus_tokenizer", idx++, 0, texts[i], n) != 0) return -1;
        if (i < 3 && put_text("corpus_tokenizer", idx++, 3, texts[i], n) != 0) return -1;
    }
    static const char nul[] = "with\0nul\0bytes";
    return put_text("corpus_tokenizer", idx, 0, nul, sizeof nul - 1);
}

/* ------------------------------------------------------------------ corpus_qa */

static int gen_qa(void) {
    static const char *const lines[] = {
        "{\"id\": \"q1\", \"question\": \"Who designed the lighthouse?\", \"answers\": [\"Miriam Ashcombe\"], \"ctxs\": "
        "[{\"title\": \"Kettleby\", \"text\": \"The lighthouse was designed by Miriam Ashcombe.\"}]}",
        "{\"id\": \"q2\", \"question\": \"When?\", \"answers\": [\"1871\", \"in 1871\"], \"ctxs\": [{\"title\": \"\", "
        "\"text\": \"a\"}, {\"title\": \"b\", \"text\": \"c\"}]}",
        "{\"id\": 3, \"question\": \"\", \"answers\": [], \"ctxs\": []}",
        "{\"id\": \"q4\", \"question\": \"The Beatles' \\\"White Album\\\"?\", \"answers\": [\"The   Beatles!\"], \"ctxs\": "
        "[{\"title\": \"t\", \"text\": \"caf\\u00e9 \\ud83d\\ude00\"}]}",
        "{\"id\": \"q5\", \"question\": \"x\", \"answers\": \"not a list\", \"ctxs\": {}}",
        "{\"id\": \"q6\"",
        "not json at all",
        "[1, 2, 3]",
        "{\"id\": \"q7\", \"question\": \"a an the\", \"answers\": [\"a\"], \"ctxs\": [{\"text\": 5}]}",
        "",
    };
    for (size_t i = 0; i < sizeof lines / sizeof *lines; i++) {
        char name[32];
        snprintf(name, sizeof name, "qa%02zu.jsonl", i);
        if (put("corpus_qa", name, lines[i], strlen(lines[i])) != 0) return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: gen_corpora OUTDIR [TOKENIZER_FIXTURES.jsonl]\n");
        return 2;
    }
    g_out = argv[1];
    const char *fixtures = argc == 3 ? argv[2] : "tests/fixtures/tokenizer.jsonl";
    static const char *const subs[] = {"corpus_msg", "corpus_kvfile", "corpus_gguf", "corpus_tokenizer", "corpus_qa"};
    for (size_t i = 0; i < sizeof subs / sizeof *subs; i++)
        if (mkdirs(subs[i]) != 0) {
            fprintf(stderr, "gen_corpora: cannot create %s/%s\n", g_out, subs[i]);
            return 1;
        }
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s/.kvtmp", g_out);
    if (gen_msg() != 0 || gen_kvfile(tmp) != 0 || gen_gguf() != 0 || gen_tokenizer(fixtures) != 0 || gen_qa() != 0)
        return 1;
    printf("gen_corpora: %d files under %s\n", g_files, g_out);
    return 0;
}
