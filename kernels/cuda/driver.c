/* kernels/cuda/driver.c: loads the CUDA driver with dlopen, finds the device, and words its errors.
 *
 * The exported symbol of each entry point is the one cuda.h maps the name to (cuMemcpyDtoH is
 * cuMemcpyDtoH_v2, ...): dlsym sees the library's symbols, not the header's macros. The table is
 * loaded all or nothing, so a caller never meets a NULL entry point.
 *
 * Library code (libkvc compiles it too): it never prints; messages go into the caller's buffer.
 */
#define _GNU_SOURCE
#include "cuda/driver.h"

#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#define CUDA_DRIVER_LIBRARY "libcuda.so.1"

static const struct {
        const char *symbol;
        size_t at;
} entry_points[] = {
#define E(member, symbol)                                                                                    \
        { symbol, offsetof(struct cuda_driver, member) }
        E(cuInit, "cuInit"),
        E(cuDriverGetVersion, "cuDriverGetVersion"),
        E(cuDeviceGetCount, "cuDeviceGetCount"),
        E(cuDeviceGet, "cuDeviceGet"),
        E(cuDeviceGetUuid, "cuDeviceGetUuid_v2"),
        E(cuDeviceGetName, "cuDeviceGetName"),
        E(cuDeviceGetAttribute, "cuDeviceGetAttribute"),
        E(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
        E(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"),
        E(cuCtxSetCurrent, "cuCtxSetCurrent"),
        E(cuCtxSynchronize, "cuCtxSynchronize"),
        E(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity"),
        E(cuMemCreate, "cuMemCreate"),
        E(cuMemRelease, "cuMemRelease"),
        E(cuMemExportToShareableHandle, "cuMemExportToShareableHandle"),
        E(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle"),
        E(cuMemAddressReserve, "cuMemAddressReserve"),
        E(cuMemAddressFree, "cuMemAddressFree"),
        E(cuMemMap, "cuMemMap"),
        E(cuMemUnmap, "cuMemUnmap"),
        E(cuMemSetAccess, "cuMemSetAccess"),
        E(cuMemsetD8, "cuMemsetD8_v2"),
        E(cuMemcpyDtoH, "cuMemcpyDtoH_v2"),
        E(cuMemcpyHtoD, "cuMemcpyHtoD_v2"),
        E(cuMemcpyDtoD, "cuMemcpyDtoD_v2"),
        E(cuMemGetInfo, "cuMemGetInfo_v2"),
        E(cuGetErrorName, "cuGetErrorName"),
#undef E
};

int cuda_driver_load(const char *path, struct cuda_driver *ret, char *why, size_t why_len) {
        const char *lib = path ? path : CUDA_DRIVER_LIBRARY;
        void *dl = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
        if (!dl) {
                const char *e = dlerror();
                snprintf(why, why_len,
                         "no CUDA driver: %s (the CUDA runtime reports this as error %d, "
                         "cudaErrorInsufficientDriver)",
                         e ? e : lib, CUDA_RT_ERROR_INSUFFICIENT_DRIVER);
                return -ENOENT;
        }
        struct cuda_driver d = { .dl = dl };
        for (size_t i = 0; i < sizeof(entry_points) / sizeof(entry_points[0]); i++) {
                void *f = dlsym(dl, entry_points[i].symbol);
                if (!f) {
                        snprintf(why, why_len,
                                 "the CUDA driver %s lacks %s: it is older than the VMM API needs", lib,
                                 entry_points[i].symbol);
                        dlclose(dl);
                        return -ENOSYS;
                }
                memcpy((char *)&d + entry_points[i].at, &f, sizeof(f));
        }
        *ret = d;
        return 0;
}

void cuda_driver_unload(struct cuda_driver *drv) {
        if (!drv)
                return;
        if (drv->dl)
                dlclose(drv->dl);
        memset(drv, 0, sizeof(*drv));
}

const char *cuda_driver_error(const struct cuda_driver *drv, cuda_result r, char *buf, size_t len) {
        const char *name = NULL;
        if (!drv || !drv->cuGetErrorName || drv->cuGetErrorName(r, &name) != CUDA_DRV_SUCCESS || !name)
                name = "CUDA error";
        snprintf(buf, len, "%s (%d)", name, r);
        return buf;
}

static int hexval(int c) {
        return isdigit(c) ? c - '0' : isxdigit(c) ? tolower(c) - 'a' + 10 : -1;
}

int cuda_uuid_parse(const char *s, struct cuda_uuid *ret) {
        struct cuda_uuid u;
        if (!s)
                return -EINVAL;
        if (strncmp(s, "GPU-", 4) == 0)
                s += 4;
        for (int i = 0; i < 16; i++) {
                if (*s == '-' && (i == 4 || i == 6 || i == 8 || i == 10))
                        s++;
                int hi = hexval((unsigned char)s[0]), lo = hi < 0 ? -1 : hexval((unsigned char)s[1]);
                if (hi < 0 || lo < 0)
                        return -EINVAL;
                u.bytes[i] = (unsigned char)(hi << 4 | lo);
                s += 2;
        }
        if (*s)
                return -EINVAL;
        *ret = u;
        return 0;
}

void cuda_uuid_format(const struct cuda_uuid *u, char buf[41]) {
        const unsigned char *b = u->bytes;
        snprintf(buf, 41, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
                 b[15]);
}

static struct cuda_mem_alloc_prop chunk_prop(cuda_device dev) {
        return (struct cuda_mem_alloc_prop){
                .type = CUDA_DRV_MEM_ALLOCATION_TYPE_PINNED,
                .requested_handle_types = CUDA_DRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                .location = { .type = CUDA_DRV_MEM_LOCATION_TYPE_DEVICE, .id = dev },
        };
}

/* Words a failed call: -ENODEV for the codes that mean "no usable CUDA here", -EIO otherwise. */
static int fail(const struct cuda_driver *drv, cuda_result r, const char *what, char *why, size_t why_len) {
        char e[96];
        switch (r) {
        case CUDA_DRV_ERROR_STUB_LIBRARY:
                snprintf(why, why_len,
                         "%s: the CUDA driver is a stub library (error %d, CUDA_ERROR_STUB_LIBRARY): "
                         "libcuda.so.1 resolves to the toolkit's link-time stub (lib64/stubs), not an "
                         "installed driver; remove the stub directory from the library path",
                         what, r);
                return -ENODEV;
        case CUDA_DRV_ERROR_NO_DEVICE:
                snprintf(why, why_len,
                         "%s: no CUDA device (error %d, CUDA_ERROR_NO_DEVICE): a driver is "
                         "installed but it sees no GPU (check CUDA_VISIBLE_DEVICES and /dev/nvidia*)",
                         what, r);
                return -ENODEV;
        case CUDA_DRV_ERROR_SYSTEM_DRIVER_MISMATCH:
                snprintf(why, why_len, "%s: %s: the user-mode driver does not match the kernel module", what,
                         cuda_driver_error(drv, r, e, sizeof(e)));
                return -ENODEV;
        default: snprintf(why, why_len, "%s: %s", what, cuda_driver_error(drv, r, e, sizeof(e))); return -EIO;
        }
}

int cuda_driver_open(const struct cuda_driver *drv, const struct cuda_uuid *uuid,
                     struct cuda_device_info *ret, char *why, size_t why_len) {
        struct cuda_device_info info = { .dev = -1 };
        cuda_result r;
        int n = 0;

        if ((r = drv->cuInit(0)) != CUDA_DRV_SUCCESS)
                return fail(drv, r, "cuInit", why, why_len);
        if ((r = drv->cuDriverGetVersion(&info.driver_version)) != CUDA_DRV_SUCCESS)
                return fail(drv, r, "cuDriverGetVersion", why, why_len);
        if ((r = drv->cuDeviceGetCount(&n)) != CUDA_DRV_SUCCESS)
                return fail(drv, r, "cuDeviceGetCount", why, why_len);
        if (n <= 0)
                return fail(drv, CUDA_DRV_ERROR_NO_DEVICE, "cuDeviceGetCount", why, why_len);

        char seen[256] = "";
        size_t seen_len = 0;
        for (int i = 0; i < n && info.dev < 0; i++) {
                cuda_device dev;
                struct cuda_uuid u;
                if ((r = drv->cuDeviceGet(&dev, i)) != CUDA_DRV_SUCCESS ||
                    (r = drv->cuDeviceGetUuid(&u, dev)) != CUDA_DRV_SUCCESS)
                        return fail(drv, r, "cuDeviceGetUuid", why, why_len);
                if (!uuid || memcmp(u.bytes, uuid->bytes, sizeof(u.bytes)) == 0) {
                        info.dev = dev;
                        info.uuid = u;
                } else if (seen_len + 42 < sizeof(seen)) {
                        char t[41];
                        cuda_uuid_format(&u, t);
                        seen_len += (size_t)snprintf(seen + seen_len, sizeof(seen) - seen_len, " %s", t);
                }
        }
        if (info.dev < 0) {
                char want[41];
                cuda_uuid_format(uuid, want);
                snprintf(why, why_len, "no CUDA device %s among the %d this process sees:%s", want, n, seen);
                return -ENXIO;
        }
        cuda_uuid_format(&info.uuid, info.uuid_text);
        if (drv->cuDeviceGetName(info.name, (int)sizeof(info.name), info.dev) != CUDA_DRV_SUCCESS)
                snprintf(info.name, sizeof(info.name), "device %d", info.dev);
        info.name[sizeof(info.name) - 1] = 0;

        int vmm = 0, posix_fd = 0;
        if ((r = drv->cuDeviceGetAttribute(&vmm,
                                           CUDA_DRV_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                           info.dev)) != CUDA_DRV_SUCCESS ||
            (r = drv->cuDeviceGetAttribute(
                     &posix_fd, CUDA_DRV_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                     info.dev)) != CUDA_DRV_SUCCESS)
                return fail(drv, r, "cuDeviceGetAttribute", why, why_len);
        if (!vmm || !posix_fd) {
                snprintf(why, why_len, "CUDA device %s (%s) does not support %s", info.uuid_text, info.name,
                         !vmm ? "virtual memory management (cuMemCreate)" : "POSIX file-descriptor handles");
                return -ENODEV;
        }
        struct cuda_mem_alloc_prop prop = chunk_prop(info.dev);
        size_t g = 0;
        if ((r = drv->cuMemGetAllocationGranularity(&g, &prop, CUDA_DRV_MEM_ALLOC_GRANULARITY_MINIMUM)) !=
            CUDA_DRV_SUCCESS)
                return fail(drv, r, "cuMemGetAllocationGranularity", why, why_len);
        if (g == 0 || (g & (g - 1))) {
                snprintf(why, why_len, "CUDA device %s reports an allocation granularity of %zu bytes",
                         info.uuid_text, g);
                return -EIO;
        }
        info.granularity = g;
        if ((r = drv->cuDevicePrimaryCtxRetain(&info.ctx, info.dev)) != CUDA_DRV_SUCCESS)
                return fail(drv, r, "cuDevicePrimaryCtxRetain", why, why_len);
        if ((r = drv->cuCtxSetCurrent(info.ctx)) != CUDA_DRV_SUCCESS) {
                drv->cuDevicePrimaryCtxRelease(info.dev);
                return fail(drv, r, "cuCtxSetCurrent", why, why_len);
        }
        *ret = info;
        return 0;
}

void cuda_driver_close(const struct cuda_driver *drv, struct cuda_device_info *info) {
        if (!drv || !info || !info->ctx)
                return;
        /* not cuCtxSetCurrent(NULL): in a client the CUDA runtime shares the context and the thread */
        drv->cuDevicePrimaryCtxRelease(info->dev);
        info->ctx = NULL;
}
