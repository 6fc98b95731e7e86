/* ladder.c: compaction, demotion, attention and reading of a layer of several tiers (the contracts
 * are in ladder.h). Plain loops over tier.h's rows: the oracle of the fast kernels.
 *
 * Compaction in place. Destination tiers are written lowest first (n_tiers - 1 down to 0). A
 * destination tier t takes its tokens from tier t and from more precise tiers u < t (precision
 * only goes down); the more precise tiers are written after t, so they are intact when t reads
 * them. Within tier t the sources from tier t come first (tier t precedes every more precise tier
 * in the logical order and the kept slots are ascending), so the j-th of them has in-tier index
 * >= j: a quantized destination block d gathers all its sources (in-tier index >= dT: blocks >= d)
 * into scratch before writing itself, and a later block d' > d reads in-tier indices >= d'T,
 * never block d. Tier 0 (full precision) moves its rows in runs, destination index <= source
 * index, each run a memmove: the sequential argument of compact.c.
 *
 * Attention: mixed.c's chunked online softmax, one block per chunk, with the tier's row doing the
 * two inner loops. Rotated tiers are summed into a second accumulator in the rotated basis, with
 * the same rescalings, and it is rotated back and added once per query head at the end.
 */
#include "ladder.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <string.h>

#include "attention.h"
#include "compact.h"
#include "lloyd.h"
#include "tier.h"

enum { SIDE_ARRAYS = BLOCK_SIDE_ARRAYS };

static uint32_t div_up(uint32_t a, uint32_t b) {
        return (uint32_t)(((uint64_t)a + b - 1) / b);
}

uint32_t ladder_tokens(const struct ladder_layer *M) {
        uint32_t n = 0;
        for (uint32_t t = 0; t < M->n_tiers; t++)
                n += M->n[t];
        return n;
}

static uint32_t first_slot(const struct ladder_layer *M, uint32_t t) {
        uint32_t f = 0;
        for (uint32_t u = t + 1; u < M->n_tiers; u++)
                f += M->n[u];
        return f;
}

void ladder_locate(const struct ladder_layer *M, uint32_t s, uint32_t *ret_tier, uint32_t *ret_index) {
        uint32_t t = M->n_tiers - 1;
        while (t > 0 && s >= M->n[t]) {
                s -= M->n[t];
                t--;
        }
        *ret_tier = t;
        *ret_index = s;
}

int ladder_check(const struct ladder_layer *M) {
        if (!M || M->n_tiers == 0 || M->n_tiers > LADDER_TIERS)
                return -EINVAL;
        const struct block_layout *l0 = M->layout[0];
        if (!l0 || block_dtype_quantized(l0->dtype) || !tier_row(l0->dtype))
                return -EINVAL;
        uint64_t total = 0;
        int rotated = 0;
        for (uint32_t t = 0; t < M->n_tiers; t++) {
                const struct block_layout *l = M->layout[t];
                const struct tier_row *row = l ? tier_row(l->dtype) : NULL;
                if (!row || l->block_tokens != l0->block_tokens || l->n_kv_heads != l0->n_kv_heads ||
                    l->head_dim != l0->head_dim)
                        return -EINVAL;
                if (t > 0 && (!row->quantized ||
                              block_dtype_bits(l->dtype) >= block_dtype_bits(M->layout[t - 1]->dtype) ||
                              (rotated && !row->rotated)))
                        return -EINVAL;
                rotated |= row->rotated;
                if ((uint64_t)M->n[t] > (uint64_t)M->n_blocks[t] * l->block_tokens ||
                    (M->n_blocks[t] && !M->blocks[t]))
                        return -EINVAL;
                total += M->n[t];
        }
        if (total > UINT32_MAX || (rotated && !M->signs) || l0->head_dim > ATTN_MAX_HEAD_DIM)
                return -EINVAL;
        if (M->n_shared) {
                if (!M->shared_mask || (uint64_t)M->mask_stride * 8 < M->n_shared || M->n_shared > M->n[0])
                        return -EINVAL;
                for (uint32_t t = 1; t < M->n_tiers; t++)
                        if (M->n[t])
                                return -EINVAL; /* a shared prefix is full precision */
        }
        return 0;
}

/* ---- compaction ---- */

/* The scratch of one destination block of one head. */
struct gather {
        float *keys, *values; /* [T][D], in the destination's basis */
        float *row;           /* [D] */
        uint32_t *side;       /* [T][SIDE_ARRAYS] */
        uint8_t *kraw, *vraw; /* [T][row_bytes]: a same-tier source's bytes */
        float *kscale, *vscale;
        uint32_t *same; /* [T]: bit 0 value bytes valid, bit 1 key bytes valid */
};

size_t ladder_compact_scratch_floats(const struct ladder_layer *M) {
        uint64_t T = M->layout[0]->block_tokens, D = M->layout[0]->head_dim;
        return (size_t)(2 * T * D + D + SIDE_ARRAYS * T + 2 * (T * D / 4 + 1) + 3 * T);
}

static struct gather gather_carve(const struct ladder_layer *M, float *scratch) {
        uint64_t T = M->layout[0]->block_tokens, D = M->layout[0]->head_dim;
        struct gather g;
        g.keys = scratch;
        g.values = g.keys + T * D;
        g.row = g.values + T * D;
        g.side = (uint32_t *)(g.row + D);
        g.kraw = (uint8_t *)(g.side + SIDE_ARRAYS * T);
        g.vraw = g.kraw + 4 * (T * D / 4 + 1); /* rows of quantized tiers: at most D bytes */
        g.kscale = (float *)(g.vraw + 4 * (T * D / 4 + 1));
        g.vscale = g.kscale + T;
        g.same = (uint32_t *)(g.vscale + T);
        return g;
}

struct compaction {
        const struct ladder_layer *M;
        const uint32_t *keep; /* this head's */
        const uint8_t *tier;  /* this head's, or NULL */
        uint32_t kc, base, n_old;
        uint32_t first[LADDER_TIERS]; /* the old first logical slot of each tier */
        struct gather g;
};

static uint32_t old_tier(const struct compaction *C, uint32_t s) {
        uint32_t t = C->M->n_tiers - 1;
        while (t > 0 && s >= C->first[t] + C->M->n[t])
                t--;
        return t;
}

static uint32_t new_tier(const struct compaction *C, uint32_t i) {
        return C->tier ? C->tier[i] : old_tier(C, C->keep[i]);
}

/* Walks the sources of destination tier t in order: keep entries of tier t, then (t = 0) the tail. */
struct cursor {
        uint32_t i;    /* next keep entry to look at */
        uint32_t tail; /* next tail slot */
};

static uint32_t cursor_next(const struct compaction *C, uint32_t t, struct cursor *k) {
        while (k->i < C->kc) {
                uint32_t i = k->i++;
                if (new_tier(C, i) == t)
                        return C->keep[i];
        }
        return k->tail++; /* only reached for t == 0 */
}

/* Gathers source slot s of head h into entry e of the scratch, converted to tier t's basis. */
static void gather_one(const struct compaction *C, uint32_t h, uint32_t t, uint32_t s, uint32_t e) {
        const struct ladder_layer *M = C->M;
        uint32_t u = old_tier(C, s), idx = s - C->first[u], T = M->layout[u]->block_tokens;
        uint32_t D = M->layout[u]->head_dim;
        const struct block_layout *lu = M->layout[u];
        const struct tier_row *ru = tier_row(lu->dtype), *rt = tier_row(M->layout[t]->dtype);
        uint8_t *b = M->blocks[u][idx / T];
        const struct gather *g = &C->g;
        float *k = g->keys + (uint64_t)e * D, *v = g->values + (uint64_t)e * D;
        uint64_t off[SIDE_ARRAYS];

        ru->load_key(lu, b, h, idx % T, k);
        ru->load_value(lu, b, h, idx % T, v);
        if (rt->rotated && !ru->rotated) {
                lloyd_rotate(M->signs + (uint64_t)h * D, k, D);
                lloyd_rotate(M->signs + (uint64_t)h * D, v, D);
        }
        g->same[e] = 0;
        if (u == t && rt->quantized) {
                uint64_t rb = lu->row_bytes;
                memcpy(g->vraw + e * rb, block_value(lu, b, h, idx % T), rb);
                g->vscale[e] = *block_vscale(lu, b, h, idx % T);
                g->same[e] = 1;
                if (!rt->key_block_scales) {
                        memcpy(g->kraw + e * rb, block_key(lu, b, h, idx % T), rb);
                        g->kscale[e] = *block_kscale_row(lu, b, h, idx % T);
                        g->same[e] |= 2;
                }
        }
        block_side_offsets(lu, off);
        for (int a = 0; a < SIDE_ARRAYS; a++)
                memcpy(&g->side[(uint64_t)e * SIDE_ARRAYS + a], block_side(lu, b, off[a], h, idx % T), 4);
}

/* Writes the cnt gathered tokens into block d of quantized tier t, head h. */
static void write_block(const struct compaction *C, uint32_t h, uint32_t t, uint32_t d, uint32_t cnt) {
        const struct block_layout *l = C->M->layout[t];
        const struct tier_row *row = tier_row(l->dtype);
        const struct gather *g = &C->g;
        uint8_t *db = C->M->blocks[t][d];
        uint64_t off[SIDE_ARRAYS], rb = l->row_bytes;

        (void)row->fill_head(l, db, h, g->keys, g->values, cnt); /* non-finite rows are stored as zeros */
        block_side_offsets(l, off);
        for (uint32_t e = 0; e < cnt; e++) {
                if (g->same[e] & 1) {
                        memcpy(block_value(l, db, h, e), g->vraw + e * rb, rb);
                        *block_vscale(l, db, h, e) = g->vscale[e];
                }
                if (g->same[e] & 2) {
                        memcpy(block_key(l, db, h, e), g->kraw + e * rb, rb);
                        *block_kscale_row(l, db, h, e) = g->kscale[e];
                }
                for (int a = 0; a < SIDE_ARRAYS; a++)
                        memcpy(block_side(l, db, off[a], h, e), &g->side[(uint64_t)e * SIDE_ARRAYS + a], 4);
        }
}

/* Destination tier t (quantized) of head h: block by block. */
static void compact_quantized(const struct compaction *C, uint32_t h, uint32_t t, uint32_t count) {
        uint32_t T = C->M->layout[t]->block_tokens;
        struct cursor k = { 0, C->base };
        for (uint32_t d = 0; d < div_up(count, T); d++) {
                uint32_t cnt = count - d * T < T ? count - d * T : T, unchanged = 1;
                uint32_t old_live =
                        C->M->n[t] > d * T ? (C->M->n[t] - d * T < T ? C->M->n[t] - d * T : T) : 0;
                struct cursor probe = k;
                for (uint32_t e = 0; e < cnt; e++) {
                        uint32_t s = cursor_next(C, t, &probe);
                        if (s != C->first[t] + d * T + e)
                                unchanged = 0;
                }
                if (unchanged && old_live == cnt) {
                        k = probe;
                        continue;
                }
                for (uint32_t e = 0; e < cnt; e++)
                        gather_one(C, h, t, cursor_next(C, t, &k), e);
                write_block(C, h, t, d, cnt);
        }
}

/* Moves len consecutive tier-0 rows of head h from index src to index dst (dst <= src), each run
 * inside one block on both sides; memmove, since a run may overlap itself. */
static void move_run(const struct compaction *C, uint32_t h, uint32_t src, uint32_t dst, uint32_t len) {
        const struct block_layout *l = C->M->layout[0];
        uint32_t T = l->block_tokens;
        uint8_t *sb = C->M->blocks[0][src / T], *db = C->M->blocks[0][dst / T];
        uint32_t ss = src % T, ds = dst % T;
        uint64_t off[SIDE_ARRAYS];

        memmove(block_key(l, db, h, ds), block_key(l, sb, h, ss), len * l->row_bytes);
        memmove(block_value(l, db, h, ds), block_value(l, sb, h, ss), len * l->row_bytes);
        block_side_offsets(l, off);
        for (int a = 0; a < SIDE_ARRAYS; a++)
                memmove(block_side(l, db, off[a], h, ds), block_side(l, sb, off[a], h, ss), (size_t)len * 4u);
}

static void compact_tier0(const struct compaction *C, uint32_t h, uint32_t count) {
        uint32_t T = C->M->layout[0]->block_tokens, f0 = C->first[0], j = 0;
        struct cursor k = { 0, C->base };
        uint32_t next = count ? cursor_next(C, 0, &k) - f0 : 0;

        while (j < count) {
                uint32_t f = next, len = 1;
                uint32_t room = T - (f % T) < T - (j % T) ? T - (f % T) : T - (j % T);
                next = 0;
                while (j + len < count) {
                        next = cursor_next(C, 0, &k) - f0;
                        if (len >= room || next != f + len)
                                break;
                        len++;
                }
                if (f != j)
                        move_run(C, h, f, j, len);
                j += len;
        }
}

/* Validates head h's keep-set and tiers; counts each new tier into cnt. */
static int count_head(const struct compaction *C, uint32_t *cnt) {
        if (compact_check_keep(C->keep, C->kc, C->base) < 0)
                return -EINVAL;
        memset(cnt, 0, LADDER_TIERS * sizeof(*cnt));
        for (uint32_t i = 0; i < C->kc; i++) {
                uint32_t ot = old_tier(C, C->keep[i]), nt = new_tier(C, i);
                if (nt < ot || nt >= C->M->n_tiers)
                        return -EINVAL;
                cnt[nt]++;
        }
        cnt[0] += C->n_old - C->base;
        return 0;
}

int ladder_compact(const struct ladder_layer *M, const uint32_t *keep, const uint8_t *tier,
                   uint32_t keep_count, int per_head, uint32_t base_tokens, float *scratch, uint32_t *ret_n) {
        if (ladder_check(M) < 0 || !scratch || !ret_n || (keep_count && !keep))
                return -EINVAL;
        uint32_t n = ladder_tokens(M), H = M->layout[0]->n_kv_heads, T = M->layout[0]->block_tokens;
        if (base_tokens > n || M->n_shared)
                return -EINVAL; /* a shared prefix compacts by masking (plan.c), never here */
        struct compaction C = { .M = M, .kc = keep_count, .base = base_tokens, .n_old = n };
        for (uint32_t t = 0; t < M->n_tiers; t++)
                C.first[t] = first_slot(M, t);
        if (base_tokens < n && base_tokens < C.first[0])
                return -EINVAL; /* the tail goes to tier 0: it must come from there */
        uint32_t cnt[LADDER_TIERS], cnt_h[LADDER_TIERS];
        for (uint32_t h = 0; h < (per_head ? H : 1u); h++) {
                C.keep = keep ? keep + (uint64_t)h * keep_count : NULL;
                C.tier = tier ? tier + (uint64_t)h * keep_count : NULL;
                if (count_head(&C, h ? cnt_h : cnt) < 0 || (h && memcmp(cnt, cnt_h, sizeof(cnt))))
                        return -EINVAL;
        }
        for (uint32_t t = 0; t < M->n_tiers; t++)
                if (div_up(cnt[t], T) > M->n_blocks[t])
                        return -EINVAL;

        C.g = gather_carve(M, scratch);
        for (uint32_t h = 0; h < H; h++) {
                C.keep = keep && per_head ? keep + (uint64_t)h * keep_count : keep;
                C.tier = tier && per_head ? tier + (uint64_t)h * keep_count : tier;
                for (uint32_t t = M->n_tiers; t-- > 1;)
                        compact_quantized(&C, h, t, cnt[t]);
                compact_tier0(&C, h, cnt[0]);
        }
        for (uint32_t t = 0; t < LADDER_TIERS; t++)
                ret_n[t] = t < M->n_tiers ? cnt[t] : 0;
        return 0;
}

/* ---- attention ---- */

size_t ladder_attn_scratch_floats(const struct ladder_layer *M, uint32_t n_heads) {
        uint32_t H = M->layout[0]->n_kv_heads;
        if (!H || !n_heads || n_heads % H)
                return 0;
        uint64_t group = n_heads / H, D = M->layout[0]->head_dim, T = M->layout[0]->block_tokens;
        uint64_t n = ladder_tokens(M);
        /* logits, qrot, row-dot scratch, dots (doubles), cacc, acc_rot, p, m, l, row */
        return (size_t)(group * n + group * D + (group * D + D) + 2 * group * T + 2 * group * D + group * T +
                        2 * group + D + 2);
}

struct attention {
        const struct ladder_layer *M;
        uint32_t n, group, g;
        const float *q; /* [group][D]: this KV head's queries */
        float *out;     /* [group][D]: this KV head's outputs (the unrotated accumulator) */
        float *logits;  /* [group][n] */
        float *qrot;    /* [group][D] */
        float *dscratch;
        double *dots; /* [group][T] */
        float *cacc, *acc_rot, *p, *m, *l, *row;
};

static void attend_chunk(const struct attention *A, uint32_t t, uint8_t *block, uint32_t slot0,
                         uint32_t cnt) {
        const struct ladder_layer *M = A->M;
        const struct block_layout *l = M->layout[t];
        const struct tier_row *row = tier_row(l->dtype);
        uint32_t D = l->head_dim, T = l->block_tokens, g = A->g, group = A->group, n = A->n;
        double scale = sqrt((double)D);

        row->dots(l, block, g, cnt, row->rotated ? A->qrot : A->q, group, A->dscratch, A->dots);
        for (uint32_t i = 0; i < cnt; i++) {
                float logw = *(const float *)block_side(l, block, l->logw_offset, g, i);
                uint32_t j = slot0 + i;
                if (j < M->n_shared && (M->shared_mask[(uint64_t)g * M->mask_stride + j / 8] >> (j % 8) & 1))
                        logw = -INFINITY; /* evicted by this session, kept for the others */
                for (uint32_t r = 0; r < group; r++) {
                        float s;
                        if (isinf(logw) && logw < 0) {
                                s = -INFINITY;
                        } else {
                                s = (float)(A->dots[(uint64_t)r * cnt + i] / scale + logw);
                                s = s < FLT_MAX ? s : FLT_MAX; /* +inf and NaN: the largest finite logit */
                        }
                        A->logits[(uint64_t)r * n + j] = s;
                }
        }

        for (uint32_t r = 0; r < group; r++) {
                const float *s = A->logits + (uint64_t)r * n + slot0;
                float *p = A->p + (uint64_t)r * T, *oh = A->out + (uint64_t)r * D,
                      *orot = A->acc_rot + (uint64_t)r * D;
                float cmax = -INFINITY, m_new, psum = 0.0f;
                for (uint32_t i = 0; i < cnt; i++)
                        if (s[i] > cmax)
                                cmax = s[i];
                m_new = cmax > A->m[r] ? cmax : A->m[r];
                if (isinf(m_new)) { /* everything so far masked */
                        memset(p, 0, cnt * sizeof(*p));
                        continue;
                }
                float alpha = expf(A->m[r] - m_new);
                for (uint32_t i = 0; i < cnt; i++) {
                        p[i] = expf(s[i] - m_new);
                        psum += p[i];
                }
                A->l[r] = A->l[r] * alpha + psum;
                A->m[r] = m_new;
                if (alpha != 1.0f)
                        for (uint32_t c = 0; c < D; c++) {
                                oh[c] *= alpha;
                                orot[c] *= alpha;
                        }
        }

        memset(A->cacc, 0, (size_t)group * D * sizeof(float));
        row->accumulate(l, block, g, cnt, A->p, T, group, A->row, A->cacc);
        for (uint32_t r = 0; r < group; r++) {
                float *oh = (row->rotated ? A->acc_rot : A->out) + (uint64_t)r * D,
                      *acc = A->cacc + (uint64_t)r * D;
                for (uint32_t c = 0; c < D; c++)
                        oh[c] += acc[c];
        }
}

static void update_scores(const struct attention *A, float ema_gamma) {
        const struct ladder_layer *M = A->M;
        for (uint32_t j = M->n_shared; j < A->n; j++) {
                uint32_t t, idx;
                ladder_locate(M, j, &t, &idx);
                const struct block_layout *l = M->layout[t];
                uint8_t *b = M->blocks[t][idx / l->block_tokens];
                uint32_t slot = idx % l->block_tokens;
                float a = 0.0f;
                for (uint32_t r = 0; r < A->group; r++)
                        if (A->l[r] > 0.0f)
                                a += expf(A->logits[(uint64_t)r * A->n + j] - A->m[r]) / A->l[r];
                a /= (float)A->group;
                float *sum = block_side(l, b, l->sum_offset, A->g, slot);
                float *ema = block_side(l, b, l->ema_offset, A->g, slot);
                float *last = block_side(l, b, l->last_offset, A->g, slot);
                *sum += a;
                *ema = ema_gamma * *ema + (1.0f - ema_gamma) * a;
                *last = a;
        }
}

int ladder_attend(const struct ladder_layer *M, const float *q, float *out, uint32_t n_heads, float ema_gamma,
                  int update, float *scratch) {
        if (ladder_check(M) < 0 || !scratch || !q || !out)
                return -EINVAL;
        uint32_t n = ladder_tokens(M), H = M->layout[0]->n_kv_heads, D = M->layout[0]->head_dim;
        uint32_t T = M->layout[0]->block_tokens;
        if (n == 0 || n_heads == 0 || n_heads % H)
                return -EINVAL;
        int rotated_tokens = 0;
        for (uint32_t t = 1; t < M->n_tiers; t++)
                rotated_tokens |= M->n[t] && tier_row(M->layout[t]->dtype)->rotated;

        struct attention A = { .M = M, .n = n, .group = n_heads / H };
        uint64_t group = A.group;
        A.logits = scratch;
        A.qrot = A.logits + group * n;
        A.dscratch = A.qrot + group * D;
        A.dots = (double *)(((uintptr_t)(A.dscratch + group * D + D) + 7u) & ~(uintptr_t)7u); /* aligned */
        A.cacc = (float *)(A.dots + group * T);
        A.acc_rot = A.cacc + group * D;
        A.p = A.acc_rot + group * D;
        A.m = A.p + group * T;
        A.l = A.m + group;
        A.row = A.l + group;

        memset(out, 0, (size_t)n_heads * D * sizeof(float));
        for (A.g = 0; A.g < H; A.g++) {
                A.q = q + (uint64_t)A.g * group * D;
                A.out = out + (uint64_t)A.g * group * D;
                for (uint32_t r = 0; r < group; r++) {
                        A.m[r] = -INFINITY;
                        A.l[r] = 0.0f;
                }
                memset(A.acc_rot, 0, group * D * sizeof(float));
                if (rotated_tokens)
                        for (uint32_t r = 0; r < group; r++) {
                                memcpy(A.qrot + r * D, A.q + r * D, D * sizeof(float));
                                lloyd_rotate(M->signs + (uint64_t)A.g * D, A.qrot + r * D, D);
                        }
                uint32_t slot0 = 0;
                for (uint32_t t = M->n_tiers; t-- > 0;) {
                        for (uint32_t b = 0; b < div_up(M->n[t], T); b++) {
                                uint32_t left = M->n[t] - b * T;
                                attend_chunk(&A, t, M->blocks[t][b], slot0 + b * T, left < T ? left : T);
                        }
                        slot0 += M->n[t];
                }
                for (uint32_t r = 0; r < group; r++) {
                        float *oh = A.out + r * D;
                        if (rotated_tokens) {
                                lloyd_unrotate(M->signs + (uint64_t)A.g * D, A.acc_rot + r * D, D);
                                for (uint32_t c = 0; c < D; c++)
                                        oh[c] += A.acc_rot[r * D + c];
                        }
                        if (A.l[r] > 0.0f)
                                for (uint32_t c = 0; c < D; c++)
                                        oh[c] /= A.l[r];
                }
                if (update)
                        update_scores(&A, ema_gamma);
        }
        return 0;
}

int ladder_attend_rows(const struct ladder_layer *M, uint32_t n_rows, const float *q, float *out,
                       uint32_t n_heads, float ema_gamma, int update, float *scratch) {
        if (ladder_check(M) < 0 || n_rows == 0 || n_rows > M->n[0] || M->n_shared > M->n[0] - n_rows)
                return -EINVAL;
        uint64_t row = (uint64_t)n_heads * M->layout[0]->head_dim;
        struct ladder_layer P = *M;
        for (uint32_t r = 0; r < n_rows; r++) {
                P.n[0] = M->n[0] - (n_rows - 1 - r);
                int e = ladder_attend(&P, q + r * row, out + r * row, n_heads, ema_gamma, update, scratch);
                if (e < 0)
                        return e;
        }
        return 0;
}

/* ---- readers ---- */

void ladder_load(const struct ladder_layer *M, uint32_t h, uint32_t s, float *key, float *value) {
        uint32_t t, idx;
        ladder_locate(M, s, &t, &idx);
        const struct block_layout *l = M->layout[t];
        const struct tier_row *row = tier_row(l->dtype);
        uint8_t *b = M->blocks[t][idx / l->block_tokens];
        uint32_t D = l->head_dim;
        if (key) {
                row->load_key(l, b, h, idx % l->block_tokens, key);
                if (row->rotated)
                        lloyd_unrotate(M->signs + (uint64_t)h * D, key, D);
        }
        if (value) {
                row->load_value(l, b, h, idx % l->block_tokens, value);
                if (row->rotated)
                        lloyd_unrotate(M->signs + (uint64_t)h * D, value, D);
        }
}
