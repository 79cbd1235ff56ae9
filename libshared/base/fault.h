/* fault: the failure points of the test build (make test-faults; docs/reliability.md).
 *
 * Every allocation of libshared and the services goes through base/alloc.h and every read, write,
 * fsync and rename of the KV files and the config through base/sysio.h. In the release build those
 * seams are inline calls to libc and nothing here is ever consulted. In the fault build (compiled with
 * -DCB_FAULT_INJECT) each seam call first asks cb_fault_point(kind): the calls of each kind are
 * counted from the last cb_fault_arm, and the armed one (the Nth, 1-based) fails: an allocation
 * returns NULL, an I/O call returns -1 with errno set to the armed value (ENOSPC, EIO, ...). One call
 * fails, the ones after it succeed again (SQLite's "fail once" mode), so every failure point is tried
 * alone. The test driver can also count a library's own calls through cb_fault_point (SQLite's
 * allocator and VFS, jansson's allocator).
 *
 * Thread-safe (atomic counters); a failure point is deterministic only on a single-threaded path.
 */
#ifndef CB_FAULT_H
#define CB_FAULT_H

#include <stdbool.h>
#include <stdint.h>

typedef enum {
    CB_FAULT_ALLOC = 0, /* malloc, calloc, realloc, strdup, strndup, aligned_alloc */
    CB_FAULT_IO,        /* read, pread, write, pwrite, fsync, rename(at), and the test VFS's calls */
    CB_FAULT_KIND_COUNT_
} cb_fault_kind_t;

/* Restarts the counts of every kind; the nth call of `kind` from now fails (nth >= 1; 0 disarms), with
 * errno = err for I/O (ignored for allocations). */
void cb_fault_arm(cb_fault_kind_t kind, uint64_t nth, int err);
/* No call fails any more; the counts go on. */
void cb_fault_disarm(void);
/* Calls of `kind` since the last arm. */
uint64_t cb_fault_calls(cb_fault_kind_t kind);
/* Whether the armed call has happened (and failed) since the last arm. */
bool cb_fault_fired(void);
/* Counts one call of `kind`; true when it is the armed one, with errno set for I/O. The seams call it. */
bool cb_fault_point(cb_fault_kind_t kind);
/* Whether this build's seams consult the counters (compiled with -DCB_FAULT_INJECT). */
bool cb_fault_enabled(void);

#endif
