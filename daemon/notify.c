/* notify.c: notify.h. One datagram socket, opened with READY=1 and kept: kvcd's descriptors are
 * all there when the manager (or a test) reads READY=1 (issue 28, item 7). */
#define _GNU_SOURCE
#include "notify.h"

#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

static int notify_fd = -1;
static struct sockaddr_un notify_addr;
static socklen_t notify_len;

static int notify_open(const char *where) {
        size_t n = strlen(where);
        if (n >= sizeof(notify_addr.sun_path))
                return -ENAMETOOLONG;
        notify_addr = (struct sockaddr_un){ .sun_family = AF_UNIX };
        memcpy(notify_addr.sun_path, where, n);
        if (where[0] == '@')
                notify_addr.sun_path[0] = '\0'; /* the abstract namespace */
        notify_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n + (where[0] == '@' ? 0 : 1));
        notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        return notify_fd < 0 ? -errno : 0;
}

static int send_msg(const char *msg, bool wait) {
        const char *where = getenv("NOTIFY_SOCKET");
        if (!where || !*where)
                return 0;
        if (where[0] != '/' && where[0] != '@') /* vsock: and the like */
                return sd_notify(0, msg) < 0 ? -EIO : 0;
        int r = notify_fd < 0 ? notify_open(where) : 0;
        if (r < 0)
                return r;
        while (sendto(notify_fd, msg, strlen(msg), MSG_DONTWAIT | MSG_NOSIGNAL, (struct sockaddr *)&notify_addr,
                      notify_len) < 0) {
                if (errno != EWOULDBLOCK && errno != EINTR)
                        return -errno;
                if (!wait)
                        return -EAGAIN;
                struct pollfd p = { .fd = notify_fd, .events = POLLOUT };
                poll(&p, 1, -1); /* as sd_notify would block: the manager reads its queue */
        }
        return 0;
}

int notify_nowait(const char *msg) {
        return send_msg(msg, false);
}

int notify_wait(const char *msg) {
        return send_msg(msg, true);
}

void notify_close(void) {
        if (notify_fd >= 0)
                close(notify_fd);
        notify_fd = -1;
}
