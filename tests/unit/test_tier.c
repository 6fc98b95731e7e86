/* test_tier.c - unit tests of kernels/lloyd.c (the low tiers' quantizer) and kernels/tier.c (the
 * table of tiers and its layouts).
 *
 * Owns: the codebooks, the rotation (orthogonal, its own inverse's transpose, deterministic per
 * seed, layer and head), the round-trip error of every low tier against its stated bounds (the
 * expected one for Gaussian-like rows, random, with outlier channels, constant; the worst case
 * |y - y'| <= |y| on rows built to defeat the rotation), the refusal of NaN and infinities, the
 * bits per value each layout costs, and each row's fused loops against its own load functions.
 *
 * The expected-error bound. For coordinates that are N(0, sigma^2) the Lloyd-Max codebook's
 * mean-square error is D_b sigma^2 (D_4 = 0.0095, D_3 = 0.0345, D_2 = 0.1175); the least-squares
 * scale can only lower it. Rotated rows of 64 coordinates are close to Gaussian but not exactly
 * (and sigma is estimated from the row), so the test allows 1.25 D_b on the mean over 2,000 rows.
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
#include "lloyd.h"
#include "tier.h"

static const double distortion[5] = { 0, 0, 0.117481848, 0.034547761, 0.009501008 };

static double rng_gauss(void) {
        double u = ((double)(rng_next() >> 11) + 0.5) / 9007199254740992.0;
        double v = (double)(rng_next() >> 11) / 9007199254740992.0;
        return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static void lloyd_codebooks_are_symmetric_and_ascending(void **state) {
        (void)state;
        for (uint32_t b = 2; b <= 4; b++) {
                const float *c = lloyd_codebook(b);
                uint32_t L = 1u << b;
                assert_non_null(c);
                for (uint32_t k = 0; k < L; k++) {
                        assert_true(c[k] == -c[L - 1 - k]);
                        if (k)
                                assert_true(c[k] > c[k - 1]);
                }
        }
        assert_null(lloyd_codebook(1));
        assert_null(lloyd_codebook(5));
        assert_null(lloyd_codebook(8));
}

static void lloyd_rotation_is_orthogonal_and_undone_by_unrotate(void **state) {
        float signs[256], x[256], y[256];
        (void)state;
        rng_state = 11;
        for (uint32_t d = 8; d <= 256; d *= 2) {
                lloyd_signs(42, 3, 1, d, signs);
                for (int rep = 0; rep < 20; rep++) {
                        double n0 = 0, n1 = 0, err = 0;
                        for (uint32_t i = 0; i < d; i++) {
                                x[i] = (float)rng_gauss() * (i == 5 ? 50.0f : 1.0f);
                                y[i] = x[i];
                                n0 += (double)x[i] * x[i];
                        }
                        lloyd_rotate(signs, y, d);
                        for (uint32_t i = 0; i < d; i++)
                                n1 += (double)y[i] * y[i];
                        assert_true(fabs(n1 - n0) <= 1e-5 * n0);
                        lloyd_unrotate(signs, y, d);
                        for (uint32_t i = 0; i < d; i++)
                                err = fmax(err, fabs((double)y[i] - x[i]));
                        assert_true(err <= 1e-5 * sqrt(n0));
                }
        }
}

static void lloyd_signs_depend_on_seed_layer_and_head_only(void **state) {
        float a[64], b[64], c[64];
        (void)state;
        lloyd_signs(7, 2, 1, 64, a);
        lloyd_signs(7, 2, 1, 64, b);
        assert_memory_equal(a, b, sizeof(a));
        int plus = 0;
        for (int i = 0; i < 64; i++) {
                assert_true(a[i] == 1.0f || a[i] == -1.0f);
                plus += a[i] > 0;
        }
        assert_true(plus > 16 && plus < 48);
        lloyd_signs(7, 2, 2, 64, c);
        assert_memory_not_equal(a, c, sizeof(a));
        lloyd_signs(7, 3, 1, 64, c);
        assert_memory_not_equal(a, c, sizeof(a));
        lloyd_signs(8, 2, 1, 64, c);
        assert_memory_not_equal(a, c, sizeof(a));
}

/* Round trip of one row through rotation and codes: returns |x - x'|^2 / |x|^2. */
static double round_trip(const float *signs, const float *x, uint32_t d, uint32_t bits) {
        float y[256], back[256];
        uint8_t codes[128];
        float scale;
        memcpy(y, x, d * sizeof(float));
        lloyd_rotate(signs, y, d);
        assert_int_equal(lloyd_encode_row(y, d, bits, codes, &scale), 0);
        lloyd_decode_row(codes, scale, d, bits, back);
        double e = 0, n = 0, ey = 0;
        for (uint32_t i = 0; i < d; i++) {
                ey += ((double)y[i] - back[i]) * ((double)y[i] - back[i]);
                n += (double)y[i] * y[i];
        }
        assert_true(ey <= n * (1 + 1e-6)); /* the worst case: never amplified */
        lloyd_unrotate(signs, back, d);
        for (uint32_t i = 0; i < d; i++)
                e += ((double)x[i] - back[i]) * ((double)x[i] - back[i]);
        return n > 0 ? e / n : 0;
}

enum row_kind { ROW_GAUSS, ROW_OUTLIER_CHANNELS, ROW_CONSTANT, ROW_HEAVY_TAILED };

static void make_row(enum row_kind kind, float *x, uint32_t d) {
        double c = rng_gauss();
        for (uint32_t i = 0; i < d; i++) {
                switch (kind) {
                case ROW_GAUSS: x[i] = (float)rng_gauss(); break;
                case ROW_OUTLIER_CHANNELS: x[i] = (float)rng_gauss() * (i % 17 == 3 ? 40.0f : 1.0f); break;
                case ROW_CONSTANT: x[i] = (float)c; break;
                case ROW_HEAVY_TAILED: x[i] = (float)(rng_gauss() / (0.2 + fabs(rng_gauss()))); break;
                }
        }
}

static void lloyd_round_trip_meets_the_expected_bound_on_every_kind_of_row(void **state) {
        float signs[64], x[64];
        (void)state;
        rng_state = 2024;
        for (uint32_t bits = 2; bits <= 4; bits++) {
                for (int kind = ROW_GAUSS; kind <= ROW_HEAVY_TAILED; kind++) {
                        double sum = 0;
                        for (int rep = 0; rep < 2000; rep++) {
                                lloyd_signs(rep, rep % 30, rep % 3, 64, signs);
                                make_row((enum row_kind)kind, x, 64);
                                sum += round_trip(signs, x, 64, bits);
                        }
                        double mean = sum / 2000;
                        if (!(mean <= 1.25 * distortion[bits]))
                                fail_msg("%u bits, row kind %d: relative MSE %.5f above 1.25 x %.5f", bits,
                                         kind, mean, distortion[bits]);
                }
        }
}

/* A row whose rotation is one coordinate: the rotation does not help, the worst case holds. */
static void lloyd_never_amplifies_a_row_built_to_defeat_the_rotation(void **state) {
        float signs[64], x[64];
        (void)state;
        lloyd_signs(5, 0, 0, 64, signs);
        for (uint32_t bits = 2; bits <= 4; bits++)
                for (uint32_t j = 0; j < 64; j += 9) {
                        memset(x, 0, sizeof(x));
                        x[j] = 3.0f;
                        lloyd_unrotate(signs, x, 64); /* x = R^T e_j: R x = e_j */
                        double e = round_trip(signs, x, 64, bits);
                        assert_true(e <= 1.0 + 1e-6);
                }
}

static void lloyd_refuses_nan_and_infinity_and_stores_zeros(void **state) {
        float y[64], back[64], scale = 1.0f;
        uint8_t codes[32];
        (void)state;
        for (int bad = 0; bad < 3; bad++) {
                for (int i = 0; i < 64; i++)
                        y[i] = (float)i - 30.0f;
                y[17] = bad == 0 ? NAN : bad == 1 ? INFINITY : -INFINITY;
                memset(codes, 0xff, sizeof(codes));
                assert_int_equal(lloyd_encode_row(y, 64, 4, codes, &scale), -EINVAL);
                assert_true(scale == 0.0f);
                lloyd_decode_row(codes, scale, 64, 4, back);
                for (int i = 0; i < 64; i++)
                        assert_true(back[i] == 0.0f);
        }
        memset(y, 0, sizeof(y));
        assert_int_equal(lloyd_encode_row(y, 64, 3, codes, &scale), 0);
        assert_true(scale == 0.0f);
}

/* Code i sits in bits [i b, i b + b) of the row, read little-endian, nothing is written past the
 * row, and the row reads back as scale * centroid[code_i]. */
static void lloyd_packs_codes_little_endian(void **state) {
        float y[64], back[64], scale;
        uint8_t buf[32 + 8];
        (void)state;
        rng_state = 5;
        for (uint32_t bits = 2; bits <= 4; bits++) {
                const float *c = lloyd_codebook(bits);
                uint32_t L = 1u << bits, seen = 0;
                for (int i = 0; i < 64; i++)
                        y[i] = (float)rng_gauss();
                memset(buf, 0, sizeof(buf));
                assert_int_equal(lloyd_encode_row(y, 64, bits, buf, &scale), 0);
                lloyd_decode_row(buf, scale, 64, bits, back);
                for (uint32_t i = 0; i < 64; i++) {
                        uint64_t word = 0;
                        for (int k = 0; k < 8; k++)
                                word |= (uint64_t)buf[i * bits / 8 + k] << (8 * k);
                        uint32_t code = (uint32_t)(word >> (i * bits % 8)) & (L - 1);
                        assert_int_equal(lloyd_code(buf, i, bits), code);
                        assert_true(back[i] == scale * c[code]);
                        assert_true((back[i] > 0) == (y[i] > 0) || y[i] == 0); /* codes keep the sign */
                        seen |= 1u << code;
                }
                for (uint32_t k = 64 * bits / 8; k < sizeof(buf); k++)
                        assert_int_equal(buf[k], 0); /* nothing past the row */
                if (bits <= 3)
                        assert_int_equal(seen, (1u << L) - 1); /* 64 Gaussian values use every level */
        }
}

static void tier_layouts_cost_what_tier_h_states(void **state) {
        static const struct {
                enum block_dtype dt;
                double bits;
        } want[] = { { BLOCK_DTYPE_F32, 33.25 }, { BLOCK_DTYPE_F16, 17.25 }, { BLOCK_DTYPE_BF16, 17.25 },
                     { BLOCK_DTYPE_Q8, 10.5 },   { BLOCK_DTYPE_Q4, 5.75 },   { BLOCK_DTYPE_Q3, 4.75 },
                     { BLOCK_DTYPE_Q2, 3.75 } };
        (void)state;
        for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
                struct block_layout l;
                assert_int_equal(block_layout_init(&l, 16, 3, 64, want[i].dt), 0);
                const struct tier_row *row = tier_row(want[i].dt);
                assert_non_null(row);
                assert_ptr_equal(tier_by_name(row->name), row);
                if (fabs(tier_bits_per_value(&l) - want[i].bits) > 1e-9)
                        fail_msg("%s: %.4f bits per value, tier.h says %.2f", row->name,
                                 tier_bits_per_value(&l), want[i].bits);
                assert_true(l.block_bytes % 64 == 0);
        }
        struct block_layout l;
        assert_int_equal(block_layout_init(&l, 16, 3, 48, BLOCK_DTYPE_Q4), -EINVAL); /* not a power of two */
        assert_int_equal(block_layout_init(&l, 16, 3, 4, BLOCK_DTYPE_Q3), -EINVAL);
        assert_int_equal(block_layout_init(&l, 16, 3, 48, BLOCK_DTYPE_Q8), 0);
        assert_null(tier_by_name("q5"));
        assert_null(tier_row((enum block_dtype)99));
}

/* Each row's fused loops compute what its load functions read: dots against q . load_key in double,
 * and the accumulation against sum w v. */
static void tier_rows_fused_loops_agree_with_their_loads(void **state) {
        static const enum block_dtype dts[] = { BLOCK_DTYPE_F32, BLOCK_DTYPE_F16, BLOCK_DTYPE_BF16,
                                                BLOCK_DTYPE_Q8,  BLOCK_DTYPE_Q4,  BLOCK_DTYPE_Q3,
                                                BLOCK_DTYPE_Q2 };
        enum { T = 16, H = 2, D = 64, G = 3 };
        (void)state;
        rng_state = 99;
        for (size_t i = 0; i < sizeof(dts) / sizeof(dts[0]); i++) {
                struct block_layout l;
                assert_int_equal(block_layout_init(&l, T, H, D, dts[i]), 0);
                const struct tier_row *row = tier_row(dts[i]);
                uint8_t *block = calloc(1, l.block_bytes);
                float keys[T * D], values[T * D], q[G * D], scratch[G * D + D], w[G * T], acc[G * D],
                        rowbuf[D];
                double dots[G * T];
                for (uint32_t h = 0; h < H; h++) {
                        for (int j = 0; j < T * D; j++) {
                                keys[j] = (float)rng_gauss() * (j % D == 7 ? 20.0f : 1.0f);
                                values[j] = (float)rng_gauss();
                        }
                        assert_int_equal(row->fill_head(&l, block, h, keys, values, T), 0);
                }
                for (int j = 0; j < G * D; j++)
                        q[j] = (float)rng_gauss();
                for (int j = 0; j < G * T; j++)
                        w[j] = (float)(rng_next() % 1000) / 1000.0f;
                for (uint32_t h = 0; h < H; h++) {
                        uint32_t cnt = T - 3;
                        row->dots(&l, block, h, cnt, q, G, scratch, dots);
                        memset(acc, 0, sizeof(acc));
                        row->accumulate(&l, block, h, cnt, w, T, G, rowbuf, acc);
                        double want_acc[G * D] = { 0 };
                        for (uint32_t t = 0; t < cnt; t++) {
                                float k[D], v[D];
                                row->load_key(&l, block, h, t, k);
                                row->load_value(&l, block, h, t, v);
                                for (int r = 0; r < G; r++) {
                                        double dot = 0, mag = 0;
                                        for (int c = 0; c < D; c++) {
                                                dot += (double)q[r * D + c] * k[c];
                                                mag += fabs((double)q[r * D + c] * k[c]);
                                                want_acc[r * D + c] += (double)w[r * T + t] * v[c];
                                        }
                                        assert_true(fabs(dots[r * cnt + t] - dot) <= 1e-6 * mag + 1e-30);
                                }
                        }
                        for (int j = 0; j < G * D; j++)
                                assert_true(fabs(acc[j] - want_acc[j]) <= 1e-5 * (1 + fabs(want_acc[j])) * 4);
                }
                free(block);
        }
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(lloyd_codebooks_are_symmetric_and_ascending),
                cmocka_unit_test(lloyd_rotation_is_orthogonal_and_undone_by_unrotate),
                cmocka_unit_test(lloyd_signs_depend_on_seed_layer_and_head_only),
                cmocka_unit_test(lloyd_round_trip_meets_the_expected_bound_on_every_kind_of_row),
                cmocka_unit_test(lloyd_never_amplifies_a_row_built_to_defeat_the_rotation),
                cmocka_unit_test(lloyd_refuses_nan_and_infinity_and_stores_zeros),
                cmocka_unit_test(lloyd_packs_codes_little_endian),
                cmocka_unit_test(tier_layouts_cost_what_tier_h_states),
                cmocka_unit_test(tier_rows_fused_loops_agree_with_their_loads),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
