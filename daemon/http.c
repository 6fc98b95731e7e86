/* http.c: GET /metrics over libmicrohttpd, single-threaded in kvcd's loop (see http.h).
 *
 * libmicrohttpd runs without threads on its own epoll fd, which kvcd polls with its other
 * sockets; MHD_run() is called every loop round, and the loop's poll timeout is bounded by
 * MHD_get_timeout() (http_timeout_ms), so that idle connections are timed out although they never
 * make the epoll fd readable. Without that, HTTP_MAX_CONNECTIONS idle TCP connections would hold
 * every slot for good: libmicrohttpd stops listening at its connection limit, and nothing would
 * ever call it again to close them.
 *
 * Every limit a peer could otherwise grow: connections in all (HTTP_MAX_CONNECTIONS) and per
 * address (HTTP_MAX_PER_IP), how long one may idle (HTTP_TIMEOUT_SEC), the bytes of its request
 * line and headers (HTTP_MEMORY_LIMIT for libmicrohttpd's buffer; within it, a URL above
 * HTTP_MAX_URL gets 414 and headers above HTTP_MAX_HEADER_BYTES get 431, as libmicrohttpd itself
 * answers what does not fit its buffer), no request body. Rejected: a thread of its own for MHD
 * (rendering would then need locks around kvcd's state).
 *
 * Slow peers (issue 28, item 8): libmicrohttpd's timeout is an idle timeout, so a peer that sends
 * a byte every 2 s kept its connection, and HTTP_MAX_PER_IP of them (every local peer is
 * 127.0.0.1) held the endpoint from every local scraper. kvcd keeps its own table of connections
 * (MHD_OPTION_NOTIFY_CONNECTION): a connection must send a whole request within
 * HTTP_REQUEST_DEADLINE_USEC of connecting or of its last answer, or it is shut down, and a new
 * connection from an address that has HTTP_MAX_PER_IP connections waiting for a request shuts
 * down the oldest of them instead of being refused: a scraper that asks at once always gets in.
 */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "clock.h"
#include "kvcd.h"
#include "log.h"
#include "metrics.h"

/* The connections libmicrohttpd holds, by slot: the socket, the peer's address, and since when
 * it owes a whole request (0: it is being answered). */
static struct http_conn {
        struct MHD_Connection *conn; /* NULL: a free slot */
        int fd;
        struct sockaddr_storage addr;
        uint64_t since_usec;
} conns[HTTP_MAX_CONNECTIONS + 1];

static bool same_address(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
        if (a->ss_family != b->ss_family)
                return false;
        if (a->ss_family == AF_INET)
                return ((const struct sockaddr_in *)a)->sin_addr.s_addr ==
                       ((const struct sockaddr_in *)b)->sin_addr.s_addr;
        return a->ss_family == AF_INET6 && memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                                                  &((const struct sockaddr_in6 *)b)->sin6_addr,
                                                  sizeof(struct in6_addr)) == 0;
}

/* libmicrohttpd sees the hang-up on its next run and closes the connection. */
static void shut(struct http_conn *c) {
        shutdown(c->fd, SHUT_RDWR);
        c->since_usec = 0; /* counted as waiting no more */
}

static void notify_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                              enum MHD_ConnectionNotificationCode code) {
        (void)cls;
        if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
                struct http_conn *c = *socket_context;
                if (c)
                        c->conn = NULL;
                return;
        }
        const union MHD_ConnectionInfo *fd = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD),
                                       *ad = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        struct http_conn *c = NULL, *oldest = NULL;
        unsigned waiting = 0;
        for (size_t i = 0; i < sizeof(conns) / sizeof(conns[0]); i++)
                if (!conns[i].conn && !c)
                        c = &conns[i];
        if (!c || !fd || !ad || !ad->client_addr)
                return; /* not tracked: libmicrohttpd's own limits still hold */
        *c = (struct http_conn){ .conn = conn, .fd = fd->connect_fd, .since_usec = now_usec() };
        memcpy(&c->addr, ad->client_addr,
               ad->client_addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in));
        *socket_context = c;
        for (size_t i = 0; i < sizeof(conns) / sizeof(conns[0]); i++) {
                struct http_conn *o = &conns[i];
                if (o == c || !o->conn || !o->since_usec || !same_address(&o->addr, &c->addr))
                        continue;
                waiting++;
                if (!oldest || o->since_usec < oldest->since_usec)
                        oldest = o;
        }
        if (waiting >= HTTP_MAX_PER_IP)
                shut(oldest);
}

static struct http_conn *conn_of(struct MHD_Connection *conn) {
        for (size_t i = 0; i < sizeof(conns) / sizeof(conns[0]); i++)
                if (conns[i].conn == conn)
                        return &conns[i];
        return NULL;
}

/* A request answered: the connection owes the next one from now. */
static void request_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                              enum MHD_RequestTerminationCode code) {
        (void)cls, (void)con_cls, (void)code;
        struct http_conn *c = conn_of(conn);
        if (c)
                c->since_usec = now_usec();
}

static enum MHD_Result add_header_bytes(void *cls, enum MHD_ValueKind kind, const char *key,
                                        const char *value) {
        size_t *n = cls;
        (void)kind;
        *n += strlen(key) + (value ? strlen(value) : 0) + 4; /* ": " and CRLF */
        return MHD_YES;
}

/* A static text answer. */
static enum MHD_Result reply_text(struct MHD_Connection *conn, unsigned status, const char *text) {
        struct MHD_Response *r =
                MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_PERSISTENT);
        if (!r)
                return MHD_NO;
        MHD_add_response_header(r, "Content-Type", "text/plain; charset=utf-8");
        enum MHD_Result ret = MHD_queue_response(conn, status, r);
        MHD_destroy_response(r);
        return ret;
}

static enum MHD_Result answer(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **con_cls) {
        struct kvcd *d = cls;
        (void)version, (void)upload, (void)con_cls;
        struct http_conn *c = conn_of(conn);
        if (c)
                c->since_usec = 0; /* its request is in: no deadline while it is answered */
        if (*upload_size)
                return MHD_NO; /* a body: nothing here takes one */
        size_t header_bytes = 0;
        MHD_get_connection_values(conn, MHD_HEADER_KIND, add_header_bytes, &header_bytes);
        if (strlen(url) > HTTP_MAX_URL)
                return reply_text(conn, MHD_HTTP_URI_TOO_LONG, "URL too long\n");
        if (header_bytes > HTTP_MAX_HEADER_BYTES)
                return reply_text(conn, MHD_HTTP_REQUEST_HEADER_FIELDS_TOO_LARGE, "headers too large\n");
        if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
                return reply_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET\n");
        if (strcmp(url, "/metrics") != 0)
                return reply_text(conn, MHD_HTTP_NOT_FOUND, "kvcd serves /metrics\n");
        char *body = malloc(METRICS_MAX_BYTES);
        if (!body)
                return reply_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory\n");
        int n = metrics_render(d, body, METRICS_MAX_BYTES);
        if (n < 0) {
                free(body);
                return reply_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "metrics too large\n");
        }
        struct MHD_Response *r = MHD_create_response_from_buffer((size_t)n, body, MHD_RESPMEM_MUST_FREE);
        if (!r) {
                free(body);
                return MHD_NO;
        }
        MHD_add_response_header(r, "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
        enum MHD_Result ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        return ret;
}

int http_parse_address(const char *text, struct sockaddr_storage *ret, socklen_t *ret_len) {
        struct sockaddr_in v4 = { .sin_family = AF_INET };
        struct sockaddr_in6 v6 = { .sin6_family = AF_INET6 };
        if (inet_pton(AF_INET, text, &v4.sin_addr) == 1) {
                memset(ret, 0, sizeof(*ret));
                memcpy(ret, &v4, sizeof(v4));
                *ret_len = sizeof(v4);
                return 0;
        }
        if (inet_pton(AF_INET6, text, &v6.sin6_addr) == 1) {
                memset(ret, 0, sizeof(*ret));
                memcpy(ret, &v6, sizeof(v6));
                *ret_len = sizeof(v6);
                return 0;
        }
        return -EINVAL;
}

int http_start(struct kvcd *d) {
        struct sockaddr_storage sa;
        socklen_t len;
        const char *addr = d->cfg.metrics_address ? d->cfg.metrics_address : HTTP_DEFAULT_ADDRESS;
        uint16_t port = d->cfg.metrics_port;
        if (http_parse_address(addr, &sa, &len) < 0)
                return -EINVAL;
        bool v6 = sa.ss_family == AF_INET6;
        if (v6)
                ((struct sockaddr_in6 *)&sa)->sin6_port = htons(port);
        else
                ((struct sockaddr_in *)&sa)->sin_port = htons(port);
        d->http = MHD_start_daemon(
                MHD_USE_EPOLL | MHD_USE_ERROR_LOG | (v6 ? MHD_USE_IPv6 : 0), port, NULL, NULL, answer, d,
                MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa, MHD_OPTION_CONNECTION_LIMIT,
                (unsigned)HTTP_MAX_CONNECTIONS, MHD_OPTION_NOTIFY_CONNECTION, notify_connection, NULL,
                MHD_OPTION_NOTIFY_COMPLETED, request_completed, NULL, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_TIMEOUT_SEC, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
                (size_t)HTTP_MEMORY_LIMIT, MHD_OPTION_END);
        if (!d->http)
                return -EADDRNOTAVAIL;
        log_notice(v6 ? "metrics on http://[%s]:%u/metrics" : "metrics on http://%s:%u/metrics", addr, port);
        return 0;
}

int http_fd(const struct kvcd *d) {
        if (!d->http)
                return -1;
        const union MHD_DaemonInfo *i = MHD_get_daemon_info(d->http, MHD_DAEMON_INFO_EPOLL_FD);
        return i ? i->epoll_fd : -1;
}

/* The first deadline of a connection that owes a request, or UINT64_MAX. */
static uint64_t next_deadline(void) {
        uint64_t due = UINT64_MAX;
        for (size_t i = 0; i < sizeof(conns) / sizeof(conns[0]); i++)
                if (conns[i].conn && conns[i].since_usec && conns[i].since_usec + HTTP_REQUEST_DEADLINE_USEC < due)
                        due = conns[i].since_usec + HTTP_REQUEST_DEADLINE_USEC;
        return due;
}

long http_timeout_ms(const struct kvcd *d) {
        MHD_UNSIGNED_LONG_LONG ms;
        if (!d->http)
                return -1;
        long t = MHD_get_timeout(d->http, &ms) == MHD_YES ? (ms > 3600000 ? 3600000 : (long)ms) : -1;
        uint64_t due = next_deadline(), now = now_usec();
        if (due != UINT64_MAX) {
                long left = due <= now ? 0 : (long)((due - now) / 1000) + 1;
                if (t < 0 || left < t)
                        t = left;
        }
        return t;
}

void http_run(struct kvcd *d) {
        if (!d->http)
                return;
        uint64_t now = now_usec();
        for (size_t i = 0; i < sizeof(conns) / sizeof(conns[0]); i++)
                if (conns[i].conn && conns[i].since_usec && now >= conns[i].since_usec + HTTP_REQUEST_DEADLINE_USEC)
                        shut(&conns[i]);
        MHD_run(d->http);
}

void http_stop(struct kvcd *d) {
        if (d->http)
                MHD_stop_daemon(d->http);
        d->http = NULL;
}
