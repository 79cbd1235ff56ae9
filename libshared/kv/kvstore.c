/* kvstore.c: chunk keys, the precompute context's KV, and the memory tier -> file -> remote tier -> compute
 * -> store walk (see kvstore.h). Owns: the context's token copy and sequence, a work sequence for chunk
 * computes, the kv_dir copy. Borrows: the engine, the memory tier, the remote tier.
 *
 * A KV path that is refused (kv_dir not a directory, a symbolic link, FIFO, directory or device at a chunk's
 * file name, an open that fails) is reported with its concrete reason: which check failed, errno's text, and
 * what lstat finds at the path (its type, mode and owner; a link's target and what that is): describe_path.
 */
#include "kv/kvstore.h"
#include "base/alloc.h"
#include "base/sysio.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/err.h"
#include "base/log.h"
#include "format/quant.h"

#define KVSTORE_WARN_SLOTS 16     /* keys whose failed writes are remembered for rate limiting */
#define KVSTORE_WARN_EVERY_MS 60000.0

struct cb_kvstore {
    cb_engine_t *e;
    const cb_model_t *model;
    const cb_hparams_t *hp;
    cb_kvmem_t *mem;           /* borrowed, may be NULL */
    cb_kvremote_t *remote;     /* borrowed, may be NULL */
    char *kv_dir;              /* owned copy, may be NULL */
    cb_kv_dtype_t dtype;
    uint8_t model_fp[32];
    int L, KVD, HD;

    /* the precompute context */
    cb_seq_t *ctx_seq;         /* its exact KV, positions [0, ctx_n) */
    int32_t *ctx_tokens;       /* [ctx_n] */
    int ctx_n;                 /* 0 = none yet */
    uint8_t ctx_fp[32];

    cb_seq_t *work;            /* chunk computes: shares the context's blocks, then the chunk */
    float **cap_k, **cap_v;    /* [L] capture pointers of one compute */

    /* failed KV file writes: a counter any thread may read, and the keys warned about lately */
    atomic_uint_fast64_t write_failed;
    struct {
        uint8_t key[32];
        double at_ms;          /* 0: free */
        uint64_t suppressed;   /* failures of this key not logged since */
    } warned[KVSTORE_WARN_SLOTS];
};

/* ---------------------------------------------------------------- refused paths */

/* The kind of file a mode says ("a FIFO", ...). */
static const char *mode_kind(mode_t m) {
    return S_ISREG(m) ? "a regular file" : S_ISDIR(m) ? "a directory" : S_ISLNK(m) ? "a symbolic link" :
           S_ISFIFO(m) ? "a FIFO" : S_ISSOCK(m) ? "a socket" : S_ISCHR(m) ? "a character device" :
           S_ISBLK(m) ? "a block device" : "of an unknown type";
}

/* What lstat finds at path, for the reason of a refusal: "lstat: a FIFO, mode 0644, uid 1000", a link with
 * its target and what the target is ("lstat: a symbolic link, uid 0, to /tmp/x (a FIFO)", "... (stat: No
 * such file or directory)"), or "lstat: <errno text>". The owner is named "not ours" when it is not this
 * process's effective user. Into out[cap], always terminated. */
static void describe_path(const char *path, char *out, size_t cap) {
    struct stat st;
    if (lstat(path, &st) != 0) {
        snprintf(out, cap, "lstat: %s", strerror(errno));
        return;
    }
    const char *owner = st.st_uid == geteuid() ? "" : " (not ours)";
    if (!S_ISLNK(st.st_mode)) {
        snprintf(out, cap, "lstat: %s, mode %04o, uid %u%s", mode_kind(st.st_mode), (unsigned)(st.st_mode & 07777),
                 (unsigned)st.st_uid, owner);
        return;
    }
    char target[512];
    ssize_t k = readlink(path, target, sizeof target - 1);
    if (k < 0) snprintf(target, sizeof target, "? (readlink: %s)", strerror(errno));
    else target[k] = 0;
    struct stat ts;
    char what[160];
    if (stat(path, &ts) != 0) snprintf(what, sizeof what, "stat: %s", strerror(errno));
    else snprintf(what, sizeof what, "%s", mode_kind(ts.st_mode));
    snprintf(out, cap, "lstat: a symbolic link, uid %u%s, to %.400s (%.150s)", (unsigned)st.st_uid, owner, target,
             what);
}

const char *cb_kvstore_src_str(cb_kvstore_src_t s) {
    return s == CB_KVSTORE_MEM ? "mem" : s == CB_KVSTORE_FILE ? "file" : s == CB_KVSTORE_COMPUTED ? "computed" : "?";
}

/* ---------------------------------------------------------------- lifetime */

cb_kvstore_t *cb_kvstore_new(cb_engine_t *engine, const char *kv_dir, cb_kvmem_t *mem, cb_kv_dtype_t dtype,
                             char *err, size_t errlen) {
    if (!engine) {
        cb_set_err(err, errlen, "kvstore: no engine");
        return NULL;
    }
    if (!cb_kv_row_bytes(dtype, 32)) {
        cb_set_err(err, errlen, "kvstore: unknown KV dtype %d", (int)dtype);
        return NULL;
    }
    if (kv_dir) {
        struct stat st;
        char what[700];
        if (stat(kv_dir, &st) != 0) {
            int e = errno;
            describe_path(kv_dir, what, sizeof what);
            cb_set_err(err, errlen, "kvstore: kv dir %s: stat: %s (%s)", kv_dir, strerror(e), what);
            return NULL;
        }
        if (!S_ISDIR(st.st_mode)) {
            describe_path(kv_dir, what, sizeof what);
            cb_set_err(err, errlen, "kvstore: kv dir %s: not a directory: %s (%s)", kv_dir, mode_kind(st.st_mode),
                       what);
            return NULL;
        }
        char probe[4096];
        static const uint8_t zero_key[32];
        if (cb_kvfile_path(kv_dir, zero_key, probe, sizeof probe) != 0) {
            cb_set_err(err, errlen, "kvstore: kv dir %.200s...: path too long for chunk file names", kv_dir);
            return NULL;
        }
    }
    cb_kvstore_t *s = cb_calloc(1, sizeof *s);
    if (!s) {
        cb_set_err(err, errlen, "kvstore: out of memory");
        return NULL;
    }
    s->e = engine;
    s->model = cb_engine_model(engine);
    s->hp = cb_model_hparams(s->model);
    s->mem = mem;
    s->dtype = dtype;
    atomic_init(&s->write_failed, 0);
    cb_model_fingerprint(s->model, s->model_fp);
    s->L = s->hp->n_layer;
    s->HD = s->hp->head_dim;
    s->KVD = s->hp->n_head_kv * s->HD;
    if (s->L > CB_KV_MAX_LAYERS || s->hp->n_head_kv > CB_KV_MAX_HEADS_KV || s->HD > CB_KV_MAX_HEAD_DIM ||
        s->KVD > CB_KV_MAX_KV_DIM || (s->HD & 1)) {
        cb_set_err(err, errlen, "kvstore: model geometry outside the KV file limits");
        goto fail;
    }
    if (!cb_kv_row_bytes(dtype, (size_t)s->KVD)) {
        cb_set_err(err, errlen, "kvstore: KV dtype %s cannot hold this model's rows (kv_dim %d is not a multiple of "
                   "its block)", cb_kv_dtype_name(dtype), s->KVD);
        goto fail;
    }
    if (kv_dir && !(s->kv_dir = cb_strdup(kv_dir))) goto oom;
    s->ctx_seq = cb_seq_new(engine);
    s->work = cb_seq_new(engine);
    s->cap_k = cb_calloc((size_t)s->L, sizeof(float *));
    s->cap_v = cb_calloc((size_t)s->L, sizeof(float *));
    if (!s->ctx_seq || !s->work || !s->cap_k || !s->cap_v) goto oom;
    return s;
oom:
    cb_set_err(err, errlen, "kvstore: out of memory");
fail:
    cb_kvstore_destroy(&s);
    return NULL;
}

void cb_kvstore_destroy(cb_kvstore_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_kvstore_t *s = *self_p;
    cb_seq_destroy(&s->ctx_seq);
    cb_seq_destroy(&s->work);
    free(s->ctx_tokens);
    free(s->kv_dir);
    free(s->cap_k);
    free(s->cap_v);
    free(s);
    *self_p = NULL;
}

cb_engine_t *cb_kvstore_engine(const cb_kvstore_t *self) { return self->e; }
cb_kvmem_t *cb_kvstore_mem(const cb_kvstore_t *self) { return self->mem; }
cb_kv_dtype_t cb_kvstore_dtype(const cb_kvstore_t *self) { return self->dtype; }
void cb_kvstore_set_remote(cb_kvstore_t *self, cb_kvremote_t *remote) { self->remote = remote; }
cb_kvremote_t *cb_kvstore_remote(const cb_kvstore_t *self) { return self->remote; }
const cb_seq_t *cb_kvstore_context_seq(const cb_kvstore_t *self) { return self->ctx_seq; }
int cb_kvstore_context_len(const cb_kvstore_t *self) { return self->ctx_n; }
uint64_t cb_kvstore_write_failures(const cb_kvstore_t *self) {
    return self ? atomic_load(&((cb_kvstore_t *)self)->write_failed) : 0;
}

/* ---------------------------------------------------------------- keys and checks */

void cb_kvstore_chunk_key(const cb_kvstore_t *self, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n,
                          uint8_t key[32]) {
    uint8_t fp[32];
    cb_kvfile_ctx_fp(self->model_fp, ctx, n_ctx, fp);
    cb_kvfile_key(self->model_fp, fp, tokens, n, key);
}

int cb_kvstore_path(const cb_kvstore_t *self, const uint8_t key[32], char *path, size_t cap) {
    if (!self->kv_dir) return -1;
    return cb_kvfile_path(self->kv_dir, key, path, cap);
}

static int check_tokens(const cb_kvstore_t *s, const int32_t *t, int n, const char *what, char *err, size_t errlen) {
    char w[48];
    snprintf(w, sizeof w, "kvstore: %s", what);
    return cb_model_check_tokens(s->model, t, n, w, err, errlen);
}

static int check_ctx_chunk(const cb_kvstore_t *s, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n,
                           char *err, size_t errlen) {
    if (check_tokens(s, ctx, n_ctx, "context", err, errlen) || check_tokens(s, tokens, n, "chunk", err, errlen))
        return -1;
    const int max_ctx = cb_engine_max_ctx(s->e);
    if (n_ctx > max_ctx || n > max_ctx - n_ctx) {
        cb_set_err(err, errlen, "kvstore: context %d + chunk %d tokens exceed max_ctx %d", n_ctx, n, max_ctx);
        return -1;
    }
    if (n > CB_KV_MAX_TOKENS) {
        cb_set_err(err, errlen, "kvstore: chunk of %d tokens exceeds the KV file limit", n);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- the context */

int cb_kvstore_set_context(cb_kvstore_t *self, const int32_t *ctx, int n_ctx, char *err, size_t errlen) {
    if (!self) return -1;
    if (self->ctx_n == n_ctx && n_ctx > 0 && !memcmp(self->ctx_tokens, ctx, sizeof(int32_t) * (size_t)n_ctx))
        return 0;
    if (check_tokens(self, ctx, n_ctx, "context", err, errlen)) return -1;
    if (n_ctx > cb_engine_max_ctx(self->e)) {
        cb_set_err(err, errlen, "kvstore: context of %d tokens exceeds max_ctx %d", n_ctx, cb_engine_max_ctx(self->e));
        return -1;
    }
    /* requests still holding the old context's blocks keep them (reference counts) */
    cb_seq_clear(self->ctx_seq);
    free(self->ctx_tokens);
    self->ctx_tokens = NULL;
    self->ctx_n = 0;
    int32_t *copy = cb_malloc(sizeof(int32_t) * (size_t)n_ctx);
    if (!copy) {
        cb_set_err(err, errlen, "kvstore: out of memory");
        return -1;
    }
    memcpy(copy, ctx, sizeof(int32_t) * (size_t)n_ctx);
    int rc = cb_engine_prefill(self->e, self->ctx_seq, copy, n_ctx, 0, NULL);
    if (rc) {
        cb_set_err(err, errlen, "kvstore: computing the context of %d tokens: %s", n_ctx, cb_engine_status_str(rc));
        cb_seq_clear(self->ctx_seq);
        free(copy);
        return rc == CB_ENGINE_EPOOL ? CB_ENGINE_EPOOL : -1;
    }
    self->ctx_tokens = copy;
    self->ctx_n = n_ctx;
    cb_kvfile_ctx_fp(self->model_fp, copy, n_ctx, self->ctx_fp);
    return 0;
}

/* ---------------------------------------------------------------- compute and store */

/* A failed KV file write of key: counted; logged as a warning at most once a minute per key (a key that
 * keeps failing, e.g. a directory in the way, would otherwise log at every query), with the number of
 * failures not logged since. */
static void write_failed(cb_kvstore_t *s, const uint8_t key[32], const char *why) {
    atomic_fetch_add(&s->write_failed, 1);
    double now = cb_now_ms();
    int slot = -1, oldest = 0;
    for (int i = 0; i < KVSTORE_WARN_SLOTS; i++) {
        if (s->warned[i].at_ms > 0 && !memcmp(s->warned[i].key, key, 32)) {
            slot = i;
            break;
        }
        if (s->warned[i].at_ms < s->warned[oldest].at_ms) oldest = i;
    }
    if (slot >= 0 && now - s->warned[slot].at_ms < KVSTORE_WARN_EVERY_MS) {
        s->warned[slot].suppressed++;
        return;
    }
    uint64_t quiet = slot >= 0 ? s->warned[slot].suppressed : 0;
    if (slot < 0) {
        slot = oldest;
        memcpy(s->warned[slot].key, key, 32);
    }
    s->warned[slot].at_ms = now;
    s->warned[slot].suppressed = 0;
    char hex[CB_KV_HEX_BYTES];
    if (quiet)
        CB_WARN("kvstore: KV file of chunk %.16s not written: %s (%llu more failures of it in the last minute)",
                cb_kvfile_hex(key, hex), why, (unsigned long long)quiet);
    else
        CB_WARN("kvstore: KV file of chunk %.16s not written: %s", cb_kvfile_hex(key, hex), why);
}

/* Whether a failed write of key was warned about in the last minute. */
static bool recently_warned(const cb_kvstore_t *s, const uint8_t key[32]) {
    double now = cb_now_ms();
    for (int i = 0; i < KVSTORE_WARN_SLOTS; i++)
        if (s->warned[i].at_ms > 0 && !memcmp(s->warned[i].key, key, 32))
            return now - s->warned[i].at_ms < KVSTORE_WARN_EVERY_MS;
    return false;
}

/* Writes an entry (this context's chunk) as key's KV file in dtype (kv_dir set). 0, or -1 (err; counted,
 * and logged by write_failed, rate limited). */
static int write_file(cb_kvstore_t *s, const uint8_t key[32], const cb_kvmem_entry_t *ent, cb_kv_dtype_t dtype,
                      char *err, size_t errlen) {
    char path[4096];
    if (cb_kvstore_path(s, key, path, sizeof path) != 0) {
        cb_set_err(err, errlen, "kvstore: kv dir path too long");
        return -1;
    }
    cb_kv_meta_t meta;
    memset(&meta, 0, sizeof meta);
    memcpy(meta.model_fp, s->model_fp, 32);
    memcpy(meta.ctx_fp, s->ctx_fp, 32);
    meta.n_layer = s->L;
    meta.n_head_kv = s->hp->n_head_kv;
    meta.head_dim = s->HD;
    meta.dtype = dtype;
    for (int l = 0; l < s->L; l++) {
        s->cap_k[l] = (float *)cb_kvmem_entry_k(ent, l);
        s->cap_v[l] = (float *)cb_kvmem_entry_v(ent, l);
    }
    char werr[600] = "";
    if (cb_kvfile_write_layers(path, &meta, cb_kvmem_entry_tokens(ent), cb_kvmem_entry_n_tokens(ent),
                               (const float *const *)s->cap_k, (const float *const *)s->cap_v, werr,
                               sizeof werr) != 0) {
        cb_set_err(err, errlen, "kvstore: %s", werr); /* werr names the path */
        write_failed(s, key, werr);
        return -1;
    }
    return 0;
}

/* Puts key's local KV file (its bytes, as they are) in the remote tier. Best effort: a failure is counted
 * and logged by kvremote (a tier going down) or here (debug); the caller goes on. */
static void remote_put_file(cb_kvstore_t *s, const uint8_t key[32]) {
    char path[4096];
    if (!s->remote || cb_kvstore_path(s, key, path, sizeof path) != 0) return;
    char what[700];
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT) return; /* no local file (evicted meanwhile): nothing to put */
        describe_path(path, what, sizeof what);
        CB_WARN("kvstore: KV file %s not put in the remote tier: open refused it: %s (%s)", path,
                e == ELOOP ? "a symbolic link (O_NOFOLLOW: not followed)" : strerror(e), what);
        return;
    }
    struct stat st;
    uint8_t *buf = NULL;
    size_t len = 0;
    if (fstat(fd, &st) != 0) {
        CB_WARN("kvstore: KV file %s not put in the remote tier: fstat: %s", path, strerror(errno));
        close(fd);
        return;
    }
    if (!S_ISREG(st.st_mode) || st.st_size <= 0) {
        describe_path(path, what, sizeof what);
        CB_WARN("kvstore: KV file %s not put in the remote tier: %s (%s)", path,
                S_ISREG(st.st_mode) ? "an empty file" : "not a regular file", what);
        close(fd);
        return;
    }
    if ((uint64_t)st.st_size > cb_kvremote_max_value_bytes(s->remote)) {
        CB_DEBUG("kvstore: KV file %s (%lld bytes) is over the remote tier's max value size: not shared", path,
                 (long long)st.st_size);
        close(fd);
        return;
    }
    len = (size_t)st.st_size;
    if (!(buf = cb_malloc(len))) {
        close(fd);
        return;
    }
    size_t got = 0;
    while (got < len) {
        ssize_t k = cb_io_read(fd, buf + got, len - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        got += (size_t)k;
    }
    close(fd);
    char err[512] = "";
    if (got == len && cb_kvremote_put(s->remote, s->model_fp, key, buf, len, err, sizeof err) != CB_KVREMOTE_OK)
        CB_DEBUG("kvstore: chunk not put in the remote tier: %s", err);
    free(buf);
}

/* Stores an entry as a KV file (if kv_dir; then also in the remote tier, if any) and in the memory tier
 * (if mem). 0, or -1 when the file write failed (err; counted, and logged by write_failed, rate limited). */
static int store_entry(cb_kvstore_t *s, const uint8_t key[32], cb_kvmem_entry_t *ent, char *err, size_t errlen) {
    int rc = 0;
    if (s->kv_dir) {
        rc = write_file(s, key, ent, s->dtype, err, errlen);
        if (rc == 0) remote_put_file(s, key);
    }
    if (s->mem) cb_kvmem_put(s->mem, key, ent);
    return rc;
}

/* Rounds an entry's K/V through the storage dtype, so that a chunk computed now gives exactly what the same
 * chunk read back from its file gives. */
static void round_to_dtype(const cb_kvstore_t *s, cb_kvmem_entry_t *ent) {
    if (s->dtype == CB_KV_F32) return;
    size_t cnt = (size_t)cb_kvmem_entry_n_tokens(ent) * s->KVD;
    for (int l = 0; l < s->L; l++) {
        float *p[2] = {cb_kvmem_entry_k_mut(ent, l), cb_kvmem_entry_v_mut(ent, l)};
        for (int t = 0; t < 2; t++)
            for (size_t i = 0; i < cnt; i++)
                p[t][i] = s->dtype == CB_KV_F16 ? cb_f16_to_f32(cb_f32_to_f16(p[t][i]))
                                                : cb_bf16_to_f32(cb_f32_to_bf16(p[t][i]));
    }
}

/* Computes chunk tokens [n] after the current context: a plain prefill at positions ctx_n.. of a sequence
 * sharing the context's blocks, capturing pre-RoPE K and V; rounded to the dtype. NULL on failure, with
 * *rc_out (may be NULL) = CB_ENGINE_EPOOL when the pool had no room, else -1. */
static cb_kvmem_entry_t *compute_chunk(cb_kvstore_t *s, const int32_t *tokens, int n, int *rc_out, char *err,
                                       size_t errlen) {
    if (rc_out) *rc_out = -1;
    cb_kvmem_entry_t *ent = cb_kvmem_entry_new(s->L, s->hp->n_head_kv, s->HD, n);
    if (!ent) {
        cb_set_err(err, errlen, "kvstore: out of memory (chunk KV of %d tokens)", n);
        return NULL;
    }
    memcpy(cb_kvmem_entry_tokens_mut(ent), tokens, sizeof(int32_t) * (size_t)n);
    for (int l = 0; l < s->L; l++) {
        s->cap_k[l] = cb_kvmem_entry_k_mut(ent, l);
        s->cap_v[l] = cb_kvmem_entry_v_mut(ent, l);
    }
    int rc = cb_seq_share(s->work, s->ctx_seq, s->ctx_n);
    if (rc == 0) rc = cb_engine_prefill_capture(s->e, s->work, tokens, n, s->ctx_n, s->cap_k, s->cap_v, NULL);
    cb_seq_clear(s->work);
    if (rc) {
        cb_set_err(err, errlen, "kvstore: computing a chunk of %d tokens: %s", n, cb_engine_status_str(rc));
        if (rc_out && rc == CB_ENGINE_EPOOL) *rc_out = CB_ENGINE_EPOOL;
        cb_kvmem_entry_release(&ent);
        return NULL;
    }
    round_to_dtype(s, ent);
    return ent;
}

cb_kvmem_entry_t *cb_kvstore_compute(cb_kvstore_t *self, const int32_t *ctx, int n_ctx, const int32_t *tokens,
                                     int n, bool store, char *err, size_t errlen) {
    if (!self) return NULL;
    if (check_ctx_chunk(self, ctx, n_ctx, tokens, n, err, errlen)) return NULL;
    if (cb_kvstore_set_context(self, ctx, n_ctx, err, errlen)) return NULL;
    cb_kvmem_entry_t *ent = compute_chunk(self, tokens, n, NULL, err, errlen);
    if (!ent) return NULL;
    if (store) {
        uint8_t key[32];
        cb_kvfile_key(self->model_fp, self->ctx_fp, tokens, n, key);
        if (store_entry(self, key, ent, err, errlen) != 0) {
            cb_kvmem_entry_release(&ent);
            return NULL;
        }
    }
    return ent;
}

/* ---------------------------------------------------------------- lookup */

/* What a KV file of chunk tokens [n] after the current context must be. */
static void expect_of(const cb_kvstore_t *s, const int32_t *tokens, int n, cb_kv_expect_t *ex) {
    memset(ex, 0, sizeof *ex);
    memcpy(ex->model_fp, s->model_fp, 32);
    memcpy(ex->ctx_fp, s->ctx_fp, 32);
    ex->n_layer = s->L;
    ex->n_head_kv = s->hp->n_head_kv;
    ex->head_dim = s->HD;
    ex->tokens = tokens;
    ex->n_tokens = n;
}

/* Opens key's file against this model, context and tokens. NULL = miss (*why). */
static cb_kvfile_t *open_chunk_file(cb_kvstore_t *s, const uint8_t key[32], const int32_t *tokens, int n,
                                    cb_kv_miss_t *why) {
    char path[4096];
    if (cb_kvstore_path(s, key, path, sizeof path) != 0) {
        *why = CB_KV_MISS_NOT_FOUND;
        return NULL;
    }
    cb_kv_expect_t ex;
    expect_of(s, tokens, n, &ex);
    char err[512] = "";
    cb_kvfile_t *f = cb_kvfile_open(path, &ex, why, err, sizeof err);
    /* a key whose rewrite keeps failing (an obstacle at its path) was warned about with the write failure */
    if (!f && *why != CB_KV_MISS_NOT_FOUND) {
        /* refused before its bytes were read (not a regular file, open/stat failed): say what is there */
        char what[700] = "";
        if (*why == CB_KV_MISS_NOT_REGULAR || *why == CB_KV_MISS_IO) describe_path(path, what, sizeof what);
        cb_log(recently_warned(s, key) ? CB_LOG_DEBUG : CB_LOG_WARN, NULL, "kvstore: chunk file miss (%s): %s%s%s",
               cb_kv_miss_str(*why), err, what[0] ? "; " : "", what);
    }
    return f;
}

/* Whether a memory-tier entry fits this model and these tokens (the key makes a mismatch unlikely; an entry
 * that does not fit is dropped and counts as a miss). */
static bool entry_fits(const cb_kvstore_t *s, const cb_kvmem_entry_t *e, const int32_t *tokens, int n) {
    return cb_kvmem_entry_n_layer(e) == s->L && cb_kvmem_entry_n_head_kv(e) == s->hp->n_head_kv &&
           cb_kvmem_entry_head_dim(e) == s->HD && cb_kvmem_entry_n_tokens(e) == n &&
           !memcmp(cb_kvmem_entry_tokens(e), tokens, sizeof(int32_t) * (size_t)n);
}

/* The memory tier's entry for key, validated (NULL: miss). */
static cb_kvmem_entry_t *mem_get(cb_kvstore_t *s, const uint8_t key[32], const int32_t *tokens, int n) {
    if (!s->mem) return NULL;
    cb_kvmem_entry_t *e = cb_kvmem_get(s->mem, key);
    if (e && !entry_fits(s, e, tokens, n)) {
        CB_WARN("kvstore: memory-tier entry does not fit its key; dropped");
        cb_kvmem_remove(s->mem, key);
        cb_kvmem_entry_release(&e);
    }
    return e;
}

/* The chunk from the remote tier (after a file miss): a value that opens and verifies in full (every
 * checksum) as key's KV file for this model, context and tokens; one that does not is rejected (counted,
 * deleted from Redis) and is a miss. With kv_dir the value is written as the local KV file, in its own
 * dtype (*stored: it was). Returns the value's verified handle, or NULL (a miss: not there, the tier down
 * or slow, or rejected). */
static cb_kvfile_t *remote_fetch(cb_kvstore_t *s, const uint8_t key[32], const int32_t *tokens, int n,
                                 bool *stored) {
    *stored = false;
    uint8_t *val = NULL;
    size_t len = 0;
    char err[512] = "";
    cb_kvremote_rc_t rc = cb_kvremote_get(s->remote, s->model_fp, key, &val, &len, err, sizeof err);
    if (rc == CB_KVREMOTE_TOO_LARGE) { /* counted as corrupt by kvremote */
        char derr[256] = "";
        CB_WARN("kvstore: remote value of a chunk rejected: %s", err);
        cb_kvremote_del(s->remote, s->model_fp, key, derr, sizeof derr);
    }
    if (rc != CB_KVREMOTE_OK) return NULL; /* a miss, or the tier down (kvremote logs the transition) */
    cb_kv_expect_t ex;
    expect_of(s, tokens, n, &ex);
    cb_kv_miss_t why = CB_KV_OK;
    cb_kvfile_t *f = cb_kvfile_open_mem(val, len, &ex, &why, err, sizeof err);
    free(val);
    if (f && memcmp(cb_kvfile_key_of(f), key, 32) != 0) { /* the value of another key */
        why = CB_KV_MISS_NAME_MISMATCH;
        snprintf(err, sizeof err, "name_mismatch: the value holds another chunk's key");
        cb_kvfile_destroy(&f);
    }
    if (f && (why = cb_kvfile_verify(f)) != CB_KV_OK) {
        snprintf(err, sizeof err, "%s: a layer fails its checksum", cb_kv_miss_str(why));
        cb_kvfile_destroy(&f);
    }
    if (!f) {
        cb_kvremote_reject(s->remote, s->model_fp, key, err[0] ? err : cb_kv_miss_str(why)); /* err names why */
        return NULL;
    }
    if (s->kv_dir) { /* the local copy: the next use is a file hit */
        cb_kv_miss_t w = CB_KV_OK;
        cb_kvmem_entry_t *ent = cb_kvmem_entry_from_file(f, &w);
        if (ent) *stored = write_file(s, key, ent, cb_kvfile_meta(f)->dtype, err, sizeof err) == 0;
        cb_kvmem_entry_release(&ent);
    }
    return f;
}

void cb_kvstore_remember(cb_kvstore_t *self, const uint8_t key[32], cb_kvmem_entry_t *entry) {
    if (self->mem && entry) cb_kvmem_put(self->mem, key, entry);
}

void cb_kvstore_chunk_release(cb_kvstore_chunk_t *c) {
    if (!c) return;
    cb_kvmem_entry_release(&c->entry);
    cb_kvfile_destroy(&c->file);
}

/* The walk for the current context (tokens checked): memory tier, the file (an open, header-checked
 * handle), the remote tier (a verified handle; its local copy written), or computed now and stored.
 * skip_cached: forget the memory-tier entry and skip the file (the remote tier is still asked: its values
 * are verified in full before use). strict_store: a failed file write fails the call (precompute needs the
 * file); else it is logged and the chunk is used from memory. 0, CB_ENGINE_EPOOL or -1. */
static int lookup(cb_kvstore_t *s, const int32_t *tokens, int n, bool skip_cached, bool strict_store,
                  cb_kvstore_chunk_t *rs, char *err, size_t errlen) {
    memset(rs, 0, sizeof *rs);
    cb_kvfile_key(s->model_fp, s->ctx_fp, tokens, n, rs->key);
    rs->why = CB_KV_OK;
    if (!skip_cached) {
        rs->entry = mem_get(s, rs->key, tokens, n);
        if (rs->entry) {
            rs->src = CB_KVSTORE_MEM;
            return 0;
        }
        cb_kv_miss_t w = CB_KV_MISS_NOT_FOUND;
        rs->file = open_chunk_file(s, rs->key, tokens, n, &w);
        if (rs->file) {
            rs->src = CB_KVSTORE_FILE;
            return 0;
        }
        rs->why = w;
    } else if (s->mem) {
        cb_kvmem_remove(s->mem, rs->key);
    }
    if (s->remote) {
        bool stored = false;
        cb_kvfile_t *f = remote_fetch(s, rs->key, tokens, n, &stored);
        if (f && strict_store && s->kv_dir && !stored) {
            cb_kvfile_destroy(&f);
            cb_set_err(err, errlen, "kvstore: the local copy of a chunk from the remote tier could not be written");
            return -1;
        }
        if (f) {
            rs->file = f;
            rs->src = CB_KVSTORE_FILE;
            rs->remote = true;
            rs->stored = stored;
            rs->why = CB_KV_OK;
            return 0;
        }
    }
    int crc;
    rs->entry = compute_chunk(s, tokens, n, &crc, err, errlen);
    if (!rs->entry) return crc;
    rs->src = CB_KVSTORE_COMPUTED;
    char serr[512] = "";
    if (store_entry(s, rs->key, rs->entry, serr, sizeof serr) != 0) {
        if (!strict_store) return 0; /* logged (rate limited); the chunk is used from memory, rs->stored false */
        cb_set_err(err, errlen, "%s", serr);
        cb_kvstore_chunk_release(rs);
        return -1;
    }
    rs->stored = s->kv_dir != NULL;
    return 0;
}

int cb_kvstore_resolve(cb_kvstore_t *self, const int32_t *tokens, int n, bool skip_cached, cb_kvstore_chunk_t *rs,
                       char *err, size_t errlen) {
    memset(rs, 0, sizeof *rs);
    if (!self || self->ctx_n == 0) {
        cb_set_err(err, errlen, "kvstore: no precompute context");
        return -1;
    }
    if (check_ctx_chunk(self, self->ctx_tokens, self->ctx_n, tokens, n, err, errlen)) return -1;
    return lookup(self, tokens, n, skip_cached, false, rs, err, errlen);
}

/* Shared by ensure/load: the walk, with a file decoded (want_entry, or to fill the memory tier) or verified
 * in full; a file that fails is a miss like any other: computed and stored. With want_entry the decoded KV
 * is returned. refill: a chunk found locally (memory tier or file) is put in the remote tier when Redis
 * does not have it (EXISTS, then SET of the file's bytes). */
static int find_chunk(cb_kvstore_t *s, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n, bool want_entry,
                      bool refill, cb_kvmem_entry_t **out, cb_kvstore_src_t *src, cb_kv_miss_t *why, char *err,
                      size_t errlen) {
    if (check_ctx_chunk(s, ctx, n_ctx, tokens, n, err, errlen)) return -1;
    int rc = cb_kvstore_set_context(s, ctx, n_ctx, err, errlen);
    if (rc) return rc;
    cb_kvstore_chunk_t c;
    if ((rc = lookup(s, tokens, n, false, true, &c, err, errlen)) != 0) return rc;
    /* a file (or a remote value, verified already) decoded or verified; one that fails is computed (or,
     * when the remote tier has it, taken from there: then decoded in the second turn) */
    for (int turn = 0; c.src == CB_KVSTORE_FILE; turn++) {
        cb_kv_miss_t w; /* set by both: CB_KV_OK exactly when the whole file verified */
        if (want_entry || s->mem) {
            c.entry = cb_kvmem_entry_from_file(c.file, &w);
            if (c.entry && s->mem) cb_kvmem_put(s->mem, c.key, c.entry);
        } else {
            w = cb_kvfile_verify(c.file);
        }
        cb_kvfile_destroy(&c.file);
        if (w == CB_KV_OK) break;
        char path[4096] = "";
        if (c.remote || cb_kvstore_path(s, c.key, path, sizeof path) != 0)
            snprintf(path, sizeof path, "the remote tier's value");
        CB_WARN("kvstore: chunk file miss (%s): %s: %s", cb_kv_miss_str(w), path,
                w == CB_KV_MISS_PAYLOAD_CHECKSUM ? "a layer's bytes do not match their checksum (read in full)"
                                                 : "it failed when read in full");
        cb_kvstore_chunk_release(&c);
        if (turn > 0) {
            cb_set_err(err, errlen, "kvstore: a verified chunk value failed to decode (%s)", cb_kv_miss_str(w));
            return -1;
        }
        if ((rc = lookup(s, tokens, n, true, true, &c, err, errlen)) != 0) return rc;
        if (c.src == CB_KVSTORE_COMPUTED) c.why = w;
    }
    if (refill && s->remote && s->kv_dir && !c.remote && c.src != CB_KVSTORE_COMPUTED) {
        char e[256] = "";
        if (cb_kvremote_exists(s->remote, s->model_fp, c.key, e, sizeof e) == CB_KVREMOTE_MISS) remote_put_file(s, c.key);
    }
    if (src) *src = c.src;
    if (why) *why = c.why;
    if (want_entry) {
        *out = c.entry;
        c.entry = NULL;
    }
    cb_kvstore_chunk_release(&c);
    return 0;
}

int cb_kvstore_ensure(cb_kvstore_t *self, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n,
                      cb_kvstore_src_t *src, cb_kv_miss_t *why, char *err, size_t errlen) {
    if (!self) return -1;
    return find_chunk(self, ctx, n_ctx, tokens, n, false, true, NULL, src, why, err, errlen);
}

cb_kvmem_entry_t *cb_kvstore_load(cb_kvstore_t *self, const int32_t *ctx, int n_ctx, const int32_t *tokens, int n,
                                  cb_kvstore_src_t *src, cb_kv_miss_t *why, char *err, size_t errlen) {
    cb_kvmem_entry_t *ent = NULL;
    if (!self || find_chunk(self, ctx, n_ctx, tokens, n, true, false, &ent, src, why, err, errlen) != 0) return NULL;
    return ent;
}
