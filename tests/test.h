/* tests/test.h: the whole unit-test framework, one header.
 *
 *   TEST(name) { CHECK(x == 1); CHECK_NEAR(a, b, 1e-6); }
 *   int main(void) { RUN(name); return test_summary(); }
 *
 * Each test prints "ok <file>:<name>" or "FAIL <file>:<name> (...)"; tests/run.sh counts those lines.
 * A test that needs a missing resource calls SKIP("why"): printed as "skip", counted as neither.
 */
#ifndef CB_TEST_H
#define CB_TEST_H
#include "svc/svcconfig.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int test_failed_;   /* the current test failed */
static int test_skipped_;  /* the current test skipped itself */
static int test_n_fail_;   /* failed tests in this program */

#define TEST(name) static void name(void)

#define CHECK(cond) do { if (!(cond)) { \
    fprintf(stderr, "  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
    test_failed_ = 1; return; } } while (0)

#define CHECK_MSG(cond, ...) do { if (!(cond)) { \
    fprintf(stderr, "  %s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
    fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); \
    test_failed_ = 1; return; } } while (0)

#define CHECK_NEAR(a, b, tol) do { double a_ = (a), b_ = (b); if (!(fabs(a_ - b_) <= (tol))) { \
    fprintf(stderr, "  %s:%d: |%s - %s| = |%g - %g| > %g\n", __FILE__, __LINE__, #a, #b, a_, b_, (double)(tol)); \
    test_failed_ = 1; return; } } while (0)

#define SKIP(why) do { test_skipped_ = 1; fprintf(stderr, "  skipped: %s\n", why); return; } while (0)

#define RUN(name) do { test_failed_ = 0; test_skipped_ = 0; name(); \
    if (test_skipped_) printf("skip %s:%s\n", __FILE__, #name); \
    else if (test_failed_) { printf("FAIL %s:%s\n", __FILE__, #name); test_n_fail_++; } \
    else { printf("ok %s:%s\n", __FILE__, #name); } fflush(stdout); } while (0)

static inline int test_summary(void) { return test_n_fail_ ? 1 : 0; }

/* Path of the default model for tests that need it; NULL when it is not there. */
static inline const char *test_model_path(void) {
    const char *p = cb_svc_model_path(NULL);
    FILE *f = fopen(p, "rb");
    if (!f) return NULL;
    fclose(f);
    return p;
}

/* True when built with sanitizers: heavy tests shrink their inputs there. */
#if defined(__SANITIZE_ADDRESS__)
#define TEST_SANITIZED 1
#else
#define TEST_SANITIZED 0
#endif
#endif
