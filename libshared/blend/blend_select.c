/* blend_select.c: which candidate rows are recomputed: the most deviating at a measuring layer (the
 * backend's top-k), ratio = auto's count, gradual filtering's target per layer, and metric a: the probe
 * pass set up, its attention mass ranked, the chosen rows' sparse key blocks. Part of blend
 * (blend_internal.h). */
#include "blend/blend_internal.h"

#include <math.h>
#include <string.h>

#include "base/err.h"

/* ratio = auto's count for scores s [m] (>= 0; NaN and negative count as 0) whose order best first is
 * order [m]: the fewest leading candidates whose scores sum to at least `target` of the total, clamped to
 * [floor(fl * m), ceil(ce * m)]; target >= 1: m. Deterministic: the order is the backend's top-k (ties to
 * the lower position). A total of 0 (no signal) gives the floor. */
static int auto_count(const double *s, const int32_t *order, int m, float target, float fl, float ce) {
    if (m <= 0) return 0;
    if (target >= 1.0f) return m;
    int lo = (int)floor((double)fl * m + 1e-9), hi = (int)ceil((double)ce * m - 1e-9);
    if (hi > m) hi = m;
    if (lo > hi) lo = hi;
    double total = 0.0;
    for (int i = 0; i < m; i++) total += s[i] > 0.0 ? s[i] : 0.0; /* NaN > 0 is false */
    int k = 0;
    if (total > 0.0) {
        double want = (double)target * total, acc = 0.0;
        while (k < m && acc < want) {
            double v = s[order[k]];
            acc += v > 0.0 ? v : 0.0;
            k++;
        }
    }
    return k < lo ? lo : k > hi ? hi : k;
}

/* ratio = auto over the candidates' scores b->dev [m]: sorts them all into b->order (best first) and
 * returns the count to keep, or -1 when the backend failed. */
static int auto_target_count(cb_blend_t *b, const run_t *R, int m) {
    if (R->auto_target >= 1.0f || m <= 0) return m;
    if (cb_engine_topk(b->e, m, b->dev, m, b->order) != CB_ENGINE_OK) return -1;
    return auto_count(b->dev, b->order, m, R->auto_target, R->auto_floor, R->auto_ceil);
}

/* Keeps the forced rows and the `target` most deviating candidates among the active rows (the backend's
 * top-k: NaN first, ties to the lower position); compacts act, x and q (the backend's row compaction).
 * Returns the new active count, or -1 when the backend failed. */
int cb_blend_select_rows(cb_blend_t *b, run_t *R, int n_act, int target) {
    int m = 0;
    for (int i = 0; i < n_act; i++)
        if (b->cls[b->act[i]] == CB_ROW_CANDIDATE) b->cand[m++] = i;
    for (int k = 0; k < m; k++) b->dev[k] = b->dev[b->cand[k]]; /* candidates' deviations, ascending rows */
    bool sorted = false;
    if (R->auto_target > 0.0f && (target = auto_target_count(b, R, m)) < 0) return -1;
    sorted = R->auto_target > 0.0f && R->auto_target < 1.0f && m > 0; /* b->order holds all m, best first */
    if (target < 0) target = 0;
    R->n_chosen = target < m ? target : m;
    if (target >= m) return n_act;
    if (!sorted && cb_engine_topk(b->e, m, b->dev, target, b->order) != CB_ENGINE_OK) return -1;
    for (int i = 0; i < n_act; i++) b->keep[i] = b->cls[b->act[i]] != CB_ROW_CANDIDATE;
    for (int j = 0; j < target; j++) b->keep[b->cand[b->order[j]]] = 1;
    int k = 0;
    for (int i = 0; i < n_act; i++)
        if (b->keep[i]) b->cand[k++] = i; /* the kept active indices, ascending */
    for (int j = 0; j < k; j++) b->act[j] = b->act[b->cand[j]];
    cb_engine_compact_rows(b->e, b->x, (size_t)b->E, b->cand, k);
    cb_engine_compact_rows(b->e, b->q, (size_t)b->QD, b->cand, k);
    return k;
}

/* Metric 'a': b->order [m] holds the candidate rows (ascending), b->dev [m] their attention mass. Makes
 * the `target` most attended (ties: lower position first) COMPUTED; the others stay LOADED. 0 or -1. */
static int select_by_mass(cb_blend_t *b, int m, int target, const double *rank) {
    if (target > m) target = m;
    if (cb_engine_topk(b->e, m, rank, target, b->cand) != CB_ENGINE_OK) return -1;
    for (int j = 0; j < target; j++) {
        int r = b->order[b->cand[j]];
        b->cls[r] = CB_ROW_COMPUTED;
        b->srcs[b->src_of[r]].n_loaded--;
    }
    return 0;
}

/* Target count of candidates kept at measuring layer l. */
int cb_blend_target_at(const run_t *R, int l) {
    double r = R->ratio;
    if (R->grad_end > R->check_layer) {
        double f = (double)(l - R->check_layer) / (double)(R->grad_end - R->check_layer);
        r = R->start_ratio + ((double)R->ratio - R->start_ratio) * f;
    }
    return (int)floor(r * (double)R->n_cand_total + 1e-6);
}

/* Metric 'a' (query-aware selection): every candidate and every cached forced row is LOADED for a probe
 * pass in which the last suffix rows measure the attention mass each key receives (summed over heads,
 * rows and layers); the `target` most attended candidates then become COMPUTED (recomputed at every
 * layer) and the others LOADED at every layer: no check layer, so R->blend is cleared. The probe leaves
 * every cached row's K/V in the sequence, so the main pass loads nothing (R->preloaded). No probe when
 * the target is 0 or every candidate. This sets the probe up (J->P); 1 when it is to run, 0 when not. */
int cb_blend_probe_setup(cb_blend_t *b, job_t *J) {
    run_t *R = &J->R;
    const int N = J->N;
    const int target = R->auto_target > 0.0f ? (R->auto_target >= 1.0f ? R->n_cand_total : 1) /* decided after the probe */
                                              : cb_blend_target_at(R, R->check_layer);
    R->blend = false;
    if (target <= 0 || target >= R->n_cand_total) {
        R->n_chosen = target > 0 ? R->n_cand_total : 0;
        for (int i = 0; i < N; i++)
            if (b->cls[i] == CB_ROW_CANDIDATE) {
                src_t *s = &b->srcs[b->src_of[i]];
                s->n_cand--;
                if (target > 0) b->cls[i] = CB_ROW_COMPUTED;
                else b->cls[i] = CB_ROW_LOADED, s->n_loaded++;
            }
        return 0;
    }
    /* keep: 1 = candidate, 2 = forced row with cached KV (both LOADED during the probe), 0 = unchanged */
    for (int i = 0; i < N; i++) {
        b->keep[i] = b->cls[i] == CB_ROW_CANDIDATE ? 1 : b->cls[i] == CB_ROW_COMPUTED && b->src_of[i] >= 0 ? 2 : 0;
        if (b->keep[i]) b->cls[i] = CB_ROW_LOADED, b->srcs[b->src_of[i]].n_loaded++;
    }
    for (int i = 0; i < b->n_srcs; i++) b->srcs[i].n_cand = 0;
    /* a short probe runs only the last probe_suffix suffix rows, moved to the rows right after the chunks
     * (their positions shift down by the rows left out; the main pass recomputes the whole suffix) */
    const int s0 = N - J->n_suffix, ps = J->opts.probe_suffix;
    J->n_probe = ps > 0 && ps < J->n_suffix ? ps : J->n_suffix;
    J->moved = J->n_probe < J->n_suffix;
    run_t *P = &J->P;
    *P = *R;
    P->n = s0 + J->n_probe;
    P->logits = NULL;
    P->probe_rows = J->n_probe < CB_BLEND_PROBE_ROWS ? J->n_probe : CB_BLEND_PROBE_ROWS;
    if (J->opts.probe_layers > 0) P->compute_layers = J->opts.probe_layers;
    if (J->moved) memmove(b->tok + s0, b->tok + N - J->n_probe, sizeof(int32_t) * (size_t)J->n_probe);
    memset(b->mass, 0, sizeof(float) * (size_t)N);
    return 1;
}

/* opts.sparse_keys after the selection: the chosen candidates (b->order maps candidate -> row, and
 * b->cand [n_chosen] the chosen ones' indices) attend sparsely; the KV blocks wholly inside the chunks are
 * ranked by their rows' probe mass and the top share kept (the prefix's blocks always). 0, or -1 (backend). */
static int sparse_setup(cb_blend_t *b, job_t *J) {
    const int bt = b->bt, s0 = J->N - J->n_suffix;
    const int p_end = (J->n_prefix + bt - 1) / bt, c_end = s0 / bt; /* chunk blocks [p_end, c_end) */
    for (int j = 0; j < J->R.n_chosen; j++) b->sparse[b->order[b->cand[j]]] = 1;
    memset(b->blk_keep, 0, (size_t)(c_end > p_end ? c_end : p_end));
    memset(b->blk_keep, 1, (size_t)p_end);
    const int nc = c_end - p_end;
    if (nc <= 0) return 0;
    for (int k = 0; k < nc; k++) {
        double sm = 0.0;
        for (int r = (p_end + k) * bt; r < (p_end + k + 1) * bt; r++) sm += b->mass[r];
        b->blk_mass[k] = sm;
    }
    int keep = (int)ceil((double)J->opts.sparse_keys * nc - 1e-9);
    if (keep > nc) keep = nc;
    if (keep <= 0) return 0;
    if (cb_engine_topk(b->e, nc, b->blk_mass, keep, b->blk_list) != CB_ENGINE_OK) return -1;
    for (int k = 0; k < keep; k++) b->blk_keep[p_end + b->blk_list[k]] = 1;
    return 0;
}

/* After a successful probe pass: the most attended candidates COMPUTED, the rest LOADED; the main pass
 * only overwrites its computed rows (the probe placed every cached row of every layer and verified the
 * files). 0, or -1 with err. */
int cb_blend_probe_finish(cb_blend_t *b, job_t *J, char *err, size_t errlen) {
    run_t *R = &J->R;
    const int N = J->N;
    int m = 0;
    for (int i = 0; i < N; i++) {
        if (b->keep[i] == 1) b->order[m++] = i;
        if (b->keep[i] == 2) b->cls[i] = CB_ROW_COMPUTED, b->srcs[b->src_of[i]].n_loaded--;
    }
    for (int i = 0; i < m; i++) b->dev[i] = b->mass[b->order[i]];
    const double *rank = b->dev;
    const double p0 = R->auto_cost_keys;
    if (R->auto_target > 0.0f && p0 > 0.0) { /* mass per unit cost: later rows attend over more keys */
        for (int i = 0; i < m; i++) b->wdev[i] = b->dev[i] / (1.0 + (double)b->order[i] / p0);
        rank = b->wdev;
    }
    int target = cb_blend_target_at(R, R->check_layer);
    if (R->auto_target > 0.0f) {
        /* auto: the count from the sorted masses; b->order still maps candidate index -> row, so sort into cand */
        if (R->auto_target >= 1.0f) target = m;
        else if (cb_engine_topk(b->e, m, rank, m, b->cand) != CB_ENGINE_OK) target = -1;
        else target = auto_count(b->dev, b->cand, m, R->auto_target, R->auto_floor, R->auto_ceil);
    }
    R->n_chosen = target < m ? target : m;
    if (target < 0 || select_by_mass(b, m, target, rank)) {
        cb_set_err(err, errlen, "blend: the backend failed (top-k)");
        return -1;
    }
    R->preloaded = true;
    if (J->opts.sparse_keys > 0.0f && sparse_setup(b, J) != 0) {
        cb_set_err(err, errlen, "blend: the backend failed (top-k)");
        return -1;
    }
    return 0;
}
