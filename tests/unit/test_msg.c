/* test_msg: the wire protocol module (libshared/msg): round trips through the writer and the
 * decoder, and every decoder error path (truncation, trailing bytes, nesting, hostile counts and
 * lengths, wrong types, oversize strings, bad envelopes, duplicate keys, non-map top level). */
#include <jansson.h>
#include <msgpack.h>
#include <stdint.h>

#include "wire/msg.h"
#include "test.h"

/* A byte buffer built by hand for malformed inputs. */
typedef struct {
    unsigned char b[4096];
    size_t n;
} bytes_t;

static void put(bytes_t *x, const char *hex) { /* appends bytes written as hex, spaces ignored */
    for (const char *p = hex; *p;) {
        if (*p == ' ') { p++; continue; }
        unsigned v;
        sscanf(p, "%2x", &v);
        x->b[x->n++] = (unsigned char)v;
        p += 2;
    }
}

static void put_fixstr(bytes_t *x, const char *s) {
    size_t n = strlen(s);
    x->b[x->n++] = (unsigned char)(0xa0 | n);
    memcpy(x->b + x->n, s, n);
    x->n += n;
}

/* Starts a map of `entries` entries whose first three are v=1, type, id="r1". */
static void envelope(bytes_t *x, unsigned entries, const char *type) {
    x->n = 0;
    x->b[x->n++] = (unsigned char)(0x80 | entries);
    put_fixstr(x, "v");
    put(x, "01");
    put_fixstr(x, "type");
    put_fixstr(x, type);
    put_fixstr(x, "id");
    put_fixstr(x, "r1");
}

static cb_msg_t *dec(const bytes_t *x, cb_msg_error_t *e) { return cb_msg_decode_ex(x->b, x->n, 1 << 20, e); }

TEST(roundtrip_request) {
    cb_msg_writer_t *w = cb_msg_writer_new();
    CHECK(w);
    cb_msg_begin(w, "search", "req-1");
    cb_msg_put_str(w, "query", "who wrote hamlet");
    cb_msg_put_int(w, "k", 5);
    cb_msg_put_int(w, "neg", -7);
    cb_msg_put_uint(w, "big", UINT64_MAX);
    cb_msg_put_double(w, "ratio", 0.15);
    cb_msg_put_bool(w, "flag", true);
    cb_msg_put_nil(w, "nothing");
    cb_msg_put_bin(w, "blob", "\x00\x01\x02", 3);
    cb_msg_put_str(w, "hexkey", "00ff1a");
    cb_msg_begin_array(w, "contexts");
    cb_msg_put_str(w, NULL, "alpha");
    cb_msg_put_str(w, NULL, "beta");
    cb_msg_end_array(w);
    cb_msg_begin_array(w, "ids");
    for (int i = 0; i < 4; i++) cb_msg_put_int(w, NULL, i * 10);
    cb_msg_end_array(w);
    cb_msg_begin_map(w, "meta");
    cb_msg_put_str(w, "source", "unit");
    cb_msg_end_map(w);
    size_t len;
    const void *data = cb_msg_end(w, &len);
    CHECK_MSG(data, "%s", cb_msg_writer_error(w));

    char err[256];
    cb_msg_t *m = cb_msg_decode(data, len, err, sizeof err);
    CHECK_MSG(m, "%s", err);
    CHECK(cb_msg_version(m) == 1);
    CHECK(strcmp(cb_msg_type(m), "search") == 0);
    CHECK(cb_msg_is_type(m, "search"));
    CHECK(strcmp(cb_msg_id(m), "req-1") == 0);
    CHECK(!cb_msg_is_reply(m));
    const char *s;
    size_t n;
    CHECK(cb_msg_str(m, "query", 100, &s, &n) && n == 16 && memcmp(s, "who wrote hamlet", 16) == 0);
    char buf[32];
    CHECK(cb_msg_str_copy(m, "query", 100, buf, sizeof buf) && strcmp(buf, "who wrote hamlet") == 0);
    CHECK(!cb_msg_str_copy(m, "query", 100, buf, 8)); /* does not fit: limited to 7 bytes */
    int64_t v;
    CHECK(cb_msg_int(m, "k", 1, 100, &v) && v == 5);
    CHECK(cb_msg_int(m, "neg", -10, 0, &v) && v == -7);
    CHECK(!cb_msg_int(m, "big", 0, INT64_MAX, &v)); /* u64 above INT64_MAX */
    double d;
    CHECK(cb_msg_double(m, "ratio", 0, 1, &d) && fabs(d - 0.15) < 1e-12);
    CHECK(cb_msg_double(m, "k", 0, 10, &d) && d == 5.0); /* integers are numbers */
    bool b;
    CHECK(cb_msg_bool(m, "flag", &b) && b);
    CHECK(!cb_msg_has(m, "nothing")); /* nil counts as absent */
    CHECK(!cb_msg_has(m, "absent"));
    const void *p;
    CHECK(cb_msg_bin(m, "blob", 10, &p, &n) && n == 3 && memcmp(p, "\x00\x01\x02", 3) == 0);
    CHECK(cb_msg_hex(m, "hexkey", 2, 64, &s, &n) && n == 6);
    CHECK(!cb_msg_hex(m, "query", 2, 64, &s, &n));
    const char *strs[4];
    size_t lens[4];
    CHECK(cb_msg_str_array(m, "contexts", 4, 10, strs, lens, &n) && n == 2);
    CHECK(lens[1] == 4 && memcmp(strs[1], "beta", 4) == 0);
    CHECK(!cb_msg_str_array(m, "contexts", 1, 10, strs, lens, &n)); /* over max count */
    CHECK(strstr(cb_msg_last_error(m), "limit of 1"));
    int64_t ids[8];
    CHECK(cb_msg_int_array(m, "ids", 8, 0, 100, ids, &n) && n == 4 && ids[3] == 30);
    CHECK(!cb_msg_int_array(m, "ids", 8, 0, 20, ids, &n));
    CHECK(strstr(cb_msg_last_error(m), "ids[3]"));
    CHECK(cb_msg_at_int(m, "ids", 2, 0, 100, &v) && v == 20);
    CHECK(!cb_msg_at_int(m, "ids", 4, 0, 100, &v)); /* out of range index */
    CHECK(cb_msg_at_str(m, "contexts", 0, 10, &s, &n) && n == 5);
    const cb_msg_t *meta = cb_msg_map(m, "meta");
    CHECK(meta && cb_msg_str(meta, "source", 10, &s, &n) && n == 4);
    CHECK(!cb_msg_int(meta, "source", 0, 1, &v));
    CHECK_MSG(strstr(cb_msg_last_error(m), "meta.source"), "%s", cb_msg_last_error(m));
    cb_msg_t *view = (cb_msg_t *)meta;
    cb_msg_destroy(&view); /* a no-op on views */
    CHECK(view == NULL);
    CHECK(cb_msg_str(meta, "source", 10, &s, &n));
    cb_msg_destroy(&m);
    CHECK(m == NULL);
    cb_msg_destroy(&m); /* NULL-safe */
    cb_msg_writer_destroy(&w);
    CHECK(w == NULL);
}

TEST(optional_fields) {
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_begin(w, "query", "x");
    cb_msg_put_int(w, "k", 3);
    cb_msg_put_str(w, "mode", "blend");
    cb_msg_put_nil(w, "ratio");
    size_t len;
    const void *data = cb_msg_end(w, &len);
    cb_msg_t *m = cb_msg_decode(data, len, NULL, 0);
    CHECK(m);
    int64_t k;
    double r;
    bool b;
    const char *s;
    size_t n;
    CHECK(cb_msg_int_or(m, "k", 1, 10, 5, &k) && k == 3);
    CHECK(cb_msg_int_or(m, "max_tokens", 1, 10, 7, &k) && k == 7);
    CHECK(!cb_msg_int_or(m, "k", 5, 10, 7, &k));
    CHECK(cb_msg_double_or(m, "ratio", 0, 1, 0.15, &r) && r == 0.15);
    CHECK(cb_msg_bool_or(m, "stream", true, &b) && b);
    CHECK(!cb_msg_bool_or(m, "mode", true, &b));
    CHECK(cb_msg_str_or(m, "mode", 10, "full", &s, &n) && n == 5);
    CHECK(cb_msg_str_or(m, "other", 10, "full", &s, &n) && n == 4 && strcmp(s, "full") == 0);
    CHECK(!cb_msg_str_or(m, "k", 10, "full", &s, &n));
    cb_msg_destroy(&m);
    cb_msg_writer_destroy(&w);
}

TEST(reply_and_error_reply) {
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_begin(w, "lookup", "abc");
    size_t len;
    const void *data = cb_msg_end(w, &len);
    cb_msg_t *req = cb_msg_decode(data, len, NULL, 0);
    CHECK(req);
    cb_msg_begin_reply(w, req);
    cb_msg_begin_array(w, "hits");
    cb_msg_begin_map(w, NULL);
    cb_msg_put_str(w, "key", "aa");
    cb_msg_end_map(w);
    cb_msg_begin_map(w, NULL);
    cb_msg_put_int(w, "key", 1);
    cb_msg_end_map(w);
    cb_msg_end_array(w);
    data = cb_msg_end(w, &len);
    CHECK(data);
    cb_msg_t *rep = cb_msg_decode(data, len, NULL, 0);
    CHECK(rep && cb_msg_is_reply(rep) && cb_msg_ok(rep) && cb_msg_err_code(rep) == CB_ERR_NONE);
    CHECK(strcmp(cb_msg_type(rep), "lookup") == 0 && strcmp(cb_msg_id(rep), "abc") == 0);
    size_t n;
    CHECK(cb_msg_array_len(rep, "hits", 10, &n) && n == 2);
    const cb_msg_t *h0 = cb_msg_at_map(rep, "hits", 0), *h1 = cb_msg_at_map(rep, "hits", 1);
    const char *s;
    CHECK(h0 && h1 && cb_msg_str(h0, "key", 8, &s, &n) && n == 2);
    CHECK(!cb_msg_str(h1, "key", 8, &s, &n));
    CHECK_MSG(strstr(cb_msg_last_error(rep), "hits[1].key") && strstr(cb_msg_last_error(rep), "expected string"),
              "%s", cb_msg_last_error(rep));
    CHECK(!cb_msg_at_map(rep, "hits", 2));
    cb_msg_destroy(&rep);

    data = cb_msg_write_error(w, "lookup", "abc", CB_ERR_NOT_FOUND, &len, "no such key %s", "zz");
    CHECK(data);
    rep = cb_msg_decode(data, len, NULL, 0);
    CHECK(rep && cb_msg_is_reply(rep) && !cb_msg_ok(rep));
    CHECK(cb_msg_err_code(rep) == CB_ERR_NOT_FOUND);
    CHECK(strcmp(cb_msg_err_code_name(rep), "not_found") == 0);
    CHECK(strcmp(cb_msg_err_message(rep), "no such key zz") == 0);
    cb_msg_destroy(&rep);

    /* invalid type and id fall back to "error" and "" */
    data = cb_msg_write_error(w, "Bad Type!", "\x01", CB_ERR_BAD_REQUEST, &len, "x");
    rep = cb_msg_decode(data, len, NULL, 0);
    CHECK(rep && strcmp(cb_msg_type(rep), "error") == 0 && strcmp(cb_msg_id(rep), "") == 0);
    cb_msg_destroy(&rep);
    cb_msg_destroy(&req);
    cb_msg_writer_destroy(&w);
}

TEST(error_names) {
    for (int c = 1; c < CB_ERR_COUNT_; c++) {
        const char *nm = cb_err_name((cb_err_t)c);
        CHECK(cb_err_from_name(nm, strlen(nm)) == (cb_err_t)c);
    }
    CHECK(strcmp(cb_err_name(CB_ERR_OVERLOADED), "overloaded") == 0);
    CHECK(strcmp(cb_err_name(CB_ERR_BAD_REQUEST), "bad_request") == 0);
    CHECK(strcmp(cb_err_name((cb_err_t)99), "internal") == 0);
    CHECK(cb_err_from_name("nonsense", 8) == CB_ERR_INTERNAL);
}

TEST(truncated_every_prefix) {
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_begin(w, "index", "id1");
    cb_msg_put_str(w, "text", "some text here");
    cb_msg_begin_array(w, "a");
    cb_msg_put_int(w, NULL, 70000);
    cb_msg_put_double(w, NULL, 1.5);
    cb_msg_end_array(w);
    size_t len;
    const unsigned char *data = cb_msg_end(w, &len);
    CHECK(data);
    for (size_t i = 0; i < len; i++) {
        cb_msg_error_t e;
        cb_msg_t *m = cb_msg_decode_ex(data, i, 1 << 20, &e);
        CHECK_MSG(!m, "prefix of %zu bytes decoded", i);
        CHECK(e.code == CB_ERR_BAD_REQUEST);
    }
    cb_msg_t *m = cb_msg_decode(data, len, NULL, 0);
    CHECK(m);
    cb_msg_destroy(&m);
    CHECK(!cb_msg_decode(NULL, 0, NULL, 0));
    cb_msg_writer_destroy(&w);
}

TEST(trailing_bytes) {
    bytes_t x;
    envelope(&x, 3, "ping");
    cb_msg_error_t e;
    cb_msg_t *m = dec(&x, &e);
    CHECK_MSG(m, "%s", e.message);
    cb_msg_destroy(&m);
    put(&x, "c0");
    CHECK(!dec(&x, &e));
    CHECK_MSG(strstr(e.message, "trailing"), "%s", e.message);
    /* two maps back to back */
    bytes_t y;
    envelope(&y, 3, "ping");
    memcpy(x.b, y.b, y.n);
    memcpy(x.b + y.n, y.b, y.n);
    x.n = 2 * y.n;
    CHECK(!dec(&x, &e) && strstr(e.message, "trailing"));
}

TEST(non_map_top_level) {
    const char *cases[] = {"91 01", "01", "a3 61 62 63", "c0", "c3", "cb 3f f0 00 00 00 00 00 00", "dc 00 00", "c4 00"};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        bytes_t x = {.n = 0};
        put(&x, cases[i]);
        cb_msg_error_t e;
        CHECK(!dec(&x, &e));
        CHECK_MSG(strstr(e.message, "not a map"), "%s: %s", cases[i], e.message);
    }
}

TEST(deep_nesting) {
    /* field "x" = 7 nested arrays: total depth 8 (top map + 7) passes; 8 arrays fail */
    for (int levels = 6; levels <= 9; levels++) {
        bytes_t x;
        envelope(&x, 4, "ping");
        put_fixstr(&x, "x");
        for (int i = 0; i < levels; i++) put(&x, "91");
        put(&x, "01");
        cb_msg_error_t e;
        cb_msg_t *m = dec(&x, &e);
        if (levels + 1 <= CB_MSG_MAX_DEPTH) CHECK_MSG(m, "depth %d: %s", levels + 1, e.message);
        else CHECK_MSG(!m && strstr(e.message, "nesting"), "depth %d: %s", levels + 1, e.message);
        cb_msg_destroy(&m);
    }
    /* 10000 levels of maps: rejected early, no recursion */
    static unsigned char deep[30000];
    size_t n = 0;
    for (int i = 0; i < 10000; i++) { deep[n++] = 0x81; deep[n++] = 0xa1; deep[n++] = 'a'; }
    cb_msg_error_t e;
    CHECK(!cb_msg_decode_ex(deep, n, sizeof deep, &e) && strstr(e.message, "nesting"));
}

TEST(huge_counts) {
    cb_msg_error_t e;
    /* array32 of 2^32-1 elements in 5 bytes (msgpack-c would try to allocate ~96 GiB) */
    bytes_t x;
    envelope(&x, 4, "ping");
    put_fixstr(&x, "x");
    put(&x, "dd ff ff ff ff");
    CHECK(!dec(&x, &e));
    CHECK_MSG(strstr(e.message, "claims") && strstr(e.message, "remain"), "%s", e.message);
    /* array32 of 2^20 elements followed by a few bytes */
    envelope(&x, 4, "ping");
    put_fixstr(&x, "x");
    put(&x, "dd 00 10 00 00 01 01 01");
    CHECK(!dec(&x, &e) && strstr(e.message, "claims"));
    /* map32 at the top claiming 2^32-1 entries */
    x.n = 0;
    put(&x, "df ff ff ff ff a1 76 01");
    CHECK(!dec(&x, &e) && strstr(e.message, "claims"));
    /* a map over the per-map entry cap, even with the bytes present */
    static unsigned char big[20000];
    size_t n = 0;
    big[n++] = 0xde;
    big[n++] = (CB_MSG_MAX_MAP_ENTRIES + 1) >> 8;
    big[n++] = (CB_MSG_MAX_MAP_ENTRIES + 1) & 0xff;
    for (int i = 0; i < CB_MSG_MAX_MAP_ENTRIES + 1; i++) {
        char kb[16];
        snprintf(kb, sizeof kb, "%04d", i % 10000);
        big[n++] = 0xa4;
        memcpy(big + n, kb, 4);
        n += 4;
        big[n++] = 0x01;
    }
    CHECK(!cb_msg_decode_ex(big, n, sizeof big, &e) && strstr(e.message, "entries"));
    /* nested array16 chains claiming more than what remains at each level */
    envelope(&x, 4, "ping");
    put_fixstr(&x, "x");
    put(&x, "dc ff ff dc ff ff dc ff ff");
    CHECK(!dec(&x, &e) && strstr(e.message, "claims"));
}

TEST(oversized_lengths) {
    cb_msg_error_t e;
    bytes_t x;
    /* str32 length beyond the frame */
    envelope(&x, 4, "ping");
    put_fixstr(&x, "x");
    put(&x, "db 7f ff ff ff 61 62");
    CHECK(!dec(&x, &e) && strstr(e.message, "exceeds"));
    /* bin32 length beyond the frame */
    envelope(&x, 4, "ping");
    put_fixstr(&x, "x");
    put(&x, "c6 00 01 00 00 61");
    CHECK(!dec(&x, &e) && strstr(e.message, "exceeds"));
    /* truncated length field */
    envelope(&x, 4, "ping");
    put_fixstr(&x, "x");
    put(&x, "db 00 00");
    CHECK(!dec(&x, &e) && strstr(e.message, "truncated"));
    /* whole message over the cap: too_large */
    envelope(&x, 3, "ping");
    CHECK(!cb_msg_decode_ex(x.b, x.n, x.n - 1, &e) && e.code == CB_ERR_TOO_LARGE);
}

TEST(bad_bytes_and_keys) {
    cb_msg_error_t e;
    bytes_t x;
    envelope(&x, 4, "ping"); /* 0xc1 is never used */
    put_fixstr(&x, "x");
    put(&x, "c1");
    CHECK(!dec(&x, &e) && strstr(e.message, "0xc1"));
    const char *exts[] = {"d4 01 00", "c7 01 01 00", "d8 01 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00"};
    for (int i = 0; i < 3; i++) {
        envelope(&x, 4, "ping");
        put_fixstr(&x, "x");
        put(&x, exts[i]);
        CHECK(!dec(&x, &e) && strstr(e.message, "ext"));
    }
    envelope(&x, 4, "ping"); /* integer key */
    put(&x, "01 01");
    CHECK(!dec(&x, &e) && strstr(e.message, "key"));
    envelope(&x, 4, "ping"); /* 70-byte key */
    put(&x, "d9 46");
    for (int i = 0; i < 70; i++) x.b[x.n++] = 'k';
    put(&x, "01");
    CHECK(!dec(&x, &e) && strstr(e.message, "key"));
    envelope(&x, 4, "ping"); /* empty key, key with a NUL */
    put(&x, "a0 01");
    CHECK(!dec(&x, &e) && strstr(e.message, "key"));
    envelope(&x, 4, "ping");
    put(&x, "a2 61 00 01");
    CHECK(!dec(&x, &e) && strstr(e.message, "control"));
    envelope(&x, 4, "ping"); /* invalid UTF-8 (overlong '/') */
    put_fixstr(&x, "x");
    put(&x, "a2 c0 af");
    CHECK(!dec(&x, &e) && strstr(e.message, "UTF-8"));
    envelope(&x, 4, "ping"); /* UTF-16 surrogate encoded in UTF-8 */
    put_fixstr(&x, "x");
    put(&x, "a3 ed a0 80");
    CHECK(!dec(&x, &e) && strstr(e.message, "UTF-8"));
    envelope(&x, 4, "ping"); /* valid multi-byte UTF-8 is fine */
    put_fixstr(&x, "x");
    put(&x, "a7 c3 a9 e2 82 ac f0 9f");
    CHECK(!dec(&x, &e)); /* a 4-byte sequence cut short inside the string */
    envelope(&x, 4, "ping");
    put_fixstr(&x, "x");
    put(&x, "a9 c3 a9 e2 82 ac f0 9f 98 80");
    cb_msg_t *m = dec(&x, &e);
    CHECK_MSG(m, "%s", e.message);
    cb_msg_destroy(&m);
}

TEST(envelope_errors) {
    cb_msg_error_t e;
    bytes_t x;
    /* missing id */
    x.n = 0;
    put(&x, "82");
    put_fixstr(&x, "v");
    put(&x, "01");
    put_fixstr(&x, "type");
    put_fixstr(&x, "ping");
    CHECK(!dec(&x, &e) && strstr(e.message, "'id'") && e.code == CB_ERR_BAD_REQUEST);
    /* missing type: the id is reported back */
    x.n = 0;
    put(&x, "82");
    put_fixstr(&x, "v");
    put(&x, "01");
    put_fixstr(&x, "id");
    put_fixstr(&x, "abc");
    CHECK(!dec(&x, &e) && strstr(e.message, "'type'") && strcmp(e.id, "abc") == 0);
    /* missing v */
    x.n = 0;
    put(&x, "82");
    put_fixstr(&x, "type");
    put_fixstr(&x, "ping");
    put_fixstr(&x, "id");
    put_fixstr(&x, "abc");
    CHECK(!dec(&x, &e) && strstr(e.message, "'v'") && strcmp(e.type, "ping") == 0);
    /* wrong version */
    envelope(&x, 3, "ping");
    x.b[3] = 0x02;
    CHECK(!dec(&x, &e) && strstr(e.message, "unsupported protocol version 2"));
    /* v as a string */
    x.n = 0;
    put(&x, "83");
    put_fixstr(&x, "v");
    put_fixstr(&x, "1");
    put_fixstr(&x, "type");
    put_fixstr(&x, "ping");
    put_fixstr(&x, "id");
    put_fixstr(&x, "a");
    CHECK(!dec(&x, &e) && strstr(e.message, "'v'"));
    /* type with characters outside [a-z0-9_] */
    envelope(&x, 3, "Ping");
    CHECK(!dec(&x, &e) && strstr(e.message, "'type'"));
    envelope(&x, 3, "");
    CHECK(!dec(&x, &e));
    /* id with a control character */
    envelope(&x, 3, "ping");
    x.b[x.n - 1] = '\n';
    CHECK(!dec(&x, &e) && strstr(e.message, "'id'"));
    /* id too long (65 bytes) */
    x.n = 0;
    put(&x, "83");
    put_fixstr(&x, "v");
    put(&x, "01");
    put_fixstr(&x, "type");
    put_fixstr(&x, "ping");
    put_fixstr(&x, "id");
    put(&x, "d9 41");
    for (int i = 0; i < 65; i++) x.b[x.n++] = 'i';
    CHECK(!dec(&x, &e) && strstr(e.message, "'id'"));
    /* duplicate id key */
    envelope(&x, 4, "ping");
    put_fixstr(&x, "id");
    put_fixstr(&x, "r2");
    CHECK(!dec(&x, &e));
    /* ok with a wrong type */
    envelope(&x, 4, "ping");
    put_fixstr(&x, "ok");
    put(&x, "01");
    CHECK(!dec(&x, &e) && strstr(e.message, "'ok'"));
    /* ok=false without error */
    envelope(&x, 4, "ping");
    put_fixstr(&x, "ok");
    put(&x, "c2");
    CHECK(!dec(&x, &e) && strstr(e.message, "error.code"));
    /* ok=false with error.code but no message */
    envelope(&x, 5, "ping");
    put_fixstr(&x, "ok");
    put(&x, "c2");
    put_fixstr(&x, "error");
    put(&x, "81");
    put_fixstr(&x, "code");
    put_fixstr(&x, "timeout");
    CHECK(!dec(&x, &e) && strstr(e.message, "message"));
    /* an unknown error code name decodes (forward compatibility) as internal */
    envelope(&x, 5, "ping");
    put_fixstr(&x, "ok");
    put(&x, "c2");
    put_fixstr(&x, "error");
    put(&x, "82");
    put_fixstr(&x, "code");
    put_fixstr(&x, "brand_new");
    put_fixstr(&x, "message");
    put_fixstr(&x, "m");
    cb_msg_t *m = dec(&x, &e);
    CHECK_MSG(m, "%s", e.message);
    CHECK(cb_msg_err_code(m) == CB_ERR_INTERNAL && strcmp(cb_msg_err_code_name(m), "brand_new") == 0);
    cb_msg_destroy(&m);
    /* an unknown message type decodes: the service answers unknown_type */
    envelope(&x, 3, "frobnicate");
    m = dec(&x, &e);
    CHECK(m && cb_msg_is_type(m, "frobnicate"));
    cb_msg_destroy(&m);
}

TEST(field_errors) {
    bytes_t x;
    envelope(&x, 10, "search");
    put_fixstr(&x, "k");
    put_fixstr(&x, "5"); /* wrong type */
    put_fixstr(&x, "q");
    put(&x, "a5 68 65 6c 6c 6f");
    put_fixstr(&x, "n");
    put(&x, "d0 9c"); /* -100 */
    put_fixstr(&x, "f");
    put(&x, "cb 7f f8 00 00 00 00 00 00"); /* NaN */
    put_fixstr(&x, "z");
    put(&x, "a3 61 00 62"); /* "a\0b" */
    put_fixstr(&x, "dup");
    put(&x, "01");
    put_fixstr(&x, "dup");
    put(&x, "02");
    cb_msg_error_t e;
    cb_msg_t *m = dec(&x, &e);
    CHECK_MSG(m, "%s", e.message);
    int64_t v;
    double d;
    const char *s;
    size_t n;
    bool b;
    const void *p;
    CHECK(!cb_msg_int(m, "k", 0, 10, &v) && strstr(cb_msg_last_error(m), "expected integer, got string"));
    CHECK(!cb_msg_int(m, "missing", 0, 10, &v) && strstr(cb_msg_last_error(m), "missing"));
    CHECK(!cb_msg_str(m, "q", 4, &s, &n) && strstr(cb_msg_last_error(m), "longer than the limit of 4"));
    CHECK(cb_msg_str(m, "q", 5, &s, &n) && n == 5);
    CHECK(!cb_msg_int(m, "n", 0, 10, &v) && strstr(cb_msg_last_error(m), "out of range"));
    CHECK(cb_msg_int(m, "n", -100, 10, &v) && v == -100);
    CHECK(!cb_msg_double(m, "f", -1e9, 1e9, &d) && strstr(cb_msg_last_error(m), "finite"));
    CHECK(!cb_msg_double(m, "q", 0, 1, &d));
    CHECK(!cb_msg_double(m, "n", 0, 1, &d) && strstr(cb_msg_last_error(m), "out of range"));
    CHECK(!cb_msg_str(m, "z", 10, &s, &n) && strstr(cb_msg_last_error(m), "NUL"));
    CHECK(!cb_msg_int(m, "dup", 0, 10, &v) && strstr(cb_msg_last_error(m), "duplicate"));
    CHECK(!cb_msg_has(m, "dup"));
    CHECK(!cb_msg_bool(m, "k", &b) && strstr(cb_msg_last_error(m), "expected boolean"));
    CHECK(!cb_msg_bin(m, "q", 10, &p, &n) && strstr(cb_msg_last_error(m), "expected binary"));
    CHECK(!cb_msg_map(m, "q") && strstr(cb_msg_last_error(m), "expected map"));
    CHECK(!cb_msg_array_len(m, "q", 10, &n) && strstr(cb_msg_last_error(m), "expected array"));
    CHECK(!cb_msg_at_str(m, "q", 0, 10, &s, &n));
    cb_msg_destroy(&m);
}

TEST(json_roundtrip) {
    json_error_t je;
    json_t *in = json_loads("{\"v\":1,\"type\":\"put\",\"id\":\"j1\",\"keys\":[\"ab\",\"cd\"],\"n\":-3,"
                            "\"r\":0.5,\"t\":true,\"z\":null,\"m\":{\"x\":[1,[2,{\"y\":\"\\u00e9\"}]]},"
                            "\"b\":{\"$bin\":\"00ff10\"}}",
                            0, &je);
    CHECK(in);
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_writer_reset(w);
    /* write the object as the top-level map by hand: begin with its envelope */
    cb_msg_begin(w, "put", "j1");
    const char *skip[] = {"v", "type", "id", NULL};
    const char *k;
    json_t *val;
    json_object_foreach(in, k, val) {
        int skipme = 0;
        for (int i = 0; skip[i]; i++) skipme |= strcmp(skip[i], k) == 0;
        if (!skipme) cb_msg_put_json(w, k, val);
    }
    size_t len;
    const void *data = cb_msg_end(w, &len);
    CHECK_MSG(data, "%s", cb_msg_writer_error(w));
    cb_msg_t *m = cb_msg_decode(data, len, NULL, 0);
    CHECK(m);
    const void *p;
    size_t n;
    CHECK(cb_msg_bin(m, "b", 10, &p, &n) && n == 3 && ((const unsigned char *)p)[1] == 0xff);
    json_t *out = cb_msg_to_json(m);
    CHECK(out);
    CHECK_MSG(json_equal(in, out), "%s", json_dumps(out, JSON_COMPACT));
    json_decref(out);
    /* relay: copy entries of the decoded message into a new one */
    cb_msg_begin(w, "put", "j2");
    cb_msg_put_entries(w, m, skip);
    data = cb_msg_end(w, &len);
    CHECK(data);
    cb_msg_t *m2 = cb_msg_decode(data, len, NULL, 0);
    CHECK(m2 && strcmp(cb_msg_id(m2), "j2") == 0);
    out = cb_msg_to_json(m2);
    json_object_set_new(out, "id", json_string("j1"));
    CHECK(json_equal(in, out));
    json_decref(out);
    cb_msg_destroy(&m2);
    cb_msg_destroy(&m);
    /* $bin with bad hex fails the writer */
    cb_msg_begin(w, "put", "j3");
    json_t *bad = json_pack("{s:s}", "$bin", "zz");
    cb_msg_put_json(w, "b", bad);
    CHECK(!cb_msg_end(w, &len) && cb_msg_writer_error(w));
    json_decref(bad);
    /* JSON nested deeper than the protocol allows fails the writer */
    json_t *deep = json_loads("[[[[[[[[[[1]]]]]]]]]]", 0, &je);
    cb_msg_begin(w, "put", "j4");
    cb_msg_put_json(w, "d", deep);
    CHECK(!cb_msg_end(w, &len) && strstr(cb_msg_writer_error(w), "nesting"));
    json_decref(deep);
    json_decref(in);
    cb_msg_writer_destroy(&w);
}

TEST(writer_misuse) {
    cb_msg_writer_t *w = cb_msg_writer_new();
    size_t len;
    cb_msg_put_int(w, "k", 1); /* before begin */
    CHECK(!cb_msg_end(w, &len) && cb_msg_writer_error(w));
    cb_msg_begin(w, "ping", "a");
    CHECK(!cb_msg_writer_error(w)); /* begin resets */
    cb_msg_put_int(w, NULL, 1);    /* no key in a map */
    CHECK(!cb_msg_end(w, &len));
    cb_msg_begin(w, "ping", "a");
    cb_msg_begin_array(w, "a");
    cb_msg_put_int(w, "k", 1); /* key in an array */
    CHECK(!cb_msg_end(w, &len));
    cb_msg_begin(w, "ping", "a");
    cb_msg_begin_array(w, "a");
    CHECK(!cb_msg_end(w, &len) && strstr(cb_msg_writer_error(w), "open"));
    cb_msg_begin(w, "ping", "a");
    cb_msg_end_array(w);
    CHECK(!cb_msg_end(w, &len));
    cb_msg_begin(w, "ping", "a");
    for (int i = 0; i < 8; i++) cb_msg_begin_array(w, i == 0 ? "a" : NULL);
    CHECK(!cb_msg_end(w, &len) && strstr(cb_msg_writer_error(w), "nesting"));
    cb_msg_begin(w, "Not valid", "a");
    CHECK(!cb_msg_end(w, &len));
    cb_msg_begin(w, "ping", "tab\there");
    CHECK(!cb_msg_end(w, &len));
    char longkey[80];
    memset(longkey, 'k', sizeof longkey - 1);
    longkey[79] = 0;
    cb_msg_begin(w, "ping", "a");
    cb_msg_put_int(w, longkey, 1);
    CHECK(!cb_msg_end(w, &len));
    /* the writer recovers after reset */
    cb_msg_begin(w, "ping", "a");
    CHECK(cb_msg_end(w, &len) && len > 0);
    cb_msg_writer_destroy(&w);
    cb_msg_writer_destroy(&w);
}

TEST(utf8) {
    CHECK(cb_msg_utf8_valid("", 0));
    CHECK(cb_msg_utf8_valid("plain", 5));
    CHECK(cb_msg_utf8_valid("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", 9));
    CHECK(!cb_msg_utf8_valid("\xc3", 1));
    CHECK(!cb_msg_utf8_valid("\xe0\x80\xaf", 3)); /* overlong */
    CHECK(!cb_msg_utf8_valid("\xf4\x90\x80\x80", 4)); /* > U+10FFFF */
    CHECK(!cb_msg_utf8_valid("\xff", 1));
    CHECK(!cb_msg_utf8_valid("\x80", 1));
}

/* Error reply messages built from hostile text stay valid UTF-8 and bounded. */
TEST(error_message_sanitized) {
    cb_msg_writer_t *w = cb_msg_writer_new();
    char big[3000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = 0;
    big[5] = (char)0xff;
    size_t len;
    const void *data = cb_msg_write_error(w, "x", "1", CB_ERR_BAD_REQUEST, &len, "%s", big);
    CHECK(data);
    cb_msg_t *m = cb_msg_decode(data, len, NULL, 0);
    CHECK(m && strlen(cb_msg_err_message(m)) <= CB_MSG_MAX_ERROR_MESSAGE && cb_msg_err_message(m)[5] == '?');
    cb_msg_destroy(&m);
    cb_msg_writer_destroy(&w);
}

int main(void) {
    RUN(roundtrip_request);
    RUN(optional_fields);
    RUN(reply_and_error_reply);
    RUN(error_names);
    RUN(truncated_every_prefix);
    RUN(trailing_bytes);
    RUN(non_map_top_level);
    RUN(deep_nesting);
    RUN(huge_counts);
    RUN(oversized_lengths);
    RUN(bad_bytes_and_keys);
    RUN(envelope_errors);
    RUN(field_errors);
    RUN(json_roundtrip);
    RUN(writer_misuse);
    RUN(utf8);
    RUN(error_message_sanitized);
    return test_summary();
}
