/* test_backend_select: the backend choice (auto|cpu|cuda) and, in a CUDA build, how the CUDA backend
 * library is found and loaded (backend_select.h "Loading"). The tests run in this order on purpose: the
 * last one loads libcbcuda.so (and cuBLAS) into the process, the ones before check that nothing else does. */
#include <limits.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/backend_select.h"
#include "model/model.h"
#include "test.h"

/* A small geometry for the backends that need no model file. */
static cb_hparams_t tiny_hp(void) {
    cb_hparams_t hp;
    memset(&hp, 0, sizeof hp);
    snprintf(hp.arch, sizeof hp.arch, "llama");
    hp.n_layer = 2, hp.n_embd = 64, hp.n_head = 4, hp.n_head_kv = 2, hp.head_dim = 16, hp.n_ff = 96;
    hp.n_vocab = 80, hp.n_ctx_train = 256, hp.n_rot = 16, hp.rope_base = 10000.0f, hp.rms_eps = 1e-5f;
    hp.bos_id = hp.eos_id = hp.eot_id = -1;
    return hp;
}

/* True when a mapping of this process names a file containing `needle` (/proc/self/maps). */
static bool mapped(const char *needle) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return false;
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) found = strstr(line, needle) != NULL;
    fclose(f);
    return found;
}

/* Resident set size of this process in kB (VmRSS), -1 when unreadable. */
static long rss_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &kb) == 1) break;
    fclose(f);
    return kb;
}

TEST(test_parse) {
    cb_backend_kind_t k;
    CHECK(cb_backend_kind_parse("auto", &k) && k == CB_BACKEND_AUTO);
    CHECK(cb_backend_kind_parse("cpu", &k) && k == CB_BACKEND_CPU);
    CHECK(cb_backend_kind_parse("cuda", &k) && k == CB_BACKEND_CUDA);
    CHECK(!cb_backend_kind_parse("gpu", &k));
    CHECK(!cb_backend_kind_parse(NULL, &k));
    CHECK(strcmp(cb_backend_kind_name(CB_BACKEND_CUDA), "cuda") == 0);
}

/* Without a device: auto is the CPU backend, cuda a clear error, and neither maps the CUDA libraries. */
TEST(test_select_no_device) {
    if (cb_backend_cuda_devices() > 0) SKIP("a CUDA device is present");
    cb_hparams_t hp = tiny_hp();
    char err[512] = "";
    cb_backend_kind_t got = CB_BACKEND_CUDA;
    long rss0 = rss_kb();
    cb_backend_t *be = cb_backend_select(CB_BACKEND_AUTO, &hp, 8, 64, 1, &got, err, sizeof err);
    CHECK_MSG(be && got == CB_BACKEND_CPU, "%s", err);
    cb_backend_destroy(&be);
    be = cb_backend_select(CB_BACKEND_CUDA, &hp, 8, 64, 1, &got, err, sizeof err);
    CHECK(be == NULL);
    CHECK_MSG(strstr(err, "backend cuda: ") == err && strlen(err) > strlen("backend cuda: "), "%s", err);
    fprintf(stderr, "  cuda without a device: %s\n", err);
    /* the point of loading on demand: cuBLAS, the CUDA runtime and the backend library stay out */
    CHECK(!mapped("libcublas"));
    CHECK(!mapped("libcudart"));
    CHECK(!mapped("libcbcuda"));
    long rss1 = rss_kb();
    fprintf(stderr, "  VmRSS %ld kB before, %ld kB after selecting twice\n", rss0, rss1);
    CHECK(rss0 < 0 || rss1 - rss0 < 32 * 1024);
}

TEST(test_select_model) {
    const char *path = test_model_path();
    if (!path) SKIP("model absent");
    char err[512];
    cb_model_t *m = cb_model_load(path, err, sizeof err);
    CHECK_MSG(m, "%s", err);
    cb_backend_kind_t got = CB_BACKEND_AUTO;
    cb_backend_t *be = cb_backend_select(CB_BACKEND_CPU, cb_model_hparams(m), 8, 64, 1, &got, err, sizeof err);
    CHECK_MSG(be && got == CB_BACKEND_CPU, "%s", err);
    cb_backend_destroy(&be);
    CHECK(be == NULL);
    /* auto always gives something: CUDA where a device is, else CPU */
    be = cb_backend_select(CB_BACKEND_AUTO, cb_model_hparams(m), 8, 64, 1, &got, err, sizeof err);
    CHECK_MSG(be, "%s", err);
    CHECK(got == (cb_backend_cuda_devices() > 0 ? CB_BACKEND_CUDA : CB_BACKEND_CPU));
    cb_backend_destroy(&be);
    /* cuda without a device is a clear error, not a crash */
    if (cb_backend_cuda_devices() == 0) {
        be = cb_backend_select(CB_BACKEND_CUDA, cb_model_hparams(m), 8, 64, 1, &got, err, sizeof err);
        CHECK(be == NULL);
        CHECK(strstr(err, "cuda") != NULL);
    }
    cb_model_destroy(&m);
}

/* Libraries that are not the CUDA backend: each a message, never a crash, nothing left mapped. */
TEST(test_lib_errors) {
    char err[1024] = "", where[512] = "";
#ifndef CB_HAVE_CUDA
    CHECK(cb_backend_cuda_lib_check(NULL, where, sizeof where, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, "no CUDA backend"), "%s", err);
    SKIP("this build has no CUDA backend");
#else
    /* $CB_CUDA_LIB naming nothing */
    setenv("CB_CUDA_LIB", "/nonexistent/libcbcuda.so", 1);
    CHECK(cb_backend_cuda_lib_check(NULL, where, sizeof where, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, "CB_CUDA_LIB=/nonexistent/libcbcuda.so") && strstr(err, "cannot load"), "%s", err);
    fprintf(stderr, "  %s\n", err);
    /* a file that is not a shared object */
    char bogus[] = "/tmp/cb_test_cudalib_XXXXXX";
    int fd = mkstemp(bogus);
    CHECK(fd >= 0);
    CHECK(write(fd, "not an ELF file\n", 16) == 16);
    close(fd);
    setenv("CB_CUDA_LIB", bogus, 1);
    int rc = cb_backend_cuda_lib_check(NULL, where, sizeof where, err, sizeof err);
    unlink(bogus);
    CHECK(rc == -1);
    CHECK_MSG(strstr(err, "cannot load the CUDA backend library"), "%s", err);
    fprintf(stderr, "  %s\n", err);
    unsetenv("CB_CUDA_LIB");
    /* a real shared object without the entry points */
    rc = cb_backend_cuda_lib_check("libm.so.6", where, sizeof where, err, sizeof err);
    CHECK(rc == -1);
    CHECK_MSG(strstr(err, "lacks cb_backend_cuda_new"), "%s", err);
    fprintf(stderr, "  %s\n", err);
    /* an explicit path that does not exist */
    CHECK(cb_backend_cuda_lib_check("/nonexistent.so", where, sizeof where, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, "/nonexistent.so"), "%s", err);
    CHECK(!mapped("libcublas"));
#endif
}

/* The library this build made (build/lib/libcbcuda.so, found next to build/tests) opens with every symbol
 * bound now: the libshared functions it calls resolve against this program (linked like every other). The
 * device part cannot run here without a GPU, but the resolution can. Last: it maps cuBLAS. */
TEST(test_lib_resolves) {
#ifndef CB_HAVE_CUDA
    SKIP("this build has no CUDA backend");
#else
    char err[1024] = "", where[512] = "";
    unsetenv("CB_CUDA_LIB");
    int rc = cb_backend_cuda_lib_check(NULL, where, sizeof where, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    fprintf(stderr, "  loaded %s\n", where);
    CHECK_MSG(strstr(where, "/../lib/libcbcuda.so"), "%s", where);
    CHECK(mapped("libcbcuda.so"));
    CHECK(mapped("libcublas"));
    /* the same through $CB_CUDA_LIB */
    char path[600];
    snprintf(path, sizeof path, "%s", where);
    setenv("CB_CUDA_LIB", path, 1);
    rc = cb_backend_cuda_lib_check(NULL, where, sizeof where, err, sizeof err);
    unsetenv("CB_CUDA_LIB");
    CHECK_MSG(rc == 0 && strcmp(where, path) == 0, "%s", err);
#endif
}

/* The child of test_fake_driver, run with build/tests/fakecuda (a driver reporting one device) on
 * LD_LIBRARY_PATH: the library is loaded because a device is reported, the CUDA runtime then finds none
 * usable, and that is the reason given. Exit status 0 when everything held; messages on stderr. */
static int fake_driver_child(bool no_lib) {
    cb_hparams_t hp = tiny_hp();
    char err[1024] = "";
    cb_backend_kind_t got = CB_BACKEND_CUDA;
    if (no_lib) setenv("CB_CUDA_LIB", "/nonexistent/libcbcuda.so", 1);
    cb_backend_t *be = cb_backend_select(CB_BACKEND_CUDA, &hp, 8, 64, 1, &got, err, sizeof err);
    fprintf(stderr, "  fake driver%s: %s\n", no_lib ? ", CB_CUDA_LIB=/nonexistent" : "", err);
    if (be) return 1;
    const char *want = no_lib ? "backend cuda: CB_CUDA_LIB=/nonexistent/libcbcuda.so: cannot load"
                              : "backend cuda: the CUDA runtime finds no usable device";
    if (strstr(err, want) != err) return 2;
    if (!no_lib && !mapped("libcbcuda.so")) return 3; /* a device was reported: the library was loaded */
    if (no_lib && mapped("libcublas")) return 4;
    be = cb_backend_select(CB_BACKEND_AUTO, &hp, 8, 64, 1, &got, err, sizeof err);
    if (!be || got != CB_BACKEND_CPU) return 5;
    cb_backend_destroy(&be);
    return cb_backend_cuda_devices() == 0 ? 0 : 6;
}

/* A driver that says a device is there, and a CUDA runtime that cannot use it: each child process decides
 * once, so each case runs in a fresh process (this program again, with LD_LIBRARY_PATH set). */
TEST(test_fake_driver) {
#ifndef CB_HAVE_CUDA
    SKIP("this build has no CUDA backend");
#else
    char exe[PATH_MAX], dir[PATH_MAX + 16];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    CHECK(n > 0);
    exe[n] = '\0';
    snprintf(dir, sizeof dir, "%s", exe);
    char *slash = strrchr(dir, '/');
    CHECK(slash);
    snprintf(slash, sizeof dir - (size_t)(slash - dir), "/fakecuda");
    char lib[PATH_MAX + 64];
    snprintf(lib, sizeof lib, "%s/libcuda.so.1", dir);
    if (access(lib, R_OK) != 0) SKIP("build/tests/fakecuda/libcuda.so.1 not built");
    const char *modes[] = {"--fake-driver", "--fake-driver-nolib"};
    for (int i = 0; i < 2; i++) {
        fflush(stdout), fflush(stderr);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            setenv("LD_LIBRARY_PATH", dir, 1);
            unsetenv("CB_CUDA_LIB");
            execl(exe, exe, modes[i], (char *)NULL);
            _exit(127);
        }
        int status = 0;
        CHECK(waitpid(pid, &status, 0) == pid);
        CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s: child status %d", modes[i], status);
    }
#endif
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--fake-driver") == 0) return fake_driver_child(false);
    if (argc == 2 && strcmp(argv[1], "--fake-driver-nolib") == 0) return fake_driver_child(true);
    RUN(test_parse);
    RUN(test_select_no_device);
    RUN(test_select_model);
    RUN(test_lib_errors);
    RUN(test_fake_driver);
    RUN(test_lib_resolves);
    return test_summary();
}
