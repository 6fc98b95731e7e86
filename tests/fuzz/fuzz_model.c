/* fuzz_model.c: libFuzzer target for kvc-run's checkpoint loader (client/model.c).
 *
 * The input is a whole llama2.c checkpoint. model_load_buffer() must refuse anything whose header
 * is out of range or whose length does not match it to the byte; what it accepts must run: two
 * forward steps (positions 0 and 1, when the context has two) over a plain cache of two
 * positions. Nothing is asserted about the logits (a checkpoint of NaNs is a valid checkpoint);
 * the sanitizers watch every access, and the config must agree with what the loader promised.
 *
 * Seeds are tiny synthetic checkpoints (dim 8, one or two layers) written by tests/fuzz/seeds.c:
 * the real 1 MB model would drown the fuzzer.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "model.h"

#define FUZZ_CHECK(cond)                                                                                     \
        do {                                                                                                 \
                if (!(cond)) {                                                                               \
                        fprintf(stderr, "fuzz_model: %s:%d: %s\n", __FILE__, __LINE__, #cond);               \
                        abort();                                                                             \
                }                                                                                            \
        } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        struct model *m;
        int r = model_load_buffer(data, size, &m);
        FUZZ_CHECK(r == 0 || r == -EINVAL || r == -ENOMEM);
        if (r < 0)
                return 0;

        const struct model_config *c = model_get_config(m);
        FUZZ_CHECK(c->dim > 0 && c->hidden_dim > 0 && c->n_layers > 0 && c->n_heads > 0 &&
                   c->n_kv_heads > 0 && c->vocab_size > 0 && c->seq_len > 0);
        FUZZ_CHECK(c->n_heads % c->n_kv_heads == 0 && c->dim % c->n_heads == 0 &&
                   (c->dim / c->n_heads) % 2 == 0);
        /* every weight is in the file: the length bounds the sizes */
        FUZZ_CHECK((uint64_t)c->vocab_size * (uint64_t)c->dim * 4u <= size);

        struct plain_cache *pc;
        r = plain_cache_new(c, 2, &pc);
        FUZZ_CHECK(r == 0 || r == -ENOMEM);
        if (r == 0) {
                int token = (int)(size % (size_t)c->vocab_size);
                for (int pos = 0; pos < 2 && pos < c->seq_len; pos++) {
                        float *logits;
                        r = model_forward(m, token, pos, &plain_cache_ops, pc, &logits);
                        FUZZ_CHECK(r == 0);
                        token = (token + 1) % c->vocab_size;
                }
                FUZZ_CHECK(model_forward(m, c->vocab_size, 0, &plain_cache_ops, pc, &(float *){ NULL }) ==
                           -EINVAL);
                plain_cache_free(pc);
        }
        model_free(m);
        return 0;
}
