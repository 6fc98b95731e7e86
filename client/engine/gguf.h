/* gguf.h - the GGUF file format (versions 2 and 3), read-only: the format llama.cpp and most
 * published checkpoints use.
 *
 * Owns: struct gguf, a validated index of one file: its metadata key/values (every GGUF value
 * type, arrays included) and its tensor infos (name, shape, type, where the data lies), with the
 * tensor data mapped read-only (mmap of the file, or a caller's buffer for the fuzzer).
 *
 * Trust: the file is untrusted input. gguf_open checks every count, string length, array length,
 * dimension, offset and size against the file before anything is indexed: a truncated, lying or
 * hostile file gets -EINVAL (or -EOVERFLOW for sizes past the limits below) and a message in why,
 * never a read outside the file. After gguf_open succeeds, every pointer the accessors return lies
 * inside the mapping, and every tensor's [data, data + n_bytes) lies inside the file.
 *
 * What is not interpreted here: the meaning of keys (llama.c reads "llama.*", bpe.c
 * "tokenizer.*"), and tensor types beyond their block size and bytes (qtype.h). A tensor of a type
 * this project has no row for is indexed (its size known from ggml's table) but refused by name
 * when a reader asks for it.
 *
 * Not thread-safe for writing; a struct gguf is immutable after gguf_open, so readers in several
 * threads may share it.
 */
#ifndef KVC_ENGINE_GGUF_H
#define KVC_ENGINE_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define GGUF_MAGIC       0x46554747u /* "GGUF" little-endian */
#define GGUF_MAX_DIMS    4
#define GGUF_MAX_KV      (1u << 16) /* metadata entries */
#define GGUF_MAX_TENSORS (1u << 16)
#define GGUF_MAX_STRING  (1u << 20) /* bytes of one string (a key, a value, a name) */
#define GGUF_MAX_ARRAY   (1u << 24) /* elements of one array (a vocabulary of 16M tokens) */

enum gguf_type {
        GGUF_TYPE_UINT8 = 0,
        GGUF_TYPE_INT8 = 1,
        GGUF_TYPE_UINT16 = 2,
        GGUF_TYPE_INT16 = 3,
        GGUF_TYPE_UINT32 = 4,
        GGUF_TYPE_INT32 = 5,
        GGUF_TYPE_FLOAT32 = 6,
        GGUF_TYPE_BOOL = 7,
        GGUF_TYPE_STRING = 8,
        GGUF_TYPE_ARRAY = 9,
        GGUF_TYPE_UINT64 = 10,
        GGUF_TYPE_INT64 = 11,
        GGUF_TYPE_FLOAT64 = 12,
        GGUF_TYPE_COUNT
};

/* A string inside the mapping: not NUL-terminated. */
struct gguf_str {
        const char *s;
        uint64_t len;
};

/* One metadata value. Scalars are widened into the union; an array points into the mapping:
 * elem_type is its element type, n its count; elements of fixed size lie at data (unaligned
 * little-endian), strings are reached with gguf_array_str. */
struct gguf_value {
        enum gguf_type type;
        union {
                uint64_t u64; /* every unsigned integer and bool */
                int64_t i64;  /* every signed integer */
                double f64;   /* float32 and float64 */
                struct gguf_str str;
                struct {
                        enum gguf_type elem_type;
                        uint64_t n;
                        const uint8_t *data;
                        const uint64_t *str_offsets; /* string arrays: offset of element i in the file */
                } arr;
        };
};

struct gguf_kv {
        struct gguf_str key;
        struct gguf_value value;
};

struct gguf_tensor {
        struct gguf_str name;
        uint32_t n_dims;
        uint64_t ne[GGUF_MAX_DIMS]; /* ne[0] is the row length (contiguous); unused dims are 1 */
        uint32_t type;              /* ggml's type number (qtype.h names the supported ones) */
        uint64_t n_elements;
        uint64_t n_bytes;
        uint64_t offset;     /* from the start of the data section */
        const uint8_t *data; /* inside the mapping */
};

struct gguf;

/* Opens and validates path; the data is mapped read-only with mmap and stays mapped until
 * gguf_free. -ENOENT/-EACCES/... from open, -EINVAL for a malformed file, -EOVERFLOW past the
 * limits above, -ENOMEM; why (when not NULL) says what and where. */
int gguf_open(const char *path, struct gguf **ret, char *why, size_t why_len);
/* The same checks on a buffer that stays the caller's and must outlive the struct gguf. */
int gguf_open_buffer(const void *data, size_t len, struct gguf **ret, char *why, size_t why_len);
struct gguf *gguf_free(struct gguf *g);

uint32_t gguf_version(const struct gguf *g);
uint64_t gguf_n_kv(const struct gguf *g);
const struct gguf_kv *gguf_kv_at(const struct gguf *g, uint64_t i);
uint64_t gguf_n_tensors(const struct gguf *g);
const struct gguf_tensor *gguf_tensor_at(const struct gguf *g, uint64_t i);

/* Lookups by name; NULL when absent. */
const struct gguf_value *gguf_find(const struct gguf *g, const char *key);
const struct gguf_tensor *gguf_find_tensor(const struct gguf *g, const char *name);

/* Typed reads of a key: 0, -ENOENT when absent, -EINVAL when of another kind (any integer type
 * reads as an integer if it fits; float32 and float64 read as double). */
int gguf_get_u64(const struct gguf *g, const char *key, uint64_t *ret);
int gguf_get_u32(const struct gguf *g, const char *key, uint32_t *ret);
int gguf_get_f64(const struct gguf *g, const char *key, double *ret);
int gguf_get_bool(const struct gguf *g, const char *key, bool *ret);
int gguf_get_str(const struct gguf *g, const char *key, struct gguf_str *ret);
/* An array key: its element type and count; -EINVAL when the key is not an array. */
int gguf_get_array(const struct gguf *g, const char *key, const struct gguf_value **ret);

/* Element i of an array of strings (i < arr.n). */
struct gguf_str gguf_array_str(const struct gguf_value *v, uint64_t i);
/* Element i of an array of 32-bit integers or floats, read unaligned. */
int32_t gguf_array_i32(const struct gguf_value *v, uint64_t i);
float gguf_array_f32(const struct gguf_value *v, uint64_t i);

/* Whether a string equals a C string. */
bool gguf_str_eq(struct gguf_str s, const char *c);

/* The size of one value type in the file (0 for strings and arrays). */
size_t gguf_type_size(enum gguf_type t);
const char *gguf_type_name(enum gguf_type t);

#endif
