/* gguf.c: bounds-checked, read-only GGUF v2/v3 reader (see gguf.h).
 *
 * The whole header (metadata and tensor infos) is parsed and validated at open; afterwards every
 * accessor is a lookup into tables built here. Nothing is allocated before the count that drives the
 * allocation has been bounded by the bytes that remain in the file, so a hostile file can make us
 * allocate at most a small multiple of its own size. Failures return NULL with a message saying what
 * is wrong and where; nothing asserts on file content.
 *
 * Owns: the mapping (cb_gguf_open) or nothing of the caller's buffer (cb_gguf_open_mem); the kv table,
 * the string-array offset tables, the key copies and the tensor table with its name copies.
 */
#include "format/gguf.h"
#include "base/alloc.h"
#include "base/err.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf.c reads little-endian files by memcpy and assumes a little-endian host"
#endif

#define GGUF_MAX_STRING_LEN  ((uint64_t)1 << 30)  /* 1 GiB, ggml's GGUF_MAX_STRING_LENGTH */
#define GGUF_MAX_ARRAY_ELEMS ((uint64_t)1 << 30)  /* ggml's GGUF_MAX_ARRAY_ELEMENTS */
#define GGUF_MAX_KEY_LEN     65535u               /* docs/gguf.md: keys are at most 2^16-1 bytes */
#define GGUF_MAX_NAME        64u                  /* GGML_MAX_NAME: tensor names are shorter */
#define GGUF_MAX_ALIGNMENT   ((uint64_t)1 << 30)
#define GGUF_DEFAULT_ALIGN   32u
/* Smallest encodings, used to bound counts by the bytes remaining. */
#define KV_MIN_BYTES     13u  /* key length u64 + value type u32 + a 1-byte value */
#define TENSOR_MIN_BYTES 32u  /* name length u64 + n_dims u32 + one ne u64 + type u32 + offset u64 */

typedef struct {
    const char *key;         /* NUL-terminated copy in self->keys */
    size_t key_len;
    uint32_t type;           /* cb_gguf_vtype_t */
    uint32_t elem_type;      /* arrays only */
    uint64_t count;          /* arrays: elements; strings: byte length */
    const uint8_t *data;     /* scalar value, string bytes, or first array element (in the buffer) */
    uint64_t *str_off;       /* string arrays: [count] offsets of each element's u64 length from data */
} kv_t;

struct cb_gguf {
    const uint8_t *base;     /* the file bytes */
    size_t size;
    bool mapped;             /* base is our mmap */
    uint32_t version;
    size_t alignment;
    size_t data_start;       /* offset of the data section */
    size_t n_kv;
    kv_t *kv;                /* [n_kv] in file order */
    const kv_t **kv_sorted;  /* [n_kv] sorted by key, for lookup */
    char *keys;              /* key copies, each NUL-terminated */
    size_t n_tensors;
    cb_gguf_tensor_t *tensors;              /* [n_tensors] in file order */
    const cb_gguf_tensor_t **tensor_sorted; /* [n_tensors] sorted by name */
    char (*names)[GGUF_MAX_NAME];           /* [n_tensors] name copies */
    uint64_t *offsets;                      /* [n_tensors] offsets in the data section */
};

/* ---------------------------------------------------------------- type traits */

typedef struct { const char *name; uint32_t blck; uint32_t bytes; } type_info_t;

/* Names of every ggml type id (for messages); blck/bytes only for the types we support. */
static const type_info_t TYPES[] = {
    [0] = {"F32", 1, 4},     [1] = {"F16", 1, 2},      [2] = {"Q4_0", 32, 18}, [3] = {"Q4_1", 32, 20},
    [4] = {"Q4_2(removed)", 0, 0}, [5] = {"Q4_3(removed)", 0, 0},
    [6] = {"Q5_0", 32, 22},  [7] = {"Q5_1", 0, 0},     [8] = {"Q8_0", 32, 34}, [9] = {"Q8_1", 0, 0},
    [10] = {"Q2_K", 0, 0},   [11] = {"Q3_K", 0, 0},    [12] = {"Q4_K", 256, 144},
    [13] = {"Q5_K", 256, 176}, [14] = {"Q6_K", 256, 210}, [15] = {"Q8_K", 0, 0},
    [16] = {"IQ2_XXS", 0, 0}, [17] = {"IQ2_XS", 0, 0}, [18] = {"IQ3_XXS", 0, 0}, [19] = {"IQ1_S", 0, 0},
    [20] = {"IQ4_NL", 0, 0}, [21] = {"IQ3_S", 0, 0},   [22] = {"IQ2_S", 0, 0}, [23] = {"IQ4_XS", 0, 0},
    [24] = {"I8", 0, 0},     [25] = {"I16", 0, 0},     [26] = {"I32", 0, 0},   [27] = {"I64", 0, 0},
    [28] = {"F64", 0, 0},    [29] = {"IQ1_M", 0, 0},   [30] = {"BF16", 1, 2},
    [34] = {"TQ1_0", 0, 0},  [35] = {"TQ2_0", 0, 0},   [39] = {"MXFP4", 0, 0},
};
#define N_TYPES (sizeof TYPES / sizeof TYPES[0])

size_t cb_type_block_elems(uint32_t type) { return type < N_TYPES ? TYPES[type].blck : 0; }
size_t cb_type_block_bytes(uint32_t type) { return type < N_TYPES ? TYPES[type].bytes : 0; }
const char *cb_type_name(uint32_t type) {
    return type < N_TYPES && TYPES[type].name ? TYPES[type].name : "unknown";
}

static const char *vtype_name(uint32_t t) {
    static const char *const names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool",
                                        "string", "array", "u64", "i64", "f64"};
    return t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}
const char *cb_gguf_vtype_name(uint32_t type) { return vtype_name(type); }

/* Size of a fixed-size value type; 0 for string, array and unknown types. */
static size_t vtype_size(uint32_t t) {
    switch (t) {
    case CB_GGUF_U8: case CB_GGUF_I8: case CB_GGUF_BOOL: return 1;
    case CB_GGUF_U16: case CB_GGUF_I16: return 2;
    case CB_GGUF_U32: case CB_GGUF_I32: case CB_GGUF_F32: return 4;
    case CB_GGUF_U64: case CB_GGUF_I64: case CB_GGUF_F64: return 8;
    default: return 0;
    }
}

/* ---------------------------------------------------------------- cursor over the buffer */

typedef struct {
    const uint8_t *buf;
    size_t size, pos;
    char *err;
    size_t errlen;
    bool failed;
} rd_t;

static void fail(rd_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(rd_t *r, const char *fmt, ...) {
    if (r->failed) return;  /* keep the first, most specific message */
    r->failed = true;
    if (r->err && r->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->err, r->errlen, fmt, ap);
        va_end(ap);
    }
}

static size_t left(const rd_t *r) { return r->size - r->pos; }

/* Reads n bytes into out; `what` names the field for the truncation message. */
static bool rd_bytes(rd_t *r, void *out, size_t n, const char *what) {
    if (left(r) < n) {
        fail(r, "gguf: truncated at offset %zu reading %s (%zu bytes needed, %zu left)", r->pos, what, n,
             left(r));
        return false;
    }
    memcpy(out, r->buf + r->pos, n);
    r->pos += n;
    return true;
}
static bool rd_u32(rd_t *r, uint32_t *v, const char *what) { return rd_bytes(r, v, 4, what); }
static bool rd_u64(rd_t *r, uint64_t *v, const char *what) { return rd_bytes(r, v, 8, what); }

/* A GGUF string: u64 length + bytes. Returns a pointer into the buffer. */
static bool rd_str(rd_t *r, const uint8_t **s, uint64_t *len, uint64_t cap, const char *what) {
    size_t at = r->pos;
    if (!rd_u64(r, len, what)) return false;
    if (*len > cap) {
        fail(r, "gguf: %s at offset %zu: length %llu exceeds the limit %llu", what, at,
             (unsigned long long)*len, (unsigned long long)cap);
        return false;
    }
    if (*len > left(r)) {
        fail(r, "gguf: %s at offset %zu: length %llu beyond end of file (%zu bytes left)", what, at,
             (unsigned long long)*len, left(r));
        return false;
    }
    *s = r->buf + r->pos;
    r->pos += (size_t)*len;
    return true;
}

/* ---------------------------------------------------------------- metadata parsing */

/* Parses one value of type t (not an array) at the cursor; for a string, *count gets its length. */
static bool parse_scalar(rd_t *r, uint32_t t, const uint8_t **data, uint64_t *count, const char *ctx) {
    if (t == CB_GGUF_STRING) return rd_str(r, data, count, GGUF_MAX_STRING_LEN, ctx);
    size_t n = vtype_size(t);
    if (n == 0) {
        fail(r, "gguf: %s: unknown value type %u", ctx, t);
        return false;
    }
    if (left(r) < n) {
        fail(r, "gguf: %s: truncated at offset %zu (%zu-byte %s value, %zu bytes left)", ctx, r->pos, n,
             vtype_name(t), left(r));
        return false;
    }
    *data = r->buf + r->pos;
    *count = 1;
    if (t == CB_GGUF_BOOL && **data > 1) {
        fail(r, "gguf: %s: bool value %u at offset %zu is not 0 or 1", ctx, **data, r->pos);
        return false;
    }
    r->pos += n;
    return true;
}

static bool parse_array(rd_t *r, kv_t *kv, const char *ctx) {
    uint32_t et;
    uint64_t count;
    if (!rd_u32(r, &et, "array element type") || !rd_u64(r, &count, "array count")) return false;
    if (et == CB_GGUF_ARRAY) {
        fail(r, "gguf: %s: nested arrays are not supported", ctx);
        return false;
    }
    if (et != CB_GGUF_STRING && vtype_size(et) == 0) {
        fail(r, "gguf: %s: unknown array element type %u", ctx, et);
        return false;
    }
    if (count > GGUF_MAX_ARRAY_ELEMS) {
        fail(r, "gguf: %s: array count %llu exceeds the limit %llu", ctx, (unsigned long long)count,
             (unsigned long long)GGUF_MAX_ARRAY_ELEMS);
        return false;
    }
    size_t min_elem = et == CB_GGUF_STRING ? 8 : vtype_size(et);
    if (count > left(r) / min_elem) {
        fail(r, "gguf: %s: array of %llu %s elements at offset %zu beyond end of file (%zu bytes left)", ctx,
             (unsigned long long)count, vtype_name(et), r->pos, left(r));
        return false;
    }
    kv->elem_type = et;
    kv->count = count;
    kv->data = r->buf + r->pos;
    if (et != CB_GGUF_STRING) {
        if (et == CB_GGUF_BOOL) {
            for (uint64_t i = 0; i < count; i++)
                if (kv->data[i] > 1) {
                    fail(r, "gguf: %s: bool element %llu is %u, not 0 or 1", ctx, (unsigned long long)i,
                         kv->data[i]);
                    return false;
                }
        }
        r->pos += (size_t)(count * min_elem);
        return true;
    }
    /* String array: count <= bytes left / 8, so this table is at most the file's size. */
    if (count > 0) {
        kv->str_off = cb_malloc((size_t)count * sizeof *kv->str_off);
        if (!kv->str_off) {
            fail(r, "gguf: %s: out of memory for %llu string offsets", ctx, (unsigned long long)count);
            return false;
        }
    }
    for (uint64_t i = 0; i < count; i++) {
        kv->str_off[i] = r->pos - (size_t)(kv->data - r->buf);
        const uint8_t *s;
        uint64_t len;
        if (!rd_str(r, &s, &len, GGUF_MAX_STRING_LEN, "array string")) {
            char prev[256];
            snprintf(prev, sizeof prev, "%s", r->err && r->errlen ? r->err : "");
            r->failed = false;
            fail(r, "%s (%s, element %llu)", prev, ctx, (unsigned long long)i);
            return false;
        }
    }
    return true;
}

static int cmp_kv(const void *a, const void *b) {
    const kv_t *x = *(const kv_t *const *)a, *y = *(const kv_t *const *)b;
    size_t n = x->key_len < y->key_len ? x->key_len : y->key_len;
    int c = memcmp(x->key, y->key, n);
    if (c) return c;
    return x->key_len < y->key_len ? -1 : x->key_len > y->key_len;
}

static int cmp_tensor(const void *a, const void *b) {
    const cb_gguf_tensor_t *x = *(const cb_gguf_tensor_t *const *)a, *y = *(const cb_gguf_tensor_t *const *)b;
    return strcmp(x->name, y->name);
}

static const kv_t *find_kv(const cb_gguf_t *self, const char *key) {
    if (!self || !key) return NULL;
    size_t n = strlen(key), lo = 0, hi = self->n_kv;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const kv_t *kv = self->kv_sorted[mid];
        size_t m = kv->key_len < n ? kv->key_len : n;
        int c = memcmp(kv->key, key, m);
        if (!c) c = kv->key_len < n ? -1 : kv->key_len > n;
        if (!c) return kv;
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

/* ---------------------------------------------------------------- open */

static bool parse(cb_gguf_t *self, rd_t *r) {
    uint8_t magic[4];
    if (!rd_bytes(r, magic, 4, "magic")) return false;
    if (memcmp(magic, "GGUF", 4) != 0) {
        fail(r, "gguf: bad magic %02x %02x %02x %02x (not a GGUF file)", magic[0], magic[1], magic[2], magic[3]);
        return false;
    }
    if (!rd_u32(r, &self->version, "version")) return false;
    if ((self->version & 0xFFFFu) == 0) {
        fail(r, "gguf: version field 0x%08x: big-endian or corrupt file (only little-endian is supported)",
             self->version);
        return false;
    }
    if (self->version == 1) {
        fail(r, "gguf: version 1 (32-bit counts) is not supported; convert the file to v3");
        return false;
    }
    if (self->version < 2 || self->version > 3) {
        fail(r, "gguf: unsupported version %u (expected 2 or 3)", self->version);
        return false;
    }
    uint64_t n_tensors, n_kv;
    if (!rd_u64(r, &n_tensors, "tensor count") || !rd_u64(r, &n_kv, "metadata kv count")) return false;
    if (n_tensors > left(r) / TENSOR_MIN_BYTES) {
        fail(r, "gguf: tensor count %llu is impossible: %zu bytes left hold at most %zu tensor infos",
             (unsigned long long)n_tensors, left(r), left(r) / TENSOR_MIN_BYTES);
        return false;
    }
    if (n_kv > left(r) / KV_MIN_BYTES) {
        fail(r, "gguf: metadata kv count %llu is impossible: %zu bytes left hold at most %zu pairs",
             (unsigned long long)n_kv, left(r), left(r) / KV_MIN_BYTES);
        return false;
    }
    if (n_kv * KV_MIN_BYTES + n_tensors * TENSOR_MIN_BYTES > left(r)) {
        fail(r, "gguf: %llu kv pairs and %llu tensor infos cannot fit in the %zu bytes left",
             (unsigned long long)n_kv, (unsigned long long)n_tensors, left(r));
        return false;
    }

    /* ---- metadata */
    self->n_kv = (size_t)n_kv;
    if (n_kv) {
        self->kv = cb_calloc(self->n_kv, sizeof *self->kv);
        self->kv_sorted = cb_malloc(self->n_kv * sizeof *self->kv_sorted);
        if (!self->kv || !self->kv_sorted) {
            fail(r, "gguf: out of memory for %zu kv pairs", self->n_kv);
            return false;
        }
    }
    size_t keys_bytes = 0;
    for (size_t i = 0; i < self->n_kv; i++) {
        kv_t *kv = &self->kv[i];
        char ctx[160];
        snprintf(ctx, sizeof ctx, "kv %zu key", i);
        const uint8_t *k;
        uint64_t klen;
        if (!rd_str(r, &k, &klen, GGUF_MAX_KEY_LEN, ctx)) return false;
        if (memchr(k, 0, (size_t)klen)) {
            fail(r, "gguf: kv %zu: key contains a NUL byte", i);
            return false;
        }
        kv->key = (const char *)k; /* into the buffer until copied below */
        kv->key_len = (size_t)klen;
        keys_bytes += kv->key_len + 1;
        snprintf(ctx, sizeof ctx, "kv %zu '%.*s'", i, (int)(klen < 80 ? klen : 80), (const char *)k);
        if (!rd_u32(r, &kv->type, "value type")) return false;
        if (kv->type == CB_GGUF_ARRAY) {
            if (!parse_array(r, kv, ctx)) return false;
        } else if (!parse_scalar(r, kv->type, &kv->data, &kv->count, ctx)) {
            return false;
        }
    }
    /* Key copies: total bounded by the metadata bytes already read. */
    if (self->n_kv) {
        self->keys = cb_malloc(keys_bytes);
        if (!self->keys) {
            fail(r, "gguf: out of memory for keys");
            return false;
        }
        char *p = self->keys;
        for (size_t i = 0; i < self->n_kv; i++) {
            memcpy(p, self->kv[i].key, self->kv[i].key_len);
            p[self->kv[i].key_len] = '\0';
            self->kv[i].key = p;
            p += self->kv[i].key_len + 1;
            self->kv_sorted[i] = &self->kv[i];
        }
        qsort(self->kv_sorted, self->n_kv, sizeof *self->kv_sorted, cmp_kv);
        for (size_t i = 1; i < self->n_kv; i++)
            if (cmp_kv(&self->kv_sorted[i - 1], &self->kv_sorted[i]) == 0) {
                fail(r, "gguf: duplicate key '%.*s' (kv %zu and kv %zu)", (int)(self->kv_sorted[i]->key_len < 80 ? self->kv_sorted[i]->key_len : 80),
                     self->kv_sorted[i]->key, (size_t)(self->kv_sorted[i - 1] - self->kv),
                     (size_t)(self->kv_sorted[i] - self->kv));
                return false;
            }
    }

    /* ---- alignment */
    self->alignment = GGUF_DEFAULT_ALIGN;
    const kv_t *al = find_kv(self, "general.alignment");
    if (al) {
        int64_t a;
        if (!cb_gguf_get_i64(self, "general.alignment", &a) || a <= 0 || (uint64_t)a > GGUF_MAX_ALIGNMENT ||
            (a & (a - 1)) != 0) {
            fail(r, "gguf: general.alignment (type %s) must be a power of two integer in [1, 2^30]",
                 vtype_name(al->type));
            return false;
        }
        self->alignment = (size_t)a;
    }

    /* ---- tensor infos */
    self->n_tensors = (size_t)n_tensors;
    if (n_tensors) {
        self->tensors = cb_calloc(self->n_tensors, sizeof *self->tensors);
        self->tensor_sorted = cb_malloc(self->n_tensors * sizeof *self->tensor_sorted);
        self->names = cb_malloc(self->n_tensors * sizeof *self->names);
        if (!self->tensors || !self->tensor_sorted || !self->names) {
            fail(r, "gguf: out of memory for %zu tensor infos", self->n_tensors);
            return false;
        }
    }
    uint64_t *offsets = NULL;
    if (n_tensors) {
        offsets = self->offsets = cb_malloc(self->n_tensors * sizeof *offsets);
        if (!offsets) {
            fail(r, "gguf: out of memory for %zu tensor offsets", self->n_tensors);
            return false;
        }
    }
    bool ok = true;
    for (size_t i = 0; ok && i < self->n_tensors; i++) {
        cb_gguf_tensor_t *t = &self->tensors[i];
        char ctx[64];
        snprintf(ctx, sizeof ctx, "tensor %zu name", i);
        const uint8_t *nm;
        uint64_t nlen;
        if (!rd_str(r, &nm, &nlen, GGUF_MAX_NAME - 1, ctx)) { ok = false; break; }
        if (memchr(nm, 0, (size_t)nlen)) {
            fail(r, "gguf: tensor %zu: name contains a NUL byte", i);
            ok = false;
            break;
        }
        memcpy(self->names[i], nm, (size_t)nlen);
        self->names[i][nlen] = '\0';
        t->name = self->names[i];
        uint32_t n_dims, type;
        if (!rd_u32(r, &n_dims, "tensor n_dims")) { ok = false; break; }
        if (n_dims < 1 || n_dims > 4) {
            fail(r, "gguf: tensor %zu '%s': n_dims %u not in 1..4", i, t->name, n_dims);
            ok = false;
            break;
        }
        t->n_dims = n_dims;
        for (int d = 0; d < 4; d++) t->ne[d] = 1;
        for (uint32_t d = 0; ok && d < n_dims; d++) {
            uint64_t ne;
            if (!rd_u64(r, &ne, "tensor dimension")) { ok = false; break; }
            if (ne > (uint64_t)INT64_MAX) {
                fail(r, "gguf: tensor %zu '%s': dimension %u is negative (%lld)", i, t->name, d, (long long)ne);
                ok = false;
                break;
            }
            t->ne[d] = (int64_t)ne;
        }
        if (!ok) break;
        if (!rd_u32(r, &type, "tensor type") || !rd_u64(r, &offsets[i], "tensor offset")) { ok = false; break; }
        size_t blck = cb_type_block_elems(type), tbytes = cb_type_block_bytes(type);
        if (blck == 0) {
            fail(r, "gguf: tensor %zu '%s': unsupported tensor type id %u (%s)", i, t->name, type, cb_type_name(type));
            ok = false;
            break;
        }
        t->type = (cb_type_t)type;
        /* Element count and byte size, overflow-checked. */
        uint64_t nel = 1;
        for (int d = 0; d < 4; d++) {
            uint64_t ne = (uint64_t)t->ne[d];
            if (ne != 0 && nel > (uint64_t)INT64_MAX / ne) {
                fail(r, "gguf: tensor %zu '%s': element count overflows int64", i, t->name);
                ok = false;
                break;
            }
            nel *= ne;
        }
        if (!ok) break;
        if ((uint64_t)t->ne[0] % blck != 0) {
            fail(r, "gguf: tensor %zu '%s': ne[0] = %lld is not a multiple of the %s block size %zu", i, t->name,
                 (long long)t->ne[0], cb_type_name(type), blck);
            ok = false;
            break;
        }
        /* nbytes = nel / blck * tbytes; nel / blck <= INT64_MAX / 1 and tbytes <= 210. */
        uint64_t blocks = nel / blck;
        if (blocks > (uint64_t)SIZE_MAX / tbytes || blocks > (uint64_t)INT64_MAX / tbytes) {
            fail(r, "gguf: tensor %zu '%s': byte size overflows", i, t->name);
            ok = false;
            break;
        }
        t->nbytes = (size_t)(blocks * tbytes);
        if (offsets[i] % self->alignment != 0) {
            fail(r, "gguf: tensor %zu '%s': offset %llu is not a multiple of the alignment %zu", i, t->name,
                 (unsigned long long)offsets[i], self->alignment);
            ok = false;
            break;
        }
        self->tensor_sorted[i] = t;
    }
    if (ok && self->n_tensors) {
        qsort(self->tensor_sorted, self->n_tensors, sizeof *self->tensor_sorted, cmp_tensor);
        for (size_t i = 1; i < self->n_tensors; i++)
            if (strcmp(self->tensor_sorted[i - 1]->name, self->tensor_sorted[i]->name) == 0) {
                fail(r, "gguf: duplicate tensor name '%s' (tensors %zu and %zu)", self->tensor_sorted[i]->name,
                     (size_t)(self->tensor_sorted[i - 1] - self->tensors), (size_t)(self->tensor_sorted[i] - self->tensors));
                ok = false;
                break;
            }
    }

    /* ---- data section: starts at the next multiple of the alignment; every tensor in bounds. */
    if (ok) {
        size_t pad = (self->alignment - r->pos % self->alignment) % self->alignment;
        self->data_start = r->pos + pad;
        if (self->n_tensors && self->data_start > r->size) {
            fail(r, "gguf: data section would start at %zu, beyond end of file (size %zu)", self->data_start, r->size);
            ok = false;
        }
    }
    for (size_t i = 0; ok && i < self->n_tensors; i++) {
        cb_gguf_tensor_t *t = &self->tensors[i];
        size_t avail = r->size - self->data_start;
        if (offsets[i] > avail || t->nbytes > avail - offsets[i]) {
            fail(r, "gguf: tensor %zu '%s': data [%llu, %llu) beyond end of file (size %zu, data section at %zu)", i,
                 t->name, (unsigned long long)offsets[i], (unsigned long long)offsets[i] + t->nbytes, r->size,
                 self->data_start);
            ok = false;
            break;
        }
        t->data = r->buf + self->data_start + offsets[i];
    }
    return ok;
}

static cb_gguf_t *open_buf(const uint8_t *buf, size_t len, bool mapped, char *err, size_t errlen) {
    cb_gguf_t *self = cb_calloc(1, sizeof *self);
    if (!self) {
        cb_set_err(err, errlen, "gguf: out of memory");
        if (mapped) munmap((void *)buf, len);
        return NULL;
    }
    self->base = buf;
    self->size = len;
    self->mapped = mapped;
    rd_t r = {.buf = buf, .size = len, .pos = 0, .err = err, .errlen = errlen, .failed = false};
    if (!buf && len) {
        fail(&r, "gguf: NULL buffer");
        cb_gguf_destroy(&self);
        return NULL;
    }
    if (!parse(self, &r)) {
        cb_gguf_destroy(&self);
        return NULL;
    }
    if (err && errlen) err[0] = '\0';
    return self;
}

cb_gguf_t *cb_gguf_open_mem(const void *buf, size_t len, char *err, size_t errlen) {
    return open_buf(buf, len, false, err, errlen);
}

cb_gguf_t *cb_gguf_open(const char *path, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        cb_set_err(err, errlen, "gguf: cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        cb_set_err(err, errlen, "gguf: %s is not a regular file", path);
        close(fd);
        return NULL;
    }
    if (st.st_size < 24) {
        cb_set_err(err, errlen, "gguf: %s: file too small for a GGUF header (%lld bytes)", path,
                   (long long)st.st_size);
        close(fd);
        return NULL;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        cb_set_err(err, errlen, "gguf: %s: file too large to map", path);
        close(fd);
        return NULL;
    }
    size_t size = (size_t)st.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) {
        cb_set_err(err, errlen, "gguf: cannot mmap %s: %s", path, strerror(e));
        return NULL;
    }
    char local[512];
    cb_gguf_t *self = open_buf(map, size, true, local, sizeof local);
    if (!self) cb_set_err(err, errlen, "%s: %s", path, local);
    return self;
}

void cb_gguf_destroy(cb_gguf_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_gguf_t *self = *self_p;
    if (self->kv)
        for (size_t i = 0; i < self->n_kv; i++) free(self->kv[i].str_off);
    free(self->kv);
    free(self->kv_sorted);
    free(self->keys);
    free(self->tensors);
    free(self->tensor_sorted);
    free(self->names);
    free(self->offsets);
    if (self->mapped) munmap((void *)self->base, self->size);
    free(self);
    *self_p = NULL;
}

/* ---------------------------------------------------------------- accessors */

uint32_t cb_gguf_version(const cb_gguf_t *self) { return self ? self->version : 0; }
size_t cb_gguf_alignment(const cb_gguf_t *self) { return self ? self->alignment : 0; }
size_t cb_gguf_data_offset(const cb_gguf_t *self) { return self ? self->data_start : 0; }
size_t cb_gguf_file_size(const cb_gguf_t *self) { return self ? self->size : 0; }

size_t cb_gguf_n_kv(const cb_gguf_t *self) { return self ? self->n_kv : 0; }

bool cb_gguf_kv_info(const cb_gguf_t *self, size_t i, const char **key, cb_gguf_vtype_t *type) {
    if (!self || i >= self->n_kv) return false;
    if (key) *key = self->kv[i].key;
    if (type) *type = (cb_gguf_vtype_t)self->kv[i].type;
    return true;
}

bool cb_gguf_has(const cb_gguf_t *self, const char *key) { return find_kv(self, key) != NULL; }

/* Reads an integer-typed value as a sign flag plus magnitude. */
static bool kv_int(const kv_t *kv, bool *neg, uint64_t *mag) {
    if (!kv) return false;
    const uint8_t *p = kv->data;
    int64_t s;
    switch (kv->type) {
    case CB_GGUF_U8: *neg = false; *mag = p[0]; return true;
    case CB_GGUF_U16: { uint16_t v; memcpy(&v, p, 2); *neg = false; *mag = v; return true; }
    case CB_GGUF_U32: { uint32_t v; memcpy(&v, p, 4); *neg = false; *mag = v; return true; }
    case CB_GGUF_U64: { uint64_t v; memcpy(&v, p, 8); *neg = false; *mag = v; return true; }
    case CB_GGUF_I8: { int8_t v; memcpy(&v, p, 1); s = v; break; }
    case CB_GGUF_I16: { int16_t v; memcpy(&v, p, 2); s = v; break; }
    case CB_GGUF_I32: { int32_t v; memcpy(&v, p, 4); s = v; break; }
    case CB_GGUF_I64: { int64_t v; memcpy(&v, p, 8); s = v; break; }
    default: return false;
    }
    *neg = s < 0;
    *mag = s < 0 ? (uint64_t)0 - (uint64_t)s : (uint64_t)s;
    return true;
}

bool cb_gguf_get_u32(const cb_gguf_t *self, const char *key, uint32_t *out) {
    bool neg;
    uint64_t mag;
    if (!kv_int(find_kv(self, key), &neg, &mag) || (neg && mag) || mag > UINT32_MAX) return false;
    if (out) *out = (uint32_t)mag;
    return true;
}

bool cb_gguf_get_i64(const cb_gguf_t *self, const char *key, int64_t *out) {
    bool neg;
    uint64_t mag;
    if (!kv_int(find_kv(self, key), &neg, &mag)) return false;
    if (!neg && mag > (uint64_t)INT64_MAX) return false;
    if (out) *out = neg ? (mag == (uint64_t)1 << 63 ? INT64_MIN : -(int64_t)mag) : (int64_t)mag;
    return true;
}

bool cb_gguf_get_f32(const cb_gguf_t *self, const char *key, float *out) {
    const kv_t *kv = find_kv(self, key);
    if (!kv) return false;
    if (kv->type == CB_GGUF_F32) {
        float v;
        memcpy(&v, kv->data, 4);
        if (out) *out = v;
        return true;
    }
    if (kv->type == CB_GGUF_F64) {
        double v;
        memcpy(&v, kv->data, 8);
        if (out) *out = (float)v;
        return true;
    }
    return false;
}

bool cb_gguf_get_bool(const cb_gguf_t *self, const char *key, bool *out) {
    const kv_t *kv = find_kv(self, key);
    if (!kv || kv->type != CB_GGUF_BOOL) return false;
    if (out) *out = kv->data[0] != 0;
    return true;
}

bool cb_gguf_get_str(const cb_gguf_t *self, const char *key, const char **s, size_t *len) {
    const kv_t *kv = find_kv(self, key);
    if (!kv || kv->type != CB_GGUF_STRING) return false;
    if (s) *s = (const char *)kv->data;
    if (len) *len = (size_t)kv->count;
    return true;
}

bool cb_gguf_get_arr(const cb_gguf_t *self, const char *key, cb_gguf_vtype_t *elem_type, size_t *count) {
    const kv_t *kv = find_kv(self, key);
    if (!kv || kv->type != CB_GGUF_ARRAY) return false;
    if (elem_type) *elem_type = (cb_gguf_vtype_t)kv->elem_type;
    if (count) *count = (size_t)kv->count;
    return true;
}

bool cb_gguf_arr_str(const cb_gguf_t *self, const char *key, size_t i, const char **s, size_t *len) {
    const kv_t *kv = find_kv(self, key);
    if (!kv || kv->type != CB_GGUF_ARRAY || kv->elem_type != CB_GGUF_STRING || i >= kv->count) return false;
    const uint8_t *p = kv->data + kv->str_off[i];
    uint64_t n;
    memcpy(&n, p, 8);
    if (s) *s = (const char *)p + 8;
    if (len) *len = (size_t)n;
    return true;
}

const void *cb_gguf_arr_data(const cb_gguf_t *self, const char *key) {
    const kv_t *kv = find_kv(self, key);
    if (!kv || kv->type != CB_GGUF_ARRAY || kv->elem_type == CB_GGUF_STRING) return NULL;
    return kv->data;
}

size_t cb_gguf_n_tensors(const cb_gguf_t *self) { return self ? self->n_tensors : 0; }

const cb_gguf_tensor_t *cb_gguf_tensor(const cb_gguf_t *self, size_t i) {
    return self && i < self->n_tensors ? &self->tensors[i] : NULL;
}

size_t cb_gguf_tensor_offset(const cb_gguf_t *self, size_t i) {
    return self && i < self->n_tensors ? (size_t)self->offsets[i] : 0;
}

const cb_gguf_tensor_t *cb_gguf_find_tensor(const cb_gguf_t *self, const char *name) {
    if (!self || !name || !self->n_tensors) return NULL;
    cb_gguf_tensor_t key = {.name = name};
    const cb_gguf_tensor_t *kp = &key;
    const cb_gguf_tensor_t **hit =
        bsearch(&kp, self->tensor_sorted, self->n_tensors, sizeof *self->tensor_sorted, cmp_tensor);
    return hit ? *hit : NULL;
}
