/* chat: the chat templates of the model families we serve, rendered in C and encoded safely.
 *
 * A tokenizer remembers its template (tokenizer.h): recognised from the GGUF's tokenizer.chat_template by
 * cb_chat_template_detect(), or named by the caller (cb_tokenizer_new_from_gguf_opts). Every encoder
 * below renders the tokenizer's template; with none it fails (CB_TOKENIZER_EINVAL) and cb_chat_check()
 * says why, so a service can refuse to start with a clear message. The templates (no Jinja engine: each
 * is hand-written after the family's published Jinja, checked against jinja2 renderings in
 * tests/fixtures/chat-*.jsonl):
 *
 *   "smollm2"   ChatML plus SmolLM2's default system line:
 *                 [<|im_start|>system\n{default}<|im_end|>\n when the first message is not a system one]
 *                 <|im_start|>{role}\n{content}<|im_end|>\n ...  generation prompt: <|im_start|>assistant\n
 *   "qwen2.5"   the same with Qwen2.5's default "You are Qwen, created by Alibaba Cloud. You are a helpful
 *               assistant." (Qwen2.5-Coder's GGUF has this line too)
 *   "chatml"    the same without a default system message
 *   "llama3"    <|begin_of_text|> (before the first message) then per message
 *               <|start_header_id|>{role}<|end_header_id|>\n\n{content, trimmed}<|eot_id|>;
 *               generation prompt <|start_header_id|>assistant<|end_header_id|>\n\n; no default system (the
 *               Llama 3.0 format; 3.1+'s "Cutting Knowledge Date" system header is not rendered, as in
 *               llama.cpp's built-in llama3 template)
 *   "mistral"   <s> then [INST] {user} [/INST] per user turn, {assistant}</s> per answer (Mistral-7B-Instruct
 *               v0.1/v0.2); a leading system message, which those templates reject, is put before the
 *               first user message as "{system}\n\n" (llama.cpp's mistral-v1 rule); no generation prompt
 *   "gemma"     <bos> then <start_of_turn>{user|model}\n{content, trimmed}<end_of_turn>\n per message
 *               ("assistant" is "model"); a leading system message becomes "{system}\n\n" at the start of
 *               the first turn (Gemma 3's template); generation prompt <start_of_turn>model\n
 *   "completion" no template, for base models (e.g. gemma3-270m): [BOS when the vocabulary adds one]
 *               then the messages' contents separated by "\n\n"; no generation prompt.
 * Recognition (cb_chat_template_detect), as llama.cpp's built-in heuristics but stricter: <|im_start|>
 * templates are ChatML, told apart by their default system line (SmolLM2's exact template, Qwen's line, or
 * none); <|start_header_id|> + <|end_header_id|> is llama3; [INST] is mistral; <start_of_turn> is gemma.
 * A template of those families that also does what these renderers do not is refused, naming what was
 * seen: thinking tags (<think>), a ChatML BOS (bos_token), Llama 3.1+'s "Cutting Knowledge Date" header,
 * function/tool formats (macro, function, <|python_tag|>), Mistral v3/v7 ([SYSTEM_PROMPT],
 * [AVAILABLE_TOOLS]), Llama 2's <<SYS>>, another default system line; so is anything else and a missing
 * template. Naming a template (cb_tokenizer_new_from_gguf_opts) overrides recognition: e.g. "llama3"
 * renders Llama 3.1+ in the 3.0 format, as llama.cpp's built-in llama3 template does.
 *
 * Encoding (the RAG prompt is a concatenation of token arrays, rag/ragprompt.h): the template's markers
 * (<|im_start|>, <|eot_id|>, <start_of_turn>, ...) are emitted as token ids when the vocabulary has them
 * as special tokens (else as text, e.g. Mistral v0.1's [INST]); BOS/EOS as the vocabulary's ids;
 * everything else, roles and contents, is tokenized with special-token parsing OFF, so user or document
 * text can never forge a control token. The text between two markers is tokenized as one piece, which
 * gives exactly llama.cpp's ids for the rendered text (tokenized with special parsing on) whenever the
 * contents hold no special-token text.
 *
 * All int-returning encoders follow cb_tokenizer_encode: n >= 0 ids written; -needed if max_out is too
 * small (out may be NULL with max_out 0); CB_TOKENIZER_EINVAL (NULL arguments, no usable template: see
 * cb_chat_check) or CB_TOKENIZER_EINTERNAL on error. Nothing is written past out[max_out-1].
 */
#ifndef CB_CHAT_H
#define CB_CHAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/tokenizer.h"

#define CB_CHAT_DEFAULT_SYSTEM "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
#define CB_CHAT_QWEN_DEFAULT_SYSTEM "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

typedef enum {
    CB_CHAT_NONE = 0,
    CB_CHAT_SMOLLM2,
    CB_CHAT_CHATML,
    CB_CHAT_QWEN25,
    CB_CHAT_LLAMA3,
    CB_CHAT_MISTRAL,
    CB_CHAT_GEMMA,
    CB_CHAT_COMPLETION
} cb_chat_kind_t;

/* One message; both strings borrowed, NUL-terminated. role is normally system|user|assistant. */
typedef struct {
    const char *role;
    const char *content;
} cb_chat_msg_t;

/* "smollm2", "chatml", "qwen2.5", "llama3", "mistral", "gemma", "completion"; NULL for CB_CHAT_NONE or an
 * out-of-range value. */
const char *cb_chat_kind_name(cb_chat_kind_t kind);
/* The kind of a name above (exact, case-sensitive); CB_CHAT_NONE for NULL or an unknown name. */
cb_chat_kind_t cb_chat_kind_from_name(const char *name);
/* All names, comma-separated, for messages. */
const char *cb_chat_kind_names(void);
/* The default system message the template inserts when the first message is not a system one (NULL
 * when it has none). */
const char *cb_chat_default_system(cb_chat_kind_t kind);
/* Recognises a GGUF's Jinja chat template tmpl[0..len) (see above); CB_CHAT_NONE with a one-line reason in
 * err when it is not one of ours. */
cb_chat_kind_t cb_chat_template_detect(const char *tmpl, size_t len, char *err, size_t errlen);
/* True when tok has a template the encoders can render: one was recognised or named, and the vocabulary
 * holds the special tokens it needs (ChatML: <|im_start|>, <|im_end|>; llama3: <|start_header_id|>,
 * <|end_header_id|>, <|eot_id|>; gemma: <start_of_turn>, <end_of_turn>) and BOS/EOS where it starts or
 * ends turns with them. Otherwise false with a one-line message in err naming the template and the gap. */
bool cb_chat_check(const cb_tokenizer_t *tok, char *err, size_t errlen);

/* SmolLM2's rendered prompt text (caller frees with free()); NULL on NULL role/content or out of memory.
 * Kept for the callers of the SmolLM2-only API; cb_chat_render_tok renders any tokenizer's template. */
char *cb_chat_render(const cb_chat_msg_t *msgs, size_t n, bool add_generation_prompt);
/* tok's template rendered as text, BOS/EOS as their vocabulary text (e.g. "<bos>"); caller frees.
 * NULL when tok has no usable template, on NULL role/content or out of memory. */
char *cb_chat_render_tok(const cb_tokenizer_t *tok, const cb_chat_msg_t *msgs, size_t n, bool add_generation_prompt);

/* Token ids of the rendered conversation, markers as ids and text with special parsing off. */
int cb_chat_encode(const cb_tokenizer_t *tok, const cb_chat_msg_t *msgs, size_t n, bool add_generation_prompt,
                   int32_t *out, int max_out);

/* A single user turn ready for generation: [system], user, generation prompt. system NULL = the template's
 * default system message (none for chatml, llama3, mistral, gemma, completion). Same ids as cb_chat_encode
 * on {system, user} (or {user} when there is no system message). */
int cb_chat_encode_user_turn(const cb_tokenizer_t *tok, const char *system, const char *user,
                             int32_t *out, int max_out);

/* Pieces for assembling a RAG prompt as prefix + chunk ids ... + question ids + suffix, split where the
 * user turn's content starts and ends (system NULL = the template's default, if any):
 *   smollm2/qwen2.5/chatml  prefix [<|im_start|>system\n{system}<|im_end|>\n]<|im_start|>user\n
 *                           suffix <|im_end|>\n<|im_start|>assistant\n
 *   llama3      prefix <|begin_of_text|>[<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>]
 *                      <|start_header_id|>user<|end_header_id|>\n\n
 *               suffix <|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n
 *   mistral     prefix <s>[INST] [{system}\n\n]     suffix " [/INST]"
 *               (with a SentencePiece space prefix the space after [INST] and before [/INST] comes from
 *               the next piece's own leading U+2581, so it is not repeated)
 *   gemma       prefix <bos><start_of_turn>user\n[{system}\n\n]
 *               suffix <end_of_turn>\n<start_of_turn>model\n
 *   completion  prefix [BOS][{system}\n\n]          suffix empty (0 ids)
 * The caller tokenizes each chunk/question with cb_tokenizer_encode(..., parse_special = false).
 * This equals cb_chat_encode_user_turn of the concatenated text except where a piece starts with two or
 * more whitespace characters (BPE would group them across the boundary), where llama3/gemma would trim
 * the content's ends, and, for SentencePiece vocabularies with a space prefix (Mistral), by the U+2581
 * each separately tokenized piece starts with. */
int cb_chat_encode_prefix(const cb_tokenizer_t *tok, const char *system, int32_t *out, int max_out);
int cb_chat_encode_suffix(const cb_tokenizer_t *tok, int32_t *out, int max_out);

/* True when tmpl[0..len) is exactly SmolLM2-Instruct's Jinja template. */
bool cb_chat_template_is_smollm2(const char *tmpl, size_t len);
#endif
