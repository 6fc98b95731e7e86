/* dequant-dump.c - the C side of tests/engine/dequant.sh: dequantizes one tensor of a GGUF file with
 * client/engine/qtype.c and writes its values to stdout as raw little-endian float32.
 *
 *   dequant-dump FILE OFFSET TYPE N
 *
 * OFFSET is the tensor data's absolute byte offset in FILE, TYPE ggml's type number, N the element
 * count (a multiple of the type's block). The caller (tests/python/check_dequant.py) reads these
 * with the gguf package's GGUFReader, so this program needs no GGUF reader of its own, and its
 * output is compared with gguf.quants.dequantize bit for bit.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qtype.h"

#define CHUNK_BLOCKS 4096

int main(int argc, char **argv) {
        if (argc != 5) {
                fprintf(stderr, "usage: dequant-dump FILE OFFSET TYPE N\n");
                return 2;
        }
        char *end;
        unsigned long long offset = strtoull(argv[2], &end, 0), n = strtoull(argv[4], NULL, 0);
        const struct qtype *t = qtype_of((uint32_t)strtoul(argv[3], NULL, 0));
        if (*end || !t || !t->dequantize || n % t->block) {
                fprintf(stderr,
                        "dequant-dump: type %s has no dequantize, or %llu is not a multiple of its block\n",
                        argv[3], n);
                return 2;
        }
        FILE *f = fopen(argv[1], "rb");
        if (!f || fseeko(f, (off_t)offset, SEEK_SET) < 0) {
                fprintf(stderr, "dequant-dump: %s: %s\n", argv[1], strerror(errno));
                return 1;
        }
        size_t chunk = (size_t)CHUNK_BLOCKS * t->block;
        uint8_t *src = malloc((size_t)CHUNK_BLOCKS * t->bytes);
        float *dst = malloc(chunk * sizeof(float));
        if (!src || !dst)
                return 1;
        for (unsigned long long done = 0; done < n; done += chunk) {
                size_t len = n - done < chunk ? (size_t)(n - done) : chunk, bytes = len / t->block * t->bytes;
                if (fread(src, 1, bytes, f) != bytes) {
                        fprintf(stderr, "dequant-dump: %s: short read at element %llu\n", argv[1], done);
                        return 1;
                }
                t->dequantize(src, dst, len);
                if (fwrite(dst, sizeof(float), len, stdout) != len)
                        return 1;
        }
        free(src);
        free(dst);
        fclose(f);
        return fflush(stdout) ? 1 : 0;
}
