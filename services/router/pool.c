/* pool: cb-router's worker and in-flight tables and its routing policy. See pool.h. */
#include "pool.h"
#include "base/alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

struct rt_pool {
    int max_workers, max_inflight, max_resident;
    rt_worker_t *workers;      /* [max_workers] */
    rt_flight_t *flights;      /* [max_inflight] */
    uint8_t (*resident)[32];   /* [max_workers * max_resident]: worker i's keys start at i * max_resident */
    int n_inflight;
    int rr;                    /* round-robin cursor: the last worker picked */
};

int rt_policy_parse(const char *s, rt_policy_t *out) {
    static const char *names[] = {"cache", "least_loaded", "round_robin"};
    for (int i = 0; i < 3; i++)
        if (s && strcmp(s, names[i]) == 0) {
            *out = (rt_policy_t)i;
            return 0;
        }
    return -1;
}

const char *rt_policy_name(rt_policy_t p) {
    return p == RT_POLICY_CACHE ? "cache" : p == RT_POLICY_LEAST_LOADED ? "least_loaded" : "round_robin";
}

rt_pool_t *rt_pool_new(int max_workers, int max_inflight, int max_resident) {
    if (max_workers <= 0 || max_inflight <= 0 || max_resident < 0) return NULL;
    rt_pool_t *p = cb_calloc(1, sizeof *p);
    if (!p) return NULL;
    p->max_workers = max_workers;
    p->max_inflight = max_inflight;
    p->max_resident = max_resident;
    p->workers = cb_calloc((size_t)max_workers, sizeof *p->workers);
    p->flights = cb_calloc((size_t)max_inflight, sizeof *p->flights);
    p->resident = max_resident ? cb_calloc((size_t)max_workers * (size_t)max_resident, 32) : NULL;
    if (!p->workers || !p->flights || (max_resident && !p->resident)) {
        rt_pool_destroy(&p);
        return NULL;
    }
    p->rr = -1;
    return p;
}

void rt_pool_destroy(rt_pool_t **self_p) {
    if (!self_p || !*self_p) return;
    rt_pool_t *p = *self_p;
    for (int i = 0; p->flights && i < p->max_inflight; i++) free(p->flights[i].body);
    free(p->workers);
    free(p->flights);
    free(p->resident);
    free(p);
    *self_p = NULL;
}

int rt_pool_max_workers(const rt_pool_t *self) { return self->max_workers; }
int rt_pool_max_inflight(const rt_pool_t *self) { return self->max_inflight; }
int rt_pool_max_resident(const rt_pool_t *self) { return self->max_resident; }

/* ---- workers ---------------------------------------------------------------------------------- */

int rt_pool_worker_find(const rt_pool_t *self, const uint8_t *ident, size_t len) {
    for (int i = 0; i < self->max_workers; i++) {
        const rt_worker_t *w = &self->workers[i];
        if (w->used && w->ident_len == len && memcmp(w->ident, ident, len) == 0) return i;
    }
    return -1;
}

int rt_pool_worker_seen(rt_pool_t *self, const uint8_t *ident, size_t len, double now, bool *added) {
    *added = false;
    if (len == 0 || len > RT_MAX_IDENT) return -1;
    int i = rt_pool_worker_find(self, ident, len);
    if (i < 0) {
        for (int j = 0; j < self->max_workers && i < 0; j++)
            if (!self->workers[j].used) i = j;
        if (i < 0) return -1;
        rt_worker_t *w = &self->workers[i];
        memset(w, 0, sizeof *w);
        w->used = true;
        memcpy(w->ident, ident, len);
        w->ident_len = len;
        w->joined_ms = now;
        w->resident = self->resident ? &self->resident[(size_t)i * (size_t)self->max_resident] : NULL;
        snprintf(w->name, sizeof w->name, "?");
        *added = true;
    }
    self->workers[i].last_seen_ms = now;
    return i;
}

rt_worker_t *rt_pool_worker(rt_pool_t *self, int i) {
    return i >= 0 && i < self->max_workers && self->workers[i].used ? &self->workers[i] : NULL;
}

void rt_pool_worker_set_resident(rt_pool_t *self, int i, const uint8_t (*keys)[32], int n) {
    rt_worker_t *w = rt_pool_worker(self, i);
    if (!w) return;
    if (n > self->max_resident) n = self->max_resident;
    if (n < 0) n = 0;
    if (n) memcpy(w->resident, keys, (size_t)n * 32);
    w->n_resident = n;
}

void rt_pool_worker_remove(rt_pool_t *self, int i) {
    rt_worker_t *w = rt_pool_worker(self, i);
    if (w) memset(w, 0, sizeof *w);
}

int rt_pool_worker_expired(const rt_pool_t *self, double now, double timeout_ms) {
    for (int i = 0; i < self->max_workers; i++)
        if (self->workers[i].used && now - self->workers[i].last_seen_ms > timeout_ms) return i;
    return -1;
}

int rt_pool_n_workers(const rt_pool_t *self, int *n_ready) {
    int n = 0, r = 0;
    for (int i = 0; i < self->max_workers; i++)
        if (self->workers[i].used) {
            n++;
            r += self->workers[i].ready;
        }
    if (n_ready) *n_ready = r;
    return n;
}

int rt_pool_worker_score(const rt_pool_t *self, int i, const uint8_t (*keys)[32], int n) {
    const rt_worker_t *w = i >= 0 && i < self->max_workers && self->workers[i].used ? &self->workers[i] : NULL;
    if (!w) return 0;
    int score = 0;
    for (int k = 0; k < n; k++)
        for (int j = 0; j < w->n_resident; j++)
            if (memcmp(w->resident[j], keys[k], 32) == 0) {
                score++;
                break;
            }
    return score;
}

/* Rendezvous (highest random weight) of worker w for key: the same key prefers the same worker while it
 * lives, and only the keys of a worker that leaves move. */
static uint64_t hrw(const rt_worker_t *w, const uint8_t key[32]) {
    uint64_t seed = XXH3_64bits(w->name, strlen(w->name)) ^ XXH3_64bits(w->ident, w->ident_len);
    return XXH3_64bits_withSeed(key, 32, seed);
}

static bool candidate(const rt_pool_t *self, int i, int exclude) {
    return i != exclude && self->workers[i].used && self->workers[i].ready;
}

/* Is a better than b by load: fewer in flight from us, then fewer waiting by its own report. */
static bool less_loaded(const rt_worker_t *a, const rt_worker_t *b) {
    if (a->inflight != b->inflight) return a->inflight < b->inflight;
    return a->waiting < b->waiting;
}

int rt_pool_pick(rt_pool_t *self, rt_policy_t policy, const uint8_t (*keys)[32], int n, int exclude,
                 int max_imbalance) {
    const int nw = self->max_workers;
    int best = -1;
    if (policy == RT_POLICY_ROUND_ROBIN || policy == RT_POLICY_LEAST_LOADED || n <= 0) {
        /* scanning from the one after the last pick makes ties rotate */
        for (int s = 1; s <= nw; s++) {
            int i = (self->rr + s + nw) % nw;
            if (!candidate(self, i, exclude)) continue;
            if (policy == RT_POLICY_ROUND_ROBIN) {
                best = i;
                break;
            }
            if (best < 0 || less_loaded(&self->workers[i], &self->workers[best])) best = i;
        }
    } else {
        int min_load = -1;
        for (int i = 0; i < nw; i++)
            if (candidate(self, i, exclude) && (min_load < 0 || self->workers[i].inflight < min_load))
                min_load = self->workers[i].inflight;
        int best_score = -1;
        uint64_t best_h = 0;
        for (int i = 0; i < nw; i++) {
            if (!candidate(self, i, exclude) || self->workers[i].inflight > min_load + max_imbalance) continue;
            const rt_worker_t *w = &self->workers[i];
            int score = rt_pool_worker_score(self, i, keys, n);
            uint64_t h = hrw(w, keys[0]);
            /* equal scores: when someone holds keys, the less loaded of the holders; when nobody does, the
             * rendezvous choice, so that the chunks computed now are found there next time (the load
             * bound above keeps that from piling up) */
            bool better = best < 0 || score > best_score;
            if (!better && score == best_score) {
                const int best_load = self->workers[best].inflight;
                bool tie_load = score > 0 && w->inflight != best_load;
                better = tie_load ? w->inflight < best_load : h > best_h;
            }
            if (better) {
                best = i;
                best_score = score;
                best_h = h;
            }
        }
    }
    if (best >= 0) self->rr = best;
    return best;
}

/* ---- requests in flight ----------------------------------------------------------------------- */

rt_flight_t *rt_pool_flight_add(rt_pool_t *self) {
    if (self->n_inflight >= self->max_inflight) return NULL;
    for (int i = 0; i < self->max_inflight; i++) {
        rt_flight_t *f = &self->flights[i];
        if (f->used) continue;
        memset(f, 0, sizeof *f);
        f->used = true;
        f->worker = f->excluded = -1;
        self->n_inflight++;
        return f;
    }
    return NULL;
}

rt_flight_t *rt_pool_flight_find(rt_pool_t *self, const uint8_t *client, size_t len, const char *id) {
    for (int i = 0; i < self->max_inflight; i++) {
        rt_flight_t *f = &self->flights[i];
        if (f->used && f->client_len == len && memcmp(f->client, client, len) == 0 && strcmp(f->id, id) == 0) return f;
    }
    return NULL;
}

rt_flight_t *rt_pool_flight_find_search(rt_pool_t *self, uint64_t seq) {
    for (int i = 0; i < self->max_inflight; i++) {
        rt_flight_t *f = &self->flights[i];
        if (f->used && f->searching && f->search_seq == seq) return f;
    }
    return NULL;
}

rt_flight_t *rt_pool_flight_at(rt_pool_t *self, int i) {
    return i >= 0 && i < self->max_inflight ? &self->flights[i] : NULL;
}

void rt_pool_flight_assign(rt_pool_t *self, rt_flight_t *f, int w) {
    rt_worker_t *wk = rt_pool_worker(self, w);
    if (!wk) return;
    rt_pool_flight_unassign(self, f);
    f->worker = w;
    f->attempts++;
    wk->inflight++;
    wk->dispatched++;
}

void rt_pool_flight_unassign(rt_pool_t *self, rt_flight_t *f) {
    rt_worker_t *wk = rt_pool_worker(self, f->worker);
    if (wk && wk->inflight > 0) wk->inflight--;
    f->worker = -1;
}

void rt_pool_flight_drop_body(rt_flight_t *f) {
    free(f->body);
    f->body = NULL;
    f->body_len = 0;
}

int rt_pool_flight_set_body(rt_flight_t *f, const void *data, size_t len) {
    void *copy = cb_malloc(len ? len : 1);
    if (!copy) return -1; /* the body it had stays */
    memcpy(copy, data, len);
    rt_pool_flight_drop_body(f);
    f->body = copy;
    f->body_len = len;
    return 0;
}

void rt_pool_flight_remove(rt_pool_t *self, rt_flight_t *f) {
    if (!f || !f->used) return;
    rt_pool_flight_unassign(self, f);
    rt_pool_flight_drop_body(f);
    memset(f, 0, sizeof *f);
    self->n_inflight--;
}

int rt_pool_n_inflight(const rt_pool_t *self) { return self->n_inflight; }
