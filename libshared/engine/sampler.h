/* sampler: picks the next token from a row of logits: greedy, or temperature sampling restricted by
 * top-k and top-p, with a seeded PRNG (deterministic for a seed: same seed + same logits -> same ids),
 * after OpenAI's frequency and presence penalties on the tokens accepted so far.
 *
 * Order: first the penalties (OpenAI semantics): for every token j accepted so far (cb_sampler_accept),
 *   l[j] = logit[j] - (count[j] * frequency_penalty + presence_penalty)
 * on the sampler's own copy of the row (the caller's logits are never modified); so they change greedy
 * choices too. With both penalties 0 the row is used as it is (bit-identical to a sampler without them).
 * Then the filters (llama.cpp's default chain): top-k on the logits, then top-p on the softmax of the
 * surviving logits at temperature 1, then temperature, then one draw.
 *
 * Memory: the sampler owns, allocated once in _new, scratch for n_vocab candidates, a penalised copy of a
 * row [n_vocab], the count of each token [n_vocab] and the list of distinct tokens accepted [n_vocab]; no
 * call allocates. It is not thread-safe (one per request).
 */
#ifndef CB_SAMPLER_H
#define CB_SAMPLER_H

#include <stdint.h>

typedef struct cb_sampler cb_sampler_t;

typedef struct {
    float temperature;      /* <= 0: greedy (argmax; lowest id on ties). Otherwise softmax(l / T). */
    int top_k;              /* keep the k largest logits; <= 0: off */
    float top_p;            /* keep the smallest set of most likely tokens with mass >= top_p; off unless 0 < p < 1 */
    uint64_t seed;          /* PRNG seed (PCG32 stream) */
    float frequency_penalty; /* [-2, 2], 0 = off: subtracted once per earlier occurrence of a token */
    float presence_penalty;  /* [-2, 2], 0 = off: subtracted once from every token that occurred */
} cb_sampler_params_t;

#define CB_SAMPLER_PENALTY_MAX 2.0f /* |frequency_penalty|, |presence_penalty| at most this (OpenAI's range) */

/* NULL on a bad argument (n_vocab < 1, NaN temperature or top_p, a penalty NaN or outside [-2, 2]) or
 * out of memory. Caller owns the result: destroy with cb_sampler_destroy. */
cb_sampler_t *cb_sampler_new(const cb_sampler_params_t *params, int n_vocab);
/* Frees the sampler and nulls *self_p; safe on NULL. */
void cb_sampler_destroy(cb_sampler_t **self_p);
/* Restarts the PRNG stream from seed and forgets the accepted tokens (a new request). */
void cb_sampler_reset(cb_sampler_t *self, uint64_t seed);
/* Records that token (the one sampled, or any the caller generated) is part of the answer: the
 * penalties of later calls count it. Ids outside [0, n_vocab) are ignored. O(1). */
void cb_sampler_accept(cb_sampler_t *self, int32_t token);
/* How many times token was accepted since _new or the last reset (0 for ids outside the vocabulary). */
int cb_sampler_count(const cb_sampler_t *self, int32_t token);
/* Next token from logits [n_vocab] (not modified). NaN logits are never chosen unless all are NaN.
 * Does not accept the token: call cb_sampler_accept for the one kept. With penalties, O(n_vocab) for
 * the copy of the row plus O(distinct accepted tokens). */
int32_t cb_sampler_sample(cb_sampler_t *self, const float *logits);

/* Index of the largest of x[0..n) (lowest index on ties; NaNs ignored; 0 if all NaN). */
int32_t cb_argmax(const float *x, int n);
/* out [n] = log softmax of logits [n], in double. */
void cb_log_softmax(const float *logits, int n, double *out);
/* KL(p || q) of two log-distributions lp, lq [n] (terms with p below e^-60 skipped; never negative). */
double cb_kl_div(const double *lp, const double *lq, int n);
#endif
