/* ident: the client of an ingest, from the authenticated CURVE key (see ident.h). */
#include "ident.h"
#include "base/alloc.h"

#include <errno.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"

typedef struct {
    char name[PC_IDENT_NAME_MAX + 1];
    char key[CB_CURVE_TXT];       /* its public key, Z85 */
} forwarder_t;

struct pc_ident {
    bool require_key;             /* curve on, not behind a broker: every request has a User-Id */
    int n;
    forwarder_t fw[PC_IDENT_MAX_FORWARDERS];
};

static bool name_ok(const char *s, size_t n) {
    if (n == 0 || n > PC_IDENT_NAME_MAX || s[0] == '.') return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
              c == '.'))
            return false;
    }
    return true;
}

pc_ident_t *pc_ident_new(const cb_curve_t *curve, bool behind_broker, const char *trusted, char *err, size_t errlen) {
    pc_ident_t *self = cb_calloc(1, sizeof *self);
    if (!self) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (!curve || !curve->on) return self;
    self->require_key = !behind_broker;
    if (!trusted) return self;
    for (const char *p = trusted; *p;) {
        p += strspn(p, ", \t");
        size_t n = strcspn(p, ", \t");
        if (n == 0) break;
        if (!name_ok(p, n)) {
            snprintf(err, errlen, "precompute.trusted_forwarders: '%.*s' is not a key name (1..%d of a-z A-Z 0-9 . - _)",
                     (int)(n > 64 ? 64 : n), p, PC_IDENT_NAME_MAX);
            goto fail;
        }
        if (self->n >= PC_IDENT_MAX_FORWARDERS) {
            snprintf(err, errlen, "precompute.trusted_forwarders: more than %d names", PC_IDENT_MAX_FORWARDERS);
            goto fail;
        }
        forwarder_t *f = &self->fw[self->n];
        snprintf(f->name, sizeof f->name, "%.*s", (int)n, p);
        p += n;
        char path[1024];
        struct stat st;
        if (!cb_curve_path(path, sizeof path, curve->keys_dir, CB_CURVE_ALLOWED, f->name)) {
            snprintf(err, errlen, "precompute.trusted_forwarders: keys_dir %.200s: path too long", curve->keys_dir);
            goto fail;
        }
        if (stat(path, &st) != 0 && errno == ENOENT) {
            cb_log(CB_LOG_WARN, NULL, "trusted forwarder '%s': no %s, so it is not trusted (its on_behalf_of is "
                   "refused)", f->name, path);
            continue;
        }
        char e[900];
        if (!cb_curve_read(path, f->key, NULL, e, sizeof e)) {
            snprintf(err, errlen, "precompute.trusted_forwarders: %s", e);
            goto fail;
        }
        bool repeat = false;
        for (int i = 0; i < self->n; i++) repeat |= strcmp(self->fw[i].key, f->key) == 0 || !strcmp(self->fw[i].name, f->name);
        if (repeat) {
            snprintf(err, errlen, "precompute.trusted_forwarders: '%s' is named twice, or has the key of another", f->name);
            goto fail;
        }
        self->n++;
    }
    return self;
fail:
    pc_ident_destroy(&self);
    return NULL;
}

void pc_ident_destroy(pc_ident_t **self_p) {
    if (!self_p || !*self_p) return;
    sodium_memzero(*self_p, sizeof **self_p);
    free(*self_p);
    *self_p = NULL;
}

int pc_ident_forwarders(const pc_ident_t *self) { return self ? self->n : 0; }

/* An optional field of 1..PC_IDENT_FIELD_MAX printable ASCII bytes into out: 1 = present, 0 = absent,
 * -1 = invalid (why). */
static int field(const cb_msg_t *m, const char *key, char out[PC_IDENT_FIELD_MAX + 1], char *why, size_t whylen) {
    out[0] = 0;
    if (!cb_msg_has(m, key)) return 0;
    const char *c;
    size_t n;
    if (!cb_msg_str(m, key, PC_IDENT_FIELD_MAX, &c, &n)) {
        snprintf(why, whylen, "%s", cb_msg_last_error(m));
        return -1;
    }
    bool ok = n > 0;
    for (size_t i = 0; i < n && ok; i++) ok = c[i] >= 0x20 && c[i] <= 0x7e;
    if (!ok) {
        snprintf(why, whylen, "field '%s': 1..%d printable ASCII characters", key, PC_IDENT_FIELD_MAX);
        return -1;
    }
    memcpy(out, c, n);
    out[n] = 0;
    return 1;
}

/* prefix + the hex of bytes (of their BLAKE2b-128 when longer than 32) into out. */
static void hex_key(const char *prefix, const uint8_t *b, size_t n, char out[CB_JOB_CLIENT_MAX + 1]) {
    uint8_t h[16];
    if (n > 32) {
        crypto_generichash(h, sizeof h, b, n, NULL, 0);
        b = h;
        n = sizeof h;
    }
    size_t pl = strlen(prefix);
    memcpy(out, prefix, pl);
    sodium_bin2hex(out + pl, CB_JOB_CLIENT_MAX + 1 - pl, b, n);
}

cb_err_t pc_ident_resolve(const pc_ident_t *self, const cb_msg_t *m, const char *user_id, const uint8_t *peer,
                          size_t peer_len, pc_who_t *who, char *why, size_t whylen) {
    memset(who, 0, sizeof *who);
    char client[PC_IDENT_FIELD_MAX + 1], behalf[PC_IDENT_FIELD_MAX + 1];
    int has_client = field(m, "client", client, why, whylen);
    if (has_client < 0) return CB_ERR_BAD_REQUEST;
    int has_behalf = field(m, "on_behalf_of", behalf, why, whylen);
    if (has_behalf < 0) return CB_ERR_BAD_REQUEST;
    if (self && self->require_key && !(user_id && user_id[0])) {
        snprintf(why, whylen, "CURVE is on but the connection has no authenticated key (ZAP User-Id): refused");
        return CB_ERR_INTERNAL;
    }
    if (user_id && user_id[0]) { /* authenticated by the CURVE handshake (ZAP) */
        const forwarder_t *fw = NULL;
        for (int i = 0; self && i < self->n && !fw; i++)
            if (strcmp(self->fw[i].key, user_id) == 0) fw = &self->fw[i];
        if (has_behalf && !fw) {
            snprintf(why, whylen, "field 'on_behalf_of': only a trusted forwarder (precompute.trusted_forwarders) "
                     "may send it; this CURVE key counts as itself");
            return CB_ERR_BAD_REQUEST;
        }
        if (has_behalf) snprintf(who->principal, sizeof who->principal, "%s:%s", fw->name, behalf);
        else if (strlen(user_id) + 2 <= CB_JOB_CLIENT_MAX) snprintf(who->principal, sizeof who->principal, "k:%s", user_id);
        else hex_key("kh:", (const uint8_t *)user_id, strlen(user_id), who->principal);
        who->authenticated = true;
    } else if (has_behalf) {
        snprintf(who->principal, sizeof who->principal, "f:%s", behalf);
    } else if (has_client) {
        snprintf(who->principal, sizeof who->principal, "c:%s", client);
        has_client = 0; /* it is the principal already */
    } else if (!peer) {
        snprintf(who->principal, sizeof who->principal, "pull");
    } else {
        hex_key("peer:", peer, peer_len, who->principal);
    }
    if (has_client) snprintf(who->identity, sizeof who->identity, "%s/%s", who->principal, client);
    else snprintf(who->identity, sizeof who->identity, "%s", who->principal);
    return CB_ERR_NONE;
}
