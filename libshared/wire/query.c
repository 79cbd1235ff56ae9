/* query: the `query` message's codec (see query.h). */
#include "wire/query.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const char *const MODES[] = {"full", "prefix", "reuse", "blend"};

void cb_query_init(cb_query_t *q) { memset(q, 0, sizeof *q); }

bool cb_query_mode_valid(const char *name) {
    for (size_t i = 0; name && i < sizeof MODES / sizeof MODES[0]; i++)
        if (!strcmp(name, MODES[i])) return true;
    return false;
}

static bool bad(char *why, size_t whylen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool bad(char *why, size_t whylen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, whylen, fmt, ap);
    va_end(ap);
    return false;
}

/* The accessor's reason for the last failure on m. */
static bool bad_field(const cb_msg_t *m, char *why, size_t whylen) {
    return bad(why, whylen, "%s", cb_msg_last_error(m));
}

/* An optional integer / number: absent leaves q untouched; present sets bit in q->set. */
static bool opt_int(const cb_msg_t *m, const char *key, int64_t lo, int64_t hi, unsigned bit, int64_t *out,
                    cb_query_t *q) {
    if (!cb_msg_int_or(m, key, lo, hi, 0, out)) return false;
    if (cb_msg_has(m, key)) q->set |= bit;
    return true;
}

static bool opt_double(const cb_msg_t *m, const char *key, double lo, double hi, unsigned bit, double *out,
                       cb_query_t *q) {
    double v;
    if (!cb_msg_double_or(m, key, lo, hi, 0.0, &v)) return false;
    if (cb_msg_has(m, key)) {
        q->set |= bit;
        *out = v;
    }
    return true;
}

/* `contexts`: absent, or an array of at most CB_QUERY_MAX_CONTEXTS texts. */
static bool get_contexts(const cb_msg_t *m, cb_query_t *q, char *why, size_t whylen) {
    int p = cb_msg_present(m, "contexts");
    if (p <= 0) return p == 0 || bad_field(m, why, whylen);
    size_t n;
    if (!cb_msg_array_len(m, "contexts", CB_QUERY_MAX_CONTEXTS, &n)) return bad_field(m, why, whylen);
    for (size_t i = 0; i < n; i++) {
        if (!cb_msg_at_str(m, "contexts", i, CB_QUERY_MAX_CONTEXT_BYTES, &q->contexts[i], &q->context_lens[i]))
            return bad_field(m, why, whylen);
        q->n_contexts = (int)i + 1;
    }
    q->set |= CB_QUERY_CONTEXTS;
    return true;
}

/* `ratio`: a number in [0, 1], or the string "auto". */
static bool get_ratio(const cb_msg_t *m, cb_query_t *q, char *why, size_t whylen) {
    int p = cb_msg_present(m, "ratio");
    if (p <= 0) return p == 0 || bad_field(m, why, whylen);
    const char *s;
    size_t len;
    if (cb_msg_str(m, "ratio", 16, &s, &len)) {
        if (len != 4 || memcmp(s, "auto", 4))
            return bad(why, whylen, "field 'ratio': expected a number in [0, 1] or \"auto\", got '%.*s'", (int)len, s);
        q->ratio_auto = true;
    } else if (!cb_msg_double(m, "ratio", 0.0, CB_QUERY_RATIO_MAX, &q->ratio)) {
        return bad_field(m, why, whylen);
    }
    q->set |= CB_QUERY_RATIO;
    return true;
}

/* `stop`: absent, one string, or an array of at most CB_QUERY_MAX_STOP strings (empty: none), each
 * 1..CB_QUERY_MAX_STOP_BYTES bytes. */
static bool get_stop(const cb_msg_t *m, cb_query_t *q, char *why, size_t whylen) {
    int p = cb_msg_present(m, "stop");
    if (p <= 0) return p == 0 || bad_field(m, why, whylen);
    q->set |= CB_QUERY_STOP;
    const char *s;
    size_t len, n;
    if (cb_msg_array_len(m, "stop", SIZE_MAX, &n)) {
        if (n > CB_QUERY_MAX_STOP)
            return bad(why, whylen, "field 'stop': at most %d stop sequences, got %zu", CB_QUERY_MAX_STOP, n);
        for (size_t i = 0; i < n; i++) {
            if (!cb_msg_at_str(m, "stop", i, CB_QUERY_MAX_STOP_BYTES, &s, &len)) return bad_field(m, why, whylen);
            if (len == 0)
                return bad(why, whylen, "field 'stop[%zu]': empty (a stop sequence has 1..%d bytes)", i,
                           CB_QUERY_MAX_STOP_BYTES);
            q->stop[i] = s;
            q->stop_lens[i] = len;
            q->n_stop = (int)i + 1;
        }
        return true;
    }
    if (!cb_msg_str(m, "stop", SIZE_MAX, &s, &len))
        return bad(why, whylen, "field 'stop': expected a string or an array of at most %d strings", CB_QUERY_MAX_STOP);
    if (len == 0 || len > CB_QUERY_MAX_STOP_BYTES)
        return bad(why, whylen, "field 'stop': a stop sequence has 1..%d bytes, got %zu", CB_QUERY_MAX_STOP_BYTES, len);
    q->stop[0] = s;
    q->stop_lens[0] = len;
    q->n_stop = 1;
    return true;
}

/* `retrieved`: absent, or an array of at most CB_QUERY_MAX_CONTEXTS maps {chunk_id, text}; not with
 * `contexts`. `retrieve_ms`: absent, or a number of milliseconds. */
static bool get_retrieved(const cb_msg_t *m, cb_query_t *q, char *why, size_t whylen) {
    int p = cb_msg_present(m, "retrieved");
    if (p < 0) return bad_field(m, why, whylen);
    if (p > 0) {
        if (q->set & CB_QUERY_CONTEXTS)
            return bad(why, whylen, "field 'retrieved': a query carries either 'contexts' or 'retrieved', not both");
        size_t n;
        if (!cb_msg_array_len(m, "retrieved", CB_QUERY_MAX_CONTEXTS, &n)) return bad_field(m, why, whylen);
        for (size_t i = 0; i < n; i++) {
            const cb_msg_t *h = cb_msg_at_map(m, "retrieved", i);
            if (!h) return bad_field(m, why, whylen);
            if (!cb_msg_hex(h, "chunk_id", CB_QUERY_CHUNK_ID_MIN, CB_QUERY_CHUNK_ID_MAX, &q->retrieved_ids[i],
                            &q->retrieved_id_lens[i]) ||
                !cb_msg_str(h, "text", CB_QUERY_MAX_CONTEXT_BYTES, &q->retrieved[i], &q->retrieved_lens[i]))
                return bad_field(h, why, whylen);
            q->n_retrieved = (int)i + 1;
        }
        q->set |= CB_QUERY_RETRIEVED;
    }
    if (!opt_double(m, "retrieve_ms", 0.0, CB_QUERY_RETRIEVE_MS_MAX, CB_QUERY_RETRIEVE_MS, &q->retrieve_ms, q))
        return bad_field(m, why, whylen);
    return true;
}

bool cb_query_decode(const cb_msg_t *m, cb_query_t *q, char *why, size_t whylen) {
    cb_query_init(q);
    if (!cb_msg_str(m, "question", CB_QUERY_MAX_QUESTION, &q->question, &q->question_len))
        return bad_field(m, why, whylen);
    if (q->question_len == 0) return bad(why, whylen, "field 'question': empty");
    if (!get_contexts(m, q, why, whylen)) return false;
    int64_t v = 0;
    if (!opt_int(m, "k", CB_QUERY_K_MIN, CB_QUERY_K_MAX, CB_QUERY_K, &v, q)) return bad_field(m, why, whylen);
    q->k = (int)v;
    const char *s;
    size_t len;
    if (!cb_msg_str_or(m, "mode", CB_QUERY_MAX_MODE, NULL, &s, &len)) return bad_field(m, why, whylen);
    if (s) {
        snprintf(q->mode, sizeof q->mode, "%.*s", (int)len, s);
        if (strlen(q->mode) != len || !cb_query_mode_valid(q->mode))
            return bad(why, whylen, "field 'mode': expected full, prefix, reuse or blend, got '%s'", q->mode);
        q->set |= CB_QUERY_MODE;
    }
    if (!get_ratio(m, q, why, whylen)) return false;
    if (!opt_int(m, "max_tokens", CB_QUERY_MAX_TOKENS_MIN, CB_QUERY_MAX_TOKENS_MAX, CB_QUERY_MAX_TOKENS, &v, q))
        return bad_field(m, why, whylen);
    q->max_tokens = (int)v;
    if (!opt_double(m, "temperature", 0.0, CB_QUERY_TEMPERATURE_MAX, CB_QUERY_TEMPERATURE, &q->temperature, q) ||
        !opt_double(m, "top_p", CB_QUERY_TOP_P_MIN, CB_QUERY_TOP_P_MAX, CB_QUERY_TOP_P, &q->top_p, q) ||
        !opt_int(m, "seed", 0, CB_QUERY_SEED_MAX, CB_QUERY_SEED, &q->seed, q) ||
        !opt_double(m, "frequency_penalty", -CB_QUERY_PENALTY_MAX, CB_QUERY_PENALTY_MAX, CB_QUERY_FREQUENCY_PENALTY,
                    &q->frequency_penalty, q) ||
        !opt_double(m, "presence_penalty", -CB_QUERY_PENALTY_MAX, CB_QUERY_PENALTY_MAX, CB_QUERY_PRESENCE_PENALTY,
                    &q->presence_penalty, q))
        return bad_field(m, why, whylen);
    return get_stop(m, q, why, whylen) && get_retrieved(m, q, why, whylen);
}

static void put_texts(cb_msg_writer_t *w, const char *key, const char *const *s, const size_t *lens, int n) {
    cb_msg_begin_array(w, key);
    for (int i = 0; i < n; i++) cb_msg_put_strn(w, NULL, s[i], lens[i]);
    cb_msg_end_array(w);
}

void cb_query_encode(const cb_query_t *q, const char *id, cb_msg_writer_t *w) {
    const unsigned set = q->set;
    cb_msg_begin(w, "query", id);
    cb_msg_put_strn(w, "question", q->question ? q->question : "", q->question ? q->question_len : 0);
    if (set & CB_QUERY_CONTEXTS) put_texts(w, "contexts", q->contexts, q->context_lens, q->n_contexts);
    if (set & CB_QUERY_K) cb_msg_put_int(w, "k", q->k);
    if (set & CB_QUERY_MODE) cb_msg_put_str(w, "mode", q->mode);
    if ((set & CB_QUERY_RATIO) && q->ratio_auto) cb_msg_put_str(w, "ratio", "auto");
    else if (set & CB_QUERY_RATIO) cb_msg_put_double(w, "ratio", q->ratio);
    if (set & CB_QUERY_MAX_TOKENS) cb_msg_put_int(w, "max_tokens", q->max_tokens);
    if (set & CB_QUERY_TEMPERATURE) cb_msg_put_double(w, "temperature", q->temperature);
    if (set & CB_QUERY_TOP_P) cb_msg_put_double(w, "top_p", q->top_p);
    if (set & CB_QUERY_SEED) cb_msg_put_int(w, "seed", q->seed);
    if (set & CB_QUERY_FREQUENCY_PENALTY) cb_msg_put_double(w, "frequency_penalty", q->frequency_penalty);
    if (set & CB_QUERY_PRESENCE_PENALTY) cb_msg_put_double(w, "presence_penalty", q->presence_penalty);
    if (set & CB_QUERY_STOP) put_texts(w, "stop", q->stop, q->stop_lens, q->n_stop);
    if (set & CB_QUERY_RETRIEVED) {
        cb_msg_begin_array(w, "retrieved");
        for (int i = 0; i < q->n_retrieved; i++) {
            cb_msg_begin_map(w, NULL);
            cb_msg_put_strn(w, "chunk_id", q->retrieved_ids[i], q->retrieved_id_lens[i]);
            cb_msg_put_strn(w, "text", q->retrieved[i], q->retrieved_lens[i]);
            cb_msg_end_map(w);
        }
        cb_msg_end_array(w);
    }
    if (set & CB_QUERY_RETRIEVE_MS) cb_msg_put_double(w, "retrieve_ms", q->retrieve_ms);
}

bool cb_query_check(const cb_query_t *q, char *why, size_t whylen) {
    cb_msg_writer_t *w = cb_msg_writer_new();
    if (!w) return bad(why, whylen, "out of memory");
    cb_query_encode(q, "check", w);
    size_t len;
    const void *d = cb_msg_end(w, &len);
    cb_msg_error_t e;
    cb_msg_t *m = d ? cb_msg_decode_ex(d, len, len + 1, &e) : NULL;
    cb_query_t back;
    bool ok = m && cb_query_decode(m, &back, why, whylen);
    if (!d) bad(why, whylen, "cannot encode the query: %s", cb_msg_writer_error(w));
    else if (!m) bad(why, whylen, "%s", e.message);
    cb_msg_destroy(&m);
    cb_msg_writer_destroy(&w);
    return ok;
}
