/* relocate.c: emptying a chunk that still holds blocks, so that its owner can give it back
 * (docs/gpu.md, "Cooperative shrink", step 5). Owns the drain in progress (kvcd.relocate) and
 * each session's moves in flight (session.moves).
 *
 * When the pool is short of chunks and no owned chunk is empty, kvcd picks one client chunk to
 * drain: of those whose units are all blocks of the client's sessions (no plan buffer, nothing in
 * flight) and fit in the free room of the client's other chunks, the one with the fewest units in
 * use. The pool stops allocating there (pool_reclaim_drain), and every session with blocks there
 * gets a plan of moves only, sent unasked (request id 0) when it has no plan outstanding, or as
 * soon as the one it has is applied. A move's destination is allocated right away in the client's
 * other chunks; it is the pool's, not charged to the session, which holds as many blocks before
 * and after. The client copies each block and swaps its table entry. PlanApplied commits the
 * moves: the tables name the new blocks and the old ones are freed. A refused plan frees the
 * destinations and calls the drain off. When the chunk's last unit is freed, the pool raises its
 * shortage flag, and the next pick asks the client to unmap the chunk (client.c).
 *
 * One chunk drains at a time. A drain not finished within RELOCATE_DEADLINE_USEC (a session that
 * never answers) is called off, and no other starts for as long.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "handlers.h"
#include "kvcd.h"
#include "log.h"
#include "pool.h"

#define RELOCATE_DEADLINE_USEC (10u * 1000000u)
#define RELOCATE_RETRY_USEC    (100u * 1000u)

static uint32_t chunk_of(const struct kvcd *d, uint64_t off) {
        return (uint32_t)(off / pool_chunk_bytes(d->pool));
}

/* Blocks of a layer's tier-t table (the shared prefix's blocks are the prefix index's, and never move). */
static uint32_t first_own_block(const struct session *s, uint32_t t) {
        return t ? 0 : s->n_shared_blocks;
}

/* For client c, per chunk: how many units are blocks of its sessions (count), and whether
 * something else of its lies there (blocked: a plan buffer, a move in flight). */
static void survey(const struct kvcd *d, const struct client *c, uint32_t *count, bool *blocked) {
        for (const struct session *s = c->sessions; s; s = s->next) {
                if (session_pool_owner(s) != c->id) /* a hand-off session: chunks of its own */
                        continue;
                if (s->plan_units)
                        blocked[chunk_of(d, s->plan_offset)] = true;
                for (uint32_t i = 0; i < s->n_moves; i++)
                        blocked[chunk_of(d, s->moves[i].from)] = blocked[chunk_of(d, s->moves[i].to)] = true;
                for (uint32_t l = 0; l < s->n_layers; l++) {
                        for (uint32_t q = 0; q < s->n_tiers; q++) {
                                const struct block_table *t = &s->layers[l].t[q];
                                for (uint32_t b = first_own_block(s, q); b < t->n; b++)
                                        count[chunk_of(d, t->blocks[b])]++;
                        }
                }
        }
}

bool relocate_pick(struct kvcd *d, uint64_t now) {
        if (d->relocate.active || now < d->relocate.not_before_usec)
                return false;
        uint32_t n = pool_n_chunks(d->pool);
        uint32_t *count = malloc(n * sizeof(*count));
        bool *blocked = malloc(n * sizeof(*blocked));
        int64_t best = -1;
        uint32_t best_used = UINT32_MAX;
        for (uint32_t ci = 0; count && blocked && ci < d->n_clients; ci++) {
                const struct client *c = d->clients[ci];
                if (c->refuses_moves || !c->sessions)
                        continue;
                memset(count, 0, n * sizeof(*count));
                memset(blocked, 0, n * sizeof(*blocked));
                survey(d, c, count, blocked);
                for (uint32_t i = n; i-- > 0;) {
                        uint32_t unit, used = pool_chunk_units(d->pool, i, &unit);
                        if (pool_chunk_owner(d->pool, i) != c->id || used == 0 || blocked[i] ||
                            count[i] != used || pool_chunk_draining(d->pool, i) || used >= best_used)
                                continue;
                        /* the room elsewhere: its own chunks of that size, less this one's free units */
                        uint64_t room = pool_owner_room(d->pool, c->id, unit) -
                                        (pool_chunk_bytes(d->pool) / unit - used);
                        if (room < used)
                                continue;
                        best = i;
                        best_used = used;
                }
        }
        free(count);
        free(blocked);
        if (best < 0 || pool_reclaim_drain(d->pool, (uint32_t)best) < 0) {
                d->relocate.not_before_usec =
                        now + RELOCATE_RETRY_USEC; /* nothing qualifies: not every round */
                return false;
        }
        uint64_t owner = pool_chunk_owner(d->pool, (uint32_t)best);
        d->relocate.active = true;
        d->relocate.chunk = (uint32_t)best;
        d->relocate.deadline_usec = now + RELOCATE_DEADLINE_USEC;
        d->n.chunks_drained++;
        log_info("draining chunk %lld of client %llu: its %u blocks move to the client's other chunks",
                 (long long)best, (unsigned long long)owner, best_used);
        struct client *c = client_by_id(d, owner);
        for (struct session *s = c ? c->sessions : NULL; s; s = s->next)
                relocate_kick(d, s);
        return true;
}

/* Builds s's plan of moves out of the draining chunk (at most WIRE_MAX_MOVES), allocating the
 * destinations; NULL when none is needed or none could be allocated. */
static Kvc__Plan *moves_plan(struct kvcd *d, struct session *s, struct wire_arena *a) {
        uint32_t idx = d->relocate.chunk, n = 0;
        uint64_t owner = s->owner->id;
        if (!s->moves && !(s->moves = malloc(WIRE_MAX_MOVES * sizeof(*s->moves))))
                return NULL;
        for (uint32_t l = 0; l < s->n_layers && n < WIRE_MAX_MOVES; l++) {
                for (uint32_t q = 0; q < s->n_tiers && n < WIRE_MAX_MOVES; q++) {
                        const struct block_table *t = &s->layers[l].t[q];
                        for (uint32_t b = first_own_block(s, q); b < t->n && n < WIRE_MAX_MOVES; b++) {
                                uint64_t to;
                                if (chunk_of(d, t->blocks[b]) != idx)
                                        continue;
                                if (pool_alloc_owned(d->pool, owner, session_unit_bytes(s, q), 1, &to) < 0)
                                        goto built; /* no room after all: the deadline calls it off */
                                s->moves[n++] = (struct block_move){
                                        .layer = l, .tier = q, .index = b, .from = t->blocks[b], .to = to
                                };
                        }
                }
        }
built:
        s->n_moves = n;
        if (n == 0)
                return NULL;
        Kvc__Plan *p = wire_arena_alloc(a, sizeof(*p));
        Kvc__BlockMove **mp = wire_arena_alloc(a, n * sizeof(*mp));
        Kvc__BlockMove *mv = wire_arena_alloc(a, n * sizeof(*mv));
        if (!p || !mp || !mv) {
                relocate_undo(d, s);
                return NULL;
        }
        kvc__plan__init(p);
        p->session_id = s->id;
        p->plan_id = ++s->next_plan_id;
        p->moves = mp;
        p->n_moves = n;
        for (uint32_t i = 0; i < n; i++) {
                kvc__block_move__init(&mv[i]);
                mv[i].layer = s->moves[i].layer;
                mv[i].tier = s->moves[i].tier;
                mv[i].q8 = s->moves[i].tier == 1; /* clients before the ladder */
                mv[i].index = s->moves[i].index;
                mv[i].from = s->moves[i].from;
                mv[i].to = s->moves[i].to;
                mp[i] = &mv[i];
        }
        /* nothing else changes: no tokens evicted, no tier changed, no mask */
        for (uint32_t l = 0; l < s->n_layers; l++)
                memcpy(s->layers[l].planned, s->layers[l].low, sizeof(s->layers[l].low));
        if (s->mask)
                memcpy(s->mask_next, s->mask, (size_t)s->n_layers * s->mask_stride);
        s->plan_intact = s->prompt_alive;
        s->pending_plan_id = p->plan_id;
        s->pending_since_usec = now_usec();
        return p;
}

bool relocate_wanted(const struct kvcd *d, const struct session *s) {
        if (!d->relocate.active || s->owner->id != pool_chunk_owner(d->pool, d->relocate.chunk) ||
            session_pool_owner(s) != s->owner->id)
                return false;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                for (uint32_t q = 0; q < s->n_tiers; q++) {
                        const struct block_table *t = &s->layers[l].t[q];
                        for (uint32_t b = first_own_block(s, q); b < t->n; b++)
                                if (chunk_of(d, t->blocks[b]) == d->relocate.chunk)
                                        return true;
                }
        }
        return false;
}

void relocate_kick(struct kvcd *d, struct session *s) {
        if (s->pending_plan_id || s->n_moves || !s->owner->bound || !relocate_wanted(d, s))
                return;
        /* its own arena: a kick may come in the middle of a request whose reply is in d->out */
        struct wire_arena *a = d->notes ? d->notes : d->out;
        if (d->notes)
                wire_arena_reset(d->notes);
        Kvc__Plan *p = moves_plan(d, s, a);
        if (!p)
                return;
        if (send_unasked_plan(d, s, p, NULL) < 0) {
                relocate_undo(d, s); /* not sent: nothing outstanding (the deadline calls the drain off) */
                s->pending_plan_id = 0;
                return;
        }
        d->n.plans++;
        log_debug("session %llu: plan %llu moves %zu blocks out of chunk %u", (unsigned long long)s->id,
                  (unsigned long long)p->plan_id, p->n_moves, d->relocate.chunk);
}

void relocate_swap(struct session *s, bool forward) {
        for (uint32_t i = 0; i < s->n_moves; i++) {
                const struct block_move *m = &s->moves[i];
                struct block_table *t = &s->layers[m->layer].t[m->tier];
                t->blocks[m->index] = forward ? m->to : m->from;
        }
}

void relocate_commit(struct kvcd *d, struct session *s) {
        for (uint32_t i = 0; i < s->n_moves; i++) {
                const struct block_move *m = &s->moves[i];
                int r = pool_release(d->pool, s->owner->id, m->from, session_unit_bytes(s, m->tier), 1);
                if (r < 0) /* a bookkeeping bug of ours: say so loudly, keep serving */
                        log_error("session %llu: freeing moved block %llu failed: %s",
                                  (unsigned long long)s->id, (unsigned long long)m->from, strerror(-r));
        }
        d->n.blocks_relocated += s->n_moves;
        s->n_moves = 0;
        d->freed = true;
}

void relocate_undo(struct kvcd *d, struct session *s) {
        for (uint32_t i = 0; i < s->n_moves; i++)
                pool_release(d->pool, s->owner->id, s->moves[i].to, session_unit_bytes(s, s->moves[i].tier), 1);
        s->n_moves = 0;
}

void relocate_refused(struct kvcd *d, struct session *s, int status) {
        if (!s->n_moves)
                return;
        relocate_undo(d, s);
        if (!d->relocate.active)
                return;
        log_notice("client %llu refused to move blocks (%s): chunk %u stays its own",
                   (unsigned long long)s->owner->id, wire_errno_name(status), d->relocate.chunk);
        s->owner->refuses_moves = true;
        pool_reclaim_cancel(d->pool, d->relocate.chunk);
        d->relocate.active = false;
}

uint64_t relocate_bytes(const struct session *s) {
        uint64_t n = 0;
        for (uint32_t i = 0; i < s->n_moves; i++)
                n += session_unit_bytes(s, s->moves[i].tier);
        return n;
}

void relocate_tick(struct kvcd *d, uint64_t now) {
        if (!d->relocate.active)
                return;
        uint32_t idx = d->relocate.chunk, unit;
        if (!pool_chunk_draining(d->pool, idx)) { /* drained and asked for, taken back, or its owner gone */
                d->relocate.active = false;
                return;
        }
        if (pool_chunk_units(d->pool, idx, &unit) && now >= d->relocate.deadline_usec) {
                log_notice("chunk %u still holds blocks after %u s: its drain is called off", idx,
                           RELOCATE_DEADLINE_USEC / 1000000u);
                pool_reclaim_cancel(d->pool, idx);
                d->relocate.active = false;
                d->relocate.not_before_usec = now + RELOCATE_DEADLINE_USEC;
        }
}
