/* backend_select: the CPU/CUDA choice behind cb_engine_new (see backend_select.h). */
#include "engine/backend_select.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "base/log.h"
#include "cpu/cpu_backend.h"

#ifdef CB_HAVE_CUDA
#include "cuda/cb_cuda.h"
#include "cuda/cb_cuda_backend.h"
#endif

static int s_kind = -1; /* -1: not set; read $CB_BACKEND on first use */

bool cb_backend_kind_parse(const char *s, cb_backend_kind_t *out) {
    static const char *names[] = {"auto", "cpu", "cuda"};
    for (int i = 0; s && i < 3; i++)
        if (strcmp(s, names[i]) == 0) {
            *out = (cb_backend_kind_t)i;
            return true;
        }
    return false;
}

const char *cb_backend_kind_name(cb_backend_kind_t kind) {
    return kind == CB_BACKEND_CPU ? "cpu" : kind == CB_BACKEND_CUDA ? "cuda" : "auto";
}

void cb_backend_set_default_kind(cb_backend_kind_t kind) { s_kind = (int)kind; }

cb_backend_kind_t cb_backend_default_kind(void) {
    if (s_kind < 0) {
        cb_backend_kind_t k = CB_BACKEND_AUTO;
        const char *e = getenv("CB_BACKEND");
        if (e && *e && !cb_backend_kind_parse(e, &k))
            CB_WARN("CB_BACKEND=%s is not auto|cpu|cuda; using auto", e);
        s_kind = (int)k;
    }
    return (cb_backend_kind_t)s_kind;
}

int cb_backend_cuda_devices(void) {
#ifdef CB_HAVE_CUDA
    int n = cb_cuda_device_count();
    return n > 0 ? n : 0;
#else
    return 0;
#endif
}

cb_backend_t *cb_backend_select(cb_backend_kind_t kind, const cb_hparams_t *hp, int max_rows, int max_keys,
                                int n_threads, cb_backend_kind_t *chosen, char *err, size_t errlen) {
    cb_backend_kind_t got = CB_BACKEND_CPU;
    cb_backend_t *be = NULL;
    if (kind != CB_BACKEND_CPU) {
        char why[256] = "this build has no CUDA backend (nvcc was not found at build time)";
#ifdef CB_HAVE_CUDA
        if (cb_backend_cuda_devices() == 0)
            snprintf(why, sizeof why, "no CUDA device is present");
        else if ((be = cb_backend_cuda_new(hp, max_rows, max_keys, 0, why, sizeof why)))
            got = CB_BACKEND_CUDA;
#endif
        if (!be && kind == CB_BACKEND_CUDA) {
            cb_set_err(err, errlen, "backend cuda: %s", why);
            return NULL;
        }
        if (!be) CB_INFO("backend auto: %s; using the CPU backend", why);
    }
    if (!be) be = cb_backend_cpu_new(hp, max_rows, max_keys, n_threads, err, errlen);
    if (be && chosen) *chosen = got;
    return be;
}

void cb_backend_destroy(cb_backend_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_backend_t *be = *self_p;
    if (be->ops && be->ops->destroy) be->ops->destroy(be->ctx);
    free(be);
    *self_p = NULL;
}
