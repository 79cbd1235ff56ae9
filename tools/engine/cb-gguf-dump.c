/* cb-gguf-dump: prints a GGUF file's version, metadata (key, type, scalar value or array type and
 * count) and tensors (name, type, shape, offset in the data section), plus a per-type histogram.
 * Usage: cb-gguf-dump FILE. Exit 0 ok, 1 bad file (the reader's message on stderr), 2 bad arguments. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "format/gguf.h"

/* Prints at most max bytes of s, escaping non-printable bytes. */
static void print_str(const char *s, size_t len, size_t max) {
    putchar('"');
    for (size_t i = 0; i < len && i < max; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c >= 0x20 && c < 0x7f) putchar(c);
        else if (c == '\n') fputs("\\n", stdout);
        else printf("\\x%02x", c);
    }
    putchar('"');
    if (len > max) printf("...(%zu bytes)", len);
}

static void print_value(const cb_gguf_t *g, const char *key, cb_gguf_vtype_t t) {
    int64_t i64;
    uint32_t u32;
    float f;
    bool b;
    const char *s;
    size_t len;
    cb_gguf_vtype_t et;
    switch (t) {
    case CB_GGUF_U64:
        /* May exceed int64: print via u32 when it fits, else "large". */
        if (cb_gguf_get_i64(g, key, &i64)) printf("%" PRId64, i64);
        else printf("(> INT64_MAX)");
        break;
    case CB_GGUF_F32: case CB_GGUF_F64:
        if (cb_gguf_get_f32(g, key, &f)) printf("%g", (double)f);
        break;
    case CB_GGUF_BOOL:
        if (cb_gguf_get_bool(g, key, &b)) printf("%s", b ? "true" : "false");
        break;
    case CB_GGUF_STRING:
        if (cb_gguf_get_str(g, key, &s, &len)) print_str(s, len, 120);
        break;
    case CB_GGUF_ARRAY:
        if (cb_gguf_get_arr(g, key, &et, &len)) {
            printf("[%s x %zu]", cb_gguf_vtype_name(et), len);
            if (et == CB_GGUF_STRING && len > 0 && cb_gguf_arr_str(g, key, 0, &s, &len)) {
                printf(" first ");
                print_str(s, len, 40);
            }
        }
        break;
    default:
        if (cb_gguf_get_i64(g, key, &i64)) printf("%" PRId64, i64);
        else if (cb_gguf_get_u32(g, key, &u32)) printf("%" PRIu32, u32);
        break;
    }
}

int main(int argc, char **argv) {
    if (argc != 2 || argv[1][0] == '-') {
        fprintf(stderr, "usage: cb-gguf-dump FILE\n");
        return 2;
    }
    char err[512];
    cb_gguf_t *g = cb_gguf_open(argv[1], err, sizeof err);
    if (!g) {
        fprintf(stderr, "cb-gguf-dump: %s\n", err);
        return 1;
    }
    printf("version %u, alignment %zu, data at %zu, file size %zu\n", cb_gguf_version(g), cb_gguf_alignment(g),
           cb_gguf_data_offset(g), cb_gguf_file_size(g));
    printf("metadata: %zu keys\n", cb_gguf_n_kv(g));
    for (size_t i = 0; i < cb_gguf_n_kv(g); i++) {
        const char *key;
        cb_gguf_vtype_t t;
        cb_gguf_kv_info(g, i, &key, &t);
        printf("  %-40s %-6s ", key, cb_gguf_vtype_name(t));
        print_value(g, key, t);
        putchar('\n');
    }
    size_t n = cb_gguf_n_tensors(g);
    printf("tensors: %zu\n", n);
    size_t hist[64] = {0};
    size_t total_bytes = 0;
    for (size_t i = 0; i < n; i++) {
        const cb_gguf_tensor_t *t = cb_gguf_tensor(g, i);
        printf("  %-32s %-5s [", t->name, cb_type_name(t->type));
        for (uint32_t d = 0; d < t->n_dims; d++) printf("%s%" PRId64, d ? ", " : "", t->ne[d]);
        printf("] off %zu bytes %zu\n", cb_gguf_tensor_offset(g, i), t->nbytes);
        if (t->type < 64) hist[t->type]++;
        total_bytes += t->nbytes;
    }
    printf("types:");
    for (int k = 0; k < 64; k++)
        if (hist[k]) printf(" %s=%zu", cb_type_name((uint32_t)k), hist[k]);
    printf("\ntensor bytes: %zu\n", total_bytes);
    cb_gguf_destroy(&g);
    return 0;
}
