/* alloc: the allocator seam's fault-build bodies (alloc.h); the release build inlines libc instead. */
#include "base/alloc.h"

#ifdef CB_FAULT_INJECT
#include "base/fault.h"

void *cb_malloc(size_t size) { return cb_fault_point(CB_FAULT_ALLOC) ? NULL : malloc(size); }
void *cb_calloc(size_t n, size_t size) { return cb_fault_point(CB_FAULT_ALLOC) ? NULL : calloc(n, size); }
void *cb_realloc(void *p, size_t size) { return cb_fault_point(CB_FAULT_ALLOC) ? NULL : realloc(p, size); }
char *cb_strdup(const char *s) { return cb_fault_point(CB_FAULT_ALLOC) ? NULL : strdup(s); }
char *cb_strndup(const char *s, size_t n) { return cb_fault_point(CB_FAULT_ALLOC) ? NULL : strndup(s, n); }
void *cb_aligned_alloc(size_t align, size_t size) {
    return cb_fault_point(CB_FAULT_ALLOC) ? NULL : aligned_alloc(align, size);
}
#else
typedef int cb_alloc_release_build_t; /* nothing to compile: alloc.h inlines libc */
#endif
