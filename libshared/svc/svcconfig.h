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
 *   blend.k, max_tokens, temperature, top_p, seed, frequency_penalty, presence_penalty   generation defaults
 *   blend.ctx_size, kv_pool_bytes, hot_cache_bytes       the session's context, KV pool and memory tier
 * Errors: "config blend.mode = 'x': expected full, prefix, reuse or blend", and the getters' (config.h).
 */
#ifndef CB_SVC_SVCCONFIG_H
#define CB_SVC_SVCCONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "blend/blend.h"
#include "svc/session.h"
#include "wire/config.h"

/* The model every program loads when none is named (fetched by scripts/fetch-model.sh). */
#define CB_SVC_DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define CB_SVC_DEFAULT_CTX_SIZE 2048          /* blend.ctx_size when the configuration has none */
#define CB_SVC_DEFAULT_THREADS 2              /* <section>.threads when the configuration has none */
#define CB_SVC_DEFAULT_HOT_CACHE_BYTES ((int64_t)256 << 20)   /* blend.hot_cache_bytes */

/* The model path of a tool: given when non-empty, else $CB_MODEL when non-empty, else CB_SVC_DEFAULT_MODEL. */
const char *cb_svc_model_path(const char *given);

/* The blend section: the options of every request (the service's defaults, which a query may override). */
typedef struct {
    cb_blend_opts_t blend;      /* mode, ratio, check_layer, metric, lead_tokens, auto_floor, auto_ceil,
                                   auto_cost_keys, sparse_keys from the section; auto_target is blend.auto_target
                                   whether or not ratio = auto (a query may ask for auto); the rest
                                   cb_blend_opts_default. With ratio = auto, ratio is CB_BLEND_DEFAULT_RATIO */
    bool ratio_auto;            /* blend.ratio = auto */
    int k;                      /* chunks retrieved for a query without contexts, 1..max_k (default 3) */
    int max_tokens;             /* 1..4096 (default 64) */
    double temperature, top_p;  /* [0, 5] (default 0: greedy), (0, 1] (default 1) */
    uint64_t seed;              /* default 0 */
    double frequency_penalty, presence_penalty; /* [-2, 2] each (default 0) */
} cb_svc_blend_config_t;

/* The options of one request as the section sets them: c->blend, with auto_target 0 unless ratio = auto. */
void cb_svc_blend_request_opts(const cb_svc_blend_config_t *c, cb_blend_opts_t *o);

/* Fills o (cb_session_opts_default first) from <section> (with the fallback to common) and engine:
 * model_path, chat_template, system_prompt, threads, kv_dtype, engine_kv_dtype, engine_attn. The strings
 * are borrowed from cfg. 0, or -1 with err. */
int cb_svc_session_config(const cb_config_t *cfg, const char *section, cb_session_opts_t *o, char *err,
                          size_t errlen);
/* Fills c from the blend section (max_k: k's upper bound) and, when o is not NULL, o->ctx_size,
 * o->kv_pool_bytes and o->mem_bytes (blend.hot_cache_bytes). 0, or -1 with err. */
int cb_svc_blend_config(const cb_config_t *cfg, int max_k, cb_svc_blend_config_t *c, cb_session_opts_t *o,
                        char *err, size_t errlen);
#endif
