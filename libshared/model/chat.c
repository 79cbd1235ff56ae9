/* chat.c: fixed C renderer and safe encoder for SmolLM2-Instruct's ChatML template (see chat.h).
 * No Jinja engine: the one template is hard-coded, and checked against the GGUF's text by
 * cb_chat_template_is_smollm2(). Allocation: render returns a malloc'd string; the encoders allocate
 * one small buffer per message to join "{role}\n{content}". */
#include "model/chat.h"

#include <stdlib.h>
#include <string.h>

static const char SMOLLM2_TEMPLATE[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#define IM_START "<|im_start|>"
#define IM_END "<|im_end|>"

bool cb_chat_template_is_smollm2(const char *tmpl, size_t len) {
    return tmpl && len == sizeof SMOLLM2_TEMPLATE - 1 && memcmp(tmpl, SMOLLM2_TEMPLATE, len) == 0;
}

static bool needs_default_system(const cb_chat_msg_t *msgs, size_t n) {
    return n > 0 && strcmp(msgs[0].role, "system") != 0;
}

static bool msgs_valid(const cb_chat_msg_t *msgs, size_t n) {
    if (n && !msgs) return false;
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content) return false;
    return true;
}

/* ---------------------------------------------------------------------------------------------- */
/* text */

typedef struct {
    char *buf;
    size_t len, cap;
    bool oom;
} sbuf_t;

static void sb_add(sbuf_t *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *nb = realloc(b->buf, cap);
        if (!nb) { b->oom = true; return; }
        b->buf = nb;
        b->cap = cap;
    }
    memcpy(b->buf + b->len, s, n);
    b->len += n;
    b->buf[b->len] = 0;
}

static void sb_str(sbuf_t *b, const char *s) { sb_add(b, s, strlen(s)); }

static void sb_msg(sbuf_t *b, const char *role, const char *content) {
    sb_str(b, IM_START);
    sb_str(b, role);
    sb_str(b, "\n");
    sb_str(b, content);
    sb_str(b, IM_END "\n");
}

char *cb_chat_render(const cb_chat_msg_t *msgs, size_t n, bool add_generation_prompt) {
    if (!msgs_valid(msgs, n)) return NULL;
    sbuf_t b = {0};
    sb_add(&b, "", 0);
    if (needs_default_system(msgs, n)) sb_msg(&b, "system", CB_CHAT_DEFAULT_SYSTEM);
    for (size_t i = 0; i < n; i++) sb_msg(&b, msgs[i].role, msgs[i].content);
    if (add_generation_prompt) sb_str(&b, IM_START "assistant\n");
    if (b.oom) {
        free(b.buf);
        return NULL;
    }
    return b.buf;
}

/* ---------------------------------------------------------------------------------------------- */
/* ids */

typedef struct {
    const cb_tokenizer_t *tok;
    int32_t *out;
    int max_out;
    int n;        /* ids produced so far (may exceed max_out: then only counted) */
    int err;      /* 0 or a CB_TOKENIZER_E* code */
    int32_t im_start, im_end;
} enc_t;

static void put_id(enc_t *e, int32_t id) {
    if (e->err) return;
    if (e->n == INT_MAX) { e->err = CB_TOKENIZER_EINVAL; return; }
    if (e->n < e->max_out) e->out[e->n] = id;
    e->n++;
}

static void put_text(enc_t *e, const char *s, size_t len) {
    if (e->err || len == 0) return;
    bool room = e->n < e->max_out;
    int r = cb_tokenizer_encode(e->tok, s, len, false, room ? e->out + e->n : NULL, room ? e->max_out - e->n : 0);
    if (r == CB_TOKENIZER_EINVAL || r == CB_TOKENIZER_EINTERNAL) { e->err = r; return; }
    int got = r < 0 ? -r : r;
    if (got > INT_MAX - e->n) { e->err = CB_TOKENIZER_EINVAL; return; }
    e->n += got;
}

/* <|im_start|> "{role}\n{content}" <|im_end|> "\n" */
static void put_msg(enc_t *e, const char *role, const char *content) {
    size_t rl = strlen(role), cl = strlen(content);
    char *joined = malloc(rl + 1 + cl + 1);
    if (!joined) { e->err = CB_TOKENIZER_EINTERNAL; return; }
    memcpy(joined, role, rl);
    joined[rl] = '\n';
    memcpy(joined + rl + 1, content, cl);
    put_id(e, e->im_start);
    put_text(e, joined, rl + 1 + cl);
    put_id(e, e->im_end);
    put_text(e, "\n", 1);
    free(joined);
}

static bool enc_init(enc_t *e, const cb_tokenizer_t *tok, int32_t *out, int max_out) {
    *e = (enc_t){.tok = tok, .out = out, .max_out = max_out};
    if (!tok || max_out < 0 || (!out && max_out > 0)) return false;
    e->im_start = cb_tokenizer_find(tok, IM_START, strlen(IM_START));
    e->im_end = cb_tokenizer_find(tok, IM_END, strlen(IM_END));
    return e->im_start >= 0 && e->im_end >= 0;
}

static int enc_result(const enc_t *e) {
    if (e->err) return e->err;
    return e->n > e->max_out ? -e->n : e->n;
}

int cb_chat_encode(const cb_tokenizer_t *tok, const cb_chat_msg_t *msgs, size_t n, bool add_generation_prompt,
                   int32_t *out, int max_out) {
    enc_t e;
    if (!enc_init(&e, tok, out, max_out) || !msgs_valid(msgs, n)) return CB_TOKENIZER_EINVAL;
    if (needs_default_system(msgs, n)) put_msg(&e, "system", CB_CHAT_DEFAULT_SYSTEM);
    for (size_t i = 0; i < n; i++) put_msg(&e, msgs[i].role, msgs[i].content);
    if (add_generation_prompt) {
        put_id(&e, e.im_start);
        put_text(&e, "assistant\n", 10);
    }
    return enc_result(&e);
}

int cb_chat_encode_user_turn(const cb_tokenizer_t *tok, const char *system, const char *user,
                             int32_t *out, int max_out) {
    if (!user) return CB_TOKENIZER_EINVAL;
    cb_chat_msg_t m[2] = {{"system", system ? system : CB_CHAT_DEFAULT_SYSTEM}, {"user", user}};
    return cb_chat_encode(tok, m, 2, true, out, max_out);
}

int cb_chat_encode_prefix(const cb_tokenizer_t *tok, const char *system, int32_t *out, int max_out) {
    enc_t e;
    if (!enc_init(&e, tok, out, max_out)) return CB_TOKENIZER_EINVAL;
    put_msg(&e, "system", system ? system : CB_CHAT_DEFAULT_SYSTEM);
    put_id(&e, e.im_start);
    put_text(&e, "user\n", 5);
    return enc_result(&e);
}

int cb_chat_encode_suffix(const cb_tokenizer_t *tok, int32_t *out, int max_out) {
    enc_t e;
    if (!enc_init(&e, tok, out, max_out)) return CB_TOKENIZER_EINVAL;
    put_id(&e, e.im_end);
    put_text(&e, "\n", 1);
    put_id(&e, e.im_start);
    put_text(&e, "assistant\n", 10);
    return enc_result(&e);
}
