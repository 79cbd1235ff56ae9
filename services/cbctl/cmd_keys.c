/* cbctl keys init [--force] [DIR] | keys list [DIR]: the CURVE key pairs of the stack (wire/curve.h has
 * the layout; DIR defaults to common.keys_dir). `init` makes a server pair per service and a client pair
 * per identity with CZMQ zcert, secret files 0600, and the public copies clients (public/) and the
 * services' ZAP handlers (allowed/) read; a complete set is left alone unless --force. `list` prints every
 * key with its public half and checks the set: a pair whose copy is missing or differs, a repeated key
 * in allowed/, a secret file readable by others. Exit 0, 1 (a problem found or a write failed), 2 usage. */
#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cbctl.h"
#include "client.h"
#include "wire/curve.h"

static int usage(cbctl_t *ctl) {
    cbctl_error(ctl, "usage: cbctl keys init [--force] [DIR] | cbctl keys list [DIR]   (DIR: common.keys_dir)");
    return CBCTL_EXIT_USAGE;
}

/* One pair and its public copy: prints a line, returns false on a problem. */
static bool list_pair(const char *dir, cb_curve_file_t pair, cb_curve_file_t copy, const char *name, char keys[][CB_CURVE_TXT],
                      int *nkeys) {
    char path[1024], copy_path[1024], pub[CB_CURVE_TXT], sec[CB_CURVE_TXT], copy_pub[CB_CURVE_TXT], err[1024];
    cb_curve_path(path, sizeof path, dir, pair, name);
    cb_curve_path(copy_path, sizeof copy_path, dir, copy, name);
    const char *kind = pair == CB_CURVE_SERVER ? "server" : "client";
    if (!cb_curve_read(path, pub, sec, err, sizeof err)) {
        printf("%-7s %-11s %-40s PROBLEM: %s\n", kind, name, "-", err);
        return false;
    }
    struct stat st;
    bool open_mode = stat(path, &st) == 0 && (st.st_mode & 077);
    const char *copy_dir = copy == CB_CURVE_PUBLIC ? "public" : "allowed";
    bool ok = !open_mode;
    char note[1200];
    copy_pub[0] = 0;
    if (copy == CB_CURVE_ALLOWED && access(copy_path, F_OK) != 0) {
        snprintf(note, sizeof note, "not in allowed/ (the services refuse it)"); /* revoked: a choice */
    } else if (!cb_curve_read(copy_path, copy_pub, NULL, err, sizeof err)) {
        snprintf(note, sizeof note, "PROBLEM: %s", err);
        ok = false;
    } else if (strcmp(copy_pub, pub) != 0) {
        snprintf(note, sizeof note, "PROBLEM: %s/%s.key holds another key", copy_dir, name);
        ok = false;
    } else {
        snprintf(note, sizeof note, "%s%s", copy == CB_CURVE_PUBLIC ? "published in public/" : "allowed",
                 open_mode ? "; PROBLEM: the secret file is readable by others (chmod 600)" : "");
    }
    if (copy == CB_CURVE_ALLOWED && nkeys && copy_pub[0]) snprintf(keys[(*nkeys)++], CB_CURVE_TXT, "%s", copy_pub);
    printf("%-7s %-11s %s  %s\n", kind, name, pub, note);
    return ok;
}

static int run_list(cbctl_t *ctl, const char *dir) {
    printf("CURVE keys in %s\n", dir);
    bool ok = true;
    char listed[CB_CURVE_N_CLIENTS][CB_CURVE_TXT];
    int nlisted = 0;
    for (int i = 0; i < CB_CURVE_N_SERVICES; i++)
        ok &= list_pair(dir, CB_CURVE_SERVER, CB_CURVE_PUBLIC, cb_curve_services[i], NULL, NULL);
    for (int i = 0; i < CB_CURVE_N_CLIENTS; i++)
        ok &= list_pair(dir, CB_CURVE_CLIENT, CB_CURVE_ALLOWED, cb_curve_clients[i], listed, &nlisted);
    /* allowed/ as the services read it: every key once (the services refuse to start otherwise) */
    char adir[1100];
    snprintf(adir, sizeof adir, "%s/allowed", dir);
    DIR *d = opendir(adir);
    int n = 0;
    static char seen[256][CB_CURVE_TXT];
    for (struct dirent *e; d && (e = readdir(d));) {
        size_t len = strlen(e->d_name);
        if (e->d_name[0] == '.' || (len >= 7 && !strcmp(e->d_name + len - 7, "_secret"))) continue;
        char path[1400], pub[CB_CURVE_TXT], err[1024];
        snprintf(path, sizeof path, "%s/%s", adir, e->d_name);
        struct stat st;
        if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) continue;
        if (!cb_curve_read(path, pub, NULL, err, sizeof err)) {
            printf("allowed %-11s %-40s PROBLEM: %s\n", e->d_name, "-", err);
            ok = false;
            continue;
        }
        bool repeat = false;
        for (int k = 0; k < n; k++) repeat |= !strcmp(seen[k], pub);
        if (repeat) {
            printf("allowed %-11s %s  PROBLEM: the same key twice in allowed/ (services refuse to start)\n", e->d_name, pub);
            ok = false;
        } else if (n < 256) {
            snprintf(seen[n++], CB_CURVE_TXT, "%s", pub);
        }
        bool ours = false;
        for (int k = 0; k < nlisted; k++) ours |= !strcmp(listed[k], pub);
        if (!ours && !repeat) printf("allowed %-11s %s  an extra client key (%s)\n", e->d_name, pub, path);
    }
    if (!d) {
        printf("PROBLEM: cannot read %s\n", adir);
        ok = false;
    } else {
        closedir(d);
    }
    printf("%s; %d client keys allowed\n", ok ? "ok" : "problems found", n);
    (void)ctl;
    return ok ? CBCTL_EXIT_OK : CBCTL_EXIT_FAIL;
}

static int run_keys(cbctl_t *ctl, int argc, char **argv) {
    if (argc < 2) return usage(ctl);
    const char *sub = argv[1], *dir_arg = NULL;
    bool force = false;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--force") && !strcmp(sub, "init")) force = true;
        else if (argv[i][0] == '-' || dir_arg) return usage(ctl);
        else dir_arg = argv[i];
    }
    char dir[1024], err[1024];
    if (dir_arg) {
        snprintf(dir, sizeof dir, "%s", dir_arg);
    } else if (!cb_config_data_path(ctl->cfg, "cbctl", "keys_dir", "keys", dir, sizeof dir, err, sizeof err)) {
        cbctl_error(ctl, "%s", err);
        return CBCTL_EXIT_USAGE;
    }
    if (!strcmp(sub, "list")) return run_list(ctl, dir);
    if (strcmp(sub, "init") != 0) return usage(ctl);
    int rc = cb_curve_keys_init(dir, force, err, sizeof err);
    if (rc < 0) {
        cbctl_error(ctl, "keys init: %s", err);
        return CBCTL_EXIT_FAIL;
    }
    if (!ctl->quiet) {
        if (rc == 0)
            printf("%s already holds a complete key set: nothing changed (--force makes a new one)\n", dir);
        else
            printf("made CURVE keys in %s: server/ (%d service key pairs, secret), public/ (their public keys, for "
                   "clients), client/ (%d client key pairs, secret), allowed/ (their public keys, for the services)\n"
                   "turn it on with common.curve = on and common.keys_dir = %s (or CB_COMMON_CURVE=on "
                   "CB_COMMON_KEYS_DIR=...)\n", dir, CB_CURVE_N_SERVICES, CB_CURVE_N_CLIENTS, dir);
    }
    return CBCTL_EXIT_OK;
}

CBCTL_COMMAND(keys, "keys init [--force] [DIR] | keys list [DIR]",
              "make (or list and check) the CURVE key pairs in DIR (default common.keys_dir)", run_keys)
