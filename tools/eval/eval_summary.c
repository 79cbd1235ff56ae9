/* eval_summary.c: cb-eval's summaries: the sums of each mode over the examples as OUT/summary.json (and
 * summary-<label>.json per blend variant, for scripts/plot-eval), the table printed at the end, and
 * --summarize, which rebuilds them from results files (eval.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "eval.h"

int eval_mkdir_p(const char *path) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return -1;
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
    return 0;
}

static json_t *summary_mode(const variant_t *v, const variant_t *full) {
    json_t *m = json_object();
    double n = v->n > 0 ? v->n : 1;
    json_object_set_new(m, "n", json_integer(v->n));
    json_object_set_new(m, "f1", json_real(v->f1 / n));
    json_object_set_new(m, "agree_f1", v->n_agree ? json_real(v->agree / v->n_agree) : json_null());
    json_object_set_new(m, "first_token_match", v->n_ftm ? json_real(v->ftm / v->n_ftm) : json_null());
    json_object_set_new(m, "kl_first", v->n_kl ? json_real(v->kl / v->n_kl) : json_null());
    json_object_set_new(m, "ttft_ms", json_real(v->ttft / n));
    json_object_set_new(m, "ttft_ratio",
                        full && full->n > 0 && full->ttft > 0 ? json_real((v->ttft / n) / (full->ttft / full->n))
                                                              : json_null());
    json_object_set_new(m, "ttft_cpu_ms", json_real(v->ttft_cpu / n));
    json_object_set_new(m, "ttft_cpu_ratio", full && full->n > 0 && full->ttft_cpu > 0
                                                 ? json_real((v->ttft_cpu / n) / (full->ttft_cpu / full->n))
                                                 : json_null());
    json_object_set_new(m, "recompute_frac", json_real(v->rfrac / n));
    json_object_set_new(m, "ratio_chosen", json_real(v->rchosen / n));
    json_object_set_new(m, "load_ms", json_real(v->load / n));
    json_object_set_new(m, "load_wait_ms", json_real(v->wait / n));
    json_object_set_new(m, "select_ms", json_real(v->sel / n));
    json_object_set_new(m, "compute_ms", json_real(v->comp / n));
    json_object_set_new(m, "resolve_ms", json_real(v->resolve / n));
    json_t *c = json_object();
    json_object_set_new(c, "mode", json_string(cb_blend_mode_str(v->o.mode)));
    if (v->o.mode == CB_BLEND_BLEND) {
        json_object_set_new(c, "ratio", json_real(v->o.ratio));
        json_object_set_new(c, "auto_target", json_real(v->o.auto_target));
        json_object_set_new(c, "auto_cost_keys", json_real(v->o.auto_cost_keys));
        char mt[2] = {v->o.metric, 0};
        json_object_set_new(c, "metric", json_string(mt));
        json_object_set_new(c, "check_layer", json_integer(v->o.check_layer));
        json_object_set_new(c, "gradual_ratio", json_real(v->o.gradual_ratio));
        json_object_set_new(c, "gradual_end_layer", json_integer(v->o.gradual_ratio != 0.0f ? v->o.gradual_end_layer : 0));
        json_object_set_new(c, "lead_tokens", json_integer(v->o.lead_tokens));
        json_object_set_new(c, "probe_layers", json_integer(v->o.probe_layers));
        json_object_set_new(c, "probe_suffix", json_integer(v->o.probe_suffix));
        json_object_set_new(c, "sparse_keys", json_real(v->o.sparse_keys));
    }
    json_object_set_new(c, "overlap", json_boolean(!v->o.no_overlap));
    json_object_set_new(m, "config", c);
    return m;
}

static int write_json(const char *path, json_t *j) {
    char tmp[4400];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) return -1;
    if (json_dump_file(j, tmp, JSON_INDENT(2) | JSON_REAL_PRECISION(6)) != 0) return -1;
    return rename(tmp, path);
}

/* summary.json (all variants) and, with several blend variants, summary-<label>.json per variant. */
int eval_write_summaries(const char *out, variant_t *vs, int nv, json_t *config) {
    const variant_t *full = NULL;
    int n_blend = 0;
    for (int i = 0; i < nv; i++) {
        if (!full && vs[i].o.mode == CB_BLEND_FULL) full = &vs[i];
        n_blend += vs[i].o.mode == CB_BLEND_BLEND;
    }
    char path[4200];
    json_t *root = json_object(), *modes = json_object();
    for (int i = 0; i < nv; i++) json_object_set_new(modes, vs[i].label, summary_mode(&vs[i], full));
    json_object_set_new(root, "modes", modes);
    json_object_set(root, "config", config);
    snprintf(path, sizeof path, "%s/summary.json", out);
    int rc = write_json(path, root);
    json_decref(root);
    if (n_blend < 2) return rc;
    for (int i = 0; i < nv; i++) {
        if (vs[i].o.mode != CB_BLEND_BLEND) continue;
        json_t *r = json_object(), *m = json_object();
        for (int j = 0; j < nv; j++)
            if (vs[j].o.mode != CB_BLEND_BLEND && !strcmp(vs[j].label, cb_blend_mode_str(vs[j].o.mode)))
                json_object_set_new(m, vs[j].label, summary_mode(&vs[j], full));
        json_object_set_new(m, "blend", summary_mode(&vs[i], full));
        json_object_set_new(r, "modes", m);
        json_t *c = json_deep_copy(config);
        json_object_set_new(c, "ratio", json_real(vs[i].o.ratio));
        json_object_set_new(c, "variant", json_string(vs[i].label));
        json_object_set_new(r, "config", c);
        char name[80];
        snprintf(name, sizeof name, "%s", vs[i].label);
        for (char *p = name; *p; p++)
            if (*p == ':' || *p == '/' || *p == '=') *p = '_';
        snprintf(path, sizeof path, "%s/summary-%s.json", out, name);
        rc |= write_json(path, r);
        json_decref(r);
    }
    return rc;
}

void eval_print_table(FILE *f, const variant_t *vs, int nv) {
    const variant_t *full = NULL;
    for (int i = 0; i < nv; i++)
        if (vs[i].o.mode == CB_BLEND_FULL) {
            full = &vs[i];
            break;
        }
    fprintf(f, "%-28s %4s %7s %9s %7s %8s %10s %10s %10s %8s %8s %8s\n", "mode", "n", "f1", "agree_f1", "ftm", "kl",
            "ttft_ms", "ttft_ratio", "cpu_ratio", "recomp", "load_ms", "wait_ms");
    for (int i = 0; i < nv; i++) {
        const variant_t *v = &vs[i];
        double n = v->n > 0 ? v->n : 1;
        char ag[16] = "-", ft[16] = "-", tr[16] = "-", cr[16] = "-", kl[16] = "-";
        if (v->n_kl) snprintf(kl, sizeof kl, "%.4f", v->kl / v->n_kl);
        if (v->n_agree) {
            snprintf(ag, sizeof ag, "%.3f", v->agree / v->n_agree);
            if (v->n_ftm) snprintf(ft, sizeof ft, "%.3f", v->ftm / v->n_ftm);
        }
        if (full && full->n > 0 && full->ttft > 0) {
            snprintf(tr, sizeof tr, "%.3f", (v->ttft / n) / (full->ttft / full->n));
            snprintf(cr, sizeof cr, "%.3f", (v->ttft_cpu / n) / (full->ttft_cpu / full->n));
        }
        fprintf(f, "%-28s %4d %7.3f %9s %7s %8s %10.1f %10s %10s %8.3f %8.1f %8.1f\n", v->label, v->n, v->f1 / n, ag, ft,
                kl, v->ttft / n, tr, cr, v->rfrac / n, v->load / n, v->wait / n);
    }
}

/* Adds one results line to its variant (created from the label on first sight). 0, or -1 (bad label/line). */
static int summarize_line(json_t *j, const cb_blend_opts_t *base, const char *only, variant_t *vs, int *nv) {
    const char *label = json_string_value(json_object_get(j, "mode"));
    if (!label) return -1;
    if (only) { /* comma list of labels to keep */
        size_t n = strlen(label);
        const char *p = only;
        bool found = false;
        while (!found && (p = strstr(p, label)) != NULL) {
            found = (p == only || p[-1] == ',') && (p[n] == ',' || p[n] == 0);
            p += n;
        }
        if (!found) return 0;
    }
    variant_t *v = NULL;
    for (int i = 0; i < *nv; i++)
        if (!strcmp(vs[i].label, label)) v = &vs[i];
    if (!v) {
        if (*nv == MAX_VARIANTS) return -1;
        v = &vs[*nv];
        memset(v, 0, sizeof *v);
        if (!eval_parse_variant(label, base, v)) return -1;
        (*nv)++;
    }
    double n_tok = json_number_value(json_object_get(j, "n_tokens"));
    v->n++;
    v->f1 += json_number_value(json_object_get(j, "f1"));
    json_t *a = json_object_get(j, "agree_f1"), *ft = json_object_get(j, "first_token_match"),
           *kl = json_object_get(j, "kl_first");
    if (json_is_number(a)) v->n_agree++, v->agree += json_number_value(a);
    if (json_is_boolean(ft)) v->n_ftm++, v->ftm += json_is_true(ft);
    if (json_is_number(kl)) v->n_kl++, v->kl += json_number_value(kl);
    v->ttft += json_number_value(json_object_get(j, "ttft_ms"));
    v->ttft_cpu += json_number_value(json_object_get(j, "ttft_cpu_ms"));
    v->rfrac += n_tok > 0 ? json_number_value(json_object_get(j, "tokens_recomputed")) / n_tok : 0.0;
    v->load += json_number_value(json_object_get(j, "load_ms"));
    v->wait += json_number_value(json_object_get(j, "load_wait_ms"));
    v->sel += json_number_value(json_object_get(j, "select_ms"));
    v->comp += json_number_value(json_object_get(j, "compute_ms"));
    v->resolve += json_number_value(json_object_get(j, "resolve_ms"));
    return 0;
}

/* --summarize: rebuild the summaries from results files. */
int eval_summarize(const char *out, const cb_blend_opts_t *base, const char *only, char **files, int n_files) {
    static variant_t vs[MAX_VARIANTS];
    int nv = 0, n_ex = 0;
    for (int f = 0; f < n_files; f++) {
        json_t *arr = json_array(), *count = json_object();
        FILE *fp = fopen(files[f], "r");
        if (!fp) {
            fprintf(stderr, "cb-eval: %s: %s\n", files[f], strerror(errno));
            return 1;
        }
        char *line = NULL;
        size_t cap = 0;
        int max_per_id = 0;
        while (getline(&line, &cap, fp) > 0) {
            json_error_t je;
            json_t *j = json_loads(line, 0, &je);
            const char *id = j ? json_string_value(json_object_get(j, "id")) : NULL;
            if (!id) {
                fprintf(stderr, "cb-eval: %s: bad line skipped\n", files[f]);
                json_decref(j);
                continue;
            }
            json_int_t c = json_integer_value(json_object_get(count, id)) + 1;
            json_object_set_new(count, id, json_integer(c));
            if (c > max_per_id) max_per_id = (int)c;
            json_array_append_new(arr, j);
        }
        free(line);
        fclose(fp);
        size_t i;
        json_t *j;
        json_array_foreach(arr, i, j) {
            const char *id = json_string_value(json_object_get(j, "id"));
            if (json_integer_value(json_object_get(count, id)) != max_per_id) continue; /* incomplete example */
            if (summarize_line(j, base, only, vs, &nv)) {
                fprintf(stderr, "cb-eval: %s: bad mode label\n", files[f]);
                return 1;
            }
        }
        const char *k;
        json_t *c;
        json_object_foreach(count, k, c) n_ex += json_integer_value(c) == max_per_id;
        json_decref(arr);
        json_decref(count);
    }
    /* full first, as in a run */
    for (int i = 1; i < nv; i++)
        if (vs[i].o.mode == CB_BLEND_FULL && vs[0].o.mode != CB_BLEND_FULL) {
            variant_t t = vs[0];
            vs[0] = vs[i];
            vs[i] = t;
        }
    if (eval_mkdir_p(out) != 0) return 1;
    json_t *config = json_object(), *src = json_array();
    for (int f = 0; f < n_files; f++) json_array_append_new(src, json_string(files[f]));
    json_object_set_new(config, "merged_from", src);
    json_object_set_new(config, "examples", json_integer(n_ex));
    json_object_set_new(config, "ratio", json_real(base->ratio));
    int rc = eval_write_summaries(out, vs, nv, config);
    json_decref(config);
    if (rc) {
        fprintf(stderr, "cb-eval: writing the summary failed\n");
        return 1;
    }
    eval_print_table(stdout, vs, nv);
    return 0;
}
