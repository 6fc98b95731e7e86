/* main.c: kvcd's command line. Parses the flags, resolves the runtime directory, and runs the
 * server in the foreground (under systemd as Type=notify; it never forks or writes a pid file). */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvcd.h"
#include "log.h"

static void usage(FILE *f) {
        fprintf(f,
                "Usage: kvcd [OPTIONS]\n"
                "The KV-cache daemon: owns the KV-cache pools of the inference processes on this machine,\n"
                "runs their eviction policies and answers with compaction plans.\n\n"
                "  --runtime-dir DIR    sockets and lock live here (default: $RUNTIME_DIRECTORY,\n"
                "                       else $XDG_RUNTIME_DIR/kvcd, else /tmp/kvcd-$UID)\n"
                "  --backend NAME       host (memfd chunks; default), cuda, auto\n"
                "  --capacity BYTES     node capacity of the pool (default 256M; suffixes K M G)\n"
                "  --chunk-bytes BYTES  chunk size, a multiple of 2M (default 2M)\n"
                "  --pool-max BYTES     the most the capacity can be raised to at run time (default: the capacity)\n"
                "  --metrics-port PORT  serve Prometheus metrics on http://127.0.0.1:PORT/metrics (default: off)\n"
                "  --log-level LEVEL    error, warning, notice, info (default), debug\n"
                "  -h, --help           this text\n"
                "  -V, --version        the version\n");
}

/* "256M", "2G", "4096": bytes, or -EINVAL. */
static int parse_bytes(const char *s, uint64_t *ret) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(s, &end, 10);
        if (errno || end == s || s[0] == '-')
                return -EINVAL;
        uint64_t mul = 1;
        switch (*end) {
        case 'K':
        case 'k':
                mul = 1ull << 10;
                end++;
                break;
        case 'M':
        case 'm':
                mul = 1ull << 20;
                end++;
                break;
        case 'G':
        case 'g':
                mul = 1ull << 30;
                end++;
                break;
        case 'T':
        case 't':
                mul = 1ull << 40;
                end++;
                break;
        }
        if (*end == 'i')
                end++;
        if (*end == 'B')
                end++;
        if (*end || v > UINT64_MAX / mul)
                return -EINVAL;
        *ret = v * mul;
        return 0;
}

int main(int argc, char **argv) {
        static const struct option opts[] = {
                { "runtime-dir", required_argument, NULL, 'r' },
                { "backend", required_argument, NULL, 'b' },
                { "capacity", required_argument, NULL, 'c' },
                { "chunk-bytes", required_argument, NULL, 'k' },
                { "log-level", required_argument, NULL, 'l' },
                { "pool-max", required_argument, NULL, 'M' },
                { "metrics-port", required_argument, NULL, 'p' },
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, 'V' },
                {},
        };
        struct kvcd d = {
                .cfg = { .backend = "host", .capacity_bytes = 256ull << 20, .chunk_bytes = 2ull << 20 }
        };
        char dir[256];
        int c, r;

        while ((c = getopt_long(argc, argv, "hV", opts, NULL)) != -1) {
                switch (c) {
                case 'r': d.cfg.runtime_dir = optarg; break;
                case 'b': d.cfg.backend = optarg; break;
                case 'p': {
                        char *end;
                        unsigned long port = strtoul(optarg, &end, 10);
                        if (*end || port == 0 || port > 65535) {
                                fprintf(stderr, "kvcd: %s is not a port\n", optarg);
                                return 2;
                        }
                        d.cfg.metrics_port = (uint16_t)port;
                        break;
                }
                case 'c':
                case 'k':
                case 'M':
                        if (parse_bytes(optarg, c == 'c'   ? &d.cfg.capacity_bytes
                                                : c == 'k' ? &d.cfg.chunk_bytes
                                                           : &d.cfg.pool_max_bytes) < 0) {
                                fprintf(stderr, "kvcd: %s is not a size in bytes\n", optarg);
                                return 2;
                        }
                        break;
                case 'l':
                        if ((r = log_parse_level(optarg)) < 0) {
                                fprintf(stderr, "kvcd: unknown log level %s\n", optarg);
                                return 2;
                        }
                        log_set_level(r);
                        break;
                case 'h': usage(stdout); return 0;
                case 'V': printf("kvcd %s\n", KVCD_VERSION); return 0;
                default: usage(stderr); return 2;
                }
        }
        if (optind < argc) {
                fprintf(stderr, "kvcd: unexpected argument %s\n", argv[optind]);
                return 2;
        }
        if (!d.cfg.runtime_dir) {
                const char *rd = getenv("RUNTIME_DIRECTORY"), *xdg = getenv("XDG_RUNTIME_DIR");
                if (rd && *rd)
                        snprintf(dir, sizeof(dir), "%s", rd);
                else if (xdg && *xdg)
                        snprintf(dir, sizeof(dir), "%s/kvcd", xdg);
                else
                        snprintf(dir, sizeof(dir), "/tmp/kvcd-%u", (unsigned)getuid());
                d.cfg.runtime_dir = dir;
        }

        r = server_start(&d);
        if (r == 0)
                r = server_run(&d);
        server_stop(&d);
        return r < 0 ? 1 : 0;
}
