/* args: see args.h. */
#include "args.h"

#include <errno.h>
#include <stdlib.h>

bool parse_long(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!*s || *end || errno || v < lo || v > hi) return false;
    *out = v;
    return true;
}

bool parse_float(const char *s, float lo, float hi, float *out) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (!*s || *end || errno || !(v >= lo && v <= hi)) return false;
    *out = v;
    return true;
}
