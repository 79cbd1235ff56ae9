/* cpu_blend_host.c: the host-side CacheBlend operations of the backend table (cpu_ops.h: kv_deviation, topk,
 * compact_rows) over host buffers, shared by the CPU backend and the CUDA backend.
 */
#include "cpu/cpu_ops.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "format/kvfile.h"

/* ---------------------------------------------------------------- host-side CacheBlend operations */

int cb_cpu_kv_deviation(int n, int width, const float *fresh, const void *const *cached, cb_kv_dtype_t dtype,
                        double *dev, float *row) {
    if (!cb_kv_dtype_size(dtype) && !(dtype == CB_KV_Q8_0 && width % 32 == 0)) return -1;
    for (int i = 0; i < n; i++) {
        cb_cpu_kv_to_f32(dtype, cached[i], row, (size_t)width);
        const float *a = fresh + (size_t)i * width;
        double s = 0.0;
        for (int j = 0; j < width; j++) {
            double d = (double)a[j] - (double)row[j];
            s += d * d;
        }
        dev[i] = s;
    }
    return 0;
}

/* Descending score (NaN first), then ascending index: a strict total order, so one answer. */
static int cmp_score(const void *pa, const void *pb, void *arg) {
    const double *sc = arg;
    int ia = *(const int32_t *)pa, ib = *(const int32_t *)pb;
    double da = sc[ia], db = sc[ib];
    bool na = isnan(da), nb = isnan(db);
    if (na != nb) return na ? -1 : 1;
    if (!na && da != db) return da > db ? -1 : 1;
    return ia < ib ? -1 : ia > ib;
}

void cb_cpu_topk(int n, const double *score, int k, int32_t *out, int32_t *idx) {
    if (k > n) k = n;
    if (k <= 0) return;
    for (int i = 0; i < n; i++) idx[i] = i;
    qsort_r(idx, (size_t)n, sizeof(int32_t), cmp_score, (void *)score);
    memcpy(out, idx, sizeof(int32_t) * (size_t)k);
}

void cb_cpu_compact_rows(float *x, size_t row_len, const int32_t *keep, int n_keep) {
    for (int i = 0; i < n_keep; i++)
        if (keep[i] != i) memmove(x + (size_t)i * row_len, x + (size_t)keep[i] * row_len, sizeof(float) * row_len);
}
