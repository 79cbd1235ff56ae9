/* qa: evaluation helpers for the MuSiQue QA set (data/musique_dev.jsonl, see data/README.md):
 * loading and validating the jsonl, answer extraction and SQuAD-style F1. The prompt (the anchors'
 * instruction, passages and question) is rag/ragprompt.h's, the one the services use.
 *
 * The answer handling follows the CacheBlend anchors (YaoJiayi/CacheBlend,
 * example/blend_musique.py and example/utils.py) exactly; docs/qa.md lists each one and where ours
 * differ (word-level F1 by default; the anchors count tokenizer ids, which cb_qa_f1_ids reproduces).
 *
 * Text is UTF-8. Lowercasing, word boundaries and white space are Unicode-aware (PCRE2 with UCP);
 * punctuation is Python's string.punctuation (ASCII). Strings returned as `char *` are malloc'd and
 * owned by the caller (free). Small allocations abort on out-of-memory. Thread-safe.
 */
#ifndef CB_QA_H
#define CB_QA_H

#include <stddef.h>
#include <stdint.h>

/* ---- the data set ------------------------------------------------------------------------- */

typedef struct {
    char *title;   /* may be empty (it is, throughout musique_dev) */
    char *text;
} cb_qa_ctx_t;

/* One example; every string NUL-terminated, valid UTF-8 (jansson checks), no embedded NUL. */
typedef struct {
    char *id;            /* non-empty */
    char *question;      /* non-empty */
    int n_answers;       /* >= 1 */
    char **answers;      /* [n_answers], each non-empty */
    int n_ctxs;          /* >= 1 */
    cb_qa_ctx_t *ctxs;   /* [n_ctxs] */
} cb_qa_example_t;

#define CB_QA_MAX_ANSWERS 1000
#define CB_QA_MAX_CTXS 1000

/* Parses one jsonl line (len bytes, need not be NUL-terminated) into a new example (caller owns,
 * cb_qa_example_destroy). Fields: id, question (non-empty strings), answers (1..1000 non-empty
 * strings), ctxs (1..1000 objects with string title and text); other fields are ignored; duplicate
 * keys are an error. Returns NULL with a message naming the field on any violation. */
cb_qa_example_t *cb_qa_example_parse(const char *line, size_t len, char *err, size_t errlen);
void cb_qa_example_destroy(cb_qa_example_t **ex_p);

typedef struct cb_qa_set cb_qa_set_t;
/* Loads every non-blank line of a jsonl file. NULL with "path:line: message" on the first bad line. */
cb_qa_set_t *cb_qa_set_load(const char *path, char *err, size_t errlen);
int cb_qa_set_size(const cb_qa_set_t *self);
const cb_qa_example_t *cb_qa_set_get(const cb_qa_set_t *self, int i); /* NULL if out of range */
void cb_qa_set_destroy(cb_qa_set_t **self_p);

/* ---- answers and scoring ------------------------------------------------------------------- */

/* The first line of a generation: leading '\n's dropped, then up to the next '\n'. */
char *cb_qa_first_line(const char *output);
/* The anchors' parse_generation: the first line, then "Yes" if it starts with "Yes"/"yes", else "No" if
 * its first word starts with "No"/"no" (sic: also "north", "November"...), else the line itself. */
char *cb_qa_parse_generation(const char *output);
/* SQuAD normalization: lowercase, remove ASCII punctuation, remove the words a/an/the, fold white space
 * to single spaces (trimmed). */
char *cb_qa_normalize(const char *s);
/* Word-level F1 of the normalized strings, in [0, 1]; when either has no words it is 1 if both have
 * none, else 0. NULL counts as "". */
double cb_qa_f1(const char *prediction, const char *truth);
/* Best cb_qa_f1 over truths[0..n); 0 when n <= 0. */
double cb_qa_f1_best(const char *prediction, const char *const *truths, int n);
/* The anchors' score of a raw generation: best over answers of cb_qa_f1(cb_qa_parse_generation(output), a). */
double cb_qa_score(const char *output, const char *const *answers, int n);
/* F1 over two token-id multisets (the anchors' exact metric: ids of the tokenized, normalized strings,
 * BOS dropped); same empty rule as cb_qa_f1. */
double cb_qa_f1_ids(const int32_t *pred, int n_pred, const int32_t *gold, int n_gold);
#endif
