/* cb-kvdev: where the reused KV deviates, and which rows each selection metric recomputes. The
 * diagnostic behind the choice of blend's default metric (docs/eval.md, "Why metric a").
 *
 *   cb-kvdev [--model PATH] [--chat-template NAME] --data FILE.jsonl [--skip N] [--limit N] [--ratio R] [--lead N] [--kv-dir DIR]
 *
 * For each MuSiQue example (prompt as cb-eval and cb-blend build it, ragprompt.h): a full prefill gives
 * the exact K/V of every row and layer (read back from its engine sequence, cb_engine_kv_read); each
 * chunk's cached K/V (its KV file, computed after the prefix when missing) is compared with it. Over the
 * candidate rows (chunk rows after the lead tokens) and per layer it prints the mean squared deviation of
 * V, the share of the total that the floor(R * candidates) most deviating rows hold ("top share": 1.0
 * would mean perfectly concentrated, R when uniform), and the share that falls on the rows blend
 * recomputes with metric v (the check-layer set) and with metric a (the attention set), both at ratio R.
 * Then the first-token KL divergence from full of reuse and of blend with each metric, and the mean
 * position of each metric's recomputed rows (attention cost grows with it). Averages over the examples
 * come last.
 * Exit: 0 ok, 1 runtime error, 2 usage.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "base/alloc.h"
#include "blend/blend.h"
#include "engine/engine.h"
#include "kv/kvstore.h"
#include "base/log.h"
#include "model/model.h"
#include "rag/qa.h"
#include "rag/ragprompt.h"
#include "svc/session.h"
#include "svc/svcconfig.h"
#include "engine/sampler.h"
#include "model/tokenizer.h"

#define N_SETS 3 /* top of the layer, metric v's rows, metric a's rows */
static const char METRICS[] = "va";

static int usage(const char *why) {
    if (why) fprintf(stderr, "cb-kvdev: %s\n", why);
    fprintf(stderr, "usage: cb-kvdev [--model PATH] [--chat-template NAME] --data FILE.jsonl [--skip N] [--limit N] [--ratio R] [--lead N] [--kv-dir DIR]\n");
    return 2;
}

typedef struct {
    double dev, share[N_SETS];
} layer_acc_t;

typedef struct {
    double v;
    int r;
} vr_t;

static int cmp_desc(const void *a, const void *b) {
    double x = ((const vr_t *)a)->v, y = ((const vr_t *)b)->v;
    return x > y ? -1 : x < y ? 1 : ((const vr_t *)a)->r - ((const vr_t *)b)->r;
}

int main(int argc, char **argv) {
    cb_log_set_component("cb-kvdev");
    const char *model_path = cb_svc_model_path(NULL), *data = NULL, *kv_dir = "var/kv";
    const char *chat_tmpl = NULL; /* --chat-template NAME; NULL = the GGUF's */
    long skip = 0, limit = 5, lead = CB_BLEND_DEFAULT_LEAD;
    float ratio = CB_BLEND_DEFAULT_RATIO;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        if (!v) return usage("missing value");
        if (!strcmp(a, "--model")) model_path = v;
        else if (!strcmp(a, "--chat-template")) chat_tmpl = v;
        else if (!strcmp(a, "--data")) data = v;
        else if (!strcmp(a, "--kv-dir")) kv_dir = v;
        else if (!strcmp(a, "--skip")) {
            if (!parse_long(v, 0, 1000000, &skip)) return usage("bad --skip");
        } else if (!strcmp(a, "--limit")) {
            if (!parse_long(v, 1, 1000000, &limit)) return usage("bad --limit");
        } else if (!strcmp(a, "--lead")) {
            if (!parse_long(v, 0, 1 << 20, &lead)) return usage("bad --lead");
        } else if (!strcmp(a, "--ratio")) {
            if (!parse_float(v, 0.001f, 1.0f, &ratio)) return usage("bad --ratio");
        } else return usage("unknown option");
        i++;
    }
    if (!data) return usage("--data is required");

    int rc = 1;
    char err[512] = "";
    cb_qa_set_t *set = NULL;
    cb_session_t *ses = NULL;
    cb_seq_t *seq = NULL;
    float *logits = NULL, *Vt = NULL;
    double *lp_full = NULL, *lp_mode = NULL, *dv = NULL; /* [n_vocab] first-token log-distributions */
    vr_t *order = NULL;
    uint8_t *cand = NULL, *in_set[N_SETS] = {NULL};
    int32_t *chunk_tok[CB_QA_MAX_CTXS] = {NULL}, *suffix = NULL;
    layer_acc_t *acc = NULL;
    double kl_sum[1 + sizeof METRICS - 1] = {0};
    int n_done = 0;

    /* the served path's objects (svc/session.h) over the model's whole context, the chunk files in kv_dir */
    cb_session_opts_t so;
    cb_session_opts_default(&so);
    so.model_path = model_path;
    so.chat_template = chat_tmpl;
    so.kv_dir = kv_dir;
    if (!(set = cb_qa_set_load(data, err, sizeof err)) || !(ses = cb_session_new(&so, err, sizeof err))) {
        fprintf(stderr, "cb-kvdev: %s\n", err);
        goto done;
    }
    const cb_hparams_t *hp = cb_session_hparams(ses);
    const int L = hp->n_layer, KVD = hp->n_head_kv * hp->head_dim, V = hp->n_vocab;
    cb_engine_t *eng = cb_session_engine(ses);
    cb_kvstore_t *store = cb_session_store(ses);
    cb_blend_t *bl = cb_session_blend(ses);
    const cb_ragprompt_t *rp = cb_session_prompt(ses);
    const int C = cb_engine_max_ctx(eng);
    seq = cb_seq_new(eng);
    logits = cb_malloc(sizeof(float) * (size_t)V);
    lp_full = cb_malloc(sizeof(double) * (size_t)V);
    lp_mode = cb_malloc(sizeof(double) * (size_t)V);
    Vt = cb_malloc(sizeof(float) * (size_t)L * C * KVD); /* [L][N][KVD] exact V of the full prefill */
    dv = cb_malloc(sizeof(double) * (size_t)L * C);      /* [L][N] squared V deviation */
    order = cb_malloc(sizeof(vr_t) * (size_t)C);
    cand = cb_malloc((size_t)C);
    acc = cb_calloc((size_t)L, sizeof *acc);
    for (int s = 0; s < N_SETS; s++) in_set[s] = cb_malloc((size_t)C);
    if (!seq || !logits || !lp_full || !lp_mode || !Vt || !dv || !order || !cand || !acc || !in_set[0] || !in_set[1] ||
        !in_set[2]) {
        fprintf(stderr, "cb-kvdev: out of memory\n");
        goto done;
    }
    int np = 0;
    const int32_t *prefix = cb_ragprompt_prefix(rp, &np);
    int n_set = cb_qa_set_size(set);
    for (int ei = (int)skip; ei < n_set && ei < skip + limit; ei++) {
        const cb_qa_example_t *ex = cb_qa_set_get(set, ei);
        cb_blend_chunk_t ch[CB_QA_MAX_CTXS];
        int nc = ex->n_ctxs, ns = 0, N = np;
        for (int c = 0; c < nc; c++) {
            char *t = cb_ragprompt_passage(ex->ctxs[c].title, ex->ctxs[c].text);
            chunk_tok[c] = t ? cb_ragprompt_chunk(rp, t, strlen(t), &ch[c].n) : NULL;
            free(t);
            if (!chunk_tok[c]) goto tok_fail;
            ch[c].tokens = chunk_tok[c];
            N += ch[c].n;
        }
        if (!(suffix = cb_ragprompt_suffix(rp, ex->question, &ns))) goto tok_fail;
        N += ns;
        if (N > C) {
            fprintf(stderr, "cb-kvdev: %s: %d tokens exceed the context; skipped\n", ex->id, N);
            goto next;
        }
        /* exact KV */
        cb_blend_opts_t o;
        cb_blend_opts_default(&o);
        o.mode = CB_BLEND_FULL;
        o.lead_tokens = (int)lead;
        if (cb_blend_prefill(bl, seq, prefix, np, ch, nc, suffix, ns, &o, logits, NULL, err, sizeof err)) goto fail;
        cb_log_softmax(logits, V, lp_full);
        for (int l = 0; l < L; l++)
            if (cb_engine_kv_read(eng, seq, l, 0, N, NULL, Vt + (size_t)l * N * KVD) != CB_ENGINE_OK) {
                snprintf(err, sizeof err, "%s: cannot read back layer %d of the full prefill", ex->id, l);
                goto fail;
            }
        /* deviations of the cached chunk rows; candidates = chunk rows after the lead tokens */
        memset(cand, 0, (size_t)N);
        int n_cand = 0, r0 = np;
        for (int c = 0; c < nc; c++) {
            cb_kvmem_entry_t *e = cb_kvstore_load(store, prefix, np, ch[c].tokens, ch[c].n, NULL, NULL, err, sizeof err);
            if (!e) goto fail;
            for (int l = 0; l < L; l++) {
                const float *cv = cb_kvmem_entry_v(e, l);
                for (int i = 0; i < ch[c].n; i++) {
                    const float *t = Vt + ((size_t)l * N + r0 + i) * KVD, *x = cv + (size_t)i * KVD;
                    double s = 0;
                    for (int d = 0; d < KVD; d++) s += ((double)t[d] - x[d]) * ((double)t[d] - x[d]);
                    dv[(size_t)l * N + r0 + i] = s;
                }
            }
            cb_kvmem_entry_release(&e);
            for (int i = o.lead_tokens; i < ch[c].n; i++) cand[r0 + i] = 1, n_cand++;
            r0 += ch[c].n;
        }
        int target = (int)floor(ratio * n_cand + 1e-6);
        if (target < 1 || n_cand == 0) goto next;
        /* the rows each metric recomputes, and its first-token KL */
        o.mode = CB_BLEND_REUSE;
        if (cb_blend_prefill(bl, seq, prefix, np, ch, nc, suffix, ns, &o, logits, NULL, err, sizeof err)) goto fail;
        cb_log_softmax(logits, V, lp_mode);
        double kl[1 + sizeof METRICS - 1], mean_pos[sizeof METRICS - 1];
        kl[0] = cb_kl_div(lp_full, lp_mode, V);
        for (int m = 0; m < (int)sizeof METRICS - 1; m++) {
            cb_blend_opts_default(&o);
            o.lead_tokens = (int)lead;
            o.ratio = ratio;
            o.metric = METRICS[m];
            cb_blend_stats_t st;
            if (cb_blend_prefill(bl, seq, prefix, np, ch, nc, suffix, ns, &o, logits, &st, err, sizeof err)) goto fail;
            cb_log_softmax(logits, V, lp_mode);
            kl[1 + m] = cb_kl_div(lp_full, lp_mode, V);
            memset(in_set[1 + m], 0, (size_t)N);
            double sp = 0;
            for (int i = 0; i < st.tokens_recomputed; i++) in_set[1 + m][st.selected[i]] = 1, sp += st.selected[i];
            mean_pos[m] = sp / st.tokens_recomputed;
        }
        printf("%s: %d tokens, %d candidates, %d recomputed (ratio %.2f); first-token KL: reuse %.4f, blend v %.4f, "
               "blend a %.4f; mean position of the recomputed rows: v %.0f, a %.0f\n", ex->id, N, n_cand, target,
               (double)ratio, kl[0], kl[1], kl[2], mean_pos[0], mean_pos[1]);
        printf("  layer  mean dev(V)  top share  v-set share  a-set share\n");
        for (int l = 0; l < L; l++) {
            int m = 0;
            double tot = 0, sh[N_SETS] = {0};
            for (int r = 0; r < N; r++)
                if (cand[r]) order[m++] = (vr_t){dv[(size_t)l * N + r], r}, tot += dv[(size_t)l * N + r];
            qsort(order, (size_t)m, sizeof *order, cmp_desc);
            memset(in_set[0], 0, (size_t)N);
            for (int j = 0; j < target; j++) in_set[0][order[j].r] = 1;
            for (int j = 0; j < m; j++)
                for (int s = 0; s < N_SETS; s++)
                    if (in_set[s][order[j].r]) sh[s] += order[j].v;
            for (int s = 0; s < N_SETS; s++) sh[s] = tot > 0 ? sh[s] / tot : 0;
            acc[l].dev += tot / m;
            for (int s = 0; s < N_SETS; s++) acc[l].share[s] += sh[s];
            if (l % 4 == 1 || l == L - 1)
                printf("  %5d  %11.4g  %9.3f  %11.3f  %11.3f\n", l, tot / m, sh[0], sh[1], sh[2]);
        }
        for (int k = 0; k < 3; k++) kl_sum[k] += kl[k];
        n_done++;
        fflush(stdout);
    next:
        for (int c = 0; c < nc; c++) free(chunk_tok[c]), chunk_tok[c] = NULL;
        free(suffix);
        suffix = NULL;
        continue;
    tok_fail:
        fprintf(stderr, "cb-kvdev: %s: tokenization failed\n", ex->id);
        goto done;
    }
    if (n_done > 0) {
        printf("mean over %d examples (ratio %.2f): first-token KL reuse %.4f, blend v %.4f, blend a %.4f\n", n_done,
               (double)ratio, kl_sum[0] / n_done, kl_sum[1] / n_done, kl_sum[2] / n_done);
        printf("  layer  mean dev(V)  top share  v-set share  a-set share\n");
        for (int l = 0; l < L; l++)
            printf("  %5d  %11.4g  %9.3f  %11.3f  %11.3f\n", l, acc[l].dev / n_done, acc[l].share[0] / n_done,
                   acc[l].share[1] / n_done, acc[l].share[2] / n_done);
    }
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "cb-kvdev: %s\n", err);
done:
    for (int c = 0; c < CB_QA_MAX_CTXS; c++) free(chunk_tok[c]);
    free(suffix);
    for (int s = 0; s < N_SETS; s++) free(in_set[s]);
    free(logits), free(lp_full), free(lp_mode), free(Vt), free(dv), free(order), free(cand), free(acc);
    cb_seq_destroy(&seq);
    cb_session_destroy(&ses);
    cb_qa_set_destroy(&set);
    return rc;
}
