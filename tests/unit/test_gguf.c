/* test_gguf.c - unit tests of the GGUF reader (client/engine/gguf.c) and of the checks llama.c
 * makes before it runs a GGUF model.
 *
 * Owns: a small GGUF writer (struct gbuf) that builds files in memory, so every malformed shape
 * (truncation at every byte, lying counts and lengths, duplicate names, bad alignment, tensors
 * outside the file, unknown types) is one test, and a tiny valid llama model (F32 weights) whose
 * forward pass is checked against a hand computation of its first layer.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "gguf.h"
#include "llama.h"
#include "qtype.h"

/* fields: where each 32- or 64-bit number the writer put lies (offset and width), so a test can
 * set every one of them to its limits */
#define GBUF_MAX_FIELDS 512
struct gbuf {
        uint8_t *b;
        size_t n, cap;
        size_t n_fields;
        struct {
                size_t at;
                unsigned bytes;
        } fields[GBUF_MAX_FIELDS];
};

static void put(struct gbuf *g, const void *p, size_t n) {
        if (g->n + n > g->cap) {
                g->cap = (g->n + n) * 2 + 64;
                g->b = realloc(g->b, g->cap);
                assert_non_null(g->b);
        }
        memcpy(g->b + g->n, p, n);
        g->n += n;
}

static void field(struct gbuf *g, const void *p, unsigned bytes) {
        if (g->n_fields < GBUF_MAX_FIELDS)
                g->fields[g->n_fields].at = g->n, g->fields[g->n_fields++].bytes = bytes;
        put(g, p, bytes);
}

static void u32(struct gbuf *g, uint32_t x) {
        field(g, &x, 4);
}

static void u64(struct gbuf *g, uint64_t x) {
        field(g, &x, 8);
}

static void str(struct gbuf *g, const char *s) {
        u64(g, strlen(s));
        put(g, s, strlen(s));
}

static void kv_u32(struct gbuf *g, const char *k, uint32_t v) {
        str(g, k);
        u32(g, GGUF_TYPE_UINT32);
        u32(g, v);
}

static void kv_f32(struct gbuf *g, const char *k, float v) {
        str(g, k);
        u32(g, GGUF_TYPE_FLOAT32);
        field(g, &v, 4);
}

/* A key of any scalar type; v is written in the type's width. */
static void kv_scalar(struct gbuf *g, const char *k, enum gguf_type t, uint64_t v) {
        str(g, k);
        u32(g, t);
        field(g, &v, (unsigned)gguf_type_size(t));
}

static void kv_str(struct gbuf *g, const char *k, const char *v) {
        str(g, k);
        u32(g, GGUF_TYPE_STRING);
        str(g, v);
}

static void pad(struct gbuf *g, size_t align) {
        static const uint8_t zero[64];
        while (g->n % align)
                put(g, zero, 1);
}

/* The tiny model: 1 layer, dim 8, 2 heads of 4, 1 KV head, hidden 16, vocab 4, all F32. */
#define T_DIM   8
#define T_HID   16
#define T_KV    4
#define T_VOCAB 4

struct tensor_spec {
        const char *name;
        uint64_t ne0, ne1;
};

static const struct tensor_spec tiny_tensors[] = {
        { "token_embd.weight", T_DIM, T_VOCAB },   { "output_norm.weight", T_DIM, 1 },
        { "blk.0.attn_norm.weight", T_DIM, 1 },    { "blk.0.ffn_norm.weight", T_DIM, 1 },
        { "blk.0.attn_q.weight", T_DIM, T_DIM },   { "blk.0.attn_k.weight", T_DIM, T_KV },
        { "blk.0.attn_v.weight", T_DIM, T_KV },    { "blk.0.attn_output.weight", T_DIM, T_DIM },
        { "blk.0.ffn_gate.weight", T_DIM, T_HID }, { "blk.0.ffn_up.weight", T_DIM, T_HID },
        { "blk.0.ffn_down.weight", T_HID, T_DIM },
};
#define N_TINY (sizeof(tiny_tensors) / sizeof(tiny_tensors[0]))

/* Writes the tiny model with llama.context_length of type ctx_type and value ctx (in the type's
 * width); arch names the architecture. Weights: element i of tensor t is sin(1 + i + 7 t) / 4
 * (norms: 1 + element / 8). */
static struct gbuf tiny_model_ctx(const char *arch, enum gguf_type ctx_type, uint64_t ctx) {
        struct gbuf g = { 0 };
        u32(&g, GGUF_MAGIC);
        u32(&g, 3);
        u64(&g, N_TINY);
        u64(&g, 9);
        kv_str(&g, "general.architecture", arch);
        kv_u32(&g, "llama.block_count", 1);
        kv_u32(&g, "llama.embedding_length", T_DIM);
        kv_u32(&g, "llama.feed_forward_length", T_HID);
        kv_u32(&g, "llama.attention.head_count", 2);
        kv_u32(&g, "llama.attention.head_count_kv", 1);
        kv_scalar(&g, "llama.context_length", ctx_type, ctx);
        kv_f32(&g, "llama.rope.freq_base", 10000.0f);
        kv_f32(&g, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
        uint64_t off = 0;
        for (size_t t = 0; t < N_TINY; t++) {
                const struct tensor_spec *s = &tiny_tensors[t];
                str(&g, s->name);
                u32(&g, s->ne1 > 1 ? 2 : 1);
                u64(&g, s->ne0);
                if (s->ne1 > 1)
                        u64(&g, s->ne1);
                u32(&g, QTYPE_F32);
                u64(&g, off);
                off += (s->ne0 * s->ne1 * 4 + 31) / 32 * 32;
        }
        pad(&g, 32);
        for (size_t t = 0; t < N_TINY; t++) {
                const struct tensor_spec *s = &tiny_tensors[t];
                bool norm = s->ne1 == 1;
                for (uint64_t i = 0; i < s->ne0 * s->ne1; i++) {
                        float v = norm ? 1.0f + (float)i / 8 : sinf((float)(1 + i + 7 * t)) / 4;
                        put(&g, &v, 4);
                }
                pad(&g, 32);
        }
        return g;
}

static struct gbuf tiny_model(const char *arch) {
        return tiny_model_ctx(arch, GGUF_TYPE_UINT32, 64);
}

static int open_buf(const struct gbuf *g, struct gguf **ret, char *why) {
        return gguf_open_buffer(g->b, g->n, ret, why, 256);
}

static void reader_indexes_every_key_and_tensor(void **state) {
        (void)state;
        struct gbuf b = tiny_model("llama");
        struct gguf *g;
        char why[256];
        assert_int_equal(open_buf(&b, &g, why), 0);
        assert_int_equal(gguf_version(g), 3);
        assert_int_equal(gguf_n_kv(g), 9);
        assert_int_equal(gguf_n_tensors(g), N_TINY);
        uint32_t x;
        double f;
        struct gguf_str s;
        assert_int_equal(gguf_get_u32(g, "llama.embedding_length", &x), 0);
        assert_int_equal(x, T_DIM);
        assert_int_equal(gguf_get_f64(g, "llama.rope.freq_base", &f), 0);
        assert_true(f == 10000.0);
        assert_int_equal(gguf_get_str(g, "general.architecture", &s), 0);
        assert_true(gguf_str_eq(s, "llama"));
        assert_int_equal(gguf_get_u32(g, "no.such.key", &x), -ENOENT);
        assert_int_equal(gguf_get_str(g, "llama.block_count", &s), -EINVAL);
        const struct gguf_tensor *t = gguf_find_tensor(g, "blk.0.ffn_down.weight");
        assert_non_null(t);
        assert_int_equal(t->ne[0], T_HID);
        assert_int_equal(t->ne[1], T_DIM);
        assert_int_equal(t->n_bytes, T_HID * T_DIM * 4);
        assert_true(t->data >= b.b && t->data + t->n_bytes <= b.b + b.n);
        assert_null(gguf_find_tensor(g, "blk.1.ffn_down.weight"));
        gguf_free(g);
        free(b.b);
}

static void reader_refuses_every_truncation(void **state) {
        (void)state;
        struct gbuf b = tiny_model("llama");
        for (size_t n = 0; n < b.n; n++) {
                /* a copy of exactly n bytes, so ASan sees any read past it */
                uint8_t *cut = malloc(n ? n : 1);
                memcpy(cut, b.b, n);
                struct gguf *g = NULL;
                char why[256];
                int r = gguf_open_buffer(cut, n, &g, why, sizeof(why));
                assert_int_equal(r, -EINVAL);
                assert_null(g);
                free(cut);
        }
        free(b.b);
}

/* Overwrites the 8 bytes at off with x. */
static void poke64(struct gbuf *b, size_t off, uint64_t x) {
        memcpy(b->b + off, &x, 8);
}

static void reader_refuses_lying_counts(void **state) {
        (void)state;
        const uint64_t lies[] = { 1u << 20, UINT64_MAX, GGUF_MAX_TENSORS + 1ull, 5000 };
        for (size_t i = 0; i < sizeof(lies) / sizeof(lies[0]); i++) {
                for (size_t field = 8; field <= 16; field += 8) { /* n_tensors, n_kv */
                        struct gbuf b = tiny_model("llama");
                        struct gguf *g = NULL;
                        char why[256];
                        poke64(&b, field, lies[i]);
                        int r = open_buf(&b, &g, why);
                        assert_true(r == -EINVAL || r == -EOVERFLOW);
                        assert_null(g);
                        free(b.b);
                }
        }
        /* the first key's length beyond the file */
        struct gbuf b = tiny_model("llama");
        struct gguf *g = NULL;
        char why[256];
        poke64(&b, 24, 1ull << 40);
        assert_int_equal(open_buf(&b, &g, why), -EOVERFLOW);
        poke64(&b, 24, b.n);
        assert_int_equal(open_buf(&b, &g, why), -EINVAL);
        assert_non_null(strstr(why, "truncated"));
        free(b.b);
}

static void reader_refuses_duplicates_and_bad_values(void **state) {
        (void)state;
        char why[256];
        struct gguf *g = NULL;
        /* the same key twice */
        struct gbuf b = { 0 };
        u32(&b, GGUF_MAGIC);
        u32(&b, 3);
        u64(&b, 0);
        u64(&b, 2);
        kv_u32(&b, "a", 1);
        kv_u32(&b, "a", 2);
        assert_int_equal(open_buf(&b, &g, why), -EINVAL);
        assert_non_null(strstr(why, "twice"));
        free(b.b);
        /* a bool of 2, an unknown value type, an array of arrays too deep, alignment 3 */
        for (int c = 0; c < 4; c++) {
                b = (struct gbuf){ 0 };
                u32(&b, GGUF_MAGIC);
                u32(&b, 2);
                u64(&b, 0);
                u64(&b, 1);
                if (c == 0) {
                        str(&b, "b");
                        u32(&b, GGUF_TYPE_BOOL);
                        put(&b, "\2", 1);
                } else if (c == 1) {
                        str(&b, "u");
                        u32(&b, 77);
                        u32(&b, 0);
                } else if (c == 2) {
                        str(&b, "deep");
                        u32(&b, GGUF_TYPE_ARRAY);
                        for (int d = 0; d < 6; d++) {
                                u32(&b, GGUF_TYPE_ARRAY);
                                u64(&b, 1);
                        }
                        u32(&b, GGUF_TYPE_UINT8);
                        u64(&b, 0);
                } else {
                        kv_u32(&b, "general.alignment", 3);
                }
                assert_int_equal(open_buf(&b, &g, why), -EINVAL);
                free(b.b);
        }
        /* not GGUF at all, and version 1 */
        b = (struct gbuf){ 0 };
        u32(&b, 0x12345678);
        u32(&b, 3);
        u64(&b, 0);
        u64(&b, 0);
        assert_int_equal(open_buf(&b, &g, why), -EINVAL);
        assert_non_null(strstr(why, "not a GGUF"));
        memcpy(b.b, &(uint32_t){ GGUF_MAGIC }, 4);
        memcpy(b.b + 4, &(uint32_t){ 1 }, 4);
        assert_int_equal(open_buf(&b, &g, why), -EINVAL);
        assert_non_null(strstr(why, "version 1"));
        free(b.b);
}

/* The tensor infos start right after the 9 keys; returns the offset of tensor 0's info. */
static size_t first_tensor_info(const struct gbuf *b) {
        struct gguf *g;
        char why[256];
        assert_int_equal(open_buf(b, &g, why), 0);
        const struct gguf_tensor *t = gguf_tensor_at(g, 0);
        size_t at = (size_t)((const uint8_t *)t->name.s - b->b) - 8;
        gguf_free(g);
        return at;
}

static void reader_refuses_tensors_outside_the_file(void **state) {
        (void)state;
        struct gbuf b = tiny_model("llama");
        size_t info = first_tensor_info(&b);
        size_t name_len = strlen(tiny_tensors[0].name);
        size_t ne0_at = info + 8 + name_len + 4, type_at = ne0_at + 16, off_at = type_at + 4;
        struct gguf *g = NULL;
        char why[256];
        uint8_t saved[8];

        memcpy(saved, b.b + off_at, 8);
        poke64(&b, off_at, 1ull << 40); /* data past the end */
        assert_int_equal(open_buf(&b, &g, why), -EINVAL);
        assert_non_null(strstr(why, "outside the file"));
        poke64(&b, off_at, 4); /* misaligned */
        assert_int_equal(open_buf(&b, &g, why), -EINVAL);
        memcpy(b.b + off_at, saved, 8);

        memcpy(saved, b.b + ne0_at, 8);
        poke64(&b, ne0_at, 1ull << 62); /* a dimension whose product overflows */
        assert_int_equal(open_buf(&b, &g, why), -EINVAL);
        poke64(&b, ne0_at, 0);
        assert_int_equal(open_buf(&b, &g, why), -EINVAL);
        memcpy(b.b + ne0_at, saved, 8);

        memcpy(b.b + type_at, &(uint32_t){ 99 }, 4); /* a type ggml does not define */
        assert_int_equal(open_buf(&b, &g, why), -EINVAL);
        assert_non_null(strstr(why, "unknown type 99"));
        memcpy(b.b + type_at, &(uint32_t){ QTYPE_Q4_1 }, 4); /* 8 elements: not a whole q4_1 block */
        assert_int_equal(open_buf(&b, &g, why), -EINVAL);
        assert_non_null(strstr(why, "q4_1"));
        free(b.b);
}

static void llama_refuses_another_architecture_by_name(void **state) {
        (void)state;
        struct gbuf b = tiny_model("gpt2");
        struct gguf *g;
        struct llama *m = NULL;
        char why[256];
        assert_int_equal(open_buf(&b, &g, why), 0);
        assert_int_equal(llama_new(&g, &(struct llama_options){ .threads = 1 }, &m, why, sizeof(why)),
                         -EINVAL);
        assert_null(g);
        assert_null(m);
        assert_non_null(strstr(why, "gpt2"));
        free(b.b);
}

static void llama_refuses_a_missing_or_misshapen_tensor(void **state) {
        (void)state;
        struct gbuf b = tiny_model("llama");
        struct gguf *g;
        struct llama *m = NULL;
        char why[256];
        /* rename blk.0.attn_v.weight to blk.0.attn_x.weight */
        char *p = memmem(b.b, b.n, "blk.0.attn_v.weight", 19);
        assert_non_null(p);
        p[11] = 'x';
        assert_int_equal(open_buf(&b, &g, why), 0);
        assert_int_equal(llama_new(&g, &(struct llama_options){ .threads = 1 }, &m, why, sizeof(why)),
                         -EINVAL);
        assert_non_null(strstr(why, "blk.0.attn_v.weight is missing"));
        free(b.b);
}

struct capture {
        float k[T_KV], v[T_KV];
};

static int cap_store(void *ctx, int layer, int pos, const float *k, const float *v) {
        struct capture *c = ctx;
        (void)layer;
        (void)pos;
        memcpy(c->k, k, sizeof(c->k));
        memcpy(c->v, v, sizeof(c->v));
        return 0;
}

/* At position 0 attention over one token returns its value, per query head (GQA: both heads
 * read KV head 0). */
static int cap_attend(void *ctx, int layer, int pos, const float *q, float *out) {
        struct capture *c = ctx;
        (void)layer;
        (void)pos;
        (void)q;
        memcpy(out, c->v, sizeof(c->v));
        memcpy(out + T_KV, c->v, sizeof(c->v));
        return 0;
}

static float w_of(size_t t, uint64_t i) {
        return sinf((float)(1 + i + 7 * t)) / 4;
}

static void rms(float *o, const float *x, int n) {
        double ss = 0;
        for (int i = 0; i < n; i++)
                ss += (double)x[i] * x[i];
        float s = (float)(1.0 / sqrt(ss / n + 1e-5));
        for (int i = 0; i < n; i++)
                o[i] = (1.0f + (float)i / 8) * x[i] * s;
}

/* y[r] = sum_c W_t[r][c] x[c] with tensor t's generated weights */
static void mv(size_t t, int rows, int cols, const float *x, float *y) {
        for (int r = 0; r < rows; r++) {
                double s = 0;
                for (int c = 0; c < cols; c++)
                        s += (double)w_of(t, (uint64_t)r * cols + c) * x[c];
                y[r] = (float)s;
        }
}

static void llama_forward_matches_a_hand_computation(void **state) {
        (void)state;
        struct gbuf b = tiny_model("llama");
        struct gguf *g;
        struct llama *m = NULL;
        char why[256];
        assert_int_equal(open_buf(&b, &g, why), 0);
        assert_int_equal(
                llama_new(&g, &(struct llama_options){ .threads = 2, .exact = true }, &m, why, sizeof(why)),
                0);
        const struct model_config *c = llama_config(m);
        assert_int_equal(c->vocab_size, T_VOCAB);
        assert_int_equal(c->n_kv_heads, 1);

        struct capture cap;
        struct model_cache_ops ops = { .store = cap_store, .attend = cap_attend };
        float *logits;
        int token = 2;
        assert_int_equal(llama_forward(m, token, 0, &ops, &cap, &logits), 0);

        /* the same layer by hand, in double: at pos 0 RoPE is the identity */
        float x[T_DIM], xb[T_DIM], v[T_KV], att[T_DIM], o[T_DIM], gate[T_HID], up[T_HID], h[T_HID], d[T_DIM];
        for (int i = 0; i < T_DIM; i++)
                x[i] = w_of(0, (uint64_t)token * T_DIM + i);
        rms(xb, x, T_DIM);
        mv(6, T_KV, T_DIM, xb, v);
        for (int i = 0; i < T_KV; i++)
                assert_float_equal(cap.v[i], v[i], 1e-5);
        memcpy(att, v, sizeof(v));
        memcpy(att + T_KV, v, sizeof(v));
        mv(7, T_DIM, T_DIM, att, o);
        for (int i = 0; i < T_DIM; i++)
                x[i] += o[i];
        rms(xb, x, T_DIM);
        mv(8, T_HID, T_DIM, xb, gate);
        mv(9, T_HID, T_DIM, xb, up);
        for (int i = 0; i < T_HID; i++)
                h[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        mv(10, T_DIM, T_HID, h, d);
        for (int i = 0; i < T_DIM; i++)
                x[i] += d[i];
        rms(xb, x, T_DIM);
        float want[T_VOCAB];
        mv(0, T_VOCAB, T_DIM, xb, want); /* tied embeddings: no output.weight */
        for (int i = 0; i < T_VOCAB; i++)
                assert_float_equal(logits[i], want[i], 1e-5);
        assert_int_equal(llama_forward(m, T_VOCAB, 0, &ops, &cap, &logits), -EINVAL);
        llama_free(m);
        free(b.b);
}

/* A cache for any configuration llama_new accepted: stores nothing, attends to zeros. */
static int null_store(void *ctx, int layer, int pos, const float *k, const float *v) {
        (void)ctx, (void)layer, (void)pos, (void)k, (void)v;
        return 0;
}

static int null_attend(void *ctx, int layer, int pos, const float *q, float *out) {
        const struct model_config *c = ctx;
        (void)layer, (void)pos, (void)q;
        memset(out, 0, (size_t)c->dim * sizeof(float));
        return 0;
}

/* What every caller of the engine relies on once llama_new accepted a model: every count is
 * positive and bounded, so int arithmetic on it (a prompt buffer of seq_len + 3 ids) is sound. */
static void assert_config_in_range(const struct model_config *c) {
        assert_true(c->dim > 0 && c->hidden_dim > 0 && c->n_layers > 0 && c->n_heads > 0 &&
                    c->n_kv_heads > 0 && c->vocab_size > 0);
        assert_in_range(c->seq_len, 1, MODEL_MAX_SEQ_LEN);
}

/* Opens a copy of exactly b->n bytes (ASan sees any read past it) and, when the reader accepts
 * it, builds the model and runs one step at position 0 and one at the last position. Returns
 * what refused it (0: accepted). */
static int open_and_run(const struct gbuf *b) {
        uint8_t *copy = malloc(b->n);
        assert_non_null(copy);
        memcpy(copy, b->b, b->n);
        struct gguf *g = NULL;
        char why[256] = "";
        int r = gguf_open_buffer(copy, b->n, &g, why, sizeof(why));
        assert_true(r == 0 || r == -EINVAL || r == -EOVERFLOW);
        if (r == 0) {
                struct llama *m = NULL;
                why[0] = 0;
                r = llama_new(&g, &(struct llama_options){ .threads = 1, .exact = true }, &m, why,
                              sizeof(why));
                assert_null(g);
                assert_true(r == 0 || (r == -EINVAL && why[0]));
                if (r == 0) {
                        const struct model_config *c = llama_config(m);
                        assert_config_in_range(c);
                        struct model_cache_ops ops = { .store = null_store, .attend = null_attend };
                        float *logits;
                        assert_int_equal(llama_forward(m, 0, 0, &ops, (void *)c, &logits), 0);
                        assert_int_equal(llama_forward(m, 0, c->seq_len - 1, &ops, (void *)c, &logits), 0);
                        llama_free(m);
                }
        }
        free(copy);
        return r;
}

/* Issue 28, item 4: llama.context_length of 2^31 became a negative int, and kvc-run's prompt
 * buffer of seq_len + 3 ids was allocated for it; the encoder then wrote the prompt past it. */
static void llama_refuses_a_context_length_past_what_the_engine_holds(void **state) {
        (void)state;
        static const struct {
                enum gguf_type type;
                uint64_t value;
                int want; /* 0: accepted with seq_len == value */
        } cases[] = {
                { GGUF_TYPE_UINT32, 1u << 31, -EINVAL },
                { GGUF_TYPE_UINT32, (1u << 31) - 1, -EINVAL },
                { GGUF_TYPE_UINT32, UINT32_MAX, -EINVAL },
                { GGUF_TYPE_UINT32, MODEL_MAX_SEQ_LEN + 1, -EINVAL },
                { GGUF_TYPE_UINT32, 0, -EINVAL },
                { GGUF_TYPE_UINT64, 1ull << 32, -EINVAL },
                { GGUF_TYPE_UINT64, (1ull << 32) + 64, -EINVAL }, /* not cut to 64 */
                { GGUF_TYPE_UINT64, 1ull << 63, -EINVAL },
                { GGUF_TYPE_UINT64, UINT64_MAX, -EINVAL },
                { GGUF_TYPE_INT32, UINT32_MAX, -EINVAL }, /* -1 */
                { GGUF_TYPE_INT32, 1u << 31, -EINVAL },   /* INT32_MIN */
                { GGUF_TYPE_INT64, UINT64_MAX, -EINVAL }, /* -1 */
                { GGUF_TYPE_INT64, 1ull << 63, -EINVAL }, /* INT64_MIN */
                { GGUF_TYPE_FLOAT32, 0x45000000u, -EINVAL }, /* 2048.0f: not an integer */
                { GGUF_TYPE_UINT32, 1, 0 },
                { GGUF_TYPE_UINT32, MODEL_MAX_SEQ_LEN, 0 },
                { GGUF_TYPE_UINT64, MODEL_MAX_SEQ_LEN, 0 },
                { GGUF_TYPE_INT32, 8192, 0 },
                { GGUF_TYPE_UINT16, 65535, 0 },
        };
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                struct gbuf b = tiny_model_ctx("llama", cases[i].type, cases[i].value);
                struct gguf *g;
                struct llama *m = NULL;
                char why[256] = "";
                assert_int_equal(open_buf(&b, &g, why), 0);
                int r = llama_new(&g, &(struct llama_options){ .threads = 1 }, &m, why, sizeof(why));
                if (r != cases[i].want)
                        fail_msg("context_length %llu of type %s: %d (%s), expected %d",
                                 (unsigned long long)cases[i].value, gguf_type_name(cases[i].type), r, why,
                                 cases[i].want);
                if (r == 0) {
                        assert_int_equal(llama_config(m)->seq_len, cases[i].value);
                        llama_free(m);
                } else {
                        assert_non_null(strstr(why, "context_length"));
                }
                assert_int_equal(open_and_run(&b), cases[i].want);
                free(b.b);
        }
}

/* Every 32- and 64-bit number in a valid file (header, key lengths, value types and values,
 * tensor names, dimension counts, dimensions, types and offsets) set to each of its limits: the
 * reader refuses or indexes it inside the file, and llama_new refuses it or builds a model whose
 * counts are in range and that runs at its first and last positions. */
static void every_number_in_the_file_at_its_limits_is_refused_or_held(void **state) {
        (void)state;
        static const uint64_t limits[] = { 0,           1,           0x7fffffffu,  0x80000000u,
                                           0xffffffffu, 0x7f800000u, 1ull << 32,   (1ull << 32) + 1,
                                           INT64_MAX,   1ull << 63,  UINT64_MAX };
        struct gbuf b = tiny_model("llama");
        size_t n_fields = b.n_fields, tried = 0, accepted = 0;
        assert_true(n_fields > 60 && n_fields < GBUF_MAX_FIELDS);
        for (size_t f = 0; f < n_fields; f++) {
                size_t at = b.fields[f].at;
                unsigned bytes = b.fields[f].bytes;
                uint64_t saved = 0;
                memcpy(&saved, b.b + at, bytes);
                for (size_t i = 0; i < sizeof(limits) / sizeof(limits[0]); i++) {
                        if (bytes == 4 && limits[i] > UINT32_MAX)
                                continue;
                        memcpy(b.b + at, &limits[i], bytes);
                        accepted += open_and_run(&b) == 0;
                        tried++;
                }
                memcpy(b.b + at, &saved, bytes);
        }
        assert_true(tried > 500);
        assert_true(accepted > 0 && accepted < tried); /* e.g. a weight of 0 or 1 runs */
        assert_int_equal(open_and_run(&b), 0);
        free(b.b);
}

/* A file with arrays of every fixed type and of strings, the shape of a vocabulary. */
static struct gbuf arrays_file(void) {
        struct gbuf g = { 0 };
        u32(&g, GGUF_MAGIC);
        u32(&g, 3);
        u64(&g, 0);
        u64(&g, 2);
        str(&g, "tokenizer.ggml.tokens");
        u32(&g, GGUF_TYPE_ARRAY);
        u32(&g, GGUF_TYPE_STRING);
        u64(&g, 3);
        str(&g, "a");
        str(&g, "\xc4\xa0"
                "b");
        str(&g, "<|im_end|>");
        str(&g, "tokenizer.ggml.token_type");
        u32(&g, GGUF_TYPE_ARRAY);
        u32(&g, GGUF_TYPE_INT32);
        u64(&g, 3);
        u32(&g, 1);
        u32(&g, 1);
        u32(&g, 3);
        return g;
}

static void reader_reads_string_arrays_in_place(void **state) {
        (void)state;
        struct gbuf b = arrays_file();
        struct gguf *g;
        char why[256];
        const struct gguf_value *v;
        assert_int_equal(open_buf(&b, &g, why), 0);
        assert_int_equal(gguf_get_array(g, "tokenizer.ggml.tokens", &v), 0);
        assert_int_equal(v->arr.n, 3);
        struct gguf_str s = gguf_array_str(v, 2);
        assert_true(gguf_str_eq(s, "<|im_end|>"));
        assert_true(gguf_str_eq(gguf_array_str(v, 1), "\xc4\xa0"
                                                      "b"));
        assert_int_equal(gguf_array_str(v, 3).len, 0); /* past the end: empty */
        assert_int_equal(gguf_get_array(g, "tokenizer.ggml.token_type", &v), 0);
        assert_int_equal(gguf_array_i32(v, 2), 3);
        gguf_free(g);
        free(b.b);
}

/* --write-seeds DIR: the fuzz target's seeds (tests/fuzz/corpus/gguf), from the writer above. */
static int write_seeds(const char *dir) {
        /* the context lengths of issue 28 (item 4) and their neighbours */
        struct gbuf seeds[] = { tiny_model("llama"),
                                tiny_model("gpt2"),
                                arrays_file(),
                                tiny_model_ctx("llama", GGUF_TYPE_UINT32, 1u << 31),
                                tiny_model_ctx("llama", GGUF_TYPE_UINT32, UINT32_MAX),
                                tiny_model_ctx("llama", GGUF_TYPE_UINT32, MODEL_MAX_SEQ_LEN + 1),
                                tiny_model_ctx("llama", GGUF_TYPE_UINT32, MODEL_MAX_SEQ_LEN),
                                tiny_model_ctx("llama", GGUF_TYPE_UINT64, UINT64_MAX),
                                tiny_model_ctx("llama", GGUF_TYPE_INT32, UINT32_MAX) };
        const char *names[] = { "seed-tiny-llama",         "seed-tiny-gpt2",        "seed-arrays",
                                "seed-context-2p31",       "seed-context-u32-max",  "seed-context-2p20-plus-1",
                                "seed-context-2p20",       "seed-context-u64-max",  "seed-context-i32-minus-1" };
        _Static_assert(sizeof(seeds) / sizeof(seeds[0]) == sizeof(names) / sizeof(names[0]), "one name a seed");
        for (size_t i = 0; i < sizeof(seeds) / sizeof(seeds[0]); i++) {
                char path[4096];
                snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
                FILE *f = fopen(path, "wb");
                if (!f || fwrite(seeds[i].b, 1, seeds[i].n, f) != seeds[i].n || fclose(f) != 0) {
                        perror(path);
                        return 1;
                }
                free(seeds[i].b);
        }
        return 0;
}

int main(int argc, char **argv) {
        if (argc == 3 && strcmp(argv[1], "--write-seeds") == 0)
                return write_seeds(argv[2]);
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(reader_reads_string_arrays_in_place),
                cmocka_unit_test(reader_indexes_every_key_and_tensor),
                cmocka_unit_test(reader_refuses_every_truncation),
                cmocka_unit_test(reader_refuses_lying_counts),
                cmocka_unit_test(reader_refuses_duplicates_and_bad_values),
                cmocka_unit_test(reader_refuses_tensors_outside_the_file),
                cmocka_unit_test(llama_refuses_another_architecture_by_name),
                cmocka_unit_test(llama_refuses_a_missing_or_misshapen_tensor),
                cmocka_unit_test(llama_forward_matches_a_hand_computation),
                cmocka_unit_test(llama_refuses_a_context_length_past_what_the_engine_holds),
                cmocka_unit_test(every_number_in_the_file_at_its_limits_is_refused_or_held),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
