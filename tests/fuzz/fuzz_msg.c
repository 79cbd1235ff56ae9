/* fuzz_msg: libFuzzer target for the wire decoder (libshared/msg): cb_msg_decode_ex on arbitrary
 * bytes, then every accessor on a set of field names the services use, JSON conversion, and a
 * re-encode of the decoded message that must decode again (the writer never produces what the
 * decoder rejects). Run: make fuzz && build/fuzz/fuzz_msg -max_total_time=60 -max_len=4096 */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wire/msg.h"

static const char *const s_keys[] = {"v", "type", "id", "ok", "error", "k", "query", "text", "keys", "hits",
                                     "contexts", "metrics", "chunk_id", "doc_id", "x", "a", ""};

static void poke(const cb_msg_t *m, int depth) {
    const char *s;
    size_t n, cnt;
    int64_t i64;
    double d;
    bool b;
    const void *p;
    for (size_t k = 0; k < sizeof s_keys / sizeof *s_keys; k++) {
        const char *key = s_keys[k];
        (void)cb_msg_has(m, key);
        (void)cb_msg_str(m, key, 64, &s, &n);
        (void)cb_msg_hex(m, key, 0, 128, &s, &n);
        (void)cb_msg_int(m, key, INT64_MIN, INT64_MAX, &i64);
        (void)cb_msg_int_or(m, key, -5, 5, 0, &i64);
        (void)cb_msg_double(m, key, -1e300, 1e300, &d);
        (void)cb_msg_bool(m, key, &b);
        (void)cb_msg_bin(m, key, 1 << 20, &p, &n);
        char buf[16];
        (void)cb_msg_str_copy(m, key, 100, buf, sizeof buf);
        if (cb_msg_array_len(m, key, 1u << 20, &cnt)) {
            const char *strs[8];
            size_t lens[8];
            int64_t ints[8];
            (void)cb_msg_str_array(m, key, 8, 32, strs, lens, &n);
            (void)cb_msg_int_array(m, key, 8, -1000, 1000, ints, &n);
            for (size_t i = 0; i < cnt && i < 4; i++) {
                (void)cb_msg_at_str(m, key, i, 16, &s, &n);
                (void)cb_msg_at_hex(m, key, i, 2, 64, &s, &n);
                (void)cb_msg_at_int(m, key, i, 0, 100, &i64);
                (void)cb_msg_at_bin(m, key, i, 16, &p, &n);
                const cb_msg_t *v = cb_msg_at_map(m, key, i);
                if (v && depth < 3) poke(v, depth + 1);
            }
            (void)cb_msg_at_str(m, key, cnt, 16, &s, &n); /* one past the end */
        }
        const cb_msg_t *v = cb_msg_map(m, key);
        if (v && depth < 3) poke(v, depth + 1);
    }
    (void)cb_msg_last_error(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cb_msg_error_t e;
    cb_msg_t *m = cb_msg_decode_ex(data, size, 1 << 16, &e);
    if (!m) {
        if (strlen(e.message) >= sizeof e.message || strlen(e.id) > CB_MSG_MAX_ID) abort();
        return 0;
    }
    (void)cb_msg_version(m);
    (void)cb_msg_type(m);
    (void)cb_msg_id(m);
    (void)cb_msg_is_reply(m);
    (void)cb_msg_ok(m);
    (void)cb_msg_err_code(m);
    (void)cb_msg_err_code_name(m);
    (void)cb_msg_err_message(m);
    poke(m, 0);

    json_t *j = cb_msg_to_json(m);
    if (j) {
        char *text = json_dumps(j, JSON_COMPACT);
        free(text);
        json_decref(j);
    }

    /* Re-encode: same envelope plus every other entry; the result must decode. */
    cb_msg_writer_t *w = cb_msg_writer_new();
    if (w) {
        static const char *const skip[] = {"v", "type", "id", NULL};
        cb_msg_begin(w, cb_msg_type(m), cb_msg_id(m));
        cb_msg_put_entries(w, m, skip);
        size_t len;
        const void *out = cb_msg_end(w, &len);
        /* the copy has the same entries as a message that decoded, so it must encode and decode */
        if (!out) abort();
        cb_msg_t *again = cb_msg_decode_ex(out, len, 1 << 20, &e);
        if (!again) abort();
        cb_msg_destroy(&again);
        cb_msg_writer_destroy(&w);
    }
    cb_msg_destroy(&m);
    return 0;
}
