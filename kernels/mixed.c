/* mixed.c: compaction, quantization and decode attention over a mixed INT8 / full-precision layer
 * (the contracts are in mixed.h). Plain loops: this is the oracle the CUDA kernels are tested
 * against, and the path a machine without a GPU runs.
 *
 * Compaction in place, sequentially. New slot i takes old slot src(i), and src is strictly
 * increasing with src(i) >= i (keep is strictly ascending, so keep[i] >= i; the tail starts at
 * base_tokens >= keep_count). The sources of the INT8 destinations come first in that order, and
 * every kept INT8 token is among them (new_q8 >= their count), so the full-precision destinations
 * read full-precision sources only. Two phases, INT8 destinations first:
 *
 * 1. INT8 destination blocks in ascending order d = 0, 1, ...: block d takes new slots
 *    [dT, dT + T), whose sources are >= dT, so they sit in Q8 blocks >= d or in fp blocks. All of
 *    block d's sources are gathered into scratch (keys dequantized to floats, value codes and
 *    scales, side words) before block d is written, so block d may be one of its own sources.
 *    A later destination block d' > d reads sources >= d'T >= (d + 1)T: never block d. Phase 1
 *    writes only Q8 blocks, so the fp sources are intact until phase 2.
 * 2. Full-precision destinations in ascending order: destination fp index j (new slot new_q8 + j)
 *    reads fp index f(j) = src(new_q8 + j) - n_q8. f is strictly increasing and f(0) >= 0, hence
 *    f(j) >= j: a destination never writes a slot a later destination still has to read (the
 *    sequential argument of compact.c). This holds whatever new_q8 is relative to n_q8; when
 *    new_q8 >= n_q8 it is also immediate, since f(j) >= new_q8 + j - n_q8 >= j.
 *
 * Requantization: a Q8 destination block gets key scales computed over exactly the tokens it
 * will hold, from their values as floats (INT8 sources dequantized with their own block's scales),
 * and every key is quantized with them. A token with an outlier moving into a block of small
 * values makes the scale grow: nothing clips. Values move as codes plus their per-token scale,
 * exactly; a full-precision value landing in INT8 is quantized with its own fresh scale.
 *
 * Attention: a chunked online softmax (the FlashAttention recurrence), one block per chunk, per
 * query head a running maximum m, normalizer l and output accumulator:
 *   m' = max(m, max_j s_j);  alpha = exp(m - m');  l' = alpha l + sum_j exp(s_j - m');
 *   acc' = alpha acc + sum_j exp(s_j - m') v_j;  out = acc / l at the end.
 * Each chunk's weighted values are summed in a chunk accumulator first and then added, so the
 * rounding error grows with T + n / T rather than n. The query heads of one KV head are done
 * together, so each key and value is read (and dequantized) once per KV head. The logits are kept
 * in scratch during the pass; the score side output needs the final m and l, so a second cheap pass
 * over those logits gives a_j = exp(s_j - m) / l without touching the keys again.
 */
#include "mixed.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <string.h>

#include "attention.h"
#include "compact.h"
#include "quant.h"

enum { SIDE_ARRAYS = BLOCK_SIDE_ARRAYS };

static uint32_t div_up(uint32_t a, uint32_t b) {
        return (uint32_t)(((uint64_t)a + b - 1) / b);
}

int mixed_layer_check(const struct mixed_layer *M) {
        const struct block_layout *f = M->fp, *q = M->q8;

        if (!f || !q || q->dtype != BLOCK_DTYPE_Q8 || f->dtype == BLOCK_DTYPE_Q8 ||
            !block_dtype_bytes(f->dtype))
                return -EINVAL;
        if (f->block_tokens != q->block_tokens || f->n_kv_heads != q->n_kv_heads ||
            f->head_dim != q->head_dim)
                return -EINVAL;
        uint64_t T = q->block_tokens;
        if (M->n_q8 > M->n_tokens || M->n_q8 > M->n_q8_blocks * T ||
            M->n_tokens - M->n_q8 > M->n_fp_blocks * T)
                return -EINVAL;
        if ((M->n_q8_blocks && !M->q8_blocks) || (M->n_fp_blocks && !M->fp_blocks))
                return -EINVAL;
        if (M->n_shared && (!M->shared_mask || (uint64_t)M->mask_stride * 8 < M->n_shared ||
                            M->n_shared > M->n_tokens || M->n_q8))
                return -EINVAL; /* a shared prefix is full precision, and its mask covers it */
        return 0;
}

/* ---- compaction ---- */

/* The scratch of one destination block of one head. */
struct gather {
        float *keys;   /* [T][D] */
        float *vs;     /* [T] */
        float *row;    /* [D] */
        uint8_t *side; /* [T][SIDE_ARRAYS] 4-byte words */
        int8_t *vq;    /* [T][D] */
};

size_t compact_mixed_scratch_floats(const struct mixed_layer *M) {
        uint64_t T = M->q8->block_tokens, D = M->q8->head_dim;
        return (size_t)(T * D + T + D + SIDE_ARRAYS * T + (T * D + 3) / 4);
}

static struct gather gather_carve(const struct mixed_layer *M, float *scratch) {
        uint64_t T = M->q8->block_tokens, D = M->q8->head_dim;
        struct gather g;
        g.keys = scratch;
        g.vs = g.keys + T * D;
        g.row = g.vs + T;
        g.side = (uint8_t *)(g.row + D);
        g.vq = (int8_t *)(g.row + D + SIDE_ARRAYS * T);
        return g;
}

static uint32_t source_of(const uint32_t *keep, uint32_t kc, uint32_t base, uint32_t i) {
        return i < kc ? keep[i] : base + (i - kc);
}

/* How many of the new slots have INT8 sources (they are the first ones). */
static uint32_t int8_source_count(const uint32_t *keep, uint32_t kc, uint32_t base, uint32_t n_q8) {
        uint32_t c = 0;
        while (c < kc && keep[c] < n_q8)
                c++;
        return c + (base < n_q8 ? n_q8 - base : 0);
}

struct compaction {
        const struct mixed_layer *M;
        const uint32_t *keep; /* this head's */
        uint32_t kc, base, new_q8, new_len;
        struct gather g;
        uint64_t q8_side[SIDE_ARRAYS], fp_side[SIDE_ARRAYS];
};

/* Phase 1 for destination Q8 block d of head h: gather, then requantize into the block. */
static void compact_q8_block(const struct compaction *C, uint32_t h, uint32_t d) {
        const struct mixed_layer *M = C->M;
        const struct block_layout *lq = M->q8, *lf = M->fp;
        uint32_t T = lq->block_tokens, D = lq->head_dim, first = d * T;
        uint32_t cnt = C->new_q8 - first < T ? C->new_q8 - first : T;
        const struct gather *g = &C->g;

        /* the same tokens in the same slots, and no others: nothing to do */
        uint32_t old_live = M->n_q8 > first ? (M->n_q8 - first < T ? M->n_q8 - first : T) : 0;
        if (old_live == cnt && source_of(C->keep, C->kc, C->base, first) == first &&
            source_of(C->keep, C->kc, C->base, first + cnt - 1) == first + cnt - 1)
                return;

        for (uint32_t t = 0; t < cnt; t++) {
                uint32_t s = source_of(C->keep, C->kc, C->base, first + t);
                float *k = g->keys + (uint64_t)t * D;
                int8_t *vq = g->vq + (uint64_t)t * D;
                uint8_t *side = g->side + (uint64_t)t * SIDE_ARRAYS * 4;
                if (s < M->n_q8) {
                        uint8_t *b = M->q8_blocks[s / T];
                        quant_block_load_key(lq, b, h, s % T, k);
                        memcpy(vq, block_value(lq, b, h, s % T), D);
                        g->vs[t] = *block_vscale(lq, b, h, s % T);
                        for (int a = 0; a < SIDE_ARRAYS; a++)
                                memcpy(side + 4 * a, block_side(lq, b, C->q8_side[a], h, s % T), 4);
                } else {
                        uint32_t f = s - M->n_q8;
                        uint8_t *b = M->fp_blocks[f / T];
                        block_load_row(lf->dtype, block_key(lf, b, h, f % T), k, D);
                        block_load_row(lf->dtype, block_value(lf, b, h, f % T), g->row, D);
                        g->vs[t] = quant_scale(g->row, D);
                        quant_encode_row(g->row, g->vs[t], vq, D);
                        for (int a = 0; a < SIDE_ARRAYS; a++)
                                memcpy(side + 4 * a, block_side(lf, b, C->fp_side[a], h, f % T), 4);
                }
        }

        uint8_t *db = M->q8_blocks[d];
        float *ks = block_kscale(lq, db, h);
        quant_channel_scales(g->keys, cnt, D, ks);
        for (uint32_t t = 0; t < cnt; t++) {
                quant_encode_row_channels(g->keys + (uint64_t)t * D, ks, (int8_t *)block_key(lq, db, h, t),
                                          D);
                memcpy(block_value(lq, db, h, t), g->vq + (uint64_t)t * D, D);
                *block_vscale(lq, db, h, t) = g->vs[t];
                for (int a = 0; a < SIDE_ARRAYS; a++)
                        memcpy(block_side(lq, db, C->q8_side[a], h, t),
                               g->side + ((uint64_t)t * SIDE_ARRAYS + a) * 4, 4);
        }
}

/* Moves len consecutive fp slots of head h from fp index src to fp index dst (dst <= src), each
 * run inside one block on both sides; memmove, since a run may overlap itself. */
static void move_fp_run(const struct compaction *C, uint32_t h, uint32_t src, uint32_t dst, uint32_t len) {
        const struct block_layout *l = C->M->fp;
        uint32_t T = l->block_tokens;
        uint8_t *sb = C->M->fp_blocks[src / T], *db = C->M->fp_blocks[dst / T];
        uint32_t ss = src % T, ds = dst % T;

        memmove(block_key(l, db, h, ds), block_key(l, sb, h, ss), len * l->row_bytes);
        memmove(block_value(l, db, h, ds), block_value(l, sb, h, ss), len * l->row_bytes);
        for (int a = 0; a < SIDE_ARRAYS; a++)
                memmove(block_side(l, db, C->fp_side[a], h, ds), block_side(l, sb, C->fp_side[a], h, ss),
                        (size_t)len * 4u);
}

/* Phase 2 for head h: the full-precision destinations, run by run. */
static void compact_fp_part(const struct compaction *C, uint32_t h) {
        uint32_t T = C->M->fp->block_tokens, n_q8 = C->M->n_q8;
        uint32_t n_fp = C->new_len - C->new_q8, j = 0;

        while (j < n_fp) {
                uint32_t f = source_of(C->keep, C->kc, C->base, C->new_q8 + j) - n_q8;
                uint32_t room = T - (f % T) < T - (j % T) ? T - (f % T) : T - (j % T);
                uint32_t len = 1;
                while (len < room && j + len < n_fp &&
                       source_of(C->keep, C->kc, C->base, C->new_q8 + j + len) - n_q8 == f + len)
                        len++;
                if (f != j)
                        move_fp_run(C, h, f, j, len);
                j += len;
        }
}

int compact_mixed(const struct mixed_layer *M, const uint32_t *keep, uint32_t keep_count, int per_head,
                  uint32_t base_tokens, uint32_t new_q8, float *scratch, uint32_t *ret_n_tokens) {
        if (mixed_layer_check(M) < 0 || base_tokens > M->n_tokens || !scratch || (keep_count && !keep))
                return -EINVAL;
        uint32_t H = M->q8->n_kv_heads, T = M->q8->block_tokens;
        for (uint32_t h = 0; h < (per_head ? H : 1u); h++) {
                const uint32_t *kh = keep ? keep + (uint64_t)h * keep_count : NULL;
                if (compact_check_keep(kh, keep_count, base_tokens) < 0)
                        return -EINVAL;
                if (int8_source_count(kh, keep_count, base_tokens, M->n_q8) > new_q8)
                        return -EINVAL;
        }
        /* a valid keep-set has keep_count <= base_tokens */
        uint32_t new_len = keep_count + (M->n_tokens - base_tokens);
        if (new_q8 > new_len || div_up(new_q8, T) > M->n_q8_blocks ||
            div_up(new_len - new_q8, T) > M->n_fp_blocks)
                return -EINVAL;

        struct compaction C = {
                .M = M,
                .kc = keep_count,
                .base = base_tokens,
                .new_q8 = new_q8,
                .new_len = new_len,
                .g = gather_carve(M, scratch),
        };
        block_side_offsets(M->q8, C.q8_side);
        block_side_offsets(M->fp, C.fp_side);
        for (uint32_t h = 0; h < H; h++) {
                C.keep = keep && per_head ? keep + (uint64_t)h * keep_count : keep;
                for (uint32_t d = 0; d < div_up(new_q8, T); d++)
                        compact_q8_block(&C, h, d);
                compact_fp_part(&C, h);
        }
        *ret_n_tokens = new_len;
        return 0;
}

int mixed_advance_q8(const struct mixed_layer *M, uint32_t new_q8, float *scratch) {
        uint32_t n;
        if (mixed_layer_check(M) < 0 || new_q8 < M->n_q8 || new_q8 > M->n_tokens)
                return -EINVAL;
        /* keep nothing of a zero-length prefix: every slot is "tail", so new slot i is old slot i */
        return compact_mixed(M, NULL, 0, 0, 0, new_q8, scratch, &n);
}

/* ---- attention ---- */

size_t attn_mixed_scratch_floats(const struct mixed_layer *M, uint32_t n_heads) {
        uint32_t H = M->q8->n_kv_heads;
        if (!H || n_heads % H)
                return 0;
        uint64_t group = n_heads / H, D = M->q8->head_dim, T = M->q8->block_tokens;
        return (size_t)(group * ((uint64_t)M->n_tokens + 2 * D + T + 2));
}

/* One chunk: a block's live slots [0, cnt), slot0 its first slot in the sequence. */
struct chunk {
        uint8_t *block;
        int q8;
        uint32_t slot0, cnt;
};

struct attention {
        const struct mixed_layer *M;
        const float *q; /* [n_heads][D] */
        float *out;
        uint32_t group, g;
        float *logits; /* [group][n] */
        float *qk;     /* [group][D] */
        float *cacc;   /* [group][D] */
        float *p;      /* [group][T] */
        float *m, *l;  /* [group] */
};

static void attend_chunk(const struct attention *A, const struct chunk *ch) {
        const struct mixed_layer *M = A->M;
        const struct block_layout *l = ch->q8 ? M->q8 : M->fp;
        uint32_t D = l->head_dim, T = l->block_tokens, n = M->n_tokens, g = A->g, group = A->group;
        double scale = sqrt((double)D);
        float row[ATTN_MAX_HEAD_DIM];

        if (ch->q8) { /* fused dequantization: fold the key scales into the query */
                const float *ks = block_kscale(l, ch->block, g);
                for (uint32_t r = 0; r < group; r++)
                        for (uint32_t c = 0; c < D; c++)
                                A->qk[(uint64_t)r * D + c] = A->q[((uint64_t)g * group + r) * D + c] * ks[c];
        }
        for (uint32_t t = 0; t < ch->cnt; t++) {
                float logw = *(const float *)block_side(l, ch->block, l->logw_offset, g, t);
                uint32_t j = ch->slot0 + t;
                if (j < A->M->n_shared &&
                    (A->M->shared_mask[(uint64_t)g * A->M->mask_stride + j / 8] >> (j % 8) & 1))
                        logw = -INFINITY; /* evicted by this session, kept for the others */
                const int8_t *kq = (const int8_t *)block_key(l, ch->block, g, t);
                if (!ch->q8)
                        block_load_row(l->dtype, block_key(l, ch->block, g, t), row, D);
                for (uint32_t r = 0; r < group; r++) {
                        /* double accumulation: a logit's float rounding error grows with
                         * sum |q_c k_c|, and outlier channels make that large */
                        double dot = 0.0;
                        float s;
                        if (ch->q8) {
                                const float *qk = A->qk + (uint64_t)r * D;
                                for (uint32_t c = 0; c < D; c++)
                                        dot += (double)qk[c] * kq[c];
                        } else {
                                const float *qh = A->q + ((uint64_t)g * group + r) * D;
                                for (uint32_t c = 0; c < D; c++)
                                        dot += (double)qh[c] * row[c];
                        }
                        if (isinf(logw) && logw < 0) {
                                s = -INFINITY;
                        } else {
                                s = (float)(dot / scale + logw);
                                s = s < FLT_MAX ? s : FLT_MAX; /* +inf and NaN: the largest finite logit */
                        }
                        A->logits[(uint64_t)r * n + ch->slot0 + t] = s;
                }
        }

        /* the online softmax update, per query head */
        for (uint32_t r = 0; r < group; r++) {
                const float *s = A->logits + (uint64_t)r * n + ch->slot0;
                float *p = A->p + (uint64_t)r * T, *oh = A->out + ((uint64_t)g * group + r) * D;
                float cmax = -INFINITY, m_new, psum = 0.0f;
                for (uint32_t t = 0; t < ch->cnt; t++)
                        if (s[t] > cmax)
                                cmax = s[t];
                m_new = cmax > A->m[r] ? cmax : A->m[r];
                if (isinf(m_new)) { /* everything so far masked */
                        memset(p, 0, ch->cnt * sizeof(*p));
                        continue;
                }
                float alpha = expf(A->m[r] - m_new);
                for (uint32_t t = 0; t < ch->cnt; t++) {
                        p[t] = expf(s[t] - m_new);
                        psum += p[t];
                        if (ch->q8)
                                p[t] *= *block_vscale(l, ch->block, g, t);
                }
                A->l[r] = A->l[r] * alpha + psum;
                A->m[r] = m_new;
                if (alpha != 1.0f)
                        for (uint32_t c = 0; c < D; c++)
                                oh[c] *= alpha;
        }

        memset(A->cacc, 0, (size_t)group * D * sizeof(float));
        for (uint32_t t = 0; t < ch->cnt; t++) {
                const int8_t *vq = (const int8_t *)block_value(l, ch->block, g, t);
                if (ch->q8)
                        for (uint32_t c = 0; c < D; c++)
                                row[c] = (float)vq[c];
                else
                        block_load_row(l->dtype, block_value(l, ch->block, g, t), row, D);
                for (uint32_t r = 0; r < group; r++) {
                        float w = A->p[(uint64_t)r * T + t], *acc = A->cacc + (uint64_t)r * D;
                        if (w == 0.0f)
                                continue; /* masked or underflowed: adds exact zeros */
                        for (uint32_t c = 0; c < D; c++)
                                acc[c] += w * row[c];
                }
        }
        for (uint32_t r = 0; r < group; r++) {
                float *oh = A->out + ((uint64_t)g * group + r) * D, *acc = A->cacc + (uint64_t)r * D;
                for (uint32_t c = 0; c < D; c++)
                        oh[c] += acc[c];
        }
}

int attn_decode_mixed(const struct mixed_layer *M, const float *q, float *out, uint32_t n_heads,
                      float ema_gamma, int update_scores, float *scratch) {
        if (mixed_layer_check(M) < 0 || M->n_tokens == 0 || !scratch)
                return -EINVAL;
        const struct block_layout *lq = M->q8, *lf = M->fp;
        uint32_t H = lq->n_kv_heads, D = lq->head_dim, T = lq->block_tokens, n = M->n_tokens;
        if (n_heads == 0 || n_heads % H || D > ATTN_MAX_HEAD_DIM)
                return -EINVAL;

        struct attention A = { .M = M, .q = q, .out = out, .group = n_heads / H };
        A.logits = scratch;
        A.qk = A.logits + (uint64_t)A.group * n;
        A.cacc = A.qk + (uint64_t)A.group * D;
        A.p = A.cacc + (uint64_t)A.group * D;
        A.m = A.p + (uint64_t)A.group * T;
        A.l = A.m + A.group;

        memset(out, 0, (size_t)n_heads * D * sizeof(float));
        for (A.g = 0; A.g < H; A.g++) {
                for (uint32_t r = 0; r < A.group; r++) {
                        A.m[r] = -INFINITY;
                        A.l[r] = 0.0f;
                }
                for (uint32_t b = 0; b < div_up(M->n_q8, T); b++) {
                        uint32_t left = M->n_q8 - b * T;
                        struct chunk ch = { M->q8_blocks[b], 1, b * T, left < T ? left : T };
                        attend_chunk(&A, &ch);
                }
                for (uint32_t b = 0; b < div_up(n - M->n_q8, T); b++) {
                        uint32_t left = n - M->n_q8 - b * T;
                        struct chunk ch = { M->fp_blocks[b], 0, M->n_q8 + b * T, left < T ? left : T };
                        attend_chunk(&A, &ch);
                }
                for (uint32_t r = 0; r < A.group; r++) {
                        float *oh = out + ((uint64_t)A.g * A.group + r) * D;
                        if (A.l[r] > 0.0f)
                                for (uint32_t c = 0; c < D; c++)
                                        oh[c] /= A.l[r];
                }
                if (!update_scores)
                        continue;
                /* the second pass: the final weights from the stored logits (not into shared slots) */
                for (uint32_t j = M->n_shared; j < n; j++) {
                        const struct block_layout *l = j < M->n_q8 ? lq : lf;
                        uint32_t s = j < M->n_q8 ? j : j - M->n_q8;
                        uint8_t *b = j < M->n_q8 ? M->q8_blocks[s / T] : M->fp_blocks[s / T];
                        float a = 0.0f;
                        for (uint32_t r = 0; r < A.group; r++)
                                if (A.l[r] > 0.0f)
                                        a += expf(A.logits[(uint64_t)r * n + j] - A.m[r]) / A.l[r];
                        a /= (float)A.group;
                        float *sum = block_side(l, b, l->sum_offset, A.g, s % T);
                        float *ema = block_side(l, b, l->ema_offset, A.g, s % T);
                        float *last = block_side(l, b, l->last_offset, A.g, s % T);
                        *sum += a;
                        *ema = ema_gamma * *ema + (1.0f - ema_gamma) * a;
                        *last = a;
                }
        }
        return 0;
}
