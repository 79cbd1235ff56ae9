/* keyguard: slows API-key guessing. Wrong keys are counted per client address; after `limit` of them
 * within `window_s` the address is locked out for `lockout_s`: every /v1/ request from it gets 429
 * (Retry-After) without its key being looked at, so a right key found during a lockout is no different
 * from a wrong one, and a guesser gets at most `limit` tries per window + lockout.
 *
 * A fixed table (4096 addresses, 8 probes each, no allocation after new): an address that is neither
 * locked out nor within its window frees its slot; when all 8 slots of an address are busy, the one whose
 * window began first is reused, so a flood of addresses can only shorten other addresses' memory, never
 * grow the table. Thread-safe (one mutex, held for a lookup).
 */
#ifndef GW_KEYGUARD_H
#define GW_KEYGUARD_H

#include <stdbool.h>
#include <stdint.h>

typedef struct gw_keyguard gw_keyguard_t;

/* limit 0: off (every call below answers 0 / false). NULL when out of memory. Caller owns. */
gw_keyguard_t *gw_keyguard_new(unsigned limit, unsigned window_s, unsigned lockout_s);
void gw_keyguard_destroy(gw_keyguard_t **self_p);

/* Seconds the address (gw_addr_key) is still locked out (rounded up); 0: it may try a key. */
unsigned gw_keyguard_locked(gw_keyguard_t *self, const uint8_t key[16]);
/* Counts a wrong or missing key from the address; true when this one starts a lockout. */
bool gw_keyguard_failed(gw_keyguard_t *self, const uint8_t key[16]);

#endif
