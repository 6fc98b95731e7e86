/* gpucheck.c: kvc-gpucheck, the GPU check of the CUDA kernels (tests/gpu/run.sh builds and runs
 * it; docs/kernels.md shows its output).
 *
 * Every CUDA kernel runs on fresh random inputs against its CPU reference, and is timed; a
 * device-to-device copy of the same number of bytes is timed in the same run as the yardstick.
 * One table row per kernel and case:
 *
 *   kernel, shape, max relative error against the CPU reference, time (median of the runs),
 *   GB/s (bytes the kernel must move / time), the percentage of the copy's GB/s, a verdict.
 *
 * Two parts. The matrix (`--quick` runs only it): small cases over every variant the kernels
 * have (f16, bf16 and f32 windows; head dims 64, 128, 256; query groups 1, 3, 4, 8, 12; blocks of
 * 16 and 32 tokens; masked and all-masked tokens; per-head keep-sets; refused keep-sets). Then the
 * table of the issue: 8 KV heads, 32 query heads, head dims 64 and 128, 4K to 32K tokens.
 *
 * Errors: attention output per query head max|gpu - cpu| / max|cpu|, and the same for each score
 * array per KV head; the worse is shown (threshold 1e-4). Compaction and quantization are
 * compared byte for byte over the whole buffer of blocks, garbage included (the kernels produce
 * the CPU's bytes; the column shows the fraction of bytes that differ, 0 to pass). A refused
 * keep-set must leave every byte alone. The summary per field, relative (1e-5), top-1 exactly.
 *
 * Bytes: attention, the keys, values, key and value scales and log-weights it reads plus the
 * score arrays it reads and writes (its logits scratch is not counted); compaction, every byte of
 * a chunk it rewrites, read once and written once (chunks it skips are not counted); summary, the
 * logits once. The copy moves the same number of bytes, half read and half written.
 *
 * Targets checked at the end of the table: compaction at least 80% of the copy's bandwidth, INT8
 * decode attention faster than F16 over the same tokens from 8K tokens on. Exit status 0 when every
 * check passed or when there is no GPU (it says so), 1 when a check failed, 2 on a CUDA error.
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "block.h"
#include "cuda.h"
#include "ladder.h"
#include "lloyd.h"
#include "mixed.h"
#include "quant.h"
#include "summary.h"
#include "tier.h"

#define CK(x)                                                                                                \
        do {                                                                                                 \
                cudaError_t e_ = (x);                                                                        \
                if (e_ != cudaSuccess) {                                                                     \
                        fprintf(stderr, "kvc-gpucheck: %s:%d: %s: %s\n", __FILE__, __LINE__, #x,             \
                                cudaGetErrorString(e_));                                                     \
                        exit(2);                                                                             \
                }                                                                                            \
        } while (0)

#define KV(x)                                                                                                \
        do {                                                                                                 \
                int r_ = (x);                                                                                \
                if (r_ != 0) {                                                                               \
                        fprintf(stderr, "kvc-gpucheck: %s:%d: %s returned %d\n", __FILE__, __LINE__, #x,     \
                                r_);                                                                         \
                        exit(2);                                                                             \
                }                                                                                            \
        } while (0)

static uint64_t rng_state = 0x6b7663u;

static uint64_t rng_next(void) {
        uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

static uint32_t rng_below(uint32_t n) {
        return (uint32_t)(rng_next() % n);
}

static float rng_uniform(float lo, float hi) {
        return lo + (hi - lo) * (float)((double)(rng_next() >> 11) / 9007199254740992.0);
}

static void *xmalloc(size_t n) {
        void *p = malloc(n ? n : 1);
        if (!p) {
                fprintf(stderr, "kvc-gpucheck: out of memory (%zu bytes)\n", n);
                exit(2);
        }
        return p;
}

static cudaStream_t stream;
static cudaEvent_t ev0, ev1;
static int failures, runs = 21;

static int cmp_float(const void *a, const void *b) {
        float x = *(const float *)a, y = *(const float *)b;
        return x < y ? -1 : x > y;
}

static float median(float *x, int n) {
        qsort(x, n, sizeof(*x), cmp_float);
        return x[n / 2];
}

/* ---- a mixed layer: host mirror and device copy of one buffer of blocks ---- */

enum mask_mode { MASK_NONE, MASK_SOME, MASK_ALL };

struct glayer {
        struct block_layout lf, lq;
        uint32_t T, H, n_q8b, n_fpb;
        size_t bytes;
        uint8_t *host, *initial; /* the host mirror, and its state before any kernel */
        uint8_t *dev, *pristine; /* pristine: a device copy of the initial state */
        uint8_t **h_q8, **h_fp;  /* host tables into host */
        uint8_t **d_q8, **d_fp;  /* device tables: device arrays of device pointers */
        struct mixed_layer Mh, Md;
};

static void shuffle(uint32_t *x, uint32_t n) {
        for (uint32_t i = n; i > 1; i--) {
                uint32_t j = rng_below(i), t = x[i - 1];
                x[i - 1] = x[j];
                x[j] = t;
        }
}

/* n tokens of H KV heads, the first n_q8 INT8, the rest of dtype dt; the tables can hold n tokens
 * of either class. Blocks in shuffled order in one buffer; garbage in every unused byte. */
/* Slot s's side arrays (its position, random scores, a log-weight: -inf where the mask says). */
static void fill_side(const struct block_layout *l, uint8_t *b, uint32_t h, uint32_t in, uint32_t s, int mask) {
        int32_t pos = (int32_t)s;
        int masked = mask == MASK_ALL || (mask == MASK_SOME && (s % 11 == 3 || (s >= 32 && s < 48)));
        memcpy(block_side(l, b, l->pos_offset, h, in), &pos, 4);
        *(float *)block_side(l, b, l->sum_offset, h, in) = rng_uniform(0, 2);
        *(float *)block_side(l, b, l->ema_offset, h, in) = rng_uniform(0, 1);
        *(float *)block_side(l, b, l->last_offset, h, in) = rng_uniform(0, 1);
        *(float *)block_side(l, b, l->logw_offset, h, in) = masked ? -INFINITY : rng_uniform(-2, 0);
}

static void layer_make(struct glayer *g, enum block_dtype dt, uint32_t T, uint32_t H, uint32_t D, uint32_t n,
                       uint32_t n_q8, enum mask_mode mask) {
        memset(g, 0, sizeof(*g));
        g->T = T;
        g->H = H;
        KV(block_layout_init(&g->lf, T, H, D, dt));
        KV(block_layout_init(&g->lq, T, H, D, BLOCK_DTYPE_Q8));
        g->n_q8b = (n + T - 1) / T + 1;
        g->n_fpb = (n + T - 1) / T + 1;
        g->bytes = g->n_q8b * g->lq.block_bytes + g->n_fpb * g->lf.block_bytes;
        g->host = xmalloc(g->bytes);
        g->initial = xmalloc(g->bytes);
        CK(cudaMalloc((void **)&g->dev, g->bytes));
        CK(cudaMalloc((void **)&g->pristine, g->bytes));
        uint32_t *perm = xmalloc((g->n_q8b + g->n_fpb) * sizeof(*perm));
        for (uint32_t i = 0; i < g->n_q8b + g->n_fpb; i++)
                perm[i] = i;
        shuffle(perm, g->n_q8b);
        shuffle(perm + g->n_q8b, g->n_fpb);
        uint8_t **dq = xmalloc(g->n_q8b * sizeof(*dq)), **df = xmalloc(g->n_fpb * sizeof(*df));
        g->h_q8 = xmalloc(g->n_q8b * sizeof(*g->h_q8));
        g->h_fp = xmalloc(g->n_fpb * sizeof(*g->h_fp));
        for (uint32_t i = 0; i < g->n_q8b; i++) {
                size_t off = (size_t)perm[i] * g->lq.block_bytes;
                g->h_q8[i] = g->host + off;
                dq[i] = g->dev + off;
        }
        for (uint32_t i = 0; i < g->n_fpb; i++) {
                size_t off = g->n_q8b * g->lq.block_bytes +
                             (size_t)(perm[g->n_q8b + i] - g->n_q8b) * g->lf.block_bytes;
                g->h_fp[i] = g->host + off;
                df[i] = g->dev + off;
        }
        CK(cudaMalloc((void **)&g->d_q8, g->n_q8b * sizeof(*dq)));
        CK(cudaMalloc((void **)&g->d_fp, g->n_fpb * sizeof(*df)));
        CK(cudaMemcpy(g->d_q8, dq, g->n_q8b * sizeof(*dq), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(g->d_fp, df, g->n_fpb * sizeof(*df), cudaMemcpyHostToDevice));
        free(dq);
        free(df);
        free(perm);

        /* garbage that is finite in every dtype, then the live slots */
        for (size_t i = 0; i < g->bytes / 8; i++)
                ((uint64_t *)g->host)[i] = rng_next() & 0x3c3c3c3c3c3c3c3cull;
        float *k = xmalloc((size_t)T * D * sizeof(float)), *v = xmalloc((size_t)T * D * sizeof(float));
        g->Mh = (struct mixed_layer){ .fp = &g->lf,
                                      .q8 = &g->lq,
                                      .fp_blocks = g->h_fp,
                                      .n_fp_blocks = g->n_fpb,
                                      .q8_blocks = g->h_q8,
                                      .n_q8_blocks = g->n_q8b,
                                      .n_q8 = n_q8,
                                      .n_tokens = n };
        g->Md = g->Mh;
        g->Md.fp_blocks = g->d_fp;
        g->Md.q8_blocks = g->d_q8;
        for (uint32_t h = 0; h < H; h++) {
                for (uint32_t b = 0; b * T < n_q8; b++) {
                        uint32_t cnt = n_q8 - b * T < T ? n_q8 - b * T : T;
                        for (uint32_t i = 0; i < cnt * D; i++) {
                                k[i] = rng_uniform(-1, 1) *
                                       (i % D == 5 ? 8.0f : 1.0f); /* an outlier channel */
                                v[i] = rng_uniform(-1, 1);
                        }
                        KV(quant_block_fill_head(&g->lq, g->h_q8[b], h, k, v, cnt));
                }
                for (uint32_t s = n_q8; s < n; s++) {
                        uint8_t *b = g->h_fp[(s - n_q8) / T];
                        uint32_t in = (s - n_q8) % T;
                        for (uint32_t i = 0; i < D; i++) {
                                k[i] = rng_uniform(-1, 1) * (i == 5 ? 8.0f : 1.0f);
                                v[i] = rng_uniform(-1, 1);
                        }
                        block_store_row(dt, k, block_key(&g->lf, b, h, in), D);
                        block_store_row(dt, v, block_value(&g->lf, b, h, in), D);
                }
                for (uint32_t s = 0; s < n; s++) {
                        const struct block_layout *l = s < n_q8 ? &g->lq : &g->lf;
                        uint8_t *b = s < n_q8 ? g->h_q8[s / T] : g->h_fp[(s - n_q8) / T];
                        uint32_t in = s < n_q8 ? s % T : (s - n_q8) % T;
                        fill_side(l, b, h, in, s, mask);
                }
        }
        free(k);
        free(v);
        memcpy(g->initial, g->host, g->bytes);
        CK(cudaMemcpy(g->dev, g->host, g->bytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(g->pristine, g->dev, g->bytes, cudaMemcpyDeviceToDevice));
}

static void layer_free(struct glayer *g) {
        free(g->host);
        free(g->initial);
        free(g->h_q8);
        free(g->h_fp);
        CK(cudaFree(g->dev));
        CK(cudaFree(g->pristine));
        CK(cudaFree(g->d_q8));
        CK(cudaFree(g->d_fp));
}

static const char *dtype_name(enum block_dtype dt) {
        return dt == BLOCK_DTYPE_F32 ? "f32" : dt == BLOCK_DTYPE_BF16 ? "bf16" : "f16";
}

/* ---- timing and the table ---- */

static void timer_start(void) {
        CK(cudaEventRecord(ev0, stream));
}

static float timer_usec(void) {
        float ms;
        CK(cudaEventRecord(ev1, stream));
        CK(cudaEventSynchronize(ev1));
        CK(cudaEventElapsedTime(&ms, ev0, ev1));
        return ms * 1000.0f;
}

/* The median time of a D2D copy of `bytes` (half read, half written), in microseconds. */
static float copy_usec(size_t bytes) {
        size_t half = bytes / 2;
        void *a, *b;
        float *t = xmalloc(runs * sizeof(*t));
        CK(cudaMalloc(&a, half ? half : 1));
        CK(cudaMalloc(&b, half ? half : 1));
        CK(cudaMemsetAsync(a, 1, half, stream));
        for (int i = 0; i < runs; i++) {
                timer_start();
                CK(cudaMemcpyAsync(b, a, half, cudaMemcpyDeviceToDevice, stream));
                t[i] = timer_usec();
        }
        CK(cudaFree(a));
        CK(cudaFree(b));
        float m = median(t, runs);
        free(t);
        return m;
}

/* Prints a row; returns the kernel's bandwidth as a fraction of the copy's. */
static double row(const char *kernel, const char *shape, double err, int ok, float usec, double bytes) {
        double gbs = bytes / (usec * 1e3), copy = bytes / (copy_usec((size_t)bytes) * 1e3);
        printf("%-9s %-40s %11.2e %10.1f %9.1f %7.1f%%  %s\n", kernel, shape, err, (double)usec, gbs,
               100.0 * gbs / copy, ok ? "ok" : "FAIL");
        fflush(stdout);
        if (!ok)
                failures++;
        return gbs / copy;
}

/* ---- attention ---- */

static double attention_bytes(const struct glayer *g) {
        double n = g->Mh.n_tokens, n_q8 = g->Mh.n_q8, D = g->lf.head_dim, eb = g->lf.elem_bytes;
        double per_q8 = 2 * D + 4 /* vscale */ + 4 /* logw */ + 24 /* sum, ema, last read and written */;
        double per_fp = 2 * D * eb + 4 + 24;
        double kscales = ceil(n_q8 / g->T) * D * 4;
        return g->H * (n_q8 * per_q8 + (n - n_q8) * per_fp + kscales);
}

/* Runs and times attention with nh query heads; returns the median time, *ret_err the worse
 * relative error of output and scores. */
static float check_attention(struct glayer *g, uint32_t nh, double *ret_err) {
        uint32_t D = g->lf.head_dim, n = g->Mh.n_tokens, H = g->H, T = g->T;
        float *q = xmalloc((size_t)nh * D * 4), *out = xmalloc((size_t)nh * D * 4),
              *gout = xmalloc((size_t)nh * D * 4);
        float *scratch = xmalloc(attn_mixed_scratch_floats(&g->Mh, nh) * sizeof(float));
        for (size_t i = 0; i < (size_t)nh * D; i++)
                q[i] = rng_uniform(-1, 1);
        float *dq, *dout;
        size_t wsb = kvc_cuda_attn_workspace_bytes(&g->Md, nh);
        void *ws;
        CK(cudaMalloc((void **)&dq, (size_t)nh * D * 4));
        CK(cudaMalloc((void **)&dout, (size_t)nh * D * 4));
        CK(cudaMalloc(&ws, wsb));
        CK(cudaMemcpy(dq, q, (size_t)nh * D * 4, cudaMemcpyHostToDevice));
        CK(cudaMemset(dout, 0xff, (size_t)nh * D * 4));

        KV(attn_decode_mixed(&g->Mh, q, out, nh, 0.9f, 1, scratch));
        KV(kvc_cuda_attn_decode_mixed(&g->Md, dq, dout, nh, 0.9f, 1, ws, wsb, stream));
        CK(cudaStreamSynchronize(stream));
        CK(cudaMemcpy(gout, dout, (size_t)nh * D * 4, cudaMemcpyDeviceToHost));
        uint8_t *got = xmalloc(g->bytes);
        CK(cudaMemcpy(got, g->dev, g->bytes, cudaMemcpyDeviceToHost));

        double err = 0;
        for (uint32_t h = 0; h < nh; h++) {
                double m = 0, e = 0;
                for (uint32_t c = 0; c < D; c++) {
                        m = fmax(m, fabs(out[h * D + c]));
                        e = fmax(e, fabs((double)gout[h * D + c] - out[h * D + c]));
                        if (isnan(gout[h * D + c]))
                                e = INFINITY;
                }
                err = fmax(err, m > 0 ? e / m : e);
        }
        /* the score arrays (sum, ema, last) per KV head, through the host tables shifted to `got` */
        for (uint32_t h = 0; h < H; h++) {
                for (int a = 0; a < 3; a++) {
                        double m = 0, e = 0;
                        for (uint32_t s = 0; s < n; s++) {
                                int q8 = s < g->Mh.n_q8;
                                const struct block_layout *l = q8 ? &g->lq : &g->lf;
                                uint8_t *b = q8 ? g->h_q8[s / T] : g->h_fp[(s - g->Mh.n_q8) / T];
                                uint32_t in = q8 ? s % T : (s - g->Mh.n_q8) % T;
                                uint64_t off = a == 0   ? l->sum_offset
                                               : a == 1 ? l->ema_offset
                                                        : l->last_offset;
                                float c = *(float *)block_side(l, b, off, h, in);
                                float x = *(float *)block_side(l, got + (b - g->host), off, h, in);
                                m = fmax(m, fabs(c));
                                e = isnan(x) ? INFINITY : fmax(e, fabs((double)x - c));
                        }
                        err = fmax(err, m > 0 ? e / m : e);
                }
        }
        /* nothing but the score arrays changed */
        for (uint32_t i = 0; i < g->n_q8b + g->n_fpb; i++) {
                const struct block_layout *l = i < g->n_q8b ? &g->lq : &g->lf;
                size_t off = (i < g->n_q8b ? g->h_q8[i] : g->h_fp[i - g->n_q8b]) - g->host;
                if (memcmp(got + off, g->initial + off, l->sum_offset) ||
                    memcmp(got + off + l->logw_offset, g->initial + off + l->logw_offset,
                           l->block_bytes - l->logw_offset))
                        err = INFINITY;
        }
        *ret_err = err;

        float *t = xmalloc(runs * sizeof(*t));
        for (int i = 0; i < runs; i++) {
                timer_start();
                KV(kvc_cuda_attn_decode_mixed(&g->Md, dq, dout, nh, 0.9f, 1, ws, wsb, stream));
                t[i] = timer_usec();
        }
        float m = median(t, runs);
        CK(cudaFree(dq));
        CK(cudaFree(dout));
        CK(cudaFree(ws));
        free(q);
        free(out);
        free(gout);
        free(scratch);
        free(got);
        free(t);
        return m;
}

static float attention_row(enum block_dtype dt, uint32_t T, uint32_t H, uint32_t nh, uint32_t D, uint32_t n,
                           uint32_t n_q8, enum mask_mode mask) {
        struct glayer g;
        char shape[96];
        double err;
        layer_make(&g, dt, T, H, D, n, n_q8, mask);
        float usec = check_attention(&g, nh, &err);
        snprintf(shape, sizeof(shape), "D=%u T=%u %u/%u heads n=%u q8=%u %s%s", D, T, H, nh, n, n_q8,
                 dtype_name(dt),
                 mask == MASK_ALL    ? " all masked"
                 : mask == MASK_SOME ? " masked"
                                     : "");
        row("attn", shape, err, err <= 1e-4, usec, attention_bytes(&g));
        layer_free(&g);
        return usec;
}

/* ---- a ladder layer (ladder.h): host mirror and device copy of one buffer of blocks ---- */

struct gladder {
        struct block_layout l[LADDER_TIERS];
        uint32_t T, H, D;
        size_t bytes;
        uint8_t *host, *initial, *dev, *pristine;
        uint8_t **h_tab[LADDER_TIERS], **d_tab[LADDER_TIERS];
        float *h_signs, *d_signs;
        uint8_t *h_mask, *d_mask;
        struct ladder_layer Mh, Md;
};

/* The tier and in-table index of logical slot s. */
static void ladder_at(const struct gladder *g, uint32_t s, const struct block_layout **ret_l, uint8_t **ret_b,
                      uint32_t *ret_in) {
        uint32_t t, idx;
        ladder_locate(&g->Mh, s, &t, &idx);
        *ret_l = &g->l[t];
        *ret_b = g->h_tab[t][idx / g->T];
        *ret_in = idx % g->T;
}

/* Tiers dts[0 .. n_tiers) holding n[t] tokens each (tables with a block to spare), blocks shuffled
 * within each tier's region of one buffer, garbage in every unused byte; keys with an outlier
 * channel, rotated for the rotated tiers (lloyd_signs of seed 77, layer 3) and stored by the
 * tier's row. n_shared > 0 (tier 0 alone): a shared prefix with some mask bits set. */
static void ladder_make(struct gladder *g, const enum block_dtype *dts, const uint32_t *n, uint32_t n_tiers,
                        uint32_t T, uint32_t H, uint32_t D, enum mask_mode mask, uint32_t n_shared) {
        memset(g, 0, sizeof(*g));
        g->T = T;
        g->H = H;
        g->D = D;
        size_t region[LADDER_TIERS + 1] = { 0 };
        for (uint32_t t = 0; t < n_tiers; t++) {
                KV(block_layout_init(&g->l[t], T, H, D, dts[t]));
                g->Mh.layout[t] = &g->l[t];
                g->Mh.n_blocks[t] = (n[t] + T - 1) / T + 1;
                g->Mh.n[t] = n[t];
                region[t + 1] = region[t] + g->Mh.n_blocks[t] * g->l[t].block_bytes;
        }
        g->Mh.n_tiers = n_tiers;
        g->bytes = region[n_tiers];
        g->host = xmalloc(g->bytes);
        g->initial = xmalloc(g->bytes);
        CK(cudaMalloc((void **)&g->dev, g->bytes));
        CK(cudaMalloc((void **)&g->pristine, g->bytes));
        g->Md = g->Mh;
        for (uint32_t t = 0; t < n_tiers; t++) {
                uint32_t nb = g->Mh.n_blocks[t], *perm = xmalloc(nb * sizeof(*perm));
                uint8_t **dt = xmalloc(nb * sizeof(*dt));
                for (uint32_t i = 0; i < nb; i++)
                        perm[i] = i;
                shuffle(perm, nb);
                g->h_tab[t] = xmalloc(nb * sizeof(*g->h_tab[t]));
                for (uint32_t i = 0; i < nb; i++) {
                        size_t off = region[t] + (size_t)perm[i] * g->l[t].block_bytes;
                        g->h_tab[t][i] = g->host + off;
                        dt[i] = g->dev + off;
                }
                CK(cudaMalloc((void **)&g->d_tab[t], nb * sizeof(*dt)));
                CK(cudaMemcpy(g->d_tab[t], dt, nb * sizeof(*dt), cudaMemcpyHostToDevice));
                g->Mh.blocks[t] = g->h_tab[t];
                g->Md.blocks[t] = g->d_tab[t];
                free(dt);
                free(perm);
        }
        g->h_signs = xmalloc((size_t)H * D * sizeof(float));
        for (uint32_t h = 0; h < H; h++)
                lloyd_signs(77, 3, h, D, g->h_signs + (size_t)h * D);
        CK(cudaMalloc((void **)&g->d_signs, (size_t)H * D * sizeof(float)));
        CK(cudaMemcpy(g->d_signs, g->h_signs, (size_t)H * D * sizeof(float), cudaMemcpyHostToDevice));
        g->Mh.signs = g->h_signs;
        g->Md.signs = g->d_signs;
        if (n_shared) {
                uint32_t stride = (n_shared + 7) / 8;
                g->h_mask = xmalloc((size_t)H * stride);
                for (size_t i = 0; i < (size_t)H * stride; i++)
                        g->h_mask[i] = (uint8_t)rng_next();
                CK(cudaMalloc((void **)&g->d_mask, (size_t)H * stride));
                CK(cudaMemcpy(g->d_mask, g->h_mask, (size_t)H * stride, cudaMemcpyHostToDevice));
                g->Mh.n_shared = g->Md.n_shared = n_shared;
                g->Mh.mask_stride = g->Md.mask_stride = stride;
                g->Mh.shared_mask = g->h_mask;
                g->Md.shared_mask = g->d_mask;
        }

        for (size_t i = 0; i < g->bytes / 8; i++)
                ((uint64_t *)g->host)[i] = rng_next() & 0x3c3c3c3c3c3c3c3cull;
        float *k = xmalloc((size_t)T * D * sizeof(float)), *v = xmalloc((size_t)T * D * sizeof(float));
        uint32_t total = ladder_tokens(&g->Mh);
        for (uint32_t h = 0; h < H; h++) {
                for (uint32_t t = 0; t < n_tiers; t++) {
                        const struct tier_row *tr = tier_row(dts[t]);
                        for (uint32_t b = 0; b * T < n[t]; b++) {
                                uint32_t cnt = n[t] - b * T < T ? n[t] - b * T : T;
                                for (uint32_t i = 0; i < cnt * D; i++) {
                                        k[i] = rng_uniform(-1, 1) * (i % D == 5 ? 8.0f : 1.0f);
                                        v[i] = rng_uniform(-1, 1);
                                }
                                for (uint32_t i = 0; tr->rotated && i < cnt; i++) {
                                        lloyd_rotate(g->h_signs + (size_t)h * D, k + (size_t)i * D, D);
                                        lloyd_rotate(g->h_signs + (size_t)h * D, v + (size_t)i * D, D);
                                }
                                KV(tr->fill_head(&g->l[t], g->h_tab[t][b], h, k, v, cnt));
                        }
                }
                for (uint32_t s = 0; s < total; s++) {
                        const struct block_layout *l;
                        uint8_t *b;
                        uint32_t in;
                        ladder_at(g, s, &l, &b, &in);
                        fill_side(l, b, h, in, s, mask);
                }
        }
        free(k);
        free(v);
        memcpy(g->initial, g->host, g->bytes);
        CK(cudaMemcpy(g->dev, g->host, g->bytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(g->pristine, g->dev, g->bytes, cudaMemcpyDeviceToDevice));
}

static void ladder_free(struct gladder *g) {
        for (uint32_t t = 0; t < g->Mh.n_tiers; t++) {
                free(g->h_tab[t]);
                CK(cudaFree(g->d_tab[t]));
        }
        free(g->host);
        free(g->initial);
        free(g->h_signs);
        free(g->h_mask);
        CK(cudaFree(g->dev));
        CK(cudaFree(g->pristine));
        CK(cudaFree(g->d_signs));
        if (g->d_mask)
                CK(cudaFree(g->d_mask));
}

/* "f16+q8+q4 40/35/50": the tiers and their counts. */
static void ladder_name(const struct gladder *g, char *buf, size_t size) {
        size_t at = 0;
        for (uint32_t t = 0; t < g->Mh.n_tiers && at < size; t++)
                at += (size_t)snprintf(buf + at, size - at, "%s%s", t ? "+" : "",
                                       tier_row(g->l[t].dtype)->name);
        for (uint32_t t = 0; t < g->Mh.n_tiers && at < size; t++)
                at += (size_t)snprintf(buf + at, size - at, "%s%u", t ? "/" : " ", g->Mh.n[t]);
}

static double ladder_attention_bytes(const struct gladder *g) {
        double bytes = 0;
        for (uint32_t t = 0; t < g->Mh.n_tiers; t++) {
                const struct block_layout *l = &g->l[t];
                double n = g->Mh.n[t], scales = 0;
                if (l->dtype == BLOCK_DTYPE_Q8)
                        scales = 4 + ceil(n / g->T) * l->head_dim * 4 / fmax(n, 1);
                else if (block_dtype_quantized(l->dtype))
                        scales = 8;
                bytes += g->H * n * (2.0 * l->row_bytes + scales + 4 /* logw */ + 24 /* sum, ema, last */);
        }
        return bytes;
}

/* The tolerance of the ladder attention: max|gpu - cpu| / max|cpu| per query head's output and
 * per KV head's score array. The reference dots in double, the kernel in float with the query
 * pre-scaled by 1/sqrt(d) (and rotated after that scaling), sums in another order, and rotates
 * each warp's partial sum back instead of the whole: a logit carries at most about
 * (d + log2 d + 4) u sum_i |q_i k_i| / sqrt(d) of rounding (u = 2^-24; sum |q_i k_i| / sqrt(d) <= 4
 * for these inputs, keys up to 8 on the outlier channel), 1.6e-5 at d = 256; exp turns it into
 * the same relative error of a weight, and the weighted sum and its rotation back (log2 d
 * butterflies) add a few u more. 1e-4, the mixed attention's threshold, covers that with room. */
#define LADDER_ATTN_TOL 1e-4

/* Runs and times ladder attention with nh query heads (rows > 0: ladder_attend_rows of that
 * many rows); returns the median time, *ret_err the worse relative error of output and scores. */
static float check_ladder_attention(struct gladder *g, uint32_t nh, uint32_t rows, double *ret_err) {
        uint32_t D = g->D, H = g->H, n = ladder_tokens(&g->Mh), nr = rows ? rows : 1;
        size_t qn = (size_t)nr * nh * D;
        float *q = xmalloc(qn * 4), *out = xmalloc(qn * 4), *gout = xmalloc(qn * 4);
        float *scratch = xmalloc(ladder_attn_scratch_floats(&g->Mh, nh) * sizeof(float) + 8);
        for (size_t i = 0; i < qn; i++)
                q[i] = rng_uniform(-1, 1);
        float *dq, *dout;
        size_t wsb = kvc_cuda_ladder_attn_workspace_bytes(&g->Md, nh);
        void *ws;
        CK(cudaMalloc((void **)&dq, qn * 4));
        CK(cudaMalloc((void **)&dout, qn * 4));
        CK(cudaMalloc(&ws, wsb));
        CK(cudaMemcpy(dq, q, qn * 4, cudaMemcpyHostToDevice));
        CK(cudaMemset(dout, 0xff, qn * 4));

        if (rows) {
                KV(ladder_attend_rows(&g->Mh, rows, q, out, nh, 0.9f, 1, scratch));
                KV(kvc_cuda_attn_rows_ladder(&g->Md, rows, dq, dout, nh, 0.9f, 1, ws, wsb, stream));
        } else {
                KV(ladder_attend(&g->Mh, q, out, nh, 0.9f, 1, scratch));
                KV(kvc_cuda_attn_decode_ladder(&g->Md, dq, dout, nh, 0.9f, 1, ws, wsb, stream));
        }
        CK(cudaStreamSynchronize(stream));
        CK(cudaMemcpy(gout, dout, qn * 4, cudaMemcpyDeviceToHost));
        uint8_t *got = xmalloc(g->bytes);
        CK(cudaMemcpy(got, g->dev, g->bytes, cudaMemcpyDeviceToHost));

        double err = 0;
        for (uint32_t h = 0; h < nr * nh; h++) {
                double m = 0, e = 0;
                for (uint32_t c = 0; c < D; c++) {
                        m = fmax(m, fabs(out[h * D + c]));
                        e = fmax(e, fabs((double)gout[h * D + c] - out[h * D + c]));
                        if (isnan(gout[h * D + c]))
                                e = INFINITY;
                }
                err = fmax(err, m > 0 ? e / m : e);
        }
        for (uint32_t h = 0; h < H; h++) {
                for (int a = 0; a < 3; a++) {
                        double m = 0, e = 0;
                        for (uint32_t s = 0; s < n; s++) {
                                const struct block_layout *l;
                                uint8_t *b;
                                uint32_t in;
                                ladder_at(g, s, &l, &b, &in);
                                uint64_t off = a == 0   ? l->sum_offset
                                               : a == 1 ? l->ema_offset
                                                        : l->last_offset;
                                float c = *(float *)block_side(l, b, off, h, in);
                                float x = *(float *)block_side(l, got + (b - g->host), off, h, in);
                                m = fmax(m, fabs(c));
                                e = isnan(x) ? INFINITY : fmax(e, fabs((double)x - c));
                        }
                        err = fmax(err, m > 0 ? e / m : e);
                }
        }
        /* nothing but the score arrays changed (shared slots' scores: compared above) */
        for (uint32_t t = 0; t < g->Mh.n_tiers; t++) {
                const struct block_layout *l = &g->l[t];
                for (uint32_t i = 0; i < g->Mh.n_blocks[t]; i++) {
                        size_t off = g->h_tab[t][i] - g->host;
                        if (memcmp(got + off, g->initial + off, l->sum_offset) ||
                            memcmp(got + off + l->logw_offset, g->initial + off + l->logw_offset,
                                   l->block_bytes - l->logw_offset))
                                err = INFINITY;
                }
        }
        *ret_err = err;

        float *t = xmalloc(runs * sizeof(*t));
        for (int i = 0; i < runs; i++) {
                timer_start();
                if (rows)
                        KV(kvc_cuda_attn_rows_ladder(&g->Md, rows, dq, dout, nh, 0.9f, 1, ws, wsb, stream));
                else
                        KV(kvc_cuda_attn_decode_ladder(&g->Md, dq, dout, nh, 0.9f, 1, ws, wsb, stream));
                t[i] = timer_usec();
        }
        float m = median(t, runs);
        CK(cudaFree(dq));
        CK(cudaFree(dout));
        CK(cudaFree(ws));
        free(q);
        free(out);
        free(gout);
        free(scratch);
        free(got);
        free(t);
        return m;
}

/* One ladder attention row: tiers dts with counts n (terminated by a zero dtype). */
static float ladder_attention_row(const enum block_dtype *dts, const uint32_t *n, uint32_t T, uint32_t H,
                                  uint32_t nh, uint32_t D, enum mask_mode mask, uint32_t n_shared,
                                  uint32_t rows) {
        struct gladder g;
        char shape[112], tiers[64];
        double err;
        uint32_t n_tiers = 0;
        while (n_tiers < LADDER_TIERS && dts[n_tiers])
                n_tiers++;
        ladder_make(&g, dts, n, n_tiers, T, H, D, mask, n_shared);
        float usec = check_ladder_attention(&g, nh, rows, &err);
        ladder_name(&g, tiers, sizeof(tiers));
        snprintf(shape, sizeof(shape), "D=%u T=%u %u/%u %s%s%s%s", D, T, H, nh, tiers,
                 mask == MASK_ALL    ? " all masked"
                 : mask == MASK_SOME ? " masked"
                                     : "",
                 n_shared ? " shared" : "", rows ? " rows" : "");
        row(rows ? "ladrows" : "ladattn", shape, err, err <= LADDER_ATTN_TOL, usec,
            ladder_attention_bytes(&g) * (rows ? rows : 1));
        ladder_free(&g);
        return usec;
}

/* ---- compaction ---- */

static uint32_t src_of(const uint32_t *keep, uint32_t kc, uint32_t base, uint32_t i) {
        return i < kc ? keep[i] : base + i - kc;
}

/* The bytes a compaction must move: the chunks it does not skip, read and written once. Mirrors
 * the skip rule of mixed.c and compact.cu. */
static double compaction_bytes(const struct glayer *g, const uint32_t *keep, uint32_t kc, int per_head,
                               uint32_t base, uint32_t new_q8) {
        uint32_t n = g->Mh.n_tokens, n_q8 = g->Mh.n_q8, new_len = kc + n - base, D = g->lf.head_dim, T = g->T;
        double q8_tok = 2.0 * D + 4 + 20, fp_tok = 2.0 * D * g->lf.elem_bytes + 20, bytes = 0;
        for (uint32_t h = 0; h < g->H; h++) {
                const uint32_t *kh = per_head ? keep + (size_t)h * kc : keep;
                for (int q8 = 1; q8 >= 0; q8--) {
                        uint32_t lo = q8 ? 0 : new_q8, hi = q8 ? new_q8 : new_len;
                        for (uint32_t first = lo; first < hi; first += T) {
                                uint32_t cnt = hi - first < T ? hi - first : T, l = first + cnt - 1;
                                uint32_t s0 = src_of(kh, kc, base, first), s1 = src_of(kh, kc, base, l);
                                uint32_t old_live = n_q8 > first ? (n_q8 - first < T ? n_q8 - first : T) : 0;
                                int skip = q8 ? old_live == cnt && s0 == first && s1 == l
                                              : s0 - n_q8 == first - new_q8 && s1 - n_q8 == l - new_q8;
                                for (uint32_t i = first; i <= l && !skip; i++)
                                        bytes += (src_of(kh, kc, base, i) < n_q8 ? q8_tok : fp_tok) +
                                                 (q8 ? q8_tok : fp_tok);
                        }
                }
        }
        return bytes;
}

/* Runs and times a compaction (advance: mixed_advance_q8 instead); compares every byte with the
 * CPU's. refused: the keep-set is wrong, both must refuse it and move nothing. */
static float check_compaction(struct glayer *g, const uint32_t *keep, uint32_t kc, int per_head,
                              uint32_t base, uint32_t new_q8, int advance, int refused, double *ret_err) {
        size_t wsb = kvc_cuda_compact_workspace_bytes(&g->Md), nk = (size_t)(per_head ? g->H : 1) * kc;
        void *ws;
        uint32_t *dkeep = NULL, n_cpu = 0, n_gpu = 0;
        int32_t status = 1;
        float *scratch = xmalloc(compact_mixed_scratch_floats(&g->Mh) * sizeof(float));
        CK(cudaMalloc(&ws, wsb));
        if (nk) {
                CK(cudaMalloc((void **)&dkeep, nk * sizeof(*keep)));
                CK(cudaMemcpy(dkeep, keep, nk * sizeof(*keep), cudaMemcpyHostToDevice));
        }
        int cpu;
        if (advance) {
                cpu = mixed_advance_q8(&g->Mh, new_q8, scratch);
                KV(kvc_cuda_mixed_advance_q8(&g->Md, new_q8, ws, wsb, stream));
        } else {
                cpu = compact_mixed(&g->Mh, keep, kc, per_head, base, new_q8, scratch, &n_cpu);
                KV(kvc_cuda_compact_mixed(&g->Md, dkeep, kc, per_head, base, new_q8, ws, wsb, stream,
                                          &n_gpu));
        }
        CK(cudaStreamSynchronize(stream));
        CK(cudaMemcpy(&status, ws, 4, cudaMemcpyDeviceToHost));
        uint8_t *got = xmalloc(g->bytes);
        CK(cudaMemcpy(got, g->dev, g->bytes, cudaMemcpyDeviceToHost));
        size_t diff = 0;
        for (size_t i = 0; i < g->bytes; i++)
                diff += got[i] != g->host[i];
        int agree = refused ? cpu == -EINVAL && status == -EINVAL && !memcmp(g->host, g->initial, g->bytes)
                            : cpu == 0 && status == 0 && n_cpu == n_gpu;
        *ret_err = agree ? (double)diff / (double)g->bytes : INFINITY;
        if (diff)
                fprintf(stderr, "kvc-gpucheck: compaction: %zu of %zu bytes differ from the CPU's\n", diff,
                        g->bytes);

        float *t = xmalloc(runs * sizeof(*t));
        for (int i = 0; i < runs; i++) {
                CK(cudaMemcpyAsync(g->dev, g->pristine, g->bytes, cudaMemcpyDeviceToDevice, stream));
                timer_start();
                if (advance)
                        KV(kvc_cuda_mixed_advance_q8(&g->Md, new_q8, ws, wsb, stream));
                else
                        KV(kvc_cuda_compact_mixed(&g->Md, dkeep, kc, per_head, base, new_q8, ws, wsb, stream,
                                                  &n_gpu));
                t[i] = timer_usec();
        }
        float m = median(t, runs);
        CK(cudaFree(ws));
        if (dkeep)
                CK(cudaFree(dkeep));
        free(scratch);
        free(got);
        free(t);
        return m;
}

enum keep_kind {
        KEEP_DROP_EVERY_8TH,
        KEEP_SHIFT_BY_ONE,
        KEEP_EVERY_OTHER,
        KEEP_RANDOM,
        KEEP_NOTHING,
        KEEP_UNSORTED,
        KEEP_DROP_INT8_TAIL, /* all but the last 4 INT8 tokens: the last INT8 block shrinks in place */
};

static const char *const keep_names[] = { "keep 7/8",  "shift by one", "every other",       "random half",
                                          "keep none", "unsorted",     "drop the INT8 tail" };

/* Builds keep-set kind (per_head: for head 0, and random sets of the same size for the others,
 * the last one swapped out of order for KEEP_UNSORTED); returns the count. */
static uint32_t keep_build(enum keep_kind kind, uint32_t base, uint32_t n_q8, uint32_t H, int per_head,
                           uint32_t *keep) {
        uint32_t kc = 0;
        switch (kind) {
        case KEEP_DROP_INT8_TAIL:
                for (uint32_t i = 0; i < base; i++)
                        if (i + 4 < n_q8 || i >= n_q8)
                                keep[kc++] = i;
                break;
        case KEEP_DROP_EVERY_8TH:
                for (uint32_t i = 0; i < base; i++)
                        if (i % 8 != 0)
                                keep[kc++] = i;
                break;
        case KEEP_SHIFT_BY_ONE:
                for (uint32_t i = 1; i < base; i++)
                        keep[kc++] = i;
                break;
        case KEEP_EVERY_OTHER:
                for (uint32_t i = 1; i < base; i += 2)
                        keep[kc++] = i;
                break;
        case KEEP_RANDOM:
                for (uint32_t i = 0; i < base; i++)
                        if (rng_below(2))
                                keep[kc++] = i;
                break;
        case KEEP_NOTHING: break;
        case KEEP_UNSORTED:
                for (uint32_t i = 0; i < base; i++)
                        keep[kc++] = i;
                break;
        }
        for (uint32_t h = 1; per_head && h < H; h++) /* choose kc of base, in order */
                for (uint32_t i = 0, need = kc, m = 0; i < base && need; i++)
                        if (rng_below(base - i) < need) {
                                keep[(size_t)h * kc + m++] = i;
                                need--;
                        }
        if (kind == KEEP_UNSORTED && kc > 3) {
                uint32_t *k = keep + (size_t)(per_head ? H - 1 : 0) * kc, x = k[kc / 2];
                k[kc / 2] = k[kc / 2 + 1];
                k[kc / 2 + 1] = x;
        }
        return kc;
}

/* The INT8 tokens the keep-set keeps, the most of any head: new_q8's lower bound. */
static uint32_t kept_int8(const uint32_t *keep, uint32_t kc, int per_head, uint32_t H, uint32_t base,
                          uint32_t n_q8) {
        uint32_t most = 0;
        for (uint32_t h = 0; h < (per_head ? H : 1); h++) {
                uint32_t c = 0;
                while (c < kc && keep[(size_t)h * kc * (per_head != 0) + c] < n_q8)
                        c++;
                c += base < n_q8 ? n_q8 - base : 0;
                most = c > most ? c : most;
        }
        return most;
}

/* One compaction row. extra: new_q8 above the kept INT8 count (clamped to the new length); a
 * negative extra asks for one below it, which must be refused. Returns the fraction of the copy's
 * bandwidth. */
static double compaction_row(enum block_dtype dt, uint32_t T, uint32_t H, uint32_t D, uint32_t n,
                             uint32_t n_q8, uint32_t tail, enum keep_kind kind, int per_head, int extra) {
        struct glayer g;
        char shape[112];
        double err;
        uint32_t base = n - tail, *keep = xmalloc((size_t)H * (base + 1) * sizeof(*keep));
        uint32_t kc = keep_build(kind, base, n_q8, H, per_head, keep), new_len = kc + tail;
        uint32_t lo = kept_int8(keep, kc, per_head, H, base, n_q8);
        uint32_t new_q8 = extra < 0                        ? lo + extra
                          : lo + (uint32_t)extra > new_len ? new_len
                                                           : lo + (uint32_t)extra;
        int refused = kind == KEEP_UNSORTED || extra < 0;
        layer_make(&g, dt, T, H, D, n, n_q8, MASK_NONE);
        double bytes = refused ? 1 : compaction_bytes(&g, keep, kc, per_head, base, new_q8);
        float usec = check_compaction(&g, keep, kc, per_head, base, new_q8, 0, refused, &err);
        snprintf(shape, sizeof(shape), "D=%u T=%u H=%u n=%u q8=%u->%u %s, %s%s%s", D, T, H, n, n_q8, new_q8,
                 dtype_name(dt), keep_names[kind], per_head ? " per head" : "", refused ? " (refused)" : "");
        double pct = row("compact", shape, err, err == 0, usec, bytes);
        layer_free(&g);
        free(keep);
        return pct;
}

static void advance_row(enum block_dtype dt, uint32_t T, uint32_t H, uint32_t D, uint32_t n, uint32_t n_q8,
                        uint32_t new_q8) {
        struct glayer g;
        char shape[96];
        double err;
        uint32_t *ident = xmalloc(n * sizeof(*ident));
        for (uint32_t i = 0; i < n; i++)
                ident[i] = i;
        layer_make(&g, dt, T, H, D, n, n_q8, MASK_NONE);
        double bytes = compaction_bytes(&g, ident, n, 0, n, new_q8);
        float usec = check_compaction(&g, NULL, 0, 0, 0, new_q8, 1, 0, &err);
        snprintf(shape, sizeof(shape), "D=%u T=%u H=%u n=%u q8=%u->%u %s", D, T, H, n, n_q8, new_q8,
                 dtype_name(dt));
        row("quantize", shape, err, err == 0, usec, bytes);
        layer_free(&g);
        free(ident);
}

/* ---- ladder compaction ---- */

enum lkeep_kind {
        LKEEP_RANDOM,     /* about 3/4 of each tier, a third of the kept demoted */
        LKEEP_DROP_FIRST, /* all but the first slot of each tier: every slot moves; no demotion */
        LKEEP_DEMOTE,     /* everything kept (the identity), half of each tier demoted */
        LKEEP_UNSORTED,   /* refused: a swapped pair */
        LKEEP_PROMOTE,    /* refused: a token moved up a tier */
        LKEEP_WRONG_N,    /* refused on the device: new_n off by one between two tiers */
};

static const char *const lkeep_names[] = { "random 3/4", "drop each first", "demote half (identity)",
                                           "unsorted",   "promote one",     "wrong counts" };

/* Builds the keep-set and tiers of kind over g's layer (base = n - tail): per old tier u the same
 * number of kept tokens in every head (per_head: chosen at random per head), the first m_u of them
 * (in order) demoted by `by` tiers (at most to the last). Returns the count; new_n gets the counts. */
static uint32_t lkeep_build(const struct gladder *g, enum lkeep_kind kind, uint32_t tail, int per_head,
                            uint32_t by, uint32_t *keep, uint8_t *tiers, uint32_t *new_n) {
        const struct ladder_layer *M = &g->Mh;
        uint32_t n = ladder_tokens(M), base = n - tail, first[LADDER_TIERS], kc = 0;
        for (uint32_t t = M->n_tiers, f = 0; t-- > 0;) {
                first[t] = f;
                f += M->n[t];
        }
        memset(new_n, 0, LADDER_TIERS * sizeof(*new_n));
        for (uint32_t h = 0; h < (per_head ? g->H : 1u); h++) {
                uint32_t at = 0;
                for (uint32_t u = M->n_tiers; u-- > 0;) {
                        uint32_t lo = first[u], hi = first[u] + M->n[u] < base ? first[u] + M->n[u] : base;
                        if (hi <= lo)
                                continue;
                        uint32_t avail = hi - lo, want = kind == LKEEP_RANDOM       ? avail * 3 / 4
                                                         : kind == LKEEP_DROP_FIRST ? avail - 1
                                                                                    : avail;
                        uint32_t demote = kind == LKEEP_RANDOM   ? want / 3
                                          : kind == LKEEP_DEMOTE ? want / 2
                                                                 : 0;
                        uint32_t nt = u + by < M->n_tiers ? u + by : M->n_tiers - 1;
                        for (uint32_t s = lo, need = want, m = 0; s < hi && need; s++) {
                                int take = kind == LKEEP_RANDOM       ? rng_below(hi - s) < need
                                           : kind == LKEEP_DROP_FIRST ? s > lo
                                                                      : 1;
                                if (!take)
                                        continue;
                                need--;
                                keep[at] = s;
                                tiers[at] = (uint8_t)(m++ < demote ? nt : u);
                                if (h == 0)
                                        new_n[tiers[at]]++;
                                at++;
                        }
                }
                if (h == 0)
                        kc = at;
                keep += at;
                tiers += at;
        }
        new_n[0] += tail;
        keep -= (size_t)(per_head ? g->H : 1) * kc;
        tiers -= (size_t)(per_head ? g->H : 1) * kc;
        uint32_t last = (per_head ? g->H - 1 : 0) * kc;
        if (kind == LKEEP_UNSORTED && kc > 3) {
                uint32_t x = keep[last + kc / 2];
                keep[last + kc / 2] = keep[last + kc / 2 + 1];
                keep[last + kc / 2 + 1] = x;
        }
        if (kind == LKEEP_PROMOTE)
                for (uint32_t i = 0; i < kc; i++)
                        if (tiers[last + i] > 0) {
                                tiers[last + i]--;
                                break;
                        }
        if (kind == LKEEP_WRONG_N)
                for (uint32_t t = 1; t < M->n_tiers; t++)
                        if (new_n[t]) {
                                new_n[t]--;
                                new_n[t - 1]++;
                                break;
                        }
        return kc;
}

/* Runs and times a ladder compaction; compares every byte of the buffer with ladder_compact's.
 * refused: both refuse (the GPU on the device when device_refuses) and nothing moves. */
static float check_ladder_compaction(struct gladder *g, const uint32_t *keep, const uint8_t *tiers,
                                     uint32_t kc, int per_head, uint32_t base, const uint32_t *new_n,
                                     int refused, int cpu_accepts, double *ret_err) {
        size_t wsb = kvc_cuda_ladder_compact_workspace_bytes(&g->Md), nk = (size_t)(per_head ? g->H : 1) * kc;
        void *ws;
        uint32_t *dkeep = NULL, ret_n[LADDER_TIERS];
        uint8_t *dtiers = NULL;
        int32_t status = 1;
        float *scratch = xmalloc(ladder_compact_scratch_floats(&g->Mh) * sizeof(float));
        CK(cudaMalloc(&ws, wsb));
        if (nk) {
                CK(cudaMalloc((void **)&dkeep, nk * sizeof(*keep)));
                CK(cudaMemcpy(dkeep, keep, nk * sizeof(*keep), cudaMemcpyHostToDevice));
                CK(cudaMalloc((void **)&dtiers, nk));
                CK(cudaMemcpy(dtiers, tiers, nk, cudaMemcpyHostToDevice));
        }
        int cpu = cpu_accepts ? 0 : ladder_compact(&g->Mh, keep, tiers, kc, per_head, base, scratch, ret_n);
        if (cpu_accepts) /* the CPU has no new_n: the layer is left as it was */
                memcpy(ret_n, new_n, sizeof(ret_n));
        KV(kvc_cuda_ladder_compact(&g->Md, dkeep, dtiers, kc, per_head, base, new_n, ws, wsb, stream));
        CK(cudaStreamSynchronize(stream));
        CK(cudaMemcpy(&status, ws, 4, cudaMemcpyDeviceToHost));
        uint8_t *got = xmalloc(g->bytes);
        CK(cudaMemcpy(got, g->dev, g->bytes, cudaMemcpyDeviceToHost));
        size_t diff = 0;
        for (size_t i = 0; i < g->bytes; i++)
                diff += got[i] != g->host[i];
        int agree = refused ? (cpu_accepts || cpu == -EINVAL) && status == -EINVAL &&
                                      !memcmp(g->host, g->initial, g->bytes)
                            : cpu == 0 && status == 0 && !memcmp(ret_n, new_n, sizeof(ret_n));
        *ret_err = agree ? (double)diff / (double)g->bytes : INFINITY;
        if (diff)
                fprintf(stderr, "kvc-gpucheck: ladder compaction: %zu of %zu bytes differ from the CPU's\n",
                        diff, g->bytes);

        float *t = xmalloc(runs * sizeof(*t));
        for (int i = 0; i < runs; i++) {
                CK(cudaMemcpyAsync(g->dev, g->pristine, g->bytes, cudaMemcpyDeviceToDevice, stream));
                timer_start();
                KV(kvc_cuda_ladder_compact(&g->Md, dkeep, dtiers, kc, per_head, base, new_n, ws, wsb,
                                           stream));
                t[i] = timer_usec();
        }
        float m = median(t, runs);
        CK(cudaFree(ws));
        if (dkeep) {
                CK(cudaFree(dkeep));
                CK(cudaFree(dtiers));
        }
        free(scratch);
        free(got);
        free(t);
        return m;
}

static void ladder_compaction_row(const enum block_dtype *dts, const uint32_t *n, uint32_t T, uint32_t H,
                                  uint32_t D, uint32_t tail, enum lkeep_kind kind, int per_head,
                                  uint32_t by) {
        struct gladder g;
        char shape[128], tiers_s[64];
        double err;
        uint32_t n_tiers = 0, new_n[LADDER_TIERS];
        while (n_tiers < LADDER_TIERS && dts[n_tiers])
                n_tiers++;
        ladder_make(&g, dts, n, n_tiers, T, H, D, MASK_SOME, 0);
        uint32_t total = ladder_tokens(&g.Mh), base = total - tail;
        uint32_t *keep = xmalloc((size_t)H * (total + 1) * sizeof(*keep));
        uint8_t *tiers = xmalloc((size_t)H * (total + 1));
        uint32_t kc = lkeep_build(&g, kind, tail, per_head, by, keep, tiers, new_n);
        int refused = kind >= LKEEP_UNSORTED;
        float usec = check_ladder_compaction(&g, keep, tiers, kc, per_head, base, new_n, refused,
                                             kind == LKEEP_WRONG_N, &err);
        ladder_name(&g, tiers_s, sizeof(tiers_s));
        snprintf(shape, sizeof(shape), "D=%u T=%u H=%u %s, %s%s by %u%s", D, T, H, tiers_s, lkeep_names[kind],
                 per_head ? " per head" : "", by, refused ? " (refused)" : "");
        /* bytes: every block of the layer read and written once (an upper bound) */
        row("ladcomp", shape, err, err == 0, usec, 2.0 * (double)g.bytes);
        ladder_free(&g);
        free(keep);
        free(tiers);
}

/* ---- summary ---- */

enum logit_kind { LOGITS_RANDOM, LOGITS_TIES, LOGITS_ONE_BAD };

static void summary_row(uint32_t rows, uint32_t V, uint32_t k, enum logit_kind kind) {
        float *z = xmalloc((size_t)rows * V * 4), *topk = xmalloc((size_t)rows * k * 4),
              *gtopk = xmalloc((size_t)rows * k * 4);
        struct summary *s = xmalloc(rows * sizeof(*s)), *gs = xmalloc(rows * sizeof(*gs));
        int32_t *st = xmalloc(rows * 4);
        int *cpu = xmalloc(rows * sizeof(*cpu));
        for (size_t i = 0; i < (size_t)rows * V; i++)
                z[i] = kind == LOGITS_TIES ? (float)rng_below(4)
                                           : rng_uniform(-4, 4) * (i % 97 == 0 ? 3.0f : 1.0f);
        if (kind == LOGITS_ONE_BAD)
                z[(size_t)(rows / 2) * V + V / 3] = NAN;
        for (uint32_t r = 0; r < rows; r++)
                cpu[r] = summary_logits_ref(z + (size_t)r * V, V, &s[r], k ? topk + (size_t)r * k : NULL, k);
        float *dz, *dtopk;
        struct summary *ds;
        int32_t *dst;
        CK(cudaMalloc((void **)&dz, (size_t)rows * V * 4));
        CK(cudaMalloc((void **)&dtopk, (size_t)rows * k * 4 + 4));
        CK(cudaMalloc((void **)&ds, rows * sizeof(*ds)));
        CK(cudaMalloc((void **)&dst, rows * 4));
        CK(cudaMemcpy(dz, z, (size_t)rows * V * 4, cudaMemcpyHostToDevice));
        KV(kvc_cuda_summary(dz, rows, V, ds, k ? dtopk : NULL, k, dst, stream));
        CK(cudaStreamSynchronize(stream));
        CK(cudaMemcpy(gs, ds, rows * sizeof(*ds), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(gtopk, dtopk, (size_t)rows * k * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(st, dst, rows * 4, cudaMemcpyDeviceToHost));
        double err = 0;
        int ok = 1;
        for (uint32_t r = 0; r < rows; r++) {
                ok &= st[r] == cpu[r];
                if (cpu[r])
                        continue;
                const float a[3] = { s[r].entropy, s[r].top1_prob, s[r].margin };
                const float b[3] = { gs[r].entropy, gs[r].top1_prob, gs[r].margin };
                for (int i = 0; i < 3; i++)
                        err = fmax(err, fabs((double)a[i] - b[i]) / fmax(fabs(a[i]), 1e-30));
                for (uint32_t j = 0; j < k; j++)
                        err = fmax(err, fabs((double)topk[r * k + j] - gtopk[r * k + j]) /
                                                fmax(fabs(topk[r * k + j]), 1e-30));
                ok &= s[r].top1 == gs[r].top1;
        }
        float *t = xmalloc(runs * sizeof(*t));
        for (int i = 0; i < runs; i++) {
                timer_start();
                KV(kvc_cuda_summary(dz, rows, V, ds, k ? dtopk : NULL, k, dst, stream));
                t[i] = timer_usec();
        }
        char shape[80];
        snprintf(shape, sizeof(shape), "%u rows x %u, top-%u%s", rows, V, k,
                 kind == LOGITS_TIES      ? ", ties"
                 : kind == LOGITS_ONE_BAD ? ", a NaN row"
                                          : "");
        row("summary", shape, err, ok && err <= 1e-5, median(t, runs), (double)rows * V * 4);
        CK(cudaFree(dz));
        CK(cudaFree(dtopk));
        CK(cudaFree(ds));
        CK(cudaFree(dst));
        free(z);
        free(topk);
        free(gtopk);
        free(s);
        free(gs);
        free(st);
        free(cpu);
        free(t);
}

/* ---- the two parts ---- */

static void matrix(void) {
        const enum block_dtype F16 = BLOCK_DTYPE_F16, BF16 = BLOCK_DTYPE_BF16, F32 = BLOCK_DTYPE_F32;
        printf("-- the matrix: every variant, small\n");
        summary_row(3, 2, 2, LOGITS_RANDOM);
        summary_row(4, 1000, 8, LOGITS_RANDOM);
        summary_row(3, 50, 5, LOGITS_TIES);
        summary_row(3, 100, 0, LOGITS_ONE_BAD);

        attention_row(F16, 16, 2, 8, 64, 300, 200, MASK_SOME);
        attention_row(BF16, 32, 2, 2, 128, 100, 0, MASK_NONE);
        attention_row(F32, 16, 1, 8, 64, 77, 77, MASK_NONE);
        attention_row(F16, 16, 2, 6, 128, 40, 20, MASK_ALL);
        attention_row(F16, 16, 1, 12, 256, 50, 33, MASK_SOME);
        attention_row(F32, 16, 1, 2, 256, 40, 17, MASK_NONE);
        attention_row(F16, 16, 2, 4, 64, 1, 0, MASK_NONE);
        attention_row(BF16, 16, 2, 4, 64, 1000, 900, MASK_NONE);

        /* the ladder: every tier, every dtype of tier 0, head dims 64-256, groups 1-8, empty tiers,
         * only rotated tokens, masks, a shared prefix, prompt rows, several splits */
        const enum block_dtype Q8 = BLOCK_DTYPE_Q8, Q4 = BLOCK_DTYPE_Q4, Q3 = BLOCK_DTYPE_Q3,
                               Q2 = BLOCK_DTYPE_Q2;
        ladder_attention_row((enum block_dtype[]){ F16, Q8, Q4, Q3, Q2 }, (uint32_t[]){ 40, 35, 50, 17, 33 },
                             16, 2, 8, 64, MASK_SOME, 0, 0);
        ladder_attention_row((enum block_dtype[]){ BF16, Q4, 0 }, (uint32_t[]){ 20, 70 }, 32, 2, 6, 128,
                             MASK_NONE, 0, 0);
        ladder_attention_row((enum block_dtype[]){ F32, Q8, Q2, 0 }, (uint32_t[]){ 10, 16, 40 }, 16, 1, 8,
                             256, MASK_NONE, 0, 0);
        ladder_attention_row((enum block_dtype[]){ F16, Q3, 0 }, (uint32_t[]){ 20, 30 }, 16, 2, 4, 64,
                             MASK_ALL, 0, 0);
        ladder_attention_row((enum block_dtype[]){ F16, Q8, Q4, 0 }, (uint32_t[]){ 0, 20, 30 }, 16, 2, 4, 64,
                             MASK_NONE, 0, 0);
        ladder_attention_row((enum block_dtype[]){ F16, Q8, Q4, Q2, 0 }, (uint32_t[]){ 30, 0, 25, 5 }, 16, 2,
                             12, 128, MASK_SOME, 0, 0);
        ladder_attention_row((enum block_dtype[]){ BF16, Q3, 0 }, (uint32_t[]){ 0, 45 }, 16, 1, 2, 256,
                             MASK_NONE, 0, 0);
        ladder_attention_row((enum block_dtype[]){ F16, 0 }, (uint32_t[]){ 60 }, 16, 2, 4, 64, MASK_NONE, 40,
                             0);
        ladder_attention_row((enum block_dtype[]){ F16, Q8, Q4, 0 }, (uint32_t[]){ 30, 20, 40 }, 16, 2, 4, 64,
                             MASK_SOME, 0, 5);
        ladder_attention_row((enum block_dtype[]){ BF16, Q8, Q4, Q3, Q2 },
                             (uint32_t[]){ 200, 300, 200, 150, 150 }, 16, 2, 8, 128, MASK_SOME, 0, 0);

        ladder_compaction_row((enum block_dtype[]){ F16, Q8, Q4, Q3, Q2 }, (uint32_t[]){ 40, 35, 50, 17, 33 },
                              16, 2, 64, 5, LKEEP_RANDOM, 0, 1);
        ladder_compaction_row((enum block_dtype[]){ F16, Q8, Q4, Q3, Q2 }, (uint32_t[]){ 40, 35, 50, 17, 33 },
                              16, 2, 64, 5, LKEEP_RANDOM, 1, 2);
        ladder_compaction_row((enum block_dtype[]){ BF16, Q8, Q4, 0 }, (uint32_t[]){ 70, 40, 20 }, 32, 2, 128,
                              0, LKEEP_DROP_FIRST, 0, 1);
        ladder_compaction_row((enum block_dtype[]){ F32, Q4, Q2, 0 }, (uint32_t[]){ 50, 33, 16 }, 16, 1, 256,
                              3, LKEEP_DEMOTE, 0, 1);
        ladder_compaction_row((enum block_dtype[]){ F16, Q8, Q3, 0 }, (uint32_t[]){ 60, 0, 20 }, 16, 2, 64, 4,
                              LKEEP_DEMOTE, 1, 2);
        ladder_compaction_row((enum block_dtype[]){ F16, Q8, Q4, 0 }, (uint32_t[]){ 40, 30, 20 }, 16, 2, 64,
                              4, LKEEP_UNSORTED, 1, 1);
        ladder_compaction_row((enum block_dtype[]){ F16, Q8, Q4, 0 }, (uint32_t[]){ 40, 30, 20 }, 16, 2, 64,
                              4, LKEEP_PROMOTE, 0, 1);
        ladder_compaction_row((enum block_dtype[]){ F16, Q8, Q4, 0 }, (uint32_t[]){ 40, 30, 20 }, 16, 2, 64,
                              4, LKEEP_WRONG_N, 0, 1);

        compaction_row(F16, 16, 2, 64, 200, 0, 10, KEEP_DROP_EVERY_8TH, 0, 0);
        compaction_row(F16, 16, 2, 64, 200, 120, 10, KEEP_RANDOM, 1, 10);
        compaction_row(BF16, 32, 2, 128, 300, 100, 5, KEEP_SHIFT_BY_ONE, 0, 0);
        compaction_row(F32, 16, 1, 64, 150, 150, 0, KEEP_EVERY_OTHER, 0, 1000);
        compaction_row(F16, 16, 1, 256, 64, 30, 14, KEEP_NOTHING, 0, 0);
        compaction_row(F16, 16, 2, 128, 90, 50, 3, KEEP_DROP_EVERY_8TH, 1, 7);
        compaction_row(F16, 16, 2, 64, 100, 40, 4, KEEP_UNSORTED, 1, 0);
        compaction_row(F16, 16, 2, 64, 100, 40, 4, KEEP_DROP_EVERY_8TH, 0, -1);
        compaction_row(F16, 16, 2, 64, 100, 40, 4, KEEP_DROP_INT8_TAIL, 0, 0);
        compaction_row(BF16, 16, 2, 64, 100, 44, 4, KEEP_DROP_INT8_TAIL, 0, 2);
        /* many chunks at once: the read-done waits matter */
        compaction_row(F16, 16, 4, 64, 1200, 0, 16, KEEP_SHIFT_BY_ONE, 0, 0);
        compaction_row(F16, 16, 4, 64, 1200, 700, 16, KEEP_DROP_EVERY_8TH, 1, 60);
        advance_row(F16, 16, 2, 128, 100, 20, 70);
        advance_row(BF16, 16, 2, 64, 64, 0, 64);
        advance_row(F32, 32, 1, 64, 100, 64, 96);
}

static void table(void) {
        static const uint32_t dims[] = { 64, 128 };
        static const uint32_t lens[] = { 4096, 8192, 16384, 32768 };
        const uint32_t T = 16, H = 8, NH = 32, W = 256;
        float t_f16[2][4], t_q8[2][4], t_q4[2][4];
        double worst_compact = 1e9;

        printf("\n-- the table: %u KV heads, %u query heads, %u-token blocks, f16 window\n", H, NH, T);
        summary_row(64, 32000, 8, LOGITS_RANDOM);
        for (int di = 0; di < 2; di++) {
                for (int li = 0; li < 4; li++) {
                        uint32_t D = dims[di], n = lens[li];
                        t_f16[di][li] = attention_row(BLOCK_DTYPE_F16, T, H, NH, D, n, 0, MASK_NONE);
                        t_q8[di][li] = attention_row(BLOCK_DTYPE_F16, T, H, NH, D, n, n - W, MASK_NONE);
                        /* the ladder: all but the window at q4, and a mix of every tier */
                        t_q4[di][li] = ladder_attention_row(
                                (enum block_dtype[]){ BLOCK_DTYPE_F16, BLOCK_DTYPE_Q4, 0 },
                                (uint32_t[]){ W, n - W }, T, H, NH, D, MASK_NONE, 0, 0);
                        ladder_attention_row((enum block_dtype[]){ BLOCK_DTYPE_F16, BLOCK_DTYPE_Q8,
                                                                   BLOCK_DTYPE_Q4, BLOCK_DTYPE_Q3,
                                                                   BLOCK_DTYPE_Q2 },
                                             (uint32_t[]){ W, n / 4, n / 4, n / 4, n / 4 - W }, T, H, NH, D,
                                             MASK_NONE, 0, 0);
                        if (li % 2 == 0) /* demote a quarter of each tier by one, keep 3/4 */
                                ladder_compaction_row((enum block_dtype[]){ BLOCK_DTYPE_F16, BLOCK_DTYPE_Q8,
                                                                            BLOCK_DTYPE_Q4, 0 },
                                                      (uint32_t[]){ n / 2, n / 4, n / 4 }, T, H, D, 16,
                                                      LKEEP_RANDOM, 0, 1);
                        /* drop every 8th of the first n - 16 tokens: every slot moves */
                        worst_compact = fmin(worst_compact, compaction_row(BLOCK_DTYPE_F16, T, H, D, n, 0, 16,
                                                                           KEEP_DROP_EVERY_8TH, 0, 0));
                        /* the same with INT8 blocks requantized and half the window quantized */
                        compaction_row(BLOCK_DTYPE_F16, T, H, D, n, n - W, 16, KEEP_DROP_EVERY_8TH, 0,
                                       (int)W / 2);
                        advance_row(BLOCK_DTYPE_F16, T, H, D, n, n - 2 * W, n - W);
                }
        }
        printf("\nF16 time / INT8 time of decode attention over the same tokens:\n");
        int q8_ok = 1;
        for (int di = 0; di < 2; di++) {
                printf("  D=%-3u", dims[di]);
                for (int li = 0; li < 4; li++) {
                        double r = t_f16[di][li] / t_q8[di][li];
                        printf("   n=%-5u %.2fx", lens[li], r);
                        if (lens[li] >= 8192 && r <= 1.0)
                                q8_ok = 0;
                }
                printf("\n");
        }
        printf("F16 time / q4 ladder time (all but %u tokens at q4):\n", W);
        for (int di = 0; di < 2; di++) {
                printf("  D=%-3u", dims[di]);
                for (int li = 0; li < 4; li++)
                        printf("   n=%-5u %.2fx", lens[li], t_f16[di][li] / t_q4[di][li]);
                printf("\n");
        }
        printf("targets: f16 compaction >= 80%% of copy bandwidth: %s (worst %.0f%%); "
               "INT8 faster than F16 from 8K tokens: %s\n",
               worst_compact >= 0.8 ? "met" : "MISSED", 100 * worst_compact, q8_ok ? "met" : "MISSED");
}

int main(int argc, char **argv) {
        int quick = argc > 1 && !strcmp(argv[1], "--quick");
        if (argc > 2 || (argc == 2 && !quick)) {
                printf("usage: kvc-gpucheck [--quick]\n"
                       "  runs every CUDA kernel against its CPU reference and prints a table;\n"
                       "  --quick: only the matrix of small cases\n");
                return argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) ? 0 : 2;
        }
        int n_dev = 0;
        cudaError_t e = cudaGetDeviceCount(&n_dev);
        if (e != cudaSuccess || n_dev == 0 || kvc_cuda_device_count() == 0) {
                printf("kvc-gpucheck: no CUDA device found (%s); nothing to check\n",
                       e != cudaSuccess ? cudaGetErrorString(e) : "no device");
                return 0;
        }
        struct cudaDeviceProp prop;
        CK(cudaGetDeviceProperties(&prop, 0));
        CK(cudaSetDevice(0));
        CK(cudaStreamCreate(&stream));
        CK(cudaEventCreate(&ev0));
        CK(cudaEventCreate(&ev1));
        if (quick)
                runs = 3;
        printf("kvc-gpucheck: %s, %d SMs, %.1f GiB; times are medians of %d runs\n\n", prop.name,
               prop.multiProcessorCount, (double)prop.totalGlobalMem / (1u << 30), runs);
        printf("%-9s %-40s %11s %10s %9s %8s  %s\n", "kernel", "shape", "max rel err", "time (us)", "GB/s",
               "% copy", "check");
        matrix();
        if (!quick)
                table();
        printf("%s\n", failures ? "kvc-gpucheck: FAILED" : "kvc-gpucheck: all checks passed");
        CK(cudaEventDestroy(ev0));
        CK(cudaEventDestroy(ev1));
        CK(cudaStreamDestroy(stream));
        return failures ? 1 : 0;
}
