/* fuzz_qa: libFuzzer target for the MuSiQue line parser and the answer normalization / F1.
 * The input is parsed as one jsonl line; it is also split at its first NUL-free half into a
 * "generation" and an "answer" that are scored. Nothing may crash, leak or read out of bounds. */
#include "rag/qa.h"
#include "rag/ragprompt.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[256];
    cb_qa_example_t *ex = cb_qa_example_parse((const char *)data, size, err, sizeof err);
    if (ex) {
        char *suffix = cb_ragprompt_question(ex->question);
        for (int i = 0; i < ex->n_ctxs; i++) free(cb_ragprompt_chunk_text(ex->ctxs[i].title, ex->ctxs[i].text));
        (void)cb_qa_score(ex->question, (const char *const *)ex->answers, ex->n_answers);
        free(suffix);
        cb_qa_example_destroy(&ex);
    }
    char *s = malloc(size + 1);
    if (!s) return 0;
    memcpy(s, data, size);
    s[size] = '\0';
    size_t half = strlen(s) / 2;
    char *truth = strdup(s + half);
    s[half] = '\0';
    const char *answers[1] = {truth};
    (void)cb_qa_score(s, answers, 1);
    free(cb_ragprompt_normalize_question(s));
    free(truth);
    free(s);
    return 0;
}
