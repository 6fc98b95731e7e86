/* threads.h - a fixed pool of worker threads for the engine's matrix products.
 *
 * threads_run(pool, fn, ctx) calls fn(ctx, i, n) once for every i < n, where n is the pool's size,
 * the caller's thread taking i = 0, and returns when all have returned. A product splits its
 * output rows into n contiguous ranges by i; every output element is computed by one call in one
 * fixed order, so results do not depend on the number of threads (house rule: a fixed reduction
 * order).
 *
 * Workers spin briefly on a generation counter before they sleep, since a decode step dispatches
 * a few hundred short products back to back. Not reentrant: one threads_run at a time per pool.
 */
#ifndef KVC_ENGINE_THREADS_H
#define KVC_ENGINE_THREADS_H

#include <stdint.h>

#define THREADS_MAX 256

struct threads;

typedef void (*threads_fn)(void *ctx, uint32_t idx, uint32_t n);

/* n threads in all (the caller counts as one): n - 1 workers are started. -EINVAL for n outside
 * 1..THREADS_MAX, -errno when a thread cannot be started. */
int threads_new(uint32_t n, struct threads **ret);
struct threads *threads_free(struct threads *t);
uint32_t threads_count(const struct threads *t);
void threads_run(struct threads *t, threads_fn fn, void *ctx);
/* The number of CPUs this process may run on (sched_getaffinity), at least 1. */
uint32_t threads_default(void);

#endif
