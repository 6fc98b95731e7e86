/* fdwire.c: send and receive one side-channel record with an optional SCM_RIGHTS fd. */
#define _GNU_SOURCE
#include "fdwire.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define FDWIRE_MAX_FDS 4

int fdwire_send(int sock, const struct fdwire_msg *m, int fd) {
        struct iovec iov = { .iov_base = (void *)m, .iov_len = sizeof(*m) };
        union {
                char buf[CMSG_SPACE(sizeof(int))];
                struct cmsghdr align;
        } ctl;
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };

        if (fd >= 0) {
                memset(&ctl, 0, sizeof(ctl));
                mh.msg_control = ctl.buf;
                mh.msg_controllen = sizeof(ctl.buf);
                struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
                c->cmsg_level = SOL_SOCKET;
                c->cmsg_type = SCM_RIGHTS;
                c->cmsg_len = CMSG_LEN(sizeof(int));
                memcpy(CMSG_DATA(c), &fd, sizeof(int));
        }
        ssize_t n = sendmsg(sock, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0)
                return -errno;
        return n == (ssize_t)sizeof(*m) ? 0 : -EIO;
}

int fdwire_recv(int sock, struct fdwire_msg *m, int *ret_fd, int timeout_ms) {
        struct pollfd pfd = { .fd = sock, .events = POLLIN };
        int pr;
        do
                pr = poll(&pfd, 1, timeout_ms);
        while (pr < 0 && errno == EINTR);
        if (pr < 0)
                return -errno;
        if (pr == 0)
                return -ETIMEDOUT;

        struct fdwire_msg tmp;
        struct iovec iov = { .iov_base = &tmp, .iov_len = sizeof(tmp) };
        union {
                char buf[CMSG_SPACE(sizeof(int) * FDWIRE_MAX_FDS)];
                struct cmsghdr align;
        } ctl;
        struct msghdr mh = {
                .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof(ctl.buf)
        };
        ssize_t n;
        do
                n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        while (n < 0 && errno == EINTR);
        if (n < 0)
                return errno == EAGAIN ? -ETIMEDOUT : -errno;
        if (n == 0)
                return -ENOTCONN;

        int fd = -1;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
                if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                        continue;
                size_t nfd = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                for (size_t i = 0; i < nfd; i++) {
                        int f;
                        memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                        if (fd < 0)
                                fd = f;
                        else
                                close(f);
                }
        }
        if (n != (ssize_t)sizeof(tmp) || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ||
            tmp.magic != FDWIRE_MAGIC || tmp.version != FDWIRE_VERSION) {
                if (fd >= 0)
                        close(fd);
                return -EPROTO;
        }
        *m = tmp;
        *ret_fd = fd;
        return 0;
}
