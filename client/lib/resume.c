/* resume.c: a client outliving a kvcd restart. When kvcd said it keeps our pool (Welcome.resumable,
 * systemd's fd store), a hung-up side channel is not the end: the client connects again until
 * resume_ms passes, checks the pool is the same one, resumes every session from its own tables
 * (the client's tables are the truth), and sends again the StepBatches kvcd had not answered.
 * Sessions kvcd did not keep are marked closed; the others go on.
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
        Kvc__ResumeLayer *layers = calloc(s->g.n_layers, sizeof(*layers));
        Kvc__ResumeLayer **lp = calloc(s->g.n_layers, sizeof(*lp));
        if (!layers || !lp) {
                free(layers);
                free(lp);
                return -ENOMEM;
        }
        for (uint32_t l = 0; l < s->g.n_layers; l++) {
                struct layer *L = &s->layers[l];
                kvc__resume_layer__init(&layers[l]);
                layers[l].n_tokens = L->n_tokens;
                layers[l].n_q8 = L->n_q8;
                layers[l].n_fp_blocks = L->fp.n;
                layers[l].fp_blocks = L->fp.offs;
                layers[l].n_q8_blocks = L->q8.n;
                layers[l].q8_blocks = L->q8.offs;
                lp[l] = &layers[l];
        }
        m.n_layers = s->g.n_layers;
        m.layers = lp;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_RESUME;
        env.resume = &m;
        int r = client_call(c, &env, KVC__ENVELOPE__BODY_RESUMED, &in);
        free(layers);
        free(lp);
        return r;
}

/* kvcd went away (its side channel hung up). When it said it keeps our pool across a restart:
 * connect again until resume_ms passes, resume every session, and send again the step batches
 * it had not answered. Otherwise, or when that fails, -ENOTCONN. */
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
                bool again = r == -ENOENT || r == -ECONNREFUSED || r == -ETIMEDOUT || r == -ENOTCONN ||
                             r == -ECONNRESET || r == -EPIPE;
                if (r == 0 || !again || now_ms() >= deadline)
                        break;
                poll(NULL, 0, 50);
        }
        if (r == 0 &&
            (in->welcome->chunk_bytes != c->chunk_bytes || in->welcome->pool_bytes != c->pool_bytes ||
             device != (c->dev != NULL) || (device && memcmp(uuid, c->device_uuid, 16) != 0)))
                r = client_error(c, -ESTALE, "kvcd came back with another pool");
        if (r == 0) {
                c->client_id = in->welcome->client_id;
                c->resumable = in->welcome->resumable;
                for (struct kvc_session *s = c->sessions; s; s = s->next) {
                        if (s->closed_by_kvcd)
                                continue;
                        int q = resume_session(c, s);
                        if (q < 0) /* kvcd did not keep it: the session is lost, the others go on */
                                s->closed_by_kvcd = -q;
                }
                for (uint32_t i = 0; i < c->n_pending && r == 0; i++) {
                        const struct sent_batch *b = &c->sent[(c->pending_head + i) % KVC_MAX_PENDING];
                        r = client_send_packed(c, b->bytes, b->len);
                }
        }
        c->recovering = false;
        if (r < 0)
                return client_error(c, -ENOTCONN, "kvcd closed the connection and did not come back: %s",
                                    c->error[0] ? c->error : strerror(-r));
        return 0;
}
