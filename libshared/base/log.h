/* log: one line per event on stderr, "<time> <level> <component> [<request id>] message".
 * Level from CB_LOG_LEVEL (debug|info|warn|error), default info. Thread-safe (one fprintf per line). */
#ifndef CB_LOG_H
#define CB_LOG_H

typedef enum { CB_LOG_DEBUG = 0, CB_LOG_INFO, CB_LOG_WARN, CB_LOG_ERROR } cb_log_level_t;

/* Sets the component name printed on every line (e.g. "cb-blend"); the string must outlive the process. */
void cb_log_set_component(const char *name);
void cb_log_set_level(cb_log_level_t level);
int cb_log_enabled(cb_log_level_t level);
/* req_id may be NULL. */
void cb_log(cb_log_level_t level, const char *req_id, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define CB_DEBUG(...) cb_log(CB_LOG_DEBUG, NULL, __VA_ARGS__)
#define CB_INFO(...) cb_log(CB_LOG_INFO, NULL, __VA_ARGS__)
#define CB_WARN(...) cb_log(CB_LOG_WARN, NULL, __VA_ARGS__)
#define CB_ERROR(...) cb_log(CB_LOG_ERROR, NULL, __VA_ARGS__)
#endif
