/* main.c: kvcd's command line. Parses the flags, resolves the runtime directory, and runs the
 * server in the foreground (under systemd as Type=notify; it never forks or writes a pid file). */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "events.h"
#include "http.h"
#include "kvcd.h"
#include "log.h"
#include "prefix.h"
#include "pool.h"

static void usage(FILE *f) {
        fprintf(f,
                "Usage: kvcd [OPTIONS]\n"
                "The KV-cache daemon: owns the KV-cache pools of the inference processes on this machine,\n"
                "runs their eviction policies and answers with compaction plans.\n\n"
                "  --runtime-dir DIR    sockets and lock live here (default: $RUNTIME_DIRECTORY,\n"
                "                       else $XDG_RUNTIME_DIR/kvcd, else /tmp/kvcd-$UID)\n"
                "  --backend NAME       host (memfd chunks; default), cuda (GPU memory), auto (cuda when a\n"
                "                       driver and a device are present, else host)\n"
                "  --device UUID        cuda: the GPU, as nvidia-smi -L names it (default: device 0)\n"
                "  --capacity BYTES     node capacity of the pool (default 256M; suffixes K M G)\n"
                "  --chunk-bytes BYTES  chunk size, a multiple of 2M and of the GPU's allocation "
                "granularity\n"
                "                       (default 2M)\n"
                "  --pool-max BYTES     the most the capacity can be raised to at run time (default: the "
                "capacity)\n"
                "  --tenant NAME[:uid=N][:gid=N][:quota=BYTES]\n"
                "                       declare a tenant: the uid or gid whose sessions may charge it, and\n"
                "                       its quota (repeatable; default: no quota of its own)\n"
                "  --default-quota BYTES  the quota of every tenant without one (default: none)\n"
                "  --metrics-port PORT  serve Prometheus metrics on http://ADDR:PORT/metrics (default: "
                "off)\n"
                "  --metrics-address ADDR\n"
                "                       the numeric IPv4 or IPv6 address it listens on (default 127.0.0.1;\n"
                "                       0.0.0.0 or :: for every interface, for a central Prometheus)\n"
                "  --stop-timeout SEC   on SIGTERM, refuse new sessions and wait this long for open ones\n"
                "                       to end before stopping (default 10; a second SIGTERM stops at once)\n"
                "  --fd-store           keep the pool chunks and a state record in systemd's fd store, so\n"
                "                       that a restarted kvcd gives every client its caches back (needs\n"
                "                       FileDescriptorStoreMax= in the unit; on by itself when $FDSTORE is "
                "set)\n"
                "  --resume-grace SEC   after such a restart, how long clients have to resume their "
                "sessions\n"
                "                       before kvcd closes them and scrubs their memory (default 30)\n"
                "  --log-level LEVEL    error, warning, notice, info (default), debug\n"
                "  --events-format FMT  the KV events' wire format: kvcd (protobuf, default; kvcctl events\n"
                "                       reads it) or vllm (vLLM 0.10.2's msgpack KVEventBatch, for routers)\n"
                "  --events-endpoint EP also publish the KV events on EP (tcp://ADDR:PORT, for routers on\n"
                "                       other machines; the ipc socket in the runtime directory stays)\n"
                "  --events-replay-buffer N  keep the last N KV event messages and serve them on the replay\n"
                "                       socket (kvcd.events.replay.sock; default 0: no replay socket)\n"
                "  --events-replay-endpoint EP  also serve replay requests on EP (tcp://ADDR:PORT)\n"
                "  --events-token-ids   put the prompts' token ids in the KV events (default: empty lists;\n"
                "                       see docs/security.md)\n"
                "  --share-scope SCOPE  who may attach a shared prompt prefix: uid (sessions of clients with\n"
                "                       the publisher's uid; default) or tenant (sessions of its tenant)\n"
                "  -h, --help           this text\n"
                "  -V, --version        the version\n"
                "Exit status: 0 stopped cleanly, 1 failed, 2 bad usage, 69 the backend cannot run here (no\n"
                "CUDA driver, a stub driver, no device).\n");
}

int main(int argc, char **argv) {
        static const struct option opts[] = {
                { "runtime-dir", required_argument, NULL, 'r' },
                { "backend", required_argument, NULL, 'b' },
                { "device", required_argument, NULL, 'd' },
                { "capacity", required_argument, NULL, 'c' },
                { "chunk-bytes", required_argument, NULL, 'k' },
                { "log-level", required_argument, NULL, 'l' },
                { "pool-max", required_argument, NULL, 'M' },
                { "metrics-port", required_argument, NULL, 'p' },
                { "stop-timeout", required_argument, NULL, 's' },
                { "fd-store", no_argument, NULL, 'F' },
                { "resume-grace", required_argument, NULL, 'g' },
                { "tenant", required_argument, NULL, 't' },
                { "default-quota", required_argument, NULL, 'Q' },
                { "metrics-address", required_argument, NULL, 'A' },
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, 'V' },
                { "events-format", required_argument, NULL, 'E' },
                { "events-endpoint", required_argument, NULL, 'e' },
                { "events-replay-buffer", required_argument, NULL, 'R' },
                { "events-replay-endpoint", required_argument, NULL, 'P' },
                { "events-token-ids", no_argument, NULL, 'T' },
                { "share-scope", required_argument, NULL, 'S' },
                {},
        };
        struct kvcd d = { .cfg = { .backend = "host",
                                   .capacity_bytes = 256ull << 20,
                                   .chunk_bytes = 2ull << 20,
                                   .stop_timeout_usec = 10000000,
                                   .resume_grace_usec = 30000000 } };
        char dir[256], why[256];
        int c, r;
        budget_init(&d.budget);

        while ((c = getopt_long(argc, argv, "hV", opts, NULL)) != -1) {
                switch (c) {
                case 'r': d.cfg.runtime_dir = optarg; break;
                case 'b': d.cfg.backend = optarg; break;
                case 'd': d.cfg.device = optarg; break;
                case 'F': d.cfg.fd_store = true; break;
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
                case 's':
                case 'g': {
                        char *end;
                        double sec = strtod(optarg, &end);
                        if (*end || !(sec >= 0 && sec <= 3600)) {
                                fprintf(stderr, "kvcd: %s is not a number of seconds\n", optarg);
                                return 2;
                        }
                        *(c == 's' ? &d.cfg.stop_timeout_usec : &d.cfg.resume_grace_usec) =
                                (uint64_t)(sec * 1e6);
                        break;
                }
                case 'A': {
                        struct sockaddr_storage sa;
                        socklen_t len;
                        if (http_parse_address(optarg, &sa, &len) < 0) {
                                fprintf(stderr, "kvcd: %s is not a numeric IPv4 or IPv6 address\n", optarg);
                                return 2;
                        }
                        d.cfg.metrics_address = optarg;
                        break;
                }
                case 't':
                        if (budget_declare(&d.budget, optarg, why, sizeof(why)) < 0) {
                                fprintf(stderr, "kvcd: --tenant %s\n", why);
                                return 2;
                        }
                        break;
                case 'c':
                case 'k':
                case 'M':
                case 'Q':
                        if (wire_parse_bytes(optarg, c == 'c'   ? &d.cfg.capacity_bytes
                                                     : c == 'k' ? &d.cfg.chunk_bytes
                                                     : c == 'Q' ? &d.budget.default_quota
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
                case 'E':
                        if (!events_format_known(optarg)) {
                                fprintf(stderr, "kvcd: unknown events format %s (kvcd or vllm)\n", optarg);
                                return 2;
                        }
                        d.cfg.events_format = optarg;
                        break;
                case 'e':
                case 'P':
                        if (strncmp(optarg, "tcp://", 6) != 0 && strncmp(optarg, "ipc://", 6) != 0) {
                                fprintf(stderr, "kvcd: %s is not a tcp:// or ipc:// endpoint\n", optarg);
                                return 2;
                        }
                        *(c == 'e' ? &d.cfg.events_endpoint : &d.cfg.events_replay_endpoint) = optarg;
                        break;
                case 'R': {
                        char *end;
                        unsigned long n = strtoul(optarg, &end, 10);
                        if (*end || !*optarg || optarg[0] == '-' || n > EVENTS_REPLAY_MAX) {
                                fprintf(stderr,
                                        "kvcd: --events-replay-buffer %s is not a count from 0 to %u\n",
                                        optarg, EVENTS_REPLAY_MAX);
                                return 2;
                        }
                        d.cfg.events_replay_buffer = (uint32_t)n;
                        break;
                }
                case 'T': d.cfg.events_token_ids = true; break;
                case 'S':
                        if ((r = prefix_scope_parse(optarg)) < 0) {
                                fprintf(stderr, "kvcd: unknown share scope %s (uid or tenant)\n", optarg);
                                return 2;
                        }
                        d.cfg.share_scope = r;
                        break;
                case 'h': usage(stdout); return 0;
                case 'V': printf("kvcd %s\n", KVCD_VERSION); return 0;
                default: usage(stderr); return 2;
                }
        }
        if (d.cfg.events_replay_endpoint && !d.cfg.events_replay_buffer) {
                fprintf(stderr, "kvcd: --events-replay-endpoint needs --events-replay-buffer N\n");
                return 2;
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
        budget_done(&d.budget);
        return r == -ENODEV ? 69 /* EX_UNAVAILABLE */ : r < 0 ? 1 : 0;
}
