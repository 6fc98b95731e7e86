/* bench-select: plan building's selection against a full sort and against PyTorch's topk
 * (issue 7, item 2).
 *
 * The input is what a per-head policy (h2o, pyramid) selects over when it builds a plan:
 * layers x heads rows of n token scores each; every row gets its own keep-set of k = n * keep
 * indices, ascending (the plan buffer's form). Three ways, on the same scores:
 *
 *   radix   select_topk() (daemon/policy/select.c), what kvcd runs
 *   qsort   the indices sorted by score (descending, ties to the larger index: select_topk's
 *           contract), the first k marked and read back in ascending order
 *   torch   torch.topk(x, k, dim=-1, sorted=False) on the rows as one tensor, one thread (kvcd has one); and
 *           topk followed by sorting the indices, which is what a plan needs. Run by
 *           bench/topk.py under python3 on a copy of the scores; "skipped: no torch" when
 *           python3 cannot import torch.
 *
 * Each figure is the median of 5 measurements, each of at least --min-ms milliseconds of
 * repetitions, in nanoseconds per token-score (rows * n scores). The radix and qsort results are
 * compared: they must be the same keep-sets.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "policy/policy.h"

#define MEASUREMENTS 5

struct opts {
        uint32_t layers, heads;
        double keep;
        double min_ms;
        const char *python, *script;
        uint32_t sizes[16];
        int n_sizes;
        bool json;
};

static const float *qsort_score; /* qsort has no context argument */

static int by_score_desc(const void *a, const void *b) {
        uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
        float x = qsort_score[i], y = qsort_score[j];
        if (x != y)
                return x > y ? -1 : 1;
        return i > j ? -1 : (i < j); /* ties: the larger index first */
}

/* The baseline: a full sort of the indices, then the top k read back ascending. */
static void sort_topk(const float *score, uint32_t n, uint32_t k, uint32_t *out, uint32_t *idx,
                      uint8_t *mark) {
        for (uint32_t i = 0; i < n; i++)
                idx[i] = i;
        qsort_score = score;
        qsort(idx, n, sizeof(*idx), by_score_desc);
        memset(mark, 0, n);
        for (uint32_t i = 0; i < k; i++)
                mark[idx[i]] = 1;
        for (uint32_t i = 0, m = 0; i < n; i++)
                if (mark[i])
                        out[m++] = i;
}

struct input {
        uint32_t rows, n, k;
        float *score;
        uint32_t *out, *scratch;
        uint8_t *mark;
};

static void run_radix(struct input *in) {
        for (uint32_t r = 0; r < in->rows; r++)
                select_topk(in->score + (size_t)r * in->n, in->n, in->k, in->out + (size_t)r * in->k,
                            in->scratch);
}

static void run_qsort(struct input *in) {
        for (uint32_t r = 0; r < in->rows; r++)
                sort_topk(in->score + (size_t)r * in->n, in->n, in->k, in->out + (size_t)r * in->k,
                          in->scratch, in->mark);
}

/* The median over MEASUREMENTS of ns per score, each measurement repeating fn for min_ms. */
static double measure(void (*fn)(struct input *), struct input *in, double min_ms) {
        double v[MEASUREMENTS];
        fn(in); /* warm: page faults, caches */
        for (int m = 0; m < MEASUREMENTS; m++) {
                uint64_t t0 = bench_now_ns(), t;
                uint64_t reps = 0;
                do {
                        fn(in);
                        reps++;
                        t = bench_now_ns();
                } while ((double)(t - t0) < min_ms * 1e6);
                v[m] = (double)(t - t0) / (double)reps / ((double)in->rows * in->n);
        }
        return bench_quantile(v, MEASUREMENTS, 0.5);
}

/* Runs the torch script on the scores (written to a file); its two figures, or false with the
 * reason in why. */
static bool run_torch(const struct opts *o, const struct input *in, double *ret_topk, double *ret_sorted,
                      char *why, size_t why_len) {
        char dir[128], path[160], cmd[1024], line[256];
        if (bench_tmpdir(dir, sizeof(dir), "select") < 0) {
                snprintf(why, why_len, "skipped: no temporary directory");
                return false;
        }
        snprintf(path, sizeof(path), "%s/scores.f32", dir);
        FILE *f = fopen(path, "wb");
        bool ok = f &&
                  fwrite(in->score, sizeof(float), (size_t)in->rows * in->n, f) == (size_t)in->rows * in->n;
        if (f)
                fclose(f);
        if (!ok) {
                bench_rmtree(dir);
                snprintf(why, why_len, "skipped: cannot write the scores");
                return false;
        }
        snprintf(cmd, sizeof(cmd), "'%s' '%s' '%s' %u %u %u %.0f 2>&1", o->python, o->script, path, in->rows,
                 in->n, in->k, o->min_ms);
        FILE *p = popen(cmd, "r");
        ok = false;
        snprintf(why, why_len, "skipped: %s did not answer", o->python);
        while (p && fgets(line, sizeof(line), p)) {
                line[strcspn(line, "\n")] = '\0';
                if (sscanf(line, "torch %lf %lf", ret_topk, ret_sorted) == 2)
                        ok = true;
                else if (strncmp(line, "skipped", 7) == 0)
                        snprintf(why, why_len, "%s", line);
        }
        if (p)
                pclose(p);
        bench_rmtree(dir);
        return ok;
}

static int parse_sizes(const char *s, struct opts *o) {
        o->n_sizes = 0;
        for (const char *p = s; *p;) {
                char *end;
                unsigned long v = strtoul(p, &end, 10);
                if (end == p || o->n_sizes >= 16)
                        return -EINVAL;
                if (*end == 'K' || *end == 'k')
                        v <<= 10, end++;
                if (v < 16 || v > (1u << 24))
                        return -EINVAL;
                o->sizes[o->n_sizes++] = (uint32_t)v;
                p = *end == ',' ? end + 1 : end;
                if (*end && *end != ',')
                        return -EINVAL;
        }
        return o->n_sizes ? 0 : -EINVAL;
}

static void usage(FILE *f) {
        fprintf(f,
                "Usage: bench-select [--layers N] [--heads N] [--keep F] [--sizes 1K,4K,...] [--min-ms MS]\n"
                "                    [--python PATH] [--torch-script PATH] [--json]\n"
                "Selection of the top k of layers x heads rows of n scores: radix select vs qsort vs "
                "torch.topk.\n");
}

int main(int argc, char **argv) {
        struct opts o = { .layers = 4,
                          .heads = 8,
                          .keep = 0.125,
                          .min_ms = 40,
                          .python = "python3",
                          .script = "bench/topk.py" };
        parse_sizes("1K,4K,16K,64K,128K", &o);
        static const struct option lo[] = {
                { "layers", required_argument, NULL, 'L' },
                { "heads", required_argument, NULL, 'H' },
                { "keep", required_argument, NULL, 'k' },
                { "sizes", required_argument, NULL, 'n' },
                { "min-ms", required_argument, NULL, 'm' },
                { "python", required_argument, NULL, 'p' },
                { "torch-script", required_argument, NULL, 's' },
                { "json", no_argument, NULL, 'j' },
                { "help", no_argument, NULL, 'h' },
                {},
        };
        int ch;
        while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
                switch (ch) {
                case 'L': o.layers = (uint32_t)atoi(optarg); break;
                case 'H': o.heads = (uint32_t)atoi(optarg); break;
                case 'k': o.keep = atof(optarg); break;
                case 'm': o.min_ms = atof(optarg); break;
                case 'p': o.python = optarg; break;
                case 's': o.script = optarg; break;
                case 'j': o.json = true; break;
                case 'n':
                        if (parse_sizes(optarg, &o) < 0) {
                                usage(stderr);
                                return 2;
                        }
                        break;
                case 'h': usage(stdout); return 0;
                default: usage(stderr); return 2;
                }
        }
        if (!o.layers || !o.heads || !(o.keep > 0 && o.keep < 1) || !(o.min_ms > 0)) {
                usage(stderr);
                return 2;
        }
        int cpu_client, cpu_server;
        bench_pick_cpus(&cpu_client, &cpu_server);
        bench_pin(0, cpu_client);
        uint32_t rows = o.layers * o.heads;
        if (!o.json) {
                printf("2. Plan building: top %.1f%% of %u layers x %u heads = %u rows of n scores each, "
                       "ns per token-score (median of %d)\n",
                       o.keep * 100, o.layers, o.heads, rows, MEASUREMENTS);
                printf("| n | radix (kvcd) | qsort | torch.topk | torch.topk + sort | qsort / radix | "
                       "torch.topk / radix | (topk+sort) / radix |\n");
                printf("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        }
        double first_radix = NAN, last_radix = NAN;
        bool ahead = true, mismatch = false, torch_seen = false;
        char torch_why[256] = "";
        for (int si = 0; si < o.n_sizes; si++) {
                struct input in = { .rows = rows, .n = o.sizes[si] };
                in.k = (uint32_t)((double)in.n * o.keep);
                in.score = malloc((size_t)rows * in.n * sizeof(float));
                in.out = malloc((size_t)rows * in.k * sizeof(uint32_t));
                in.scratch = malloc((size_t)in.n * sizeof(uint32_t));
                in.mark = malloc(in.n);
                uint32_t *check = malloc((size_t)rows * in.k * sizeof(uint32_t));
                if (!in.score || !in.out || !in.scratch || !in.mark || !check) {
                        perror("bench-select");
                        return 1;
                }
                uint64_t rng = 42 + in.n;
                for (size_t i = 0; i < (size_t)rows * in.n; i++)
                        in.score[i] = bench_rng_float(&rng);
                run_radix(&in);
                memcpy(check, in.out, (size_t)rows * in.k * sizeof(uint32_t));
                run_qsort(&in);
                if (memcmp(check, in.out, (size_t)rows * in.k * sizeof(uint32_t)) != 0)
                        mismatch = true;

                double radix = measure(run_radix, &in, o.min_ms);
                double sorted = measure(run_qsort, &in, o.min_ms);
                double topk = NAN, topk_sorted = NAN;
                bool torch = run_torch(&o, &in, &topk, &topk_sorted, torch_why, sizeof(torch_why));
                torch_seen |= torch;
                if (si == 0)
                        first_radix = radix;
                last_radix = radix;
                ahead &= radix < sorted && (!torch || radix < topk);
                if (o.json) {
                        printf("{\"n\":%u,\"rows\":%u,\"k\":%u,\"radix_ns\":%.3f,\"qsort_ns\":%.3f,", in.n,
                               rows, in.k, radix, sorted);
                        if (torch)
                                printf("\"torch_topk_ns\":%.3f,\"torch_topk_sort_ns\":%.3f}\n", topk,
                                       topk_sorted);
                        else
                                printf("\"torch\":\"%s\"}\n", torch_why);
                } else if (torch) {
                        printf("| %u | %.2f | %.2f | %.2f | %.2f | %.1f | %.1f | %.1f |\n", in.n, radix,
                               sorted, topk, topk_sorted, sorted / radix, topk / radix, topk_sorted / radix);
                } else {
                        printf("| %u | %.2f | %.2f | %s | | %.1f | | |\n", in.n, radix, sorted, torch_why,
                               sorted / radix);
                }
                fflush(stdout);
                free(in.score);
                free(in.out);
                free(in.scratch);
                free(in.mark);
                free(check);
        }
        if (!o.json) {
                printf("radix ns per score at n = %u over n = %u: %.2f (1.00 is exactly linear)\n",
                       o.sizes[o.n_sizes - 1], o.sizes[0], last_radix / first_radix);
                printf("target: ahead of qsort%s at every n: %s; linear in n: %s\n",
                       torch_seen ? " and torch.topk" : " (torch skipped)", ahead ? "HOLDS" : "DOES NOT HOLD",
                       last_radix / first_radix < 1.5 ? "HOLDS" : "DOES NOT HOLD");
                if (mismatch)
                        printf("ERROR: radix and qsort chose different keep-sets\n");
        }
        return mismatch ? 1 : 0;
}
