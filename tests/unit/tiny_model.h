/* tiny_model.h: writes a small random llama-architecture GGUF v3 file for engine/model tests, so they
 * run (fast, also under ASan) without the real model, and can be broken on purpose to test the
 * loader's error paths. Header-only test helper (static functions).
 *
 * Geometry: 2 layers, n_embd 64, 4 heads / 2 KV heads (head_dim 16), n_ff 96, vocab 80, context 256;
 * block weights Q4_1, token_embd Q8_0, norms F32, tied output (unless opts ask otherwise).
 */
#ifndef CB_TINY_MODEL_H
#define CB_TINY_MODEL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "format/quant.h"

typedef struct {
    const char *arch;          /* default "llama" */
    const char *drop_tensor;   /* omit this tensor */
    const char *extra_tensor;  /* add this F32 [64] tensor (e.g. a bias) */
    const char *bad_shape;     /* write this 2-D tensor with one row too many */
    int rope_dim;              /* 0: head_dim */
    int separate_output;       /* add output.weight (Q8_0) */
    int n_vocab;               /* 0: 80 */
    unsigned seed;
} tiny_opts_t;

#define TINY_L 2
#define TINY_E 64
#define TINY_H 4
#define TINY_HKV 2
#define TINY_HD 16
#define TINY_F 96
#define TINY_CTX 256

typedef struct { FILE *f; } tw_t;

static void tw_u32(FILE *f, uint32_t v) { fwrite(&v, 4, 1, f); }
static void tw_u64(FILE *f, uint64_t v) { fwrite(&v, 8, 1, f); }
static void tw_str(FILE *f, const char *s) { tw_u64(f, strlen(s)); fwrite(s, 1, strlen(s), f); }
static void tw_kv_u32(FILE *f, const char *k, uint32_t v) { tw_str(f, k); tw_u32(f, 4); tw_u32(f, v); }
static void tw_kv_f32(FILE *f, const char *k, float v) { tw_str(f, k); tw_u32(f, 6); fwrite(&v, 4, 1, f); }
static void tw_kv_str(FILE *f, const char *k, const char *v) { tw_str(f, k); tw_u32(f, 8); tw_str(f, v); }

typedef struct { char name[64]; int n_dims; uint64_t ne0, ne1; uint32_t type; size_t bytes; uint8_t *data; } tw_tensor_t;

static uint32_t tiny_rand(unsigned *s) { *s = *s * 1103515245u + 12345u; return (*s >> 8) & 0xFFFFFF; }

static void tiny_fill(tw_tensor_t *t, unsigned *seed, int is_norm) {
    size_t n = (size_t)t->ne0 * t->ne1;
    if (t->type == 0) {
        t->bytes = n * 4;
        t->data = malloc(t->bytes);
        float *p = (float *)t->data;
        for (size_t i = 0; i < n; i++)
            p[i] = is_norm ? 1.0f + ((float)tiny_rand(seed) / 16777216.0f - 0.5f) * 0.4f
                           : ((float)tiny_rand(seed) / 16777216.0f - 0.5f) * 0.2f;
    } else if (t->type == 3) { /* Q4_1 */
        size_t nb = n / 32;
        t->bytes = nb * 20;
        t->data = malloc(t->bytes);
        for (size_t b = 0; b < nb; b++) {
            uint8_t *blk = t->data + b * 20;
            float d = 0.015f + 0.01f * (float)tiny_rand(seed) / 16777216.0f;
            uint16_t hd = cb_f32_to_f16(d), hm = cb_f32_to_f16(-7.5f * d);
            memcpy(blk, &hd, 2);
            memcpy(blk + 2, &hm, 2);
            for (int j = 0; j < 16; j++) blk[4 + j] = (uint8_t)tiny_rand(seed);
        }
    } else { /* Q8_0 */
        size_t nb = n / 32;
        t->bytes = nb * 34;
        t->data = malloc(t->bytes);
        for (size_t b = 0; b < nb; b++) {
            uint8_t *blk = t->data + b * 34;
            uint16_t hd = cb_f32_to_f16(0.008f);
            memcpy(blk, &hd, 2);
            for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t)tiny_rand(seed);
        }
    }
}

/* Writes the tiny model to path. Returns 0 on success. */
static int tiny_model_write(const char *path, const tiny_opts_t *o) {
    tiny_opts_t def = {0};
    if (!o) o = &def;
    unsigned seed = o->seed ? o->seed : 1234u;
    const int V = o->n_vocab ? o->n_vocab : 80;
    tw_tensor_t ts[64];
    int nt = 0;
#define ADD(nm, dims, a, b, ty)                                                                   \
    do {                                                                                          \
        tw_tensor_t *t_ = &ts[nt];                                                                \
        memset(t_, 0, sizeof *t_);                                                                \
        snprintf(t_->name, sizeof t_->name, "%s", nm);                                            \
        t_->n_dims = dims; t_->ne0 = a; t_->ne1 = b; t_->type = ty;                               \
        if (o->drop_tensor && !strcmp(o->drop_tensor, t_->name)) break;                           \
        if (o->bad_shape && !strcmp(o->bad_shape, t_->name)) t_->ne1 += 1;                        \
        tiny_fill(t_, &seed, dims == 1);                                                          \
        nt++;                                                                                     \
    } while (0)
    char nm[64];
    ADD("token_embd.weight", 2, TINY_E, V, 8);
    for (int l = 0; l < TINY_L; l++) {
        snprintf(nm, sizeof nm, "blk.%d.attn_norm.weight", l); ADD(nm, 1, TINY_E, 1, 0);
        snprintf(nm, sizeof nm, "blk.%d.attn_q.weight", l); ADD(nm, 2, TINY_E, TINY_H * TINY_HD, 3);
        snprintf(nm, sizeof nm, "blk.%d.attn_k.weight", l); ADD(nm, 2, TINY_E, TINY_HKV * TINY_HD, 3);
        snprintf(nm, sizeof nm, "blk.%d.attn_v.weight", l); ADD(nm, 2, TINY_E, TINY_HKV * TINY_HD, 3);
        snprintf(nm, sizeof nm, "blk.%d.attn_output.weight", l); ADD(nm, 2, TINY_H * TINY_HD, TINY_E, 3);
        snprintf(nm, sizeof nm, "blk.%d.ffn_norm.weight", l); ADD(nm, 1, TINY_E, 1, 0);
        snprintf(nm, sizeof nm, "blk.%d.ffn_gate.weight", l); ADD(nm, 2, TINY_E, TINY_F, 3);
        snprintf(nm, sizeof nm, "blk.%d.ffn_up.weight", l); ADD(nm, 2, TINY_E, TINY_F, 3);
        snprintf(nm, sizeof nm, "blk.%d.ffn_down.weight", l); ADD(nm, 2, TINY_F, TINY_E, 3);
    }
    ADD("output_norm.weight", 1, TINY_E, 1, 0);
    if (o->separate_output) ADD("output.weight", 2, TINY_E, V, 8);
    if (o->extra_tensor) ADD(o->extra_tensor, 1, TINY_E, 1, 0);
#undef ADD
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    const int n_kv = 16;
    fwrite("GGUF", 1, 4, f);
    tw_u32(f, 3);
    tw_u64(f, (uint64_t)nt);
    tw_u64(f, (uint64_t)n_kv);
    tw_kv_str(f, "general.architecture", o->arch ? o->arch : "llama");
    const char *a = o->arch ? o->arch : "llama";
    char k[128];
    snprintf(k, sizeof k, "%s.block_count", a); tw_kv_u32(f, k, TINY_L);
    snprintf(k, sizeof k, "%s.context_length", a); tw_kv_u32(f, k, TINY_CTX);
    snprintf(k, sizeof k, "%s.embedding_length", a); tw_kv_u32(f, k, TINY_E);
    snprintf(k, sizeof k, "%s.feed_forward_length", a); tw_kv_u32(f, k, TINY_F);
    snprintf(k, sizeof k, "%s.attention.head_count", a); tw_kv_u32(f, k, TINY_H);
    snprintf(k, sizeof k, "%s.attention.head_count_kv", a); tw_kv_u32(f, k, TINY_HKV);
    snprintf(k, sizeof k, "%s.rope.freq_base", a); tw_kv_f32(f, k, 10000.0f);
    snprintf(k, sizeof k, "%s.attention.layer_norm_rms_epsilon", a); tw_kv_f32(f, k, 1e-5f);
    snprintf(k, sizeof k, "%s.rope.dimension_count", a); tw_kv_u32(f, k, o->rope_dim ? (uint32_t)o->rope_dim : TINY_HD);
    tw_kv_str(f, "tokenizer.ggml.model", "gpt2");
    tw_str(f, "tokenizer.ggml.tokens"); tw_u32(f, 9); tw_u32(f, 8); tw_u64(f, (uint64_t)V);
    for (int i = 0; i < V; i++) {
        char t[32];
        if (i == 0) snprintf(t, sizeof t, "<|endoftext|>");
        else if (i == 2) snprintf(t, sizeof t, "<|im_end|>");
        else snprintf(t, sizeof t, "t%d", i);
        tw_str(f, t);
    }
    tw_str(f, "tokenizer.ggml.token_type"); tw_u32(f, 9); tw_u32(f, 5); tw_u64(f, (uint64_t)V);
    for (int i = 0; i < V; i++) tw_u32(f, (i == 0 || i == 2) ? 3u : 1u);
    tw_str(f, "tokenizer.ggml.merges"); tw_u32(f, 9); tw_u32(f, 8); tw_u64(f, 2);
    tw_str(f, "t 1"); tw_str(f, "t 2");
    tw_kv_u32(f, "tokenizer.ggml.bos_token_id", 1);
    tw_kv_u32(f, "tokenizer.ggml.eos_token_id", 2);
    uint64_t off = 0;
    for (int i = 0; i < nt; i++) {
        tw_str(f, ts[i].name);
        tw_u32(f, (uint32_t)ts[i].n_dims);
        tw_u64(f, ts[i].ne0);
        if (ts[i].n_dims == 2) tw_u64(f, ts[i].ne1);
        tw_u32(f, ts[i].type);
        tw_u64(f, off);
        off += (ts[i].bytes + 31) / 32 * 32;
    }
    long pos = ftell(f);
    while (pos % 32) { fputc(0, f); pos++; }
    for (int i = 0; i < nt; i++) {
        fwrite(ts[i].data, 1, ts[i].bytes, f);
        for (size_t p = ts[i].bytes; p % 32; p++) fputc(0, f);
        free(ts[i].data);
    }
    return fclose(f) == 0 ? 0 : -1;
}
#endif
