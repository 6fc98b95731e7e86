/* step.c: one decode step as libkvc sends it. Owns the queue of step summaries (kvc_step), their
 * StepBatch (one message for every session of the batch, kept whole until answered so that a
 * resume can send it again), the ring of batches in flight (at most KVC_MAX_PENDING, plan_lag of
 * them unanswered after a flush), and the handling of kvcd's answers: grants, published prefixes,
 * plans (plan.c) and per-step errors.
 *
 * Also the logits summary (kvc_summarize, the CPU reference of kernels/summary.h) and the
 * confidence formula kvcd uses, so clients can show what kvcd sees.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "summary.h"

/* The oldest StepBatch in flight, when request_id answers it, is done: true. */
static bool answered(struct kvc_client *c, uint64_t request_id) {
        if (!c->n_pending || c->pending[c->pending_head] != request_id)
                return false;
        struct sent_batch *b = &c->sent[c->pending_head];
        free(b->bytes);
        free(b->steps);
        *b = (struct sent_batch){ 0 };
        c->pending_head = (c->pending_head + 1) % KVC_MAX_PENDING;
        c->n_pending--;
        return true;
}

int step_dispatch(struct kvc_client *c, const Kvc__Envelope *env) {
        int r = 0;
        switch (env->body_case) {
        case KVC__ENVELOPE__BODY_PLAN_BATCH: {
                const Kvc__PlanBatch *pb = env->plan_batch;
                answered(c, env->request_id);
                for (size_t i = 0; i < pb->n_grants && r == 0; i++)
                        r = plan_grant(c, pb->grants[i]);
                for (size_t i = 0; i < pb->n_shared; i++) { /* published: never written again */
                        struct kvc_session *s = session_find(c, pb->shared[i]->session_id);
                        uint32_t S = pb->shared[i]->shared_tokens;
                        if (s && S >= s->n_shared && (uint64_t)s->mask_stride * 8 >= S &&
                            S / s->layout.block_tokens <= s->layers[0].t[0].n)
                                s->n_shared = S;
                }
                for (size_t i = 0; i < pb->n_plans; i++) {
                        int q = plan_apply(c, pb->plans[i]);
                        if (q < 0 && r == 0)
                                r = q;
                }
                for (size_t i = 0; i < pb->n_errors; i++) {
                        if (c->step_error == 0) {
                                c->step_error = -pb->errors[i]->code;
                                client_error(c, -pb->errors[i]->code, "session %llu: %s",
                                             (unsigned long long)pb->errors[i]->session_id,
                                             pb->errors[i]->message);
                        }
                }
                return r;
        }
        case KVC__ENVELOPE__BODY_ERROR: {
                /* kvcd refused a whole StepBatch (it failed validation): its answer all the same */
                if (env->request_id && answered(c, env->request_id) && c->step_error == 0)
                        c->step_error = -env->error->code;
                /* about a session, unasked: kvcd closed it (an operator evicted it) */
                struct kvc_session *s = env->request_id == 0 ? session_find(c, env->error->session_id) : NULL;
                if (s)
                        s->closed_by_kvcd = env->error->code;
                /* else an answer to a PlanApplied: kvcd refused our account of a plan */
                return client_error(c, -env->error->code, "kvcd: %s", env->error->message);
        }
        default: return client_error(c, -EPROTO, "unexpected %s from kvcd", wire_body_name(env->body_case));
        }
}

int kvc_summarize(const float *logits, uint32_t vocab, struct kvc_summary *ret) {
        struct summary sm;
        int r = summary_logits_ref(logits, vocab, &sm, NULL, 0);
        if (r < 0)
                return r;
        *ret = (struct kvc_summary){
                .entropy = sm.entropy, .top1_prob = sm.top1_prob, .margin = sm.margin, .top1 = sm.top1
        };
        return 0;
}

float kvc_confidence(const struct kvc_summary *s) {
        return 0.4f * (1.0f - s->entropy) + 0.3f / (1.0f + expf(-s->margin)) + 0.3f * s->top1_prob;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
        if (need <= *cap)
                return 0;
        size_t n = *cap ? *cap * 2 : 16;
        while (n < need)
                n *= 2;
        void *q = realloc(*p, n * elem);
        if (!q)
                return -ENOMEM;
        *p = q;
        *cap = n;
        return 0;
}

int kvc_step(struct kvc_session *s, uint64_t step, enum kvc_phase phase, const struct kvc_summary *sum) {
        struct kvc_client *c = s->c;
        if (s->closed_by_kvcd)
                return client_error(c, -s->closed_by_kvcd, "kvcd closed session %llu",
                                    (unsigned long long)s->id);
        if (s->stepped && step <= s->last_step)
                return client_error(c, -EINVAL, "step %llu is not after %llu", (unsigned long long)step,
                                    (unsigned long long)s->last_step);
        if (c->n_queue >= WIRE_MAX_STEPS)
                return client_error(c, -ENOSPC, "%u steps queued: flush first", WIRE_MAX_STEPS);
        if (grow((void **)&c->queue, &c->cap_queue, c->n_queue + 1, sizeof(*c->queue)) < 0 ||
            grow((void **)&c->lengths, &c->cap_lengths, c->n_lengths + s->g.n_layers, sizeof(uint32_t)) < 0)
                return -ENOMEM;
        c->queue[c->n_queue++] = (struct queued_step){
                .session_id = s->id,
                .prev_step = s->last_step,
                .prev_stepped = s->stepped,
                .step = step,
                .phase = phase,
                .entropy = sum->entropy,
                .top1_prob = sum->top1_prob,
                .margin = sum->margin,
                .n_layers = s->g.n_layers,
                .lengths_at = c->n_lengths,
        };
        for (uint32_t l = 0; l < s->g.n_layers; l++)
                c->lengths[c->n_lengths++] = s->layers[l].n_tokens;
        s->last_step = step;
        s->stepped = true;
        s->stats.steps++;
        return 0;
}

static int send_steps(struct kvc_client *c) {
        Kvc__Step *steps = calloc(c->n_queue, sizeof(*steps));
        Kvc__Step **sp = calloc(c->n_queue, sizeof(*sp));
        if (!steps || !sp) {
                free(steps);
                free(sp);
                return -ENOMEM;
        }
        for (size_t i = 0; i < c->n_queue; i++) {
                const struct queued_step *q = &c->queue[i];
                kvc__step__init(&steps[i]);
                steps[i].session_id = q->session_id;
                steps[i].step = q->step;
                steps[i].phase =
                        q->phase == KVC_PHASE_PREFILL ? KVC__PHASE__PHASE_PREFILL : KVC__PHASE__PHASE_DECODE;
                steps[i].n_layer_tokens = q->n_layers;
                steps[i].layer_tokens = c->lengths + q->lengths_at;
                steps[i].entropy = q->entropy;
                steps[i].top1_prob = q->top1_prob;
                steps[i].margin = q->margin;
                sp[i] = &steps[i];
        }
        Kvc__StepBatch sb = KVC__STEP_BATCH__INIT;
        sb.n_steps = c->n_queue;
        sb.steps = sp;
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.request_id = ++c->next_request_id;
        env.body_case = KVC__ENVELOPE__BODY_STEP_BATCH;
        env.step_batch = &sb;
        env.version = WIRE_VERSION;
        uint32_t slot = (c->pending_head + c->n_pending) % KVC_MAX_PENDING;
        struct sent_batch b = { .len = wire_packed_size(&env), .n_steps = c->n_queue };
        b.bytes = malloc(b.len);
        b.steps = malloc(c->n_queue * sizeof(*b.steps));
        int r = b.bytes && b.steps ? 0 : -ENOMEM;
        if (r == 0) {
                wire_pack(&env, b.bytes);
                memcpy(b.steps, c->queue, c->n_queue * sizeof(*b.steps));
                r = client_send_packed(c, b.bytes, b.len);
        }
        free(steps);
        free(sp);
        if (r < 0) {
                free(b.bytes);
                free(b.steps);
                return r;
        }
        c->sent[slot] = b;
        c->pending[slot] = env.request_id;
        c->n_pending++;
        c->n_queue = 0;
        c->n_lengths = 0;
        return 0;
}

int kvc_flush(struct kvc_client *c) {
        int r = 0;
        c->step_error = 0;
        if (c->n_queue) {
                if (c->n_pending >= KVC_MAX_PENDING - 1) /* make room: wait for the oldest answer */
                        while (c->n_pending >= KVC_MAX_PENDING - 1 && (r = kvc_poll(c, c->timeout_ms)) >= 0)
                                ;
                if (r < 0 || (r = send_steps(c)) < 0)
                        return r;
        }
        /* and the links of demotions kvcd cut up (plan.c): a session steps again once it has them */
        while (c->n_pending > c->plan_lag || (c->plan_lag == 0 && c->n_links)) {
                Kvc__Envelope *in;
                r = client_recv(c, c->timeout_ms, &in);
                if (r == -ENOTCONN && (r = resume_recover(c)) == 0)
                        continue; /* the unanswered batches went again */
                if (r < 0)
                        return r;
                int q = step_dispatch(c, in);
                if (q < 0 && r == 0)
                        r = q;
        }
        return r < 0 ? r : c->step_error;
}

int kvc_poll(struct kvc_client *c, int timeout_ms) {
        int handled = 0;
        for (;;) {
                Kvc__Envelope *in;
                int r = client_recv(c, handled ? 0 : timeout_ms, &in);
                if (r == -ENOTCONN && (r = resume_recover(c)) == 0)
                        continue;
                if (r == -ETIMEDOUT)
                        return handled;
                if (r < 0)
                        return r;
                step_dispatch(c, in);
                handled++;
        }
}
