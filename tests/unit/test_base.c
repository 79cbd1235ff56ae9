/* test_base: the base/ helpers: cb_set_err (truncation, NULL buffer), cb_now_ms (monotonic), the
 * UTF-8 helpers (valid multi-byte, truncated sequences, overlongs, lone continuation bytes, surrogates,
 * above U+10FFFF, NULs, repair to U+FFFD, encoding), and the log's escaping (control characters,
 * newlines, invalid UTF-8, truncation with a marker; one line per cb_log call whatever the text). */
#include "base/clock.h"
#include "base/err.h"
#include "base/log.h"
#include "base/utf8.h"
#include "test.h"

#include <stdint.h>
#include <unistd.h>

#define U(s) ((const unsigned char *)(s))
#define R CB_UTF8_REPLACEMENT

/* cb_utf8_repair of s equals want (and the _n form agrees and reports the length). */
static int repairs_to(const char *s, const char *want) {
    char *a = cb_utf8_repair(s);
    size_t n = 0;
    char *b = cb_utf8_repair_n(s, strlen(s), &n);
    int ok = a && b && strcmp(a, want) == 0 && strcmp(b, want) == 0 && n == strlen(want);
    if (!ok) fprintf(stderr, "  repair of \"%s\" gave \"%s\"\n", s, a ? a : "(null)");
    free(a);
    free(b);
    return ok;
}

TEST(set_err_formats_and_truncates) {
    char err[8];
    cb_set_err(err, sizeof err, "%s %d", "abc", 12);
    CHECK(strcmp(err, "abc 12") == 0);
    cb_set_err(err, sizeof err, "%s", "0123456789");
    CHECK(strcmp(err, "0123456") == 0); /* errlen - 1 bytes and the NUL */
    memset(err, 'x', sizeof err);
    cb_set_err(err, 1, "%s", "anything");
    CHECK(err[0] == '\0' && err[1] == 'x');
}

TEST(set_err_null_or_empty_buffer) {
    cb_set_err(NULL, 0, "%s", "ignored");
    cb_set_err(NULL, 64, "%s", "ignored"); /* must not crash */
    char err[4] = "abc";
    cb_set_err(err, 0, "%s", "ignored");
    CHECK(strcmp(err, "abc") == 0); /* errlen 0: untouched */
}

TEST(now_ms_monotonic) {
    double a = cb_now_ms(), b = cb_now_ms();
    CHECK(a > 0 && b >= a);
}

TEST(utf8_valid_multibyte) {
    CHECK(cb_utf8_seq_len(U("a"), 1) == 1);
    CHECK(cb_utf8_seq_len(U("\xC3\xA9"), 2) == 2);             /* é */
    CHECK(cb_utf8_seq_len(U("\xE2\x82\xAC"), 3) == 3);         /* € */
    CHECK(cb_utf8_seq_len(U("\xF0\x9F\x98\x80"), 4) == 4);     /* U+1F600 */
    CHECK(cb_utf8_seq_len(U("\xF4\x8F\xBF\xBF"), 4) == 4);     /* U+10FFFF */
    CHECK(cb_utf8_seq_len(U("\xED\x9F\xBF"), 3) == 3);         /* U+D7FF, just below the surrogates */
    CHECK(cb_utf8_seq_len(U("\xC3\xA9x"), 3) == 2);            /* only the first sequence */
    CHECK(cb_utf8_valid("", 0) && cb_utf8_valid(NULL, 0));
    CHECK(cb_utf8_valid("plain \xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80", 15));
    CHECK(cb_utf8_valid("a\0b", 3));                           /* NUL is a one-byte sequence */
    CHECK(cb_utf8_lead_len('a') == 1 && cb_utf8_lead_len(0xC2) == 2 && cb_utf8_lead_len(0xEF) == 3);
    CHECK(cb_utf8_lead_len(0xF4) == 4 && cb_utf8_lead_len(0xF5) == 0 && cb_utf8_lead_len(0xBF) == 0);
    CHECK(repairs_to("plain \xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80", "plain \xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80"));
}

TEST(utf8_truncated_sequence) {
    CHECK(cb_utf8_seq_len(U("\xC3\xA9"), 1) == 0);
    CHECK(cb_utf8_seq_len(U("\xE2\x82\xAC"), 2) == 0);
    CHECK(cb_utf8_seq_len(U("\xF0\x9F\x98\x80"), 3) == 0);
    CHECK(cb_utf8_seq_len(U("x"), 0) == 0);
    CHECK(!cb_utf8_valid("\xC3", 1));
    CHECK(!cb_utf8_valid("ab\xE2\x82", 4));
    CHECK(repairs_to("Br\xC3", "Br" R));                      /* cut inside "é" */
    CHECK(repairs_to("\xE2\x82" "x", R R "x"));               /* one U+FFFD per byte, resumes at x */
    CHECK(repairs_to("\xF0\x9F\x98", R R R));
    CHECK(repairs_to("\xC3" "a", R "a"));                     /* bad continuation byte */
}

TEST(utf8_overlong) {
    CHECK(cb_utf8_seq_len(U("\xC0\xAF"), 2) == 0);             /* '/' in two bytes */
    CHECK(cb_utf8_seq_len(U("\xC1\xBF"), 2) == 0);
    CHECK(cb_utf8_seq_len(U("\xE0\x80\xAF"), 3) == 0);
    CHECK(cb_utf8_seq_len(U("\xE0\x9F\xBF"), 3) == 0);
    CHECK(cb_utf8_seq_len(U("\xE0\xA0\x80"), 3) == 3);         /* U+0800, the first 3-byte one */
    CHECK(cb_utf8_seq_len(U("\xF0\x8F\xBF\xBF"), 4) == 0);
    CHECK(cb_utf8_seq_len(U("\xF0\x90\x80\x80"), 4) == 4);     /* U+10000 */
    CHECK(cb_utf8_seq_len(U("\xF4\x90\x80\x80"), 4) == 0);     /* above U+10FFFF */
    CHECK(cb_utf8_seq_len(U("\xF5\x80\x80\x80"), 4) == 0);
    CHECK(!cb_utf8_valid("\xE0\x80\xAF", 3));
    CHECK(repairs_to("a\xC0\xAF" "b", "a" R R "b"));
    CHECK(repairs_to("\xE0\x80\xAF", R R R));
    CHECK(repairs_to("\xFF\xFE", R R));
}

TEST(utf8_lone_continuation) {
    CHECK(cb_utf8_seq_len(U("\x80"), 1) == 0);
    CHECK(cb_utf8_seq_len(U("\xBF" "a"), 2) == 0);
    CHECK(!cb_utf8_valid("\x80", 1));
    CHECK(!cb_utf8_valid("\xC3\xA9\xA9", 3));                  /* one continuation byte too many */
    CHECK(repairs_to("a\x80" "b", "a" R "b"));
    CHECK(repairs_to("\xC3\xA9\xA9", "\xC3\xA9" R));
}

TEST(utf8_surrogate) {
    CHECK(cb_utf8_seq_len(U("\xED\xA0\x80"), 3) == 0);         /* U+D800 */
    CHECK(cb_utf8_seq_len(U("\xED\xBF\xBF"), 3) == 0);         /* U+DFFF */
    CHECK(!cb_utf8_valid("\xED\xA0\x80", 3));
    CHECK(repairs_to("\xED\xA0\x80 x", R R R " x"));
    unsigned char b[4];
    CHECK(cb_utf8_encode(0xD800, b) == 3 && memcmp(b, "\xED\xA0\x80", 3) == 0); /* encoded as it is */
}

TEST(utf8_repair_n_keeps_nul) {
    size_t n = 99;
    char *r = cb_utf8_repair_n("a\0\xFF" "b", 4, &n);
    CHECK(r);
    int ok = n == 6 && memcmp(r, "a\0" R "b", 7) == 0;
    free(r);
    CHECK(ok);
    r = cb_utf8_repair_n(NULL, 0, &n);
    CHECK(r && n == 0 && r[0] == '\0');
    free(r);
    CHECK(cb_utf8_repair_n("x", SIZE_MAX / 2, &n) == NULL); /* 3n + 1 overflows: refused before reading */
}

TEST(utf8_encode) {
    unsigned char b[4];
    CHECK(cb_utf8_encode('A', b) == 1 && b[0] == 'A');
    CHECK(cb_utf8_encode(0x120, b) == 2 && memcmp(b, "\xC4\xA0", 2) == 0); /* Ġ */
    CHECK(cb_utf8_encode(0x20AC, b) == 3 && memcmp(b, "\xE2\x82\xAC", 3) == 0);
    CHECK(cb_utf8_encode(0x1F600, b) == 4 && memcmp(b, "\xF0\x9F\x98\x80", 4) == 0);
    /* every scalar value round-trips through seq_len */
    for (uint32_t cp = 1; cp <= 0x10FFFF; cp += (cp < 0x800 ? 1 : 97)) {
        if (cp >= 0xD800 && cp <= 0xDFFF) continue;
        size_t l = cb_utf8_encode(cp, b);
        CHECK_MSG(cb_utf8_seq_len(b, l) == l, "U+%04X", (unsigned)cp);
    }
}

/* cb_log_escape of s[0..n) equals want. */
static int escapes_to(const char *s, size_t n, const char *want) {
    char out[256];
    size_t len = cb_log_escape(s, n, out, sizeof out);
    int ok = len == strlen(out) && strcmp(out, want) == 0;
    if (!ok) fprintf(stderr, "  escape gave \"%s\", expected \"%s\"\n", out, want);
    return ok;
}

TEST(log_escape_controls_and_newlines) {
    CHECK(escapes_to("plain text", 10, "plain text"));
    CHECK(escapes_to("a\n2026-01-01T00:00:00.000Z info  cb-precompute forged", 53,
                     "a\\n2026-01-01T00:00:00.000Z info  cb-precompute forged"));
    CHECK(escapes_to("\r\t\x1b[31mred", 10, "\\r\\t\\x1b[31mred"));
    CHECK(escapes_to("a\0b", 3, "a\\x00b"));
    CHECK(escapes_to("del\x7f", 4, "del\\x7f"));
    CHECK(escapes_to("back\\slash", 10, "back\\\\slash")); /* "\n" typed as text stays tellable from a newline */
    CHECK(escapes_to(NULL, 0, ""));
}

TEST(log_escape_utf8) {
    CHECK(escapes_to("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80", 14, "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"));
    CHECK(escapes_to("bad \xFF\xC3(", 7, "bad \\xff\\xc3("));        /* invalid and cut sequences */
    CHECK(escapes_to("\xC0\xAF", 2, "\\xc0\\xaf"));                  /* overlong */
    CHECK(escapes_to("\xED\xA0\x80", 3, "\\xed\\xa0\\x80"));         /* surrogate */
    CHECK(escapes_to("x\xC2\x85y", 4, "x\\u{0085}y"));               /* NEL, a C1 control */
    CHECK(escapes_to("\xE2\x80\xA8|\xE2\x80\xAE", 7, "\\u{2028}|\\u{202e}")); /* line separator, RLO */
}

TEST(log_escape_truncates_with_marker) {
    char out[32];
    const char *m = CB_LOG_TRUNCATED;
    size_t ml = strlen(m);
    /* fits exactly: no marker */
    char in[64];
    memset(in, 'a', sizeof in);
    CHECK(cb_log_escape(in, 31, out, sizeof out) == 31 && strchr(out, '.') == NULL);
    /* one byte too many: cut, marker at the end, within the buffer */
    size_t n = cb_log_escape(in, 32, out, sizeof out);
    CHECK(n < sizeof out && n == strlen(out) && n >= ml && strcmp(out + n - ml, m) == 0);
    /* never split an escape or a character */
    char e[40];
    for (int i = 0; i < 40; i++) e[i] = i % 3 ? '\n' : 'x';
    n = cb_log_escape(e, sizeof e, out, sizeof out);
    CHECK(strcmp(out + n - ml, m) == 0);
    CHECK(out[n - ml - 1] != '\\'); /* the piece before the marker is whole */
    char u[60];
    for (int i = 0; i < 20; i++) memcpy(u + 3 * i, "\xE2\x82\xAC", 3);
    n = cb_log_escape(u, sizeof u, out, sizeof out);
    CHECK(strcmp(out + n - ml, m) == 0 && cb_utf8_valid(out, n) && (n - ml) % 3 == 0);
    CHECK(cb_log_escape(in, 10, out, ml) == 0 && out[0] == 0); /* no room for the marker: empty */
}

TEST(log_escape_random_bytes_are_one_clean_line) {
    uint32_t st = 12345;
    char in[300], out[512];
    for (int round = 0; round < 2000; round++) {
        size_t n = (size_t)(round % 300);
        for (size_t i = 0; i < n; i++) {
            st = st * 1103515245u + 12345u;
            in[i] = (char)(st >> 16);
        }
        size_t len = cb_log_escape(in, n, out, sizeof out);
        CHECK(len == strlen(out) && cb_utf8_valid(out, len));
        for (size_t i = 0; i < len; i++) CHECK_MSG((unsigned char)out[i] >= 0x20 && out[i] != 0x7f, "round %d", round);
    }
}

TEST(log_line_cannot_be_forged) {
    char path[] = "/tmp/cb-test-log.XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    CHECK(saved >= 0 && dup2(fd, 2) == 2);
    cb_log_set_level(CB_LOG_INFO);
    cb_log(CB_LOG_INFO, "id\nx", "doc '%s' done", "a\n2026-01-01T00:00:00.000Z info  cb-precompute forged\x1b[2J");
    char big[5000];
    memset(big, 'z', sizeof big - 1);
    big[sizeof big - 1] = 0;
    cb_log(CB_LOG_INFO, NULL, "long: %s", big);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    FILE *f = fdopen(fd, "r");
    CHECK(f);
    rewind(f);
    char line[8192];
    int lines = 0, forged = 0, marked = 0;
    while (fgets(line, sizeof line, f)) {
        lines++;
        if (strncmp(line, "2026-01-01T", 11) == 0) forged++;
        if (strstr(line, CB_LOG_TRUNCATED "\n")) marked++;
        CHECK(strchr(line, 0x1b) == NULL);
    }
    fclose(f);
    unlink(path);
    CHECK_MSG(lines == 2 && forged == 0 && marked == 1, "%d lines, %d forged, %d marked", lines, forged, marked);
}

int main(void) {
    RUN(set_err_formats_and_truncates);
    RUN(set_err_null_or_empty_buffer);
    RUN(now_ms_monotonic);
    RUN(utf8_valid_multibyte);
    RUN(utf8_truncated_sequence);
    RUN(utf8_overlong);
    RUN(utf8_lone_continuation);
    RUN(utf8_surrogate);
    RUN(utf8_repair_n_keeps_nul);
    RUN(utf8_encode);
    RUN(log_escape_controls_and_newlines);
    RUN(log_escape_utf8);
    RUN(log_escape_truncates_with_marker);
    RUN(log_escape_random_bytes_are_one_clean_line);
    RUN(log_line_cannot_be_forged);
    return test_summary();
}
