/* kvcctl: watch and steer kvcd from a terminal, over its admin socket.
 *
 * One verb per row of the verb table; each sends one admin request and prints the answer as a
 * human table, or as JSON with --json. Exit codes (documented in the README and the man page):
 *   0 done, 1 kvcd refused the request, 2 bad usage, 3 kvcd unreachable.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zmq.h>

#include "kvc.h"
#include "wire.h"

enum {
        EXIT_REFUSED = 1,
        EXIT_USAGE = 2,
        EXIT_UNREACHABLE = 3,
};

struct ctl {
        const char *socket;
        bool json;
        int timeout_ms;
        char path[300];
        void *zctx, *zsock;
        struct wire_arena *arena;
};

static void usage(FILE *f) {
        fprintf(f, "Usage: kvcctl [--socket PATH] [--json] [--timeout MS] VERB\n"
                   "Watches and steers kvcd.\n\n"
                   "Verbs:\n"
                   "  status      the daemon: pool, clients, sessions, counters\n"
                   "  sessions    one row per session\n\n"
                   "  --socket PATH   kvcd's admin socket or its runtime directory\n"
                   "  --json          machine-readable output\n"
                   "  --timeout MS    how long to wait for kvcd (default 5000)\n\n"
                   "Exit codes: 0 done, 1 kvcd refused the request, 2 bad usage, 3 kvcd unreachable.\n");
}

static int admin_path(struct ctl *c) {
        char dir[256];
        struct stat st;
        /* a socket path names an existing socket or ends in ".sock"; anything else is a directory
         * (perhaps not created yet: kvcctl waits for kvcd to appear) */
        size_t n = c->socket ? strlen(c->socket) : 0;
        if (c->socket && ((stat(c->socket, &st) == 0 && S_ISSOCK(st.st_mode)) ||
                          (n > 5 && strcmp(c->socket + n - 5, ".sock") == 0))) {
                snprintf(c->path, sizeof(c->path), "%s", c->socket);
                return 0;
        }
        if (c->socket)
                snprintf(dir, sizeof(dir), "%s", c->socket);
        else if (kvc_default_runtime_dir(dir, sizeof(dir)) < 0)
                return -ENAMETOOLONG;
        snprintf(c->path, sizeof(c->path), "%s/kvcd.admin.sock", dir);
        return 0;
}

/* Sends one admin request and waits for the answer; returns an exit code. */
static int request(struct ctl *c, Kvc__Envelope *req, Kvc__Envelope__BodyCase want, Kvc__Envelope **ret) {
        char ep[320], why[WIRE_MAX_MESSAGE];
        int zero = 0;
        snprintf(ep, sizeof(ep), "ipc://%s", c->path);
        c->zctx = zmq_ctx_new();
        c->zsock = zmq_socket(c->zctx, ZMQ_DEALER);
        zmq_setsockopt(c->zsock, ZMQ_LINGER, &zero, sizeof(zero));
        if (zmq_connect(c->zsock, ep) < 0 || wire_arena_new(WIRE_REPLY_MAX_BYTES * 2, &c->arena) < 0) {
                fprintf(stderr, "kvcctl: cannot connect to %s\n", c->path);
                return EXIT_UNREACHABLE;
        }
        req->version = WIRE_VERSION;
        req->request_id = 1;
        size_t n = wire_packed_size(req);
        uint8_t *buf = malloc(n ? n : 1);
        if (!buf)
                return EXIT_REFUSED;
        wire_pack(req, buf);
        int r = zmq_send(c->zsock, buf, n, ZMQ_DONTWAIT);
        free(buf);
        zmq_pollitem_t item = { .socket = c->zsock, .events = ZMQ_POLLIN };
        if (r < 0 || zmq_poll(&item, 1, c->timeout_ms) <= 0) {
                fprintf(stderr, "kvcctl: no answer from kvcd at %s within %d ms\n", c->path, c->timeout_ms);
                return EXIT_UNREACHABLE;
        }
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, c->zsock, 0) < 0) {
                zmq_msg_close(&msg);
                return EXIT_UNREACHABLE;
        }
        Kvc__Envelope *env;
        r = wire_decode(c->arena, zmq_msg_data(&msg), zmq_msg_size(&msg), WIRE_REPLY_MAX_BYTES, &env, why,
                        sizeof(why));
        zmq_msg_close(&msg);
        if (r < 0) {
                fprintf(stderr, "kvcctl: bad answer from kvcd: %s\n", why);
                return EXIT_REFUSED;
        }
        if (env->body_case == KVC__ENVELOPE__BODY_ERROR) {
                fprintf(stderr, "kvcctl: kvcd refused: %s (%s)\n", env->error->message,
                        wire_errno_name(env->error->code));
                return EXIT_REFUSED;
        }
        if (env->body_case != want) {
                fprintf(stderr, "kvcctl: kvcd answered %s\n", wire_body_name(env->body_case));
                return EXIT_REFUSED;
        }
        *ret = env;
        return 0;
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

static int verb_status(struct ctl *c) {
        Kvc__StatusRequest sr = KVC__STATUS_REQUEST__INIT;
        Kvc__Envelope req = KVC__ENVELOPE__INIT, *env;
        req.body_case = KVC__ENVELOPE__BODY_STATUS_REQUEST;
        req.status_request = &sr;
        int r = request(c, &req, KVC__ENVELOPE__BODY_STATUS, &env);
        if (r)
                return r;
        const Kvc__Status *s = env->status;
        if (c->json) {
                printf("{\"version\":\"%s\",\"backend\":\"%s\",\"uptime_usec\":%llu,\"capacity_bytes\":%llu,"
                       "\"used_bytes\":%llu,\"chunk_bytes\":%llu,\"chunks_total\":%u,\"chunks_in_use\":%u,"
                       "\"clients\":%u,\"sessions\":%u,\"steps_total\":%llu,\"plans_total\":%llu,"
                       "\"client_deaths\":%llu,\"errors_total\":%llu}\n",
                       s->version, s->backend, (unsigned long long)s->uptime_usec,
                       (unsigned long long)s->capacity_bytes, (unsigned long long)s->used_bytes,
                       (unsigned long long)s->chunk_bytes, s->chunks_total, s->chunks_in_use, s->clients,
                       s->sessions, (unsigned long long)s->steps_total, (unsigned long long)s->plans_total,
                       (unsigned long long)s->client_deaths, (unsigned long long)s->errors_total);
                return 0;
        }
        char a[32], b[32];
        printf("kvcd %s  backend %s  up %.1f s\n", s->version, s->backend, (double)s->uptime_usec / 1e6);
        printf("pool      %s of %s in use (%.1f%%), %u of %u chunks owned\n",
               human_bytes(s->used_bytes, a, sizeof(a)), human_bytes(s->capacity_bytes, b, sizeof(b)),
               s->capacity_bytes ? 100.0 * (double)s->used_bytes / (double)s->capacity_bytes : 0.0,
               s->chunks_in_use, s->chunks_total);
        printf("clients   %u\nsessions  %u\n", s->clients, s->sessions);
        printf("steps     %llu   plans %llu   client deaths %llu   errors %llu\n",
               (unsigned long long)s->steps_total, (unsigned long long)s->plans_total,
               (unsigned long long)s->client_deaths, (unsigned long long)s->errors_total);
        return 0;
}

static int verb_sessions(struct ctl *c) {
        Kvc__ListSessions ls = KVC__LIST_SESSIONS__INIT;
        Kvc__Envelope req = KVC__ENVELOPE__INIT, *env;
        req.body_case = KVC__ENVELOPE__BODY_LIST_SESSIONS;
        req.list_sessions = &ls;
        int r = request(c, &req, KVC__ENVELOPE__BODY_SESSION_LIST, &env);
        if (r)
                return r;
        const Kvc__SessionList *l = env->session_list;
        if (c->json) {
                printf("[");
                for (size_t i = 0; i < l->n_sessions; i++) {
                        const Kvc__SessionInfo *s = l->sessions[i];
                        printf("%s{\"id\":%llu,\"pid\":%u,\"uid\":%u,\"tenant\":\"%s\",\"policy\":\"%s\","
                               "\"budget\":%u,"
                               "\"tokens\":%u,\"peak_tokens\":%u,\"blocks\":%u,\"bytes\":%llu,\"confidence\":"
                               "%.4f,"
                               "\"steps\":%llu,\"plans\":%llu,\"age_usec\":%llu,\"layers\":%u}",
                               i ? "," : "", (unsigned long long)s->session_id, s->pid, s->uid, s->tenant,
                               s->policy, s->budget_tokens, s->tokens, s->peak_tokens, s->blocks,
                               (unsigned long long)s->bytes, (double)s->confidence,
                               (unsigned long long)s->steps, (unsigned long long)s->plans,
                               (unsigned long long)s->age_usec, s->n_layers);
                }
                printf("]\n");
                return 0;
        }
        printf("%6s %8s %6s %-10s %-8s %6s %6s %6s %5s %10s %8s %6s %8s\n", "ID", "PID", "UID", "TENANT",
               "POLICY", "BUDGET", "TOKENS", "BLOCKS", "CONF", "BYTES", "STEPS", "PLANS", "AGE");
        for (size_t i = 0; i < l->n_sessions; i++) {
                const Kvc__SessionInfo *s = l->sessions[i];
                char b[32];
                printf("%6llu %8u %6u %-10.10s %-8.8s %6u %6u %6u %5.2f %10s %8llu %6llu %7.1fs\n",
                       (unsigned long long)s->session_id, s->pid, s->uid, s->tenant, s->policy,
                       s->budget_tokens, s->tokens, s->blocks, (double)s->confidence,
                       human_bytes(s->bytes, b, sizeof(b)), (unsigned long long)s->steps,
                       (unsigned long long)s->plans, (double)s->age_usec / 1e6);
        }
        if (l->n_sessions == 0)
                printf("(no sessions)\n");
        return 0;
}

static const struct {
        const char *name;
        int (*run)(struct ctl *c);
} verbs[] = {
        { "status", verb_status },
        { "sessions", verb_sessions },
};

int main(int argc, char **argv) {
        static const struct option opts[] = {
                { "socket", required_argument, NULL, 's' },  { "json", no_argument, NULL, 'j' },
                { "timeout", required_argument, NULL, 't' }, { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, 'V' },       {},
        };
        struct ctl c = { .timeout_ms = 5000 };
        int o;
        while ((o = getopt_long(argc, argv, "+hV", opts, NULL)) != -1) {
                switch (o) {
                case 's': c.socket = optarg; break;
                case 'j': c.json = true; break;
                case 't': c.timeout_ms = atoi(optarg); break;
                case 'h': usage(stdout); return 0;
                case 'V': printf("kvcctl %s\n", KVC_VERSION); return 0;
                default: usage(stderr); return EXIT_USAGE;
                }
        }
        if (optind != argc - 1 || c.timeout_ms <= 0) {
                usage(stderr);
                return EXIT_USAGE;
        }
        if (admin_path(&c) < 0) {
                fprintf(stderr, "kvcctl: socket path too long\n");
                return EXIT_USAGE;
        }
        int rc = -1;
        for (size_t i = 0; i < sizeof(verbs) / sizeof(verbs[0]); i++)
                if (strcmp(verbs[i].name, argv[optind]) == 0)
                        rc = verbs[i].run(&c);
        if (rc < 0) {
                fprintf(stderr, "kvcctl: unknown verb %s\n", argv[optind]);
                usage(stderr);
                rc = EXIT_USAGE;
        }
        if (c.zsock)
                zmq_close(c.zsock);
        if (c.zctx)
                zmq_ctx_term(c.zctx);
        wire_arena_free(c.arena);
        return rc;
}
