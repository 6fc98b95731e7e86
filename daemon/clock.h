/* clock.h: kvcd's one clock. Every time in kvcd is microseconds of CLOCK_MONOTONIC, in a
 * uint64_t: deadlines and latencies only, never wall-clock time, so that a clock step cannot fire
 * or hold back a deadline. A header of its own so that a file needing the time does not include
 * the daemon's whole world (kvcd.h). */
#pragma once

#include <stdint.h>
#include <time.h>

static inline uint64_t now_usec(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}
