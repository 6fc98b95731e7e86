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
 */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>

#include "kvcd.h"
#include "log.h"
#include "metrics.h"

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
                (unsigned)HTTP_MAX_CONNECTIONS, MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)HTTP_MAX_PER_IP,
                MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_TIMEOUT_SEC, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
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

long http_timeout_ms(const struct kvcd *d) {
        MHD_UNSIGNED_LONG_LONG ms;
        if (!d->http || MHD_get_timeout(d->http, &ms) != MHD_YES)
                return -1;
        return ms > 3600000 ? 3600000 : (long)ms;
}

void http_run(struct kvcd *d) {
        if (d->http)
                MHD_run(d->http);
}

void http_stop(struct kvcd *d) {
        if (d->http)
                MHD_stop_daemon(d->http);
        d->http = NULL;
}
