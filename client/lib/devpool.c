/* devpool.c: a device pool in a client process (see devpool.h).
 *
 * The imported handle is released as soon as the chunk is mapped: the mapping keeps the memory,
 * so unmapping is the whole of giving a chunk back, and a process that dies mid-way leaves
 * nothing behind (its mappings go with its context). Per chunk only "mapped or not" is kept.
 */
#define _GNU_SOURCE
#include "devpool.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/driver.h"

struct devpool {
        const struct cuda_driver *drv;
        struct cuda_device_info dev;
        cuda_dptr base;
        uint64_t pool_bytes;
        uint64_t chunk_bytes;
        uint64_t n_chunks;
        uint8_t *mapped;
};

static int drv_fail(const struct devpool *p, cuda_result r, const char *what, char *why, size_t why_len) {
        char e[96];
        snprintf(why, why_len, "%s: %s", what, cuda_driver_error(p->drv, r, e, sizeof(e)));
        return r == CUDA_DRV_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
}

int devpool_open(const struct cuda_driver *drv, const uint8_t uuid[16], uint64_t pool_bytes,
                 uint64_t chunk_bytes, struct devpool **ret, char *why, size_t why_len) {
        if (chunk_bytes == 0 || pool_bytes < chunk_bytes || pool_bytes % chunk_bytes) {
                snprintf(why, why_len, "kvcd named a pool of %llu bytes in %llu-byte chunks",
                         (unsigned long long)pool_bytes, (unsigned long long)chunk_bytes);
                return -EPROTO;
        }
        struct devpool *p = calloc(1, sizeof(*p));
        if (!p)
                return -ENOMEM;
        p->drv = drv;
        p->pool_bytes = pool_bytes;
        p->chunk_bytes = chunk_bytes;
        p->n_chunks = pool_bytes / chunk_bytes;
        p->mapped = calloc(p->n_chunks, 1);
        struct cuda_uuid u;
        memcpy(u.bytes, uuid, sizeof(u.bytes));
        int r = p->mapped ? cuda_driver_open(drv, &u, &p->dev, why, why_len) : -ENOMEM;
        if (r < 0) {
                free(p->mapped);
                free(p);
                return r;
        }
        if (chunk_bytes % p->dev.granularity) {
                snprintf(why, why_len,
                         "kvcd's chunks of %llu bytes are not a multiple of the granularity of %s here",
                         (unsigned long long)chunk_bytes, p->dev.uuid_text);
                devpool_free(p);
                return -EPROTO;
        }
        cuda_result cr = drv->cuMemAddressReserve(&p->base, pool_bytes, p->dev.granularity, 0, 0);
        if (cr != CUDA_DRV_SUCCESS) {
                p->base = 0;
                r = drv_fail(p, cr, "reserving the pool's device address range (cuMemAddressReserve)", why,
                             why_len);
                devpool_free(p);
                return r;
        }
        *ret = p;
        return 0;
}

struct devpool *devpool_free(struct devpool *p) {
        if (!p)
                return NULL;
        for (uint64_t i = 0; p->base && i < p->n_chunks; i++)
                if (p->mapped[i])
                        p->drv->cuMemUnmap(p->base + i * p->chunk_bytes, p->chunk_bytes);
        if (p->base)
                p->drv->cuMemAddressFree(p->base, p->pool_bytes);
        cuda_driver_close(p->drv, &p->dev);
        free(p->mapped);
        free(p);
        return NULL;
}

int devpool_map(struct devpool *p, uint64_t idx, int fd, bool read_only, char *why, size_t why_len) {
        if (idx >= p->n_chunks) {
                snprintf(why, why_len, "chunk %llu is outside the pool", (unsigned long long)idx);
                return -EINVAL;
        }
        if (p->mapped[idx]) {
                snprintf(why, why_len, "chunk %llu is mapped already", (unsigned long long)idx);
                return -EEXIST;
        }
        const struct cuda_driver *d = p->drv;
        cuda_dptr at = p->base + idx * p->chunk_bytes;
        cuda_mem_handle h;
        cuda_result cr = d->cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
                                                           CUDA_DRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (cr != CUDA_DRV_SUCCESS)
                return drv_fail(p, cr, "importing a chunk (cuMemImportFromShareableHandle)", why, why_len);
        cr = d->cuMemMap(at, p->chunk_bytes, 0, h, 0);
        d->cuMemRelease(h); /* mapped or not, this process needs no handle of its own */
        if (cr != CUDA_DRV_SUCCESS)
                return drv_fail(p, cr, "mapping a chunk (cuMemMap)", why, why_len);
        struct cuda_mem_access_desc a = {
                .location = { .type = CUDA_DRV_MEM_LOCATION_TYPE_DEVICE, .id = p->dev.dev },
                .flags = read_only ? CUDA_DRV_MEM_ACCESS_FLAGS_PROT_READ
                                   : CUDA_DRV_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        if ((cr = d->cuMemSetAccess(at, p->chunk_bytes, &a, 1)) != CUDA_DRV_SUCCESS) {
                d->cuMemUnmap(at, p->chunk_bytes);
                return drv_fail(p, cr, "cuMemSetAccess", why, why_len);
        }
        p->mapped[idx] = 1;
        return 0;
}

int devpool_unmap(struct devpool *p, uint64_t idx, char *why, size_t why_len) {
        if (idx >= p->n_chunks || !p->mapped[idx]) {
                snprintf(why, why_len, "chunk %llu is not mapped", (unsigned long long)idx);
                return -EINVAL;
        }
        cuda_result cr = p->drv->cuMemUnmap(p->base + idx * p->chunk_bytes, p->chunk_bytes);
        if (cr != CUDA_DRV_SUCCESS)
                return drv_fail(p, cr, "cuMemUnmap", why, why_len);
        p->mapped[idx] = 0;
        return 0;
}

bool devpool_mapped(const struct devpool *p, uint64_t idx) {
        return idx < p->n_chunks && p->mapped[idx];
}

uint64_t devpool_base(const struct devpool *p) {
        return p->base;
}

int devpool_device(const struct devpool *p) {
        return p->dev.dev;
}

static bool span_mapped(const struct devpool *p, uint64_t offset, size_t n) {
        if (offset > p->pool_bytes || n > p->pool_bytes - offset)
                return false;
        for (uint64_t i = offset / p->chunk_bytes; n && i <= (offset + n - 1) / p->chunk_bytes; i++)
                if (!p->mapped[i])
                        return false;
        return true;
}

int devpool_read(const struct devpool *p, uint64_t offset, void *dst, size_t n) {
        if (!span_mapped(p, offset, n))
                return -EINVAL;
        return n == 0 || p->drv->cuMemcpyDtoH(dst, p->base + offset, n) == CUDA_DRV_SUCCESS ? 0 : -EIO;
}

int devpool_write(struct devpool *p, uint64_t offset, const void *src, size_t n) {
        if (!span_mapped(p, offset, n))
                return -EINVAL;
        return n == 0 || p->drv->cuMemcpyHtoD(p->base + offset, src, n) == CUDA_DRV_SUCCESS ? 0 : -EIO;
}

int devpool_copy(struct devpool *p, uint64_t dst, uint64_t src, size_t n) {
        if (!span_mapped(p, dst, n) || !span_mapped(p, src, n))
                return -EINVAL;
        if (n == 0)
                return 0;
        /* device to device may return before the copy is done: the plan is acknowledged after it */
        return p->drv->cuMemcpyDtoD(p->base + dst, p->base + src, n) == CUDA_DRV_SUCCESS &&
                               p->drv->cuCtxSynchronize() == CUDA_DRV_SUCCESS
                       ? 0
                       : -EIO;
}
