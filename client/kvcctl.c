/* kvcctl: watch and steer kvcd from a terminal, over its admin socket.
 *
 * One verb per row of the verb table; each sends admin requests and prints the answers as human
 * tables, or as JSON with --json. Exit codes (README and kvcctl(1)):
 *   0 done, 1 kvcd refused the request (or the audit found a mismatch), 2 bad usage,
 *   3 kvcd unreachable.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <termios.h>
#include <unistd.h>
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
        char dir[256];
        char path[300];
        void *zctx, *zsock;
        struct wire_arena *arena;
        uint64_t next_id;
        int argc; /* the verb's own arguments */
        char **argv;
};

static void usage(FILE *f) {
        fprintf(f,
                "Usage: kvcctl [--socket PATH] [--json] [--timeout MS] VERB [ARGS]\n"
                "Watches and steers kvcd.\n\n"
                "Verbs:\n"
                "  status                    the daemon: pool, clients, sessions, counters\n"
                "  sessions                  one row per session\n"
                "  top [--interval S] [--iterations N]\n"
                "                            status and sessions, refreshed in place; q quits\n"
                "  budget get                the capacity and the tenants' quotas\n"
                "  budget set [--capacity BYTES] [--tenant NAME [--quota BYTES] [--uid N | --gid N]]\n"
                "             [--session ID [--min BYTES] [--max BYTES] [--priority N]]\n"
                "  evict SESSION             close a session; its client is told\n"
                "  drain [--timeout S] [--resume]\n"
                "                            refuse new sessions; wait until the open ones end\n"
                "  audit                     recompute the accounting from the blocks (exit 1 on a "
                "mismatch)\n"
                "  metrics                   Prometheus text\n"
                "  events [--count N]        KV events as they happen (block stored / removed / cleared)\n\n"
                "  --socket PATH   kvcd's admin socket or its runtime directory\n"
                "  --json          machine-readable output\n"
                "  --timeout MS    how long to wait for kvcd (default 5000)\n\n"
                "Exit codes: 0 done, 1 refused (or a mismatch found), 2 bad usage, 3 kvcd unreachable.\n");
}

static int admin_path(struct ctl *c) {
        struct stat st;
        /* a socket path names an existing socket or ends in ".sock"; anything else is a directory
         * (perhaps not created yet: kvcctl waits for kvcd to appear) */
        size_t n = c->socket ? strlen(c->socket) : 0;
        if (c->socket && ((stat(c->socket, &st) == 0 && S_ISSOCK(st.st_mode)) ||
                          (n > 5 && strcmp(c->socket + n - 5, ".sock") == 0))) {
                snprintf(c->path, sizeof(c->path), "%s", c->socket);
                const char *slash = strrchr(c->socket, '/');
                snprintf(c->dir, sizeof(c->dir), "%.*s", slash ? (int)(slash - c->socket) : 1,
                         slash ? c->socket : ".");
                return 0;
        }
        if (c->socket)
                snprintf(c->dir, sizeof(c->dir), "%s", c->socket);
        else if (kvc_default_runtime_dir(c->dir, sizeof(c->dir)) < 0)
                return -ENAMETOOLONG;
        snprintf(c->path, sizeof(c->path), "%s/kvcd.admin.sock", c->dir);
        return 0;
}

static int connect_admin(struct ctl *c) {
        char ep[320];
        int zero = 0;
        snprintf(ep, sizeof(ep), "ipc://%s", c->path);
        c->zctx = zmq_ctx_new();
        c->zsock = c->zctx ? zmq_socket(c->zctx, ZMQ_DEALER) : NULL;
        if (!c->zsock || zmq_setsockopt(c->zsock, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
            zmq_connect(c->zsock, ep) < 0 || wire_arena_new(WIRE_REPLY_MAX_BYTES * 2, &c->arena) < 0) {
                fprintf(stderr, "kvcctl: cannot connect to %s\n", c->path);
                return EXIT_UNREACHABLE;
        }
        return 0;
}

/* Sends one admin request and waits (wait_ms) for its answer; returns an exit code. The answer
 * is valid until the next request. */
static int request_wait(struct ctl *c, Kvc__Envelope *req, Kvc__Envelope__BodyCase want, Kvc__Envelope **ret,
                        int wait_ms) {
        char why[WIRE_MAX_MESSAGE];
        if (!c->zsock && connect_admin(c))
                return EXIT_UNREACHABLE;
        req->version = WIRE_VERSION;
        req->request_id = ++c->next_id;
        size_t n = wire_packed_size(req);
        uint8_t *buf = malloc(n ? n : 1);
        if (!buf)
                return EXIT_REFUSED;
        wire_pack(req, buf);
        int r = zmq_send(c->zsock, buf, n, ZMQ_DONTWAIT);
        free(buf);
        for (;;) {
                zmq_pollitem_t item = { .socket = c->zsock, .events = ZMQ_POLLIN };
                if (r < 0 || zmq_poll(&item, 1, wait_ms) <= 0) {
                        fprintf(stderr, "kvcctl: no answer from kvcd at %s within %d ms\n", c->path, wait_ms);
                        return EXIT_UNREACHABLE;
                }
                zmq_msg_t msg;
                zmq_msg_init(&msg);
                if (zmq_msg_recv(&msg, c->zsock, 0) < 0) {
                        zmq_msg_close(&msg);
                        return EXIT_UNREACHABLE;
                }
                Kvc__Envelope *env;
                r = wire_decode(c->arena, zmq_msg_data(&msg), zmq_msg_size(&msg), WIRE_REPLY_MAX_BYTES, &env,
                                why, sizeof(why));
                zmq_msg_close(&msg);
                if (r < 0) {
                        fprintf(stderr, "kvcctl: bad answer from kvcd: %s\n", why);
                        return EXIT_REFUSED;
                }
                if (env->request_id != req->request_id)
                        continue; /* a late answer to an earlier request */
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
}

static int request(struct ctl *c, Kvc__Envelope *req, Kvc__Envelope__BodyCase want, Kvc__Envelope **ret) {
        return request_wait(c, req, want, ret, c->timeout_ms);
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

static int get_status(struct ctl *c, Kvc__Envelope **env) {
        Kvc__StatusRequest sr = KVC__STATUS_REQUEST__INIT;
        Kvc__Envelope req = KVC__ENVELOPE__INIT;
        req.body_case = KVC__ENVELOPE__BODY_STATUS_REQUEST;
        req.status_request = &sr;
        return request(c, &req, KVC__ENVELOPE__BODY_STATUS, env);
}

static void print_status(const struct ctl *c, const Kvc__Status *s) {
        if (c->json) {
                printf("{\"version\":\"%s\",\"backend\":\"%s\",\"uptime_usec\":%llu,\"capacity_bytes\":%llu,"
                       "\"used_bytes\":%llu,\"int8_bytes\":%llu,\"chunk_bytes\":%llu,\"chunks_total\":%u,"
                       "\"chunks_in_use\":%u,\"clients\":%u,\"sessions\":%u,\"steps_total\":%llu,\"plans_"
                       "total\":%llu,"
                       "\"client_deaths\":%llu,\"errors_total\":%llu,\"draining\":%s,\"shared_bytes\":%llu,"
                       "\"shared_blocks\":%u,\"chunks_reclaiming\":%u,\"chunks_held\":%u}\n",
                       s->version, s->backend, (unsigned long long)s->uptime_usec,
                       (unsigned long long)s->capacity_bytes, (unsigned long long)s->used_bytes,
                       (unsigned long long)s->int8_bytes, (unsigned long long)s->chunk_bytes, s->chunks_total,
                       s->chunks_in_use, s->clients, s->sessions, (unsigned long long)s->steps_total,
                       (unsigned long long)s->plans_total, (unsigned long long)s->client_deaths,
                       (unsigned long long)s->errors_total, s->draining ? "true" : "false",
                       (unsigned long long)s->shared_bytes, s->shared_blocks, s->chunks_reclaiming,
                       s->chunks_held);
                return;
        }
        char a[32], b[32], q[32];
        printf("kvcd %s  backend %s  up %.1f s%s\n", s->version, s->backend, (double)s->uptime_usec / 1e6,
               s->draining ? "  DRAINING (new sessions refused)" : "");
        printf("pool      %s of %s in use (%.1f%%; INT8 %s), %u of %u chunks owned\n",
               human_bytes(s->used_bytes, a, sizeof(a)), human_bytes(s->capacity_bytes, b, sizeof(b)),
               s->capacity_bytes ? 100.0 * (double)s->used_bytes / (double)s->capacity_bytes : 0.0,
               human_bytes(s->int8_bytes, q, sizeof(q)), s->chunks_in_use, s->chunks_total);
        if (s->chunks_reclaiming || s->chunks_held)
                printf("          of those, %u being taken back, %u held until a dead client's process "
                       "exits\n",
                       s->chunks_reclaiming, s->chunks_held);
        printf("clients   %u\nsessions  %u\n", s->clients, s->sessions);
        if (s->shared_blocks)
                printf("shared    %u prompt blocks, %s (counted once)\n", s->shared_blocks,
                       human_bytes(s->shared_bytes, q, sizeof(q)));
        printf("steps     %llu   plans %llu   client deaths %llu   errors %llu\n",
               (unsigned long long)s->steps_total, (unsigned long long)s->plans_total,
               (unsigned long long)s->client_deaths, (unsigned long long)s->errors_total);
}

static int verb_status(struct ctl *c) {
        Kvc__Envelope *env;
        int r = get_status(c, &env);
        if (r == 0)
                print_status(c, env->status);
        return r;
}

static int get_sessions(struct ctl *c, Kvc__Envelope **env) {
        Kvc__ListSessions ls = KVC__LIST_SESSIONS__INIT;
        Kvc__Envelope req = KVC__ENVELOPE__INIT;
        req.body_case = KVC__ENVELOPE__BODY_LIST_SESSIONS;
        req.list_sessions = &ls;
        return request(c, &req, KVC__ENVELOPE__BODY_SESSION_LIST, env);
}

static void print_sessions(const struct ctl *c, const Kvc__SessionList *l) {
        if (c->json) {
                printf("[");
                for (size_t i = 0; i < l->n_sessions; i++) {
                        const Kvc__SessionInfo *s = l->sessions[i];
                        printf("%s{\"id\":%llu,\"pid\":%u,\"uid\":%u,\"client\":", i ? "," : "",
                               (unsigned long long)s->session_id, s->pid, s->uid);
                        json_string(s->client_name);
                        printf(",\"tenant\":\"%s\",\"policy\":\"%s\",\"budget\":%u,\"tokens\":%u,\"peak_"
                               "tokens\":%u,"
                               "\"blocks\":%u,\"bytes\":%llu,\"int8_bytes\":%llu,\"confidence\":%.4f,"
                               "\"steps\":%llu,"
                               "\"plans\":%llu,\"age_usec\":%llu,\"layers\":%u,\"min_bytes\":%llu,\"max_"
                               "bytes\":%llu,"
                               "\"cap_bytes\":%llu,\"priority\":%d}",
                               s->tenant, s->policy, s->budget_tokens, s->tokens, s->peak_tokens, s->blocks,
                               (unsigned long long)s->bytes, (unsigned long long)s->int8_bytes,
                               (double)s->confidence, (unsigned long long)s->steps,
                               (unsigned long long)s->plans, (unsigned long long)s->age_usec, s->n_layers,
                               (unsigned long long)s->min_bytes, (unsigned long long)s->max_bytes,
                               (unsigned long long)s->cap_bytes, s->priority);
                }
                printf("]\n");
                return;
        }
        printf("%6s %8s %6s %-10s %-8s %6s %6s %5s %10s %10s %8s %6s %8s\n", "ID", "PID", "UID", "TENANT",
               "POLICY", "BUDGET", "TOKENS", "CONF", "FP BYTES", "INT8 BYTES", "STEPS", "PLANS", "AGE");
        for (size_t i = 0; i < l->n_sessions; i++) {
                const Kvc__SessionInfo *s = l->sessions[i];
                char b[32], q[32];
                printf("%6llu %8u %6u %-10.10s %-8.8s %6u %6u %5.2f %10s %10s %8llu %6llu %7.1fs\n",
                       (unsigned long long)s->session_id, s->pid, s->uid, s->tenant, s->policy,
                       s->budget_tokens, s->tokens, (double)s->confidence,
                       human_bytes(s->bytes - s->int8_bytes, b, sizeof(b)),
                       human_bytes(s->int8_bytes, q, sizeof(q)), (unsigned long long)s->steps,
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

/* top: status and sessions, redrawn in place every interval; q (or Ctrl-C) quits. */
static int verb_top(struct ctl *c) {
        double interval = 1.0;
        long iterations = -1;
        for (int i = 0; i < c->argc; i++) {
                if (strcmp(c->argv[i], "--interval") == 0 && i + 1 < c->argc)
                        interval = atof(c->argv[++i]);
                else if (strcmp(c->argv[i], "--iterations") == 0 && i + 1 < c->argc)
                        iterations = atol(c->argv[++i]);
                else
                        return EXIT_USAGE;
        }
        if (!(interval > 0))
                return EXIT_USAGE;
        bool tty = isatty(STDIN_FILENO) && isatty(STDOUT_FILENO);
        struct termios saved, raw;
        if (tty && tcgetattr(STDIN_FILENO, &saved) == 0) {
                raw = saved;
                raw.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
                tcsetattr(STDIN_FILENO, TCSANOW, &raw);
        } else {
                tty = false;
        }
        int r = 0;
        for (long n = 0; iterations < 0 || n < iterations; n++) {
                Kvc__Envelope *env;
                if ((r = get_status(c, &env)))
                        break;
                if (tty)
                        printf("\033[H\033[2J"); /* home, clear */
                print_status(c, env->status);
                if ((r = get_sessions(c, &env)))
                        break;
                printf("\n");
                print_sessions(c, env->session_list);
                if (tty)
                        printf("\n(q quits)");
                fflush(stdout);
                if (iterations >= 0 && n + 1 >= iterations)
                        break;
                struct pollfd p = { .fd = STDIN_FILENO, .events = POLLIN };
                if (poll(&p, tty ? 1 : 0, (int)(interval * 1000)) > 0) {
                        char ch;
                        if (read(STDIN_FILENO, &ch, 1) == 1 && (ch == 'q' || ch == 'Q'))
                                break;
                }
        }
        if (tty) {
                tcsetattr(STDIN_FILENO, TCSANOW, &saved);
                printf("\n");
        }
        return r;
}

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
                               "\"sessions\":%u,"
                               "\"uid\":%lld,\"gid\":%lld,\"declared\":%s}",
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

static int verb_budget(struct ctl *c) {
        Kvc__Envelope req = KVC__ENVELOPE__INIT, *env;
        Kvc__BudgetRequest br = KVC__BUDGET_REQUEST__INIT;
        Kvc__BudgetSet bs = KVC__BUDGET_SET__INIT;
        if (c->argc < 1)
                return EXIT_USAGE;
        if (strcmp(c->argv[0], "get") == 0 && c->argc == 1) {
                req.body_case = KVC__ENVELOPE__BODY_BUDGET_REQUEST;
                req.budget_request = &br;
        } else if (strcmp(c->argv[0], "set") == 0) {
                for (int i = 1; i < c->argc; i++) {
                        const char *a = c->argv[i], *v = i + 1 < c->argc ? c->argv[i + 1] : NULL;
                        if (!v)
                                return EXIT_USAGE;
                        i++;
                        if (strcmp(a, "--capacity") == 0) {
                                bs.set_capacity = true;
                                if (wire_parse_bytes(v, &bs.capacity_bytes) < 0)
                                        return EXIT_USAGE;
                        } else if (strcmp(a, "--tenant") == 0) {
                                bs.tenant = (char *)v;
                        } else if (strcmp(a, "--quota") == 0) {
                                bs.set_quota = true;
                                if (wire_parse_bytes(v, &bs.quota_bytes) < 0)
                                        return EXIT_USAGE;
                        } else if (strcmp(a, "--session") == 0) {
                                bs.set_session = true;
                                bs.session_id = strtoull(v, NULL, 10);
                        } else if (strcmp(a, "--min") == 0) {
                                bs.set_min = true;
                                if (wire_parse_bytes(v, &bs.session_min_bytes) < 0)
                                        return EXIT_USAGE;
                        } else if (strcmp(a, "--max") == 0) {
                                bs.set_max = true;
                                if (wire_parse_bytes(v, &bs.session_max_bytes) < 0)
                                        return EXIT_USAGE;
                        } else if (strcmp(a, "--priority") == 0) {
                                char *end;
                                long p = strtol(v, &end, 10);
                                if (*end || p < -1000000 || p > 1000000)
                                        return EXIT_USAGE;
                                bs.set_priority = true;
                                bs.priority = (int32_t)p;
                        } else if (strcmp(a, "--uid") == 0 || strcmp(a, "--gid") == 0) {
                                char *end;
                                long long id = strtoll(v, &end, 10);
                                if (*end || id < -1 || id >= UINT32_MAX)
                                        return EXIT_USAGE;
                                if (!bs.set_binding)
                                        bs.tenant_uid = bs.tenant_gid = -1;
                                bs.set_binding = true;
                                *(a[2] == 'u' ? &bs.tenant_uid : &bs.tenant_gid) = id;
                        } else {
                                return EXIT_USAGE;
                        }
                }
                /* --min/--max/--priority belong to --session; --quota/--uid/--gid to --tenant */
                if ((bs.set_min || bs.set_max || bs.set_priority) != bs.set_session ||
                    (bs.set_binding && !bs.tenant) ||
                    (!bs.set_capacity && !bs.set_quota && !bs.set_session && !bs.set_binding))
                        return EXIT_USAGE;
                req.body_case = KVC__ENVELOPE__BODY_BUDGET_SET;
                req.budget_set = &bs;
        } else {
                return EXIT_USAGE;
        }
        int r = request(c, &req, KVC__ENVELOPE__BODY_BUDGETS, &env);
        if (r == 0)
                print_budgets(c, env->budgets);
        return r;
}

static int verb_evict(struct ctl *c) {
        char *end;
        if (c->argc != 1)
                return EXIT_USAGE;
        Kvc__Evict ev = KVC__EVICT__INIT;
        ev.session_id = strtoull(c->argv[0], &end, 10);
        if (*end || ev.session_id == 0)
                return EXIT_USAGE;
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

static int verb_drain(struct ctl *c) {
        Kvc__Drain dr = KVC__DRAIN__INIT;
        double timeout = 0;
        for (int i = 0; i < c->argc; i++) {
                if (strcmp(c->argv[i], "--timeout") == 0 && i + 1 < c->argc)
                        timeout = atof(c->argv[++i]);
                else if (strcmp(c->argv[i], "--resume") == 0)
                        dr.resume = true;
                else
                        return EXIT_USAGE;
        }
        if (timeout < 0 || timeout > 86400)
                return EXIT_USAGE;
        dr.timeout_ms = (uint32_t)(timeout * 1000);
        Kvc__Envelope req = KVC__ENVELOPE__INIT, *env;
        req.body_case = KVC__ENVELOPE__BODY_DRAIN;
        req.drain = &dr;
        int r = request_wait(c, &req, KVC__ENVELOPE__BODY_DRAINED, &env, (int)dr.timeout_ms + c->timeout_ms);
        if (r)
                return r;
        const Kvc__Drained *d = env->drained;
        if (c->json)
                printf("{\"sessions_left\":%u,\"timed_out\":%s,\"draining\":%s}\n", d->sessions_left,
                       d->timed_out ? "true" : "false", dr.resume ? "false" : "true");
        else if (dr.resume)
                printf("sessions are admitted again\n");
        else
                printf("draining: %u sessions left%s\n", d->sessions_left,
                       d->timed_out ? " (timed out)" : "");
        return 0;
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

/* events: subscribe to kvcd.events.sock and print each event; stops after --count events or
 * when none comes for --timeout. */
static int verb_events(struct ctl *c) {
        long count = -1;
        for (int i = 0; i < c->argc; i++) {
                if (strcmp(c->argv[i], "--count") == 0 && i + 1 < c->argc)
                        count = atol(c->argv[++i]);
                else
                        return EXIT_USAGE;
        }
        char ep[320];
        snprintf(ep, sizeof(ep), "ipc://%s/kvcd.events.sock", c->dir);
        c->zctx = zmq_ctx_new();
        c->zsock = c->zctx ? zmq_socket(c->zctx, ZMQ_SUB) : NULL;
        int zero = 0;
        if (!c->zsock || zmq_setsockopt(c->zsock, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
            zmq_setsockopt(c->zsock, ZMQ_SUBSCRIBE, "kv-events", 9) < 0 || zmq_connect(c->zsock, ep) < 0 ||
            wire_arena_new(WIRE_REPLY_MAX_BYTES * 2, &c->arena) < 0) {
                fprintf(stderr, "kvcctl: cannot subscribe to %s\n", ep);
                return EXIT_UNREACHABLE;
        }
        if (!c->json)
                printf("%8s  %-8s %8s  %s\n", "SEQ", "EVENT", "SESSION", "BLOCKS");
        fflush(stdout);
        for (long seen = 0; count < 0 || seen < count;) {
                zmq_pollitem_t item = { .socket = c->zsock, .events = ZMQ_POLLIN };
                if (zmq_poll(&item, 1, c->timeout_ms) <= 0)
                        return count < 0 ? 0 : EXIT_UNREACHABLE; /* quiet: a tail stops when idle */
                zmq_msg_t part[3];
                int got = 0;
                for (; got < 3; got++) {
                        zmq_msg_init(&part[got]);
                        if (zmq_msg_recv(&part[got], c->zsock, 0) < 0 || !zmq_msg_more(&part[got]))
                                break;
                }
                if (got == 2 && zmq_msg_size(&part[1]) == 8) {
                        const uint8_t *sq = zmq_msg_data(&part[1]);
                        unsigned long long seq = 0;
                        for (int i = 0; i < 8; i++)
                                seq = seq << 8 | sq[i];
                        Kvc__KvEventBatch *b;
                        if (wire_event_decode(c->arena, zmq_msg_data(&part[2]), zmq_msg_size(&part[2]), &b) ==
                            0) {
                                for (size_t i = 0; i < b->n_events; i++, seen++) {
                                        const Kvc__KvEvent *e = b->events[i];
                                        const char *kind =
                                                e->event_case == KVC__KV_EVENT__EVENT_STORED    ? "stored"
                                                : e->event_case == KVC__KV_EVENT__EVENT_REMOVED ? "removed"
                                                                                                : "cleared";
                                        size_t n = e->event_case == KVC__KV_EVENT__EVENT_STORED
                                                           ? e->stored->n_block_hashes
                                                   : e->event_case == KVC__KV_EVENT__EVENT_REMOVED
                                                           ? e->removed->n_block_hashes
                                                           : 0;
                                        const uint64_t *h = e->event_case == KVC__KV_EVENT__EVENT_STORED
                                                                    ? e->stored->block_hashes
                                                            : e->event_case == KVC__KV_EVENT__EVENT_REMOVED
                                                                    ? e->removed->block_hashes
                                                                    : NULL;
                                        unsigned long long sid =
                                                e->event_case == KVC__KV_EVENT__EVENT_STORED
                                                        ? e->stored->session_id
                                                : e->event_case == KVC__KV_EVENT__EVENT_REMOVED
                                                        ? e->removed->session_id
                                                        : 0;
                                        if (c->json) {
                                                printf("{\"seq\":%llu,\"ts_usec\":%llu,\"event\":\"%s\","
                                                       "\"session\":%llu,"
                                                       "\"block_hashes\":[",
                                                       seq, (unsigned long long)b->ts_usec, kind, sid);
                                                for (size_t k = 0; k < n; k++)
                                                        printf("%s\"%016llx\"", k ? "," : "",
                                                               (unsigned long long)h[k]);
                                                printf("]}\n");
                                        } else {
                                                printf("%8llu  %-8s %8llu  %zu", seq, kind, sid, n);
                                                if (n)
                                                        printf(" (%016llx..)", (unsigned long long)h[0]);
                                                printf("\n");
                                        }
                                }
                                fflush(stdout);
                        }
                }
                for (int i = 0; i <= got && i < 3; i++)
                        zmq_msg_close(&part[i]);
        }
        return 0;
}

static const struct {
        const char *name;
        int (*run)(struct ctl *c);
} verbs[] = {
        { "events", verb_events }, { "status", verb_status }, { "sessions", verb_sessions },
        { "top", verb_top },       { "budget", verb_budget }, { "evict", verb_evict },
        { "drain", verb_drain },   { "audit", verb_audit },   { "metrics", verb_metrics },
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
        if (optind >= argc || c.timeout_ms <= 0) {
                usage(stderr);
                return EXIT_USAGE;
        }
        if (admin_path(&c) < 0) {
                fprintf(stderr, "kvcctl: socket path too long\n");
                return EXIT_USAGE;
        }
        c.argc = argc - optind - 1;
        c.argv = argv + optind + 1;
        int rc = -1;
        for (size_t i = 0; i < sizeof(verbs) / sizeof(verbs[0]); i++)
                if (strcmp(verbs[i].name, argv[optind]) == 0)
                        rc = verbs[i].run(&c);
        if (rc < 0 || rc == EXIT_USAGE) {
                if (rc < 0)
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
