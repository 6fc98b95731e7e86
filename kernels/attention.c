/* attention.c: decode attention over a layer's cache on the CPU: the plain-loop reference
 * (attn_decode_ref) and the fast kernel libkvc's kvc_attend and kvc-run --local run
 * (attn_decode_fast, attn_decode_rows).
 *
 * The fast kernel. Decode attention at long context is a stream over the keys and values: for
 * SmolLM2 (9 query heads on 3 KV heads, head_dim 64) every token costs 3 x 2 rows of 64 elements
 * a layer. The reference reads each row once per query head (3 times), converts it to f32 with a
 * call per row, does two softmax passes and sums one lane at a time. The fast kernel, per KV head:
 *
 * - keeps the group's query heads together: each key row is loaded and converted once and dotted
 *   with all of them, each value row likewise accumulated into all of their outputs;
 * - goes once over the cache, one tile (a block's live slots; ATTN_ROWS_TILE rows of a contiguous
 *   cache) at a time, with the online softmax of mixed.c (m, l and the output rescaled by
 *   exp(m - m') when a tile raises the maximum): logits of a tile, their exponentials and the
 *   tile's values, while the tile is in L1;
 * - converts f16 (F16C), bf16 (a shift) and int8 (sign extension) in registers. An INT8 tile
 *   folds its per-channel key scales into the queries and its per-token value scales into the
 *   weights, as attn_decode_mixed does;
 * - for the score side arrays keeps each weight exp(s_j - m_tile) and each tile's maximum, so the
 *   final a_j = exp(s_j - m_tile) exp(m_tile - m) / l costs one exp a tile, not a second pass of
 *   exp over the logits.
 *
 * q / sqrt(head_dim) is formed once (exact for the power-of-two dims: 64 gives 1/8), so a logit
 * is q' . k + logw. AVX2 sums a dot in 8 lanes, then across them; the plain path one lane at a
 * time; neither is the reference's order, so all three differ by rounding (test_attn_fast bounds
 * it). A tile is processed the same way whatever holds it, so a contiguous f32 cache in tiles of
 * 16 and kvcd's f32 blocks of 16 give identical bits: kvc-run through kvcd with --policy full
 * prints --local's text by construction, as it did when both ran two-pass loops.
 *
 * The AVX2 path's exponentials are Cephes' expf polynomial on 8 lanes (Cephes states about 1e-7
 * relative error; test_attn_fast's comparison with the references covers it): with one libm
 * expf per logit and query head the kernel took 301 us instead of 263 at 1K f16 tokens
 * (bench-attn-long).
 *
 * Rejected: transposing keys for a rows-in-lanes dot (the block layout is kvcd's and shared with
 * compaction and the GPU; the horizontal sums cost less than a second layout).
 */
#include "attention.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "cpu.h"
#include "ladder.h"
#include "lloyd.h"
#include "mixed.h"
#include "tier.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ATTN_HAVE_AVX2 1
#else
#define ATTN_HAVE_AVX2 0
#endif

/* Two-pass softmax in place, exactly as llama2.c: max, exp(x - max) with a running sum, divide.
 * All -inf (every token masked) gives all zeros rather than NaN. */
static void softmax_inplace(float *x, uint32_t n) {
        float max = x[0];
        for (uint32_t i = 1; i < n; i++)
                if (x[i] > max)
                        max = x[i];
        if (isinf(max) && max < 0) {
                memset(x, 0, (size_t)n * sizeof(float));
                return;
        }
        float sum = 0.0f;
        for (uint32_t i = 0; i < n; i++) {
                x[i] = expf(x[i] - max);
                sum += x[i];
        }
        for (uint32_t i = 0; i < n; i++)
                x[i] /= sum;
}

int attn_decode_ref(const struct block_layer *L, const float *q, float *out, uint32_t n_heads,
                    float ema_gamma, int update_scores, float *scratch) {
        const struct block_layout *l = L->layout;
        uint32_t H = l->n_kv_heads, D = l->head_dim, T = l->block_tokens, n = L->n_tokens;
        float krow[ATTN_MAX_HEAD_DIM], vrow[ATTN_MAX_HEAD_DIM];

        if (n == 0 || n_heads == 0 || n_heads % H || D > ATTN_MAX_HEAD_DIM ||
            (uint64_t)n > (uint64_t)L->n_blocks * T)
                return -EINVAL;
        if (L->n_shared && (!L->shared_mask || (uint64_t)L->mask_stride * 8 < L->n_shared || L->n_shared > n))
                return -EINVAL;

        uint32_t group = n_heads / H;
        float *att = scratch, *acc = scratch + n;
        float scale = sqrtf((float)D);
        bool f32 = l->dtype == BLOCK_DTYPE_F32;

        for (uint32_t g = 0; g < H; g++) {
                if (update_scores)
                        memset(acc, 0, (size_t)n * sizeof(float));
                for (uint32_t r = 0; r < group; r++) {
                        uint32_t h = g * group + r;
                        const float *qh = q + (size_t)h * D;
                        float *oh = out + (size_t)h * D;

                        /* block by block, slot by slot: the same arithmetic, in the same order, as
                         * token by token; f32 rows are read where they lie */
                        for (uint32_t t0 = 0; t0 < n; t0 += T) {
                                uint8_t *b = L->blocks[t0 / T];
                                uint32_t cnt = n - t0 < T ? n - t0 : T;
                                for (uint32_t u = 0; u < cnt; u++) {
                                        const float *k = f32 ? (const float *)block_key(l, b, g, u) : krow;
                                        if (!f32)
                                                block_load_row(l->dtype, block_key(l, b, g, u), krow, D);
                                        float s = 0.0f;
                                        for (uint32_t i = 0; i < D; i++)
                                                s += qh[i] * k[i];
                                        s /= scale;
                                        s += *(const float *)block_side(l, b, l->logw_offset, g, u);
                                        att[t0 + u] = s;
                                }
                        }
                        for (uint32_t t = 0; t < L->n_shared;
                             t++) /* evicted by this session, kept for others */
                                if (L->shared_mask[(size_t)g * L->mask_stride + t / 8] >> (t % 8) & 1)
                                        att[t] = -INFINITY;
                        softmax_inplace(att, n);
                        memset(oh, 0, (size_t)D * sizeof(float));
                        for (uint32_t t0 = 0; t0 < n; t0 += T) {
                                uint8_t *b = L->blocks[t0 / T];
                                uint32_t cnt = n - t0 < T ? n - t0 : T;
                                for (uint32_t u = 0; u < cnt; u++) {
                                        float a = att[t0 + u];
                                        const float *v = f32 ? (const float *)block_value(l, b, g, u) : vrow;
                                        if (!f32)
                                                block_load_row(l->dtype, block_value(l, b, g, u), vrow, D);
                                        for (uint32_t i = 0; i < D; i++)
                                                oh[i] += a * v[i];
                                        if (update_scores)
                                                acc[t0 + u] += a;
                                }
                        }
                }
                if (!update_scores)
                        continue;
                for (uint32_t t = L->n_shared; t < n; t++) { /* shared slots are read-only */
                        uint8_t *b = L->blocks[t / T];
                        float a = acc[t] / (float)group;
                        float *sum = block_side(l, b, l->sum_offset, g, t % T);
                        float *ema = block_side(l, b, l->ema_offset, g, t % T);
                        float *last = block_side(l, b, l->last_offset, g, t % T);
                        *sum += a;
                        *ema = ema_gamma * *ema + (1.0f - ema_gamma) * a;
                        *last = a;
                }
        }
        return 0;
}

/* ---- the fast kernel ---- */

/* One tile: cnt consecutive tokens of one KV head, rows stride bytes apart. */
struct tile {
        const uint8_t *k, *v;
        size_t stride;
        enum block_dtype dtype;
        const float *kscale; /* BLOCK_DTYPE_Q8: [D] per channel */
        const float *krow;   /* the packed tiers (Q4, Q3, Q2): [cnt] per token */
        const float *vscale; /* the quantized tiers: [cnt] per token */
        uint64_t row_bytes;  /* of one key or value row */
        bool rotated;        /* rows in the layer's rotated basis (lloyd.h) */
        const float *logw;   /* [cnt], or NULL for none */
        uint32_t slot0, cnt; /* its first slot in the layer */
};

struct fast {
        uint32_t D, T, group, n_shared;
        const uint8_t *mask; /* KV head g's row of the shared-prefix bitmap */
        float *qs;           /* [group][D]: q / sqrt(D) */
        float *qk;           /* [group][D]: qs times a Q8 tile's key scales */
        float *qr;           /* [group][D]: qs rotated, for the rotated tiers */
        const float *signs;  /* KV head g's rotation, or NULL when the layer has no rotated token */
        bool acc_rotated;    /* acc holds the rotated tiles' sum, still in the rotated basis */
        float *acc;          /* [group][D] */
        float *s;            /* [group][T]: a tile's logits, then its weights */
        float *m, *l;        /* [group] */
        float *p;            /* [group][n]: exp(s_j - m_tile), or NULL (no scores) */
        float *tm;           /* [group][n_tiles]: each tile's m' */
        uint32_t n, n_tiles, tile_idx;
        bool avx2;
};

size_t attn_fast_scratch_floats(uint32_t n_tokens, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                uint32_t tile_tokens) {
        if (!n_kv_heads || !n_heads || n_heads % n_kv_heads || !tile_tokens || !head_dim)
                return 0;
        uint64_t group = n_heads / n_kv_heads,
                 tiles = (uint64_t)n_tokens / tile_tokens + 2 + LADDER_TIERS; /* a partial tile per tier */
        return (size_t)(group * ((uint64_t)n_tokens + tiles + 4ull * head_dim + tile_tokens + 2));
}

static inline __attribute__((always_inline)) float fast_logit(const struct fast *F, const struct tile *t,
                                                              uint32_t u, float dot) {
        uint32_t j = t->slot0 + u;
        float lw = t->logw ? t->logw[u] : 0.0f;
        if (j < F->n_shared && (F->mask[j / 8] >> (j % 8) & 1))
                return -INFINITY; /* evicted by this session, kept for the others */
        if (isinf(lw) && lw < 0)
                return -INFINITY;
        if (t->krow)
                dot *= t->krow[u];
        float s = dot + lw;
        return s < FLT_MAX ? s : FLT_MAX; /* +inf and NaN: the largest finite logit */
}

/* s[u] = exp(s[u] - m) for u < n, and their sum: the plain path's, with libm's expf. */
static inline __attribute__((always_inline)) float exp_span_plain(float *s, uint32_t n, float m) {
        float sum = 0.0f;
        for (uint32_t u = 0; u < n; u++) {
                s[u] = expf(s[u] - m);
                sum += s[u];
        }
        return sum;
}

/* The online softmax step of a tile, per query head: F->s's logits become weights exp(s - m')
 * (times the value scales of an INT8 tile), acc is rescaled by exp(m - m'), m and l move on, and
 * the score inputs are kept. exp_span is the path's exponential. */
static inline __attribute__((always_inline)) void fast_softmax(struct fast *F, const struct tile *t,
                                                               float (*exp_span)(float *, uint32_t, float)) {
        for (uint32_t r = 0; r < F->group; r++) {
                float *s = F->s + (size_t)r * F->T, *acc = F->acc + (size_t)r * F->D;
                float cmax = -INFINITY;
                for (uint32_t u = 0; u < t->cnt; u++)
                        cmax = s[u] > cmax ? s[u] : cmax;
                float m_new = cmax > F->m[r] ? cmax : F->m[r];
                if (F->p)
                        F->tm[(size_t)r * F->n_tiles + F->tile_idx] = m_new;
                if (isinf(m_new)) { /* everything so far masked */
                        for (uint32_t u = 0; u < t->cnt; u++)
                                s[u] = 0.0f;
                        if (F->p)
                                memset(F->p + (size_t)r * F->n + t->slot0, 0, t->cnt * sizeof(float));
                        continue;
                }
                float psum = exp_span(s, t->cnt, m_new);
                if (F->p)
                        memcpy(F->p + (size_t)r * F->n + t->slot0, s, t->cnt * sizeof(float));
                if (t->vscale)
                        for (uint32_t u = 0; u < t->cnt; u++)
                                s[u] *= t->vscale[u];
                if (m_new != F->m[r]) {
                        float alpha = expf(F->m[r] - m_new);
                        for (uint32_t c = 0; c < F->D; c++)
                                acc[c] *= alpha;
                        F->l[r] *= alpha;
                        F->m[r] = m_new;
                }
                F->l[r] += psum;
        }
}

/* Row u of a tile as floats (the plain path). */
static void fast_load(const struct tile *t, const uint8_t *row, float *dst, uint32_t D) {
        uint32_t bits = block_dtype_bits(t->dtype);
        if (t->dtype == BLOCK_DTYPE_Q8)
                for (uint32_t c = 0; c < D; c++)
                        dst[c] = (float)((const int8_t *)row)[c];
        else if (t->krow) /* a packed tier: the centroids, the scales come with the dot and the weight */
                lloyd_decode_row(row, 1.0f, D, bits, dst);
        else
                block_load_row(t->dtype, row, dst, D);
}

static void fast_tile_plain(struct fast *F, const struct tile *t, const float *q) {
        uint32_t D = F->D;
        float row[ATTN_MAX_HEAD_DIM];
        for (uint32_t u = 0; u < t->cnt; u++) {
                fast_load(t, t->k + u * t->stride, row, D);
                for (uint32_t r = 0; r < F->group; r++) {
                        const float *qr = q + (size_t)r * D;
                        float dot = 0.0f;
                        for (uint32_t c = 0; c < D; c++)
                                dot += qr[c] * row[c];
                        F->s[(size_t)r * F->T + u] = fast_logit(F, t, u, dot);
                }
        }
        fast_softmax(F, t, exp_span_plain);
        for (uint32_t u = 0; u < t->cnt; u++) {
                fast_load(t, t->v + u * t->stride, row, D);
                for (uint32_t r = 0; r < F->group; r++) {
                        float w = F->s[(size_t)r * F->T + u], *acc = F->acc + (size_t)r * D;
                        if (w != 0.0f) /* masked or underflowed: adds exact zeros */
                                for (uint32_t c = 0; c < D; c++)
                                        acc[c] += w * row[c];
                }
        }
}

#if ATTN_HAVE_AVX2
#define ATTN_AVX2 __attribute__((target("avx2,f16c")))

/* The centroids of codes [c, c + 8) of a packed row (c a multiple of 8: b whole bytes): the 8
 * codes shifted into lanes, then looked up in the codebook held in one register (two for 4 bits,
 * chosen by the code's top bit). Reads 4 bytes from the group's first: past the row for 2 and 3
 * bits, still inside the block (the scales and side arrays follow the codes). */
ATTN_AVX2 static inline __attribute__((always_inline)) __m256 fast_codes8(enum block_dtype dt,
                                                                          const uint8_t *row, uint32_t c) {
        const uint32_t bits = dt == BLOCK_DTYPE_Q4 ? 4 : dt == BLOCK_DTYPE_Q3 ? 3 : 2;
        uint32_t w;
        memcpy(&w, row + c / 8 * bits, 4);
        const float *cb = lloyd_codebook(bits);
        const __m256i shifts = _mm256_setr_epi32(0, (int)bits, 2 * (int)bits, 3 * (int)bits, 4 * (int)bits,
                                                 5 * (int)bits, 6 * (int)bits, 7 * (int)bits);
        __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts),
                                       _mm256_set1_epi32((1 << bits) - 1));
        __m256 lo = _mm256_permutevar8x32_ps(_mm256_load_ps(cb), idx);
        if (bits < 4)
                return lo;
        __m256 hi = _mm256_permutevar8x32_ps(_mm256_load_ps(cb + 8), idx);
        return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

ATTN_AVX2 static inline __attribute__((always_inline)) __m256 fast_load8(enum block_dtype dt,
                                                                         const uint8_t *row, uint32_t c) {
        switch (dt) {
        case BLOCK_DTYPE_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * c)));
        case BLOCK_DTYPE_BF16:
                return _mm256_castsi256_ps(_mm256_slli_epi32(
                        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * c))), 16));
        case BLOCK_DTYPE_Q8:
                return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c))));
        case BLOCK_DTYPE_Q4:
        case BLOCK_DTYPE_Q3:
        case BLOCK_DTYPE_Q2: return fast_codes8(dt, row, c);
        default: return _mm256_loadu_ps((const float *)(row + 4 * c));
        }
}

ATTN_AVX2 static inline __attribute__((always_inline)) float fast_hsum(__m256 v) {
        __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        x = _mm_add_ss(x, _mm_movehdup_ps(x));
        return _mm_cvtss_f32(x);
}

/* exp(x) for 8 lanes, x <= 0 or -inf (a logit minus the running maximum): Cephes' expf (range
 * reduction by ln 2 in two parts, a degree-5 polynomial, the exponent added to the bits); below
 * -87.3 (where expf is subnormal or 0) it gives 0, and -inf exactly 0. */
ATTN_AVX2 static inline __attribute__((always_inline)) __m256 fast_exp8(__m256 x) {
        const __m256 lo = _mm256_set1_ps(-87.3f);
        __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ); /* -inf included */
        x = _mm256_max_ps(x, lo);
        __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
        x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
        __m256 y = _mm256_set1_ps(1.9875691500e-4f);
        y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
        y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
        y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
        y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
        y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
        y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, x), x), x), _mm256_set1_ps(1.0f));
        __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
        y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
        return _mm256_andnot_ps(under, y);
}

/* exp_span_plain's contract, 8 lanes at a time (the tail through libm's expf). */
ATTN_AVX2 static inline __attribute__((always_inline)) float exp_span_avx2(float *s, uint32_t n, float m) {
        __m256 vm = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
        uint32_t u = 0;
        for (; u + 8 <= n; u += 8) {
                __m256 p = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + u), vm));
                _mm256_storeu_ps(s + u, p);
                acc = _mm256_add_ps(acc, p);
        }
        float sum = fast_hsum(acc);
        for (; u < n; u++) {
                s[u] = expf(s[u] - m);
                sum += s[u];
        }
        return sum;
}

/* Query heads [r0, r0 + NR) (NR 1 or 3) of a tile: logits, two rows at a time (2 NR independent
 * accumulators in registers, each query slice loaded once for both rows), then, after the
 * softmax, the weighted values: an 8-column slice of the NR outputs in registers across the
 * tile's rows. A row whose NR weights are all zero (masked, or underflowed) is skipped: it would
 * add exact zeros. */
ATTN_AVX2 static inline __attribute__((always_inline)) void
fast_dots_avx2(struct fast *F, const struct tile *t, const float *q, uint32_t r0, const int NR,
               enum block_dtype dt) {
        uint32_t D = F->D, u = 0;
        const float *q0 = q + (size_t)r0 * D, *q1 = q0 + D, *q2 = q1 + D;
        float *s0 = F->s + (size_t)r0 * F->T, *s1 = s0 + F->T, *s2 = s1 + F->T;
        for (; u + 2 <= t->cnt; u += 2) {
                const uint8_t *ka = t->k + u * t->stride, *kb = ka + t->stride;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0;
                for (uint32_t c = 0; c < D; c += 8) {
                        __m256 x = fast_load8(dt, ka, c), y = fast_load8(dt, kb, c),
                               w = _mm256_loadu_ps(q0 + c);
                        a0 = _mm256_add_ps(a0, _mm256_mul_ps(w, x));
                        b0 = _mm256_add_ps(b0, _mm256_mul_ps(w, y));
                        if (NR == 3) {
                                w = _mm256_loadu_ps(q1 + c);
                                a1 = _mm256_add_ps(a1, _mm256_mul_ps(w, x));
                                b1 = _mm256_add_ps(b1, _mm256_mul_ps(w, y));
                                w = _mm256_loadu_ps(q2 + c);
                                a2 = _mm256_add_ps(a2, _mm256_mul_ps(w, x));
                                b2 = _mm256_add_ps(b2, _mm256_mul_ps(w, y));
                        }
                }
                s0[u] = fast_logit(F, t, u, fast_hsum(a0));
                s0[u + 1] = fast_logit(F, t, u + 1, fast_hsum(b0));
                if (NR == 3) {
                        s1[u] = fast_logit(F, t, u, fast_hsum(a1));
                        s1[u + 1] = fast_logit(F, t, u + 1, fast_hsum(b1));
                        s2[u] = fast_logit(F, t, u, fast_hsum(a2));
                        s2[u + 1] = fast_logit(F, t, u + 1, fast_hsum(b2));
                }
        }
        for (; u < t->cnt; u++) {
                const uint8_t *ka = t->k + u * t->stride;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0;
                for (uint32_t c = 0; c < D; c += 8) {
                        __m256 x = fast_load8(dt, ka, c);
                        a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(q0 + c), x));
                        if (NR == 3) {
                                a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(q1 + c), x));
                                a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_loadu_ps(q2 + c), x));
                        }
                }
                s0[u] = fast_logit(F, t, u, fast_hsum(a0));
                if (NR == 3) {
                        s1[u] = fast_logit(F, t, u, fast_hsum(a1));
                        s2[u] = fast_logit(F, t, u, fast_hsum(a2));
                }
        }
}

ATTN_AVX2 static inline __attribute__((always_inline)) void
fast_values_avx2(struct fast *F, const struct tile *t, uint32_t r0, const int NR, enum block_dtype dt) {
        uint32_t D = F->D;
        const float *w0 = F->s + (size_t)r0 * F->T, *w1 = w0 + F->T, *w2 = w1 + F->T;
        float *o0 = F->acc + (size_t)r0 * D, *o1 = o0 + D, *o2 = o1 + D;
        for (uint32_t c = 0; c < D; c += 8) {
                __m256 a0 = _mm256_loadu_ps(o0 + c), a1 = a0, a2 = a0;
                if (NR == 3) {
                        a1 = _mm256_loadu_ps(o1 + c);
                        a2 = _mm256_loadu_ps(o2 + c);
                }
                for (uint32_t u = 0; u < t->cnt; u++) {
                        if (w0[u] == 0.0f && (NR == 1 || (w1[u] == 0.0f && w2[u] == 0.0f)))
                                continue;
                        __m256 v = fast_load8(dt, t->v + u * t->stride, c);
                        a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_set1_ps(w0[u]), v));
                        if (NR == 3) {
                                a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_set1_ps(w1[u]), v));
                                a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_set1_ps(w2[u]), v));
                        }
                }
                _mm256_storeu_ps(o0 + c, a0);
                if (NR == 3) {
                        _mm256_storeu_ps(o1 + c, a1);
                        _mm256_storeu_ps(o2 + c, a2);
                }
        }
}

ATTN_AVX2 static inline __attribute__((always_inline)) void
fast_tile_avx2_dt(struct fast *F, const struct tile *t, const float *q, enum block_dtype dt) {
        uint32_t r = 0;
        for (; r + 3 <= F->group; r += 3)
                fast_dots_avx2(F, t, q, r, 3, dt);
        for (; r < F->group; r++)
                fast_dots_avx2(F, t, q, r, 1, dt);
        fast_softmax(F, t, exp_span_avx2);
        for (r = 0; r + 3 <= F->group; r += 3)
                fast_values_avx2(F, t, r, 3, dt);
        for (; r < F->group; r++)
                fast_values_avx2(F, t, r, 1, dt);
}

ATTN_AVX2 static void fast_tile_avx2(struct fast *F, const struct tile *t, const float *q) {
        switch (t->dtype) { /* one copy of the loops per dtype: the conversion is a constant in each */
        case BLOCK_DTYPE_F16: fast_tile_avx2_dt(F, t, q, BLOCK_DTYPE_F16); break;
        case BLOCK_DTYPE_BF16: fast_tile_avx2_dt(F, t, q, BLOCK_DTYPE_BF16); break;
        case BLOCK_DTYPE_Q8: fast_tile_avx2_dt(F, t, q, BLOCK_DTYPE_Q8); break;
        case BLOCK_DTYPE_Q4: fast_tile_avx2_dt(F, t, q, BLOCK_DTYPE_Q4); break;
        case BLOCK_DTYPE_Q3: fast_tile_avx2_dt(F, t, q, BLOCK_DTYPE_Q3); break;
        case BLOCK_DTYPE_Q2: fast_tile_avx2_dt(F, t, q, BLOCK_DTYPE_Q2); break;
        default: fast_tile_avx2_dt(F, t, q, BLOCK_DTYPE_F32); break;
        }
}

static bool fast_cpu_has_avx2(void) {
        return cpu_has_avx2_f16c(); /* detected once, at start (cpu.c) */
}
#else
static void fast_tile_avx2(struct fast *F, const struct tile *t, const float *q) {
        fast_tile_plain(F, t, q);
}

static bool fast_cpu_has_avx2(void) {
        return false;
}
#endif

/* Asks for the cache lines of tile t's key and value rows (the next tile, while this one is
 * computed): a tile's rows are contiguous within a block, but blocks are not, and a layer's cache
 * at long context is far larger than the CPU's caches. */
static void fast_prefetch(const struct tile *t) {
        size_t row = t->row_bytes;
        for (uint32_t u = 0; u < t->cnt; u++)
                for (size_t o = 0; o < row; o += 64) {
                        __builtin_prefetch(t->k + u * t->stride + o);
                        __builtin_prefetch(t->v + u * t->stride + o);
                }
}

/* acc back from the rotated basis: R^T is linear, so the sum of the rotated tiles (rescaled as
 * the softmax went) can be rotated once, however many tiles made it. */
static void fast_unrotate_acc(struct fast *F) {
        for (uint32_t r = 0; r < F->group; r++)
                lloyd_unrotate(F->signs, F->acc + (size_t)r * F->D, F->D);
        F->acc_rotated = false;
}

static void fast_tile(struct fast *F, const struct tile *t) {
        const float *q = F->qs;
        if (t->rotated) { /* the rotated tiers come first in a layer: acc has only their tiles */
                F->acc_rotated = true;
                q = F->qr;
        } else if (F->acc_rotated) {
                fast_unrotate_acc(F);
        }
        if (t->kscale) {
                for (uint32_t r = 0; r < F->group; r++)
                        for (uint32_t c = 0; c < F->D; c++)
                                F->qk[(size_t)r * F->D + c] = F->qs[(size_t)r * F->D + c] * t->kscale[c];
                q = F->qk;
        }
        if (F->avx2)
                fast_tile_avx2(F, t, q);
        else
                fast_tile_plain(F, t, q);
        F->tile_idx++;
}

/* Sets up F for n tokens in tiles of up to T over the scratch; -ENOTSUP / -EINVAL. */
static int fast_init(struct fast *F, uint32_t n, uint32_t n_heads, uint32_t H, uint32_t D, uint32_t T,
                     bool scores, float *scratch, enum attn_isa isa) {
        if (n == 0 || n_heads == 0 || !H || n_heads % H || D == 0 || D > ATTN_MAX_HEAD_DIM || !T || !scratch)
                return -EINVAL;
        bool can = fast_cpu_has_avx2() && D % 8 == 0;
        if (isa == ATTN_ISA_AVX2 && !can)
                return -ENOTSUP;
        *F = (struct fast){
                .D = D, .T = T, .group = n_heads / H, .n = n, .n_tiles = n / T + 2 + LADDER_TIERS
        };
        F->avx2 = isa != ATTN_ISA_PLAIN && can;
        uint32_t G = F->group;
        F->qs = scratch;
        F->qk = F->qs + (size_t)G * D;
        F->qr = F->qk + (size_t)G * D;
        F->acc = F->qr + (size_t)G * D;
        F->s = F->acc + (size_t)G * D;
        F->m = F->s + (size_t)G * T;
        F->l = F->m + G;
        F->p = scores ? F->l + G : NULL;
        F->tm = scores ? F->p + (size_t)G * n : NULL;
        return 0;
}

/* Starts KV head g: scaled queries (rotated too, by signs, for a layer with rotated tokens),
 * empty accumulators. */
static void fast_head_begin(struct fast *F, const float *q, uint32_t g, const float *signs) {
        float inv = 1.0f / sqrtf((float)F->D);
        for (uint32_t i = 0; i < F->group * F->D; i++)
                F->qs[i] = q[(size_t)g * F->group * F->D + i] * inv;
        F->signs = signs;
        F->acc_rotated = false;
        if (signs)
                for (uint32_t r = 0; r < F->group; r++) {
                        memcpy(F->qr + (size_t)r * F->D, F->qs + (size_t)r * F->D, F->D * sizeof(float));
                        lloyd_rotate(signs, F->qr + (size_t)r * F->D, F->D);
                }
        memset(F->acc, 0, (size_t)F->group * F->D * sizeof(float));
        for (uint32_t r = 0; r < F->group; r++) {
                F->m[r] = -INFINITY;
                F->l[r] = 0.0f;
        }
        F->tile_idx = 0;
}

static void fast_head_end(struct fast *F, float *out, uint32_t g) {
        if (F->acc_rotated)
                fast_unrotate_acc(F);
        for (uint32_t r = 0; r < F->group; r++) {
                float *oh = out + ((size_t)g * F->group + r) * F->D, *acc = F->acc + (size_t)r * F->D;
                float l = F->l[r];
                for (uint32_t c = 0; c < F->D; c++)
                        oh[c] = l > 0.0f ? acc[c] / l : 0.0f;
        }
}

static struct tile fast_block_tile(const struct block_layout *l, uint8_t *b, uint32_t g, uint32_t slot0,
                                   uint32_t cnt) {
        bool q8 = l->dtype == BLOCK_DTYPE_Q8, packed = block_dtype_quantized(l->dtype) && !q8;
        return (struct tile){ .k = block_key(l, b, g, 0),
                              .v = block_value(l, b, g, 0),
                              .stride = l->row_bytes,
                              .row_bytes = l->row_bytes,
                              .dtype = l->dtype,
                              .rotated = packed,
                              .kscale = q8 ? block_kscale(l, b, g) : NULL,
                              .krow = packed ? block_kscale_row(l, b, g, 0) : NULL,
                              .vscale = q8 || packed ? block_vscale(l, b, g, 0) : NULL,
                              .logw = block_side(l, b, l->logw_offset, g, 0),
                              .slot0 = slot0,
                              .cnt = cnt };
}

/* Where the tiles of a layer come from: the tiers of a ladder (L; mixed layers are ladders of
 * {fp, q8}) or a contiguous f32 cache (keys, values; no log-weights, no scores). */
struct rows_src {
        const struct ladder_layer *L;
        const float *keys, *values;
        size_t row_stride;            /* floats between tokens of the contiguous cache */
        uint32_t H, D, T, n, n_lower; /* n_lower: the tokens below tier 0 */
        bool rotated;                 /* the layer holds rotated tokens */
};

/* The tile at slot j of KV head g: a block's worth of tokens of one tier. */
static struct tile rows_tile(const struct rows_src *src, uint32_t g, uint32_t j) {
        if (!src->L) {
                size_t off = (size_t)j * src->row_stride + (size_t)g * src->D;
                uint32_t cnt = src->n - j < src->T ? src->n - j : src->T;
                return (struct tile){ .k = (const uint8_t *)(src->keys + off),
                                      .v = (const uint8_t *)(src->values + off),
                                      .stride = src->row_stride * sizeof(float),
                                      .row_bytes = (uint64_t)src->D * sizeof(float),
                                      .dtype = BLOCK_DTYPE_F32,
                                      .slot0 = j,
                                      .cnt = cnt };
        }
        const struct ladder_layer *L = src->L;
        uint32_t t, idx;
        ladder_locate(L, j, &t, &idx);
        uint32_t len = L->n[t] - idx, cnt = len < src->T ? len : src->T;
        return fast_block_tile(L->layout[t], L->blocks[t][idx / src->T], g, j, cnt);
}

/* The score update of KV head g after F's row: a_j = exp(s_j - m_tile) exp(m_tile - m) / l,
 * averaged over the group, tile by tile in the order the row was computed; shared slots left
 * alone. F->s holds each tile's coefficients. */
static void fast_scores(struct fast *F, const struct ladder_layer *L, uint32_t g, float ema_gamma) {
        uint32_t T = L->layout[0]->block_tokens, n = F->n, tile = 0, base = 0;
        for (uint32_t tier = L->n_tiers; tier-- > 0; base += L->n[tier]) {
                const struct block_layout *l = L->layout[tier];
                uint32_t len = L->n[tier];
                if (base + len > n)
                        len = n > base ? n - base : 0; /* a prompt row's layer ends early (in tier 0) */
                for (uint32_t j0 = 0; j0 < len; j0 += T, tile++) {
                        uint8_t *b = L->blocks[tier][j0 / T];
                        uint32_t cnt = len - j0 < T ? len - j0 : T;
                        for (uint32_t rr = 0; rr < F->group; rr++) {
                                float tmax = F->tm[(size_t)rr * F->n_tiles + tile];
                                F->s[rr] = F->l[rr] > 0.0f && !isinf(tmax)
                                                   ? expf(tmax - F->m[rr]) / F->l[rr] / (float)F->group
                                                   : 0.0f;
                        }
                        for (uint32_t u = 0; u < cnt; u++) {
                                uint32_t j = base + j0 + u;
                                if (j < L->n_shared)
                                        continue;
                                float a = 0.0f;
                                for (uint32_t rr = 0; rr < F->group; rr++)
                                        a += F->p[(size_t)rr * n + j] * F->s[rr];
                                float *sum = block_side(l, b, l->sum_offset, g, u);
                                float *ema = block_side(l, b, l->ema_offset, g, u);
                                float *last = block_side(l, b, l->last_offset, g, u);
                                *sum += a;
                                *ema = ema_gamma * *ema + (1.0f - ema_gamma) * a;
                                *last = a;
                        }
                }
        }
}

/* The fast kernel for n_rows query rows over src's n tokens: row r (queries q + r * n_heads * D,
 * output likewise) over slots [0, n - n_rows + r + 1), computed as a layer of that many tokens
 * alone would be, so a row's result does not depend on the other rows; up to ATTN_ROWS_GROUP rows
 * at a time share each read of a tile (one state per row, rows_floats of scratch each), and their
 * scores are updated row after row. */
static int fast_rows(const struct rows_src *src, uint32_t n_rows, const float *q, float *out,
                     uint32_t n_heads, float ema_gamma, int update_scores, float *scratch, size_t rows_floats,
                     enum attn_isa isa) {
        const struct ladder_layer *M = src->L;
        uint32_t H = src->H, D = src->D, n = src->n;
        if (!q || !out || !scratch || n_rows == 0 || n_rows > n || src->n_lower > n - n_rows + 1)
                return -EINVAL;
        size_t stride = (size_t)n_heads * D;
        struct fast F[ATTN_ROWS_GROUP];
        for (uint32_t r0 = 0; r0 < n_rows; r0 += ATTN_ROWS_GROUP) {
                uint32_t rows = n_rows - r0 < ATTN_ROWS_GROUP ? n_rows - r0 : ATTN_ROWS_GROUP;
                for (uint32_t i = 0; i < rows; i++) {
                        int r = fast_init(&F[i], n - n_rows + r0 + i + 1, n_heads, H, D, src->T,
                                          update_scores && M, scratch + i * rows_floats, isa);
                        if (r < 0)
                                return r;
                        F[i].n_shared = M ? M->n_shared : 0;
                }
                uint32_t last = F[rows - 1].n; /* the longest row's tokens */
                for (uint32_t g = 0; g < H; g++) {
                        for (uint32_t i = 0; i < rows; i++) {
                                F[i].mask =
                                        F[i].n_shared ? M->shared_mask + (size_t)g * M->mask_stride : NULL;
                                fast_head_begin(&F[i], q + (r0 + i) * stride, g,
                                                src->rotated ? M->signs + (size_t)g * D : NULL);
                        }
                        /* a tile is computed for every row while the next tile's rows are fetched */
                        struct tile t = rows_tile(src, g, 0);
                        for (uint32_t j = 0;;) {
                                uint32_t end = j + t.cnt;
                                struct tile next = end < last ? rows_tile(src, g, end) : t;
                                if (end < last)
                                        fast_prefetch(&next);
                                for (uint32_t i = 0; i < rows; i++) {
                                        if (F[i].n <= j)
                                                continue;
                                        struct tile ti = t; /* the row's layer ends at F[i].n */
                                        ti.cnt = F[i].n - j < t.cnt ? F[i].n - j : t.cnt;
                                        fast_tile(&F[i], &ti);
                                }
                                if (end >= last)
                                        break;
                                j = end;
                                t = next;
                        }
                        for (uint32_t i = 0; i < rows; i++) {
                                fast_head_end(&F[i], out + (r0 + i) * stride, g);
                                if (update_scores && M)
                                        fast_scores(&F[i], M, g, ema_gamma);
                        }
                }
        }
        return 0;
}

static struct rows_src rows_src_blocks(const struct ladder_layer *L) {
        struct rows_src src = { .L = L,
                                .H = L->layout[0]->n_kv_heads,
                                .D = L->layout[0]->head_dim,
                                .T = L->layout[0]->block_tokens,
                                .n = ladder_tokens(L) };
        src.n_lower = src.n - L->n[0];
        for (uint32_t t = 1; t < L->n_tiers; t++)
                src.rotated |= L->n[t] && tier_row(L->layout[t]->dtype)->rotated;
        return src;
}

/* A mixed layer as the ladder of its two tiers (tier 1 only when it has a Q8 layout). */
static struct ladder_layer mixed_as_ladder(const struct mixed_layer *M) {
        struct ladder_layer L = { .n_tiers = M->q8 ? 2 : 1,
                                  .layout = { M->fp, M->q8 },
                                  .blocks = { M->fp_blocks, M->q8_blocks },
                                  .n_blocks = { M->n_fp_blocks, M->n_q8_blocks },
                                  .n = { M->n_tokens - M->n_q8, M->n_q8 },
                                  .n_shared = M->n_shared,
                                  .shared_mask = M->shared_mask,
                                  .mask_stride = M->mask_stride };
        return L;
}

/* A plain layer as a mixed one without INT8 tokens; -EINVAL for a layer the kernel cannot read. */
static int plain_as_mixed(const struct block_layer *L, struct mixed_layer *M) {
        if (!L || !L->layout || L->layout->dtype == BLOCK_DTYPE_Q8 || !block_dtype_bytes(L->layout->dtype) ||
            (uint64_t)L->n_tokens > (uint64_t)L->n_blocks * L->layout->block_tokens ||
            (L->n_blocks && !L->blocks))
                return -EINVAL;
        if (L->n_shared &&
            (!L->shared_mask || (uint64_t)L->mask_stride * 8 < L->n_shared || L->n_shared > L->n_tokens))
                return -EINVAL;
        *M = (struct mixed_layer){ .fp = L->layout,
                                   .fp_blocks = L->blocks,
                                   .n_fp_blocks = L->n_blocks,
                                   .n_tokens = L->n_tokens,
                                   .n_shared = L->n_shared,
                                   .shared_mask = L->shared_mask,
                                   .mask_stride = L->mask_stride };
        return 0;
}

static int rows_over(const struct ladder_layer *L, uint32_t n_rows, const float *q, float *out,
                     uint32_t n_heads, float ema_gamma, int update_scores, float *scratch,
                     enum attn_isa isa) {
        struct rows_src src = rows_src_blocks(L);
        if (src.n == 0)
                return -EINVAL;
        size_t per = attn_fast_scratch_floats(src.n, n_heads, src.H, src.D, src.T);
        if (!per)
                return -EINVAL;
        return fast_rows(&src, n_rows, q, out, n_heads, ema_gamma, update_scores, scratch, per, isa);
}

size_t attn_rows_scratch_floats(uint32_t n_tokens, uint32_t n_rows, uint32_t n_heads, uint32_t n_kv_heads,
                                uint32_t head_dim, uint32_t tile_tokens) {
        uint32_t group = n_rows < ATTN_ROWS_GROUP ? n_rows : ATTN_ROWS_GROUP;
        return group * attn_fast_scratch_floats(n_tokens, n_heads, n_kv_heads, head_dim, tile_tokens);
}

int attn_decode_fast(const struct block_layer *L, const float *q, float *out, uint32_t n_heads,
                     float ema_gamma, int update_scores, float *scratch, enum attn_isa isa) {
        return attn_prefill_fast(L, 1, q, out, n_heads, ema_gamma, update_scores, scratch, isa);
}

int attn_decode_fast_mixed(const struct mixed_layer *M, const float *q, float *out, uint32_t n_heads,
                           float ema_gamma, int update_scores, float *scratch, enum attn_isa isa) {
        return attn_prefill_fast_mixed(M, 1, q, out, n_heads, ema_gamma, update_scores, scratch, isa);
}

int attn_prefill_fast(const struct block_layer *L, uint32_t n_rows, const float *q, float *out,
                      uint32_t n_heads, float ema_gamma, int update_scores, float *scratch,
                      enum attn_isa isa) {
        struct mixed_layer M;
        int r = plain_as_mixed(L, &M);
        if (r < 0)
                return r;
        struct ladder_layer ld = mixed_as_ladder(&M);
        return rows_over(&ld, n_rows, q, out, n_heads, ema_gamma, update_scores, scratch, isa);
}

int attn_prefill_fast_mixed(const struct mixed_layer *M, uint32_t n_rows, const float *q, float *out,
                            uint32_t n_heads, float ema_gamma, int update_scores, float *scratch,
                            enum attn_isa isa) {
        if (!M || mixed_layer_check(M) < 0)
                return -EINVAL;
        struct ladder_layer ld = mixed_as_ladder(M);
        return rows_over(&ld, n_rows, q, out, n_heads, ema_gamma, update_scores, scratch, isa);
}

int attn_prefill_fast_ladder(const struct ladder_layer *L, uint32_t n_rows, const float *q, float *out,
                             uint32_t n_heads, float ema_gamma, int update_scores, float *scratch,
                             enum attn_isa isa) {
        if (ladder_check(L) < 0 || n_rows > L->n[0])
                return -EINVAL;
        return rows_over(L, n_rows, q, out, n_heads, ema_gamma, update_scores, scratch, isa);
}

int attn_decode_fast_ladder(const struct ladder_layer *L, const float *q, float *out, uint32_t n_heads,
                            float ema_gamma, int update_scores, float *scratch, enum attn_isa isa) {
        return attn_prefill_fast_ladder(L, 1, q, out, n_heads, ema_gamma, update_scores, scratch, isa);
}

int attn_decode_rows(const float *keys, const float *values, size_t row_stride, uint32_t n_tokens,
                     const float *q, float *out, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                     float *scratch, enum attn_isa isa) {
        return attn_prefill_rows(keys, values, row_stride, n_tokens, 1, q, out, n_heads, n_kv_heads, head_dim,
                                 scratch, isa);
}

int attn_prefill_rows(const float *keys, const float *values, size_t row_stride, uint32_t n_tokens,
                      uint32_t n_rows, const float *q, float *out, uint32_t n_heads, uint32_t n_kv_heads,
                      uint32_t head_dim, float *scratch, enum attn_isa isa) {
        if (!keys || !values || row_stride < (size_t)n_kv_heads * head_dim || n_tokens == 0)
                return -EINVAL;
        size_t per = attn_fast_scratch_floats(n_tokens, n_heads, n_kv_heads, head_dim, ATTN_ROWS_TILE);
        if (!per)
                return -EINVAL;
        struct rows_src src = { .keys = keys,
                                .values = values,
                                .row_stride = row_stride,
                                .H = n_kv_heads,
                                .D = head_dim,
                                .T = ATTN_ROWS_TILE,
                                .n = n_tokens };
        return fast_rows(&src, n_rows, q, out, n_heads, 0.0f, 0, scratch, per, isa);
}
