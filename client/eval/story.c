/* story.c: one story of the story suite and its metrics, on a worker's side (the contract is in
 * story.h): the text cut into stories, a story's tokens and name targets, the reference pass and
 * the lockstep pass through kvcd, and the lines a worker writes its sums as, with the parent's
 * reading of them beside the writing (one file holds the whole line format).
 */
#define _GNU_SOURCE
#include "story.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvccache.h"
#include "lab.h"

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
size_t story_split(const char *text, size_t len, const char **starts, size_t *lens, size_t max) {
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
                ref_top[pos] = lab_log_softmax(logits, V, ref + (size_t)pos * V);
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
                        double t0 = now_s();
                        float *logits;
                        if ((r = model_forward(e->model, st->tokens[pos], (int)pos, &kvccache_ops,
                                               sessions[c], &logits)) < 0)
                                break;
                        uint32_t top = lab_log_softmax(logits, V, lp);
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
                        mt->seconds += now_s() - t0;
                }
                double t0 = now_s();
                if (r == 0 && (r = kvc_flush(client)) < 0)
                        fprintf(stderr, "kvc-eval: step %u: %s\n", pos, kvc_last_error(client));
                double per = (now_s() - t0) / e->n_configs;
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
int story_worker(struct eval *e, uint32_t index, FILE *out) {
        const char *starts[2048];
        size_t lens[2048];
        size_t n_stories = story_split(e->text, e->text_len, starts, lens, 2048);
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
uint64_t story_merge_line(struct eval *e, const char *line, struct metrics *m, struct metrics *own,
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
                   &c, &x.nll, &x.kl, &x.name_logp, &x.bytes_sum, &x.q8_bytes_sum, &x.seconds, &v[0], &v[1],
                   &v[2], &v[3], &v[4], &v[5], &v[6], &x.charged_sum, &x.tokens_sum, &v[7], &v[8],
                   &v[9]) != 19 ||
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
        return 0;
}
