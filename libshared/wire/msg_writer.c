/* msg_writer.c: the message writer: a msgpack buffer with a stack of open maps and arrays whose counts are
 * patched when they close; the envelope (v, type, id, ok), error replies, JSON values and the entries of a
 * decoded map. Every limit the decoder enforces is enforced here too, so what it writes decodes. Part of
 * the wire protocol (msg_internal.h). */
#include "wire/msg_internal.h"
#include "base/alloc.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    if (!type || !cb_msg_valid_type_name(type, strlen(type))) {
        wfail(w, "invalid message type");
        return;
    }
    if (!id) id = "";
    if (!cb_msg_valid_id(id, strlen(id))) {
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
    cb_msg_utf8_sanitize(message);
    if (!type || !*type || !cb_msg_valid_type_name(type, strlen(type))) type = "error";
    if (!id || !cb_msg_valid_id(id, strlen(id))) id = "";
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

