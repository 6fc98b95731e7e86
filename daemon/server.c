/* server.c: kvcd's sockets and its one event loop.
 *
 * One thread, one zmq_poll over: the client ROUTER, the admin ROUTER, the fd side channel's
 * listening socket, every client's side-channel connection, and a signalfd. In each round the
 * side-channel events are handled before any ZeroMQ message, so a request that arrives after a
 * client died is answered with the death already accounted (tests rely on it, and so do
 * operators reading `kvcctl status` right after a crash). zmq_poll alone does not promise that
 * (it reads a ZeroMQ socket's events after its poll() of the fds), so before an admin request
 * kvcd polls the side channels once more without waiting (handle_hangups_now).
 *
 * Out of file descriptors, the side channel's listener is left out of the poll for a while
 * (client_accepting): a listener that stays readable while accept4 fails would make the loop spin.
 *
 * Start-up takes an flock on $RUNTIME_DIR/kvcd.lock before touching the socket paths: binding
 * an ipc:// path that a live kvcd serves would silently steal it, so a second kvcd on the same
 * directory refuses to start instead. The directory must be kvcd's own and writable by nobody
 * else, and the lock is opened without following symlinks (docs/security.md, "Runtime directory
 * and credentials"): in a directory another user made, that user would choose what kvcd creates
 * and which sockets clients reach. READY=1 goes to systemd (or a test's fake NOTIFY_SOCKET)
 * once every socket is bound.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <stddef.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>
#include <zmq.h>

#include "admin.h"
#include "backend.h"
#include "clock.h"
#include "events.h"
#include "fdguard.h"
#include "handlers.h"
#include "http.h"
#include "kvcd.h"
#include "log.h"
#include "notify.h"
#include "plan.h"
#include "pool.h"
#include "prefix.h"

/* Frames above this make ZeroMQ drop the connection; frames between WIRE_REQUEST_MAX_BYTES and
 * this get an EMSGSIZE reply. */
#define KVCD_ZMQ_MAXMSGSIZE     (1 << 20)
#define KVCD_MESSAGES_PER_ROUND 1024
/* Messages ZeroMQ queues per client connection each way: replies a client does not read are
 * dropped past it (dropped_replies), so one that never reads holds at most this many of kvcd's
 * replies in memory (docs/security.md). Operators' connections keep ZeroMQ's default. */
#define KVCD_CLIENT_HWM 64
#define KVCD_ADMIN_HWM  1000

static int path_in(char *dst, size_t cap, const char *dir, const char *name) {
        int n = snprintf(dst, cap, "%s/%s", dir, name);
        return n < 0 || (size_t)n >= cap || (size_t)n >= sizeof(((struct sockaddr_un *)0)->sun_path)
                       ? -ENAMETOOLONG
                       : 0;
}

/* The runtime directory, made 0750 if missing, opened without following a symlink: an fd on it
 * (*ret_fd) once it is ours and nobody else can write in it. A directory somebody else made (a
 * squatter in /tmp: kvcd would create files and serve sockets where that user controls the names)
 * is refused with -EPERM, one others may write in with -EACCES; why says which. */
static int open_runtime_dir(const char *dir, int *ret_fd, char *why, size_t why_len) {
        struct stat st;
        if (mkdir(dir, 0750) < 0 && errno != EEXIST) {
                int r = -errno;
                snprintf(why, why_len, "cannot create it: %s", strerror(errno));
                return r;
        }
        int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0 || fstat(fd, &st) < 0) {
                int r = -errno;
                snprintf(why, why_len, "%s",
                         errno == ELOOP || errno == ENOTDIR ? "not a directory (a symlink?)"
                                                            : strerror(errno));
                if (fd >= 0)
                        close(fd);
                return r;
        }
        if (st.st_uid != geteuid()) {
                snprintf(why, why_len,
                         "it belongs to uid %u, not to kvcd's uid %u: refusing a directory "
                         "somebody else made",
                         (unsigned)st.st_uid, (unsigned)geteuid());
                close(fd);
                return -EPERM;
        }
        if (st.st_mode & (S_IWGRP | S_IWOTH)) {
                snprintf(why, why_len, "mode %04o lets others create and replace files in it (at most 0755)",
                         (unsigned)(st.st_mode & 07777));
                close(fd);
                return -EACCES;
        }
        *ret_fd = fd;
        return 0;
}

/* kvcd.lock in the runtime directory dir_fd: opened without following a symlink (ELOOP), and only
 * a plain file of ours with one link is taken. -EBUSY when another kvcd holds it. */
static int take_lock(struct kvcd *d, int dir_fd) {
        struct stat st;
        d->lock_fd = openat(dir_fd, "kvcd.lock", O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (d->lock_fd < 0)
                return -errno;
        if (fstat(d->lock_fd, &st) < 0)
                return -errno;
        if (!S_ISREG(st.st_mode) || st.st_nlink != 1 || st.st_uid != geteuid())
                return -EPERM;
        if (flock(d->lock_fd, LOCK_EX | LOCK_NB) < 0)
                return errno == EWOULDBLOCK ? -EBUSY : -errno;
        return 0;
}

/* Takes the sockets systemd (or a test playing it) passed: each listening Unix socket is known by
 * the name of the path it listens on. Returns how many. */
static int take_activated_sockets(struct kvcd *d) {
        char **names = NULL;
        int n = sd_listen_fds_with_names(1, &names), taken = 0;
        for (int i = 0; i < n; i++) {
                int fd = SD_LISTEN_FDS_START + i;
                struct sockaddr_un sa;
                socklen_t len = sizeof(sa);
                const char *base = NULL;
                if (sd_is_socket(fd, AF_UNIX, 0, 1) > 0 &&
                    getsockname(fd, (struct sockaddr *)&sa, &len) == 0 &&
                    len > offsetof(struct sockaddr_un, sun_path) && sa.sun_path[0]) {
                        base = strrchr(sa.sun_path, '/');
                        base = base ? base + 1 : sa.sun_path;
                }
                int *slot = !base                                   ? NULL
                            : strcmp(base, "kvcd.sock") == 0        ? &d->act_client_fd
                            : strcmp(base, "kvcd.fd.sock") == 0     ? &d->fd_listen
                            : strcmp(base, "kvcd.admin.sock") == 0  ? &d->act_admin_fd
                            : strcmp(base, "kvcd.events.sock") == 0 ? &d->events_fd
                                                                    : NULL;
                if (slot && *slot < 0) {
                        *slot = fd;
                        taken++;
                } else if (names && names[i] && restore_keep_fd(d, names[i], fd) == 0) {
                        /* a chunk or the state record kept in the fd store (restart.c) */
                } else {
                        log_warning("ignoring passed fd %d (%s)", fd, names && names[i] ? names[i] : "?");
                        close(fd);
                }
        }
        if (names)
                for (int i = 0; i < n; i++)
                        free(names[i]);
        free(names);
        if (taken)
                log_info("%d sockets from socket activation", taken);
        return taken;
}

static int listen_fd_channel(struct kvcd *d) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        if (d->fd_listen >= 0) /* activated */
                return fcntl(d->fd_listen, F_SETFL, fcntl(d->fd_listen, F_GETFL) | O_NONBLOCK) < 0 ? -errno
                                                                                                   : 0;
        memcpy(sa.sun_path, d->fd_path, strlen(d->fd_path) + 1); /* path_in() checked the length */
        d->fd_listen = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (d->fd_listen < 0)
                return -errno;
        unlink(d->fd_path); /* stale: we hold the lock */
        if (bind(d->fd_listen, (struct sockaddr *)&sa, sizeof(sa)) < 0 || chmod(d->fd_path, 0660) < 0 ||
            listen(d->fd_listen, 128) < 0)
                return -errno;
        return 0;
}

static int bind_router(struct kvcd *d, void **ret, const char *path, mode_t mode, int act_fd, int hwm) {
        void *s = zmq_socket(d->zctx, ZMQ_ROUTER);
        if (!s)
                return -zmq_errno();
        int one = 1, zero = 0, ivl = 2000, timeout = 10000;
        int64_t max = KVCD_ZMQ_MAXMSGSIZE;
        char ep[300];
        snprintf(ep, sizeof(ep), "ipc://%s", path);
        if (act_fd < 0)
                unlink(path);
        if ((act_fd >= 0 && zmq_setsockopt(s, ZMQ_USE_FD, &act_fd, sizeof(act_fd)) < 0) ||
            zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &one, sizeof(one)) < 0 ||
            /* a client that comes back under its routing id (libkvc's is its secret token: after a
             * heartbeat timeout, say) takes its place over again */
            zmq_setsockopt(s, ZMQ_ROUTER_HANDOVER, &one, sizeof(one)) < 0 ||
            zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &max, sizeof(max)) < 0 ||
            zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
            zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm)) < 0 ||
            zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm)) < 0 ||
            zmq_setsockopt(s, ZMQ_HEARTBEAT_IVL, &ivl, sizeof(ivl)) < 0 ||
            zmq_setsockopt(s, ZMQ_HEARTBEAT_TIMEOUT, &timeout, sizeof(timeout)) < 0 ||
            /* a connection that never greets gives its descriptor back within 2 s (fdguard.h) */
            zmq_setsockopt(s, ZMQ_HANDSHAKE_IVL, &ivl, sizeof(ivl)) < 0 || zmq_bind(s, ep) < 0) {
                int r = -zmq_errno();
                zmq_close(s);
                return r;
        }
        *ret = s;
        return act_fd < 0 && chmod(path, mode) < 0 ? -errno : 0;
}

/* ZeroMQ connections fdguard refused for want of descriptors: logged at most once a second. */
static void log_fd_refusals(struct kvcd *d) {
        static unsigned long seen;
        static uint64_t last_usec;
        unsigned long n = fdguard_refusals();
        uint64_t now = now_usec();
        if (n == seen || now - last_usec < 1000000)
                return;
        log_warning("ZeroMQ connections refused for want of descriptors: %lu so far (%u kept free, %u for "
                    "operators)",
                    n, KVCD_FD_RESERVE, KVCD_FD_RESERVE_ADMIN);
        seen = n;
        last_usec = now;
        (void)d;
}

/* Gives freed heap back to the system (issue 28, item 13): called about once a second, it trims
 * when the free memory the allocator holds (every arena's, ZeroMQ's I/O thread's included) grew by
 * more than KVCD_TRIM_SLACK_BYTES since the last trim, so a transient peak (replies queued to a
 * peer that left, a replay, a burst of sessions) does not stay in kvcd's RSS, and an idle kvcd
 * does not trim again and again what fragmentation keeps. */
static void trim_heap(void) {
        static size_t kept; /* free bytes held after the last trim */
        struct mallinfo2 mi = mallinfo2();
        if (mi.fordblks <= kept + KVCD_TRIM_SLACK_BYTES) {
                if (mi.fordblks < kept)
                        kept = mi.fordblks;
                return;
        }
        malloc_trim(0);
        kept = mallinfo2().fordblks;
}

static int open_signals(struct kvcd *d) {
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, SIGTERM);
        sigaddset(&set, SIGINT);
        sigaddset(&set, SIGHUP);
        /* blocked before the ZeroMQ context starts its I/O thread, which inherits the mask */
        if (sigprocmask(SIG_BLOCK, &set, NULL) < 0)
                return -errno;
        signal(SIGPIPE, SIG_IGN);
        d->sig_fd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
        return d->sig_fd < 0 ? -errno : 0;
}

int server_start(struct kvcd *d) {
        const char *dir = d->cfg.runtime_dir;
        int r;

        d->fd_listen = d->sig_fd = d->lock_fd = d->events_fd = d->act_client_fd = d->act_admin_fd = -1;
        bool activated = take_activated_sockets(d) > 0;
        char why_dir[256];
        int dir_fd = -1;
        if ((r = open_runtime_dir(dir, &dir_fd, why_dir, sizeof(why_dir))) < 0) {
                log_error("runtime directory %s: %s", dir, why_dir);
                return r;
        }
        if ((r = path_in(d->sock_path, sizeof(d->sock_path), dir, "kvcd.sock")) < 0 ||
            (r = path_in(d->fd_path, sizeof(d->fd_path), dir, "kvcd.fd.sock")) < 0 ||
            (r = path_in(d->admin_path, sizeof(d->admin_path), dir, "kvcd.admin.sock")) < 0 ||
            (r = path_in(d->events_path, sizeof(d->events_path), dir, "kvcd.events.sock")) < 0 ||
            (r = path_in(d->lock_path, sizeof(d->lock_path), dir, "kvcd.lock")) < 0) {
                log_error("runtime directory path too long for a socket: %s", dir);
                close(dir_fd);
                return r;
        }
        r = activated ? 0 : take_lock(d, dir_fd); /* systemd owns activated paths: nobody can steal them */
        close(dir_fd);
        if (r == -EBUSY) {
                log_error("another kvcd is serving %s: refusing to start", dir);
                return r;
        }
        if (r < 0) {
                log_error("cannot lock %s: %s", d->lock_path,
                          r == -ELOOP   ? "it is a symlink: refusing to follow it"
                          : r == -EPERM ? "not a plain file of kvcd's own with one link"
                                        : strerror(-r));
                return r;
        }
        uint64_t max =
                d->cfg.pool_max_bytes > d->cfg.capacity_bytes ? d->cfg.pool_max_bytes : d->cfg.capacity_bytes;
        struct backend_params bp = { .va_bytes = d->cfg.chunk_bytes ? max - max % d->cfg.chunk_bytes : 0,
                                     .chunk_bytes = d->cfg.chunk_bytes,
                                     .device = d->cfg.device };
        char why[512];
        if ((r = backend_select(d->cfg.backend, &bp, &d->backend, why, sizeof(why))) < 0) {
                log_error("backend %s: %s", d->cfg.backend, why);
                return r;
        }
        if (why[0])
                log_notice("backend auto: %s", why);
        struct backend_info bi;
        backend_get_info(d->backend, &bi);
        if (bi.device)
                log_notice("cuda backend: %s (%s), driver %d.%d, allocation granularity %llu bytes",
                           bi.device_text, bi.device_name, bi.driver_version / 1000,
                           bi.driver_version % 1000 / 10, (unsigned long long)bi.granularity);
        if ((r = pool_new(d->backend, max, d->cfg.chunk_bytes, &d->pool)) < 0 ||
            (r = pool_set_capacity(d->pool, d->cfg.capacity_bytes)) < 0) {
                log_error("cannot create a pool of %llu bytes in %llu-byte chunks: %s",
                          (unsigned long long)d->cfg.capacity_bytes, (unsigned long long)d->cfg.chunk_bytes,
                          strerror(-r));
                return r;
        }
        if ((r = idmap_init(&d->sessions, 64)) < 0 || (r = prefix_init(d)) < 0 ||
            (r = wire_arena_new(WIRE_REQUEST_MAX_BYTES * 16, &d->in)) < 0 ||
            (r = wire_arena_new(WIRE_REPLY_MAX_BYTES, &d->out)) < 0 ||
            (r = wire_arena_new(NOTE_BYTES, &d->notes)) < 0 || (r = open_signals(d)) < 0)
                return r;
        if ((r = restart_begin(d)) < 0) {
                log_error("cannot set up the fd store: %s", strerror(-r));
                return r;
        }

        d->zctx = zmq_ctx_new();
        if (!d->zctx)
                return -ENOMEM;
        fdguard_arm(d->admin_path); /* before any ZeroMQ listener exists */
        if ((r = listen_fd_channel(d)) < 0 ||
            (r = bind_router(d, &d->zclient, d->sock_path, 0660, d->act_client_fd, KVCD_CLIENT_HWM)) < 0 ||
            (r = bind_router(d, &d->zadmin, d->admin_path, 0600, d->act_admin_fd, KVCD_ADMIN_HWM)) < 0 ||
            (r = events_open(d)) < 0) {
                log_error("cannot bind the sockets in %s: %s", dir, strerror(-r));
                return r;
        }
        static const double latency_bounds[] = { 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
                                                 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1,    1 };
        static const double confidence_bounds[] = { 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0 };
        histogram_init(&d->plan_latency, latency_bounds, sizeof(latency_bounds) / sizeof(latency_bounds[0]));
        histogram_init(&d->confidence, confidence_bounds,
                       sizeof(confidence_bounds) / sizeof(confidence_bounds[0]));
        if (d->cfg.metrics_port && (r = http_start(d)) < 0) {
                log_error("cannot serve metrics on %s port %u: %s",
                          d->cfg.metrics_address ? d->cfg.metrics_address : HTTP_DEFAULT_ADDRESS,
                          d->cfg.metrics_port, strerror(-r));
                return r;
        }
        d->started_usec = now_usec();
        d->started_unix_usec = unix_usec();
        uint64_t wd = 0;
        if (sd_watchdog_enabled(0, &wd) > 0)
                d->watchdog_usec = wd;
        log_notice("kvcd %s serving %s: backend %s, capacity %llu bytes in %llu-byte chunks", KVCD_VERSION,
                   dir, d->backend->name, (unsigned long long)d->cfg.capacity_bytes,
                   (unsigned long long)d->cfg.chunk_bytes);
        char ready[PATH_MAX + 64];
        snprintf(ready, sizeof(ready), "READY=1\nSTATUS=serving %s\nMAINPID=%d", dir, (int)getpid());
        notify_wait(ready); /* on the socket kvcd keeps: no descriptor comes and goes after it */
        return 0;
}

static void handle_signals(struct kvcd *d) {
        struct signalfd_siginfo si;
        while (read(d->sig_fd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
                if (si.ssi_signo == SIGHUP) {
                        log_info("SIGHUP: nothing to reload");
                        continue;
                }
                if (si.ssi_signo == SIGTERM && !d->stop_deadline_usec && d->sessions.n &&
                    d->cfg.stop_timeout_usec) {
                        /* a graceful stop: no new sessions, the open ones get stop_timeout to end */
                        d->draining = true;
                        d->stop_deadline_usec = now_usec() + d->cfg.stop_timeout_usec;
                        log_notice("SIGTERM: draining %u sessions for at most %.1f s (again to stop now)",
                                   d->sessions.n, (double)d->cfg.stop_timeout_usec / 1e6);
                        char msg[64];
                        snprintf(msg, sizeof(msg), "STOPPING=1\nSTATUS=draining %u sessions", d->sessions.n);
                        notify_nowait(msg);
                        continue;
                }
                log_notice("signal %u: stopping", si.ssi_signo);
                d->stopping = true;
        }
}

/* Receives and handles up to max frames from a ROUTER. */
static void drain_router(struct kvcd *d, void *zsock, enum channel ch, int max) {
        for (int i = 0; i < max; i++) {
                zmq_msg_t rid, body;
                zmq_msg_init(&rid);
                if (zmq_msg_recv(&rid, zsock, ZMQ_DONTWAIT) < 0) {
                        zmq_msg_close(&rid);
                        return;
                }
                zmq_msg_init(&body);
                bool ok = zmq_msg_more(&rid) && zmq_msg_recv(&body, zsock, ZMQ_DONTWAIT) >= 0;
                bool extra = ok && zmq_msg_more(&body);
                for (bool more = extra; more;) { /* drop surplus frames of this message */
                        zmq_msg_t junk;
                        zmq_msg_init(&junk);
                        more = zmq_msg_recv(&junk, zsock, ZMQ_DONTWAIT) >= 0 && zmq_msg_more(&junk);
                        zmq_msg_close(&junk);
                }
                if (ok && !extra)
                        handle_frame(d, ch, zsock, zmq_msg_data(&rid), zmq_msg_size(&rid),
                                     zmq_msg_data(&body), zmq_msg_size(&body));
                else if (ok) /* several frames: answer as to garbage */
                        handle_frame(d, ch, zsock, zmq_msg_data(&rid), zmq_msg_size(&rid), NULL, 0);
                zmq_msg_close(&body);
                zmq_msg_close(&rid);
        }
}

/* WATCHDOG=1 when systemd watches us, and STATUS= when it changed, at most once a second and
 * never waiting for the manager (notify.h): a status it had no room for is sent again next time. */
static void notify_status(struct kvcd *d) {
        struct pool_stats ps;
        char status[sizeof(d->last_status)];
        pool_get_stats(d->pool, &ps);
        snprintf(status, sizeof(status), "%u clients, %u sessions, %llu of %llu bytes in use", d->n_clients,
                 d->sessions.n, (unsigned long long)ps.used_bytes, (unsigned long long)ps.capacity_bytes);
        bool changed = strcmp(status, d->last_status) != 0;
        if (!changed && !d->watchdog_usec)
                return;
        char msg[sizeof(status) + 32];
        snprintf(msg, sizeof(msg), "%s%s%s", d->watchdog_usec ? "WATCHDOG=1\n" : "", changed ? "STATUS=" : "",
                 changed ? status : "");
        if (notify_nowait(msg) == 0 && changed)
                memcpy(d->last_status, status, sizeof(status));
}

/* Handles the side-channel hang-ups and process exits the kernel has seen by now, without waiting.
 * Called before an admin request: zmq_poll reports a ZeroMQ socket's messages as of when it looks
 * at that socket, which can be after it looked at the side channels, so a request sent after a
 * client hung up could otherwise be answered with the client still there. */
static void handle_hangups_now(struct kvcd *d) {
        struct pollfd p[2 * KVCD_MAX_CLIENTS];
        struct client *owners[KVCD_MAX_CLIENTS];
        uint32_t n = d->n_clients, n_holds = d->n_holds;
        for (uint32_t i = 0; i < n; i++) {
                owners[i] = d->clients[i];
                p[i] = (struct pollfd){ .fd = owners[i]->fd, .events = POLLIN };
        }
        for (uint32_t i = 0; i < n_holds; i++)
                p[n + i] = (struct pollfd){ .fd = d->holds[i].pidfd, .events = POLLIN };
        if (poll(p, n + n_holds, 0) <= 0)
                return;
        for (uint32_t i = 0; i < n; i++)
                if (p[i].revents && (client_drain(d, owners[i]) < 0 || (p[i].revents & POLLERR)))
                        client_destroy(d, owners[i], !owners[i]->said_bye);
        for (uint32_t i = n_holds; i-- > 0;)
                if (p[n + i].revents)
                        client_exited(d, i);
}

int server_run(struct kvcd *d) {
        enum { FIXED = 6 };
        zmq_pollitem_t items[FIXED + 2 * KVCD_MAX_CLIENTS];
        struct client *owners[KVCD_MAX_CLIENTS];
        uint64_t next_ping = 0;

        while (!d->stopping) {
                items[0] = (zmq_pollitem_t){ .socket = d->zclient, .events = ZMQ_POLLIN };
                items[1] = (zmq_pollitem_t){ .socket = d->zadmin, .events = ZMQ_POLLIN };
                uint64_t now0 = now_usec();
                /* out of fds: the listener is left alone for a while (polling it would spin) */
                items[2] = (zmq_pollitem_t){ .fd = client_accepting(d, now0) ? d->fd_listen : -1,
                                             .events = ZMQ_POLLIN };
                items[3] = (zmq_pollitem_t){ .fd = d->sig_fd, .events = ZMQ_POLLIN };
                items[4] = (zmq_pollitem_t){ .fd = http_fd(d), .events = ZMQ_POLLIN }; /* -1: ignored */
                items[5] =
                        (zmq_pollitem_t){ .socket = events_replay_socket(d), .fd = -1, .events = ZMQ_POLLIN };
                uint32_t n = d->n_clients;
                for (uint32_t i = 0; i < n; i++) {
                        owners[i] = d->clients[i];
                        items[FIXED + i] = (zmq_pollitem_t){ .fd = owners[i]->fd, .events = ZMQ_POLLIN };
                }
                uint32_t n_holds = d->n_holds; /* processes whose chunks wait for their exit */
                for (uint32_t i = 0; i < n_holds; i++)
                        items[FIXED + n + i] =
                                (zmq_pollitem_t){ .fd = d->holds[i].pidfd, .events = ZMQ_POLLIN };
                long timeout = d->watchdog_usec ? (long)(d->watchdog_usec / 2000) : 1000;
                uint64_t due = admin_next_deadline(d), due_clients = client_next_deadline(d);
                if (due_clients < due)
                        due = due_clients;
                if (due != UINT64_MAX)
                        timeout = due <= now0 ? 0
                                  : (long)((due - now0) / 1000) + 1 < timeout
                                          ? (long)((due - now0) / 1000) + 1
                                          : timeout;
                long http_ms = http_timeout_ms(d); /* its idle connections time out */
                if (http_ms >= 0 && http_ms < timeout)
                        timeout = http_ms;
                if (zmq_poll(items, (int)(FIXED + n + n_holds), timeout) < 0 && zmq_errno() != EINTR) {
                        log_error("zmq_poll: %s", zmq_strerror(zmq_errno()));
                        return -zmq_errno();
                }
                if (items[3].revents)
                        handle_signals(d);
                log_fd_refusals(d);
                for (uint32_t i = 0; i < n; i++) {
                        short ev = items[FIXED + i].revents;
                        /* what it wrote last (a BYE) is read before its hang-up is handled */
                        if (ev && (client_drain(d, owners[i]) < 0 || (ev & ZMQ_POLLERR)))
                                client_destroy(d, owners[i], !owners[i]->said_bye);
                }
                for (uint32_t i = n_holds; i-- > 0;) /* from the end: client_exited moves the last one here */
                        if (items[FIXED + n + i].revents)
                                client_exited(d, i);
                for (int i = 0; items[2].revents && i < 16; i++)
                        if (client_accept(d) <= 0)
                                break;
                if (items[0].revents)
                        drain_router(d, d->zclient, CHANNEL_CLIENT, KVCD_MESSAGES_PER_ROUND);
                /* one admin request a round: one that arrived while this round ran waits for the
                 * next poll, which hands kvcd the side channels' hang-ups first, so an operator
                 * never sees a client that had gone before the request was sent */
                if (items[1].revents) {
                        handle_hangups_now(d);
                        drain_router(d, d->zadmin, CHANNEL_ADMIN, 1);
                }
                http_run(d); /* every round: it also closes the connections that timed out */
                if (items[5].revents)
                        events_replay_run(d);
                if (pool_short_of_chunks(d->pool) || pool_over_capacity(d->pool))
                        client_reclaim(d);
                uint64_t now = now_usec();
                admin_tick(d, now);
                client_tick(d, now);
                restart_tick(d, now);
                handoff_tick(d, now);
                relocate_tick(d, now);
                handlers_retry_waits(d, now);
                if (d->stop_deadline_usec && (d->sessions.n == 0 || now >= d->stop_deadline_usec)) {
                        if (d->sessions.n)
                                log_warning("stop timeout: %u sessions still open are closed", d->sessions.n);
                        d->stopping = true;
                }
                if (now >= next_ping) {
                        trim_heap();
                        notify_status(d);
                        next_ping = now + (d->watchdog_usec ? d->watchdog_usec / 2 : 1000000u);
                }
        }
        return 0;
}

void server_stop(struct kvcd *d) {
        notify_nowait("STOPPING=1\nSTATUS=stopping");
        notify_close();
        http_stop(d);
        while (d->n_clients)
                client_destroy(d, d->clients[d->n_clients - 1], false);
        handoff_end(d);
        prefix_done(d);
        if (d->pool)
                restart_end(d);
        events_close(d);
        if (d->zclient)
                zmq_close(d->zclient);
        if (d->zadmin)
                zmq_close(d->zadmin);
        if (d->zctx)
                zmq_ctx_term(d->zctx);
        if (d->fd_listen >= 0) {
                close(d->fd_listen);
                if (d->act_client_fd < 0) { /* our own paths; activated ones are systemd's */
                        unlink(d->fd_path);
                        unlink(d->sock_path);
                        unlink(d->admin_path);
                        unlink(d->events_path);
                }
        }
        if (d->sig_fd >= 0)
                close(d->sig_fd);
        if (d->sessions.keys)
                idmap_done(&d->sessions);
        plan_scratch_done(&d->scratch);
        d->in = wire_arena_free(d->in);
        d->out = wire_arena_free(d->out);
        d->notes = wire_arena_free(d->notes);
        d->pool = pool_free(d->pool);
        backend_close(d->backend); /* after the pool: its chunks go first */
        d->backend = NULL;
        if (d->lock_fd >= 0)
                close(d->lock_fd);
        log_notice("kvcd stopped");
}
