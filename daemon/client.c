/* client.c: client processes as kvcd sees them, through the fd side channel.
 *
 * A client exists from the moment its SEQPACKET connection is accepted: kvcd reads the peer's
 * credentials from the kernel (SO_PEERCRED), hands it a random token, and waits for a ZeroMQ
 * Hello carrying that token to learn its routing id. Routing ids are chosen by the peer and are
 * not proof of anything; the token is, because only the process at the other end of this
 * connection received it.
 *
 * The connection's hang-up is the client's death certificate: the kernel closes it when the
 * process exits, however it exits. client_destroy() then closes every session of the client
 * and gives its chunks back to the pool, scrubbed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fdwire.h"
#include "kvcd.h"
#include "log.h"

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

int client_accept(struct kvcd *d) {
        int fd = accept4(d->fd_listen, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0)
                return errno == EAGAIN || errno == EINTR ? 0 : -errno;

        if (d->n_clients >= KVCD_MAX_CLIENTS) {
                log_warning("refusing a client: %u clients connected (the limit)", d->n_clients);
                close(fd);
                return 1;
        }
        struct ucred cred;
        socklen_t len = sizeof(cred);
        struct client *c = calloc(1, sizeof(*c));
        if (!c || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0 ||
            random_bytes(c->token, sizeof(c->token)) < 0) {
                int r = c ? -errno : -ENOMEM;
                free(c);
                close(fd);
                return r;
        }
        c->id = ++d->next_client_id;
        c->fd = fd;
        c->pid = cred.pid;
        c->uid = cred.uid;
        c->gid = cred.gid;
        c->connected_usec = now_usec();

        struct fdwire_msg m = { .magic = FDWIRE_MAGIC,
                                .version = FDWIRE_VERSION,
                                .kind = FDWIRE_WELCOME,
                                .chunk_bytes = pool_chunk_bytes(d->pool) };
        memcpy(m.token, c->token, sizeof(m.token));
        int r = fdwire_send(fd, &m, -1);
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

int client_send_chunk(struct kvcd *d, struct client *c, uint32_t idx) {
        struct fdwire_msg m = { .magic = FDWIRE_MAGIC,
                                .version = FDWIRE_VERSION,
                                .kind = FDWIRE_CHUNK,
                                .chunk_idx = idx,
                                .chunk_bytes = pool_chunk_bytes(d->pool) };
        return fdwire_send(c->fd, &m, pool_chunk_fd(d->pool, idx));
}

int client_drain(struct kvcd *d, struct client *c) {
        (void)d;
        for (int i = 0; i < 64; i++) {
                char buf[256];
                ssize_t n = recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT);
                if (n == 0)
                        return -ENOTCONN;
                if (n < 0)
                        return errno == EAGAIN || errno == EINTR ? 0 : -ENOTCONN;
        }
        return 0;
}

void client_destroy(struct kvcd *d, struct client *c, bool died) {
        uint32_t n_sessions = c->n_sessions;
        while (c->sessions)
                session_close(d, c->sessions);
        uint32_t n_chunks = pool_release_owner(d->pool, c->id);
        if (died && n_sessions)
                d->n.client_deaths++;
        log_info("client %llu (pid %d) %s: %u sessions closed, %u chunks scrubbed", (unsigned long long)c->id,
                 (int)c->pid, died ? "gone" : "disconnected", n_sessions, n_chunks);
        for (uint32_t i = 0; i < d->n_clients; i++) {
                if (d->clients[i] == c) {
                        d->clients[i] = d->clients[--d->n_clients];
                        break;
                }
        }
        close(c->fd);
        free(c);
}
