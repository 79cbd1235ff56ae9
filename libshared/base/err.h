/* err: the "char *err, size_t errlen" convention, formatted in one place.
 *
 * A function that can fail for a reason from outside (a file, a socket, a model) takes a caller's
 * buffer err of errlen bytes and writes one line into it on failure. err may be NULL or errlen 0
 * when the caller does not want the message. The message is truncated to errlen - 1 bytes and
 * always NUL-terminated (vsnprintf). Thread-safe (it touches only err), allocates nothing.
 */
#ifndef CB_ERR_H
#define CB_ERR_H

#include <stddef.h>

/* Formats fmt into err[0..errlen); does nothing when err is NULL or errlen is 0. */
void cb_set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
#endif
