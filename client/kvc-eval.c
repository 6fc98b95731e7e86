/* kvc-eval: the quality lab. Runs the reference model over real text through the real kvcd, one
 * token at a time, with every policy and budget, and measures what each keeps per byte.
 *
 * The text is cut into stories (each begins "Once upon a time"), one story per sequence, at most
 * the model's context. For every story the model first runs with a plain in-process cache (the
 * reference: no kvcd, no eviction), keeping its next-token log-probabilities. Then one kvcd
 * session per configuration replays the same tokens, teacher-forced, all sessions stepping in
 * lockstep in one StepBatch per position, exactly as an inference server would run them; the
 * first --prompt-tokens of the story are declared the prompt (prefill policies compress it).
 *
 * Per configuration: perplexity (and its gap to the full cache), mean KL(p_full || p_policy),
 * top-1 agreement with the full cache, name recall (the first token of a character's name where
 * it recurs at least 64 tokens after the name first appeared: top-1 accuracy and mean
 * log-probability), the bytes kvcd charges the session (blocks granted at their full size,
 * averaged over steps; kvcd's own peak at close) beside the old nominal count, the tokens the
 * layers hold (average and peak: budgets plus the plans' slack), tokens scored and wall time, each
 * per-token figure with its story-clustered 95% interval (eval/stats.h). Also the model's own
 * perplexity computed without kvcd, and per step the full cache's confidence beside the KL a
 * short recent window causes (the mechanism CONF-KV rests on). Stories come from the test split
 * (stories 200 on) unless --split tune; the report's verdicts are paired comparisons over stories
 * ("no difference" when the interval contains 0).
 *
 * Stories are spread over --jobs worker processes (each its own kvcd client); the parent reads
 * their lines as they come (poll), adds them up and shows progress on stderr. Output: one JSON
 * object per configuration on stdout, and in the output directory (--out, default a new
 * build/kvc-eval/DATE-PID) results.{md,csv,jsonl} and the per-step confidence/KL pairs, written as
 * .partial files renamed only when the run completes. --task niah runs the needle task on a GGUF
 * model instead (eval/niah.h, docs/quality.md).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "eval/longdoc.h"
#include "eval/longgen.h"
#include "eval/mechanism.h"
#include "eval/niah.h"
#include "eval/stats.h"
#include "eval/tiers.h"
#include "kvc.h"
#include "kvccache.h"
#include "model.h"
#include "tokenizer.h"

#define SHARED            "../shared"
#define MAX_CONFIGS       96
#define MAX_CONFIG_PARAMS 8
#define NAME_GAP          64
#define TUNE_STORIES      200 /* stories [0, 200) of the sample are the tuning split, the rest the test split */

struct config {
        char label[64];
        char family[48]; /* the label without its budget: curves are drawn per family */
        char policy[32];
        uint32_t budget;
        struct kvc_param params[MAX_CONFIG_PARAMS];
        char param_text[MAX_CONFIG_PARAMS][2][48];
        size_t n_params;
};

struct metrics {
        double nll, kl, name_logp, bytes_sum, q8_bytes_sum, seconds;
        uint64_t n, top1, name_n, name_hit, peak_bytes, plans, sequences;
        /* what kvcd charges: blocks granted times their size, summed over steps (charged_sum), the
         * peak kvcd itself reported at close, and the tokens the layers held (mean over layers,
         * summed over steps; the largest layer at any step) */
        double charged_sum, tokens_sum;
        uint64_t peak_charged, peak_tokens;
        uint64_t bytes_mismatch; /* over sequences: kvcd's bytes at close beyond the layers' blocks */
};

/* One sequence of one configuration: the clusters of every interval (eval/stats.h). */
struct seq_rec {
        double nll, kl, top1, n, charged, name_n, name_hit, name_logp;
};

struct eval {
        const char *socket, *model_path, *tok_path, *data_path, *out_dir, *corr_label;
        uint32_t sequences, max_tokens, prompt_tokens, jobs, first;
        uint32_t split_first, split_end; /* the split's stories [split_first, split_end) */
        const char *split;
        struct seq_rec *recs; /* [sequence][configuration], filled by the parent */
        bool quick;
        enum kvc_dtype dtype;
        struct config configs[MAX_CONFIGS];
        uint32_t n_configs;
        struct model *model;
        struct tokenizer *tok;
        char *text;
        size_t text_len;
};

static double seconds(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* "label=policy:budget[:key=value,...]" or "policy:budget[:...]" */
static int parse_config(const char *spec, struct config *c) {
        char buf[256];
        snprintf(buf, sizeof(buf), "%s", spec);
        memset(c, 0, sizeof(*c));
        char *body = buf, *eq = strchr(buf, '=');
        char *colon = strchr(buf, ':');
        if (eq && (!colon || eq < colon)) {
                *eq = '\0';
                snprintf(c->label, sizeof(c->label), "%s", buf);
                body = eq + 1;
        }
        char *save = NULL, *policy = strtok_r(body, ":", &save), *budget = strtok_r(NULL, ":", &save);
        char *params = strtok_r(NULL, ":", &save);
        if (!policy)
                return -EINVAL;
        snprintf(c->policy, sizeof(c->policy), "%s", policy);
        c->budget = budget ? (uint32_t)strtoul(budget, NULL, 10) : 0;
        for (char *kv = params ? strtok_r(params, ",", &save) : NULL; kv; kv = strtok_r(NULL, ",", &save)) {
                char *e = strchr(kv, '=');
                if (!e || c->n_params >= MAX_CONFIG_PARAMS)
                        return -EINVAL;
                *e = '\0';
                snprintf(c->param_text[c->n_params][0], 48, "%s", kv);
                snprintf(c->param_text[c->n_params][1], 48, "%s", e + 1);
                c->n_params++;
        }
        for (size_t i = 0; i < c->n_params; i++)
                c->params[i] = (struct kvc_param){ .key = c->param_text[i][0], .value = c->param_text[i][1] };
        if (!c->label[0]) {
                int n = snprintf(c->label, sizeof(c->label), "%s-%u", c->policy, c->budget);
                snprintf(c->family, sizeof(c->family), "%s", c->policy);
                for (size_t i = 0; i < c->n_params && n > 0 && (size_t)n < sizeof(c->label); i++)
                        n += snprintf(c->label + n, sizeof(c->label) - (size_t)n, ",%s=%s",
                                      c->param_text[i][0], c->param_text[i][1]);
        }
        return 0;
}

static int add_config(struct eval *e, const char *spec) {
        struct config *c = &e->configs[e->n_configs];
        if (e->n_configs >= MAX_CONFIGS || parse_config(spec, c) < 0) {
                fprintf(stderr, "kvc-eval: bad configuration '%s'\n", spec);
                return -EINVAL;
        }
        if (!c->family[0]) { /* "name-64" -> "name" */
                size_t n = strlen(c->label);
                while (n && c->label[n - 1] >= '0' && c->label[n - 1] <= '9')
                        n--;
                if (n && n < strlen(c->label) && c->label[n - 1] == '-')
                        n--;
                size_t len = n ? n : strlen(c->label);
                len = len < sizeof(c->family) - 1 ? len : sizeof(c->family) - 1;
                memcpy(c->family, c->label, len);
                c->family[len] = '\0';
        }
        e->n_configs++;
        return 0;
}

/* The default suite: every policy at budgets 32..256, the gates and corrections to compare. */
static int default_suite(struct eval *e) {
        static const char *const per_budget[] = {
                "window:%u",
                "streaming:%u",
                "h2o:%u",
                "tova:%u",
                "pyramid:%u",
                "pyramid-taper:%u",
                "scope-slide=scope:%u",
                "scope-adaptive=scope:%u:strategy=adaptive",
                "h2o-unified=h2o:%u:per_head=0",
                "conf-fixed=conf:%u:gate=fixed",
                "conf-naive=conf:%u:gate=naive",
                "conf-defer=conf:%u:gate=defer",
                "conf-l=conf-l:%u",
                "conf-int8=conf:%u:gate=fixed,int8=1",
                "conf-defer-int8=conf:%u:gate=defer,int8=1",
                "snapkv:%u",
                "prob-none=prob:%u:correction=none",
                "prob-ht=prob:%u:correction=ht",
                "prob-moment=prob:%u:correction=moment",
                "prob-sink=prob:%u:correction=sink",
                "conf-moment=conf:%u:gate=fixed,correction=moment",
        };
        static const uint32_t budgets[] = { 32, 64, 128, 256 };
        char spec[160], label[64];
        int r = add_config(e, "full=full:0");
        for (size_t i = 0; r == 0 && i < sizeof(per_budget) / sizeof(per_budget[0]); i++) {
                for (size_t b = 0; r == 0 && b < sizeof(budgets) / sizeof(budgets[0]); b++) {
                        snprintf(spec, sizeof(spec), per_budget[i], budgets[b]);
                        char *eq = strchr(spec, '='), *colon = strchr(spec, ':');
                        if (eq && eq < colon) { /* "name=policy:..." -> "name-B=policy:..." */
                                snprintf(label, sizeof(label), "%.*s-%u", (int)(eq - spec), spec, budgets[b]);
                                char tail[160];
                                snprintf(tail, sizeof(tail), "%s=%s", label, eq + 1);
                                snprintf(spec, sizeof(spec), "%s", tail);
                        }
                        r = add_config(e, spec);
                }
        }
        /* the INT8 curve is measured finer where it crosses a 64-token FP16 window's bytes */
        if (r == 0)
                r = add_config(e, "conf-int8-80=conf:80:gate=fixed,int8=1");
        if (r == 0)
                r = add_config(e, "conf-int8-96=conf:96:gate=fixed,int8=1");
        return r;
}

static int quick_suite(struct eval *e) {
        int r = add_config(e, "full=full:0");
        if (r == 0)
                r = add_config(e, "window-big=window:512"); /* >= the sequence: must equal full */
        if (r == 0)
                r = add_config(e, "window-32=window:32");
        if (r == 0)
                r = add_config(e, "conf-32=conf:32");
        return r;
}

/* ---- text ---- */

struct story {
        int *tokens;
        uint32_t n;
        /* name recall targets: positions whose token starts a recurring name */
        uint32_t *targets;
        uint32_t n_targets;
};

static void story_free(struct story *s) {
        free(s->tokens);
        free(s->targets);
        memset(s, 0, sizeof(*s));
}

static bool is_name_word(const char *w, size_t n) {
        if (n < 2 || w[0] < 'A' || w[0] > 'Z')
                return false;
        for (size_t i = 1; i < n; i++)
                if (w[i] < 'a' || w[i] > 'z')
                        return false;
        return true;
}

/* Characters' names: capitalized words that also appear in the middle of a sentence (after a
 * lowercase word or a comma), so sentence-initial "She" or "The" do not count. */
static size_t find_names(const char *text, size_t len, char names[][24], size_t max) {
        size_t n = 0;
        for (size_t i = 1; i < len && n < max; i++) {
                if (text[i - 1] != ' ' || i < 2)
                        continue;
                char before = text[i - 2];
                if (!((before >= 'a' && before <= 'z') || before == ','))
                        continue;
                size_t j = i;
                while (j < len && ((text[j] >= 'a' && text[j] <= 'z') || (text[j] >= 'A' && text[j] <= 'Z')))
                        j++;
                if (!is_name_word(text + i, j - i) || j - i >= 24)
                        continue;
                bool seen = false;
                for (size_t k = 0; k < n && !seen; k++)
                        seen = strlen(names[k]) == j - i && memcmp(names[k], text + i, j - i) == 0;
                if (!seen) {
                        memcpy(names[n], text + i, j - i);
                        names[n][j - i] = '\0';
                        n++;
                }
        }
        return n;
}

static int make_story(struct eval *e, const char *text, size_t len, struct story *s) {
        size_t cap = len + 3;
        size_t n;
        s->tokens = malloc(cap * sizeof(int));
        if (!s->tokens)
                return -ENOMEM;
        while (len && (text[len - 1] == '\n' || text[len - 1] == ' '))
                len--;
        int r = tokenizer_encode(e->tok, text, len, true, false, s->tokens, cap, &n);
        if (r < 0)
                return r;
        s->n = (uint32_t)(n < e->max_tokens ? n : e->max_tokens);

        char names[32][24];
        size_t n_names = find_names(text, len, names, 32);
        s->targets = malloc(s->n * sizeof(uint32_t));
        if (!s->targets)
                return -ENOMEM;
        for (size_t k = 0; k < n_names; k++) {
                int nt[32];
                size_t nn;
                if (tokenizer_encode(e->tok, names[k], strlen(names[k]), false, false, nt, 32, &nn) < 0 ||
                    nn == 0)
                        continue;
                int64_t first = -1;
                for (uint32_t i = 1; i + nn <= s->n; i++) {
                        if (memcmp(s->tokens + i, nt, nn * sizeof(int)) != 0)
                                continue;
                        if (first < 0)
                                first = i;
                        else if (i >= first + NAME_GAP)
                                s->targets[s->n_targets++] = i;
                }
        }
        return 0;
}

/* The stories of the text: each starts at "Once upon a time". */
static size_t split_stories(const char *text, size_t len, const char **starts, size_t *lens, size_t max) {
        static const char marker[] = "Once upon a time";
        size_t n = 0;
        const char *p = text, *end = text + len;
        p = memmem(p, (size_t)(end - p), marker, sizeof(marker) - 1);
        while (p && n < max) {
                const char *next = memmem(p + 1, (size_t)(end - p - 1), marker, sizeof(marker) - 1);
                starts[n] = p;
                lens[n] = (size_t)((next ? next : end) - p);
                n++;
                p = next;
        }
        return n;
}

/* ---- one story ---- */

/* log-softmax of logits into out; returns the argmax. */
static uint32_t log_softmax(const float *logits, uint32_t v, float *out) {
        uint32_t best = 0;
        for (uint32_t i = 1; i < v; i++)
                if (logits[i] > logits[best])
                        best = i;
        double sum = 0;
        for (uint32_t i = 0; i < v; i++)
                sum += exp((double)logits[i] - logits[best]);
        double lse = logits[best] + log(sum);
        for (uint32_t i = 0; i < v; i++)
                out[i] = (float)(logits[i] - lse);
        return best;
}

/* Bytes of KV per token per layer: full precision as FP16, INT8 with its scales (per-token value
 * scales, per-block per-channel key scales spread over the block's 16 slots). */
static double fp16_token_bytes(const struct model_config *mc) {
        return 2.0 * mc->n_kv_heads * (mc->dim / mc->n_heads) * 2.0;
}

static double q8_token_bytes(const struct model_config *mc) {
        double hd = mc->dim / mc->n_heads;
        return 2.0 * mc->n_kv_heads * hd + 4.0 * mc->n_kv_heads + 4.0 * mc->n_kv_heads * hd / 16.0;
}

static int run_story(struct eval *e, struct kvc_client *client, const struct story *st, uint32_t index,
                     struct metrics *m, struct metrics *own, FILE *pairs) {
        const struct model_config *mc = model_get_config(e->model);
        uint32_t V = (uint32_t)mc->vocab_size, n = st->n;
        float *ref = malloc((size_t)n * V * sizeof(float)), *lp = malloc(V * sizeof(float));
        uint32_t *ref_top = malloc(n * sizeof(uint32_t));
        float *ref_conf = malloc(n * sizeof(float));
        struct kvc_session *sessions[MAX_CONFIGS] = { 0 };
        struct seq_rec rec[MAX_CONFIGS] = { 0 };
        double last_charged[MAX_CONFIGS] = { 0 };
        bool *is_target = calloc(n + 1, 1);
        struct plain_cache *plain = NULL;
        int r = 0;
        if (!ref || !lp || !ref_top || !ref_conf || !is_target)
                r = -ENOMEM;
        for (uint32_t i = 0; i < st->n_targets; i++)
                is_target[st->targets[i]] = true;

        /* the reference: the model with its own cache */
        if (r == 0)
                r = plain_cache_new(mc, mc->seq_len, &plain);
        for (uint32_t pos = 0; r == 0 && pos + 1 < n; pos++) {
                float *logits;
                if ((r = model_forward(e->model, st->tokens[pos], (int)pos, &plain_cache_ops, plain,
                                       &logits)) < 0)
                        break;
                ref_top[pos] = log_softmax(logits, V, ref + (size_t)pos * V);
                struct kvc_summary sm;
                kvc_summarize(logits, V, &sm);
                ref_conf[pos] = kvc_confidence(&sm);
                own->nll -= ref[(size_t)pos * V + (uint32_t)st->tokens[pos + 1]];
                own->n++;
        }
        plain_cache_free(plain);

        /* every configuration, in lockstep through kvcd */
        uint32_t prompt = e->prompt_tokens < n ? e->prompt_tokens : n;
        for (uint32_t c = 0; r == 0 && c < e->n_configs; c++) {
                const struct config *cf = &e->configs[c];
                struct kvc_session_config sc = {
                        .geometry = { .n_layers = (uint32_t)mc->n_layers,
                                      .n_heads = (uint32_t)mc->n_heads,
                                      .n_kv_heads = (uint32_t)mc->n_kv_heads,
                                      .head_dim = (uint32_t)(mc->dim / mc->n_heads),
                                      .dtype = e->dtype,
                                      .max_tokens = (uint32_t)mc->seq_len },
                        .policy = cf->policy,
                        .budget_tokens = cf->budget,
                        .params = cf->params,
                        .n_params = cf->n_params,
                        .prompt_tokens = prompt,
                };
                if ((r = kvc_session_open(client, &sc, &sessions[c])) < 0)
                        fprintf(stderr, "kvc-eval: %s: %s\n", cf->label, kvc_last_error(client));
        }
        double fp_b = fp16_token_bytes(mc), q8_b = q8_token_bytes(mc);
        for (uint32_t pos = 0; r == 0 && pos + 1 < n; pos++) {
                uint32_t target = (uint32_t)st->tokens[pos + 1];
                const float *rl = ref + (size_t)pos * V;
                for (uint32_t c = 0; r == 0 && c < e->n_configs; c++) {
                        double t0 = seconds();
                        float *logits;
                        if ((r = model_forward(e->model, st->tokens[pos], (int)pos, &kvccache_ops,
                                               sessions[c], &logits)) < 0)
                                break;
                        uint32_t top = log_softmax(logits, V, lp);
                        struct metrics *mt = &m[c];
                        mt->nll -= lp[target];
                        double kl = 0;
                        for (uint32_t v = 0; v < V; v++)
                                kl += exp(rl[v]) * ((double)rl[v] - lp[v]);
                        mt->kl += kl;
                        mt->top1 += top == ref_top[pos];
                        mt->n++;
                        rec[c].nll -= lp[target];
                        rec[c].kl += kl;
                        rec[c].top1 += top == ref_top[pos];
                        rec[c].n++;
                        if (is_target[pos + 1]) {
                                mt->name_n++;
                                mt->name_hit += top == target;
                                mt->name_logp += lp[target];
                                rec[c].name_n++;
                                rec[c].name_hit += top == target;
                                rec[c].name_logp += lp[target];
                        }
                        if (pairs && strcmp(e->configs[c].label, e->corr_label) == 0)
                                fprintf(pairs, "P %.6f,%.6g\n", (double)ref_conf[pos], kl);
                        struct kvc_summary sm;
                        kvc_summarize(logits, V, &sm);
                        enum kvc_phase ph = pos + 1 < prompt ? KVC_PHASE_PREFILL : KVC_PHASE_DECODE;
                        if ((r = kvc_step(sessions[c], pos, ph, &sm)) < 0)
                                break;
                        mt->seconds += seconds() - t0;
                }
                double t0 = seconds();
                if (r == 0 && (r = kvc_flush(client)) < 0)
                        fprintf(stderr, "kvc-eval: step %u: %s\n", pos, kvc_last_error(client));
                double per = (seconds() - t0) / e->n_configs;
                /* bytes held after this step's plans, as the client holds them */
                for (uint32_t c = 0; r == 0 && c < e->n_configs; c++) {
                        m[c].seconds += per;
                        double bytes = 0, q8 = 0;
                        for (uint32_t l = 0; l < (uint32_t)mc->n_layers; l++) {
                                uint32_t nq = kvc_layer_q8_tokens(sessions[c], l);
                                bytes += (kvc_layer_tokens(sessions[c], l) - nq) * fp_b + nq * q8_b;
                                q8 += nq * q8_b;
                        }
                        m[c].bytes_sum += bytes;
                        m[c].q8_bytes_sum += q8;
                        if ((uint64_t)bytes > m[c].peak_bytes)
                                m[c].peak_bytes = (uint64_t)bytes;
                        /* what kvcd charges: every block it granted the session, full size */
                        double charged = 0, tokens = 0;
                        for (uint32_t l = 0; l < (uint32_t)mc->n_layers; l++) {
                                struct kvc_layer_view v;
                                if (kvc_layer_view(sessions[c], l, &v) < 0)
                                        continue;
                                charged += (double)v.n_blocks * (double)v.block_bytes +
                                           (double)v.n_q8_blocks * (double)v.q8_block_bytes;
                                tokens += v.n_tokens;
                                if (v.n_tokens > m[c].peak_tokens)
                                        m[c].peak_tokens = v.n_tokens;
                        }
                        m[c].charged_sum += charged;
                        m[c].tokens_sum += tokens / mc->n_layers;
                        rec[c].charged += charged;
                        last_charged[c] = charged;
                }
        }
        for (uint32_t c = 0; c < e->n_configs; c++) {
                if (!sessions[c])
                        continue;
                struct kvc_session_stats ss;
                if (kvc_session_close(sessions[c], &ss) == 0) {
                        m[c].plans += ss.plans_applied;
                        /* kvcd's own accounting: its peak, and what it charges at the end beyond
                         * the blocks the layers hold (a block granted ahead) */
                        if (ss.peak_bytes > m[c].peak_charged)
                                m[c].peak_charged = ss.peak_bytes;
                        if ((double)ss.bytes > last_charged[c])
                                m[c].bytes_mismatch += ss.bytes - (uint64_t)last_charged[c];
                }
                m[c].sequences++;
                if (r == 0 && pairs)
                        fprintf(pairs, "S %u %u %.17g %.17g %.17g %.17g %.17g %.17g %.17g %.17g\n", index, c,
                                rec[c].nll, rec[c].kl, rec[c].top1, rec[c].n, rec[c].charged, rec[c].name_n,
                                rec[c].name_hit, rec[c].name_logp);
        }
        if (r == 0 && pairs) {
                fprintf(pairs, "G %u\n", n ? n - 1 : 0);
                fflush(pairs);
        }
        free(ref);
        free(lp);
        free(ref_top);
        free(ref_conf);
        free(is_target);
        return r;
}

/* A worker: stories first + k * jobs; writes its metrics as text lines to out. */
static int worker(struct eval *e, uint32_t index, FILE *out) {
        const char *starts[2048];
        size_t lens[2048];
        size_t n_stories = split_stories(e->text, e->text_len, starts, lens, 2048);
        struct metrics m[MAX_CONFIGS] = { 0 }, own = { 0 };
        struct kvc_client *client;
        struct kvc_options ko = { .socket = e->socket, .name = "kvc-eval", .timeout_ms = 60000 };
        int r = kvc_connect(&ko, &client);
        if (r < 0) {
                fprintf(stderr, "kvc-eval: cannot connect to kvcd: %s\n", strerror(-r));
                return r;
        }
        for (uint32_t k = index; r == 0 && k < e->sequences; k += e->jobs) {
                uint32_t s = e->split_first + e->first + k;
                if (s >= e->split_end || s >= n_stories)
                        break;
                struct story st = { 0 };
                r = make_story(e, starts[s], lens[s], &st);
                if (r == 0)
                        r = run_story(e, client, &st, k, m, &own, out);
                story_free(&st);
        }
        kvc_disconnect(client);
        for (uint32_t c = 0; r == 0 && c < e->n_configs; c++)
                fprintf(out,
                        "M %u %.17g %.17g %.17g %.17g %.17g %.17g %llu %llu %llu %llu %llu %llu %llu %.17g "
                        "%.17g %llu "
                        "%llu %llu\n",
                        c, m[c].nll, m[c].kl, m[c].name_logp, m[c].bytes_sum, m[c].q8_bytes_sum, m[c].seconds,
                        (unsigned long long)m[c].n, (unsigned long long)m[c].top1,
                        (unsigned long long)m[c].name_n, (unsigned long long)m[c].name_hit,
                        (unsigned long long)m[c].peak_bytes, (unsigned long long)m[c].plans,
                        (unsigned long long)m[c].sequences, m[c].charged_sum, m[c].tokens_sum,
                        (unsigned long long)m[c].peak_charged, (unsigned long long)m[c].peak_tokens,
                        (unsigned long long)m[c].bytes_mismatch);
        if (r == 0)
                fprintf(out, "O %.17g %llu\n", own.nll, (unsigned long long)own.n);
        return r;
}

/* One line a worker wrote: P (a confidence/KL pair), S (one sequence of one configuration), G (a
 * sequence done: its scored positions), O (the model alone), M (a configuration's totals).
 * Returns the positions a G line reports, else 0. */
static uint64_t merge_line(struct eval *e, const char *line, struct metrics *m, struct metrics *own,
                           FILE *pairs) {
        if (line[0] == 'P') {
                if (pairs)
                        fprintf(pairs, "%s\n", line + 2);
                return 0;
        }
        if (line[0] == 'G')
                return strtoull(line + 2, NULL, 10);
        if (line[0] == 'S') {
                unsigned k, c;
                struct seq_rec x;
                if (sscanf(line + 2, "%u %u %lf %lf %lf %lf %lf %lf %lf %lf", &k, &c, &x.nll, &x.kl, &x.top1,
                           &x.n, &x.charged, &x.name_n, &x.name_hit, &x.name_logp) == 10 &&
                    k < e->sequences && c < e->n_configs)
                        e->recs[(size_t)k * e->n_configs + c] = x;
                return 0;
        }
        {
                if (line[0] == 'O') {
                        double nll;
                        unsigned long long n;
                        if (sscanf(line + 2, "%lf %llu", &nll, &n) == 2) {
                                own->nll += nll;
                                own->n += n;
                        }
                        return 0;
                }
                unsigned c;
                struct metrics x = { 0 };
                unsigned long long v[10];
                if (line[0] != 'M' ||
                    sscanf(line + 2,
                           "%u %lf %lf %lf %lf %lf %lf %llu %llu %llu %llu %llu %llu %llu %lf %lf %llu %llu "
                           "%llu",
                           &c, &x.nll, &x.kl, &x.name_logp, &x.bytes_sum, &x.q8_bytes_sum, &x.seconds, &v[0],
                           &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &x.charged_sum, &x.tokens_sum, &v[7],
                           &v[8], &v[9]) != 19 ||
                    c >= MAX_CONFIGS)
                        return 0;
                m[c].nll += x.nll;
                m[c].kl += x.kl;
                m[c].name_logp += x.name_logp;
                m[c].bytes_sum += x.bytes_sum;
                m[c].q8_bytes_sum += x.q8_bytes_sum;
                m[c].seconds += x.seconds;
                m[c].n += v[0];
                m[c].top1 += v[1];
                m[c].name_n += v[2];
                m[c].name_hit += v[3];
                m[c].peak_bytes = v[4] > m[c].peak_bytes ? v[4] : m[c].peak_bytes;
                m[c].plans += v[5];
                m[c].sequences += v[6];
                m[c].charged_sum += x.charged_sum;
                m[c].tokens_sum += x.tokens_sum;
                m[c].peak_charged = v[7] > m[c].peak_charged ? v[7] : m[c].peak_charged;
                m[c].peak_tokens = v[8] > m[c].peak_tokens ? v[8] : m[c].peak_tokens;
                m[c].bytes_mismatch += v[9];
        }
        return 0;
}

/* What one configuration measured, in the units the report uses. Bytes are kvcd's: `charged` is
 * the average over steps of the blocks it granted the session times their size (full precision
 * and INT8 blocks, side arrays and partly filled blocks included), `peak_charged` the peak kvcd
 * reported at close; `bytes` is the old nominal count (live tokens as FP16, INT8 with its
 * scales), kept beside it. */
struct row {
        const struct config *cf;
        uint32_t index;
        double ppl, kl, top1, name_acc, name_lp, bytes, peak, q8;
        double charged, peak_charged, tokens, peak_tokens;
        uint64_t n, name_n, plans;
        double close_extra; /* per sequence: kvcd's bytes at close beyond the layers' blocks */
        double seconds;
        struct stats_ci ppl_ci, kl_ci;
        bool no_compression; /* snapkv with the prompt within its budget */
};

enum seq_metric { SEQ_NLL, SEQ_KL, SEQ_TOP1, SEQ_NAME };

/* The per-sequence sums of configuration c and their weights (tokens, or name targets). */
static void seq_vec(const struct eval *e, uint32_t c, enum seq_metric what, double *y, double *w) {
        for (uint32_t k = 0; k < e->sequences; k++) {
                const struct seq_rec *r = &e->recs[(size_t)k * e->n_configs + c];
                y[k] = what == SEQ_NLL    ? r->nll
                       : what == SEQ_KL   ? r->kl
                       : what == SEQ_TOP1 ? r->top1
                                          : r->name_hit;
                w[k] = what == SEQ_NAME ? r->name_n : r->n;
        }
}

/* SnapKV keeps a prompt no longer than its budget whole. (PyramidKV's deep layers get a small
 * share of the budget, so it compresses them even then: it is not marked.) */
static bool is_prompt_compressor(const char *policy) {
        return strcmp(policy, "snapkv") == 0;
}

static struct row row_of(const struct eval *e, uint32_t c, const struct metrics *x) {
        const struct config *cf = &e->configs[c];
        double n = x->n ? (double)x->n : 1;
        struct row r = { .cf = cf,
                         .index = c,
                         .ppl = exp(x->nll / n),
                         .kl = x->kl / n,
                         .top1 = (double)x->top1 / n,
                         .name_acc = x->name_n ? (double)x->name_hit / (double)x->name_n : 0,
                         .name_lp = x->name_n ? x->name_logp / (double)x->name_n : 0,
                         .bytes = x->bytes_sum / n,
                         .peak = (double)x->peak_bytes,
                         .q8 = x->q8_bytes_sum / n,
                         .charged = x->charged_sum / n,
                         .peak_charged = (double)x->peak_charged,
                         .tokens = x->tokens_sum / n,
                         .peak_tokens = (double)x->peak_tokens,
                         .n = x->n,
                         .name_n = x->name_n,
                         .plans = x->plans,
                         .close_extra = x->sequences ? (double)x->bytes_mismatch / (double)x->sequences : 0,
                         .seconds = x->seconds,
                         .no_compression =
                                 is_prompt_compressor(cf->policy) && e->prompt_tokens <= cf->budget };
        double *y = malloc(e->sequences * sizeof(double)), *w = malloc(e->sequences * sizeof(double));
        if (y && w) {
                seq_vec(e, c, SEQ_NLL, y, w);
                if (stats_ratio_ci(y, w, e->sequences, &r.ppl_ci) == 0) {
                        r.ppl_ci.lo = exp(r.ppl_ci.lo);
                        r.ppl_ci.hi = exp(r.ppl_ci.hi);
                }
                seq_vec(e, c, SEQ_KL, y, w);
                stats_ratio_ci(y, w, e->sequences, &r.kl_ci);
        }
        free(y);
        free(w);
        return r;
}

static const struct row *find_row(const struct row *rows, uint32_t n, const char *label) {
        for (uint32_t i = 0; i < n; i++)
                if (strcmp(rows[i].cf->label, label) == 0)
                        return &rows[i];
        return NULL;
}

/* A family's two neighbouring points around `bytes` (charged, average over steps) and the weight
 * t of the upper one: the family at those bytes is (1 - t) lo + t hi, per sequence as well as in
 * total (the interpolation is linear). -ERANGE outside the family's range. */
static int family_at(const struct row *rows, uint32_t n, const char *family, double bytes,
                     const struct row **lo, const struct row **hi, double *t) {
        *lo = *hi = NULL;
        for (uint32_t i = 0; i < n; i++) {
                if (strcmp(rows[i].cf->family, family) != 0)
                        continue;
                if (rows[i].charged <= bytes && (!*lo || rows[i].charged > (*lo)->charged))
                        *lo = &rows[i];
                if (rows[i].charged >= bytes && (!*hi || rows[i].charged < (*hi)->charged))
                        *hi = &rows[i];
        }
        if (!*lo || !*hi)
                return -ERANGE;
        *t = (*hi)->charged == (*lo)->charged ? 0
                                              : (bytes - (*lo)->charged) / ((*hi)->charged - (*lo)->charged);
        return 0;
}

/* Per sequence: configuration a's metric against the family interpolated at a's charged bytes
 * (or at `bytes` when > 0), paired; d = a - family. The family's value goes to *ret_other. */
static int paired_at_bytes(const struct eval *e, const struct row *rows, uint32_t n, const struct row *a,
                           const char *family, double bytes, enum seq_metric what, struct stats_ci *d,
                           double *ret_other) {
        const struct row *lo, *hi;
        double t;
        if (family_at(rows, n, family, bytes > 0 ? bytes : a->charged, &lo, &hi, &t) < 0)
                return -ERANGE;
        uint32_t k = e->sequences;
        double *ya = malloc(k * sizeof(double)), *yl = malloc(k * sizeof(double)),
               *yh = malloc(k * sizeof(double)), *w = malloc(k * sizeof(double));
        int r = ya && yl && yh && w ? 0 : -ENOMEM;
        if (r == 0) {
                seq_vec(e, lo->index, what, yl, w);
                seq_vec(e, hi->index, what, yh, w);
                double sy = 0, sw = 0;
                for (uint32_t i = 0; i < k; i++) {
                        yl[i] = (1 - t) * yl[i] + t * yh[i];
                        sy += yl[i], sw += w[i];
                }
                *ret_other = sw > 0 ? sy / sw : 0;
                seq_vec(e, a->index, what, ya, w);
                r = stats_paired_ci(ya, yl, w, k, d);
        }
        free(ya), free(yl), free(yh), free(w);
        return r;
}

/* (sum(a) - sum(b)) / sum(b) per sequence cluster: the relative change of b's metric to a's. */
static int relative_change(const struct eval *e, const struct row *a, const struct row *b,
                           enum seq_metric what, struct stats_ci *d) {
        uint32_t k = e->sequences;
        double *ya = malloc(k * sizeof(double)), *yb = malloc(k * sizeof(double)),
               *w = malloc(k * sizeof(double));
        int r = ya && yb && w ? 0 : -ENOMEM;
        if (r == 0) {
                seq_vec(e, a->index, what, ya, w);
                seq_vec(e, b->index, what, yb, w);
                for (uint32_t i = 0; i < k; i++)
                        ya[i] -= yb[i];
                r = stats_ratio_ci(ya, yb, k, d);
        }
        free(ya), free(yb), free(w);
        return r;
}

/* Pearson r of the (confidence, KL) pairs and its 95% interval (Fisher z). */
static int pearson(const char *path, double *r, double *lo, double *hi, uint64_t *ret_n) {
        FILE *f = fopen(path, "r");
        char line[128];
        double sx = 0, sy = 0, sxx = 0, syy = 0, sxy = 0;
        uint64_t n = 0;
        if (!f)
                return -errno;
        while (fgets(line, sizeof(line), f)) {
                double x, y;
                if (sscanf(line, "%lf,%lf", &x, &y) != 2)
                        continue;
                sx += x, sy += y, sxx += x * x, syy += y * y, sxy += x * y;
                n++;
        }
        fclose(f);
        if (n < 4)
                return -EINVAL;
        double cov = sxy - sx * sy / n, vx = sxx - sx * sx / n, vy = syy - sy * sy / n;
        *r = cov / sqrt(vx * vy);
        double z = atanh(*r), se = 1.0 / sqrt((double)n - 3);
        *lo = tanh(z - 1.96 * se);
        *hi = tanh(z + 1.96 * se);
        *ret_n = n;
        return 0;
}

/* The markdown report: the table, then each target the project set itself, measured as paired
 * comparisons over stories with their 95% intervals. */
static void write_markdown(const struct eval *e, const struct row *rows, uint32_t n, double own_ppl,
                           uint64_t own_n, const char *path, const char *pairs_path) {
        FILE *f = fopen(path, "w");
        if (!f)
                return;
        const struct row *full = find_row(rows, n, "full");
        fprintf(f, "# Quality per byte: every policy on stories260K through kvcd\n\n");
        fprintf(f,
                "%u stories of the TinyStories validation sample, **%s split** (stories %u to %u of the "
                "sample; the tuning split is stories 0 to %u, the test split %u on: the defaults of conf's "
                "tau and w_rec and prob's temperature were chosen on the first 64 stories, inside the tuning "
                "split), at most %u tokens each, the first %u of each declared the prompt; %llu tokens "
                "scored per configuration, teacher-forced. The model's own perplexity without kvcd: %.4f.\n\n"
                "**Bytes are kvcd's**, with keys and values stored as **%s** (`--dtype`; full precision "
                "is what INT8 is compared against, so the storage moves every INT8 verdict): *charged* "
                "is what kvcd's accounting charges the session (every block "
                "it granted, full precision or INT8, at its full size with the side arrays), averaged over "
                "steps, and its peak as kvcd reported it at close; *nominal* is the old count (live tokens "
                "as FP16, INT8 with its scales). **Tokens held** are per layer, as kvcd counts them "
                "(average over steps and layers / the largest layer at any step): a plan fires at the "
                "budget plus the policy's slack (a block by default), so a budget-B row holds between B "
                "and B + 15 tokens: compare rows at equal charged bytes, never by their labels. "
                "Intervals are 95%%, clustered by story (eval/stats.h).\n\n",
                e->sequences, e->split, e->split_first + e->first,
                e->split_first + e->first + e->sequences - 1, TUNE_STORIES - 1, TUNE_STORIES, e->max_tokens,
                e->prompt_tokens, (unsigned long long)own_n, own_ppl,
                e->dtype == KVC_DTYPE_F16 ? "FP16" : "FP32");
        fprintf(f, "| configuration | ppl [95%% CI] | KL(full‖policy) | top-1 agree | name acc | "
                   "charged bytes avg | charged peak | nominal avg | tokens held avg / peak | plans |\n");
        fprintf(f, "|---|---|---|---|---|---|---|---|---|---|\n");
        for (uint32_t i = 0; i < n; i++) {
                const struct row *r = &rows[i];
                const char *mark = r->no_compression ? " †" : strcmp(r->cf->policy, "scope") == 0 ? " ‡" : "";
                fprintf(f,
                        "| %s%s | %.4f [%.4f, %.4f] | %.4f | %.3f | %.3f | %.0f | %.0f | %.0f | %.1f / %.0f "
                        "| %llu "
                        "|\n",
                        r->cf->label, mark, r->ppl, r->ppl_ci.lo, r->ppl_ci.hi, r->kl, r->top1, r->name_acc,
                        r->charged, r->peak_charged, r->bytes, r->tokens, r->peak_tokens,
                        (unsigned long long)r->plans);
        }
        fprintf(f,
                "\n† snapkv with a budget of at least the %u-token prompt: it "
                "compresses nothing (pyramid still compresses its deeper layers), and the row is the full "
                "cache under another name.\n"
                "‡ SCOPE keeps the prompt plus its decode budget, so scope-B holds what a B + prompt window "
                "holds: compare it at equal charged bytes only.\n\n",
                e->prompt_tokens);
        fprintf(f,
                "Name recall counts %llu name recurrences (a character's name again at least %d tokens after "
                "it first appeared).\n\n## The targets, measured\n\n"
                "Each is a paired comparison over the same stories; a difference whose interval contains 0 "
                "is **no difference**.\n\n",
                (unsigned long long)(full ? full->name_n : 0), NAME_GAP);

        const struct row *w64 = find_row(rows, n, "window-64");
        if (full && w64) {
                const struct row *lo, *hi;
                double t;
                if (family_at(rows, n, "conf-int8", w64->charged, &lo, &hi, &t) == 0) {
                        /* closed = (nll_w - nll_c) / (nll_w - nll_full), per story clustered */
                        uint32_t k = e->sequences;
                        double *u = malloc(k * sizeof(double)), *v = malloc(k * sizeof(double)),
                               *a = malloc(k * sizeof(double)), *b = malloc(k * sizeof(double)),
                               *w = malloc(k * sizeof(double));
                        struct stats_ci closed;
                        if (u && v && a && b && w) {
                                seq_vec(e, w64->index, SEQ_NLL, u, w);
                                seq_vec(e, full->index, SEQ_NLL, v, w);
                                seq_vec(e, lo->index, SEQ_NLL, a, w);
                                seq_vec(e, hi->index, SEQ_NLL, b, w);
                                for (uint32_t i = 0; i < k; i++) {
                                        double c = (1 - t) * a[i] + t * b[i];
                                        double gap = u[i] - v[i];
                                        u[i] = u[i] - c;
                                        v[i] = gap;
                                }
                                if (stats_ratio_ci(u, v, k, &closed) == 0)
                                        fprintf(f,
                                                "1. **CONF-KV with INT8 at the charged bytes of a 64-token "
                                                "window** (%.0f bytes; between %s and %s): it closes "
                                                "**%.0f%%** "
                                                "[%.0f%%, %.0f%%] of the window's gap to the full cache in "
                                                "log "
                                                "perplexity (target: 80%%; the paper reports 74%% on GPT-2) "
                                                "— "
                                                "**%s**.\n",
                                                w64->charged, lo->cf->label, hi->cf->label, 100 * closed.mean,
                                                100 * closed.lo, 100 * closed.hi,
                                                stats_verdict(&closed, 0.8, false));
                        }
                        free(u), free(v), free(a), free(b), free(w);
                } else {
                        fprintf(f,
                                "1. CONF-KV with INT8: its curve does not reach the window-64's %.0f "
                                "charged bytes; not measured.\n",
                                w64->charged);
                }
        }
        fprintf(f, "2. **Confidence gating against its own fixed-budget ranking at equal charged bytes** "
                   "(mean NLL per token, the gated point minus conf-fixed interpolated at its bytes; "
                   "negative: gating better):\n");
        static const char *const gated[] = { "conf-naive", "conf-defer" };
        for (size_t g = 0; g < 2; g++) {
                for (uint32_t i = 0; i < n; i++) {
                        if (strcmp(rows[i].cf->family, gated[g]) != 0)
                                continue;
                        struct stats_ci d;
                        double other;
                        if (paired_at_bytes(e, rows, n, &rows[i], "conf-fixed", 0, SEQ_NLL, &d, &other) < 0) {
                                fprintf(f, "   - %s at %.0f bytes: outside conf-fixed's range\n",
                                        rows[i].cf->label, rows[i].charged);
                                continue;
                        }
                        const char *v = stats_verdict(&d, 0, true);
                        fprintf(f, "   - %s at %.0f bytes: ppl %.4f vs %.4f, ΔNLL %+.5f [%+.5f, %+.5f]: %s\n",
                                rows[i].cf->label, rows[i].charged, rows[i].ppl, exp(other), d.mean, d.lo,
                                d.hi,
                                strcmp(v, "holds") == 0           ? "gating better"
                                : strcmp(v, "no difference") == 0 ? "no difference"
                                                                  : "gating worse");
                }
        }
        fprintf(f, "3. **Decode-time correction against plain eviction at equal budget** (mean KL, relative "
                   "change; target: at least 20%% lower):\n");
        static const char *const corr[][2] = { { "prob-ht", "prob-none" },
                                               { "prob-moment", "prob-none" },
                                               { "prob-sink", "prob-none" },
                                               { "conf-moment", "conf-fixed" } };
        static const uint32_t budgets[] = { 32, 64, 128, 256 };
        for (size_t c = 0; c < sizeof(corr) / sizeof(corr[0]); c++) {
                for (size_t b = 0; b < 4; b++) {
                        char la[64], lb[64];
                        snprintf(la, sizeof(la), "%s-%u", corr[c][0], budgets[b]);
                        snprintf(lb, sizeof(lb), "%s-%u", corr[c][1], budgets[b]);
                        const struct row *x = find_row(rows, n, la), *y = find_row(rows, n, lb);
                        struct stats_ci d;
                        if (x && y && y->kl > 0 && relative_change(e, x, y, SEQ_KL, &d) == 0)
                                fprintf(f,
                                        "   - %s vs %s (%.0f vs %.0f charged bytes): KL %.4f vs %.4f, "
                                        "%+.0f%% "
                                        "[%+.0f%%, %+.0f%%] — %s\n",
                                        la, lb, x->charged, y->charged, x->kl, y->kl, 100 * d.mean,
                                        100 * d.lo, 100 * d.hi, stats_verdict(&d, 0.2, true));
                }
        }
        fprintf(f,
                "4. **SCOPE against unified compression (H2O over all positions, prompt included) at equal "
                "charged bytes** (ΔNLL, SCOPE minus h2o-unified; negative: SCOPE better):\n");
        for (uint32_t i = 0; i < n; i++) {
                if (strcmp(rows[i].cf->family, "scope-slide") != 0)
                        continue;
                struct stats_ci d;
                double other;
                if (paired_at_bytes(e, rows, n, &rows[i], "h2o-unified", 0, SEQ_NLL, &d, &other) < 0) {
                        fprintf(f, "   - %s at %.0f bytes: outside h2o-unified's range\n", rows[i].cf->label,
                                rows[i].charged);
                        continue;
                }
                const char *v = stats_verdict(&d, 0, true);
                fprintf(f, "   - %s at %.0f bytes: ppl %.4f vs %.4f, ΔNLL %+.5f [%+.5f, %+.5f]: %s\n",
                        rows[i].cf->label, rows[i].charged, rows[i].ppl, exp(other), d.mean, d.lo, d.hi,
                        strcmp(v, "holds") == 0           ? "SCOPE better"
                        : strcmp(v, "no difference") == 0 ? "no difference"
                                                          : "SCOPE worse");
        }
        double r = 0, lo = 0, hi = 0;
        uint64_t np = 0;
        if (pearson(pairs_path, &r, &lo, &hi, &np) == 0)
                fprintf(f,
                        "5. **The mechanism**: Pearson r between the full cache's confidence and the KL a %s "
                        "causes, over %llu steps: **r = %.3f** (95%% CI %.3f to %.3f, steps treated as "
                        "independent: too narrow). The paper reports r = -0.77.\n",
                        e->corr_label, (unsigned long long)np, r, lo, hi);
        fclose(f);
}

/* out_dir/name.partial: what a run writes until it completes (then renamed over out_dir/name). */
static void partial_path(const struct eval *e, const char *name, bool partial, char *buf, size_t len) {
        snprintf(buf, len, "%s/%s%s", e->out_dir, name, partial ? ".partial" : "");
}

static void report(struct eval *e, const struct metrics *m, const struct metrics *own) {
        double own_ppl = own->n ? exp(own->nll / (double)own->n) : 0;
        struct row rows[MAX_CONFIGS];
        for (uint32_t c = 0; c < e->n_configs; c++)
                rows[c] = row_of(e, c, &m[c]);
        const struct row *full = find_row(rows, e->n_configs, "full");
        FILE *jsonl = NULL, *csv = NULL;
        char path[512];
        printf("{\"own\":true,\"ppl\":%.8f,\"tokens\":%llu}\n", own_ppl, (unsigned long long)own->n);
        partial_path(e, "results.jsonl", true, path, sizeof(path));
        if ((jsonl = fopen(path, "w")))
                fprintf(jsonl, "{\"own\":true,\"ppl\":%.8f,\"tokens\":%llu}\n", own_ppl,
                        (unsigned long long)own->n);
        partial_path(e, "results.csv", true, path, sizeof(path));
        if ((csv = fopen(path, "w")))
                fprintf(csv,
                        "label,family,policy,budget,ppl,ppl_gap,kl,top1_agree,name_acc,name_logp,name_n,"
                        "avg_kv_bytes,peak_kv_bytes,avg_int8_bytes,tokens,plans,seconds,"
                        "avg_charged_bytes,peak_charged_bytes,avg_tokens_held,peak_tokens_held,ppl_lo,ppl_"
                        "hi,kl_lo,kl_hi,no_compression,split\n");
        for (uint32_t c = 0; c < e->n_configs; c++) {
                const struct row *r = &rows[c];
                double gap = full ? r->ppl - full->ppl : 0;
                char line[2048];
                snprintf(line, sizeof(line),
                         "{\"label\":\"%s\",\"family\":\"%s\",\"policy\":\"%s\",\"budget\":%u,\"ppl\":%.8f,"
                         "\"ppl_gap\":%.6f,\"kl\":%.6f,\"top1_agree\":%.6f,\"name_acc\":%.6f,\"name_logp\":%."
                         "6f,"
                         "\"name_n\":%llu,\"avg_kv_bytes\":%.1f,\"peak_kv_bytes\":%.0f,\"avg_int8_bytes\":%."
                         "1f,"
                         "\"tokens\":%llu,\"plans\":%llu,\"seconds\":%.3f,\"avg_charged_bytes\":%.1f,"
                         "\"peak_charged_bytes\":%.0f,\"avg_tokens_held\":%.2f,\"peak_tokens_held\":%.0f,"
                         "\"close_extra_bytes\":%.0f,\"ppl_lo\":%.6f,\"ppl_hi\":%.6f,\"kl_lo\":%.6f,\"kl_"
                         "hi\":%."
                         "6f,"
                         "\"no_compression\":%s,\"split\":\"%s\",\"sequences\":%u}\n",
                         r->cf->label, r->cf->family, r->cf->policy, r->cf->budget, r->ppl, gap, r->kl,
                         r->top1, r->name_acc, r->name_lp, (unsigned long long)r->name_n, r->bytes, r->peak,
                         r->q8, (unsigned long long)r->n, (unsigned long long)r->plans, r->seconds,
                         r->charged, r->peak_charged, r->tokens, r->peak_tokens, r->close_extra, r->ppl_ci.lo,
                         r->ppl_ci.hi, r->kl_ci.lo, r->kl_ci.hi, r->no_compression ? "true" : "false",
                         e->split, e->sequences);
                fputs(line, stdout);
                if (jsonl)
                        fputs(line, jsonl);
                if (csv)
                        fprintf(csv,
                                "%s,%s,%s,%u,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%llu,%.1f,%.0f,%.1f,%llu,%llu,%."
                                "3f,"
                                "%.1f,%.0f,%.2f,%.0f,%.6f,%.6f,%.6f,%.6f,%d,%s\n",
                                r->cf->label, r->cf->family, r->cf->policy, r->cf->budget, r->ppl, gap, r->kl,
                                r->top1, r->name_acc, r->name_lp, (unsigned long long)r->name_n, r->bytes,
                                r->peak, r->q8, (unsigned long long)r->n, (unsigned long long)r->plans,
                                r->seconds, r->charged, r->peak_charged, r->tokens, r->peak_tokens,
                                r->ppl_ci.lo, r->ppl_ci.hi, r->kl_ci.lo, r->kl_ci.hi, r->no_compression,
                                e->split);
        }
        if (csv)
                fclose(csv);
        if (jsonl)
                fclose(jsonl);
        char pairs[512];
        partial_path(e, "confidence_kl.csv", true, pairs, sizeof(pairs));
        partial_path(e, "results.md", true, path, sizeof(path));
        write_markdown(e, rows, e->n_configs, own_ppl, own->n, path, pairs);
        /* complete: the results replace the old ones only now */
        static const char *const names[] = { "results.jsonl", "results.csv", "results.md",
                                             "confidence_kl.csv" };
        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
                char from[512], to[512];
                partial_path(e, names[i], true, from, sizeof(from));
                partial_path(e, names[i], false, to, sizeof(to));
                if (rename(from, to) < 0)
                        fprintf(stderr, "kvc-eval: cannot write %s: %s\n", to, strerror(errno));
        }
}

/* Reads every worker's lines as they come (poll), adds them up, and shows progress on stderr at
 * most once a second: sequences done, positions scored per second over all configurations, and
 * the time left at that rate. Returns the number of workers that failed. */
static int collect(struct eval *e, const int *fds, const pid_t *pids, struct metrics *m, struct metrics *own,
                   FILE *pairs, double t0) {
        struct pollfd pfd[64];
        char *bufs[64] = { 0 };
        size_t lens[64] = { 0 }, caps[64] = { 0 };
        uint32_t open_pipes = e->jobs, done = 0;
        uint64_t positions = 0;
        double last = 0;
        bool tty = isatty(2);
        for (uint32_t w = 0; w < e->jobs; w++)
                pfd[w] = (struct pollfd){ .fd = fds[w], .events = POLLIN };
        while (open_pipes > 0) {
                if (poll(pfd, e->jobs, 1000) < 0 && errno != EINTR)
                        break;
                for (uint32_t w = 0; w < e->jobs; w++) {
                        if (pfd[w].fd < 0 || !(pfd[w].revents & (POLLIN | POLLHUP | POLLERR)))
                                continue;
                        if (caps[w] - lens[w] < 4096) {
                                char *nb = realloc(bufs[w], caps[w] * 2 + 8192);
                                if (!nb)
                                        break;
                                bufs[w] = nb;
                                caps[w] = caps[w] * 2 + 8192;
                        }
                        ssize_t got = read(pfd[w].fd, bufs[w] + lens[w], caps[w] - lens[w] - 1);
                        if (got < 0 && errno == EINTR)
                                continue;
                        if (got <= 0) {
                                pfd[w].fd = -1;
                                open_pipes--;
                                continue;
                        }
                        lens[w] += (size_t)got;
                        bufs[w][lens[w]] = '\0';
                        char *line = bufs[w], *nl;
                        while ((nl = strchr(line, '\n'))) { /* whole lines only; the rest waits */
                                *nl = '\0';
                                uint64_t g = merge_line(e, line, m, own, pairs);
                                if (line[0] == 'G') {
                                        positions += g;
                                        done++;
                                }
                                line = nl + 1;
                        }
                        lens[w] -= (size_t)(line - bufs[w]);
                        memmove(bufs[w], line, lens[w]);
                }
                double now = seconds();
                if (now - last >= 1.0 || open_pipes == 0) {
                        last = now;
                        double rate = positions * e->n_configs / (now - t0 > 0 ? now - t0 : 1);
                        double left = done ? (now - t0) * (e->sequences - done) / done : 0;
                        fprintf(stderr,
                                "%skvc-eval: %u configurations, %u/%u sequences, %.0f tokens/s, %.0f s "
                                "left%s",
                                tty ? "\r" : "", e->n_configs, done, e->sequences, rate, left,
                                tty ? "   " : "\n");
                }
        }
        if (tty)
                fputc('\n', stderr);
        int failed = 0;
        for (uint32_t w = 0; w < e->jobs; w++) {
                free(bufs[w]);
                close(fds[w]);
                int st;
                waitpid(pids[w], &st, 0);
                failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        }
        return failed;
}

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
                   "  --dump-tokens          tiers: write the token ids of its documents and needles\n"
                   "                         (tiers_tokens.txt) and run nothing (bench/tiers-peers.sh)\n"
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
                case 'k': e.tok_path = optarg; break;
                case 'D': e.data_path = optarg; break;
                case 'n': e.sequences = (uint32_t)atoi(optarg); break;
                case 'f': e.first = (uint32_t)atoi(optarg); break;
                case 'x': e.max_tokens = (uint32_t)atoi(optarg); break;
                case 'p': e.prompt_tokens = (uint32_t)atoi(optarg); break;
                case 'c':
                        if (add_config(&e, optarg) < 0)
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
        e.recs = calloc((size_t)e.sequences * MAX_CONFIGS, sizeof(struct seq_rec));
        if (!e.recs)
                return 1;
        if (e.n_configs == 0 && (e.quick ? quick_suite(&e) : default_suite(&e)) < 0)
                return 2;

        int r = model_load(e.model_path, &e.model);
        if (r < 0) {
                fprintf(stderr, "kvc-eval: cannot load %s: %s\n", e.model_path, strerror(-r));
                return 1;
        }
        const struct model_config *mc = model_get_config(e.model);
        if (!e.max_tokens || e.max_tokens > (uint32_t)mc->seq_len)
                e.max_tokens = (uint32_t)mc->seq_len;
        FILE *df = fopen(e.data_path, "rb");
        if ((r = tokenizer_load(e.tok_path, mc->vocab_size, &e.tok)) < 0 || !df) {
                fprintf(stderr, "kvc-eval: cannot load the tokenizer or the data\n");
                return 1;
        }
        fseek(df, 0, SEEK_END);
        e.text_len = (size_t)ftell(df);
        fseek(df, 0, SEEK_SET);
        e.text = malloc(e.text_len + 1);
        if (!e.text || fread(e.text, 1, e.text_len, df) != e.text_len)
                return 1;
        e.text[e.text_len] = '\0';
        fclose(df);
        { /* the split may hold fewer stories than asked for: every interval counts the ones run */
                static const char *starts[2048];
                static size_t lens[2048];
                size_t ns = split_stories(e.text, e.text_len, starts, lens, 2048);
                size_t end = ns < e.split_end ? ns : e.split_end, from = (size_t)e.split_first + e.first;
                size_t avail = end > from ? end - from : 0;
                if (avail < 2) {
                        fprintf(stderr, "kvc-eval: the %s split holds %zu stories from --first on\n", e.split,
                                avail);
                        return 2;
                }
                if (e.sequences > avail)
                        e.sequences = (uint32_t)avail;
        }

        /* workers report through pipes; the parent adds up */
        struct metrics m[MAX_CONFIGS] = { 0 }, own = { 0 };
        FILE *pairs = NULL;
        char pairs_path[512];
        partial_path(&e, "confidence_kl.csv", true, pairs_path, sizeof(pairs_path));
        pairs = fopen(pairs_path, "w");
        if (pairs)
                fprintf(pairs, "confidence,kl\n");
        pid_t pids[64];
        int ins[64];
        double t0 = seconds();
        for (uint32_t w = 0; w < e.jobs; w++) {
                int fds[2];
                if (pipe(fds) < 0)
                        return 1;
                fflush(NULL);
                pids[w] = fork();
                if (pids[w] == 0) {
                        close(fds[0]);
                        FILE *out = fdopen(fds[1], "w");
                        int wr = worker(&e, w, out);
                        fclose(out);
                        _exit(wr < 0 ? 1 : 0);
                }
                close(fds[1]);
                ins[w] = fds[0];
        }
        int failed = collect(&e, ins, pids, m, &own, pairs, t0);
        if (pairs)
                fclose(pairs);
        if (failed) {
                fprintf(stderr, "kvc-eval: %d of %u workers failed: no results (%s untouched)\n", failed,
                        e.jobs, e.out_dir);
                unlink(pairs_path);
        } else {
                report(&e, m, &own);
                fprintf(stderr,
                        "kvc-eval: %u configurations, %llu tokens scored each, %.1f s; results in %s\n",
                        e.n_configs, (unsigned long long)(e.n_configs ? m[0].n : 0), seconds() - t0,
                        e.out_dir);
        }
        free(e.recs);
        tokenizer_free(e.tok);
        model_free(e.model);
        free(e.text);
        return failed ? 1 : 0;
}
