/* select.c: linear-time top-k selection by radix select on the float bits.
 *
 * Why radix and not quickselect: scores are written by clients, and a client could craft an
 * order that makes a quickselect quadratic and stall the daemon. A radix select over an
 * order-preserving integer key finds the k-th largest value exactly in O(n), always.
 *
 * How (three digits of 11, 11 and 10 bits, from the top):
 *   1. one pass over the scores counts the top digit of every key;
 *   2. one pass gathers the indices whose top digit is the threshold's into scratch (ascending);
 *      the next two digits are found on those candidates only, each pass narrowing them in
 *      place, so for ordinary scores the later digits cost next to nothing;
 *   3. the candidates left are exactly the indices whose key equals the threshold, ascending, so
 *      the ties to keep (the most recent ones) are their tail, found without another pass;
 *   4. one pass writes the keep-set.
 * Three passes over n in all (the old code made seven: a key array, four histograms over all of
 * it, a tie scan and the output). Worst case (all keys in one bucket) five, still linear.
 * Measured in bench/RESULTS.md (item 2).
 */
#include <string.h>

#include "policy.h"

#define DIGIT1_SHIFT 21 /* bits 31..21 */
#define DIGIT2_SHIFT 10 /* bits 20..10 */
#define HIST_BUCKETS 2048

/* An unsigned key with the same order as the float: NaN gets the key of -inf (the contract ranks
 * them equal), and -0 the key of +0 (equal floats tie). Integer selects only, no branches: the
 * compiler turns them into conditional moves (or vector blends), and every pass calls this. */
static inline uint32_t float_key(float f) {
        uint32_t b;
        memcpy(&b, &f, sizeof(b));
        b = (b & 0x7fffffffu) > 0x7f800000u ? 0xff800000u : b; /* NaN: -inf */
        b = b == 0x80000000u ? 0u : b;                          /* -0: +0 */
        return b ^ ((uint32_t)((int32_t)b >> 31) | 0x80000000u);
}

/* The bucket holding the need-th largest entry of hist[0..buckets) (need >= 1 and no more than
 * the entries), and *need reduced by the entries of the buckets above it. */
static uint32_t find_bucket(const uint32_t *hist, uint32_t buckets, uint32_t *need) {
        uint32_t b = buckets - 1;
        while (hist[b] < *need) {
                *need -= hist[b];
                b--;
        }
        return b;
}

/* Narrows cand[0..cnt) (ascending indices, all sharing the key bits above shift + bits) to those
 * whose next `bits` bits are the need-th largest digit; returns the new count. */
static uint32_t narrow(const float *score, uint32_t *cand, uint32_t cnt, int shift, uint32_t bits, uint32_t *need) {
        uint32_t hist[HIST_BUCKETS] = { 0 }, mask = (1u << bits) - 1;
        for (uint32_t j = 0; j < cnt; j++)
                hist[(float_key(score[cand[j]]) >> shift) & mask]++;
        uint32_t digit = find_bucket(hist, mask + 1, need), m = 0;
        for (uint32_t j = 0; j < cnt; j++) {
                uint32_t i = cand[j];
                cand[m] = i;
                m += ((float_key(score[i]) >> shift) & mask) == digit;
        }
        return m;
}

void select_topk(const float *score, uint32_t n, uint32_t k, uint32_t *out, uint32_t *scratch) {
        if (k >= n) {
                for (uint32_t i = 0; i < n; i++)
                        out[i] = i;
                return;
        }
        if (k == 0)
                return;

        /* two histograms, even and odd indices: neighbours in one bucket do not wait on each
         * other's increment */
        uint32_t hist[HIST_BUCKETS] = { 0 }, hist2[HIST_BUCKETS] = { 0 }, need = k, i = 0;
        for (; i + 1 < n; i += 2) {
                hist[float_key(score[i]) >> DIGIT1_SHIFT]++;
                hist2[float_key(score[i + 1]) >> DIGIT1_SHIFT]++;
        }
        if (i < n)
                hist[float_key(score[i]) >> DIGIT1_SHIFT]++;
        for (uint32_t b = 0; b < HIST_BUCKETS; b++)
                hist[b] += hist2[b];
        uint32_t top = find_bucket(hist, HIST_BUCKETS, &need);

        /* the candidates: indices in the threshold's top bucket, ascending */
        uint32_t *cand = scratch, cnt = 0;
        for (i = 0; i < n; i++) {
                cand[cnt] = i;
                cnt += (float_key(score[i]) >> DIGIT1_SHIFT) == top;
        }
        cnt = narrow(score, cand, cnt, DIGIT2_SHIFT, 11, &need);
        cnt = narrow(score, cand, cnt, 0, 10, &need);

        /* cand[0..cnt) hold the threshold key exactly; the last `need` of them are kept */
        uint32_t threshold = float_key(score[cand[0]]), tie_from = cand[cnt - need];
        /* Branch-free: out[m] is written for every index but kept only when m advances. While
         * m < k a later index is still to be kept and overwrites it, so nothing lands past
         * out[k - 1]; and the loop ends with the k-th. Key and index compare as one word. */
        uint64_t from = (uint64_t)threshold << 32 | tie_from;
        i = 0;
        for (uint32_t m = 0; m < k; i++) {
                out[m] = i;
                m += ((uint64_t)float_key(score[i]) << 32 | i) >= from;
        }
}
