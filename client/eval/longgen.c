/* longgen.c: long generation through kvcd, the full cache generating and every policy
 * teacher-forced on its answer in the same passes (longgen.h).
 *
 * Budgets are fractions f of the sequence's T = P + N tokens (P the prompt, N the answer), by what
 * each family compresses:
 *
 *   unified (window, h2o, conf+INT8)  one budget over the whole cache: B = f T
 *   prefill only (snapkv)              the prompt cut to f P, the answer kept whole
 *   decode only (scope-decode)         the prompt kept whole (prefill=full), the answer under
 *                                      f T - P (at least a block)
 *   both, decoupled (scope)            the prompt cut to f P (snapkv scorer), the answer under f N
 *
 * so unified, decode-only and decoupled configurations hold f T tokens (plus the plans' slack)
 * when the answer is done, and prefill-only holds more (its answer is not compressed).
 *
 * The split: after every pass, before kvcd plans, the positions each configuration's layers hold
 * (the position side array of every slot, every layer and KV head) say whether the row just run
 * attended over the whole prompt ("prompt whole": whatever it lost is the decode part's) or over a
 * prompt with some tokens evicted in some layer or head ("prompt cut"). Every answer position is
 * scored in exactly one of the two parts; the shares of the prompt and of the answer so far that
 * the configuration still holds are averaged over the answer.
 */
#define _GNU_SOURCE
#include "longgen.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "block.h"
#include "kvc.h"
#include "kvccache.h"
#include "lab.h"
#include "model.h"
#include "stats.h"
#include "text.h"

#define LG_BIN      64 /* answer tokens per line of longgen_curve.csv */
#define LG_MAX_BINS 128
#define LG_TARGET   0.35 /* the SCOPE target: at 35% of the full cache's bytes ... */
#define LG_KEEP     0.95 /* ... within 5% of its quality (top-1 agreement; the full cache's is 1) */
#define LG_NEAR     0.1  /* a configuration this close in bytes stands in when none bracket them */

enum lg_kind { LG_FULL, LG_UNIFIED, LG_PREFILL, LG_DECODE, LG_BOTH };
static const char *const kind_names[] = { "reference", "unified", "prefill only", "decode only",
                                          "prefill + decode" };

/* A family and what it compresses. The niah_family comes first: a configuration's fam points at
 * it, and the kind is found from there. */
struct lg_family {
        struct niah_family f;
        enum lg_kind kind;
};

static const struct lg_family main_families[] = {
        { { "window", "window", { 0 }, { 0 }, 0 }, LG_UNIFIED },
        { { "h2o", "h2o", { 0 }, { 0 }, 0 }, LG_UNIFIED },
        { { "conf-int8", "conf", { "gate", "int8" }, { "fixed", "1" }, 2 }, LG_UNIFIED },
        { { "snapkv", "snapkv", { 0 }, { 0 }, 0 }, LG_PREFILL },
        { { "scope", "scope", { "prefill_budget" }, { NULL }, 1 }, LG_BOTH },
        { { "scope-decode", "scope", { "prefill" }, { "full" }, 1 }, LG_DECODE },
};
static const struct lg_family quick_families[] = {
        { { "window", "window", { 0 }, { 0 }, 0 }, LG_UNIFIED },
        { { "scope", "scope", { "prefill_budget" }, { NULL }, 1 }, LG_BOTH },
};

/* One prompt of one configuration: sums over the answer's positions. Part 0: prompt whole, 1:
 * prompt cut. */
struct lg_result {
        double kl, agree, n;
        double part_kl[2], part_agree[2], part_n[2];
        double prompt_held, answer_held; /* sums of the shares held */
        double charged, tokens;
        double end_charged; /* after the last step: the full cache is at its largest */
        uint64_t peak_charged;
        uint32_t budget, n_prompt;
};

struct longgen {
        struct niah n;
        uint32_t gen_tokens, n_prompt;
        int *ids; /* prompt, then the answer as the full cache generates it */
        struct block_layout fp, q8;
        bool layouts;
        double curve[NIAH_MAX_CONFIGS][LG_MAX_BINS][4]; /* sums over prompts: kl, agree, prompt held, n */
};

static enum lg_kind kind_of(const struct niah_config *cf) {
        return cf->fam ? ((const struct lg_family *)(const void *)cf->fam)->kind : LG_FULL;
}

/* The configurations for a prompt of P tokens and an answer of N. */
static void make_configs(struct longgen *g, uint32_t P, uint32_t N) {
        struct niah *n = &g->n;
        const struct lg_family *fams = n->o->quick ? quick_families : main_families;
        size_t n_fams = n->o->quick ? sizeof(quick_families) / sizeof(quick_families[0])
                                    : sizeof(main_families) / sizeof(main_families[0]);
        n->n_cfg = 0;
        lab_config_add(n, NULL, 0, 0);
        for (size_t f = 0; f < n_fams; f++)
                for (uint32_t i = 0; i < n->o->n_fractions; i++) {
                        double fr = n->o->fractions[i];
                        long total = lround(fr * (P + N)), prompt = lround(fr * P), budget = total;
                        switch (fams[f].kind) {
                        case LG_PREFILL: budget = prompt; break;
                        case LG_DECODE: budget = total - (long)P > 16 ? total - (long)P : 16; break;
                        case LG_BOTH: budget = lround(fr * N); break;
                        default: break;
                        }
                        struct niah_config *c = lab_config_add(n, &fams[f].f, fr, (uint32_t)budget);
                        for (size_t p = 0; c && p < fams[f].f.n_params; p++)
                                if (!fams[f].f.values[p]) { /* scope's prefill_budget: the prompt's share */
                                        snprintf(c->value_buf[p], sizeof(c->value_buf[p]), "%ld",
                                                 prompt > 8 ? prompt : 8);
                                        c->params[p].value = c->value_buf[p];
                                }
                }
}

/* The prompt: the user asks to retell and continue a story of `length` tokens (test split). */
static int build_prompt(struct longgen *g, uint32_t length) {
        struct niah *n = &g->n;
        struct textbuf story = { 0 }, user = { 0 };
        static const char intro[] = "Here is a story.\n\n",
                          ask[] = "\n\nRetell this story in your own words, then continue it: what happens "
                                  "to the characters next? Write a long story.";
        int r = haystack(n, length, &story);
        if (r == 0)
                r = tb_add(&user, intro, sizeof(intro) - 1);
        if (r == 0)
                r = tb_add(&user, story.s, story.len);
        if (r == 0)
                r = tb_add(&user, ask, sizeof(ask) - 1);
        size_t cap = (size_t)n->mc->seq_len, np = 0;
        int *ids = r == 0 ? calloc(cap, sizeof(int)) : NULL;
        if (r == 0 && !ids)
                r = -ENOMEM;
        if (r == 0)
                r = text_encode_chat(n->tok, NULL, user.s, ids, cap, &np);
        if (r == 0 && np + g->gen_tokens > cap)
                r = -E2BIG; /* prompt and answer must fit the model's context */
        if (r == 0) {
                free(g->ids);
                g->ids = ids;
                ids = NULL;
                g->n_prompt = (uint32_t)np;
        }
        free(ids);
        free(story.s);
        free(user.s);
        return r;
}

/* Slots of s whose position is below P (the prompt) and at or above it, over every layer and KV
 * head. -EPROTO when the blocks are not laid out as block.h says for this geometry. */
static int held_parts(struct longgen *g, struct kvc_session *s, uint32_t P, double *ret_prompt,
                      double *ret_answer) {
        const struct model_config *mc = g->n.mc;
        uint32_t H = (uint32_t)mc->n_kv_heads, D = (uint32_t)(mc->dim / mc->n_heads);
        double in = 0, out = 0;
        for (uint32_t l = 0; l < (uint32_t)mc->n_layers; l++) {
                struct kvc_layer_view v;
                int r = kvc_layer_view(s, l, &v);
                if (r < 0)
                        return r;
                if (!g->layouts) {
                        if (block_layout_init(&g->fp, v.block_tokens, H, D, BLOCK_DTYPE_F16) < 0 ||
                            block_layout_init(&g->q8, v.block_tokens, H, D, BLOCK_DTYPE_Q8) < 0)
                                return -EPROTO;
                        g->layouts = true;
                }
                if (g->fp.block_bytes != v.block_bytes ||
                    (v.n_q8_blocks && g->q8.block_bytes != v.q8_block_bytes))
                        return -EPROTO;
                uint32_t T = v.block_tokens;
                for (uint32_t slot = 0; slot < v.n_tokens; slot++) {
                        bool q = slot < v.n_q8;
                        uint32_t i = q ? slot : slot - v.n_q8;
                        const struct block_layout *lay = q ? &g->q8 : &g->fp;
                        uint8_t *blk = q ? v.q8_blocks[i / T] : v.blocks[i / T];
                        for (uint32_t h = 0; h < H; h++) {
                                int32_t p = *(const int32_t *)block_side(lay, blk, lay->pos_offset, h, i % T);
                                in += p < (int32_t)P;
                                out += p >= (int32_t)P;
                        }
                }
        }
        *ret_prompt = in;
        *ret_answer = out;
        return 0;
}

/* The argmax over the tokens that do not end the turn: the token greedy generation emits. */
static uint32_t greedy(const struct text *tok, const float *lg, uint32_t V) {
        uint32_t best = UINT32_MAX;
        for (uint32_t v = 0; v < V; v++)
                if (!text_is_stop(tok, (int)v) && (best == UINT32_MAX || lg[v] > lg[best]))
                        best = v;
        return best;
}

static int run_prompt(struct longgen *g, struct lg_result *res) {
        struct niah *n = &g->n;
        const struct model_config *mc = n->mc;
        uint32_t C = n->n_cfg, V = (uint32_t)mc->vocab_size, L = (uint32_t)mc->n_layers;
        uint32_t P = g->n_prompt, N = g->gen_tokens, total = P + N - 1; /* the last answer token is not fed */
        double per_layer = (double)L * (double)mc->n_kv_heads;
        struct kvc_session *ss[NIAH_MAX_CONFIGS] = { 0 };
        float *ref = malloc(V * sizeof(float)), *lp = malloc(V * sizeof(float));
        double weight = 0;
        int r = ref && lp ? 0 : -ENOMEM;
        memset(res, 0, C * sizeof(*res));
        for (uint32_t c = 0; r == 0 && c < C; c++) {
                res[c].budget = n->cfg[c].budget;
                res[c].n_prompt = P;
                r = lab_session_open(n, &n->cfg[c], P, "longgen", &ss[c]);
        }
        struct model_row rows[MODEL_MAX_ROWS];
        uint32_t pos = 0;
        while (r == 0 && pos < total) {
                uint32_t k = 1;
                if (pos < P) { /* a prompt chunk; its last NIAH_OBSERVED tokens one per step */
                        uint32_t stop = pos + NIAH_OBSERVED < P ? P - NIAH_OBSERVED : pos + 1,
                                 most = MODEL_MAX_ROWS / C;
                        k = stop - pos;
                        k = k < n->o->chunk ? k : n->o->chunk;
                        k = lab_chunk(ss, C, L, k < most ? k : most);
                }
                uint32_t nr = 0;
                for (uint32_t c = 0; c < C; c++)
                        for (uint32_t j = 0; j < k; j++)
                                rows[nr++] = (struct model_row){ .token = g->ids[pos + j],
                                                                 .pos = (int)(pos + j),
                                                                 .ctx = ss[c],
                                                                 .logits = j == k - 1 };
                float *logits;
                if ((r = model_forward_rows(n->model, rows, nr, &kvccache_ops, &logits)) < 0) {
                        fprintf(stderr, "kvc-eval longgen: forward pass at %u: %s\n", pos, strerror(-r));
                        break;
                }
                uint32_t last = pos + k - 1; /* its logits predict position last + 1 */
                if (last + 1 >= P) {         /* an answer token: the full cache chooses it, all are scored */
                        uint32_t a = last + 1 - P, bin = a / LG_BIN;
                        uint32_t ref_top = 0;
                        for (uint32_t c = 0; r == 0 && c < C; c++) {
                                const float *lg = logits + (size_t)c * V;
                                lab_log_softmax(lg, V, c == 0 ? ref : lp);
                                uint32_t top = greedy(n->tok, lg, V);
                                if (c == 0)
                                        g->ids[last + 1] = (int)(ref_top = top);
                                double kl = c ? lab_kl(ref, lp, V) : 0, held_p = P * per_layer,
                                       held_a = (double)a * per_layer;
                                if (c && (r = held_parts(g, ss[c], P, &held_p, &held_a)) < 0)
                                        fprintf(stderr, "kvc-eval longgen: %s: cannot read its positions\n",
                                                n->cfg[c].label);
                                int part = held_p < P * per_layer ? 1 : 0;
                                struct lg_result *x = &res[c];
                                x->kl += kl;
                                x->agree += top == ref_top;
                                x->n++;
                                x->part_kl[part] += kl;
                                x->part_agree[part] += top == ref_top;
                                x->part_n[part]++;
                                x->prompt_held += held_p / (P * per_layer);
                                /* the answer so far: a - 1 tokens before this row's own (always held) */
                                x->answer_held +=
                                        a >= 2 ? (held_a - per_layer) / ((double)(a - 1) * per_layer) : 1;
                                if (bin < LG_MAX_BINS) {
                                        double *cv = g->curve[c][bin];
                                        cv[0] += kl, cv[1] += top == ref_top,
                                                cv[2] += held_p / (P * per_layer);
                                        cv[3]++;
                                }
                        }
                }
                for (uint32_t c = 0; r == 0 && c < C; c++) {
                        struct kvc_summary sm;
                        if ((r = kvc_summarize(logits + (size_t)c * V, V, &sm)) == 0)
                                r = kvc_step(ss[c], last, last + 1 < P ? KVC_PHASE_PREFILL : KVC_PHASE_DECODE,
                                             &sm);
                }
                if (r == 0 && (r = kvc_flush(n->client)) < 0)
                        fprintf(stderr, "kvc-eval longgen: step %u: %s\n", last, kvc_last_error(n->client));
                for (uint32_t c = 0; r == 0 && c < C; c++)
                        held_add(ss[c], L, k, &res[c].charged, &res[c].tokens);
                weight += k;
                pos += k;
                lab_rows_done(n, nr);
        }
        for (uint32_t c = 0; c < C; c++) {
                double end_tokens = 0;
                if (ss[c] && r == 0)
                        held_add(ss[c], L, 1, &res[c].end_charged, &end_tokens);
                if (ss[c])
                        held_close(ss[c], weight, &res[c].charged, &res[c].tokens, &res[c].peak_charged);
        }
        free(ref);
        free(lp);
        return r;
}

/* ---- the report ---- */

/* Which figure of a result a verdict or an interpolation reads (sums over the answer). */
enum lg_metric { LG_KL, LG_AGREE };

static double metric(const struct lg_result *x, enum lg_metric m) {
        return m == LG_KL ? x->kl : x->agree;
}

static double mean_peak(const struct lg_result *res, uint32_t K, uint32_t C, uint32_t c) {
        double s = 0;
        for (uint32_t k = 0; k < K; k++)
                s += (double)res[(size_t)k * C + c].peak_charged / K;
        return s;
}

/* The bytes the targets read: charged at the end of the answer, where the full cache is largest
 * (SCOPE's compression ratio). Not the peak: kvcd's peak also counts what is held for a while only
 * (a prompt held whole until it is compressed; conf-int8's peak is far above its steady state). */
static double mean_end(const struct lg_result *res, uint32_t K, uint32_t C, uint32_t c) {
        double s = 0;
        for (uint32_t k = 0; k < K; k++)
                s += res[(size_t)k * C + c].end_charged / K;
        return s;
}

/* Family fam's sums of m at `want` bytes at the end, prompt by prompt (x[0..K)): linear between the
 * two configurations around want by their mean over prompts (0). When they do not bracket it,
 * the configuration nearest in bytes if it is within LG_NEAR of want (1: *lo == *hi, and the
 * report says at what share it was read), else -ERANGE. *lo and *hi name them. */
static int at_bytes(const struct longgen *g, const struct lg_result *res, uint32_t K, const char *fam,
                    double want, enum lg_metric m, double *x, int *lo, int *hi) {
        const struct niah *n = &g->n;
        uint32_t C = n->n_cfg;
        double blo = 0, bhi = 0;
        *lo = *hi = -1;
        for (uint32_t i = 1; i < C; i++) {
                if (strcmp(n->cfg[i].fam->label, fam) != 0)
                        continue;
                double by = mean_end(res, K, C, i);
                if (by <= want && (*lo < 0 || by > blo))
                        *lo = (int)i, blo = by;
                if (by >= want && (*hi < 0 || by < bhi))
                        *hi = (int)i, bhi = by;
        }
        if (*lo < 0 || *hi < 0) {
                int near = *lo >= 0 ? *lo : *hi;
                double by = *lo >= 0 ? blo : bhi;
                if (near < 0 || fabs(by - want) > LG_NEAR * want)
                        return -ERANGE;
                *lo = *hi = near;
                for (uint32_t k = 0; k < K; k++)
                        x[k] = metric(&res[(size_t)k * C + near], m);
                return 1;
        }
        double t = bhi > blo ? (want - blo) / (bhi - blo) : 0;
        for (uint32_t k = 0; k < K; k++)
                x[k] = (1 - t) * metric(&res[(size_t)k * C + *lo], m) +
                       t * metric(&res[(size_t)k * C + *hi], m);
        return 0;
}

/* "between A and B", or "at A (X% of the full cache's bytes; none bracket them)". */
static const char *where(const struct longgen *g, const struct lg_result *res, uint32_t K, int lo, int hi,
                         char *buf, size_t len) {
        const struct niah *n = &g->n;
        if (lo != hi)
                snprintf(buf, len, "between %s and %s", n->cfg[lo].label, n->cfg[hi].label);
        else
                snprintf(buf, len, "at %s, %.1f%% of the full cache's bytes: none bracket them",
                         n->cfg[lo].label,
                         100 * mean_end(res, K, n->n_cfg, (uint32_t)lo) / mean_end(res, K, n->n_cfg, 0));
        return buf;
}

static void print_ci(FILE *f, const char *fmt, const struct stats_ci *ci, bool ok) {
        if (!ok) {
                fprintf(f, "—");
                return;
        }
        fprintf(f, fmt, ci->mean, ci->lo, ci->hi);
}

/* The per-configuration table and the machine-readable lines. */
static void write_table(struct longgen *g, const struct lg_result *res, uint32_t K, uint32_t length,
                        FILE *jsonl, FILE *md, FILE *per) {
        struct niah *n = &g->n;
        uint32_t C = n->n_cfg;
        double y[1000], w[1000];
        double full_avg = 0, full_peak = mean_peak(res, K, C, 0), full_end = mean_end(res, K, C, 0);
        for (uint32_t k = 0; k < K; k++)
                full_avg += res[(size_t)k * C].charged / K;
        fprintf(md,
                "\n| configuration | compresses | budget | KL(full‖policy) [95%% CI] | top-1 agree [95%% CI] "
                "| prompt whole: positions, KL, top-1 | prompt cut: positions, KL, top-1 | prompt held | "
                "answer held | charged avg (of full) | charged at the end (of full) | charged peak (of full) "
                "| tokens held "
                "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        for (uint32_t c = 0; c < C; c++) {
                const struct niah_config *cf = &n->cfg[c];
                struct stats_ci kl = { 0 }, ag = { 0 }, pk[2] = { 0 }, pa[2] = { 0 };
                double budget = 0, charged = 0, tokens = 0, ph = 0, ah = 0, pn[2] = { 0 }, npos = 0;
                for (uint32_t k = 0; k < K; k++) {
                        const struct lg_result *x = &res[(size_t)k * C + c];
                        budget += (double)x->budget / K;
                        charged += x->charged / K;
                        tokens += x->tokens / K;
                        ph += x->prompt_held, ah += x->answer_held, npos += x->n;
                        pn[0] += x->part_n[0], pn[1] += x->part_n[1];
                        y[k] = x->kl, w[k] = x->n;
                }
                bool ok = stats_ratio_ci(y, w, K, &kl) == 0;
                for (uint32_t k = 0; k < K; k++)
                        y[k] = res[(size_t)k * C + c].agree;
                ok = ok && stats_ratio_ci(y, w, K, &ag) == 0;
                bool part_ok[2];
                for (int p = 0; p < 2; p++) {
                        for (uint32_t k = 0; k < K; k++)
                                y[k] = res[(size_t)k * C + c].part_kl[p],
                                w[k] = res[(size_t)k * C + c].part_n[p];
                        part_ok[p] = stats_ratio_ci(y, w, K, &pk[p]) == 0;
                        for (uint32_t k = 0; k < K; k++)
                                y[k] = res[(size_t)k * C + c].part_agree[p];
                        part_ok[p] = part_ok[p] && stats_ratio_ci(y, w, K, &pa[p]) == 0;
                }
                double peak = mean_peak(res, K, C, c);
                ph = npos > 0 ? ph / npos : 0, ah = npos > 0 ? ah / npos : 0;
                enum lg_kind kind = kind_of(cf);
                fprintf(md, "| %s | %s | %.0f | ", cf->label, kind_names[kind], budget);
                print_ci(md, "%.4f [%.4f, %.4f]", &kl, ok);
                fprintf(md, " | ");
                print_ci(md, "%.3f [%.3f, %.3f]", &ag, ok);
                for (int p = 0; p < 2; p++) {
                        fprintf(md, " | %.0f, ", pn[p]);
                        print_ci(md, "%.4f [%.4f, %.4f]", &pk[p], part_ok[p]);
                        fprintf(md, ", ");
                        print_ci(md, "%.3f [%.3f, %.3f]", &pa[p], part_ok[p]);
                }
                double end = mean_end(res, K, C, c);
                fprintf(md, " | %.0f%% | %.0f%% | %.0f (%.0f%%) | %.0f (%.1f%%) | %.0f (%.0f%%) | %.0f |\n",
                        100 * ph, 100 * ah, charged, full_avg > 0 ? 100 * charged / full_avg : 0, end,
                        full_end > 0 ? 100 * end / full_end : 0, peak,
                        full_peak > 0 ? 100 * peak / full_peak : 0, tokens);
                char line[1024];
                snprintf(
                        line, sizeof(line),
                        "{\"label\":\"%s\",\"task\":\"longgen\",\"story_tokens\":%u,\"family\":\"%s\","
                        "\"policy\":\"%s\",\"compresses\":"
                        "\"%s\",\"fraction\":%.2f,\"budget\":%.0f,\"prompts\":%u,\"gen_tokens\":%u,\"kl\":%."
                        "6f,"
                        "\"kl_lo\":%.6f,\"kl_hi\":%.6f,\"top1_agree\":%.6f,\"top1_lo\":%.6f,\"top1_hi\":%.6f,"
                        "\"n_prompt_whole\":%.0f,\"n_prompt_cut\":%.0f,\"kl_prompt_whole\":%.6f,\"kl_prompt_"
                        "cut\":%."
                        "6f,\"prompt_held\":%.4f,\"answer_held\":%.4f,\"avg_charged_bytes\":%.0f,\"peak_"
                        "charged_"
                        "bytes\":%.0f,\"peak_of_full\":%.4f,\"end_charged_bytes\":%.0f,\"end_of_full\":%.4f,"
                        "\"avg_tokens_held\":%.1f}\n",
                        cf->label, length, cf->fam ? cf->fam->label : "full",
                        cf->fam ? cf->fam->policy : "full", kind_names[kind], cf->fraction, budget, K,
                        g->gen_tokens, kl.mean, kl.lo, kl.hi, ag.mean, ag.lo, ag.hi, pn[0], pn[1],
                        part_ok[0] ? pk[0].mean : 0, part_ok[1] ? pk[1].mean : 0, ph, ah, charged, peak,
                        full_peak > 0 ? peak / full_peak : 0, end, full_end > 0 ? end / full_end : 0, tokens);
                fputs(line, jsonl);
                fputs(line, stdout);
                for (uint32_t k = 0; k < K; k++) {
                        const struct lg_result *x = &res[(size_t)k * C + c];
                        fprintf(per, "%u,%u,%s,%u,%u,%.6f,%.6f,%.0f,%.0f,%.4f,%.4f,%.0f,%.0f,%llu\n", length,
                                k, cf->label, x->n_prompt, x->budget, x->n ? x->kl / x->n : 0,
                                x->n ? x->agree / x->n : 0, x->part_n[0], x->part_n[1],
                                x->n ? x->prompt_held / x->n : 0, x->n ? x->answer_held / x->n : 0,
                                x->charged, x->end_charged, (unsigned long long)x->peak_charged);
                }
        }
}

/* The SCOPE targets: (1) every family's top-1 agreement and KL at 35% of the full cache's
 * peak bytes, SCOPE's against "within 5%" of the full cache (top-1 >= 0.95); (2) every SCOPE
 * configuration against each unified family at SCOPE's own peak bytes, paired by prompt. */
static void write_targets(struct longgen *g, const struct lg_result *res, uint32_t K, FILE *md) {
        struct niah *n = &g->n;
        uint32_t C = n->n_cfg;
        double x[1000], y[1000], w[1000];
        double want = LG_TARGET * mean_end(res, K, C, 0);
        for (uint32_t k = 0; k < K; k++)
                w[k] = res[(size_t)k * C].n;
        fprintf(md,
                "\n### Targets\n\nAt %.0f%% of the full cache's charged bytes at the end of the answer "
                "(%.0f), each family "
                "linear "
                "between its two configurations around those bytes, prompt by prompt (the full cache's top-1 "
                "agreement is 1 by construction; SCOPE's target: at least %.2f):\n\n",
                100 * LG_TARGET, want, LG_KEEP);
        const char *seen[NIAH_MAX_CONFIGS];
        uint32_t n_seen = 0;
        for (uint32_t c = 1; c < C; c++) {
                const char *fam = n->cfg[c].fam->label;
                bool dup = false;
                for (uint32_t i = 0; i < n_seen; i++)
                        dup |= strcmp(seen[i], fam) == 0;
                if (dup)
                        continue;
                seen[n_seen++] = fam;
                int lo, hi;
                struct stats_ci ag, kl;
                if (at_bytes(g, res, K, fam, want, LG_AGREE, x, &lo, &hi) < 0 ||
                    at_bytes(g, res, K, fam, want, LG_KL, y, &lo, &hi) < 0 ||
                    stats_ratio_ci(x, w, K, &ag) < 0 || stats_ratio_ci(y, w, K, &kl) < 0) {
                        fprintf(md, "- %s: its configurations do not bracket %.0f bytes; not measured\n", fam,
                                want);
                        continue;
                }
                bool scope = kind_of(&n->cfg[c]) == LG_BOTH || kind_of(&n->cfg[c]) == LG_DECODE;
                char at[160];
                fprintf(md, "- %s (%s): top-1 %.3f [%.3f, %.3f], KL %.4f [%.4f, %.4f]%s%s\n", fam,
                        where(g, res, K, lo, hi, at, sizeof(at)), ag.mean, ag.lo, ag.hi, kl.mean, kl.lo,
                        kl.hi, scope ? " — " : "",
                        scope ? (ag.lo >= LG_KEEP  ? "holds"
                                 : ag.hi < LG_KEEP ? "does not hold"
                                                   : "not resolved (the interval spans 0.95)")
                              : "");
        }
        fprintf(md, "\nSCOPE against unified compression at SCOPE's own bytes at the end (the unified family "
                    "linear "
                    "between its configurations around them; paired by prompt; Δ = SCOPE − unified, KL lower "
                    "is better, top-1 higher):\n\n");
        for (uint32_t s = 1; s < C; s++) {
                enum lg_kind ks = kind_of(&n->cfg[s]);
                if (ks != LG_BOTH && ks != LG_DECODE)
                        continue;
                double bytes = mean_end(res, K, C, s);
                for (uint32_t u = 1; u < C; u++) {
                        if (kind_of(&n->cfg[u]) != LG_UNIFIED || n->cfg[u].fraction != n->o->fractions[0])
                                continue; /* once per unified family */
                        const char *fam = n->cfg[u].fam->label;
                        int lo, hi;
                        char at[160];
                        struct stats_ci dk, da;
                        for (uint32_t k = 0; k < K; k++)
                                y[k] = res[(size_t)k * C + s].kl;
                        int rk = at_bytes(g, res, K, fam, bytes, LG_KL, x, &lo, &hi);
                        if (rk >= 0)
                                rk = stats_paired_ci(y, x, w, K, &dk);
                        for (uint32_t k = 0; k < K; k++)
                                y[k] = res[(size_t)k * C + s].agree;
                        int ra = rk >= 0 ? at_bytes(g, res, K, fam, bytes, LG_AGREE, x, &lo, &hi) : rk;
                        if (ra >= 0)
                                ra = stats_paired_ci(y, x, w, K, &da);
                        if (rk < 0 || ra < 0) {
                                fprintf(md,
                                        "- %s (%.0f bytes) vs %s: %s's configurations do not bracket those "
                                        "bytes; "
                                        "not measured at equal bytes\n",
                                        n->cfg[s].label, bytes, fam, fam);
                                continue;
                        }
                        fprintf(md,
                                "- %s (%.0f bytes, %.1f%% of the full cache's) vs %s (%s): ΔKL %+.4f "
                                "[%+.4f, "
                                "%+.4f] %s; Δtop-1 %+.3f [%+.3f, %+.3f] %s\n",
                                n->cfg[s].label, bytes, 100 * bytes / mean_end(res, K, C, 0), fam,
                                where(g, res, K, lo, hi, at, sizeof(at)), dk.mean, dk.lo, dk.hi,
                                stats_compare(&dk, true), da.mean, da.lo, da.hi, stats_compare(&da, false));
                }
        }
}

/* KL and top-1 agreement along the answer, LG_BIN tokens a line, over every prompt. */
static void write_curve(struct longgen *g, uint32_t length, FILE *f) {
        struct niah *n = &g->n;
        for (uint32_t c = 0; c < n->n_cfg; c++)
                for (uint32_t b = 0; b < LG_MAX_BINS && (size_t)b * LG_BIN < g->gen_tokens; b++) {
                        const double *cv = g->curve[c][b];
                        if (cv[3] > 0)
                                fprintf(f, "%u,%s,%u,%u,%.6f,%.6f,%.4f,%.0f\n", length, n->cfg[c].label,
                                        b * LG_BIN, (b + 1) * LG_BIN, cv[0] / cv[3], cv[1] / cv[3],
                                        cv[2] / cv[3], cv[3]);
                }
}

/* The share of the answer's 4-grams that occur once: 1 for text that never repeats itself, near 0
 * for a loop. */
static double distinct_4grams(const int *a, uint32_t N) {
        if (N < 4)
                return 1;
        uint32_t distinct = 0;
        for (uint32_t i = 0; i + 3 < N; i++) {
                bool again = false;
                for (uint32_t j = 0; j < i && !again; j++)
                        again = memcmp(a + i, a + j, 4 * sizeof(int)) == 0;
                distinct += !again;
        }
        return (double)distinct / (N - 3);
}

static void write_answer(struct longgen *g, uint32_t k, FILE *f) {
        fprintf(f, "=== prompt %u (%u tokens; answer %u tokens; distinct 4-grams %.2f)\n", k, g->n_prompt,
                g->gen_tokens, distinct_4grams(g->ids + g->n_prompt, g->gen_tokens));
        char piece[256];
        for (uint32_t i = g->n_prompt; i < g->n_prompt + g->gen_tokens; i++) {
                size_t pl = 0;
                if (text_piece(g->n.tok, g->ids[i - 1], g->ids[i], piece, sizeof(piece), &pl) == 0)
                        fwrite(piece, 1, pl, f);
        }
        fprintf(f, "\n\n");
}

int longgen_run(const struct niah_options *o, uint32_t gen_tokens) {
        struct longgen *g = calloc(1, sizeof(*g));
        if (!g)
                return -ENOMEM;
        g->n = (struct niah){ .o = o, .rng = o->seed ? o->seed : 0x452821e638d01377ull };
        g->gen_tokens = gen_tokens;
        struct niah *n = &g->n;
        uint32_t K = o->needles;
        int r = K >= 2 && K <= 1000 && gen_tokens >= 1 && gen_tokens <= LG_BIN * LG_MAX_BINS ? 0 : -EINVAL;
        if (r == 0 && (r = lab_open(n, "longgen")) < 0 && !n->model) {
                free(g);
                return r;
        }
        static const char *const names[] = { "longgen.jsonl", "longgen.md", "longgen_prompts.csv",
                                             "longgen_curve.csv", "longgen_answers.txt" };
        FILE *fs[5] = { 0 };
        for (size_t i = 0; r == 0 && i < 5; i++)
                if (!(fs[i] = open_partial(o, names[i])))
                        r = -errno;
        FILE *jsonl = fs[0], *md = fs[1], *per = fs[2];
        if (r == 0) {
                fprintf(fs[3],
                        "story_tokens,label,answer_from,answer_to,kl,top1_agree,prompt_held,positions\n");
                fprintf(per, "story_tokens,prompt,label,prompt_tokens,budget,kl,top1_agree,n_prompt_whole,n_"
                             "prompt_cut,prompt_held,"
                             "answer_held,avg_charged_bytes,end_charged_bytes,peak_charged_bytes\n");
                fprintf(md,
                        "# Long generation: SmolLM2-135M-Instruct through kvcd\n\n"
                        "Prompts: the user asks the model to retell and continue a story (TinyStories "
                        "validation "
                        "stories, test split, stories %u on, CDLA-Sharing-1.0, joined and cut at the token "
                        "count); the "
                        "full cache answers %u tokens greedily (end-of-turn masked) and every configuration "
                        "is "
                        "teacher-forced on that answer in the same passes (one batch, one StepBatch a "
                        "position). "
                        "Scored: every answer position, KL(full‖policy) and top-1 agreement (the policy's "
                        "greedy "
                        "token is the full cache's); split by whether the row attended over the whole prompt "
                        "(\"prompt whole\": the loss is the decode part's) or over a prompt with evicted "
                        "tokens "
                        "(\"prompt cut\"). Budgets are fractions of prompt + answer (docs/quality.md says "
                        "per family "
                        "how). Intervals: 95%%, clustered by prompt. Bytes are what kvcd charges: average "
                        "over "
                        "positions, at the end of the answer (the targets read these) and kvcd's peak, as a "
                        "share of the full cache's. Keys and values in FP16. "
                        "Seed "
                        "%llu.\n",
                        NIAH_TEST_FIRST, gen_tokens, (unsigned long long)n->rng);
        }
        n->t0 = now_s();
        for (uint32_t li = 0; li < o->n_lengths; li++) {
                make_configs(g, o->lengths[li] + 64, gen_tokens);
                n->rows_total += (double)K * n->n_cfg * (o->lengths[li] + 64 + gen_tokens);
        }
        for (uint32_t li = 0; r == 0 && li < o->n_lengths; li++) {
                struct lg_result *res = calloc((size_t)K * NIAH_MAX_CONFIGS, sizeof(*res));
                memset(g->curve, 0, sizeof(g->curve));
                double prompt_tokens = 0, distinct = 0;
                if (!res)
                        r = -ENOMEM;
                for (uint32_t k = 0; r == 0 && k < K; k++) {
                        if ((r = build_prompt(g, o->lengths[li])) < 0) {
                                fprintf(stderr,
                                        "kvc-eval longgen: cannot build a prompt of %u story tokens: %s\n",
                                        o->lengths[li], strerror(-r));
                                break;
                        }
                        make_configs(g, g->n_prompt, gen_tokens);
                        r = run_prompt(g, res + (size_t)k * n->n_cfg);
                        if (r == 0) {
                                write_answer(g, k, fs[4]);
                                prompt_tokens += (double)g->n_prompt / K;
                                distinct += distinct_4grams(g->ids + g->n_prompt, gen_tokens) / K;
                        }
                        progress(n, "longgen", o->lengths[li], k + 1);
                }
                if (r == 0) {
                        fprintf(md,
                                "\n## Stories of %u tokens: prompts of %.0f tokens on average, answers of %u "
                                "(%u "
                                "prompts; distinct 4-grams in the answers: %.2f)\n",
                                o->lengths[li], prompt_tokens, gen_tokens, K, distinct);
                        write_table(g, res, K, o->lengths[li], jsonl, md, per);
                        write_targets(g, res, K, md);
                        write_curve(g, o->lengths[li], fs[3]);
                }
                free(res);
        }
        for (size_t i = 0; i < 5; i++)
                if (fs[i])
                        fclose(fs[i]);
        for (size_t i = 0; fs[4] && i < 5; i++)
                finish_partial(o, names[i], r == 0);
        if (r == 0)
                fprintf(stderr, "kvc-eval longgen: %.0f s; results in %s\n", now_s() - n->t0, o->out_dir);
        lab_close(n);
        free(g->ids);
        free(g);
        return r;
}
