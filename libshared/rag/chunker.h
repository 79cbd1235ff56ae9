/* chunker: splits a document's text into chunk texts under a token budget, at good boundaries.
 *
 * A chunk is a TEXT, not a slice of the document's token array: the caller tokenizes each chunk text on
 * its own (ragprompt.h cb_ragprompt_chunk), so that the same text gives the same tokens, hence the same
 * content-addressed KV key, in whatever document and at whatever position it appears (ragprompt.h:
 * each piece is tokenized apart). The tokenizer is used here only to measure.
 *
 * Boundaries, in order of preference:
 *   1. paragraph ends (a blank line: two or more '\n' in a run of white space), when the chunk is then at
 *      least half the budget;
 *   2. sentence ends ('.', '!', '?', '。', '！', '？', optionally followed by closing quotes or brackets,
 *      then white space) and single line breaks;
 *   3. inside a sentence longer than the budget: the last white space before the budget, else the last
 *      UTF-8 character boundary before it.
 * Chunks are packed greedily (as many whole units as fit). A document whose whole text fits in the budget
 * is one chunk. White space at every split point and at the end of the document is dropped (the prompt
 * adds its own separator after each passage); the document's leading white space stays in the first chunk
 * (so a MuSiQue passage "{title}\n\n{text}" with an empty title is kept byte for byte). Chunks that would
 * be empty or white space only are not produced: a blank document has zero chunks.
 *
 * Each chunk text, encoded alone (special parsing off), has at most `budget` tokens, except in the
 * pathological case where BPE merges across a unit boundary produce more tokens than the units had
 * separately (never seen in practice; the chunker re-measures every chunk and sheds units to avoid it).
 *
 * Ownership: the tokenizer is borrowed and must outlive the chunker. A chunker keeps scratch buffers;
 * use one per thread.
 */
#ifndef CB_CHUNKER_H
#define CB_CHUNKER_H

#include <stddef.h>
#include <stdint.h>

#include "model/tokenizer.h"

#define CB_CHUNKER_MIN_BUDGET 8
#define CB_CHUNKER_MAX_BUDGET (1 << 20)

typedef struct cb_chunker cb_chunker_t;

/* One chunk: the bytes text[off, off + len) of the document, and the token count of that text encoded
 * alone (special parsing off). */
typedef struct {
    size_t off;
    size_t len;
    int n_tokens;
} cb_chunk_span_t;

/* A chunker measuring with tok, budget tokens per chunk (CB_CHUNKER_MIN_BUDGET..CB_CHUNKER_MAX_BUDGET).
 * NULL + err on a bad argument or out of memory. Caller owns (cb_chunker_destroy). */
cb_chunker_t *cb_chunker_new(const cb_tokenizer_t *tok, int budget, char *err, size_t errlen);
void cb_chunker_destroy(cb_chunker_t **self_p);
int cb_chunker_budget(const cb_chunker_t *self);

/* Splits text[0..len) (any bytes; need not be NUL-terminated). *spans gets a new array of *n spans in
 * document order (caller frees with free(); NULL when *n is 0). Returns 0, or -1 with err (tokenizer
 * failure, out of memory, len > INT_MAX/4). */
int cb_chunker_split(cb_chunker_t *self, const char *text, size_t len, cb_chunk_span_t **spans, int *n,
                     char *err, size_t errlen);
#endif
