/* kvc-eval: the quality lab's command line. Parses the options, makes the output directory
 * (--out, default a new build/kvc-eval/DATE-PID) and runs one task:
 *   ppl (the default)  the story suite: every policy and budget on stories260K through kvcd,
 *                      perplexity, KL, name recall and bytes per configuration (eval/suite.h)
 *   niah               needle in a haystack on a GGUF chat model (eval/niah.h)
 *   longdoc            long documents: perplexity and KL against the full cache (eval/longdoc.h)
 *   longgen            long generation, SCOPE's setting (eval/longgen.h)
 *   mechanism          confidence and attention against what a window costs (eval/mechanism.h)
 *   tiers              each tier of the precision ladder alone, in process (eval/tiers.h)
 * The GGUF tasks take the lab's options as struct niah_options, with their defaults (and --quick's)
 * set here; docs/quality.md describes every task.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "eval/longdoc.h"
#include "eval/longgen.h"
#include "eval/mechanism.h"
#include "eval/niah.h"
#include "eval/suite.h"
#include "eval/tiers.h"
#include "kvc.h"

#define SHARED "../shared"

/* mkdir -p */
static int make_dirs(const char *path) {
        char buf[512];
        snprintf(buf, sizeof(buf), "%s", path);
        for (char *p = buf + 1; *p; p++) {
                if (*p != '/')
                        continue;
                *p = '\0';
                if (mkdir(buf, 0755) < 0 && errno != EEXIST)
                        return -errno;
                *p = '/';
        }
        return mkdir(buf, 0755) < 0 && errno != EEXIST ? -errno : 0;
}

static void usage(FILE *f) {
        fprintf(f, "Usage: kvc-eval [OPTIONS]\n"
                   "Measures every policy on the real model through the real kvcd.\n\n"
                   "  --socket PATH          kvcd's runtime directory or kvcd.sock\n"
                   "  --model FILE           (default " SHARED "/models/stories260K/stories260K.bin)\n"
                   "  --tokenizer FILE       (default " SHARED "/models/stories260K/tok512.bin)\n"
                   "  --data FILE            (default " SHARED "/data/tinystories/validation-sample.txt)\n"
                   "  --sequences N          stories to run (default 64)\n"
                   "  --split test|tune      the test split (stories 200 on; default) or the tuning split\n"
                   "                         (stories 0-199): tune on one, report on the other\n"
                   "  --first N              skip the first N stories of the split (default 0)\n"
                   "  --max-tokens N         tokens per story at most (default: the model's context)\n"
                   "  --prompt-tokens N      the first N tokens of a story are its prompt (default 64)\n"
                   "  --config SPEC          [label=]policy:budget[:key=value,...] (repeatable; default: the "
                   "suite)\n"
                   "  --corr LABEL           the configuration whose per-step KL is paired with the\n"
                   "                         full cache's confidence (default window-32)\n"
                   "  --dtype f32|f16        storage of keys and values (default f32)\n"
                   "  --jobs N               worker processes (default 2)\n"
                   "  --out DIR              write results.{md,csv,jsonl} and confidence_kl.csv into DIR\n"
                   "                         (default: a new build/kvc-eval/DATE-PID); files are written\n"
                   "                         as NAME.partial and renamed only when the run completes\n"
                   "  --quick                3 stories, 4 configurations: checks the harness itself\n"
                   "                         (with --task niah: one 192-token haystack, 3 needles, the full\n"
                   "                         cache, window and conf at half of it)\n"
                   "  --task ppl|niah|longdoc|longgen|mechanism|tiers  perplexity on stories260K (default),\n"
                   "                         needle in a haystack, long documents (4096 tokens, ppl/KL/top-1\n"
                   "                         against the full cache), long generation (SCOPE's setting), the\n"
                   "                         mechanism (confidence and attention against a window's KL), or\n"
                   "                         each tier of the precision ladder alone (in process, no kvcd:\n"
                   "                         --documents at --lengths, and --documents needles at 1K-4K), on a\n"
                   "                         GGUF chat model (docs/quality.md)\n"
                   "  --lengths L,...        niah: haystack tokens (default 1024,2048,4096)\n"
                   "  --needles N            niah: needles per length (default 10)\n"
                   "  --documents N          longdoc, mechanism: documents per length (default 10; quick 2)\n"
                   "  --prompts N            longgen: prompts per length (default 10; quick 2)\n"
                   "  --gen-tokens N         longgen: answer tokens (default 1024; quick 48)\n"
                   "  --fractions F,...      niah: budgets as fractions of the haystack (default 0.25,0.5)\n"
                   "  --chunk N              niah: prefill rows per configuration and pass (default 64)\n"
                   "  --threads N            niah: the engine's threads (default: every CPU)\n"
                   "  --seed N               niah: needles and haystacks (default fixed)\n"
                   "  --dump-tokens          tiers, niah: write the token ids of its documents and needles\n"
                   "                         (tiers_tokens.txt; niah_tokens.txt and niah_questions.txt) and\n"
                   "                         run nothing (bench/tiers-peers.sh, bench/niah-peers.sh)\n"
                   "  --suite main|ladder    niah: the families (default main; ladder: window and\n"
                   "                         conf-int8 at token budgets, the ladder at byte budgets ranked\n"
                   "                         by attention, surprisal and reconstruction)\n"
                   "  --families A,B,...     niah: only these of the suite's families (their labels)\n"
                   "  -h, --help, -V, --version\n");
}

/* What the SmolLM2 tasks (niah, longdoc) take from the lab's own options: the model is --model,
 * else $KVC_SMOLLM2. */
static void niah_options_from(struct niah_options *no, const struct eval *e, bool model_given) {
        const char *env = getenv("KVC_SMOLLM2");
        no->socket = e->socket;
        no->model_path = model_given ? e->model_path : env ? env : NULL;
        no->data_path = e->data_path;
        no->out_dir = e->out_dir;
        no->quick = e->quick;
}

/* The long-generation and mechanism tasks' defaults (docs/quality.md), checked, and the run. */
static int smol_long_task(const char *task, struct niah_options *no, const struct eval *e, bool model_given,
                          uint32_t gen_tokens) {
        bool longgen = strcmp(task, "longgen") == 0;
        niah_options_from(no, e, model_given);
        if (!no->n_lengths) {
                no->lengths[0] = longgen ? (e->quick ? 64 : 256) : (e->quick ? 256 : 2048);
                no->n_lengths = 1;
        }
        if (!no->n_fractions) {
                no->fractions[0] = longgen ? (e->quick ? 0.5 : 0.35) : (e->quick ? 0.125 : 0.0625);
                no->fractions[1] = longgen ? 0.5 : 0.25;
                no->n_fractions = e->quick ? 1 : 2;
        }
        if (no->needles == 10 && e->quick)
                no->needles = 2;
        if (!gen_tokens)
                gen_tokens = e->quick ? 48 : 1024;
        if (!no->model_path || no->needles < 2 || no->needles > 1000 || no->chunk < 1) {
                fprintf(stderr,
                        "kvc-eval: --task %s needs --model (a GGUF; or KVC_SMOLLM2), 2..1000 --%s and a "
                        "--chunk of at "
                        "least 1\n",
                        task, longgen ? "prompts" : "documents");
                return 2;
        }
        return (longgen ? longgen_run(no, gen_tokens) : mechanism_run(no)) < 0 ? 1 : 0;
}

int main(int argc, char **argv) {
        static const struct option opts[] = {
                { "socket", required_argument, NULL, 'S' },
                { "model", required_argument, NULL, 'm' },
                { "tokenizer", required_argument, NULL, 'k' },
                { "data", required_argument, NULL, 'D' },
                { "sequences", required_argument, NULL, 'n' },
                { "first", required_argument, NULL, 'f' },
                { "max-tokens", required_argument, NULL, 'x' },
                { "prompt-tokens", required_argument, NULL, 'p' },
                { "config", required_argument, NULL, 'c' },
                { "corr", required_argument, NULL, 'C' },
                { "dtype", required_argument, NULL, 'd' },
                { "jobs", required_argument, NULL, 'j' },
                { "out", required_argument, NULL, 'o' },
                { "quick", no_argument, NULL, 'q' },
                { "split", required_argument, NULL, 's' },
                { "task", required_argument, NULL, 't' },
                { "lengths", required_argument, NULL, 'L' },
                { "needles", required_argument, NULL, 'N' },
                { "documents", required_argument, NULL, 'N' },
                { "prompts", required_argument, NULL, 'N' },
                { "gen-tokens", required_argument, NULL, 'G' },
                { "fractions", required_argument, NULL, 'F' },
                { "chunk", required_argument, NULL, 'K' },
                { "threads", required_argument, NULL, 'T' },
                { "seed", required_argument, NULL, 'R' },
                { "dump-tokens", no_argument, NULL, 'Y' },
                { "suite", required_argument, NULL, 'U' },
                { "families", required_argument, NULL, 'B' },
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, 'V' },
                {},
        };
        struct eval e = { .model_path = SHARED "/models/stories260K/stories260K.bin",
                          .tok_path = SHARED "/models/stories260K/tok512.bin",
                          .data_path = SHARED "/data/tinystories/validation-sample.txt",
                          .sequences = 64,
                          .prompt_tokens = 64,
                          .jobs = 2,
                          .dtype = KVC_DTYPE_F32,
                          .corr_label = "window-32",
                          .split = "test" };
        struct niah_options no = { .needles = 10, .chunk = 64, .threads = 0, .seed = 0 };
        const char *task = "ppl";
        uint32_t gen_tokens = 0;
        bool model_given = false;
        int o;
        while ((o = getopt_long(argc, argv, "hV", opts, NULL)) != -1) {
                switch (o) {
                case 'S': e.socket = optarg; break;
                case 'm':
                        e.model_path = optarg;
                        model_given = true;
                        break;
                case 't': task = optarg; break;
                case 'L':
                        no.n_lengths = 0;
                        for (char *p = optarg; *p && no.n_lengths < NIAH_MAX_LENGTHS; p += *p == ',')
                                no.lengths[no.n_lengths++] = (uint32_t)strtoul(p, &p, 10);
                        break;
                case 'F':
                        no.n_fractions = 0;
                        for (char *p = optarg; *p && no.n_fractions < NIAH_MAX_FRACTIONS; p += *p == ',')
                                no.fractions[no.n_fractions++] = strtod(p, &p);
                        break;
                case 'N': no.needles = (uint32_t)atoi(optarg); break;
                case 'G': gen_tokens = (uint32_t)atoi(optarg); break;
                case 'K': no.chunk = (uint32_t)atoi(optarg); break;
                case 'T': no.threads = (uint32_t)atoi(optarg); break;
                case 'R': no.seed = strtoull(optarg, NULL, 0); break;
                case 'Y': no.dump_tokens = true; break;
                case 'B': no.families = optarg; break;
                case 'U':
                        if (strcmp(optarg, "main") != 0 && strcmp(optarg, "ladder") != 0) {
                                fprintf(stderr, "kvc-eval: --suite main|ladder\n");
                                return 2;
                        }
                        no.suite = optarg;
                        break;
                case 'k': e.tok_path = optarg; break;
                case 'D': e.data_path = optarg; break;
                case 'n': e.sequences = (uint32_t)atoi(optarg); break;
                case 'f': e.first = (uint32_t)atoi(optarg); break;
                case 'x': e.max_tokens = (uint32_t)atoi(optarg); break;
                case 'p': e.prompt_tokens = (uint32_t)atoi(optarg); break;
                case 'c':
                        if (suite_add_config(&e, optarg) < 0)
                                return 2;
                        break;
                case 'C': e.corr_label = optarg; break;
                case 'd':
                        if (strcmp(optarg, "f16") == 0)
                                e.dtype = KVC_DTYPE_F16;
                        else if (strcmp(optarg, "f32") != 0)
                                return 2;
                        break;
                case 'j': e.jobs = (uint32_t)atoi(optarg); break;
                case 'o': e.out_dir = optarg; break;
                case 'q': e.quick = true; break;
                case 's':
                        if (strcmp(optarg, "test") != 0 && strcmp(optarg, "tune") != 0) {
                                fprintf(stderr, "kvc-eval: --split is test or tune\n");
                                return 2;
                        }
                        e.split = optarg;
                        break;
                case 'h': usage(stdout); return 0;
                case 'V': printf("kvc-eval %s\n", KVC_VERSION); return 0;
                default: usage(stderr); return 2;
                }
        }
        if (optind != argc || e.jobs == 0 || e.jobs > 64) {
                usage(stderr);
                return 2;
        }
        static const char *const tasks[] = { "ppl", "niah", "longdoc", "longgen", "mechanism", "tiers" };
        bool known = false;
        for (size_t i = 0; i < sizeof(tasks) / sizeof(tasks[0]); i++)
                known |= strcmp(task, tasks[i]) == 0;
        if (!known) {
                fprintf(stderr, "kvc-eval: --task is ppl, niah, longdoc, longgen, mechanism or tiers\n");
                return 2;
        }
        if (e.quick && strcmp(task, "ppl") == 0) {
                e.sequences = 3;
                e.max_tokens = e.max_tokens ? e.max_tokens : 200;
        }
        bool tune = strcmp(e.split, "tune") == 0;
        e.split_first = tune ? 0 : TUNE_STORIES;
        e.split_end = tune ? TUNE_STORIES : UINT32_MAX;
        if (e.sequences < 2 || (tune && e.first + e.sequences > TUNE_STORIES)) {
                fprintf(stderr,
                        "kvc-eval: --sequences must be at least 2 (intervals) and within the split\n");
                return 2;
        }
        char default_out[256];
        if (!e.out_dir) {
                time_t now = time(NULL);
                struct tm tm;
                gmtime_r(&now, &tm);
                snprintf(default_out, sizeof(default_out), "build/kvc-eval/%04d%02d%02d-%02d%02d%02d-%d",
                         tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                         (int)getpid());
                e.out_dir = default_out;
        }
        if (make_dirs(e.out_dir) < 0) {
                fprintf(stderr, "kvc-eval: cannot make %s: %s\n", e.out_dir, strerror(errno));
                return 1;
        }
        if (strcmp(task, "longgen") == 0 || strcmp(task, "mechanism") == 0)
                return smol_long_task(task, &no, &e, model_given, gen_tokens);
        if (strcmp(task, "tiers") == 0) {
                niah_options_from(&no, &e, model_given);
                if (no.needles == 10 && e.quick)
                        no.needles = 2;
                if (!no.model_path || no.needles < 2 || no.needles > 1000 || no.chunk < 1) {
                        fprintf(stderr, "kvc-eval: --task tiers needs --model (a GGUF; or KVC_SMOLLM2), 2..1000 "
                                        "--documents and a --chunk of at least 1\n");
                        return 2;
                }
                return tiers_run(&no) < 0 ? 1 : 0;
        }
        if (strcmp(task, "longdoc") == 0) {
                niah_options_from(&no, &e, model_given);
                if (!no.n_lengths) {
                        no.lengths[0] = e.quick ? 256 : 4096;
                        no.n_lengths = 1;
                }
                if (!no.n_fractions) {
                        no.fractions[0] = 0.25;
                        no.fractions[1] = 0.5;
                        no.n_fractions = 2;
                }
                if (no.needles == 10 && e.quick)
                        no.needles = 2;
                if (!no.model_path || no.needles < 2 || no.needles > 1000 || no.chunk < 1) {
                        fprintf(stderr,
                                "kvc-eval: --task longdoc needs --model (a GGUF; or KVC_SMOLLM2), 2..1000 "
                                "--documents and a --chunk of at least 1\n");
                        return 2;
                }
                return longdoc_run(&no) < 0 ? 1 : 0;
        }
        if (strcmp(task, "niah") == 0) {
                niah_options_from(&no, &e, model_given);
                if (!no.n_lengths) {
                        no.lengths[0] = e.quick ? 192 : 1024;
                        no.lengths[1] = 2048;
                        no.lengths[2] = 4096;
                        no.n_lengths = e.quick ? 1 : 3;
                }
                if (!no.n_fractions) {
                        no.fractions[0] = e.quick ? 0.5 : 0.25;
                        no.fractions[1] = 0.5;
                        no.n_fractions = e.quick ? 1 : 2;
                }
                if (e.quick)
                        no.needles = no.needles == 10 ? 3 : no.needles;
                if (!no.model_path || no.needles < 1 || no.needles > 1000 || no.chunk < 1) {
                        fprintf(stderr,
                                "kvc-eval: --task niah needs --model (a GGUF; or KVC_SMOLLM2), 1..1000 "
                                "--needles and a --chunk of at least 1\n");
                        return 2;
                }
                return niah_run(&no) < 0 ? 1 : 0;
        }
        return suite_run(&e);
}
