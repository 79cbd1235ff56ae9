/* fuzz_kvfile: libFuzzer target for the kv-file reader (cb_kvfile_open_mem + verify + read).
 *
 * Input: byte 0 selects the mode, the rest is the file. Mode bit 0 set: before opening, the fuzzer
 * recomputes the header checksum and (when the meta region fits) the meta checksum, so mutated header
 * fields get past the checksums and exercise the field validation behind them. Mode bit 1 selects an
 * expectation (SmolLM2-like geometry, zero fingerprints) instead of integrity-only opening.
 * Whatever the bytes, nothing may crash, leak or read out of bounds.
 */
#include "format/kvfile.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    uint8_t mode = data[0];
    size_t len = size - 1;
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) return 0;
    if (len) memcpy(buf, data + 1, len);
    if ((mode & 1) && len >= 256) {
        uint64_t meta_bytes;
        memcpy(&meta_bytes, buf + 144, 8);
        if (meta_bytes <= len - 256) {
            uint64_t ms = XXH3_64bits(buf + 256, (size_t)meta_bytes);
            memcpy(buf + 184, &ms, 8);
        }
        uint64_t hs = XXH3_64bits(buf, 248);
        memcpy(buf + 248, &hs, 8);
    }
    cb_kv_expect_t ex;
    memset(&ex, 0, sizeof ex);
    ex.n_layer = 30;
    ex.n_head_kv = 3;
    ex.head_dim = 64;
    cb_kv_miss_t why;
    char err[256];
    cb_kvfile_t *f = cb_kvfile_open_mem(buf, len, (mode & 2) ? &ex : NULL, &why, err, sizeof err);
    if (f) {
        const cb_kv_meta_t *m = cb_kvfile_meta(f);
        /* A valid file is at least as large as its payload, so these are bounded by the input size. */
        size_t n = (size_t)cb_kvfile_n_tokens(f) * (size_t)m->n_head_kv * (size_t)m->head_dim;
        float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
        if (k && v) {
            for (int l = 0; l < m->n_layer; l++) (void)cb_kvfile_read_layer(f, l, k, v);
            (void)cb_kvfile_verify(f);
        }
        free(k);
        free(v);
        cb_kvfile_destroy(&f);
    }
    free(buf);
    return 0;
}
