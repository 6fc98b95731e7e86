/* fuzz_tokenizer.c: libFuzzer target for kvc-run's tokenizer (client/tokenizer.c): the loader,
 * the BPE encoder and the piece decoder.
 *
 * Input: [u16 vocab][u16 text length][text][tokenizer file], little-endian. With bit 15 of vocab
 * set, its low 10 bits + 259 are the vocabulary size the loader is told (so most files are
 * refused: the size must match the file exactly); otherwise the harness counts the file's records
 * and passes that, so mutated files mostly load and the encoder gets to run on hostile
 * vocabularies (NUL bytes in pieces, duplicate pieces, NaN scores, byte tokens that are not
 * "<0xHH>").
 *
 * What a loaded tokenizer must do, whatever the file said:
 *   - encode: every id inside the vocabulary, BOS/EOS where asked, at most text length + 3 ids,
 *     -ENOBUFS (and nothing written) when the output does not fit;
 *   - decode: every id decodes, and tokenizer_piece_safe fits a buffer of max_piece_bytes + 1;
 *   - when the byte tokens 3..258 are the usual "<0xHH>" pieces, the pieces of the encoding
 *     concatenate back to " " + text (the dummy prefix): merging never loses or invents a byte.
 *     (Skipped when the text itself contains "<0x": a merge may then land on a byte token.)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"

#define FUZZ_CHECK(cond)                                                                                     \
        do {                                                                                                 \
                if (!(cond)) {                                                                               \
                        fprintf(stderr, "fuzz_tokenizer: %s:%d: %s\n", __FILE__, __LINE__, #cond);           \
                        abort();                                                                             \
                }                                                                                            \
        } while (0)

/* The number of records [f32 score][i32 len][len bytes] after the i32 header that consume the file
 * exactly, or 0. */
static int count_records(const uint8_t *p, size_t len) {
        size_t at = 4;
        int n = 0;
        if (len < 4)
                return 0;
        while (at < len && n < (1 << 20)) {
                int32_t l;
                if (len - at < 8)
                        return 0;
                memcpy(&l, p + at + 4, 4);
                if (l < 0 || (size_t)l > len - at - 8)
                        return 0;
                at += 8 + (size_t)l;
                n++;
        }
        return at == len ? n : 0;
}

static bool byte_tokens_are_sane(const struct tokenizer *t) {
        for (int b = 0; b < 256; b++) {
                const char *piece;
                size_t len;
                if (tokenizer_decode(t, -1, TOKENIZER_FIRST_BYTE_TOKEN + b, &piece, &len) < 0 || len != 1 ||
                    (unsigned char)piece[0] != b)
                        return false;
        }
        return true;
}

static void check_encoding(const struct tokenizer *t, const char *text, size_t text_len, bool bos, bool eos) {
        int vocab = tokenizer_vocab_size(t);
        size_t cap = text_len + 3, n = 0;
        int *ids = malloc(cap * sizeof(int));
        FUZZ_CHECK(ids);
        int r = tokenizer_encode(t, text, text_len, bos, eos, ids, cap, &n);
        FUZZ_CHECK(r == 0 || r == -ENOMEM);
        if (r < 0) {
                free(ids);
                return;
        }
        FUZZ_CHECK(n <= cap && n >= (size_t)bos + (size_t)eos + (text_len ? 1u : 0u));
        FUZZ_CHECK(!bos || ids[0] == TOKENIZER_BOS);
        FUZZ_CHECK(!eos || ids[n - 1] == TOKENIZER_EOS);

        size_t piece_cap = tokenizer_max_piece_bytes(t) + 1;
        char *piece = malloc(piece_cap);
        FUZZ_CHECK(piece);
        for (size_t i = 0; i < n; i++) {
                size_t len;
                FUZZ_CHECK(ids[i] >= 0 && ids[i] < vocab);
                FUZZ_CHECK(tokenizer_piece_safe(t, i ? ids[i - 1] : -1, ids[i], piece, piece_cap, &len) == 0);
                FUZZ_CHECK(len < piece_cap && piece[len] == '\0');
        }
        free(piece);

        if (n > 0) { /* a buffer one short is refused, and left alone */
                size_t m = 12345;
                int sentinel = -7;
                int *small = malloc(n * sizeof(int));
                FUZZ_CHECK(small);
                small[n - 1] = sentinel;
                FUZZ_CHECK(tokenizer_encode(t, text, text_len, bos, eos, small, n - 1, &m) == -ENOBUFS);
                FUZZ_CHECK(m == 12345 && small[n - 1] == sentinel);
                free(small);
        }

        if (!bos && !eos && text_len > 0 && !memmem(text, text_len, "<0x", 3) && byte_tokens_are_sane(t)) {
                size_t total = 0;
                char *joined = malloc(text_len + 2);
                FUZZ_CHECK(joined);
                for (size_t i = 0; i < n; i++) {
                        const char *p;
                        size_t len;
                        FUZZ_CHECK(tokenizer_decode(t, -1, ids[i], &p, &len) == 0);
                        FUZZ_CHECK(total + len <= text_len + 1);
                        memcpy(joined + total, p, len);
                        total += len;
                }
                FUZZ_CHECK(total == text_len + 1 && joined[0] == ' ' &&
                           memcmp(joined + 1, text, text_len) == 0);
                free(joined);
        }
        free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size < 4)
                return 0;
        unsigned sel = (unsigned)data[0] | (unsigned)data[1] << 8;
        size_t text_len = (size_t)data[2] | (size_t)data[3] << 8;
        if (text_len > size - 4)
                text_len = size - 4;
        const char *text = (const char *)data + 4;
        const uint8_t *file = data + 4 + text_len;
        size_t file_len = size - 4 - text_len;

        int vocab = (sel & 0x8000u) ? (int)(sel & 0x3ffu) + 259 : count_records(file, file_len);
        struct tokenizer *t;
        int r = tokenizer_load_buffer(file, file_len, vocab, &t);
        FUZZ_CHECK(r == 0 || r == -EINVAL || r == -ENOMEM);
        if (r < 0)
                return 0;
        FUZZ_CHECK(tokenizer_vocab_size(t) == vocab);

        check_encoding(t, text, text_len, false, false);
        check_encoding(t, text, text_len, true, (sel & 1u) != 0);
        const char *p;
        size_t len;
        FUZZ_CHECK(tokenizer_decode(t, -1, vocab, &p, &len) == -EINVAL);
        FUZZ_CHECK(tokenizer_decode(t, -1, -1, &p, &len) == -EINVAL);
        tokenizer_free(t);
        return 0;
}
