/* msg_internal.h: what the wire protocol's source files share; not for use outside libshared/wire.
 *   msg.c         error codes, UTF-8, the bounded pre-scan, decoding and the envelope;
 *   msg_fields.c  a decoded message's typed fields: value checks, accessors, views, JSON;
 *   msg_writer.c  the writer.
 * Here: a decoded message's layout (its root and the views into it) and the functions one file defines
 * for another. */
#ifndef CB_MSG_INTERNAL_H
#define CB_MSG_INTERNAL_H

#include "wire/msg.h"

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---------------------------------------------------------------------------------------------- */
/* Messages and views                                                                              */

typedef struct msg_root_s msg_root_t;

struct cb_msg_s {
    msg_root_t *r;
    const msgpack_object *map; /* a MAP object in r->up.zone */
    const char *path;          /* "" for the root, else e.g. "hits[3]." (zone-allocated) */
};

struct msg_root_s {
    cb_msg_t top;  /* the root view; &r->top is what cb_msg_decode returns */
    char *buf;     /* [len] owned copy of the input; STR/BIN objects point here */
    size_t len;
    msgpack_unpacked up;
    int version;
    int ok; /* -1 absent, 0 false, 1 true */
    cb_err_t err_code;
    char type[CB_MSG_MAX_TYPE + 1];
    char id[CB_MSG_MAX_ID + 1];
    char err_code_name[CB_MSG_MAX_TYPE + 1];
    char *err_message; /* malloc'd, NUL-terminated; "" when ok */
    char last_error[256];
};

/* msg.c */
/* Replaces every byte that does not start a valid UTF-8 sequence by '?', in place. */
void cb_msg_utf8_sanitize(char *str);
/* A message type: 1..CB_MSG_MAX_TYPE characters [a-z0-9_] starting with a letter; a request id: at most
 * CB_MSG_MAX_ID printable ASCII bytes. */
bool cb_msg_valid_type_name(const char *s, size_t n);
bool cb_msg_valid_id(const char *s, size_t n);
/* msg_fields.c */
/* 1: found (non-nil) in *out; 0: absent or nil; -1: duplicate key (error set). */
int cb_msg_lookup(const cb_msg_t *m, const char *key, const msgpack_object **out);
/* Required field: the object, or NULL with the error set. */
const msgpack_object *cb_msg_require(const cb_msg_t *m, const char *key);
/* The name of an object's type, for errors. */
const char *cb_msg_type_name(const msgpack_object *o);
/* An integer in [min, max] into *out, or false with the error set (`key` labels it). */
bool cb_msg_chk_int(const cb_msg_t *m, const char *key, const msgpack_object *o, int64_t min, int64_t max,
             int64_t *out);

#endif
