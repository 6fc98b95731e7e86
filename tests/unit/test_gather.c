/* test_gather.c: kvcd's two ways of reading a layer's side arrays give the policies one view.
 *
 * Owns: on a device pool kvcd reads each block's five side arrays (position, accumulated, EMA and
 * last attention, log-weight) in one copy and splits them (session.c, gather_block), where a host
 * pool reads them array by array and head by head. Two kvcds in process (tests/unit/sim.h) run
 * the same sessions over the same data, one of them with its backend marked as a device (the
 * memory stays host memory, so the staged path reads it through the same pool_read), and every
 * plan must come out the same: its layers, and its keep-sets in the plan buffer, step after step.
 * The data covers partial blocks (a layer's last block, an INT8 table ending inside a block),
 * per-head keep-sets (h2o), INT8 tables with their own layout (conf), and scores that differ per
 * head and per token.
 *
 * Also owns the log-weight increments a plan writes (prob's corrections, add_logw: one read and
 * one write per run of slots in a block): after each plan, every slot of the planned layer holds
 * exactly its old log-weight plus its increment, and no other slot changed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "pool.h"
#include "sim.h"

/* Where slot j of layer l lies, in kvcd's mapping of the pool: its block, layout and slot there. */
static uint8_t *slot_at(struct kvcd *d, const struct session *s, uint32_t l, uint32_t j,
                        const struct block_layout **lay, uint32_t *slot) {
        const struct session_layer *L = &s->layers[l];
        uint32_t T = s->layout.block_tokens;
        uint32_t q8 = L->low[1];
        *lay = j < q8 ? &s->tiers[1] : &s->layout;
        *slot = (j < q8 ? j : j - q8) % T;
        return pool_ptr(d->pool, j < q8 ? L->t[1].blocks[j / T] : L->t[0].blocks[(j - q8) / T]);
}

/* Writes the side arrays of the layers' newest slot: values from (layer, head, position, salt). */
static void write_newest(struct kvcd *d, struct session *s, int32_t pos) {
        for (uint32_t l = 0; l < s->n_layers; l++) {
                const struct block_layout *lay;
                uint32_t slot;
                uint8_t *b = slot_at(d, s, l, s->layers[l].n_tokens - 1, &lay, &slot);
                for (uint32_t h = 0; h < s->n_kv_heads; h++) {
                        uint32_t x = (uint32_t)pos * 2654435761u ^ (l * 97u + h * 31u);
                        float sum = (float)(x % 1000) / 100.0f, ema = (float)(x % 77) / 10.0f,
                              last = (float)(x % 13) / 13.0f, logw = 0.0f;
                        memcpy(block_side(lay, b, lay->pos_offset, h, slot), &pos, 4);
                        memcpy(block_side(lay, b, lay->sum_offset, h, slot), &sum, 4);
                        memcpy(block_side(lay, b, lay->ema_offset, h, slot), &ema, 4);
                        memcpy(block_side(lay, b, lay->last_offset, h, slot), &last, 4);
                        memcpy(block_side(lay, b, lay->logw_offset, h, slot), &logw, 4);
                }
        }
}

/* One decode step: room for one more token (a Reserve when needed), its side arrays, the step.
 * The plan, if any, is returned (in d->out, until the next step). */
static Kvc__Plan *one_step(struct sim *m, struct session *s, int32_t pos, float confidence) {
        struct kvcd *d = &m->d;
        char why[256];
        uint32_t tokens[WIRE_MAX_LAYERS];
        Kvc__Grant *g;
        wire_arena_reset(d->out);
        if (session_reserve(d, s, s->layers[0].n_tokens + 1, &g, why, sizeof(why)) < 0)
                fail_msg("reserve: %s", why);
        sim_drain(m);
        for (uint32_t l = 0; l < s->n_layers; l++) {
                s->layers[l].n_tokens++; /* the client appended: kvcd hears it with the step */
                tokens[l] = s->layers[l].n_tokens;
        }
        write_newest(d, s, pos);
        Kvc__Step st = KVC__STEP__INIT;
        st.session_id = s->id;
        st.step = (uint64_t)pos + 1;
        st.n_layer_tokens = s->n_layers;
        st.layer_tokens = tokens;
        st.entropy = 1.0f - confidence;
        st.top1_prob = confidence;
        Kvc__Plan *p;
        wire_arena_reset(d->out);
        if (session_step(d, s, &st, &p, &g, why, sizeof(why)) < 0)
                fail_msg("step: %s", why);
        sim_drain(m);
        return p;
}

static void same_plans(const char *policy, uint32_t budget, uint32_t kv_heads, const char *param) {
        struct sim *m[2] = { sim_new(8 * CHUNK), sim_new(8 * CHUNK) };
        struct backend_ops device = *m[1]->d.backend;
        device.device = true; /* kvcd reads side arrays as from GPU memory: staged, one copy per block */
        m[1]->d.backend = &device;
        struct session *s[2];
        char why[256];
        struct open_args a = { .policy = policy,
                               .budget = budget,
                               .kv_heads = kv_heads,
                               .head_dim = 16,
                               .param = param,
                               .value = 1 };
        for (int k = 0; k < 2; k++) {
                struct client *c = sim_client_new(m[k], 1000, 1000);
                if (sim_open_session(m[k], c, &a, &s[k], why, sizeof(why)) != 0)
                        fail_msg("open %s: %s", policy, why);
        }
        uint32_t plans = 0, q8 = 0;
        for (int32_t pos = 0; pos < 300; pos++) {
                float confidence = (pos / 40) % 2 ? 0.2f : 0.9f;
                Kvc__Plan *p[2];
                for (int k = 0; k < 2; k++)
                        p[k] = one_step(m[k], s[k], pos, confidence);
                if (!p[0] != !p[1])
                        fail_msg("%s, token %d: a plan on one side only", policy, pos);
                if (!p[0])
                        continue;
                plans++;
                assert_int_equal(p[0]->n_layers, p[1]->n_layers);
                for (size_t i = 0; i < p[0]->n_layers; i++) {
                        const Kvc__LayerPlan *x = p[0]->layers[i], *y = p[1]->layers[i];
                        assert_int_equal(x->layer, y->layer);
                        assert_int_equal(x->keep_count, y->keep_count);
                        assert_int_equal(x->per_head, y->per_head);
                        assert_int_equal(x->q8_tokens, y->q8_tokens);
                        q8 += x->q8_tokens;
                        size_t n = (size_t)x->keep_count * (x->per_head ? kv_heads : 1u) * 4u;
                        if (memcmp(pool_ptr(m[0]->d.pool, s[0]->plan_offset + (uint64_t)x->keep_offset * 4),
                                   pool_ptr(m[1]->d.pool, s[1]->plan_offset + (uint64_t)y->keep_offset * 4),
                                   n))
                                fail_msg("%s, token %d, layer %u: the keep-sets differ", policy, pos,
                                         x->layer);
                }
                for (int k = 0; k < 2; k++)
                        sim_apply(m[k], s[k], p[k]);
        }
        print_message("%s: %u plans alike (%u INT8 slots planned)\n", policy, plans, q8);
        assert_true(plans >= 5);
        if (param) /* conf with int8=1: INT8 tables were planned, and read through */
                assert_true(q8 > 0);
        for (int k = 0; k < 2; k++)
                sim_free(m[k]);
}

static void h2o_per_head_plans_are_the_same_on_both_paths(void **state) {
        (void)state;
        same_plans("h2o", 40, 2, NULL);
}

static void conf_int8_plans_are_the_same_on_both_paths(void **state) {
        (void)state;
        same_plans("conf", 48, 2, "int8");
}

static void tova_plans_are_the_same_on_both_paths(void **state) {
        (void)state;
        same_plans("tova", 24, 1, NULL);
}

/* slot j of layer l, head h: its log-weight in the pool */
static float *logw_at(struct kvcd *d, struct session *s, uint32_t l, uint32_t h, uint32_t j) {
        const struct block_layout *lay;
        uint32_t slot;
        uint8_t *b = slot_at(d, s, l, j, &lay, &slot);
        return block_side(lay, b, lay->logw_offset, h, slot);
}

static void plans_add_exactly_their_log_weight_increments(void **state) {
        (void)state;
        struct sim *m = sim_new(8 * CHUNK);
        struct kvcd *d = &m->d;
        struct session *s;
        char why[256];
        struct open_args a = { .policy = "prob", .budget = 32, .kv_heads = 2, .head_dim = 16 };
        struct client *c = sim_client_new(m, 1000, 1000);
        if (sim_open_session(m, c, &a, &s, why, sizeof(why)) != 0)
                fail_msg("open prob: %s", why);
        static float before[2][2][1024];
        uint32_t plans = 0, increments = 0;
        for (int32_t pos = 0; pos < 400; pos++) {
                for (uint32_t l = 0; l < s->n_layers; l++)
                        for (uint32_t h = 0; h < 2; h++)
                                for (uint32_t j = 0; j < 1024; j++) /* the token this step appends: 0 */
                                        before[l][h][j] =
                                                j < s->layers[l].n_tokens ? *logw_at(d, s, l, h, j) : 0.0f;
                Kvc__Plan *p = one_step(m, s, pos, 0.5f);
                if (!p)
                        continue;
                /* the scratch holds the last planned layer's increments */
                const Kvc__LayerPlan *lp = p->layers[p->n_layers - 1];
                uint32_t l = lp->layer, k = lp->keep_count, n = lp->base_tokens;
                const uint32_t *keep =
                        (const uint32_t *)pool_ptr(d->pool, s->plan_offset + (uint64_t)lp->keep_offset * 4);
                const float *delta = d->scratch.logw_delta;
                for (uint32_t h = 0; h < 2; h++) {
                        const uint32_t *kh = keep + (lp->per_head ? (size_t)h * k : 0);
                        const float *dh = delta + (lp->per_head ? (size_t)h * k : 0);
                        float want[1024];
                        memcpy(want, before[l][h], n * sizeof(float));
                        for (uint32_t i = 0; i < k; i++)
                                if (dh[i] != 0.0f && isfinite(dh[i])) {
                                        want[kh[i]] += dh[i];
                                        increments++;
                                }
                        for (uint32_t j = 0; j < n; j++)
                                if (memcmp(logw_at(d, s, l, h, j), &want[j], sizeof(float)))
                                        fail_msg("token %d, layer %u head %u slot %u: log-weight %g, not %g",
                                                 pos, l, h, j, *logw_at(d, s, l, h, j), want[j]);
                }
                plans++;
                sim_apply(m, s, p);
        }
        print_message("prob: %u plans, %u log-weight increments checked\n", plans, increments);
        assert_true(plans >= 5 && increments > 0);
        sim_free(m);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(h2o_per_head_plans_are_the_same_on_both_paths),
                cmocka_unit_test(conf_int8_plans_are_the_same_on_both_paths),
                cmocka_unit_test(tova_plans_are_the_same_on_both_paths),
                cmocka_unit_test(plans_add_exactly_their_log_weight_increments),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
