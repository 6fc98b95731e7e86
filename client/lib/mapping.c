/* mapping.c: the pool in this process. Owns the reserved address range's chunks: mapping a chunk
 * kvcd sends (a sealed memfd, or a device allocation through devpool.c), giving one back when kvcd
 * asks (UNMAP, acknowledged with UNMAPPED once nothing of ours lies in it), and checking that a
 * region kvcd names lies in one chunk before anything touches it.
 *
 * Chunk i is mapped at base + i * chunk_bytes, so a block has the same pool offset here as in
 * kvcd. A chunk stays mapped at the generation kvcd sent; a read-only record (a shared prefix)
 * never takes write access away from a chunk we also write. A chunk asked back that still holds a
 * block or a plan buffer of ours is kept and not acknowledged.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "devpool.h"

/* Maps chunk record m's fd (closed here either way). */
static int map_chunk(struct kvc_client *c, const struct fdwire_msg *m, int fd) {
        struct stat st;
        bool device = (m->flags & FDWIRE_DEVICE_MEM) != 0;
        if (fd < 0 || m->chunk_idx >= c->n_chunks || m->chunk_bytes != c->chunk_bytes ||
            device != (c->dev != NULL) ||
            (!device && (fstat(fd, &st) < 0 || (uint64_t)st.st_size < c->chunk_bytes))) {
                if (fd >= 0)
                        close(fd);
                return client_error(c, -EPROTO, "kvcd sent an invalid chunk record");
        }
        bool read_only = (m->flags & FDWIRE_READ_ONLY) != 0;
        if (c->dev && c->mapped[m->chunk_idx]) { /* sent again (kvcd called a reclaim off): same memory */
                close(fd);
                return 0;
        }
        /* the same memory again: a read-only record never takes write access away (a shared
         * prefix's chunk, when we also publish into it) */
        if (!c->dev && c->mapped[m->chunk_idx] && c->mapped_gen[m->chunk_idx] == m->generation &&
            (read_only || c->mapped[m->chunk_idx] == MAPPED_RW)) {
                close(fd);
                return 0;
        }
        if (c->dev) {
                char why[256];
                int r = devpool_map(c->dev, m->chunk_idx, fd, read_only, why, sizeof(why));
                close(fd);
                if (r < 0)
                        return client_error(c, r, "mapping chunk %llu on the GPU: %s",
                                            (unsigned long long)m->chunk_idx, why);
        } else {
                int prot = PROT_READ | (read_only ? 0 : PROT_WRITE);
                void *p = mmap(c->base + m->chunk_idx * c->chunk_bytes, c->chunk_bytes, prot,
                               MAP_SHARED | MAP_FIXED, fd, 0);
                close(fd);
                if (p == MAP_FAILED)
                        return client_error(c, -errno, "mapping chunk %llu: %s",
                                            (unsigned long long)m->chunk_idx, strerror(errno));
                /* a child forked without exec must not keep the pool: it would outlive our death */
                madvise(p, c->chunk_bytes, MADV_DONTFORK);
        }
        c->mapped[m->chunk_idx] = read_only ? MAPPED_RO : MAPPED_RW;
        c->mapped_gen[m->chunk_idx] = m->generation;
        return 0;
}

static bool in_chunk(const struct kvc_client *c, uint64_t off, uint64_t idx) {
        return off / c->chunk_bytes == idx;
}

/* Whether anything of the client's (a block, a plan buffer) lies in chunk idx. */
static bool chunk_in_use(const struct kvc_client *c, uint64_t idx) {
        for (const struct kvc_session *s = c->sessions; s; s = s->next) {
                if (s->plan_bytes && in_chunk(c, s->plan_offset, idx))
                        return true;
                for (uint32_t l = 0; s->layers && l < s->g.n_layers; l++) {
                        const struct layer *L = &s->layers[l];
                        for (uint32_t t = 0; t < s->n_tiers; t++)
                                for (uint32_t b = 0; b < L->t[t].n; b++)
                                        if (in_chunk(c, L->t[t].offs[b], idx))
                                                return true;
                }
        }
        return false;
}

/* kvcd asks chunk idx back: unmap it and say so. A chunk that is not mapped, or still holds
 * something of ours, is kept and not acknowledged (kvcd then keeps it marked until we go). */
static int unmap_chunk(struct kvc_client *c, uint64_t idx) {
        if (idx >= c->n_chunks || !c->mapped[idx] || chunk_in_use(c, idx))
                return 0;
        if (c->dev) {
                char why[256];
                int r = devpool_unmap(c->dev, idx, why, sizeof(why));
                if (r < 0)
                        return client_error(c, r, "giving chunk %llu back: %s", (unsigned long long)idx, why);
        } else if (mmap(c->base + idx * c->chunk_bytes, c->chunk_bytes, PROT_NONE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED) {
                return client_error(c, -errno, "giving chunk %llu back: %s", (unsigned long long)idx,
                                    strerror(errno));
        }
        c->mapped[idx] = 0;
        struct fdwire_msg m = { .magic = FDWIRE_MAGIC,
                                .version = FDWIRE_VERSION,
                                .kind = FDWIRE_UNMAPPED,
                                .chunk_idx = idx,
                                .chunk_bytes = c->chunk_bytes };
        int r = fdwire_send(c->fd, &m, -1);
        return r < 0 ? client_error(c, r, "telling kvcd chunk %llu is unmapped: %s", (unsigned long long)idx,
                                    strerror(-r))
                     : 0;
}

/* Handles one side-channel record (its fd, if any, is consumed). */
int mapping_side_record(struct kvc_client *c, const struct fdwire_msg *m, int fd) {
        if (m->kind == FDWIRE_CHUNK)
                return map_chunk(c, m, fd);
        if (fd >= 0)
                close(fd);
        if (m->kind == FDWIRE_UNMAP)
                return unmap_chunk(c, m->chunk_idx);
        return client_error(c, -EPROTO, "kvcd sent an unexpected side-channel record (kind %u)", m->kind);
}

static int ensure_chunk(struct kvc_client *c, uint64_t idx) {
        while (!c->mapped[idx]) {
                struct fdwire_msg m;
                int fd, r = fdwire_recv(c->fd, &m, &fd, c->timeout_ms);
                if (r < 0)
                        return client_error(c, r, "waiting for chunk %llu: %s", (unsigned long long)idx,
                                            strerror(-r));
                if ((r = mapping_side_record(c, &m, fd)) < 0)
                        return r;
        }
        return 0;
}

/* Copies n bytes at a pool offset out of the pool (host memory, or the GPU's). */
int mapping_copy_out(const struct kvc_client *c, uint64_t off, void *dst, size_t n) {
        if (c->dev)
                return devpool_read(c->dev, off, dst, n);
        memcpy(dst, c->base + off, n);
        return 0;
}

/* Checks that `bytes` at pool offset off lie inside one chunk, then maps that chunk. */
int mapping_check_region(struct kvc_client *c, uint64_t off, uint64_t bytes) {
        uint64_t idx = off / c->chunk_bytes;
        if (off % 64 || idx >= c->n_chunks || off % c->chunk_bytes + bytes > c->chunk_bytes)
                return client_error(c, -EPROTO, "kvcd named a region outside the pool (offset %llu)",
                                    (unsigned long long)off);
        return ensure_chunk(c, idx);
}

int kvc_pool_is_device(const struct kvc_client *c) {
        return c->dev != NULL;
}

void *kvc_pool_base(const struct kvc_client *c) {
        return c->base == MAP_FAILED ? NULL : c->base;
}

int kvc_pool_device(const struct kvc_client *c) {
        return c->dev ? devpool_device(c->dev) : -1;
}
