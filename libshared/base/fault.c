/* fault: failure points of the test build (fault.h). */
#include "base/fault.h"

#include <errno.h>
#include <stdatomic.h>

static atomic_uint_fast64_t g_calls[CB_FAULT_KIND_COUNT_];
static atomic_uint_fast64_t g_nth;   /* the armed call; 0 = none */
static atomic_int g_kind;            /* its kind */
static atomic_int g_err;             /* errno of an armed I/O failure */
static atomic_bool g_fired;

void cb_fault_arm(cb_fault_kind_t kind, uint64_t nth, int err) {
    atomic_store(&g_nth, 0);
    for (int k = 0; k < CB_FAULT_KIND_COUNT_; k++) atomic_store(&g_calls[k], 0);
    atomic_store(&g_fired, false);
    atomic_store(&g_kind, (int)kind);
    atomic_store(&g_err, err ? err : EIO);
    atomic_store(&g_nth, nth);
}

void cb_fault_disarm(void) { atomic_store(&g_nth, 0); }

uint64_t cb_fault_calls(cb_fault_kind_t kind) {
    return (unsigned)kind < CB_FAULT_KIND_COUNT_ ? atomic_load(&g_calls[kind]) : 0;
}

bool cb_fault_fired(void) { return atomic_load(&g_fired); }

bool cb_fault_point(cb_fault_kind_t kind) {
    if ((unsigned)kind >= CB_FAULT_KIND_COUNT_) return false;
    uint64_t n = atomic_fetch_add(&g_calls[kind], 1) + 1;
    uint64_t nth = atomic_load(&g_nth);
    if (nth == 0 || n != nth || atomic_load(&g_kind) != (int)kind) return false;
    atomic_store(&g_fired, true);
    if (kind == CB_FAULT_IO) errno = atomic_load(&g_err);
    else errno = ENOMEM;
    return true;
}

bool cb_fault_enabled(void) {
#ifdef CB_FAULT_INJECT
    return true;
#else
    return false;
#endif
}
