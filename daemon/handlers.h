/* handlers.h: what handlers.c offers the rest of kvcd: a frame in and its reply out, the requests
 * waiting for memory tried again, and send_envelope(), the one way a message goes to a ZeroMQ peer
 * (a reply, or a note kvcd sends unasked). Apart from kvcd.h so that a file that only sends does
 * not depend on the request table. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "kvc.pb-c.h"

struct kvcd;
struct session;

enum channel {
        CHANNEL_CLIENT = 1,
        CHANNEL_ADMIN = 2,
};

/* Handles one frame from peer rid on the channel and sends the reply. */
void handle_frame(struct kvcd *d, enum channel ch, void *zsock, const uint8_t *rid, size_t rid_len,
                  const uint8_t *data, size_t len);
/* Tries the requests waiting for memory again; answers them, or refuses them at their deadline. */
void handlers_retry_waits(struct kvcd *d, uint64_t now);

/* Sends an envelope to a peer of a ROUTER; -errno when it was dropped (the peer left, or stopped
 * reading). */
int send_envelope(struct kvcd *d, void *zsock, const uint8_t *rid, size_t rid_len, const Kvc__Envelope *env);
/* A PlanBatch of one plan (and its grant, when g holds any layer) that no request asked for
 * (request id 0: a relocation's moves, a demotion's next link) to s's client. */
int send_unasked_plan(struct kvcd *d, const struct session *s, Kvc__Plan *p, Kvc__Grant *g);
