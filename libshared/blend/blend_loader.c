/* blend_loader.c: the loader of a pass: for each layer, the cached K/V of every row that needs them placed in
 * the sequence through the backend's layer load (K rotated there), streamed file layers verified first; run
 * in its own thread ahead of the compute (the compute of layer l waits only for layer l), or inline with
 * no_overlap. Part of blend (blend_internal.h). */
#include "blend/blend_internal.h"

#include <pthread.h>
#include <stdlib.h>

#include "base/clock.h"

/* Does a row of class c need its cached K/V in the sequence at layer l? */
static bool row_needs_cache(const run_t *R, int c, int l) {
    return c == CB_ROW_LOADED || (c == CB_ROW_CANDIDATE && l > R->check_layer);
}

/* Places layer l's cached K/V of every row that needs them into the sequence (the backend's layer load: K
 * rotated to the row's position). Streams file layers (checksum verified) first. 0; 1 with R->fail_src/why
 * set when a file layer failed; -1 when the backend failed. */
static int load_layer(cb_blend_t *b, run_t *R, int l) {
    const int KVD = b->KVD;
    for (int si = 0; si < b->n_srcs; si++) {
        src_t *s = &b->srcs[si];
        bool need_rows = s->n_loaded > 0 || (s->n_cand > 0 && l > R->check_layer);
        bool need_pre = s->n_cand > 0 && cb_blend_measuring(R, l);
        const void *kp, *vp;             /* source rows of this layer, in dtype dt */
        cb_kv_dtype_t dt = CB_KV_F32;
        if (s->kind == SRC_ENTRY) {
            if (!need_rows) continue;
            kp = cb_kvmem_entry_k(s->entry, l);
            vp = cb_kvmem_entry_v(s->entry, l);
        } else if (s->fill) {
            /* decode every layer: the entry joins the memory tier after the prefill */
            float *dk = cb_kvmem_entry_k_mut(s->fill, l), *dv = cb_kvmem_entry_v_mut(s->fill, l);
            cb_kv_miss_t w = cb_kvfile_read_layer(s->file, l, dk, dv);
            if (w != CB_KV_OK) {
                R->fail_src = si;
                R->fail_why = w;
                return 1;
            }
            if (!need_rows) continue;
            kp = dk;
            vp = dv;
        } else {
            if (!need_rows && !need_pre) continue;
            cb_kv_miss_t w = cb_kvfile_layer_raw(s->file, l, &kp, &vp); /* checksum verified here */
            if (w != CB_KV_OK) {
                R->fail_src = si;
                R->fail_why = w;
                return 1;
            }
            s->raw_k[l] = kp;
            s->raw_v[l] = vp;
            dt = s->dtype;
            if (!need_rows) continue;
        }
        const size_t rowb = cb_kv_row_bytes(dt, (size_t)KVD); /* bytes of a source row */
        /* contiguous runs of rows that need the cache: one layer load each */
        int i = 0;
        while (i < s->n) {
            if (!row_needs_cache(R, b->cls[s->row0 + i], l)) {
                i++;
                continue;
            }
            int j = i + 1;
            while (j < s->n && row_needs_cache(R, b->cls[s->row0 + j], l)) j++;
            if (cb_engine_kv_load(b->e, b->seq, l, s->row0 + i, j - i, (const uint8_t *)kp + (size_t)i * rowb,
                                  (const uint8_t *)vp + (size_t)i * rowb, dt) != CB_ENGINE_OK)
                return -1;
            i = j;
        }
    }
    return 0;
}

void *cb_blend_loader_main(void *arg) {
    cb_blend_t *b = arg;
    run_t *R = b->ld_run;
    for (int l = 0; l < b->L; l++) {
        pthread_mutex_lock(&b->mu);
        int stop = b->ld_stop;
        pthread_mutex_unlock(&b->mu);
        if (stop) break;
        double t0 = cb_now_ms();
        int rc = load_layer(b, R, l);
        R->t_load += cb_now_ms() - t0;
        pthread_mutex_lock(&b->mu);
        if (rc) {
            b->ld_failed = rc;
        } else {
            b->ld_ready = l + 1;
        }
        pthread_cond_broadcast(&b->cv);
        pthread_mutex_unlock(&b->mu);
        if (rc) break;
    }
    return NULL;
}

/* Waits for (threaded) or does (serial) the loader's layer l. 0, 1 (a file layer failed), -1 (backend). */
int cb_blend_await_layer(cb_blend_t *b, run_t *R, int l, bool threaded) {
    double tw = cb_now_ms();
    if (threaded) {
        pthread_mutex_lock(&b->mu);
        while (b->ld_ready < l + 1 && !b->ld_failed) pthread_cond_wait(&b->cv, &b->mu);
        int failed = b->ld_ready < l + 1 ? b->ld_failed : 0;
        pthread_mutex_unlock(&b->mu);
        R->t_wait += cb_now_ms() - tw;
        return failed;
    }
    int rc = load_layer(b, R, l);
    double dt = cb_now_ms() - tw;
    R->t_load += dt;
    R->t_wait += dt;
    return rc;
}

/* Stops and joins the loader thread, if one runs. */
void cb_blend_run_stop_loader(cb_blend_t *b) {
    if (!b->ld_on) return;
    pthread_mutex_lock(&b->mu);
    b->ld_stop = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    pthread_join(b->ld_th, NULL);
    b->ld_on = false;
}
