/* utf8: well-formed UTF-8 checked, measured, repaired and encoded in one place.
 *
 * "Well-formed" is RFC 3629 / Unicode Table 3-7: 1 to 4 bytes, no overlong forms (C0, C1, E0 80..9F,
 * F0 80..8F), no UTF-16 surrogates (ED A0..BF), nothing above U+10FFFF (F4 90.., F5..FF). A NUL byte
 * is a well-formed one-byte sequence (callers that hand the text on as a C string say what they do
 * with one). Repair follows Python's decode(errors="replace") on the byte level: every byte that does
 * not start a well-formed sequence becomes U+FFFD and decoding resumes at the next byte, so a character
 * cut at the end of a generation becomes one U+FFFD per byte.
 *
 * Pure functions of their arguments, thread-safe. The repair functions return a malloc'd copy the
 * caller frees, or NULL when out of memory (at most 3 bytes out per byte in, plus the NUL).
 * The tokenizer's lenient llama.cpp-style decoder is deliberately not here (it accepts overlongs).
 */
#ifndef CB_UTF8_H
#define CB_UTF8_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* U+FFFD REPLACEMENT CHARACTER as UTF-8 (3 bytes). */
#define CB_UTF8_REPLACEMENT "\xEF\xBF\xBD"

/* Length of the sequence the lead byte c announces: 1 (ASCII, NUL included), 2, 3 or 4; 0 for a byte
 * no well-formed sequence starts with (a continuation byte 80..BF, C0, C1, F5..FF). It says nothing
 * about the bytes after c: cb_utf8_seq_len checks those. */
size_t cb_utf8_lead_len(unsigned char c);

/* Length of the well-formed sequence at p, which has n bytes left: 1..4, or 0 when the bytes at p are
 * not one (invalid lead, a sequence cut by the end of the n bytes, a bad continuation byte, an overlong
 * form, a surrogate, above U+10FFFF). n == 0 gives 0. */
size_t cb_utf8_seq_len(const unsigned char *p, size_t n);

/* True when s[0..len) is well-formed UTF-8 (embedded NULs allowed). s may be NULL when len is 0. */
bool cb_utf8_valid(const char *s, size_t len);

/* Copy of the C string s with every byte that does not start a well-formed sequence replaced by
 * U+FFFD; the result is well-formed UTF-8 without NULs. s must not be NULL. Caller frees; NULL when
 * out of memory. */
char *cb_utf8_repair(const char *s);

/* The same for the bytes s[0..n), which may contain NULs (kept as they are, so the result may too).
 * The copy is NUL-terminated; *out_len (when out_len is not NULL) gets its length without that NUL.
 * s may be NULL when n is 0. Caller frees; NULL when out of memory or n is absurd (3n+1 overflows). */
char *cb_utf8_repair_n(const char *s, size_t n, size_t *out_len);

/* Writes the UTF-8 of code point cp (<= 0x10FFFF; a surrogate is encoded as it is) into out, which has
 * room for 4 bytes; returns the bytes written (1..4). No NUL is written. */
size_t cb_utf8_encode(uint32_t cp, unsigned char *out);
#endif
