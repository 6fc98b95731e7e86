/* bench-attn: where kvc-run's extra time per token goes when kvcd manages its cache (issue 7,
 * item 5): the attention kernel libkvc runs (attn_decode_ref over 16-slot blocks, updating the
 * score arrays the policies read) against kvc-run --local's (since issue 17's long-context work
 * the fast kernel, attn_decode_rows; before it llama2.c's loop) over a contiguous cache, on the same keys,
 * values and queries, for stories260K's geometry (8 query heads, 4 KV heads, head_dim 8, f32).
 *
 * Each figure: microseconds per call (one layer, one token), the median of 7 measurements of at
 * least --min-ms, the two kernels alternating.
 */
#define _GNU_SOURCE
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "block.h"
#include "common.h"
#include "model.h"

#define MEASUREMENTS 7
#define HEADS        8u
#define KV_HEADS     4u
#define HEAD_DIM     8u
#define T            16u

struct job {
        struct block_layer L;
        struct plain_cache *plain;
        int pos;
        float q[HEADS * HEAD_DIM], out[HEADS * HEAD_DIM];
        float *scratch;
        int update;
};

static void run_plain(struct job *j) {
        plain_cache_ops.attend(j->plain, 0, j->pos, j->q, j->out);
}

static void run_blocks(struct job *j) {
        attn_decode_ref(&j->L, j->q, j->out, HEADS, 0.9f, j->update, j->scratch);
}

static double once(void (*fn)(struct job *), struct job *j, double min_ms) {
        uint64_t t0 = bench_now_ns(), t, reps = 0;
        do {
                fn(j);
                reps++;
                t = bench_now_ns();
        } while ((double)(t - t0) < min_ms * 1e6);
        return (double)(t - t0) / 1e3 / (double)reps;
}

int main(int argc, char **argv) {
        double min_ms = 20;
        static const struct option lo[] = { { "min-ms", required_argument, NULL, 'm' },
                                            { "help", no_argument, NULL, 'h' },
                                            {} };
        int ch;
        while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
                if (ch == 'm')
                        min_ms = atof(optarg);
                else {
                        printf("Usage: bench-attn [--min-ms MS]\n");
                        return ch == 'h' ? 0 : 2;
                }
        }
        int cpu_client, cpu_server;
        bench_pick_cpus(&cpu_client, &cpu_server);
        bench_pin(0, cpu_client);
        const uint32_t sizes[] = { 64, 256, 512 };
        struct model_config mc = { .dim = HEADS * HEAD_DIM,
                                   .hidden_dim = 4 * HEADS * HEAD_DIM,
                                   .n_layers = 1,
                                   .n_heads = HEADS,
                                   .n_kv_heads = KV_HEADS,
                                   .vocab_size = 512,
                                   .seq_len = 512 };
        struct block_layout lay;
        block_layout_init(&lay, T, KV_HEADS, HEAD_DIM, BLOCK_DTYPE_F32);
        printf("5b. Decode attention for one layer and one token, stories260K's geometry: libkvc's kernel "
               "against "
               "kvc-run --local's (us per call, median of %d)\n",
               MEASUREMENTS);
        printf("| tokens | --local: attn_decode_rows, contiguous | libkvc: attn_decode_ref, scores updated | "
               "/ "
               "--local | "
               "attn_decode_ref, no score update | / --local |\n");
        printf("|---:|---:|---:|---:|---:|---:|\n");
        for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
                uint32_t n = sizes[si], nb = n / T;
                struct job j = { .pos = (int)n - 1 };
                uint8_t *pool = aligned_alloc(64, (size_t)nb * lay.block_bytes);
                uint8_t **blocks = malloc(nb * sizeof(*blocks));
                j.scratch = malloc(2 * n * sizeof(float));
                if (!pool || !blocks || !j.scratch || plain_cache_new(&mc, 512, &j.plain) < 0) {
                        perror("bench-attn");
                        return 1;
                }
                memset(pool, 0, (size_t)nb * lay.block_bytes);
                for (uint32_t b = 0; b < nb; b++)
                        blocks[b] = pool + (size_t)b * lay.block_bytes;
                j.L = (struct block_layer){ .layout = &lay, .blocks = blocks, .n_blocks = nb, .n_tokens = n };
                uint64_t rng = 5 + n;
                float k[KV_HEADS * HEAD_DIM], v[KV_HEADS * HEAD_DIM];
                for (uint32_t t = 0; t < n; t++) {
                        for (uint32_t i = 0; i < KV_HEADS * HEAD_DIM; i++) {
                                k[i] = bench_rng_float(&rng) - 0.5f;
                                v[i] = bench_rng_float(&rng) - 0.5f;
                        }
                        plain_cache_ops.store(j.plain, 0, (int)t, k, v);
                        for (uint32_t g = 0; g < KV_HEADS; g++) {
                                block_store_row(BLOCK_DTYPE_F32, k + g * HEAD_DIM,
                                                block_key(&lay, blocks[t / T], g, t % T), HEAD_DIM);
                                block_store_row(BLOCK_DTYPE_F32, v + g * HEAD_DIM,
                                                block_value(&lay, blocks[t / T], g, t % T), HEAD_DIM);
                        }
                }
                for (uint32_t i = 0; i < HEADS * HEAD_DIM; i++)
                        j.q[i] = bench_rng_float(&rng) - 0.5f;
                double tp[MEASUREMENTS], tu[MEASUREMENTS], tn[MEASUREMENTS];
                run_plain(&j);
                run_blocks(&j);
                for (int m = 0; m < MEASUREMENTS; m++) {
                        tp[m] = once(run_plain, &j, min_ms);
                        j.update = 1;
                        tu[m] = once(run_blocks, &j, min_ms);
                        j.update = 0;
                        tn[m] = once(run_blocks, &j, min_ms);
                }
                double p = bench_quantile(tp, MEASUREMENTS, 0.5), u = bench_quantile(tu, MEASUREMENTS, 0.5),
                       nu = bench_quantile(tn, MEASUREMENTS, 0.5);
                printf("| %u | %.2f | %.2f | **%.2f** | %.2f | %.2f |\n", n, p, u, u / p, nu, nu / p);
                plain_cache_free(j.plain);
                free(pool);
                free(blocks);
                free(j.scratch);
        }
        return 0;
}
