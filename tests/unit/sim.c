/* sim.c: kvcd in process for unit tests (sim.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "pool.h"
#include "prefix.h"
#include "sim.h"

struct sim *sim_new(uint64_t capacity) {
        struct sim *m = calloc(1, sizeof(*m));
        assert_non_null(m);
        struct kvcd *d = &m->d;
        budget_init(&d->budget);
        assert_int_equal(backend_find("host", &d->backend), 0);
        assert_int_equal(pool_new(d->backend, capacity, CHUNK, &d->pool), 0);
        assert_int_equal(idmap_init(&d->sessions, 64), 0);
        assert_int_equal(prefix_init(d), 0);
        assert_int_equal(wire_arena_new(WIRE_REQUEST_MAX_BYTES, &d->in), 0);
        assert_int_equal(wire_arena_new(WIRE_REPLY_MAX_BYTES, &d->out), 0);
        d->events_fd = d->fd_listen = d->act_client_fd = d->act_admin_fd = d->sig_fd = d->lock_fd = -1;
        for (size_t i = 0; i < KVCD_MAX_CLIENTS; i++)
                m->peer[i] = -1;
        return m;
}

/* Reads and drops what kvcd sent on every side channel (chunk fds included). */
void sim_drain(struct sim *m) {
        for (size_t i = 0; i < KVCD_MAX_CLIENTS; i++) {
                if (m->peer[i] < 0)
                        continue;
                for (;;) {
                        char buf[256];
                        union {
                                struct cmsghdr align;
                                char b[CMSG_SPACE(sizeof(int) * 4)];
                        } ctl;
                        struct iovec iov = { .iov_base = buf, .iov_len = sizeof(buf) };
                        struct msghdr mh = { .msg_iov = &iov,
                                             .msg_iovlen = 1,
                                             .msg_control = ctl.b,
                                             .msg_controllen = sizeof(ctl.b) };
                        if (recvmsg(m->peer[i], &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) <= 0)
                                break;
                        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
                                if (c->cmsg_type != SCM_RIGHTS)
                                        continue;
                                for (size_t k = 0; k < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); k++) {
                                        int fd;
                                        memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof(int));
                                        close(fd);
                                }
                        }
                }
        }
}

struct client *sim_client_new(struct sim *m, uid_t uid, gid_t gid) {
        struct kvcd *d = &m->d;
        int sv[2];
        assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv), 0);
        struct client *c = calloc(1, sizeof(*c));
        assert_non_null(c);
        c->id = ++d->next_client_id;
        c->fd = sv[0];
        c->uid = uid;
        c->gid = gid;
        c->pid = 0; /* no process kvcd could watch: a dead client's chunks are scrubbed at once */
        c->bound = true;
        assert_true(d->n_clients < KVCD_MAX_CLIENTS);
        d->clients[d->n_clients++] = c;
        assert_int_equal(m->peer[c->id % KVCD_MAX_CLIENTS], -1);
        m->peer[c->id % KVCD_MAX_CLIENTS] = sv[1];
        return c;
}

/* The client dies: kvcd sees its side channel hang up. */
void sim_client_die(struct sim *m, struct client *c) {
        int *peer = &m->peer[c->id % KVCD_MAX_CLIENTS];
        sim_drain(m);
        close(*peer);
        *peer = -1;
        client_destroy(&m->d, c, true);
}

void sim_free(struct sim *m) {
        struct kvcd *d = &m->d;
        while (d->n_clients)
                sim_client_die(m, d->clients[0]);
        idmap_done(&d->sessions);
        prefix_done(d);
        pool_free(d->pool);
        plan_scratch_done(&d->scratch);
        wire_arena_free(d->in);
        wire_arena_free(d->out);
        budget_done(&d->budget);
        free(m);
}

int sim_open_session(struct sim *m, struct client *c, const struct open_args *a, struct session **ret,
                     char *why, size_t why_len) {
        Kvc__Geometry g = KVC__GEOMETRY__INIT;
        g.n_layers = 2;
        g.n_heads = 2;
        g.n_kv_heads = a->kv_heads ? a->kv_heads : 1;
        g.head_dim = a->head_dim ? a->head_dim : 16;
        g.dtype = KVC__DTYPE__DTYPE_F32;
        g.max_tokens = 512;
        Kvc__OpenSession o = KVC__OPEN_SESSION__INIT;
        o.geometry = &g;
        o.policy = (char *)a->policy;
        o.budget_tokens = a->budget;
        o.tenant = (char *)(a->tenant ? a->tenant : "");
        o.int8 = true;
        o.min_bytes = a->min;
        o.max_bytes = a->max;
        o.priority = a->priority;
        o.prompt_token_ids = (uint32_t *)a->prompt;
        o.n_prompt_token_ids = a->n_prompt;
        o.model_id = (char *)(a->model_id ? a->model_id : "");
        o.share_prefix = a->share;
        Kvc__Param param = KVC__PARAM__INIT, *params[1] = { &param };
        if (a->param) {
                param.key = (char *)a->param;
                param.value_case = KVC__PARAM__VALUE_NUMBER;
                param.number = a->value;
                o.params = params;
                o.n_params = 1;
        }
        why[0] = '\0';
        int r = session_open(&m->d, c, &o, ret, why, why_len);
        sim_drain(m);
        return r;
}

/* The client's side of a plan: keep what it keeps, release the blocks no longer needed. */
void sim_apply(struct sim *m, struct session *s, const Kvc__Plan *p) {
        uint32_t T = s->layout.block_tokens, tokens[WIRE_MAX_LAYERS], q8[WIRE_MAX_LAYERS];
        Kvc__LayerBlocks lbs[2 * WIRE_MAX_LAYERS], *rel[2 * WIRE_MAX_LAYERS];
        size_t n_rel = 0;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                tokens[l] = s->layers[l].n_tokens;
                q8[l] = s->layers[l].low[1];
        }
        for (size_t i = 0; i < p->n_layers; i++) {
                tokens[p->layers[i]->layer] = p->layers[i]->keep_count;
                q8[p->layers[i]->layer] = p->layers[i]->q8_tokens;
        }
        for (uint32_t l = 0; l < s->n_layers; l++) {
                struct session_layer *L = &s->layers[l];
                uint32_t need[2] = { (tokens[l] - q8[l] + T - 1) / T, (q8[l] + T - 1) / T };
                struct block_table *t[2] = { &L->t[0], &L->t[1] }; /* the INT8 tier, as a client before the ladder */
                for (int k = 0; k < 2; k++) {
                        if (t[k]->n <= need[k])
                                continue;
                        Kvc__LayerBlocks *lb = &lbs[n_rel];
                        kvc__layer_blocks__init(lb);
                        lb->layer = l;
                        lb->q8 = k == 1;
                        lb->n_blocks = t[k]->n - need[k];
                        lb->blocks = t[k]->blocks + need[k];
                        rel[n_rel++] = lb;
                }
        }
        Kvc__PlanApplied a = KVC__PLAN_APPLIED__INIT;
        a.session_id = s->id;
        a.plan_id = p->plan_id;
        a.n_layer_tokens = s->n_layers;
        a.layer_tokens = tokens;
        a.n_layer_q8_tokens = s->n_layers;
        a.layer_q8_tokens = q8;
        a.n_released = n_rel;
        a.released = rel;
        char why[256];
        int r = session_plan_applied(&m->d, s, &a, why, sizeof(why));
        if (r < 0)
                fail_msg("plan %llu of session %llu not accepted: %s", (unsigned long long)p->plan_id,
                         (unsigned long long)s->id, why);
}

/* One decode step of s at the given confidence (0..1): the client appends a token when it has
 * room (asking kvcd for some when it has none), steps, and applies the plan now or leaves it
 * pending (*ret_plan, for the caller to apply later). */
int sim_step(struct sim *m, struct session *s, float confidence, bool apply_now, Kvc__Plan **ret_plan) {
        struct kvcd *d = &m->d;
        uint32_t T = s->layout.block_tokens, tokens[WIRE_MAX_LAYERS];
        char why[256];
        if (ret_plan)
                *ret_plan = NULL;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                const struct session_layer *L = &s->layers[l];
                tokens[l] = L->n_tokens;
        }
        bool room = true;
        for (uint32_t l = 0; l < s->n_layers && room; l++) {
                const struct session_layer *L = &s->layers[l];
                room = L->n_tokens + 1 <= L->low[1] + L->t[0].n * T && L->n_tokens + 1 <= s->max_layer_tokens;
        }
        if (!room && s->pending_plan_id == 0 && s->layers[0].n_tokens + 1 <= s->max_layer_tokens) {
                Kvc__Grant *g;
                wire_arena_reset(d->out);
                int r = session_reserve(d, s, s->layers[0].n_tokens + 1, &g, why, sizeof(why));
                sim_drain(m);
                room = r == 0;
                if (r < 0 && r != -ENOSPC && r != -EINPROGRESS)
                        fail_msg("reserve: %s", why);
        }
        if (room)
                for (uint32_t l = 0; l < s->n_layers; l++)
                        tokens[l]++;
        Kvc__Step st = KVC__STEP__INIT;
        st.session_id = s->id;
        st.step = m->step[s->id]++;
        st.phase = KVC__PHASE__PHASE_DECODE;
        st.n_layer_tokens = s->n_layers;
        st.layer_tokens = tokens;
        st.entropy = 1.0f - confidence;
        st.top1_prob = confidence;
        st.margin = 0;
        Kvc__Plan *p;
        Kvc__Grant *g;
        wire_arena_reset(d->out);
        int r = session_step(d, s, &st, &p, &g, why, sizeof(why));
        sim_drain(m);
        if (r < 0)
                fail_msg("step of session %llu: %s", (unsigned long long)s->id, why);
        if (p && apply_now)
                sim_apply(m, s, p);
        else if (p && ret_plan)
                *ret_plan = p; /* lives in d->out until the next reset: the caller applies it first */
        return 0;
}
