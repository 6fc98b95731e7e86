/* http.h: the optional Prometheus endpoint (GET /metrics on --metrics-address:--metrics-port),
 * served by libmicrohttpd inside kvcd's own loop: MHD runs without threads on an epoll fd that
 * kvcd polls with everything else, so rendering reads kvcd's state without locks. */
#pragma once

#include <stdint.h>
#include <sys/socket.h>

struct kvcd;

#define HTTP_DEFAULT_ADDRESS  "127.0.0.1"
#define HTTP_MAX_CONNECTIONS  64u
#define HTTP_MAX_PER_IP       8u
#define HTTP_TIMEOUT_SEC      5u           /* an idle connection is closed after this */
/* a whole request must come within this of connecting (or of the last answer), trickled or not */
#define HTTP_REQUEST_DEADLINE_USEC 2000000u
#define HTTP_MEMORY_LIMIT     (16u * 1024) /* per connection: request line and headers */
#define HTTP_MAX_URL          1024u        /* longer: 414 */
#define HTTP_MAX_HEADER_BYTES (8u * 1024)  /* more: 431 */

/* A numeric IPv4 or IPv6 address (no name lookup), port 0. -EINVAL when text is neither. */
int http_parse_address(const char *text, struct sockaddr_storage *ret, socklen_t *ret_len);
/* Listens on d->cfg.metrics_address (default HTTP_DEFAULT_ADDRESS) and d->cfg.metrics_port;
 * -EADDRNOTAVAIL when it cannot (in use, no such local address). */
int http_start(struct kvcd *d);
/* The fd to poll for readiness, -1 when not serving. */
int http_fd(const struct kvcd *d);
/* The longest the loop may wait before http_run() must run again (idle connections time out),
 * in milliseconds; -1: no limit. */
long http_timeout_ms(const struct kvcd *d);
/* Serves what is ready and closes what timed out; call every loop round (it does not block). */
void http_run(struct kvcd *d);
void http_stop(struct kvcd *d);
