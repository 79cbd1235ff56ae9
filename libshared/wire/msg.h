/* msg: the cacheblend wire protocol (docs/protocol.md): decoding with validation, typed accessors,
 * error codes, and an encoder.
 *
 * Every message is ONE msgpack map: {v: 1, type: str, id: str, ...fields of that type}.
 * Replies carry the request's type and id plus `ok: true` and their fields, or `ok: false` and
 * `error: {code: str, message: str}`. A stream is several messages with the same id; its last
 * message has type "done".
 *
 * Decoding never trusts a length. Before msgpack-c allocates anything, cb_msg_decode walks the raw
 * bytes itself (iteratively, no recursion) and rejects: a top level that is not a map, truncation,
 * trailing bytes after the map, nesting deeper than CB_MSG_MAX_DEPTH, any array/map count larger
 * than the bytes that remain (every element needs at least one byte), maps with more than
 * CB_MSG_MAX_MAP_ENTRIES entries, map keys that are not strings of 1..CB_MSG_MAX_KEY bytes without
 * control characters,
 * str/bin lengths beyond the buffer, strings that are not valid UTF-8, the ext types and the
 * reserved byte 0xc1, and messages over the size cap. Only then does msgpack-c build its object tree,
 * so its allocation is bounded by about 24 bytes per input byte. The envelope (v, type, id and,
 * for replies, ok/error) is checked during decoding; fields are checked by the typed accessors.
 *
 * Accessors never trust the message either: each checks presence, msgpack type, range and length,
 * and on failure returns false and records a readable reason ("field 'k': expected integer in
 * [1, 100], got 1000") that cb_msg_last_error() returns, ready to send back as a bad_request.
 * A key that appears twice in one map is an error when it is looked up. Unknown keys are ignored
 * (forward compatibility); nil counts as absent.
 *
 * Ownership: cb_msg_decode copies the input bytes, so the message does not depend on the caller's
 * buffer (a ZMQ frame may be freed right away). Strings and binaries returned by accessors point
 * into the message and stay valid until cb_msg_destroy; strings are NOT NUL-terminated (use the
 * length, or cb_msg_str_copy). Nested maps returned by cb_msg_map/cb_msg_at_map are borrowed views
 * owned by the root message: never destroy them.
 *
 * Not thread-safe per message (accessors record the last error in the message); different
 * messages may be used from different threads.
 */
#ifndef CB_MSG_H
#define CB_MSG_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CB_MSG_VERSION 1                    /* the protocol version this build speaks */
#define CB_MSG_MAX_DEPTH 8                  /* top-level map = depth 1 */
#define CB_MSG_MAX_ID 64                    /* bytes of a request id (printable ASCII) */
#define CB_MSG_MAX_TYPE 32                  /* bytes of a type name ([a-z0-9_], starts a-z) */
#define CB_MSG_MAX_KEY 64                   /* bytes of any map key */
#define CB_MSG_MAX_MAP_ENTRIES 1024         /* entries of any one map */
#define CB_MSG_MAX_ERROR_MESSAGE 1024       /* bytes of error.message */
#define CB_MSG_DEFAULT_MAX_BYTES (8u << 20) /* cap of cb_msg_decode (services use config) */

/* ---------------------------------------------------------------------------------------------- */
/* Error codes: a small enum with stable string names (the `error.code` field on the wire).        */

typedef enum {
    CB_ERR_NONE = 0,     /* "ok" (never sent as a code) */
    CB_ERR_BAD_REQUEST,  /* "bad_request": malformed message, missing/invalid field, bad version */
    CB_ERR_UNKNOWN_TYPE, /* "unknown_type": the service does not handle this message type */
    CB_ERR_TOO_LARGE,    /* "too_large": message or field over a limit */
    CB_ERR_NOT_FOUND,    /* "not_found": the thing named does not exist */
    CB_ERR_UNAVAILABLE,  /* "unavailable": a peer service could not be reached */
    CB_ERR_TIMEOUT,      /* "timeout": no reply in time */
    CB_ERR_INTERNAL,     /* "internal": a bug or an unexpected local failure (disk, SQLite) */
    CB_ERR_OVERLOADED,   /* "overloaded": queue full, try again later */
    CB_ERR_COUNT_
} cb_err_t;

/* Stable wire name of a code ("bad_request", ...); "internal" for out-of-range values. */
const char *cb_err_name(cb_err_t code);
/* Code for a wire name of `len` bytes; CB_ERR_INTERNAL for a name this build does not know. */
cb_err_t cb_err_from_name(const char *name, size_t len);

/* ---------------------------------------------------------------------------------------------- */
/* Decoding                                                                                        */

typedef struct cb_msg_s cb_msg_t;

/* What went wrong in a failed decode, for the error reply. */
typedef struct {
    cb_err_t code;                      /* CB_ERR_BAD_REQUEST or CB_ERR_TOO_LARGE */
    char id[CB_MSG_MAX_ID + 1];         /* the request id when it could be read safely, else "" */
    char type[CB_MSG_MAX_TYPE + 1];     /* the type when it could be read safely, else "" */
    char message[256];                  /* human-readable reason */
} cb_msg_error_t;

/* Decodes and validates one message of `len` bytes (cap CB_MSG_DEFAULT_MAX_BYTES). Returns a new
 * message (caller owns; cb_msg_destroy) or NULL with a reason in err (may be NULL). */
cb_msg_t *cb_msg_decode(const void *buf, size_t len, char *err, size_t errlen);
/* Same with an explicit size cap and a structured error (e may be NULL). */
cb_msg_t *cb_msg_decode_ex(const void *buf, size_t len, size_t max_bytes, cb_msg_error_t *e);
/* Frees a root message and every view and string taken from it; NULL-safe; nulls *self_p.
 * Calling it on a view is a no-op (the view stays owned by its root). */
void cb_msg_destroy(cb_msg_t **self_p);

/* Envelope (valid for the root and for any view: they read the root). */
int cb_msg_version(const cb_msg_t *m);
const char *cb_msg_type(const cb_msg_t *m);  /* NUL-terminated, validated */
const char *cb_msg_id(const cb_msg_t *m);    /* NUL-terminated, printable ASCII, may be "" */
bool cb_msg_is_type(const cb_msg_t *m, const char *type);
/* Replies: whether `ok` is present, its value, and for ok=false the error (validated at decode). */
bool cb_msg_is_reply(const cb_msg_t *m);
bool cb_msg_ok(const cb_msg_t *m);                 /* false when absent or false */
cb_err_t cb_msg_err_code(const cb_msg_t *m);       /* CB_ERR_NONE when ok */
const char *cb_msg_err_code_name(const cb_msg_t *m); /* the wire string as sent ("" when ok) */
const char *cb_msg_err_message(const cb_msg_t *m); /* NUL-terminated ("" when ok) */

/* Reason for the last failed accessor call on this message (or one of its views). */
const char *cb_msg_last_error(const cb_msg_t *m);

/* ---------------------------------------------------------------------------------------------- */
/* Typed accessors on a map (the root or a view). All return false with cb_msg_last_error() set   */
/* when the key is absent (or nil), duplicated, of the wrong type, or out of range.                */

bool cb_msg_has(const cb_msg_t *m, const char *key); /* present and not nil */
/* 1 when key is present and not nil, 0 when absent (or nil), -1 when it appears twice (last error set). */
int cb_msg_present(const cb_msg_t *m, const char *key);

/* UTF-8 string without NUL bytes, at most max_len bytes. *s points into the message. */
bool cb_msg_str(const cb_msg_t *m, const char *key, size_t max_len, const char **s, size_t *len);
/* Same, copied NUL-terminated into dst (dstsize must be > max_len). */
bool cb_msg_str_copy(const cb_msg_t *m, const char *key, size_t max_len, char *dst, size_t dstsize);
/* Lower-case hex string of min_len..max_len characters (chunk keys, fingerprints). */
bool cb_msg_hex(const cb_msg_t *m, const char *key, size_t min_len, size_t max_len, const char **s,
                size_t *len);
/* Integer in [min, max]; accepts both msgpack integer families (a Python 5 arrives as positive). */
bool cb_msg_int(const cb_msg_t *m, const char *key, int64_t min, int64_t max, int64_t *out);
/* Finite number in [min, max]; accepts float32, float64 and integers. */
bool cb_msg_double(const cb_msg_t *m, const char *key, double min, double max, double *out);
bool cb_msg_bool(const cb_msg_t *m, const char *key, bool *out);
/* Binary (msgpack bin) of at most max_len bytes; *p points into the message. */
bool cb_msg_bin(const cb_msg_t *m, const char *key, size_t max_len, const void **p, size_t *len);

/* Optional fields: when the key is absent (or nil) store def and return true; when present, behave
 * like the accessor above (false when invalid). */
bool cb_msg_int_or(const cb_msg_t *m, const char *key, int64_t min, int64_t max, int64_t def,
                   int64_t *out);
bool cb_msg_double_or(const cb_msg_t *m, const char *key, double min, double max, double def,
                      double *out);
bool cb_msg_bool_or(const cb_msg_t *m, const char *key, bool def, bool *out);
bool cb_msg_str_or(const cb_msg_t *m, const char *key, size_t max_len, const char *def,
                   const char **s, size_t *len);

/* Arrays. cb_msg_array_len checks that key is an array of at most max_count elements. */
bool cb_msg_array_len(const cb_msg_t *m, const char *key, size_t max_count, size_t *n);
/* Element i of array `key` (bounds-checked), with the same checks as the scalar accessors. */
bool cb_msg_at_str(const cb_msg_t *m, const char *key, size_t i, size_t max_len, const char **s,
                   size_t *len);
bool cb_msg_at_hex(const cb_msg_t *m, const char *key, size_t i, size_t min_len, size_t max_len,
                   const char **s, size_t *len);
bool cb_msg_at_int(const cb_msg_t *m, const char *key, size_t i, int64_t min, int64_t max,
                   int64_t *out);
bool cb_msg_at_bin(const cb_msg_t *m, const char *key, size_t i, size_t max_len, const void **p,
                   size_t *len);
/* Whole arrays into caller arrays of capacity max_count (strings point into the message). */
bool cb_msg_str_array(const cb_msg_t *m, const char *key, size_t max_count, size_t max_len,
                      const char **strs /* [max_count] */, size_t *lens /* [max_count] */, size_t *n);
bool cb_msg_int_array(const cb_msg_t *m, const char *key, size_t max_count, int64_t min, int64_t max,
                      int64_t *out /* [max_count] */, size_t *n);

/* Nested maps: a borrowed view (owned by the root; never destroy), or NULL with last error set. */
const cb_msg_t *cb_msg_map(const cb_msg_t *m, const char *key);
const cb_msg_t *cb_msg_at_map(const cb_msg_t *m, const char *key, size_t i);

/* The map (root or view) as a jansson object (caller owns: json_decref). Binaries become
 * {"$bin": "<hex>"}. NULL on allocation failure. */
struct json_t *cb_msg_to_json(const cb_msg_t *m);

/* True when s[0..len) is valid UTF-8 (no overlong forms, no surrogates, <= U+10FFFF): cb_utf8_valid of
 * base/utf8.h, under the name the wire API has always had. */
bool cb_msg_utf8_valid(const char *s, size_t len);

/* ---------------------------------------------------------------------------------------------- */
/* Encoding. A writer builds one message at a time into its own buffer (msgpack_sbuffer/packer).  */
/* Maps and arrays may be opened without knowing their size (the count is patched on close).      */
/* Inside a map every put needs a key; inside an array the key must be NULL. Any misuse or        */
/* allocation failure makes the writer sticky-failed: cb_msg_end then returns NULL and            */
/* cb_msg_writer_error says why. Typical use:                                                      */
/*                                                                                                 */
/*     cb_msg_begin(w, "search", id);                                                              */
/*     cb_msg_put_str(w, "query", q); cb_msg_put_int(w, "k", 5);                                   */
/*     const void *data = cb_msg_end(w, &len);                                                     */
/*                                                                                                 */
/*     cb_msg_begin_reply(w, req);           // v, type, id of req, ok: true                       */
/*     cb_msg_begin_array(w, "hits");                                                              */
/*       cb_msg_begin_map(w, NULL); cb_msg_put_str(w, "key", k); cb_msg_end_map(w);                */
/*     cb_msg_end_array(w);                                                                        */
/*     data = cb_msg_end(w, &len);                                                                 */

typedef struct cb_msg_writer_s cb_msg_writer_t;

cb_msg_writer_t *cb_msg_writer_new(void);
void cb_msg_writer_destroy(cb_msg_writer_t **self_p);
/* Empties the writer (keeps its buffer) and clears a sticky error. cb_msg_begin* call it. */
void cb_msg_writer_reset(cb_msg_writer_t *w);
/* NULL when fine, else the reason the writer failed. */
const char *cb_msg_writer_error(const cb_msg_writer_t *w);

/* Starts a message {v, type, id}. type must be a valid type name, id <= CB_MSG_MAX_ID printable. */
void cb_msg_begin(cb_msg_writer_t *w, const char *type, const char *id);
/* Starts a top-level map WITHOUT the envelope fields (tools and tests that must be able to send
 * invalid envelopes; services never need it). */
void cb_msg_begin_bare(cb_msg_writer_t *w);
/* Starts a success reply to req: {v, type: req's type, id: req's id, ok: true}. */
void cb_msg_begin_reply(cb_msg_writer_t *w, const cb_msg_t *req);
/* Same, with an explicit type and id (e.g. a stream's "token" and "done" messages). */
void cb_msg_begin_reply_as(cb_msg_writer_t *w, const char *type, const char *id);
/* A whole error reply {v, type, id, ok: false, error: {code, message}}; returns the bytes like
 * cb_msg_end. type/id may be NULL or "" (then "error" and ""). */
const void *cb_msg_write_error(cb_msg_writer_t *w, const char *type, const char *id, cb_err_t code,
                               size_t *len, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
const void *cb_msg_write_errorv(cb_msg_writer_t *w, const char *type, const char *id, cb_err_t code,
                                size_t *len, const char *fmt, va_list ap);

void cb_msg_put_str(cb_msg_writer_t *w, const char *key, const char *s);
void cb_msg_put_strn(cb_msg_writer_t *w, const char *key, const char *s, size_t len);
void cb_msg_put_int(cb_msg_writer_t *w, const char *key, int64_t v);
void cb_msg_put_uint(cb_msg_writer_t *w, const char *key, uint64_t v);
void cb_msg_put_double(cb_msg_writer_t *w, const char *key, double v);
void cb_msg_put_bool(cb_msg_writer_t *w, const char *key, bool v);
void cb_msg_put_nil(cb_msg_writer_t *w, const char *key);
void cb_msg_put_bin(cb_msg_writer_t *w, const char *key, const void *p, size_t len);
void cb_msg_begin_map(cb_msg_writer_t *w, const char *key);
void cb_msg_end_map(cb_msg_writer_t *w);
void cb_msg_begin_array(cb_msg_writer_t *w, const char *key);
void cb_msg_end_array(cb_msg_writer_t *w);
/* Writes a jansson value: objects become maps, arrays arrays, integers/reals/bools/null/strings
 * themselves; an object {"$bin": "<hex>"} becomes a binary. */
void cb_msg_put_json(cb_msg_writer_t *w, const char *key, const struct json_t *value);
/* Copies every entry of a decoded map (root or view) into the open map, except the keys listed in
 * the NULL-terminated `skip` (may be NULL). Useful for relaying. */
void cb_msg_put_entries(cb_msg_writer_t *w, const cb_msg_t *m, const char *const *skip);

/* Closes the top-level map; returns the message bytes (owned by the writer, valid until the next
 * begin/reset/destroy) and their length, or NULL when the writer failed or containers are open. */
const void *cb_msg_end(cb_msg_writer_t *w, size_t *len);

#endif
