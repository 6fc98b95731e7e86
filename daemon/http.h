/* http.h: the optional Prometheus endpoint (GET /metrics on 127.0.0.1:PORT), served by
 * libmicrohttpd inside kvcd's own loop: MHD runs without threads on an epoll fd that kvcd polls
 * with everything else, so rendering reads kvcd's state without locks. */
#pragma once

#include <stdint.h>

struct kvcd;

int http_start(struct kvcd *d, uint16_t port);
/* The fd to poll for readiness, -1 when not serving. */
int http_fd(const struct kvcd *d);
/* Serves what is ready; call when http_fd() is readable. */
void http_run(struct kvcd *d);
void http_stop(struct kvcd *d);
