/* svcconfig.c: the session's and the blend's configuration (see svcconfig.h). */
#include "svc/svcconfig.h"

#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "svc/engine_config.h"
#include "wire/query.h"

#define BLEND "blend"

const char *cb_svc_model_path(const char *given) {
    if (given && *given) return given;
    const char *env = getenv("CB_MODEL");
    return env && *env ? env : CB_SVC_DEFAULT_MODEL;
}

int cb_svc_session_config(const cb_config_t *cfg, const char *section, cb_session_opts_t *o, char *err,
                          size_t errlen) {
    cb_session_opts_default(o);
    const char *kv_dtype = "f16";
    int64_t threads;
    if (!cb_config_str(cfg, section, "model", CB_SVC_DEFAULT_MODEL, &o->model_path, err, errlen) ||
        !cb_config_str(cfg, "engine", "chat_template", "", &o->chat_template, err, errlen) ||
        !cb_config_str(cfg, BLEND, "system_prompt", "", &o->system_prompt, err, errlen) ||
        !cb_config_int(cfg, section, "threads", 1, 1024, CB_SVC_DEFAULT_THREADS, &threads, err, errlen) ||
        !cb_config_str(cfg, section, "kv_dtype", "f16", &kv_dtype, err, errlen))
        return -1;
    int kvdt = cb_kv_dtype_parse(kv_dtype);
    if (kvdt < 0) {
        cb_set_err(err, errlen, "config kv_dtype = '%s': expected f16, bf16, f32 or q8_0", kv_dtype);
        return -1;
    }
    o->kv_dtype = (cb_kv_dtype_t)kvdt;
    o->threads = (int)threads;
    cb_engine_opts_t eo = {0};
    if (cb_engine_opts_from_config(cfg, &eo, err, errlen) != 0) return -1;
    o->engine_kv_dtype = eo.kv_dtype;
    o->engine_attn = eo.attn;
    return 0;
}

/* blend.ratio: a number in [0, 1], or "auto" (then *ratio is the default). */
static bool config_ratio(const cb_config_t *cfg, double *ratio, bool *is_auto, char *err, size_t errlen) {
    const char *raw = cb_config_raw(cfg, BLEND, "ratio", NULL, NULL);
    *is_auto = raw && !strcmp(raw, "auto");
    if (*is_auto) {
        *ratio = CB_BLEND_DEFAULT_RATIO;
        return true;
    }
    return cb_config_double(cfg, BLEND, "ratio", 0.0, CB_QUERY_RATIO_MAX, CB_BLEND_DEFAULT_RATIO, ratio, err, errlen);
}

/* The blend options' keys into c->blend (on cb_blend_opts_default), c->ratio and c->auto_target. 0, or -1
 * with err. */
static int blend_opts_config(const cb_config_t *cfg, cb_svc_blend_config_t *c, char *err, size_t errlen) {
    const char *mode, *metric;
    double target, floor_, ceil_, cost, sparse;
    int64_t check, lead;
    bool ratio_auto;
    if (!cb_config_str(cfg, BLEND, "mode", "blend", &mode, err, errlen) ||
        !config_ratio(cfg, &c->ratio, &ratio_auto, err, errlen) ||
        !cb_config_double(cfg, BLEND, "auto_target", 1e-6, 1.0, CB_BLEND_DEFAULT_AUTO_TARGET, &target, err, errlen) ||
        !cb_config_double(cfg, BLEND, "auto_floor", 0.0, 1.0, CB_BLEND_DEFAULT_AUTO_FLOOR, &floor_, err, errlen) ||
        !cb_config_double(cfg, BLEND, "auto_ceil", 0.0, 1.0, CB_BLEND_DEFAULT_AUTO_CEIL, &ceil_, err, errlen) ||
        !cb_config_double(cfg, BLEND, "auto_cost_keys", 0.0, CB_BLEND_AUTO_COST_KEYS_MAX,
                          CB_BLEND_DEFAULT_AUTO_COST_KEYS, &cost, err, errlen) ||
        !cb_config_double(cfg, BLEND, "sparse_keys", 0.0, 1.0, CB_BLEND_DEFAULT_SPARSE_KEYS, &sparse, err, errlen) ||
        !cb_config_int(cfg, BLEND, "check_layer", 0, 1024, CB_BLEND_DEFAULT_CHECK_LAYER, &check, err, errlen) ||
        !cb_config_str(cfg, BLEND, "metric", CB_BLEND_DEFAULT_METRIC_NAME, &metric, err, errlen) ||
        !cb_config_int(cfg, BLEND, "leading_tokens", 0, 1 << 20, CB_BLEND_DEFAULT_LEAD, &lead, err, errlen))
        return -1;
    if (floor_ > ceil_) {
        cb_set_err(err, errlen, "config blend.auto_floor %g > blend.auto_ceil %g", floor_, ceil_);
        return -1;
    }
    int md = cb_blend_mode_parse(mode);
    if (md < 0) {
        cb_set_err(err, errlen, "config blend.mode = '%s': expected full, prefix, reuse or blend", mode);
        return -1;
    }
    if (!cb_blend_metric_parse(metric)) {
        cb_set_err(err, errlen, "config blend.metric = '%s': expected a, k or v", metric);
        return -1;
    }
    cb_blend_opts_t *o = &c->blend;
    cb_blend_opts_default(o);
    o->mode = (cb_blend_mode_t)md;
    o->ratio = (float)c->ratio;
    c->auto_target = (float)target;
    o->auto_target = ratio_auto ? c->auto_target : 0.0f;
    o->auto_floor = (float)floor_;
    o->auto_ceil = (float)ceil_;
    o->auto_cost_keys = (float)cost;
    o->sparse_keys = (float)sparse;
    o->check_layer = (int)check;
    o->metric = metric[0];
    o->lead_tokens = (int)lead;
    return 0;
}

/* The generation defaults (blend.k, max_tokens and the sampling keys) into c, in the query's ranges. 0, or
 * -1 with err. */
static int generation_config(const cb_config_t *cfg, cb_svc_blend_config_t *c, char *err, size_t errlen) {
    int64_t k, max_tokens, seed;
    double temperature, top_p, freq, pres;
    if (!cb_config_int(cfg, BLEND, "k", CB_QUERY_K_MIN, CB_QUERY_K_MAX, 3, &k, err, errlen) ||
        !cb_config_int(cfg, BLEND, "max_tokens", CB_QUERY_MAX_TOKENS_MIN, CB_QUERY_MAX_TOKENS_MAX, 64, &max_tokens, err,
                       errlen) ||
        !cb_config_double(cfg, BLEND, "temperature", 0.0, CB_QUERY_TEMPERATURE_MAX, 0.0, &temperature, err, errlen) ||
        !cb_config_double(cfg, BLEND, "top_p", CB_QUERY_TOP_P_MIN, CB_QUERY_TOP_P_MAX, 1.0, &top_p, err, errlen) ||
        !cb_config_int(cfg, BLEND, "seed", 0, CB_QUERY_SEED_MAX, 0, &seed, err, errlen) ||
        !cb_config_double(cfg, BLEND, "frequency_penalty", -CB_QUERY_PENALTY_MAX, CB_QUERY_PENALTY_MAX, 0.0, &freq, err,
                          errlen) ||
        !cb_config_double(cfg, BLEND, "presence_penalty", -CB_QUERY_PENALTY_MAX, CB_QUERY_PENALTY_MAX, 0.0, &pres, err,
                          errlen))
        return -1;
    c->k = (int)k;
    c->max_tokens = (int)max_tokens;
    c->sampling = (cb_sampler_params_t){.temperature = (float)temperature, .top_k = 0, .top_p = (float)top_p,
                                        .seed = (uint64_t)seed, .frequency_penalty = (float)freq,
                                        .presence_penalty = (float)pres};
    return 0;
}

int cb_svc_blend_config(const cb_config_t *cfg, cb_svc_blend_config_t *c, cb_session_opts_t *o, char *err,
                        size_t errlen) {
    memset(c, 0, sizeof *c);
    if (blend_opts_config(cfg, c, err, errlen) != 0 || generation_config(cfg, c, err, errlen) != 0) return -1;
    int64_t ctx, pool, hot;
    if (!cb_config_int(cfg, BLEND, "ctx_size", 64, 1 << 20, CB_SVC_DEFAULT_CTX_SIZE, &ctx, err, errlen) ||
        !cb_config_int(cfg, BLEND, "kv_pool_bytes", 0, INT64_MAX, 0, &pool, err, errlen) ||
        !cb_config_int(cfg, BLEND, "hot_cache_bytes", 0, INT64_MAX, CB_SVC_DEFAULT_HOT_CACHE_BYTES, &hot, err, errlen))
        return -1;
    if (o) {
        o->ctx_size = (int)ctx;
        o->kv_pool_bytes = (size_t)pool;
        o->mem_bytes = (size_t)hot;
    }
    return 0;
}
