/* regex: the PCRE2 pattern compile and substitution that the prompt builder (ragprompt) and the scoring
 * (qa) share. Patterns are compiled for UTF-8 with Unicode properties and invalid UTF-8 tolerated. */
#ifndef CB_RAG_REGEX_H
#define CB_RAG_REGEX_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stddef.h>

/* Compiles a constant pattern; a pattern that does not compile is a bug (logged, then abort). The code is
 * owned by the caller (pcre2_code_free), usually kept for the process. */
pcre2_code *cb_regex_compile(const char *pat);

/* Substitutes repl for re's matches in s[0..len) (every match when `global`; PCRE2's extended replacement
 * syntax, e.g. \L, when `extended`): a new NUL-terminated string with `extra` spare bytes after it (owned by
 * the caller, free), or NULL when out of memory. Should PCRE2 refuse the substitution for another reason
 * (not expected with our patterns), the text is returned unchanged. */
char *cb_regex_subst(const pcre2_code *re, const char *s, size_t len, const char *repl, int global, int extended,
                     size_t extra);
#endif
