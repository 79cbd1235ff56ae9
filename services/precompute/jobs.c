/* jobs.c: cb-precompute's durable job queue in SQLite (see jobs.h). */
#include "jobs.h"
#include "base/alloc.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "wire/db.h"

static const char SCHEMA[] =
    "CREATE TABLE IF NOT EXISTS jobs("
    "  seq INTEGER PRIMARY KEY,"          /* queue order (a requeued job moves to the end) */
    "  job TEXT NOT NULL UNIQUE,"
    "  doc_id TEXT NOT NULL,"
    "  text TEXT NOT NULL,"
    "  meta TEXT,"
    "  state INTEGER NOT NULL DEFAULT 0," /* cb_job_state_t */
    "  planned INTEGER NOT NULL DEFAULT 0,"
    "  replaced INTEGER NOT NULL DEFAULT 0,"
    "  chunks_total INTEGER NOT NULL DEFAULT 0,"
    "  chunks_done INTEGER NOT NULL DEFAULT 0,"
    "  error TEXT,"
    "  created REAL NOT NULL,"
    "  updated REAL NOT NULL,"
    "  client TEXT NOT NULL DEFAULT '',"  /* who submitted it (fairness, per-client limits) */
    "  text_bytes INTEGER NOT NULL DEFAULT 0,"
    "  lease_owner TEXT,"                 /* who holds (or last held) the job: "local" or "r:" + worker name */
    "  lease_token TEXT,"                 /* the holder's token (kept after finish: a resent finish is idempotent) */
    "  lease_until INTEGER NOT NULL DEFAULT 0);" /* ms since the epoch (this host's clock); 0 = not leased */
    "CREATE INDEX IF NOT EXISTS jobs_doc ON jobs(doc_id, seq);"
    "CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, seq);"
    "CREATE TABLE IF NOT EXISTS chunks("
    "  job TEXT NOT NULL,"
    "  idx INTEGER NOT NULL,"
    "  off INTEGER NOT NULL,"
    "  len INTEGER NOT NULL,"
    "  key TEXT NOT NULL,"
    "  tokens INTEGER NOT NULL,"
    "  done INTEGER NOT NULL DEFAULT 0,"
    "  PRIMARY KEY(job, idx)) WITHOUT ROWID;";

/* A job is ready for a turn when it is queued or running, no older unfinished version of its document
 * exists, it is under no live lease (:now, ms) but maybe one of :self's own (the local worker's, see
 * pick()), and its text is at most :maxb bytes (alias j). */
#define READY "j.state IN (0, 1) AND NOT EXISTS (SELECT 1 FROM jobs o WHERE o.doc_id = j.doc_id AND o.state IN (0, 1) " \
              "AND o.seq < j.seq) AND (j.lease_until <= :now OR j.lease_owner = :self) AND j.text_bytes <= :maxb"

struct cb_jobs {
    sqlite3 *db;
    sqlite3_stmt *find, *latest, *insert, *requeue, *drop_chunks, *status, *counts, *chunk_sum, *get, *mark_running,
        *older, *plan_chunk, *plan_job, *chunks, *chunk_done, *job_done_inc, *replaced, *finish, *client_load,
        *total_load, *pick_after, *pick_first, *pick_job, *next_chunk, *clients, *owner_leases, *lease_row, *lease_set,
        *lease_renew, *lease_replaced, *lease_release, *release_owner, *lease_counts, *chunk_row, *chunks_left,
        *lease_finish;
};

/* Tests move the clock (the file is included by tests/unit/test_jobs.c). */
static int64_t s_clock_skew_ms = 0;

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000 + (int64_t)(t.tv_nsec / 1000000) + s_clock_skew_ms;
}

/* Binds :now (and :maxb when present) of s. */
static void bind_now(sqlite3_stmt *s, int64_t maxb) {
    int i = sqlite3_bind_parameter_index(s, ":now");
    if (i > 0) sqlite3_bind_int64(s, i, now_ms());
    if ((i = sqlite3_bind_parameter_index(s, ":maxb")) > 0) sqlite3_bind_int64(s, i, maxb);
    if ((i = sqlite3_bind_parameter_index(s, ":self")) > 0) sqlite3_bind_null(s, i); /* = NULL: never true */
}

/* :self of a pick (after bind_now): owner, whose own live leases do not keep it from a job. */
static void bind_self(sqlite3_stmt *s, const char *owner) {
    int i = sqlite3_bind_parameter_index(s, ":self");
    if (i > 0 && owner) sqlite3_bind_text(s, i, owner, -1, SQLITE_TRANSIENT);
}

static const char *const STATE_NAMES[CB_JOB_STATE_COUNT_] = {"queued", "running", "done", "failed"};

const char *cb_job_state_name(cb_job_state_t s) {
    return (unsigned)s < CB_JOB_STATE_COUNT_ ? STATE_NAMES[s] : "unknown";
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int db_fail(cb_jobs_t *j, char *err, size_t errlen, const char *what) {
    snprintf(err, errlen, "jobs: %s: %s", what, sqlite3_errmsg(j->db));
    return -1;
}

void cb_jobs_close(cb_jobs_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_jobs_t *j = *self_p;
    sqlite3_stmt **all[] = {&j->find,       &j->latest,     &j->insert,     &j->requeue,    &j->drop_chunks,
                            &j->status,     &j->counts,     &j->chunk_sum,  &j->get,        &j->mark_running,
                            &j->older,      &j->plan_chunk, &j->plan_job,   &j->chunks,     &j->chunk_done,
                            &j->job_done_inc, &j->replaced, &j->finish,     &j->client_load, &j->total_load, &j->pick_after,
                            &j->pick_first, &j->pick_job,   &j->next_chunk, &j->clients,
                            &j->owner_leases, &j->lease_row, &j->lease_set, &j->lease_renew, &j->lease_replaced,
                            &j->lease_release, &j->release_owner, &j->lease_counts, &j->chunk_row,
                            &j->chunks_left, &j->lease_finish};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) sqlite3_finalize(*all[i]);
    cb_db_close(&j->db);
    free(j);
    *self_p = NULL;
}

/* A table made before the client columns existed gets them (its jobs belong to client "", their sizes are
 * measured); then the index the turn picking uses. 0 or -1. */
static int migrate(cb_jobs_t *j, char *err, size_t errlen) {
    sqlite3_stmt *st = cb_db_prepare(j->db, "SELECT count(*) FROM pragma_table_info('jobs') WHERE name = 'client'",
                                     err, errlen);
    if (!st) return -1;
    int has = sqlite3_step(st) == SQLITE_ROW && sqlite3_column_int(st, 0) > 0;
    sqlite3_finalize(st);
    if (!has && cb_db_exec(j->db,
                           "BEGIN IMMEDIATE;"
                           "ALTER TABLE jobs ADD COLUMN client TEXT NOT NULL DEFAULT '';"
                           "ALTER TABLE jobs ADD COLUMN text_bytes INTEGER NOT NULL DEFAULT 0;"
                           "UPDATE jobs SET text_bytes = length(CAST(text AS BLOB));"
                           "COMMIT;",
                           err, errlen) != 0) {
        cb_db_exec(j->db, "ROLLBACK", NULL, 0);
        /* another connection may have done it meanwhile */
        st = cb_db_prepare(j->db, "SELECT count(*) FROM pragma_table_info('jobs') WHERE name = 'client'", err, errlen);
        has = st && sqlite3_step(st) == SQLITE_ROW && sqlite3_column_int(st, 0) > 0;
        sqlite3_finalize(st);
        if (!has) return -1;
    }
    /* jobs_load covers the global cap's count and sum (no row is read for them) */
    if (cb_db_exec(j->db, "CREATE INDEX IF NOT EXISTS jobs_client ON jobs(state, client, seq);"
                          "CREATE INDEX IF NOT EXISTS jobs_load ON jobs(state, text_bytes);", err, errlen) != 0)
        return -1;
    /* the lease columns (a table made before leases: nothing is leased) */
    st = cb_db_prepare(j->db, "SELECT count(*) FROM pragma_table_info('jobs') WHERE name = 'lease_until'", err, errlen);
    if (!st) return -1;
    has = sqlite3_step(st) == SQLITE_ROW && sqlite3_column_int(st, 0) > 0;
    sqlite3_finalize(st);
    if (!has && cb_db_exec(j->db,
                           "BEGIN IMMEDIATE;"
                           "ALTER TABLE jobs ADD COLUMN lease_owner TEXT;"
                           "ALTER TABLE jobs ADD COLUMN lease_token TEXT;"
                           "ALTER TABLE jobs ADD COLUMN lease_until INTEGER NOT NULL DEFAULT 0;"
                           "COMMIT;",
                           err, errlen) != 0) {
        cb_db_exec(j->db, "ROLLBACK", NULL, 0);
        st = cb_db_prepare(j->db, "SELECT count(*) FROM pragma_table_info('jobs') WHERE name = 'lease_until'", err,
                           errlen);
        has = st && sqlite3_step(st) == SQLITE_ROW && sqlite3_column_int(st, 0) > 0;
        sqlite3_finalize(st);
        if (!has) return -1;
    }
    return 0;
}

cb_jobs_t *cb_jobs_open(const char *path, char *err, size_t errlen) {
    cb_jobs_t *j = cb_calloc(1, sizeof *j);
    if (!j) {
        snprintf(err, errlen, "jobs: out of memory");
        return NULL;
    }
    if (!(j->db = cb_db_open(path, true, err, errlen)) || cb_db_exec(j->db, SCHEMA, err, errlen) != 0 ||
        migrate(j, err, errlen) != 0)
        goto fail;
#define PREP(field, sql) \
    if (!(j->field = cb_db_prepare(j->db, sql, err, errlen))) goto fail
    PREP(find, "SELECT seq, state, doc_id, text_bytes FROM jobs WHERE job = ?1");
    PREP(latest, "SELECT max(seq) FROM jobs WHERE doc_id = ?1");
    PREP(insert, "INSERT INTO jobs(job, doc_id, text, meta, state, created, updated, client, text_bytes) "
                 "VALUES(?1, ?2, ?3, ?4, 0, ?5, ?5, ?6, ?7)");
    PREP(requeue, "UPDATE jobs SET seq = (SELECT max(seq) + 1 FROM jobs), state = 0, planned = 0, replaced = 0, "
                  "chunks_total = 0, chunks_done = 0, error = NULL, updated = ?2, client = ?3, lease_token = NULL, "
                  "lease_until = 0 WHERE job = ?1");
    PREP(drop_chunks, "DELETE FROM chunks WHERE job = ?1");
    PREP(status, "SELECT state, chunks_done, chunks_total, coalesce(error, ''), doc_id, coalesce(lease_owner, '') "
                 "FROM jobs WHERE job = ?1");
    PREP(counts, "SELECT state, count(*) FROM jobs GROUP BY state");
    PREP(chunk_sum, "SELECT coalesce(sum(chunks_done), 0) FROM jobs");
    PREP(get, "SELECT seq, job, doc_id, text, planned, replaced, client, chunks_done, chunks_total, "
              "coalesce(lease_token, '') FROM jobs "
              "WHERE job = ?1 AND state IN (0, 1)");
    PREP(mark_running, "UPDATE jobs SET state = 1, updated = ?2 WHERE job = ?1 AND state = 0");
    PREP(client_load, "SELECT count(*), coalesce(sum(text_bytes), 0) FROM jobs WHERE state IN (0, 1) AND client = ?1");
    PREP(total_load, "SELECT count(*), coalesce(sum(text_bytes), 0) FROM jobs WHERE state IN (0, 1)");
    /* ?1 comes first in the text: a named parameter before it would take index 1 */
    PREP(pick_after, "SELECT j.client FROM jobs j WHERE j.client > ?1 AND " READY " ORDER BY j.client LIMIT 1");
    PREP(pick_first, "SELECT j.client FROM jobs j WHERE " READY " ORDER BY j.client LIMIT 1");
    PREP(pick_job, "SELECT j.job FROM jobs j WHERE j.client = ?1 AND " READY " ORDER BY j.seq LIMIT 1");
    PREP(next_chunk, "SELECT idx, off, len, key, tokens FROM chunks WHERE job = ?1 AND done = 0 ORDER BY idx LIMIT 1");
    PREP(clients, "SELECT count(DISTINCT client) FROM jobs WHERE state IN (0, 1)");
    PREP(older, "SELECT EXISTS(SELECT 1 FROM jobs WHERE doc_id = ?1 AND seq < ?2)");
    PREP(owner_leases, "SELECT count(*) FROM jobs WHERE lease_owner = ?1 AND state IN (0, 1) AND lease_until > :now");
    PREP(lease_row, "SELECT state, coalesce(lease_token, ''), lease_until, planned, chunks_total FROM jobs WHERE job = ?1");
    PREP(lease_set, "UPDATE jobs SET lease_owner = ?2, lease_token = ?3, lease_until = ?4, state = 1, updated = ?5 "
                    "WHERE job = ?1");
    PREP(lease_renew, "UPDATE jobs SET lease_until = ?3 WHERE job = ?1 AND lease_token = ?2 AND state IN (0, 1)");
    PREP(lease_replaced, "UPDATE jobs SET replaced = 1, lease_until = ?3, updated = ?4 WHERE job = ?1 AND "
                         "lease_token = ?2 AND state IN (0, 1)");
    PREP(lease_release, "UPDATE jobs SET lease_until = 0 WHERE job = ?1 AND lease_token = ?2 AND state IN (0, 1)");
    PREP(release_owner, "UPDATE jobs SET lease_until = 0 WHERE lease_owner = ?1 AND lease_until > 0");
    PREP(lease_counts, "SELECT coalesce(sum(lease_until > :now), 0), coalesce(sum(lease_until > 0 AND "
                       "lease_until <= :now), 0) FROM jobs WHERE state IN (0, 1)");
    PREP(chunk_row, "SELECT done FROM chunks WHERE job = ?1 AND idx = ?2");
    PREP(chunks_left, "SELECT count(*) FROM chunks WHERE job = ?1 AND done = 0");
    PREP(lease_finish, "UPDATE jobs SET state = ?2, error = ?3, updated = ?4, lease_until = 0 WHERE job = ?1");
    PREP(plan_chunk, "INSERT OR REPLACE INTO chunks(job, idx, off, len, key, tokens, done) VALUES(?1, ?2, ?3, ?4, ?5, ?6, 0)");
    PREP(plan_job, "UPDATE jobs SET planned = 1, chunks_total = ?2, chunks_done = 0, updated = ?3 WHERE job = ?1");
    PREP(chunks, "SELECT idx, off, len, key, tokens, done FROM chunks WHERE job = ?1 ORDER BY idx");
    PREP(chunk_done, "UPDATE chunks SET done = 1 WHERE job = ?1 AND idx = ?2 AND done = 0");
    PREP(job_done_inc, "UPDATE jobs SET chunks_done = chunks_done + 1, updated = ?2 WHERE job = ?1");
    PREP(replaced, "UPDATE jobs SET replaced = 1, updated = ?2 WHERE job = ?1");
    PREP(finish, "UPDATE jobs SET state = ?2, error = ?3, updated = ?4 WHERE job = ?1");
#undef PREP
    return j;
fail:
    cb_jobs_close(&j);
    return NULL;
}

void cb_jobs_id(const char *doc_id, size_t doc_len, const char *text, size_t text_len, char job[CB_JOB_ID_LEN + 1]) {
    crypto_generichash_state st;
    unsigned char h[CB_JOB_ID_LEN / 2];
    uint8_t lenle[4] = {(uint8_t)doc_len, (uint8_t)(doc_len >> 8), (uint8_t)(doc_len >> 16), (uint8_t)(doc_len >> 24)};
    crypto_generichash_init(&st, NULL, 0, sizeof h);
    crypto_generichash_update(&st, (const unsigned char *)"cb-job-v1", 9);
    crypto_generichash_update(&st, lenle, 4);
    crypto_generichash_update(&st, (const unsigned char *)doc_id, doc_len);
    crypto_generichash_update(&st, (const unsigned char *)text, text_len);
    crypto_generichash_final(&st, h, sizeof h);
    for (size_t i = 0; i < sizeof h; i++) snprintf(job + 2 * i, 3, "%02x", h[i]);
}

static int exec_simple(cb_jobs_t *j, const char *sql, char *err, size_t errlen) {
    return cb_db_exec(j->db, sql, err, errlen);
}

/* Within a transaction: 0 when the queue may take one more job of bytes bytes (the global cap), 1 (err)
 * when that would take it over lim, -1 on a database error. */
static int check_total(cb_jobs_t *self, const cb_jobs_limits_t *lim, int64_t bytes, char *err, size_t errlen) {
    if (lim->max_total_jobs <= 0 && lim->max_total_bytes <= 0) return 0;
    sqlite3_stmt *s = self->total_load;
    int rc = sqlite3_step(s);
    int64_t n = rc == SQLITE_ROW ? sqlite3_column_int64(s, 0) : 0, have = rc == SQLITE_ROW ? sqlite3_column_int64(s, 1) : 0;
    sqlite3_reset(s);
    if (rc != SQLITE_ROW) return db_fail(self, err, errlen, "queue load");
    if (n == 0) return 0; /* an empty queue takes one document; max_doc_bytes bounds it */
    if (lim->max_total_jobs > 0 && n + 1 > lim->max_total_jobs) {
        snprintf(err, errlen, "the ingest queue is full: %lld documents queued (precompute.max_queued_jobs = %lld); "
                 "retry when some are done", (long long)n, (long long)lim->max_total_jobs);
        return 1;
    }
    if (lim->max_total_bytes > 0 && have + bytes > lim->max_total_bytes) {
        snprintf(err, errlen, "the ingest queue is full: %lld bytes queued, %lld more would exceed "
                 "precompute.max_queued_bytes (%lld); retry when some are done", (long long)have, (long long)bytes,
                 (long long)lim->max_total_bytes);
        return 1;
    }
    return 0;
}

/* Within a transaction: 0 when client may queue one more job of bytes bytes, 1 (err) when that would take
 * it or the whole queue over lim, -1 on a database error. */
static int check_limits(cb_jobs_t *self, const char *client, const cb_jobs_limits_t *lim, int64_t bytes, char *err,
                        size_t errlen) {
    if (!lim) return 0;
    int t = check_total(self, lim, bytes, err, errlen);
    if (t != 0 || (lim->max_jobs <= 0 && lim->max_bytes <= 0)) return t;
    sqlite3_stmt *s = self->client_load;
    sqlite3_bind_text(s, 1, client, -1, SQLITE_STATIC);
    int rc = sqlite3_step(s);
    int64_t n = rc == SQLITE_ROW ? sqlite3_column_int64(s, 0) : 0, have = rc == SQLITE_ROW ? sqlite3_column_int64(s, 1) : 0;
    sqlite3_reset(s);
    if (rc != SQLITE_ROW) return db_fail(self, err, errlen, "client load");
    if (n == 0) return 0; /* one document is always let through; max_doc_bytes bounds it */
    if (lim->max_jobs > 0 && n + 1 > lim->max_jobs) {
        snprintf(err, errlen, "this client has %lld documents queued (precompute.max_queued_jobs_per_client = %lld); "
                 "retry when some are done", (long long)n, (long long)lim->max_jobs);
        return 1;
    }
    if (lim->max_bytes > 0 && have + bytes > lim->max_bytes) {
        snprintf(err, errlen, "this client has %lld bytes queued, %lld more would exceed "
                 "precompute.max_queued_bytes_per_client (%lld); retry when some are done", (long long)have,
                 (long long)bytes, (long long)lim->max_bytes);
        return 1;
    }
    return 0;
}

/* Within a transaction: queues job again for client (at the end of the queue, its chunks dropped). 0 or -1. */
static int requeue(cb_jobs_t *self, const char *job, const char *client, char *err, size_t errlen) {
    sqlite3_bind_text(self->requeue, 1, job, CB_JOB_ID_LEN, SQLITE_STATIC);
    sqlite3_bind_double(self->requeue, 2, now_s());
    sqlite3_bind_text(self->requeue, 3, client, -1, SQLITE_STATIC);
    sqlite3_bind_text(self->drop_chunks, 1, job, CB_JOB_ID_LEN, SQLITE_STATIC);
    int rc = sqlite3_step(self->requeue) == SQLITE_DONE && sqlite3_step(self->drop_chunks) == SQLITE_DONE ? 0 : -1;
    if (rc) db_fail(self, err, errlen, "requeue");
    sqlite3_reset(self->requeue);
    sqlite3_reset(self->drop_chunks);
    return rc;
}

/* Ends the open transaction: COMMIT when rc is 0, else ROLLBACK; returns rc (or -1 when COMMIT failed). */
static int end_tx(cb_jobs_t *self, int rc, char *err, size_t errlen) {
    if (rc == 0 && exec_simple(self, "COMMIT", err, errlen) == 0) return 0;
    exec_simple(self, "ROLLBACK", NULL, 0);
    return rc == 0 ? -1 : rc;
}

int cb_jobs_submit(cb_jobs_t *self, const char *doc_id, size_t doc_len, const char *text, size_t text_len,
                   const char *meta_json, const char *client, const cb_jobs_limits_t *lim,
                   char job[CB_JOB_ID_LEN + 1], bool *duplicate, cb_job_state_t *state, char *err, size_t errlen) {
    cb_jobs_id(doc_id, doc_len, text, text_len, job);
    *duplicate = false;
    if (!client) client = "";
    if (exec_simple(self, "BEGIN IMMEDIATE", err, errlen) != 0) return -1;
    sqlite3_stmt *f = self->find;
    sqlite3_bind_text(f, 1, job, CB_JOB_ID_LEN, SQLITE_STATIC);
    int rc = sqlite3_step(f), out = 0;
    if (rc == SQLITE_ROW) {
        int64_t seq = sqlite3_column_int64(f, 0);
        int st = sqlite3_column_int(f, 1);
        sqlite3_reset(f);
        sqlite3_bind_text(self->latest, 1, doc_id, (int)doc_len, SQLITE_STATIC);
        int64_t latest = sqlite3_step(self->latest) == SQLITE_ROW ? sqlite3_column_int64(self->latest, 0) : seq;
        sqlite3_reset(self->latest);
        bool finished = st == CB_JOB_DONE || st == CB_JOB_FAILED;
        if (st == CB_JOB_FAILED || (finished && latest != seq)) {
            /* retry a failed document; bring back an older version pushed again after a newer one */
            out = check_limits(self, client, lim, (int64_t)text_len, err, errlen);
            if (out == 0) out = requeue(self, job, client, err, errlen);
        } else {
            *duplicate = true;
            if (state) *state = (unsigned)st < CB_JOB_STATE_COUNT_ ? (cb_job_state_t)st : CB_JOB_FAILED;
        }
    } else if (rc == SQLITE_DONE) {
        sqlite3_reset(f);
        out = check_limits(self, client, lim, (int64_t)text_len, err, errlen);
        if (out == 0) {
            sqlite3_stmt *ins = self->insert;
            sqlite3_bind_text(ins, 1, job, CB_JOB_ID_LEN, SQLITE_STATIC);
            sqlite3_bind_text(ins, 2, doc_id, (int)doc_len, SQLITE_STATIC);
            sqlite3_bind_text(ins, 3, text, (int)text_len, SQLITE_STATIC);
            if (meta_json) sqlite3_bind_text(ins, 4, meta_json, -1, SQLITE_STATIC);
            else sqlite3_bind_null(ins, 4);
            sqlite3_bind_double(ins, 5, now_s());
            sqlite3_bind_text(ins, 6, client, -1, SQLITE_STATIC);
            sqlite3_bind_int64(ins, 7, (int64_t)text_len);
            rc = sqlite3_step(ins);
            sqlite3_reset(ins);
            sqlite3_clear_bindings(ins);
            if (rc != SQLITE_DONE) out = db_fail(self, err, errlen, "insert");
        }
    } else {
        sqlite3_reset(f);
        out = db_fail(self, err, errlen, "lookup");
    }
    return end_tx(self, out, err, errlen);
}

int cb_jobs_restore(cb_jobs_t *self, const char *job, const char *client, const cb_jobs_limits_t *lim,
                    bool *requeued, char *err, size_t errlen) {
    *requeued = false;
    if (!client) client = "";
    if (exec_simple(self, "BEGIN IMMEDIATE", err, errlen) != 0) return -1;
    sqlite3_stmt *f = self->find;
    sqlite3_bind_text(f, 1, job, -1, SQLITE_STATIC);
    int rc = sqlite3_step(f), out = 0;
    if (rc == SQLITE_ROW) {
        int64_t seq = sqlite3_column_int64(f, 0);
        int st = sqlite3_column_int(f, 1);
        char doc[257];
        snprintf(doc, sizeof doc, "%s", (const char *)sqlite3_column_text(f, 2));
        int64_t bytes = sqlite3_column_int64(f, 3);
        sqlite3_reset(f);
        sqlite3_bind_text(self->latest, 1, doc, -1, SQLITE_STATIC);
        int64_t latest = sqlite3_step(self->latest) == SQLITE_ROW ? sqlite3_column_int64(self->latest, 0) : seq;
        sqlite3_reset(self->latest);
        if (st == CB_JOB_DONE && latest == seq) {
            out = check_limits(self, client, lim, bytes, err, errlen);
            if (out == 0 && (out = requeue(self, job, client, err, errlen)) == 0) *requeued = true;
        }
    } else if (rc != SQLITE_DONE) {
        out = db_fail(self, err, errlen, "lookup");
        sqlite3_reset(f);
    } else {
        sqlite3_reset(f);
    }
    return end_tx(self, out, err, errlen);
}

int cb_jobs_status(cb_jobs_t *self, const char *job, cb_job_status_t *st, char *err, size_t errlen) {
    sqlite3_stmt *s = self->status;
    sqlite3_bind_text(s, 1, job, -1, SQLITE_STATIC);
    int rc = sqlite3_step(s), out;
    if (rc == SQLITE_ROW) {
        int state = sqlite3_column_int(s, 0);
        st->state = (unsigned)state < CB_JOB_STATE_COUNT_ ? (cb_job_state_t)state : CB_JOB_FAILED;
        st->chunks_done = sqlite3_column_int64(s, 1);
        st->chunks_total = sqlite3_column_int64(s, 2);
        snprintf(st->error, sizeof st->error, "%s", (const char *)sqlite3_column_text(s, 3));
        snprintf(st->doc_id, sizeof st->doc_id, "%s", (const char *)sqlite3_column_text(s, 4));
        snprintf(st->owner, sizeof st->owner, "%s", (const char *)sqlite3_column_text(s, 5));
        out = 1;
    } else if (rc == SQLITE_DONE) {
        out = 0;
    } else {
        out = db_fail(self, err, errlen, "status");
    }
    sqlite3_reset(s);
    return out;
}

int cb_jobs_counts(cb_jobs_t *self, int64_t counts[CB_JOB_STATE_COUNT_], int64_t *chunks_done, char *err,
                   size_t errlen) {
    for (int i = 0; i < CB_JOB_STATE_COUNT_; i++) counts[i] = 0;
    *chunks_done = 0;
    int rc;
    while ((rc = sqlite3_step(self->counts)) == SQLITE_ROW) {
        int s = sqlite3_column_int(self->counts, 0);
        if ((unsigned)s < CB_JOB_STATE_COUNT_) counts[s] = sqlite3_column_int64(self->counts, 1);
    }
    sqlite3_reset(self->counts);
    if (rc != SQLITE_DONE) return db_fail(self, err, errlen, "counts");
    if (sqlite3_step(self->chunk_sum) == SQLITE_ROW) *chunks_done = sqlite3_column_int64(self->chunk_sum, 0);
    sqlite3_reset(self->chunk_sum);
    return 0;
}

void cb_job_free(cb_job_t **job_p) {
    if (!job_p || !*job_p) return;
    free((*job_p)->doc_id);
    free((*job_p)->text);
    free(*job_p);
    *job_p = NULL;
}

int cb_jobs_clients_waiting(cb_jobs_t *self, int64_t *n, char *err, size_t errlen) {
    int rc = sqlite3_step(self->clients);
    *n = rc == SQLITE_ROW ? sqlite3_column_int64(self->clients, 0) : 0;
    sqlite3_reset(self->clients);
    return rc == SQLITE_ROW ? 0 : db_fail(self, err, errlen, "clients");
}

/* The first column of s's first row (a text) into out[cap]: 1, 0 (no row), -1 (error). Resets s. */
static int first_text(sqlite3_stmt *s, char *out, size_t cap) {
    int rc = sqlite3_step(s), r = 0;
    if (rc == SQLITE_ROW) {
        const char *t = (const char *)sqlite3_column_text(s, 0);
        snprintf(out, cap, "%s", t ? t : "");
        r = 1;
    } else if (rc != SQLITE_DONE) {
        r = -1;
    }
    sqlite3_reset(s);
    return r;
}

/* The turn after after_client among the jobs ready now with at most maxb bytes of text (jobs.h cb_jobs_pick). */
/* reclaim: an owner whose own live leases do not count (the local worker, one thread: a lease of its own
 * that it could not release, e.g. on a full disk, must not keep it from the job until the lease expires),
 * or NULL. */
static int pick(cb_jobs_t *self, const char *after_client, int64_t maxb, const char *reclaim,
                char job[CB_JOB_ID_LEN + 1], char *client) {
    int r = 0;
    if (after_client && *after_client) {
        sqlite3_bind_text(self->pick_after, 1, after_client, -1, SQLITE_STATIC);
        bind_now(self->pick_after, maxb);
        bind_self(self->pick_after, reclaim);
        r = first_text(self->pick_after, client, CB_JOB_CLIENT_MAX + 1);
    }
    if (r == 0) {
        bind_now(self->pick_first, maxb);
        bind_self(self->pick_first, reclaim);
        r = first_text(self->pick_first, client, CB_JOB_CLIENT_MAX + 1);
    }
    if (r == 1) {
        sqlite3_bind_text(self->pick_job, 1, client, -1, SQLITE_STATIC);
        bind_now(self->pick_job, maxb);
        bind_self(self->pick_job, reclaim);
        r = first_text(self->pick_job, job, CB_JOB_ID_LEN + 1);
    }
    return r;
}

int cb_jobs_pick(cb_jobs_t *self, const char *after_client, char job[CB_JOB_ID_LEN + 1], char *client, char *err,
                 size_t errlen) {
    int r = pick(self, after_client, INT64_MAX, NULL, job, client);
    return r < 0 ? db_fail(self, err, errlen, "pick") : r;
}

int cb_jobs_get(cb_jobs_t *self, const char *id, cb_job_t **out, char *err, size_t errlen) {
    *out = NULL;
    sqlite3_stmt *s = self->get;
    sqlite3_bind_text(s, 1, id, -1, SQLITE_STATIC);
    int rc = sqlite3_step(s);
    if (rc == SQLITE_DONE) {
        sqlite3_reset(s);
        return 0;
    }
    if (rc != SQLITE_ROW) {
        db_fail(self, err, errlen, "get");
        sqlite3_reset(s);
        return -1;
    }
    cb_job_t *j = cb_calloc(1, sizeof *j);
    const char *doc = (const char *)sqlite3_column_text(s, 2);
    const char *text = (const char *)sqlite3_column_text(s, 3);
    int text_len = sqlite3_column_bytes(s, 3);
    if (!j || !doc || !text || !(j->doc_id = cb_strdup(doc)) || !(j->text = cb_malloc((size_t)text_len + 1))) {
        if (j) free(j->doc_id);
        free(j);
        sqlite3_reset(s);
        snprintf(err, errlen, "jobs: out of memory");
        return -1;
    }
    j->seq = sqlite3_column_int64(s, 0);
    snprintf(j->job, sizeof j->job, "%s", (const char *)sqlite3_column_text(s, 1));
    memcpy(j->text, text, (size_t)text_len);
    j->text[text_len] = 0;
    j->text_len = (size_t)text_len;
    j->planned = sqlite3_column_int(s, 4) != 0;
    j->replaced = sqlite3_column_int(s, 5) != 0;
    snprintf(j->client, sizeof j->client, "%s", (const char *)sqlite3_column_text(s, 6));
    j->chunks_done = sqlite3_column_int64(s, 7);
    j->chunks_total = sqlite3_column_int64(s, 8);
    snprintf(j->token, sizeof j->token, "%s", (const char *)sqlite3_column_text(s, 9));
    sqlite3_reset(s);
    sqlite3_bind_text(self->older, 1, j->doc_id, -1, SQLITE_STATIC);
    sqlite3_bind_int64(self->older, 2, j->seq);
    j->has_older = sqlite3_step(self->older) == SQLITE_ROW && sqlite3_column_int(self->older, 0) != 0;
    sqlite3_reset(self->older);
    sqlite3_bind_text(self->mark_running, 1, j->job, -1, SQLITE_STATIC);
    sqlite3_bind_double(self->mark_running, 2, now_s());
    rc = sqlite3_step(self->mark_running);
    sqlite3_reset(self->mark_running);
    if (rc != SQLITE_DONE) {
        db_fail(self, err, errlen, "mark running");
        cb_job_free(&j);
        return -1;
    }
    *out = j;
    return 1;
}

int cb_jobs_next_chunk(cb_jobs_t *self, const char *job, int *idx, cb_job_chunk_t *c, char *err, size_t errlen) {
    sqlite3_stmt *s = self->next_chunk;
    sqlite3_bind_text(s, 1, job, -1, SQLITE_STATIC);
    int rc = sqlite3_step(s), r = 0;
    if (rc == SQLITE_ROW) {
        *idx = sqlite3_column_int(s, 0);
        c->off = sqlite3_column_int64(s, 1);
        c->len = sqlite3_column_int64(s, 2);
        snprintf(c->key, sizeof c->key, "%s", (const char *)sqlite3_column_text(s, 3));
        c->n_tokens = sqlite3_column_int(s, 4);
        c->done = false;
        r = 1;
    } else if (rc != SQLITE_DONE) {
        r = db_fail(self, err, errlen, "next chunk");
    }
    sqlite3_reset(s);
    return r;
}

/* Within a transaction: the chunk rows of a job and its chunks_total. 0 or -1 (err set). */
static int plan_rows(cb_jobs_t *self, const char *job, const cb_job_chunk_t *chunks, int n, char *err,
                     size_t errlen) {
    sqlite3_bind_text(self->drop_chunks, 1, job, -1, SQLITE_STATIC);
    int rc = sqlite3_step(self->drop_chunks);
    sqlite3_reset(self->drop_chunks);
    if (rc != SQLITE_DONE) return db_fail(self, err, errlen, "plan");
    for (int i = 0; i < n; i++) {
        sqlite3_stmt *p = self->plan_chunk;
        sqlite3_bind_text(p, 1, job, -1, SQLITE_STATIC);
        sqlite3_bind_int(p, 2, i);
        sqlite3_bind_int64(p, 3, chunks[i].off);
        sqlite3_bind_int64(p, 4, chunks[i].len);
        sqlite3_bind_text(p, 5, chunks[i].key, -1, SQLITE_STATIC);
        sqlite3_bind_int(p, 6, chunks[i].n_tokens);
        rc = sqlite3_step(p);
        sqlite3_reset(p);
        if (rc != SQLITE_DONE) return db_fail(self, err, errlen, "plan");
    }
    sqlite3_bind_text(self->plan_job, 1, job, -1, SQLITE_STATIC);
    sqlite3_bind_int(self->plan_job, 2, n);
    sqlite3_bind_double(self->plan_job, 3, now_s());
    rc = sqlite3_step(self->plan_job);
    sqlite3_reset(self->plan_job);
    return rc == SQLITE_DONE ? 0 : db_fail(self, err, errlen, "plan");
}

int cb_jobs_plan(cb_jobs_t *self, const char *job, const cb_job_chunk_t *chunks, int n, char *err, size_t errlen) {
    if (exec_simple(self, "BEGIN IMMEDIATE", err, errlen) != 0) return -1;
    return end_tx(self, plan_rows(self, job, chunks, n, err, errlen), err, errlen);
}

int cb_jobs_chunks(cb_jobs_t *self, const char *job, cb_job_chunk_t **chunks, int *n, char *err, size_t errlen) {
    *chunks = NULL;
    *n = 0;
    size_t cap = 0, cnt = 0;
    cb_job_chunk_t *out = NULL;
    sqlite3_stmt *s = self->chunks;
    sqlite3_bind_text(s, 1, job, -1, SQLITE_STATIC);
    int rc;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
        if (cnt == cap) {
            cap = cap ? cap * 2 : 16;
            cb_job_chunk_t *o2 = cb_realloc(out, cap * sizeof *o2);
            if (!o2) {
                free(out);
                sqlite3_reset(s);
                snprintf(err, errlen, "jobs: out of memory");
                return -1;
            }
            out = o2;
        }
        cb_job_chunk_t *c = &out[cnt++];
        c->off = sqlite3_column_int64(s, 1);
        c->len = sqlite3_column_int64(s, 2);
        snprintf(c->key, sizeof c->key, "%s", (const char *)sqlite3_column_text(s, 3));
        c->n_tokens = sqlite3_column_int(s, 4);
        c->done = sqlite3_column_int(s, 5) != 0;
    }
    sqlite3_reset(s);
    if (rc != SQLITE_DONE) {
        free(out);
        return db_fail(self, err, errlen, "chunks");
    }
    *chunks = out;
    *n = (int)cnt;
    return 0;
}

/* Within a transaction: marks chunk idx of job done and counts it (once). 0 or -1. */
static int chunk_done_row(cb_jobs_t *self, const char *job, int idx, char *err, size_t errlen) {
    sqlite3_bind_text(self->chunk_done, 1, job, -1, SQLITE_STATIC);
    sqlite3_bind_int(self->chunk_done, 2, idx);
    int rc = sqlite3_step(self->chunk_done);
    sqlite3_reset(self->chunk_done);
    if (rc != SQLITE_DONE) return db_fail(self, err, errlen, "chunk done");
    if (sqlite3_changes(self->db) > 0) {
        sqlite3_bind_text(self->job_done_inc, 1, job, -1, SQLITE_STATIC);
        sqlite3_bind_double(self->job_done_inc, 2, now_s());
        rc = sqlite3_step(self->job_done_inc);
        sqlite3_reset(self->job_done_inc);
        if (rc != SQLITE_DONE) return db_fail(self, err, errlen, "chunk done");
    }
    return 0;
}

int cb_jobs_chunk_done(cb_jobs_t *self, const char *job, int idx, char *err, size_t errlen) {
    if (exec_simple(self, "BEGIN IMMEDIATE", err, errlen) != 0) return -1;
    return end_tx(self, chunk_done_row(self, job, idx, err, errlen), err, errlen);
}

int cb_jobs_set_replaced(cb_jobs_t *self, const char *job, char *err, size_t errlen) {
    sqlite3_bind_text(self->replaced, 1, job, -1, SQLITE_STATIC);
    sqlite3_bind_double(self->replaced, 2, now_s());
    int rc = sqlite3_step(self->replaced);
    sqlite3_reset(self->replaced);
    return rc == SQLITE_DONE ? 0 : db_fail(self, err, errlen, "replaced");
}

int cb_jobs_finish(cb_jobs_t *self, const char *job, bool ok, const char *error, char *err, size_t errlen) {
    sqlite3_stmt *s = self->finish;
    sqlite3_bind_text(s, 1, job, -1, SQLITE_STATIC);
    sqlite3_bind_int(s, 2, ok ? CB_JOB_DONE : CB_JOB_FAILED);
    if (!ok && error) sqlite3_bind_text(s, 3, error, -1, SQLITE_TRANSIENT);
    else sqlite3_bind_null(s, 3);
    sqlite3_bind_double(s, 4, now_s());
    int rc = sqlite3_step(s);
    sqlite3_reset(s);
    sqlite3_clear_bindings(s);
    return rc == SQLITE_DONE ? 0 : db_fail(self, err, errlen, "finish");
}

/* ---- leases ------------------------------------------------------------------------------------------- */

/* Within a transaction: the lease state of job. 1 = the job exists (out fields set), 0 = no such job, -1. */
typedef struct {
    int state;
    char token[CB_JOB_TOKEN_LEN + 1];
    int64_t until;
    bool planned;
    int64_t chunks_total;
} lease_row_t;

static int read_lease(cb_jobs_t *self, const char *job, lease_row_t *r) {
    sqlite3_stmt *s = self->lease_row;
    sqlite3_bind_text(s, 1, job, -1, SQLITE_STATIC);
    int rc = sqlite3_step(s), out = 0;
    if (rc == SQLITE_ROW) {
        r->state = sqlite3_column_int(s, 0);
        snprintf(r->token, sizeof r->token, "%s", (const char *)sqlite3_column_text(s, 1));
        r->until = sqlite3_column_int64(s, 2);
        r->planned = sqlite3_column_int(s, 3) != 0;
        r->chunks_total = sqlite3_column_int64(s, 4);
        out = 1;
    } else if (rc != SQLITE_DONE) {
        out = -1;
    }
    sqlite3_reset(s);
    return out;
}

/* Whether token holds job's lease: a token matches (only its grant sets it; a new grant replaces it) and
 * the job is still unfinished. An expired lease that nobody took over still holds (renew revives it). */
static bool holds(const lease_row_t *r, const char *token) {
    return token && token[0] && strcmp(r->token, token) == 0 && (r->state == CB_JOB_QUEUED || r->state == CB_JOB_RUNNING);
}

int cb_jobs_lease(cb_jobs_t *self, const char *after_client, const char *owner, int64_t ttl_ms, int64_t max_text_bytes,
                  int max_per_owner, cb_job_lease_t *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    if (exec_simple(self, "BEGIN IMMEDIATE", err, errlen) != 0) return -1;
    int r = 0;
    if (max_per_owner > 0) {
        sqlite3_bind_text(self->owner_leases, 1, owner, -1, SQLITE_STATIC);
        bind_now(self->owner_leases, 0);
        int rc = sqlite3_step(self->owner_leases);
        int64_t held = rc == SQLITE_ROW ? sqlite3_column_int64(self->owner_leases, 0) : 0;
        sqlite3_reset(self->owner_leases);
        if (rc != SQLITE_ROW) return end_tx(self, db_fail(self, err, errlen, "lease"), err, errlen);
        if (held >= max_per_owner) {
            snprintf(err, errlen, "worker '%.80s' holds %lld live leases (precompute.max_leases_per_worker = %d)",
                     owner, (long long)held, max_per_owner);
            end_tx(self, 0, NULL, 0);
            return 2;
        }
    }
    r = pick(self, after_client, max_text_bytes > 0 ? max_text_bytes : INT64_MAX,
             strcmp(owner, CB_JOBS_LOCAL_OWNER) == 0 ? owner : NULL, out->job, out->client);
    if (r <= 0) {
        if (r < 0) db_fail(self, err, errlen, "lease");
        end_tx(self, r, NULL, 0);
        return r < 0 ? -1 : 0;
    }
    lease_row_t prev;
    if (read_lease(self, out->job, &prev) != 1) return end_tx(self, db_fail(self, err, errlen, "lease"), err, errlen);
    out->lapsed = prev.until > 0 && prev.token[0]; /* pickable with a lease set: it had expired */
    snprintf(out->prev_token, sizeof out->prev_token, "%s", prev.token);
    uint8_t rnd[CB_JOB_TOKEN_LEN / 2];
    randombytes_buf(rnd, sizeof rnd);
    sodium_bin2hex(out->token, sizeof out->token, rnd, sizeof rnd);
    int64_t now = now_ms();
    out->until_ms = now + ttl_ms;
    sqlite3_stmt *s = self->lease_set;
    sqlite3_bind_text(s, 1, out->job, -1, SQLITE_STATIC);
    sqlite3_bind_text(s, 2, owner, -1, SQLITE_STATIC);
    sqlite3_bind_text(s, 3, out->token, -1, SQLITE_STATIC);
    sqlite3_bind_int64(s, 4, out->until_ms);
    sqlite3_bind_double(s, 5, now_s());
    int rc = sqlite3_step(s);
    sqlite3_reset(s);
    if (rc != SQLITE_DONE) return end_tx(self, db_fail(self, err, errlen, "lease"), err, errlen);
    if (end_tx(self, 0, err, errlen) != 0) return -1;
    return 1;
}

int cb_jobs_lease_renew(cb_jobs_t *self, const char *job, const char *token, int64_t ttl_ms, char *err,
                        size_t errlen) {
    sqlite3_stmt *s = self->lease_renew;
    sqlite3_bind_text(s, 1, job, -1, SQLITE_STATIC);
    sqlite3_bind_text(s, 2, token, -1, SQLITE_STATIC);
    sqlite3_bind_int64(s, 3, now_ms() + ttl_ms);
    int rc = sqlite3_step(s);
    sqlite3_reset(s);
    if (rc != SQLITE_DONE) return db_fail(self, err, errlen, "renew");
    return sqlite3_changes(self->db) > 0 ? 1 : 0;
}

/* Begins a transaction in which token holds job's lease: 1 (r set, the transaction open), 0 (stale: no
 * transaction), -1 (err; no transaction). */
static int lease_begin(cb_jobs_t *self, const char *job, const char *token, lease_row_t *r, char *err, size_t errlen) {
    if (exec_simple(self, "BEGIN IMMEDIATE", err, errlen) != 0) return -1;
    int f = read_lease(self, job, r);
    if (f < 0) return end_tx(self, db_fail(self, err, errlen, "lease"), err, errlen);
    if (f == 0 || !holds(r, token)) {
        end_tx(self, 1, NULL, 0);
        return 0;
    }
    return 1;
}

/* Within a transaction: the lease of job renewed for ttl_ms (its token checked by the caller). 0 or -1. */
static int renew_in_tx(cb_jobs_t *self, const char *job, const char *token, int64_t ttl_ms, char *err, size_t errlen) {
    return cb_jobs_lease_renew(self, job, token, ttl_ms, err, errlen) < 0 ? -1 : 0;
}

int cb_jobs_lease_plan(cb_jobs_t *self, const char *job, const char *token, int64_t ttl_ms,
                       const cb_job_chunk_t *chunks, int n, int64_t *chunks_total, char *err, size_t errlen) {
    lease_row_t r;
    int h = lease_begin(self, job, token, &r, err, errlen);
    if (h <= 0) return h;
    int rc = 0;
    if (r.planned) {
        *chunks_total = r.chunks_total; /* planned already (a resent plan): nothing changes */
    } else {
        rc = plan_rows(self, job, chunks, n, err, errlen);
        *chunks_total = n;
    }
    if (rc == 0) rc = renew_in_tx(self, job, token, ttl_ms, err, errlen);
    return end_tx(self, rc, err, errlen) == 0 ? 1 : -1;
}

int cb_jobs_lease_replaced(cb_jobs_t *self, const char *job, const char *token, int64_t ttl_ms, char *err,
                           size_t errlen) {
    sqlite3_stmt *s = self->lease_replaced;
    sqlite3_bind_text(s, 1, job, -1, SQLITE_STATIC);
    sqlite3_bind_text(s, 2, token, -1, SQLITE_STATIC);
    sqlite3_bind_int64(s, 3, now_ms() + ttl_ms);
    sqlite3_bind_double(s, 4, now_s());
    int rc = sqlite3_step(s);
    sqlite3_reset(s);
    if (rc != SQLITE_DONE) return db_fail(self, err, errlen, "replaced");
    return sqlite3_changes(self->db) > 0 ? 1 : 0;
}

int cb_jobs_lease_chunk_done(cb_jobs_t *self, const char *job, const char *token, int idx, int64_t ttl_ms, char *err,
                             size_t errlen) {
    lease_row_t r;
    int h = lease_begin(self, job, token, &r, err, errlen);
    if (h <= 0) return h;
    sqlite3_bind_text(self->chunk_row, 1, job, -1, SQLITE_STATIC);
    sqlite3_bind_int(self->chunk_row, 2, idx);
    int rc = sqlite3_step(self->chunk_row);
    sqlite3_reset(self->chunk_row);
    if (rc == SQLITE_DONE) {
        snprintf(err, errlen, "job %s has no chunk %d (%lld planned)", job, idx, (long long)r.chunks_total);
        end_tx(self, 2, NULL, 0);
        return 2;
    }
    int out = rc == SQLITE_ROW ? 0 : db_fail(self, err, errlen, "chunk done");
    if (out == 0) out = chunk_done_row(self, job, idx, err, errlen);
    if (out == 0) out = renew_in_tx(self, job, token, ttl_ms, err, errlen);
    return end_tx(self, out, err, errlen) == 0 ? 1 : -1;
}

int cb_jobs_lease_finish(cb_jobs_t *self, const char *job, const char *token, bool ok, const char *error,
                         bool *already, char *err, size_t errlen) {
    *already = false;
    if (exec_simple(self, "BEGIN IMMEDIATE", err, errlen) != 0) return -1;
    lease_row_t r;
    int f = read_lease(self, job, &r);
    if (f < 0) return end_tx(self, db_fail(self, err, errlen, "finish"), err, errlen);
    if (f == 1 && token && token[0] && strcmp(r.token, token) == 0 && (r.state == CB_JOB_DONE || r.state == CB_JOB_FAILED)) {
        *already = true; /* this holder finished it before: a resent finish */
        end_tx(self, 0, NULL, 0);
        return 1;
    }
    if (f == 0 || !holds(&r, token)) {
        end_tx(self, 1, NULL, 0);
        return 0;
    }
    if (ok) { /* done means every planned chunk done */
        sqlite3_bind_text(self->chunks_left, 1, job, -1, SQLITE_STATIC);
        int rc = sqlite3_step(self->chunks_left);
        int64_t left = rc == SQLITE_ROW ? sqlite3_column_int64(self->chunks_left, 0) : -1;
        sqlite3_reset(self->chunks_left);
        if (left < 0) return end_tx(self, db_fail(self, err, errlen, "finish"), err, errlen);
        if (!r.planned || left > 0) {
            if (!r.planned) snprintf(err, errlen, "job %s cannot be done: it has no plan", job);
            else snprintf(err, errlen, "job %s cannot be done: %lld of its %lld chunks are not done", job,
                          (long long)left, (long long)r.chunks_total);
            end_tx(self, 2, NULL, 0);
            return 2;
        }
    }
    sqlite3_stmt *s = self->lease_finish;
    sqlite3_bind_text(s, 1, job, -1, SQLITE_STATIC);
    sqlite3_bind_int(s, 2, ok ? CB_JOB_DONE : CB_JOB_FAILED);
    if (!ok && error) sqlite3_bind_text(s, 3, error, -1, SQLITE_TRANSIENT);
    else sqlite3_bind_null(s, 3);
    sqlite3_bind_double(s, 4, now_s());
    int rc = sqlite3_step(s);
    sqlite3_reset(s);
    sqlite3_clear_bindings(s);
    return end_tx(self, rc == SQLITE_DONE ? 0 : db_fail(self, err, errlen, "finish"), err, errlen) == 0 ? 1 : -1;
}

int cb_jobs_lease_release(cb_jobs_t *self, const char *job, const char *token, char *err, size_t errlen) {
    sqlite3_stmt *s = self->lease_release;
    sqlite3_bind_text(s, 1, job, -1, SQLITE_STATIC);
    sqlite3_bind_text(s, 2, token, -1, SQLITE_STATIC);
    int rc = sqlite3_step(s);
    sqlite3_reset(s);
    if (rc != SQLITE_DONE) return db_fail(self, err, errlen, "release");
    return sqlite3_changes(self->db) > 0 ? 1 : 0;
}

int cb_jobs_release_owner(cb_jobs_t *self, const char *owner, char *err, size_t errlen) {
    sqlite3_stmt *s = self->release_owner;
    sqlite3_bind_text(s, 1, owner, -1, SQLITE_STATIC);
    int rc = sqlite3_step(s);
    sqlite3_reset(s);
    return rc == SQLITE_DONE ? sqlite3_changes(self->db) : db_fail(self, err, errlen, "release");
}

int cb_jobs_lease_counts(cb_jobs_t *self, int64_t *live, int64_t *lapsed, char *err, size_t errlen) {
    sqlite3_stmt *s = self->lease_counts;
    bind_now(s, 0);
    int rc = sqlite3_step(s);
    *live = rc == SQLITE_ROW ? sqlite3_column_int64(s, 0) : 0;
    *lapsed = rc == SQLITE_ROW ? sqlite3_column_int64(s, 1) : 0;
    sqlite3_reset(s);
    return rc == SQLITE_ROW ? 0 : db_fail(self, err, errlen, "lease counts");
}
