/* kernels/cuda/driver.h: the part of the CUDA driver API that kvcd and libkvc call, as one table of
 * function pointers.
 *
 * The table is filled by cuda_driver_load() from dlopen("libcuda.so.1"), or by a test's fake
 * (tests/gpu/fakecuda.c): nothing links -lcuda, so every binary starts on a machine without a
 * driver and says so. The toolkit's libcuda.so in lib64/stubs is a link-time aid only; loaded at
 * run time its cuInit answers 34 (CUDA_ERROR_STUB_LIBRARY), which cuda_driver_open() reports as
 * such.
 *
 * The few CUDA types are declared here rather than taken from <cuda.h>, so the CPU build needs no
 * CUDA toolkit. They must match the driver's ABI: the static assertions below pin the layouts of
 * CUDA 13's cuda.h (CUmemAllocationProp 32 bytes, CUmemAccessDesc 12, CUuuid 16), and the constants
 * are cuda.h's values. The members of struct cuda_driver are named as the driver names its entry
 * points, so grep finds both; driver.c holds the exported symbol of each (some are _v2).
 *
 * Lives in kernels/, the device layer under the kernels, because both ends load it: kvcd's cuda
 * backend and libkvc's device pools (client/lib/devpool.c). One loader, one set of error messages,
 * and neither side needs the other's code to build.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef int cuda_result;                    /* CUresult */
typedef int cuda_device;                    /* CUdevice: an ordinal of this process */
typedef void *cuda_context;                 /* CUcontext */
typedef unsigned long long cuda_dptr;       /* CUdeviceptr */
typedef unsigned long long cuda_mem_handle; /* CUmemGenericAllocationHandle */

/* CUresult values kvcd tells apart (cuda.h) */
enum {
        CUDA_DRV_SUCCESS = 0,
        CUDA_DRV_ERROR_INVALID_VALUE = 1,
        CUDA_DRV_ERROR_OUT_OF_MEMORY = 2,
        CUDA_DRV_ERROR_NOT_INITIALIZED = 3,
        CUDA_DRV_ERROR_STUB_LIBRARY = 34,
        CUDA_DRV_ERROR_NO_DEVICE = 100,
        CUDA_DRV_ERROR_INVALID_DEVICE = 101,
        CUDA_DRV_ERROR_NOT_SUPPORTED = 801,
        CUDA_DRV_ERROR_SYSTEM_DRIVER_MISMATCH = 803,
};

/* The CUDA runtime's code for "no driver" (cudaErrorInsufficientDriver): what a runtime-API
 * program such as kvc-gpucheck reports where cuda_driver_load() fails. */
#define CUDA_RT_ERROR_INSUFFICIENT_DRIVER 35

enum {
        CUDA_DRV_MEM_ALLOCATION_TYPE_PINNED = 0x1,
        CUDA_DRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
        CUDA_DRV_MEM_LOCATION_TYPE_DEVICE = 0x1,
        CUDA_DRV_MEM_ACCESS_FLAGS_PROT_READ = 0x1,
        CUDA_DRV_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3,
        CUDA_DRV_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
        CUDA_DRV_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1,
        CUDA_DRV_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
        CUDA_DRV_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103,
};

struct cuda_mem_location { /* CUmemLocation */
        int type;
        int id;
};

struct cuda_mem_alloc_prop { /* CUmemAllocationProp */
        int type;
        int requested_handle_types;
        struct cuda_mem_location location;
        void *win32_handle_meta_data;
        struct {
                unsigned char compression_type;
                unsigned char gpu_direct_rdma_capable;
                unsigned short usage;
                unsigned char reserved[4];
        } alloc_flags;
};

struct cuda_mem_access_desc { /* CUmemAccessDesc */
        struct cuda_mem_location location;
        int flags;
};

struct cuda_uuid { /* CUuuid */
        unsigned char bytes[16];
};

_Static_assert(sizeof(struct cuda_mem_alloc_prop) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(__builtin_offsetof(struct cuda_mem_alloc_prop, location) == 8, "CUmemAllocationProp.location");
_Static_assert(__builtin_offsetof(struct cuda_mem_alloc_prop, alloc_flags) == 24,
               "CUmemAllocationProp.allocFlags");
_Static_assert(sizeof(struct cuda_mem_access_desc) == 12, "CUmemAccessDesc is 12 bytes");
_Static_assert(sizeof(struct cuda_uuid) == 16, "CUuuid is 16 bytes");
_Static_assert(sizeof(cuda_dptr) == 8 && sizeof(cuda_mem_handle) == 8, "64-bit device pointers and handles");

struct cuda_driver {
        void *dl; /* the dlopen handle; NULL for a table a test filled */
        cuda_result (*cuInit)(unsigned int flags);
        cuda_result (*cuDriverGetVersion)(int *version);
        cuda_result (*cuDeviceGetCount)(int *count);
        cuda_result (*cuDeviceGet)(cuda_device *dev, int ordinal);
        cuda_result (*cuDeviceGetUuid)(struct cuda_uuid *uuid, cuda_device dev);
        cuda_result (*cuDeviceGetName)(char *name, int len, cuda_device dev);
        cuda_result (*cuDeviceGetAttribute)(int *value, int attrib, cuda_device dev);
        cuda_result (*cuDevicePrimaryCtxRetain)(cuda_context *ctx, cuda_device dev);
        cuda_result (*cuDevicePrimaryCtxRelease)(cuda_device dev);
        cuda_result (*cuCtxSetCurrent)(cuda_context ctx);
        cuda_result (*cuCtxSynchronize)(void);
        cuda_result (*cuMemGetAllocationGranularity)(size_t *granularity,
                                                     const struct cuda_mem_alloc_prop *prop, int option);
        cuda_result (*cuMemCreate)(cuda_mem_handle *handle, size_t size,
                                   const struct cuda_mem_alloc_prop *prop, unsigned long long flags);
        cuda_result (*cuMemRelease)(cuda_mem_handle handle);
        cuda_result (*cuMemExportToShareableHandle)(void *shareable, cuda_mem_handle handle, int type,
                                                    unsigned long long flags);
        cuda_result (*cuMemImportFromShareableHandle)(cuda_mem_handle *handle, void *os_handle, int type);
        cuda_result (*cuMemAddressReserve)(cuda_dptr *ptr, size_t size, size_t alignment, cuda_dptr addr,
                                           unsigned long long flags);
        cuda_result (*cuMemAddressFree)(cuda_dptr ptr, size_t size);
        cuda_result (*cuMemMap)(cuda_dptr ptr, size_t size, size_t offset, cuda_mem_handle handle,
                                unsigned long long flags);
        cuda_result (*cuMemUnmap)(cuda_dptr ptr, size_t size);
        cuda_result (*cuMemSetAccess)(cuda_dptr ptr, size_t size, const struct cuda_mem_access_desc *desc,
                                      size_t count);
        cuda_result (*cuMemsetD8)(cuda_dptr ptr, unsigned char value, size_t n);
        cuda_result (*cuMemcpyDtoH)(void *dst, cuda_dptr src, size_t n);
        cuda_result (*cuMemcpyHtoD)(cuda_dptr dst, const void *src, size_t n);
        cuda_result (*cuMemcpyDtoD)(cuda_dptr dst, cuda_dptr src, size_t n);
        cuda_result (*cuMemGetInfo)(size_t *free_bytes, size_t *total_bytes);
        cuda_result (*cuGetErrorName)(cuda_result r, const char **name);
};

/* What cuda_driver_open() found. */
struct cuda_device_info {
        cuda_device dev; /* the ordinal in this process */
        struct cuda_uuid uuid;
        char uuid_text[41]; /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L shows it */
        char name[96];
        int driver_version;   /* 13000 for 13.0 */
        uint64_t granularity; /* cuMemGetAllocationGranularity, MINIMUM, for POSIX-fd chunks */
        cuda_context ctx;     /* the device's primary context, retained and current */
};

/* Loads the driver: dlopen(path, or "libcuda.so.1" when NULL) and every entry point above. Does not
 * call cuInit. -ENOENT when the library cannot be loaded (no driver: the runtime API would say
 * error 35), -ENOSYS when it lacks an entry point (a driver older than the VMM API); why says
 * which, and *ret is untouched. */
int cuda_driver_load(const char *path, struct cuda_driver *ret, char *why, size_t why_len);
/* dlcloses a loaded table and clears it; a filled-in fake is only cleared. Accepts NULL. */
void cuda_driver_unload(struct cuda_driver *drv);

/* cuInit, then the device: the one whose UUID is uuid, or ordinal 0 when uuid is NULL. Checks it
 * supports the VMM API with POSIX-fd handles, reads the allocation granularity, and makes the
 * device's primary context current on the calling thread. Errors (why has the driver's code):
 *   -ENODEV  CUDA is not usable here: a stub library (34), no device (100), a device without
 *            VMM or POSIX-fd handles
 *   -ENXIO   no device has that UUID (the others are listed in why)
 *   -EIO     any other driver error
 * Pair with cuda_driver_close(). */
int cuda_driver_open(const struct cuda_driver *drv, const struct cuda_uuid *uuid,
                     struct cuda_device_info *ret, char *why, size_t why_len);
/* Releases the primary context cuda_driver_open() retained. */
void cuda_driver_close(const struct cuda_driver *drv, struct cuda_device_info *info);

/* "CUDA_ERROR_OUT_OF_MEMORY (2)" into buf (len >= 16), for messages. */
const char *cuda_driver_error(const struct cuda_driver *drv, cuda_result r, char *buf, size_t len);

/* A UUID as nvidia-smi prints it ("GPU-" then 32 hex digits in 8-4-4-4-12 groups); the "GPU-"
 * prefix and the dashes are optional. -EINVAL otherwise. */
int cuda_uuid_parse(const char *s, struct cuda_uuid *ret);
void cuda_uuid_format(const struct cuda_uuid *u, char buf[41]);
