/* config: the stack's configuration: one ZPL file (config/cacheblend.cfg, read with CZMQ's zconfig)
 * with one section per program (common, retriever, cacheindex, precompute, blend, cbctl), every key
 * overridable by an environment variable and by a command-line flag.
 *
 * Precedence for a lookup of <section>.<key>, first hit wins:
 *   1. command-line flag  --<section>.<key>=VALUE | --<section>.<key> VALUE
 *                         (and for the program's own section, or common: --<key>=VALUE | --<key> VALUE;
 *                         dashes in keys may be written as '-' or '_')
 *   2. environment        CB_<SECTION>_<KEY> (upper case), e.g. CB_BLEND_ENDPOINT, CB_COMMON_MAX_MSG_BYTES;
 *                         CB_DATA_DIR is an alias of CB_COMMON_DATA_DIR
 *   3. the file           section/key
 *   then, when <section> is not "common", the same three for common.<key>;
 *   4. the default the caller passes to the getter.
 *
 * The file: `--config PATH` (or --config=PATH), else $CB_CONFIG, else config/cacheblend.cfg. An
 * explicitly named file must exist and parse; the default file may be missing (then only
 * environment, flags and defaults apply, and a warning is logged).
 *
 * Flag parsing (cb_config_new) removes the flags it consumes from argv and leaves the rest (the
 * program's own options and positional arguments) in order. A --<section>.<key> flag naming a key
 * that the loaded file does not have is an error (catches typos); a bare --<key> flag is consumed only
 * when the file has that key in the program's section or in common.
 *
 * Getters validate and explain: "config retriever.max_k = 'abc' (from CB_RETRIEVER_MAX_K): expected
 * an integer in [1, 1000]". Not thread-safe for writes (cb_config_set); lookups may run concurrently.
 */
#ifndef CB_CONFIG_H
#define CB_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct cb_config_s cb_config_t;

typedef enum { CB_CONFIG_SRC_NONE = 0, CB_CONFIG_SRC_DEFAULT, CB_CONFIG_SRC_FILE, CB_CONFIG_SRC_ENV,
               CB_CONFIG_SRC_FLAG } cb_config_src_t;

/* Loads the configuration for a program whose own section is `section` (e.g. "retriever"), taking
 * --config and override flags out of argv (argc/argv may be NULL/0). Returns NULL with err on a bad
 * flag, a missing explicit file or a file that does not parse. Caller owns; cb_config_destroy. */
cb_config_t *cb_config_new(const char *section, int *argc, char **argv, char *err, size_t errlen);
/* Loads `path` (NULL: no file) without flags. A named file that is missing is an error. */
cb_config_t *cb_config_load(const char *path, const char *section, char *err, size_t errlen);
void cb_config_destroy(cb_config_t **self_p);

/* Adds a flag-level override (highest precedence). Returns false on an invalid section/key name. */
bool cb_config_set(cb_config_t *cfg, const char *section, const char *key, const char *value);

/* The raw value after precedence (see above), or NULL; *src (may be NULL) says where it came from and
 * *from_section (may be NULL) which section supplied it ("common" on fallback). */
const char *cb_config_raw(const cb_config_t *cfg, const char *section, const char *key, cb_config_src_t *src,
                          const char **from_section);

/* Typed getters: true with *out set (to def when the key is nowhere), false with a clear err. */
bool cb_config_str(const cb_config_t *cfg, const char *section, const char *key, const char *def,
                   const char **out, char *err, size_t errlen);
/* As cb_config_str, for section itself only (flag, environment, file): no fallback to common. For a key
 * whose name means something else in common (engine.kv_dtype, the KV pool, vs common.kv_dtype, the files). */
bool cb_config_str_own(const cb_config_t *cfg, const char *section, const char *key, const char *def,
                       const char **out, char *err, size_t errlen);
/* Integers: decimal, optionally with a binary suffix K, M, G or T (x1024^n), e.g. 2G. */
bool cb_config_int(const cb_config_t *cfg, const char *section, const char *key, int64_t min, int64_t max,
                   int64_t def, int64_t *out, char *err, size_t errlen);
bool cb_config_double(const cb_config_t *cfg, const char *section, const char *key, double min, double max,
                      double def, double *out, char *err, size_t errlen);
/* Booleans: 1/0, true/false, yes/no, on/off. */
bool cb_config_bool(const cb_config_t *cfg, const char *section, const char *key, bool def, bool *out,
                    char *err, size_t errlen);
/* A ZeroMQ endpoint: tcp://HOST:PORT (PORT 1..65535 or *), ipc://PATH or inproc://NAME. An empty value
 * counts as absent (def is used; def may be NULL and then *out is NULL). */
bool cb_config_endpoint(const cb_config_t *cfg, const char *section, const char *key, const char *def,
                        const char **out, char *err, size_t errlen);
/* A path under the data directory: absolute values stay, relative ones are joined to common.data_dir
 * (itself relative to the working directory). Written NUL-terminated into out. */
bool cb_config_data_path(const cb_config_t *cfg, const char *section, const char *key, const char *def,
                         char *out, size_t outsz, char *err, size_t errlen);

/* True when s is a valid endpoint as above. */
bool cb_config_endpoint_valid(const char *s);

/* The file that was loaded, or NULL. */
const char *cb_config_file(const cb_config_t *cfg);
/* Logs (info) one line per key of `section` and of common found in the file or set by a flag, with its
 * effective value and source: the startup record of the effective configuration. */
void cb_config_log(const cb_config_t *cfg, const char *section);
/* Name of a source ("file", "env", ...). */
const char *cb_config_src_name(cb_config_src_t src);

#endif
