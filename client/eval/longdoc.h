/* longdoc.h: long documents (kvc-eval --task longdoc) on a GGUF chat model (SmolLM2-135M-Instruct)
 * through kvcd.
 *
 * Owns: the documents (joined test-split stories, no needle), every configuration teacher-forced on
 * them in one batch (the full cache's row of the same position in the same pass is the reference,
 * every row asking for logits), the scores on the positions past the largest budget (perplexity,
 * KL(full || policy), top-1 agreement, with intervals clustered by document), the bytes kvcd
 * charged, and the three targets that read perplexity and KL, each as a paired verdict at
 * equal average charged bytes:
 *   - CONF-KV+INT8 at the smallest window's bytes closes >= 80% of its perplexity gap;
 *   - a gate (confidence: gate=defer; attention: gate=attention) beats conf-fixed read at its bytes;
 *   - prob's correction (ht) lowers KL against prob-none at the same budget by >= 20%.
 * The configurations: the curves the targets read along (window, conf-fixed, conf-int8) at every
 * fraction, and the points they place on them (the two gates, prob with and without correction)
 * at the smallest fraction. No prompt is declared: the prompt compressors would keep everything,
 * so the task has none.
 */
#ifndef KVC_EVAL_LONGDOC_H
#define KVC_EVAL_LONGDOC_H

#include "niah.h"

/* lengths[]: document tokens; needles: documents per length; fractions: budgets as fractions of
 * the length. Writes out_dir/longdoc.{jsonl,md}; a JSON line per configuration on stdout; progress
 * on stderr. quick: the full cache, window and conf-fixed at the fractions, conf-attention at the
 * smallest. 0 or -errno. */
int longdoc_run(const struct niah_options *o);

#endif
