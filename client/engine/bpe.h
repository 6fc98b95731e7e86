/* bpe.h - byte-level BPE (GPT-2 style), the tokenizer of GGUF models with tokenizer.ggml.model
 * "gpt2": SmolLM2 and its kin.
 *
 * Owns: struct bpe, a vocabulary (each token's bytes and type), its merges by rank, the special
 * ids, and the hash maps that make encoding linear in the text: bytes -> id, and (left id, right
 * id) -> (rank, merged id).
 *
 * Encoding is llama.cpp's (llama-vocab.cpp, "parse special" on, no BOS added unless asked):
 *  1. with parse_special, the text is cut at every occurrence of a control, user-defined or unknown
 *     token's text, longest token first (each cut is that token's id);
 *  2. each remaining fragment is pre-tokenized by the regex of tokenizer.ggml.pre: for "smollm"
 *     first \p{N} (every number code point alone), then GPT-2's
 *     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ (contractions
 *     case-sensitive); "gpt-2" is the second regex alone;
 *  3. each pre-token's bytes are merged pairwise, lowest merge rank first (leftmost on ties),
 *     until no adjacent pair has a merge.
 * Decoding maps ids back to bytes: a normal token through the inverse of GPT-2's byte-to-unicode
 * table (the vocabulary stores space as U+0120 'Ġ'), a control, user-defined or unknown token as
 * its text. Bytes are bytes: a UTF-8 character split across tokens comes out split, and
 * bpe_utf8_incomplete_tail tells a streaming caller how many trailing bytes to hold back.
 *
 * Trust: the vocabulary and the text are untrusted. Text is any bytes: invalid UTF-8 is cut into
 * single bytes of class "other". A byte that the vocabulary has no token for (SmolLM2 lacks 21 of
 * the 256, bytes that valid UTF-8 never holds, such as 0xC0 and 0xF5..0xFF, and a few controls) is
 * dropped, as llama.cpp drops it: such text does not round-trip. bpe_new refuses -EINVAL, with the
 * reason in why, a normal token that is not in the byte-to-unicode alphabet, a merge that is not
 * two tokens of the vocabulary whose concatenation is a third, a type outside 0..6, and special
 * ids outside the vocabulary. A struct bpe is immutable after bpe_new: threads may share it.
 */
#ifndef KVC_ENGINE_BPE_H
#define KVC_ENGINE_BPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct gguf;

#define BPE_MAX_VOCAB       (1 << 24)
#define BPE_MAX_TOKEN_BYTES (1u << 16)        /* bytes of one token's text */
#define BPE_MAX_TEXT_BYTES  ((size_t)1 << 30) /* one bpe_encode call */

/* tokenizer.ggml.token_type, llama.cpp's numbering. */
enum bpe_token_type {
        BPE_TOKEN_UNDEFINED = 0,
        BPE_TOKEN_NORMAL = 1,
        BPE_TOKEN_UNKNOWN = 2,
        BPE_TOKEN_CONTROL = 3,
        BPE_TOKEN_USER_DEFINED = 4,
        BPE_TOKEN_UNUSED = 5,
        BPE_TOKEN_BYTE = 6,
};

enum bpe_pre {
        BPE_PRE_GPT2 = 0, /* "gpt-2": the GPT-2 regex */
        BPE_PRE_SMOLLM,   /* "smollm": \p{N} split first, then the GPT-2 regex */
};

/* Bytes that are not NUL-terminated. */
struct bpe_str {
        const char *s;
        size_t len;
};

/* What bpe_new builds from; nothing is kept (the texts are copied). Token and merge texts are as
 * GGUF stores them: normal tokens in GPT-2's byte-to-unicode alphabet, merges "left right" in it. */
struct bpe_vocab {
        const struct bpe_str *tokens; /* [n_tokens] */
        size_t n_tokens;
        const int32_t *types;         /* [n_tokens], enum bpe_token_type; NULL: every token normal */
        const struct bpe_str *merges; /* [n_merges]; the rank is the index */
        size_t n_merges;
        enum bpe_pre pre;
        int32_t bos_id, eos_id, unk_id, pad_id; /* -1: none */
        bool add_bos;
};

struct bpe;

/* 0, -EINVAL (malformed vocabulary: why says which token or merge), -ENOMEM. *ret untouched on
 * failure. A duplicated token text maps to its first id; a duplicated merge keeps its first rank. */
int bpe_new(const struct bpe_vocab *v, struct bpe **ret, char *why, size_t why_len);
/* Reads tokenizer.ggml.{model, pre, tokens, token_type, merges, bos/eos/unknown/padding_token_id,
 * add_bos_token} and calls bpe_new. -ENOENT (a required key absent), -ENOTSUP (model not "gpt2",
 * or a pre-tokenizer without a row here), -EINVAL (a key of the wrong type, or bpe_new's), -ENOMEM. */
int bpe_from_gguf(const struct gguf *g, struct bpe **ret, char *why, size_t why_len);
struct bpe *bpe_free(struct bpe *b);

int32_t bpe_n_vocab(const struct bpe *b);
/* -1 when the vocabulary has none. */
int32_t bpe_bos_id(const struct bpe *b);
int32_t bpe_eos_id(const struct bpe *b);
int32_t bpe_unk_id(const struct bpe *b);
int32_t bpe_pad_id(const struct bpe *b);
bool bpe_add_bos(const struct bpe *b);
/* The id whose bytes are exactly bytes[0..len) (a normal token before a special one of the same
 * bytes), or -ENOENT. */
int32_t bpe_find(const struct bpe *b, const char *bytes, size_t len);

/* Encodes text[0..text_len) into ids[0..*ret_n), BOS first when bos. With parse_special the texts
 * of control, user-defined and unknown tokens become those tokens; without, they are plain text.
 * Every token is at least one byte of text, so cap >= text_len + 1 always suffices.
 * Returns 0, -EINVAL (NULL argument, text_len > BPE_MAX_TEXT_BYTES, bos without a BOS id),
 * -ENOSPC (more than cap ids), -ENOMEM. On failure *ret_n is untouched and ids[0..cap) unspecified. */
int bpe_encode(const struct bpe *b, const char *text, size_t text_len, bool bos, bool parse_special,
               int32_t *ids, size_t cap, size_t *ret_n);

/* The bytes of one token (its text for control, user-defined and unknown tokens): *ret points into
 * b, valid until bpe_free, not NUL-terminated. 0 or -EINVAL for an id outside the vocabulary. */
int bpe_token_bytes(const struct bpe *b, int32_t id, const char **ret, size_t *ret_len);
/* enum bpe_token_type of id, or -EINVAL. */
int bpe_token_type(const struct bpe *b, int32_t id);
/* The bytes of ids[0..n) concatenated into buf, NUL-terminated (*ret_len excludes the NUL).
 * 0, -EINVAL (an id outside the vocabulary), -ENOSPC (cap < length + 1; buf, *ret_len untouched). */
int bpe_decode(const struct bpe *b, const int32_t *ids, size_t n, char *buf, size_t cap, size_t *ret_len);

/* How many trailing bytes of buf[0..len) are the start of a UTF-8 character that is not complete
 * yet (0..3): a streaming printer holds them back until the next token's bytes arrive. Invalid
 * bytes count as complete (they will never become valid). */
size_t bpe_utf8_incomplete_tail(const char *buf, size_t len);

#endif
