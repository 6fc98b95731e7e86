/* bpe.c - byte-level BPE: vocabulary loading, special-token partition, the GPT-2 pre-tokenizer as a
 * hand-written scanner, rank-ordered merges, decoding.
 *
 * Owns: struct bpe. Each token's bytes (decoded from the byte-to-unicode alphabet once, at load)
 * live in one blob; tok_map is an open-addressing table bytes -> id, merge_map one (left id, right
 * id) -> (rank, merged id), both at most half full. Merges work on ids, not strings: bpe_new
 * resolves every merge "a b" to the ids of a, b and ab, so a merge is one hash probe.
 *
 * The merge loop of one pre-token keeps its symbols as a doubly linked list over the byte
 * positions and the candidate pairs in a binary min-heap ordered by (rank, position): popping the
 * minimum is the choice of llama.cpp's and Hugging Face's loops (lowest rank, then leftmost). An
 * entry remembers the two ids it was made for and is dropped when popped if either symbol has
 * changed since, so each merge costs O(log n) and a pre-token of n bytes O(n log n): a hostile
 * run of a megabyte of punctuation (one pre-token) stays fast. Rejected: rescanning all pairs
 * after each merge (quadratic), and a cache of whole words (not needed at these speeds, and a
 * cache that grows with the input is one more limit to police).
 *
 * The pre-tokenizer follows llama.cpp's hand-written GPT-2 splitter (unicode.cpp), not a regex
 * engine: at each position try the contractions, then " ?" plus a run of letters, of numbers, or
 * of "other" code points; else a whitespace run, which leaves its last character to the next
 * pre-token when a non-space follows (\s+(?!\S)). A fragment's ends are hard boundaries (specials
 * and, for smollm, each number code point cut first). Code point classes come from
 * unicode_tables.c by binary search, ASCII from a 128-entry table.
 *
 * Special tokens are cut as llama.cpp does: one pass per special token, longest first (then
 * lowest id), each splitting every plain fragment at its leftmost occurrences. This differs from a
 * single leftmost-longest scan only for overlapping specials, but it is the reference's answer. A
 * 64K-bit table of the text's byte pairs skips the passes of tokens that cannot occur.
 */
#define _GNU_SOURCE /* memmem */
#include "bpe.h"

#include "gguf.h"
#include "unicode_tables.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BPE_NONE UINT32_MAX

struct bpe_merge_slot {
        uint64_t key; /* left << 32 | right; BPE_MERGE_EMPTY when free */
        uint32_t rank;
        int32_t merged;
};
#define BPE_MERGE_EMPTY UINT64_MAX

struct bpe {
        int32_t n_tokens;
        uint8_t *types; /* [n_tokens] */
        uint64_t *offs; /* [n_tokens + 1] into blob */
        char *blob;
        int32_t *tok_map; /* [tok_mask + 1], -1 empty */
        uint64_t tok_mask;
        struct bpe_merge_slot *merge_map; /* [merge_mask + 1] */
        uint64_t merge_mask;
        int32_t byte_id[256]; /* the token of each byte alone; -ENOENT when the vocabulary has none */
        int32_t *specials;    /* ids of control, user-defined, unknown tokens by (length desc, id) */
        size_t n_specials;
        enum bpe_pre pre;
        int32_t bos_id, eos_id, unk_id, pad_id;
        bool add_bos;
};

static void bpe_why(char *why, size_t why_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void bpe_why(char *why, size_t why_len, const char *fmt, ...) {
        va_list ap;

        if (!why || !why_len)
                return;
        va_start(ap, fmt);
        vsnprintf(why, why_len, fmt, ap);
        va_end(ap);
}

/* ---- GPT-2's byte-to-unicode alphabet ---- */

/* Bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for themselves; the other 68 bytes, in order,
 * become U+0100..U+0143. Returns the byte for code point cp, or -1 outside the alphabet. */
static int bpe_unicode_to_byte(uint32_t cp) {
        static int16_t inv[256 + 68];
        static bool ready;

        if (!ready) { /* idempotent: racing threads write the same values */
                int k = 0;

                for (int c = 0; c < 256 + 68; c++)
                        inv[c] = -1;
                for (int byte = 0; byte < 256; byte++) {
                        bool self = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) ||
                                    (byte >= 0xAE);
                        inv[self ? byte : 256 + k++] = (int16_t)byte;
                }
                __atomic_store_n(&ready, true, __ATOMIC_RELEASE);
        }
        return cp < 256 + 68 ? inv[cp] : -1;
}

/* One strict UTF-8 character at p[0..n), n >= 1: its length, *cp set; 0 for an invalid sequence
 * (overlong, surrogate, above U+10FFFF, truncated, stray continuation). */
static size_t bpe_utf8_decode(const unsigned char *p, size_t n, uint32_t *cp) {
        uint32_t c = p[0], min;
        size_t len;

        if (c < 0x80) {
                *cp = c;
                return 1;
        }
        if (c >= 0xC2 && c <= 0xDF)
                len = 2, c &= 0x1F, min = 0x80;
        else if (c >= 0xE0 && c <= 0xEF)
                len = 3, c &= 0x0F, min = 0x800;
        else if (c >= 0xF0 && c <= 0xF4)
                len = 4, c &= 0x07, min = 0x10000;
        else
                return 0;
        if (n < len)
                return 0;
        for (size_t i = 1; i < len; i++) {
                if ((p[i] & 0xC0) != 0x80)
                        return 0;
                c = c << 6 | (p[i] & 0x3F);
        }
        if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF))
                return 0;
        *cp = c;
        return len;
}

/* ---- code point classes ---- */

static enum unicode_class bpe_class_of(uint32_t cp) {
        size_t lo = 0, hi = unicode_n_ranges;

        while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;

                if (cp < unicode_ranges[mid].first)
                        hi = mid;
                else if (cp > unicode_ranges[mid].last)
                        lo = mid + 1;
                else
                        return (enum unicode_class)unicode_ranges[mid].cls;
        }
        return UNICODE_CLASS_OTHER;
}

/* The class of the character at text[pos] within [.., end), its byte length in *len; CLS_END at
 * or past end (llama.cpp's OUT_OF_RANGE: a fragment boundary is no character). An invalid byte is
 * one character of class other. */
#define BPE_CLS_END 4
static int bpe_class_at(const unsigned char *text, size_t pos, size_t end, size_t *len) {
        static uint8_t ascii[128];
        static bool ready;
        uint32_t cp;

        if (pos >= end) {
                *len = 0;
                return BPE_CLS_END;
        }
        if (text[pos] < 0x80) {
                if (!ready) {
                        for (uint32_t c = 0; c < 128; c++)
                                ascii[c] = (uint8_t)bpe_class_of(c);
                        __atomic_store_n(&ready, true, __ATOMIC_RELEASE);
                }
                *len = 1;
                return ascii[text[pos]];
        }
        *len = bpe_utf8_decode(text + pos, end - pos, &cp);
        if (!*len) {
                *len = 1;
                return UNICODE_CLASS_OTHER;
        }
        return bpe_class_of(cp);
}

/* ---- hash maps ---- */

static uint64_t bpe_hash_bytes(const char *s, size_t n) {
        uint64_t h = 0xcbf29ce484222325ull;

        for (size_t i = 0; i < n; i++)
                h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
        return h ^ (h >> 29);
}

static uint64_t bpe_hash_u64(uint64_t x) {
        x ^= x >> 30;
        x *= 0xbf58476d1ce4e5b9ull;
        x ^= x >> 27;
        x *= 0x94d049bb133111ebull;
        return x ^ (x >> 31);
}

static bool bpe_tok_eq(const struct bpe *b, int32_t id, const char *s, size_t n) {
        return b->offs[id + 1] - b->offs[id] == n && !memcmp(b->blob + b->offs[id], s, n);
}

int32_t bpe_find(const struct bpe *b, const char *bytes, size_t len) {
        uint64_t i;

        if (!b || (!bytes && len))
                return -ENOENT;
        for (i = bpe_hash_bytes(bytes, len) & b->tok_mask; b->tok_map[i] >= 0; i = (i + 1) & b->tok_mask)
                if (bpe_tok_eq(b, b->tok_map[i], bytes, len))
                        return b->tok_map[i];
        return -ENOENT;
}

/* Adds id unless its bytes are already mapped (the first id of a text wins). */
static void bpe_tok_insert(struct bpe *b, int32_t id) {
        const char *s = b->blob + b->offs[id];
        size_t n = b->offs[id + 1] - b->offs[id];
        uint64_t i;

        for (i = bpe_hash_bytes(s, n) & b->tok_mask; b->tok_map[i] >= 0; i = (i + 1) & b->tok_mask)
                if (bpe_tok_eq(b, b->tok_map[i], s, n))
                        return;
        b->tok_map[i] = id;
}

static const struct bpe_merge_slot *bpe_merge_find(const struct bpe *b, int32_t left, int32_t right) {
        uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;

        if (!b->merge_map)
                return NULL;
        for (uint64_t i = bpe_hash_u64(key) & b->merge_mask; b->merge_map[i].key != BPE_MERGE_EMPTY;
             i = (i + 1) & b->merge_mask)
                if (b->merge_map[i].key == key)
                        return &b->merge_map[i];
        return NULL;
}

static void bpe_merge_insert(struct bpe *b, int32_t left, int32_t right, uint32_t rank, int32_t merged) {
        uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
        uint64_t i;

        for (i = bpe_hash_u64(key) & b->merge_mask; b->merge_map[i].key != BPE_MERGE_EMPTY;
             i = (i + 1) & b->merge_mask)
                if (b->merge_map[i].key == key)
                        return;
        b->merge_map[i] = (struct bpe_merge_slot){ key, rank, merged };
}

/* The smallest power of two >= 2 * n (and >= 16). */
static uint64_t bpe_table_size(size_t n) {
        uint64_t size = 16;

        while (size < 2 * (uint64_t)n)
                size <<= 1;
        return size;
}

/* ---- construction ---- */

static bool bpe_type_is_special(int type) {
        return type == BPE_TOKEN_CONTROL || type == BPE_TOKEN_USER_DEFINED || type == BPE_TOKEN_UNKNOWN;
}

/* Decodes s[0..n) from the byte-to-unicode alphabet into out (at least n bytes: every character
 * is one or two bytes and stands for one). Returns the byte count, or -EINVAL. */
static long bpe_unmap(const char *s, size_t n, char *out) {
        const unsigned char *p = (const unsigned char *)s;
        size_t i = 0, o = 0;

        while (i < n) {
                uint32_t cp;
                size_t len = bpe_utf8_decode(p + i, n - i, &cp);
                int byte = len ? bpe_unicode_to_byte(cp) : -1;

                if (byte < 0)
                        return -EINVAL;
                out[o++] = (char)byte;
                i += len;
        }
        return (long)o;
}

struct bpe_special_key {
        uint64_t len;
        int32_t id;
};

/* Longest first, then lowest id. */
static int bpe_special_cmp(const void *x, const void *y) {
        const struct bpe_special_key *a = x, *c = y;

        if (a->len != c->len)
                return a->len > c->len ? -1 : 1;
        return a->id < c->id ? -1 : a->id > c->id;
}

static int bpe_check_id(int32_t id, size_t n_tokens, const char *what, char *why, size_t why_len) {
        if (id < -1 || (id >= 0 && (size_t)id >= n_tokens)) {
                bpe_why(why, why_len, "%s %d outside the vocabulary of %zu tokens", what, id, n_tokens);
                return -EINVAL;
        }
        return 0;
}

/* Fills types, offs and blob from v (texts decoded), then the token map and byte ids. */
static int bpe_load_tokens(struct bpe *b, const struct bpe_vocab *v, char *why, size_t why_len) {
        uint64_t total = 0;

        for (size_t i = 0; i < v->n_tokens; i++) {
                int type = v->types ? v->types[i] : BPE_TOKEN_NORMAL;

                if (type < BPE_TOKEN_UNDEFINED || type > BPE_TOKEN_BYTE) {
                        bpe_why(why, why_len, "token %zu has type %d (not 0..6)", i, type);
                        return -EINVAL;
                }
                if ((!v->tokens[i].s && v->tokens[i].len) || v->tokens[i].len > BPE_MAX_TOKEN_BYTES) {
                        bpe_why(why, why_len, "token %zu: text of %zu bytes", i, v->tokens[i].len);
                        return -EINVAL;
                }
                b->types[i] = (uint8_t)type;
                total += v->tokens[i].len;
        }
        b->blob = malloc(total + 1);
        if (!b->blob)
                return -ENOMEM;
        b->offs[0] = 0;
        for (size_t i = 0; i < v->n_tokens; i++) {
                char *out = b->blob + b->offs[i];
                long n = (long)v->tokens[i].len;

                if (bpe_type_is_special(b->types[i])) {
                        if (n)
                                memcpy(out, v->tokens[i].s, (size_t)n);
                } else if ((n = bpe_unmap(v->tokens[i].s, v->tokens[i].len, out)) < 0) {
                        bpe_why(why, why_len, "token %zu (type %d) is not in the byte-to-unicode alphabet", i,
                                b->types[i]);
                        return -EINVAL;
                }
                b->offs[i + 1] = b->offs[i] + (uint64_t)n;
        }
        b->tok_mask = bpe_table_size(v->n_tokens) - 1;
        b->tok_map = malloc((b->tok_mask + 1) * sizeof(*b->tok_map));
        if (!b->tok_map)
                return -ENOMEM;
        memset(b->tok_map, 0xff, (b->tok_mask + 1) * sizeof(*b->tok_map));
        for (int pass = 0; pass < 2; pass++) /* normal tokens first: they win a shared text */
                for (size_t i = 0; i < v->n_tokens; i++)
                        if (bpe_type_is_special(b->types[i]) == (pass == 1) && b->offs[i + 1] > b->offs[i])
                                bpe_tok_insert(b, (int32_t)i);
        for (int byte = 0; byte < 256; byte++) {
                char c = (char)byte;

                b->byte_id[byte] = bpe_find(b, &c, 1); /* -ENOENT: encode drops the byte */
        }
        return 0;
}

static int bpe_load_merges(struct bpe *b, const struct bpe_vocab *v, char *why, size_t why_len) {
        char *scratch;
        int r = 0;

        if (!v->n_merges)
                return 0;
        b->merge_mask = bpe_table_size(v->n_merges) - 1;
        b->merge_map = malloc((b->merge_mask + 1) * sizeof(*b->merge_map));
        scratch = malloc(2 * (size_t)BPE_MAX_TOKEN_BYTES + 2);
        if (!b->merge_map || !scratch) {
                free(scratch);
                return -ENOMEM;
        }
        for (uint64_t i = 0; i <= b->merge_mask; i++)
                b->merge_map[i].key = BPE_MERGE_EMPTY;
        for (size_t m = 0; m < v->n_merges; m++) {
                const struct bpe_str *s = &v->merges[m];
                const char *sp = s->len > 1 && s->s ? memchr(s->s + 1, ' ', s->len - 1) : NULL;
                long nl, nr;
                int32_t left, right, merged;

                if (!sp || s->len > 2 * (size_t)BPE_MAX_TOKEN_BYTES) {
                        bpe_why(why, why_len, "merge %zu is not \"left right\"", m);
                        r = -EINVAL;
                        break;
                }
                nl = bpe_unmap(s->s, (size_t)(sp - s->s), scratch);
                nr = nl < 0 ? -EINVAL : bpe_unmap(sp + 1, s->len - (size_t)(sp - s->s) - 1, scratch + nl);
                if (nl <= 0 || nr <= 0) {
                        bpe_why(why, why_len, "merge %zu is not two texts in the byte-to-unicode alphabet",
                                m);
                        r = -EINVAL;
                        break;
                }
                left = bpe_find(b, scratch, (size_t)nl);
                right = bpe_find(b, scratch + nl, (size_t)nr);
                merged = bpe_find(b, scratch, (size_t)(nl + nr));
                if (left < 0 || right < 0 || merged < 0) {
                        bpe_why(why, why_len, "merge %zu (\"%.*s\") names a %s not in the vocabulary", m,
                                (int)(s->len < 64 ? s->len : 64), s->s,
                                merged < 0 && left >= 0 && right >= 0 ? "result" : "token");
                        r = -EINVAL;
                        break;
                }
                bpe_merge_insert(b, left, right, (uint32_t)m, merged);
        }
        free(scratch);
        return r;
}

/* b->specials: the non-empty control, user-defined and unknown tokens, longest first. */
static int bpe_sort_specials(struct bpe *b) {
        struct bpe_special_key *keys;
        size_t n = 0;

        for (int32_t i = 0; i < b->n_tokens; i++)
                n += bpe_type_is_special(b->types[i]) && b->offs[i + 1] > b->offs[i];
        keys = malloc((n ? n : 1) * sizeof(*keys));
        if (!keys)
                return -ENOMEM;
        n = 0;
        for (int32_t i = 0; i < b->n_tokens; i++)
                if (bpe_type_is_special(b->types[i]) && b->offs[i + 1] > b->offs[i])
                        keys[n++] = (struct bpe_special_key){ b->offs[i + 1] - b->offs[i], i };
        qsort(keys, n, sizeof(*keys), bpe_special_cmp);
        for (size_t i = 0; i < n; i++)
                b->specials[i] = keys[i].id;
        b->n_specials = n;
        free(keys);
        return 0;
}

int bpe_new(const struct bpe_vocab *v, struct bpe **ret, char *why, size_t why_len) {
        struct bpe *b;
        int r;

        if (!v || !ret || !v->tokens || (!v->merges && v->n_merges))
                return -EINVAL;
        if (!v->n_tokens || v->n_tokens > BPE_MAX_VOCAB || v->n_merges > UINT32_MAX ||
            (v->pre != BPE_PRE_GPT2 && v->pre != BPE_PRE_SMOLLM)) {
                bpe_why(why, why_len, "vocabulary of %zu tokens, %zu merges (1..%d tokens)", v->n_tokens,
                        v->n_merges, BPE_MAX_VOCAB);
                return -EINVAL;
        }
        if ((r = bpe_check_id(v->bos_id, v->n_tokens, "bos id", why, why_len)) ||
            (r = bpe_check_id(v->eos_id, v->n_tokens, "eos id", why, why_len)) ||
            (r = bpe_check_id(v->unk_id, v->n_tokens, "unknown id", why, why_len)) ||
            (r = bpe_check_id(v->pad_id, v->n_tokens, "padding id", why, why_len)))
                return r;
        b = calloc(1, sizeof(*b));
        if (!b)
                return -ENOMEM;
        b->n_tokens = (int32_t)v->n_tokens;
        b->pre = v->pre;
        b->bos_id = v->bos_id;
        b->eos_id = v->eos_id;
        b->unk_id = v->unk_id;
        b->pad_id = v->pad_id;
        b->add_bos = v->add_bos;
        b->types = malloc(v->n_tokens);
        b->offs = malloc((v->n_tokens + 1) * sizeof(*b->offs));
        b->specials = malloc(v->n_tokens * sizeof(*b->specials));
        r = !b->types || !b->offs || !b->specials ? -ENOMEM : bpe_load_tokens(b, v, why, why_len);
        if (!r)
                r = bpe_load_merges(b, v, why, why_len);
        if (r) {
                if (r == -ENOMEM)
                        bpe_why(why, why_len, "out of memory");
                bpe_free(b);
                return r;
        }
        if ((r = bpe_sort_specials(b))) {
                bpe_why(why, why_len, "out of memory");
                bpe_free(b);
                return r;
        }
        *ret = b;
        return 0;
}

struct bpe *bpe_free(struct bpe *b) {
        if (b) {
                free(b->types);
                free(b->offs);
                free(b->blob);
                free(b->tok_map);
                free(b->merge_map);
                free(b->specials);
                free(b);
        }
        return NULL;
}

int32_t bpe_n_vocab(const struct bpe *b) {
        return b->n_tokens;
}
int32_t bpe_bos_id(const struct bpe *b) {
        return b->bos_id;
}
int32_t bpe_eos_id(const struct bpe *b) {
        return b->eos_id;
}
int32_t bpe_unk_id(const struct bpe *b) {
        return b->unk_id;
}
int32_t bpe_pad_id(const struct bpe *b) {
        return b->pad_id;
}
bool bpe_add_bos(const struct bpe *b) {
        return b->add_bos;
}

/* ---- encoding ---- */

struct bpe_sym {
        int32_t id;
        uint32_t prev, next; /* byte positions in the pre-token, BPE_NONE at the ends */
        bool alive;
};

struct bpe_cand {
        uint32_t rank, pos;
        int32_t left, right;
};

struct bpe_work {
        struct bpe_sym *syms;
        struct bpe_cand *heap;
        size_t cap; /* syms: cap; heap: 3 * cap */
        size_t n_heap;
        int32_t *out;
        size_t out_cap, n_out;
};

static int bpe_emit(struct bpe_work *w, int32_t id) {
        if (w->n_out == w->out_cap)
                return -ENOSPC;
        w->out[w->n_out++] = id;
        return 0;
}

static bool bpe_cand_less(const struct bpe_cand *a, const struct bpe_cand *c) {
        return a->rank != c->rank ? a->rank < c->rank : a->pos < c->pos;
}

static void bpe_heap_push(struct bpe_work *w, struct bpe_cand c) {
        size_t i = w->n_heap++;

        while (i && bpe_cand_less(&c, &w->heap[(i - 1) / 2])) {
                w->heap[i] = w->heap[(i - 1) / 2];
                i = (i - 1) / 2;
        }
        w->heap[i] = c;
}

static struct bpe_cand bpe_heap_pop(struct bpe_work *w) {
        struct bpe_cand top = w->heap[0], last = w->heap[--w->n_heap];
        size_t i = 0;

        for (;;) {
                size_t c = 2 * i + 1;

                if (c >= w->n_heap)
                        break;
                if (c + 1 < w->n_heap && bpe_cand_less(&w->heap[c + 1], &w->heap[c]))
                        c++;
                if (!bpe_cand_less(&w->heap[c], &last))
                        break;
                w->heap[i] = w->heap[c];
                i = c;
        }
        if (w->n_heap)
                w->heap[i] = last;
        return top;
}

static void bpe_try_pair(const struct bpe *b, struct bpe_work *w, uint32_t pos) {
        const struct bpe_merge_slot *m;
        uint32_t next;

        if (pos == BPE_NONE || (next = w->syms[pos].next) == BPE_NONE)
                return;
        m = bpe_merge_find(b, w->syms[pos].id, w->syms[next].id);
        if (m)
                bpe_heap_push(w, (struct bpe_cand){ m->rank, pos, w->syms[pos].id, w->syms[next].id });
}

/* BPE of one pre-token s[0..n), n >= 1: the ids are appended to w->out. */
static int bpe_word(const struct bpe *b, struct bpe_work *w, const unsigned char *s, size_t n) {
        if (n == 1)
                return b->byte_id[s[0]] < 0 ? 0 : bpe_emit(w, b->byte_id[s[0]]);
        if (n > w->cap) {
                size_t cap = n < 64 ? 64 : n;
                struct bpe_sym *syms = realloc(w->syms, cap * sizeof(*syms));

                if (!syms)
                        return -ENOMEM;
                w->syms = syms;
                struct bpe_cand *heap = realloc(w->heap, 3 * cap * sizeof(*heap));
                if (!heap)
                        return -ENOMEM;
                w->heap = heap;
                w->cap = cap;
        }
        for (size_t i = 0; i < n; i++)
                w->syms[i] = (struct bpe_sym){ b->byte_id[s[i]], i ? (uint32_t)i - 1 : BPE_NONE,
                                               i + 1 < n ? (uint32_t)i + 1 : BPE_NONE, true };
        w->n_heap = 0;
        for (size_t i = 0; i + 1 < n; i++)
                bpe_try_pair(b, w, (uint32_t)i);
        while (w->n_heap) {
                struct bpe_cand c = bpe_heap_pop(w);
                struct bpe_sym *l = &w->syms[c.pos];
                uint32_t r = l->next;

                if (!l->alive || r == BPE_NONE || l->id != c.left || w->syms[r].id != c.right)
                        continue; /* stale: a symbol changed since this pair was pushed */
                l->id = bpe_merge_find(b, c.left, c.right)->merged;
                w->syms[r].alive = false;
                l->next = w->syms[r].next;
                if (l->next != BPE_NONE)
                        w->syms[l->next].prev = c.pos;
                bpe_try_pair(b, w, l->prev);
                bpe_try_pair(b, w, c.pos);
        }
        for (uint32_t i = 0; i != BPE_NONE; i = w->syms[i].next) {
                int r = w->syms[i].id < 0 ? 0 : bpe_emit(w, w->syms[i].id);

                if (r)
                        return r;
        }
        return 0;
}

/* The GPT-2 regex over s[start..end), each pre-token handed to bpe_word. */
static int bpe_gpt2_split(const struct bpe *b, struct bpe_work *w, const unsigned char *s, size_t start,
                          size_t end) {
        size_t pos = start;

        while (pos < end) {
                size_t q = pos, len, tok_end;
                int cls;

                if (s[pos] == '\'' && pos + 1 < end) {
                        unsigned char c1 = s[pos + 1], c2 = pos + 2 < end ? s[pos + 2] : 0;

                        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
                                tok_end = pos + 2;
                        else if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') ||
                                 (c1 == 'l' && c2 == 'l'))
                                tok_end = pos + 3;
                        else
                                tok_end = 0;
                        if (tok_end) {
                                int r = bpe_word(b, w, s + pos, tok_end - pos);

                                if (r)
                                        return r;
                                pos = tok_end;
                                continue;
                        }
                }
                if (s[pos] == ' ')
                        q = pos + 1;
                cls = bpe_class_at(s, q, end, &len);
                if (cls == UNICODE_CLASS_LETTER || cls == UNICODE_CLASS_NUMBER ||
                    cls == UNICODE_CLASS_OTHER) {
                        int run = cls;

                        while (cls == run) {
                                q += len;
                                cls = bpe_class_at(s, q, end, &len);
                        }
                        tok_end = q;
                } else {
                        size_t r = pos, last = pos, n_space = 0;

                        while (bpe_class_at(s, r, end, &len) == UNICODE_CLASS_SPACE) {
                                last = r;
                                r += len;
                                n_space++;
                        }
                        if (n_space > 1 && r < end)
                                tok_end = last; /* \s+(?!\S): the last space goes with what follows */
                        else if (n_space)
                                tok_end = r;
                        else
                                tok_end = pos + 1; /* unreachable: every character has a class */
                }
                int r = bpe_word(b, w, s + pos, tok_end - pos);
                if (r)
                        return r;
                pos = tok_end;
        }
        return 0;
}

/* One fragment of plain text: the pre-tokenizer of b->pre, then BPE. */
static int bpe_fragment(const struct bpe *b, struct bpe_work *w, const unsigned char *s, size_t start,
                        size_t end) {
        size_t pos = start, piece = start;
        int r;

        if (b->pre == BPE_PRE_GPT2)
                return bpe_gpt2_split(b, w, s, start, end);
        while (pos < end) { /* \p{N}: each number code point is a fragment of its own */
                size_t len;

                if (bpe_class_at(s, pos, end, &len) != UNICODE_CLASS_NUMBER) {
                        pos += len;
                        continue;
                }
                if ((r = bpe_gpt2_split(b, w, s, piece, pos)) || (r = bpe_word(b, w, s + pos, len)))
                        return r;
                pos += len;
                piece = pos;
        }
        return bpe_gpt2_split(b, w, s, piece, end);
}

/* A run of the text: plain (id < 0) or one special token. */
struct bpe_frag {
        size_t start, len;
        int32_t id;
};

/* Cuts the text at the specials' occurrences (see the file comment). *ret gets the fragments. */
static int bpe_partition(const struct bpe *b, const char *text, size_t len, struct bpe_frag **ret,
                         size_t *ret_n) {
        struct bpe_frag *frags = malloc(sizeof(*frags)), *next = NULL;
        size_t n = 1, cap = 1, next_cap = 0;
        uint64_t *pairs = calloc(65536 / 64, sizeof(*pairs));
        int r = 0;

        if (!frags || !pairs) {
                r = -ENOMEM;
                goto out;
        }
        frags[0] = (struct bpe_frag){ 0, len, -1 };
        for (size_t i = 0; i + 1 < len; i++) {
                unsigned k = (unsigned char)text[i] << 8 | (unsigned char)text[i + 1];

                pairs[k / 64] |= 1ull << (k % 64);
        }
        for (size_t k = 0; k < b->n_specials; k++) {
                int32_t id = b->specials[k];
                const char *sp = b->blob + b->offs[id];
                size_t sl = b->offs[id + 1] - b->offs[id], m = 0, need = 0;

                if (sl > len)
                        continue;
                if (sl >= 2) {
                        unsigned key = (unsigned char)sp[0] << 8 | (unsigned char)sp[1];

                        if (!(pairs[key / 64] >> (key % 64) & 1))
                                continue;
                }
                for (size_t i = 0; i < n; i++) { /* the fragments after this pass */
                        const char *p = text + frags[i].start, *e = p + frags[i].len, *hit;

                        need++;
                        while (frags[i].id < 0 && (hit = memmem(p, (size_t)(e - p), sp, sl))) {
                                need += 2;
                                p = hit + sl;
                        }
                }
                if (need == n)
                        continue;
                if (need > next_cap) {
                        struct bpe_frag *bigger = realloc(next, need * sizeof(*next));

                        if (!bigger) {
                                r = -ENOMEM;
                                goto out;
                        }
                        next = bigger;
                        next_cap = need;
                }
                for (size_t i = 0; i < n; i++) {
                        size_t p = frags[i].start, e = p + frags[i].len;
                        const char *hit;

                        if (frags[i].id >= 0) {
                                next[m++] = frags[i];
                                continue;
                        }
                        while ((hit = memmem(text + p, e - p, sp, sl))) {
                                size_t h = (size_t)(hit - text);

                                if (h > p)
                                        next[m++] = (struct bpe_frag){ p, h - p, -1 };
                                next[m++] = (struct bpe_frag){ h, sl, id };
                                p = h + sl;
                        }
                        if (e > p)
                                next[m++] = (struct bpe_frag){ p, e - p, -1 };
                }
                struct bpe_frag *t = frags;
                size_t t_cap = cap;
                frags = next, cap = next_cap, n = m;
                next = t, next_cap = t_cap;
        }
out:
        free(next);
        free(pairs);
        if (r) {
                free(frags);
                return r;
        }
        *ret = frags;
        *ret_n = n;
        return 0;
}

int bpe_encode(const struct bpe *b, const char *text, size_t text_len, bool bos, bool parse_special,
               int32_t *ids, size_t cap, size_t *ret_n) {
        struct bpe_work w = { .out = ids, .out_cap = cap };
        struct bpe_frag one = { 0, text_len, -1 }, *frags = &one;
        size_t n_frags = 1;
        int r = 0;

        if (!b || (!text && text_len) || (!ids && cap) || !ret_n || text_len > BPE_MAX_TEXT_BYTES ||
            (bos && b->bos_id < 0))
                return -EINVAL;
        if (bos && (r = bpe_emit(&w, b->bos_id)))
                return r;
        if (parse_special && b->n_specials && (r = bpe_partition(b, text, text_len, &frags, &n_frags)))
                return r;
        for (size_t i = 0; i < n_frags && !r; i++) {
                if (frags[i].id >= 0)
                        r = bpe_emit(&w, frags[i].id);
                else
                        r = bpe_fragment(b, &w, (const unsigned char *)text, frags[i].start,
                                         frags[i].start + frags[i].len);
        }
        if (frags != &one)
                free(frags);
        free(w.syms);
        free(w.heap);
        if (!r)
                *ret_n = w.n_out;
        return r;
}

/* ---- decoding ---- */

int bpe_token_bytes(const struct bpe *b, int32_t id, const char **ret, size_t *ret_len) {
        if (!b || !ret || !ret_len || id < 0 || id >= b->n_tokens)
                return -EINVAL;
        *ret = b->blob + b->offs[id];
        *ret_len = b->offs[id + 1] - b->offs[id];
        return 0;
}

int bpe_token_type(const struct bpe *b, int32_t id) {
        if (!b || id < 0 || id >= b->n_tokens)
                return -EINVAL;
        return b->types[id];
}

int bpe_decode(const struct bpe *b, const int32_t *ids, size_t n, char *buf, size_t cap, size_t *ret_len) {
        size_t total = 0;

        if (!b || (!ids && n) || !buf || !ret_len)
                return -EINVAL;
        for (size_t i = 0; i < n; i++) {
                if (ids[i] < 0 || ids[i] >= b->n_tokens)
                        return -EINVAL;
                total += b->offs[ids[i] + 1] - b->offs[ids[i]];
        }
        if (cap < total + 1)
                return -ENOSPC;
        total = 0;
        for (size_t i = 0; i < n; i++) {
                size_t len = b->offs[ids[i] + 1] - b->offs[ids[i]];

                memcpy(buf + total, b->blob + b->offs[ids[i]], len);
                total += len;
        }
        buf[total] = '\0';
        *ret_len = total;
        return 0;
}

size_t bpe_utf8_incomplete_tail(const char *buf, size_t len) {
        const unsigned char *p = (const unsigned char *)buf;

        /* look back over at most 3 continuation bytes for a lead byte whose character is cut */
        for (size_t back = 1; back <= 4 && back <= len; back++) {
                unsigned char c = p[len - back];
                size_t need;

                if ((c & 0xC0) == 0x80)
                        continue;
                need = c >= 0xF0 && c <= 0xF4   ? 4
                       : c >= 0xE0 && c <= 0xEF ? 3
                       : c >= 0xC2 && c <= 0xDF ? 2
                                                : 1;
                return need > back ? back : 0;
        }
        return 0;
}

/* ---- GGUF ---- */

struct bpe_pre_row {
        const char *name;
        enum bpe_pre pre;
};

/* tokenizer.ggml.pre values with a row here; llama.cpp maps more names to these two regexes. */
static const struct bpe_pre_row bpe_pre_rows[] = {
        { "gpt-2", BPE_PRE_GPT2 },
        { "smollm", BPE_PRE_SMOLLM },
};

static int bpe_gguf_id(const struct gguf *g, const char *key, int32_t *ret, char *why, size_t why_len) {
        uint32_t v;
        int r = gguf_get_u32(g, key, &v);

        if (r == -ENOENT) {
                *ret = -1;
                return 0;
        }
        if (r || v > INT32_MAX) {
                bpe_why(why, why_len, "%s is not a token id", key);
                return -EINVAL;
        }
        *ret = (int32_t)v;
        return 0;
}

static int bpe_gguf_array(const struct gguf *g, const char *key, enum gguf_type elem,
                          const struct gguf_value **ret, char *why, size_t why_len) {
        int r = gguf_get_array(g, key, ret);

        if (r == -ENOENT) {
                bpe_why(why, why_len, "no %s", key);
                return r;
        }
        if (r || (*ret)->arr.elem_type != elem) {
                bpe_why(why, why_len, "%s is not an array of %s", key, gguf_type_name(elem));
                return -EINVAL;
        }
        return 0;
}

int bpe_from_gguf(const struct gguf *g, struct bpe **ret, char *why, size_t why_len) {
        struct bpe_vocab v = { 0 };
        const struct gguf_value *tokens, *types = NULL, *merges;
        struct gguf_str model, pre;
        struct bpe_str *toks = NULL, *mrg = NULL;
        int32_t *typ = NULL;
        size_t row;
        int r;

        if (!g || !ret)
                return -EINVAL;
        if ((r = gguf_get_str(g, "tokenizer.ggml.model", &model))) {
                bpe_why(why, why_len, "tokenizer.ggml.model: %s", r == -ENOENT ? "absent" : "not a string");
                return r;
        }
        if (!gguf_str_eq(model, "gpt2")) {
                bpe_why(why, why_len, "tokenizer.ggml.model is \"%.*s\", not gpt2 (byte-level BPE)",
                        (int)(model.len < 64 ? model.len : 64), model.s);
                return -ENOTSUP;
        }
        if ((r = gguf_get_str(g, "tokenizer.ggml.pre", &pre))) {
                bpe_why(why, why_len, "tokenizer.ggml.pre: %s", r == -ENOENT ? "absent" : "not a string");
                return r;
        }
        for (row = 0; row < sizeof(bpe_pre_rows) / sizeof(bpe_pre_rows[0]); row++)
                if (gguf_str_eq(pre, bpe_pre_rows[row].name))
                        break;
        if (row == sizeof(bpe_pre_rows) / sizeof(bpe_pre_rows[0])) {
                bpe_why(why, why_len, "tokenizer.ggml.pre \"%.*s\" has no pre-tokenizer here",
                        (int)(pre.len < 64 ? pre.len : 64), pre.s);
                return -ENOTSUP;
        }
        v.pre = bpe_pre_rows[row].pre;
        if ((r = bpe_gguf_array(g, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, &tokens, why, why_len)) ||
            (r = bpe_gguf_array(g, "tokenizer.ggml.merges", GGUF_TYPE_STRING, &merges, why, why_len)))
                return r;
        if (gguf_find(g, "tokenizer.ggml.token_type") &&
            (r = bpe_gguf_array(g, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, &types, why, why_len)))
                return r;
        if (types && types->arr.n != tokens->arr.n) {
                bpe_why(why, why_len, "%llu token types for %llu tokens", (unsigned long long)types->arr.n,
                        (unsigned long long)tokens->arr.n);
                return -EINVAL;
        }
        if (tokens->arr.n > BPE_MAX_VOCAB || merges->arr.n > UINT32_MAX) {
                bpe_why(why, why_len, "vocabulary of %llu tokens, %llu merges",
                        (unsigned long long)tokens->arr.n, (unsigned long long)merges->arr.n);
                return -EINVAL;
        }
        if ((r = bpe_gguf_id(g, "tokenizer.ggml.bos_token_id", &v.bos_id, why, why_len)) ||
            (r = bpe_gguf_id(g, "tokenizer.ggml.eos_token_id", &v.eos_id, why, why_len)) ||
            (r = bpe_gguf_id(g, "tokenizer.ggml.unknown_token_id", &v.unk_id, why, why_len)) ||
            (r = bpe_gguf_id(g, "tokenizer.ggml.padding_token_id", &v.pad_id, why, why_len)))
                return r;
        r = gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &v.add_bos);
        if (r && r != -ENOENT) {
                bpe_why(why, why_len, "tokenizer.ggml.add_bos_token is not a bool");
                return r;
        }
        toks = malloc((tokens->arr.n ? tokens->arr.n : 1) * sizeof(*toks));
        mrg = malloc((merges->arr.n ? merges->arr.n : 1) * sizeof(*mrg));
        typ = types ? malloc(tokens->arr.n ? tokens->arr.n * sizeof(*typ) : 1) : NULL;
        if (!toks || !mrg || (types && !typ)) {
                r = -ENOMEM;
                bpe_why(why, why_len, "out of memory");
                goto out;
        }
        for (uint64_t i = 0; i < tokens->arr.n; i++) {
                struct gguf_str s = gguf_array_str(tokens, i);

                toks[i] = (struct bpe_str){ s.s, s.len };
                if (typ)
                        typ[i] = gguf_array_i32(types, i);
        }
        for (uint64_t i = 0; i < merges->arr.n; i++) {
                struct gguf_str s = gguf_array_str(merges, i);

                mrg[i] = (struct bpe_str){ s.s, s.len };
        }
        v.tokens = toks;
        v.n_tokens = tokens->arr.n;
        v.types = typ;
        v.merges = mrg;
        v.n_merges = merges->arr.n;
        r = bpe_new(&v, ret, why, why_len);
out:
        free(toks);
        free(mrg);
        free(typ);
        return r;
}
