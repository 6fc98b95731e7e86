/* text.h - the text side of a model, whatever its format: a llama2.c tokenizer file beside a
 * checkpoint (tokenizer.h) or the vocabulary inside a GGUF (bpe.h, with its chat template, chat.h),
 * behind one interface for the programs: encode a prompt or a chat turn, the bytes of each token
 * generated, and the tokens that end generation.
 *
 * Owns: struct text and the tokenizer it wraps (for a GGUF, its own read-only mapping of the file:
 * the pages are the model's too, so nothing is read twice).
 */
#ifndef KVC_ENGINE_TEXT_H
#define KVC_ENGINE_TEXT_H

#include <stdbool.h>
#include <stddef.h>

struct text;

/* A llama2.c tokenizer file for a model of vocab_size tokens. */
int text_open_llama2c(const char *path, int vocab_size, struct text **ret);
/* The vocabulary of a GGUF file; why says what was refused. */
int text_open_gguf(const char *path, struct text **ret, char *why, size_t why_len);
struct text *text_free(struct text *t);

/* The token a generation without a prompt starts from (BOS), or -1 when the model has none to
 * offer (a GGUF chat model: give it a prompt). */
int text_start_token(const struct text *t);
/* Encodes s: for llama2.c, BOS first and its dummy prefix; for a GGUF, special tokens parsed and
 * BOS only when the file asks for it. -ENOBUFS past cap tokens. */
int text_encode(const struct text *t, const char *s, int *ids, size_t cap, size_t *ret_n);
/* Renders one chat turn with the model's template (ChatML; system NULL: the model's default
 * system prompt) and encodes it, ending with the assistant's generation prompt. -ENOTSUP for a
 * model without a chat template. */
int text_encode_chat(const struct text *t, const char *system, const char *user, int *ids, size_t cap,
                     size_t *ret_n);
/* The bytes token `next` prints after `prev`, copied into buf (not NUL-terminated). */
int text_piece(const struct text *t, int prev, int next, char *buf, size_t cap, size_t *ret_len);
/* Whether generation ends at token id (EOS; for llama2.c, BOS: a new story begins). */
bool text_is_stop(const struct text *t, int id);

#endif
