/* tokenizer.h - the llama2.c tokenizer (tok*.bin): load, encode, decode one piece.
 *
 * Owns: struct tokenizer, the vocabulary of a llama2.c tokenizer file (int32 max_token_length, then
 * per token: float32 score, int32 length, the bytes) and a sorted index of it for lookups.
 *
 * Semantics are llama2.c run.c's so that text round-trips the way the reference model was trained:
 * encode adds a leading space ("dummy prefix") to non-empty text, looks up each UTF-8 code point
 * (falling back to byte tokens 3 + byte), then greedily merges the adjacent pair whose concatenated
 * piece has the highest score (leftmost on ties) until no pair is in the vocabulary. decode strips
 * the leading space of a piece that follows BOS and turns a byte token "<0xXX>" into the raw byte.
 * Ids: 0 <unk>, 1 BOS, 2 EOS, 3..258 the byte tokens.
 *
 * Everything is bounded: lengths come with every string, the caller supplies output capacity, and
 * a file that is truncated, has trailing bytes or a piece longer than its own max_token_length is
 * rejected with -EINVAL. A struct tokenizer is immutable after load and may be shared by threads.
 */
#ifndef KVC_CLIENT_TOKENIZER_H
#define KVC_CLIENT_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>

#define TOKENIZER_UNK              0
#define TOKENIZER_BOS              1
#define TOKENIZER_EOS              2
#define TOKENIZER_FIRST_BYTE_TOKEN 3

struct tokenizer;

/* vocab_size is the model's (the file does not record it): 259..2^20, since ids 3..258 must be the
 * byte tokens. The file must hold exactly vocab_size entries and nothing after them.
 * Returns 0, -EINVAL (malformed or too large), -ENOENT/-EACCES/... (open), -EIO, -ENOMEM. */
int tokenizer_load(const char *path, int vocab_size, struct tokenizer **ret);
/* The same from memory; data is copied and not kept. */
int tokenizer_load_buffer(const void *data, size_t len, int vocab_size, struct tokenizer **ret);
struct tokenizer *tokenizer_free(struct tokenizer *t);

int tokenizer_vocab_size(const struct tokenizer *t);
/* The longest piece in bytes; a buffer of this plus one always fits tokenizer_piece_safe. */
size_t tokenizer_max_piece_bytes(const struct tokenizer *t);

/* Encodes text[0..text_len) (any bytes; NUL is an ordinary byte here) into tokens[0..*ret_n),
 * with BOS first and/or EOS last when asked. cap >= text_len + 3 always suffices. Writes nothing
 * to tokens and *ret_n on failure.
 * Returns 0, -EINVAL (NULL argument or text_len > 2^28), -ENOBUFS (more than cap tokens),
 * -ENOMEM (the work arrays, about 90 bytes per input byte, freed before returning). */
int tokenizer_encode(const struct tokenizer *t, const char *text, size_t text_len, bool bos, bool eos,
                     int *tokens, size_t cap, size_t *ret_n);

/* The bytes that token prints as when it follows prev_token (pass -1 when there is none):
 * *ret_piece points into the tokenizer (valid until tokenizer_free), not NUL-terminated, and may be
 * empty. A byte token "<0xXX>" (exactly six characters, hex digits) decodes to its one raw byte.
 * Returns 0 or -EINVAL for a token outside the vocabulary. */
int tokenizer_decode(const struct tokenizer *t, int prev_token, int token, const char **ret_piece,
                     size_t *ret_len);

/* tokenizer_decode, then llama2.c's safe_printf filter: a one-byte piece that is neither printable
 * ASCII nor whitespace becomes empty (longer pieces, e.g. UTF-8, pass). The result is copied to buf
 * and NUL-terminated; *ret_len excludes the NUL. Returns 0, -EINVAL, or -ENOBUFS when
 * cap < length + 1 (buf and *ret_len then untouched). */
int tokenizer_piece_safe(const struct tokenizer *t, int prev_token, int token, char *buf, size_t cap,
                         size_t *ret_len);

#endif
