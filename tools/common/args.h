/* args: strict parsing of numeric command-line values for the tools (tools/<dir>/, which all link it).
 * A value must be the whole string, in range, without overflow; false otherwise. */
#ifndef CB_TOOLS_ARGS_H
#define CB_TOOLS_ARGS_H
#include <stdbool.h>

bool parse_long(const char *s, long lo, long hi, long *out);
bool parse_float(const char *s, float lo, float hi, float *out);
#endif
