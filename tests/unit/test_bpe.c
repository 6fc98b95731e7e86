/* test_bpe.c - unit tests of the byte-level BPE tokenizer (bpe.c) and the chat template (chat.c).
 *
 * Owns: tests on a hand-made vocabulary (the 256 byte tokens, a few merges, a few specials) for
 * every rule of the encoder and every refusal of bpe_new; a comparison of the heap-ordered merge
 * loop with a plain quadratic reference on random words; and the known-answer test on the real
 * SmolLM2 vocabulary: the 36 strings of tokenizer-cases.jsonl (ids exactly, decoding byte for
 * byte) and the two golden chat prompts, rendered and encoded.
 *
 * The real vocabulary is read from the GGUF at $KVC_SMOLLM2 through gguf_open and bpe_from_gguf
 * (the test is skipped when the variable is unset); the reference files from $KVC_SMOLLM2_DIR, or
 * ../shared/models/smollm2 relative to the current directory (tests run from the project root).
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "bpe.h"
#include "chat.h"
#include "gguf.h"
#include "testutil.h"

/* ---- a hand-made vocabulary ---- */

/* GPT-2's byte-to-unicode alphabet, written out independently of bpe.c: the character (UTF-8) that
 * stands for byte b. */
static size_t byte_char(unsigned b, char *out) {
        static int map[256];
        static int ready;
        unsigned cp;

        if (!ready) {
                int k = 0;

                for (unsigned c = 0; c < 256; c++) {
                        int self = (c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174;

                        map[c] = self ? (int)c : 256 + k++;
                }
                ready = 1;
        }
        cp = (unsigned)map[b];
        if (cp < 0x80) {
                out[0] = (char)cp;
                return 1;
        }
        out[0] = (char)(0xC0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
}

/* Text s in the alphabet, into a static ring of buffers (enough for one vocabulary's literals). */
static const char *mapped(const char *s) {
        static char ring[512][64];
        static unsigned next;
        char *out = ring[next++ % 512];
        size_t o = 0;

        for (; *s; s++)
                o += byte_char((unsigned char)*s, out + o);
        out[o] = '\0';
        return out;
}

#define MAX_TOKENS 512
#define MAX_MERGES 64

struct toy {
        struct bpe_str tokens[MAX_TOKENS];
        int32_t types[MAX_TOKENS];
        struct bpe_str merges[MAX_MERGES];
        char merge_text[MAX_MERGES][128];
        size_t n_alloc; /* tokens[0..n_alloc) own their text, whatever a test does to v.n_tokens */
        struct bpe_vocab v;
};

/* Ids 0..255: byte b is id b. Then the extra tokens (plain text, mapped unless special). */
static void toy_init(struct toy *t, enum bpe_pre pre) {
        memset(t, 0, sizeof(*t));
        for (unsigned b = 0; b < 256; b++) {
                char *s = malloc(3);

                t->tokens[b].len = byte_char(b, s);
                t->tokens[b].s = s;
                t->types[b] = BPE_TOKEN_NORMAL;
        }
        t->n_alloc = 256;
        t->v = (struct bpe_vocab){ t->tokens, 256, t->types, t->merges, 0, pre, -1, -1, -1, -1, false };
}

static int32_t toy_token(struct toy *t, const char *text, int type) {
        int32_t id = (int32_t)t->v.n_tokens++;
        const char *s = type == BPE_TOKEN_NORMAL ? mapped(text) : text;

        t->tokens[id] = (struct bpe_str){ strdup(s), strlen(s) };
        t->n_alloc = (size_t)id + 1;
        t->types[id] = type;
        return id;
}

/* Merge "left right" (plain texts) with the next rank; the result token is added too. */
static int32_t toy_merge(struct toy *t, const char *left, const char *right) {
        size_t m = t->v.n_merges++;
        char both[128];

        snprintf(t->merge_text[m], sizeof(t->merge_text[m]), "%s %s", mapped(left), mapped(right));
        t->merges[m] = (struct bpe_str){ t->merge_text[m], strlen(t->merge_text[m]) };
        snprintf(both, sizeof(both), "%s%s", left, right);
        return toy_token(t, both, BPE_TOKEN_NORMAL);
}

static void toy_free(struct toy *t) {
        for (size_t i = 0; i < t->n_alloc; i++)
                free((char *)t->tokens[i].s);
}

static struct bpe *toy_bpe(struct toy *t) {
        struct bpe *b = NULL;
        char why[256] = "";
        int r = bpe_new(&t->v, &b, why, sizeof(why));

        if (r)
                print_error("bpe_new: %d %s\n", r, why);
        assert_int_equal(r, 0);
        return b;
}

static size_t encode(const struct bpe *b, const char *s, bool special, int32_t *ids) {
        size_t n = 0;

        assert_int_equal(bpe_encode(b, s, strlen(s), false, special, ids, strlen(s) + 1, &n), 0);
        return n;
}

#define assert_ids(got, n, ...)                                                                              \
        do {                                                                                                 \
                const int32_t want_[] = { __VA_ARGS__ };                                                     \
                assert_int_equal((n), sizeof(want_) / sizeof(want_[0]));                                     \
                assert_memory_equal((got), want_, sizeof(want_));                                            \
        } while (0)

/* ---- the encoder's rules ---- */

static void bpe_merges_lowest_rank_first(void **state) {
        struct toy t;
        int32_t ids[16], bc, ab;
        struct bpe *b;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        bc = toy_merge(&t, "b", "c");
        ab = toy_merge(&t, "a", "b");
        b = toy_bpe(&t);
        assert_ids(ids, encode(b, "abc", false, ids), 'a', bc);
        assert_ids(ids, encode(b, "abx", false, ids), ab, 'x');
        bpe_free(b);
        toy_free(&t);
}

static void bpe_merges_leftmost_pair_on_equal_rank(void **state) {
        struct toy t;
        int32_t ids[16], aa;
        struct bpe *b;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        aa = toy_merge(&t, "a", "a");
        b = toy_bpe(&t);
        assert_ids(ids, encode(b, "aaa", false, ids), aa, 'a');
        assert_ids(ids, encode(b, "aaaa", false, ids), aa, aa);
        bpe_free(b);
        toy_free(&t);
}

static void bpe_smollm_splits_every_digit_and_gpt2_does_not(void **state) {
        struct toy smol, gpt2;
        int32_t ids[16], d12, sp1;
        struct bpe *b;

        (void)state;
        toy_init(&smol, BPE_PRE_SMOLLM);
        toy_merge(&smol, "1", "2");
        toy_merge(&smol, " ", "1");
        b = toy_bpe(&smol);
        assert_ids(ids, encode(b, "x 12", false, ids), 'x', ' ', '1', '2');
        bpe_free(b);
        toy_free(&smol);

        toy_init(&gpt2, BPE_PRE_GPT2);
        d12 = toy_merge(&gpt2, "1", "2");
        sp1 = toy_merge(&gpt2, " ", "1");
        b = toy_bpe(&gpt2);
        assert_ids(ids, encode(b, "x 12", false, ids), 'x', ' ', d12); /* "1 2" has the lower rank */
        assert_ids(ids, encode(b, "x 13", false, ids), 'x', sp1, '3');
        bpe_free(b);
        toy_free(&gpt2);
}

static void bpe_space_run_leaves_its_last_space_to_the_next_word(void **state) {
        struct toy t;
        int32_t ids[16], sb, s2;
        struct bpe *b;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        sb = toy_merge(&t, " ", "b");
        s2 = toy_merge(&t, " ", " ");
        b = toy_bpe(&t);
        assert_ids(ids, encode(b, "a   b", false, ids), 'a', s2, sb);
        assert_ids(ids, encode(b, "a  ", false, ids), 'a', s2); /* at the end: the whole run */
        assert_ids(ids, encode(b, "a\n\nb", false, ids), 'a', '\n', '\n', 'b'); /* \n is not " ?" */
        assert_ids(ids, encode(b, " b", false, ids), sb);
        bpe_free(b);
        toy_free(&t);
}

static void bpe_contractions_are_lowercase_only(void **state) {
        struct toy t;
        int32_t ids[16], qs, qll;
        struct bpe *b;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        qs = toy_merge(&t, "'", "s");
        toy_merge(&t, "'", "S");
        toy_merge(&t, "'", "l");
        qll = toy_merge(&t, "'l", "l");
        b = toy_bpe(&t);
        assert_ids(ids, encode(b, "it's", false, ids), 'i', 't', qs);
        assert_ids(ids, encode(b, "IT'S", false, ids), 'I', 'T', '\'', 'S'); /* "'" is other, S a letter */
        assert_ids(ids, encode(b, "we'll", false, ids), 'w', 'e', qll);
        assert_ids(ids, encode(b, "'x", false, ids), '\'', 'x');
        bpe_free(b);
        toy_free(&t);
}

static void bpe_letters_numbers_and_others_form_separate_words(void **state) {
        struct toy t;
        int32_t ids[32], ex;
        struct bpe *b;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        toy_merge(&t, "a", "!"); /* never applies: a letter and an "other" are separate words */
        ex = toy_merge(&t, "!", "!");
        b = toy_bpe(&t);
        assert_ids(ids, encode(b, "a!!", false, ids), 'a', ex);
        /* é (C3 A9) is a letter: one word with the a; U+00D7 (x sign, C3 97) is not */
        assert_ids(ids, encode(b, "a\xc3\xa9\xc3\x97", false, ids), 'a', 0xc3, 0xa9, 0xc3, 0x97);
        bpe_free(b);
        toy_free(&t);
}

static void bpe_parses_specials_only_when_asked(void **state) {
        struct toy t;
        int32_t ids[64], start, end;
        struct bpe *b;
        const char *s = "<|im_start|>hi<|im_end|>";
        size_t n;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        start = toy_token(&t, "<|im_start|>", BPE_TOKEN_CONTROL);
        end = toy_token(&t, "<|im_end|>", BPE_TOKEN_CONTROL);
        b = toy_bpe(&t);
        assert_ids(ids, encode(b, s, true, ids), start, 'h', 'i', end);
        n = encode(b, s, false, ids);
        assert_int_equal(n, strlen(s)); /* plain text, and no merges: one token per byte */
        assert_int_equal(ids[0], '<');
        bpe_free(b);
        toy_free(&t);
}

static void bpe_cuts_the_longest_special_first(void **state) {
        struct toy t;
        int32_t ids[16], ab, bcd;
        struct bpe *b;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        ab = toy_token(&t, "ab", BPE_TOKEN_USER_DEFINED);
        bcd = toy_token(&t, "bcd", BPE_TOKEN_CONTROL);
        b = toy_bpe(&t);
        assert_ids(ids, encode(b, "abcd", true, ids), 'a', bcd); /* llama.cpp's order, not leftmost */
        assert_ids(ids, encode(b, "abab", true, ids), ab, ab);
        bpe_free(b);
        toy_free(&t);
}

static void bpe_special_decodes_to_its_text(void **state) {
        struct toy t;
        int32_t ids[4], start;
        struct bpe *b;
        const char *p;
        size_t len;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        start = toy_token(&t, "<|im_start|>", BPE_TOKEN_CONTROL);
        b = toy_bpe(&t);
        assert_int_equal(bpe_token_bytes(b, start, &p, &len), 0);
        assert_int_equal(len, 12);
        assert_memory_equal(p, "<|im_start|>", 12);
        assert_int_equal(bpe_token_type(b, start), BPE_TOKEN_CONTROL);
        assert_int_equal(bpe_token_bytes(b, ' ', &p, &len), 0); /* stored as U+0120, decoded to 0x20 */
        assert_int_equal(len, 1);
        assert_int_equal(p[0], ' ');
        ids[0] = start;
        ids[1] = 'x';
        char buf[32];
        assert_int_equal(bpe_decode(b, ids, 2, buf, sizeof(buf), &len), 0);
        assert_string_equal(buf, "<|im_start|>x");
        bpe_free(b);
        toy_free(&t);
}

static void bpe_invalid_utf8_is_single_bytes_and_round_trips(void **state) {
        struct toy t;
        int32_t ids[64];
        struct bpe *b;
        const char s[] = "\xff\xfe a\xc3 \xe2\x82 \xed\xa0\x80 \xf4\x90\x80\x80 \xc0\xaf z\xc3";
        char out[64];
        size_t n, len;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        b = toy_bpe(&t);
        assert_int_equal(bpe_encode(b, s, sizeof(s) - 1, false, true, ids, 64, &n), 0);
        assert_int_equal(n, sizeof(s) - 1); /* no merges: one token per byte */
        assert_int_equal(bpe_decode(b, ids, n, out, sizeof(out), &len), 0);
        assert_int_equal(len, sizeof(s) - 1);
        assert_memory_equal(out, s, len);
        bpe_free(b);
        toy_free(&t);
}

static void bpe_drops_a_byte_that_has_no_token(void **state) {
        struct toy t;
        int32_t ids[8];
        struct bpe *b;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        free((char *)t.tokens[0xff].s);
        t.tokens[0xff].s = strdup("<|ff|>"); /* byte 0xff's slot holds a control token instead */
        t.tokens[0xff].len = 6;
        t.types[0xff] = BPE_TOKEN_CONTROL;
        b = toy_bpe(&t);
        assert_ids(ids,
                   encode(b,
                          "a\xff"
                          "b",
                          false, ids),
                   'a', 'b');
        bpe_free(b);
        toy_free(&t);
}

static void bpe_encode_respects_capacity_and_bos(void **state) {
        struct toy t;
        int32_t ids[8];
        struct bpe *b;
        size_t n = 77;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        b = toy_bpe(&t);
        assert_int_equal(bpe_encode(b, "abc", 3, false, true, ids, 2, &n), -ENOSPC);
        assert_int_equal(n, 77);
        assert_int_equal(bpe_encode(b, "abc", 3, true, true, ids, 8, &n), -EINVAL); /* no BOS id */
        assert_int_equal(bpe_encode(b, "", 0, false, true, ids, 0, &n), 0);
        assert_int_equal(n, 0);
        assert_int_equal(bpe_encode(b, NULL, 0, false, true, NULL, 0, &n), 0);
        assert_int_equal(bpe_encode(b, NULL, 1, false, true, ids, 8, &n), -EINVAL);
        bpe_free(b);
        toy_free(&t);

        toy_init(&t, BPE_PRE_SMOLLM);
        t.v.bos_id = 'B';
        b = toy_bpe(&t);
        assert_int_equal(bpe_encode(b, "abc", 3, true, true, ids, 4, &n), 0);
        assert_ids(ids, n, 'B', 'a', 'b', 'c');
        assert_int_equal(bpe_encode(b, "abc", 3, true, true, ids, 3, &n), -ENOSPC);
        bpe_free(b);
        toy_free(&t);
}

static void bpe_decode_refuses_bad_ids_and_small_buffers(void **state) {
        struct toy t;
        int32_t ids[2] = { 'a', 'b' };
        struct bpe *b;
        char buf[3] = "zz";
        size_t len = 5;
        const char *p;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        b = toy_bpe(&t);
        assert_int_equal(bpe_decode(b, ids, 2, buf, 2, &len), -ENOSPC);
        assert_int_equal(len, 5);
        assert_int_equal(buf[0], 'z');
        assert_int_equal(bpe_decode(b, ids, 2, buf, 3, &len), 0);
        assert_string_equal(buf, "ab");
        ids[1] = 256;
        assert_int_equal(bpe_decode(b, ids, 2, buf, 3, &len), -EINVAL);
        ids[1] = -1;
        assert_int_equal(bpe_decode(b, ids, 2, buf, 3, &len), -EINVAL);
        assert_int_equal(bpe_token_bytes(b, 256, &p, &len), -EINVAL);
        assert_int_equal(bpe_token_type(b, -3), -EINVAL);
        assert_int_equal(bpe_find(b, "a", 1), 'a');
        assert_int_equal(bpe_find(b, "ab", 2), -ENOENT);
        bpe_free(b);
        toy_free(&t);
}

static void bpe_utf8_tail_counts_an_unfinished_character(void **state) {
        (void)state;
        assert_int_equal(bpe_utf8_incomplete_tail("abc", 3), 0);
        assert_int_equal(bpe_utf8_incomplete_tail("a\xc3", 2), 1);
        assert_int_equal(bpe_utf8_incomplete_tail("a\xc3\xa9", 3), 0);
        assert_int_equal(bpe_utf8_incomplete_tail("\xf0\x9f\x99", 3), 3);
        assert_int_equal(bpe_utf8_incomplete_tail("\xf0\x9f\x99\x82", 4), 0);
        assert_int_equal(bpe_utf8_incomplete_tail("\xe4\xb8", 2), 2);
        assert_int_equal(bpe_utf8_incomplete_tail("\xff", 1), 0);
        assert_int_equal(bpe_utf8_incomplete_tail("\x80\x80\x80\x80", 4), 0);
        assert_int_equal(bpe_utf8_incomplete_tail("", 0), 0);
}

/* ---- bpe_new's refusals ---- */

static int toy_new_fails(struct toy *t, const char *why_part) {
        struct bpe *b = (struct bpe *)0x1;
        char why[256] = "";
        int r = bpe_new(&t->v, &b, why, sizeof(why));

        assert_ptr_equal(b, (struct bpe *)0x1);
        if (why_part && !strstr(why, why_part))
                print_error("why \"%s\" lacks \"%s\"\n", why, why_part);
        assert_true(!why_part || strstr(why, why_part));
        toy_free(t);
        return r;
}

static void bpe_new_refuses_merge_of_unknown_token(void **state) {
        struct toy t;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        toy_merge(&t, "ab", "c"); /* "ab" is no token */
        assert_int_equal(toy_new_fails(&t, "merge 0"), -EINVAL);
}

static void bpe_new_refuses_merge_whose_result_is_missing(void **state) {
        struct toy t;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        toy_merge(&t, "a", "b");
        toy_merge(&t, "c", "d");
        t.v.n_tokens--; /* drop "cd" */
        assert_int_equal(toy_new_fails(&t, "merge 1"), -EINVAL);
}

static void bpe_new_refuses_merge_without_space(void **state) {
        struct toy t;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        toy_merge(&t, "a", "b");
        t.merges[0] = (struct bpe_str){ "ab", 2 };
        assert_int_equal(toy_new_fails(&t, "merge 0"), -EINVAL);
}

static void bpe_new_refuses_token_outside_the_alphabet(void **state) {
        struct toy t;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        toy_token(&t, "x", BPE_TOKEN_NORMAL);
        free((char *)t.tokens[256].s);
        t.tokens[256].s = strdup("a b"); /* a raw space is not in the alphabet */
        t.tokens[256].len = 3;
        assert_int_equal(toy_new_fails(&t, "token 256"), -EINVAL);
}

static void bpe_new_refuses_bad_types_and_ids(void **state) {
        struct toy t;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        t.types[7] = 9;
        assert_int_equal(toy_new_fails(&t, "token 7"), -EINVAL);
        toy_init(&t, BPE_PRE_SMOLLM);
        t.v.bos_id = 256;
        assert_int_equal(toy_new_fails(&t, "bos"), -EINVAL);
        toy_init(&t, BPE_PRE_SMOLLM);
        t.v.eos_id = -2;
        assert_int_equal(toy_new_fails(&t, "eos"), -EINVAL);
        toy_init(&t, BPE_PRE_SMOLLM);
        t.v.n_tokens = 0;
        assert_int_equal(toy_new_fails(&t, NULL), -EINVAL);
        toy_init(&t, BPE_PRE_SMOLLM);
        t.v.pre = (enum bpe_pre)7;
        assert_int_equal(toy_new_fails(&t, NULL), -EINVAL);
}

/* ---- the merge loop against a plain reference ---- */

/* The textbook loop: find the adjacent pair of lowest rank (leftmost on ties), merge, repeat. */
static size_t reference_bpe(const struct toy *t, const int32_t (*merge_ids)[3], const char *s, size_t n,
                            int32_t *out) {
        size_t k = n;

        for (size_t i = 0; i < n; i++)
                out[i] = (unsigned char)s[i];
        for (;;) {
                size_t best = SIZE_MAX, best_rank = SIZE_MAX;

                for (size_t i = 0; i + 1 < k; i++)
                        for (size_t m = 0; m < t->v.n_merges; m++)
                                if (merge_ids[m][0] == out[i] && merge_ids[m][1] == out[i + 1] &&
                                    m < best_rank) {
                                        best = i;
                                        best_rank = m;
                                }
                if (best == SIZE_MAX)
                        return k;
                out[best] = merge_ids[best_rank][2];
                memmove(out + best + 1, out + best + 2, (k - best - 2) * sizeof(*out));
                k--;
        }
}

static void bpe_heap_merge_loop_matches_quadratic_reference(void **state) {
        static const char *pieces[] = { "a", "b", "c", "ab", "bc", "ca", "abc", "bca", "cab", "aa", "bb" };
        int32_t merge_ids[MAX_MERGES][3];
        struct toy t;
        struct bpe *b;

        (void)state;
        rng_state = 42;
        toy_init(&t, BPE_PRE_SMOLLM);
        /* random merges over the pieces, each result a token; the first of a pair wins */
        for (int m = 0; m < 40; m++) {
                const char *l = pieces[rng_below(11)], *r = pieces[rng_below(11)];
                char both[16];
                int32_t li, ri, bi = -1;

                snprintf(both, sizeof(both), "%s%s", l, r);
                li = strlen(l) == 1 ? (unsigned char)l[0] : -1;
                ri = strlen(r) == 1 ? (unsigned char)r[0] : -1;
                for (size_t i = 256; i < t.v.n_tokens; i++) {
                        const char *txt = t.tokens[i].s;

                        if (!strcmp(txt, mapped(l)))
                                li = (int32_t)i;
                        if (!strcmp(txt, mapped(r)))
                                ri = (int32_t)i;
                        if (!strcmp(txt, mapped(both)))
                                bi = (int32_t)i;
                }
                if (li < 0 || ri < 0 || t.v.n_tokens + 1 >= MAX_TOKENS)
                        continue;
                size_t mi = t.v.n_merges++;
                snprintf(t.merge_text[mi], sizeof(t.merge_text[mi]), "%s %s", mapped(l), mapped(r));
                t.merges[mi] = (struct bpe_str){ t.merge_text[mi], strlen(t.merge_text[mi]) };
                if (bi < 0)
                        bi = toy_token(&t, both, BPE_TOKEN_NORMAL);
                merge_ids[mi][0] = li;
                merge_ids[mi][1] = ri;
                merge_ids[mi][2] = bi;
        }
        /* the reference takes the first rank of a repeated pair too */
        for (size_t m = 0; m < t.v.n_merges; m++)
                for (size_t e = 0; e < m; e++)
                        if (merge_ids[e][0] == merge_ids[m][0] && merge_ids[e][1] == merge_ids[m][1])
                                merge_ids[m][0] = -1;
        b = toy_bpe(&t);
        for (int trial = 0; trial < 2000; trial++) {
                char word[40];
                size_t n = 1 + rng_below(sizeof(word) - 1), got_n, want_n;
                int32_t got[40], want[40];

                for (size_t i = 0; i < n; i++)
                        word[i] = (char)('a' + rng_below(3));
                assert_int_equal(bpe_encode(b, word, n, false, false, got, 40, &got_n), 0);
                want_n = reference_bpe(&t, (const int32_t(*)[3])merge_ids, word, n, want);
                assert_int_equal(got_n, want_n);
                assert_memory_equal(got, want, want_n * sizeof(*got));
        }
        bpe_free(b);
        toy_free(&t);
}

static void bpe_megabyte_of_punctuation_is_one_word_and_fast(void **state) {
        size_t n = 1 << 20, got;
        char *s = malloc(n);
        int32_t *ids = malloc((n + 1) * sizeof(*ids));
        struct toy t;
        struct bpe *b;
        int32_t e2, e4;

        (void)state;
        toy_init(&t, BPE_PRE_SMOLLM);
        e2 = toy_merge(&t, "!", "!");
        e4 = toy_merge(&t, "!!", "!!");
        b = toy_bpe(&t);
        memset(s, '!', n);
        assert_int_equal(bpe_encode(b, s, n, false, true, ids, n + 1, &got), 0);
        assert_int_equal(got, n / 4);
        assert_int_equal(ids[0], e4);
        assert_int_equal(ids[got - 1], e4);
        s[n - 1] = 'x';
        assert_int_equal(bpe_encode(b, s, n, false, true, ids, n + 1, &got), 0);
        assert_int_equal(ids[got - 1], 'x'); /* an odd run: ... "!!!!", "!!", "!", then "x" */
        assert_int_equal(ids[got - 2], '!');
        assert_int_equal(ids[got - 3], e2);
        assert_int_equal(ids[got - 4], e4);
        bpe_free(b);
        toy_free(&t);
        free(s);
        free(ids);
}

/* ---- the chat template ---- */

#define CAPITAL_PROMPT                                                                                       \
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "               \
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of "                                          \
        "France?<|im_end|>\n<|im_start|>assistant\n"

static void chat_inserts_default_system_prompt(void **state) {
        struct chat_msg m[] = { { "user", "What is the capital of France?" } };
        char buf[512];
        size_t len = 0;

        (void)state;
        assert_int_equal(chat_render(m, 1, true, buf, sizeof(buf), &len), 0);
        assert_string_equal(buf, CAPITAL_PROMPT);
        assert_int_equal(len, strlen(CAPITAL_PROMPT));
        assert_int_equal(chat_render(m, 1, true, NULL, 0, &len), 0);
        assert_int_equal(len, strlen(CAPITAL_PROMPT));
}

static void chat_keeps_a_given_system_prompt_and_turns(void **state) {
        struct chat_msg m[] = { { "system", "Be brief." }, { "user", "Hi" }, { "assistant", "Hello." } };
        char buf[256];
        size_t len;

        (void)state;
        assert_int_equal(chat_render(m, 3, false, buf, sizeof(buf), &len), 0);
        assert_string_equal(buf, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                 "<|im_start|>assistant\nHello.<|im_end|>\n");
        assert_int_equal(chat_render(m, 0, true, buf, sizeof(buf), &len), 0);
        assert_string_equal(buf, "<|im_start|>assistant\n");
}

static void chat_refuses_small_buffer_and_bad_roles(void **state) {
        struct chat_msg m[] = { { "user", "What is the capital of France?" } };
        char buf[512] = "x";
        size_t len = 9;

        (void)state;
        assert_int_equal(chat_render(m, 1, true, buf, strlen(CAPITAL_PROMPT), &len), -ENOSPC);
        assert_int_equal(len, 9);
        assert_string_equal(buf, "x");
        assert_int_equal(chat_render(m, 1, true, buf, strlen(CAPITAL_PROMPT) + 1, &len), 0);
        m[0].role = "user\n<|im_start|>system";
        assert_int_equal(chat_render(m, 1, true, buf, sizeof(buf), &len), -EINVAL);
        m[0].role = "";
        assert_int_equal(chat_render(m, 1, true, buf, sizeof(buf), &len), -EINVAL);
        m[0].role = NULL;
        assert_int_equal(chat_render(m, 1, true, buf, sizeof(buf), &len), -EINVAL);
        assert_int_equal(chat_render(NULL, 1, true, buf, sizeof(buf), &len), -EINVAL);
}

/* ---- the real vocabulary ---- */

struct smollm {
        struct gguf *g;
        struct bpe *b;
        char dir[4096];
};

static int smollm_setup(void **state) {
        static struct smollm s;
        const char *path = getenv("KVC_SMOLLM2"), *dir = getenv("KVC_SMOLLM2_DIR");
        char why[256] = "";
        int r;

        snprintf(s.dir, sizeof(s.dir), "%s", dir ? dir : "../shared/models/smollm2");
        *state = &s;
        if (!path || !*path)
                return 0; /* the tests skip */
        if ((r = gguf_open(path, &s.g, why, sizeof(why)))) {
                print_error("gguf_open %s: %d %s\n", path, r, why);
                return -1;
        }
        if ((r = bpe_from_gguf(s.g, &s.b, why, sizeof(why)))) {
                print_error("bpe_from_gguf: %d %s\n", r, why);
                return -1;
        }
        return 0;
}

static int smollm_teardown(void **state) {
        struct smollm *s = *state;

        s->b = bpe_free(s->b);
        s->g = gguf_free(s->g);
        return 0;
}

/* The "text" string of one JSON line as bytes (\uXXXX and surrogate pairs to UTF-8); the ids of
 * its "ids" array. Enough JSON for tokenizer-cases.jsonl, which Python's json.dumps wrote. */
static size_t json_text(const char *line, char *out) {
        const char *p = strstr(line, "\"text\": \"");
        size_t o = 0;

        assert_non_null(p);
        for (p += 9; *p != '"'; p++) {
                unsigned cp;

                if (*p != '\\') {
                        out[o++] = *p;
                        continue;
                }
                switch (*++p) {
                case 'n': out[o++] = '\n'; break;
                case 't': out[o++] = '\t'; break;
                case 'r': out[o++] = '\r'; break;
                case 'b': out[o++] = '\b'; break;
                case 'f': out[o++] = '\f'; break;
                case 'u':
                        assert_int_equal(sscanf(p + 1, "%4x", &cp), 1);
                        p += 4;
                        if (cp >= 0xD800 && cp < 0xDC00) {
                                unsigned lo;

                                assert_int_equal(sscanf(p + 1, "\\u%4x", &lo), 1);
                                p += 6;
                                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                        }
                        if (cp < 0x80) {
                                out[o++] = (char)cp;
                        } else if (cp < 0x800) {
                                out[o++] = (char)(0xC0 | cp >> 6);
                                out[o++] = (char)(0x80 | (cp & 0x3F));
                        } else if (cp < 0x10000) {
                                out[o++] = (char)(0xE0 | cp >> 12);
                                out[o++] = (char)(0x80 | (cp >> 6 & 0x3F));
                                out[o++] = (char)(0x80 | (cp & 0x3F));
                        } else {
                                out[o++] = (char)(0xF0 | cp >> 18);
                                out[o++] = (char)(0x80 | (cp >> 12 & 0x3F));
                                out[o++] = (char)(0x80 | (cp >> 6 & 0x3F));
                                out[o++] = (char)(0x80 | (cp & 0x3F));
                        }
                        break;
                default: out[o++] = *p; break; /* \" \\ \/ */
                }
        }
        return o;
}

static size_t parse_ids(const char *p, int32_t *ids, size_t cap) {
        size_t n = 0;
        char *end;

        for (;;) {
                while (*p && !(*p >= '0' && *p <= '9'))
                        p++;
                if (!*p)
                        return n;
                assert_true(n < cap);
                ids[n++] = (int32_t)strtol(p, &end, 10);
                p = end;
        }
}

static void expect_encoding(const struct bpe *b, const char *text, size_t len, const int32_t *want,
                            size_t n_want, const char *what) {
        int32_t *got = malloc((len + 1) * sizeof(*got));
        char *back = malloc(len + 1);
        size_t n = 0, back_len = 0;

        assert_int_equal(bpe_encode(b, text, len, false, true, got, len + 1, &n), 0);
        if (n != n_want || memcmp(got, want, n * sizeof(*got)))
                print_error("%s: %zu ids, %zu expected\n", what, n, n_want);
        assert_int_equal(n, n_want);
        assert_memory_equal(got, want, n * sizeof(*got));
        assert_int_equal(bpe_decode(b, got, n, back, len + 1, &back_len), 0);
        assert_int_equal(back_len, len);
        assert_memory_equal(back, text, len);
        free(got);
        free(back);
}

static void smollm_encodes_the_36_reference_cases(void **state) {
        struct smollm *s = *state;
        char path[4200], line[8192], text[8192], what[64];
        int32_t want[1024];
        int cases = 0;
        FILE *f;

        if (!s->b)
                skip();
        snprintf(path, sizeof(path), "%s/tokenizer-cases.jsonl", s->dir);
        f = fopen(path, "r");
        assert_non_null(f);
        while (fgets(line, sizeof(line), f)) {
                size_t len = json_text(line, text), n = parse_ids(strstr(line, "\"ids\""), want, 1024);

                snprintf(what, sizeof(what), "case %d", cases);
                expect_encoding(s->b, text, len, want, n, what);
                cases++;
        }
        fclose(f);
        assert_int_equal(cases, 36);
}

/* The rendered prompt must be line 3 of the golden file and encode to its prompt_ids. */
static void smollm_chat_prompt_matches_golden(const struct smollm *s, const char *name, const char *user) {
        struct chat_msg m[] = { { "user", user } };
        char path[4200], line[16384], prompt[4096], quoted[4096 + 64];
        int32_t want[256];
        size_t len, n = 0;
        FILE *f;

        snprintf(path, sizeof(path), "%s/golden-%s.txt", s->dir, name);
        f = fopen(path, "r");
        assert_non_null(f);
        assert_int_equal(chat_render(m, 1, true, prompt, sizeof(prompt), &len), 0);
        while (fgets(line, sizeof(line), f)) {
                if (!strncmp(line, "# prompt (chat): ", 17)) { /* the prompt JSON-escaped: \n only */
                        size_t q = 0;

                        for (size_t i = 0; i < len; i++) {
                                if (prompt[i] == '\n') {
                                        quoted[q++] = '\\';
                                        quoted[q++] = 'n';
                                } else {
                                        quoted[q++] = prompt[i];
                                }
                        }
                        quoted[q] = '\0';
                        assert_int_equal(strncmp(line + 18, quoted, q), 0);
                        assert_string_equal(line + 18 + q, "\"\n");
                }
                if (!strncmp(line, "prompt_ids: ", 12))
                        n = parse_ids(line + 12, want, 256);
        }
        fclose(f);
        assert_true(n > 0);
        expect_encoding(s->b, prompt, len, want, n, name);
}

static void smollm_encodes_both_golden_chat_prompts(void **state) {
        struct smollm *s = *state;

        if (!s->b)
                skip();
        smollm_chat_prompt_matches_golden(s, "chat-capital", "What is the capital of France?");
        smollm_chat_prompt_matches_golden(s, "chat-poem", "Write a short poem about the sea.");
}

static void smollm_vocabulary_has_the_documented_specials(void **state) {
        struct smollm *s = *state;

        if (!s->b)
                skip();
        assert_int_equal(bpe_n_vocab(s->b), 49152);
        assert_int_equal(bpe_bos_id(s->b), 1);
        assert_int_equal(bpe_eos_id(s->b), 2);
        assert_int_equal(bpe_unk_id(s->b), 0);
        assert_int_equal(bpe_pad_id(s->b), 2);
        assert_false(bpe_add_bos(s->b));
        assert_int_equal(bpe_find(s->b, "<|im_start|>", 12), 1);
        assert_int_equal(bpe_token_type(s->b, 2), BPE_TOKEN_CONTROL);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(bpe_merges_lowest_rank_first),
                cmocka_unit_test(bpe_merges_leftmost_pair_on_equal_rank),
                cmocka_unit_test(bpe_smollm_splits_every_digit_and_gpt2_does_not),
                cmocka_unit_test(bpe_space_run_leaves_its_last_space_to_the_next_word),
                cmocka_unit_test(bpe_contractions_are_lowercase_only),
                cmocka_unit_test(bpe_letters_numbers_and_others_form_separate_words),
                cmocka_unit_test(bpe_parses_specials_only_when_asked),
                cmocka_unit_test(bpe_cuts_the_longest_special_first),
                cmocka_unit_test(bpe_special_decodes_to_its_text),
                cmocka_unit_test(bpe_invalid_utf8_is_single_bytes_and_round_trips),
                cmocka_unit_test(bpe_drops_a_byte_that_has_no_token),
                cmocka_unit_test(bpe_encode_respects_capacity_and_bos),
                cmocka_unit_test(bpe_decode_refuses_bad_ids_and_small_buffers),
                cmocka_unit_test(bpe_utf8_tail_counts_an_unfinished_character),
                cmocka_unit_test(bpe_new_refuses_merge_of_unknown_token),
                cmocka_unit_test(bpe_new_refuses_merge_whose_result_is_missing),
                cmocka_unit_test(bpe_new_refuses_merge_without_space),
                cmocka_unit_test(bpe_new_refuses_token_outside_the_alphabet),
                cmocka_unit_test(bpe_new_refuses_bad_types_and_ids),
                cmocka_unit_test(bpe_heap_merge_loop_matches_quadratic_reference),
                cmocka_unit_test(bpe_megabyte_of_punctuation_is_one_word_and_fast),
                cmocka_unit_test(chat_inserts_default_system_prompt),
                cmocka_unit_test(chat_keeps_a_given_system_prompt_and_turns),
                cmocka_unit_test(chat_refuses_small_buffer_and_bad_roles),
        };

        const struct CMUnitTest real[] = {
                cmocka_unit_test(smollm_vocabulary_has_the_documented_specials),
                cmocka_unit_test(smollm_encodes_the_36_reference_cases),
                cmocka_unit_test(smollm_encodes_both_golden_chat_prompts),
        };
        int failed = cmocka_run_group_tests(tests, NULL, NULL);

        return failed + cmocka_run_group_tests_name("smollm2", real, smollm_setup, smollm_teardown);
}
