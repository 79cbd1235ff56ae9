/* svcconfig: the one reader of the configuration sections that set up a RAG session (session.h) and its
 * blend: `engine` (kv_dtype, attn, chat_template: engine_config.h), `blend` (the blend options, the
 * generation defaults, the session's context and tiers) and `common` (model, threads, kv_dtype, through
 * the fallback of wire/config.h). cb-blend, cb-precompute and cb-rag read their setup here, so a key means
 * the same in each; the defaults are written once, below and in blend.h (CB_BLEND_DEFAULT_*).
 *
 * Keys (config/cacheblend.cfg documents each):
 *   <section>.model            GGUF path (common.model; default CB_SVC_DEFAULT_MODEL)
 *   <section>.threads          engine threads, 1..1024 (default 2)
 *   <section>.kv_dtype         the KV files' payload: f16 (default), bf16, f32 or q8_0
 *   engine.chat_template       a template name, or "" = the GGUF's
 *   engine.kv_dtype, .attn     the engine's KV pool and prefill attention (engine_config.h)
 *   blend.system_prompt        "" = the template's default line
 *   blend.mode, ratio (a number in [0, 1] or auto), check_layer, metric, leading_tokens, auto_target,
 *   auto_floor (<= auto_ceil), auto_ceil, auto_cost_keys, sparse_keys      the blend options (blend.h)
 *   blend.k, max_tokens, temperature, top_p, seed, frequency_penalty, presence_penalty   generation defaults,
 *                              in the query's ranges (wire/query.h)
 *   blend.ctx_size, kv_pool_bytes, hot_cache_bytes       the session's context, KV pool and memory tier
 * Errors: "config blend.mode = 'x': expected full, prefix, reuse or blend", and the getters' (config.h).
 */
#ifndef CB_SVC_SVCCONFIG_H
#define CB_SVC_SVCCONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "blend/blend.h"
#include "engine/sampler.h"
#include "svc/session.h"
#include "wire/config.h"

/* The model every program loads when none is named (fetched by scripts/fetch-model.sh). */
#define CB_SVC_DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define CB_SVC_DEFAULT_CTX_SIZE 2048          /* blend.ctx_size when the configuration has none */
#define CB_SVC_DEFAULT_THREADS 2              /* <section>.threads when the configuration has none */
#define CB_SVC_DEFAULT_HOT_CACHE_BYTES ((int64_t)256 << 20)   /* blend.hot_cache_bytes */

/* The model path of a tool: given when non-empty, else $CB_MODEL when non-empty, else CB_SVC_DEFAULT_MODEL. */
const char *cb_svc_model_path(const char *given);

/* The blend section: the service's defaults, built once from the configuration. Each request copies them
 * and overrides what it sets (a query's fields: wire/query.h), so blend and sampling are the values every
 * request starts from. The ranges are the query's (CB_QUERY_*), so a default is always a valid query. */
typedef struct {
    cb_blend_opts_t blend;      /* mode, ratio, check_layer, metric, lead_tokens, auto_floor, auto_ceil,
                                   auto_cost_keys, sparse_keys from the section, the rest cb_blend_opts_default;
                                   auto_target > 0 (blend.auto_target) only when blend.ratio = auto, and then
                                   ratio is CB_BLEND_DEFAULT_RATIO */
    double ratio;               /* blend.ratio as written (blend.ratio is its float), for reports */
    float auto_target;          /* blend.auto_target: the target of a request that asks for ratio "auto" */
    int k;                      /* chunks retrieved for a query without contexts (default 3) */
    int max_tokens;             /* default 64 */
    cb_sampler_params_t sampling; /* temperature (default 0: greedy), top_p (default 1), seed (default 0),
                                     frequency_penalty and presence_penalty (default 0); top_k 0 */
} cb_svc_blend_config_t;

/* Fills o (cb_session_opts_default first) from <section> (with the fallback to common) and engine:
 * model_path, chat_template, system_prompt, threads, kv_dtype, engine_kv_dtype, engine_attn. The strings
 * are borrowed from cfg. 0, or -1 with err. */
int cb_svc_session_config(const cb_config_t *cfg, const char *section, cb_session_opts_t *o, char *err,
                          size_t errlen);
/* Fills c from the blend section and, when o is not NULL, o->ctx_size, o->kv_pool_bytes and o->mem_bytes
 * (blend.hot_cache_bytes). 0, or -1 with err. */
int cb_svc_blend_config(const cb_config_t *cfg, cb_svc_blend_config_t *c, cb_session_opts_t *o, char *err,
                        size_t errlen);
#endif
