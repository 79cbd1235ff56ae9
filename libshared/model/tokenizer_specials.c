/* tokenizer_specials.c: the special tokens of a vocabulary as llama.cpp finds them (llama_vocab::impl::load):
 * BOS/EOS/PAD by key, EOT/EOM and the FIM markers by key or else by text (a match found by text gets the
 * control attribute), and the end-of-generation set. Part of the tokenizer (tokenizer_internal.h). */
#include "model/tokenizer_internal.h"

#include <stddef.h>

#include "base/log.h"

static int32_t get_id(const cb_gguf_t *g, const char *key, int n_vocab) {
    uint32_t v;
    if (!cb_gguf_get_u32(g, key, &v)) return -1;
    if (v >= (uint32_t)n_vocab) {
        CB_WARN("tokenizer: %s = %u is outside the vocabulary (%d tokens); ignored", key, v, n_vocab);
        return -1;
    }
    return (int32_t)v;
}

/* The texts llama.cpp (llama_vocab::impl::load) recognises, by category. */
static const char *const EOT_TEXTS[] = {"<|eot_id|>", "<|endoftext|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                                        "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
                                        "<\xEF\xBD\x9C" "end\xE2\x96\x81" "of\xE2\x96\x81" "sentence\xEF\xBD\x9C>",
                                        "<end_of_utterance>", NULL};
static const char *const EOM_TEXTS[] = {"<|eom_id|>", NULL};
static const char *const FIM_PRE_TEXTS[] = {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                                            "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "begin\xEF\xBD\x9C>", "<PRE>",
                                            "\xE2\x96\x81<PRE>", "<|code_prefix|>", "<|prefix|>", NULL};
static const char *const FIM_SUF_TEXTS[] = {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                                            "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "hole\xEF\xBD\x9C>", "<SUF>",
                                            "\xE2\x96\x81<SUF>", "<|code_suffix|>", "<|suffix|>", NULL};
static const char *const FIM_MID_TEXTS[] = {"<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                                            "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "end\xEF\xBD\x9C>", "<MID>",
                                            "\xE2\x96\x81<MID>", "<|code_middle|>", "<|middle|>", NULL};
static const char *const FIM_PAD_TEXTS[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", NULL};
static const char *const FIM_REP_TEXTS[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
                                            NULL};
static const char *const FIM_SEP_TEXTS[] = {"<|file_sep|>", NULL};
static const char *const EOG_TEXTS[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
                                        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
                                        "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
                                        "<turn|>", "<|tool_response>",
                                        "<\xEF\xBD\x9C" "end\xE2\x96\x81" "of\xE2\x96\x81" "sentence\xEF\xBD\x9C>",
                                        "[e~[", NULL};

/* First id among texts (in this order) present in the vocabulary, -1 if none. llama.cpp takes the first
 * match in its hash map's iteration order; the orders here give the same answers on the supported
 * vocabularies, which hold at most one candidate of a category, except SmolLM2/Qwen's EOT (checked by
 * test_tokenizer against llama_vocab_eot). */
static int32_t first_of(const cb_tokenizer_t *t, const char *const *texts) {
    for (int i = 0; texts[i]; i++) {
        int32_t id = cb_tokenizer_vocab_lookup_str(t, texts[i]);
        if (id >= 0) return id;
    }
    return -1;
}

static void add_control(cb_tokenizer_t *t, int32_t id) {
    if (id >= 0) t->tok_attr[id] |= A_CONTROL;
}

/* An optional id key, else the first text match; a match found by text is promoted to control, as
 * llama.cpp does ("control-looking token ... was not control-type"). */
static int32_t special_by_key_or_text(cb_tokenizer_t *t, const cb_gguf_t *g, const char *key,
                                      const char *const *texts) {
    int32_t id = key ? get_id(g, key, t->n_vocab) : -1;
    if (id >= 0) return id;
    id = first_of(t, texts);
    add_control(t, id);
    return id;
}

/* Attributes, special ids and the end-of-generation set, after llama.cpp's load(). */
void cb_tokenizer_find_specials(cb_tokenizer_t *t, const cb_gguf_t *g) {
    t->bos = get_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab);
    t->eos = get_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab);
    t->pad = get_id(g, "tokenizer.ggml.padding_token_id", t->n_vocab);
    if (t->kind == KIND_SPM) { /* llama.cpp's SPM defaults when the keys are absent: <s> 1, </s> 2 */
        if (t->bos < 0 && !cb_gguf_has(g, "tokenizer.ggml.bos_token_id") && t->n_vocab > 1) t->bos = 1;
        if (t->eos < 0 && !cb_gguf_has(g, "tokenizer.ggml.eos_token_id") && t->n_vocab > 2) t->eos = 2;
    }
    t->eot = special_by_key_or_text(t, g, "tokenizer.ggml.eot_token_id", EOT_TEXTS);
    t->eom = special_by_key_or_text(t, g, "tokenizer.ggml.eom_token_id", EOM_TEXTS);
    special_by_key_or_text(t, g, "tokenizer.ggml.fim_pre_token_id", FIM_PRE_TEXTS);
    special_by_key_or_text(t, g, "tokenizer.ggml.fim_suf_token_id", FIM_SUF_TEXTS);
    special_by_key_or_text(t, g, "tokenizer.ggml.fim_mid_token_id", FIM_MID_TEXTS);
    int32_t fim_pad = special_by_key_or_text(t, g, "tokenizer.ggml.fim_pad_token_id", FIM_PAD_TEXTS);
    int32_t fim_rep = special_by_key_or_text(t, g, "tokenizer.ggml.fim_rep_token_id", FIM_REP_TEXTS);
    int32_t fim_sep = special_by_key_or_text(t, g, "tokenizer.ggml.fim_sep_token_id", FIM_SEP_TEXTS);
    int32_t eog[] = {fim_pad, fim_rep, fim_sep, t->eos, t->eot, t->eom};
    for (size_t i = 0; i < sizeof eog / sizeof *eog; i++)
        if (eog[i] >= 0) t->tok_eog[eog[i]] = 1;
    for (int i = 0; EOG_TEXTS[i]; i++) {
        int32_t id = cb_tokenizer_vocab_lookup_str(t, EOG_TEXTS[i]);
        if (id < 0) continue;
        t->tok_eog[id] = 1;
        add_control(t, id);
    }
    /* Not mirrored (no supported vocabulary has them): gpt-oss's <|end|> and gemma4/plamo's </s> removals. */
}
