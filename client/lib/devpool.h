/* devpool.h: libkvc's side of a device pool (kvcd's cuda backend): one reserved device address
 * range, and the chunks kvcd grants imported and mapped into it.
 *
 *   open    find the device whose UUID kvcd named (this process's ordinal for it may differ:
 *           CUDA_VISIBLE_DEVICES), make its primary context current (the one the CUDA runtime
 *           uses, so runtime kernels see the mappings), cuMemAddressReserve(pool_bytes)
 *   map     cuMemImportFromShareableHandle(fd) -> cuMemMap at base + idx * chunk_bytes ->
 *           cuMemRelease of the imported handle (the mapping holds the memory) -> cuMemSetAccess
 *           (read-write, or read-only for a shared prefix)
 *   unmap   cuMemUnmap: this process holds no reference to the chunk any more
 *   free    unmaps what is mapped, frees the range, releases the context
 *
 * The driver table is the caller's (client.c loads it with cuda_driver_load; tests pass a fake).
 * Errors: -errno with a message in why; the fd passed to map stays the caller's.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct cuda_driver;
struct devpool;

int devpool_open(const struct cuda_driver *drv, const uint8_t uuid[16], uint64_t pool_bytes,
                 uint64_t chunk_bytes, struct devpool **ret, char *why, size_t why_len);
struct devpool *devpool_free(struct devpool *p);

/* -EINVAL for an index outside the range, -EEXIST when the chunk is mapped already, -EIO when the
 * driver refuses (why has its code); nothing stays mapped or imported on failure. */
int devpool_map(struct devpool *p, uint64_t idx, int fd, bool read_only, char *why, size_t why_len);
/* -EINVAL when the chunk is not mapped. */
int devpool_unmap(struct devpool *p, uint64_t idx, char *why, size_t why_len);
bool devpool_mapped(const struct devpool *p, uint64_t idx);

/* The range's base (a device pointer) and this process's ordinal of the device. */
uint64_t devpool_base(const struct devpool *p);
int devpool_device(const struct devpool *p);

/* Copies n bytes at a pool offset out of (into) device memory; the range must lie in mapped
 * chunks. -EINVAL otherwise, -EIO when the driver refuses. */
int devpool_read(const struct devpool *p, uint64_t offset, void *dst, size_t n);
int devpool_write(struct devpool *p, uint64_t offset, const void *src, size_t n);
/* Copies n bytes from one pool offset to another, on the device, and waits for the copy (block
 * relocation). -EINVAL outside mapped chunks, -EIO when the driver refuses. */
int devpool_copy(struct devpool *p, uint64_t dst, uint64_t src, size_t n);
