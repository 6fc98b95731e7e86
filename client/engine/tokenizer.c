/* tokenizer.c - the llama2.c tokenizer: loader, BPE encoder, piece decoder.
 *
 * Owns: struct tokenizer (scores, one blob with every piece, offsets into it, and the ids sorted by
 * piece bytes for binary search).
 *
 * The encoder produces exactly llama2.c's output, but not with its algorithm: llama2.c rescans
 * every adjacent pair after each merge (quadratic, hours on the 800 kB validation text). Here each
 * candidate pair sits in a max-heap ordered by (score descending, position ascending), tokens form
 * a linked list, and a per-token version number retires heap entries whose tokens have changed.
 * Popping the best valid entry is the same choice as llama2.c's scan, which takes the first pair
 * with the strictly highest score, so the results agree; a pair is eligible, as in llama2.c, only
 * when its piece exists and its score is above -1e10. Pieces are compared as (bytes, length), never
 * as C strings, so a hostile file with NUL bytes in a piece cannot confuse the lookup.
 * Unlike llama2.c, BOS takes no part in merges (its piece "\n<s>\n" cannot merge in any sane
 * vocabulary) and a missing " " piece falls back to the byte token for 0x20 instead of id -1.
 */
#include "tokenizer.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tokenizer.c reads little-endian files in place and needs a little-endian host"
#endif

#define TOKENIZER_MIN_VOCAB        (TOKENIZER_FIRST_BYTE_TOKEN + 256)
#define TOKENIZER_MAX_VOCAB        (1 << 20)
#define TOKENIZER_MAX_TOKEN_LENGTH 4096
#define TOKENIZER_MAX_FILE_BYTES   (64u << 20)
#define TOKENIZER_MAX_TEXT_BYTES   ((size_t)1 << 28)

struct tokenizer_entry {
        const char *piece;
        uint32_t len;
        int id;
};

struct tokenizer {
        int vocab_size;
        size_t max_piece_bytes;
        float *scores;     /* [vocab_size] */
        uint32_t *offsets; /* [vocab_size + 1] into blob */
        char *blob;
        struct tokenizer_entry *sorted; /* [vocab_size], by (bytes, id) */
        unsigned char byte_pieces[256];
};

static int32_t tokenizer_read_i32(const unsigned char *p) {
        int32_t v;

        memcpy(&v, p, sizeof(v));
        return v;
}

/* memcmp order, a proper prefix first; a total order on byte strings. */
static int tokenizer_bytes_cmp(const char *a, size_t alen, const char *b, size_t blen) {
        int r = memcmp(a, b, alen < blen ? alen : blen);

        if (r)
                return r;
        return alen < blen ? -1 : alen > blen ? 1 : 0;
}

static int tokenizer_entry_cmp(const void *pa, const void *pb) {
        const struct tokenizer_entry *a = pa, *b = pb;
        int r = tokenizer_bytes_cmp(a->piece, a->len, b->piece, b->len);

        if (r)
                return r;
        return a->id < b->id ? -1 : a->id > b->id;
}

/* Compares the entry with the virtual string a || b. */
static int tokenizer_entry_cmp_concat(const struct tokenizer_entry *e, const char *a, size_t alen,
                                      const char *b, size_t blen) {
        size_t elen = e->len;
        int r = memcmp(e->piece, a, elen < alen ? elen : alen);

        if (r)
                return r;
        if (elen < alen)
                return -1;
        return tokenizer_bytes_cmp(e->piece + alen, elen - alen, b, blen);
}

/* The lowest id whose piece is a || b, or -1. */
static int tokenizer_lookup(const struct tokenizer *t, const char *a, size_t alen, const char *b,
                            size_t blen) {
        size_t lo = 0, hi = (size_t)t->vocab_size;

        while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;

                if (tokenizer_entry_cmp_concat(&t->sorted[mid], a, alen, b, blen) < 0)
                        lo = mid + 1;
                else
                        hi = mid;
        }
        if (lo < (size_t)t->vocab_size && tokenizer_entry_cmp_concat(&t->sorted[lo], a, alen, b, blen) == 0)
                return t->sorted[lo].id;
        return -1;
}

struct tokenizer *tokenizer_free(struct tokenizer *t) {
        if (!t)
                return NULL;
        free(t->scores);
        free(t->offsets);
        free(t->blob);
        free(t->sorted);
        free(t);
        return NULL;
}

int tokenizer_load_buffer(const void *data, size_t len, int vocab_size, struct tokenizer **ret) {
        const unsigned char *p = data;
        struct tokenizer *t;
        size_t at, total = 0;
        int32_t max_len;

        if (!data || !ret || vocab_size < TOKENIZER_MIN_VOCAB || vocab_size > TOKENIZER_MAX_VOCAB ||
            len < 4 || len > TOKENIZER_MAX_FILE_BYTES)
                return -EINVAL;
        max_len = tokenizer_read_i32(p);
        if (max_len <= 0 || max_len > TOKENIZER_MAX_TOKEN_LENGTH)
                return -EINVAL;

        /* First pass: every record in bounds, the file consumed exactly. */
        at = 4;
        for (int i = 0; i < vocab_size; i++) {
                int32_t n;

                if (len - at < 8)
                        return -EINVAL;
                n = tokenizer_read_i32(p + at + 4);
                if (n < 0 || n > max_len || len - at - 8 < (size_t)n)
                        return -EINVAL;
                at += 8 + (size_t)n;
                total += (size_t)n;
        }
        if (at != len)
                return -EINVAL;

        t = calloc(1, sizeof(*t));
        if (!t)
                return -ENOMEM;
        t->vocab_size = vocab_size;
        t->scores = malloc((size_t)vocab_size * sizeof(float));
        t->offsets = malloc(((size_t)vocab_size + 1) * sizeof(uint32_t));
        t->blob = malloc(total + 1);
        t->sorted = malloc((size_t)vocab_size * sizeof(*t->sorted));
        if (!t->scores || !t->offsets || !t->blob || !t->sorted) {
                tokenizer_free(t);
                return -ENOMEM;
        }

        at = 4;
        total = 0;
        for (int i = 0; i < vocab_size; i++) {
                size_t n = (size_t)tokenizer_read_i32(p + at + 4);

                memcpy(&t->scores[i], p + at, sizeof(float));
                memcpy(t->blob + total, p + at + 8, n);
                t->offsets[i] = (uint32_t)total;
                if (n > t->max_piece_bytes)
                        t->max_piece_bytes = n;
                at += 8 + n;
                total += n;
        }
        t->offsets[vocab_size] = (uint32_t)total;
        for (int i = 0; i < vocab_size; i++) {
                t->sorted[i].piece = t->blob + t->offsets[i];
                t->sorted[i].len = t->offsets[i + 1] - t->offsets[i];
                t->sorted[i].id = i;
        }
        qsort(t->sorted, (size_t)vocab_size, sizeof(*t->sorted), tokenizer_entry_cmp);
        for (int i = 0; i < 256; i++)
                t->byte_pieces[i] = (unsigned char)i;
        *ret = t;
        return 0;
}

int tokenizer_load(const char *path, int vocab_size, struct tokenizer **ret) {
        struct stat st;
        void *buf = NULL;
        size_t len;
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
        if (!S_ISREG(st.st_mode) || st.st_size < 4 || (uint64_t)st.st_size > TOKENIZER_MAX_FILE_BYTES) {
                r = -EINVAL;
                goto out;
        }
        len = (size_t)st.st_size;
        buf = malloc(len);
        if (!buf) {
                r = -ENOMEM;
                goto out;
        }
        if (fread(buf, 1, len, f) != len) {
                r = -EIO;
                goto out;
        }
        r = tokenizer_load_buffer(buf, len, vocab_size, ret);
out:
        free(buf);
        fclose(f);
        return r;
}

int tokenizer_vocab_size(const struct tokenizer *t) {
        return t ? t->vocab_size : 0;
}

size_t tokenizer_max_piece_bytes(const struct tokenizer *t) {
        return t ? t->max_piece_bytes : 0;
}

static const char *tokenizer_piece_of(const struct tokenizer *t, int id, size_t *ret_len) {
        *ret_len = t->offsets[id + 1] - t->offsets[id];
        return t->blob + t->offsets[id];
}

/* A candidate merge of the adjacent tokens left and right (indices into the work list). */
struct tokenizer_pair {
        float score;
        int id;
        int left, right;
        uint32_t left_ver, right_ver;
};

struct tokenizer_work {
        int *ids, *prev, *next;
        uint32_t *ver;
        struct tokenizer_pair *heap;
        size_t n_heap;
};

/* Heap order: higher score first, then the leftmost pair (indices grow left to right). */
static bool tokenizer_pair_before(const struct tokenizer_pair *a, const struct tokenizer_pair *b) {
        if (a->score != b->score)
                return a->score > b->score;
        return a->left < b->left;
}

static void tokenizer_heap_push(struct tokenizer_work *w, const struct tokenizer_pair *e) {
        size_t i = w->n_heap++;

        while (i > 0) {
                size_t parent = (i - 1) / 2;

                if (!tokenizer_pair_before(e, &w->heap[parent]))
                        break;
                w->heap[i] = w->heap[parent];
                i = parent;
        }
        w->heap[i] = *e;
}

static struct tokenizer_pair tokenizer_heap_pop(struct tokenizer_work *w) {
        struct tokenizer_pair top = w->heap[0], last = w->heap[--w->n_heap];
        size_t i = 0, n = w->n_heap;

        for (;;) {
                size_t c = 2 * i + 1;

                if (c >= n)
                        break;
                if (c + 1 < n && tokenizer_pair_before(&w->heap[c + 1], &w->heap[c]))
                        c++;
                if (!tokenizer_pair_before(&w->heap[c], &last))
                        break;
                w->heap[i] = w->heap[c];
                i = c;
        }
        if (n)
                w->heap[i] = last;
        return top;
}

/* Queues the merge of left and its successor when llama2.c would consider it. */
static void tokenizer_consider(const struct tokenizer *t, struct tokenizer_work *w, int left) {
        struct tokenizer_pair e;
        const char *a, *b;
        size_t alen, blen;
        int right = w->next[left];

        if (right < 0)
                return;
        a = tokenizer_piece_of(t, w->ids[left], &alen);
        b = tokenizer_piece_of(t, w->ids[right], &blen);
        e.id = tokenizer_lookup(t, a, alen, b, blen);
        if (e.id < 0)
                return;
        e.score = t->scores[e.id];
        if (!(e.score > -1e10f))
                return;
        e.left = left;
        e.right = right;
        e.left_ver = w->ver[left];
        e.right_ver = w->ver[right];
        tokenizer_heap_push(w, &e);
}

static void tokenizer_work_free(struct tokenizer_work *w) {
        free(w->ids);
        free(w->prev);
        free(w->next);
        free(w->ver);
        free(w->heap);
}

int tokenizer_encode(const struct tokenizer *t, const char *text, size_t text_len, bool bos, bool eos,
                     int *tokens, size_t cap, size_t *ret_n) {
        struct tokenizer_work w = { 0 };
        size_t n_max, n = 0, n_out;
        unsigned char buf[4];
        size_t buf_len = 0;
        int r = 0, head;

        if (!t || (!text && text_len) || !tokens || !ret_n || text_len > TOKENIZER_MAX_TEXT_BYTES)
                return -EINVAL;

        n_max = text_len + 1;
        w.ids = malloc(n_max * sizeof(int));
        w.prev = malloc(n_max * sizeof(int));
        w.next = malloc(n_max * sizeof(int));
        w.ver = calloc(n_max, sizeof(uint32_t));
        /* n - 1 initial pairs plus at most two new ones per merge, and at most n - 1 merges. */
        w.heap = malloc(3 * n_max * sizeof(struct tokenizer_pair));
        if (!w.ids || !w.prev || !w.next || !w.ver || !w.heap) {
                r = -ENOMEM;
                goto out;
        }

        if (text_len > 0) {
                int space = tokenizer_lookup(t, " ", 1, "", 0);

                w.ids[n++] = space >= 0 ? space : TOKENIZER_FIRST_BYTE_TOKEN + ' ';
        }
        /* One code point at a time (a lead byte and at most three continuation bytes), as llama2.c. */
        for (size_t i = 0; i < text_len; i++) {
                unsigned char c = (unsigned char)text[i];
                int id;

                if ((c & 0xC0) != 0x80)
                        buf_len = 0;
                buf[buf_len++] = c;
                if (i + 1 < text_len && ((unsigned char)text[i + 1] & 0xC0) == 0x80 && buf_len < 4)
                        continue;
                id = tokenizer_lookup(t, (const char *)buf, buf_len, "", 0);
                if (id >= 0)
                        w.ids[n++] = id;
                else
                        for (size_t j = 0; j < buf_len; j++)
                                w.ids[n++] = TOKENIZER_FIRST_BYTE_TOKEN + buf[j];
                buf_len = 0;
        }

        for (size_t i = 0; i < n; i++) {
                w.prev[i] = (int)i - 1;
                w.next[i] = i + 1 < n ? (int)i + 1 : -1;
        }
        for (size_t i = 0; i + 1 < n; i++)
                tokenizer_consider(t, &w, (int)i);
        while (w.n_heap > 0) {
                struct tokenizer_pair e = tokenizer_heap_pop(&w);
                int l = e.left, rt = e.right;

                if (w.ver[l] != e.left_ver || w.ver[rt] != e.right_ver || w.next[l] != rt)
                        continue;
                w.ids[l] = e.id;
                w.ver[l]++;
                w.ver[rt]++;
                w.next[l] = w.next[rt];
                if (w.next[rt] >= 0)
                        w.prev[w.next[rt]] = l;
                w.next[rt] = -1;
                if (w.prev[l] >= 0)
                        tokenizer_consider(t, &w, w.prev[l]);
                tokenizer_consider(t, &w, l);
        }

        head = n > 0 ? 0 : -1;
        n_out = (size_t)bos + (size_t)eos;
        for (int i = head; i >= 0; i = w.next[i])
                n_out++;
        if (n_out > cap) {
                r = -ENOBUFS;
                goto out;
        }
        n_out = 0;
        if (bos)
                tokens[n_out++] = TOKENIZER_BOS;
        for (int i = head; i >= 0; i = w.next[i])
                tokens[n_out++] = w.ids[i];
        if (eos)
                tokens[n_out++] = TOKENIZER_EOS;
        *ret_n = n_out;
out:
        tokenizer_work_free(&w);
        return r;
}

static int tokenizer_hex_digit(char c) {
        if (c >= '0' && c <= '9')
                return c - '0';
        if (c >= 'A' && c <= 'F')
                return c - 'A' + 10;
        if (c >= 'a' && c <= 'f')
                return c - 'a' + 10;
        return -1;
}

/* The byte of a piece spelled exactly "<0xHH>", or -1. */
static int tokenizer_byte_piece(const char *p, size_t len) {
        int hi, lo;

        if (len != 6 || memcmp(p, "<0x", 3) != 0 || p[5] != '>')
                return -1;
        hi = tokenizer_hex_digit(p[3]);
        lo = tokenizer_hex_digit(p[4]);
        if (hi < 0 || lo < 0)
                return -1;
        return hi * 16 + lo;
}

int tokenizer_decode(const struct tokenizer *t, int prev_token, int token, const char **ret_piece,
                     size_t *ret_len) {
        const char *piece;
        size_t len;
        int byte;

        if (!t || !ret_piece || !ret_len || token < 0 || token >= t->vocab_size)
                return -EINVAL;
        piece = tokenizer_piece_of(t, token, &len);
        if (prev_token == TOKENIZER_BOS && len > 0 && piece[0] == ' ') {
                piece++;
                len--;
        }
        byte = tokenizer_byte_piece(piece, len);
        if (byte >= 0) {
                piece = (const char *)&t->byte_pieces[byte];
                len = 1;
        }
        *ret_piece = piece;
        *ret_len = len;
        return 0;
}

/* isprint || isspace in the C locale, without depending on the process's locale. */
static bool tokenizer_byte_is_safe(unsigned char c) {
        return (c >= 0x20 && c <= 0x7E) || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

int tokenizer_piece_safe(const struct tokenizer *t, int prev_token, int token, char *buf, size_t cap,
                         size_t *ret_len) {
        const char *piece;
        size_t len;
        int r;

        if (!buf || !ret_len)
                return -EINVAL;
        r = tokenizer_decode(t, prev_token, token, &piece, &len);
        if (r < 0)
                return r;
        if (len == 1 && !tokenizer_byte_is_safe((unsigned char)piece[0]))
                len = 0;
        if (cap < len + 1)
                return -ENOBUFS;
        memcpy(buf, piece, len);
        buf[len] = '\0';
        *ret_len = len;
        return 0;
}
