/* chat: SmolLM2-Instruct's ChatML template (REFERENCE.md §11), rendered in C and encoded safely.
 *
 * The GGUF's tokenizer.chat_template (Jinja) is ChatML plus a default system prompt:
 *   - if the first message's role is not "system":
 *       <|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n
 *   - every message:       <|im_start|>{role}\n{content}<|im_end|>\n
 *   - generation prompt:   <|im_start|>assistant\n
 *   (no messages at all: no system line either, as the Jinja loop never runs).
 * cb_chat_template_is_smollm2() checks a GGUF's template against exactly that text.
 *
 * Encoding (the RAG prompt is a concatenation of token arrays, REFERENCE.md §10): the <|im_start|> and
 * <|im_end|> markers are emitted as token ids; everything else, role and content, is tokenized with
 * special-token parsing OFF, so user or document text can never forge a control token. For each
 * message, "{role}\n{content}" is tokenized as one piece, which gives exactly llama.cpp's ids for the
 * rendered text whenever the content holds no special-token text.
 *
 * All int-returning encoders follow cb_tokenizer_encode: n >= 0 ids written; -needed if max_out is too
 * small (out may be NULL with max_out 0); CB_TOKENIZER_EINVAL (NULL arguments, or a vocabulary without
 * <|im_start|>/<|im_end|>) or CB_TOKENIZER_EINTERNAL on error. Nothing is written past out[max_out-1].
 */
#ifndef CB_CHAT_H
#define CB_CHAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/tokenizer.h"

#define CB_CHAT_DEFAULT_SYSTEM "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

/* One message; both strings borrowed, NUL-terminated. role is normally system|user|assistant. */
typedef struct {
    const char *role;
    const char *content;
} cb_chat_msg_t;

/* The rendered prompt text (caller frees with free()); NULL on NULL role/content or out of memory. */
char *cb_chat_render(const cb_chat_msg_t *msgs, size_t n, bool add_generation_prompt);

/* Token ids of cb_chat_render's text, markers as ids and text with special parsing off. */
int cb_chat_encode(const cb_tokenizer_t *tok, const cb_chat_msg_t *msgs, size_t n, bool add_generation_prompt,
                   int32_t *out, int max_out);

/* A single user turn ready for generation: [system (NULL = the default line)], user, assistant prompt.
 * Same ids as cb_chat_encode on {system, user} (or {user} when system is NULL). */
int cb_chat_encode_user_turn(const cb_tokenizer_t *tok, const char *system, const char *user,
                             int32_t *out, int max_out);

/* Pieces for assembling a RAG prompt as prefix + chunk ids ... + question ids + suffix:
 *   prefix = <|im_start|>system\n{system or default}<|im_end|>\n<|im_start|>user\n
 *   suffix = <|im_end|>\n<|im_start|>assistant\n
 * The caller tokenizes each chunk/question with cb_tokenizer_encode(..., parse_special = false).
 * (This equals cb_chat_encode_user_turn of the concatenated text except where a piece starts with two or
 * more whitespace characters, which BPE would group across the boundary.) */
int cb_chat_encode_prefix(const cb_tokenizer_t *tok, const char *system, int32_t *out, int max_out);
int cb_chat_encode_suffix(const cb_tokenizer_t *tok, int32_t *out, int max_out);

/* True when tmpl[0..len) is exactly SmolLM2-Instruct's Jinja template, the one rendered here. */
bool cb_chat_template_is_smollm2(const char *tmpl, size_t len);
#endif
