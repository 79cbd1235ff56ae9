/* fake_libcuda: a stand-in for the CUDA driver (libcuda.so.1) that reports one device and offers nothing
 * else, so test_backend_select can drive backend_select's "a device is present" path on a host without a
 * GPU: the backend library is loaded, and the CUDA runtime then fails to use this driver, which must be a
 * clear error. Built as build/tests/fakecuda/libcuda.so.1 in CUDA builds (Makefile). */
int cuInit(unsigned flags);
int cuDeviceGetCount(int *count);

int cuInit(unsigned flags) {
    (void)flags;
    return 0;
}

int cuDeviceGetCount(int *count) {
    *count = 1;
    return 0;
}
