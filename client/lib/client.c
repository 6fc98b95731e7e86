/* client.c: the client's connection to kvcd. Owns struct kvc_client's lifetime (kvc_connect,
 * kvc_disconnect), its two channels (ZeroMQ DEALER for messages, SEQPACKET for chunk fds), the
 * envelopes sent and received over them, the request/reply call, and the last error.
 *
 * Messages from kvcd are decoded by wire.c into the client's bounded arena and validated before
 * any field is read; a reply is valid until the next receive. Side-channel records (a chunk, a
 * chunk asked back) are handled before the message that follows them, as kvcd sent them first.
 * A broken connection (-ENOTCONN) inside a call is handed to resume.c, which reconnects when kvcd
 * keeps the pool across its restarts, and the call is sent again.
 *
 * Before a byte goes to kvcd, the side channel's peer (SO_PEERCRED), the runtime directory and
 * kvcd.sock must belong to a user allowed to be kvcd (check_daemon): a fake kvcd in a directory
 * another user made (/tmp/kvcd-$UID) would otherwise receive our sessions and hand us memfds it
 * reads. docs/security.md, "Runtime directory and credentials".
 *
 * Device pools (kvcd's cuda backend, docs/gpu.md): kvcd says so on the side channel, with the
 * GPU's UUID; kvc_connect then loads the driver (kernels/cuda/driver.h) and reserves the range on
 * that GPU (devpool.c). The host path never touches the driver.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "devpool.h"

int client_error(struct kvc_client *c, int code, const char *fmt, ...) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->error, sizeof(c->error), fmt, ap);
        va_end(ap);
        return code;
}

/* Why the last kvc_connect of this thread failed, when it knows more than the code. */
static __thread char connect_error[640];

const char *kvc_last_error(const struct kvc_client *c) {
        return c ? c->error : connect_error[0] ? connect_error : "no client";
}

struct uuid_text {
        char s[41];
};

static struct uuid_text uuid_text(const uint8_t bytes[16]) {
        struct cuda_uuid u;
        struct uuid_text t;
        memcpy(u.bytes, bytes, sizeof(u.bytes));
        cuda_uuid_format(&u, t.s);
        return t;
}

int kvc_default_runtime_dir(char *buf, size_t len) {
        const char *env = getenv("KVC_SOCKET"), *xdg = getenv("XDG_RUNTIME_DIR");
        int n;
        if (env && *env)
                n = snprintf(buf, len, "%s", env);
        else if (xdg && *xdg)
                n = snprintf(buf, len, "%s/kvcd", xdg);
        else
                n = snprintf(buf, len, "/tmp/kvcd-%u", (unsigned)getuid());
        return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

/* A user name or a uid: 0, or -EINVAL when nobody is called that. */
static int resolve_uid(const char *name, uid_t *ret) {
        char *end, buf[4096];
        struct passwd pw, *found = NULL;
        unsigned long v = strtoul(name, &end, 10);
        if (*name && !*end && v < (uid_t)-1) {
                *ret = (uid_t)v;
                return 0;
        }
        if (getpwnam_r(name, &pw, buf, sizeof(buf), &found) != 0 || !found)
                return -EINVAL;
        *ret = found->pw_uid;
        return 0;
}

/* Who may be kvcd: o->daemon_user or $KVC_DAEMON_UID pins one user; otherwise root, this
 * process's uid (a kvcd started by hand) and the user "kvcd" that systemd/kvcd.service runs as.
 * Either way a side channel listened on by pid 1 as root is the service manager's (socket
 * activation: SO_PEERCRED names whoever called listen()). */
static int daemon_users(struct kvc_client *c, const struct kvc_options *o) {
        const char *pin = o->daemon_user && *o->daemon_user ? o->daemon_user : getenv("KVC_DAEMON_UID");
        if (pin && *pin) {
                c->pinned = true;
                if (resolve_uid(pin, &c->daemon_uid) < 0) {
                        snprintf(connect_error, sizeof(connect_error), "kvcd's user %s: no such user", pin);
                        return -EINVAL;
                }
                return 0;
        }
        c->has_service_uid = resolve_uid(KVC_SERVICE_USER, &c->service_uid) == 0;
        return 0;
}

static bool daemon_allowed(const struct kvc_client *c, uid_t uid) {
        if (c->pinned)
                return uid == c->daemon_uid;
        return uid == 0 || uid == getuid() || uid == geteuid() ||
               (c->has_service_uid && uid == c->service_uid);
}

static const char *allowed_text(const struct kvc_client *c, char *buf, size_t len) {
        if (c->pinned)
                snprintf(buf, len, "only uid %u (KVC_DAEMON_UID)", (unsigned)c->daemon_uid);
        else if (c->has_service_uid)
                snprintf(buf, len, "root, uid %u or the user %s (uid %u)", (unsigned)getuid(),
                         KVC_SERVICE_USER, (unsigned)c->service_uid);
        else
                snprintf(buf, len, "root or uid %u", (unsigned)getuid());
        return buf;
}

/* The peer of peer_fd, a connection to one of kvcd's sockets (SO_PEERCRED: the kernel's word),
 * then the directory of sock_path and sock_path itself: all must belong to a user allowed to be
 * kvcd, and nobody else may write in the directory (else they could put their own socket beside
 * the real one). 0, or -errno (-EPERM: not kvcd's) with the reason in why. */
static int check_daemon_paths(const struct kvc_client *c, int peer_fd, const char *peer_path,
                              const char *sock_path, char *why, size_t why_len) {
        struct ucred cr;
        socklen_t len = sizeof(cr);
        struct stat st;
        char allowed[160], dir[256];
        if (getsockopt(peer_fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0) {
                int e = errno;
                snprintf(why, why_len, "SO_PEERCRED on %s: %s", peer_path, strerror(e));
                return -e;
        }
        /* under socket activation the listening socket is the service manager's (pid 1, root) */
        bool activated = cr.uid == 0 && cr.pid == 1;
        if (!daemon_allowed(c, cr.uid) && !activated) {
                snprintf(why, why_len, "%s is served by uid %u (pid %d), not by kvcd's user (%s)", peer_path,
                         (unsigned)cr.uid, (int)cr.pid, allowed_text(c, allowed, sizeof(allowed)));
                return -EPERM;
        }
        const char *slash = strrchr(sock_path, '/');
        snprintf(dir, sizeof(dir), "%.*s", slash ? (int)(slash - sock_path) : 1, slash ? sock_path : ".");
        if (!dir[0])
                snprintf(dir, sizeof(dir), "/");
        /* a symlink for the directory (in /tmp, anyone's) could be pointed elsewhere after the
         * checks: only one of an allowed user is followed */
        if (lstat(dir, &st) == 0 && S_ISLNK(st.st_mode) && !daemon_allowed(c, st.st_uid) && st.st_uid != 0) {
                snprintf(why, why_len, "kvcd's runtime directory %s is a symlink of uid %u", dir,
                         (unsigned)st.st_uid);
                return -EPERM;
        }
        if (stat(dir, &st) < 0) {
                int e = errno;
                snprintf(why, why_len, "%s: %s", dir, strerror(e));
                return -e;
        }
        if ((!daemon_allowed(c, st.st_uid) && st.st_uid != 0) || (st.st_mode & (S_IWGRP | S_IWOTH))) {
                snprintf(why, why_len,
                         "kvcd's runtime directory %s belongs to uid %u with mode %04o: it must be "
                         "kvcd's (%s) and writable by nobody else",
                         dir, (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777),
                         allowed_text(c, allowed, sizeof(allowed)));
                return -EPERM;
        }
        if (lstat(sock_path, &st) < 0) {
                int e = errno;
                snprintf(why, why_len, "%s: %s", sock_path, strerror(e));
                return -e;
        }
        if (!S_ISSOCK(st.st_mode) || (!daemon_allowed(c, st.st_uid) && st.st_uid != 0)) {
                snprintf(why, why_len, "%s is not a socket of kvcd's user (%s): uid %u", sock_path,
                         allowed_text(c, allowed, sizeof(allowed)), (unsigned)st.st_uid);
                return -EPERM;
        }
        return 0;
}

/* The connected side channel's peer, the runtime directory and kvcd.sock (check_daemon_paths).
 * -EPERM, the reason in c->error. Called before a byte is sent or anything is mapped. */
static int check_daemon(struct kvc_client *c) {
        char why[sizeof(c->error)];
        int r = check_daemon_paths(c, c->fd, c->fd_path, c->sock_path, why, sizeof(why));
        return r < 0 ? client_error(c, r, "%s", why) : 0;
}

int kvc_check_daemon_socket(const char *path, const char *daemon_user, char *why, size_t why_len) {
        char none[1];
        if (!why || !why_len)
                why = none, why_len = sizeof(none);
        why[0] = '\0';
        if (!path || !*path) {
                snprintf(why, why_len, "no socket path");
                return -EINVAL;
        }
        struct kvc_client *c = calloc(1, sizeof(*c));
        if (!c)
                return -ENOMEM;
        struct kvc_options o = { .daemon_user = daemon_user };
        int r = daemon_users(c, &o);
        if (r < 0) {
                snprintf(why, why_len, "%s", connect_error);
                free(c);
                return r;
        }
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        int fd = -1;
        if (strlen(path) >= sizeof(sa.sun_path)) {
                snprintf(why, why_len, "socket path too long: %s", path);
                r = -ENAMETOOLONG;
        } else if ((fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0) {
                r = -errno;
                snprintf(why, why_len, "socket: %s", strerror(-r));
        } else {
                memcpy(sa.sun_path, path, strlen(path) + 1);
                if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                        r = -errno;
                        snprintf(why, why_len, "cannot connect to %s: %s", path, strerror(-r));
                } else {
                        r = check_daemon_paths(c, fd, path, path, why, why_len);
                }
        }
        if (fd >= 0)
                close(fd);
        free(c);
        return r;
}

/* kvcd.sock and kvcd.fd.sock from a runtime directory or a kvcd.sock path. */
static int socket_paths(const char *hint, char *sock, char *fdp, size_t len) {
        char dir[256];
        struct stat st;
        int r;
        if (hint && *hint) {
                size_t n = strlen(hint);
                bool sock_path = (stat(hint, &st) == 0 && S_ISSOCK(st.st_mode)) ||
                                 (n > 5 && strcmp(hint + n - 5, ".sock") == 0);
                if (!sock_path) {
                        r = snprintf(dir, sizeof(dir), "%s", hint);
                } else {
                        const char *slash = strrchr(hint, '/');
                        r = slash ? snprintf(dir, sizeof(dir), "%.*s", (int)(slash - hint), hint)
                                  : snprintf(dir, sizeof(dir), ".");
                        if (r >= 0 && (size_t)r < sizeof(dir) && snprintf(sock, len, "%s", hint) < (int)len)
                                return snprintf(fdp, len, "%s/kvcd.fd.sock", dir) < (int)len ? 0
                                                                                             : -ENAMETOOLONG;
                }
                if (r < 0 || (size_t)r >= sizeof(dir))
                        return -ENAMETOOLONG;
        } else if ((r = kvc_default_runtime_dir(dir, sizeof(dir))) < 0) {
                return r;
        }
        if (snprintf(sock, len, "%s/kvcd.sock", dir) >= (int)len ||
            snprintf(fdp, len, "%s/kvcd.fd.sock", dir) >= (int)len)
                return -ENAMETOOLONG;
        return 0;
}

/* kvcd reads no request frame over WIRE_REQUEST_MAX_BYTES: it cannot say which request it
 * refused (ZeroMQ drops a peer above 1 MiB without a word), so the caller would wait its whole
 * timeout. Refused here, before anything is sent (issue 28). */
static int check_request_size(struct kvc_client *c, size_t n) {
        if (n > WIRE_REQUEST_MAX_BYTES)
                return client_error(c, -EMSGSIZE, "the request is %zu bytes, kvcd takes at most %u", n,
                                    WIRE_REQUEST_MAX_BYTES);
        return 0;
}

int client_send_packed(struct kvc_client *c, const uint8_t *bytes, size_t n) {
        int r = check_request_size(c, n);
        if (r < 0)
                return r;
        if (!c->zsock) /* a client made by kvc_fuzz_client_new(): nobody to tell */
                return 0;
        if (zmq_send(c->zsock, bytes, n, 0) < 0)
                return client_error(c, -ECONNREFUSED, "cannot send to kvcd: %s", zmq_strerror(zmq_errno()));
        return 0;
}

int client_send(struct kvc_client *c, Kvc__Envelope *env) {
        env->version = WIRE_VERSION;
        size_t n = wire_packed_size(env);
        int r = check_request_size(c, n);
        if (r < 0)
                return r;
        if (!c->zsock) /* a client made by kvc_fuzz_client_new(): nobody to tell */
                return 0;
        if (n > c->sendbuf_cap) {
                uint8_t *b = realloc(c->sendbuf, n);
                if (!b)
                        return -ENOMEM;
                c->sendbuf = b;
                c->sendbuf_cap = n;
        }
        wire_pack(env, c->sendbuf);
        return client_send_packed(c, c->sendbuf, n);
}

/* Receives one message (valid until the next receive). -ETIMEDOUT, -ENOTCONN when kvcd's side
 * channel hung up (it died), -EPROTO for a message that fails validation. */
int client_recv(struct kvc_client *c, int timeout_ms, Kvc__Envelope **ret) {
        zmq_pollitem_t items[2] = {
                { .socket = c->zsock, .events = ZMQ_POLLIN },
                { .fd = c->fd, .events = ZMQ_POLLIN },
        };
        for (;;) {
                int n = zmq_poll(items, 2, timeout_ms);
                if (n < 0 && zmq_errno() == EINTR)
                        continue;
                if (n < 0)
                        return client_error(c, -EIO, "poll: %s", zmq_strerror(zmq_errno()));
                if (n == 0)
                        return client_error(c, -ETIMEDOUT, "no answer from kvcd within %d ms", timeout_ms);
                /* the side channel first, as kvcd sent it first: a chunk ahead of the message that
                 * names it, one kvcd asks back, or kvcd hung up */
                if (items[1].revents) {
                        struct fdwire_msg m;
                        int fd, r = fdwire_recv(c->fd, &m, &fd, 0);
                        if (r == -ENOTCONN)
                                return client_error(c, -ENOTCONN, "kvcd closed the connection");
                        if (r == 0 && (r = mapping_side_record(c, &m, fd)) < 0)
                                return r;
                        if (r < 0 && r != -ETIMEDOUT && r != -EPROTO)
                                return client_error(c, r, "side channel: %s", strerror(-r));
                        if (r == 0)
                                continue; /* there may be more */
                }
                if (items[0].revents)
                        break;
        }
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, c->zsock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&msg);
                return client_error(c, -EIO, "receive: %s", zmq_strerror(zmq_errno()));
        }
        char why[WIRE_MAX_MESSAGE];
        Kvc__Envelope *env;
        int r = wire_decode(c->arena, zmq_msg_data(&msg), zmq_msg_size(&msg), WIRE_REPLY_MAX_BYTES, &env, why,
                            sizeof(why));
        zmq_msg_close(&msg);
        if (r < 0)
                return client_error(c, -EPROTO, "bad message from kvcd: %s", why);
        *ret = env;
        return 0;
}

/* Sends env and waits for its reply of kind want (other messages are dispatched meanwhile). The
 * reply is valid until the next receive. An Error reply becomes its -code. */
int client_call(struct kvc_client *c, Kvc__Envelope *env, Kvc__Envelope__BodyCase want, Kvc__Envelope **ret) {
        env->request_id = ++c->next_request_id;
        int r = client_send(c, env);
        if (r < 0)
                return r;
        for (;;) {
                Kvc__Envelope *in;
                r = client_recv(c, c->timeout_ms, &in);
                if (r == -ENOTCONN && !c->recovering) { /* kvcd restarted: resume, then ask again */
                        if ((r = resume_recover(c)) < 0 || (r = client_send(c, env)) < 0)
                                return r;
                        continue;
                }
                if (r < 0)
                        return r;
                if (in->request_id != env->request_id) {
                        step_dispatch(c, in);
                        continue;
                }
                if (in->body_case == KVC__ENVELOPE__BODY_ERROR)
                        return client_error(c, -in->error->code, "kvcd: %s", in->error->message);
                if (in->body_case != want)
                        return client_error(c, -EPROTO, "kvcd answered %s to %s",
                                            wire_body_name(in->body_case), wire_body_name(env->body_case));
                *ret = in;
                return 0;
        }
}

/* The fd channel (kvcd's Welcome record, and the GPU's UUID for a device pool), the ZeroMQ
 * socket, and Hello: this client's connection to kvcd. On failure the caller closes what opened. */
int client_open_channels(struct kvc_client *c, bool *ret_device, uint8_t uuid[16],
                         Kvc__Envelope **ret_welcome) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        struct fdwire_msg m;
        int fd = -1, r;
        if (strlen(c->fd_path) >= sizeof(sa.sun_path))
                return -ENAMETOOLONG;
        memcpy(sa.sun_path, c->fd_path, strlen(c->fd_path) + 1);
        c->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
                return -errno;
        if ((r = check_daemon(c)) < 0)
                return r;
        r = fdwire_recv(c->fd, &m, &fd, c->timeout_ms);
        if (r == 0 && (m.kind != FDWIRE_WELCOME || fd >= 0)) {
                if (fd >= 0)
                        close(fd);
                r = -EPROTO;
        }
        bool device = r == 0 && (m.flags & FDWIRE_DEVICE_MEM);
        if (device) { /* the GPU's UUID follows */
                struct fdwire_msg dm;
                r = fdwire_recv(c->fd, &dm, &fd, c->timeout_ms);
                if (r == 0 && (dm.kind != FDWIRE_DEVICE || fd >= 0)) {
                        if (fd >= 0)
                                close(fd);
                        r = -EPROTO;
                }
                if (r == 0)
                        memcpy(uuid, dm.token, 16);
        }
        if (r < 0)
                return r;
        *ret_device = device;

        int zero = 0;
        char ep[300];
        snprintf(ep, sizeof(ep), "ipc://%s", c->sock_path);
        if (!c->zctx && !(c->zctx = zmq_ctx_new()))
                return -ENOMEM;
        c->zsock = zmq_socket(c->zctx, ZMQ_DEALER);
        /* our routing id: the secret token (a first byte of 0 is ZeroMQ's), so that a connection
         * kvcd dropped (a heartbeat timeout while we were stopped) comes back as the same peer */
        uint8_t rid[1 + sizeof(m.token)] = { 'K' };
        memcpy(rid + 1, m.token, sizeof(m.token));
        if (!c->zsock || zmq_setsockopt(c->zsock, ZMQ_ROUTING_ID, rid, sizeof(rid)) < 0 ||
            zmq_setsockopt(c->zsock, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
            zmq_setsockopt(c->zsock, ZMQ_SNDTIMEO, &c->timeout_ms, sizeof(c->timeout_ms)) < 0 ||
            zmq_connect(c->zsock, ep) < 0)
                return -ECONNREFUSED;

        Kvc__Hello hello = KVC__HELLO__INIT;
        hello.token.data = m.token;
        hello.token.len = sizeof(m.token);
        hello.client_name = c->name;
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.body_case = KVC__ENVELOPE__BODY_HELLO;
        env.hello = &hello;
        return client_call(c, &env, KVC__ENVELOPE__BODY_WELCOME, ret_welcome);
}

void client_close_channels(struct kvc_client *c) {
        if (c->zsock)
                zmq_close(c->zsock);
        c->zsock = NULL;
        if (c->fd >= 0)
                close(c->fd); /* kvcd frees everything of ours when this closes */
        c->fd = -1;
}

int kvc_connect(const struct kvc_options *opt, struct kvc_client **ret) {
        struct kvc_options o = opt ? *opt : (struct kvc_options){ 0 };
        struct kvc_client *c = calloc(1, sizeof(*c));
        if (!c)
                return -ENOMEM;
        connect_error[0] = 0;
        c->fd = -1;
        c->base = MAP_FAILED;
        c->timeout_ms = o.timeout_ms > 0 ? o.timeout_ms : KVC_DEFAULT_TIMEOUT_MS;
        c->plan_lag = o.plan_lag < KVC_MAX_PENDING ? o.plan_lag : KVC_MAX_PENDING - 1;
        c->resume_ms = o.resume_ms == 0 ? 30000 : o.resume_ms;
        snprintf(c->name, sizeof(c->name), "%s", o.name ? o.name : "libkvc");
        int r = socket_paths(o.socket, c->sock_path, c->fd_path, sizeof(c->sock_path));
        if (r == 0)
                r = daemon_users(c, &o);
        if (r == 0)
                r = wire_arena_new(WIRE_REPLY_MAX_BYTES * 2, &c->arena);
        bool device = false;
        Kvc__Envelope *in = NULL;
        if (r == 0)
                r = client_open_channels(c, &device, c->device_uuid, &in);
        if (r < 0) {
                if (!connect_error[0] && c->error[0])
                        snprintf(connect_error, sizeof(connect_error), "%s", c->error);
                kvc_disconnect(c);
                return r;
        }
        const Kvc__Welcome *w = in->welcome;
        c->client_id = w->client_id;
        c->resumable = w->resumable;
        c->chunk_bytes = w->chunk_bytes;
        c->pool_bytes = w->pool_bytes;
        c->n_chunks = (uint32_t)(w->pool_bytes / w->chunk_bytes);
        c->block_tokens = w->block_tokens;
        c->mapped = calloc(c->n_chunks, 1);
        c->mapped_gen = calloc(c->n_chunks, sizeof(*c->mapped_gen));
        if (!c->mapped || !c->mapped_gen) {
                kvc_disconnect(c);
                return -ENOMEM;
        }
        if (device) {
                char why[512];
                r = cuda_driver_load(NULL, &c->drv, why, sizeof(why));
                if (r == 0)
                        r = devpool_open(&c->drv, c->device_uuid, c->pool_bytes, c->chunk_bytes, &c->dev, why,
                                         sizeof(why));
                if (r < 0) {
                        snprintf(connect_error, sizeof(connect_error), "the pool is on GPU %s: %s",
                                 uuid_text(c->device_uuid).s, why);
                        kvc_disconnect(c);
                        return r;
                }
                c->base = (uint8_t *)(uintptr_t)devpool_base(c->dev);
        } else {
                c->base = mmap(NULL, c->pool_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                               -1, 0);
                if (c->base == MAP_FAILED) {
                        kvc_disconnect(c);
                        return -ENOMEM;
                }
        }
        *ret = c;
        return 0;
}

struct kvc_client *kvc_disconnect(struct kvc_client *c) {
        if (!c)
                return NULL;
        while (c->sessions) {
                struct kvc_session *s = c->sessions;
                c->sessions = s->next;
                session_free(s);
        }
        if (c->zsock)
                zmq_close(c->zsock);
        c->zsock = NULL;
        if (c->zctx)
                zmq_ctx_term(c->zctx);
        for (uint32_t i = 0; i < KVC_MAX_PENDING; i++) {
                free(c->sent[i].bytes);
                free(c->sent[i].steps);
        }
        if (c->dev) {
                c->dev = devpool_free(c->dev);
                c->base = MAP_FAILED;
        }
        cuda_driver_unload(&c->drv);
        if (c->base != MAP_FAILED)
                munmap(c->base, c->pool_bytes);
        if (c->fd >= 0) { /* nothing of the pool is mapped here any more: kvcd may scrub it at once */
                struct fdwire_msg bye = { .magic = FDWIRE_MAGIC,
                                          .version = FDWIRE_VERSION,
                                          .kind = FDWIRE_BYE };
                fdwire_send(c->fd, &bye, -1);
        }
        client_close_channels(c);
        free(c->mapped);
        free(c->mapped_gen);
        wire_arena_free(c->arena);
        free(c->sendbuf);
        free(c->queue);
        free(c->lengths);
        free(c);
        return NULL;
}
