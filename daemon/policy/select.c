/* select.c: linear-time top-k selection by radix select on the float bits.
 *
 * Why radix and not quickselect: scores are written by clients, and a client could craft an
 * order that makes a quickselect quadratic and stall the daemon. A radix select over an
 * order-preserving integer key finds the k-th largest value exactly in O(n), always.
 *
 * How, digit by digit from the top of the key:
 *   1. one pass over the scores counts the top digit of every key;
 *   2. one pass gathers the indices whose top digit is the threshold's into scratch (ascending);
 *      the next digits are found on those candidates only, each pass narrowing them in place,
 *      so for ordinary scores the later digits cost next to nothing;
 *   3. the candidates left are exactly the indices whose key equals the threshold, ascending, so
 *      the ties to keep (the most recent ones) are their tail, found without another pass (and
 *      when the digits so far leave exactly as many candidates as are still needed, the rest
 *      of the digits are skipped: all of them are kept);
 *   4. one pass writes the keep-set, without branches.
 * Three passes over n in all (the code before made seven: a key array, four histograms over all
 * of it, a tie scan and the output). Worst case (all keys in one bucket) two more per further
 * digit, still linear. Long rows use digits of 11, 11 and 10 bits (few candidates survive the first);
 * short ones (kvcd's usual: a budget plus a block) 8-bit digits, whose 256-entry histograms cost
 * less to clear and scan than the rows themselves. Measured in bench/RESULTS.md (item 2).
 */
#include <string.h>

#include "policy.h"

#define WIDE_FROM   1024u /* rows at least this long use the wide digits */
#define MAX_BUCKETS 2048u

static const uint8_t wide_shifts[] = { 21, 10, 0 };     /* 11, 11, 10 bits */
static const uint8_t short_shifts[] = { 24, 16, 8, 0 }; /* 8 bits each */

/* An unsigned key with the same order as the float: NaN gets the key of -inf (the contract ranks
 * them equal), and -0 the key of +0 (equal floats tie). Integer selects only, no branches: the
 * compiler turns them into conditional moves, and every pass calls this. */
static inline uint32_t float_key(float f) {
        uint32_t b;
        memcpy(&b, &f, sizeof(b));
        b = (b & 0x7fffffffu) > 0x7f800000u ? 0xff800000u : b; /* NaN: -inf */
        b = b == 0x80000000u ? 0u : b;                         /* -0: +0 */
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
 * whose `bits` bits at shift are the digit holding the need-th largest; returns the new count. */
static uint32_t narrow(const float *score, uint32_t *cand, uint32_t cnt, uint32_t shift, uint32_t bits,
                       uint32_t *need) {
        uint32_t hist[MAX_BUCKETS], mask = (1u << bits) - 1;
        memset(hist, 0, (mask + 1) * sizeof(hist[0]));
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

        const uint8_t *shift = n >= WIDE_FROM ? wide_shifts : short_shifts;
        uint32_t levels = n >= WIDE_FROM ? sizeof(wide_shifts) : sizeof(short_shifts);
        uint32_t top_buckets = 1u << (32 - shift[0]), hist[MAX_BUCKETS], need = k, i;
        memset(hist, 0, top_buckets * sizeof(hist[0]));
        for (i = 0; i < n; i++)
                hist[float_key(score[i]) >> shift[0]]++;
        uint32_t top = find_bucket(hist, top_buckets, &need);

        /* the candidates: indices in the threshold's top bucket, ascending */
        uint32_t *cand = scratch, cnt = 0;
        for (i = 0; i < n; i++) {
                cand[cnt] = i;
                cnt += (float_key(score[i]) >> shift[0]) == top;
        }
        for (uint32_t l = 1; l < levels && cnt > need; l++)
                cnt = narrow(score, cand, cnt, shift[l], shift[l - 1] - shift[l], &need);

        /* Kept: the indices whose (key, index) is at least `from`, the need-th largest among the
         * candidates. With every digit found, the candidates all hold the threshold key and the
         * last `need` of them are kept (ties go to the more recent); when the digits so far
         * left exactly `need`, every candidate is kept and `from` is the least of them. */
        uint64_t from = (uint64_t)float_key(score[cand[0]]) << 32 | cand[cnt - need];
        for (uint32_t j = 0; cnt == need && j < cnt; j++) {
                uint64_t c = (uint64_t)float_key(score[cand[j]]) << 32 | cand[j];
                from = c < from ? c : from;
        }
        /* Branch-free: out[m] is written for every index but kept only when m advances. While
         * m < k a later index is still to be kept and overwrites it, so nothing lands past
         * out[k - 1]; and the loop ends with the k-th. Key and index compare as one word. */
        i = 0;
        for (uint32_t m = 0; m < k; i++) {
                out[m] = i;
                m += ((uint64_t)float_key(score[i]) << 32 | i) >= from;
        }
}
