/* summary.h: the logits summary a client sends after each step (CPU reference).
 *
 * From one row of next-token logits z over a vocabulary of V entries, p = softmax(z):
 *   entropy   = H(p) / log V           (normalized, in [0, 1])
 *   top1_prob = p_(1)
 *   margin    = z_(1) - z_(2)          (>= 0; FLT_MAX when the difference overflows)
 *   topk      = log p of the k most likely tokens, descending (optional)
 * These are CONF-KV's confidence features; kvcd combines them into one confidence.
 * Accumulates in double, so it agrees with a double-precision oracle to about 1e-6.
 */
#pragma once

#include <stdint.h>

struct summary {
        float entropy;
        float top1_prob;
        float margin;
        uint32_t top1; /* argmax (the lowest index among ties) */
};

/* -EINVAL for V < 2, k > V, or a non-finite logit. topk may be NULL when k == 0. */
int summary_logits_ref(const float *logits, uint32_t vocab, struct summary *ret, float *topk, uint32_t k);
