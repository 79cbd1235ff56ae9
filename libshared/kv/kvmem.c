/* kvmem.c: in-memory LRU tier of decoded chunk KV (see kvmem.h).
 *
 * The index is a CZMQ zhashx keyed by the 32 key bytes (stored in the node, not duplicated) and the
 * recency order a zlistx of the same nodes, most recent first; one mutex guards both and the counters.
 * An entry is one 64-byte-aligned allocation: this struct, the token ids, then for each layer K and V.
 * Its reference count is atomic so that readers release without the cache's lock.
 *
 * Owns: the nodes, the containers and one reference per cached entry.
 */
#include "kv/kvmem.h"
#include "base/alloc.h"

#include <czmq.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define ALIGN 64u

struct cb_kvmem_entry {
    atomic_int refs;
    int n_layer, n_head_kv, head_dim, n_tokens;
    size_t kv_dim;
    size_t bytes;          /* the whole allocation */
    int32_t *tokens;       /* [n_tokens] */
    float *data;           /* [n_layer][2 (K, V)][n_tokens][kv_dim] */
};

typedef struct {
    uint8_t key[32];
    cb_kvmem_entry_t *e;   /* the cache's reference */
    void *handle;          /* position in the LRU list */
} node_t;

struct cb_kvmem {
    pthread_mutex_t mu;
    zhashx_t *index;       /* key -> node_t* */
    zlistx_t *lru;         /* node_t*, most recently used first */
    size_t budget, bytes;
    uint64_t hits, misses, inserts, evictions;
};

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* ---------------------------------------------------------------- entries */

cb_kvmem_entry_t *cb_kvmem_entry_new(int n_layer, int n_head_kv, int head_dim, int n_tokens) {
    if (n_layer < 1 || n_layer > CB_KV_MAX_LAYERS || n_head_kv < 1 || n_head_kv > CB_KV_MAX_HEADS_KV ||
        head_dim < 1 || head_dim > CB_KV_MAX_HEAD_DIM || n_head_kv * head_dim > CB_KV_MAX_KV_DIM || n_tokens < 1 ||
        n_tokens > CB_KV_MAX_TOKENS)
        return NULL;
    size_t kv_dim = (size_t)n_head_kv * (size_t)head_dim, n_floats, data_bytes;
    if (__builtin_mul_overflow((size_t)n_layer * 2 * (size_t)n_tokens, kv_dim, &n_floats) ||
        __builtin_mul_overflow(n_floats, sizeof(float), &data_bytes))
        return NULL;
    size_t head = round_up(sizeof(cb_kvmem_entry_t), ALIGN);
    size_t tok = round_up((size_t)n_tokens * sizeof(int32_t), ALIGN);
    size_t total = head + tok + round_up(data_bytes, ALIGN);
    if (total < data_bytes) return NULL;
    uint8_t *p = cb_aligned_alloc(ALIGN, total);
    if (!p) return NULL;
    cb_kvmem_entry_t *e = (cb_kvmem_entry_t *)p;
    atomic_init(&e->refs, 1);
    e->n_layer = n_layer;
    e->n_head_kv = n_head_kv;
    e->head_dim = head_dim;
    e->n_tokens = n_tokens;
    e->kv_dim = kv_dim;
    e->bytes = total;
    e->tokens = (int32_t *)(p + head);
    e->data = (float *)(p + head + tok);
    return e;
}

cb_kvmem_entry_t *cb_kvmem_entry_from_file(cb_kvfile_t *file, cb_kv_miss_t *why) {
    cb_kv_miss_t w = CB_KV_OK;
    cb_kvmem_entry_t *e = NULL;
    const cb_kv_meta_t *m = cb_kvfile_meta(file);
    if (!m) {
        w = CB_KV_MISS_BAD_ARG;
        goto out;
    }
    int n = cb_kvfile_n_tokens(file);
    e = cb_kvmem_entry_new(m->n_layer, m->n_head_kv, m->head_dim, n);
    if (!e) {
        w = CB_KV_MISS_IO;
        goto out;
    }
    memcpy(e->tokens, cb_kvfile_tokens(file), (size_t)n * sizeof(int32_t));
    for (int l = 0; l < m->n_layer && w == CB_KV_OK; l++)
        w = cb_kvfile_read_layer(file, l, cb_kvmem_entry_k_mut(e, l), cb_kvmem_entry_v_mut(e, l));
    if (w != CB_KV_OK) cb_kvmem_entry_release(&e);
out:
    if (why) *why = w;
    return e;
}

cb_kvmem_entry_t *cb_kvmem_entry_ref(cb_kvmem_entry_t *e) {
    if (e) atomic_fetch_add_explicit(&e->refs, 1, memory_order_relaxed);
    return e;
}

void cb_kvmem_entry_release(cb_kvmem_entry_t **e_p) {
    if (!e_p || !*e_p) return;
    cb_kvmem_entry_t *e = *e_p;
    *e_p = NULL;
    if (atomic_fetch_sub_explicit(&e->refs, 1, memory_order_acq_rel) == 1) free(e);
}

int cb_kvmem_entry_n_layer(const cb_kvmem_entry_t *e) { return e ? e->n_layer : 0; }
int cb_kvmem_entry_n_head_kv(const cb_kvmem_entry_t *e) { return e ? e->n_head_kv : 0; }
int cb_kvmem_entry_head_dim(const cb_kvmem_entry_t *e) { return e ? e->head_dim : 0; }
int cb_kvmem_entry_n_tokens(const cb_kvmem_entry_t *e) { return e ? e->n_tokens : 0; }
size_t cb_kvmem_entry_bytes(const cb_kvmem_entry_t *e) { return e ? e->bytes : 0; }
const int32_t *cb_kvmem_entry_tokens(const cb_kvmem_entry_t *e) { return e ? e->tokens : NULL; }
int32_t *cb_kvmem_entry_tokens_mut(cb_kvmem_entry_t *e) { return e ? e->tokens : NULL; }

static float *layer_ptr(const cb_kvmem_entry_t *e, int layer, int which) {
    if (!e || layer < 0 || layer >= e->n_layer) return NULL;
    return e->data + ((size_t)layer * 2 + (size_t)which) * (size_t)e->n_tokens * e->kv_dim;
}
const float *cb_kvmem_entry_k(const cb_kvmem_entry_t *e, int layer) { return layer_ptr(e, layer, 0); }
const float *cb_kvmem_entry_v(const cb_kvmem_entry_t *e, int layer) { return layer_ptr(e, layer, 1); }
float *cb_kvmem_entry_k_mut(cb_kvmem_entry_t *e, int layer) { return layer_ptr(e, layer, 0); }
float *cb_kvmem_entry_v_mut(cb_kvmem_entry_t *e, int layer) { return layer_ptr(e, layer, 1); }

/* ---------------------------------------------------------------- the cache */

/* Keys are BLAKE2b outputs: any 8 of their bytes are a good hash. */
static size_t key_hash(const void *key) {
    size_t h;
    memcpy(&h, key, sizeof h);
    return h;
}
static int key_cmp(const void *a, const void *b) { return memcmp(a, b, 32); }

cb_kvmem_t *cb_kvmem_new(size_t budget_bytes) {
    cb_kvmem_t *self = cb_calloc(1, sizeof *self);
    if (!self) return NULL;
    self->index = zhashx_new();
    self->lru = zlistx_new();
    if (!self->index || !self->lru || pthread_mutex_init(&self->mu, NULL) != 0) {
        zhashx_destroy(&self->index);
        zlistx_destroy(&self->lru);
        free(self);
        return NULL;
    }
    zhashx_set_key_hasher(self->index, key_hash);
    zhashx_set_key_comparator(self->index, key_cmp);
    zhashx_set_key_duplicator(self->index, NULL);  /* the key lives in the node */
    zhashx_set_key_destructor(self->index, NULL);
    self->budget = budget_bytes;
    return self;
}

/* Unlinks and frees a node, dropping the cache's reference. Lock held. */
static void drop_node(cb_kvmem_t *self, node_t *n) {
    self->bytes -= n->e->bytes;
    zhashx_delete(self->index, n->key);
    zlistx_delete(self->lru, n->handle);
    cb_kvmem_entry_release(&n->e);
    free(n);
}

/* Evicts from the cold end until `need` more bytes fit. Lock held. */
static void make_room(cb_kvmem_t *self, size_t need) {
    while (self->bytes + need > self->budget) {
        node_t *n = zlistx_tail(self->lru);
        if (!n) break;
        drop_node(self, n);
        self->evictions++;
    }
}

void cb_kvmem_clear(cb_kvmem_t *self) {
    if (!self) return;
    pthread_mutex_lock(&self->mu);
    node_t *n;
    while ((n = zlistx_tail(self->lru)) != NULL) drop_node(self, n);
    pthread_mutex_unlock(&self->mu);
}

void cb_kvmem_destroy(cb_kvmem_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_kvmem_t *self = *self_p;
    cb_kvmem_clear(self);
    zhashx_destroy(&self->index);
    zlistx_destroy(&self->lru);
    pthread_mutex_destroy(&self->mu);
    free(self);
    *self_p = NULL;
}

int cb_kvmem_put(cb_kvmem_t *self, const uint8_t key[32], cb_kvmem_entry_t *e) {
    if (!self || !key || !e) return -1;
    pthread_mutex_lock(&self->mu);
    int rc;
    node_t *old = zhashx_lookup(self->index, key);
    if (old) {
        zlistx_move_start(self->lru, old->handle);
        rc = 1;
    } else if (e->bytes > self->budget) {
        rc = -1;
    } else {
        node_t *n = cb_malloc(sizeof *n);
        if (!n) {
            rc = -1;
        } else {
            make_room(self, e->bytes);
            memcpy(n->key, key, 32);
            n->e = cb_kvmem_entry_ref(e);
            n->handle = zlistx_add_start(self->lru, n);
            if (!n->handle || zhashx_insert(self->index, n->key, n) != 0) {
                if (n->handle) zlistx_delete(self->lru, n->handle);
                cb_kvmem_entry_release(&n->e);
                free(n);
                rc = -1;
            } else {
                self->bytes += e->bytes;
                self->inserts++;
                rc = 0;
            }
        }
    }
    pthread_mutex_unlock(&self->mu);
    return rc;
}

cb_kvmem_entry_t *cb_kvmem_get(cb_kvmem_t *self, const uint8_t key[32]) {
    if (!self || !key) return NULL;
    pthread_mutex_lock(&self->mu);
    cb_kvmem_entry_t *e = NULL;
    node_t *n = zhashx_lookup(self->index, key);
    if (n) {
        zlistx_move_start(self->lru, n->handle);
        e = cb_kvmem_entry_ref(n->e);
        self->hits++;
    } else {
        self->misses++;
    }
    pthread_mutex_unlock(&self->mu);
    return e;
}

int cb_kvmem_contains(cb_kvmem_t *self, const uint8_t key[32]) {
    if (!self || !key) return 0;
    pthread_mutex_lock(&self->mu);
    int found = zhashx_lookup(self->index, key) != NULL;
    pthread_mutex_unlock(&self->mu);
    return found;
}

int cb_kvmem_remove(cb_kvmem_t *self, const uint8_t key[32]) {
    if (!self || !key) return 0;
    pthread_mutex_lock(&self->mu);
    node_t *n = zhashx_lookup(self->index, key);
    int found = n != NULL;
    if (found) drop_node(self, n);
    pthread_mutex_unlock(&self->mu);
    return found;
}

void cb_kvmem_set_budget(cb_kvmem_t *self, size_t budget_bytes) {
    if (!self) return;
    pthread_mutex_lock(&self->mu);
    self->budget = budget_bytes;
    make_room(self, 0);
    pthread_mutex_unlock(&self->mu);
}

void cb_kvmem_stats(cb_kvmem_t *self, cb_kvmem_stats_t *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!self) return;
    pthread_mutex_lock(&self->mu);
    out->hits = self->hits;
    out->misses = self->misses;
    out->inserts = self->inserts;
    out->evictions = self->evictions;
    out->entries = zhashx_size(self->index);
    out->bytes = self->bytes;
    out->budget = self->budget;
    pthread_mutex_unlock(&self->mu);
}
