/* fdguard.c: ZeroMQ's listeners never meet EMFILE (see fdguard.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "fdguard.h"

static atomic_bool armed;
static pthread_t owner; /* kvcd's thread: its own accept4 calls pass untouched */
static char admin[sizeof(((struct sockaddr_un *)0)->sun_path)];
static atomic_ulong refusals;

void fdguard_arm(const char *admin_path) {
        owner = pthread_self();
        strncpy(admin, admin_path ? admin_path : "", sizeof(admin) - 1);
        atomic_store(&armed, true);
}

bool fdguard_room(int fd, unsigned reserve) {
        struct rlimit rl;
        if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == RLIM_INFINITY)
                return true;
        return (rlim_t)fd + reserve < rl.rlim_cur;
}

unsigned long fdguard_refusals(void) {
        return atomic_load(&refusals);
}

static bool is_admin(int listen_fd) {
        struct sockaddr_un sa;
        socklen_t len = sizeof(sa);
        if (!admin[0] || getsockname(listen_fd, (struct sockaddr *)&sa, &len) < 0 || sa.sun_family != AF_UNIX ||
            len <= offsetof(struct sockaddr_un, sun_path))
                return false;
        return strncmp(sa.sun_path, admin, sizeof(sa.sun_path)) == 0;
}

static void pause_thread(void) {
        struct timespec ts = { .tv_nsec = FDGUARD_PAUSE_USEC * 1000l };
        while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
                ;
}

/* libzmq's (and libc's) accept4: the kernel's, guarded on ZeroMQ's threads. */
int accept4(int listen_fd, struct sockaddr *addr, socklen_t *addrlen, int flags) {
        int fd = (int)syscall(SYS_accept4, listen_fd, addr, addrlen, flags);
        if (!atomic_load(&armed) || pthread_equal(pthread_self(), owner))
                return fd;
        int e = errno;
        if (fd >= 0 && (fdguard_room(fd, KVCD_FD_RESERVE) ||
                        (fdguard_room(fd, KVCD_FD_RESERVE_ADMIN) && is_admin(listen_fd))))
                return fd;
        if (fd < 0 && e != EMFILE && e != ENFILE && e != ENOBUFS && e != ENOMEM) {
                errno = e;
                return fd;
        }
        if (fd >= 0)
                close(fd); /* the peer sees a reset; libzmq's peers connect again */
        atomic_fetch_add(&refusals, 1);
        pause_thread();
        errno = EAGAIN;
        return -1;
}

int accept(int listen_fd, struct sockaddr *addr, socklen_t *addrlen) {
        return accept4(listen_fd, addr, addrlen, 0);
}
