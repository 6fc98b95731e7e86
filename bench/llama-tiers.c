/* llama-tiers.c: llama.cpp's KV cache types on the exact sequences of kvc-eval --task tiers (issue
 * 26, the peers' half of the precision ladder's table) and --task niah (issue 27: every peer on the
 * ladder suite's needles). Built and run by bench/tiers-peers.sh and bench/niah-peers.sh against
 * the llama.cpp of `make peers` (BUILD/peers); never part of kvcd.
 *
 *   llama-tiers run MODEL TOKENS TYPES THREADS RAW    scores, one line a sequence and type into RAW
 *   llama-tiers report RAW... OUT_PREFIX              the tiers tables from every RAW (shards, any order)
 *   llama-tiers niah-report RAW... OUT_PREFIX         exact match, log p and bytes per cache and length
 *
 * TOKENS is kvc-eval's `--dump-tokens` file (client/eval/tiers.c and niah.c: "doc D N ids" and
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
 * needles teacher-forced, a hit when every answer token is the argmax after the true prefix, and the
 * answer's summed log probability (niah.c's two scores), bootstrap intervals over cases with
 * tiers.c's seeds (report) or niah.c's (niah-report). What is not alike: llama.cpp quantizes
 * every token of the cache, the newest included (kvcd keeps the last 128 at f16), including the
 * chunk being computed (its K and V are stored, then read back); and the forward pass is
 * llama.cpp's (Q8_1 activations against the Q4_1 weights), so the references differ a little.
 *
 * run appends to RAW, flushed after each sequence (a run cut short keeps what it finished):
 * "doc D TYPE SCORED NLL KL TOP1" and "needle LENGTH K TYPE HIT LOGP BYTES" (BYTES: a token's K or V
 * row at the type as a fraction of the same row at f16, ggml_row_size's); bench/tiers-peers.sh runs
 * a shard of the sequences per process (the machine's cores are shared, one thread each) and report
 * reads them all. report writes OUT_PREFIX.md (the tables) and OUT_PREFIX.jsonl (their rows); the
 * reference is the first type of the first line, needles are ordered by length then case as tiers.c
 * orders them (the bootstrap resamples by index). niah-report reads needle lines of every peer
 * (bench/tiers_quanto.py's and bench/kvpress_bench.py's write the same format, LOGP and BYTES
 * optional) and writes one row per cache: its peer, the bytes it holds as a fraction of its own FP16
 * cache, exact match with its interval per haystack length, and log p in a second table; a cache is
 * scored on the needles it has lines for. Exit 0, 1 on any failure (said on stderr).
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
#define MAX_TYPES        32   /* caches of one report (niah-report: every peer's) */
#define NAME_LEN         32
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

/* log softmax(lg)[want], in double. */
static double log_prob(const float *lg, unsigned V, unsigned best, int want) {
        double sum = 0;
        for (unsigned v = 0; v < V; v++)
                sum += exp((double)lg[v] - lg[best]);
        return (double)lg[want] - lg[best] - log(sum);
}

struct run {
        struct llama_context *ctx[MAX_TYPES];
        unsigned n_types, V;
        struct llama_batch batch;
        float *ref, *lp;
};

/* Feeds q (all but its last token) to every context in chunks of CHUNK, the same chunk to each in
 * turn, and scores the positions tiers.c scores: a document's into ds, a needle's hits into hit
 * and its answer's log probability into logp (one each per type; niah.c scores both). 0 or -1. */
static int run_seq(struct run *R, const struct seq *q, struct doc_score *ds, double *hit, double *logp) {
        unsigned last = q->n - 2; /* the last input: the last token is only predicted */
        unsigned from = q->needle ? q->n_prompt - 1 : TIERS_SCORE_FROM - 1;
        for (unsigned c = 0; c < R->n_types; c++) {
                llama_memory_clear(llama_get_memory(R->ctx[c]), true);
                if (hit)
                        hit[c] = 1, logp[c] = 0;
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
                                for (unsigned c = 0; c < R->n_types; c++) {
                                        const float *lg = llama_get_logits_ith(R->ctx[c], (int)j);
                                        unsigned best = argmax(lg, R->V);
                                        hit[c] = (int)best == want ? hit[c] : 0;
                                        logp[c] += log_prob(lg, R->V, best, want);
                                }
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
        /* a token's K (or V) row in one layer, at the type, as a fraction of the same row at f16 */
        int64_t row =
                (int64_t)llama_model_n_embd(model) / llama_model_n_head(model) * llama_model_n_head_kv(model);
        double bytes[MAX_TYPES];
        for (unsigned c = 0; c < n_types; c++)
                bytes[c] = (double)ggml_row_size(types[c], row) / (double)ggml_row_size(GGML_TYPE_F16, row);
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
                double hit[MAX_TYPES], logp[MAX_TYPES];
                if (run_seq(&R, q, &ds, hit, logp) < 0)
                        return 1;
                for (unsigned c = 0; c < n_types; c++)
                        if (q->needle)
                                fprintf(raw, "needle %u %u %s %.0f %.6f %.6f\n", q->length, q->index,
                                        names[c], hit[c], logp[c], bytes[c]);
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
#define MAX_LENGTHS 8

/* One needle's scores under every cache that scored it (has), in any raw file. */
struct needle_score {
        unsigned length, k;
        double hit[MAX_TYPES], logp[MAX_TYPES], bytes[MAX_TYPES]; /* logp, bytes: NAN where not given */
        bool has[MAX_TYPES];
};

struct report {
        char names[MAX_TYPES][NAME_LEN];
        unsigned n_types, n_docs, n_needles;
        unsigned doc_id[MAX_DOCS];
        struct doc_score ds[MAX_DOCS];
        struct needle_score nd[MAX_NEEDLES];
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

/* Reads raw lines: "doc D TYPE SCORED NLL KL TOP1" and "needle LENGTH K TYPE HIT [LOGP [BYTES]]"
 * (the log p of the answer and the bytes as a fraction of the FP16 cache: llama-tiers run writes
 * them since the niah peers, older files and tiers_quanto.py's docs part do without). */
static int read_raw(struct report *R, const char *path) {
        FILE *f = fopen(path, "r");
        if (!f)
                return -errno;
        char line[512], name[NAME_LEN];
        int r = 0;
        while (r == 0 && fgets(line, sizeof(line), f)) {
                unsigned a, b, i;
                double n, nll, kl, top1, hit, logp = NAN, bytes = NAN;
                int c, end = 0;
                if (sscanf(line, "doc %u %31s %lf %lf %lf %lf", &a, name, &n, &nll, &kl, &top1) == 6) {
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
                } else if (sscanf(line, "needle %u %u %31s %lf%n", &a, &b, name, &hit, &end) == 4) {
                        (void)sscanf(line + end, "%lf %lf", &logp, &bytes);
                        for (i = 0; i < R->n_needles && !(R->nd[i].length == a && R->nd[i].k == b); i++)
                                ;
                        if ((c = type_index(R, name)) < 0 || i == MAX_NEEDLES)
                                r = -ENOSPC;
                        else {
                                struct needle_score *s = &R->nd[i];
                                R->n_needles += i == R->n_needles;
                                s->length = a;
                                s->k = b;
                                s->hit[c] = hit;
                                s->logp[c] = logp;
                                s->bytes[c] = bytes;
                                s->has[c] = true;
                        }
                } else if (line[strspn(line, " \t\r\n")] != '\0')
                        r = -EINVAL;
        }
        fclose(f);
        return r;
}

/* tiers.c's and niah.c's order: by length, then case (the bootstrap resamples by index) */
static int cmp_needle(const void *a, const void *b) {
        const struct needle_score *x = a, *y = b;
        if (x->length != y->length)
                return x->length < y->length ? -1 : 1;
        return (x->k > y->k) - (x->k < y->k);
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
        fprintf(md,
                "\n## Needles (%u cases)\n\n| cache | exact match [95%%] | vs %s [95%%] | verdict |\n"
                "|---|---:|---:|---|\n",
                N, ref);
        double x[MAX_NEEDLES], dx[MAX_NEEDLES];
        for (unsigned c = 0; c < R->n_types; c++) {
                double hits = 0;
                for (unsigned i = 0; i < N; i++) {
                        x[i] = R->nd[i].hit[c];
                        dx[i] = x[i] - R->nd[i].hit[0];
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

/* ---- niah-report: exact match and bytes per cache and haystack length, every peer ---- */

/* The peer of a cache name (llama.cpp's types; transformers' caches of bench/tiers_quanto.py: f32,
 * quanto-intN; kvpress's of bench/kvpress_bench.py: kvpress-full, PRESS@RATIO), its kind (full,
 * quant, press) and what to say beside its row. */
static void describe(const char *name, const char **peer, const char **kind, const char **note) {
        bool llama = false;
        for (size_t i = 0; i < sizeof(cache_types) / sizeof(cache_types[0]); i++)
                llama |= strcmp(cache_types[i].name, name) == 0;
        if (llama) {
                *peer = "llama.cpp";
                *kind = strcmp(name, "f16") == 0 ? "full" : "quant";
                *note = strcmp(name, "f16") == 0 ? "the reference of llama.cpp's rows"
                                                 : "K and V at the type, every token (prompt included)";
        } else if (strcmp(name, "f32") == 0 || strncmp(name, "quanto-", 7) == 0) {
                *peer = "transformers";
                *kind = strcmp(name, "f32") == 0 ? "full" : "quant";
                *note = strcmp(name, "f32") == 0
                                ? "DynamicCache, float32: the reference of the QuantizedCache rows"
                                : "QuantizedCache quantizes only after the prefill: the question reads exact "
                                  "values, only the answer's tokens read quantized ones";
        } else {
                *peer = "kvpress";
                *kind = strchr(name, '@') ? "press" : "full";
                *note = !strchr(name, '@')
                                ? "DynamicCache, float32, kvpress's harness: the reference of the presses"
                        : strncmp(name, "kvzip@", 6) == 0
                                ? "question-agnostic by context reconstruction; kvpress masks the evicted "
                                  "keys "
                                  "(the cache keeps every token): bytes are what it would hold"
                                : "the context compressed before the question is read";
        }
}

/* A JSON number, or null where there is none (NaN: one needle has no interval, a line no bytes). */
static void json_num(FILE *js, const char *key, double v, bool last) {
        if (isfinite(v))
                fprintf(js, "\"%s\":%.5f%s", key, v, last ? "" : ",");
        else
                fprintf(js, "\"%s\":null%s", key, last ? "" : ",");
}

static void niah_tables(struct report *R, FILE *md, FILE *js) {
        unsigned lengths[MAX_LENGTHS], n_len = 0;
        for (unsigned i = 0; i < R->n_needles; i++) {
                unsigned l = 0;
                while (l < n_len && lengths[l] != R->nd[i].length)
                        l++;
                if (l == n_len && n_len < MAX_LENGTHS)
                        lengths[n_len++] = R->nd[i].length; /* nd is sorted: so are lengths */
        }
        struct cell {
                double hits, n, bytes;
                struct stats_ci acc, logp;
        } cells[MAX_TYPES][MAX_LENGTHS];
        double x[MAX_NEEDLES];
        for (unsigned c = 0; c < R->n_types; c++)
                for (unsigned l = 0; l < n_len; l++) {
                        struct cell *e = &cells[c][l];
                        uint64_t seed = 0x5eed0000ull + l * 977 + c; /* niah.c's */
                        unsigned n = 0, n_bytes = 0;
                        e->hits = e->bytes = 0;
                        for (unsigned i = 0; i < R->n_needles; i++)
                                if (R->nd[i].length == lengths[l] && R->nd[i].has[c]) {
                                        x[n++] = R->nd[i].hit[c];
                                        e->hits += R->nd[i].hit[c];
                                        if (isfinite(R->nd[i].bytes[c]))
                                                e->bytes += R->nd[i].bytes[c], n_bytes++;
                                }
                        e->n = n;
                        e->bytes = n_bytes ? e->bytes / n_bytes : NAN;
                        if (stats_bootstrap_mean(x, n, 2000, seed, &e->acc) < 0)
                                e->acc = (struct stats_ci){ .mean = n ? x[0] : NAN, .lo = NAN, .hi = NAN };
                        n = 0;
                        for (unsigned i = 0; i < R->n_needles; i++)
                                if (R->nd[i].length == lengths[l] && R->nd[i].has[c])
                                        x[n++] = R->nd[i].logp[c];
                        if (stats_bootstrap_mean(x, n, 2000, seed + 2, &e->logp) < 0)
                                e->logp = (struct stats_ci){ .mean = n ? x[0] : NAN, .lo = NAN, .hi = NAN };
                }
        fprintf(md, "## Exact match and bytes\n\n| peer | cache | bytes of its FP16 cache |");
        for (unsigned l = 0; l < n_len; l++)
                fprintf(md, " %u tokens: exact match [95%%] |", lengths[l]);
        fprintf(md, " note |\n|---|---|---:|");
        for (unsigned l = 0; l < n_len; l++)
                fprintf(md, "---:|");
        fprintf(md, "---|\n");
        for (unsigned c = 0; c < R->n_types; c++) {
                const char *peer, *kind, *note;
                describe(R->names[c], &peer, &kind, &note);
                double lo = INFINITY, hi = -INFINITY, all = 0, n_all = 0;
                for (unsigned l = 0; l < n_len; l++)
                        if (isfinite(cells[c][l].bytes)) {
                                lo = fmin(lo, cells[c][l].bytes);
                                hi = fmax(hi, cells[c][l].bytes);
                                all += cells[c][l].bytes * cells[c][l].n;
                                n_all += cells[c][l].n;
                        }
                all = n_all > 0 ? all / n_all : NAN;
                fprintf(md, "| %s | %s | ", peer, R->names[c]);
                if (!isfinite(all))
                        fprintf(md, "- |");
                else if (hi - lo < 0.0005)
                        fprintf(md, "%.3f |", all);
                else
                        for (unsigned l = 0; l < n_len; l++)
                                fprintf(md, "%s%.3f%s", l ? " / " : "", cells[c][l].bytes,
                                        l + 1 == n_len ? " |" : "");
                for (unsigned l = 0; l < n_len; l++) {
                        const struct cell *e = &cells[c][l];
                        if (e->n == 0)
                                fprintf(md, " - |");
                        else if (isnan(e->acc.lo))
                                fprintf(md, " %.0f/%.0f |", e->hits, e->n);
                        else
                                fprintf(md, " %.0f/%.0f: %.0f%% [%.0f%%, %.0f%%] |", e->hits, e->n,
                                        100 * e->acc.mean, 100 * e->acc.lo, 100 * e->acc.hi);
                }
                fprintf(md, " %s |\n", note);
                const char *at = strchr(R->names[c], '@');
                fprintf(js, "{\"peer\":\"%s\",\"cache\":\"%s\",\"kind\":\"%s\",", peer, R->names[c], kind);
                json_num(js, "ratio", at ? atof(at + 1) : NAN, false);
                json_num(js, "bits_per_value", at ? NAN : 16 * all, false);
                json_num(js, "bytes_frac", all, false);
                fprintf(js, "\"note\":\"%s\",\"lengths\":[", note);
                for (unsigned l = 0, first = 1; l < n_len; l++) {
                        const struct cell *e = &cells[c][l];
                        if (e->n == 0)
                                continue;
                        fprintf(js, "%s{\"length\":%u,\"needles\":%.0f,\"hits\":%.0f,", first ? "" : ",",
                                lengths[l], e->n, e->hits);
                        json_num(js, "exact", e->acc.mean, false);
                        json_num(js, "exact_lo", e->acc.lo, false);
                        json_num(js, "exact_hi", e->acc.hi, false);
                        json_num(js, "logp", e->logp.mean, false);
                        json_num(js, "logp_lo", e->logp.lo, false);
                        json_num(js, "logp_hi", e->logp.hi, false);
                        json_num(js, "bytes_frac", e->bytes, true);
                        fprintf(js, "}");
                        first = 0;
                }
                fprintf(js, "]}\n");
        }
        fprintf(md, "\n## Log probability of the answer (sum over its tokens, mean over needles [95%%])\n\n"
                    "| peer | cache |");
        for (unsigned l = 0; l < n_len; l++)
                fprintf(md, " %u tokens |", lengths[l]);
        fprintf(md, "\n|---|---|");
        for (unsigned l = 0; l < n_len; l++)
                fprintf(md, "---:|");
        fprintf(md, "\n");
        for (unsigned c = 0; c < R->n_types; c++) {
                const char *peer, *kind, *note;
                describe(R->names[c], &peer, &kind, &note);
                fprintf(md, "| %s | %s |", peer, R->names[c]);
                for (unsigned l = 0; l < n_len; l++) {
                        const struct cell *e = &cells[c][l];
                        if (e->n == 0)
                                fprintf(md, " - |");
                        else if (isnan(e->logp.lo))
                                fprintf(md, " %.3f |", e->logp.mean);
                        else
                                fprintf(md, " %.3f [%.3f, %.3f] |", e->logp.mean, e->logp.lo, e->logp.hi);
                }
                fprintf(md, "\n");
        }
}

static int report_main(int argc, char **argv, bool niah) {
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
        qsort(R->nd, R->n_needles, sizeof(R->nd[0]), cmp_needle);
        char path[4096];
        snprintf(path, sizeof(path), "%s.md", argv[argc - 1]);
        FILE *md = fopen(path, "w");
        snprintf(path, sizeof(path), "%s.jsonl", argv[argc - 1]);
        FILE *js = fopen(path, "w");
        if (!md || !js) {
                fprintf(stderr, "llama-tiers: cannot write %s.{md,jsonl}\n", argv[argc - 1]);
                return 1;
        }
        if (niah)
                niah_tables(R, md, js);
        else
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
                return report_main(argc - 2, argv + 2, false);
        if (argc >= 4 && strcmp(argv[1], "niah-report") == 0)
                return report_main(argc - 2, argv + 2, true);
        fprintf(stderr, "usage: llama-tiers run MODEL TOKENS TYPES THREADS RAW\n"
                        "       llama-tiers report RAW... OUT_PREFIX\n"
                        "       llama-tiers niah-report RAW... OUT_PREFIX\n");
        return 2;
}
