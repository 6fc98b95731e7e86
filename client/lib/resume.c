/* resume.c: a client outliving a kvcd restart. When kvcd said it keeps our pool (Welcome.resumable,
 * systemd's fd store), a hung-up side channel is not the end: the client connects again until
 * resume_ms passes, checks the pool is the same one, resumes every session from its own tables
 * (the client's tables are the truth), and sends again the StepBatches kvcd had not answered.
 * Sessions kvcd did not keep are marked closed; the others go on. A connection that breaks again
 * during all this (kvcd killed once more) is not kvcd's answer: the resume starts over, within the
 * same resume_ms.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int64_t now_ms(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* One session back from a restarted kvcd: our tables are the truth; the step before the first
 * unanswered one is where kvcd takes up (those steps are sent again). */
static int resume_session(struct kvc_client *c, struct kvc_session *s) {
        Kvc__Resume m = KVC__RESUME__INIT;
        m.session_id = s->id;
        m.token.data = s->token;
        m.token.len = sizeof(s->token);
        m.last_step = s->last_step;
        m.stepped = s->stepped;
        bool found = false;
        for (uint32_t i = 0; i < c->n_pending && !found; i++) {
                const struct sent_batch *b = &c->sent[(c->pending_head + i) % KVC_MAX_PENDING];
                for (size_t k = 0; k < b->n_steps && !found; k++) {
                        if (b->steps[k].session_id != s->id)
                                continue;
                        m.last_step = b->steps[k].prev_step;
                        m.stepped = b->steps[k].prev_stepped;
                        found = true;
                }
        }
        m.last_plan_id = s->last_plan_id;
        size_t per = LADDER_TIERS; /* per layer: a tier's blocks, its pointer and its count */
        Kvc__ResumeLayer *layers = calloc(s->g.n_layers, sizeof(*layers));
        Kvc__ResumeLayer **lp = calloc(s->g.n_layers, sizeof(*lp));
        Kvc__LayerBlocks *tb = calloc(s->g.n_layers * per, sizeof(*tb));
        Kvc__LayerBlocks **tbp = calloc(s->g.n_layers * per, sizeof(*tbp));
        uint32_t *tt = calloc(s->g.n_layers * per, sizeof(*tt));
        int r = layers && lp && tb && tbp && tt ? 0 : -ENOMEM;
        for (uint32_t l = 0; r == 0 && l < s->g.n_layers; l++) {
                struct layer *L = &s->layers[l];
                kvc__resume_layer__init(&layers[l]);
                layers[l].n_tokens = L->n_tokens;
                layers[l].n_fp_blocks = L->t[0].n;
                layers[l].fp_blocks = L->t[0].offs;
                if (s->n_tiers == 2 && s->tiers[1].dtype == BLOCK_DTYPE_Q8) { /* a kvcd before the ladder reads these */
                        layers[l].n_q8 = L->low[1];
                        layers[l].n_q8_blocks = L->t[1].n;
                        layers[l].q8_blocks = L->t[1].offs;
                }
                for (uint32_t t = 1; t < s->n_tiers; t++) {
                        Kvc__LayerBlocks *b = &tb[l * per + t - 1];
                        kvc__layer_blocks__init(b);
                        b->layer = l;
                        b->tier = t;
                        b->n_blocks = L->t[t].n;
                        b->blocks = L->t[t].offs;
                        tbp[l * per + t - 1] = b;
                        tt[l * per + t - 1] = L->low[t];
                }
                if (s->n_tiers > 1) {
                        layers[l].tier_blocks = tbp + l * per;
                        layers[l].n_tier_blocks = s->n_tiers - 1;
                        layers[l].tier_tokens = tt + l * per;
                        layers[l].n_tier_tokens = s->n_tiers - 1;
                }
                lp[l] = &layers[l];
        }
        m.n_layers = s->g.n_layers;
        m.layers = lp;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_RESUME;
        env.resume = &m;
        if (r == 0)
                r = client_call(c, &env, KVC__ENVELOPE__BODY_RESUMED, &in);
        if (r == 0 && s->awaiting_link) { /* the new kvcd knows of no link: none comes */
                s->awaiting_link = false;
                c->n_links--;
        }
        free(layers);
        free(lp);
        free(tb);
        free(tbp);
        free(tt);
        return r;
}

/* A failure of the connection itself rather than kvcd's answer: kvcd died again (or is not back
 * yet). Such a failure says nothing about the session, so the resume is tried again. */
static bool transport_failure(int r) {
        return r == -ECONNREFUSED || r == -ENOTCONN || r == -ECONNRESET || r == -EPIPE;
}

/* kvcd went away (its side channel hung up). When it said it keeps our pool across a restart:
 * connect again until resume_ms passes, resume every session, and send again the step batches
 * it had not answered. When kvcd dies again during the resume (a crash loop, or systemd's restart
 * killed), the whole resume starts over on the next kvcd within the same resume_ms: only kvcd's
 * own refusal of a session (it did not keep it) loses that session. Otherwise, or when that
 * fails, -ENOTCONN. */
int resume_recover(struct kvc_client *c) {
        if (!c->resumable || c->recovering || c->resume_ms < 0)
                return client_error(c, -ENOTCONN, "kvcd closed the connection");
        c->recovering = true;
        int64_t deadline = now_ms() + c->resume_ms;
        bool device = false;
        uint8_t uuid[16];
        Kvc__Envelope *in = NULL;
        int r;
        for (;;) {
                client_close_channels(c);
                r = client_open_channels(c, &device, uuid, &in);
                /* kvcd not back yet: no listener, a refused connection, or no Welcome in time */
                if (r < 0 && (transport_failure(r) || r == -ENOENT || r == -ETIMEDOUT) &&
                    now_ms() < deadline) {
                        poll(NULL, 0, 50);
                        continue;
                }
                if (r == 0 &&
                    (in->welcome->chunk_bytes != c->chunk_bytes || in->welcome->pool_bytes != c->pool_bytes ||
                     device != (c->dev != NULL) || (device && memcmp(uuid, c->device_uuid, 16) != 0)))
                        r = client_error(c, -ESTALE, "kvcd came back with another pool");
                if (r < 0)
                        break;
                c->client_id = in->welcome->client_id;
                c->resumable = in->welcome->resumable;
                bool again = false;
                for (struct kvc_session *s = c->sessions; s && !again; s = s->next) {
                        if (s->closed_by_kvcd)
                                continue;
                        int q = resume_session(c, s);
                        if (q < 0 && transport_failure(q))
                                again = true; /* kvcd died during the resume: say nothing yet */
                        else if (q < 0) /* kvcd did not keep it: the session is lost, the others go on */
                                s->closed_by_kvcd = -q;
                }
                for (uint32_t i = 0; i < c->n_pending && !again; i++) {
                        const struct sent_batch *b = &c->sent[(c->pending_head + i) % KVC_MAX_PENDING];
                        r = client_send_packed(c, b->bytes, b->len);
                        again = r < 0;
                }
                if (!again)
                        break;
                r = client_error(c, -ENOTCONN, "kvcd went away again during the resume");
                if (now_ms() >= deadline)
                        break;
        }
        c->recovering = false;
        if (r < 0)
                return client_error(c, -ENOTCONN, "kvcd closed the connection and did not come back: %s",
                                    c->error[0] ? c->error : strerror(-r));
        return 0;
}
