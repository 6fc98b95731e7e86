/* bench-compact: plan application (CPU compaction, compact_layer) against memcpy of the same
 * bytes (issue 7, item 3).
 *
 * One layer of n tokens in blocks of 16 slots carved back to back out of one buffer (as out of a
 * pool chunk), compacted by a keep-set of one of these shapes:
 *
 *   window   the newest half stays: every slot moves, in runs as long as the blocks allow
 *   h2o      4 sinks, the newest quarter, and a random quarter of the rest: runs of every length
 *   h2o-per-head  the same with each KV head's own random quarter (per_head plans, as h2o's
 *            default): runs are found and moved head by head
 *   sparse   a random eighth: nearly every kept token is a run of its own
 *
 * The bytes moved are the keys, values and five side arrays (20 bytes) of every KV head of every
 * token whose slot changes. The baseline is one memcpy of that many bytes between two other
 * buffers; the ratio is compaction's bandwidth over memcpy's. Compaction is timed in place on the
 * same layer again and again (its bytes do not matter to its speed), alternating with memcpy,
 * each figure the median of 7 measurements of at least --min-ms.
 *
 * Geometries: stories260K (4 KV heads, head_dim 8, f32: 32-byte rows) and a 7B-class model
 * (8 KV heads, head_dim 128, f16: 256-byte rows).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "block.h"
#include "common.h"
#include "compact.h"

#define MEASUREMENTS 7

struct geometry {
        const char *name;
        uint32_t kv_heads, head_dim;
        enum block_dtype dtype;
};

static const struct geometry geometries[] = {
        { "stories260K (4 x 8, f32)", 4, 8, BLOCK_DTYPE_F32 },
        { "7B-class (8 x 128, f16)", 8, 128, BLOCK_DTYPE_F16 },
};

enum shape { SHAPE_WINDOW, SHAPE_H2O, SHAPE_H2O_PER_HEAD, SHAPE_SPARSE };
static const char *const shape_names[] = { "window", "h2o", "h2o-per-head", "sparse" };

/* Exactly m of the slots [from, to), at random, ascending (selection sampling); the next free
 * entry of keep. */
static uint32_t *sample(uint32_t from, uint32_t to, uint32_t m, uint32_t *keep, uint64_t *rng) {
        for (uint32_t i = from; i < to && m; i++)
                if (bench_rng(rng) % (to - i) < m) {
                        *keep++ = i;
                        m--;
                }
        return keep;
}

/* The keep-set of a shape over n slots (per head: heads sets, head after head); its count per
 * head. */
static uint32_t make_keep(enum shape sh, uint32_t n, uint32_t heads, uint32_t *keep, uint64_t *rng) {
        uint32_t k = 0;
        switch (sh) {
        case SHAPE_H2O_PER_HEAD: { /* what h2o keeps by default: sinks, recent, and each head's own best */
                uint32_t recent = n / 4, mid = (n - 4 - recent) / 4;
                for (uint32_t h = 0; h < heads; h++) {
                        uint32_t *p = keep + (size_t)h * (4 + mid + recent);
                        for (uint32_t i = 0; i < 4; i++)
                                *p++ = i;
                        p = sample(4, n - recent, mid, p, rng);
                        for (uint32_t i = n - recent; i < n; i++)
                                *p++ = i;
                }
                return 4 + mid + recent;
        }
        case SHAPE_WINDOW:
                for (uint32_t i = n / 2; i < n; i++)
                        keep[k++] = i;
                break;
        case SHAPE_H2O:
                for (uint32_t i = 0; i < n; i++)
                        if (i < 4 || i >= n - n / 4 || bench_rng(rng) % 4 == 0)
                                keep[k++] = i;
                break;
        case SHAPE_SPARSE:
                for (uint32_t i = 0; i < n; i++)
                        if (bench_rng(rng) % 8 == 0)
                                keep[k++] = i;
                break;
        }
        return k;
}

struct job {
        struct block_layer L;
        const uint32_t *keep;
        uint32_t k;
        int per_head;
        uint8_t *src, *dst;
        size_t bytes;
};

static void run_compact(struct job *j) {
        uint32_t n;
        if (compact_layer(&j->L, j->keep, j->k, j->per_head, j->L.n_tokens, &n) < 0) {
                fprintf(stderr, "bench-compact: compact_layer refused the keep-set\n");
                exit(1);
        }
}

static void run_memcpy(struct job *j) {
        memcpy(j->dst, j->src, j->bytes);
        __asm__ volatile("" : : "r"(j->dst) : "memory"); /* the copy is not dead */
}

/* One measurement: seconds per call, repeating fn for min_ms. */
static double once(void (*fn)(struct job *), struct job *j, double min_ms) {
        uint64_t t0 = bench_now_ns(), t, reps = 0;
        do {
                fn(j);
                reps++;
                t = bench_now_ns();
        } while ((double)(t - t0) < min_ms * 1e6);
        return (double)(t - t0) / 1e9 / (double)reps;
}

int main(int argc, char **argv) {
        uint32_t n = 4096;
        double min_ms = 30;
        const char *only_shape = NULL;
        int only_geometry = -1;
        bool json = false;
        static const struct option lo[] = {
                { "tokens", required_argument, NULL, 'n' },
                { "min-ms", required_argument, NULL, 'm' },
                { "json", no_argument, NULL, 'j' },
                { "help", no_argument, NULL, 'h' },
                { "shape", required_argument, NULL, 's' },
                { "geometry", required_argument, NULL, 'g' },
                {},
        };
        int ch;
        while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
                switch (ch) {
                case 'n': n = (uint32_t)atoi(optarg); break;
                case 'm': min_ms = atof(optarg); break;
                case 'j': json = true; break;
                case 's': only_shape = optarg; break;
                case 'g': only_geometry = atoi(optarg); break;
                case 'h':
                        printf("Usage: bench-compact [--tokens N] [--min-ms MS] [--shape window|h2o|sparse] "
                               "[--geometry 0|1] [--json]\n"
                               "(--shape and --geometry pick one case, for a profiler)\n");
                        return 0;
                default: return 2;
                }
        }
        if (n < 64 || n > (1u << 20) || !(min_ms > 0)) {
                fprintf(stderr, "bench-compact: bad arguments\n");
                return 2;
        }
        int cpu_client, cpu_server;
        bench_pick_cpus(&cpu_client, &cpu_server);
        bench_pin(0, cpu_client);
        if (!json) {
                printf("3. Plan application: compact_layer of one layer of %u tokens against memcpy of the "
                       "same bytes\n",
                       n);
                printf("| geometry | keep-set | tokens kept | bytes moved | compaction GB/s | memcpy GB/s | "
                       "compaction / memcpy |\n");
                printf("|---|---|---:|---:|---:|---:|---:|\n");
        }
        double worst = 1e9;
        for (size_t g = 0; g < sizeof(geometries) / sizeof(geometries[0]); g++) {
                const struct geometry *ge = &geometries[g];
                if (only_geometry >= 0 && (size_t)only_geometry != g)
                        continue;
                struct block_layout lay;
                block_layout_init(&lay, 16, ge->kv_heads, ge->head_dim, ge->dtype);
                uint32_t n_blocks = n / 16;
                uint8_t *pool = aligned_alloc(4096, (size_t)n_blocks * lay.block_bytes);
                uint8_t **blocks = malloc(n_blocks * sizeof(*blocks));
                uint32_t *keep = malloc((size_t)n * ge->kv_heads * sizeof(*keep));
                if (!pool || !blocks || !keep) {
                        perror("bench-compact");
                        return 1;
                }
                memset(pool, 1, (size_t)n_blocks * lay.block_bytes);
                for (uint32_t b = 0; b < n_blocks; b++)
                        blocks[b] = pool + (size_t)b * lay.block_bytes;
                for (int sh = SHAPE_WINDOW; sh <= SHAPE_SPARSE; sh++) {
                        if (only_shape && strcmp(only_shape, shape_names[sh]) != 0)
                                continue;
                        uint64_t rng = 7 + (uint64_t)sh;
                        struct job j = {
                                .L = { .layout = &lay, .blocks = blocks, .n_blocks = n_blocks, .n_tokens = n }
                        };
                        j.k = make_keep((enum shape)sh, n, lay.n_kv_heads, keep, &rng);
                        j.keep = keep;
                        j.per_head = sh == SHAPE_H2O_PER_HEAD;
                        uint64_t moved = 0; /* token-heads whose slot changes */
                        for (uint32_t h = 0; h < lay.n_kv_heads; h++)
                                for (uint32_t i = 0; i < j.k; i++)
                                        moved += keep[(j.per_head ? (size_t)h * j.k : 0) + i] != i;
                        j.bytes = (size_t)(moved * (2 * lay.row_bytes + 5 * 4));
                        j.src = aligned_alloc(4096, (j.bytes + 4095) & ~(size_t)4095);
                        j.dst = aligned_alloc(4096, (j.bytes + 4095) & ~(size_t)4095);
                        if (!j.src || !j.dst) {
                                perror("bench-compact");
                                return 1;
                        }
                        memset(j.src, 2, j.bytes);
                        memset(j.dst, 3, j.bytes);
                        run_compact(&j);
                        run_memcpy(&j);
                        double tc[MEASUREMENTS], tm[MEASUREMENTS];
                        for (int m = 0; m < MEASUREMENTS; m++) {
                                tc[m] = once(run_compact, &j, min_ms);
                                tm[m] = once(run_memcpy, &j, min_ms);
                        }
                        double c = (double)j.bytes / bench_quantile(tc, MEASUREMENTS, 0.5) / 1e9;
                        double mc = (double)j.bytes / bench_quantile(tm, MEASUREMENTS, 0.5) / 1e9;
                        if (c / mc < worst)
                                worst = c / mc;
                        if (json)
                                printf("{\"geometry\":\"%s\",\"keep\":\"%s\",\"kept\":%u,\"bytes\":%zu,"
                                       "\"compact_gbs\":%.3f,"
                                       "\"memcpy_gbs\":%.3f,\"ratio\":%.3f}\n",
                                       ge->name, shape_names[sh], j.k, j.bytes, c, mc, c / mc);
                        else
                                printf("| %s | %s | %u | %zu | %.2f | %.2f | **%.2f** |\n", ge->name,
                                       shape_names[sh], j.k, j.bytes, c, mc, c / mc);
                        fflush(stdout);
                        free(j.src);
                        free(j.dst);
                }
                free(pool);
                free(blocks);
                free(keep);
        }
        if (!json)
                printf("target: at least 0.7 of memcpy's bandwidth: %s (worst %.2f)\n",
                       worst >= 0.7 ? "HOLDS" : "DOES NOT HOLD", worst);
        return 0;
}
