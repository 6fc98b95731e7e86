/* niah.c: needle in a haystack through kvcd, batched (niah.h). */
#define _GNU_SOURCE
#include "niah.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvc.h"
#include "importance.h"
#include "kvccache.h"
#include "lab.h"
#include "model.h"
#include "stats.h"
#include "text.h"

#define NIAH_BOOT 2000

/* The main suite: the window baseline, H2O (decode-time ranking), SnapKV (prompt compression) and
 * CONF-KV with INT8 (the target), 9 configurations with the full cache: what fits make
 * quality-smol's hour on 2 cores (docs/quality.md). More families (conf without INT8, pyramid,
 * streaming, tova, prob) are one row each here. */
static const struct niah_family main_families[] = {
        { "window", "window", { 0 }, { 0 }, 0 },
        { "h2o", "h2o", { 0 }, { 0 }, 0 },
        { "snapkv", "snapkv", { 0 }, { 0 }, 0 },
        { "conf-int8", "conf", { "gate", "int8" }, { "fixed", "1" }, 2 },
};
/* The ladder suite (issue 27, --suite ladder): the eviction-only families (the window, CONF-KV with
 * INT8) at token budgets and the ladder at the same fractions of the full cache's bytes (tiers q8,
 * q4 and q2 below FP16: what it may lower to; sinks 4 and a window of 32 at FP16), ranked by each
 * of the three importance scores: the accumulated attention (sum), the tokens' surprisal, KVzip's
 * reconstruction (importance.h; the prompt's chunks of those two run one configuration at a time).
 * Five families and the full cache: what two cores run in about half an hour at 2K. */
static const struct niah_family ladder_families[] = {
        { "window", "window", { 0 }, { 0 }, 0, NULL, false, NULL },
        { "conf-int8", "conf", { "gate", "int8" }, { "fixed", "1" }, 2, NULL, false, NULL },
        { "ladder", "ladder", { 0 }, { 0 }, 0, "q8,q4,q2", true, NULL },
        { "ladder-surprisal", "ladder", { 0 }, { 0 }, 0, "q8,q4,q2", true, "surprisal" },
        { "ladder-recon", "ladder", { 0 }, { 0 }, 0, "q8,q4,q2", true, "recon" },
};
static const struct niah_family quick_families[] = {
        { "window", "window", { 0 }, { 0 }, 0 },
        { "conf-fixed", "conf", { "gate" }, { "fixed" }, 1 },
};

/* One needle of one configuration. */
struct niah_result {
        double hit, logp, charged, tokens;
        uint64_t peak_charged;
};

/* The configurations for haystacks of `length` tokens: the full cache, then every family at
 * every fraction of the length. */
/* Whether label is in the comma-separated list (NULL: every label is). */
static bool picked(const char *list, const char *label) {
        size_t n = strlen(label);
        for (const char *at = list; at && *at;) {
                const char *end = strchr(at, ',');
                size_t len = end ? (size_t)(end - at) : strlen(at);
                if (len == n && strncmp(at, label, n) == 0)
                        return true;
                at = end ? end + 1 : NULL;
        }
        return !list;
}

static void make_configs(struct niah *n, uint32_t length) {
        bool ladder = n->o->suite && strcmp(n->o->suite, "ladder") == 0;
        const struct niah_family *fams = n->o->quick ? quick_families : ladder ? ladder_families : main_families;
        size_t n_fams = n->o->quick ? sizeof(quick_families) / sizeof(quick_families[0])
                        : ladder    ? sizeof(ladder_families) / sizeof(ladder_families[0])
                                    : sizeof(main_families) / sizeof(main_families[0]);
        const struct model_config *mc = n->mc;
        const struct kvc_geometry g = { .n_layers = (uint32_t)mc->n_layers,
                                        .n_heads = (uint32_t)mc->n_heads,
                                        .n_kv_heads = (uint32_t)mc->n_kv_heads,
                                        .head_dim = (uint32_t)(mc->dim / mc->n_heads),
                                        .dtype = KVC_DTYPE_F16 };
        n->n_cfg = 0;
        lab_config_add(n, NULL, 0, 0);
        for (size_t f = 0; f < n_fams; f++)
                for (uint32_t i = 0; i < n->o->n_fractions && picked(n->o->families, fams[f].label); i++) {
                        double frac = n->o->fractions[i];
                        struct niah_config *c =
                                lab_config_add(n, &fams[f], frac, fams[f].bytes ? 0 : (uint32_t)lround(frac * length));
                        if (c && fams[f].bytes) /* of the haystack's full cache, as kvcd charges it */
                                c->budget_bytes = (uint64_t)(frac * (double)kvc_full_cache_bytes(&g, length));
                }
}

static const char *const colours[] = { "blue",  "red",  "green",  "yellow", "white", "black",
                                       "brown", "pink", "purple", "orange", "grey",  "golden" };

int niah_build_needle(struct niah *n, uint32_t length, uint32_t index, struct needle *nd) {
        struct textbuf hay = { 0 }, user = { 0 };
        char sentence[128], question[192], prefix[96], full_answer[128];
        int r = haystack(n, length, &hay);
        if (r < 0)
                return r;
        snprintf(nd->colour, sizeof(nd->colour), "%s",
                 colours[next_rand(&n->rng) % (sizeof(colours) / sizeof(colours[0]))]);
        nd->value = 1000 + (unsigned)(next_rand(&n->rng) % 9000);
        nd->depth = (index + 0.5) / n->o->needles; /* spread evenly over the haystack */
        snprintf(sentence, sizeof(sentence), "The secret code of the %s door is %u. ", nd->colour, nd->value);
        /* the needle goes after the sentence end nearest its depth */
        size_t at = (size_t)(nd->depth * hay.len);
        while (at < hay.len && !(at > 0 && (hay.s[at - 1] == ' ' || hay.s[at - 1] == '\n') && at > 1 &&
                                 (hay.s[at - 2] == '.' || hay.s[at - 2] == '\n')))
                at++;
        static const char intro[] = "Read the text below. Somewhere in it is a secret code.\n\n";
        snprintf(question, sizeof(question),
                 "\n\nQuestion: what is the secret code of the %s door? Answer with the number only.",
                 nd->colour);
        r = tb_add(&user, intro, sizeof(intro) - 1);
        if (r == 0)
                r = tb_add(&user, hay.s, at);
        if (r == 0)
                r = tb_add(&user, sentence, strlen(sentence));
        if (r == 0)
                r = tb_add(&user, hay.s + at, hay.len - at);
        size_t hay_end = user.len;
        if (r == 0)
                r = tb_add(&user, question, strlen(question));
        size_t cap = (size_t)n->mc->seq_len, np = 0, nh = 0, npre = 0, nfull = 0;
        int *ids = calloc(cap + 64, sizeof(int)), *hids = calloc(cap + 64, sizeof(int));
        int pre[64], fa[64];
        if (r == 0 && (!ids || !hids))
                r = -ENOMEM;
        if (r == 0)
                r = text_encode_chat(n->tok, NULL, user.s, ids, cap, &np);
        /* the question begins where the prompt without it stops agreeing (less one token: the
         * haystack's last token may merge with what follows) */
        if (r == 0) {
                char saved = user.s[hay_end];
                user.s[hay_end] = '\0';
                r = text_encode_chat(n->tok, NULL, user.s, hids, cap, &nh);
                user.s[hay_end] = saved;
        }
        snprintf(prefix, sizeof(prefix), "The secret code of the %s door is", nd->colour);
        snprintf(full_answer, sizeof(full_answer), "%s %u", prefix, nd->value);
        if (r == 0)
                r = text_encode(n->tok, prefix, pre, 64, &npre);
        if (r == 0)
                r = text_encode(n->tok, full_answer, fa, 64, &nfull);
        if (r == 0 && (nfull <= npre || memcmp(pre, fa, npre * sizeof(int)) != 0 || nfull - npre > 16 ||
                       np + npre + 16 > cap))
                r = -EINVAL; /* the answer must extend the prefix's tokens */
        if (r == 0) {
                uint32_t q = 0;
                while (q < np && q < nh && ids[q] == hids[q])
                        q++;
                nd->question = q ? q - 1 : 0;
                memcpy(ids + np, pre, npre * sizeof(int));
                nd->n_prompt = (uint32_t)(np + npre);
                nd->n_answer = (uint32_t)(nfull - npre);
                memcpy(nd->answer, fa + npre, nd->n_answer * sizeof(int));
                nd->ids = ids;
                ids = NULL;
        }
        free(ids);
        free(hids);
        free(hay.s);
        free(user.s);
        return r;
}

/* ---- one haystack, every configuration in one batch ---- */

/* The configurations whose prompt scores are not attention: an importance object each (NULL for
 * the others), and room for the last logits of their own passes. */
static int importance_open(struct niah *n, struct importance **imp, float **own_logits) {
        for (uint32_t c = 0; c < n->n_cfg; c++) {
                const struct niah_family *f = n->cfg[c].fam;
                enum importance_kind kind = IMPORTANCE_KIND_ATTENTION;
                imp[c] = NULL;
                own_logits[c] = NULL;
                if (!f || !f->importance || importance_parse(f->importance, &kind) < 0 ||
                    kind == IMPORTANCE_KIND_ATTENTION)
                        continue;
                int r = importance_new(n->model, n->tok, kind, n->o->threads, &imp[c]);
                if (r == 0 && !(own_logits[c] = malloc((size_t)n->mc->vocab_size * sizeof(float))))
                        r = -ENOMEM;
                if (r < 0)
                        return r;
        }
        return 0;
}

static void importance_close(uint32_t C, struct importance **imp, float **own_logits) {
        for (uint32_t c = 0; c < C; c++) {
                imp[c] = importance_free(imp[c]);
                free(own_logits[c]);
                own_logits[c] = NULL;
        }
}

static int run_needle(struct niah *n, const struct needle *nd, struct niah_result *res) {
        const struct model_config *mc = n->mc;
        uint32_t C = n->n_cfg, V = (uint32_t)mc->vocab_size, L = (uint32_t)mc->n_layers;
        struct kvc_session *ss[NIAH_MAX_CONFIGS] = { 0 };
        struct importance *imp[NIAH_MAX_CONFIGS] = { 0 };
        float *own_logits[NIAH_MAX_CONFIGS] = { 0 };
        uint32_t at[NIAH_MAX_CONFIGS]; /* a batched configuration's logits in the pass's */
        double weight = 0;
        int r = importance_open(n, imp, own_logits);
        memset(res, 0, C * sizeof(*res));
        for (uint32_t c = 0; r == 0 && c < C; c++)
                r = lab_session_open(n, &n->cfg[c], nd->question, "niah", &ss[c]);
        struct model_row rows[MODEL_MAX_ROWS];
        uint32_t total =
                nd->n_prompt + nd->n_answer - 1; /* positions run: the last answer token is not fed */
        uint32_t pos = 0;
        while (r == 0 && pos < total) {
                /* the chunk: the same positions for every configuration */
                uint32_t k = 1;
                if (pos < nd->n_prompt) {
                        uint32_t stop = pos < nd->question - NIAH_OBSERVED ? nd->question - NIAH_OBSERVED
                                        : pos < nd->question               ? pos + 1
                                                                           : nd->n_prompt;
                        k = stop - pos;
                        uint32_t most = n->o->chunk < MODEL_MAX_ROWS / C ? n->o->chunk : MODEL_MAX_ROWS / C;
                        for (uint32_t c = 0; c < C; c++)
                                if (imp[c] && importance_max_rows(imp[c]) < most)
                                        most = importance_max_rows(imp[c]);
                        k = lab_chunk(ss, C, L, k < most ? k : most);
                }
                /* the prompt's chunks of a configuration with its own scores: a pass of their own */
                bool prompt = pos + k <= nd->n_prompt;
                uint32_t nr = 0, batched = 0;
                for (uint32_t c = 0; c < C; c++) {
                        bool own = prompt && imp[c];
                        struct model_row *to = own ? rows + MODEL_MAX_ROWS - k : rows + nr;
                        for (uint32_t j = 0; j < k; j++) {
                                uint32_t p = pos + j;
                                int token = p < nd->n_prompt ? nd->ids[p] : nd->answer[p - nd->n_prompt];
                                to[j] = (struct model_row){
                                        .token = token, .pos = (int)p, .ctx = ss[c], .logits = j == k - 1
                                };
                        }
                        if (!own) {
                                nr += k;
                                at[c] = batched++;
                                continue;
                        }
                        float *lg;
                        if ((r = importance_prefill(imp[c], to, k, &kvccache_ops, &kvccache_store_ops, &lg)) < 0) {
                                fprintf(stderr, "kvc-eval niah: %s: importance at %u: %s\n", n->cfg[c].label, pos,
                                        strerror(-r));
                                break;
                        }
                        memcpy(own_logits[c], lg, V * sizeof(float));
                }
                float *logits = NULL;
                if (r == 0 && nr && (r = model_forward_rows(n->model, rows, nr, &kvccache_ops, &logits)) < 0)
                        fprintf(stderr, "kvc-eval niah: forward pass at %u: %s\n", pos, strerror(-r));
                if (r < 0)
                        break;
                uint32_t last = pos + k - 1; /* its logits predict position last + 1 */
                for (uint32_t c = 0; r == 0 && c < C; c++) {
                        const float *lg = prompt && imp[c] ? own_logits[c] : logits + (size_t)at[c] * V;
                        if (last + 1 >= nd->n_prompt) { /* an answer token: score it */
                                uint32_t a = last + 1 - nd->n_prompt;
                                int truth = nd->answer[a];
                                uint32_t best = 0;
                                double mx = lg[0];
                                for (uint32_t v = 1; v < V; v++)
                                        if (lg[v] > mx)
                                                mx = lg[v], best = v;
                                double sum = 0;
                                for (uint32_t v = 0; v < V; v++)
                                        sum += exp((double)lg[v] - mx);
                                res[c].logp += (double)lg[truth] - mx - log(sum);
                                if (a == 0)
                                        res[c].hit = 1;
                                if (best != (uint32_t)truth)
                                        res[c].hit = 0;
                        }
                        struct kvc_summary sm;
                        if ((r = kvc_summarize(lg, V, &sm)) < 0)
                                break;
                        r = kvc_step(ss[c], last,
                                     last + 1 < nd->n_prompt ? KVC_PHASE_PREFILL : KVC_PHASE_DECODE, &sm);
                }
                if (r == 0 && (r = kvc_flush(n->client)) < 0)
                        fprintf(stderr, "kvc-eval niah: step %u: %s\n", last, kvc_last_error(n->client));
                for (uint32_t c = 0; r == 0 && c < C; c++)
                        held_add(ss[c], L, k, &res[c].charged, &res[c].tokens);
                weight += k;
                pos += k;
                lab_rows_done(n, nr);
        }
        for (uint32_t c = 0; c < C; c++)
                if (ss[c])
                        held_close(ss[c], weight, &res[c].charged, &res[c].tokens, &res[c].peak_charged);
        importance_close(C, imp, own_logits);
        return r;
}

/* ---- the report ---- */

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return (x > y) - (x < y);
}

struct niah_row {
        const struct niah_config *cf;
        uint32_t length;
        struct stats_ci acc, logp, d_acc, d_logp;
        double charged, peak, tokens;
};

static int boot(const double *x, uint32_t k, uint64_t seed, struct stats_ci *ret) {
        int r = stats_bootstrap_mean(x, k, NIAH_BOOT, seed, ret);
        if (r < 0) /* one needle: the estimate without an interval */
                *ret = (struct stats_ci){ .mean = k ? x[0] : 0, .lo = NAN, .hi = NAN, .n = k };
        return r;
}

/* The targets at fractions of the full cache's bytes (issue 27: at 25% at least 95% of the full
 * cache's exact match, at 15% 90%, at 10% 75%): each family's exact match there (linear between
 * its two configurations around those bytes, needle by needle) as a share of the full cache's,
 * with a bootstrap interval of the share over needles. Bytes here are the peak kvcd charged (the
 * memory a server provisions for the sequence, reached when the question is read): an average
 * over positions would favour the full cache, which is small while its prompt is short. */
static void targets(struct niah *n, const struct niah_result *res, uint32_t length, FILE *md) {
        static const double level[] = { 0.25, 0.15, 0.10 }, goal[] = { 0.95, 0.90, 0.75 };
        uint32_t K = n->o->needles, C = n->n_cfg;
        double full_acc = 0, full_peak = 0;
        for (uint32_t k = 0; k < K; k++) {
                full_acc += res[(size_t)k * C].hit / K;
                full_peak += (double)res[(size_t)k * C].peak_charged / K;
        }
        double *x = malloc(K * sizeof(double)), *b = malloc(NIAH_BOOT * sizeof(double)),
               *f = malloc(K * sizeof(double));
        for (uint32_t v = 0; x && f && b && v < sizeof(level) / sizeof(level[0]); v++) {
                double want = level[v] * full_peak;
                fprintf(md,
                        "\nHaystacks of %u tokens at %.0f%% of the full cache's peak charged bytes (%.0f): exact "
                        "match as a share of the full cache's %.2f (target: at least %.0f%%):\n\n",
                        length, 100 * level[v], want, full_acc, 100 * goal[v]);
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
                        /* the family's bytes per configuration, and the two around `want` */
                        int lo = -1, hi = -1;
                        double blo = 0, bhi = 0;
                        for (uint32_t i = 1; i < C; i++) {
                                if (strcmp(n->cfg[i].fam->label, fam) != 0)
                                        continue;
                                double by = 0;
                                for (uint32_t k = 0; k < K; k++)
                                        by += (double)res[(size_t)k * C + i].peak_charged / K;
                                if (by <= want && (lo < 0 || by > blo))
                                        lo = (int)i, blo = by;
                                if (by >= want && (hi < 0 || by < bhi))
                                        hi = (int)i, bhi = by;
                        }
                        if (lo >= 0 && hi < 0) /* all below: its most bytes, at less than the level */
                                hi = lo, bhi = blo;
                        if (lo < 0 || hi < 0) {
                                fprintf(md, "- %s: its configurations do not reach %.0f bytes (%s); not measured\n",
                                        fam, want, lo < 0 ? "all above" : "all below");
                                continue;
                        }
                        double t = bhi > blo ? (want - blo) / (bhi - blo) : 0, mean = 0;
                        for (uint32_t k = 0; k < K; k++) {
                                x[k] = (1 - t) * res[(size_t)k * C + lo].hit + t * res[(size_t)k * C + hi].hit;
                                f[k] = res[(size_t)k * C].hit;
                                mean += x[k] / K;
                        }
                        uint64_t s = 0x7a26e7ull + c;
                        for (uint32_t r = 0; r < NIAH_BOOT; r++) {
                                double sx = 0, sf = 0;
                                for (uint32_t k = 0; k < K; k++) {
                                        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
                                        uint32_t i = (uint32_t)(s % K);
                                        sx += x[i], sf += f[i];
                                }
                                b[r] = sf > 0 ? sx / sf : 0;
                        }
                        qsort(b, NIAH_BOOT, sizeof(double), cmp_double);
                        struct stats_ci share = { .mean = full_acc > 0 ? mean / full_acc : 0,
                                                  .lo = b[(size_t)(0.025 * (NIAH_BOOT - 1))],
                                                  .hi = b[(size_t)ceil(0.975 * (NIAH_BOOT - 1))],
                                                  .n = K };
                        char where[160];
                        if (lo == hi)
                                snprintf(where, sizeof(where), "%s, below those bytes", n->cfg[lo].label);
                        else
                                snprintf(where, sizeof(where), "between %s and %s", n->cfg[lo].label,
                                         n->cfg[hi].label);
                        fprintf(md, "- %s (%s): %.0f%% [%.0f%%, %.0f%%] of the full cache's exact match: %s\n", fam,
                                where, 100 * share.mean, 100 * share.lo, 100 * share.hi,
                                share.lo >= goal[v]  ? "holds"
                                : share.hi < goal[v] ? "does not hold"
                                                     : "not resolved (the interval spans the target)");
                }
        }
        free(x);
        free(f);
        free(b);
}

static void write_outputs(struct niah *n, uint32_t li, const struct niah_result *res, FILE *jsonl, FILE *csv,
                          FILE *md) {
        uint32_t K = n->o->needles, C = n->n_cfg, length = n->o->lengths[li];
        double *x = malloc(K * sizeof(double)), *d = malloc(K * sizeof(double));
        if (!x || !d) {
                free(x);
                free(d);
                return;
        }
        double full_bytes = 0;
        for (uint32_t k = 0; k < K; k++)
                full_bytes += res[(size_t)k * C].charged / K;
        double full_peak = 0;
        for (uint32_t k = 0; k < K; k++)
                full_peak = (double)res[(size_t)k * C].peak_charged > full_peak
                                    ? (double)res[(size_t)k * C].peak_charged
                                    : full_peak;
        fprintf(md, "\n### Haystacks of %u tokens (%u needles)\n\n", length, K);
        fprintf(md, "| configuration | budget | exact match [95%% CI] | Δ vs full | log p(answer) [95%% CI] "
                    "| Δ vs full "
                    "| charged bytes avg (of full) | charged peak (of full) | tokens held "
                    "|\n|---|---|---|---|---|---|---|---|---|\n");
        for (uint32_t c = 0; c < C; c++) {
                struct niah_row row = { .cf = &n->cfg[c], .length = length };
                uint64_t seed = 0x5eed0000ull + li * 977 + c;
                for (uint32_t k = 0; k < K; k++) {
                        x[k] = res[(size_t)k * C + c].hit;
                        d[k] = x[k] - res[(size_t)k * C].hit;
                        row.charged += res[(size_t)k * C + c].charged / K;
                        row.tokens += res[(size_t)k * C + c].tokens / K;
                        if (res[(size_t)k * C + c].peak_charged > row.peak)
                                row.peak = (double)res[(size_t)k * C + c].peak_charged;
                }
                boot(x, K, seed, &row.acc);
                boot(d, K, seed + 1, &row.d_acc);
                for (uint32_t k = 0; k < K; k++) {
                        x[k] = res[(size_t)k * C + c].logp;
                        d[k] = x[k] - res[(size_t)k * C].logp;
                }
                boot(x, K, seed + 2, &row.logp);
                boot(d, K, seed + 3, &row.d_logp);
                const struct niah_config *cf = row.cf;
                bool no_compression =
                        cf->fam && strcmp(cf->fam->policy, "snapkv") == 0 && cf->budget >= length;
                const char *verdict = c == 0 ? "" : stats_compare(&row.d_logp, false);
                fprintf(jsonl,
                        "{\"task\":\"niah\",\"length\":%u,\"label\":\"%s\",\"family\":\"%s\",\"policy\":\"%"
                        "s\","
                        "\"fraction\":%.2f,\"budget\":%u,\"needles\":%u,\"acc\":%.6f,\"acc_lo\":%.6f,\"acc_"
                        "hi\":%.6f,"
                        "\"logp\":%.6f,\"logp_lo\":%.6f,\"logp_hi\":%.6f,\"d_acc\":%.6f,\"d_acc_lo\":%.6f,"
                        "\"d_acc_hi\":%.6f,\"d_logp\":%.6f,\"d_logp_lo\":%.6f,\"d_logp_hi\":%.6f,"
                        "\"avg_charged_bytes\":%.0f,\"peak_charged_bytes\":%.0f,\"bytes_of_full\":%.4f,"
                        "\"avg_tokens_held\":%.1f,\"no_compression\":%s}\n",
                        length, cf->label, cf->fam ? cf->fam->label : "full",
                        cf->fam ? cf->fam->policy : "full", cf->fraction, cf->budget, K, row.acc.mean,
                        row.acc.lo, row.acc.hi, row.logp.mean, row.logp.lo, row.logp.hi, row.d_acc.mean,
                        row.d_acc.lo, row.d_acc.hi, row.d_logp.mean, row.d_logp.lo, row.d_logp.hi,
                        row.charged, row.peak, full_bytes > 0 ? row.charged / full_bytes : 0, row.tokens,
                        no_compression ? "true" : "false");
                fprintf(csv,
                        "%u,%s,%s,%s,%.2f,%u,%u,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.0f,%.0f,%.4f,%"
                        ".1f,%d\n",
                        length, cf->label, cf->fam ? cf->fam->label : "full",
                        cf->fam ? cf->fam->policy : "full", cf->fraction, cf->budget, K, row.acc.mean,
                        row.acc.lo, row.acc.hi, row.logp.mean, row.logp.lo, row.logp.hi, row.d_logp.mean,
                        row.d_logp.lo, row.d_logp.hi, row.charged, row.peak,
                        full_bytes > 0 ? row.charged / full_bytes : 0, row.tokens, no_compression);
                fprintf(md,
                        "| %s%s | %u | %.2f [%.2f, %.2f] | %+.2f [%+.2f, %+.2f] | %.3f [%.3f, %.3f] | %+.3f "
                        "[%+.3f, "
                        "%+.3f] %s | %.0f (%.0f%%) | %.0f (%.0f%%) | %.0f |\n",
                        cf->label, no_compression ? " †" : "", cf->budget, row.acc.mean, row.acc.lo,
                        row.acc.hi, row.d_acc.mean, row.d_acc.lo, row.d_acc.hi, row.logp.mean, row.logp.lo,
                        row.logp.hi, row.d_logp.mean, row.d_logp.lo, row.d_logp.hi, verdict, row.charged,
                        full_bytes > 0 ? 100 * row.charged / full_bytes : 0, row.peak,
                        full_peak > 0 ? 100 * row.peak / full_peak : 0, row.tokens);
                printf("{\"label\":\"%s\",\"task\":\"niah\",\"length\":%u,\"acc\":%.6f,\"acc_lo\":%.6f,\"acc_"
                       "hi\":%.6f,"
                       "\"logp\":%.6f,\"logp_lo\":%.6f,\"logp_hi\":%.6f,\"d_logp_lo\":%.6f,\"d_logp_hi\":%."
                       "6f,"
                       "\"avg_charged_bytes\":%.0f,\"peak_charged_bytes\":%.0f,\"needles\":%u}\n",
                       cf->label, length, row.acc.mean, row.acc.lo, row.acc.hi, row.logp.mean, row.logp.lo,
                       row.logp.hi, row.d_logp.lo, row.d_logp.hi, row.charged, row.peak, K);
        }
        targets(n, res, length, md);
        free(x);
        free(d);
}

/* --dump-tokens: the needles the task would score, so that peers (bench/niah-peers.sh) run the same
 * sequences: in niah_tokens.txt one line a needle, "needle LENGTH K N_PROMPT N_ANSWER ids answer"
 * (the format of the tiers task's: bench/llama-tiers.c reads both), and in niah_questions.txt
 * "LENGTH K QUESTION DEPTH" (where the question starts: the context a question-agnostic press
 * compresses ends there). */
static void dump_needle(FILE *tokens, FILE *questions, uint32_t length, uint32_t k, const struct needle *nd) {
        fprintf(tokens, "needle %u %u %u %u", length, k, nd->n_prompt, nd->n_answer);
        for (uint32_t i = 0; i < nd->n_prompt; i++)
                fprintf(tokens, " %d", nd->ids[i]);
        for (uint32_t i = 0; i < nd->n_answer; i++)
                fprintf(tokens, " %d", nd->answer[i]);
        fputc('\n', tokens);
        fprintf(questions, "%u %u %u %.4f\n", length, k, nd->question, nd->depth);
}

int niah_run(const struct niah_options *o) {
        struct niah n = { .o = o, .rng = o->seed ? o->seed : 0x243f6a8885a308d3ull, .local = o->dump_tokens };
        int r = lab_open(&n, "niah");
        if (r < 0 && !n.model)
                return r;
        FILE *jsonl = NULL, *csv = NULL, *md = NULL, *per = NULL;
        if (r == 0) {
                bool dump = o->dump_tokens;
                jsonl = open_partial(o, dump ? "niah_tokens.txt" : "niah.jsonl");
                csv = open_partial(o, "niah.csv");
                md = open_partial(o, "niah.md");
                per = open_partial(o, dump ? "niah_questions.txt" : "niah_needles.csv");
                if (!jsonl || !csv || !md || !per)
                        r = -errno;
        }
        if (r == 0 && !o->dump_tokens) {
                fprintf(csv, "length,label,family,policy,fraction,budget,needles,acc,acc_lo,acc_hi,logp,logp_"
                             "lo,logp_hi,"
                             "d_logp,d_logp_lo,d_logp_hi,avg_charged_bytes,peak_charged_bytes,bytes_of_full,"
                             "avg_tokens_held,no_compression\n");
                fprintf(per, "length,needle,depth,label,hit,logp,avg_charged_bytes\n");
                fprintf(md,
                        "# Needle in a haystack: SmolLM2-135M-Instruct through kvcd\n\n"
                        "Haystacks: TinyStories validation stories (test split, stories %u on; "
                        "CDLA-Sharing-1.0) "
                        "joined by blank lines and cut at the token count; a needle \"The secret code of the "
                        "<colour> door is <4 digits>.\" at depths (i + 0.5) / %u; the question after the "
                        "haystack "
                        "in the chat template, the assistant's answer prefix \"The secret code of the "
                        "<colour> door "
                        "is\". Exact match: the greedy answer begins with the value's tokens; log p: the "
                        "value's "
                        "tokens, teacher-forced. The haystack is prefilled in chunks of at most %u rows with "
                        "the "
                        "policy's plans between chunks and declared the prompt up to the question (policies "
                        "choose before they see it); all configurations of a haystack run as one batch. Keys "
                        "and values in FP16. Intervals: percentile bootstrap over needles (%u resamples); Δ "
                        "is "
                        "paired with the full cache on the same needles; a Δ whose interval contains 0 is no "
                        "difference. Bytes are what kvcd charges (blocks at full size with their side "
                        "arrays), "
                        "averaged over positions; peak as kvcd reported it. † snapkv with a budget of "
                        "at least the haystack (compresses nothing). Seed %llu.\n",
                        NIAH_TEST_FIRST, o->needles, o->chunk, NIAH_BOOT, (unsigned long long)n.rng);
        }
        n.t0 = now_s();
        for (uint32_t li = 0; li < o->n_lengths; li++) {
                make_configs(&n, o->lengths[li]);
                n.rows_total += (double)o->needles * n.n_cfg * (o->lengths[li] + 80);
        }
        for (uint32_t li = 0; r == 0 && li < o->n_lengths; li++) {
                uint32_t length = o->lengths[li];
                make_configs(&n, length);
                struct niah_result *res = calloc((size_t)o->needles * n.n_cfg, sizeof(*res));
                if (!res) {
                        r = -ENOMEM;
                        break;
                }
                for (uint32_t k = 0; r == 0 && k < o->needles; k++) {
                        struct needle nd = { 0 };
                        if ((r = niah_build_needle(&n, length, k, &nd)) < 0) {
                                fprintf(stderr, "kvc-eval niah: cannot build a haystack of %u tokens: %s\n",
                                        length, strerror(-r));
                                break;
                        }
                        n.max_tokens = nd.n_prompt + nd.n_answer; /* sessions never hold more */
                        if (o->dump_tokens) {
                                dump_needle(jsonl, per, length, k, &nd);
                                free(nd.ids);
                                continue;
                        }
                        r = run_needle(&n, &nd, res + (size_t)k * n.n_cfg);
                        for (uint32_t c = 0; r == 0 && c < n.n_cfg; c++)
                                fprintf(per, "%u,%u,%.4f,%s,%.0f,%.6f,%.0f\n", length, k, nd.depth,
                                        n.cfg[c].label, res[(size_t)k * n.n_cfg + c].hit,
                                        res[(size_t)k * n.n_cfg + c].logp,
                                        res[(size_t)k * n.n_cfg + c].charged);
                        free(nd.ids);
                        fflush(per); /* a needle's lines survive an interrupted run (in the .partial) */
                        progress(&n, "niah", length, k + 1);
                }
                if (r == 0 && !o->dump_tokens)
                        write_outputs(&n, li, res, jsonl, csv, md);
                free(res);
        }
        if (jsonl)
                fclose(jsonl);
        if (csv)
                fclose(csv);
        if (md)
                fclose(md);
        if (per)
                fclose(per);
        if (jsonl && csv && md && per) {
                static const char *const names[] = { "niah.jsonl", "niah.csv", "niah.md", "niah_needles.csv" },
                                         *dumped[] = { "niah_tokens.txt", "niah.csv", "niah.md",
                                                       "niah_questions.txt" };
                for (size_t i = 0; i < 4; i++) /* a dump leaves the results as they were */
                        finish_partial(o, (o->dump_tokens ? dumped : names)[i],
                                       r == 0 && (!o->dump_tokens || i == 0 || i == 3));
        }
        if (r == 0)
                fprintf(stderr, "kvc-eval niah: %.0f s; results in %s\n", now_s() - n.t0, o->out_dir);
        lab_close(&n);
        return r;
}
