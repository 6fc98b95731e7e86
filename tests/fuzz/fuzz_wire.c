/* fuzz_wire.c: libFuzzer target for proto/wire.c, the only code that turns socket bytes into
 * messages.
 *
 * Every input is decoded twice, as kvcd decodes a request (64 KiB cap, its 1 MiB arena) and as
 * libkvc decodes a reply (8 MiB cap, its 16 MiB arena). Whatever decodes must then hold up:
 *   - wire_validate() accepts it again (decoding is validation; nothing is checked only once);
 *   - packing it and decoding the packed frame gives a message that validates and packs to the
 *     very same bytes (a canonical round trip).
 * Unknown fields are cleared before the round trip: protobuf-c keeps them and packs them back,
 * but it accepts some it cannot re-read (a field number 0 in an overlong varint, platform notes
 * 4.4), so their round trip is not an invariant of ours. kvcd never echoes a peer's message.
 *
 * Violations abort(), which both libFuzzer and the replay program report as a crash.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire.h"

#define REQUEST_ARENA_BYTES (WIRE_REQUEST_MAX_BYTES * 16u)
#define REPLY_ARENA_BYTES   (WIRE_REPLY_MAX_BYTES * 2u)

static struct wire_arena *request_arena, *reply_arena, *again_arena;

#define FUZZ_CHECK(cond)                                                                                     \
        do {                                                                                                 \
                if (!(cond)) {                                                                               \
                        fprintf(stderr, "fuzz_wire: %s:%d: %s\n", __FILE__, __LINE__, #cond);                \
                        abort();                                                                             \
                }                                                                                            \
        } while (0)

/* Clears the unknown fields of m and of every message inside it. */
static void strip_unknown(ProtobufCMessage *m) {
        const ProtobufCMessageDescriptor *d = m->descriptor;
        m->n_unknown_fields = 0;
        m->unknown_fields = NULL;
        for (unsigned i = 0; i < d->n_fields; i++) {
                const ProtobufCFieldDescriptor *f = &d->fields[i];
                char *base = (char *)m;
                if (f->type != PROTOBUF_C_TYPE_MESSAGE)
                        continue;
                if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
                    *(uint32_t *)(base + f->quantifier_offset) != f->id)
                        continue;
                if (f->label == PROTOBUF_C_LABEL_REPEATED) {
                        size_t n = *(size_t *)(base + f->quantifier_offset);
                        ProtobufCMessage **v = *(ProtobufCMessage ***)(base + f->offset);
                        for (size_t j = 0; j < n; j++)
                                strip_unknown(v[j]);
                } else {
                        ProtobufCMessage *sub = *(ProtobufCMessage **)(base + f->offset);
                        if (sub)
                                strip_unknown(sub);
                }
        }
}

static uint8_t *pack(const Kvc__Envelope *env, size_t *ret_len) {
        size_t n = wire_packed_size(env);
        uint8_t *buf = malloc(n ? n : 1);
        FUZZ_CHECK(buf);
        FUZZ_CHECK(wire_pack(env, buf) == n);
        *ret_len = n;
        return buf;
}

static void check_decoded(Kvc__Envelope *env) {
        char why[WIRE_MAX_MESSAGE];
        FUZZ_CHECK(wire_validate(env, why, sizeof(why)) == 0);
        FUZZ_CHECK(strcmp(wire_body_name(env->body_case), "unknown") != 0);
        if (env->body_case == KVC__ENVELOPE__BODY_ERROR)
                FUZZ_CHECK(wire_errno_name(env->error->code) != NULL);

        strip_unknown(&env->base);
        size_t len1, len2;
        uint8_t *one = pack(env, &len1);
        Kvc__Envelope *again;
        int r = wire_decode(again_arena, one, len1, WIRE_REPLY_MAX_BYTES, &again, why, sizeof(why));
        if (r != 0)
                fprintf(stderr, "fuzz_wire: the repacked %s does not decode: %s\n",
                        wire_body_name(env->body_case), why);
        FUZZ_CHECK(r == 0);
        FUZZ_CHECK(again->body_case == env->body_case && again->request_id == env->request_id);
        uint8_t *two = pack(again, &len2);
        FUZZ_CHECK(len1 == len2 && memcmp(one, two, len1) == 0);
        free(one);
        free(two);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        (void)argc;
        (void)argv;
        if (wire_arena_new(REQUEST_ARENA_BYTES, &request_arena) < 0 ||
            wire_arena_new(REPLY_ARENA_BYTES, &reply_arena) < 0 ||
            wire_arena_new(REPLY_ARENA_BYTES, &again_arena) < 0)
                abort();
        return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        char why[WIRE_MAX_MESSAGE];
        Kvc__Envelope *env;
        int r;

        r = wire_decode(request_arena, data, size, WIRE_REQUEST_MAX_BYTES, &env, why, sizeof(why));
        FUZZ_CHECK(r == 0 || r == -EMSGSIZE || r == -EPROTO || r == -EINVAL);
        if (r == 0)
                check_decoded(env);

        r = wire_decode(reply_arena, data, size, WIRE_REPLY_MAX_BYTES, &env, why, sizeof(why));
        FUZZ_CHECK(r == 0 || r == -EMSGSIZE || r == -EPROTO || r == -EINVAL);
        if (r == 0)
                check_decoded(env);
        return 0;
}
