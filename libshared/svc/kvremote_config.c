/* kvremote_config.c: the remote tier from config, its stats fields (see kvremote_config.h). */
#include "svc/kvremote_config.h"

#include <stdint.h>
#include <stdio.h>

#include "base/err.h"

int cb_kvremote_from_config(const cb_config_t *cfg, const char *section, cb_kvremote_t **out, char *err,
                            size_t errlen) {
    *out = NULL;
    const char *url = NULL, *password = NULL, *prefix = NULL;
    int64_t timeout, recovery, max_value;
    if (!cb_config_str(cfg, section, "kv_remote", "", &url, err, errlen)) return -1;
    if (!url || !*url) return 0;
    if (!cb_config_str(cfg, section, "kv_remote_password", "", &password, err, errlen) ||
        !cb_config_int(cfg, section, "kv_remote_timeout_ms", 1, 600000, 1000, &timeout, err, errlen) ||
        !cb_config_int(cfg, section, "kv_remote_recovery_ms", 1, 86400000, 5000, &recovery, err, errlen) ||
        !cb_config_str(cfg, section, "kv_remote_prefix", "cb", &prefix, err, errlen) ||
        !cb_config_int(cfg, section, "kv_remote_max_value_bytes", 1, (int64_t)512 << 20, (int64_t)64 << 20,
                       &max_value, err, errlen))
        return -1;
    cb_kvremote_opts_t o;
    cb_kvremote_opts_default(&o);
    o.url = url;
    o.password = password;
    o.connect_timeout_ms = (int)timeout;
    o.timeout_ms = (int)timeout;
    o.recovery_ms = (int)recovery;
    o.prefix = prefix;
    o.max_value_bytes = (size_t)max_value;
    char e[512] = "";
    if (!(*out = cb_kvremote_new(&o, e, sizeof e))) {
        cb_set_err(err, errlen, "config kv_remote: %s", e);
        return -1;
    }
    return 0;
}

void cb_kvremote_put_stats(cb_msg_writer_t *w, const cb_kvremote_t *remote) {
    if (!remote) return;
    cb_kvremote_stats_t st;
    cb_kvremote_stats(remote, &st);
    cb_msg_put_str(w, "kv_remote", cb_kvremote_url(remote));
    cb_msg_put_uint(w, "kv_remote_hits", st.hits);
    cb_msg_put_uint(w, "kv_remote_misses", st.misses);
    cb_msg_put_uint(w, "kv_remote_errors", st.errors);
    cb_msg_put_uint(w, "kv_remote_corrupt", st.corrupt);
    cb_msg_put_uint(w, "kv_remote_skipped", st.skipped);
    cb_msg_put_uint(w, "kv_remote_puts", st.puts);
    cb_msg_put_uint(w, "kv_remote_bytes_read", st.bytes_read);
    cb_msg_put_uint(w, "kv_remote_bytes_written", st.bytes_written);
    cb_msg_put_uint(w, "kv_remote_downs", st.downs);
    cb_msg_put_int(w, "kv_remote_up", st.up ? 1 : 0);
}
