/* vfs: SQLite's allocator and a shim VFS as failure points (vfs.h). */
#include "vfs.h"

#include <errno.h>
#include <jansson.h>
#include <sqlite3.h>
#include <stdio.h>
#include <string.h>

#include "base/fault.h"

/* ---- allocators ---------------------------------------------------------------------------------------- */

static sqlite3_mem_methods g_mem; /* SQLite's own allocator, wrapped */

static void *mem_malloc(int n) { return cb_fault_point(CB_FAULT_ALLOC) ? NULL : g_mem.xMalloc(n); }
static void mem_free(void *p) { g_mem.xFree(p); }
static void *mem_realloc(void *p, int n) { return cb_fault_point(CB_FAULT_ALLOC) ? NULL : g_mem.xRealloc(p, n); }
static int mem_size(void *p) { return g_mem.xSize(p); }
static int mem_roundup(int n) { return g_mem.xRoundup(n); }
static int mem_init(void *app) { return g_mem.xInit(app); }
static void mem_shutdown(void *app) { g_mem.xShutdown(app); }

static void *json_fault_malloc(size_t n) { return cb_fault_point(CB_FAULT_ALLOC) ? NULL : malloc(n); }
static void json_fault_free(void *p) { free(p); }

/* ---- the shim VFS -------------------------------------------------------------------------------------- */

/* A file of the shim: its header, then the real VFS's file in the same allocation (szOsFile). */
typedef struct {
    sqlite3_file base;
    sqlite3_file *real;
} ffile_t;

static sqlite3_vfs *g_real;  /* the platform VFS ("unix") */
static sqlite3_vfs g_vfs;

#define REAL(f) (((ffile_t *)(f))->real)

static int io_err(int otherwise) { return errno == ENOSPC ? SQLITE_FULL : otherwise; }

static int f_close(sqlite3_file *f) {
    sqlite3_file *r = REAL(f);
    return r->pMethods ? r->pMethods->xClose(r) : SQLITE_OK;
}
static int f_read(sqlite3_file *f, void *buf, int n, sqlite3_int64 off) {
    if (cb_fault_point(CB_FAULT_IO)) return SQLITE_IOERR_READ;
    return REAL(f)->pMethods->xRead(REAL(f), buf, n, off);
}
static int f_write(sqlite3_file *f, const void *buf, int n, sqlite3_int64 off) {
    if (cb_fault_point(CB_FAULT_IO)) return io_err(SQLITE_IOERR_WRITE);
    return REAL(f)->pMethods->xWrite(REAL(f), buf, n, off);
}
static int f_truncate(sqlite3_file *f, sqlite3_int64 size) {
    if (cb_fault_point(CB_FAULT_IO)) return io_err(SQLITE_IOERR_TRUNCATE);
    return REAL(f)->pMethods->xTruncate(REAL(f), size);
}
static int f_sync(sqlite3_file *f, int flags) {
    if (cb_fault_point(CB_FAULT_IO)) return SQLITE_IOERR_FSYNC;
    return REAL(f)->pMethods->xSync(REAL(f), flags);
}
static int f_size(sqlite3_file *f, sqlite3_int64 *size) { return REAL(f)->pMethods->xFileSize(REAL(f), size); }
static int f_lock(sqlite3_file *f, int l) { return REAL(f)->pMethods->xLock(REAL(f), l); }
static int f_unlock(sqlite3_file *f, int l) { return REAL(f)->pMethods->xUnlock(REAL(f), l); }
static int f_check(sqlite3_file *f, int *out) { return REAL(f)->pMethods->xCheckReservedLock(REAL(f), out); }
static int f_fcntl(sqlite3_file *f, int op, void *arg) { return REAL(f)->pMethods->xFileControl(REAL(f), op, arg); }
static int f_sector(sqlite3_file *f) { return REAL(f)->pMethods->xSectorSize(REAL(f)); }
static int f_devchar(sqlite3_file *f) { return REAL(f)->pMethods->xDeviceCharacteristics(REAL(f)); }
static int f_shm_map(sqlite3_file *f, int pg, int sz, int ext, void volatile **p) {
    return REAL(f)->pMethods->xShmMap(REAL(f), pg, sz, ext, p);
}
static int f_shm_lock(sqlite3_file *f, int off, int n, int flags) {
    return REAL(f)->pMethods->xShmLock(REAL(f), off, n, flags);
}
static void f_shm_barrier(sqlite3_file *f) { REAL(f)->pMethods->xShmBarrier(REAL(f)); }
static int f_shm_unmap(sqlite3_file *f, int del) { return REAL(f)->pMethods->xShmUnmap(REAL(f), del); }
static int f_fetch(sqlite3_file *f, sqlite3_int64 off, int n, void **p) {
    return REAL(f)->pMethods->xFetch(REAL(f), off, n, p);
}
static int f_unfetch(sqlite3_file *f, sqlite3_int64 off, void *p) { return REAL(f)->pMethods->xUnfetch(REAL(f), off, p); }

/* One method table per iVersion of the real file's (1: no shm, 2: shm, 3: memory-mapped fetch). */
static sqlite3_io_methods g_io[3];

static int v_open(sqlite3_vfs *vfs, sqlite3_filename name, sqlite3_file *f, int flags, int *out_flags) {
    (void)vfs;
    ffile_t *ff = (ffile_t *)f;
    ff->base.pMethods = NULL;
    ff->real = (sqlite3_file *)&ff[1];
    memset(ff->real, 0, (size_t)g_real->szOsFile);
    if (cb_fault_point(CB_FAULT_IO)) return SQLITE_CANTOPEN;
    int rc = g_real->xOpen(g_real, name, ff->real, flags, out_flags);
    if (ff->real->pMethods) {
        int v = ff->real->pMethods->iVersion;
        ff->base.pMethods = &g_io[(v < 1 ? 1 : v > 3 ? 3 : v) - 1];
    }
    return rc;
}

int faultvfs_install(char *err, size_t errlen) {
    if (sqlite3_config(SQLITE_CONFIG_GETMALLOC, &g_mem) != SQLITE_OK) {
        snprintf(err, errlen, "sqlite3_config(GETMALLOC) failed (SQLite already initialized?)");
        return -1;
    }
    sqlite3_mem_methods m = {mem_malloc, mem_free, mem_realloc, mem_size, mem_roundup, mem_init, mem_shutdown, NULL};
    if (sqlite3_config(SQLITE_CONFIG_MALLOC, &m) != SQLITE_OK) {
        snprintf(err, errlen, "sqlite3_config(MALLOC) failed");
        return -1;
    }
    json_set_alloc_funcs(json_fault_malloc, json_fault_free);
    if (sqlite3_initialize() != SQLITE_OK || !(g_real = sqlite3_vfs_find(NULL))) {
        snprintf(err, errlen, "sqlite3_initialize failed");
        return -1;
    }
    sqlite3_io_methods io = {1,        f_close,  f_read,   f_write,       f_truncate, f_sync,
                             f_size,   f_lock,   f_unlock, f_check,       f_fcntl,    f_sector,
                             f_devchar, f_shm_map, f_shm_lock, f_shm_barrier, f_shm_unmap, f_fetch,
                             f_unfetch};
    for (int v = 0; v < 3; v++) {
        g_io[v] = io;
        g_io[v].iVersion = v + 1;
    }
    g_vfs = *g_real;
    g_vfs.zName = "cbfault";
    g_vfs.szOsFile = (int)sizeof(ffile_t) + g_real->szOsFile;
    g_vfs.xOpen = v_open;
    if (sqlite3_vfs_register(&g_vfs, 1) != SQLITE_OK) {
        snprintf(err, errlen, "sqlite3_vfs_register failed");
        return -1;
    }
    return 0;
}
