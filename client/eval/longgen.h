/* longgen.h: long generation, SCOPE's setting (kvc-eval --task longgen), on a GGUF chat model
 * (SmolLM2-135M-Instruct) through kvcd.
 *
 * Owns: the prompts (a chat request to retell and continue a story of the test split), the full
 * cache's greedy answer to each, every policy teacher-forced on that answer, and the scores: KL
 * to the full cache and top-1 agreement over the answer, split by the part of the cache a policy
 * had compressed at each position (SCOPE's prefill / decode split), the bytes kvcd charged, and the
 * issue's SCOPE targets as paired verdicts at equal bytes.
 *
 * One pass, two jobs: configuration 0 (the full cache) generates, and every other configuration
 * is fed the token the full cache chose at the previous position. Every configuration of a
 * prompt steps through the same positions in one pass of the model and one StepBatch, so the
 * answer is generated and the policies are teacher-forced on it at once (no second run, nothing
 * stored between them). The prompt is prefilled in chunks with kvcd's plans between chunks, its
 * last NIAH_OBSERVED tokens one per step (SnapKV's and SCOPE's observation window), and declared
 * to kvcd (prompt_tokens) whole: the question is in it, as in SCOPE.
 *
 * Generation is greedy with the end-of-turn tokens masked, so every answer has exactly
 * gen_tokens tokens (a 135M model would otherwise stop after a few hundred).
 */
#ifndef KVC_EVAL_LONGGEN_H
#define KVC_EVAL_LONGGEN_H

#include <stdint.h>

#include "niah.h"

/* lengths[]: the story's tokens in the prompt (the prompt adds the chat template and the
 * request); needles: prompts per length; fractions: budgets as fractions of prompt + answer;
 * gen_tokens: the answer's length. Writes out_dir/longgen.{md,jsonl}, longgen_prompts.csv,
 * longgen_curve.csv and longgen_answers.txt; a JSON line per configuration on stdout; progress on
 * stderr. quick: the full cache, window and scope at the fractions. 0 or -errno. */
int longgen_run(const struct niah_options *o, uint32_t gen_tokens);

#endif
