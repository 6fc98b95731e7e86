/* sim.h: kvcd in process, for unit tests of the daemon's session code (test_budget, test_gather).
 *
 * A struct kvcd with the real host pool, clients whose side channel is one end of a socketpair
 * (sim_drain reads and drops the chunk fds sent to them), and the client's part played by the
 * test: it appends while it has room, asks for room when it has none, and applies plans by
 * keeping the tokens the plan keeps and releasing the blocks it no longer needs.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "kvcd.h"

#define MIB   (1ull << 20)
#define CHUNK (2 * MIB)

struct sim {
        struct kvcd d;
        int peer[KVCD_MAX_CLIENTS]; /* the client's end of each side channel, by client id % max */
        uint64_t step[4096];        /* the next step number per session id (ids stay small here) */
};

struct open_args {
        const char *policy;
        uint32_t budget;
        uint64_t min, max;
        int32_t priority;
        const char *tenant;
        uint32_t kv_heads, head_dim; /* default 1 x 16: 2.5 KiB blocks; 2 x 128: 32 KiB */
        const char *param;           /* one numeric policy parameter, or NULL */
        double value;
        /* a shared prefix (prefix.c): the prompt's ids, the model's id and share_prefix */
        const uint32_t *prompt;
        size_t n_prompt;
        const char *model_id;
        bool share;
};

struct sim *sim_new(uint64_t capacity);
void sim_free(struct sim *m);
/* Reads and drops what kvcd sent on every side channel (chunk fds included). */
void sim_drain(struct sim *m);
struct client *sim_client_new(struct sim *m, uid_t uid, gid_t gid);
/* The client dies: kvcd sees its side channel hang up. */
void sim_client_die(struct sim *m, struct client *c);
/* Opens a session of 2 layers (F32, INT8 allowed) with the given policy and limits. */
int sim_open_session(struct sim *m, struct client *c, const struct open_args *a, struct session **ret,
                     char *why, size_t why_len);
/* The client's side of a plan: keep what it keeps, release the blocks no longer needed. */
void sim_apply(struct sim *m, struct session *s, const Kvc__Plan *p);
/* One decode step of s at the given confidence (0..1): the client appends a token when it has
 * room (asking kvcd for some when it has none), steps, and applies the plan now or leaves it
 * pending (*ret_plan, for the caller to apply later: it lives in d->out until the next reset). */
int sim_step(struct sim *m, struct session *s, float confidence, bool apply_now, Kvc__Plan **ret_plan);
