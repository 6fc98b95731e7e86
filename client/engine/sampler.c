/* sampler.c - argmax and seeded temperature sampling, as llama2.c run.c.
 *
 * Owns: struct sampler. The arithmetic copies llama2.c (divide logits by T, max-subtracted softmax,
 * a coin from the top 24 bits of xorshift64*, first index whose running CDF exceeds the coin) so
 * runs can be compared with llama2.c's token for token. Logits are copied to a buffer owned by the
 * sampler rather than modified in place, because the caller's logits belong to the model.
 */
#include "sampler.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

#define SAMPLER_MAX_VOCAB             (1 << 20)
#define SAMPLER_ZERO_SEED_REPLACEMENT 0x9E3779B97F4A7C15ull

struct sampler {
        int vocab_size;
        float temperature;
        uint64_t rng_state;
        float *probs; /* [vocab_size] */
};

int sampler_new(int vocab_size, float temperature, uint64_t seed, struct sampler **ret) {
        struct sampler *s;

        if (!ret || vocab_size <= 0 || vocab_size > SAMPLER_MAX_VOCAB || !isfinite(temperature) ||
            temperature < 0.0f)
                return -EINVAL;
        s = calloc(1, sizeof(*s));
        if (!s)
                return -ENOMEM;
        s->probs = malloc((size_t)vocab_size * sizeof(float));
        if (!s->probs) {
                free(s);
                return -ENOMEM;
        }
        s->vocab_size = vocab_size;
        s->temperature = temperature;
        s->rng_state = seed ? seed : SAMPLER_ZERO_SEED_REPLACEMENT;
        *ret = s;
        return 0;
}

struct sampler *sampler_free(struct sampler *s) {
        if (!s)
                return NULL;
        free(s->probs);
        free(s);
        return NULL;
}

static uint32_t sampler_random_u32(uint64_t *state) {
        *state ^= *state >> 12;
        *state ^= *state << 25;
        *state ^= *state >> 27;
        return (uint32_t)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}

/* Uniform in [0, 1). */
static float sampler_random_f32(uint64_t *state) {
        return (float)(sampler_random_u32(state) >> 8) / 16777216.0f;
}

int sampler_argmax(const float *values, int n, int *ret_token) {
        int max_i = 0;
        float max_p;

        if (!values || n <= 0 || !ret_token)
                return -EINVAL;
        max_p = values[0];
        for (int i = 1; i < n; i++) {
                if (values[i] > max_p) {
                        max_i = i;
                        max_p = values[i];
                }
        }
        *ret_token = max_i;
        return 0;
}

int sampler_sample(struct sampler *s, const float *logits, int *ret_token) {
        float *p, max_val, sum = 0.0f, coin, cdf = 0.0f;
        int n;

        if (!s || !logits || !ret_token)
                return -EINVAL;
        if (s->temperature == 0.0f)
                return sampler_argmax(logits, s->vocab_size, ret_token);

        p = s->probs;
        n = s->vocab_size;
        for (int i = 0; i < n; i++)
                p[i] = logits[i] / s->temperature;
        max_val = p[0];
        for (int i = 1; i < n; i++)
                if (p[i] > max_val)
                        max_val = p[i];
        for (int i = 0; i < n; i++) {
                p[i] = expf(p[i] - max_val);
                sum += p[i];
        }
        for (int i = 0; i < n; i++)
                p[i] /= sum;

        coin = sampler_random_f32(&s->rng_state);
        for (int i = 0; i < n; i++) {
                cdf += p[i];
                if (coin < cdf) {
                        *ret_token = i;
                        return 0;
                }
        }
        *ret_token = n - 1;
        return 0;
}
