/* chat.c: fixed C renderers and a safe encoder for the chat templates of chat.h.
 *
 * No Jinja engine: each template is a small function that lays a conversation out as a list of segments
 * (text, a marker such as <|im_start|>, BOS, EOS); rendering joins them as text, encoding turns markers
 * into ids and tokenizes each run of text between them as one piece with special parsing off.
 * Allocation: the segment list and one text buffer per encode call; render returns a malloc'd string.
 */
#include "model/chat.h"
#include "base/alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

static const char SMOLLM2_TEMPLATE[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#define IM_START "<|im_start|>"
#define IM_END "<|im_end|>"
#define L3_START "<|start_header_id|>"
#define L3_END "<|end_header_id|>"
#define L3_EOT "<|eot_id|>"
#define G_START "<start_of_turn>"
#define G_END "<end_of_turn>"
#define M_INST "[INST]"
#define M_INST_END "[/INST]"

bool cb_chat_template_is_smollm2(const char *tmpl, size_t len) {
    return tmpl && len == sizeof SMOLLM2_TEMPLATE - 1 && memcmp(tmpl, SMOLLM2_TEMPLATE, len) == 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* names and recognition */

static const char *const KIND_NAMES[] = {NULL, "smollm2", "chatml", "qwen2.5", "llama3", "mistral", "gemma",
                                         "completion"};
#define N_KINDS (sizeof KIND_NAMES / sizeof *KIND_NAMES)

const char *cb_chat_kind_name(cb_chat_kind_t kind) {
    return (unsigned)kind < N_KINDS ? KIND_NAMES[kind] : NULL;
}

cb_chat_kind_t cb_chat_kind_from_name(const char *name) {
    if (!name) return CB_CHAT_NONE;
    for (size_t k = 1; k < N_KINDS; k++)
        if (strcmp(name, KIND_NAMES[k]) == 0) return (cb_chat_kind_t)k;
    return CB_CHAT_NONE;
}

const char *cb_chat_kind_names(void) { return "smollm2, chatml, qwen2.5, llama3, mistral, gemma, completion"; }

const char *cb_chat_default_system(cb_chat_kind_t kind) {
    switch (kind) {
    case CB_CHAT_SMOLLM2: return CB_CHAT_DEFAULT_SYSTEM;
    case CB_CHAT_QWEN25: return CB_CHAT_QWEN_DEFAULT_SYSTEM;
    default: return NULL;
    }
}

static bool contains(const char *s, size_t n, const char *lit) { return memmem(s, n, lit, strlen(lit)) != NULL; }

/* The literal default system text of a ChatML template: the characters after an occurrence of
 * "<|im_start|>system" + newline (a real one or the two characters \n) up to "<|im_end|>", when they hold
 * no quote, brace, backslash or '+' (so they are one piece of a Jinja string literal). *found is false
 * when there is none. */
static void chatml_default_system(const char *t, size_t n, const char **sys, size_t *sys_len, bool *found) {
    static const char head[] = IM_START "system";
    *found = false;
    for (const char *p = t; (p = memmem(p, n - (size_t)(p - t), head, sizeof head - 1)); p++) {
        const char *q = p + sizeof head - 1, *end = t + n;
        if (q < end && *q == '\n') q++;
        else if (end - q >= 2 && q[0] == '\\' && q[1] == 'n') q += 2;
        else continue;
        const char *e = memmem(q, (size_t)(end - q), IM_END, sizeof IM_END - 1);
        if (!e) continue;
        bool literal = true;
        for (const char *c = q; c < e && literal; c++) literal = !strchr("'\"{}\\+", *c);
        if (!literal) continue;
        *sys = q;
        *sys_len = (size_t)(e - q);
        *found = true;
        return;
    }
}

static bool same(const char *s, size_t n, const char *lit) { return n == strlen(lit) && memcmp(s, lit, n) == 0; }

/* The first of the texts found in tmpl, or NULL. */
static const char *first_found(const char *tmpl, size_t len, const char *const *texts) {
    for (int i = 0; texts[i]; i++)
        if (contains(tmpl, len, texts[i])) return texts[i];
    return NULL;
}

/* A known family whose template also does what our renderer does not: a clear refusal. */
static cb_chat_kind_t refuse(char *err, size_t errlen, const char *family, const char *seen) {
    cb_set_err(err, errlen, "a %s chat template with %s is not supported (not rendered here); name a template to "
                            "use instead (%s)", family, seen, cb_chat_kind_names());
    return CB_CHAT_NONE;
}

cb_chat_kind_t cb_chat_template_detect(const char *tmpl, size_t len, char *err, size_t errlen) {
    if (err && errlen) err[0] = 0;
    if (!tmpl || len == 0) {
        cb_set_err(err, errlen, "tokenizer.chat_template is empty; name a template (%s)", cb_chat_kind_names());
        return CB_CHAT_NONE;
    }
    if (cb_chat_template_is_smollm2(tmpl, len)) return CB_CHAT_SMOLLM2;
    const char *seen;
    if (contains(tmpl, len, IM_START)) {
        /* thinking tags, Phi-4's separator, SmolVLM, a BOS before the turns, macro-built (tool) formats */
        static const char *const odd[] = {"<think>", "<|im_sep|>", "<end_of_utterance>", "bos_token", "macro", NULL};
        if ((seen = first_found(tmpl, len, odd))) return refuse(err, errlen, "ChatML", seen);
        const char *sys = NULL;
        size_t sn = 0;
        bool found;
        chatml_default_system(tmpl, len, &sys, &sn, &found);
        if (!found) return CB_CHAT_CHATML;
        if (same(sys, sn, CB_CHAT_DEFAULT_SYSTEM)) return CB_CHAT_SMOLLM2;
        if (same(sys, sn, CB_CHAT_QWEN_DEFAULT_SYSTEM)) return CB_CHAT_QWEN25;
        cb_set_err(err, errlen,
                   "ChatML chat template with an unrecognised default system message \"%.*s%s\"; name the template "
                   "to use (e.g. chatml)", (int)(sn > 60 ? 60 : sn), sys, sn > 60 ? "..." : "");
        return CB_CHAT_NONE;
    }
    if (contains(tmpl, len, L3_START) && contains(tmpl, len, L3_END)) {
        /* Llama 3.1+'s date header, tool and function formats */
        static const char *const odd[] = {"Cutting Knowledge Date", "<|python_tag|>", "function", "macro", NULL};
        if ((seen = first_found(tmpl, len, odd))) return refuse(err, errlen, "Llama 3", seen);
        return CB_CHAT_LLAMA3;
    }
    if (contains(tmpl, len, M_INST)) {
        static const char *const odd[] = {"[SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]", "<<SYS>>", "macro", NULL};
        if ((seen = first_found(tmpl, len, odd))) return refuse(err, errlen, "[INST]", seen);
        return CB_CHAT_MISTRAL;
    }
    if (contains(tmpl, len, G_START)) {
        static const char *const odd[] = {"macro", NULL};
        if ((seen = first_found(tmpl, len, odd))) return refuse(err, errlen, "Gemma", seen);
        return CB_CHAT_GEMMA;
    }
    char head[48];
    size_t k = 0;
    for (size_t i = 0; i < len && k + 1 < sizeof head; i++)
        head[k++] = (tmpl[i] >= 0x20 && tmpl[i] < 0x7f) ? tmpl[i] : ' ';
    head[k] = 0;
    cb_set_err(err, errlen, "unrecognised tokenizer.chat_template (\"%s...\"); name a template (%s)", head,
               cb_chat_kind_names());
    return CB_CHAT_NONE;
}

/* ---------------------------------------------------------------------------------------------- */
/* segments */

typedef enum { SEG_TEXT, SEG_MARK, SEG_BOS, SEG_EOS } seg_kind_t;
typedef struct {
    seg_kind_t kind;
    const char *s; /* SEG_TEXT/SEG_MARK: borrowed text */
    size_t n;
} seg_t;
typedef struct {
    seg_t *v;
    size_t n, cap;
    bool oom;
} segs_t;

static void seg_add(segs_t *g, seg_kind_t kind, const char *s, size_t n) {
    if (g->oom) return;
    if (kind == SEG_TEXT && n == 0) return;
    if (g->n == g->cap) {
        size_t cap = g->cap ? 2 * g->cap : 32;
        seg_t *v = cb_realloc(g->v, cap * sizeof *v);
        if (!v) { g->oom = true; return; }
        g->v = v;
        g->cap = cap;
    }
    g->v[g->n++] = (seg_t){kind, s, n};
}

static void text(segs_t *g, const char *s) { seg_add(g, SEG_TEXT, s, strlen(s)); }
static void mark(segs_t *g, const char *s) { seg_add(g, SEG_MARK, s, strlen(s)); }

/* Python's str.strip() (Jinja's trim) on UTF-8: the White_Space characters and the ASCII separators. */
static size_t space_at(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    if (n >= 1 && ((u[0] >= 0x09 && u[0] <= 0x0d) || (u[0] >= 0x1c && u[0] <= 0x20))) return 1;
    if (n >= 2 && u[0] == 0xC2 && (u[1] == 0x85 || u[1] == 0xA0)) return 2;
    if (n >= 3 && u[0] == 0xE1 && u[1] == 0x9A && u[2] == 0x80) return 3;                    /* U+1680 */
    if (n >= 3 && u[0] == 0xE2 && u[1] == 0x80 &&
        (u[2] <= 0x8A || u[2] == 0xA8 || u[2] == 0xA9 || u[2] == 0xAF)) return 3;             /* U+2000.. */
    if (n >= 3 && u[0] == 0xE2 && u[1] == 0x81 && u[2] == 0x9F) return 3;                    /* U+205F */
    if (n >= 3 && u[0] == 0xE3 && u[1] == 0x80 && u[2] == 0x80) return 3;                    /* U+3000 */
    return 0;
}

static void text_trimmed(segs_t *g, const char *s) {
    size_t n = strlen(s), k;
    while (n && (k = space_at(s, n))) { s += k; n -= k; }
    for (;;) { /* from the end: try each possible width of a trailing space character */
        size_t w = 0;
        for (size_t c = 1; c <= 3 && c <= n && !w; c++)
            if (space_at(s + n - c, c) == c) w = c;
        if (!w) break;
        n -= w;
    }
    seg_add(g, SEG_TEXT, s, n);
}

static bool is_role(const cb_chat_msg_t *m, const char *role) { return strcmp(m->role, role) == 0; }

/* ---------------------------------------------------------------------------------------------- */
/* the templates: whole conversations, and the RAG prefix/suffix */

typedef struct {
    cb_chat_kind_t kind;
    bool space_prefix; /* SentencePiece vocabulary with a space prefix (Mistral) */
    bool add_bos;      /* completion: the vocabulary adds BOS */
} tmpl_t;

static void chatml_msg(segs_t *g, const char *role, const char *content) {
    mark(g, IM_START);
    text(g, role);
    text(g, "\n");
    text(g, content);
    mark(g, IM_END);
    text(g, "\n");
}

static void llama3_msg(segs_t *g, const char *role, const char *content) {
    mark(g, L3_START);
    text(g, role);
    mark(g, L3_END);
    text(g, "\n\n");
    text_trimmed(g, content);
    mark(g, L3_EOT);
}

static void render_chat(const tmpl_t *tp, const cb_chat_msg_t *m, size_t n, bool agp, segs_t *g) {
    const char *def = cb_chat_default_system(tp->kind);
    switch (tp->kind) {
    case CB_CHAT_SMOLLM2: case CB_CHAT_QWEN25: case CB_CHAT_CHATML:
        if (def && n > 0 && !is_role(&m[0], "system")) chatml_msg(g, "system", def);
        for (size_t i = 0; i < n; i++) chatml_msg(g, m[i].role, m[i].content);
        if (agp) { mark(g, IM_START); text(g, "assistant\n"); }
        break;
    case CB_CHAT_LLAMA3:
        if (n > 0) seg_add(g, SEG_BOS, NULL, 0);
        for (size_t i = 0; i < n; i++) llama3_msg(g, m[i].role, m[i].content);
        if (agp) { mark(g, L3_START); text(g, "assistant"); mark(g, L3_END); text(g, "\n\n"); }
        break;
    case CB_CHAT_GEMMA: {
        seg_add(g, SEG_BOS, NULL, 0);
        size_t i = 0;
        const char *first_prefix = NULL;
        if (n > 0 && is_role(&m[0], "system")) first_prefix = m[i++].content;
        for (bool first = true; i < n; i++, first = false) {
            mark(g, G_START);
            text(g, is_role(&m[i], "assistant") ? "model" : m[i].role);
            text(g, "\n");
            if (first && first_prefix) { text(g, first_prefix); text(g, "\n\n"); }
            text_trimmed(g, m[i].content);
            mark(g, G_END);
            text(g, "\n");
        }
        if (agp) { mark(g, G_START); text(g, "model\n"); }
        break;
    }
    case CB_CHAT_MISTRAL: {
        seg_add(g, SEG_BOS, NULL, 0);
        size_t i = 0;
        const char *sys = NULL;
        if (n > 0 && is_role(&m[0], "system")) sys = m[i++].content;
        for (; i < n; i++) {
            if (is_role(&m[i], "assistant")) {
                text(g, m[i].content);
                seg_add(g, SEG_EOS, NULL, 0);
                continue;
            }
            mark(g, M_INST);
            text(g, " ");
            if (sys) { text(g, sys); text(g, "\n\n"); sys = NULL; }
            text(g, m[i].content);
            text(g, " ");
            mark(g, M_INST_END);
        }
        break;
    }
    case CB_CHAT_COMPLETION:
        if (tp->add_bos) seg_add(g, SEG_BOS, NULL, 0);
        for (size_t i = 0; i < n; i++) {
            if (i) text(g, "\n\n");
            text(g, m[i].content);
        }
        break;
    default:
        break;
    }
}

static void render_prefix(const tmpl_t *tp, const char *system, segs_t *g) {
    if (!system) system = cb_chat_default_system(tp->kind);
    switch (tp->kind) {
    case CB_CHAT_SMOLLM2: case CB_CHAT_QWEN25: case CB_CHAT_CHATML:
        if (system) chatml_msg(g, "system", system);
        mark(g, IM_START);
        text(g, "user\n");
        break;
    case CB_CHAT_LLAMA3:
        seg_add(g, SEG_BOS, NULL, 0);
        if (system) llama3_msg(g, "system", system);
        mark(g, L3_START);
        text(g, "user");
        mark(g, L3_END);
        text(g, "\n\n");
        break;
    case CB_CHAT_GEMMA:
        seg_add(g, SEG_BOS, NULL, 0);
        mark(g, G_START);
        text(g, "user\n");
        if (system) { text(g, system); text(g, "\n\n"); }
        break;
    case CB_CHAT_MISTRAL:
        seg_add(g, SEG_BOS, NULL, 0);
        mark(g, M_INST);
        if (system) { text(g, " "); text(g, system); text(g, "\n\n"); }
        else if (!tp->space_prefix) text(g, " ");
        break;
    case CB_CHAT_COMPLETION:
        if (tp->add_bos) seg_add(g, SEG_BOS, NULL, 0);
        if (system) { text(g, system); text(g, "\n\n"); }
        break;
    default:
        break;
    }
}

static void render_suffix(const tmpl_t *tp, segs_t *g) {
    switch (tp->kind) {
    case CB_CHAT_SMOLLM2: case CB_CHAT_QWEN25: case CB_CHAT_CHATML:
        mark(g, IM_END);
        text(g, "\n");
        mark(g, IM_START);
        text(g, "assistant\n");
        break;
    case CB_CHAT_LLAMA3:
        mark(g, L3_EOT);
        mark(g, L3_START);
        text(g, "assistant");
        mark(g, L3_END);
        text(g, "\n\n");
        break;
    case CB_CHAT_GEMMA:
        mark(g, G_END);
        text(g, "\n");
        mark(g, G_START);
        text(g, "model\n");
        break;
    case CB_CHAT_MISTRAL:
        if (!tp->space_prefix) text(g, " ");
        mark(g, M_INST_END);
        break;
    default:
        break;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* checks */

static bool has_special(const cb_tokenizer_t *tok, const char *s) {
    return cb_tokenizer_is_special(tok, cb_tokenizer_find(tok, s, strlen(s)));
}

bool cb_chat_check(const cb_tokenizer_t *tok, char *err, size_t errlen) {
    if (err && errlen) err[0] = 0;
    if (!tok) {
        cb_set_err(err, errlen, "chat: no tokenizer");
        return false;
    }
    cb_chat_kind_t kind = (cb_chat_kind_t)cb_tokenizer_chat_template(tok);
    const char *name = cb_chat_kind_name(kind);
    if (!name) {
        cb_set_err(err, errlen, "chat: no chat template: %s", cb_tokenizer_chat_template_error(tok));
        return false;
    }
    static const char *const chatml[] = {IM_START, IM_END, NULL};
    static const char *const llama3[] = {L3_START, L3_END, L3_EOT, NULL};
    static const char *const gemma[] = {G_START, G_END, NULL};
    const char *const *need = NULL;
    bool bos = false, eos = false;
    switch (kind) {
    case CB_CHAT_SMOLLM2: case CB_CHAT_QWEN25: case CB_CHAT_CHATML: need = chatml; break;
    case CB_CHAT_LLAMA3: need = llama3; bos = true; break;
    case CB_CHAT_GEMMA: need = gemma; bos = true; break;
    case CB_CHAT_MISTRAL: bos = eos = true; break;
    case CB_CHAT_COMPLETION: bos = cb_tokenizer_add_bos(tok); break;
    default: break;
    }
    for (int i = 0; need && need[i]; i++)
        if (!has_special(tok, need[i])) {
            cb_set_err(err, errlen, "chat: template \"%s\" needs the special token %s, which this vocabulary lacks",
                       name, need[i]);
            return false;
        }
    if (bos && cb_tokenizer_bos(tok) < 0) {
        cb_set_err(err, errlen, "chat: template \"%s\" starts with BOS, which this vocabulary lacks", name);
        return false;
    }
    if (eos && cb_tokenizer_eos(tok) < 0) {
        cb_set_err(err, errlen, "chat: template \"%s\" ends turns with EOS, which this vocabulary lacks", name);
        return false;
    }
    return true;
}

static bool tmpl_of(const cb_tokenizer_t *tok, tmpl_t *tp) {
    if (!cb_chat_check(tok, NULL, 0)) return false;
    *tp = (tmpl_t){(cb_chat_kind_t)cb_tokenizer_chat_template(tok), cb_tokenizer_add_space_prefix(tok),
                   cb_tokenizer_add_bos(tok)};
    return true;
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
        char *nb = cb_realloc(b->buf, cap);
        if (!nb) { b->oom = true; return; }
        b->buf = nb;
        b->cap = cap;
    }
    if (n) memcpy(b->buf + b->len, s, n);
    b->len += n;
    b->buf[b->len] = 0;
}

static char *segs_text(const cb_tokenizer_t *tok, const segs_t *g) {
    sbuf_t b = {0};
    sb_add(&b, "", 0);
    for (size_t i = 0; i < g->n; i++) {
        const seg_t *s = &g->v[i];
        if (s->kind == SEG_TEXT || s->kind == SEG_MARK) {
            sb_add(&b, s->s, s->n);
        } else {
            size_t l = 0;
            const char *p = cb_tokenizer_token_text(tok, s->kind == SEG_BOS ? cb_tokenizer_bos(tok)
                                                                          : cb_tokenizer_eos(tok), &l);
            if (p) sb_add(&b, p, l);
        }
    }
    if (b.oom || g->oom) {
        free(b.buf);
        return NULL;
    }
    return b.buf;
}

char *cb_chat_render(const cb_chat_msg_t *msgs, size_t n, bool add_generation_prompt) {
    if (!msgs_valid(msgs, n)) return NULL;
    tmpl_t tp = {CB_CHAT_SMOLLM2, false, false};
    segs_t g = {0};
    render_chat(&tp, msgs, n, add_generation_prompt, &g);
    char *s = segs_text(NULL, &g);
    free(g.v);
    return s;
}

char *cb_chat_render_tok(const cb_tokenizer_t *tok, const cb_chat_msg_t *msgs, size_t n, bool add_generation_prompt) {
    tmpl_t tp;
    if (!tmpl_of(tok, &tp) || !msgs_valid(msgs, n)) return NULL;
    segs_t g = {0};
    render_chat(&tp, msgs, n, add_generation_prompt, &g);
    char *s = segs_text(tok, &g);
    free(g.v);
    return s;
}

/* ---------------------------------------------------------------------------------------------- */
/* ids */

typedef struct {
    const cb_tokenizer_t *tok;
    int32_t *out;
    int max_out;
    int n;        /* ids produced so far (may exceed max_out: then only counted) */
    int err;      /* 0 or a CB_TOKENIZER_E* code */
    sbuf_t text;  /* pending text since the last id */
} enc_t;

static void put_id(enc_t *e, int32_t id) {
    if (e->err) return;
    if (id < 0) { e->err = CB_TOKENIZER_EINVAL; return; }
    if (e->n == INT_MAX) { e->err = CB_TOKENIZER_EINVAL; return; }
    if (e->n < e->max_out) e->out[e->n] = id;
    e->n++;
}

static void flush_text(enc_t *e) {
    if (e->text.oom) e->err = CB_TOKENIZER_EINTERNAL;
    if (e->err || e->text.len == 0) return;
    bool room = e->n < e->max_out;
    int r = cb_tokenizer_encode(e->tok, e->text.buf, e->text.len, false, room ? e->out + e->n : NULL,
                                room ? e->max_out - e->n : 0);
    e->text.len = 0;
    if (r == CB_TOKENIZER_EINVAL || r == CB_TOKENIZER_EINTERNAL) { e->err = r; return; }
    int got = r < 0 ? -r : r;
    if (got > INT_MAX - e->n) { e->err = CB_TOKENIZER_EINVAL; return; }
    e->n += got;
}

static int encode_segs(const cb_tokenizer_t *tok, const segs_t *g, int32_t *out, int max_out) {
    if (g->oom) return CB_TOKENIZER_EINTERNAL;
    enc_t e = {.tok = tok, .out = out, .max_out = max_out};
    for (size_t i = 0; i < g->n && !e.err; i++) {
        const seg_t *s = &g->v[i];
        int32_t id = -1;
        switch (s->kind) {
        case SEG_TEXT:
            sb_add(&e.text, s->s, s->n);
            continue;
        case SEG_MARK:
            id = cb_tokenizer_find(tok, s->s, s->n);
            if (!cb_tokenizer_is_special(tok, id)) { /* not a special token here: it is text */
                sb_add(&e.text, s->s, s->n);
                continue;
            }
            break;
        case SEG_BOS: id = cb_tokenizer_bos(tok); break;
        case SEG_EOS: id = cb_tokenizer_eos(tok); break;
        }
        flush_text(&e);
        put_id(&e, id);
    }
    flush_text(&e);
    free(e.text.buf);
    if (e.err) return e.err;
    return e.n > max_out ? -e.n : e.n;
}

static bool out_valid(int32_t *out, int max_out) { return max_out >= 0 && (out || max_out == 0); }

int cb_chat_encode(const cb_tokenizer_t *tok, const cb_chat_msg_t *msgs, size_t n, bool add_generation_prompt,
                   int32_t *out, int max_out) {
    tmpl_t tp;
    if (!out_valid(out, max_out) || !tmpl_of(tok, &tp) || !msgs_valid(msgs, n)) return CB_TOKENIZER_EINVAL;
    segs_t g = {0};
    render_chat(&tp, msgs, n, add_generation_prompt, &g);
    int r = encode_segs(tok, &g, out, max_out);
    free(g.v);
    return r;
}

int cb_chat_encode_user_turn(const cb_tokenizer_t *tok, const char *system, const char *user,
                             int32_t *out, int max_out) {
    if (!user) return CB_TOKENIZER_EINVAL;
    if (!system) system = cb_chat_default_system((cb_chat_kind_t)cb_tokenizer_chat_template(tok));
    cb_chat_msg_t m[2] = {{"system", system}, {"user", user}};
    return system ? cb_chat_encode(tok, m, 2, true, out, max_out) : cb_chat_encode(tok, m + 1, 1, true, out, max_out);
}

int cb_chat_encode_prefix(const cb_tokenizer_t *tok, const char *system, int32_t *out, int max_out) {
    tmpl_t tp;
    if (!out_valid(out, max_out) || !tmpl_of(tok, &tp)) return CB_TOKENIZER_EINVAL;
    segs_t g = {0};
    render_prefix(&tp, system, &g);
    int r = encode_segs(tok, &g, out, max_out);
    free(g.v);
    return r;
}

int cb_chat_encode_suffix(const cb_tokenizer_t *tok, int32_t *out, int max_out) {
    tmpl_t tp;
    if (!out_valid(out, max_out) || !tmpl_of(tok, &tp)) return CB_TOKENIZER_EINVAL;
    segs_t g = {0};
    render_suffix(&tp, &g);
    int r = encode_segs(tok, &g, out, max_out);
    free(g.v);
    return r;
}
