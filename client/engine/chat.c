/* chat.c - the ChatML template: measure, then copy.
 *
 * Owns: chat_render. It walks the conversation twice with one function: once counting bytes,
 * once writing, so the bound check happens before any byte is written and the two passes cannot
 * disagree about the length.
 */
#include "chat.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>

/* A cursor that counts every byte and writes only when out is set. */
struct chat_out {
        char *out;
        size_t len;
        bool overflow;
};

static void chat_put(struct chat_out *o, const char *s, size_t n) {
        if (n > SIZE_MAX - o->len) {
                o->overflow = true;
                return;
        }
        if (o->out)
                memcpy(o->out + o->len, s, n);
        o->len += n;
}

static void chat_puts(struct chat_out *o, const char *s) {
        chat_put(o, s, strlen(s));
}

static void chat_turn(struct chat_out *o, const char *role, const char *text) {
        chat_puts(o, "<|im_start|>");
        chat_puts(o, role);
        chat_puts(o, "\n");
        chat_puts(o, text);
        chat_puts(o, "<|im_end|>\n");
}

static bool chat_role_ok(const char *role) {
        size_t n = 0;

        for (; role[n]; n++) {
                char c = role[n];

                if (n == CHAT_MAX_ROLE || !((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                                            (c >= '0' && c <= '9') || c == '_' || c == '-'))
                        return false;
        }
        return n > 0;
}

static void chat_walk(struct chat_out *o, const struct chat_msg *msgs, size_t n_msgs,
                      bool add_generation_prompt) {
        if (n_msgs && strcmp(msgs[0].role, "system"))
                chat_turn(o, "system", CHAT_DEFAULT_SYSTEM);
        for (size_t i = 0; i < n_msgs; i++)
                chat_turn(o, msgs[i].role, msgs[i].text);
        if (add_generation_prompt)
                chat_puts(o, "<|im_start|>assistant\n");
}

int chat_render(const struct chat_msg *msgs, size_t n_msgs, bool add_generation_prompt, char *buf, size_t cap,
                size_t *ret_len) {
        struct chat_out o = { 0 };

        if ((!msgs && n_msgs) || !ret_len || (!buf && cap))
                return -EINVAL;
        for (size_t i = 0; i < n_msgs; i++)
                if (!msgs[i].role || !msgs[i].text || !chat_role_ok(msgs[i].role))
                        return -EINVAL;
        chat_walk(&o, msgs, n_msgs, add_generation_prompt);
        if (o.overflow || o.len == SIZE_MAX)
                return -EOVERFLOW;
        if (!buf) {
                *ret_len = o.len;
                return 0;
        }
        if (cap < o.len + 1)
                return -ENOSPC;
        o = (struct chat_out){ .out = buf };
        chat_walk(&o, msgs, n_msgs, add_generation_prompt);
        buf[o.len] = '\0';
        *ret_len = o.len;
        return 0;
}
