/* suite.h: the story suite (kvc-eval --task ppl, the default; --quick its short form). Runs the
 * reference model (stories260K) over real text through the real kvcd, one token at a time, with
 * every policy and budget, and measures what each keeps per byte.
 *
 * The text is cut into stories (each begins "Once upon a time"), one story per sequence, at most
 * the model's context. For every story the model first runs with a plain in-process cache (the
 * reference: no kvcd, no eviction), keeping its next-token log-probabilities. Then one kvcd
 * session per configuration replays the same tokens, teacher-forced, all sessions stepping in
 * lockstep in one StepBatch per position, exactly as an inference server would run them; the
 * first --prompt-tokens of the story are declared the prompt (prefill policies compress it).
 *
 * Per configuration: perplexity (and its gap to the full cache), mean KL(p_full || p_policy),
 * top-1 agreement with the full cache, name recall (the first token of a character's name where
 * it recurs at least 64 tokens after the name first appeared: top-1 accuracy and mean
 * log-probability), the bytes kvcd charges the session (blocks granted at their full size,
 * averaged over steps; kvcd's own peak at close) beside the old nominal count, the tokens the
 * layers hold (average and peak: budgets plus the plans' slack), tokens scored and wall time, each
 * per-token figure with its story-clustered 95% interval (eval/stats.h). Also the model's own
 * perplexity computed without kvcd, and per step the full cache's confidence beside the KL a
 * short recent window causes (the mechanism CONF-KV rests on). Stories come from the test split
 * (stories 200 on) unless --split tune; the report's verdicts are paired comparisons over stories
 * ("no difference" when the interval contains 0).
 *
 * Stories are spread over --jobs worker processes (each its own kvcd client); the parent reads
 * their lines as they come (poll), adds them up and shows progress on stderr. Output: one JSON
 * object per configuration on stdout, and in the output directory results.{md,csv,jsonl} and the
 * per-step confidence/KL pairs, written as .partial files renamed only when the run completes.
 *
 * The suite's parts, one concern a file: suite.c owns the options and state of a run (struct
 * eval, filled by kvc-eval.c's options), the configurations (a spec each; the default and quick
 * suites) and the run itself (model, tokenizer and text loaded, workers forked, their lines
 * collected, the report written); story.h owns one story and its metrics, and the lines a worker
 * writes them as; report.h owns the report. The names are those the code had in kvc-eval.c, where
 * it was born.
 */
#ifndef KVC_EVAL_SUITE_H
#define KVC_EVAL_SUITE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvc.h"
#include "model.h"
#include "tokenizer.h"

#define MAX_CONFIGS       96
#define MAX_CONFIG_PARAMS 8
#define NAME_GAP          64
#define TUNE_STORIES      200 /* stories [0, 200) of the sample are the tuning split, the rest the test split */

struct config {
        char label[64];
        char family[48]; /* the label without its budget: curves are drawn per family */
        char policy[32];
        uint32_t budget;
        struct kvc_param params[MAX_CONFIG_PARAMS];
        char param_text[MAX_CONFIG_PARAMS][2][48];
        size_t n_params;
};

struct metrics {
        double nll, kl, name_logp, bytes_sum, q8_bytes_sum, seconds;
        uint64_t n, top1, name_n, name_hit, peak_bytes, plans, sequences;
        /* what kvcd charges: blocks granted times their size, summed over steps (charged_sum), the
         * peak kvcd itself reported at close, and the tokens the layers held (mean over layers,
         * summed over steps; the largest layer at any step) */
        double charged_sum, tokens_sum;
        uint64_t peak_charged, peak_tokens;
        uint64_t bytes_mismatch; /* over sequences: kvcd's bytes at close beyond the layers' blocks */
};

/* One sequence of one configuration: the clusters of every interval (eval/stats.h). */
struct seq_rec {
        double nll, kl, top1, n, charged, name_n, name_hit, name_logp;
};

struct eval {
        const char *socket, *model_path, *tok_path, *data_path, *out_dir, *corr_label;
        uint32_t sequences, max_tokens, prompt_tokens, jobs, first;
        uint32_t split_first, split_end; /* the split's stories [split_first, split_end) */
        const char *split;
        struct seq_rec *recs; /* [sequence][configuration], filled by the parent */
        bool quick;
        enum kvc_dtype dtype;
        struct config configs[MAX_CONFIGS];
        uint32_t n_configs;
        struct model *model;
        struct tokenizer *tok;
        char *text;
        size_t text_len;
};

/* Appends the configuration "label=policy:budget[:key=value,...]" or "policy:budget[:...]". Without
 * a label it is labelled "policy-budget[,key=value...]" and its family is the policy; with one, the
 * family is the label without a trailing "-digits". -EINVAL, said on stderr, for a bad spec or one
 * past MAX_CONFIGS. */
int suite_add_config(struct eval *e, const char *spec);

/* Runs the suite on e (options set, out_dir made): the default suite, or the quick one, when no
 * configuration was given. Returns kvc-eval's exit status: 0; 1 when the model, tokenizer or text
 * does not load or a worker fails (the results already in out_dir are left as they were); 2 for a
 * bad suite or a split with fewer than 2 stories from e->first on. */
int suite_run(struct eval *e);

#endif
