/* tokenizer: the GGUF vocabularies llama.cpp tokenizes, token for token, for the model families we serve.
 *
 * Built once from a GGUF's tokenizer.ggml.* metadata; after that the
 * object is immutable and every function here may be called from any number of threads at once.
 *
 * Supported (anything else is refused at construction with a message naming the key and its value):
 *   tokenizer.ggml.model "gpt2" (byte-level BPE) with tokenizer.ggml.pre
 *     "smollm"     SmolLM/SmolLM2: every \p{N} split off, then the GPT-2 pattern
 *                  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *     "qwen2"      Qwen2/2.5: (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+
 *                  |\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *     "llama-bpe"  Llama 3 (also "llama3", "llama-v3"): as qwen2 but digits in runs of up to three,
 *                  \p{N}{1,3}, and a word that is itself a vocabulary token is emitted without merging
 *                  (llama.cpp's ignore_merges);
 *   tokenizer.ggml.model "llama" (SentencePiece-style: Mistral, Gemma 3, Llama 2): spaces become U+2581,
 *     a space is put before a fragment's text when tokenizer.ggml.add_space_prefix is true (llama.cpp's
 *     default for this model: true; Gemma 3's GGUFs say false), the whole fragment is merged by token
 *     score (highest first, leftmost on ties) and a character left without a token falls back to its
 *     <0xNN> byte tokens.
 *
 * Encoding, as llama.cpp's llama_tokenize(add_special = false) does it:
 *   1. special tokens are cut out of the raw bytes first (longest first, leftmost): control and unknown
 *      tokens only when parse_special is true, user-defined tokens always (llama.cpp's rule: Qwen's
 *      <tool_call>, Gemma's "\n", "  " and HTML tags are user-defined). Untrusted text must be encoded with
 *      parse_special = false so it can never produce a control token (<|im_start|>, <start_of_turn>, BOS,
 *      EOS, ...); where llama.cpp's SentencePiece merging would build a control token out of plain text
 *      this tokenizer does not (the one deliberate difference, see tokenizer.c);
 *   2. BPE: each remaining fragment is decoded as UTF-8 leniently, as llama.cpp does (a byte that does not
 *      start a well-formed sequence becomes U+FFFD, lossy there), split by the pre-tokenizer's pattern
 *      (PCRE2), mapped through GPT-2's byte-to-unicode table and merged by merge rank; a byte whose symbol
 *      is missing from the vocabulary is dropped, as llama.cpp drops it (SmolLM2: 0x04, 0x06, 0x13, ...);
 *      SentencePiece: the fragment's raw bytes are merged as above; invalid UTF-8 ends up as byte tokens.
 * "Fragment" matters for SentencePiece with a space prefix: every call of the encoder starts a fragment,
 * so encode("a") + encode("b") is "▁a▁b", not encode("ab"); prompts built from pieces (chat.h, RAG) are
 * defined as such concatenations.
 *
 * Decoding reverses the byte-level map (BPE) or U+2581 and <0xNN> (SentencePiece), so decode(encode(x)) ==
 * x for valid UTF-8 x encoded with parse_special = false, except: the BPE bytes the vocabulary lacks; and,
 * with a space prefix, the one space each fragment gained (cb_tokenizer_decode drops the first token's
 * leading space, as llama_detokenize does, so a single encode round-trips; user-defined tokens split a
 * text into several fragments).
 *
 * Ownership: the constructors copy everything they need; the cb_gguf_t may be destroyed afterwards.
 * Returned const pointers live as long as the tokenizer.
 */
#ifndef CB_TOKENIZER_H
#define CB_TOKENIZER_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "format/gguf.h"

typedef struct cb_tokenizer cb_tokenizer_t;

/* tokenizer.ggml.token_type values. */
typedef enum {
    CB_TOKEN_UNDEFINED = 0, CB_TOKEN_NORMAL = 1, CB_TOKEN_UNKNOWN = 2, CB_TOKEN_CONTROL = 3,
    CB_TOKEN_USER_DEFINED = 4, CB_TOKEN_UNUSED = 5, CB_TOKEN_BYTE = 6
} cb_token_type_t;

/* Errors of the int-returning encoders (other negative results mean "out too small", see below). */
#define CB_TOKENIZER_EINVAL   INT_MIN        /* NULL tokenizer/text, or text longer than INT_MAX/4 bytes */
#define CB_TOKENIZER_EINTERNAL (INT_MIN + 1) /* regex engine failure or out of memory */

/* Builds the tokenizer from tokenizer.ggml.{model,pre,tokens,token_type,merges,scores,add_space_prefix,
 * add_bos_token,*_token_id} and remembers the chat template recognised in tokenizer.chat_template
 * (chat.h). An absent or unrecognised template does NOT fail construction (a tool that only tokenizes
 * needs the vocabulary alone); the chat encoders then fail, and cb_tokenizer_chat_template_name() is NULL
 * with the reason in cb_tokenizer_chat_template_error(). Returns NULL (message in err) on an unsupported
 * model/pre-tokenizer or malformed metadata. */
cb_tokenizer_t *cb_tokenizer_new_from_gguf(const cb_gguf_t *g, char *err, size_t errlen);
/* Same; chat_template names the chat template to use instead of detecting it from the GGUF ("smollm2",
 * "chatml", "qwen2.5", "llama3", "mistral", "gemma", "completion"; chat.h), NULL or "" = detect. An
 * unknown name fails construction. */
cb_tokenizer_t *cb_tokenizer_new_from_gguf_opts(const cb_gguf_t *g, const char *chat_template, char *err,
                                                size_t errlen);
void cb_tokenizer_destroy(cb_tokenizer_t **self_p);

/* Encodes text[0..len) (any bytes; no NUL terminator needed) into out[max_out].
 * Never adds BOS/EOS. Returns:
 *   n >= 0                      success, n ids written;
 *   -needed (-INT_MAX..-1)      max_out was too small: nothing beyond out[max_out-1] was written and
 *                               -result is the count needed (out may be NULL with max_out == 0 to ask);
 *   CB_TOKENIZER_EINVAL / EINTERNAL on error. */
int cb_tokenizer_encode(const cb_tokenizer_t *self, const char *text, size_t len, bool parse_special,
                        int32_t *out, int max_out);
/* Same, into a new array the caller frees with free(); *n_out gets the count. NULL on error. */
int32_t *cb_tokenizer_encode_alloc(const cb_tokenizer_t *self, const char *text, size_t len,
                                   bool parse_special, int *n_out);

/* The bytes one token contributes to decoded text (not NUL-terminated; *len set). Control and unknown
 * tokens give their text only when special is true, otherwise len 0; unused tokens give len 0.
 * NULL for an id outside [0, n_vocab). */
const char *cb_tokenizer_token_bytes(const cb_tokenizer_t *self, int32_t id, bool special, size_t *len);

/* Decodes ids[n] into out (snprintf semantics): writes at most cap-1 bytes plus a NUL when cap > 0 and
 * returns the full decoded length (so a result >= cap means truncated). Returns -1 for an invalid id
 * or NULL arguments. The text may contain NUL bytes; use the returned length. With a SentencePiece space
 * prefix, the first token's leading space is dropped (llama_detokenize's rule). */
int64_t cb_tokenizer_decode(const cb_tokenizer_t *self, const int32_t *ids, size_t n, bool special,
                            char *out, size_t cap);
/* Same into a new NUL-terminated buffer the caller frees; *len (may be NULL) gets the length. */
char *cb_tokenizer_decode_alloc(const cb_tokenizer_t *self, const int32_t *ids, size_t n, bool special,
                                size_t *len);

int cb_tokenizer_n_vocab(const cb_tokenizer_t *self);
/* The vocabulary text of a token as stored in the GGUF (byte-level alphabet, e.g. "Ġthe", or
 * SentencePiece's, e.g. "▁the"). */
const char *cb_tokenizer_token_text(const cb_tokenizer_t *self, int32_t id, size_t *len);
/* The type stored in tokenizer.ggml.token_type (NORMAL when the GGUF has none). */
cb_token_type_t cb_tokenizer_token_type(const cb_tokenizer_t *self, int32_t id);
/* True when id is cut out of text as a whole token when parse_special is true: control, unknown and
 * user-defined tokens, and tokens llama.cpp promotes to control because of their text (<|im_end|>,
 * <end_of_turn>, FIM markers, ...). */
bool cb_tokenizer_is_special(const cb_tokenizer_t *self, int32_t id);
/* True when untrusted text (parse_special = false) can never produce id: the special tokens above minus
 * the user-defined ones. */
bool cb_tokenizer_is_control(const cb_tokenizer_t *self, int32_t id);
/* Id of the token whose vocabulary text is exactly text[0..len); -1 if none. */
int32_t cb_tokenizer_find(const cb_tokenizer_t *self, const char *text, size_t len);

/* Special ids from metadata (-1 when absent). eot: tokenizer.ggml.eot_token_id, else the first of
 * <|eot_id|>, <|endoftext|>, <|im_end|>, ... in the vocabulary: 0 for SmolLM2, as llama.cpp reports. */
int32_t cb_tokenizer_bos(const cb_tokenizer_t *self);
int32_t cb_tokenizer_eos(const cb_tokenizer_t *self);
int32_t cb_tokenizer_eot(const cb_tokenizer_t *self);
int32_t cb_tokenizer_pad(const cb_tokenizer_t *self);
/* Whether a prompt starts with BOS for this vocabulary: tokenizer.ggml.add_bos_token, else llama.cpp's
 * default (true for SentencePiece and llama-bpe, false for the other BPE pre-tokenizers). */
bool cb_tokenizer_add_bos(const cb_tokenizer_t *self);
/* End of generation, as llama_vocab_is_eog: eos, eot, eom, the FIM pad/repo/separator tokens and every
 * token whose text llama.cpp lists as EOG (<|im_end|>, <|endoftext|>, <|eot_id|>, <end_of_turn>, </s>,
 * ...), whatever its type. For SmolLM2-Instruct: ids 0, 2 and 4. */
bool cb_tokenizer_is_eog(const cb_tokenizer_t *self, int32_t id);
/* The end-of-generation ids in increasing order into out[max_out]; returns how many there are (may be
 * more than max_out: then only max_out were written). */
int cb_tokenizer_eog_ids(const cb_tokenizer_t *self, int32_t *out, int max_out);

/* "gpt2" or "llama" (tokenizer.ggml.model), and the pre-tokenizer: "smollm", "qwen2", "llama-bpe"
 * (for all its aliases), or "default" for SentencePiece. */
const char *cb_tokenizer_model_name(const cb_tokenizer_t *self);
const char *cb_tokenizer_pre_name(const cb_tokenizer_t *self);
/* SentencePiece: whether each fragment gets a leading space (false for BPE). */
bool cb_tokenizer_add_space_prefix(const cb_tokenizer_t *self);

/* The chat template this tokenizer renders (chat.h names), or NULL when none was recognised or named;
 * then cb_tokenizer_chat_template_error() says why (a one-line message, "" otherwise). */
const char *cb_tokenizer_chat_template_name(const cb_tokenizer_t *self);
const char *cb_tokenizer_chat_template_error(const cb_tokenizer_t *self);
/* The template as a cb_chat_kind_t (chat.h) value, 0 when none; for chat.c. */
int cb_tokenizer_chat_template(const cb_tokenizer_t *self);
#endif
