/* llama.c - the Llama forward pass of llama.h.
 *
 * Invariants: a struct llama exists only for a GGUF whose every tensor the pass reads was found
 * with the expected shape and a type qtype.c computes with; after llama_new nothing is checked
 * again and nothing is allocated (llama_forward does no allocation and no I/O).
 *
 * Attention: with a cache that attends rows together (model_cache_ops.attend_rows), a layer stores
 * every row first, then each context's rows (a prompt chunk, or one decode row) attend in one
 * call, the contexts spread over the threads; otherwise row by row, store then attend.
 *
 * Products: every weight matrix W [rows][cols] (GGUF ne = {cols, rows}) multiplies one vector
 * (matmul.h: the exact path, or 8-bit activations quantized once per product, or once for the
 * products that read the same x: q, k and v; gate and up); its rows are split
 * into one contiguous range per thread, and a row's result depends on the row and the vector
 * alone, so the output does not depend on the thread count.
 *
 * Arithmetic follows the float32 reference (transformers): RMSNorm x / sqrt(mean(x^2) + eps) *
 * weight, RoPE with inv_freq = 1 / base^(2i / head_dim) in float, SwiGLU silu(gate) * up, tied
 * embeddings when output.weight is absent.
 */
#include "llama.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "matmul.h"
#include "qtype.h"
#include "threads.h"

#define LLAMA_MAX_LAYERS     512
#define LLAMA_MAX_DIM        (1 << 16)
#define LLAMA_MAX_ROWS       MODEL_MAX_ROWS
#define LLAMA_MAX_LOGIT_ROWS MODEL_MAX_LOGIT_ROWS

struct llama_layer {
        const struct gguf_tensor *wq, *wk, *wv, *wo, *gate, *up, *down;
        float *attn_norm, *ffn_norm; /* [dim] */
};

struct llama {
        struct model_config cfg;
        int head_dim, kv_dim;
        float eps;
        struct gguf *g;
        struct llama_layer *layers;
        const struct gguf_tensor *embd, *out;
        float *out_norm;
        struct threads *pool;
        bool exact;
        float *inv_freq;                 /* [head_dim / 2] */
        float *rope_cos, *rope_sin;      /* [row][head_dim / 2]: each row's angles, once a pass */
        float *x, *xb, *xb2, *q, *k, *v; /* activations, LLAMA_MAX_ROWS rows each */
        float *hb, *hb2, *logits;        /* logits: LLAMA_MAX_LOGIT_ROWS rows */
        float *floats;                   /* one allocation behind all of the above */
        struct matmul_q8 *xq;            /* the fast path's activations, every row */
        const float *xq_of;              /* the x xq holds (NULL: none), of xq_n vectors of xq_cols */
        uint32_t xq_cols, xq_n;
        struct llama_run {               /* a pass's rows of one context (find_runs) */
                uint32_t first, n;
                uint64_t cost;
                int result;
        } runs[LLAMA_MAX_ROWS];
        uint32_t n_runs;
};

struct product {
        struct matmul mm;
        uint64_t rows;
};

static void product_rows(void *ctx, uint32_t idx, uint32_t n) {
        struct product *p = ctx;
        /* cannot fail: llama_new checked every tensor's type and shape, and the buffers fit */
        (void)matmul_rows(&p->mm, (uint32_t)(p->rows * idx / n), (uint32_t)(p->rows * (idx + 1) / n));
}

/* y[b][rows] = W x[b][cols] for b < n_x; the fast path quantizes x once for every row of W
 * (matmul.h). same_x: x is the x of the product just before (q, k and v read one x, gate and up
 * another), whose 8-bit form m->xq still holds: it is not made again (the same bytes). */
static void matmul_x(struct llama *m, const struct gguf_tensor *w, const float *x, uint32_t n_x, float *y,
                     bool same_x) {
        const struct qtype *t = qtype_of(w->type);
        uint32_t cols = (uint32_t)w->ne[0];
        struct product p = { .mm = { .t = t,
                                     .w = w->data,
                                     .row_bytes = qtype_row_bytes(t, cols),
                                     .cols = cols,
                                     .x = x,
                                     .x_stride = cols,
                                     .n_x = n_x,
                                     .y = y,
                                     .y_stride = w->ne[1] },
                             .rows = w->ne[1] };
        if (same_x ? m->xq_of == x && m->xq_cols == cols && m->xq_n == n_x
                   : !m->exact && cols % MATMUL_BLOCK == 0 && matmul_quantize(x, cols, n_x, cols, m->xq) == 0)
                p.mm.xq = m->xq;
        m->xq_of = p.mm.xq ? x : NULL;
        m->xq_cols = cols, m->xq_n = n_x;
        threads_run(m->pool, product_rows, &p);
}

static void matmul(struct llama *m, const struct gguf_tensor *w, const float *x, uint32_t n_x, float *y) {
        matmul_x(m, w, x, n_x, y, false);
}

static void rmsnorm(float *o, const float *x, const float *weight, int n, float eps) {
        float ss = 0.0f;
        for (int j = 0; j < n; j++)
                ss += x[j] * x[j];
        ss = 1.0f / sqrtf(ss / n + eps);
        for (int j = 0; j < n; j++)
                o[j] = weight[j] * (ss * x[j]);
}

static int fail(char *why, size_t why_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static int fail(char *why, size_t why_len, const char *fmt, ...) {
        if (why && why_len) {
                va_list ap;
                va_start(ap, fmt);
                vsnprintf(why, why_len, fmt, ap);
                va_end(ap);
        }
        return -EINVAL;
}

/* The tensor `name` with shape {ne0, ne1} (ne1 0: a vector) and a type the products can use. */
static int find(const struct gguf *g, const char *name, uint64_t ne0, uint64_t ne1,
                const struct gguf_tensor **ret, char *why, size_t why_len) {
        const struct gguf_tensor *t = gguf_find_tensor(g, name);
        if (!t)
                return fail(why, why_len, "tensor %s is missing", name);
        const struct qtype *q = qtype_of(t->type);
        bool shape = t->ne[0] == ne0 && t->ne[1] == (ne1 ? ne1 : 1) && t->ne[2] == 1 && t->ne[3] == 1;
        if (!shape)
                return fail(why, why_len, "tensor %s has shape [%llu, %llu], expected [%llu, %llu]", name,
                            (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
                            (unsigned long long)ne0, (unsigned long long)(ne1 ? ne1 : 1));
        if (!q->dequantize || !q->dot)
                return fail(why, why_len, "tensor %s is of type %s, which this engine does not compute with",
                            name, q->name);
        *ret = t;
        return 0;
}

/* A vector tensor (a norm) copied out as floats. */
static int find_vector(const struct gguf *g, const char *name, uint64_t n, float **ret, char *why,
                       size_t why_len) {
        const struct gguf_tensor *t;
        int r = find(g, name, n, 0, &t, why, why_len);
        if (r < 0)
                return r;
        float *v = malloc(n * sizeof(float));
        if (!v)
                return -ENOMEM;
        qtype_of(t->type)->dequantize(t->data, v, n);
        *ret = v;
        return 0;
}

static int read_config(struct llama *m, char *why, size_t why_len) {
        const struct gguf *g = m->g;
        struct gguf_str arch;
        uint32_t n_layers, dim, hidden, n_heads, n_kv_heads, ctx, rope_dims;
        double base = 10000.0, eps = 1e-5;
        if (gguf_get_str(g, "general.architecture", &arch) < 0)
                return fail(why, why_len, "general.architecture is missing");
        if (!gguf_str_eq(arch, "llama"))
                return fail(why, why_len, "architecture %.*s is not supported (llama is)", (int)arch.len,
                            arch.s);
        if (gguf_get_u32(g, "llama.block_count", &n_layers) < 0 ||
            gguf_get_u32(g, "llama.embedding_length", &dim) < 0 ||
            gguf_get_u32(g, "llama.feed_forward_length", &hidden) < 0 ||
            gguf_get_u32(g, "llama.attention.head_count", &n_heads) < 0)
                return fail(why, why_len,
                            "llama.block_count, embedding_length, feed_forward_length or "
                            "attention.head_count is missing or not an integer");
        int r = gguf_get_u32(g, "llama.attention.head_count_kv", &n_kv_heads);
        if (r == -ENOENT)
                n_kv_heads = n_heads;
        else if (r < 0)
                return fail(why, why_len, "llama.attention.head_count_kv is not an integer of 32 bits");
        r = gguf_get_u32(g, "llama.context_length", &ctx);
        if (r == -ENOENT)
                ctx = 2048;
        else if (r < 0)
                return fail(why, why_len, "llama.context_length is not an integer of 32 bits");
        /* every count is bounded here, before any arithmetic or cast to int uses it */
        if (n_layers == 0 || n_layers > LLAMA_MAX_LAYERS || dim == 0 || dim > LLAMA_MAX_DIM || hidden == 0 ||
            hidden > 4 * LLAMA_MAX_DIM || n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads ||
            dim % n_heads || (dim / n_heads) % 2)
                return fail(why, why_len,
                            "the model's shape is out of range (%u layers, dim %u, %u heads, %u KV heads)",
                            n_layers, dim, n_heads, n_kv_heads);
        if (ctx == 0 || ctx > MODEL_MAX_SEQ_LEN)
                return fail(why, why_len, "llama.context_length %u is out of range (1 to %d)", ctx,
                            MODEL_MAX_SEQ_LEN);
        m->head_dim = (int)(dim / n_heads);
        r = gguf_get_u32(g, "llama.rope.dimension_count", &rope_dims);
        if (r < 0 && r != -ENOENT)
                return fail(why, why_len, "llama.rope.dimension_count is not an integer of 32 bits");
        if (r == 0 && rope_dims != (uint32_t)m->head_dim)
                return fail(why, why_len, "partial rotary embeddings (%u of %d dimensions) are not supported",
                            rope_dims, m->head_dim);
        r = gguf_get_f64(g, "llama.rope.freq_base", &base);
        if ((r < 0 && r != -ENOENT) || !(base > 1.0) || !isfinite(base))
                return fail(why, why_len, "llama.rope.freq_base is not a number above 1");
        r = gguf_get_f64(g, "llama.attention.layer_norm_rms_epsilon", &eps);
        if ((r < 0 && r != -ENOENT) || !(eps > 0 && eps < 1))
                return fail(why, why_len, "llama.attention.layer_norm_rms_epsilon is out of range");
        struct gguf_str scaling;
        if (gguf_get_str(g, "llama.rope.scaling.type", &scaling) == 0 && !gguf_str_eq(scaling, "none"))
                return fail(why, why_len, "RoPE scaling %.*s is not supported", (int)scaling.len, scaling.s);
        m->eps = (float)eps;
        m->kv_dim = (int)(n_kv_heads * (uint32_t)m->head_dim);
        m->cfg = (struct model_config){ .dim = (int)dim,
                                        .hidden_dim = (int)hidden,
                                        .n_layers = (int)n_layers,
                                        .n_heads = (int)n_heads,
                                        .n_kv_heads = (int)n_kv_heads,
                                        .seq_len = (int)ctx };
        m->inv_freq = malloc((size_t)m->head_dim / 2 * sizeof(float));
        if (!m->inv_freq)
                return -ENOMEM;
        for (int i = 0; i < m->head_dim / 2; i++)
                m->inv_freq[i] = 1.0f / powf((float)base, (float)(2 * i) / (float)m->head_dim);
        return 0;
}

static int read_tensors(struct llama *m, char *why, size_t why_len) {
        const struct gguf *g = m->g;
        const struct model_config *c = &m->cfg;
        uint64_t dim = (uint64_t)c->dim, kv = (uint64_t)m->kv_dim, hid = (uint64_t)c->hidden_dim;
        const struct gguf_tensor *e = gguf_find_tensor(g, "token_embd.weight");
        if (!e)
                return fail(why, why_len, "tensor token_embd.weight is missing");
        if (e->ne[1] == 0 || e->ne[1] > (1u << 22))
                return fail(why, why_len, "a vocabulary of %llu tokens", (unsigned long long)e->ne[1]);
        m->cfg.vocab_size = (int)e->ne[1];
        uint64_t vocab = e->ne[1];
        int r = find(g, "token_embd.weight", dim, vocab, &m->embd, why, why_len);
        if (r < 0)
                return r;
        m->out = m->embd; /* tied embeddings unless the file has its own head */
        if (gguf_find_tensor(g, "output.weight") &&
            (r = find(g, "output.weight", dim, vocab, &m->out, why, why_len)) < 0)
                return r;
        if ((r = find_vector(g, "output_norm.weight", dim, &m->out_norm, why, why_len)) < 0)
                return r;
        m->layers = calloc((size_t)c->n_layers, sizeof(*m->layers));
        if (!m->layers)
                return -ENOMEM;
        for (int l = 0; l < c->n_layers; l++) {
                struct llama_layer *L = &m->layers[l];
                char n[64];
#define TENSOR(field, suffix, ne0, ne1)                                                                      \
        do {                                                                                                 \
                snprintf(n, sizeof(n), "blk.%d." suffix ".weight", l);                                       \
                if ((r = find(g, n, ne0, ne1, &L->field, why, why_len)) < 0)                                 \
                        return r;                                                                            \
        } while (0)
                TENSOR(wq, "attn_q", dim, dim);
                TENSOR(wk, "attn_k", dim, kv);
                TENSOR(wv, "attn_v", dim, kv);
                TENSOR(wo, "attn_output", dim, dim);
                TENSOR(gate, "ffn_gate", dim, hid);
                TENSOR(up, "ffn_up", dim, hid);
                TENSOR(down, "ffn_down", hid, dim);
#undef TENSOR
                snprintf(n, sizeof(n), "blk.%d.attn_norm.weight", l);
                if ((r = find_vector(g, n, dim, &L->attn_norm, why, why_len)) < 0)
                        return r;
                snprintf(n, sizeof(n), "blk.%d.ffn_norm.weight", l);
                if ((r = find_vector(g, n, dim, &L->ffn_norm, why, why_len)) < 0)
                        return r;
        }
        return 0;
}

static int alloc_state(struct llama *m) {
        size_t dim = (size_t)m->cfg.dim, hid = (size_t)m->cfg.hidden_dim, kv = (size_t)m->kv_dim,
               half = (size_t)m->head_dim / 2, R = LLAMA_MAX_ROWS;
        size_t n = R * (4 * dim + 2 * kv + 2 * hid + 2 * half) +
                   LLAMA_MAX_LOGIT_ROWS * (size_t)m->cfg.vocab_size;
        float *p = m->floats = calloc(n, sizeof(float));
        if (!p)
                return -ENOMEM;
        m->x = p, p += R * dim;
        m->xb = p, p += R * dim;
        m->xb2 = p, p += R * dim;
        m->q = p, p += R * dim;
        m->k = p, p += R * kv;
        m->v = p, p += R * kv;
        m->hb = p, p += R * hid;
        m->hb2 = p, p += R * hid;
        m->rope_cos = p, p += R * half;
        m->rope_sin = p, p += R * half;
        m->logits = p;
        size_t longest = dim > hid ? dim : hid;
        m->xq = calloc(matmul_q8_count((uint32_t)((longest + MATMUL_BLOCK - 1) / MATMUL_BLOCK * MATMUL_BLOCK),
                                       LLAMA_MAX_ROWS),
                       sizeof(*m->xq));
        return m->xq ? 0 : -ENOMEM;
}

int llama_new(struct gguf **g, const struct llama_options *o, struct llama **ret, char *why, size_t why_len) {
        struct llama_options opt = o ? *o : (struct llama_options){ 0 };
        struct llama *m = calloc(1, sizeof(*m));
        if (!m) {
                *g = gguf_free(*g);
                return -ENOMEM;
        }
        m->g = *g;
        *g = NULL;
        m->exact = opt.exact;
        int r = read_config(m, why, why_len);
        if (r == 0)
                r = read_tensors(m, why, why_len);
        if (r == 0)
                r = alloc_state(m);
        if (r == 0)
                r = threads_new(opt.threads ? opt.threads : threads_default(), &m->pool);
        if (r < 0) {
                llama_free(m);
                return r;
        }
        *ret = m;
        return 0;
}

struct llama *llama_free(struct llama *m) {
        if (!m)
                return NULL;
        for (int l = 0; m->layers && l < m->cfg.n_layers; l++) {
                free(m->layers[l].attn_norm);
                free(m->layers[l].ffn_norm);
        }
        free(m->layers);
        free(m->out_norm);
        free(m->inv_freq);
        free(m->floats);
        free(m->xq);
        threads_free(m->pool);
        gguf_free(m->g);
        free(m);
        return NULL;
}

const struct model_config *llama_config(const struct llama *m) {
        return &m->cfg;
}

/* Rotates every head of vec (n_heads heads of head_dim) by the angles cos[i], sin[i]. */
static void rope(const struct llama *m, float *vec, int n_heads, const float *cos, const float *sin) {
        for (int h = 0; h < n_heads; h++) {
                float *v = vec + (size_t)h * (size_t)m->head_dim;
                for (int i = 0; i < m->head_dim / 2; i++) {
                        float c = cos[i], sn = sin[i], v0 = v[2 * i], v1 = v[2 * i + 1];
                        v[2 * i] = v0 * c - v1 * sn;
                        v[2 * i + 1] = v0 * sn + v1 * c;
                }
        }
}

/* The rows of a pass as runs, for cache->attend_rows: each context's rows consecutive, at
 * consecutive positions, in one run. The runs go in m->runs, longest work first (rows times the
 * last position: what attention over them costs), so that the threads finish together; 0 when
 * the rows are not so arranged (the pass then attends row by row). */
static uint32_t find_runs(struct llama *m, const struct model_row *rows, uint32_t n) {
        uint32_t k = 0;
        for (uint32_t i = 0; i < n; i++) {
                if (k && rows[i].ctx == rows[m->runs[k - 1].first].ctx) {
                        struct llama_run *u = &m->runs[k - 1];
                        if (rows[i].pos != rows[u->first + u->n - 1].pos + 1)
                                return 0;
                        u->n++;
                        continue;
                }
                for (uint32_t j = 0; j < k; j++)
                        if (rows[m->runs[j].first].ctx == rows[i].ctx)
                                return 0; /* a context in two runs */
                m->runs[k++] = (struct llama_run){ .first = i, .n = 1 };
        }
        for (uint32_t i = 0; i < k; i++)
                m->runs[i].cost = (uint64_t)m->runs[i].n *
                                  (uint64_t)(rows[m->runs[i].first + m->runs[i].n - 1].pos + 1);
        for (uint32_t i = 1; i < k; i++) /* insertion sort, by cost descending, stable */
                for (uint32_t j = i; j > 0 && m->runs[j].cost > m->runs[j - 1].cost; j--) {
                        struct llama_run t = m->runs[j];
                        m->runs[j] = m->runs[j - 1];
                        m->runs[j - 1] = t;
                }
        m->n_runs = k;
        return k;
}

struct attend_job {
        struct llama *m;
        const struct model_row *rows;
        const struct model_cache_ops *cache;
        int layer;
        atomic_uint next;
};

/* A thread's share of the runs: the next one not taken, until none is left. A run's result
 * depends on its rows alone, not on which thread computes it. */
static void attend_job_run(void *ctx, uint32_t idx, uint32_t n) {
        (void)idx, (void)n;
        struct attend_job *j = ctx;
        struct llama *m = j->m;
        size_t dim = (size_t)m->cfg.dim;
        for (uint32_t k; (k = atomic_fetch_add(&j->next, 1)) < m->n_runs;) {
                struct llama_run *u = &m->runs[k];
                const struct model_row *row = &j->rows[u->first];
                u->result = j->cache->attend_rows(row->ctx, j->layer, row->pos, u->n, m->q + u->first * dim,
                                                  m->xb + u->first * dim);
        }
}

/* Every run of layer l attended, the runs spread over the threads; the first failure in row
 * order. */
static int attend_runs(struct llama *m, const struct model_row *rows, const struct model_cache_ops *cache,
                       int l) {
        struct attend_job j = { .m = m, .rows = rows, .cache = cache, .layer = l };
        atomic_init(&j.next, 0);
        if (m->n_runs == 1)
                attend_job_run(&j, 0, 1);
        else
                threads_run(m->pool, attend_job_run, &j);
        int r = 0;
        uint32_t first = UINT32_MAX;
        for (uint32_t k = 0; k < m->n_runs; k++)
                if (m->runs[k].result < 0 && m->runs[k].first < first) {
                        first = m->runs[k].first;
                        r = m->runs[k].result;
                }
        return r;
}

int llama_forward_rows(struct llama *m, const struct model_row *rows, uint32_t n,
                       const struct model_cache_ops *cache, float **ret_logits) {
        if (!m || !rows || !cache || !cache->store || !cache->attend || !ret_logits || n == 0 ||
            n > LLAMA_MAX_ROWS)
                return -EINVAL;
        const struct model_config *c = &m->cfg;
        uint32_t n_logits = 0;
        for (uint32_t i = 0; i < n; i++) {
                if (rows[i].token < 0 || rows[i].token >= c->vocab_size || rows[i].pos < 0)
                        return -EINVAL;
                n_logits += rows[i].logits;
        }
        if (n_logits > LLAMA_MAX_LOGIT_ROWS)
                return -EINVAL;
        size_t dim = (size_t)c->dim, hid = (size_t)c->hidden_dim, kv = (size_t)m->kv_dim;
        uint32_t n_runs = cache->attend_rows ? find_runs(m, rows, n) : 0;
        const struct qtype *et = qtype_of(m->embd->type);
        size_t half = (size_t)m->head_dim / 2;
        for (uint32_t i = 0; i < n; i++) {
                et->dequantize(m->embd->data + (size_t)rows[i].token * qtype_row_bytes(et, dim),
                               m->x + i * dim, dim);
                for (size_t k = 0; k < half; k++) { /* the row's angles, for every layer */
                        float a = (float)rows[i].pos * m->inv_freq[k];
                        m->rope_cos[i * half + k] = cosf(a);
                        m->rope_sin[i * half + k] = sinf(a);
                }
        }
        for (int l = 0; l < c->n_layers; l++) {
                const struct llama_layer *L = &m->layers[l];
                for (uint32_t i = 0; i < n; i++)
                        rmsnorm(m->xb + i * dim, m->x + i * dim, L->attn_norm, (int)dim, m->eps);
                matmul(m, L->wq, m->xb, n, m->q);
                matmul_x(m, L->wk, m->xb, n, m->k, true);
                matmul_x(m, L->wv, m->xb, n, m->v, true);
                /* in row order: a row attends over what the rows before it stored (a prompt's chunk
                 * is causal), and rows of other sequences have caches of their own */
                for (uint32_t i = 0; i < n; i++) {
                        const float *cs = m->rope_cos + i * half, *sn = m->rope_sin + i * half;
                        rope(m, m->q + i * dim, c->n_heads, cs, sn);
                        rope(m, m->k + i * kv, c->n_kv_heads, cs, sn);
                        int r = cache->store(rows[i].ctx, l, rows[i].pos, m->k + i * kv, m->v + i * kv);
                        if (r == 0 && !n_runs)
                                r = cache->attend(rows[i].ctx, l, rows[i].pos, m->q + i * dim,
                                                  m->xb + i * dim);
                        if (r < 0)
                                return r;
                }
                int r = n_runs ? attend_runs(m, rows, cache, l) : 0;
                if (r < 0)
                        return r;
                matmul(m, L->wo, m->xb, n, m->xb2);
                for (size_t i = 0; i < n * dim; i++)
                        m->x[i] += m->xb2[i];
                for (uint32_t i = 0; i < n; i++)
                        rmsnorm(m->xb + i * dim, m->x + i * dim, L->ffn_norm, (int)dim, m->eps);
                matmul(m, L->gate, m->xb, n, m->hb);
                matmul_x(m, L->up, m->xb, n, m->hb2, true);
                for (size_t i = 0; i < n * hid; i++) {
                        float gv = m->hb[i];
                        m->hb[i] = gv / (1.0f + expf(-gv)) * m->hb2[i];
                }
                matmul(m, L->down, m->hb, n, m->xb);
                for (size_t i = 0; i < n * dim; i++)
                        m->x[i] += m->xb[i];
        }
        /* the head for the rows that want logits only: it is the largest product of all */
        uint32_t k = 0;
        for (uint32_t i = 0; i < n; i++)
                if (rows[i].logits)
                        rmsnorm(m->xb + k++ * dim, m->x + i * dim, m->out_norm, (int)dim, m->eps);
        if (k)
                matmul(m, m->out, m->xb, k, m->logits);
        *ret_logits = m->logits;
        return 0;
}

int llama_forward(struct llama *m, int token, int pos, const struct model_cache_ops *cache, void *ctx,
                  float **ret_logits) {
        struct model_row row = { .token = token, .pos = pos, .ctx = ctx, .logits = true };
        return llama_forward_rows(m, &row, 1, cache, ret_logits);
}
