/* bench-attn-long: decode attention of one token over one layer at SmolLM2's shape (9 query heads
 * on 3 KV heads, head_dim 64, blocks of 16) at long context (issue 17): the plain-loop references
 * (attn_decode_ref, attn_decode_mixed, ladder_attend) against the fast kernel (attn_decode_fast,
 * _mixed, _ladder: AVX2 and its plain-loop path), f32, f16, and every tier of the precision ladder
 * (int8, q4, q3, q2: all tokens but the last 64, which stay f16), scores updated as kvc_attend
 * does. The last column is the f16 cache's AVX2 time over this one's at the same length. Each figure:
 * microseconds per call, the median of 5 measurements of at least --min-ms, the kernels alternating; CPU time
 * of this thread, so that other jobs on a shared machine do not count.
 */
#define _GNU_SOURCE
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attention.h"
#include "block.h"
#include "common.h"
#include "ladder.h"
#include "lloyd.h"
#include "mixed.h"

#define HEADS    9u
#define KV_HEADS 3u
#define HEAD_DIM 64u
#define T        16u
#define RECENT   64u /* full-precision tokens of the INT8 layer */
#define MEASURES 5

enum kernel { K_REF, K_FAST_PLAIN, K_FAST_AVX2, K_COUNT };

struct job {
        struct block_layer L;
        struct mixed_layer M;
        struct ladder_layer Ld;
        float signs[KV_HEADS * HEAD_DIM];
        int mixed, ladder;
        float q[HEADS * HEAD_DIM], out[HEADS * HEAD_DIM];
        float *scratch;
};

static void call(struct job *j, enum kernel k) {
        enum attn_isa isa = k == K_FAST_AVX2 ? ATTN_ISA_AVX2 : ATTN_ISA_PLAIN;
        if (j->ladder)
                k == K_REF ? ladder_attend(&j->Ld, j->q, j->out, HEADS, 0.9f, 1, j->scratch)
                           : attn_decode_fast_ladder(&j->Ld, j->q, j->out, HEADS, 0.9f, 1, j->scratch, isa);
        else if (j->mixed)
                k == K_REF ? attn_decode_mixed(&j->M, j->q, j->out, HEADS, 0.9f, 1, j->scratch)
                           : attn_decode_fast_mixed(&j->M, j->q, j->out, HEADS, 0.9f, 1, j->scratch, isa);
        else
                k == K_REF ? attn_decode_ref(&j->L, j->q, j->out, HEADS, 0.9f, 1, j->scratch)
                           : attn_decode_fast(&j->L, j->q, j->out, HEADS, 0.9f, 1, j->scratch, isa);
}

static double cpu_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
        return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static double once(struct job *j, enum kernel k, double min_ms) {
        double t0 = cpu_ns(), t;
        uint64_t reps = 0;
        do {
                call(j, k);
                reps++;
                t = cpu_ns();
        } while (t - t0 < min_ms * 1e6);
        return (t - t0) / 1e3 / (double)reps;
}

static int cmp(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return (x > y) - (x < y);
}

/* Blocks for n tokens of dtype, random rows; for INT8 the first n - RECENT go to Q8 blocks, for a
 * ladder tier (low: its layout) to that tier's. */
static int setup(struct job *j, uint32_t n, struct block_layout *fp, struct block_layout *q8,
                 const struct block_layout *low) {
        uint32_t nb = (n + T - 1) / T;
        uint8_t **fb = calloc(nb, sizeof(*fb)), **qb = calloc(nb, sizeof(*qb));
        uint64_t rng = 7 + n;
        float row[HEAD_DIM];
        if (!fb || !qb)
                return -1;
        for (uint32_t b = 0; b < nb; b++) {
                fb[b] = aligned_alloc(64, fp->block_bytes);
                qb[b] = aligned_alloc(64, q8->block_bytes);
                if (!fb[b] || !qb[b])
                        return -1;
                memset(fb[b], 0, fp->block_bytes);
                memset(qb[b], 0, q8->block_bytes);
        }
        for (uint32_t s = 0; s < n; s++)
                for (uint32_t g = 0; g < KV_HEADS; g++) {
                        for (uint32_t i = 0; i < HEAD_DIM; i++)
                                row[i] = bench_rng_float(&rng) - 0.5f;
                        block_store_row(fp->dtype, row, block_key(fp, fb[s / T], g, s % T), HEAD_DIM);
                        for (uint32_t i = 0; i < HEAD_DIM; i++)
                                row[i] = bench_rng_float(&rng) - 0.5f;
                        block_store_row(fp->dtype, row, block_value(fp, fb[s / T], g, s % T), HEAD_DIM);
                }
        for (uint32_t i = 0; i < HEADS * HEAD_DIM; i++)
                j->q[i] = bench_rng_float(&rng) - 0.5f;
        j->L = (struct block_layer){ .layout = fp, .blocks = fb, .n_blocks = nb, .n_tokens = n };
        j->M = (struct mixed_layer){ .fp = fp,
                                     .q8 = q8,
                                     .fp_blocks = fb,
                                     .n_fp_blocks = nb,
                                     .q8_blocks = qb,
                                     .n_q8_blocks = nb,
                                     .n_tokens = n };
        for (uint32_t g = 0; g < KV_HEADS; g++)
                lloyd_signs(1, 0, g, HEAD_DIM, j->signs + g * HEAD_DIM);
        uint8_t **lb = calloc(nb, sizeof(*lb));
        for (uint32_t b = 0; low && b < nb; b++)
                if (!(lb[b] = aligned_alloc(64, low->block_bytes)))
                        return -1;
        j->Ld = (struct ladder_layer){ .n_tiers = 2,
                                       .layout = { fp, low ? low : q8 },
                                       .blocks = { fb, lb },
                                       .n_blocks = { nb, low ? nb : 0 },
                                       .n = { n, 0 },
                                       .signs = j->signs };
        size_t sf = attn_fast_scratch_floats(n, HEADS, KV_HEADS, HEAD_DIM, T) +
                    attn_mixed_scratch_floats(&j->M, HEADS) + compact_mixed_scratch_floats(&j->M) + 2 * n +
                    ladder_attn_scratch_floats(&j->Ld, HEADS) + ladder_compact_scratch_floats(&j->Ld);
        j->scratch = malloc(sf * sizeof(float));
        if (!j->scratch)
                return -1;
        if (j->ladder) { /* demote all but the last RECENT, keeping every token */
                uint32_t *keep = malloc(n * sizeof(*keep)), got[LADDER_TIERS];
                uint8_t *tier = malloc(n);
                for (uint32_t i = 0; i < n; i++) {
                        keep[i] = i;
                        tier[i] = i < n - RECENT;
                }
                if (ladder_compact(&j->Ld, keep, tier, n, 0, n, j->scratch, got) < 0)
                        return -1;
                j->Ld.n[0] = got[0];
                j->Ld.n[1] = got[1];
                free(keep);
                free(tier);
        }
        if (j->mixed) {
                if (mixed_advance_q8(&j->M, n - RECENT, j->scratch) < 0)
                        return -1;
                j->M.n_q8 = n - RECENT;
                j->M.n_q8_blocks = (n - RECENT + T - 1) / T;
                j->M.n_fp_blocks = (RECENT + T - 1) / T;
        }
        return 0;
}

int main(int argc, char **argv) {
        double min_ms = 30;
        static const struct option lo[] = { { "min-ms", required_argument, NULL, 'm' },
                                            { "help", no_argument, NULL, 'h' },
                                            {} };
        int ch;
        while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
                if (ch == 'm')
                        min_ms = atof(optarg);
                else {
                        printf("Usage: bench-attn-long [--min-ms MS]\n");
                        return ch == 'h' ? 0 : 2;
                }
        }
        static const uint32_t sizes[] = { 1024, 4096, 8192 };
        static const struct {
                const char *name;
                enum block_dtype dt;
                int mixed;
                enum block_dtype low; /* a ladder of f16 and this tier (0: none) */
        } kinds[] = { { "f32", BLOCK_DTYPE_F32, 0, 0 },
                      { "f16", BLOCK_DTYPE_F16, 0, 0 },
                      { "int8 + 64 f16", BLOCK_DTYPE_F16, 1, 0 },
                      { "q4 + 64 f16", BLOCK_DTYPE_F16, 0, BLOCK_DTYPE_Q4 },
                      { "q3 + 64 f16", BLOCK_DTYPE_F16, 0, BLOCK_DTYPE_Q3 },
                      { "q2 + 64 f16", BLOCK_DTYPE_F16, 0, BLOCK_DTYPE_Q2 } };
        double f16_avx2[3] = { 0 };
        printf("Decode attention, one layer, one token, SmolLM2's shape (9 / 3 heads, head_dim 64, blocks of "
               "16), "
               "scores updated: us of CPU per call (median of %d)\n",
               MEASURES);
        printf("| cache | tokens | reference | fast, plain loops | fast, AVX2 | reference / AVX2 | x 30 "
               "layers, ms "
               "(AVX2) | f16 / this (AVX2) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
        for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++)
                for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
                        struct block_layout fp, q8, low;
                        struct job j = { .mixed = kinds[k].mixed, .ladder = kinds[k].low != 0 };
                        if (block_layout_init(&fp, T, KV_HEADS, HEAD_DIM, kinds[k].dt) < 0 ||
                            block_layout_init(&q8, T, KV_HEADS, HEAD_DIM, BLOCK_DTYPE_Q8) < 0 ||
                            (j.ladder && block_layout_init(&low, T, KV_HEADS, HEAD_DIM, kinds[k].low) < 0) ||
                            setup(&j, sizes[si], &fp, &q8, j.ladder ? &low : NULL) < 0) {
                                perror("bench-attn-long");
                                return 1;
                        }
                        double t[K_COUNT][MEASURES];
                        for (int m = 0; m < MEASURES; m++)
                                for (int e = 0; e < K_COUNT; e++)
                                        t[e][m] = once(&j, (enum kernel)e, min_ms);
                        for (int e = 0; e < K_COUNT; e++)
                                qsort(t[e], MEASURES, sizeof(double), cmp);
                        double r = t[K_REF][MEASURES / 2], p = t[K_FAST_PLAIN][MEASURES / 2],
                               a = t[K_FAST_AVX2][MEASURES / 2];
                        if (kinds[k].dt == BLOCK_DTYPE_F16 && !kinds[k].mixed && !j.ladder)
                                f16_avx2[si] = a;
                        printf("| %s | %u | %.0f | %.0f | %.0f | %.1f | %.1f | %.2f |\n", kinds[k].name,
                               sizes[si], r, p, a, r / a, a * 30 / 1e3, f16_avx2[si] / a);
                        fflush(stdout);
                }
        return 0;
}
