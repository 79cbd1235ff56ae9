/* db: small SQLite helpers shared by the services that own a database (cb-retriever, cb-cacheindex,
 * cb-precompute): open with WAL, a busy timeout and a startup integrity check; run SQL scripts;
 * create directories; measure the database's files.
 *
 * The rules: one writer process per database; WAL (never on a network filesystem); never
 * delete -wal/-shm by hand; `synchronous=NORMAL` where a lost last commit only costs a recompute
 * (cache index, retrieval), `FULL` where an acknowledgement must survive power loss (ingest queue).
 */
#ifndef CB_DB_H
#define CB_DB_H

#include <sqlite3.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Opens (creating it and its parent directories) the database at path with journal_mode=WAL,
 * synchronous FULL (full_sync) or NORMAL, foreign_keys on, busy_timeout 5000 ms, then runs
 * `PRAGMA quick_check`. Returns the handle (caller closes with cb_db_close) or NULL with err. */
sqlite3 *cb_db_open(const char *path, bool full_sync, char *err, size_t errlen);
/* Closes (finalizing nothing: finalize your statements first); NULL-safe; nulls *db_p. */
void cb_db_close(sqlite3 **db_p);
/* Runs one or more SQL statements without results. 0, or -1 with err (SQLite's message). */
int cb_db_exec(sqlite3 *db, const char *sql, char *err, size_t errlen);
/* Prepares a statement; NULL with err naming the SQL's start on failure. */
sqlite3_stmt *cb_db_prepare(sqlite3 *db, const char *sql, char *err, size_t errlen);
/* Bytes of the database file plus its -wal file (0 for missing files). */
int64_t cb_db_file_bytes(const char *path);
/* mkdir -p of dir (mode 0755). 0, or -1 with err. */
int cb_db_mkdirs(const char *dir, char *err, size_t errlen);

#endif
