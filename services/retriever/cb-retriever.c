/* cb-retriever: the chunk-text search service. Owns a SQLite database (WAL) with an FTS5 index of
 * chunk text and answers index / delete / search / count / ping / stats (docs/protocol.md §4) on a ROUTER
 * socket. User queries are never passed to FTS5 as syntax: they are split into words, each quoted,
 * OR-ed and ranked by BM25. Its `ping` says `degraded` while the database's disk is full (diskhealth.h).
 *
 * Usage: cb-retriever [--config PATH] [--retriever.KEY=VALUE | --KEY VALUE]...   (see config/cacheblend.cfg)
 * Exit: 0 after SIGINT/SIGTERM, 1 on a startup error.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire/bus.h"
#include "base/alloc.h"
#include "wire/config.h"
#include "wire/db.h"
#include "base/log.h"
#include "wire/msg.h"

#define SECTION "retriever"
#define MAX_QUERY_WORDS 64
#define MAX_DOC_ID 256
#define CHUNK_ID_MIN 16
#define CHUNK_ID_MAX 128

typedef struct {
    sqlite3 *db;
    char db_path[4096];
    int64_t default_k, max_k, max_query_bytes, max_text_bytes;
    sqlite3_stmt *get_chunk, *ins_chunk, *upd_chunk, *ins_link, *del_links_chunk, *del_chunk,
        *del_doc_chunks, *del_doc_links, *search, *count_chunks, *count_docs, *count_doc;
    char *fts; /* scratch for the FTS5 query: [max_query_bytes * 2 + 64] */
    cb_diskhealth_t *disk; /* the database's disk, for ping: ok or degraded (diskhealth.h) */
} retriever_t;

static const char *SCHEMA =
    "CREATE TABLE IF NOT EXISTS chunks(id INTEGER PRIMARY KEY, chunk_id TEXT NOT NULL UNIQUE, text TEXT NOT NULL);"
    "CREATE TABLE IF NOT EXISTS chunk_docs(chunk_id TEXT NOT NULL, doc_id TEXT NOT NULL,"
    "  PRIMARY KEY(chunk_id, doc_id)) WITHOUT ROWID;"
    "CREATE INDEX IF NOT EXISTS chunk_docs_doc ON chunk_docs(doc_id);"
    "CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5(text, content='chunks', content_rowid='id',"
    "  tokenize='porter unicode61 remove_diacritics 2');"
    "CREATE TRIGGER IF NOT EXISTS chunks_ai AFTER INSERT ON chunks BEGIN"
    "  INSERT INTO chunks_fts(rowid, text) VALUES (new.id, new.text); END;"
    "CREATE TRIGGER IF NOT EXISTS chunks_ad AFTER DELETE ON chunks BEGIN"
    "  INSERT INTO chunks_fts(chunks_fts, rowid, text) VALUES ('delete', old.id, old.text); END;"
    "CREATE TRIGGER IF NOT EXISTS chunks_au AFTER UPDATE OF text ON chunks BEGIN"
    "  INSERT INTO chunks_fts(chunks_fts, rowid, text) VALUES ('delete', old.id, old.text);"
    "  INSERT INTO chunks_fts(rowid, text) VALUES (new.id, new.text); END;";

static int prepare_all(retriever_t *r, char *err, size_t errlen) {
    struct {
        sqlite3_stmt **st;
        const char *sql;
    } all[] = {
        {&r->get_chunk, "SELECT id, text FROM chunks WHERE chunk_id = ?1"},
        {&r->ins_chunk, "INSERT INTO chunks(chunk_id, text) VALUES (?1, ?2)"},
        {&r->upd_chunk, "UPDATE chunks SET text = ?2 WHERE id = ?1"},
        {&r->ins_link, "INSERT OR IGNORE INTO chunk_docs(chunk_id, doc_id) VALUES (?1, ?2)"},
        {&r->del_links_chunk, "DELETE FROM chunk_docs WHERE chunk_id = ?1"},
        {&r->del_chunk, "DELETE FROM chunks WHERE chunk_id = ?1"},
        {&r->del_doc_chunks,
         "DELETE FROM chunks WHERE chunk_id IN (SELECT chunk_id FROM chunk_docs WHERE doc_id = ?1)"
         " AND NOT EXISTS (SELECT 1 FROM chunk_docs d WHERE d.chunk_id = chunks.chunk_id AND d.doc_id <> ?1)"},
        {&r->del_doc_links, "DELETE FROM chunk_docs WHERE doc_id = ?1"},
        {&r->search,
         "SELECT c.chunk_id, (SELECT MIN(d.doc_id) FROM chunk_docs d WHERE d.chunk_id = c.chunk_id),"
         " -bm25(chunks_fts), c.text FROM chunks_fts JOIN chunks c ON c.id = chunks_fts.rowid"
         " WHERE chunks_fts MATCH ?1 ORDER BY bm25(chunks_fts) LIMIT ?2"},
        {&r->count_chunks, "SELECT COUNT(*) FROM chunks"},
        {&r->count_docs, "SELECT COUNT(DISTINCT doc_id) FROM chunk_docs"},
        {&r->count_doc, "SELECT COUNT(*) FROM chunk_docs WHERE doc_id = ?1"},
    };
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (!(*all[i].st = cb_db_prepare(r->db, all[i].sql, err, errlen))) return -1;
    return 0;
}

static void retriever_close(retriever_t *r) {
    sqlite3_stmt *all[] = {r->get_chunk, r->ins_chunk, r->upd_chunk, r->ins_link, r->del_links_chunk,
                           r->del_chunk, r->del_doc_chunks, r->del_doc_links, r->search, r->count_chunks,
                           r->count_docs, r->count_doc};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) sqlite3_finalize(all[i]);
    cb_db_close(&r->db);
    free(r->fts);
}

/* Runs a statement that returns no rows; resets it. SQLITE_DONE on success. */
static int step_done(sqlite3_stmt *st) {
    int rc = sqlite3_step(st);
    sqlite3_reset(st);
    return rc;
}

static int64_t count(sqlite3_stmt *st) {
    int64_t n = -1;
    if (sqlite3_step(st) == SQLITE_ROW) n = sqlite3_column_int64(st, 0);
    sqlite3_reset(st);
    return n;
}

/* User text -> FTS5 query: words (runs of ASCII letters/digits and any non-ASCII UTF-8 bytes) are
 * each written as a quoted FTS5 string and OR-ed. Nothing else survives, so FTS5 operators,
 * column filters, prefixes and quotes in user text are inert. Returns the number of words. */
static int fts_query(const char *q, size_t n, char *out, size_t outsz) {
    size_t o = 0;
    int words = 0;
    size_t i = 0;
    out[0] = 0;
    while (i < n && words < MAX_QUERY_WORDS) {
        unsigned char c = (unsigned char)q[i];
        bool wc = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c >= 0x80;
        if (!wc) { i++; continue; }
        size_t j = i;
        while (j < n) {
            unsigned char d = (unsigned char)q[j];
            if (!((d >= 'a' && d <= 'z') || (d >= 'A' && d <= 'Z') || (d >= '0' && d <= '9') || d >= 0x80)) break;
            j++;
        }
        size_t need = (j - i) + 2 + (words ? 4 : 0) + 1;
        if (o + need > outsz) break;
        if (words) { memcpy(out + o, " OR ", 4); o += 4; }
        out[o++] = '"';
        memcpy(out + o, q + i, j - i);
        o += j - i;
        out[o++] = '"';
        out[o] = 0;
        words++;
        i = j;
    }
    return words;
}

static bool get_chunk_id(cb_bus_req_t *req, const cb_msg_t *m, const char **id, size_t *n) {
    if (cb_msg_hex(m, "chunk_id", CHUNK_ID_MIN, CHUNK_ID_MAX, id, n)) return true;
    cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
    return false;
}

static void on_index(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    retriever_t *r = arg;
    const char *cid, *doc, *text;
    size_t ncid, ndoc, ntext;
    if (!get_chunk_id(req, m, &cid, &ncid)) return;
    if (!cb_msg_str(m, "doc_id", MAX_DOC_ID, &doc, &ndoc)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    if (ndoc == 0) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "field 'doc_id': empty");
        return;
    }
    if (!cb_msg_str(m, "text", SIZE_MAX, &text, &ntext)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    if (ntext == 0 || (int64_t)ntext > r->max_text_bytes) {
        cb_bus_reply_error(req, ntext ? CB_ERR_TOO_LARGE : CB_ERR_BAD_REQUEST,
                           "field 'text': %zu bytes (must be 1..%lld)", ntext, (long long)r->max_text_bytes);
        return;
    }
    char err[256];
    bool created = false;
    if (cb_db_exec(r->db, "BEGIN IMMEDIATE", err, sizeof err) != 0) goto fail;
    sqlite3_bind_text(r->get_chunk, 1, cid, (int)ncid, SQLITE_STATIC);
    int rc = sqlite3_step(r->get_chunk);
    if (rc == SQLITE_ROW) {
        int64_t rowid = sqlite3_column_int64(r->get_chunk, 0);
        const void *old = sqlite3_column_blob(r->get_chunk, 1);
        size_t nold = (size_t)sqlite3_column_bytes(r->get_chunk, 1);
        bool same = nold == ntext && (ntext == 0 || memcmp(old, text, ntext) == 0);
        sqlite3_reset(r->get_chunk);
        if (!same) {
            cb_log(CB_LOG_WARN, cb_bus_req_id(req), "chunk %.*s re-indexed with different text", (int)ncid, cid);
            sqlite3_bind_int64(r->upd_chunk, 1, rowid);
            sqlite3_bind_text(r->upd_chunk, 2, text, (int)ntext, SQLITE_STATIC);
            if (step_done(r->upd_chunk) != SQLITE_DONE) goto rollback;
        }
    } else {
        sqlite3_reset(r->get_chunk);
        if (rc != SQLITE_DONE) goto rollback;
        sqlite3_bind_text(r->ins_chunk, 1, cid, (int)ncid, SQLITE_STATIC);
        sqlite3_bind_text(r->ins_chunk, 2, text, (int)ntext, SQLITE_STATIC);
        if (step_done(r->ins_chunk) != SQLITE_DONE) goto rollback;
        created = true;
    }
    sqlite3_bind_text(r->ins_link, 1, cid, (int)ncid, SQLITE_STATIC);
    sqlite3_bind_text(r->ins_link, 2, doc, (int)ndoc, SQLITE_STATIC);
    if (step_done(r->ins_link) != SQLITE_DONE) goto rollback;
    if (cb_db_exec(r->db, "COMMIT", err, sizeof err) != 0) goto rollback_err;
    cb_diskhealth_ok(r->disk, "database");
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_bool(w, "created", created);
    cb_bus_reply(req, w);
    return;
rollback:
    snprintf(err, sizeof err, "SQLite: %s", sqlite3_errmsg(r->db));
rollback_err:
    {
        char e2[128];
        cb_db_exec(r->db, "ROLLBACK", e2, sizeof e2);
    }
fail:
    cb_diskhealth_note(r->disk, "database", err); /* SQLITE_FULL: ping says degraded */
    cb_bus_reply_error(req, CB_ERR_INTERNAL, "index failed: %s", err);
}

static void on_delete(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    retriever_t *r = arg;
    bool by_chunk = cb_msg_has(m, "chunk_id"), by_doc = cb_msg_has(m, "doc_id");
    if (by_chunk == by_doc) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "delete needs exactly one of 'chunk_id' or 'doc_id'");
        return;
    }
    const char *key;
    size_t n;
    if (by_chunk) {
        if (!get_chunk_id(req, m, &key, &n)) return;
    } else {
        if (!cb_msg_str(m, "doc_id", MAX_DOC_ID, &key, &n)) {
            cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
            return;
        }
        if (n == 0) {
            cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "field 'doc_id': empty");
            return;
        }
    }
    char err[256];
    int64_t deleted = 0;
    if (cb_db_exec(r->db, "BEGIN IMMEDIATE", err, sizeof err) != 0) {
        cb_diskhealth_note(r->disk, "database", err);
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "delete failed: %s", err);
        return;
    }
    sqlite3_stmt *first = by_chunk ? r->del_links_chunk : r->del_doc_chunks;
    sqlite3_stmt *second = by_chunk ? r->del_chunk : r->del_doc_links;
    sqlite3_bind_text(first, 1, key, (int)n, SQLITE_STATIC);
    int rc = step_done(first);
    if (rc == SQLITE_DONE && !by_chunk) deleted = sqlite3_changes(r->db);
    if (rc == SQLITE_DONE) {
        sqlite3_bind_text(second, 1, key, (int)n, SQLITE_STATIC);
        rc = step_done(second);
        if (rc == SQLITE_DONE && by_chunk) deleted = sqlite3_changes(r->db);
    }
    if (rc != SQLITE_DONE || cb_db_exec(r->db, "COMMIT", err, sizeof err) != 0) {
        if (rc != SQLITE_DONE) snprintf(err, sizeof err, "SQLite: %s", sqlite3_errmsg(r->db));
        char e2[128];
        cb_db_exec(r->db, "ROLLBACK", e2, sizeof e2);
        cb_diskhealth_note(r->disk, "database", err);
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "delete failed: %s", err);
        return;
    }
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_int(w, "deleted", deleted);
    cb_bus_reply(req, w);
}

/* count {doc_id} -> {chunks}: how many chunks the document holds (cb-precompute checks a re-ingested
 * document with it). A document that is not there has 0. */
static void on_count(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    retriever_t *r = arg;
    const char *doc;
    size_t n;
    if (!cb_msg_str(m, "doc_id", MAX_DOC_ID, &doc, &n)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    if (n == 0) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "field 'doc_id': empty");
        return;
    }
    sqlite3_bind_text(r->count_doc, 1, doc, (int)n, SQLITE_STATIC);
    int64_t c = count(r->count_doc);
    if (c < 0) {
        cb_bus_reply_error(req, CB_ERR_INTERNAL, "count failed: SQLite: %s", sqlite3_errmsg(r->db));
        return;
    }
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    cb_msg_begin_reply(w, m);
    cb_msg_put_int(w, "chunks", c);
    cb_bus_reply(req, w);
}

static void on_search(cb_bus_service_t *svc, cb_bus_req_t *req, const cb_msg_t *m, void *arg) {
    retriever_t *r = arg;
    const char *q;
    size_t nq;
    int64_t k;
    if (!cb_msg_str(m, "query", SIZE_MAX, &q, &nq)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    if (nq == 0 || (int64_t)nq > r->max_query_bytes) {
        cb_bus_reply_error(req, nq ? CB_ERR_TOO_LARGE : CB_ERR_BAD_REQUEST, "field 'query': %zu bytes (must be 1..%lld)",
                           nq, (long long)r->max_query_bytes);
        return;
    }
    if (!cb_msg_int_or(m, "k", 1, r->max_k, r->default_k, &k)) {
        cb_bus_reply_error(req, CB_ERR_BAD_REQUEST, "%s", cb_msg_last_error(m));
        return;
    }
    cb_msg_writer_t *w = cb_bus_service_writer(svc);
    int words = fts_query(q, nq, r->fts, (size_t)r->max_query_bytes * 2 + 64);
    cb_msg_begin_reply(w, m);
    cb_msg_begin_array(w, "hits");
    if (words > 0) {
        sqlite3_bind_text(r->search, 1, r->fts, -1, SQLITE_STATIC);
        sqlite3_bind_int64(r->search, 2, k);
        int rc;
        while ((rc = sqlite3_step(r->search)) == SQLITE_ROW) {
            cb_msg_begin_map(w, NULL);
            cb_msg_put_strn(w, "chunk_id", (const char *)sqlite3_column_text(r->search, 0),
                            (size_t)sqlite3_column_bytes(r->search, 0));
            const char *doc = (const char *)sqlite3_column_text(r->search, 1);
            cb_msg_put_strn(w, "doc_id", doc ? doc : "", doc ? (size_t)sqlite3_column_bytes(r->search, 1) : 0);
            cb_msg_put_double(w, "score", sqlite3_column_double(r->search, 2));
            cb_msg_put_strn(w, "text", (const char *)sqlite3_column_text(r->search, 3),
                            (size_t)sqlite3_column_bytes(r->search, 3));
            cb_msg_end_map(w);
        }
        char why[256];
        snprintf(why, sizeof why, "%s", sqlite3_errmsg(r->db));
        sqlite3_reset(r->search);
        if (rc != SQLITE_DONE) {
            /* with quoted words a syntax error should not happen; if it does it is the query's fault */
            bool syntax = (rc & 0xff) == SQLITE_ERROR;
            cb_bus_reply_error(req, syntax ? CB_ERR_BAD_REQUEST : CB_ERR_INTERNAL, "search failed: %s", why);
            return;
        }
    }
    cb_msg_end_array(w);
    cb_bus_reply(req, w);
}

static void stats_extra(cb_bus_service_t *svc, cb_msg_writer_t *w, void *arg) {
    (void)svc;
    retriever_t *r = arg;
    cb_msg_put_int(w, "chunks", count(r->count_chunks));
    cb_msg_put_int(w, "docs", count(r->count_docs));
    cb_msg_put_int(w, "db_bytes", cb_db_file_bytes(r->db_path));
}

static void usage(FILE *f) {
    fprintf(f, "usage: cb-retriever [--config PATH] [--retriever.KEY=VALUE | --KEY VALUE]...\n"
               "  Serves index/delete/search/ping/stats (docs/protocol.md) on retriever.endpoint.\n"
               "  Keys: endpoint, bind, db, default_k, max_k, max_query_bytes, max_text_bytes, and common.*\n"
               "  (min_free_mb, disk_full_hold_s, ...: config/cacheblend.cfg); environment CB_RETRIEVER_<KEY>\n"
               "  overrides the file.\n");
}

int main(int argc, char **argv) {
    cb_bus_init("cb-retriever");
    char err[512];
    int exit_code;
    cb_config_t *cfg = cb_bus_service_config(SECTION, &argc, argv, usage, &exit_code);
    if (!cfg) return exit_code;
    retriever_t r = {0};
    cb_bus_service_t *svc = NULL;
    int rc = 1;
    if (!cb_config_int(cfg, SECTION, "max_k", 1, 1000, 50, &r.max_k, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "default_k", 1, r.max_k, 5 < r.max_k ? 5 : r.max_k, &r.default_k, err,
                       sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_query_bytes", 1, 1 << 20, 4096, &r.max_query_bytes, err, sizeof err) ||
        !cb_config_int(cfg, SECTION, "max_text_bytes", 1, 64 << 20, 256 << 10, &r.max_text_bytes, err, sizeof err) ||
        !cb_config_data_path(cfg, SECTION, "db", "retriever.db", r.db_path, sizeof r.db_path, err, sizeof err) ||
        !(r.disk = cb_diskhealth_from_config(cfg, SECTION, err, sizeof err))) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    cb_diskhealth_watch_file(r.disk, "database", r.db_path);
    cb_config_log(cfg, SECTION);
    r.fts = cb_malloc((size_t)r.max_query_bytes * 2 + 64);
    if (!r.fts) {
        cb_log(CB_LOG_ERROR, NULL, "out of memory");
        goto out;
    }
    if (!(r.db = cb_db_open(r.db_path, false, err, sizeof err)) || cb_db_exec(r.db, SCHEMA, err, sizeof err) != 0 ||
        prepare_all(&r, err, sizeof err) != 0) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    cb_log(CB_LOG_INFO, NULL, "database %s: %lld chunks", r.db_path, (long long)count(r.count_chunks));
    svc = cb_bus_service_from_config("cb-retriever", cfg, SECTION, err, sizeof err);
    if (!svc) {
        cb_log(CB_LOG_ERROR, NULL, "%s", err);
        goto out;
    }
    cb_bus_service_on(svc, "index", on_index, &r);
    cb_bus_service_on(svc, "delete", on_delete, &r);
    cb_bus_service_on(svc, "search", on_search, &r);
    cb_bus_service_on(svc, "count", on_count, &r);
    cb_bus_service_set_stats(svc, stats_extra, &r);
    cb_bus_service_set_disk(svc, r.disk);
    rc = cb_bus_service_run(svc) == 0 ? 0 : 1;
out:
    cb_bus_service_destroy(&svc);
    retriever_close(&r);
    cb_diskhealth_destroy(&r.disk);
    cb_config_destroy(&cfg);
    if (rc == 0) cb_log(CB_LOG_INFO, NULL, "bye");
    return rc;
}
