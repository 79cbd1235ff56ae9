/* test_kvremote: the shared KV tier on a real redis-server (kv/kvremote.h, kv/kvstore.h with a remote tier).
 *
 * Each test starts its own redis-server on a Unix socket in a temporary directory (--port 0, persistence
 * off) and skips when redis-server is not installed. The chunks come from a small synthetic model
 * (model/synth.h): computed by one store, shared through Redis with a second store whose kv_dir is empty,
 * which must get bit-identical KV and write a local copy with the same bytes. Corrupt values (a flipped
 * payload or header byte, a truncated value, another model's file, another chunk's file, a value over the
 * size bound) are misses, counted and deleted. A killed or stopped Redis costs at most the timeout, marks
 * the tier down, and the tier comes back after a restart and the recovery interval.
 */
#include <errno.h>
#include <fcntl.h>
#include <hiredis.h>
#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/clock.h"
#include "engine/engine.h"
#include "format/kvfile.h"
#include "kv/kvremote.h"
#include "kv/kvstore.h"
#include "model/model.h"
#include "model/synth.h"
#include "test.h"

#define TIMEOUT_MS 300
#define RECOVERY_MS 400
#define N_CTX 8
#define N_CHUNK 24

/* ---------------------------------------------------------------- redis-server */

typedef struct {
    char dir[64];      /* temporary directory: socket, log */
    char sock[128];
    pid_t pid;         /* 0: not running */
} redis_t;

static bool have_redis(void) {
    const char *path = getenv("PATH");
    if (!path) return false;
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *save = NULL, *d = strtok_r(buf, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        char p[4200];
        snprintf(p, sizeof p, "%s/redis-server", d);
        if (access(p, X_OK) == 0) return true;
    }
    return false;
}

/* Starts redis-server on r->sock (r->dir made first when empty); extra: one more "--opt value" pair or
 * NULL. Waits (at most 5 s) until the socket accepts a PING. 0, or -1. */
static int redis_start(redis_t *r, const char *opt, const char *val) {
    if (!r->dir[0]) {
        snprintf(r->dir, sizeof r->dir, "/tmp/test_kvremote.XXXXXX");
        if (!mkdtemp(r->dir)) return -1;
        snprintf(r->sock, sizeof r->sock, "%s/redis.sock", r->dir);
    }
    char logf[160];
    snprintf(logf, sizeof logf, "%s/redis.log", r->dir);
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        const char *argv[] = {"redis-server", "--port", "0", "--unixsocket", r->sock, "--unixsocketperm", "700",
                              "--save", "", "--appendonly", "no", "--dir", r->dir, "--logfile", logf,
                              "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru", opt, val, NULL};
        execvp("redis-server", (char *const *)argv);
        _exit(127);
    }
    r->pid = pid;
    for (double t0 = cb_now_ms(); cb_now_ms() - t0 < 5000;) {
        redisContext *c = redisConnectUnix(r->sock);
        if (c && !c->err) {
            redisReply *rep = redisCommand(c, "PING");
            bool ok = rep && (rep->type == REDIS_REPLY_STATUS || rep->type == REDIS_REPLY_ERROR); /* NOAUTH: up */
            if (rep) freeReplyObject(rep);
            redisFree(c);
            if (ok) return 0;
        } else if (c) {
            redisFree(c);
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            r->pid = 0;
            return -1;
        }
        usleep(20000);
    }
    return -1;
}

static void redis_kill(redis_t *r) {
    if (r->pid <= 0) return;
    kill(r->pid, SIGKILL);
    waitpid(r->pid, NULL, 0);
    r->pid = 0;
    unlink(r->sock);
}

static void redis_cleanup(redis_t *r) {
    redis_kill(r);
    if (!r->dir[0]) return;
    char p[200];
    snprintf(p, sizeof p, "%s/redis.log", r->dir);
    unlink(p);
    rmdir(r->dir);
    r->dir[0] = '\0';
}

/* A raw command on the test's own connection (blocking hiredis). The reply, or NULL; caller frees. */
static redisReply *raw(const redis_t *r, const char *fmt, const void *a, size_t al, const void *b, size_t bl) {
    redisContext *c = redisConnectUnix(r->sock);
    if (!c || c->err) {
        if (c) redisFree(c);
        return NULL;
    }
    redisReply *rep = b ? redisCommand(c, fmt, a, al, b, bl) : redisCommand(c, fmt, a, al);
    redisFree(c);
    return rep;
}

/* ---------------------------------------------------------------- model, stores, files */

static cb_model_t *g_model, *g_model2; /* g_model2: another model (other weights), same shape */
static cb_engine_t *g_eng, *g_eng2;
static uint8_t g_fp[32], g_fp2[32];
static char g_setup_err[512];
static int32_t g_ctx[N_CTX], g_chunk[2][N_CHUNK];

static cb_model_t *synth_model(uint64_t seed, char *err, size_t errlen) {
    cb_synth_shape_t s;
    memset(&s, 0, sizeof s);
    snprintf(s.name, sizeof s.name, "test-kvremote");
    s.n_layer = 2, s.n_embd = 64, s.n_head = 2, s.n_head_kv = 1, s.n_ff = 128, s.n_vocab = 1024, s.n_ctx = 256;
    s.rope_base = 10000.0f, s.rms_eps = 1e-5f, s.tied = true;
    char dir[64], path[128];
    snprintf(dir, sizeof dir, "/tmp/test_kvremote_model.XXXXXX");
    if (!mkdtemp(dir)) {
        snprintf(err, errlen, "mkdtemp: %s", strerror(errno));
        return NULL;
    }
    snprintf(path, sizeof path, "%s/synth.gguf", dir);
    cb_model_t *m = NULL;
    if (cb_synth_write(path, &s, CB_SYNTH_F32, seed, err, errlen) == 0) m = cb_model_load(path, err, errlen);
    unlink(path);
    rmdir(dir);
    return m;
}

static int setup(void) {
    if (g_eng) return 1;
    if (g_setup_err[0]) return 0;
    char err[256] = "";
    if (!(g_model = synth_model(7, err, sizeof err)) || !(g_model2 = synth_model(8, err, sizeof err))) {
        snprintf(g_setup_err, sizeof g_setup_err, "synthetic model: %s", err);
        return 0;
    }
    cb_engine_opts_t eo = {.max_ctx = 128, .kv_pool_seqs = 8};
    if (!(g_eng = cb_engine_new_opts(g_model, &eo, err, sizeof err)) ||
        !(g_eng2 = cb_engine_new_opts(g_model2, &eo, err, sizeof err))) {
        snprintf(g_setup_err, sizeof g_setup_err, "engine: %s", err);
        return 0;
    }
    cb_engine_set_threads(g_eng, 1);
    cb_engine_set_threads(g_eng2, 1);
    cb_model_fingerprint(g_model, g_fp);
    cb_model_fingerprint(g_model2, g_fp2);
    uint32_t x = 99;
    for (int i = 0; i < N_CTX; i++) g_ctx[i] = (int32_t)(300 + (x = x * 1664525u + 1013904223u) % 700);
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < N_CHUNK; i++) g_chunk[c][i] = (int32_t)(300 + (x = x * 1664525u + 1013904223u) % 700);
    return 1;
}

#define SETUP() CHECK_MSG(setup(), "setup: %s", g_setup_err)

static char *make_dir(char *buf, size_t cap) {
    snprintf(buf, cap, "/tmp/test_kvremote_kv.XXXXXX");
    return mkdtemp(buf);
}

static void rm_dir(const char *dir) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "  (could not remove %s)\n", dir);
}

/* The whole file at path (malloc'd, *len bytes), or NULL. */
static uint8_t *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = n > 0 ? malloc((size_t)n) : NULL;
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return b;
}

static cb_kvremote_t *remote_new(const redis_t *r, const char *password, size_t max_value) {
    char url[200], err[256] = "";
    snprintf(url, sizeof url, "unix://%s", r->sock);
    cb_kvremote_opts_t o;
    cb_kvremote_opts_default(&o);
    o.url = url;
    o.password = password;
    o.connect_timeout_ms = TIMEOUT_MS;
    o.timeout_ms = TIMEOUT_MS;
    o.recovery_ms = RECOVERY_MS;
    o.prefix = "test";
    if (max_value) o.max_value_bytes = max_value;
    cb_kvremote_t *k = cb_kvremote_new(&o, err, sizeof err);
    if (!k) fprintf(stderr, "  kvremote: %s\n", err);
    return k;
}

static cb_kvstore_t *store_new(cb_engine_t *e, const char *dir, cb_kvremote_t *remote) {
    char err[256] = "";
    cb_kvstore_t *s = cb_kvstore_new(e, dir, NULL, CB_KV_F16, err, sizeof err);
    if (!s) fprintf(stderr, "  kvstore: %s\n", err);
    else cb_kvstore_set_remote(s, remote);
    return s;
}

/* Loads chunk c through store s: its KV (caller releases), *src where it came from. */
static cb_kvmem_entry_t *load(cb_kvstore_t *s, int c, cb_kvstore_src_t *src, cb_kv_miss_t *why) {
    char err[256] = "";
    cb_kvmem_entry_t *e = cb_kvstore_load(s, g_ctx, N_CTX, g_chunk[c], N_CHUNK, src, why, err, sizeof err);
    if (!e) fprintf(stderr, "  load: %s\n", err);
    return e;
}

static bool same_kv(const cb_kvmem_entry_t *a, const cb_kvmem_entry_t *b, int n_layer) {
    if (cb_kvmem_entry_n_tokens(a) != cb_kvmem_entry_n_tokens(b)) return false;
    size_t bytes = (size_t)cb_kvmem_entry_n_tokens(a) * 32 * sizeof(float); /* kv_dim 32 */
    for (int l = 0; l < n_layer; l++)
        if (memcmp(cb_kvmem_entry_k(a, l), cb_kvmem_entry_k(b, l), bytes) ||
            memcmp(cb_kvmem_entry_v(a, l), cb_kvmem_entry_v(b, l), bytes))
            return false;
    return true;
}

static void chunk_path(const cb_kvstore_t *s, int c, char *path, size_t cap) {
    uint8_t key[32];
    cb_kvstore_chunk_key(s, g_ctx, N_CTX, g_chunk[c], N_CHUNK, key);
    cb_kvstore_path(s, key, path, cap);
}

/* ---------------------------------------------------------------- tests */

TEST(options) {
    char err[256];
    cb_kvremote_opts_t o;
    cb_kvremote_opts_default(&o);
    const char *bad[] = {"", "http://x:1", "redis://", "redis://:6379", "redis://h:0", "redis://h:70000",
                         "redis://h:12x", "redis://u:p@h:1", "redis://h:1/0", "unix://rel/path", "redis://[::1"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        o.url = bad[i];
        err[0] = '\0';
        cb_kvremote_t *k = cb_kvremote_new(&o, err, sizeof err);
        CHECK_MSG(!k && err[0], "url '%s' accepted", bad[i]);
    }
    o.url = "unix:///nonexistent/dir/redis.sock";
    o.prefix = "bad prefix";
    CHECK(!cb_kvremote_new(&o, err, sizeof err));
    o.prefix = "cb";
    o.timeout_ms = 0;
    CHECK(!cb_kvremote_new(&o, err, sizeof err));
    o.timeout_ms = TIMEOUT_MS;
    o.max_value_bytes = (size_t)1 << 40;
    CHECK(!cb_kvremote_new(&o, err, sizeof err));
    o.max_value_bytes = 1024;
    /* a server that is not there: made, down, calls fail at once, then are skipped */
    o.recovery_ms = 60000;
    cb_kvremote_t *k = cb_kvremote_new(&o, err, sizeof err);
    CHECK_MSG(k, "%s", err);
    CHECK(!cb_kvremote_up(k));
    uint8_t fp[32] = {1}, key[32] = {2}, *v = NULL;
    size_t len = 0;
    double t0 = cb_now_ms();
    CHECK(cb_kvremote_get(k, fp, key, &v, &len, err, sizeof err) == CB_KVREMOTE_DOWN && !v);
    CHECK(cb_kvremote_put(k, fp, key, "x", 1, err, sizeof err) == CB_KVREMOTE_DOWN);
    CHECK(cb_now_ms() - t0 < 50);
    CHECK(cb_kvremote_put(k, fp, key, "x", 2000, err, sizeof err) == CB_KVREMOTE_TOO_LARGE);
    char ks[CB_KVREMOTE_MAX_KEY];
    cb_kvremote_key(k, fp, key, ks, sizeof ks);
    CHECK(strlen(ks) == 2 + 1 + 64 + 1 + 64 && !strncmp(ks, "cb:01000000", 11));
    cb_kvremote_stats_t st;
    cb_kvremote_stats(k, &st);
    CHECK(st.errors == 1 && st.skipped == 2 && st.downs == 1 && !st.up);
    cb_kvremote_destroy(&k);
    CHECK(k == NULL);
    cb_kvremote_destroy(&k);
}

/* Commands on a live server: put, get, exists, del, and a value over the bound. */
TEST(commands) {
    if (!have_redis()) SKIP("redis-server is not installed");
    redis_t r = {0};
    CHECK_MSG(redis_start(&r, NULL, NULL) == 0, "redis-server did not start");
    cb_kvremote_t *k = remote_new(&r, NULL, 4096);
    uint8_t fp[32] = {9}, key[32] = {8}, *v = NULL, big[5000];
    memset(big, 0xab, sizeof big);
    size_t len = 0;
    char err[256] = "";
    bool ok = k && cb_kvremote_up(k);
    ok = ok && cb_kvremote_get(k, fp, key, &v, &len, err, sizeof err) == CB_KVREMOTE_MISS;
    ok = ok && cb_kvremote_exists(k, fp, key, err, sizeof err) == CB_KVREMOTE_MISS;
    ok = ok && cb_kvremote_put(k, fp, key, big, 4096, err, sizeof err) == CB_KVREMOTE_OK;
    ok = ok && cb_kvremote_exists(k, fp, key, err, sizeof err) == CB_KVREMOTE_OK;
    ok = ok && cb_kvremote_get(k, fp, key, &v, &len, err, sizeof err) == CB_KVREMOTE_OK && len == 4096 &&
         !memcmp(v, big, len);
    free(v);
    v = NULL;
    /* a value larger than this client's bound (written by someone else): refused, counted, not held */
    char ks[CB_KVREMOTE_MAX_KEY];
    cb_kvremote_key(k, fp, key, ks, sizeof ks);
    redisReply *rep = raw(&r, "SET %b %b", ks, strlen(ks), big, sizeof big);
    ok = ok && rep && rep->type == REDIS_REPLY_STATUS;
    if (rep) freeReplyObject(rep);
    ok = ok && cb_kvremote_get(k, fp, key, &v, &len, err, sizeof err) == CB_KVREMOTE_TOO_LARGE && !v;
    ok = ok && cb_kvremote_up(k); /* not a failure of the server: the next call reconnects */
    ok = ok && cb_kvremote_del(k, fp, key, err, sizeof err) == CB_KVREMOTE_OK;
    ok = ok && cb_kvremote_exists(k, fp, key, err, sizeof err) == CB_KVREMOTE_MISS;
    cb_kvremote_stats_t st;
    cb_kvremote_stats(k, &st);
    cb_kvremote_destroy(&k);
    redis_cleanup(&r);
    CHECK_MSG(ok, "%s", err);
    CHECK(st.hits == 1 && st.misses == 1 && st.corrupt == 1 && st.puts == 1 && st.errors == 0 && st.up);
    CHECK(st.bytes_read == 4096 && st.bytes_written == 4096);
}

/* AUTH: the right password works; a wrong one leaves the tier down. */
TEST(auth) {
    if (!have_redis()) SKIP("redis-server is not installed");
    redis_t r = {0};
    CHECK_MSG(redis_start(&r, "--requirepass", "s3cret") == 0, "redis-server did not start");
    cb_kvremote_t *good = remote_new(&r, "s3cret", 0), *bad = remote_new(&r, "wrong", 0), *none = remote_new(&r, NULL, 0);
    uint8_t fp[32] = {1}, key[32] = {1};
    char err[256] = "";
    bool ok = good && bad && none && cb_kvremote_up(good) && !cb_kvremote_up(bad);
    ok = ok && cb_kvremote_put(good, fp, key, "v", 1, err, sizeof err) == CB_KVREMOTE_OK;
    ok = ok && cb_kvremote_exists(bad, fp, key, err, sizeof err) == CB_KVREMOTE_DOWN;
    /* no password: the server answers NOAUTH, an error reply (the tier stays up, the call fails) */
    ok = ok && cb_kvremote_exists(none, fp, key, err, sizeof err) == CB_KVREMOTE_ERROR && strstr(err, "NOAUTH");
    cb_kvremote_destroy(&good);
    cb_kvremote_destroy(&bad);
    cb_kvremote_destroy(&none);
    redis_cleanup(&r);
    CHECK_MSG(ok, "%s", err);
}

/* A chunk computed by one store reaches another (empty kv_dir) through Redis: bit-identical KV, a local
 * copy with the same bytes, then a file hit; resolve marks it remote; ensure refills an emptied Redis. */
TEST(roundtrip) {
    SETUP();
    if (!have_redis()) SKIP("redis-server is not installed");
    redis_t r = {0};
    CHECK_MSG(redis_start(&r, NULL, NULL) == 0, "redis-server did not start");
    char da[64], db[64], dc[64];
    make_dir(da, sizeof da), make_dir(db, sizeof db), make_dir(dc, sizeof dc);
    cb_kvremote_t *k = remote_new(&r, NULL, 0);
    cb_kvstore_t *a = store_new(g_eng, da, k), *b = store_new(g_eng, db, k), *c = store_new(g_eng, dc, k);
    cb_kvstore_src_t sa = CB_KVSTORE_MEM, sb = CB_KVSTORE_MEM, sb2 = CB_KVSTORE_MEM;
    cb_kv_miss_t why = CB_KV_OK;
    cb_kvmem_entry_t *ea = a ? load(a, 0, &sa, &why) : NULL;
    cb_kvremote_stats_t s1, s2, s3;
    cb_kvremote_stats(k, &s1);
    cb_kvmem_entry_t *eb = b ? load(b, 0, &sb, &why) : NULL;
    cb_kvremote_stats(k, &s2);
    cb_kvmem_entry_t *eb2 = b ? load(b, 0, &sb2, &why) : NULL; /* now from its local copy */
    cb_kvremote_stats(k, &s3);
    char pa[4096] = "", pb[4096] = "";
    if (a && b) chunk_path(a, 0, pa, sizeof pa), chunk_path(b, 0, pb, sizeof pb);
    size_t la = 0, lb = 0;
    uint8_t *fa = read_all(pa, &la), *fb = read_all(pb, &lb);
    bool same_file = fa && fb && la == lb && !memcmp(fa, fb, la);
    free(fa);
    free(fb);
    /* resolve (cb-blend's path): a FILE marked remote, its local copy written */
    cb_kvstore_chunk_t rc;
    memset(&rc, 0, sizeof rc);
    char err[256] = "";
    int rrc = c ? cb_kvstore_set_context(c, g_ctx, N_CTX, err, sizeof err) : -1;
    if (rrc == 0) rrc = cb_kvstore_resolve(c, g_chunk[0], N_CHUNK, false, &rc, err, sizeof err);
    bool resolved = rrc == 0 && rc.src == CB_KVSTORE_FILE && rc.remote && rc.stored && rc.file;
    cb_kvstore_chunk_release(&rc);
    /* Redis restarted empty: ensure of a chunk on disk puts it back */
    redisReply *rep = raw(&r, "FLUSHALL", "", 0, NULL, 0);
    if (rep) freeReplyObject(rep);
    cb_kvstore_src_t se = CB_KVSTORE_COMPUTED;
    int erc = a ? cb_kvstore_ensure(a, g_ctx, N_CTX, g_chunk[0], N_CHUNK, &se, &why, err, sizeof err) : -1;
    uint8_t key[32];
    if (a) cb_kvstore_chunk_key(a, g_ctx, N_CTX, g_chunk[0], N_CHUNK, key);
    bool refilled = a && cb_kvremote_exists(k, g_fp, key, err, sizeof err) == CB_KVREMOTE_OK;
    bool same = ea && eb && eb2 && same_kv(ea, eb, 2) && same_kv(ea, eb2, 2);
    cb_kvmem_entry_release(&ea);
    cb_kvmem_entry_release(&eb);
    cb_kvmem_entry_release(&eb2);
    cb_kvstore_destroy(&a);
    cb_kvstore_destroy(&b);
    cb_kvstore_destroy(&c);
    cb_kvremote_destroy(&k);
    redis_cleanup(&r);
    rm_dir(da), rm_dir(db), rm_dir(dc);
    CHECK(sa == CB_KVSTORE_COMPUTED && s1.puts == 1 && s1.misses == 1 && s1.bytes_written > 0);
    CHECK(sb == CB_KVSTORE_FILE && s2.hits == 1 && s2.bytes_read == s1.bytes_written && s2.corrupt == 0);
    CHECK(sb2 == CB_KVSTORE_FILE && s3.hits == 1 && s3.misses == 1); /* the local copy: Redis not asked */
    CHECK_MSG(same, "the KV through Redis differs");
    CHECK_MSG(same_file, "the local copy's bytes differ from the original file's");
    CHECK_MSG(resolved, "resolve: %s", err);
    CHECK_MSG(erc == 0 && se == CB_KVSTORE_FILE && refilled, "ensure did not refill Redis: %s", err);
}

/* Puts raw value [len] under chunk 0's key, then loads chunk 0 through a store with an empty kv_dir: it
 * must be computed (the value a miss), counted corrupt, and the bad value replaced by the good one. */
static bool bad_value_is_miss(redis_t *r, cb_kvremote_t *k, const uint8_t *val, size_t len, const char *what) {
    char d[64];
    make_dir(d, sizeof d);
    cb_kvstore_t *s = store_new(g_eng, d, k);
    uint8_t key[32];
    cb_kvstore_chunk_key(s, g_ctx, N_CTX, g_chunk[0], N_CHUNK, key);
    char ks[CB_KVREMOTE_MAX_KEY];
    cb_kvremote_key(k, g_fp, key, ks, sizeof ks);
    redisReply *rep = raw(r, "SET %b %b", ks, strlen(ks), val, len);
    bool ok = rep && rep->type == REDIS_REPLY_STATUS;
    if (rep) freeReplyObject(rep);
    cb_kvremote_stats_t s0, s1;
    cb_kvremote_stats(k, &s0);
    cb_kvstore_src_t src = CB_KVSTORE_MEM;
    cb_kv_miss_t why = CB_KV_OK;
    cb_kvmem_entry_t *e = load(s, 0, &src, &why);
    cb_kvremote_stats(k, &s1);
    ok = ok && e && src == CB_KVSTORE_COMPUTED && s1.corrupt == s0.corrupt + 1 && s1.hits == s0.hits + 1;
    ok = ok && s1.puts == s0.puts + 1; /* the computed chunk replaced it */
    cb_kvmem_entry_release(&e);
    uint8_t *v = NULL;
    size_t vl = 0;
    char err[256];
    ok = ok && cb_kvremote_get(k, g_fp, key, &v, &vl, err, sizeof err) == CB_KVREMOTE_OK &&
         (vl != len || memcmp(v, val, len) != 0);
    free(v);
    cb_kvstore_destroy(&s);
    rm_dir(d);
    if (!ok) fprintf(stderr, "  %s: not a counted miss (src %s)\n", what, cb_kvstore_src_str(src));
    return ok;
}

TEST(corrupt) {
    SETUP();
    if (!have_redis()) SKIP("redis-server is not installed");
    redis_t r = {0};
    CHECK_MSG(redis_start(&r, NULL, NULL) == 0, "redis-server did not start");
    cb_kvremote_t *k = remote_new(&r, NULL, 0);
    /* the good file of chunk 0 and of chunk 1 (this model), and of chunk 0 by another model */
    char d[64], d2[64], p0[4096], p1[4096], p2[4096];
    make_dir(d, sizeof d), make_dir(d2, sizeof d2);
    cb_kvstore_t *s = store_new(g_eng, d, NULL), *s2 = store_new(g_eng2, d2, NULL);
    cb_kvstore_src_t src;
    cb_kv_miss_t why;
    cb_kvmem_entry_t *e0 = s ? load(s, 0, &src, &why) : NULL, *e1 = s ? load(s, 1, &src, &why) : NULL;
    cb_kvmem_entry_t *e2 = s2 ? load(s2, 0, &src, &why) : NULL;
    cb_kvmem_entry_release(&e0), cb_kvmem_entry_release(&e1), cb_kvmem_entry_release(&e2);
    size_t l0 = 0, l1 = 0, l2 = 0;
    uint8_t *f0 = NULL, *f1 = NULL, *f2 = NULL;
    if (s && s2) {
        chunk_path(s, 0, p0, sizeof p0), chunk_path(s, 1, p1, sizeof p1), chunk_path(s2, 0, p2, sizeof p2);
        f0 = read_all(p0, &l0), f1 = read_all(p1, &l1), f2 = read_all(p2, &l2);
    }
    bool ok = k && f0 && f1 && f2 && l0 > 256 && memcmp(g_fp, g_fp2, 32) != 0;
    uint8_t *m = ok ? malloc(l0) : NULL;
    if (ok && m) {
        memcpy(m, f0, l0);
        m[l0 - 7] ^= 0x40; /* a payload byte */
        ok = bad_value_is_miss(&r, k, m, l0, "payload byte flipped") && ok;
        memcpy(m, f0, l0);
        m[12] ^= 0x01; /* a header byte */
        ok = bad_value_is_miss(&r, k, m, l0, "header byte flipped") && ok;
        ok = bad_value_is_miss(&r, k, f0, l0 / 2, "truncated") && ok;
        ok = bad_value_is_miss(&r, k, f0, 10, "a stub") && ok;
        ok = bad_value_is_miss(&r, k, f2, l2, "another model's file") && ok;
        ok = bad_value_is_miss(&r, k, f1, l1, "another chunk's file") && ok;
        ok = bad_value_is_miss(&r, k, (const uint8_t *)"not a kv file at all", 20, "junk") && ok;
    }
    cb_kvremote_stats_t st;
    cb_kvremote_stats(k, &st);
    free(m), free(f0), free(f1), free(f2);
    cb_kvstore_destroy(&s), cb_kvstore_destroy(&s2);
    cb_kvremote_destroy(&k);
    redis_cleanup(&r);
    rm_dir(d), rm_dir(d2);
    CHECK(ok);
    CHECK(st.corrupt == 7 && st.errors == 0 && st.up);
}

/* Redis killed, then stopped (SIGSTOP): each call costs at most the timeout, the tier goes down (errors
 * counted, then calls skipped), chunks are computed; restarted, it is back after the recovery interval. */
TEST(down_and_back) {
    SETUP();
    if (!have_redis()) SKIP("redis-server is not installed");
    redis_t r = {0};
    CHECK_MSG(redis_start(&r, NULL, NULL) == 0, "redis-server did not start");
    cb_kvremote_t *k = remote_new(&r, NULL, 0);
    char d[64];
    make_dir(d, sizeof d);
    cb_kvstore_t *s = store_new(g_eng, d, k);
    bool ok = k && s && cb_kvremote_up(k);
    uint8_t fp[32] = {3}, key[32] = {4}, *v = NULL;
    size_t len = 0;
    char err[256] = "";
    ok = ok && cb_kvremote_put(k, fp, key, "v", 1, err, sizeof err) == CB_KVREMOTE_OK;
    redis_kill(&r);
    double t0 = cb_now_ms();
    cb_kvremote_rc_t g1 = k ? cb_kvremote_get(k, fp, key, &v, &len, err, sizeof err) : CB_KVREMOTE_OK;
    double dt1 = cb_now_ms() - t0;
    t0 = cb_now_ms();
    cb_kvremote_rc_t g2 = k ? cb_kvremote_get(k, fp, key, &v, &len, err, sizeof err) : CB_KVREMOTE_OK;
    double dt2 = cb_now_ms() - t0;
    cb_kvremote_stats_t sd;
    cb_kvremote_stats(k, &sd);
    /* the store goes on without it */
    cb_kvstore_src_t src = CB_KVSTORE_MEM;
    cb_kv_miss_t why;
    cb_kvmem_entry_t *e = s ? load(s, 0, &src, &why) : NULL;
    bool computed = e && src == CB_KVSTORE_COMPUTED;
    cb_kvmem_entry_release(&e);
    /* back: restarted (empty), and after the recovery interval a call reconnects */
    bool restarted = redis_start(&r, NULL, NULL) == 0;
    usleep((RECOVERY_MS + 50) * 1000);
    cb_kvremote_rc_t g3 = k ? cb_kvremote_get(k, fp, key, &v, &len, err, sizeof err) : CB_KVREMOTE_OK;
    bool back = cb_kvremote_up(k);
    /* a stopped server (alive, silent): the call times out within the bound, the tier goes down */
    if (r.pid > 0) kill(r.pid, SIGSTOP);
    t0 = cb_now_ms();
    cb_kvremote_rc_t g4 = k ? cb_kvremote_exists(k, fp, key, err, sizeof err) : CB_KVREMOTE_OK;
    double dt4 = cb_now_ms() - t0;
    bool down4 = !cb_kvremote_up(k);
    if (r.pid > 0) kill(r.pid, SIGCONT);
    usleep((RECOVERY_MS + 50) * 1000);
    cb_kvremote_rc_t g5 = k ? cb_kvremote_put(k, fp, key, "w", 1, err, sizeof err) : CB_KVREMOTE_ERROR;
    cb_kvremote_stats_t sb;
    cb_kvremote_stats(k, &sb);
    cb_kvstore_destroy(&s);
    cb_kvremote_destroy(&k);
    redis_cleanup(&r);
    rm_dir(d);
    CHECK_MSG(ok, "%s", err);
    CHECK_MSG(g1 == CB_KVREMOTE_ERROR && dt1 < 2 * TIMEOUT_MS + 100, "killed: %s in %.0f ms", cb_kvremote_rc_str(g1), dt1);
    CHECK_MSG(g2 == CB_KVREMOTE_DOWN && dt2 < 20, "down: %s in %.0f ms", cb_kvremote_rc_str(g2), dt2);
    CHECK(!v && sd.errors >= 1 && sd.skipped >= 1 && !sd.up && sd.downs == 1);
    CHECK(computed);
    CHECK(restarted);
    CHECK_MSG(g3 == CB_KVREMOTE_MISS && back, "back: %s", cb_kvremote_rc_str(g3));
    CHECK_MSG(g4 == CB_KVREMOTE_ERROR && dt4 >= TIMEOUT_MS - 20 && dt4 < TIMEOUT_MS + 300 && down4,
              "stopped: %s in %.0f ms", cb_kvremote_rc_str(g4), dt4);
    CHECK_MSG(g5 == CB_KVREMOTE_OK && sb.up && sb.downs == 2, "after SIGCONT: %s", cb_kvremote_rc_str(g5));
}

int main(void) {
    signal(SIGPIPE, SIG_DFL); /* a dead peer must not raise it (MSG_NOSIGNAL): the default would kill us */
    RUN(options);
    RUN(commands);
    RUN(auth);
    RUN(roundtrip);
    RUN(corrupt);
    RUN(down_and_back);
    cb_engine_destroy(&g_eng);
    cb_engine_destroy(&g_eng2);
    cb_model_destroy(&g_model);
    cb_model_destroy(&g_model2);
    return test_summary();
}
