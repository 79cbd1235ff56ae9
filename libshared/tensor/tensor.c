/* tensor.c: the shared state of prepared weights and the backend destructor (see tensor.h). */
#include "tensor/tensor.h"

#include <stdio.h>
#include <stdlib.h>

#include "base/err.h"

int cb_weights_prepare(cb_weights_t *ws, const char *by, cb_weights_build_fn build, void *arg, char *err,
                       size_t errlen) {
    int rc = 0;
    pthread_mutex_lock(&ws->lock);
    if (ws->refs > 0 && strcmp(ws->by, by) != 0) {
        cb_set_err(err, errlen, "backend %s: the model's weights are prepared for backend %s", by, ws->by);
        rc = -1;
    } else if (ws->refs == 0 && (rc = build(ws, arg, err, errlen)) == 0) {
        ws->by = by;
    }
    if (rc == 0) ws->refs++;
    pthread_mutex_unlock(&ws->lock);
    return rc;
}

void cb_weights_release(cb_weights_t *ws) {
    if (!ws) return;
    pthread_mutex_lock(&ws->lock);
    if (ws->refs > 0 && --ws->refs == 0) {
        for (int i = 0; i < ws->n; i++) ws->w[i]->f32 = NULL, ws->w[i]->x8 = ws->w[i]->v16 = NULL;
        if (ws->alias) ws->alias->f32 = NULL, ws->alias->x8 = ws->alias->v16 = NULL;
        if (ws->free_mem) ws->free_mem(ws->mem);
        ws->mem = NULL;
        ws->free_mem = NULL;
        ws->bytes = 0;
        ws->by = NULL;
    }
    pthread_mutex_unlock(&ws->lock);
}

void cb_backend_destroy(cb_backend_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_backend_t *be = *self_p;
    if (be->ops && be->ops->destroy) be->ops->destroy(be->ctx);
    free(be);
    *self_p = NULL;
}
