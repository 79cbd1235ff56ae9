/* ragprompt.c: the RAG prompt's pieces as token arrays (see ragprompt.h). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "rag/ragprompt.h"
#include "base/alloc.h"

#include <pcre2.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "base/log.h"
#include "rag/regex.h"
#include "model/chat.h"

#define SEP "\n\n"

/* The anchors' strings (example/blend_musique.py: prefix_prompt, query_prompt), byte for byte,
 * including the doubled period of the instruction. */
static const char INSTRUCTION[] =
    "You will be asked a question after reading several passages. Please directly answer the question based "
    "on the given passages. Do NOT repeat the question. The answer should be within 5 words..\nPassages:\n";
static const char QUERY[] =
    "\n\nAnswer the question directly based on the given passages. Do NOT repeat the question. The answer "
    "should be within 5 words. \nQuestion:";
static const char ANSWER[] = "\nAnswer:";

static pcre2_code *g_re_first; /* the first character (UTF-8, Unicode case rules) */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void init_once(void) { g_re_first = cb_regex_compile("^(?s)."); }

struct cb_ragprompt {
    const cb_tokenizer_t *tok;
    int32_t *prefix;   /* [n_prefix] P */
    int n_prefix;
    int32_t *tail;     /* [n_tail] the chat template's close: <|im_end|>\n<|im_start|>assistant\n */
    int n_tail;
};

/* Encodes with an int-returning encoder protocol: ask the size, then fill. */
static int32_t *encode_text(const cb_tokenizer_t *tok, const char *s, size_t len, int *n) {
    int32_t *ids = cb_tokenizer_encode_alloc(tok, s, len, false, n);
    return ids;
}

cb_ragprompt_t *cb_ragprompt_new(const cb_tokenizer_t *tok, const char *system, char *err, size_t errlen) {
    if (!tok) {
        cb_set_err(err, errlen, "ragprompt: no tokenizer");
        return NULL;
    }
    if (system && !*system) system = NULL;
    cb_ragprompt_t *r = cb_calloc(1, sizeof *r);
    if (!r) goto oom;
    r->tok = tok;
    char why[256];
    if (!cb_chat_check(tok, why, sizeof why)) {
        cb_set_err(err, errlen, "ragprompt: %s", why);
        cb_ragprompt_destroy(&r);
        return NULL;
    }
    int nc = cb_chat_encode_prefix(tok, system, NULL, 0);
    if (nc == CB_TOKENIZER_EINVAL || nc == CB_TOKENIZER_EINTERNAL) {
        cb_set_err(err, errlen, "ragprompt: cannot encode the chat prefix");
        cb_ragprompt_destroy(&r);
        return NULL;
    }
    nc = nc < 0 ? -nc : 0;
    const char *qp = INSTRUCTION;
    int nq = 0;
    int32_t *q = encode_text(tok, qp, strlen(qp), &nq);
    if (!q) goto oom;
    r->prefix = cb_malloc(((size_t)nc + (size_t)nq + 1) * sizeof(int32_t));
    if (!r->prefix) {
        free(q);
        goto oom;
    }
    if (cb_chat_encode_prefix(tok, system, r->prefix, nc) != nc) {
        free(q);
        cb_set_err(err, errlen, "ragprompt: cannot encode the chat prefix");
        cb_ragprompt_destroy(&r);
        return NULL;
    }
    memcpy(r->prefix + nc, q, (size_t)nq * sizeof(int32_t));
    free(q);
    r->n_prefix = nc + nq;
    int nt = cb_chat_encode_suffix(tok, NULL, 0);
    if (nt == CB_TOKENIZER_EINVAL || nt == CB_TOKENIZER_EINTERNAL) {
        cb_set_err(err, errlen, "ragprompt: cannot encode the chat suffix");
        cb_ragprompt_destroy(&r);
        return NULL;
    }
    nt = nt < 0 ? -nt : 0; /* 0: a template without a suffix ("completion") */
    r->tail = cb_malloc(((size_t)nt + 1) * sizeof(int32_t));
    if (!r->tail) goto oom;
    if (cb_chat_encode_suffix(tok, r->tail, nt) != nt) {
        cb_set_err(err, errlen, "ragprompt: cannot encode the chat suffix");
        cb_ragprompt_destroy(&r);
        return NULL;
    }
    r->n_tail = nt;
    return r;
oom:
    cb_set_err(err, errlen, "ragprompt: out of memory");
    cb_ragprompt_destroy(&r);
    return NULL;
}

void cb_ragprompt_destroy(cb_ragprompt_t **self_p) {
    if (!self_p || !*self_p) return;
    free((*self_p)->prefix);
    free((*self_p)->tail);
    free(*self_p);
    *self_p = NULL;
}

const int32_t *cb_ragprompt_prefix(const cb_ragprompt_t *self, int *n) {
    *n = self->n_prefix;
    return self->prefix;
}

const char *cb_ragprompt_separator(void) { return SEP; }

int32_t *cb_ragprompt_chunk(const cb_ragprompt_t *self, const char *text, size_t len, int *n) {
    *n = 0;
    if (!text && len) return NULL;
    char *buf = cb_malloc(len + sizeof SEP);
    if (!buf) return NULL;
    if (len) memcpy(buf, text, len);
    memcpy(buf + len, SEP, sizeof SEP);
    int32_t *ids = encode_text(self->tok, buf, len + sizeof SEP - 1, n);
    free(buf);
    return ids;
}

int32_t *cb_ragprompt_suffix(const cb_ragprompt_t *self, const char *question, int *n) {
    *n = 0;
    if (!question) return NULL;
    char *s = cb_ragprompt_question(question);
    if (!s) return NULL;
    int nq = 0;
    int32_t *q = encode_text(self->tok, s, strlen(s), &nq);
    free(s);
    if (!q) return NULL;
    int32_t *out = cb_realloc(q, ((size_t)nq + (size_t)self->n_tail) * sizeof(int32_t));
    if (!out) {
        free(q);
        return NULL;
    }
    memcpy(out + nq, self->tail, (size_t)self->n_tail * sizeof(int32_t));
    *n = nq + self->n_tail;
    return out;
}

char *cb_ragprompt_passage(const char *title, const char *text) {
    if (!title) title = "";
    if (!text) text = "";
    size_t a = strlen(title), b = strlen(text);
    char *s = cb_malloc(a + b + 3);
    if (!s) return NULL;
    memcpy(s, title, a);
    memcpy(s + a, SEP, 2);
    memcpy(s + a + 2, text, b + 1);
    return s;
}

const char *cb_ragprompt_instruction(void) { return INSTRUCTION; }

char *cb_ragprompt_chunk_text(const char *title, const char *text) {
    char *p = cb_ragprompt_passage(title, text);
    if (!p) return NULL;
    size_t n = strlen(p);
    char *s = cb_realloc(p, n + sizeof SEP);
    if (!s) {
        free(p);
        return NULL;
    }
    memcpy(s + n, SEP, sizeof SEP);
    return s;
}

char *cb_ragprompt_normalize_question(const char *question) {
    pthread_once(&g_once, init_once);
    if (!question) question = "";
    size_t n = strlen(question);
    int add_q = n == 0 || question[n - 1] != '?';
    /* the first character lowercased (\L in a PCRE2 substitution: Unicode-aware, as Python's str.lower) */
    char *out = cb_regex_subst(g_re_first, question, n, "\\L$0", 0, 1, 1);
    if (!out) return NULL;
    if (add_q) strcat(out, "?"); /* the one spare byte */
    return out;
}

char *cb_ragprompt_question(const char *question) {
    char *q = cb_ragprompt_normalize_question(question);
    if (!q) return NULL;
    size_t a = strlen(QUERY), b = strlen(q);
    char *s = cb_malloc(a + b + sizeof ANSWER);
    if (s) {
        memcpy(s, QUERY, a);
        memcpy(s + a, q, b);
        memcpy(s + a + b, ANSWER, sizeof ANSWER);
    }
    free(q);
    return s;
}
