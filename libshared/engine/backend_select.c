/* backend_select: the CPU/CUDA choice behind cb_engine_new (see backend_select.h).
 *
 * With CB_HAVE_CUDA the CUDA backend is not linked into the program: it lives in libcbcuda.so, which
 * pulls in cuBLAS and the CUDA runtime (about 150 MB resident once mapped). So that a host without a GPU
 * never pays for it, the first question goes to the driver alone (libcuda.so.1: cuInit, cuDeviceGetCount),
 * and only when it reports a device is the backend library opened and its entry points resolved. A program
 * that links the CUDA backend itself (the GPU tools and tests) exports it, and its own copy is used. Both
 * steps run once per process (pthread_once); their outcome, a device count or the reason there is none,
 * is kept for every later call. */
#include "engine/backend_select.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "base/log.h"
#include "cpu/cpu_backend.h"

#ifdef CB_HAVE_CUDA
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <unistd.h>

#define CB_CUDA_SO "libcbcuda.so" /* the CUDA backend library's file name */
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

#ifdef CB_HAVE_CUDA
/* ---------------------------------------------------------------- the CUDA backend, loaded on demand */

/* The entry points of kernels/cuda/cb_cuda_backend.h and cb_cuda.h that this file calls. */
typedef cb_backend_t *(*s_cuda_new_fn)(const cb_hparams_t *hp, int max_rows, int max_keys, int device,
                                       char *err, size_t errlen);
typedef int (*s_cuda_count_fn)(void);
typedef struct {
    s_cuda_new_fn backend_new;   /* cb_backend_cuda_new */
    s_cuda_count_fn device_count;/* cb_cuda_device_count */
} s_cuda_api_t;

static pthread_once_t s_cuda_once = PTHREAD_ONCE_INIT;
static s_cuda_api_t s_cuda;      /* valid when s_cuda_devices > 0 */
static int s_cuda_devices;       /* usable devices; 0 with the reason in s_cuda_why */
static char s_cuda_why[512];

/* Devices the driver reports, without loading the CUDA runtime or cuBLAS; 0 with the reason in why.
 * The driver library stays open where it was found (the runtime would open it again; closing a driver
 * that has been initialized is not worth the risk). */
static int s_driver_devices(char *why, size_t whylen) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        cb_set_err(why, whylen, "no CUDA driver (%s)", e ? e : "libcuda.so.1 not found");
        return 0;
    }
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
    int (*count)(int *) = (int (*)(int *))dlsym(h, "cuDeviceGetCount");
    if (!init || !count) {
        cb_set_err(why, whylen, "the CUDA driver (libcuda.so.1) lacks cuInit or cuDeviceGetCount");
        return 0;
    }
    int rc = init(0), n = 0;
    if (rc == 100) { /* CUDA_ERROR_NO_DEVICE */
        cb_set_err(why, whylen, "no CUDA device is present");
        return 0;
    }
    if (rc != 0) {
        cb_set_err(why, whylen, "the CUDA driver did not initialize (cuInit: error %d)", rc);
        return 0;
    }
    if ((rc = count(&n)) != 0) {
        cb_set_err(why, whylen, "cuDeviceGetCount failed (error %d)", rc);
        return 0;
    }
    if (n <= 0) {
        cb_set_err(why, whylen, "no CUDA device is present");
        return 0;
    }
    return n;
}

/* Resolves the entry points in handle h (RTLD_DEFAULT: the program itself); false naming the missing one. */
static bool s_cuda_resolve(void *h, const char *what, s_cuda_api_t *api, char *why, size_t whylen) {
    static const char *names[] = {"cb_backend_cuda_new", "cb_cuda_device_count"};
    void *p[2];
    for (int i = 0; i < 2; i++) {
        dlerror();
        p[i] = dlsym(h, names[i]);
        if (!p[i]) {
            cb_set_err(why, whylen, "%s lacks %s", what, names[i]);
            return false;
        }
    }
    api->backend_new = (s_cuda_new_fn)p[0];
    api->device_count = (s_cuda_count_fn)p[1];
    return true;
}

/* dlopen(path) with every symbol bound now, then its entry points; the handle stays open on success. */
static bool s_cuda_open(const char *path, s_cuda_api_t *api, char *why, size_t whylen) {
    dlerror();
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        cb_set_err(why, whylen, "cannot load the CUDA backend library: %s", e ? e : path);
        return false;
    }
    if (!s_cuda_resolve(h, path, api, why, whylen)) {
        dlclose(h);
        return false;
    }
    return true;
}

/* Opens the CUDA backend library: path when given, else $CB_CUDA_LIB, else <program dir>/../lib/CB_CUDA_SO,
 * else CB_CUDA_SO through the loader's search path. where (may be NULL) receives the path opened. */
static bool s_cuda_load(const char *path, s_cuda_api_t *api, char *where, size_t wherelen, char *why,
                        size_t whylen) {
    const char *env = getenv("CB_CUDA_LIB");
    if (!path && env && *env) {
        if (!s_cuda_open(env, api, why, whylen)) {
            char inner[768];
            snprintf(inner, sizeof inner, "%s", why);
            cb_set_err(why, whylen, "CB_CUDA_LIB=%s: %s", env, inner);
            return false;
        }
        path = env;
    } else if (path) {
        if (!s_cuda_open(path, api, why, whylen)) return false;
    } else {
        char exe[PATH_MAX], next[PATH_MAX + 32] = "";
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n > 0) {
            exe[n] = '\0';
            char *slash = strrchr(exe, '/');
            if (slash) {
                *slash = '\0';
                snprintf(next, sizeof next, "%s/../lib/%s", exe, CB_CUDA_SO);
            }
        }
        if (next[0] && access(next, F_OK) == 0) {
            if (!s_cuda_open(next, api, why, whylen)) return false;
            path = next;
        } else if (!s_cuda_open(CB_CUDA_SO, api, why, whylen)) {
            char inner[768];
            snprintf(inner, sizeof inner, "%s", why);
            cb_set_err(why, whylen, "%s is neither next to the program (%s) nor on the loader's path (%s)",
                       CB_CUDA_SO, next[0] ? next : "/proc/self/exe unreadable", inner);
            return false;
        } else {
            path = CB_CUDA_SO;
        }
    }
    if (where) cb_set_err(where, wherelen, "%s", path);
    return true;
}

static void s_cuda_init(void) {
    int n = s_driver_devices(s_cuda_why, sizeof s_cuda_why);
    if (n <= 0) return;
    /* The program's own copy first (linked with the CUDA backend and exporting it), else the library. */
    if (!s_cuda_resolve(RTLD_DEFAULT, "the program", &s_cuda, s_cuda_why, sizeof s_cuda_why) &&
        !s_cuda_load(NULL, &s_cuda, NULL, 0, s_cuda_why, sizeof s_cuda_why))
        return;
    n = s_cuda.device_count();
    if (n <= 0) {
        cb_set_err(s_cuda_why, sizeof s_cuda_why, "the CUDA runtime finds no usable device (the driver has one)");
        return;
    }
    s_cuda_devices = n;
}
#endif

int cb_backend_cuda_devices(void) {
#ifdef CB_HAVE_CUDA
    pthread_once(&s_cuda_once, s_cuda_init);
    return s_cuda_devices;
#else
    return 0;
#endif
}

int cb_backend_cuda_lib_check(const char *path, char *where, size_t wherelen, char *err, size_t errlen) {
#ifdef CB_HAVE_CUDA
    s_cuda_api_t api;
    char why[1024];
    if (!s_cuda_load(path, &api, where, wherelen, why, sizeof why)) {
        cb_set_err(err, errlen, "%s", why);
        return -1;
    }
    return 0;
#else
    (void)path, (void)where, (void)wherelen;
    cb_set_err(err, errlen, "this build has no CUDA backend (nvcc was not found at build time)");
    return -1;
#endif
}

cb_backend_t *cb_backend_select(cb_backend_kind_t kind, const cb_hparams_t *hp, int max_rows, int max_keys,
                                int n_threads, cb_backend_kind_t *chosen, char *err, size_t errlen) {
    cb_backend_kind_t got = CB_BACKEND_CPU;
    cb_backend_t *be = NULL;
    if (kind != CB_BACKEND_CPU) {
        char why[512] = "this build has no CUDA backend (nvcc was not found at build time)";
#ifdef CB_HAVE_CUDA
        if (cb_backend_cuda_devices() == 0)
            snprintf(why, sizeof why, "%s", s_cuda_why);
        else if ((be = s_cuda.backend_new(hp, max_rows, max_keys, 0, why, sizeof why)))
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
