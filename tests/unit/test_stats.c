/* test_stats.c: the quality lab's intervals and verdicts (client/eval/stats.c): the clustered
 * ratio estimator against hand-computed values, paired differences, the bootstrap's determinism
 * and limits, and the four verdicts. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "../../client/eval/stats.h"

static void t95_is_students_table_then_normal(void **state) {
        (void)state;
        assert_true(fabs(stats_t95(1) - 12.706) < 1e-9);
        assert_true(fabs(stats_t95(2) - 4.303) < 1e-9);
        assert_true(fabs(stats_t95(30) - 2.042) < 1e-9);
        assert_true(stats_t95(31) == 1.96);
        assert_true(isinf(stats_t95(0)));
}

/* y = 1, 2, 3 over three clusters of one token each: mean 2, sample sd 1, se 1/sqrt(3), t(2). */
static void ratio_ci_of_equal_weights_is_the_clustered_mean(void **state) {
        (void)state;
        const double y[] = { 1, 2, 3 }, w[] = { 1, 1, 1 };
        struct stats_ci ci;
        assert_int_equal(stats_ratio_ci(y, w, 3, &ci), 0);
        assert_true(fabs(ci.mean - 2) < 1e-12);
        assert_true(fabs(ci.se - 1 / sqrt(3)) < 1e-12);
        assert_true(fabs(ci.lo - (2 - 4.303 / sqrt(3))) < 1e-12);
        assert_true(fabs(ci.hi - (2 + 4.303 / sqrt(3))) < 1e-12);
        assert_int_equal(ci.n, 3);
}

/* Clusters of different sizes with one ratio: no variation between clusters, se 0. Token-level
 * noise inside a cluster does not narrow anything: only clusters count. */
static void ratio_ci_weighs_clusters_by_their_tokens(void **state) {
        (void)state;
        const double y[] = { 1, 10, 100 }, w[] = { 2, 20, 200 };
        struct stats_ci ci;
        assert_int_equal(stats_ratio_ci(y, w, 3, &ci), 0);
        assert_true(fabs(ci.mean - 0.5) < 1e-12);
        assert_true(ci.se < 1e-12);
}

static void ratio_ci_refuses_one_cluster_and_no_weight(void **state) {
        (void)state;
        const double y[] = { 1, 2 }, w[] = { 0, 0 };
        struct stats_ci ci = { .mean = 42 };
        assert_int_equal(stats_ratio_ci(y, w, 1, &ci), -EINVAL);
        assert_int_equal(stats_ratio_ci(y, w, 2, &ci), -EINVAL);
        assert_true(ci.mean == 42); /* untouched */
}

/* A constant shift between two configurations on every cluster is exact; equal ones are no
 * difference. */
static void paired_ci_differences_within_each_cluster(void **state) {
        (void)state;
        const double a[] = { 5, 9, 2, 7 }, b[] = { 4, 8, 1, 6 }, w[] = { 1, 1, 1, 1 };
        struct stats_ci d;
        assert_int_equal(stats_paired_ci(a, b, w, 4, &d), 0);
        assert_true(fabs(d.mean - 1) < 1e-12);
        assert_true(d.se < 1e-12);
        assert_string_equal(stats_verdict(&d, 0, false), "holds");
        assert_int_equal(stats_paired_ci(a, a, w, 4, &d), 0);
        assert_string_equal(stats_verdict(&d, 0, true), "no difference");
}

static void bootstrap_is_deterministic_and_brackets_the_mean(void **state) {
        (void)state;
        const double x[] = { 0, 1, 1, 0, 1, 1, 1, 0, 1, 1 };
        struct stats_ci a, b;
        assert_int_equal(stats_bootstrap_mean(x, 10, 2000, 7, &a), 0);
        assert_int_equal(stats_bootstrap_mean(x, 10, 2000, 7, &b), 0);
        assert_true(a.lo == b.lo && a.hi == b.hi);
        assert_true(fabs(a.mean - 0.7) < 1e-12);
        assert_true(a.lo <= 0.7 && a.hi >= 0.7);
        assert_true(a.lo >= 0 && a.hi <= 1);
        assert_true(a.hi - a.lo > 0.2); /* ten needles cannot pin 0.7 down */
        assert_int_equal(stats_bootstrap_mean(x, 1, 2000, 7, &a), -EINVAL);
        assert_int_equal(stats_bootstrap_mean(x, 10, 99, 7, &a), -EINVAL);
}

/* The four verdicts on a target of 0.2 lower (a relative change of -20%). */
static void verdicts_read_the_interval(void **state) {
        (void)state;
        struct stats_ci d = { .mean = -0.3, .lo = -0.4, .hi = -0.25 };
        assert_string_equal(stats_verdict(&d, 0.2, true), "holds");
        d = (struct stats_ci){ .mean = -0.1, .lo = -0.15, .hi = -0.05 };
        assert_string_equal(stats_verdict(&d, 0.2, true), "does not hold");
        d = (struct stats_ci){ .mean = -0.25, .lo = -0.35, .hi = -0.1 };
        assert_string_equal(stats_verdict(&d, 0.2, true), "not resolved (the interval spans the target)");
        d = (struct stats_ci){ .mean = -0.3, .lo = -0.6, .hi = 0.01 };
        assert_string_equal(stats_verdict(&d, 0.2, true), "no difference");
        /* higher is better: the gap closed toward the full cache, target 80% */
        d = (struct stats_ci){ .mean = 0.83, .lo = 0.63, .hi = 1.02 };
        assert_string_equal(stats_verdict(&d, 0.8, false), "not resolved (the interval spans the target)");
        /* an interval that could not be computed is not a verdict */
        d = (struct stats_ci){ .mean = 0.5, .lo = NAN, .hi = NAN };
        assert_string_equal(stats_verdict(&d, 0.8, false), "not measured");
}

/* Without a target: better, worse or no difference, in the metric's own direction. */
static void comparisons_say_better_or_worse(void **state) {
        (void)state;
        struct stats_ci d = { .mean = -0.3, .lo = -0.4, .hi = -0.25 };
        assert_string_equal(stats_compare(&d, true), "better");
        assert_string_equal(stats_compare(&d, false), "worse");
        d = (struct stats_ci){ .mean = 0.1, .lo = -0.05, .hi = 0.2 };
        assert_string_equal(stats_compare(&d, true), "no difference");
        d = (struct stats_ci){ .mean = NAN, .lo = NAN, .hi = NAN };
        assert_string_equal(stats_compare(&d, true), "not measured");
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(t95_is_students_table_then_normal),
                cmocka_unit_test(ratio_ci_of_equal_weights_is_the_clustered_mean),
                cmocka_unit_test(ratio_ci_weighs_clusters_by_their_tokens),
                cmocka_unit_test(ratio_ci_refuses_one_cluster_and_no_weight),
                cmocka_unit_test(paired_ci_differences_within_each_cluster),
                cmocka_unit_test(bootstrap_is_deterministic_and_brackets_the_mean),
                cmocka_unit_test(verdicts_read_the_interval),
                cmocka_unit_test(comparisons_say_better_or_worse),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
