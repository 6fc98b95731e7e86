/* threads.c - the worker pool of threads.h.
 *
 * One job at a time: threads_run publishes (fn, ctx) and bumps `generation`; each worker, seeing a
 * new generation, runs its index and counts itself done in `pending`; the caller runs index 0,
 * then waits for `pending` to reach zero. Workers spin for a short while on the generation (a
 * product follows another within microseconds during a step), then sleep on a condition variable.
 * The caller spins on `pending` the same way.
 *
 * Rejected alternatives: OpenMP (a second runtime in the build and its own spinning policy, which
 * misbehaves on a shared 2-core machine); a thread per product (tens of microseconds each).
 */
#define _GNU_SOURCE
#include "threads.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#define THREADS_SPIN 20000

struct worker {
        struct threads *pool;
        pthread_t tid;
        uint32_t idx;
};

struct threads {
        uint32_t n;
        struct worker *workers;
        pthread_mutex_t lock;
        pthread_cond_t wake, done;
        _Atomic uint64_t generation;
        _Atomic uint32_t pending;
        _Atomic bool stop;
        threads_fn fn;
        void *ctx;
};

static void *worker_main(void *arg) {
        struct worker *w = arg;
        struct threads *t = w->pool;
        uint64_t seen = 0;
        for (;;) {
                uint64_t g;
                int spins = 0;
                while ((g = atomic_load_explicit(&t->generation, memory_order_acquire)) == seen &&
                       !atomic_load(&t->stop) && spins < THREADS_SPIN)
                        spins++;
                if (g == seen && !atomic_load(&t->stop)) {
                        pthread_mutex_lock(&t->lock);
                        while ((g = atomic_load(&t->generation)) == seen && !atomic_load(&t->stop))
                                pthread_cond_wait(&t->wake, &t->lock);
                        pthread_mutex_unlock(&t->lock);
                }
                if (atomic_load(&t->stop))
                        return NULL;
                seen = g;
                t->fn(t->ctx, w->idx, t->n);
                if (atomic_fetch_sub_explicit(&t->pending, 1, memory_order_acq_rel) == 1) {
                        pthread_mutex_lock(&t->lock);
                        pthread_cond_signal(&t->done);
                        pthread_mutex_unlock(&t->lock);
                }
        }
}

uint32_t threads_default(void) {
        cpu_set_t set;
        if (sched_getaffinity(0, sizeof(set), &set) == 0) {
                int n = CPU_COUNT(&set);
                if (n > 0)
                        return n > THREADS_MAX ? THREADS_MAX : (uint32_t)n;
        }
        return 1;
}

int threads_new(uint32_t n, struct threads **ret) {
        if (n < 1 || n > THREADS_MAX)
                return -EINVAL;
        struct threads *t = calloc(1, sizeof(*t));
        if (!t)
                return -ENOMEM;
        t->n = n;
        pthread_mutex_init(&t->lock, NULL);
        pthread_cond_init(&t->wake, NULL);
        pthread_cond_init(&t->done, NULL);
        t->workers = calloc(n, sizeof(*t->workers));
        if (!t->workers) {
                threads_free(t);
                return -ENOMEM;
        }
        for (uint32_t i = 1; i < n; i++) {
                t->workers[i] = (struct worker){ .pool = t, .idx = i };
                int e = pthread_create(&t->workers[i].tid, NULL, worker_main, &t->workers[i]);
                if (e) {
                        t->n = i; /* those started are joined */
                        threads_free(t);
                        return -e;
                }
        }
        *ret = t;
        return 0;
}

struct threads *threads_free(struct threads *t) {
        if (!t)
                return NULL;
        pthread_mutex_lock(&t->lock);
        atomic_store(&t->stop, true);
        pthread_cond_broadcast(&t->wake);
        pthread_mutex_unlock(&t->lock);
        for (uint32_t i = 1; t->workers && i < t->n; i++)
                pthread_join(t->workers[i].tid, NULL);
        pthread_cond_destroy(&t->wake);
        pthread_cond_destroy(&t->done);
        pthread_mutex_destroy(&t->lock);
        free(t->workers);
        free(t);
        return NULL;
}

uint32_t threads_count(const struct threads *t) {
        return t ? t->n : 1;
}

void threads_run(struct threads *t, threads_fn fn, void *ctx) {
        if (!t || t->n == 1) {
                fn(ctx, 0, 1);
                return;
        }
        t->fn = fn;
        t->ctx = ctx;
        atomic_store(&t->pending, t->n - 1);
        pthread_mutex_lock(&t->lock);
        atomic_fetch_add_explicit(&t->generation, 1, memory_order_release);
        pthread_cond_broadcast(&t->wake);
        pthread_mutex_unlock(&t->lock);
        fn(ctx, 0, t->n);
        int spins = 0;
        while (atomic_load_explicit(&t->pending, memory_order_acquire) && spins < THREADS_SPIN)
                spins++;
        if (atomic_load(&t->pending)) {
                pthread_mutex_lock(&t->lock);
                while (atomic_load(&t->pending))
                        pthread_cond_wait(&t->done, &t->lock);
                pthread_mutex_unlock(&t->lock);
        }
}
