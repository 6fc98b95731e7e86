/* tiers.c: each tier of the precision ladder alone, in process (the contract is in tiers.h). */
#include "tiers.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lab.h"
#include "laddercache.h"
#include "stats.h"
#include "text.h"
#include "tier.h"

#define TIERS_WINDOW  128u
#define TIERS_CONFIGS 5u

static const char *const tier_names[TIERS_CONFIGS] = { "", "q8", "q4", "q3", "q2" };
static const char *const tier_labels[TIERS_CONFIGS] = { "f16", "q8 + 128 f16", "q4 + 128 f16", "q3 + 128 f16",
                                                        "q2 + 128 f16" };
/* the targets: the perplexity ratio to f16 at most 1 + this (q3 is the low tier; q2 is
 * measured and has no target) */
static const double ppl_target[TIERS_CONFIGS] = { 0, 0.002, 0.02, 0.05, NAN };

struct doc_score {
        double nll[TIERS_CONFIGS], kl[TIERS_CONFIGS], top1[TIERS_CONFIGS], n;
        double bytes[TIERS_CONFIGS], peak[TIERS_CONFIGS], full; /* averaged over positions; the most */
};

static int caches_new(struct niah *n, uint32_t max_tokens, struct ladder_cache **lc) {
        for (uint32_t c = 0; c < TIERS_CONFIGS; c++) {
                struct ladder_cache_config cf = { .dtype = BLOCK_DTYPE_F16,
                                                  .tier = tier_names[c],
                                                  .window = TIERS_WINDOW,
                                                  .seed = n->o->seed };
                int r = ladder_cache_new(n->mc, (int)max_tokens, &cf, &lc[c]);
                if (r < 0)
                        return r;
        }
        return 0;
}

static void caches_free(struct ladder_cache **lc) {
        for (uint32_t c = 0; c < TIERS_CONFIGS; c++)
                lc[c] = ladder_cache_free(lc[c]);
}

/* The rows of positions [pos, pos + k) of ids for every cache, logits for each when want. */
static uint32_t make_rows(struct model_row *rows, struct ladder_cache **lc, const int *ids, uint32_t pos,
                          uint32_t k, bool want) {
        uint32_t nr = 0;
        for (uint32_t c = 0; c < TIERS_CONFIGS; c++)
                for (uint32_t j = 0; j < k; j++)
                        rows[nr++] = (struct model_row){ .token = ids[pos + j],
                                                         .pos = (int)(pos + j),
                                                         .ctx = lc[c],
                                                         .logits = want || j == k - 1 };
        return nr;
}

static int run_doc(struct niah *n, struct ladder_cache **lc, const int *ids, uint32_t length,
                   uint32_t score_from, struct doc_score *ds) {
        uint32_t V = (uint32_t)n->mc->vocab_size;
        float *ref = malloc(V * sizeof(float)), *lp = malloc(V * sizeof(float));
        struct model_row rows[MODEL_MAX_ROWS];
        int r = ref && lp ? 0 : -ENOMEM;
        double positions = 0;
        memset(ds, 0, sizeof(*ds));
        for (uint32_t c = 0; c < TIERS_CONFIGS; c++)
                ladder_cache_reset(lc[c]);
        for (uint32_t pos = 0; r == 0 && pos + 1 < length;) {
                uint32_t k = length - 1 - pos, most = MODEL_MAX_LOGIT_ROWS / TIERS_CONFIGS;
                k = k < most ? k : most;
                k = k < n->o->chunk ? k : n->o->chunk;
                uint32_t nr = make_rows(rows, lc, ids, pos, k, true);
                float *logits;
                if ((r = model_forward_rows(n->model, rows, nr, &ladder_cache_ops, &logits)) < 0) {
                        fprintf(stderr, "kvc-eval tiers: forward pass at %u: %s\n", pos, strerror(-r));
                        break;
                }
                for (uint32_t j = 0; j < k; j++) {
                        uint32_t p = pos + j, ref_top = 0;
                        if (p + 1 < score_from)
                                continue;
                        for (uint32_t c = 0; c < TIERS_CONFIGS; c++) {
                                float *out = c == 0 ? ref : lp;
                                uint32_t best = lab_log_softmax(logits + ((size_t)c * k + j) * V, V, out);
                                if (c == 0)
                                        ref_top = best;
                                ds->nll[c] -= out[ids[p + 1]];
                                ds->kl[c] += c ? lab_kl(ref, lp, V) : 0;
                                ds->top1[c] += best == ref_top;
                        }
                        ds->n++;
                }
                for (uint32_t c = 0; c < TIERS_CONFIGS; c++) {
                        ds->bytes[c] += (double)ladder_cache_bytes(lc[c]) * k;
                        ds->peak[c] = fmax(ds->peak[c], (double)ladder_cache_peak_bytes(lc[c]));
                }
                ds->full += (double)ladder_cache_full_bytes(lc[0]) * k;
                positions += k;
                pos += k;
                lab_rows_done(n, nr);
        }
        for (uint32_t c = 0; c < TIERS_CONFIGS; c++)
                ds->bytes[c] /= positions > 0 ? positions : 1;
        ds->full /= positions > 0 ? positions : 1;
        free(ref);
        free(lp);
        return r;
}

/* One needle through every cache: exact match of the greedy answer (teacher forced). */
static int run_needle(struct niah *n, struct ladder_cache **lc, const struct needle *nd, double *hit) {
        uint32_t V = (uint32_t)n->mc->vocab_size, total = nd->n_prompt + nd->n_answer - 1;
        struct model_row rows[MODEL_MAX_ROWS];
        int *ids = malloc(((size_t)total + 1) * sizeof(int));
        if (!ids)
                return -ENOMEM;
        memcpy(ids, nd->ids, nd->n_prompt * sizeof(int));
        memcpy(ids + nd->n_prompt, nd->answer, (nd->n_answer - 1) * sizeof(int));
        for (uint32_t c = 0; c < TIERS_CONFIGS; c++) {
                ladder_cache_reset(lc[c]);
                hit[c] = 1;
        }
        int r = 0;
        for (uint32_t pos = 0; r == 0 && pos < total;) {
                uint32_t k = pos < nd->n_prompt - 1 ? nd->n_prompt - 1 - pos : 1,
                         most = MODEL_MAX_ROWS / TIERS_CONFIGS;
                k = k < most ? k : most;
                k = k < n->o->chunk ? k : n->o->chunk;
                uint32_t nr = make_rows(rows, lc, ids, pos, k, false), last = pos + k - 1;
                float *logits;
                if ((r = model_forward_rows(n->model, rows, nr, &ladder_cache_ops, &logits)) < 0)
                        break;
                if (last + 1 >= nd->n_prompt) /* predicts an answer token */
                        for (uint32_t c = 0; c < TIERS_CONFIGS; c++) {
                                const float *lg = logits + (size_t)c * V;
                                uint32_t best = 0;
                                for (uint32_t v = 1; v < V; v++)
                                        best = lg[v] > lg[best] ? v : best;
                                if ((int)best != nd->answer[last + 1 - nd->n_prompt])
                                        hit[c] = 0;
                        }
                pos += k;
                lab_rows_done(n, nr);
        }
        free(ids);
        return r;
}

static void write_report(struct niah *n, FILE *md, FILE *jsonl, const struct doc_score *ds, uint32_t docs,
                         uint32_t doc_len, const double *hits, uint32_t n_needles, const uint32_t *needle_len,
                         uint32_t n_needle_len) {
        double *a = malloc(docs * sizeof(double)), *b = malloc(docs * sizeof(double)),
               *w = malloc(docs * sizeof(double));
        fprintf(md,
                "\n## Long documents at %u tokens (%u documents, teacher-forced, scored past %u tokens)\n\n"
                "| cache | bits / value | bytes vs f16 (average, peak) | perplexity | vs f16 [95%%] | target "
                "| "
                "KL(f16 ‖ tier) | top-1 agreement |\n|---|---:|---:|---:|---:|---|---:|---:|\n",
                doc_len, docs, TIERS_WINDOW + 16);
        for (uint32_t c = 0; c < TIERS_CONFIGS && a && b && w; c++) {
                double bytes = 0, full = 0, peak = 0, peak_full = 0;
                for (uint32_t d = 0; d < docs; d++) {
                        b[d] = ds[d].nll[0];
                        w[d] = ds[d].n;
                        bytes += ds[d].bytes[c] / docs;
                        full += ds[d].full / docs;
                        peak = fmax(peak, ds[d].peak[c]);
                        peak_full = fmax(peak_full, ds[d].peak[0]);
                }
                struct stats_ci ppl = { 0 }, d = { 0 }, kl = { 0 }, t1 = { 0 };
                for (uint32_t i = 0; i < docs; i++)
                        a[i] = ds[i].nll[c];
                stats_ratio_ci(a, w, docs, &ppl);
                stats_paired_ci(a, b, w, docs, &d);
                for (uint32_t i = 0; i < docs; i++)
                        a[i] = ds[i].kl[c];
                stats_ratio_ci(a, w, docs, &kl);
                for (uint32_t i = 0; i < docs; i++)
                        a[i] = ds[i].top1[c];
                stats_ratio_ci(a, w, docs, &t1);
                /* the ratio exp(d) - 1 and its interval, from d's */
                double rel = expm1(d.mean), lo = expm1(d.lo), hi = expm1(d.hi);
                const char *verdict = "-";
                char vbuf[96];
                if (!isnan(ppl_target[c]) && c > 0) {
                        snprintf(vbuf, sizeof(vbuf), "within %.1f%%: %s", ppl_target[c] * 100,
                                 isnan(d.lo)           ? "not measured"
                                 : hi <= ppl_target[c] ? "holds"
                                 : lo > ppl_target[c]  ? "does not hold"
                                                       : "not resolved (the interval spans it)");
                        verdict = vbuf;
                }
                struct block_layout l;
                const struct tier_row *row = tier_by_name(c ? tier_names[c] : "f16");
                block_layout_init(&l, 16, (uint32_t)n->mc->n_kv_heads,
                                  (uint32_t)(n->mc->dim / n->mc->n_heads), row->dtype);
                fprintf(md,
                        "| %s | %.2f | %.1f%%, %.1f%% | %.3f | %+.2f%% [%+.2f%%, %+.2f%%] | %s | %.4f | %.3f "
                        "|\n",
                        tier_labels[c], tier_bits_per_value(&l), 100 * bytes / full, 100 * peak / peak_full,
                        exp(ppl.mean), 100 * rel, 100 * lo, 100 * hi, verdict, kl.mean, t1.mean);
                fprintf(jsonl,
                        "{\"task\":\"tiers\",\"part\":\"longdoc\",\"cache\":\"%s\",\"length\":%u,"
                        "\"documents\":%u,"
                        "\"bytes_vs_f16\":%.5f,\"peak_vs_f16\":%.5f,\"ppl\":%.5f,\"ppl_rel\":%.6f,\"ppl_rel_"
                        "lo\":%.6f,"
                        "\"ppl_rel_hi\":%.6f,\"kl\":%.6f,\"top1\":%.5f,\"verdict\":\"%s\"}\n",
                        tier_labels[c], doc_len, docs, bytes / full, peak / peak_full, exp(ppl.mean), rel, lo,
                        hi, kl.mean, t1.mean, verdict);
        }
        free(a);
        free(b);
        free(w);
        if (!n_needles)
                return;
        fprintf(md, "\n## Needles (%u cases: %u per length at", n_needles * n_needle_len, n_needles);
        for (uint32_t i = 0; i < n_needle_len; i++)
                fprintf(md, " %u", needle_len[i]);
        fprintf(md, " tokens; the question after the haystack, the haystack compressed before it)\n\n"
                    "| cache | exact match [95%%] | vs f16 [95%%] | verdict |\n|---|---:|---:|---|\n");
        uint32_t N = n_needles * n_needle_len;
        double *x = malloc(N * sizeof(double)), *dx = malloc(N * sizeof(double));
        for (uint32_t c = 0; c < TIERS_CONFIGS && x && dx; c++) {
                for (uint32_t i = 0; i < N; i++) {
                        x[i] = hits[(size_t)i * TIERS_CONFIGS + c];
                        dx[i] = x[i] - hits[(size_t)i * TIERS_CONFIGS];
                }
                struct stats_ci m = { 0 }, d = { 0 };
                stats_bootstrap_mean(x, N, 2000, 7 + c, &m);
                stats_bootstrap_mean(dx, N, 2000, 70 + c, &d);
                fprintf(md, "| %s | %.0f%% [%.0f%%, %.0f%%] | %+.0f%% [%+.0f%%, %+.0f%%] | %s |\n",
                        tier_labels[c], 100 * m.mean, 100 * m.lo, 100 * m.hi, 100 * d.mean, 100 * d.lo,
                        100 * d.hi, c ? stats_compare(&d, false) : "-");
                fprintf(jsonl,
                        "{\"task\":\"tiers\",\"part\":\"needle\",\"cache\":\"%s\",\"cases\":%u,\"exact\":%."
                        "5f,"
                        "\"exact_lo\":%.5f,\"exact_hi\":%.5f,\"vs_f16\":%.5f,\"vs_f16_lo\":%.5f,\"vs_f16_"
                        "hi\":%.5f}\n",
                        tier_labels[c], N, m.mean, m.lo, m.hi, d.mean, d.lo, d.hi);
        }
        free(x);
        free(dx);
}

/* --dump-tokens: the token ids the task scores, so that a peer (bench/tiers-peers.sh: llama.cpp's
 * caches) can run the same sequences. One line a sequence: "doc D N ids" (the N ids of document D,
 * all scored past TIERS_WINDOW + 16 as run_doc scores them), "needle LENGTH K N_PROMPT N_ANSWER
 * ids answer" (the prompt, then the answer teacher-forced after it). The documents' text, as their
 * ids print, goes to tiers_docs.txt, one after the other (for llama-perplexity). */
static void dump_ids(FILE *f, const int *ids, uint32_t k) {
        for (uint32_t i = 0; i < k; i++)
                fprintf(f, " %d", ids[i]);
}

static int dump_text(struct niah *n, FILE *f, const int *ids, uint32_t k) {
        char buf[256];
        for (uint32_t i = 0; i < k; i++) {
                size_t len = 0;
                int r = text_piece(n->tok, i ? ids[i - 1] : -1, ids[i], buf, sizeof(buf), &len);
                if (r < 0)
                        return r;
                fwrite(buf, 1, len, f);
        }
        return 0;
}

int tiers_run(const struct niah_options *o) {
        struct niah n = { .o = o, .rng = o->seed ? o->seed : 0x13198a2e03707344ull, .local = true };
        uint32_t docs = o->needles, doc_len = o->n_lengths ? o->lengths[0] : (o->quick ? 256 : 4096);
        static const uint32_t full_lengths[] = { 1024, 2048, 4096 }, quick_lengths[] = { 192 };
        const uint32_t *nl = o->quick ? quick_lengths : full_lengths;
        uint32_t n_nl = o->quick ? 1 : 3, per_len = o->quick ? 2 : o->needles;
        int r = lab_open(&n, "tiers");
        if (r < 0)
                return r;
        struct ladder_cache *lc[TIERS_CONFIGS] = { 0 };
        struct doc_score *ds = calloc(docs, sizeof(*ds));
        double *hits = calloc((size_t)per_len * n_nl * TIERS_CONFIGS, sizeof(double));
        int *ids = malloc(((size_t)doc_len + 8) * sizeof(int));
        bool dump = o->dump_tokens;
        FILE *jsonl = open_partial(o, dump ? "tiers_tokens.txt" : "tiers.jsonl"),
             *md = open_partial(o, dump ? "tiers_docs.txt" : "tiers.md");
        if (!ds || !hits || !ids || !jsonl || !md)
                r = -ENOMEM;
        if (r == 0 && !dump)
                r = caches_new(&n, (uint32_t)n.mc->seq_len, lc);
        n.t0 = now_s();
        n.rows_total = (double)docs * TIERS_CONFIGS * doc_len;
        for (uint32_t i = 0; i < n_nl; i++)
                n.rows_total += (double)per_len * TIERS_CONFIGS * (nl[i] + 64);
        for (uint32_t d = 0; r == 0 && d < docs; d++) {
                struct textbuf t = { 0 };
                size_t got = 0;
                if ((r = haystack(&n, doc_len, &t)) == 0)
                        r = text_encode(n.tok, t.s, ids, (size_t)doc_len + 8, &got);
                free(t.s);
                if (r == 0 && got < doc_len / 2)
                        r = -ENODATA;
                uint32_t len = (uint32_t)(got < doc_len ? got : doc_len);
                if (r == 0 && dump) {
                        fprintf(jsonl, "doc %u %u", d, len);
                        dump_ids(jsonl, ids, len);
                        fputc('\n', jsonl);
                        r = dump_text(&n, md, ids, len);
                } else if (r == 0)
                        r = run_doc(&n, lc, ids, len, TIERS_WINDOW + 16, &ds[d]);
                progress(&n, "tiers", doc_len, d + 1);
        }
        struct niah_options needle_o = *o;
        needle_o.needles = per_len;
        n.o = &needle_o;
        for (uint32_t li = 0; r == 0 && li < n_nl; li++)
                for (uint32_t k = 0; r == 0 && k < per_len; k++) {
                        struct needle nd = { 0 };
                        if ((r = niah_build_needle(&n, nl[li], k, &nd)) == 0 && dump) {
                                fprintf(jsonl, "needle %u %u %u %u", nl[li], k, nd.n_prompt, nd.n_answer);
                                dump_ids(jsonl, nd.ids, nd.n_prompt);
                                dump_ids(jsonl, nd.answer, nd.n_answer);
                                fputc('\n', jsonl);
                        } else if (r == 0)
                                r = run_needle(&n, lc, &nd,
                                               hits + ((size_t)li * per_len + k) * TIERS_CONFIGS);
                        free(nd.ids);
                        progress(&n, "tiers", nl[li], k + 1);
                }
        n.o = o;
        if (r == 0 && !dump) {
                fprintf(md,
                        "# Each tier of the precision ladder alone: SmolLM2-135M-Instruct, in process\n\n"
                        "Every token but the last %u of each layer at the tier (kvc-run --local --tier), the "
                        "last "
                        "%u at f16; the f16 cache (every token at f16) is the reference. Documents: "
                        "TinyStories "
                        "validation stories (test split), as the longdoc task builds them; needles as the "
                        "niah "
                        "task builds them. Bits per value: a block's bytes (codes, scales, side arrays, "
                        "padding) "
                        "per key and value element (kernels/tier.h); bytes: what the blocks in use would be "
                        "charged, averaged over positions, against the f16 cache's. Intervals: 95%%, "
                        "clustered by "
                        "document (perplexity), bootstrap over cases (needles).\n",
                        TIERS_WINDOW, TIERS_WINDOW);
                write_report(&n, md, jsonl, ds, docs, doc_len, hits, per_len, nl, n_nl);
        }
        if (jsonl)
                fclose(jsonl);
        if (md)
                fclose(md);
        if (jsonl && md) {
                finish_partial(o, dump ? "tiers_tokens.txt" : "tiers.jsonl", r == 0);
                finish_partial(o, dump ? "tiers_docs.txt" : "tiers.md", r == 0);
        }
        caches_free(lc);
        free(ds);
        free(hits);
        free(ids);
        lab_close(&n);
        return r;
}
