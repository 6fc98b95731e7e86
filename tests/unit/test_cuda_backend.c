/* test_cuda_backend.c - unit tests of the cuda backend (daemon/backend_cuda.c, kernels/cuda/driver.c),
 * libkvc's device pool (client/devpool.c) and the pool's cooperative shrink (daemon/pool.c), without a
 * GPU.
 *
 * Owns: backend selection (cuda, host, auto and its fallback), the clear errors for a missing driver
 * (35), a stub driver (34), no device (100) and a device without VMM, device selection by UUID, the
 * granularity check, and the bookkeeping of chunks: create/export/zero/map, reads and writes at the
 * chunk's device address, scrubbing, destruction, every failure of a driver call with nothing leaked;
 * on the client side import/map/set-access/unmap; and the reclaim of a chunk only after its owner
 * acknowledges the unmap.
 *
 * The driver is tests/gpu/fakecuda.c, included here: the same table dlopen fills, over host memory,
 * so a chunk's bytes are real and the daemon's and the client's mappings share them. The missing-
 * driver paths use the real dlopen (no libcuda.so.1 on a CPU machine; skipped where one loads).
 */
#define FAKECUDA_STATIC
#include "../gpu/fakecuda.c"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "backend.h"
#include "cuda/driver.h"
#include "devpool.h"
#include "log.h"
#include "pool.h"

#define MIB   (1ull << 20)
#define CHUNK (2 * MIB)
#define UNIT  (64u * 1024u)

static struct cuda_driver fake;

static int setup(void **state) {
        (void)state;
        fakecuda_reset();
        fakecuda_fill(&fake);
        backend_cuda_set_driver(&fake);
        return 0;
}

static int teardown(void **state) {
        (void)state;
        backend_close(&backend_cuda_ops);
        backend_cuda_set_driver(NULL);
        assert_int_equal(fakecuda_reset(), 0); /* nothing left allocated, mapped, reserved or retained */
        return 0;
}

static struct backend_params params(uint64_t chunks, const char *device) {
        return (struct backend_params){ .va_bytes = chunks * CHUNK, .chunk_bytes = CHUNK, .device = device };
}

static const struct backend_ops *open_cuda(uint64_t chunks) {
        const struct backend_ops *ops = NULL;
        char why[512];
        struct backend_params p = params(chunks, NULL);
        assert_int_equal(backend_select("cuda", &p, &ops, why, sizeof(why)), 0);
        assert_ptr_equal(ops, &backend_cuda_ops);
        return ops;
}

static struct pool *cuda_pool(uint64_t chunks) {
        struct pool *p = NULL;
        assert_int_equal(pool_new(open_cuda(chunks), chunks * CHUNK, CHUNK, &p), 0);
        return p;
}

static uint64_t alloc(struct pool *p, uint64_t owner, uint32_t n_units, int64_t *ret_new_chunk) {
        uint64_t off = 0;
        int64_t nc = -1;
        assert_int_equal(pool_alloc(p, owner, UNIT, n_units, &off, &nc), 0);
        if (ret_new_chunk)
                *ret_new_chunk = nc;
        return off;
}

static bool driver_loads_here(void) {
        struct cuda_driver d;
        char why[256];
        if (cuda_driver_load(NULL, &d, why, sizeof(why)) < 0)
                return false;
        cuda_driver_unload(&d);
        return true;
}

/* ---- UUIDs ---- */

static void cuda_uuid_parses_the_nvidia_smi_form_and_round_trips(void **state) {
        struct cuda_uuid u;
        char t[41];
        (void)state;
        assert_int_equal(cuda_uuid_parse("GPU-fa4ec0da-0000-4000-8000-0000000000ff", &u), 0);
        assert_int_equal(u.bytes[0], 0xfa);
        assert_int_equal(u.bytes[15], 0xff);
        cuda_uuid_format(&u, t);
        assert_string_equal(t, "GPU-fa4ec0da-0000-4000-8000-0000000000ff");
        assert_int_equal(cuda_uuid_parse("FA4EC0DA0000400080000000000000FF", &u), 0);
        cuda_uuid_format(&u, t);
        assert_string_equal(t, "GPU-fa4ec0da-0000-4000-8000-0000000000ff");
}

static void cuda_uuid_rejects_what_is_not_a_uuid(void **state) {
        struct cuda_uuid u;
        (void)state;
        assert_int_equal(cuda_uuid_parse("", &u), -EINVAL);
        assert_int_equal(cuda_uuid_parse("GPU-fa4ec0da", &u), -EINVAL);
        assert_int_equal(cuda_uuid_parse("GPU-fa4ec0da-0000-4000-8000-0000000000ff0", &u), -EINVAL);
        assert_int_equal(cuda_uuid_parse("GPU-fa4ec0da-0000-4000-8000-0000000000fg", &u), -EINVAL);
        assert_int_equal(cuda_uuid_parse("0", &u), -EINVAL);
        assert_int_equal(cuda_uuid_parse(NULL, &u), -EINVAL);
}

/* ---- selection and the errors of machines without a usable GPU ---- */

static void backend_find_knows_host_cuda_and_auto(void **state) {
        const struct backend_ops *ops = NULL;
        (void)state;
        assert_int_equal(backend_find("host", &ops), 0);
        assert_false(ops->device);
        assert_int_equal(backend_find("cuda", &ops), 0);
        assert_true(ops->device);
        assert_int_equal(backend_find("auto", &ops), 0);
        assert_int_equal(backend_find("rocm", &ops), -ENOENT);
}

static void cuda_backend_without_a_driver_says_error_35(void **state) {
        const struct backend_ops *ops = NULL;
        char why[512];
        struct backend_params p = params(4, NULL);
        (void)state;
        if (driver_loads_here())
                skip();
        backend_cuda_set_driver(NULL); /* the real dlopen */
        assert_int_equal(backend_select("cuda", &p, &ops, why, sizeof(why)), -ENODEV);
        assert_null(ops);
        assert_non_null(strstr(why, "no CUDA driver"));
        assert_non_null(strstr(why, "libcuda.so.1"));
        assert_non_null(strstr(why, "error 35"));
}

static void auto_falls_back_to_host_when_the_driver_is_missing(void **state) {
        const struct backend_ops *ops = NULL;
        char why[512];
        struct backend_params p = params(4, NULL);
        (void)state;
        if (driver_loads_here())
                skip();
        backend_cuda_set_driver(NULL);
        assert_int_equal(backend_select("auto", &p, &ops, why, sizeof(why)), 0);
        assert_string_equal(ops->name, "host");
        assert_non_null(strstr(why, "error 35"));
        assert_non_null(strstr(why, "using the host backend"));
        assert_int_equal(backend_select("host", &p, &ops, why, sizeof(why)), 0);
        assert_string_equal(why, "");
}

static void cuda_backend_refuses_a_stub_driver_with_error_34(void **state) {
        const struct backend_ops *ops = NULL;
        char why[512];
        struct backend_params p = params(4, NULL);
        (void)state;
        fc.init_result = CUDA_DRV_ERROR_STUB_LIBRARY;
        assert_int_equal(backend_select("cuda", &p, &ops, why, sizeof(why)), -ENODEV);
        assert_non_null(strstr(why, "stub library"));
        assert_non_null(strstr(why, "error 34"));
        assert_int_equal(backend_select("auto", &p, &ops, why, sizeof(why)), 0);
        assert_string_equal(ops->name, "host");
        assert_non_null(strstr(why, "error 34"));
}

static void cuda_backend_refuses_a_machine_without_devices_with_error_100(void **state) {
        const struct backend_ops *ops = NULL;
        char why[512];
        struct backend_params p = params(4, NULL);
        (void)state;
        fc.n_devices = 0;
        assert_int_equal(backend_select("cuda", &p, &ops, why, sizeof(why)), -ENODEV);
        assert_non_null(strstr(why, "no CUDA device"));
        assert_non_null(strstr(why, "error 100"));
        assert_int_equal(backend_select("auto", &p, &ops, why, sizeof(why)), 0);
        assert_string_equal(ops->name, "host");
}

static void cuda_backend_refuses_a_device_without_vmm_or_posix_fds(void **state) {
        const struct backend_ops *ops = NULL;
        char why[512];
        struct backend_params p = params(4, NULL);
        (void)state;
        fc.posix_fd = 0;
        assert_int_equal(backend_select("cuda", &p, &ops, why, sizeof(why)), -ENODEV);
        assert_non_null(strstr(why, "POSIX file-descriptor handles"));
        fc.posix_fd = 1;
        fc.vmm = 0;
        assert_int_equal(backend_select("cuda", &p, &ops, why, sizeof(why)), -ENODEV);
        assert_non_null(strstr(why, "virtual memory management"));
        assert_int_equal(fc.ctx_retained, 0);
}

static void cuda_backend_picks_the_device_by_uuid(void **state) {
        const struct backend_ops *ops = NULL;
        char why[512];
        struct backend_params p = params(4, "GPU-fa4ec0da-0000-4000-8000-000000000002");
        struct backend_info bi;
        (void)state;
        fc.n_devices = 3;
        assert_int_equal(backend_select("cuda", &p, &ops, why, sizeof(why)), 0);
        backend_get_info(ops, &bi);
        assert_true(bi.device);
        assert_string_equal(bi.device_text, "GPU-fa4ec0da-0000-4000-8000-000000000002");
        assert_int_equal(bi.device_uuid[15], 2);
        assert_string_equal(bi.device_name, "fakecuda device 2");
        assert_int_equal(bi.driver_version, 13000);
        assert_int_equal(bi.granularity, CHUNK);
        assert_ptr_equal(fc.current, (cuda_context)(uintptr_t)(0x1000 + 2)); /* its primary context */

        struct pool *pl = NULL;
        assert_int_equal(pool_new(ops, 4 * CHUNK, CHUNK, &pl), 0);
        alloc(pl, 7, 1, NULL);
        assert_int_equal(fc.last_create_location, 2); /* memory and access on that device */
        assert_int_equal(fc.last_access_location, 2);
        pool_free(pl);
}

static void cuda_backend_refuses_an_unknown_or_malformed_uuid(void **state) {
        const struct backend_ops *ops = NULL;
        char why[512];
        struct backend_params p = params(4, "GPU-fa4ec0da-0000-4000-8000-000000000009");
        (void)state;
        fc.n_devices = 2;
        assert_int_equal(backend_select("cuda", &p, &ops, why, sizeof(why)), -ENXIO);
        assert_non_null(strstr(why, "GPU-fa4ec0da-0000-4000-8000-000000000009"));
        assert_non_null(strstr(why, "GPU-fa4ec0da-0000-4000-8000-000000000001")); /* lists what there is */
        assert_int_equal(backend_select("auto", &p, &ops, why, sizeof(why)), -ENXIO); /* named: no fallback */
        p.device = "GPU-nope";
        assert_int_equal(backend_select("cuda", &p, &ops, why, sizeof(why)), -EINVAL);
        assert_non_null(strstr(why, "not a GPU UUID"));
        assert_int_equal(fc.ctx_retained, 0);
}

static void cuda_backend_refuses_chunks_that_are_not_a_granularity_multiple(void **state) {
        const struct backend_ops *ops = NULL;
        char why[512];
        struct backend_params p = params(4, NULL);
        (void)state;
        fc.granularity = 4 * MIB;
        assert_int_equal(backend_select("cuda", &p, &ops, why, sizeof(why)), -EINVAL);
        assert_non_null(strstr(why, "not a multiple of the allocation granularity"));
        assert_non_null(strstr(why, "4194304"));
        assert_int_equal(backend_select("auto", &p, &ops, why, sizeof(why)),
                         -EINVAL); /* a misfit, not absence */
        assert_int_equal(fc.ctx_retained, 0);
        p.chunk_bytes = 4 * MIB;
        p.va_bytes = 16 * MIB;
        assert_int_equal(backend_select("cuda", &p, &ops, why, sizeof(why)), 0);
}

static void cuda_backend_reports_a_failed_address_reservation(void **state) {
        const struct backend_ops *ops = NULL;
        char why[512];
        struct backend_params p = params(4, NULL);
        (void)state;
        fc.fail_reserve = CUDA_DRV_ERROR_OUT_OF_MEMORY;
        assert_int_equal(backend_select("cuda", &p, &ops, why, sizeof(why)), -ENOMEM);
        assert_non_null(strstr(why, "cuMemAddressReserve"));
        assert_non_null(strstr(why, "CUDA_ERROR_OUT_OF_MEMORY"));
        assert_int_equal(fc.ctx_retained, 0);
}

/* ---- chunks ---- */

static void cuda_chunk_is_created_exported_zeroed_and_mapped_in_kvcds_range(void **state) {
        struct pool *p = cuda_pool(4);
        int64_t nc;
        (void)state;
        uint64_t off = alloc(p, 7, 1, &nc);
        assert_int_equal(nc, 0);
        assert_int_equal(off, 0);
        assert_int_equal(fc.n_create, 1);
        assert_int_equal(fc.n_export, 1);
        assert_int_equal(fc.n_map, 1);
        assert_int_equal(fc.last_access_flags, CUDA_DRV_MEM_ACCESS_FLAGS_PROT_READWRITE);
        assert_int_equal(fc.last_memset_bytes, CHUNK); /* a fresh chunk reads as zeros */
        assert_int_equal(fc.last_memset_value, 0);

        int fd = pool_chunk_fd(p, 0);
        assert_int_equal(fd, fc.last_exported_fd); /* the fd the client gets is the export */
        struct stat st;
        assert_int_equal(fstat(fd, &st), 0);
        assert_int_equal(st.st_size, CHUNK);

        alloc(p, 8, 1, &nc); /* another owner: another chunk, another slot of the range */
        assert_int_equal(nc, 1);
        assert_int_equal(fc.n_create, 2);
        assert_int_not_equal(pool_chunk_fd(p, 1), fd);
        pool_free(p);
}

static void cuda_reads_and_writes_land_at_the_chunks_device_address(void **state) {
        struct pool *p = cuda_pool(4);
        uint8_t in[300], out[300] = { 0 };
        (void)state;
        alloc(p, 7, 1, NULL);
        uint64_t off = alloc(p, 8, 2, NULL) + UNIT + 100; /* chunk 1, inside its second unit */
        for (size_t i = 0; i < sizeof(in); i++)
                in[i] = (uint8_t)(i * 7 + 1);
        int syncs = fc.n_sync;
        assert_int_equal(pool_write(p, off, in, sizeof(in)), 0);
        assert_true(fc.n_sync > syncs); /* in place before the write returns */
        uintptr_t dst = fc.last_htod_dst;
        assert_int_equal(dst % CHUNK, UNIT + 100);
        assert_memory_equal((const void *)dst, in, sizeof(in)); /* the device memory itself */
        assert_int_equal(pool_read(p, off, out, sizeof(out)), 0);
        assert_int_equal(fc.last_dtoh_src, dst);
        assert_memory_equal(out, in, sizeof(in));
        assert_int_equal(pool_read(p, 3 * CHUNK, out, 4), -EINVAL); /* no such chunk: no copy */
        assert_int_equal(pool_write(p, CHUNK - 2, in, 4), -EINVAL); /* across chunks */
        pool_free(p);
}

static void cuda_scrub_zeroes_the_whole_chunk_before_another_owner_gets_it(void **state) {
        struct pool *p = cuda_pool(1);
        uint8_t junk[64], back[64];
        (void)state;
        memset(junk, 0xab, sizeof(junk));
        uint64_t off = alloc(p, 7, 4, NULL);
        assert_int_equal(pool_write(p, off + 3 * UNIT, junk, sizeof(junk)), 0);
        uintptr_t at = fc.last_htod_dst - 3 * UNIT;
        int memsets = fc.n_memset;
        assert_int_equal(pool_release_owner(p, 7), 1);
        assert_int_equal(fc.n_memset, memsets + 1);
        assert_int_equal(fc.last_memset_ptr, at);
        assert_int_equal(fc.last_memset_bytes, CHUNK);
        assert_int_equal(fc.last_memset_value, 0);
        int64_t nc;
        uint64_t off2 = alloc(p, 9, 4, &nc);
        assert_int_equal(nc, 0);          /* the same index, granted again... */
        assert_int_equal(fc.n_create, 2); /* ...with a fresh allocation (the old one is retired) */
        assert_int_equal(pool_read(p, off2 + 3 * UNIT, back, sizeof(back)), 0);
        memset(junk, 0, sizeof(junk));
        assert_memory_equal(back, junk, sizeof(back));
        pool_free(p);
}

static void cuda_destroy_and_close_release_everything(void **state) {
        struct pool *p = cuda_pool(4);
        (void)state;
        alloc(p, 7, 1, NULL);
        alloc(p, 8, 1, NULL);
        alloc(p, 9, 1, NULL);
        int fd = pool_chunk_fd(p, 2);
        pool_free(p);
        assert_int_equal(fc.n_unmap, 3);
        assert_int_equal(fc.n_release, 3);
        assert_int_equal(fakecuda_live_allocs(), 0);
        assert_int_equal(fcntl(fd, F_GETFD), -1); /* the exported fd is closed */
        backend_close(&backend_cuda_ops);
        assert_int_equal(fc.n_address_free, 1);
        assert_int_equal(fc.ctx_retained, 0);
        backend_close(&backend_cuda_ops); /* twice is harmless */
}

/* One driver call fails while a chunk is made: the allocation fails with err and nothing stays. */
static void create_fails(cuda_result *knob, cuda_result code, int err) {
        struct pool *p = cuda_pool(2);
        uint64_t off;
        int64_t nc;
        struct pool_stats st;
        *knob = code;
        assert_int_equal(pool_alloc(p, 7, UNIT, 1, &off, &nc), err);
        assert_int_equal(fakecuda_live_allocs(), 0);
        for (int j = 0; j < FC_MAX_MAPS; j++)
                assert_false(fc.maps[j].live);
        if (fc.last_exported_fd > 0)
                assert_int_equal(fcntl(fc.last_exported_fd, F_GETFD), -1);
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_created, 0);
        assert_int_equal(st.chunks_owned, 0);
        assert_int_equal(st.used_bytes, 0);
        *knob = 0; /* the next try works, in the same slot */
        assert_int_equal(pool_alloc(p, 7, UNIT, 1, &off, &nc), 0);
        assert_int_equal(nc, 0);
        pool_free(p);
        backend_close(&backend_cuda_ops);
        assert_int_equal(fakecuda_reset(), 0);
        fakecuda_fill(&fake);
}

static void cuda_create_failures_return_enomem_or_eio_and_leak_nothing(void **state) {
        (void)state;
        create_fails(&fc.fail_create, CUDA_DRV_ERROR_OUT_OF_MEMORY, -ENOMEM);
        create_fails(&fc.fail_create, CUDA_DRV_ERROR_INVALID_VALUE, -EIO);
        create_fails(&fc.fail_export, CUDA_DRV_ERROR_NOT_SUPPORTED, -EIO);
        create_fails(&fc.fail_map, CUDA_DRV_ERROR_OUT_OF_MEMORY, -ENOMEM);
        create_fails(&fc.fail_set_access, CUDA_DRV_ERROR_INVALID_VALUE, -EIO);
        create_fails(&fc.fail_memset, CUDA_DRV_ERROR_INVALID_VALUE, -EIO);
}

static void cuda_scrub_failure_retires_the_chunk(void **state) {
        struct pool *p = cuda_pool(1);
        struct pool_stats st;
        int64_t nc;
        (void)state;
        alloc(p, 7, 1, NULL);
        fc.fail_memset = CUDA_DRV_ERROR_INVALID_VALUE;
        assert_int_equal(pool_release_owner(p, 7), 1);
        fc.fail_memset = 0;
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_created, 0); /* destroyed: cannot prove it is clean */
        assert_int_equal(fakecuda_live_allocs(), 0);
        alloc(p, 8, 1, &nc); /* a fresh one replaces it */
        assert_int_equal(nc, 0);
        assert_int_equal(fc.n_create, 2);
        pool_free(p);
}

static void cuda_adopts_a_chunk_kept_across_a_restart_with_its_bytes(void **state) {
        struct pool *p = cuda_pool(2);
        const char msg[] = "kv that outlives kvcd";
        char back[sizeof(msg)] = { 0 };
        (void)state;
        uint64_t off = alloc(p, 7, 1, NULL);
        assert_int_equal(pool_write(p, off + 100, msg, sizeof(msg)), 0);
        int kept = dup(pool_chunk_fd(p, 0)); /* what systemd's fd store holds */
        pool_free(p);                        /* kvcd goes: unmapped, released, its fd closed */
        backend_close(&backend_cuda_ops);

        p = cuda_pool(2); /* the next kvcd */
        int imports = fc.n_import;
        assert_int_equal(pool_adopt_chunk(p, 1, kept, 7), 0);
        assert_int_equal(fc.n_import, imports + 1);
        assert_int_equal(pool_chunk_fd(p, 1), kept);
        assert_int_equal(pool_read(p, CHUNK + off + 100, back, sizeof(back)), 0);
        assert_string_equal(back, msg);
        assert_int_equal(pool_adopt_chunk(p, 1, kept, 7), -EINVAL); /* once */
        pool_free(p);
        assert_int_equal(fcntl(kept, F_GETFD), -1); /* the pool owned it */
}

/* ---- cooperative shrink in the pool ---- */

static void pool_reclaims_an_empty_chunk_only_after_its_owner_acknowledges(void **state) {
        struct pool *p = cuda_pool(3);
        struct pool_stats st;
        char why[128];
        uint64_t off, a0, a1;
        int64_t nc;
        (void)state;
        a0 = alloc(p, 7, 1, NULL);                        /* chunk 0 */
        a1 = alloc(p, 7, (uint32_t)(CHUNK / UNIT), NULL); /* chunk 1, full */
        alloc(p, 8, 1, NULL);                             /* chunk 2 */
        assert_false(pool_short_of_chunks(p));
        assert_int_equal(pool_alloc(p, 9, UNIT, 1, &off, &nc), -ENOSPC); /* room, but no chunk */
        assert_true(pool_short_of_chunks(p));

        uint32_t idx[4];
        uint64_t owner[4];
        assert_int_equal(pool_reclaim_pick(p, 4, idx, owner), 0); /* every chunk holds units */
        assert_false(pool_short_of_chunks(p));
        assert_int_equal(pool_release(p, 7, a0, UNIT, 1), 0);
        assert_int_equal(pool_release(p, 7, a1, UNIT, (uint32_t)(CHUNK / UNIT)), 0);
        assert_int_equal(pool_reclaim_pick(p, 1, idx, owner), 1); /* highest first */
        assert_int_equal(idx[0], 1);
        assert_int_equal(owner[0], 7);
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_reclaiming, 1);
        assert_int_equal(pool_audit(p, why, sizeof(why)), 0);

        /* the owner's next allocation goes to its other empty chunk, never the one asked back */
        off = alloc(p, 7, 2, &nc);
        assert_int_equal(off / CHUNK, 0);
        assert_int_equal(pool_alloc(p, 9, UNIT, 1, &off, &nc), -ENOSPC); /* not free before the ack */

        int memsets = fc.n_memset;
        assert_int_equal(pool_reclaim_done(p, 8, 1), -EINVAL); /* not the owner */
        assert_int_equal(pool_reclaim_done(p, 7, 0), -EINVAL); /* not asked back */
        assert_int_equal(pool_reclaim_done(p, 7, 9), -EINVAL);
        assert_int_equal(fc.n_memset, memsets);
        assert_int_equal(pool_reclaim_done(p, 7, 1), 0);
        assert_int_equal(fc.n_memset, memsets + 1); /* scrubbed */
        assert_int_equal(fc.last_memset_bytes, CHUNK);
        assert_int_equal(pool_reclaim_done(p, 7, 1), -EINVAL); /* once */
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_reclaiming, 0);
        assert_int_equal(st.chunks_owned, 2);

        off = alloc(p, 9, 1, &nc); /* now another owner gets it */
        assert_int_equal(nc, 1);
        assert_int_equal(fc.n_create, 4); /* a fresh allocation: the old holder keeps nothing of 9's */
        assert_int_equal(pool_audit(p, why, sizeof(why)), 0);
        pool_free(p);
}

static void pool_owner_takes_back_a_chunk_being_reclaimed_when_it_has_no_other(void **state) {
        struct pool *p = cuda_pool(2);
        struct pool_stats st;
        char why[128];
        uint32_t idx[2];
        uint64_t owner[2], off;
        int64_t nc;
        (void)state;
        off = alloc(p, 7, 1, NULL);
        alloc(p, 8, 1, NULL);
        assert_int_equal(pool_release(p, 7, off, UNIT, 1), 0);
        assert_int_equal(pool_reclaim_pick(p, 2, idx, owner), 1);
        assert_int_equal(idx[0], 0);

        assert_int_equal(pool_alloc(p, 8, UNIT, (uint32_t)(CHUNK / UNIT), &off, &nc), -ENOSPC); /* not 8's */
        off = alloc(p, 7, 1, &nc); /* 7's only room: the reclaim is called off */
        assert_int_equal(nc, 0);   /* reported as new: its fd goes out again after the UNMAP */
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_reclaiming, 0);
        assert_int_equal(pool_reclaim_done(p, 7, 0), -EINVAL); /* the late acknowledgement is ignored */
        assert_int_equal(pool_audit(p, why, sizeof(why)), 0);

        /* the fd could not be sent: the chunk goes back to being asked for, still 7's */
        assert_int_equal(pool_release(p, 7, off, UNIT, 1), 0);
        pool_disown_chunk(p, 0);
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_reclaiming, 1);
        assert_int_equal(st.chunks_owned, 2);
        assert_int_equal(pool_reclaim_done(p, 7, 0), 0);
        assert_int_equal(pool_audit(p, why, sizeof(why)), 0);
        pool_free(p);
}

/* A chunk that still holds units is drained: nothing new goes there, pool_alloc_owned finds room
 * only in the owner's other chunks, and the last release makes a pick due, which asks for it. */
static void pool_drains_a_chunk_then_asks_for_it(void **state) {
        struct pool *p = cuda_pool(3);
        struct pool_stats st;
        char why[128];
        uint32_t idx[2], unit;
        uint64_t owner[2], off, moved[3];
        int64_t nc;
        (void)state;
        const uint32_t per_chunk = (uint32_t)(CHUNK / UNIT);
        alloc(p, 7, per_chunk - 4, NULL); /* chunk 0, 4 units free */
        for (int i = 0; i < 3; i++)
                moved[i] = alloc(p, 7, 1, NULL); /* chunk 0's 4th to 2nd last... */
        alloc(p, 7, 1, NULL);                    /* ...and its last */
        for (int i = 0; i < 3; i++)
                moved[i] = alloc(p, 7, 1, NULL); /* chunk 1: 3 units */
        assert_int_equal(moved[0] / CHUNK, 1);
        alloc(p, 8, 1, NULL);                                /* chunk 2 */
        assert_int_equal(pool_release(p, 7, 0, UNIT, 3), 0); /* room for 3 in chunk 0 */
        assert_int_equal(pool_owner_room(p, 7, UNIT), 3 + (per_chunk - 3));
        assert_int_equal(pool_chunk_units(p, 1, &unit), 3);
        assert_int_equal(unit, UNIT);

        assert_int_equal(pool_reclaim_drain(p, 2 + 1), -EINVAL); /* no such chunk */
        assert_int_equal(pool_reclaim_drain(p, 1), 0);
        assert_int_equal(pool_reclaim_drain(p, 1), -EINVAL); /* once */
        assert_true(pool_chunk_draining(p, 1));
        assert_int_equal(pool_owner_room(p, 7, UNIT), 3); /* a drained chunk's room does not count */
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_reclaiming, 1);
        assert_int_equal(pool_audit(p, why, sizeof(why)), 0);     /* units in a drained chunk are fine */
        assert_int_equal(pool_reclaim_pick(p, 2, idx, owner), 0); /* not empty: not asked yet */

        /* the destinations: only the owner's other chunks, never a new one */
        uint64_t to[3];
        for (int i = 0; i < 3; i++) {
                assert_int_equal(pool_alloc_owned(p, 7, UNIT, 1, &to[i]), 0);
                assert_int_equal(to[i] / CHUNK, 0);
        }
        assert_int_equal(pool_alloc_owned(p, 7, UNIT, 1, &off), -ENOSPC);
        assert_int_equal(pool_alloc_owned(p, 9, UNIT, 1, &off), -ENOSPC); /* owns nothing */
        assert_int_equal(pool_alloc_owned(p, 7, 0, 1, &off), -EINVAL);
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_owned, 3);

        /* the moves are applied: the old units go, and the last one makes a pick due */
        assert_int_equal(pool_release(p, 7, moved[0], UNIT, 1), 0);
        assert_int_equal(pool_release(p, 7, moved[1], UNIT, 1), 0);
        assert_false(pool_short_of_chunks(p));
        assert_int_equal(pool_release(p, 7, moved[2], UNIT, 1), 0);
        assert_true(pool_short_of_chunks(p));
        assert_int_equal(pool_reclaim_pick(p, 2, idx, owner), 1);
        assert_int_equal(idx[0], 1);
        assert_int_equal(owner[0], 7);
        assert_false(pool_chunk_draining(p, 1)); /* asked now */
        assert_int_equal(pool_reclaim_done(p, 7, 1), 0);
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_reclaiming, 0);
        assert_int_equal(st.chunks_owned, 2);
        assert_int_equal(pool_audit(p, why, sizeof(why)), 0);
        alloc(p, 9, 1, &nc);
        assert_int_equal(nc, 1);
        pool_free(p);
}

/* An owner that needs room and has no other takes its drained chunk back: still mapped, so not
 * reported as new; the units in it stay. */
static void pool_owner_takes_back_a_chunk_being_drained(void **state) {
        struct pool *p = cuda_pool(2);
        struct pool_stats st;
        char why[128];
        uint32_t unit;
        int64_t nc;
        (void)state;
        alloc(p, 7, 2, NULL);
        alloc(p, 8, 1, NULL);
        assert_int_equal(pool_reclaim_drain(p, 0), 0);
        alloc(p, 7, 1, &nc);
        assert_int_equal(nc, -1);
        assert_false(pool_chunk_draining(p, 0));
        assert_int_equal(pool_chunk_units(p, 0, &unit), 3);
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_reclaiming, 0);
        assert_int_equal(pool_audit(p, why, sizeof(why)), 0);
        assert_int_equal(pool_reclaim_drain(p, 1), 0); /* then cancelled: back to normal */
        pool_reclaim_cancel(p, 1);
        assert_false(pool_chunk_draining(p, 1));
        pool_free(p);
}

static void pool_reclaim_ends_when_the_owner_dies(void **state) {
        struct pool *p = cuda_pool(2);
        struct pool_stats st;
        uint32_t idx[2];
        uint64_t owner[2], off;
        int64_t nc;
        (void)state;
        off = alloc(p, 7, 1, NULL);
        alloc(p, 7, (uint32_t)(CHUNK / UNIT), NULL);
        assert_int_equal(pool_release(p, 7, off, UNIT, 1), 0);
        assert_int_equal(pool_reclaim_pick(p, 2, idx, owner), 1);
        assert_int_equal(idx[0], 0);
        assert_int_equal(pool_reclaim_pick(p, 2, idx, owner), 0); /* asked once */
        pool_reclaim_cancel(p, 0);                                /* could not be asked: called off */
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_reclaiming, 0);
        assert_int_equal(pool_reclaim_done(p, 7, 0), -EINVAL);
        pool_reclaim_cancel(p, 0); /* twice is harmless */
        assert_int_equal(pool_reclaim_pick(p, 2, idx, owner), 1);
        assert_int_equal(pool_release_owner(p, 7), 2);
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_reclaiming, 0);
        assert_int_equal(st.chunks_owned, 0);
        assert_int_equal(pool_reclaim_done(p, 7, 0), -EINVAL); /* a late ack changes nothing */
        alloc(p, 8, 1, &nc);
        assert_int_equal(nc, 0);
        pool_free(p);
}

/* ---- libkvc's device pool ---- */

/* kvcd's side: a cuda pool with chunk 0 granted; its exported fd. */
static struct pool *daemon_with_chunk(uint64_t chunks, int *ret_fd) {
        struct pool *p = cuda_pool(chunks);
        alloc(p, 7, 1, NULL);
        *ret_fd = pool_chunk_fd(p, 0);
        return p;
}

/* The fake's UUID of device dev, whether or not it has that many. */
static const uint8_t *uuid_of(int dev) {
        static struct cuda_uuid u;
        assert_int_equal(cuda_uuid_parse("GPU-fa4ec0da-0000-4000-8000-000000000000", &u), 0);
        u.bytes[15] = (unsigned char)dev;
        return u.bytes;
}

static void devpool_imports_maps_and_shares_memory_with_kvcd(void **state) {
        int fd;
        struct pool *p = daemon_with_chunk(4, &fd);
        struct devpool *dp = NULL;
        char why[256];
        (void)state;
        assert_int_equal(devpool_open(&fake, uuid_of(0), 4 * CHUNK, CHUNK, &dp, why, sizeof(why)), 0);
        assert_int_equal(devpool_device(dp), 0);
        uint64_t base = devpool_base(dp);
        assert_int_equal(base % CHUNK, 0);
        int imports = fc.n_import, releases = fc.n_release;
        assert_int_equal(devpool_map(dp, 2, fd, false, why, sizeof(why)), 0);
        assert_true(devpool_mapped(dp, 2));
        assert_int_equal(fc.n_import, imports + 1);
        assert_int_equal(fc.n_release, releases + 1); /* the mapping holds it, not a handle */
        assert_int_equal(fc.last_access_flags, CUDA_DRV_MEM_ACCESS_FLAGS_PROT_READWRITE);

        /* kvcd writes a plan; the client's kernels (here: the CPU) see it at base + 2 chunks */
        uint32_t plan[4] = { 1, 5, 9, 12 };
        assert_int_equal(pool_write(p, 4096, plan, sizeof(plan)), 0);
        assert_memory_equal((const void *)(uintptr_t)(base + 2 * CHUNK + 4096), plan, sizeof(plan));
        uint32_t copy[4] = { 0 };
        assert_int_equal(devpool_read(dp, 2 * CHUNK + 4096, copy, sizeof(copy)), 0);
        assert_memory_equal(copy, plan, sizeof(plan));
        /* the client's scores, read back by kvcd */
        float score = 0.25f, seen = 0;
        assert_int_equal(devpool_write(dp, 2 * CHUNK + 8192, &score, sizeof(score)), 0);
        assert_int_equal(pool_read(p, 8192, &seen, sizeof(seen)), 0);
        assert_true(seen == 0.25f);

        assert_int_equal(devpool_read(dp, 1 * CHUNK, copy, 4), -EINVAL); /* not mapped */
        assert_int_equal(devpool_read(dp, 3 * CHUNK - 2, copy, 4), -EINVAL);
        assert_int_equal(devpool_read(dp, 4 * CHUNK, copy, 4), -EINVAL);

        /* a block relocated on the device: copied, synchronized, visible to kvcd */
        int syncs = fc.n_sync;
        assert_int_equal(devpool_copy(dp, 2 * CHUNK + 65536, 2 * CHUNK + 4096, sizeof(plan)), 0);
        assert_int_equal(fc.n_dtod, 1);
        assert_int_equal(fc.n_sync, syncs + 1);
        assert_int_equal(pool_read(p, 65536, copy, sizeof(copy)), 0);
        assert_memory_equal(copy, plan, sizeof(plan));
        assert_int_equal(devpool_copy(dp, 1 * CHUNK, 2 * CHUNK, 64), -EINVAL); /* not mapped */
        assert_int_equal(devpool_copy(dp, 2 * CHUNK, 3 * CHUNK - 32, 64), -EINVAL);
        assert_int_equal(fc.n_dtod, 1);
        devpool_free(dp);
        pool_free(p);
}

static void devpool_maps_read_only_chunks_read_only(void **state) {
        int fd;
        struct pool *p = daemon_with_chunk(2, &fd);
        struct devpool *dp = NULL;
        char why[256];
        (void)state;
        assert_int_equal(devpool_open(&fake, uuid_of(0), 2 * CHUNK, CHUNK, &dp, why, sizeof(why)), 0);
        assert_int_equal(devpool_map(dp, 0, fd, true, why, sizeof(why)), 0);
        assert_int_equal(fc.last_access_flags, CUDA_DRV_MEM_ACCESS_FLAGS_PROT_READ);
        uint32_t v = 1;
        assert_int_equal(devpool_write(dp, 0, &v, sizeof(v)), -EIO); /* the driver refuses the write */
        assert_int_equal(devpool_read(dp, 0, &v, sizeof(v)), 0);
        devpool_free(dp);
        pool_free(p);
}

static void devpool_refuses_double_maps_and_chunks_outside_the_pool(void **state) {
        int fd;
        struct pool *p = daemon_with_chunk(2, &fd);
        struct devpool *dp = NULL;
        char why[256];
        (void)state;
        assert_int_equal(devpool_open(&fake, uuid_of(0), 2 * CHUNK, CHUNK, &dp, why, sizeof(why)), 0);
        assert_int_equal(devpool_map(dp, 2, fd, false, why, sizeof(why)), -EINVAL);
        assert_int_equal(devpool_map(dp, 1, fd, false, why, sizeof(why)), 0);
        int imports = fc.n_import;
        assert_int_equal(devpool_map(dp, 1, fd, false, why, sizeof(why)), -EEXIST);
        assert_int_equal(fc.n_import, imports);
        devpool_free(dp);
        pool_free(p);
}

static void devpool_unmap_lets_go_of_the_chunk(void **state) {
        int fd;
        struct pool *p = daemon_with_chunk(2, &fd);
        struct devpool *dp = NULL;
        char why[256];
        (void)state;
        assert_int_equal(devpool_open(&fake, uuid_of(0), 2 * CHUNK, CHUNK, &dp, why, sizeof(why)), 0);
        assert_int_equal(devpool_map(dp, 0, fd, false, why, sizeof(why)), 0);
        int unmaps = fc.n_unmap;
        assert_int_equal(devpool_unmap(dp, 0, why, sizeof(why)), 0);
        assert_int_equal(fc.n_unmap, unmaps + 1);
        assert_false(devpool_mapped(dp, 0));
        uint32_t v;
        assert_int_equal(devpool_read(dp, 0, &v, sizeof(v)), -EINVAL);
        assert_int_equal(devpool_unmap(dp, 0, why, sizeof(why)), -EINVAL);
        assert_int_equal(devpool_map(dp, 0, fd, false, why, sizeof(why)), 0); /* granted again later */
        devpool_free(dp);
        pool_free(p);
}

static void devpool_free_unmaps_and_frees_the_range(void **state) {
        int fd;
        struct pool *p = daemon_with_chunk(4, &fd);
        struct devpool *dp = NULL;
        char why[256];
        (void)state;
        int retained = fc.ctx_retained, frees = fc.n_address_free;
        assert_int_equal(devpool_open(&fake, uuid_of(0), 4 * CHUNK, CHUNK, &dp, why, sizeof(why)), 0);
        assert_int_equal(fc.ctx_retained, retained + 1);
        assert_int_equal(devpool_map(dp, 0, fd, false, why, sizeof(why)), 0);
        assert_int_equal(devpool_map(dp, 3, fd, false, why, sizeof(why)), 0);
        int unmaps = fc.n_unmap;
        assert_null(devpool_free(dp));
        assert_int_equal(fc.n_unmap, unmaps + 2);
        assert_int_equal(fc.n_address_free, frees + 1); /* accepted: nothing mapped in it any more */
        assert_int_equal(fc.ctx_retained, retained);
        assert_null(devpool_free(NULL));
        pool_free(p);
}

static void devpool_open_refuses_a_gpu_this_process_cannot_see(void **state) {
        struct devpool *dp = NULL;
        char why[256];
        (void)state;
        fc.n_devices = 2;
        assert_int_equal(devpool_open(&fake, uuid_of(5), 4 * CHUNK, CHUNK, &dp, why, sizeof(why)), -ENXIO);
        assert_non_null(strstr(why, "GPU-fa4ec0da-0000-4000-8000-000000000005"));
        assert_int_equal(devpool_open(&fake, uuid_of(1), 4 * CHUNK, 3 * MIB, &dp, why, sizeof(why)), -EPROTO);
        fc.granularity = 4 * MIB;
        assert_int_equal(devpool_open(&fake, uuid_of(1), 4 * CHUNK, CHUNK, &dp, why, sizeof(why)), -EPROTO);
        assert_null(dp);
        assert_int_equal(fc.ctx_retained, 0);
}

static void devpool_map_failure_leaves_nothing_imported(void **state) {
        int fd;
        struct pool *p = daemon_with_chunk(2, &fd);
        struct devpool *dp = NULL;
        char why[256];
        (void)state;
        assert_int_equal(devpool_open(&fake, uuid_of(0), 2 * CHUNK, CHUNK, &dp, why, sizeof(why)), 0);
        int live = fakecuda_live_allocs();
        fc.fail_map = CUDA_DRV_ERROR_INVALID_VALUE;
        assert_int_equal(devpool_map(dp, 0, fd, false, why, sizeof(why)), -EIO);
        assert_non_null(strstr(why, "cuMemMap"));
        fc.fail_map = 0;
        fc.fail_set_access = CUDA_DRV_ERROR_INVALID_VALUE;
        assert_int_equal(devpool_map(dp, 0, fd, false, why, sizeof(why)), -EIO);
        fc.fail_set_access = 0;
        fc.fail_import = CUDA_DRV_ERROR_INVALID_VALUE;
        assert_int_equal(devpool_map(dp, 0, fd, false, why, sizeof(why)), -EIO);
        fc.fail_import = 0;
        assert_int_equal(fakecuda_live_allocs(), live);
        assert_false(devpool_mapped(dp, 0));
        assert_int_equal(devpool_map(dp, 0, fd, false, why, sizeof(why)), 0);
        devpool_free(dp);
        pool_free(p);
}

#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)

int main(void) {
        log_set_level(LOG_CRIT); /* the failure paths log errors on purpose */
        const struct CMUnitTest tests[] = {
                T(cuda_uuid_parses_the_nvidia_smi_form_and_round_trips),
                T(cuda_uuid_rejects_what_is_not_a_uuid),
                T(backend_find_knows_host_cuda_and_auto),
                T(cuda_backend_without_a_driver_says_error_35),
                T(auto_falls_back_to_host_when_the_driver_is_missing),
                T(cuda_backend_refuses_a_stub_driver_with_error_34),
                T(cuda_backend_refuses_a_machine_without_devices_with_error_100),
                T(cuda_backend_refuses_a_device_without_vmm_or_posix_fds),
                T(cuda_backend_picks_the_device_by_uuid),
                T(cuda_backend_refuses_an_unknown_or_malformed_uuid),
                T(cuda_backend_refuses_chunks_that_are_not_a_granularity_multiple),
                T(cuda_backend_reports_a_failed_address_reservation),
                T(cuda_chunk_is_created_exported_zeroed_and_mapped_in_kvcds_range),
                T(cuda_reads_and_writes_land_at_the_chunks_device_address),
                T(cuda_scrub_zeroes_the_whole_chunk_before_another_owner_gets_it),
                T(cuda_destroy_and_close_release_everything),
                T(cuda_create_failures_return_enomem_or_eio_and_leak_nothing),
                T(cuda_scrub_failure_retires_the_chunk),
                T(cuda_adopts_a_chunk_kept_across_a_restart_with_its_bytes),
                T(pool_reclaims_an_empty_chunk_only_after_its_owner_acknowledges),
                T(pool_owner_takes_back_a_chunk_being_reclaimed_when_it_has_no_other),
                T(pool_drains_a_chunk_then_asks_for_it),
                T(pool_owner_takes_back_a_chunk_being_drained),
                T(pool_reclaim_ends_when_the_owner_dies),
                T(devpool_imports_maps_and_shares_memory_with_kvcd),
                T(devpool_maps_read_only_chunks_read_only),
                T(devpool_refuses_double_maps_and_chunks_outside_the_pool),
                T(devpool_unmap_lets_go_of_the_chunk),
                T(devpool_free_unmaps_and_frees_the_range),
                T(devpool_open_refuses_a_gpu_this_process_cannot_see),
                T(devpool_map_failure_leaves_nothing_imported),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
