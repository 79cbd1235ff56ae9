/* openai: chat-completions JSON <-> the query protocol. See openai.h. */
#include "openai.h"

#include <math.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>

static bool fail(char *err, size_t errlen, const char **param, const char *p, const char *fmt, const char *a) {
    snprintf(err, errlen, fmt, a);
    *param = p;
    return false;
}

/* A number field in [lo, hi] (absent or null: *out untouched). */
static bool get_number(json_t *o, const char *key, double lo, double hi, double *out, char *err, size_t errlen,
                       const char **param) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_number(v)) return fail(err, errlen, param, key, "'%s' must be a number", key);
    double d = json_number_value(v);
    if (!isfinite(d) || d < lo || d > hi) {
        snprintf(err, errlen, "'%s' must be between %g and %g", key, lo, hi);
        *param = key;
        return false;
    }
    *out = d;
    return true;
}

static bool get_int(json_t *o, const char *key, int64_t lo, int64_t hi, int64_t *out, char *err, size_t errlen,
                    const char **param) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_integer(v)) return fail(err, errlen, param, key, "'%s' must be an integer", key);
    json_int_t i = json_integer_value(v);
    if (i < lo || i > hi) {
        snprintf(err, errlen, "'%s' must be between %lld and %lld", key, (long long)lo, (long long)hi);
        *param = key;
        return false;
    }
    *out = i;
    return true;
}

/* The query's sampling fields present (not null) in the request o, into q->set. */
static void mark_set(json_t *o, cb_query_t *q) {
    static const struct {
        const char *key;
        unsigned bit;
    } FIELDS[] = {{"temperature", CB_QUERY_TEMPERATURE},
                  {"top_p", CB_QUERY_TOP_P},
                  {"seed", CB_QUERY_SEED},
                  {"frequency_penalty", CB_QUERY_FREQUENCY_PENALTY},
                  {"presence_penalty", CB_QUERY_PRESENCE_PENALTY}};
    for (size_t i = 0; i < sizeof FIELDS / sizeof FIELDS[0]; i++) {
        json_t *v = json_object_get(o, FIELDS[i].key);
        if (v && !json_is_null(v)) q->set |= FIELDS[i].bit;
    }
}

static bool get_bool(json_t *o, const char *key, bool *out, char *err, size_t errlen, const char **param) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_boolean(v)) return fail(err, errlen, param, key, "'%s' must be a boolean", key);
    *out = json_is_true(v);
    return true;
}

/* The text of a message's content: a string, or an array of parts of which the text ones are joined
 * (only one text part is supported: the common case; more is an error rather than a silent join). */
static const char *content_text(json_t *content) {
    if (json_is_string(content)) return json_string_value(content);
    if (!json_is_array(content)) return NULL;
    const char *text = NULL;
    size_t i;
    json_t *part;
    json_array_foreach(content, i, part) {
        json_t *t = json_object_get(part, "type");
        if (!json_is_string(t) || strcmp(json_string_value(t), "text")) continue;
        json_t *s = json_object_get(part, "text");
        if (!json_is_string(s) || text) return NULL;
        text = json_string_value(s);
    }
    return text;
}

static bool parse_messages(json_t *root, gw_chat_t *r, char *err, size_t errlen, const char **param) {
    json_t *msgs = json_object_get(root, "messages");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return fail(err, errlen, param, "messages", "'%s' must be a non-empty array of messages", "messages");
    if (json_array_size(msgs) > 1024) return fail(err, errlen, param, "messages", "at most 1024 %s", "messages");
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
        json_t *role = json_object_get(m, "role");
        if (!json_is_object(m) || !json_is_string(role))
            return fail(err, errlen, param, "messages", "every message must be an object with a string '%s'", "role");
        const char *rs = json_string_value(role);
        if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") && strcmp(rs, "developer") &&
            strcmp(rs, "tool"))
            return fail(err, errlen, param, "messages", "unknown message role '%.32s'", rs);
        if (strcmp(rs, "user")) continue;
        const char *text = content_text(json_object_get(m, "content"));
        if (!text) return fail(err, errlen, param, "messages", "a user message needs a string '%s' (or one text part)", "content");
        r->query.question = text;
    }
    if (!r->query.question)
        return fail(err, errlen, param, "messages", "no user message: the last %s message is the question", "user");
    size_t ql = strlen(r->query.question);
    if (ql == 0) return fail(err, errlen, param, "messages", "the %s message is empty", "user");
    if (ql > CB_QUERY_MAX_QUESTION) {
        snprintf(err, errlen, "the question (the last user message) is %zu bytes; at most %d", ql, CB_QUERY_MAX_QUESTION);
        *param = "messages";
        return false;
    }
    r->query.question_len = ql;
    return true;
}

static bool parse_documents(json_t *root, gw_chat_t *r, char *err, size_t errlen, const char **param) {
    json_t *docs = json_object_get(root, "documents");
    if (!docs || json_is_null(docs)) return true;
    if (!json_is_array(docs)) return fail(err, errlen, param, "documents", "'%s' must be an array of texts", "documents");
    if (json_array_size(docs) > CB_QUERY_MAX_CONTEXTS) {
        snprintf(err, errlen, "at most %d documents (got %zu)", CB_QUERY_MAX_CONTEXTS, json_array_size(docs));
        *param = "documents";
        return false;
    }
    size_t i;
    json_t *d;
    json_array_foreach(docs, i, d) {
        json_t *t = json_is_object(d) ? json_object_get(d, "text") : d; /* a text, or {"text": ...} */
        if (!json_is_string(t) || json_string_length(t) == 0)
            return fail(err, errlen, param, "documents", "every document must be a non-empty string (or {\"text\": %s})", "...");
        if (json_string_length(t) > CB_QUERY_MAX_CONTEXT_BYTES) {
            snprintf(err, errlen, "document %zu is %zu bytes; at most %d", i, json_string_length(t),
                     CB_QUERY_MAX_CONTEXT_BYTES);
            *param = "documents";
            return false;
        }
        cb_query_t *q = &r->query;
        q->contexts[q->n_contexts] = json_string_value(t);
        q->context_lens[q->n_contexts] = strlen(q->contexts[q->n_contexts]);
        q->n_contexts++;
        q->set |= CB_QUERY_CONTEXTS;
    }
    return true;
}

static bool parse_stop(json_t *root, gw_chat_t *r, char *err, size_t errlen, const char **param) {
    json_t *stop = json_object_get(root, "stop");
    if (!stop || json_is_null(stop)) return true;
    json_t *one[1] = {stop};
    size_t n = json_is_array(stop) ? json_array_size(stop) : 1;
    if (!json_is_array(stop) && !json_is_string(stop))
        return fail(err, errlen, param, "stop", "'%s' must be a string or an array of strings", "stop");
    if (n > CB_QUERY_MAX_STOP) return fail(err, errlen, param, "stop", "at most 4 %s sequences", "stop");
    cb_query_t *q = &r->query;
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_is_array(stop) ? json_array_get(stop, i) : one[0];
        if (!json_is_string(s) || json_string_length(s) == 0 || json_string_length(s) > CB_QUERY_MAX_STOP_BYTES)
            return fail(err, errlen, param, "stop", "every %s sequence must be a string of 1 to 256 bytes", "stop");
        q->stop[q->n_stop] = json_string_value(s);
        q->stop_lens[q->n_stop] = strlen(q->stop[q->n_stop]);
        q->n_stop++;
        q->set |= CB_QUERY_STOP;
    }
    return true;
}

static bool parse_ext(json_t *root, gw_chat_t *r, char *err, size_t errlen, const char **param) {
    json_t *cb = json_object_get(root, "cacheblend");
    if (!cb || json_is_null(cb)) return true;
    if (!json_is_object(cb)) return fail(err, errlen, param, "cacheblend", "'%s' must be an object", "cacheblend");
    cb_query_t *q = &r->query;
    json_t *mode = json_object_get(cb, "mode");
    if (mode && !json_is_null(mode)) {
        const char *m = json_is_string(mode) ? json_string_value(mode) : "";
        if (!cb_query_mode_valid(m))
            return fail(err, errlen, param, "cacheblend.mode", "'%s' must be full, prefix, reuse or blend", "cacheblend.mode");
        snprintf(q->mode, sizeof q->mode, "%s", m);
        q->set |= CB_QUERY_MODE;
    }
    int64_t k = -1;
    json_t *ratio = json_object_get(cb, "ratio");
    if (json_is_string(ratio)) { /* "auto": chosen per request by cb-blend */
        if (strcmp(json_string_value(ratio), "auto"))
            return fail(err, errlen, param, "cacheblend.ratio", "'%s' must be a number in [0, 1] or \"auto\"", "cacheblend.ratio");
        q->ratio_auto = true;
        q->set |= CB_QUERY_RATIO;
    } else if (!get_number(cb, "ratio", 0, CB_QUERY_RATIO_MAX, &q->ratio, err, errlen, param)) {
        *param = "cacheblend.ratio";
        return false;
    } else if (json_is_number(ratio)) {
        q->set |= CB_QUERY_RATIO;
    }
    if (!get_int(cb, "k", CB_QUERY_K_MIN, CB_QUERY_K_MAX, &k, err, errlen, param)) {
        *param = "cacheblend.k";
        return false;
    }
    if (k > 0) {
        q->k = (int)k;
        q->set |= CB_QUERY_K;
    }
    return true;
}

bool gw_chat_parse(const char *body, size_t len, gw_chat_t *r, char *err, size_t errlen, const char **param) {
    memset(r, 0, sizeof *r);
    cb_query_init(&r->query);
    cb_query_t *q = &r->query;
    *param = NULL;
    json_error_t je;
    r->root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!r->root) {
        snprintf(err, errlen, "the body is not valid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
        return false;
    }
    bool ok = json_is_object(r->root) || fail(err, errlen, param, NULL, "the body must be a JSON %s", "object");
    json_t *o = r->root;
    json_t *model = ok ? json_object_get(o, "model") : NULL;
    if (ok && model && !json_is_null(model)) {
        if (!json_is_string(model) || json_string_length(model) > 256)
            ok = fail(err, errlen, param, "model", "'%s' must be a string (at most 256 bytes)", "model");
        else r->model = json_string_value(model);
    }
    int64_t n = 1, mt = -1, mct = -1;
    ok = ok && parse_messages(o, r, err, errlen, param) && parse_documents(o, r, err, errlen, param) &&
         parse_stop(o, r, err, errlen, param) && parse_ext(o, r, err, errlen, param) &&
         get_int(o, "max_tokens", CB_QUERY_MAX_TOKENS_MIN, CB_QUERY_MAX_TOKENS_MAX, &mt, err, errlen, param) &&
         get_int(o, "max_completion_tokens", CB_QUERY_MAX_TOKENS_MIN, CB_QUERY_MAX_TOKENS_MAX, &mct, err, errlen,
                 param) &&
         /* OpenAI's temperature range (narrower than the query's) */
         get_number(o, "temperature", 0, 2, &q->temperature, err, errlen, param) &&
         get_number(o, "top_p", 0, CB_QUERY_TOP_P_MAX, &q->top_p, err, errlen, param) &&
         get_int(o, "seed", 0, CB_QUERY_SEED_MAX, &q->seed, err, errlen, param) &&
         get_number(o, "frequency_penalty", -CB_QUERY_PENALTY_MAX, CB_QUERY_PENALTY_MAX, &q->frequency_penalty, err,
                    errlen, param) &&
         get_number(o, "presence_penalty", -CB_QUERY_PENALTY_MAX, CB_QUERY_PENALTY_MAX, &q->presence_penalty, err,
                    errlen, param) &&
         get_int(o, "n", 1, 128, &n, err, errlen, param) && get_bool(o, "stream", &r->stream, err, errlen, param);
    if (ok && n != 1) ok = fail(err, errlen, param, "n", "only n = 1 is supported (%s)", "one choice per request");
    json_t *so = ok ? json_object_get(o, "stream_options") : NULL;
    if (ok && so && !json_is_null(so)) {
        if (!json_is_object(so)) ok = fail(err, errlen, param, "stream_options", "'%s' must be an object", "stream_options");
        else ok = get_bool(so, "include_usage", &r->include_usage, err, errlen, param);
    }
    if (ok) mark_set(o, q);
    if (mct > 0 || mt > 0) {
        q->max_tokens = (int)(mct > 0 ? mct : mt);
        q->set |= CB_QUERY_MAX_TOKENS;
    }
    /* top_p 0 (OpenAI: only the most likely token) is the smallest top_p cb-blend takes */
    if ((q->set & CB_QUERY_TOP_P) && q->top_p < CB_QUERY_TOP_P_MIN) q->top_p = CB_QUERY_TOP_P_MIN;
    if (!ok) gw_chat_clear(r);
    return ok;
}

void gw_chat_clear(gw_chat_t *r) {
    json_decref(r->root);
    memset(r, 0, sizeof *r);
}

void gw_chat_query(const gw_chat_t *r, const char *id, cb_msg_writer_t *w) { cb_query_encode(&r->query, id, w); }

int gw_chat_max_tokens(const gw_chat_t *r) { return r->query.set & CB_QUERY_MAX_TOKENS ? r->query.max_tokens : -1; }

const char *gw_chat_mode(const gw_chat_t *r) { return r->query.mode; }

const char *gw_chat_model(const gw_chat_t *r, const char *fallback) { return r->model ? r->model : fallback; }

const char *gw_finish_reason(const cb_msg_t *done, int max_tokens) {
    const char *s;
    size_t len;
    if (cb_msg_str(done, "finish_reason", 16, &s, &len)) return len == 6 && !memcmp(s, "length", 6) ? "length" : "stop";
    const cb_msg_t *mt = cb_msg_map(done, "metrics");
    int64_t n = 0;
    if (mt && max_tokens > 0 && cb_msg_int(mt, "n_generated", 0, INT64_MAX, &n) && n >= max_tokens) return "length";
    return "stop";
}

static int64_t metric_int(const cb_msg_t *done, const char *key) {
    const cb_msg_t *mt = cb_msg_map(done, "metrics");
    int64_t v = 0;
    if (mt && cb_msg_int(mt, key, 0, INT64_MAX, &v)) return v;
    return 0;
}

json_t *gw_usage(const cb_msg_t *done) {
    int64_t p = metric_int(done, "n_prompt_tokens"), c = metric_int(done, "n_generated");
    return json_pack("{s:I, s:I, s:I}", "prompt_tokens", (json_int_t)p, "completion_tokens", (json_int_t)c,
                     "total_tokens", (json_int_t)(p + c));
}

json_t *gw_cacheblend_ext(const cb_msg_t *done) {
    json_t *all = cb_msg_to_json(done);
    json_t *ext = json_incref(json_object_get(all, "metrics"));
    if (!ext) ext = json_object();
    json_t *ids = json_object_get(all, "chunk_ids");
    if (ids) json_object_set(ext, "chunk_ids", ids);
    json_decref(all);
    return ext;
}

json_t *gw_completion(const char *cid, int64_t created, const char *model, const cb_msg_t *done, int max_tokens) {
    const char *text = "";
    size_t tl = 0;
    cb_msg_str(done, "text", SIZE_MAX, &text, &tl);
    json_t *msg = json_pack("{s:s, s:s%}", "role", "assistant", "content", text, tl);
    json_t *choice = json_pack("{s:i, s:o, s:n, s:s}", "index", 0, "message", msg, "logprobs", "finish_reason",
                               gw_finish_reason(done, max_tokens));
    return json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o, s:o}", "id", cid, "object", "chat.completion", "created",
                     (json_int_t)created, "model", model, "choices", choice, "usage", gw_usage(done), "cacheblend",
                     gw_cacheblend_ext(done));
}

json_t *gw_chunk(const char *cid, int64_t created, const char *model, const char *role, const char *content,
                 size_t content_len, const char *finish_reason) {
    json_t *delta = json_object();
    if (role) json_object_set_new(delta, "role", json_string(role));
    if (content) json_object_set_new(delta, "content", json_stringn(content, content_len));
    json_t *choice = json_pack("{s:i, s:o, s:n}", "index", 0, "delta", delta, "logprobs");
    json_object_set_new(choice, "finish_reason", finish_reason ? json_string(finish_reason) : json_null());
    return json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", cid, "object", "chat.completion.chunk", "created",
                     (json_int_t)created, "model", model, "choices", choice);
}

json_t *gw_error_json(const char *message, const char *type, const char *param, const char *code) {
    json_t *e = json_pack("{s:s, s:s}", "message", message, "type", type);
    json_object_set_new(e, "param", param ? json_string(param) : json_null());
    json_object_set_new(e, "code", code ? json_string(code) : json_null());
    return json_pack("{s:o}", "error", e);
}

void gw_ingest_client(const char *api_key, const char *addr, char *out, size_t size) {
    if (api_key && api_key[0]) {
        static const char domain[] = "cb-gateway-client-v1";
        uint8_t h[12];
        crypto_generichash_state st;
        crypto_generichash_init(&st, NULL, 0, sizeof h);
        crypto_generichash_update(&st, (const uint8_t *)domain, sizeof domain);
        crypto_generichash_update(&st, (const uint8_t *)api_key, strlen(api_key));
        crypto_generichash_final(&st, h, sizeof h);
        char hex[2 * sizeof h + 1];
        sodium_bin2hex(hex, sizeof hex, h, sizeof h);
        snprintf(out, size, "key:%s", hex);
        sodium_memzero(&st, sizeof st);
    } else {
        snprintf(out, size, "addr:%.58s", addr && addr[0] ? addr : "unknown");
    }
}
