/* blend_internal.h: what the fused prefill's source files share; not for use outside libshared/blend.
 *   blend.c         options, lifetime, request checks, a call in slices (cb_blend_start/step/prefill);
 *   blend_rows.c    a request's rows: tokens, classes, the chunk sources, the sequence's blocks;
 *   blend_loader.c  the loader: cached K/V placed layer by layer, in its thread or inline;
 *   blend_select.c  which candidates are recomputed: top-k by deviation, ratio = auto, metric a's probe,
 *                   sparse attention's key blocks;
 *   blend_pass.c    a pass over the layers: QKV, deviation, selection, attention + MLP, logits.
 * Here: the sources, the pass and the call's state, the object's layout, and the functions one file
 * defines for another. */
#ifndef CB_BLEND_INTERNAL_H
#define CB_BLEND_INTERNAL_H

#include "blend/blend.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---------------------------------------------------------------- types */

enum { SRC_ENTRY = 0, SRC_FILE = 1 };

typedef struct {
    int kind;                  /* SRC_ENTRY: decoded f32; SRC_FILE: streamed from a KV file */
    int row0, n;               /* fused rows [row0, row0 + n) */
    int chunk;                 /* chunk index */
    cb_kvmem_entry_t *entry;   /* SRC_ENTRY: our reference */
    cb_kvfile_t *file;         /* SRC_FILE: open handle (owned) */
    cb_kvmem_entry_t *fill;    /* SRC_FILE with a memory tier or a dtype the backend does not load: entry decoded
                                * layer by layer (owned ref) */
    cb_kv_dtype_t dtype;       /* SRC_FILE: payload dtype */
    const void **raw_k;        /* SRC_FILE without fill: [n_layer] layer's K/V in the mapping (set by the loader) */
    const void **raw_v;
    uint8_t key[32];
    int n_loaded, n_cand;      /* rows of each class in this source (set with the classes) */
} src_t;

typedef struct {
    int n;                     /* rows N */
    bool blend;                /* candidates exist: measuring layers apply */
    int check_layer;
    int grad_end;              /* last measuring layer (= check_layer when gradual is off) */
    float ratio, start_ratio;
    float auto_target, auto_floor, auto_ceil; /* ratio = auto (auto_target > 0) */
    float auto_cost_keys;      /* ratio = auto, metric a: rank by mass per cost (0 = by mass) */
    int n_chosen;              /* candidates kept by the (last) selection; -1 before one */
    char metric;
    bool overlap;
    int n_cand_total;
    float *logits;             /* NULL: skip the LM head (and the last layer's attention/MLP) */
    cb_blend_attn_hook_t hook;
    cb_blend_sparse_hook_t sparse_hook;
    void *hook_ud;
    bool preloaded;            /* every LOADED row's K/V is already in the sequence, at every layer */
    int probe_rows;            /* > 0: a probe pass (metric 'a'); the last probe_rows active rows add their
                                  attention mass over keys into b->mass at every layer */
    int compute_layers;        /* > 0: layers [compute_layers, L) only place their cached rows (a probe that
                                  stops early; needs logits == NULL); 0 = every layer computes */
    /* the pass in progress (cb_blend_run_begin .. cb_blend_run_end) */
    int l_next;                /* the next layer to run */
    int n_act;                 /* active rows (b->act) */
    bool any_src;              /* some LOADED row is still to be placed (the loader has work) */
    /* out */
    double t_load, t_wait, t_compute, t_select;
    int fail_src;              /* source whose layer failed its checksum (-1 none) */
    cb_kv_miss_t fail_why;
} run_t;

typedef enum { PH_IDLE = 0, PH_RESOLVE, PH_PROBE, PH_MAIN } phase_t;

/* A fused prefill in progress (cb_blend_start .. the cb_blend_step that ends it). */
typedef struct {
    phase_t ph;
    cb_seq_t *seq;             /* borrowed for the call */
    const int32_t *prefix, *suffix; /* [n_prefix], [n_suffix] borrowed for the call */
    int n_prefix, n_suffix;
    cb_blend_chunk_t *chunks;  /* [cap_chunks] a copy of the caller's list (the tokens stay borrowed) */
    cb_kvstore_chunk_t *rs;    /* [cap_chunks] the chunks resolved in this attempt */
    uint8_t *force;            /* [cap_chunks] 1: the chunk's file failed mid-stream; compute it */
    int n_chunks, cap_chunks;
    cb_blend_opts_t opts;
    float *logits;             /* [n_vocab] borrowed, or NULL */
    int N, n_need;             /* prompt rows; chunks the mode reads from the store (the first n_need) */
    int attempt, c_next;       /* restarts so far; the next chunk to resolve */
    bool ctx_ok;               /* the store's context is set for this attempt */
    run_t R, P;                /* the main pass; metric a's probe pass */
    run_t *cur;                /* the pass running (&R or &P), NULL before the first */
    int n_probe;               /* probe: the suffix rows it computes */
    bool moved;                /* probe: they were moved up to follow the chunks */
    cb_blend_stats_t st;
} job_t;

struct cb_blend {
    cb_kvstore_t *store;       /* borrowed */
    cb_engine_t *e;            /* the store's */
    cb_seq_t *seq;             /* the sequence of the current call (borrowed) */
    const cb_hparams_t *hp;
    int L, E, QD, KVD, HD, max_ctx, max_rows;

    float *x;                  /* [max_ctx][E] residual stream of the active rows (compact, ascending) */
    float *q;                  /* [max_ctx][QD] post-RoPE queries of the active rows */
    float *kb, *vb;            /* [max_rows][KVD] one ubatch's fresh K (pre-RoPE, then rotated) and V */
    int32_t *tok;              /* [max_ctx] prompt tokens */
    uint8_t *cls;              /* [max_ctx] CB_ROW_* */
    int32_t *src_of;           /* [max_ctx] source index or -1 */
    int32_t *act;              /* [max_ctx] active rows (positions), ascending */
    double *dev;               /* [max_ctx] deviation of active index i (candidates) */
    double *wdev;              /* [max_ctx] the candidates' ranking score (auto_cost_keys) */
    int32_t *order;            /* [max_ctx] scratch for selection */
    int32_t *cand;             /* [max_ctx] scratch for selection */
    uint8_t *keep;             /* [max_ctx] */
    int32_t *ub_lim, *ub_tok;  /* [max_rows] */
    float *mass;               /* [max_ctx] attention mass each row receives in a probe pass (metric 'a') */
    uint8_t *sparse;           /* [max_ctx] 1: the row attends sparsely in the main pass (opts.sparse_keys; all 0
                                  before the probe, so the probe pass is dense) */
    uint8_t *blk_keep;         /* [max_ctx] per KV block: 1 = every sparse row before it attends it */
    int32_t *blk_list;         /* [max_ctx] a sparse call's gathered block indices */
    double *blk_mass;          /* [max_ctx] per KV block: probe mass */
    int bt;                    /* engine positions per KV block */

    src_t *srcs;               /* [cap_srcs] */
    int n_srcs, cap_srcs;
    cb_blend_chunk_info_t *info; /* [cap_info] the last call's chunks (stats.chunks) */
    int cap_info;

    /* loader synchronisation of a run */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ld_ready;              /* layers the loader has finished */
    int ld_stop, ld_failed;
    run_t *ld_run;             /* the pass it loads for */
    pthread_t ld_th;
    bool ld_on;                /* the loader thread is running (joined by cb_blend_run_stop_loader) */

    job_t job;                 /* the call in progress */
};

/* ---------------------------------------------------------------- shared */

static inline bool cb_blend_measuring(const run_t *R, int l) { return R->blend && l >= R->check_layer && l <= R->grad_end; }

/* blend_rows.c */
void cb_blend_release_srcs(cb_blend_t *b);
int cb_blend_build_rows(cb_blend_t *b, cb_blend_mode_t mode, const int32_t *prefix, int n_prefix,
               const cb_blend_chunk_t *chunks, int n_chunks, int n_need, cb_kvstore_chunk_t *rs,
               const int32_t *suffix, int n_suffix, int lead_tokens);
int cb_blend_prepare_seq(cb_blend_t *b, cb_seq_t *seq, cb_blend_mode_t mode, int n_prefix, int N, char *err,
                size_t errlen);
/* blend_loader.c */
void *cb_blend_loader_main(void *arg);
int cb_blend_await_layer(cb_blend_t *b, run_t *R, int l, bool threaded);
void cb_blend_run_stop_loader(cb_blend_t *b);
/* blend_select.c */
int cb_blend_select_rows(cb_blend_t *b, run_t *R, int n_act, int target);
int cb_blend_target_at(const run_t *R, int l);
int cb_blend_probe_setup(cb_blend_t *b, job_t *J);
int cb_blend_probe_finish(cb_blend_t *b, job_t *J, char *err, size_t errlen);
/* blend_pass.c */
void cb_blend_run_init(run_t *R, int n);
int cb_blend_run_begin(cb_blend_t *b, run_t *R, char *err, size_t errlen);
int cb_blend_run_layer(cb_blend_t *b, run_t *R);
int cb_blend_run_end(cb_blend_t *b, run_t *R, int rc, char *err, size_t errlen);

#endif
