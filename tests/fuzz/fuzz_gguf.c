/* fuzz_gguf: libFuzzer target for the GGUF reader and the model loader. Opens the input with
 * cb_gguf_open_mem and walks every metadata value (all getters, every string-array element) and every
 * tensor, touching the first and last byte of each tensor's data so an out-of-bounds pointer shows up under
 * ASan; then loads the same bytes as a model (an in-memory file, /proc/self/fd), which runs the
 * architecture table, the hyperparameter, RoPE-scaling and window keys and every tensor check
 * (model/model.c, model/arch.h) on hostile metadata.
 * Seeds: tests/fuzz/corpus_gguf/ (small valid files of every synthetic architecture). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "format/gguf.h"
#include "model/model.h"

/* cb_model_load over the input's bytes, through an anonymous in-memory file. */
static void load_as_model(const uint8_t *data, size_t size) {
    int fd = memfd_create("fuzz_gguf", 0);
    if (fd < 0) return;
    if (write(fd, data, size) == (ssize_t)size) {
        char path[64], err[256];
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        cb_model_t *m = cb_model_load(path, err, sizeof err);
        if (!m && !memchr(err, 0, sizeof err)) __builtin_trap(); /* the message must be a terminated string */
        cb_model_destroy(&m);
    }
    close(fd);
}

static volatile uint64_t sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[256];
    cb_gguf_t *g = cb_gguf_open_mem(data, size, err, sizeof err);
    if (!g) {
        sink += strlen(err); /* the message must be a terminated string */
        return 0;
    }
    sink += cb_gguf_version(g) + cb_gguf_alignment(g);
    for (size_t i = 0; i < cb_gguf_n_kv(g); i++) {
        const char *key;
        cb_gguf_vtype_t t;
        if (!cb_gguf_kv_info(g, i, &key, &t)) __builtin_trap();
        if (!cb_gguf_has(g, key)) __builtin_trap();
        uint32_t u; int64_t v; float f; bool b; const char *s; size_t len, count;
        cb_gguf_vtype_t et;
        if (cb_gguf_get_u32(g, key, &u)) sink += u;
        if (cb_gguf_get_i64(g, key, &v)) sink += (uint64_t)v;
        if (cb_gguf_get_f32(g, key, &f)) sink += (uint64_t)(f == f);
        if (cb_gguf_get_bool(g, key, &b)) sink += b;
        if (cb_gguf_get_str(g, key, &s, &len) && len) sink += (uint8_t)s[0] + (uint8_t)s[len - 1];
        if (cb_gguf_get_arr(g, key, &et, &count)) {
            if (et == CB_GGUF_STRING) {
                for (size_t k = 0; k < count; k++) {
                    if (!cb_gguf_arr_str(g, key, k, &s, &len)) __builtin_trap();
                    if (len) sink += (uint8_t)s[0] + (uint8_t)s[len - 1];
                }
                if (cb_gguf_arr_str(g, key, count, &s, &len)) __builtin_trap();
            } else {
                const uint8_t *p = cb_gguf_arr_data(g, key);
                size_t esz = et == CB_GGUF_U8 || et == CB_GGUF_I8 || et == CB_GGUF_BOOL ? 1
                           : et == CB_GGUF_U16 || et == CB_GGUF_I16 ? 2
                           : et == CB_GGUF_U64 || et == CB_GGUF_I64 || et == CB_GGUF_F64 ? 8 : 4;
                if (!p) __builtin_trap();
                if (count) sink += p[0] + p[count * esz - 1];
            }
        }
    }
    for (size_t i = 0; i < cb_gguf_n_tensors(g); i++) {
        const cb_gguf_tensor_t *t = cb_gguf_tensor(g, i);
        if (!t || cb_gguf_find_tensor(g, t->name) != t) __builtin_trap();
        if (t->n_dims < 1 || t->n_dims > 4 || cb_type_block_elems(t->type) == 0) __builtin_trap();
        const uint8_t *d = t->data;
        if (d < data || d + t->nbytes > data + size) __builtin_trap();
        if (t->nbytes) sink += d[0] + d[t->nbytes - 1];
        sink += cb_gguf_tensor_offset(g, i);
    }
    cb_gguf_destroy(&g);
    load_as_model(data, size);
    return 0;
}
