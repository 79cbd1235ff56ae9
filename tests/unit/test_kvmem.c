/* test_kvmem: the in-memory KV tier: entries, LRU order under a byte budget, counters, references
 * that outlive eviction, decoding from a kv file, and many threads at once. */
#include "format/kvfile.h"
#include "kv/kvmem.h"
#include "test.h"

#include <pthread.h>
#include <unistd.h>

#define NL 3
#define NH 2
#define HD 4
#define NT 5
#define PER (NT * NH * HD)

static void key_of(int i, uint8_t key[32]) {
    uint8_t fp[32] = {0};
    int32_t t = i;
    cb_kvfile_key(fp, fp, &t, 1, key);
}

/* An entry whose every value is `val` and whose tokens are val, val+1, ... */
static cb_kvmem_entry_t *make_entry(float val) {
    cb_kvmem_entry_t *e = cb_kvmem_entry_new(NL, NH, HD, NT);
    if (!e) return NULL;
    for (int i = 0; i < NT; i++) cb_kvmem_entry_tokens_mut(e)[i] = (int32_t)val + i;
    for (int l = 0; l < NL; l++)
        for (int i = 0; i < PER; i++) { cb_kvmem_entry_k_mut(e, l)[i] = val; cb_kvmem_entry_v_mut(e, l)[i] = -val; }
    return e;
}

static int entry_is(const cb_kvmem_entry_t *e, float val) {
    for (int l = 0; l < NL; l++)
        for (int i = 0; i < PER; i++)
            if (cb_kvmem_entry_k(e, l)[i] != val || cb_kvmem_entry_v(e, l)[i] != -val) return 0;
    return cb_kvmem_entry_tokens(e)[NT - 1] == (int32_t)val + NT - 1;
}

TEST(test_entry_basics) {
    CHECK(cb_kvmem_entry_new(0, NH, HD, NT) == NULL);
    CHECK(cb_kvmem_entry_new(NL, NH, HD, 0) == NULL);
    CHECK(cb_kvmem_entry_new(NL, 2000, HD, NT) == NULL);
    cb_kvmem_entry_t *e = make_entry(3.0f);
    CHECK(e != NULL);
    CHECK(cb_kvmem_entry_n_layer(e) == NL && cb_kvmem_entry_n_head_kv(e) == NH && cb_kvmem_entry_head_dim(e) == HD &&
          cb_kvmem_entry_n_tokens(e) == NT);
    CHECK(cb_kvmem_entry_bytes(e) >= (size_t)NL * 2 * PER * sizeof(float));
    CHECK(cb_kvmem_entry_k(e, NL) == NULL && cb_kvmem_entry_v(e, -1) == NULL);
    CHECK(((uintptr_t)cb_kvmem_entry_k(e, 0) % 64) == 0);
    CHECK(cb_kvmem_entry_v(e, 0) == cb_kvmem_entry_k(e, 0) + PER && cb_kvmem_entry_k(e, 1) == cb_kvmem_entry_v(e, 0) + PER);
    CHECK(entry_is(e, 3.0f));
    cb_kvmem_entry_t *e2 = cb_kvmem_entry_ref(e);
    cb_kvmem_entry_release(&e);
    CHECK(e == NULL && entry_is(e2, 3.0f)); /* still alive through e2 */
    cb_kvmem_entry_release(&e2);
    cb_kvmem_entry_release(&e2); /* NULL-safe */
    cb_kvmem_entry_release(NULL);
}

TEST(test_lru_and_counters) {
    cb_kvmem_entry_t *probe = make_entry(0);
    size_t eb = cb_kvmem_entry_bytes(probe);
    cb_kvmem_entry_release(&probe);
    cb_kvmem_t *c = cb_kvmem_new(3 * eb); /* room for three */
    CHECK(c != NULL);
    uint8_t k[6][32];
    for (int i = 0; i < 6; i++) key_of(i, k[i]);
    for (int i = 0; i < 3; i++) {
        cb_kvmem_entry_t *e = make_entry((float)i);
        CHECK(cb_kvmem_put(c, k[i], e) == 0);
        cb_kvmem_entry_release(&e);
    }
    cb_kvmem_entry_t *g = cb_kvmem_get(c, k[0]); /* 0 becomes the most recent: order 0, 2, 1 */
    CHECK(g && entry_is(g, 0.0f));
    cb_kvmem_entry_release(&g);
    CHECK(cb_kvmem_get(c, k[5]) == NULL);
    cb_kvmem_entry_t *e = make_entry(3.0f);
    CHECK(cb_kvmem_put(c, k[3], e) == 0); /* evicts 1, the least recent */
    cb_kvmem_entry_release(&e);
    CHECK(cb_kvmem_contains(c, k[0]) && !cb_kvmem_contains(c, k[1]) && cb_kvmem_contains(c, k[2]) &&
          cb_kvmem_contains(c, k[3]));
    cb_kvmem_stats_t st;
    cb_kvmem_stats(c, &st);
    CHECK_MSG(st.hits == 1 && st.misses == 1 && st.inserts == 4 && st.evictions == 1 && st.entries == 3 &&
              st.bytes == 3 * eb && st.budget == 3 * eb,
              "hits %llu misses %llu inserts %llu evictions %llu entries %zu bytes %zu", (unsigned long long)st.hits,
              (unsigned long long)st.misses, (unsigned long long)st.inserts, (unsigned long long)st.evictions,
              st.entries, st.bytes);
    /* Put of a cached key keeps the cached entry and marks it used: now 2 is the most recent. */
    e = make_entry(99.0f);
    CHECK(cb_kvmem_put(c, k[2], e) == 1);
    cb_kvmem_entry_release(&e);
    g = cb_kvmem_get(c, k[2]);
    CHECK(g && entry_is(g, 2.0f));
    cb_kvmem_entry_release(&g);
    e = make_entry(4.0f);
    CHECK(cb_kvmem_put(c, k[4], e) == 0); /* evicts 0 (order was 2, 3, 0) */
    cb_kvmem_entry_release(&e);
    CHECK(!cb_kvmem_contains(c, k[0]) && cb_kvmem_contains(c, k[2]) && cb_kvmem_contains(c, k[3]));
    /* Bigger than the whole budget: refused, nothing evicted. */
    cb_kvmem_entry_t *big = cb_kvmem_entry_new(NL, NH, HD, NT * 4);
    CHECK(cb_kvmem_put(c, k[5], big) == -1);
    cb_kvmem_entry_release(&big);
    CHECK(cb_kvmem_put(c, k[5], NULL) == -1 && cb_kvmem_put(NULL, k[5], NULL) == -1);
    cb_kvmem_stats(c, &st);
    CHECK(st.entries == 3);
    /* remove, set_budget, clear */
    CHECK(cb_kvmem_remove(c, k[3]) == 1 && cb_kvmem_remove(c, k[3]) == 0);
    cb_kvmem_set_budget(c, eb); /* one left: the most recent (4) */
    CHECK(cb_kvmem_contains(c, k[4]) && !cb_kvmem_contains(c, k[2]));
    cb_kvmem_clear(c);
    cb_kvmem_stats(c, &st);
    CHECK(st.entries == 0 && st.bytes == 0 && st.budget == eb);
    cb_kvmem_destroy(&c);
    CHECK(c == NULL);
    cb_kvmem_destroy(&c);
}

/* References handed out stay valid through eviction, removal, clear and destroy (ASan checks this). */
TEST(test_reference_outlives_eviction) {
    cb_kvmem_entry_t *probe = make_entry(0);
    size_t eb = cb_kvmem_entry_bytes(probe);
    cb_kvmem_entry_release(&probe);
    cb_kvmem_t *c = cb_kvmem_new(eb);
    uint8_t k0[32], k1[32];
    key_of(0, k0);
    key_of(1, k1);
    cb_kvmem_entry_t *e = make_entry(7.0f);
    CHECK(cb_kvmem_put(c, k0, e) == 0);
    cb_kvmem_entry_release(&e);
    cb_kvmem_entry_t *held = cb_kvmem_get(c, k0);
    e = make_entry(8.0f);
    CHECK(cb_kvmem_put(c, k1, e) == 0); /* evicts k0 while `held` is in use */
    cb_kvmem_entry_release(&e);
    CHECK(!cb_kvmem_contains(c, k0));
    CHECK(entry_is(held, 7.0f));
    cb_kvmem_entry_t *held2 = cb_kvmem_get(c, k1);
    cb_kvmem_destroy(&c);
    CHECK(entry_is(held2, 8.0f));
    cb_kvmem_entry_release(&held);
    cb_kvmem_entry_release(&held2);
}

TEST(test_from_file) {
    char dir[] = "/tmp/test_kvmem.XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    cb_kv_meta_t m;
    memset(&m, 0, sizeof m);
    m.model_fp[0] = 1;
    m.n_layer = NL;
    m.n_head_kv = NH;
    m.head_dim = HD;
    m.dtype = CB_KV_F32;
    int32_t toks[NT] = {5, 6, 7, 8, 9};
    float k[NL * PER], v[NL * PER];
    for (int i = 0; i < NL * PER; i++) { k[i] = (float)i * 0.5f; v[i] = (float)-i; }
    uint8_t key[32];
    cb_kvfile_key(m.model_fp, m.ctx_fp, toks, NT, key);
    char path[300], err[256];
    cb_kvfile_path(dir, key, path, sizeof path);
    CHECK(cb_kvfile_write(path, &m, toks, NT, k, v, err, sizeof err) == 0);
    cb_kv_miss_t why;
    cb_kvfile_t *f = cb_kvfile_open(path, NULL, &why, err, sizeof err);
    CHECK(f != NULL);
    cb_kvmem_entry_t *e = cb_kvmem_entry_from_file(f, &why);
    CHECK(e && why == CB_KV_OK);
    CHECK(memcmp(cb_kvmem_entry_tokens(e), toks, sizeof toks) == 0);
    for (int l = 0; l < NL; l++) {
        CHECK(memcmp(cb_kvmem_entry_k(e, l), k + l * PER, PER * sizeof(float)) == 0);
        CHECK(memcmp(cb_kvmem_entry_v(e, l), v + l * PER, PER * sizeof(float)) == 0);
    }
    cb_kvmem_entry_release(&e);
    cb_kvfile_destroy(&f);
    /* A corrupt payload gives no entry and the reason. */
    FILE *fp = fopen(path, "r+b");
    CHECK(fp != NULL);
    fseek(fp, -5, SEEK_END);
    fputc(0x55, fp);
    fclose(fp);
    f = cb_kvfile_open(path, NULL, &why, err, sizeof err);
    CHECK(f != NULL);
    e = cb_kvmem_entry_from_file(f, &why);
    CHECK(e == NULL && why == CB_KV_MISS_PAYLOAD_CHECKSUM);
    cb_kvfile_destroy(&f);
    CHECK(cb_kvmem_entry_from_file(NULL, &why) == NULL && why == CB_KV_MISS_BAD_ARG);
    unlink(path);
    *strrchr(path, '/') = 0;
    rmdir(path);
    rmdir(dir);
}

#define NKEYS 32
#define NTHREADS 4
typedef struct { cb_kvmem_t *c; unsigned seed; int gets, bad; } worker_t;

static void *worker(void *p) {
    worker_t *w = p;
    int iters = TEST_SANITIZED ? 2000 : 20000;
    for (int it = 0; it < iters; it++) {
        w->seed = w->seed * 1103515245u + 12345u;
        int i = (int)((w->seed >> 16) % NKEYS);
        uint8_t key[32];
        key_of(i, key);
        if ((w->seed >> 8) % 3 == 0) {
            cb_kvmem_entry_t *e = make_entry((float)i);
            if (cb_kvmem_put(w->c, key, e) < 0) w->bad++;
            cb_kvmem_entry_release(&e);
        } else {
            w->gets++;
            cb_kvmem_entry_t *e = cb_kvmem_get(w->c, key);
            if (e) {
                if (!entry_is(e, (float)i)) w->bad++;
                cb_kvmem_entry_release(&e);
            }
        }
    }
    return NULL;
}

TEST(test_threads) {
    cb_kvmem_entry_t *probe = make_entry(0);
    size_t eb = cb_kvmem_entry_bytes(probe);
    cb_kvmem_entry_release(&probe);
    cb_kvmem_t *c = cb_kvmem_new(8 * eb);
    pthread_t t[NTHREADS];
    worker_t w[NTHREADS];
    for (int i = 0; i < NTHREADS; i++) {
        w[i] = (worker_t){c, 17u + (unsigned)i * 7919u, 0, 0};
        pthread_create(&t[i], NULL, worker, &w[i]);
    }
    int gets = 0, bad = 0;
    for (int i = 0; i < NTHREADS; i++) {
        pthread_join(t[i], NULL);
        gets += w[i].gets;
        bad += w[i].bad;
    }
    cb_kvmem_stats_t st;
    cb_kvmem_stats(c, &st);
    CHECK(bad == 0);
    CHECK(st.hits + st.misses == (uint64_t)gets);
    CHECK(st.entries <= 8 && st.bytes <= st.budget && st.bytes == st.entries * eb);
    CHECK(st.inserts - st.evictions == st.entries);
    CHECK(st.hits > 0 && st.misses > 0 && st.evictions > 0);
    cb_kvmem_destroy(&c);
}

int main(void) {
    RUN(test_entry_basics);
    RUN(test_lru_and_counters);
    RUN(test_reference_outlives_eviction);
    RUN(test_from_file);
    RUN(test_threads);
    return test_summary();
}
