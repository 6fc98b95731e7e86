/* backend.c: the backend table, selection (auto), and the host backend (sealed memfd chunks).
 *
 * Host chunks are memfds sealed against shrinking and growing, so a client that holds the fd
 * cannot truncate the pool under kvcd (SIGBUS) or grow it past its budget. Scrubbing punches a
 * hole over the whole chunk: the pages are freed and read back as zeros, without a write pass.
 */
#define _GNU_SOURCE
#include "backend.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static int host_chunk_create(uint64_t bytes, uint8_t *addr, struct backend_chunk *ret) {
        int fd = memfd_create("kvcd-chunk", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0)
                return -errno;
        if (ftruncate(fd, (off_t)bytes) < 0 ||
            fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
                int r = -errno;
                close(fd);
                return r;
        }
        void *m = mmap(addr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
        if (m == MAP_FAILED) {
                int r = -errno;
                close(fd);
                return r;
        }
        ret->fd = fd;
        ret->map = m;
        return 0;
}

static int host_chunk_adopt(int fd, uint64_t bytes, uint8_t *addr, struct backend_chunk *ret) {
        struct stat st;
        if (fstat(fd, &st) < 0 || (uint64_t)st.st_size != bytes)
                return -EINVAL;
        void *m = mmap(addr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
        if (m == MAP_FAILED)
                return -errno;
        ret->fd = fd;
        ret->map = m;
        return 0;
}

static int host_chunk_scrub(struct backend_chunk *c, uint64_t bytes) {
        if (fallocate(c->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)bytes) == 0)
                return 0;
        memset(c->map, 0, bytes); /* a filesystem without hole punching: zero by hand */
        return 0;
}

static void host_chunk_destroy(struct backend_chunk *c, uint64_t bytes) {
        /* back to an inaccessible page range of the reservation, rather than a hole in it */
        mmap(c->map, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        close(c->fd);
        c->fd = -1;
}

static int host_read(const struct backend_chunk *c, uint64_t offset, void *dst, size_t n) {
        memcpy(dst, c->map + offset, n);
        return 0;
}

static int host_write(struct backend_chunk *c, uint64_t offset, const void *src, size_t n) {
        memcpy(c->map + offset, src, n);
        return 0;
}

static const struct backend_ops host_ops = {
        .name = "host",
        .device = false,
        .chunk_create = host_chunk_create,
        .chunk_adopt = host_chunk_adopt,
        .chunk_scrub = host_chunk_scrub,
        .chunk_destroy = host_chunk_destroy,
        .read = host_read,
        .write = host_write,
};

static const struct {
        const char *name;
        const struct backend_ops *ops;
} backends[] = {
        { "host", &host_ops },
        { "cuda", &backend_cuda_ops },
        { "auto", &host_ops }, /* backend_select() tries cuda first */
};

int backend_find(const char *name, const struct backend_ops **ret) {
        for (size_t i = 0; i < sizeof(backends) / sizeof(backends[0]); i++) {
                if (strcmp(backends[i].name, name) == 0) {
                        *ret = backends[i].ops;
                        return 0;
                }
        }
        return -ENOENT;
}

static int backend_open(const struct backend_ops *ops, const struct backend_params *p, char *why,
                        size_t why_len) {
        return ops->open ? ops->open(p, why, why_len) : 0;
}

int backend_select(const char *name, const struct backend_params *p, const struct backend_ops **ret,
                   char *why, size_t why_len) {
        const struct backend_ops *ops;
        int r;
        why[0] = 0;
        if ((r = backend_find(name, &ops)) < 0) {
                snprintf(why, why_len, "unknown backend %s (host, cuda, auto)", name);
                return r;
        }
        if (strcmp(name, "auto") == 0) {
                r = backend_open(&backend_cuda_ops, p, why, why_len);
                if (r == 0) {
                        why[0] = 0;
                        *ret = &backend_cuda_ops;
                        return 0;
                }
                if (r != -ENODEV)
                        return r;
                /* keep cuda's reason: the caller logs why auto chose host */
                size_t n = strlen(why);
                snprintf(why + n, why_len - n, "; using the host backend");
        }
        if ((r = backend_open(ops, p, why, why_len)) < 0) /* host: no open, why stays cuda's */
                return r;
        *ret = ops;
        return 0;
}

void backend_close(const struct backend_ops *ops) {
        if (ops && ops->close)
                ops->close();
}

void backend_get_info(const struct backend_ops *ops, struct backend_info *ret) {
        *ret = (struct backend_info){ 0 };
        if (ops && ops->get_info)
                ops->get_info(ret);
}
