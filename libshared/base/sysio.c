/* sysio: the I/O seam's fault-build bodies (sysio.h); the release build inlines the calls instead. */
#include "base/sysio.h"

#ifdef CB_FAULT_INJECT
#include "base/fault.h"

ssize_t cb_io_read(int fd, void *buf, size_t n) { return cb_fault_point(CB_FAULT_IO) ? -1 : read(fd, buf, n); }
ssize_t cb_io_pread(int fd, void *buf, size_t n, off_t off) {
    return cb_fault_point(CB_FAULT_IO) ? -1 : pread(fd, buf, n, off);
}
ssize_t cb_io_write(int fd, const void *buf, size_t n) { return cb_fault_point(CB_FAULT_IO) ? -1 : write(fd, buf, n); }
ssize_t cb_io_pwrite(int fd, const void *buf, size_t n, off_t off) {
    return cb_fault_point(CB_FAULT_IO) ? -1 : pwrite(fd, buf, n, off);
}
int cb_io_fsync(int fd) { return cb_fault_point(CB_FAULT_IO) ? -1 : fsync(fd); }
int cb_io_renameat(int olddirfd, const char *oldpath, int newdirfd, const char *newpath) {
    return cb_fault_point(CB_FAULT_IO) ? -1 : renameat(olddirfd, oldpath, newdirfd, newpath);
}
void *cb_io_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    return cb_fault_point(CB_FAULT_IO) ? MAP_FAILED : mmap(addr, len, prot, flags, fd, off);
}
#else
typedef int cb_sysio_release_build_t; /* nothing to compile: sysio.h inlines the calls */
#endif
