/* test_router_pool: cb-router's tables (services/router/pool.c, included): workers join, beat, expire and
 * leave; requests in flight are found by client and id, assigned and unassigned with the load counts; the
 * policies pick as pool.h says (round robin rotates, least loaded, cache prefers the holder within the
 * imbalance bound, rendezvous is stable, exclusion and readiness are honoured); the tables are bounded. */
#include "../../services/router/pool.c"
#include "test.h"

static void key_of(int i, uint8_t key[32]) {
    memset(key, 0, 32);
    key[0] = (uint8_t)i;
    key[31] = 0xAB;
}

/* A pool with n ready workers named "w<i>" with routing ids "id<i>". */
static rt_pool_t *pool_with(int n) {
    rt_pool_t *p = rt_pool_new(8, 4, 4);
    for (int i = 0; p && i < n; i++) {
        char id[16];
        snprintf(id, sizeof id, "id%d", i);
        bool added;
        int wi = rt_pool_worker_seen(p, (const uint8_t *)id, strlen(id), 1000.0, &added);
        rt_worker_t *w = rt_pool_worker(p, wi);
        snprintf(w->name, sizeof w->name, "w%d", i);
        w->ready = true;
    }
    return p;
}

TEST(policy_names) {
    rt_policy_t p;
    CHECK(rt_policy_parse("cache", &p) == 0 && p == RT_POLICY_CACHE);
    CHECK(rt_policy_parse("least_loaded", &p) == 0 && p == RT_POLICY_LEAST_LOADED);
    CHECK(rt_policy_parse("round_robin", &p) == 0 && p == RT_POLICY_ROUND_ROBIN);
    CHECK(rt_policy_parse("random", &p) == -1 && rt_policy_parse(NULL, &p) == -1);
    CHECK(strcmp(rt_policy_name(RT_POLICY_LEAST_LOADED), "least_loaded") == 0);
    CHECK(rt_pool_new(0, 1, 1) == NULL && rt_pool_new(1, 0, 1) == NULL);
}

TEST(workers_join_beat_expire) {
    rt_pool_t *p = rt_pool_new(2, 4, 2);
    CHECK(p);
    bool added;
    int a = rt_pool_worker_seen(p, (const uint8_t *)"A", 1, 100.0, &added);
    CHECK(a >= 0 && added);
    CHECK(rt_pool_worker_seen(p, (const uint8_t *)"A", 1, 200.0, &added) == a && !added);
    int b = rt_pool_worker_seen(p, (const uint8_t *)"B", 1, 100.0, &added);
    CHECK(b >= 0 && b != a && added);
    CHECK(rt_pool_worker_seen(p, (const uint8_t *)"C", 1, 100.0, &added) == -1); /* full */
    CHECK(rt_pool_worker_seen(p, (const uint8_t *)"", 0, 100.0, &added) == -1);
    int ready;
    CHECK(rt_pool_n_workers(p, &ready) == 2 && ready == 0);
    CHECK(rt_pool_worker_expired(p, 3100.0, 3000.0) == -1); /* B last seen at 100, A at 200: 3000 ms is not more */
    CHECK(rt_pool_worker_expired(p, 3150.0, 3000.0) == b);
    rt_pool_worker_remove(p, b);
    CHECK(rt_pool_worker_expired(p, 3100.0, 3000.0) == -1);
    CHECK(rt_pool_worker_expired(p, 3300.0, 3000.0) == a);
    CHECK(rt_pool_worker_find(p, (const uint8_t *)"B", 1) == -1);
    /* resident keys: at most max_resident kept */
    uint8_t keys[3][32];
    for (int i = 0; i < 3; i++) key_of(i, keys[i]);
    rt_pool_worker_set_resident(p, a, (const uint8_t(*)[32])keys, 3);
    CHECK(rt_pool_worker(p, a)->n_resident == 2);
    CHECK(rt_pool_worker_score(p, a, (const uint8_t(*)[32])keys, 3) == 2);
    rt_pool_destroy(&p);
    CHECK(p == NULL);
    rt_pool_destroy(&p); /* NULL-safe */
}

TEST(flights_bounded_and_counted) {
    rt_pool_t *p = pool_with(2);
    CHECK(p);
    rt_flight_t *f[5];
    for (int i = 0; i < 4; i++) {
        f[i] = rt_pool_flight_add(p);
        CHECK(f[i] && f[i]->worker == -1 && f[i]->excluded == -1);
        memcpy(f[i]->client, "cli", 3);
        f[i]->client_len = 3;
        snprintf(f[i]->id, sizeof f[i]->id, "q%d", i);
    }
    CHECK(rt_pool_flight_add(p) == NULL); /* max_inflight = 4 */
    CHECK(rt_pool_n_inflight(p) == 4);
    CHECK(rt_pool_flight_find(p, (const uint8_t *)"cli", 3, "q2") == f[2]);
    CHECK(rt_pool_flight_find(p, (const uint8_t *)"clj", 3, "q2") == NULL);
    CHECK(rt_pool_flight_set_body(f[0], "abc", 3) == 0 && f[0]->body_len == 3);
    rt_pool_flight_assign(p, f[0], 1);
    rt_pool_flight_assign(p, f[1], 1);
    CHECK(rt_pool_worker(p, 1)->inflight == 2 && rt_pool_worker(p, 1)->dispatched == 2 && f[0]->attempts == 1);
    rt_pool_flight_assign(p, f[0], 0); /* moved: the old worker's count goes down */
    CHECK(rt_pool_worker(p, 1)->inflight == 1 && rt_pool_worker(p, 0)->inflight == 1 && f[0]->attempts == 2);
    rt_pool_flight_remove(p, f[0]);
    CHECK(rt_pool_worker(p, 0)->inflight == 0 && rt_pool_n_inflight(p) == 3 && !f[0]->used && !f[0]->body);
    f[2]->searching = true;
    f[2]->search_seq = 77;
    CHECK(rt_pool_flight_find_search(p, 77) == f[2] && rt_pool_flight_find_search(p, 78) == NULL);
    CHECK(rt_pool_flight_add(p) != NULL); /* a slot again */
    rt_pool_destroy(&p);
}

TEST(round_robin_and_least_loaded) {
    rt_pool_t *p = pool_with(3);
    CHECK(p);
    int seen[3] = {0};
    for (int i = 0; i < 6; i++) seen[rt_pool_pick(p, RT_POLICY_ROUND_ROBIN, NULL, 0, -1, 0)]++;
    CHECK(seen[0] == 2 && seen[1] == 2 && seen[2] == 2);
    rt_pool_worker(p, 0)->inflight = 2;
    rt_pool_worker(p, 1)->inflight = 1;
    rt_pool_worker(p, 2)->inflight = 3;
    CHECK(rt_pool_pick(p, RT_POLICY_LEAST_LOADED, NULL, 0, -1, 0) == 1);
    CHECK(rt_pool_pick(p, RT_POLICY_LEAST_LOADED, NULL, 0, 1, 0) == 0); /* excluded */
    rt_pool_worker(p, 1)->ready = false;                              /* not ready: never picked */
    CHECK(rt_pool_pick(p, RT_POLICY_LEAST_LOADED, NULL, 0, -1, 0) == 0);
    rt_pool_worker(p, 0)->ready = rt_pool_worker(p, 2)->ready = false;
    CHECK(rt_pool_pick(p, RT_POLICY_ROUND_ROBIN, NULL, 0, -1, 0) == -1);
    /* equal load: ties rotate */
    rt_pool_t *q = pool_with(2);
    int a = rt_pool_pick(q, RT_POLICY_LEAST_LOADED, NULL, 0, -1, 0);
    int b = rt_pool_pick(q, RT_POLICY_LEAST_LOADED, NULL, 0, -1, 0);
    CHECK(a != b);
    rt_pool_destroy(&p);
    rt_pool_destroy(&q);
}

TEST(cache_prefers_holder_within_imbalance) {
    rt_pool_t *p = pool_with(3);
    CHECK(p);
    uint8_t keys[2][32], other[1][32];
    key_of(1, keys[0]);
    key_of(2, keys[1]);
    key_of(9, other[0]);
    rt_pool_worker_set_resident(p, 2, (const uint8_t(*)[32])keys, 2);
    rt_pool_worker_set_resident(p, 1, (const uint8_t(*)[32])keys, 1);
    CHECK(rt_pool_pick(p, RT_POLICY_CACHE, (const uint8_t(*)[32])keys, 2, -1, 2) == 2); /* holds both */
    rt_pool_worker(p, 2)->inflight = 2;
    CHECK(rt_pool_pick(p, RT_POLICY_CACHE, (const uint8_t(*)[32])keys, 2, -1, 2) == 2); /* within 2 of the least */
    rt_pool_worker(p, 2)->inflight = 3;
    CHECK(rt_pool_pick(p, RT_POLICY_CACHE, (const uint8_t(*)[32])keys, 2, -1, 2) == 1); /* too busy: next best */
    CHECK(rt_pool_pick(p, RT_POLICY_CACHE, (const uint8_t(*)[32])keys, 2, 1, 2) == 0);  /* 1 excluded, 2 busy */
    /* nobody holds the key: rendezvous, the same worker every time, and only the keys of a leaver move */
    rt_pool_worker(p, 2)->inflight = 0;
    int first = rt_pool_pick(p, RT_POLICY_CACHE, (const uint8_t(*)[32])other, 1, -1, 2);
    for (int i = 0; i < 5; i++) CHECK(rt_pool_pick(p, RT_POLICY_CACHE, (const uint8_t(*)[32])other, 1, -1, 2) == first);
    rt_pool_worker(p, first)->inflight = 2; /* busier, but within the bound: affinity wins over load */
    CHECK(rt_pool_pick(p, RT_POLICY_CACHE, (const uint8_t(*)[32])other, 1, -1, 2) == first);
    rt_pool_worker(p, first)->inflight = 3; /* beyond it: another worker */
    CHECK(rt_pool_pick(p, RT_POLICY_CACHE, (const uint8_t(*)[32])other, 1, -1, 2) != first);
    rt_pool_worker(p, first)->inflight = 0;
    /* two holders with the same score: the less loaded */
    rt_pool_worker_set_resident(p, 0, (const uint8_t(*)[32])keys, 2);
    rt_pool_worker(p, 2)->inflight = 1;
    CHECK(rt_pool_pick(p, RT_POLICY_CACHE, (const uint8_t(*)[32])keys, 2, -1, 2) == 0);
    rt_pool_worker(p, 2)->inflight = 0;
    rt_pool_worker(p, 0)->inflight = 1;
    CHECK(rt_pool_pick(p, RT_POLICY_CACHE, (const uint8_t(*)[32])keys, 2, -1, 2) == 2);
    rt_pool_worker(p, 0)->inflight = 0;
    rt_pool_worker_set_resident(p, 0, NULL, 0);
    int spread[3] = {0};
    for (int k = 0; k < 60; k++) {
        uint8_t kk[1][32];
        key_of(100 + k, kk[0]);
        kk[0][5] = (uint8_t)(k * 37);
        spread[rt_pool_pick(p, RT_POLICY_CACHE, (const uint8_t(*)[32])kk, 1, -1, 2)]++;
    }
    CHECK_MSG(spread[0] > 5 && spread[1] > 5 && spread[2] > 5, "spread %d %d %d", spread[0], spread[1], spread[2]);
    /* without keys: least loaded */
    rt_pool_worker(p, 0)->inflight = 1;
    rt_pool_worker(p, 1)->inflight = 1;
    CHECK(rt_pool_pick(p, RT_POLICY_CACHE, NULL, 0, -1, 2) == 2);
    rt_pool_destroy(&p);
}

int main(void) {
    RUN(policy_names);
    RUN(workers_join_beat_expire);
    RUN(flights_bounded_and_counted);
    RUN(round_robin_and_least_loaded);
    RUN(cache_prefers_holder_within_imbalance);
    return test_summary();
}
