/* config: ZPL file + environment + flags, with validating typed getters. See config.h. */
#include "wire/config.h"
#include "base/alloc.h"
#include "base/sysio.h"

#include <czmq.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"

#define NAME_MAX_LEN 64
#define DEFAULT_PATH "config/cacheblend.cfg"
#define CONFIG_MAX_BYTES (1u << 20)

struct cb_config_s {
    zconfig_t *file;  /* the loaded file, or NULL */
    zconfig_t *flags; /* overrides: flags/<section>/<key> = value */
    char *path;       /* file path, or NULL */
    char section[NAME_MAX_LEN + 1];
};

const char *cb_config_src_name(cb_config_src_t src) {
    switch (src) {
    case CB_CONFIG_SRC_DEFAULT: return "default";
    case CB_CONFIG_SRC_FILE: return "file";
    case CB_CONFIG_SRC_ENV: return "env";
    case CB_CONFIG_SRC_FLAG: return "flag";
    default: return "none";
    }
}

static bool valid_name(const char *s, size_t n) {
    if (n == 0 || n > NAME_MAX_LEN) return false;
    for (size_t i = 0; i < n; i++)
        if (!(islower((unsigned char)s[i]) || isdigit((unsigned char)s[i]) || s[i] == '_')) return false;
    return true;
}

/* The file's value of section/key when it is a leaf with a value, else NULL. */
static const char *file_value(const cb_config_t *cfg, const char *section, const char *key) {
    if (!cfg->file) return NULL;
    char path[2 * NAME_MAX_LEN + 2];
    snprintf(path, sizeof path, "%s/%s", section, key);
    zconfig_t *item = zconfig_locate(cfg->file, path);
    if (!item || zconfig_child(item)) return NULL;
    return zconfig_value(item);
}

static bool file_has(const cb_config_t *cfg, const char *section, const char *key) {
    return file_value(cfg, section, key) != NULL;
}

static const char *flag_value(const cb_config_t *cfg, const char *section, const char *key) {
    char path[2 * NAME_MAX_LEN + 2];
    snprintf(path, sizeof path, "%s/%s", section, key);
    zconfig_t *item = zconfig_locate(cfg->flags, path);
    return item ? zconfig_value(item) : NULL;
}

static const char *env_value(const char *section, const char *key, char *name, size_t namesz) {
    snprintf(name, namesz, "CB_%s_%s", section, key);
    for (char *p = name; *p; p++) *p = (char)toupper((unsigned char)*p);
    const char *v = getenv(name);
    if (!v && strcmp(section, "common") == 0 && strcmp(key, "data_dir") == 0) {
        v = getenv("CB_DATA_DIR");
        if (v) snprintf(name, namesz, "CB_DATA_DIR");
    }
    return v;
}

/* Lookup in one section: flag, env, file. */
static const char *lookup1(const cb_config_t *cfg, const char *section, const char *key, cb_config_src_t *src,
                           char *envname, size_t envsz) {
    const char *v;
    if ((v = flag_value(cfg, section, key))) { *src = CB_CONFIG_SRC_FLAG; return v; }
    if ((v = env_value(section, key, envname, envsz))) { *src = CB_CONFIG_SRC_ENV; return v; }
    if ((v = file_value(cfg, section, key))) { *src = CB_CONFIG_SRC_FILE; return v; }
    return NULL;
}

/* Full lookup with fallback to common; describes the origin in `origin` for error messages. */
static const char *lookup(const cb_config_t *cfg, const char *section, const char *key, cb_config_src_t *src,
                          const char **from, char *origin, size_t originsz) {
    char envname[2 * NAME_MAX_LEN + 8];
    cb_config_src_t s = CB_CONFIG_SRC_NONE;
    const char *sec = section;
    const char *v = lookup1(cfg, section, key, &s, envname, sizeof envname);
    if (!v && strcmp(section, "common") != 0) {
        sec = "common";
        v = lookup1(cfg, "common", key, &s, envname, sizeof envname);
    }
    if (src) *src = v ? s : CB_CONFIG_SRC_NONE;
    if (from) *from = v ? sec : NULL;
    if (origin && originsz) {
        if (!v) snprintf(origin, originsz, "default");
        else if (s == CB_CONFIG_SRC_ENV) snprintf(origin, originsz, "from %s", envname);
        else if (s == CB_CONFIG_SRC_FLAG) snprintf(origin, originsz, "from flag --%s.%s", sec, key);
        else snprintf(origin, originsz, "from %s, %s/%s", cfg->path ? cfg->path : "file", sec, key);
    }
    return v;
}

const char *cb_config_raw(const cb_config_t *cfg, const char *section, const char *key, cb_config_src_t *src,
                          const char **from_section) {
    if (!cfg || !section || !key) return NULL;
    return lookup(cfg, section, key, src, from_section, NULL, 0);
}

bool cb_config_set(cb_config_t *cfg, const char *section, const char *key, const char *value) {
    if (!cfg || !section || !key || !value) return false;
    if (!valid_name(section, strlen(section)) || !valid_name(key, strlen(key))) return false;
    char path[2 * NAME_MAX_LEN + 2];
    snprintf(path, sizeof path, "%s/%s", section, key);
    zconfig_put(cfg->flags, path, value);
    return true;
}

static cb_config_t *config_alloc(const char *section, char *err, size_t errlen) {
    if (!section || !valid_name(section, strlen(section))) {
        snprintf(err, errlen, "invalid config section name");
        return NULL;
    }
    cb_config_t *cfg = cb_calloc(1, sizeof *cfg);
    if (!cfg) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    snprintf(cfg->section, sizeof cfg->section, "%s", section);
    cfg->flags = zconfig_new("root", NULL);
    if (!cfg->flags) {
        free(cfg);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    return cfg;
}

/* Loads path into cfg. required: a missing file is an error (else a warning). */
static bool config_read(cb_config_t *cfg, const char *path, bool required, char *err, size_t errlen) {
    if (!path) return true;
    if (access(path, R_OK) != 0) {
        if (required) {
            snprintf(err, errlen, "config file %s: %s", path, strerror(errno));
            return false;
        }
        CB_WARN("config file %s not found: using environment, flags and built-in defaults", path);
        return true;
    }
    /* Read the file ourselves (bounded) and parse the text: zconfig_load leaks its zfile when the
     * file does not parse (CZMQ 4.2.1). */
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    char *text = fd >= 0 ? cb_malloc(CONFIG_MAX_BYTES + 1) : NULL;
    size_t n = 0;
    int rerr = fd < 0 ? errno : 0;
    while (text && n <= CONFIG_MAX_BYTES) {
        ssize_t k = cb_io_read(fd, text + n, CONFIG_MAX_BYTES + 1 - n);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) rerr = errno;
        if (k <= 0) break;
        n += (size_t)k;
    }
    if (fd >= 0) close(fd);
    if (!text || rerr || n > CONFIG_MAX_BYTES) {
        free(text);
        snprintf(err, errlen, "config file %s: %s", path,
                 rerr ? strerror(rerr) : !text ? "out of memory" : "larger than 1 MiB");
        return false;
    }
    text[n] = 0;
    if (memchr(text, 0, n)) {
        free(text);
        snprintf(err, errlen, "config file %s: contains a NUL byte", path);
        return false;
    }
    cfg->file = zconfig_str_load(text);
    free(text);
    if (!cfg->file) {
        snprintf(err, errlen, "config file %s: cannot parse (ZPL: 'name = value' lines, sections by 4-space "
                 "indentation, '#' comments)", path);
        return false;
    }
    cfg->path = cb_strdup(path);
    if (!cfg->path) {
        snprintf(err, errlen, "out of memory");
        return false;
    }
    return true;
}

cb_config_t *cb_config_load(const char *path, const char *section, char *err, size_t errlen) {
    cb_config_t *cfg = config_alloc(section, err, errlen);
    if (!cfg) return NULL;
    if (!config_read(cfg, path, true, err, errlen)) {
        cb_config_destroy(&cfg);
        return NULL;
    }
    return cfg;
}

void cb_config_destroy(cb_config_t **self_p) {
    if (!self_p || !*self_p) return;
    cb_config_t *cfg = *self_p;
    zconfig_destroy(&cfg->file);
    zconfig_destroy(&cfg->flags);
    free(cfg->path);
    free(cfg);
    *self_p = NULL;
}

/* Normalises a flag name in place: '-' becomes '_'. */
static void dash_to_underscore(char *s) {
    for (; *s; s++)
        if (*s == '-') *s = '_';
}

cb_config_t *cb_config_new(const char *section, int *argc, char **argv, char *err, size_t errlen) {
    cb_config_t *cfg = config_alloc(section, err, errlen);
    if (!cfg) return NULL;
    int n = argc ? *argc : 0;
    /* pass 1: --config */
    const char *path = NULL;
    for (int i = 1; i < n; i++) {
        if (strcmp(argv[i], "--") == 0) break;
        if (strcmp(argv[i], "--config") == 0) {
            if (i + 1 >= n) {
                snprintf(err, errlen, "--config needs a path");
                cb_config_destroy(&cfg);
                return NULL;
            }
            path = argv[i + 1];
        } else if (strncmp(argv[i], "--config=", 9) == 0) {
            path = argv[i] + 9;
        }
    }
    bool required = path != NULL;
    if (!path && getenv("CB_CONFIG") && *getenv("CB_CONFIG")) {
        path = getenv("CB_CONFIG");
        required = true;
    }
    if (!path) path = DEFAULT_PATH;
    if (!config_read(cfg, path, required, err, errlen)) {
        cb_config_destroy(&cfg);
        return NULL;
    }
    /* pass 2: overrides; compact argv */
    int out = 1;
    for (int i = 1; i < n; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) { /* everything after stays */
            while (i < n) argv[out++] = argv[i++];
            break;
        }
        if (strcmp(a, "--config") == 0) { i++; continue; }
        if (strncmp(a, "--config=", 9) == 0) continue;
        if (strncmp(a, "--", 2) != 0 || !a[2]) { argv[out++] = argv[i]; continue; }
        char name[2 * NAME_MAX_LEN + 2];
        const char *eq = strchr(a + 2, '=');
        size_t nl = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
        if (nl >= sizeof name) { argv[out++] = argv[i]; continue; }
        memcpy(name, a + 2, nl);
        name[nl] = 0;
        dash_to_underscore(name);
        char *dot = strchr(name, '.');
        const char *sec, *key;
        if (dot) {
            *dot = 0;
            sec = name;
            key = dot + 1;
            if (!valid_name(sec, strlen(sec)) || !valid_name(key, strlen(key))) {
                snprintf(err, errlen, "invalid config flag %s (expected --section.key=value)", a);
                cb_config_destroy(&cfg);
                return NULL;
            }
            if (cfg->file && !file_has(cfg, sec, key)) {
                snprintf(err, errlen, "unknown config key %s.%s in flag %s (not in %s)", sec, key, a, cfg->path);
                cb_config_destroy(&cfg);
                return NULL;
            }
        } else {
            key = name;
            if (!valid_name(key, strlen(key))) { argv[out++] = argv[i]; continue; }
            if (file_has(cfg, cfg->section, key)) sec = cfg->section;
            else if (file_has(cfg, "common", key)) sec = "common";
            else { argv[out++] = argv[i]; continue; } /* the program's own option */
        }
        const char *value;
        if (eq) value = eq + 1;
        else if (i + 1 < n) value = argv[++i];
        else {
            snprintf(err, errlen, "config flag %s needs a value", a);
            cb_config_destroy(&cfg);
            return NULL;
        }
        cb_config_set(cfg, sec, key, value);
    }
    if (argc) {
        *argc = out;
        if (out < n) argv[out] = NULL;
    }
    return cfg;
}

const char *cb_config_file(const cb_config_t *cfg) { return cfg ? cfg->path : NULL; }

/* ---------------------------------------------------------------------------------------------- */
/* Getters                                                                                         */

bool cb_config_str(const cb_config_t *cfg, const char *section, const char *key, const char *def,
                   const char **out, char *err, size_t errlen) {
    const char *v = lookup(cfg, section, key, NULL, NULL, NULL, 0);
    if (!v) v = def;
    if (!v) {
        snprintf(err, errlen, "config %s.%s is not set (file, CB_%s_%s or --%s.%s)", section, key, section, key,
                 section, key);
        return false;
    }
    *out = v;
    return true;
}

bool cb_config_str_own(const cb_config_t *cfg, const char *section, const char *key, const char *def,
                       const char **out, char *err, size_t errlen) {
    char envname[2 * NAME_MAX_LEN + 8];
    cb_config_src_t src;
    const char *v = cfg && section && key ? lookup1(cfg, section, key, &src, envname, sizeof envname) : NULL;
    if (!v) v = def;
    if (!v) {
        snprintf(err, errlen, "config %s.%s is not set (file, CB_%s_%s or --%s.%s)", section, key, section, key,
                 section, key);
        return false;
    }
    *out = v;
    return true;
}

static bool parse_int(const char *s, int64_t *out) {
    while (isspace((unsigned char)*s)) s++;
    if (!*s) return false;
    errno = 0;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s) return false;
    int shift = 0;
    switch (*end) {
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    case 't': case 'T': shift = 40; end++; break;
    default: break;
    }
    while (isspace((unsigned char)*end)) end++;
    if (*end) return false;
    if (shift) {
        if (v > (INT64_MAX >> shift) || v < (INT64_MIN >> shift)) return false;
        v = (long long)((int64_t)v * ((int64_t)1 << shift));
    }
    *out = v;
    return true;
}

bool cb_config_int(const cb_config_t *cfg, const char *section, const char *key, int64_t min, int64_t max,
                   int64_t def, int64_t *out, char *err, size_t errlen) {
    char origin[256];
    const char *v = lookup(cfg, section, key, NULL, NULL, origin, sizeof origin);
    if (!v) {
        if (def < min || def > max) {
            snprintf(err, errlen, "config %s.%s: default %lld out of range [%lld, %lld]", section, key,
                     (long long)def, (long long)min, (long long)max);
            return false;
        }
        *out = def;
        return true;
    }
    int64_t x;
    if (!parse_int(v, &x) || x < min || x > max) {
        snprintf(err, errlen, "config %s.%s = '%.64s' (%s): expected an integer in [%lld, %lld]", section, key, v,
                 origin, (long long)min, (long long)max);
        return false;
    }
    *out = x;
    return true;
}

bool cb_config_double(const cb_config_t *cfg, const char *section, const char *key, double min, double max,
                      double def, double *out, char *err, size_t errlen) {
    char origin[256];
    const char *v = lookup(cfg, section, key, NULL, NULL, origin, sizeof origin);
    if (!v) {
        *out = def;
        return true;
    }
    errno = 0;
    char *end;
    double x = strtod(v, &end);
    while (end && isspace((unsigned char)*end)) end++;
    if (errno || end == v || *end || !isfinite(x) || x < min || x > max) {
        snprintf(err, errlen, "config %s.%s = '%.64s' (%s): expected a number in [%g, %g]", section, key, v, origin,
                 min, max);
        return false;
    }
    *out = x;
    return true;
}

bool cb_config_bool(const cb_config_t *cfg, const char *section, const char *key, bool def, bool *out,
                    char *err, size_t errlen) {
    char origin[256];
    const char *v = lookup(cfg, section, key, NULL, NULL, origin, sizeof origin);
    if (!v) {
        *out = def;
        return true;
    }
    static const char *yes[] = {"1", "true", "yes", "on"}, *no[] = {"0", "false", "no", "off"};
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(v, yes[i]) == 0) { *out = true; return true; }
        if (strcasecmp(v, no[i]) == 0) { *out = false; return true; }
    }
    snprintf(err, errlen, "config %s.%s = '%.64s' (%s): expected a boolean (1/0, true/false, yes/no, on/off)",
             section, key, v, origin);
    return false;
}

bool cb_config_endpoint_valid(const char *s) {
    if (!s) return false;
    if (strncmp(s, "ipc://", 6) == 0) return s[6] != 0 && strlen(s) < 4096;
    if (strncmp(s, "inproc://", 9) == 0) return s[9] != 0 && strlen(s) < 256;
    if (strncmp(s, "tcp://", 6) != 0) return false;
    const char *host = s + 6;
    const char *colon = strrchr(host, ':');
    if (!colon || colon == host) return false;
    size_t hl = (size_t)(colon - host);
    if (hl > 253) return false;
    if (host[0] == '[') { /* [ipv6] */
        if (host[hl - 1] != ']' || hl < 3) return false;
        for (size_t i = 1; i + 1 < hl; i++)
            if (!(isxdigit((unsigned char)host[i]) || host[i] == ':' || host[i] == '.')) return false;
    } else if (!(hl == 1 && host[0] == '*')) {
        for (size_t i = 0; i < hl; i++)
            if (!(isalnum((unsigned char)host[i]) || host[i] == '.' || host[i] == '-' || host[i] == '_'))
                return false;
    }
    const char *port = colon + 1;
    if (strcmp(port, "*") == 0) return true;
    if (!*port || strlen(port) > 5) return false;
    for (const char *p = port; *p; p++)
        if (!isdigit((unsigned char)*p)) return false;
    long pn = strtol(port, NULL, 10);
    return pn >= 1 && pn <= 65535;
}

bool cb_config_endpoint(const cb_config_t *cfg, const char *section, const char *key, const char *def,
                        const char **out, char *err, size_t errlen) {
    char origin[256];
    const char *v = lookup(cfg, section, key, NULL, NULL, origin, sizeof origin);
    if (!v || !*v) {
        *out = (def && *def) ? def : NULL;
        if (*out && !cb_config_endpoint_valid(*out)) {
            snprintf(err, errlen, "config %s.%s: default '%s' is not a valid endpoint", section, key, def);
            return false;
        }
        return true;
    }
    if (!cb_config_endpoint_valid(v)) {
        snprintf(err, errlen,
                 "config %s.%s = '%.128s' (%s): expected an endpoint tcp://HOST:PORT, ipc://PATH or inproc://NAME",
                 section, key, v, origin);
        return false;
    }
    *out = v;
    return true;
}

bool cb_config_data_path(const cb_config_t *cfg, const char *section, const char *key, const char *def,
                         char *out, size_t outsz, char *err, size_t errlen) {
    const char *v, *dir;
    if (!cb_config_str(cfg, section, key, def, &v, err, errlen)) return false;
    if (!*v) {
        snprintf(err, errlen, "config %s.%s is empty", section, key);
        return false;
    }
    int n;
    if (v[0] == '/' || (strcmp(section, "common") == 0 && strcmp(key, "data_dir") == 0)) {
        n = snprintf(out, outsz, "%s", v);
    } else {
        if (!cb_config_str(cfg, "common", "data_dir", "var", &dir, err, errlen)) return false;
        if (!*dir) dir = ".";
        n = snprintf(out, outsz, "%s/%s", dir, v);
    }
    if (n < 0 || (size_t)n >= outsz) {
        snprintf(err, errlen, "config %s.%s: path too long", section, key);
        return false;
    }
    return true;
}

/* ---------------------------------------------------------------------------------------------- */
/* Startup log                                                                                     */

/* Keys whose values are credentials (gateway.api_key, common.kv_remote_password, ...): never logged. */
static bool secret_key(const char *key) {
    static const char *const words[] = {"password", "api_key", "secret"};
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++)
        if (strstr(key, words[i])) return true;
    return false;
}

static void log_section(const cb_config_t *cfg, const char *section) {
    zconfig_t *seen = zconfig_new("seen", NULL);
    zconfig_t *roots[2] = {cfg->file ? zconfig_locate(cfg->file, section) : NULL, zconfig_locate(cfg->flags, section)};
    for (int r = 0; r < 2; r++) {
        for (zconfig_t *c = roots[r] ? zconfig_child(roots[r]) : NULL; c; c = zconfig_next(c)) {
            const char *key = zconfig_name(c);
            if (!key || zconfig_child(c) || (seen && zconfig_locate(seen, key))) continue;
            if (seen) zconfig_put(seen, key, "1");
            cb_config_src_t src;
            char envname[2 * NAME_MAX_LEN + 8];
            const char *v = lookup1(cfg, section, key, &src, envname, sizeof envname);
            if (v && *v && secret_key(key)) v = "(set; not logged)";
            cb_log(CB_LOG_INFO, NULL, "config %s.%s = \"%s\" (%s)", section, key, v ? v : "",
                   src == CB_CONFIG_SRC_ENV ? envname : cb_config_src_name(src));
        }
    }
    zconfig_destroy(&seen);
}

void cb_config_log(const cb_config_t *cfg, const char *section) {
    if (!cfg) return;
    cb_log(CB_LOG_INFO, NULL, "config file: %s", cfg->path ? cfg->path : "(none)");
    log_section(cfg, "common");
    if (section && strcmp(section, "common") != 0) log_section(cfg, section);
}
