/* longdoc.c: long documents through kvcd, batched (kvc-eval --task longdoc; longdoc.h). */
#define _GNU_SOURCE
#include "longdoc.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvc.h"
#include "kvccache.h"
#include "lab.h"
#include "model.h"
#include "stats.h"
#include "text.h"

#define DOC_NEAR 0.1 /* a configuration this close in bytes stands in when none bracket them */

/* The families: the curves (at every fraction) that the targets interpolate along, then the points
 * (at the smallest fraction only) the targets place on them. */
static const struct niah_family doc_curves[] = {
        { "window", "window", { 0 }, { 0 }, 0 },
        { "conf-fixed", "conf", { "gate" }, { "fixed" }, 1 },
        { "conf-int8", "conf", { "gate", "int8" }, { "fixed", "1" }, 2 },
};
static const struct niah_family doc_points[] = {
        { "conf-defer", "conf", { "gate" }, { "defer" }, 1 },
        { "conf-attention", "conf", { "gate" }, { "attention" }, 1 },
        { "prob-none", "prob", { "correction" }, { "none" }, 1 },
        { "prob-ht", "prob", { "correction" }, { "ht" }, 1 },
};
/* quick (make test): the window and conf-fixed curves and the attention gate */
#define QUICK_CURVES 2
#define QUICK_POINTS 1

struct doc_result {
        double nll, kl, top1, n, charged, tokens;
        uint64_t peak_charged;
};

static void add_config(struct niah *n, const struct niah_family *fam, double fraction, uint32_t length) {
        struct niah_config *c = lab_config_add(n, fam, fraction, (uint32_t)lround(fraction * length));
        if (c)
                snprintf(c->label, sizeof(c->label), "%s-%u", fam->label, c->budget);
}

static void make_doc_configs(struct niah *n, uint32_t length) {
        const struct niah_options *o = n->o;
        size_t curves = o->quick ? QUICK_CURVES : sizeof(doc_curves) / sizeof(doc_curves[0]);
        size_t points = o->quick ? QUICK_POINTS : sizeof(doc_points) / sizeof(doc_points[0]);
        double smallest = o->fractions[0];
        for (uint32_t i = 1; i < o->n_fractions; i++)
                smallest = o->fractions[i] < smallest ? o->fractions[i] : smallest;
        n->n_cfg = 0;
        lab_config_add(n, NULL, 0, 0);
        for (size_t f = 0; f < curves; f++)
                for (uint32_t i = 0; i < o->n_fractions; i++)
                        add_config(n, &doc_curves[f], o->fractions[i], length);
        for (size_t f = 0; f < points; f++)
                add_config(n, &doc_points[o->quick ? f + 1 : f], smallest, length);
}

/* One document through every configuration: sums over the positions from score_from on. */
static int run_doc(struct niah *n, const int *ids, uint32_t length, uint32_t score_from,
                   struct doc_result *res) {
        const struct model_config *mc = n->mc;
        uint32_t C = n->n_cfg, V = (uint32_t)mc->vocab_size, L = (uint32_t)mc->n_layers;
        struct kvc_session *ss[NIAH_MAX_CONFIGS] = { 0 };
        float *ref = malloc(V * sizeof(float)), *lp = malloc(V * sizeof(float));
        double weight = 0;
        int r = ref && lp ? 0 : -ENOMEM;
        memset(res, 0, C * sizeof(*res));
        for (uint32_t c = 0; r == 0 && c < C; c++)
                r = lab_session_open(n, &n->cfg[c], 0, "longdoc", &ss[c]);
        struct model_row rows[MODEL_MAX_ROWS];
        uint32_t pos = 0;
        while (r == 0 && pos + 1 < length) {
                uint32_t k = length - 1 - pos, most = MODEL_MAX_LOGIT_ROWS / C;
                k = k < most ? k : most;
                k = lab_chunk(ss, C, L, k < n->o->chunk ? k : n->o->chunk);
                uint32_t nr = 0;
                for (uint32_t c = 0; c < C; c++)
                        for (uint32_t j = 0; j < k; j++)
                                rows[nr++] = (struct model_row){ .token = ids[pos + j],
                                                                 .pos = (int)(pos + j),
                                                                 .ctx = ss[c],
                                                                 .logits = true };
                float *logits;
                if ((r = model_forward_rows(n->model, rows, nr, &kvccache_ops, &logits)) < 0) {
                        fprintf(stderr, "kvc-eval longdoc: forward pass at %u: %s (%s)\n", pos, strerror(-r),
                                kvc_last_error(n->client));
                        break;
                }
                for (uint32_t j = 0; j < k; j++) {
                        uint32_t p = pos + j;
                        if (p + 1 < score_from)
                                continue;
                        /* the full cache's distribution (configuration 0) is the reference */
                        uint32_t ref_top = 0;
                        for (uint32_t c = 0; c < C; c++) {
                                const float *lg = logits + ((size_t)c * k + j) * V;
                                float *out = c == 0 ? ref : lp;
                                uint32_t best = lab_log_softmax(lg, V, out);
                                if (c == 0)
                                        ref_top = best;
                                res[c].nll -= out[ids[p + 1]];
                                res[c].kl += c ? lab_kl(ref, lp, V) : 0;
                                res[c].top1 += best == ref_top;
                                res[c].n++;
                        }
                }
                for (uint32_t c = 0; r == 0 && c < C; c++) {
                        struct kvc_summary sm;
                        const float *lg = logits + ((size_t)c * k + k - 1) * V;
                        if ((r = kvc_summarize(lg, V, &sm)) == 0)
                                r = kvc_step(ss[c], pos + k - 1, KVC_PHASE_DECODE, &sm);
                }
                if (r == 0 && (r = kvc_flush(n->client)) < 0)
                        fprintf(stderr, "kvc-eval longdoc: step %u: %s\n", pos + k - 1,
                                kvc_last_error(n->client));
                for (uint32_t c = 0; r == 0 && c < C; c++)
                        held_add(ss[c], L, k, &res[c].charged, &res[c].tokens);
                weight += k;
                pos += k;
                lab_rows_done(n, nr);
        }
        for (uint32_t c = 0; c < C; c++)
                if (ss[c])
                        held_close(ss[c], weight, &res[c].charged, &res[c].tokens, &res[c].peak_charged);
        free(ref);
        free(lp);
        return r;
}

/* ---- the report ---- */

struct doc_report {
        const struct niah *n;
        const struct doc_result *res; /* [document][configuration] */
        uint32_t docs, length;
        double bytes[NIAH_MAX_CONFIGS]; /* average charged bytes, mean over documents */
};

enum doc_metric { DOC_NLL, DOC_KL };

static double metric(const struct doc_report *R, uint32_t d, uint32_t c, enum doc_metric m) {
        const struct doc_result *x = &R->res[(size_t)d * R->n->n_cfg + c];
        return m == DOC_NLL ? x->nll : x->kl;
}

static int find_family(const struct doc_report *R, const char *fam) {
        for (uint32_t c = 1; c < R->n->n_cfg; c++)
                if (strcmp(R->n->cfg[c].fam->label, fam) == 0)
                        return (int)c;
        return -1;
}

static int find_label(const struct doc_report *R, const char *label) {
        for (uint32_t c = 0; c < R->n->n_cfg; c++)
                if (strcmp(R->n->cfg[c].label, label) == 0)
                        return (int)c;
        return -1;
}

/* Family fam's sums of m at `want` average charged bytes, document by document (x[0..docs)):
 * linear between the two configurations around want; when none bracket it, the one nearest in bytes
 * if within DOC_NEAR of want (*lo == *hi), else -ERANGE. *lo and *hi name them. */
static int at_bytes(const struct doc_report *R, const char *fam, double want, enum doc_metric m, double *x,
                    int *lo, int *hi) {
        const struct niah *n = R->n;
        *lo = *hi = -1;
        for (uint32_t c = 1; c < n->n_cfg; c++) {
                if (strcmp(n->cfg[c].fam->label, fam) != 0)
                        continue;
                double by = R->bytes[c];
                if (by <= want && (*lo < 0 || by > R->bytes[*lo]))
                        *lo = (int)c;
                if (by >= want && (*hi < 0 || by < R->bytes[*hi]))
                        *hi = (int)c;
        }
        if (*lo < 0 || *hi < 0) {
                int near = *lo >= 0 ? *lo : *hi;
                if (near < 0 || fabs(R->bytes[near] - want) > DOC_NEAR * want)
                        return -ERANGE;
                *lo = *hi = near;
        }
        double blo = R->bytes[*lo], bhi = R->bytes[*hi], t = bhi > blo ? (want - blo) / (bhi - blo) : 0;
        for (uint32_t d = 0; d < R->docs; d++)
                x[d] = (1 - t) * metric(R, d, (uint32_t)*lo, m) + t * metric(R, d, (uint32_t)*hi, m);
        return 0;
}

static const char *where(const struct doc_report *R, int lo, int hi, char *buf, size_t len) {
        if (lo != hi)
                snprintf(buf, len, "between %s and %s", R->n->cfg[lo].label, R->n->cfg[hi].label);
        else
                snprintf(buf, len, "at %s (%.0f bytes; none bracket them)", R->n->cfg[lo].label,
                         R->bytes[lo]);
        return buf;
}

static void target_line(FILE *jsonl, const struct doc_report *R, const char *target, const char *label,
                        const struct stats_ci *ci, const char *verdict) {
        fprintf(jsonl,
                "{\"task\":\"longdoc\",\"length\":%u,\"target\":\"%s\",\"label\":\"%s\",\"estimate\":%.6f,"
                "\"lo\":%.6f,\"hi\":%.6f,\"documents\":%u,\"verdict\":\"%s\"}\n",
                R->length, target, label, ci->mean, ci->lo, ci->hi, R->docs, verdict);
}

/* Target 1: CONF-KV+INT8 at the bytes of the smallest window closes >= 80% of its perplexity gap:
 * sum(NLL_window - NLL_conf8) / sum(NLL_window - NLL_full) over documents, clustered. */
static void gap_closed(const struct doc_report *R, FILE *md, FILE *jsonl, double *x, double *y, double *w) {
        const struct niah *n = R->n;
        int win = -1, lo, hi;
        for (uint32_t c = 1; c < n->n_cfg; c++)
                if (strcmp(n->cfg[c].fam->label, "window") == 0 &&
                    (win < 0 || n->cfg[c].budget < n->cfg[win].budget))
                        win = (int)c;
        fprintf(md, "- **CONF-KV+INT8 closes at least 80%% of the window's perplexity gap at the window's "
                    "bytes**: ");
        if (win < 0 || at_bytes(R, "conf-int8", R->bytes[win], DOC_NLL, x, &lo, &hi) < 0) {
                fprintf(md, "not measured (conf-int8's configurations do not bracket %s's bytes)\n",
                        win < 0 ? "a window" : n->cfg[win].label);
                return;
        }
        for (uint32_t d = 0; d < R->docs; d++) {
                y[d] = metric(R, d, (uint32_t)win, DOC_NLL) - x[d];
                w[d] = metric(R, d, (uint32_t)win, DOC_NLL) - metric(R, d, 0, DOC_NLL);
        }
        struct stats_ci gc;
        char buf[160];
        if (stats_ratio_ci(y, w, R->docs, &gc) < 0) {
                fprintf(md, "not measured (the window's gap sums to 0)\n");
                return;
        }
        const char *v = stats_verdict(&gc, 0.8, false);
        fprintf(md,
                "%s (%.0f bytes, %.1f%% of the full cache's), conf-int8 read %s: %.0f%% [%.0f%%, %.0f%%] of "
                "the "
                "gap closed — **%s**\n",
                n->cfg[win].label, R->bytes[win], 100 * R->bytes[win] / R->bytes[0],
                where(R, lo, hi, buf, sizeof(buf)), 100 * gc.mean, 100 * gc.lo, 100 * gc.hi, v);
        target_line(jsonl, R, "gap_closed", n->cfg[win].label, &gc, v);
}

/* Target 2: a gate against its own fixed-budget ranking (conf-fixed) at the gate's bytes: the paired
 * difference of NLL and of KL per document. The gates' own differences are kept in dn[] for the
 * comparison between them. */
static void gates(const struct doc_report *R, FILE *md, FILE *jsonl, double *x, double *y, double *w) {
        const struct niah *n = R->n;
        static const char *const gated[] = { "conf-defer", "conf-attention" };
        double *diff[2] = { NULL, NULL };
        fprintf(md, "- **A gate beats its own fixed-budget ranking at equal average bytes** (the gated "
                    "configuration minus conf-fixed read at its bytes; per token, paired by document):\n");
        for (size_t g = 0; g < 2; g++) {
                int c = find_family(R, gated[g]), lo, hi;
                if (c < 0)
                        continue;
                if (at_bytes(R, "conf-fixed", R->bytes[c], DOC_NLL, x, &lo, &hi) < 0) {
                        fprintf(md,
                                "  - %s (%.0f bytes): conf-fixed does not bracket its bytes; not measured\n",
                                n->cfg[c].label, R->bytes[c]);
                        continue;
                }
                struct stats_ci dn, dk;
                char buf[160];
                for (uint32_t d = 0; d < R->docs; d++) {
                        y[d] = metric(R, d, (uint32_t)c, DOC_NLL);
                        w[d] = R->res[(size_t)d * n->n_cfg].n;
                }
                stats_paired_ci(y, x, w, R->docs, &dn);
                diff[g] = malloc(R->docs * sizeof(double));
                for (uint32_t d = 0; diff[g] && d < R->docs; d++)
                        diff[g][d] = y[d] - x[d];
                at_bytes(R, "conf-fixed", R->bytes[c], DOC_KL, x, &lo, &hi);
                for (uint32_t d = 0; d < R->docs; d++)
                        y[d] = metric(R, d, (uint32_t)c, DOC_KL);
                stats_paired_ci(y, x, w, R->docs, &dk);
                const char *v = stats_compare(&dn, true), *vk = stats_compare(&dk, true);
                fprintf(md,
                        "  - %s (%.0f bytes, %.1f%% of the full cache's; conf-fixed %s): ΔNLL %+.4f [%+.4f, "
                        "%+.4f] — **%s**; ΔKL %+.4f [%+.4f, %+.4f] — %s\n",
                        n->cfg[c].label, R->bytes[c], 100 * R->bytes[c] / R->bytes[0],
                        where(R, lo, hi, buf, sizeof(buf)), dn.mean, dn.lo, dn.hi, v, dk.mean, dk.lo, dk.hi,
                        vk);
                target_line(jsonl, R, "gate_vs_fixed_nll", n->cfg[c].label, &dn, v);
                target_line(jsonl, R, "gate_vs_fixed_kl", n->cfg[c].label, &dk, vk);
        }
        if (diff[0] && diff[1]) {
                struct stats_ci dd;
                for (uint32_t d = 0; d < R->docs; d++)
                        w[d] = R->res[(size_t)d * n->n_cfg].n;
                stats_paired_ci(diff[1], diff[0], w, R->docs, &dd);
                const char *v = stats_compare(&dd, true);
                fprintf(md,
                        "  - the attention gate's ΔNLL minus the confidence gate's (each against conf-fixed "
                        "at its own bytes): %+.4f [%+.4f, %+.4f] — %s%s\n",
                        dd.mean, dd.lo, dd.hi,
                        strcmp(v, "better") == 0 || strcmp(v, "worse") == 0 ? "attention " : "", v);
                target_line(jsonl, R, "attention_vs_confidence_gate", "conf-attention", &dd, v);
        }
        free(diff[0]);
        free(diff[1]);
}

/* Target 3: prob's decode-time corrections lower KL against plain sampling (prob-none) at the same
 * budget by at least 20%: sum(KL_corr - KL_none) / sum(KL_none), clustered by document. */
static void corrections(const struct doc_report *R, FILE *md, FILE *jsonl, double *y, double *w) {
        const struct niah *n = R->n;
        static const char *const corr[] = { "prob-ht" };
        if (find_family(R, "prob-none") < 0)
                return; /* not in this suite (quick) */
        fprintf(md,
                "- **The decode-time correction lowers KL against plain sampling at equal budget by at least "
                "20%%** (the relative change of KL(full‖policy) against prob-none, clustered by "
                "document):\n");
        for (size_t k = 0; k < sizeof(corr) / sizeof(corr[0]); k++) {
                char label[64];
                int c = find_family(R, corr[k]), none;
                if (c < 0)
                        continue;
                snprintf(label, sizeof(label), "prob-none-%u", n->cfg[c].budget);
                if ((none = find_label(R, label)) < 0)
                        continue;
                for (uint32_t d = 0; d < R->docs; d++) {
                        w[d] = metric(R, d, (uint32_t)none, DOC_KL);
                        y[d] = metric(R, d, (uint32_t)c, DOC_KL) - w[d];
                }
                struct stats_ci rel;
                if (stats_ratio_ci(y, w, R->docs, &rel) < 0)
                        continue;
                const char *v = stats_verdict(&rel, 0.2, true);
                fprintf(md,
                        "  - %s against %s (%.0f and %.0f bytes): KL %+.0f%% [%+.0f%%, %+.0f%%] — **%s**\n",
                        n->cfg[c].label, label, R->bytes[c], R->bytes[none], 100 * rel.mean, 100 * rel.lo,
                        100 * rel.hi, v);
                target_line(jsonl, R, "correction_kl", n->cfg[c].label, &rel, v);
        }
}

static void write_doc_outputs(struct niah *n, uint32_t length, uint32_t docs, const struct doc_result *res,
                              FILE *jsonl, FILE *md) {
        uint32_t C = n->n_cfg;
        struct doc_report R = { .n = n, .res = res, .docs = docs, .length = length };
        double *y = malloc(docs * sizeof(double)), *w = malloc(docs * sizeof(double)),
               *f = malloc(docs * sizeof(double));
        if (!y || !w || !f) {
                free(y), free(w), free(f);
                return;
        }
        for (uint32_t c = 0; c < C; c++)
                for (uint32_t d = 0; d < docs; d++)
                        R.bytes[c] += res[(size_t)d * C + c].charged / docs;
        fprintf(md, "\n### Documents of %u tokens (%u documents, %.0f positions scored each)\n\n", length,
                docs, res[0].n);
        fprintf(md, "| configuration | ppl [95%% CI] | ΔNLL vs full [95%% CI] | KL(full‖policy) [95%% CI] | "
                    "top-1 agree "
                    "| charged bytes avg (of full) | charged peak | tokens held "
                    "|\n|---|---|---|---|---|---|---|---|\n");
        for (uint32_t c = 0; c < C; c++) {
                struct stats_ci ppl = { 0 }, dn = { 0 }, kl = { 0 };
                double top1 = 0, n_tok = 0, tokens = 0, peak = 0;
                for (uint32_t d = 0; d < docs; d++) {
                        const struct doc_result *x = &res[(size_t)d * C + c];
                        y[d] = x->nll;
                        w[d] = x->n;
                        f[d] = res[(size_t)d * C].nll;
                        top1 += x->top1;
                        n_tok += x->n;
                        tokens += x->tokens / docs;
                        peak = (double)x->peak_charged > peak ? (double)x->peak_charged : peak;
                }
                stats_ratio_ci(y, w, docs, &ppl);
                stats_paired_ci(y, f, w, docs, &dn);
                for (uint32_t d = 0; d < docs; d++)
                        y[d] = res[(size_t)d * C + c].kl;
                stats_ratio_ci(y, w, docs, &kl);
                const struct niah_config *cf = &n->cfg[c];
                double charged = R.bytes[c];
                fprintf(jsonl,
                        "{\"task\":\"longdoc\",\"length\":%u,\"label\":\"%s\",\"family\":\"%s\",\"budget\":%"
                        "u,"
                        "\"documents\":%u,\"ppl\":%.6f,\"ppl_lo\":%.6f,\"ppl_hi\":%.6f,\"d_nll\":%.6f,\"d_"
                        "nll_lo\":%.6f,"
                        "\"d_nll_hi\":%.6f,\"kl\":%.6f,\"kl_lo\":%.6f,\"kl_hi\":%.6f,\"top1_agree\":%.6f,"
                        "\"avg_charged_bytes\":%.0f,\"peak_charged_bytes\":%.0f,\"avg_tokens_held\":%.1f}\n",
                        length, cf->label, cf->fam ? cf->fam->label : "full", cf->budget, docs, exp(ppl.mean),
                        exp(ppl.lo), exp(ppl.hi), dn.mean, dn.lo, dn.hi, kl.mean, kl.lo, kl.hi,
                        n_tok > 0 ? top1 / n_tok : 0, charged, peak, tokens);
                printf("{\"label\":\"%s\",\"task\":\"longdoc\",\"length\":%u,\"ppl\":%.6f,\"ppl_lo\":%.6f,"
                       "\"ppl_hi\":%.6f,\"kl\":%.6f,\"kl_lo\":%.6f,\"kl_hi\":%.6f,\"top1_agree\":%.6f,"
                       "\"avg_charged_bytes\":%.0f,\"documents\":%u}\n",
                       cf->label, length, exp(ppl.mean), exp(ppl.lo), exp(ppl.hi), kl.mean, kl.lo, kl.hi,
                       n_tok > 0 ? top1 / n_tok : 0, charged, docs);
                fprintf(md,
                        "| %s | %.3f [%.3f, %.3f] | %+.4f [%+.4f, %+.4f] %s | %.4f [%.4f, %.4f] | %.3f | "
                        "%.0f (%.0f%%) | %.0f | "
                        "%.0f |\n",
                        cf->label, exp(ppl.mean), exp(ppl.lo), exp(ppl.hi), dn.mean, dn.lo, dn.hi,
                        c ? stats_compare(&dn, true) : "", kl.mean, kl.lo, kl.hi,
                        n_tok > 0 ? top1 / n_tok : 0, charged,
                        R.bytes[0] > 0 ? 100 * charged / R.bytes[0] : 0, peak, tokens);
        }
        fprintf(md,
                "\n#### Targets at %u tokens (equal average charged bytes; 95%% intervals over %u "
                "documents)\n\n",
                length, docs);
        gap_closed(&R, md, jsonl, f, y, w);
        gates(&R, md, jsonl, f, y, w);
        corrections(&R, md, jsonl, y, w);
        free(y), free(w), free(f);
}

int longdoc_run(const struct niah_options *o) {
        struct niah n = { .o = o, .rng = o->seed ? o->seed : 0x13198a2e03707344ull };
        uint32_t docs = o->needles;
        int r = lab_open(&n, "longdoc");
        if (r < 0 && !n.model)
                return r;
        FILE *jsonl = r == 0 ? open_partial(o, "longdoc.jsonl") : NULL,
             *md = r == 0 ? open_partial(o, "longdoc.md") : NULL;
        if (r == 0 && (!jsonl || !md))
                r = -errno;
        if (r == 0)
                fprintf(md,
                        "# Long documents: SmolLM2-135M-Instruct through kvcd\n\n"
                        "Documents: TinyStories validation stories (test split, stories %u on; "
                        "CDLA-Sharing-1.0) joined by blank lines and cut at the token count; teacher-forced "
                        "through every configuration in one batch (FP16 keys and values), the full cache's "
                        "distribution at the same position the reference. Scored: the positions past the "
                        "largest budget plus a block. Intervals: 95%%, clustered by document; a ΔNLL whose "
                        "interval contains 0 is no difference. Bytes are what kvcd charges, averaged over "
                        "positions. Budgets in the labels are tokens per layer (a plan fires at budget + one "
                        "block). The policies' parameters are their defaults (docs/policies.md), fitted on "
                        "stories260K's tuning split, never on these documents; conf-attention's att_q (0.5) "
                        "is "
                        "the median, not fitted.\n",
                        NIAH_TEST_FIRST);
        n.t0 = now_s();
        for (uint32_t li = 0; li < o->n_lengths; li++) {
                make_doc_configs(&n, o->lengths[li]);
                n.rows_total += (double)docs * n.n_cfg * o->lengths[li];
        }
        for (uint32_t li = 0; r == 0 && li < o->n_lengths; li++) {
                uint32_t length = o->lengths[li], most = 0;
                make_doc_configs(&n, length);
                for (uint32_t c = 0; c < n.n_cfg; c++)
                        most = n.cfg[c].budget > most ? n.cfg[c].budget : most;
                struct doc_result *res = calloc((size_t)docs * n.n_cfg, sizeof(*res));
                int *ids = malloc(((size_t)length + 8) * sizeof(int));
                if (!res || !ids)
                        r = -ENOMEM;
                for (uint32_t d = 0; r == 0 && d < docs; d++) {
                        struct textbuf t = { 0 };
                        size_t got = 0;
                        if ((r = haystack(&n, length, &t)) == 0)
                                r = text_encode(n.tok, t.s, ids, (size_t)length + 8, &got);
                        free(t.s);
                        if (r == 0 && got < length / 2)
                                r = -ENODATA;
                        if (r == 0)
                                r = run_doc(&n, ids, (uint32_t)(got < length ? got : length), most + 16,
                                            res + (size_t)d * n.n_cfg);
                        progress(&n, "longdoc", length, d + 1);
                }
                if (r == 0)
                        write_doc_outputs(&n, length, docs, res, jsonl, md);
                free(res);
                free(ids);
        }
        if (jsonl)
                fclose(jsonl);
        if (md)
                fclose(md);
        if (jsonl && md) {
                finish_partial(o, "longdoc.jsonl", r == 0);
                finish_partial(o, "longdoc.md", r == 0);
        }
        lab_close(&n);
        return r;
}
