/* log.c: one escaped line per event on stderr (see log.h). */
#include "base/log.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/utf8.h"

static const char *s_component = "cb";
static int s_level = -1; /* -1: not read from the environment yet */

void cb_log_set_component(const char *name) { s_component = name ? name : "cb"; }
void cb_log_set_level(cb_log_level_t level) { s_level = (int)level; }

static int current_level(void) {
    if (s_level < 0) {
        const char *e = getenv("CB_LOG_LEVEL");
        s_level = CB_LOG_INFO;
        if (e && strcmp(e, "debug") == 0) s_level = CB_LOG_DEBUG;
        else if (e && strcmp(e, "warn") == 0) s_level = CB_LOG_WARN;
        else if (e && strcmp(e, "error") == 0) s_level = CB_LOG_ERROR;
    }
    return s_level;
}

int cb_log_enabled(cb_log_level_t level) { return (int)level >= current_level(); }

/* The code point of the well-formed sequence p[0..n) (n = 2 or 3 here). */
static uint32_t code_point(const unsigned char *p, size_t n) {
    if (n == 2) return ((uint32_t)(p[0] & 0x1f) << 6) | (p[1] & 0x3f);
    return ((uint32_t)(p[0] & 0x0f) << 12) | ((uint32_t)(p[1] & 0x3f) << 6) | (p[2] & 0x3f);
}

/* Code points that are well-formed but must not reach a log line as they are. */
static int cp_unsafe(uint32_t cp) {
    return (cp >= 0x80 && cp <= 0x9f) || cp == 0x2028 || cp == 0x2029 || (cp >= 0x202a && cp <= 0x202e) ||
           (cp >= 0x2066 && cp <= 0x2069);
}

size_t cb_log_escape(const char *in, size_t len, char *out, size_t cap) {
    static const char hex[] = "0123456789abcdef";
    const size_t mark = sizeof CB_LOG_TRUNCATED - 1;
    if (!out || cap == 0) return 0;
    if (cap <= mark) {
        out[0] = 0;
        return 0;
    }
    const unsigned char *p = (const unsigned char *)in;
    size_t o = 0, i = 0, safe = 0; /* safe: an output length after which the marker still fits */
    while (p && i < len) {
        char piece[12];
        size_t pl, used;
        unsigned char c = p[i];
        size_t sl = cb_utf8_seq_len(p + i, len - i);
        if (c == '\\') {
            memcpy(piece, "\\\\", pl = 2), used = 1;
        } else if (c == '\n' || c == '\r' || c == '\t') {
            piece[0] = '\\', piece[1] = c == '\n' ? 'n' : c == '\r' ? 'r' : 't', pl = 2, used = 1;
        } else if (c < 0x20 || c == 0x7f || sl == 0) {
            piece[0] = '\\', piece[1] = 'x', piece[2] = hex[c >> 4], piece[3] = hex[c & 15], pl = 4, used = 1;
        } else if (sl > 1 && sl < 4 && cp_unsafe(code_point(p + i, sl))) {
            uint32_t cp = code_point(p + i, sl);
            pl = (size_t)snprintf(piece, sizeof piece, "\\u{%04x}", (unsigned)cp), used = sl;
        } else {
            memcpy(piece, p + i, sl), pl = sl, used = sl;
        }
        if (o + pl >= cap) { /* does not fit: cut at the last boundary that leaves room for the marker */
            memcpy(out + safe, CB_LOG_TRUNCATED, mark);
            o = safe + mark;
            break;
        }
        memcpy(out + o, piece, pl);
        o += pl;
        i += used;
        if (o + mark < cap) safe = o;
    }
    out[o] = 0;
    return o;
}

void cb_log(cb_log_level_t level, const char *req_id, const char *fmt, ...) {
    static const char *names[] = {"debug", "info", "warn", "error"};
    if (!cb_log_enabled(level)) return;
    char msg[CB_LOG_MAX_MSG + 1];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    size_t mlen = n < 0 ? 0 : (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1;
    const size_t mark = sizeof CB_LOG_TRUNCATED - 1;
    bool cut = n >= 0 && (size_t)n >= sizeof msg;
    if (cut) { /* vsnprintf may have cut a character: drop its first bytes rather than escape them */
        size_t k = mlen;
        while (k > 0 && mlen - k < 4 && ((unsigned char)msg[k - 1] & 0xc0) == 0x80) k--;
        if (k > 0 && cb_utf8_seq_len((const unsigned char *)msg + k - 1, mlen - (k - 1)) == 0) mlen = k - 1;
    }
    char esc[CB_LOG_MAX_MSG + 1];
    size_t elen = cb_log_escape(msg, mlen, esc, cut ? sizeof esc - mark : sizeof esc);
    if (cut && (elen < mark || memcmp(esc + elen - mark, CB_LOG_TRUNCATED, mark) != 0))
        memcpy(esc + elen, CB_LOG_TRUNCATED, mark + 1);
    char rid[2 * 64 + sizeof CB_LOG_TRUNCATED + 1];
    if (req_id) cb_log_escape(req_id, strnlen(req_id, 256), rid, sizeof rid);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s%s%s%s %s\n", tm.tm_year + 1900,
            tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000L,
            names[level], s_component, req_id ? " [" : "", req_id ? rid : "", req_id ? "]" : "", esc);
}
