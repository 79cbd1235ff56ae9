/* cpu_pool.c: fork-join pool with dynamic task claiming (see cpu_pool.h).
 *
 * Protocol. A job is published in slot[gen & 1] (fn, ctx, n, done = 0), then `claim` is set to
 * gen << 32 (the high half names the job, the low half is the next task index). A thread claims task
 * i by CAS claim (gen, i) -> (gen, i + 1), which can only succeed while job gen is current; the slot
 * of job gen is not rewritten before job gen + 2, which needs job gen finished, so a claimed task
 * always runs with its own job's fn/ctx. The caller runs tasks too and then waits for done == n.
 * Workers spin (pause, sched_yield) for a short while after a job, then sleep on the futex word
 * `wake` (Dekker-style with `sleepers`, all seq_cst, so no wake-up is lost).
 */
#include "cpu/cpu_pool.h"
#include "base/alloc.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define SPIN_NS 200000 /* a worker spins this long after its last job before sleeping */

typedef struct {
    _Atomic(cb_pool_fn) fn;       /* atomics (relaxed) only so that a stale worker's read of a slot */
    _Atomic(void *) ctx;          /* being rewritten is not a data race; see the protocol above */
    atomic_int n;
    atomic_int done;
} job_t;

typedef struct {
    cb_pool_t *pool;
    int index;
    pthread_t tid;
} worker_t;

struct cb_pool {
    int n_threads;
    _Atomic uint64_t claim;       /* gen << 32 | next task */
    atomic_uint wake;             /* futex word: low 32 bits of the current gen */
    atomic_int sleepers;
    atomic_bool stop;
    uint32_t gen;                 /* owner's last published job */
    job_t slot[2];
    worker_t *workers;            /* [n_threads - 1] */
};

static long futex(atomic_uint *addr, int op, unsigned val) {
    return syscall(SYS_futex, (unsigned *)addr, op, val, NULL, NULL, 0);
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claims and runs tasks of job gen until none are left. */
static void run_tasks(cb_pool_t *p, uint32_t gen, int thread) {
    job_t *j = &p->slot[gen & 1];
    cb_pool_fn fn = atomic_load_explicit(&j->fn, memory_order_relaxed);
    void *ctx = atomic_load_explicit(&j->ctx, memory_order_relaxed);
    uint32_t n = (uint32_t)atomic_load_explicit(&j->n, memory_order_relaxed);
    uint64_t c = atomic_load_explicit(&p->claim, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(c >> 32) != gen || (uint32_t)c >= n) return;
        if (atomic_compare_exchange_weak_explicit(&p->claim, &c, c + 1, memory_order_acq_rel, memory_order_acquire)) {
            fn(ctx, (int)(uint32_t)c, thread);
            atomic_fetch_add_explicit(&j->done, 1, memory_order_release);
            c = atomic_load_explicit(&p->claim, memory_order_acquire);
        }
    }
}

static void *worker_main(void *arg) {
    worker_t *w = arg;
    cb_pool_t *p = w->pool;
    uint32_t seen = (uint32_t)(atomic_load(&p->claim) >> 32);
    for (;;) {
        uint32_t g = (uint32_t)(atomic_load_explicit(&p->claim, memory_order_acquire) >> 32);
        if (g != seen) {
            seen = g;
            run_tasks(p, g, w->index);
            continue;
        }
        if (atomic_load(&p->stop)) break;
        /* spin a little, yielding so an oversubscribed core can run whoever has work */
        int64_t t0 = now_ns();
        bool changed = false;
        for (int i = 0; !changed; i++) {
            CPU_RELAX();
            changed = (uint32_t)(atomic_load_explicit(&p->claim, memory_order_acquire) >> 32) != seen ||
                      atomic_load_explicit(&p->stop, memory_order_relaxed);
            if ((i & 63) == 63) {
                if (now_ns() - t0 > SPIN_NS) break;
                sched_yield();
            }
        }
        if (changed) continue;
        atomic_fetch_add(&p->sleepers, 1);
        if (atomic_load(&p->wake) == seen && !atomic_load(&p->stop)) futex(&p->wake, FUTEX_WAIT_PRIVATE, seen);
        atomic_fetch_sub(&p->sleepers, 1);
    }
    return NULL;
}

cb_pool_t *cb_pool_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    cb_pool_t *p = cb_calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_threads = n_threads;
    atomic_init(&p->claim, 0);
    atomic_init(&p->wake, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->stop, false);
    for (int i = 0; i < 2; i++) {
        atomic_init(&p->slot[i].fn, NULL);
        atomic_init(&p->slot[i].ctx, NULL);
        atomic_init(&p->slot[i].n, 0);
        atomic_init(&p->slot[i].done, 0);
    }
    if (n_threads > 1) {
        p->workers = cb_calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (!p->workers) {
            free(p);
            return NULL;
        }
        for (int i = 0; i < n_threads - 1; i++) {
            p->workers[i] = (worker_t){.pool = p, .index = i + 1};
            if (pthread_create(&p->workers[i].tid, NULL, worker_main, &p->workers[i]) != 0) {
                p->n_threads = i + 1; /* the ones created so far */
                cb_pool_destroy(&p);
                return NULL;
            }
        }
    }
    return p;
}

void cb_pool_destroy(cb_pool_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_pool_t *p = *self_p;
    atomic_store(&p->stop, true);
    atomic_fetch_add(&p->wake, 1);
    futex(&p->wake, FUTEX_WAKE_PRIVATE, INT_MAX);
    for (int i = 0; i < p->n_threads - 1; i++) pthread_join(p->workers[i].tid, NULL);
    free(p->workers);
    free(p);
    *self_p = NULL;
}

int cb_pool_size(const cb_pool_t *self) { return self ? self->n_threads : 1; }

void cb_pool_run(cb_pool_t *p, int n_tasks, cb_pool_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    uint32_t g = p->gen + 1;
    job_t *j = &p->slot[g & 1];
    atomic_store_explicit(&j->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&j->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&j->n, n_tasks, memory_order_relaxed);
    atomic_store_explicit(&j->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->claim, (uint64_t)g << 32, memory_order_release);
    atomic_store(&p->wake, g);
    if (atomic_load(&p->sleepers) > 0) futex(&p->wake, FUTEX_WAKE_PRIVATE, INT_MAX);
    run_tasks(p, g, 0);
    for (int i = 0; atomic_load_explicit(&j->done, memory_order_acquire) < n_tasks; i++) {
        CPU_RELAX();
        if ((i & 255) == 255) sched_yield(); /* a preempted worker holds a task: let it run */
    }
    p->gen = g;
}
