/* summary.c: normalized entropy, top-1 probability, margin and top-k log-probabilities. */
#include "summary.h"

#include <errno.h>
#include <float.h>
#include <math.h>

int summary_logits_ref(const float *logits, uint32_t vocab, struct summary *ret, float *topk, uint32_t k) {
        if (vocab < 2 || k > vocab)
                return -EINVAL;

        uint32_t i1 = 0, i2 = UINT32_MAX;
        for (uint32_t i = 0; i < vocab; i++) {
                if (!isfinite(logits[i]))
                        return -EINVAL;
                if (i == 0)
                        continue;
                if (logits[i] > logits[i1]) {
                        i2 = i1;
                        i1 = i;
                } else if (i2 == UINT32_MAX || logits[i] > logits[i2]) {
                        i2 = i;
                }
        }
        double max = logits[i1], sum = 0.0, zsum = 0.0;
        for (uint32_t i = 0; i < vocab; i++) {
                double e = exp((double)logits[i] - max);
                sum += e;
                zsum += e * ((double)logits[i] - max);
        }
        double lse = max + log(sum);
        /* H = lse - E_p[z] = log(sum) - E_p[z - max] */
        double h = log(sum) - zsum / sum;
        double hn = h / log((double)vocab);
        ret->entropy = (float)(hn < 0 ? 0 : hn > 1 ? 1 : hn);
        ret->top1_prob = (float)exp((double)logits[i1] - lse);
        /* finite logits more than FLT_MAX apart: the protocol carries only finite margins */
        float margin = logits[i1] - logits[i2];
        ret->margin = isinf(margin) ? FLT_MAX : margin;
        ret->top1 = i1;

        /* top-k by repeated selection: k is small (the protocol allows 64) */
        float last = INFINITY;
        uint32_t last_idx = UINT32_MAX;
        for (uint32_t j = 0; j < k; j++) {
                uint32_t best = UINT32_MAX;
                for (uint32_t i = 0; i < vocab; i++) {
                        float z = logits[i];
                        /* strictly after (last, last_idx) in the order (value desc, index asc) */
                        if (z > last || (z == last && i <= last_idx && last_idx != UINT32_MAX))
                                continue;
                        if (best == UINT32_MAX || z > logits[best])
                                best = i;
                }
                topk[j] = (float)((double)logits[best] - lse);
                last = logits[best];
                last_idx = best;
        }
        return 0;
}
