/* ragprompt.c: the RAG prompt's pieces as token arrays (see ragprompt.h). */
#include "rag/ragprompt.h"
#include "base/alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "model/chat.h"
#include "rag/qa.h"

#define SEP "\n\n"

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
    const char *qp = cb_qa_prefix();
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
    char *s = cb_qa_suffix(question);
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
