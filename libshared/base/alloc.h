/* alloc: the one allocator seam of libshared and the services.
 *
 * Code outside this module never calls malloc, calloc, realloc, strdup, strndup or aligned_alloc
 * (scripts/check-layers enforces it); it calls the cb_ names below, which behave exactly like the libc
 * functions they name and return NULL on failure like them. Memory is released with free(). In the
 * release build they are inline calls to libc; in the fault build (-DCB_FAULT_INJECT, make test-faults)
 * each call is a failure point of base/fault.h, so a test can make the Nth allocation fail and check that
 * the caller reports a clean error and leaks nothing.
 */
#ifndef CB_ALLOC_H
#define CB_ALLOC_H

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#ifdef CB_FAULT_INJECT
void *cb_malloc(size_t size);
void *cb_calloc(size_t n, size_t size);
void *cb_realloc(void *p, size_t size);
char *cb_strdup(const char *s);
char *cb_strndup(const char *s, size_t n);
void *cb_aligned_alloc(size_t align, size_t size);
#else
static inline void *cb_malloc(size_t size) { return malloc(size); }
static inline void *cb_calloc(size_t n, size_t size) { return calloc(n, size); }
static inline void *cb_realloc(void *p, size_t size) { return realloc(p, size); }
static inline char *cb_strdup(const char *s) { return strdup(s); }
static inline char *cb_strndup(const char *s, size_t n) { return strndup(s, n); }
static inline void *cb_aligned_alloc(size_t align, size_t size) { return aligned_alloc(align, size); }
#endif

#endif
