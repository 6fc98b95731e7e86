/* test_importance.c - importance.c: the scores a prompt chunk leaves in the score array, against
 * references computed beside it with the plain cache.
 *
 * Owns: an array store (the test's own importance_store_ops: keys, values and scores per layer,
 * slot = position) over the plain cache, whose attention adds a constant to every score of the
 * layer on each call (the attention kernels' sum += a, which importance_prefill must take back
 * out); and the references:
 * - recon: the same chunks prefilled into a second plain cache, and the pass's tokens
 *   (importance_recon_tokens, taken before each chunk) run through it with an attention that
 *   also computes, in double, every probability a cached slot gets from any row and query head
 *   (a brute-force softmax over the stored keys), its output the plain cache's. A slot's score
 *   must be the largest of them over the chunks' passes. The recon pass attends with its own
 *   loops, so the two runs' activations differ by rounding only: RECON_TOL bounds the
 *   difference of probabilities (measured: 7.6e-7 on stories260K, 1.5e-6 on SmolLM2's exact
 *   products through 30 layers; its fast products' 8-bit activations made it 3e-4).
 * - surprisal: -ln softmax of the logits before each token, from a token-by-token run over the
 *   plain cache, in double; position 0 gets IMPORTANCE_FIRST_SURPRISAL.
 * On stories260K (llama2.c: attention row by row, one logit row a pass) and on SmolLM2 (GGUF:
 * rows attended together, the recon attention on 1 and 2 threads giving the same bits, chunks of
 * several logit rows). Also: the attention kind leaves the scores alone, and the refusals.
 *
 * Models: ../shared/models/stories260K (or $KVC_STORIES_DIR) and $KVC_SMOLLM2.
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "importance.h"
#include "model.h"
#include "text.h"

#define MAX_T     512
#define MAX_L     32
#define NOISE     0.5f
#define RECON_TOL 1e-4

/* the exact products are slow, ten times slower under the sanitizers (make check): SmolLM2's recon
 * test takes the story's first SMOL_RECON_TOKENS tokens */
#if defined(__SANITIZE_ADDRESS__)
#define SMOL_RECON_TOKENS 16
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SMOL_RECON_TOKENS 16
#endif
#endif
#ifndef SMOL_RECON_TOKENS
#define SMOL_RECON_TOKENS 43
#endif

#define STORY                                                                                                \
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the park "       \
        "with her friends. One day, she saw a big red ball under a tree and ran to get it."

/* ---- the array store over the plain cache ---- */

struct arr {
        struct plain_cache *pc;
        uint32_t L, H, Q, D, kv;
        float *k, *v; /* [L][MAX_T][kv] */
        float *score; /* [L][H][MAX_T] */
        uint32_t n[MAX_L];
        float noise;    /* added to a layer's scores by every attend */
        uint32_t ref_n; /* > 0: the reference pass, over the first ref_n slots */
        double *ref;    /* [L][H][MAX_T]: the largest probability of each slot */
};

static void arr_init(struct arr *a, struct model *m, float noise) {
        const struct model_config *c = model_get_config(m);
        *a = (struct arr){ .L = (uint32_t)c->n_layers,
                           .H = (uint32_t)c->n_kv_heads,
                           .Q = (uint32_t)c->n_heads,
                           .D = (uint32_t)(c->dim / c->n_heads),
                           .noise = noise };
        a->kv = a->H * a->D;
        assert_true(a->L <= MAX_L);
        assert_int_equal(plain_cache_new(c, MAX_T, &a->pc), 0);
        a->k = calloc((size_t)a->L * MAX_T * a->kv, sizeof(float));
        a->v = calloc((size_t)a->L * MAX_T * a->kv, sizeof(float));
        a->score = calloc((size_t)a->L * a->H * MAX_T, sizeof(float));
        a->ref = calloc((size_t)a->L * a->H * MAX_T, sizeof(double));
        assert_true(a->k && a->v && a->score && a->ref);
}

static void arr_free(struct arr *a) {
        plain_cache_free(a->pc);
        free(a->k);
        free(a->v);
        free(a->score);
        free(a->ref);
}

static int arr_store(void *ctx, int layer, int pos, const float *k, const float *v) {
        struct arr *a = ctx;
        int e = plain_cache_ops.store(a->pc, layer, pos, k, v);
        if (e < 0)
                return e;
        size_t at = ((size_t)layer * MAX_T + (size_t)pos) * a->kv;
        memcpy(a->k + at, k, a->kv * sizeof(float));
        memcpy(a->v + at, v, a->kv * sizeof(float));
        a->n[layer] = (uint32_t)pos + 1;
        return 0;
}

/* The reference probabilities of query q at pos over the stored keys, in double. */
static void arr_reference(struct arr *a, int layer, int pos, const float *q) {
        double s[MAX_T];
        for (uint32_t qh = 0; qh < a->Q; qh++) {
                uint32_t g = qh / (a->Q / a->H);
                double m = -INFINITY, l = 0.0;
                for (int t = 0; t <= pos; t++) {
                        const float *k =
                                a->k + ((size_t)layer * MAX_T + (size_t)t) * a->kv + (size_t)g * a->D;
                        double d = 0.0;
                        for (uint32_t c = 0; c < a->D; c++)
                                d += (double)q[qh * a->D + c] * k[c];
                        s[t] = d / sqrt((double)a->D);
                        m = s[t] > m ? s[t] : m;
                }
                for (int t = 0; t <= pos; t++)
                        l += exp(s[t] - m);
                double *best = a->ref + ((size_t)layer * a->H + g) * MAX_T;
                for (uint32_t t = 0; t < a->ref_n; t++) {
                        double p = exp(s[t] - m) / l;
                        best[t] = p > best[t] ? p : best[t];
                }
        }
}

static int arr_attend(void *ctx, int layer, int pos, const float *q, float *out) {
        struct arr *a = ctx;
        for (size_t i = 0; i < (size_t)a->H * MAX_T; i++)
                a->score[(size_t)layer * a->H * MAX_T + i] += a->noise;
        if (a->ref_n)
                arr_reference(a, layer, pos, q);
        return plain_cache_ops.attend(a->pc, layer, pos, q, out);
}

static const struct model_cache_ops arr_ops = { .store = arr_store, .attend = arr_attend };

/* The plain cache alone, the store's slots left as they were (as if a plan took them meanwhile). */
static int stale_store(void *ctx, int layer, int pos, const float *k, const float *v) {
        return plain_cache_ops.store(((struct arr *)ctx)->pc, layer, pos, k, v);
}

static int stale_attend(void *ctx, int layer, int pos, const float *q, float *out) {
        return plain_cache_ops.attend(((struct arr *)ctx)->pc, layer, pos, q, out);
}

static const struct model_cache_ops stale_ops = { .store = stale_store, .attend = stale_attend };

static uint32_t arr_tokens(void *ctx, uint32_t layer) {
        return ((struct arr *)ctx)->n[layer];
}

static int arr_gather(void *ctx, uint32_t layer, uint32_t n, float *keys, float *values) {
        struct arr *a = ctx;
        for (uint32_t h = 0; h < a->H; h++)
                for (uint32_t t = 0; t < n; t++) {
                        size_t at = ((size_t)layer * MAX_T + t) * a->kv + (size_t)h * a->D;
                        memcpy(keys + ((size_t)h * n + t) * a->D, a->k + at, a->D * sizeof(float));
                        memcpy(values + ((size_t)h * n + t) * a->D, a->v + at, a->D * sizeof(float));
                }
        return 0;
}

static int arr_get_scores(void *ctx, uint32_t layer, uint32_t n, float *score) {
        struct arr *a = ctx;
        for (uint32_t h = 0; h < a->H; h++)
                memcpy(score + (size_t)h * n, a->score + ((size_t)layer * a->H + h) * MAX_T,
                       n * sizeof(float));
        return 0;
}

static int arr_set_scores(void *ctx, uint32_t layer, uint32_t n, const float *score) {
        struct arr *a = ctx;
        for (uint32_t h = 0; h < a->H; h++)
                memcpy(a->score + ((size_t)layer * a->H + h) * MAX_T, score + (size_t)h * n,
                       n * sizeof(float));
        return 0;
}

static const struct importance_store_ops arr_store_ops = {
        .tokens = arr_tokens, .gather = arr_gather, .get_scores = arr_get_scores, .set_scores = arr_set_scores
};

static float *score_at(struct arr *a, uint32_t l, uint32_t h, uint32_t t) {
        return a->score + ((size_t)l * a->H + h) * MAX_T + t;
}

/* ---- models ---- */

struct fixture {
        struct model *m;
        struct text *tok;
        int ids[MAX_T];
        size_t n_ids;
};

static void open_stories(struct fixture *f) {
        const char *dir = getenv("KVC_STORIES_DIR");
        char path[4200];
        if (!dir || !*dir)
                dir = "../shared/models/stories260K";
        snprintf(path, sizeof(path), "%s/stories260K.bin", dir);
        assert_int_equal(model_load(path, &f->m), 0);
        snprintf(path, sizeof(path), "%s/tok512.bin", dir);
        assert_int_equal(text_open_llama2c(path, model_get_config(f->m)->vocab_size, &f->tok), 0);
        assert_int_equal(text_encode(f->tok, STORY, f->ids, MAX_T, &f->n_ids), 0);
}

/* exact: f32-accurate products (the recon reference's activations then differ from the pass's by
 * the attention's rounding alone, not by that rounding through 8-bit activations). */
static void open_smollm2(struct fixture *f, unsigned threads, bool exact) {
        const char *path = getenv("KVC_SMOLLM2");
        if (!path || !*path)
                fail_msg("KVC_SMOLLM2 is not set: run through `make test` (after `make model`)");
        char why[512];
        struct model_options o = { .threads = threads, .exact = exact };
        if (model_open(path, &o, &f->m, why, sizeof(why)) < 0)
                fail_msg("cannot open %s: %s", path, why);
        assert_int_equal(text_open_gguf(path, &f->tok, why, sizeof(why)), 0);
        assert_int_equal(text_encode(f->tok, STORY " " STORY, f->ids, MAX_T, &f->n_ids), 0);
}

static void close_fixture(struct fixture *f) {
        model_free(f->m);
        text_free(f->tok);
}

/* Rows of ids[first, first + n) at their positions, in one context. */
static void make_rows(const struct fixture *f, struct model_row *rows, uint32_t first, uint32_t n,
                      void *ctx) {
        for (uint32_t i = 0; i < n; i++)
                rows[i] =
                        (struct model_row){ .token = f->ids[first + i], .pos = (int)(first + i), .ctx = ctx };
}

/* Rows through the reference's array store (row passes of at most MODEL_MAX_ROWS). */
static void forward(struct fixture *f, struct arr *a, const int *tokens, size_t n, int pos) {
        struct model_row rows[MODEL_MAX_ROWS];
        float *logits;
        for (size_t done = 0; done < n;) {
                uint32_t k = n - done < MODEL_MAX_ROWS ? (uint32_t)(n - done) : MODEL_MAX_ROWS;
                for (uint32_t i = 0; i < k; i++)
                        rows[i] = (struct model_row){ .token = tokens[done + i],
                                                      .pos = pos + (int)(done + i),
                                                      .ctx = a };
                assert_int_equal(model_forward_rows(f->m, rows, k, &arr_ops, &logits), 0);
                done += k;
        }
}

/* ---- recon ---- */

/* The ids in chunks of the given sizes, scored by the recon pass (threads), against the reference
 * when `check`; *ret_scores (may be NULL) gets a copy of the final scores. */
static void recon_scores(struct fixture *f, const uint32_t *chunks, size_t n_chunks, unsigned threads,
                         bool check, float **ret_scores) {
        struct importance *imp;
        assert_int_equal(importance_new(f->m, f->tok, IMPORTANCE_KIND_RECON, threads, &imp), 0);
        struct arr a, ref;
        arr_init(&a, f->m, NOISE);
        arr_init(&ref, f->m, 0.0f);
        uint32_t first = 0;
        for (size_t c = 0; c < n_chunks; c++) {
                uint32_t n = chunks[c];
                int pass[MAX_T];
                size_t n_pass;
                assert_int_equal(importance_recon_tokens(imp, f->ids + first, n, pass, MAX_T, &n_pass), 0);
                struct model_row rows[MODEL_MAX_ROWS];
                make_rows(f, rows, first, n, &a);
                float *logits;
                assert_int_equal(importance_prefill(imp, rows, n, &arr_ops, &arr_store_ops, &logits), 0);

                first += n;
                if (!check)
                        continue;
                /* the reference: the chunk, then the pass's rows with the brute-force attention */
                forward(f, &ref, f->ids + first - n, n, (int)(first - n));
                ref.ref_n = first;
                forward(f, &ref, pass, n_pass, (int)first);
                ref.ref_n = 0;
                double worst = 0.0;
                for (uint32_t l = 0; l < a.L; l++)
                        for (uint32_t h = 0; h < a.H; h++)
                                for (uint32_t t = 0; t < first; t++) {
                                        double want = ref.ref[((size_t)l * a.H + h) * MAX_T + t],
                                               got = *score_at(&a, l, h, t), d = fabs(got - want);
                                        worst = d > worst ? d : worst;
                                        if (d > RECON_TOL)
                                                fail_msg("chunk %zu layer %u head %u slot %u: %.7f, the "
                                                         "reference %.7f",
                                                         c, l, h, t, got, want);
                                }
                if (getenv("KVC_TEST_VERBOSE"))
                        printf("chunk %zu: %u slots, largest difference %.3g\n", c, first, worst);
        }
        if (ret_scores) {
                *ret_scores = malloc((size_t)a.L * a.H * MAX_T * sizeof(float));
                assert_non_null(*ret_scores);
                memcpy(*ret_scores, a.score, (size_t)a.L * a.H * MAX_T * sizeof(float));
        }
        arr_free(&a);
        arr_free(&ref);
        importance_free(imp);
}

static void recon_scores_are_the_largest_probability_of_each_pass_on_stories260K(void **state) {
        (void)state;
        struct fixture f;
        open_stories(&f);
        uint32_t chunks[] = { 20, 1, (uint32_t)f.n_ids - 21 }; /* the second pass quotes the first chunk */
        recon_scores(&f, chunks, 3, 1, true, NULL);
        close_fixture(&f);
}

static void recon_scores_match_on_smollm2_with_rows_together_and_any_thread_count(void **state) {
        (void)state;
        struct fixture f;
        float *one, *two;
        open_smollm2(&f, 2, true);
        f.n_ids = SMOL_RECON_TOKENS;
        uint32_t chunks[] = { SMOL_RECON_TOKENS / 2, SMOL_RECON_TOKENS - SMOL_RECON_TOKENS / 2 };
        recon_scores(&f, chunks, 2, 2, true, &two);
        recon_scores(&f, chunks, 2, 1, false, &one);
        const struct model_config *c = model_get_config(f.m);
        assert_memory_equal(one, two, (size_t)c->n_layers * c->n_kv_heads * MAX_T * sizeof(float));
        free(one);
        free(two);
        close_fixture(&f);
}

static void the_recon_instruction_quotes_the_previous_chunk(void **state) {
        (void)state;
        struct fixture f;
        open_stories(&f);
        struct importance *imp;
        assert_int_equal(importance_new(f.m, f.tok, IMPORTANCE_KIND_RECON, 1, &imp), 0);
        int first[MAX_T], later[MAX_T], bare[MAX_T], nl[8];
        size_t n_first, n_later, n_bare, n_nl;
        assert_int_equal(importance_recon_tokens(imp, f.ids, 12, first, MAX_T, &n_first), 0);
        assert_memory_equal(first + n_first - 12, f.ids, 12 * sizeof(int)); /* the chunk last */
        /* before it, the instruction and a line break, each encoded without its BOS */
        assert_int_equal(text_encode(f.tok, "\n\nRepeat the previous context exactly.", bare, MAX_T, &n_bare),
                         0);
        assert_int_equal(text_encode(f.tok, "\n", nl, 8, &n_nl), 0);
        assert_int_equal(n_first, n_bare - 1 + n_nl - 1 + 12);
        assert_memory_equal(first, bare + 1, (n_bare - 1) * sizeof(int));
        assert_memory_equal(first + n_bare - 1, nl + 1, (n_nl - 1) * sizeof(int));
        assert_int_equal(importance_recon_tokens(imp, f.ids, 12, first, 12, &n_first), -ENOBUFS);

        struct arr a;
        arr_init(&a, f.m, 0.0f);
        struct model_row rows[MODEL_MAX_ROWS];
        float *logits;
        make_rows(&f, rows, 0, 12, &a);
        assert_int_equal(importance_prefill(imp, rows, 12, &arr_ops, &arr_store_ops, &logits), 0);
        assert_int_equal(importance_recon_tokens(imp, f.ids + 12, 5, later, MAX_T, &n_later), 0);
        assert_memory_equal(later + n_later - 5, f.ids + 12, 5 * sizeof(int));
        /* ... the quote: the chunk's last IMPORTANCE_QUOTE tokens, then "\n" (one token or two) */
        int quoted = 0;
        for (size_t i = 0; i + IMPORTANCE_QUOTE <= n_later - 5; i++)
                quoted |=
                        memcmp(later + i, f.ids + 12 - IMPORTANCE_QUOTE, IMPORTANCE_QUOTE * sizeof(int)) == 0;
        assert_true(quoted);
        arr_free(&a);
        importance_free(imp);
        close_fixture(&f);
}

/* ---- surprisal ---- */

/* The ids in chunks of `rows` through the surprisal kind, against a token-by-token reference. */
static void surprisal_matches_log_softmax(struct fixture *f, uint32_t rows_a_chunk) {
        struct importance *imp;
        assert_int_equal(importance_new(f->m, NULL, IMPORTANCE_KIND_SURPRISAL, 1, &imp), 0);
        assert_true(importance_max_rows(imp) >= rows_a_chunk);
        struct arr a, ref;
        arr_init(&a, f->m, NOISE);
        arr_init(&ref, f->m, 0.0f);
        uint32_t V = (uint32_t)model_get_config(f->m)->vocab_size, N = (uint32_t)f->n_ids;
        double want[MAX_T];
        want[0] = IMPORTANCE_FIRST_SURPRISAL;
        for (uint32_t t = 0; t + 1 < N; t++) { /* the reference: logits of t predict token t + 1 */
                float *logits;
                assert_int_equal(model_forward(f->m, f->ids[t], (int)t, &arr_ops, &ref, &logits), 0);
                double m = -INFINITY, l = 0.0;
                for (uint32_t i = 0; i < V; i++)
                        m = logits[i] > m ? logits[i] : m;
                for (uint32_t i = 0; i < V; i++)
                        l += exp((double)logits[i] - m);
                want[t + 1] = -(((double)logits[f->ids[t + 1]] - m) - log(l));
        }
        for (uint32_t first = 0; first < N;) {
                uint32_t n = N - first < rows_a_chunk ? N - first : rows_a_chunk;
                struct model_row rows[MODEL_MAX_ROWS];
                float *logits;
                make_rows(f, rows, first, n, &a);
                assert_int_equal(importance_prefill(imp, rows, n, &arr_ops, &arr_store_ops, &logits), 0);
                first += n;
        }
        for (uint32_t l = 0; l < a.L; l++)
                for (uint32_t h = 0; h < a.H; h++)
                        for (uint32_t t = 0; t < N; t++) {
                                double got = *score_at(&a, l, h, t);
                                if (fabs(got - want[t]) > 1e-5 * (1.0 + want[t]))
                                        fail_msg("layer %u head %u token %u: %.7f, -ln p %.7f", l, h, t, got,
                                                 want[t]);
                        }
        arr_free(&a);
        arr_free(&ref);
        importance_free(imp);
}

static void surprisal_is_minus_log_softmax_on_stories260K(void **state) {
        (void)state;
        struct fixture f;
        open_stories(&f);
        surprisal_matches_log_softmax(&f, 1);
        close_fixture(&f);
}

static void surprisal_is_minus_log_softmax_on_smollm2_in_chunks_of_rows(void **state) {
        (void)state;
        struct fixture f;
        open_smollm2(&f, 2, false);
        surprisal_matches_log_softmax(&f, 13); /* the first of a chunk from the chunk before */
        close_fixture(&f);
}

/* ---- the rest ---- */

static void attention_leaves_the_scores_to_the_kernels(void **state) {
        (void)state;
        struct fixture f;
        open_stories(&f);
        struct importance *imp;
        assert_int_equal(importance_new(f.m, NULL, IMPORTANCE_KIND_ATTENTION, 1, &imp), 0);
        assert_int_equal(importance_max_rows(imp), MODEL_MAX_ROWS);
        struct arr a, ref;
        arr_init(&a, f.m, NOISE);
        arr_init(&ref, f.m, 0.0f);
        struct model_row rows[MODEL_MAX_ROWS];
        float *logits, *want;
        make_rows(&f, rows, 0, 10, &a);
        assert_int_equal(importance_prefill(imp, rows, 10, &arr_ops, NULL, &logits), 0);
        make_rows(&f, rows, 0, 10, &ref);
        rows[9].logits = true;
        assert_int_equal(model_forward_rows(f.m, rows, 10, &arr_ops, &want), 0);
        assert_memory_equal(logits, want, (size_t)model_get_config(f.m)->vocab_size * sizeof(float));
        /* the kernels' sums stay: layer 0's slot 0 got the constant from each of the 10 rows */
        assert_true(*score_at(&a, 0, 0, 0) == 10 * NOISE);
        arr_free(&a);
        arr_free(&ref);
        importance_free(imp);
        close_fixture(&f);
}

static void bad_arguments_and_a_plan_inside_the_chunk_are_refused(void **state) {
        (void)state;
        struct fixture f;
        open_stories(&f);
        enum importance_kind k;
        assert_int_equal(importance_parse("recon", &k), 0);
        assert_int_equal(k, IMPORTANCE_KIND_RECON);
        assert_string_equal(importance_name(IMPORTANCE_KIND_SURPRISAL), "surprisal");
        assert_int_equal(importance_parse("question", &k), -EINVAL);
        struct importance *imp = NULL;
        assert_int_equal(importance_new(f.m, NULL, IMPORTANCE_KIND_RECON, 1, &imp), -EINVAL); /* no text */
        assert_int_equal(importance_new(f.m, f.tok, IMPORTANCE_KIND_SURPRISAL, 1, &imp), 0);
        assert_int_equal(importance_max_rows(imp), 1); /* llama2.c: logits of one row a pass */
        struct arr a;
        arr_init(&a, f.m, 0.0f);
        struct model_row rows[MODEL_MAX_ROWS];
        float *logits;
        make_rows(&f, rows, 0, 2, &a);
        assert_int_equal(importance_prefill(imp, rows, 2, &arr_ops, &arr_store_ops, &logits), -EINVAL);
        assert_int_equal(importance_prefill(imp, rows, 1, &arr_ops, NULL, &logits), -EINVAL); /* no store */
        importance_free(imp);

        assert_int_equal(importance_new(f.m, f.tok, IMPORTANCE_KIND_RECON, 1, &imp), 0);
        make_rows(&f, rows, 0, 4, &a);
        rows[2].pos = 7;
        assert_int_equal(importance_prefill(imp, rows, 4, &arr_ops, &arr_store_ops, &logits), -EINVAL);
        /* the store did not grow by the chunk: its slots moved under the pass */
        make_rows(&f, rows, 0, 4, &a);
        assert_int_equal(importance_prefill(imp, rows, 4, &stale_ops, &arr_store_ops, &logits), -ESTALE);
        arr_free(&a);
        importance_free(imp);
        close_fixture(&f);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(recon_scores_are_the_largest_probability_of_each_pass_on_stories260K),
                cmocka_unit_test(recon_scores_match_on_smollm2_with_rows_together_and_any_thread_count),
                cmocka_unit_test(the_recon_instruction_quotes_the_previous_chunk),
                cmocka_unit_test(surprisal_is_minus_log_softmax_on_stories260K),
                cmocka_unit_test(surprisal_is_minus_log_softmax_on_smollm2_in_chunks_of_rows),
                cmocka_unit_test(attention_leaves_the_scores_to_the_kernels),
                cmocka_unit_test(bad_arguments_and_a_plan_inside_the_chunk_are_refused),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
