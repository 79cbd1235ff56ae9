/* kvfile.c: chunk KV files (see kvfile.h; the format is specified in docs/kvfile.md).
 *
 * Layout: a 256-byte fixed header (kv_header_t, pinned below), the meta region (token ids, then one
 * XXH3-64 per layer), zero padding to a 4096-byte boundary, then one 64-byte-aligned record per layer
 * (K, padding, V, padding). The reader recomputes every offset from the geometry and requires the
 * header's copies to be equal, so no file-supplied size is ever used unchecked.
 *
 * Owns: the mapping (cb_kvfile_open) or a 64-byte-aligned copy of the caller's buffer (open_mem).
 * Fails with a miss reason and a message; nothing asserts on file content.
 */
#include "format/kvfile.h"
#include "base/alloc.h"
#include "base/sysio.h"
#include "base/err.h"
#include "base/log.h"
#include "format/gguf.h"
#include "format/quant.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvfile.c writes and reads little-endian fields by memcpy and assumes a little-endian host"
#endif

#define KV_MAGIC        "CBKVFILE"
#define KV_HEADER_SIZE  256u
#define KV_PAYLOAD_ALIGN 4096u  /* the payload starts on a page: mmap-friendly */
#define KV_LAYER_ALIGN  64u     /* each layer's K and V start on a cache line */
#define KV_FLAG_K_PRE_ROPE 1u   /* K is stored before RoPE (the only layout of version 1) */
#define KV_TMP_MARK     ".tmp." /* temporary names: "<final>.tmp.<pid>.<counter>" */

/* The fixed header, as on disk (all fields little-endian). header_checksum = XXH3-64 of bytes
 * [0, 248); meta_checksum = XXH3-64 of the meta region [meta_offset, meta_offset + meta_bytes). */
typedef struct {
    char magic[8];             /*   0: "CBKVFILE" */
    uint32_t version;          /*   8: CB_KV_FORMAT_VERSION */
    uint32_t header_size;      /*  12: 256 */
    uint8_t model_fp[32];      /*  16 */
    uint8_t ctx_fp[32];        /*  48 */
    uint8_t key[32];           /*  80: cb_kvfile_key(model_fp, ctx_fp, tokens) */
    uint32_t n_layer;          /* 112 */
    uint32_t n_head_kv;        /* 116 */
    uint32_t head_dim;         /* 120 */
    uint32_t n_tokens;         /* 124 */
    uint32_t dtype;            /* 128: cb_kv_dtype_t */
    uint32_t flags;            /* 132: KV_FLAG_K_PRE_ROPE */
    uint64_t meta_offset;      /* 136: = header_size */
    uint64_t meta_bytes;       /* 144: round8(4 * n_tokens) + 8 * n_layer */
    uint64_t payload_offset;   /* 152: round4096(meta_offset + meta_bytes) */
    uint64_t layer_stride;     /* 160: bytes per layer record */
    uint64_t v_offset;         /* 168: V's offset inside a layer record */
    uint64_t file_size;        /* 176: payload_offset + n_layer * layer_stride */
    uint64_t meta_checksum;    /* 184 */
    uint8_t reserved[56];      /* 192: zero */
    uint64_t header_checksum;  /* 248 */
} kv_header_t;

_Static_assert(sizeof(kv_header_t) == KV_HEADER_SIZE, "kv file header is 256 bytes");
_Static_assert(offsetof(kv_header_t, n_layer) == 112, "kv header layout");
_Static_assert(offsetof(kv_header_t, meta_offset) == 136, "kv header layout");
_Static_assert(offsetof(kv_header_t, reserved) == 192, "kv header layout");
_Static_assert(offsetof(kv_header_t, header_checksum) == 248, "kv header checksum is the last field");
_Static_assert(sizeof(int32_t) == 4 && sizeof(float) == 4, "fixed widths");

/* Offsets and sizes of a file, all derived from the geometry (the reader's truth). */
typedef struct {
    uint64_t kv_dim, elsize, k_bytes, meta_bytes, payload_offset, v_offset, layer_stride, file_size;
} kv_layout_t;

struct cb_kvfile {
    const uint8_t *base;       /* the file bytes */
    size_t size;
    int mapped;                /* base is our mmap (else our aligned copy) */
    cb_kv_meta_t meta;
    int n_tokens;
    const int32_t *tokens;     /* [n_tokens], in base */
    const uint64_t *sums;      /* [n_layer] per-layer checksums, in base */
    uint8_t key[CB_KV_KEY_BYTES];
    kv_layout_t lay;
    uint8_t verified[CB_KV_MAX_LAYERS]; /* layer checksum already verified */
};

static atomic_int g_stop_before_rename;
static atomic_uint g_tmp_counter;
static pthread_once_t g_sodium_once = PTHREAD_ONCE_INIT;

/* sodium_init only selects faster implementations; BLAKE2b works without it, so a failure is not fatal. */
static void sodium_once(void) {
    if (sodium_init() < 0) return; /* keep the portable implementation */
}

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

size_t cb_kv_dtype_size(uint32_t dtype) {
    switch (dtype) {
    case CB_KV_F32: return 4;
    case CB_KV_F16: return 2;
    case CB_KV_BF16: return 2;
    default: return 0;
    }
}

#define Q8_BLOCK 32                      /* values per Q8_0 block */
#define Q8_BLOCK_BYTES (2 + Q8_BLOCK)    /* f16 scale + 32 int8 */

size_t cb_kv_row_bytes(uint32_t dtype, size_t kv_dim) {
    if (dtype == CB_KV_Q8_0) return kv_dim % Q8_BLOCK == 0 ? kv_dim / Q8_BLOCK * Q8_BLOCK_BYTES : 0;
    return kv_dim * cb_kv_dtype_size(dtype);
}

static const struct {
    uint32_t dtype;
    const char *name;
} DTYPE_NAMES[] = {{CB_KV_F32, "f32"}, {CB_KV_F16, "f16"}, {CB_KV_BF16, "bf16"}, {CB_KV_Q8_0, "q8_0"}};

const char *cb_kv_dtype_name(uint32_t dtype) {
    for (size_t i = 0; i < sizeof DTYPE_NAMES / sizeof DTYPE_NAMES[0]; i++)
        if (DTYPE_NAMES[i].dtype == dtype) return DTYPE_NAMES[i].name;
    return "?";
}

int cb_kv_dtype_parse(const char *name) {
    for (size_t i = 0; name && i < sizeof DTYPE_NAMES / sizeof DTYPE_NAMES[0]; i++)
        if (!strcmp(DTYPE_NAMES[i].name, name)) return (int)DTYPE_NAMES[i].dtype;
    return -1;
}

/* Geometry must already be within the limits (then nothing here overflows 64 bits). */
static kv_layout_t layout_of(uint64_t n_layer, uint64_t n_head_kv, uint64_t head_dim, uint64_t n_tokens,
                             uint32_t dtype) {
    kv_layout_t l;
    l.kv_dim = n_head_kv * head_dim;
    l.elsize = cb_kv_dtype_size(dtype);
    l.k_bytes = n_tokens * cb_kv_row_bytes(dtype, l.kv_dim);
    l.meta_bytes = round_up(4 * n_tokens, 8) + 8 * n_layer;
    l.payload_offset = round_up(KV_HEADER_SIZE + l.meta_bytes, KV_PAYLOAD_ALIGN);
    l.v_offset = round_up(l.k_bytes, KV_LAYER_ALIGN);
    l.layer_stride = round_up(l.v_offset + l.k_bytes, KV_LAYER_ALIGN);
    l.file_size = l.payload_offset + n_layer * l.layer_stride;
    return l;
}

static int geometry_ok(long n_layer, long n_head_kv, long head_dim, long n_tokens) {
    return n_layer >= 1 && n_layer <= CB_KV_MAX_LAYERS && n_head_kv >= 1 && n_head_kv <= CB_KV_MAX_HEADS_KV &&
           head_dim >= 1 && head_dim <= CB_KV_MAX_HEAD_DIM && n_head_kv * head_dim <= CB_KV_MAX_KV_DIM &&
           n_tokens >= 1 && n_tokens <= CB_KV_MAX_TOKENS;
}

const char *cb_kv_miss_str(cb_kv_miss_t why) {
    static const char *const names[CB_KV_MISS_COUNT_] = {
        [CB_KV_OK] = "ok",
        [CB_KV_MISS_NOT_FOUND] = "not_found",
        [CB_KV_MISS_IO] = "io",
        [CB_KV_MISS_TRUNCATED] = "truncated",
        [CB_KV_MISS_BAD_MAGIC] = "bad_magic",
        [CB_KV_MISS_BAD_VERSION] = "bad_version",
        [CB_KV_MISS_HEADER_CHECKSUM] = "header_checksum",
        [CB_KV_MISS_BAD_HEADER] = "bad_header",
        [CB_KV_MISS_NAME_MISMATCH] = "name_mismatch",
        [CB_KV_MISS_MODEL_MISMATCH] = "model_mismatch",
        [CB_KV_MISS_CONTEXT_MISMATCH] = "context_mismatch",
        [CB_KV_MISS_GEOMETRY_MISMATCH] = "geometry_mismatch",
        [CB_KV_MISS_TOKENS_MISMATCH] = "tokens_mismatch",
        [CB_KV_MISS_PAYLOAD_CHECKSUM] = "payload_checksum",
        [CB_KV_MISS_BAD_ARG] = "bad_arg",
        [CB_KV_MISS_NOT_REGULAR] = "not_regular",
    };
    if ((int)why < 0 || why >= CB_KV_MISS_COUNT_) return "unknown";
    return names[why];
}

/* ---------------------------------------------------------------- keys and names */

void cb_kvfile_key(const uint8_t model_fp[32], const uint8_t ctx_fp[32], const int32_t *tokens, int n,
                   uint8_t key[32]) {
    pthread_once(&g_sodium_once, sodium_once);
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, CB_KV_KEY_BYTES);
    crypto_generichash_update(&st, model_fp, CB_KV_KEY_BYTES);
    crypto_generichash_update(&st, ctx_fp, CB_KV_KEY_BYTES);
    if (tokens && n > 0) crypto_generichash_update(&st, (const unsigned char *)tokens, (size_t)n * 4);
    crypto_generichash_final(&st, key, CB_KV_KEY_BYTES);
}

void cb_kvfile_ctx_fp(const uint8_t model_fp[32], const int32_t *ctx_tokens, int n, uint8_t ctx_fp[32]) {
    pthread_once(&g_sodium_once, sodium_once);
    uint32_t n32 = n > 0 ? (uint32_t)n : 0;
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, CB_KV_KEY_BYTES);
    crypto_generichash_update(&st, (const unsigned char *)"cb-ctx-v1", 9);
    crypto_generichash_update(&st, model_fp, CB_KV_KEY_BYTES);
    crypto_generichash_update(&st, (const unsigned char *)&n32, 4);
    if (ctx_tokens && n > 0) crypto_generichash_update(&st, (const unsigned char *)ctx_tokens, (size_t)n * 4);
    crypto_generichash_final(&st, ctx_fp, CB_KV_KEY_BYTES);
}

char *cb_kvfile_hex(const uint8_t key[32], char hex[CB_KV_HEX_BYTES]) {
    sodium_bin2hex(hex, CB_KV_HEX_BYTES, key, CB_KV_KEY_BYTES);
    return hex;
}

int cb_kvfile_unhex(const char *s, uint8_t key[32]) {
    if (!s || strlen(s) != 64) return -1;
    size_t got = 0;
    const char *end = NULL;
    if (sodium_hex2bin(key, CB_KV_KEY_BYTES, s, 64, NULL, &got, &end) != 0 || got != CB_KV_KEY_BYTES ||
        end != s + 64)
        return -1;
    return 0;
}

int cb_kvfile_rel_path(const uint8_t key[32], char *buf, size_t buflen) {
    char hex[CB_KV_HEX_BYTES];
    cb_kvfile_hex(key, hex);
    int n = snprintf(buf, buflen, "%.2s/%s.kv", hex, hex);
    return (n < 0 || (size_t)n >= buflen) ? -1 : 0;
}

int cb_kvfile_path(const char *kv_dir, const uint8_t key[32], char *buf, size_t buflen) {
    char rel[CB_KV_REL_PATH_BYTES];
    cb_kvfile_rel_path(key, rel, sizeof rel);
    int n = snprintf(buf, buflen, "%s/%s", kv_dir, rel);
    return (n < 0 || (size_t)n >= buflen) ? -1 : 0;
}

/* ---------------------------------------------------------------- writing */

void cb_kvfile_test_stop_before_rename(int on) { atomic_store(&g_stop_before_rename, on ? 1 : 0); }

static int pwrite_all(int fd, const void *buf, size_t len, uint64_t off) {
    const uint8_t *p = buf;
    while (len > 0) {
        ssize_t w = cb_io_pwrite(fd, p, len, (off_t)off);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (w == 0) { errno = EIO; return -1; }
        p += w;
        len -= (size_t)w;
        off += (uint64_t)w;
    }
    return 0;
}

/* fsyncs a directory; 0 or -1 (errno). */
static int fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -1;
    int rc = cb_io_fsync(fd);
    int e = errno;
    close(fd);
    errno = e;
    return rc;
}

/* Splits path into its directory (into dir[dirlen]) and returns a pointer to its basename. */
static const char *split_path(const char *path, char *dir, size_t dirlen) {
    const char *slash = strrchr(path, '/');
    if (!slash) {
        snprintf(dir, dirlen, ".");
        return path;
    }
    size_t n = (size_t)(slash - path);
    if (n == 0) n = 1; /* "/name" */
    if (n >= dirlen) n = dirlen - 1;
    memcpy(dir, path, n);
    dir[n] = '\0';
    return slash + 1;
}

/* Creates dir (one level) if missing, and makes the new entry durable. 0 or -1 (errno). */
static int ensure_dir(const char *dir) {
    if (mkdir(dir, 0755) != 0) return errno == EEXIST ? 0 : -1;
    char parent[PATH_MAX];
    split_path(dir, parent, sizeof parent);
    return fsync_dir(parent);
}

/* Opens the directory a KV file goes into, creating it when missing, never through a symbolic link (the
 * writer must not put a file outside the directory it was given). The descriptor, or -1 with err. */
static int open_dir_nofollow(const char *dir, char *err, size_t errlen) {
    const int flags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
    int fd = open(dir, flags);
    if (fd < 0 && errno == ENOENT && ensure_dir(dir) == 0) fd = open(dir, flags);
    if (fd >= 0) return fd;
    int e = errno;
    struct stat st;
    if ((e == ELOOP || e == ENOTDIR) && lstat(dir, &st) == 0 && S_ISLNK(st.st_mode))
        cb_set_err(err, errlen, "kvfile write: %s is a symbolic link: not written through (remove it)", dir);
    else if (e == ENOTDIR)
        cb_set_err(err, errlen, "kvfile write: %s is not a directory (remove it)", dir);
    else
        cb_set_err(err, errlen, "kvfile write: directory %s: %s", dir, strerror(e));
    return -1;
}

/* Renames tmp to base inside dfd, which replaces any non-directory at base (a stale file, a FIFO, a
 * symbolic link: the link itself, never its target). An empty directory at base is removed first (logged);
 * a non-empty one is left alone and the write fails. 0, or -1 with err. */
static int rename_into_place(int dfd, const char *dir, const char *tmp, const char *base, char *err,
                             size_t errlen) {
    if (cb_io_renameat(dfd, tmp, dfd, base) == 0) return 0;
    int e = errno;
    if (e == EISDIR || e == ENOTEMPTY || e == EEXIST) {
        if (unlinkat(dfd, base, AT_REMOVEDIR) == 0) {
            CB_WARN("kvfile write: removed an empty directory in the way of %s/%s", dir, base);
            if (cb_io_renameat(dfd, tmp, dfd, base) == 0) return 0;
            e = errno;
        } else if (errno == ENOTEMPTY || errno == EEXIST) {
            cb_set_err(err, errlen, "kvfile write: %s/%s is a directory that is not empty: left alone, the KV file "
                       "is not written (remove it to let this chunk be cached)", dir, base);
            return -1;
        }
    }
    cb_set_err(err, errlen, "kvfile write: rename %s -> %s in %s: %s", tmp, base, dir, strerror(e));
    return -1;
}

/* Q8_0 blocks of src [n] (n % 32 == 0) into dst [n / 32 * 34]: per block d = f16(max|x| / 127) and
 * q = round(x / d) in [-127, 127] (round to nearest, ties away from zero); an all-zero block has d = 0.
 * The scale is rounded to f16 first and q computed with that d, so a value's error is at most d / 2. */
static void q8_0_encode(const float *src, uint8_t *dst, size_t n) {
    for (size_t b = 0; b < n / Q8_BLOCK; b++, src += Q8_BLOCK, dst += Q8_BLOCK_BYTES) {
        float amax = 0.0f;
        for (int i = 0; i < Q8_BLOCK; i++) {
            float a = fabsf(src[i]);
            if (a > amax) amax = a; /* NaN never wins */
        }
        uint16_t dh = cb_f32_to_f16(amax / 127.0f);
        float d = cb_f16_to_f32(dh), id = d > 0.0f ? 1.0f / d : 0.0f;
        memcpy(dst, &dh, 2);
        for (int i = 0; i < Q8_BLOCK; i++) {
            float q = roundf(src[i] * id);
            if (!(q >= -127.0f)) q = q != q ? 0.0f : -127.0f; /* NaN -> 0 */
            if (q > 127.0f) q = 127.0f;
            dst[2 + i] = (uint8_t)(int8_t)q;
        }
    }
}

static void convert_out(const float *src, uint8_t *dst, size_t n, uint32_t dtype) {
    if (dtype == CB_KV_Q8_0) {
        q8_0_encode(src, dst, n);
    } else if (dtype == CB_KV_F32) {
        memcpy(dst, src, n * 4);
    } else if (dtype == CB_KV_F16) {
        uint16_t *d = (uint16_t *)dst;
        for (size_t i = 0; i < n; i++) d[i] = cb_f32_to_f16(src[i]);
    } else {
        uint16_t *d = (uint16_t *)dst;
        for (size_t i = 0; i < n; i++) d[i] = cb_f32_to_bf16(src[i]);
    }
}

static void convert_in(const uint8_t *src, float *dst, size_t n, uint32_t dtype) {
    if (dtype == CB_KV_Q8_0) {
        cb_dequant(CB_TYPE_Q8_0, src, dst, n); /* the GGUF Q8_0 block: the same layout */
    } else if (dtype == CB_KV_F32) {
        memcpy(dst, src, n * 4);
    } else if (dtype == CB_KV_F16) {
        const uint16_t *s = (const uint16_t *)src;
        for (size_t i = 0; i < n; i++) dst[i] = cb_f16_to_f32(s[i]);
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (size_t i = 0; i < n; i++) dst[i] = cb_bf16_to_f32(s[i]);
    }
}

/* Checks what both write entry points take; 0 or -1 (err). */
static int check_write_args(const char *path, const cb_kv_meta_t *meta, const int32_t *tokens, int n_tokens,
                            const void *k, const void *v, char *err, size_t errlen) {
    if (!path || !*path || !meta || !tokens || !k || !v) {
        cb_set_err(err, errlen, "kvfile write: NULL argument");
        return -1;
    }
    if (!geometry_ok(meta->n_layer, meta->n_head_kv, meta->head_dim, n_tokens) ||
        !cb_kv_row_bytes(meta->dtype, (size_t)meta->n_head_kv * (size_t)meta->head_dim)) {
        cb_set_err(err, errlen, "kvfile write: bad geometry or dtype (layers %d, kv heads %d, head_dim %d, "
                   "tokens %d, dtype %d)", meta->n_layer, meta->n_head_kv, meta->head_dim, n_tokens, (int)meta->dtype);
        return -1;
    }
    return 0;
}

int cb_kvfile_write_layers(const char *path, const cb_kv_meta_t *meta, const int32_t *tokens, int n_tokens,
                           const float *const *k_layers, const float *const *v_layers, char *err,
                           size_t errlen) {
    if (check_write_args(path, meta, tokens, n_tokens, k_layers, v_layers, err, errlen)) return -1;
    for (int l = 0; l < meta->n_layer; l++) {
        if (!k_layers[l] || !v_layers[l]) {
            cb_set_err(err, errlen, "kvfile write: NULL layer pointer (layer %d)", l);
            return -1;
        }
    }
    char dir[PATH_MAX];
    const char *base = split_path(path, dir, sizeof dir);
    if (strlen(path) + 40 >= PATH_MAX || !*base) {
        cb_set_err(err, errlen, "kvfile write: bad path '%s'", path);
        return -1;
    }
    char tmp[PATH_MAX]; /* the temporary file's name inside dir */
    snprintf(tmp, sizeof tmp, "%s" KV_TMP_MARK "%ld.%u", base, (long)getpid(), atomic_fetch_add(&g_tmp_counter, 1u));

    kv_layout_t lay = layout_of((uint64_t)meta->n_layer, (uint64_t)meta->n_head_kv, (uint64_t)meta->head_dim,
                                (uint64_t)n_tokens, (uint32_t)meta->dtype);
    uint8_t *stage = NULL, *metabuf = NULL;
    int fd = -1, rc = -1;
    int dfd = open_dir_nofollow(dir, err, errlen);
    if (dfd < 0) return -1;
    /* O_EXCL | O_NOFOLLOW: never opens anything already there, a symbolic link included */
    fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
        cb_set_err(err, errlen, "kvfile write: cannot create %s/%s: %s", dir, tmp, strerror(errno));
        close(dfd);
        return -1;
    }
    stage = cb_aligned_alloc(KV_LAYER_ALIGN, (size_t)lay.layer_stride);
    metabuf = cb_calloc(1, (size_t)lay.meta_bytes);
    if (!stage || !metabuf) {
        cb_set_err(err, errlen, "kvfile write: out of memory (%llu bytes per layer)",
                   (unsigned long long)lay.layer_stride);
        goto fail;
    }
    /* Meta region: tokens (int32 LE), zero pad to 8, then the layer checksums (u64 LE). */
    memcpy(metabuf, tokens, (size_t)n_tokens * 4);
    uint64_t *sums = (uint64_t *)(metabuf + round_up(4 * (uint64_t)n_tokens, 8));
    size_t n_elem = (size_t)n_tokens * (size_t)lay.kv_dim;
    for (int l = 0; l < meta->n_layer; l++) {
        memset(stage, 0, (size_t)lay.layer_stride);
        convert_out(k_layers[l], stage, n_elem, (uint32_t)meta->dtype);
        convert_out(v_layers[l], stage + lay.v_offset, n_elem, (uint32_t)meta->dtype);
        sums[l] = XXH3_64bits(stage, (size_t)lay.layer_stride);
        if (pwrite_all(fd, stage, (size_t)lay.layer_stride, lay.payload_offset + (uint64_t)l * lay.layer_stride)) {
            cb_set_err(err, errlen, "kvfile write: %s/%s: %s", dir, tmp, strerror(errno));
            goto fail;
        }
    }
    kv_header_t h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, KV_MAGIC, 8);
    h.version = CB_KV_FORMAT_VERSION;
    h.header_size = KV_HEADER_SIZE;
    memcpy(h.model_fp, meta->model_fp, 32);
    memcpy(h.ctx_fp, meta->ctx_fp, 32);
    cb_kvfile_key(meta->model_fp, meta->ctx_fp, tokens, n_tokens, h.key);
    h.n_layer = (uint32_t)meta->n_layer;
    h.n_head_kv = (uint32_t)meta->n_head_kv;
    h.head_dim = (uint32_t)meta->head_dim;
    h.n_tokens = (uint32_t)n_tokens;
    h.dtype = (uint32_t)meta->dtype;
    h.flags = KV_FLAG_K_PRE_ROPE;
    h.meta_offset = KV_HEADER_SIZE;
    h.meta_bytes = lay.meta_bytes;
    h.payload_offset = lay.payload_offset;
    h.layer_stride = lay.layer_stride;
    h.v_offset = lay.v_offset;
    h.file_size = lay.file_size;
    h.meta_checksum = XXH3_64bits(metabuf, (size_t)lay.meta_bytes);
    h.header_checksum = XXH3_64bits(&h, offsetof(kv_header_t, header_checksum));
    if (pwrite_all(fd, metabuf, (size_t)lay.meta_bytes, KV_HEADER_SIZE) || pwrite_all(fd, &h, sizeof h, 0)) {
        cb_set_err(err, errlen, "kvfile write: %s/%s: %s", dir, tmp, strerror(errno));
        goto fail;
    }
    if (cb_io_fsync(fd) != 0) {
        cb_set_err(err, errlen, "kvfile write: fsync %s/%s: %s (disk tier degraded; do not retry)", dir, tmp,
                   strerror(errno));
        rc = -2;
        goto fail;
    }
    int cfd = fd;
    fd = -1;
    if (close(cfd) != 0) {
        cb_set_err(err, errlen, "kvfile write: close %s/%s: %s (disk tier degraded)", dir, tmp, strerror(errno));
        rc = -2;
        goto fail;
    }
    if (atomic_load(&g_stop_before_rename)) {
        cb_set_err(err, errlen, "kvfile write: stopped before rename (test hook); %s/%s left behind", dir, tmp);
        free(stage);
        free(metabuf);
        close(dfd);
        return -1;
    }
    if (rename_into_place(dfd, dir, tmp, base, err, errlen) != 0) goto fail;
    if (cb_io_fsync(dfd) != 0) {
        cb_set_err(err, errlen, "kvfile write: fsync of directory %s: %s (disk tier degraded; do not retry)", dir,
                   strerror(errno));
        unlinkat(dfd, base, 0);
        free(stage);
        free(metabuf);
        close(dfd);
        return -2;
    }
    free(stage);
    free(metabuf);
    close(dfd);
    return 0;

fail:
    if (fd >= 0) close(fd);
    unlinkat(dfd, tmp, 0);
    close(dfd);
    free(stage);
    free(metabuf);
    return rc;
}

int cb_kvfile_write(const char *path, const cb_kv_meta_t *meta, const int32_t *tokens, int n_tokens,
                    const float *k, const float *v, char *err, size_t errlen) {
    if (check_write_args(path, meta, tokens, n_tokens, k, v, err, errlen)) return -1;
    const float *kl[CB_KV_MAX_LAYERS], *vl[CB_KV_MAX_LAYERS];
    size_t per_layer = (size_t)n_tokens * (size_t)meta->n_head_kv * (size_t)meta->head_dim;
    for (int l = 0; l < meta->n_layer; l++) {
        kl[l] = k + (size_t)l * per_layer;
        vl[l] = v + (size_t)l * per_layer;
    }
    return cb_kvfile_write_layers(path, meta, tokens, n_tokens, kl, vl, err, errlen);
}

/* True when name looks like one of our temporary files. */
static int is_tmp_name(const char *name) {
    const char *p = strstr(name, ".kv" KV_TMP_MARK);
    return p != NULL && p != name;
}

/* Removes old temp files in one directory; adds to *removed. 0, or -1 on an unreadable directory. */
static int sweep_one(const char *dir, double min_age_s, int recurse, int *removed, char *err, size_t errlen) {
    DIR *d = opendir(dir);
    if (!d) {
        cb_set_err(err, errlen, "kvfile sweep: %s: %s", dir, strerror(errno));
        return -1;
    }
    time_t now = time(NULL);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.' && (!e->d_name[1] || (e->d_name[1] == '.' && !e->d_name[2]))) continue;
        struct stat st;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        if (S_ISDIR(st.st_mode)) {
            if (recurse && strlen(e->d_name) == 2) {
                char sub[PATH_MAX];
                if (snprintf(sub, sizeof sub, "%s/%s", dir, e->d_name) < (int)sizeof sub)
                    (void)sweep_one(sub, min_age_s, 0, removed, NULL, 0);
            }
            continue;
        }
        if (!S_ISREG(st.st_mode) || !is_tmp_name(e->d_name)) continue;
        if (difftime(now, st.st_mtime) < min_age_s) continue;
        if (unlinkat(dirfd(d), e->d_name, 0) == 0) (*removed)++;
    }
    closedir(d);
    return 0;
}

int cb_kvfile_sweep_tmp(const char *kv_dir, double min_age_s, char *err, size_t errlen) {
    if (!kv_dir) {
        cb_set_err(err, errlen, "kvfile sweep: NULL directory");
        return -1;
    }
    int removed = 0;
    if (sweep_one(kv_dir, min_age_s, 1, &removed, err, errlen) != 0) return -1;
    return removed;
}

/* ---------------------------------------------------------------- reading */

static cb_kv_miss_t miss(cb_kv_miss_t why, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static cb_kv_miss_t miss(cb_kv_miss_t why, char *err, size_t errlen, const char *fmt, ...) {
    if (err && errlen) {
        int n = snprintf(err, errlen, "%s: ", cb_kv_miss_str(why));
        if (n >= 0 && (size_t)n < errlen) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
            va_end(ap);
        }
    }
    return why;
}

static int all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

/* Validates self->base[0..size) (already set) and fills the handle. name: the file's basename, or NULL. */
static cb_kv_miss_t validate(cb_kvfile_t *self, const char *name, const cb_kv_expect_t *ex, char *err,
                             size_t errlen) {
    const uint8_t *b = self->base;
    size_t size = self->size;
    if (size >= 8 && memcmp(b, KV_MAGIC, 8) != 0) return miss(CB_KV_MISS_BAD_MAGIC, err, errlen, "not a kv file");
    if (size < 12) return miss(CB_KV_MISS_TRUNCATED, err, errlen, "%zu bytes, shorter than the header", size);
    uint32_t version;
    memcpy(&version, b + 8, 4);
    if (version != CB_KV_FORMAT_VERSION)
        return miss(CB_KV_MISS_BAD_VERSION, err, errlen, "format version %u, reader knows %u", version,
                    CB_KV_FORMAT_VERSION);
    if (size < KV_HEADER_SIZE)
        return miss(CB_KV_MISS_TRUNCATED, err, errlen, "%zu bytes, shorter than the %u-byte header", size,
                    KV_HEADER_SIZE);
    kv_header_t h;
    memcpy(&h, b, sizeof h);
    if (XXH3_64bits(b, offsetof(kv_header_t, header_checksum)) != h.header_checksum)
        return miss(CB_KV_MISS_HEADER_CHECKSUM, err, errlen, "fixed header checksum differs");

    /* The header is what its writer wrote; now check that it is self-consistent. */
    if (h.header_size != KV_HEADER_SIZE || h.meta_offset != KV_HEADER_SIZE)
        return miss(CB_KV_MISS_BAD_HEADER, err, errlen, "header size %u", h.header_size);
    if (!cb_kv_row_bytes(h.dtype, 32)) return miss(CB_KV_MISS_BAD_HEADER, err, errlen, "unknown dtype %u", h.dtype);
    if (h.flags != KV_FLAG_K_PRE_ROPE) return miss(CB_KV_MISS_BAD_HEADER, err, errlen, "unknown flags 0x%x", h.flags);
    if (!all_zero(h.reserved, sizeof h.reserved))
        return miss(CB_KV_MISS_BAD_HEADER, err, errlen, "reserved bytes not zero");
    if (!geometry_ok(h.n_layer, h.n_head_kv, h.head_dim, h.n_tokens))
        return miss(CB_KV_MISS_BAD_HEADER, err, errlen, "geometry out of limits (layers %u, kv heads %u, "
                    "head_dim %u, tokens %u)", h.n_layer, h.n_head_kv, h.head_dim, h.n_tokens);
    if (!cb_kv_row_bytes(h.dtype, (size_t)h.n_head_kv * h.head_dim))
        return miss(CB_KV_MISS_BAD_HEADER, err, errlen, "kv_dim %u is not a multiple of %s's block",
                    h.n_head_kv * h.head_dim, cb_kv_dtype_name(h.dtype));
    kv_layout_t lay = layout_of(h.n_layer, h.n_head_kv, h.head_dim, h.n_tokens, h.dtype);
    if (h.meta_bytes != lay.meta_bytes || h.payload_offset != lay.payload_offset ||
        h.layer_stride != lay.layer_stride || h.v_offset != lay.v_offset || h.file_size != lay.file_size)
        return miss(CB_KV_MISS_BAD_HEADER, err, errlen, "offsets do not follow from the geometry");
    if (lay.file_size > SIZE_MAX) return miss(CB_KV_MISS_BAD_HEADER, err, errlen, "file too large");

    if (name) {
        char hex[CB_KV_HEX_BYTES];
        cb_kvfile_hex(h.key, hex);
        if (strlen(name) != 67 || memcmp(name, hex, 64) != 0 || strcmp(name + 64, ".kv") != 0)
            return miss(CB_KV_MISS_NAME_MISMATCH, err, errlen, "file name '%s' is not '%s.kv'", name, hex);
    }
    if (ex) {
        if (memcmp(h.model_fp, ex->model_fp, 32) != 0)
            return miss(CB_KV_MISS_MODEL_MISMATCH, err, errlen, "written for another model");
        if (memcmp(h.ctx_fp, ex->ctx_fp, 32) != 0)
            return miss(CB_KV_MISS_CONTEXT_MISMATCH, err, errlen, "computed after another precompute context");
        if ((int64_t)h.n_layer != ex->n_layer || (int64_t)h.n_head_kv != ex->n_head_kv ||
            (int64_t)h.head_dim != ex->head_dim)
            return miss(CB_KV_MISS_GEOMETRY_MISMATCH, err, errlen,
                        "file has %u layers x %u kv heads x %u, model has %d x %d x %d", h.n_layer, h.n_head_kv,
                        h.head_dim, ex->n_layer, ex->n_head_kv, ex->head_dim);
    }
    if (size < KV_HEADER_SIZE + lay.meta_bytes)
        return miss(CB_KV_MISS_TRUNCATED, err, errlen, "%zu bytes, token table needs %llu", size,
                    (unsigned long long)(KV_HEADER_SIZE + lay.meta_bytes));
    const uint8_t *m = b + KV_HEADER_SIZE;
    if (XXH3_64bits(m, (size_t)lay.meta_bytes) != h.meta_checksum)
        return miss(CB_KV_MISS_HEADER_CHECKSUM, err, errlen, "token/checksum table checksum differs");
    const int32_t *tokens = (const int32_t *)m;
    uint8_t key[CB_KV_KEY_BYTES];
    cb_kvfile_key(h.model_fp, h.ctx_fp, tokens, (int)h.n_tokens, key);
    if (memcmp(key, h.key, 32) != 0)
        return miss(CB_KV_MISS_BAD_HEADER, err, errlen, "key does not match fingerprints and tokens");
    if (ex && ex->tokens) {
        if (ex->n_tokens != (int)h.n_tokens)
            return miss(CB_KV_MISS_TOKENS_MISMATCH, err, errlen, "%u tokens, expected %d", h.n_tokens, ex->n_tokens);
        if (memcmp(tokens, ex->tokens, (size_t)h.n_tokens * 4) != 0)
            return miss(CB_KV_MISS_TOKENS_MISMATCH, err, errlen, "token ids differ");
    }
    if (size < lay.file_size)
        return miss(CB_KV_MISS_TRUNCATED, err, errlen, "%zu bytes, header says %llu", size,
                    (unsigned long long)lay.file_size);
    if (size > lay.file_size)
        return miss(CB_KV_MISS_BAD_HEADER, err, errlen, "%zu bytes, header says %llu (trailing bytes)", size,
                    (unsigned long long)lay.file_size);
    uint64_t meta_end = KV_HEADER_SIZE + lay.meta_bytes;
    if (!all_zero(b + meta_end, (size_t)(lay.payload_offset - meta_end)))
        return miss(CB_KV_MISS_BAD_HEADER, err, errlen, "padding before the payload not zero");

    memcpy(self->meta.model_fp, h.model_fp, 32);
    memcpy(self->meta.ctx_fp, h.ctx_fp, 32);
    self->meta.n_layer = (int)h.n_layer;
    self->meta.n_head_kv = (int)h.n_head_kv;
    self->meta.head_dim = (int)h.head_dim;
    self->meta.dtype = (cb_kv_dtype_t)h.dtype;
    self->n_tokens = (int)h.n_tokens;
    self->tokens = tokens;
    self->sums = (const uint64_t *)(m + round_up(4 * (uint64_t)h.n_tokens, 8));
    memcpy(self->key, h.key, 32);
    self->lay = lay;
    return CB_KV_OK;
}

static void release(cb_kvfile_t *self) {
    if (!self) return;
    if (self->base) {
        if (self->mapped) munmap((void *)self->base, self->size);
        else free((void *)self->base);
    }
    free(self);
}

cb_kvfile_t *cb_kvfile_open(const char *path, const cb_kv_expect_t *expect, cb_kv_miss_t *why, char *err,
                            size_t errlen) {
    cb_kv_miss_t w = CB_KV_OK;
    cb_kvfile_t *self = NULL;
    int fd = -1;
    if (!path) {
        w = miss(CB_KV_MISS_BAD_ARG, err, errlen, "NULL path");
        goto out;
    }
    /* O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; O_NOFOLLOW: a symbolic link at
     * the name is not followed. Only a regular file is read (mmap ignores O_NONBLOCK). */
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT) w = miss(CB_KV_MISS_NOT_FOUND, err, errlen, "%s", path);
        else if (e == ELOOP) w = miss(CB_KV_MISS_NOT_REGULAR, err, errlen, "%s: a symbolic link (not followed)", path);
        else if (e == ENXIO) w = miss(CB_KV_MISS_NOT_REGULAR, err, errlen, "%s: a socket or device", path);
        else w = miss(CB_KV_MISS_IO, err, errlen, "%s: %s", path, strerror(e));
        goto out;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        w = miss(CB_KV_MISS_IO, err, errlen, "%s: fstat: %s", path, strerror(errno));
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        w = miss(CB_KV_MISS_NOT_REGULAR, err, errlen, "%s: not a regular file (%s)", path,
                 S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISDIR(st.st_mode) ? "a directory" :
                 S_ISSOCK(st.st_mode) ? "a socket" : "a device");
        goto out;
    }
    if (st.st_size <= 0) {
        w = miss(CB_KV_MISS_TRUNCATED, err, errlen, "%s: empty file", path);
        goto out;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        w = miss(CB_KV_MISS_IO, err, errlen, "%s: too large to map", path);
        goto out;
    }
    self = cb_calloc(1, sizeof *self);
    if (!self) {
        w = miss(CB_KV_MISS_IO, err, errlen, "out of memory");
        goto out;
    }
    void *p = cb_io_mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
        w = miss(CB_KV_MISS_IO, err, errlen, "%s: mmap: %s", path, strerror(errno));
        goto out;
    }
    self->base = p;
    self->size = (size_t)st.st_size;
    self->mapped = 1;
    const char *slash = strrchr(path, '/');
    w = validate(self, slash ? slash + 1 : path, expect, err, errlen);
out:
    if (fd >= 0) close(fd);
    if (w != CB_KV_OK) {
        release(self);
        self = NULL;
    }
    if (why) *why = w;
    return self;
}

cb_kvfile_t *cb_kvfile_open_mem(const void *buf, size_t len, const cb_kv_expect_t *expect, cb_kv_miss_t *why,
                                char *err, size_t errlen) {
    cb_kv_miss_t w = CB_KV_OK;
    cb_kvfile_t *self = NULL;
    if (!buf && len) {
        w = miss(CB_KV_MISS_BAD_ARG, err, errlen, "NULL buffer");
        goto out;
    }
    if (len == 0) {
        w = miss(CB_KV_MISS_TRUNCATED, err, errlen, "empty buffer");
        goto out;
    }
    self = cb_calloc(1, sizeof *self);
    uint8_t *copy = cb_aligned_alloc(KV_LAYER_ALIGN, (size_t)round_up(len, KV_LAYER_ALIGN));
    if (!self || !copy) {
        free(copy);
        w = miss(CB_KV_MISS_IO, err, errlen, "out of memory");
        goto out;
    }
    memcpy(copy, buf, len);
    self->base = copy;
    self->size = len;
    w = validate(self, NULL, expect, err, errlen);
out:
    if (w != CB_KV_OK) {
        release(self);
        self = NULL;
    }
    if (why) *why = w;
    return self;
}

void cb_kvfile_destroy(cb_kvfile_t **self_p) {
    if (!self_p || !*self_p) return;
    release(*self_p);
    *self_p = NULL;
}

static cb_kv_miss_t check_layer(cb_kvfile_t *self, int layer) {
    if (!self || layer < 0 || layer >= self->meta.n_layer) return CB_KV_MISS_BAD_ARG;
    if (self->verified[layer]) return CB_KV_OK;
    const uint8_t *p = self->base + self->lay.payload_offset + (uint64_t)layer * self->lay.layer_stride;
    if (XXH3_64bits(p, (size_t)self->lay.layer_stride) != self->sums[layer]) return CB_KV_MISS_PAYLOAD_CHECKSUM;
    self->verified[layer] = 1;
    return CB_KV_OK;
}

cb_kv_miss_t cb_kvfile_layer_raw(cb_kvfile_t *self, int layer, const void **k, const void **v) {
    cb_kv_miss_t w = check_layer(self, layer);
    if (w != CB_KV_OK) return w;
    const uint8_t *p = self->base + self->lay.payload_offset + (uint64_t)layer * self->lay.layer_stride;
    if (k) *k = p;
    if (v) *v = p + self->lay.v_offset;
    return CB_KV_OK;
}

cb_kv_miss_t cb_kvfile_read_layer(cb_kvfile_t *self, int layer, float *k_out, float *v_out) {
    if (!k_out || !v_out) return CB_KV_MISS_BAD_ARG;
    const void *k, *v;
    cb_kv_miss_t w = cb_kvfile_layer_raw(self, layer, &k, &v);
    if (w != CB_KV_OK) return w;
    size_t n = (size_t)self->n_tokens * (size_t)self->lay.kv_dim;
    convert_in(k, k_out, n, (uint32_t)self->meta.dtype);
    convert_in(v, v_out, n, (uint32_t)self->meta.dtype);
    return CB_KV_OK;
}

cb_kv_miss_t cb_kvfile_verify(cb_kvfile_t *self) {
    if (!self) return CB_KV_MISS_BAD_ARG;
    for (int l = 0; l < self->meta.n_layer; l++) {
        cb_kv_miss_t w = check_layer(self, l);
        if (w != CB_KV_OK) return w;
    }
    return CB_KV_OK;
}

const cb_kv_meta_t *cb_kvfile_meta(const cb_kvfile_t *self) { return self ? &self->meta : NULL; }
int cb_kvfile_n_tokens(const cb_kvfile_t *self) { return self ? self->n_tokens : 0; }
const int32_t *cb_kvfile_tokens(const cb_kvfile_t *self) { return self ? self->tokens : NULL; }
const uint8_t *cb_kvfile_key_of(const cb_kvfile_t *self) { return self ? self->key : NULL; }
size_t cb_kvfile_layer_bytes(const cb_kvfile_t *self) { return self ? (size_t)self->lay.k_bytes : 0; }
