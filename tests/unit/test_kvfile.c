/* test_kvfile: chunk KV files: keys, round trips per dtype, every corruption and truncation a miss
 * with the right reason, identity mismatches, interrupted writes, the temp-file sweep, and what else can
 * sit at a file's name (a FIFO, a symbolic link, a directory): a miss without waiting or following, then
 * replaced by the writer (a non-empty directory and a symbolic-link directory are refused). */
#include "format/kvfile.h"
#include "format/quant.h"
#include "test.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

/* A small geometry keeps the exhaustive loops fast; one test uses SmolLM2's (30 x 3 x 64). */
#define NL 4
#define NH 3
#define HD 8
#define KVD (NH * HD)
#define NT 13

static char g_dir[256];

static void setup_dir(void) {
    if (g_dir[0]) return;
    snprintf(g_dir, sizeof g_dir, "/tmp/test_kvfile.XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); exit(1); }
}

static void rm_rf(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[512];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode)) rm_rf(p);
        else unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static uint32_t rng_state = 12345;
static uint32_t rnd(void) { rng_state = rng_state * 1664525u + 1013904223u; return rng_state >> 8; }
static float rndf(void) { return ((float)(rnd() % 200001) - 100000.0f) / 25000.0f; } /* [-4, 4] */

typedef struct {
    cb_kv_meta_t meta;
    int n_tokens;
    int32_t *tokens;
    float *k, *v; /* [n_layer][n_tokens][kv_dim] */
    uint8_t key[32];
    char path[512];
} chunk_t;

static void chunk_init(chunk_t *c, int nl, int nh, int hd, int nt, cb_kv_dtype_t dt) {
    memset(c, 0, sizeof *c);
    for (int i = 0; i < 32; i++) { c->meta.model_fp[i] = (uint8_t)(i * 7 + 1); c->meta.ctx_fp[i] = (uint8_t)(i * 13 + 5); }
    c->meta.n_layer = nl;
    c->meta.n_head_kv = nh;
    c->meta.head_dim = hd;
    c->meta.dtype = dt;
    c->n_tokens = nt;
    c->tokens = malloc(sizeof(int32_t) * (size_t)nt);
    size_t n = (size_t)nl * (size_t)nt * (size_t)(nh * hd);
    c->k = malloc(n * sizeof(float));
    c->v = malloc(n * sizeof(float));
    for (int i = 0; i < nt; i++) c->tokens[i] = (int32_t)(rnd() % 49152);
    for (size_t i = 0; i < n; i++) { c->k[i] = rndf(); c->v[i] = rndf(); }
    cb_kvfile_key(c->meta.model_fp, c->meta.ctx_fp, c->tokens, nt, c->key);
    setup_dir();
    cb_kvfile_path(g_dir, c->key, c->path, sizeof c->path);
}

static void chunk_free(chunk_t *c) { free(c->tokens); free(c->k); free(c->v); }

static cb_kv_expect_t expect_of(const chunk_t *c) {
    cb_kv_expect_t e;
    memset(&e, 0, sizeof e);
    memcpy(e.model_fp, c->meta.model_fp, 32);
    memcpy(e.ctx_fp, c->meta.ctx_fp, 32);
    e.n_layer = c->meta.n_layer;
    e.n_head_kv = c->meta.n_head_kv;
    e.head_dim = c->meta.head_dim;
    e.tokens = c->tokens;
    e.n_tokens = c->n_tokens;
    return e;
}

static uint8_t *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)n + 1);
    *len = fread(b, 1, (size_t)n, f);
    fclose(f);
    return b;
}

static int spit(const char *path, const uint8_t *b, size_t len) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(b, 1, len, f);
    fclose(f);
    return w == len ? 0 : -1;
}

/* Opens buf with expect e; returns the reason (and, on success, compares all layers to c exactly). */
static cb_kv_miss_t open_mem_reason(const uint8_t *buf, size_t len, const cb_kv_expect_t *e) {
    cb_kv_miss_t why = CB_KV_MISS_COUNT_;
    char err[256];
    cb_kvfile_t *f = cb_kvfile_open_mem(buf, len, e, &why, err, sizeof err);
    if (f) { why = cb_kvfile_verify(f); cb_kvfile_destroy(&f); }
    return why;
}

TEST(test_key_and_names) {
    chunk_t c;
    chunk_init(&c, NL, NH, HD, NT, CB_KV_F16);
    uint8_t k0[32], k1[32];
    cb_kvfile_key(c.meta.model_fp, c.meta.ctx_fp, c.tokens, NT, k0);
    CHECK(memcmp(k0, c.key, 32) == 0);
    uint8_t fp[32];
    memcpy(fp, c.meta.model_fp, 32); fp[31] ^= 1;
    cb_kvfile_key(fp, c.meta.ctx_fp, c.tokens, NT, k1); CHECK(memcmp(k0, k1, 32) != 0);
    memcpy(fp, c.meta.ctx_fp, 32); fp[0] ^= 0x80;
    cb_kvfile_key(c.meta.model_fp, fp, c.tokens, NT, k1); CHECK(memcmp(k0, k1, 32) != 0);
    cb_kvfile_key(c.meta.model_fp, c.meta.ctx_fp, c.tokens, NT - 1, k1); CHECK(memcmp(k0, k1, 32) != 0);
    c.tokens[5] ^= 1;
    cb_kvfile_key(c.meta.model_fp, c.meta.ctx_fp, c.tokens, NT, k1); CHECK(memcmp(k0, k1, 32) != 0);
    c.tokens[5] ^= 1;
    int32_t t = c.tokens[0]; c.tokens[0] = c.tokens[1]; c.tokens[1] = t; /* order matters */
    cb_kvfile_key(c.meta.model_fp, c.meta.ctx_fp, c.tokens, NT, k1);
    CHECK(c.tokens[0] == c.tokens[1] || memcmp(k0, k1, 32) != 0);
    /* Known answer: BLAKE2b-256 of 64 zero bytes (model and context fingerprints zero, no tokens). */
    uint8_t z[32] = {0};
    char hex[CB_KV_HEX_BYTES];
    cb_kvfile_key(z, z, NULL, 0, k1);
    cb_kvfile_hex(k1, hex);
    CHECK_MSG(!strcmp(hex, "0eb923b0cbd24df54401d998531feead35a47a99f4deed205de4af81120f9761"), "%s", hex);
    /* ... and of bytes 0..63 followed by the int32 LE tokens 1, 2, -3 (Python hashlib reference). */
    uint8_t m[32], x[32];
    for (int i = 0; i < 32; i++) { m[i] = (uint8_t)i; x[i] = (uint8_t)(32 + i); }
    int32_t toks[3] = {1, 2, -3};
    cb_kvfile_key(m, x, toks, 3, k1);
    cb_kvfile_hex(k1, hex);
    CHECK_MSG(!strcmp(hex, "ec6885ea9d41ded581f52e99b1c464a1b1931e9d5091a455eb0c8d2ad0d7f029"), "%s", hex);
    /* hex round trip and path */
    uint8_t back[32];
    cb_kvfile_hex(k0, hex);
    CHECK(strlen(hex) == 64);
    CHECK(cb_kvfile_unhex(hex, back) == 0 && memcmp(back, k0, 32) == 0);
    CHECK(cb_kvfile_unhex("zz", back) == -1);
    hex[10] = 'g';
    CHECK(cb_kvfile_unhex(hex, back) == -1);
    char path[200], want[200];
    cb_kvfile_hex(k0, hex);
    CHECK(cb_kvfile_path("/kv", k0, path, sizeof path) == 0);
    snprintf(want, sizeof want, "/kv/%.2s/%s.kv", hex, hex);
    CHECK(!strcmp(path, want));
    CHECK(cb_kvfile_path("/kv", k0, path, 20) == -1);
    /* context fingerprint depends on model, tokens and their number */
    uint8_t c0[32], c1[32];
    cb_kvfile_ctx_fp(c.meta.model_fp, c.tokens, 4, c0);
    cb_kvfile_ctx_fp(c.meta.model_fp, c.tokens, 3, c1); CHECK(memcmp(c0, c1, 32) != 0);
    cb_kvfile_ctx_fp(z, c.tokens, 4, c1); CHECK(memcmp(c0, c1, 32) != 0);
    CHECK(!strcmp(cb_kv_miss_str(CB_KV_MISS_PAYLOAD_CHECKSUM), "payload_checksum"));
    CHECK(!strcmp(cb_kv_miss_str((cb_kv_miss_t)999), "unknown"));
    chunk_free(&c);
}

/* Writes c, reads it back, checks every value within tol (relative). */
static int roundtrip(chunk_t *c, double rel_tol, int use_layers) {
    char err[256];
    int rc;
    if (use_layers) {
        const float *kl[64], *vl[64];
        size_t per = (size_t)c->n_tokens * (size_t)(c->meta.n_head_kv * c->meta.head_dim);
        for (int l = 0; l < c->meta.n_layer; l++) { kl[l] = c->k + l * per; vl[l] = c->v + l * per; }
        rc = cb_kvfile_write_layers(c->path, &c->meta, c->tokens, c->n_tokens, kl, vl, err, sizeof err);
    } else {
        rc = cb_kvfile_write(c->path, &c->meta, c->tokens, c->n_tokens, c->k, c->v, err, sizeof err);
    }
    if (rc != 0) { fprintf(stderr, "  write: %s\n", err); return 0; }
    cb_kv_expect_t e = expect_of(c);
    cb_kv_miss_t why;
    cb_kvfile_t *f = cb_kvfile_open(c->path, &e, &why, err, sizeof err);
    if (!f) { fprintf(stderr, "  open: %s\n", err); return 0; }
    int ok = cb_kvfile_n_tokens(f) == c->n_tokens && why == CB_KV_OK &&
             memcmp(cb_kvfile_tokens(f), c->tokens, sizeof(int32_t) * (size_t)c->n_tokens) == 0 &&
             memcmp(cb_kvfile_key_of(f), c->key, 32) == 0 && cb_kvfile_meta(f)->dtype == c->meta.dtype &&
             cb_kvfile_meta(f)->n_layer == c->meta.n_layer;
    size_t per = (size_t)c->n_tokens * (size_t)(c->meta.n_head_kv * c->meta.head_dim);
    float *k = malloc(per * sizeof(float)), *v = malloc(per * sizeof(float));
    for (int l = 0; ok && l < c->meta.n_layer; l++) {
        if (cb_kvfile_read_layer(f, l, k, v) != CB_KV_OK) { ok = 0; break; }
        for (size_t i = 0; i < per && ok; i++) {
            float a = c->k[l * per + i], b = c->v[l * per + i];
            if (rel_tol == 0.0 ? (k[i] != a || v[i] != b)
                               : (fabs(k[i] - a) > rel_tol * fabs(a) + 1e-7 || fabs(v[i] - b) > rel_tol * fabs(b) + 1e-7)) {
                fprintf(stderr, "  layer %d elem %zu: %g vs %g, %g vs %g\n", l, i, k[i], a, v[i], b);
                ok = 0;
            }
        }
    }
    const void *rk, *rv;
    if (ok) ok = cb_kvfile_layer_raw(f, 0, &rk, &rv) == CB_KV_OK && ((uintptr_t)rk % 64) == 0 &&
                 ((uintptr_t)rv % 64) == 0;
    if (ok) ok = cb_kvfile_read_layer(f, c->meta.n_layer, k, v) == CB_KV_MISS_BAD_ARG &&
                 cb_kvfile_read_layer(f, -1, k, v) == CB_KV_MISS_BAD_ARG && cb_kvfile_verify(f) == CB_KV_OK;
    free(k);
    free(v);
    cb_kvfile_destroy(&f);
    return ok && f == NULL;
}

TEST(test_roundtrip_dtypes) {
    chunk_t c;
    chunk_init(&c, NL, NH, HD, NT, CB_KV_F32);
    CHECK(roundtrip(&c, 0.0, 0));
    chunk_free(&c);
    chunk_init(&c, NL, NH, HD, NT, CB_KV_F16);
    CHECK(roundtrip(&c, 1.0 / 2048, 1)); /* f16: 11-bit significand, round to nearest */
    chunk_free(&c);
    chunk_init(&c, NL, NH, HD, NT, CB_KV_BF16);
    CHECK(roundtrip(&c, 1.0 / 256, 0)); /* bf16: 8-bit significand */
    chunk_free(&c);
    /* SmolLM2-135M geometry: 30 layers x 3 KV heads x 64, f16 by default. */
    int nt = TEST_SANITIZED ? 17 : 100;
    chunk_init(&c, 30, 3, 64, nt, CB_KV_F16);
    CHECK(roundtrip(&c, 1.0 / 2048, 0));
    size_t len;
    uint8_t *b = slurp(c.path, &len);
    /* 4096 header+tokens page, then 30 layers of K+V f16 rows of 192, each record 64-byte aligned. */
    size_t rec = ((size_t)nt * 192 * 2 + 63) / 64 * 64;
    CHECK_MSG(len == 4096 + 30 * 2 * rec, "len %zu", len);
    free(b);
    chunk_free(&c);
}

/* Q8_0 files: every value within half a step of its block (d = max|x| / 127, rounded to f16), zero blocks
 * exact, both writers the same bytes, 34 bytes per 32 values; a kv_dim that is not a multiple of 32 refused. */
TEST(test_roundtrip_q8_0) {
    chunk_t c;
    chunk_init(&c, NL, 3, 32, NT, CB_KV_Q8_0);
    size_t per = (size_t)NT * 96;
    for (size_t i = 0; i < 32; i++) c.k[i] = 0.0f; /* one all-zero block */
    c.v[5] = 1000.0f;                              /* one block with an outlier */
    char err[256];
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == 0);
    size_t l1;
    uint8_t *a = slurp(c.path, &l1);
    cb_kv_expect_t e = expect_of(&c);
    cb_kv_miss_t why;
    cb_kvfile_t *f = cb_kvfile_open(c.path, &e, &why, err, sizeof err);
    CHECK(f && cb_kvfile_meta(f)->dtype == CB_KV_Q8_0 && cb_kvfile_layer_bytes(f) == (size_t)NT * 3 * 34);
    float *k = malloc(per * sizeof(float)), *v = malloc(per * sizeof(float));
    double worst = 0.0, sum_sq = 0.0;
    for (int l = 0; f && l < NL; l++) {
        CHECK(cb_kvfile_read_layer(f, l, k, v) == CB_KV_OK);
        for (int which = 0; which < 2; which++) {
            const float *x = (which ? c.v : c.k) + l * per, *y = which ? v : k;
            for (size_t b0 = 0; b0 < per; b0 += 32) {
                float amax = 0.0f;
                for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[b0 + i]));
                double d = cb_f16_to_f32(cb_f32_to_f16(amax / 127.0f));
                for (int i = 0; i < 32; i++) {
                    double err1 = fabs((double)y[b0 + i] - x[b0 + i]);
                    sum_sq += err1 * err1;
                    if (amax == 0.0f) CHECK(y[b0 + i] == 0.0f);
                    double r = d > 0 ? err1 / d : 0.0;
                    if (r > worst) worst = r;
                }
            }
        }
    }
    fprintf(stderr, "  q8_0: worst error %.3f of a step, rms %.4g (values in [-4, 4])\n", worst,
            sqrt(sum_sq / (2.0 * NL * per)));
    CHECK(worst <= 0.5 + 1e-3);
    cb_kvfile_destroy(&f);
    /* the other writer: the same bytes */
    const float *kl[NL], *vl[NL];
    for (int l = 0; l < NL; l++) { kl[l] = c.k + l * per; vl[l] = c.v + l * per; }
    CHECK(cb_kvfile_write_layers(c.path, &c.meta, c.tokens, NT, kl, vl, err, sizeof err) == 0);
    size_t l2;
    uint8_t *b = slurp(c.path, &l2);
    CHECK(l1 == l2 && memcmp(a, b, l1) == 0);
    free(a), free(b), free(k), free(v);
    chunk_free(&c);
    chunk_init(&c, NL, NH, HD, NT, CB_KV_Q8_0); /* kv_dim 24 */
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, "dtype") != NULL, "%s", err);
    chunk_free(&c);
    CHECK(cb_kv_row_bytes(CB_KV_Q8_0, 192) == 6 * 34 && cb_kv_row_bytes(CB_KV_F16, 192) == 384 &&
          cb_kv_row_bytes(CB_KV_Q8_0, 100) == 0 && cb_kv_row_bytes(7, 32) == 0);
    CHECK(cb_kv_dtype_parse("q8_0") == CB_KV_Q8_0 && cb_kv_dtype_parse("f16") == CB_KV_F16 &&
          cb_kv_dtype_parse("int8") == -1 && !strcmp(cb_kv_dtype_name(CB_KV_Q8_0), "q8_0"));
}

TEST(test_both_writers_same_bytes) {
    chunk_t c;
    chunk_init(&c, NL, NH, HD, NT, CB_KV_BF16);
    CHECK(roundtrip(&c, 1.0 / 256, 0));
    size_t l1, l2;
    uint8_t *a = slurp(c.path, &l1);
    CHECK(roundtrip(&c, 1.0 / 256, 1));
    uint8_t *b = slurp(c.path, &l2);
    int same = l1 == l2 && memcmp(a, b, l1) == 0;
    free(a);
    free(b);
    CHECK(same);
    chunk_free(&c);
}

/* Every single-byte change anywhere in the file is a miss; the reason depends on where it is. */
static void test_every_byte_flip_is_a_miss_of(cb_kv_dtype_t dt, int nh, int hd) {
    const int kvd = nh * hd;
    (void)kvd;
    chunk_t c;
    chunk_init(&c, NL, nh, hd, NT, dt);
    char err[256];
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == 0);
    size_t len;
    uint8_t *b = slurp(c.path, &len);
    cb_kv_expect_t e = expect_of(&c);
    CHECK(open_mem_reason(b, len, &e) == CB_KV_OK);
    size_t meta_end = 256 + ((NT * 4 + 7) / 8 * 8) + 8 * NL;
    int n_bad = 0;
    for (size_t off = 0; off < len; off++) {
        b[off] ^= 0x5a;
        cb_kv_miss_t want = off < 8 ? CB_KV_MISS_BAD_MAGIC : off < 12 ? CB_KV_MISS_BAD_VERSION
                          : off < meta_end ? CB_KV_MISS_HEADER_CHECKSUM : off < 4096 ? CB_KV_MISS_BAD_HEADER
                          : CB_KV_MISS_PAYLOAD_CHECKSUM;
        cb_kv_miss_t got = open_mem_reason(b, len, &e);
        if (got != want && n_bad++ < 5)
            fprintf(stderr, "  offset %zu: got %s, want %s\n", off, cb_kv_miss_str(got), cb_kv_miss_str(want));
        b[off] ^= 0x5a;
    }
    CHECK(n_bad == 0);
    /* Through a real file: a payload flip opens fine, then the layer read is a miss that leaves the
     * output untouched, while the other layers still read. */
    b[len - 1] ^= 1; /* last layer's padding or V */
    CHECK(spit(c.path, b, len) == 0);
    cb_kv_miss_t why;
    cb_kvfile_t *f = cb_kvfile_open(c.path, &e, &why, err, sizeof err);
    CHECK(f != NULL);
    float *k = malloc(sizeof(float) * NT * kvd), *v = malloc(sizeof(float) * NT * kvd);
    for (int i = 0; i < NT * kvd; i++) k[i] = v[i] = 42.0f;
    CHECK(cb_kvfile_read_layer(f, NL - 1, k, v) == CB_KV_MISS_PAYLOAD_CHECKSUM);
    CHECK(k[0] == 42.0f && v[NT * kvd - 1] == 42.0f);
    CHECK(cb_kvfile_read_layer(f, 0, k, v) == CB_KV_OK);
    CHECK(cb_kvfile_verify(f) == CB_KV_MISS_PAYLOAD_CHECKSUM);
    cb_kvfile_destroy(&f);
    b[len - 1] ^= 1;
    /* A header flip through a real file. */
    b[100] ^= 1;
    CHECK(spit(c.path, b, len) == 0);
    f = cb_kvfile_open(c.path, &e, &why, err, sizeof err);
    CHECK(f == NULL && why == CB_KV_MISS_HEADER_CHECKSUM);
    CHECK_MSG(strstr(err, "header_checksum") != NULL, "%s", err);
    free(b);
    free(k);
    free(v);
    chunk_free(&c);
}

TEST(test_every_byte_flip_is_a_miss) {
    test_every_byte_flip_is_a_miss_of(CB_KV_F16, NH, HD);
    test_every_byte_flip_is_a_miss_of(CB_KV_Q8_0, 3, 32); /* the compressed files: every case of the others (kv_dim 96: 3 blocks a row) */
}

static void test_truncation_and_trailing_of(cb_kv_dtype_t dt, int nh, int hd) {
    const int kvd = nh * hd;
    (void)kvd;
    chunk_t c;
    chunk_init(&c, NL, nh, hd, NT, dt);
    char err[256];
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == 0);
    size_t len;
    uint8_t *b = slurp(c.path, &len);
    cb_kv_expect_t e = expect_of(&c);
    int n_bad = 0;
    for (size_t n = 0; n < len; n++) {
        cb_kv_miss_t got = open_mem_reason(b, n, &e);
        if (got != CB_KV_MISS_TRUNCATED && n_bad++ < 5) fprintf(stderr, "  len %zu: %s\n", n, cb_kv_miss_str(got));
    }
    CHECK(n_bad == 0);
    /* Through real files, at a few offsets (with and without expectations). */
    size_t cuts[] = {0, 1, 7, 8, 11, 12, 255, 256, 300, 4095, 4096, 4097, len / 2, len - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        CHECK(spit(c.path, b, cuts[i]) == 0);
        cb_kv_miss_t why;
        cb_kvfile_t *f = cb_kvfile_open(c.path, i % 2 ? &e : NULL, &why, err, sizeof err);
        CHECK_MSG(f == NULL && why == CB_KV_MISS_TRUNCATED, "cut %zu: %s", cuts[i], err);
    }
    /* Trailing garbage (e.g. an old, longer file's tail) is a miss too. */
    uint8_t *b2 = malloc(len + 10);
    memcpy(b2, b, len);
    memset(b2 + len, 0, 10);
    CHECK(open_mem_reason(b2, len + 10, &e) == CB_KV_MISS_BAD_HEADER);
    free(b2);
    free(b);
    chunk_free(&c);
}

TEST(test_truncation_and_trailing) {
    test_truncation_and_trailing_of(CB_KV_F32, NH, HD);
    test_truncation_and_trailing_of(CB_KV_Q8_0, 3, 32); /* the compressed files: every case of the others (kv_dim 96: 3 blocks a row) */
}

static void test_identity_mismatches_of(cb_kv_dtype_t dt, int nh, int hd) {
    const int kvd = nh * hd;
    (void)kvd;
    chunk_t c;
    chunk_init(&c, NL, nh, hd, NT, dt);
    char err[256];
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == 0);
    cb_kv_miss_t why;
    cb_kvfile_t *f;
    cb_kv_expect_t e = expect_of(&c);
#define EXPECT_MISS(E, REASON) do { f = cb_kvfile_open(c.path, &(E), &why, err, sizeof err); \
        CHECK_MSG(f == NULL && why == (REASON), "got %s (%s)", cb_kv_miss_str(why), err); } while (0)
    e.model_fp[3] ^= 1; EXPECT_MISS(e, CB_KV_MISS_MODEL_MISMATCH); e.model_fp[3] ^= 1;
    e.ctx_fp[31] ^= 1;  EXPECT_MISS(e, CB_KV_MISS_CONTEXT_MISMATCH); e.ctx_fp[31] ^= 1;
    e.n_layer = NL + 1; EXPECT_MISS(e, CB_KV_MISS_GEOMETRY_MISMATCH); e.n_layer = NL;
    e.n_head_kv = 9;    EXPECT_MISS(e, CB_KV_MISS_GEOMETRY_MISMATCH); e.n_head_kv = nh;
    e.head_dim = 64;    EXPECT_MISS(e, CB_KV_MISS_GEOMETRY_MISMATCH); e.head_dim = hd;
    e.n_tokens = NT - 1; EXPECT_MISS(e, CB_KV_MISS_TOKENS_MISMATCH); e.n_tokens = NT;
    int32_t other[NT];
    memcpy(other, c.tokens, sizeof other);
    other[NT - 1] += 1;
    e.tokens = other;   EXPECT_MISS(e, CB_KV_MISS_TOKENS_MISMATCH); e.tokens = c.tokens;
    f = cb_kvfile_open(c.path, &e, &why, err, sizeof err);
    CHECK(f && why == CB_KV_OK);
    cb_kvfile_destroy(&f);
    cb_kvfile_destroy(&f); /* NULL-safe */
    cb_kvfile_destroy(NULL);
    /* Not found; a directory; a file under another key's name. */
    char p2[600];
    snprintf(p2, sizeof p2, "%s/nope.kv", g_dir);
    f = cb_kvfile_open(p2, &e, &why, err, sizeof err);
    CHECK(!f && why == CB_KV_MISS_NOT_FOUND);
    f = cb_kvfile_open(g_dir, &e, &why, err, sizeof err);
    CHECK(!f && why == CB_KV_MISS_NOT_REGULAR);
    size_t len;
    uint8_t *b = slurp(c.path, &len);
    uint8_t k2[32];
    memcpy(k2, c.key, 32);
    k2[0] ^= 1;
    CHECK(cb_kvfile_path(g_dir, k2, p2, sizeof p2) == 0);
    *strrchr(p2, '/') = 0;
    mkdir(p2, 0755);
    cb_kvfile_path(g_dir, k2, p2, sizeof p2);
    CHECK(spit(p2, b, len) == 0);
    f = cb_kvfile_open(p2, &e, &why, err, sizeof err);
    CHECK_MSG(!f && why == CB_KV_MISS_NAME_MISMATCH, "%s", err);
    unlink(p2);
    free(b);
    /* Integrity-only open (expect NULL) reads the identity from the file. */
    f = cb_kvfile_open(c.path, NULL, &why, err, sizeof err);
    CHECK(f && memcmp(cb_kvfile_meta(f)->model_fp, c.meta.model_fp, 32) == 0);
    CHECK(cb_kvfile_layer_bytes(f) == (size_t)NT * cb_kv_row_bytes(dt, (size_t)kvd));
    cb_kvfile_destroy(&f);
    chunk_free(&c);
#undef EXPECT_MISS
}

TEST(test_identity_mismatches) {
    test_identity_mismatches_of(CB_KV_F16, NH, HD);
    test_identity_mismatches_of(CB_KV_Q8_0, 3, 32); /* the compressed files: every case of the others (kv_dim 96: 3 blocks a row) */
}

static int count_tmp(const char *dir, char *found, size_t foundlen) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strstr(e->d_name, ".kv.tmp.")) { n++; snprintf(found, foundlen, "%s/%s", dir, e->d_name); }
    closedir(d);
    return n;
}

TEST(test_interrupted_write_and_sweep) {
    chunk_t c;
    chunk_init(&c, NL, NH, HD, NT, CB_KV_F16);
    char err[256], sub[600], tmp[900];
    snprintf(sub, sizeof sub, "%s", c.path);
    *strrchr(sub, '/') = 0;
    cb_kvfile_test_stop_before_rename(1);
    int rc = cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err);
    cb_kvfile_test_stop_before_rename(0);
    CHECK(rc == -1);
    cb_kv_expect_t e = expect_of(&c);
    cb_kv_miss_t why;
    cb_kvfile_t *f = cb_kvfile_open(c.path, &e, &why, err, sizeof err);
    CHECK(!f && why == CB_KV_MISS_NOT_FOUND); /* nothing under the final name */
    CHECK(count_tmp(sub, tmp, sizeof tmp) == 1);
    /* The complete temp file is never taken as a chunk, whatever name is used to open it. */
    f = cb_kvfile_open(tmp, &e, &why, err, sizeof err);
    CHECK_MSG(!f && why == CB_KV_MISS_NAME_MISMATCH, "%s", err);
    /* A crash mid-write leaves a partial temp file; copied under the final name it is still a miss. */
    size_t len;
    uint8_t *b = slurp(tmp, &len);
    CHECK(spit(c.path, b, len - 100) == 0);
    f = cb_kvfile_open(c.path, &e, &why, err, sizeof err);
    CHECK(!f && why == CB_KV_MISS_TRUNCATED);
    unlink(c.path);
    free(b);
    /* The startup sweep: young temp files stay (a write may be in flight), old ones go. */
    CHECK(cb_kvfile_sweep_tmp(g_dir, 3600, err, sizeof err) == 0);
    CHECK(count_tmp(sub, tmp, sizeof tmp) == 1);
    CHECK(cb_kvfile_sweep_tmp(g_dir, 0, err, sizeof err) == 1);
    CHECK(count_tmp(sub, tmp, sizeof tmp) == 0);
    CHECK(cb_kvfile_sweep_tmp("/nonexistent/kv", 0, err, sizeof err) == -1);
    /* A normal write now succeeds and leaves no temp file. */
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == 0);
    CHECK(count_tmp(sub, tmp, sizeof tmp) == 0);
    f = cb_kvfile_open(c.path, &e, &why, err, sizeof err);
    CHECK(f != NULL);
    cb_kvfile_destroy(&f);
    chunk_free(&c);
}

TEST(test_write_errors) {
    chunk_t c;
    chunk_init(&c, NL, NH, HD, NT, CB_KV_F16);
    char err[256];
    CHECK(cb_kvfile_write(NULL, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == -1);
    CHECK(cb_kvfile_write(c.path, NULL, c.tokens, NT, c.k, c.v, err, sizeof err) == -1);
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, 0, c.k, c.v, err, sizeof err) == -1);
    CHECK(cb_kvfile_write(c.path, &c.meta, NULL, NT, c.k, c.v, err, sizeof err) == -1);
    c.meta.dtype = (cb_kv_dtype_t)7;
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, "dtype") != NULL, "%s", err);
    c.meta.dtype = CB_KV_F16;
    c.meta.n_layer = 0;
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == -1);
    c.meta.n_layer = NL;
    const float *kl[NL] = {c.k, c.k, NULL, c.k}, *vl[NL] = {c.v, c.v, c.v, c.v};
    CHECK(cb_kvfile_write_layers(c.path, &c.meta, c.tokens, NT, kl, vl, err, sizeof err) == -1);
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == 0);
    /* An unwritable place: nothing is left behind and the error says why. */
    CHECK(cb_kvfile_write("/proc/kvfile-test/x.kv", &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == -1);
    CHECK(strlen(err) > 0);
    chunk_free(&c);
}

/* Random multi-byte corruption: every open/verify is either a miss or returns the original bytes. */
static void test_random_corruption_of(cb_kv_dtype_t dt, int nh, int hd) {
    const int kvd = nh * hd;
    (void)kvd;
    chunk_t c;
    chunk_init(&c, NL, nh, hd, NT, dt);
    char err[256];
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == 0);
    size_t len;
    uint8_t *orig = slurp(c.path, &len);
    uint8_t *b = malloc(len);
    cb_kv_expect_t e = expect_of(&c);
    int iters = TEST_SANITIZED ? 300 : 3000, accepted_changed = 0;
    for (int it = 0; it < iters; it++) {
        memcpy(b, orig, len);
        int nflip = 1 + (int)(rnd() % 4);
        for (int j = 0; j < nflip; j++) b[rnd() % len] = (uint8_t)rnd();
        int changed = memcmp(b, orig, len) != 0;
        size_t n = (rnd() % 8 == 0) ? rnd() % len : len;
        cb_kv_miss_t why = open_mem_reason(b, n, (it % 3) ? &e : NULL);
        if (why == CB_KV_OK && (changed || n != len)) accepted_changed++;
    }
    CHECK(accepted_changed == 0);
    free(b);
    free(orig);
    chunk_free(&c);
}

TEST(test_random_corruption) {
    test_random_corruption_of(CB_KV_BF16, NH, HD);
    test_random_corruption_of(CB_KV_Q8_0, 3, 32); /* the compressed files: every case of the others (kv_dim 96: 3 blocks a row) */
}

typedef struct { chunk_t *c; int rc; } writer_arg_t;
static void *writer(void *p) {
    writer_arg_t *a = p;
    char err[256];
    a->rc = 0;
    for (int i = 0; i < 10; i++)
        a->rc |= cb_kvfile_write(a->c->path, &a->c->meta, a->c->tokens, a->c->n_tokens, a->c->k, a->c->v, err, sizeof err);
    return NULL;
}

/* Two writers racing on one content key both succeed (unique temp names) and leave a valid file. */
TEST(test_concurrent_writers) {
    chunk_t c;
    chunk_init(&c, NL, NH, HD, NT, CB_KV_F16);
    pthread_t t1, t2;
    writer_arg_t a1 = {&c, -1}, a2 = {&c, -1};
    pthread_create(&t1, NULL, writer, &a1);
    pthread_create(&t2, NULL, writer, &a2);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    CHECK(a1.rc == 0 && a2.rc == 0);
    cb_kv_expect_t e = expect_of(&c);
    cb_kv_miss_t why;
    char err[256];
    cb_kvfile_t *f = cb_kvfile_open(c.path, &e, &why, err, sizeof err);
    CHECK(f && cb_kvfile_verify(f) == CB_KV_OK);
    cb_kvfile_destroy(&f);
    chunk_free(&c);
}

/* The file is a regular file with valid content. */
static int is_valid_regular(const chunk_t *c) {
    struct stat st;
    if (lstat(c->path, &st) != 0 || !S_ISREG(st.st_mode)) return 0;
    cb_kv_expect_t e = expect_of(c);
    cb_kv_miss_t why;
    char err[256];
    cb_kvfile_t *f = cb_kvfile_open(c->path, &e, &why, err, sizeof err);
    int ok = f && cb_kvfile_verify(f) == CB_KV_OK;
    cb_kvfile_destroy(&f);
    return ok;
}

static cb_kv_miss_t open_reason(const chunk_t *c, char *err, size_t errlen) {
    cb_kv_expect_t e = expect_of(c);
    cb_kv_miss_t why = CB_KV_OK;
    cb_kvfile_t *f = cb_kvfile_open(c->path, &e, &why, err, errlen);
    cb_kvfile_destroy(&f);
    return why;
}

static void on_alarm(int sig) {
    (void)sig;
    static const char m[] = "test_kvfile: an open or a write hung on a special file\n";
    (void)!write(2, m, sizeof m - 1);
    _exit(3);
}

/* A FIFO, a symbolic link (to a FIFO, to a valid file) or a directory at a KV file's name: the reader
 * gives NOT_REGULAR at once (never waits for a FIFO writer, never follows a link); the writer replaces a
 * FIFO or a link (never writing through it: the link's target is unchanged) and removes an empty
 * directory; a non-empty directory stays and the write fails with a clear message. */
TEST(test_special_files_at_the_name) {
    signal(SIGALRM, on_alarm);
    alarm(20); /* a hang fails the program instead of blocking the suite */
    chunk_t c;
    chunk_init(&c, NL, NH, HD, NT, CB_KV_F16);
    char err[512], dir[512], other[600], fifo[600];
    snprintf(dir, sizeof dir, "%s", c.path);
    *strrchr(dir, '/') = 0;
    mkdir(dir, 0755);
    snprintf(fifo, sizeof fifo, "%s/a.fifo", g_dir);
    snprintf(other, sizeof other, "%s/outside.kv", g_dir);
    /* 1. a FIFO at the name */
    unlink(c.path);
    CHECK(mkfifo(c.path, 0644) == 0);
    CHECK_MSG(open_reason(&c, err, sizeof err) == CB_KV_MISS_NOT_REGULAR, "%s", err);
    CHECK_MSG(strstr(err, "FIFO") != NULL, "%s", err);
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == 0);
    CHECK(is_valid_regular(&c));
    /* 2. a symbolic link to a FIFO */
    unlink(c.path);
    CHECK(mkfifo(fifo, 0644) == 0);
    CHECK(symlink(fifo, c.path) == 0);
    CHECK_MSG(open_reason(&c, err, sizeof err) == CB_KV_MISS_NOT_REGULAR, "%s", err);
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == 0);
    CHECK(is_valid_regular(&c));
    struct stat st;
    CHECK(lstat(fifo, &st) == 0 && S_ISFIFO(st.st_mode)); /* the target is untouched */
    /* 3. a symbolic link to a valid file elsewhere: not followed on read, replaced (not written through) */
    size_t len;
    uint8_t *b = slurp(c.path, &len);
    CHECK(b && spit(other, b, len) == 0);
    unlink(c.path);
    CHECK(symlink(other, c.path) == 0);
    CHECK_MSG(open_reason(&c, err, sizeof err) == CB_KV_MISS_NOT_REGULAR, "%s", err);
    CHECK(truncate(other, 100) == 0); /* so that a write through the link would show */
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == 0);
    CHECK(is_valid_regular(&c));
    CHECK(stat(other, &st) == 0 && st.st_size == 100);
    free(b);
    /* 4. an empty directory at the name: removed, the file written */
    unlink(c.path);
    CHECK(mkdir(c.path, 0755) == 0);
    CHECK(open_reason(&c, err, sizeof err) == CB_KV_MISS_NOT_REGULAR);
    CHECK_MSG(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == 0, "%s", err);
    CHECK(is_valid_regular(&c));
    /* 5. a non-empty directory: left alone, a clear failure, no temporary file left */
    unlink(c.path);
    char inner[700];
    CHECK(mkdir(c.path, 0755) == 0);
    snprintf(inner, sizeof inner, "%s/keep", c.path);
    CHECK(spit(inner, (const uint8_t *)"x", 1) == 0);
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, "not empty") != NULL, "%s", err);
    CHECK(stat(inner, &st) == 0);
    char tmp[1400];
    DIR *d = opendir(dir);
    int n_tmp = 0;
    struct dirent *de;
    while (d && (de = readdir(d)) != NULL) n_tmp += strstr(de->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    CHECK(n_tmp == 0);
    unlink(inner);
    rmdir(c.path);
    /* 6. the shard directory is a symbolic link: nothing is written through it */
    char real[700];
    snprintf(real, sizeof real, "%s/realshard", g_dir);
    CHECK(mkdir(real, 0755) == 0);
    unlink(c.path);
    CHECK(rmdir(dir) == 0);
    CHECK(symlink(real, dir) == 0);
    CHECK(cb_kvfile_write(c.path, &c.meta, c.tokens, NT, c.k, c.v, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, "symbolic link") != NULL, "%s", err);
    snprintf(tmp, sizeof tmp, "%s/%s", real, strrchr(c.path, '/') + 1);
    CHECK(lstat(tmp, &st) != 0);
    unlink(dir);
    rmdir(real);
    unlink(fifo);
    unlink(other);
    alarm(0);
    chunk_free(&c);
}

int main(void) {
    RUN(test_key_and_names);
    RUN(test_roundtrip_dtypes);
    RUN(test_roundtrip_q8_0);
    RUN(test_both_writers_same_bytes);
    RUN(test_every_byte_flip_is_a_miss);
    RUN(test_truncation_and_trailing);
    RUN(test_identity_mismatches);
    RUN(test_interrupted_write_and_sweep);
    RUN(test_write_errors);
    RUN(test_random_corruption);
    RUN(test_concurrent_writers);
    RUN(test_special_files_at_the_name);
    rm_rf(g_dir);
    return test_summary();
}
