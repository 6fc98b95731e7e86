/* log.h: kvcd's logging: one line per event on stderr, with the <N> priority prefix journald
 * understands (sd-daemon(3)), so the same lines read well in a terminal and in the journal.
 * Only kvcd logs; its libraries report through return codes. */
#pragma once

#include <syslog.h>

/* LOG_ERR .. LOG_DEBUG; lines above the level are dropped. */
void log_set_level(int level);
int log_get_level(void);
/* "error", "warning", "notice", "info", "debug" (or a digit): -EINVAL when unknown. */
int log_parse_level(const char *name);

void log_at(int priority, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define log_error(...)   log_at(LOG_ERR, __VA_ARGS__)
#define log_warning(...) log_at(LOG_WARNING, __VA_ARGS__)
#define log_notice(...)  log_at(LOG_NOTICE, __VA_ARGS__)
#define log_info(...)    log_at(LOG_INFO, __VA_ARGS__)
#define log_debug(...)   log_at(LOG_DEBUG, __VA_ARGS__)
