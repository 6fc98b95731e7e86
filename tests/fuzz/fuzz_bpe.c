/* fuzz_bpe.c: libFuzzer target for the byte-level BPE tokenizer (client/engine/bpe.c): the
 * vocabulary and merges parsing of bpe_new and bpe_from_gguf, the encoder and the decoder.
 *
 * Input: [flags][ids][spec][0x00][text]. The low two bits of flags pick the vocabulary:
 *   0, 1  a hostile vocabulary built from spec: one line ('\n') per token or merge. A line
 *         "Dtext" (D a digit) is a token of type D (7..9 are out of range and must be refused)
 *         whose text is as GGUF stores it; "mleft right" is a merge. With flags bit 2 the 256
 *         byte tokens of GPT-2's byte-to-unicode alphabet come first, so every byte has a token
 *         and most mutated merges name real tokens. The low nibble of ids minus 1 is the BOS id,
 *         the high nibble minus 1 the unknown id (either may lie outside the vocabulary).
 *   2     the real SmolLM2 vocabulary (49152 tokens, 48900 merges), loaded once from $KVC_SMOLLM2
 *         or the model cache; inputs are skipped when it is not there.
 *   3     spec and text together are a GGUF file, read by bpe_from_gguf (keys of the wrong type,
 *         arrays of the wrong length, ids outside the vocabulary); what loads encodes a fixed text.
 * Bit 3 of flags: the smollm pre-tokenizer (else gpt-2); bit 4: parse special tokens; bit 5: BOS.
 *
 * What a vocabulary bpe_new accepts must do, whatever it said:
 *   - encode: 0 (or -ENOMEM), every id inside the vocabulary, BOS first when asked, at most
 *     text length + 1 ids, and -ENOSPC when one id fewer is allowed;
 *   - decode: the ids decode; when every byte has a token, back to exactly the text (merges and
 *     special tokens never lose or invent a byte); a buffer one byte short is refused;
 *   - ids read from the text decode, or are refused with -EINVAL when outside the vocabulary.
 * Refusals must be -EINVAL (or -ENOENT/-ENOTSUP from a GGUF) with a reason in why.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bpe.h"
#include "gguf.h"

#define FUZZ_CHECK(cond)                                                                                     \
        do {                                                                                                 \
                if (!(cond)) {                                                                               \
                        fprintf(stderr, "fuzz_bpe: %s:%d: %s\n", __FILE__, __LINE__, #cond);                 \
                        abort();                                                                             \
                }                                                                                            \
        } while (0)

#define FUZZ_MAX_LINES 4096

/* GPT-2's byte-to-unicode alphabet, written independently of bpe.c: bytes '!'..'~', 0xA1..0xAC
 * and 0xAE..0xFF stand for themselves, the other 68 become U+0100.. in order. UTF-8 into out[4]. */
static size_t byte_char(int byte, char out[4]) {
        static int cp_of[256];
        static bool ready;
        if (!ready) {
                int k = 0;
                for (int b = 0; b < 256; b++) {
                        bool self = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
                        cp_of[b] = self ? b : 256 + k++;
                }
                ready = true;
        }
        int cp = cp_of[byte];
        if (cp < 0x80) {
                out[0] = (char)cp;
                return 1;
        }
        out[0] = (char)(0xC0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
}

static void check_tokenizer(const struct bpe *b, const char *text, size_t len, bool parse_special, bool bos) {
        int32_t n_vocab = bpe_n_vocab(b);
        FUZZ_CHECK(n_vocab > 0);
        bos = bos && bpe_bos_id(b) >= 0;
        bool every_byte = true;
        for (int c = 0; c < 256 && every_byte; c++) {
                char ch = (char)c;
                every_byte = bpe_find(b, &ch, 1) >= 0;
        }

        size_t cap = len + 1, n = 0;
        int32_t *ids = malloc(cap * sizeof(*ids));
        FUZZ_CHECK(ids);
        int r = bpe_encode(b, text, len, bos, parse_special, ids, cap, &n);
        FUZZ_CHECK(r == 0 || r == -ENOMEM);
        if (r < 0) {
                free(ids);
                return;
        }
        FUZZ_CHECK(n <= cap);
        FUZZ_CHECK(!bos || (n >= 1 && ids[0] == bpe_bos_id(b)));
        size_t bytes = 0;
        for (size_t i = 0; i < n; i++) {
                const char *p;
                size_t l;
                FUZZ_CHECK(ids[i] >= 0 && ids[i] < n_vocab);
                FUZZ_CHECK(bpe_token_bytes(b, ids[i], &p, &l) == 0);
                FUZZ_CHECK(bpe_token_type(b, ids[i]) >= 0);
                bytes += l;
        }
        if (n > 0) { /* one id fewer does not fit */
                size_t m = 777;
                FUZZ_CHECK(bpe_encode(b, text, len, bos, parse_special, ids, n - 1, &m) == -ENOSPC);
                FUZZ_CHECK(m == 777);
                r = bpe_encode(b, text, len, bos, parse_special, ids, cap, &n); /* ids again */
                FUZZ_CHECK(r == 0);
        }

        char *out = malloc(bytes + 1);
        FUZZ_CHECK(out);
        size_t out_len = 0;
        FUZZ_CHECK(bpe_decode(b, ids, n, out, bytes + 1, &out_len) == 0);
        FUZZ_CHECK(out_len == bytes && out[out_len] == '\0');
        FUZZ_CHECK(bpe_utf8_incomplete_tail(out, out_len) <= 3 &&
                   bpe_utf8_incomplete_tail(out, out_len) <= out_len);
        if (every_byte) {
                const char *p;
                size_t skip = 0;
                if (bos)
                        FUZZ_CHECK(bpe_token_bytes(b, ids[0], &p, &skip) == 0);
                FUZZ_CHECK(out_len == skip + len && memcmp(out + skip, text, len) == 0);
        } else {
                FUZZ_CHECK(out_len <= len + (bos ? BPE_MAX_TOKEN_BYTES : 0));
        }
        if (bytes > 0) {
                size_t kept = 4242;
                FUZZ_CHECK(bpe_decode(b, ids, n, out, bytes, &kept) == -ENOSPC && kept == 4242);
        }
        free(out);
        free(ids);

        /* the text's bytes as ids: inside the vocabulary they decode, outside they are refused */
        size_t n_raw = len / 4 < 64 ? len / 4 : 64;
        for (size_t i = 0; i < n_raw; i++) {
                int32_t id;
                memcpy(&id, text + 4 * i, 4);
                char buf[2 * BPE_MAX_TOKEN_BYTES];
                size_t l;
                r = bpe_decode(b, &id, 1, buf, sizeof(buf), &l);
                FUZZ_CHECK(id >= 0 && id < n_vocab ? r == 0 : r == -EINVAL);
                const char *p;
                FUZZ_CHECK((bpe_token_bytes(b, id, &p, &l) == 0) == (id >= 0 && id < n_vocab));
        }
}

/* The hostile vocabulary of spec, built and checked. */
static void from_spec(const uint8_t *spec, size_t spec_len, unsigned flags, unsigned idb, const char *text,
                      size_t text_len) {
        static struct bpe_str tokens[256 + FUZZ_MAX_LINES], merges[FUZZ_MAX_LINES];
        static int32_t types[256 + FUZZ_MAX_LINES];
        static char alphabet[256][4];
        size_t n_tokens = 0, n_merges = 0;
        if (flags & 4u)
                for (int c = 0; c < 256; c++) {
                        tokens[n_tokens].len = byte_char(c, alphabet[c]);
                        tokens[n_tokens].s = alphabet[c];
                        types[n_tokens++] = BPE_TOKEN_NORMAL;
                }
        for (size_t at = 0; at < spec_len;) {
                const uint8_t *nl = memchr(spec + at, '\n', spec_len - at);
                size_t end = nl ? (size_t)(nl - spec) : spec_len;
                if (end > at) {
                        const char *line = (const char *)spec + at;
                        size_t len = end - at;
                        if (line[0] >= '0' && line[0] <= '9' && n_tokens < 256 + FUZZ_MAX_LINES) {
                                types[n_tokens] = line[0] - '0';
                                tokens[n_tokens++] = (struct bpe_str){ line + 1, len - 1 };
                        } else if (line[0] == 'm' && n_merges < FUZZ_MAX_LINES) {
                                merges[n_merges++] = (struct bpe_str){ line + 1, len - 1 };
                        }
                }
                at = end + 1;
        }
        struct bpe_vocab v = { .tokens = tokens,
                               .n_tokens = n_tokens,
                               .types = types,
                               .merges = merges,
                               .n_merges = n_merges,
                               .pre = (flags & 8u) ? BPE_PRE_SMOLLM : BPE_PRE_GPT2,
                               .bos_id = (int32_t)(idb & 15u) - 1,
                               .eos_id = -1,
                               .unk_id = (int32_t)(idb >> 4) - 1,
                               .pad_id = -1,
                               .add_bos = (flags & 32u) != 0 };
        struct bpe *b = NULL;
        char why[256] = "";
        int r = bpe_new(&v, &b, why, sizeof(why));
        FUZZ_CHECK(r == 0 || r == -EINVAL || r == -ENOMEM);
        FUZZ_CHECK(r == 0 ? b != NULL : b == NULL && why[0]);
        if (r < 0)
                return;
        FUZZ_CHECK(bpe_n_vocab(b) == (int32_t)n_tokens);
        check_tokenizer(b, text, text_len, (flags & 16u) != 0, (flags & 32u) != 0);
        bpe_free(b);
}

static struct bpe *smollm2(void) {
        static struct bpe *b;
        static bool tried;
        if (tried)
                return b;
        tried = true;
        const char *path = getenv("KVC_SMOLLM2"), *home = getenv("HOME");
        char def[512];
        if (!path || !*path) {
                snprintf(def, sizeof(def), "%s/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                         home ? home : "");
                path = def;
        }
        struct gguf *g;
        char why[256];
        if (gguf_open(path, &g, why, sizeof(why)) < 0)
                return NULL;
        if (bpe_from_gguf(g, &b, why, sizeof(why)) < 0)
                b = NULL;
        gguf_free(g); /* bpe_new copies what it keeps */
        return b;
}

static void from_gguf(const uint8_t *file, size_t len, unsigned flags) {
        static const char text[] =
                "<|im_start|>user\nHello, 123 world! It's \xc3\xa9t\xc3\xa9 \xff\n<|im_end|>";
        struct gguf *g;
        char why[256] = "";
        int r = gguf_open_buffer(file, len, &g, why, sizeof(why));
        if (r < 0)
                return;
        struct bpe *b = NULL;
        why[0] = 0;
        r = bpe_from_gguf(g, &b, why, sizeof(why));
        gguf_free(g);
        FUZZ_CHECK(r == 0 || r == -ENOENT || r == -ENOTSUP || r == -EINVAL || r == -ENOMEM);
        FUZZ_CHECK(r == 0 ? b != NULL : b == NULL && why[0]);
        if (r < 0)
                return;
        check_tokenizer(b, text, sizeof(text) - 1, (flags & 16u) != 0, (flags & 32u) != 0);
        bpe_free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size < 2)
                return 0;
        unsigned flags = data[0], idb = data[1];
        const uint8_t *spec = data + 2;
        size_t rest = size - 2;
        if ((flags & 3u) == 3u) {
                from_gguf(spec, rest, flags);
                return 0;
        }
        const uint8_t *zero = memchr(spec, 0, rest);
        size_t spec_len = zero ? (size_t)(zero - spec) : rest;
        const char *text = zero ? (const char *)zero + 1 : (const char *)spec + rest;
        size_t text_len = zero ? rest - spec_len - 1 : 0;
        if ((flags & 3u) == 2u) {
                struct bpe *b = smollm2();
                if (b) /* the whole input is the text */
                        check_tokenizer(b, (const char *)spec, rest, (flags & 16u) != 0, (flags & 32u) != 0);
                return 0;
        }
        from_spec(spec, spec_len, flags, idb, text, text_len);
        return 0;
}
