/* cb-logits: every position's next-token logits of a token sequence, for comparing the engine with another
 * one position by position (scripts/compare-llamacpp: KL divergence and top-1 agreement with llama.cpp).
 *
 *   cb-logits [--model PATH] --ids-file FILE [--out FILE] [--threads N]
 *
 * FILE holds whitespace-separated token ids (at most 32,768). The sequence is prefilled in pieces of 512
 * positions (cb_engine_prefill_all) and row i of the output is the logits after ids[0..i]: raw little-endian
 * f32, [n][n_vocab], to --out (default stdout). Model: --model, else $CB_MODEL, else the default model.
 * Exit: 0 ok, 1 runtime error, 2 bad arguments.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "svc/svcconfig.h"
#include "base/alloc.h"
#include "engine/engine.h"
#include "model/model.h"

#define MAX_IDS 32768
#define PIECE 512

static int usage(void) {
    fprintf(stderr, "usage: cb-logits [--model PATH] --ids-file FILE [--out FILE] [--threads N]\n");
    return 2;
}

/* Reads up to MAX_IDS ids from path into ids; the count, or -1 with a message. */
static int read_ids(const char *path, int32_t *ids) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "cb-logits: %s: %s\n", path, strerror(errno));
        return -1;
    }
    int n = 0;
    char word[32];
    while (fscanf(f, "%31s", word) == 1) {
        long v;
        if (n == MAX_IDS || !parse_long(word, 0, INT32_MAX, &v)) {
            fprintf(stderr, "cb-logits: %s: %s\n", path, n == MAX_IDS ? "more than 32768 ids" : "not a token id");
            fclose(f);
            return -1;
        }
        ids[n++] = (int32_t)v;
    }
    fclose(f);
    if (n == 0) fprintf(stderr, "cb-logits: %s: no ids\n", path);
    return n ? n : -1;
}

int main(int argc, char **argv) {
    const char *model_path = cb_svc_model_path(NULL), *ids_path = NULL, *out_path = NULL;
    long threads = 0;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) return usage();
        if (!strcmp(argv[i], "--model")) model_path = v;
        else if (!strcmp(argv[i], "--ids-file")) ids_path = v;
        else if (!strcmp(argv[i], "--out")) out_path = v;
        else if (!strcmp(argv[i], "--threads") && parse_long(v, 1, 256, &threads)) {}
        else return usage();
        i++;
    }
    if (!ids_path) return usage();
    int32_t *ids = cb_malloc(sizeof(int32_t) * MAX_IDS);
    int n = ids ? read_ids(ids_path, ids) : -1;
    char err[256] = "";
    cb_model_t *m = n > 0 ? cb_model_load(model_path, err, sizeof err) : NULL;
    cb_engine_t *e = m ? cb_engine_new(m, n, err, sizeof err) : NULL;
    cb_seq_t *seq = e ? cb_seq_new(e) : NULL;
    const int V = m ? cb_model_hparams(m)->n_vocab : 0;
    float *lg = seq ? cb_malloc(sizeof(float) * (size_t)PIECE * (size_t)V) : NULL;
    FILE *out = lg ? (out_path ? fopen(out_path, "wb") : stdout) : NULL;
    int rc = 1;
    if (n > 0 && !out) fprintf(stderr, "cb-logits: %s\n", err[0] ? err : out_path && lg ? strerror(errno) : "out of memory");
    if (out && cb_model_check_tokens(m, ids, n, "ids", err, sizeof err) != 0) {
        fprintf(stderr, "cb-logits: %s\n", err);
        out = out != stdout && out ? (fclose(out), NULL) : NULL;
    }
    if (out) {
        if (threads) cb_engine_set_threads(e, (int)threads);
        rc = 0;
        for (int p = 0; p < n && rc == 0; p += PIECE) {
            const int k = n - p < PIECE ? n - p : PIECE;
            int st = cb_engine_prefill_all(e, seq, ids + p, k, p, lg);
            if (st != CB_ENGINE_OK) {
                fprintf(stderr, "cb-logits: prefill: %s\n", cb_engine_status_str(st));
                rc = 1;
            } else if (fwrite(lg, sizeof(float) * (size_t)V, (size_t)k, out) != (size_t)k) {
                fprintf(stderr, "cb-logits: write: %s\n", strerror(errno));
                rc = 1;
            }
        }
        if ((out != stdout ? fclose(out) : fflush(out)) != 0 && rc == 0) {
            fprintf(stderr, "cb-logits: closing the output: %s\n", strerror(errno));
            rc = 1;
        }
    }
    free(lg);
    cb_seq_destroy(&seq);
    cb_engine_destroy(&e);
    cb_model_destroy(&m);
    free(ids);
    return rc;
}
