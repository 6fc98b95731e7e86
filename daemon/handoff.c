/* handoff.c: a session handed from one client process to another without copying (a prefill
 * worker handing a sequence to a decode worker; HandoffExport and HandoffImport in
 * proto/kvc.proto).
 *
 * Owns the exports waiting for their import. A session opened with OpenSession.handoff keeps its
 * blocks in chunks of its own (session_pool_owner), so its chunks can change hands without showing
 * anyone anything else. Export: the owner asks for a one-time ticket, and the session moves from
 * its client to a parking client of its own (no connection), so that the exporter may exit. Import:
 * a client that shows the ticket takes the session: kvcd sends it the session's chunk fds, the
 * handler answers with the tables and lengths, and the exporter, if still connected, is asked to
 * unmap the chunks. An export nobody imports within HANDOFF_USEC is closed, its chunks scrubbed and
 * retired. The session keeps everything else: its id, its tenant and limits, its policy's state.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "clock.h"
#include "kvcd.h"
#include "log.h"
#include "pool.h"

#define HANDOFF_USEC (30u * 1000000u)

int handoff_export(struct kvcd *d, struct client *c, const Kvc__HandoffExport *m,
                   uint8_t ticket[WIRE_TOKEN_BYTES], char *why, size_t why_len) {
        struct session *s;
        uint64_t id = m->session_id;
        int r = session_lookup(d, c, id, &s);
        if (r < 0) { /* another client's session is answered as a missing one: no oracle for ids */
                snprintf(why, why_len, "no session %llu", (unsigned long long)id);
                return r == -EPERM ? -ENOENT : r;
        }
        if (!s->domain) {
                snprintf(why, why_len, "session %llu was not opened for hand-off (OpenSession.handoff)",
                         (unsigned long long)id);
                return -EINVAL;
        }
        if (s->pending_plan_id || s->wait.kind != WAIT_NONE) {
                snprintf(why, why_len, "session %llu has a plan or a request outstanding: settle it first",
                         (unsigned long long)id);
                return -EBUSY;
        }
        if (m->n_layer_tokens != s->n_layers) {
                snprintf(why, why_len, "%zu layer lengths for a %u-layer session", m->n_layer_tokens,
                         s->n_layers);
                return -EINVAL;
        }
        uint32_t T = s->layout.block_tokens;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                const struct session_layer *L = &s->layers[l];
                uint32_t low = session_low_tokens(s, L, false);
                if (m->layer_tokens[l] > low + L->t[0].n * T || m->layer_tokens[l] < low) {
                        snprintf(why, why_len, "layer %u: %u tokens do not fit the blocks granted", l,
                                 m->layer_tokens[l]);
                        return -EPROTO;
                }
        }
        struct client *park = calloc(1, sizeof(*park));
        if (!park)
                return -ENOMEM;
        for (uint32_t l = 0; l < s->n_layers; l++) /* the importer starts from these */
                s->layers[l].n_tokens = m->layer_tokens[l];
        if (getrandom(s->handoff.ticket, WIRE_TOKEN_BYTES, 0) != WIRE_TOKEN_BYTES) {
                free(park);
                return -EIO;
        }
        park->id = ++d->next_client_id;
        restart_record_ids(d);
        park->fd = -1;
        park->pid = c->pid;
        park->uid = c->uid;
        park->gid = c->gid;
        snprintf(park->name, sizeof(park->name), "hand-off of session %llu", (unsigned long long)id);
        park->orphan_next = d->handoffs;
        d->handoffs = park;
        session_move(s, park);
        s->handoff.from_client = c->id;
        s->handoff.deadline_usec = now_usec() + HANDOFF_USEC;
        memcpy(ticket, s->handoff.ticket, WIRE_TOKEN_BYTES);
        log_info("session %llu exported by client %llu: waiting %u s for its import", (unsigned long long)id,
                 (unsigned long long)c->id, HANDOFF_USEC / 1000000u);
        return 0;
}

static void unpark(struct kvcd *d, struct client *park) {
        for (struct client **p = &d->handoffs; *p; p = &(*p)->orphan_next) {
                if (*p == park) {
                        *p = park->orphan_next;
                        break;
                }
        }
        free(park);
}

/* Equal in time independent of where they differ: the ticket is a secret. */
static bool same_secret(const uint8_t *a, const uint8_t *b, size_t n) {
        uint8_t diff = 0;
        for (size_t i = 0; i < n; i++)
                diff |= a[i] ^ b[i];
        return diff == 0;
}

int handoff_import(struct kvcd *d, struct client *c, const Kvc__HandoffImport *m, struct session **ret,
                   char *why, size_t why_len) {
        struct session *s = idmap_get(&d->sessions, m->session_id);
        if (!s || !s->handoff.deadline_usec ||
            !same_secret(s->handoff.ticket, m->ticket.data, WIRE_TOKEN_BYTES)) {
                /* one answer for every case: no oracle for ids or tickets */
                snprintf(why, why_len, "no session %llu waits for an import with that ticket",
                         (unsigned long long)m->session_id);
                return -EPERM;
        }
        if (c->n_sessions >= KVCD_MAX_SESSIONS_PER_CLIENT) {
                snprintf(why, why_len, "session limit reached (%u per client)", KVCD_MAX_SESSIONS_PER_CLIENT);
                return -ENOSPC;
        }
        /* the chunks first: the reply names blocks in them */
        uint32_t n = 0;
        for (uint32_t i = 0; i < pool_n_chunks(d->pool); i++) {
                if (pool_chunk_owner(d->pool, i) != s->domain)
                        continue;
                int r = client_send_chunk(d, c, i);
                if (r < 0) {
                        snprintf(why, why_len, "cannot send chunk %u: %s", i, strerror(-r));
                        return -EIO; /* the export stands: the importer may try again */
                }
                n++;
        }
        struct client *park = s->owner, *from = client_by_id(d, s->handoff.from_client);
        session_move(s, c);
        unpark(d, park);
        memset(&s->handoff, 0, sizeof(s->handoff));
        for (uint32_t i = 0; from && from != c && i < pool_n_chunks(d->pool); i++)
                if (pool_chunk_owner(d->pool, i) == s->domain)
                        client_send_unmap(d, from, i); /* best effort: nothing else is in them */
        log_info("session %llu imported by client %llu (pid %d): %u chunks, nothing copied",
                 (unsigned long long)s->id, (unsigned long long)c->id, (int)c->pid, n);
        *ret = s;
        return 0;
}

void handoff_tick(struct kvcd *d, uint64_t now) {
        struct client *next;
        for (struct client *park = d->handoffs; park; park = next) {
                next = park->orphan_next;
                struct session *s = park->sessions;
                if (s && now < s->handoff.deadline_usec)
                        continue;
                if (s) {
                        log_notice("session %llu: exported and not imported within %u s: closed",
                                   (unsigned long long)s->id, HANDOFF_USEC / 1000000u);
                        session_close(d, s);
                }
                unpark(d, park);
        }
}

void handoff_end(struct kvcd *d) {
        while (d->handoffs) {
                struct client *park = d->handoffs;
                if (park->sessions)
                        session_close(d, park->sessions);
                unpark(d, park);
        }
}
