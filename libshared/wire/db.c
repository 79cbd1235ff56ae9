/* db: SQLite open/exec helpers with WAL and an integrity check. See db.h. */
#include "wire/db.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int cb_db_mkdirs(const char *dir, char *err, size_t errlen) {
    char buf[4096];
    if (!dir || !*dir) return 0;
    if (strlen(dir) >= sizeof buf) {
        snprintf(err, errlen, "path too long: %.64s...", dir);
        return -1;
    }
    strcpy(buf, dir);
    for (char *p = buf + 1; ; p++) {
        if (*p == '/' || *p == 0) {
            char c = *p;
            *p = 0;
            if (mkdir(buf, 0755) != 0 && errno != EEXIST) {
                snprintf(err, errlen, "cannot create directory %s: %s", buf, strerror(errno));
                return -1;
            }
            struct stat st;
            if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode)) {
                snprintf(err, errlen, "%s is not a directory", buf);
                return -1;
            }
            *p = c;
            if (!c) break;
        }
    }
    return 0;
}

int cb_db_exec(sqlite3 *db, const char *sql, char *err, size_t errlen) {
    char *msg = NULL;
    if (sqlite3_exec(db, sql, NULL, NULL, &msg) != SQLITE_OK) {
        snprintf(err, errlen, "SQLite: %s", msg ? msg : sqlite3_errmsg(db));
        sqlite3_free(msg);
        return -1;
    }
    return 0;
}

sqlite3_stmt *cb_db_prepare(sqlite3 *db, const char *sql, char *err, size_t errlen) {
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK) {
        snprintf(err, errlen, "SQLite: %s (in: %.60s)", sqlite3_errmsg(db), sql);
        sqlite3_finalize(st);
        return NULL;
    }
    return st;
}

void cb_db_close(sqlite3 **db_p) {
    if (!db_p || !*db_p) return;
    sqlite3_close_v2(*db_p);
    *db_p = NULL;
}

sqlite3 *cb_db_open(const char *path, bool full_sync, char *err, size_t errlen) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = 0;
        if (cb_db_mkdirs(dir, err, errlen) != 0) return NULL;
    }
    sqlite3 *db = NULL;
    int rc = sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, NULL);
    if (rc != SQLITE_OK) {
        snprintf(err, errlen, "cannot open database %s: %s", path, db ? sqlite3_errmsg(db) : sqlite3_errstr(rc));
        sqlite3_close_v2(db);
        return NULL;
    }
    sqlite3_busy_timeout(db, 5000);
    sqlite3_extended_result_codes(db, 1);
    char e2[256];
    const char *sync = full_sync ? "PRAGMA synchronous=FULL;" : "PRAGMA synchronous=NORMAL;";
    if (cb_db_exec(db, "PRAGMA journal_mode=WAL; PRAGMA foreign_keys=ON;", e2, sizeof e2) != 0 ||
        cb_db_exec(db, sync, e2, sizeof e2) != 0) {
        snprintf(err, errlen, "database %s: %s", path, e2);
        sqlite3_close_v2(db);
        return NULL;
    }
    sqlite3_stmt *st = cb_db_prepare(db, "PRAGMA quick_check", e2, sizeof e2);
    if (!st) {
        snprintf(err, errlen, "database %s: %s", path, e2);
        sqlite3_close_v2(db);
        return NULL;
    }
    bool ok = sqlite3_step(st) == SQLITE_ROW && sqlite3_column_text(st, 0) &&
              strcmp((const char *)sqlite3_column_text(st, 0), "ok") == 0;
    if (!ok)
        snprintf(err, errlen, "database %s failed its integrity check (%s): move it away to start afresh", path,
                 sqlite3_column_text(st, 0) ? (const char *)sqlite3_column_text(st, 0) : sqlite3_errmsg(db));
    sqlite3_finalize(st);
    if (!ok) {
        sqlite3_close_v2(db);
        return NULL;
    }
    return db;
}

int64_t cb_db_file_bytes(const char *path) {
    struct stat st;
    int64_t total = 0;
    char wal[4096];
    if (stat(path, &st) == 0) total += st.st_size;
    snprintf(wal, sizeof wal, "%s-wal", path);
    if (stat(wal, &st) == 0) total += st.st_size;
    return total;
}
