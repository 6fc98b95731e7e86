/* testblocks.h: what the block-layer tests (test_mixed.c, test_ladder.c) share: blocks as
 * separate allocations, filled with random bytes and shuffled, so no test can lean on blocks
 * being adjacent or in order. Include after cmocka.h and testutil.h. */
#pragma once

#include <stdint.h>
#include <stdlib.h>

/* n blocks of `bytes` each, 64-byte aligned, random contents, in a random order. */
static inline uint8_t **blocks_alloc(uint32_t n, uint64_t bytes) {
        uint8_t **b = calloc(n ? n : 1, sizeof(*b));
        assert_non_null(b);
        for (uint32_t i = 0; i < n; i++) {
                b[i] = aligned_alloc(64, bytes);
                assert_non_null(b[i]);
                for (uint64_t j = 0; j < bytes; j++)
                        b[i][j] = (uint8_t)rng_next();
        }
        for (uint32_t i = n; i > 1; i--) {
                uint32_t j = rng_below(i);
                uint8_t *x = b[i - 1];
                b[i - 1] = b[j];
                b[j] = x;
        }
        return b;
}
