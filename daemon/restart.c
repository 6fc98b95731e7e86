/* restart.c: kvcd restarted (it crashed, or was killed) without losing the caches.
 *
 * Under systemd, with --fd-store (or $FDSTORE, which systemd 254 and later set when the unit has
 * FileDescriptorStoreMax=), kvcd keeps two kinds of fds in the service manager's fd
 * store: every pool chunk it creates ("chunk-N"), and a state record ("state", a memfd). When
 * kvcd comes back, systemd hands them over with LISTEN_FDS/LISTEN_FDNAMES; kvcd maps the chunks
 * again at their indices and rebuilds its sessions from the record, each under an "orphan"
 * standing for its old client connection. The client processes still have every chunk mapped:
 * their data never moved. Each reconnects, says Hello, and sends one Resume per session with
 * its block tables and lengths; kvcd checks every block against the chunks the old connection
 * owned, claims them in the pool, and the session carries on. Orphans nobody resumes within the
 * grace period are closed and their chunks scrubbed.
 *
 * The record holds only what changes rarely: the pool's shape, the owner of each chunk, and one
 * slot per session (its id, secret, owner, plan buffer and its OpenSession, packed). Block tables
 * change every few steps and are not recorded: the client's account of them is the truth, and a
 * block it does not claim is free after the restart. The record lives in a shared memfd, so
 * every write is in the store the moment it is made, whatever kills kvcd next. A slot becomes
 * valid when its in_use word is set, after everything else in it is written. The first Resume
 * from a new connection renames the old one in the whole record at once (adopt_in_record: a
 * guard word in the header, which the next start completes), so a kvcd killed again between two
 * Resumes of one client still finds all of that client's sessions and chunks under one owner.
 *
 * What does not survive: the policies' own counters (SCOPE's steps, SnapKV's observation, the
 * sampling generator: the policy starts afresh from its parameters), the KV event hash chains,
 * and a plan kvcd had sent but not seen acknowledged (the client's Resume says what it applied).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "clock.h"
#include "kvcd.h"
#include "log.h"
#include "pool.h"

#define STATE_MAGIC      0x5453564bu /* "KVST" */
#define STATE_VERSION    1u
#define STATE_SLOT_BYTES 8192u

struct state_header {
        uint32_t magic;
        uint32_t version;
        uint64_t chunk_bytes;
        uint32_t n_chunks;
        uint32_t n_slots;
        uint64_t next_session_id;
        uint64_t next_client_id;
        uint64_t clean; /* 1: stopped cleanly, nothing to restore */
        /* an adoption under way (restart_resume): every owner adopt_from in the record becomes
         * adopt_to. Set before the record's owners are rewritten and cleared after, so a kvcd
         * killed in between finishes the rewrite when it restores (adopt_to is written first) */
        uint64_t adopt_from, adopt_to;
        uint64_t reserved[1];
        /* uint64_t chunk_owner[n_chunks], then n_slots slots */
};

struct state_slot {
        uint32_t in_use; /* written last */
        uint32_t open_len;
        uint64_t session_id;
        uint64_t owner;
        uint64_t plan_offset;
        uint32_t plan_units;
        uint32_t reserved;
        uint8_t token[WIRE_TOKEN_BYTES];
        uint8_t open[STATE_SLOT_BYTES - 56];
};

struct kept_fd {
        uint32_t chunk; /* UINT32_MAX: the state record */
        int fd;
};

struct restart {
        bool managed; /* a service manager keeps our fds */
        int state_fd;
        struct state_header *hdr;
        size_t state_bytes;
        struct kept_fd *kept;
        size_t n_kept, cap_kept;
        uint64_t grace_deadline;
};

static uint64_t *chunk_owners(struct state_header *h) {
        return (uint64_t *)(h + 1);
}

static struct state_slot *slot_at(struct state_header *h, uint32_t i) {
        uint8_t *slots = (uint8_t *)(chunk_owners(h) + h->n_chunks);
        slots = (uint8_t *)(((uintptr_t)slots + 63) & ~(uintptr_t)63);
        return (struct state_slot *)(slots + (size_t)i * STATE_SLOT_BYTES);
}

static size_t state_size(uint32_t n_chunks, uint32_t n_slots) {
        return sizeof(struct state_header) + n_chunks * sizeof(uint64_t) + 64 +
               (size_t)n_slots * STATE_SLOT_BYTES;
}

static struct restart *get(struct kvcd *d) {
        if (!d->restart) {
                d->restart = calloc(1, sizeof(*d->restart));
                if (d->restart)
                        d->restart->state_fd = -1;
        }
        return d->restart;
}

int restore_keep_fd(struct kvcd *d, const char *name, int fd) {
        struct restart *rs = get(d);
        uint32_t chunk;
        char tail;
        if (!rs)
                return -ENOMEM;
        if (strcmp(name, "state") == 0)
                chunk = UINT32_MAX;
        else if (sscanf(name, "chunk-%u%c", &chunk, &tail) != 1)
                return -ENOENT;
        if (rs->n_kept == rs->cap_kept) {
                size_t cap = rs->cap_kept ? 2 * rs->cap_kept : 64;
                struct kept_fd *k = realloc(rs->kept, cap * sizeof(*k));
                if (!k)
                        return -ENOMEM;
                rs->kept = k;
                rs->cap_kept = cap;
        }
        rs->kept[rs->n_kept++] = (struct kept_fd){ .chunk = chunk, .fd = fd };
        return 0;
}

/* The pool created a chunk: into the fd store with it. */
/* A chunk index gets fresh memory each time it changes owner (pool.c): the store's old fd of
 * that name goes first. */
static void store_chunk(void *ctx, uint32_t idx, int fd) {
        (void)ctx;
        char msg[64];
        snprintf(msg, sizeof(msg), "FDSTOREREMOVE=1\nFDNAME=chunk-%u", idx);
        sd_notify(0, msg);
        snprintf(msg, sizeof(msg), "FDSTORE=1\nFDNAME=chunk-%u", idx);
        if (sd_pid_notify_with_fds(0, 0, msg, &fd, 1) <= 0)
                log_warning("chunk %u: not in the fd store; it will not survive a restart", idx);
}

static int new_record(struct kvcd *d, struct restart *rs) {
        uint32_t n_chunks = pool_n_chunks(d->pool), n_slots = KVCD_MAX_SESSIONS;
        size_t bytes = state_size(n_chunks, n_slots);
        int fd = memfd_create("kvcd-state", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, (off_t)bytes) < 0) {
                int r = -errno;
                if (fd >= 0)
                        close(fd);
                return r;
        }
        void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED) {
                close(fd);
                return -errno;
        }
        rs->state_fd = fd;
        rs->hdr = m;
        rs->state_bytes = bytes;
        *rs->hdr = (struct state_header){ .magic = STATE_MAGIC,
                                          .version = STATE_VERSION,
                                          .chunk_bytes = pool_chunk_bytes(d->pool),
                                          .n_chunks = n_chunks,
                                          .n_slots = n_slots };
        if (sd_pid_notify_with_fds(0, 0, "FDSTORE=1\nFDNAME=state", &fd, 1) <= 0)
                log_warning("the state record is not in the fd store: caches will not survive a restart");
        return 0;
}

/* Every owner from in the record (chunks and session slots) becomes to. */
static void rename_owner(struct state_header *h, uint64_t from, uint64_t to) {
        for (uint32_t i = 0; i < h->n_chunks; i++)
                if (chunk_owners(h)[i] == from)
                        chunk_owners(h)[i] = to;
        for (uint32_t i = 0; i < h->n_slots; i++) {
                struct state_slot *sl = slot_at(h, i);
                if (sl->in_use && sl->owner == from)
                        sl->owner = to;
        }
}

/* The record's owners from become to, all or (after a kill at any point) none until the next
 * restore completes it. */
static void adopt_in_record(struct state_header *h, uint64_t from, uint64_t to) {
        h->adopt_to = to;
        __atomic_store_n(&h->adopt_from, from, __ATOMIC_RELEASE);
        rename_owner(h, from, to);
        __atomic_store_n(&h->adopt_from, 0, __ATOMIC_RELEASE);
}

/* Maps a kept record; -EINVAL when it does not describe this pool or was closed cleanly. */
static int open_record(struct kvcd *d, struct restart *rs, int fd) {
        struct state_header h;
        if (pread(fd, &h, sizeof(h), 0) != (ssize_t)sizeof(h) || h.magic != STATE_MAGIC ||
            h.version != STATE_VERSION || h.chunk_bytes != pool_chunk_bytes(d->pool) ||
            h.n_chunks != pool_n_chunks(d->pool) || h.n_slots == 0 || h.n_slots > KVCD_MAX_SESSIONS ||
            h.clean)
                return -EINVAL;
        size_t bytes = state_size(h.n_chunks, h.n_slots);
        void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED)
                return -errno;
        rs->state_fd = fd;
        rs->hdr = m;
        rs->state_bytes = bytes;
        return 0;
}

static struct client *orphan_of(struct kvcd *d, uint64_t id) {
        for (struct client *o = d->orphans; o; o = o->orphan_next)
                if (o->id == id)
                        return o;
        struct client *o = calloc(1, sizeof(*o));
        if (!o)
                return NULL;
        o->id = id;
        o->fd = -1;
        o->orphan_next = d->orphans;
        d->orphans = o;
        return o;
}

/* Drops what could not be restored from systemd's store as well. */
static void forget_fd(int fd, const char *name) {
        char msg[64];
        snprintf(msg, sizeof(msg), "FDSTOREREMOVE=1\nFDNAME=%s", name);
        sd_notify(0, msg);
        close(fd);
}

int restart_begin(struct kvcd *d) {
        struct restart *rs = get(d);
        if (!rs)
                return -ENOMEM;
        const char *store = getenv("FDSTORE");
        rs->managed = getenv("NOTIFY_SOCKET") && (d->cfg.fd_store || (store && atoi(store) > 0));
        if (!rs->managed) {
                for (size_t i = 0; i < rs->n_kept; i++)
                        close(rs->kept[i].fd);
                rs->n_kept = 0;
                return 0;
        }
        pool_set_created_hook(d->pool, store_chunk, d);

        int state = -1;
        for (size_t i = 0; i < rs->n_kept; i++)
                if (rs->kept[i].chunk == UINT32_MAX)
                        state = rs->kept[i].fd;
        bool restoring = state >= 0 && open_record(d, rs, state) == 0;
        if (state >= 0 && !restoring)
                log_warning("the kept state record does not describe this pool: starting afresh");
        if (restoring && rs->hdr->adopt_from) /* the last kvcd was killed mid-adoption: finish it */
                adopt_in_record(rs->hdr, rs->hdr->adopt_from, rs->hdr->adopt_to);

        uint32_t chunks = 0, sessions = 0;
        for (size_t i = 0; i < rs->n_kept; i++) {
                struct kept_fd *k = &rs->kept[i];
                char name[32];
                if (k->chunk == UINT32_MAX) {
                        if (!restoring)
                                forget_fd(k->fd, "state");
                        continue;
                }
                snprintf(name, sizeof(name), "chunk-%u", k->chunk);
                uint64_t owner =
                        restoring && k->chunk < rs->hdr->n_chunks ? chunk_owners(rs->hdr)[k->chunk] : 0;
                if (!restoring || (owner && !orphan_of(d, owner)) ||
                    pool_adopt_chunk(d->pool, k->chunk, k->fd, owner) < 0) {
                        forget_fd(k->fd, name);
                        continue;
                }
                chunks++;
        }
        free(rs->kept);
        rs->kept = NULL;
        rs->n_kept = rs->cap_kept = 0;
        if (!restoring)
                return new_record(d, rs);

        struct state_header *h = rs->hdr;
        d->next_session_id = h->next_session_id;
        d->next_client_id = h->next_client_id;
        for (uint32_t i = 0; i < h->n_slots; i++) {
                struct state_slot *sl = slot_at(h, i);
                if (!sl->in_use)
                        continue;
                Kvc__OpenSession *m;
                struct session *s = NULL;
                struct client *o = orphan_of(d, sl->owner);
                char why[WIRE_MAX_MESSAGE] = "";
                int r = sl->open_len <= sizeof(sl->open) && o
                                ? wire_open_session_decode(d->in, sl->open, sl->open_len, &m, why,
                                                           sizeof(why))
                                : -EINVAL;
                if (r == 0)
                        r = session_restore(d, o, m, sl->session_id, sl->token, sl->plan_offset,
                                            sl->plan_units, &s, why, sizeof(why));
                if (r < 0) {
                        log_warning("session %llu could not be restored: %s",
                                    (unsigned long long)sl->session_id, why);
                        sl->in_use = 0;
                        continue;
                }
                s->state_slot = (int32_t)i;
                sessions++;
        }
        rs->grace_deadline = now_usec() + d->cfg.resume_grace_usec;
        log_notice("restored %u chunks and %u sessions from the fd store; their clients have %.1f s to "
                   "resume them",
                   chunks, sessions, (double)d->cfg.resume_grace_usec / 1e6);
        return 0;
}

int restart_record_session(struct kvcd *d, struct session *s, const Kvc__OpenSession *m) {
        struct restart *rs = d->restart;
        if (!rs || !rs->hdr)
                return 0;
        for (uint32_t i = 0; i < rs->hdr->n_slots; i++) {
                struct state_slot *sl = slot_at(rs->hdr, i);
                if (sl->in_use)
                        continue;
                Kvc__OpenSession copy = *m; /* the prompt's ids are for events only: not kept */
                size_t len;
                copy.n_prompt_token_ids = 0;
                copy.prompt_token_ids = NULL;
                if (wire_open_session_pack(&copy, sl->open, sizeof(sl->open), &len) < 0)
                        return 0; /* too large to keep: this session will not survive a restart */
                sl->open_len = (uint32_t)len;
                sl->session_id = s->id;
                sl->owner = s->owner->id;
                sl->plan_offset = s->plan_offset;
                sl->plan_units = s->plan_units;
                memcpy(sl->token, s->token, sizeof(sl->token));
                __atomic_store_n(&sl->in_use, 1u, __ATOMIC_RELEASE);
                s->state_slot = (int32_t)i;
                restart_record_ids(d);
                return 0;
        }
        return 0;
}

void restart_record_plan(struct kvcd *d, struct session *s) {
        struct restart *rs = d->restart;
        if (!rs || !rs->hdr || s->state_slot < 0)
                return;
        struct state_slot *sl = slot_at(rs->hdr, (uint32_t)s->state_slot);
        sl->plan_offset = s->plan_offset; /* a slot is read only after a crash: no ordering needed */
        sl->plan_units = s->plan_units;
}

void restart_forget_session(struct kvcd *d, struct session *s) {
        struct restart *rs = d->restart;
        if (rs && rs->hdr && s->state_slot >= 0)
                __atomic_store_n(&slot_at(rs->hdr, (uint32_t)s->state_slot)->in_use, 0u, __ATOMIC_RELEASE);
        s->state_slot = -1;
}

void restart_record_chunk_owner(struct kvcd *d, uint32_t idx, uint64_t owner) {
        struct restart *rs = d->restart;
        if (rs && rs->hdr && idx < rs->hdr->n_chunks)
                chunk_owners(rs->hdr)[idx] = owner;
}

void restart_record_ids(struct kvcd *d) {
        struct restart *rs = d->restart;
        if (rs && rs->hdr) {
                rs->hdr->next_session_id = d->next_session_id;
                rs->hdr->next_client_id = d->next_client_id;
        }
}

static void drop_orphan(struct kvcd *d, struct client *o) {
        for (struct client **p = &d->orphans; *p; p = &(*p)->orphan_next) {
                if (*p == o) {
                        *p = o->orphan_next;
                        break;
                }
        }
        while (o->sessions)
                session_close(d, o->sessions);
        /* an orphan whose chunks a live client took over (adopted_from set) gives none back */
        uint32_t n = o->adopted_from ? 0 : pool_release_owner(d->pool, o->id);
        for (uint32_t i = 0; i < pool_n_chunks(d->pool); i++)
                if (pool_chunk_owner(d->pool, i) == 0)
                        restart_record_chunk_owner(d, i, 0);
        if (n)
                log_notice("connection %llu from before the restart did not come back: %u chunks scrubbed",
                           (unsigned long long)o->id, n);
        free(o);
}

void restart_tick(struct kvcd *d, uint64_t now) {
        struct restart *rs = d->restart;
        if (!rs || !rs->grace_deadline || now < rs->grace_deadline)
                return;
        rs->grace_deadline = 0;
        while (d->orphans)
                drop_orphan(d, d->orphans);
}

/* Claims the blocks of one table for the session; on failure releases what it claimed. */
static int claim_table(struct kvcd *d, struct session *s, struct block_table *t, uint32_t tier,
                       const uint64_t *blocks, size_t n) {
        uint32_t unit = session_unit_bytes(s, tier);
        if (n > s->max_layer_blocks)
                return -EPROTO;
        int r = session_table_reserve(d, s, t, (uint32_t)n);
        if (r < 0)
                return r;
        for (size_t b = 0; b < n; b++) {
                r = pool_claim(d->pool, s->owner->id, blocks[b], unit, 1);
                if (r < 0) {
                        log_debug("session %llu: block %llu (%u bytes) cannot be claimed for client %llu: %s",
                                  (unsigned long long)s->id, (unsigned long long)blocks[b], unit,
                                  (unsigned long long)s->owner->id, strerror(-r));
                        while (b-- > 0)
                                pool_release(d->pool, s->owner->id, blocks[b], unit, 1);
                        return r;
                }
                t->blocks[b] = blocks[b];
        }
        t->n = (uint32_t)n;
        budget_charge(d, s, (int64_t)n * unit);
        return 0;
}

int restart_resume(struct kvcd *d, struct client *c, const Kvc__Resume *m, char *why, size_t why_len) {
        struct session *s = idmap_get(&d->sessions, m->session_id);
        if (!s || s->owner->fd >= 0 || memcmp(s->token, m->token.data, WIRE_TOKEN_BYTES) != 0) {
                snprintf(why, why_len, "no session %llu waits to be resumed with that secret",
                         (unsigned long long)m->session_id);
                return -ENOENT;
        }
        struct client *o = s->owner;
        /* once c adopted an old connection, that orphan carries c's id (below): its other
         * sessions come back to c; another old connection's do not */
        if (c->adopted_from && o->adopted_from != c->id) {
                snprintf(why, why_len, "session %llu belonged to another connection",
                         (unsigned long long)m->session_id);
                return -EPERM;
        }
        if (m->n_layers != s->n_layers) {
                snprintf(why, why_len, "%zu layers for a %u-layer session", m->n_layers, s->n_layers);
                return -EINVAL;
        }
        uint32_t T = s->layout.block_tokens;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                const Kvc__ResumeLayer *L = m->layers[l];
                uint64_t low = 0;
                bool ok = L->n_tier_tokens <= s->n_tiers - 1 && (s->n_tiers > 1 || L->n_q8_blocks == 0);
                for (uint32_t t = 1; t < LADDER_TIERS && ok; t++) {
                        uint32_t n;
                        const uint64_t *b;
                        size_t nb;
                        wire_resume_tier(L, t, &n, &b, &nb);
                        ok = t < s->n_tiers ? n <= nb * T : nb == 0;
                        low += n;
                }
                if (!ok || low > L->n_tokens || L->n_tokens - low > L->n_fp_blocks * T) {
                        snprintf(why, why_len, "layer %u: %u tokens do not fit the blocks listed", l,
                                 L->n_tokens);
                        return -EPROTO;
                }
        }
        if (!c->adopted_from) { /* the chunks of the old connection are this one's now */
                /* and so are its sessions in the record, resumed or not yet, in one step: a kvcd
                 * killed again before the client resumed them all restores them under one owner,
                 * with its chunks, and the client's next Resume finds them together */
                adopt_in_record(d->restart->hdr, o->id, c->id);
                pool_transfer_owner(d->pool, o->id, c->id);
                c->adopted_from = o->id;
                o->id = c->id; /* its remaining sessions' blocks are claimed under the new id too */
                o->adopted_from = c->id;
        }
        session_move(s, c); /* then claim its blocks */
        for (uint32_t l = 0; l < s->n_layers; l++) {
                const Kvc__ResumeLayer *L = m->layers[l];
                struct session_layer *SL = &s->layers[l];
                int r = claim_table(d, s, &SL->t[0], 0, L->fp_blocks, L->n_fp_blocks);
                for (uint32_t t = 1; r == 0 && t < s->n_tiers; t++) {
                        uint32_t n;
                        const uint64_t *b;
                        size_t nb;
                        wire_resume_tier(L, t, &n, &b, &nb);
                        r = claim_table(d, s, &SL->t[t], t, b, nb);
                        SL->low[t] = SL->planned[t] = n;
                }
                if (r < 0) { /* the tables it claimed whole go back (the failed one took nothing) */
                        for (uint32_t t = 0; t < s->n_tiers; t++)
                                while (SL->t[t].n) {
                                        pool_release(d->pool, c->id, SL->t[t].blocks[--SL->t[t].n],
                                                     session_unit_bytes(s, t), 1);
                                        budget_charge(d, s, -(int64_t)session_unit_bytes(s, t));
                                }
                        memset(SL->low, 0, sizeof(SL->low));
                        memset(SL->planned, 0, sizeof(SL->planned));
                        snprintf(why, why_len,
                                 "layer %u: a block is not one of the old connection's free units", l);
                        session_close(d, s); /* what it claimed so far goes with it */
                        return -EPROTO;
                }
                SL->n_tokens = L->n_tokens;
                if (L->n_tokens > s->stats.peak_tokens)
                        s->stats.peak_tokens = L->n_tokens;
        }
        s->last_step = m->last_step;
        s->stepped = m->stepped;
        s->next_plan_id = m->last_plan_id > s->next_plan_id ? m->last_plan_id : s->next_plan_id;
        s->pending_plan_id = 0;
        s->appended = s->layers[0].n_tokens;
        if (s->bytes > s->stats.peak_bytes)
                s->stats.peak_bytes = s->bytes;
        if (s->state_slot >= 0)
                slot_at(d->restart->hdr, (uint32_t)s->state_slot)->owner = c->id;
        if (o->n_sessions == 0) /* every session of the old connection came back */
                drop_orphan(d, o);
        log_info("session %llu resumed by client %llu (pid %d)", (unsigned long long)s->id,
                 (unsigned long long)c->id, (int)c->pid);
        return 0;
}

bool restart_managed(const struct kvcd *d) {
        return d->restart && d->restart->managed && d->restart->hdr;
}

void restart_end(struct kvcd *d) {
        struct restart *rs = d->restart;
        if (!rs)
                return;
        if (rs->hdr) {
                rs->hdr->clean = 1;
                /* a clean stop: the store gives back nothing next time */
                for (uint32_t i = 0; rs->managed && i < pool_n_chunks(d->pool); i++) {
                        char msg[64];
                        snprintf(msg, sizeof(msg), "FDSTOREREMOVE=1\nFDNAME=chunk-%u", i);
                        sd_notify(0, msg);
                }
                if (rs->managed)
                        sd_notify(0, "FDSTOREREMOVE=1\nFDNAME=state");
                munmap(rs->hdr, rs->state_bytes);
        }
        while (d->orphans)
                drop_orphan(d, d->orphans);
        if (rs->state_fd >= 0)
                close(rs->state_fd);
        for (size_t i = 0; i < rs->n_kept; i++)
                close(rs->kept[i].fd);
        free(rs->kept);
        free(rs);
        d->restart = NULL;
}
