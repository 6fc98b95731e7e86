/* rawpeer.h: a client that speaks kvcd's protocol by hand (wire.c and raw sockets, no libkvc),
 * so tests can send what libkvc never would: garbage, oversized frames, other clients' ids; and
 * rawadmin, an admin peer that stays connected between requests (kvcctl connects once a request). */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "wire.h"

struct rawpeer {
        void *zctx, *zsock;
        int fd;
        uint8_t token[WIRE_TOKEN_BYTES];
        struct wire_arena *arena;
        uint64_t next_id;
};

/* Connects to kvcd in runtime directory dir: the fd channel (token), the ZeroMQ socket, and
 * Hello when hello is true. */
int rawpeer_open(struct rawpeer *p, const char *dir, bool hello);
void rawpeer_close(struct rawpeer *p);
int rawpeer_send_bytes(struct rawpeer *p, const void *data, size_t len);
/* Stamps version 1 and a fresh request id (returned in env->request_id) and sends. */
int rawpeer_send(struct rawpeer *p, Kvc__Envelope *env);
/* The next message (valid until the next receive), within timeout_ms. */
int rawpeer_recv(struct rawpeer *p, int timeout_ms, Kvc__Envelope **ret);
/* Sends env and receives its answer. */
int rawpeer_call(struct rawpeer *p, Kvc__Envelope *env, Kvc__Envelope **ret);
/* Opens a session of the stories260K geometry with the policy; its id in *ret_id. */
int rawpeer_open_session(struct rawpeer *p, const char *policy, uint32_t budget, uint64_t *ret_id);

struct rawadmin {
        void *ctx, *sock;
        struct wire_arena *arena;
        uint64_t next_id;
};

/* Connects to the admin socket of kvcd in runtime directory dir. */
int rawadmin_open(struct rawadmin *a, const char *dir);
void rawadmin_close(struct rawadmin *a);
/* A Status round trip within timeout_ms; *ret is valid until the next call. Answers to earlier
 * requests (that timed out) are skipped. */
int rawadmin_status(struct rawadmin *a, int timeout_ms, const Kvc__Status **ret);
