/* curve: CURVE keys and the ZAP allow-list of the bus (docs/protocol.md §1.1).
 *
 * With common.curve = on, every socket a cacheblend process binds (ROUTER, PULL) is a CURVE server with
 * its service's key pair, and admits only the clients whose public keys are in the allow-list (a zauth
 * actor, one per process); every socket it connects (DEALER, PUSH) is a CURVE client with the process's
 * own key pair and the public key of the service it connects to. Keys are CZMQ zcert files, made by
 * `cbctl keys init` (cb_curve_keys_init) in one directory, common.keys_dir:
 *
 *   KEYS/server/<service>.key_secret   key pair of a service (retriever, cacheindex, precompute, blend), 0600
 *   KEYS/server/<service>.key          its public half (zcert's companion file)
 *   KEYS/public/<service>.key          the same public key: what every client needs to reach that service
 *   KEYS/client/<identity>.key_secret  key pair of a client identity (the four services, cbctl, gateway), 0600
 *   KEYS/client/<identity>.key         its public half
 *   KEYS/allowed/<identity>.key        the same public key: the allow-list every service's ZAP handler loads
 *
 * A process needs its own client pair, its own server pair when it is a service, public/ and (services)
 * allowed/. The allow-list is read once, when the first CURVE server socket of the process is made:
 * adding or revoking a client means editing allowed/ and restarting the services. Any file of allowed/
 * (but names starting with '.' and *_secret) must be a public key; a repeated key is an error.
 *
 * What the handler tells the service: for an admitted client, zauth answers ZAP with the client's public
 * key (Z85, 40 characters) as the User-Id (CZMQ 4.2.1's zauth does; test_curve checks it), so every message
 * from that connection carries it (zmq "User-Id" metadata; bus.h cb_bus_req_user_id, cb_bus_recv_zmsg).
 * It is the one identity of a client that the client cannot choose: cb-precompute's ingest fairness and
 * limits count by it (services/precompute/ident.h). The keys of allowed/ carry no other metadata.
 *
 * The state is a plain value (cb_curve_t, inside cb_bus_opts_t) so that options are copied freely: the
 * key texts, the process's identity and one public key per service endpoint. Loading fails with a clear
 * message naming the file; nothing here aborts on bad files.
 */
#ifndef CB_CURVE_H
#define CB_CURVE_H

#include <czmq.h>
#include <stdbool.h>
#include <stddef.h>

#include "wire/config.h"

#define CB_CURVE_TXT 41       /* a Z85 key: 40 characters and a NUL */
#define CB_CURVE_MAX_PEERS 8  /* service endpoints a process knows keys for */
#define CB_CURVE_N_SERVICES 4 /* retriever, cacheindex, precompute, blend */
#define CB_CURVE_N_CLIENTS 6  /* the four services, cbctl, gateway */

/* The services (server key pairs) and the client identities (client key pairs), in layout order. */
extern const char *const cb_curve_services[CB_CURVE_N_SERVICES];
extern const char *const cb_curve_clients[CB_CURVE_N_CLIENTS];

typedef struct {
    char endpoint[256];               /* as the clients connect to it, e.g. tcp://127.0.0.1:5551 */
    char name[16];                    /* the service */
    char public_txt[CB_CURVE_TXT];    /* its server public key */
} cb_curve_peer_t;

typedef struct {
    bool on;                          /* false: plaintext; everything else is empty */
    char keys_dir[512];
    char identity[32];                /* this process as a client: client/<identity>.key_secret */
    char public_txt[CB_CURVE_TXT], secret_txt[CB_CURVE_TXT];
    char service[16];                 /* this process as a server ("" when not a service) */
    char server_public[CB_CURVE_TXT], server_secret[CB_CURVE_TXT];
    int n_peers;
    cb_curve_peer_t peers[CB_CURVE_MAX_PEERS];
} cb_curve_t;

/* Which key file: KEYS/server/NAME.key_secret, KEYS/public/NAME.key, KEYS/client/NAME.key_secret,
 * KEYS/allowed/NAME.key. */
typedef enum { CB_CURVE_SERVER, CB_CURVE_PUBLIC, CB_CURVE_CLIENT, CB_CURVE_ALLOWED } cb_curve_file_t;
/* Writes the path into out; false when it does not fit. */
bool cb_curve_path(char *out, size_t outsz, const char *keys_dir, cb_curve_file_t which, const char *name);

/* Makes the whole key set in dir (created 0755 when missing; server/ and client/ 0700, secret files
 * 0600). Returns 1 when it made the keys, 0 when dir already holds a complete set (nothing changed;
 * with force, a new set replaces it and 1 is returned), -1 with err when some but not all files exist
 * (without force) or a write failed. Not thread-safe (sets the umask while writing). */
int cb_curve_keys_init(const char *dir, bool force, char *err, size_t errlen);

/* Reads a key file (a zcert file) into Z85 texts. A secret file must carry both keys and they must
 * match; secret may be NULL for a public file. A secret file readable by group or others is logged
 * (warning). False with err naming the file. */
bool cb_curve_read(const char *path, char public_txt[CB_CURVE_TXT], char secret_txt[CB_CURVE_TXT], char *err,
                   size_t errlen);

/* Turns CURVE on in c with the client pair of `identity` from keys_dir (c is cleared first). */
bool cb_curve_load_client(cb_curve_t *c, const char *keys_dir, const char *identity, char *err, size_t errlen);
/* Adds the server pair of `service` (c must be on). */
bool cb_curve_load_server(cb_curve_t *c, const char *service, char *err, size_t errlen);
/* Adds (or replaces) the public key of `service` for connections to endpoint (c must be on). */
bool cb_curve_add_peer(cb_curve_t *c, const char *endpoint, const char *service, char *err, size_t errlen);
/* The peer connected to at endpoint, or NULL. */
const cb_curve_peer_t *cb_curve_peer(const cb_curve_t *c, const char *endpoint);

/* From config: <section>.curve (falling back to common.curve; default off) and keys_dir (a data path,
 * default "keys"); when on, the client pair of identity `section`, the server pair when `section` is
 * one of the services, and the public key of every service for its configured endpoint (and
 * precompute.pull_endpoint). c is cleared first. False with err on a bad value or an unreadable key. */
bool cb_curve_from_config(const cb_config_t *cfg, const char *section, cb_curve_t *c, char *err, size_t errlen);

/* Sets the CURVE options of s before it binds (server: also starts the process's ZAP handler on first
 * use) or connects to endpoint (client: the peer's key must be known). Nothing when c is off. 0, or -1
 * with err. */
int cb_curve_apply(const cb_curve_t *c, zsock_t *s, bool server, const char *endpoint, char *err, size_t errlen);

/* Starts the process's ZAP handler (zauth) with the keys of KEYS/allowed, once; a second call with the
 * same keys_dir does nothing, with another one fails. Stopped at exit. False with err (missing or
 * empty directory, a file that is not a public key, a repeated key). Thread-safe. */
bool cb_curve_zap_start(const char *keys_dir, char *err, size_t errlen);

/* True when endpoint binds or names a non-loopback TCP address (host "*", 0.0.0.0, any host but
 * 127.x, localhost and ::1). */
bool cb_curve_endpoint_public(const char *endpoint);

#endif
