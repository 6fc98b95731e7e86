/* llama-tiers.c: llama.cpp's KV cache types on the exact sequences of kvc-eval --task tiers (issue
 * 26, the peers' half of the precision ladder's table). Built and run by bench/tiers-peers.sh
 * against the llama.cpp of `make peers` (BUILD/peers); never part of kvcd.
 *
 *   llama-tiers run MODEL TOKENS TYPES THREADS RAW    scores, one line a sequence and type into RAW
 *   llama-tiers report RAW... OUT_PREFIX              the tables from every RAW (shards, any order)
 *
 * TOKENS is kvc-eval's `--task tiers --dump-tokens` file (client/eval/tiers.c: "doc D N ids" and
 * "needle LENGTH K N_PROMPT N_ANSWER ids answer"); TYPES a comma list of cache types, the first the
 * reference (f16). One llama.cpp context per type, K and V both at that type, flash attention on for
 * every one (llama.cpp needs it for a quantized V cache, and the reference must take the same
 * path); every context gets the same chunk of the same sequence in turn, so the logits of one
 * position are compared across types without storing them.
 *
 * Scored as client/eval/tiers.c scores kvcd's tiers, so the two tables are paired on the same texts
 * and positions: documents teacher-forced, every position p with p + 1 >= 144 predicting token
 * p + 1 (NLL, KL(reference || type), top-1 agreement with the reference), the perplexity ratio to
 * the reference with its 95% interval clustered by document (client/eval/stats.c, the same code);
 * needles teacher-forced, a hit when every answer token is the argmax after the true prefix,
 * bootstrap intervals over cases with tiers.c's seeds. What is not alike: llama.cpp quantizes
 * every token of the cache, the newest included (kvcd keeps the last 128 at f16), including the
 * chunk being computed (its K and V are stored, then read back); and the forward pass is
 * llama.cpp's (Q8_1 activations against the Q4_1 weights), so the references differ a little.
 *
 * run appends to RAW, flushed after each sequence (a run cut short keeps what it finished):
 * "doc D TYPE SCORED NLL KL TOP1" and "needle LENGTH K TYPE HIT"; bench/tiers-peers.sh runs a
 * shard of the sequences per process (the machine's cores are shared, one thread each) and report
 * reads them all. report writes OUT_PREFIX.md (the tables) and OUT_PREFIX.jsonl (their rows); the
 * reference is the first type of the first line, needles are ordered by length then case as tiers.c
 * orders them (the bootstrap resamples by index). Exit 0, 1 on any failure (said on stderr).
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "llama.h"
#include "stats.h"

#define TIERS_SCORE_FROM 144u /* tiers.c: TIERS_WINDOW + 16 */
#define MAX_TYPES        8
#define CHUNK            256
#define N_CTX            4608 /* the longest needle (4,096-token haystack) is about 4,190 */

static const struct {
        const char *name;
        enum ggml_type type;
} cache_types[] = {
        { "f16", GGML_TYPE_F16 },   { "bf16", GGML_TYPE_BF16 },     { "q8_0", GGML_TYPE_Q8_0 },
        { "q5_1", GGML_TYPE_Q5_1 }, { "q5_0", GGML_TYPE_Q5_0 },     { "q4_1", GGML_TYPE_Q4_1 },
        { "q4_0", GGML_TYPE_Q4_0 }, { "iq4_nl", GGML_TYPE_IQ4_NL },
};

struct seq {
        bool needle;
        unsigned length, index, n_prompt, n_answer, n;
        int *ids; /* n ids: a document, or the prompt then the answer */
};

struct doc_score {
        double nll[MAX_TYPES], kl[MAX_TYPES], top1[MAX_TYPES], n;
};

static void quiet_log(enum ggml_log_level level, const char *text, void *user) {
        (void)user;
        if (level == GGML_LOG_LEVEL_ERROR)
                fputs(text, stderr);
}

/* Reads every line of a --dump-tokens file. 0 or -errno. */
static int read_seqs(const char *path, struct seq **ret, unsigned *ret_n) {
        FILE *f = fopen(path, "r");
        if (!f)
                return -errno;
        struct seq *s = NULL;
        unsigned n = 0;
        char kind[16];
        int r = 0;
        while (r == 0 && fscanf(f, "%15s", kind) == 1) {
                struct seq q = { 0 };
                struct seq *grown = realloc(s, (n + 1) * sizeof(*s));
                if (!grown) {
                        r = -ENOMEM;
                        break;
                }
                s = grown;
                if (strcmp(kind, "doc") == 0 && fscanf(f, "%u %u", &q.index, &q.n) == 2)
                        q.length = q.n;
                else if (strcmp(kind, "needle") == 0 &&
                         fscanf(f, "%u %u %u %u", &q.length, &q.index, &q.n_prompt, &q.n_answer) == 4) {
                        q.needle = true;
                        q.n = q.n_prompt + q.n_answer;
                } else
                        r = -EINVAL;
                if (r == 0 && (q.n < 2 || q.n > N_CTX))
                        r = -EINVAL;
                if (r == 0 && !(q.ids = malloc(q.n * sizeof(int))))
                        r = -ENOMEM;
                for (unsigned i = 0; r == 0 && i < q.n; i++)
                        if (fscanf(f, "%d", &q.ids[i]) != 1)
                                r = -EINVAL;
                s[n++] = q;
        }
        fclose(f);
        *ret = s;
        *ret_n = n;
        return r;
}

/* out = log softmax(lg), in double, stored as float; returns the argmax (lab_log_softmax's). */
static unsigned log_softmax(const float *lg, unsigned V, float *out) {
        unsigned best = 0;
        for (unsigned v = 1; v < V; v++)
                best = lg[v] > lg[best] ? v : best;
        double sum = 0;
        for (unsigned v = 0; v < V; v++)
                sum += exp((double)lg[v] - lg[best]);
        double lse = lg[best] + log(sum);
        for (unsigned v = 0; v < V; v++)
                out[v] = (float)(lg[v] - lse);
        return best;
}

static double kl(const float *p, const float *q, unsigned V) {
        double s = 0;
        for (unsigned v = 0; v < V; v++)
                s += exp((double)p[v]) * ((double)p[v] - q[v]);
        return s;
}

static unsigned argmax(const float *lg, unsigned V) {
        unsigned best = 0;
        for (unsigned v = 1; v < V; v++)
                best = lg[v] > lg[best] ? v : best;
        return best;
}

struct run {
        struct llama_context *ctx[MAX_TYPES];
        unsigned n_types, V;
        struct llama_batch batch;
        float *ref, *lp;
};

/* Feeds q (all but its last token) to every context in chunks of CHUNK, the same chunk to each in
 * turn, and scores the positions tiers.c scores: a document's into ds, a needle's hits into hit
 * (one per type). 0 or -1. */
static int run_seq(struct run *R, const struct seq *q, struct doc_score *ds, double *hit) {
        unsigned last = q->n - 2; /* the last input: the last token is only predicted */
        unsigned from = q->needle ? q->n_prompt - 1 : TIERS_SCORE_FROM - 1;
        for (unsigned c = 0; c < R->n_types; c++) {
                llama_memory_clear(llama_get_memory(R->ctx[c]), true);
                if (hit)
                        hit[c] = 1;
        }
        for (unsigned pos = 0; pos <= last;) {
                unsigned k = last + 1 - pos < CHUNK ? last + 1 - pos : CHUNK;
                R->batch.n_tokens = (int)k;
                for (unsigned j = 0; j < k; j++) {
                        R->batch.token[j] = q->ids[pos + j];
                        R->batch.pos[j] = (llama_pos)(pos + j);
                        R->batch.n_seq_id[j] = 1;
                        R->batch.seq_id[j][0] = 0;
                        R->batch.logits[j] = pos + j >= from;
                }
                for (unsigned c = 0; c < R->n_types; c++)
                        if (llama_decode(R->ctx[c], R->batch) != 0) {
                                fprintf(stderr, "llama-tiers: llama_decode failed at %u\n", pos);
                                return -1;
                        }
                for (unsigned j = 0; j < k; j++) {
                        unsigned p = pos + j;
                        if (p < from)
                                continue;
                        if (q->needle) {
                                int want = q->ids[p + 1];
                                for (unsigned c = 0; c < R->n_types; c++)
                                        if ((int)argmax(llama_get_logits_ith(R->ctx[c], (int)j), R->V) !=
                                            want)
                                                hit[c] = 0;
                                continue;
                        }
                        unsigned ref_top = 0;
                        for (unsigned c = 0; c < R->n_types; c++) {
                                float *out = c == 0 ? R->ref : R->lp;
                                unsigned best =
                                        log_softmax(llama_get_logits_ith(R->ctx[c], (int)j), R->V, out);
                                if (c == 0)
                                        ref_top = best;
                                ds->nll[c] -= out[q->ids[p + 1]];
                                ds->kl[c] += c ? kl(R->ref, R->lp, R->V) : 0;
                                ds->top1[c] += best == ref_top;
                        }
                        ds->n++;
                }
                pos += k;
        }
        return 0;
}

/* ---- run: score every sequence of a --dump-tokens file with every type ---- */

static int run_main(char **argv) {
        const char *names[MAX_TYPES];
        enum ggml_type types[MAX_TYPES];
        unsigned n_types = 0;
        char *list = strdup(argv[2]);
        for (char *t = strtok(list, ","); t; t = strtok(NULL, ",")) {
                size_t i = 0;
                while (i < sizeof(cache_types) / sizeof(cache_types[0]) &&
                       strcmp(cache_types[i].name, t) != 0)
                        i++;
                if (i == sizeof(cache_types) / sizeof(cache_types[0]) || n_types == MAX_TYPES) {
                        fprintf(stderr, "llama-tiers: unknown cache type %s (or more than %d)\n", t,
                                MAX_TYPES);
                        return 2;
                }
                names[n_types] = cache_types[i].name;
                types[n_types++] = cache_types[i].type;
        }
        struct seq *seqs = NULL;
        unsigned n_seqs = 0;
        int r = read_seqs(argv[1], &seqs, &n_seqs);
        if (r < 0) {
                fprintf(stderr, "llama-tiers: cannot read %s: %s\n", argv[1], strerror(-r));
                return 1;
        }
        llama_log_set(quiet_log, NULL);
        llama_backend_init();
        struct llama_model_params mp = llama_model_default_params();
        mp.use_extra_bufts = false; /* the AMX backend segfaults on these Xeons (get-llamacpp.sh) */
        struct llama_model *model = llama_model_load_from_file(argv[0], mp);
        if (!model) {
                fprintf(stderr, "llama-tiers: cannot load %s\n", argv[0]);
                return 1;
        }
        struct run R = { .n_types = n_types,
                         .V = (unsigned)llama_vocab_n_tokens(llama_model_get_vocab(model)) };
        for (unsigned c = 0; c < n_types; c++) {
                struct llama_context_params cp = llama_context_default_params();
                cp.n_ctx = N_CTX;
                cp.n_batch = cp.n_ubatch = CHUNK;
                cp.n_seq_max = 1;
                cp.n_threads = cp.n_threads_batch = atoi(argv[3]);
                cp.type_k = cp.type_v = types[c];
                cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
                cp.no_perf = true;
                if (!(R.ctx[c] = llama_init_from_model(model, cp))) {
                        fprintf(stderr, "llama-tiers: no context with a %s cache\n", names[c]);
                        return 1;
                }
        }
        R.batch = llama_batch_init(CHUNK, 0, 1);
        R.ref = malloc(R.V * sizeof(float));
        R.lp = malloc(R.V * sizeof(float));
        FILE *raw = fopen(argv[4], "a");
        if (!R.ref || !R.lp || !raw) {
                fprintf(stderr, "llama-tiers: out of memory, or cannot write %s\n", argv[4]);
                return 1;
        }
        time_t t0 = time(NULL);
        for (unsigned i = 0; i < n_seqs; i++) {
                const struct seq *q = &seqs[i];
                struct doc_score ds = { 0 };
                double hit[MAX_TYPES];
                if (run_seq(&R, q, &ds, hit) < 0)
                        return 1;
                for (unsigned c = 0; c < n_types; c++)
                        if (q->needle)
                                fprintf(raw, "needle %u %u %s %.0f\n", q->length, q->index, names[c], hit[c]);
                        else
                                fprintf(raw, "doc %u %s %.0f %.9g %.9g %.0f\n", q->index, names[c], ds.n,
                                        ds.nll[c], ds.kl[c], ds.top1[c]);
                fflush(raw);
                fprintf(stderr, "llama-tiers: %s %u of %u tokens done, %ld s\n",
                        q->needle ? "needle" : "document", q->index, q->n, (long)(time(NULL) - t0));
        }
        fclose(raw);
        for (unsigned c = 0; c < n_types; c++)
                llama_free(R.ctx[c]);
        llama_batch_free(R.batch);
        llama_model_free(model);
        for (unsigned i = 0; i < n_seqs; i++)
                free(seqs[i].ids);
        free(seqs);
        free(R.ref);
        free(R.lp);
        free(list);
        return 0;
}

/* ---- report: the tables, with client/eval/stats.c's intervals and tiers.c's seeds ---- */

#define MAX_DOCS    256
#define MAX_NEEDLES 1024

struct report {
        char names[MAX_TYPES][16];
        unsigned n_types, n_docs, n_needles;
        unsigned doc_id[MAX_DOCS];
        struct doc_score ds[MAX_DOCS];
        unsigned nd_len[MAX_NEEDLES], nd_k[MAX_NEEDLES];
        double hit[MAX_NEEDLES][MAX_TYPES];
};

static int type_index(struct report *R, const char *name) {
        for (unsigned c = 0; c < R->n_types; c++)
                if (strcmp(R->names[c], name) == 0)
                        return (int)c;
        if (R->n_types == MAX_TYPES)
                return -1;
        snprintf(R->names[R->n_types], sizeof(R->names[0]), "%s", name);
        return (int)R->n_types++;
}

static int read_raw(struct report *R, const char *path) {
        FILE *f = fopen(path, "r");
        if (!f)
                return -errno;
        char kind[16], name[16];
        int r = 0;
        while (r == 0 && fscanf(f, "%15s", kind) == 1) {
                unsigned a, b = 0, i;
                double n, nll, kl, top1, hit;
                int c;
                if (strcmp(kind, "doc") == 0 &&
                    fscanf(f, "%u %15s %lf %lf %lf %lf", &a, name, &n, &nll, &kl, &top1) == 6) {
                        for (i = 0; i < R->n_docs && R->doc_id[i] != a; i++)
                                ;
                        if ((c = type_index(R, name)) < 0 || i == MAX_DOCS)
                                r = -ENOSPC;
                        else {
                                R->n_docs += i == R->n_docs;
                                R->doc_id[i] = a;
                                R->ds[i].n = n;
                                R->ds[i].nll[c] = nll;
                                R->ds[i].kl[c] = kl;
                                R->ds[i].top1[c] = top1;
                        }
                } else if (strcmp(kind, "needle") == 0 &&
                           fscanf(f, "%u %u %15s %lf", &a, &b, name, &hit) == 4) {
                        for (i = 0; i < R->n_needles && !(R->nd_len[i] == a && R->nd_k[i] == b); i++)
                                ;
                        if ((c = type_index(R, name)) < 0 || i == MAX_NEEDLES)
                                r = -ENOSPC;
                        else {
                                R->n_needles += i == R->n_needles;
                                R->nd_len[i] = a;
                                R->nd_k[i] = b;
                                R->hit[i][c] = hit;
                        }
                } else
                        r = -EINVAL;
        }
        fclose(f);
        return r;
}

static void write_tables(struct report *R, FILE *md, FILE *js) {
        double a[MAX_DOCS], b[MAX_DOCS], w[MAX_DOCS];
        const char *ref = R->names[0];
        fprintf(md,
                "## Long documents (%u documents, teacher-forced, scored past %u tokens)\n\n"
                "| cache | perplexity | vs %s [95%%] | KL(%s ‖ type) | top-1 agreement |\n"
                "|---|---:|---:|---:|---:|\n",
                R->n_docs, TIERS_SCORE_FROM, ref, ref);
        for (unsigned c = 0; c < R->n_types && R->n_docs >= 2; c++) {
                struct stats_ci ppl = { 0 }, d = { 0 }, k = { 0 }, t1 = { 0 };
                for (unsigned i = 0; i < R->n_docs; i++) {
                        a[i] = R->ds[i].nll[c];
                        b[i] = R->ds[i].nll[0];
                        w[i] = R->ds[i].n;
                }
                stats_ratio_ci(a, w, R->n_docs, &ppl);
                stats_paired_ci(a, b, w, R->n_docs, &d);
                for (unsigned i = 0; i < R->n_docs; i++)
                        a[i] = R->ds[i].kl[c];
                stats_ratio_ci(a, w, R->n_docs, &k);
                for (unsigned i = 0; i < R->n_docs; i++)
                        a[i] = R->ds[i].top1[c];
                stats_ratio_ci(a, w, R->n_docs, &t1);
                double rel = expm1(d.mean), lo = expm1(d.lo), hi = expm1(d.hi);
                fprintf(md, "| %s | %.3f | %+.2f%% [%+.2f%%, %+.2f%%] | %.4f | %.3f |\n", R->names[c],
                        exp(ppl.mean), 100 * rel, 100 * lo, 100 * hi, k.mean, t1.mean);
                fprintf(js,
                        "{\"part\":\"longdoc\",\"cache\":\"%s\",\"documents\":%u,\"ppl\":%.5f,\"ppl_rel\":%."
                        "6f,"
                        "\"ppl_rel_lo\":%.6f,\"ppl_rel_hi\":%.6f,\"kl\":%.6f,\"top1\":%.5f}\n",
                        R->names[c], R->n_docs, exp(ppl.mean), rel, lo, hi, k.mean, t1.mean);
        }
        unsigned N = R->n_needles;
        if (N < 2)
                return;
        /* tiers.c's order: by length, then case */
        for (unsigned i = 1; i < N; i++)
                for (unsigned j = i;
                     j > 0 && (R->nd_len[j - 1] > R->nd_len[j] ||
                               (R->nd_len[j - 1] == R->nd_len[j] && R->nd_k[j - 1] > R->nd_k[j]));
                     j--) {
                        unsigned tl = R->nd_len[j], tk = R->nd_k[j];
                        double th[MAX_TYPES];
                        memcpy(th, R->hit[j], sizeof(th));
                        R->nd_len[j] = R->nd_len[j - 1], R->nd_k[j] = R->nd_k[j - 1];
                        memcpy(R->hit[j], R->hit[j - 1], sizeof(th));
                        R->nd_len[j - 1] = tl, R->nd_k[j - 1] = tk;
                        memcpy(R->hit[j - 1], th, sizeof(th));
                }
        fprintf(md,
                "\n## Needles (%u cases)\n\n| cache | exact match [95%%] | vs %s [95%%] | verdict |\n"
                "|---|---:|---:|---|\n",
                N, ref);
        double x[MAX_NEEDLES], dx[MAX_NEEDLES];
        for (unsigned c = 0; c < R->n_types; c++) {
                double hits = 0;
                for (unsigned i = 0; i < N; i++) {
                        x[i] = R->hit[i][c];
                        dx[i] = x[i] - R->hit[i][0];
                        hits += x[i];
                }
                struct stats_ci m = { 0 }, d = { 0 };
                stats_bootstrap_mean(x, N, 2000, 7 + c, &m);
                stats_bootstrap_mean(dx, N, 2000, 70 + c, &d);
                fprintf(md, "| %s | %.0f/%u: %.0f%% [%.0f%%, %.0f%%] | %+.0f%% [%+.0f%%, %+.0f%%] | %s |\n",
                        R->names[c], hits, N, 100 * m.mean, 100 * m.lo, 100 * m.hi, 100 * d.mean, 100 * d.lo,
                        100 * d.hi, c ? stats_compare(&d, false) : "-");
                fprintf(js,
                        "{\"part\":\"needle\",\"cache\":\"%s\",\"cases\":%u,\"hits\":%.0f,\"exact\":%.5f,"
                        "\"exact_lo\":%.5f,\"exact_hi\":%.5f,\"vs_ref\":%.5f,\"vs_ref_lo\":%.5f,\"vs_ref_"
                        "hi\":%.5f}\n",
                        R->names[c], N, hits, m.mean, m.lo, m.hi, d.mean, d.lo, d.hi);
        }
}

static int report_main(int argc, char **argv) {
        struct report *R = calloc(1, sizeof(*R));
        if (!R)
                return 1;
        for (int i = 0; i < argc - 1; i++) {
                int r = read_raw(R, argv[i]);
                if (r < 0) {
                        fprintf(stderr, "llama-tiers: cannot read %s: %s\n", argv[i], strerror(-r));
                        return 1;
                }
        }
        char path[4096];
        snprintf(path, sizeof(path), "%s.md", argv[argc - 1]);
        FILE *md = fopen(path, "w");
        snprintf(path, sizeof(path), "%s.jsonl", argv[argc - 1]);
        FILE *js = fopen(path, "w");
        if (!md || !js) {
                fprintf(stderr, "llama-tiers: cannot write %s.{md,jsonl}\n", argv[argc - 1]);
                return 1;
        }
        write_tables(R, md, js);
        fclose(md);
        fclose(js);
        free(R);
        return 0;
}

int main(int argc, char **argv) {
        if (argc == 7 && strcmp(argv[1], "run") == 0)
                return run_main(argv + 2);
        if (argc >= 4 && strcmp(argv[1], "report") == 0)
                return report_main(argc - 2, argv + 2);
        fprintf(stderr, "usage: llama-tiers run MODEL TOKENS TYPES THREADS RAW\n"
                        "       llama-tiers report RAW... OUT_PREFIX\n");
        return 2;
}
