/* rawpeer.c: hand-made protocol peer for the bad-input tests. */
#define _GNU_SOURCE
#include "rawpeer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "fdwire.h"

int rawpeer_open(struct rawpeer *p, const char *dir, bool hello) {
        memset(p, 0, sizeof(*p));
        p->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/kvcd.fd.sock", dir);
        if (p->fd < 0 || connect(p->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
                return -errno;
        struct fdwire_msg m;
        int fd, r = fdwire_recv(p->fd, &m, &fd, 10000);
        if (r < 0)
                return r;
        memcpy(p->token, m.token, sizeof(p->token));
        if ((r = wire_arena_new(WIRE_REPLY_MAX_BYTES * 2, &p->arena)) < 0)
                return r;

        char ep[300];
        int zero = 0;
        snprintf(ep, sizeof(ep), "ipc://%s/kvcd.sock", dir);
        p->zctx = zmq_ctx_new();
        p->zsock = zmq_socket(p->zctx, ZMQ_DEALER);
        zmq_setsockopt(p->zsock, ZMQ_LINGER, &zero, sizeof(zero));
        if (zmq_connect(p->zsock, ep) < 0)
                return -ECONNREFUSED;
        if (!hello)
                return 0;
        Kvc__Hello h = KVC__HELLO__INIT;
        h.token.data = p->token;
        h.token.len = sizeof(p->token);
        h.client_name = "rawpeer";
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_HELLO;
        env.hello = &h;
        r = rawpeer_call(p, &env, &in);
        if (r < 0)
                return r;
        return in->body_case == KVC__ENVELOPE__BODY_WELCOME ? 0 : -EPROTO;
}

void rawpeer_close(struct rawpeer *p) {
        if (p->zsock)
                zmq_close(p->zsock);
        if (p->zctx)
                zmq_ctx_term(p->zctx);
        if (p->fd > 0)
                close(p->fd);
        wire_arena_free(p->arena);
        memset(p, 0, sizeof(*p));
}

int rawpeer_send_bytes(struct rawpeer *p, const void *data, size_t len) {
        return zmq_send(p->zsock, data, len, 0) < 0 ? -zmq_errno() : 0;
}

int rawpeer_send(struct rawpeer *p, Kvc__Envelope *env) {
        env->version = WIRE_VERSION;
        env->request_id = ++p->next_id;
        size_t n = wire_packed_size(env);
        uint8_t *buf = malloc(n ? n : 1);
        if (!buf)
                return -ENOMEM;
        wire_pack(env, buf);
        int r = rawpeer_send_bytes(p, buf, n);
        free(buf);
        return r;
}

int rawpeer_recv(struct rawpeer *p, int timeout_ms, Kvc__Envelope **ret) {
        zmq_pollitem_t it = { .socket = p->zsock, .events = ZMQ_POLLIN };
        if (zmq_poll(&it, 1, timeout_ms) <= 0)
                return -ETIMEDOUT;
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, p->zsock, 0) < 0) {
                zmq_msg_close(&msg);
                return -EIO;
        }
        char why[WIRE_MAX_MESSAGE];
        int r = wire_decode(p->arena, zmq_msg_data(&msg), zmq_msg_size(&msg), WIRE_REPLY_MAX_BYTES, ret, why,
                            sizeof(why));
        zmq_msg_close(&msg);
        return r;
}

int rawpeer_call(struct rawpeer *p, Kvc__Envelope *env, Kvc__Envelope **ret) {
        int r = rawpeer_send(p, env);
        return r < 0 ? r : rawpeer_recv(p, 10000, ret);
}

int rawpeer_open_session(struct rawpeer *p, const char *policy, uint32_t budget, uint64_t *ret_id) {
        Kvc__Geometry g = KVC__GEOMETRY__INIT;
        g.n_layers = 5;
        g.n_heads = 8;
        g.n_kv_heads = 4;
        g.head_dim = 8;
        g.dtype = KVC__DTYPE__DTYPE_F32;
        g.max_tokens = 512;
        Kvc__OpenSession os = KVC__OPEN_SESSION__INIT;
        os.geometry = &g;
        os.policy = (char *)policy;
        os.budget_tokens = budget;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_OPEN_SESSION;
        env.open_session = &os;
        int r = rawpeer_call(p, &env, &in);
        if (r < 0)
                return r;
        if (in->body_case == KVC__ENVELOPE__BODY_ERROR)
                return -in->error->code;
        if (in->body_case != KVC__ENVELOPE__BODY_SESSION_OPENED)
                return -EPROTO;
        *ret_id = in->session_opened->session_id;
        return 0;
}

int rawadmin_open(struct rawadmin *a, const char *dir) {
        char ep[300];
        int zero = 0;
        memset(a, 0, sizeof(*a));
        if (wire_arena_new(WIRE_REPLY_MAX_BYTES, &a->arena) < 0)
                return -ENOMEM;
        snprintf(ep, sizeof(ep), "ipc://%s/kvcd.admin.sock", dir);
        a->ctx = zmq_ctx_new();
        a->sock = a->ctx ? zmq_socket(a->ctx, ZMQ_DEALER) : NULL;
        if (!a->sock || zmq_setsockopt(a->sock, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
            zmq_connect(a->sock, ep) < 0)
                return -ECONNREFUSED;
        return 0;
}

void rawadmin_close(struct rawadmin *a) {
        if (a->sock)
                zmq_close(a->sock);
        if (a->ctx)
                zmq_ctx_term(a->ctx);
        wire_arena_free(a->arena);
        memset(a, 0, sizeof(*a));
}

int rawadmin_status(struct rawadmin *a, int timeout_ms, const Kvc__Status **ret) {
        Kvc__StatusRequest sr = KVC__STATUS_REQUEST__INIT;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.version = WIRE_VERSION;
        env.request_id = ++a->next_id;
        env.body_case = KVC__ENVELOPE__BODY_STATUS_REQUEST;
        env.status_request = &sr;
        uint8_t buf[64];
        size_t n = wire_packed_size(&env);
        wire_pack(&env, buf);
        if (zmq_send(a->sock, buf, n, 0) < 0)
                return -EIO;
        for (;;) {
                zmq_pollitem_t it = { .socket = a->sock, .events = ZMQ_POLLIN };
                if (zmq_poll(&it, 1, timeout_ms) <= 0)
                        return -ETIMEDOUT;
                zmq_msg_t msg;
                zmq_msg_init(&msg);
                if (zmq_msg_recv(&msg, a->sock, 0) < 0) {
                        zmq_msg_close(&msg);
                        return -EIO;
                }
                char why[WIRE_MAX_MESSAGE];
                int r = wire_decode(a->arena, zmq_msg_data(&msg), zmq_msg_size(&msg), WIRE_REPLY_MAX_BYTES,
                                    &in, why, sizeof(why));
                zmq_msg_close(&msg);
                if (r < 0)
                        return r;
                if (in->request_id != env.request_id)
                        continue;
                if (in->body_case != KVC__ENVELOPE__BODY_STATUS)
                        return -EPROTO;
                *ret = in->status;
                return 0;
        }
}
