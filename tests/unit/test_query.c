/* test_query: the `query` message's codec (libshared/wire/query.h): a round trip of every field, the
 * limits of each field at and past its bounds, wrong types, unknown fields (ignored), duplicate keys,
 * nil, the rules between fields (contexts or retrieved), and cb_query_check on filled structs. */
#include <jansson.h>
#include <stdint.h>

#include "wire/query.h"
#include "test.h"

/* The query message of the JSON object `fields` (plus the envelope), decoded; NULL when the JSON or the
 * message is invalid (a test bug). Caller destroys. */
static cb_msg_t *msg_of(const char *fields) {
    json_error_t je;
    json_t *o = json_loads(fields, 0, &je);
    if (!json_is_object(o)) {
        fprintf(stderr, "  bad test JSON: %s\n", je.text);
        json_decref(o);
        return NULL;
    }
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_msg_begin(w, "query", "t1");
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) cb_msg_put_json(w, key, v);
    size_t len;
    const void *d = cb_msg_end(w, &len);
    cb_msg_t *m = d ? cb_msg_decode_ex(d, len, len + 1, NULL) : NULL;
    cb_msg_writer_destroy(&w);
    json_decref(o);
    return m;
}

static cb_msg_t *s_last; /* the message decode() read last: q's strings point into it until the next call */

/* Decodes `fields` into q: true when valid; why gets the reason. */
static bool decode(const char *fields, cb_query_t *q, char *why, size_t whylen) {
    cb_msg_destroy(&s_last);
    if (!(s_last = msg_of(fields))) {
        snprintf(why, whylen, "(no message)");
        return false;
    }
    why[0] = 0;
    return cb_query_decode(s_last, q, why, whylen);
}

/* `fields` is rejected with a reason containing `part`. */
static bool rejects(const char *fields, const char *part) {
    cb_query_t q;
    char why[512];
    if (decode(fields, &q, why, sizeof why)) {
        fprintf(stderr, "  accepted: %s\n", fields);
        return false;
    }
    if (!strstr(why, part)) {
        fprintf(stderr, "  %s: reason '%s' lacks '%s'\n", fields, why, part);
        return false;
    }
    return true;
}

static bool accepts(const char *fields) {
    cb_query_t q;
    char why[512];
    if (decode(fields, &q, why, sizeof why)) return true;
    fprintf(stderr, "  rejected %s: %s\n", fields, why);
    return false;
}

static bool str_is(const char *s, size_t len, const char *want) {
    return s && len == strlen(want) && memcmp(s, want, len) == 0;
}

TEST(minimal_sets_nothing) {
    cb_msg_t *m = msg_of("{\"question\": \"who?\"}");
    CHECK(m);
    cb_query_t q;
    char why[256];
    CHECK(cb_query_decode(m, &q, why, sizeof why));
    CHECK(str_is(q.question, q.question_len, "who?"));
    CHECK(q.set == 0);
    CHECK(q.n_contexts == 0 && q.n_stop == 0 && q.n_retrieved == 0);
    cb_msg_destroy(&m);
}

TEST(roundtrip_every_field) {
    cb_query_t q;
    cb_query_init(&q);
    q.question = "Who designed it?";
    q.question_len = strlen(q.question);
    q.set = CB_QUERY_CONTEXTS | CB_QUERY_K | CB_QUERY_MODE | CB_QUERY_RATIO | CB_QUERY_MAX_TOKENS |
            CB_QUERY_TEMPERATURE | CB_QUERY_TOP_P | CB_QUERY_SEED | CB_QUERY_FREQUENCY_PENALTY |
            CB_QUERY_PRESENCE_PENALTY | CB_QUERY_STOP;
    q.n_contexts = 2;
    q.contexts[0] = "first context";
    q.context_lens[0] = 13;
    q.contexts[1] = "second";
    q.context_lens[1] = 6;
    q.k = 7;
    snprintf(q.mode, sizeof q.mode, "reuse");
    q.ratio = 0.25;
    q.max_tokens = 100;
    q.temperature = 0.7;
    q.top_p = 0.9;
    q.seed = INT64_MAX;
    q.frequency_penalty = -1.5;
    q.presence_penalty = 2.0;
    q.n_stop = 2;
    q.stop[0] = "\n\n";
    q.stop_lens[0] = 2;
    q.stop[1] = "END";
    q.stop_lens[1] = 3;
    cb_msg_writer_t *w = cb_msg_writer_new();
    cb_query_encode(&q, "rt-1", w);
    size_t len;
    const void *d = cb_msg_end(w, &len);
    CHECK(d);
    cb_msg_t *m = cb_msg_decode(d, len, NULL, 0);
    CHECK(m);
    CHECK(cb_msg_is_type(m, "query") && !strcmp(cb_msg_id(m), "rt-1"));
    cb_query_t b;
    char why[256];
    CHECK_MSG(cb_query_decode(m, &b, why, sizeof why), "%s", why);
    CHECK(b.set == q.set);
    CHECK(str_is(b.question, b.question_len, "Who designed it?"));
    CHECK(b.n_contexts == 2 && str_is(b.contexts[0], b.context_lens[0], "first context") &&
          str_is(b.contexts[1], b.context_lens[1], "second"));
    CHECK(b.k == 7 && !strcmp(b.mode, "reuse") && !b.ratio_auto && b.ratio == 0.25);
    CHECK(b.max_tokens == 100 && b.temperature == 0.7 && b.top_p == 0.9 && b.seed == INT64_MAX);
    CHECK(b.frequency_penalty == -1.5 && b.presence_penalty == 2.0);
    CHECK(b.n_stop == 2 && str_is(b.stop[0], b.stop_lens[0], "\n\n") && str_is(b.stop[1], b.stop_lens[1], "END"));
    cb_msg_destroy(&m);
    /* ratio auto, and the router's retrieval instead of contexts */
    q.set = CB_QUERY_RATIO | CB_QUERY_RETRIEVED | CB_QUERY_RETRIEVE_MS;
    q.ratio_auto = true;
    q.n_retrieved = 2;
    const char *id0 = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    q.retrieved_ids[0] = id0;
    q.retrieved_id_lens[0] = 64;
    q.retrieved[0] = "chunk zero";
    q.retrieved_lens[0] = 10;
    q.retrieved_ids[1] = "0123456789abcdef";
    q.retrieved_id_lens[1] = 16;
    q.retrieved[1] = "chunk one";
    q.retrieved_lens[1] = 9;
    q.retrieve_ms = 3.5;
    cb_query_encode(&q, "rt-2", w);
    CHECK((d = cb_msg_end(w, &len)));
    CHECK((m = cb_msg_decode(d, len, NULL, 0)));
    CHECK_MSG(cb_query_decode(m, &b, why, sizeof why), "%s", why);
    CHECK(b.set == q.set && b.ratio_auto);
    CHECK(b.n_retrieved == 2 && str_is(b.retrieved_ids[0], b.retrieved_id_lens[0], id0) &&
          str_is(b.retrieved[0], b.retrieved_lens[0], "chunk zero") &&
          str_is(b.retrieved_ids[1], b.retrieved_id_lens[1], "0123456789abcdef") &&
          str_is(b.retrieved[1], b.retrieved_lens[1], "chunk one"));
    CHECK(b.retrieve_ms == 3.5);
    cb_msg_destroy(&m);
    /* an empty array of contexts is set (no retrieval), unlike an absent one */
    q.set = CB_QUERY_CONTEXTS;
    q.n_contexts = 0;
    cb_query_encode(&q, "rt-3", w);
    CHECK((d = cb_msg_end(w, &len)));
    CHECK((m = cb_msg_decode(d, len, NULL, 0)));
    CHECK(cb_query_decode(m, &b, why, sizeof why));
    CHECK(b.set == CB_QUERY_CONTEXTS && b.n_contexts == 0);
    cb_msg_destroy(&m);
    cb_msg_writer_destroy(&w);
}

/* head + a string of `limit` bytes + tail is accepted, and with limit + 1 bytes rejected with `part`. */
static bool string_at_limit(const char *head, size_t limit, const char *tail, const char *part) {
    size_t hl = strlen(head), tl = strlen(tail);
    char *buf = malloc(hl + limit + 1 + tl + 1);
    if (!buf) return false;
    memcpy(buf, head, hl);
    memset(buf + hl, 'x', limit + 1);
    memcpy(buf + hl + limit, tail, tl + 1);
    bool ok_at = accepts(buf);
    memcpy(buf + hl + limit + 1, tail, tl + 1);
    buf[hl + limit] = 'x';
    bool bad_past = rejects(buf, part);
    free(buf);
    return ok_at && bad_past;
}

TEST(question_limits) {
    CHECK(rejects("{}", "field 'question': missing"));
    CHECK(rejects("{\"question\": \"\"}", "field 'question': empty"));
    CHECK(string_at_limit("{\"question\": \"", CB_QUERY_MAX_QUESTION, "\"}",
                          "field 'question': string of 8193 bytes is longer than the limit of 8192"));
}

/* "{question, <field>: <value>}" */
static bool field_ok(const char *field, const char *value) {
    char buf[1024];
    snprintf(buf, sizeof buf, "{\"question\": \"q\", \"%s\": %s}", field, value);
    return accepts(buf);
}

static bool field_bad(const char *field, const char *value, const char *part) {
    char buf[1024];
    snprintf(buf, sizeof buf, "{\"question\": \"q\", \"%s\": %s}", field, value);
    return rejects(buf, part);
}

TEST(integer_limits) {
    CHECK(field_ok("k", "1") && field_ok("k", "32"));
    CHECK(field_bad("k", "0", "field 'k': integer 0 out of range [1, 32]"));
    CHECK(field_bad("k", "33", "field 'k': integer 33 out of range [1, 32]"));
    CHECK(field_ok("max_tokens", "1") && field_ok("max_tokens", "4096"));
    CHECK(field_bad("max_tokens", "0", "out of range [1, 4096]"));
    CHECK(field_bad("max_tokens", "4097", "field 'max_tokens': integer 4097 out of range [1, 4096]"));
    CHECK(field_ok("seed", "0") && field_ok("seed", "9223372036854775807"));
    CHECK(field_bad("seed", "-1", "field 'seed': integer -1 out of range"));
}

TEST(number_limits) {
    CHECK(field_ok("ratio", "0") && field_ok("ratio", "1") && field_ok("ratio", "0.15"));
    CHECK(field_bad("ratio", "-0.01", "field 'ratio': number -0.01 out of range [0, 1]"));
    CHECK(field_bad("ratio", "1.5", "field 'ratio'"));
    CHECK(field_ok("temperature", "0") && field_ok("temperature", "5"));
    CHECK(field_bad("temperature", "5.01", "field 'temperature': number 5.01 out of range [0, 5]"));
    CHECK(field_bad("temperature", "-1", "field 'temperature'"));
    CHECK(field_ok("top_p", "1") && field_ok("top_p", "1e-9"));
    CHECK(field_bad("top_p", "0", "field 'top_p': number 0 out of range"));
    CHECK(field_bad("top_p", "1.01", "field 'top_p'"));
    CHECK(field_ok("frequency_penalty", "-2") && field_ok("frequency_penalty", "2"));
    CHECK(field_bad("frequency_penalty", "2.5", "field 'frequency_penalty': number 2.5 out of range [-2, 2]"));
    CHECK(field_bad("frequency_penalty", "-2.5", "field 'frequency_penalty'"));
    CHECK(field_ok("presence_penalty", "-2") && field_ok("presence_penalty", "2"));
    CHECK(field_bad("presence_penalty", "3", "field 'presence_penalty'"));
    CHECK(field_ok("retrieve_ms", "0") && field_ok("retrieve_ms", "12.5"));
    CHECK(field_bad("retrieve_ms", "-1", "field 'retrieve_ms'"));
    CHECK(field_bad("retrieve_ms", "1e12", "field 'retrieve_ms'"));
    /* integers are numbers too */
    cb_query_t q;
    char why[256];
    CHECK(decode("{\"question\": \"q\", \"temperature\": 1}", &q, why, sizeof why));
    CHECK(q.set == CB_QUERY_TEMPERATURE && q.temperature == 1.0);
}

TEST(mode_and_ratio) {
    static const char *const modes[] = {"\"full\"", "\"prefix\"", "\"reuse\"", "\"blend\""};
    for (int i = 0; i < 4; i++) CHECK(field_ok("mode", modes[i]));
    CHECK(field_bad("mode", "\"fast\"", "field 'mode': expected full, prefix, reuse or blend, got 'fast'"));
    CHECK(field_bad("mode", "\"\"", "field 'mode': expected full, prefix, reuse or blend"));
    CHECK(field_bad("mode", "\"blendblendblendblend\"", "field 'mode': string of 20 bytes is longer"));
    CHECK(cb_query_mode_valid("blend") && !cb_query_mode_valid("Blend") && !cb_query_mode_valid(NULL));
    cb_query_t q;
    char why[256];
    CHECK(decode("{\"question\": \"q\", \"ratio\": \"auto\", \"mode\": \"prefix\"}", &q, why, sizeof why));
    CHECK(q.set == (CB_QUERY_RATIO | CB_QUERY_MODE) && q.ratio_auto && !strcmp(q.mode, "prefix"));
    CHECK(field_bad("ratio", "\"0.5\"", "field 'ratio': expected a number in [0, 1] or \"auto\", got '0.5'"));
    CHECK(field_bad("ratio", "\"a very long ratio string\"", "field 'ratio': expected number, got string"));
}

TEST(contexts_limits) {
    char buf[4096];
    int n = snprintf(buf, sizeof buf, "{\"question\": \"q\", \"contexts\": [");
    for (int i = 0; i < CB_QUERY_MAX_CONTEXTS; i++) n += snprintf(buf + n, sizeof buf - n, "%s\"c%d\"", i ? "," : "", i);
    snprintf(buf + n, sizeof buf - n, "]}");
    cb_query_t q;
    char why[256];
    CHECK_MSG(decode(buf, &q, why, sizeof why), "%s", why);
    CHECK(q.n_contexts == CB_QUERY_MAX_CONTEXTS);
    snprintf(buf + n, sizeof buf - n, ",\"one more\"]}");
    CHECK(rejects(buf, "field 'contexts': array of 33 elements is longer than the limit of 32"));
    CHECK(field_ok("contexts", "[]"));
    CHECK(field_ok("contexts", "[\"\"]")); /* an empty context is a context */
    CHECK(field_bad("contexts", "\"one text\"", "field 'contexts': expected array, got string"));
    CHECK(field_bad("contexts", "[\"a\", 3]", "field 'contexts[1]': expected string"));
    /* one context at the byte limit, and one past it */
    CHECK(string_at_limit("{\"question\": \"q\", \"contexts\": [\"", CB_QUERY_MAX_CONTEXT_BYTES, "\"]}",
                          "longer than the limit of 262144"));
}

TEST(stop_limits) {
    cb_query_t q;
    char why[256];
    CHECK(decode("{\"question\": \"q\", \"stop\": \"END\"}", &q, why, sizeof why));
    CHECK(q.set == CB_QUERY_STOP && q.n_stop == 1 && str_is(q.stop[0], q.stop_lens[0], "END"));
    CHECK(decode("{\"question\": \"q\", \"stop\": []}", &q, why, sizeof why));
    CHECK(q.set == CB_QUERY_STOP && q.n_stop == 0);
    CHECK(field_ok("stop", "[\"a\", \"b\", \"c\", \"d\"]"));
    CHECK(field_bad("stop", "[\"a\", \"b\", \"c\", \"d\", \"e\"]", "field 'stop': at most 4 stop sequences, got 5"));
    CHECK(field_bad("stop", "\"\"", "field 'stop': a stop sequence has 1..256 bytes, got 0"));
    CHECK(field_bad("stop", "[\"a\", \"\"]", "field 'stop[1]': empty (a stop sequence has 1..256 bytes)"));
    CHECK(field_bad("stop", "7", "field 'stop': expected a string or an array of at most 4 strings"));
    char s256[300], s257[300];
    memset(s256, 'z', 256);
    s256[256] = 0;
    memset(s257, 'z', 257);
    s257[257] = 0;
    char v[320];
    snprintf(v, sizeof v, "\"%s\"", s256);
    CHECK(field_ok("stop", v));
    snprintf(v, sizeof v, "\"%s\"", s257);
    CHECK(field_bad("stop", v, "got 257"));
    snprintf(v, sizeof v, "[\"%s\"]", s257);
    CHECK(field_bad("stop", v, "field 'stop[0]': string of 257 bytes is longer than the limit of 256"));
}

TEST(retrieved_rules) {
    const char *id = "\"00112233445566778899aabbccddeeff\"";
    char v[512];
    snprintf(v, sizeof v, "[{\"chunk_id\": %s, \"text\": \"t\"}]", id);
    CHECK(field_ok("retrieved", v));
    CHECK(field_ok("retrieved", "[]"));
    CHECK(field_bad("retrieved", "[{\"chunk_id\": \"0123\", \"text\": \"t\"}]",
                    "field 'retrieved[0].chunk_id': hex string of 4 characters is shorter than 16"));
    CHECK(field_bad("retrieved", "[{\"chunk_id\": \"0123456789ABCDEF\", \"text\": \"t\"}]", "lower-case hex"));
    snprintf(v, sizeof v, "[{\"chunk_id\": %s}]", id);
    CHECK(field_bad("retrieved", v, "field 'retrieved[0].text': missing"));
    CHECK(field_bad("retrieved", "[\"just text\"]", "field 'retrieved"));
    CHECK(field_bad("retrieved", "{}", "field 'retrieved': expected array"));
    snprintf(v, sizeof v, "{\"question\": \"q\", \"contexts\": [\"c\"], \"retrieved\": [{\"chunk_id\": %s, \"text\": \"t\"}]}",
             id);
    CHECK(rejects(v, "either 'contexts' or 'retrieved'"));
}

TEST(wrong_types) {
    CHECK(rejects("{\"question\": 5}", "field 'question': expected string, got"));
    CHECK(field_bad("k", "\"3\"", "field 'k': expected integer, got string"));
    CHECK(field_bad("k", "2.5", "field 'k': expected integer"));
    CHECK(field_bad("max_tokens", "true", "field 'max_tokens': expected integer"));
    CHECK(field_bad("mode", "1", "field 'mode': expected string"));
    CHECK(field_bad("ratio", "true", "field 'ratio': expected number"));
    CHECK(field_bad("temperature", "\"hot\"", "field 'temperature': expected number, got string"));
    CHECK(field_bad("top_p", "[]", "field 'top_p': expected number"));
    CHECK(field_bad("seed", "1.5", "field 'seed': expected integer"));
    CHECK(field_bad("frequency_penalty", "{}", "field 'frequency_penalty': expected number"));
    CHECK(field_bad("presence_penalty", "\"0\"", "field 'presence_penalty': expected number"));
    CHECK(field_bad("retrieve_ms", "\"1\"", "field 'retrieve_ms': expected number"));
}

TEST(unknown_fields_and_nil) {
    cb_query_t q;
    char why[256];
    /* unknown fields are ignored (forward compatibility); nil is absent */
    CHECK(decode("{\"question\": \"q\", \"temperatur\": 9, \"x\": {\"y\": [1, 2]}, \"k\": null, \"stop\": null}", &q,
                 why, sizeof why));
    CHECK(q.set == 0);
    /* a key given twice is an error */
    cb_msg_writer_t *w = cb_msg_writer_new();
    static const char *const keys[] = {"k", "contexts", "ratio", "stop", "retrieved"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        cb_msg_begin(w, "query", "d");
        cb_msg_put_str(w, "question", "q");
        for (int j = 0; j < 2; j++) {
            if (!strcmp(keys[i], "k")) cb_msg_put_int(w, "k", 2);
            else if (!strcmp(keys[i], "ratio")) cb_msg_put_double(w, "ratio", 0.5);
            else if (!strcmp(keys[i], "stop")) cb_msg_put_str(w, "stop", "x");
            else {
                cb_msg_begin_array(w, keys[i]);
                cb_msg_end_array(w);
            }
        }
        size_t len;
        const void *d = cb_msg_end(w, &len);
        CHECK(d);
        cb_msg_t *m = cb_msg_decode(d, len, NULL, 0);
        CHECK(m);
        bool ok = cb_query_decode(m, &q, why, sizeof why);
        cb_msg_destroy(&m);
        CHECK_MSG(!ok && strstr(why, "duplicate key"), "%s twice: %s", keys[i], ok ? "accepted" : why);
    }
    cb_msg_writer_destroy(&w);
}

TEST(check_filled_struct) {
    cb_query_t q;
    cb_query_init(&q);
    char why[256];
    CHECK(!cb_query_check(&q, why, sizeof why) && strstr(why, "field 'question'"));
    q.question = "q";
    q.question_len = 1;
    CHECK(cb_query_check(&q, why, sizeof why));
    q.set = CB_QUERY_MAX_TOKENS;
    q.max_tokens = CB_QUERY_MAX_TOKENS_MAX + 1;
    CHECK(!cb_query_check(&q, why, sizeof why) && strstr(why, "field 'max_tokens'"));
    q.max_tokens = CB_QUERY_MAX_TOKENS_MAX;
    CHECK(cb_query_check(&q, why, sizeof why));
    q.set |= CB_QUERY_MODE;
    snprintf(q.mode, sizeof q.mode, "fast");
    CHECK(!cb_query_check(&q, why, sizeof why) && strstr(why, "field 'mode'"));
}

int main(void) {
    RUN(minimal_sets_nothing);
    RUN(roundtrip_every_field);
    RUN(question_limits);
    RUN(integer_limits);
    RUN(number_limits);
    RUN(mode_and_ratio);
    RUN(contexts_limits);
    RUN(stop_limits);
    RUN(retrieved_rules);
    RUN(wrong_types);
    RUN(unknown_fields_and_nil);
    RUN(check_filled_struct);
    cb_msg_destroy(&s_last);
    return test_summary();
}
