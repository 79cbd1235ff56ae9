/* test_sampler: greedy, determinism per seed, top-k / top-p / temperature against the exact
 * distributions they should produce (frequency checks with generous bounds); frequency and presence
 * penalties against argmaxes computed by hand, zero penalties = no penalties, bad penalties refused. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "engine/sampler.h"
#include "test.h"

/* log-softmax and KL: KL(p||p) = 0; a two-point case against its closed form; shift invariance */
TEST(test_kl) {
    float a[3] = {1.0f, 2.0f, 3.0f}, b[3] = {3.0f, 2.0f, 1.0f}, c[3] = {11.0f, 12.0f, 13.0f};
    double la[3], lb[3], lc[3];
    cb_log_softmax(a, 3, la);
    cb_log_softmax(b, 3, lb);
    cb_log_softmax(c, 3, lc);
    double s = exp(la[0]) + exp(la[1]) + exp(la[2]);
    CHECK(fabs(s - 1.0) < 1e-12);
    CHECK(cb_kl_div(la, la, 3) == 0.0);
    CHECK(cb_kl_div(la, lc, 3) < 1e-12);
    double ref = 0.0;
    for (int i = 0; i < 3; i++) ref += exp(la[i]) * (la[i] - lb[i]);
    CHECK(fabs(cb_kl_div(la, lb, 3) - ref) < 1e-12 && ref > 1.0);
    float p[2] = {0.0f, 0.0f}, q[2] = {0.0f, (float)log(3.0)}; /* (1/2, 1/2) vs (1/4, 3/4) */
    double lp[2], lq[2];
    cb_log_softmax(p, 2, lp);
    cb_log_softmax(q, 2, lq);
    CHECK(fabs(cb_kl_div(lp, lq, 2) - (0.5 * log(2.0) + 0.5 * log(2.0 / 3.0))) < 1e-7);
}

TEST(test_greedy) {
    float l[6] = {0.5f, 2.0f, -1.0f, 2.0f, NAN, 1.0f};
    CHECK(cb_argmax(l, 6) == 1); /* tie: lowest id; NaN ignored */
    cb_sampler_params_t p = {.temperature = 0.0f, .seed = 1};
    cb_sampler_t *s = cb_sampler_new(&p, 6);
    CHECK(s);
    for (int i = 0; i < 10; i++) CHECK(cb_sampler_sample(s, l) == 1);
    cb_sampler_destroy(&s);
    CHECK(s == NULL);
    cb_sampler_destroy(&s);
    float nan3[3] = {NAN, NAN, NAN};
    CHECK(cb_argmax(nan3, 3) == 0);
    CHECK(cb_sampler_new(&p, 0) == NULL);
    p.temperature = NAN;
    CHECK(cb_sampler_new(&p, 6) == NULL);
}

static void draw(cb_sampler_t *s, const float *l, int n, int draws, double *freq) {
    int count[16] = {0};
    for (int i = 0; i < draws; i++) {
        int32_t t = cb_sampler_sample(s, l);
        if (t >= 0 && t < n) count[t]++;
    }
    for (int i = 0; i < n; i++) freq[i] = (double)count[i] / draws;
}

TEST(test_determinism) {
    enum { V = 1000, N = 200 };
    static float l[V];
    for (int i = 0; i < V; i++) l[i] = sinf((float)i * 0.37f) * 3.0f;
    cb_sampler_params_t p = {.temperature = 0.9f, .top_k = 50, .top_p = 0.95f, .seed = 1234};
    cb_sampler_t *a = cb_sampler_new(&p, V), *b = cb_sampler_new(&p, V);
    p.seed = 1235;
    cb_sampler_t *c = cb_sampler_new(&p, V);
    int32_t ra[N], rb[N], rc[N];
    for (int i = 0; i < N; i++) ra[i] = cb_sampler_sample(a, l), rb[i] = cb_sampler_sample(b, l), rc[i] = cb_sampler_sample(c, l);
    CHECK(memcmp(ra, rb, sizeof ra) == 0);
    CHECK(memcmp(ra, rc, sizeof ra) != 0);
    cb_sampler_reset(a, 1234);
    for (int i = 0; i < N; i++) CHECK(cb_sampler_sample(a, l) == ra[i]);
    cb_sampler_destroy(&a); cb_sampler_destroy(&b); cb_sampler_destroy(&c);
}

TEST(test_distributions) {
    const float l[4] = {logf(0.5f), logf(0.3f), logf(0.2f), -INFINITY};
    const int D = TEST_SANITIZED ? 20000 : 100000;
    double f[4];
    cb_sampler_params_t p = {.temperature = 1.0f, .seed = 7};
    cb_sampler_t *s = cb_sampler_new(&p, 4);
    draw(s, l, 4, D, f);
    CHECK_NEAR(f[0], 0.5, 0.015); CHECK_NEAR(f[1], 0.3, 0.015); CHECK_NEAR(f[2], 0.2, 0.015); CHECK(f[3] == 0);
    cb_sampler_destroy(&s);

    p.top_k = 2; /* 0.5 : 0.3 renormalised */
    s = cb_sampler_new(&p, 4);
    draw(s, l, 4, D, f);
    CHECK_NEAR(f[0], 0.625, 0.015); CHECK_NEAR(f[1], 0.375, 0.015); CHECK(f[2] == 0);
    cb_sampler_destroy(&s);

    p.top_k = 0; p.top_p = 0.75f; /* 0.5 < 0.75 <= 0.8: keeps {0, 1} */
    s = cb_sampler_new(&p, 4);
    draw(s, l, 4, D, f);
    CHECK_NEAR(f[0], 0.625, 0.015); CHECK(f[2] == 0);
    cb_sampler_destroy(&s);

    p.top_p = 0.01f; /* nucleus of one */
    s = cb_sampler_new(&p, 4);
    draw(s, l, 4, 1000, f);
    CHECK(f[0] == 1.0);
    cb_sampler_destroy(&s);

    p.top_p = 1.0f; p.temperature = 0.5f; /* p^2 renormalised: .25/.38, .09/.38, .04/.38 */
    s = cb_sampler_new(&p, 4);
    draw(s, l, 4, D, f);
    CHECK_NEAR(f[0], 0.25 / 0.38, 0.015); CHECK_NEAR(f[1], 0.09 / 0.38, 0.015); CHECK_NEAR(f[2], 0.04 / 0.38, 0.015);
    cb_sampler_destroy(&s);

    p.temperature = 5.0f; p.top_k = 1; /* top-k 1 is greedy at any temperature */
    s = cb_sampler_new(&p, 4);
    draw(s, l, 4, 1000, f);
    CHECK(f[0] == 1.0);
    cb_sampler_destroy(&s);
}

/* frequency penalty: l[j] - count[j] * f; the caller's row is never modified */
TEST(test_frequency_penalty) {
    const float l[4] = {1.0f, 0.8f, 0.5f, 0.0f};
    float copy[4];
    memcpy(copy, l, sizeof l);
    cb_sampler_params_t p = {.temperature = 0.0f, .frequency_penalty = 0.25f};
    cb_sampler_t *s = cb_sampler_new(&p, 4);
    CHECK(s);
    CHECK(cb_sampler_sample(s, l) == 0); /* nothing accepted: plain argmax */
    cb_sampler_accept(s, 0);             /* 0.75 0.8 0.5 0 */
    CHECK(cb_sampler_sample(s, l) == 1);
    cb_sampler_accept(s, 1);             /* 0.75 0.55 0.5 0 */
    CHECK(cb_sampler_sample(s, l) == 0);
    cb_sampler_accept(s, 0);             /* 0.5 0.55 0.5 0 */
    CHECK(cb_sampler_sample(s, l) == 1);
    cb_sampler_accept(s, 1);             /* 0.5 0.3 0.5 0: tie, lowest id */
    CHECK(cb_sampler_sample(s, l) == 0);
    CHECK(cb_sampler_count(s, 0) == 2 && cb_sampler_count(s, 1) == 2 && cb_sampler_count(s, 2) == 0);
    CHECK(memcmp(l, copy, sizeof l) == 0);
    cb_sampler_accept(s, -1); /* out of the vocabulary: ignored */
    cb_sampler_accept(s, 4);
    CHECK(cb_sampler_count(s, 4) == 0 && cb_sampler_count(s, -1) == 0);
    cb_sampler_reset(s, 0); /* a new request: counts forgotten */
    CHECK(cb_sampler_count(s, 0) == 0 && cb_sampler_count(s, 1) == 0);
    CHECK(cb_sampler_sample(s, l) == 0);
    cb_sampler_destroy(&s);

    p.frequency_penalty = -0.5f; /* negative: repetition encouraged */
    s = cb_sampler_new(&p, 4);
    cb_sampler_accept(s, 2); /* 1 0.8 1.0 0: tie, lowest id */
    CHECK(cb_sampler_sample(s, l) == 0);
    cb_sampler_accept(s, 2); /* 1 0.8 1.5 0 */
    CHECK(cb_sampler_sample(s, l) == 2);
    cb_sampler_destroy(&s);
}

/* presence penalty: once per token however often it occurred; with frequency: count * f + p */
TEST(test_presence_penalty) {
    const float l[4] = {1.0f, 0.8f, 0.5f, 0.0f};
    cb_sampler_params_t p = {.temperature = 0.0f, .presence_penalty = 0.625f};
    cb_sampler_t *s = cb_sampler_new(&p, 4);
    CHECK(s);
    for (int i = 0; i < 3; i++) cb_sampler_accept(s, 0); /* 0.375 0.8 0.5 0 */
    CHECK(cb_sampler_sample(s, l) == 1);
    cb_sampler_accept(s, 1);                             /* 0.375 0.175 0.5 0 */
    CHECK(cb_sampler_sample(s, l) == 2);
    cb_sampler_destroy(&s);

    p.frequency_penalty = 0.125f; p.presence_penalty = 0.5f;
    s = cb_sampler_new(&p, 4);
    cb_sampler_accept(s, 0); /* 1 - (0.125 + 0.5) = 0.375 */
    cb_sampler_accept(s, 1); cb_sampler_accept(s, 1); /* 0.8 - (0.25 + 0.5) = 0.05 */
    CHECK(cb_sampler_sample(s, l) == 2);
    cb_sampler_accept(s, 2); /* 0.5 - 0.625 = -0.125 < 0 */
    CHECK(cb_sampler_sample(s, l) == 0);
    cb_sampler_accept(s, 0); cb_sampler_accept(s, 0); /* 1 - (0.375 + 0.5) = 0.125 > 0.05 > 0 > -0.125 */
    CHECK(cb_sampler_sample(s, l) == 0);
    cb_sampler_accept(s, 0); /* 1 - (0.5 + 0.5) = 0 < 0.05 */
    CHECK(cb_sampler_sample(s, l) == 1);
    cb_sampler_destroy(&s);

    /* at temperature 1: a presence penalty of 2 on one of two equal tokens gives it e^-2 / (1 + e^-2) */
    const float two[2] = {0.0f, 0.0f};
    cb_sampler_params_t t = {.temperature = 1.0f, .presence_penalty = 2.0f, .seed = 11};
    s = cb_sampler_new(&t, 2);
    cb_sampler_accept(s, 0);
    double f[2];
    draw(s, two, 2, TEST_SANITIZED ? 20000 : 100000, f);
    CHECK_NEAR(f[0], exp(-2.0) / (1.0 + exp(-2.0)), 0.015);
    cb_sampler_destroy(&s);
}

/* zero penalties (accepting or not) = a sampler without them; penalties before any accept = none;
 * a penalised sampler is deterministic per seed */
TEST(test_penalties_neutral) {
    enum { V = 1000, N = 200 };
    static float l[V];
    for (int i = 0; i < V; i++) l[i] = sinf((float)i * 0.37f) * 3.0f;
    cb_sampler_params_t p = {.temperature = 0.9f, .top_k = 50, .top_p = 0.95f, .seed = 99};
    cb_sampler_t *a = cb_sampler_new(&p, V), *b = cb_sampler_new(&p, V);
    p.frequency_penalty = 0.7f; p.presence_penalty = -0.3f;
    cb_sampler_t *c = cb_sampler_new(&p, V), *d = cb_sampler_new(&p, V);
    CHECK(a && b && c && d);
    int32_t ra[N], rc[N], rd[N];
    for (int i = 0; i < N; i++) {
        ra[i] = cb_sampler_sample(a, l);
        int32_t t = cb_sampler_sample(b, l);
        cb_sampler_accept(b, t); /* counted, but with zero penalties it changes nothing */
        CHECK(t == ra[i]);
    }
    CHECK(cb_sampler_sample(c, l) == ra[0]); /* nothing accepted yet */
    cb_sampler_reset(c, 99);
    for (int i = 0; i < N; i++) {
        rc[i] = cb_sampler_sample(c, l), rd[i] = cb_sampler_sample(d, l);
        cb_sampler_accept(c, rc[i]);
        cb_sampler_accept(d, rd[i]);
    }
    CHECK(memcmp(rc, rd, sizeof rc) == 0);
    CHECK(memcmp(rc, ra, sizeof rc) != 0);
    cb_sampler_reset(c, 99);
    for (int i = 0; i < N; i++) {
        int32_t t = cb_sampler_sample(c, l);
        CHECK(t == rc[i]);
        cb_sampler_accept(c, t);
    }
    /* greedy with a frequency penalty walks down the ranking instead of repeating the top token */
    cb_sampler_params_t g = {.temperature = 0.0f, .frequency_penalty = 2.0f};
    cb_sampler_t *e = cb_sampler_new(&g, V);
    int32_t first = cb_sampler_sample(e, l);
    cb_sampler_accept(e, first);
    CHECK(cb_sampler_sample(e, l) != first);
    cb_sampler_destroy(&a); cb_sampler_destroy(&b); cb_sampler_destroy(&c); cb_sampler_destroy(&d);
    cb_sampler_destroy(&e);
}

/* penalties outside [-2, 2], NaN or infinite: refused by _new */
TEST(test_penalty_params) {
    const float bad[] = {NAN, INFINITY, -INFINITY, 2.0001f, -2.0001f, 5.0f, -5.0f};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cb_sampler_params_t p = {.frequency_penalty = bad[i]};
        CHECK(cb_sampler_new(&p, 8) == NULL);
        cb_sampler_params_t q = {.presence_penalty = bad[i]};
        CHECK(cb_sampler_new(&q, 8) == NULL);
    }
    cb_sampler_params_t ok = {.frequency_penalty = 2.0f, .presence_penalty = -2.0f};
    cb_sampler_t *s = cb_sampler_new(&ok, 8);
    CHECK(s);
    cb_sampler_destroy(&s);
    ok.frequency_penalty = -2.0f; ok.presence_penalty = 2.0f;
    s = cb_sampler_new(&ok, 8);
    CHECK(s);
    cb_sampler_destroy(&s);
}

int main(void) {
    RUN(test_greedy);
    RUN(test_kl);
    RUN(test_determinism);
    RUN(test_distributions);
    RUN(test_frequency_penalty);
    RUN(test_presence_penalty);
    RUN(test_penalties_neutral);
    RUN(test_penalty_params);
    return test_summary();
}
