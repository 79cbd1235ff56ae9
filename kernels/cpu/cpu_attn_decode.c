/* cpu_attn_decode.c: decode attention (calls of a few rows): the split-key kernel that cb_cpu_attention runs
 * for up to ATT_SPLIT_ROWS rows (tasks of (row, KV head, chunk of keys), merged flash-decoding style) and
 * cb_cpu_attention_rows, the decode batch of rows of different sequences with the same numerics; both on
 * the per-row score and P·V kernels here. Scratch layout, KV views and job: cpu_ops_internal.h.
 */
#include "cpu/cpu_ops.h"
#include "cpu/cpu_ops_internal.h"

#include <assert.h>
#include <math.h>
#include <string.h>

#if CB_AVX512
/* r[i] = sum of the 16 lanes of v[i], for i in 0..15 (a transpose-and-add tree: 45 ops for 16 sums). */
static inline __m512 hsum16x16(const __m512 v[16]) {
    __m512 w[8], u[4], z[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if CB_AVX2
/* r[i] = sum of the 8 lanes of v[i], for i in 0..7. */
static inline __m256 hsum8x8(const __m256 v[8]) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
/* q · key as 8 lane partial sums (q in qv [nd], key kr [8 * nd]): two chains, alternating. */
static inline __m256 key_lanes8(const __m256 *qv, int nd, const float *kr) {
    __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr)), a1 = _mm256_setzero_ps();
    for (int d = 1; d + 1 < nd; d += 2) {
        a1 = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(kr + 8 * d), a1);
        a0 = _mm256_fmadd_ps(qv[d + 1], _mm256_loadu_ps(kr + 8 * d + 8), a0);
    }
    if (nd % 2 == 0) a1 = _mm256_fmadd_ps(qv[nd - 1], _mm256_loadu_ps(kr + 8 * (nd - 1)), a1);
    return _mm256_add_ps(a0, a1);
}
#endif

/* s[j] = scale * q · K[j] for j < cnt (K rows kvd apart; hd a multiple of 16 on the AVX-512 path). */
static void scores_row(const float *q, const float *K, int kvd, int cnt, int hd, float scale, float *s) {
    int j = 0;
#if CB_AVX512
    if (hd % 16 == 0 && hd <= 256) {
        __m512 qv[16], v[16];
        const int nd = hd / 16;
        for (int d = 0; d < nd; d++) qv[d] = _mm512_loadu_ps(q + 16 * d);
        const __m512 vs = _mm512_set1_ps(scale);
        for (; j < cnt; j += 16) {
            int nk = cnt - j < 16 ? cnt - j : 16;
            for (int k = 0; k < 16; k++) {
                __m512 acc = _mm512_setzero_ps();
                if (k < nk) {
                    const float *kr = K + (size_t)(j + k) * kvd;
                    for (int d = 0; d < nd; d++) acc = _mm512_fmadd_ps(qv[d], _mm512_loadu_ps(kr + 16 * d), acc);
                }
                v[k] = acc;
            }
            _mm512_mask_storeu_ps(s + j, (__mmask16)((1u << nk) - 1u), _mm512_mul_ps(hsum16x16(v), vs));
        }
        return;
    }
#elif CB_AVX2
    if (hd % 8 == 0 && hd <= 128) {
        __m256 qv[16], v[8];
        const int nd = hd / 8;
        for (int d = 0; d < nd; d++) qv[d] = _mm256_loadu_ps(q + 8 * d);
        const __m256 vs = _mm256_set1_ps(scale);
        for (; j + 8 <= cnt; j += 8) {
            for (int k = 0; k < 8; k++) v[k] = key_lanes8(qv, nd, K + (size_t)(j + k) * kvd);
            _mm256_storeu_ps(s + j, _mm256_mul_ps(hsum8x8(v), vs));
        }
        for (; j < cnt; j++) { /* the same sums, one key at a time */
            float a[8];
            _mm256_storeu_ps(a, key_lanes8(qv, nd, K + (size_t)j * kvd));
            s[j] = (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))) * scale; /* hsum8x8's order */
        }
        return;
    }
#endif
    for (; j < cnt; j++) s[j] = dot_f32(q, K + (size_t)j * kvd, hd) * scale;
}

/* o[0:hd) += sum_j p[j] V[j] for j < cnt, in j order (o starts at zero: the same sums whether the keys
 * come in one run or several). */
static void pv_row(const float *p, const float *V, int kvd, int cnt, int hd, float *o) {
    int d0 = 0;
#if CB_AVX512
    for (; d0 + 64 <= hd; d0 += 64) {
        __m512 a0 = _mm512_loadu_ps(o + d0), a1 = _mm512_loadu_ps(o + d0 + 16), a2 = _mm512_loadu_ps(o + d0 + 32),
               a3 = _mm512_loadu_ps(o + d0 + 48);
        for (int j = 0; j < cnt; j++) {
            const float *vr = V + (size_t)j * kvd + d0;
            __m512 pj = _mm512_set1_ps(p[j]);
            a0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr), a0);
            a1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16), a1);
            a2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 32), a2);
            a3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 48), a3);
        }
        _mm512_storeu_ps(o + d0, a0);
        _mm512_storeu_ps(o + d0 + 16, a1);
        _mm512_storeu_ps(o + d0 + 32, a2);
        _mm512_storeu_ps(o + d0 + 48, a3);
    }
#elif CB_AVX2
    for (; d0 + 32 <= hd; d0 += 32) {
        __m256 a0 = _mm256_loadu_ps(o + d0), a1 = _mm256_loadu_ps(o + d0 + 8), a2 = _mm256_loadu_ps(o + d0 + 16),
               a3 = _mm256_loadu_ps(o + d0 + 24);
        for (int j = 0; j < cnt; j++) {
            const float *vr = V + (size_t)j * kvd + d0;
            __m256 pj = _mm256_set1_ps(p[j]);
            a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr), a0);
            a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8), a1);
            a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 16), a2);
            a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 24), a3);
        }
        _mm256_storeu_ps(o + d0, a0);
        _mm256_storeu_ps(o + d0 + 8, a1);
        _mm256_storeu_ps(o + d0 + 16, a2);
        _mm256_storeu_ps(o + d0 + 24, a3);
    }
#endif
    for (int d = d0; d < hd; d++) {
        float a = o[d];
        for (int j = 0; j < cnt; j++) a += p[j] * V[(size_t)j * kvd + d];
        o[d] = a;
    }
}

/* attn_split_task on an f16 pool, for row i, KV head kvh, keys [c0, c1) (chunk c): the chunk's K, then its
 * V, converted ATT_F16_PIECE keys (of one run) at a time and read by every query head of the group from L1.
 * Per head the arithmetic is the f32 kernel's: scores per key, the online softmax over the chunk, P·V in key
 * order. s: the thread's region (scores [G][c1 - c0] at its start, the converted piece at cvt_offset). */
static void attn_split_f16(const attn_job_t *j, int i, int kvh, int c, int c0, int c1, float *s) {
    const cb_attn_geom_t *g = j->g;
    const int H = g->n_head, hd = g->head_dim, G = H / g->n_head_kv, qd = H * hd, kvd = g->n_head_kv * hd;
    const int cnt = c1 - c0;
    const cb_cpu_kv_t *kv = j->kv;
    float *cv = s + j->cvt_offset; /* [ATT_F16_PIECE][hd] */
    float *part[ATT_MAX_G];
    for (int hh = 0; hh < G; hh++) {
        part[hh] = j->scratch + (((size_t)i * H + kvh * G + hh) * j->n_chunks + c) * (size_t)(hd + 2);
        part[hh][0] = -INFINITY;
        part[hh][1] = 0.0f;
    }
    if (cnt <= 0) return;
    for (int p = c0, w; p < c1; p += w) {
        w = kv_run(kv, p, p + ATT_F16_PIECE < c1 ? p + ATT_F16_PIECE : c1);
        cvt_rows_f16(kv_f16(kv->k, kv_row(kv, p) * kvd + (size_t)kvh * hd), (size_t)kvd, w, hd, cv, (size_t)hd);
        for (int hh = 0; hh < G; hh++)
            scores_row(j->q + (size_t)i * qd + (size_t)(kvh * G + hh) * hd, cv, hd, w, hd, g->scale,
                       s + (size_t)hh * cnt + (p - c0));
    }
    for (int hh = 0; hh < G; hh++) {
        online_softmax(s + (size_t)hh * cnt, cnt, cnt, &part[hh][0], &part[hh][1]);
        memset(part[hh] + 2, 0, sizeof(float) * (size_t)hd);
    }
    for (int p = c0, w; p < c1; p += w) {
        w = kv_run(kv, p, p + ATT_F16_PIECE < c1 ? p + ATT_F16_PIECE : c1);
        cvt_rows_f16(kv_f16(kv->v, kv_row(kv, p) * kvd + (size_t)kvh * hd), (size_t)kvd, w, hd, cv, (size_t)hd);
        for (int hh = 0; hh < G; hh++) pv_row(s + (size_t)hh * cnt + (p - c0), cv, hd, w, hd, part[hh] + 2);
    }
}

/* Split-key attention for a few rows (decode): task = (row, KV head, chunk of keys). Each task leaves,
 * per query head of the group, the chunk's max m, sum l and unnormalised output o; attn_split_merge
 * combines the chunks (flash-decoding). K and V of a chunk are read once per query head from L2. */
void attn_split_task(void *arg, int t, int thread) {
    const attn_job_t *j = arg;
    const cb_attn_geom_t *g = j->g;
    const int H = g->n_head, HKV = g->n_head_kv, hd = g->head_dim, G = H / HKV, qd = H * hd, kvd = HKV * hd;
    const int c = t % j->n_chunks, kvh = (t / j->n_chunks) % HKV, i = t / j->n_chunks / HKV;
    const int lim = j->key_limit[i], c0 = cb_attn_key_lo(g, lim) + c * j->chunk;
    const int c1 = c0 + j->chunk < lim ? c0 + j->chunk : lim;
    float *s = j->scratch + j->partial_floats + (size_t)thread * j->per_thread;
    if (j->kv->dtype == CB_KV_F16) {
        attn_split_f16(j, i, kvh, c, c0, c1, s);
        return;
    }
    for (int hh = 0; hh < G; hh++) {
        const int h = kvh * G + hh;
        float *part = j->scratch + (((size_t)i * H + h) * j->n_chunks + c) * (size_t)(hd + 2);
        if (c0 >= c1) {
            part[0] = -INFINITY;
            part[1] = 0.0f;
            continue;
        }
        const cb_cpu_kv_t *kv = j->kv;
        for (int p = c0, w; p < c1; p += w) {
            w = kv_run(kv, p, c1);
            scores_row(j->q + (size_t)i * qd + (size_t)h * hd, kv_f32(kv->k, kv_row(kv, p) * kvd + (size_t)kvh * hd),
                       kvd, w, hd, g->scale, s + (p - c0));
        }
        float m = -INFINITY, l = 0.0f;
        online_softmax(s, c1 - c0, c1 - c0, &m, &l);
        memset(part + 2, 0, sizeof(float) * (size_t)hd);
        for (int p = c0, w; p < c1; p += w) {
            w = kv_run(kv, p, c1);
            pv_row(s + (p - c0), kv_f32(kv->v, kv_row(kv, p) * kvd + (size_t)kvh * hd), kvd, w, hd, part + 2);
        }
        part[0] = m;
        part[1] = l;
    }
}

/* One head of one row from its chunks' partials (part + c * stride for chunk c: m, l, o[hd]): o [hd]. */
static void split_merge_head(const float *part, size_t stride, int n_chunks, int hd, float *o) {
    float M = -INFINITY, L = 0.0f;
    for (int c = 0; c < n_chunks; c++) M = part[c * stride] > M ? part[c * stride] : M;
    memset(o, 0, sizeof(float) * (size_t)hd);
    for (int c = 0; c < n_chunks; c++) {
        const float *pc = part + (size_t)c * stride;
        if (pc[0] == -INFINITY) continue;
        float d = pc[0] - M, a;
        cb_cpu_exp(&d, &a, 1);
        L += a * pc[1];
        for (int k = 0; k < hd; k++) o[k] += a * pc[2 + k];
    }
    scale_row(o, hd, 1.0f / L);
}

void attn_split_merge(const attn_job_t *j) {
    const int H = j->g->n_head, hd = j->g->head_dim, qd = H * hd;
    for (int i = 0; i < j->n; i++)
        for (int h = 0; h < H; h++)
            split_merge_head(j->scratch + ((size_t)i * H + h) * j->n_chunks * (size_t)(hd + 2), (size_t)(hd + 2),
                             j->n_chunks, hd, j->out + (size_t)i * qd + (size_t)h * hd);
}

/* Decode rows of different sequences (cb_cpu_attention_rows): task = (row, chunk of its keys), for every head,
 * the chunking a one-row call gives the row. The chunk's K rows, then its V rows, are read front to back in
 * pieces of ATT_ROWS_PIECE keys that every head uses from L1 (the split kernel's (row, KV head, chunk) tasks
 * read a third of each row per pass, at about half the memory bandwidth). Per head the arithmetic is the
 * split kernel's: scores (the same bits in any grouping of keys), the online softmax over the whole chunk,
 * P·V in key order, and the same merge. */
typedef struct {
    const cb_attn_geom_t *g;
    const float *q;           /* [n][n_head*head_dim] */
    const cb_cpu_kv_t *pool;  /* the layer's pool (its blocks unused) */
    const cb_kv_table_t *t;   /* [n] */
    const int32_t *key_limit; /* [n] */
    int bt, nr;               /* block tokens; rows of this run */
    int chunk[ATT_ROWS_MAX];  /* keys per task of each row */
    int task0[ATT_ROWS_MAX + 1]; /* first task of each row; task0[nr] = tasks */
    float *partial;           /* [tasks][n_head][2 + head_dim] */
    float *scratch;           /* per thread: [n_head][chunk] scores; an f16 piece's f32 copy at cvt_offset */
    size_t per_thread, cvt_offset;
} attn_rows_job_t;

static inline void prefetch_bytes(const char *p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
}

static void attn_rows_task(void *arg, int t, int thread) {
    const attn_rows_job_t *j = arg;
    const cb_attn_geom_t *g = j->g;
    const int H = g->n_head, hd = g->head_dim, G = H / g->n_head_kv, kvd = g->n_head_kv * hd;
    int i = 0;
    while (t >= j->task0[i + 1]) i++;
    const int cs = j->chunk[i], lim = j->key_limit[i], c0 = cb_attn_key_lo(g, lim) + (t - j->task0[i]) * cs;
    const int c1 = c0 + cs < lim ? c0 + cs : lim;
    const cb_cpu_kv_t kv = {j->pool->k, j->pool->v, j->t[i].blocks, j->bt, j->pool->dtype};
    const bool f16 = kv.dtype == CB_KV_F16;
    const size_t esz = f16 ? sizeof(uint16_t) : sizeof(float);
    const float *q = j->q + (size_t)i * H * hd;
    float *s = j->scratch + (size_t)thread * j->per_thread, *part = j->partial + (size_t)t * H * (hd + 2);
    float *cv = s + j->cvt_offset; /* f16: [ATT_ROWS_PIECE][kvd] */
    /* each head's pass over a piece prefetches its share of the piece ATT_ROWS_AHEAD keys on */
    const size_t slice = ((size_t)ATT_ROWS_PIECE * kvd * esz / (size_t)H + 63) / 64 * 64;
    for (int p = c0, w; p < c1; p += w) { /* runs of consecutive pool rows, in pieces */
        w = kv_run(&kv, p, p + ATT_ROWS_PIECE < c1 ? p + ATT_ROWS_PIECE : c1);
        const float *K = f16 ? cv : kv_f32(kv.k, kv_row(&kv, p) * kvd);
        if (f16) kv_to_f32(CB_KV_F16, kv_f16(kv.k, kv_row(&kv, p) * kvd), cv, (size_t)w * kvd);
        const char *next =
            p + ATT_ROWS_AHEAD < c1 ? (const char *)kv.k + kv_row(&kv, p + ATT_ROWS_AHEAD) * kvd * esz : NULL;
        for (int h = 0; h < H; h++) {
            if (next) prefetch_bytes(next + (size_t)h * slice, slice);
            scores_row(q + (size_t)h * hd, K + (size_t)(h / G) * hd, kvd, w, hd, g->scale, s + (size_t)h * cs + (p - c0));
        }
    }
    for (int h = 0; h < H; h++) {
        float *ph = part + (size_t)h * (hd + 2);
        ph[0] = -INFINITY, ph[1] = 0.0f;
        online_softmax(s + (size_t)h * cs, c1 - c0, c1 - c0, &ph[0], &ph[1]);
        memset(ph + 2, 0, sizeof(float) * (size_t)hd);
    }
    for (int p = c0, w; p < c1; p += w) {
        w = kv_run(&kv, p, p + ATT_ROWS_PIECE < c1 ? p + ATT_ROWS_PIECE : c1);
        const float *V = f16 ? cv : kv_f32(kv.v, kv_row(&kv, p) * kvd);
        if (f16) kv_to_f32(CB_KV_F16, kv_f16(kv.v, kv_row(&kv, p) * kvd), cv, (size_t)w * kvd);
        const char *next =
            p + ATT_ROWS_AHEAD < c1 ? (const char *)kv.v + kv_row(&kv, p + ATT_ROWS_AHEAD) * kvd * esz : NULL;
        for (int h = 0; h < H; h++) {
            if (next) prefetch_bytes(next + (size_t)h * slice, slice);
            pv_row(s + (size_t)h * cs + (p - c0), V + (size_t)(h / G) * hd, kvd, w, hd, part + (size_t)h * (hd + 2) + 2);
        }
    }
}

void cb_cpu_attention_rows(const cb_attn_geom_t *g, const float *q, int n, const cb_cpu_kv_t *kvp,
                           const cb_kv_table_t *t, const int32_t *key_limit, float *out, float *scratch, int max_keys,
                           cb_pool_t *pool) {
    const int H = g->n_head, hd = g->head_dim, qd = H * hd, nt = cb_pool_size(pool);
    if (H / g->n_head_kv > ATT_MAX_G) { /* the one-row path, row by row */
        for (int i = 0; i < n; i++) {
            const cb_cpu_kv_t kv = {kvp->k, kvp->v, t[i].blocks, kvp->block_tokens, kvp->dtype};
            cb_cpu_attention(g, q + (size_t)i * qd, 1, &kv, &key_limit[i], out + (size_t)i * qd, scratch, max_keys, pool);
        }
        return;
    }
    attn_rows_job_t j = {.g = g, .pool = kvp, .bt = kvp->block_tokens, .partial = scratch,
                         .scratch = scratch + att_partial_floats(g, max_keys), .per_thread = att_thread_floats(g, max_keys),
                         .cvt_offset = att_cvt_offset(g, max_keys)};
    const int slots = ATT_ROWS_MAX * ((max_keys + ATT_SPLIT_MIN - 1) / ATT_SPLIT_MIN); /* tasks the partials hold */
    for (int i0 = 0; i0 < n; i0 += j.nr) {
        j.q = q + (size_t)i0 * qd, j.t = t + i0, j.key_limit = key_limit + i0;
        j.nr = 0;
        j.task0[0] = 0;
        while (j.nr < ATT_ROWS_MAX && i0 + j.nr < n) {
            const int lim = key_limit[i0 + j.nr], span = lim - cb_attn_key_lo(g, lim);
            assert(lim >= 1 && lim <= max_keys);
            const int cs = split_chunk(span, 1, g->n_head_kv, nt), tasks = (span + cs - 1) / cs;
            if (j.task0[j.nr] + tasks > slots) break;
            j.chunk[j.nr] = cs;
            j.task0[j.nr + 1] = j.task0[j.nr] + tasks;
            j.nr++;
        }
        cb_pool_run(pool, j.task0[j.nr], attn_rows_task, &j);
        for (int i = 0; i < j.nr; i++)
            for (int h = 0; h < H; h++)
                split_merge_head(j.partial + ((size_t)j.task0[i] * H + h) * (hd + 2), (size_t)H * (hd + 2),
                                 j.task0[i + 1] - j.task0[i], hd, out + (size_t)(i0 + i) * qd + (size_t)h * hd);
    }
}
