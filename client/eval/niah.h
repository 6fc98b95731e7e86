/* niah.h: needle in a haystack (kvc-eval --task niah) on a GGUF chat model (SmolLM2-135M-Instruct)
 * through kvcd, and the options every SmolLM2 task of the lab takes (struct niah_options).
 *
 * Owns: building haystacks (TinyStories validation stories, the test split, joined into a text of
 * a given number of tokens), hiding a needle in them ("The secret code of the blue door is 4821.":
 * a random colour and four-digit value, at depths spread evenly over the haystack), asking for it
 * in the chat template, running every configuration of one haystack as one batch through kvcd,
 * and scoring both the exact match of the greedy answer and the log-probability of the true
 * answer's tokens.
 *
 * The prompt is user: an instruction, the haystack, the question; then the assistant's turn
 * opens with "The code of the <colour> door is" (an answer prefix, so a 135M model answers in a
 * fixed form: without it the full cache's answer wanders off and exact match measures the
 * phrasing, not the cache). The answer is the value's tokens after that prefix. Greedy exact
 * match is computed by teacher forcing: the greedy answer begins with the true tokens exactly when
 * every teacher-forced argmax is the true token, so one forced pass gives both scores.
 *
 * The haystack is prefilled in chunks (kvcd plans between chunks) and declared the prompt up to
 * the question (prompt_tokens = the position where the question begins): a policy with a budget
 * below the haystack must choose what to keep before it sees the question (the hard, realistic
 * case, not kvpress's "question-aware" one). The last `NIAH_OBSERVED` tokens before the question
 * go one per step, so SnapKV and PyramidKV observe that many queries, as in their papers.
 * Configurations share the token stream: each pass takes the same chunk of every configuration's
 * sequence (the weights read once), and kvcd gets every session's step in one StepBatch.
 */
#ifndef KVC_EVAL_NIAH_H
#define KVC_EVAL_NIAH_H

#include <stdbool.h>
#include <stdint.h>

#define NIAH_MAX_LENGTHS   8
#define NIAH_MAX_FRACTIONS 4
#define NIAH_OBSERVED      8

struct niah_options {
        const char *socket;                 /* kvcd's runtime directory */
        const char *model_path;             /* a GGUF chat model */
        const char *data_path;              /* the TinyStories validation sample */
        const char *out_dir;                /* results go here (written as .partial, renamed at the end) */
        uint32_t lengths[NIAH_MAX_LENGTHS]; /* haystack tokens */
        uint32_t n_lengths;
        double fractions[NIAH_MAX_FRACTIONS]; /* budgets as a fraction of the haystack */
        uint32_t n_fractions;
        uint32_t needles;  /* per length */
        uint32_t chunk;    /* prefill rows per configuration and pass, at most */
        uint32_t threads;  /* the engine's threads (0: every CPU) */
        uint64_t seed;     /* needles and haystacks */
        bool quick;        /* one short haystack, three configurations */
        const char *suite; /* "quick", "main", "ladder" */
        const char *families; /* niah: the suite's families to run, comma-separated labels (NULL: all) */
        bool dump_tokens;  /* tiers: write the sequences it would score, run nothing */
};

/* One needle's prompt: the tokens (chat template, answer prefix; ids is the caller's to free),
 * where the question starts, and the answer's tokens. */
struct needle {
        int *ids;
        uint32_t n_prompt, question, n_answer;
        int answer[16];
        double depth;
        char colour[16];
        unsigned value;
};

struct niah;
/* Needle `index` of `needles` (n->o->needles) in a haystack of `length` tokens, at depth
 * (index + 0.5) / needles. 0, -ENOMEM, -EINVAL (the answer does not extend its prefix). */
int niah_build_needle(struct niah *n, uint32_t length, uint32_t index, struct needle *nd);

/* Runs the task and writes out_dir/niah.{jsonl,csv,md} and niah_needles.csv; a summary line per
 * configuration and length on stdout. Progress on stderr. 0 or -errno. */
int niah_run(const struct niah_options *o);

#endif
