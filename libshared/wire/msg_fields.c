/* msg_fields.c: a decoded message's typed fields: the value checks shared by named fields and array
 * elements (type, range, length, hex, UTF-8 already proven by the pre-scan), the accessors, the views of
 * nested maps, and the conversion to JSON. A failed access leaves its reason in cb_msg_last_error. Part of
 * the wire protocol (msg_internal.h). */
#include "wire/msg_internal.h"
#include "base/alloc.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------- */
/* Field errors and value checks                                                                  */

static void seterr(const cb_msg_t *m, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void seterr(const cb_msg_t *m, const char *key, const char *fmt, ...) {
    char what[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(m->r->last_error, sizeof m->r->last_error, "field '%s%s': %s", m->path, key ? key : "", what);
    cb_msg_utf8_sanitize(m->r->last_error);
}

const char *cb_msg_last_error(const cb_msg_t *m) { return m ? m->r->last_error : "no message"; }

static bool key_eq(const msgpack_object *k, const char *key, size_t keylen) {
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == keylen &&
           memcmp(k->via.str.ptr, key, keylen) == 0;
}

/* 1: found (non-nil) in *out; 0: absent or nil; -1: duplicate key (error set). */
int cb_msg_lookup(const cb_msg_t *m, const char *key, const msgpack_object **out) {
    size_t keylen = strlen(key);
    const msgpack_object_map *mp = &m->map->via.map;
    const msgpack_object *found = NULL;
    for (uint32_t i = 0; i < mp->size; i++) {
        if (key_eq(&mp->ptr[i].key, key, keylen)) {
            if (found) {
                seterr(m, key, "duplicate key");
                return -1;
            }
            found = &mp->ptr[i].val;
        }
    }
    if (!found || found->type == MSGPACK_OBJECT_NIL) return 0;
    *out = found;
    return 1;
}

/* Required field: the object, or NULL with the error set. */
const msgpack_object *cb_msg_require(const cb_msg_t *m, const char *key) {
    const msgpack_object *o = NULL;
    int rc = cb_msg_lookup(m, key, &o);
    if (rc == 0) seterr(m, key, "missing");
    return rc == 1 ? o : NULL;
}

const char *cb_msg_type_name(const msgpack_object *o) {
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return "nil";
    case MSGPACK_OBJECT_BOOLEAN: return "boolean";
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "integer";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return "float";
    case MSGPACK_OBJECT_STR: return "string";
    case MSGPACK_OBJECT_BIN: return "binary";
    case MSGPACK_OBJECT_ARRAY: return "array";
    case MSGPACK_OBJECT_MAP: return "map";
    default: return "ext";
    }
}

/* Value checks shared by named fields and array elements; `key` is the label for errors. */
static bool chk_str(const cb_msg_t *m, const char *key, const msgpack_object *o, size_t max_len,
                    const char **s, size_t *len) {
    if (o->type != MSGPACK_OBJECT_STR) {
        seterr(m, key, "expected string, got %s", cb_msg_type_name(o));
        return false;
    }
    if (o->via.str.size > max_len) {
        seterr(m, key, "string of %u bytes is longer than the limit of %zu", o->via.str.size, max_len);
        return false;
    }
    if (o->via.str.size && memchr(o->via.str.ptr, 0, o->via.str.size)) {
        seterr(m, key, "string contains a NUL byte");
        return false;
    }
    /* UTF-8 validity was checked by the pre-scan for every string. */
    *s = o->via.str.ptr;
    if (len) *len = o->via.str.size;
    return true;
}

static bool chk_hex(const cb_msg_t *m, const char *key, const msgpack_object *o, size_t min_len,
                    size_t max_len, const char **s, size_t *len) {
    const char *p;
    size_t n;
    if (!chk_str(m, key, o, max_len, &p, &n)) return false;
    if (n < min_len) {
        seterr(m, key, "hex string of %zu characters is shorter than %zu", n, min_len);
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f'))) {
            seterr(m, key, "expected lower-case hex, found byte 0x%02x at %zu", (unsigned char)p[i], i);
            return false;
        }
    }
    *s = p;
    if (len) *len = n;
    return true;
}

bool cb_msg_chk_int(const cb_msg_t *m, const char *key, const msgpack_object *o, int64_t min,
                    int64_t max, int64_t *out) {
    int64_t v;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > (uint64_t)INT64_MAX) {
            seterr(m, key, "integer %llu out of range [%lld, %lld]", (unsigned long long)o->via.u64,
                   (long long)min, (long long)max);
            return false;
        }
        v = (int64_t)o->via.u64;
    } else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        v = o->via.i64;
    } else {
        seterr(m, key, "expected integer, got %s", cb_msg_type_name(o));
        return false;
    }
    if (v < min || v > max) {
        seterr(m, key, "integer %lld out of range [%lld, %lld]", (long long)v, (long long)min, (long long)max);
        return false;
    }
    *out = v;
    return true;
}

static bool chk_double(const cb_msg_t *m, const char *key, const msgpack_object *o, double min,
                       double max, double *out) {
    double v;
    if (o->type == MSGPACK_OBJECT_FLOAT32 || o->type == MSGPACK_OBJECT_FLOAT64) v = o->via.f64;
    else if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) v = (double)o->via.u64;
    else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) v = (double)o->via.i64;
    else {
        seterr(m, key, "expected number, got %s", cb_msg_type_name(o));
        return false;
    }
    if (!isfinite(v)) {
        seterr(m, key, "number is not finite");
        return false;
    }
    if (v < min || v > max) {
        seterr(m, key, "number %g out of range [%g, %g]", v, min, max);
        return false;
    }
    *out = v;
    return true;
}

static bool chk_bin(const cb_msg_t *m, const char *key, const msgpack_object *o, size_t max_len,
                    const void **p, size_t *len) {
    if (o->type != MSGPACK_OBJECT_BIN) {
        seterr(m, key, "expected binary, got %s", cb_msg_type_name(o));
        return false;
    }
    if (o->via.bin.size > max_len) {
        seterr(m, key, "binary of %u bytes is longer than the limit of %zu", o->via.bin.size, max_len);
        return false;
    }
    *p = o->via.bin.ptr;
    *len = o->via.bin.size;
    return true;
}

/* ---------------------------------------------------------------------------------------------- */
/* Accessors                                                                                       */

bool cb_msg_has(const cb_msg_t *m, const char *key) {
    const msgpack_object *o;
    return cb_msg_lookup(m, key, &o) == 1;
}

int cb_msg_present(const cb_msg_t *m, const char *key) {
    const msgpack_object *o;
    return cb_msg_lookup(m, key, &o);
}

bool cb_msg_str(const cb_msg_t *m, const char *key, size_t max_len, const char **s, size_t *len) {
    const msgpack_object *o = cb_msg_require(m, key);
    return o && chk_str(m, key, o, max_len, s, len);
}

bool cb_msg_str_copy(const cb_msg_t *m, const char *key, size_t max_len, char *dst, size_t dstsize) {
    const char *s;
    size_t n;
    if (!dst || dstsize == 0) return false;
    if (max_len >= dstsize) max_len = dstsize - 1;
    if (!cb_msg_str(m, key, max_len, &s, &n)) return false;
    memcpy(dst, s, n);
    dst[n] = 0;
    return true;
}

bool cb_msg_hex(const cb_msg_t *m, const char *key, size_t min_len, size_t max_len, const char **s,
                size_t *len) {
    const msgpack_object *o = cb_msg_require(m, key);
    return o && chk_hex(m, key, o, min_len, max_len, s, len);
}

bool cb_msg_int(const cb_msg_t *m, const char *key, int64_t min, int64_t max, int64_t *out) {
    const msgpack_object *o = cb_msg_require(m, key);
    return o && cb_msg_chk_int(m, key, o, min, max, out);
}

bool cb_msg_double(const cb_msg_t *m, const char *key, double min, double max, double *out) {
    const msgpack_object *o = cb_msg_require(m, key);
    return o && chk_double(m, key, o, min, max, out);
}

bool cb_msg_bool(const cb_msg_t *m, const char *key, bool *out) {
    const msgpack_object *o = cb_msg_require(m, key);
    if (!o) return false;
    if (o->type != MSGPACK_OBJECT_BOOLEAN) {
        seterr(m, key, "expected boolean, got %s", cb_msg_type_name(o));
        return false;
    }
    *out = o->via.boolean;
    return true;
}

bool cb_msg_bin(const cb_msg_t *m, const char *key, size_t max_len, const void **p, size_t *len) {
    const msgpack_object *o = cb_msg_require(m, key);
    return o && chk_bin(m, key, o, max_len, p, len);
}

bool cb_msg_int_or(const cb_msg_t *m, const char *key, int64_t min, int64_t max, int64_t def, int64_t *out) {
    const msgpack_object *o = NULL;
    int rc = cb_msg_lookup(m, key, &o);
    if (rc < 0) return false;
    if (rc == 0) { *out = def; return true; }
    return cb_msg_chk_int(m, key, o, min, max, out);
}

bool cb_msg_double_or(const cb_msg_t *m, const char *key, double min, double max, double def, double *out) {
    const msgpack_object *o = NULL;
    int rc = cb_msg_lookup(m, key, &o);
    if (rc < 0) return false;
    if (rc == 0) { *out = def; return true; }
    return chk_double(m, key, o, min, max, out);
}

bool cb_msg_bool_or(const cb_msg_t *m, const char *key, bool def, bool *out) {
    const msgpack_object *o = NULL;
    int rc = cb_msg_lookup(m, key, &o);
    if (rc < 0) return false;
    if (rc == 0) { *out = def; return true; }
    return cb_msg_bool(m, key, out);
}

bool cb_msg_str_or(const cb_msg_t *m, const char *key, size_t max_len, const char *def, const char **s,
                   size_t *len) {
    const msgpack_object *o = NULL;
    int rc = cb_msg_lookup(m, key, &o);
    if (rc < 0) return false;
    if (rc == 0) {
        *s = def;
        if (len) *len = def ? strlen(def) : 0;
        return true;
    }
    return chk_str(m, key, o, max_len, s, len);
}

/* The array under key, or NULL with the error set. */
static const msgpack_object_array *get_array(const cb_msg_t *m, const char *key) {
    const msgpack_object *o = cb_msg_require(m, key);
    if (!o) return NULL;
    if (o->type != MSGPACK_OBJECT_ARRAY) {
        seterr(m, key, "expected array, got %s", cb_msg_type_name(o));
        return NULL;
    }
    return &o->via.array;
}

/* Element i of the array under key, labelled "key[i]" for errors; NULL with the error set. */
static const msgpack_object *get_elem(const cb_msg_t *m, const char *key, size_t i, char *label, size_t lsz) {
    const msgpack_object_array *a = get_array(m, key);
    if (!a) return NULL;
    if (i >= a->size) {
        seterr(m, key, "index %zu out of range (%u elements)", i, a->size);
        return NULL;
    }
    snprintf(label, lsz, "%s[%zu]", key, i);
    return &a->ptr[i];
}

bool cb_msg_array_len(const cb_msg_t *m, const char *key, size_t max_count, size_t *n) {
    const msgpack_object_array *a = get_array(m, key);
    if (!a) return false;
    if (a->size > max_count) {
        seterr(m, key, "array of %u elements is longer than the limit of %zu", a->size, max_count);
        return false;
    }
    *n = a->size;
    return true;
}

bool cb_msg_at_str(const cb_msg_t *m, const char *key, size_t i, size_t max_len, const char **s, size_t *len) {
    char label[CB_MSG_MAX_KEY + 32];
    const msgpack_object *o = get_elem(m, key, i, label, sizeof label);
    return o && chk_str(m, label, o, max_len, s, len);
}

bool cb_msg_at_hex(const cb_msg_t *m, const char *key, size_t i, size_t min_len, size_t max_len,
                   const char **s, size_t *len) {
    char label[CB_MSG_MAX_KEY + 32];
    const msgpack_object *o = get_elem(m, key, i, label, sizeof label);
    return o && chk_hex(m, label, o, min_len, max_len, s, len);
}

bool cb_msg_at_int(const cb_msg_t *m, const char *key, size_t i, int64_t min, int64_t max, int64_t *out) {
    char label[CB_MSG_MAX_KEY + 32];
    const msgpack_object *o = get_elem(m, key, i, label, sizeof label);
    return o && cb_msg_chk_int(m, label, o, min, max, out);
}

bool cb_msg_at_bin(const cb_msg_t *m, const char *key, size_t i, size_t max_len, const void **p, size_t *len) {
    char label[CB_MSG_MAX_KEY + 32];
    const msgpack_object *o = get_elem(m, key, i, label, sizeof label);
    return o && chk_bin(m, label, o, max_len, p, len);
}

bool cb_msg_str_array(const cb_msg_t *m, const char *key, size_t max_count, size_t max_len,
                      const char **strs, size_t *lens, size_t *n) {
    size_t cnt;
    if (!cb_msg_array_len(m, key, max_count, &cnt)) return false;
    const msgpack_object_array *a = get_array(m, key);
    char label[CB_MSG_MAX_KEY + 32];
    for (size_t i = 0; i < cnt; i++) {
        snprintf(label, sizeof label, "%s[%zu]", key, i);
        if (!chk_str(m, label, &a->ptr[i], max_len, &strs[i], &lens[i])) return false;
    }
    *n = cnt;
    return true;
}

bool cb_msg_int_array(const cb_msg_t *m, const char *key, size_t max_count, int64_t min, int64_t max,
                      int64_t *out, size_t *n) {
    size_t cnt;
    if (!cb_msg_array_len(m, key, max_count, &cnt)) return false;
    const msgpack_object_array *a = get_array(m, key);
    char label[CB_MSG_MAX_KEY + 32];
    for (size_t i = 0; i < cnt; i++) {
        snprintf(label, sizeof label, "%s[%zu]", key, i);
        if (!cb_msg_chk_int(m, label, &a->ptr[i], min, max, &out[i])) return false;
    }
    *n = cnt;
    return true;
}

/* A view of the map object o, labelled "<m's path><label>." for errors; allocated in the zone. */
static const cb_msg_t *make_view(const cb_msg_t *m, const char *label, const msgpack_object *o) {
    if (o->type != MSGPACK_OBJECT_MAP) {
        seterr(m, label, "expected map, got %s", cb_msg_type_name(o));
        return NULL;
    }
    msgpack_zone *z = m->r->up.zone;
    size_t plen = strlen(m->path) + strlen(label) + 2;
    cb_msg_t *v = msgpack_zone_malloc(z, sizeof *v);
    char *path = msgpack_zone_malloc(z, plen);
    if (!v || !path) {
        seterr(m, label, "out of memory");
        return NULL;
    }
    snprintf(path, plen, "%s%s.", m->path, label);
    v->r = m->r;
    v->map = o;
    v->path = path;
    return v;
}

const cb_msg_t *cb_msg_map(const cb_msg_t *m, const char *key) {
    const msgpack_object *o = cb_msg_require(m, key);
    return o ? make_view(m, key, o) : NULL;
}

const cb_msg_t *cb_msg_at_map(const cb_msg_t *m, const char *key, size_t i) {
    char label[CB_MSG_MAX_KEY + 32];
    const msgpack_object *o = get_elem(m, key, i, label, sizeof label);
    return o ? make_view(m, label, o) : NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* JSON                                                                                            */

static char *hex_of(const void *p, size_t n) {
    static const char digits[] = "0123456789abcdef";
    char *s = cb_malloc(2 * n + 1);
    if (!s) return NULL;
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        s[2 * i] = digits[b[i] >> 4];
        s[2 * i + 1] = digits[b[i] & 15];
    }
    s[2 * n] = 0;
    return s;
}

/* Depth is bounded by the pre-scan (CB_MSG_MAX_DEPTH), so recursion is bounded. */
static json_t *obj_to_json(const msgpack_object *o) {
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return json_null();
    case MSGPACK_OBJECT_BOOLEAN: return json_boolean(o->via.boolean);
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        if (o->via.u64 > (uint64_t)INT64_MAX) return json_real((double)o->via.u64);
        return json_integer((json_int_t)o->via.u64);
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return json_integer((json_int_t)o->via.i64);
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        if (!isfinite(o->via.f64)) return json_null(); /* JSON has no NaN/inf */
        return json_real(o->via.f64);
    case MSGPACK_OBJECT_STR: return json_stringn(o->via.str.ptr, o->via.str.size);
    case MSGPACK_OBJECT_BIN: {
        char *h = hex_of(o->via.bin.ptr, o->via.bin.size);
        json_t *j = h ? json_pack("{s:s}", "$bin", h) : NULL;
        free(h);
        return j;
    }
    case MSGPACK_OBJECT_ARRAY: {
        json_t *a = json_array();
        for (uint32_t i = 0; a && i < o->via.array.size; i++) {
            json_t *e = obj_to_json(&o->via.array.ptr[i]);
            if (!e || json_array_append_new(a, e) != 0) { json_decref(a); return NULL; }
        }
        return a;
    }
    case MSGPACK_OBJECT_MAP: {
        json_t *j = json_object();
        char key[CB_MSG_MAX_KEY + 1];
        for (uint32_t i = 0; j && i < o->via.map.size; i++) {
            const msgpack_object *k = &o->via.map.ptr[i].key;
            if (k->type != MSGPACK_OBJECT_STR || k->via.str.size > CB_MSG_MAX_KEY) continue;
            memcpy(key, k->via.str.ptr, k->via.str.size);
            key[k->via.str.size] = 0;
            json_t *v = obj_to_json(&o->via.map.ptr[i].val);
            if (!v || json_object_set_new(j, key, v) != 0) { json_decref(j); return NULL; }
        }
        return j;
    }
    default: return json_null();
    }
}

json_t *cb_msg_to_json(const cb_msg_t *m) { return m ? obj_to_json(m->map) : NULL; }
