/* arch.c: the architecture table (see arch.h). */
#include "model/arch.h"

#include <string.h>

static const cb_arch_t ARCHS[] = {
    {.name = "llama", .rope = CB_ROPE_NORM, .act = CB_ACT_SILU, .rope_freqs = true, .swa = CB_SWA_ALL},
    {.name = "qwen2", .rope = CB_ROPE_NEOX, .act = CB_ACT_SILU, .qkv_bias = true},
    {.name = "qwen3", .rope = CB_ROPE_NEOX, .act = CB_ACT_SILU, .qk_norm = true},
    {.name = "gemma3", .rope = CB_ROPE_NEOX, .act = CB_ACT_GELU_TANH, .qk_norm = true, .post_norms = true,
     .embd_scale = true, .swa = CB_SWA_PERIODIC},
};

const cb_arch_t *cb_arch_find(const char *name, size_t len) {
    for (size_t i = 0; i < sizeof ARCHS / sizeof ARCHS[0]; i++)
        if (strlen(ARCHS[i].name) == len && memcmp(ARCHS[i].name, name, len) == 0) return &ARCHS[i];
    return NULL;
}

const char *cb_arch_names(void) { return "llama, qwen2, qwen3, gemma3"; }
