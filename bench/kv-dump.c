/* kv-dump: the engine's real queries, keys and values for the quantizer study (bench/quant-study.py,
 * bench/quant-study.md).
 *
 * Runs a GGUF model in process over a text (the plain cache, as kvc-run --local does, prompt chunks
 * of 256 rows through model_forward_rows) behind a struct model_cache_ops wrapper that records, for
 * the layers asked for, what store() receives (the post-RoPE key and the value of every position)
 * and what attend()/attend_rows() receive (the post-RoPE query) and return (the attention output of
 * the exact float32 cache, the reference). The engine is not changed.
 *
 *   kv-dump --model M.gguf --text FILE [--offset BYTES] [--tokens N] [--layers 0,1,7,15,23,29]
 *           [--threads T] --out FILE
 *
 * The text is FILE from byte --offset on (moved forward to the next blank line, so it starts at a
 * paragraph), encoded, cut to --tokens tokens (an error when there are fewer).
 *
 * Output (little-endian): the header, 16 int32: magic 0x504d444b ("KDMP"), version 1, n_dump_layers,
 * T (tokens), n_heads, n_kv_heads, head_dim, n_layers (the model's), then 8 zeros; then
 * n_dump_layers int32 layer ids; then T int32 token ids; then per dumped layer, in order, four
 * float32 arrays: q [T][n_heads*head_dim], k [T][n_kv_heads*head_dim], v [T][n_kv_heads*head_dim],
 * o [T][n_heads*head_dim] (o: the plain cache's attention output for q).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "text.h"

#define MAX_DUMP 64

struct rec {
        struct plain_cache *plain;
        int n_dump, T, qdim, kvdim;
        int slot[256]; /* layer -> dump index, -1 */
        float *q[MAX_DUMP], *k[MAX_DUMP], *v[MAX_DUMP], *o[MAX_DUMP];
};

static int rec_store(void *ctx, int layer, int pos, const float *k, const float *v) {
        struct rec *r = ctx;
        int s = layer < 256 ? r->slot[layer] : -1;
        if (s >= 0 && pos < r->T) {
                memcpy(r->k[s] + (size_t)pos * r->kvdim, k, (size_t)r->kvdim * sizeof(float));
                memcpy(r->v[s] + (size_t)pos * r->kvdim, v, (size_t)r->kvdim * sizeof(float));
        }
        return plain_cache_ops.store(r->plain, layer, pos, k, v);
}

static int rec_attend(void *ctx, int layer, int pos, const float *q, float *out) {
        struct rec *r = ctx;
        int e = plain_cache_ops.attend(r->plain, layer, pos, q, out);
        int s = layer < 256 ? r->slot[layer] : -1;
        if (e == 0 && s >= 0 && pos < r->T) {
                memcpy(r->q[s] + (size_t)pos * r->qdim, q, (size_t)r->qdim * sizeof(float));
                memcpy(r->o[s] + (size_t)pos * r->qdim, out, (size_t)r->qdim * sizeof(float));
        }
        return e;
}

static int rec_attend_rows(void *ctx, int layer, int pos, uint32_t n, const float *q, float *out) {
        struct rec *r = ctx;
        int e = plain_cache_ops.attend_rows(r->plain, layer, pos, n, q, out);
        int s = layer < 256 ? r->slot[layer] : -1;
        for (uint32_t i = 0; e == 0 && s >= 0 && i < n; i++) {
                int p = pos + (int)i;
                if (p >= r->T)
                        break;
                memcpy(r->q[s] + (size_t)p * r->qdim, q + (size_t)i * r->qdim, (size_t)r->qdim * sizeof(float));
                memcpy(r->o[s] + (size_t)p * r->qdim, out + (size_t)i * r->qdim, (size_t)r->qdim * sizeof(float));
        }
        return e;
}

static const struct model_cache_ops rec_ops = {
        .store = rec_store,
        .attend = rec_attend,
        .attend_rows = rec_attend_rows,
};

static char *read_file(const char *path, size_t *len) {
        FILE *f = fopen(path, "rb");
        if (!f)
                return NULL;
        char *buf = NULL;
        size_t cap = 0, n = 0, got;
        do {
                if (n + 65536 + 1 > cap) {
                        cap = (n + 65536 + 1) * 2;
                        char *nb = realloc(buf, cap);
                        if (!nb) {
                                free(buf);
                                fclose(f);
                                return NULL;
                        }
                        buf = nb;
                }
                got = fread(buf + n, 1, 65536, f);
                n += got;
        } while (got > 0);
        fclose(f);
        buf[n] = 0;
        *len = n;
        return buf;
}

static void usage(FILE *f) {
        fprintf(f, "usage: kv-dump --model M.gguf --text FILE [--offset BYTES] [--tokens N] "
                   "[--layers 0,1,7,15,23,29] [--threads T] --out FILE\n");
}

int main(int argc, char **argv) {
        const char *model_path = NULL, *text_path = NULL, *out_path = NULL, *layers = "0,1,7,15,23,29";
        long offset = 0;
        int want = 2048, threads = 0;
        static const struct option opts[] = {
                { "model", required_argument, NULL, 'm' },  { "text", required_argument, NULL, 't' },
                { "offset", required_argument, NULL, 'f' }, { "tokens", required_argument, NULL, 'n' },
                { "layers", required_argument, NULL, 'l' }, { "threads", required_argument, NULL, 'j' },
                { "out", required_argument, NULL, 'o' },    { "help", no_argument, NULL, 'h' },
                { 0 },
        };
        int c;
        while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
                switch (c) {
                case 'm': model_path = optarg; break;
                case 't': text_path = optarg; break;
                case 'f': offset = atol(optarg); break;
                case 'n': want = atoi(optarg); break;
                case 'l': layers = optarg; break;
                case 'j': threads = atoi(optarg); break;
                case 'o': out_path = optarg; break;
                case 'h': usage(stdout); return 0;
                default: usage(stderr); return 2;
                }
        }
        if (!model_path || !text_path || !out_path || want < 1 || offset < 0 || threads < 0) {
                usage(stderr);
                return 2;
        }
        char why[512] = "";
        struct model *m = NULL;
        struct text *tx = NULL;
        struct model_options mo = { .threads = (unsigned)threads };
        int e;
        if ((e = model_open(model_path, &mo, &m, why, sizeof(why))) < 0 || !model_is_gguf(m)) {
                fprintf(stderr, "kv-dump: %s: %s %s\n", model_path, e < 0 ? strerror(-e) : "not a GGUF", why);
                return 1;
        }
        if ((e = text_open_gguf(model_path, &tx, why, sizeof(why))) < 0) {
                fprintf(stderr, "kv-dump: tokenizer: %s %s\n", strerror(-e), why);
                return 1;
        }
        const struct model_config *mc = model_get_config(m);
        int H = mc->n_heads, KVH = mc->n_kv_heads, D = mc->dim / mc->n_heads;
        if (want > mc->seq_len) {
                fprintf(stderr, "kv-dump: --tokens %d > the model's context %d\n", want, mc->seq_len);
                return 2;
        }

        size_t len;
        char *all = read_file(text_path, &len);
        if (!all) {
                fprintf(stderr, "kv-dump: %s: %s\n", text_path, strerror(errno));
                return 1;
        }
        if ((size_t)offset > len)
                offset = (long)len;
        char *start = all + offset;
        if (offset > 0) { /* the next paragraph */
                char *p = strstr(start, "\n\n");
                start = p ? p + 2 : start;
        }
        /* about 4 bytes a token; 6 a token leaves room */
        size_t take = strlen(start), cap_bytes = (size_t)want * 6 + 1024;
        if (take > cap_bytes)
                start[cap_bytes] = 0;
        size_t cap = (size_t)want * 3 + 1024, n_ids = 0;
        int *ids = malloc(cap * sizeof(int));
        if (!ids || (e = text_encode(tx, start, ids, cap, &n_ids)) < 0) {
                fprintf(stderr, "kv-dump: encode: %s\n", strerror(ids ? -e : ENOMEM));
                return 1;
        }
        if (n_ids < (size_t)want) {
                fprintf(stderr, "kv-dump: the text gives %zu tokens, fewer than %d\n", n_ids, want);
                return 1;
        }

        struct rec r = { .T = want, .qdim = H * D, .kvdim = KVH * D };
        for (int i = 0; i < 256; i++)
                r.slot[i] = -1;
        int layer_ids[MAX_DUMP];
        for (const char *p = layers; *p;) {
                char *end;
                long l = strtol(p, &end, 10);
                if (end == p || l < 0 || l >= mc->n_layers || l >= 256 || r.n_dump >= MAX_DUMP ||
                    r.slot[l] >= 0) {
                        fprintf(stderr, "kv-dump: bad --layers %s\n", layers);
                        return 2;
                }
                r.slot[l] = r.n_dump;
                layer_ids[r.n_dump++] = (int)l;
                p = *end == ',' ? end + 1 : end;
        }
        for (int s = 0; s < r.n_dump; s++) {
                r.q[s] = calloc((size_t)want * r.qdim, sizeof(float));
                r.o[s] = calloc((size_t)want * r.qdim, sizeof(float));
                r.k[s] = calloc((size_t)want * r.kvdim, sizeof(float));
                r.v[s] = calloc((size_t)want * r.kvdim, sizeof(float));
                if (!r.q[s] || !r.o[s] || !r.k[s] || !r.v[s]) {
                        fprintf(stderr, "kv-dump: out of memory\n");
                        return 1;
                }
        }
        if ((e = plain_cache_new(mc, want, &r.plain)) < 0) {
                fprintf(stderr, "kv-dump: cache: %s\n", strerror(-e));
                return 1;
        }

        struct model_row rows[MODEL_MAX_ROWS];
        for (int pos = 0; pos < want;) {
                int n = want - pos < MODEL_MAX_ROWS ? want - pos : MODEL_MAX_ROWS;
                for (int i = 0; i < n; i++)
                        rows[i] = (struct model_row){ .token = ids[pos + i], .pos = pos + i, .ctx = &r,
                                                      .logits = i == n - 1 };
                float *logits;
                if ((e = model_forward_rows(m, rows, (uint32_t)n, &rec_ops, &logits)) < 0) {
                        fprintf(stderr, "kv-dump: forward at %d: %s\n", pos, strerror(-e));
                        return 1;
                }
                pos += n;
                fprintf(stderr, "\rkv-dump: %d/%d tokens", pos, want);
        }
        fprintf(stderr, "\n");

        FILE *f = fopen(out_path, "wb");
        if (!f) {
                fprintf(stderr, "kv-dump: %s: %s\n", out_path, strerror(errno));
                return 1;
        }
        int32_t hdr[16] = { 0x504d444b, 1, r.n_dump, want, H, KVH, D, mc->n_layers };
        int ok = fwrite(hdr, sizeof(hdr), 1, f) == 1;
        for (int s = 0; s < r.n_dump; s++) {
                int32_t l = layer_ids[s];
                ok = ok && fwrite(&l, sizeof(l), 1, f) == 1;
        }
        for (int i = 0; i < want; i++) {
                int32_t t = ids[i];
                ok = ok && fwrite(&t, sizeof(t), 1, f) == 1;
        }
        for (int s = 0; s < r.n_dump && ok; s++)
                ok = fwrite(r.q[s], sizeof(float) * r.qdim, (size_t)want, f) == (size_t)want &&
                     fwrite(r.k[s], sizeof(float) * r.kvdim, (size_t)want, f) == (size_t)want &&
                     fwrite(r.v[s], sizeof(float) * r.kvdim, (size_t)want, f) == (size_t)want &&
                     fwrite(r.o[s], sizeof(float) * r.qdim, (size_t)want, f) == (size_t)want;
        if (fclose(f) != 0 || !ok) {
                fprintf(stderr, "kv-dump: %s: write failed\n", out_path);
                return 1;
        }
        fprintf(stderr, "kv-dump: %d layers x %d tokens -> %s\n", r.n_dump, want, out_path);
        for (int s = 0; s < r.n_dump; s++) {
                free(r.q[s]);
                free(r.o[s]);
                free(r.k[s]);
                free(r.v[s]);
        }
        free(ids);
        free(all);
        plain_cache_free(r.plain);
        text_free(tx);
        model_free(m);
        return 0;
}
