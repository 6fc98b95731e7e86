/* pool.c: chunk ownership and unit bitmaps.
 *
 * Allocation scans the chunk table: first chunks the owner already holds with the same unit size,
 * then its empty chunks (re-carved), then a free chunk (created on first use). The table is small
 * (capacity / 2 MiB); a per-owner index is the obvious next step if pools reach tens of thousands
 * of chunks.
 */
#define _GNU_SOURCE
#include "pool.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

struct pool_chunk {
        struct backend_chunk bc;
        bool created;
        uint64_t owner; /* 0: free */
        uint32_t unit_bytes;
        uint32_t n_units;
        uint32_t n_used;
        bool reclaiming;     /* wanted back: nothing new is allocated there (pool_reclaim_pick, _drain) */
        bool asked;          /* reclaiming, and its owner was asked to unmap it (it holds no units) */
        uint32_t generation; /* of the memory it holds now: a new one at every creation */
        uint64_t *bits;
};

struct pool {
        const struct backend_ops *backend;
        void (*created)(void *ctx, uint32_t idx, int fd);
        void *created_ctx;
        uint64_t capacity_bytes;
        uint64_t chunk_bytes;
        uint64_t used_bytes;
        uint32_t n_chunks;
        uint32_t chunks_owned;
        uint32_t chunks_created;
        uint32_t chunks_reclaiming;
        bool short_of_chunks; /* or a chunk being drained became empty: a pick is due */
        int64_t regranted;    /* the chunk the last pool_alloc took back from being reclaimed, or -1 */
        uint8_t *base;
        struct pool_chunk *chunks;
        uint32_t generation; /* the last chunk generation given (from a random start: a restarted kvcd's
                                cannot be mistaken for its predecessor's) */
};

#define POOL_CHUNK_ALIGN (2ull << 20)

int pool_new(const struct backend_ops *backend, uint64_t capacity_bytes, uint64_t chunk_bytes,
             struct pool **ret) {
        if (chunk_bytes == 0 || chunk_bytes % POOL_CHUNK_ALIGN || capacity_bytes < chunk_bytes ||
            chunk_bytes > (1ull << 32))
                return -EINVAL;
        uint64_t n = capacity_bytes / chunk_bytes;
        if (n > (1u << 20))
                return -EINVAL;
        struct pool *p = calloc(1, sizeof(*p));
        if (!p)
                return -ENOMEM;
        p->chunks = calloc(n, sizeof(*p->chunks));
        void *base =
                mmap(NULL, n * chunk_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (!p->chunks || base == MAP_FAILED) {
                free(p->chunks);
                free(p);
                return -ENOMEM;
        }
        p->backend = backend;
        p->capacity_bytes = capacity_bytes;
        p->chunk_bytes = chunk_bytes;
        p->n_chunks = (uint32_t)n;
        p->base = base;
        p->regranted = -1;
        if (getrandom(&p->generation, sizeof(p->generation), 0) != sizeof(p->generation))
                p->generation = (uint32_t)(uintptr_t)base ^ (uint32_t)getpid();
        for (uint32_t i = 0; i < p->n_chunks; i++)
                p->chunks[i].bc.fd = -1;
        *ret = p;
        return 0;
}

struct pool *pool_free(struct pool *p) {
        if (!p)
                return NULL;
        for (uint32_t i = 0; i < p->n_chunks; i++) {
                if (p->chunks[i].created)
                        p->backend->chunk_destroy(&p->chunks[i].bc, p->chunk_bytes);
                free(p->chunks[i].bits);
        }
        munmap(p->base, (size_t)p->n_chunks * p->chunk_bytes);
        free(p->chunks);
        free(p);
        return NULL;
}

static bool bit_get(const uint64_t *bits, uint32_t i) {
        return (bits[i / 64] >> (i % 64)) & 1u;
}

static void bits_set(uint64_t *bits, uint32_t from, uint32_t n, bool on) {
        for (uint32_t i = from; i < from + n; i++) {
                if (on)
                        bits[i / 64] |= 1ull << (i % 64);
                else
                        bits[i / 64] &= ~(1ull << (i % 64));
        }
}

/* First run of n free units in the chunk, or -1. */
static int64_t find_run(const struct pool_chunk *c, uint32_t n) {
        if (c->n_units - c->n_used < n)
                return -1;
        uint32_t run = 0;
        for (uint32_t i = 0; i < c->n_units; i++) {
                if (n == 1 && i % 64 == 0 && c->bits[i / 64] == ~0ull) {
                        i += 63; /* a full word: skip it */
                        continue;
                }
                run = bit_get(c->bits, i) ? 0 : run + 1;
                if (run == n)
                        return (int64_t)i + 1 - n;
        }
        return -1;
}

/* Carves chunk c into units of unit_bytes; c must hold no units. */
static int carve(struct pool *p, struct pool_chunk *c, uint32_t unit_bytes) {
        uint32_t n = (uint32_t)(p->chunk_bytes / unit_bytes);
        uint64_t *bits = calloc((n + 63) / 64, sizeof(uint64_t));
        if (!bits)
                return -ENOMEM;
        free(c->bits);
        c->bits = bits;
        c->unit_bytes = unit_bytes;
        c->n_units = n;
        c->n_used = 0;
        return 0;
}

static int take_units(struct pool *p, uint32_t idx, uint32_t n, uint64_t *ret_offset) {
        struct pool_chunk *c = &p->chunks[idx];
        int64_t first = find_run(c, n);
        if (first < 0)
                return -ENOSPC;
        bits_set(c->bits, (uint32_t)first, n, true);
        c->n_used += n;
        p->used_bytes += (uint64_t)n * c->unit_bytes;
        *ret_offset = (uint64_t)idx * p->chunk_bytes + (uint64_t)first * c->unit_bytes;
        return 0;
}

/* n units of unit_bytes (a multiple of 64) for a real owner, and no more than a chunk holds. */
static bool valid_request(const struct pool *p, uint64_t owner, uint32_t unit_bytes, uint32_t n_units) {
        return owner && unit_bytes && unit_bytes % 64 == 0 && n_units &&
               (uint64_t)unit_bytes * n_units <= p->chunk_bytes;
}

static int alloc_owned(struct pool *p, uint64_t owner, uint32_t unit_bytes, uint32_t n_units,
                       uint64_t *ret_offset);
static int alloc_elsewhere(struct pool *p, uint64_t owner, uint32_t unit_bytes, uint32_t n_units,
                           uint64_t *ret_offset, int64_t *ret_new_chunk);

int pool_alloc(struct pool *p, uint64_t owner, uint32_t unit_bytes, uint32_t n_units, uint64_t *ret_offset,
               int64_t *ret_new_chunk) {
        if (!valid_request(p, owner, unit_bytes, n_units))
                return -EINVAL;
        if (p->used_bytes + (uint64_t)unit_bytes * n_units > p->capacity_bytes)
                return -ENOSPC;
        p->regranted = -1;
        *ret_new_chunk = -1;
        if (alloc_owned(p, owner, unit_bytes, n_units, ret_offset) == 0)
                return 0;
        return alloc_elsewhere(p, owner, unit_bytes, n_units, ret_offset, ret_new_chunk);
}

/* Steps 1 and 2 of the allocation: chunks the owner holds and is not asked for. */
static int alloc_owned(struct pool *p, uint64_t owner, uint32_t unit_bytes, uint32_t n_units,
                       uint64_t *ret_offset) {
        /* 1: a chunk of the owner's with this unit size and room */
        for (uint32_t i = 0; i < p->n_chunks; i++) {
                struct pool_chunk *c = &p->chunks[i];
                if (c->owner == owner && !c->reclaiming && c->unit_bytes == unit_bytes &&
                    take_units(p, i, n_units, ret_offset) == 0)
                        return 0;
        }
        /* 2: an empty chunk of the owner's, re-carved */
        for (uint32_t i = 0; i < p->n_chunks; i++) {
                struct pool_chunk *c = &p->chunks[i];
                if (c->owner == owner && !c->reclaiming && c->n_used == 0) {
                        int r = carve(p, c, unit_bytes);
                        if (r < 0)
                                return r;
                        return take_units(p, i, n_units, ret_offset);
                }
        }
        return -ENOSPC;
}

/* Steps 3 and 4: a free chunk, or one of the owner's that was wanted back. */
static int alloc_elsewhere(struct pool *p, uint64_t owner, uint32_t unit_bytes, uint32_t n_units,
                           uint64_t *ret_offset, int64_t *ret_new_chunk) {
        /* 3: a free chunk, created on first use, while the chunks owned fit the capacity (a chunk
         * is device memory held, whatever part of it is in use) */
        for (uint32_t i = 0;
             (uint64_t)(p->chunks_owned + 1) * p->chunk_bytes <= p->capacity_bytes && i < p->n_chunks; i++) {
                struct pool_chunk *c = &p->chunks[i];
                if (c->owner != 0)
                        continue;
                if (!c->created) {
                        int r = p->backend->chunk_create(p->chunk_bytes,
                                                         p->base + (uint64_t)i * p->chunk_bytes, &c->bc);
                        if (r < 0)
                                return r;
                        c->created = true;
                        c->generation = ++p->generation;
                        p->chunks_created++;
                        if (p->created)
                                p->created(p->created_ctx, i, c->bc.fd);
                }
                int r = carve(p, c, unit_bytes);
                if (r < 0)
                        return r;
                c->owner = owner;
                p->chunks_owned++;
                *ret_new_chunk = i;
                return take_units(p, i, n_units, ret_offset);
        }
        /* 4: the owner's own chunk that was wanted back: it needs it after all. One being drained
         * (not asked yet, still mapped) just stops being drained. An asked one's UNMAP may have
         * reached the owner already, so the chunk is reported as new and its fd goes out again
         * (after the UNMAP on the side channel, so the client maps it again); a late UNMAPPED is
         * ignored. */
        for (uint32_t i = p->n_chunks; i-- > 0;) {
                struct pool_chunk *c = &p->chunks[i];
                if (c->owner != owner || !c->reclaiming)
                        continue;
                if (c->n_used && (c->unit_bytes != unit_bytes || find_run(c, n_units) < 0))
                        continue;
                int r = c->n_used ? 0 : carve(p, c, unit_bytes);
                if (r < 0)
                        return r;
                if (c->asked) {
                        p->regranted = i;
                        *ret_new_chunk = i;
                }
                c->reclaiming = c->asked = false;
                p->chunks_reclaiming--;
                return take_units(p, i, n_units, ret_offset);
        }
        p->short_of_chunks = true; /* the capacity has room, the chunks are all owned */
        return -ENOSPC;
}

bool pool_owner_carved(const struct pool *p, uint64_t owner, uint32_t unit_bytes) {
        for (uint32_t i = 0; i < p->n_chunks; i++)
                if (p->chunks[i].owner == owner && p->chunks[i].unit_bytes == unit_bytes && !p->chunks[i].reclaiming)
                        return true;
        return false;
}

uint32_t pool_free_chunks(const struct pool *p) {
        uint64_t fit = p->capacity_bytes / p->chunk_bytes;
        return fit > p->chunks_owned ? (uint32_t)(fit - p->chunks_owned) : 0;
}

int pool_alloc_owned(struct pool *p, uint64_t owner, uint32_t unit_bytes, uint32_t n_units,
                     uint64_t *ret_offset) {
        if (!valid_request(p, owner, unit_bytes, n_units))
                return -EINVAL;
        return alloc_owned(p, owner, unit_bytes, n_units, ret_offset); /* no capacity check: see pool.h */
}

/* The chunk and first unit of an allocation, after checking it is one. */
static int locate(const struct pool *p, uint64_t owner, uint64_t offset, uint32_t unit_bytes,
                  uint32_t n_units, struct pool_chunk **ret_c, uint32_t *ret_first) {
        uint64_t idx = offset / p->chunk_bytes, in = offset % p->chunk_bytes;
        if (idx >= p->n_chunks || unit_bytes == 0 || n_units == 0)
                return -EINVAL;
        struct pool_chunk *c = &p->chunks[idx];
        if (c->owner != owner || c->unit_bytes != unit_bytes || in % unit_bytes)
                return -EINVAL;
        uint64_t first = in / unit_bytes;
        if (first + n_units > c->n_units)
                return -EINVAL;
        for (uint32_t i = 0; i < n_units; i++)
                if (!bit_get(c->bits, (uint32_t)first + i))
                        return -EINVAL;
        *ret_c = c;
        *ret_first = (uint32_t)first;
        return 0;
}

int pool_release(struct pool *p, uint64_t owner, uint64_t offset, uint32_t unit_bytes, uint32_t n_units) {
        struct pool_chunk *c;
        uint32_t first;
        int r = locate(p, owner, offset, unit_bytes, n_units, &c, &first);
        if (r < 0)
                return r;
        bits_set(c->bits, first, n_units, false);
        c->n_used -= n_units;
        p->used_bytes -= (uint64_t)n_units * unit_bytes;
        if (c->reclaiming && c->n_used == 0)
                p->short_of_chunks = true; /* drained: its owner can be asked for it now */
        return 0;
}

static void chunk_reset(struct pool *p, struct pool_chunk *c) {
        p->used_bytes -= (uint64_t)c->n_used * c->unit_bytes;
        free(c->bits);
        c->bits = NULL;
        c->owner = 0;
        c->unit_bytes = 0;
        c->n_units = 0;
        c->n_used = 0;
        if (c->reclaiming)
                p->chunks_reclaiming--;
        c->reclaiming = c->asked = false;
        p->chunks_owned--;
}

/* A chunk leaving its owner is scrubbed and retired: the next owner gets fresh memory (a new
 * memfd, a new GPU allocation), never the one the old owner may still hold. A client keeps what it
 * mapped (or an fd it kept, or a child it forked) until it lets go, and nothing kvcd does can take
 * a mapping away; scrubbing makes what it still sees zeros, and retiring makes sure nobody else's
 * data ever lands there. */
static void chunk_scrub(struct pool *p, struct pool_chunk *c) {
        p->backend->chunk_scrub(&c->bc, p->chunk_bytes); /* best effort: the memory goes anyway */
        p->backend->chunk_destroy(&c->bc, p->chunk_bytes);
        c->created = false;
        p->chunks_created--;
}

uint32_t pool_release_owner(struct pool *p, uint64_t owner) {
        uint32_t n = 0;
        for (uint32_t i = 0; i < p->n_chunks; i++) {
                struct pool_chunk *c = &p->chunks[i];
                if (owner == 0 || c->owner != owner)
                        continue;
                chunk_scrub(p, c);
                chunk_reset(p, c);
                n++;
        }
        return n;
}

uint32_t pool_owner_chunks(const struct pool *p, uint64_t owner) {
        uint32_t n = 0;
        for (uint32_t i = 0; owner && i < p->n_chunks; i++)
                n += p->chunks[i].owner == owner;
        return n;
}

uint64_t pool_owner_units(const struct pool *p, uint64_t owner) {
        uint64_t n = 0;
        for (uint32_t i = 0; i < p->n_chunks; i++)
                if (owner && p->chunks[i].owner == owner)
                        n += p->chunks[i].n_used;
        return n;
}

bool pool_short_of_chunks(const struct pool *p) {
        return p->short_of_chunks;
}

bool pool_over_capacity(const struct pool *p) {
        return (uint64_t)(p->chunks_owned - p->chunks_reclaiming) * p->chunk_bytes > p->capacity_bytes;
}

uint32_t pool_reclaim_pick(struct pool *p, uint32_t max, uint32_t *ret_idx, uint64_t *ret_owner) {
        uint32_t n = 0;
        for (uint32_t i = p->n_chunks; i-- > 0 && n < max;) {
                struct pool_chunk *c = &p->chunks[i];
                if (c->owner == 0 || c->asked || c->n_used)
                        continue;
                if (!c->reclaiming)
                        p->chunks_reclaiming++;
                c->reclaiming = c->asked = true;
                ret_idx[n] = i;
                ret_owner[n] = c->owner;
                n++;
        }
        p->short_of_chunks = false;
        return n;
}

int pool_reclaim_done(struct pool *p, uint64_t owner, uint32_t idx) {
        if (idx >= p->n_chunks || owner == 0 || p->chunks[idx].owner != owner || !p->chunks[idx].asked)
                return -EINVAL;
        struct pool_chunk *c = &p->chunks[idx];
        chunk_scrub(p, c);
        chunk_reset(p, c);
        return 0;
}

void pool_disown_chunk(struct pool *p, uint32_t idx) {
        if (idx >= p->n_chunks || p->chunks[idx].owner == 0)
                return;
        if (p->regranted == idx) { /* the owner may still map it: back to being asked for it */
                p->chunks[idx].reclaiming = p->chunks[idx].asked = true;
                p->chunks_reclaiming++;
                p->regranted = -1;
                return;
        }
        chunk_reset(p, &p->chunks[idx]);
}

int pool_owns(const struct pool *p, uint64_t owner, uint64_t offset, uint32_t unit_bytes, uint32_t n_units) {
        struct pool_chunk *c;
        uint32_t first;
        return locate(p, owner, offset, unit_bytes, n_units, &c, &first);
}

int pool_set_capacity(struct pool *p, uint64_t capacity_bytes) {
        if (capacity_bytes < p->chunk_bytes || capacity_bytes > (uint64_t)p->n_chunks * p->chunk_bytes)
                return -EINVAL;
        p->capacity_bytes = capacity_bytes;
        return 0;
}

/* The chunk that holds [offset, offset + n), or NULL. */
static struct pool_chunk *span(const struct pool *p, uint64_t offset, size_t n, uint64_t *ret_in) {
        uint64_t idx = offset / p->chunk_bytes, in = offset % p->chunk_bytes;
        if (idx >= p->n_chunks || !p->chunks[idx].created || in + n > p->chunk_bytes)
                return NULL;
        *ret_in = in;
        return &p->chunks[idx];
}

void pool_reclaim_cancel(struct pool *p, uint32_t idx) {
        if (idx < p->n_chunks && p->chunks[idx].reclaiming) {
                p->chunks[idx].reclaiming = p->chunks[idx].asked = false;
                p->chunks_reclaiming--;
        }
}

int pool_reclaim_drain(struct pool *p, uint32_t idx) {
        if (idx >= p->n_chunks || p->chunks[idx].owner == 0 || p->chunks[idx].reclaiming)
                return -EINVAL;
        p->chunks[idx].reclaiming = true;
        p->chunks_reclaiming++;
        return 0;
}

bool pool_chunk_draining(const struct pool *p, uint32_t idx) {
        return idx < p->n_chunks && p->chunks[idx].reclaiming && !p->chunks[idx].asked;
}

uint32_t pool_chunk_units(const struct pool *p, uint32_t idx, uint32_t *ret_unit_bytes) {
        if (idx >= p->n_chunks || p->chunks[idx].owner == 0) {
                *ret_unit_bytes = 0;
                return 0;
        }
        *ret_unit_bytes = p->chunks[idx].unit_bytes;
        return p->chunks[idx].n_used;
}

uint64_t pool_owner_room(const struct pool *p, uint64_t owner, uint32_t unit_bytes) {
        uint64_t n = 0;
        for (uint32_t i = 0; owner && i < p->n_chunks; i++) {
                const struct pool_chunk *c = &p->chunks[i];
                if (c->owner == owner && !c->reclaiming && c->unit_bytes == unit_bytes)
                        n += c->n_units - c->n_used;
        }
        return n;
}

void pool_set_created_hook(struct pool *p, void (*fn)(void *ctx, uint32_t idx, int fd), void *ctx) {
        p->created = fn;
        p->created_ctx = ctx;
}

int pool_adopt_chunk(struct pool *p, uint32_t idx, int fd, uint64_t owner) {
        if (idx >= p->n_chunks || p->chunks[idx].created || !p->backend->chunk_adopt)
                return -EINVAL;
        struct pool_chunk *c = &p->chunks[idx];
        int r = p->backend->chunk_adopt(fd, p->chunk_bytes, p->base + (uint64_t)idx * p->chunk_bytes, &c->bc);
        if (r < 0)
                return r;
        c->created = true;
        c->generation = ++p->generation;
        p->chunks_created++;
        if (owner) {
                c->owner = owner;
                p->chunks_owned++;
        }
        return 0;
}

int pool_claim(struct pool *p, uint64_t owner, uint64_t offset, uint32_t unit_bytes, uint32_t n_units) {
        uint64_t idx = offset / p->chunk_bytes, in = offset % p->chunk_bytes;
        if (idx >= p->n_chunks || owner == 0 || unit_bytes == 0 || unit_bytes % 64 || n_units == 0)
                return -EINVAL;
        struct pool_chunk *c = &p->chunks[idx];
        if (!c->created || c->owner != owner || in % unit_bytes)
                return -EINVAL;
        if (c->unit_bytes == 0 && carve(p, c, unit_bytes) < 0)
                return -ENOMEM;
        if (c->unit_bytes != unit_bytes || in / unit_bytes + n_units > c->n_units)
                return -EINVAL;
        uint32_t first = (uint32_t)(in / unit_bytes);
        for (uint32_t u = 0; u < n_units; u++)
                if (bit_get(c->bits, first + u))
                        return -EINVAL;
        if (p->used_bytes + (uint64_t)unit_bytes * n_units > p->capacity_bytes)
                return -ENOSPC;
        bits_set(c->bits, first, n_units, true);
        c->n_used += n_units;
        p->used_bytes += (uint64_t)unit_bytes * n_units;
        return 0;
}

void pool_transfer_owner(struct pool *p, uint64_t from, uint64_t to) {
        for (uint32_t i = 0; i < p->n_chunks; i++)
                if (from && p->chunks[i].owner == from)
                        p->chunks[i].owner = to;
}

uint64_t pool_chunk_owner(const struct pool *p, uint32_t idx) {
        return idx < p->n_chunks ? p->chunks[idx].owner : 0;
}

uint32_t pool_chunk_generation(const struct pool *p, uint32_t idx) {
        return idx < p->n_chunks ? p->chunks[idx].generation : 0;
}

uint32_t pool_n_chunks(const struct pool *p) {
        return p->n_chunks;
}

uint8_t *pool_ptr(const struct pool *p, uint64_t offset) {
        return p->base + offset;
}

int pool_read(const struct pool *p, uint64_t offset, void *dst, size_t n) {
        uint64_t in;
        struct pool_chunk *c = span(p, offset, n, &in);
        return c ? p->backend->read(&c->bc, in, dst, n) : -EINVAL;
}

int pool_write(struct pool *p, uint64_t offset, const void *src, size_t n) {
        uint64_t in;
        struct pool_chunk *c = span(p, offset, n, &in);
        return c ? p->backend->write(&c->bc, in, src, n) : -EINVAL;
}

int pool_chunk_fd(const struct pool *p, uint32_t idx) {
        return idx < p->n_chunks ? p->chunks[idx].bc.fd : -1;
}

uint64_t pool_chunk_bytes(const struct pool *p) {
        return p->chunk_bytes;
}

uint64_t pool_va_bytes(const struct pool *p) {
        return (uint64_t)p->n_chunks * p->chunk_bytes;
}

uint64_t pool_waste_bytes(const struct pool *p) {
        uint64_t waste = 0;
        for (uint32_t i = 0; i < p->n_chunks; i++) {
                const struct pool_chunk *c = &p->chunks[i];
                if (c->owner && c->n_units)
                        waste += p->chunk_bytes - (uint64_t)c->n_units * c->unit_bytes;
        }
        return waste;
}

void pool_get_stats(const struct pool *p, struct pool_stats *ret) {
        *ret = (struct pool_stats){
                .capacity_bytes = p->capacity_bytes,
                .used_bytes = p->used_bytes,
                .chunk_bytes = p->chunk_bytes,
                .chunks_total = p->n_chunks,
                .chunks_owned = p->chunks_owned,
                .chunks_created = p->chunks_created,
                .chunks_reclaiming = p->chunks_reclaiming,
        };
}

int pool_audit(const struct pool *p, char *why, size_t why_len) {
        uint64_t used = 0;
        uint32_t owned = 0;
        for (uint32_t i = 0; i < p->n_chunks; i++) {
                const struct pool_chunk *c = &p->chunks[i];
                uint32_t n = 0;
                for (uint32_t u = 0; u < c->n_units; u++)
                        n += bit_get(c->bits, u);
                if (n != c->n_used) {
                        snprintf(why, why_len, "chunk %u counts %u units in use, its bitmap %u", i, c->n_used,
                                 n);
                        return -EUCLEAN;
                }
                if (c->owner == 0 && n) {
                        snprintf(why, why_len, "free chunk %u has %u units in use", i, n);
                        return -EUCLEAN;
                }
                if (c->asked && n) {
                        snprintf(why, why_len, "chunk %u is being reclaimed with %u units in use", i, n);
                        return -EUCLEAN;
                }
                used += (uint64_t)n * c->unit_bytes;
                owned += c->owner != 0;
        }
        if (used != p->used_bytes || owned != p->chunks_owned) {
                snprintf(why, why_len, "counters say %llu bytes in %u chunks, bitmaps %llu in %u",
                         (unsigned long long)p->used_bytes, p->chunks_owned, (unsigned long long)used, owned);
                return -EUCLEAN;
        }
        return 0; /* use above a capacity an operator just lowered is a state, not a mismatch */
}
