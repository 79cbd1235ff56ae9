/* jobs.c: cb-precompute's durable job queue in SQLite (see jobs.h). */
#include "jobs.h"

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
    "  updated REAL NOT NULL);"
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

struct cb_jobs {
    sqlite3 *db;
    sqlite3_stmt *find, *latest, *insert, *requeue, *drop_chunks, *status, *counts, *chunk_sum, *next, *mark_running,
        *older, *plan_chunk, *plan_job, *chunks, *chunk_done, *job_done_inc, *replaced, *finish;
};

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
    sqlite3_stmt **all[] = {&j->find,  &j->latest,  &j->insert,       &j->requeue,    &j->drop_chunks,
                            &j->status, &j->counts,  &j->chunk_sum,    &j->next,       &j->mark_running,
                            &j->older,  &j->plan_chunk, &j->plan_job,  &j->chunks,     &j->chunk_done,
                            &j->job_done_inc, &j->replaced, &j->finish};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) sqlite3_finalize(*all[i]);
    cb_db_close(&j->db);
    free(j);
    *self_p = NULL;
}

cb_jobs_t *cb_jobs_open(const char *path, char *err, size_t errlen) {
    cb_jobs_t *j = calloc(1, sizeof *j);
    if (!j) {
        snprintf(err, errlen, "jobs: out of memory");
        return NULL;
    }
    if (!(j->db = cb_db_open(path, true, err, errlen)) || cb_db_exec(j->db, SCHEMA, err, errlen) != 0) goto fail;
#define PREP(field, sql) \
    if (!(j->field = cb_db_prepare(j->db, sql, err, errlen))) goto fail
    PREP(find, "SELECT seq, state FROM jobs WHERE job = ?1");
    PREP(latest, "SELECT max(seq) FROM jobs WHERE doc_id = ?1");
    PREP(insert, "INSERT INTO jobs(job, doc_id, text, meta, state, created, updated) VALUES(?1, ?2, ?3, ?4, 0, ?5, ?5)");
    PREP(requeue, "UPDATE jobs SET seq = (SELECT max(seq) + 1 FROM jobs), state = 0, planned = 0, replaced = 0, "
                  "chunks_total = 0, chunks_done = 0, error = NULL, updated = ?2 WHERE job = ?1");
    PREP(drop_chunks, "DELETE FROM chunks WHERE job = ?1");
    PREP(status, "SELECT state, chunks_done, chunks_total, coalesce(error, '') FROM jobs WHERE job = ?1");
    PREP(counts, "SELECT state, count(*) FROM jobs GROUP BY state");
    PREP(chunk_sum, "SELECT coalesce(sum(chunks_done), 0) FROM jobs");
    PREP(next, "SELECT seq, job, doc_id, text, planned, replaced FROM jobs WHERE state IN (0, 1) ORDER BY seq LIMIT 1");
    PREP(mark_running, "UPDATE jobs SET state = 1, updated = ?2 WHERE job = ?1 AND state = 0");
    PREP(older, "SELECT EXISTS(SELECT 1 FROM jobs WHERE doc_id = ?1 AND seq < ?2)");
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

int cb_jobs_submit(cb_jobs_t *self, const char *doc_id, size_t doc_len, const char *text, size_t text_len,
                   const char *meta_json, char job[CB_JOB_ID_LEN + 1], bool *duplicate, char *err, size_t errlen) {
    cb_jobs_id(doc_id, doc_len, text, text_len, job);
    *duplicate = false;
    if (exec_simple(self, "BEGIN IMMEDIATE", err, errlen) != 0) return -1;
    sqlite3_stmt *f = self->find;
    sqlite3_bind_text(f, 1, job, CB_JOB_ID_LEN, SQLITE_STATIC);
    int rc = sqlite3_step(f);
    if (rc == SQLITE_ROW) {
        int64_t seq = sqlite3_column_int64(f, 0);
        int state = sqlite3_column_int(f, 1);
        sqlite3_reset(f);
        sqlite3_bind_text(self->latest, 1, doc_id, (int)doc_len, SQLITE_STATIC);
        int64_t latest = sqlite3_step(self->latest) == SQLITE_ROW ? sqlite3_column_int64(self->latest, 0) : seq;
        sqlite3_reset(self->latest);
        bool finished = state == CB_JOB_DONE || state == CB_JOB_FAILED;
        if (state == CB_JOB_FAILED || (finished && latest != seq)) {
            /* retry a failed document; bring back an older version pushed again after a newer one */
            sqlite3_bind_text(self->requeue, 1, job, CB_JOB_ID_LEN, SQLITE_STATIC);
            sqlite3_bind_double(self->requeue, 2, now_s());
            sqlite3_bind_text(self->drop_chunks, 1, job, CB_JOB_ID_LEN, SQLITE_STATIC);
            if (sqlite3_step(self->requeue) != SQLITE_DONE || sqlite3_step(self->drop_chunks) != SQLITE_DONE) {
                db_fail(self, err, errlen, "requeue");
                sqlite3_reset(self->requeue);
                sqlite3_reset(self->drop_chunks);
                exec_simple(self, "ROLLBACK", NULL, 0);
                return -1;
            }
            sqlite3_reset(self->requeue);
            sqlite3_reset(self->drop_chunks);
        } else {
            *duplicate = true;
        }
    } else if (rc == SQLITE_DONE) {
        sqlite3_reset(f);
        sqlite3_stmt *ins = self->insert;
        sqlite3_bind_text(ins, 1, job, CB_JOB_ID_LEN, SQLITE_STATIC);
        sqlite3_bind_text(ins, 2, doc_id, (int)doc_len, SQLITE_STATIC);
        sqlite3_bind_text(ins, 3, text, (int)text_len, SQLITE_STATIC);
        if (meta_json) sqlite3_bind_text(ins, 4, meta_json, -1, SQLITE_STATIC);
        else sqlite3_bind_null(ins, 4);
        sqlite3_bind_double(ins, 5, now_s());
        rc = sqlite3_step(ins);
        sqlite3_reset(ins);
        sqlite3_clear_bindings(ins);
        if (rc != SQLITE_DONE) {
            db_fail(self, err, errlen, "insert");
            exec_simple(self, "ROLLBACK", NULL, 0);
            return -1;
        }
    } else {
        db_fail(self, err, errlen, "lookup");
        sqlite3_reset(f);
        exec_simple(self, "ROLLBACK", NULL, 0);
        return -1;
    }
    if (exec_simple(self, "COMMIT", err, errlen) != 0) {
        exec_simple(self, "ROLLBACK", NULL, 0);
        return -1;
    }
    return 0;
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

int cb_jobs_next(cb_jobs_t *self, cb_job_t **out, char *err, size_t errlen) {
    *out = NULL;
    sqlite3_stmt *s = self->next;
    int rc = sqlite3_step(s);
    if (rc == SQLITE_DONE) {
        sqlite3_reset(s);
        return 0;
    }
    if (rc != SQLITE_ROW) {
        db_fail(self, err, errlen, "next");
        sqlite3_reset(s);
        return -1;
    }
    cb_job_t *j = calloc(1, sizeof *j);
    const char *doc = (const char *)sqlite3_column_text(s, 2);
    const char *text = (const char *)sqlite3_column_text(s, 3);
    int text_len = sqlite3_column_bytes(s, 3);
    if (!j || !doc || !text || !(j->doc_id = strdup(doc)) || !(j->text = malloc((size_t)text_len + 1))) {
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

int cb_jobs_plan(cb_jobs_t *self, const char *job, const cb_job_chunk_t *chunks, int n, char *err, size_t errlen) {
    if (exec_simple(self, "BEGIN IMMEDIATE", err, errlen) != 0) return -1;
    sqlite3_bind_text(self->drop_chunks, 1, job, -1, SQLITE_STATIC);
    int rc = sqlite3_step(self->drop_chunks);
    sqlite3_reset(self->drop_chunks);
    if (rc != SQLITE_DONE) goto fail;
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
        if (rc != SQLITE_DONE) goto fail;
    }
    sqlite3_bind_text(self->plan_job, 1, job, -1, SQLITE_STATIC);
    sqlite3_bind_int(self->plan_job, 2, n);
    sqlite3_bind_double(self->plan_job, 3, now_s());
    rc = sqlite3_step(self->plan_job);
    sqlite3_reset(self->plan_job);
    if (rc != SQLITE_DONE) goto fail;
    return exec_simple(self, "COMMIT", err, errlen);
fail:
    db_fail(self, err, errlen, "plan");
    exec_simple(self, "ROLLBACK", NULL, 0);
    return -1;
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
            cb_job_chunk_t *o2 = realloc(out, cap * sizeof *o2);
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

int cb_jobs_chunk_done(cb_jobs_t *self, const char *job, int idx, char *err, size_t errlen) {
    if (exec_simple(self, "BEGIN IMMEDIATE", err, errlen) != 0) return -1;
    sqlite3_bind_text(self->chunk_done, 1, job, -1, SQLITE_STATIC);
    sqlite3_bind_int(self->chunk_done, 2, idx);
    int rc = sqlite3_step(self->chunk_done);
    sqlite3_reset(self->chunk_done);
    if (rc != SQLITE_DONE) goto fail;
    if (sqlite3_changes(self->db) > 0) {
        sqlite3_bind_text(self->job_done_inc, 1, job, -1, SQLITE_STATIC);
        sqlite3_bind_double(self->job_done_inc, 2, now_s());
        rc = sqlite3_step(self->job_done_inc);
        sqlite3_reset(self->job_done_inc);
        if (rc != SQLITE_DONE) goto fail;
    }
    return exec_simple(self, "COMMIT", err, errlen);
fail:
    db_fail(self, err, errlen, "chunk done");
    exec_simple(self, "ROLLBACK", NULL, 0);
    return -1;
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
