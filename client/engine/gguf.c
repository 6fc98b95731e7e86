/* gguf.c - the GGUF reader (gguf.h): one pass over the header, metadata and tensor infos that
 * checks every field against the file, then an index the accessors read.
 *
 * Invariants: after gguf_open, every gguf_str, array and tensor data pointer lies inside the
 * mapping, every string array has its element offsets precomputed (so element i is O(1)), and
 * keys and tensor names are unique. Nothing is read from the file after gguf_open returns.
 *
 * The parse is a cursor over [0, len) whose every read checks the bytes left first; a count read
 * from the file (keys, tensors, array elements) is checked against the bytes that remain before
 * anything is allocated for it, so a lying count cannot make the reader allocate more than the
 * file could describe. Nested arrays are walked (depth at most GGUF_MAX_DEPTH) and indexed by
 * count only: no key this project reads is one.
 *
 * Rejected alternatives: reading the file with read() into the heap (a 100 MB model would be
 * copied for nothing; mmap also lets several processes share the pages); a hash table for the
 * lookups (a model has tens of keys and hundreds of tensors, looked up once at load).
 */
#define _GNU_SOURCE
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qtype.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf.c reads little-endian files in place and needs a little-endian host"
#endif

#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_DEPTH         4

struct gguf {
        const uint8_t *base;
        uint64_t len;
        bool mapped; /* base is our mmap */
        uint32_t version;
        uint64_t n_kv, n_tensors;
        struct gguf_kv *kv;
        struct gguf_tensor *tensors;
        uint64_t **str_offsets; /* per kv: the string array's element offsets, or NULL */
        uint32_t alignment;
        uint64_t data_offset;
};

struct cursor {
        const uint8_t *base;
        uint64_t pos, len;
        char *why;
        size_t why_len;
};

static int fail(struct cursor *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static int fail(struct cursor *c, int code, const char *fmt, ...) {
        if (c->why && c->why_len) {
                char msg[256];
                va_list ap;
                va_start(ap, fmt);
                vsnprintf(msg, sizeof(msg), fmt, ap);
                va_end(ap);
                snprintf(c->why, c->why_len, "gguf: %s (at byte %llu)", msg, (unsigned long long)c->pos);
        }
        return code;
}

static uint64_t left(const struct cursor *c) {
        return c->len - c->pos;
}

static int take(struct cursor *c, uint64_t n, const uint8_t **ret) {
        if (n > left(c))
                return fail(c, -EINVAL, "truncated: %llu bytes wanted, %llu left", (unsigned long long)n,
                            (unsigned long long)left(c));
        *ret = c->base + c->pos;
        c->pos += n;
        return 0;
}

static int rd_u32(struct cursor *c, uint32_t *ret) {
        const uint8_t *p = NULL;
        int r = take(c, 4, &p);
        if (r == 0)
                memcpy(ret, p, 4);
        return r;
}

static int rd_u64(struct cursor *c, uint64_t *ret) {
        const uint8_t *p = NULL;
        int r = take(c, 8, &p);
        if (r == 0)
                memcpy(ret, p, 8);
        return r;
}

static int rd_str(struct cursor *c, struct gguf_str *ret) {
        uint64_t n = 0;
        const uint8_t *p = NULL;
        int r = rd_u64(c, &n);
        if (r < 0)
                return r;
        if (n > GGUF_MAX_STRING)
                return fail(c, -EOVERFLOW, "a string of %llu bytes", (unsigned long long)n);
        if ((r = take(c, n, &p)) < 0)
                return r;
        ret->s = (const char *)p;
        ret->len = n;
        return 0;
}

size_t gguf_type_size(enum gguf_type t) {
        static const uint8_t sizes[GGUF_TYPE_COUNT] = { 1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8 };
        return (unsigned)t < GGUF_TYPE_COUNT ? sizes[t] : 0;
}

const char *gguf_type_name(enum gguf_type t) {
        static const char *const names[GGUF_TYPE_COUNT] = { "uint8",  "int8",    "uint16", "int16",  "uint32",
                                                            "int32",  "float32", "bool",   "string", "array",
                                                            "uint64", "int64",   "float64" };
        return (unsigned)t < GGUF_TYPE_COUNT ? names[t] : "unknown";
}

/* Reads one scalar of type t into v (widened). */
static int rd_scalar(struct cursor *c, enum gguf_type t, struct gguf_value *v) {
        const uint8_t *p = NULL;
        int r = take(c, gguf_type_size(t), &p);
        if (r < 0)
                return r;
        switch (t) {
        case GGUF_TYPE_UINT8: v->u64 = p[0]; break;
        case GGUF_TYPE_BOOL:
                if (p[0] > 1)
                        return fail(c, -EINVAL, "a bool of value %u", p[0]);
                v->u64 = p[0];
                break;
        case GGUF_TYPE_INT8: v->i64 = (int8_t)p[0]; break;
        case GGUF_TYPE_UINT16: {
                uint16_t x;
                memcpy(&x, p, 2);
                v->u64 = x;
                break;
        }
        case GGUF_TYPE_INT16: {
                int16_t x;
                memcpy(&x, p, 2);
                v->i64 = x;
                break;
        }
        case GGUF_TYPE_UINT32: {
                uint32_t x;
                memcpy(&x, p, 4);
                v->u64 = x;
                break;
        }
        case GGUF_TYPE_INT32: {
                int32_t x;
                memcpy(&x, p, 4);
                v->i64 = x;
                break;
        }
        case GGUF_TYPE_FLOAT32: {
                float x;
                memcpy(&x, p, 4);
                v->f64 = x;
                break;
        }
        case GGUF_TYPE_UINT64: memcpy(&v->u64, p, 8); break;
        case GGUF_TYPE_INT64: memcpy(&v->i64, p, 8); break;
        case GGUF_TYPE_FLOAT64: memcpy(&v->f64, p, 8); break;
        default: return fail(c, -EINVAL, "value type %u is not a scalar", (unsigned)t);
        }
        return 0;
}

static int rd_value(struct cursor *c, enum gguf_type t, struct gguf_value *v, uint64_t **ret_offsets,
                    int depth);

/* An array: element type, count, elements. String arrays get their offsets indexed (when
 * ret_offsets is not NULL); nested arrays are walked. */
static int rd_array(struct cursor *c, struct gguf_value *v, uint64_t **ret_offsets, int depth) {
        uint32_t et = 0;
        uint64_t n = 0;
        int r;
        if (depth >= GGUF_MAX_DEPTH)
                return fail(c, -EINVAL, "arrays nested deeper than %d", GGUF_MAX_DEPTH);
        if ((r = rd_u32(c, &et)) < 0 || (r = rd_u64(c, &n)) < 0)
                return r;
        if (et >= GGUF_TYPE_COUNT)
                return fail(c, -EINVAL, "array of unknown type %u", et);
        if (n > GGUF_MAX_ARRAY)
                return fail(c, -EOVERFLOW, "an array of %llu elements", (unsigned long long)n);
        v->arr.elem_type = et;
        v->arr.n = n;
        v->arr.data = c->base + c->pos;
        v->arr.str_offsets = NULL;
        size_t es = gguf_type_size(et);
        if (es) { /* fixed-size elements: one bounds check for all */
                const uint8_t *p = NULL;
                if (n > left(c) / es)
                        return fail(c, -EINVAL, "truncated: an array of %llu %s", (unsigned long long)n,
                                    gguf_type_name(et));
                return take(c, n * es, &p);
        }
        /* strings (8 bytes of length at least) and arrays (12 bytes at least) */
        if (n > left(c) / 8)
                return fail(c, -EINVAL, "truncated: an array of %llu %s", (unsigned long long)n,
                            gguf_type_name(et));
        uint64_t *offs = NULL;
        if (et == GGUF_TYPE_STRING && ret_offsets && n && !(offs = malloc(n * sizeof(*offs))))
                return -ENOMEM;
        for (uint64_t i = 0; i < n; i++) {
                struct gguf_value e = { .type = et };
                if (offs)
                        offs[i] = c->pos;
                if ((r = rd_value(c, et, &e, NULL, depth + 1)) < 0) {
                        free(offs);
                        return r;
                }
        }
        if (ret_offsets)
                *ret_offsets = offs;
        v->arr.str_offsets = offs;
        return 0;
}

static int rd_value(struct cursor *c, enum gguf_type t, struct gguf_value *v, uint64_t **ret_offsets,
                    int depth) {
        v->type = t;
        if (t == GGUF_TYPE_STRING)
                return rd_str(c, &v->str);
        if (t == GGUF_TYPE_ARRAY)
                return rd_array(c, v, ret_offsets, depth);
        if (t >= GGUF_TYPE_COUNT)
                return fail(c, -EINVAL, "value of unknown type %u", (unsigned)t);
        return rd_scalar(c, t, v);
}

static bool str_same(struct gguf_str a, struct gguf_str b) {
        return a.len == b.len && memcmp(a.s, b.s, a.len) == 0;
}

bool gguf_str_eq(struct gguf_str s, const char *c) {
        size_t n = strlen(c);
        return s.len == n && memcmp(s.s, c, n) == 0;
}

static int parse_kv(struct gguf *g, struct cursor *c) {
        for (uint64_t i = 0; i < g->n_kv; i++) {
                struct gguf_kv *kv = &g->kv[i];
                uint32_t t = 0;
                int r = rd_str(c, &kv->key);
                if (r < 0 || (r = rd_u32(c, &t)) < 0)
                        return r;
                if (kv->key.len == 0)
                        return fail(c, -EINVAL, "metadata key %llu is empty", (unsigned long long)i);
                for (uint64_t j = 0; j < i; j++)
                        if (str_same(g->kv[j].key, kv->key))
                                return fail(c, -EINVAL, "metadata key %.*s twice", (int)kv->key.len,
                                            kv->key.s);
                if ((r = rd_value(c, (enum gguf_type)t, &kv->value, &g->str_offsets[i], 0)) < 0)
                        return r;
        }
        return 0;
}

static int parse_tensor_infos(struct gguf *g, struct cursor *c) {
        for (uint64_t i = 0; i < g->n_tensors; i++) {
                struct gguf_tensor *t = &g->tensors[i];
                int r = rd_str(c, &t->name);
                if (r < 0 || (r = rd_u32(c, &t->n_dims)) < 0)
                        return r;
                if (t->n_dims == 0 || t->n_dims > GGUF_MAX_DIMS)
                        return fail(c, -EINVAL, "tensor %.*s has %u dimensions", (int)t->name.len, t->name.s,
                                    t->n_dims);
                for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++)
                        t->ne[d] = 1;
                for (uint32_t d = 0; d < t->n_dims; d++)
                        if ((r = rd_u64(c, &t->ne[d])) < 0)
                                return r;
                if ((r = rd_u32(c, &t->type)) < 0 || (r = rd_u64(c, &t->offset)) < 0)
                        return r;
                for (uint64_t j = 0; j < i; j++)
                        if (str_same(g->tensors[j].name, t->name))
                                return fail(c, -EINVAL, "tensor %.*s twice", (int)t->name.len, t->name.s);
        }
        return 0;
}

/* Sizes and places of the tensors, once the data section's start is known. */
static int check_tensors(struct gguf *g, struct cursor *c) {
        for (uint64_t i = 0; i < g->n_tensors; i++) {
                struct gguf_tensor *t = &g->tensors[i];
                const struct qtype *q = qtype_of(t->type);
                int nl = (int)t->name.len;
                if (!q)
                        return fail(c, -EINVAL, "tensor %.*s has unknown type %u", nl, t->name.s, t->type);
                uint64_t n = 1;
                for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
                        if (t->ne[d] == 0 || t->ne[d] > (UINT64_MAX >> 1) / n)
                                return fail(c, -EINVAL, "tensor %.*s: dimension %u of %llu", nl, t->name.s, d,
                                            (unsigned long long)t->ne[d]);
                        n *= t->ne[d];
                }
                if (t->ne[0] % q->block)
                        return fail(c, -EINVAL, "tensor %.*s: rows of %llu are not whole %s blocks of %u", nl,
                                    t->name.s, (unsigned long long)t->ne[0], q->name, q->block);
                t->n_elements = n;
                uint64_t blocks = n / q->block;
                if (blocks > UINT64_MAX / q->bytes)
                        return fail(c, -EINVAL, "tensor %.*s is too large", nl, t->name.s);
                t->n_bytes = blocks * q->bytes;
                uint64_t room = g->len - g->data_offset;
                if (t->offset % g->alignment || t->offset > room || t->n_bytes > room - t->offset)
                        return fail(c, -EINVAL,
                                    "tensor %.*s: %llu bytes at data offset %llu lie outside the file", nl,
                                    t->name.s, (unsigned long long)t->n_bytes, (unsigned long long)t->offset);
                t->data = g->base + g->data_offset + t->offset;
        }
        return 0;
}

static int parse(struct gguf *g, char *why, size_t why_len) {
        struct cursor c = { .base = g->base, .len = g->len, .why = why, .why_len = why_len };
        uint32_t magic = 0;
        int r = rd_u32(&c, &magic);
        if (r < 0 || (r = rd_u32(&c, &g->version)) < 0)
                return r;
        if (magic != GGUF_MAGIC)
                return fail(&c, -EINVAL, "not a GGUF file (magic %08x)", magic);
        if (g->version != 2 && g->version != 3)
                return fail(&c, -EINVAL, "version %u (2 and 3 are read)", g->version);
        if ((r = rd_u64(&c, &g->n_tensors)) < 0 || (r = rd_u64(&c, &g->n_kv)) < 0)
                return r;
        if (g->n_tensors > GGUF_MAX_TENSORS || g->n_kv > GGUF_MAX_KV)
                return fail(&c, -EOVERFLOW, "%llu tensors and %llu keys", (unsigned long long)g->n_tensors,
                            (unsigned long long)g->n_kv);
        /* a key takes 12 bytes at least, a tensor info 24 */
        if (g->n_kv > left(&c) / 12 || g->n_tensors > left(&c) / 24)
                return fail(&c, -EINVAL, "truncated: %llu keys and %llu tensors cannot fit",
                            (unsigned long long)g->n_kv, (unsigned long long)g->n_tensors);
        g->kv = calloc(g->n_kv ? g->n_kv : 1, sizeof(*g->kv));
        g->str_offsets = calloc(g->n_kv ? g->n_kv : 1, sizeof(*g->str_offsets));
        g->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof(*g->tensors));
        if (!g->kv || !g->str_offsets || !g->tensors)
                return -ENOMEM;
        if ((r = parse_kv(g, &c)) < 0 || (r = parse_tensor_infos(g, &c)) < 0)
                return r;
        g->alignment = GGUF_DEFAULT_ALIGNMENT;
        const struct gguf_value *a = gguf_find(g, "general.alignment");
        if (a) {
                if (a->type != GGUF_TYPE_UINT32 || a->u64 == 0 || (a->u64 & (a->u64 - 1)) ||
                    a->u64 > 1u << 20)
                        return fail(&c, -EINVAL, "general.alignment is not a power of two of type uint32");
                g->alignment = (uint32_t)a->u64;
        }
        uint64_t off = (c.pos + g->alignment - 1) / g->alignment * g->alignment;
        if (off > g->len && g->n_tensors)
                return fail(&c, -EINVAL, "truncated: no data section");
        g->data_offset = off > g->len ? g->len : off;
        return check_tensors(g, &c);
}

static int open_common(struct gguf *g, struct gguf **ret, char *why, size_t why_len) {
        int r = parse(g, why, why_len);
        if (r < 0) {
                gguf_free(g);
                return r;
        }
        *ret = g;
        return 0;
}

int gguf_open_buffer(const void *data, size_t len, struct gguf **ret, char *why, size_t why_len) {
        struct gguf *g = calloc(1, sizeof(*g));
        if (!g)
                return -ENOMEM;
        g->base = data;
        g->len = len;
        return open_common(g, ret, why, why_len);
}

int gguf_open(const char *path, struct gguf **ret, char *why, size_t why_len) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) < 0) {
                int e = -errno;
                if (why && why_len)
                        snprintf(why, why_len, "%s: %s", path, strerror(-e));
                if (fd >= 0)
                        close(fd);
                return e;
        }
        if (!S_ISREG(st.st_mode) || st.st_size < 24) {
                close(fd);
                if (why && why_len)
                        snprintf(why, why_len, "%s: not a GGUF file (%s)", path,
                                 S_ISREG(st.st_mode) ? "too short" : "not a regular file");
                return -EINVAL;
        }
        void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        int e = p == MAP_FAILED ? -errno : 0;
        close(fd);
        if (e < 0) {
                if (why && why_len)
                        snprintf(why, why_len, "%s: mmap: %s", path, strerror(-e));
                return e;
        }
        struct gguf *g = calloc(1, sizeof(*g));
        if (!g) {
                munmap(p, (size_t)st.st_size);
                return -ENOMEM;
        }
        g->base = p;
        g->len = (uint64_t)st.st_size;
        g->mapped = true;
        return open_common(g, ret, why, why_len);
}

struct gguf *gguf_free(struct gguf *g) {
        if (!g)
                return NULL;
        for (uint64_t i = 0; g->str_offsets && i < g->n_kv; i++)
                free(g->str_offsets[i]);
        free(g->str_offsets);
        free(g->kv);
        free(g->tensors);
        if (g->mapped)
                munmap((void *)g->base, g->len);
        free(g);
        return NULL;
}

uint32_t gguf_version(const struct gguf *g) {
        return g->version;
}

uint64_t gguf_n_kv(const struct gguf *g) {
        return g->n_kv;
}

const struct gguf_kv *gguf_kv_at(const struct gguf *g, uint64_t i) {
        return i < g->n_kv ? &g->kv[i] : NULL;
}

uint64_t gguf_n_tensors(const struct gguf *g) {
        return g->n_tensors;
}

const struct gguf_tensor *gguf_tensor_at(const struct gguf *g, uint64_t i) {
        return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const struct gguf_value *gguf_find(const struct gguf *g, const char *key) {
        for (uint64_t i = 0; i < g->n_kv; i++)
                if (gguf_str_eq(g->kv[i].key, key))
                        return &g->kv[i].value;
        return NULL;
}

const struct gguf_tensor *gguf_find_tensor(const struct gguf *g, const char *name) {
        for (uint64_t i = 0; i < g->n_tensors; i++)
                if (gguf_str_eq(g->tensors[i].name, name))
                        return &g->tensors[i];
        return NULL;
}

static bool is_unsigned(enum gguf_type t) {
        return t == GGUF_TYPE_UINT8 || t == GGUF_TYPE_UINT16 || t == GGUF_TYPE_UINT32 ||
               t == GGUF_TYPE_UINT64;
}

static bool is_signed(enum gguf_type t) {
        return t == GGUF_TYPE_INT8 || t == GGUF_TYPE_INT16 || t == GGUF_TYPE_INT32 || t == GGUF_TYPE_INT64;
}

int gguf_get_u64(const struct gguf *g, const char *key, uint64_t *ret) {
        const struct gguf_value *v = gguf_find(g, key);
        if (!v)
                return -ENOENT;
        if (is_unsigned(v->type))
                *ret = v->u64;
        else if (is_signed(v->type) && v->i64 >= 0)
                *ret = (uint64_t)v->i64;
        else
                return -EINVAL;
        return 0;
}

int gguf_get_u32(const struct gguf *g, const char *key, uint32_t *ret) {
        uint64_t x;
        int r = gguf_get_u64(g, key, &x);
        if (r < 0)
                return r;
        if (x > UINT32_MAX)
                return -EINVAL;
        *ret = (uint32_t)x;
        return 0;
}

int gguf_get_f64(const struct gguf *g, const char *key, double *ret) {
        const struct gguf_value *v = gguf_find(g, key);
        if (!v)
                return -ENOENT;
        if (v->type != GGUF_TYPE_FLOAT32 && v->type != GGUF_TYPE_FLOAT64)
                return -EINVAL;
        *ret = v->f64;
        return 0;
}

int gguf_get_bool(const struct gguf *g, const char *key, bool *ret) {
        const struct gguf_value *v = gguf_find(g, key);
        if (!v)
                return -ENOENT;
        if (v->type != GGUF_TYPE_BOOL)
                return -EINVAL;
        *ret = v->u64 != 0;
        return 0;
}

int gguf_get_str(const struct gguf *g, const char *key, struct gguf_str *ret) {
        const struct gguf_value *v = gguf_find(g, key);
        if (!v)
                return -ENOENT;
        if (v->type != GGUF_TYPE_STRING)
                return -EINVAL;
        *ret = v->str;
        return 0;
}

int gguf_get_array(const struct gguf *g, const char *key, const struct gguf_value **ret) {
        const struct gguf_value *v = gguf_find(g, key);
        if (!v)
                return -ENOENT;
        if (v->type != GGUF_TYPE_ARRAY)
                return -EINVAL;
        *ret = v;
        return 0;
}

struct gguf_str gguf_array_str(const struct gguf_value *v, uint64_t i) {
        struct gguf_str s = { "", 0 };
        if (v->type != GGUF_TYPE_ARRAY || v->arr.elem_type != GGUF_TYPE_STRING || i >= v->arr.n ||
            !v->arr.str_offsets)
                return s;
        /* the data pointer is element 0; offsets are from the file's start */
        const uint8_t *file = v->arr.data - v->arr.str_offsets[0];
        const uint8_t *p = file + v->arr.str_offsets[i];
        memcpy(&s.len, p, 8);
        s.s = (const char *)p + 8;
        return s;
}

int32_t gguf_array_i32(const struct gguf_value *v, uint64_t i) {
        int32_t x = 0;
        if (v->type == GGUF_TYPE_ARRAY && i < v->arr.n && gguf_type_size(v->arr.elem_type) == 4)
                memcpy(&x, v->arr.data + 4 * i, 4);
        return x;
}

float gguf_array_f32(const struct gguf_value *v, uint64_t i) {
        float x = 0;
        if (v->type == GGUF_TYPE_ARRAY && i < v->arr.n && v->arr.elem_type == GGUF_TYPE_FLOAT32)
                memcpy(&x, v->arr.data + 4 * i, 4);
        return x;
}
