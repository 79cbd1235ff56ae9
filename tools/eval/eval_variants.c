/* eval_variants.c: cb-eval's modes: a --modes token (a mode name and its overrides, e.g.
 * "blend:r=0.05:metric=k") parsed into a variant on top of the options of plain `blend`; also what
 * --summarize reads back from the results' mode labels (eval.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "eval.h"

/* "R1<sep>L" into ratio and layer. */
bool eval_parse_gradual(const char *s, char sep, float *r1, int *layer) {
    const char *p = strchr(s, sep);
    if (!p || p == s) return false;
    char a[32];
    size_t n = (size_t)(p - s);
    if (n >= sizeof a) return false;
    memcpy(a, s, n);
    a[n] = 0;
    long l;
    if (!parse_float(a, 0.0f, 1.0f, r1) || !parse_long(p + 1, 0, 4096, &l)) return false;
    *layer = (int)l;
    return true;
}

/* One --modes token ("blend:r=0.1:metric=k") on top of base. */
bool eval_parse_variant(const char *tok, const cb_blend_opts_t *base, variant_t *v) {
    if (strlen(tok) >= sizeof v->label || !*tok) return false;
    snprintf(v->label, sizeof v->label, "%s", tok);
    char buf[64];
    snprintf(buf, sizeof buf, "%s", tok);
    char *save = NULL, *name = strtok_r(buf, ":", &save);
    int m = cb_blend_mode_parse(name);
    if (m < 0) return false;
    v->o = *base;
    v->o.mode = (cb_blend_mode_t)m;
    v->kv_dtype = -1;
    for (char *kv = strtok_r(NULL, ":", &save); kv; kv = strtok_r(NULL, ":", &save)) {
        char *eq = strchr(kv, '=');
        if (!eq) return false;
        *eq = 0;
        const char *k = kv, *val = eq + 1;
        long l;
        if (!strcmp(k, "r") && !strcmp(val, "auto")) {
            if (v->o.auto_target == 0.0f) v->o.auto_target = CB_BLEND_DEFAULT_AUTO_TARGET;
        } else if (!strcmp(k, "r")) {
            if (!parse_float(val, 0.0f, 1.0f, &v->o.ratio)) return false;
            v->o.auto_target = 0.0f;
        } else if (!strcmp(k, "t")) { /* ratio = auto with this target */
            if (!parse_float(val, 1e-6f, 1.0f, &v->o.auto_target)) return false;
        } else if (!strcmp(k, "cost")) { /* ratio = auto ranks by mass per cost, 1 + pos / cost */
            if (!parse_float(val, 0.0f, CB_BLEND_AUTO_COST_KEYS_MAX, &v->o.auto_cost_keys)) return false;
        } else if (!strcmp(k, "floor")) {
            if (!parse_float(val, 0.0f, 1.0f, &v->o.auto_floor)) return false;
        } else if (!strcmp(k, "ceil")) {
            if (!parse_float(val, 0.0f, 1.0f, &v->o.auto_ceil)) return false;
        } else if (!strcmp(k, "metric")) {
            if (!cb_blend_metric_parse(val)) return false;
            v->o.metric = val[0];
        } else if (!strcmp(k, "check")) {
            if (!parse_long(val, 0, 4096, &l)) return false;
            v->o.check_layer = (int)l;
        } else if (!strcmp(k, "gradual")) {
            if (!strcmp(val, "0")) v->o.gradual_ratio = 0.0f;
            else if (!eval_parse_gradual(val, '/', &v->o.gradual_ratio, &v->o.gradual_end_layer)) return false;
        } else if (!strcmp(k, "lead")) {
            if (!parse_long(val, 0, 1 << 20, &l)) return false;
            v->o.lead_tokens = (int)l;
        } else if (!strcmp(k, "probe")) {
            if (!parse_long(val, 0, 4096, &l)) return false;
            v->o.probe_layers = (int)l;
        } else if (!strcmp(k, "sparse")) { /* sparse attention for the chosen rows: share of blocks kept */
            if (!parse_float(val, 0.0f, 1.0f, &v->o.sparse_keys)) return false;
        } else if (!strcmp(k, "psuf")) {
            if (!parse_long(val, 0, 4096, &l)) return false;
            v->o.probe_suffix = (int)l;
        } else if (!strcmp(k, "overlap")) {
            if (strcmp(val, "0") && strcmp(val, "1")) return false;
            v->o.no_overlap = val[0] == '0';
        } else if (!strcmp(k, "kv")) { /* this mode's chunk files in another dtype (their own store) */
            if ((v->kv_dtype = cb_kv_dtype_parse(val)) < 0) return false;
        } else {
            return false;
        }
    }
    return true;
}
