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
 *
 * The files: this one holds the error codes, the pre-scan, decoding and the envelope; msg_fields.c the
 * typed access to a decoded message; msg_writer.c the writer; msg_internal.h what they share.
 */
#include "wire/msg_internal.h"
#include "base/alloc.h"
#include "base/utf8.h"

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
void cb_msg_utf8_sanitize(char *str) {
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
/* Decode                                                                                          */

bool cb_msg_valid_type_name(const char *s, size_t n) {
    if (n < 1 || n > CB_MSG_MAX_TYPE || !(s[0] >= 'a' && s[0] <= 'z')) return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '_')) return false;
    return true;
}

bool cb_msg_valid_id(const char *s, size_t n) {
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
    cb_msg_utf8_sanitize(e->message);
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
    if (cb_msg_lookup(m, "id", &o) != 1 || o->type != MSGPACK_OBJECT_STR || !cb_msg_valid_id(o->via.str.ptr, o->via.str.size)) {
        set_decode_err(e, CB_ERR_BAD_REQUEST, "field 'id': required, a string of at most %d printable ASCII bytes",
                       CB_MSG_MAX_ID);
        return false;
    }
    memcpy(r->id, o->via.str.ptr, o->via.str.size);
    r->id[o->via.str.size] = 0;
    if (e) memcpy(e->id, r->id, sizeof r->id);
    if (cb_msg_lookup(m, "type", &o) != 1 || o->type != MSGPACK_OBJECT_STR ||
        !cb_msg_valid_type_name(o->via.str.ptr, o->via.str.size)) {
        set_decode_err(e, CB_ERR_BAD_REQUEST,
                       "field 'type': required, a string of 1..%d characters [a-z0-9_] starting with a letter",
                       CB_MSG_MAX_TYPE);
        return false;
    }
    memcpy(r->type, o->via.str.ptr, o->via.str.size);
    r->type[o->via.str.size] = 0;
    if (e) memcpy(e->type, r->type, sizeof r->type);
    int64_t v;
    if (!(o = cb_msg_require(m, "v")) || !cb_msg_chk_int(m, "v", o, INT64_MIN, INT64_MAX, &v)) {
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
    if (cb_msg_lookup(m, "ok", &o) == 1) {
        if (o->type != MSGPACK_OBJECT_BOOLEAN) {
            set_decode_err(e, CB_ERR_BAD_REQUEST, "field 'ok': expected boolean, got %s", cb_msg_type_name(o));
            return false;
        }
        r->ok = o->via.boolean ? 1 : 0;
    }
    if (r->ok == 0) {
        const cb_msg_t *em = cb_msg_map(m, "error");
        if (!em || !cb_msg_str(em, "code", CB_MSG_MAX_TYPE, &s, &n) || !cb_msg_valid_type_name(s, n)) {
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
