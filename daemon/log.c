/* log.c: stderr lines with <N> prefixes. One write(2) per line so lines never interleave. */
#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int max_level = LOG_INFO;

void log_set_level(int level) {
        max_level = level;
}

int log_get_level(void) {
        return max_level;
}

int log_parse_level(const char *name) {
        static const char *const names[] = { "emerg",   "alert",  "crit", "error",
                                             "warning", "notice", "info", "debug" };
        if (name[0] >= '0' && name[0] <= '7' && name[1] == '\0')
                return name[0] - '0';
        for (int i = 0; i < 8; i++)
                if (strcmp(name, names[i]) == 0)
                        return i;
        if (strcmp(name, "err") == 0)
                return LOG_ERR;
        return -EINVAL;
}

void log_at(int priority, const char *fmt, ...) {
        if (priority > max_level)
                return;
        char line[1024];
        int n = snprintf(line, sizeof(line), "<%d>", priority);
        va_list ap;
        va_start(ap, fmt);
        int m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
        va_end(ap);
        size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
        if (len > sizeof(line) - 2)
                len = sizeof(line) - 2;
        line[len++] = '\n';
        int saved = errno;
        ssize_t w = write(STDERR_FILENO, line, len);
        (void)w;
        errno = saved;
}
