/* select.c: linear-time top-k selection by radix select on the float bits.
 *
 * Why radix and not quickselect: scores are written by clients, and a client could craft an
 * order that makes a quickselect quadratic and stall the daemon. Four histogram passes over the
 * bytes of an order-preserving integer key find the k-th largest value exactly in O(n), always.
 */
#include <math.h>
#include <string.h>

#include "policy.h"

/* An unsigned key with the same order as the float: NaN gets the key of -inf (the contract ranks
 * them equal), and -0 the key of +0 (equal floats tie). */
static uint32_t float_key(float f) {
        uint32_t b;
        if (f != f)
                f = -INFINITY;
        else if (f == 0.0f)
                f = 0.0f;
        memcpy(&b, &f, sizeof(b));
        return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

void select_topk(const float *score, uint32_t n, uint32_t k, uint32_t *out, uint32_t *scratch) {
        if (k >= n) {
                for (uint32_t i = 0; i < n; i++)
                        out[i] = i;
                return;
        }
        if (k == 0)
                return;

        uint32_t *key = scratch;
        for (uint32_t i = 0; i < n; i++)
                key[i] = float_key(score[i]);

        /* find the k-th largest key, one byte at a time from the top */
        uint32_t prefix = 0, mask = 0, need = k;
        for (int shift = 24; shift >= 0; shift -= 8) {
                uint32_t hist[256] = { 0 };
                for (uint32_t i = 0; i < n; i++)
                        if ((key[i] & mask) == prefix)
                                hist[(key[i] >> shift) & 0xff]++;
                uint32_t b = 255;
                while (hist[b] < need) {
                        need -= hist[b];
                        b--;
                }
                prefix |= b << shift;
                mask |= 0xffu << shift;
        }
        /* prefix is the k-th largest key; `need` ties at it are kept, the most recent ones */
        uint32_t tie_from = n;
        for (uint32_t i = n, seen = 0; i-- > 0 && seen < need;) {
                if (key[i] == prefix) {
                        seen++;
                        tie_from = i;
                }
        }
        uint32_t m = 0;
        for (uint32_t i = 0; i < n; i++)
                if (key[i] > prefix || (key[i] == prefix && i >= tie_from))
                        out[m++] = i;
}
