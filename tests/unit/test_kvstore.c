/* test_kvstore: a KV path the store refuses is reported with its concrete reason (libshared/kv/kvstore.c).
 *   - kv_dir: missing, a FIFO, a symbolic link to a FIFO, a dangling link: cb_kvstore_new's error names the
 *     failed check, errno's text and what lstat finds (type, mode, owner; a link's target and what it is);
 *   - a chunk's file name holding a symbolic link to a FIFO, a FIFO, a directory: the logged miss names the
 *     reader's refusal and what lstat finds there; the chunk is computed and stored all the same, and a
 *     link's target is never written through;
 *   - the shard directory a symbolic link: the store's error (cb_kvstore_compute with store) says so.
 * Runs on a tiny synthetic model (2 layers), so it is fast and needs no model file.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"
#include "engine/engine.h"
#include "format/kvfile.h"
#include "kv/kvstore.h"
#include "model/model.h"
#include "model/synth.h"
#include "test.h"

static cb_model_t *g_model;
static cb_engine_t *g_eng;
static char g_setup_err[512];
static char g_tmp[64]; /* the test's directory: kv/, the FIFOs, the captured log */

static int setup(void) {
    if (g_eng) return 1;
    if (g_setup_err[0]) return 0;
    char err[256] = "", path[128];
    snprintf(g_tmp, sizeof g_tmp, "/tmp/test_kvstore.XXXXXX");
    if (!mkdtemp(g_tmp)) {
        snprintf(g_setup_err, sizeof g_setup_err, "mkdtemp: %s", strerror(errno));
        return 0;
    }
    cb_synth_shape_t s;
    memset(&s, 0, sizeof s);
    snprintf(s.name, sizeof s.name, "test-kvstore");
    s.n_layer = 2, s.n_embd = 64, s.n_head = 2, s.n_head_kv = 1, s.n_ff = 128, s.n_vocab = 512, s.n_ctx = 256;
    s.rope_base = 10000.0f, s.rms_eps = 1e-5f, s.tied = true;
    snprintf(path, sizeof path, "%s/synth.gguf", g_tmp);
    if (cb_synth_write(path, &s, CB_SYNTH_F32, 7, err, sizeof err) == 0) g_model = cb_model_load(path, err, sizeof err);
    unlink(path);
    if (g_model) g_eng = cb_engine_new(g_model, 128, err, sizeof err);
    if (!g_eng) snprintf(g_setup_err, sizeof g_setup_err, "%s", err[0] ? err : "no engine");
    if (g_eng) cb_engine_set_threads(g_eng, 1);
    return g_eng != NULL;
}

#define SETUP() CHECK_MSG(setup(), "setup: %s", g_setup_err)

static char *tmp_path(char *buf, size_t cap, const char *name) {
    snprintf(buf, cap, "%s/%s", g_tmp, name);
    return buf;
}

/* ---------------------------------------------------------------- stderr capture (the log) */

static int g_saved_fd = -1;

static void capture_begin(void) {
    char p[128];
    fflush(stderr);
    int fd = open(tmp_path(p, sizeof p, "log.txt"), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    g_saved_fd = dup(2);
    if (fd >= 0) {
        dup2(fd, 2);
        close(fd);
    }
}

/* Ends the capture; the log's text into buf. */
static void capture_end(char *buf, size_t cap) {
    char p[128];
    fflush(stderr);
    if (g_saved_fd >= 0) {
        dup2(g_saved_fd, 2);
        close(g_saved_fd);
        g_saved_fd = -1;
    }
    buf[0] = 0;
    FILE *f = fopen(tmp_path(p, sizeof p, "log.txt"), "r");
    if (!f) return;
    size_t n = fread(buf, 1, cap - 1, f);
    buf[n] = 0;
    fclose(f);
    fputs(buf, stderr); /* kept in the test's log */
}

/* ---------------------------------------------------------------- kv_dir */

TEST(kv_dir_refusals_name_the_reason) {
    SETUP();
    char err[1024], p[128], fifo[128], link[128];
    CHECK(cb_kvstore_new(g_eng, tmp_path(p, sizeof p, "missing"), NULL, CB_KV_F16, err, sizeof err) == NULL);
    CHECK_MSG(strstr(err, "stat: No such file or directory") && strstr(err, "lstat: No such file"), "%s", err);

    CHECK(mkfifo(tmp_path(fifo, sizeof fifo, "dir.fifo"), 0640) == 0);
    CHECK(cb_kvstore_new(g_eng, fifo, NULL, CB_KV_F16, err, sizeof err) == NULL);
    CHECK_MSG(strstr(err, "not a directory: a FIFO") && strstr(err, "mode 0640") && strstr(err, "uid "), "%s", err);

    CHECK(symlink(fifo, tmp_path(link, sizeof link, "dir.link")) == 0);
    CHECK(cb_kvstore_new(g_eng, link, NULL, CB_KV_F16, err, sizeof err) == NULL);
    CHECK_MSG(strstr(err, "not a directory: a FIFO") && strstr(err, "lstat: a symbolic link") && strstr(err, fifo) &&
                  strstr(err, "(a FIFO)"),
              "%s", err);

    CHECK(symlink(tmp_path(p, sizeof p, "nowhere"), tmp_path(link, sizeof link, "dangling.link")) == 0);
    CHECK(cb_kvstore_new(g_eng, link, NULL, CB_KV_F16, err, sizeof err) == NULL);
    CHECK_MSG(strstr(err, "lstat: a symbolic link") && strstr(err, "nowhere") &&
                  strstr(err, "(stat: No such file or directory)"),
              "%s", err);
    unlink(fifo);
}

/* ---------------------------------------------------------------- a chunk's file name */

static const int32_t g_ctx[4] = {1, 300, 301, 302};
static const int32_t g_chunk[6] = {310, 311, 312, 313, 314, 315};

/* A store over kv (made fresh), its context set, and the path of g_chunk's file (its shard made). */
static cb_kvstore_t *open_store(const char *kv, char *path, size_t cap) {
    char err[512] = "", cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", kv, kv);
    if (system(cmd) != 0) return NULL;
    cb_kvstore_t *st = cb_kvstore_new(g_eng, kv, NULL, CB_KV_F16, err, sizeof err);
    if (!st || cb_kvstore_set_context(st, g_ctx, 4, err, sizeof err) != 0) {
        fprintf(stderr, "  store: %s\n", err);
        cb_kvstore_destroy(&st);
        return NULL;
    }
    uint8_t key[32];
    cb_kvstore_chunk_key(st, g_ctx, 4, g_chunk, 6, key);
    if (cb_kvstore_path(st, key, path, cap) != 0) {
        cb_kvstore_destroy(&st);
        return NULL;
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    mkdir(dir, 0755);
    return st;
}

/* Resolves g_chunk with the log captured into log[cap]; the source it came from, or -1. */
static int resolve_logged(cb_kvstore_t *st, char *log, size_t cap) {
    char err[512] = "";
    cb_kvstore_chunk_t c;
    cb_log_set_level(CB_LOG_WARN);
    capture_begin();
    int rc = cb_kvstore_resolve(st, g_chunk, 6, false, &c, err, sizeof err);
    capture_end(log, cap);
    if (rc != 0) {
        fprintf(stderr, "  resolve: %s\n", err);
        return -1;
    }
    int src = (int)c.src;
    cb_kvstore_chunk_release(&c);
    return src;
}

static bool is_regular(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0 && S_ISREG(st.st_mode);
}

TEST(chunk_path_refusals_are_logged_with_the_reason) {
    SETUP();
    char kv[128], path[4096], fifo[128], log[8192];
    tmp_path(kv, sizeof kv, "kv");
    cb_kvstore_t *st = open_store(kv, path, sizeof path);
    CHECK(st != NULL);

    /* 1. a symbolic link to a FIFO: not followed, and said so, with the link's target and what it is */
    tmp_path(fifo, sizeof fifo, "target.fifo");
    unlink(fifo);
    CHECK(mkfifo(fifo, 0600) == 0);
    CHECK(symlink(fifo, path) == 0);
    int src = resolve_logged(st, log, sizeof log);
    CHECK(src == CB_KVSTORE_COMPUTED);
    CHECK_MSG(strstr(log, "chunk file miss (not_regular)") && strstr(log, "a symbolic link (not followed)") &&
                  strstr(log, "lstat: a symbolic link") && strstr(log, fifo) && strstr(log, "(a FIFO)"),
              "log: %s", log);
    CHECK_MSG(is_regular(path), "the computed chunk replaced the link with its file");
    struct stat fs;
    CHECK(lstat(fifo, &fs) == 0 && S_ISFIFO(fs.st_mode)); /* the target was not written through */

    /* 2. a FIFO itself: its type and mode */
    CHECK(unlink(path) == 0);
    CHECK(mkfifo(path, 0604) == 0);
    src = resolve_logged(st, log, sizeof log);
    CHECK(src == CB_KVSTORE_COMPUTED);
    CHECK_MSG(strstr(log, "chunk file miss (not_regular)") && strstr(log, "not a regular file (a FIFO)") &&
                  strstr(log, "lstat: a FIFO, mode 0604, uid "),
              "log: %s", log);

    /* 3. a directory (empty: the writer replaces it) */
    CHECK(unlink(path) == 0);
    CHECK(mkdir(path, 0750) == 0);
    src = resolve_logged(st, log, sizeof log);
    CHECK(src == CB_KVSTORE_COMPUTED);
    CHECK_MSG(strstr(log, "chunk file miss (not_regular)") && strstr(log, "lstat: a directory, mode 0750"), "log: %s",
              log);
    CHECK(is_regular(path));

    /* 4. the file now there is used: nothing logged */
    src = resolve_logged(st, log, sizeof log);
    CHECK(src == CB_KVSTORE_FILE);
    CHECK_MSG(strstr(log, "chunk file miss") == NULL, "log: %s", log);
    cb_kvstore_destroy(&st);
    unlink(fifo);
}

TEST(store_error_names_a_linked_shard_directory) {
    SETUP();
    char kv[128], path[4096], real[128], err[1024] = "";
    tmp_path(kv, sizeof kv, "kv2");
    cb_kvstore_t *st = open_store(kv, path, sizeof path);
    CHECK(st != NULL);
    /* the shard directory replaced by a link to a directory elsewhere: nothing is written through it */
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    *strrchr(dir, '/') = 0;
    CHECK(rmdir(dir) == 0);
    tmp_path(real, sizeof real, "elsewhere");
    mkdir(real, 0755);
    CHECK(symlink(real, dir) == 0);
    cb_log_set_level(CB_LOG_ERROR);
    cb_kvmem_entry_t *e = cb_kvstore_compute(st, g_ctx, 4, g_chunk, 6, true, err, sizeof err);
    CHECK(e == NULL);
    CHECK_MSG(strstr(err, "symbolic link") && strstr(err, dir), "%s", err);
    CHECK(cb_kvstore_write_failures(st) == 1);
    cb_kvstore_destroy(&st);
}

int main(void) {
    cb_log_set_component("test_kvstore");
    RUN(kv_dir_refusals_name_the_reason);
    RUN(chunk_path_refusals_are_logged_with_the_reason);
    RUN(store_error_names_a_linked_shard_directory);
    cb_engine_destroy(&g_eng);
    cb_model_destroy(&g_model);
    if (g_tmp[0]) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
        if (system(cmd) != 0) fprintf(stderr, "  cleanup of %s failed\n", g_tmp);
    }
    return test_summary();
}
