/* matmul.c - the matrix-vectors product of matmul.h: the exact path over qtype.h's rows, and the
 * fast path's activation quantization and integer kernels: plain C, AVX2, and AVX2 with AVX-512
 * VNNI's vpdpbusd.
 *
 * Loop order (AVX2): a pass of vectors whose activation scales fit struct scales, then four rows
 * at a time, then a chunk of vectors (8, 4, 2 or 1, a constant that keeps every accumulator in a
 * register), then the rows' blocks, then the chunk's vectors. A weight block is decoded once and
 * meets every vector of the chunk while it is in registers; a row (360 bytes for 576 q4_1
 * columns) stays in L1 across chunks. The plain kernel takes a row a vector at a time (the row is
 * read from memory once, then from L1).
 *
 * The f32 steps, the same in every implementation (no FMA: the build has -ffp-contract=off and
 * the AVX2 functions do not enable "fma"): block k's integer lane sums s_l are exact, whatever
 * order the lanes add them in; then acc_l += (d_w d_x) * (float)s_l for l < 8, which the AVX2
 * kernels do as one vector multiply and add per block and vector, as llama.cpp does (its
 * accumulator is the same eight lanes). q4_1's terms m d_x sum(q) of a group of eight blocks go
 * into the same lanes, block k0 + i into lane i, before the group's products: kept in lanes of
 * their own they would be summed apart from the products they nearly cancel (m is about -7.5 d
 * for weights centred on zero), and the final difference of two large sums loses bits. A row
 * ends with the fixed tree of lanes_tree. The earlier kernels reduced each block to one scalar
 * before the f32 step (one scalar chain per row, a horizontal sum per block) and ran at 7% of
 * memcpy; this order keeps the plain reference exact (bit for bit, not within a tolerance) and
 * costs the AVX2 kernels nothing.
 *
 * Where the time went, and what removed it: the quantization's libm calls (roundf, fmaxf and
 * fminf per element cost more than a 1536-column product), gathering the activation scales from
 * the 40-byte blocks once per row (they are laid out once per call, struct scales), and the
 * accumulators of a batch kept in memory (the chunk size is a constant).
 *
 * AVX2 (with F16C, for the f16 scales: every AVX2 CPU has it) is compiled with function target
 * attributes, not -mavx2 for the file, so the rest of the file (and the plain path) stay baseline
 * x86-64; matmul_isa_supported reads kernels/cpu.h's answer, detected once at start (until issue 29
 * it executed CPUID for every product, 211 a token: 15% of decode on a virtual machine, where CPUID
 * traps; test_qtype and test_smollm2 assert that no product runs the detector). The f16
 * conversions are exact in both paths (subnormal scales too), so they cannot make the two differ.
 */
#include "matmul.h"
#include "cpu.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MATMUL_HAVE_AVX2 1
#else
#define MATMUL_HAVE_AVX2 0
#endif

#define LANES 8 /* f32 accumulator lanes of a row and vector */
/* The x86 kernels ask for the cache lines of the rows MATMUL_PREFETCH_ROWS ahead, a group at a
 * time: decode reads 98 MB of weights a token from memory, and without it the kernels waited on
 * it (the profile's hot spots were the loads of each group's scales); 8 to 16 rows gave 1.2x
 * decode per CPU-second, 0 1.0x, 32 1.15x (issue 29, Zen 4, 1 thread). */
#ifndef MATMUL_PREFETCH_ROWS
#define MATMUL_PREFETCH_ROWS 8
#endif

size_t matmul_q8_count(uint32_t cols, uint32_t n_x) {
        return (size_t)(cols / MATMUL_BLOCK) * n_x;
}

/* roundf(v) (halves away from zero) clamped to [-127, 127], a NaN to -127, without the libm calls
 * (roundf, fmaxf, fminf) that made the quantization cost more than the product: within the clamp,
 * v - trunc(v) is exact, and its magnitude decides the rounding. */
static inline int8_t quantize_code(float v) {
        if (!(v >= -127.0f))
                return -127;
        if (v > 127.0f)
                return 127;
        int32_t t = (int32_t)v;
        float f = v - (float)t;
        return (int8_t)(t + (f >= 0.5f) - (f <= -0.5f));
}

/* One block of 32 activations, in plain C. */
static void quantize_block_plain(const float *xs, struct matmul_q8 *o) {
        float amax = 0.0f;
        for (int j = 0; j < MATMUL_BLOCK; j++)
                amax = fabsf(xs[j]) > amax ? fabsf(xs[j]) : amax;
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < MATMUL_BLOCK; j++) {
                o->q[j] = quantize_code(xs[j] * id);
                sum += o->q[j];
        }
        o->d = d;
        o->sum = sum;
}

#if MATMUL_HAVE_AVX2
/* quantize_block_plain with AVX2, bit for bit: the same f32 operations per element. The largest
 * magnitude: maxps returns its second operand when either is a NaN, so max(|x|, m) skips NaNs as
 * the plain comparison does (and max is exact, in any order). quantize_code: max(v, -127) sends a
 * NaN to -127 (second operand again), min(., 127) clamps, and the truncation's remainder decides
 * the rounding, as in the plain code. */
__attribute__((target("avx2,f16c"))) static void quantize_block_avx2(const float *xs, struct matmul_q8 *o) {
        __m256 sign = _mm256_set1_ps(-0.0f), m = _mm256_setzero_ps(), v[4];
        for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xs + 8 * i);
                m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        __m256i t[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
                __m256 c = _mm256_mul_ps(v[i], _mm256_set1_ps(id));
                c = _mm256_min_ps(_mm256_max_ps(c, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
                __m256i q = _mm256_cvttps_epi32(c);
                __m256 f = _mm256_sub_ps(c, _mm256_cvtepi32_ps(q));
                q = _mm256_sub_epi32(q, _mm256_castps_si256(_mm256_cmp_ps(f, _mm256_set1_ps(0.5f), _CMP_GE_OQ)));
                q = _mm256_add_epi32(q, _mm256_castps_si256(_mm256_cmp_ps(f, _mm256_set1_ps(-0.5f), _CMP_LE_OQ)));
                t[i] = q;
                total = _mm256_add_epi32(total, q);
        }
        __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(t[0], t[1]), _mm256_packs_epi32(t[2], t[3]));
        /* the packs interleave 128-bit lanes: elements 0-3 8-11 16-19 24-27 4-7 12-15 20-23 28-31 */
        w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)o->q, w);
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        o->d = d;
        o->sum = _mm_cvtsi128_si32(s);
}
#endif

int matmul_quantize_isa(enum matmul_isa isa, const float *x, size_t x_stride, uint32_t n_x, uint32_t cols,
                        struct matmul_q8 *ret) {
        uint32_t nb = cols / MATMUL_BLOCK;

        if (cols % MATMUL_BLOCK || x_stride < cols)
                return -EINVAL;
        if (!matmul_isa_supported(isa))
                return -ENOTSUP;
        void (*block)(const float *, struct matmul_q8 *) = quantize_block_plain;
#if MATMUL_HAVE_AVX2
        if (isa != MATMUL_ISA_PLAIN && cpu_features()->avx2_f16c)
                block = quantize_block_avx2;
#endif
        for (uint32_t b = 0; b < n_x; b++)
                for (uint32_t k = 0; k < nb; k++)
                        block(x + b * x_stride + (size_t)k * MATMUL_BLOCK, &ret[(size_t)b * nb + k]);
        return 0;
}

int matmul_quantize(const float *x, size_t x_stride, uint32_t n_x, uint32_t cols, struct matmul_q8 *ret) {
        return matmul_quantize_isa(MATMUL_ISA_BEST, x, x_stride, n_x, cols, ret);
}

/* The fast path's weight kinds: how a block decodes to 32 integer codes (the 8-bit activations
 * meet them in an exact integer dot) and what its f32 steps add. */
enum kind {
        KIND_Q8_0, /* f16 d, int8 q: w = d q */
        KIND_Q4_0, /* f16 d, nibbles q: w = d (q - 8), codes q - 8 */
        KIND_Q4_1, /* f16 d, f16 m, nibbles q: w = d q + m, codes q and a term m * x_d * sum */
};

static uint16_t load_u16(const uint8_t *p) {
        uint16_t v;

        memcpy(&v, p, sizeof(v));
        return v;
}

static inline __attribute__((always_inline)) uint32_t kind_block_bytes(enum kind kind) {
        return kind == KIND_Q8_0 ? 34 : kind == KIND_Q4_0 ? 18 : 20;
}

/* Where a weight block's codes start, after its f16 scale (and q4_1's f16 minimum). */
static inline __attribute__((always_inline)) uint32_t kind_codes_offset(enum kind kind) {
        return kind == KIND_Q4_1 ? 4 : 2;
}

/* The fixed tree that ends every row: the eight lanes of lane l, (l0 + l4) + (l2 + l6) + ... */
static inline __attribute__((always_inline)) float lanes_tree(const float l[LANES]) {
        float t0 = l[0] + l[4], t1 = l[1] + l[5], t2 = l[2] + l[6], t3 = l[3] + l[7];

        return (t0 + t2) + (t1 + t3);
}

/* Row r's result for vector b in the order of the header, in plain C: the reference the AVX2
 * kernels equal bit for bit, and the kernel of CPUs without them. A vector at a time, so that its
 * accumulators stay out of memory (across a batch they went there, and the chain through memory
 * cost more than decoding each block once per vector). */
static inline __attribute__((always_inline)) float row_plain(enum kind kind, const struct matmul *m,
                                                             uint32_t r, uint32_t b) {
        uint32_t nb = m->cols / MATMUL_BLOCK, bb = kind_block_bytes(kind);
        const uint8_t *row = (const uint8_t *)m->w + (size_t)r * m->row_bytes;
        const struct matmul_q8 *xq = &m->xq[(size_t)b * nb];
        float acc[LANES] = { 0 };

        for (uint32_t k = 0; k < nb; k++) {
                const uint8_t *blk = row + (size_t)k * bb, *qs = blk + kind_codes_offset(kind);
                if (kind == KIND_Q4_1 && k % LANES == 0) /* a group's minimum terms, lanes past nb +0 */
                        for (uint32_t i = 0; i < LANES; i++)
                                acc[i] += k + i < nb ? qtype_f16_to_f32(load_u16(blk + (size_t)i * bb + 2)) *
                                                               (xq[k + i].d * (float)xq[k + i].sum)
                                                     : 0.0f;
                const int8_t *xj = xq[k].q;
                int8_t wq[MATMUL_BLOCK];
                for (int j = 0; j < 16; j++) {
                        if (kind == KIND_Q8_0) {
                                wq[j] = (int8_t)qs[j];
                                wq[j + 16] = (int8_t)qs[j + 16];
                        } else {
                                int off = kind == KIND_Q4_0 ? 8 : 0;
                                wq[j] = (int8_t)((qs[j] & 0x0f) - off);
                                wq[j + 16] = (int8_t)((qs[j] >> 4) - off);
                        }
                }
                int32_t s[LANES];
                for (int l = 0; l < LANES; l++)
                        s[l] = wq[4 * l] * xj[4 * l] + wq[4 * l + 1] * xj[4 * l + 1] +
                               wq[4 * l + 2] * xj[4 * l + 2] + wq[4 * l + 3] * xj[4 * l + 3];
                float c = qtype_f16_to_f32(load_u16(blk)) * xq[k].d;
                for (int l = 0; l < LANES; l++)
                        acc[l] += c * (float)s[l];
        }
        return lanes_tree(acc);
}

static inline __attribute__((always_inline)) void rows_plain(enum kind kind, const struct matmul *m,
                                                             uint32_t r0, uint32_t r1) {
        for (uint32_t r = r0; r < r1; r++)
                for (uint32_t b = 0; b < m->n_x; b++)
                        m->y[(size_t)b * m->y_stride + r] = row_plain(kind, m, r, b);
}

#if MATMUL_HAVE_AVX2
#define AVX2_TARGET __attribute__((target("avx2,f16c")))
/* The VNNI kernels are the AVX2 ones compiled for the CPUs that have them (cpu.h's avx512_vnni
 * implies F, BW, VL and DQ): EVEX encodings give the compiler 32 vector registers and let it fold
 * the products' broadcasts of c and the activations' loads (vpdpbusd's "vm": it may read x from
 * memory) into the instructions that use them: 1.10-1.18x on batches of 8, 1.04-1.14x at B = 1, in
 * cache (issue 29 item 5). Still 256-bit registers. */
#define VNNI_TARGET __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

/* A weight block's 32 codes as bytes: q4_1's unsigned nibbles (0..15), q4_0's nibbles - 8, q8_0's
 * as stored. Nibbles: both halves of the 16 bytes, the high lane shifted by 4, then masked. */
AVX2_TARGET static inline __attribute__((always_inline)) __m256i block_codes(enum kind kind,
                                                                             const uint8_t *qs) {
        if (kind == KIND_Q8_0)
                return _mm256_loadu_si256((const __m256i *)qs);
        __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
        __m256i c = _mm256_and_si256(_mm256_srlv_epi64(h, _mm256_setr_epi64x(0, 0, 4, 4)),
                                     _mm256_set1_epi8(0x0f));
        return kind == KIND_Q4_0 ? _mm256_sub_epi8(c, _mm256_set1_epi8(8)) : c;
}

/* AVX-512 VNNI (issue 29). vpdpbusd adds the four u8 x s8 products of each 32-bit lane into it:
 * the lane sums s_l in one instruction where AVX2 takes maddubs and madd (both exact: |s_l| <=
 * 4 * 128 * 127), so the kernel is the AVX2 one with that one step changed, bit for bit the same.
 * On 256-bit registers (EVEX, AVX512VL), not 512: 512-bit tiles (two rows' eight lanes in one
 * register, each lane still summing its own row's blocks in order) were built and measured at
 * 0.84x to 1.11x the AVX2 kernel on this Zen 4, which splits 512-bit operations in two halves,
 * against 1.02x to 1.15x for these; they were dropped. Written in inline assembly ("{evex}": the
 * VEX form is AVX-VNNI, another extension), because the intrinsic needs avx512vnni in the target
 * of the function it is inlined into, and the AVX2 kernel inlines the same tile. */
AVX2_TARGET static inline __attribute__((always_inline)) __m256i dpbusd256_asm(__m256i acc, __m256i a,
                                                                               __m256i b) {
        __asm__("%{evex%} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
        return acc;
}

/* The block's lane sums s_l (elements 4l .. 4l + 3) as f32, exact. Unsigned codes go straight into
 * maddubs or vpdpbusd (pairs at most 2 * 15 * 127); signed codes move their sign onto x first,
 * |w| sign(w) x (pairs at most 2 * 128 * 127 < 2^15). wa is |w| for signed codes. */
AVX2_TARGET static inline __attribute__((always_inline)) __m256
block_lanes(enum kind kind, const int vnni, __m256i w, __m256i wa, const struct matmul_q8 *xb) {
        __m256i x = _mm256_loadu_si256((const __m256i *)xb->q), u = w;

        if (kind != KIND_Q4_1) {
                x = _mm256_sign_epi8(x, w);
                u = wa;
        }
        if (vnni)
                return _mm256_cvtepi32_ps(dpbusd256_asm(_mm256_setzero_si256(), u, x));
        return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}

/* The f32 side of the activations, laid out for the AVX2 kernels: for each vector, x_d of every
 * block and (q4_1) x_d * sum, contiguous, padded with zeros to a multiple of eight blocks. Built
 * once per call for every vector it can hold (they would otherwise be gathered from the struct
 * matmul_q8 blocks, 40 bytes apart, once per row). */
#define SCALES_MAX 2048 /* (vector, block) pairs on the stack, 16 KB */

struct scales {
        uint32_t nbp; /* blocks per vector, padded */
        float xd[SCALES_MAX], xs[SCALES_MAX];
};

/* Lays out vectors [p0, p0 + pn) of m's activations in sc (sc->nbp set, pn * nbp <= SCALES_MAX). */
static void scales_fill(struct scales *sc, const struct matmul *m, uint32_t p0, uint32_t pn) {
        uint32_t nb = m->cols / MATMUL_BLOCK;

        for (uint32_t b = 0; b < pn; b++)
                for (uint32_t k = 0; k < sc->nbp; k++) {
                        const struct matmul_q8 *xb = &m->xq[(size_t)(p0 + b) * nb + k];
                        sc->xd[b * sc->nbp + k] = k < nb ? xb->d : 0.0f;
                        sc->xs[b * sc->nbp + k] = k < nb ? xb->d * (float)xb->sum : 0.0f;
                }
}

/* f16 value o bytes into each of a group's kn blocks, bb bytes apart, as f32; lanes past kn repeat
 * block 0 (their products are masked or unused). */
AVX2_TARGET static inline __attribute__((always_inline)) __m256 group_halves(const uint8_t *g, uint32_t bb,
                                                                             uint32_t o, uint32_t kn) {
        const uint8_t *p[LANES];
        for (uint32_t i = 0; i < LANES; i++)
                p[i] = g + (size_t)(i < kn ? i : 0) * bb + o;
        return _mm256_cvtph_ps(_mm_setr_epi16(load_u16(p[0]), load_u16(p[1]), load_u16(p[2]), load_u16(p[3]),
                                              load_u16(p[4]), load_u16(p[5]), load_u16(p[6]),
                                              load_u16(p[7])));
}

#define LOAD128(p) _mm_loadu_si128((const __m128i *)(p))

/* The scales (and q4_1's minimums) of a group of eight blocks, as f32, without a load per scale:
 * block i's scale lies in the 16 bytes at 16 i (q4_0, 18-byte blocks), 32 i (q8_0, 34) or
 * 16 i + 16 (i >= 4) (q4_1's scale and minimum, 20), at word i (q4_1: dword i mod 4), so a blend
 * of whole 16-byte loads, all inside the group, collects them. A short group takes group_halves. */
AVX2_TARGET static inline __attribute__((always_inline)) void
group_scales(enum kind kind, const uint8_t *g, uint32_t kn, __m256 *dw, __m256 *mw) {
        uint32_t bb = kind_block_bytes(kind);

        if (kn < LANES) {
                *dw = group_halves(g, bb, 0, kn);
                *mw = kind == KIND_Q4_1 ? group_halves(g, bb, 2, kn) : _mm256_setzero_ps();
                return;
        }
        if (kind == KIND_Q4_1) {
                __m128i lo = _mm_blend_epi32(_mm_blend_epi32(LOAD128(g), LOAD128(g + 16), 0x2),
                                             _mm_blend_epi32(LOAD128(g + 32), LOAD128(g + 48), 0x8), 0xc);
                __m128i hi = _mm_blend_epi32(_mm_blend_epi32(LOAD128(g + 80), LOAD128(g + 96), 0x2),
                                             _mm_blend_epi32(LOAD128(g + 112), LOAD128(g + 128), 0x8), 0xc);
                __m128i split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
                lo = _mm_shuffle_epi8(lo, split); /* d0..d3, m0..m3 */
                hi = _mm_shuffle_epi8(hi, split);
                *dw = _mm256_cvtph_ps(_mm_unpacklo_epi64(lo, hi));
                *mw = _mm256_cvtph_ps(_mm_unpackhi_epi64(lo, hi));
                return;
        }
        uint32_t step = kind == KIND_Q8_0 ? 32 : 16;
        __m128i h01 = _mm_blend_epi16(LOAD128(g), LOAD128(g + step), 0x02);
        __m128i h23 = _mm_blend_epi16(LOAD128(g + 2 * step), LOAD128(g + 3 * step), 0x08);
        __m128i h45 = _mm_blend_epi16(LOAD128(g + 4 * step), LOAD128(g + 5 * step), 0x20);
        __m128i h67 = _mm_blend_epi16(LOAD128(g + 6 * step), LOAD128(g + 7 * step), 0x80);
        *dw = _mm256_cvtph_ps(
                _mm_blend_epi16(_mm_blend_epi16(h01, h23, 0x0c), _mm_blend_epi16(h45, h67, 0xc0), 0xf0));
        *mw = _mm256_setzero_ps();
}

/* lanes_tree in registers: the halves added (l_i + l_{i+4}), then pairs, then the two. */
AVX2_TARGET static inline __attribute__((always_inline)) float tree_avx2(__m256 v) {
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
        return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

/* row_plain for NR rows from r and NB vectors from b0 (constants, NR * NB <= 8: the accumulators
 * stay in registers; rows side by side give the out-of-order core independent chains when the
 * batch is small), blocks in groups of eight: a group's scales are converted together (F16C
 * converts every f16 exactly, as qtype_f16_to_f32 does), the products c = d_w d_x go to memory
 * for a broadcast per block, and q4_1's minimum terms of the group, one vector (block k0 + i in
 * lane i, empty lanes +0), go into the accumulator ahead of the group's products. xd and xs are
 * vector b0's scales. */
AVX2_TARGET static inline __attribute__((always_inline)) void
tile_avx2(enum kind kind, const int vnni, const struct matmul *m, uint32_t r, uint32_t b0, const int NR, const int NB,
          const struct scales *sc, const float *xd, const float *xs) {
        uint32_t nb = m->cols / MATMUL_BLOCK, bb = kind_block_bytes(kind), nbp = sc->nbp;
        const uint8_t *row = (const uint8_t *)m->w + (size_t)r * m->row_bytes;
        const struct matmul_q8 *xq = m->xq + (size_t)b0 * nb;
        __m256 acc[4][MATMUL_CHUNK];
        float c[4][MATMUL_CHUNK][LANES] __attribute__((aligned(32)));

        _Pragma("GCC unroll 4") for (int rr = 0; rr < NR; rr++)
                _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++) acc[rr][b] = _mm256_setzero_ps();
        for (uint32_t k0 = 0; k0 < nb; k0 += LANES) {
                uint32_t kn = nb - k0 < LANES ? nb - k0 : LANES;
                __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                        _mm256_set1_epi32((int)kn), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
                _Pragma("GCC unroll 4") for (int rr = 0; rr < NR; rr++) {
                        const uint8_t *g = row + (size_t)rr * m->row_bytes + (size_t)k0 * bb;
                        for (uint32_t o = 0; MATMUL_PREFETCH_ROWS && o < LANES * bb; o += 64)
                                __builtin_prefetch(g + (size_t)MATMUL_PREFETCH_ROWS * m->row_bytes + o);
                        __m256 dw, mw;
                        group_scales(kind, g, kn, &dw, &mw);
                        _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++) {
                                _mm256_store_ps(
                                        c[rr][b],
                                        _mm256_mul_ps(dw, _mm256_loadu_ps(xd + (size_t)b * nbp + k0)));
                                if (kind == KIND_Q4_1) {
                                        __m256 t =
                                                _mm256_mul_ps(mw, _mm256_loadu_ps(xs + (size_t)b * nbp + k0));
                                        acc[rr][b] = _mm256_add_ps(acc[rr][b], _mm256_and_ps(t, live));
                                }
                        }
                }
                for (uint32_t i = 0; i < kn; i++) {
                        _Pragma("GCC unroll 4") for (int rr = 0; rr < NR; rr++) {
                                const uint8_t *blk = row + (size_t)rr * m->row_bytes + (size_t)(k0 + i) * bb;
                                __m256i w = block_codes(kind, blk + kind_codes_offset(kind));
                                __m256i wa = kind == KIND_Q4_1 ? w : _mm256_sign_epi8(w, w);
                                _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++) {
                                        __m256 s = block_lanes(kind, vnni, w, wa, xq + (size_t)b * nb + k0 + i);
                                        acc[rr][b] = _mm256_add_ps(
                                                acc[rr][b],
                                                _mm256_mul_ps(_mm256_broadcast_ss(&c[rr][b][i]), s));
                                }
                        }
                }
        }
        _Pragma("GCC unroll 4") for (int rr = 0; rr < NR; rr++)
                _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++) {
                m->y[(size_t)(b0 + b) * m->y_stride + r + rr] = tree_avx2(acc[rr][b]);
        }
}

/* Rows [r, r + nr) (nr 1 or 4) for vectors [b0, b0 + NB), as tiles of at most 8 accumulators. */
AVX2_TARGET static inline __attribute__((always_inline)) void
rows_chunk_avx2(enum kind kind, const int vnni, const struct matmul *m, uint32_t r, uint32_t nr, uint32_t b0, const int NB,
                const struct scales *sc, const float *xd, const float *xs) {
        if (nr == 4 && NB <= 2)
                tile_avx2(kind, vnni, m, r, b0, 4, NB, sc, xd, xs);
        else if (nr == 4 && NB == 4) {
                tile_avx2(kind, vnni, m, r, b0, 2, NB, sc, xd, xs);
                tile_avx2(kind, vnni, m, r + 2, b0, 2, NB, sc, xd, xs);
        } else
                for (uint32_t rr = 0; rr < nr; rr++)
                        tile_avx2(kind, vnni, m, r + rr, b0, 1, NB, sc, xd, xs);
}

/* Passes of as many vectors as struct scales holds; in each, four rows at a time (then one), the
 * vectors in chunks of 8, then 4, 2, 1 (a vector's result is the same in any chunk, tile and
 * pass). Rows longer than the scales hold (over 65,536 columns) take the plain kernel, which gives
 * the same bits. */
AVX2_TARGET static inline __attribute__((always_inline)) void
rows_avx2(enum kind kind, const int vnni, const struct matmul *m, uint32_t r0, uint32_t r1) {
        uint32_t nb = m->cols / MATMUL_BLOCK;
        struct scales sc;

        sc.nbp = (nb + LANES - 1) / LANES * LANES;
        if (sc.nbp > SCALES_MAX) {
                rows_plain(kind, m, r0, r1);
                return;
        }
        uint32_t per = SCALES_MAX / sc.nbp;
        for (uint32_t p0 = 0; p0 < m->n_x; p0 += per) {
                uint32_t pn = m->n_x - p0 < per ? m->n_x - p0 : per;
                scales_fill(&sc, m, p0, pn);
                for (uint32_t r = r0, nr; r < r1; r += nr) {
                        nr = r1 - r >= 4 ? 4 : 1;
                        for (uint32_t b = 0; b < pn;) {
                                const float *xd = sc.xd + b * sc.nbp, *xs = sc.xs + b * sc.nbp;
                                uint32_t left = pn - b;
                                if (left >= 8)
                                        rows_chunk_avx2(kind, vnni, m, r, nr, p0 + b, 8, &sc, xd, xs), b += 8;
                                else if (left >= 4)
                                        rows_chunk_avx2(kind, vnni, m, r, nr, p0 + b, 4, &sc, xd, xs), b += 4;
                                else if (left >= 2)
                                        rows_chunk_avx2(kind, vnni, m, r, nr, p0 + b, 2, &sc, xd, xs), b += 2;
                                else
                                        rows_chunk_avx2(kind, vnni, m, r, nr, p0 + b, 1, &sc, xd, xs), b += 1;
                        }
                }
        }
}

#endif

typedef void rows_fn(const struct matmul *m, uint32_t r0, uint32_t r1);

#define KERNELS(k, name)                                                                                     \
        static void plain_##name(const struct matmul *m, uint32_t r0, uint32_t r1) {                         \
                rows_plain(k, m, r0, r1);                                                                    \
        }                                                                                                    \
        KERNEL_X86(k, name)
#if MATMUL_HAVE_AVX2
#define KERNEL_X86(k, name)                                                                                  \
        AVX2_TARGET static void avx2_##name(const struct matmul *m, uint32_t r0, uint32_t r1) {              \
                rows_avx2(k, 0, m, r0, r1);                                                                  \
        }                                                                                                    \
        VNNI_TARGET static void vnni_##name(const struct matmul *m, uint32_t r0, uint32_t r1) {              \
                rows_avx2(k, 1, m, r0, r1);                                                                  \
        }
#define X86(isa, name) isa##_##name
#else
#define KERNEL_X86(k, name)
#define X86(isa, name) NULL
#endif
KERNELS(KIND_Q8_0, q8_0)
KERNELS(KIND_Q4_0, q4_0)
KERNELS(KIND_Q4_1, q4_1)

static void rows_kquant(const struct matmul *m, uint32_t r0, uint32_t r1);

/* The types with an integer kernel, one column per implementation (enum matmul_isa, PLAIN on);
 * NULL: the plain kernel serves. Every other type takes the exact path. */
#define N_ISA (MATMUL_ISA_AVX512_VNNI + 1)
static const struct {
        uint32_t type;
        rows_fn *isa[N_ISA];
} kernels[] = {
#define ROW(t, name) { t, { NULL, plain_##name, X86(avx2, name), X86(vnni, name) } }
        ROW(QTYPE_Q8_0, q8_0),
        ROW(QTYPE_Q4_0, q4_0),
        ROW(QTYPE_Q4_1, q4_1),
#undef ROW
        { QTYPE_Q4_K, { NULL, rows_kquant } },
        { QTYPE_Q6_K, { NULL, rows_kquant } },
};

/* y[b][r] = t->dot(row r, x[b]) bit for bit: the same spans, the same lanes, block decoded once per
 * chunk of vectors. */
static void rows_exact(const struct matmul *m, uint32_t r0, uint32_t r1) {
        const struct qtype *t = m->t;
        float tmp[QTYPE_MAX_BLOCK];
        uint32_t span = t->block > MATMUL_BLOCK ? t->block : MATMUL_BLOCK; /* qtype.c's dot spans */

        for (uint32_t r = r0; r < r1; r++) {
                const uint8_t *row = (const uint8_t *)m->w + (size_t)r * m->row_bytes;
                for (uint32_t b0 = 0; b0 < m->n_x; b0 += MATMUL_CHUNK) {
                        uint32_t bn = m->n_x - b0 < MATMUL_CHUNK ? m->n_x - b0 : MATMUL_CHUNK;
                        float lanes[MATMUL_CHUNK][QTYPE_LANES] = { { 0 } };
                        for (uint32_t i = 0; i < m->cols; i += span) {
                                uint32_t len = m->cols - i < span ? m->cols - i : span;
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

/* K-quants on the 8-bit activations (plain C, no AVX2 kernel yet). A block of 256 decodes to
 * integer codes q, a scale per 16 elements ds_u and (q4_K) a minimum per 32 dm_j, w = ds_u q - dm_j;
 * each activation block j of 32 meets them in two exact integer dots of 16:
 *   acc_j += x_d (ds_2j s_0 + ds_2j+1 s_1) - dm_j (x_d x_sum)
 * over lanes j of a block, summed by lanes_tree. Within a tolerance of the exact path
 * (test_qtype), not bit for bit: the activations are quantized. */
static void kquant_decode(uint32_t type, const uint8_t *b, int8_t q[256], float ds[16], float dm[8]) {
        if (type == QTYPE_Q4_K) {
                float d = qtype_f16_to_f32(load_u16(b)), dmin = qtype_f16_to_f32(load_u16(b + 2));
                const uint8_t *sc = b + 4, *qs = b + 16;
                for (int j = 0; j < 8; j++) {
                        uint8_t s6, m6;
                        if (j < 4) {
                                s6 = sc[j] & 63;
                                m6 = sc[j + 4] & 63;
                        } else {
                                s6 = (uint8_t)((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4));
                                m6 = (uint8_t)((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
                        }
                        ds[2 * j] = ds[2 * j + 1] = d * s6;
                        dm[j] = dmin * m6;
                }
                for (int p = 0; p < 4; p++)
                        for (int l = 0; l < 32; l++) {
                                q[64 * p + l] = (int8_t)(qs[32 * p + l] & 0xF);
                                q[64 * p + 32 + l] = (int8_t)(qs[32 * p + l] >> 4);
                        }
        } else { /* QTYPE_Q6_K */
                float d = qtype_f16_to_f32(load_u16(b + 208));
                const int8_t *sc = (const int8_t *)(b + 192);
                for (int u = 0; u < 16; u++)
                        ds[u] = d * sc[u];
                for (int j = 0; j < 8; j++)
                        dm[j] = 0.0f;
                for (int h = 0; h < 2; h++) {
                        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                        int8_t *y = q + 128 * h;
                        for (int l = 0; l < 32; l++) {
                                y[l] = (int8_t)(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                                y[l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                                y[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                                y[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                        }
                }
        }
}

static void rows_kquant(const struct matmul *m, uint32_t r0, uint32_t r1) {
        uint32_t nb = m->cols / MATMUL_BLOCK, nk = m->cols / 256, type = m->t->id, bytes = m->t->bytes;
        int8_t q[256];
        float ds[16], dm[8];

        for (uint32_t r = r0; r < r1; r++) {
                const uint8_t *row = (const uint8_t *)m->w + (size_t)r * m->row_bytes;
                float acc[MATMUL_CHUNK][LANES];
                for (uint32_t b0 = 0; b0 < m->n_x; b0 += MATMUL_CHUNK) {
                        uint32_t bn = m->n_x - b0 < MATMUL_CHUNK ? m->n_x - b0 : MATMUL_CHUNK;
                        memset(acc, 0, sizeof(acc));
                        for (uint32_t k = 0; k < nk; k++) {
                                kquant_decode(type, row + (size_t)k * bytes, q, ds, dm);
                                for (uint32_t b = 0; b < bn; b++) {
                                        const struct matmul_q8 *xq = &m->xq[(size_t)(b0 + b) * nb + 8 * k];
                                        for (int j = 0; j < 8; j++) {
                                                int32_t s0 = 0, s1 = 0;
                                                for (int i = 0; i < 16; i++) {
                                                        s0 += q[32 * j + i] * xq[j].q[i];
                                                        s1 += q[32 * j + 16 + i] * xq[j].q[16 + i];
                                                }
                                                acc[b][j] += xq[j].d * (ds[2 * j] * (float)s0 +
                                                                        ds[2 * j + 1] * (float)s1) -
                                                             dm[j] * (xq[j].d * (float)xq[j].sum);
                                        }
                                }
                        }
                        for (uint32_t b = 0; b < bn; b++)
                                m->y[(size_t)(b0 + b) * m->y_stride + r] = lanes_tree(acc[b]);
                }
        }
}

int matmul_isa_supported(enum matmul_isa isa) {
        const struct cpu_features *f = cpu_features();

        switch (isa) {
        case MATMUL_ISA_BEST:
        case MATMUL_ISA_PLAIN: return 1;
        case MATMUL_ISA_AVX2: return MATMUL_HAVE_AVX2 && f->avx2_f16c;
        case MATMUL_ISA_AVX512_VNNI: return MATMUL_HAVE_AVX2 && f->avx512_vnni;
        }
        return 0;
}

/* The implementation MATMUL_ISA_BEST stands for: the last of the enum this CPU has (cpu.h's
 * answer, detected once at start). */
static enum matmul_isa matmul_isa_best(void) {
        enum matmul_isa best = MATMUL_ISA_PLAIN;

        for (int isa = MATMUL_ISA_AVX2; isa < N_ISA; isa++)
                if (matmul_isa_supported((enum matmul_isa)isa))
                        best = (enum matmul_isa)isa;
        return best;
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
        if ((unsigned)m->isa >= N_ISA || !matmul_isa_supported(m->isa))
                return -ENOTSUP;
        if (m->xq)
                for (size_t i = 0; i < sizeof(kernels) / sizeof(kernels[0]); i++) {
                        if (kernels[i].type != m->t->id)
                                continue;
                        rows_fn *f = kernels[i].isa[m->isa == MATMUL_ISA_BEST ? matmul_isa_best() : m->isa];
                        (f ? f : kernels[i].isa[MATMUL_ISA_PLAIN])(m, row_begin, row_end);
                        return 0;
                }
        rows_exact(m, row_begin, row_end);
        return 0;
}
