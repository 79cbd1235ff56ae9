/* test_synth: synthetic GGUF models — a tiny shape written to /tmp and read back by the GGUF reader, the
 * model loader, the tokenizer and the engine; the in-memory build gives the same bytes; stored values
 * equal the generator's (bf16: exactly; q4_1: within a quantization step); named shapes; bad shapes. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "format/gguf.h"
#include "model/model.h"
#include "format/quant.h"
#include "model/synth.h"
#include "test.h"
#include "model/tokenizer.h"

static cb_synth_shape_t tiny(void) {
    cb_synth_shape_t s;
    memset(&s, 0, sizeof s);
    snprintf(s.name, sizeof s.name, "tiny");
    s.n_layer = 2, s.n_embd = 64, s.n_head = 4, s.n_head_kv = 2, s.n_ff = 96, s.n_vocab = 400, s.n_ctx = 128;
    s.rope_base = 10000.0f, s.rms_eps = 1e-5f, s.tied = false;
    return s;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return b;
}

TEST(test_write_and_read_back) {
    cb_synth_shape_t s = tiny();
    char path[64], err[256] = "";
    snprintf(path, sizeof path, "/tmp/cb_test_synth_%d.gguf", (int)getpid());
    CHECK_MSG(cb_synth_write(path, &s, CB_SYNTH_BF16, 7, err, sizeof err) == 0, "%s", err);
    cb_gguf_t *g = cb_gguf_open(path, err, sizeof err);
    CHECK_MSG(g != NULL, "%s", err);
    uint32_t v;
    CHECK(cb_gguf_version(g) == 3);
    CHECK(cb_gguf_get_u32(g, "llama.block_count", &v) && v == 2);
    CHECK(cb_gguf_get_u32(g, "llama.embedding_length", &v) && v == 64);
    CHECK(cb_gguf_get_u32(g, "llama.attention.head_count_kv", &v) && v == 2);
    CHECK(cb_gguf_get_u32(g, "llama.rope.dimension_count", &v) && v == 16);
    CHECK(cb_gguf_n_tensors(g) == 3 + 9 * 2);
    /* every stored bf16 value is the generator's value rounded to bf16 */
    const cb_gguf_tensor_t *t = cb_gguf_find_tensor(g, "blk.1.attn_k.weight");
    CHECK(t && t->type == CB_TYPE_BF16 && t->ne[0] == 64 && t->ne[1] == 32);
    float ref[64 * 32];
    cb_synth_fill(&s, 7, 1, CB_SYNTH_ATTN_K, 0, 64 * 32, ref);
    const uint8_t *d = t->data;
    for (int i = 0; i < 64 * 32; i++) {
        uint16_t b = (uint16_t)(d[2 * i] | d[2 * i + 1] << 8);
        CHECK_MSG(b == cb_f32_to_bf16(ref[i]), "element %d: %04x vs %g", i, b, ref[i]);
    }
    t = cb_gguf_find_tensor(g, "blk.0.ffn_norm.weight");
    CHECK(t && t->type == CB_TYPE_F32 && t->n_dims == 1);
    float nv[64];
    memcpy(nv, t->data, sizeof nv);
    for (int i = 0; i < 64; i++) CHECK(nv[i] >= 0.9f && nv[i] <= 1.1f);
    cb_gguf_destroy(&g);

    /* the in-memory build gives the same bytes */
    size_t flen = 0, mlen = 0;
    char *fb = read_file(path, &flen);
    void *mb = cb_synth_build(&s, CB_SYNTH_BF16, 7, &mlen, err, sizeof err);
    int same = fb && mb && flen == mlen && memcmp(fb, mb, flen) == 0;
    free(fb);
    free(mb);
    unlink(path);
    CHECK(same);
}

TEST(test_model_tokenizer_engine) {
    cb_synth_shape_t s = tiny();
    char path[64], err[256] = "";
    snprintf(path, sizeof path, "/tmp/cb_test_synth_m_%d.gguf", (int)getpid());
    CHECK_MSG(cb_synth_write(path, &s, CB_SYNTH_F32, 3, err, sizeof err) == 0, "%s", err);
    cb_model_t *m = cb_model_load(path, err, sizeof err);
    unlink(path);
    CHECK_MSG(m != NULL, "%s", err);
    const cb_hparams_t *hp = cb_model_hparams(m);
    int ok = hp->n_layer == 2 && hp->n_embd == 64 && hp->n_head == 4 && hp->n_head_kv == 2 && hp->head_dim == 16 &&
             hp->n_ff == 96 && hp->n_vocab == 400 && !hp->tied_output && hp->bos_id == 1 && hp->eos_id == 2 &&
             hp->rope_base == 10000.0f;
    bool eog = cb_model_is_eog(m, 2);
    cb_tokenizer_t *tk = cb_tokenizer_new_from_gguf(cb_model_gguf(m), err, sizeof err);
    int tok_ok = tk != NULL;
    int32_t ids[64];
    int n = tk ? cb_tokenizer_encode(tk, "the cat is in the hat", 21, false, ids, 64) : -1;
    char back[64] = "";
    if (n > 0) cb_tokenizer_decode(tk, ids, (size_t)n, false, back, sizeof back);
    int32_t sp[8];
    int nsp = tk ? cb_tokenizer_encode(tk, "<|im_start|>user", 16, true, sp, 8) : -1;
    cb_tokenizer_destroy(&tk);
    /* a short forward: finite logits with a clear winner */
    cb_engine_t *e = cb_engine_new(m, 64, err, sizeof err);
    cb_seq_t *seq = e ? cb_seq_new(e) : NULL;
    float logits[400] = {0};
    int32_t prompt[8] = {1, 100, 101, 102, 103, 104, 105, 106};
    int rc = seq ? cb_engine_prefill(e, seq, prompt, 8, 0, logits) : -1;
    double mean = 0, var = 0;
    int finite = 1;
    for (int i = 0; i < 400; i++) { finite &= isfinite(logits[i]) != 0; mean += logits[i]; }
    mean /= 400;
    for (int i = 0; i < 400; i++) var += (logits[i] - mean) * (logits[i] - mean);
    cb_seq_destroy(&seq);
    cb_engine_destroy(&e);
    cb_model_destroy(&m);
    CHECK(ok);
    CHECK(eog);
    CHECK_MSG(tok_ok, "%s", err);
    CHECK_MSG(n > 0 && n < 21, "encoded into %d tokens (merges should shorten it)", n);
    CHECK_MSG(!strcmp(back, "the cat is in the hat"), "decoded '%s'", back);
    CHECK_MSG(nsp >= 2 && sp[0] == 1, "special token parse gave %d tokens, first %d", nsp, nsp > 0 ? sp[0] : -1);
    CHECK(rc == 0);
    CHECK(finite);
    double sd = sqrt(var / 400);
    CHECK_MSG(sd > 1.0 && sd < 20.0, "logit std %g", sd);
}

TEST(test_q4_1) {
    cb_synth_shape_t s = tiny();
    s.tied = true;
    char err[256] = "";
    size_t len = 0;
    void *buf = cb_synth_build(&s, CB_SYNTH_Q4_1, 11, &len, err, sizeof err);
    CHECK_MSG(buf != NULL, "%s", err);
    cb_gguf_t *g = cb_gguf_open_mem(buf, len, err, sizeof err);
    int opened = g != NULL;
    const cb_gguf_tensor_t *t = g ? cb_gguf_find_tensor(g, "blk.0.ffn_down.weight") : NULL;
    const cb_gguf_tensor_t *e = g ? cb_gguf_find_tensor(g, "token_embd.weight") : NULL;
    int types = t && e && t->type == CB_TYPE_Q4_1 && e->type == CB_TYPE_Q8_0 && !cb_gguf_find_tensor(g, "output.weight");
    double worst = 0;
    if (types) {
        size_t n = (size_t)t->ne[0] * (size_t)t->ne[1];
        float *deq = malloc(n * sizeof *deq), *ref = malloc(n * sizeof *ref);
        cb_dequant(t->type, t->data, deq, n);
        cb_synth_fill(&s, 11, 0, CB_SYNTH_FFN_DOWN, 0, n, ref);
        /* Q4_1 step: (max - min) / 15 <= 2 * scale / 15 per block; error <= half a step (+ f16 of d, m) */
        float step = 2.0f * cb_synth_scale(&s, CB_SYNTH_FFN_DOWN) / 15.0f;
        for (size_t i = 0; i < n; i++) worst = fmax(worst, fabs(deq[i] - ref[i]) / step);
        free(deq);
        free(ref);
    }
    cb_gguf_destroy(&g);
    free(buf);
    CHECK_MSG(opened, "%s", err);
    CHECK(types);
    CHECK_MSG(worst <= 0.51, "worst error %g steps", worst);
}

TEST(test_shapes_and_errors) {
    cb_synth_shape_t s;
    char err[256];
    CHECK(cb_synth_shape_named("smollm2-135m", &s) && s.n_layer == 30 && s.n_embd == 576 && s.tied);
    CHECK(cb_synth_shape_check(&s, CB_SYNTH_Q4_1, err, sizeof err));
    CHECK(cb_synth_shape_named("llama3-8b", &s) && s.n_vocab == 128256 && s.n_head_kv == 8 && !s.tied);
    CHECK(cb_synth_shape_check(&s, CB_SYNTH_BF16, err, sizeof err));
    CHECK(cb_synth_shape_named("mistral-7b", &s) && s.n_vocab == 32000);
    CHECK(!cb_synth_shape_named("gpt5", &s));
    s = tiny();
    s.n_head_kv = 3;
    CHECK(!cb_synth_shape_check(&s, CB_SYNTH_BF16, err, sizeof err) && strstr(err, "kv heads"));
    s = tiny();
    s.n_ff = 100;
    CHECK(!cb_synth_shape_check(&s, CB_SYNTH_Q4_1, err, sizeof err));
    CHECK(cb_synth_shape_check(&s, CB_SYNTH_BF16, err, sizeof err));
    s = tiny();
    s.n_vocab = 100;
    CHECK(!cb_synth_shape_check(&s, CB_SYNTH_BF16, err, sizeof err));
    CHECK(cb_synth_write("/nonexistent-dir/x.gguf", &(cb_synth_shape_t){0}, CB_SYNTH_BF16, 1, err, sizeof err) == -1);
    s = tiny();
    CHECK(cb_synth_write("/nonexistent-dir/x.gguf", &s, CB_SYNTH_BF16, 1, err, sizeof err) == -1 &&
          strstr(err, "nonexistent"));
    /* the generator: deterministic, seed-dependent, in [-1, 1), mean ~0 */
    double sum = 0;
    for (int i = 0; i < 10000; i++) {
        float u = cb_synth_u(5, 17, (uint64_t)i);
        CHECK(u >= -1.0f && u < 1.0f);
        sum += u;
    }
    CHECK(fabs(sum / 10000) < 0.03);
    CHECK(cb_synth_u(5, 17, 3) == cb_synth_u(5, 17, 3));
    CHECK(cb_synth_u(5, 17, 3) != cb_synth_u(6, 17, 3));
    CHECK(cb_synth_tensor_id(-1, CB_SYNTH_OUTPUT) == 2 && cb_synth_tensor_id(1, CB_SYNTH_ATTN_Q) == 16 + 16 + 4);
}

int main(void) {
    RUN(test_write_and_read_back);
    RUN(test_model_tokenizer_engine);
    RUN(test_q4_1);
    RUN(test_shapes_and_errors);
    return test_summary();
}
