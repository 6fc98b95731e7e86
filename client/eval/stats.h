/* stats.h: the quality lab's intervals and verdicts.
 *
 * Owns: the 95% intervals every number in kvc-eval's reports carries, and the rule that turns a
 * paired comparison into "holds", "does not hold" or "no difference". Tokens of one sequence are
 * not independent (one story, one haystack), so every interval is clustered by sequence: a
 * per-token metric is a ratio estimator sum(y_i) / sum(w_i) over sequences i (y_i the sum of the
 * metric over the sequence's tokens, w_i their count) with its linearized (delta-method) standard
 * error; a per-sequence score (a needle found or not) is a mean over sequences with a percentile
 * bootstrap. Paired comparisons difference the two configurations within each sequence first, so
 * what varies between sequences cancels. Intervals use Student's t with n - 1 degrees of freedom
 * (exact table to 30, 1.96 beyond).
 *
 * Rejected: token-level standard errors (they treat 300 tokens of one story as 300 stories and
 * give intervals several times too narrow); a bootstrap for the ratio estimator (the delta method
 * is exact enough at these sizes and deterministic).
 */
#ifndef KVC_EVAL_STATS_H
#define KVC_EVAL_STATS_H

#include <stdbool.h>
#include <stdint.h>

struct stats_ci {
        double mean; /* the estimate */
        double se;   /* its standard error (0 for a bootstrap) */
        double lo, hi;
        uint32_t n; /* clusters (sequences) */
};

/* The two-sided 95% quantile of Student's t with df degrees of freedom (df >= 1). */
double stats_t95(uint32_t df);

/* sum(y) / sum(w) over n clusters with its clustered 95% interval. -EINVAL when n < 2 or the
 * weights sum to 0; *ret untouched then. */
int stats_ratio_ci(const double *y, const double *w, uint32_t n, struct stats_ci *ret);

/* The paired difference (sum(a) - sum(b)) / sum(w), a and b measured on the same clusters with
 * the same weights (the same tokens), with its clustered 95% interval. */
int stats_paired_ci(const double *a, const double *b, const double *w, uint32_t n, struct stats_ci *ret);

/* The mean of x[0..n) with a percentile bootstrap 95% interval of `reps` resamples (deterministic
 * given seed). -EINVAL for n < 2 or reps < 100. */
int stats_bootstrap_mean(const double *x, uint32_t n, uint32_t reps, uint64_t seed, struct stats_ci *ret);

/* The verdict on a target "the difference d is at least `need` in the good direction" (d <= -need
 * when lower_is_better, d >= need otherwise): "no difference" when d's interval contains 0 (the
 * data cannot tell the two apart, whatever the point estimate says); else "holds" when the whole
 * interval meets the target, "does not hold" when the whole interval falls short of it, and "not
 * resolved (the interval spans the target)" between. With need 0 the last cannot happen:
 * "holds" is then "better", "does not hold" "worse". "not measured" when the interval is NaN (too
 * few sequences). */
const char *stats_verdict(const struct stats_ci *d, double need, bool lower_is_better);

/* A comparison without a target: "no difference", "better", "worse" (or "not measured"), as
 * stats_verdict with need 0 reads it. */
const char *stats_compare(const struct stats_ci *d, bool lower_is_better);

#endif
