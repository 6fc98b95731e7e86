/* kvc-run: the reference model runner. Runs a GGUF model (SmolLM2 and other llama-family models)
 * or a llama2.c checkpoint (by default the project's stories260K) one token at a time, keeping its KV cache
 * in kvcd's pool through libkvc and stepping the session's eviction policy after every token, exactly as an
 * inference server would. With --local it keeps the cache in process instead (no kvcd, no eviction): the
 * baseline.
 *
 * Output: the generated text on stdout as it is produced (llama2.c's loop and decoding, so
 * greedy decoding from BOS prints the model's known story), or with --json one JSON object at the
 * end. --trace N prints the cache size every N steps on stderr. A chat that -n (positions, the
 * prompt included, where llama.cpp's -n counts new tokens) or the context cut before the model
 * ended its answer says so on stderr: `-n 40` on a 37-token chat prompt printed "L'Éto" and
 * nothing else, which read as a model or tokenizer fault (issue 30).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "importance.h"
#include "kvc.h"
#include "kvccache.h"
#include "laddercache.h"
#include "model.h"
#include "sampler.h"
#include "text.h"
#include "threads.h"
#include "wire.h"

#define DEFAULT_MODEL     "../shared/models/stories260K/stories260K.bin"
#define DEFAULT_TOKENIZER "../shared/models/stories260K/tok512.bin"
#define MAX_PARAMS        32

struct run_opts {
        const char *model, *tokenizer, *prompt, *policy, *socket, *tenant;
        const char *chat, *system; /* a chat turn (GGUF models with a chat template) */
        unsigned threads;
        bool exact;
        int steps;
        float temperature;
        unsigned long long seed;
        uint32_t budget;
        struct kvc_param params[MAX_PARAMS];
        size_t n_params;
        bool json, local, no_stop;
        int trace;
        uint32_t plan_lag;
        enum kvc_dtype dtype;
        uint64_t min_bytes, max_bytes;
        int32_t priority;
        int prefill_chunk;        /* prompt positions a pass (0: the model's default) */
        int batch;                /* sequences decoded together (0: one, or one a line of prompts) */
        const char *prompts;      /* a file of prompts, one a line */
        int export_at;            /* hand the session off after this many positions */
        bool import;              /* take a session handed off */
        bool share;               /* share the prompt's prefix with other sessions of this model */
        int stop_at;              /* SIGSTOP itself after this many positions (tests, debugging) */
        const char *handoff_file; /* where the ticket and the place in the sequence go */
        const char *tier;         /* --local: every token past tier_window at this tier */
        uint32_t tier_window;
        const char *tiers;        /* the session's tiers, for the policy to use (the ladder) */
        uint64_t budget_bytes;    /* a byte budget, or: */
        double budget_frac;       /* a fraction of the full cache of the run's positions */
        enum importance_kind importance; /* what the prompt's scores are (importance.h) */
};

static void usage(FILE *f) {
        fprintf(f,
                "Usage: kvc-run [OPTIONS]\n"
                "Runs a GGUF or llama2.c model with its KV cache managed by kvcd.\n\n"
                "  --model FILE        a GGUF model, or a llama2.c checkpoint (default " DEFAULT_MODEL ")\n"
                "  --tokenizer FILE    a llama2.c checkpoint's tokenizer (default " DEFAULT_TOKENIZER ")\n"
                "  --chat MESSAGE      one user turn in the model's chat template (GGUF), answered\n"
                "  --system TEXT       the chat's system prompt (default: the template's)\n"
                "  --threads N         threads for the matrix products (default: every CPU)\n"
                "  --exact             f32-accurate matrix products (no 8-bit activations)\n"
                "  --prefill-chunk N   prompt positions a pass, one kvcd step each (default 256 for a GGUF,\n"
                "                      1 for a llama2.c checkpoint; at most 256)\n"
                "  --batch B           decode B sequences in one pass (copies of the prompt, seeds "
                "SEED..SEED+B-1;\n"
                "                      with --prompts, the first B lines); their texts are printed at the "
                "end\n"
                "  --prompts FILE      one prompt a line, decoded together: a chat turn each for a model "
                "with a\n"
                "                      chat template, raw text otherwise\n"
                "  -n STEPS            positions to run, prompt included (default 256, at most the "
                "model's context)\n"
                "  -t TEMPERATURE      0 = greedy (default 0)\n"
                "  -s SEED             sampling seed (default 42)\n"
                "  -i PROMPT           prompt text (default: start from BOS alone)\n"
                "  --policy NAME       eviction policy (default full)\n"
                "  --budget TOKENS     the policy's budget per layer (default: the policy's)\n"
                "  --budget-bytes B    a byte budget for the whole cache, as kvcd charges it (64M, 1G...)\n"
                "  --budget-frac F     a byte budget of F times the full cache of the run's positions at\n"
                "                      --dtype (0.25: a quarter)\n"
                "  --tiers LIST        the tiers below --dtype the policy may use, highest first (q8,q4,q2:\n"
                "                      the ladder policy)\n"
                "  --param KEY=VALUE   a policy parameter (repeatable)\n"
                "  --tenant NAME       the tenant to charge\n"
                "  --min-bytes BYTES   memory kvcd must guarantee the session (default: the least it runs "
                "with)\n"
                "  --max-bytes BYTES   the most it may hold (default: no limit of its own)\n"
                "  --priority N        higher keeps its memory longer when memory is short (default 0)\n"
                "  --export-at N       after N positions, hand the session off (ticket and place in the\n"
                "                      sequence written to --handoff-file) and stop; greedy only\n"
                "  --import            carry on a session handed off (read from --handoff-file)\n"
                "  --handoff-file FILE the hand-off's ticket and place in the sequence\n"
                "  --share             share the prompt's prefix: attach what another run of this model\n"
                "                      published (nothing recomputed), publish the rest\n"
                "  --stop-at N         stop (SIGSTOP) after N positions, until continued (for tests)\n"
                "  --dtype f32|f16|bf16  storage type of keys and values (default f32)\n"
                "  --plan-lag N        steps the runner may run ahead of kvcd (default 0: deterministic)\n"
                "  --socket PATH       kvcd's runtime directory or kvcd.sock\n"
                "  --local             keep the cache in process (no kvcd)\n"
                "  --tier q8|q4|q3|q2  every token but the last --tier-window at that tier of the precision\n"
                "                      ladder (the window at --dtype): kvcd's tier_window, or with --local\n"
                "                      the in-process ladder cache\n"
                "  --tier-window N     tokens kept at --dtype with --tier (default 128)\n"
                "  --importance attention|surprisal|recon  what the prompt's scores for kvcd's policy are\n"
                "                      (default attention: the attention each token received)\n"
                "  --no-stop           keep going past the end-of-story token\n"
                "  --trace N           print the cache size and the confidence every N steps on stderr\n"
                "  --json              print one JSON object with the text and the figures\n"
                "  -h, --help          this text\n"
                "  -V, --version       the version\n");
}

static int parse_args(int argc, char **argv, struct run_opts *o) {
        static const struct option opts[] = {
                { "model", required_argument, NULL, 'm' },
                { "tokenizer", required_argument, NULL, 'k' },
                { "policy", required_argument, NULL, 'p' },
                { "budget", required_argument, NULL, 'b' },
                { "param", required_argument, NULL, 'P' },
                { "socket", required_argument, NULL, 'S' },
                { "tenant", required_argument, NULL, 'T' },
                { "dtype", required_argument, NULL, 'd' },
                { "plan-lag", required_argument, NULL, 'L' },
                { "trace", required_argument, NULL, 'r' },
                { "json", no_argument, NULL, 'j' },
                { "local", no_argument, NULL, 'l' },
                { "tier", required_argument, NULL, 1001 },
                { "tier-window", required_argument, NULL, 1002 },
                { "tiers", required_argument, NULL, 1003 },
                { "budget-bytes", required_argument, NULL, 1004 },
                { "budget-frac", required_argument, NULL, 1005 },
                { "importance", required_argument, NULL, 1006 },
                { "no-stop", no_argument, NULL, 'N' },
                { "help", no_argument, NULL, 'h' },
                { "min-bytes", required_argument, NULL, 'A' },
                { "max-bytes", required_argument, NULL, 'B' },
                { "priority", required_argument, NULL, 'R' },
                { "export-at", required_argument, NULL, 'X' },
                { "import", no_argument, NULL, 'I' },
                { "handoff-file", required_argument, NULL, 'H' },
                { "share", no_argument, NULL, 'Z' },
                { "stop-at", required_argument, NULL, 'Y' },
                { "version", no_argument, NULL, 'V' },
                { "chat", required_argument, NULL, 'C' },
                { "system", required_argument, NULL, 'y' },
                { "threads", required_argument, NULL, 'W' },
                { "exact", no_argument, NULL, 'E' },
                { "prefill-chunk", required_argument, NULL, 'c' },
                { "batch", required_argument, NULL, 'G' },
                { "prompts", required_argument, NULL, 'F' },
                {},
        };
        int c;
        char *end;
        while ((c = getopt_long(argc, argv, "n:t:s:i:hV", opts, NULL)) != -1) {
                switch (c) {
                case 'm': o->model = optarg; break;
                case 'k': o->tokenizer = optarg; break;
                case 'p': o->policy = optarg; break;
                case 'S': o->socket = optarg; break;
                case 'T': o->tenant = optarg; break;
                case 'i': o->prompt = optarg; break;
                case 'j': o->json = true; break;
                case 'l': o->local = true; break;
                case 1001: o->tier = optarg; break;
                case 1003: o->tiers = optarg; break;
                case 1004:
                        if (wire_parse_bytes(optarg, &o->budget_bytes) < 0 || !o->budget_bytes)
                                return -EINVAL;
                        break;
                case 1005:
                        o->budget_frac = strtod(optarg, &end);
                        if (*end || !(o->budget_frac > 0) || o->budget_frac > 1e6)
                                return -EINVAL;
                        break;
                case 1002:
                        o->tier_window = (uint32_t)strtoul(optarg, &end, 10);
                        if (*end || o->tier_window == 0 || o->tier_window > (1u << 24))
                                return -EINVAL;
                        break;
                case 1006:
                        if (importance_parse(optarg, &o->importance) < 0)
                                return -EINVAL;
                        break;
                case 'N': o->no_stop = true; break;
                case 'n':
                        o->steps = (int)strtol(optarg, &end, 10);
                        if (*end || o->steps <= 0)
                                return -EINVAL;
                        break;
                case 't':
                        o->temperature = strtof(optarg, &end);
                        if (*end || !(o->temperature >= 0))
                                return -EINVAL;
                        break;
                case 's':
                        o->seed = strtoull(optarg, &end, 10);
                        if (*end)
                                return -EINVAL;
                        break;
                case 'b':
                        o->budget = (uint32_t)strtoul(optarg, &end, 10);
                        if (*end)
                                return -EINVAL;
                        break;
                case 'X':
                        o->export_at = (int)strtol(optarg, &end, 10);
                        if (*end || o->export_at <= 0)
                                return -EINVAL;
                        break;
                case 'I': o->import = true; break;
                case 'Z': o->share = true; break;
                case 'Y':
                        o->stop_at = (int)strtol(optarg, &end, 10);
                        if (*end || o->stop_at <= 0)
                                return -EINVAL;
                        break;
                case 'H': o->handoff_file = optarg; break;
                case 'C': o->chat = optarg; break;
                case 'y': o->system = optarg; break;
                case 'E': o->exact = true; break;
                case 'F': o->prompts = optarg; break;
                case 'G':
                        o->batch = (int)strtol(optarg, &end, 10);
                        if (*end || o->batch < 1 || o->batch > MODEL_MAX_LOGIT_ROWS)
                                return -EINVAL;
                        break;
                case 'c':
                        o->prefill_chunk = (int)strtol(optarg, &end, 10);
                        if (*end || o->prefill_chunk < 1 || o->prefill_chunk > MODEL_MAX_ROWS)
                                return -EINVAL;
                        break;
                case 'W': {
                        unsigned long t = strtoul(optarg, &end, 10);
                        if (*end || t == 0 || t > THREADS_MAX)
                                return -EINVAL;
                        o->threads = (unsigned)t;
                        break;
                }
                case 'A':
                case 'B':
                        if (wire_parse_bytes(optarg, c == 'A' ? &o->min_bytes : &o->max_bytes) < 0)
                                return -EINVAL;
                        break;
                case 'R': {
                        long p = strtol(optarg, &end, 10);
                        if (*end || p < -1000000 || p > 1000000)
                                return -EINVAL;
                        o->priority = (int32_t)p;
                        break;
                }
                case 'L':
                        o->plan_lag = (uint32_t)strtoul(optarg, &end, 10);
                        if (*end)
                                return -EINVAL;
                        break;
                case 'r':
                        o->trace = (int)strtol(optarg, &end, 10);
                        if (*end || o->trace < 0)
                                return -EINVAL;
                        break;
                case 'd':
                        if (strcmp(optarg, "f32") == 0)
                                o->dtype = KVC_DTYPE_F32;
                        else if (strcmp(optarg, "f16") == 0)
                                o->dtype = KVC_DTYPE_F16;
                        else if (strcmp(optarg, "bf16") == 0)
                                o->dtype = KVC_DTYPE_BF16;
                        else
                                return -EINVAL;
                        break;
                case 'P': {
                        char *eq = strchr(optarg, '=');
                        if (!eq || eq == optarg || o->n_params >= MAX_PARAMS)
                                return -EINVAL;
                        *eq = '\0';
                        o->params[o->n_params++] = (struct kvc_param){ .key = optarg, .value = eq + 1 };
                        break;
                }
                case 'h': usage(stdout); exit(0);
                case 'V': printf("kvc-run %s\n", KVC_VERSION); exit(0);
                default: return -EINVAL;
                }
        }
        if ((o->chat && o->prompt) || (o->system && !o->chat && !o->prompts) ||
            (o->prompts && (o->chat || o->prompt)))
                return -EINVAL; /* a chat turn, or a file of them, is the prompt */
        if ((o->batch > 1 || o->prompts) && (o->export_at || o->import || o->stop_at))
                return -EINVAL; /* a hand-off or a stop is of one sequence */
        if (o->tier && o->local && (o->batch > 1 || o->prompts))
                return -EINVAL; /* the in-process ladder cache holds one sequence */
        if ((o->export_at || o->import) &&
            (!o->handoff_file || o->local || o->temperature != 0 || (o->export_at && o->import) || o->share))
                return -EINVAL; /* a hand-off needs the file, kvcd, and greedy decoding */
        if (o->importance != IMPORTANCE_KIND_ATTENTION &&
            (o->local || o->batch > 1 || o->prompts || o->plan_lag))
                return -EINVAL; /* scores go into kvcd's session of one sequence, between its chunks */
        return optind < argc ? -EINVAL : 0;
}

/* Appends the JSON escape of s[0..n) to out (bounded). */
static void json_escape(FILE *f, const char *s, size_t n) {
        for (size_t i = 0; i < n; i++) {
                unsigned char ch = (unsigned char)s[i];
                if (ch == '"' || ch == '\\')
                        fprintf(f, "\\%c", ch);
                else if (ch == '\n')
                        fputs("\\n", f);
                else if (ch < 0x20)
                        fprintf(f, "\\u%04x", ch);
                else
                        fputc(ch, f);
        }
}

/* Generated text kept for the end (--json, batches): NUL-terminated, grown by doubling. */
struct textbuf {
        char *s;
        size_t len, cap;
};

static int textbuf_append(struct textbuf *t, const char *piece, size_t n) {
        if (t->len + n + 1 > t->cap) {
                size_t cap = (t->cap + n + 1) * 2;
                char *p = realloc(t->s, cap);
                if (!p)
                        return -ENOMEM;
                t->s = p;
                t->cap = cap;
        }
        memcpy(t->s + t->len, piece, n);
        t->len += n;
        t->s[t->len] = '\0';
        return 0;
}

static double seconds(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* This process's CPU time (all threads): on a shared machine, the decode's cost without the time
 * other processes held the cores. */
static double cpu_seconds(void) {
        struct timespec ts;
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

struct runner {
        struct run_opts o;
        struct model *model;
        struct text *tok;
        struct sampler *sampler;
        struct plain_cache *plain;
        struct ladder_cache *ladder; /* --local --tier */
        struct importance *imp;      /* --importance surprisal|recon */
        struct kvc_client *client;
        struct kvc_session *session;
        struct textbuf text;
        int *prompt; /* the prompt's tokens, BOS first */
        int n_prompt;
        char model_id[40];  /* names the weights, for shared prefixes */
        double decode_t0;   /* when the first one-row pass past the prompt began (0: none yet) */
        double decode_cpu0; /* the process's CPU seconds then */
        int decode_pos0;    /* its position */
        int cut_at;         /* a chat's answer ended by the step limit at this many positions (0: not) */
};

static void fail(struct runner *r, const char *what, int err) {
        fprintf(stderr, "kvc-run: %s: %s%s%s\n", what, strerror(-err), r->client ? ": " : "",
                r->client ? kvc_last_error(r->client) : "");
}

/* The model computed logits the sampler or kvc_summarize refuses (NaN or infinities): the model
 * file is the cause, not kvcd (issue 28: this said only "summary: Invalid argument"). */
static void bad_logits(const struct runner *r, int pos, int err) {
        fprintf(stderr, "kvc-run: the model %s computed logits that are not finite numbers at position %d (%s): "
                "its weights are broken\n", r->o.model, pos, strerror(-err));
}

static int emit(struct runner *r, const char *piece, size_t n) {
        if (!r->o.json) {
                fwrite(piece, 1, n, stdout);
                fflush(stdout);
                return 0;
        }
        return textbuf_append(&r->text, piece, n);
}

static int connect_kvcd(struct runner *r) {
        struct kvc_options ko = { .socket = r->o.socket, .name = "kvc-run", .plan_lag = r->o.plan_lag };
        int e = kvc_connect(&ko, &r->client);
        if (e < 0) /* kvc_last_error names the uid of a kvcd refused as not kvcd's (issue 28) */
                fprintf(stderr, "kvc-run: cannot connect to kvcd (%s): %s: %s\n",
                        r->o.socket ? r->o.socket : "default socket", strerror(-e), kvc_last_error(NULL));
        return e;
}

/* A session for one sequence whose prompt is prompt[0..n_prompt). */
static int open_one(struct runner *r, const int *prompt, int n_prompt, struct kvc_session **ret) {
        const struct model_config *mc = model_get_config(r->model);
        struct kvc_param params[MAX_PARAMS + 1];
        size_t n_params = r->o.n_params;
        char window[16];
        memcpy(params, r->o.params, n_params * sizeof(params[0]));
        if (r->o.tier) { /* kvcd's uniform tier: every token but the newest window at it */
                snprintf(window, sizeof(window), "%u", r->o.tier_window ? r->o.tier_window : 128);
                params[n_params++] = (struct kvc_param){ .key = "tier_window", .value = window };
        }
        /* the session never holds more than the run's positions: its limits (and a plan buffer
         * sized by them) need no more */
        int positions = r->o.steps > n_prompt ? r->o.steps : n_prompt + 1;
        struct kvc_session_config sc = {
                .geometry = { .n_layers = (uint32_t)mc->n_layers,
                              .n_heads = (uint32_t)mc->n_heads,
                              .n_kv_heads = (uint32_t)mc->n_kv_heads,
                              .head_dim = (uint32_t)(mc->dim / mc->n_heads),
                              .dtype = r->o.dtype,
                              .max_tokens = (uint32_t)(positions < mc->seq_len ? positions : mc->seq_len) },
                .policy = r->o.policy,
                .budget_tokens = r->o.budget,
                .budget_bytes = r->o.budget_bytes,
                .params = params,
                .n_params = n_params,
                .tiers = r->o.tier ? r->o.tier : r->o.tiers,
                .tenant = r->o.tenant,
                .handoff = r->o.export_at > 0,
                .share_prefix = r->o.share,
                .model_id = r->model_id,
                .min_bytes = r->o.min_bytes,
                .max_bytes = r->o.max_bytes,
                .priority = r->o.priority,
                .prompt_tokens = (uint32_t)n_prompt,
                .prompt_token_ids = (const uint32_t *)prompt,
                .n_prompt_token_ids = (size_t)n_prompt,
        };
        if (r->o.budget_frac > 0)
                sc.budget_bytes = (uint64_t)(r->o.budget_frac *
                                             (double)kvc_full_cache_bytes(&sc.geometry, sc.geometry.max_tokens));
        int e = kvc_session_open(r->client, &sc, ret);
        if (e < 0)
                fail(r, "cannot open a session", e);
        return e;
}

static int open_session(struct runner *r) {
        int e = connect_kvcd(r);
        if (e < 0 || r->o.import) /* an imported session comes from the hand-off, in generate() */
                return e;
        return open_one(r, r->prompt, r->n_prompt, &r->session);
}

/* Encodes a prompt or a chat turn into a new array (the model's start token alone when there is
 * neither). */
static int encode(struct runner *r, const char *prompt, const char *chat, int **ret_ids, int *ret_n) {
        const struct model_config *mc = model_get_config(r->model);
        int *ids = *ret_ids = calloc((size_t)mc->seq_len + 3, sizeof(int));
        if (!ids) {
                fprintf(stderr, "kvc-run: no memory for a prompt of %d positions\n", mc->seq_len);
                return -ENOMEM;
        }
        ids[0] = text_start_token(r->tok);
        *ret_n = 1;
        if (!prompt && !chat) {
                if (ids[0] >= 0)
                        return 0;
                fprintf(stderr, "kvc-run: this model starts from a prompt: give one with -i or --chat\n");
                return -EINVAL;
        }
        size_t n;
        int e = chat ? text_encode_chat(r->tok, r->o.system, chat, ids, (size_t)mc->seq_len, &n)
                     : text_encode(r->tok, prompt, ids, (size_t)mc->seq_len, &n);
        if (e == -ENOTSUP) {
                fprintf(stderr, "kvc-run: --chat needs a model with a chat template (a GGUF)\n");
                return e;
        }
        if (e == 0 && n == 0) {
                fprintf(stderr, "kvc-run: the prompt encodes to no token\n");
                return -EINVAL;
        }
        if (e < 0) {
                fprintf(stderr, "kvc-run: the prompt does not fit the model's %d positions\n", mc->seq_len);
                return e;
        }
        *ret_n = (int)n;
        return 0;
}

/* The weights' name for shared prefixes: FNV-1a 64 of the checkpoint's size and first 4 MiB. */
static int model_id_of(const char *path, char *out, size_t len) {
        FILE *f = fopen(path, "rb");
        if (!f)
                return -errno;
        uint64_t h = 0xcbf29ce484222325ull, size = 0;
        unsigned char buf[65536];
        size_t n;
        while (size < (4u << 20) && (n = fread(buf, 1, sizeof(buf), f)) > 0) {
                for (size_t i = 0; i < n; i++)
                        h = (h ^ buf[i]) * 0x100000001b3ull;
                size += n;
        }
        if (fseek(f, 0, SEEK_END) == 0)
                size = (uint64_t)ftell(f);
        fclose(f);
        for (int k = 0; k < 8; k++)
                h = (h ^ (uint8_t)(size >> (8 * k))) * 0x100000001b3ull;
        snprintf(out, len, "fnv1a64:%016llx", (unsigned long long)h);
        return 0;
}

/* The exporter's side of a hand-off: the ticket and where the sequence stands, for the importer. */
static int hand_off(struct runner *r, int pos, int token) {
        struct kvc_handoff h;
        int e = kvc_session_export(r->session, &h);
        if (e < 0) {
                fail(r, "hand-off", e);
                return e;
        }
        r->session = NULL; /* the importer's now */
        FILE *f = fopen(r->o.handoff_file, "w");
        if (!f) {
                e = -errno;
                fprintf(stderr, "kvc-run: %s: %s\n", r->o.handoff_file, strerror(-e));
                return e;
        }
        fprintf(f, "kvc-handoff 1\nsession %llu\nticket ", (unsigned long long)h.session_id);
        for (size_t i = 0; i < sizeof(h.ticket); i++)
                fprintf(f, "%02x", h.ticket[i]);
        fprintf(f, "\npos %d\ntoken %d\n", pos, token);
        return fclose(f) == 0 ? 0 : -EIO;
}

/* The importer's side: the session and where the sequence stands. */
static int take_over(struct runner *r, int *ret_pos, int *ret_token) {
        FILE *f = fopen(r->o.handoff_file, "r");
        if (!f) {
                fprintf(stderr, "kvc-run: %s: %s\n", r->o.handoff_file, strerror(errno));
                return -errno;
        }
        struct kvc_handoff h;
        unsigned long long id;
        char hex[33];
        int version, n = fscanf(f, "kvc-handoff %d session %llu ticket %32s pos %d token %d", &version, &id,
                                hex, ret_pos, ret_token);
        fclose(f);
        if (n != 5 || version != 1 || strlen(hex) != 32) {
                fprintf(stderr, "kvc-run: %s is not a hand-off file\n", r->o.handoff_file);
                return -EINVAL;
        }
        h.session_id = id;
        for (size_t i = 0; i < sizeof(h.ticket); i++) {
                unsigned b;
                if (sscanf(hex + 2 * i, "%2x", &b) != 1)
                        return -EINVAL;
                h.ticket[i] = (uint8_t)b;
        }
        int e = kvc_session_import(r->client, &h, &r->session);
        if (e < 0)
                fail(r, "cannot import the session", e);
        return e;
}

/* How many prompt positions from pos go in one pass (pos < n_prompt - 1): at most `limit`, up to
 * and including the prompt's last token, never past `steps`, --stop-at or --export-at, and never
 * more than a layer of the session (NULL: in process) may hold beside what it holds; at least one. */
#define KVC_RUN_OBSERVED 8 /* SnapKV's default observation window (docs/policies.md) */

static int prompt_chunk(const struct runner *r, const struct kvc_session *s, int pos, int n_prompt, int steps,
                        int limit) {
        int n = n_prompt - pos < limit ? n_prompt - pos : limit;
        n = n < steps - pos ? n : steps - pos;
        if (r->o.stop_at > pos && n > r->o.stop_at - pos)
                n = r->o.stop_at - pos;
        if (r->o.export_at > pos && n > r->o.export_at - pos)
                n = r->o.export_at - pos;
        /* through kvcd the prompt's last KVC_RUN_OBSERVED rows go one per step, so a policy that
         * observes the prompt's last queries (SnapKV's, PyramidKV's, SCOPE's window of 8) sees 8,
         * not the last chunk's one; full never plans, so it observes nothing, and its prompt goes
         * in chunks as --local's does (one pass where the one-row tail made up to 8: 2% of a
         * 132-token run, issue 29 item 4). The output is the same either way. */
        int tail = n_prompt - KVC_RUN_OBSERVED;
        bool observed = s && strcmp(r->o.policy, "full") != 0;
        if (observed && pos >= tail)
                n = 1;
        else if (observed && pos + n > tail)
                n = tail - pos;
        if (s) { /* the fullest layer: a plan may cut one layer and leave another */
                uint32_t most = 0, L = (uint32_t)model_get_config(r->model)->n_layers;
                for (uint32_t l = 0; l < L; l++)
                        most = kvc_layer_tokens(s, l) > most ? kvc_layer_tokens(s, l) : most;
                int room = (int)kvc_session_max_tokens(s) - (int)most;
                n = n < room ? n : room;
        }
        return n > 1 ? n : 1;
}

static int generate(struct runner *r, int *ret_steps) {
        const struct model_config *mc = model_get_config(r->model);
        const int *prompt = r->prompt, n_prompt = r->n_prompt;
        char piece[512];
        int e = 0;
        int steps = r->o.steps < mc->seq_len ? r->o.steps : mc->seq_len;
        int token = prompt[0], pos = 0;
        if (r->o.import && (e = take_over(r, &pos, &token)) < 0)
                return e;
        /* a shared prefix attached: its tokens are in the cache already; only their text is printed */
        uint32_t shared = r->session && !r->o.import ? kvc_session_shared_tokens(r->session) : 0;
        bool echo = !r->o.chat; /* a chat prints the answer, not the template around the question */
        for (; pos < (int)shared && pos < n_prompt - 1; pos++) {
                size_t len = 1;
                if (!echo || text_piece(r->tok, prompt[pos], prompt[pos + 1], piece, sizeof(piece), &len) < 0)
                        len = 0;
                if ((e = emit(r, piece, len)) < 0)
                        return e;
                token = prompt[pos + 1];
        }
        const struct model_cache_ops *ops = r->ladder ? &ladder_cache_ops
                                            : r->o.local ? &plain_cache_ops
                                                         : &kvccache_ops;
        void *ctx = r->ladder ? (void *)r->ladder : r->o.local ? (void *)r->plain : (void *)r->session;

        struct model_row rows[MODEL_MAX_ROWS];
        bool ended = false; /* the model's end token, not the step limit */
        while (pos < steps) {
                float *logits;
                int next, n = 1;
                /* a prompt goes in chunks, rows of one pass; kvcd sees one step a chunk, and its
                 * plans apply between chunks */
                if (pos < n_prompt - 1)
                        n = prompt_chunk(r, r->session, pos, n_prompt, steps, r->o.prefill_chunk);
                else if (!r->decode_t0 && pos >= n_prompt) { /* --json's decode_seconds start here */
                        r->decode_t0 = seconds();
                        r->decode_cpu0 = cpu_seconds();
                        r->decode_pos0 = pos;
                }
                for (int i = 0; i < n; i++)
                        rows[i] = (struct model_row){ .token = i ? prompt[pos + i] : token,
                                                      .pos = pos + i,
                                                      .ctx = ctx,
                                                      .logits = i == n - 1 };
                if (r->imp && pos < n_prompt) /* the prompt's scores, before kvcd plans */
                        e = importance_prefill(r->imp, rows, (uint32_t)n, ops, &kvccache_store_ops, &logits);
                else
                        e = model_forward_rows(r->model, rows, (uint32_t)n, ops, &logits);
                if (e < 0) {
                        fail(r, "forward pass", e);
                        break;
                }
                for (int i = 0; i + 1 < n && e == 0; i++) { /* the chunk's inner tokens: their text */
                        size_t len = 0;
                        if (echo && text_piece(r->tok, rows[i].token, rows[i + 1].token, piece, sizeof(piece),
                                               &len) < 0)
                                len = 0;
                        e = emit(r, piece, len);
                }
                if (e < 0)
                        break;
                token = rows[n - 1].token;
                pos += n - 1;
                if (pos < n_prompt - 1)
                        next = prompt[pos + 1];
                else if ((e = sampler_sample(r->sampler, logits, &next)) < 0) {
                        bad_logits(r, pos, e);
                        break;
                }
                struct kvc_summary sum;
                if ((e = kvc_summarize(logits, (uint32_t)mc->vocab_size, &sum)) < 0) {
                        bad_logits(r, pos, e);
                        break;
                }
                if (!r->o.local) {
                        enum kvc_phase ph = pos < n_prompt - 1 ? KVC_PHASE_PREFILL : KVC_PHASE_DECODE;
                        if ((e = kvc_step(r->session, (uint64_t)pos, ph, &sum)) < 0 ||
                            (e = kvc_flush(r->client)) < 0) {
                                fail(r, "step", e);
                                break;
                        }
                }
                pos++;
                if (r->o.stop_at == pos) {
                        fflush(stdout);
                        raise(SIGSTOP); /* whoever started us continues us (SIGCONT) */
                }
                if (r->o.trace && pos % r->o.trace == 0)
                        fprintf(stderr, "step %4d  cache %4u tokens/layer  confidence %.3f\n", pos,
                                r->o.local ? (unsigned)pos : kvc_layer_tokens(r->session, 0),
                                (double)kvc_confidence(&sum));
                bool stop = pos >= n_prompt && text_is_stop(r->tok, next);
                if (stop && !r->o.no_stop) {
                        ended = true;
                        break;
                }
                size_t len = 1;
                if (stop) /* past the end: a line break, not "<s>" or "<|im_end|>" */
                        piece[0] = '\n';
                else if ((pos < n_prompt && !echo) ||
                         text_piece(r->tok, token, next, piece, sizeof(piece), &len) < 0)
                        len = 0;
                if ((e = emit(r, piece, len)) < 0)
                        break;
                token = next;
                if (r->o.export_at && pos == r->o.export_at) {
                        e = hand_off(r, pos, token);
                        break;
                }
        }
        r->cut_at = e == 0 && r->o.chat && !ended && pos >= steps ? steps : 0;
        *ret_steps = pos;
        return e;
}

/* One sequence of a batch. */
struct seq {
        int *prompt, n_prompt;
        int pos, token;
        bool done;
        struct sampler *sampler;
        struct kvc_session *session;
        struct plain_cache *plain;
        struct textbuf text;
        struct kvc_session_stats stats;
};

static int seq_emit(struct seq *q, const char *piece, size_t n) {
        return textbuf_append(&q->text, piece, n);
}

/* The prompts of a batch: --prompts FILE's lines (at most --batch of them), else --batch copies of
 * the one prompt. */
static int batch_prompts(struct runner *r, struct seq *seqs, int *ret_n) {
        int n = 0, e = 0;
        if (!r->o.prompts) {
                for (; n < r->o.batch && e == 0; n++)
                        e = encode(r, r->o.prompt, r->o.chat, &seqs[n].prompt, &seqs[n].n_prompt);
                *ret_n = n;
                return e;
        }
        FILE *f = fopen(r->o.prompts, "r");
        if (!f) {
                fprintf(stderr, "kvc-run: %s: %s\n", r->o.prompts, strerror(errno));
                return -errno;
        }
        char *line = NULL;
        size_t cap = 0;
        ssize_t len;
        int max = r->o.batch ? r->o.batch : MODEL_MAX_LOGIT_ROWS;
        bool chat = model_is_gguf(r->model);
        while (e == 0 && n < max && (len = getline(&line, &cap, f)) >= 0) {
                while (len && (line[len - 1] == '\n' || line[len - 1] == '\r'))
                        line[--len] = '\0';
                if (len == 0)
                        continue;
                e = encode(r, chat ? NULL : line, chat ? line : NULL, &seqs[n].prompt, &seqs[n].n_prompt);
                n++;
        }
        free(line);
        fclose(f);
        if (e == 0 && n == 0) {
                fprintf(stderr, "kvc-run: %s has no prompt\n", r->o.prompts);
                e = -EINVAL;
        }
        *ret_n = n;
        return e;
}

/* Decodes every sequence together: each pass takes one row of every sequence past its prompt and
 * a chunk of every prompt still being read (the rows of a pass at most MODEL_MAX_ROWS), the
 * weights are read once for all of them, and kvcd gets all their steps in one StepBatch. */
static int generate_batch(struct runner *r, struct seq *seqs, int n_seqs, int *ret_positions) {
        const struct model_config *mc = model_get_config(r->model);
        const struct model_cache_ops *ops = r->o.local ? &plain_cache_ops : &kvccache_ops;
        int steps = r->o.steps < mc->seq_len ? r->o.steps : mc->seq_len, positions = 0, e = 0;
        bool echo = !r->o.chat && !r->o.prompts;
        struct model_row rows[MODEL_MAX_ROWS];
        int first[MODEL_MAX_LOGIT_ROWS], count[MODEL_MAX_LOGIT_ROWS];
        char piece[512];
        for (int i = 0; i < n_seqs; i++)
                seqs[i].token = seqs[i].prompt[0];
        for (;;) {
                int active = 0, n = 0;
                for (int i = 0; i < n_seqs; i++)
                        active += !seqs[i].done;
                if (active == 0)
                        break;
                int share = MODEL_MAX_ROWS / active; /* rows a prompt may take this pass */
                for (int i = 0; i < n_seqs; i++) {
                        struct seq *q = &seqs[i];
                        count[i] = 0;
                        if (q->done)
                                continue;
                        int k = 1;
                        if (q->pos < q->n_prompt - 1)
                                k = prompt_chunk(r, q->session, q->pos, q->n_prompt, steps,
                                                 share < r->o.prefill_chunk ? share : r->o.prefill_chunk);
                        first[i] = n;
                        count[i] = k;
                        for (int j = 0; j < k; j++)
                                rows[n++] = (struct model_row){ .token = j ? q->prompt[q->pos + j] : q->token,
                                                                .pos = q->pos + j,
                                                                .ctx = r->o.local ? (void *)q->plain
                                                                                  : (void *)q->session,
                                                                .logits = j == k - 1 };
                }
                float *logits;
                if ((e = model_forward_rows(r->model, rows, (uint32_t)n, ops, &logits)) < 0) {
                        fail(r, "forward pass", e);
                        return e;
                }
                positions += n;
                int l = 0; /* the logits of each sequence's last row, in row order */
                for (int i = 0; i < n_seqs && e == 0; i++) {
                        struct seq *q = &seqs[i];
                        if (!count[i])
                                continue;
                        const float *lg = logits + (size_t)l++ * (size_t)mc->vocab_size;
                        for (int j = 0; j + 1 < count[i] && e == 0; j++) {
                                size_t len = 0;
                                if (echo &&
                                    text_piece(r->tok, rows[first[i] + j].token, rows[first[i] + j + 1].token,
                                               piece, sizeof(piece), &len) < 0)
                                        len = 0;
                                e = seq_emit(q, piece, len);
                        }
                        q->token = rows[first[i] + count[i] - 1].token;
                        q->pos += count[i] - 1;
                        int next;
                        if (q->pos < q->n_prompt - 1)
                                next = q->prompt[q->pos + 1];
                        else if ((e = sampler_sample(q->sampler, lg, &next)) < 0) {
                                bad_logits(r, q->pos, e);
                                return e;
                        }
                        struct kvc_summary sum;
                        if ((e = kvc_summarize(lg, (uint32_t)mc->vocab_size, &sum)) < 0) {
                                bad_logits(r, q->pos, e);
                                return e;
                        }
                        if (q->session) {
                                enum kvc_phase ph =
                                        q->pos < q->n_prompt - 1 ? KVC_PHASE_PREFILL : KVC_PHASE_DECODE;
                                if ((e = kvc_step(q->session, (uint64_t)q->pos, ph, &sum)) < 0)
                                        break;
                        }
                        q->pos++;
                        bool stop = q->pos >= q->n_prompt && text_is_stop(r->tok, next);
                        size_t len = 0;
                        if (!stop && (q->pos >= q->n_prompt || echo) &&
                            text_piece(r->tok, q->token, next, piece, sizeof(piece), &len) < 0)
                                len = 0;
                        if (e == 0)
                                e = seq_emit(q, piece, len);
                        q->token = next;
                        q->done = (stop && !r->o.no_stop) || q->pos >= steps;
                }
                if (e < 0) {
                        fail(r, "step", e);
                        return e;
                }
                if (!r->o.local && (e = kvc_flush(r->client)) < 0) { /* one StepBatch for all */
                        fail(r, "step", e);
                        return e;
                }
        }
        *ret_positions = positions;
        return 0;
}

static void local_cache_failed(const struct model_config *mc, int err) {
        fprintf(stderr, "kvc-run: cannot allocate the in-process cache (--local) of %d positions: %s\n",
                mc->seq_len, strerror(-err));
}

/* --batch and --prompts: the sequences, their sessions or caches, the run and its report. */
static int run_batch(struct runner *r) {
        const struct model_config *mc = model_get_config(r->model);
        struct seq seqs[MODEL_MAX_LOGIT_ROWS] = { 0 };
        int n = 0, positions = 0;
        int e = batch_prompts(r, seqs, &n);
        if (e == 0 && !r->o.local)
                e = connect_kvcd(r);
        for (int i = 0; i < n && e == 0; i++) {
                e = sampler_new(mc->vocab_size, r->o.temperature, r->o.seed + (unsigned long long)i,
                                &seqs[i].sampler);
                if (e < 0)
                        fprintf(stderr, "kvc-run: no memory for a sampler: %s\n", strerror(-e));
                else if (r->o.local && (e = plain_cache_new(mc, mc->seq_len, &seqs[i].plain)) < 0)
                        local_cache_failed(mc, e);
                else if (!r->o.local)
                        e = open_one(r, seqs[i].prompt, seqs[i].n_prompt, &seqs[i].session);
        }
        double t0 = seconds(), dt = 0, cpu0 = cpu_seconds(), cpu = 0;
        if (e == 0) {
                e = generate_batch(r, seqs, n, &positions);
                dt = seconds() - t0;
                cpu = cpu_seconds() - cpu0;
        }
        for (int i = 0; i < n; i++) {
                if (seqs[i].session) {
                        int ce = kvc_session_close(seqs[i].session, &seqs[i].stats);
                        if (ce < 0 && e == 0) {
                                fail(r, "closing a session", ce);
                                e = ce;
                        }
                }
        }
        if (e == 0 && r->o.json) {
                printf("{\"policy\":\"%s\",\"budget\":%u,\"batch\":%d,\"positions\":%d,\"seconds\":%.6f,"
                       "\"cpu_seconds\":%.6f,\"tokens_per_second\":%.1f,\"local\":%s,\"sequences\":[",
                       r->o.local ? "local" : r->o.policy, r->o.budget, n, positions, dt, cpu,
                       positions / (dt > 0 ? dt : 1e-9), r->o.local ? "true" : "false");
                for (int i = 0; i < n; i++) {
                        printf("%s{\"positions\":%d,\"text\":\"", i ? "," : "", seqs[i].pos);
                        json_escape(stdout, seqs[i].text.s ? seqs[i].text.s : "", seqs[i].text.len);
                        printf("\"");
                        if (!r->o.local)
                                printf(",\"kvcd\":{\"steps\":%llu,\"plans_applied\":%llu,\"peak_tokens\":%u,"
                                       "\"peak_bytes\":%llu}",
                                       (unsigned long long)seqs[i].stats.steps,
                                       (unsigned long long)seqs[i].stats.plans_applied,
                                       seqs[i].stats.peak_tokens,
                                       (unsigned long long)seqs[i].stats.peak_bytes);
                        printf("}");
                }
                printf("]}\n");
        } else if (e == 0) {
                for (int i = 0; i < n; i++)
                        printf("== sequence %d\n%s\n", i, seqs[i].text.s ? seqs[i].text.s : "");
        }
        for (int i = 0; i < n; i++) {
                plain_cache_free(seqs[i].plain);
                sampler_free(seqs[i].sampler);
                free(seqs[i].prompt);
                free(seqs[i].text.s);
        }
        return e;
}

int main(int argc, char **argv) {
        struct runner r = { .o = { .model = DEFAULT_MODEL,
                                   .tokenizer = DEFAULT_TOKENIZER,
                                   .policy = "full",
                                   .steps = 256,
                                   .seed = 42,
                                   .dtype = KVC_DTYPE_F32 } };
        int e, steps = 0, rc = 1;

        if (parse_args(argc, argv, &r.o) < 0) {
                usage(stderr);
                return 2;
        }
        char why[512] = "";
        struct model_options mo = { .threads = r.o.threads, .exact = r.o.exact };
        if ((e = model_open(r.o.model, &mo, &r.model, why, sizeof(why))) < 0) {
                fprintf(stderr, "kvc-run: cannot load the model %s: %s%s%s\n", r.o.model, strerror(-e),
                        why[0] ? ": " : "", why);
                if (e == -ENOENT)
                        fprintf(stderr,
                                "kvc-run: `make model` fetches SmolLM2 into the model cache (README)\n");
                return 1;
        }
        const struct model_config *mc = model_get_config(r.model);
        if (!r.o.prefill_chunk) /* llama2.c: one position a step, as kvcd has always seen it */
                r.o.prefill_chunk = model_is_gguf(r.model) ? 256 : 1;
        e = model_is_gguf(r.model) ? text_open_gguf(r.o.model, &r.tok, why, sizeof(why))
                                   : text_open_llama2c(r.o.tokenizer, mc->vocab_size, &r.tok);
        if (e < 0) {
                fprintf(stderr, "kvc-run: cannot load the tokenizer of %s: %s%s%s\n",
                        model_is_gguf(r.model) ? r.o.model : r.o.tokenizer, strerror(-e), why[0] ? ": " : "",
                        why);
                goto out;
        }
        if ((r.o.batch > 1 || r.o.prompts) && !model_is_gguf(r.model)) {
                fprintf(stderr, "kvc-run: --batch and --prompts need a GGUF model\n");
                goto out;
        }
        if (r.o.batch > 1 || r.o.prompts) {
                if (r.o.share && (e = model_id_of(r.o.model, r.model_id, sizeof(r.model_id))) < 0) {
                        fprintf(stderr, "kvc-run: %s: %s\n", r.o.model, strerror(-e));
                        goto out;
                }
                rc = run_batch(&r) < 0;
                goto out;
        }
        if ((e = sampler_new(mc->vocab_size, r.o.temperature, r.o.seed, &r.sampler)) < 0) {
                fprintf(stderr, "kvc-run: no memory for a sampler: %s\n", strerror(-e));
                goto out;
        }
        if ((e = encode(&r, r.o.prompt, r.o.chat, &r.prompt, &r.n_prompt)) < 0)
                goto out;
        if (r.o.share && (e = model_id_of(r.o.model, r.model_id, sizeof(r.model_id))) < 0) {
                fprintf(stderr, "kvc-run: %s: %s\n", r.o.model, strerror(-e));
                goto out;
        }
        if (r.o.local && r.o.tier) {
                struct ladder_cache_config lc = {
                        .dtype = r.o.dtype == KVC_DTYPE_F16    ? BLOCK_DTYPE_F16
                                 : r.o.dtype == KVC_DTYPE_BF16 ? BLOCK_DTYPE_BF16
                                                               : BLOCK_DTYPE_F32,
                        .tier = r.o.tier,
                        .window = r.o.tier_window ? r.o.tier_window : 128,
                        .seed = 0x6b7663646c616464ull,
                };
                if ((e = ladder_cache_new(mc, mc->seq_len, &lc, &r.ladder)) < 0)
                        fprintf(stderr, "kvc-run: --tier %s: %s\n", r.o.tier,
                                e == -EINVAL ? "not a tier of the ladder (q8, q4, q3, q2) for this model's heads"
                                             : strerror(-e));
        } else if (r.o.local && (e = plain_cache_new(mc, mc->seq_len, &r.plain)) < 0)
                local_cache_failed(mc, e);
        else if (!r.o.local)
                e = open_session(&r);
        if (e == 0 && r.o.importance != IMPORTANCE_KIND_ATTENTION) {
                if ((e = importance_new(r.model, r.tok, r.o.importance, r.o.threads, &r.imp)) < 0)
                        fprintf(stderr, "kvc-run: --importance: %s\n", strerror(-e));
                else if ((uint32_t)r.o.prefill_chunk > importance_max_rows(r.imp))
                        r.o.prefill_chunk = (int)importance_max_rows(r.imp);
        }
        if (e < 0)
                goto out;

        double t0 = seconds(), cpu0 = cpu_seconds();
        e = generate(&r, &steps);
        double dt = seconds() - t0, cpu_end = cpu_seconds();

        struct kvc_session_stats st = { 0 };
        if (r.session) {
                int ce = kvc_session_close(r.session, &st);
                r.session = NULL;
                if (ce < 0 && e == 0) {
                        fail(&r, "closing the session", ce);
                        e = ce;
                }
        }
        if (e < 0)
                goto out;
        if (r.o.trace && !r.o.local)
                fprintf(stderr,
                        "kvcd accounting: %llu steps, %llu plans applied, peak %u tokens and %u blocks per "
                        "layer, "
                        "peak %llu bytes\n",
                        (unsigned long long)st.steps, (unsigned long long)st.plans_applied, st.peak_tokens,
                        st.peak_layer_blocks, (unsigned long long)st.peak_bytes);
        if (r.o.json) {
                printf("{\"policy\":\"%s\",\"budget\":%u,\"steps\":%d,\"seconds\":%.6f,\"cpu_seconds\":%.6f,"
                       "\"tokens_per_second\":%.1f,"
                       "\"local\":%s,\"text\":\"",
                       r.o.local ? "local" : r.o.policy, r.o.budget, steps, dt, cpu_end - cpu0,
                       steps / (dt > 0 ? dt : 1e-9), r.o.local ? "true" : "false");
                json_escape(stdout, r.text.s ? r.text.s : "", r.text.len);
                printf("\"");
                if (!r.o.local)
                        printf(",\"kvcd\":{\"steps\":%llu,\"plans\":%llu,\"plans_applied\":%llu,\"peak_"
                               "tokens\":%u,"
                               "\"peak_layer_blocks\":%u,\"peak_bytes\":%llu}",
                               (unsigned long long)st.steps, (unsigned long long)st.plans,
                               (unsigned long long)st.plans_applied, st.peak_tokens, st.peak_layer_blocks,
                               (unsigned long long)st.peak_bytes);
                if (r.ladder)
                        printf(",\"tier\":\"%s\",\"tier_window\":%u,\"bytes\":%llu,\"peak_bytes\":%llu,"
                               "\"full_bytes\":%llu",
                               r.o.tier, r.o.tier_window ? r.o.tier_window : 128,
                               (unsigned long long)ladder_cache_bytes(r.ladder),
                               (unsigned long long)ladder_cache_peak_bytes(r.ladder),
                               (unsigned long long)ladder_cache_full_bytes(r.ladder));
                if (r.imp)
                        printf(",\"importance\":\"%s\",\"importance_seconds\":%.6f",
                               importance_name(r.o.importance), importance_seconds(r.imp));
                /* the one-row passes after the prompt alone: decode speed at the prompt's context */
                printf(",\"prompt_tokens\":%d", r.n_prompt);
                if (r.decode_t0)
                        printf(",\"decode_tokens\":%d,\"decode_seconds\":%.6f,\"decode_cpu_seconds\":%.6f",
                               steps - r.decode_pos0, t0 + dt - r.decode_t0, cpu_end - r.decode_cpu0);
                printf("}\n");
        } else if (!r.o.export_at || steps < r.o.export_at) {
                printf("\n"); /* a story handed off goes on in the importer's output */
        }
        if (r.cut_at) { /* after the answer's line, so a terminal shows the two apart */
                fflush(stdout);
                fprintf(stderr,
                        "kvc-run: the answer was cut at %s %d positions, before the model ended it: %d were "
                        "the chat's prompt, %d generated (-n counts the prompt)\n",
                        r.cut_at == r.o.steps ? "-n" : "the model's context of", r.cut_at, r.n_prompt,
                        r.cut_at >= r.n_prompt ? r.cut_at - r.n_prompt + 1 : 0);
        }
        rc = 0;
out:
        kvc_disconnect(r.client);
        plain_cache_free(r.plain);
        ladder_cache_free(r.ladder);
        importance_free(r.imp);
        sampler_free(r.sampler);
        text_free(r.tok);
        model_free(r.model);
        free(r.text.s);
        free(r.prompt);
        return rc;
}
