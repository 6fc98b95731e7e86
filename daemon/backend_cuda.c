/* backend_cuda.c: the cuda backend: pool chunks are CUDA VMM allocations on one GPU, exported to
 * clients as POSIX file descriptors (docs/gpu.md has the whole path).
 *
 *   open     loads the driver (dlopen, or the table a test set), finds the device by UUID, checks
 *            the chunk size against the allocation granularity, makes the device's primary context
 *            current and reserves one device address range for the whole pool (cuMemAddressReserve)
 *   create   cuMemCreate (pinned device memory, POSIX-fd handle type), cuMemExportToShareableHandle
 *            (the fd the pool hands out), cuMemMap + cuMemSetAccess into a free slot of kvcd's
 *            range, cuMemsetD8 to zero (a fresh chunk reads as zeros, as a memfd does)
 *   adopt    a chunk kept across a restart (its fd came back from systemd's fd store):
 *            cuMemImportFromShareableHandle, then mapped like a new one, its bytes untouched
 *            (whether a new process may import an fd whose exporter died is platform.md §7.4,
 *            still to be seen on a GPU)
 *   scrub    cuMemsetD8 + cuCtxSynchronize
 *   destroy  cuMemUnmap, cuMemRelease, close the fd: the physical memory goes when the last client
 *            mapping of it goes too (the driver refcounts it)
 *   read     cuMemcpyDtoH at the chunk's device address + offset (returns once copied)
 *   write    cuMemcpyHtoD + cuCtxSynchronize: from pageable memory the copy may still be in flight
 *            when cuMemcpyHtoD returns, and a plan must be in the buffer before its message leaves
 *
 * kvcd's slot for a chunk is independent of the chunk's pool index (kvcd only ever addresses a
 * chunk through its own record), so the range is a simple slot table: one slot per chunk the pool
 * may create. The host address the pool passes to chunk_create is not used.
 *
 * State is the process's (one primary context per device per process, one pool per kvcd), held
 * in `cb` between open and close. kvcd is single-threaded, and the context is made current on the
 * thread that opens, which is the thread that runs the loop.
 *
 * Every failure of a driver call is logged with the driver's code and mapped to an errno:
 * CUDA_ERROR_OUT_OF_MEMORY to -ENOMEM (the pool answers the client ENOSPC-like), the rest to
 * -EIO. Nothing is left behind by a failed create: what was made is undone in reverse order.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "cuda/driver.h"
#include "log.h"

static struct {
        const struct cuda_driver *injected; /* a test's table, used instead of dlopen */
        struct cuda_driver loaded;          /* the dlopen'ed table */
        const struct cuda_driver *drv;      /* NULL while closed */
        struct cuda_device_info dev;
        cuda_dptr va;
        uint64_t va_bytes;
        uint64_t chunk_bytes;
        uint32_t n_slots;
        uint8_t *slot_used;
} cb;

void backend_cuda_set_driver(const struct cuda_driver *drv) {
        cb.injected = drv;
}

static int cuda_errno(cuda_result r, const char *what) {
        char e[96];
        log_error("cuda backend: %s: %s", what, cuda_driver_error(cb.drv, r, e, sizeof(e)));
        return r == CUDA_DRV_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
}

static void cuda_close(void) {
        if (!cb.drv)
                return;
        if (cb.va)
                cb.drv->cuMemAddressFree(cb.va, cb.va_bytes);
        free(cb.slot_used);
        cuda_driver_close(cb.drv, &cb.dev);
        if (cb.drv == &cb.loaded)
                cuda_driver_unload(&cb.loaded);
        const struct cuda_driver *keep = cb.injected;
        memset(&cb, 0, sizeof(cb));
        cb.injected = keep;
}

static int cuda_open(const struct backend_params *p, char *why, size_t why_len) {
        struct cuda_uuid want;
        int r;
        if (cb.drv) {
                snprintf(why, why_len, "the cuda backend is already open");
                return -EALREADY;
        }
        if (p->chunk_bytes == 0 || p->va_bytes < p->chunk_bytes) {
                snprintf(why, why_len, "a pool of %llu bytes holds no chunk of %llu bytes",
                         (unsigned long long)p->va_bytes, (unsigned long long)p->chunk_bytes);
                return -EINVAL;
        }
        if (p->device && cuda_uuid_parse(p->device, &want) < 0) {
                snprintf(why, why_len,
                         "%s is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as nvidia-smi -L "
                         "prints it)",
                         p->device);
                return -EINVAL;
        }
        if (cb.injected) {
                cb.drv = cb.injected;
        } else {
                if ((r = cuda_driver_load(NULL, &cb.loaded, why, why_len)) < 0)
                        return -ENODEV; /* no driver, or one without the VMM API */
                cb.drv = &cb.loaded;
        }
        if ((r = cuda_driver_open(cb.drv, p->device ? &want : NULL, &cb.dev, why, why_len)) < 0)
                goto fail;
        if (p->chunk_bytes % cb.dev.granularity) {
                snprintf(why, why_len,
                         "--chunk-bytes %llu is not a multiple of the allocation granularity of %s (%llu "
                         "bytes)",
                         (unsigned long long)p->chunk_bytes, cb.dev.uuid_text,
                         (unsigned long long)cb.dev.granularity);
                r = -EINVAL;
                goto fail;
        }
        cb.chunk_bytes = p->chunk_bytes;
        cb.n_slots = (uint32_t)(p->va_bytes / p->chunk_bytes);
        cb.va_bytes = (uint64_t)cb.n_slots * p->chunk_bytes;
        cb.slot_used = calloc(cb.n_slots, 1);
        if (!cb.slot_used) {
                r = -ENOMEM;
                snprintf(why, why_len, "out of memory");
                goto fail;
        }
        cuda_result cr = cb.drv->cuMemAddressReserve(&cb.va, cb.va_bytes, cb.dev.granularity, 0, 0);
        if (cr != CUDA_DRV_SUCCESS) {
                char e[96];
                snprintf(why, why_len, "cuMemAddressReserve of %llu bytes on %s: %s",
                         (unsigned long long)cb.va_bytes, cb.dev.uuid_text,
                         cuda_driver_error(cb.drv, cr, e, sizeof(e)));
                cb.va = 0;
                r = cr == CUDA_DRV_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
                goto fail;
        }
        return 0;
fail:
        cuda_close();
        return r;
}

static void cuda_get_info(struct backend_info *ret) {
        *ret = (struct backend_info){ .device = true,
                                      .driver_version = cb.dev.driver_version,
                                      .granularity = cb.dev.granularity };
        memcpy(ret->device_uuid, cb.dev.uuid.bytes, sizeof(ret->device_uuid));
        memcpy(ret->device_text, cb.dev.uuid_text, sizeof(ret->device_text));
        memcpy(ret->device_name, cb.dev.name, sizeof(ret->device_name));
}

static int take_slot(uint64_t bytes, cuda_dptr *ret) {
        if (!cb.drv || bytes != cb.chunk_bytes)
                return -EINVAL;
        for (uint32_t slot = 0; slot < cb.n_slots; slot++) {
                if (!cb.slot_used[slot]) {
                        *ret = cb.va + (uint64_t)slot * bytes;
                        return 0;
                }
        }
        return -ENOSPC;
}

/* Maps allocation h at `at` in kvcd's range, read-write, and marks the slot taken. */
static int map_at(cuda_dptr at, uint64_t bytes, cuda_mem_handle h) {
        struct cuda_mem_access_desc rw = {
                .location = { .type = CUDA_DRV_MEM_LOCATION_TYPE_DEVICE, .id = cb.dev.dev },
                .flags = CUDA_DRV_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        cuda_result cr;
        if ((cr = cb.drv->cuMemMap(at, bytes, 0, h, 0)) != CUDA_DRV_SUCCESS)
                return cuda_errno(cr, "cuMemMap");
        if ((cr = cb.drv->cuMemSetAccess(at, bytes, &rw, 1)) != CUDA_DRV_SUCCESS) {
                cb.drv->cuMemUnmap(at, bytes);
                return cuda_errno(cr, "cuMemSetAccess");
        }
        cb.slot_used[(at - cb.va) / bytes] = 1;
        return 0;
}

static int cuda_chunk_create(uint64_t bytes, uint8_t *addr, struct backend_chunk *ret) {
        (void)addr; /* a host address: device chunks go into kvcd's device range */
        cuda_dptr at;
        int r = take_slot(bytes, &at);
        if (r < 0)
                return r;
        const struct cuda_driver *d = cb.drv;
        struct cuda_mem_alloc_prop prop = {
                .type = CUDA_DRV_MEM_ALLOCATION_TYPE_PINNED,
                .requested_handle_types = CUDA_DRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                .location = { .type = CUDA_DRV_MEM_LOCATION_TYPE_DEVICE, .id = cb.dev.dev },
        };
        cuda_mem_handle h;
        int fd = -1;
        cuda_result cr;

        if ((cr = d->cuMemCreate(&h, bytes, &prop, 0)) != CUDA_DRV_SUCCESS)
                return cuda_errno(cr, "cuMemCreate");
        if ((cr = d->cuMemExportToShareableHandle(&fd, h, CUDA_DRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                                  0)) != CUDA_DRV_SUCCESS) {
                r = cuda_errno(cr, "cuMemExportToShareableHandle");
                goto release;
        }
        if ((r = map_at(at, bytes, h)) < 0)
                goto close_fd;
        if ((cr = d->cuMemsetD8(at, 0, bytes)) != CUDA_DRV_SUCCESS ||
            (cr = d->cuCtxSynchronize()) != CUDA_DRV_SUCCESS) {
                r = cuda_errno(cr, "zeroing a new chunk");
                d->cuMemUnmap(at, bytes);
                cb.slot_used[(at - cb.va) / bytes] = 0;
                goto close_fd;
        }
        *ret = (struct backend_chunk){ .fd = fd, .map = NULL, .handle = h, .dptr = at };
        return 0;
close_fd:
        close(fd);
release:
        d->cuMemRelease(h);
        return r;
}

static int cuda_chunk_adopt(int fd, uint64_t bytes, uint8_t *addr, struct backend_chunk *ret) {
        (void)addr;
        cuda_dptr at;
        int r = take_slot(bytes, &at);
        if (r < 0)
                return r;
        cuda_mem_handle h;
        cuda_result cr = cb.drv->cuMemImportFromShareableHandle(
                &h, (void *)(intptr_t)fd, CUDA_DRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (cr != CUDA_DRV_SUCCESS)
                return cuda_errno(cr, "cuMemImportFromShareableHandle (a chunk kept across a restart)");
        if ((r = map_at(at, bytes, h)) < 0) {
                cb.drv->cuMemRelease(h);
                return r;
        }
        *ret = (struct backend_chunk){ .fd = fd, .map = NULL, .handle = h, .dptr = at };
        return 0;
}

static int cuda_chunk_scrub(struct backend_chunk *c, uint64_t bytes) {
        cuda_result cr = cb.drv->cuMemsetD8(c->dptr, 0, bytes);
        if (cr == CUDA_DRV_SUCCESS)
                cr = cb.drv->cuCtxSynchronize();
        return cr == CUDA_DRV_SUCCESS ? 0 : cuda_errno(cr, "scrubbing a chunk (cuMemsetD8)");
}

static void cuda_chunk_destroy(struct backend_chunk *c, uint64_t bytes) {
        if (!cb.drv || c->fd < 0)
                return;
        cuda_result cr;
        if ((cr = cb.drv->cuMemUnmap(c->dptr, bytes)) != CUDA_DRV_SUCCESS)
                cuda_errno(cr, "cuMemUnmap");
        if ((cr = cb.drv->cuMemRelease(c->handle)) != CUDA_DRV_SUCCESS)
                cuda_errno(cr, "cuMemRelease");
        close(c->fd);
        uint64_t slot = (c->dptr - cb.va) / cb.chunk_bytes;
        if (slot < cb.n_slots)
                cb.slot_used[slot] = 0;
        *c = (struct backend_chunk){ .fd = -1 };
}

static int cuda_read(const struct backend_chunk *c, uint64_t offset, void *dst, size_t n) {
        cuda_result cr = cb.drv->cuMemcpyDtoH(dst, c->dptr + offset, n);
        return cr == CUDA_DRV_SUCCESS ? 0 : cuda_errno(cr, "cuMemcpyDtoH");
}

static int cuda_write(struct backend_chunk *c, uint64_t offset, const void *src, size_t n) {
        cuda_result cr = cb.drv->cuMemcpyHtoD(c->dptr + offset, src, n);
        if (cr == CUDA_DRV_SUCCESS)
                cr = cb.drv->cuCtxSynchronize();
        return cr == CUDA_DRV_SUCCESS ? 0 : cuda_errno(cr, "cuMemcpyHtoD");
}

const struct backend_ops backend_cuda_ops = {
        .name = "cuda",
        .device = true,
        .open = cuda_open,
        .close = cuda_close,
        .get_info = cuda_get_info,
        .chunk_create = cuda_chunk_create,
        .chunk_adopt = cuda_chunk_adopt,
        .chunk_scrub = cuda_chunk_scrub,
        .chunk_destroy = cuda_chunk_destroy,
        .read = cuda_read,
        .write = cuda_write,
};
