/* cb-kvcheck: checks every KV file under a kv_dir the way a reader would (integrity only: header checksum,
 * layout, size, payload checksums; no model expectation), and counts stray temporary files. For the fault
 * suite (tests/faults/diskfull.sh): after a full disk, every file under its final name must be whole.
 *
 *   cb-kvcheck KV_DIR
 *
 * Output: one JSON object {"files", "valid", "invalid", "reasons": {miss reason: count}, "tmp"}; the name of
 * each invalid file goes to stderr.
 * Exit: 0 every *.kv file is valid, 1 some are not, 2 usage or an unreadable directory.
 */
#include <dirent.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "format/kvfile.h"

#define MAX_ENTRIES 1000000 /* per directory: a bound on the walk */

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !strcmp(s + n - m, suffix);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: cb-kvcheck KV_DIR\n");
        return 2;
    }
    DIR *top = opendir(argv[1]);
    if (!top) {
        perror(argv[1]);
        return 2;
    }
    long files = 0, valid = 0, tmp = 0;
    json_t *reasons = json_object();
    struct dirent *e;
    for (long i = 0; i < MAX_ENTRIES && (e = readdir(top)); i++) {
        if (e->d_name[0] == '.') continue;
        char sub[4096];
        snprintf(sub, sizeof sub, "%s/%s", argv[1], e->d_name);
        struct stat st;
        if (lstat(sub, &st) != 0 || !S_ISDIR(st.st_mode)) continue;
        DIR *d = opendir(sub);
        if (!d) continue;
        struct dirent *f;
        for (long j = 0; j < MAX_ENTRIES && (f = readdir(d)); j++) {
            if (strstr(f->d_name, ".kv.tmp.")) {
                tmp++;
                continue;
            }
            if (!ends_with(f->d_name, ".kv")) continue;
            char path[8192];
            snprintf(path, sizeof path, "%s/%s", sub, f->d_name);
            files++;
            cb_kv_miss_t why = CB_KV_OK;
            char err[256];
            cb_kvfile_t *kf = cb_kvfile_open(path, NULL, &why, err, sizeof err);
            if (kf) why = cb_kvfile_verify(kf);
            cb_kvfile_destroy(&kf);
            if (why == CB_KV_OK) {
                valid++;
                continue;
            }
            const char *r = cb_kv_miss_str(why);
            json_t *c = json_object_get(reasons, r);
            json_object_set_new(reasons, r, json_integer(c ? json_integer_value(c) + 1 : 1));
            fprintf(stderr, "cb-kvcheck: %s: %s\n", path, r);
        }
        closedir(d);
    }
    closedir(top);
    json_t *out = json_pack("{s:I, s:I, s:I, s:o, s:I}", "files", (json_int_t)files, "valid", (json_int_t)valid,
                            "invalid", (json_int_t)(files - valid), "reasons", reasons, "tmp", (json_int_t)tmp);
    json_dumpf(out, stdout, JSON_COMPACT);
    fputc('\n', stdout);
    json_decref(out);
    return files == valid ? 0 : 1;
}
