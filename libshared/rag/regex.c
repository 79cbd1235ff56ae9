/* regex.c: see regex.h. */
#include "rag/regex.h"

#include <stdlib.h>
#include <string.h>

#include "base/alloc.h"
#include "base/log.h"

pcre2_code *cb_regex_compile(const char *pat) {
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &ec, &eo, NULL);
    if (!re) { /* a constant pattern: an internal invariant */
        CB_ERROR("regex: cannot compile /%s/ (error %d at %zu)", pat, ec, (size_t)eo);
        abort();
    }
    return re;
}

char *cb_regex_subst(const pcre2_code *re, const char *s, size_t len, const char *repl, int global, int extended,
                     size_t extra) {
    const uint32_t opts = PCRE2_SUBSTITUTE_OVERFLOW_LENGTH | (global ? PCRE2_SUBSTITUTE_GLOBAL : 0) |
                          (extended ? PCRE2_SUBSTITUTE_EXTENDED : 0);
    PCRE2_SIZE cap = len + len / 2 + 16;
    char *out = cb_malloc(cap + extra);
    for (int attempt = 0; out && attempt < 2; attempt++) { /* the second with the length PCRE2 asked for */
        PCRE2_SIZE outlen = cap;
        int rc = pcre2_substitute(re, (PCRE2_SPTR)s, len, 0, opts, NULL, NULL, (PCRE2_SPTR)repl,
                                  PCRE2_ZERO_TERMINATED, (PCRE2_UCHAR *)out, &outlen);
        if (rc >= 0) return out;
        if (rc != PCRE2_ERROR_NOMEMORY) break;
        cap = outlen + 1;
        char *bigger = cb_realloc(out, cap + extra);
        if (!bigger) {
            free(out);
            return NULL;
        }
        out = bigger;
    }
    if (!out) return NULL;
    free(out);
    if (!(out = cb_malloc(len + 1 + extra))) return NULL;
    memcpy(out, s, len);
    out[len] = '\0';
    return out;
}
