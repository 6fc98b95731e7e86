/* evalout.h: reading kvc-eval's output (one JSON object a line) in the tests; include it after
 * cmocka.h. */
#ifndef KVC_TESTS_EVALOUT_H
#define KVC_TESTS_EVALOUT_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The number after "key": in the line of configuration label ("own": the model alone's line of
 * the perplexity task); the test fails where either is missing. */
static inline double eval_field(const char *output, const char *label, const char *key) {
        char pat[128], kpat[64];
        snprintf(pat, sizeof(pat), strcmp(label, "own") == 0 ? "{\"own\":true" : "\"label\":\"%s\"", label);
        const char *line = strstr(output, pat);
        assert_non_null(line);
        snprintf(kpat, sizeof(kpat), "\"%s\":", key);
        const char *p = strstr(line, kpat), *end = strchr(line, '\n');
        assert_non_null(p);
        assert_true(!end || p < end);
        return strtod(p + strlen(kpat), NULL);
}

#endif
