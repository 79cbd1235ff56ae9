/* kvstore: where a chunk's KV comes from. Chunk keys, the precompute context's KV, and the walk
 * memory tier -> KV file -> remote tier (Redis, optional) -> compute -> store that every user of chunk KV
 * goes through (cb-blend's blend, cb-precompute's worker, the tools).
 *
 * A chunk is precomputed after a fixed precompute context P (positions |P|..|P|+n-1): per layer its
 * pre-RoPE K and its V, stored as a KV file (format/kvfile.h) keyed by
 *     cb_kvfile_key(model fingerprint, cb_kvfile_ctx_fp(model fingerprint, P), chunk tokens)
 * and/or in the memory tier (kv/kvmem.h) under the same key. P's own KV is exact (nothing precedes it):
 * the store computes it once per distinct context into an engine sequence (cb_kvstore_context_seq) whose
 * blocks requests share by reference (cb_seq_share). A chunk is computed with a plain prefill of the
 * chunk after P (cb_engine_prefill_capture on a sequence sharing P's blocks), rounded through the file
 * dtype, so a chunk computed now gives exactly what the same chunk read back from its file gives.
 *
 * Lookup: memory tier (an entry that does not fit its key is dropped), then the KV file (header validated
 * against model, context and tokens at open; payload checksums verified as layers are read); any miss
 * reason makes the chunk be computed and stored (file + memory tier, when configured). Chunks decoded from
 * files join the memory tier.
 *
 * Remote tier (kv/kvremote.h, cb_kvstore_set_remote; docs/kvremote.md): after a file miss the chunk is
 * looked up in Redis. A value is a whole KV file and is verified exactly as a file from disk (header,
 * key, model, context, geometry, tokens, every payload checksum) before any of it is used; one that fails
 * is a miss (counted as corrupt and deleted from Redis), never an error. A value that verifies is written
 * as the local KV file (the atomic file writer, in the value's own dtype: the same bytes), and the chunk is
 * used from that file like any file hit (src FILE, `remote` set). A chunk computed and stored is also put
 * in Redis (the bytes of its new file; needs kv_dir). cb_kvstore_ensure also refills Redis: a chunk found
 * in its local file but absent from Redis is put there (EXISTS, then SET), so a Redis restarted empty is
 * refilled by re-ingest. A remote tier that is down or slow costs at most its timeouts (then it is skipped
 * until its recovery interval ends): the chunk is computed, as without one; never an error.
 *
 * Ownership: the engine, the memory tier (may be NULL), the remote tier (may be NULL) and kv_dir (may be
 * NULL: no files) are borrowed and must outlive the store. One thread at a time; the store uses (and clears) sequences of its own in the
 * engine's pool. Memory: the context's blocks in the pool, one chunk of f32 capture buffers while one is
 * computed.
 */
#ifndef CB_KVSTORE_H
#define CB_KVSTORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "format/kvfile.h"
#include "kv/kvmem.h"
#include "kv/kvremote.h"

typedef struct cb_kvstore cb_kvstore_t;

/* Where a chunk's KV was found. */
typedef enum { CB_KVSTORE_MEM = 0, CB_KVSTORE_FILE, CB_KVSTORE_COMPUTED } cb_kvstore_src_t;
const char *cb_kvstore_src_str(cb_kvstore_src_t s); /* "mem" | "file" | "computed" */

/* A store over engine (borrowed). kv_dir: directory of chunk KV files (must exist; NULL = no file tier).
 * mem: memory tier (borrowed; NULL = none). Files are written with dtype (CB_KV_F16 is the default
 * choice). NULL + err on failure (bad dtype, kv_dir not a directory or too long for chunk file names, model
 * geometry outside the KV file limits, out of memory). Caller owns the result (cb_kvstore_destroy). */
cb_kvstore_t *cb_kvstore_new(cb_engine_t *engine, const char *kv_dir, cb_kvmem_t *mem, cb_kv_dtype_t dtype,
                             char *err, size_t errlen);
void cb_kvstore_destroy(cb_kvstore_t **self_p);

cb_engine_t *cb_kvstore_engine(const cb_kvstore_t *self);
cb_kvmem_t *cb_kvstore_mem(const cb_kvstore_t *self);
cb_kv_dtype_t cb_kvstore_dtype(const cb_kvstore_t *self);
/* Sets the remote tier (borrowed, thread-safe, may be shared by several stores; NULL = none) behind the
 * memory and file tiers (see above). Call before the store is used. */
void cb_kvstore_set_remote(cb_kvstore_t *self, cb_kvremote_t *remote);
cb_kvremote_t *cb_kvstore_remote(const cb_kvstore_t *self);

/* Makes ctx [n_ctx] (n_ctx >= 1) the precompute context: its exact KV is computed (unless it is the current
 * one) into the context sequence. 0, or with err CB_ENGINE_EPOOL (the pool has no room) or -1 (bad tokens,
 * out of memory, ...). */
int cb_kvstore_set_context(cb_kvstore_t *self, const int32_t *ctx, int n_ctx, char *err, size_t errlen);
/* The current context: its sequence (positions [0, n)), its length (0 = none yet), its fingerprint. */
const cb_seq_t *cb_kvstore_context_seq(const cb_kvstore_t *self);
int cb_kvstore_context_len(const cb_kvstore_t *self);
/* KV file writes that failed since the store was made (any thread may read it). Each failure is also
 * logged, at most once a minute per chunk key. */
uint64_t cb_kvstore_write_failures(const cb_kvstore_t *self);

/* The chunk key of tokens [n] after ctx [n_ctx] under the engine's model (see above). */
void cb_kvstore_chunk_key(const cb_kvstore_t *self, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n,
                          uint8_t key[32]);
/* The path of key's KV file under kv_dir: the one place a KV file is named. 0, or -1 (no kv_dir, path too
 * long). */
int cb_kvstore_path(const cb_kvstore_t *self, const uint8_t key[32], char *path, size_t cap);

/* A chunk resolved for one use: exactly one of entry (decoded f32, one reference) and file (an open,
 * header-checked handle whose layers are read and verified by the user) is set. */
typedef struct {
    cb_kvstore_src_t src;
    cb_kvmem_entry_t *entry;   /* MEM or COMPUTED: owned reference */
    cb_kvfile_t *file;         /* FILE: owned handle */
    cb_kv_miss_t why;          /* the miss reason that led to COMPUTED (CB_KV_OK otherwise) */
    bool stored;               /* COMPUTED: its KV file was written (false: no kv_dir, or the write failed);
                                  FILE with remote: its local copy was written */
    bool remote;               /* FILE: fetched from the remote tier now (file: the local copy, or the value
                                  itself when the copy could not be written) */
    uint8_t key[32];
} cb_kvstore_chunk_t;

/* Resolves chunk tokens [n] after the current context (cb_kvstore_set_context first): memory tier, file,
 * remote tier (then a FILE with `remote`), or computed now and stored (a failed store is counted and logged, and `stored` is false; the chunk is used
 * from memory). skip_cached: a
 * file of this chunk failed mid-stream: forget the memory-tier entry, skip the file, recompute. 0, or with
 * err CB_ENGINE_EPOOL (no room in the pool to compute it) or -1. Release with cb_kvstore_chunk_release. */
int cb_kvstore_resolve(cb_kvstore_t *self, const int32_t *tokens, int n, bool skip_cached, cb_kvstore_chunk_t *out,
                       char *err, size_t errlen);
void cb_kvstore_chunk_release(cb_kvstore_chunk_t *c);
/* Caches entry (decoded from key's file) in the memory tier, if there is one. */
void cb_kvstore_remember(cb_kvstore_t *self, const uint8_t key[32], cb_kvmem_entry_t *entry);

/* Computes chunk tokens [n] after ctx [n_ctx] (positions n_ctx..n_ctx+n-1; n_ctx >= 1), capturing per layer
 * its pre-RoPE K and V into a new entry (one reference, caller releases), rounded through the file dtype.
 * When store is true the entry is also written as a KV file (if kv_dir) and put in the memory tier (if
 * mem). NULL + err on failure (bad arguments, pool exhausted, out of memory, a failed file write when store
 * is true). */
cb_kvmem_entry_t *cb_kvstore_compute(cb_kvstore_t *self, const int32_t *ctx, int n_ctx, const int32_t *tokens,
                                     int n, bool store, char *err, size_t errlen);

/* Makes sure the KV of chunk tokens [n] after ctx [n_ctx] is available: memory-tier hit, or a KV file that
 * opens and verifies (every checksum) against this model, context and tokens, or a remote value that does
 * (written as the local file: *src FILE); otherwise (any miss reason, in *why when why is not NULL)
 * computes it and stores it (file, memory tier, remote tier). A chunk found locally is put in the remote
 * tier when Redis lacks it. *src (may be NULL) says which. 0, or with err CB_ENGINE_EPOOL (no room in the
 * pool to compute it) or -1 (also when its local file could not be written: precompute needs it). */
int cb_kvstore_ensure(cb_kvstore_t *self, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n,
                      cb_kvstore_src_t *src, cb_kv_miss_t *why, char *err, size_t errlen);
/* The same, returning the chunk's decoded KV (a new reference the caller releases): from the memory tier,
 * or decoded from its file (then put in the memory tier), or computed and stored. NULL + err on failure. */
cb_kvmem_entry_t *cb_kvstore_load(cb_kvstore_t *self, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n,
                                  cb_kvstore_src_t *src, cb_kv_miss_t *why, char *err, size_t errlen);
#endif
