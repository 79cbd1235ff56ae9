/* msg: the cacheblend wire protocol: a bounded pre-scan of the raw msgpack bytes, then msgpack-c's
 * one-shot unpacker, envelope validation, typed accessors and a writer. See msg.h for the contract
 * and docs/protocol.md for the messages.
 *
 * Why the pre-scan: msgpack-c 4.0 trusts array/map counts and allocates count x 24 bytes when it
 * reads a header (a 5-byte array32 header asks for up to 96 GiB), has a fixed 32-level stack and no
 * limits in its C API. The pre-scan below walks the encoding without allocating,
 * iteratively, with an explicit stack of CB_MSG_MAX_DEPTH frames, and proves that every count and
 * length fits in the bytes that remain. After it passes, the sum of all element counts is at most
 * the input length, so msgpack-c's allocation is bounded by the input size times a small constant.
 */
#include "wire/msg.h"
#include "base/alloc.h"
#include "base/utf8.h"

#include <ctype.h>
#include <jansson.h>
#include <math.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------- */
/* Error codes                                                                                     */

static const char *const s_err_names[CB_ERR_COUNT_] = {
    [CB_ERR_NONE] = "ok",
    [CB_ERR_BAD_REQUEST] = "bad_request",
    [CB_ERR_UNKNOWN_TYPE] = "unknown_type",
    [CB_ERR_TOO_LARGE] = "too_large",
    [CB_ERR_NOT_FOUND] = "not_found",
    [CB_ERR_UNAVAILABLE] = "unavailable",
    [CB_ERR_TIMEOUT] = "timeout",
    [CB_ERR_INTERNAL] = "internal",
    [CB_ERR_OVERLOADED] = "overloaded",
};

const char *cb_err_name(cb_err_t code) {
    if ((int)code < 0 || code >= CB_ERR_COUNT_) return "internal";
    return s_err_names[code];
}

cb_err_t cb_err_from_name(const char *name, size_t len) {
    if (!name) return CB_ERR_INTERNAL;
    for (int i = 1; i < CB_ERR_COUNT_; i++)
        if (strlen(s_err_names[i]) == len && memcmp(s_err_names[i], name, len) == 0) return (cb_err_t)i;
    return CB_ERR_INTERNAL;
}

/* ---------------------------------------------------------------------------------------------- */
/* UTF-8                                                                                           */

bool cb_msg_utf8_valid(const char *str, size_t len) { return cb_utf8_valid(str, len); }

/* Replaces every byte that does not start a valid UTF-8 sequence by '?', in place. */
static void utf8_sanitize(char *str) {
    size_t len = strlen(str);
    size_t i = 0;
    while (i < len) {
        size_t n = cb_utf8_seq_len((const unsigned char *)str + i, len - i);
        if (n) i += n;
        else str[i++] = '?';
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Pre-scan                                                                                        */

typedef struct {
    uint64_t left; /* elements still to read in this container (a map counts keys and values) */
    bool is_map;
} scan_frame_t;

static uint64_t be_read(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* Returns 0 when buf[0..len) is exactly one msgpack map obeying the limits in msg.h; otherwise -1
 * with a reason in err. Allocates nothing; no recursion. */
static int prescan(const uint8_t *p, size_t len, char *err, size_t errlen) {
    scan_frame_t st[CB_MSG_MAX_DEPTH];
    int depth = 0; /* open containers */
    size_t pos = 0;
    for (;;) {
        bool is_key = depth > 0 && st[depth - 1].is_map && (st[depth - 1].left % 2 == 0);
        if (pos >= len) {
            snprintf(err, errlen, "truncated message (%zu bytes)", len);
            return -1;
        }
        size_t at = pos;
        uint8_t b = p[pos++];
        size_t rem = len - pos;
        enum { K_SCALAR, K_ARRAY, K_MAP, K_STR, K_BIN } kind = K_SCALAR;
        uint64_t n = 0;  /* payload bytes (scalar/str/bin) or element count (array/map) */
        int hdr = 0;     /* bytes of length field after the type byte */
        if (b <= 0x7f || b >= 0xe0) { kind = K_SCALAR; n = 0; }
        else if (b <= 0x8f) { kind = K_MAP; n = b & 0x0f; }
        else if (b <= 0x9f) { kind = K_ARRAY; n = b & 0x0f; }
        else if (b <= 0xbf) { kind = K_STR; n = b & 0x1f; }
        else switch (b) {
            case 0xc0: case 0xc2: case 0xc3: kind = K_SCALAR; n = 0; break;
            case 0xc4: kind = K_BIN; hdr = 1; break;
            case 0xc5: kind = K_BIN; hdr = 2; break;
            case 0xc6: kind = K_BIN; hdr = 4; break;
            case 0xca: n = 4; break;
            case 0xcb: n = 8; break;
            case 0xcc: case 0xd0: n = 1; break;
            case 0xcd: case 0xd1: n = 2; break;
            case 0xce: case 0xd2: n = 4; break;
            case 0xcf: case 0xd3: n = 8; break;
            case 0xd9: kind = K_STR; hdr = 1; break;
            case 0xda: kind = K_STR; hdr = 2; break;
            case 0xdb: kind = K_STR; hdr = 4; break;
            case 0xdc: kind = K_ARRAY; hdr = 2; break;
            case 0xdd: kind = K_ARRAY; hdr = 4; break;
            case 0xde: kind = K_MAP; hdr = 2; break;
            case 0xdf: kind = K_MAP; hdr = 4; break;
            case 0xc1:
                snprintf(err, errlen, "invalid msgpack byte 0xc1 at offset %zu", at);
                return -1;
            default: /* 0xc7-0xc9, 0xd4-0xd8: ext types */
                snprintf(err, errlen, "msgpack ext type 0x%02x at offset %zu is not allowed", b, at);
                return -1;
        }
        if (hdr) {
            if (rem < (size_t)hdr) {
                snprintf(err, errlen, "truncated length at offset %zu", at);
                return -1;
            }
            n = be_read(p + pos, hdr);
            pos += (size_t)hdr;
            rem -= (size_t)hdr;
        }
        if (depth == 0 && kind != K_MAP) {
            snprintf(err, errlen, "top level is not a map (first byte 0x%02x)", b);
            return -1;
        }
        if (is_key && kind != K_STR) {
            snprintf(err, errlen, "map key at offset %zu is not a string", at);
            return -1;
        }
        if (depth > 0) st[depth - 1].left--;
        switch (kind) {
        case K_SCALAR:
            if (n > rem) {
                snprintf(err, errlen, "truncated value at offset %zu", at);
                return -1;
            }
            pos += (size_t)n;
            break;
        case K_STR:
        case K_BIN:
            if (n > rem) {
                snprintf(err, errlen, "%s length %llu at offset %zu exceeds the %zu bytes left",
                         kind == K_STR ? "string" : "binary", (unsigned long long)n, at, rem);
                return -1;
            }
            if (is_key) {
                if (n == 0 || n > CB_MSG_MAX_KEY) {
                    snprintf(err, errlen, "map key at offset %zu is empty or longer than %d bytes", at,
                             CB_MSG_MAX_KEY);
                    return -1;
                }
                for (uint64_t i = 0; i < n; i++)
                    if (p[pos + i] < 0x20 || p[pos + i] == 0x7f) {
                        snprintf(err, errlen, "map key at offset %zu contains a control character", at);
                        return -1;
                    }
            }
            if (kind == K_STR && !cb_msg_utf8_valid((const char *)p + pos, (size_t)n)) {
                snprintf(err, errlen, "string at offset %zu is not valid UTF-8", at);
                return -1;
            }
            pos += (size_t)n;
            break;
        case K_ARRAY:
        case K_MAP:
            if (depth >= CB_MSG_MAX_DEPTH) {
                snprintf(err, errlen, "nesting deeper than %d levels at offset %zu", CB_MSG_MAX_DEPTH, at);
                return -1;
            }
            if (kind == K_MAP && n > CB_MSG_MAX_MAP_ENTRIES) {
                snprintf(err, errlen, "map at offset %zu claims %llu entries (limit %d)", at,
                         (unsigned long long)n, CB_MSG_MAX_MAP_ENTRIES);
                return -1;
            }
            {
                uint64_t elems = kind == K_MAP ? 2 * n : n;
                if (elems > rem) {
                    snprintf(err, errlen, "%s at offset %zu claims %llu elements but only %zu bytes remain",
                             kind == K_MAP ? "map" : "array", at, (unsigned long long)n, rem);
                    return -1;
                }
                st[depth].left = elems;
                st[depth].is_map = kind == K_MAP;
                depth++;
            }
            break;
        }
        while (depth > 0 && st[depth - 1].left == 0) depth--;
        if (depth == 0) break;
    }
    if (pos != len) {
        snprintf(err, errlen, "%zu trailing bytes after the message", len - pos);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* Messages and views                                                                              */

typedef struct msg_root_s msg_root_t;

struct cb_msg_s {
    msg_root_t *r;
    const msgpack_object *map; /* a MAP object in r->up.zone */
    const char *path;          /* "" for the root, else e.g. "hits[3]." (zone-allocated) */
};

struct msg_root_s {
    cb_msg_t top;  /* the root view; &r->top is what cb_msg_decode returns */
    char *buf;     /* [len] owned copy of the input; STR/BIN objects point here */
    size_t len;
    msgpack_unpacked up;
    int version;
    int ok; /* -1 absent, 0 false, 1 true */
    cb_err_t err_code;
    char type[CB_MSG_MAX_TYPE + 1];
    char id[CB_MSG_MAX_ID + 1];
    char err_code_name[CB_MSG_MAX_TYPE + 1];
    char *err_message; /* malloc'd, NUL-terminated; "" when ok */
    char last_error[256];
};

static void seterr(const cb_msg_t *m, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void seterr(const cb_msg_t *m, const char *key, const char *fmt, ...) {
    char what[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(m->r->last_error, sizeof m->r->last_error, "field '%s%s': %s", m->path, key ? key : "", what);
    utf8_sanitize(m->r->last_error);
}

const char *cb_msg_last_error(const cb_msg_t *m) { return m ? m->r->last_error : "no message"; }

static bool key_eq(const msgpack_object *k, const char *key, size_t keylen) {
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == keylen &&
           memcmp(k->via.str.ptr, key, keylen) == 0;
}

/* 1: found (non-nil) in *out; 0: absent or nil; -1: duplicate key (error set). */
static int lookup(const cb_msg_t *m, const char *key, const msgpack_object **out) {
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
static const msgpack_object *require(const cb_msg_t *m, const char *key) {
    const msgpack_object *o = NULL;
    int rc = lookup(m, key, &o);
    if (rc == 0) seterr(m, key, "missing");
    return rc == 1 ? o : NULL;
}

static const char *type_name(const msgpack_object *o) {
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
        seterr(m, key, "expected string, got %s", type_name(o));
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

static bool chk_int(const cb_msg_t *m, const char *key, const msgpack_object *o, int64_t min,
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
        seterr(m, key, "expected integer, got %s", type_name(o));
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
        seterr(m, key, "expected number, got %s", type_name(o));
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
        seterr(m, key, "expected binary, got %s", type_name(o));
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
/* Decode                                                                                          */

static bool valid_type_name(const char *s, size_t n) {
    if (n < 1 || n > CB_MSG_MAX_TYPE || !(s[0] >= 'a' && s[0] <= 'z')) return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '_')) return false;
    return true;
}

static bool valid_id(const char *s, size_t n) {
    if (n > CB_MSG_MAX_ID) return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || (unsigned char)s[i] > 0x7e) return false;
    return true;
}

static void set_decode_err(cb_msg_error_t *e, cb_err_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_decode_err(cb_msg_error_t *e, cb_err_t code, const char *fmt, ...) {
    if (!e) return;
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    utf8_sanitize(e->message);
}

static void root_free(msg_root_t *r) {
    if (!r) return;
    msgpack_unpacked_destroy(&r->up);
    free(r->buf);
    free(r->err_message);
    free(r);
}

/* Envelope checks on a structurally valid message. Fills e->id/type as soon as they are known. */
static bool check_envelope(msg_root_t *r, cb_msg_error_t *e) {
    cb_msg_t *m = &r->top;
    const char *s;
    size_t n;
    const msgpack_object *o = NULL;
    /* id first, so that later errors can be answered with it */
    if (lookup(m, "id", &o) != 1 || o->type != MSGPACK_OBJECT_STR || !valid_id(o->via.str.ptr, o->via.str.size)) {
        set_decode_err(e, CB_ERR_BAD_REQUEST, "field 'id': required, a string of at most %d printable ASCII bytes",
                       CB_MSG_MAX_ID);
        return false;
    }
    memcpy(r->id, o->via.str.ptr, o->via.str.size);
    r->id[o->via.str.size] = 0;
    if (e) memcpy(e->id, r->id, sizeof r->id);
    if (lookup(m, "type", &o) != 1 || o->type != MSGPACK_OBJECT_STR ||
        !valid_type_name(o->via.str.ptr, o->via.str.size)) {
        set_decode_err(e, CB_ERR_BAD_REQUEST,
                       "field 'type': required, a string of 1..%d characters [a-z0-9_] starting with a letter",
                       CB_MSG_MAX_TYPE);
        return false;
    }
    memcpy(r->type, o->via.str.ptr, o->via.str.size);
    r->type[o->via.str.size] = 0;
    if (e) memcpy(e->type, r->type, sizeof r->type);
    int64_t v;
    if (!(o = require(m, "v")) || !chk_int(m, "v", o, INT64_MIN, INT64_MAX, &v)) {
        set_decode_err(e, CB_ERR_BAD_REQUEST, "%s", r->last_error);
        return false;
    }
    if (v != CB_MSG_VERSION) {
        set_decode_err(e, CB_ERR_BAD_REQUEST, "unsupported protocol version %lld (this build speaks %d)",
                       (long long)v, CB_MSG_VERSION);
        return false;
    }
    r->version = (int)v;
    r->ok = -1;
    r->err_code = CB_ERR_NONE;
    if (lookup(m, "ok", &o) == 1) {
        if (o->type != MSGPACK_OBJECT_BOOLEAN) {
            set_decode_err(e, CB_ERR_BAD_REQUEST, "field 'ok': expected boolean, got %s", type_name(o));
            return false;
        }
        r->ok = o->via.boolean ? 1 : 0;
    }
    if (r->ok == 0) {
        const cb_msg_t *em = cb_msg_map(m, "error");
        if (!em || !cb_msg_str(em, "code", CB_MSG_MAX_TYPE, &s, &n) || !valid_type_name(s, n)) {
            set_decode_err(e, CB_ERR_BAD_REQUEST, "a reply with ok=false needs error.code (a code name)");
            return false;
        }
        memcpy(r->err_code_name, s, n);
        r->err_code_name[n] = 0;
        r->err_code = cb_err_from_name(s, n);
        if (!cb_msg_str(em, "message", CB_MSG_MAX_ERROR_MESSAGE, &s, &n)) {
            set_decode_err(e, CB_ERR_BAD_REQUEST, "%s", r->last_error);
            return false;
        }
        r->err_message = cb_malloc(n + 1);
        if (!r->err_message) {
            set_decode_err(e, CB_ERR_INTERNAL, "out of memory");
            return false;
        }
        memcpy(r->err_message, s, n);
        r->err_message[n] = 0;
    }
    if (!r->err_message) {
        r->err_message = cb_calloc(1, 1);
        if (!r->err_message) {
            set_decode_err(e, CB_ERR_INTERNAL, "out of memory");
            return false;
        }
    }
    r->last_error[0] = 0;
    return true;
}

cb_msg_t *cb_msg_decode_ex(const void *buf, size_t len, size_t max_bytes, cb_msg_error_t *e) {
    if (e) memset(e, 0, sizeof *e);
    if (!buf && len) {
        set_decode_err(e, CB_ERR_BAD_REQUEST, "no buffer");
        return NULL;
    }
    if (len > max_bytes) {
        set_decode_err(e, CB_ERR_TOO_LARGE, "message of %zu bytes exceeds the limit of %zu", len, max_bytes);
        return NULL;
    }
    char why[200];
    if (prescan((const uint8_t *)buf, len, why, sizeof why) != 0) {
        set_decode_err(e, CB_ERR_BAD_REQUEST, "malformed message: %s", why);
        return NULL;
    }
    msg_root_t *r = cb_calloc(1, sizeof *r);
    if (!r) {
        set_decode_err(e, CB_ERR_INTERNAL, "out of memory");
        return NULL;
    }
    msgpack_unpacked_init(&r->up);
    r->buf = cb_malloc(len ? len : 1);
    if (!r->buf) {
        root_free(r);
        set_decode_err(e, CB_ERR_INTERNAL, "out of memory");
        return NULL;
    }
    memcpy(r->buf, buf, len);
    r->len = len;
    size_t off = 0;
    msgpack_unpack_return rc = msgpack_unpack_next(&r->up, r->buf, len, &off);
    if (rc != MSGPACK_UNPACK_SUCCESS || off != len || r->up.data.type != MSGPACK_OBJECT_MAP) {
        /* cannot happen after the pre-scan; kept as a release-mode guard */
        set_decode_err(e, rc == MSGPACK_UNPACK_NOMEM_ERROR ? CB_ERR_INTERNAL : CB_ERR_BAD_REQUEST,
                       "msgpack unpack failed (rc %d, %zu of %zu bytes)", (int)rc, off, len);
        root_free(r);
        return NULL;
    }
    r->top.r = r;
    r->top.map = &r->up.data;
    r->top.path = "";
    if (!check_envelope(r, e)) {
        root_free(r);
        return NULL;
    }
    return &r->top;
}

cb_msg_t *cb_msg_decode(const void *buf, size_t len, char *err, size_t errlen) {
    cb_msg_error_t e;
    cb_msg_t *m = cb_msg_decode_ex(buf, len, CB_MSG_DEFAULT_MAX_BYTES, &e);
    if (!m && err && errlen) snprintf(err, errlen, "%s", e.message);
    return m;
}

void cb_msg_destroy(cb_msg_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_msg_t *m = *self_p;
    *self_p = NULL;
    if (&m->r->top != m) return; /* a view: owned by its root */
    root_free(m->r);
}

int cb_msg_version(const cb_msg_t *m) { return m->r->version; }
const char *cb_msg_type(const cb_msg_t *m) { return m->r->type; }
const char *cb_msg_id(const cb_msg_t *m) { return m->r->id; }
bool cb_msg_is_type(const cb_msg_t *m, const char *type) { return type && strcmp(m->r->type, type) == 0; }
bool cb_msg_is_reply(const cb_msg_t *m) { return m->r->ok >= 0; }
bool cb_msg_ok(const cb_msg_t *m) { return m->r->ok == 1; }
cb_err_t cb_msg_err_code(const cb_msg_t *m) { return m->r->ok == 0 ? m->r->err_code : CB_ERR_NONE; }
const char *cb_msg_err_code_name(const cb_msg_t *m) { return m->r->ok == 0 ? m->r->err_code_name : ""; }
const char *cb_msg_err_message(const cb_msg_t *m) { return m->r->err_message ? m->r->err_message : ""; }

/* ---------------------------------------------------------------------------------------------- */
/* Accessors                                                                                       */

bool cb_msg_has(const cb_msg_t *m, const char *key) {
    const msgpack_object *o;
    return lookup(m, key, &o) == 1;
}

int cb_msg_present(const cb_msg_t *m, const char *key) {
    const msgpack_object *o;
    return lookup(m, key, &o);
}

bool cb_msg_str(const cb_msg_t *m, const char *key, size_t max_len, const char **s, size_t *len) {
    const msgpack_object *o = require(m, key);
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
    const msgpack_object *o = require(m, key);
    return o && chk_hex(m, key, o, min_len, max_len, s, len);
}

bool cb_msg_int(const cb_msg_t *m, const char *key, int64_t min, int64_t max, int64_t *out) {
    const msgpack_object *o = require(m, key);
    return o && chk_int(m, key, o, min, max, out);
}

bool cb_msg_double(const cb_msg_t *m, const char *key, double min, double max, double *out) {
    const msgpack_object *o = require(m, key);
    return o && chk_double(m, key, o, min, max, out);
}

bool cb_msg_bool(const cb_msg_t *m, const char *key, bool *out) {
    const msgpack_object *o = require(m, key);
    if (!o) return false;
    if (o->type != MSGPACK_OBJECT_BOOLEAN) {
        seterr(m, key, "expected boolean, got %s", type_name(o));
        return false;
    }
    *out = o->via.boolean;
    return true;
}

bool cb_msg_bin(const cb_msg_t *m, const char *key, size_t max_len, const void **p, size_t *len) {
    const msgpack_object *o = require(m, key);
    return o && chk_bin(m, key, o, max_len, p, len);
}

bool cb_msg_int_or(const cb_msg_t *m, const char *key, int64_t min, int64_t max, int64_t def, int64_t *out) {
    const msgpack_object *o = NULL;
    int rc = lookup(m, key, &o);
    if (rc < 0) return false;
    if (rc == 0) { *out = def; return true; }
    return chk_int(m, key, o, min, max, out);
}

bool cb_msg_double_or(const cb_msg_t *m, const char *key, double min, double max, double def, double *out) {
    const msgpack_object *o = NULL;
    int rc = lookup(m, key, &o);
    if (rc < 0) return false;
    if (rc == 0) { *out = def; return true; }
    return chk_double(m, key, o, min, max, out);
}

bool cb_msg_bool_or(const cb_msg_t *m, const char *key, bool def, bool *out) {
    const msgpack_object *o = NULL;
    int rc = lookup(m, key, &o);
    if (rc < 0) return false;
    if (rc == 0) { *out = def; return true; }
    return cb_msg_bool(m, key, out);
}

bool cb_msg_str_or(const cb_msg_t *m, const char *key, size_t max_len, const char *def, const char **s,
                   size_t *len) {
    const msgpack_object *o = NULL;
    int rc = lookup(m, key, &o);
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
    const msgpack_object *o = require(m, key);
    if (!o) return NULL;
    if (o->type != MSGPACK_OBJECT_ARRAY) {
        seterr(m, key, "expected array, got %s", type_name(o));
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
    return o && chk_int(m, label, o, min, max, out);
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
        if (!chk_int(m, label, &a->ptr[i], min, max, &out[i])) return false;
    }
    *n = cnt;
    return true;
}

/* A view of the map object o, labelled "<m's path><label>." for errors; allocated in the zone. */
static const cb_msg_t *make_view(const cb_msg_t *m, const char *label, const msgpack_object *o) {
    if (o->type != MSGPACK_OBJECT_MAP) {
        seterr(m, label, "expected map, got %s", type_name(o));
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
    const msgpack_object *o = require(m, key);
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

/* ---------------------------------------------------------------------------------------------- */
/* Writer                                                                                          */

typedef struct {
    size_t off;     /* offset of the 5-byte header (0xdf/0xdd + u32 count) */
    uint32_t count; /* entries (map) or elements (array) so far */
    bool is_map;
} wframe_t;

struct cb_msg_writer_s {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    wframe_t st[CB_MSG_MAX_DEPTH];
    int depth;
    bool done;   /* the top-level map was closed */
    bool failed;
    char error[160];
};

cb_msg_writer_t *cb_msg_writer_new(void) {
    cb_msg_writer_t *w = cb_calloc(1, sizeof *w);
    if (!w) return NULL;
    msgpack_sbuffer_init(&w->sb);
    msgpack_packer_init(&w->pk, &w->sb, msgpack_sbuffer_write);
    return w;
}

void cb_msg_writer_destroy(cb_msg_writer_t **self_p) {
    if (!self_p || !*self_p) return;
    msgpack_sbuffer_destroy(&(*self_p)->sb);
    free(*self_p);
    *self_p = NULL;
}

void cb_msg_writer_reset(cb_msg_writer_t *w) {
    w->sb.size = 0;
    w->depth = 0;
    w->done = false;
    w->failed = false;
    w->error[0] = 0;
}

const char *cb_msg_writer_error(const cb_msg_writer_t *w) { return w->failed ? w->error : NULL; }

static void wfail(cb_msg_writer_t *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void wfail(cb_msg_writer_t *w, const char *fmt, ...) {
    if (w->failed) return;
    w->failed = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->error, sizeof w->error, fmt, ap);
    va_end(ap);
}

#define WCHK(w, expr) do { if ((expr) != 0) wfail((w), "out of memory"); } while (0)

/* Writes the key (in a map) or checks there is none (in an array), and counts the element.
 * Returns false when the writer cannot take a value here. */
static bool wkey(cb_msg_writer_t *w, const char *key) {
    if (w->failed) return false;
    if (w->depth == 0) {
        wfail(w, "value outside a message (call cb_msg_begin first)");
        return false;
    }
    wframe_t *f = &w->st[w->depth - 1];
    if (f->is_map) {
        size_t n = key ? strlen(key) : 0;
        if (!key || n == 0 || n > CB_MSG_MAX_KEY) {
            wfail(w, "a map entry needs a key of 1..%d bytes", CB_MSG_MAX_KEY);
            return false;
        }
        if (f->count >= CB_MSG_MAX_MAP_ENTRIES) {
            wfail(w, "map over %d entries", CB_MSG_MAX_MAP_ENTRIES);
            return false;
        }
        WCHK(w, msgpack_pack_str_with_body(&w->pk, key, n));
    } else if (key) {
        wfail(w, "array elements take no key (got '%s')", key);
        return false;
    } else if (f->count == UINT32_MAX) {
        wfail(w, "array too long");
        return false;
    }
    f->count++;
    return !w->failed;
}

static void wopen(cb_msg_writer_t *w, bool is_map) {
    if (w->depth >= CB_MSG_MAX_DEPTH) {
        wfail(w, "nesting deeper than %d", CB_MSG_MAX_DEPTH);
        return;
    }
    unsigned char hdr[5] = {is_map ? 0xdf : 0xdd, 0, 0, 0, 0};
    size_t off = w->sb.size;
    WCHK(w, msgpack_sbuffer_write(&w->sb, (const char *)hdr, sizeof hdr));
    if (w->failed) return;
    w->st[w->depth].off = off;
    w->st[w->depth].count = 0;
    w->st[w->depth].is_map = is_map;
    w->depth++;
}

static void wclose(cb_msg_writer_t *w, bool is_map) {
    if (w->failed) return;
    if (w->depth == 0 || w->st[w->depth - 1].is_map != is_map) {
        wfail(w, "cb_msg_end_%s without a matching begin", is_map ? "map" : "array");
        return;
    }
    wframe_t *f = &w->st[--w->depth];
    unsigned char *h = (unsigned char *)w->sb.data + f->off;
    h[1] = (unsigned char)(f->count >> 24);
    h[2] = (unsigned char)(f->count >> 16);
    h[3] = (unsigned char)(f->count >> 8);
    h[4] = (unsigned char)f->count;
}

static void wstart(cb_msg_writer_t *w, const char *type, const char *id) {
    cb_msg_writer_reset(w);
    if (!type || !valid_type_name(type, strlen(type))) {
        wfail(w, "invalid message type");
        return;
    }
    if (!id) id = "";
    if (!valid_id(id, strlen(id))) {
        wfail(w, "invalid request id (at most %d printable ASCII bytes)", CB_MSG_MAX_ID);
        return;
    }
    wopen(w, true);
    cb_msg_put_int(w, "v", CB_MSG_VERSION);
    cb_msg_put_str(w, "type", type);
    cb_msg_put_str(w, "id", id);
}

void cb_msg_begin(cb_msg_writer_t *w, const char *type, const char *id) { wstart(w, type, id); }

void cb_msg_begin_bare(cb_msg_writer_t *w) {
    cb_msg_writer_reset(w);
    wopen(w, true);
}

void cb_msg_begin_reply_as(cb_msg_writer_t *w, const char *type, const char *id) {
    wstart(w, type, id);
    cb_msg_put_bool(w, "ok", true);
}

void cb_msg_begin_reply(cb_msg_writer_t *w, const cb_msg_t *req) {
    cb_msg_begin_reply_as(w, cb_msg_type(req), cb_msg_id(req));
}

const void *cb_msg_write_errorv(cb_msg_writer_t *w, const char *type, const char *id, cb_err_t code,
                                size_t *len, const char *fmt, va_list ap) {
    char message[CB_MSG_MAX_ERROR_MESSAGE + 1];
    vsnprintf(message, sizeof message, fmt ? fmt : "", ap);
    utf8_sanitize(message);
    if (!type || !*type || !valid_type_name(type, strlen(type))) type = "error";
    if (!id || !valid_id(id, strlen(id))) id = "";
    if (code == CB_ERR_NONE || code >= CB_ERR_COUNT_) code = CB_ERR_INTERNAL;
    wstart(w, type, id);
    cb_msg_put_bool(w, "ok", false);
    cb_msg_begin_map(w, "error");
    cb_msg_put_str(w, "code", cb_err_name(code));
    cb_msg_put_str(w, "message", message);
    cb_msg_end_map(w);
    return cb_msg_end(w, len);
}

const void *cb_msg_write_error(cb_msg_writer_t *w, const char *type, const char *id, cb_err_t code,
                               size_t *len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const void *p = cb_msg_write_errorv(w, type, id, code, len, fmt, ap);
    va_end(ap);
    return p;
}

void cb_msg_put_strn(cb_msg_writer_t *w, const char *key, const char *s, size_t len) {
    if (!s && len) {
        wfail(w, "NULL string for '%s'", key ? key : "");
        return;
    }
    if (len > UINT32_MAX) {
        wfail(w, "string too long");
        return;
    }
    if (!wkey(w, key)) return;
    WCHK(w, msgpack_pack_str_with_body(&w->pk, s ? s : "", len));
}

void cb_msg_put_str(cb_msg_writer_t *w, const char *key, const char *s) {
    cb_msg_put_strn(w, key, s ? s : "", s ? strlen(s) : 0);
}

void cb_msg_put_int(cb_msg_writer_t *w, const char *key, int64_t v) {
    if (wkey(w, key)) WCHK(w, msgpack_pack_int64(&w->pk, v));
}

void cb_msg_put_uint(cb_msg_writer_t *w, const char *key, uint64_t v) {
    if (wkey(w, key)) WCHK(w, msgpack_pack_uint64(&w->pk, v));
}

void cb_msg_put_double(cb_msg_writer_t *w, const char *key, double v) {
    if (wkey(w, key)) WCHK(w, msgpack_pack_double(&w->pk, v));
}

void cb_msg_put_bool(cb_msg_writer_t *w, const char *key, bool v) {
    if (wkey(w, key)) WCHK(w, v ? msgpack_pack_true(&w->pk) : msgpack_pack_false(&w->pk));
}

void cb_msg_put_nil(cb_msg_writer_t *w, const char *key) {
    if (wkey(w, key)) WCHK(w, msgpack_pack_nil(&w->pk));
}

void cb_msg_put_bin(cb_msg_writer_t *w, const char *key, const void *p, size_t len) {
    if ((!p && len) || len > UINT32_MAX) {
        wfail(w, "invalid binary for '%s'", key ? key : "");
        return;
    }
    if (wkey(w, key)) WCHK(w, msgpack_pack_bin_with_body(&w->pk, p, len));
}

void cb_msg_begin_map(cb_msg_writer_t *w, const char *key) {
    if (wkey(w, key)) wopen(w, true);
}

void cb_msg_end_map(cb_msg_writer_t *w) { wclose(w, true); }

void cb_msg_begin_array(cb_msg_writer_t *w, const char *key) {
    if (wkey(w, key)) wopen(w, false);
}

void cb_msg_end_array(cb_msg_writer_t *w) { wclose(w, false); }

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

void cb_msg_put_json(cb_msg_writer_t *w, const char *key, const json_t *v) {
    if (w->failed) return;
    if (!v) {
        wfail(w, "NULL JSON value");
        return;
    }
    switch (json_typeof(v)) {
    case JSON_NULL: cb_msg_put_nil(w, key); break;
    case JSON_TRUE: cb_msg_put_bool(w, key, true); break;
    case JSON_FALSE: cb_msg_put_bool(w, key, false); break;
    case JSON_INTEGER: cb_msg_put_int(w, key, (int64_t)json_integer_value(v)); break;
    case JSON_REAL: cb_msg_put_double(w, key, json_real_value(v)); break;
    case JSON_STRING: cb_msg_put_strn(w, key, json_string_value(v), json_string_length(v)); break;
    case JSON_ARRAY: {
        if (w->depth >= CB_MSG_MAX_DEPTH) { wfail(w, "nesting deeper than %d", CB_MSG_MAX_DEPTH); return; }
        cb_msg_begin_array(w, key);
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) {
            cb_msg_put_json(w, NULL, e);
            if (w->failed) return;
        }
        cb_msg_end_array(w);
        break;
    }
    case JSON_OBJECT: {
        json_t *bin = json_object_get(v, "$bin");
        if (bin && json_object_size(v) == 1 && json_is_string(bin)) {
            const char *h = json_string_value(bin);
            size_t n = json_string_length(bin);
            if (n % 2) { wfail(w, "$bin: odd number of hex digits"); return; }
            unsigned char *buf = cb_malloc(n / 2 + 1);
            if (!buf) { wfail(w, "out of memory"); return; }
            for (size_t i = 0; i < n / 2; i++) {
                int hi = hexval(h[2 * i]), lo = hexval(h[2 * i + 1]);
                if (hi < 0 || lo < 0) { free(buf); wfail(w, "$bin: not hex"); return; }
                buf[i] = (unsigned char)(hi * 16 + lo);
            }
            cb_msg_put_bin(w, key, buf, n / 2);
            free(buf);
            break;
        }
        if (w->depth >= CB_MSG_MAX_DEPTH) { wfail(w, "nesting deeper than %d", CB_MSG_MAX_DEPTH); return; }
        cb_msg_begin_map(w, key);
        const char *k;
        json_t *e;
        json_object_foreach((json_t *)v, k, e) {
            cb_msg_put_json(w, k, e);
            if (w->failed) return;
        }
        cb_msg_end_map(w);
        break;
    }
    default: wfail(w, "unsupported JSON value"); break;
    }
}

/* Nesting depth of an object (a scalar is 0); bounded by the pre-scan's cap. */
static int obj_depth(const msgpack_object *o) {
    int d = 0;
    if (o->type == MSGPACK_OBJECT_ARRAY)
        for (uint32_t i = 0; i < o->via.array.size; i++) {
            int c = obj_depth(&o->via.array.ptr[i]);
            if (c > d) d = c;
        }
    else if (o->type == MSGPACK_OBJECT_MAP)
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            int c = obj_depth(&o->via.map.ptr[i].val);
            if (c > d) d = c;
        }
    else return 0;
    return d + 1;
}

void cb_msg_put_entries(cb_msg_writer_t *w, const cb_msg_t *m, const char *const *skip) {
    if (!m) return;
    const msgpack_object_map *mp = &m->map->via.map;
    char key[CB_MSG_MAX_KEY + 1];
    for (uint32_t i = 0; i < mp->size && !w->failed; i++) {
        const msgpack_object *k = &mp->ptr[i].key;
        if (k->type != MSGPACK_OBJECT_STR || k->via.str.size > CB_MSG_MAX_KEY) continue;
        memcpy(key, k->via.str.ptr, k->via.str.size);
        key[k->via.str.size] = 0;
        bool skipped = false;
        for (size_t s = 0; skip && skip[s]; s++)
            if (strcmp(skip[s], key) == 0) skipped = true;
        if (skipped) continue;
        /* a value nested too deep for the writer fails it rather than producing an undecodable
         * message */
        if (w->depth + obj_depth(&mp->ptr[i].val) > CB_MSG_MAX_DEPTH) {
            wfail(w, "'%s': nesting deeper than %d", key, CB_MSG_MAX_DEPTH);
            return;
        }
        if (!wkey(w, key)) return;
        WCHK(w, msgpack_pack_object(&w->pk, mp->ptr[i].val));
    }
}

const void *cb_msg_end(cb_msg_writer_t *w, size_t *len) {
    if (!w->failed && !w->done) {
        if (w->depth == 0) wfail(w, "no message begun");
        else if (w->depth != 1) wfail(w, "%d containers left open", w->depth - 1);
        else {
            wclose(w, true);
            w->done = true;
        }
    }
    if (w->failed) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = w->sb.size;
    return w->sb.data;
}
