/* cpu_weights.c: the CPU backend's layouts of a model's weights (cb_cpu_weights_build, see cpu_quant.h).
 *
 * One arena per model, shared by every CPU backend over it (tensor.h cb_weights_t), huge-page advised:
 *   native: per matrix the v16 copy where the VNNI kernel runs (Q4_1), else the x8 copy (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K,
 *           Q6_K), else nothing (read where stored); a copied matrix's stored pages are given back slice by
 *           slice as they are copied, and an untied embedding table's (a lookup reads a few rows), so the
 *           weights cost their size once;
 *   f32:    f32 copies of every matrix of the set (the f32 reference numerics), dequantized row-parallel;
 *   stored: nothing.
 */
#include "cpu/cpu_quant.h"
#include "base/alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "base/err.h"
#include "cpu/cpu_ops.h"

/* Drops the resident pages wholly inside [q, q + bytes) of the file mapping (madvise DONTNEED: the mapping
 * refills them if anything reads them again, e.g. a GPU upload). Advisory: a failure only costs memory. */
static void give_back(const void *q, size_t bytes) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = ((uintptr_t)q + page - 1) / page * page, e = ((uintptr_t)q + bytes) / page * page;
    if (e > a) (void)madvise((void *)a, e - a, MADV_DONTNEED);
}

/* Packs w into dst (v16 or x8 form) in slices of about PACK_SLICE stored bytes, giving each slice's stored
 * pages back once copied, so that the copy and the stored rows are resident together for one slice only.
 * Both forms are group-major (8 or 16 rows per group), so a slice of whole groups is the form of the weight
 * made of those rows, at the same offset. */
#define PACK_SLICE ((size_t)16 << 20)
static bool pack_rows(const cb_weight_t *w, uint8_t *dst, bool v16) {
    int step = (int)(PACK_SLICE / w->row_bytes) / 16 * 16;
    if (step < 16) step = 16;
    for (int r0 = 0; r0 < w->rows; r0 += step) {
        cb_weight_t part = *w;
        part.q = (const uint8_t *)w->q + (size_t)r0 * w->row_bytes;
        part.rows = w->rows - r0 < step ? w->rows - r0 : step;
        if (!(v16 ? cb_cpu_v16_pack(&part, dst) : cb_cpu_x8_pack(&part, dst)))
            return false; /* (a Q8_0 slice holding -128): the weight stays stored; its copy's space is reused */
        dst += v16 ? cb_cpu_v16_bytes(&part) : cb_cpu_x8_bytes(&part);
        give_back(part.q, (size_t)part.rows * w->row_bytes);
    }
    return true;
}

/* native: the x8 or v16 copies of every matrix that has such a form. */
static int build_native(cb_weights_t *ws, char *err, size_t errlen) {
    const bool v16 = cb_cpu_v16_preferred();
    size_t total = 0;
    for (int i = 0; i < ws->n; i++) {
        const size_t b = v16 && cb_cpu_v16_bytes(ws->w[i]) ? cb_cpu_v16_bytes(ws->w[i]) : cb_cpu_x8_bytes(ws->w[i]);
        total += (b + 63) / 64 * 64;
    }
    uint8_t *arena = NULL;
    if (total && !(arena = cb_cpu_alloc_huge(total, false))) {
        cb_set_err(err, errlen, "cpu backend: out of memory for %zu MB of interleaved weights", total >> 20);
        return -1;
    }
    uint8_t *p = arena;
    size_t bytes = 0;
    for (int i = 0; i < ws->n; i++) {
        cb_weight_t *w = ws->w[i];
        size_t b = 0;
        if (v16 && cb_cpu_v16_bytes(w) && pack_rows(w, p, true)) {
            w->v16 = p;
            b = cb_cpu_v16_bytes(w);
        } else if (cb_cpu_x8_bytes(w) && pack_rows(w, p, false)) {
            w->x8 = p;
            b = cb_cpu_x8_bytes(w);
        } else {
            continue; /* read where stored */
        }
        p += (b + 63) / 64 * 64;
        bytes += b;
    }
    if (ws->alias && ws->n > 0) {
        ws->alias->x8 = ws->w[ws->n - 1]->x8;
        ws->alias->v16 = ws->w[ws->n - 1]->v16;
    }
    /* the fingerprint read every stored page; an embedding table that is not the output matrix is read a few
     * rows at a time from here on */
    if (ws->lookup) give_back(ws->lookup->q, (size_t)ws->lookup->rows * ws->lookup->row_bytes);
    ws->mem = arena;
    ws->free_mem = free;
    ws->bytes = bytes;
    return 0;
}

/* f32: every matrix dequantized, in one arena in the set's order. */
static int build_f32(cb_weights_t *ws, char *err, size_t errlen) {
    size_t floats = 0;
    for (int i = 0; i < ws->n; i++) floats += (size_t)ws->w[i]->rows * (size_t)ws->w[i]->cols;
    if (floats > ((size_t)1 << 40) / sizeof(float)) {
        cb_set_err(err, errlen, "cpu backend: model too large for f32 weights");
        return -1;
    }
    float *arena = floats ? cb_cpu_alloc_huge(floats * sizeof(float), false) : NULL;
    if (floats && !arena) {
        cb_set_err(err, errlen, "cpu backend: out of memory for %zu MB of f32 weights", floats * 4 >> 20);
        return -1;
    }
    float *p = arena;
    for (int i = 0; i < ws->n; i++) {
        cb_weight_t *w = ws->w[i];
        float *dst = p;
        /* row-parallel: each row is a whole number of blocks; cb_cpu_dequant_row is bit-identical to cb_dequant */
        #pragma omp parallel for schedule(static)
        for (int r = 0; r < w->rows; r++) cb_cpu_dequant_row(w, r, dst + (size_t)r * w->cols);
        w->f32 = dst;
        p += (size_t)w->rows * w->cols;
    }
    ws->mem = arena;
    ws->free_mem = free;
    ws->bytes = floats * sizeof(float);
    return 0;
}

int cb_cpu_weights_build(cb_weights_t *ws, void *arg, char *err, size_t errlen) {
    (void)arg;
    switch (ws->mode) {
    case CB_WEIGHTS_NATIVE: return build_native(ws, err, errlen);
    case CB_WEIGHTS_F32: return build_f32(ws, err, errlen);
    case CB_WEIGHTS_STORED: return 0;
    }
    cb_set_err(err, errlen, "cpu backend: unknown weight mode %d", (int)ws->mode);
    return -1;
}
