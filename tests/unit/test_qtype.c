/* test_qtype.c - unit tests of client/engine/qtype.c (the tensor types' table, dequantize, dot) and
 * client/engine/matmul.c (the exact and fast matrix-vectors products).
 *
 * Owns: every computing row's dequantize on hand-built blocks of known values; f16 and bf16 to f32
 * for every one of the 65,536 bit patterns; dot as the lane-ordered sum of dequantized products
 * (bit for bit against a transcription of qtype.h's order, and within its rounding bound of the
 * exact sum); the activation quantization's round trip (codes those of roundf, halves away from
 * zero); the fast product within the bound that 8-bit activations imply; the exact product equal
 * to dot; batches (whole, single, and of 4, 7, 5, 3 vectors: every chunk and tile of the AVX2
 * kernels), row ranges and the AVX2 and AVX-512 VNNI kernels equal to single products, one full
 * call and the plain kernels, bit for bit; every fast kernel equal to a transcription of matmul.h's order, with
 * subnormal and zero scales too; and the products matmul_rows refuses. The real tensors of
 * SmolLM2 are tests/engine/dequant.sh's.
 *
 * The fast path's bound. With u = 2^-24, activation block k has scale d_k and codes q_j with
 * |x_j - q_j d_k| <= d_k (1/2 + 254 u) (the rounding of x_j / d_k adds at most 2 u |x_j| / d_k <=
 * 254 u, as test_quant.c derives for kernels/quant.c). In exact arithmetic the fast result is
 * sum_j w_j q_j d_k, so it differs from sum_j w_j x_j by at most
 *     Q = sum_k d_k (1/2 + 254 u) sum_{j in k} |w_j|.
 * On top of that come f32 roundings, each at most u times the magnitude it rounds: the exact path's
 * (n / 8 + 3 for the lanes and the tree, 1 for each product), the dequantization's (2: d q, + m),
 * the fast path's terms (2 roundings each: d_w d_x and its product with a lane sum, or q4_1's
 * m (d_x sum); their operands are bounded by the weight components |d q| + |m| times
 * |q_j d_k| <= |x_j| + d_k) and its eight lanes, each a running sum of n / 32 products and
 * n / 256 minimum terms, then the 3 adds of the tree. With M_k = max over block k of
 * |d code| + |m| and A = sum_k M_k sum_{j in k} (|x_j| + d_k), the test allows
 * Q + (n / 32 + n / 256 + n / 8 + 10) u A, times 1.01 for second-order terms. Q is loose for any
 * one row (it adds worst cases), so the test also compares the fast result with the row times the
 * rounded activations q_j d_k in double, within (n / 32 + n / 256 + 10) u A: f32 rounding only.
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

#include "cpu.h"
#include "matmul.h"
#include "qtype.h"

#define U 0x1p-24

static const uint32_t computing[] = { QTYPE_F32,  QTYPE_F16,  QTYPE_BF16, QTYPE_Q8_0,
                                      QTYPE_Q4_0, QTYPE_Q4_1, QTYPE_Q4_K, QTYPE_Q6_K };
#define N_COMPUTING (sizeof(computing) / sizeof(computing[0]))

static void put_u16(uint8_t *p, uint16_t v) {
        memcpy(p, &v, sizeof(v));
}

static float rng_uniform(float lo, float hi) {
        return lo + (hi - lo) * (float)((double)(rng_next() >> 11) / 9007199254740992.0);
}

/* A half of magnitude in [2^-10, 2^2), random sign: scales of a plausible block. */
static uint16_t rng_half_scale(void) {
        return (uint16_t)((rng_below(2) << 15) | ((5u << 10) + rng_below(12u << 10)));
}

/* n random elements of type t: scales from rng_half_scale, codes uniform over all bit patterns. */
static void fill_random(const struct qtype *t, uint8_t *dst, size_t n) {
        size_t bytes = qtype_row_bytes(t, n);

        for (size_t i = 0; i < bytes; i++)
                dst[i] = (uint8_t)rng_next();
        switch (t->id) {
        case QTYPE_F32:
                for (size_t i = 0; i < n; i++) {
                        float f = rng_uniform(-2, 2);
                        memcpy(dst + 4 * i, &f, 4);
                }
                break;
        case QTYPE_F16:
                for (size_t i = 0; i < n; i++)
                        put_u16(dst + 2 * i, rng_half_scale());
                break;
        case QTYPE_BF16:
                for (size_t i = 0; i < n; i++)
                        put_u16(dst + 2 * i,
                                (uint16_t)((rng_below(2) << 15) | (0x3c00u + rng_below(0x500u))));
                break;
        case QTYPE_Q4_K: /* f16 d and dmin first; the 6-bit scales and the nibbles any bits */
                for (size_t b = 0; b < n / 256; b++) {
                        put_u16(dst + b * t->bytes, rng_half_scale());
                        put_u16(dst + b * t->bytes + 2, rng_half_scale());
                }
                break;
        case QTYPE_Q6_K: /* f16 d last */
                for (size_t b = 0; b < n / 256; b++)
                        put_u16(dst + b * t->bytes + 208, rng_half_scale());
                break;
        case QTYPE_Q4_1:
                for (size_t b = 0; b < n / 32; b++)
                        put_u16(dst + b * t->bytes + 2, rng_half_scale());
                /* fall through */
        default:
                for (size_t b = 0; b < n / 32; b++)
                        put_u16(dst + b * t->bytes, rng_half_scale());
        }
}

static void dequantize_equals(uint32_t id, const uint8_t *src, const float *want, size_t n) {
        const struct qtype *t = qtype_of(id);
        float got[64];

        assert_non_null(t);
        assert_true(n <= 64);
        t->dequantize(src, got, n);
        for (size_t i = 0; i < n; i++)
                if (memcmp(&got[i], &want[i], sizeof(float)))
                        fail_msg("%s element %zu: %.9g, want %.9g", t->name, i, (double)got[i],
                                 (double)want[i]);
}

static void dequantize_gives_known_values_for_every_row(void **state) {
        uint8_t b[2 * 34];
        float want[64];

        (void)state;
        /* f32: the bytes themselves */
        const float f32[] = { 1.5f, -2.25f, 0.0f, 3e38f, -1e-40f };
        dequantize_equals(QTYPE_F32, (const uint8_t *)f32, f32, 5);

        /* f16: one, -two, the smallest and largest subnormal, the largest normal, -0, inf, 1/3 */
        const uint16_t h[] = { 0x3c00, 0xc000, 0x0001, 0x03ff, 0x7bff, 0x8000, 0x7c00, 0x3555 };
        const float hv[] = { 1.0f,     -2.0f, 0x1p-24f, 1023 * 0x1p-24f,
                             65504.0f, -0.0f, INFINITY, 0.333251953125f };
        for (int i = 0; i < 8; i++)
                put_u16(b + 2 * i, h[i]);
        dequantize_equals(QTYPE_F16, b, hv, 8);

        /* bf16: one, -three, inf, the smallest subnormal */
        const uint16_t bf[] = { 0x3f80, 0xc040, 0x7f80, 0x0001 };
        const float bfv[] = { 1.0f, -3.0f, INFINITY, 0x1p-133f };
        for (int i = 0; i < 4; i++)
                put_u16(b + 2 * i, bf[i]);
        dequantize_equals(QTYPE_BF16, b, bfv, 4);

        /* q8_0: two blocks, d = 0.5 then -0.25; codes j - 16 then 127, -128, ... */
        put_u16(b, 0x3800);
        put_u16(b + 34, 0xb400);
        for (int j = 0; j < 32; j++) {
                b[2 + j] = (uint8_t)(int8_t)(j - 16);
                b[36 + j] = (uint8_t)(int8_t)(j % 2 ? -128 + j : 127 - j);
                want[j] = (float)(j - 16) * 0.5f;
                want[32 + j] = (float)(j % 2 ? -128 + j : 127 - j) * -0.25f;
        }
        dequantize_equals(QTYPE_Q8_0, b, want, 64);

        /* q4_0: d = 0.25 then 2; byte j holds j (element j) low and 15 - j (element j + 16) high */
        put_u16(b, 0x3400);
        put_u16(b + 18, 0x4000);
        for (int j = 0; j < 16; j++) {
                b[2 + j] = b[20 + j] = (uint8_t)(j | (15 - j) << 4);
                want[j] = (float)(j - 8) * 0.25f;
                want[j + 16] = (float)(7 - j) * 0.25f;
                want[32 + j] = (float)(j - 8) * 2.0f;
                want[48 + j] = (float)(7 - j) * 2.0f;
        }
        dequantize_equals(QTYPE_Q4_0, b, want, 64);

        /* q4_1: d = 0.5, m = -1, then d = 0.125, m = 3; the same nibbles: x = d q + m */
        put_u16(b, 0x3800);
        put_u16(b + 2, 0xbc00);
        put_u16(b + 20, 0x3000);
        put_u16(b + 22, 0x4200);
        for (int j = 0; j < 16; j++) {
                b[4 + j] = b[24 + j] = (uint8_t)(j | (15 - j) << 4);
                want[j] = (float)j * 0.5f - 1.0f;
                want[j + 16] = (float)(15 - j) * 0.5f - 1.0f;
                want[32 + j] = (float)j * 0.125f + 3.0f;
                want[48 + j] = (float)(15 - j) * 0.125f + 3.0f;
        }
        dequantize_equals(QTYPE_Q4_1, b, want, 64);
}

static void table_has_functions_for_the_computing_rows_only(void **state) {
        (void)state;
        for (uint32_t id = 0; id < 64; id++) {
                const struct qtype *t = qtype_of(id);
                int computes = 0;
                for (size_t i = 0; i < N_COMPUTING; i++)
                        computes |= computing[i] == id;
                if (!t) {
                        assert_false(computes);
                        continue;
                }
                assert_int_equal(t->id, id);
                assert_true(t->block == 1 || t->block == 32 || t->block == 256);
                assert_int_equal(!!t->dequantize, computes);
                assert_int_equal(!!t->dot, computes);
        }
        assert_null(qtype_of(4)); /* q4_2 and q4_3, removed from ggml */
        assert_null(qtype_of(5));
        assert_int_equal(qtype_row_bytes(qtype_of(QTYPE_Q4_1), 576), 18 * 20);
        assert_int_equal(qtype_row_bytes(qtype_of(QTYPE_Q4_1), 577), 0);
}

static void f16_and_bf16_convert_every_bit_pattern_exactly(void **state) {
        (void)state;
        for (uint32_t h = 0; h < 65536; h++) {
                int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
                double want = exp == 0 ? ldexp(man, -24) : ldexp(1024 + man, exp - 25);
                float got = qtype_f16_to_f32((uint16_t)h);
                if (exp == 31) {
                        assert_true(man ? isnan(got) : isinf(got));
                } else if ((double)got != (sign ? -want : want) || !!signbit(got) != sign) {
                        fail_msg("f16 0x%04x: %.9g, want %.9g", h, (double)got, sign ? -want : want);
                }
                uint32_t bits = h << 16, got_bits;
                float bf = qtype_bf16_to_f32((uint16_t)h);
                memcpy(&got_bits, &bf, 4);
                assert_int_equal(got_bits, bits);
        }
}

/* qtype.h's order, transcribed: lane i % 8, then the tree. */
static float lane_ordered_dot(const float *w, const float *x, size_t n) {
        float l[8] = { 0 };

        for (size_t i = 0; i < n; i++)
                l[i % 8] += w[i] * x[i];
        return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

static void dot_is_the_lane_ordered_sum_of_dequantized_products(void **state) {
        static uint8_t w[64 * 4 * 32];
        static float wd[64 * 32], x[64 * 32];

        (void)state;
        rng_state = 0x51;
        for (size_t ti = 0; ti < N_COMPUTING; ti++) {
                const struct qtype *t = qtype_of(computing[ti]);
                for (int rep = 0; rep < 200; rep++) {
                        size_t n = t->block == 1    ? 1 + rng_below(64 * 32)
                                   : t->block == 32 ? 32 * (1 + rng_below(64))
                                                    : 256 * (1 + rng_below(8));
                        fill_random(t, w, n);
                        for (size_t i = 0; i < n; i++)
                                x[i] = rng_uniform(-3, 3) * (rng_below(16) ? 1.0f : 40.0f);
                        t->dequantize(w, wd, n);
                        float got = t->dot(w, x, n), want = lane_ordered_dot(wd, x, n);
                        if (memcmp(&got, &want, 4))
                                fail_msg("%s n %zu: dot %.9g, lane-ordered sum %.9g", t->name, n, (double)got,
                                         (double)want);
                        double exact = 0, mag = 0;
                        for (size_t i = 0; i < n; i++) {
                                exact += (double)wd[i] * x[i];
                                mag += fabs((double)wd[i] * x[i]);
                        }
                        double bound = (n / 8.0 + 4) * U * mag * 1.01;
                        if (!(fabs(got - exact) <= bound))
                                fail_msg("%s n %zu: dot %.9g, exact %.17g, bound %.3g", t->name, n,
                                         (double)got, exact, bound);
                }
        }
}

static void quantize_stays_within_half_a_step(void **state) {
        float x[4 * 64];
        struct matmul_q8 q[8];

        (void)state;
        rng_state = 0x52;
        for (int rep = 0; rep < 500; rep++) {
                float mag = ldexpf(1.0f, (int)rng_below(80) - 40);
                for (int i = 0; i < 4 * 64; i++)
                        x[i] = mag * rng_uniform(-1, 1) * (rng_below(8) ? 1.0f : 0.01f);
                if (rep % 50 == 0)
                        memset(x + 32, 0, 32 * sizeof(float));          /* a zero block */
                assert_int_equal(matmul_quantize(x, 128, 2, 64, q), 0); /* two vectors, 128 floats apart */
                for (int b = 0; b < 2; b++)
                        for (int k = 0; k < 2; k++) {
                                const struct matmul_q8 *o = &q[b * 2 + k];
                                const float *xs = x + b * 128 + k * 32;
                                int32_t sum = 0, top = 0;
                                for (int j = 0; j < 32; j++) {
                                        float err = fabsf(xs[j] - (float)o->q[j] * o->d);
                                        if (!(err <= o->d * (0.5 + 254 * U)))
                                                fail_msg("x %.9g, code %d, scale %.9g", (double)xs[j],
                                                         o->q[j], (double)o->d);
                                        assert_true(o->q[j] >= -127 && o->q[j] <= 127);
                                        float id = o->d > 0.0f ? 1.0f / o->d : 0.0f;
                                        assert_int_equal(
                                                o->q[j],
                                                (int8_t)fminf(fmaxf(roundf(xs[j] * id), -127.0f), 127.0f));
                                        sum += o->q[j];
                                        top = abs(o->q[j]) > top ? abs(o->q[j]) : top;
                                }
                                assert_int_equal(o->sum, sum);
                                assert_int_equal(top, o->d > 0 ? 127 : 0);
                        }
        }
        /* halves round away from zero (scale 1: the block's largest magnitude is 127) */
        static const float halves[] = {
                0.5f, 1.5f, -2.5f, 126.5f, -126.5f, 0.49999997f, -0.5f, 127.0f, -0.0f
        };
        static const int8_t rounded[] = { 1, 2, -3, 127, -127, 0, -1, 127, 0 };
        memset(x, 0, 32 * sizeof(float));
        memcpy(x, halves, sizeof(halves));
        assert_int_equal(matmul_quantize(x, 32, 1, 32, q), 0);
        assert_true(q[0].d == 1.0f);
        for (size_t j = 0; j < sizeof(rounded); j++)
                assert_int_equal(q[0].q[j], rounded[j]);
        /* non-finite input gives defined codes */
        for (int j = 0; j < 32; j++)
                x[j] = j % 3 ? NAN : INFINITY;
        assert_int_equal(matmul_quantize(x, 32, 1, 32, q), 0);
        for (int j = 0; j < 32; j++)
                assert_true(q[0].q[j] >= -127 && q[0].q[j] <= 127);
        assert_int_equal(matmul_quantize(x, 32, 1, 48, q), -EINVAL);
        assert_int_equal(matmul_quantize(x, 16, 2, 32, q), -EINVAL);
}

/* The AVX2 quantization gives the plain one's bytes: scale, codes and sum, also for NaN, infinities,
 * subnormals, signed zeros, halves and blocks of zeros. */
static void quantize_implementations_agree_bit_for_bit(void **state) {
        static const float odd[] = { NAN, -NAN, INFINITY, -INFINITY, 0x1p-149f, -0x1p-140f, -0.0f, 0.0f,
                                     0.5f, -0.5f, 1.5f, FLT_MAX, -FLT_MAX, 126.5f, 0x1p-126f, 3.0f };
        float x[8 * 32];
        struct matmul_q8 a[8], b[8];

        (void)state;
        if (!matmul_isa_supported(MATMUL_ISA_AVX2)) {
                assert_int_equal(matmul_quantize_isa(MATMUL_ISA_AVX2, x, 32, 1, 32, a), -ENOTSUP);
                return;
        }
        rng_state = 0x58;
        for (int rep = 0; rep < 2000; rep++) {
                float mag = ldexpf(1.0f, (int)rng_below(120) - 60);
                for (int i = 0; i < 8 * 32; i++)
                        x[i] = rng_below(16) ? mag * rng_uniform(-1, 1) : odd[rng_below(16)];
                if (rep % 7 == 0)
                        memset(x + 32 * rng_below(8), 0, 32 * sizeof(float));
                memset(a, 0x55, sizeof(a));
                memset(b, 0xaa, sizeof(b));
                assert_int_equal(matmul_quantize_isa(MATMUL_ISA_PLAIN, x, 64, 4, 64, a), 0);
                assert_int_equal(matmul_quantize_isa(MATMUL_ISA_AVX2, x, 64, 4, 64, b), 0);
                for (int k = 0; k < 8; k++)
                        if (memcmp(&a[k].d, &b[k].d, sizeof(float)) || a[k].sum != b[k].sum ||
                            memcmp(a[k].q, b[k].q, sizeof(a[k].q)))
                                fail_msg("rep %d block %d: the AVX2 quantization differs from the plain one", rep, k);
        }
}

/* A random product: rows x cols weights of type t, n_x vectors with outliers, quantized. */
struct product {
        const struct qtype *t;
        uint32_t rows, cols, n_x;
        uint8_t *w;
        float *x, *y;
        struct matmul_q8 *xq;
};

static void product_new(struct product *p, uint32_t id, uint32_t rows, uint32_t cols, uint32_t n_x) {
        p->t = qtype_of(id);
        p->rows = rows;
        p->cols = cols;
        p->n_x = n_x;
        p->w = malloc(qtype_row_bytes(p->t, cols) * rows);
        p->x = malloc(sizeof(float) * cols * n_x);
        p->y = malloc(sizeof(float) * rows * n_x);
        p->xq = malloc(sizeof(*p->xq) * (matmul_q8_count(cols, n_x) + 1));
        assert_true(p->w && p->x && p->y && p->xq);
        fill_random(p->t, p->w, (size_t)cols * rows);
        for (size_t i = 0; i < (size_t)cols * n_x; i++)
                p->x[i] = rng_uniform(-1, 1) * (rng_below(32) ? 1.0f : 20.0f);
        assert_int_equal(matmul_quantize(p->x, cols, n_x, cols, p->xq), 0);
}

static void product_free(struct product *p) {
        free(p->w);
        free(p->x);
        free(p->y);
        free(p->xq);
}

/* matmul of p, vectors [b0, b0 + n_x), rows [r0, r1), into out (out[b * rows + r]). */
static int run(const struct product *p, int fast, enum matmul_isa isa, uint32_t b0, uint32_t n_x, uint32_t r0,
               uint32_t r1, float *out) {
        struct matmul m = {
                .t = p->t,
                .w = p->w,
                .row_bytes = qtype_row_bytes(p->t, p->cols),
                .cols = p->cols,
                .x = p->x + (size_t)b0 * p->cols,
                .x_stride = p->cols,
                .xq = fast ? p->xq + matmul_q8_count(p->cols, b0) : NULL,
                .n_x = n_x,
                .y = out + (size_t)b0 * p->rows,
                .y_stride = p->rows,
                .isa = isa,
        };
        return matmul_rows(&m, r0, r1);
}

static void exact_product_equals_dot_bit_for_bit(void **state) {
        (void)state;
        rng_state = 0x53;
        for (size_t ti = 0; ti < N_COMPUTING; ti++) {
                struct product p;
                product_new(&p, computing[ti], 7, qtype_of(computing[ti])->block == 256 ? 256 * 3 : 32 * 9,
                            11);
                assert_int_equal(run(&p, 0, MATMUL_ISA_BEST, 0, p.n_x, 0, p.rows, p.y), 0);
                size_t rb = qtype_row_bytes(p.t, p.cols);
                for (uint32_t b = 0; b < p.n_x; b++)
                        for (uint32_t r = 0; r < p.rows; r++) {
                                float want = p.t->dot(p.w + r * rb, p.x + b * p.cols, p.cols);
                                if (memcmp(&want, &p.y[b * p.rows + r], 4))
                                        fail_msg("%s row %u vector %u: %.9g, dot %.9g", p.t->name, r, b,
                                                 (double)p.y[b * p.rows + r], (double)want);
                        }
                product_free(&p);
        }
}

/* Q + (n / 32 + n / 256 + n / 8 + 10) u A of the header, for row r and vector b of p. With
 * ret_rounded, also the dot of the row with the rounded activations q_j d_k (in double), which the
 * fast result equals within (n / 32 + n / 256 + 10) u A: the f32 roundings alone. */
static double fast_bound(const struct product *p, uint32_t r, uint32_t b, double *ret_rounded,
                         double *ret_rounding) {
        const uint8_t *row = p->w + r * qtype_row_bytes(p->t, p->cols);
        const struct matmul_q8 *xq = p->xq + matmul_q8_count(p->cols, b);
        const float *x = p->x + b * p->cols;
        double q = 0, a = 0, rounded = 0;
        float wd[32];

        for (uint32_t k = 0; k < p->cols / 32; k++) {
                const uint8_t *blk = row + k * p->t->bytes;
                double dk = xq[k].d, sw = 0, sx = 0, d, mk;
                uint16_t h;
                memcpy(&h, blk, 2);
                d = fabs(qtype_f16_to_f32(h));
                memcpy(&h, blk + 2, 2);
                mk = p->t->id == QTYPE_Q4_1 ? fabs(qtype_f16_to_f32(h)) : 0;
                mk += d * (p->t->id == QTYPE_Q8_0 ? 128 : p->t->id == QTYPE_Q4_0 ? 8 : 15);
                p->t->dequantize(blk, wd, 32);
                for (int j = 0; j < 32; j++) {
                        sw += fabs(wd[j]);
                        sx += fabs(x[k * 32 + j]) + dk;
                        rounded += (double)wd[j] * xq[k].q[j] * dk;
                }
                q += dk * (0.5 + 254 * U) * sw;
                a += mk * sx;
        }
        *ret_rounded = rounded;
        *ret_rounding = (p->cols / 32.0 + p->cols / 256.0 + 10) * U * a * 1.01;
        return (q + (p->cols / 32.0 + p->cols / 256.0 + p->cols / 8.0 + 10) * U * a) * 1.01;
}

static void fast_product_stays_within_the_activation_rounding_bound(void **state) {
        static const uint32_t ids[] = { QTYPE_Q8_0, QTYPE_Q4_0, QTYPE_Q4_1 };

        (void)state;
        rng_state = 0x54;
        for (size_t ti = 0; ti < 3; ti++) {
                struct product p;
                product_new(&p, ids[ti], 40, 32 * 48, 5);
                float *exact = malloc(sizeof(float) * p.rows * p.n_x);
                assert_non_null(exact);
                assert_int_equal(run(&p, 0, MATMUL_ISA_BEST, 0, p.n_x, 0, p.rows, exact), 0);
                assert_int_equal(run(&p, 1, MATMUL_ISA_BEST, 0, p.n_x, 0, p.rows, p.y), 0);
                uint32_t differ = 0;
                double worst = 0;
                for (uint32_t b = 0; b < p.n_x; b++)
                        for (uint32_t r = 0; r < p.rows; r++) {
                                double e = fabs((double)p.y[b * p.rows + r] - exact[b * p.rows + r]);
                                double rounded, rounding, bound = fast_bound(&p, r, b, &rounded, &rounding);
                                if (!(e <= bound))
                                        fail_msg("%s row %u vector %u: fast %.9g, exact %.9g, bound %.3g",
                                                 p.t->name, r, b, (double)p.y[b * p.rows + r],
                                                 (double)exact[b * p.rows + r], bound);
                                if (!(fabs(p.y[b * p.rows + r] - rounded) <= rounding))
                                        fail_msg("%s row %u vector %u: fast %.9g, with rounded activations "
                                                 "%.17g, bound %.3g",
                                                 p.t->name, r, b, (double)p.y[b * p.rows + r], rounded,
                                                 rounding);
                                differ += e > 0;
                                worst = e / bound > worst ? e / bound : worst;
                        }
                /* the fast path did run (its result is not the exact one), and the bound is not
                 * loose by orders of magnitude */
                assert_true(differ > p.rows * p.n_x / 2);
                assert_true(worst > 0.01);
                free(exact);
                product_free(&p);
        }
}

/* The K-quants' fast product (matmul.c's rows_kquant): against the row times the rounded
 * activations q_j d_k in double, within f32 rounding: each sub-block of 32 adds two products of
 * exact integer sums, their sum, the x_d product, the minimum term (2 roundings) and the
 * difference into a lane that takes n / 256 of them, then the tree: (n / 256 + 10) u A with
 * A = sum_j M (|x_j| + d_k), M a block's largest |d sc q| + |dmin m| (q4_K: 63 * 15 |d| + 63 |dmin|;
 * q6_K: 128 * 32 |d|). And against the exact product, within the activations' rounding
 * Q = sum_k d_k (1/2 + 254 u) sum |w_j| plus both paths' roundings. */
static void kquant_fast_product_stays_within_the_activation_rounding_bound(void **state) {
        static const uint32_t ids[] = { QTYPE_Q4_K, QTYPE_Q6_K };

        (void)state;
        rng_state = 0x57;
        for (size_t ti = 0; ti < 2; ti++) {
                struct product p;
                product_new(&p, ids[ti], 24, 256 * 6, 3);
                float *exact = malloc(sizeof(float) * p.rows * p.n_x), wd[256];
                assert_non_null(exact);
                assert_int_equal(run(&p, 0, MATMUL_ISA_BEST, 0, p.n_x, 0, p.rows, exact), 0);
                assert_int_equal(run(&p, 1, MATMUL_ISA_BEST, 0, p.n_x, 0, p.rows, p.y), 0);
                uint32_t differ = 0;
                for (uint32_t b = 0; b < p.n_x; b++)
                        for (uint32_t r = 0; r < p.rows; r++) {
                                const uint8_t *row = p.w + r * qtype_row_bytes(p.t, p.cols);
                                const struct matmul_q8 *xq = p.xq + matmul_q8_count(p.cols, b);
                                const float *x = p.x + b * p.cols;
                                double rounded = 0, a = 0, q = 0, mag = 0;
                                for (uint32_t k = 0; k < p.cols / 256; k++) {
                                        const uint8_t *blk = row + k * p.t->bytes;
                                        uint16_t h, h2;
                                        double M;
                                        if (p.t->id == QTYPE_Q4_K) {
                                                memcpy(&h, blk, 2);
                                                memcpy(&h2, blk + 2, 2);
                                                M = 63 * 15 * fabs(qtype_f16_to_f32(h)) +
                                                    63 * fabs(qtype_f16_to_f32(h2));
                                        } else {
                                                memcpy(&h, blk + 208, 2);
                                                M = 128 * 32 * fabs(qtype_f16_to_f32(h));
                                        }
                                        p.t->dequantize(blk, wd, 256);
                                        for (int j = 0; j < 256; j++) {
                                                const struct matmul_q8 *xk = &xq[k * 8 + j / 32];
                                                double xr = (double)xk->q[j % 32] * xk->d;
                                                rounded += (double)wd[j] * xr;
                                                a += M * (fabs(x[k * 256 + j]) + xk->d);
                                                q += xk->d * (0.5 + 254 * U) * fabs(wd[j]);
                                                mag += fabs((double)wd[j] * x[k * 256 + j]);
                                        }
                                }
                                double rounding = (p.cols / 256.0 + 10) * U * a * 1.01;
                                double bound = q + rounding + (p.cols / 8.0 + 4) * U * mag * 1.01;
                                float got = p.y[b * p.rows + r], ex = exact[b * p.rows + r];
                                if (!(fabs(got - rounded) <= rounding))
                                        fail_msg("%s row %u vector %u: fast %.9g, with rounded activations "
                                                 "%.17g, "
                                                 "bound %.3g",
                                                 p.t->name, r, b, (double)got, rounded, rounding);
                                if (!(fabs((double)got - ex) <= bound))
                                        fail_msg("%s row %u vector %u: fast %.9g, exact %.9g, bound %.3g",
                                                 p.t->name, r, b, (double)got, (double)ex, bound);
                                differ += got != ex;
                        }
                assert_true(differ > p.rows * p.n_x / 2); /* the fast path did run */
                free(exact);
                product_free(&p);
        }
}

/* The same y from one batched call as from n_x single calls, from one full row range as from a
 * random split, and (fast path) from the AVX2 kernels as from the plain ones. */
static void products_agree_bit_for_bit(const struct product *p, int fast, enum matmul_isa isa, float *ref) {
        size_t bytes = sizeof(float) * p->rows * p->n_x;
        float *y = malloc(bytes);

        assert_non_null(y);
        memset(y, 0, bytes);
        for (uint32_t b = 0; b < p->n_x; b++)
                assert_int_equal(run(p, fast, isa, b, 1, 0, p->rows, y), 0);
        if (memcmp(y, ref, bytes))
                fail_msg("%s %s: B single products differ from one batch of %u", p->t->name,
                         fast ? "fast" : "exact", p->n_x);
        memset(y, 0, bytes);
        for (uint32_t b = 0, n; b < p->n_x; b += n) { /* batches of 4, 7, 5, 3: every chunk and tile */
                n = (uint32_t[]){ 4, 7, 5, 3 }[b % 4];
                n = n < p->n_x - b ? n : p->n_x - b;
                assert_int_equal(run(p, fast, isa, b, n, 0, p->rows, y), 0);
        }
        if (memcmp(y, ref, bytes))
                fail_msg("%s %s: batches of 4, 7, 5 and 3 differ from one batch of %u", p->t->name,
                         fast ? "fast" : "exact", p->n_x);
        memset(y, 0, bytes);
        for (uint32_t r0 = 0, r1; r0 < p->rows; r0 = r1) {
                r1 = r0 + rng_below(p->rows - r0 + 1); /* an empty range too */
                assert_int_equal(run(p, fast, isa, 0, p->n_x, r0, r1, y), 0);
                if (r1 == r0)
                        assert_int_equal(run(p, fast, isa, 0, p->n_x, r0, ++r1, y), 0);
        }
        if (memcmp(y, ref, bytes))
                fail_msg("%s %s: a split of the rows differs from one call", p->t->name,
                         fast ? "fast" : "exact");
        free(y);
}

static void batches_row_ranges_and_kernels_agree_bit_for_bit(void **state) {
        static const enum matmul_isa isas[] = { MATMUL_ISA_PLAIN, MATMUL_ISA_AVX2,
                                                MATMUL_ISA_AVX512_VNNI };

        (void)state;
        rng_state = 0x55;
        for (size_t ti = 0; ti < N_COMPUTING; ti++) {
                struct product p;
                product_new(&p, computing[ti], 23, qtype_of(computing[ti])->block == 256 ? 256 * 2 : 32 * 18,
                            2 * MATMUL_CHUNK + 3);
                size_t bytes = sizeof(float) * p.rows * p.n_x;
                float *plain = malloc(bytes);
                assert_non_null(plain);
                for (int fast = 0; fast < 2; fast++) {
                        assert_int_equal(run(&p, fast, MATMUL_ISA_PLAIN, 0, p.n_x, 0, p.rows, plain), 0);
                        for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
                                if (!matmul_isa_supported(isas[ii])) {
                                        assert_int_equal(run(&p, fast, isas[ii], 0, p.n_x, 0, p.rows, p.y),
                                                         -ENOTSUP);
                                        continue;
                                }
                                assert_int_equal(run(&p, fast, isas[ii], 0, p.n_x, 0, p.rows, p.y), 0);
                                if (memcmp(p.y, plain, bytes))
                                        fail_msg("%s %s: isa %d differs from the plain kernel", p.t->name,
                                                 fast ? "fast" : "exact", isas[ii]);
                                products_agree_bit_for_bit(&p, fast, isas[ii], plain);
                        }
                }
                free(plain);
                product_free(&p);
        }
        if (!matmul_isa_supported(MATMUL_ISA_AVX2))
                fprintf(stderr, "test_qtype: this CPU has no AVX2; only the plain kernels were compared\n");
}

/* matmul.h's fast order, transcribed: block k's lane sums s_l (elements 4l .. 4l + 3) times
 * d_w d_x into lane l; for q4_1, before each group of eight blocks, block k0 + i's m d_x sum into
 * lane i (lanes past the last block add +0, as the AVX2 kernel's do); then the tree
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). */
static float tree8(const float l[8]) {
        return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

static float fast_in_header_order(const struct product *p, uint32_t r, uint32_t b) {
        const uint8_t *row = p->w + r * qtype_row_bytes(p->t, p->cols);
        const struct matmul_q8 *xq = p->xq + matmul_q8_count(p->cols, b);
        uint32_t nb = p->cols / 32, id = p->t->id;
        float acc[8] = { 0 };
        uint16_t h;

        for (uint32_t k = 0; k < nb; k++) {
                const uint8_t *blk = row + k * p->t->bytes, *qs = blk + (id == QTYPE_Q4_1 ? 4 : 2);
                for (uint32_t i = 0; id == QTYPE_Q4_1 && k % 8 == 0 && i < 8; i++) {
                        float t = 0.0f;
                        if (k + i < nb) {
                                memcpy(&h, blk + i * p->t->bytes + 2, 2);
                                t = qtype_f16_to_f32(h) * (xq[k + i].d * (float)xq[k + i].sum);
                        }
                        acc[i] += t;
                }
                int w[32];
                for (int j = 0; j < 32; j++)
                        w[j] = id == QTYPE_Q8_0 ? (int8_t)qs[j]
                                                : ((j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4) -
                                                   (id == QTYPE_Q4_0 ? 8 : 0));
                memcpy(&h, blk, 2);
                float c = qtype_f16_to_f32(h) * xq[k].d;
                for (int l = 0; l < 8; l++) {
                        int32_t sl = 0;
                        for (int j = 4 * l; j < 4 * l + 4; j++)
                                sl += w[j] * xq[k].q[j];
                        acc[l] += c * (float)sl;
                }
        }
        return tree8(acc);
}

/* Both kernels compute the header's order bit for bit, also with the scales the random weights
 * lack: subnormal f16 (F16C and qtype_f16_to_f32 must convert them alike), zeros of both signs,
 * and an activation block of zeros; rows of 13 blocks (a short last group). */
static void fast_kernels_follow_the_header_order_with_any_scale(void **state) {
        static const uint32_t ids[] = { QTYPE_Q8_0, QTYPE_Q4_0, QTYPE_Q4_1 };
        static const enum matmul_isa isas[] = { MATMUL_ISA_PLAIN, MATMUL_ISA_AVX2,
                                                MATMUL_ISA_AVX512_VNNI };

        (void)state;
        rng_state = 0x56;
        for (size_t ti = 0; ti < 3; ti++) {
                struct product p;
                product_new(&p, ids[ti], 9, 32 * 13, 11);
                size_t rb = qtype_row_bytes(p.t, p.cols);
                for (uint32_t r = 0; r < p.rows; r++)
                        for (uint32_t k = 0; k < p.cols / 32; k++)
                                for (int o = 0; o < (ids[ti] == QTYPE_Q4_1 ? 4 : 2); o += 2) {
                                        uint32_t pick = rng_below(4);
                                        uint16_t v = (uint16_t)(rng_below(2) << 15);
                                        v |= pick == 0   ? 1 + rng_below(0x3ff)
                                             : pick == 1 ? 0
                                                         : rng_half_scale() & 0x7fff;
                                        put_u16(p.w + r * rb + k * p.t->bytes + o, v);
                                }
                memset(p.x + 32, 0, 32 * sizeof(float)); /* vector 0, block 1 */
                assert_int_equal(matmul_quantize(p.x, p.cols, p.n_x, p.cols, p.xq), 0);
                for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
                        if (!matmul_isa_supported(isas[ii]))
                                continue;
                        assert_int_equal(run(&p, 1, isas[ii], 0, p.n_x, 0, p.rows, p.y), 0);
                        for (uint32_t b = 0; b < p.n_x; b++)
                                for (uint32_t r = 0; r < p.rows; r++) {
                                        float want = fast_in_header_order(&p, r, b);
                                        if (memcmp(&want, &p.y[b * p.rows + r], 4))
                                                fail_msg("%s isa %d row %u vector %u: %.9g, in the header's "
                                                         "order %.9g",
                                                         p.t->name, isas[ii], r, b,
                                                         (double)p.y[b * p.rows + r], (double)want);
                                }
                }
                product_free(&p);
        }
}

/* The CPU is detected once, at start (kernels/cpu.h): products of every type and implementation,
 * and the questions about them, read the answer and never run the detector again (its CPUID
 * traps to the hypervisor on a virtual machine and cost 15% of decode when every product asked). */
static void products_do_not_run_the_cpu_detector(void **state) {
        static const enum matmul_isa isas[] = { MATMUL_ISA_BEST, MATMUL_ISA_PLAIN, MATMUL_ISA_AVX2,
                                                MATMUL_ISA_AVX512_VNNI };

        (void)state;
        assert_int_equal(cpu_detect_count(), 1); /* the constructor ran it, before main */
        rng_state = 0x57;
        for (size_t ti = 0; ti < N_COMPUTING; ti++) {
                struct product p;
                product_new(&p, computing[ti], 5, qtype_of(computing[ti])->block == 256 ? 256 : 32 * 9, 3);
                for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++)
                        for (int fast = 0; fast < 2; fast++)
                                if (matmul_isa_supported(isas[ii]))
                                        assert_int_equal(run(&p, fast, isas[ii], 0, p.n_x, 0, p.rows, p.y), 0);
                product_free(&p);
        }
        assert_int_equal(cpu_detect_count(), 1);
}

static void matmul_rejects_what_it_cannot_compute(void **state) {
        struct product p;
        float keep[4] = { 7, 7, 7, 7 };

        (void)state;
        rng_state = 0x56;
        product_new(&p, QTYPE_Q4_1, 2, 64, 2);
        struct matmul good = {
                .t = p.t,
                .w = p.w,
                .row_bytes = 40,
                .cols = 64,
                .x = p.x,
                .x_stride = 64,
                .xq = p.xq,
                .n_x = 2,
                .y = keep,
                .y_stride = 2,
        };
        struct matmul m;
        assert_int_equal(matmul_rows(&good, 0, 2), 0);
        memcpy(keep, (float[]){ 7, 7, 7, 7 }, sizeof(keep));
#define REJECT(field, value, r0, r1)                                                                         \
        do {                                                                                                 \
                m = good;                                                                                    \
                m.field = value;                                                                             \
                assert_int_equal(matmul_rows(&m, r0, r1), -EINVAL);                                          \
                for (int i = 0; i < 4; i++)                                                                  \
                        assert_true(keep[i] == 7.0f);                                                        \
        } while (0)
        REJECT(t, qtype_of(QTYPE_Q4_K), 0, 2); /* no functions */
        REJECT(t, NULL, 0, 2);
        REJECT(cols, 48, 0, 2);      /* not a multiple of the block */
        REJECT(row_bytes, 39, 0, 2); /* shorter than a row */
        REJECT(x_stride, 63, 0, 2);  /* vectors overlap */
        REJECT(n_x, 0, 0, 2);
        REJECT(y_stride, 1, 0, 2); /* outputs overlap */
        REJECT(y, NULL, 0, 2);
        REJECT(w, NULL, 0, 2);
        REJECT(x, NULL, 0, 2);
        REJECT(n_x, 2, 2, 1); /* a reversed range */
        m = good;
        m.t = qtype_of(QTYPE_F32);
        m.cols = 8; /* f32 takes any cols exactly, but not into 32-element activation blocks */
        m.row_bytes = 32;
        assert_int_equal(matmul_rows(&m, 0, 2), -EINVAL);
        m.xq = NULL;
        assert_int_equal(matmul_rows(&m, 0, 2), 0);
        product_free(&p);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(dequantize_gives_known_values_for_every_row),
                cmocka_unit_test(table_has_functions_for_the_computing_rows_only),
                cmocka_unit_test(f16_and_bf16_convert_every_bit_pattern_exactly),
                cmocka_unit_test(dot_is_the_lane_ordered_sum_of_dequantized_products),
                cmocka_unit_test(quantize_stays_within_half_a_step),
                cmocka_unit_test(quantize_implementations_agree_bit_for_bit),
                cmocka_unit_test(exact_product_equals_dot_bit_for_bit),
                cmocka_unit_test(fast_product_stays_within_the_activation_rounding_bound),
                cmocka_unit_test(kquant_fast_product_stays_within_the_activation_rounding_bound),
                cmocka_unit_test(batches_row_ranges_and_kernels_agree_bit_for_bit),
                cmocka_unit_test(fast_kernels_follow_the_header_order_with_any_scale),
                cmocka_unit_test(matmul_rejects_what_it_cannot_compute),
                cmocka_unit_test(products_do_not_run_the_cpu_detector),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
