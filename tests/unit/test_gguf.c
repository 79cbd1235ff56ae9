/* test_gguf: the GGUF reader against small files built in memory by a tiny writer below (v3 and v2),
 * every metadata getter and integer width, string arrays, tensors; then corrupt variants made by
 * patching single fields of a valid file (each must fail with a message, never crash), truncation at
 * every byte offset, random byte flips; and finally the real model when present. */
#include <stdint.h>
#include <string.h>

#include "base/clock.h"
#include "format/gguf.h"
#include "test.h"

/* ---------------------------------------------------------------- tiny writer */

typedef struct { uint8_t *p; size_t n, cap; } wb_t;

static void wb_put(wb_t *w, const void *src, size_t n) {
    if (w->n + n > w->cap) {
        w->cap = (w->n + n) * 2 + 64;
        w->p = realloc(w->p, w->cap);
        if (!w->p) abort();
    }
    memcpy(w->p + w->n, src, n);
    w->n += n;
}
static void w_u8(wb_t *w, uint8_t v) { wb_put(w, &v, 1); }
static void w_u32(wb_t *w, uint32_t v) { wb_put(w, &v, 4); }
static void w_u64(wb_t *w, uint64_t v) { wb_put(w, &v, 8); }
static void w_str(wb_t *w, const char *s) { w_u64(w, strlen(s)); wb_put(w, s, strlen(s)); }
static size_t w_key(wb_t *w, const char *key, uint32_t type) { /* returns the key text position */
    w_str(w, key);
    w_u32(w, type);
    return w->n - 4 - strlen(key);
}
static void w_pad(wb_t *w, size_t align) { while (w->n % align) w_u8(w, 0); }
static void patch32(wb_t *w, size_t at, uint32_t v) { memcpy(w->p + at, &v, 4); }
static void patch64(wb_t *w, size_t at, uint64_t v) { memcpy(w->p + at, &v, 8); }

/* Positions of the fields the corruption tests patch. */
typedef struct {
    size_t magic, version, n_tensors, n_kv;
    size_t key_u8, key_i8;             /* key text of "k.u8" and "k.i8" (same length) */
    size_t arch_len;                   /* u64 length of general.architecture's value */
    size_t f32_vtype;                  /* value type of "k.f32" */
    size_t bool_val;                   /* the byte of "k.bool" */
    size_t tok_elem_type, tok_count;   /* tokens array header */
    size_t tok_len1;                   /* u64 length of tokens[1] */
    size_t align_val;                  /* u32 value of general.alignment (when written) */
    size_t t_name[3], t_ndims[3], t_type[3], t_off[3];
    size_t data_start, off[3];
} layout_t;

#define N_T 3
static const char *T_NAMES[N_T] = {"w.a", "w.b", "w.c"};
static const uint32_t T_TYPES[N_T] = {CB_TYPE_F32, CB_TYPE_Q4_1, CB_TYPE_Q8_0};
static const uint32_t T_NDIMS[N_T] = {2, 1, 4};
static const uint64_t T_NE[N_T][4] = {{4, 2, 1, 1}, {64, 1, 1, 1}, {32, 1, 1, 2}};
static const size_t T_BYTES[N_T] = {32, 40, 68};
static const char *TOKENS[] = {"a", "bc", "", "d\xc3\xa9" "f"};

/* A valid file: the last tensor ends exactly at the end of the file. align = 0: no general.alignment. */
static layout_t build(wb_t *w, uint32_t version, uint32_t align) {
    layout_t L;
    memset(&L, 0, sizeof L);
    w->n = 0;
    L.magic = w->n; wb_put(w, "GGUF", 4);
    L.version = w->n; w_u32(w, version);
    L.n_tensors = w->n; w_u64(w, N_T);
    L.n_kv = w->n; w_u64(w, align ? 19 : 18);
    w_key(w, "general.architecture", CB_GGUF_STRING);
    L.arch_len = w->n; w_str(w, "llama");
    w_key(w, "llama.block_count", CB_GGUF_U32); w_u32(w, 30);
    L.key_u8 = w_key(w, "k.u8", CB_GGUF_U8); w_u8(w, 200);
    L.key_i8 = w_key(w, "k.i8", CB_GGUF_I8); w_u8(w, (uint8_t)(int8_t)-5);
    w_key(w, "k.u16", CB_GGUF_U16); { uint16_t v = 60000; wb_put(w, &v, 2); }
    w_key(w, "k.i16", CB_GGUF_I16); { int16_t v = -300; wb_put(w, &v, 2); }
    w_key(w, "k.u32", CB_GGUF_U32); w_u32(w, 4000000000u);
    w_key(w, "k.i32", CB_GGUF_I32); w_u32(w, (uint32_t)-2000000000);
    w_key(w, "k.u64", CB_GGUF_U64); w_u64(w, 5000000000ull);
    w_key(w, "k.u64big", CB_GGUF_U64); w_u64(w, (1ull << 63) + 1);
    w_key(w, "k.i64", CB_GGUF_I64); w_u64(w, (uint64_t)-6000000000ll);
    L.f32_vtype = w_key(w, "k.f32", CB_GGUF_F32) + 5; { float v = 0.5f; wb_put(w, &v, 4); }
    w_key(w, "k.f64", CB_GGUF_F64); { double v = 2.25; wb_put(w, &v, 8); }
    w_key(w, "k.bool", CB_GGUF_BOOL); L.bool_val = w->n; w_u8(w, 1);
    w_key(w, "tokenizer.ggml.tokens", CB_GGUF_ARRAY);
    L.tok_elem_type = w->n; w_u32(w, CB_GGUF_STRING);
    L.tok_count = w->n; w_u64(w, 4);
    for (int i = 0; i < 4; i++) {
        if (i == 1) L.tok_len1 = w->n;
        w_str(w, TOKENS[i]);
    }
    w_key(w, "k.arr_i32", CB_GGUF_ARRAY); w_u32(w, CB_GGUF_I32); w_u64(w, 3);
    for (int i = 1; i <= 3; i++) w_u32(w, (uint32_t)(i * -7));
    w_key(w, "k.arr_bool", CB_GGUF_ARRAY); w_u32(w, CB_GGUF_BOOL); w_u64(w, 2); w_u8(w, 0); w_u8(w, 1);
    w_key(w, "k.empty", CB_GGUF_ARRAY); w_u32(w, CB_GGUF_STRING); w_u64(w, 0);
    if (align) { w_key(w, "general.alignment", CB_GGUF_U32); L.align_val = w->n; w_u32(w, align); }
    size_t A = align ? align : 32, off = 0;
    for (int t = 0; t < N_T; t++) {
        L.off[t] = off;
        L.t_name[t] = w->n + 8;
        w_str(w, T_NAMES[t]);
        L.t_ndims[t] = w->n; w_u32(w, T_NDIMS[t]);
        for (uint32_t d = 0; d < T_NDIMS[t]; d++) w_u64(w, T_NE[t][d]);
        L.t_type[t] = w->n; w_u32(w, T_TYPES[t]);
        L.t_off[t] = w->n; w_u64(w, off);
        off = (off + T_BYTES[t] + A - 1) / A * A;
    }
    w_pad(w, A);
    L.data_start = w->n;
    for (int t = 0; t < N_T; t++) {
        while (w->n < L.data_start + L.off[t]) w_u8(w, 0);
        for (size_t i = 0; i < T_BYTES[t]; i++) w_u8(w, (uint8_t)(t * 50 + i));
    }
    return L;
}

/* Opens a private exact-size copy (so ASan sees any overread). */
static cb_gguf_t *open_copy(const uint8_t *p, size_t n, char *err, size_t errlen, uint8_t **copy) {
    *copy = malloc(n ? n : 1);
    if (n) memcpy(*copy, p, n);
    return cb_gguf_open_mem(*copy, n, err, errlen);
}

/* Expects a failure whose message contains `want`. */
#define EXPECT_FAIL(w, want) do { \
    char err_[512] = ""; uint8_t *c_; \
    cb_gguf_t *g_ = open_copy((w)->p, (w)->n, err_, sizeof err_, &c_); \
    bool bad_ = g_ != NULL; cb_gguf_destroy(&g_); free(c_); \
    CHECK_MSG(!bad_, "opened a bad file (expected '%s')", want); \
    CHECK_MSG(strstr(err_, want) != NULL, "message '%s' lacks '%s'", err_, want); \
} while (0)

/* ---------------------------------------------------------------- valid files */

static void check_valid(uint32_t version, uint32_t align) {
    wb_t w = {0};
    layout_t L = build(&w, version, align);
    char err[512];
    uint8_t *copy;
    cb_gguf_t *g = open_copy(w.p, w.n, err, sizeof err, &copy);
    free(w.p);
    CHECK_MSG(g, "%s", err);
    bool ok = true;
#define C(x) do { if (!(x)) { fprintf(stderr, "  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #x); ok = false; } } while (0)
    C(cb_gguf_version(g) == version);
    C(cb_gguf_alignment(g) == (align ? align : 32));
    C(cb_gguf_data_offset(g) == L.data_start);
    C(cb_gguf_n_kv(g) == (align ? 19u : 18u));
    const char *key;
    cb_gguf_vtype_t vt;
    C(cb_gguf_kv_info(g, 0, &key, &vt) && strcmp(key, "general.architecture") == 0 && vt == CB_GGUF_STRING);
    C(!cb_gguf_kv_info(g, 99, &key, &vt));
    const char *s;
    size_t len;
    C(cb_gguf_get_str(g, "general.architecture", &s, &len) && len == 5 && memcmp(s, "llama", 5) == 0);
    C(cb_gguf_has(g, "k.u8") && !cb_gguf_has(g, "k.u") && !cb_gguf_has(g, "k.u88") && !cb_gguf_has(g, ""));
    uint32_t u;
    int64_t i;
    C(cb_gguf_get_u32(g, "llama.block_count", &u) && u == 30);
    C(cb_gguf_get_u32(g, "k.u8", &u) && u == 200);
    C(!cb_gguf_get_u32(g, "k.i8", &u));
    C(cb_gguf_get_i64(g, "k.i8", &i) && i == -5);
    C(cb_gguf_get_u32(g, "k.u16", &u) && u == 60000);
    C(!cb_gguf_get_u32(g, "k.i16", &u) && cb_gguf_get_i64(g, "k.i16", &i) && i == -300);
    C(cb_gguf_get_u32(g, "k.u32", &u) && u == 4000000000u);
    C(cb_gguf_get_i64(g, "k.u32", &i) && i == 4000000000ll);
    C(!cb_gguf_get_u32(g, "k.i32", &u) && cb_gguf_get_i64(g, "k.i32", &i) && i == -2000000000);
    C(!cb_gguf_get_u32(g, "k.u64", &u) && cb_gguf_get_i64(g, "k.u64", &i) && i == 5000000000ll);
    C(!cb_gguf_get_i64(g, "k.u64big", &i) && !cb_gguf_get_u32(g, "k.u64big", &u));
    C(!cb_gguf_get_u32(g, "k.i64", &u) && cb_gguf_get_i64(g, "k.i64", &i) && i == -6000000000ll);
    C(!cb_gguf_get_u32(g, "k.f32", &u) && !cb_gguf_get_u32(g, "general.architecture", &u));
    C(!cb_gguf_get_u32(g, "k.bool", &u) && !cb_gguf_get_u32(g, "absent", &u));
    float f;
    C(cb_gguf_get_f32(g, "k.f32", &f) && f == 0.5f);
    C(cb_gguf_get_f32(g, "k.f64", &f) && f == 2.25f);
    C(!cb_gguf_get_f32(g, "k.u32", &f));
    bool b = false;
    C(cb_gguf_get_bool(g, "k.bool", &b) && b);
    C(!cb_gguf_get_bool(g, "k.u8", &b));
    C(!cb_gguf_get_str(g, "k.u8", &s, &len));
    cb_gguf_vtype_t et;
    size_t count;
    C(cb_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &count) && et == CB_GGUF_STRING && count == 4);
    for (size_t k = 0; k < 4; k++)
        C(cb_gguf_arr_str(g, "tokenizer.ggml.tokens", k, &s, &len) && len == strlen(TOKENS[k]) &&
          memcmp(s, TOKENS[k], len) == 0);
    C(!cb_gguf_arr_str(g, "tokenizer.ggml.tokens", 4, &s, &len));
    C(!cb_gguf_arr_str(g, "k.arr_i32", 0, &s, &len));
    C(!cb_gguf_arr_data(g, "tokenizer.ggml.tokens") && !cb_gguf_get_arr(g, "k.u8", &et, &count));
    C(cb_gguf_get_arr(g, "k.arr_i32", &et, &count) && et == CB_GGUF_I32 && count == 3);
    const uint8_t *ad = cb_gguf_arr_data(g, "k.arr_i32");
    C(ad != NULL);
    if (ad)
        for (int k = 0; k < 3; k++) {
            int32_t v;
            memcpy(&v, ad + 4 * k, 4);
            C(v == (k + 1) * -7);
        }
    C(cb_gguf_get_arr(g, "k.arr_bool", &et, &count) && et == CB_GGUF_BOOL && count == 2);
    C(cb_gguf_get_arr(g, "k.empty", &et, &count) && count == 0 && !cb_gguf_arr_str(g, "k.empty", 0, &s, &len));
    C(cb_gguf_n_tensors(g) == N_T);
    for (int t = 0; t < N_T; t++) {
        const cb_gguf_tensor_t *T = cb_gguf_tensor(g, (size_t)t);
        C(T && cb_gguf_find_tensor(g, T_NAMES[t]) == T);
        if (!T) continue;
        C(strcmp(T->name, T_NAMES[t]) == 0 && T->n_dims == T_NDIMS[t] && (uint32_t)T->type == T_TYPES[t]);
        for (int d = 0; d < 4; d++) C((uint64_t)T->ne[d] == T_NE[t][d]);
        C(T->nbytes == T_BYTES[t] && cb_gguf_tensor_offset(g, (size_t)t) == L.off[t]);
        C((const uint8_t *)T->data == copy + L.data_start + L.off[t]);
        C(((const uint8_t *)T->data)[0] == (uint8_t)(t * 50) && ((const uint8_t *)T->data)[T->nbytes - 1] ==
          (uint8_t)(t * 50 + T_BYTES[t] - 1));
    }
    C(!cb_gguf_tensor(g, N_T) && !cb_gguf_find_tensor(g, "w.d") && !cb_gguf_find_tensor(g, "w."));
#undef C
    cb_gguf_destroy(&g);
    CHECK(g == NULL);
    cb_gguf_destroy(&g); /* NULL-safe */
    free(copy);
    CHECK(ok);
}

TEST(test_valid_v3) { check_valid(3, 0); }
TEST(test_valid_v2) { check_valid(2, 0); }
TEST(test_valid_align64) { check_valid(3, 64); }
TEST(test_valid_align1) { check_valid(3, 1); }

TEST(test_type_traits) {
    CHECK(cb_type_block_elems(CB_TYPE_F32) == 1 && cb_type_block_bytes(CB_TYPE_F32) == 4);
    CHECK(cb_type_block_elems(CB_TYPE_F16) == 1 && cb_type_block_bytes(CB_TYPE_F16) == 2);
    CHECK(cb_type_block_elems(CB_TYPE_BF16) == 1 && cb_type_block_bytes(CB_TYPE_BF16) == 2);
    CHECK(cb_type_block_elems(CB_TYPE_Q4_0) == 32 && cb_type_block_bytes(CB_TYPE_Q4_0) == 18);
    CHECK(cb_type_block_elems(CB_TYPE_Q4_1) == 32 && cb_type_block_bytes(CB_TYPE_Q4_1) == 20);
    CHECK(cb_type_block_elems(CB_TYPE_Q8_0) == 32 && cb_type_block_bytes(CB_TYPE_Q8_0) == 34);
    CHECK(cb_type_block_elems(CB_TYPE_Q4_K) == 256 && cb_type_block_bytes(CB_TYPE_Q4_K) == 144);
    CHECK(cb_type_block_elems(CB_TYPE_Q6_K) == 256 && cb_type_block_bytes(CB_TYPE_Q6_K) == 210);
    CHECK(cb_type_block_elems(CB_TYPE_Q5_K) == 256 && cb_type_block_bytes(CB_TYPE_Q5_K) == 176);
    CHECK(cb_type_block_elems(7) == 0 && cb_type_block_bytes(6) == 22 && cb_type_block_bytes(11) == 0 && cb_type_block_elems(1000) == 0);
    CHECK(strcmp(cb_type_name(CB_TYPE_Q4_1), "Q4_1") == 0 && strcmp(cb_type_name(6), "Q5_0") == 0);
    CHECK(strcmp(cb_type_name(31), "unknown") == 0 && strcmp(cb_type_name(1u << 31), "unknown") == 0);
}

TEST(test_no_tensors_no_kv) {
    wb_t w = {0};
    wb_put(&w, "GGUF", 4); w_u32(&w, 3); w_u64(&w, 0); w_u64(&w, 0);
    char err[256];
    cb_gguf_t *g = cb_gguf_open_mem(w.p, w.n, err, sizeof err);
    free(w.p);
    CHECK_MSG(g, "%s", err);
    CHECK(cb_gguf_n_tensors(g) == 0 && cb_gguf_n_kv(g) == 0 && !cb_gguf_has(g, "x"));
    CHECK(!cb_gguf_find_tensor(g, "x"));
    cb_gguf_destroy(&g);
}

/* ---------------------------------------------------------------- bad files */

TEST(test_truncated_everywhere) {
    wb_t w = {0};
    build(&w, 3, 0);
    for (size_t n = 0; n < w.n; n++) {
        char err[512] = "";
        uint8_t *c;
        cb_gguf_t *g = open_copy(w.p, n, err, sizeof err, &c);
        bool opened = g != NULL;
        cb_gguf_destroy(&g);
        free(c);
        CHECK_MSG(!opened, "opened a file truncated to %zu of %zu bytes", n, w.n);
        CHECK_MSG(err[0] != '\0', "no message at %zu", n);
    }
    free(w.p);
}

TEST(test_bad_magic) {
    wb_t w = {0};
    build(&w, 3, 0);
    w.p[0] = 'X';
    EXPECT_FAIL(&w, "bad magic");
    free(w.p);
}

TEST(test_bad_versions) {
    wb_t w = {0};
    layout_t L = build(&w, 1, 0);
    EXPECT_FAIL(&w, "version 1");
    patch32(&w, L.version, 4);
    EXPECT_FAIL(&w, "unsupported version 4");
    patch32(&w, L.version, 0);
    EXPECT_FAIL(&w, "big-endian");
    patch32(&w, L.version, 0x03000000u); /* a byte-swapped 3 */
    EXPECT_FAIL(&w, "big-endian");
    free(w.p);
}

TEST(test_absurd_counts) {
    wb_t w = {0};
    layout_t L = build(&w, 3, 0);
    patch64(&w, L.n_tensors, 1ull << 60);
    EXPECT_FAIL(&w, "tensor count");
    patch64(&w, L.n_tensors, UINT64_MAX); /* -1 as int64 */
    EXPECT_FAIL(&w, "tensor count");
    patch64(&w, L.n_tensors, N_T);
    patch64(&w, L.n_kv, 1ull << 62);
    EXPECT_FAIL(&w, "kv count");
    patch64(&w, L.n_kv, 100); /* plausible by the byte bound, but the file ends first */
    char err[512];
    CHECK(!cb_gguf_open_mem(w.p, w.n, err, sizeof err));
    patch64(&w, L.n_kv, 17);  /* one kv too few: the tensor infos are misread */
    CHECK(!cb_gguf_open_mem(w.p, w.n, err, sizeof err));
    free(w.p);
}

TEST(test_string_beyond_file) {
    wb_t w = {0};
    layout_t L = build(&w, 3, 0);
    patch64(&w, L.arch_len, w.n); /* plausible-size string that runs past the end */
    EXPECT_FAIL(&w, "beyond end of file");
    patch64(&w, L.arch_len, 1ull << 40);
    EXPECT_FAIL(&w, "exceeds the limit");
    patch64(&w, L.arch_len, 5);
    patch64(&w, L.tok_len1, 1ull << 20);
    EXPECT_FAIL(&w, "element 1");
    patch64(&w, L.key_u8 - 8, UINT64_MAX); /* a key length */
    EXPECT_FAIL(&w, "kv 2 key");
    free(w.p);
}

TEST(test_array_beyond_file) {
    wb_t w = {0};
    layout_t L = build(&w, 3, 0);
    patch64(&w, L.tok_count, w.n / 8 + 1);
    EXPECT_FAIL(&w, "beyond end of file");
    patch64(&w, L.tok_count, (1ull << 30) + 1);
    EXPECT_FAIL(&w, "exceeds the limit");
    patch64(&w, L.tok_count, 1000); /* fits the byte bound, strings run out */
    char err[512];
    CHECK(!cb_gguf_open_mem(w.p, w.n, err, sizeof err));
    free(w.p);
}

TEST(test_unknown_value_type) {
    wb_t w = {0};
    layout_t L = build(&w, 3, 0);
    patch32(&w, L.f32_vtype, 13);
    EXPECT_FAIL(&w, "'k.f32': unknown value type 13");
    patch32(&w, L.f32_vtype, 0xFFFFFFFFu);
    EXPECT_FAIL(&w, "unknown value type");
    patch32(&w, L.f32_vtype, CB_GGUF_F32);
    patch32(&w, L.tok_elem_type, 77);
    EXPECT_FAIL(&w, "unknown array element type 77");
    free(w.p);
}

TEST(test_nested_array) {
    wb_t w = {0};
    layout_t L = build(&w, 3, 0);
    patch32(&w, L.tok_elem_type, CB_GGUF_ARRAY);
    EXPECT_FAIL(&w, "nested");
    free(w.p);
}

TEST(test_bad_bool) {
    wb_t w = {0};
    layout_t L = build(&w, 3, 0);
    w.p[L.bool_val] = 2;
    EXPECT_FAIL(&w, "not 0 or 1");
    free(w.p);
}

TEST(test_unknown_tensor_type) {
    wb_t w = {0};
    layout_t L = build(&w, 3, 0);
    patch32(&w, L.t_type[1], 7); /* Q5_1: a ggml type we do not support */
    EXPECT_FAIL(&w, "tensor 1 'w.b': unsupported tensor type id 7 (Q5_1)");
    patch32(&w, L.t_type[1], 4242);
    EXPECT_FAIL(&w, "type id 4242");
    free(w.p);
}

TEST(test_bad_dims) {
    wb_t w = {0};
    layout_t L = build(&w, 3, 0);
    patch32(&w, L.t_ndims[2], 5);
    EXPECT_FAIL(&w, "tensor 2 'w.c': n_dims 5");
    patch32(&w, L.t_ndims[2], 0);
    EXPECT_FAIL(&w, "n_dims 0");
    patch32(&w, L.t_ndims[2], 4);
    patch64(&w, L.t_ndims[2] + 4 + 8, UINT64_MAX); /* ne[1] = -1 */
    EXPECT_FAIL(&w, "negative");
    patch64(&w, L.t_ndims[2] + 4 + 8, 1ull << 40);
    patch64(&w, L.t_ndims[2] + 4 + 16, 1ull << 40); /* product overflows int64 */
    EXPECT_FAIL(&w, "overflow");
    patch64(&w, L.t_ndims[2] + 4 + 16, 1);
    EXPECT_FAIL(&w, "beyond end of file"); /* huge but representable */
    patch64(&w, L.t_ndims[2] + 4 + 8, 1);
    patch64(&w, L.t_ndims[2] + 4, 48); /* ne[0] not a multiple of 32 */
    EXPECT_FAIL(&w, "not a multiple of the Q8_0 block size 32");
    free(w.p);
}

TEST(test_duplicates) {
    wb_t w = {0};
    layout_t L = build(&w, 3, 0);
    w.p[L.key_u8 + 2] = 'i'; /* "k.u8" -> "k.i8" */
    EXPECT_FAIL(&w, "duplicate key 'k.i8'");
    w.p[L.key_u8 + 2] = 'u';
    w.p[L.t_name[2] + 2] = 'a'; /* "w.c" -> "w.a" */
    EXPECT_FAIL(&w, "duplicate tensor name 'w.a' (tensors 0 and 2)");
    w.p[L.t_name[2] + 2] = '\0';
    EXPECT_FAIL(&w, "NUL");
    free(w.p);
}

TEST(test_bad_offsets) {
    wb_t w = {0};
    layout_t L = build(&w, 3, 0);
    patch64(&w, L.t_off[1], L.off[1] + 4);
    EXPECT_FAIL(&w, "tensor 1 'w.b': offset 36 is not a multiple of the alignment 32");
    patch64(&w, L.t_off[1], L.off[2] + 32); /* aligned, runs past the end */
    EXPECT_FAIL(&w, "tensor 1 'w.b': data [");
    EXPECT_FAIL(&w, "beyond end of file");
    patch64(&w, L.t_off[1], UINT64_MAX - 31); /* aligned, offset + size overflows */
    EXPECT_FAIL(&w, "beyond end of file");
    free(w.p);
}

TEST(test_bad_alignment) {
    wb_t w = {0};
    layout_t L = build(&w, 3, 64);
    patch32(&w, L.align_val, 48);
    EXPECT_FAIL(&w, "general.alignment");
    patch32(&w, L.align_val, 0);
    EXPECT_FAIL(&w, "general.alignment");
    patch32(&w, L.align_val, 1u << 31);
    EXPECT_FAIL(&w, "general.alignment");
    patch32(&w, L.align_val - 4, CB_GGUF_F32); /* right bits, wrong type */
    patch32(&w, L.align_val, 64);
    EXPECT_FAIL(&w, "general.alignment");
    free(w.p);
}

/* Random byte flips and splices: no crash, no leak (meaningful under ASan). */
TEST(test_random_corruption) {
    wb_t w = {0};
    build(&w, 3, 0);
    uint32_t x = 99;
    int rounds = TEST_SANITIZED ? 3000 : 20000, opened = 0;
    uint8_t *buf = malloc(w.n);
    for (int r = 0; r < rounds; r++) {
        memcpy(buf, w.p, w.n);
        int flips = 1 + r % 4;
        for (int k = 0; k < flips; k++) {
            x = x * 1103515245u + 12345u;
            size_t at = (x >> 8) % w.n;
            x = x * 1103515245u + 12345u;
            buf[at] = (r & 1) ? (uint8_t)(x >> 16) : (uint8_t)(buf[at] ^ (1u << ((x >> 16) & 7)));
        }
        char err[256];
        cb_gguf_t *g = cb_gguf_open_mem(buf, w.n, err, sizeof err);
        if (g) {
            opened++;
            for (size_t i = 0; i < cb_gguf_n_kv(g); i++) {
                const char *key;
                cb_gguf_vtype_t t;
                cb_gguf_kv_info(g, i, &key, &t);
                CHECK(cb_gguf_has(g, key));
            }
            for (size_t i = 0; i < cb_gguf_n_tensors(g); i++) {
                const cb_gguf_tensor_t *T = cb_gguf_tensor(g, i);
                CHECK((const uint8_t *)T->data + T->nbytes <= buf + w.n);
                CHECK(cb_gguf_find_tensor(g, T->name) == T);
            }
        }
        cb_gguf_destroy(&g);
    }
    free(buf);
    free(w.p);
    fprintf(stderr, "  %d of %d corrupted files still opened (e.g. flips inside tensor data)\n", opened, rounds);
}

TEST(test_open_errors) {
    char err[256];
    CHECK(!cb_gguf_open("/nonexistent/x.gguf", err, sizeof err) && strstr(err, "cannot open"));
    CHECK(!cb_gguf_open("/", err, sizeof err) && strstr(err, "not a regular file"));
    CHECK(!cb_gguf_open_mem("", 0, err, sizeof err));
    CHECK(!cb_gguf_open_mem("GGU", 3, NULL, 0)); /* NULL err is fine */
}

/* ---------------------------------------------------------------- the real model */

TEST(test_real_model) {
    const char *path = test_model_path();
    if (!path) SKIP("model not present");
    char err[512];
    double t0 = cb_now_ms();
    cb_gguf_t *g = cb_gguf_open(path, err, sizeof err);
    double t1 = cb_now_ms();
    CHECK_MSG(g, "%s", err);
    fprintf(stderr, "  open: %.2f ms\n", t1 - t0);
    bool ok = true;
#define C(x) do { if (!(x)) { fprintf(stderr, "  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #x); ok = false; } } while (0)
    C(cb_gguf_version(g) == 3);
    const char *s;
    size_t len;
    C(cb_gguf_get_str(g, "general.architecture", &s, &len) && len == 5 && memcmp(s, "llama", 5) == 0);
    uint32_t u;
    C(cb_gguf_get_u32(g, "llama.block_count", &u) && u == 30);
    C(cb_gguf_get_u32(g, "llama.embedding_length", &u) && u == 576);
    size_t n = cb_gguf_n_tensors(g);
    C(n >= 270 && n <= 275);
    const cb_gguf_tensor_t *te = cb_gguf_find_tensor(g, "token_embd.weight");
    C(te && te->ne[0] == 576 && te->ne[1] == 49152);
    size_t hist[32] = {0};
    for (size_t i = 0; i < n; i++) hist[cb_gguf_tensor(g, i)->type & 31]++;
    fprintf(stderr, "  %zu tensors; token_embd.weight %s; types:", n, te ? cb_type_name(te->type) : "?");
    for (int k = 0; k < 32; k++)
        if (hist[k]) fprintf(stderr, " %s=%zu", cb_type_name((uint32_t)k), hist[k]);
    fprintf(stderr, "; output.weight %s\n", cb_gguf_find_tensor(g, "output.weight") ? "present" : "absent (tied)");
    cb_gguf_vtype_t et;
    size_t count;
    C(cb_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &count) && et == CB_GGUF_STRING && count == 49152);
    C(cb_gguf_arr_str(g, "tokenizer.ggml.tokens", 0, &s, &len) && len == 13 && memcmp(s, "<|endoftext|>", 13) == 0);
    C(cb_gguf_arr_str(g, "tokenizer.ggml.tokens", 49151, &s, &len) && len > 0);
    C(cb_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &count) && et == CB_GGUF_STRING && count == 48900);
#undef C
    cb_gguf_destroy(&g);
    CHECK(ok);
}

int main(void) {
    RUN(test_valid_v3);
    RUN(test_valid_v2);
    RUN(test_valid_align64);
    RUN(test_valid_align1);
    RUN(test_type_traits);
    RUN(test_no_tensors_no_kv);
    RUN(test_truncated_everywhere);
    RUN(test_bad_magic);
    RUN(test_bad_versions);
    RUN(test_absurd_counts);
    RUN(test_string_beyond_file);
    RUN(test_array_beyond_file);
    RUN(test_unknown_value_type);
    RUN(test_nested_array);
    RUN(test_bad_bool);
    RUN(test_unknown_tensor_type);
    RUN(test_bad_dims);
    RUN(test_duplicates);
    RUN(test_bad_offsets);
    RUN(test_bad_alignment);
    RUN(test_random_corruption);
    RUN(test_open_errors);
    RUN(test_real_model);
    return test_summary();
}
