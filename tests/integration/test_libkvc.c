/* test_libkvc.c: libkvc as a library others link. A small program (tests/lib/kvc-hello.c) that
 * includes <kvc.h> alone is built twice and run against a real kvcd each time:
 *   - against the build tree ($KVC_BUILD/lib, -lkvc): the loader must find libkvc's soname there
 *     (libkvc.so.0, a link to libkvc.so.0.3.0), or the program does not start;
 *   - against `make install DESTDIR=...`, with the flags `pkg-config --cflags --libs kvc` gives for
 *     that copy (PKG_CONFIG_SYSROOT_DIR), and run with only that copy on the loader's path.
 * The layout of the names (file, soname link, link-time link) and the soname in the ELF header are
 * checked on both. The compiler is $CC, else cc; make is $MAKE, else make. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"

static char tmp[128];
static char build[PATH_MAX];

/* Runs a shell command line built from fmt; returns its stdout, asserting exit 0. */
static char *sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *sh(const char *fmt, ...) {
        char cmd[4096];
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(cmd, sizeof(cmd), fmt, ap);
        va_end(ap);
        assert_true(n > 0 && (size_t)n < sizeof(cmd));
        const char *argv[] = { "/bin/sh", "-c", cmd, NULL };
        char *out = NULL;
        int st = 0;
        assert_int_equal(harness_run(argv, &out, &st), 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
                fail_msg("`%s` failed (status %d): %s", cmd, st, out ? out : "");
        return out;
}

/* The compiler, with the sanitizers when this build has them (make check): a library built with
 * them links only into a program built with them. */
static const char *cc(void) {
        static char buf[256];
        const char *c = getenv("CC");
#if defined(__SANITIZE_ADDRESS__)
        snprintf(buf, sizeof(buf), "%s -fsanitize=address,undefined", c && *c ? c : "cc");
#else
        snprintf(buf, sizeof(buf), "%s", c && *c ? c : "cc");
#endif
        return buf;
}

/* The three names of libkvc in dir: the links point where they should, the soname is .so.0. */
static void assert_layout(const char *dir) {
        char *out = sh("readlink %s/libkvc.so && readlink %s/libkvc.so.0 && test -f %s/libkvc.so.0.3.0 && "
                       "LC_ALL=C readelf -d %s/libkvc.so.0.3.0 | sed -n 's/.*SONAME.*\\[\\(.*\\)\\]/\\1/p'",
                       dir, dir, dir, dir);
        assert_string_equal(out, "libkvc.so.0\nlibkvc.so.0.3.0\nlibkvc.so.0\n");
        free(out);
}

static int group_start(void **state) {
        const char *b = getenv("KVC_BUILD");
        if (!realpath(b && *b ? b : "build", build))
                return -1;
        snprintf(tmp, sizeof(tmp), "/tmp/kvc-libkvc-XXXXXX");
        if (!mkdtemp(tmp))
                return -1;
        char cmd[PATH_MAX + 256];
        snprintf(cmd, sizeof(cmd), "cp tests/lib/kvc-hello.c %s/", tmp);
        if (system(cmd) != 0)
                return -1;
        return harness_group_start(state, NULL);
}

static int group_stop(void **state) {
        char cmd[256];
        snprintf(cmd, sizeof(cmd), "rm -rf %s", tmp);
        if (system(cmd) != 0)
                return -1;
        return harness_group_stop(state);
}

static void a_program_built_against_the_build_tree_runs(void **state) {
        struct daemon *d = *state;
        char lib[PATH_MAX + 8];
        snprintf(lib, sizeof(lib), "%s/lib", build);
        assert_layout(lib);
        free(sh("%s -Wall -Werror -Iclient/lib tests/lib/kvc-hello.c -L%s -lkvc -o %s/hello-tree", cc(), lib,
                tmp));
        /* the loader looks for the soname, libkvc.so.0, on the path it is given */
        char *out = sh("LD_LIBRARY_PATH=%s %s/hello-tree %s", lib, tmp, d->dir);
        assert_non_null(strstr(out, "held "));
        assert_true(strtoll(out + strlen("held "), NULL, 10) > 0);
        free(out);
        out = sh("LD_LIBRARY_PATH=%s ldd %s/hello-tree | sed -n 's/.*libkvc.so.0 => \\([^ ]*\\).*/\\1/p'",
                 lib, tmp);
        char want[PATH_MAX + 64];
        snprintf(want, sizeof(want), "%s/libkvc.so.0\n", lib);
        assert_string_equal(out, want);
        free(out);
}

static void a_program_built_with_pkg_config_against_an_install_runs(void **state) {
        struct daemon *d = *state;
        const char *make = getenv("MAKE");
        free(sh("%s --no-print-directory -s BUILD=%s install DESTDIR=%s/root PREFIX=/usr/local >/dev/null",
                make && *make ? make : "make", build, tmp));
        char lib[sizeof(tmp) + 32];
        snprintf(lib, sizeof(lib), "%s/root/usr/local/lib", tmp);
        assert_layout(lib);
        /* the copy's kvc.pc first; libzmq's and libprotobuf-c's from the system */
        const char *pc = "PKG_CONFIG_SYSROOT_DIR=%s/root PKG_CONFIG_PATH=%s/pkgconfig";
        char env[sizeof(tmp) + sizeof(lib) + 64];
        snprintf(env, sizeof(env), pc, tmp, lib);
        char *version = sh("%s pkg-config --modversion kvc", env);
        assert_string_equal(version, "0.3.0\n");
        free(version);
        char *flags = sh("%s pkg-config --cflags --libs kvc", env);
        char want[sizeof(tmp) * 2 + 64];
        snprintf(want, sizeof(want), "-I%s/root/usr/local/include -L%s/root/usr/local/lib -lkvc \n", tmp,
                 tmp);
        assert_string_equal(flags, want);
        free(flags);
        /* a static link needs libkvc's own dependencies, which --static adds */
        char *stat = sh("%s pkg-config --static --libs kvc", env);
        assert_non_null(strstr(stat, "-lzmq"));
        assert_non_null(strstr(stat, "-lprotobuf-c"));
        free(stat);
        free(sh("cd %s && %s -Wall -Werror kvc-hello.c $(%s pkg-config --cflags --libs kvc) -o "
                "hello-installed",
                tmp, cc(), env));
        char *out = sh("LD_LIBRARY_PATH=%s %s/hello-installed %s", lib, tmp, d->dir);
        assert_non_null(strstr(out, "held "));
        free(out);
        /* and it is the installed copy it runs with, not the build tree's */
        out = sh(
                "LD_LIBRARY_PATH=%s ldd %s/hello-installed | sed -n 's/.*libkvc.so.0 => \\([^ ]*\\).*/\\1/p'",
                lib, tmp);
        char so[sizeof(lib) + 16];
        snprintf(so, sizeof(so), "%s/libkvc.so.0\n", lib);
        assert_string_equal(out, so);
        free(out);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(a_program_built_against_the_build_tree_runs),
                cmocka_unit_test(a_program_built_with_pkg_config_against_an_install_runs),
        };
        return cmocka_run_group_tests(tests, group_start, group_stop);
}
