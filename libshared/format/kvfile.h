/* kvfile: content-addressed files holding one chunk's precomputed KV (format: docs/kvfile.md).
 *
 * A chunk's KV is computed after a fixed precompute context, at the positions that follow it; K is
 * stored BEFORE RoPE (so moving the chunk to another position is an exact rotation at load time) and
 * V as computed. The payload dtype is f16 by default (f32 and bf16 selectable); readers always get f32.
 *
 * Key and name: key = BLAKE2b-256(model fingerprint || context fingerprint || token ids as int32 LE);
 * the file is <kv_dir>/<hex[0:2]>/<hex>.kv (cb_kvfile_path). The reader checks that a file's name is
 * the hex of the key in its header, so a temporary or misnamed file is never taken as a chunk.
 *
 * Writing: a temporary file next to the final name (<name>.tmp.<pid>.<n>), fsync, rename, fsync of
 * the directory. Nothing is visible under the final name until it is complete and durable. The writer
 * never writes through a symbolic link (neither the file nor its directory is followed); the rename
 * replaces whatever non-directory is at the name (a stale file, a FIFO, a symbolic link), and an empty
 * directory there is removed; a non-empty directory is left alone and the write fails.
 *
 * Reading: cb_kvfile_open opens the name without following a symbolic link and without waiting (a FIFO
 * at the name is a miss, never a hang), accepts only a regular file, validates everything but the payload (magic, version, header checksums,
 * name, fingerprints, geometry, size, tokens) and mmaps the file; each layer's checksum is verified
 * before its bytes are used (cb_kvfile_read_layer) or all up front (cb_kvfile_verify). Any failure is a
 * *miss* with a reason (cb_kv_miss_t) and a message: the caller recomputes the chunk. No file content
 * makes this module crash, allocate from file-supplied sizes, or return KV other than what was written.
 * (Files are never modified in place by this module; another process truncating a file that is open
 * here would raise SIGBUS on access, as with any mmap.)
 *
 * Threads: the functions without a handle are thread-safe. A cb_kvfile_t is used by one thread at a time.
 */
#ifndef CB_KVFILE_H
#define CB_KVFILE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" { /* kernels/cuda includes it through tensor/tensor.h */
#endif

#define CB_KV_KEY_BYTES 32       /* key and fingerprint size */
#define CB_KV_HEX_BYTES 65       /* 64 hex digits + NUL */
#define CB_KV_FORMAT_VERSION 1u

/* Limits a file may not exceed (writer and reader); they bound every size computation. */
#define CB_KV_MAX_LAYERS   1024
#define CB_KV_MAX_HEADS_KV 1024
#define CB_KV_MAX_HEAD_DIM 1024
#define CB_KV_MAX_KV_DIM   65536          /* n_head_kv * head_dim */
#define CB_KV_MAX_TOKENS   (1 << 22)

/* Payload element type; the values are ggml type ids (gguf.h cb_type_t). CB_KV_Q8_0 is ggml's Q8_0 block
 * (32 values: an f16 scale d = max|x| / 127, then 32 int8 q, x ~ d * q; 34 bytes), for compressed files
 * (1.06 bytes a value against f16's 2); a row of kv_dim values is kv_dim / 32 blocks (kv_dim % 32 == 0). */
typedef enum { CB_KV_F32 = 0, CB_KV_F16 = 1, CB_KV_Q8_0 = 8, CB_KV_BF16 = 30 } cb_kv_dtype_t;
/* Bytes of one value of an element dtype (4 or 2); 0 for Q8_0 (a block type: see cb_kv_row_bytes) and for
 * a value that is not a cb_kv_dtype_t. The backends' raw row ops (kv_load, kv_deviation) take these. */
size_t cb_kv_dtype_size(uint32_t dtype);
/* Bytes of one row of kv_dim values of dtype; 0 for an unknown dtype or a Q8_0 row whose kv_dim is not a
 * multiple of 32. */
size_t cb_kv_row_bytes(uint32_t dtype, size_t kv_dim);
/* "f32", "f16", "bf16", "q8_0"; "?" otherwise. cb_kv_dtype_parse: the dtype of a name, or -1. */
const char *cb_kv_dtype_name(uint32_t dtype);
int cb_kv_dtype_parse(const char *name);

/* What a file is: identity, geometry and dtype. kv_dim = n_head_kv * head_dim. */
typedef struct {
    uint8_t model_fp[CB_KV_KEY_BYTES]; /* model fingerprint (weights, tokenizer, RoPE, KV layout...) */
    uint8_t ctx_fp[CB_KV_KEY_BYTES];   /* fingerprint of the precompute context the chunk follows */
    int n_layer;
    int n_head_kv;
    int head_dim;
    cb_kv_dtype_t dtype;               /* storage dtype (writer); what the file holds (reader) */
} cb_kv_meta_t;

/* What a reader requires; the geometry is the running model's, never taken from the file. */
typedef struct {
    uint8_t model_fp[CB_KV_KEY_BYTES];
    uint8_t ctx_fp[CB_KV_KEY_BYTES];
    int n_layer;
    int n_head_kv;
    int head_dim;
    const int32_t *tokens;  /* optional [n_tokens]: the chunk's token ids must equal these; NULL = unchecked */
    int n_tokens;           /* with tokens */
} cb_kv_expect_t;

/* Why an open or a read gave no KV. CB_KV_OK (0) = success. */
typedef enum {
    CB_KV_OK = 0,
    CB_KV_MISS_NOT_FOUND,         /* no file under that name */
    CB_KV_MISS_IO,                /* open/stat/mmap/read failed */
    CB_KV_MISS_TRUNCATED,         /* shorter than its header says */
    CB_KV_MISS_BAD_MAGIC,         /* not a kv file */
    CB_KV_MISS_BAD_VERSION,       /* a format version this reader does not know */
    CB_KV_MISS_HEADER_CHECKSUM,   /* header or token/checksum table corrupt */
    CB_KV_MISS_BAD_HEADER,        /* checksums fine but fields inconsistent (size, offsets, dtype, limits...) */
    CB_KV_MISS_NAME_MISMATCH,     /* file name is not the hex of its key (e.g. a stray temporary file) */
    CB_KV_MISS_MODEL_MISMATCH,    /* written for another model */
    CB_KV_MISS_CONTEXT_MISMATCH,  /* computed after another precompute context */
    CB_KV_MISS_GEOMETRY_MISMATCH, /* layers / kv heads / head_dim differ from the running model */
    CB_KV_MISS_TOKENS_MISMATCH,   /* token ids differ from the expected ones */
    CB_KV_MISS_PAYLOAD_CHECKSUM,  /* a layer's bytes do not match their checksum */
    CB_KV_MISS_BAD_ARG,           /* caller error (NULL pointer, layer out of range) */
    CB_KV_MISS_NOT_REGULAR,       /* something other than a regular file at the name (a FIFO, a directory, a
                                     device, a socket, a symbolic link: never followed, never waited on) */
    CB_KV_MISS_COUNT_
} cb_kv_miss_t;

/* Static name of a reason ("ok", "not_found", "payload_checksum", ...); "unknown" when out of range. */
const char *cb_kv_miss_str(cb_kv_miss_t why);

/* ---- keys and names ---------------------------------------------------------------------- */

/* key = BLAKE2b-256(model_fp[32] || ctx_fp[32] || tokens[0..n) as int32 little-endian). n >= 0. */
void cb_kvfile_key(const uint8_t model_fp[32], const uint8_t ctx_fp[32], const int32_t *tokens, int n,
                   uint8_t key[32]);
/* Lowercase hex of a 32-byte key into hex[65] (NUL-terminated); returns hex. */
char *cb_kvfile_hex(const uint8_t key[32], char hex[CB_KV_HEX_BYTES]);
/* Parses 64 hex digits (either case) into key; returns 0, or -1 if s is not exactly that. */
int cb_kvfile_unhex(const char *s, uint8_t key[32]);
/* A context fingerprint for a precompute context given as token ids (which also fixes the chunk's
 * start position, n): BLAKE2b-256("cb-ctx-v1" || model_fp || n as u32 LE || tokens as int32 LE).
 * A convenience; callers may fingerprint their context differently. */
void cb_kvfile_ctx_fp(const uint8_t model_fp[32], const int32_t *ctx_tokens, int n, uint8_t ctx_fp[32]);
/* Path of a key's file: "<kv_dir>/<hex[0:2]>/<hex>.kv" into buf. Returns 0, or -1 if buflen is too small. */
int cb_kvfile_path(const char *kv_dir, const uint8_t key[32], char *buf, size_t buflen);
/* The part of that path under kv_dir, "hh/<hex>.kv" (what cb-cacheindex stores): buf >= CB_KV_REL_PATH_BYTES. 0,
 * or -1 when buf is too small. */
#define CB_KV_REL_PATH_BYTES (CB_KV_HEX_BYTES + 6)
int cb_kvfile_rel_path(const uint8_t key[32], char *buf, size_t buflen);

/* ---- writing ----------------------------------------------------------------------------- */

/* Writes a chunk's KV to path (its basename should be "<hex(key)>.kv", see cb_kvfile_path; the parent
 * directory, the two-hex-digit shard, is created if missing; kv_dir itself must exist). k and v are packed [n_layer][n_tokens][kv_dim] f32, K pre-RoPE.
 * Atomic and durable: temp file, fsync, rename, fsync(dir). The directory must not be a symbolic link
 * (refused: nothing is written through one); at path, any non-directory is replaced and an empty directory
 * removed (logged), a non-empty directory makes the write fail. Returns 0 on success; -1 on failure with
 * nothing new under path (err says why); -2 when an fsync failed: nothing left under path, do not retry
 * and trust a later success, mark the disk tier degraded (docs/kvfile.md). Caller keeps ownership
 * of all arguments. */
int cb_kvfile_write(const char *path, const cb_kv_meta_t *meta, const int32_t *tokens, int n_tokens,
                    const float *k, const float *v, char *err, size_t errlen);
/* Same with one pointer per layer: k_layers[l] and v_layers[l] are each [n_tokens][kv_dim] f32. */
int cb_kvfile_write_layers(const char *path, const cb_kv_meta_t *meta, const int32_t *tokens, int n_tokens,
                           const float *const *k_layers, const float *const *v_layers, char *err, size_t errlen);

/* Removes stray temporary files ("*.kv.tmp.*") older than min_age_s seconds from kv_dir and its
 * subdirectories one level down (the startup sweep). Returns how many were removed, or -1 (err). */
int cb_kvfile_sweep_tmp(const char *kv_dir, double min_age_s, char *err, size_t errlen);

/* ---- reading ----------------------------------------------------------------------------- */

typedef struct cb_kvfile cb_kvfile_t;

/* Opens and validates path against expect (NULL = integrity checks only, no identity checks: for
 * tools and sweeps). Returns the handle (caller owns, cb_kvfile_destroy), or NULL = a miss: *why (if
 * why is not NULL) says which and err (errlen bytes) has a message. The payload is not read yet. */
cb_kvfile_t *cb_kvfile_open(const char *path, const cb_kv_expect_t *expect, cb_kv_miss_t *why,
                            char *err, size_t errlen);
/* Same over a copy of buf[len] (tests, fuzzing); no name check. */
cb_kvfile_t *cb_kvfile_open_mem(const void *buf, size_t len, const cb_kv_expect_t *expect,
                                cb_kv_miss_t *why, char *err, size_t errlen);
void cb_kvfile_destroy(cb_kvfile_t **self_p);

/* Verifies layer's checksum (once per handle), then converts it to f32: k_out and v_out are each
 * [n_tokens][kv_dim]. Returns CB_KV_OK, CB_KV_MISS_PAYLOAD_CHECKSUM (outputs untouched) or BAD_ARG. */
cb_kv_miss_t cb_kvfile_read_layer(cb_kvfile_t *self, int layer, float *k_out, float *v_out);
/* Verifies layer's checksum and returns pointers to its raw K and V bytes in the mapping
 * ([n_tokens][kv_dim] of the file's dtype, 64-byte aligned; valid until destroy): for a GPU copy. */
cb_kv_miss_t cb_kvfile_layer_raw(cb_kvfile_t *self, int layer, const void **k, const void **v);
/* Verifies every layer now. CB_KV_OK or CB_KV_MISS_PAYLOAD_CHECKSUM. */
cb_kv_miss_t cb_kvfile_verify(cb_kvfile_t *self);

const cb_kv_meta_t *cb_kvfile_meta(const cb_kvfile_t *self);   /* identity, geometry, dtype */
int cb_kvfile_n_tokens(const cb_kvfile_t *self);
const int32_t *cb_kvfile_tokens(const cb_kvfile_t *self);      /* [n_tokens], valid until destroy */
const uint8_t *cb_kvfile_key_of(const cb_kvfile_t *self);      /* [32] */
size_t cb_kvfile_layer_bytes(const cb_kvfile_t *self);         /* raw bytes of K (= of V) per layer */

/* ---- testing only -------------------------------------------------------------------------- */

/* When on (non-zero), writes in this process stop after the temporary file is written and fsynced,
 * before the rename, as a crash there would: the temp file stays behind and the write returns -1. */
void cb_kvfile_test_stop_before_rename(int on);
#ifdef __cplusplus
}
#endif
#endif
