/* kvdir: path validation and symlink-proof file operations under the KV directory. See kvdir.h. */
#include "kvdir.h"
#include "base/alloc.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "wire/db.h"

struct kvdir_s {
    int fd; /* O_DIRECTORY descriptor of kv_dir */
    char *root;
};

kvdir_t *kvdir_open(const char *dir, char *err, size_t errlen) {
    if (cb_db_mkdirs(dir, err, errlen) != 0) return NULL;
    kvdir_t *d = cb_calloc(1, sizeof *d);
    if (!d || !(d->root = cb_strdup(dir))) {
        free(d);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    d->fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d->fd < 0) {
        snprintf(err, errlen, "cannot open KV directory %s: %s", dir, strerror(errno));
        free(d->root);
        free(d);
        return NULL;
    }
    return d;
}

void kvdir_close(kvdir_t **self_p) {
    if (!self_p || !*self_p) return;
    close((*self_p)->fd);
    free((*self_p)->root);
    free(*self_p);
    *self_p = NULL;
}

const char *kvdir_root(const kvdir_t *d) { return d->root; }

bool kvdir_path_valid(const char *p, size_t n, char *why, size_t whylen) {
    if (n == 0 || n > KVDIR_MAX_PATH) {
        snprintf(why, whylen, "path must be 1..%d bytes", KVDIR_MAX_PATH);
        return false;
    }
    if (p[0] == '/') {
        snprintf(why, whylen, "path must be relative to kv_dir");
        return false;
    }
    int depth = 0;
    size_t start = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i == n || p[i] == '/') {
            size_t len = i - start;
            if (len == 0 || (len == 1 && p[start] == '.') || (len == 2 && p[start] == '.' && p[start + 1] == '.')) {
                snprintf(why, whylen, "path has an empty, '.' or '..' component");
                return false;
            }
            if (++depth > KVDIR_MAX_DEPTH) {
                snprintf(why, whylen, "path has more than %d components", KVDIR_MAX_DEPTH);
                return false;
            }
            start = i + 1;
            continue;
        }
        char c = p[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
              c == '-')) {
            snprintf(why, whylen, "path contains a byte outside [A-Za-z0-9._-/] (0x%02x)", (unsigned char)c);
            return false;
        }
    }
    if (n < 4 || memcmp(p + n - 3, ".kv", 3) != 0 || p[n - 4] == '/') {
        snprintf(why, whylen, "path must name a '*.kv' file");
        return false;
    }
    return true;
}

/* Opens the directory holding rel's last component, walking from d->fd with O_NOFOLLOW. Returns the
 * descriptor (caller closes; may be d->fd itself: then *owned is false) and the last component. */
static int open_parent(const kvdir_t *d, const char *rel, const char **last, bool *owned) {
    char buf[KVDIR_MAX_PATH + 1];
    size_t n = strlen(rel);
    if (n > KVDIR_MAX_PATH) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(buf, rel, n + 1);
    int fd = d->fd;
    *owned = false;
    char *p = buf;
    char *slash;
    while ((slash = strchr(p, '/'))) {
        *slash = 0;
        int nfd = openat(fd, p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        int e = errno;
        if (*owned) close(fd);
        if (nfd < 0) {
            errno = e;
            return -1;
        }
        fd = nfd;
        *owned = true;
        p = slash + 1;
    }
    *last = rel + (p - buf);
    return fd;
}

int kvdir_stat(const kvdir_t *d, const char *rel, struct stat *st) {
    const char *last;
    bool owned;
    int fd = open_parent(d, rel, &last, &owned);
    if (fd < 0) return -1;
    int rc = fstatat(fd, last, st, AT_SYMLINK_NOFOLLOW);
    int e = errno;
    if (owned) close(fd);
    errno = e;
    return rc;
}

int kvdir_unlink(const kvdir_t *d, const char *rel) {
    const char *last;
    bool owned;
    int fd = open_parent(d, rel, &last, &owned);
    if (fd < 0) return errno == ENOENT ? 0 : -1;
    struct stat st;
    int rc = 0;
    if (fstatat(fd, last, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        rc = errno == ENOENT ? 0 : -1;
    } else if (!S_ISREG(st.st_mode)) {
        errno = EPERM;
        rc = -1;
    } else if (unlinkat(fd, last, 0) != 0 && errno != ENOENT) {
        rc = -1;
    }
    int e = errno;
    if (owned) close(fd);
    errno = e;
    return rc;
}

static long walk(int dirfd, char *rel, size_t rlen, int depth, kvdir_visit_fn *fn, void *arg, char *err,
                 size_t errlen) {
    int fd = dup(dirfd);
    if (fd < 0) {
        snprintf(err, errlen, "dup: %s", strerror(errno));
        return -1;
    }
    DIR *dir = fdopendir(fd);
    if (!dir) {
        close(fd);
        snprintf(err, errlen, "cannot read directory: %s", strerror(errno));
        return -1;
    }
    rewinddir(dir);
    long visited = 0;
    struct dirent *de;
    while ((de = readdir(dir))) {
        const char *name = de->d_name;
        if (!strcmp(name, ".") || !strcmp(name, "..")) continue;
        size_t nl = strlen(name);
        if (rlen + nl + 2 > KVDIR_MAX_PATH + 1) continue; /* too long to be ours */
        struct stat st;
        if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        size_t save = rlen;
        if (rlen) rel[rlen++] = '/';
        memcpy(rel + rlen, name, nl + 1);
        rlen += nl;
        if (S_ISDIR(st.st_mode) && depth < KVDIR_MAX_DEPTH) {
            int sub = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (sub >= 0) {
                long v = walk(sub, rel, rlen, depth + 1, fn, arg, err, errlen);
                close(sub);
                if (v < 0) {
                    closedir(dir);
                    return -1;
                }
                visited += v;
            }
        } else if (S_ISREG(st.st_mode)) {
            visited++;
            if (fn(rel, &st, arg)) unlinkat(dirfd, name, 0);
        }
        rlen = save;
        rel[rlen] = 0;
    }
    closedir(dir);
    return visited;
}

long kvdir_walk(const kvdir_t *d, kvdir_visit_fn *fn, void *arg, char *err, size_t errlen) {
    char rel[KVDIR_MAX_PATH + 2] = "";
    return walk(d->fd, rel, 0, 1, fn, arg, err, errlen);
}
