/* backend.h: where pool chunks come from. One row per backend in backend.c's table, selected by
 * name (`kvcd --backend`). A chunk is a fixed-size piece of memory the daemon maps at a given
 * address and can hand to one client process as a file descriptor.
 *
 *   host  sealed memfd chunks (memory is zeroed by punching a hole); the default, and the one
 *         every test uses.
 *   cuda  CUDA VMM chunks exported as POSIX fds (not built yet: see the README's roadmap).
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

struct backend_chunk {
        int fd;       /* the descriptor sent to the owning client */
        uint8_t *map; /* the daemon's own mapping */
};

struct backend_ops {
        const char *name;
        /* Creates a chunk of `bytes` and maps it at addr (a page of a PROT_NONE reservation). */
        int (*chunk_create)(uint64_t bytes, uint8_t *addr, struct backend_chunk *ret);
        /* Zeroes a chunk before it goes to another client. */
        int (*chunk_scrub)(struct backend_chunk *c, uint64_t bytes);
        /* Unmaps and closes; the memory goes when the last client mapping goes too. */
        void (*chunk_destroy)(struct backend_chunk *c, uint64_t bytes);
        /* kvcd's own reads and writes of chunk memory (side arrays, plan buffers, log-weights):
         * host memory is read in place, device memory is copied. */
        int (*read)(const struct backend_chunk *c, uint64_t offset, void *dst, size_t n);
        int (*write)(struct backend_chunk *c, uint64_t offset, const void *src, size_t n);
};

/* The backend called name ("host", "auto"); -ENOENT when unknown, -ENOTSUP when not built. */
int backend_find(const char *name, const struct backend_ops **ret);
