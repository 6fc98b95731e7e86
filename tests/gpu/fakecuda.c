/* fakecuda.c: a CUDA driver without a GPU, for tests: the entry points of kernels/cuda/driver.h
 * over host memory.
 *
 * Two uses:
 *   - built as $(BUILD)/fakecuda/libcuda.so.1 (kernels/cuda.mk), so the real kvcd and libkvc load
 *     it with dlopen (LD_LIBRARY_PATH): tests/gpu/ipc.sh --fake runs the GPU check's whole flow on
 *     a CPU, with the CUDA kernels under the emulator (tests/gpu/emu);
 *   - #included by tests/unit/test_cuda_backend.c, which fills a struct cuda_driver with
 *     fakecuda_fill(), turns the knobs in `fc` and reads its counters.
 *
 * Device memory is host memory. cuMemCreate makes a memfd; export dups it; import dups the fd it
 * is given; cuMemAddressReserve reserves PROT_NONE pages; cuMemMap maps the memfd there
 * (MAP_SHARED: a chunk is shared between processes as a GPU allocation is) but inaccessible until
 * cuMemSetAccess; cuMemUnmap puts the PROT_NONE pages back. cuMemsetD8 and cuMemcpy* check that
 * their range is mapped and accessible, then memset/memcpy. Device pointers are host pointers,
 * which is what the emulated kernels need. The rules of the real driver that kvcd relies on are
 * enforced: sizes and addresses multiples of the granularity, no partial unmap, no freeing a range
 * that still has mappings, POSIX-fd handles requested at create before export.
 *
 * Environment (read once, at the first call): FAKECUDA_INIT (what cuInit answers, e.g. 34),
 * FAKECUDA_DEVICES (how many; 0: cuInit answers 100), FAKECUDA_GRANULARITY (bytes).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda/driver.h"

#define FC_MAX_ALLOCS 4096
#define FC_MAX_MAPS   4096
#define FC_MAX_RANGES 64

#ifdef FAKECUDA_STATIC
#define FC_API static
#else
#define FC_API __attribute__((visibility("default")))
#endif

struct fc_alloc {
        int fd;
        size_t size;
        bool live;
};

struct fc_map {
        uintptr_t at;
        size_t size;
        int prot; /* 0 until cuMemSetAccess */
        bool live;
};

struct fc_range {
        uintptr_t base;
        size_t size;
        bool live;
};

static struct fakecuda {
        bool ready;
        /* knobs */
        cuda_result init_result;
        int n_devices;
        int vmm, posix_fd;
        int driver_version;
        size_t granularity;
        cuda_result fail_create, fail_export, fail_map, fail_set_access, fail_memset, fail_reserve,
                fail_import;
        /* what happened */
        int n_init, n_create, n_release, n_export, n_import, n_map, n_unmap, n_set_access, n_memset, n_dtoh,
                n_htod, n_dtod, n_reserve, n_address_free, n_sync, ctx_retained;
        cuda_context current;
        uintptr_t last_memset_ptr;
        size_t last_memset_bytes;
        int last_memset_value;
        uintptr_t last_htod_dst, last_dtoh_src;
        int last_create_location, last_access_location, last_access_flags;
        int last_exported_fd;
        struct fc_alloc allocs[FC_MAX_ALLOCS];
        struct fc_map maps[FC_MAX_MAPS];
        struct fc_range ranges[FC_MAX_RANGES];
} fc;

static void fc_setup(void) {
        if (fc.ready)
                return;
        fc.ready = true;
        fc.n_devices = 1;
        fc.vmm = fc.posix_fd = 1;
        fc.driver_version = 13000;
        fc.granularity = 2u << 20;
        const char *e;
        if ((e = getenv("FAKECUDA_INIT")))
                fc.init_result = atoi(e);
        if ((e = getenv("FAKECUDA_DEVICES")))
                fc.n_devices = atoi(e);
        if ((e = getenv("FAKECUDA_GRANULARITY")))
                fc.granularity = strtoull(e, NULL, 0);
}

static bool fc_valid_dev(cuda_device d) {
        return d >= 0 && d < fc.n_devices;
}

FC_API cuda_result cuInit(unsigned int flags) {
        fc_setup();
        fc.n_init++;
        if (flags)
                return CUDA_DRV_ERROR_INVALID_VALUE;
        if (fc.init_result)
                return fc.init_result;
        return fc.n_devices > 0 ? CUDA_DRV_SUCCESS : CUDA_DRV_ERROR_NO_DEVICE;
}

FC_API cuda_result cuDriverGetVersion(int *v) {
        fc_setup();
        *v = fc.driver_version;
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuDeviceGetCount(int *n) {
        fc_setup();
        *n = fc.n_devices;
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuDeviceGet(cuda_device *d, int ordinal) {
        if (!fc_valid_dev(ordinal))
                return CUDA_DRV_ERROR_INVALID_DEVICE;
        *d = ordinal;
        return CUDA_DRV_SUCCESS;
}

/* Device i's UUID: GPU-fa4ec0da-0000-4000-8000-0000000000ii */
FC_API cuda_result cuDeviceGetUuid_v2(struct cuda_uuid *u, cuda_device d) {
        static const unsigned char stem[16] = { 0xfa, 0x4e, 0xc0, 0xda, 0, 0, 0x40, 0, 0x80, 0 };
        if (!fc_valid_dev(d))
                return CUDA_DRV_ERROR_INVALID_DEVICE;
        memcpy(u->bytes, stem, 16);
        u->bytes[15] = (unsigned char)d;
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuDeviceGetName(char *name, int len, cuda_device d) {
        if (!fc_valid_dev(d))
                return CUDA_DRV_ERROR_INVALID_DEVICE;
        snprintf(name, (size_t)len, "fakecuda device %d", d);
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuDeviceGetAttribute(int *v, int attrib, cuda_device d) {
        if (!fc_valid_dev(d))
                return CUDA_DRV_ERROR_INVALID_DEVICE;
        *v = attrib == CUDA_DRV_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED           ? fc.vmm
             : attrib == CUDA_DRV_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED ? fc.posix_fd
                                                                                               : 0;
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuDevicePrimaryCtxRetain(cuda_context *ctx, cuda_device d) {
        if (!fc_valid_dev(d))
                return CUDA_DRV_ERROR_INVALID_DEVICE;
        fc.ctx_retained++;
        *ctx = (cuda_context)(uintptr_t)(0x1000 + d);
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuDevicePrimaryCtxRelease_v2(cuda_device d) {
        if (!fc_valid_dev(d) || fc.ctx_retained <= 0)
                return CUDA_DRV_ERROR_INVALID_VALUE;
        fc.ctx_retained--;
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuCtxSetCurrent(cuda_context ctx) {
        fc.current = ctx;
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuCtxSynchronize(void) {
        fc.n_sync++;
        return fc.current ? CUDA_DRV_SUCCESS : CUDA_DRV_ERROR_INVALID_VALUE;
}

static bool fc_prop_ok(const struct cuda_mem_alloc_prop *p) {
        return p->type == CUDA_DRV_MEM_ALLOCATION_TYPE_PINNED &&
               p->location.type == CUDA_DRV_MEM_LOCATION_TYPE_DEVICE && fc_valid_dev(p->location.id);
}

FC_API cuda_result cuMemGetAllocationGranularity(size_t *g, const struct cuda_mem_alloc_prop *p, int option) {
        if (!fc_prop_ok(p) || (option != 0 && option != 1))
                return CUDA_DRV_ERROR_INVALID_VALUE;
        *g = fc.granularity;
        return CUDA_DRV_SUCCESS;
}

static cuda_result fc_new_alloc(int fd, size_t size, cuda_mem_handle *h) {
        for (int i = 0; i < FC_MAX_ALLOCS; i++) {
                if (!fc.allocs[i].live) {
                        fc.allocs[i] = (struct fc_alloc){ .fd = fd, .size = size, .live = true };
                        *h = (cuda_mem_handle)i + 1;
                        return CUDA_DRV_SUCCESS;
                }
        }
        close(fd);
        return CUDA_DRV_ERROR_OUT_OF_MEMORY;
}

static struct fc_alloc *fc_alloc_of(cuda_mem_handle h) {
        return h >= 1 && h <= FC_MAX_ALLOCS && fc.allocs[h - 1].live ? &fc.allocs[h - 1] : NULL;
}

FC_API cuda_result cuMemCreate(cuda_mem_handle *h, size_t size, const struct cuda_mem_alloc_prop *p,
                               unsigned long long flags) {
        fc.n_create++;
        if (fc.fail_create)
                return fc.fail_create;
        if (!fc_prop_ok(p) || flags || size == 0 || size % fc.granularity)
                return CUDA_DRV_ERROR_INVALID_VALUE;
        if (p->requested_handle_types != CUDA_DRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
                return CUDA_DRV_ERROR_NOT_SUPPORTED; /* this fake exports nothing else */
        fc.last_create_location = p->location.id;
        int fd = memfd_create("fakecuda", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, (off_t)size) < 0) {
                if (fd >= 0)
                        close(fd);
                return CUDA_DRV_ERROR_OUT_OF_MEMORY;
        }
        return fc_new_alloc(fd, size, h);
}

FC_API cuda_result cuMemRelease(cuda_mem_handle h) {
        struct fc_alloc *a = fc_alloc_of(h);
        if (!a)
                return CUDA_DRV_ERROR_INVALID_VALUE;
        fc.n_release++;
        close(a->fd); /* a mapping of it keeps the memory, as on a GPU */
        a->live = false;
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuMemExportToShareableHandle(void *out, cuda_mem_handle h, int type,
                                                unsigned long long flags) {
        struct fc_alloc *a = fc_alloc_of(h);
        fc.n_export++;
        if (fc.fail_export)
                return fc.fail_export;
        if (!a || type != CUDA_DRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || flags)
                return CUDA_DRV_ERROR_INVALID_VALUE;
        int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
        if (fd < 0)
                return CUDA_DRV_ERROR_OUT_OF_MEMORY;
        memcpy(out, &fd, sizeof(fd));
        fc.last_exported_fd = fd;
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuMemImportFromShareableHandle(cuda_mem_handle *h, void *os_handle, int type) {
        fc_setup();
        fc.n_import++;
        if (fc.fail_import)
                return fc.fail_import;
        int fd = (int)(intptr_t)os_handle;
        struct stat st;
        if (type != CUDA_DRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || fstat(fd, &st) < 0 || st.st_size <= 0)
                return CUDA_DRV_ERROR_INVALID_VALUE;
        int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (mine < 0)
                return CUDA_DRV_ERROR_OUT_OF_MEMORY;
        return fc_new_alloc(mine, (size_t)st.st_size, h);
}

static struct fc_range *fc_range_of(uintptr_t at, size_t size) {
        for (int i = 0; i < FC_MAX_RANGES; i++) {
                struct fc_range *r = &fc.ranges[i];
                if (r->live && at >= r->base && size <= r->size && at - r->base <= r->size - size)
                        return r;
        }
        return NULL;
}

FC_API cuda_result cuMemAddressReserve(cuda_dptr *ptr, size_t size, size_t alignment, cuda_dptr addr,
                                       unsigned long long flags) {
        fc_setup();
        fc.n_reserve++;
        if (fc.fail_reserve)
                return fc.fail_reserve;
        if (size == 0 || size % fc.granularity || addr || flags || (alignment && alignment % fc.granularity))
                return CUDA_DRV_ERROR_INVALID_VALUE;
        size_t align = alignment ? alignment : fc.granularity;
        uint8_t *m = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED)
                return CUDA_DRV_ERROR_OUT_OF_MEMORY;
        uintptr_t base = ((uintptr_t)m + align - 1) / align * align;
        if (base > (uintptr_t)m)
                munmap(m, base - (uintptr_t)m);
        munmap((void *)(base + size), (uintptr_t)m + size + align - (base + size));
        for (int i = 0; i < FC_MAX_RANGES; i++) {
                if (!fc.ranges[i].live) {
                        fc.ranges[i] = (struct fc_range){ .base = base, .size = size, .live = true };
                        *ptr = base;
                        return CUDA_DRV_SUCCESS;
                }
        }
        munmap((void *)base, size);
        return CUDA_DRV_ERROR_OUT_OF_MEMORY;
}

FC_API cuda_result cuMemAddressFree(cuda_dptr ptr, size_t size) {
        fc.n_address_free++;
        for (int i = 0; i < FC_MAX_RANGES; i++) {
                struct fc_range *r = &fc.ranges[i];
                if (!r->live || r->base != ptr || r->size != size)
                        continue;
                for (int j = 0; j < FC_MAX_MAPS; j++)
                        if (fc.maps[j].live && fc.maps[j].at >= ptr && fc.maps[j].at < ptr + size)
                                return CUDA_DRV_ERROR_INVALID_VALUE; /* still mapped */
                munmap((void *)r->base, r->size);
                r->live = false;
                return CUDA_DRV_SUCCESS;
        }
        return CUDA_DRV_ERROR_INVALID_VALUE;
}

FC_API cuda_result cuMemMap(cuda_dptr ptr, size_t size, size_t offset, cuda_mem_handle h,
                            unsigned long long flags) {
        struct fc_alloc *a = fc_alloc_of(h);
        fc.n_map++;
        if (fc.fail_map)
                return fc.fail_map;
        if (!a || offset || flags || size != a->size || ptr % fc.granularity || !fc_range_of(ptr, size))
                return CUDA_DRV_ERROR_INVALID_VALUE;
        for (int j = 0; j < FC_MAX_MAPS; j++)
                if (fc.maps[j].live && ptr < fc.maps[j].at + fc.maps[j].size && fc.maps[j].at < ptr + size)
                        return CUDA_DRV_ERROR_INVALID_VALUE; /* overlaps a mapping */
        for (int j = 0; j < FC_MAX_MAPS; j++) {
                if (fc.maps[j].live)
                        continue;
                if (mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, 0) == MAP_FAILED)
                        return CUDA_DRV_ERROR_OUT_OF_MEMORY;
                fc.maps[j] = (struct fc_map){ .at = ptr, .size = size, .live = true };
                return CUDA_DRV_SUCCESS;
        }
        return CUDA_DRV_ERROR_OUT_OF_MEMORY;
}

FC_API cuda_result cuMemUnmap(cuda_dptr ptr, size_t size) {
        fc.n_unmap++;
        for (int j = 0; j < FC_MAX_MAPS; j++) {
                struct fc_map *m = &fc.maps[j];
                if (!m->live || m->at != ptr)
                        continue;
                if (m->size != size)
                        return CUDA_DRV_ERROR_INVALID_VALUE; /* no partial unmap */
                mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                     -1, 0);
                m->live = false;
                return CUDA_DRV_SUCCESS;
        }
        return CUDA_DRV_ERROR_INVALID_VALUE;
}

FC_API cuda_result cuMemSetAccess(cuda_dptr ptr, size_t size, const struct cuda_mem_access_desc *desc,
                                  size_t count) {
        fc.n_set_access++;
        if (fc.fail_set_access)
                return fc.fail_set_access;
        if (count != 1 || desc->location.type != CUDA_DRV_MEM_LOCATION_TYPE_DEVICE ||
            !fc_valid_dev(desc->location.id))
                return CUDA_DRV_ERROR_INVALID_VALUE;
        fc.last_access_location = desc->location.id;
        fc.last_access_flags = desc->flags;
        int prot = desc->flags == CUDA_DRV_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE
                   : desc->flags == CUDA_DRV_MEM_ACCESS_FLAGS_PROT_READ    ? PROT_READ
                                                                           : -1;
        for (int j = 0; j < FC_MAX_MAPS && prot >= 0; j++) {
                struct fc_map *m = &fc.maps[j];
                if (m->live && m->at == ptr && m->size == size) {
                        mprotect((void *)ptr, size, prot);
                        m->prot = prot;
                        return CUDA_DRV_SUCCESS;
                }
        }
        return CUDA_DRV_ERROR_INVALID_VALUE;
}

/* Whether [p, p + n) lies in mappings that allow prot. */
static bool fc_accessible(uintptr_t p, size_t n, int prot) {
        while (n) {
                const struct fc_map *hit = NULL;
                for (int j = 0; j < FC_MAX_MAPS && !hit; j++)
                        if (fc.maps[j].live && p >= fc.maps[j].at && p < fc.maps[j].at + fc.maps[j].size)
                                hit = &fc.maps[j];
                if (!hit || (hit->prot & prot) != prot)
                        return false;
                size_t in = hit->at + hit->size - p;
                if (in >= n)
                        return true;
                p += in;
                n -= in;
        }
        return true;
}

FC_API cuda_result cuMemsetD8_v2(cuda_dptr ptr, unsigned char v, size_t n) {
        fc.n_memset++;
        fc.last_memset_ptr = ptr;
        fc.last_memset_bytes = n;
        fc.last_memset_value = v;
        if (fc.fail_memset)
                return fc.fail_memset;
        if (!fc_accessible(ptr, n, PROT_WRITE))
                return CUDA_DRV_ERROR_INVALID_VALUE;
        memset((void *)ptr, v, n);
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuMemcpyDtoH_v2(void *dst, cuda_dptr src, size_t n) {
        fc.n_dtoh++;
        fc.last_dtoh_src = src;
        if (!fc_accessible(src, n, PROT_READ))
                return CUDA_DRV_ERROR_INVALID_VALUE;
        memcpy(dst, (const void *)src, n);
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuMemcpyHtoD_v2(cuda_dptr dst, const void *src, size_t n) {
        fc.n_htod++;
        fc.last_htod_dst = dst;
        if (!fc_accessible(dst, n, PROT_WRITE))
                return CUDA_DRV_ERROR_INVALID_VALUE;
        memcpy((void *)dst, src, n);
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuMemcpyDtoD_v2(cuda_dptr dst, cuda_dptr src, size_t n) {
        fc.n_dtod++;
        if (!fc_accessible(dst, n, PROT_WRITE) || !fc_accessible(src, n, PROT_READ))
                return CUDA_DRV_ERROR_INVALID_VALUE;
        memmove((void *)dst, (const void *)src, n);
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
        size_t used = 0;
        for (int i = 0; i < FC_MAX_ALLOCS; i++)
                used += fc.allocs[i].live ? fc.allocs[i].size : 0;
        *total_bytes = 1ull << 30;
        *free_bytes = used < *total_bytes ? *total_bytes - used : 0;
        return CUDA_DRV_SUCCESS;
}

FC_API cuda_result cuGetErrorName(cuda_result r, const char **name) {
        switch (r) {
        case 0: *name = "CUDA_SUCCESS"; break;
        case 1: *name = "CUDA_ERROR_INVALID_VALUE"; break;
        case 2: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
        case 34: *name = "CUDA_ERROR_STUB_LIBRARY"; break;
        case 100: *name = "CUDA_ERROR_NO_DEVICE"; break;
        case 101: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
        case 801: *name = "CUDA_ERROR_NOT_SUPPORTED"; break;
        default: *name = "CUDA_ERROR_UNKNOWN"; return CUDA_DRV_ERROR_INVALID_VALUE;
        }
        return CUDA_DRV_SUCCESS;
}

#ifdef FAKECUDA_STATIC
/* The unit tests' table: the fake's functions where dlsym would put the driver's. */
static void fakecuda_fill(struct cuda_driver *d) {
        *d = (struct cuda_driver){
                .cuInit = cuInit,
                .cuDriverGetVersion = cuDriverGetVersion,
                .cuDeviceGetCount = cuDeviceGetCount,
                .cuDeviceGet = cuDeviceGet,
                .cuDeviceGetUuid = cuDeviceGetUuid_v2,
                .cuDeviceGetName = cuDeviceGetName,
                .cuDeviceGetAttribute = cuDeviceGetAttribute,
                .cuDevicePrimaryCtxRetain = cuDevicePrimaryCtxRetain,
                .cuDevicePrimaryCtxRelease = cuDevicePrimaryCtxRelease_v2,
                .cuCtxSetCurrent = cuCtxSetCurrent,
                .cuCtxSynchronize = cuCtxSynchronize,
                .cuMemGetAllocationGranularity = cuMemGetAllocationGranularity,
                .cuMemCreate = cuMemCreate,
                .cuMemRelease = cuMemRelease,
                .cuMemExportToShareableHandle = cuMemExportToShareableHandle,
                .cuMemImportFromShareableHandle = cuMemImportFromShareableHandle,
                .cuMemAddressReserve = cuMemAddressReserve,
                .cuMemAddressFree = cuMemAddressFree,
                .cuMemMap = cuMemMap,
                .cuMemUnmap = cuMemUnmap,
                .cuMemSetAccess = cuMemSetAccess,
                .cuMemsetD8 = cuMemsetD8_v2,
                .cuMemcpyDtoH = cuMemcpyDtoH_v2,
                .cuMemcpyHtoD = cuMemcpyHtoD_v2,
                .cuMemcpyDtoD = cuMemcpyDtoD_v2,
                .cuMemGetInfo = cuMemGetInfo_v2,
                .cuGetErrorName = cuGetErrorName,
        };
}

/* Back to a fresh driver with default knobs; what tests left live (allocations, mappings,
 * ranges) is counted first: 0 when they cleaned up. */
static int fakecuda_reset(void) {
        int live = 0;
        for (int i = 0; i < FC_MAX_ALLOCS; i++)
                if (fc.allocs[i].live) {
                        close(fc.allocs[i].fd);
                        live++;
                }
        for (int j = 0; j < FC_MAX_MAPS; j++)
                live += fc.maps[j].live;
        for (int i = 0; i < FC_MAX_RANGES; i++)
                if (fc.ranges[i].live) {
                        munmap((void *)fc.ranges[i].base, fc.ranges[i].size);
                        live++;
                }
        live += fc.ctx_retained;
        memset(&fc, 0, sizeof(fc));
        fc_setup();
        return live;
}

static int fakecuda_live_allocs(void) {
        int n = 0;
        for (int i = 0; i < FC_MAX_ALLOCS; i++)
                n += fc.allocs[i].live;
        return n;
}
#endif
