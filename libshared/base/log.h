/* log: one line per event on stderr, "<time> <level> <component> [<request id>] message".
 * Level from CB_LOG_LEVEL (debug|info|warn|error), default info. Thread-safe (one fprintf per line).
 *
 * One event is one line, whatever the text holds: the request id and the formatted message go through
 * cb_log_escape, so a value from outside (a doc_id, a file name, a peer's error message) can never start
 * a forged line or drive the terminal. A message longer than CB_LOG_MAX_MSG bytes (after escaping) is
 * cut at a character boundary and ends with CB_LOG_TRUNCATED.
 */
#ifndef CB_LOG_H
#define CB_LOG_H

#include <stddef.h>

typedef enum { CB_LOG_DEBUG = 0, CB_LOG_INFO, CB_LOG_WARN, CB_LOG_ERROR } cb_log_level_t;

#define CB_LOG_MAX_MSG 2048              /* bytes of one line's escaped message, marker included */
#define CB_LOG_TRUNCATED "...[truncated]" /* ends a message that was cut */

/* Sets the component name printed on every line (e.g. "cb-blend"); the string must outlive the process. */
void cb_log_set_component(const char *name);
void cb_log_set_level(cb_log_level_t level);
int cb_log_enabled(cb_log_level_t level);
/* req_id may be NULL. */
void cb_log(cb_log_level_t level, const char *req_id, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Escapes in[0..len) (in may be NULL when len is 0) into out[cap] (cap >= sizeof CB_LOG_TRUNCATED),
 * always NUL-terminated, and returns the length written. Printable ASCII and well-formed UTF-8 stay as
 * they are; a backslash becomes "\\"; newline, carriage return and tab become "\n", "\r", "\t"; every
 * other control byte (0x00-0x1f, 0x7f) and every byte that does not start a well-formed UTF-8 sequence
 * becomes "\xHH"; the C1 controls (U+0080-U+009F), the line and paragraph separators (U+2028, U+2029)
 * and the bidirectional overrides (U+202A-U+202E, U+2066-U+2069) become "\u{HHHH}". When the result
 * does not fit, it is cut before the first escape or character that would not fit together with
 * CB_LOG_TRUNCATED, which then ends it. Pure; thread-safe. */
size_t cb_log_escape(const char *in, size_t len, char *out, size_t cap);

#define CB_DEBUG(...) cb_log(CB_LOG_DEBUG, NULL, __VA_ARGS__)
#define CB_INFO(...) cb_log(CB_LOG_INFO, NULL, __VA_ARGS__)
#define CB_WARN(...) cb_log(CB_LOG_WARN, NULL, __VA_ARGS__)
#define CB_ERROR(...) cb_log(CB_LOG_ERROR, NULL, __VA_ARGS__)
#endif
