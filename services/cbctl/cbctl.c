/* cbctl: the command-line client of the cacheblend stack. This file holds main, the command registry
 * and help; each subcommand lives in its own file (cmd_*.c) and registers itself with CBCTL_COMMAND
 * (see cbctl.h).
 *
 *   cbctl [--config PATH] [--SECTION.KEY=VALUE]... [-q] COMMAND [ARGS]
 */
#include "cbctl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire/bus.h"
#include "client.h"
#include "base/log.h"

#define MAX_COMMANDS 32

static const cbctl_cmd_t *s_cmds[MAX_COMMANDS];
static int s_ncmds;

void cbctl_register(const cbctl_cmd_t *cmd) {
    if (s_ncmds < MAX_COMMANDS) s_cmds[s_ncmds++] = cmd;
}

static int by_name(const void *a, const void *b) {
    return strcmp((*(const cbctl_cmd_t *const *)a)->name, (*(const cbctl_cmd_t *const *)b)->name);
}

static void help(FILE *f) {
    qsort(s_cmds, (size_t)s_ncmds, sizeof *s_cmds, by_name);
    fprintf(f, "usage: cbctl [--config PATH] [--SECTION.KEY=VALUE]... [-q] COMMAND [ARGS]\n\ncommands:\n");
    for (int i = 0; i < s_ncmds; i++) fprintf(f, "  %-38s %s\n", s_cmds[i]->usage, s_cmds[i]->summary);
    fprintf(f, "  %-38s %s\n", "help", "this text");
    fprintf(f, "\noptions:\n"
               "  --config PATH           configuration file (default $CB_CONFIG, else config/cacheblend.cfg)\n"
               "  --SECTION.KEY=VALUE     override any configuration key, e.g. --blend.endpoint=tcp://h:5555\n"
               "                          (environment: CB_<SECTION>_<KEY>; cbctl's own keys: --KEY VALUE)\n"
               "  -q, --quiet             print nothing; only the exit status\n"
               "\nexit status: 0 ok, 1 a service answered with an error, 2 bad usage,\n"
               "             3 a service is unreachable or did not answer in time,\n"
               "             4 (health) every service answers, but one or more is degraded (its data disk is full)\n");
}

int main(int argc, char **argv) {
    cb_log_set_component("cbctl");
    if (!getenv("CB_LOG_LEVEL")) cb_log_set_level(CB_LOG_WARN);
    setenv("ZSYS_SIGHANDLER", "false", 0); /* Ctrl-C ends cbctl at once */
    char err[512];
    cbctl_t ctl = {0};
    ctl.cfg = cb_config_new("cbctl", &argc, argv, err, sizeof err);
    if (!ctl.cfg) {
        fprintf(stderr, "cbctl: %s\n", err);
        return CBCTL_EXIT_USAGE;
    }
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (!strcmp(argv[i], "-q") || !strcmp(argv[i], "--quiet")) ctl.quiet = true;
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            help(stdout);
            cb_config_destroy(&ctl.cfg);
            return CBCTL_EXIT_OK;
        } else {
            fprintf(stderr, "cbctl: unknown option %s (see cbctl help)\n", argv[i]);
            cb_config_destroy(&ctl.cfg);
            return CBCTL_EXIT_USAGE;
        }
    }
    if (i >= argc || !strcmp(argv[i], "help")) {
        help(i >= argc ? stderr : stdout);
        cb_config_destroy(&ctl.cfg);
        return i >= argc ? CBCTL_EXIT_USAGE : CBCTL_EXIT_OK;
    }
    const cbctl_cmd_t *cmd = NULL;
    for (int k = 0; k < s_ncmds; k++)
        if (!strcmp(s_cmds[k]->name, argv[i])) cmd = s_cmds[k];
    if (!cmd) {
        fprintf(stderr, "cbctl: unknown command '%s' (see cbctl help)\n", argv[i]);
        cb_config_destroy(&ctl.cfg);
        return CBCTL_EXIT_USAGE;
    }
    zsys_init();
    int rc = cmd->run(&ctl, argc - i, argv + i);
    cb_config_destroy(&ctl.cfg);
    return rc;
}
