/* chat.h - the ChatML chat template as SmolLM2 uses it (its tokenizer.chat_template).
 *
 * Owns: rendering a conversation into the prompt text. Each message becomes
 * "<|im_start|>ROLE\nTEXT<|im_end|>\n"; when the first message is not a system message, a system
 * message with CHAT_DEFAULT_SYSTEM goes first; with the generation prompt the text ends in
 * "<|im_start|>assistant\n". The result is meant for bpe_encode with parse_special, which turns the
 * markers into their control tokens.
 *
 * Trust: a role is 1..CHAT_MAX_ROLE bytes of [A-Za-z0-9_-] (so it cannot carry a newline or a
 * marker); a text is any bytes. A text that contains a marker's text is rendered as is and becomes
 * that control token under parse_special, as llama.cpp's chat path does: a caller who takes text
 * from an untrusted party and cares filters it first. Rejected: a Jinja interpreter (one template
 * of five lines does not need one; a model with another template gets another row here).
 */
#ifndef KVC_ENGINE_CHAT_H
#define KVC_ENGINE_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#define CHAT_DEFAULT_SYSTEM "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
#define CHAT_MAX_ROLE       32

struct chat_msg {
        const char *role; /* "system", "user", "assistant", ... (NUL-terminated) */
        const char *text; /* NUL-terminated */
};

/* Renders msgs[0..n_msgs) (and the generation prompt when asked) into buf, NUL-terminated;
 * *ret_len excludes the NUL. buf == NULL with cap == 0 only measures: *ret_len is the length.
 * Returns 0, -EINVAL (NULL argument, a bad role), -ENOSPC (cap < length + 1: buf and *ret_len
 * untouched), -EOVERFLOW (a length past SIZE_MAX). */
int chat_render(const struct chat_msg *msgs, size_t n_msgs, bool add_generation_prompt, char *buf, size_t cap,
                size_t *ret_len);

#endif
