/* mechanism.c: confidence and attention signals against what a window costs, per step, through
 * kvcd (mechanism.h).
 *
 * A step p is the row at position p (its logits predict p + 1). For a window of W it counts once
 * the window's cache lacks some earlier position at that row (it has evicted); the 16-step target
 * is the mean KL of rows p + 1 .. p + 16 and exists when they do. Signals and targets are pooled
 * over documents; the correlations' intervals are percentile bootstraps that resample whole
 * documents (steps of one document are not independent), MECH_BOOT resamples with a fixed seed.
 * "Attention predicts better" is the paired bootstrap of |rho(attention)| - |rho(confidence)|
 * over the same resamples: a verdict only when its interval excludes 0.
 *
 * Rejected: Fisher-z intervals over steps (kvc-eval's stories260K report uses them and says they
 * are too narrow: thousands of steps of a handful of documents are not thousands of samples).
 */
#define _GNU_SOURCE
#include "mechanism.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvc.h"
#include "lab.h"
#include "model.h"
#include "stats.h"
#include "text.h"

#define MECH_HORIZON  16
#define MECH_BOOT     1000
#define MECH_BINS     10
#define MECH_SIGNALS  4
#define MECH_SINKS    4 /* the first positions, which attract attention whatever the query (sinks) */
#define MECH_MIN_DOCS 5 /* a verdict needs at least this many documents to resample */
#define MECH_TARGETS  2

static const char *const signal_names[MECH_SIGNALS] = { "confidence", "attn_mass_beyond", "attn_entropy",
                                                        "attn_mass_beyond_nosink" };
static const char *const signal_words[MECH_SIGNALS] = { "confidence (kvcd's summary)",
                                                        "attention mass beyond the window",
                                                        "attention entropy",
                                                        "attention mass beyond the window, sinks excluded" };
static const char *const target_names[MECH_TARGETS] = { "kl", "kl_next16" };

/* The cache context of one configuration's rows: the full cache's also feeds the signals. */
struct mech_ctx {
        struct mechanism *m;
        struct kvc_session *s;
        bool full;
};

/* One step of one document, for one window. */
struct mech_step {
        uint32_t doc;
        float signal[MECH_SIGNALS];
        float target[MECH_TARGETS]; /* NAN: the 16 steps after it run past the document */
};

struct mechanism {
        struct niah n;
        uint32_t length, n_w, W[NIAH_MAX_FRACTIONS];
        uint32_t L, H, Hkv, D;
        float *keys;      /* [L][length][Hkv * D]: the full cache's keys as the engine stored them */
        double *probs;    /* [length]: one head's attention */
        double *mass;     /* [n_w][length]: attention beyond the W newest, summed over layers and heads */
        double *mass_ns;  /* [n_w][length]: the same without the first MECH_SINKS positions */
        double *attn_ent; /* [length]: normalized attention entropy, summed over layers and heads */
        /* per position of the current document (the full cache's summary; each window's KL and
         * whether it had evicted) */
        float *conf, *entropy, *top1, *margin, *kl[NIAH_MAX_FRACTIONS];
        bool *evicted[NIAH_MAX_FRACTIONS];
        struct mech_step *steps[NIAH_MAX_FRACTIONS];
        size_t n_steps[NIAH_MAX_FRACTIONS];
};

static int mech_store(void *ctx, int layer, int pos, const float *k, const float *v) {
        struct mech_ctx *c = ctx;
        struct mechanism *m = c->m;
        if (c->full && (uint32_t)pos < m->length)
                memcpy(m->keys + ((size_t)layer * m->length + (size_t)pos) * m->Hkv * m->D, k,
                       (size_t)m->Hkv * m->D * sizeof(float));
        return kvc_append(c->s, (uint32_t)layer, pos, k, v);
}

/* The full cache's attention at (layer, pos) over every position up to pos: its mass beyond
 * each window and its entropy (normalized by log(pos + 1)), added to the position's sums. */
static void attention_signals(struct mechanism *m, uint32_t layer, uint32_t pos, const float *q) {
        uint32_t group = m->H / m->Hkv;
        double scale = 1.0 / sqrt((double)m->D);
        for (uint32_t h = 0; h < m->H; h++) {
                const float *qh = q + (size_t)h * m->D;
                const float *k0 =
                        m->keys + (size_t)layer * m->length * m->Hkv * m->D + (size_t)(h / group) * m->D;
                double mx = -INFINITY, sum = 0;
                for (uint32_t j = 0; j <= pos; j++) {
                        const float *kj = k0 + (size_t)j * m->Hkv * m->D;
                        float dot = 0;
                        for (uint32_t d = 0; d < m->D; d++)
                                dot += qh[d] * kj[d];
                        m->probs[j] = dot * scale;
                        mx = m->probs[j] > mx ? m->probs[j] : mx;
                }
                for (uint32_t j = 0; j <= pos; j++)
                        sum += m->probs[j] = exp(m->probs[j] - mx);
                double ent = 0;
                for (uint32_t j = 0; j <= pos; j++) {
                        double p = m->probs[j] / sum;
                        m->probs[j] = p;
                        ent -= p > 0 ? p * log(p) : 0;
                }
                if (pos > 0)
                        m->attn_ent[pos] += ent / log((double)pos + 1);
                for (uint32_t w = 0; w < m->n_w; w++) {
                        double beyond = 0, sinks = 0;
                        for (uint32_t j = 0; j + m->W[w] <= pos; j++)
                                beyond += m->probs[j], sinks += j < MECH_SINKS ? m->probs[j] : 0;
                        m->mass[(size_t)w * m->length + pos] += beyond;
                        m->mass_ns[(size_t)w * m->length + pos] += beyond - sinks;
                }
        }
}

static int mech_attend(void *ctx, int layer, int pos, const float *q, float *out) {
        struct mech_ctx *c = ctx;
        if (c->full && (uint32_t)pos < c->m->length)
                attention_signals(c->m, (uint32_t)layer, (uint32_t)pos, q);
        return kvc_attend(c->s, (uint32_t)layer, q, out);
}

static const struct model_cache_ops mech_ops = { .store = mech_store, .attend = mech_attend };

/* The full cache and one window per W, in one batch over the document ids[0..T). */
static int run_doc(struct mechanism *m, const int *ids, uint32_t T) {
        struct niah *n = &m->n;
        uint32_t C = n->n_cfg, V = (uint32_t)n->mc->vocab_size;
        struct mech_ctx ctx[NIAH_MAX_CONFIGS] = { 0 };
        struct kvc_session *ss[NIAH_MAX_CONFIGS] = { 0 };
        float *ref = malloc(V * sizeof(float)), *lp = malloc(V * sizeof(float));
        int r = ref && lp ? 0 : -ENOMEM;
        memset(m->mass, 0, (size_t)m->n_w * m->length * sizeof(double));
        memset(m->mass_ns, 0, (size_t)m->n_w * m->length * sizeof(double));
        memset(m->attn_ent, 0, m->length * sizeof(double));
        for (uint32_t c = 0; r == 0 && c < C; c++) {
                ctx[c] = (struct mech_ctx){ .m = m, .full = c == 0 };
                r = lab_session_open(n, &n->cfg[c], 0, "mechanism", &ss[c]);
                ctx[c].s = ss[c];
        }
        struct model_row rows[MODEL_MAX_ROWS];
        uint32_t pos = 0, before[NIAH_MAX_CONFIGS];
        while (r == 0 && pos + 1 < T) {
                uint32_t k = T - 1 - pos, most = MODEL_MAX_LOGIT_ROWS / C;
                k = k < most ? k : most;
                k = lab_chunk(ss, C, m->L, k < n->o->chunk ? k : n->o->chunk);
                for (uint32_t c = 0; c < C; c++)
                        before[c] = kvc_layer_tokens(ss[c], 0);
                uint32_t nr = 0;
                for (uint32_t c = 0; c < C; c++)
                        for (uint32_t j = 0; j < k; j++)
                                rows[nr++] = (struct model_row){ .token = ids[pos + j],
                                                                 .pos = (int)(pos + j),
                                                                 .ctx = &ctx[c],
                                                                 .logits = true };
                float *logits;
                if ((r = model_forward_rows(n->model, rows, nr, &mech_ops, &logits)) < 0) {
                        fprintf(stderr, "kvc-eval mechanism: forward pass at %u: %s\n", pos, strerror(-r));
                        break;
                }
                for (uint32_t j = 0; r == 0 && j < k; j++) {
                        uint32_t p = pos + j;
                        const float *full = logits + (size_t)j * V;
                        struct kvc_summary sm;
                        if ((r = kvc_summarize(full, V, &sm)) < 0)
                                break;
                        m->conf[p] = kvc_confidence(&sm);
                        m->entropy[p] = sm.entropy, m->top1[p] = sm.top1_prob, m->margin[p] = sm.margin;
                        lab_log_softmax(full, V, ref);
                        for (uint32_t c = 1; c < C; c++) {
                                lab_log_softmax(logits + ((size_t)c * k + j) * V, V, lp);
                                m->kl[c - 1][p] = (float)lab_kl(ref, lp, V);
                                m->evicted[c - 1][p] = before[c] + j + 1 < p + 1;
                        }
                }
                for (uint32_t c = 0; r == 0 && c < C; c++) {
                        struct kvc_summary sm;
                        if ((r = kvc_summarize(logits + ((size_t)c * k + k - 1) * V, V, &sm)) == 0)
                                r = kvc_step(ctx[c].s, pos + k - 1, KVC_PHASE_DECODE, &sm);
                }
                if (r == 0 && (r = kvc_flush(n->client)) < 0)
                        fprintf(stderr, "kvc-eval mechanism: step %u: %s\n", pos + k - 1,
                                kvc_last_error(n->client));
                pos += k;
                lab_rows_done(n, nr);
        }
        for (uint32_t c = 0; c < C; c++)
                if (ctx[c].s)
                        kvc_session_close(ctx[c].s, NULL);
        free(ref);
        free(lp);
        return r;
}

/* The document's steps into each window's records, and its lines of the per-step CSV. */
static int collect(struct mechanism *m, uint32_t doc, uint32_t T, FILE *csv) {
        double heads = (double)m->L * m->H;
        for (uint32_t w = 0; w < m->n_w; w++) {
                struct mech_step *s = realloc(m->steps[w], (m->n_steps[w] + T) * sizeof(*s));
                if (!s)
                        return -ENOMEM;
                m->steps[w] = s;
        }
        for (uint32_t p = 1; p + 1 < T; p++) {
                fprintf(csv, "%u,%u,%.5f,%.5f,%.5f,%.4f,%.5f", doc, p, m->conf[p], m->entropy[p], m->top1[p],
                        m->margin[p], m->attn_ent[p] / heads);
                for (uint32_t w = 0; w < m->n_w; w++) {
                        double next = 0;
                        bool has_next = p + MECH_HORIZON + 1 < T;
                        for (uint32_t i = 1; has_next && i <= MECH_HORIZON; i++)
                                next += m->kl[w][p + i] / MECH_HORIZON;
                        double mass = m->mass[(size_t)w * m->length + p] / heads,
                               mass_ns = m->mass_ns[(size_t)w * m->length + p] / heads;
                        fprintf(csv, ",%d,%.5g,", m->evicted[w][p], m->kl[w][p]);
                        if (has_next)
                                fprintf(csv, "%.5g", next);
                        fprintf(csv, ",%.5f,%.5f", mass, mass_ns);
                        if (!m->evicted[w][p])
                                continue;
                        m->steps[w][m->n_steps[w]++] = (struct mech_step){
                                .doc = doc,
                                .signal = { m->conf[p], (float)mass, (float)(m->attn_ent[p] / heads),
                                            (float)mass_ns },
                                .target = { m->kl[w][p], has_next ? (float)next : NAN },
                        };
                }
                fputc('\n', csv);
        }
        return 0;
}

/* ---- correlations ---- */

static const double *rank_keys;
static int cmp_rank(const void *a, const void *b) {
        double x = rank_keys[*(const uint32_t *)a], y = rank_keys[*(const uint32_t *)b];
        return (x > y) - (x < y);
}

/* Ranks of x[0..n) (1-based, ties averaged) into r; idx is scratch of n. */
static void ranks(const double *x, uint32_t n, double *r, uint32_t *idx) {
        for (uint32_t i = 0; i < n; i++)
                idx[i] = i;
        rank_keys = x;
        qsort(idx, n, sizeof(*idx), cmp_rank);
        for (uint32_t i = 0; i < n;) {
                uint32_t j = i;
                while (j + 1 < n && x[idx[j + 1]] == x[idx[i]])
                        j++;
                for (uint32_t t = i; t <= j; t++)
                        r[idx[t]] = 0.5 * (i + j) + 1;
                i = j + 1;
        }
}

/* Pearson's r of x and y; NAN when either is constant. */
static double pearson(const double *x, const double *y, uint32_t n) {
        double mx = 0, my = 0, sxx = 0, syy = 0, sxy = 0;
        for (uint32_t i = 0; i < n; i++)
                mx += x[i] / n, my += y[i] / n;
        for (uint32_t i = 0; i < n; i++) {
                double a = x[i] - mx, b = y[i] - my;
                sxx += a * a, syy += b * b, sxy += a * b;
        }
        return sxx > 0 && syy > 0 ? sxy / sqrt(sxx * syy) : NAN;
}

/* One sample of steps (all, or a bootstrap resample of documents): every signal against every
 * target, Pearson and Spearman. out[s][t][0] Pearson, [1] Spearman. */
struct sample {
        double *x[MECH_SIGNALS], *y[MECH_TARGETS], *rx[MECH_SIGNALS], *ry[MECH_TARGETS];
        uint32_t *idx;
        uint32_t n[MECH_TARGETS];
};

static void correlate(struct sample *S, const struct mech_step *st, const uint32_t *pick, uint32_t n_pick,
                      double out[MECH_SIGNALS][MECH_TARGETS][2]) {
        for (uint32_t t = 0; t < MECH_TARGETS; t++) {
                uint32_t n = 0;
                for (uint32_t i = 0; i < n_pick; i++) {
                        const struct mech_step *s = &st[pick[i]];
                        if (isnan(s->target[t]))
                                continue;
                        for (uint32_t g = 0; g < MECH_SIGNALS; g++)
                                S->x[g][n] = s->signal[g];
                        S->y[0][n] = s->target[t];
                        n++;
                }
                S->n[t] = n;
                ranks(S->y[0], n, S->ry[0], S->idx);
                for (uint32_t g = 0; g < MECH_SIGNALS; g++) {
                        ranks(S->x[g], n, S->rx[g], S->idx);
                        out[g][t][0] = n > 2 ? pearson(S->x[g], S->y[0], n) : NAN;
                        out[g][t][1] = n > 2 ? pearson(S->rx[g], S->ry[0], n) : NAN;
                }
        }
}

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return (x > y) - (x < y);
}

/* The 2.5% and 97.5% points of v[0..n) (sorted here), NAN when n is 0. */
static void percentiles(double *v, uint32_t n, double *lo, double *hi) {
        if (!n) {
                *lo = *hi = NAN;
                return;
        }
        qsort(v, n, sizeof(*v), cmp_double);
        *lo = v[(size_t)(0.025 * (n - 1))];
        *hi = v[(size_t)ceil(0.975 * (n - 1))];
}

/* Mean KL by decile of each signal (equal-count bins of the pooled steps). */
static void deciles(const struct mech_step *st, uint32_t n, FILE *md) {
        double *x = malloc((size_t)n * sizeof(double));
        uint32_t *idx = malloc((size_t)n * sizeof(uint32_t));
        double r[MECH_SIGNALS][MECH_BINS][4] = { 0 }; /* mean signal, KL, KL next 16, its count */
        if (!x || !idx || n < MECH_BINS) {
                free(x), free(idx);
                return;
        }
        for (uint32_t g = 0; g < MECH_SIGNALS; g++) {
                for (uint32_t i = 0; i < n; i++)
                        x[i] = st[i].signal[g], idx[i] = i;
                rank_keys = x;
                qsort(idx, n, sizeof(*idx), cmp_rank);
                for (uint32_t i = 0; i < n; i++) {
                        uint32_t b = (uint32_t)((uint64_t)i * MECH_BINS / n);
                        const struct mech_step *s = &st[idx[i]];
                        r[g][b][0] += s->signal[g];
                        r[g][b][1] += s->target[0];
                        if (!isnan(s->target[1]))
                                r[g][b][2] += s->target[1], r[g][b][3]++;
                }
        }
        fprintf(md,
                "\nMean KL by decile of each signal (%u steps; decile 1 is the signal's lowest tenth):\n\n| "
                "decile |",
                n);
        for (uint32_t g = 0; g < MECH_SIGNALS; g++)
                fprintf(md, " %s | KL | KL next %d |", signal_names[g], MECH_HORIZON);
        fprintf(md, "\n|---|");
        for (uint32_t g = 0; g < MECH_SIGNALS; g++)
                fprintf(md, "---|---|---|");
        fprintf(md, "\n");
        for (uint32_t b = 0; b < MECH_BINS; b++) {
                uint32_t cnt = (uint32_t)(((uint64_t)(b + 1) * n + MECH_BINS - 1) / MECH_BINS) -
                               (uint32_t)(((uint64_t)b * n + MECH_BINS - 1) / MECH_BINS);
                fprintf(md, "| %u |", b + 1);
                for (uint32_t g = 0; g < MECH_SIGNALS; g++)
                        fprintf(md, " %.4f | %.4f | %.4f |", r[g][b][0] / cnt, r[g][b][1] / cnt,
                                r[g][b][3] > 0 ? r[g][b][2] / r[g][b][3] : NAN);
                fprintf(md, "\n");
        }
        free(x), free(idx);
}

/* One window's report: correlations with their intervals, the paired comparisons, deciles. */
static int report_window(struct mechanism *m, uint32_t w, uint32_t docs, FILE *md, FILE *jsonl) {
        const struct mech_step *st = m->steps[w];
        uint32_t n = (uint32_t)m->n_steps[w], cap = 0;
        struct sample S = { 0 };
        uint32_t *first = calloc(docs + 1, sizeof(uint32_t));
        if (!first)
                return -ENOMEM;
        /* the steps of document d are [first[d], first[d + 1]); a resample holds at most docs times
         * the longest */
        for (uint32_t i = 0, d = 0; d <= docs; d++) {
                while (i < n && st[i].doc < d)
                        i++;
                first[d] = i;
        }
        for (uint32_t d = 0; d < docs; d++)
                cap = first[d + 1] - first[d] > cap ? first[d + 1] - first[d] : cap;
        cap = cap * docs + 1;
        uint32_t *pick = malloc((size_t)cap * sizeof(uint32_t));
        double *boot = malloc((size_t)MECH_BOOT * MECH_SIGNALS * MECH_TARGETS * 2 * sizeof(double)),
               *v = malloc(MECH_BOOT * sizeof(double));
        S.idx = malloc((size_t)cap * sizeof(uint32_t));
        int r = pick && boot && v && S.idx ? 0 : -ENOMEM;
        for (uint32_t g = 0; r == 0 && g < MECH_SIGNALS; g++)
                if (!(S.x[g] = malloc((size_t)cap * 2 * sizeof(double))))
                        r = -ENOMEM;
                else
                        S.rx[g] = S.x[g] + cap;
        if (r == 0 && !(S.y[0] = malloc((size_t)cap * 2 * sizeof(double))))
                r = -ENOMEM;
        if (r < 0)
                goto out;
        S.ry[0] = S.y[0] + cap;
        double est[MECH_SIGNALS][MECH_TARGETS][2];
        for (uint32_t i = 0; i < n; i++)
                pick[i] = i;
        correlate(&S, st, pick, n, est);
        uint64_t seed = 0x6d656368ull + w;
        for (uint32_t b = 0; b < MECH_BOOT; b++) {
                uint32_t np = 0;
                for (uint32_t d = 0; d < docs; d++) {
                        uint32_t doc = (uint32_t)(next_rand(&seed) % docs);
                        for (uint32_t i = first[doc]; i < first[doc + 1]; i++)
                                pick[np++] = i;
                }
                double one[MECH_SIGNALS][MECH_TARGETS][2];
                correlate(&S, st, pick, np, one);
                memcpy(boot + (size_t)b * MECH_SIGNALS * MECH_TARGETS * 2, one, sizeof(one));
        }
#define BOOT(b, g, t, k) boot[(((size_t)(b)*MECH_SIGNALS + (g)) * MECH_TARGETS + (t)) * 2 + (k)]
        fprintf(md,
                "\n### Window of %u tokens (%u steps after its first eviction, %u documents)\n\n| signal | "
                "target | "
                "Pearson r [95%% CI] | Spearman ρ [95%% CI] | steps |\n|---|---|---|---|---|\n",
                m->W[w], n, docs);
        for (uint32_t g = 0; g < MECH_SIGNALS; g++)
                for (uint32_t t = 0; t < MECH_TARGETS; t++) {
                        double lo[2], hi[2];
                        for (uint32_t k = 0; k < 2; k++) {
                                uint32_t nv = 0;
                                for (uint32_t b = 0; b < MECH_BOOT; b++)
                                        if (!isnan(BOOT(b, g, t, k)))
                                                v[nv++] = BOOT(b, g, t, k);
                                percentiles(v, nv, &lo[k], &hi[k]);
                        }
                        fprintf(md, "| %s | %s | %+.3f [%+.3f, %+.3f] | %+.3f [%+.3f, %+.3f] | %u |\n",
                                signal_words[g], t ? "KL over the next 16 steps" : "KL at the step",
                                est[g][t][0], lo[0], hi[0], est[g][t][1], lo[1], hi[1], S.n[t]);
                        char line[512];
                        snprintf(line, sizeof(line),
                                 "{\"label\":\"%s/%s/"
                                 "window-%u\",\"task\":\"mechanism\",\"window\":%u,\"signal\":\"%s\","
                                 "\"target\":\"%s\",\"documents\":%u,\"steps\":%u,\"pearson\":%.6f,\"pearson_"
                                 "lo\":%.6f,"
                                 "\"pearson_hi\":%.6f,\"spearman\":%.6f,\"spearman_lo\":%.6f,\"spearman_hi\":"
                                 "%.6f}\n",
                                 signal_names[g], target_names[t], m->W[w], m->W[w], signal_names[g],
                                 target_names[t], docs, S.n[t], est[g][t][0], lo[0], hi[0], est[g][t][1],
                                 lo[1], hi[1]);
                        fputs(line, jsonl);
                        fputs(line, stdout);
                }
        fprintf(md,
                "\nDoes an attention signal predict the cost better than confidence? The paired difference "
                "|ρ(attention)| − |ρ(confidence)| (Spearman), bootstrapped over documents:\n\n");
        for (uint32_t g = 1; g < MECH_SIGNALS; g++)
                for (uint32_t t = 0; t < MECH_TARGETS; t++) {
                        uint32_t nv = 0;
                        for (uint32_t b = 0; b < MECH_BOOT; b++) {
                                double d = fabs(BOOT(b, g, t, 1)) - fabs(BOOT(b, 0, t, 1));
                                if (!isnan(d))
                                        v[nv++] = d;
                        }
                        struct stats_ci ci = { .mean = fabs(est[g][t][1]) - fabs(est[0][t][1]), .n = docs };
                        percentiles(v, nv, &ci.lo, &ci.hi);
                        fprintf(md, "- %s, %s: %+.3f [%+.3f, %+.3f] — %s\n", signal_words[g],
                                t ? "KL over the next 16 steps" : "KL at the step", ci.mean, ci.lo, ci.hi,
                                !nv                    ? "not measured"
                                : docs < MECH_MIN_DOCS ? "too few documents for a verdict"
                                                       : stats_verdict(&ci, 0, false));
                }
#undef BOOT
        deciles(st, n, md);
out:
        for (uint32_t g = 0; g < MECH_SIGNALS; g++)
                free(S.x[g]);
        free(S.y[0]);
        free(S.idx);
        free(pick), free(first), free(boot), free(v);
        return r;
}

static void mech_free(struct mechanism *m) {
        free(m->keys), free(m->probs), free(m->mass), free(m->mass_ns), free(m->attn_ent);
        free(m->conf), free(m->entropy), free(m->top1), free(m->margin);
        for (uint32_t w = 0; w < NIAH_MAX_FRACTIONS; w++)
                free(m->kl[w]), free(m->evicted[w]), free(m->steps[w]);
        free(m);
}

static int mech_alloc(struct mechanism *m) {
        const struct model_config *mc = m->n.mc;
        size_t T = m->length;
        m->L = (uint32_t)mc->n_layers, m->H = (uint32_t)mc->n_heads, m->Hkv = (uint32_t)mc->n_kv_heads;
        m->D = (uint32_t)(mc->dim / mc->n_heads);
        m->keys = malloc((size_t)m->L * T * m->Hkv * m->D * sizeof(float));
        m->probs = malloc(T * sizeof(double));
        m->mass = malloc((size_t)m->n_w * T * sizeof(double));
        m->mass_ns = malloc((size_t)m->n_w * T * sizeof(double));
        m->attn_ent = malloc(T * sizeof(double));
        m->conf = calloc(T, sizeof(float)), m->entropy = calloc(T, sizeof(float));
        m->top1 = calloc(T, sizeof(float)), m->margin = calloc(T, sizeof(float));
        bool ok = m->keys && m->probs && m->mass && m->mass_ns && m->attn_ent && m->conf && m->entropy &&
                  m->top1 && m->margin;
        for (uint32_t w = 0; w < m->n_w; w++) {
                m->kl[w] = calloc(T, sizeof(float));
                m->evicted[w] = calloc(T, sizeof(bool));
                ok = ok && m->kl[w] && m->evicted[w];
        }
        return ok ? 0 : -ENOMEM;
}

int mechanism_run(const struct niah_options *o) {
        struct mechanism *m = calloc(1, sizeof(*m));
        if (!m)
                return -ENOMEM;
        struct niah *n = &m->n;
        *n = (struct niah){ .o = o, .rng = o->seed ? o->seed : 0xa4093822299f31d0ull };
        uint32_t docs = o->needles;
        m->length = o->lengths[0];
        int r = docs >= 2 && m->length >= 64 ? 0 : -EINVAL;
        /* the configurations: the full cache, then a window per fraction */
        lab_config_add(n, NULL, 0, 0);
        static const struct niah_family window = { "window", "window", { 0 }, { 0 }, 0 };
        for (uint32_t i = 0; r == 0 && i < o->n_fractions; i++) {
                uint32_t W = (uint32_t)lround(o->fractions[i] * m->length);
                if (W < 1 || W + MECH_HORIZON + 2 >= m->length)
                        r = -EINVAL;
                m->W[m->n_w++] = W;
                struct niah_config *c = lab_config_add(n, &window, o->fractions[i], W);
                if (c)
                        snprintf(c->label, sizeof(c->label), "window-%u", W);
        }
        if (r < 0) {
                fprintf(stderr, "kvc-eval mechanism: every window must be shorter than the documents\n");
                free(m);
                return r;
        }
        if ((r = lab_open(n, "mechanism")) < 0 && !n->model) {
                free(m);
                return r;
        }
        if (r == 0)
                r = mech_alloc(m);
        FILE *csv = r == 0 ? open_partial(o, "mechanism_steps.csv") : NULL,
             *md = r == 0 ? open_partial(o, "mechanism.md") : NULL,
             *jsonl = r == 0 ? open_partial(o, "mechanism.jsonl") : NULL;
        if (r == 0 && (!csv || !md || !jsonl))
                r = -errno;
        if (r == 0) {
                fprintf(csv, "document,pos,confidence,entropy,top1_prob,margin,attn_entropy");
                for (uint32_t w = 0; w < m->n_w; w++)
                        fprintf(csv,
                                ",evicted_w%u,kl_w%u,kl_next16_w%u,attn_mass_beyond_w%u,attn_mass_beyond_"
                                "nosink_w%u",
                                m->W[w], m->W[w], m->W[w], m->W[w], m->W[w]);
                fprintf(csv, "\n");
                fprintf(md,
                        "# The mechanism: does confidence predict what a short cache costs? "
                        "SmolLM2-135M-Instruct "
                        "through kvcd\n\n"
                        "Documents: %u of %u tokens, TinyStories validation stories (test split, stories %u "
                        "on; "
                        "CDLA-Sharing-1.0) joined and cut at the token count, teacher-forced through the "
                        "full "
                        "cache and windows of %u",
                        docs, m->length, NIAH_TEST_FIRST, m->W[0]);
                for (uint32_t w = 1; w < m->n_w; w++)
                        fprintf(md, " and %u", m->W[w]);
                fprintf(md,
                        " tokens in one batch (FP16 keys and values). At each step after a window's first "
                        "eviction: the full cache's confidence (CONF-KV's 0.4 (1 − H/log V) + 0.3 σ(margin) "
                        "+ 0.3 "
                        "p1 of the logits summary kvcd gets), the full cache's attention mass on the "
                        "positions "
                        "older than the window's W newest (mean over layers and query heads; also without "
                        "the first %d "
                        "positions, the attention sinks a window loses and CONF-KV keeps) and its attention "
                        "entropy (normalized by log of the positions seen), against KL(full ‖ window) at "
                        "that step "
                        "and its mean over the next %d steps. Intervals: percentile bootstrap over documents "
                        "(%d "
                        "resamples; a verdict needs at least %d documents); a difference whose interval "
                        "contains 0 is "
                        "no difference. Seed %llu.\n",
                        MECH_SINKS, MECH_HORIZON, MECH_BOOT, MECH_MIN_DOCS, (unsigned long long)n->rng);
        }
        int *ids = r == 0 ? malloc(((size_t)m->length + 8) * sizeof(int)) : NULL;
        if (r == 0 && !ids)
                r = -ENOMEM;
        n->t0 = now_s();
        n->rows_total = (double)docs * n->n_cfg * m->length;
        for (uint32_t d = 0; r == 0 && d < docs; d++) {
                struct textbuf t = { 0 };
                size_t got = 0;
                if ((r = haystack(n, m->length, &t)) == 0)
                        r = text_encode(n->tok, t.s, ids, (size_t)m->length + 8, &got);
                free(t.s);
                uint32_t T = (uint32_t)(got < m->length ? got : m->length);
                if (r == 0 && T < m->length / 2)
                        r = -ENODATA;
                if (r == 0)
                        r = run_doc(m, ids, T);
                if (r == 0)
                        r = collect(m, d, T, csv);
                progress(n, "mechanism", m->length, d + 1);
        }
        for (uint32_t w = 0; r == 0 && w < m->n_w; w++)
                r = report_window(m, w, docs, md, jsonl);
        free(ids);
        if (csv)
                fclose(csv);
        if (md)
                fclose(md);
        if (jsonl)
                fclose(jsonl);
        if (csv && md && jsonl) {
                finish_partial(o, "mechanism_steps.csv", r == 0);
                finish_partial(o, "mechanism.md", r == 0);
                finish_partial(o, "mechanism.jsonl", r == 0);
        }
        if (r == 0)
                fprintf(stderr, "kvc-eval mechanism: %.0f s; results in %s\n", now_s() - n->t0, o->out_dir);
        lab_close(n);
        mech_free(m);
        return r;
}
