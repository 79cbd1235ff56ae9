/* blend_pass.c: one pass of the fused prefill over the layers: the active rows' embeddings; per layer the
 * wait for the loader, QKV (ubatches), the candidates' deviation on a measuring layer, RoPE, K/V into the
 * sequence, the selection, the probe's attention mass, attention (dense, or over gathered key blocks for
 * sparse rows) + MLP; the last row's logits. Part of blend (blend_internal.h). */
#include "blend/blend_internal.h"

#include <assert.h>
#include <pthread.h>
#include <string.h>

#include "base/clock.h"
#include "base/err.h"

void cb_blend_run_init(run_t *R, int n) {
    memset(R, 0, sizeof *R);
    R->n = n;
    R->check_layer = 0;
    R->grad_end = -1;
    R->metric = 'v';
    R->overlap = true;
    R->fail_src = -1;
    R->n_chosen = -1;
}

/* Pre-RoPE cached K or V row (which: 0 = K, 1 = V) of fused row r at layer l (valid once the loader has
 * done layer l), in host memory of dtype *dt. */
static const void *cached_row(const cb_blend_t *b, int r, int l, int which, cb_kv_dtype_t *dt) {
    const src_t *s = &b->srcs[b->src_of[r]];
    const size_t i = (size_t)(r - s->row0); /* the row within its chunk */
    const cb_kvmem_entry_t *e = s->kind == SRC_ENTRY ? s->entry : s->fill;
    if (e) {
        *dt = CB_KV_F32;
        return (which ? cb_kvmem_entry_v(e, l) : cb_kvmem_entry_k(e, l)) + i * (size_t)b->KVD;
    }
    const uint8_t *raw = which ? s->raw_v[l] : s->raw_k[l];
    *dt = s->dtype;
    return raw + i * cb_kv_row_bytes(s->dtype, (size_t)b->KVD);
}

/* QKV of every active row of layer l, the candidates' deviation on a measuring layer (into b->dev), RoPE,
 * and the rows' K/V into the sequence before any attention of the layer. t_sel gets the deviation time.
 * 0, or -1 (backend / pool). */
static int layer_qkv_rows(cb_blend_t *b, const run_t *R, int l, int n_act, bool meas, double *t_sel) {
    const int E = b->E, QD = b->QD, MR = b->max_rows, KVD = b->KVD;
    for (int i0 = 0; i0 < n_act; i0 += MR) {
        int n = n_act - i0 < MR ? n_act - i0 : MR;
        const int32_t *rows = b->act + i0; /* = their positions */
        float *q = b->q + (size_t)i0 * QD;
        cb_engine_layer_qkv(b->e, l, b->x + (size_t)i0 * E, n, q, b->kb, b->vb);
        if (meas) {
            double ts = cb_now_ms();
            const int which = R->metric == 'k' ? 0 : 1;
            const float *fresh = which ? b->vb : b->kb;
            for (int j = 0; j < n; j++) {
                int r = rows[j];
                if (b->cls[r] != CB_ROW_CANDIDATE) continue;
                cb_kv_dtype_t dt;
                const void *cached = cached_row(b, r, l, which, &dt);
                if (cb_engine_kv_deviation(b->e, 1, fresh + (size_t)j * KVD, &cached, dt, &b->dev[i0 + j]))
                    return -1;
            }
            *t_sel += cb_now_ms() - ts;
        }
        cb_engine_rope(b->e, l, q, n, b->hp->n_head, rows);
        cb_engine_rope(b->e, l, b->kb, n, b->hp->n_head_kv, rows);
        if (cb_engine_kv_write(b->e, b->seq, l, rows, n, b->kb, b->vb) != CB_ENGINE_OK) return -1;
    }
    return 0;
}

/* Sparse attention + MLP of active rows [i0, i0 + n), all sparse and of the chunk whose rows start at c0:
 * their keys are the kept blocks before the chunk's first block, then every block from it to the last
 * row's (ascending), each row up to itself. */
static void attn_sparse(cb_blend_t *b, const run_t *R, int l, int i0, int n, int c0) {
    const int bt = b->bt, first = c0 / bt, last = b->act[i0 + n - 1] / bt;
    int nb = 0;
    for (int k = 0; k < first; k++)
        if (b->blk_keep[k]) b->blk_list[nb++] = k;
    const int before = nb;
    for (int k = first; k <= last; k++) b->blk_list[nb++] = k;
    for (int j = 0; j < n; j++) b->ub_lim[j] = (before - first) * bt + b->act[i0 + j] + 1;
    if (R->sparse_hook) R->sparse_hook(R->hook_ud, l, n, b->act + i0, b->ub_lim, b->blk_list, nb, bt);
    cb_engine_layer_attn_mlp_blocks(b->e, b->seq, l, b->x + (size_t)i0 * b->E, b->q + (size_t)i0 * b->QD, n,
                                    b->blk_list, nb, b->ub_lim);
}

/* Which attention call row r joins: -1 dense, else the first row of its chunk (a sparse row). */
static int attn_group(const cb_blend_t *b, int r) { return b->sparse[r] ? b->srcs[b->src_of[r]].row0 : -1; }

/* b->ub_lim [n] of the dense active rows [i0, i0 + n): every earlier key; with attend, the hook is told of
 * their attention call. Their positions. */
static const int32_t *dense_limits(cb_blend_t *b, const run_t *R, int l, int i0, int n, bool attend) {
    const int32_t *pos = b->act + i0;
    for (int j = 0; j < n; j++) b->ub_lim[j] = pos[j] + 1;
    if (attend && R->hook) R->hook(R->hook_ud, l, n, pos, b->ub_lim);
    return pos;
}

/* Attention (exact causal limits) + MLP of active rows [a0, n_act) of layer l: runs of dense rows in
 * ubatches over every earlier key; runs of one chunk's sparse rows over their gathered blocks. On a layer
 * with a sliding window every row is dense: it sees only the keys of its window, which a gathered table
 * (whose key indices are not positions) could not bound. */
static void layer_attn_rows(cb_blend_t *b, const run_t *R, int l, int a0, int n_act) {
    const int MR = b->max_rows;
    const bool windowed = cb_model_layer(cb_engine_model(b->e), l)->window > 0;
    int i0 = a0;
    while (i0 < n_act) {
        const int c0 = windowed ? -1 : attn_group(b, b->act[i0]);
        int n = 1;
        while (n < MR && i0 + n < n_act && (windowed ? -1 : attn_group(b, b->act[i0 + n])) == c0) n++;
        if (c0 >= 0) {
            attn_sparse(b, R, l, i0, n, c0);
        } else {
            dense_limits(b, R, l, i0, n, true);
            cb_engine_layer_attn_mlp(b->e, b->seq, l, b->x + (size_t)i0 * b->E, b->q + (size_t)i0 * b->QD, n,
                                     b->ub_lim);
        }
        i0 += n;
    }
}

/* Begins a pass over the rows b->tok/cls/src_of [R->n] (sources in b->srcs) in b->seq (reserved for
 * [0, R->n)): the active rows (b->act) and their embeddings (b->x), and the loader thread that places the
 * cached rows layer by layer ahead of the compute (it keeps going between the caller's slices). 0, or -1
 * with err. */
int cb_blend_run_begin(cb_blend_t *b, run_t *R, char *err, size_t errlen) {
    const int E = b->E, MR = b->max_rows;
    int n_act = 0;
    for (int r = 0; r < R->n; r++)
        if (b->cls[r] != CB_ROW_LOADED) b->act[n_act++] = r;
    if (n_act == 0 || b->act[n_act - 1] != R->n - 1) {
        cb_set_err(err, errlen, "blend: the last row must be computed");
        return -1;
    }
    R->n_act = n_act;
    R->l_next = 0;
    R->fail_src = -1;
    R->t_load = R->t_wait = R->t_compute = R->t_select = 0.0;
    double t0 = cb_now_ms();
    for (int i0 = 0; i0 < n_act; i0 += MR) {
        int n = n_act - i0 < MR ? n_act - i0 : MR;
        for (int j = 0; j < n; j++) b->ub_tok[j] = b->tok[b->act[i0 + j]];
        cb_engine_embed(b->e, b->ub_tok, n, b->x + (size_t)i0 * E);
    }
    R->t_compute += cb_now_ms() - t0;
    R->any_src = b->n_srcs > 0 && !R->preloaded;
    b->ld_ready = 0;
    b->ld_stop = 0;
    b->ld_failed = 0;
    b->ld_run = R;
    b->ld_on = R->overlap && R->any_src && pthread_create(&b->ld_th, NULL, cb_blend_loader_main, b) == 0;
    return 0;
}


/* Layer R->l_next of a begun pass: wait for its cached rows; QKV of the active rows, K/V into the sequence
 * before any attention of the layer; on a measuring layer the selection; the probe's attention mass;
 * attention + MLP (at the last computing layer only the last row, whose residual feeds the logits). 0, 1
 * (a streamed layer failed its checksum: R->fail_*), or -1 (backend). */
int cb_blend_run_layer(cb_blend_t *b, run_t *R) {
    const int QD = b->QD;
    const int CL = R->compute_layers > 0 ? R->compute_layers : b->L; /* layers that compute */
    assert(CL <= b->L && (CL == b->L || !R->logits));
    const int l = R->l_next++;
    int n_act = R->n_act, rc;
    if (R->any_src && (rc = cb_blend_await_layer(b, R, l, b->ld_on)) != 0) return rc;
    if (l >= CL) return 0;
    double tc = cb_now_ms(), t_sel = 0.0;
    const bool meas = cb_blend_measuring(R, l);
    if (layer_qkv_rows(b, R, l, n_act, meas, &t_sel)) return -1;
    if (meas) {
        double ts = cb_now_ms();
        n_act = cb_blend_select_rows(b, R, n_act, cb_blend_target_at(R, l));
        t_sel += cb_now_ms() - ts;
        if (n_act < 0) return -1;
        R->n_act = n_act;
    }
    int a0 = 0;
    if (l == CL - 1) a0 = R->logits ? n_act - 1 : n_act;
    if (R->probe_rows > 0) {
        /* the probe rows (the last active ones: suffix rows, dense) add their attention mass; where they also
         * attend (every probe layer but the last), one call gives both, from the same probabilities */
        const int np = R->probe_rows < n_act ? R->probe_rows : n_act, p0 = n_act - np;
        const bool attend = a0 <= p0;
        assert(attn_group(b, b->act[p0]) < 0);
        layer_attn_rows(b, R, l, a0, attend ? p0 : n_act);
        dense_limits(b, R, l, p0, np, attend);
        const float *q = b->q + (size_t)p0 * QD;
        rc = attend ? cb_engine_layer_attn_mass_mlp(b->e, b->seq, l, b->x + (size_t)p0 * b->E, q, np, b->ub_lim, b->mass)
                    : cb_engine_attn_mass(b->e, b->seq, l, q, np, b->ub_lim, b->mass);
        if (rc != CB_ENGINE_OK) return -1;
    } else {
        layer_attn_rows(b, R, l, a0, n_act);
    }
    R->t_select += t_sel;
    R->t_compute += cb_now_ms() - tc - t_sel;
    return 0;
}

/* Ends a pass whose layers returned rc: the loader joined; on success the last row's logits. Returns rc
 * (-1 with err). */
int cb_blend_run_end(cb_blend_t *b, run_t *R, int rc, char *err, size_t errlen) {
    cb_blend_run_stop_loader(b);
    if (rc < 0) cb_set_err(err, errlen, "blend: the backend failed");
    if (rc) return rc;
    if (R->logits) {
        double tl = cb_now_ms();
        cb_engine_logits(b->e, b->x + (size_t)(R->n_act - 1) * b->E, R->logits);
        R->t_compute += cb_now_ms() - tl;
    }
    return 0;
}
