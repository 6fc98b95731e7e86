/* matmul.c - the matrix-vectors product of matmul.h: the exact path over qtype.h's rows, and the
 * fast path's activation quantization and integer kernels, plain C and AVX2.
 *
 * Loop order: row, then a chunk of vectors, then the row's blocks, then the chunk's vectors. A
 * weight block is decoded once and meets every vector of the chunk while it is in registers; a
 * row (360 bytes for 576 q4_1 columns) stays in L1 across chunks.
 *
 * Why the fast kernels agree bit for bit across implementations: a weight block and an
 * activation block give an exact int32 sum (at most 32 * 128 * 127 in magnitude), whatever order
 * the lanes add it in; only then does f32 arithmetic start, in block_term, which every
 * implementation inlines (no FMA: the build has -ffp-contract=off and the AVX2 functions do not
 * enable "fma"). The AVX2 kernels therefore reduce each block's int32 vector to a scalar (eight
 * blocks at a time) before the f32 step, instead of keeping f32 vector lanes across blocks as
 * llama.cpp does; that keeps one scalar f32 chain per row and vector, and buys a plain-C reference
 * that is exact, not within a tolerance.
 *
 * AVX2 is compiled with function target attributes, not -mavx2 for the file, so the rest of the
 * file (and the plain path) stay baseline x86-64; matmul_isa_supported asks the CPU at run time.
 */
#include "matmul.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MATMUL_HAVE_AVX2 1
#else
#define MATMUL_HAVE_AVX2 0
#endif

size_t matmul_q8_count(uint32_t cols, uint32_t n_x) {
        return (size_t)(cols / MATMUL_BLOCK) * n_x;
}

int matmul_quantize(const float *x, size_t x_stride, uint32_t n_x, uint32_t cols, struct matmul_q8 *ret) {
        uint32_t nb = cols / MATMUL_BLOCK;

        if (cols % MATMUL_BLOCK || x_stride < cols)
                return -EINVAL;
        for (uint32_t b = 0; b < n_x; b++) {
                for (uint32_t k = 0; k < nb; k++) {
                        const float *xs = x + b * x_stride + (size_t)k * MATMUL_BLOCK;
                        struct matmul_q8 *o = &ret[(size_t)b * nb + k];
                        float amax = 0.0f;
                        for (int j = 0; j < MATMUL_BLOCK; j++)
                                amax = fabsf(xs[j]) > amax ? fabsf(xs[j]) : amax;
                        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
                        int32_t sum = 0;
                        for (int j = 0; j < MATMUL_BLOCK; j++) {
                                /* fmaxf/fminf return the other operand for a NaN */
                                float q = fminf(fmaxf(roundf(xs[j] * id), -127.0f), 127.0f);
                                o->q[j] = (int8_t)q;
                                sum += o->q[j];
                        }
                        o->d = d;
                        o->sum = sum;
                }
        }
        return 0;
}

/* The fast path's weight kinds: how a block decodes to 32 integer codes and how its int32 sum
 * becomes f32. */
enum kind {
        KIND_Q8_0, /* f16 d, int8 q: w = d q */
        KIND_Q4_0, /* f16 d, nibbles q: w = d (q - 8) */
        KIND_Q4_1, /* f16 d, f16 m, nibbles q: w = d q + m */
};

static uint16_t load_u16(const uint8_t *p) {
        uint16_t v;

        memcpy(&v, p, sizeof(v));
        return v;
}

/* The one f32 step of every fast kernel: block k's share of dot(row, x), from the exact integer
 * sum of the weight codes times the activation codes. */
static inline __attribute__((always_inline)) float block_term(enum kind kind, float dw, float mw,
                                                              const struct matmul_q8 *xb, int32_t sumi) {
        switch (kind) {
        case KIND_Q8_0: return (dw * xb->d) * (float)sumi;
        case KIND_Q4_0: return (dw * xb->d) * (float)(sumi - 8 * xb->sum);
        case KIND_Q4_1: break;
        }
        return (dw * xb->d) * (float)sumi + mw * (xb->d * (float)xb->sum);
}

static inline __attribute__((always_inline)) uint32_t kind_block_bytes(enum kind kind) {
        return kind == KIND_Q8_0 ? 34 : kind == KIND_Q4_0 ? 18 : 20;
}

/* A weight block's scales and the offset of its codes. */
static inline __attribute__((always_inline)) const uint8_t *block_scales(enum kind kind, const uint8_t *blk,
                                                                         float *dw, float *mw) {
        *dw = qtype_f16_to_f32(load_u16(blk));
        *mw = kind == KIND_Q4_1 ? qtype_f16_to_f32(load_u16(blk + 2)) : 0.0f;
        return blk + (kind == KIND_Q4_1 ? 4 : 2);
}

static inline __attribute__((always_inline)) void rows_plain(enum kind kind, const struct matmul *m,
                                                             uint32_t r0, uint32_t r1) {
        uint32_t nb = m->cols / MATMUL_BLOCK, bb = kind_block_bytes(kind);

        for (uint32_t r = r0; r < r1; r++) {
                const uint8_t *row = (const uint8_t *)m->w + (size_t)r * m->row_bytes;
                for (uint32_t b0 = 0; b0 < m->n_x; b0 += MATMUL_CHUNK) {
                        uint32_t bn = m->n_x - b0 < MATMUL_CHUNK ? m->n_x - b0 : MATMUL_CHUNK;
                        float acc[MATMUL_CHUNK] = { 0 };
                        for (uint32_t k = 0; k < nb; k++) {
                                float dw, mw;
                                const uint8_t *qs = block_scales(kind, row + (size_t)k * bb, &dw, &mw);
                                int8_t wq[MATMUL_BLOCK];
                                if (kind == KIND_Q8_0)
                                        memcpy(wq, qs, MATMUL_BLOCK);
                                else
                                        for (int j = 0; j < 16; j++) {
                                                wq[j] = (int8_t)(qs[j] & 0x0f);
                                                wq[j + 16] = (int8_t)(qs[j] >> 4);
                                        }
                                for (uint32_t b = 0; b < bn; b++) {
                                        const struct matmul_q8 *xb = &m->xq[(size_t)(b0 + b) * nb + k];
                                        int32_t sumi = 0;
                                        for (int j = 0; j < MATMUL_BLOCK; j++)
                                                sumi += wq[j] * xb->q[j];
                                        acc[b] += block_term(kind, dw, mw, xb, sumi);
                                }
                        }
                        for (uint32_t b = 0; b < bn; b++)
                                m->y[(size_t)(b0 + b) * m->y_stride + r] = acc[b];
                }
        }
}

#if MATMUL_HAVE_AVX2
/* The eight int32 sums of v[0..8): out[i] = the sum of v[i]'s lanes, by a tree of horizontal adds
 * (one reduction for eight blocks instead of eight). */
__attribute__((target("avx2"))) static inline void hsum8_i32(const __m256i v[8], int32_t out[8]) {
        __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
        __m256i c = _mm256_hadd_epi32(v[4], v[5]), d = _mm256_hadd_epi32(v[6], v[7]);
        __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
        /* ab holds v0..v3's halves: low lane sums of the low 128 bits, high lane of the high */
        __m256i lo = _mm256_permute2x128_si256(ab, cd, 0x20), hi = _mm256_permute2x128_si256(ab, cd, 0x31);

        _mm256_storeu_si256((__m256i *)out, _mm256_add_epi32(lo, hi));
}

/* A weight block's 32 codes as bytes: nibbles unsigned (0..15), q8_0 as stored. */
__attribute__((target("avx2"))) static inline __m256i block_codes(enum kind kind, const uint8_t *qs) {
        if (kind == KIND_Q8_0)
                return _mm256_loadu_si256((const __m256i *)qs);
        __m128i h = _mm_loadu_si128((const __m128i *)qs);
        return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(h), _mm_srli_epi16(h, 4), 1),
                                _mm256_set1_epi8(0x0f));
}

/* The int32 lanes of a weight block times an activation block. Nibble codes are unsigned, so
 * maddubs(codes, x) is exact (pairs at most 2 * 15 * 127); q8_0 codes are signed, so their sign
 * moves onto x first (|w| * sign(w) x, pairs at most 2 * 128 * 127 < 2^15). */
__attribute__((target("avx2"))) static inline __m256i block_dot(enum kind kind, __m256i wv,
                                                                const struct matmul_q8 *xb) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)xb->q), p;

        if (kind == KIND_Q8_0)
                p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
        else
                p = _mm256_maddubs_epi16(wv, xv);
        return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* rows_plain's loops and f32 steps, with the blocks taken eight at a time: their integer sums are
 * reduced together (hsum8_i32), then added to the row's sum one block at a time, in order. */
__attribute__((target("avx2"))) static inline void rows_avx2(enum kind kind, const struct matmul *m,
                                                             uint32_t r0, uint32_t r1) {
        uint32_t nb = m->cols / MATMUL_BLOCK, bb = kind_block_bytes(kind);

        for (uint32_t r = r0; r < r1; r++) {
                const uint8_t *row = (const uint8_t *)m->w + (size_t)r * m->row_bytes;
                for (uint32_t b0 = 0; b0 < m->n_x; b0 += MATMUL_CHUNK) {
                        uint32_t bn = m->n_x - b0 < MATMUL_CHUNK ? m->n_x - b0 : MATMUL_CHUNK;
                        float acc[MATMUL_CHUNK] = { 0 };
                        for (uint32_t k0 = 0; k0 < nb; k0 += 8) {
                                uint32_t kn = nb - k0 < 8 ? nb - k0 : 8;
                                __m256i wv[8], pv[8];
                                float dw[8], mw[8];
                                int32_t sumi[8];
                                for (uint32_t i = 0; i < 8; i++) {
                                        /* a short last group repeats its first block; those sums go unused */
                                        const uint8_t *qs =
                                                block_scales(kind, row + (size_t)(k0 + (i < kn ? i : 0)) * bb,
                                                             &dw[i], &mw[i]);
                                        wv[i] = block_codes(kind, qs);
                                }
                                for (uint32_t b = 0; b < bn; b++) {
                                        const struct matmul_q8 *xb = &m->xq[(size_t)(b0 + b) * nb + k0];
                                        for (uint32_t i = 0; i < 8; i++)
                                                pv[i] = block_dot(kind, wv[i], &xb[i < kn ? i : 0]);
                                        hsum8_i32(pv, sumi);
                                        for (uint32_t i = 0; i < kn; i++)
                                                acc[b] += block_term(kind, dw[i], mw[i], &xb[i], sumi[i]);
                                }
                        }
                        for (uint32_t b = 0; b < bn; b++)
                                m->y[(size_t)(b0 + b) * m->y_stride + r] = acc[b];
                }
        }
}
#endif

typedef void rows_fn(const struct matmul *m, uint32_t r0, uint32_t r1);

#define KERNELS(k, name)                                                                                     \
        static void plain_##name(const struct matmul *m, uint32_t r0, uint32_t r1) {                         \
                rows_plain(k, m, r0, r1);                                                                    \
        }                                                                                                    \
        KERNEL_AVX2(k, name)
#if MATMUL_HAVE_AVX2
#define KERNEL_AVX2(k, name)                                                                                 \
        __attribute__((target("avx2"))) static void avx2_##name(const struct matmul *m, uint32_t r0,         \
                                                                uint32_t r1) {                               \
                rows_avx2(k, m, r0, r1);                                                                     \
        }
#define AVX2(name) avx2_##name
#else
#define KERNEL_AVX2(k, name)
#define AVX2(name) NULL
#endif
KERNELS(KIND_Q8_0, q8_0)
KERNELS(KIND_Q4_0, q4_0)
KERNELS(KIND_Q4_1, q4_1)

/* The types with an integer kernel; every other row takes the exact path. */
static const struct {
        uint32_t type;
        rows_fn *plain, *avx2;
} kernels[] = {
        { QTYPE_Q8_0, plain_q8_0, AVX2(q8_0) },
        { QTYPE_Q4_0, plain_q4_0, AVX2(q4_0) },
        { QTYPE_Q4_1, plain_q4_1, AVX2(q4_1) },
};

/* y[b][r] = t->dot(row r, x[b]) bit for bit: the same spans, the same lanes, block decoded once per
 * chunk of vectors. */
static void rows_exact(const struct matmul *m, uint32_t r0, uint32_t r1) {
        const struct qtype *t = m->t;
        float tmp[MATMUL_BLOCK];

        for (uint32_t r = r0; r < r1; r++) {
                const uint8_t *row = (const uint8_t *)m->w + (size_t)r * m->row_bytes;
                for (uint32_t b0 = 0; b0 < m->n_x; b0 += MATMUL_CHUNK) {
                        uint32_t bn = m->n_x - b0 < MATMUL_CHUNK ? m->n_x - b0 : MATMUL_CHUNK;
                        float lanes[MATMUL_CHUNK][QTYPE_LANES] = { { 0 } };
                        for (uint32_t i = 0; i < m->cols; i += MATMUL_BLOCK) {
                                uint32_t len = m->cols - i < MATMUL_BLOCK ? m->cols - i : MATMUL_BLOCK;
                                t->dequantize(row + (size_t)i / t->block * t->bytes, tmp, len);
                                for (uint32_t b = 0; b < bn; b++)
                                        qtype_dot_lanes(lanes[b], tmp,
                                                        m->x + (size_t)(b0 + b) * m->x_stride + i, len);
                        }
                        for (uint32_t b = 0; b < bn; b++)
                                m->y[(size_t)(b0 + b) * m->y_stride + r] = qtype_lanes_sum(lanes[b]);
                }
        }
}

int matmul_isa_supported(enum matmul_isa isa) {
        switch (isa) {
        case MATMUL_ISA_BEST:
        case MATMUL_ISA_PLAIN: return 1;
        case MATMUL_ISA_AVX2:
#if MATMUL_HAVE_AVX2
                return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
                return 0;
#endif
        }
        return 0;
}

static int matmul_valid(const struct matmul *m, uint32_t row_begin, uint32_t row_end) {
        const struct qtype *t = m->t;

        if (!t || !t->dequantize || !t->dot || !m->w || !m->x || !m->y || m->n_x == 0)
                return 0;
        if (m->cols % t->block || m->row_bytes < qtype_row_bytes(t, m->cols) || m->x_stride < m->cols)
                return 0;
        if (row_begin > row_end || (m->n_x > 1 && m->y_stride < row_end))
                return 0;
        return !m->xq || m->cols % MATMUL_BLOCK == 0;
}

int matmul_rows(const struct matmul *m, uint32_t row_begin, uint32_t row_end) {
        if (!matmul_valid(m, row_begin, row_end))
                return -EINVAL;
        if (!matmul_isa_supported(m->isa))
                return -ENOTSUP;
        if (m->xq)
                for (size_t i = 0; i < sizeof(kernels) / sizeof(kernels[0]); i++) {
                        if (kernels[i].type != m->t->id)
                                continue;
                        int avx2 = m->isa == MATMUL_ISA_AVX2 ||
                                   (m->isa == MATMUL_ISA_BEST && matmul_isa_supported(MATMUL_ISA_AVX2));
                        (avx2 && kernels[i].avx2 ? kernels[i].avx2 : kernels[i].plain)(m, row_begin, row_end);
                        return 0;
                }
        rows_exact(m, row_begin, row_end);
        return 0;
}
