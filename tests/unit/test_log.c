#include "base/log.h"
#include "test.h"

TEST(test_levels) {
    cb_log_set_level(CB_LOG_WARN);
    CHECK(!cb_log_enabled(CB_LOG_INFO));
    CHECK(cb_log_enabled(CB_LOG_ERROR));
    cb_log_set_level(CB_LOG_DEBUG);
    CHECK(cb_log_enabled(CB_LOG_DEBUG));
    cb_log(CB_LOG_DEBUG, "req-1", "hello %d", 42);
}

int main(void) {
    RUN(test_levels);
    return test_summary();
}
