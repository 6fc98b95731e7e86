/* http.c: GET /metrics over libmicrohttpd, single-threaded in kvcd's loop (see http.h). */
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

#define HTTP_METRICS_CAP (256 * 1024)

static enum MHD_Result answer(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **con_cls) {
        struct kvcd *d = cls;
        (void)version, (void)upload, (void)con_cls;
        if (*upload_size)
                return MHD_NO;
        int status = MHD_HTTP_OK;
        char *body = malloc(HTTP_METRICS_CAP);
        if (!body)
                return MHD_NO;
        int n;
        if (strcmp(method, "GET") != 0) {
                status = MHD_HTTP_METHOD_NOT_ALLOWED;
                n = (int)strlen(strcpy(body, "only GET\n"));
        } else if (strcmp(url, "/metrics") != 0) {
                status = MHD_HTTP_NOT_FOUND;
                n = (int)strlen(strcpy(body, "kvcd serves /metrics\n"));
        } else if ((n = metrics_render(d, body, HTTP_METRICS_CAP)) < 0) {
                status = MHD_HTTP_INTERNAL_SERVER_ERROR;
                n = (int)strlen(strcpy(body, "metrics too large\n"));
        }
        struct MHD_Response *r = MHD_create_response_from_buffer((size_t)n, body, MHD_RESPMEM_MUST_FREE);
        if (!r) {
                free(body);
                return MHD_NO;
        }
        MHD_add_response_header(r, "Content-Type", "text/plain; version=0.0.4");
        enum MHD_Result ret = MHD_queue_response(conn, (unsigned)status, r);
        MHD_destroy_response(r);
        return ret;
}

int http_start(struct kvcd *d, uint16_t port) {
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port) };
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        d->http = MHD_start_daemon(MHD_USE_EPOLL | MHD_USE_ERROR_LOG, port, NULL, NULL, answer, d,
                                   MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa, MHD_OPTION_CONNECTION_LIMIT,
                                   16u, MHD_OPTION_CONNECTION_TIMEOUT, 10u, MHD_OPTION_END);
        if (!d->http)
                return -EADDRINUSE;
        log_notice("metrics on http://127.0.0.1:%u/metrics", port);
        return 0;
}

int http_fd(const struct kvcd *d) {
        if (!d->http)
                return -1;
        const union MHD_DaemonInfo *i = MHD_get_daemon_info(d->http, MHD_DAEMON_INFO_EPOLL_FD);
        return i ? i->epoll_fd : -1;
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
