/* cb-kvbench: what each chunk KV file dtype costs: bytes per token, write time, and the time to open a
 * file, verify every layer's checksum and decode it to f32 (what the blend's loader does per chunk), with
 * the page cache warm; and the decode error against the f32 values written.
 *
 *   cb-kvbench [--tokens N] [--layers L] [--kv-heads H] [--head-dim D] [--reps R] [--dir DIR]
 *
 * Defaults: SmolLM2-135M's geometry (30 layers, 3 KV heads of 64) and a 512-token chunk; the values are
 * random normals scaled like real K/V (sigma 1, a few outliers), best of R repetitions.
 * Exit: 0 ok, 1 runtime error, 2 usage.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/alloc.h"
#include "format/kvfile.h"

static int usage(const char *why) {
    fprintf(stderr, "cb-kvbench: %s\nusage: cb-kvbench [--tokens N] [--layers L] [--kv-heads H] [--head-dim D] "
                    "[--reps R] [--dir DIR]\n", why);
    return 2;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double unif(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return ((double)(rng >> 11) + 0.5) / 9007199254740992.0;
}
static float normal(void) { return (float)(sqrt(-2.0 * log(unif())) * cos(6.283185307179586 * unif())); }

int main(int argc, char **argv) {
    long nt = 512, nl = 30, nh = 3, hd = 64, reps = 5;
    const char *dir = NULL;
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) return usage("an option without its value");
        char *end;
        long v = strtol(argv[i + 1], &end, 10);
        if (!strcmp(argv[i], "--dir")) { dir = argv[++i]; continue; }
        if (*end || v < 1 || v > 1 << 20) return usage("a value out of range");
        if (!strcmp(argv[i], "--tokens")) nt = v;
        else if (!strcmp(argv[i], "--layers")) nl = v;
        else if (!strcmp(argv[i], "--kv-heads")) nh = v;
        else if (!strcmp(argv[i], "--head-dim")) hd = v;
        else if (!strcmp(argv[i], "--reps")) reps = v;
        else return usage("unknown option");
        i++;
    }
    char tmp[] = "/tmp/cb-kvbench.XXXXXX";
    if (!dir && !(dir = mkdtemp(tmp))) return usage("cannot make a temporary directory");
    const size_t kvd = (size_t)(nh * hd), per = (size_t)nt * kvd, n = (size_t)nl * per;
    float *k = cb_malloc(n * sizeof(float)), *v = cb_malloc(n * sizeof(float)); /* [layers][tokens][kv_dim] */
    float *ok = cb_malloc(per * sizeof(float)), *ov = cb_malloc(per * sizeof(float));
    int32_t *tokens = cb_malloc(sizeof(int32_t) * (size_t)nt);
    if (!k || !v || !ok || !ov || !tokens) return 1;
    for (size_t i = 0; i < n; i++) {
        k[i] = normal() * (unif() < 0.01 ? 8.0f : 1.0f); /* a few outliers, as real K has */
        v[i] = normal();
    }
    for (long i = 0; i < nt; i++) tokens[i] = (int32_t)i;
    cb_kv_meta_t meta = {.n_layer = (int)nl, .n_head_kv = (int)nh, .head_dim = (int)hd};
    const cb_kv_dtype_t dts[] = {CB_KV_F32, CB_KV_F16, CB_KV_BF16, CB_KV_Q8_0};
    printf("chunk: %ld tokens, %ld layers x %ld kv heads x %ld; best of %ld (page cache warm)\n", nt, nl, nh, hd, reps);
    enum { ND = sizeof dts / sizeof dts[0] };
    double bpt[ND] = {0}, wms[ND] = {0}, rms_ms[ND] = {0}, rms[ND] = {0}, maxe[ND] = {0}, f16_bpt = 0;
    for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++) {
        meta.dtype = dts[d];
        if (!cb_kv_row_bytes(dts[d], kvd)) continue;
        uint8_t key[32];
        tokens[0] = (int32_t)d; /* one file (key) per dtype */
        cb_kvfile_key(meta.model_fp, meta.ctx_fp, tokens, (int)nt, key);
        char path[4200], err[256];
        if (cb_kvfile_path(dir, key, path, sizeof path)) return 1;
        double best_w = 1e30, best_r = 1e30, sq = 0, mx = 0;
        for (long r = 0; r < reps; r++) {
            unlink(path);
            double t0 = cb_now_ms();
            if (cb_kvfile_write(path, &meta, tokens, (int)nt, k, v, err, sizeof err)) {
                fprintf(stderr, "cb-kvbench: write: %s\n", err);
                return 1;
            }
            double t1 = cb_now_ms();
            cb_kv_miss_t why;
            cb_kvfile_t *f = cb_kvfile_open(path, NULL, &why, err, sizeof err);
            if (!f) {
                fprintf(stderr, "cb-kvbench: open: %s\n", err);
                return 1;
            }
            for (long l = 0; l < nl; l++)
                if (cb_kvfile_read_layer(f, (int)l, ok, ov) != CB_KV_OK) return 1;
            double t2 = cb_now_ms();
            if (r == 0)
                for (long l = 0; l < nl; l++) {
                    cb_kvfile_read_layer(f, (int)l, ok, ov);
                    for (size_t i = 0; i < per; i++) {
                        double e1 = fabs((double)ok[i] - k[l * per + i]), e2 = fabs((double)ov[i] - v[l * per + i]);
                        sq += e1 * e1 + e2 * e2;
                        mx = fmax(mx, fmax(e1, e2));
                    }
                }
            cb_kvfile_destroy(&f);
            best_w = fmin(best_w, t1 - t0);
            best_r = fmin(best_r, t2 - t1);
        }
        struct stat st;
        if (stat(path, &st)) return 1;
        bpt[d] = (double)st.st_size / (double)nt;
        if (dts[d] == CB_KV_F16) f16_bpt = bpt[d];
        wms[d] = best_w, rms_ms[d] = best_r, rms[d] = sqrt(sq / (2.0 * n)), maxe[d] = mx;
        unlink(path);
    }
    printf("%-6s %12s %8s %10s %12s %12s %12s\n", "dtype", "bytes/token", "vs f16", "write ms", "load ms", "rms err",
           "max err");
    for (size_t d = 0; d < ND; d++)
        if (bpt[d] > 0)
            printf("%-6s %12.0f %7.0f%% %10.2f %12.2f %12.3g %12.3g\n", cb_kv_dtype_name(dts[d]), bpt[d],
                   f16_bpt > 0 ? 100.0 * bpt[d] / f16_bpt : 0.0, wms[d], rms_ms[d], rms[d], maxe[d]);
    free(k), free(v), free(ok), free(ov), free(tokens);
    return 0;
}
