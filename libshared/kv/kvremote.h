/* kvremote: the shared KV tier on Redis (or Valkey), through hiredis: chunk KV files as values, shared by
 * every host's cb-blend and cb-precompute (docs/kvremote.md, docs/scaleout.md).
 *
 * Keys: "<prefix>:<model fingerprint hex>:<chunk key hex>" (chunk key: format/kvfile.h cb_kvfile_key).
 * Values: the bytes of a whole KV file, exactly as on disk. This module moves bytes only: it never trusts
 * them. The caller (kv/kvstore.h) validates each value as a file from disk (header, model, context, tokens,
 * every checksum) and reports a value that fails with cb_kvremote_reject (counted, deleted).
 *
 * Endpoints: "redis://HOST[:PORT]" (PORT 6379 by default; HOST a name or an IPv4 address, or an IPv6
 * address in brackets) or "unix:///PATH" (a Unix socket). Optional AUTH password (sent at each connect).
 *
 * Time bounds: every call (connect, AUTH, command, reply) runs against a deadline (connect_timeout_ms for
 * the connection and its AUTH, timeout_ms for a command from its first byte sent to its last byte read),
 * with non-blocking I/O and poll(): a slow or dead Redis costs a caller at most connect_timeout_ms +
 * timeout_ms. Host names are resolved by the connect (getaddrinfo, not bounded by the timeout: use an
 * address or a name the resolver answers locally). No signal is raised by a dead peer (MSG_NOSIGNAL).
 *
 * Health: after a failed connect, an I/O error or a timeout the connection is dropped and the tier is marked
 * down (one warning at the transition, not per request); while it is down every call returns at once
 * (CB_KVREMOTE_DOWN, counted as `skipped`) until recovery_ms have passed, then the next call tries to
 * reconnect: success logs that the tier is back, failure keeps it down for another recovery_ms (no new
 * warning). An error reply from Redis (-OOM, -ERR ...) fails that call (counted in `errors`) and keeps
 * the connection: the server answered. A reply larger than max_value_bytes (+ the protocol's bytes) is
 * refused without being held in memory beyond that bound: a corrupt value, counted as such.
 *
 * Threads: every call may come from any thread; one mutex serializes the connection (calls wait for the
 * one in progress, which is bounded as above). The counters are atomics (cb_kvremote_stats never waits).
 * Memory: the reply being read (at most max_value_bytes plus the reader's buffer) while a call runs.
 */
#ifndef CB_KVREMOTE_H
#define CB_KVREMOTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct cb_kvremote cb_kvremote_t;

#define CB_KVREMOTE_MAX_PREFIX 64           /* bytes of a key prefix ([A-Za-z0-9_.-], at least one) */
#define CB_KVREMOTE_MAX_KEY (CB_KVREMOTE_MAX_PREFIX + 2 * 64 + 3) /* a key with its NUL */

typedef struct {
    const char *url;              /* "redis://host:port" | "unix:///path" (required) */
    const char *password;         /* AUTH at each connect; NULL or "" = none */
    int connect_timeout_ms;       /* connect + AUTH, 1..600000 (default 500) */
    int timeout_ms;               /* one command, send to last reply byte, 1..600000 (default 1000) */
    int recovery_ms;              /* a down tier is skipped this long before a reconnect, 1..86400000 (5000) */
    const char *prefix;           /* key prefix (default "cb") */
    size_t max_value_bytes;       /* values larger are neither sent nor read (default 64 MiB, max 512 MiB) */
} cb_kvremote_opts_t;

/* Fills o with the defaults above (url NULL). */
void cb_kvremote_opts_default(cb_kvremote_opts_t *o);

/* A client for opts (copied: the strings need not outlive the call). It tries to connect now: an unreachable
 * server is not an error (the tier starts down, logged, and is retried after recovery_ms). NULL + err on a
 * bad option (URL, prefix, a timeout or size out of range) or out of memory. Caller owns the result
 * (cb_kvremote_destroy). */
cb_kvremote_t *cb_kvremote_new(const cb_kvremote_opts_t *opts, char *err, size_t errlen);
void cb_kvremote_destroy(cb_kvremote_t **self_p);

/* What a call found. */
typedef enum {
    CB_KVREMOTE_OK = 0,     /* get: a value (a hit); put, del: done; exists: the key exists */
    CB_KVREMOTE_MISS,       /* get, exists: no such key */
    CB_KVREMOTE_DOWN,       /* skipped: the tier is down (recovery interval not over) */
    CB_KVREMOTE_ERROR,      /* failed now: connect, I/O, timeout, an error reply, a reply of the wrong type */
    CB_KVREMOTE_TOO_LARGE   /* the value is over max_value_bytes (get: counted corrupt; put: not sent) */
} cb_kvremote_rc_t;
const char *cb_kvremote_rc_str(cb_kvremote_rc_t rc); /* "ok", "miss", "down", "error", "too_large" */

/* GET of (model_fp, key): on CB_KVREMOTE_OK, *value (malloc'd; the caller frees it with free()) holds *len
 * bytes (len >= 1; an empty value is a MISS). Otherwise *value is NULL and err (may be NULL) says why.
 * Counts hits, misses, errors, skipped, bytes_read. */
cb_kvremote_rc_t cb_kvremote_get(cb_kvremote_t *self, const uint8_t model_fp[32], const uint8_t key[32],
                                 uint8_t **value, size_t *len, char *err, size_t errlen);
/* SET of (model_fp, key) to value [len] (borrowed; 1..max_value_bytes). CB_KVREMOTE_OK or a failure. Counts
 * puts, errors, skipped, bytes_written. */
cb_kvremote_rc_t cb_kvremote_put(cb_kvremote_t *self, const uint8_t model_fp[32], const uint8_t key[32],
                                 const void *value, size_t len, char *err, size_t errlen);
/* EXISTS: CB_KVREMOTE_OK (there), CB_KVREMOTE_MISS (not there), or a failure. */
cb_kvremote_rc_t cb_kvremote_exists(cb_kvremote_t *self, const uint8_t model_fp[32], const uint8_t key[32],
                                    char *err, size_t errlen);
/* DEL: CB_KVREMOTE_OK (gone, or was not there) or a failure. */
cb_kvremote_rc_t cb_kvremote_del(cb_kvremote_t *self, const uint8_t model_fp[32], const uint8_t key[32],
                                 char *err, size_t errlen);
/* A value got from the tier failed validation (why: a short reason for the log): counted in `corrupt`,
 * logged, and deleted from Redis (best effort), so that no host uses it again. */
void cb_kvremote_reject(cb_kvremote_t *self, const uint8_t model_fp[32], const uint8_t key[32], const char *why);

/* The key string of (model_fp, key) into buf [cap >= CB_KVREMOTE_MAX_KEY]; returns buf. */
char *cb_kvremote_key(const cb_kvremote_t *self, const uint8_t model_fp[32], const uint8_t key[32], char *buf,
                      size_t cap);

typedef struct {
    uint64_t hits;            /* GETs that returned a value (one rejected later counts in corrupt too) */
    uint64_t misses;          /* GETs of a key Redis did not have */
    uint64_t errors;          /* calls that failed now (connect, I/O, timeout, error replies) */
    uint64_t corrupt;         /* values rejected (cb_kvremote_reject, or a GET reply over the size bound) */
    uint64_t skipped;         /* calls not made: the tier was down */
    uint64_t puts;            /* SETs done */
    uint64_t bytes_read;      /* value bytes of the hits */
    uint64_t bytes_written;   /* value bytes of the SETs done */
    uint64_t downs;           /* transitions to down */
    bool up;                  /* connected, or not known to be down (false while down) */
} cb_kvremote_stats_t;

/* A snapshot of the counters (thread-safe, never waits). */
void cb_kvremote_stats(const cb_kvremote_t *self, cb_kvremote_stats_t *out);
bool cb_kvremote_up(const cb_kvremote_t *self);
const char *cb_kvremote_url(const cb_kvremote_t *self);      /* the endpoint, for logs */
size_t cb_kvremote_max_value_bytes(const cb_kvremote_t *self);
#endif
