/* bench-matmul: the engine's matrix-vectors product (client/engine/matmul.c), exact path against
 * fast path, on SmolLM2-135M's shapes: ffn_down, 576 rows of 1536 q4_1 columns (552,960 bytes), its
 * transpose ffn_up / ffn_gate, 1536 x 576, and the output head, 49152 rows of 576 q8_0 columns
 * (30 MB: it does not fit in any cache, as a decode step's 98 MB of weights do not).
 *
 * For B = 1, 4 and 8 vectors: the exact path (dequantize, f32 products in qtype.h's order), the
 * fast path's plain C kernel, its AVX2 kernel and its AVX-512 VNNI one (those the CPU has), with the activations'
 * quantization (matmul_quantize, once per product) timed in. Each figure is the median of 7
 * measurements of at least --min-ms, interleaved with memcpy of the weight bytes; it prints the
 * time per product, fast / exact (speed-up), the weights' effective GB/s (bytes read once per
 * product, whatever B) against memcpy's, and for B > 1 the vectors per second against B = 1's
 * (the batch's gain). Single thread. The q4_1 matrices fit in L2, so memcpy's figure there is a
 * cache bandwidth, not DRAM's: the ratio says how far from streaming the weights each kernel is.
 * --quick measures memcpy and the x86 kernels only. avx2/this: the AVX2 kernel's time over this one's.
 * --stream WEIGHT_MB prints one core's read bandwidth and the decode rate it bounds (bench/decode.sh).
 */
#define _GNU_SOURCE
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"
#include "matmul.h"
#include "qtype.h"

#define MEASUREMENTS 7

struct setup {
        const struct qtype *t;
        uint32_t rows, cols, n_x;
        uint8_t *w, *copy;
        size_t w_bytes;
        float *x, *y;
        struct matmul_q8 *xq;
};

enum what { WHAT_MEMCPY, WHAT_EXACT, WHAT_PLAIN, WHAT_AVX2, WHAT_VNNI, WHAT_COUNT };
static const char *const what_names[] = { "memcpy", "exact", "fast plain", "fast avx2", "fast vnni" };
static const enum matmul_isa what_isa[] = { 0, 0, MATMUL_ISA_PLAIN, MATMUL_ISA_AVX2, MATMUL_ISA_AVX512_VNNI };

static int is_fast(int w) {
        return w >= WHAT_PLAIN;
}

static int lacking(int w) {
        return is_fast(w) && !matmul_isa_supported(what_isa[w]);
}

/* --quick: memcpy and the x86 kernels only */
static int skipped(int w, int quick) {
        return lacking(w) || (quick && (w == WHAT_EXACT || w == WHAT_PLAIN));
}

static int run_once(struct setup *s, enum what what) {
        if (what == WHAT_MEMCPY) {
                memcpy(s->copy, s->w, s->w_bytes);
                __asm__ volatile("" : : "r"(s->copy) : "memory");
                return 0;
        }
        struct matmul m = {
                .t = s->t,
                .w = s->w,
                .row_bytes = qtype_row_bytes(s->t, s->cols),
                .cols = s->cols,
                .x = s->x,
                .x_stride = s->cols,
                .n_x = s->n_x,
                .y = s->y,
                .y_stride = s->rows,
                .isa = is_fast(what) ? what_isa[what] : MATMUL_ISA_PLAIN,
        };
        if (what != WHAT_EXACT) {
                if (matmul_quantize(s->x, s->cols, s->n_x, s->cols, s->xq) < 0)
                        return -1;
                m.xq = s->xq;
        }
        return matmul_rows(&m, 0, s->rows);
}

/* Seconds per product: repeats until min_ms have passed. */
static double measure(struct setup *s, enum what what, double min_ms) {
        uint64_t t0 = bench_now_ns(), t;
        long n = 0;

        do {
                if (run_once(s, what) < 0) {
                        fprintf(stderr, "bench-matmul: %s failed\n", what_names[what]);
                        exit(1);
                }
                n++;
                t = bench_now_ns();
        } while ((double)(t - t0) < min_ms * 1e6);
        return (double)(t - t0) * 1e-9 / (double)n;
}

/* Measures one shape and batch; returns the best kernel's median seconds per product. */
static double bench_shape(uint32_t id, uint32_t rows, uint32_t cols, uint32_t n_x, double min_ms, int quick,
                          double best_b1) {
        struct setup s = { .t = qtype_of(id), .rows = rows, .cols = cols, .n_x = n_x };
        uint64_t rng = 0x6d61746d756cull;
        int best = WHAT_PLAIN;
        double samples[WHAT_COUNT][MEASUREMENTS], med[WHAT_COUNT];

        s.w_bytes = qtype_row_bytes(s.t, cols) * rows;
        s.w = malloc(s.w_bytes);
        s.copy = malloc(s.w_bytes);
        s.x = malloc(sizeof(float) * cols * n_x);
        s.y = malloc(sizeof(float) * rows * n_x);
        s.xq = malloc(sizeof(*s.xq) * matmul_q8_count(cols, n_x));
        if (!s.w || !s.copy || !s.x || !s.y || !s.xq) {
                fprintf(stderr, "bench-matmul: out of memory\n");
                exit(1);
        }
        for (size_t i = 0; i < s.w_bytes; i++)
                s.w[i] = (uint8_t)bench_rng(&rng);
        for (size_t b = 0; b < s.w_bytes; b += s.t->bytes) { /* scales 2^-6 .. 2^-4, any sign */
                uint16_t d = (uint16_t)(0x2400 + bench_rng(&rng) % 0x800), m = (uint16_t)(d | 0x8000);
                memcpy(s.w + b, &d, 2);
                if (id == QTYPE_Q4_1)
                        memcpy(s.w + b + 2, &m, 2);
        }
        for (size_t i = 0; i < (size_t)cols * n_x; i++)
                s.x[i] = (float)((double)(bench_rng(&rng) >> 11) / 9007199254740992.0 * 2 - 1);
        for (int k = 0; k < MEASUREMENTS; k++)
                for (int w = 0; w < WHAT_COUNT; w++)
                        samples[w][k] = skipped(w, quick) ? 0 : measure(&s, (enum what)w, min_ms);
        for (int w = 0; w < WHAT_COUNT; w++)
                med[w] = bench_quantile(samples[w], MEASUREMENTS, 0.5);
        for (int w = 0; w < WHAT_COUNT; w++) {
                if (lacking(w))
                        printf("%-4s %5u x %-5u B %-2u %-11s (not on this CPU)\n", s.t->name, rows, cols, n_x,
                               what_names[w]);
                if (skipped(w, quick))
                        continue;
                best = is_fast(w) ? w : best;
                double gbs = (double)s.w_bytes / med[w] * 1e-9;
                printf("%-4s %5u x %-5u B %-2u %-11s %9.1f us %6.2f GB/s %5.3f of memcpy", s.t->name, rows,
                       cols, n_x, what_names[w], med[w] * 1e6, gbs, med[WHAT_MEMCPY] / med[w]);
                if (w != WHAT_MEMCPY && w != WHAT_EXACT && !quick)
                        printf("  fast/exact %5.2f", med[WHAT_EXACT] / med[w]);
                if (w != WHAT_MEMCPY)
                        printf("  %8.2f us per vector", med[w] * 1e6 / n_x);
                if (w >= WHAT_AVX2 && n_x > 1 && best_b1 > 0)
                        printf("  batch gain %4.2f", best_b1 * n_x / med[w]);
                if (w > WHAT_AVX2 && med[WHAT_AVX2] > 0)
                        printf("  avx2/this %4.2f", med[WHAT_AVX2] / med[w]);
                printf("\n");
        }
        free(s.w);
        free(s.copy);
        free(s.x);
        free(s.y);
        free(s.xq);
        return med[best];
}

static double thread_cpu_seconds(void) {
        struct timespec t;

        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
        return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* --stream: one core's read bandwidth from memory, the floor of decode (every weight read once a
 * token): memchr for a byte that is not there over 256 MB of varied bytes (libc's vector loop,
 * reads only; zero pages would be read from one shared page where the host merges them), per
 * CPU-second of the thread (as bench/decode.sh's decode figures: on a shared machine the wall clock
 * measures the other jobs), best of 5 passes after a first one; and the tokens per CPU-second it
 * allows at weight_mb a token. */
static int stream(double weight_mb) {
        size_t n = (size_t)256 << 20;
        char *buf = malloc(n);
        double best = 0;

        if (!buf)
                return 1;
        for (size_t i = 0; i < n; i++) /* no 1 byte, and no two pages alike (a host may merge those) */
                buf[i] = (char)(2 + (i * 2654435761u >> 24) % 200);
        for (int k = 0; k < 6; k++) {
                double t0 = thread_cpu_seconds();
                if (memchr(buf, 1, n))
                        return 1;
                double gbs = (double)n / (thread_cpu_seconds() - t0) * 1e-9;
                best = k && gbs > best ? gbs : best;
        }
        printf("read bandwidth, one core: %.2f GB/s per CPU-second (best of 5 reads of 256 MB); at %.1f MB of "
               "weights a token: %.1f tokens per CPU-second\n",
               best, weight_mb, best * 1000 / weight_mb);
        free(buf);
        return 0;
}

int main(int argc, char **argv) {
        static const struct option opts[] = { { "min-ms", required_argument, NULL, 'm' },
                                              { "quick", no_argument, NULL, 'q' },
                                              { "stream", required_argument, NULL, 's' },
                                              { 0 } };
        static const struct {
                uint32_t id, rows, cols;
        } shapes[] = { { QTYPE_Q4_1, 576, 1536 }, { QTYPE_Q4_1, 1536, 576 }, { QTYPE_Q8_0, 49152, 576 } };
        static const uint32_t batches[] = { 1, 4, 8 };
        double min_ms = 20;
        int c, quick = 0;

        while ((c = getopt_long(argc, argv, "m:qs:", opts, NULL)) != -1) {
                if (c == 's')
                        return stream(atof(optarg));
                if (c == 'q')
                        quick = 1;
                else if (c == 'm')
                        min_ms = atof(optarg);
                else {
                        fprintf(stderr, "usage: bench-matmul [--min-ms MS] [--quick] | --stream WEIGHT_MB\n");
                        return 2;
                }
        }
        printf("one thread, median of %d measurements of at least %.0f ms\n", MEASUREMENTS, min_ms);
        for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
                double b1 = 0;
                for (size_t j = 0; j < sizeof(batches) / sizeof(batches[0]); j++) {
                        double t = bench_shape(shapes[i].id, shapes[i].rows, shapes[i].cols, batches[j],
                                               min_ms, quick, b1);
                        b1 = batches[j] == 1 ? t : b1;
                }
        }
        return 0;
}
