/* importance.h - importance scores that do not need the question (issue 27 item 3): what a prompt
 * chunk's tokens are worth to whatever comes later, written into the score the policies rank by
 * (the `sum` side array, kvc_layer_set_scores) after each chunk, before kvcd plans.
 *
 * Three kinds:
 *   attention  nothing is done here: the score is the attention the chunk's queries gave each
 *              token, as the attention kernels accumulate it (kvcd's behaviour before this file)
 *   surprisal  -ln p(token | its prefix), from the prefill's own logits: a token the model could
 *              not predict carries information the rest of the context does not
 *   recon      KVzip's (Kim et al. 2025): after a chunk is in the cache, one teacher-forced pass of
 *              "repeat the previous context" followed by the chunk; a token's score is the largest
 *              attention probability any query of that pass (any row, any query head of the KV
 *              head's group) gives it: the tokens the model needs to reproduce the context
 *
 * How it is used: importance_prefill runs a chunk through the model in place of model_forward_rows
 * and leaves every slot of every layer with its score: the slots the chunk added get the chunk's
 * scores, and the slots that were there keep what this object wrote before (surprisal), or the
 * larger of that and this pass's (recon: each chunk's pass attends over the whole cache, and a
 * token keeps the most any reconstruction needed it; KVzip's own chunked scoring keeps the same
 * maximum). Either way the attention the chunk's prefill added to the old slots is taken back
 * out (their scores are read before the chunk and written again after it): the attention sums
 * of a long prompt grow with its length and would drown a score of another scale. After the
 * prompt, decode attention adds to the scores as before.
 *
 * The recon pass keeps its own keys and values in a scratch of its own (never appended to the
 * session), reads the session's keys through store->gather (every tier, dequantized) and attends
 * exactly: one softmax over the cached slots and its own rows (causally), no log-weights (kvcd's
 * corrections of evicted mass belong to decode, not to what the context needs) and no mask of a
 * shared prefix's evicted slots. Its output feeds the next layer, so later layers see the
 * activations a real continuation would.
 *
 * The instruction (decision): plain text, no chat template, in KVzip's words: "\n\nRepeat the
 * previous context exactly." + "\n" before the first chunk, "\n\nRepeat the part of the previous
 * context exactly, starting with" + the last IMPORTANCE_QUOTE tokens before the chunk + "\n"
 * before a later one, each encoded by the model's tokenizer without its BOS. A template would
 * open a user turn inside whatever the prompt already is (often a chat turn of its own, left
 * open at the assistant's start), and the plain text is the same for a llama2.c checkpoint and a
 * chat model; the chunk's tokens, teacher-forced, carry the pass either way.
 *
 * Cost: the recon pass runs about as many rows as the chunk (plus the instruction), each
 * attending over the whole cache: about one more prefill (docs/policies.md has the measurement).
 *
 * Not thread-safe; one object per sequence.
 */
#ifndef KVC_ENGINE_IMPORTANCE_H
#define KVC_ENGINE_IMPORTANCE_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"

struct text;

enum importance_kind {
        IMPORTANCE_KIND_ATTENTION = 0,
        IMPORTANCE_KIND_SURPRISAL = 1,
        IMPORTANCE_KIND_RECON = 2,
};

/* The score of a token whose predecessor's logits importance_prefill did not see (position 0, or
 * the first after a shared prefix): above any surprisal a real model gives (ln of a 1M-token
 * vocabulary is 14), so the token is kept. */
#define IMPORTANCE_FIRST_SURPRISAL 1000.0f
/* Tokens of the previous chunk a later recon pass quotes after its instruction. */
#define IMPORTANCE_QUOTE 8u

/* Where a sequence's cached keys and scores are read and written, slots [0, n) of a layer in the
 * layouts of kvc_layer_gather ([n_kv_heads][n][head_dim]) and kvc_layer_set_scores ([n_kv_heads][n]);
 * kvccache.h has libkvc's, a test its own arrays. Each returns 0 or -errno. */
struct importance_store_ops {
        uint32_t (*tokens)(void *ctx, uint32_t layer);
        int (*gather)(void *ctx, uint32_t layer, uint32_t n, float *keys, float *values);
        int (*get_scores)(void *ctx, uint32_t layer, uint32_t n, float *score);
        int (*set_scores)(void *ctx, uint32_t layer, uint32_t n, const float *score);
};

/* "attention", "surprisal" or "recon"; -EINVAL for anything else. */
int importance_parse(const char *name, enum importance_kind *ret);
const char *importance_name(enum importance_kind kind);

struct importance;
/* An object for one sequence of model m. recon needs the model's text (its instruction is encoded
 * here: -EINVAL without one) and runs its attention on `threads` threads (0: every CPU). */
int importance_new(struct model *m, const struct text *tok, enum importance_kind kind, unsigned threads,
                   struct importance **ret);
struct importance *importance_free(struct importance *imp);
enum importance_kind importance_kind(const struct importance *imp);
/* Wall seconds importance_prefill spent beyond the chunks' own forward passes: the recon passes,
 * the scores read and written (what the scoring costs on top of the prefill). */
double importance_seconds(const struct importance *imp);

/* The most rows importance_prefill takes at once: MODEL_MAX_ROWS, and for surprisal the rows a
 * pass can give logits for (MODEL_MAX_LOGIT_ROWS for a GGUF, 1 for a llama2.c checkpoint). */
uint32_t importance_max_rows(const struct importance *imp);

/* One prompt chunk: rows[0..n) of one sequence (the same ctx, consecutive positions; their logits
 * flags are set here) through model_forward_rows with cache, then the scores of the object's kind
 * written through store (ctx: the rows' context) as the file comment says. *ret_logits gets the
 * last row's logits (vocab_size floats, the object's until its next call). -EINVAL for n outside
 * 1..importance_max_rows() or rows that are not so; -ESTALE when a layer did not grow by exactly
 * n slots during the pass (a plan applied inside it: run with a plan lag of 0); the model's, the
 * cache's or the store's error; -ENOMEM. */
int importance_prefill(struct importance *imp, struct model_row *rows, uint32_t n,
                       const struct model_cache_ops *cache, const struct importance_store_ops *store,
                       float **ret_logits);

/* ---- the parts, for tests ---- */

/* -ln softmax(logits)[token] (a log-sum-exp in double). */
double importance_surprisal(const float *logits, uint32_t vocab, int token);
/* The tokens of the recon pass for the chunk[0..n) that comes next: its instruction (with the
 * quote of the chunks importance_prefill saw before) and the chunk. -ENOBUFS past cap. */
int importance_recon_tokens(const struct importance *imp, const int *chunk, uint32_t n, int *out, size_t cap,
                            size_t *ret_n);

#endif
