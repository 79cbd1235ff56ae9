/* qa.c: MuSiQue loading (jansson), answer extraction and F1 (see qa.h).
 *
 * Normalization mirrors the anchors' normalize_answer (SQuAD): lower -> remove punctuation -> remove
 * articles -> fold white space. Lowercasing (\L in a PCRE2 substitution), the \b of the article regex
 * and the white-space split use PCRE2 in UTF + UCP mode, close to Python 3's str/re semantics; bytes
 * that are not valid UTF-8 become U+FFFD first (Python's errors="replace").
 *
 * Owns: three compiled patterns, created once per process and never freed.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "rag/qa.h"
#include "base/alloc.h"
#include "base/err.h"
#include "base/log.h"
#include "base/utf8.h"
#include "rag/regex.h"

#include <jansson.h>
#include <pcre2.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QA_MAX_FILE ((size_t)1 << 30)

static const char QA_PUNCT[] = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"; /* Python string.punctuation */

static pcre2_code *g_re_all;      /* the whole string */
static pcre2_code *g_re_articles; /* \b(a|an|the)\b */
static pcre2_code *g_re_word;     /* \S+ */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

/* ---------------------------------------------------------------- small helpers */

static void *xmalloc(size_t n) {
    void *p = cb_malloc(n ? n : 1);
    if (!p) {
        CB_ERROR("qa: out of memory (%zu bytes)", n);
        abort();
    }
    return p;
}

static void *xrealloc(void *p, size_t n) {
    void *q = cb_realloc(p, n ? n : 1);
    if (!q) {
        CB_ERROR("qa: out of memory (%zu bytes)", n);
        abort();
    }
    return q;
}

static char *xstrndup(const char *s, size_t n) {
    char *d = xmalloc(n + 1);
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

static void init_once(void) {
    g_re_all = cb_regex_compile("(?s).+");
    g_re_articles = cb_regex_compile("\\b(a|an|the)\\b");
    g_re_word = cb_regex_compile("\\S+");
}

/* Scoring (the evaluation's, never a service's) stops the program when out of memory. */
static char *xsubst(const pcre2_code *re, const char *s, size_t len, const char *repl, int global, int extended) {
    char *out = cb_regex_subst(re, s, len, repl, global, extended, 0);
    if (!out) {
        CB_ERROR("qa: out of memory (%zu bytes)", len);
        abort();
    }
    return out;
}

/* Appends the spans of the white-space separated words of s[0..len) to *spans (pairs start, end). */
static int words(const char *s, size_t len, size_t **spans) {
    pthread_once(&g_once, init_once);
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(g_re_word, NULL);
    if (!md) {
        CB_ERROR("qa: out of memory");
        abort();
    }
    int n = 0, cap = 0;
    size_t off = 0;
    *spans = NULL;
    while (off < len && pcre2_match(g_re_word, (PCRE2_SPTR)s, len, off, 0, md, NULL) > 0) {
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            *spans = xrealloc(*spans, sizeof(size_t) * 2 * (size_t)cap);
        }
        (*spans)[2 * n] = ov[0];
        (*spans)[2 * n + 1] = ov[1];
        n++;
        off = ov[1] > off ? ov[1] : off + 1;
    }
    pcre2_match_data_free(md);
    return n;
}

/* ---------------------------------------------------------------- normalization and F1 */

char *cb_qa_normalize(const char *s) {
    pthread_once(&g_once, init_once);
    if (!s) s = "";
    char *clean = cb_utf8_repair(s); /* Python's errors="replace": a character cut in two is not a space */
    if (!clean) {
        CB_ERROR("qa: out of memory (repairing %zu bytes of UTF-8)", strlen(s));
        abort();
    }
    char *low = xsubst(g_re_all, clean, strlen(clean), "\\L$0", 1, 1);
    free(clean);
    size_t j = 0;
    for (size_t i = 0; low[i]; i++)
        if (!strchr(QA_PUNCT, low[i])) low[j++] = low[i];
    low[j] = '\0';
    char *noart = xsubst(g_re_articles, low, j, " ", 1, 0);
    free(low);
    size_t *sp;
    int n = words(noart, strlen(noart), &sp);
    size_t total = 1;
    for (int i = 0; i < n; i++) total += sp[2 * i + 1] - sp[2 * i] + 1;
    char *out = xmalloc(total), *o = out;
    for (int i = 0; i < n; i++) {
        if (i) *o++ = ' ';
        memcpy(o, noart + sp[2 * i], sp[2 * i + 1] - sp[2 * i]);
        o += sp[2 * i + 1] - sp[2 * i];
    }
    *o = '\0';
    free(sp);
    free(noart);
    return out;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }
static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Splits a normalized string (single spaces) in place into words; returns their count. */
static int split_normalized(char *s, char ***out) {
    int n = 0;
    for (char *p = s; *p; p++)
        if (*p == ' ') n++;
    n = *s ? n + 1 : 0;
    *out = xmalloc(sizeof(char *) * (size_t)(n ? n : 1));
    int i = 0;
    for (char *p = s; i < n;) {
        (*out)[i++] = p;
        char *sp = strchr(p, ' ');
        if (!sp) break;
        *sp = '\0';
        p = sp + 1;
    }
    return n;
}

static double f1_of(int common, int n_pred, int n_gold) {
    if (n_pred == 0 || n_gold == 0) return (n_pred == 0 && n_gold == 0) ? 1.0 : 0.0;
    if (common == 0) return 0.0;
    double p = (double)common / n_pred, r = (double)common / n_gold;
    return 2.0 * p * r / (p + r);
}

double cb_qa_f1(const char *prediction, const char *truth) {
    char *np = cb_qa_normalize(prediction), *ng = cb_qa_normalize(truth);
    char **wp, **wg;
    int n_p = split_normalized(np, &wp), n_g = split_normalized(ng, &wg);
    qsort(wp, (size_t)n_p, sizeof *wp, cmp_str);
    qsort(wg, (size_t)n_g, sizeof *wg, cmp_str);
    int common = 0;
    for (int i = 0, j = 0; i < n_p && j < n_g;) { /* multiset intersection of sorted lists */
        int c = strcmp(wp[i], wg[j]);
        if (c == 0) { common++; i++; j++; }
        else if (c < 0) i++;
        else j++;
    }
    double f = f1_of(common, n_p, n_g);
    free(wp);
    free(wg);
    free(np);
    free(ng);
    return f;
}

double cb_qa_f1_best(const char *prediction, const char *const *truths, int n) {
    double best = 0.0;
    for (int i = 0; truths && i < n; i++) {
        double f = cb_qa_f1(prediction, truths[i]);
        if (f > best) best = f;
    }
    return best;
}

double cb_qa_f1_ids(const int32_t *pred, int n_pred, const int32_t *gold, int n_gold) {
    if (!pred || n_pred < 0) n_pred = 0;
    if (!gold || n_gold < 0) n_gold = 0;
    int32_t *a = xmalloc(sizeof(int32_t) * (size_t)n_pred), *b = xmalloc(sizeof(int32_t) * (size_t)n_gold);
    if (n_pred) memcpy(a, pred, sizeof(int32_t) * (size_t)n_pred);
    if (n_gold) memcpy(b, gold, sizeof(int32_t) * (size_t)n_gold);
    qsort(a, (size_t)n_pred, sizeof *a, cmp_i32);
    qsort(b, (size_t)n_gold, sizeof *b, cmp_i32);
    int common = 0;
    for (int i = 0, j = 0; i < n_pred && j < n_gold;) {
        if (a[i] == b[j]) { common++; i++; j++; }
        else if (a[i] < b[j]) i++;
        else j++;
    }
    free(a);
    free(b);
    return f1_of(common, n_pred, n_gold);
}

/* ---------------------------------------------------------------- answers */

char *cb_qa_first_line(const char *output) {
    if (!output) output = "";
    while (*output == '\n') output++;
    const char *nl = strchr(output, '\n');
    return xstrndup(output, nl ? (size_t)(nl - output) : strlen(output));
}

char *cb_qa_parse_generation(const char *output) {
    char *s = cb_qa_first_line(output);
    if (!strncmp(s, "Yes", 3) || !strncmp(s, "yes", 3)) {
        free(s);
        return xstrndup("Yes", 3);
    }
    size_t *sp;
    int n = words(s, strlen(s), &sp);
    int no = n > 0 && sp[1] - sp[0] >= 2 && (!strncmp(s + sp[0], "No", 2) || !strncmp(s + sp[0], "no", 2));
    free(sp);
    if (no) {
        free(s);
        return xstrndup("No", 2);
    }
    return s;
}

double cb_qa_score(const char *output, const char *const *answers, int n) {
    char *p = cb_qa_parse_generation(output);
    double f = cb_qa_f1_best(p, answers, n);
    free(p);
    return f;
}

/* ---------------------------------------------------------------- the data set */

/* A required string member; NULL with an error naming it. */
static char *get_string(json_t *obj, const char *key, const char *where, int allow_empty, char *err, size_t errlen) {
    json_t *v = json_object_get(obj, key);
    if (!v) {
        cb_set_err(err, errlen, "%s%s: missing", where, key);
        return NULL;
    }
    if (!json_is_string(v)) {
        cb_set_err(err, errlen, "%s%s: not a string", where, key);
        return NULL;
    }
    size_t n = json_string_length(v);
    if (!allow_empty && n == 0) {
        cb_set_err(err, errlen, "%s%s: empty", where, key);
        return NULL;
    }
    return xstrndup(json_string_value(v), n);
}

void cb_qa_example_destroy(cb_qa_example_t **ex_p) {
    if (!ex_p || !*ex_p) return;
    cb_qa_example_t *ex = *ex_p;
    free(ex->id);
    free(ex->question);
    for (int i = 0; ex->answers && i < ex->n_answers; i++) free(ex->answers[i]);
    free(ex->answers);
    for (int i = 0; ex->ctxs && i < ex->n_ctxs; i++) {
        free(ex->ctxs[i].title);
        free(ex->ctxs[i].text);
    }
    free(ex->ctxs);
    free(ex);
    *ex_p = NULL;
}

cb_qa_example_t *cb_qa_example_parse(const char *line, size_t len, char *err, size_t errlen) {
    if (!line) {
        cb_set_err(err, errlen, "NULL line");
        return NULL;
    }
    json_error_t je;
    json_t *root = json_loadb(line, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        cb_set_err(err, errlen, "bad JSON at column %d: %s", je.column, je.text);
        return NULL;
    }
    cb_qa_example_t *ex = cb_calloc(1, sizeof *ex);
    if (!ex) {
        json_decref(root);
        cb_set_err(err, errlen, "out of memory");
        return NULL;
    }
    int ok = 0;
    if (!json_is_object(root)) {
        cb_set_err(err, errlen, "not a JSON object");
        goto out;
    }
    if (!(ex->id = get_string(root, "id", "", 0, err, errlen))) goto out;
    if (!(ex->question = get_string(root, "question", "", 0, err, errlen))) goto out;
    json_t *ans = json_object_get(root, "answers");
    if (!json_is_array(ans) || json_array_size(ans) < 1 || json_array_size(ans) > CB_QA_MAX_ANSWERS) {
        cb_set_err(err, errlen, "answers: %s", !ans ? "missing" : !json_is_array(ans) ? "not an array"
                                                               : "needs 1..1000 entries");
        goto out;
    }
    ex->answers = cb_calloc(json_array_size(ans), sizeof(char *));
    if (!ex->answers) goto oom;
    for (size_t i = 0; i < json_array_size(ans); i++) {
        json_t *a = json_array_get(ans, i);
        if (!json_is_string(a) || json_string_length(a) == 0) {
            cb_set_err(err, errlen, "answers[%zu]: %s", i, json_is_string(a) ? "empty" : "not a string");
            goto out;
        }
        ex->answers[i] = xstrndup(json_string_value(a), json_string_length(a));
        ex->n_answers = (int)i + 1;
    }
    json_t *ctxs = json_object_get(root, "ctxs");
    if (!json_is_array(ctxs) || json_array_size(ctxs) < 1 || json_array_size(ctxs) > CB_QA_MAX_CTXS) {
        cb_set_err(err, errlen, "ctxs: %s", !ctxs ? "missing" : !json_is_array(ctxs) ? "not an array"
                                                            : "needs 1..1000 entries");
        goto out;
    }
    ex->ctxs = cb_calloc(json_array_size(ctxs), sizeof(cb_qa_ctx_t));
    if (!ex->ctxs) goto oom;
    for (size_t i = 0; i < json_array_size(ctxs); i++) {
        json_t *c = json_array_get(ctxs, i);
        char where[32];
        snprintf(where, sizeof where, "ctxs[%zu].", i);
        if (!json_is_object(c)) {
            cb_set_err(err, errlen, "ctxs[%zu]: not an object", i);
            goto out;
        }
        ex->n_ctxs = (int)i + 1;
        if (!(ex->ctxs[i].title = get_string(c, "title", where, 1, err, errlen))) goto out;
        if (!(ex->ctxs[i].text = get_string(c, "text", where, 1, err, errlen))) goto out;
    }
    ok = 1;
    goto out;
oom:
    cb_set_err(err, errlen, "out of memory");
out:
    json_decref(root);
    if (!ok) cb_qa_example_destroy(&ex);
    return ex;
}

struct cb_qa_set {
    int n;
    cb_qa_example_t **ex;  /* [n] */
};

void cb_qa_set_destroy(cb_qa_set_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_qa_set_t *self = *self_p;
    for (int i = 0; i < self->n; i++) cb_qa_example_destroy(&self->ex[i]);
    free(self->ex);
    free(self);
    *self_p = NULL;
}

cb_qa_set_t *cb_qa_set_load(const char *path, char *err, size_t errlen) {
    if (!path) {
        cb_set_err(err, errlen, "NULL path");
        return NULL;
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        cb_set_err(err, errlen, "%s: cannot open", path);
        return NULL;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            if (cap >= QA_MAX_FILE) {
                cb_set_err(err, errlen, "%s: larger than %zu bytes", path, QA_MAX_FILE);
                fclose(f);
                free(buf);
                return NULL;
            }
            cap = cap ? cap * 2 : 1 << 20;
            buf = xrealloc(buf, cap);
        }
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0) break;
    }
    int read_err = ferror(f);
    fclose(f);
    if (read_err) {
        cb_set_err(err, errlen, "%s: read error", path);
        free(buf);
        return NULL;
    }
    cb_qa_set_t *self = cb_calloc(1, sizeof *self);
    if (!self) {
        free(buf);
        cb_set_err(err, errlen, "out of memory");
        return NULL;
    }
    int cap_ex = 0, line_no = 0;
    for (size_t pos = 0; pos < len;) {
        const char *nl = memchr(buf + pos, '\n', len - pos);
        size_t end = nl ? (size_t)(nl - buf) : len;
        line_no++;
        int blank = 1;
        for (size_t i = pos; i < end && blank; i++)
            if (buf[i] != ' ' && buf[i] != '\t' && buf[i] != '\r') blank = 0;
        if (!blank) {
            char msg[256];
            cb_qa_example_t *ex = cb_qa_example_parse(buf + pos, end - pos, msg, sizeof msg);
            if (!ex) {
                cb_set_err(err, errlen, "%s:%d: %s", path, line_no, msg);
                free(buf);
                cb_qa_set_destroy(&self);
                return NULL;
            }
            if (self->n == cap_ex) {
                cap_ex = cap_ex ? cap_ex * 2 : 64;
                self->ex = xrealloc(self->ex, sizeof *self->ex * (size_t)cap_ex);
            }
            self->ex[self->n++] = ex;
        }
        pos = end + 1;
    }
    free(buf);
    return self;
}

int cb_qa_set_size(const cb_qa_set_t *self) { return self ? self->n : 0; }

const cb_qa_example_t *cb_qa_set_get(const cb_qa_set_t *self, int i) {
    return (self && i >= 0 && i < self->n) ? self->ex[i] : NULL;
}
