/* cbctl: the command-line client of the cacheblend stack. This header is what a subcommand file in
 * services/cbctl/ needs: the context every command gets, the registration macro and the exit codes.
 * Client helpers (talking to the services) are in client.h.
 *
 * Adding a subcommand: create services/cbctl/cmd_<name>.c with
 *
 *     #include "cbctl.h"
 *     #include "client.h"
 *     static int run_ingest(cbctl_t *ctl, int argc, char **argv) { ... return CBCTL_EXIT_OK; }
 *     CBCTL_COMMAND(ingest, "ingest [--wait] PATH...", "send documents to cb-precompute", run_ingest)
 *
 * Nothing else changes: every .c file of services/cbctl links into cbctl (see the Makefile), and the
 * macro registers the command before main runs. argv[0] is the command name; argv has had the global
 * options and every --config / --section.key=value flag removed already (cb_config_new).
 */
#ifndef CBCTL_H
#define CBCTL_H

#include <stdbool.h>

#include "wire/config.h"

/* Exit codes (documented in `cbctl help`). */
enum {
    CBCTL_EXIT_OK = 0,          /* everything asked for succeeded */
    CBCTL_EXIT_FAIL = 1,        /* a service answered with an error, or the work failed */
    CBCTL_EXIT_USAGE = 2,       /* bad command line */
    CBCTL_EXIT_UNAVAILABLE = 3, /* a service could not be reached or did not answer in time */
    CBCTL_EXIT_DEGRADED = 4,    /* health: every service answers, one or more degraded (a full data disk) */
};

typedef struct {
    cb_config_t *cfg; /* section "cbctl" (client timeouts) + each service's endpoint */
    bool quiet;       /* -q: print nothing, the exit code says it all */
} cbctl_t;

typedef struct {
    const char *name;    /* the word after cbctl */
    const char *usage;   /* e.g. "stats [--json] [SERVICE...]" */
    const char *summary; /* one line for `cbctl help` */
    int (*run)(cbctl_t *ctl, int argc, char **argv);
} cbctl_cmd_t;

/* Adds a command (called by CBCTL_COMMAND before main). At most 32 commands. */
void cbctl_register(const cbctl_cmd_t *cmd);

#define CBCTL_COMMAND(id, usage_, summary_, fn)                                              \
    static const cbctl_cmd_t cbctl_cmd_##id = {#id, usage_, summary_, fn};                   \
    __attribute__((constructor)) static void cbctl_register_##id(void) { cbctl_register(&cbctl_cmd_##id); }

#endif
