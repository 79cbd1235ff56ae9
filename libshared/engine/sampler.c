/* sampler.c: frequency/presence penalties, then greedy / top-k / top-p / temperature sampling with a
 * PCG32 generator (see sampler.h). Owns a candidate array, a penalised row, token counts and the list
 * of distinct accepted tokens, n_vocab entries each, allocated in _new; no allocation per call.
 */
#include "engine/sampler.h"
#include "base/alloc.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

typedef struct { float logit; int32_t id; } cand_t;

struct cb_sampler {
    cb_sampler_params_t p;
    int n_vocab;
    uint64_t state, inc;     /* PCG32 */
    cand_t *cand;            /* [n_vocab] */
    bool penalised;          /* a penalty is not 0: sample from row, not the caller's logits */
    float *row;              /* [n_vocab] the penalised copy of the last row (when penalised) */
    int32_t *count;          /* [n_vocab] times each token was accepted (saturates at INT32_MAX) */
    int32_t *seen;           /* [n_seen] distinct accepted tokens, in first-accepted order (capacity n_vocab) */
    int n_seen;
};

/* PCG32 (O'Neill), XSH RR output. */
static uint32_t pcg32(cb_sampler_t *s) {
    uint64_t old = s->state;
    s->state = old * 6364136223846793005ULL + s->inc;
    uint32_t xorshifted = (uint32_t)(((old >> 18u) ^ old) >> 27u), rot = (uint32_t)(old >> 59u);
    return (xorshifted >> rot) | (xorshifted << ((-rot) & 31u));
}

/* Uniform in [0, 1) with 53 random bits. */
static double uniform(cb_sampler_t *s) {
    uint64_t a = pcg32(s) >> 5, b = pcg32(s) >> 6; /* 27 + 26 bits */
    return ((double)a * 67108864.0 + (double)b) / 9007199254740992.0;
}

void cb_sampler_reset(cb_sampler_t *self, uint64_t seed) {
    for (int i = 0; i < self->n_seen; i++) self->count[self->seen[i]] = 0;
    self->n_seen = 0;
    self->state = 0;
    self->inc = (seed << 1u) | 1u;
    pcg32(self);
    self->state += seed ^ 0x853c49e6748fea9bULL;
    pcg32(self);
}

/* A penalty is a number in [-CB_SAMPLER_PENALTY_MAX, CB_SAMPLER_PENALTY_MAX] (false for NaN). */
static bool penalty_ok(float x) { return x >= -CB_SAMPLER_PENALTY_MAX && x <= CB_SAMPLER_PENALTY_MAX; }

cb_sampler_t *cb_sampler_new(const cb_sampler_params_t *params, int n_vocab) {
    if (!params || n_vocab < 1 || isnan(params->temperature) || isnan(params->top_p) ||
        !penalty_ok(params->frequency_penalty) || !penalty_ok(params->presence_penalty))
        return NULL;
    cb_sampler_t *s = cb_calloc(1, sizeof *s);
    if (!s) return NULL;
    s->p = *params;
    s->n_vocab = n_vocab;
    s->penalised = params->frequency_penalty != 0.0f || params->presence_penalty != 0.0f;
    s->cand = cb_malloc(sizeof(cand_t) * (size_t)n_vocab);
    s->count = cb_calloc((size_t)n_vocab, sizeof(int32_t));
    s->seen = cb_malloc(sizeof(int32_t) * (size_t)n_vocab);
    if (s->penalised) s->row = cb_malloc(sizeof(float) * (size_t)n_vocab);
    if (!s->cand || !s->count || !s->seen || (s->penalised && !s->row)) {
        cb_sampler_destroy(&s);
        return NULL;
    }
    cb_sampler_reset(s, params->seed);
    return s;
}

void cb_sampler_destroy(cb_sampler_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_sampler_t *s = *self_p;
    free(s->cand);
    free(s->row);
    free(s->count);
    free(s->seen);
    free(s);
    *self_p = NULL;
}

void cb_sampler_accept(cb_sampler_t *self, int32_t token) {
    if (token < 0 || token >= self->n_vocab) return;
    int32_t *c = &self->count[token];
    if (*c == 0) self->seen[self->n_seen++] = token; /* at most n_vocab distinct ids */
    if (*c < INT32_MAX) (*c)++;
}

int cb_sampler_count(const cb_sampler_t *self, int32_t token) {
    return token >= 0 && token < self->n_vocab ? self->count[token] : 0;
}

/* row = logits minus the penalties of the accepted tokens (OpenAI: count * frequency + presence). */
static const float *penalise(cb_sampler_t *self, const float *logits) {
    const float fp = self->p.frequency_penalty, pp = self->p.presence_penalty;
    memcpy(self->row, logits, sizeof(float) * (size_t)self->n_vocab);
    for (int i = 0; i < self->n_seen; i++) {
        const int32_t j = self->seen[i];
        self->row[j] -= (float)self->count[j] * fp + pp;
    }
    return self->row;
}

int32_t cb_argmax(const float *x, int n) {
    int32_t best = -1;
    for (int i = 0; i < n; i++)
        if (!isnan(x[i]) && (best < 0 || x[i] > x[best])) best = i;
    return best < 0 ? 0 : best;
}

void cb_log_softmax(const float *l, int n, double *out) {
    double m = -INFINITY, s = 0.0;
    for (int i = 0; i < n; i++)
        if (l[i] > m) m = l[i];
    for (int i = 0; i < n; i++) s += exp((double)l[i] - m);
    double lse = m + log(s);
    for (int i = 0; i < n; i++) out[i] = (double)l[i] - lse;
}

double cb_kl_div(const double *lp, const double *lq, int n) {
    double k = 0.0;
    for (int i = 0; i < n; i++)
        if (lp[i] > -60.0) k += exp(lp[i]) * (lp[i] - lq[i]);
    return k < 0.0 ? 0.0 : k;
}

/* Descending logit, then ascending id: a total order, so results do not depend on qsort's internals. */
static int cand_cmp(const void *a, const void *b) {
    const cand_t *x = a, *y = b;
    if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

int32_t cb_sampler_sample(cb_sampler_t *self, const float *in) {
    const cb_sampler_params_t *p = &self->p;
    const int V = self->n_vocab;
    const float *logits = self->penalised ? penalise(self, in) : in; /* [V] the row the filters see */
    if (!(p->temperature > 0.0f)) return cb_argmax(logits, V);
    float mx = logits[cb_argmax(logits, V)];
    if (isnan(mx) || isinf(mx)) return cb_argmax(logits, V);

    /* Candidates. Without top-k, tokens more than 30 nats (at T = 1) below the best are dropped
     * before sorting: together they hold at most n_vocab * e^-30 (< 5e-9 for 49152 tokens) of the
     * T = 1 mass, so the top-p set is unchanged for any top_p < 1 - 5e-9; with top-p off they
     * are equally negligible after temperature T <= 1. With top-k, all tokens compete. */
    int n = 0;
    const bool use_k = p->top_k > 0 && p->top_k < V;
    const float floor = use_k ? -INFINITY : mx - 30.0f * (p->temperature > 1.0f ? p->temperature : 1.0f);
    for (int i = 0; i < V; i++)
        if (!isnan(logits[i]) && logits[i] >= floor) self->cand[n++] = (cand_t){logits[i], i};
    qsort(self->cand, (size_t)n, sizeof(cand_t), cand_cmp);
    if (use_k && n > p->top_k) n = p->top_k;

    if (p->top_p > 0.0f && p->top_p < 1.0f) {
        double sum = 0.0, cum = 0.0;
        for (int i = 0; i < n; i++) sum += exp((double)self->cand[i].logit - self->cand[0].logit);
        int keep = n;
        for (int i = 0; i < n; i++) {
            cum += exp((double)self->cand[i].logit - self->cand[0].logit) / sum;
            if (cum >= p->top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }

    double total = 0.0;
    const double inv_t = 1.0 / p->temperature, top = self->cand[0].logit;
    for (int i = 0; i < n; i++) total += exp(((double)self->cand[i].logit - top) * inv_t);
    double r = uniform(self) * total, acc = 0.0;
    for (int i = 0; i < n; i++) {
        acc += exp(((double)self->cand[i].logit - top) * inv_t);
        if (r < acc) return self->cand[i].id;
    }
    return self->cand[n - 1].id;
}
