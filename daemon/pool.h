/* pool.h: the KV-cache memory pool: chunks, their owners, and the blocks carved out of them.
 *
 * The pool is at most capacity_bytes / chunk_bytes equal chunks, created lazily by the backend
 * and mapped by kvcd at base + i * chunk_bytes. Every client maps the chunks it owns at the same
 * offsets in its own reserved range, so a block is named by its pool offset on both sides.
 *
 * Ownership: a chunk is free or belongs to exactly one client, and holds only that client's
 * blocks (isolation: nobody can map another client's KV). A new chunk is given only while the
 * chunks owned fit the capacity (a chunk is memory held: on a GPU, all of it). Inside a chunk, units of one
 * size (the session geometry's block size) are carved and tracked in a bitmap; a chunk whose units are all
 * free may be re-carved for another size by the same owner. Chunks go back to the free list, scrubbed, when
 * their owner disconnects or dies, or when it gives one back on request (cooperative shrink:
 * pool_reclaim_pick, then pool_reclaim_done once the owner unmapped it; a chunk that still holds blocks is
 * first drained: pool_reclaim_drain, and relocate.c moves them).
 *
 * Accounting: used_bytes is the sum of allocated units; pool_alloc never lets it pass
 * capacity_bytes, and pool_audit() recomputes it from the bitmaps.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"

struct pool;

struct pool_stats {
        uint64_t capacity_bytes;
        uint64_t used_bytes;
        uint64_t chunk_bytes;
        uint32_t chunks_total;
        uint32_t chunks_owned;
        uint32_t chunks_created;
        uint32_t chunks_reclaiming; /* wanted back (being drained, or asked), not yet given back */
};

/* chunk_bytes: a multiple of 2 MiB. -EINVAL when the capacity holds no chunk. */
int pool_new(const struct backend_ops *backend, uint64_t capacity_bytes, uint64_t chunk_bytes,
             struct pool **ret);
struct pool *pool_free(struct pool *p);

/* Allocates n_units contiguous units of unit_bytes (a multiple of 64) for owner (non-zero).
 * *ret_new_chunk is the index of a chunk newly given to owner (its fd must reach the client
 * before any offset in it does), or -1. -ENOSPC when the capacity or the chunks are exhausted,
 * -EINVAL when the request cannot fit a chunk. */
int pool_alloc(struct pool *p, uint64_t owner, uint32_t unit_bytes, uint32_t n_units, uint64_t *ret_offset,
               int64_t *ret_new_chunk);

/* pool_alloc limited to the chunks owner already holds and is not asked for (no new chunk): where
 * relocation moves blocks to. -ENOSPC when they have no room. The capacity is not checked: a
 * move's destination lies in memory already held, and its source is freed when the move is
 * applied, so used bytes may pass the capacity only for as long as a move is in flight (which
 * happens when an operator lowered the capacity and kvcd gathers blocks to give chunks back). */
int pool_alloc_owned(struct pool *p, uint64_t owner, uint32_t unit_bytes, uint32_t n_units,
                     uint64_t *ret_offset);
/* Whether owner holds a chunk carved for units of unit_bytes (not wanted back). */
bool pool_owner_carved(const struct pool *p, uint64_t owner, uint32_t unit_bytes);
/* The chunks the capacity could still give: free ones, within it. */
uint32_t pool_free_chunks(const struct pool *p);

/* Frees what pool_alloc returned. -EINVAL (and nothing changes) when a unit of the range is not
 * allocated to owner with that unit size. The bitmap does not record where allocations begin, so
 * part of one allocation, or two neighbours, can be released at once: callers release exactly
 * what they allocated. */
int pool_release(struct pool *p, uint64_t owner, uint64_t offset, uint32_t unit_bytes, uint32_t n_units);

/* Gives back, scrubbed, every chunk of owner (its process ended). Returns the count. */
uint32_t pool_release_owner(struct pool *p, uint64_t owner);
/* Units owner holds, in all its chunks. */
uint64_t pool_owner_units(const struct pool *p, uint64_t owner);
/* Chunks owner holds. */
uint32_t pool_owner_chunks(const struct pool *p, uint64_t owner);

/* Cooperative shrink (docs/gpu.md). No API lets kvcd take a mapping away from a client, so a chunk
 * is asked back and stays its owner's until the owner says it unmapped it.
 *
 * pool_short_of_chunks: an allocation failed since the last pick because every chunk was owned,
 * though the capacity had room. pool_reclaim_pick then marks up to max owned chunks that hold no
 * units (highest index first) as being reclaimed: nothing more is allocated from them. It returns
 * how many, with their indices and owners, and clears the shortage. pool_reclaim_done takes the
 * owner's acknowledgement: the chunk is scrubbed and free again. -EINVAL (nothing changes) for a
 * chunk that is not being reclaimed from that owner. An owner that dies first gives it back with
 * the rest (pool_release_owner). An owner whose allocation finds no other room takes its chunk
 * back (the reclaim is called off, and the chunk is reported as new so its fd goes out again).
 *
 * A chunk that still holds units is drained first (pool_reclaim_drain): it stays its owner's and
 * mapped, nothing new is allocated there, and its units are moved out (relocate.c). When the last
 * one is released the shortage flag is raised again, and the next pick asks for the chunk. */
bool pool_short_of_chunks(const struct pool *p);
/* The chunks owned and not yet wanted back hold more than the capacity (an operator lowered it):
 * chunks should be asked back until they fit. */
bool pool_over_capacity(const struct pool *p);
uint32_t pool_reclaim_pick(struct pool *p, uint32_t max, uint32_t *ret_idx, uint64_t *ret_owner);
int pool_reclaim_done(struct pool *p, uint64_t owner, uint32_t idx);
/* Calls a reclaim off when the owner could not be asked (the chunk stays its owner's). */
void pool_reclaim_cancel(struct pool *p, uint32_t idx);
/* Marks owned chunk idx as being drained. -EINVAL when it is free or already wanted back. */
int pool_reclaim_drain(struct pool *p, uint32_t idx);
bool pool_chunk_draining(const struct pool *p, uint32_t idx);
/* Units in use in chunk idx and their size (0 and 0 for a free chunk). */
uint32_t pool_chunk_units(const struct pool *p, uint32_t idx, uint32_t *ret_unit_bytes);
/* Free units of unit_bytes in owner's chunks that are carved for that size and not wanted back. */
uint64_t pool_owner_room(const struct pool *p, uint64_t owner, uint32_t unit_bytes);

/* Called with each chunk the backend creates (kvcd puts its fd in systemd's fd store). */
void pool_set_created_hook(struct pool *p, void (*fn)(void *ctx, uint32_t idx, int fd), void *ctx);

/* Restart: takes over chunk idx from a kept fd, owned by owner (0: free). */
int pool_adopt_chunk(struct pool *p, uint32_t idx, int fd, uint64_t owner);
/* Restart: marks [offset, n_units units) allocated to owner, carving the chunk for unit_bytes if it
 * is not yet. -EINVAL when the chunk is not owner's, is carved for another size, or the units are
 * taken; -ENOSPC beyond the capacity. */
int pool_claim(struct pool *p, uint64_t owner, uint64_t offset, uint32_t unit_bytes, uint32_t n_units);
/* Restart: every chunk of from now belongs to to. */
void pool_transfer_owner(struct pool *p, uint64_t from, uint64_t to);
uint64_t pool_chunk_owner(const struct pool *p, uint32_t idx);
uint32_t pool_n_chunks(const struct pool *p);
/* Which memory chunk idx holds now: a new generation at every creation (fdwire CHUNK records). */
uint32_t pool_chunk_generation(const struct pool *p, uint32_t idx);

/* Undoes the grant of a chunk to owner when its fd could not be delivered (no units in use); a
 * chunk the allocation took back from being reclaimed goes back to being reclaimed. */
void pool_disown_chunk(struct pool *p, uint32_t idx);

/* 0 when [offset, n_units units) is allocated to owner with that unit size, -EINVAL otherwise. */
int pool_owns(const struct pool *p, uint64_t owner, uint64_t offset, uint32_t unit_bytes, uint32_t n_units);

/* Changes the capacity: at least one chunk, at most the chunks reserved at start. Lowering it
 * below what is in use is allowed: nothing is taken away, but nothing more is granted until use
 * falls under it. -EINVAL out of range. */
int pool_set_capacity(struct pool *p, uint64_t capacity_bytes);

/* kvcd's access to pool memory through the backend: n bytes at a pool offset, inside one chunk
 * that exists. -EINVAL otherwise (nothing read or written). */
int pool_read(const struct pool *p, uint64_t offset, void *dst, size_t n);
int pool_write(struct pool *p, uint64_t offset, const void *src, size_t n);
/* The daemon's own mapping of a host chunk's byte (tests look at pool memory this way); kvcd itself
 * goes through pool_read and pool_write, which work for every backend. */
uint8_t *pool_ptr(const struct pool *p, uint64_t offset);
int pool_chunk_fd(const struct pool *p, uint32_t idx);
uint64_t pool_chunk_bytes(const struct pool *p);
uint64_t pool_va_bytes(const struct pool *p);
void pool_get_stats(const struct pool *p, struct pool_stats *ret);
/* Bytes no unit can use: the tails of carved chunks, where the unit size does not divide the
 * chunk (the arbiter counts them out of the capacity). */
uint64_t pool_waste_bytes(const struct pool *p);

/* Recomputes used bytes and owners from the bitmaps; 0 when they agree with the counters,
 * -EUCLEAN otherwise (with what differs in why). Use above the capacity is not a mismatch: an
 * operator may lower the capacity below what is in use (pool_set_capacity). */
int pool_audit(const struct pool *p, char *why, size_t why_len);
