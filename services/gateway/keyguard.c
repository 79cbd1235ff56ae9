/* keyguard: wrong API keys per address, lockouts. See keyguard.h. */
#include "keyguard.h"
#include "base/alloc.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"

#define SLOTS 4096 /* a power of two */
#define PROBES 8

typedef struct {
    uint8_t key[16];
    bool used;
    unsigned fails;        /* within the window */
    double window_start;   /* cb_now_ms() of the window's first failure */
    double locked_until;   /* cb_now_ms(); 0: not locked */
} slot_t;

struct gw_keyguard {
    unsigned limit;
    double window_ms, lockout_ms;
    pthread_mutex_t mu;
    slot_t slots[SLOTS];
};

gw_keyguard_t *gw_keyguard_new(unsigned limit, unsigned window_s, unsigned lockout_s) {
    gw_keyguard_t *self = cb_calloc(1, sizeof *self);
    if (!self) return NULL;
    self->limit = limit;
    self->window_ms = 1000.0 * window_s;
    self->lockout_ms = 1000.0 * lockout_s;
    pthread_mutex_init(&self->mu, NULL);
    return self;
}

void gw_keyguard_destroy(gw_keyguard_t **self_p) {
    if (!self_p || !*self_p) return;
    pthread_mutex_destroy(&(*self_p)->mu);
    free(*self_p);
    *self_p = NULL;
}

static unsigned hash(const uint8_t key[16]) {
    uint32_t h = 2166136261u;
    for (int i = 0; i < 16; i++) h = (h ^ key[i]) * 16777619u;
    return h;
}

static bool expired(const gw_keyguard_t *self, const slot_t *s, double now) {
    return !s->used || (now >= s->locked_until && now >= s->window_start + self->window_ms);
}

/* The address's slot, or NULL (under mu). */
static slot_t *find(gw_keyguard_t *self, const uint8_t key[16]) {
    unsigned h = hash(key);
    for (unsigned i = 0; i < PROBES; i++) {
        slot_t *s = &self->slots[(h + i) & (SLOTS - 1)];
        if (s->used && !memcmp(s->key, key, 16)) return s;
    }
    return NULL;
}

unsigned gw_keyguard_locked(gw_keyguard_t *self, const uint8_t key[16]) {
    if (!self || !self->limit) return 0;
    double now = cb_now_ms();
    pthread_mutex_lock(&self->mu);
    slot_t *s = find(self, key);
    double left = s && s->locked_until > now ? s->locked_until - now : 0;
    pthread_mutex_unlock(&self->mu);
    return (unsigned)((left + 999) / 1000);
}

bool gw_keyguard_failed(gw_keyguard_t *self, const uint8_t key[16]) {
    if (!self || !self->limit) return false;
    double now = cb_now_ms();
    bool locked = false;
    pthread_mutex_lock(&self->mu);
    slot_t *s = find(self, key);
    if (!s) { /* a free or expired slot among the probes, else the one whose window began first */
        unsigned h = hash(key);
        for (unsigned i = 0; i < PROBES; i++) {
            slot_t *t = &self->slots[(h + i) & (SLOTS - 1)];
            if (expired(self, t, now)) {
                s = t;
                break;
            }
            if (!s || t->window_start < s->window_start) s = t;
        }
        memset(s, 0, sizeof *s);
        memcpy(s->key, key, 16);
        s->used = true;
        s->window_start = now;
    }
    if (now >= s->window_start + self->window_ms) { /* a new window */
        s->window_start = now;
        s->fails = 0;
    }
    if (++s->fails >= self->limit) {
        s->locked_until = now + self->lockout_ms;
        s->fails = 0;
        s->window_start = now;
        locked = true;
    }
    pthread_mutex_unlock(&self->mu);
    return locked;
}
