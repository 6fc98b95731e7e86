/* fdguard.h: kvcd's file descriptors against floods of connections (issue 28, item 2).
 *
 * libzmq 4.3.4 (Debian 12) asserts, and so aborts kvcd, when its ipc listener's accept4 fails
 * with EMFILE, and every ZeroMQ connection costs kvcd a descriptor before any byte is read. kvcd
 * cannot tell ZeroMQ to stop accepting, so fdguard.c stands between libzmq and the kernel: kvcd
 * defines accept4 itself (the executable's definition is the one libzmq's PLT binds), and on
 * ZeroMQ's I/O threads (every thread but kvcd's own, once armed):
 *   - a connection that would leave fewer than KVCD_FD_RESERVE descriptors free (or
 *     KVCD_FD_RESERVE_ADMIN on the admin socket, so operators get in after a client flood) is
 *     closed at once, and an accept4 that fails for want of descriptors or memory is reported as
 *     EAGAIN, which libzmq takes quietly: the listener never sees EMFILE;
 *   - either way the I/O thread then waits FDGUARD_PAUSE_USEC before it goes back to its poll, so
 *     a listener that stays readable is retried 100 times a second, not spun on.
 * kvcd's own side channel keeps the same reserve (client.c). "Fewer than N free" is read off the
 * accepted descriptor's number: the kernel hands out the lowest free one, so every one below it is
 * open. Rejected: a socket monitor that counts peers and unbinds a listener above a cap (it
 * reacts a loop round late, while the I/O thread accepts on; unbinding an ipc endpoint removes
 * its path, and a socket-activated one cannot be bound again). */
#pragma once

#include <stdbool.h>

#define KVCD_FD_RESERVE       64u
#define KVCD_FD_RESERVE_ADMIN 16u
#define FDGUARD_PAUSE_USEC    10000u

/* From now on accept4 on any other thread than the caller's is guarded; admin_path is the admin
 * socket's path (its connections keep the smaller reserve). */
void fdguard_arm(const char *admin_path);
/* Whether a descriptor numbered fd leaves at least reserve descriptors free under the current
 * RLIMIT_NOFILE. */
bool fdguard_room(int fd, unsigned reserve);
/* Connections refused or deferred on ZeroMQ's threads since the start (for the log). */
unsigned long fdguard_refusals(void);
