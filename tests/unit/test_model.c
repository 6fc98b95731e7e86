/* test_model.c - unit tests of the reference model runner: model.c, tokenizer.c, sampler.c.
 *
 * Owns: the known-answer test (greedy decoding of stories260K reproduces golden-greedy-256.txt
 * byte for byte), the loaders' rejection of malformed files, the tokenizer's agreement with a
 * literal transcription of llama2.c's quadratic encoder, and the sampler's determinism.
 *
 * The model directory is $KVC_STORIES_DIR, or ../shared/models/stories260K relative to the current
 * directory (tests run from the project root).
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "model.h"
#include "sampler.h"
#include "tokenizer.h"

#define GREEDY_STEPS 256

struct fixture {
        char dir[4096];
        unsigned char *model_bytes;
        size_t model_len;
        unsigned char *tok_bytes;
        size_t tok_len;
        struct model *model;
        struct tokenizer *tok;
};

static struct fixture fx;

static int read_whole_file(const char *path, unsigned char **ret, size_t *ret_len) {
        FILE *f = fopen(path, "rb");
        unsigned char *buf;
        long len;

        if (!f)
                return -errno;
        if (fseek(f, 0, SEEK_END) < 0 || (len = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) < 0) {
                fclose(f);
                return -EIO;
        }
        buf = malloc((size_t)len + 1);
        if (!buf || fread(buf, 1, (size_t)len, f) != (size_t)len) {
                free(buf);
                fclose(f);
                return -EIO;
        }
        fclose(f);
        *ret = buf;
        *ret_len = (size_t)len;
        return 0;
}

static void fixture_path(char *buf, size_t cap, const char *name) {
        int n = snprintf(buf, cap, "%s/%s", fx.dir, name);

        assert_true(n > 0 && (size_t)n < cap);
}

static int group_setup(void **state) {
        const char *dir = getenv("KVC_STORIES_DIR");
        char path[4200];

        (void)state;
        if (!dir || !*dir)
                dir = "../shared/models/stories260K";
        if ((size_t)snprintf(fx.dir, sizeof(fx.dir), "%s", dir) >= sizeof(fx.dir))
                return -1;
        fixture_path(path, sizeof(path), "stories260K.bin");
        if (read_whole_file(path, &fx.model_bytes, &fx.model_len) < 0 || model_load(path, &fx.model) < 0)
                goto fail;
        fixture_path(path, sizeof(path), "tok512.bin");
        if (read_whole_file(path, &fx.tok_bytes, &fx.tok_len) < 0 ||
            tokenizer_load(path, model_get_config(fx.model)->vocab_size, &fx.tok) < 0)
                goto fail;
        return 0;
fail:
        fprintf(stderr, "test_model: cannot load %s (set KVC_STORIES_DIR or run from the project root)\n",
                path);
        return -1;
}

static int group_teardown(void **state) {
        (void)state;
        fx.model = model_free(fx.model);
        fx.tok = tokenizer_free(fx.tok);
        free(fx.model_bytes);
        free(fx.tok_bytes);
        return 0;
}

/* A private copy of the checkpoint with header field idx (0..6) replaced. */
static unsigned char *model_copy_with_field(int idx, int32_t value) {
        unsigned char *copy = malloc(fx.model_len);

        assert_non_null(copy);
        memcpy(copy, fx.model_bytes, fx.model_len);
        memcpy(copy + 4 * idx, &value, sizeof(value));
        return copy;
}

static void assert_model_buffer_rejected(const void *data, size_t len) {
        struct model *m = (struct model *)0x1;

        assert_int_equal(model_load_buffer(data, len, &m), -EINVAL);
        assert_ptr_equal(m, (struct model *)0x1);
}

static void assert_field_rejected(int idx, int32_t value) {
        unsigned char *copy = model_copy_with_field(idx, value);

        assert_model_buffer_rejected(copy, fx.model_len);
        free(copy);
}

/* Writes data to a fresh temporary file; the caller unlinks path. */
static void write_temp_file(const void *data, size_t len, char *path, size_t cap) {
        const char *tmp = getenv("TMPDIR");
        int fd;

        assert_true((size_t)snprintf(path, cap, "%s/kvc-test-XXXXXX", tmp && *tmp ? tmp : "/tmp") < cap);
        fd = mkstemp(path);
        assert_true(fd >= 0);
        assert_true(write(fd, data, len) == (ssize_t)len);
        assert_int_equal(close(fd), 0);
}

static size_t rope_tables_bytes(const struct model_config *c) {
        return (size_t)c->seq_len * (size_t)(c->dim / c->n_heads) * sizeof(float);
}

/* Runs tokens through a fresh plain cache and returns a copy of the last logits. */
static float *logits_after(struct model *m, const int *tokens, int n) {
        const struct model_config *cfg = model_get_config(m);
        struct plain_cache *c = NULL;
        float *logits = NULL, *copy;

        assert_int_equal(plain_cache_new(cfg, cfg->seq_len, &c), 0);
        for (int pos = 0; pos < n; pos++)
                assert_int_equal(model_forward(m, tokens[pos], pos, &plain_cache_ops, c, &logits), 0);
        copy = malloc((size_t)cfg->vocab_size * sizeof(float));
        assert_non_null(copy);
        memcpy(copy, logits, (size_t)cfg->vocab_size * sizeof(float));
        plain_cache_free(c);
        return copy;
}

static void model_greedy_decoding_reproduces_golden_text(void **state) {
        const struct model_config *cfg = model_get_config(fx.model);
        struct plain_cache *c = NULL;
        unsigned char *golden;
        size_t golden_len, out_len = 0, cap = GREEDY_STEPS * 64;
        char path[4200], piece[64], *out = malloc(cap);
        int token = TOKENIZER_BOS;

        (void)state;
        assert_non_null(out);
        fixture_path(path, sizeof(path), "golden-greedy-256.txt");
        assert_int_equal(read_whole_file(path, &golden, &golden_len), 0);
        assert_int_equal(plain_cache_new(cfg, cfg->seq_len, &c), 0);

        for (int pos = 0; pos < GREEDY_STEPS; pos++) {
                float *logits;
                int next;
                size_t n;

                assert_int_equal(model_forward(fx.model, token, pos, &plain_cache_ops, c, &logits), 0);
                assert_int_equal(sampler_argmax(logits, cfg->vocab_size, &next), 0);
                assert_int_equal(tokenizer_piece_safe(fx.tok, token, next, piece, sizeof(piece), &n), 0);
                assert_true(out_len + n <= cap);
                memcpy(out + out_len, piece, n);
                out_len += n;
                token = next;
        }
        /* The golden file is exactly the decoded text: 565 bytes, no trailing newline. */
        assert_int_equal(golden_len, 565);
        assert_int_not_equal(golden[golden_len - 1], '\n');
        assert_int_equal(out_len, golden_len);
        assert_memory_equal(out, golden, golden_len);

        plain_cache_free(c);
        free(golden);
        free(out);
}

static void model_load_buffer_matches_model_load(void **state) {
        const struct model_config *cfg = model_get_config(fx.model);
        struct model *m = NULL;
        int tokens[] = { TOKENIZER_BOS, 300, 42, 317 };
        float *a, *b;

        (void)state;
        assert_int_equal(model_load_buffer(fx.model_bytes, fx.model_len, &m), 0);
        assert_memory_equal(model_get_config(m), cfg, sizeof(*cfg));
        assert_int_equal(cfg->dim, 64);
        assert_int_equal(cfg->hidden_dim, 172);
        assert_int_equal(cfg->n_layers, 5);
        assert_int_equal(cfg->n_heads, 8);
        assert_int_equal(cfg->n_kv_heads, 4);
        assert_int_equal(cfg->vocab_size, 512);
        assert_int_equal(cfg->seq_len, 512);
        a = logits_after(fx.model, tokens, 4);
        b = logits_after(m, tokens, 4);
        assert_memory_equal(a, b, (size_t)cfg->vocab_size * sizeof(float));
        free(a);
        free(b);
        model_free(m);
}

static void model_accepts_checkpoint_without_rope_tables(void **state) {
        const struct model_config *cfg = model_get_config(fx.model);
        size_t len = fx.model_len - rope_tables_bytes(cfg);
        int tokens[] = { TOKENIZER_BOS, 259, 260 };
        struct model *m = NULL;
        float *a, *b;

        (void)state;
        assert_int_equal(model_load_buffer(fx.model_bytes, len, &m), 0);
        a = logits_after(fx.model, tokens, 3);
        b = logits_after(m, tokens, 3);
        assert_memory_equal(a, b, (size_t)cfg->vocab_size * sizeof(float));
        free(a);
        free(b);
        model_free(m);
}

static void model_accepts_separate_classifier_when_vocab_is_negative(void **state) {
        const struct model_config *cfg = model_get_config(fx.model);
        size_t cls_bytes = (size_t)cfg->vocab_size * (size_t)cfg->dim * sizeof(float);
        size_t len = fx.model_len + cls_bytes;
        unsigned char *copy = malloc(len);
        int32_t neg = -cfg->vocab_size;
        int tokens[] = { TOKENIZER_BOS, 400 };
        struct model *m = NULL;
        float *a, *b;

        (void)state;
        assert_non_null(copy);
        /* The classifier, a copy of the embedding, follows the RoPE tables: same logits. */
        memcpy(copy, fx.model_bytes, fx.model_len);
        memcpy(copy + fx.model_len, fx.model_bytes + 28, cls_bytes);
        memcpy(copy + 20, &neg, sizeof(neg));
        assert_int_equal(model_load_buffer(copy, len, &m), 0);
        assert_int_equal(model_get_config(m)->vocab_size, cfg->vocab_size);
        a = logits_after(fx.model, tokens, 2);
        b = logits_after(m, tokens, 2);
        assert_memory_equal(a, b, (size_t)cfg->vocab_size * sizeof(float));
        free(a);
        free(b);
        model_free(m);
        free(copy);
}

static void model_rejects_truncated_file(void **state) {
        size_t cuts[] = { 0, 1, 27, 28, 32, 4096, fx.model_len / 2, fx.model_len - 4, fx.model_len - 1 };
        char path[4200];
        struct model *m = (struct model *)0x1;

        (void)state;
        for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++)
                assert_model_buffer_rejected(fx.model_bytes, cuts[i]);
        /* Without the RoPE tables and then one float short. */
        assert_model_buffer_rejected(fx.model_bytes,
                                     fx.model_len - rope_tables_bytes(model_get_config(fx.model)) - 4);

        write_temp_file(fx.model_bytes, fx.model_len - 100, path, sizeof(path));
        assert_int_equal(model_load(path, &m), -EINVAL);
        assert_ptr_equal(m, (struct model *)0x1);
        unlink(path);
        write_temp_file(fx.model_bytes, 10, path, sizeof(path));
        assert_int_equal(model_load(path, &m), -EINVAL);
        assert_ptr_equal(m, (struct model *)0x1);
        unlink(path);
}

static void model_rejects_trailing_garbage(void **state) {
        unsigned char *copy = malloc(fx.model_len + 8);
        char path[4200];
        struct model *m = (struct model *)0x1;

        (void)state;
        assert_non_null(copy);
        memcpy(copy, fx.model_bytes, fx.model_len);
        memset(copy + fx.model_len, 0x5a, 8);
        assert_model_buffer_rejected(copy, fx.model_len + 1);
        assert_model_buffer_rejected(copy, fx.model_len + 4);
        assert_model_buffer_rejected(copy, fx.model_len + 8);

        write_temp_file(copy, fx.model_len + 4, path, sizeof(path));
        assert_int_equal(model_load(path, &m), -EINVAL);
        assert_ptr_equal(m, (struct model *)0x1);
        unlink(path);
        free(copy);
}

static void model_rejects_zero_layers(void **state) {
        (void)state;
        assert_field_rejected(2, 0);
        assert_field_rejected(2, -5);
}

static void model_rejects_heads_not_divisible_by_kv_heads(void **state) {
        (void)state;
        assert_field_rejected(4, 3);  /* 8 % 3 */
        assert_field_rejected(4, 16); /* more KV heads than heads */
        assert_field_rejected(3, 6);  /* 64 % 6: dim not divisible by heads */
        assert_field_rejected(3, 64); /* head_dim 1: odd, RoPE needs pairs */
}

static void model_rejects_huge_or_nonpositive_dims(void **state) {
        int32_t bad[] = { 0, -1, INT32_MIN, INT32_MAX, 1 << 30 };

        (void)state;
        for (int idx = 0; idx < 7; idx++)
                for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
                        assert_field_rejected(idx, bad[i]);
        /* In range but inconsistent with the file size. */
        assert_field_rejected(0, 128);
        assert_field_rejected(1, 173);
        assert_field_rejected(5, 513);
        assert_field_rejected(6, 1024);
}

static void model_load_reports_missing_file(void **state) {
        struct model *m = (struct model *)0x1;
        char path[4200];

        (void)state;
        fixture_path(path, sizeof(path), "no-such-checkpoint.bin");
        assert_int_equal(model_load(path, &m), -ENOENT);
        assert_int_equal(model_load(fx.dir, &m), -EINVAL); /* a directory */
        assert_ptr_equal(m, (struct model *)0x1);
        assert_null(model_free(NULL));
}

static void model_forward_rejects_bad_token_and_position(void **state) {
        const struct model_config *cfg = model_get_config(fx.model);
        struct plain_cache *c = NULL;
        float *logits = (float *)0x1;

        (void)state;
        assert_int_equal(plain_cache_new(cfg, 8, &c), 0);
        assert_int_equal(model_forward(fx.model, -1, 0, &plain_cache_ops, c, &logits), -EINVAL);
        assert_int_equal(model_forward(fx.model, cfg->vocab_size, 0, &plain_cache_ops, c, &logits), -EINVAL);
        assert_int_equal(model_forward(fx.model, 1, -1, &plain_cache_ops, c, &logits), -EINVAL);
        assert_int_equal(model_forward(fx.model, 1, 0, NULL, c, &logits), -EINVAL);
        assert_ptr_equal(logits, (float *)0x1);
        plain_cache_free(c);
}

static void plain_cache_refuses_positions_it_cannot_hold(void **state) {
        const struct model_config *cfg = model_get_config(fx.model);
        struct plain_cache *c = NULL;
        float *logits;

        (void)state;
        assert_int_equal(plain_cache_new(cfg, 0, &c), -EINVAL);
        assert_int_equal(plain_cache_new(cfg, (1 << 24) + 1, &c), -EINVAL);
        assert_null(c);
        assert_int_equal(plain_cache_new(cfg, 3, &c), 0);
        /* A gap: position 1 before position 0. */
        assert_int_equal(model_forward(fx.model, 1, 1, &plain_cache_ops, c, &logits), -EINVAL);
        for (int pos = 0; pos < 3; pos++)
                assert_int_equal(model_forward(fx.model, 1 + pos, pos, &plain_cache_ops, c, &logits), 0);
        assert_int_equal(model_forward(fx.model, 5, 3, &plain_cache_ops, c, &logits), -ERANGE);
        assert_null(plain_cache_free(c));
        assert_null(plain_cache_free(NULL));
}

static void plain_cache_rewind_recomputes_the_same_logits(void **state) {
        const struct model_config *cfg = model_get_config(fx.model);
        int tokens[] = { TOKENIZER_BOS, 317, 300, 280 };
        struct plain_cache *c = NULL;
        float *logits, *expected = logits_after(fx.model, tokens, 4);

        (void)state;
        assert_int_equal(plain_cache_new(cfg, 16, &c), 0);
        for (int pos = 0; pos < 4; pos++)
                assert_int_equal(model_forward(fx.model, pos == 3 ? 500 : tokens[pos], pos, &plain_cache_ops,
                                               c, &logits),
                                 0);
        /* Rewind to position 3 with the intended token. */
        assert_int_equal(model_forward(fx.model, tokens[3], 3, &plain_cache_ops, c, &logits), 0);
        assert_memory_equal(logits, expected, (size_t)cfg->vocab_size * sizeof(float));
        plain_cache_reset(c);
        for (int pos = 0; pos < 4; pos++)
                assert_int_equal(model_forward(fx.model, tokens[pos], pos, &plain_cache_ops, c, &logits), 0);
        assert_memory_equal(logits, expected, (size_t)cfg->vocab_size * sizeof(float));
        plain_cache_free(c);
        free(expected);
}

/* --- tokenizer --- */

static void assert_tokenizer_buffer_rejected(const void *data, size_t len, int vocab_size) {
        struct tokenizer *t = (struct tokenizer *)0x1;

        assert_int_equal(tokenizer_load_buffer(data, len, vocab_size, &t), -EINVAL);
        assert_ptr_equal(t, (struct tokenizer *)0x1);
}

/* Offset of token idx's (score, length) record in tok512.bin. */
static size_t tok_record_offset(int idx) {
        size_t at = 4;

        for (int i = 0; i < idx; i++) {
                int32_t n;

                memcpy(&n, fx.tok_bytes + at + 4, sizeof(n));
                at += 8 + (size_t)n;
        }
        return at;
}

static void tokenizer_rejects_truncated_file(void **state) {
        struct tokenizer *t = (struct tokenizer *)0x1;
        char path[4200];

        (void)state;
        for (size_t len = 0; len < fx.tok_len; len++)
                assert_tokenizer_buffer_rejected(fx.tok_bytes, len, 512);
        write_temp_file(fx.tok_bytes, fx.tok_len - 1, path, sizeof(path));
        assert_int_equal(tokenizer_load(path, 512, &t), -EINVAL);
        assert_ptr_equal(t, (struct tokenizer *)0x1);
        unlink(path);
}

static void tokenizer_rejects_absurd_lengths(void **state) {
        int32_t bad_max[] = { 0, -1, INT32_MIN, INT32_MAX, 1 << 20 };
        int32_t bad_len[] = { -1, INT32_MIN, INT32_MAX, 8, 1 << 20 };
        unsigned char *copy = malloc(fx.tok_len + 4);
        size_t rec = tok_record_offset(100);

        (void)state;
        assert_non_null(copy);
        for (size_t i = 0; i < sizeof(bad_max) / sizeof(bad_max[0]); i++) {
                memcpy(copy, fx.tok_bytes, fx.tok_len);
                memcpy(copy, &bad_max[i], 4);
                assert_tokenizer_buffer_rejected(copy, fx.tok_len, 512);
        }
        /* A piece longer than max_token_length (7), negative, or past the end. */
        for (size_t i = 0; i < sizeof(bad_len) / sizeof(bad_len[0]); i++) {
                memcpy(copy, fx.tok_bytes, fx.tok_len);
                memcpy(copy + rec + 4, &bad_len[i], 4);
                assert_tokenizer_buffer_rejected(copy, fx.tok_len, 512);
        }
        /* Trailing bytes, too few or too many entries for the vocabulary size. */
        memcpy(copy, fx.tok_bytes, fx.tok_len);
        memset(copy + fx.tok_len, 0, 4);
        assert_tokenizer_buffer_rejected(copy, fx.tok_len + 1, 512);
        assert_tokenizer_buffer_rejected(copy, fx.tok_len + 4, 512);
        assert_tokenizer_buffer_rejected(fx.tok_bytes, fx.tok_len, 513);
        assert_tokenizer_buffer_rejected(fx.tok_bytes, fx.tok_len, 511);
        /* Vocabulary sizes that cannot hold the byte tokens, or absurd ones. */
        assert_tokenizer_buffer_rejected(fx.tok_bytes, fx.tok_len, 258);
        assert_tokenizer_buffer_rejected(fx.tok_bytes, fx.tok_len, 0);
        assert_tokenizer_buffer_rejected(fx.tok_bytes, fx.tok_len, -512);
        assert_tokenizer_buffer_rejected(fx.tok_bytes, fx.tok_len, INT_MAX);
        free(copy);
}

static void tokenizer_load_reports_missing_file(void **state) {
        struct tokenizer *t = (struct tokenizer *)0x1;
        char path[4200];

        (void)state;
        fixture_path(path, sizeof(path), "no-such-tokenizer.bin");
        assert_int_equal(tokenizer_load(path, 512, &t), -ENOENT);
        assert_ptr_equal(t, (struct tokenizer *)0x1);
        assert_null(tokenizer_free(NULL));
}

/* The llama2.c decoding of tokens[1..n) (each piece after its predecessor, tokens[0] only as the
 * first predecessor, as in generation after BOS), written to out. */
static size_t decode_all(const int *tokens, size_t n, char *out, size_t cap) {
        size_t len = 0;

        for (size_t i = 1; i < n; i++) {
                const char *piece;
                size_t plen;

                assert_int_equal(tokenizer_decode(fx.tok, tokens[i - 1], tokens[i], &piece, &plen), 0);
                assert_true(len + plen <= cap);
                memcpy(out + len, piece, plen);
                len += plen;
        }
        return len;
}

static const char *const sentences[] = {
        "Once upon a time, there was a little girl named Lily.",
        "She loved to play outside in the park. One day, she saw a big, red ball.",
        "Lily's mom said, \"Don't worry, Lily. We can help you.\"",
        "Tom and Sue went to the zoo!\nThey saw a lion.\n\nThe end.",
        "  leading spaces, tabs\tand UTF-8: caf\xc3\xa9, \xe2\x80\x9cquotes\xe2\x80\x9d, \xf0\x9f\x98\x80.",
        "\xe2\x80\x8a hair space and stray bytes \x80\xff\xc3",
        /* Equal-score pairs ("ll" twice in "alll"): llama2.c merges the leftmost first. */
        "alll pppp oooooo, it was sooo goood and the hill was tallll.",
};

static void tokenizer_round_trips_sentences(void **state) {
        int tokens[512];
        char out[1024];

        (void)state;
        for (size_t s = 0; s < sizeof(sentences) / sizeof(sentences[0]); s++) {
                size_t len = strlen(sentences[s]), n = 0, out_len;

                assert_int_equal(tokenizer_encode(fx.tok, sentences[s], len, true, false, tokens, 512, &n),
                                 0);
                assert_true(n >= 2 && n <= len + 2);
                assert_int_equal(tokens[0], TOKENIZER_BOS);
                out_len = decode_all(tokens, n, out, sizeof(out));
                assert_int_equal(out_len, len);
                assert_memory_equal(out, sentences[s], len);
        }
}

static bool contains(const int *tokens, size_t n, int id) {
        for (size_t i = 0; i < n; i++)
                if (tokens[i] == id)
                        return true;
        return false;
}

static void tokenizer_encodes_lily_as_token_317(void **state) {
        const char *text = "Once upon a time, there was a little girl named Lily.";
        int tokens[64];
        size_t n = 0;

        (void)state;
        assert_int_equal(tokenizer_encode(fx.tok, " Lily", 5, false, false, tokens, 64, &n), 0);
        assert_true(contains(tokens, n, 317));
        assert_int_equal(tokenizer_encode(fx.tok, "Lily", 4, false, false, tokens, 64, &n), 0);
        assert_int_equal(n, 1);
        assert_int_equal(tokens[0], 317);
        assert_int_equal(tokenizer_encode(fx.tok, text, strlen(text), true, true, tokens, 64, &n), 0);
        assert_true(contains(tokens, n, 317));
        assert_int_equal(tokens[n - 1], TOKENIZER_EOS);
}

static void tokenizer_encodes_newline_as_byte_token(void **state) {
        int tokens[64];
        size_t n = 0;

        (void)state;
        /* "\n" is not a piece of tok512, so it falls back to <0x0A> = 3 + 10, and byte tokens never
         * merge (their pieces are the six characters "<0x0A>"). */
        assert_int_equal(tokenizer_encode(fx.tok, "a\n\nb", 4, false, false, tokens, 64, &n), 0);
        assert_true(n >= 3);
        assert_true(contains(tokens, n, TOKENIZER_FIRST_BYTE_TOKEN + '\n'));
        assert_int_equal(tokenizer_encode(fx.tok, "\n", 1, false, false, tokens, 64, &n), 0);
        assert_int_equal(n, 2);
        assert_int_equal(tokens[1], 13);
}

static void tokenizer_encode_handles_empty_text_and_small_capacity(void **state) {
        const char *text = "Once upon a time";
        int tokens[64] = { 0 };
        size_t n = 77, need;

        (void)state;
        assert_int_equal(tokenizer_encode(fx.tok, "", 0, true, true, tokens, 64, &n), 0);
        assert_int_equal(n, 2);
        assert_int_equal(tokens[0], TOKENIZER_BOS);
        assert_int_equal(tokens[1], TOKENIZER_EOS);
        assert_int_equal(tokenizer_encode(fx.tok, NULL, 0, false, false, tokens, 64, &n), 0);
        assert_int_equal(n, 0);

        assert_int_equal(tokenizer_encode(fx.tok, text, strlen(text), true, false, tokens, 64, &need), 0);
        memset(tokens, 0, sizeof(tokens));
        n = 77;
        assert_int_equal(tokenizer_encode(fx.tok, text, strlen(text), true, false, tokens, need - 1, &n),
                         -ENOBUFS);
        assert_int_equal(n, 77);
        assert_int_equal(tokens[0], 0);
        assert_int_equal(tokenizer_encode(fx.tok, text, strlen(text), true, false, tokens, need, &n), 0);
        assert_int_equal(n, need);
        assert_int_equal(tokenizer_encode(fx.tok, NULL, 3, false, false, tokens, 64, &n), -EINVAL);
        /* The length limit is checked before the text is read. */
        assert_int_equal(tokenizer_encode(fx.tok, text, ((size_t)1 << 28) + 1, false, false, tokens, 64, &n),
                         -EINVAL);
        assert_int_equal(n, need);
}

static void tokenizer_decode_strips_space_after_bos_and_maps_byte_tokens(void **state) {
        const char *piece;
        size_t len;

        (void)state;
        assert_int_equal(tokenizer_decode(fx.tok, -1, 317, &piece, &len), 0);
        assert_int_equal(len, 5);
        assert_memory_equal(piece, " Lily", 5);
        assert_int_equal(tokenizer_decode(fx.tok, TOKENIZER_BOS, 317, &piece, &len), 0);
        assert_int_equal(len, 4);
        assert_memory_equal(piece, "Lily", 4);
        assert_int_equal(tokenizer_decode(fx.tok, 5, 13, &piece, &len), 0);
        assert_int_equal(len, 1);
        assert_int_equal(piece[0], '\n');
        assert_int_equal(tokenizer_decode(fx.tok, 5, 3 + 0xff, &piece, &len), 0);
        assert_int_equal(len, 1);
        assert_int_equal((unsigned char)piece[0], 0xff);
        assert_int_equal(tokenizer_decode(fx.tok, 5, TOKENIZER_BOS, &piece, &len), 0);
        assert_int_equal(len, 5);
        assert_memory_equal(piece, "\n<s>\n", 5);
        assert_int_equal(tokenizer_decode(fx.tok, 5, 512, &piece, &len), -EINVAL);
        assert_int_equal(tokenizer_decode(fx.tok, 5, -1, &piece, &len), -EINVAL);
}

static void tokenizer_piece_safe_drops_control_bytes(void **state) {
        char buf[16];
        size_t len = 99;

        (void)state;
        assert_int_equal(tokenizer_piece_safe(fx.tok, 5, 3 + 0x07, buf, sizeof(buf), &len), 0); /* BEL */
        assert_int_equal(len, 0);
        assert_string_equal(buf, "");
        assert_int_equal(tokenizer_piece_safe(fx.tok, 5, 3 + 0xc3, buf, sizeof(buf), &len),
                         0); /* lone byte */
        assert_int_equal(len, 0);
        assert_int_equal(tokenizer_piece_safe(fx.tok, 5, 3 + '\t', buf, sizeof(buf), &len), 0);
        assert_int_equal(len, 1);
        assert_string_equal(buf, "\t");
        assert_int_equal(tokenizer_piece_safe(fx.tok, 5, 511, buf, sizeof(buf), &len), 0); /* UTF-8 piece */
        assert_int_equal(len, 3);
        assert_string_equal(buf, "\xe2\x80\x8a");
        len = 99;
        assert_int_equal(tokenizer_piece_safe(fx.tok, 5, 317, buf, 5, &len), -ENOBUFS);
        assert_int_equal(len, 99);
        assert_int_equal(tokenizer_piece_safe(fx.tok, 5, 317, buf, 6, &len), 0);
        assert_string_equal(buf, " Lily");
        assert_true(tokenizer_max_piece_bytes(fx.tok) == 7);
        assert_int_equal(tokenizer_vocab_size(fx.tok), 512);
}

/* llama2.c's encode, transcribed: byte strings instead of C strings, linear lookup, quadratic
 * merge loop, merges starting after BOS. The oracle the heap encoder must agree with. */
struct naive_vocab {
        int n;
        float scores[512];
        char pieces[512][8];
        int lens[512];
};

static void naive_vocab_load(struct naive_vocab *v) {
        size_t at = 4;

        v->n = 512;
        for (int i = 0; i < 512; i++) {
                memcpy(&v->scores[i], fx.tok_bytes + at, 4);
                memcpy(&v->lens[i], fx.tok_bytes + at + 4, 4);
                assert_true(v->lens[i] >= 0 && v->lens[i] <= 7);
                memcpy(v->pieces[i], fx.tok_bytes + at + 8, (size_t)v->lens[i]);
                at += 8 + (size_t)v->lens[i];
        }
}

static int naive_lookup(const struct naive_vocab *v, const char *s, int len) {
        for (int i = 0; i < v->n; i++)
                if (v->lens[i] == len && memcmp(v->pieces[i], s, (size_t)len) == 0)
                        return i;
        return -1;
}

static size_t naive_encode(const struct naive_vocab *v, const char *text, size_t text_len, int *tokens) {
        size_t n = 0;
        char buf[16];
        int buf_len = 0;

        if (text_len)
                tokens[n++] = naive_lookup(v, " ", 1);
        for (size_t i = 0; i < text_len; i++) {
                int id;

                if ((text[i] & 0xC0) != 0x80)
                        buf_len = 0;
                buf[buf_len++] = text[i];
                if (i + 1 < text_len && (text[i + 1] & 0xC0) == 0x80 && buf_len < 4)
                        continue;
                id = naive_lookup(v, buf, buf_len);
                if (id != -1)
                        tokens[n++] = id;
                else
                        for (int j = 0; j < buf_len; j++)
                                tokens[n++] = (unsigned char)buf[j] + 3;
                buf_len = 0;
        }
        for (;;) {
                float best_score = -1e10f;
                int best_id = -1;
                long best_idx = -1;

                for (size_t i = 0; i + 1 < n; i++) {
                        int la = v->lens[tokens[i]], lb = v->lens[tokens[i + 1]], id;

                        memcpy(buf, v->pieces[tokens[i]], (size_t)la);
                        memcpy(buf + la, v->pieces[tokens[i + 1]], (size_t)lb);
                        id = naive_lookup(v, buf, la + lb);
                        if (id != -1 && v->scores[id] > best_score) {
                                best_score = v->scores[id];
                                best_id = id;
                                best_idx = (long)i;
                        }
                }
                if (best_idx == -1)
                        break;
                tokens[best_idx] = best_id;
                for (size_t i = (size_t)best_idx + 1; i + 1 < n; i++)
                        tokens[i] = tokens[i + 1];
                n--;
        }
        return n;
}

static void tokenizer_encode_matches_llama2c_quadratic_encoder(void **state) {
        struct naive_vocab *v = malloc(sizeof(*v));
        const char *texts[sizeof(sentences) / sizeof(sentences[0]) + 1];
        size_t lens[sizeof(sentences) / sizeof(sentences[0]) + 1];
        unsigned char *sample = NULL;
        size_t sample_len = 0, n_texts = 0;
        char path[4200];
        int *a = malloc(4096 * sizeof(int)), *b = malloc(4096 * sizeof(int));

        (void)state;
        assert_non_null(v);
        assert_non_null(a);
        assert_non_null(b);
        naive_vocab_load(v);
        for (size_t s = 0; s < sizeof(sentences) / sizeof(sentences[0]); s++) {
                texts[n_texts] = sentences[s];
                lens[n_texts++] = strlen(sentences[s]);
        }
        /* A stretch of real text with blank lines and mis-encoded quotes, when it is present. */
        assert_true((size_t)snprintf(path, sizeof(path), "%s/../../data/tinystories/validation-sample.txt",
                                     fx.dir) < sizeof(path));
        if (read_whole_file(path, &sample, &sample_len) == 0) {
                texts[n_texts] = (const char *)sample;
                lens[n_texts++] = sample_len < 1500 ? sample_len : 1500;
        }
        for (size_t s = 0; s < n_texts; s++) {
                size_t na, nb = naive_encode(v, texts[s], lens[s], b);

                assert_int_equal(tokenizer_encode(fx.tok, texts[s], lens[s], false, false, a, 4096, &na), 0);
                assert_int_equal(na, nb);
                assert_memory_equal(a, b, na * sizeof(int));
        }
        free(sample);
        free(a);
        free(b);
        free(v);
}

/* --- sampler --- */

static void sampler_at_temperature_zero_is_argmax(void **state) {
        float logits[512];
        struct sampler *s = NULL;
        uint64_t x = 88172645463325252ull;

        (void)state;
        assert_int_equal(sampler_new(512, 0.0f, 7, &s), 0);
        for (int round = 0; round < 50; round++) {
                int want, got;

                for (int i = 0; i < 512; i++) {
                        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                        logits[i] = (float)(x % 20001) / 1000.0f - 10.0f;
                }
                assert_int_equal(sampler_argmax(logits, 512, &want), 0);
                assert_int_equal(sampler_sample(s, logits, &got), 0);
                assert_int_equal(got, want);
        }
        sampler_free(s);
}

static void sampler_argmax_takes_first_of_ties(void **state) {
        float v[] = { 1.0f, 3.0f, 2.0f, 3.0f };
        int got = -1;

        (void)state;
        assert_int_equal(sampler_argmax(v, 4, &got), 0);
        assert_int_equal(got, 1);
        got = -1;
        assert_int_equal(sampler_argmax(v, 0, &got), -EINVAL);
        assert_int_equal(got, -1);
}

static void sampler_same_seed_gives_same_sequence(void **state) {
        const struct model_config *cfg = model_get_config(fx.model);
        struct sampler *a = NULL, *b = NULL, *c = NULL;
        int tokens[] = { TOKENIZER_BOS, 317 };
        float *logits = logits_after(fx.model, tokens, 2);
        bool differs = false;

        (void)state;
        assert_int_equal(sampler_new(cfg->vocab_size, 1.0f, 1234, &a), 0);
        assert_int_equal(sampler_new(cfg->vocab_size, 1.0f, 1234, &b), 0);
        assert_int_equal(sampler_new(cfg->vocab_size, 1.0f, 99, &c), 0);
        for (int i = 0; i < 200; i++) {
                int ta, tb, tc;

                assert_int_equal(sampler_sample(a, logits, &ta), 0);
                assert_int_equal(sampler_sample(b, logits, &tb), 0);
                assert_int_equal(sampler_sample(c, logits, &tc), 0);
                assert_int_equal(ta, tb);
                assert_true(ta >= 0 && ta < cfg->vocab_size);
                differs |= ta != tc;
        }
        assert_true(differs);
        sampler_free(a);
        sampler_free(b);
        sampler_free(c);
        free(logits);
}

static void sampler_follows_the_softmax_distribution(void **state) {
        float logits[3] = { logf(0.5f), logf(0.25f), logf(0.25f) };
        int counts[3] = { 0 };
        struct sampler *s = NULL;

        (void)state;
        assert_int_equal(sampler_new(3, 1.0f, 0, &s), 0); /* seed 0 is replaced, not frozen */
        for (int i = 0; i < 20000; i++) {
                int t;

                assert_int_equal(sampler_sample(s, logits, &t), 0);
                counts[t]++;
        }
        assert_in_range(counts[0], 9500, 10500);
        assert_in_range(counts[1], 4500, 5500);
        assert_in_range(counts[2], 4500, 5500);
        sampler_free(s);
}

static void sampler_rejects_bad_arguments(void **state) {
        struct sampler *s = (struct sampler *)0x1;

        (void)state;
        assert_int_equal(sampler_new(512, -0.5f, 1, &s), -EINVAL);
        assert_int_equal(sampler_new(512, NAN, 1, &s), -EINVAL);
        assert_int_equal(sampler_new(512, INFINITY, 1, &s), -EINVAL);
        assert_int_equal(sampler_new(0, 1.0f, 1, &s), -EINVAL);
        assert_ptr_equal(s, (struct sampler *)0x1);
        assert_null(sampler_free(NULL));
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(model_greedy_decoding_reproduces_golden_text),
                cmocka_unit_test(model_load_buffer_matches_model_load),
                cmocka_unit_test(model_accepts_checkpoint_without_rope_tables),
                cmocka_unit_test(model_accepts_separate_classifier_when_vocab_is_negative),
                cmocka_unit_test(model_rejects_truncated_file),
                cmocka_unit_test(model_rejects_trailing_garbage),
                cmocka_unit_test(model_rejects_zero_layers),
                cmocka_unit_test(model_rejects_heads_not_divisible_by_kv_heads),
                cmocka_unit_test(model_rejects_huge_or_nonpositive_dims),
                cmocka_unit_test(model_load_reports_missing_file),
                cmocka_unit_test(model_forward_rejects_bad_token_and_position),
                cmocka_unit_test(plain_cache_refuses_positions_it_cannot_hold),
                cmocka_unit_test(plain_cache_rewind_recomputes_the_same_logits),
                cmocka_unit_test(tokenizer_rejects_truncated_file),
                cmocka_unit_test(tokenizer_rejects_absurd_lengths),
                cmocka_unit_test(tokenizer_load_reports_missing_file),
                cmocka_unit_test(tokenizer_round_trips_sentences),
                cmocka_unit_test(tokenizer_encodes_lily_as_token_317),
                cmocka_unit_test(tokenizer_encodes_newline_as_byte_token),
                cmocka_unit_test(tokenizer_encode_handles_empty_text_and_small_capacity),
                cmocka_unit_test(tokenizer_decode_strips_space_after_bos_and_maps_byte_tokens),
                cmocka_unit_test(tokenizer_piece_safe_drops_control_bytes),
                cmocka_unit_test(tokenizer_encode_matches_llama2c_quadratic_encoder),
                cmocka_unit_test(sampler_at_temperature_zero_is_argmax),
                cmocka_unit_test(sampler_argmax_takes_first_of_ties),
                cmocka_unit_test(sampler_same_seed_gives_same_sequence),
                cmocka_unit_test(sampler_follows_the_softmax_distribution),
                cmocka_unit_test(sampler_rejects_bad_arguments),
        };

        return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
