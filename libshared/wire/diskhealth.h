/* diskhealth: whether the disk a service writes its data to is full, for its `ping` (docs/protocol.md §3):
 * `status` "ok", or "degraded" with a `reason` that names the disk. Two signals, both cheap enough to
 * read at every ping (no thread of its own):
 *   - the free space of each watched directory's file system (statvfs: f_bavail * f_frsize, what a writer
 *     that is not root gets) against min_free_bytes (common.min_free_mb);
 *   - a write that failed because the disk or the quota was full (ENOSPC, EDQUOT, SQLite's SQLITE_FULL),
 *     reported by the service per kind of write (cb_diskhealth_failed: "KV dir", "job table", ...): it
 *     counts for hold_ms (common.disk_full_hold_s), or until a write of the same kind succeeds
 *     (cb_diskhealth_ok), whichever comes first.
 * Watched directories on one file system are reported together. The state's changes are logged (warn
 * when it becomes degraded, info when it is ok again), as seen by the checks.
 *
 * Thread-safe: worker threads report their writes while the loop thread checks. Every function takes a
 * NULL handle and then does nothing (a check is "ok").
 */
#ifndef CB_DISKHEALTH_H
#define CB_DISKHEALTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "wire/config.h"
#include "wire/msg.h"

#define CB_DISKHEALTH_MAX 8                    /* watched directories, and kinds of write */
#define CB_DISKHEALTH_MIN_FREE_MB_DEFAULT 64
#define CB_DISKHEALTH_HOLD_S_DEFAULT 60

typedef struct cb_diskhealth_s cb_diskhealth_t;

/* min_free_bytes: below it a file system is full (0: no free-space check); hold_ms: how long a failed
 * write counts (0: failed writes do not count). NULL when out of memory. Caller owns. */
cb_diskhealth_t *cb_diskhealth_new(int64_t min_free_bytes, int64_t hold_ms);
/* Reads <section>.min_free_mb (then common; default 64; 0 = off) and <section>.disk_full_hold_s (then
 * common; default 60). NULL with err on a bad value or out of memory. */
cb_diskhealth_t *cb_diskhealth_from_config(const cb_config_t *cfg, const char *section, char *err, size_t errlen);
void cb_diskhealth_destroy(cb_diskhealth_t **self_p);

/* Watches the file system of directory dir, called what in the reason ("KV dir", "index database").
 * cb_diskhealth_watch_file watches the directory of the file at path (a database: its -wal and journal
 * files are written there too). 0, or -1 when CB_DISKHEALTH_MAX directories are watched already. */
int cb_diskhealth_watch(cb_diskhealth_t *dh, const char *what, const char *dir);
int cb_diskhealth_watch_file(cb_diskhealth_t *dh, const char *what, const char *path);

/* Whether an errno, or an error message, says that the disk (or the quota) is full: ENOSPC, EDQUOT, their
 * strerror texts ("No space left on device", "Disk quota exceeded") or SQLite's "database or disk is
 * full". */
bool cb_diskhealth_full_errno(int e);
bool cb_diskhealth_full_msg(const char *msg);

/* A write of kind what failed because the disk is full; msg (may be NULL) is the error, quoted in the
 * reason (cut at 300 bytes). */
void cb_diskhealth_failed(cb_diskhealth_t *dh, const char *what, const char *msg);
/* cb_diskhealth_failed when msg says the disk is full (cb_diskhealth_full_msg); returns whether it did. */
bool cb_diskhealth_note(cb_diskhealth_t *dh, const char *what, const char *msg);
/* A write of kind what succeeded: an earlier failure of that kind counts no more. */
void cb_diskhealth_ok(cb_diskhealth_t *dh, const char *what);

/* Whether the file system of dir has room for need bytes and 1 MiB more (statvfs); *avail (may be NULL):
 * its free bytes (UINT64_MAX when statvfs fails, which counts as room). */
bool cb_diskhealth_room(const char *dir, uint64_t need, uint64_t *avail);

/* The state now: true when degraded, with the reason in reason [len] (well-formed UTF-8, e.g. "data disk
 * full: 0 bytes free on the file system of the KV dir /var/lib/cb/kv (statvfs; min_free_mb = 64); a write
 * to the KV dir failed 2 s ago: ... No space left on device"); false with reason "" when ok. *free_bytes
 * (may be NULL): the least free space of the watched file systems (-1 when none could be read). */
bool cb_diskhealth_check(cb_diskhealth_t *dh, char *reason, size_t len, int64_t *free_bytes);
/* Adds `status` ("ok" | "degraded"), `reason` (when degraded) and `disk_free_bytes` (when a watched
 * file system could be read) to the open map of a ping reply. dh NULL: status "ok" only. */
void cb_diskhealth_put(cb_diskhealth_t *dh, cb_msg_writer_t *w);

#endif
