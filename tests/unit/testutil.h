/* testutil.h: what several unit tests share: a seeded splitmix64 generator, so every random case
 * is the same on every run and every machine. Set rng_state to seed it. */
#pragma once

#include <stdint.h>

static uint64_t rng_state;

static inline uint64_t rng_next(void) {
        uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

/* Uniform in [0, n), n > 0. */
static inline uint32_t rng_below(uint32_t n) {
        return (uint32_t)(rng_next() % n);
}
