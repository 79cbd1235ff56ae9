/* gguf_writer.h: a tiny in-memory GGUF metadata writer for the unit tests (no tensors): a growing buffer
 * and one function per value kind. Test-only; the library's own writer is model/synth.c. */
#ifndef CB_TEST_GGUF_WRITER_H
#define CB_TEST_GGUF_WRITER_H
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "format/gguf.h"

typedef struct { unsigned char *p; size_t n, cap; } buf_t;

static inline void put(buf_t *b, const void *s, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 256;
        b->p = realloc(b->p, b->cap);
        if (!b->p) abort();
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}
static inline void put_u32(buf_t *b, uint32_t v) { put(b, &v, 4); }
static inline void put_u64(buf_t *b, uint64_t v) { put(b, &v, 8); }
static inline void put_gstr(buf_t *b, const char *s) { put_u64(b, strlen(s)); put(b, s, strlen(s)); }
static inline void kv_str(buf_t *b, const char *k, const char *v) { put_gstr(b, k); put_u32(b, CB_GGUF_STRING); put_gstr(b, v); }
static inline void kv_u32(buf_t *b, const char *k, uint32_t v) { put_gstr(b, k); put_u32(b, CB_GGUF_U32); put_u32(b, v); }
static inline void kv_bool(buf_t *b, const char *k, bool v) { uint8_t x = v; put_gstr(b, k); put_u32(b, CB_GGUF_BOOL); put(b, &x, 1); }
static inline void kv_strs(buf_t *b, const char *k, char **v, size_t n) {
    put_gstr(b, k); put_u32(b, CB_GGUF_ARRAY); put_u32(b, CB_GGUF_STRING); put_u64(b, n);
    for (size_t i = 0; i < n; i++) put_gstr(b, v[i]);
}
static inline void kv_i32s(buf_t *b, const char *k, const int32_t *v, size_t n) {
    put_gstr(b, k); put_u32(b, CB_GGUF_ARRAY); put_u32(b, CB_GGUF_I32); put_u64(b, n);
    put(b, v, 4 * n);
}
#endif
