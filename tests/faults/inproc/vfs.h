/* vfs: failure points inside SQLite for the in-process fault driver (cb-faultpaths.c).
 *
 * faultvfs_install() must run before SQLite is first used. It routes SQLite's allocator (SQLITE_CONFIG_MALLOC)
 * through the CB_FAULT_ALLOC failure points of base/fault.h and registers, as the default VFS, a shim over the
 * platform's VFS whose open, read, write, truncate and sync calls are CB_FAULT_IO failure points: a failed
 * write answers SQLITE_FULL when the armed errno is ENOSPC, else SQLITE_IOERR_WRITE; a failed read
 * SQLITE_IOERR_READ; a failed sync SQLITE_IOERR_FSYNC; a failed open SQLITE_CANTOPEN. Everything else passes
 * through. jansson's allocator goes through the allocation failure points too. 0, or -1 with err.
 */
#ifndef CB_FAULTVFS_H
#define CB_FAULTVFS_H

#include <stddef.h>

int faultvfs_install(char *err, size_t errlen);

#endif
