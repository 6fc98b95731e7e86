/* summarize.h: the moment summary of evicted tokens (decode-time correction, CPU reference).
 *
 * Plain eviction renormalises attention over the kept tokens as if the evicted ones had never
 * been there. A summary token puts them back, approximately: one slot per layer and KV head whose
 * key is the mean of the evicted keys, whose value is the mean of their values, and whose
 * log-weight is log(count). Its attention logit is then q . mean(k) / sqrt(d) + log n, so its
 * weight n exp(q . mean(k) / sqrt(d)) is, by Jensen's inequality, a lower bound of the evicted
 * tokens' true total weight sum_j exp(q . k_j / sqrt(d)) for every query: the denominator moves
 * toward the truth and never past it, and the value it brings is the evicted tokens' mean
 * (MomentKV's zeroth order in the value, first order in the key; notes/policies.md 2.4).
 *
 * The summary lives in an ordinary kept slot, marked by position -1. When a plan evicts more
 * tokens, their moments are merged into it (a running mean weighted by counts); the first plan
 * turns one evicted token into the summary (its own key and value count among the evicted).
 */
#pragma once

#include <stdint.h>

#include "block.h"

#define SUMMARY_POS (-1)

/* Merges the tokens of L that the keep-set drops (slots below base_tokens not in keep, which
 * holds keep_count ascending indices and includes summary) into slot `summary`, for every KV
 * head. scratch holds 2 * head_dim floats. -EINVAL for a summary slot not in keep or past
 * base_tokens, or an INT8 layer (only full-precision layers carry a summary). */
int summarize_evicted(const struct block_layer *L, const uint32_t *keep, uint32_t keep_count,
                      uint32_t base_tokens, uint32_t summary, float *scratch);
