/* lab.c: what the SmolLM2 tasks share: the lab's model, stories and kvcd client, haystacks, sessions
 * and the bytes kvcd charges them, partial files (lab.h). */
#define _GNU_SOURCE
#include "lab.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "text.h"

double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t next_rand(uint64_t *s) {
        uint64_t x = *s;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        return *s = x;
}

static size_t split_stories(const char *text, size_t len, const char **starts, size_t *lens, size_t max) {
        static const char marker[] = "Once upon a time";
        size_t k = 0;
        const char *p = memmem(text, len, marker, sizeof(marker) - 1), *end = text + len;
        while (p && k < max) {
                const char *nx = memmem(p + 1, (size_t)(end - p - 1), marker, sizeof(marker) - 1);
                const char *stop = nx ? nx : end;
                while (stop > p && (stop[-1] == '\n' || stop[-1] == ' '))
                        stop--;
                starts[k] = p;
                lens[k] = (size_t)(stop - p);
                k++;
                p = nx;
        }
        return k;
}

int tb_add(struct textbuf *b, const char *s, size_t n) {
        if (b->len + n + 1 > b->cap) {
                size_t cap = (b->len + n + 1) * 2;
                char *p = realloc(b->s, cap);
                if (!p)
                        return -ENOMEM;
                b->s = p;
                b->cap = cap;
        }
        memcpy(b->s + b->len, s, n);
        b->len += n;
        b->s[b->len] = '\0';
        return 0;
}

int haystack(struct niah *n, uint32_t length, struct textbuf *out) {
        struct textbuf joined = { 0 };
        size_t avail = n->n_stories - NIAH_TEST_FIRST;
        size_t s = NIAH_TEST_FIRST + next_rand(&n->rng) % avail;
        int r = 0;
        /* about 4 bytes a token in these stories; 5 per token leaves room for the cut */
        while (r == 0 && joined.len < (size_t)length * 5 + 64) {
                if (joined.len)
                        r = tb_add(&joined, "\n\n", 2);
                if (r == 0)
                        r = tb_add(&joined, n->stories[s], n->story_lens[s]);
                s = s + 1 < n->n_stories ? s + 1 : NIAH_TEST_FIRST;
        }
        size_t cap = joined.len + 8, got = 0;
        int *ids = malloc(cap * sizeof(int));
        if (r == 0 && !ids)
                r = -ENOMEM;
        if (r == 0)
                r = text_encode(n->tok, joined.s, ids, cap, &got);
        if (r == 0 && got < length)
                r = -ENODATA;
        char piece[256];
        for (uint32_t i = 0; r == 0 && i < length; i++) {
                size_t pl = 0;
                if ((r = text_piece(n->tok, i ? ids[i - 1] : -1, ids[i], piece, sizeof(piece), &pl)) == 0)
                        r = tb_add(out, piece, pl);
        }
        free(ids);
        free(joined.s);
        return r;
}

void progress(struct niah *n, const char *task, uint32_t length, uint32_t needle) {
        double el = now_s() - n->t0, rate = el > 0 ? n->rows_done / el : 0;
        n->last_progress = now_s();
        double left = rate > 0 ? (n->rows_total - n->rows_done) / rate : 0;
        fprintf(stderr, "kvc-eval %s: length %u, %s %u/%u, %u configurations, %.0f tokens/s, %.0f s left\n",
                task, length,
                strcmp(task, "niah") == 0      ? "needle"
                : strcmp(task, "longgen") == 0 ? "prompt"
                                               : "document",
                needle, n->o->needles, n->n_cfg, rate, left > 0 ? left : 0);
}

void lab_rows_done(struct niah *n, double rows) {
        double now = now_s();
        n->rows_done += rows;
        if (n->last_progress == 0)
                n->last_progress = n->t0;
        if (now - n->last_progress < LAB_PROGRESS_S)
                return;
        n->last_progress = now;
        double el = now - n->t0, rate = el > 0 ? n->rows_done / el : 0;
        double left = rate > 0 ? (n->rows_total - n->rows_done) / rate : 0;
        fprintf(stderr, "kvc-eval %s: %.0f of %.0f rows (%.0f%%), %.0f tokens/s, %.0f s left\n", n->task,
                n->rows_done, n->rows_total, n->rows_total > 0 ? 100 * n->rows_done / n->rows_total : 0, rate,
                left > 0 ? left : 0);
}

struct niah_config *lab_config_add(struct niah *n, const struct niah_family *fam, double fraction,
                                   uint32_t budget) {
        if (n->n_cfg >= NIAH_MAX_CONFIGS)
                return NULL;
        struct niah_config *c = &n->cfg[n->n_cfg++];
        *c = (struct niah_config){ .fam = fam, .fraction = fraction, .budget = budget };
        if (!fam) {
                snprintf(c->label, sizeof(c->label), "full");
                return c;
        }
        snprintf(c->label, sizeof(c->label), "%s-%.0f%%", fam->label, 100 * fraction);
        for (size_t p = 0; p < fam->n_params; p++)
                c->params[p] = (struct kvc_param){ .key = fam->keys[p], .value = fam->values[p] };
        return c;
}

int lab_session_open(struct niah *n, const struct niah_config *cf, uint32_t prompt_tokens, const char *task,
                     struct kvc_session **ret) {
        const struct model_config *mc = n->mc;
        struct kvc_session_config sc = {
                .geometry = { .n_layers = (uint32_t)mc->n_layers,
                              .n_heads = (uint32_t)mc->n_heads,
                              .n_kv_heads = (uint32_t)mc->n_kv_heads,
                              .head_dim = (uint32_t)(mc->dim / mc->n_heads),
                              .dtype = KVC_DTYPE_F16,
                              .max_tokens = n->max_tokens && n->max_tokens < (uint32_t)mc->seq_len
                                                    ? n->max_tokens
                                                    : (uint32_t)mc->seq_len },
                .policy = cf->fam ? cf->fam->policy : "full",
                .budget_tokens = cf->budget,
                .budget_bytes = cf->budget_bytes,
                .tiers = cf->fam ? cf->fam->tiers : NULL,
                .params = cf->params,
                .n_params = cf->fam ? cf->fam->n_params : 0,
                .prompt_tokens = prompt_tokens,
        };
        int r = kvc_session_open(n->client, &sc, ret);
        if (r < 0)
                fprintf(stderr, "kvc-eval %s: %s: %s\n", task, cf->label, kvc_last_error(n->client));
        return r;
}

uint32_t lab_chunk(struct kvc_session *const *ss, uint32_t n_sessions, uint32_t n_layers, uint32_t k) {
        for (uint32_t c = 0; c < n_sessions; c++) {
                uint32_t most = 0; /* layers may differ: a plan may cut one and leave another */
                for (uint32_t l = 0; l < n_layers; l++)
                        most = kvc_layer_tokens(ss[c], l) > most ? kvc_layer_tokens(ss[c], l) : most;
                int room = (int)kvc_session_max_tokens(ss[c]) - (int)most;
                if (room >= 1 && (uint32_t)room < k)
                        k = (uint32_t)room;
        }
        return k ? k : 1;
}

/* What kvcd charges the session now (every tier's blocks and its plan buffer), and the tokens a
 * layer holds on average. */
static double charged_bytes(struct kvc_session *s, uint32_t n_layers, double *ret_tokens) {
        double t = 0;
        for (uint32_t l = 0; l < n_layers; l++)
                t += kvc_layer_tokens(s, l);
        *ret_tokens = t / n_layers;
        return (double)kvc_session_bytes(s);
}

void held_add(struct kvc_session *s, uint32_t n_layers, uint32_t k, double *charged, double *tokens) {
        double tok;
        *charged += k * charged_bytes(s, n_layers, &tok);
        *tokens += k * tok;
}

void held_close(struct kvc_session *s, double weight, double *charged, double *tokens,
                uint64_t *peak_charged) {
        struct kvc_session_stats st;
        if (kvc_session_close(s, &st) == 0)
                *peak_charged = st.peak_bytes;
        *charged /= weight > 0 ? weight : 1;
        *tokens /= weight > 0 ? weight : 1;
}

static int load_data(struct niah *n) {
        FILE *f = fopen(n->o->data_path, "rb");
        if (!f)
                return -errno;
        fseek(f, 0, SEEK_END);
        long len = ftell(f);
        fseek(f, 0, SEEK_SET);
        n->data = malloc((size_t)len + 1);
        int r = n->data && fread(n->data, 1, (size_t)len, f) == (size_t)len ? 0 : -EIO;
        fclose(f);
        if (r < 0)
                return r;
        n->data[len] = '\0';
        n->data_len = (size_t)len;
        n->stories = malloc(4096 * sizeof(char *));
        n->story_lens = malloc(4096 * sizeof(size_t));
        if (!n->stories || !n->story_lens)
                return -ENOMEM;
        n->n_stories = split_stories(n->data, n->data_len, n->stories, n->story_lens, 4096);
        return n->n_stories > NIAH_TEST_FIRST + 16 ? 0 : -ENODATA;
}

uint32_t lab_log_softmax(const float *lg, uint32_t V, float *out) {
        uint32_t best = 0;
        for (uint32_t v = 1; v < V; v++)
                best = lg[v] > lg[best] ? v : best;
        double sum = 0;
        for (uint32_t v = 0; v < V; v++)
                sum += exp((double)lg[v] - lg[best]);
        double lse = lg[best] + log(sum);
        for (uint32_t v = 0; v < V; v++)
                out[v] = (float)(lg[v] - lse);
        return best;
}

double lab_kl(const float *log_p, const float *log_q, uint32_t V) {
        double kl = 0;
        for (uint32_t v = 0; v < V; v++)
                kl += exp((double)log_p[v]) * ((double)log_p[v] - log_q[v]);
        return kl;
}

FILE *open_partial(const struct niah_options *o, const char *name) {
        char path[600];
        snprintf(path, sizeof(path), "%s/%s.partial", o->out_dir, name);
        return fopen(path, "w");
}

void finish_partial(const struct niah_options *o, const char *name, bool keep) {
        char from[600], to[600];
        snprintf(from, sizeof(from), "%s/%s.partial", o->out_dir, name);
        snprintf(to, sizeof(to), "%s/%s", o->out_dir, name);
        if (!keep)
                unlink(from);
        else if (rename(from, to) < 0)
                fprintf(stderr, "kvc-eval: cannot write %s: %s\n", to, strerror(errno));
}

int lab_open(struct niah *n, const char *task) {
        const struct niah_options *o = n->o;
        n->task = task;
        struct model_options mo = { .threads = o->threads };
        char why[256] = "", name[64];
        int r = model_open(o->model_path, &mo, &n->model, why, sizeof(why));
        if (r == 0 && !model_is_gguf(n->model))
                r = -EINVAL, snprintf(why, sizeof(why), "the %s task needs a GGUF chat model", task);
        if (r == 0)
                r = text_open_gguf(o->model_path, &n->tok, why, sizeof(why));
        if (r < 0) {
                fprintf(stderr, "kvc-eval %s: %s: %s\n", task, o->model_path, why[0] ? why : strerror(-r));
                n->model = model_free(n->model);
                return r;
        }
        n->mc = model_get_config(n->model);
        if ((r = load_data(n)) < 0) {
                fprintf(stderr, "kvc-eval %s: %s: no stories (%s)\n", task, o->data_path, strerror(-r));
                return r;
        }
        if (n->local)
                return 0;
        snprintf(name, sizeof(name), "kvc-eval-%s", task);
        struct kvc_options ko = { .socket = o->socket, .name = name, .timeout_ms = 120000 };
        if ((r = kvc_connect(&ko, &n->client)) < 0)
                fprintf(stderr, "kvc-eval %s: cannot connect to kvcd: %s\n", task, strerror(-r));
        return r;
}

void lab_close(struct niah *n) {
        if (n->client)
                kvc_disconnect(n->client);
        text_free(n->tok);
        model_free(n->model);
        free(n->data);
        free(n->stories);
        free(n->story_lens);
}
