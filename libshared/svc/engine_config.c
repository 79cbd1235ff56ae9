/* engine_config: engine options from the configuration (see engine_config.h). */
#include "svc/engine_config.h"

#include <stdio.h>
#include <string.h>

int cb_engine_opts_from_config(const cb_config_t *cfg, cb_engine_opts_t *o, char *err, size_t errlen) {
    const char *s = NULL;
    if (!cb_config_str_own(cfg, "engine", "kv_dtype", "f16", &s, err, errlen)) return -1;
    cb_engine_kv_dtype_t d;
    if (!cb_engine_kv_dtype_parse(s, &d) || d == CB_ENGINE_KV_DEFAULT) {
        snprintf(err, errlen, "config engine.kv_dtype = '%.32s': expected f16 or f32", s);
        return -1;
    }
    o->kv_dtype = d;
    if (!cb_config_str_own(cfg, "engine", "attn", "auto", &s, err, errlen)) return -1;
    cb_engine_attn_t a;
    if (!cb_engine_attn_parse(s, &a) || a == CB_ENGINE_ATTN_DEFAULT) {
        snprintf(err, errlen, "config engine.attn = '%.32s': expected auto, bf16, int16 or f32", s);
        return -1;
    }
    o->attn = a;
    return 0;
}
