/* clock: the one monotonic clock of the project, in milliseconds.
 *
 * CLOCK_MONOTONIC: never jumps with the wall clock, so differences are durations (latency, TTFT,
 * timeouts, heartbeats). The origin is arbitrary (boot), so a value means nothing on its own and is
 * comparable only with values from the same machine. Thread-safe, allocates nothing, cannot fail.
 * (czmq's zclock_usecs() reads the same clock; zclock_mono() is the same in whole milliseconds.)
 */
#ifndef CB_CLOCK_H
#define CB_CLOCK_H

/* Milliseconds on CLOCK_MONOTONIC, with sub-millisecond resolution (nanoseconds / 1e6). */
double cb_now_ms(void);
#endif
