/* cpu_pool: a small fork-join thread pool for the CPU kernels.
 *
 * Why not OpenMP: an OpenMP region ends in a barrier that every team thread must reach, so when the
 * machine is oversubscribed (services and builds sharing two cores) one descheduled thread stalls the
 * whole region for a scheduler time slice; decode runs ~300 regions per token and collapsed from ~40 to
 * under 1 token/s that way. Here tasks are claimed dynamically (an atomic counter) and the caller only
 * waits for tasks that were actually claimed: a worker that is not running simply claims nothing.
 * Idle workers spin briefly (yielding) and then sleep on a futex.
 *
 * cb_pool_run is called by one thread at a time (the pool's owner); tasks must not call it.
 */
#ifndef CB_CPU_POOL_H
#define CB_CPU_POOL_H

typedef struct cb_pool cb_pool_t;

/* task in [0, n_tasks); thread in [0, cb_pool_size) (0 = the caller), for per-thread scratch. */
typedef void (*cb_pool_fn)(void *ctx, int task, int thread);

/* n_threads in total, the caller included (n_threads - 1 workers). NULL on failure. */
cb_pool_t *cb_pool_new(int n_threads);
void cb_pool_destroy(cb_pool_t **self_p);
int cb_pool_size(const cb_pool_t *self);   /* 1 for a NULL pool */
/* Runs fn(ctx, t, thread) for every t in [0, n_tasks) and returns when all are done. A NULL pool, one
 * thread or one task run inline on the caller. */
void cb_pool_run(cb_pool_t *self, int n_tasks, cb_pool_fn fn, void *ctx);
#endif
