/* test_config: libshared/config: ZPL file, environment and flag precedence, common fallback, typed
 * getters and their errors, argv handling, and the shipped config/cacheblend.cfg. */
#include <stdlib.h>
#include <unistd.h>

#include "wire/config.h"
#include "svc/engine_config.h"
#include "svc/svcconfig.h"
#include "test.h"
#include "wire/query.h"

static char s_path[64];

static void write_cfg(const char *text) {
    snprintf(s_path, sizeof s_path, "/tmp/cb_test_config_%d.cfg", (int)getpid());
    FILE *f = fopen(s_path, "w");
    fputs(text, f);
    fclose(f);
}

static const char *CFG =
    "# test\n"
    "common\n"
    "    data_dir = \"var\"     # comment after a value\n"
    "    kv_dir = \"kv\"\n"
    "    max_msg_bytes = 8M\n"
    "    request_timeout_ms = 2500\n"
    "    flag = yes\n"
    "retriever\n"
    "    endpoint = \"tcp://127.0.0.1:5551\"\n"
    "    bind = \"\"\n"
    "    max_k = 50\n"
    "    db = \"retriever.db\"\n"
    "    request_timeout_ms = 100\n"
    "blend\n"
    "    ratio = 0.15\n"
    "    endpoint = \"tcp://127.0.0.1:5555\"\n";

static void clear_env(void) {
    unsetenv("CB_RETRIEVER_MAX_K");
    unsetenv("CB_COMMON_REQUEST_TIMEOUT_MS");
    unsetenv("CB_RETRIEVER_REQUEST_TIMEOUT_MS");
    unsetenv("CB_DATA_DIR");
    unsetenv("CB_COMMON_DATA_DIR");
    unsetenv("CB_CONFIG");
    unsetenv("CB_BLEND_RATIO");
    unsetenv("CB_COMMON_CURVE");
    unsetenv("CB_COMMON_KEYS_DIR");
    unsetenv("CB_ENGINE_KV_DTYPE");
}

TEST(file_values_and_types) {
    clear_env();
    write_cfg(CFG);
    char err[256];
    cb_config_t *cfg = cb_config_load(s_path, "retriever", err, sizeof err);
    CHECK_MSG(cfg, "%s", err);
    CHECK(strcmp(cb_config_file(cfg), s_path) == 0);
    int64_t v;
    CHECK(cb_config_int(cfg, "retriever", "max_k", 1, 1000, 5, &v, err, sizeof err) && v == 50);
    CHECK(cb_config_int(cfg, "retriever", "max_msg_bytes", 1, INT64_MAX, 1, &v, err, sizeof err) && v == 8 << 20);
    CHECK(cb_config_int(cfg, "retriever", "nonexistent", 1, 10, 7, &v, err, sizeof err) && v == 7);
    /* own section beats common */
    CHECK(cb_config_int(cfg, "retriever", "request_timeout_ms", 1, 100000, 1, &v, err, sizeof err) && v == 100);
    CHECK(cb_config_int(cfg, "blend", "request_timeout_ms", 1, 100000, 1, &v, err, sizeof err) && v == 2500);
    double d;
    CHECK(cb_config_double(cfg, "blend", "ratio", 0, 1, 0.5, &d, err, sizeof err) && fabs(d - 0.15) < 1e-12);
    bool b;
    CHECK(cb_config_bool(cfg, "retriever", "flag", false, &b, err, sizeof err) && b);
    const char *s;
    CHECK(cb_config_str(cfg, "common", "data_dir", NULL, &s, err, sizeof err) && strcmp(s, "var") == 0);
    CHECK(!cb_config_str(cfg, "common", "missing", NULL, &s, err, sizeof err) && strstr(err, "not set"));
    CHECK(cb_config_endpoint(cfg, "retriever", "endpoint", NULL, &s, err, sizeof err) &&
          strcmp(s, "tcp://127.0.0.1:5551") == 0);
    /* empty bind: default used */
    CHECK(cb_config_endpoint(cfg, "retriever", "bind", NULL, &s, err, sizeof err) && s == NULL);
    char path[256];
    CHECK(cb_config_data_path(cfg, "retriever", "db", NULL, path, sizeof path, err, sizeof err) &&
          strcmp(path, "var/retriever.db") == 0);
    CHECK(cb_config_data_path(cfg, "common", "data_dir", NULL, path, sizeof path, err, sizeof err) &&
          strcmp(path, "var") == 0);
    cb_config_src_t src;
    const char *from;
    CHECK(cb_config_raw(cfg, "blend", "max_msg_bytes", &src, &from) && src == CB_CONFIG_SRC_FILE &&
          strcmp(from, "common") == 0);
    cb_config_destroy(&cfg);
    CHECK(cfg == NULL);
    cb_config_destroy(&cfg);
    unlink(s_path);
}

TEST(bad_values) {
    clear_env();
    write_cfg(CFG);
    char err[256];
    cb_config_t *cfg = cb_config_load(s_path, "retriever", err, sizeof err);
    CHECK(cfg);
    int64_t v;
    CHECK(!cb_config_int(cfg, "retriever", "max_k", 1, 10, 5, &v, err, sizeof err));
    CHECK_MSG(strstr(err, "retriever.max_k") && strstr(err, "[1, 10]") && strstr(err, s_path), "%s", err);
    setenv("CB_RETRIEVER_MAX_K", "12abc", 1);
    CHECK(!cb_config_int(cfg, "retriever", "max_k", 1, 100, 5, &v, err, sizeof err));
    CHECK_MSG(strstr(err, "CB_RETRIEVER_MAX_K") && strstr(err, "12abc"), "%s", err);
    setenv("CB_RETRIEVER_MAX_K", "99999999999999999999", 1);
    CHECK(!cb_config_int(cfg, "retriever", "max_k", 1, INT64_MAX, 5, &v, err, sizeof err));
    setenv("CB_RETRIEVER_MAX_K", "9000000000000T", 1); /* overflow with the suffix */
    CHECK(!cb_config_int(cfg, "retriever", "max_k", 1, INT64_MAX, 5, &v, err, sizeof err));
    setenv("CB_RETRIEVER_MAX_K", " 42 ", 1);
    CHECK(cb_config_int(cfg, "retriever", "max_k", 1, 100, 5, &v, err, sizeof err) && v == 42);
    unsetenv("CB_RETRIEVER_MAX_K");
    setenv("CB_BLEND_RATIO", "nan", 1);
    double d;
    CHECK(!cb_config_double(cfg, "blend", "ratio", 0, 1, 0.5, &d, err, sizeof err) && strstr(err, "CB_BLEND_RATIO"));
    setenv("CB_BLEND_RATIO", "1.5", 1);
    CHECK(!cb_config_double(cfg, "blend", "ratio", 0, 1, 0.5, &d, err, sizeof err));
    setenv("CB_BLEND_RATIO", "0.25", 1);
    CHECK(cb_config_double(cfg, "blend", "ratio", 0, 1, 0.5, &d, err, sizeof err) && d == 0.25);
    unsetenv("CB_BLEND_RATIO");
    bool b;
    CHECK(!cb_config_bool(cfg, "retriever", "max_k", false, &b, err, sizeof err) && strstr(err, "boolean"));
    const char *s;
    CHECK(!cb_config_endpoint(cfg, "blend", "ratio", NULL, &s, err, sizeof err) && strstr(err, "endpoint"));
    cb_config_destroy(&cfg);
    unlink(s_path);
}

TEST(endpoints) {
    CHECK(cb_config_endpoint_valid("tcp://127.0.0.1:5551"));
    CHECK(cb_config_endpoint_valid("tcp://*:5551"));
    CHECK(cb_config_endpoint_valid("tcp://127.0.0.1:*"));
    CHECK(cb_config_endpoint_valid("tcp://retriever:5551"));
    CHECK(cb_config_endpoint_valid("tcp://[::1]:5551"));
    CHECK(cb_config_endpoint_valid("ipc:///tmp/cb.sock"));
    CHECK(cb_config_endpoint_valid("inproc://pipe"));
    CHECK(!cb_config_endpoint_valid("tcp://127.0.0.1"));
    CHECK(!cb_config_endpoint_valid("tcp://127.0.0.1:0"));
    CHECK(!cb_config_endpoint_valid("tcp://127.0.0.1:65536"));
    CHECK(!cb_config_endpoint_valid("tcp://:5551"));
    CHECK(!cb_config_endpoint_valid("tcp://host name:5551"));
    CHECK(!cb_config_endpoint_valid("udp://127.0.0.1:5551"));
    CHECK(!cb_config_endpoint_valid("ipc://"));
    CHECK(!cb_config_endpoint_valid(""));
    CHECK(!cb_config_endpoint_valid(NULL));
}

TEST(precedence_flag_env_file) {
    clear_env();
    write_cfg(CFG);
    char err[256];
    char *argv[] = {"prog", "--config", s_path, "query", "--max-k", "7", "--json", "--blend.ratio=0.3",
                    "--common.request_timeout_ms", "900", "--unknown-opt", "x", NULL};
    int argc = 12;
    cb_config_t *cfg = cb_config_new("retriever", &argc, argv, err, sizeof err);
    CHECK_MSG(cfg, "%s", err);
    /* consumed flags removed, the rest kept in order */
    CHECK_MSG(argc == 5, "argc %d", argc);
    CHECK(strcmp(argv[1], "query") == 0 && strcmp(argv[2], "--json") == 0 && strcmp(argv[3], "--unknown-opt") == 0 &&
          strcmp(argv[4], "x") == 0 && argv[5] == NULL);
    int64_t v;
    double d;
    CHECK(cb_config_int(cfg, "retriever", "max_k", 1, 100, 5, &v, err, sizeof err) && v == 7);
    setenv("CB_RETRIEVER_MAX_K", "8", 1); /* flag beats env */
    CHECK(cb_config_int(cfg, "retriever", "max_k", 1, 100, 5, &v, err, sizeof err) && v == 7);
    unsetenv("CB_RETRIEVER_MAX_K");
    CHECK(cb_config_double(cfg, "blend", "ratio", 0, 1, 0.5, &d, err, sizeof err) && d == 0.3);
    setenv("CB_BLEND_RATIO", "0.9", 1);
    CHECK(cb_config_double(cfg, "blend", "ratio", 0, 1, 0.5, &d, err, sizeof err) && d == 0.3);
    unsetenv("CB_BLEND_RATIO");
    /* section value (file) beats a common flag; a section without the key takes the common flag */
    CHECK(cb_config_int(cfg, "retriever", "request_timeout_ms", 1, 100000, 1, &v, err, sizeof err) && v == 100);
    CHECK(cb_config_int(cfg, "blend", "request_timeout_ms", 1, 100000, 1, &v, err, sizeof err) && v == 900);
    /* env beats file */
    setenv("CB_RETRIEVER_REQUEST_TIMEOUT_MS", "333", 1);
    CHECK(cb_config_int(cfg, "retriever", "request_timeout_ms", 1, 100000, 1, &v, err, sizeof err) && v == 333);
    unsetenv("CB_RETRIEVER_REQUEST_TIMEOUT_MS");
    /* CB_DATA_DIR alias, and CB_COMMON_DATA_DIR beats it */
    char path[256];
    setenv("CB_DATA_DIR", "/tmp/cbdata", 1);
    CHECK(cb_config_data_path(cfg, "retriever", "db", NULL, path, sizeof path, err, sizeof err) &&
          strcmp(path, "/tmp/cbdata/retriever.db") == 0);
    setenv("CB_COMMON_DATA_DIR", "/tmp/other", 1);
    CHECK(cb_config_data_path(cfg, "retriever", "db", NULL, path, sizeof path, err, sizeof err) &&
          strcmp(path, "/tmp/other/retriever.db") == 0);
    clear_env();
    /* cb_config_set is a flag-level override */
    CHECK(cb_config_set(cfg, "retriever", "max_k", "9"));
    CHECK(cb_config_int(cfg, "retriever", "max_k", 1, 100, 5, &v, err, sizeof err) && v == 9);
    CHECK(!cb_config_set(cfg, "Bad", "max_k", "9"));
    cb_config_log(cfg, "retriever");
    cb_config_destroy(&cfg);
    unlink(s_path);
}

TEST(flag_errors) {
    clear_env();
    write_cfg(CFG);
    char err[256];
    {
        char *argv[] = {"prog", "--config", s_path, "--retriever.max_kk=3", NULL};
        int argc = 4;
        CHECK(!cb_config_new("retriever", &argc, argv, err, sizeof err) && strstr(err, "unknown config key"));
    }
    {
        char *argv[] = {"prog", "--config", s_path, "--retriever.max_k", NULL};
        int argc = 4;
        CHECK(!cb_config_new("retriever", &argc, argv, err, sizeof err) && strstr(err, "needs a value"));
    }
    {
        char *argv[] = {"prog", "--config", s_path, "--Retriever.max_k=1", NULL};
        int argc = 4;
        CHECK(!cb_config_new("retriever", &argc, argv, err, sizeof err) && strstr(err, "invalid config flag"));
    }
    {
        char *argv[] = {"prog", "--config", NULL};
        int argc = 2;
        CHECK(!cb_config_new("retriever", &argc, argv, err, sizeof err) && strstr(err, "--config needs"));
    }
    {
        char *argv[] = {"prog", "--config=/nonexistent/x.cfg", NULL};
        int argc = 2;
        CHECK(!cb_config_new("retriever", &argc, argv, err, sizeof err) && strstr(err, "/nonexistent/x.cfg"));
    }
    {
        /* everything after "--" is left alone */
        char *argv[] = {"prog", "--config", s_path, "--", "--max_k", "3", NULL};
        int argc = 6;
        cb_config_t *cfg = cb_config_new("retriever", &argc, argv, err, sizeof err);
        CHECK(cfg && argc == 4 && strcmp(argv[2], "--max_k") == 0);
        int64_t v;
        CHECK(cb_config_int(cfg, "retriever", "max_k", 1, 100, 5, &v, err, sizeof err) && v == 50);
        cb_config_destroy(&cfg);
    }
    /* a file that does not parse */
    write_cfg("common\n  two_space_indent = 1\n");
    CHECK(!cb_config_load(s_path, "retriever", err, sizeof err) && strstr(err, "cannot parse"));
    /* CB_CONFIG names the file; then it must exist */
    setenv("CB_CONFIG", "/nonexistent/y.cfg", 1);
    {
        char *argv[] = {"prog", NULL};
        int argc = 1;
        CHECK(!cb_config_new("retriever", &argc, argv, err, sizeof err) && strstr(err, "/nonexistent/y.cfg"));
    }
    unsetenv("CB_CONFIG");
    /* no file at all: defaults and --section.key flags work */
    cb_config_t *cfg = cb_config_load(NULL, "retriever", err, sizeof err);
    CHECK(cfg && cb_config_file(cfg) == NULL);
    int64_t v;
    CHECK(cb_config_int(cfg, "retriever", "max_k", 1, 100, 5, &v, err, sizeof err) && v == 5);
    cb_config_destroy(&cfg);
    unlink(s_path);
}

/* The shipped file parses, has every section, valid loopback endpoints on ports 5550-5559. */
TEST(shipped_config) {
    clear_env();
    char err[256];
    cb_config_t *cfg = cb_config_load("config/cacheblend.cfg", "common", err, sizeof err);
    if (!cfg && access("config/cacheblend.cfg", R_OK) != 0) SKIP("run from the repository root");
    CHECK_MSG(cfg, "%s", err);
    const char *eps[][2] = {{"retriever", "endpoint"}, {"cacheindex", "endpoint"}, {"precompute", "endpoint"},
                            {"precompute", "pull_endpoint"}, {"blend", "endpoint"}};
    for (size_t i = 0; i < sizeof eps / sizeof *eps; i++) {
        const char *s;
        CHECK_MSG(cb_config_endpoint(cfg, eps[i][0], eps[i][1], NULL, &s, err, sizeof err) && s, "%s", err);
        CHECK(strncmp(s, "tcp://127.0.0.1:555", 19) == 0);
    }
    int64_t v;
    CHECK(cb_config_int(cfg, "precompute", "chunk_tokens", 1, 100000, 0, &v, err, sizeof err) && v == 512);
    CHECK(cb_config_int(cfg, "cacheindex", "budget_bytes", 1, INT64_MAX, 0, &v, err, sizeof err) && v > 0);
    double d;
    CHECK(cb_config_double(cfg, "blend", "ratio", 0, 1, 0, &d, err, sizeof err) && d == 0.15);
    const char *s;
    CHECK(cb_config_str(cfg, "blend", "model", NULL, &s, err, sizeof err) &&
          strcmp(s, CB_SVC_DEFAULT_MODEL) == 0);
    char path[256];
    CHECK(cb_config_data_path(cfg, "cacheindex", "kv_dir", NULL, path, sizeof path, err, sizeof err) &&
          strcmp(path, "var/kv") == 0);
    bool curve = true; /* plaintext by default, keys under the data directory */
    CHECK(cb_config_bool(cfg, "cbctl", "curve", true, &curve, err, sizeof err) && !curve);
    CHECK(cb_config_data_path(cfg, "blend", "keys_dir", NULL, path, sizeof path, err, sizeof err) &&
          strcmp(path, "var/keys") == 0);
    cb_engine_opts_t eo = {.kv_dtype = CB_ENGINE_KV_F32}; /* the engine section: an f16 pool */
    CHECK_MSG(cb_engine_opts_from_config(cfg, &eo, err, sizeof err) == 0 && eo.kv_dtype == CB_ENGINE_KV_F16, "%s", err);
    cb_config_destroy(&cfg);
}

/* engine.kv_dtype: the engine section only (common.kv_dtype is the KV files' payload, never the pool's),
 * environment and flags over the file, f16 when absent, a clear error for anything but f16 / f32. */
TEST(engine_kv_dtype) {
    clear_env();
    char err[256];
    write_cfg("common\n    kv_dtype = q8_0\nblend\n    ratio = 0.15\n");
    cb_config_t *cfg = cb_config_load(s_path, "blend", err, sizeof err);
    CHECK_MSG(cfg, "%s", err);
    const char *v = NULL;
    CHECK(cb_config_str_own(cfg, "engine", "kv_dtype", "dflt", &v, err, sizeof err) && !strcmp(v, "dflt"));
    cb_engine_opts_t eo = {0};
    CHECK_MSG(cb_engine_opts_from_config(cfg, &eo, err, sizeof err) == 0 && eo.kv_dtype == CB_ENGINE_KV_F16, "%s", err);
    setenv("CB_ENGINE_KV_DTYPE", "f32", 1);
    CHECK(cb_engine_opts_from_config(cfg, &eo, err, sizeof err) == 0 && eo.kv_dtype == CB_ENGINE_KV_F32);
    setenv("CB_ENGINE_KV_DTYPE", "bf16", 1);
    CHECK(cb_engine_opts_from_config(cfg, &eo, err, sizeof err) == -1 && strstr(err, "engine.kv_dtype = 'bf16'"));
    unsetenv("CB_ENGINE_KV_DTYPE");
    cb_config_destroy(&cfg);
    write_cfg("engine\n    kv_dtype = f32\nblend\n    ratio = 0.15\n");
    cfg = cb_config_load(s_path, "blend", err, sizeof err);
    CHECK_MSG(cfg, "%s", err);
    CHECK(cb_engine_opts_from_config(cfg, &eo, err, sizeof err) == 0 && eo.kv_dtype == CB_ENGINE_KV_F32);
    CHECK(cb_config_set(cfg, "engine", "kv_dtype", "f16")); /* a flag */
    CHECK(cb_engine_opts_from_config(cfg, &eo, err, sizeof err) == 0 && eo.kv_dtype == CB_ENGINE_KV_F16);
    CHECK(cb_config_set(cfg, "engine", "kv_dtype", "half"));
    CHECK(cb_engine_opts_from_config(cfg, &eo, err, sizeof err) == -1 && strstr(err, "expected f16 or f32"));
    cb_config_destroy(&cfg);
    unlink(s_path);
}

/* svcconfig: the blend section's options and generation defaults, the session's keys from blend, common and
 * engine; ratio = auto; clear errors for a bad mode, metric and auto bounds. */
TEST(svc_config) {
    clear_env();
    char err[256];
    write_cfg("common\n    model = \"m.gguf\"\n    threads = 3\n    kv_dtype = q8_0\nengine\n    chat_template = chatml\n"
              "blend\n    mode = reuse\n    ratio = 0.25\n    metric = v\n    max_tokens = 9\n    ctx_size = 512\n"
              "    hot_cache_bytes = 1M\n    system_prompt = \"S\"\n");
    cb_config_t *cfg = cb_config_load(s_path, "blend", err, sizeof err);
    CHECK_MSG(cfg, "%s", err);
    cb_session_opts_t so;
    cb_svc_blend_config_t bc;
    CHECK_MSG(cb_svc_session_config(cfg, "blend", &so, err, sizeof err) == 0, "%s", err);
    CHECK(!strcmp(so.model_path, "m.gguf") && !strcmp(so.chat_template, "chatml") && !strcmp(so.system_prompt, "S"));
    CHECK(so.threads == 3 && so.kv_dtype == CB_KV_Q8_0 && so.engine_kv_dtype == CB_ENGINE_KV_F16);
    CHECK_MSG(cb_svc_blend_config(cfg, &bc, &so, err, sizeof err) == 0, "%s", err);
    CHECK(bc.blend.mode == CB_BLEND_REUSE && bc.ratio == 0.25 && bc.blend.ratio == 0.25f && bc.blend.metric == 'v');
    CHECK(bc.max_tokens == 9 && bc.k == 3 && bc.sampling.top_p == 1.0f && bc.sampling.temperature == 0.0f &&
          bc.sampling.top_k == 0 && bc.sampling.seed == 0);
    CHECK(so.ctx_size == 512 && so.mem_bytes == (1u << 20) && so.kv_pool_bytes == 0);
    /* a number: the requests' options are not auto, the target is kept for a query asking auto */
    CHECK(bc.blend.auto_target == 0.0f && bc.auto_target == CB_BLEND_DEFAULT_AUTO_TARGET);
    cb_config_set(cfg, "blend", "ratio", "auto");
    cb_config_set(cfg, "blend", "seed", "7");
    cb_config_set(cfg, "blend", "presence_penalty", "-1.5");
    CHECK(cb_svc_blend_config(cfg, &bc, NULL, err, sizeof err) == 0 && bc.blend.ratio == CB_BLEND_DEFAULT_RATIO &&
          bc.blend.auto_target == CB_BLEND_DEFAULT_AUTO_TARGET);
    CHECK(bc.sampling.seed == 7 && bc.sampling.presence_penalty == -1.5f);
    /* the generation defaults have the query's ranges (wire/query.h) */
    char big[32];
    snprintf(big, sizeof big, "%d", CB_QUERY_MAX_TOKENS_MAX + 1);
    cb_config_set(cfg, "blend", "max_tokens", big);
    CHECK(cb_svc_blend_config(cfg, &bc, NULL, err, sizeof err) == -1 && strstr(err, "max_tokens"));
    cb_config_set(cfg, "blend", "max_tokens", "9");
    snprintf(big, sizeof big, "%d", CB_QUERY_K_MAX + 1);
    cb_config_set(cfg, "blend", "k", big);
    CHECK(cb_svc_blend_config(cfg, &bc, NULL, err, sizeof err) == -1 && strstr(err, "blend.k"));
    cb_config_set(cfg, "blend", "k", "3");
    cb_config_set(cfg, "blend", "frequency_penalty", "2.5");
    CHECK(cb_svc_blend_config(cfg, &bc, NULL, err, sizeof err) == -1 && strstr(err, "frequency_penalty"));
    cb_config_set(cfg, "blend", "frequency_penalty", "0");
    cb_config_set(cfg, "blend", "mode", "fast");
    CHECK(cb_svc_blend_config(cfg, &bc, NULL, err, sizeof err) == -1 &&
          strstr(err, "blend.mode = 'fast': expected full, prefix, reuse or blend"));
    cb_config_set(cfg, "blend", "mode", "blend");
    cb_config_set(cfg, "blend", "metric", "q");
    CHECK(cb_svc_blend_config(cfg, &bc, NULL, err, sizeof err) == -1 && strstr(err, "blend.metric = 'q'"));
    cb_config_set(cfg, "blend", "metric", "a");
    cb_config_set(cfg, "blend", "auto_floor", "0.5");
    cb_config_set(cfg, "blend", "auto_ceil", "0.4");
    CHECK(cb_svc_blend_config(cfg, &bc, NULL, err, sizeof err) == -1 && strstr(err, "auto_floor"));
    cb_config_set(cfg, "blend", "kv_dtype", "f8");
    CHECK(cb_svc_session_config(cfg, "blend", &so, err, sizeof err) == -1 && strstr(err, "kv_dtype = 'f8'"));
    cb_config_destroy(&cfg);
    setenv("CB_MODEL", "x.gguf", 1);
    CHECK(!strcmp(cb_svc_model_path(NULL), "x.gguf") && !strcmp(cb_svc_model_path("y"), "y"));
    unsetenv("CB_MODEL");
    CHECK(!strcmp(cb_svc_model_path(""), CB_SVC_DEFAULT_MODEL));
}

int main(void) {
    RUN(file_values_and_types);
    RUN(bad_values);
    RUN(endpoints);
    RUN(precedence_flag_env_file);
    RUN(flag_errors);
    RUN(shipped_config);
    RUN(engine_kv_dtype);
    RUN(svc_config);
    return test_summary();
}
