/* gguf: a bounds-checked, read-only GGUF v2/v3 reader over an mmapped file (or a caller's buffer).
 *
 * Every length in the file is checked against the bytes that remain before anything is allocated;
 * a truncated or corrupt file makes cb_gguf_open return NULL with a message in err naming the
 * problem. Nothing here asserts on file content. Strings returned point into the mapping (not
 * NUL-terminated: always use the returned length); they live until cb_gguf_destroy.
 */
#ifndef CB_GGUF_H
#define CB_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct cb_gguf cb_gguf_t;

/* Metadata value types, as stored in the file. */
typedef enum {
    CB_GGUF_U8 = 0, CB_GGUF_I8 = 1, CB_GGUF_U16 = 2, CB_GGUF_I16 = 3, CB_GGUF_U32 = 4, CB_GGUF_I32 = 5,
    CB_GGUF_F32 = 6, CB_GGUF_BOOL = 7, CB_GGUF_STRING = 8, CB_GGUF_ARRAY = 9, CB_GGUF_U64 = 10,
    CB_GGUF_I64 = 11, CB_GGUF_F64 = 12
} cb_gguf_vtype_t;

/* ggml tensor type ids (the subset of enum ggml_type we know; others are rejected at open). */
typedef enum {
    CB_TYPE_F32 = 0, CB_TYPE_F16 = 1, CB_TYPE_Q4_0 = 2, CB_TYPE_Q4_1 = 3, CB_TYPE_Q5_0 = 6, CB_TYPE_Q8_0 = 8,
    CB_TYPE_Q4_K = 12, CB_TYPE_Q5_K = 13, CB_TYPE_Q6_K = 14, CB_TYPE_BF16 = 30
} cb_type_t;

typedef struct {
    const char *name;     /* NUL-terminated copy owned by the reader */
    uint32_t n_dims;      /* 1..4 */
    int64_t ne[4];        /* ne[0] = row length (fastest varying); unused dims are 1 */
    cb_type_t type;
    const void *data;     /* points into the mapping; nbytes bytes, bounds-checked at open */
    size_t nbytes;
} cb_gguf_tensor_t;

/* Opens and validates path. Returns NULL on failure with a message in err (errlen bytes). */
cb_gguf_t *cb_gguf_open(const char *path, char *err, size_t errlen);
/* Same over a caller's buffer, which must outlive the reader (tests, fuzzing). */
cb_gguf_t *cb_gguf_open_mem(const void *buf, size_t len, char *err, size_t errlen);
void cb_gguf_destroy(cb_gguf_t **self_p);

uint32_t cb_gguf_version(const cb_gguf_t *self);
size_t cb_gguf_alignment(const cb_gguf_t *self);

/* Metadata. Each getter returns false when the key is absent or has an incompatible type or range. */
bool cb_gguf_has(const cb_gguf_t *self, const char *key);
bool cb_gguf_get_u32(const cb_gguf_t *self, const char *key, uint32_t *out); /* any integer type in range */
bool cb_gguf_get_i64(const cb_gguf_t *self, const char *key, int64_t *out);  /* any integer type in range */
bool cb_gguf_get_f32(const cb_gguf_t *self, const char *key, float *out);    /* F32 or F64 */
bool cb_gguf_get_bool(const cb_gguf_t *self, const char *key, bool *out);
bool cb_gguf_get_str(const cb_gguf_t *self, const char *key, const char **s, size_t *len);
/* Arrays: element type and count; then element access. */
bool cb_gguf_get_arr(const cb_gguf_t *self, const char *key, cb_gguf_vtype_t *elem_type, size_t *count);
bool cb_gguf_arr_str(const cb_gguf_t *self, const char *key, size_t i, const char **s, size_t *len);
/* Raw little-endian element bytes of a numeric (or bool) array (count * element size bytes); NULL for a
 * string array or a non-array. Not necessarily aligned: memcpy elements out. */
const void *cb_gguf_arr_data(const cb_gguf_t *self, const char *key);

/* Iteration over metadata in file order (i < cb_gguf_n_kv). key is a NUL-terminated copy owned by the
 * reader (keys never contain NUL). Returns false when i is out of range. */
size_t cb_gguf_n_kv(const cb_gguf_t *self);
bool cb_gguf_kv_info(const cb_gguf_t *self, size_t i, const char **key, cb_gguf_vtype_t *type);
const char *cb_gguf_vtype_name(uint32_t type); /* "u32", "string", ...; "unknown" otherwise */
/* Offset of the data section in the file, and the file's size. */
size_t cb_gguf_data_offset(const cb_gguf_t *self);
size_t cb_gguf_file_size(const cb_gguf_t *self);

/* Tensors. */
size_t cb_gguf_n_tensors(const cb_gguf_t *self);
const cb_gguf_tensor_t *cb_gguf_tensor(const cb_gguf_t *self, size_t i);
const cb_gguf_tensor_t *cb_gguf_find_tensor(const cb_gguf_t *self, const char *name); /* NULL if absent */
/* Offset of tensor i's data from the start of the data section (as stored in the file). */
size_t cb_gguf_tensor_offset(const cb_gguf_t *self, size_t i);

/* Type traits: elements per block and bytes per block; 0 for a type this project does not support
 * (only the cb_type_t ids). cb_type_name never returns NULL: ggml's name for any ggml id, "unknown"
 * otherwise. */
size_t cb_type_block_elems(uint32_t type);
size_t cb_type_block_bytes(uint32_t type);
const char *cb_type_name(uint32_t type);
#endif
