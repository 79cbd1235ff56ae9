/* query: cb-blend's `query` message (docs/protocol.md §7) defined once: one struct with every field, the
 * limits as named constants, one encoder and one decoder. Every program that builds or reads a query goes
 * through it: cb-blend decodes with it, cb-router decodes and re-encodes it (adding the chunks it
 * retrieved), cbctl maps its flags and cb-gateway its JSON to it, cb-load its query file.
 *
 * The struct is a plain value (no allocation): its strings are borrowed, never NUL-terminated by the
 * decoder (use the lengths), and point into the decoded message (valid until cb_msg_destroy) or, when a
 * program fills it, into that program's own strings. The `set` bits say which optional fields the
 * message carries: a field not set takes the service's default (blend.k, blend.max_tokens, ...), which
 * only cb-blend knows, so a program that forwards a query keeps what was not set unset.
 *
 * The decoder checks presence, type, range and length of every field, in the order the fields are
 * listed below, and stops at the first bad one with a readable reason ("field 'max_tokens': expected
 * integer in [1, 4096], got 5000"), ready to send back as a bad_request. Fields it does not know are
 * ignored (forward compatibility, docs/protocol.md §2); nil counts as absent; a key given twice is an
 * error. The encoder writes the fields that are set; it does not validate (cb_query_check does).
 */
#ifndef CB_QUERY_H
#define CB_QUERY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "wire/msg.h"

#define CB_QUERY_MAX_QUESTION 8192          /* bytes of `question` (at least 1) */
#define CB_QUERY_MAX_CONTEXTS 32            /* texts in `contexts`, chunks in `retrieved` */
#define CB_QUERY_MAX_CONTEXT_BYTES 262144   /* bytes of one context (or retrieved chunk text) */
#define CB_QUERY_K_MIN 1                    /* `k`: the chunks cb-retriever gives a query without contexts */
#define CB_QUERY_K_MAX CB_QUERY_MAX_CONTEXTS
#define CB_QUERY_MAX_MODE 16                /* bytes of `mode` (full, prefix, reuse, blend) */
#define CB_QUERY_RATIO_MAX 1.0              /* `ratio`: [0, 1], or the string "auto" */
#define CB_QUERY_MAX_TOKENS_MIN 1           /* `max_tokens` */
#define CB_QUERY_MAX_TOKENS_MAX 4096
#define CB_QUERY_TEMPERATURE_MAX 5.0        /* `temperature`: [0, 5] (0 = greedy) */
#define CB_QUERY_TOP_P_MIN 1e-9             /* `top_p`: (0, 1] */
#define CB_QUERY_TOP_P_MAX 1.0
#define CB_QUERY_SEED_MAX INT64_MAX         /* `seed`: [0, 2^63 - 1] */
#define CB_QUERY_PENALTY_MAX 2.0            /* `frequency_penalty`, `presence_penalty`: [-2, 2] */
#define CB_QUERY_MAX_STOP 4                 /* stop sequences */
#define CB_QUERY_MAX_STOP_BYTES 256         /* bytes of one stop sequence (at least 1) */
#define CB_QUERY_CHUNK_ID_MIN 16            /* hex characters of a retrieved chunk's id (as cb-retriever's) */
#define CB_QUERY_CHUNK_ID_MAX 128
#define CB_QUERY_RETRIEVE_MS_MAX 3600000.0  /* `retrieve_ms` */

/* Bits of cb_query_t.set: the optional fields present in the message. */
enum {
    CB_QUERY_CONTEXTS = 1u << 0,          /* absent: cb-blend retrieves the top k chunks */
    CB_QUERY_K = 1u << 1,
    CB_QUERY_MODE = 1u << 2,
    CB_QUERY_RATIO = 1u << 3,             /* a number, or "auto" (ratio_auto) */
    CB_QUERY_MAX_TOKENS = 1u << 4,
    CB_QUERY_TEMPERATURE = 1u << 5,
    CB_QUERY_TOP_P = 1u << 6,
    CB_QUERY_SEED = 1u << 7,
    CB_QUERY_FREQUENCY_PENALTY = 1u << 8,
    CB_QUERY_PRESENCE_PENALTY = 1u << 9,
    CB_QUERY_STOP = 1u << 10,
    CB_QUERY_RETRIEVED = 1u << 11,        /* cb-router's retrieval: the worker does not search again */
    CB_QUERY_RETRIEVE_MS = 1u << 12,
};

typedef struct {
    unsigned set;                                      /* CB_QUERY_* bits */
    const char *question;                              /* [question_len], 1..CB_QUERY_MAX_QUESTION bytes */
    size_t question_len;
    int n_contexts;                                    /* with CB_QUERY_CONTEXTS; 0..CB_QUERY_MAX_CONTEXTS */
    const char *contexts[CB_QUERY_MAX_CONTEXTS];       /* [n_contexts] texts, each [context_lens[i]] */
    size_t context_lens[CB_QUERY_MAX_CONTEXTS];
    int k;                                             /* CB_QUERY_K_MIN..CB_QUERY_K_MAX */
    char mode[CB_QUERY_MAX_MODE + 1];                  /* NUL-terminated: "full", "prefix", "reuse" or "blend" */
    bool ratio_auto;                                   /* with CB_QUERY_RATIO: "auto" (ratio unused) */
    double ratio;                                      /* [0, 1] */
    int max_tokens;
    double temperature, top_p;
    int64_t seed;
    double frequency_penalty, presence_penalty;
    int n_stop;                                        /* with CB_QUERY_STOP; 0..CB_QUERY_MAX_STOP */
    const char *stop[CB_QUERY_MAX_STOP];               /* [n_stop] sequences, each [stop_lens[i]] */
    size_t stop_lens[CB_QUERY_MAX_STOP];
    /* the chunks cb-router retrieved for a query without contexts (docs/router.md), in rank order, and how
     * long that search took; a query carries either `contexts` or `retrieved` */
    int n_retrieved;                                   /* with CB_QUERY_RETRIEVED; 0..CB_QUERY_MAX_CONTEXTS */
    const char *retrieved_ids[CB_QUERY_MAX_CONTEXTS];  /* [n_retrieved] lower-case hex chunk ids */
    size_t retrieved_id_lens[CB_QUERY_MAX_CONTEXTS];
    const char *retrieved[CB_QUERY_MAX_CONTEXTS];      /* [n_retrieved] the chunks' texts */
    size_t retrieved_lens[CB_QUERY_MAX_CONTEXTS];
    double retrieve_ms;                                /* with CB_QUERY_RETRIEVE_MS; [0, CB_QUERY_RETRIEVE_MS_MAX] */
} cb_query_t;

/* An empty query: nothing set, no question. */
void cb_query_init(cb_query_t *q);

/* True when name is a mode a query may ask for ("full", "prefix", "reuse", "blend"). */
bool cb_query_mode_valid(const char *name);

/* Reads and validates the fields of a decoded `query` message m into q (its strings point into m). False
 * with the reason in why (q is then partly filled). Does not look at m's type. */
bool cb_query_decode(const cb_msg_t *m, cb_query_t *q, char *why, size_t whylen);

/* Starts the message {v, type: "query", id} in w and writes q's question and the fields set in q; the
 * caller adds nothing or more and calls cb_msg_end. Does not validate q (the writer's own misuse checks
 * apply: an invalid id makes it fail). */
void cb_query_encode(const cb_query_t *q, const char *id, cb_msg_writer_t *w);

/* Validates q as cb_query_decode would validate its message (encodes it and decodes it back). True, or
 * false with the reason in why (also when out of memory). */
bool cb_query_check(const cb_query_t *q, char *why, size_t whylen);

#endif
