/* test_metrics.c: the Prometheus endpoint and kvcctl metrics of a real kvcd.
 *
 *   - both texts pass `promtool check metrics` (Debian's prometheus package, from make deps) with
 *     nothing to say, name the same families (one renderer), and hold the series operators use:
 *     pool bytes that add up to the capacity, per-tenant use, quota and refusals, refusals by
 *     reason, policy and model series, start time, build info, process_*;
 *   - a flood of idle TCP connections (more than the endpoint's connection and per-address
 *     limits) does not stop it: it answers again within its idle timeout, having closed every
 *     idle connection itself (issue 19: kvcd never ran libmicrohttpd's timeouts, so sixteen idle
 *     connections stopped the endpoint for good);
 *   - a URL or headers above the limits get 414 and 431, also above libmicrohttpd's buffer;
 *   - the model label keeps METRICS_MAX_LABEL_VALUES values, the rest is "other";
 *   - --metrics-address serves IPv6 (where the machine has ::1) and takes numeric addresses only.
 * Every wait is a poll() with a deadline; the port is one the kernel chose free just before. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"
#include "kvc.h"

/* as daemon/http.h says (the test does not include daemon headers) */
#define IDLE_TIMEOUT_SEC 5
#define MAX_CONNECTIONS  64
#define FLOOD            (MAX_CONNECTIONS + 16)

static uint16_t port;
static char port_text[8];

static int64_t now_ms(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A TCP port of 127.0.0.1 nobody listens on (the kernel's choice, released again). */
static uint16_t free_port(void) {
        int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        socklen_t len = sizeof(sa);
        if (s < 0 || bind(s, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
            getsockname(s, (struct sockaddr *)&sa, &len) < 0) {
                if (s >= 0)
                        close(s);
                return 0;
        }
        close(s);
        return ntohs(sa.sin_port);
}

static int dial(void) {
        int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in sa = { .sin_family = AF_INET,
                                  .sin_port = htons(port),
                                  .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        if (s < 0)
                return -1;
        if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                close(s);
                return -1;
        }
        return s;
}

/* Sends req (len bytes) on a new connection and reads the answer until kvcd closes it or
 * deadline_ms passes. Returns the HTTP status (0: no status line came), the whole answer in
 * *ret_text (malloc'd) when ret_text is not NULL. */
static int http(const char *req, size_t len, int deadline_ms, char **ret_text) {
        int s = dial();
        if (s < 0)
                return 0;
        size_t off = 0;
        while (off < len) { /* kvcd may answer and close before it read everything */
                ssize_t n = send(s, req + off, len - off, MSG_NOSIGNAL);
                if (n <= 0)
                        break;
                off += (size_t)n;
        }
        size_t cap = 1 << 20, got = 0;
        char *buf = malloc(cap + 1);
        assert_non_null(buf);
        int64_t end = now_ms() + deadline_ms;
        for (;;) {
                int left = (int)(end - now_ms());
                struct pollfd p = { .fd = s, .events = POLLIN };
                if (left <= 0 || poll(&p, 1, left) <= 0)
                        break;
                ssize_t n = recv(s, buf + got, cap - got, 0);
                if (n <= 0)
                        break;
                got += (size_t)n;
                if (got == cap)
                        break;
        }
        close(s);
        buf[got] = '\0';
        int status = 0;
        if (sscanf(buf, "HTTP/1.%*d %d", &status) != 1)
                status = 0;
        if (ret_text)
                *ret_text = buf;
        else
                free(buf);
        return status;
}

static int get(const char *path, int deadline_ms, char **ret_text) {
        char *req = NULL;
        int n = asprintf(&req, "GET %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", path);
        assert_true(n > 0);
        int status = http(req, (size_t)n, deadline_ms, ret_text);
        free(req);
        return status;
}

/* The body of GET /metrics (asserting 200). */
static char *scrape(void) {
        char *text = NULL;
        assert_int_equal(get("/metrics", HARNESS_DEADLINE_MS, &text), 200);
        char *body = strstr(text, "\r\n\r\n");
        assert_non_null(body);
        char *out = strdup(body + 4);
        free(text);
        return out;
}

/* The value of the sample that starts a line with series ("name" or "name{labels}"); -1: none. */
static double sample(const char *text, const char *series) {
        size_t n = strlen(series);
        for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
                if (strncmp(p, series, n) == 0 && p[n] == ' ')
                        return strtod(p + n + 1, NULL);
        return -1;
}

static int by_text(const void *a, const void *b) {
        return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The sorted "# TYPE" lines of an exposition text, one string. */
static char *families(const char *text) {
        char *lines[512];
        size_t n = 0, total = 1;
        for (const char *p = text; p && *p && n < 512; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
                if (strncmp(p, "# TYPE ", 7) != 0)
                        continue;
                const char *e = strchr(p, '\n');
                lines[n] = strndup(p, e ? (size_t)(e - p) : strlen(p));
                total += strlen(lines[n++]) + 1;
        }
        qsort(lines, n, sizeof(*lines), by_text);
        char *out = calloc(1, total);
        for (size_t i = 0; i < n; i++) {
                strcat(strcat(out, lines[i]), "\n");
                free(lines[i]);
        }
        return out;
}

/* promtool check metrics on text: asserts exit 0 and nothing said. */
static void assert_promtool_clean(const char *text, const char *what) {
        char path[] = "/tmp/kvc-metrics-XXXXXX";
        int fd = mkstemp(path);
        assert_true(fd >= 0);
        assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
        close(fd);
        char cmd[256];
        snprintf(cmd, sizeof(cmd), "promtool check metrics < %s 2>&1", path);
        const char *argv[] = { "/bin/sh", "-c", cmd, NULL };
        char *out = NULL;
        int st = -1;
        assert_int_equal(harness_run(argv, &out, &st), 0);
        unlink(path);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || (out && *out))
                fail_msg("promtool check metrics on %s (status %d; 127: no promtool, run make deps):\n%s",
                         what, st, out ? out : "");
        free(out);
}

static int group_start(void **state) {
        if (!(port = free_port()))
                return -1;
        snprintf(port_text, sizeof(port_text), "%u", port);
        const char *extra[] = { "--capacity", "64M",      "--metrics-port",  port_text, "--metrics-address",
                                "127.0.0.1",  "--tenant", "team-a:quota=4M", NULL };
        return harness_group_start(state, extra);
}

static struct kvc_client *client(const struct daemon *d) {
        struct kvc_options o = { .socket = d->dir,
                                 .name = "test_metrics",
                                 .timeout_ms = HARNESS_DEADLINE_MS };
        struct kvc_client *c = NULL;
        assert_int_equal(kvc_connect(&o, &c), 0);
        return c;
}

static struct kvc_session_config config(const char *tenant, const char *model) {
        return (struct kvc_session_config){ .geometry = { .n_layers = 2,
                                                          .n_heads = 2,
                                                          .n_kv_heads = 1,
                                                          .head_dim = 64,
                                                          .dtype = KVC_DTYPE_F32,
                                                          .max_tokens = 512 },
                                            .policy = "window",
                                            .budget_tokens = 64,
                                            .tenant = tenant,
                                            .model_id = model };
}

static void endpoint_and_kvcctl_metrics_pass_promtool_and_hold_the_series(void **state) {
        struct daemon *d = *state;
        struct kvc_client *c = client(d);
        struct kvc_session *a = NULL, *b = NULL, *refused = NULL;
        struct kvc_session_config ca = config("team-a", "smollm2"), cb = config(NULL, "smollm2");
        assert_int_equal(kvc_session_open(c, &ca, &a), 0);
        assert_int_equal(kvc_session_reserve(a, 64), 0);
        assert_int_equal(kvc_session_open(c, &cb, &b), 0);
        /* a minimum above team-a's quota: refused, for the quota */
        struct kvc_session_config big = config("team-a", "smollm2");
        big.min_bytes = 8u << 20;
        assert_int_equal(kvc_session_open(c, &big, &refused), -ENOSPC);
        /* a minimum above the node's capacity: refused, for the capacity */
        struct kvc_session_config huge = config(NULL, "smollm2");
        huge.min_bytes = 128u << 20;
        assert_int_equal(kvc_session_open(c, &huge, &refused), -ENOSPC);
        /* a reservation above the session's own maximum: refused, for it */
        struct kvc_session_config capped = config(NULL, "smollm2");
        struct kvc_session *small = NULL;
        capped.max_bytes = 48u << 10;
        assert_int_equal(kvc_session_open(c, &capped, &small), 0);
        assert_int_equal(kvc_session_reserve(small, 64), -ENOSPC);
        /* and one above what its policy keeps a layer: refused, for the policy's limit */
        assert_int_equal(kvc_session_reserve(small, 4096), -ENOSPC);
        assert_int_equal(kvc_session_close(small, NULL), 0);

        char *m = scrape();
        assert_promtool_clean(m, "GET /metrics");
        const char *argv[] = { harness_bin("kvcctl"), "--socket", d->dir, "metrics", NULL };
        char *k = harness_output(argv);
        assert_non_null(k);
        assert_promtool_clean(k, "kvcctl metrics");
        char *fm = families(m), *fk = families(k);
        assert_string_equal(fm, fk); /* one renderer */
        assert_non_null(strstr(fm, "# TYPE kvcd_pool_capacity_bytes gauge"));
        free(fm);
        free(fk);

        assert_true(sample(m, "kvcd_pool_capacity_bytes") == 64.0 * 1024 * 1024);
        double fp = sample(m, "kvcd_pool_bytes{state=\"used\",precision=\"fp\"}"),
               q8 = sample(m, "kvcd_pool_bytes{state=\"used\",precision=\"int8\"}"),
               fr = sample(m, "kvcd_pool_bytes{state=\"free\"}");
        assert_true(fp > 0 && q8 == 0 && fr > 0);
        assert_true(fp + q8 + fr == 64.0 * 1024 * 1024); /* the series add up to the capacity */
        double ratio = sample(m, "kvcd_pool_usage_ratio");
        assert_true(ratio > 0 && ratio < 1 && ratio * 64.0 * 1024 * 1024 > fp - 1 &&
                    ratio * 64.0 * 1024 * 1024 < fp + 1);
        assert_true(sample(m, "kvcd_tenant_used_bytes{tenant=\"team-a\"}") > 0);
        assert_true(sample(m, "kvcd_tenant_quota_bytes{tenant=\"team-a\"}") == 4.0 * 1024 * 1024);
        assert_true(sample(m, "kvcd_tenant_refusals_total{tenant=\"team-a\"}") == 1);
        assert_true(sample(m, "kvcd_tenant_sessions{tenant=\"team-a\"}") == 1);
        assert_true(sample(m, "kvcd_refusals_total{reason=\"quota\"}") == 1);
        assert_true(sample(m, "kvcd_refusals_total{reason=\"capacity\"}") == 1);
        assert_true(sample(m, "kvcd_refusals_total{reason=\"session_max\"}") == 1);
        assert_true(sample(m, "kvcd_refusals_total{reason=\"policy_limit\"}") == 1);
        assert_true(sample(m, "kvcd_tenant_refusals_total{tenant=\"default\"}") == 3);
        assert_true(sample(m, "kvcd_refusals_total{reason=\"draining\"}") == 0);
        assert_true(sample(m, "kvcd_policy_sessions{policy=\"window\"}") == 2);
        assert_true(sample(m, "kvcd_model_sessions{model=\"smollm2\"}") == 2);
        assert_true(sample(m, "kvcd_sessions") == 2);
        assert_true(sample(m, "kvcd_requests_waiting_for_memory") == 0);
        assert_true(sample(m, "kvcd_prefix_lookups_total") == 0);
        assert_non_null(strstr(m, "\nkvcd_build_info{version=\"0.3.0\",compiler=\""));
        assert_true(sample(m, "kvcd_backend_info{backend=\"host\"}") == 1);
        double start = sample(m, "kvcd_start_time_seconds");
        assert_true(start > (double)time(NULL) - 600 && start <= (double)time(NULL) + 1);
        assert_true(sample(m, "process_resident_memory_bytes") > 1 << 20);
        assert_true(sample(m, "process_open_fds") > 3);
        assert_true(sample(m, "process_cpu_seconds_total") >= 0);
        assert_null(strstr(m, "uptime"));
        free(k);
        free(m);

        assert_int_equal(kvc_session_close(a, NULL), 0);
        assert_int_equal(kvc_session_close(b, NULL), 0);
        m = scrape();
        assert_true(sample(m, "kvcd_pool_bytes{state=\"free\"}") == 64.0 * 1024 * 1024);
        assert_true(sample(m, "kvcd_pool_usage_ratio") == 0);
        free(m);
        kvc_disconnect(c);
}

static void endpoint_answers_again_within_its_timeout_after_a_flood_of_idle_connections(void **state) {
        struct daemon *d = *state;
        int flood[FLOOD];
        for (int i = 0; i < FLOOD; i++)
                assert_true((flood[i] = dial()) >= 0); /* the listen queue takes the ones not accepted */
        int64_t t0 = now_ms(), deadline = t0 + (IDLE_TIMEOUT_SEC + 5) * 1000;
        /* kvcd closes every one of them: beyond the per-address limit at once, the rest once idle */
        int closed = 0;
        for (int i = 0; i < FLOOD; i++) {
                char c;
                struct pollfd p = { .fd = flood[i], .events = POLLIN };
                int left = (int)(deadline - now_ms());
                if (left > 0 && poll(&p, 1, left) == 1 && recv(flood[i], &c, 1, 0) <= 0)
                        closed++;
        }
        int64_t all_closed = now_ms() - t0;
        assert_int_equal(closed, FLOOD);
        /* and it answers; the flood's connections are gone */
        char *m = NULL;
        int status = 0;
        while (status != 200 && now_ms() < deadline) {
                free(m);
                m = NULL;
                status = get("/metrics", 1000, &m);
        }
        int64_t answered = now_ms() - t0;
        print_message("flood of %d: all closed after %lld ms, answered after %lld ms\n", FLOOD,
                      (long long)all_closed, (long long)answered);
        assert_int_equal(status, 200);
        assert_true(answered <= (IDLE_TIMEOUT_SEC + 3) * 1000);
        free(m);
        for (int i = 0; i < FLOOD; i++)
                close(flood[i]);
        char *st = harness_kvcctl(d, "status"); /* the rest of kvcd never stopped */
        assert_non_null(st);
        free(st);
}

/* Slow peers (issue 28, item 8): 8 local connections that trickle a request a byte at a time,
 * well within the idle timeout. A scraper that connects meanwhile is answered at once (before, the
 * 8 took the per-address limit for as long as they trickled), and each slow one is closed within
 * the request deadline (2 s) although it never idles. */
#define SLOW 8
static void slow_peers_neither_hold_the_endpoint_nor_outstay_the_request_deadline(void **state) {
        (void)state;
        int slow[SLOW];
        static const char head[] = "GET /metrics HTTP/1.1\r\nX-Slow: ";
        for (int i = 0; i < SLOW; i++) {
                assert_true((slow[i] = dial()) >= 0);
                assert_int_equal(send(slow[i], head, sizeof(head) - 1, MSG_NOSIGNAL), (ssize_t)sizeof(head) - 1);
        }
        int64_t t0 = now_ms();
        char *m = NULL;
        assert_int_equal(get("/metrics", 2000, &m), 200);
        free(m);
        /* a byte each every 500 ms (the clock: polling the slow connections themselves); kvcd closes
         * them all within the deadline plus a margin for a loaded machine */
        int open_ = SLOW, bytes = 0;
        int64_t end = t0 + 6000, next = t0;
        while (open_ > 0 && now_ms() < end) {
                struct pollfd p[SLOW];
                for (int i = 0; i < SLOW; i++)
                        p[i] = (struct pollfd){ .fd = slow[i], .events = POLLIN };
                int left = (int)(next - now_ms());
                poll(p, SLOW, left > 0 ? left : 0);
                for (int i = 0; i < SLOW; i++) {
                        char c;
                        if (slow[i] >= 0 && (p[i].revents & (POLLIN | POLLHUP | POLLERR)) &&
                            recv(slow[i], &c, 1, MSG_DONTWAIT) <= 0) {
                                close(slow[i]);
                                slow[i] = -1;
                                open_--;
                        }
                }
                if (now_ms() >= next) {
                        for (int i = 0; i < SLOW; i++)
                                if (slow[i] >= 0 && send(slow[i], "a", 1, MSG_NOSIGNAL) == 1)
                                        bytes++;
                        next += 500;
                }
        }
        int64_t closed_after = now_ms() - t0;
        print_message("%d slow peers (%d bytes trickled): closed after %lld ms\n", SLOW, bytes,
                      (long long)closed_after);
        for (int i = 0; i < SLOW; i++)
                if (slow[i] >= 0)
                        close(slow[i]);
        assert_int_equal(open_, 0);
}

static void endpoint_answers_oversized_urls_with_414_and_headers_with_431(void **state) {
        (void)state;
        size_t big = 64 * 1024;
        char *req = malloc(big + 256), *path = malloc(big + 2);
        assert_non_null(req);
        assert_non_null(path);
        /* above the endpoint's limit, and above libmicrohttpd's buffer too */
        size_t sizes[] = { 2000, 40000 };
        for (int i = 0; i < 2; i++) {
                path[0] = '/';
                memset(path + 1, 'a', sizes[i]);
                path[sizes[i] + 1] = '\0';
                assert_int_equal(get(path, HARNESS_DEADLINE_MS, NULL), 414);
        }
        size_t header_sizes[] = { 10000, 40000 };
        for (int i = 0; i < 2; i++) {
                char *v = malloc(header_sizes[i] + 1);
                assert_non_null(v);
                memset(v, 'b', header_sizes[i]);
                v[header_sizes[i]] = '\0';
                int n = snprintf(req, big + 256, "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\n\r\n", v);
                assert_true(n > 0 && (size_t)n < big + 256);
                assert_int_equal(http(req, (size_t)n, HARNESS_DEADLINE_MS, NULL), 431);
                free(v);
        }
        assert_int_equal(get("/other", HARNESS_DEADLINE_MS, NULL), 404);
        const char post[] = "DELETE /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        assert_int_equal(http(post, sizeof(post) - 1, HARNESS_DEADLINE_MS, NULL), 405);
        /* and a well-formed scrape still works */
        free(scrape());
        free(req);
        free(path);
}

static void model_label_keeps_sixteen_values_and_counts_the_rest_as_other(void **state) {
        struct daemon *d = *state;
        struct kvc_client *c = client(d);
        struct kvc_session *s[18];
        char names[18][16];
        for (int i = 0; i < 18; i++) {
                snprintf(names[i], sizeof(names[i]), "model-%02d", i);
                struct kvc_session_config cfg = config(NULL, names[i]);
                assert_int_equal(kvc_session_open(c, &cfg, &s[i]), 0);
        }
        char *m = scrape();
        int named = 0;
        for (const char *p = m; (p = strstr(p, "\nkvcd_model_sessions{model=\"model-")); p++)
                named++;
        assert_int_equal(named, 16);
        assert_true(sample(m, "kvcd_model_sessions{model=\"other\"}") == 2);
        assert_true(sample(m, "kvcd_policy_sessions{policy=\"window\"}") == 18);
        free(m);
        for (int i = 0; i < 18; i++)
                assert_int_equal(kvc_session_close(s[i], NULL), 0);
        kvc_disconnect(c);
}

static void every_tenant_kvcd_can_hold_fits_the_text_and_names_are_escaped(void **state) {
        (void)state;
        enum { TENANTS = 255 }; /* BUDGET_MAX_TENANTS, less the default tenant */
        char p2[8], spec[96];
        uint16_t port2 = free_port();
        assert_true(port2 > 0);
        snprintf(p2, sizeof(p2), "%u", port2);
        /* 64-byte names, the longest; the first, declared on the command line, with the two bytes
         * the format escapes (the wire refuses them in names, the command line does not) */
        snprintf(spec, sizeof(spec), "q\"\\-%060d:quota=1M", 0);
        const char *extra[] = { "--metrics-port", p2, "--tenant", spec, NULL };
        struct daemon d2 = { 0 };
        assert_int_equal(harness_daemon_start(&d2, extra, NULL), 0);
        for (int i = 1; i < TENANTS; i++) {
                char name[80], quota[16];
                snprintf(name, sizeof(name), "tnt-%060d", i);
                snprintf(quota, sizeof(quota), "%dM", i + 1);
                const char *argv[] = { harness_bin("kvcctl"),
                                       "--socket",
                                       d2.dir,
                                       "budget",
                                       "set",
                                       "--tenant",
                                       name,
                                       "--quota",
                                       quota,
                                       NULL };
                char *out = harness_output(argv);
                assert_non_null(out);
                free(out);
        }
        uint16_t saved = port;
        port = port2;
        char *m = scrape();
        port = saved;
        assert_promtool_clean(m, "GET /metrics with 255 tenants");
        int quotas = 0;
        for (const char *p = m; (p = strstr(p, "\nkvcd_tenant_quota_bytes{")); p++)
                quotas++;
        assert_int_equal(quotas, TENANTS);
        assert_non_null(strstr(m, "kvcd_tenant_quota_bytes{tenant=\"q\\\"\\\\-0000"));
        print_message("%d tenants: %zu bytes of metrics\n", TENANTS, strlen(m));
        free(m);
        const char *ctl[] = { harness_bin("kvcctl"), "--socket", d2.dir, "metrics", NULL };
        char *k = harness_output(ctl); /* the admin reply carries it whole too */
        assert_non_null(k);
        assert_promtool_clean(k, "kvcctl metrics with 255 tenants");
        free(k);
        int st = harness_daemon_stop(&d2);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static void metrics_address_serves_ipv6_too(void **state) {
        (void)state;
        int probe = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in6 sa = { .sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT };
        socklen_t len = sizeof(sa);
        if (probe < 0 || bind(probe, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
            getsockname(probe, (struct sockaddr *)&sa, &len) < 0) {
                if (probe >= 0)
                        close(probe);
                skip(); /* no IPv6 loopback here */
        }
        close(probe);
        char p6[8];
        snprintf(p6, sizeof(p6), "%u", ntohs(sa.sin6_port));
        struct daemon d6 = { 0 };
        const char *extra[] = { "--metrics-port", p6, "--metrics-address", "::1", NULL };
        assert_int_equal(harness_daemon_start(&d6, extra, NULL), 0);
        int s = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
        assert_true(s >= 0);
        assert_int_equal(connect(s, (struct sockaddr *)&sa, sizeof(sa)), 0);
        const char req[] = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        assert_int_equal(send(s, req, sizeof(req) - 1, MSG_NOSIGNAL), (ssize_t)sizeof(req) - 1);
        char head[64] = "";
        struct pollfd pf = { .fd = s, .events = POLLIN };
        assert_int_equal(poll(&pf, 1, HARNESS_DEADLINE_MS), 1);
        assert_true(recv(s, head, sizeof(head) - 1, 0) > 12);
        assert_memory_equal(head, "HTTP/1.1 200", 12);
        close(s);
        int st = harness_daemon_stop(&d6);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static void metrics_address_takes_numeric_addresses_only(void **state) {
        (void)state;
        struct daemon d2 = { 0 };
        int st = 0;
        const char *bad[] = { "--metrics-port", "1", "--metrics-address", "localhost", NULL };
        assert_int_equal(harness_daemon_start(&d2, bad, &st), -ECHILD);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 2);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(endpoint_and_kvcctl_metrics_pass_promtool_and_hold_the_series),
                cmocka_unit_test(endpoint_answers_again_within_its_timeout_after_a_flood_of_idle_connections),
                cmocka_unit_test(slow_peers_neither_hold_the_endpoint_nor_outstay_the_request_deadline),
                cmocka_unit_test(endpoint_answers_oversized_urls_with_414_and_headers_with_431),
                cmocka_unit_test(model_label_keeps_sixteen_values_and_counts_the_rest_as_other),
                cmocka_unit_test(every_tenant_kvcd_can_hold_fits_the_text_and_names_are_escaped),
                cmocka_unit_test(metrics_address_serves_ipv6_too),
                cmocka_unit_test(metrics_address_takes_numeric_addresses_only),
        };
        return cmocka_run_group_tests(tests, group_start, harness_group_stop);
}
