/* fuzz_gguf.c: libFuzzer target for the GGUF reader (client/engine/gguf.c) and llama.c's checks.
 *
 * The input is a whole GGUF file. gguf_open_buffer() must refuse what is malformed with -EINVAL or
 * -EOVERFLOW; what it accepts is walked completely (every key, every element of every string
 * array, every tensor's bytes, which must lie inside the input), then handed to llama_new, whose
 * refusals must name a reason; a model it accepts runs one forward step over a cache that returns
 * the values it was given. The sanitizers watch every access.
 *
 * Seeds: tiny llama models written by `build/tests/test_gguf --write-seeds DIR` (the same writer
 * the unit tests use), checked in under tests/fuzz/corpus/gguf.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "llama.h"

#define FUZZ_CHECK(cond)                                                                                     \
        do {                                                                                                 \
                if (!(cond)) {                                                                               \
                        fprintf(stderr, "fuzz_gguf: %s:%d: %s\n", __FILE__, __LINE__, #cond);                \
                        abort();                                                                             \
                }                                                                                            \
        } while (0)

static float kv_seen[1 << 12];
static volatile uint64_t sink;

static int store(void *ctx, int layer, int pos, const float *k, const float *v) {
        const struct model_config *c = ctx;
        size_t n = (size_t)(c->dim / c->n_heads) * (size_t)c->n_kv_heads;
        (void)layer;
        (void)pos;
        (void)k;
        if (n <= sizeof(kv_seen) / sizeof(kv_seen[0]))
                memcpy(kv_seen, v, n * sizeof(float));
        return 0;
}

static int attend(void *ctx, int layer, int pos, const float *q, float *out) {
        const struct model_config *c = ctx;
        (void)layer;
        (void)pos;
        (void)q;
        memset(out, 0, (size_t)c->dim * sizeof(float));
        return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        struct gguf *g;
        char why[256];
        int r = gguf_open_buffer(data, size, &g, why, sizeof(why));
        FUZZ_CHECK(r == 0 || r == -EINVAL || r == -EOVERFLOW || r == -ENOMEM);
        if (r < 0)
                return 0;
        uint64_t sum = 0;
        for (uint64_t i = 0; i < gguf_n_kv(g); i++) {
                const struct gguf_kv *kv = gguf_kv_at(g, i);
                FUZZ_CHECK((const uint8_t *)kv->key.s >= data &&
                           (const uint8_t *)kv->key.s + kv->key.len <= data + size);
                if (kv->value.type == GGUF_TYPE_ARRAY && kv->value.arr.elem_type == GGUF_TYPE_STRING)
                        for (uint64_t j = 0; j < kv->value.arr.n; j++) {
                                struct gguf_str s = gguf_array_str(&kv->value, j);
                                FUZZ_CHECK((const uint8_t *)s.s >= data &&
                                           (const uint8_t *)s.s + s.len <= data + size);
                                sum += s.len ? (uint8_t)s.s[s.len - 1] : 0;
                        }
        }
        for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
                const struct gguf_tensor *t = gguf_tensor_at(g, i);
                FUZZ_CHECK(t->data >= data && t->data + t->n_bytes <= data + size);
                if (t->n_bytes)
                        sum += t->data[t->n_bytes - 1];
        }
        struct llama *m = NULL;
        r = llama_new(&g, &(struct llama_options){ .threads = 1, .exact = true }, &m, why, sizeof(why));
        FUZZ_CHECK(g == NULL);
        FUZZ_CHECK(r == 0 || r == -ENOMEM || (r == -EINVAL && why[0]));
        if (r == 0) {
                const struct model_config *c = llama_config(m);
                /* every count of an accepted model is in range (issue 28: a context of 2^31 became a
                 * negative int that kvc-run sized its prompt buffer with) */
                FUZZ_CHECK(c->dim > 0 && c->hidden_dim > 0 && c->n_layers > 0 && c->n_heads > 0 &&
                           c->n_kv_heads > 0 && c->vocab_size > 0);
                FUZZ_CHECK(c->seq_len > 0 && c->seq_len <= MODEL_MAX_SEQ_LEN);
                struct model_cache_ops ops = { .store = store, .attend = attend };
                float *logits;
                FUZZ_CHECK(llama_forward(m, 0, 0, &ops, (void *)c, &logits) == 0);
                FUZZ_CHECK(llama_forward(m, 0, c->seq_len - 1, &ops, (void *)c, &logits) == 0);
                llama_free(m);
        }
        sink = sum; /* the bytes were read, so the sanitizers saw every access */
        return 0;
}
