/* chunker.c: document text -> chunk texts under a token budget (see chunker.h).
 *
 * Three passes: (1) find the unit ends (paragraph, sentence/line) by scanning runs of white space;
 * (2) measure each unit by encoding it alone, splitting units over the budget at word or character
 * boundaries (binary search on the byte length, measured by encoding); (3) pack units greedily into
 * chunks, preferring a paragraph end when it leaves the chunk at least half full, and re-measure each
 * chunk's trimmed text, shedding units from its end if BPE made it longer than the sum of its units.
 */
#include "rag/chunker.h"
#include "base/alloc.h"

#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

enum { BRK_HARD = 0, BRK_SENT = 1, BRK_PARA = 2 };

typedef struct {
    size_t start, end;  /* bytes [start, end) of the document, trailing white space included */
    int n_tokens;       /* tokens of text[start, end) encoded alone */
    int brk;            /* strength of the boundary at `end` (BRK_*) */
} unit_t;

struct cb_chunker {
    const cb_tokenizer_t *tok;
    int budget;
    unit_t *units;      /* [cap_units] scratch */
    size_t cap_units;
};

cb_chunker_t *cb_chunker_new(const cb_tokenizer_t *tok, int budget, char *err, size_t errlen) {
    if (!tok) {
        cb_set_err(err, errlen, "chunker: no tokenizer");
        return NULL;
    }
    if (budget < CB_CHUNKER_MIN_BUDGET || budget > CB_CHUNKER_MAX_BUDGET) {
        cb_set_err(err, errlen, "chunker: budget %d out of range [%d, %d]", budget, CB_CHUNKER_MIN_BUDGET,
                   CB_CHUNKER_MAX_BUDGET);
        return NULL;
    }
    cb_chunker_t *c = cb_calloc(1, sizeof *c);
    if (!c) {
        cb_set_err(err, errlen, "chunker: out of memory");
        return NULL;
    }
    c->tok = tok;
    c->budget = budget;
    return c;
}

void cb_chunker_destroy(cb_chunker_t **self_p) {
    if (!self_p || !*self_p) return;
    free((*self_p)->units);
    free(*self_p);
    *self_p = NULL;
}

int cb_chunker_budget(const cb_chunker_t *self) { return self->budget; }

/* Tokens of s[0..len) encoded alone; -1 on a tokenizer error. */
static int count_tokens(const cb_chunker_t *c, const char *s, size_t len) {
    if (len == 0) return 0;
    int r = cb_tokenizer_encode(c->tok, s, len, false, NULL, 0);
    if (r == CB_TOKENIZER_EINVAL || r == CB_TOKENIZER_EINTERNAL) return -1;
    return r < 0 ? -r : r;
}

static bool is_ws(unsigned char ch) { return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\f' || ch == '\v'; }

/* Whether the text just before position p (exclusive) ends a sentence: a terminator, optionally followed
 * by closing quotes/brackets. */
static bool ends_sentence(const char *s, size_t start, size_t p) {
    size_t i = p;
    /* skip closing characters: ASCII ) ] " ' and the UTF-8 right quotes ” (E2 80 9D) ’ (E2 80 99) */
    for (int guard = 0; guard < 4 && i > start; guard++) {
        unsigned char ch = (unsigned char)s[i - 1];
        if (ch == ')' || ch == ']' || ch == '"' || ch == '\'') {
            i--;
        } else if (i - start >= 3 && (unsigned char)s[i - 3] == 0xE2 && (unsigned char)s[i - 2] == 0x80 &&
                   (ch == 0x9D || ch == 0x99)) {
            i -= 3;
        } else {
            break;
        }
    }
    if (i == start) return false;
    unsigned char ch = (unsigned char)s[i - 1];
    if (ch == '.' || ch == '!' || ch == '?') return true;
    /* 。 E3 80 82, ！ EF BC 81, ？ EF BC 9F */
    if (i - start >= 3) {
        const unsigned char *u = (const unsigned char *)s + i - 3;
        if (u[0] == 0xE3 && u[1] == 0x80 && u[2] == 0x82) return true;
        if (u[0] == 0xEF && u[1] == 0xBC && (u[2] == 0x81 || u[2] == 0x9F)) return true;
    }
    return false;
}

static int push_unit(cb_chunker_t *c, size_t *n, size_t start, size_t end, int n_tokens, int brk) {
    if (*n == c->cap_units) {
        size_t cap = c->cap_units ? c->cap_units * 2 : 64;
        unit_t *u = cb_realloc(c->units, cap * sizeof *u);
        if (!u) return -1;
        c->units = u;
        c->cap_units = cap;
    }
    c->units[(*n)++] = (unit_t){start, end, n_tokens, brk};
    return 0;
}

/* Moves p back to the start of a UTF-8 character (never below lo). */
static size_t utf8_floor(const char *s, size_t lo, size_t p) {
    while (p > lo && ((unsigned char)s[p] & 0xC0) == 0x80) p--;
    return p;
}

/* Adds the unit text[a, b) with boundary strength brk, split into pieces of at most budget tokens when it
 * is larger. 0, or -1 (tokenizer failure / out of memory). */
static int add_unit(cb_chunker_t *c, const char *s, size_t len, size_t *n, size_t a, size_t b, int brk) {
    int budget = c->budget;
    size_t pos = a;
    while (pos < b) {
        int t = count_tokens(c, s + pos, b - pos);
        if (t < 0) return -1;
        if (t <= budget) return push_unit(c, n, pos, b, t, brk);
        /* the piece cannot hold more than ~32 bytes per token: search within that window */
        size_t window = (size_t)budget * 32;
        size_t hi = b - pos < window ? b - pos : window; /* bytes */
        size_t lo = 1, best = 0;
        int t_hi = count_tokens(c, s + pos, hi);
        if (t_hi < 0) return -1;
        if (t_hi <= budget) {
            best = hi;
        } else {
            while (lo <= hi) { /* largest m with tokens(s[pos, pos+m)) <= budget (approximately monotone) */
                size_t m = lo + (hi - lo) / 2;
                int tm = count_tokens(c, s + pos, m);
                if (tm < 0) return -1;
                if (tm <= budget) {
                    best = m;
                    lo = m + 1;
                } else {
                    hi = m - 1;
                }
            }
        }
        size_t cut = pos + best;
        cut = utf8_floor(s, pos, cut);
        /* prefer the end of the last white space run in the second half of the piece */
        for (size_t q = cut; q > pos + (cut - pos) / 2; q--) {
            if (is_ws((unsigned char)s[q - 1])) {
                cut = q;
                break;
            }
        }
        if (cut <= pos) { /* a single character over the budget: take one whole character */
            cut = pos + 1;
            while (cut < b && ((unsigned char)s[cut] & 0xC0) == 0x80) cut++;
        }
        int tc = count_tokens(c, s + pos, cut - pos);
        if (tc < 0) return -1;
        if (push_unit(c, n, pos, cut, tc, BRK_HARD) != 0) return -1;
        pos = cut;
    }
    (void)len;
    return 0;
}

/* Pass 1 + 2: the document's units. Returns the count, or -1. */
static long find_units(cb_chunker_t *c, const char *s, size_t len) {
    size_t n = 0, unit_start = 0, i = 0;
    /* the document's leading white space belongs to the first unit */
    while (i < len && is_ws((unsigned char)s[i])) i++;
    while (i < len) {
        if (!is_ws((unsigned char)s[i])) {
            i++;
            continue;
        }
        size_t ws = i;
        int newlines = 0;
        while (i < len && is_ws((unsigned char)s[i])) {
            if (s[i] == '\n') newlines++;
            i++;
        }
        int brk = -1;
        if (newlines >= 2) brk = BRK_PARA;
        else if (newlines == 1 || ends_sentence(s, unit_start, ws)) brk = BRK_SENT;
        if (brk >= 0) {
            if (add_unit(c, s, len, &n, unit_start, i, brk) != 0) return -1;
            unit_start = i;
        }
    }
    if (unit_start < len && add_unit(c, s, len, &n, unit_start, len, BRK_PARA) != 0) return -1;
    return (long)n;
}

/* The chunk text of units [i0, j]: trailing white space dropped, leading white space dropped unless it
 * is the document's start. */
static void chunk_bounds(const cb_chunker_t *c, const char *s, size_t i0, size_t j, size_t *off, size_t *len) {
    size_t a = c->units[i0].start, b = c->units[j].end;
    if (a > 0)
        while (a < b && is_ws((unsigned char)s[a])) a++;
    while (b > a && is_ws((unsigned char)s[b - 1])) b--;
    *off = a;
    *len = b - a;
}

static bool all_ws(const char *s, size_t len) {
    for (size_t i = 0; i < len; i++)
        if (!is_ws((unsigned char)s[i])) return false;
    return true;
}

int cb_chunker_split(cb_chunker_t *self, const char *text, size_t len, cb_chunk_span_t **spans, int *n, char *err,
                     size_t errlen) {
    *spans = NULL;
    *n = 0;
    if (!text && len) {
        cb_set_err(err, errlen, "chunker: NULL text");
        return -1;
    }
    if (len > (size_t)INT_MAX / 4) {
        cb_set_err(err, errlen, "chunker: document of %zu bytes is too large", len);
        return -1;
    }
    if (len == 0 || all_ws(text, len)) return 0;

    size_t cap = 8, count = 0;
    cb_chunk_span_t *out = cb_malloc(cap * sizeof *out);
    if (!out) goto oom;

    /* the whole document (without its trailing white space) when it fits */
    size_t whole = len;
    while (whole > 0 && is_ws((unsigned char)text[whole - 1])) whole--;
    int t_whole = count_tokens(self, text, whole);
    if (t_whole < 0) goto tokfail;
    if (t_whole <= self->budget) {
        out[0] = (cb_chunk_span_t){0, whole, t_whole};
        *spans = out;
        *n = 1;
        return 0;
    }

    long nu = find_units(self, text, len);
    if (nu < 0) goto tokfail;
    const unit_t *u = self->units;
    size_t i0 = 0;
    while (i0 < (size_t)nu) {
        /* grow the chunk from i0 while the units fit */
        long sum = 0;
        size_t i = i0;
        while (i < (size_t)nu && sum + u[i].n_tokens <= self->budget) sum += u[i++].n_tokens;
        if (i == i0) i = i0 + 1; /* a unit over the budget on its own (cannot happen: add_unit splits) */
        size_t j; /* last unit of the chunk */
        if (i == (size_t)nu) {
            j = i - 1;
        } else {
            /* prefer the last paragraph end that leaves the chunk at least half full */
            j = i - 1;
            long acc = 0, best = -1;
            for (size_t q = i0; q < i; q++) {
                acc += u[q].n_tokens;
                if (u[q].brk == BRK_PARA && acc * 2 >= self->budget) best = (long)q;
            }
            if (best >= 0) j = (size_t)best;
            else {
                /* else the last sentence end, else the budget (the last unit that fits) */
                for (size_t q = i; q-- > i0;)
                    if (u[q].brk >= BRK_SENT) {
                        j = q;
                        break;
                    }
            }
        }
        /* re-measure the trimmed text; shed units while BPE made it too long */
        size_t off, clen;
        int t;
        for (;;) {
            chunk_bounds(self, text, i0, j, &off, &clen);
            t = count_tokens(self, text + off, clen);
            if (t < 0) goto tokfail;
            if (t <= self->budget || j == i0) break;
            j--;
        }
        if (clen > 0 && !all_ws(text + off, clen)) {
            if (count == cap) {
                cap *= 2;
                cb_chunk_span_t *o2 = cb_realloc(out, cap * sizeof *o2);
                if (!o2) goto oom;
                out = o2;
            }
            out[count++] = (cb_chunk_span_t){off, clen, t};
        }
        i0 = j + 1;
    }
    if (count == 0) {
        free(out);
        out = NULL;
    }
    *spans = out;
    *n = (int)count;
    return 0;

oom:
    free(out);
    cb_set_err(err, errlen, "chunker: out of memory");
    return -1;
tokfail:
    free(out);
    cb_set_err(err, errlen, "chunker: tokenizer failure (or out of memory)");
    return -1;
}
