/* tokenizer: GPT-2 byte-level BPE as llama.cpp runs it for the SmolLM2 GGUF (pre-tokenizer "smollm").
 *
 * Built once from a GGUF's tokenizer.ggml.* metadata (REFERENCE.md §5, §9, §10); after that the object
 * is immutable and every function here may be called from any number of threads at once.
 *
 * Encoding, as llama.cpp's llama_tokenize(add_special = false) does it:
 *   1. special tokens are cut out of the raw bytes first: control and unknown tokens only when
 *      parse_special is true, user-defined tokens always (llama.cpp's rule; this vocabulary has none).
 *      Untrusted text must be encoded with parse_special = false so it can never produce <|im_start|>;
 *   2. each remaining piece is decoded as UTF-8 leniently, as llama.cpp does: every byte that does not
 *      start a well-formed sequence becomes U+FFFD, so invalid input never fails (it is lossy there);
 *   3. pre-tokenization with PCRE2: every \p{N} code point is split off, then the GPT-2 pattern
 *      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ runs on each piece;
 *   4. each word's bytes go through GPT-2's byte-to-unicode table and are merged by merge rank.
 * Bytes whose byte-level symbol is missing from the vocabulary (here 0x04, 0x06, 0x13, 0x14, 0x16, 0x1D,
 * 0xC0, 0xC1, 0xF1, 0xF2, 0xF5..0xFF) are dropped when no merge covers them, exactly as llama.cpp drops them.
 *
 * Decoding reverses the byte-level map, so decode(encode(x)) == x for valid UTF-8 x that avoids those
 * bytes and contains no special-token text (or was encoded with parse_special = false).
 *
 * Ownership: cb_tokenizer_new_from_gguf copies everything it needs; the cb_gguf_t may be destroyed
 * afterwards. Returned const pointers live as long as the tokenizer.
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

/* Builds the tokenizer from tokenizer.ggml.{model,pre,tokens,token_type,merges,*_token_id}.
 * Requires model "gpt2" and pre "smollm"; anything else is refused with a message in err.
 * Returns NULL on failure. */
cb_tokenizer_t *cb_tokenizer_new_from_gguf(const cb_gguf_t *g, char *err, size_t errlen);
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
 * or NULL arguments. The text may contain NUL bytes; use the returned length. */
int64_t cb_tokenizer_decode(const cb_tokenizer_t *self, const int32_t *ids, size_t n, bool special,
                            char *out, size_t cap);
/* Same into a new NUL-terminated buffer the caller frees; *len (may be NULL) gets the length. */
char *cb_tokenizer_decode_alloc(const cb_tokenizer_t *self, const int32_t *ids, size_t n, bool special,
                                size_t *len);

int cb_tokenizer_n_vocab(const cb_tokenizer_t *self);
/* The vocabulary text of a token as stored in the GGUF (byte-level alphabet, e.g. "Ġthe"). */
const char *cb_tokenizer_token_text(const cb_tokenizer_t *self, int32_t id, size_t *len);
cb_token_type_t cb_tokenizer_token_type(const cb_tokenizer_t *self, int32_t id);
/* Id of the token whose vocabulary text is exactly text[0..len); -1 if none. */
int32_t cb_tokenizer_find(const cb_tokenizer_t *self, const char *text, size_t len);

/* Special ids from metadata (-1 when absent). eot: tokenizer.ggml.eot_token_id, else the first of
 * <|eot_id|>, <|endoftext|>, <|im_end|>, ... in the vocabulary: 0 for SmolLM2, as llama.cpp reports. */
int32_t cb_tokenizer_bos(const cb_tokenizer_t *self);
int32_t cb_tokenizer_eos(const cb_tokenizer_t *self);
int32_t cb_tokenizer_eot(const cb_tokenizer_t *self);
int32_t cb_tokenizer_pad(const cb_tokenizer_t *self);
/* tokenizer.ggml.add_bos_token (false when absent, as llama.cpp defaults for BPE). */
bool cb_tokenizer_add_bos(const cb_tokenizer_t *self);
/* End of generation, as llama_vocab_is_eog: eos, eot, and control tokens whose text llama.cpp lists as
 * EOG (<|im_end|>, <|endoftext|>, FIM repo/pad/separator, ...). For SmolLM2-Instruct: ids 0, 2 and 4. */
bool cb_tokenizer_is_eog(const cb_tokenizer_t *self, int32_t id);
#endif
