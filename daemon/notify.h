/* notify.h: the notifications kvcd sends its service manager while it serves (WATCHDOG=1,
 * STATUS=, STOPPING=1), sent without ever blocking the event loop.
 *
 * libsystemd's sd_notify blocks while the manager's queue is full (a datagram socket holds 10
 * messages by default), and a manager that stops reading (a hung one, or a test's stand-in) would
 * then freeze kvcd's one thread for good (a stop included). A watchdog ping or a status line that
 * does not fit is worth nothing later, and a manager that misses STOPPING=1 still sees the process
 * exit, so these are sent with MSG_DONTWAIT and dropped when they do not fit. READY=1 (before
 * anything is served) waits for room on the same socket (notify_wait), so that the socket is
 * there before READY=1 is read and kvcd opens no descriptor of its own afterwards; the fd
 * store's messages, which carry chunks that must arrive, still go through sd_notify.
 */
#pragma once

/* Sends msg to $NOTIFY_SOCKET (a path, or @abstract) without blocking: 0 when sent or when there
 * is no manager, -EAGAIN when its queue was full (the message is dropped), -errno otherwise. An
 * address of another family (vsock) goes through sd_notify. */
int notify_nowait(const char *msg);
/* The same, waiting for room in the manager's queue (READY=1). */
int notify_wait(const char *msg);
/* Closes the socket (at exit; harmless when none was opened). */
void notify_close(void);
