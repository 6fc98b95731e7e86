/* report.h: the story suite's report (suite.h), from what the parent added up.
 *
 * Owns: a configuration's figures in the report's units (perplexity and its gap to the full
 * cache, KL, top-1 agreement, name recall, charged and nominal bytes, tokens held, plans, with
 * the perplexity and KL intervals clustered by story), the outputs and their formats (a JSON
 * object per configuration on stdout and in results.jsonl, the same as results.csv, results.md),
 * the targets the markdown measures as paired comparisons over stories (CONF-KV with INT8 against
 * a 64-token window's gap, gating and SCOPE at equal charged bytes, decode-time correction at
 * equal budget, the Pearson r of confidence_kl.csv), and completing a run: every file is written
 * as NAME.partial and renamed over NAME only at the end, so a failed run leaves the old results.
 */
#ifndef KVC_EVAL_REPORT_H
#define KVC_EVAL_REPORT_H

#include <stdbool.h>
#include <stddef.h>

#include "suite.h"

/* out_dir/name.partial (partial) or out_dir/name into buf. */
void report_path(const struct eval *e, const char *name, bool partial, char *buf, size_t len);

/* Writes the report of e's configurations from their totals m[] and the model's own sums (own),
 * with the per-story sums in e->recs and the pairs already in confidence_kl.csv.partial, then
 * renames results.{jsonl,csv,md} and confidence_kl.csv into place (saying on stderr which could
 * not be). */
void report_write(const struct eval *e, const struct metrics *m, const struct metrics *own);

#endif
