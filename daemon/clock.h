/* clock.h: kvcd's one clock. Every time in kvcd is microseconds of CLOCK_MONOTONIC, in a
 * uint64_t: deadlines and latencies only, never wall-clock time, so that a clock step cannot fire
 * or hold back a deadline (unix_usec() is the one exception, for display). A header of its own so that a file
 * needing the time does not include the daemon's whole world (kvcd.h). */
#pragma once

#include <stdint.h>
#include <time.h>

static inline uint64_t now_usec(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Wall-clock microseconds since the epoch: only for what kvcd shows (its start time in the
 * metrics), never for a deadline. */
static inline uint64_t unix_usec(void) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}
