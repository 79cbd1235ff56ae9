/* clock: cb_now_ms() on CLOCK_MONOTONIC (see clock.h). */
#include "base/clock.h"

#include <time.h>

double cb_now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}
