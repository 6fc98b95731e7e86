/* pool.h: the KV-cache memory pool: chunks, their owners, and the blocks carved out of them.
 *
 * The pool is at most capacity_bytes / chunk_bytes equal chunks, created lazily by the backend
 * and mapped by kvcd at base + i * chunk_bytes. Every client maps the chunks it owns at the same
 * offsets in its own reserved range, so a block is named by its pool offset on both sides.
 *
 * Ownership: a chunk is free or belongs to exactly one client, and holds only that client's
 * blocks (isolation: nobody can map another client's KV). Inside a chunk, units of one size
 * (the session geometry's block size) are carved and tracked in a bitmap; a chunk whose units
 * are all free may be re-carved for another size by the same owner. Chunks go back to the free
 * list, scrubbed, only when their owner disconnects or dies.
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

/* Frees what pool_alloc returned. -EINVAL (and nothing changes) when a unit of the range is not
 * allocated to owner with that unit size. The bitmap does not record where allocations begin, so
 * part of one allocation, or two neighbours, can be released at once: callers release exactly
 * what they allocated. */
int pool_release(struct pool *p, uint64_t owner, uint64_t offset, uint32_t unit_bytes, uint32_t n_units);

/* Gives back, scrubbed, every chunk of owner (its process ended). Returns the count. */
uint32_t pool_release_owner(struct pool *p, uint64_t owner);

/* Undoes the grant of a chunk to owner when its fd could not be delivered (no units in use). */
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

/* Recomputes used bytes and owners from the bitmaps; 0 when they agree with the counters,
 * -EUCLEAN otherwise (with what differs in why). Use above the capacity is not a mismatch: an
 * operator may lower the capacity below what is in use (pool_set_capacity). */
int pool_audit(const struct pool *p, char *why, size_t why_len);
