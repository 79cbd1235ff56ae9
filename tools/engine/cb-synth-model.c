/* cb-synth-model: writes a GGUF v3 with deterministic random weights (libshared/synth) of one of the engine's
 * architectures (--arch llama|llama3|qwen2|qwen3|mistral|gemma3, default llama; llama3 adds rope_freqs, qwen2
 * Q/K/V biases and NEOX RoPE, qwen3 per-head Q/K norms and NEOX RoPE, mistral a SentencePiece vocabulary,
 * gemma3 its block: synth.h).
 *
 *   cb-synth-model --shape smollm2-135m|llama3-8b|mistral-7b [--arch A] [--dtype bf16|q4_1|f32|q4_k_m] [--seed S]
 *                  --out FILE
 *   cb-synth-model --layers N --dim D --heads H --kv-heads K --ffn F --vocab V [--ctx C] [--rope-base B]
 *                  [--head-dim D] [--window W] [--tied] [--dtype ...] [--seed S] --out FILE
 * Options given after --shape override that shape's fields. Defaults: dtype bf16, seed 1, ctx 4096,
 * rope base 10000. The same (shape, dtype, seed) always gives the same bytes; the engine can build the
 * same model in memory with cb_synth_build. Exit: 0 ok, 1 write error, 2 bad arguments.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/synth.h"

static int usage(void) {
    fprintf(stderr,
            "usage: cb-synth-model --shape smollm2-135m|llama3-8b|mistral-7b\n"
            "                      [--arch llama|llama3|qwen2|qwen3|mistral|gemma3]\n"
            "                      [--dtype bf16|q4_1|f32|q4_k_m] [--seed S] --out FILE\n"
            "       cb-synth-model --layers N --dim D --heads H --kv-heads K --ffn F --vocab V [--ctx C]\n"
            "                      [--rope-base B] [--head-dim D] [--window W] [--tied] [--dtype ...] [--seed S]\n"
            "                      --out FILE\n");
    return 2;
}

static bool parse_int(const char *s, int lo, int hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = (int)v;
    return true;
}

int main(int argc, char **argv) {
    cb_synth_shape_t s;
    memset(&s, 0, sizeof s);
    s.n_ctx = 4096;
    s.rope_base = 10000.0f;
    s.rms_eps = 1e-5f;
    cb_synth_dtype_t dtype = CB_SYNTH_BF16;
    unsigned long long seed = 1;
    const char *out = NULL;
    bool have_shape = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int *field = NULL;
        if (!strcmp(a, "--tied")) { s.tied = true; continue; }
        if (!v) return usage();
        i++;
        if (!strcmp(a, "--shape")) {
            if (!cb_synth_shape_named(v, &s)) {
                fprintf(stderr, "cb-synth-model: unknown shape '%s'\n", v);
                return usage();
            }
            have_shape = true;
        } else if (!strcmp(a, "--arch")) {
            if (!cb_synth_arch_parse(v, &s.arch)) {
                fprintf(stderr, "cb-synth-model: unknown arch '%s'\n", v);
                return usage();
            }
        } else if (!strcmp(a, "--dtype")) {
            if (!cb_synth_dtype_parse(v, &dtype)) {
                fprintf(stderr, "cb-synth-model: unknown dtype '%s'\n", v);
                return usage();
            }
        } else if (!strcmp(a, "--seed")) {
            char *end;
            errno = 0;
            seed = strtoull(v, &end, 0);
            if (errno || end == v || *end) return usage();
        } else if (!strcmp(a, "--out")) {
            out = v;
        } else if (!strcmp(a, "--rope-base")) {
            char *end;
            s.rope_base = strtof(v, &end);
            if (end == v || *end) return usage();
        } else if (!strcmp(a, "--layers")) field = &s.n_layer;
        else if (!strcmp(a, "--dim")) field = &s.n_embd;
        else if (!strcmp(a, "--heads")) field = &s.n_head;
        else if (!strcmp(a, "--kv-heads")) field = &s.n_head_kv;
        else if (!strcmp(a, "--ffn")) field = &s.n_ff;
        else if (!strcmp(a, "--vocab")) field = &s.n_vocab;
        else if (!strcmp(a, "--ctx")) field = &s.n_ctx;
        else if (!strcmp(a, "--head-dim")) field = &s.head_dim;
        else if (!strcmp(a, "--window")) field = &s.window;
        else return usage();
        if (field && !parse_int(v, 1, 1 << 24, field)) {
            fprintf(stderr, "cb-synth-model: bad value for %s: '%s'\n", a, v);
            return usage();
        }
    }
    if (!out) return usage();
    if (!have_shape) {
        snprintf(s.name, sizeof s.name, "custom");
        if (!s.n_head_kv) s.n_head_kv = s.n_head;
    }
    char err[256] = "";
    if (!cb_synth_shape_check(&s, dtype, err, sizeof err)) {
        fprintf(stderr, "cb-synth-model: %s\n", err);
        return 2;
    }
    if (cb_synth_write(out, &s, dtype, (uint64_t)seed, err, sizeof err) != 0) {
        fprintf(stderr, "cb-synth-model: %s\n", err);
        return 1;
    }
    fprintf(stderr, "cb-synth-model: wrote %s (%s: %d layers, dim %d, heads %d/%d, ffn %d, vocab %d, seed %llu)\n", out,
            s.name, s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.n_ff, s.n_vocab, seed);
    return 0;
}
