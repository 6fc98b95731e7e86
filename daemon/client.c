/* client.c: client processes as kvcd sees them, through the fd side channel.
 *
 * A client exists from the moment its SEQPACKET connection is accepted: kvcd reads the peer's
 * credentials from the kernel (SO_PEERCRED), hands it a random token, and waits for a ZeroMQ
 * Hello carrying that token to learn its routing id. Routing ids are chosen by the peer and are
 * not proof of anything; the token is, because only the process at the other end of this
 * connection received it.
 *
 * The connection's hang-up ends the client: the kernel closes it when the process exits, however
 * it exits. client_destroy() then closes every session of the client and gives its chunks back to
 * the pool, scrubbed. A hang-up without a BYE record first (libkvc sends one after unmapping the
 * pool) is a death, and the kernel closes a dying process's files before its memory and its GPU
 * context are torn down: its mappings still hold the chunks' memory, and a kernel it had running
 * may still write. Its chunks are then held, scrubbed only when the process has exited (a pidfd
 * turns readable): until then they count against the capacity, so no fresh memory is created
 * beside memory the dying process still holds. A process kvcd cannot watch (gone already, or in a
 * pid namespace kvcd cannot see: SO_PEERCRED says pid 0) has its chunks scrubbed at once.
 *
 * A connection must say Hello within KVCD_HELLO_USEC, and a uid has at most
 * KVCD_MAX_PENDING_PER_UID connections that have not (a new one closes its oldest): connections
 * that never say Hello cannot take the client slots from others. When accept4 fails for want of
 * descriptors kvcd logs it once and stops polling the listener for KVCD_ACCEPT_BACKOFF_USEC at a
 * time; the connections wait in the backlog and the connected clients are served meanwhile. A
 * connection that would leave fewer than KVCD_FD_RESERVE descriptors is closed the same way: the
 * reserve is for ZeroMQ's peers, operators first (fdguard.h).
 * A client with sessions that leaves is followed by malloc_trim(), so kvcd's RSS goes back.
 *
 * On a device pool (the cuda backend) the WELCOME record says so and a DEVICE record with the
 * GPU's UUID follows it; chunk records carry the DEVICE_MEM flag. The records a client sends are
 * UNMAPPED, its answer to UNMAP (cooperative shrink, docs/gpu.md), and BYE; anything else it
 * writes is read and dropped.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "backend.h"
#include "clock.h"
#include "fdguard.h"
#include "fdwire.h"
#include "kvcd.h"
#include "log.h"
#include "pool.h"

static int random_bytes(uint8_t *buf, size_t n) {
        while (n > 0) {
                ssize_t r = getrandom(buf, n, 0);
                if (r < 0) {
                        if (errno == EINTR)
                                continue;
                        return -errno;
                }
                buf += r;
                n -= (size_t)r;
        }
        return 0;
}

bool client_accepting(const struct kvcd *d, uint64_t now) {
        return now >= d->accept_paused_until_usec;
}

uint64_t client_next_deadline(const struct kvcd *d) {
        uint64_t due = d->accept_paused_until_usec > now_usec() ? d->accept_paused_until_usec : UINT64_MAX;
        for (uint32_t i = 0; i < d->n_clients; i++)
                if (!d->clients[i]->bound && d->clients[i]->connected_usec + KVCD_HELLO_USEC < due)
                        due = d->clients[i]->connected_usec + KVCD_HELLO_USEC;
        return due;
}

void client_tick(struct kvcd *d, uint64_t now) {
        for (uint32_t i = d->n_clients; i-- > 0;) { /* from the end: client_destroy moves the last here */
                struct client *c = d->clients[i];
                if (c->bound || now < c->connected_usec + KVCD_HELLO_USEC)
                        continue;
                log_info("client %llu (pid %d) said no Hello within %.1f s: closed",
                         (unsigned long long)c->id, (int)c->pid, KVCD_HELLO_USEC / 1e6);
                client_destroy(d, c, false);
        }
}

/* A uid's connections that have not said Hello yet are at most KVCD_MAX_PENDING_PER_UID: at the
 * limit its oldest is closed, so a flood of them neither takes the client slots from others nor
 * keeps the same user's real client (which says Hello at once) out. */
static void make_room_for_pending(struct kvcd *d, uid_t uid) {
        struct client *oldest = NULL;
        uint32_t n = 0;
        for (uint32_t i = 0; i < d->n_clients; i++) {
                struct client *c = d->clients[i];
                if (c->bound || c->uid != uid)
                        continue;
                n++;
                if (!oldest || c->connected_usec < oldest->connected_usec)
                        oldest = c;
        }
        if (n < KVCD_MAX_PENDING_PER_UID)
                return;
        log_debug("uid %u has %u connections without Hello: its oldest (client %llu) is closed",
                  (unsigned)uid, n, (unsigned long long)oldest->id);
        client_destroy(d, oldest, false);
}

int client_accept(struct kvcd *d) {
        int fd = accept4(d->fd_listen, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)) {
                /* the connection stays queued; polling a listener we cannot accept from would spin */
                if (!d->fds_exhausted)
                        log_warning("cannot accept a client: %s; new connections wait (%.2f s back-off "
                                    "while out of descriptors), connected clients are served",
                                    strerror(errno), KVCD_ACCEPT_BACKOFF_USEC / 1e6);
                d->fds_exhausted = true;
                d->accept_paused_until_usec = now_usec() + KVCD_ACCEPT_BACKOFF_USEC;
                return 0;
        }
        if (fd < 0)
                return errno == EAGAIN || errno == EINTR ? 0 : -errno;
        if (!fdguard_room(fd, KVCD_FD_RESERVE)) {
                /* the reserve is ZeroMQ's (fdguard.h): an operator can still connect */
                close(fd);
                if (!d->fds_exhausted)
                        log_warning("refusing a client: fewer than %u descriptors left (%.2f s back-off)",
                                    KVCD_FD_RESERVE, KVCD_ACCEPT_BACKOFF_USEC / 1e6);
                d->fds_exhausted = true;
                d->accept_paused_until_usec = now_usec() + KVCD_ACCEPT_BACKOFF_USEC;
                return 0;
        }
        if (d->fds_exhausted) {
                log_notice("accepting clients again");
                d->fds_exhausted = false;
        }

        struct ucred cred;
        socklen_t len = sizeof(cred);
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
                close(fd);
                return 1;
        }
        make_room_for_pending(d, cred.uid);
        if (d->n_clients >= KVCD_MAX_CLIENTS) {
                log_warning("refusing a client: %u clients connected (the limit)", d->n_clients);
                close(fd);
                return 1;
        }
        struct client *c = calloc(1, sizeof(*c));
        if (!c || random_bytes(c->token, sizeof(c->token)) < 0) {
                int r = c ? -errno : -ENOMEM;
                free(c);
                close(fd);
                return r;
        }
        c->id = ++d->next_client_id;
        restart_record_ids(d);
        c->fd = fd;
        c->pid = cred.pid;
        c->uid = cred.uid;
        c->gid = cred.gid;
        c->connected_usec = now_usec();

        struct backend_info bi;
        backend_get_info(d->backend, &bi);
        struct fdwire_msg m = { .magic = FDWIRE_MAGIC,
                                .version = FDWIRE_VERSION,
                                .kind = FDWIRE_WELCOME,
                                .chunk_bytes = pool_chunk_bytes(d->pool),
                                .flags = bi.device ? FDWIRE_DEVICE_MEM : 0 };
        memcpy(m.token, c->token, sizeof(m.token));
        int r = fdwire_send(fd, &m, -1);
        if (r == 0 && bi.device) {
                m.kind = FDWIRE_DEVICE;
                memcpy(m.token, bi.device_uuid, sizeof(m.token));
                r = fdwire_send(fd, &m, -1);
        }
        if (r < 0) {
                log_warning("client pid %d: cannot send its token: %s", (int)c->pid, strerror(-r));
                close(fd);
                free(c);
                return 1;
        }
        d->clients[d->n_clients++] = c;
        log_info("client %llu connected: pid %d uid %u gid %u", (unsigned long long)c->id, (int)c->pid,
                 (unsigned)c->uid, (unsigned)c->gid);
        return 1;
}

struct client *client_by_rid(struct kvcd *d, const uint8_t *rid, size_t len) {
        for (uint32_t i = 0; i < d->n_clients; i++) {
                struct client *c = d->clients[i];
                if (c->bound && c->rid_len == len && memcmp(c->rid, rid, len) == 0)
                        return c;
        }
        return NULL;
}

struct client *client_by_token(struct kvcd *d, const uint8_t *token) {
        for (uint32_t i = 0; i < d->n_clients; i++)
                if (memcmp(d->clients[i]->token, token, WIRE_TOKEN_BYTES) == 0)
                        return d->clients[i];
        return NULL;
}

int client_send_chunk_as(struct kvcd *d, struct client *c, uint32_t idx, bool read_only) {
        struct fdwire_msg m = { .magic = FDWIRE_MAGIC,
                                .version = FDWIRE_VERSION,
                                .kind = FDWIRE_CHUNK,
                                .chunk_idx = idx,
                                .chunk_bytes = pool_chunk_bytes(d->pool),
                                .flags = (d->backend->device ? FDWIRE_DEVICE_MEM : 0) |
                                         (read_only ? FDWIRE_READ_ONLY : 0),
                                .generation = pool_chunk_generation(d->pool, idx) };
        return fdwire_send(c->fd, &m, pool_chunk_fd(d->pool, idx));
}

int client_send_chunk(struct kvcd *d, struct client *c, uint32_t idx) {
        return client_send_chunk_as(d, c, idx, false);
}

int client_send_unmap(struct kvcd *d, struct client *c, uint32_t idx) {
        struct fdwire_msg m = { .magic = FDWIRE_MAGIC,
                                .version = FDWIRE_VERSION,
                                .kind = FDWIRE_UNMAP,
                                .chunk_idx = idx,
                                .chunk_bytes = pool_chunk_bytes(d->pool) };
        return fdwire_send(c->fd, &m, -1);
}

struct client *client_by_id(struct kvcd *d, uint64_t id) {
        for (uint32_t i = 0; i < d->n_clients; i++)
                if (d->clients[i]->id == id)
                        return d->clients[i];
        return NULL;
}

int client_drain(struct kvcd *d, struct client *c) {
        bool reset = false;
        for (int i = 0; i < 64; i++) {
                struct fdwire_msg m;
                int fd = -1, r = fdwire_recv(c->fd, &m, &fd, 0);
                if (r == -ETIMEDOUT)
                        return reset ? -ENOTCONN : 0;
                if (r == -ENOTCONN)
                        return r;
                if (r == -ECONNRESET) { /* it closed with our records unread: what it sent is still here */
                        reset = true;
                        continue;
                }
                if (fd >= 0)
                        close(fd); /* clients send no fds */
                if (r == -EPROTO)
                        continue; /* not a record: dropped */
                if (r < 0)
                        return -ENOTCONN;
                if (m.kind == FDWIRE_BYE)
                        c->said_bye = true;
                if (m.kind != FDWIRE_UNMAPPED || m.chunk_idx > UINT32_MAX)
                        continue;
                if (pool_reclaim_done(d->pool, c->id, (uint32_t)m.chunk_idx) == 0)
                        log_info("client %llu gave back chunk %llu (scrubbed)", (unsigned long long)c->id,
                                 (unsigned long long)m.chunk_idx);
                else /* the owner took it back meanwhile (its fd went out again), or a peer's mistake */
                        log_info("client %llu unmapped chunk %llu, which is no longer asked back",
                                 (unsigned long long)c->id, (unsigned long long)m.chunk_idx);
        }
        return 0;
}

void client_reclaim(struct kvcd *d) {
        uint32_t idx[16], asked = 0;
        uint64_t owner[16];
        uint32_t n = pool_reclaim_pick(d->pool, 16, idx, owner);
        for (uint32_t i = 0; i < n; i++) {
                /* no client: a domain's chunk, a dead client's held until its process exits, or a
                 * restart's orphan's: nobody to ask */
                struct client *c = client_by_id(d, owner[i]);
                int r = c ? client_send_unmap(d, c, idx[i]) : -ENOENT;
                if (r < 0) { /* not delivered (a record goes whole or not at all): called off */
                        pool_reclaim_cancel(d->pool, idx[i]);
                        log_at(c ? LOG_INFO : LOG_DEBUG, "cannot ask owner %llu for chunk %u back: %s",
                               (unsigned long long)owner[i], idx[i], strerror(-r));
                        continue;
                }
                asked++;
                log_info("asked client %llu for chunk %u back (it holds nothing there)",
                         (unsigned long long)owner[i], idx[i]);
        }
        if (asked == 0) /* no empty chunk anyone can give back: empty one by moving its blocks out */
                relocate_pick(d, now_usec());
}

/* Gives owner's chunks back, scrubbed; the restart record follows. */
static uint32_t release_chunks(struct kvcd *d, uint64_t owner) {
        uint32_t n = pool_release_owner(d->pool, owner);
        for (uint32_t i = 0; n && i < pool_n_chunks(d->pool); i++)
                if (pool_chunk_owner(d->pool, i) == 0)
                        restart_record_chunk_owner(d, i, 0);
        return n;
}

/* The chunks of client c, which died, are held until its process has exited: 0 when they are,
 * -errno when they can be scrubbed now (nothing to wait for, or no way to wait). */
static int hold_until_exit(struct kvcd *d, struct client *c) {
        if (pool_owner_chunks(d->pool, c->id) == 0)
                return -ENOENT;
        if (c->pid <= 0 || d->n_holds == KVCD_MAX_CLIENTS)
                return -ESRCH;
        int fd = (int)syscall(SYS_pidfd_open, c->pid, 0);
        if (fd < 0)
                return -errno; /* ESRCH: gone (and reaped) already */
        struct pollfd p = { .fd = fd, .events = POLLIN };
        if (poll(&p, 1, 0) != 0) { /* exited already */
                close(fd);
                return -ESRCH;
        }
        uint64_t owner = EXITING_DOMAIN | c->id;
        pool_transfer_owner(d->pool, c->id, owner);
        d->holds[d->n_holds++] = (struct exit_hold){ .owner = owner, .pid = c->pid, .pidfd = fd };
        return 0;
}

void client_exited(struct kvcd *d, uint32_t i) {
        struct exit_hold h = d->holds[i];
        d->holds[i] = d->holds[--d->n_holds];
        close(h.pidfd);
        uint32_t n = release_chunks(d, h.owner);
        log_info("process %d has exited: its %u chunks scrubbed", (int)h.pid, n);
}

uint32_t client_held_chunks(const struct kvcd *d) {
        uint32_t n = 0;
        for (uint32_t i = 0; d->n_holds && i < pool_n_chunks(d->pool); i++) /* one pass over the chunks */
                n += (pool_chunk_owner(d->pool, i) & EXITING_DOMAIN) != 0;
        return n;
}

void client_destroy(struct kvcd *d, struct client *c, bool died) {
        uint32_t n_sessions = c->n_sessions;
        while (c->sessions)
                session_close(d, c->sessions);
        uint32_t n_chunks = 0;
        bool held = died && hold_until_exit(d, c) == 0;
        if (!held)
                n_chunks = release_chunks(d, c->id);
        if (died && n_sessions)
                d->n.client_deaths++;
        if (held)
                log_info("client %llu (pid %d) gone: %u sessions closed, its chunks held until the process "
                         "exits",
                         (unsigned long long)c->id, (int)c->pid, n_sessions);
        else
                log_info("client %llu (pid %d) %s: %u sessions closed, %u chunks scrubbed",
                         (unsigned long long)c->id, (int)c->pid, died ? "gone" : "disconnected", n_sessions,
                         n_chunks);
        for (uint32_t i = 0; i < d->n_clients; i++) {
                if (d->clients[i] == c) {
                        d->clients[i] = d->clients[--d->n_clients];
                        break;
                }
        }
        close(c->fd);
        free(c);
        if (n_sessions)
                malloc_trim(0); /* what its sessions' bookkeeping took goes back to the system */
}
