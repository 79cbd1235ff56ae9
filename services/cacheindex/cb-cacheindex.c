/* cb-cacheindex: the KV cache index service. Owns a SQLite database (WAL) mapping chunk keys to KV
 * files under kv_dir (relative path, bytes, tokens, model fingerprint, created, last used, hits),
 * answers put / lookup / touch / gc / ping / stats (docs/protocol.md §5) on a ROUTER socket, keeps the
 * files under a byte budget by evicting the least recently used entries, and garbage-collects rows
 * whose files are gone and files that no row names (at start and on request). Its `ping` says `degraded`
 * while the disk of the database or kv_dir is full (diskhealth.h).
 *
 * LRU order is a monotonic use counter (use_seq), not wall-clock time, so many uses within one
 * millisecond still order correctly and a clock step cannot reorder the cache.
 *
 * Usage: cb-cacheindex [--config PATH] [--cacheindex.KEY=VALUE | --KEY VALUE]...
 * Exit: 0 after SIGINT/SIGTERM, 1 on a startup error.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "wire/bus.h"
#include "base/alloc.h"
#include "wire/config.h"
#include "wire/db.h"
#include "kvdir.h"
#include "format/kvfile.h"
#include "base/log.h"
#include "wire/msg.h"

#define SECTION "cacheindex"
#define KEY_MIN 16
#define KEY_MAX 128
#define FP_MAX 128
#define MAX_BYTES ((int64_t)1 << 50)
#define MAX_TOKENS 10000000

typedef struct {
    sqlite3 *db;
    kvdir_t *kv;
    char db_path[4096];
    int64_t budget, max_keys, gc_min_age_s;
    int64_t total_bytes; /* SUM(bytes) of all rows, kept in step with every change */
    int64_t seq;         /* last use_seq handed out */
    uint64_t hits, misses, evictions;
    sqlite3_stmt *get, *get_by_path, *upsert, *del, *use, *touch, *lru, *all, *count;
    cb_diskhealth_t *disk; /* the disk of the database and kv_dir, for ping: ok or degraded (diskhealth.h) */
} cacheindex_t;

static const char *SCHEMA =
    "CREATE TABLE IF NOT EXISTS entries("
    "  key TEXT PRIMARY KEY,"
    "  path TEXT NOT NULL UNIQUE,"  /* relative to kv_dir */
    "  bytes INTEGER NOT NULL,"
    "  tokens INTEGER NOT NULL,"
    "  fingerprint TEXT NOT NULL,"
    "  created INTEGER NOT NULL,"   /* unix ms */
    "  last_used INTEGER NOT NULL," /* unix ms */
    "  use_seq INTEGER NOT NULL,"   /* LRU order */
    "  hits INTEGER NOT NULL DEFAULT 0);"
    "CREATE INDEX IF NOT EXISTS entries_lru ON entries(use_seq);";

static int prepare_all(cacheindex_t *c, char *err, size_t errlen) {
    struct {
        sqlite3_stmt **st;
        const char *sql;
    } all[] = {
        {&c->get, "SELECT path, bytes, tokens, fingerprint FROM entries WHERE key = ?1"},
        {&c->get_by_path, "SELECT key FROM entries WHERE path = ?1 AND key <> ?2"},
        {&c->upsert,
         "INSERT INTO entries(key, path, bytes, tokens, fingerprint, created, last_used, use_seq, hits)"
         " VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, ?7, 0) ON CONFLICT(key) DO UPDATE SET path = excluded.path,"
         " bytes = excluded.bytes, tokens = excluded.tokens, fingerprint = excluded.fingerprint,"
         " last_used = excluded.last_used, use_seq = excluded.use_seq"},
        {&c->del, "DELETE FROM entries WHERE key = ?1"},
        {&c->use, "UPDATE entries SET hits = hits + 1, last_used = ?2, use_seq = ?3 WHERE key = ?1"},
        {&c->touch, "UPDATE entries SET last_used = ?2, use_seq = ?3 WHERE key = ?1"},
        {&c->lru, "SELECT key, path, bytes FROM entries WHERE key <> ?1 ORDER BY use_seq LIMIT 1"},
        {&c->all, "SELECT key, path, bytes FROM entries"},
        {&c->count, "SELECT COUNT(*), COALESCE(SUM(bytes), 0), COALESCE(MAX(use_seq), 0) FROM entries"},
    };
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (!(*all[i].st = cb_db_prepare(c->db, all[i].sql, err, errlen))) return -1;
    return 0;
}

static void cacheindex_close(cacheindex_t *c) {
    sqlite3_stmt *all[] = {c->get, c->get_by_path, c->upsert, c->del, c->use, c->touch, c->lru, c->all, c->count};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) sqlite3_finalize(all[i]);
    cb_db_close(&c->db);
    kvdir_close(&c->kv);
}

static int64_t now_unix_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int step_done(sqlite3_stmt *st) {
    int rc = sqlite3_step(st);
    sqlite3_reset(st);
    return rc;
}

static int64_t entry_count(cacheindex_t *c) {
    int64_t n = 0;
    if (sqlite3_step(c->count) == SQLITE_ROW) n = sqlite3_column_int64(c->count, 0);
    sqlite3_reset(c->count);
    return n;
}

static int begin(cacheindex_t *c, char *err, size_t errlen) { return cb_db_exec(c->db, "BEGIN IMMEDIATE", err, errlen); }
static int commit(cacheindex_t *c, char *err, size_t errlen) { return cb_db_exec(c->db, "COMMIT", err, errlen); }
static void rollback(cacheindex_t *c) {
    char e[128];
    cb_db_exec(c->db, "ROLLBACK", e, sizeof e);
}

/* Deletes the row of key (bytes accounted); the file is left alone. */
static int delete_row(cacheindex_t *c, const char *key, int keylen, int64_t bytes) {
    sqlite3_bind_text(c->del, 1, key, keylen, SQLITE_TRANSIENT);
    if (step_done(c->del) != SQLITE_DONE) return -1;
    if (sqlite3_changes(c->db) > 0) c->total_bytes -= bytes;
    return 0;
}

/* Evicts least-recently-used entries (files, then rows) until the total fits the budget; never the
 * entry `keep` (may be NULL). Inside the caller's transaction. Returns the number evicted, -1 on a
 * database error. */
static int evict(cacheindex_t *c, const char *keep, const char *req_id) {
    int n = 0;
    while (c->total_bytes > c->budget) {
        sqlite3_bind_text(c->lru, 1, keep ? keep : "", -1, SQLITE_TRANSIENT);
        int rc = sqlite3_step(c->lru);
        if (rc != SQLITE_ROW) {
            sqlite3_reset(c->lru);
            if (rc != SQLITE_DONE) return -1;
            cb_log(CB_LOG_WARN, req_id, "over budget (%lld > %lld bytes) with nothing left to evict",
                   (long long)c->total_bytes, (long long)c->budget);
            break;
        }
        char key[KEY_MAX + 1], path[KVDIR_MAX_PATH + 1];
        snprintf(key, sizeof key, "%s", (const char *)sqlite3_column_text(c->lru, 0));
        snprintf(path, sizeof path, "%s", (const char *)sqlite3_column_text(c->lru, 1));
        int64_t bytes = sqlite3_column_int64(c->lru, 2);
        sqlite3_reset(c->lru);
        char why[128];
        if (kvdir_path_valid(path, strlen(path), why, sizeof why) && kvdir_unlink(c->kv, path) != 0)
            cb_log(CB_LOG_WARN, req_id, "evict %s: cannot remove %s: %s (gc will retry)", key, path, strerror(errno));
        if (delete_row(c, key, -1, bytes) != 0) return -1;
        c->evictions++;
        n++;
        cb_log(CB_LOG_DEBUG, req_id, "evicted %s (%lld bytes)", key, (long long)bytes);
    }
    return n;
}

static bool get_keys(cacheindex_t *c, cb_bus_req_t *req, const cb_msg_t *m, size_t *n) {
    if (!cb_msg_array_len(m, "keys", (size_t)c->max_keys, n)) {
        cb_bus_reply_error(req, cb_msg_has(m, "keys") && strstr(cb_msg_last_error(m), "limit") ? CB_ERR_TOO_LARGE
                                                                                             : CB_ERR_BAD_REQUEST,
                           "%s", cb_msg_last_error(m));
        return false;
    }
    if (*n == 0) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "field 'keys': empty");
        return false;
    }
    const char *s;
    size_t len;
    for (size_t i = 0; i < *n; i++)
        if (!cb_msg_at_hex(m, "keys", i, KEY_MIN, KEY_MAX, &s, &len)) {
            cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
            return false;
        }
    return true;
}

static void on_put(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    cacheindex_t *c = arg;
    const char *key, *path, *fp;
    size_t nkey, npath, nfp;
    int64_t bytes, tokens;
    char why[160], err[256];
    if (!cb_msg_hex(m, "key", KEY_MIN, KEY_MAX, &key, &nkey) || !cb_msg_str(m, "path", KVDIR_MAX_PATH, &path, &npath) ||
        !cb_msg_int(m, "bytes", 0, MAX_BYTES, &bytes) || !cb_msg_int(m, "tokens", 0, MAX_TOKENS, &tokens) ||
        !cb_msg_hex(m, "fingerprint", 1, FP_MAX, &fp, &nfp)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    if (!kvdir_path_valid(path, npath, why, sizeof why)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "field 'path': %s", why);
        return;
    }
    char rel[KVDIR_MAX_PATH + 1], k[KEY_MAX + 1];
    memcpy(rel, path, npath);
    rel[npath] = 0;
    memcpy(k, key, nkey);
    k[nkey] = 0;
    struct stat st;
    if (kvdir_stat(c->kv, rel, &st) != 0) {
        cb_bus_reply_error(req, errno == ENOENT ? CB_ERR_NOT_FOUND : CB_ERR_BAD_REQUEST, "file %s in kv_dir: %s", rel,
                           errno == ELOOP || errno == ENOTDIR ? "a symlink or not a directory on the way" : strerror(errno));
        return;
    }
    if (!S_ISREG(st.st_mode)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "file %s in kv_dir is not a regular file", rel);
        return;
    }
    if ((int64_t)st.st_size != bytes) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "file %s has %lld bytes, the request says %lld", rel,
                           (long long)st.st_size, (long long)bytes);
        return;
    }
    if (begin(c, err, sizeof err) != 0) goto fail;
    /* the path must not belong to another key */
    sqlite3_bind_text(c->get_by_path, 1, rel, -1, SQLITE_STATIC);
    sqlite3_bind_text(c->get_by_path, 2, k, -1, SQLITE_STATIC);
    int rc = sqlite3_step(c->get_by_path);
    sqlite3_reset(c->get_by_path);
    if (rc == SQLITE_ROW) {
        rollback(c);
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "path %s already belongs to another key", rel);
        return;
    }
    /* the previous row of this key, if any */
    char old_path[KVDIR_MAX_PATH + 1] = "";
    int64_t old_bytes = 0;
    sqlite3_bind_text(c->get, 1, k, -1, SQLITE_STATIC);
    if (sqlite3_step(c->get) == SQLITE_ROW) {
        snprintf(old_path, sizeof old_path, "%s", (const char *)sqlite3_column_text(c->get, 0));
        old_bytes = sqlite3_column_int64(c->get, 1);
    }
    sqlite3_reset(c->get);
    int64_t now = now_unix_ms();
    sqlite3_bind_text(c->upsert, 1, k, -1, SQLITE_STATIC);
    sqlite3_bind_text(c->upsert, 2, rel, -1, SQLITE_STATIC);
    sqlite3_bind_int64(c->upsert, 3, bytes);
    sqlite3_bind_int64(c->upsert, 4, tokens);
    sqlite3_bind_text(c->upsert, 5, fp, (int)nfp, SQLITE_STATIC);
    sqlite3_bind_int64(c->upsert, 6, now);
    sqlite3_bind_int64(c->upsert, 7, ++c->seq);
    if (step_done(c->upsert) != SQLITE_DONE) goto db_fail;
    int64_t saved_total = c->total_bytes;
    c->total_bytes += bytes - old_bytes;
    uint64_t saved_evictions = c->evictions;
    int evicted = evict(c, k, cb_bus_req_id(req));
    if (evicted < 0) {
        c->total_bytes = saved_total;
        c->evictions = saved_evictions;
        goto db_fail;
    }
    if (commit(c, err, sizeof err) != 0) {
        rollback(c);
        c->total_bytes = saved_total;
        goto fail;
    }
    cb_diskhealth_ok(c->disk, "index database");
    if (old_path[0] && strcmp(old_path, rel) != 0 && kvdir_path_valid(old_path, strlen(old_path), why, sizeof why))
        kvdir_unlink(c->kv, old_path); /* replaced by a new file */
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_int(w, "evicted", evicted);
    cb_msg_put_int(w, "bytes_total", c->total_bytes);
    cb_bus_reply(req, w);
    return;
db_fail:
    snprintf(err, sizeof err, "SQLite: %s", sqlite3_errmsg(c->db));
    rollback(c);
fail:
    /* the in-memory totals may be off after a failed transaction: recount */
    if (sqlite3_step(c->count) == SQLITE_ROW) c->total_bytes = sqlite3_column_int64(c->count, 1);
    sqlite3_reset(c->count);
    cb_diskhealth_note(c->disk, "index database", err); /* SQLITE_FULL: ping says degraded */
    cb_bus_reply_error(req, CB_ERR_INTERNAL, "put failed: %s", err);
}

static void on_lookup(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    cacheindex_t *c = arg;
    size_t n;
    char err[256];
    if (!get_keys(c, req, m, &n)) return;
    if (begin(c, err, sizeof err) != 0) {
        cb_diskhealth_note(c->disk, "index database", err); /* SQLITE_FULL: ping says degraded */
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "lookup failed: %s", err);
        return;
    }
    /* hits go into the reply as they are found; misses are written after them (second pass) */
    bool *hit = cb_calloc(n, sizeof *hit);
    if (!hit) {
        rollback(c);
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "out of memory");
        return;
    }
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_begin_array(w, "hits");
    int64_t now = now_unix_ms();
    bool dberr = false;
    for (size_t i = 0; i < n && !dberr; i++) {
        const char *key;
        size_t klen;
        cb_msg_at_hex(m, "keys", i, KEY_MIN, KEY_MAX, &key, &klen);
        sqlite3_bind_text(c->get, 1, key, (int)klen, SQLITE_STATIC);
        if (sqlite3_step(c->get) != SQLITE_ROW) {
            sqlite3_reset(c->get);
            continue;
        }
        char path[KVDIR_MAX_PATH + 1], fp[FP_MAX + 1], why[128];
        snprintf(path, sizeof path, "%s", (const char *)sqlite3_column_text(c->get, 0));
        int64_t bytes = sqlite3_column_int64(c->get, 1), tokens = sqlite3_column_int64(c->get, 2);
        snprintf(fp, sizeof fp, "%s", (const char *)sqlite3_column_text(c->get, 3));
        sqlite3_reset(c->get);
        struct stat st;
        bool ok = kvdir_path_valid(path, strlen(path), why, sizeof why) && kvdir_stat(c->kv, path, &st) == 0 &&
                  S_ISREG(st.st_mode) && (int64_t)st.st_size == bytes;
        if (!ok) { /* the file vanished or changed: a miss, and the row goes */
            cb_log(CB_LOG_INFO, cb_bus_req_id(req), "entry %.*s: file %s is gone or changed; row removed", (int)klen,
                   key, path);
            if (delete_row(c, key, (int)klen, bytes) != 0) dberr = true;
            continue;
        }
        sqlite3_bind_text(c->use, 1, key, (int)klen, SQLITE_STATIC);
        sqlite3_bind_int64(c->use, 2, now);
        sqlite3_bind_int64(c->use, 3, ++c->seq);
        if (step_done(c->use) != SQLITE_DONE) dberr = true;
        hit[i] = true;
        cb_msg_begin_map(w, NULL);
        cb_msg_put_strn(w, "key", key, klen);
        cb_msg_put_str(w, "path", path);
        cb_msg_put_int(w, "bytes", bytes);
        cb_msg_put_int(w, "tokens", tokens);
        cb_msg_put_str(w, "fingerprint", fp);
        cb_msg_end_map(w);
    }
    if (dberr || commit(c, err, sizeof err) != 0) {
        if (dberr) snprintf(err, sizeof err, "SQLite: %s", sqlite3_errmsg(c->db));
        rollback(c);
        free(hit);
        if (sqlite3_step(c->count) == SQLITE_ROW) c->total_bytes = sqlite3_column_int64(c->count, 1);
        sqlite3_reset(c->count);
        cb_diskhealth_note(c->disk, "index database", err); /* SQLITE_FULL: ping says degraded */
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "lookup failed: %s", err);
        return;
    }
    cb_msg_end_array(w);
    cb_msg_begin_array(w, "misses");
    for (size_t i = 0; i < n; i++) {
        if (hit[i]) {
            c->hits++;
            continue;
        }
        const char *key;
        size_t klen;
        cb_msg_at_hex(m, "keys", i, KEY_MIN, KEY_MAX, &key, &klen);
        cb_msg_put_strn(w, NULL, key, klen);
        c->misses++;
    }
    cb_msg_end_array(w);
    free(hit);
    cb_bus_reply(req, w);
}

/* touch {keys, hit?}: marks the existing entries as just used (LRU). With hit true (cb-blend, for the
 * chunks it read from its memory tier or a KV file) each existing key also counts as a hit (the entry's hit
 * counter and stats.hits) and each unknown key as a miss, as a lookup would. Reply: touched (keys that
 * exist), unknown (the keys no row has, in request order). */
static void on_touch(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    cacheindex_t *c = arg;
    size_t n;
    char err[256];
    bool hit;
    if (!get_keys(c, req, m, &n)) return;
    if (!cb_msg_bool_or(m, "hit", false, &hit)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    bool *known = cb_calloc(n, sizeof *known);
    if (!known) {
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "out of memory");
        return;
    }
    if (begin(c, err, sizeof err) != 0) {
        free(known);
        cb_diskhealth_note(c->disk, "index database", err); /* SQLITE_FULL: ping says degraded */
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "touch failed: %s", err);
        return;
    }
    sqlite3_stmt *st = hit ? c->use : c->touch;
    int64_t now = now_unix_ms(), touched = 0;
    for (size_t i = 0; i < n; i++) {
        const char *key;
        size_t klen;
        cb_msg_at_hex(m, "keys", i, KEY_MIN, KEY_MAX, &key, &klen);
        sqlite3_bind_text(st, 1, key, (int)klen, SQLITE_STATIC);
        sqlite3_bind_int64(st, 2, now);
        sqlite3_bind_int64(st, 3, ++c->seq);
        if (step_done(st) != SQLITE_DONE) {
            snprintf(err, sizeof err, "SQLite: %s", sqlite3_errmsg(c->db));
            rollback(c);
            free(known);
            cb_diskhealth_note(c->disk, "index database", err); /* SQLITE_FULL: ping says degraded */
            cb_bus_reply_error(req, CB_ERR_INTERNAL, "touch failed: %s", err);
            return;
        }
        known[i] = sqlite3_changes(c->db) > 0;
        touched += known[i];
    }
    if (commit(c, err, sizeof err) != 0) {
        rollback(c);
        free(known);
        cb_diskhealth_note(c->disk, "index database", err); /* SQLITE_FULL: ping says degraded */
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "touch failed: %s", err);
        return;
    }
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_int(w, "touched", touched);
    cb_msg_begin_array(w, "unknown");
    for (size_t i = 0; i < n; i++) {
        if (hit && known[i]) c->hits++;
        else if (hit) c->misses++;
        if (known[i]) continue;
        const char *key;
        size_t klen;
        cb_msg_at_hex(m, "keys", i, KEY_MIN, KEY_MAX, &key, &klen);
        cb_msg_put_strn(w, NULL, key, klen);
    }
    cb_msg_end_array(w);
    free(known);
    cb_bus_reply(req, w);
}

/* ---- gc ---------------------------------------------------------------------------------- */

typedef struct {
    zhash_t *paths; /* relative paths that rows name */
    time_t now;
    int64_t min_age_s;
    int64_t files_removed, bytes_freed;
} gc_walk_t;

static bool gc_visit(const char *rel, const struct stat *st, void *arg) {
    gc_walk_t *g = arg;
    size_t n = strlen(rel);
    if (n < 3 || strcmp(rel + n - 3, ".kv") != 0) return false; /* only *.kv files (temp files: kvfile sweep) */
    if (zhash_lookup(g->paths, rel)) return false;
    if (g->now - st->st_mtime < g->min_age_s) return false; /* maybe about to be put */
    g->files_removed++;
    g->bytes_freed += st->st_size;
    return true;
}

typedef struct {
    int64_t rows_removed, files_removed, tmp_removed, bytes_freed;
    int evicted;
} gc_result_t;

static int gc(cacheindex_t *c, gc_result_t *r, const char *req_id, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    zhash_t *paths = zhash_new();
    if (!paths) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (begin(c, err, errlen) != 0) {
        zhash_destroy(&paths);
        return -1;
    }
    /* 1. rows whose files are gone */
    zlist_t *gone = zlist_new();
    zlist_autofree(gone);
    int rc;
    while ((rc = sqlite3_step(c->all)) == SQLITE_ROW) {
        const char *key = (const char *)sqlite3_column_text(c->all, 0);
        const char *path = (const char *)sqlite3_column_text(c->all, 1);
        struct stat st;
        char why[128];
        bool ok = path && kvdir_path_valid(path, strlen(path), why, sizeof why) && kvdir_stat(c->kv, path, &st) == 0 &&
                  S_ISREG(st.st_mode) && (int64_t)st.st_size == sqlite3_column_int64(c->all, 2);
        if (ok) zhash_insert(paths, path, (void *)1);
        else zlist_append(gone, (void *)key);
    }
    sqlite3_reset(c->all);
    bool failed = rc != SQLITE_DONE;
    for (char *key = zlist_first(gone); key && !failed; key = zlist_next(gone)) {
        sqlite3_bind_text(c->get, 1, key, -1, SQLITE_TRANSIENT);
        int64_t bytes = sqlite3_step(c->get) == SQLITE_ROW ? sqlite3_column_int64(c->get, 1) : 0;
        sqlite3_reset(c->get);
        if (delete_row(c, key, -1, bytes) != 0) failed = true;
        else r->rows_removed++;
    }
    zlist_destroy(&gone);
    if (failed || commit(c, err, errlen) != 0) {
        if (failed) snprintf(err, errlen, "SQLite: %s", sqlite3_errmsg(c->db));
        rollback(c);
        zhash_destroy(&paths);
        return -1;
    }
    /* 2. files that no row names (old enough), 3. stray temporary files */
    gc_walk_t g = {.paths = paths, .now = time(NULL), .min_age_s = c->gc_min_age_s};
    long visited = kvdir_walk(c->kv, gc_visit, &g, err, errlen);
    zhash_destroy(&paths);
    if (visited < 0) return -1;
    r->files_removed = g.files_removed;
    r->bytes_freed = g.bytes_freed;
    char e2[256];
    int tmp = cb_kvfile_sweep_tmp(kvdir_root(c->kv), (double)c->gc_min_age_s, e2, sizeof e2);
    if (tmp < 0) cb_log(CB_LOG_WARN, req_id, "gc: temporary files: %s", e2);
    else r->tmp_removed = tmp;
    /* 4. the budget */
    if (begin(c, err, errlen) != 0) return -1;
    r->evicted = evict(c, NULL, req_id);
    if (r->evicted < 0 || commit(c, err, errlen) != 0) {
        if (r->evicted < 0) snprintf(err, errlen, "SQLite: %s", sqlite3_errmsg(c->db));
        rollback(c);
        return -1;
    }
    cb_log(CB_LOG_INFO, req_id,
           "gc: %lld rows without files, %lld orphan files (%lld bytes), %lld temporary files removed; %d evicted",
           (long long)r->rows_removed, (long long)r->files_removed, (long long)r->bytes_freed,
           (long long)r->tmp_removed, r->evicted);
    return 0;
}

static void on_gc(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    cacheindex_t *c = arg;
    gc_result_t r;
    char err[256];
    if (gc(c, &r, cb_bus_req_id(req), err, sizeof err) != 0) {
        cb_diskhealth_note(c->disk, "index database", err); /* SQLITE_FULL: ping says degraded */
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "gc failed: %s", err);
        return;
    }
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_int(w, "rows_removed", r.rows_removed);
    cb_msg_put_int(w, "files_removed", r.files_removed);
    cb_msg_put_int(w, "tmp_removed", r.tmp_removed);
    cb_msg_put_int(w, "bytes_freed", r.bytes_freed);
    cb_msg_put_int(w, "evicted", r.evicted);
    cb_bus_reply(req, w);
}

static void stats_extra(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg) {
    (void)svc;
    cacheindex_t *c = arg;
    cb_msg_put_int(w, "entries", entry_count(c));
    cb_msg_put_int(w, "bytes", c->total_bytes);
    cb_msg_put_int(w, "budget", c->budget);
    cb_msg_put_uint(w, "hits", c->hits);
    cb_msg_put_uint(w, "misses", c->misses);
    cb_msg_put_uint(w, "evictions", c->evictions);
    cb_msg_put_int(w, "db_bytes", cb_db_file_bytes(c->db_path));
}

static void usage(FILE *f) {
    fprintf(f, "usage: cb-cacheindex [--config PATH] [--cacheindex.KEY=VALUE | --KEY VALUE]...\n"
               "  Serves put/lookup/touch/gc/ping/stats (docs/protocol.md) on cacheindex.endpoint.\n"
               "  Keys: endpoint, bind, db, budget_bytes, max_keys, gc_on_start, gc_min_age_s, and common.*\n"
               "  (kv_dir, data_dir, min_free_mb, disk_full_hold_s, ...); environment CB_CACHEINDEX_<KEY>\n"
               "  overrides the file.\n");
}

int main(int argc, char **argv) {
    cb_bus_init("cb-cacheindex");
    char err[512];
    int exit_code;
    cb_config_t *cfg = cb_bus_service_config(SECTION, &argc, argv, usage, &exit_code);
    if (!cfg) return exit_code;
    cacheindex_t c = {0};
    cb_bus_service_t *svc = NULL;
    int rc = 1;
    bool gc_on_start;
    char kv_dir[4096];
    if (!cb_config_int(cfg, SECTION, "budget_bytes", 0, INT64_MAX, (int64_t)2 << 30, &c.budget, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_keys", 1, 100000, 256, &c.max_keys, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "gc_min_age_s", 0, 86400 * 365, 60, &c.gc_min_age_s, err, sizeof err) ||
        !cb_config_bool(cfg, SECTION, "gc_on_start", true, &gc_on_start, err, sizeof err) ||
        !cb_config_data_path(cfg, SECTION, "db", "cacheindex.db", c.db_path, sizeof c.db_path, err, sizeof err) ||
        !cb_config_data_path(cfg, SECTION, "kv_dir", "kv", kv_dir, sizeof kv_dir, err, sizeof err) ||
        !(c.disk = cb_diskhealth_from_config(cfg, SECTION, err, sizeof err))) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    cb_diskhealth_watch_file(c.disk, "index database", c.db_path);
    cb_diskhealth_watch(c.disk, "KV dir", kv_dir);
    cb_config_log(cfg, SECTION);
    if (!(c.kv = kvdir_open(kv_dir, err, sizeof err)) || !(c.db = cb_db_open(c.db_path, false, err, sizeof err)) ||
        cb_db_exec(c.db, SCHEMA, err, sizeof err) != 0 || prepare_all(&c, err, sizeof err) != 0) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    if (sqlite3_step(c.count) == SQLITE_ROW) {
        c.total_bytes = sqlite3_column_int64(c.count, 1);
        c.seq = sqlite3_column_int64(c.count, 2);
    }
    sqlite3_reset(c.count);
    cb_log(CB_LOG_INFO, NULL, "database %s: %lld entries, %lld bytes (budget %lld); kv_dir %s", c.db_path,
           (long long)entry_count(&c), (long long)c.total_bytes, (long long)c.budget, kv_dir);
    if (gc_on_start) {
        gc_result_t r;
        if (gc(&c, &r, NULL, err, sizeof err) != 0) cb_log(CB_LOG_WARN, NULL, "gc at start failed: %s", err);
    }
    svc = cb_bus_service_from_config("cb-cacheindex", cfg, SECTION, err, sizeof err);
    if (!svc) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    cb_bus_service_on(svc, "put", on_put, &c);
    cb_bus_service_on(svc, "lookup", on_lookup, &c);
    cb_bus_service_on(svc, "touch", on_touch, &c);
    cb_bus_service_on(svc, "gc", on_gc, &c);
    cb_bus_service_set_stats(svc, stats_extra, &c);
    cb_bus_service_set_disk(svc, c.disk);
    rc = cb_bus_service_run(svc) == 0 ? 0 : 1;
out:
    cb_bus_service_destroy(&svc);
    cacheindex_close(&c);
    cb_diskhealth_destroy(&c.disk);
    cb_config_destroy(&cfg);
    if (rc == 0) cb_log(CB_LOG_INFO, NULL, "bye");
    return rc;
}
