/* cb-tokenize: command-line front end of libshared/tokenizer (encode text to ids, or decode ids).
 *
 *   cb-tokenize [--model PATH] [--special] TEXT       prints the ids, separated by spaces
 *   cb-tokenize [--model PATH] [--special] --decode "1 2 3"   prints the text (--special renders
 *                                                      control tokens such as <|im_start|>)
 *   TEXT "-" reads the text from stdin (all bytes, no trailing-newline stripping).
 * Model: --model, else $CB_MODEL, else the default model (svc/svcconfig.h).
 * Exit: 0 ok, 1 model or tokenizer error, 2 bad arguments (usage on stderr).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "svc/svcconfig.h"
#include "format/gguf.h"
#include "base/alloc.h"
#include "model/tokenizer.h"

static int usage(void) {
    fprintf(stderr,
            "usage: cb-tokenize [--model PATH] [--special] TEXT|-\n"
            "       cb-tokenize [--model PATH] [--special] --decode \"ID ID ...\"\n"
            "  --special  encode: parse special tokens (<|im_start|> -> 1); decode: render them\n"
            "  model default: $CB_MODEL or " CB_SVC_DEFAULT_MODEL "\n");
    return 2;
}

static char *read_stdin(size_t *len) {
    size_t cap = 1 << 16, n = 0;
    char *buf = cb_malloc(cap);
    if (!buf) return NULL;
    for (;;) {
        if (n == cap) {
            char *nb = cap < ((size_t)1 << 30) ? cb_realloc(buf, cap * 2) : NULL;
            if (!nb) { free(buf); return NULL; }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - n, stdin);
        n += r;
        if (r == 0) break;
    }
    *len = n;
    return buf;
}

/* Parses "1 2 3" (spaces, tabs, commas or newlines between ids). Returns count, -1 on a bad id. */
static long parse_ids(const char *s, int32_t **ids_out) {
    size_t cap = 64, n = 0;
    int32_t *ids = cb_malloc(cap * sizeof *ids);
    if (!ids) return -1;
    const char *p = s;
    for (;;) {
        while (*p == ' ' || *p == '\t' || *p == '\n' || *p == ',') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX ||
            (*end && *end != ' ' && *end != '\t' && *end != '\n' && *end != ',')) {
            free(ids);
            return -1;
        }
        if (n == cap) {
            int32_t *ni = cb_realloc(ids, 2 * cap * sizeof *ids);
            if (!ni) { free(ids); return -1; }
            ids = ni;
            cap *= 2;
        }
        ids[n++] = (int32_t)v;
        p = end;
    }
    *ids_out = ids;
    return (long)n;
}

int main(int argc, char **argv) {
    const char *model = cb_svc_model_path(NULL);
    bool special = false;
    const char *decode = NULL, *text = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model")) {
            if (++i >= argc) return usage();
            model = argv[i];
        } else if (!strcmp(argv[i], "--special")) {
            special = true;
        } else if (!strcmp(argv[i], "--decode")) {
            if (++i >= argc) return usage();
            decode = argv[i];
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage();
            return 0;
        } else if (!strcmp(argv[i], "--")) {
            if (++i >= argc || text) return usage();
            text = argv[i];
            if (i + 1 != argc) return usage();
        } else if (argv[i][0] == '-' && argv[i][1] != 0) {
            return usage();
        } else {
            if (text) return usage();
            text = argv[i];
        }
    }
    if ((decode != NULL) == (text != NULL)) return usage();

    int32_t *ids = NULL;
    long n_ids = 0;
    if (decode && (n_ids = parse_ids(decode, &ids)) < 0) {
        fprintf(stderr, "cb-tokenize: --decode wants token ids (non-negative integers) separated by spaces\n");
        return 2;
    }

    char err[256];
    cb_gguf_t *g = cb_gguf_open(model, err, sizeof err);
    if (!g) {
        fprintf(stderr, "cb-tokenize: %s\n", err);
        free(ids);
        return 1;
    }
    cb_tokenizer_t *tok = cb_tokenizer_new_from_gguf(g, err, sizeof err);
    cb_gguf_destroy(&g);
    if (!tok) {
        fprintf(stderr, "cb-tokenize: %s\n", err);
        free(ids);
        return 1;
    }

    int rc = 0;
    if (decode) {
        for (long i = 0; i < n_ids; i++) {
            if (ids[i] >= cb_tokenizer_n_vocab(tok)) {
                fprintf(stderr, "cb-tokenize: token id %d is outside the vocabulary (%d tokens)\n", ids[i],
                        cb_tokenizer_n_vocab(tok));
                rc = 2;
                break;
            }
        }
        size_t len;
        char *s = rc ? NULL : cb_tokenizer_decode_alloc(tok, ids, (size_t)n_ids, special, &len);
        if (s) {
            fwrite(s, 1, len, stdout);
            putchar('\n');
            free(s);
        } else if (!rc) {
            rc = 1;
        }
    } else {
        size_t len;
        char *buf = NULL;
        if (!strcmp(text, "-")) {
            buf = read_stdin(&len);
            if (!buf) { fprintf(stderr, "cb-tokenize: cannot read stdin\n"); rc = 1; }
        } else {
            len = strlen(text);
        }
        int n = 0;
        int32_t *out = rc ? NULL : cb_tokenizer_encode_alloc(tok, buf ? buf : text, len, special, &n);
        if (out) {
            for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", out[i]);
            putchar('\n');
            free(out);
        } else if (!rc) {
            fprintf(stderr, "cb-tokenize: tokenization failed\n");
            rc = 1;
        }
        free(buf);
    }
    free(ids);
    cb_tokenizer_destroy(&tok);
    return rc;
}
