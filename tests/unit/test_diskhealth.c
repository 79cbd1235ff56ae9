/* test_diskhealth: libshared/wire/diskhealth: the free-space threshold (statvfs of a watched directory,
 * several on one file system reported once), writes that failed on a full disk (held, forgotten on a later
 * success of the same kind, or after the hold), the error texts that mean "full", and the ping fields. */
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "wire/diskhealth.h"
#include "test.h"

TEST(threshold) {
    /* no file system has 2^50 bytes free: degraded; with no threshold: ok */
    cb_diskhealth_t *dh = cb_diskhealth_new((int64_t)1 << 50, 60000);
    CHECK(dh);
    CHECK(cb_diskhealth_watch(dh, "KV dir", "/tmp") == 0);
    CHECK(cb_diskhealth_watch_file(dh, "job table", "/tmp/x/../jobs.db") == 0); /* its dir: /tmp/x/.. */
    char why[1024];
    int64_t fb = -2;
    bool bad = cb_diskhealth_check(dh, why, sizeof why, &fb);
    CHECK(bad);
    CHECK(fb >= 0);
    CHECK_MSG(strstr(why, "data disk full: ") == why, "%s", why);
    CHECK_MSG(strstr(why, "the KV dir /tmp") && strstr(why, "statvfs") && strstr(why, "min_free_mb"), "%s", why);
    cb_diskhealth_destroy(&dh);
    CHECK(!dh);
    dh = cb_diskhealth_new(0, 60000);
    CHECK(dh && cb_diskhealth_watch(dh, "KV dir", "/tmp") == 0);
    CHECK(!cb_diskhealth_check(dh, why, sizeof why, &fb) && why[0] == 0 && fb >= 0);
    cb_diskhealth_destroy(&dh);
}

TEST(one_file_system_once) {
    cb_diskhealth_t *dh = cb_diskhealth_new((int64_t)1 << 50, 0);
    CHECK(dh);
    cb_diskhealth_watch(dh, "job table", "/tmp");
    cb_diskhealth_watch(dh, "KV dir", "/tmp/.");
    char why[1024];
    CHECK(cb_diskhealth_check(dh, why, sizeof why, NULL));
    const char *p = strstr(why, "free on the file system of");
    CHECK_MSG(p && !strstr(p + 1, "free on the file system of"), "%s", why);
    CHECK_MSG(strstr(why, "the job table /tmp and the KV dir /tmp/."), "%s", why);
    cb_diskhealth_destroy(&dh);
}

TEST(failed_writes) {
    cb_diskhealth_t *dh = cb_diskhealth_new(0, 60000);
    CHECK(dh);
    cb_diskhealth_watch(dh, "KV dir", "/tmp");
    char why[1024];
    CHECK(!cb_diskhealth_check(dh, why, sizeof why, NULL));
    /* a message that is not about space is not recorded */
    CHECK(!cb_diskhealth_note(dh, "job table", "SQLite: database is locked"));
    CHECK(!cb_diskhealth_check(dh, why, sizeof why, NULL));
    CHECK(cb_diskhealth_note(dh, "job table", "cannot record the document: SQLite: database or disk is full"));
    CHECK(cb_diskhealth_check(dh, why, sizeof why, NULL));
    CHECK_MSG(strstr(why, "a write to the job table failed 0 s ago: cannot record the document"), "%s", why);
    cb_diskhealth_failed(dh, "KV dir", "kvfile write: x.kv.tmp.1: No space left on device");
    CHECK(cb_diskhealth_check(dh, why, sizeof why, NULL));
    CHECK_MSG(strstr(why, "job table") && strstr(why, "KV dir failed"), "%s", why);
    /* a success of one kind forgets that kind only */
    cb_diskhealth_ok(dh, "job table");
    CHECK(cb_diskhealth_check(dh, why, sizeof why, NULL));
    CHECK_MSG(!strstr(why, "job table") && strstr(why, "No space left on device"), "%s", why);
    cb_diskhealth_ok(dh, "KV dir");
    CHECK(!cb_diskhealth_check(dh, why, sizeof why, NULL));
    cb_diskhealth_ok(dh, "KV dir"); /* nothing to forget */
    cb_diskhealth_destroy(&dh);
    /* the hold: a failure older than hold_ms counts no more */
    dh = cb_diskhealth_new(0, 50);
    CHECK(dh);
    cb_diskhealth_failed(dh, "database", NULL);
    CHECK(cb_diskhealth_check(dh, why, sizeof why, NULL) && strstr(why, "the disk is full"));
    usleep(120 * 1000);
    CHECK(!cb_diskhealth_check(dh, why, sizeof why, NULL));
    cb_diskhealth_destroy(&dh);
}

TEST(full_texts) {
    CHECK(cb_diskhealth_full_errno(ENOSPC));
#ifdef EDQUOT
    CHECK(cb_diskhealth_full_errno(EDQUOT));
    CHECK(cb_diskhealth_full_msg(strerror(EDQUOT)));
#endif
    CHECK(!cb_diskhealth_full_errno(EIO));
    CHECK(cb_diskhealth_full_msg("write: No space left on device"));
    CHECK(cb_diskhealth_full_msg("SQLite: database or disk is full"));
    CHECK(!cb_diskhealth_full_msg("SQLite: disk I/O error"));
    CHECK(!cb_diskhealth_full_msg(NULL) && !cb_diskhealth_full_msg(""));
    uint64_t avail = 0;
    CHECK(cb_diskhealth_room("/tmp", 0, &avail) || avail < (1u << 20));
    CHECK(!cb_diskhealth_room("/tmp", UINT64_MAX / 2, &avail));
    CHECK(cb_diskhealth_room("/no/such/dir", UINT64_MAX / 2, &avail) && avail == UINT64_MAX);
}

TEST(reason_is_utf8) {
    /* a path with bytes that are not UTF-8 and a cut character: the reason is still well-formed */
    cb_diskhealth_t *dh = cb_diskhealth_new((int64_t)1 << 50, 60000);
    CHECK(dh);
    cb_diskhealth_watch(dh, "KV dir", "/tmp");
    cb_diskhealth_failed(dh, "job\xff table", "caf\xc3");
    char why[80]; /* cut somewhere in the middle */
    CHECK(cb_diskhealth_check(dh, why, sizeof why, NULL));
    CHECK(cb_msg_utf8_valid(why, strlen(why)));
    char big[1024];
    CHECK(cb_diskhealth_check(dh, big, sizeof big, NULL));
    CHECK_MSG(cb_msg_utf8_valid(big, strlen(big)) && strstr(big, "job? table") && strstr(big, "caf?"), "%s", big);
    cb_diskhealth_destroy(&dh);
}

TEST(ping_fields) {
    cb_msg_writer_t *w = cb_msg_writer_new();
    CHECK(w);
    cb_diskhealth_t *dh = cb_diskhealth_new((int64_t)1 << 50, 60000);
    cb_diskhealth_watch(dh, "KV dir", "/tmp");
    char err[256];
    for (int round = 0; round < 3; round++) {
        cb_msg_begin(w, "ping", "p1");
        cb_diskhealth_put(round == 0 ? dh : round == 1 ? NULL : dh, w);
        size_t len;
        const void *data = cb_msg_end(w, &len);
        CHECK(data);
        cb_msg_t *m = cb_msg_decode(data, len, err, sizeof err);
        CHECK_MSG(m, "%s", err);
        char st[16] = "";
        CHECK(cb_msg_str_copy(m, "status", 15, st, sizeof st));
        int64_t fb = -1;
        if (round == 1) {
            CHECK(!strcmp(st, "ok") && !cb_msg_has(m, "reason") && !cb_msg_has(m, "disk_free_bytes"));
        } else {
            CHECK(!strcmp(st, "degraded") && cb_msg_has(m, "reason"));
            CHECK(cb_msg_int(m, "disk_free_bytes", 0, INT64_MAX, &fb) && fb >= 0);
        }
        cb_msg_destroy(&m);
    }
    cb_diskhealth_destroy(&dh);
    cb_diskhealth_destroy(&dh); /* NULL-safe */
    cb_msg_writer_destroy(&w);
}

int main(void) {
    RUN(threshold);
    RUN(one_file_system_once);
    RUN(failed_writes);
    RUN(full_texts);
    RUN(reason_is_utf8);
    RUN(ping_fields);
    return test_summary();
}
