/* eval.h: what cb-eval's files share (tools/eval; not an API):
 *   cb-eval.c          the command line (options, the list of modes) and main's steps;
 *   eval_variants.c    a mode token of --modes and its overrides parsed into a variant (variant_t);
 *   eval_run.c         the run: the session and chunk stores, each example's prompt, the answers, the
 *                      results lines;
 *   eval_summary.c     the sums per mode as summary*.json and a table, and --summarize.
 * cb-kvdev, the folder's other program, links these files too and uses none of them. */
#ifndef CB_EVAL_H
#define CB_EVAL_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "blend/blend.h"
#include "engine/engine.h"
#include "kv/kvmem.h"
#include "kv/kvstore.h"
#include "model/tokenizer.h"
#include "rag/qa.h"
#include "rag/ragprompt.h"
#include "svc/session.h"

#define MAX_VARIANTS 32
#define MAX_STORES 4 /* chunk-file dtypes: f32, f16, bf16, q8_0 */

typedef struct {
    char label[64];
    cb_blend_opts_t o;
    int kv_dtype;              /* the chunk files' dtype (mode key kv=); -1: the run's --kv-dtype */
    int store;                 /* index of its chunk store (stores[], one per dtype in use) */
    /* sums over examples */
    int n, n_agree, n_ftm, n_kl;
    double f1, agree, ftm, kl, ttft, ttft_cpu, rfrac, load, wait, sel, comp, resolve;
    double rchosen;            /* sum of the blend's ratio_chosen (ratio = auto: what each example chose) */
} variant_t;

/* The command line. */
typedef struct {
    const char *model_path, *chat_tmpl;   /* chat_tmpl NULL = the GGUF's */
    const char *system_prompt;           /* NULL or "" = the template's default line */
    const char *data, *modes_arg, *kv_dir, *out, *ref_path;
    long limit, skip, threads, mem_mb, max_new;
    cb_kv_dtype_t dtype;
    bool dump_prompt, modes_given;
    int summarize_from;                  /* argv index of the first results file (--summarize), else 0 */
    cb_blend_opts_t base;                /* the options of plain `blend` */
} eval_args_t;

/* The run: the session (model, prompt, engine, the first chunk store and its blend), the other stores
 * (one per further chunk-file dtype in use), buffers and the output. */
typedef struct {
    const eval_args_t *a;
    variant_t vs[MAX_VARIANTS];
    int nv;
    cb_session_t *s;
    const cb_ragprompt_t *rp;
    cb_tokenizer_t *tok;
    cb_engine_t *eng;
    int n_vocab;
    const int32_t *prefix;               /* [n_prefix] P, the session's */
    int n_prefix;
    /* [0] the session's store (--kv-dtype's files in kv_dir); the others (mode key kv=) in kv_dir/<dtype>,
     * since a file's name does not depend on its dtype, each with its own memory tier */
    cb_kvmem_t *mem[MAX_STORES];
    cb_kvstore_t *store[MAX_STORES];
    cb_blend_t *bl[MAX_STORES];
    cb_kv_dtype_t store_dt[MAX_STORES];
    int n_stores;
    cb_seq_t *seq;
    float *logits;                       /* [n_vocab] */
    double *lp_full, *lp_mode;           /* [n_vocab] first-token log-distributions */
    int32_t *gen;                        /* [max_new] */
    FILE *res;
    json_t *config, *ref;                /* ref: id -> full line of the reference run */
    char err[512];
} eval_t;

/* eval_variants.c */
/* "R1<sep>L" into ratio and layer. */
bool eval_parse_gradual(const char *s, char sep, float *r1, int *layer);
/* One --modes token ("blend:r=0.1:metric=k") on top of base. */
bool eval_parse_variant(const char *tok, const cb_blend_opts_t *base, variant_t *v);

/* eval_summary.c */
/* mkdir -p. 0, or -1 (errno set). */
int eval_mkdir_p(const char *path);
/* summary.json (all variants) and, with several blend variants, summary-<label>.json per variant. */
int eval_write_summaries(const char *out, variant_t *vs, int nv, json_t *config);
void eval_print_table(FILE *f, const variant_t *vs, int nv);
/* --summarize: rebuild the summaries from results files; the exit code. */
int eval_summarize(const char *out, const cb_blend_opts_t *base, const char *only, char **files, int n_files);

/* eval_run.c: the steps of a run, in main's order (each prints its own message on failure). */
/* The full-mode lines of an earlier results.jsonl, by id; NULL with a message. */
json_t *eval_load_ref(const char *path);
/* The session, the other chunk stores, the sequence and the buffers. 0, or -1. */
int eval_open(eval_t *ev);
/* OUT/results.jsonl opened and the run's configuration. 0, or -1. */
int eval_open_results(eval_t *ev);
/* Examples [first, last). 0, 2 (the prompt dumped), or -1. */
int eval_examples(eval_t *ev, const cb_qa_set_t *set, int first, int last);
void eval_close(eval_t *ev);

#endif
