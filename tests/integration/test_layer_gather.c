/* test_layer_gather.c: kvc_layer_gather against a real kvcd. A session's layer is copied out of the
 * pool's blocks into [n_kv_heads][tokens][head_dim] arrays: float32 blocks exactly, in slot order,
 * per head, also a sub-range into a larger array (the stride, and nothing written past the range);
 * float16 blocks converted; INT8 slots (a conf session with the INT8 tier) dequantized within
 * their quantization step, and full-precision slots exact after kvcd's plans moved them; bad
 * layers, ranges and strides refused with -EINVAL and the output left alone.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "block.h"
#include "harness.h"
#include "kvc.h"

#define H        2 /* KV heads */
#define D        8 /* head_dim */
#define SENTINEL -7.0f

static struct kvc_client *client(const struct daemon *d) {
        struct kvc_options o = { .socket = d->dir, .name = "gather", .timeout_ms = HARNESS_DEADLINE_MS };
        struct kvc_client *c = NULL;
        assert_int_equal(kvc_connect(&o, &c), 0);
        return c;
}

static struct kvc_session *session(struct kvc_client *c, enum kvc_dtype dtype, const char *policy,
                                   uint32_t budget, const struct kvc_param *params, size_t n_params) {
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = 2,
                              .n_heads = 4,
                              .n_kv_heads = H,
                              .head_dim = D,
                              .dtype = dtype,
                              .max_tokens = 1024 },
                .policy = policy,
                .budget_tokens = budget,
                .params = params,
                .n_params = n_params,
        };
        struct kvc_session *s = NULL;
        assert_int_equal(kvc_session_open(c, &cfg, &s), 0);
        return s;
}

static void finish(struct kvc_client *c, struct kvc_session *s) {
        assert_int_equal(kvc_session_close(s, NULL), 0);
        kvc_disconnect(c);
}

/* Token t's key (value: negated) in head h, channel j: distinct, and exact in float16. */
static float elem(uint32_t t, uint32_t h, uint32_t j) {
        return (float)(t * 16 + h * 8 + j) / 64.0f;
}

static void append_tokens(struct kvc_session *s, uint32_t layer, uint32_t n) {
        for (uint32_t t = 0; t < n; t++) {
                float k[H * D], v[H * D];
                for (uint32_t h = 0; h < H; h++)
                        for (uint32_t j = 0; j < D; j++) {
                                k[h * D + j] = elem(t, h, j);
                                v[h * D + j] = -elem(t, h, j);
                        }
                assert_int_equal(kvc_append(s, layer, (int32_t)t, k, v), 0);
        }
}

/* out[h][i][j] holds token first + i for i < n, SENTINEL for n <= i < stride. */
static void assert_gathered(const float *k, const float *v, uint32_t first, uint32_t n, uint32_t stride) {
        for (uint32_t h = 0; h < H; h++)
                for (uint32_t i = 0; i < stride; i++)
                        for (uint32_t j = 0; j < D; j++) {
                                size_t at = ((size_t)h * stride + i) * D + j;
                                float want = i < n ? elem(first + i, h, j) : SENTINEL;
                                if (k[at] != want || v[at] != (i < n ? -want : SENTINEL))
                                        fail_msg("head %u row %u channel %u: %g %g, want %g", h, i, j, k[at],
                                                 v[at], want);
                        }
}

static void fill(float *a, size_t n) {
        for (size_t i = 0; i < n; i++)
                a[i] = SENTINEL;
}

static void a_float32_layer_is_gathered_per_head_in_slot_order(void **state) {
        struct kvc_client *c = client(*state);
        struct kvc_session *s = session(c, KVC_DTYPE_F32, "full", 0, NULL, 0);
        append_tokens(s, 1, 40); /* two whole blocks of 16 and 8 in a third */
        float k[H * 48 * D], v[H * 48 * D];
        fill(k, H * 48 * D);
        fill(v, H * 48 * D);
        assert_int_equal(kvc_layer_gather(s, 1, 0, 40, 0, k, v), 0);
        assert_gathered(k, v, 0, 40, 40);

        /* slots [5, 37) across three blocks into an array of 48 rows a head: rows past 32 untouched */
        fill(k, H * 48 * D);
        fill(v, H * 48 * D);
        assert_int_equal(kvc_layer_gather(s, 1, 5, 32, 48, k, v), 0);
        assert_gathered(k, v, 5, 32, 48);
        assert_int_equal(kvc_layer_gather(s, 0, 0, 0, 0, NULL, NULL), 0); /* an empty layer, nothing */
        finish(c, s);
}

static void float16_blocks_are_converted_to_float32(void **state) {
        struct kvc_client *c = client(*state);
        struct kvc_session *s = session(c, KVC_DTYPE_F16, "full", 0, NULL, 0);
        append_tokens(s, 0, 20);
        float k[H * 20 * D], v[H * 20 * D];
        assert_int_equal(kvc_layer_gather(s, 0, 0, 20, 0, k, v), 0);
        assert_gathered(k, v, 0, 20, 20);
        finish(c, s);
}

/* Slot s's block and its index in it, INT8 below n_q8. */
static uint8_t *slot_block(const struct kvc_layer_view *lv, uint32_t s, uint32_t *ret_i) {
        uint32_t T = lv->block_tokens;
        if (s < lv->n_q8) {
                *ret_i = s % T;
                return lv->q8_blocks[s / T];
        }
        *ret_i = (s - lv->n_q8) % T;
        return lv->blocks[(s - lv->n_q8) / T];
}

static void int8_slots_are_dequantized_and_moved_slots_follow_the_plan(void **state) {
        struct kvc_client *c = client(*state);
        const struct kvc_param int8 = { "int8", "1" };
        struct kvc_session *s = session(c, KVC_DTYPE_F32, "conf", 64, &int8, 1);
        enum { N = 300, VOCAB = 100 };
        static float keys[N][H * D];
        uint32_t seed = 12345;
        for (uint32_t t = 0; t < N; t++) {
                float v[H * D], q[4 * D], out[4 * D], logits[VOCAB];
                for (uint32_t i = 0; i < H * D; i++) {
                        keys[t][i] = (float)(seed = seed * 1103515245u + 12345u) / 4294967296.0f - 0.5f;
                        v[i] = -keys[t][i];
                }
                for (uint32_t i = 0; i < 4 * D; i++)
                        q[i] = (float)(seed = seed * 1103515245u + 12345u) / 4294967296.0f - 0.5f;
                for (uint32_t i = 0; i < VOCAB; i++)
                        logits[i] = (float)(seed = seed * 1103515245u + 12345u) / 4294967296.0f * 8.0f;
                assert_int_equal(kvc_append(s, 0, (int32_t)t, keys[t], v), 0);
                assert_int_equal(kvc_attend(s, 0, q, out), 0);
                struct kvc_summary sum;
                assert_int_equal(kvc_summarize(logits, VOCAB, &sum), 0);
                assert_int_equal(kvc_step(s, t, KVC_PHASE_DECODE, &sum), 0);
                assert_int_equal(kvc_flush(c), 0);
        }
        struct kvc_layer_view lv;
        assert_int_equal(kvc_layer_view(s, 0, &lv), 0);
        assert_true(lv.n_q8 > 0 && lv.n_tokens < N); /* evicted, and an INT8 tier */
        uint32_t n = lv.n_tokens;
        float *k = malloc((size_t)H * n * D * sizeof(float)), *v = malloc((size_t)H * n * D * sizeof(float));
        assert_non_null(k);
        assert_non_null(v);
        assert_int_equal(kvc_layer_gather(s, 0, 0, n, 0, k, v), 0);
        struct block_layout fp, q8;
        assert_int_equal(block_layout_init(&fp, lv.block_tokens, H, D, BLOCK_DTYPE_F32), 0);
        assert_int_equal(block_layout_init(&q8, lv.block_tokens, H, D, BLOCK_DTYPE_Q8), 0);
        for (uint32_t slot = 0; slot < n; slot++) {
                uint32_t i;
                uint8_t *b = slot_block(&lv, slot, &i);
                const struct block_layout *l = slot < lv.n_q8 ? &q8 : &fp;
                for (uint32_t h = 0; h < H; h++) {
                        int32_t pos = *(int32_t *)block_side(l, b, l->pos_offset, h, i);
                        assert_true(pos >= 0 && pos < N);
                        for (uint32_t j = 0; j < D; j++) {
                                float got = k[((size_t)h * n + slot) * D + j], want = keys[pos][h * D + j];
                                /* INT8: within two steps of the channel's scale (a token moved between
                                 * INT8 blocks was requantized); full precision: exact */
                                float tol = slot < lv.n_q8 ? 2.0f * block_kscale(&q8, b, h)[j] + 1e-6f : 0.0f;
                                if (fabsf(got - want) > tol)
                                        fail_msg("slot %u (pos %d) head %u channel %u: %g, want %g", slot,
                                                 pos, h, j, got, want);
                        }
                }
        }
        free(k);
        free(v);
        finish(c, s);
}

static void bad_layers_ranges_and_strides_are_refused(void **state) {
        struct kvc_client *c = client(*state);
        struct kvc_session *s = session(c, KVC_DTYPE_F32, "full", 0, NULL, 0);
        append_tokens(s, 0, 10);
        float k[H * 16 * D], v[H * 16 * D];
        fill(k, H * 16 * D);
        fill(v, H * 16 * D);
        assert_int_equal(kvc_layer_gather(s, 2, 0, 1, 0, k, v), -EINVAL);          /* no layer 2 */
        assert_int_equal(kvc_layer_gather(s, 0, 0, 11, 0, k, v), -EINVAL);         /* past the length */
        assert_int_equal(kvc_layer_gather(s, 0, 11, 0, 0, k, v), -EINVAL);         /* a start past it */
        assert_int_equal(kvc_layer_gather(s, 0, 9, UINT32_MAX, 0, k, v), -EINVAL); /* no wrap */
        assert_int_equal(kvc_layer_gather(s, 0, 0, 8, 4, k, v), -EINVAL);          /* a stride below n */
        assert_non_null(strstr(kvc_last_error(c), "stride"));
        assert_int_equal(kvc_layer_gather(s, 0, 0, 8, 0, NULL, v), -EINVAL); /* no output */
        for (size_t i = 0; i < H * 16 * D; i++)
                assert_true(k[i] == SENTINEL && v[i] == SENTINEL);
        finish(c, s);
}

static int setup(void **state) {
        return harness_group_start(state, NULL);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(a_float32_layer_is_gathered_per_head_in_slot_order),
                cmocka_unit_test(float16_blocks_are_converted_to_float32),
                cmocka_unit_test(int8_slots_are_dequantized_and_moved_slots_follow_the_plan),
                cmocka_unit_test(bad_layers_ranges_and_strides_are_refused),
        };
        return cmocka_run_group_tests(tests, setup, harness_group_stop);
}
