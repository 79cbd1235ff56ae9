/* openai: the OpenAI chat-completions shapes <-> cacheblend's query protocol (docs/gateway.md).
 *
 *   request  {model?, messages, max_tokens | max_completion_tokens, temperature, top_p, seed, stop,
 *             frequency_penalty, presence_penalty, n (1), stream, stream_options.include_usage,
 *             documents (extension: texts used as the contexts), cacheblend (extension: mode, ratio, k)}
 *   reply    chat.completion {id, object, created, model, choices[{index, message, finish_reason}],
 *            usage, cacheblend (the `done` metrics)}, or chat.completion.chunk events when streamed
 *   errors   {"error": {"message", "type", "param", "code"}}
 *
 * The last user message is the question; earlier messages are not sent (cb-blend builds its own prompt
 * from its system prompt, the contexts and the question). Fields this gateway does not use (user, tools,
 * logit_bias...) are ignored, as clients that do not know them expect.
 */
#ifndef GW_OPENAI_H
#define GW_OPENAI_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "wire/msg.h"
#include "wire/query.h"

/* A validated chat request. Strings point into `root` (owned: gw_chat_clear). The query fields map to
 * cb-blend's query (wire/query.h): the last user message is its question, `documents` its contexts,
 * `cacheblend.mode/ratio/k` and the sampling fields what the request sets (query.set). */
typedef struct {
    json_t *root;
    const char *model;                 /* NULL when absent */
    cb_query_t query;                  /* question NUL-terminated (<= CB_QUERY_MAX_QUESTION bytes) */
    bool stream, include_usage;
} gw_chat_t;

/* Parses and validates body [len]. False with a message in err and the offending field's name in
 * *param (NULL when the body itself is malformed); req is then cleared. */
bool gw_chat_parse(const char *body, size_t len, gw_chat_t *req, char *err, size_t errlen, const char **param);
void gw_chat_clear(gw_chat_t *req);

/* Writes the query message for req into w (begun with id; caller calls cb_msg_end). */
void gw_chat_query(const gw_chat_t *req, const char *id, cb_msg_writer_t *w);
/* The request's max_tokens (or max_completion_tokens), -1 when absent. */
int gw_chat_max_tokens(const gw_chat_t *req);
/* Its cacheblend.mode, "" when absent. */
const char *gw_chat_mode(const gw_chat_t *req);

/* The response model name: the request's, else `fallback`. */
const char *gw_chat_model(const gw_chat_t *req, const char *fallback);

/* "stop" or "length" for a done message (its finish_reason when present, else from its counts). */
const char *gw_finish_reason(const cb_msg_t *done, int max_tokens);

/* The `usage` object {prompt_tokens, completion_tokens, total_tokens} and the `cacheblend` extension
 * object (the done message's metrics and chunk_ids) of a done message. New references. */
json_t *gw_usage(const cb_msg_t *done);
json_t *gw_cacheblend_ext(const cb_msg_t *done);

/* A chat.completion (non-streamed answer). New reference. */
json_t *gw_completion(const char *cid, int64_t created, const char *model, const cb_msg_t *done, int max_tokens);
/* A chat.completion.chunk with delta {role?, content?} (NULL: omitted) and finish_reason (NULL: null).
 * New reference. */
json_t *gw_chunk(const char *cid, int64_t created, const char *model, const char *role, const char *content,
                 size_t content_len, const char *finish_reason);

/* Who an ingest is for, sent to cb-precompute as `on_behalf_of` (docs/gateway.md, Ingest identity): with
 * an API key, "key:" + 24 hex characters of BLAKE2b("cb-gateway-client-v1", key) (the key itself is never
 * sent nor logged; one key = one client), else "addr:" + the client's address (addr, as gw_addr_key_str
 * writes it). cb-precompute trusts it only from the gateway's CURVE key. Into out [size] (>= 64). */
#define GW_INGEST_CLIENT_MAX 64
void gw_ingest_client(const char *api_key, const char *addr, char *out, size_t size);

/* {"error": {"message", "type", "param", "code"}} (param/code NULL: null). New reference. */
json_t *gw_error_json(const char *message, const char *type, const char *param, const char *code);

#endif
