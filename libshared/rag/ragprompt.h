/* ragprompt: the one place that builds the RAG prompt, its strings and its token arrays (the MuSiQue-style
 * prompt of the CacheBlend anchors, YaoJiayi/CacheBlend example/blend_musique.py, byte for byte, in the
 * tokenizer's chat template, chat.h; docs/qa.md). cb-precompute, cb-blend, cb-rag and the
 * evaluation all use it, so that a chunk precomputed at ingest has exactly the tokens (hence the key) that
 * a query uses.
 *
 * The prompt is the concatenation of independently tokenized pieces:
 *   prefix P = cb_chat_encode_prefix(system)            e.g. ChatML "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
 *            + encode(cb_ragprompt_instruction())        "You will be asked a question ... \nPassages:\n"
 *   chunk  C = encode(text + "\n\n")                     one per passage / context / chunk text
 *   suffix S = encode(cb_ragprompt_question(question))   "\n\nAnswer the question directly ... \nQuestion:{q}\nAnswer:"
 *            + cb_chat_encode_suffix()                   e.g. ChatML "<|im_end|>\n<|im_start|>assistant\n" (empty for
 *                                                        the "completion" template, whose prompt ends at "Answer:")
 * All text is encoded with special-token parsing OFF (documents and questions cannot forge control tokens).
 * P is the precompute context: a chunk's KV is computed after P (blend.h). For a MuSiQue passage the chunk
 * text is cb_ragprompt_passage(title, text) = "{title}\n\n{text}", so C = encode(cb_ragprompt_chunk_text(title,
 * text)) exactly as the anchors build it.
 *
 * Ownership: the tokenizer is borrowed and must outlive the object. The object is immutable after
 * cb_ragprompt_new: any number of threads may use it at once. Arrays returned as `int32_t *` are malloc'd
 * and owned by the caller (free()).
 */
#ifndef CB_RAGPROMPT_H
#define CB_RAGPROMPT_H

#include <stddef.h>
#include <stdint.h>

#include "model/tokenizer.h"

typedef struct cb_ragprompt cb_ragprompt_t;

/* The prompt pieces for tok and a system prompt (NULL or "" = the chat template's default line).
 * NULL + err on failure (the tokenizer has no usable chat template: err says why, see cb_chat_check; out
 * of memory). Caller owns (cb_ragprompt_destroy). */
cb_ragprompt_t *cb_ragprompt_new(const cb_tokenizer_t *tok, const char *system, char *err, size_t errlen);
void cb_ragprompt_destroy(cb_ragprompt_t **self_p);

/* P: [*n] token ids, owned by the object. */
const int32_t *cb_ragprompt_prefix(const cb_ragprompt_t *self, int *n);
/* The tokens of one chunk / context text[0..len) as it appears in the prompt (text + "\n\n"); new array of
 * *n ids (caller frees), NULL on a tokenizer failure or out of memory. An empty text gives the separator. */
int32_t *cb_ragprompt_chunk(const cb_ragprompt_t *self, const char *text, size_t len, int *n);
/* S for a question (NUL-terminated); new array (caller frees) or NULL. */
int32_t *cb_ragprompt_suffix(const cb_ragprompt_t *self, const char *question, int *n);
/* "{title}\n\n{text}": the chunk text of a titled passage (MuSiQue ctxs); new string (caller frees). */
char *cb_ragprompt_passage(const char *title, const char *text);
/* The separator appended to every chunk text ("\n\n"). */
const char *cb_ragprompt_separator(void);

/* ---- the prompt's strings (the anchors'; the token arrays above encode them) ---------------------- */
/* Each returns a new string (caller frees), or NULL when out of memory. */

/* The instruction that ends P, ending in "\nPassages:\n" (static string). */
const char *cb_ragprompt_instruction(void);
/* One passage chunk's text as it appears in the prompt: "{title}\n\n{text}\n\n". */
char *cb_ragprompt_chunk_text(const char *title, const char *text);
/* The question's text in S: "\n\nAnswer the question directly ... within 5 words. \nQuestion:" then the
 * question with its first character lowercased and "?" appended when missing, then "\nAnswer:". */
char *cb_ragprompt_question(const char *question);
/* The question as the anchors normalize it (first character lowercased, "?" appended if missing). */
char *cb_ragprompt_normalize_question(const char *question);
#endif
