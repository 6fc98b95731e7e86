/* text.c - text.h over tokenizer.c (llama2.c) and bpe.c + chat.c (GGUF).
 *
 * The two formats differ in three places only, kept as branches here rather than a table of
 * operations: where a generation starts, how a prompt is encoded, and which token ends it.
 */
#include "text.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bpe.h"
#include "chat.h"
#include "gguf.h"
#include "tokenizer.h"

struct text {
        struct tokenizer *tok; /* llama2.c */
        struct bpe *bpe;       /* GGUF */
        int32_t eos, eot;      /* GGUF: <|im_end|> (the file's EOS) and <|endoftext|>, or -1 */
};

int text_open_llama2c(const char *path, int vocab_size, struct text **ret) {
        struct text *t = calloc(1, sizeof(*t));
        if (!t)
                return -ENOMEM;
        int r = tokenizer_load(path, vocab_size, &t->tok);
        if (r < 0) {
                free(t);
                return r;
        }
        *ret = t;
        return 0;
}

int text_open_gguf(const char *path, struct text **ret, char *why, size_t why_len) {
        struct text *t = calloc(1, sizeof(*t));
        struct gguf *g = NULL;
        if (!t)
                return -ENOMEM;
        int r = gguf_open(path, &g, why, why_len);
        if (r == 0)
                r = bpe_from_gguf(g, &t->bpe, why, why_len);
        gguf_free(g); /* the tokenizer keeps copies of what it needs */
        if (r < 0) {
                free(t);
                return r;
        }
        t->eos = bpe_eos_id(t->bpe);
        int32_t eot = bpe_find(t->bpe, "<|endoftext|>", 13);
        t->eot = eot >= 0 ? eot : -1;
        *ret = t;
        return 0;
}

struct text *text_free(struct text *t) {
        if (!t)
                return NULL;
        tokenizer_free(t->tok);
        bpe_free(t->bpe);
        free(t);
        return NULL;
}

int text_start_token(const struct text *t) {
        return t->tok ? TOKENIZER_BOS : -1;
}

int text_encode(const struct text *t, const char *s, int *ids, size_t cap, size_t *ret_n) {
        if (t->tok)
                return tokenizer_encode(t->tok, s, strlen(s), true, false, ids, cap, ret_n);
        _Static_assert(sizeof(int) == sizeof(int32_t), "ids are int32");
        int r = bpe_encode(t->bpe, s, strlen(s), bpe_add_bos(t->bpe), true, (int32_t *)ids, cap, ret_n);
        return r == -ENOSPC ? -ENOBUFS : r;
}

int text_encode_chat(const struct text *t, const char *system, const char *user, int *ids, size_t cap,
                     size_t *ret_n) {
        if (!t->bpe)
                return -ENOTSUP;
        struct chat_msg msgs[2];
        size_t n = 0, len;
        if (system)
                msgs[n++] = (struct chat_msg){ .role = "system", .text = system };
        msgs[n++] = (struct chat_msg){ .role = "user", .text = user };
        int r = chat_render(msgs, n, true, NULL, 0, &len);
        if (r < 0)
                return r;
        char *buf = malloc(len + 1);
        if (!buf)
                return -ENOMEM;
        r = chat_render(msgs, n, true, buf, len + 1, &len);
        if (r == 0)
                r = bpe_encode(t->bpe, buf, len, bpe_add_bos(t->bpe), true, (int32_t *)ids, cap, ret_n);
        free(buf);
        return r == -ENOSPC ? -ENOBUFS : r;
}

int text_piece(const struct text *t, int prev, int next, char *buf, size_t cap, size_t *ret_len) {
        if (t->tok)
                return tokenizer_piece_safe(t->tok, prev, next, buf, cap, ret_len);
        const char *bytes;
        size_t n;
        int r = bpe_token_bytes(t->bpe, next, &bytes, &n);
        if (r < 0)
                return r;
        if (n > cap)
                return -ENOBUFS;
        memcpy(buf, bytes, n);
        *ret_len = n;
        return 0;
}

bool text_is_stop(const struct text *t, int id) {
        if (t->tok)
                return id == TOKENIZER_BOS;
        return id == t->eos || id == t->eot;
}
