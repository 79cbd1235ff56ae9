/* kvdir: safe file operations inside the KV directory for cb-cacheindex.
 *
 * Every path a client names is relative to kv_dir and checked by kvdir_path_valid (no absolute path,
 * no "." or ".." component, only [A-Za-z0-9._-] characters, ends in ".kv"). Operations then walk the
 * path one component at a time from a descriptor of kv_dir with O_NOFOLLOW, so a symlink anywhere in
 * the path is refused: nothing outside kv_dir is ever stat'ed or removed, even if someone plants a
 * symlink after the check.
 */
#ifndef CB_KVDIR_H
#define CB_KVDIR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#define KVDIR_MAX_PATH 255
#define KVDIR_MAX_DEPTH 8

typedef struct kvdir_s kvdir_t;

/* Opens (creating it with parents) the directory. NULL with err. */
kvdir_t *kvdir_open(const char *dir, char *err, size_t errlen);
void kvdir_close(kvdir_t **self_p);
const char *kvdir_root(const kvdir_t *d);

/* True when p[0..n) is an acceptable relative KV file path; otherwise false with a reason. */
bool kvdir_path_valid(const char *p, size_t n, char *why, size_t whylen);

/* lstat of a relative path (validated by the caller) without following any symlink. 0, or -1 with
 * errno (ENOENT when missing, ELOOP/ENOTDIR for a symlink on the way). */
int kvdir_stat(const kvdir_t *d, const char *rel, struct stat *st);
/* Removes a regular file at rel (never a symlink or directory). 0 (also when already missing), or -1
 * with errno. */
int kvdir_unlink(const kvdir_t *d, const char *rel);

/* Walks every regular file under kv_dir (not following symlinks, at most KVDIR_MAX_DEPTH levels),
 * calling fn with the relative path, its stat and arg. fn returns true to remove the file. Returns the
 * number of files visited, or -1 with err. */
typedef bool(kvdir_visit_fn)(const char *rel, const struct stat *st, void *arg);
long kvdir_walk(const kvdir_t *d, kvdir_visit_fn *fn, void *arg, char *err, size_t errlen);

#endif
