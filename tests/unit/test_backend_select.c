#include "engine/backend_select.h"
#include "model/model.h"
#include "test.h"

TEST(test_parse) {
    cb_backend_kind_t k;
    CHECK(cb_backend_kind_parse("auto", &k) && k == CB_BACKEND_AUTO);
    CHECK(cb_backend_kind_parse("cpu", &k) && k == CB_BACKEND_CPU);
    CHECK(cb_backend_kind_parse("cuda", &k) && k == CB_BACKEND_CUDA);
    CHECK(!cb_backend_kind_parse("gpu", &k));
    CHECK(!cb_backend_kind_parse(NULL, &k));
    CHECK(strcmp(cb_backend_kind_name(CB_BACKEND_CUDA), "cuda") == 0);
}

TEST(test_select) {
    const char *path = test_model_path();
    if (!path) SKIP("model absent");
    char err[256];
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

int main(void) {
    RUN(test_parse);
    RUN(test_select);
    return test_summary();
}
