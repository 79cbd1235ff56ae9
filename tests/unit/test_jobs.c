/* test_jobs: cb-precompute's job table (services/precompute/jobs.c, included here): idempotent submit,
 * turns across clients (round robin, each client's oldest job, versions of a document in order), the
 * per-client limits, the restore of a done job, the state surviving a reopen, the migration of a table
 * made before the client columns, and leases (grant, renew, expiry and a re-grant with a new token, stale
 * tokens refused, picks skipping leased jobs, a job finished once, the per-worker limit). The clock is
 * moved with jobs.c's s_clock_skew_ms. Then who the client is (ident.c, included too): with CURVE the
 * authenticated key, whatever `client` it declares (20 declared clients of one key are limited as one, a
 * trusted forwarder's `on_behalf_of`, refused from others); without CURVE, what is declared; the global
 * cap on queued work; and a victim's wait, in turns, behind a flood of 20 declared clients without CURVE
 * and behind one key with CURVE (printed). */
#include "../../services/precompute/jobs.c"
#include "../../services/precompute/ident.c"
#include "test.h"

#include <unistd.h>

static char g_db[256];

static cb_jobs_t *fresh(void) {
    snprintf(g_db, sizeof g_db, "/tmp/test_jobs.%d.db", (int)getpid());
    char p[300];
    unlink(g_db);
    snprintf(p, sizeof p, "%s-wal", g_db);
    unlink(p);
    snprintf(p, sizeof p, "%s-shm", g_db);
    unlink(p);
    char err[256];
    cb_jobs_t *j = cb_jobs_open(g_db, err, sizeof err);
    if (!j) fprintf(stderr, "  open: %s\n", err);
    return j;
}

static int submit(cb_jobs_t *j, const char *doc, const char *text, const char *client, const cb_jobs_limits_t *lim,
                  char job[CB_JOB_ID_LEN + 1], bool *dup) {
    char err[256];
    cb_job_state_t st;
    int rc = cb_jobs_submit(j, doc, strlen(doc), text, strlen(text), NULL, client, lim, job, dup, &st, err, sizeof err);
    if (rc < 0) fprintf(stderr, "  submit: %s\n", err);
    return rc;
}

/* Takes a turn: picks after *last, loads the job; returns its doc_id's first char ('-' when none). */
static char turn(cb_jobs_t *j, char *last, char job[CB_JOB_ID_LEN + 1]) {
    char client[CB_JOB_CLIENT_MAX + 1], err[256];
    if (cb_jobs_pick(j, last, job, client, err, sizeof err) != 1) return '-';
    snprintf(last, CB_JOB_CLIENT_MAX + 1, "%s", client);
    cb_job_t *jb = NULL;
    if (cb_jobs_get(j, job, &jb, err, sizeof err) != 1) return '?';
    char c = jb->doc_id[0];
    cb_job_free(&jb);
    return c;
}

static void finish(cb_jobs_t *j, const char *job) {
    char err[256];
    cb_jobs_finish(j, job, true, NULL, err, sizeof err);
}

TEST(submit_is_idempotent) {
    cb_jobs_t *j = fresh();
    CHECK(j);
    char job[CB_JOB_ID_LEN + 1], job2[CB_JOB_ID_LEN + 1];
    bool dup = true;
    CHECK(submit(j, "d1", "text one", "A", NULL, job, &dup) == 0 && !dup);
    CHECK(submit(j, "d1", "text one", "B", NULL, job2, &dup) == 0 && dup && !strcmp(job, job2));
    cb_job_status_t st;
    char err[256];
    CHECK(cb_jobs_status(j, job, &st, err, sizeof err) == 1 && st.state == CB_JOB_QUEUED && !strcmp(st.doc_id, "d1"));
    cb_jobs_close(&j);
}

TEST(turns_go_round_the_clients) {
    cb_jobs_t *j = fresh();
    CHECK(j);
    char a1[33], a2[33], b1[33], c1[33], job[33], last[CB_JOB_CLIENT_MAX + 1] = "";
    bool dup;
    CHECK(submit(j, "a-big", "A's big document", "A", NULL, a1, &dup) == 0);
    CHECK(submit(j, "a-second", "A's second", "A", NULL, a2, &dup) == 0);
    CHECK(submit(j, "b-small", "B's small one", "B", NULL, b1, &dup) == 0);
    CHECK(submit(j, "c-small", "C's", "C", NULL, c1, &dup) == 0);
    /* A's oldest job keeps its turn until it is done; B and C get theirs in between */
    CHECK(turn(j, last, job) == 'a' && !strcmp(job, a1));
    CHECK(turn(j, last, job) == 'b' && !strcmp(job, b1));
    finish(j, b1);
    CHECK(turn(j, last, job) == 'c');
    finish(j, c1);
    CHECK(turn(j, last, job) == 'a' && !strcmp(job, a1));
    CHECK(turn(j, last, job) == 'a' && !strcmp(job, a1)); /* alone now */
    finish(j, a1);
    CHECK(turn(j, last, job) == 'a' && !strcmp(job, a2));
    finish(j, a2);
    CHECK(turn(j, last, job) == '-');
    int64_t n = -1;
    char err[256];
    CHECK(cb_jobs_clients_waiting(j, &n, err, sizeof err) == 0 && n == 0);
    cb_jobs_close(&j);
}

TEST(versions_of_a_document_in_order) {
    cb_jobs_t *j = fresh();
    CHECK(j);
    char v1[33], v2[33], job[33], last[CB_JOB_CLIENT_MAX + 1] = "";
    bool dup;
    CHECK(submit(j, "doc", "version one", "A", NULL, v1, &dup) == 0);
    CHECK(submit(j, "doc", "version two", "B", NULL, v2, &dup) == 0);
    /* B's newer version waits for A's older one, whoever's turn it is */
    CHECK(turn(j, last, job) == 'd' && !strcmp(job, v1));
    CHECK(turn(j, last, job) == 'd' && !strcmp(job, v1));
    finish(j, v1);
    CHECK(turn(j, last, job) == 'd' && !strcmp(job, v2));
    cb_job_t *jb = NULL;
    char err[256];
    CHECK(cb_jobs_get(j, v2, &jb, err, sizeof err) == 1 && jb->has_older);
    cb_job_free(&jb);
    cb_jobs_close(&j);
}

TEST(per_client_limits) {
    cb_jobs_t *j = fresh();
    CHECK(j);
    cb_jobs_limits_t lim = {.max_jobs = 2, .max_bytes = 0};
    char job[33];
    bool dup;
    CHECK(submit(j, "a1", "one", "A", &lim, job, &dup) == 0);
    CHECK(submit(j, "a2", "two", "A", &lim, job, &dup) == 0);
    CHECK(submit(j, "a3", "three", "A", &lim, job, &dup) == 1); /* over the job limit */
    CHECK(submit(j, "a2", "two", "A", &lim, job, &dup) == 0 && dup); /* a duplicate adds nothing */
    CHECK(submit(j, "b1", "other client", "B", &lim, job, &dup) == 0);
    cb_job_status_t st;
    char err[256];
    cb_jobs_id("a3", 2, "three", 5, job);
    CHECK(cb_jobs_status(j, job, &st, err, sizeof err) == 0); /* nothing recorded */
    /* bytes: the first document always passes, the next one that would exceed the budget does not */
    cb_jobs_limits_t lb = {.max_jobs = 0, .max_bytes = 10};
    CHECK(submit(j, "c1", "a document longer than ten bytes", "C", &lb, job, &dup) == 0);
    CHECK(submit(j, "c2", "x", "C", &lb, job, &dup) == 1);
    char e2[256];
    CHECK(cb_jobs_submit(j, "c2", 2, "x", 1, NULL, "C", &lb, job, &dup, NULL, e2, sizeof e2) == 1);
    CHECK_MSG(strstr(e2, "max_queued_bytes_per_client") != NULL, "%s", e2);
    cb_jobs_close(&j);
}

TEST(restore_requeues_a_done_job) {
    cb_jobs_t *j = fresh();
    CHECK(j);
    char v1[33], v2[33], job[33], last[CB_JOB_CLIENT_MAX + 1] = "", err[256];
    bool dup, req = true;
    CHECK(submit(j, "doc", "text", "A", NULL, v1, &dup) == 0);
    CHECK(cb_jobs_restore(j, v1, "A", NULL, &req, err, sizeof err) == 0 && !req); /* not done: nothing */
    CHECK(turn(j, last, job) == 'd');
    finish(j, v1);
    CHECK(cb_jobs_restore(j, v1, "B", NULL, &req, err, sizeof err) == 0 && req);
    cb_job_status_t st;
    CHECK(cb_jobs_status(j, v1, &st, err, sizeof err) == 1 && st.state == CB_JOB_QUEUED && st.chunks_total == 0);
    CHECK(cb_jobs_restore(j, v1, "B", NULL, &req, err, sizeof err) == 0 && !req); /* queued already */
    CHECK(turn(j, last, job) == 'd' && !strcmp(job, v1) && !strcmp(last, "B"));
    finish(j, v1);
    /* an older version is never brought back by a restore (a submit of it does that) */
    CHECK(submit(j, "doc", "newer text", "A", NULL, v2, &dup) == 0 && !dup);
    CHECK(turn(j, last, job) == 'd');
    finish(j, v2);
    CHECK(cb_jobs_restore(j, v1, "A", NULL, &req, err, sizeof err) == 0 && !req);
    CHECK(cb_jobs_restore(j, "0123", "A", NULL, &req, err, sizeof err) == 0 && !req); /* unknown */
    cb_jobs_close(&j);
}

TEST(turn_state_survives_a_reopen) {
    cb_jobs_t *j = fresh();
    CHECK(j);
    char a1[33], b1[33], job[33], last[CB_JOB_CLIENT_MAX + 1] = "", err[256];
    bool dup;
    CHECK(submit(j, "a", "A's", "A", NULL, a1, &dup) == 0);
    CHECK(submit(j, "b", "B's", "B", NULL, b1, &dup) == 0);
    CHECK(turn(j, last, job) == 'a');
    cb_job_chunk_t cs[2] = {{.off = 0, .len = 1, .key = "k0", .n_tokens = 1}, {.off = 1, .len = 2, .key = "k1", .n_tokens = 1}};
    CHECK(cb_jobs_plan(j, a1, cs, 2, err, sizeof err) == 0 && cb_jobs_chunk_done(j, a1, 0, err, sizeof err) == 0);
    cb_jobs_close(&j);
    CHECK((j = cb_jobs_open(g_db, err, sizeof err)) != NULL);
    last[0] = 0;
    CHECK(turn(j, last, job) == 'a'); /* A's running job resumes at its undone chunk */
    int idx = -1;
    cb_job_chunk_t c;
    CHECK(cb_jobs_next_chunk(j, a1, &idx, &c, err, sizeof err) == 1 && idx == 1 && !strcmp(c.key, "k1"));
    CHECK(cb_jobs_chunk_done(j, a1, 1, err, sizeof err) == 0);
    CHECK(cb_jobs_next_chunk(j, a1, &idx, &c, err, sizeof err) == 0);
    CHECK(turn(j, last, job) == 'b');
    int64_t n = 0;
    CHECK(cb_jobs_clients_waiting(j, &n, err, sizeof err) == 0 && n == 2);
    cb_jobs_close(&j);
}

TEST(old_table_is_migrated) {
    cb_jobs_t *j = fresh();
    CHECK(j);
    cb_jobs_close(&j);
    unlink(g_db);
    sqlite3 *db = NULL;
    CHECK(sqlite3_open(g_db, &db) == SQLITE_OK);
    CHECK(sqlite3_exec(db,
                       "CREATE TABLE jobs(seq INTEGER PRIMARY KEY, job TEXT NOT NULL UNIQUE, doc_id TEXT NOT NULL,"
                       " text TEXT NOT NULL, meta TEXT, state INTEGER NOT NULL DEFAULT 0, planned INTEGER NOT NULL"
                       " DEFAULT 0, replaced INTEGER NOT NULL DEFAULT 0, chunks_total INTEGER NOT NULL DEFAULT 0,"
                       " chunks_done INTEGER NOT NULL DEFAULT 0, error TEXT, created REAL NOT NULL, updated REAL"
                       " NOT NULL);"
                       "INSERT INTO jobs(job, doc_id, text, created, updated) VALUES('j1', 'old', 'caf\xC3\xA9', 0, 0);",
                       NULL, NULL, NULL) == SQLITE_OK);
    sqlite3_close(db);
    char err[256], job[33], client[CB_JOB_CLIENT_MAX + 1] = "x";
    CHECK_MSG((j = cb_jobs_open(g_db, err, sizeof err)) != NULL, "%s", err);
    CHECK(cb_jobs_pick(j, NULL, job, client, err, sizeof err) == 1 && !strcmp(job, "j1") && client[0] == 0);
    cb_jobs_limits_t lim = {.max_jobs = 0, .max_bytes = 5};
    bool dup;
    CHECK(submit(j, "new", "x", "", &lim, job, &dup) == 1); /* the old job's 5 bytes were measured */
    cb_jobs_close(&j);
}

/* A job with two planned chunks, leased by owner W for 1000 ms. */
static void leased_job(cb_jobs_t *j, char job[CB_JOB_ID_LEN + 1], cb_job_lease_t *l) {
    char err[256];
    bool dup;
    submit(j, "doc", "two chunks", "A", NULL, job, &dup);
    if (cb_jobs_lease(j, NULL, "r:W", 1000, 0, 0, l, err, sizeof err) != 1) fprintf(stderr, "  lease: %s\n", err);
}

static const cb_job_chunk_t TWO[2] = {{.off = 0, .len = 3, .key = "k0", .n_tokens = 1},
                                      {.off = 4, .len = 6, .key = "k1", .n_tokens = 1}};

TEST(lease_grant_renew_expire_regrant) {
    s_clock_skew_ms = 0;
    cb_jobs_t *j = fresh();
    CHECK(j);
    char job[33], err[256];
    cb_job_lease_t l1, l2;
    leased_job(j, job, &l1);
    CHECK(!strcmp(l1.job, job) && strlen(l1.token) == CB_JOB_TOKEN_LEN && !l1.lapsed && !strcmp(l1.client, "A"));
    cb_job_status_t st;
    CHECK(cb_jobs_status(j, job, &st, err, sizeof err) == 1 && st.state == CB_JOB_RUNNING);
    /* under a live lease: nobody else gets it */
    CHECK(cb_jobs_lease(j, NULL, "r:V", 1000, 0, 0, &l2, err, sizeof err) == 0);
    int64_t live = -1, lapsed = -1;
    CHECK(cb_jobs_lease_counts(j, &live, &lapsed, err, sizeof err) == 0 && live == 1 && lapsed == 0);
    /* a renew moves the expiry: 800 ms later, renewed for 1000 ms, still held at +1500 */
    s_clock_skew_ms = 800;
    CHECK(cb_jobs_lease_renew(j, job, l1.token, 1000, err, sizeof err) == 1);
    s_clock_skew_ms = 1500;
    CHECK(cb_jobs_lease(j, NULL, "r:V", 1000, 0, 0, &l2, err, sizeof err) == 0);
    /* expired (no renew for 1000 ms): pickable again, with a new token */
    s_clock_skew_ms = 2000;
    CHECK(cb_jobs_lease_counts(j, &live, &lapsed, err, sizeof err) == 0 && live == 0 && lapsed == 1);
    CHECK(cb_jobs_lease(j, NULL, "r:V", 1000, 0, 0, &l2, err, sizeof err) == 1);
    CHECK(!strcmp(l2.job, job) && strcmp(l2.token, l1.token) != 0 && l2.lapsed);
    /* the old holder is told its lease is gone, whatever it sends */
    CHECK(cb_jobs_lease_renew(j, job, l1.token, 1000, err, sizeof err) == 0);
    int64_t total = 0;
    CHECK(cb_jobs_lease_plan(j, job, l1.token, 1000, TWO, 2, &total, err, sizeof err) == 0);
    CHECK(cb_jobs_lease_replaced(j, job, l1.token, 1000, err, sizeof err) == 0);
    CHECK(cb_jobs_lease_chunk_done(j, job, l1.token, 0, 1000, err, sizeof err) == 0);
    bool already = true;
    CHECK(cb_jobs_lease_finish(j, job, l1.token, true, NULL, &already, err, sizeof err) == 0);
    CHECK(cb_jobs_lease_release(j, job, l1.token, err, sizeof err) == 0);
    CHECK(cb_jobs_lease_renew(j, job, "", 1000, err, sizeof err) == 0);
    /* the new one works */
    CHECK(cb_jobs_lease_renew(j, job, l2.token, 1000, err, sizeof err) == 1);
    cb_jobs_close(&j);
    s_clock_skew_ms = 0;
}

TEST(lease_expired_but_not_taken_over_still_holds) {
    s_clock_skew_ms = 0;
    cb_jobs_t *j = fresh();
    CHECK(j);
    char job[33], err[256];
    cb_job_lease_t l;
    leased_job(j, job, &l);
    s_clock_skew_ms = 5000; /* expired, nobody asked */
    CHECK(cb_jobs_lease_renew(j, job, l.token, 1000, err, sizeof err) == 1); /* revived */
    cb_job_lease_t l2;
    CHECK(cb_jobs_lease(j, NULL, "r:V", 1000, 0, 0, &l2, err, sizeof err) == 0);
    cb_jobs_close(&j);
    s_clock_skew_ms = 0;
}

TEST(lease_progress_and_finished_once) {
    s_clock_skew_ms = 0;
    cb_jobs_t *j = fresh();
    CHECK(j);
    char job[33], err[256];
    cb_job_lease_t l;
    leased_job(j, job, &l);
    bool already = true;
    /* done needs a plan, then every chunk */
    CHECK(cb_jobs_lease_finish(j, job, l.token, true, NULL, &already, err, sizeof err) == 2);
    int64_t total = 0;
    CHECK(cb_jobs_lease_plan(j, job, l.token, 1000, TWO, 2, &total, err, sizeof err) == 1 && total == 2);
    /* a plan sent again changes nothing (the first one stands) */
    CHECK(cb_jobs_lease_plan(j, job, l.token, 1000, TWO, 1, &total, err, sizeof err) == 1 && total == 2);
    CHECK(cb_jobs_lease_chunk_done(j, job, l.token, 0, 1000, err, sizeof err) == 1);
    CHECK(cb_jobs_lease_chunk_done(j, job, l.token, 0, 1000, err, sizeof err) == 1); /* idempotent */
    CHECK(cb_jobs_lease_chunk_done(j, job, l.token, 7, 1000, err, sizeof err) == 2);  /* no such chunk */
    cb_job_status_t st;
    CHECK(cb_jobs_status(j, job, &st, err, sizeof err) == 1 && st.chunks_done == 1 && st.chunks_total == 2);
    CHECK(cb_jobs_lease_finish(j, job, l.token, true, NULL, &already, err, sizeof err) == 2);
    CHECK_MSG(strstr(err, "1 of its 2 chunks") != NULL, "%s", err);
    /* a lease that lapsed and is taken over keeps the progress: the next holder sees chunk 0 done */
    s_clock_skew_ms = 2000;
    cb_job_lease_t l2;
    CHECK(cb_jobs_lease(j, NULL, "r:V", 1000, 0, 0, &l2, err, sizeof err) == 1);
    cb_job_t *jb = NULL;
    CHECK(cb_jobs_get(j, job, &jb, err, sizeof err) == 1 && jb->planned && jb->chunks_done == 1 &&
          !strcmp(jb->token, l2.token));
    cb_job_free(&jb);
    int idx = -1;
    cb_job_chunk_t c;
    CHECK(cb_jobs_next_chunk(j, job, &idx, &c, err, sizeof err) == 1 && idx == 1);
    CHECK(cb_jobs_lease_chunk_done(j, job, l.token, 1, 1000, err, sizeof err) == 0); /* the old holder: stale */
    CHECK(cb_jobs_lease_chunk_done(j, job, l2.token, 1, 1000, err, sizeof err) == 1);
    CHECK(cb_jobs_lease_finish(j, job, l2.token, true, NULL, &already, err, sizeof err) == 1 && !already);
    CHECK(cb_jobs_status(j, job, &st, err, sizeof err) == 1 && st.state == CB_JOB_DONE && st.chunks_done == 2);
    /* finished once: the same finish again is "already", the old holder's is stale, nothing is pickable */
    CHECK(cb_jobs_lease_finish(j, job, l2.token, true, NULL, &already, err, sizeof err) == 1 && already);
    CHECK(cb_jobs_lease_finish(j, job, l.token, false, "late", &already, err, sizeof err) == 0);
    CHECK(cb_jobs_lease_renew(j, job, l2.token, 1000, err, sizeof err) == 0);
    CHECK(cb_jobs_status(j, job, &st, err, sizeof err) == 1 && st.state == CB_JOB_DONE);
    CHECK(cb_jobs_lease(j, NULL, "r:V", 1000, 0, 0, &l, err, sizeof err) == 0);
    /* a restore queues it again: the finished holder's token no longer counts */
    bool req = false;
    CHECK(cb_jobs_restore(j, job, "A", NULL, &req, err, sizeof err) == 0 && req);
    CHECK(cb_jobs_lease_finish(j, job, l2.token, true, NULL, &already, err, sizeof err) == 0);
    cb_jobs_close(&j);
    s_clock_skew_ms = 0;
}

TEST(local_pick_skips_leased_jobs) {
    s_clock_skew_ms = 0;
    cb_jobs_t *j = fresh();
    CHECK(j);
    char a1[33], b1[33], job[33], client[CB_JOB_CLIENT_MAX + 1], err[256];
    bool dup;
    CHECK(submit(j, "a", "A's", "A", NULL, a1, &dup) == 0);
    CHECK(submit(j, "b", "B's", "B", NULL, b1, &dup) == 0);
    cb_job_lease_t l;
    CHECK(cb_jobs_lease(j, NULL, "r:W", 1000, 0, 0, &l, err, sizeof err) == 1 && !strcmp(l.job, a1));
    /* the service's own worker: every turn goes to B while A is leased */
    CHECK(cb_jobs_pick(j, NULL, job, client, err, sizeof err) == 1 && !strcmp(job, b1));
    CHECK(cb_jobs_pick(j, "B", job, client, err, sizeof err) == 1 && !strcmp(job, b1));
    /* its turns are leases too ("local"): a remote worker never gets the job of a turn in progress */
    cb_job_lease_t t;
    CHECK(cb_jobs_lease(j, NULL, "local", 60000, 0, 0, &t, err, sizeof err) == 1 && !strcmp(t.job, b1));
    CHECK(cb_jobs_lease(j, NULL, "r:V", 1000, 0, 0, &l, err, sizeof err) == 0);
    CHECK(cb_jobs_lease_release(j, b1, t.token, err, sizeof err) == 1); /* the turn ended */
    CHECK(cb_jobs_lease(j, NULL, "r:V", 1000, 0, 0, &l, err, sizeof err) == 1 && !strcmp(l.job, b1));
    CHECK(cb_jobs_pick(j, NULL, job, client, err, sizeof err) == 0);
    /* a restarted service ends its own worker's leases, not the remote ones */
    CHECK(cb_jobs_lease(j, NULL, "local", 60000, 0, 0, &t, err, sizeof err) == 0);
    CHECK(cb_jobs_release_owner(j, "local", err, sizeof err) == 0);
    CHECK(cb_jobs_release_owner(j, "r:V", err, sizeof err) == 1);
    CHECK(cb_jobs_pick(j, NULL, job, client, err, sizeof err) == 1 && !strcmp(job, b1));
    cb_jobs_close(&j);
}

TEST(lease_limits_and_text_bound) {
    s_clock_skew_ms = 0;
    cb_jobs_t *j = fresh();
    CHECK(j);
    char job[33], err[256];
    bool dup;
    CHECK(submit(j, "a", "short", "A", NULL, job, &dup) == 0);
    CHECK(submit(j, "b", "short too", "B", NULL, job, &dup) == 0);
    CHECK(submit(j, "c", "a much longer text than the others", "C", NULL, job, &dup) == 0);
    cb_job_lease_t l;
    CHECK(cb_jobs_lease(j, NULL, "r:W", 1000, 0, 1, &l, err, sizeof err) == 1);
    CHECK(cb_jobs_lease(j, l.client, "r:W", 1000, 0, 1, &l, err, sizeof err) == 2); /* one per worker */
    CHECK_MSG(strstr(err, "max_leases_per_worker") != NULL, "%s", err);
    CHECK(cb_jobs_lease(j, "A", "r:V", 1000, 10, 0, &l, err, sizeof err) == 1 && !strcmp(l.client, "B"));
    CHECK(cb_jobs_lease(j, "B", "r:V", 1000, 10, 0, &l, err, sizeof err) == 0); /* C's text is too long */
    CHECK(cb_jobs_lease(j, "B", "r:V", 1000, 0, 0, &l, err, sizeof err) == 1 && !strcmp(l.client, "C"));
    cb_jobs_close(&j);
}

TEST(leases_survive_a_reopen) {
    s_clock_skew_ms = 0;
    cb_jobs_t *j = fresh();
    CHECK(j);
    char job[33], err[256];
    cb_job_lease_t l;
    leased_job(j, job, &l);
    cb_jobs_close(&j);
    CHECK((j = cb_jobs_open(g_db, err, sizeof err)) != NULL);
    cb_job_lease_t l2;
    CHECK(cb_jobs_lease(j, NULL, "r:V", 1000, 0, 0, &l2, err, sizeof err) == 0);
    CHECK(cb_jobs_lease_renew(j, job, l.token, 1000, err, sizeof err) == 1);
    cb_jobs_close(&j);
}

TEST(global_cap) {
    cb_jobs_t *j = fresh();
    CHECK(j);
    cb_jobs_limits_t lim = {.max_jobs = 10, .max_total_jobs = 3};
    char job[33], a1[33], err[256];
    bool dup;
    CHECK(submit(j, "a1", "one", "A", &lim, a1, &dup) == 0);
    CHECK(submit(j, "b1", "two", "B", &lim, job, &dup) == 0);
    CHECK(submit(j, "c1", "three", "C", &lim, job, &dup) == 0);
    CHECK(cb_jobs_submit(j, "d1", 2, "four", 4, NULL, "D", &lim, job, &dup, NULL, err, sizeof err) == 1);
    CHECK_MSG(strstr(err, "precompute.max_queued_jobs = 3") != NULL, "%s", err); /* a new client too */
    CHECK(submit(j, "a1", "one", "A", &lim, job, &dup) == 0 && dup);                /* a duplicate: no room needed */
    cb_job_status_t st;
    cb_jobs_id("d1", 2, "four", 4, job);
    CHECK(cb_jobs_status(j, job, &st, err, sizeof err) == 0); /* nothing recorded */
    char last[CB_JOB_CLIENT_MAX + 1] = "";
    CHECK(turn(j, last, job) == 'a');
    finish(j, a1);
    CHECK(submit(j, "d1", "four", "D", &lim, job, &dup) == 0); /* room again */
    cb_jobs_close(&j);
    /* bytes: an empty queue takes one document, however big; then the cap holds for everyone */
    CHECK((j = fresh()) != NULL);
    cb_jobs_limits_t lb = {.max_total_bytes = 10};
    CHECK(submit(j, "big", "a document longer than ten bytes", "A", &lb, job, &dup) == 0);
    CHECK(cb_jobs_submit(j, "b", 1, "x", 1, NULL, "B", &lb, job, &dup, NULL, err, sizeof err) == 1);
    CHECK_MSG(strstr(err, "precompute.max_queued_bytes (10)") != NULL, "%s", err);
    cb_jobs_close(&j);
}

/* An ingest message {doc_id, text, client?, on_behalf_of?}, decoded (caller destroys). */
static cb_msg_t *ingest_msg(const char *client, const char *behalf) {
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_begin(w, "ingest", "1");
    cb_msg_put_str(w, "doc_id", "d");
    cb_msg_put_str(w, "text", "t");
    if (client) cb_msg_put_str(w, "client", client);
    if (behalf) cb_msg_put_str(w, "on_behalf_of", behalf);
    size_t len;
    const void *data = cb_msg_end(w, &len);
    char err[256];
    cb_msg_t *m = data ? cb_msg_decode(data, len, err, sizeof err) : NULL;
    cb_msg_writer_destroy(&w);
    return m;
}

/* who for (user_id, client, on_behalf_of): the code, *who set. */
static cb_err_t who_of(const pc_ident_t *id, const char *user_id, const char *client, const char *behalf, pc_who_t *who) {
    cb_msg_t *m = ingest_msg(client, behalf);
    char why[512] = "";
    static const uint8_t peer[5] = {0, 1, 2, 3, 4};
    cb_err_t rc = m ? pc_ident_resolve(id, m, user_id, peer, sizeof peer, who, why, sizeof why) : CB_ERR_INTERNAL;
    if (rc != CB_ERR_NONE) fprintf(stderr, "  (resolve: %s)\n", why);
    cb_msg_destroy(&m);
    return rc;
}

static char g_keys[300];
static cb_curve_t g_curve; /* curve on, keys of g_keys (cbctl's pair) */

/* A key set in /tmp, once. */
static bool keys(void) {
    if (g_curve.on) return true;
    snprintf(g_keys, sizeof g_keys, "/tmp/test_jobs.%d.keys", (int)getpid());
    char err[1024];
    if (cb_curve_keys_init(g_keys, true, err, sizeof err) != 1 || !cb_curve_load_client(&g_curve, g_keys, "cbctl", err, sizeof err)) {
        fprintf(stderr, "  keys: %s\n", err);
        return false;
    }
    return true;
}

/* The public key (Z85) of client identity name of g_keys. */
static void key_of(const char *name, char out[CB_CURVE_TXT]) {
    char path[1024], err[1024];
    cb_curve_path(path, sizeof path, g_keys, CB_CURVE_ALLOWED, name);
    if (!cb_curve_read(path, out, NULL, err, sizeof err)) out[0] = 0;
}

TEST(identity_is_the_curve_key) {
    if (!zmq_has("curve")) SKIP("libzmq without CURVE");
    CHECK(keys());
    char err[1024], cbctl[CB_CURVE_TXT], gw[CB_CURVE_TXT], blend[CB_CURVE_TXT];
    key_of("cbctl", cbctl);
    key_of("gateway", gw);
    key_of("blend", blend);
    CHECK(cbctl[0] && gw[0] && blend[0]);
    pc_ident_t *id = pc_ident_new(&g_curve, false, "gateway, nosuch", err, sizeof err); /* nosuch: warned, skipped */
    CHECK_MSG(id && pc_ident_forwarders(id) == 1, "%s", err);
    pc_who_t w;
    /* a key is one client whatever it declares; the declared name only narrows the identity */
    CHECK(who_of(id, cbctl, "c07", NULL, &w) == CB_ERR_NONE && w.authenticated);
    char want[CB_JOB_CLIENT_MAX + 1];
    snprintf(want, sizeof want, "k:%s", cbctl);
    CHECK(!strcmp(w.principal, want) && !strncmp(w.identity, want, strlen(want)) && !strcmp(w.identity + strlen(want), "/c07"));
    CHECK(who_of(id, cbctl, NULL, NULL, &w) == CB_ERR_NONE && !strcmp(w.principal, want) && !strcmp(w.identity, want));
    /* on_behalf_of: only from the trusted forwarder's key */
    CHECK(who_of(id, cbctl, NULL, "key:0123", &w) == CB_ERR_BAD_REQUEST);
    CHECK(who_of(id, blend, "x", "addr:10.0.0.1", &w) == CB_ERR_BAD_REQUEST);
    CHECK(who_of(id, gw, "x", "key:0123", &w) == CB_ERR_NONE && !strcmp(w.principal, "gateway:key:0123") &&
          !strcmp(w.identity, "gateway:key:0123/x"));
    snprintf(want, sizeof want, "k:%s", gw);
    CHECK(who_of(id, gw, NULL, NULL, &w) == CB_ERR_NONE && !strcmp(w.principal, want)); /* the gateway itself */
    /* a CURVE request without a key (a ZAP handler that named none) is refused, not trusted */
    CHECK(who_of(id, "", "c", NULL, &w) == CB_ERR_INTERNAL);
    pc_ident_destroy(&id);
    CHECK(!id);
    /* behind a broker: no key to see, the declared fields count */
    CHECK((id = pc_ident_new(&g_curve, true, "gateway", err, sizeof err)) != NULL);
    CHECK(who_of(id, "", "c", NULL, &w) == CB_ERR_NONE && !strcmp(w.principal, "c:c") && !w.authenticated);
    pc_ident_destroy(&id);
    /* bad forwarder names */
    CHECK(!pc_ident_new(&g_curve, false, "../x", err, sizeof err) && strstr(err, "not a key name"));
    CHECK(!pc_ident_new(&g_curve, false, "gateway gateway", err, sizeof err) && strstr(err, "twice"));
}

TEST(identity_without_curve_is_declared) {
    char err[256];
    cb_curve_t off = {0};
    pc_ident_t *id = pc_ident_new(&off, false, "gateway", err, sizeof err);
    CHECK(id && pc_ident_forwarders(id) == 0);
    pc_who_t w;
    CHECK(who_of(id, NULL, "A", NULL, &w) == CB_ERR_NONE && !strcmp(w.principal, "c:A") && !strcmp(w.identity, "c:A"));
    CHECK(who_of(id, NULL, "A", "addr:1.2.3.4", &w) == CB_ERR_NONE && !strcmp(w.principal, "f:addr:1.2.3.4") &&
          !strcmp(w.identity, "f:addr:1.2.3.4/A"));
    CHECK(who_of(id, NULL, NULL, NULL, &w) == CB_ERR_NONE && !strcmp(w.principal, "peer:0001020304"));
    cb_msg_t *m = ingest_msg(NULL, NULL);
    char why[256];
    CHECK(m && pc_ident_resolve(id, m, NULL, NULL, 0, &w, why, sizeof why) == CB_ERR_NONE && !strcmp(w.principal, "pull"));
    cb_msg_destroy(&m);
    CHECK(who_of(id, NULL, "", NULL, &w) == CB_ERR_BAD_REQUEST);         /* empty */
    CHECK(who_of(id, NULL, "tab\there", NULL, &w) == CB_ERR_BAD_REQUEST); /* not printable */
    pc_ident_destroy(&id);
}

/* Submits 20 one-unit documents, "flood-00".. from user_id declaring 20 clients, then the victim's document
 * from victim_id; *accepted counts the flood's; returns the turns taken before the victim's document is
 * picked (each flood document done in one turn), or -1. */
static int victim_turns(const pc_ident_t *id, const char *user_id, const char *victim_id, const cb_jobs_limits_t *lim,
                        int *accepted) {
    cb_jobs_t *j = fresh();
    if (!j) return -1;
    char job[33], victim[33], name[32];
    bool dup;
    *accepted = 0;
    pc_who_t w;
    for (int i = 0; i < 20; i++) {
        snprintf(name, sizeof name, "flood-%02d", i);
        if (who_of(id, user_id, name, NULL, &w) != CB_ERR_NONE) return -1;
        int rc = submit(j, name, "one chunk of flood", w.principal, lim, job, &dup);
        if (rc < 0) return -1;
        *accepted += rc == 0;
    }
    if (who_of(id, victim_id, "victim", NULL, &w) != CB_ERR_NONE ||
        submit(j, "victim", "the victim's one chunk", w.principal, lim, victim, &dup) != 0)
        return -1;
    char last[CB_JOB_CLIENT_MAX + 1] = "";
    int turns = 0;
    while (turn(j, last, job) != '-' && strcmp(job, victim) != 0) {
        finish(j, job);
        turns++;
    }
    cb_jobs_close(&j);
    return turns;
}

TEST(one_key_is_one_client_and_the_victim_waits_one_turn) {
    if (!zmq_has("curve")) SKIP("libzmq without CURVE");
    CHECK(keys());
    char err[1024], cbctl[CB_CURVE_TXT], other[CB_CURVE_TXT];
    key_of("cbctl", cbctl);
    key_of("retriever", other); /* a second allowed key: the victim */
    cb_jobs_limits_t lim = {.max_jobs = 6};
    cb_curve_t off = {0};
    pc_ident_t *plain = pc_ident_new(&off, false, "", err, sizeof err), *curve = pc_ident_new(&g_curve, false, "", err, sizeof err);
    CHECK(plain && curve);
    int acc_before = 0, acc_after = 0;
    int before = victim_turns(plain, NULL, NULL, &lim, &acc_before);
    int after = victim_turns(curve, cbctl, other, &lim, &acc_after);
    pc_ident_destroy(&plain);
    pc_ident_destroy(&curve);
    fprintf(stderr, "  20 ingests, 20 declared clients: without CURVE %d accepted, the victim's document waited %d "
            "turns; with CURVE (one key) %d accepted, the victim waited %d turn(s)\n", acc_before, before, acc_after,
            after);
    CHECK(acc_before == 20 && before == 20); /* declared clients are trusted without CURVE: the victim sorts last */
    CHECK(acc_after == 6 && after >= 0 && after <= 1);
}

int main(void) {
    RUN(submit_is_idempotent);
    RUN(turns_go_round_the_clients);
    RUN(versions_of_a_document_in_order);
    RUN(per_client_limits);
    RUN(restore_requeues_a_done_job);
    RUN(turn_state_survives_a_reopen);
    RUN(old_table_is_migrated);
    RUN(lease_grant_renew_expire_regrant);
    RUN(lease_expired_but_not_taken_over_still_holds);
    RUN(lease_progress_and_finished_once);
    RUN(local_pick_skips_leased_jobs);
    RUN(lease_limits_and_text_bound);
    RUN(leases_survive_a_reopen);
    RUN(global_cap);
    RUN(identity_is_the_curve_key);
    RUN(identity_without_curve_is_declared);
    RUN(one_key_is_one_client_and_the_victim_waits_one_turn);
    if (g_keys[0]) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_keys);
        if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", g_keys);
    }
    char p[300];
    unlink(g_db);
    snprintf(p, sizeof p, "%s-wal", g_db);
    unlink(p);
    snprintf(p, sizeof p, "%s-shm", g_db);
    unlink(p);
    return test_summary();
}
