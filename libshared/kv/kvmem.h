/* kvmem: the in-memory tier of chunk KV: an LRU of decoded (f32) chunk KV under a byte budget, keyed
 * by the 32-byte chunk key (kvfile.h cb_kvfile_key).
 *
 * Entries are reference counted and immutable once cached: cb_kvmem_get hands out a new reference, so
 * an eviction (or cb_kvmem_remove/clear/destroy) only drops the cache's own reference and never frees
 * memory that a reader still holds; the memory goes when the last reference is released. The budget
 * counts the entries the cache holds (not evicted entries still held by readers).
 *
 * Threads: every cb_kvmem_* call on a cache is thread-safe (one mutex); entry references may be taken
 * and released from any thread. Counters: hits, misses, inserts, evictions (cb_kvmem_stats).
 */
#ifndef CB_KVMEM_H
#define CB_KVMEM_H

#include <stddef.h>
#include <stdint.h>

#include "format/kvfile.h"

typedef struct cb_kvmem cb_kvmem_t;
typedef struct cb_kvmem_entry cb_kvmem_entry_t;

/* ---- entries -------------------------------------------------------------------------------- */

/* A new entry for n_tokens tokens of a model with that geometry, with one reference (the caller's).
 * Its token ids and K/V are uninitialised: fill them (cb_kvmem_entry_tokens_mut, _k_mut, _v_mut)
 * before cb_kvmem_put. Returns NULL on bad geometry (kvfile.h limits) or out of memory. */
cb_kvmem_entry_t *cb_kvmem_entry_new(int n_layer, int n_head_kv, int head_dim, int n_tokens);
/* Decodes every layer of an open kv file (checksums verified) into a new entry (one reference).
 * NULL with *why (if not NULL) = the miss reason, or CB_KV_MISS_IO when out of memory. */
cb_kvmem_entry_t *cb_kvmem_entry_from_file(cb_kvfile_t *file, cb_kv_miss_t *why);
/* Adds a reference; returns e. */
cb_kvmem_entry_t *cb_kvmem_entry_ref(cb_kvmem_entry_t *e);
/* Drops the caller's reference and nulls *e_p; frees the entry with its last reference. NULL-safe. */
void cb_kvmem_entry_release(cb_kvmem_entry_t **e_p);

int cb_kvmem_entry_n_layer(const cb_kvmem_entry_t *e);
int cb_kvmem_entry_n_head_kv(const cb_kvmem_entry_t *e);
int cb_kvmem_entry_head_dim(const cb_kvmem_entry_t *e);
int cb_kvmem_entry_n_tokens(const cb_kvmem_entry_t *e);
size_t cb_kvmem_entry_bytes(const cb_kvmem_entry_t *e);  /* what it counts against a budget */
const int32_t *cb_kvmem_entry_tokens(const cb_kvmem_entry_t *e);       /* [n_tokens] */
const float *cb_kvmem_entry_k(const cb_kvmem_entry_t *e, int layer);   /* [n_tokens][kv_dim], K pre-RoPE; NULL if layer is out of range */
const float *cb_kvmem_entry_v(const cb_kvmem_entry_t *e, int layer);   /* [n_tokens][kv_dim] */
/* Writable views, only for filling an entry before it is cached. */
int32_t *cb_kvmem_entry_tokens_mut(cb_kvmem_entry_t *e);
float *cb_kvmem_entry_k_mut(cb_kvmem_entry_t *e, int layer);
float *cb_kvmem_entry_v_mut(cb_kvmem_entry_t *e, int layer);

/* ---- the cache ------------------------------------------------------------------------------ */

/* A cache holding at most budget_bytes of entries. NULL when out of memory. */
cb_kvmem_t *cb_kvmem_new(size_t budget_bytes);
/* Drops the cache's references (entries still held elsewhere live on), frees, nulls. NULL-safe. */
void cb_kvmem_destroy(cb_kvmem_t **self_p);

/* Caches e under key, taking a reference of its own (the caller keeps and still releases its own),
 * evicting least-recently-used entries to make room. The entry must not be modified afterwards.
 * Returns 0 = cached; 1 = the key was already cached (the cached entry is kept and marked used);
 * -1 = not cached (e larger than the whole budget, or NULL arguments). */
int cb_kvmem_put(cb_kvmem_t *self, const uint8_t key[32], cb_kvmem_entry_t *e);
/* The entry cached under key, as a new reference the caller releases (cb_kvmem_entry_release), and
 * marked most recently used; NULL if absent. Counts a hit or a miss. */
cb_kvmem_entry_t *cb_kvmem_get(cb_kvmem_t *self, const uint8_t key[32]);
/* Whether key is cached (no counters, no LRU update). */
int cb_kvmem_contains(cb_kvmem_t *self, const uint8_t key[32]);
/* Removes key (e.g. its file was found corrupt). Returns 1 if it was cached, else 0. */
int cb_kvmem_remove(cb_kvmem_t *self, const uint8_t key[32]);
/* Removes everything (counted as neither evictions nor removals). */
void cb_kvmem_clear(cb_kvmem_t *self);
/* Changes the budget, evicting as needed. */
void cb_kvmem_set_budget(cb_kvmem_t *self, size_t budget_bytes);

typedef struct {
    uint64_t hits, misses;   /* cb_kvmem_get outcomes */
    uint64_t inserts;        /* successful puts (return 0) */
    uint64_t evictions;      /* entries dropped to make room */
    size_t entries, bytes;   /* now cached */
    size_t budget;
} cb_kvmem_stats_t;
void cb_kvmem_stats(cb_kvmem_t *self, cb_kvmem_stats_t *out);
#endif
