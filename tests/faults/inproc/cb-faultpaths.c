/* cb-faultpaths: every failing call inside the process, one at a time (make test-faults; docs/reliability.md).
 *
 * Built from the fault build of libshared (-DCB_FAULT_INJECT, ASan + UBSan), where every allocation of libshared
 * and the services (base/alloc.h), every read, write, fsync, rename and map of the KV files and the config
 * (base/sysio.h), and SQLite's allocations and file calls (vfs.h) are failure points (base/fault.h).
 *
 * For each path (load a model, tokenize, decode and encode every message type, write and read a KV file, ingest
 * a document through the job table, serve one blend query, load the config) and each kind of failure
 * (allocation; I/O with ENOSPC; I/O with EIO), the driver runs the path once without a fault to learn its
 * result (a digest of what it produced), then for N = 1, 2, ... in a fresh child process and a fresh work
 * directory: the Nth call of that kind fails; the path must return a clean error (or succeed with the same
 * result: a failure it could absorb); the files it left must be whole (a KV file under its final name opens and
 * verifies; the job database passes SQLite's integrity check); the same path run again in the same directory
 * without a fault must succeed with the same result; and LeakSanitizer must find nothing. N stops at the first
 * run in which the Nth call never came (the path needs fewer calls). A crash (a signal, or a sanitizer report,
 * which exits the child) is counted as such. The summary is one line per path and kind.
 *
 * Usage: cb-faultpaths [--paths a,b,...] [--kinds alloc,enospc,eio] [--from N] [--max N] [-v] --vocab-dir DIR
 *        --corpus DIR [--work DIR]
 * Exit 0 when every failure point passed, 1 otherwise, 2 on a usage or setup error.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <sqlite3.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include "base/alloc.h"
#include "base/fault.h"
#include "blend/blend.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "format/gguf.h"
#include "format/kvfile.h"
#include "kv/kvstore.h"
#include "model/model.h"
#include "model/synth.h"
#include "model/tokenizer.h"
#include "rag/chunker.h"
#include "rag/ragprompt.h"
#include "wire/config.h"
#include "wire/msg.h"

#include "jobs.h"
#include "vfs.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#define HAVE_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#include <sanitizer/lsan_interface.h>
#define HAVE_LSAN 1
#endif
#endif

#define DIGEST_HEX 17 /* 16 hex digits of an XXH64 + NUL */

/* What a run of a path produced: a digest of its result. */
typedef struct {
    XXH64_state_t *h;
} digest_t;

static void dg_bytes(digest_t *d, const void *p, size_t n) { XXH64_update(d->h, p, n); }
static void dg_int(digest_t *d, int64_t v) { dg_bytes(d, &v, sizeof v); }
static void dg_str(digest_t *d, const char *s) { dg_bytes(d, s, strlen(s) + 1); }

/* ---- inputs the parent prepares once (read-only in the children) -------------------------------------------- */

static struct {
    char work[256];          /* the driver's scratch root */
    char vocab_dir[256];     /* models/vocab: vocabulary-only GGUFs of the real tokenizers */
    char corpus_dir[256];    /* tests/fuzz/corpus_msg: every message type, as the real writer encodes it */
    char synth_path[300];    /* a small synthetic model (llama, Q4_1, with a GPT-2 vocabulary and ChatML) */
    char config_path[300];   /* a config file */
    struct {
        char name[128];
        uint8_t *data;       /* [len], read once by load_corpus */
        size_t len;
    } msgs[128];             /* the corpus's *.msg files, sorted by name (a fixed order of calls) */
    int n_msgs;
} g;

/* ---- paths -------------------------------------------------------------------------------------------------- */

/* A path: runs in dir (exists, may hold what an earlier attempt left), adds its result to d; 0, or -1 with err. */
typedef int (*path_fn)(const char *dir, digest_t *d, char *err, size_t errlen);
/* Whether what a failed attempt left in dir is whole: 0, or -1 with err naming the torn file. */
typedef int (*check_fn)(const char *dir, char *err, size_t errlen);

/* config: the config file of a service, read and typed. */
static int path_config(const char *dir, digest_t *d, char *err, size_t errlen) {
    (void)dir;
    cb_config_t *cfg = cb_config_load(g.config_path, "precompute", err, errlen);
    if (!cfg) return -1;
    const char *kv = NULL, *ep = NULL;
    int64_t n = 0;
    int rc = -1;
    if (cb_config_str(cfg, "precompute", "kv_dir", "var/kv", &kv, err, errlen) &&
        cb_config_str(cfg, "precompute", "endpoint", "tcp://127.0.0.1:5556", &ep, err, errlen) &&
        cb_config_int(cfg, "precompute", "max_queued_jobs", 0, 1 << 30, 1, &n, err, errlen)) {
        dg_str(d, kv);
        dg_str(d, ep);
        dg_int(d, n);
        rc = 0;
    }
    cb_config_destroy(&cfg);
    return rc;
}

/* msg: every message of the fuzzing corpus (every request and reply type, and malformed seeds) decoded, turned
 * into JSON and encoded again: the same bytes; a malformed seed refused with its reason. */
static int path_msg(const char *dir, digest_t *d, char *err, size_t errlen) {
    (void)dir;
    cb_msg_writer_t *w = cb_msg_writer_new();
    if (!w) {
        snprintf(err, errlen, "writer: out of memory");
        return -1;
    }
    int rc = 0;
    for (int i = 0; i < g.n_msgs && rc == 0; i++) {
        const char *const name = g.msgs[i].name;
        const uint8_t *const buf = g.msgs[i].data;
        const size_t len = g.msgs[i].len;
        cb_msg_error_t me;
        cb_msg_t *m = cb_msg_decode_ex(buf, len, CB_MSG_DEFAULT_MAX_BYTES, &me);
        const bool malformed = !strncmp(name, "raw_", 4); /* the corpus's invalid seeds */
        if (!m && me.code != CB_ERR_INTERNAL) {
            dg_str(d, name); /* refused, as it must be */
            dg_str(d, me.message);
            continue;
        }
        if (!m) {
            snprintf(err, errlen, "%s: decode: %s", name, me.message);
            rc = -1;
            break;
        }
        json_t *js = cb_msg_to_json(m);
        if (!js) {
            snprintf(err, errlen, "%s: to json: out of memory", name);
            rc = -1;
        } else {
            cb_msg_begin_bare(w);
            const char *k;
            json_t *v;
            json_object_foreach(js, k, v) cb_msg_put_json(w, k, v);
            size_t out_len = 0;
            const void *out = cb_msg_end(w, &out_len);
            if (!out) {
                snprintf(err, errlen, "%s: encode: %s", name, cb_msg_writer_error(w));
                rc = -1;
            } else if (!malformed && (out_len != len || memcmp(out, buf, len) != 0)) {
                snprintf(err, errlen, "%s: encoded again, the bytes differ", name);
                rc = -1;
            } else {
                dg_str(d, name);
                dg_bytes(d, out, out_len);
            }
            json_decref(js);
        }
        cb_msg_destroy(&m);
    }
    cb_msg_writer_destroy(&w);
    return rc;
}

/* Edge-case texts for the tokenizers. */
static const char *const TEXTS[] = {
    "Hello world",
    "  leading spaces\tand\ttabs\n\nnewlines\r\n",
    "digits 1234567890 and 3.14159",
    "CJK 東京都 and emoji 🙂👍🏽",
    "<|im_start|>user\nnot a special token<|im_end|>",
    "invalid \xff\xfe utf-8 \xc3",
    "The lighthouse at Brisket Station was built in 1871 by the Kettleby company.",
};

/* tokenize: the real vocabularies (GPT-2 BPE of SmolLM2 and SentencePiece of Gemma 3): encode, decode. */
static int path_tokenize(const char *dir, digest_t *d, char *err, size_t errlen) {
    (void)dir;
    static const char *const vocabs[] = {"smollm2.gguf", "gemma3.gguf"};
    for (size_t v = 0; v < sizeof vocabs / sizeof vocabs[0]; v++) {
        char path[512], e2[256] = "";
        snprintf(path, sizeof path, "%s/%s", g.vocab_dir, vocabs[v]);
        cb_gguf_t *gg = cb_gguf_open(path, e2, sizeof e2);
        cb_tokenizer_t *tok = gg ? cb_tokenizer_new_from_gguf(gg, e2, sizeof e2) : NULL;
        int rc = tok ? 0 : -1;
        if (!tok) snprintf(err, errlen, "%s: %s", vocabs[v], e2);
        for (size_t i = 0; rc == 0 && i < sizeof TEXTS / sizeof TEXTS[0]; i++) {
            int n = 0;
            int32_t *ids = cb_tokenizer_encode_alloc(tok, TEXTS[i], strlen(TEXTS[i]), false, &n);
            size_t len = 0;
            char *text = ids ? cb_tokenizer_decode_alloc(tok, ids, (size_t)n, false, &len) : NULL;
            if (!text) {
                snprintf(err, errlen, "%s: text %zu: %s failed", vocabs[v], i, ids ? "decode" : "encode");
                rc = -1;
            } else {
                dg_bytes(d, ids, (size_t)n * sizeof *ids);
                dg_bytes(d, text, len);
            }
            free(text);
            free(ids);
        }
        cb_tokenizer_destroy(&tok);
        cb_gguf_destroy(&gg);
        if (rc) return -1;
    }
    return 0;
}

/* model: the synthetic model loaded; its geometry and fingerprint. */
static int path_model(const char *dir, digest_t *d, char *err, size_t errlen) {
    (void)dir;
    cb_model_t *m = cb_model_load(g.synth_path, err, errlen);
    if (!m) return -1;
    const cb_hparams_t *hp = cb_model_hparams(m);
    uint8_t fp[32];
    cb_model_fingerprint(m, fp);
    dg_int(d, hp->n_layer);
    dg_int(d, hp->n_embd);
    dg_int(d, hp->n_vocab);
    dg_bytes(d, fp, sizeof fp);
    cb_model_destroy(&m);
    return 0;
}

/* kvfile: a chunk's KV written (temp file, fsync, rename, fsync of the directory) and read back. */
enum { KVF_LAYERS = 3, KVF_HEADS = 2, KVF_HD = 32, KVF_TOKENS = 24, KVF_DIM = KVF_HEADS * KVF_HD };

static int path_kvfile(const char *dir, digest_t *d, char *err, size_t errlen) {
    cb_kv_meta_t meta = {.n_layer = KVF_LAYERS, .n_head_kv = KVF_HEADS, .head_dim = KVF_HD, .dtype = CB_KV_F16};
    memset(meta.model_fp, 0x5a, sizeof meta.model_fp);
    memset(meta.ctx_fp, 0xa5, sizeof meta.ctx_fp);
    int32_t tokens[KVF_TOKENS];
    for (int i = 0; i < KVF_TOKENS; i++) tokens[i] = 100 + 7 * i;
    static float k[KVF_LAYERS * KVF_TOKENS * KVF_DIM], v[KVF_LAYERS * KVF_TOKENS * KVF_DIM];
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        k[i] = (float)((int)(i % 97) - 48) / 16.0f;
        v[i] = (float)((int)(i % 89) - 44) / 32.0f;
    }
    uint8_t key[32];
    cb_kvfile_key(meta.model_fp, meta.ctx_fp, tokens, KVF_TOKENS, key);
    char path[512];
    if (cb_kvfile_path(dir, key, path, sizeof path) != 0) {
        snprintf(err, errlen, "path too long");
        return -1;
    }
    if (cb_kvfile_write(path, &meta, tokens, KVF_TOKENS, k, v, err, errlen) != 0) return -1;
    cb_kv_expect_t ex = {.n_layer = KVF_LAYERS, .n_head_kv = KVF_HEADS, .head_dim = KVF_HD, .tokens = tokens,
                         .n_tokens = KVF_TOKENS};
    memcpy(ex.model_fp, meta.model_fp, 32);
    memcpy(ex.ctx_fp, meta.ctx_fp, 32);
    cb_kv_miss_t why;
    cb_kvfile_t *f = cb_kvfile_open(path, &ex, &why, err, errlen);
    if (!f) return -1;
    int rc = 0;
    if ((why = cb_kvfile_verify(f)) != CB_KV_OK) {
        snprintf(err, errlen, "verify: %s", cb_kv_miss_str(why));
        rc = -1;
    }
    static float ko[KVF_TOKENS * KVF_DIM], vo[KVF_TOKENS * KVF_DIM];
    for (int l = 0; rc == 0 && l < KVF_LAYERS; l++) {
        if ((why = cb_kvfile_read_layer(f, l, ko, vo)) != CB_KV_OK) {
            snprintf(err, errlen, "layer %d: %s", l, cb_kv_miss_str(why));
            rc = -1;
        } else {
            dg_bytes(d, ko, sizeof ko);
            dg_bytes(d, vo, sizeof vo);
        }
    }
    cb_kvfile_destroy(&f);
    return rc;
}

/* Every "*.kv" file under dir (and one level of shards) opens and verifies. */
static int check_kv_dir(const char *dir, char *err, size_t errlen) {
    DIR *dp = opendir(dir);
    if (!dp) return 0;
    struct dirent *e;
    int rc = 0;
    while (rc == 0 && (e = readdir(dp))) {
        if (e->d_name[0] == '.') continue;
        char p[1024];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (lstat(p, &st) != 0) continue;
        if (S_ISDIR(st.st_mode)) {
            rc = check_kv_dir(p, err, errlen);
            continue;
        }
        size_t len = strlen(e->d_name);
        if (len < 3 || strcmp(e->d_name + len - 3, ".kv") != 0) continue; /* temporaries: swept at start */
        cb_kv_miss_t why;
        char e2[256] = "";
        cb_kvfile_t *f = cb_kvfile_open(p, NULL, &why, e2, sizeof e2);
        if (f && (why = cb_kvfile_verify(f)) != CB_KV_OK) snprintf(e2, sizeof e2, "%s", cb_kv_miss_str(why));
        if (!f || why != CB_KV_OK) {
            snprintf(err, errlen, "torn KV file %s: %s", p, e2);
            rc = -1;
        }
        cb_kvfile_destroy(&f);
    }
    closedir(dp);
    return rc;
}

/* ingest: a document through the job table (submit, pick, chunk, plan, each chunk done, finish), as
 * cb-precompute's worker records it. */
static const char DOC[] =
    "The lighthouse at Brisket Station was built in 1871.\n\nIts keeper, Ada Kettleby, kept a log of every ship.\n\n"
    "The supply ship Marrow came every second Tuesday, weather permitting, with coal, flour and letters.\n\n"
    "In 1903 the light was electrified; the old lens went to the museum at Harwick.";

static int path_ingest(const char *dir, digest_t *d, char *err, size_t errlen) {
    char db[512];
    snprintf(db, sizeof db, "%s/jobs.db", dir);
    cb_gguf_t *gg = cb_gguf_open(g.synth_path, err, errlen); /* its small GPT-2 vocabulary measures the chunks */
    cb_tokenizer_t *tok = gg ? cb_tokenizer_new_from_gguf(gg, err, errlen) : NULL;
    cb_chunker_t *ch = tok ? cb_chunker_new(tok, 32, err, errlen) : NULL;
    cb_jobs_t *jobs = ch ? cb_jobs_open(db, err, errlen) : NULL;
    cb_chunk_span_t *spans = NULL;
    cb_job_chunk_t *plan = NULL;
    cb_job_t *job = NULL;
    int rc = -1, n = 0;
    if (!jobs) goto out;
    char id[CB_JOB_ID_LEN + 1], client[CB_JOB_CLIENT_MAX + 1];
    bool dup = false;
    cb_job_state_t state;
    cb_jobs_limits_t lim = {.max_jobs = 10, .max_bytes = 1 << 20, .max_total_jobs = 100, .max_total_bytes = 1 << 24};
    if (cb_jobs_submit(jobs, "doc-1", 5, DOC, sizeof DOC - 1, "{\"src\":\"faults\"}", "k:client", &lim, id, &dup,
                       &state, err, errlen) != 0)
        goto out;
    /* the worker's side; a job a failed attempt left running or done is picked up where it is */
    cb_job_status_t st;
    int r = cb_jobs_status(jobs, id, &st, err, errlen);
    if (r != 1) {
        if (r == 0) snprintf(err, errlen, "submitted job %s not found", id);
        goto out;
    }
    if (st.state != CB_JOB_DONE) {
        char picked[CB_JOB_ID_LEN + 1];
        r = cb_jobs_pick(jobs, NULL, picked, client, err, errlen);
        if (r != 1 || strcmp(picked, id) != 0) {
            if (r == 0 || r == 1) snprintf(err, errlen, "pick: %s", r ? "another job" : "nothing to do");
            goto out;
        }
        if (cb_jobs_get(jobs, id, &job, err, errlen) != 1) goto out;
        if (!job->planned) {
            if (cb_chunker_split(ch, job->text, job->text_len, &spans, &n, err, errlen) != 0) goto out;
            plan = cb_calloc((size_t)(n ? n : 1), sizeof *plan);
            if (!plan) {
                snprintf(err, errlen, "out of memory");
                goto out;
            }
            for (int i = 0; i < n; i++) {
                plan[i].off = (int64_t)spans[i].off;
                plan[i].len = (int64_t)spans[i].len;
                plan[i].n_tokens = spans[i].n_tokens;
                snprintf(plan[i].key, sizeof plan[i].key, "%064x", i + 1);
            }
            if (cb_jobs_plan(jobs, id, plan, n, err, errlen) != 0) goto out;
        }
        int idx;
        cb_job_chunk_t c;
        while ((r = cb_jobs_next_chunk(jobs, id, &idx, &c, err, errlen)) == 1)
            if (cb_jobs_chunk_done(jobs, id, idx, err, errlen) != 0) goto out;
        if (r != 0 || cb_jobs_finish(jobs, id, true, NULL, err, errlen) != 0) goto out;
        if (cb_jobs_status(jobs, id, &st, err, errlen) != 1) goto out;
    }
    cb_job_chunk_t *chunks = NULL;
    int nc = 0;
    if (cb_jobs_chunks(jobs, id, &chunks, &nc, err, errlen) != 0) goto out;
    dg_str(d, id);
    dg_int(d, st.state);
    dg_int(d, st.chunks_done);
    dg_int(d, st.chunks_total);
    for (int i = 0; i < nc; i++) {
        dg_int(d, chunks[i].off);
        dg_int(d, chunks[i].len);
        dg_int(d, chunks[i].n_tokens);
        dg_int(d, chunks[i].done);
    }
    free(chunks);
    rc = 0;
out:
    cb_job_free(&job);
    free(plan);
    free(spans);
    cb_jobs_close(&jobs);
    cb_chunker_destroy(&ch);
    cb_tokenizer_destroy(&tok);
    cb_gguf_destroy(&gg);
    return rc;
}

/* The job database opens and passes SQLite's integrity check. */
static int check_jobs_db(const char *dir, char *err, size_t errlen) {
    char db[512];
    snprintf(db, sizeof db, "%s/jobs.db", dir);
    if (access(db, F_OK) != 0) return 0;
    sqlite3 *h = NULL;
    int rc = -1;
    sqlite3_stmt *st = NULL;
    if (sqlite3_open_v2(db, &h, SQLITE_OPEN_READWRITE, NULL) == SQLITE_OK &&
        sqlite3_prepare_v2(h, "PRAGMA integrity_check", -1, &st, NULL) == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW) {
        const char *res = (const char *)sqlite3_column_text(st, 0);
        if (res && !strcmp(res, "ok")) rc = 0;
        else snprintf(err, errlen, "job database %s: integrity check: %s", db, res ? res : "(null)");
    } else {
        snprintf(err, errlen, "job database %s: %s", db, h ? sqlite3_errmsg(h) : "cannot open");
    }
    sqlite3_finalize(st);
    sqlite3_close(h);
    return rc;
}

/* query: one RAG request served in-process the way cb-blend serves it: the model and its tokenizer, the prompt
 * pieces (ragprompt), an engine, a store over a KV directory (chunk files computed and written when absent),
 * the fused prefill (blend mode) and four greedy tokens, decoded to text. */
static const char *const CONTEXTS[] = {
    "The lighthouse at Brisket Station was built in 1871.",
    "The supply ship Marrow comes every second Tuesday.",
    "Ada Kettleby kept the light for forty years.",
};

static int path_query(const char *dir, digest_t *d, char *err, size_t errlen) {
    enum { N_CTX = 3, N_NEW = 4 };
    cb_model_t *m = cb_model_load(g.synth_path, err, errlen);
    /* the synthetic vocabulary's template is ChatML with another system line: named, as engine.chat_template does */
    cb_tokenizer_t *tok = m ? cb_tokenizer_new_from_gguf_opts(cb_model_gguf(m), "chatml", err, errlen) : NULL;
    cb_ragprompt_t *rp = tok ? cb_ragprompt_new(tok, NULL, err, errlen) : NULL;
    cb_engine_opts_t eo = {.max_ctx = 512, .kv_pool_seqs = 2, .kv_dtype = CB_ENGINE_KV_F32, .attn = CB_ENGINE_ATTN_F32};
    cb_engine_t *eng = rp ? cb_engine_new_opts(m, &eo, err, errlen) : NULL;
    cb_kvstore_t *store = eng ? cb_kvstore_new(eng, dir, NULL, CB_KV_F16, err, errlen) : NULL;
    cb_blend_t *b = store ? cb_blend_new(store, err, errlen) : NULL;
    cb_seq_t *seq = b ? cb_seq_new(eng) : NULL;
    int32_t *chunk_tok[N_CTX] = {0}, *suffix = NULL;
    float *logits = NULL;
    char *text = NULL;
    int rc = -1;
    if (b && !seq) snprintf(err, errlen, "sequence: out of memory");
    if (!seq) goto out;
    cb_engine_set_threads(eng, 1);
    int np = 0, ns = 0;
    const int32_t *prefix = cb_ragprompt_prefix(rp, &np);
    cb_blend_chunk_t ch[N_CTX];
    for (int i = 0; i < N_CTX; i++) {
        if (!(chunk_tok[i] = cb_ragprompt_chunk(rp, CONTEXTS[i], strlen(CONTEXTS[i]), &ch[i].n))) {
            snprintf(err, errlen, "chunk %d: tokenizer failure or out of memory", i);
            goto out;
        }
        ch[i].tokens = chunk_tok[i];
        /* precompute, as cb-precompute does at ingest: the chunk's file, read back by the blend below */
        if (cb_kvstore_ensure(store, prefix, np, ch[i].tokens, ch[i].n, NULL, NULL, err, errlen) != 0) goto out;
    }
    if (!(suffix = cb_ragprompt_suffix(rp, "Who kept the light?", &ns))) {
        snprintf(err, errlen, "suffix: tokenizer failure or out of memory");
        goto out;
    }
    const int V = cb_model_hparams(m)->n_vocab;
    if (!(logits = cb_malloc(sizeof(float) * (size_t)V))) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    cb_blend_opts_t o;
    cb_blend_opts_default(&o);
    o.mode = CB_BLEND_BLEND;
    o.no_overlap = true; /* one thread: the failure points come in a fixed order */
    cb_blend_stats_t bs;
    if (cb_blend_prefill(b, seq, prefix, np, ch, N_CTX, suffix, ns, &o, logits, &bs, err, errlen) != CB_ENGINE_OK)
        goto out;
    int pos = np + ns;
    for (int i = 0; i < N_CTX; i++) pos += ch[i].n;
    int32_t out_tok[N_NEW];
    for (int t = 0; t < N_NEW; t++) {
        out_tok[t] = cb_argmax(logits, V);
        if (t + 1 < N_NEW && cb_engine_decode(eng, seq, out_tok[t], pos++, logits) != CB_ENGINE_OK) {
            snprintf(err, errlen, "decode step %d failed", t);
            goto out;
        }
    }
    size_t len = 0;
    if (!(text = cb_tokenizer_decode_alloc(tok, out_tok, N_NEW, false, &len))) {
        snprintf(err, errlen, "detokenize: out of memory");
        goto out;
    }
    dg_bytes(d, out_tok, sizeof out_tok);
    dg_bytes(d, text, len);
    rc = 0;
out:
    free(text);
    free(logits);
    free(suffix);
    for (int i = 0; i < N_CTX; i++) free(chunk_tok[i]);
    cb_seq_destroy(&seq);
    cb_blend_destroy(&b);
    cb_kvstore_destroy(&store);
    cb_engine_destroy(&eng);
    cb_ragprompt_destroy(&rp);
    cb_tokenizer_destroy(&tok);
    cb_model_destroy(&m);
    return rc;
}

static const struct {
    const char *name;
    path_fn run;
    check_fn check;
} PATHS[] = {
    {"config", path_config, NULL},
    {"msg", path_msg, NULL},
    {"tokenize", path_tokenize, NULL},
    {"model", path_model, NULL},
    {"kvfile", path_kvfile, check_kv_dir},
    {"ingest", path_ingest, check_jobs_db},
    {"query", path_query, check_kv_dir},
};
#define N_PATHS ((int)(sizeof PATHS / sizeof PATHS[0]))

static const struct {
    const char *name;
    cb_fault_kind_t kind;
    int err;
} KINDS[] = {{"alloc", CB_FAULT_ALLOC, 0}, {"enospc", CB_FAULT_IO, ENOSPC}, {"eio", CB_FAULT_IO, EIO}};
#define N_KINDS ((int)(sizeof KINDS / sizeof KINDS[0]))

/* ---- one failure point, in a child ------------------------------------------------------------------------- */

/* What a child reports through its pipe. */
typedef struct {
    int fired;         /* the armed call came */
    int rc;            /* the faulted attempt's return */
    int same;          /* its digest equals the reference (when rc == 0) */
    int torn;          /* a file it left is not whole */
    int retry_rc;      /* the attempt after, without a fault */
    int retry_same;
    int leaks;         /* LeakSanitizer found leaks */
    uint64_t calls;    /* calls of the kind in the faulted attempt */
    uint64_t io_calls; /* I/O calls in it */
    uint64_t digest;   /* of the attempt without a fault (the reference run: N = 0) */
    char msg[320];     /* the faulted attempt's error, or what failed */
} report_t;

static int run_once(int p, const char *dir, uint64_t *digest, char *err, size_t errlen) {
    digest_t d = {XXH64_createState()};
    if (!d.h) {
        snprintf(err, errlen, "digest: out of memory");
        return -1;
    }
    XXH64_reset(d.h, 0);
    int rc = PATHS[p].run(dir, &d, err, errlen);
    *digest = XXH64_digest(d.h);
    XXH64_freeState(d.h);
    return rc;
}

static void child(int p, int k, uint64_t nth, uint64_t ref, const char *dir, int fd) {
    report_t r;
    memset(&r, 0, sizeof r);
    char err[320] = "";
    uint64_t dg = 0;
    cb_fault_arm(KINDS[k].kind, nth, KINDS[k].err); /* nth 0: no failure, the counts restart */
    r.rc = run_once(p, dir, &dg, err, sizeof err);
    r.fired = nth > 0 && cb_fault_fired();
    r.calls = cb_fault_calls(KINDS[k].kind);
    r.io_calls = cb_fault_calls(CB_FAULT_IO);
    cb_fault_disarm();
    r.same = r.rc == 0 && dg == ref;
    r.digest = dg;
    snprintf(r.msg, sizeof r.msg, "%s", err);
    if (nth > 0) {
        char e2[320] = "";
        if (PATHS[p].check && PATHS[p].check(dir, e2, sizeof e2) != 0) {
            r.torn = 1;
            snprintf(r.msg, sizeof r.msg, "%s", e2);
        }
        uint64_t dg2 = 0;
        e2[0] = 0;
        r.retry_rc = run_once(p, dir, &dg2, e2, sizeof e2);
        r.retry_same = r.retry_rc == 0 && dg2 == ref;
        if (r.retry_rc != 0) snprintf(r.msg, sizeof r.msg, "retry: %.300s", e2);
    }
#ifdef HAVE_LSAN
    r.leaks = __lsan_do_recoverable_leak_check() != 0;
#endif
    ssize_t w = write(fd, &r, sizeof r);
    _exit(w == (ssize_t)sizeof r ? 0 : 3);
}

/* Runs one point in a child; 0 with *r filled, or -1 when the child died without a report (a crash). */
static int point(int p, int k, uint64_t nth, uint64_t ref, report_t *r, int *status) {
    char dir[400];
    snprintf(dir, sizeof dir, "%.300s/%s-%s-%llu", g.work, PATHS[p].name, KINDS[k].name, (unsigned long long)nth);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%.400s'", dir);
    if (system(cmd) != 0 || mkdir(dir, 0755) != 0) {
        snprintf(r->msg, sizeof r->msg, "cannot make %.200s", dir);
        return -1;
    }
    int fds[2];
    if (pipe(fds) != 0) return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        close(fds[0]);
        child(p, k, nth, ref, dir, fds[1]);
    }
    close(fds[1]);
    ssize_t got = read(fds[0], r, sizeof *r);
    close(fds[0]);
    waitpid(pid, status, 0);
    if (system(cmd) != 0) fprintf(stderr, "cb-faultpaths: cannot remove %s\n", dir);
    return got == (ssize_t)sizeof *r && WIFEXITED(*status) && WEXITSTATUS(*status) == 0 ? 0 : -1;
}

/* ---- setup and the loop ------------------------------------------------------------------------------------- */

static int cmp_msg_name(const void *a, const void *b) { return strcmp((const char *)a, (const char *)b); }

/* Reads every "*.msg" file of g.corpus_dir into g.msgs (at most 128, each under 64 KiB; empty ones too),
 * sorted by name. */
static int load_corpus(char *err, size_t errlen) {
    DIR *dp = opendir(g.corpus_dir);
    if (!dp) {
        snprintf(err, errlen, "%s: %s", g.corpus_dir, strerror(errno));
        return -1;
    }
    struct dirent *e;
    while ((e = readdir(dp)) && g.n_msgs < 128) {
        size_t len = strlen(e->d_name);
        if (len > 4 && len < sizeof g.msgs[0].name && !strcmp(e->d_name + len - 4, ".msg"))
            memcpy(g.msgs[g.n_msgs++].name, e->d_name, len + 1);
    }
    closedir(dp);
    qsort(g.msgs, (size_t)g.n_msgs, sizeof g.msgs[0], cmp_msg_name); /* name is the first member */
    for (int i = 0; i < g.n_msgs; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s", g.corpus_dir, g.msgs[i].name);
        FILE *f = fopen(path, "rb");
        g.msgs[i].data = malloc(1 << 16);
        g.msgs[i].len = f && g.msgs[i].data ? fread(g.msgs[i].data, 1, 1 << 16, f) : 0;
        const bool bad = !f || !g.msgs[i].data || ferror(f) || g.msgs[i].len == 1 << 16;
        if (f) fclose(f);
        if (bad) {
            snprintf(err, errlen, "%.400s: cannot read it (or over 64 KiB)", path);
            return -1;
        }
    }
    if (g.n_msgs == 0) {
        snprintf(err, errlen, "%s: no *.msg files", g.corpus_dir);
        return -1;
    }
    return 0;
}

static int setup(char *err, size_t errlen) {
    if (load_corpus(err, errlen) != 0) return -1;
    snprintf(g.synth_path, sizeof g.synth_path, "%s/synth.gguf", g.work);
    cb_synth_shape_t s;
    memset(&s, 0, sizeof s);
    snprintf(s.name, sizeof s.name, "faults");
    s.n_layer = 2, s.n_embd = 64, s.n_head = 4, s.n_head_kv = 2, s.n_ff = 96, s.n_vocab = 2048;
    s.n_ctx = 1024, s.rope_base = 10000.0f, s.rms_eps = 1e-5f, s.tied = true;
    if (cb_synth_write(g.synth_path, &s, CB_SYNTH_Q4_1, 7, err, errlen) != 0) return -1;
    snprintf(g.config_path, sizeof g.config_path, "%s/cacheblend.cfg", g.work);
    FILE *f = fopen(g.config_path, "w");
    if (!f) {
        snprintf(err, errlen, "%s: %s", g.config_path, strerror(errno));
        return -1;
    }
    fprintf(f, "common\n    kv_dir = /var/lib/cb/kv\nprecompute\n    endpoint = tcp://127.0.0.1:5599\n"
               "    max_queued_jobs = 5000\n");
    return fclose(f) == 0 ? 0 : -1;
}

static bool listed(const char *list, const char *name) {
    if (!list) return true;
    size_t n = strlen(name);
    for (const char *p = list; (p = strstr(p, name)); p += n)
        if ((p == list || p[-1] == ',') && (p[n] == 0 || p[n] == ',')) return true;
    return false;
}

int main(int argc, char **argv) {
    const char *paths = NULL, *kinds = NULL;
    uint64_t max_n = 100000, from_n = 1;
    bool verbose = false;
    snprintf(g.work, sizeof g.work, "/tmp/cb-faultpaths.%d", (int)getpid());
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--paths") && v) paths = argv[++i];
        else if (!strcmp(a, "--kinds") && v) kinds = argv[++i];
        else if (!strcmp(a, "--max") && v) max_n = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(a, "--from") && v) from_n = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(a, "-v")) verbose = true;
        else if (!strcmp(a, "--vocab-dir") && v) snprintf(g.vocab_dir, sizeof g.vocab_dir, "%s", argv[++i]);
        else if (!strcmp(a, "--corpus") && v) snprintf(g.corpus_dir, sizeof g.corpus_dir, "%s", argv[++i]);
        else if (!strcmp(a, "--work") && v) snprintf(g.work, sizeof g.work, "%s", argv[++i]);
        else {
            fprintf(stderr, "usage: cb-faultpaths --vocab-dir DIR --corpus DIR [--paths LIST] [--kinds LIST] "
                            "[--max N] [--work DIR]\n  paths:");
            for (int p = 0; p < N_PATHS; p++) fprintf(stderr, " %s", PATHS[p].name);
            fprintf(stderr, "\n  kinds: alloc enospc eio\n");
            return 2;
        }
    }
    if (!g.vocab_dir[0] || !g.corpus_dir[0]) {
        fprintf(stderr, "cb-faultpaths: --vocab-dir and --corpus are required\n");
        return 2;
    }
    if (!cb_fault_enabled()) {
        fprintf(stderr, "cb-faultpaths: built without -DCB_FAULT_INJECT: no failure points\n");
        return 2;
    }
    char err[512] = "";
    if (faultvfs_install(err, sizeof err) != 0 || (mkdir(g.work, 0755) != 0 && errno != EEXIST) ||
        setup(err, sizeof err) != 0) {
        fprintf(stderr, "cb-faultpaths: setup: %s\n", err[0] ? err : strerror(errno));
        return 2;
    }
    printf("| path | failure | points | clean errors | absorbed | wrong results | torn files | no recovery | leaks | crashes |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");
    int bad_total = 0;
    for (int p = 0; p < N_PATHS; p++) {
        if (!listed(paths, PATHS[p].name)) continue;
        /* the reference: no fault */
        report_t ref;
        int status = 0;
        if (point(p, 0, 0, 0, &ref, &status) != 0 || ref.rc != 0) {
            fprintf(stderr, "cb-faultpaths: %s: the path fails without a fault: %s\n", PATHS[p].name, ref.msg);
            bad_total++;
            continue;
        }
        fprintf(stderr, "cb-faultpaths: %s: %llu allocations, %llu I/O calls\n", PATHS[p].name,
                (unsigned long long)ref.calls, (unsigned long long)ref.io_calls);
        for (int k = 0; k < N_KINDS; k++) {
            if (!listed(kinds, KINDS[k].name)) continue;
            int points = 0, clean = 0, absorbed = 0, wrong = 0, torn = 0, norec = 0, leaks = 0, crashes = 0;
            for (uint64_t n = from_n ? from_n : 1; n <= max_n; n++) {
                report_t r;
                memset(&r, 0, sizeof r);
                if (point(p, k, n, ref.digest, &r, &status) != 0) {
                    crashes++, points++;
                    fprintf(stderr, "  %s/%s N=%llu: CRASH (%s %d)\n", PATHS[p].name, KINDS[k].name,
                            (unsigned long long)n, WIFSIGNALED(status) ? "signal" : "exit",
                            WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
                    continue;
                }
                if (verbose)
                    fprintf(stderr, "  %s/%s N=%llu: fired %d, rc %d, %llu calls: %s\n", PATHS[p].name, KINDS[k].name,
                            (unsigned long long)n, r.fired, r.rc, (unsigned long long)r.calls, r.msg);
                if (!r.fired) break; /* the path needs fewer than n calls of this kind */
                points++;
                bool bad = false;
                if (r.rc != 0) clean++;
                else if (r.same) absorbed++;
                else wrong++, bad = true;
                if (r.torn) torn++, bad = true;
                if (!r.retry_same) norec++, bad = true;
                if (r.leaks) leaks++, bad = true;
                if (bad)
                    fprintf(stderr, "  %s/%s N=%llu: rc %d%s%s%s%s: %s\n", PATHS[p].name, KINDS[k].name,
                            (unsigned long long)n, r.rc, r.rc == 0 && !r.same ? ", wrong result" : "",
                            r.torn ? ", torn file" : "", r.retry_same ? "" : ", no recovery",
                            r.leaks ? ", leaks" : "", r.msg);
            }
            printf("| %s | %s | %d | %d | %d | %d | %d | %d | %d | %d |\n", PATHS[p].name, KINDS[k].name, points,
                   clean, absorbed, wrong, torn, norec, leaks, crashes);
            fflush(stdout);
            bad_total += wrong + torn + norec + leaks + crashes;
        }
    }
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g.work);
    if (system(cmd) != 0) fprintf(stderr, "cb-faultpaths: cannot remove %s\n", g.work);
    printf("cb-faultpaths: %s\n", bad_total ? "FAILED" : "every failure point gave a clean error or the same result");
    return bad_total ? 1 : 0;
}
