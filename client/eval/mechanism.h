/* mechanism.h: the mechanism CONF-KV rests on, measured on a GGUF chat model (SmolLM2-135M-Instruct)
 * through kvcd (kvc-eval --task mechanism): does confidence predict how much a short cache costs?
 *
 * Owns: long documents (the longdoc task's text) teacher-forced through the full cache and windows
 * of W tokens in one batch; at every step the signals a gate could read — the full cache's
 * confidence (the logits summary kvcd gets: normalized entropy, top-1 probability, margin, and
 * CONF-KV's confidence of them), the full cache's attention mass on the tokens beyond the W
 * newest (what a window of W has evicted or is about to), and the entropy of the full cache's
 * attention — beside what the window costs: KL(full ‖ window-W) at that step and its mean over the
 * next 16 steps. Reports Pearson and Spearman correlations with document-clustered bootstrap
 * intervals, the paired comparison of the signals (|Spearman| of attention mass or entropy minus
 * that of confidence), and the mean KL by decile of each signal.
 *
 * The attention signals are computed beside the engine's own attention: the full cache's keys are
 * copied as the engine stores them (float32, post-RoPE) and every query of the full cache's rows
 * is scored over them (softmax of q.k / sqrt(head_dim), every query head, every layer), so each
 * step has its own figure even when a pass holds a chunk of rows. kvcd holds the same quantity in
 * the `last` side array (the current query's attention per slot), so a gate built on it needs no
 * new data path.
 */
#ifndef KVC_EVAL_MECHANISM_H
#define KVC_EVAL_MECHANISM_H

#include "niah.h"

/* lengths[0]: the documents' tokens; needles: documents (at least 2: the intervals); fractions:
 * the windows W as fractions of the length. Writes out_dir/mechanism.{md,jsonl} and
 * mechanism_steps.csv; a JSON line per (window, signal, target) on stdout; progress on stderr.
 * 0 or -errno. */
int mechanism_run(const struct niah_options *o);

#endif
