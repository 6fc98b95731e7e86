/* test_notify.c - unit tests of daemon/notify.c: kvcd's notifications to a service manager that
 * stops reading never block it (the stand-in systemd of the integration tests once froze kvcd
 * for good when its queue of 10 datagrams filled). */
#define _GNU_SOURCE
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>

#include "notify.h"

static void a_full_manager_queue_drops_messages_instead_of_blocking(void **state) {
        (void)state;
        char dir[] = "/tmp/kvc-notify-XXXXXX";
        assert_non_null(mkdtemp(dir));
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/notify", dir);
        int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        assert_true(fd >= 0);
        assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
        setenv("NOTIFY_SOCKET", sa.sun_path, 1);
        int sent = 0, dropped = 0;
        for (int i = 0; i < 1000; i++) { /* far past any queue: each call returns at once */
                int r = notify_nowait("STATUS=busy");
                assert_true(r == 0 || r == -EAGAIN);
                sent += r == 0;
                dropped += r == -EAGAIN;
        }
        assert_true(sent >= 1 && dropped >= 1);
        /* what was sent arrived whole */
        char buf[64];
        ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        assert_int_equal(n, (ssize_t)strlen("STATUS=busy"));
        assert_memory_equal(buf, "STATUS=busy", (size_t)n);
        /* read it all, and there is room again */
        while (recv(fd, buf, sizeof(buf), MSG_DONTWAIT) > 0)
                ;
        assert_int_equal(notify_nowait("WATCHDOG=1"), 0);
        notify_close();
        unsetenv("NOTIFY_SOCKET");
        assert_int_equal(notify_nowait("STATUS=nobody"), 0); /* no manager: nothing to do */
        close(fd);
        unlink(sa.sun_path);
        rmdir(dir);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(a_full_manager_queue_drops_messages_instead_of_blocking),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
