/* test_quant.c - unit tests of kernels/quant.c and of the Q8 block layout.
 *
 * Owns: the INT8 round trip bound, zero rows, rounding of ties, clamping and non-finite input,
 * per-channel key scales against an outlier channel, filling a head of a Q8 block, and the Q8
 * layout (the f32/f16/bf16 layouts are test_compact.c's).
 *
 * The round trip bound. With s = max|x| / 127 and q = rint(x / s), |x - q s| <= s / 2 in exact
 * arithmetic. In float the quotient and the product are each rounded once (relative 2^-24 of a
 * value at most 127 s), so the test allows s * (1/2 + 254 * 2^-24), and checks that the largest
 * |x| maps to +-127 (nothing clips).
 */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"

#include "block.h"
#include "quant.h"

#define ROUND_TRIP_SLACK (0.5 + 254.0 / 16777216.0)

static float rng_uniform(float lo, float hi) {
        return lo + (hi - lo) * (float)((double)(rng_next() >> 11) / 9007199254740992.0);
}

/* |x - deq| within the bound for every element, and the element of largest magnitude on +-127. */
static void check_round_trip(const float *x, const float *scales, const int8_t *q, uint32_t n,
                             int per_element, const char *what) {
        for (uint32_t i = 0; i < n; i++) {
                float s = per_element ? scales[i] : scales[0];
                float deq = (float)q[i] * s;
                if (!(fabs((double)x[i] - deq) <= s * ROUND_TRIP_SLACK))
                        fail_msg("%s: x[%u] = %.9g dequantizes to %.9g (scale %.9g, code %d)", what, i,
                                 (double)x[i], (double)deq, (double)s, q[i]);
                assert_true(q[i] >= -127 && q[i] <= 127);
        }
}

static void quant_round_trip_stays_within_half_a_step(void **state) {
        static const float mags[] = { 1e-30f, 1e-6f, 0.01f, 1.0f, 3.7f, 1000.0f, 1e20f, 1e37f };
        float x[300], deq[300];
        int8_t q[300];
        (void)state;
        rng_state = 0x9e8;
        for (size_t mi = 0; mi < sizeof(mags) / sizeof(mags[0]); mi++) {
                for (int rep = 0; rep < 50; rep++) {
                        uint32_t n = 1 + rng_below(300);
                        for (uint32_t i = 0; i < n; i++)
                                x[i] = mags[mi] * rng_uniform(-1, 1) * (rng_below(4) ? 1.0f : 0.001f);
                        float s = quant_scale(x, n);
                        quant_encode_row(x, s, q, n);
                        check_round_trip(x, &s, q, n, 0, "row");
                        quant_decode_row(q, s, deq, n);
                        float m = 0;
                        uint32_t arg = 0;
                        for (uint32_t i = 0; i < n; i++) {
                                assert_true(deq[i] == (float)q[i] * s);
                                if (fabsf(x[i]) > m) {
                                        m = fabsf(x[i]);
                                        arg = i;
                                }
                        }
                        assert_true(s == m / 127.0f);
                        if (m > 0)
                                assert_int_equal(abs(q[arg]), 127);
                }
        }
}

static void quant_of_a_zero_row_is_a_zero_scale_and_zero_codes(void **state) {
        float x[64] = { 0 }, deq[64];
        int8_t q[64];
        (void)state;
        x[5] = -0.0f;
        memset(q, 0x55, sizeof(q));
        float s = quant_scale(x, 64);
        assert_true(s == 0.0f);
        quant_encode_row(x, s, q, 64);
        quant_decode_row(q, s, deq, 64);
        for (int i = 0; i < 64; i++) {
                assert_int_equal(q[i], 0);
                assert_true(deq[i] == 0.0f);
        }
        assert_true(quant_scale(x, 0) == 0.0f);
        /* a zero scale gives zero codes whatever the input */
        assert_int_equal(quant_one(5.0f, 0.0f), 0);
        assert_int_equal(quant_one(-5.0f, -1.0f), 0);
}

static void quant_rounds_ties_to_even(void **state) {
        (void)state;
        assert_int_equal(quant_one(0.5f, 1.0f), 0);
        assert_int_equal(quant_one(1.5f, 1.0f), 2);
        assert_int_equal(quant_one(2.5f, 1.0f), 2);
        assert_int_equal(quant_one(3.5f, 1.0f), 4);
        assert_int_equal(quant_one(-2.5f, 1.0f), -2);
        assert_int_equal(quant_one(-3.5f, 1.0f), -4);
        assert_int_equal(quant_one(2.4999998f, 1.0f), 2);
        assert_int_equal(quant_one(2.5000002f, 1.0f), 3);
        assert_int_equal(quant_one(126.5f, 1.0f), 126);
        assert_int_equal(quant_one(127.5f, 1.0f), 127); /* rounds to 128, clamped */
}

/* Out-of-range quotients clamp; NaN and infinities never reach an undefined conversion (UBSan
 * runs this too). */
static void quant_clamps_and_survives_non_finite_input(void **state) {
        (void)state;
        assert_int_equal(quant_one(1e30f, 1.0f), 127);
        assert_int_equal(quant_one(-1e30f, 1.0f), -127);
        assert_int_equal(quant_one(INFINITY, 1.0f), 127);
        assert_int_equal(quant_one(-INFINITY, 1.0f), -127);
        assert_int_equal(quant_one(NAN, 1.0f), 0);
        assert_int_equal(quant_one(1.0f, NAN), 0);
        assert_int_equal(quant_one(1.0f, INFINITY), 0);
        assert_int_equal(quant_one(INFINITY, INFINITY), 0);
        assert_int_equal(quant_one(FLT_MAX, FLT_TRUE_MIN), 127);
        const float x[] = { 1.0f, NAN, -2.0f };
        assert_true(quant_scale(x, 3) == 2.0f / 127.0f); /* NaN ignored */
        const float y[] = { 1.0f, -INFINITY };
        float s = quant_scale(y, 2);
        int8_t q[2];
        assert_true(isinf(s));
        quant_encode_row(y, s, q, 2);
        assert_true(q[0] == 0 && q[1] == 0);
        /* the smallest subnormal: its scale underflows to zero, the codes are zero */
        const float tiny[] = { FLT_TRUE_MIN, 0.0f };
        s = quant_scale(tiny, 2);
        quant_encode_row(tiny, s, q, 2);
        assert_true(q[0] == 0 || fabsf((float)q[0] * s - FLT_TRUE_MIN) <= FLT_TRUE_MIN);
}

/* Keys: one channel a thousand times larger than the others. Per-channel scales keep the small
 * channels as precise as if the outlier were not there; a per-row scale would not. */
static void quant_channel_scales_isolate_an_outlier_channel(void **state) {
        enum { N = 16, D = 64, OUT = 17 };
        float rows[N * D], scales[D];
        int8_t q[N * D];
        (void)state;
        rng_state = 0x07;
        for (uint32_t r = 0; r < N; r++)
                for (uint32_t c = 0; c < D; c++)
                        rows[r * D + c] = rng_uniform(-1, 1) * (c == OUT ? 1000.0f : 1.0f);
        quant_channel_scales(rows, N, D, scales);
        for (uint32_t c = 0; c < D; c++) {
                float m = 0;
                for (uint32_t r = 0; r < N; r++)
                        m = fmaxf(m, fabsf(rows[r * D + c]));
                assert_true(scales[c] == m / 127.0f);
                if (c != OUT)
                        assert_true(scales[c] <= 1.0f / 127.0f);
        }
        assert_true(scales[OUT] > 100.0f / 127.0f);
        for (uint32_t r = 0; r < N; r++) {
                quant_encode_row_channels(rows + r * D, scales, q + r * D, D);
                check_round_trip(rows + r * D, scales, q + r * D, D, 1, "channels");
                float deq[D];
                quant_decode_row_channels(q + r * D, scales, deq, D);
                for (uint32_t c = 0; c < D; c++) {
                        assert_true(deq[c] == (float)q[r * D + c] * scales[c]);
                        if (c != OUT)
                                assert_true(fabsf(deq[c] - rows[r * D + c]) <= 0.5f / 127.0f * 1.0001f);
                }
        }
        /* zero rows: all-zero scales */
        quant_channel_scales(rows, 0, D, scales);
        for (uint32_t c = 0; c < D; c++)
                assert_true(scales[c] == 0.0f);
}

static void q8_layout_places_scales_between_values_and_side_arrays(void **state) {
        (void)state;
        for (uint32_t T = 1; T <= 33; T += 8) {
                for (uint32_t H = 1; H <= 9; H += 4) {
                        for (uint32_t D = 1; D <= 257; D += 64) {
                                struct block_layout l;
                                assert_int_equal(block_layout_init(&l, T, H, D, BLOCK_DTYPE_Q8), 0);
                                assert_int_equal(l.elem_bytes, 1);
                                assert_int_equal(l.row_bytes, D);
                                const uint64_t off[] = { l.key_offset,    l.value_offset, l.kscale_offset,
                                                         l.vscale_offset, l.pos_offset,   l.sum_offset,
                                                         l.ema_offset,    l.last_offset,  l.logw_offset,
                                                         l.block_bytes };
                                const uint64_t size[] = { (uint64_t)H * T * D, (uint64_t)H * T * D,
                                                          (uint64_t)H * D * 4, (uint64_t)H * T * 4,
                                                          (uint64_t)H * T * 4, (uint64_t)H * T * 4,
                                                          (uint64_t)H * T * 4, (uint64_t)H * T * 4,
                                                          (uint64_t)H * T * 4 };
                                for (int a = 0; a < 10; a++)
                                        assert_int_equal(off[a] % 64, 0);
                                for (int a = 0; a < 9; a++) {
                                        assert_true(off[a] + size[a] <= off[a + 1]);
                                        assert_true(off[a + 1] - off[a] - size[a] < 64);
                                }
                                uint8_t *b = (uint8_t *)(uintptr_t)0x100000;
                                assert_ptr_equal(block_kscale(&l, b, H - 1) + D - 1,
                                                 (float *)(b + l.kscale_offset) + H * D - 1);
                                assert_ptr_equal(block_vscale(&l, b, H - 1, T - 1),
                                                 (float *)(b + l.vscale_offset) + H * T - 1);
                        }
                }
        }
}

/* Filling head 1 of 3: its scales are the channel maxima over exactly the filled rows, every
 * element is within half a step, and nothing else in the block changes. */
static void quant_block_fill_head_round_trips_and_touches_only_its_head(void **state) {
        enum { T = 16, H = 3, D = 40 };
        struct block_layout l;
        float keys[T * D], values[T * D], k[D], v[D];
        (void)state;
        rng_state = 0xf111;
        assert_int_equal(block_layout_init(&l, T, H, D, BLOCK_DTYPE_Q8), 0);
        uint8_t *b = aligned_alloc(64, l.block_bytes), *saved = malloc(l.block_bytes);
        assert_non_null(b);
        assert_non_null(saved);
        for (uint32_t n = 0; n <= T; n += 5) {
                for (uint64_t i = 0; i < l.block_bytes; i++)
                        b[i] = (uint8_t)rng_next();
                memcpy(saved, b, l.block_bytes);
                for (uint32_t i = 0; i < n * D; i++) {
                        keys[i] = rng_uniform(-2, 2) * (i % D == 7 ? 50.0f : 1.0f);
                        values[i] = rng_uniform(-1, 1) * (float)(1 + i / D);
                }
                assert_int_equal(quant_block_fill_head(&l, b, 1, keys, values, n), 0);
                const float *ks = block_kscale(&l, b, 1);
                for (uint32_t c = 0; c < D; c++) {
                        float m = 0;
                        for (uint32_t t = 0; t < n; t++)
                                m = fmaxf(m, fabsf(keys[t * D + c]));
                        assert_true(ks[c] == m / 127.0f);
                }
                for (uint32_t t = 0; t < n; t++) {
                        quant_block_load_key(&l, b, 1, t, k);
                        quant_block_load_value(&l, b, 1, t, v);
                        float vs = *block_vscale(&l, b, 1, t);
                        for (uint32_t c = 0; c < D; c++) {
                                assert_true(fabs((double)k[c] - keys[t * D + c]) <= ks[c] * ROUND_TRIP_SLACK);
                                assert_true(fabs((double)v[c] - values[t * D + c]) <= vs * ROUND_TRIP_SLACK);
                        }
                        assert_true(vs == quant_scale(values + t * D, D));
                }
                /* restore what head 1 may write and compare the whole block */
                for (uint32_t t = 0; t < n; t++) {
                        memcpy(block_key(&l, b, 1, t), block_key(&l, saved, 1, t), D);
                        memcpy(block_value(&l, b, 1, t), block_value(&l, saved, 1, t), D);
                        memcpy(block_vscale(&l, b, 1, t), block_vscale(&l, saved, 1, t), 4);
                }
                memcpy(block_kscale(&l, b, 1), block_kscale(&l, saved, 1), D * 4);
                assert_memory_equal(b, saved, l.block_bytes);
        }
        free(b);
        free(saved);
}

static void quant_block_fill_head_rejects_bad_arguments(void **state) {
        struct block_layout q8, f16;
        float rows[5 * 8] = { 0 };
        uint8_t *b;
        (void)state;
        assert_int_equal(block_layout_init(&q8, 4, 2, 8, BLOCK_DTYPE_Q8), 0);
        assert_int_equal(block_layout_init(&f16, 4, 2, 8, BLOCK_DTYPE_F16), 0);
        b = calloc(1, q8.block_bytes > f16.block_bytes ? q8.block_bytes : f16.block_bytes);
        assert_non_null(b);
        assert_int_equal(quant_block_fill_head(&f16, b, 0, rows, rows, 1), -EINVAL);
        assert_int_equal(quant_block_fill_head(&q8, b, 2, rows, rows, 1), -EINVAL);
        assert_int_equal(quant_block_fill_head(&q8, b, 0, rows, rows, 5), -EINVAL);
        for (uint64_t i = 0; i < q8.block_bytes; i++)
                assert_int_equal(b[i], 0);
        assert_int_equal(quant_block_fill_head(&q8, b, 1, rows, rows, 4), 0);
        free(b);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(quant_round_trip_stays_within_half_a_step),
                cmocka_unit_test(quant_of_a_zero_row_is_a_zero_scale_and_zero_codes),
                cmocka_unit_test(quant_rounds_ties_to_even),
                cmocka_unit_test(quant_clamps_and_survives_non_finite_input),
                cmocka_unit_test(quant_channel_scales_isolate_an_outlier_channel),
                cmocka_unit_test(q8_layout_places_scales_between_values_and_side_arrays),
                cmocka_unit_test(quant_block_fill_head_round_trips_and_touches_only_its_head),
                cmocka_unit_test(quant_block_fill_head_rejects_bad_arguments),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
