/* lloyd.c: the randomized Hadamard rotation and the Lloyd-Max row codes of the low tiers (the
 * contract is in lloyd.h). Plain loops: the reference the fast attention and the CUDA kernels are
 * checked against. */
#include "lloyd.h"

#include <errno.h>
#include <math.h>
#include <string.h>

static uint64_t splitmix64(uint64_t *s) {
        uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

void lloyd_signs(uint64_t seed, uint32_t layer, uint32_t head, uint32_t d, float *signs) {
        uint64_t s = seed ^ ((uint64_t)layer << 32 | head) * 0xd1342543de82ef95ull, w = 0;
        for (uint32_t i = 0; i < d; i++) {
                if (i % 64 == 0)
                        w = splitmix64(&s);
                signs[i] = (w >> (i % 64)) & 1 ? -1.0f : 1.0f;
        }
}

/* The unnormalized Walsh-Hadamard transform, butterflies of growing span. */
static void fwht(float *x, uint32_t d) {
        for (uint32_t h = 1; h < d; h *= 2)
                for (uint32_t i = 0; i < d; i += 2 * h)
                        for (uint32_t j = i; j < i + h; j++) {
                                float a = x[j], b = x[j + h];
                                x[j] = a + b;
                                x[j + h] = a - b;
                        }
}

void lloyd_rotate(const float *signs, float *x, uint32_t d) {
        float norm = 1.0f / sqrtf((float)d);
        for (uint32_t i = 0; i < d; i++)
                x[i] *= signs[i];
        fwht(x, d);
        for (uint32_t i = 0; i < d; i++)
                x[i] *= norm;
}

void lloyd_unrotate(const float *signs, float *x, uint32_t d) {
        float norm = 1.0f / sqrtf((float)d);
        fwht(x, d); /* H is symmetric and H H = d I */
        for (uint32_t i = 0; i < d; i++)
                x[i] *= norm * signs[i];
}

/* The index of the centroid nearest u: the number of midpoints below u. */
static uint32_t nearest(const float *c, uint32_t levels, float u) {
        uint32_t k = 0;
        while (k + 1 < levels && u > 0.5f * (c[k] + c[k + 1]))
                k++;
        return k;
}

static void put_code(uint8_t *codes, uint32_t i, uint32_t bits, uint32_t code) {
        uint32_t bit = i * bits, byte = bit / 8, shift = bit % 8;
        codes[byte] |= (uint8_t)(code << shift);
        if (shift + bits > 8)
                codes[byte + 1] |= (uint8_t)(code >> (8 - shift));
}

/* Codes y against scale s (nearest centroid of y_i / s); returns the squared error of the
 * least-squares scale for those codes and sets *ret_scale to it. */
static double fit_round(const float *y, uint32_t d, const float *c, uint32_t levels, float s, uint8_t *k,
                        float *ret_scale) {
        float inv = 1.0f / s;
        double xc = 0.0, cc = 0.0, yy = 0.0;
        for (uint32_t i = 0; i < d; i++) {
                k[i] = (uint8_t)nearest(c, levels, y[i] * inv);
                xc += (double)y[i] * c[k[i]];
                cc += (double)c[k[i]] * c[k[i]];
                yy += (double)y[i] * y[i];
        }
        /* xc > 0: each code has the sign of its coordinate (the codebook is symmetric) */
        *ret_scale = (float)(xc / cc);
        return yy - xc * xc / cc;
}

int lloyd_encode_row(const float *y, uint32_t d, uint32_t bits, uint8_t *codes, float *ret_scale) {
        const float *c = lloyd_codebook(bits);
        uint32_t levels = 1u << bits;
        uint8_t k[LLOYD_MAX_DIM], best[LLOYD_MAX_DIM];
        double ss = 0.0;
        memset(codes, 0, (size_t)d * bits / 8);
        *ret_scale = 0.0f;
        for (uint32_t i = 0; i < d; i++) {
                if (!isfinite(y[i]))
                        return -EINVAL;
                ss += (double)y[i] * y[i];
        }
        if (ss == 0.0)
                return 0; /* codes 0 with scale 0 read back as zeros */
        float s = (float)sqrt(ss / d), best_s = 0.0f;
        double best_err = INFINITY;
        for (uint32_t round = 0; round < LLOYD_FIT_ROUNDS; round++) {
                float next;
                double err = fit_round(y, d, c, levels, s, k, &next);
                if (!(err < best_err) || !(next > 0.0f))
                        break; /* converged (or a degenerate fit): keep the best so far */
                best_err = err;
                best_s = next;
                memcpy(best, k, d);
                s = next;
        }
        for (uint32_t i = 0; i < d; i++)
                put_code(codes, i, bits, best[i]);
        *ret_scale = best_s;
        return 0;
}

void lloyd_decode_row(const uint8_t *codes, float scale, uint32_t d, uint32_t bits, float *y) {
        const float *c = lloyd_codebook(bits);
        for (uint32_t i = 0; i < d; i++)
                y[i] = scale * c[lloyd_code(codes, i, bits)];
}
