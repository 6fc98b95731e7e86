/* tiers.h: each tier of the precision ladder alone (kvc-eval --task tiers) on a GGUF chat model
 * (SmolLM2-135M-Instruct), in process: no kvcd.
 *
 * Owns: the configurations (the f16 cache, and f16 for the last 128 tokens with every older token
 * at q8, q4, q3 or q2: client/engine/laddercache.h), long documents teacher-forced through all of
 * them in one batch (the task longdoc's documents: joined test-split stories), the needle suite's
 * cases (niah.h's, the question after the haystack, the haystack compressed before the question
 * is read: the ladder cache demotes as tokens are stored), and the report: per tier its bytes
 * against the f16 cache's, the perplexity ratio to f16 with its interval clustered by document,
 * KL(f16 || tier) and top-1 agreement, the targets (q8 within 0.2%, q4 within 2%, the
 * lowest tier within 5%) as verdicts, and needle exact match with a bootstrap interval and its
 * paired difference to f16.
 */
#ifndef KVC_EVAL_TIERS_H
#define KVC_EVAL_TIERS_H

#include "niah.h"

/* lengths[0]: document tokens (default 4096), needles: documents; the needle lengths are 1K, 2K
 * and 4K with o->needles cases each (quick: one 256-token document, two 192-token needles).
 * Writes out_dir/tiers.{jsonl,md}; with o->dump_tokens, runs no model and writes the token ids of
 * every document and needle to out_dir/tiers_tokens.txt and the documents' text to tiers_docs.txt
 * instead (the same sequences, built in the same order from the same seed). 0 or -errno. */
int tiers_run(const struct niah_options *o);

#endif
