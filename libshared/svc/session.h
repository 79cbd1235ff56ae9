/* session: one RAG session, the setup every program that answers (or precomputes) a RAG prompt shares:
 * the model, its tokenizer, the prompt builder (rag/ragprompt.h), the engine (and its KV pool), the chunk
 * store with its tiers (memory tier, KV files, the remote tier) and the blend over the store, built in
 * that order from one options struct. The prompt's prefix P (the precompute context) is made the store's
 * context once, at creation, so that the first request does not pay for it (and a bad context fails at
 * start). cb-blend, cb-precompute, cb-rag, cb-eval, cb-kvdev and cb-bench-gpu all build theirs here, so the
 * served path and the tools that measure it run the same objects with the same settings.
 *
 * What is built (cb_session_opts_t):
 *   model       always (opts.model_path, else CB_SVC_DEFAULT_MODEL: svc/svcconfig.h)
 *   tokenizer   and the prompt builder, unless opts.no_prompt (a synthetic model without a vocabulary)
 *   engine      max_ctx: opts.ctx_after_prefix > 0: |P| + it (at most the model's n_ctx_train, else an
 *               error); else opts.ctx_size > 0: min(ctx_size, n_ctx_train); else n_ctx_train. With a
 *               prompt, a max_ctx of |P| + 16 or less is an error (no room for a question)
 *   store       unless opts.no_store: KV files in opts.kv_dir (NULL = no file tier) of opts.kv_dtype, the
 *               memory tier opts.mem (borrowed) or, when NULL and opts.mem_bytes > 0, one of mem_bytes
 *               (owned), and the remote tier opts.remote (borrowed; NULL = off)
 *   blend       unless opts.no_store or opts.no_blend
 *   context     P set as the store's context, with a prompt and a store
 *
 * Ownership: the session owns what it builds and destroys it in reverse order (cb_session_destroy); the
 * strings of the options are copied where kept; a borrowed memory or remote tier must outlive the session
 * (the services keep them outside: their loop reports the tiers' counters while the worker thread owns the
 * session). The accessors return borrowed pointers, valid for the session's life. A session is used by one
 * thread at a time (its engine and blend are), except what the tiers themselves make thread-safe.
 */
#ifndef CB_SVC_SESSION_H
#define CB_SVC_SESSION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "blend/blend.h"
#include "engine/engine.h"
#include "format/kvfile.h"
#include "kv/kvmem.h"
#include "kv/kvremote.h"
#include "kv/kvstore.h"
#include "model/model.h"
#include "model/tokenizer.h"
#include "rag/ragprompt.h"

typedef struct cb_session cb_session_t;

typedef struct {
    const char *model_path;       /* GGUF file; NULL or "" = CB_SVC_DEFAULT_MODEL */
    const char *chat_template;    /* a template name (chat.h); NULL or "" = the GGUF's */
    const char *system_prompt;    /* NULL or "" = the template's default line */
    bool no_prompt;               /* no tokenizer and no prompt builder (and no context set) */
    int ctx_size;                 /* engine positions per sequence, see above; 0 = the model's n_ctx_train */
    int ctx_after_prefix;         /* > 0: max_ctx = |P| + this (precompute: a chunk and its separator) */
    size_t kv_pool_bytes;         /* engine KV pool budget; 0 = kv_pool_seqs sequences of max_ctx */
    int kv_pool_seqs;             /* with kv_pool_bytes 0: 0 = the engine's default (2) */
    cb_engine_kv_dtype_t engine_kv_dtype; /* the pool's values (engine.kv_dtype); DEFAULT = the engine's */
    cb_engine_attn_t engine_attn;         /* prefill attention (engine.attn); DEFAULT = the engine's */
    int threads;                  /* engine threads; 0 = the engine's default ($CB_THREADS, else every CPU) */
    bool no_store;                /* model, tokenizer, prompt and engine only */
    bool no_blend;                /* a store without a blend (precompute) */
    const char *kv_dir;           /* the KV-file tier (must exist); NULL = none */
    cb_kv_dtype_t kv_dtype;       /* payload of the KV files written (default f16) */
    cb_kvmem_t *mem;              /* borrowed memory tier; NULL = mem_bytes */
    size_t mem_bytes;             /* with mem NULL: an owned memory tier of this budget; 0 = none */
    cb_kvremote_t *remote;        /* borrowed remote tier (kvremote.h); NULL = off */
} cb_session_opts_t;

/* Zeroes o and sets kv_dtype f16: a session with a prompt, an engine of the model's context, a store
 * without tiers and a blend. */
void cb_session_opts_default(cb_session_opts_t *o);

/* Builds the session. NULL with err on failure (a model or tokenizer that does not load, no usable chat
 * template, a context too small, an engine or store that cannot be made, the context's KV that cannot be
 * computed); err is the failing step's own message. Caller owns. */
cb_session_t *cb_session_new(const cb_session_opts_t *o, char *err, size_t errlen);
void cb_session_destroy(cb_session_t **self_p);

cb_model_t *cb_session_model(const cb_session_t *self);
const cb_hparams_t *cb_session_hparams(const cb_session_t *self);
cb_tokenizer_t *cb_session_tokenizer(const cb_session_t *self);      /* NULL with no_prompt */
const cb_ragprompt_t *cb_session_prompt(const cb_session_t *self);   /* NULL with no_prompt */
/* P: [*n] token ids (NULL and 0 with no_prompt), owned by the session. */
const int32_t *cb_session_prefix(const cb_session_t *self, int *n);
cb_engine_t *cb_session_engine(const cb_session_t *self);
cb_kvstore_t *cb_session_store(const cb_session_t *self);            /* NULL with no_store */
cb_blend_t *cb_session_blend(const cb_session_t *self);              /* NULL with no_store or no_blend */
cb_kvmem_t *cb_session_mem(const cb_session_t *self);                /* the memory tier (borrowed or owned), or NULL */

#endif
