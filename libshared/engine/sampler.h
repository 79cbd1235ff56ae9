/* sampler: picks the next token from a row of logits: greedy, or temperature sampling restricted by
 * top-k and top-p, with a seeded PRNG (deterministic for a seed: same seed + same logits -> same ids).
 *
 * Order of the filters (llama.cpp's default chain, minus penalties): top-k on the logits, then top-p
 * on the softmax of the surviving logits at temperature 1, then temperature, then one draw.
 * The sampler owns scratch for n_vocab candidates (allocated once); it is not thread-safe (one per
 * request).
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
} cb_sampler_params_t;

/* NULL on a bad argument (n_vocab < 1, NaN parameters) or out of memory. Caller owns the result. */
cb_sampler_t *cb_sampler_new(const cb_sampler_params_t *params, int n_vocab);
void cb_sampler_destroy(cb_sampler_t **self_p);
/* Restarts the PRNG stream from seed. */
void cb_sampler_reset(cb_sampler_t *self, uint64_t seed);
/* Next token from logits [n_vocab] (not modified). NaN logits are never chosen unless all are NaN. */
int32_t cb_sampler_sample(cb_sampler_t *self, const float *logits);

/* Index of the largest of x[0..n) (lowest index on ties; NaNs ignored; 0 if all NaN). */
int32_t cb_argmax(const float *x, int n);
/* out [n] = log softmax of logits [n], in double. */
void cb_log_softmax(const float *logits, int n, double *out);
/* KL(p || q) of two log-distributions lp, lq [n] (terms with p below e^-60 skipped; never negative). */
double cb_kl_div(const double *lp, const double *lq, int n);
#endif
