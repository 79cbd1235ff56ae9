/* curve: CURVE key files, their loading, the per-socket options and the process's ZAP handler. See curve.h. */
#include "wire/curve.h"
#include "base/alloc.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"
#include "wire/db.h"

const char *const cb_curve_services[CB_CURVE_N_SERVICES] = {"retriever", "cacheindex", "precompute", "blend"};
const char *const cb_curve_clients[CB_CURVE_N_CLIENTS] = {"retriever", "cacheindex", "precompute",
                                                          "blend",     "cbctl",      "gateway"};

#define MAX_KEY_FILE_BYTES 65536 /* a zcert file is a few hundred bytes */
#define ZCERT_MAX_PATH 247       /* zcert_load builds "<path>_secret" in a 256-byte buffer */

static const char *const s_dirs[] = {"server", "public", "client", "allowed"};
static const char *const s_suffix[] = {".key_secret", ".key", ".key_secret", ".key"};

bool cb_curve_path(char *out, size_t outsz, const char *keys_dir, cb_curve_file_t which, const char *name) {
    int n = snprintf(out, outsz, "%s/%s/%s%s", keys_dir, s_dirs[which], name, s_suffix[which]);
    return n > 0 && (size_t)n < outsz && n <= ZCERT_MAX_PATH;
}

static bool is_service(const char *name) {
    for (int i = 0; i < CB_CURVE_N_SERVICES; i++)
        if (strcmp(name, cb_curve_services[i]) == 0) return true;
    return false;
}

static bool all_zero(const byte *k) {
    for (int i = 0; i < 32; i++)
        if (k[i]) return false;
    return true;
}

/* ---------------------------------------------------------------------------------------------- */
/* Reading                                                                                         */

/* True when the file (at most MAX_KEY_FILE_BYTES, no NUL) is ZPL text. zcert_load leaks on a file that
 * does not parse (CZMQ 4.2.1's zconfig_load error path); zconfig_str_load does not, so check first. */
static bool zpl_parses(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    char *buf = cb_malloc(MAX_KEY_FILE_BYTES + 1);
    size_t n = buf ? fread(buf, 1, MAX_KEY_FILE_BYTES + 1, f) : 0;
    fclose(f);
    bool ok = buf && n <= MAX_KEY_FILE_BYTES && memchr(buf, 0, n) == NULL;
    if (ok) {
        buf[n] = 0;
        zconfig_t *root = zconfig_str_load(buf);
        ok = root != NULL;
        zconfig_destroy(&root);
    }
    free(buf);
    return ok;
}

bool cb_curve_read(const char *path, char public_txt[CB_CURVE_TXT], char secret_txt[CB_CURVE_TXT], char *err,
                   size_t errlen) {
    struct stat st;
    if (stat(path, &st) != 0 || access(path, R_OK) != 0) {
        snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
        return false;
    }
    if (!S_ISREG(st.st_mode) || st.st_size > MAX_KEY_FILE_BYTES) {
        snprintf(err, errlen, "%s is not a key file (%s)", path, S_ISREG(st.st_mode) ? "too large" : "not a regular file");
        return false;
    }
    if (strlen(path) > ZCERT_MAX_PATH) {
        snprintf(err, errlen, "%s: path too long for CZMQ's zcert (at most %d characters)", path, ZCERT_MAX_PATH);
        return false;
    }
    if (!zpl_parses(path)) {
        snprintf(err, errlen, "%s is not a CURVE key file (not in zcert's ZPL format)", path);
        return false;
    }
    zcert_t *cert = zcert_load(path);
    if (!cert || all_zero(zcert_public_key(cert))) {
        snprintf(err, errlen, "%s is not a CURVE key file (zcert format with curve/public-key)", path);
        zcert_destroy(&cert);
        return false;
    }
    snprintf(public_txt, CB_CURVE_TXT, "%s", zcert_public_txt(cert));
    bool ok = true;
    if (secret_txt) {
        char derived[CB_CURVE_TXT];
        snprintf(secret_txt, CB_CURVE_TXT, "%s", zcert_secret_txt(cert));
        if (all_zero(zcert_secret_key(cert))) {
            snprintf(err, errlen, "%s has no secret key (curve/secret-key): a public key file where a key pair belongs?",
                     path);
            ok = false;
        } else if (zmq_curve_public(derived, secret_txt) != 0 || strcmp(derived, public_txt) != 0) {
            snprintf(err, errlen, "%s: its public key does not belong to its secret key", path);
            ok = false;
        } else if (st.st_mode & 077) {
            cb_log(CB_LOG_WARN, NULL, "%s holds a secret key and is readable by others (mode %04o): chmod 600 it", path,
                   (unsigned)(st.st_mode & 07777));
        }
        if (!ok) memset(secret_txt, 0, CB_CURVE_TXT);
    }
    zcert_destroy(&cert);
    return ok;
}

static bool read_kind(const char *dir, cb_curve_file_t which, const char *name, char *pub, char *sec, char *err,
                      size_t errlen) {
    char path[1024];
    if (!cb_curve_path(path, sizeof path, dir, which, name)) {
        snprintf(err, errlen, "keys_dir %.200s: path too long for CZMQ's zcert (at most %d characters)", dir,
                 ZCERT_MAX_PATH);
        return false;
    }
    char e[768];
    if (cb_curve_read(path, pub, sec, e, sizeof e)) return true;
    snprintf(err, errlen, "curve: %s (make the keys with `cbctl keys init %s`)", e, dir);
    return false;
}

bool cb_curve_load_client(cb_curve_t *c, const char *keys_dir, const char *identity, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    if (!zmq_has("curve")) {
        snprintf(err, errlen, "curve: this libzmq was built without CURVE (libsodium)");
        return false;
    }
    if (!keys_dir || !*keys_dir || strlen(keys_dir) >= sizeof c->keys_dir) {
        snprintf(err, errlen, "curve: keys_dir is empty or too long");
        return false;
    }
    if (!identity || !*identity || strlen(identity) >= sizeof c->identity || strchr(identity, '/')) {
        snprintf(err, errlen, "curve: invalid client identity '%s'", identity ? identity : "(null)");
        return false;
    }
    snprintf(c->keys_dir, sizeof c->keys_dir, "%s", keys_dir);
    snprintf(c->identity, sizeof c->identity, "%s", identity);
    if (!read_kind(keys_dir, CB_CURVE_CLIENT, identity, c->public_txt, c->secret_txt, err, errlen)) {
        memset(c, 0, sizeof *c);
        return false;
    }
    c->on = true;
    return true;
}

bool cb_curve_load_server(cb_curve_t *c, const char *service, char *err, size_t errlen) {
    if (!c->on || !service || !is_service(service)) {
        snprintf(err, errlen, "curve: '%s' is not a service with a server key", service ? service : "(null)");
        return false;
    }
    if (!read_kind(c->keys_dir, CB_CURVE_SERVER, service, c->server_public, c->server_secret, err, errlen)) return false;
    snprintf(c->service, sizeof c->service, "%s", service);
    return true;
}

bool cb_curve_add_peer(cb_curve_t *c, const char *endpoint, const char *service, char *err, size_t errlen) {
    if (!c->on || !endpoint || strlen(endpoint) >= sizeof c->peers[0].endpoint || !service || !is_service(service)) {
        snprintf(err, errlen, "curve: cannot add a server key for %s (%s)", endpoint ? endpoint : "(null)",
                 service ? service : "(null)");
        return false;
    }
    cb_curve_peer_t *p = (cb_curve_peer_t *)cb_curve_peer(c, endpoint);
    if (!p) {
        if (c->n_peers >= CB_CURVE_MAX_PEERS) {
            snprintf(err, errlen, "curve: more than %d service endpoints", CB_CURVE_MAX_PEERS);
            return false;
        }
        p = &c->peers[c->n_peers];
    }
    cb_curve_peer_t np = {0};
    snprintf(np.endpoint, sizeof np.endpoint, "%s", endpoint);
    snprintf(np.name, sizeof np.name, "%s", service);
    if (!read_kind(c->keys_dir, CB_CURVE_PUBLIC, service, np.public_txt, NULL, err, errlen)) return false;
    if (p == &c->peers[c->n_peers]) c->n_peers++;
    *p = np;
    return true;
}

const cb_curve_peer_t *cb_curve_peer(const cb_curve_t *c, const char *endpoint) {
    for (int i = 0; endpoint && i < c->n_peers; i++)
        if (strcmp(c->peers[i].endpoint, endpoint) == 0) return &c->peers[i];
    return NULL;
}

bool cb_curve_from_config(const cb_config_t *cfg, const char *section, cb_curve_t *c, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    bool on;
    char dir[512];
    if (!cb_config_bool(cfg, section, "curve", false, &on, err, errlen)) return false;
    if (!on) return true;
    if (!cb_config_data_path(cfg, section, "keys_dir", "keys", dir, sizeof dir, err, errlen)) return false;
    if (!cb_curve_load_client(c, dir, section, err, errlen)) return false;
    if (is_service(section) && !cb_curve_load_server(c, section, err, errlen)) return false;
    /* the services' endpoints as clients name them (the same defaults as the config file) */
    static const struct { const char *service, *key, *def; } eps[] = {
        {"retriever", "endpoint", "tcp://127.0.0.1:5551"},   {"cacheindex", "endpoint", "tcp://127.0.0.1:5552"},
        {"precompute", "endpoint", "tcp://127.0.0.1:5553"},  {"precompute", "pull_endpoint", "tcp://127.0.0.1:5554"},
        {"blend", "endpoint", "tcp://127.0.0.1:5555"},
    };
    for (size_t i = 0; i < sizeof eps / sizeof eps[0]; i++) {
        const char *ep;
        if (!cb_config_endpoint(cfg, eps[i].service, eps[i].key, eps[i].def, &ep, err, errlen)) return false;
        if (ep && !cb_curve_add_peer(c, ep, eps[i].service, err, errlen)) return false;
    }
    return true;
}

/* ---------------------------------------------------------------------------------------------- */
/* Sockets                                                                                         */

static int set_key(void *h, int opt, const char *txt) { return zmq_setsockopt(h, opt, txt, strlen(txt)); }

int cb_curve_apply(const cb_curve_t *c, zsock_t *s, bool server, const char *endpoint, char *err, size_t errlen) {
    if (!c || !c->on) return 0;
    void *h = zsock_resolve(s);
    int rc;
    if (server) {
        if (!c->service[0]) {
            snprintf(err, errlen, "curve: %s cannot be a CURVE server: identity '%s' has no server key (only %s, %s, "
                     "%s and %s serve)", endpoint ? endpoint : "this socket", c->identity, cb_curve_services[0],
                     cb_curve_services[1], cb_curve_services[2], cb_curve_services[3]);
            return -1;
        }
        if (!cb_curve_zap_start(c->keys_dir, err, errlen)) return -1;
        int one = 1;
        rc = zmq_setsockopt(h, ZMQ_CURVE_SERVER, &one, sizeof one);
        rc |= set_key(h, ZMQ_CURVE_PUBLICKEY, c->server_public);
        rc |= set_key(h, ZMQ_CURVE_SECRETKEY, c->server_secret);
    } else {
        const cb_curve_peer_t *p = cb_curve_peer(c, endpoint);
        if (!p) {
            snprintf(err, errlen, "curve: no server key for %s: it is not the endpoint of a service in the "
                     "configuration (retriever/cacheindex/precompute/blend.endpoint, precompute.pull_endpoint)",
                     endpoint ? endpoint : "(none)");
            return -1;
        }
        rc = set_key(h, ZMQ_CURVE_SERVERKEY, p->public_txt);
        rc |= set_key(h, ZMQ_CURVE_PUBLICKEY, c->public_txt);
        rc |= set_key(h, ZMQ_CURVE_SECRETKEY, c->secret_txt);
    }
    if (rc != 0) {
        snprintf(err, errlen, "curve: cannot set the CURVE options: %s", zmq_strerror(zmq_errno()));
        return -1;
    }
    return 0;
}

bool cb_curve_endpoint_public(const char *endpoint) {
    if (!endpoint || strncmp(endpoint, "tcp://", 6) != 0) return false;
    const char *host = endpoint + 6, *colon = strrchr(host, ':');
    size_t n = colon ? (size_t)(colon - host) : strlen(host);
    if (n >= 2 && host[0] == '[' && host[n - 1] == ']') host++, n -= 2;
    if (n >= 4 && strncmp(host, "127.", 4) == 0) return false;
    if ((n == 9 && strncmp(host, "localhost", 9) == 0) || (n == 3 && strncmp(host, "::1", 3) == 0)) return false;
    return true;
}

/* ---------------------------------------------------------------------------------------------- */
/* ZAP                                                                                             */

static pthread_mutex_t s_zap_lock = PTHREAD_MUTEX_INITIALIZER;
static zactor_t *s_zap;
static char s_zap_dir[512];

static void s_zap_stop(void) {
    pthread_mutex_lock(&s_zap_lock);
    zactor_destroy(&s_zap);
    pthread_mutex_unlock(&s_zap_lock);
}

/* The public keys of KEYS/allowed into a memory store (caller owns), refusing bad files and repeats
 * (a zcertstore aborts on a repeated key: they never reach it). */
static zcertstore_t *allowed_load(const char *keys_dir, int *count, char *err, size_t errlen) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/allowed", keys_dir);
    DIR *d = opendir(dir);
    if (!d) {
        snprintf(err, errlen, "curve: cannot read the allowed client keys in %s: %s (make the keys with `cbctl keys "
                 "init %s`)", dir, strerror(errno), keys_dir);
        return NULL;
    }
    zcertstore_t *store = zcertstore_new(NULL);
    zhash_t *names = zhash_new(); /* public key -> file name, for the repeat message */
    if (names) zhash_autofree(names);
    *count = 0;
    bool ok = store && names;
    if (!ok) snprintf(err, errlen, "out of memory");
    for (struct dirent *e; ok && (e = readdir(d));) {
        size_t len = strlen(e->d_name);
        if (e->d_name[0] == '.' || (len >= 7 && strcmp(e->d_name + len - 7, "_secret") == 0)) continue;
        char path[1200], pub[CB_CURVE_TXT], e2[900];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) continue;
        if (!cb_curve_read(path, pub, NULL, e2, sizeof e2)) {
            snprintf(err, errlen, "curve: allowed client keys: %s", e2);
            ok = false;
            break;
        }
        const char *first = zhash_lookup(names, pub);
        if (first) {
            snprintf(err, errlen, "curve: allowed client keys: %s repeats the key of %s/%s (remove one)", path, dir, first);
            ok = false;
            break;
        }
        static const byte no_secret[32];
        byte key[32];
        zcert_t *cert = zmq_z85_decode(key, pub) ? zcert_new_from(key, no_secret) : NULL;
        if (!cert || zhash_insert(names, pub, e->d_name) != 0) {
            snprintf(err, errlen, "curve: allowed client keys: cannot index %s", path);
            zcert_destroy(&cert);
            ok = false;
            break;
        }
        zcertstore_insert(store, &cert);
        (*count)++;
    }
    closedir(d);
    zhash_destroy(&names);
    if (!ok) {
        zcertstore_destroy(&store);
        return NULL;
    }
    return store;
}

bool cb_curve_zap_start(const char *keys_dir, char *err, size_t errlen) {
    pthread_mutex_lock(&s_zap_lock);
    bool ok = true;
    if (s_zap) {
        if (strcmp(s_zap_dir, keys_dir) != 0) {
            snprintf(err, errlen, "curve: this process already authenticates clients with the keys of %s, not %s",
                     s_zap_dir, keys_dir);
            ok = false;
        }
        pthread_mutex_unlock(&s_zap_lock);
        return ok;
    }
    int count = 0;
    zcertstore_t *store = allowed_load(keys_dir, &count, err, errlen);
    if (store && count == 0) {
        snprintf(err, errlen, "curve: no client keys in %s/allowed: no client could connect", keys_dir);
        zcertstore_destroy(&store);
    }
    if (store) {
        s_zap = zactor_new(zauth, store); /* the actor owns the store from here */
        if (!s_zap) {
            zcertstore_destroy(&store);
            snprintf(err, errlen, "curve: cannot start the ZAP handler (zauth)");
        } else {
            if (cb_log_enabled(CB_LOG_DEBUG)) { /* zauth logs every ZAP request, with the client's key */
                zstr_send(s_zap, "VERBOSE");
                zsock_wait(s_zap);
            }
            snprintf(s_zap_dir, sizeof s_zap_dir, "%s", keys_dir);
            static bool registered;
            if (!registered) atexit(s_zap_stop);
            registered = true;
            cb_log(CB_LOG_INFO, NULL, "curve: ZAP handler admits the %d client keys of %s/allowed", count, keys_dir);
        }
    }
    ok = s_zap != NULL;
    pthread_mutex_unlock(&s_zap_lock);
    return ok;
}

/* ---------------------------------------------------------------------------------------------- */
/* Making keys                                                                                     */

#define N_FILES (2 * CB_CURVE_N_SERVICES + 2 * CB_CURVE_N_CLIENTS)

/* The files of a complete set, in order: server+public per service, client+allowed per identity. */
static bool set_paths(const char *dir, char paths[N_FILES][1024]) {
    int k = 0;
    for (int i = 0; i < CB_CURVE_N_SERVICES; i++) {
        if (!cb_curve_path(paths[k++], 1024, dir, CB_CURVE_SERVER, cb_curve_services[i])) return false;
        if (!cb_curve_path(paths[k++], 1024, dir, CB_CURVE_PUBLIC, cb_curve_services[i])) return false;
    }
    for (int i = 0; i < CB_CURVE_N_CLIENTS; i++) {
        if (!cb_curve_path(paths[k++], 1024, dir, CB_CURVE_CLIENT, cb_curve_clients[i])) return false;
        if (!cb_curve_path(paths[k++], 1024, dir, CB_CURVE_ALLOWED, cb_curve_clients[i])) return false;
    }
    return true;
}

static int make_dir(const char *dir, const char *sub, mode_t mode, char *err, size_t errlen) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, sub);
    if (mkdir(path, mode) != 0 && errno != EEXIST) {
        snprintf(err, errlen, "cannot create directory %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode) || chmod(path, mode) != 0) {
        snprintf(err, errlen, "%s is not a directory we can use: %s", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* One key pair: DIR/<pair_dir>/NAME.key{,_secret} (zcert_save) and its public copy in DIR/<copy_dir>. */
static int make_pair(const char *dir, cb_curve_file_t pair, cb_curve_file_t copy, const char *name, const char *role,
                     char *err, size_t errlen) {
    char secret[1024], pub[1024], copy_path[1024];
    cb_curve_path(secret, sizeof secret, dir, pair, name);
    snprintf(pub, sizeof pub, "%.*s", (int)(strlen(secret) - strlen("_secret")), secret);
    cb_curve_path(copy_path, sizeof copy_path, dir, copy, name);
    zcert_t *cert = zcert_new();
    if (!cert) {
        snprintf(err, errlen, "cannot make a key pair: %s", zmq_strerror(zmq_errno()));
        return -1;
    }
    zcert_set_meta(cert, "name", "%s", name);
    zcert_set_meta(cert, "role", "%s", role);
    zcert_set_meta(cert, "made-by", "cbctl keys init");
    unlink(secret); /* a new file gets the 0600 of the umask; chmod below covers an old one */
    int rc = zcert_save(cert, pub);
    if (rc == 0) rc = chmod(secret, 0600) | chmod(pub, 0644);
    if (rc == 0) rc = zcert_save_public(cert, copy_path) | chmod(copy_path, 0644);
    if (rc != 0) snprintf(err, errlen, "cannot write the keys of %s in %s: %s", name, dir, strerror(errno));
    zcert_destroy(&cert);
    return rc == 0 ? 0 : -1;
}

int cb_curve_keys_init(const char *dir, bool force, char *err, size_t errlen) {
    static char paths[N_FILES][1024];
    if (!dir || !*dir || !set_paths(dir, paths)) {
        snprintf(err, errlen, "invalid keys directory '%.200s' (empty or too long for CZMQ's zcert)", dir ? dir : "");
        return -1;
    }
    int present = 0;
    const char *missing = NULL, *found = NULL;
    for (int i = 0; i < N_FILES; i++) {
        if (access(paths[i], F_OK) == 0) {
            present++;
            if (!found) found = paths[i];
        } else if (!missing) {
            missing = paths[i];
        }
    }
    if (!force && present == N_FILES) return 0;
    if (!force && present > 0) {
        snprintf(err, errlen, "%s holds an incomplete key set (%s exists, %s is missing): use --force to replace it "
                 "with a new set", dir, found, missing);
        return -1;
    }
    if (cb_db_mkdirs(dir, err, errlen) != 0) return -1;
    mode_t old = umask(077);
    int rc = make_dir(dir, "server", 0700, err, errlen) | make_dir(dir, "client", 0700, err, errlen) |
             make_dir(dir, "public", 0755, err, errlen) | make_dir(dir, "allowed", 0755, err, errlen);
    for (int i = 0; rc == 0 && i < CB_CURVE_N_SERVICES; i++)
        rc = make_pair(dir, CB_CURVE_SERVER, CB_CURVE_PUBLIC, cb_curve_services[i], "server", err, errlen);
    for (int i = 0; rc == 0 && i < CB_CURVE_N_CLIENTS; i++)
        rc = make_pair(dir, CB_CURVE_CLIENT, CB_CURVE_ALLOWED, cb_curve_clients[i], "client", err, errlen);
    umask(old);
    return rc == 0 ? 1 : -1;
}
