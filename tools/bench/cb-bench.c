/* cb-bench: engine throughput on synthetic prompts (our side of scripts/bench-engine.sh).
 *
 *   cb-bench [--model PATH] [--threads N] [--lens 512,2048,8000] [--decode N] [--reps R] [--batch B]
 *            [--batch-private] [--bandwidth] [--json]
 *   cb-bench --qdot [--reps R] [--json]
 *
 * For each prompt length L (ascending): prefill L pseudo-random token ids (the same ids the llama.cpp
 * side of the benchmark uses: id_i = (i * 7919) % 30000 + 100) at position 0 of one sequence (cleared
 * before each prefill) of an engine sized for the longest prompt; the best of R repetitions is reported. Decode: after a prompt of the first
 * length, N greedy steps. Peak RSS is the process's maximum resident set (getrusage), which includes
 * the model (its mapping), the backend's weight copies (interleaved, or f32 with CB_ENGINE_WEIGHTS=f32) and the
 * KV pool blocks the longest
 * prompt touched. --batch B (> 0): after
 * that, B sequences sharing the first prompt's blocks decode min(N, 64) greedy steps, once as one batch per
 * step (cb_engine_decode_batch) and once one sequence at a time, both reported as total tokens/s.
 * --batch-private: each of the B sequences gets its own copy of the prompt's KV (as B requests with
 * different documents would have) instead of sharing the blocks, so attention reads B times the KV.
 * --bandwidth: this machine's memory bandwidth (a STREAM-style triad a = b + s c over three 256 MB f32
 * arrays, the engine's thread count, best of 5; bytes counted as STREAM does, 12 per element) and the
 * bound it puts on decode: a step reads every block weight and the output matrix once (in the form the
 * kernels read: the interleaved copy where there is one) plus the sequence's KV (at the middle of the
 * decode), so bound = bandwidth / those bytes; decode is reported as a fraction of it.
 * --qdot (no model): the integer weight kernels alone, on one thread, for each weight type (Q4_0, Q4_1, Q5_0,
 * Q8_0, Q4_K, Q5_K, Q6_K) and each kernel set this CPU runs (avx2, avx512vnni, amx; cpu_quant.h): the product
 * of a 2048 x 2048 weight (random values quantized, in the interleaved copy prefill reads) with 64
 * activation rows, best of R (default 10), in G multiply-adds/s.
 * The KV pool is the engine's default, f16; CB_ENGINE_KV_DTYPE=f32 runs the f32 reference pool (the JSON
 * says which: "kv_dtype").
 * Exit: 0 ok, 1 runtime error, 2 bad arguments.
 */
#include <errno.h>
#include <jansson.h>
#include <stdint.h>
#include <omp.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "svc/svcconfig.h"
#include "base/clock.h"
#include "base/alloc.h"
#include "cpu/cpu_ops.h"
#include "cpu/cpu_quant.h"
#include "engine/engine.h"
#include "format/gguf.h"
#include "format/quant.h"
#include "base/log.h"
#include "model/model.h"
#include "engine/sampler.h"

static int usage(const char *why) {
    if (why) fprintf(stderr, "cb-bench: %s\n", why);
    fprintf(stderr, "usage: cb-bench [--model PATH] [--threads N] [--lens 512,2048,8000] [--decode N] [--reps R] "
                    "[--batch B] [--batch-private] [--bandwidth] [--json]\n"
                    "       cb-bench --qdot [--reps R] [--json]\n");
    return 2;
}

static bool parse_int(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!*s || *end || errno || v < lo || v > hi) return false;
    *out = v;
    return true;
}

/* B sequences over base's first n positions (shared blocks, or private copies of them) decode `steps`
 * greedy tokens: as one batch per step, then one sequence at a time; total tokens/s of each. 0, or 1 after a
 * message. */
static int bench_batch(cb_engine_t *e, cb_seq_t *base, const cb_model_t *m, const int32_t *tok, int n, int B,
                       bool private_kv, int steps, double *batch_tok_s, double *serial_tok_s) {
    const int V = cb_model_hparams(m)->n_vocab;
    cb_seq_t *seqs[64] = {0};
    int32_t t[64], pos[64];
    float *lg = cb_malloc(sizeof(float) * (size_t)B * V);
    int rc = 1;
    if (!lg) goto out;
    cb_seq_clear(base);
    if (cb_engine_prefill(e, base, tok, n, 0, lg) != CB_ENGINE_OK) goto out;
    const int32_t first = cb_argmax(lg, V);
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < B; i++) {
            if (!seqs[i] && !(seqs[i] = cb_seq_new(e))) goto out;
            if (cb_seq_share(seqs[i], base, n) != CB_ENGINE_OK) goto out;
            if (private_kv && cb_seq_reserve(seqs[i], 0, n) != CB_ENGINE_OK) goto out; /* copies the blocks */
            t[i] = first;
            pos[i] = n;
        }
        double t0 = cb_now_ms();
        for (int s = 0; s < steps; s++) {
            if (pass == 0) {
                int st = cb_engine_decode_batch(e, seqs, t, pos, B, lg);
                if (st != CB_ENGINE_OK) {
                    fprintf(stderr, "cb-bench: batched decode failed: %s\n", cb_engine_status_str(st));
                    goto out;
                }
            } else {
                for (int i = 0; i < B; i++) {
                    int st = cb_engine_decode(e, seqs[i], t[i], pos[i], lg + (size_t)i * V);
                    if (st != CB_ENGINE_OK) {
                        fprintf(stderr, "cb-bench: decode failed: %s\n", cb_engine_status_str(st));
                        goto out;
                    }
                }
            }
            for (int i = 0; i < B; i++) {
                t[i] = cb_argmax(lg + (size_t)i * V, V);
                pos[i]++;
            }
        }
        double tps = (double)B * steps / ((cb_now_ms() - t0) / 1e3);
        *(pass == 0 ? batch_tok_s : serial_tok_s) = tps;
    }
    rc = 0;
out:
    for (int i = 0; i < B; i++) cb_seq_destroy(&seqs[i]);
    free(lg);
    if (rc) fprintf(stderr, "cb-bench: the batch benchmark failed\n");
    return rc;
}

/* Bytes one decode step reads of w: its f32 copy, interleaved copy or stored rows, whichever the kernels
 * read. */
static size_t weight_bytes(const cb_weight_t *w) {
    if (w->f32) return sizeof(float) * (size_t)w->rows * (size_t)w->cols;
    if (w->v16) return cb_cpu_v16_bytes(w);
    if (w->x8) return cb_cpu_x8_bytes(w);
    return (size_t)w->rows * w->row_bytes;
}

static size_t decode_weight_bytes(const cb_model_t *m) {
    size_t b = weight_bytes(cb_model_output(m));
    for (int l = 0; l < cb_model_hparams(m)->n_layer; l++) {
        const cb_layer_weights_t *L = cb_model_layer(m, l);
        const cb_weight_t *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t k = 0; k < sizeof ws / sizeof ws[0]; k++) b += weight_bytes(ws[k]);
    }
    return b;
}

/* STREAM-style triad on `threads` threads: GB/s (12 bytes per element), best of 5; 0 when out of memory. */
static double triad_gbs(int threads) {
    const size_t n = (size_t)64 << 20; /* 256 MB per array: far past any cache */
    float *a = cb_aligned_alloc(64, n * sizeof(float)), *b = cb_aligned_alloc(64, n * sizeof(float));
    float *c = cb_aligned_alloc(64, n * sizeof(float));
    double best = 0.0;
    if (a && b && c) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (size_t i = 0; i < n; i++) a[i] = 0.0f, b[i] = 1.0f, c[i] = 2.0f; /* first touch by the same threads */
        for (int rep = 0; rep < 5; rep++) {
            const double t0 = cb_now_ms();
            #pragma omp parallel for num_threads(threads) schedule(static)
            for (size_t i = 0; i < n; i++) a[i] = b[i] + 3.0f * c[i];
            const double gbs = 12.0 * (double)n / ((cb_now_ms() - t0) * 1e6);
            best = gbs > best ? gbs : best;
        }
    }
    free(a);
    free(b);
    free(c);
    return best;
}

/* --qdot: each type's product of a 2048 x 2048 weight with 64 activation rows, by each kernel set this CPU
 * runs; one line (or a JSON object) per type. 0, or 1 out of memory. */
static int bench_qdot(long reps, bool json) {
    enum { O = 2048, C = 2048, N = 64 };
    static const uint32_t types[] = {CB_TYPE_Q4_0, CB_TYPE_Q4_1, CB_TYPE_Q5_0, CB_TYPE_Q8_0,
                                     CB_TYPE_Q4_K, CB_TYPE_Q5_K, CB_TYPE_Q6_K};
    static const char *const sets[] = {"avx2", "avx512vnni", "amx"};
    enum { N_SETS = 3 };
    const size_t rb = cb_cpu_q8_row_bytes(C), qbytes = cb_quant_row_bytes(CB_TYPE_Q8_0, (size_t)O * C);
    float *wf = cb_malloc(sizeof(float) * O * C), *y = cb_malloc(sizeof(float) * N * O); /* [O][C], [N][O] */
    uint8_t *xq = cb_aligned_alloc(64, rb * N), *q = cb_malloc(qbytes); /* [N][rb]; the stored rows (Q8_0: largest) */
    uint8_t *x8 = cb_aligned_alloc(64, (qbytes + (size_t)O / 8 * (C / 256) * 32 + 63) / 64 * 64);
    json_t *out = json_object();
    int rc = 1;
    if (!wf || !y || !xq || !q || !x8 || !out) goto done;
    uint64_t st = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < (size_t)O * C; i++) { /* uniform in [-1, 1) */
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        wf[i] = (float)((double)(st >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    }
    for (int r = 0; r < N; r++) cb_cpu_q8_quantize(wf + (size_t)r * C, C, CB_CPU_Q8_B32 | CB_CPU_Q8_K, xq + (size_t)r * rb);
    if (!json) printf("G multiply-adds/s, 1 thread, %d x %d weight x %d rows:%s%s%s\n", O, C, N, "  avx2", "  avx512vnni", "  amx");
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        cb_weight_t w = {.name = "qdot", .type = types[t], .q = q, .row_bytes = cb_quant_row_bytes(types[t], C),
                         .rows = O, .cols = C};
        if (!cb_quant(types[t], wf, q, (size_t)O * C) || !cb_cpu_x8_pack(&w, x8)) goto done;
        w.x8 = x8;
        json_t *row = json_object();
        if (!json) printf("  %-5s", cb_type_name(types[t]));
        for (int k = 0; k < N_SETS; k++) {
            if (cb_cpu_qdot_use(sets[k]) != 0) {
                if (!json) printf("  %*s", (int)strlen(sets[k]), "-");
                continue;
            }
            double best = 1e30;
            for (long i = 0; i < reps; i++) {
                const double t0 = cb_now_ms();
                cb_cpu_qdot_rows(&w, 0, O, xq, N, y, O);
                const double ms = cb_now_ms() - t0;
                best = ms < best ? ms : best;
            }
            const double g = (double)O * C * N / (best * 1e6);
            json_object_set_new(row, sets[k], json_real(g));
            if (!json) printf("  %*.1f", (int)strlen(sets[k]), g);
        }
        json_object_set_new(out, cb_type_name(types[t]), row);
        if (!json) printf("\n");
    }
    if (json) {
        json_t *doc = json_pack("{s:o}", "qdot", out);
        out = NULL;
        char *txt = doc ? json_dumps(doc, JSON_INDENT(2)) : NULL;
        if (txt) printf("%s\n", txt);
        free(txt);
        json_decref(doc);
    }
    rc = 0;
done:
    if (rc) fprintf(stderr, "cb-bench: out of memory\n");
    cb_cpu_qdot_use(NULL);
    json_decref(out);
    free(wf); free(y); free(xq); free(q); free(x8);
    return rc;
}

int main(int argc, char **argv) {
    cb_log_set_component("cb-bench");
    const char *model_path = cb_svc_model_path(NULL);
    long threads = 0, n_decode = 128, reps = 1, lens[16], n_lens = 0, batch = 0;
    bool json = false, batch_private = false, bandwidth = false, qdot = false, reps_set = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json")) { json = true; continue; }
        if (!strcmp(a, "--batch-private")) { batch_private = true; continue; }
        if (!strcmp(a, "--bandwidth")) { bandwidth = true; continue; }
        if (!strcmp(a, "--qdot")) { qdot = true; continue; }
        if (!v) return usage("missing value");
        if (!strcmp(a, "--model")) model_path = v;
        else if (!strcmp(a, "--threads")) { if (!parse_int(v, 1, 256, &threads)) return usage("bad --threads"); }
        else if (!strcmp(a, "--decode")) { if (!parse_int(v, 0, 100000, &n_decode)) return usage("bad --decode"); }
        else if (!strcmp(a, "--reps")) {
            if (!parse_int(v, 1, 100, &reps)) return usage("bad --reps");
            reps_set = true;
        }
        else if (!strcmp(a, "--batch")) { if (!parse_int(v, 0, 64, &batch)) return usage("bad --batch"); }
        else if (!strcmp(a, "--lens")) {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", v);
            n_lens = 0;
            for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
                if (n_lens == 16 || !parse_int(tok, 1, 1 << 20, &lens[n_lens])) return usage("bad --lens");
                if (n_lens && lens[n_lens] < lens[n_lens - 1]) return usage("--lens must be ascending");
                n_lens++;
            }
        } else return usage("unknown option");
        i++;
    }
    if (n_lens == 0) lens[0] = 512, lens[1] = 2048, lens[2] = 8000, n_lens = 3;
    if (qdot) return bench_qdot(reps_set ? reps : 10, json);

    char err[512];
    double t0 = cb_now_ms();
    cb_model_t *m = cb_model_load(model_path, err, sizeof err);
    if (!m) {
        fprintf(stderr, "cb-bench: %s\n", err);
        return 1;
    }
    const int V = cb_model_hparams(m)->n_vocab;
    long max_len = lens[n_lens - 1], ctx = max_len > lens[0] + n_decode ? max_len : lens[0] + n_decode;
    /* the default pool (two sequences of ctx), plus room for the batch's own blocks (f32 K/V: more than
     * enough where the backend stores less) */
    const cb_hparams_t *bhp = cb_model_hparams(m);
    const size_t per_pos = 2 * sizeof(float) * (size_t)bhp->n_layer * bhp->n_head_kv * bhp->head_dim;
    cb_engine_opts_t eo = {.max_ctx = (int)ctx};
    if (batch > 0)
        eo.kv_pool_bytes = per_pos * ((size_t)2 * ctx + (size_t)batch * ((batch_private ? lens[0] : 0) + 64 +
                                                                          2 * CB_ENGINE_BLOCK_TOKENS));
    cb_engine_t *e = cb_engine_new_opts(m, &eo, err, sizeof err);
    const double load_s = (cb_now_ms() - t0) / 1e3; /* the model and its weights as the backend reads them */
    cb_seq_t *seq = e ? cb_seq_new(e) : NULL;
    int32_t *tok = cb_malloc(sizeof(int32_t) * (size_t)ctx);
    float *lg = cb_malloc(sizeof(float) * (size_t)V);
    if (!e || !seq || !tok || !lg) {
        fprintf(stderr, "cb-bench: %s\n", e ? "out of memory" : err);
        return 1;
    }
    if (threads) cb_engine_set_threads(e, (int)threads);
    for (long i = 0; i < ctx; i++) tok[i] = (int32_t)((i * 7919) % 30000 + 100);

    json_t *out = json_object(), *pf = json_array();
    double decode_tok_s = 0.0;
    for (long li = 0; li < n_lens; li++) {
        double best = 1e30;
        for (long r = 0; r < reps; r++) {
            cb_seq_clear(seq); /* a fresh prompt each time: its blocks come from the pool again */
            t0 = cb_now_ms();
            int st = cb_engine_prefill(e, seq, tok, (int)lens[li], 0, lg);
            if (st != CB_ENGINE_OK) {
                fprintf(stderr, "cb-bench: prefill failed: %s\n", cb_engine_status_str(st));
                return 1;
            }
            double dt = (cb_now_ms() - t0) / 1e3;
            best = dt < best ? dt : best;
        }
        json_t *o = json_object();
        json_object_set_new(o, "n", json_integer(lens[li]));
        json_object_set_new(o, "ms", json_real(best * 1e3));
        json_object_set_new(o, "tok_s", json_real(lens[li] / best));
        json_array_append_new(pf, o);
        if (!json) printf("prefill %6ld tokens: %9.1f ms  %8.1f tok/s\n", lens[li], best * 1e3, lens[li] / best);
        if (li == 0 && n_decode > 0) {
            t0 = cb_now_ms();
            for (long s = 0; s < n_decode; s++) {
                int32_t t = cb_argmax(lg, V);
                int st = cb_engine_decode(e, seq, t, (int)(lens[0] + s), lg);
                if (st != CB_ENGINE_OK) {
                    fprintf(stderr, "cb-bench: decode failed: %s\n", cb_engine_status_str(st));
                    return 1;
                }
            }
            decode_tok_s = n_decode / ((cb_now_ms() - t0) / 1e3);
            if (!json) printf("decode  %6ld steps after %ld: %8.1f tok/s\n", n_decode, lens[0], decode_tok_s);
        }
    }
    double batch_tok_s = 0.0, serial_tok_s = 0.0;
    if (batch > 0 && bench_batch(e, seq, m, tok, (int)lens[0], (int)batch, batch_private,
                                 n_decode < 64 ? (int)n_decode : 64, &batch_tok_s, &serial_tok_s) != 0)
        return 1;
    if (batch > 0 && !json)
        printf("decode  %ld sequences x %ld steps%s: batched %.1f tok/s, one at a time %.1f tok/s (%.2fx)\n", batch,
               n_decode < 64 ? n_decode : 64, batch_private ? " (private KV)" : "", batch_tok_s, serial_tok_s,
               batch_tok_s / serial_tok_s);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru); /* before the triad's arrays */
    double rss_mb = ru.ru_maxrss / 1024.0;
    double bw_gbs = 0.0, bound_tok_s = 0.0, w_mb = 0.0, kv_mb = 0.0;
    if (bandwidth) {
        bw_gbs = triad_gbs(cb_engine_threads(e));
        const size_t kv_val = cb_engine_kv_dtype(e) == CB_ENGINE_KV_F32 ? 4 : 2;
        const double kv_pos = (double)lens[0] + (double)n_decode / 2; /* keys and values read per step */
        w_mb = (double)decode_weight_bytes(m) / 1e6;
        kv_mb = kv_pos * 2.0 * kv_val * bhp->n_layer * bhp->n_head_kv * bhp->head_dim / 1e6;
        bound_tok_s = bw_gbs * 1e3 / (w_mb + kv_mb);
        if (!json) {
            printf("bandwidth: triad %.1f GB/s on %d threads; a decode step reads %.0f MB of weights + %.1f MB of KV: "
                   "bound %.1f tok/s", bw_gbs, cb_engine_threads(e), w_mb, kv_mb, bound_tok_s);
            if (decode_tok_s > 0) printf(", decode at %.0f %% of it", 100.0 * decode_tok_s / bound_tok_s);
            printf("\n");
        }
    }
    /* what ran: bf16 or int16 blocks need the CPU backend on a CPU with AMX-BF16 or AVX512-VNNI */
    const char *attn_name = cb_cpu_attn_name(cb_engine_attn_math(cb_engine_attn(e)));
    if (json) {
        json_object_set_new(out, "engine", json_string("cacheblend"));
        json_object_set_new(out, "threads", json_integer(cb_engine_threads(e)));
        json_object_set_new(out, "kv_dtype", json_string(cb_engine_kv_dtype_name(cb_engine_kv_dtype(e))));
        json_object_set_new(out, "attn", json_string(attn_name));
        json_object_set_new(out, "load_ms", json_real(load_s * 1e3));
        json_object_set_new(out, "prefill", pf);
        json_object_set_new(out, "decode_steps", json_integer(n_decode));
        json_object_set_new(out, "decode_after", json_integer(lens[0]));
        json_object_set_new(out, "decode_tok_s", json_real(decode_tok_s));
        json_object_set_new(out, "peak_rss_mb", json_real(rss_mb));
        if (bandwidth) {
            json_object_set_new(out, "triad_gbs", json_real(bw_gbs));
            json_object_set_new(out, "decode_weight_mb", json_real(w_mb));
            json_object_set_new(out, "decode_kv_mb", json_real(kv_mb));
            json_object_set_new(out, "decode_bound_tok_s", json_real(bound_tok_s));
        }
        if (batch > 0) {
            json_object_set_new(out, "batch", json_integer(batch));
            json_object_set_new(out, "batch_private", json_boolean(batch_private));
            json_object_set_new(out, "batch_decode_tok_s", json_real(batch_tok_s));
            json_object_set_new(out, "serial_decode_tok_s", json_real(serial_tok_s));
        }
        char *s = json_dumps(out, JSON_COMPACT);
        puts(s);
        free(s);
    } else {
        json_decref(pf);
        printf("load %.0f ms, threads %d, KV pool %s, attention %s, peak RSS %.0f MB\n", load_s * 1e3,
               cb_engine_threads(e), cb_engine_kv_dtype_name(cb_engine_kv_dtype(e)), attn_name, rss_mb);
    }
    json_decref(out);
    free(tok);
    free(lg);
    cb_seq_destroy(&seq);
    cb_engine_destroy(&e);
    cb_model_destroy(&m);
    return 0;
}
