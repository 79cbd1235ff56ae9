/* ident: who an ingest comes from, for cb-precompute's turns and per-client limits (jobs.h;
 * docs/protocol.md §6, "Who the client is").
 *
 * Only what the transport authenticated is trusted:
 *
 *   CURVE on: the connection's ZAP User-Id U, the client's public key (Z85) that the handshake proved
 *     (wire/curve.h, bus.h cb_bus_req_user_id), is the client: principal "k:" U. One key = one client,
 *     however many `client` names or connections it uses.
 *     A trusted forwarder (precompute.trusted_forwarders: names of keys_dir/allowed/<name>.key, default
 *     "gateway") speaks for others: when U is its key and the message carries `on_behalf_of` X (the
 *     gateway's hashed API key or its client's address), the principal is "<name>:" X. From any other key,
 *     `on_behalf_of` is refused (bad_request): nobody else may choose whom it counts as.
 *   CURVE on and no User-Id: refused (internal) — the ZAP handler must name the key; only a service behind
 *     cb-router (worker mode: it sees the broker, not the client) goes on as without CURVE.
 *   CURVE off: nothing is authenticated, the declared fields are taken as given: principal "f:" on_behalf_of, else "c:" client,
 *     else "peer:" + the hex of the ROUTER routing id (its BLAKE2b-128 when longer than 32 bytes; one per
 *     connection), else "pull" (the PULL socket). A client that lies gets more turns; the global cap
 *     (precompute.max_queued_jobs/bytes) still bounds the queue.
 *
 * A declared `client` (1..64 printable ASCII) only narrows: the identity is principal "/" client, logged
 * with the job; the principal is what is limited and what takes turns.
 *
 * Thread: the service loop's. Nothing here logs the fields it reads.
 */
#ifndef PC_IDENT_H
#define PC_IDENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "jobs.h"
#include "wire/curve.h"
#include "wire/msg.h"

#define PC_IDENT_FIELD_MAX 64     /* bytes of `client` and `on_behalf_of` */
#define PC_IDENT_NAME_MAX 15      /* bytes of a trusted forwarder's name */
#define PC_IDENT_MAX_FORWARDERS 8

typedef struct pc_ident pc_ident_t;

/* The trust rule of this process: with curve on, every request must carry the key that authenticated it
 * (but behind_broker: worker mode), and the keys of the forwarders named in trusted (names
 * separated by commas or spaces; "" = none) from curve->keys_dir/allowed/<name>.key. A name whose file is
 * missing is logged (warning) and not trusted; a bad name, an unreadable file or more than
 * PC_IDENT_MAX_FORWARDERS names is an error. With curve off (or NULL) nothing is read. NULL with err.
 * Caller owns (pc_ident_destroy). */
pc_ident_t *pc_ident_new(const cb_curve_t *curve, bool behind_broker, const char *trusted, char *err, size_t errlen);
void pc_ident_destroy(pc_ident_t **self_p);
/* How many forwarders are trusted (their keys loaded). */
int pc_ident_forwarders(const pc_ident_t *self);

typedef struct {
    char principal[CB_JOB_CLIENT_MAX + 1];                      /* limited; takes the turns (jobs.h) */
    char identity[CB_JOB_CLIENT_MAX + 1 + PC_IDENT_FIELD_MAX + 1]; /* principal ["/" client] */
    bool authenticated;                                         /* the principal comes from a CURVE key */
} pc_who_t;

/* Who sent m: user_id is the connection's ZAP User-Id (NULL or "": none), peer [peer_len] its routing id
 * (NULL: the PULL socket). CB_ERR_NONE with who set; CB_ERR_BAD_REQUEST with why when `client` or
 * `on_behalf_of` is invalid, or `on_behalf_of` comes from an authenticated key that is not a trusted
 * forwarder; CB_ERR_INTERNAL when a key is required and user_id is empty. */
cb_err_t pc_ident_resolve(const pc_ident_t *self, const cb_msg_t *m, const char *user_id, const uint8_t *peer,
                          size_t peer_len, pc_who_t *who, char *why, size_t whylen);

#endif
