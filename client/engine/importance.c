/* importance.c - importance.h: surprisal and KVzip's reconstruction scores for a prompt chunk.
 *
 * Owns: struct importance (the kind, the scores read before a chunk, the last logits seen, the
 * quote of the previous chunks) and the recon pass's cache (struct recon): its own rows' keys
 * and values, the session's layer gathered to floats, the largest probability of every cached
 * slot, and the thread pool its attention runs on.
 *
 * The recon attention is plain loops written for -O2's vectorizer (constant counts, restrict
 * pointers: it vectorizes nothing else): the keys of a layer are held transposed ([head][channel]
 * [slot]), so the logits of a task's queries (8 rows times the query heads of a KV head) grow a
 * tile of 64 slots at a time by q[c] * k[c][slot], each key read once for all of them; then each
 * query's two passes (max, then exp and sum), its probabilities kept to take their maximum, and
 * its output as axpys of the value rows. Tasks go to the threads, each thread keeping its own
 * maxima, merged after the layer; every output element is computed by one task in one order, so
 * the pass gives the same bits on any number of threads. Rejected: the kernels' online softmax
 * (kernels/attention.h) gives the output but not the probabilities, which need the row's final
 * maximum and sum: a second pass over the keys would cost as much as these loops; a dot product
 * per slot and query (the first version) ran scalar, 2.2 times slower on SmolLM2 at 1K.
 *
 * The layer's gathered keys are cached for one layer at a time for a GGUF model (its pass visits
 * the layers in order once per call of model_forward_rows), and for every layer for a llama2.c
 * checkpoint (which runs a row through all its layers before the next row; its models are
 * small).
 */
#include "importance.h"

#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "text.h"
#include "threads.h"

#define RECON_ROW_TILE 8u  /* rows of one task */
#define RECON_KEY_TILE 64u /* slots whose logits are computed together */
#define INSTR_MAX      64u

struct recon {
        uint32_t n_layers, n_heads, n_kv, D, kv_dim, group;
        uint32_t cap_rows;        /* rows a pass may have */
        float *own_k, *own_v;     /* [n_layers][cap_rows][kv_dim] */
        uint32_t *own_n;          /* [n_layers] rows stored this pass */
        int pos0;                 /* the pass's first position */
        uint32_t *nc;             /* [n_layers] cached slots when the pass began */
        uint32_t nc_cap;          /* slots the buffers below hold */
        uint32_t kt_cap;          /* nc_cap + cap_rows: keys of a head, cached and the pass's own */
        uint32_t n_cached_layers; /* layers gathered at once: 1 or n_layers */
        int *tag;                 /* [n_cached_layers] the layer each gathered slot holds, -1 none */
        float *kt;                /* [n_cached_layers][n_kv][D][kt_cap] keys, transposed */
        float *cv;                /* [n_cached_layers][n_kv][nc_cap][D] values */
        float *best;              /* [n_layers][n_kv][nc_cap] the largest probability of each slot */
        float *tbest;             /* [threads][n_kv][nc_cap] a thread's maxima of one call */
        float *tscratch;          /* [threads][RECON_ROW_TILE * group][kt_cap] a thread's logits */
        float *gathered;          /* [n_kv][nc_cap][D] keys as the store gives them */
        struct threads *pool;
        uint32_t n_threads;
        void *store_ctx;
        const struct importance_store_ops *store;
};

struct importance {
        enum importance_kind kind;
        struct model *m;
        struct model_config cfg;
        bool gguf;
        float *logits;   /* [vocab] the last row's logits of the last chunk */
        int logits_pos;  /* its position; -1: none */
        float *snap;     /* [n_layers][n_kv][snap_cap] the scores read before the chunk */
        uint32_t *n_old; /* [n_layers] slots before the chunk */
        uint32_t snap_cap;
        float *out; /* [n_kv][snap_cap] a layer's scores to write */
        int instr_first[INSTR_MAX], instr_later[INSTR_MAX], suffix[INSTR_MAX];
        size_t n_first, n_later, n_suffix;
        int quote[IMPORTANCE_QUOTE];
        uint32_t n_quote;
        double seconds; /* spent beyond the chunks' own passes */
        struct recon r;
};

static const char *const kind_names[] = {
        [IMPORTANCE_KIND_ATTENTION] = "attention",
        [IMPORTANCE_KIND_SURPRISAL] = "surprisal",
        [IMPORTANCE_KIND_RECON] = "recon",
};

int importance_parse(const char *name, enum importance_kind *ret) {
        for (size_t k = 0; name && k < sizeof(kind_names) / sizeof(kind_names[0]); k++)
                if (strcmp(name, kind_names[k]) == 0) {
                        *ret = (enum importance_kind)k;
                        return 0;
                }
        return -EINVAL;
}

const char *importance_name(enum importance_kind kind) {
        return (unsigned)kind < sizeof(kind_names) / sizeof(kind_names[0]) ? kind_names[kind] : "?";
}

/* text encoded without the BOS its encoder puts first (as many tokens as "" encodes to). */
static int encode_bare(const struct text *tok, const char *s, int *ids, size_t *ret_n) {
        int bos[4];
        size_t n_bos, n;
        int e = text_encode(tok, "", bos, 4, &n_bos);
        if (e == 0)
                e = text_encode(tok, s, ids, INSTR_MAX, &n);
        if (e < 0)
                return e;
        if (n < n_bos)
                return -EINVAL;
        memmove(ids, ids + n_bos, (n - n_bos) * sizeof(int));
        *ret_n = n - n_bos;
        return 0;
}

static int recon_init(struct importance *imp, unsigned threads) {
        struct recon *r = &imp->r;
        const struct model_config *c = &imp->cfg;
        r->n_layers = (uint32_t)c->n_layers;
        r->n_heads = (uint32_t)c->n_heads;
        r->n_kv = (uint32_t)c->n_kv_heads;
        r->D = (uint32_t)(c->dim / c->n_heads);
        r->kv_dim = r->n_kv * r->D;
        r->group = r->n_heads / r->n_kv;
        size_t instr = imp->n_first > imp->n_later + IMPORTANCE_QUOTE ? imp->n_first
                                                                      : imp->n_later + IMPORTANCE_QUOTE;
        r->cap_rows = (uint32_t)(instr + imp->n_suffix) + MODEL_MAX_ROWS;
        r->n_cached_layers = imp->gguf ? 1 : r->n_layers;
        size_t own = (size_t)r->n_layers * r->cap_rows * r->kv_dim;
        r->own_k = malloc(own * sizeof(float));
        r->own_v = malloc(own * sizeof(float));
        r->own_n = calloc(r->n_layers, sizeof(uint32_t));
        r->nc = calloc(r->n_layers, sizeof(uint32_t));
        r->tag = malloc(r->n_cached_layers * sizeof(int));
        if (!r->own_k || !r->own_v || !r->own_n || !r->nc || !r->tag)
                return -ENOMEM;
        r->n_threads = imp->gguf ? (threads ? threads : threads_default()) : 1;
        if (r->n_threads > THREADS_MAX)
                r->n_threads = THREADS_MAX;
        return threads_new(r->n_threads, &r->pool);
}

int importance_new(struct model *m, const struct text *tok, enum importance_kind kind, unsigned threads,
                   struct importance **ret) {
        if (!m || !ret || (unsigned)kind > IMPORTANCE_KIND_RECON || (kind == IMPORTANCE_KIND_RECON && !tok))
                return -EINVAL;
        struct importance *imp = calloc(1, sizeof(*imp));
        if (!imp)
                return -ENOMEM;
        imp->kind = kind;
        imp->m = m;
        imp->cfg = *model_get_config(m);
        imp->gguf = model_is_gguf(m);
        imp->logits_pos = -1;
        imp->logits = malloc((size_t)imp->cfg.vocab_size * sizeof(float));
        imp->n_old = calloc((size_t)imp->cfg.n_layers, sizeof(uint32_t));
        int e = imp->logits && imp->n_old ? 0 : -ENOMEM;
        if (e == 0 && kind == IMPORTANCE_KIND_RECON) {
                e = encode_bare(tok, "\n\nRepeat the previous context exactly.", imp->instr_first,
                                &imp->n_first);
                if (e == 0)
                        e = encode_bare(tok,
                                        "\n\nRepeat the part of the previous context exactly, starting with",
                                        imp->instr_later, &imp->n_later);
                if (e == 0)
                        e = encode_bare(tok, "\n", imp->suffix, &imp->n_suffix);
                if (e == 0)
                        e = recon_init(imp, threads);
        }
        if (e < 0) {
                importance_free(imp);
                return e;
        }
        *ret = imp;
        return 0;
}

struct importance *importance_free(struct importance *imp) {
        if (!imp)
                return NULL;
        struct recon *r = &imp->r;
        threads_free(r->pool);
        free(r->own_k);
        free(r->own_v);
        free(r->own_n);
        free(r->nc);
        free(r->tag);
        free(r->kt);
        free(r->cv);
        free(r->gathered);
        free(r->best);
        free(r->tbest);
        free(r->tscratch);
        free(imp->logits);
        free(imp->snap);
        free(imp->n_old);
        free(imp->out);
        free(imp);
        return NULL;
}

enum importance_kind importance_kind(const struct importance *imp) {
        return imp->kind;
}

double importance_seconds(const struct importance *imp) {
        return imp->seconds;
}

static double now(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

uint32_t importance_max_rows(const struct importance *imp) {
        if (imp->kind != IMPORTANCE_KIND_SURPRISAL)
                return MODEL_MAX_ROWS;
        return imp->gguf ? MODEL_MAX_LOGIT_ROWS : 1;
}

double importance_surprisal(const float *logits, uint32_t vocab, int token) {
        double m = -INFINITY, sum = 0.0;
        for (uint32_t i = 0; i < vocab; i++)
                m = logits[i] > m ? logits[i] : m;
        for (uint32_t i = 0; i < vocab; i++)
                sum += exp((double)logits[i] - m);
        return log(sum) - ((double)logits[token] - m);
}

int importance_recon_tokens(const struct importance *imp, const int *chunk, uint32_t n, int *out, size_t cap,
                            size_t *ret_n) {
        const int *instr = imp->n_quote ? imp->instr_later : imp->instr_first;
        size_t ni = imp->n_quote ? imp->n_later : imp->n_first;
        size_t total = ni + imp->n_quote + imp->n_suffix + n;
        if (total > cap)
                return -ENOBUFS;
        int *p = out;
        memcpy(p, instr, ni * sizeof(int));
        p += ni;
        memcpy(p, imp->quote, imp->n_quote * sizeof(int));
        p += imp->n_quote;
        memcpy(p, imp->suffix, imp->n_suffix * sizeof(int));
        p += imp->n_suffix;
        memcpy(p, chunk, n * sizeof(int));
        *ret_n = total;
        return 0;
}

/* ---- growing buffers ---- */

/* Makes *p hold at least n floats (its contents are not kept). */
static int ensure(float **p, size_t n) {
        float *q = realloc(*p, n * sizeof(float));
        if (!q)
                return -ENOMEM;
        *p = q;
        return 0;
}

/* Room for layers of up to n slots, in the snapshot and the recon buffers. */
static int reserve_slots(struct importance *imp, uint32_t n) {
        if (n <= imp->snap_cap && (imp->kind != IMPORTANCE_KIND_RECON || n <= imp->r.nc_cap))
                return 0;
        uint32_t cap = n + n / 2 + 64;
        size_t L = (size_t)imp->cfg.n_layers, H = (size_t)imp->cfg.n_kv_heads;
        int e = 0;
        if (imp->kind == IMPORTANCE_KIND_RECON) {
                struct recon *r = &imp->r;
                uint32_t kt_cap = (cap + r->cap_rows + RECON_KEY_TILE - 1) / RECON_KEY_TILE * RECON_KEY_TILE;
                size_t per_layer = H * kt_cap * r->D;
                e = ensure(&r->kt, (size_t)r->n_cached_layers * per_layer);
                if (e == 0)
                        e = ensure(&r->cv, (size_t)r->n_cached_layers * H * cap * r->D);
                if (e == 0)
                        e = ensure(&r->gathered, H * cap * r->D);
                if (e == 0)
                        e = ensure(&r->best, L * H * cap);
                if (e == 0)
                        e = ensure(&r->tbest, (size_t)r->n_threads * H * cap);
                if (e == 0)
                        e = ensure(&r->tscratch, (size_t)r->n_threads * RECON_ROW_TILE * r->group * kt_cap);
                if (e < 0)
                        return e;
                r->nc_cap = cap;
                r->kt_cap = kt_cap;
        }
        /* the snapshot keeps its contents: it is only grown before it is filled */
        e = ensure(&imp->snap, L * H * cap);
        if (e == 0)
                e = ensure(&imp->out, H * cap);
        if (e == 0)
                imp->snap_cap = cap;
        return e;
}

/* ---- the recon pass's cache: model_cache_ops over its own rows and the gathered session ---- */

/* y += a x over a constant count, restrict: loops -O2's vectorizer takes (it refuses a count it
 * does not know, and pointers that may overlap). */
static inline void axpy8(float *restrict y, float a, const float *restrict x) {
        for (uint32_t k = 0; k < 8; k++)
                y[k] += a * x[k];
}

static inline void axpy_tile(float *restrict y, float a, const float *restrict x) {
        for (uint32_t k = 0; k < RECON_KEY_TILE; k++)
                y[k] += a * x[k];
}

static inline void axpy(float *y, float a, const float *x, uint32_t n) {
        uint32_t i = 0;
        for (; i + 8 <= n; i += 8)
                axpy8(y + i, a, x + i);
        for (; i < n; i++)
                y[i] += a * x[i];
}

static int recon_store(void *ctx, int layer, int pos, const float *k, const float *v) {
        struct recon *r = ctx;
        if (layer < 0 || (uint32_t)layer >= r->n_layers || pos < r->pos0)
                return -EINVAL;
        uint32_t i = (uint32_t)(pos - r->pos0);
        if (i != r->own_n[layer] || i >= r->cap_rows)
                return -EINVAL;
        size_t at = ((size_t)layer * r->cap_rows + i) * r->kv_dim;
        memcpy(r->own_k + at, k, r->kv_dim * sizeof(float));
        memcpy(r->own_v + at, v, r->kv_dim * sizeof(float));
        r->own_n[layer] = i + 1;
        return 0;
}

/* A layer's keys transposed ([n_kv][D][kt_cap]: the cached slots, then the pass's rows stored so
 * far) and its cached values ([n_kv][nc_cap][D]); the cached part read when not held. */
static int layer_keys(struct recon *r, uint32_t layer, const float **ret_kt, const float **ret_cv) {
        uint32_t at = layer % r->n_cached_layers, nc = r->nc[layer], D = r->D;
        float *kt = r->kt + (size_t)at * r->n_kv * D * r->kt_cap,
              *cv = r->cv + (size_t)at * r->n_kv * r->nc_cap * D;
        if (r->tag[at] != (int)layer) {
                /* the store's layout, [n_kv][nc][D] each: the values in place, spread to nc_cap rows
                 * a head (the last head first: nothing is overwritten), the keys transposed */
                int e = nc ? r->store->gather(r->store_ctx, layer, nc, r->gathered, cv) : 0;
                if (e < 0)
                        return e;
                for (uint32_t h = r->n_kv; h-- > 1;)
                        memmove(cv + (size_t)h * r->nc_cap * D, cv + (size_t)h * nc * D,
                                (size_t)nc * D * sizeof(float));
                for (uint32_t h = 0; h < r->n_kv; h++)
                        for (uint32_t t = 0; t < nc; t++)
                                for (uint32_t c = 0; c < D; c++)
                                        kt[((size_t)h * D + c) * r->kt_cap + t] =
                                                r->gathered[((size_t)h * nc + t) * D + c];
                r->tag[at] = (int)layer;
        }
        const float *own = r->own_k + (size_t)layer * r->cap_rows * r->kv_dim;
        for (uint32_t h = 0; h < r->n_kv; h++) /* the pass's rows, after the cached slots */
                for (uint32_t t = 0; t < r->own_n[layer]; t++)
                        for (uint32_t c = 0; c < D; c++)
                                kt[((size_t)h * D + c) * r->kt_cap + nc + t] =
                                        own[(size_t)t * r->kv_dim + h * D + c];
        *ret_kt = kt;
        *ret_cv = cv;
        return 0;
}

struct recon_job {
        struct recon *r;
        uint32_t layer, first, n; /* rows [first, first + n) of the pass */
        const float *q, *kt, *cv;
        float *out;
        uint32_t n_tiles;
        atomic_uint next;
};

/* Rows [r0, r1) of the pass attend for KV head g: every query head of its group, over the cached
 * slots and the pass's rows up to their own, exactly; the probabilities of the cached slots go
 * into best (this thread's maxima). The logits of all the tile's queries are computed together,
 * a tile of keys at a time (s[query][slot] += q[c] * k[c][slot]: each key read once for them
 * all, loops the compiler vectorizes); then each query's softmax and output, on its own. */
static void recon_rows(struct recon_job *j, uint32_t g, uint32_t r0, uint32_t r1, float *s, float *best) {
        struct recon *r = j->r;
        uint32_t nc = r->nc[j->layer], D = r->D, G = r->group, nq = (r1 - r0) * G, n_max = nc + r1;
        const float *kt = j->kt + (size_t)g * D * r->kt_cap, *cv = j->cv + (size_t)g * r->nc_cap * D;
        const float *ov = r->own_v + (size_t)j->layer * r->cap_rows * r->kv_dim + (size_t)g * D;
        float scale = 1.0f / sqrtf((float)D);
        for (uint32_t t0 = 0; t0 < n_max; t0 += RECON_KEY_TILE) { /* whole tiles: kt_cap is a multiple */
                for (uint32_t x = 0; x < nq; x++)
                        memset(s + (size_t)x * r->kt_cap + t0, 0, RECON_KEY_TILE * sizeof(float));
                for (uint32_t c = 0; c < D; c++) {
                        const float *kc = kt + (size_t)c * r->kt_cap + t0;
                        for (uint32_t x = 0; x < nq; x++) {
                                uint32_t row = r0 + x / G - j->first, qh = g * G + x % G;
                                axpy_tile(s + (size_t)x * r->kt_cap + t0,
                                          j->q[((size_t)row * r->n_heads + qh) * D + c], kc);
                        }
                }
        }
        for (uint32_t x = 0; x < nq; x++) {
                uint32_t i = r0 + x / G, row = i - j->first, qh = g * G + x % G, n = nc + i + 1;
                float *sx = s + (size_t)x * r->kt_cap, *o = j->out + ((size_t)row * r->n_heads + qh) * D;
                float m = -INFINITY, l = 0.0f;
                for (uint32_t t = 0; t < n; t++) {
                        sx[t] *= scale;
                        m = sx[t] > m ? sx[t] : m;
                }
                for (uint32_t t = 0; t < n; t++) {
                        sx[t] = expf(sx[t] - m);
                        l += sx[t];
                }
                float inv = 1.0f / l;
                memset(o, 0, D * sizeof(float));
                for (uint32_t t = 0; t < nc; t++) {
                        float p = sx[t] * inv;
                        best[t] = p > best[t] ? p : best[t];
                        axpy(o, p, cv + (size_t)t * D, D);
                }
                for (uint32_t t = 0; t <= i; t++)
                        axpy(o, sx[nc + t] * inv, ov + (size_t)t * r->kv_dim, D);
        }
}

static void recon_job_run(void *ctx, uint32_t idx, uint32_t n_threads) {
        (void)n_threads;
        struct recon_job *j = ctx;
        struct recon *r = j->r;
        float *s = r->tscratch + (size_t)idx * RECON_ROW_TILE * r->group * r->kt_cap;
        float *best = r->tbest + (size_t)idx * r->n_kv * r->nc_cap;
        for (uint32_t k; (k = atomic_fetch_add(&j->next, 1)) < r->n_kv * j->n_tiles;) {
                uint32_t g = k / j->n_tiles, r0 = j->first + (k % j->n_tiles) * RECON_ROW_TILE;
                uint32_t r1 = r0 + RECON_ROW_TILE < j->first + j->n ? r0 + RECON_ROW_TILE : j->first + j->n;
                recon_rows(j, g, r0, r1, s, best + (size_t)g * r->nc_cap);
        }
}

static int recon_attend_rows(void *ctx, int layer, int pos, uint32_t n, const float *q, float *out) {
        struct recon *r = ctx;
        if (layer < 0 || (uint32_t)layer >= r->n_layers || pos < r->pos0 || n == 0 ||
            (uint32_t)(pos - r->pos0) + n > r->own_n[layer])
                return -EINVAL;
        struct recon_job j = { .r = r,
                               .layer = (uint32_t)layer,
                               .first = (uint32_t)(pos - r->pos0),
                               .n = n,
                               .q = q,
                               .out = out,
                               .n_tiles = (n + RECON_ROW_TILE - 1) / RECON_ROW_TILE };
        int e = layer_keys(r, (uint32_t)layer, &j.kt, &j.cv);
        if (e < 0)
                return e;
        uint32_t nc = r->nc[layer];
        memset(r->tbest, 0, (size_t)r->n_threads * r->n_kv * r->nc_cap * sizeof(float));
        atomic_init(&j.next, 0);
        if (r->n_threads == 1 || r->n_kv * j.n_tiles == 1)
                recon_job_run(&j, 0, 1);
        else
                threads_run(r->pool, recon_job_run, &j);
        float *best = r->best + (size_t)layer * r->n_kv * r->nc_cap;
        for (uint32_t t = 0; t < r->n_threads; t++)
                for (uint32_t g = 0; g < r->n_kv; g++) {
                        const float *tb = r->tbest + ((size_t)t * r->n_kv + g) * r->nc_cap;
                        float *b = best + (size_t)g * r->nc_cap;
                        for (uint32_t x = 0; x < nc; x++)
                                b[x] = tb[x] > b[x] ? tb[x] : b[x];
                }
        return 0;
}

static int recon_attend(void *ctx, int layer, int pos, const float *q, float *out) {
        return recon_attend_rows(ctx, layer, pos, 1, q, out);
}

static const struct model_cache_ops recon_ops = {
        .store = recon_store,
        .attend = recon_attend,
        .attend_rows = recon_attend_rows,
};

/* The recon pass of the chunk rows[0..n) just prefilled: r->best gets every cached slot's largest
 * probability. */
static int recon_pass(struct importance *imp, const struct model_row *rows, uint32_t n,
                      const struct importance_store_ops *store) {
        struct recon *r = &imp->r;
        int tokens[INSTR_MAX * 2 + IMPORTANCE_QUOTE + MODEL_MAX_ROWS], chunk[MODEL_MAX_ROWS];
        size_t total;
        for (uint32_t i = 0; i < n; i++)
                chunk[i] = rows[i].token;
        int e = importance_recon_tokens(imp, chunk, n, tokens, sizeof(tokens) / sizeof(tokens[0]), &total);
        if (e < 0)
                return e;
        r->store = store;
        r->store_ctx = rows[0].ctx;
        r->pos0 = rows[n - 1].pos + 1;
        memset(r->own_n, 0, r->n_layers * sizeof(uint32_t));
        for (uint32_t l = 0; l < r->n_layers; l++) {
                r->nc[l] = imp->n_old[l] + n;
                memset(r->best + (size_t)l * r->n_kv * r->nc_cap, 0,
                       (size_t)r->n_kv * r->nc_cap * sizeof(float));
        }
        for (uint32_t c = 0; c < r->n_cached_layers; c++)
                r->tag[c] = -1;
        struct model_row pass[MODEL_MAX_ROWS];
        float *logits;
        for (size_t done = 0; done < total && e == 0;) {
                uint32_t k = total - done < MODEL_MAX_ROWS ? (uint32_t)(total - done) : MODEL_MAX_ROWS;
                for (uint32_t i = 0; i < k; i++)
                        pass[i] = (struct model_row){ .token = tokens[done + i],
                                                      .pos = r->pos0 + (int)(done + i),
                                                      .ctx = r };
                e = model_forward_rows(imp->m, pass, k, &recon_ops, &logits);
                done += k;
                for (uint32_t c = 0; c < r->n_cached_layers; c++) /* a later call gathers again */
                        r->tag[c] = -1;
        }
        return e;
}

/* ---- importance_prefill ---- */

int importance_prefill(struct importance *imp, struct model_row *rows, uint32_t n,
                       const struct model_cache_ops *cache, const struct importance_store_ops *store,
                       float **ret_logits) {
        if (!imp || !rows || !cache || !ret_logits || n == 0 || n > importance_max_rows(imp) ||
            (imp->kind != IMPORTANCE_KIND_ATTENTION && !store))
                return -EINVAL;
        for (uint32_t i = 1; i < n; i++)
                if (rows[i].ctx != rows[0].ctx || rows[i].pos != rows[0].pos + (int)i)
                        return -EINVAL;
        bool scoring = imp->kind != IMPORTANCE_KIND_ATTENTION;
        uint32_t L = (uint32_t)imp->cfg.n_layers, H = (uint32_t)imp->cfg.n_kv_heads,
                 V = (uint32_t)imp->cfg.vocab_size;
        void *ctx = rows[0].ctx;
        double t0 = now();
        int e = 0;
        uint32_t most = 0;
        for (uint32_t l = 0; scoring && l < L; l++) {
                imp->n_old[l] = store->tokens(ctx, l);
                most = imp->n_old[l] > most ? imp->n_old[l] : most;
        }
        if (scoring)
                e = reserve_slots(imp, most + n);
        for (uint32_t l = 0; scoring && l < L && e == 0; l++) /* before the chunk: what it must not change */
                e = store->get_scores(ctx, l, imp->n_old[l], imp->snap + (size_t)l * H * imp->snap_cap);
        for (uint32_t i = 0; i < n; i++)
                rows[i].logits = imp->kind == IMPORTANCE_KIND_SURPRISAL || i == n - 1;
        float *logits;
        double t1 = now();
        if (e == 0)
                e = model_forward_rows(imp->m, rows, n, cache, &logits);
        if (e < 0)
                return e;
        double t2 = now();
        for (uint32_t l = 0; scoring && l < L; l++)
                if (store->tokens(ctx, l) != imp->n_old[l] + n)
                        return -ESTALE;
        float mine[MODEL_MAX_ROWS]; /* surprisal: from the logits before each token */
        if (imp->kind == IMPORTANCE_KIND_SURPRISAL)
                for (uint32_t i = 0; i < n; i++) {
                        const float *before = i ? logits + (size_t)(i - 1) * V
                                              : rows[0].pos > 0 && imp->logits_pos == rows[0].pos - 1
                                                      ? imp->logits
                                                      : NULL;
                        mine[i] = before ? (float)importance_surprisal(before, V, rows[i].token)
                                         : IMPORTANCE_FIRST_SURPRISAL;
                }
        memcpy(imp->logits, logits + (size_t)(imp->kind == IMPORTANCE_KIND_SURPRISAL ? n - 1 : 0) * V,
               (size_t)V * sizeof(float));
        imp->logits_pos = rows[n - 1].pos;
        *ret_logits = imp->logits;
        if (imp->kind == IMPORTANCE_KIND_RECON && (e = recon_pass(imp, rows, n, store)) < 0)
                return e;
        for (uint32_t l = 0; scoring && l < L && e == 0; l++) {
                uint32_t old = imp->n_old[l], all = old + n;
                const float *snap = imp->snap + (size_t)l * H * imp->snap_cap;
                for (uint32_t h = 0; h < H; h++) {
                        float *o = imp->out + (size_t)h * all;
                        if (imp->kind == IMPORTANCE_KIND_SURPRISAL) {
                                memcpy(o + old, mine, n * sizeof(float));
                                memcpy(o, snap + (size_t)h * old, old * sizeof(float));
                                continue;
                        }
                        const float *b = imp->r.best + ((size_t)l * H + h) * imp->r.nc_cap;
                        for (uint32_t s = 0; s < all; s++)
                                o[s] = s < old && snap[(size_t)h * old + s] > b[s] ? snap[(size_t)h * old + s]
                                                                                   : b[s];
                }
                e = store->set_scores(ctx, l, all, imp->out);
        }
        if (e == 0) { /* the quote of the chunks seen, for the next recon pass */
                for (uint32_t i = 0; i < n; i++) {
                        if (imp->n_quote == IMPORTANCE_QUOTE)
                                memmove(imp->quote, imp->quote + 1, (IMPORTANCE_QUOTE - 1) * sizeof(int));
                        else
                                imp->n_quote++;
                        imp->quote[imp->n_quote - 1] = rows[i].token;
                }
        }
        imp->seconds += (t1 - t0) + (now() - t2);
        return e;
}
