/* kvremote_config: the shared KV tier (kv/kvremote.h) from the stack's configuration, and its counters in a
 * service's `stats` reply. One place for what cb-blend and cb-precompute both do.
 *
 * Keys (common section, so both read the same; each may be overridden per section like any key):
 *   kv_remote                   "" = off (the default) | redis://HOST:PORT | unix:///PATH
 *   kv_remote_password          AUTH password ("" = none)
 *   kv_remote_timeout_ms        connect, and each command (1..600000, default 1000)
 *   kv_remote_recovery_ms       a down tier is skipped this long before a reconnect (1..86400000, default 5000)
 *   kv_remote_prefix            key prefix (default "cb")
 *   kv_remote_max_value_bytes   largest value sent or read (default 64M, at most 512M)
 * docs/kvremote.md; config/cacheblend.cfg.
 */
#ifndef CB_KVREMOTE_CONFIG_H
#define CB_KVREMOTE_CONFIG_H

#include <stddef.h>

#include "kv/kvremote.h"
#include "wire/config.h"
#include "wire/msg.h"

/* The remote tier configured for section: 0 with *out set (caller owns; cb_kvremote_destroy) or NULL when
 * kv_remote is empty (off); -1 with err on a bad value. An unreachable server is not an error (kvremote.h:
 * the tier starts down and is retried). */
int cb_kvremote_from_config(const cb_config_t *cfg, const char *section, cb_kvremote_t **out, char *err,
                            size_t errlen);

/* Writes the tier's counters into a stats reply being built: kv_remote_hits, _misses, _errors, _corrupt,
 * _skipped, _puts, _bytes_read, _bytes_written, _downs (unsigned) and kv_remote_up (0 or 1), plus
 * kv_remote (the endpoint). Nothing when remote is NULL (the tier is off). */
void cb_kvremote_put_stats(cb_msg_writer_t *w, const cb_kvremote_t *remote);

#endif
