/* kvcctl: watch and steer kvcd from a terminal, over its admin socket.
 *
 * The command line is read against two tables. The flag table has one row per flag (its name,
 * whether it takes a value, its help); the verb table has one row per verb ("budget get" and
 * "budget set" are rows of their own) with the flags it takes and how many words it takes after
 * its name. Flags may come anywhere, before or after the verb; the words that are not flags
 * name the verb and its arguments. Anything a row does not allow (an unknown flag, a flag of
 * another verb, a word too many or too few) is refused with exit 2 and one line that says what
 * was wrong. A verb flag may share its name with a global flag (drain --timeout S, the drain's
 * wait, against --timeout MS, kvcctl's wait for an answer): after the verb the verb's meaning
 * wins, before it the global one.
 *
 * Finding kvcd: --socket, else $KVC_SOCKET, names it (the socket or its runtime directory);
 * otherwise kvcctl looks in the per-user directory ($XDG_RUNTIME_DIR/kvcd, else /tmp/kvcd-UID)
 * and then in /run/kvcd (the shipped units), and takes the first that holds the socket. Before
 * ZeroMQ connects (which would retry silently forever), one plain connect() tells whether anyone
 * listens there: no socket or a stale one is "nothing listening" at once (exit 3), EACCES is a
 * permission denial (exit 4); the --timeout wait is left for a kvcd that does not answer.
 *
 * Errors are one line on stderr, or with --json one {"error":{...}} object on stdout, with the
 * same exit codes (the EXIT_ enum; README and kvcctl(1) have the table).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvc.h"
#include "wire.h"

enum {
        EXIT_REFUSED = 1,     /* kvcd refused the request, answered nonsense, or audit found a mismatch */
        EXIT_USAGE = 2,       /* the command line is wrong */
        EXIT_UNREACHABLE = 3, /* nothing listens at the socket, or no answer within --timeout */
        EXIT_DENIED = 4,      /* permission denied on the socket */
        EXIT_TIMEDOUT = 5,    /* what was waited for did not happen in time (drain, events --count) */
};

enum flag_id {
        F_SOCKET,
        F_JSON,
        F_TIMEOUT,
        F_HELP,
        F_VERSION,
        F_INTERVAL,
        F_ITERATIONS,
        F_SORT,
        F_IDLE,
        F_CAPACITY,
        F_TENANT,
        F_QUOTA,
        F_UID,
        F_GID,
        F_SESSION,
        F_MIN,
        F_MAX,
        F_PRIORITY,
        F_WAIT, /* drain --timeout S */
        F_RESUME,
        F_COUNT,
        F_N_FLAGS,
};

#define BIT(f)       (1u << (f))
#define GLOBAL_FLAGS (BIT(F_SOCKET) | BIT(F_JSON) | BIT(F_TIMEOUT) | BIT(F_HELP) | BIT(F_VERSION))

static const struct flag {
        const char *name;
        char short_name;
        const char *arg; /* NULL: takes no value */
        const char *help;
} flags[F_N_FLAGS] = {
        [F_SOCKET] = { "socket", 0, "PATH", "kvcd's admin socket or its runtime directory" },
        [F_JSON] = { "json", 0, NULL, "machine-readable output (errors too)" },
        [F_TIMEOUT] = { "timeout", 0, "MS", "answer wait (default 5000); events: how long to follow" },
        [F_HELP] = { "help", 'h', NULL, "this text" },
        [F_VERSION] = { "version", 'V', NULL, "the version" },
        [F_INTERVAL] = { "interval", 0, "S", "top: seconds between frames (default 1)" },
        [F_ITERATIONS] = { "iterations", 'n', "N", "top: stop after N frames" },
        [F_SORT] = { "sort", 0, "KEY", "top: bytes (default), rate, confidence or age" },
        [F_IDLE] = { "idle", 0, "S", "top: mark sessions with no step for S s (default 10)" },
        [F_CAPACITY] = { "capacity", 0, "BYTES", NULL },
        [F_TENANT] = { "tenant", 0, "NAME", NULL },
        [F_QUOTA] = { "quota", 0, "BYTES", NULL },
        [F_UID] = { "uid", 0, "N", NULL },
        [F_GID] = { "gid", 0, "N", NULL },
        [F_SESSION] = { "session", 0, "ID", NULL },
        [F_MIN] = { "min", 0, "BYTES", NULL },
        [F_MAX] = { "max", 0, "BYTES", NULL },
        [F_PRIORITY] = { "priority", 0, "N", NULL },
        [F_WAIT] = { "timeout", 0, "S", NULL },
        [F_RESUME] = { "resume", 0, NULL, NULL },
        [F_COUNT] = { "count", 0, "N", NULL },
};

struct ctl {
        const char *socket;
        bool json;
        int timeout_ms;
        bool timeout_given;
        const char *val[F_N_FLAGS]; /* the verb's flags as given ("" for one without a value) */
        char dir[256];
        char path[300];
        void *zctx, *zsock;
        struct wire_arena *arena, *arena2; /* the answers of the last two requests (top needs both) */
        uint64_t next_id;
        int argc; /* the verb's own arguments */
        char **argv;
};

static int verb_status(struct ctl *c);
static int verb_sessions(struct ctl *c);
static int verb_top(struct ctl *c);
static int verb_budget_get(struct ctl *c);
static int verb_budget_set(struct ctl *c);
static int verb_evict(struct ctl *c);
static int verb_drain(struct ctl *c);
static int verb_audit(struct ctl *c);
static int verb_metrics(struct ctl *c);
static int verb_events(struct ctl *c);

static const struct verb {
        const char *name; /* one word, or two ("budget set") */
        int (*run)(struct ctl *c);
        unsigned flags; /* BIT(F_...) of the flags it takes besides the global ones */
        int min_args, max_args;
        const char *synopsis; /* after the name, for --help */
        const char *help;
} verbs[] = {
        { "status", verb_status, 0, 0, 0, "", "the daemon: pool, tenants, kvcd's memory, counters" },
        { "sessions", verb_sessions, 0, 0, 0, "", "one row per session" },
        { "top", verb_top, BIT(F_INTERVAL) | BIT(F_ITERATIONS) | BIT(F_SORT) | BIT(F_IDLE), 0, 0,
          " [--interval S] [-n|--iterations N] [--sort KEY] [--idle S]",
          "live view with rates; q quits, s/b/r/c/a sort" },
        { "budget get", verb_budget_get, 0, 0, 0, "", "the capacity and the tenants' quotas" },
        { "budget set", verb_budget_set,
          BIT(F_CAPACITY) | BIT(F_TENANT) | BIT(F_QUOTA) | BIT(F_UID) | BIT(F_GID) | BIT(F_SESSION) |
                  BIT(F_MIN) | BIT(F_MAX) | BIT(F_PRIORITY),
          0, 0,
          " [--capacity BYTES] [--tenant NAME [--quota BYTES]\n"
          "             [--uid N | --gid N]] [--session ID [--min BYTES]\n"
          "             [--max BYTES] [--priority N]]",
          "change limits" },
        { "evict", verb_evict, 0, 1, 1, " SESSION", "close a session; its client is told" },
        { "drain", verb_drain, BIT(F_WAIT) | BIT(F_RESUME), 0, 0, " [--timeout S] [--resume]",
          "refuse new sessions, wait for the open ones" },
        { "audit", verb_audit, 0, 0, 0, "", "recompute the accounting (exit 1 on a mismatch)" },
        { "metrics", verb_metrics, 0, 0, 0, "", "Prometheus text" },
        { "events", verb_events, BIT(F_COUNT), 0, 0, " [--count N]", "follow KV events until interrupted" },
};

#define N_VERBS (sizeof(verbs) / sizeof(verbs[0]))

static void usage(FILE *f) {
        fprintf(f, "Usage: kvcctl [--socket PATH] [--json] [--timeout MS] VERB [ARGS]\n"
                   "Watches and steers kvcd. Flags may come before or after the verb.\n\nVerbs:\n");
        for (size_t i = 0; i < N_VERBS; i++) {
                char head[256];
                snprintf(head, sizeof(head), "%s%s", verbs[i].name, verbs[i].synopsis);
                if (strlen(head) <= 24 && !strchr(head, '\n'))
                        fprintf(f, "  %-24s  %s\n", head, verbs[i].help);
                else
                        fprintf(f, "  %s\n  %-24s  %s\n", head, "", verbs[i].help);
        }
        fprintf(f, "\n");
        for (int i = 0; i < F_N_FLAGS; i++) {
                if (!flags[i].help)
                        continue;
                char head[64];
                if (flags[i].short_name)
                        snprintf(head, sizeof(head), "-%c, --%s%s%s", flags[i].short_name, flags[i].name,
                                 flags[i].arg ? " " : "", flags[i].arg ? flags[i].arg : "");
                else
                        snprintf(head, sizeof(head), "    --%s%s%s", flags[i].name, flags[i].arg ? " " : "",
                                 flags[i].arg ? flags[i].arg : "");
                fprintf(f, "  %-20s %s\n", head, flags[i].help);
        }
        fprintf(f, "\nWithout --socket or $KVC_SOCKET: $XDG_RUNTIME_DIR/kvcd (else /tmp/kvcd-UID),\n"
                   "then /run/kvcd.\n"
                   "Exit codes: 0 done, 1 kvcd refused (or audit found a mismatch), 2 bad usage,\n"
                   "3 kvcd unreachable (nothing listening, or no answer), 4 permission denied on\n"
                   "the socket, 5 timed out (drain with sessions left, events --count short).\n");
}

/* Prints a string as a JSON string literal. */
static void json_string(const char *s) {
        putchar('"');
        for (; s && *s; s++) {
                unsigned char ch = (unsigned char)*s;
                if (ch == '"' || ch == '\\')
                        printf("\\%c", ch);
                else if (ch == '\n')
                        fputs("\\n", stdout);
                else if (ch < 0x20)
                        printf("\\u%04x", ch);
                else
                        putchar(ch);
        }
        putchar('"');
}

static const char *errno_name(int code) {
        const char *n = wire_errno_name(code);
        if (strcmp(n, "E?") == 0 && code > 0 && strerrorname_np(code))
                n = strerrorname_np(code);
        return n;
}

/* Reports an error: one line on stderr, or with --json an error object on stdout. Returns
 * exit_code. code is the errno that says what went wrong (EINVAL for bad usage). */
__attribute__((format(printf, 4, 5))) static int fail(const struct ctl *c, int exit_code, int code,
                                                      const char *fmt, ...) {
        char msg[1024];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
        if (c->json) {
                printf("{\"error\":{\"code\":%d,\"name\":", code);
                json_string(errno_name(code));
                printf(",\"message\":");
                json_string(msg);
                printf("}}\n");
                fflush(stdout);
        } else {
                fprintf(stderr, "kvcctl: %s\n", msg);
        }
        return exit_code;
}

#define USAGE(c, ...) fail((c), EXIT_USAGE, EINVAL, __VA_ARGS__)

/* A whole decimal number in [lo, hi]; -EINVAL otherwise. */
static int parse_ll(const char *s, long long lo, long long hi, long long *ret) {
        char *end;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (errno || end == s || *end || v < lo || v > hi)
                return -EINVAL;
        *ret = v;
        return 0;
}

/* A number of seconds in (0, hi] (zero too when zero_ok). */
static int parse_seconds(const char *s, bool zero_ok, double hi, double *ret) {
        char *end;
        errno = 0;
        double v = strtod(s, &end);
        if (errno || end == s || *end || !(v >= 0) || v > hi || (!zero_ok && v == 0))
                return -EINVAL;
        *ret = v;
        return 0;
}

/* --- finding kvcd ------------------------------------------------------------------------- */

static bool is_socket(const char *path) {
        struct stat st;
        return stat(path, &st) == 0 && S_ISSOCK(st.st_mode);
}

/* c->dir and c->path (dir/name) from a --socket or $KVC_SOCKET hint: a path that names an existing
 * socket or ends in ".sock" is the socket (its directory holds the others), any other is the
 * directory. */
static int path_from_hint(struct ctl *c, const char *hint, const char *name) {
        size_t n = strlen(hint);
        if (is_socket(hint) || (n > 5 && strcmp(hint + n - 5, ".sock") == 0)) {
                const char *slash = strrchr(hint, '/');
                if ((size_t)snprintf(c->dir, sizeof(c->dir), "%.*s", slash ? (int)(slash - hint) : 1,
                                     slash ? hint : ".") >= sizeof(c->dir))
                        return -ENAMETOOLONG;
                /* the events verb wants the directory's events socket, the others the named one */
                if (strcmp(name, "kvcd.admin.sock") == 0)
                        return (size_t)snprintf(c->path, sizeof(c->path), "%s", hint) >= sizeof(c->path)
                                       ? -ENAMETOOLONG
                                       : 0;
        } else if ((size_t)snprintf(c->dir, sizeof(c->dir), "%s", hint) >= sizeof(c->dir)) {
                return -ENAMETOOLONG;
        }
        return (size_t)snprintf(c->path, sizeof(c->path), "%s/%s", c->dir, name) >= sizeof(c->path)
                       ? -ENAMETOOLONG
                       : 0;
}

/* Where the socket `name` (kvcd.admin.sock or kvcd.events.sock) is: from --socket or $KVC_SOCKET
 * when given; else the first of the per-user directory and /run/kvcd that holds it (the per-user
 * one when neither does, so the error names it; *ret_others then names the other). */
static int find_socket(struct ctl *c, const char *name, char *others, size_t others_len) {
        const char *env = getenv("KVC_SOCKET");
        others[0] = '\0';
        if (c->socket)
                return path_from_hint(c, c->socket, name);
        if (env && *env)
                return path_from_hint(c, env, name);
        char user[256];
        const char *xdg = getenv("XDG_RUNTIME_DIR");
        if (xdg && *xdg)
                snprintf(user, sizeof(user), "%s/kvcd", xdg);
        else
                snprintf(user, sizeof(user), "/tmp/kvcd-%u", (unsigned)getuid());
        const char *dirs[] = { user, "/run/kvcd" };
        for (size_t i = 0; i < 2; i++) {
                struct stat st;
                int r = path_from_hint(c, dirs[i], name);
                /* a directory this user may not enter holds kvcd as far as anyone can tell: the
                 * probe then says permission denied, not "nothing here" */
                if (r == 0 && (stat(c->path, &st) == 0 ? S_ISSOCK(st.st_mode) : errno == EACCES))
                        return 0;
        }
        snprintf(others, others_len, " (nor in /run/kvcd)");
        return path_from_hint(c, user, name);
}

/* Tells whether anyone listens at c->path: 0, or an exit code after saying why not. */
static int probe(const struct ctl *c, const char *others) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        if (strlen(c->path) >= sizeof(sa.sun_path))
                return USAGE(c, "socket path too long: %s", c->path);
        memcpy(sa.sun_path, c->path, strlen(c->path) + 1);
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
                return fail(c, EXIT_UNREACHABLE, errno, "socket: %s", strerror(errno));
        int r = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 ? 0 : errno;
        close(fd);
        char why[512];
        switch (r) {
        case 0:
                /* who listens there, and who owns the socket and its directory: the check libkvc
                 * makes of kvcd.sock (a squatted /tmp/kvcd-UID must not get an operator's
                 * commands; $KVC_DAEMON_UID pins the user) */
                r = kvc_check_daemon_socket(c->path, NULL, why, sizeof(why));
                if (r == -EPERM)
                        return fail(c, EXIT_DENIED, EPERM, "refusing %s: %s", c->path, why);
                if (r < 0)
                        return fail(c, EXIT_UNREACHABLE, -r, "%s", why);
                return 0;
        case ENOENT:
        case ENOTDIR:
                return fail(c, EXIT_UNREACHABLE, r, "nothing is listening at %s: no such socket%s", c->path,
                            others);
        case ECONNREFUSED:
                return fail(c, EXIT_UNREACHABLE, r,
                            "nothing is listening at %s: the socket is left from a kvcd that is gone",
                            c->path);
        case EACCES:
        case EPERM:
                return fail(c, EXIT_DENIED, EACCES,
                            "permission denied on %s (run kvcctl as kvcd's user or a member of the "
                            "socket's group)",
                            c->path);
        default: return fail(c, EXIT_UNREACHABLE, r, "cannot connect to %s: %s", c->path, strerror(r));
        }
}

/* --- requests ----------------------------------------------------------------------------- */

static int connect_admin(struct ctl *c) {
        char ep[320], others[64];
        int zero = 0, r;
        if ((r = find_socket(c, "kvcd.admin.sock", others, sizeof(others))) < 0)
                return USAGE(c, "socket path too long");
        if ((r = probe(c, others)))
                return r;
        snprintf(ep, sizeof(ep), "ipc://%s", c->path);
        c->zctx = zmq_ctx_new();
        c->zsock = c->zctx ? zmq_socket(c->zctx, ZMQ_DEALER) : NULL;
        if (!c->zsock || zmq_setsockopt(c->zsock, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
            zmq_connect(c->zsock, ep) < 0 || wire_arena_new(WIRE_REPLY_MAX_BYTES * 2, &c->arena) < 0 ||
            wire_arena_new(WIRE_REPLY_MAX_BYTES * 2, &c->arena2) < 0)
                return fail(c, EXIT_UNREACHABLE, zmq_errno(), "cannot connect to %s: %s", c->path,
                            zmq_strerror(zmq_errno()));
        return 0;
}

/* Sends one admin request and waits (wait_ms) for its answer, decoded into arena; returns an
 * exit code. The answer is valid until the next request that uses the same arena. */
static int request_in(struct ctl *c, struct wire_arena **arena, Kvc__Envelope *req,
                      Kvc__Envelope__BodyCase want, Kvc__Envelope **ret, int wait_ms) {
        char why[WIRE_MAX_MESSAGE];
        int r;
        if (!c->zsock && (r = connect_admin(c)))
                return r;
        req->version = WIRE_VERSION;
        req->request_id = ++c->next_id;
        size_t n = wire_packed_size(req);
        uint8_t *buf = malloc(n ? n : 1);
        if (!buf)
                return fail(c, EXIT_REFUSED, ENOMEM, "out of memory");
        wire_pack(req, buf);
        r = zmq_send(c->zsock, buf, n, ZMQ_DONTWAIT);
        free(buf);
        for (;;) {
                zmq_pollitem_t item = { .socket = c->zsock, .events = ZMQ_POLLIN };
                if (r < 0 || zmq_poll(&item, 1, wait_ms) <= 0)
                        return fail(c, EXIT_UNREACHABLE, ETIMEDOUT, "no answer from kvcd at %s within %d ms",
                                    c->path, wait_ms);
                zmq_msg_t msg;
                zmq_msg_init(&msg);
                if (zmq_msg_recv(&msg, c->zsock, 0) < 0) {
                        zmq_msg_close(&msg);
                        return fail(c, EXIT_UNREACHABLE, zmq_errno(), "receiving from %s: %s", c->path,
                                    zmq_strerror(zmq_errno()));
                }
                Kvc__Envelope *env;
                r = wire_decode(*arena, zmq_msg_data(&msg), zmq_msg_size(&msg), WIRE_REPLY_MAX_BYTES, &env,
                                why, sizeof(why));
                zmq_msg_close(&msg);
                if (r < 0)
                        return fail(c, EXIT_REFUSED, EPROTO, "bad answer from kvcd: %s", why);
                if (env->request_id != req->request_id)
                        continue; /* a late answer to an earlier request */
                if (env->body_case == KVC__ENVELOPE__BODY_ERROR)
                        return fail(c, EXIT_REFUSED, env->error->code, "kvcd refused: %s (%s)",
                                    env->error->message, errno_name(env->error->code));
                if (env->body_case != want)
                        return fail(c, EXIT_REFUSED, EPROTO, "kvcd answered %s",
                                    wire_body_name(env->body_case));
                *ret = env;
                return 0;
        }
}

static int request(struct ctl *c, Kvc__Envelope *req, Kvc__Envelope__BodyCase want, Kvc__Envelope **ret) {
        return request_in(c, &c->arena, req, want, ret, c->timeout_ms);
}

/* "12.3 MiB" */
static const char *human_bytes(uint64_t b, char *buf, size_t len) {
        static const char *const units[] = { "B", "KiB", "MiB", "GiB", "TiB" };
        double v = (double)b;
        int u = 0;
        while (v >= 1024 && u < 4) {
                v /= 1024;
                u++;
        }
        snprintf(buf, len, u ? "%.1f %s" : "%.0f %s", v, units[u]);
        return buf;
}

/* "12.3M": at most 6 characters, for top's columns */
static const char *short_bytes(uint64_t b, char *buf, size_t len) {
        static const char units[] = "BKMGTP";
        double v = (double)b;
        int u = 0;
        while (v >= 1000 && u < 5) {
                v /= 1024;
                u++;
        }
        snprintf(buf, len,
                 u == 0    ? "%.0f%c"
                 : v < 10  ? "%.2f%c"
                 : v < 100 ? "%.1f%c"
                           : "%.0f%c",
                 v, units[u]);
        return buf;
}

/* "45s", "12m", "3h05", "2d04": at most 5 characters */
static const char *short_age(uint64_t usec, char *buf, size_t len) {
        uint64_t s = usec / 1000000u;
        if (s < 100)
                snprintf(buf, len, "%llus", (unsigned long long)s);
        else if (s < 3600)
                snprintf(buf, len, "%llum", (unsigned long long)(s / 60));
        else if (s < 86400)
                snprintf(buf, len, "%lluh%02llu", (unsigned long long)(s / 3600),
                         (unsigned long long)(s % 3600 / 60));
        else
                snprintf(buf, len, "%llud%02llu", (unsigned long long)(s / 86400),
                         (unsigned long long)(s % 86400 / 3600));
        return buf;
}

/* --- status ------------------------------------------------------------------------------- */

static int get_status(struct ctl *c, Kvc__Envelope **env) {
        Kvc__StatusRequest sr = KVC__STATUS_REQUEST__INIT;
        Kvc__Envelope req = KVC__ENVELOPE__INIT;
        req.body_case = KVC__ENVELOPE__BODY_STATUS_REQUEST;
        req.status_request = &sr;
        return request_in(c, &c->arena, &req, KVC__ENVELOPE__BODY_STATUS, env, c->timeout_ms);
}

static double percent(uint64_t part, uint64_t whole) {
        return whole ? 100.0 * (double)part / (double)whole : 0.0;
}

/* A list of bytes by tier, "f16 1.2 MiB, q4 300.0 KiB", into buf ("-" when empty). */
static const char *tier_list(Kvc__TierBytes *const *v, size_t n, char *buf, size_t len) {
        size_t at = 0;
        buf[0] = '\0';
        for (size_t i = 0; i < n && at + 1 < len; i++) {
                char b[32];
                at += (size_t)snprintf(buf + at, len - at, "%s%s %s", i ? ", " : "", v[i]->tier,
                                       human_bytes(v[i]->bytes, b, sizeof(b)));
        }
        return n ? buf : "-";
}

/* The tiers' names alone, "f16,q4" ("-" when empty). */
static const char *tier_names(Kvc__TierBytes *const *v, size_t n, char *buf, size_t len) {
        size_t at = 0;
        buf[0] = '\0';
        for (size_t i = 0; i < n && at + 1 < len; i++)
                at += (size_t)snprintf(buf + at, len - at, "%s%s", i ? "," : "", v[i]->tier);
        return n ? buf : "-";
}

static void json_tier_bytes(Kvc__TierBytes *const *v, size_t n) {
        printf(",\"tier_bytes\":{");
        for (size_t i = 0; i < n; i++)
                printf("%s\"%s\":%llu", i ? "," : "", v[i]->tier, (unsigned long long)v[i]->bytes);
        printf("}");
}

/* The status as one JSON object (no newline). */
static void json_status(const Kvc__Status *s) {
        printf("{\"version\":\"%s\",\"backend\":\"%s\",\"uptime_usec\":%llu,\"capacity_bytes\":%llu,"
               "\"used_bytes\":%llu,\"int8_bytes\":%llu,\"chunk_bytes\":%llu,\"chunks_total\":%u,"
               "\"chunks_in_use\":%u,\"clients\":%u,\"sessions\":%u,\"steps_total\":%llu,\"plans_total\":%"
               "llu,"
               "\"client_deaths\":%llu,\"errors_total\":%llu,\"draining\":%s,\"shared_bytes\":%llu,"
               "\"shared_blocks\":%u,\"chunks_reclaiming\":%u,\"chunks_held\":%u,\"step_batches_total\":%llu,"
               "\"rss_bytes\":%llu,\"rss_anon_bytes\":%llu,\"tenants\":[",
               s->version, s->backend, (unsigned long long)s->uptime_usec,
               (unsigned long long)s->capacity_bytes, (unsigned long long)s->used_bytes,
               (unsigned long long)s->int8_bytes, (unsigned long long)s->chunk_bytes, s->chunks_total,
               s->chunks_in_use, s->clients, s->sessions, (unsigned long long)s->steps_total,
               (unsigned long long)s->plans_total, (unsigned long long)s->client_deaths,
               (unsigned long long)s->errors_total, s->draining ? "true" : "false",
               (unsigned long long)s->shared_bytes, s->shared_blocks, s->chunks_reclaiming, s->chunks_held,
               (unsigned long long)s->step_batches_total, (unsigned long long)s->rss_bytes,
               (unsigned long long)s->rss_anon_bytes);
        for (size_t i = 0; i < s->n_tenants; i++) {
                const Kvc__TenantBudget *t = s->tenants[i];
                printf("%s{\"name\":", i ? "," : "");
                json_string(t->name);
                printf(",\"used_bytes\":%llu,\"quota_bytes\":%llu,\"reserved_bytes\":%llu,\"sessions\":%u,"
                       "\"declared\":%s}",
                       (unsigned long long)t->used_bytes, (unsigned long long)t->quota_bytes,
                       (unsigned long long)t->reserved_bytes, t->sessions, t->declared ? "true" : "false");
        }
        printf("]");
        json_tier_bytes(s->tier_bytes, s->n_tier_bytes);
        printf("}");
}

static void print_tenants(const Kvc__Status *s) {
        char a[32], b[32], g[32];
        if (!s->n_tenants)
                return;
        printf("\n%-16s %11s %11s %6s %11s %8s\n", "TENANT", "USED", "QUOTA", "USE%", "GUARANTEED",
               "SESSIONS");
        for (size_t i = 0; i < s->n_tenants; i++) {
                const Kvc__TenantBudget *t = s->tenants[i];
                printf("%-16.16s %11s %11s %5.1f%% %11s %8u%s\n", t->name,
                       human_bytes(t->used_bytes, a, sizeof(a)), human_bytes(t->quota_bytes, b, sizeof(b)),
                       percent(t->used_bytes, t->quota_bytes), human_bytes(t->reserved_bytes, g, sizeof(g)),
                       t->sessions, t->used_bytes > t->quota_bytes ? "  OVER" : "");
        }
}

static void print_status(const struct ctl *c, const Kvc__Status *s) {
        if (c->json) {
                json_status(s);
                printf("\n");
                return;
        }
        char a[32], b[32], q[32];
        printf("kvcd %s  backend %s  up %.1f s%s\n", s->version, s->backend, (double)s->uptime_usec / 1e6,
               s->draining ? "  DRAINING (new sessions refused)" : "");
        printf("pool      %s of %s in use (%.1f%%; INT8 %s), %u of %u chunks owned\n",
               human_bytes(s->used_bytes, a, sizeof(a)), human_bytes(s->capacity_bytes, b, sizeof(b)),
               percent(s->used_bytes, s->capacity_bytes), human_bytes(s->int8_bytes, q, sizeof(q)),
               s->chunks_in_use, s->chunks_total);
        if (s->chunks_reclaiming || s->chunks_held)
                printf("          of those, %u being taken back, %u held until a dead client's process "
                       "exits\n",
                       s->chunks_reclaiming, s->chunks_held);
        printf("memory    kvcd resident %s (own heap %s)\n", human_bytes(s->rss_bytes, a, sizeof(a)),
               human_bytes(s->rss_anon_bytes, b, sizeof(b)));
        char tl[256];
        printf("tiers     %s\n", tier_list(s->tier_bytes, s->n_tier_bytes, tl, sizeof(tl)));
        printf("clients   %u\nsessions  %u\n", s->clients, s->sessions);
        if (s->shared_blocks)
                printf("shared    %u prompt blocks, %s (counted once)\n", s->shared_blocks,
                       human_bytes(s->shared_bytes, q, sizeof(q)));
        printf("steps     %llu (%llu summaries)   plans %llu   client deaths %llu   errors %llu\n",
               (unsigned long long)s->step_batches_total, (unsigned long long)s->steps_total,
               (unsigned long long)s->plans_total, (unsigned long long)s->client_deaths,
               (unsigned long long)s->errors_total);
        print_tenants(s);
}

static int verb_status(struct ctl *c) {
        Kvc__Envelope *env;
        int r = get_status(c, &env);
        if (r == 0)
                print_status(c, env->status);
        return r;
}

/* --- sessions ----------------------------------------------------------------------------- */

static int get_sessions(struct ctl *c, Kvc__Envelope **env) {
        Kvc__ListSessions ls = KVC__LIST_SESSIONS__INIT;
        Kvc__Envelope req = KVC__ENVELOPE__INIT;
        req.body_case = KVC__ENVELOPE__BODY_LIST_SESSIONS;
        req.list_sessions = &ls;
        return request_in(c, &c->arena2, &req, KVC__ENVELOPE__BODY_SESSION_LIST, env, c->timeout_ms);
}

/* One session as a JSON object, without its closing brace (top adds its own keys). */
static void json_session(const Kvc__SessionInfo *s) {
        printf("{\"id\":%llu,\"pid\":%u,\"uid\":%u,\"client\":", (unsigned long long)s->session_id, s->pid,
               s->uid);
        json_string(s->client_name);
        printf(",\"tenant\":");
        json_string(s->tenant);
        printf(",\"policy\":\"%s\",\"budget\":%u,\"tokens\":%u,\"peak_tokens\":%u,"
               "\"blocks\":%u,\"bytes\":%llu,\"int8_bytes\":%llu,\"confidence\":%.4f,\"steps\":%llu,"
               "\"plans\":%llu,\"age_usec\":%llu,\"layers\":%u,\"min_bytes\":%llu,\"max_bytes\":%llu,"
               "\"cap_bytes\":%llu,\"priority\":%d,\"idle_usec\":%llu",
               s->policy, s->budget_tokens, s->tokens, s->peak_tokens, s->blocks,
               (unsigned long long)s->bytes, (unsigned long long)s->int8_bytes, (double)s->confidence,
               (unsigned long long)s->steps, (unsigned long long)s->plans, (unsigned long long)s->age_usec,
               s->n_layers, (unsigned long long)s->min_bytes, (unsigned long long)s->max_bytes,
               (unsigned long long)s->cap_bytes, s->priority, (unsigned long long)s->idle_usec);
        printf(",\"bits_per_value\":%.3f", (double)s->bits_per_value);
        json_tier_bytes(s->tier_bytes, s->n_tier_bytes);
}

static void print_sessions(const struct ctl *c, const Kvc__SessionList *l) {
        if (c->json) {
                printf("[");
                for (size_t i = 0; i < l->n_sessions; i++) {
                        printf("%s", i ? "," : "");
                        json_session(l->sessions[i]);
                        printf("}");
                }
                printf("]\n");
                return;
        }
        printf("%6s %8s %6s %-10s %-8s %6s %6s %5s %10s %10s %5s %-12s %8s %6s %8s\n", "ID", "PID", "UID",
               "TENANT", "POLICY", "BUDGET", "TOKENS", "CONF", "FP BYTES", "INT8 BYTES", "BITS", "TIERS", "STEPS",
               "PLANS", "AGE");
        for (size_t i = 0; i < l->n_sessions; i++) {
                const Kvc__SessionInfo *s = l->sessions[i];
                char b[32], q[32], t[64];
                printf("%6llu %8u %6u %-10.10s %-8.8s %6u %6u %5.2f %10s %10s %5.1f %-12.12s %8llu %6llu %7.1fs\n",
                       (unsigned long long)s->session_id, s->pid, s->uid, s->tenant, s->policy,
                       s->budget_tokens, s->tokens, (double)s->confidence,
                       human_bytes(s->bytes - s->int8_bytes, b, sizeof(b)),
                       human_bytes(s->int8_bytes, q, sizeof(q)), (double)s->bits_per_value,
                       tier_names(s->tier_bytes, s->n_tier_bytes, t, sizeof(t)), (unsigned long long)s->steps,
                       (unsigned long long)s->plans, (double)s->age_usec / 1e6);
        }
        if (l->n_sessions == 0)
                printf("(no sessions)\n");
}

static int verb_sessions(struct ctl *c) {
        Kvc__Envelope *env;
        int r = get_sessions(c, &env);
        if (r == 0)
                print_sessions(c, env->session_list);
        return r;
}

/* --- top ---------------------------------------------------------------------------------- */

enum sort_key { SORT_BYTES, SORT_RATE, SORT_CONFIDENCE, SORT_AGE, SORT_N };
static const char *const sort_names[SORT_N] = { "bytes", "rate", "confidence", "age" };

/* What top remembers between frames, to turn totals into rates. */
struct top_state {
        bool have_prev;
        uint64_t prev_usec; /* CLOCK_MONOTONIC of the previous frame */
        uint64_t prev_batches, prev_steps, prev_plans;
        uint64_t *prev_ids, *prev_session_steps; /* sorted by id, as kvcd lists them */
        size_t n_prev;
        enum sort_key sort;
        uint64_t idle_usec;
};

struct top_row {
        const Kvc__SessionInfo *s;
        double rate; /* steps/s */
        bool over, idle;
};

static uint64_t mono_usec(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static int row_order(const void *a, const void *b, void *arg) {
        const struct top_row *x = a, *y = b;
        double kx, ky;
        switch (*(const enum sort_key *)arg) {
        case SORT_RATE: kx = x->rate, ky = y->rate; break;
        case SORT_CONFIDENCE: kx = x->s->confidence, ky = y->s->confidence; break;
        case SORT_AGE: kx = (double)x->s->age_usec, ky = (double)y->s->age_usec; break;
        default: kx = (double)x->s->bytes, ky = (double)y->s->bytes; break;
        }
        if (kx != ky)
                return kx > ky ? -1 : 1; /* largest first */
        return x->s->session_id < y->s->session_id ? -1 : x->s->session_id > y->s->session_id;
}

/* The rate of a counter: over the last interval, or over its lifetime (life_usec) on the first
 * frame. */
static double rate(uint64_t now, uint64_t prev, bool have_prev, double dt_s, uint64_t life_usec) {
        if (have_prev)
                return dt_s > 0 && now >= prev ? (double)(now - prev) / dt_s : 0.0;
        return life_usec ? (double)now / ((double)life_usec / 1e6) : 0.0;
}

struct client_sum {
        uint32_t pid;
        const char *name;
        uint32_t sessions;
        uint64_t bytes;
        double rate;
};

/* Draws one frame (or prints one JSON document) from a status and a session list. */
static int top_frame(const struct ctl *c, struct top_state *t, const Kvc__Status *st,
                     const Kvc__SessionList *l, uint64_t frame, int rows) {
        uint64_t now = mono_usec();
        double dt = t->have_prev ? (double)(now - t->prev_usec) / 1e6 : 0.0;
        double r_batches = rate(st->step_batches_total, t->prev_batches, t->have_prev, dt, st->uptime_usec);
        double r_steps = rate(st->steps_total, t->prev_steps, t->have_prev, dt, st->uptime_usec);
        double r_plans = rate(st->plans_total, t->prev_plans, t->have_prev, dt, st->uptime_usec);
        struct top_row *row = calloc(l->n_sessions + 1, sizeof(*row));
        struct client_sum *cl = calloc(l->n_sessions + 1, sizeof(*cl));
        uint64_t *ids = malloc((l->n_sessions + 1) * sizeof(*ids));
        uint64_t *steps = malloc((l->n_sessions + 1) * sizeof(*steps));
        if (!row || !cl || !ids || !steps) {
                free(row), free(cl), free(ids), free(steps);
                return fail(c, EXIT_REFUSED, ENOMEM, "out of memory");
        }
        size_t n_cl = 0, j = 0;
        for (size_t i = 0; i < l->n_sessions; i++) {
                const Kvc__SessionInfo *s = l->sessions[i];
                while (j < t->n_prev && t->prev_ids[j] < s->session_id)
                        j++;
                bool seen = j < t->n_prev && t->prev_ids[j] == s->session_id;
                row[i] = (struct top_row){
                        .s = s,
                        .rate = seen ? rate(s->steps, t->prev_session_steps[j], true, dt, 0)
                                     : rate(s->steps, 0, false, 0, s->age_usec),
                        .over = s->cap_bytes && s->bytes > s->cap_bytes,
                        .idle = s->idle_usec >= t->idle_usec,
                };
                ids[i] = s->session_id;
                steps[i] = s->steps;
                size_t k = 0;
                while (k < n_cl && !(cl[k].pid == s->pid && strcmp(cl[k].name, s->client_name) == 0))
                        k++;
                if (k == n_cl)
                        cl[n_cl++] = (struct client_sum){ .pid = s->pid, .name = s->client_name };
                cl[k].sessions++;
                cl[k].bytes += s->bytes;
                cl[k].rate += row[i].rate;
        }
        qsort_r(row, l->n_sessions, sizeof(*row), row_order, &t->sort);
        free(t->prev_ids);
        free(t->prev_session_steps);
        t->prev_ids = ids;
        t->prev_session_steps = steps;
        t->n_prev = l->n_sessions;
        t->have_prev = true;
        t->prev_usec = now;
        t->prev_batches = st->step_batches_total;
        t->prev_steps = st->steps_total;
        t->prev_plans = st->plans_total;

        if (c->json) {
                printf("{\"frame\":%llu,\"interval_s\":%.3f,\"sort\":\"%s\",\"rates\":{\"steps_per_s\":%.2f,"
                       "\"summaries_per_s\":%.2f,\"plans_per_s\":%.2f},\"status\":",
                       (unsigned long long)frame, dt, sort_names[t->sort], r_batches, r_steps, r_plans);
                json_status(st);
                printf(",\"clients\":[");
                for (size_t k = 0; k < n_cl; k++) {
                        printf("%s{\"pid\":%u,\"name\":", k ? "," : "", cl[k].pid);
                        json_string(cl[k].name);
                        printf(",\"sessions\":%u,\"bytes\":%llu,\"steps_per_s\":%.2f}", cl[k].sessions,
                               (unsigned long long)cl[k].bytes, cl[k].rate);
                }
                printf("],\"sessions\":[");
                for (size_t i = 0; i < l->n_sessions; i++) {
                        printf("%s", i ? "," : "");
                        json_session(row[i].s);
                        printf(",\"steps_per_s\":%.2f,\"over_cap\":%s,\"idle\":%s}", row[i].rate,
                               row[i].over ? "true" : "false", row[i].idle ? "true" : "false");
                }
                printf("]}\n");
                free(row), free(cl);
                return 0;
        }

        /* every line below fits 80 columns */
        char a[16], b[16], x[16], up[16];
        int lines = 0;
        printf("kvcd %s  %s  up %s  rss %s (heap %s)  sort %s%s\n", st->version, st->backend,
               short_age(st->uptime_usec, up, sizeof(up)), short_bytes(st->rss_bytes, a, sizeof(a)),
               short_bytes(st->rss_anon_bytes, b, sizeof(b)), sort_names[t->sort],
               st->draining ? "  DRAINING" : "");
        printf("pool %6s of %6s %5.1f%%  int8 %6s  shared %6s  chunks %u/%u\n",
               short_bytes(st->used_bytes, a, sizeof(a)), short_bytes(st->capacity_bytes, b, sizeof(b)),
               percent(st->used_bytes, st->capacity_bytes), short_bytes(st->int8_bytes, x, sizeof(x)),
               short_bytes(st->shared_bytes, up, sizeof(up)), st->chunks_in_use, st->chunks_total);
        printf("steps %10llu %9.1f/s  summaries %10llu %9.1f/s\n", (unsigned long long)st->step_batches_total,
               r_batches, (unsigned long long)st->steps_total, r_steps);
        printf("plans %10llu %9.1f/s  clients %u  sessions %u  deaths %llu  errors %llu\n",
               (unsigned long long)st->plans_total, r_plans, st->clients, st->sessions,
               (unsigned long long)st->client_deaths, (unsigned long long)st->errors_total);
        lines += 4;
        if (st->n_tenants) {
                printf("\n%-16s %7s %7s %6s %5s\n", "TENANT", "USED", "QUOTA", "USE%", "SESS");
                lines += 2;
        }
        for (size_t i = 0; i < st->n_tenants; i++, lines++) {
                const Kvc__TenantBudget *tn = st->tenants[i];
                printf("%-16.16s %7s %7s %5.1f%% %5u%s\n", tn->name,
                       short_bytes(tn->used_bytes, a, sizeof(a)), short_bytes(tn->quota_bytes, b, sizeof(b)),
                       percent(tn->used_bytes, tn->quota_bytes), tn->sessions,
                       tn->used_bytes > tn->quota_bytes ? "  OVER" : "");
        }
        if (n_cl) {
                printf("\n%-16s %8s %5s %7s %9s\n", "CLIENT", "PID", "SESS", "BYTES", "STEP/S");
                lines += 2;
        }
        for (size_t k = 0; k < n_cl; k++, lines++)
                printf("%-16.16s %8u %5u %7s %9.1f\n", cl[k].name[0] ? cl[k].name : "-", cl[k].pid,
                       cl[k].sessions, short_bytes(cl[k].bytes, a, sizeof(a)), cl[k].rate);
        printf("\n%5s %-8s %-8s %-7s %6s %7s %4s %4s %5s %6s %5s %s\n", "ID", "CLIENT", "TENANT", "POLICY",
               "TOKENS", "BYTES", "BITS", "%CAP", "CONF", "STEP/S", "AGE", "!");
        lines += 3; /* with the legend */
        size_t shown = l->n_sessions;
        if (rows > 0 && (int)shown > rows - lines - 1)
                shown = rows - lines - 1 > 0 ? (size_t)(rows - lines - 1) : 0;
        for (size_t i = 0; i < shown; i++) {
                const Kvc__SessionInfo *s = row[i].s;
                char cap[8] = "-";
                if (s->cap_bytes)
                        snprintf(cap, sizeof(cap), "%.0f",
                                 percent(s->bytes, s->cap_bytes) > 999 ? 999.0
                                                                       : percent(s->bytes, s->cap_bytes));
                printf("%5llu %-8.8s %-8.8s %-7.7s %6u %7s %4.1f %4s %5.2f %6.1f %5s %s%s\n",
                       (unsigned long long)s->session_id, s->client_name[0] ? s->client_name : "-", s->tenant,
                       s->policy, s->tokens, short_bytes(s->bytes, a, sizeof(a)), (double)s->bits_per_value, cap,
                       (double)s->confidence,
                       row[i].rate, short_age(s->age_usec, b, sizeof(b)), row[i].over ? "O" : "",
                       row[i].idle ? "I" : "");
        }
        if (shown < l->n_sessions)
                printf("(%zu more sessions)\n", l->n_sessions - shown);
        else if (!l->n_sessions)
                printf("(no sessions)\n");
        if (dt > 0)
                printf("! O: over its cap  I: no step for %g s   rates over the last %.1f s\n",
                       (double)t->idle_usec / 1e6, dt);
        else
                printf("! O: over its cap  I: no step for %g s   rates since kvcd started\n",
                       (double)t->idle_usec / 1e6);
        free(row), free(cl);
        return 0;
}

/* top: status and sessions, redrawn in place every interval; q (or Ctrl-C) quits, s cycles the
 * sort key and b, r, c, a choose one. Without a terminal it prints frame after frame; with
 * --json one document per frame, one per line. */
static int verb_top(struct ctl *c) {
        double interval = 1.0, idle = 10.0;
        long long iterations = -1;
        struct top_state t = { .sort = SORT_BYTES };
        if (c->val[F_INTERVAL] && parse_seconds(c->val[F_INTERVAL], false, 3600, &interval) < 0)
                return USAGE(c, "top --interval takes seconds (more than 0, at most 3600), not '%s'",
                             c->val[F_INTERVAL]);
        if (c->val[F_ITERATIONS] && parse_ll(c->val[F_ITERATIONS], 1, LLONG_MAX, &iterations) < 0)
                return USAGE(c, "top --iterations takes a number of frames (1 or more), not '%s'",
                             c->val[F_ITERATIONS]);
        if (c->val[F_IDLE] && parse_seconds(c->val[F_IDLE], false, 86400 * 365, &idle) < 0)
                return USAGE(c, "top --idle takes seconds (more than 0), not '%s'", c->val[F_IDLE]);
        if (c->val[F_SORT]) {
                int k = 0;
                while (k < SORT_N && strcmp(sort_names[k], c->val[F_SORT]) != 0)
                        k++;
                if (k == SORT_N)
                        return USAGE(c, "top --sort takes bytes, rate, confidence or age, not '%s'",
                                     c->val[F_SORT]);
                t.sort = (enum sort_key)k;
        }
        t.idle_usec = (uint64_t)(idle * 1e6);
        bool tty = !c->json && isatty(STDIN_FILENO) && isatty(STDOUT_FILENO);
        struct termios saved, raw;
        if (tty && tcgetattr(STDIN_FILENO, &saved) == 0) {
                raw = saved;
                raw.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
                tcsetattr(STDIN_FILENO, TCSANOW, &raw);
        } else {
                tty = false;
        }
        int r = 0;
        for (long long n = 0; iterations < 0 || n < iterations; n++) {
                Kvc__Envelope *se, *le;
                if ((r = get_status(c, &se)) || (r = get_sessions(c, &le)))
                        break;
                struct winsize ws = { 0 };
                int rows = tty && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 ? ws.ws_row : 0;
                if (tty)
                        printf("\033[H\033[2J"); /* home, clear */
                else if (n && !c->json)
                        printf("\n");
                if ((r = top_frame(c, &t, se->status, le->session_list, (uint64_t)n + 1, rows)))
                        break;
                fflush(stdout);
                if (iterations >= 0 && n + 1 >= iterations)
                        break;
                struct pollfd p = { .fd = STDIN_FILENO, .events = POLLIN };
                uint64_t until = mono_usec() + (uint64_t)(interval * 1e6);
                bool quit = false;
                for (uint64_t now = mono_usec(); now < until && !quit; now = mono_usec()) {
                        if (poll(&p, tty ? 1 : 0, (int)((until - now + 999) / 1000)) <= 0)
                                continue;
                        char ch;
                        if (read(STDIN_FILENO, &ch, 1) != 1)
                                break;
                        const char *keys = "brca";
                        if (ch == 'q' || ch == 'Q')
                                quit = true;
                        else if (ch == 's')
                                t.sort = (enum sort_key)((t.sort + 1) % SORT_N);
                        else if (ch && strchr(keys, ch))
                                t.sort = (enum sort_key)(strchr(keys, ch) - keys);
                        else
                                continue;
                        break; /* redraw at once with the new key */
                }
                if (quit)
                        break;
        }
        if (tty) {
                tcsetattr(STDIN_FILENO, TCSANOW, &saved);
                printf("\n");
        }
        free(t.prev_ids);
        free(t.prev_session_steps);
        return r;
}

/* --- budgets ------------------------------------------------------------------------------ */

static void print_budgets(const struct ctl *c, const Kvc__Budgets *b) {
        if (c->json) {
                printf("{\"capacity_bytes\":%llu,\"used_bytes\":%llu,\"default_quota_bytes\":%llu,"
                       "\"tenants\":[",
                       (unsigned long long)b->capacity_bytes, (unsigned long long)b->used_bytes,
                       (unsigned long long)b->default_quota_bytes);
                for (size_t i = 0; i < b->n_tenants; i++) {
                        const Kvc__TenantBudget *t = b->tenants[i];
                        printf("%s{\"name\":", i ? "," : "");
                        json_string(t->name);
                        printf(",\"quota_bytes\":%llu,\"used_bytes\":%llu,\"reserved_bytes\":%llu,"
                               "\"sessions\":%u,\"uid\":%lld,\"gid\":%lld,\"declared\":%s}",
                               (unsigned long long)t->quota_bytes, (unsigned long long)t->used_bytes,
                               (unsigned long long)t->reserved_bytes, t->sessions, (long long)t->uid,
                               (long long)t->gid, t->declared ? "true" : "false");
                }
                printf("]}\n");
                return;
        }
        char x[32], y[32], z[32];
        printf("capacity  %s (%s in use)\ndefault tenant quota  %s\n",
               human_bytes(b->capacity_bytes, x, sizeof(x)), human_bytes(b->used_bytes, y, sizeof(y)),
               human_bytes(b->default_quota_bytes, z, sizeof(z)));
        if (b->n_tenants)
                printf("\n%-16s %12s %12s %12s %8s %s\n", "TENANT", "QUOTA", "USED", "GUARANTEED", "SESSIONS",
                       "BOUND TO");
        for (size_t i = 0; i < b->n_tenants; i++) {
                const Kvc__TenantBudget *t = b->tenants[i];
                char bound[48] = "-";
                if (t->uid >= 0)
                        snprintf(bound, sizeof(bound), "uid %lld", (long long)t->uid);
                else if (t->gid >= 0)
                        snprintf(bound, sizeof(bound), "gid %lld", (long long)t->gid);
                printf("%-16.16s %12s %12s %12s %8u %s%s\n", t->name,
                       human_bytes(t->quota_bytes, x, sizeof(x)), human_bytes(t->used_bytes, y, sizeof(y)),
                       human_bytes(t->reserved_bytes, z, sizeof(z)), t->sessions, bound,
                       t->declared ? "" : " (undeclared)");
        }
}

static int budget_request(struct ctl *c, Kvc__Envelope *req) {
        Kvc__Envelope *env;
        int r = request(c, req, KVC__ENVELOPE__BODY_BUDGETS, &env);
        if (r == 0)
                print_budgets(c, env->budgets);
        return r;
}

static int verb_budget_get(struct ctl *c) {
        Kvc__BudgetRequest br = KVC__BUDGET_REQUEST__INIT;
        Kvc__Envelope req = KVC__ENVELOPE__INIT;
        req.body_case = KVC__ENVELOPE__BODY_BUDGET_REQUEST;
        req.budget_request = &br;
        return budget_request(c, &req);
}

/* A BYTES flag of budget set: its value, or a usage error. */
static int bytes_flag(const struct ctl *c, enum flag_id f, protobuf_c_boolean *set, uint64_t *ret) {
        if (!c->val[f])
                return 0;
        if (wire_parse_bytes(c->val[f], ret) < 0)
                return USAGE(c, "budget set --%s takes a size (4096, 256M, 2G), not '%s'", flags[f].name,
                             c->val[f]);
        *set = true;
        return 0;
}

static int verb_budget_set(struct ctl *c) {
        Kvc__BudgetSet bs = KVC__BUDGET_SET__INIT;
        long long v;
        int r;
        if ((r = bytes_flag(c, F_CAPACITY, &bs.set_capacity, &bs.capacity_bytes)) ||
            (r = bytes_flag(c, F_QUOTA, &bs.set_quota, &bs.quota_bytes)) ||
            (r = bytes_flag(c, F_MIN, &bs.set_min, &bs.session_min_bytes)) ||
            (r = bytes_flag(c, F_MAX, &bs.set_max, &bs.session_max_bytes)))
                return r;
        bs.tenant = (char *)c->val[F_TENANT];
        if (bs.tenant && (!*bs.tenant || *bs.tenant == '-'))
                return USAGE(c, "budget set --tenant takes a tenant's name, not '%s'", bs.tenant);
        if (c->val[F_SESSION]) {
                if (parse_ll(c->val[F_SESSION], 1, LLONG_MAX, &v) < 0)
                        return USAGE(c, "budget set --session takes a session id, not '%s'",
                                     c->val[F_SESSION]);
                bs.set_session = true;
                bs.session_id = (uint64_t)v;
        }
        if (c->val[F_PRIORITY]) {
                if (parse_ll(c->val[F_PRIORITY], -1000000, 1000000, &v) < 0)
                        return USAGE(c, "budget set --priority takes a number in -1000000..1000000, not '%s'",
                                     c->val[F_PRIORITY]);
                bs.set_priority = true;
                bs.priority = (int32_t)v;
        }
        if (c->val[F_UID] && c->val[F_GID])
                return USAGE(c, "budget set takes --uid or --gid, not both");
        for (enum flag_id f = F_UID; f <= F_GID; f++) {
                if (!c->val[f])
                        continue;
                if (parse_ll(c->val[f], -1, (long long)UINT32_MAX - 1, &v) < 0)
                        return USAGE(c, "budget set --%s takes an id (-1: none), not '%s'", flags[f].name,
                                     c->val[f]);
                bs.set_binding = true;
                bs.tenant_uid = bs.tenant_gid = -1;
                *(f == F_UID ? &bs.tenant_uid : &bs.tenant_gid) = v;
        }
        if ((bs.set_min || bs.set_max || bs.set_priority) && !bs.set_session)
                return USAGE(c, "budget set: --min, --max and --priority need --session");
        if (bs.set_session && !(bs.set_min || bs.set_max || bs.set_priority))
                return USAGE(c, "budget set --session needs --min, --max or --priority");
        if (bs.set_binding && !bs.tenant)
                return USAGE(c, "budget set: --uid and --gid need --tenant");
        if (bs.tenant && !(bs.set_quota || bs.set_binding))
                return USAGE(c, "budget set --tenant needs --quota, --uid or --gid");
        if (!bs.set_capacity && !bs.set_quota && !bs.set_session && !bs.set_binding)
                return USAGE(c, "budget set needs --capacity, --quota, --tenant with --quota/--uid/--gid, or "
                                "--session "
                                "with --min/--max/--priority");
        Kvc__Envelope req = KVC__ENVELOPE__INIT;
        req.body_case = KVC__ENVELOPE__BODY_BUDGET_SET;
        req.budget_set = &bs;
        return budget_request(c, &req);
}

/* --- evict, drain, audit, metrics --------------------------------------------------------- */

static int verb_evict(struct ctl *c) {
        long long id;
        if (parse_ll(c->argv[0], 1, LLONG_MAX, &id) < 0)
                return USAGE(c, "evict takes a session id, not '%s'", c->argv[0]);
        Kvc__Evict ev = KVC__EVICT__INIT;
        ev.session_id = (uint64_t)id;
        Kvc__Envelope req = KVC__ENVELOPE__INIT, *env;
        req.body_case = KVC__ENVELOPE__BODY_EVICT;
        req.evict = &ev;
        int r = request(c, &req, KVC__ENVELOPE__BODY_SESSION_CLOSED, &env);
        if (r)
                return r;
        const Kvc__SessionStats *st = env->session_closed->stats;
        if (c->json)
                printf("{\"evicted\":%llu,\"steps\":%llu,\"bytes_freed\":%llu}\n",
                       (unsigned long long)env->session_closed->session_id,
                       st ? (unsigned long long)st->steps : 0ull, st ? (unsigned long long)st->bytes : 0ull);
        else
                printf("session %llu evicted (%llu bytes freed)\n",
                       (unsigned long long)env->session_closed->session_id,
                       st ? (unsigned long long)st->bytes : 0ull);
        return 0;
}

/* drain: exits 0 once no session is left, EXIT_TIMEDOUT when --timeout passed with sessions
 * open (so `kvcctl drain --timeout 30 && systemctl stop kvcd` never stops a busy kvcd). A drain
 * without --timeout does not wait: it exits 0 when none is open, EXIT_TIMEDOUT otherwise. */
static int verb_drain(struct ctl *c) {
        Kvc__Drain dr = KVC__DRAIN__INIT;
        double timeout = 0;
        if (c->val[F_WAIT] && parse_seconds(c->val[F_WAIT], true, 86400, &timeout) < 0)
                return USAGE(c, "drain --timeout takes seconds (0 to 86400), not '%s'", c->val[F_WAIT]);
        if (c->val[F_RESUME] && c->val[F_WAIT])
                return USAGE(c, "drain --resume takes no --timeout");
        dr.resume = c->val[F_RESUME] != NULL;
        dr.timeout_ms = (uint32_t)(timeout * 1000);
        Kvc__Envelope req = KVC__ENVELOPE__INIT, *env;
        req.body_case = KVC__ENVELOPE__BODY_DRAIN;
        req.drain = &dr;
        int r = request_in(c, &c->arena, &req, KVC__ENVELOPE__BODY_DRAINED, &env,
                           (int)dr.timeout_ms + c->timeout_ms);
        if (r)
                return r;
        const Kvc__Drained *d = env->drained;
        bool left = !dr.resume && d->sessions_left > 0;
        if (c->json)
                printf("{\"sessions_left\":%u,\"timed_out\":%s,\"draining\":%s}\n", d->sessions_left,
                       d->timed_out ? "true" : "false", dr.resume ? "false" : "true");
        else if (dr.resume)
                printf("sessions are admitted again\n");
        else
                printf("draining: %u sessions left%s\n", d->sessions_left, left ? " (timed out)" : "");
        return left ? EXIT_TIMEDOUT : 0;
}

static int verb_audit(struct ctl *c) {
        Kvc__AuditRequest ar = KVC__AUDIT_REQUEST__INIT;
        Kvc__Envelope req = KVC__ENVELOPE__INIT, *env;
        req.body_case = KVC__ENVELOPE__BODY_AUDIT_REQUEST;
        req.audit_request = &ar;
        int r = request(c, &req, KVC__ENVELOPE__BODY_AUDIT, &env);
        if (r)
                return r;
        const Kvc__Audit *a = env->audit;
        if (c->json) {
                printf("{\"clean\":%s,\"used_bytes\":%llu,\"blocks\":%llu,\"sessions\":%u,\"report\":",
                       a->clean ? "true" : "false", (unsigned long long)a->used_bytes,
                       (unsigned long long)a->blocks, a->sessions);
                json_string(a->report);
                printf("}\n");
        } else {
                printf("%s\n", a->report);
        }
        return a->clean ? 0 : EXIT_REFUSED;
}

static int verb_metrics(struct ctl *c) {
        Kvc__MetricsRequest mr = KVC__METRICS_REQUEST__INIT;
        Kvc__Envelope req = KVC__ENVELOPE__INIT, *env;
        req.body_case = KVC__ENVELOPE__BODY_METRICS_REQUEST;
        req.metrics_request = &mr;
        int r = request(c, &req, KVC__ENVELOPE__BODY_METRICS, &env);
        if (r)
                return r;
        if (c->json) {
                printf("{\"text\":");
                json_string(env->metrics->text);
                printf("}\n");
        } else {
                fputs(env->metrics->text, stdout);
        }
        return 0;
}

/* --- events ------------------------------------------------------------------------------- */

static void print_event(const struct ctl *c, unsigned long long seq, uint64_t ts_usec,
                        const Kvc__KvEvent *e) {
        const char *kind = "cleared";
        size_t n = 0;
        const uint64_t *h = NULL;
        unsigned long long sid = 0;
        if (e->event_case == KVC__KV_EVENT__EVENT_STORED) {
                kind = "stored";
                n = e->stored->n_block_hashes, h = e->stored->block_hashes, sid = e->stored->session_id;
        } else if (e->event_case == KVC__KV_EVENT__EVENT_REMOVED) {
                kind = "removed";
                n = e->removed->n_block_hashes, h = e->removed->block_hashes, sid = e->removed->session_id;
        }
        if (c->json) {
                printf("{\"seq\":%llu,\"ts_usec\":%llu,\"event\":\"%s\",\"session\":%llu,\"block_hashes\":[",
                       seq, (unsigned long long)ts_usec, kind, sid);
                for (size_t k = 0; k < n; k++)
                        printf("%s\"%016llx\"", k ? "," : "", (unsigned long long)h[k]);
                printf("]}\n");
        } else {
                printf("%8llu  %-8s %8llu  %zu", seq, kind, sid, n);
                if (n)
                        printf(" (%016llx..)", (unsigned long long)h[0]);
                printf("\n");
        }
}

/* events: subscribe to kvcd.events.sock and print each event as it comes, until SIGINT or
 * SIGTERM (exit 0), --count events (exit 0), or --timeout MS when given (exit 0, or
 * EXIT_TIMEDOUT when --count was not reached). */
static int verb_events(struct ctl *c) {
        long long count = -1;
        char others[64];
        if (c->val[F_COUNT] && parse_ll(c->val[F_COUNT], 1, LLONG_MAX, &count) < 0)
                return USAGE(c, "events --count takes a number of events (1 or more), not '%s'",
                             c->val[F_COUNT]);
        if (find_socket(c, "kvcd.events.sock", others, sizeof(others)) < 0)
                return USAGE(c, "socket path too long");
        int r = probe(c, others);
        if (r)
                return r;
        sigset_t mask;
        sigemptyset(&mask);
        sigaddset(&mask, SIGINT);
        sigaddset(&mask, SIGTERM);
        int sfd = sigprocmask(SIG_BLOCK, &mask, NULL) == 0 ? signalfd(-1, &mask, SFD_CLOEXEC) : -1;
        if (sfd < 0)
                return fail(c, EXIT_UNREACHABLE, errno, "signalfd: %s", strerror(errno));
        char ep[320];
        snprintf(ep, sizeof(ep), "ipc://%s", c->path);
        c->zctx = zmq_ctx_new();
        c->zsock = c->zctx ? zmq_socket(c->zctx, ZMQ_SUB) : NULL;
        int zero = 0;
        if (!c->zsock || zmq_setsockopt(c->zsock, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
            zmq_setsockopt(c->zsock, ZMQ_SUBSCRIBE, "kv-events", 9) < 0 || zmq_connect(c->zsock, ep) < 0 ||
            wire_arena_new(WIRE_REPLY_MAX_BYTES * 2, &c->arena) < 0) {
                close(sfd);
                return fail(c, EXIT_UNREACHABLE, zmq_errno(), "cannot subscribe to %s", c->path);
        }
        if (!c->json)
                printf("%8s  %-8s %8s  %s\n", "SEQ", "EVENT", "SESSION", "BLOCKS");
        fflush(stdout);
        uint64_t end = c->timeout_given ? mono_usec() + (uint64_t)c->timeout_ms * 1000u : UINT64_MAX;
        r = 0;
        for (long long seen = 0; count < 0 || seen < count;) {
                zmq_pollitem_t item[2] = { { .socket = c->zsock, .events = ZMQ_POLLIN },
                                           { .fd = sfd, .events = ZMQ_POLLIN } };
                uint64_t now = mono_usec();
                if (now >= end) {
                        r = count < 0 ? 0 : EXIT_TIMEDOUT;
                        break;
                }
                long wait = end == UINT64_MAX ? -1 : (long)((end - now + 999) / 1000);
                int n = zmq_poll(item, 2, wait);
                if (n < 0 && zmq_errno() != EINTR) {
                        r = fail(c, EXIT_UNREACHABLE, zmq_errno(), "events: %s", zmq_strerror(zmq_errno()));
                        break;
                }
                if (item[1].revents & ZMQ_POLLIN)
                        break; /* interrupted: a follow ends well */
                if (!(item[0].revents & ZMQ_POLLIN))
                        continue;
                zmq_msg_t part[3];
                int got = 0;
                for (; got < 3; got++) {
                        zmq_msg_init(&part[got]);
                        if (zmq_msg_recv(&part[got], c->zsock, 0) < 0 || !zmq_msg_more(&part[got]))
                                break;
                }
                Kvc__KvEventBatch *b;
                if (got == 2 && zmq_msg_size(&part[1]) == 8 &&
                    wire_event_decode(c->arena, zmq_msg_data(&part[2]), zmq_msg_size(&part[2]), &b) == 0) {
                        const uint8_t *sq = zmq_msg_data(&part[1]);
                        unsigned long long seq = 0;
                        for (int i = 0; i < 8; i++)
                                seq = seq << 8 | sq[i];
                        for (size_t i = 0; i < b->n_events && (count < 0 || seen < count); i++, seen++)
                                print_event(c, seq, b->ts_usec, b->events[i]);
                        fflush(stdout);
                }
                for (int i = 0; i <= got && i < 3; i++)
                        zmq_msg_close(&part[i]);
        }
        close(sfd);
        return r;
}

/* --- the command line --------------------------------------------------------------------- */

/* The row of the verb named by words[0] (and words[1] for a two-word verb): its index, and in
 * *ret_used how many words its name took; -1 after saying what is wrong. */
static int find_verb(const struct ctl *c, char **words, int n, int *ret_used) {
        if (n == 0)
                return USAGE(c, "no verb given (kvcctl --help lists them)"), -1;
        bool first_known = false;
        for (size_t i = 0; i < N_VERBS; i++) {
                const char *name = verbs[i].name, *sp = strchr(name, ' ');
                size_t len = sp ? (size_t)(sp - name) : strlen(name);
                if (strlen(words[0]) != len || strncmp(words[0], name, len) != 0)
                        continue;
                first_known = true;
                if (!sp) {
                        *ret_used = 1;
                        return (int)i;
                }
                if (n > 1 && strcmp(words[1], sp + 1) == 0) {
                        *ret_used = 2;
                        return (int)i;
                }
        }
        if (!first_known)
                return USAGE(c, "unknown verb '%s' (kvcctl --help lists them)", words[0]), -1;
        char alts[128] = "";
        for (size_t i = 0; i < N_VERBS; i++) {
                const char *sp = strchr(verbs[i].name, ' ');
                if (sp && strncmp(verbs[i].name, words[0], (size_t)(sp - verbs[i].name)) == 0)
                        snprintf(alts + strlen(alts), sizeof(alts) - strlen(alts), "%s%s",
                                 alts[0] ? " or " : "", sp + 1);
        }
        if (n > 1)
                return USAGE(c, "%s takes %s, not '%s'", words[0], alts, words[1]), -1;
        return USAGE(c, "%s takes %s", words[0], alts), -1;
}

/* The flag named name ("--name" without its dashes, or a short letter when len is 1 and is_short):
 * its id in allowed when there is one there, else in any row; -1 when none. */
static int find_flag(const char *name, size_t len, bool is_short, unsigned allowed) {
        int any = -1;
        for (int i = 0; i < F_N_FLAGS; i++) {
                bool match = is_short
                                     ? flags[i].short_name == name[0]
                                     : strlen(flags[i].name) == len && strncmp(flags[i].name, name, len) == 0;
                if (!match)
                        continue;
                if (allowed & BIT(i))
                        return i;
                if (any < 0)
                        any = i;
        }
        return any;
}

struct word {
        const char *arg; /* as given */
        int flag;        /* -1: a plain word, -2: a value given to a flag without one, -3: unknown */
        const char *value;
        bool before_verb;
};

int main(int argc, char **argv) {
        struct ctl c = { .timeout_ms = 5000 };
        struct word *w = calloc((size_t)argc + 1, sizeof(*w));
        char **plain = calloc((size_t)argc + 1, sizeof(*plain));
        int n_w = 0, n_plain = 0, rc = 0;
        if (!w || !plain)
                return EXIT_REFUSED;
        /* first pass: split flags from words (whether a flag takes a value depends only on its
         * name, so this needs no verb); --json is known before any error is reported */
        bool dashdash = false;
        for (int i = 1; i < argc; i++) {
                const char *a = argv[i];
                if (dashdash || a[0] != '-' || a[1] == '\0') {
                        plain[n_plain++] = argv[i];
                        w[n_w++] = (struct word){ .arg = a, .flag = -1 };
                        continue;
                }
                if (strcmp(a, "--") == 0) {
                        dashdash = true;
                        continue;
                }
                bool is_short = a[1] != '-';
                const char *name = a + (is_short ? 1 : 2), *eq = is_short ? NULL : strchr(name, '=');
                size_t len = eq ? (size_t)(eq - name) : strlen(name);
                int f = find_flag(name, is_short ? 1 : len, is_short, ~0u);
                if (is_short && len > 1 && f >= 0 && !flags[f].arg)
                        f = -1; /* -n5 is -n 5, but flags without a value are not bundled */
                if (is_short && len > 1)
                        eq = name; /* its value starts after eq */
                struct word x = { .arg = a, .flag = f >= 0 ? f : -3, .before_verb = n_plain == 0 };
                if (f >= 0 && flags[f].arg) {
                        /* a long option where a value belongs means the value is missing
                         * (--tenant --capacity 1G named a tenant "--capacity"); a negative number
                         * (--priority -5) is a value */
                        if (eq)
                                x.value = eq + 1;
                        else if (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0)
                                x.value = argv[++i];
                        else
                                x.value = NULL;
                } else if (f >= 0 && eq) {
                        x.flag = -2; /* a value given to a flag without one */
                } else {
                        x.value = "";
                }
                if (f == F_JSON && x.flag == F_JSON)
                        c.json = true;
                w[n_w++] = x;
        }
        for (int i = 0; i < n_w; i++) {
                if (w[i].flag == F_HELP) {
                        usage(stdout);
                        goto out;
                }
                if (w[i].flag == F_VERSION) {
                        printf("kvcctl %s\n", KVC_VERSION);
                        goto out;
                }
        }
        /* a missing value is said before anything else (`--socket D --timeout` said "no verb
         * given") */
        for (int i = 0; i < n_w; i++)
                if (w[i].flag >= 0 && flags[w[i].flag].arg && !w[i].value) {
                        rc = USAGE(&c, "%s needs a value (%s)", w[i].arg, flags[w[i].flag].arg);
                        goto out;
                }
        /* second pass, against the verb's row */
        int used = 0, v = find_verb(&c, plain, n_plain, &used);
        if (v < 0) {
                rc = EXIT_USAGE;
                goto out;
        }
        const struct verb *vb = &verbs[v];
        for (int i = 0; i < n_w; i++) {
                if (w[i].flag == -1)
                        continue;
                if (w[i].flag == -2) {
                        rc = USAGE(&c, "%.*s takes no value", (int)(strchr(w[i].arg, '=') - w[i].arg),
                                   w[i].arg);
                        goto out;
                }
                if (w[i].flag < 0) {
                        rc = USAGE(&c, "unknown option %s", w[i].arg);
                        goto out;
                }
                const char *a = w[i].arg;
                bool is_short = a[1] != '-';
                const char *name = a + (is_short ? 1 : 2), *eq = is_short ? NULL : strchr(name, '=');
                size_t len = eq ? (size_t)(eq - name) : strlen(name);
                /* after the verb its own flag of a name wins; before it the global one */
                unsigned allowed = w[i].before_verb ? GLOBAL_FLAGS : vb->flags | GLOBAL_FLAGS;
                int f = find_flag(name, len, is_short, w[i].before_verb ? GLOBAL_FLAGS : vb->flags);
                if (f < 0 || !(allowed & BIT(f)))
                        f = find_flag(name, len, is_short, vb->flags | GLOBAL_FLAGS);
                if (f < 0 || !((vb->flags | GLOBAL_FLAGS) & BIT(f))) {
                        rc = USAGE(&c, "%s does not take %s", vb->name, a);
                        goto out;
                }
                if (!w[i].value) {
                        rc = USAGE(&c, "%s needs a value (%s)", a, flags[f].arg);
                        goto out;
                }
                c.val[f] = w[i].value;
        }
        int n_args = n_plain - used;
        if (n_args < vb->min_args || n_args > vb->max_args) {
                if (n_args > vb->max_args)
                        rc = USAGE(&c, "%s takes %s, not '%s'", vb->name,
                                   vb->max_args ? "one argument" : "no arguments",
                                   plain[used + vb->max_args]);
                else
                        rc = USAGE(&c, "%s needs%s", vb->name, vb->synopsis);
                goto out;
        }
        c.socket = c.val[F_SOCKET];
        if (c.socket && !*c.socket) {
                rc = USAGE(&c, "--socket takes a path, not an empty word");
                goto out;
        }
        if (c.val[F_TIMEOUT]) {
                long long t;
                if (parse_ll(c.val[F_TIMEOUT], 1, INT_MAX / 2, &t) < 0) {
                        rc = USAGE(&c, "--timeout takes milliseconds (1 or more), not '%s'",
                                   c.val[F_TIMEOUT]);
                        goto out;
                }
                c.timeout_ms = (int)t;
                c.timeout_given = true;
        }
        c.argc = n_args;
        c.argv = plain + used;
        rc = vb->run(&c);
out:
        if (c.zsock)
                zmq_close(c.zsock);
        if (c.zctx)
                zmq_ctx_term(c.zctx);
        wire_arena_free(c.arena);
        wire_arena_free(c.arena2);
        free(w);
        free(plain);
        return rc;
}
