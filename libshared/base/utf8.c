/* utf8: one implementation of UTF-8 well-formedness, repair to U+FFFD and encoding (see utf8.h).
 * No state; the repair copies are the only allocations, and their failure returns NULL. */
#include "base/utf8.h"
#include "base/alloc.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

size_t cb_utf8_lead_len(unsigned char c) {
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return 2;
    if (c >= 0xE0 && c <= 0xEF) return 3;
    if (c >= 0xF0 && c <= 0xF4) return 4;
    return 0;
}

size_t cb_utf8_seq_len(const unsigned char *p, size_t n) {
    if (n == 0) return 0;
    unsigned c = p[0];
    size_t len = cb_utf8_lead_len((unsigned char)c);
    if (len <= 1) return len;
    if (len > n) return 0;
    unsigned lo = 0x80, hi = 0xBF; /* the second byte's range excludes overlongs, surrogates, > U+10FFFF */
    if (c == 0xE0) lo = 0xA0;
    else if (c == 0xED) hi = 0x9F;
    else if (c == 0xF0) lo = 0x90;
    else if (c == 0xF4) hi = 0x8F;
    if (p[1] < lo || p[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if (p[i] < 0x80 || p[i] > 0xBF) return 0;
    return len;
}

bool cb_utf8_valid(const char *s, size_t len) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < len;) {
        size_t l = cb_utf8_seq_len(u + i, len - i);
        if (l == 0) return false;
        i += l;
    }
    return true;
}

char *cb_utf8_repair_n(const char *s, size_t n, size_t *out_len) {
    if (n > (SIZE_MAX - 1) / 3) return NULL;
    char *out = cb_malloc(3 * n + 1);
    if (!out) return NULL;
    const unsigned char *u = (const unsigned char *)s;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t l = cb_utf8_seq_len(u + i, n - i);
        if (l) {
            memcpy(out + o, u + i, l);
            o += l;
            i += l;
        } else {
            memcpy(out + o, CB_UTF8_REPLACEMENT, 3);
            o += 3;
            i++;
        }
    }
    out[o] = '\0';
    if (out_len) *out_len = o;
    return out;
}

char *cb_utf8_repair(const char *s) { return cb_utf8_repair_n(s, strlen(s), NULL); }

size_t cb_utf8_encode(uint32_t cp, unsigned char *out) {
    if (cp < 0x80) {
        out[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (unsigned char)(0xC0 | (cp >> 6));
        out[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (unsigned char)(0xE0 | (cp >> 12));
        out[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (unsigned char)(0xF0 | (cp >> 18));
    out[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}
