/* sampler.h - choosing the next token from logits: argmax, or temperature sampling.
 *
 * Owns: struct sampler, its probability scratch buffer and its random state. The generator is
 * llama2.c's xorshift64* (random_u32 / random_f32), so a seed gives the same coin flips as llama2.c
 * run.c with that seed; temperature sampling is its "sample_mult" over softmax(logits / T).
 * Temperature 0 is argmax and draws nothing from the generator. Top-p is not implemented.
 *
 * Not thread-safe: the random state advances on every temperature sample.
 */
#ifndef KVC_CLIENT_SAMPLER_H
#define KVC_CLIENT_SAMPLER_H

#include <stdint.h>

struct sampler;

/* temperature: finite, >= 0. seed 0 would freeze xorshift at zero, so it is replaced by a fixed
 * non-zero constant (documented, deterministic). Returns 0, -EINVAL, -ENOMEM. */
int sampler_new(int vocab_size, float temperature, uint64_t seed, struct sampler **ret);
struct sampler *sampler_free(struct sampler *s);

/* Picks a token from vocab_size logits (not modified). Returns 0 or -EINVAL. */
int sampler_sample(struct sampler *s, const float *logits, int *ret_token);

/* The index of the largest of n values, the first one on ties (llama2.c sample_argmax).
 * NaN never wins over a number after it. Returns 0 or -EINVAL (n <= 0, NULL). */
int sampler_argmax(const float *values, int n, int *ret_token);

#endif
