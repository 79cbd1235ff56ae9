/* blend: CacheBlend in the engine: a prompt assembled from a prefix, precomputed chunks and a suffix is
 * prefilled by fusing the chunks' cached KV with a selective recompute (docs/engine.md, "One CacheBlend").
 *
 * Prompt = prefix P (chat scaffolding + instruction + "Passages:") + chunks C1..Ck + suffix S (question +
 * assistant opening), the concatenation of the pieces' token arrays; fused positions 0..N-1.
 *
 * Chunk KV comes from the store (kv/kvstore.h: chunk keys, the context's exact KV, the walk memory tier ->
 * file -> compute -> store). The prefix P is the store's precompute context: its blocks are shared into
 * the request's sequence by reference (cb_seq_share), not loaded or computed again.
 *
 * Each row of the fused prompt has a class; the four modes differ only in the class assignment:
 *   LOADED     KV from the cache (pre-RoPE K rotated to the row's fused position, V as is), never computed;
 *   COMPUTED   recomputed at every layer;
 *   CANDIDATE  recomputed at layers 0..check_layer; at check_layer the deviation between fresh and cached
 *              KV (metric 'v': sum over kv_dim of (v - v_cached)^2; 'k': the same on pre-RoPE K) keeps
 *              the floor(ratio * #candidates) most deviating rows (ties: lower position first) recomputed
 *              at later layers; the others are LOADED from check_layer + 1 on. At the check layer itself
 *              the fresh K/V of every candidate stay in the sequence (they were computed anyway).
 *   mode      P          chunk rows                                  S
 *   full      COMPUTED   COMPUTED                                    COMPUTED
 *   prefix    LOADED     C1 LOADED (it was computed right after P:   COMPUTED
 *                        exact), later chunks COMPUTED
 *   reuse     LOADED     LOADED                                      COMPUTED
 *   blend     LOADED     CANDIDATE; the first lead_tokens rows of    COMPUTED
 *                        each chunk COMPUTED
 * Gradual filtering (paper §4.3, optional): start with gradual_ratio > ratio at the check layer and
 * shrink linearly to ratio at gradual_end_layer, re-measuring the deviation of the still-selected rows at
 * each layer in between (fresh vs cached at that layer) and dropping the least deviating ones.
 *
 * Metric 'a' (query-aware selection, our default; docs/eval.md): the KV deviation of SmolLM2 is spread
 * over many rows and the layer-1 set barely overlaps the deep layers' sets, so instead of a check layer a
 * probe pass runs first: every candidate (and every cached lead row) LOADED, only the suffix (and any
 * uncached rows) computed, and the last CB_BLEND_PROBE_ROWS suffix rows sum, at every layer and head, the
 * attention probability each key receives (cb_engine_attn_mass). The floor(ratio * #candidates) candidates
 * with the most mass (ties: lower position first) are then recomputed at every layer, the others LOADED
 * at every layer. The probe leaves every cached row in the sequence, so the main pass loads nothing more.
 * Costs one pass over the suffix rows; saves the check layer's full recompute. opts.probe_layers > 0
 * stops the probe's compute (and its measurement) after that many layers; it still places every layer's
 * cached rows. opts.probe_suffix > 0 computes only the last probe_suffix suffix rows in the probe, moved
 * to the rows right after the chunks (the suffix rows before them are absent from the probe's keys); the
 * main pass always computes the whole suffix at its own positions.
 *
 * Sparse keys (opts.sparse_keys = S > 0, metric 'a'; docs/eval.md): in the main pass a chosen candidate of
 * chunk c attends only the prefix's KV blocks, the blocks of chunk c up to itself (exact causal limit) and
 * the ceil(S * B) of the B KV blocks wholly inside the chunks (engine blocks of block_tokens rows) whose
 * rows received the most probe attention mass, those before chunk c. The recomputed rows are the ones the
 * question attends to; most of their attention cost was over keys far back in the other chunks, and the
 * probe says which of those the answer draws on. The suffix and every other computed row stay dense. The
 * gathered blocks go to the backend's attention as a block table (cb_engine_layer_attn_mlp_blocks), so
 * every backend runs it. S = 1 keeps every block (the dense keys, in per-chunk calls).
 *
 * Per layer: the LOADED rows' K/V are placed in the request's sequence (cb_engine_kv_load: converted and
 * re-rotated by the backend, by a loader thread that prepares layer l+1 while layer l computes, unless
 * opts.no_overlap); Q/K/V of every active row are computed (ubatches of cb_engine_max_rows) and written to
 * the sequence before any attention of the layer; then attention + MLP for the active rows only, each with
 * key limit pos + 1 (exact causal, never a bottom-right mask). MLP and residual run for the active rows
 * only. Every step is an engine primitive over the backend table (deviation, attention mass, top-k and row
 * compaction included), so the blend runs the same algorithm on every backend. After a successful
 * cb_blend_prefill the sequence holds the fused KV for positions [0, N) and decoding goes on with
 * cb_engine_decode(engine, seq, token, N, ...): blending is confined to prefill.
 *
 * Chunk lookup (the mode needs a chunk's KV) is the store's: memory tier, then the KV file (header
 * validated at open, each layer's checksum verified as it streams); any miss (kvfile.h reasons, including a
 * payload checksum failure found mid-stream, which restarts the prefill) makes the chunk be computed after
 * P, stored and then used. Chunks streamed from files join the memory tier after the prefill.
 *
 * Ownership: the store (and through it the engine) is borrowed and must outlive the blend object; the
 * sequence of a call is borrowed for the call. One blend object per store, used by one thread at a time,
 * one call at a time (the service runs one blend at a time, in slices, beside the decode of the others).
 * Memory: about (n_embd + n_head*head_dim) * 4 + 44 bytes per max_ctx position of activations and sparse-key
 * tables, plus 4 bytes per position of attention mass for metric a's probe; the KV is in the engine's pool.
 */
#ifndef CB_BLEND_H
#define CB_BLEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "format/kvfile.h"
#include "kv/kvmem.h"
#include "kv/kvstore.h"

typedef struct cb_blend cb_blend_t;

typedef enum { CB_BLEND_FULL = 0, CB_BLEND_PREFIX, CB_BLEND_REUSE, CB_BLEND_BLEND, CB_BLEND_MODE_COUNT_ } cb_blend_mode_t;

/* Row classes (see above). */
enum { CB_ROW_LOADED = 0, CB_ROW_COMPUTED = 1, CB_ROW_CANDIDATE = 2 };

/* Called before every attention call of a prefill (tests): n rows at positions pos [n] with key
 * limits key_limit [n] (arrays valid during the call only). */
typedef void (*cb_blend_attn_hook_t)(void *ud, int layer, int n, const int32_t *pos, const int32_t *key_limit);
/* Called before every sparse attention call (opts.sparse_keys; tests): n rows at positions pos [n] attend
 * the first key_limit[i] keys of the blocks blk [n_blk] (indices into the sequence's block table, each of
 * block_tokens positions) laid end to end. */
typedef void (*cb_blend_sparse_hook_t)(void *ud, int layer, int n, const int32_t *pos, const int32_t *key_limit,
                                       const int32_t *blk, int n_blk, int block_tokens);

typedef struct {
    cb_blend_mode_t mode;       /* default CB_BLEND_BLEND */
    float ratio;                /* recompute ratio of the candidate rows, 0..1 (default CB_BLEND_DEFAULT_RATIO) */
    int check_layer;            /* 0..n_layer-1 (default 1) */
    char metric;                /* 'v', 'k' (deviation at the check layer) or 'a' (attention from the suffix, in a
                                   probe pass; no check layer, no gradual filtering); default CB_BLEND_DEFAULT_METRIC */
    float gradual_ratio;        /* 0 = off; else start ratio at the check layer, ratio < it <= 1 */
    int gradual_end_layer;      /* with gradual_ratio: check_layer < it < n_layer, where ratio is reached */
    int lead_tokens;            /* first rows of each chunk always recomputed (blend mode), >= 0 */
    int probe_layers;           /* metric 'a': the probe measures attention in layers [0, probe_layers) and
                                   computes nothing above them; 0 = every layer (the default) */
    int probe_suffix;           /* metric 'a': the probe computes only the last probe_suffix rows of the suffix,
                                   moved up to follow the chunks; 0 = the whole suffix */
    float auto_target;          /* ratio = auto when > 0: per request, the candidates are recomputed in order of
                                   their score (attention mass for 'a', deviation for 'k'/'v') until the chosen
                                   ones hold this share of all candidates' score, but never fewer than
                                   floor(auto_floor * #candidates) nor more than ceil(auto_ceil * #candidates);
                                   >= 1: every candidate (blend then equals full). `ratio` is not used. 0 = off */
    float auto_cost_keys;       /* ratio = auto with metric 'a': > 0 ranks the candidates by attention mass per
                                   unit of recompute cost, cost(row at position p) = 1 + p / auto_cost_keys
                                   (the keys at which a row's attention costs as much as its matrix products);
                                   the coverage rule is unchanged. 0 = rank by mass alone */
    float auto_floor, auto_ceil;    /* ratio = auto's bounds, 0 <= floor <= ceil <= 1 (defaults below) */
    float sparse_keys;          /* metric 'a': > 0 makes the chosen candidates attend only to the prefix, their own
                                   chunk up to themselves and this share of the other earlier key blocks, those
                                   with the most probe attention mass (engine blocks of block_tokens rows); 0 =
                                   every earlier key (dense); 1 = every block (dense, gathered). No effect with
                                   metrics 'k' and 'v' (no probe) */
    bool no_overlap;            /* load each layer in the compute thread (serial), for comparison */
    cb_blend_attn_hook_t attn_hook; /* NULL = none (dense calls) */
    cb_blend_sparse_hook_t sparse_hook; /* NULL = none (sparse calls); both take attn_hook_ud */
    void *attn_hook_ud;
} cb_blend_opts_t;

#define CB_BLEND_DEFAULT_RATIO 0.15f
#define CB_BLEND_DEFAULT_CHECK_LAYER 1
#define CB_BLEND_DEFAULT_METRIC_NAME "a" /* measured on 100 MuSiQue examples: agree_f1 0.783 vs 0.746 for 'v',
                                            first-token KL 0.026 vs 0.058 (docs/eval.md) */
#define CB_BLEND_DEFAULT_METRIC (CB_BLEND_DEFAULT_METRIC_NAME[0]) /* the same, as a character */
#define CB_BLEND_PROBE_ROWS 16 /* metric 'a': the last suffix rows whose attention is measured */
#define CB_BLEND_DEFAULT_PROBE_LAYERS 0 /* 0 = all layers */
#define CB_BLEND_DEFAULT_PROBE_SUFFIX 16 /* measured on 100 MuSiQue examples against the whole suffix: the same
                                           first-token KL (0.0254 vs 0.0255), agree_f1 0.801 vs 0.805, TTFT
                                           ratio 0.236 vs 0.245 (docs/eval.md) */
#define CB_BLEND_DEFAULT_AUTO_TARGET 0.9f /* ratio = auto: the share of the candidates' score (metric a: attention
                                            mass) to cover. Measured on the first 20 MuSiQue dev examples (1 thread,
                                            docs/eval.md): 0.9 chose 16-25 % of the candidates (mean 19 %) for
                                            first-token KL 0.027 and agree_f1 0.827, against 0.030 / 0.827 at the
                                            fixed 0.15; 0.8 chose 8-11 % for 0.038 / 0.799; 0.5 sits on the floor */
#define CB_BLEND_DEFAULT_AUTO_FLOOR 0.02f /* ratio = auto: at least 2 % of the candidates */
#define CB_BLEND_DEFAULT_AUTO_CEIL 0.40f  /* ... and at most 40 % */
#define CB_BLEND_AUTO_COST_KEYS_MAX 1e8f /* auto_cost_keys' upper bound (config, cb-eval, opts) */
#define CB_BLEND_DEFAULT_AUTO_COST_KEYS 0.0f /* ratio = auto: rank by mass alone. 3000 gave KL -0.0031 (se 0.0016)
                                               on 40 MuSiQue examples (AMX), +0.0012 (0.0012) on 20 (AVX2): off
                                               until a larger run settles it (docs/eval.md) */
#define CB_BLEND_DEFAULT_SPARSE_KEYS 0.5f /* all 100 MuSiQue dev examples, ratio = auto (docs/eval.md): first-token
                                             KL 0.0321 against the dense fixed 0.15's 0.0318 (paired +0.0002, se
                                             0.0014) at 0.199 of full's TTFT against 0.251 (dense auto: 0.306);
                                             0.25 reached 0.144 for KL 0.0365 (+0.0046, se 0.0015); the fixed
                                             0.15 with 0.5: +0.0021 (0.0014) at 0.168 */
#define CB_BLEND_DEFAULT_LEAD 0 /* measured with metric a: 4 lead tokens per chunk gave the same first-token KL
                                   for 3 % more recomputed rows (with metric v, -2.5 % KL; docs/eval.md) */

/* Fills the defaults above (mode blend). */
void cb_blend_opts_default(cb_blend_opts_t *o);
/* "full" | "prefix" | "reuse" | "blend"; "?" when out of range. */
const char *cb_blend_mode_str(cb_blend_mode_t m);
/* Parses a mode name; -1 when unknown. */
int cb_blend_mode_parse(const char *s);
/* Parses a metric name ("a", "k" or "v"); the metric character, or 0 when unknown. */
char cb_blend_metric_parse(const char *s);

/* Where one chunk's KV came from in a prefill. */
typedef struct {
    cb_kvstore_src_t src;       /* CB_KVSTORE_COMPUTED when it was computed in any attempt of the call (its KV
                                   file is new); else MEM or FILE */
    cb_kv_miss_t why;           /* COMPUTED: why the cached KV was not used (NOT_FOUND, a bad header, or the
                                   checksum failure that restarted the prefill); CB_KV_OK otherwise */
    bool stored;                /* COMPUTED: its KV file was written (false: the write failed, or no file tier) */
    uint8_t key[32];            /* the chunk key */
} cb_blend_chunk_info_t;

typedef struct {
    int n_tokens;               /* N */
    int tokens_reused;          /* N - tokens_recomputed */
    int tokens_recomputed;      /* rows active at the last layer */
    int n_candidates;           /* CANDIDATE rows */
    int n_chosen;               /* of them, the ones recomputed past the selection (fixed ratio or auto) */
    float ratio_chosen;         /* n_chosen / n_candidates (0 without candidates): with ratio = auto, the ratio
                                   this request chose */
    int n_forced;               /* COMPUTED rows (suffix, lead tokens, chunks without KV, ...) */
    int chunks_mem;             /* chunks whose KV came from the memory tier */
    int chunks_file;            /* ... streamed from a KV file */
    int chunks_computed;        /* ... computed now (misses), then stored; the three add up to n_chunks_read */
    int restarts;               /* prefills restarted after a payload checksum failure */
    int n_slices;               /* cb_blend_step calls it took (1 for cb_blend_prefill) */
    double t_total_ms;          /* the call's work: its start and every slice (not the time between slices) */
    double t_resolve_ms;        /* chunk lookups (memory tier, file opens) and miss computation */
    double t_load_ms;           /* loader work (decode, rotate, place into the sequence), on whichever thread */
    double t_load_wait_ms;      /* compute thread blocked on the loader (= t_load_ms when serial) */
    double t_compute_ms;        /* layer compute (QKV, attention, MLP, logits) */
    double t_select_ms;         /* deviations and selection */
    double t_probe_ms;          /* metric 'a': the probe pass (its load and compute also count above) */
    const int32_t *selected;    /* [tokens_recomputed] positions active at the last layer, ascending;
                                   owned by the blend object, valid until its next call */
    int n_chunks_read;          /* chunks the mode read from the store (the first 0, 1 or n_chunks) */
    const cb_blend_chunk_info_t *chunks; /* [n_chunks_read] where each came from; owned by the blend object,
                                            valid until its next call */
} cb_blend_stats_t;

/* A chunk of the prompt: token ids [n] (borrowed). */
typedef struct {
    const int32_t *tokens;
    int n;
} cb_blend_chunk_t;

/* Creates a blend over store (borrowed). NULL + err on failure. Caller owns the result (cb_blend_destroy). */
cb_blend_t *cb_blend_new(cb_kvstore_t *store, char *err, size_t errlen);
void cb_blend_destroy(cb_blend_t **self_p);
cb_kvstore_t *cb_blend_store(const cb_blend_t *self);

/* The fused prefill of prefix [n_prefix] + chunks [n_chunks] + suffix [n_suffix] under opts (NULL =
 * defaults) into seq (borrowed; cleared first, then holding the fused KV of positions [0, N)). n_prefix >= 1
 * (the precompute context), n_suffix >= 1, chunks may be empty (n_chunks 0) but not of length 0; N = total
 * <= cb_engine_max_ctx. logits [n_vocab] gets the last row's logits (NULL: skipped). stats (may be NULL) is
 * filled. Returns CB_ENGINE_OK, or with err: CB_ENGINE_EPOOL when the KV pool has no room for the request
 * (the service's `overloaded`), CB_ENGINE_EINVAL for bad arguments (sizes, token ids out of the vocabulary,
 * options out of range), -1 for anything else (out of memory, unrecoverable store failure, backend
 * failure). A missing chunk is computed and stored first, which counts in the call's time. */
int cb_blend_prefill(cb_blend_t *self, cb_seq_t *seq, const int32_t *prefix, int n_prefix,
                     const cb_blend_chunk_t *chunks, int n_chunks, const int32_t *suffix, int n_suffix,
                     const cb_blend_opts_t *opts, float *logits, cb_blend_stats_t *stats, char *err, size_t errlen);
/* The same call in slices, so that a caller can run other work (the decode steps of other sequences)
 * between them: cb_blend_start validates the request (CB_ENGINE_EINVAL, nothing started) and takes the
 * call's arguments, which stay borrowed until the call ends (the chunk list itself is copied); then each
 * cb_blend_step runs the call's next units of work until about budget_tokens tokens' worth of prefill
 * compute is done (a unit is one layer of a pass over its active rows, or the lookup of one chunk; a
 * chunk that must be computed costs its tokens; budget_tokens <= 0: to the end). It returns CB_BLEND_MORE
 * while work is left, CB_ENGINE_OK when the call ended well (logits and stats written, as
 * cb_blend_prefill), or cb_blend_prefill's failures (the call ended, the sequence cleared). Between slices
 * the blend's loader thread may go on placing cached rows into seq (only seq's own reserved blocks), so the
 * caller may use the engine for other sequences meanwhile but must not touch seq. One call at a time per
 * blend object: cb_blend_start while one is in progress is CB_ENGINE_EINVAL. cb_blend_prefill is
 * cb_blend_start + one unbounded slice. */
#define CB_BLEND_MORE 1
int cb_blend_start(cb_blend_t *self, cb_seq_t *seq, const int32_t *prefix, int n_prefix,
                   const cb_blend_chunk_t *chunks, int n_chunks, const int32_t *suffix, int n_suffix,
                   const cb_blend_opts_t *opts, float *logits, char *err, size_t errlen);
int cb_blend_step(cb_blend_t *self, int budget_tokens, cb_blend_stats_t *stats, char *err, size_t errlen);
/* A call is in progress. */
bool cb_blend_busy(const cb_blend_t *self);
/* Ends the call in progress, if any (the client went away): the loader joined, the sequence cleared. */
void cb_blend_cancel(cb_blend_t *self);
#endif
