/* session.c: one RAG session's objects, built in order from one options struct (see session.h). */
#include "svc/session.h"
#include "base/alloc.h"

#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "svc/svcconfig.h"

struct cb_session {
    cb_model_t *model;
    cb_tokenizer_t *tok;          /* NULL with no_prompt */
    cb_ragprompt_t *rp;           /* NULL with no_prompt */
    const int32_t *prefix;        /* [n_prefix] P, owned by rp */
    int n_prefix;
    cb_engine_t *engine;
    cb_kvmem_t *mem;              /* the memory tier: borrowed, or owned when own_mem */
    bool own_mem;
    cb_kvstore_t *store;
    cb_blend_t *blend;
};

void cb_session_opts_default(cb_session_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->kv_dtype = CB_KV_F16;
}

/* The engine's positions per sequence (session.h), or -1 with err. */
static int session_ctx(const cb_session_t *s, const cb_session_opts_t *o, char *err, size_t errlen) {
    const int train = cb_model_hparams(s->model)->n_ctx_train;
    int ctx;
    if (o->ctx_after_prefix > 0) {
        ctx = s->n_prefix + o->ctx_after_prefix;
        if (ctx > train) {
            cb_set_err(err, errlen, "the precompute context (%d tokens) + %d tokens exceed the model's context (%d)",
                       s->n_prefix, o->ctx_after_prefix, train);
            return -1;
        }
        return ctx;
    }
    ctx = o->ctx_size > 0 && o->ctx_size < train ? o->ctx_size : train;
    if (s->rp && ctx <= s->n_prefix + 16) {
        cb_set_err(err, errlen, "ctx_size %d is too small for the prompt prefix (%d tokens)", ctx, s->n_prefix);
        return -1;
    }
    return ctx;
}

/* The store, its tiers, the blend and the context. 0, or -1 with err. */
static int session_store(cb_session_t *s, const cb_session_opts_t *o, char *err, size_t errlen) {
    s->mem = o->mem;
    if (!s->mem && o->mem_bytes > 0) {
        if (!(s->mem = cb_kvmem_new(o->mem_bytes))) {
            cb_set_err(err, errlen, "out of memory");
            return -1;
        }
        s->own_mem = true;
    }
    if (!(s->store = cb_kvstore_new(s->engine, o->kv_dir, s->mem, o->kv_dtype, err, errlen))) return -1;
    cb_kvstore_set_remote(s->store, o->remote); /* memory -> file -> remote -> compute */
    if (!o->no_blend && !(s->blend = cb_blend_new(s->store, err, errlen))) return -1;
    /* P's KV now, so that the first request does not pay for it (and a bad context fails at start) */
    if (s->rp && cb_kvstore_set_context(s->store, s->prefix, s->n_prefix, err, errlen) != 0) return -1;
    return 0;
}

cb_session_t *cb_session_new(const cb_session_opts_t *o, char *err, size_t errlen) {
    cb_session_t *s = cb_calloc(1, sizeof *s);
    if (!s) {
        cb_set_err(err, errlen, "out of memory");
        return NULL;
    }
    const char *path = o->model_path && *o->model_path ? o->model_path : CB_SVC_DEFAULT_MODEL;
    if (!(s->model = cb_model_load(path, err, errlen))) goto fail;
    if (!o->no_prompt) {
        const char *tmpl = o->chat_template && *o->chat_template ? o->chat_template : NULL;
        if (!(s->tok = cb_tokenizer_new_from_gguf_opts(cb_model_gguf(s->model), tmpl, err, errlen)) ||
            !(s->rp = cb_ragprompt_new(s->tok, o->system_prompt, err, errlen)))
            goto fail;
        s->prefix = cb_ragprompt_prefix(s->rp, &s->n_prefix);
    }
    int ctx = session_ctx(s, o, err, errlen);
    if (ctx < 0) goto fail;
    cb_engine_opts_t eo = {.max_ctx = ctx, .kv_pool_bytes = o->kv_pool_bytes, .kv_pool_seqs = o->kv_pool_seqs,
                           .kv_dtype = o->engine_kv_dtype, .attn = o->engine_attn};
    if (!(s->engine = cb_engine_new_opts(s->model, &eo, err, errlen))) goto fail;
    if (o->threads > 0) cb_engine_set_threads(s->engine, o->threads);
    if (!o->no_store && session_store(s, o, err, errlen) != 0) goto fail;
    return s;
fail:
    cb_session_destroy(&s);
    return NULL;
}

void cb_session_destroy(cb_session_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_session_t *s = *self_p;
    cb_blend_destroy(&s->blend);
    cb_kvstore_destroy(&s->store);
    if (s->own_mem) cb_kvmem_destroy(&s->mem);
    cb_engine_destroy(&s->engine);
    cb_ragprompt_destroy(&s->rp);
    cb_tokenizer_destroy(&s->tok);
    cb_model_destroy(&s->model);
    free(s);
    *self_p = NULL;
}

cb_model_t *cb_session_model(const cb_session_t *self) { return self->model; }
const cb_hparams_t *cb_session_hparams(const cb_session_t *self) { return cb_model_hparams(self->model); }
cb_tokenizer_t *cb_session_tokenizer(const cb_session_t *self) { return self->tok; }
const cb_ragprompt_t *cb_session_prompt(const cb_session_t *self) { return self->rp; }
cb_engine_t *cb_session_engine(const cb_session_t *self) { return self->engine; }
cb_kvstore_t *cb_session_store(const cb_session_t *self) { return self->store; }
cb_blend_t *cb_session_blend(const cb_session_t *self) { return self->blend; }
cb_kvmem_t *cb_session_mem(const cb_session_t *self) { return self->mem; }

const int32_t *cb_session_prefix(const cb_session_t *self, int *n) {
    *n = self->n_prefix;
    return self->prefix;
}
