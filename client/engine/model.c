/* model.c - model.h: the format dispatch (a GGUF goes to llama.c), the llama2.c checkpoint loader
 * and forward pass, and the plain reference KV cache.
 *
 * Owns: struct model (the header, one float array with every weight, one array with every
 * activation buffer and the per-position RoPE table) and struct plain_cache.
 *
 * Invariants:
 * - A struct model exists only for a checkpoint whose header passed model_layout_check and whose
 *   length matched it to the byte; after that no size is recomputed from untrusted data.
 * - model_forward does no allocation and no I/O; its arithmetic is llama2.c run.c's, operation
 *   for operation (same loop order, float accumulators, rmsnorm eps 1e-5f, powf/cosf/sinf RoPE on
 *   adjacent pairs, SwiGLU with expf), so greedy decoding reproduces llama2.c's text. The only
 *   reordering is hoisting the RoPE cos/sin out of the layer loop, which computes the same floats.
 *
 * Rejected alternatives: mmap of the checkpoint (the buffer loader must copy anyway, a fuzzer
 * feeds it, and the reference model is 1 MB); keeping the KV cache inside the model (eviction
 * policies and the daemon-backed cache must be able to replace it, hence model_cache_ops).
 */
#include "model.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "attention.h"
#include "gguf.h"
#include "llama.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "model.c reads little-endian checkpoints in place and needs a little-endian host"
#endif

/* Upper bounds on header fields: far above any model this project runs, low enough that every size
 * below fits in uint64_t without overflow checks at each step. */
#define MODEL_MAX_DIM          (1 << 14)
#define MODEL_MAX_HIDDEN_DIM   (1 << 16)
#define MODEL_MAX_LAYERS       512
#define MODEL_MAX_HEADS        1024
#define MODEL_MAX_VOCAB        (1 << 20)
#define MODEL_HEADER_BYTES     28u
#define PLAIN_CACHE_MAX_TOKENS (1 << 24)

/* Where the tensors sit in a checkpoint file, in floats after the header. */
struct model_layout {
        struct model_config cfg; /* vocab_size positive */
        int shared_classifier;
        uint64_t n_base_floats; /* token embedding .. final rmsnorm */
        uint64_t cls_offset;    /* first float of the classifier when not shared */
        uint64_t n_cls_floats;  /* 0 when shared */
};

struct model_weights {
        float *token_embedding; /* [vocab][dim] */
        float *rms_att;         /* [layers][dim] */
        float *wq;              /* [layers][dim][dim] */
        float *wk;              /* [layers][kv_dim][dim] */
        float *wv;              /* [layers][kv_dim][dim] */
        float *wo;              /* [layers][dim][dim] */
        float *rms_ffn;         /* [layers][dim] */
        float *w1;              /* [layers][hidden][dim] */
        float *w2;              /* [layers][dim][hidden] */
        float *w3;              /* [layers][hidden][dim] */
        float *rms_final;       /* [dim] */
        float *wcls;            /* [vocab][dim], the embedding when shared */
};

struct model_state {
        float *x, *xb, *xb2;        /* [dim] */
        float *hb, *hb2;            /* [hidden] */
        float *q;                   /* [dim] */
        float *k, *v;               /* [kv_dim] */
        float *rope_freq;           /* [dim / 2], 1 / 10000^(hd / head_size) */
        float *rope_cos, *rope_sin; /* [dim / 2] for the current pos */
        float *logits;              /* [vocab] */
};

struct model {
        struct llama *gguf; /* a GGUF model (llama.c); NULL: a llama2.c checkpoint, below */
        struct model_config cfg;
        int head_size, kv_dim, kv_mul;
        float *weight_data;
        float *state_data;
        struct model_weights w;
        struct model_state s;
};

static int model_header_field(const unsigned char *hdr, int idx) {
        int32_t v;

        memcpy(&v, hdr + 4 * idx, sizeof(v));
        return v;
}

/* Validates the 28-byte header against the total file length and fills *ret. -EINVAL on any
 * out-of-range field or a length that is not one of the accepted layouts. */
static int model_layout_check(const unsigned char *hdr, uint64_t file_len, struct model_layout *ret) {
        struct model_layout l = { 0 };
        struct model_config *c = &l.cfg;
        int vocab;
        uint64_t dim, hidden, layers, kv_dim, vocab_u, rope, body, with_rope;

        c->dim = model_header_field(hdr, 0);
        c->hidden_dim = model_header_field(hdr, 1);
        c->n_layers = model_header_field(hdr, 2);
        c->n_heads = model_header_field(hdr, 3);
        c->n_kv_heads = model_header_field(hdr, 4);
        vocab = model_header_field(hdr, 5);
        c->seq_len = model_header_field(hdr, 6);

        if (c->dim <= 0 || c->dim > MODEL_MAX_DIM || c->hidden_dim <= 0 ||
            c->hidden_dim > MODEL_MAX_HIDDEN_DIM || c->n_layers <= 0 || c->n_layers > MODEL_MAX_LAYERS ||
            c->n_heads <= 0 || c->n_heads > MODEL_MAX_HEADS || c->n_kv_heads <= 0 ||
            c->n_kv_heads > c->n_heads || c->seq_len <= 0 || c->seq_len > MODEL_MAX_SEQ_LEN || vocab == 0 ||
            vocab < -MODEL_MAX_VOCAB || vocab > MODEL_MAX_VOCAB)
                return -EINVAL;
        if (c->n_heads % c->n_kv_heads != 0 || c->dim % c->n_heads != 0 || (c->dim / c->n_heads) % 2 != 0)
                return -EINVAL;

        l.shared_classifier = vocab > 0;
        c->vocab_size = vocab > 0 ? vocab : -vocab;

        dim = (uint64_t)c->dim;
        hidden = (uint64_t)c->hidden_dim;
        layers = (uint64_t)c->n_layers;
        kv_dim = dim * (uint64_t)c->n_kv_heads / (uint64_t)c->n_heads;
        vocab_u = (uint64_t)c->vocab_size;
        /* Two tables of seq_len * head_size / 2 floats each. */
        rope = (uint64_t)c->seq_len * (dim / (uint64_t)c->n_heads);

        l.n_base_floats = vocab_u * dim               /* token embedding */
                          + layers * dim              /* attention rmsnorm */
                          + layers * dim * dim        /* wq */
                          + 2 * layers * dim * kv_dim /* wk, wv */
                          + layers * dim * dim        /* wo */
                          + layers * dim              /* ffn rmsnorm */
                          + 3 * layers * dim * hidden /* w1, w2, w3 */
                          + dim;                      /* final rmsnorm */
        l.n_cls_floats = l.shared_classifier ? 0 : vocab_u * dim;

        if (file_len < MODEL_HEADER_BYTES || (file_len - MODEL_HEADER_BYTES) % sizeof(float) != 0)
                return -EINVAL;
        body = (file_len - MODEL_HEADER_BYTES) / sizeof(float);
        with_rope = l.n_base_floats + rope + l.n_cls_floats;
        if (body == with_rope)
                l.cls_offset = l.n_base_floats + rope;
        else if (body == l.n_base_floats + l.n_cls_floats)
                l.cls_offset = l.n_base_floats;
        else
                return -EINVAL;

        *ret = l;
        return 0;
}

/* Allocates a model for a validated layout, weights uninitialised. */
static int model_alloc(const struct model_layout *l, struct model **ret) {
        const struct model_config *c = &l->cfg;
        struct model *m;
        size_t dim = (size_t)c->dim, hidden = (size_t)c->hidden_dim, layers = (size_t)c->n_layers;
        size_t kv_dim, n_state;
        float *p;

        m = calloc(1, sizeof(*m));
        if (!m)
                return -ENOMEM;
        m->cfg = *c;
        m->head_size = c->dim / c->n_heads;
        m->kv_dim = c->dim * c->n_kv_heads / c->n_heads;
        m->kv_mul = c->n_heads / c->n_kv_heads;
        kv_dim = (size_t)m->kv_dim;

        m->weight_data = malloc((size_t)(l->n_base_floats + l->n_cls_floats) * sizeof(float));
        n_state = 3 * dim + 2 * hidden + dim + 2 * kv_dim + 3 * (dim / 2) + (size_t)c->vocab_size;
        m->state_data = calloc(n_state, sizeof(float));
        if (!m->weight_data || !m->state_data) {
                model_free(m);
                return -ENOMEM;
        }

        p = m->weight_data;
        m->w.token_embedding = p, p += (size_t)c->vocab_size * dim;
        m->w.rms_att = p, p += layers * dim;
        m->w.wq = p, p += layers * dim * dim;
        m->w.wk = p, p += layers * dim * kv_dim;
        m->w.wv = p, p += layers * dim * kv_dim;
        m->w.wo = p, p += layers * dim * dim;
        m->w.rms_ffn = p, p += layers * dim;
        m->w.w1 = p, p += layers * dim * hidden;
        m->w.w2 = p, p += layers * hidden * dim;
        m->w.w3 = p, p += layers * dim * hidden;
        m->w.rms_final = p, p += dim;
        m->w.wcls = l->shared_classifier ? m->w.token_embedding : p;

        p = m->state_data;
        m->s.x = p, p += dim;
        m->s.xb = p, p += dim;
        m->s.xb2 = p, p += dim;
        m->s.hb = p, p += hidden;
        m->s.hb2 = p, p += hidden;
        m->s.q = p, p += dim;
        m->s.k = p, p += kv_dim;
        m->s.v = p, p += kv_dim;
        m->s.rope_freq = p, p += dim / 2;
        m->s.rope_cos = p, p += dim / 2;
        m->s.rope_sin = p, p += dim / 2;
        m->s.logits = p;

        for (int i = 0; i < c->dim; i += 2) {
                int head_dim = i % m->head_size;

                m->s.rope_freq[i / 2] = 1.0f / powf(10000.0f, head_dim / (float)m->head_size);
        }
        *ret = m;
        return 0;
}

struct model *model_free(struct model *m) {
        if (!m)
                return NULL;
        llama_free(m->gguf);
        free(m->weight_data);
        free(m->state_data);
        free(m);
        return NULL;
}

int model_load_buffer(const void *data, size_t len, struct model **ret) {
        const unsigned char *bytes = data;
        struct model_layout l;
        struct model *m;
        int r;

        if (!data || !ret || len < MODEL_HEADER_BYTES)
                return -EINVAL;
        r = model_layout_check(bytes, len, &l);
        if (r < 0)
                return r;
        r = model_alloc(&l, &m);
        if (r < 0)
                return r;
        memcpy(m->weight_data, bytes + MODEL_HEADER_BYTES, (size_t)l.n_base_floats * sizeof(float));
        if (l.n_cls_floats)
                memcpy(m->weight_data + l.n_base_floats,
                       bytes + MODEL_HEADER_BYTES + (size_t)l.cls_offset * sizeof(float),
                       (size_t)l.n_cls_floats * sizeof(float));
        *ret = m;
        return 0;
}

static int model_read_exact(FILE *f, void *buf, size_t len) {
        if (len && fread(buf, 1, len, f) != len)
                return -EIO;
        return 0;
}

bool model_is_gguf(const struct model *m) {
        return m && m->gguf;
}

/* Whether path starts with the GGUF magic. */
static bool path_is_gguf(const char *path) {
        uint32_t magic = 0;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        bool yes = fd >= 0 && read(fd, &magic, 4) == 4 && magic == GGUF_MAGIC;
        if (fd >= 0)
                close(fd);
        return yes;
}

int model_open(const char *path, const struct model_options *o, struct model **ret, char *why,
               size_t why_len) {
        if (!path || !ret)
                return -EINVAL;
        if (why && why_len)
                why[0] = 0;
        if (!path_is_gguf(path))
                return model_load(path, ret);
        struct model_options opt = o ? *o : (struct model_options){ 0 };
        struct gguf *g;
        struct model *m = calloc(1, sizeof(*m));
        if (!m)
                return -ENOMEM;
        int r = gguf_open(path, &g, why, why_len);
        if (r == 0)
                r = llama_new(&g, &(struct llama_options){ .threads = opt.threads, .exact = opt.exact },
                              &m->gguf, why, why_len);
        if (r < 0) {
                free(m);
                return r;
        }
        m->cfg = *llama_config(m->gguf);
        *ret = m;
        return 0;
}

int model_load(const char *path, struct model **ret) {
        unsigned char hdr[MODEL_HEADER_BYTES];
        struct model_layout l;
        struct model *m = NULL;
        struct stat st;
        FILE *f;
        int r;

        if (!path || !ret)
                return -EINVAL;
        f = fopen(path, "rb");
        if (!f)
                return -errno;
        if (fstat(fileno(f), &st) < 0) {
                r = -errno;
                goto out;
        }
        if (!S_ISREG(st.st_mode) || st.st_size < (off_t)MODEL_HEADER_BYTES) {
                r = -EINVAL;
                goto out;
        }
        r = model_read_exact(f, hdr, sizeof(hdr));
        if (r < 0)
                goto out;
        r = model_layout_check(hdr, (uint64_t)st.st_size, &l);
        if (r < 0)
                goto out;
        r = model_alloc(&l, &m);
        if (r < 0)
                goto out;
        r = model_read_exact(f, m->weight_data, (size_t)l.n_base_floats * sizeof(float));
        if (r == 0 && l.n_cls_floats) {
                if (fseeko(f, (off_t)(MODEL_HEADER_BYTES + l.cls_offset * sizeof(float)), SEEK_SET) < 0)
                        r = -EIO;
                else
                        r = model_read_exact(f, m->weight_data + l.n_base_floats,
                                             (size_t)l.n_cls_floats * sizeof(float));
        }
        if (r < 0)
                goto out;
        *ret = m;
        m = NULL;
out:
        model_free(m);
        fclose(f);
        return r;
}

const struct model_config *model_get_config(const struct model *m) {
        return m ? &m->cfg : NULL;
}

static void model_rmsnorm(float *o, const float *x, const float *weight, int size) {
        float ss = 0.0f;

        for (int j = 0; j < size; j++)
                ss += x[j] * x[j];
        ss /= size;
        ss += 1e-5f;
        ss = 1.0f / sqrtf(ss);
        for (int j = 0; j < size; j++)
                o[j] = weight[j] * (ss * x[j]);
}

/* xout[d] = W[d][n] @ x[n] */
static void model_matmul(float *xout, const float *x, const float *w, int n, int d) {
        for (int i = 0; i < d; i++) {
                const float *row = w + (size_t)i * (size_t)n;
                float val = 0.0f;

                for (int j = 0; j < n; j++)
                        val += row[j] * x[j];
                xout[i] = val;
        }
}

int model_forward(struct model *m, int token, int pos, const struct model_cache_ops *cache, void *ctx,
                  float **ret_logits) {
        const struct model_config *p;
        struct model_state *s;
        struct model_weights *w;
        int dim, kv_dim, hidden_dim, r;
        float *x;

        if (!m || !cache || !cache->store || !cache->attend || !ret_logits)
                return -EINVAL;
        if (m->gguf)
                return llama_forward(m->gguf, token, pos, cache, ctx, ret_logits);
        p = &m->cfg;
        if (token < 0 || token >= p->vocab_size || pos < 0)
                return -EINVAL;
        s = &m->s;
        w = &m->w;
        x = s->x;
        dim = p->dim;
        kv_dim = m->kv_dim;
        hidden_dim = p->hidden_dim;

        memcpy(x, w->token_embedding + (size_t)token * (size_t)dim, (size_t)dim * sizeof(*x));
        for (int i = 0; i < dim / 2; i++) {
                float val = pos * s->rope_freq[i];

                s->rope_cos[i] = cosf(val);
                s->rope_sin[i] = sinf(val);
        }

        for (int l = 0; l < p->n_layers; l++) {
                size_t lu = (size_t)l, du = (size_t)dim, kvu = (size_t)kv_dim, hu = (size_t)hidden_dim;

                model_rmsnorm(s->xb, x, w->rms_att + lu * du, dim);
                model_matmul(s->q, s->xb, w->wq + lu * du * du, dim, dim);
                model_matmul(s->k, s->xb, w->wk + lu * du * kvu, dim, kv_dim);
                model_matmul(s->v, s->xb, w->wv + lu * du * kvu, dim, kv_dim);

                for (int i = 0; i < dim; i += 2) {
                        float fcr = s->rope_cos[i / 2], fci = s->rope_sin[i / 2];
                        int rotn = i < kv_dim ? 2 : 1;

                        for (int v = 0; v < rotn; v++) {
                                float *vec = v == 0 ? s->q : s->k;
                                float v0 = vec[i], v1 = vec[i + 1];

                                vec[i] = v0 * fcr - v1 * fci;
                                vec[i + 1] = v0 * fci + v1 * fcr;
                        }
                }

                r = cache->store(ctx, l, pos, s->k, s->v);
                if (r < 0)
                        return r;
                r = cache->attend(ctx, l, pos, s->q, s->xb);
                if (r < 0)
                        return r;

                model_matmul(s->xb2, s->xb, w->wo + lu * du * du, dim, dim);
                for (int i = 0; i < dim; i++)
                        x[i] += s->xb2[i];

                model_rmsnorm(s->xb, x, w->rms_ffn + lu * du, dim);
                model_matmul(s->hb, s->xb, w->w1 + lu * du * hu, dim, hidden_dim);
                model_matmul(s->hb2, s->xb, w->w3 + lu * du * hu, dim, hidden_dim);
                for (int i = 0; i < hidden_dim; i++) {
                        float val = s->hb[i];

                        val *= (1.0f / (1.0f + expf(-val)));
                        val *= s->hb2[i];
                        s->hb[i] = val;
                }
                model_matmul(s->xb, s->hb, w->w2 + lu * du * hu, hidden_dim, dim);
                for (int i = 0; i < dim; i++)
                        x[i] += s->xb[i];
        }

        model_rmsnorm(x, x, w->rms_final, dim);
        model_matmul(s->logits, x, w->wcls, dim, p->vocab_size);
        *ret_logits = s->logits;
        return 0;
}

int model_forward_rows(struct model *m, const struct model_row *rows, uint32_t n,
                       const struct model_cache_ops *cache, float **ret_logits) {
        if (!m || !rows || !ret_logits || n == 0 || n > MODEL_MAX_ROWS)
                return -EINVAL;
        if (m->gguf)
                return llama_forward_rows(m->gguf, rows, n, cache, ret_logits);
        /* a llama2.c checkpoint: one row at a time, each overwriting the logits: the last row's only */
        for (uint32_t i = 0; i + 1 < n; i++)
                if (rows[i].logits)
                        return -EINVAL;
        for (uint32_t i = 0; i < n; i++) {
                int r = model_forward(m, rows[i].token, rows[i].pos, cache, rows[i].ctx, ret_logits);
                if (r < 0)
                        return r;
        }
        return 0;
}

struct plain_cache {
        int n_layers, n_heads, head_size, kv_dim, kv_mul, max_tokens;
        float *keys;   /* [n_layers][max_tokens][kv_dim] */
        float *values; /* same */
        float *att;    /* attn_prefill_rows's scratch, for a group of rows */
        int *n_stored; /* [n_layers], positions 0..n_stored-1 hold data */
};

int plain_cache_new(const struct model_config *cfg, int max_tokens, struct plain_cache **ret) {
        struct plain_cache *c;
        size_t n_floats;

        if (!cfg || !ret || cfg->dim <= 0 || cfg->n_layers <= 0 || cfg->n_heads <= 0 ||
            cfg->n_kv_heads <= 0 || cfg->dim > MODEL_MAX_DIM || cfg->n_layers > MODEL_MAX_LAYERS ||
            cfg->n_heads > MODEL_MAX_HEADS || cfg->dim % cfg->n_heads != 0 ||
            cfg->n_heads % cfg->n_kv_heads != 0 || max_tokens <= 0 || max_tokens > PLAIN_CACHE_MAX_TOKENS)
                return -EINVAL;

        c = calloc(1, sizeof(*c));
        if (!c)
                return -ENOMEM;
        c->n_layers = cfg->n_layers;
        c->n_heads = cfg->n_heads;
        c->head_size = cfg->dim / cfg->n_heads;
        c->kv_dim = cfg->dim * cfg->n_kv_heads / cfg->n_heads;
        c->kv_mul = cfg->n_heads / cfg->n_kv_heads;
        c->max_tokens = max_tokens;

        /* Bounded above: 2^9 * 2^24 * 2^14 floats fits size_t on the 64-bit hosts we build for, and
         * the multiplication is checked for the others. */
        if (__builtin_mul_overflow((size_t)c->n_layers, (size_t)max_tokens, &n_floats) ||
            __builtin_mul_overflow(n_floats, (size_t)c->kv_dim, &n_floats) ||
            n_floats > SIZE_MAX / sizeof(float)) {
                free(c);
                return -ENOMEM;
        }
        c->keys = malloc(n_floats * sizeof(float));
        c->values = malloc(n_floats * sizeof(float));
        c->att = malloc(attn_rows_scratch_floats((uint32_t)max_tokens, ATTN_ROWS_GROUP,
                                                 (uint32_t)cfg->n_heads, (uint32_t)cfg->n_kv_heads,
                                                 (uint32_t)c->head_size, ATTN_ROWS_TILE) *
                        sizeof(float));
        c->n_stored = calloc((size_t)c->n_layers, sizeof(int));
        if (!c->keys || !c->values || !c->att || !c->n_stored) {
                plain_cache_free(c);
                return -ENOMEM;
        }
        *ret = c;
        return 0;
}

struct plain_cache *plain_cache_free(struct plain_cache *c) {
        if (!c)
                return NULL;
        free(c->keys);
        free(c->values);
        free(c->att);
        free(c->n_stored);
        free(c);
        return NULL;
}

void plain_cache_reset(struct plain_cache *c) {
        if (c)
                memset(c->n_stored, 0, (size_t)c->n_layers * sizeof(int));
}

static size_t plain_cache_index(const struct plain_cache *c, int layer, int pos) {
        return ((size_t)layer * (size_t)c->max_tokens + (size_t)pos) * (size_t)c->kv_dim;
}

static int plain_cache_store(void *ctx, int layer, int pos, const float *k, const float *v) {
        struct plain_cache *c = ctx;
        size_t at;

        if (!c || !k || !v || layer < 0 || layer >= c->n_layers || pos < 0)
                return -EINVAL;
        if (pos >= c->max_tokens)
                return -ERANGE;
        if (pos > c->n_stored[layer])
                return -EINVAL;
        at = plain_cache_index(c, layer, pos);
        memcpy(c->keys + at, k, (size_t)c->kv_dim * sizeof(float));
        memcpy(c->values + at, v, (size_t)c->kv_dim * sizeof(float));
        c->n_stored[layer] = pos + 1;
        return 0;
}

/* The kernel libkvc runs over kvcd's blocks (kernels/attention.h), over this cache's rows: an f32
 * layer through kvcd in blocks of 16 computes the same bits. */
static int plain_cache_attend(void *ctx, int layer, int pos, const float *q, float *out) {
        struct plain_cache *c = ctx;

        if (!c || !q || !out || layer < 0 || layer >= c->n_layers || pos < 0)
                return -EINVAL;
        if (pos >= c->max_tokens)
                return -ERANGE;
        if (pos >= c->n_stored[layer])
                return -EINVAL;
        return attn_decode_rows(
                c->keys + plain_cache_index(c, layer, 0), c->values + plain_cache_index(c, layer, 0),
                (size_t)c->kv_dim, (uint32_t)pos + 1, q, out, (uint32_t)c->n_heads,
                (uint32_t)(c->n_heads / c->kv_mul), (uint32_t)c->head_size, c->att, ATTN_ISA_BEST);
}

/* Rows pos .. pos + n - 1 at once: row r over positions 0 .. pos + r. */
static int plain_cache_attend_rows(void *ctx, int layer, int pos, uint32_t n, const float *q, float *out) {
        struct plain_cache *c = ctx;

        if (!c || !q || !out || layer < 0 || layer >= c->n_layers || pos < 0 || n == 0)
                return -EINVAL;
        if ((int64_t)pos + n > c->max_tokens)
                return -ERANGE;
        if ((int64_t)pos + n > c->n_stored[layer])
                return -EINVAL;
        return attn_prefill_rows(
                c->keys + plain_cache_index(c, layer, 0), c->values + plain_cache_index(c, layer, 0),
                (size_t)c->kv_dim, (uint32_t)pos + n, n, q, out, (uint32_t)c->n_heads,
                (uint32_t)(c->n_heads / c->kv_mul), (uint32_t)c->head_size, c->att, ATTN_ISA_BEST);
}

const struct model_cache_ops plain_cache_ops = {
        .store = plain_cache_store,
        .attend = plain_cache_attend,
        .attend_rows = plain_cache_attend_rows,
};
