/* replay.c: runs files through a libFuzzer target without libFuzzer, so `make test` replays the
 * checked-in corpora with the project's own compiler and flags (and under ASan/UBSan in
 * `make check`).
 *
 *   replay-TARGET PATH...   every regular file of each directory (not recursive, dot files
 *                           skipped) or each file named, in name order
 *
 * Prints "N inputs replayed" and exits 0; a target that finds a violation aborts, so the exit
 * status is non-zero. With REPLAY_VERBOSE set in the environment, each input's name goes to stderr
 * before it runs, so the last one names the culprit (replay.sh reruns a failure that way). Exits 2
 * when a path cannot be read, or when nothing was replayed at all (an empty corpus is a broken
 * test).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

static int verbose;

static int replay_file(const char *path) {
        FILE *f = fopen(path, "rb");
        if (!f) {
                fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
                return -1;
        }
        size_t cap = 4096, len = 0, n;
        uint8_t *buf = malloc(cap);
        while (buf && (n = fread(buf + len, 1, cap - len, f)) > 0) {
                len += n;
                if (len == cap) {
                        uint8_t *b = realloc(buf, cap * 2);
                        if (!b) {
                                free(buf);
                                buf = NULL;
                                break;
                        }
                        buf = b;
                        cap *= 2;
                }
        }
        fclose(f);
        if (!buf) {
                fprintf(stderr, "replay: %s: out of memory\n", path);
                return -1;
        }
        /* an exact-size copy, so ASan sees a read past the input as one */
        uint8_t *exact = malloc(len ? len : 1);
        if (!exact) {
                free(buf);
                return -1;
        }
        memcpy(exact, buf, len);
        free(buf);
        if (verbose)
                fprintf(stderr, "replaying %s\n", path);
        LLVMFuzzerTestOneInput(exact, len);
        free(exact);
        return 0;
}

static int by_name(const struct dirent **a, const struct dirent **b) {
        return strcmp((*a)->d_name, (*b)->d_name);
}

static int skip_dot(const struct dirent *e) {
        return e->d_name[0] != '.';
}

int main(int argc, char **argv) {
        long replayed = 0;
        verbose = getenv("REPLAY_VERBOSE") != NULL;
        if (LLVMFuzzerInitialize)
                LLVMFuzzerInitialize(&argc, &argv);
        for (int i = 1; i < argc; i++) {
                struct stat st;
                if (stat(argv[i], &st) < 0) {
                        fprintf(stderr, "replay: %s: %s\n", argv[i], strerror(errno));
                        return 2;
                }
                if (!S_ISDIR(st.st_mode)) {
                        if (replay_file(argv[i]) < 0)
                                return 2;
                        replayed++;
                        continue;
                }
                struct dirent **names;
                int n = scandir(argv[i], &names, skip_dot, by_name);
                if (n < 0) {
                        fprintf(stderr, "replay: %s: %s\n", argv[i], strerror(errno));
                        return 2;
                }
                for (int j = 0; j < n; j++) {
                        char path[4096];
                        snprintf(path, sizeof(path), "%s/%s", argv[i], names[j]->d_name);
                        if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
                                if (replay_file(path) < 0)
                                        return 2;
                                replayed++;
                        }
                        free(names[j]);
                }
                free(names);
        }
        printf("%ld inputs replayed\n", replayed);
        return replayed > 0 ? 0 : 2;
}
