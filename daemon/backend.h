/* backend.h: where pool chunks come from. One row per backend in backend.c's table, selected by
 * name (`kvcd --backend`). A chunk is a fixed-size piece of memory the daemon can read and write
 * and can hand to one client process as a file descriptor.
 *
 *   host  sealed memfd chunks, mapped by kvcd (memory is zeroed by punching a hole); the default,
 *         and the one every test uses.
 *   cuda  CUDA VMM chunks (cuMemCreate with POSIX-fd handles) on one GPU, exported as fds; kvcd
 *         maps them into a device address range of its own and copies in and out of them
 *         (backend_cuda.c; docs/gpu.md).
 *   auto  cuda when a driver and a usable device are present, host otherwise.
 *
 * A backend with state (cuda: the driver, the device's primary context, the device address
 * range) is opened once per process before the pool creates chunks and closed after the pool is
 * gone: CUDA gives a process one primary context per device, so the state is the process's too.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct backend_chunk {
        int fd;          /* the descriptor sent to the owning client */
        uint8_t *map;    /* host: the daemon's own mapping; NULL for device memory */
        uint64_t handle; /* cuda: the allocation handle (CUmemGenericAllocationHandle) */
        uint64_t dptr;   /* cuda: where kvcd maps the chunk in its device address range */
};

/* What a backend is opened with. */
struct backend_params {
        uint64_t va_bytes;    /* the pool's address range: every chunk it may create */
        uint64_t chunk_bytes; /* the chunk size */
        const char *device;   /* cuda: the GPU's UUID (nvidia-smi -L); NULL: device 0 */
};

/* What an open backend serves from. */
struct backend_info {
        bool device; /* chunks are GPU memory: clients import them with the CUDA driver */
        uint8_t device_uuid[16];
        char device_text[41]; /* "GPU-...", or "" */
        char device_name[96];
        int driver_version;   /* cuDriverGetVersion, e.g. 13000 */
        uint64_t granularity; /* the chunk size must be a multiple of this */
};

struct backend_ops {
        const char *name;
        bool device; /* see backend_info.device */
        /* Readies the backend for a pool (NULL: nothing to do). -ENODEV when it cannot run on this
         * machine (no driver, a stub driver, no device), -EINVAL for parameters it cannot serve
         * (a chunk size that is not a multiple of the granularity), -ENXIO for a device that is not
         * there; why says what. */
        int (*open)(const struct backend_params *p, char *why, size_t why_len);
        /* Undoes open, once the pool has destroyed its chunks. Safe when open failed or never ran. */
        void (*close)(void);
        void (*get_info)(struct backend_info *ret); /* NULL: host memory, nothing to describe */
        /* Creates a chunk of `bytes`; host chunks are mapped at addr (a page of a PROT_NONE
         * reservation), device chunks where the backend places them. A new chunk reads as zeros. */
        int (*chunk_create)(uint64_t bytes, uint8_t *addr, struct backend_chunk *ret);
        /* Maps a chunk kept across a restart (its fd came back from systemd's fd store). */
        int (*chunk_adopt)(int fd, uint64_t bytes, uint8_t *addr, struct backend_chunk *ret);
        /* Zeroes a chunk before it goes to another client. */
        int (*chunk_scrub)(struct backend_chunk *c, uint64_t bytes);
        /* Unmaps and closes; the memory goes when the last client mapping goes too. */
        void (*chunk_destroy)(struct backend_chunk *c, uint64_t bytes);
        /* kvcd's own reads and writes of chunk memory (side arrays, plan buffers, log-weights):
         * host memory is read in place, device memory is copied. A write is complete, and visible
         * to the client, when it returns. */
        int (*read)(const struct backend_chunk *c, uint64_t offset, void *dst, size_t n);
        int (*write)(struct backend_chunk *c, uint64_t offset, const void *src, size_t n);
};

/* The backend called name ("host", "cuda", "auto" finds host); -ENOENT when unknown. */
int backend_find(const char *name, const struct backend_ops **ret);

/* Finds and opens the backend called name. "auto" opens cuda and, when that answers -ENODEV (no
 * usable CUDA here: no driver, a stub, no device), host; why then says why cuda was passed over (log it), and
 * is "" otherwise. On failure why says what failed and the error is open's (or backend_find's). */
int backend_select(const char *name, const struct backend_params *p, const struct backend_ops **ret,
                   char *why, size_t why_len);
/* Closes what backend_select opened. Accepts NULL. */
void backend_close(const struct backend_ops *ops);
/* The backend's description; zeros (device false) for host memory. */
void backend_get_info(const struct backend_ops *ops, struct backend_info *ret);

/* backend_cuda.c: the cuda backend's row, and its driver. The backend dlopens libcuda.so.1 when
 * it opens unless a driver table was set here first: tests set a fake (tests/gpu/fakecuda.c).
 * NULL goes back to dlopen. The table must outlive the backend's use of it. */
struct cuda_driver;
extern const struct backend_ops backend_cuda_ops;
void backend_cuda_set_driver(const struct cuda_driver *drv);
