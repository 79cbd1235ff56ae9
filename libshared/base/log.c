#include "base/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

void cb_log(cb_log_level_t level, const char *req_id, const char *fmt, ...) {
    static const char *names[] = {"debug", "info", "warn", "error"};
    if (!cb_log_enabled(level)) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s%s%s%s %s\n", tm.tm_year + 1900,
            tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000L,
            names[level], s_component, req_id ? " [" : "", req_id ? req_id : "", req_id ? "]" : "", msg);
}
