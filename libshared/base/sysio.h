/* sysio: the I/O seam of the files whose failures matter (KV files, the config): read, pread, write, pwrite,
 * fsync, renameat and mmap.
 *
 * The same contract as the POSIX calls they name (-1 and errno on failure, short counts as POSIX allows).
 * Release build: inline calls. Fault build (-DCB_FAULT_INJECT): each call is a failure point of
 * base/fault.h that fails with the armed errno (ENOSPC, EIO) before touching the file. The job table is a
 * SQLite database: its I/O fails through a test VFS instead (tests/faults/inproc).
 */
#ifndef CB_SYSIO_H
#define CB_SYSIO_H

#include <stdio.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

#ifdef CB_FAULT_INJECT
ssize_t cb_io_read(int fd, void *buf, size_t n);
ssize_t cb_io_pread(int fd, void *buf, size_t n, off_t off);
ssize_t cb_io_write(int fd, const void *buf, size_t n);
ssize_t cb_io_pwrite(int fd, const void *buf, size_t n, off_t off);
int cb_io_fsync(int fd);
int cb_io_renameat(int olddirfd, const char *oldpath, int newdirfd, const char *newpath);
/* A failed map returns MAP_FAILED with errno set, like mmap. */
void *cb_io_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off);
#else
static inline ssize_t cb_io_read(int fd, void *buf, size_t n) { return read(fd, buf, n); }
static inline ssize_t cb_io_pread(int fd, void *buf, size_t n, off_t off) { return pread(fd, buf, n, off); }
static inline ssize_t cb_io_write(int fd, const void *buf, size_t n) { return write(fd, buf, n); }
static inline ssize_t cb_io_pwrite(int fd, const void *buf, size_t n, off_t off) { return pwrite(fd, buf, n, off); }
static inline int cb_io_fsync(int fd) { return fsync(fd); }
static inline int cb_io_renameat(int olddirfd, const char *oldpath, int newdirfd, const char *newpath) {
    return renameat(olddirfd, oldpath, newdirfd, newpath);
}
static inline void *cb_io_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    return mmap(addr, len, prot, flags, fd, off);
}
#endif

#endif
