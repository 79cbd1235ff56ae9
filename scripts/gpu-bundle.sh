#!/usr/bin/env bash
# Builds the GPU test (tests/gpu/test_gpu) and the GPU benchmark (cb-bench-gpu) as portable binaries in
# build/gpu-bundle/bin, for a GPU machine that has the CUDA toolkit and driver but not this project's build
# dependencies (no package registry there). Portable: -march=x86-64-v3 instead of -march=native, the CUDA
# runtime linked statically, only the libraries actually used kept (--as-needed), and those that a CUDA
# image may lack (OpenBLAS, libsodium, gfortran, quadmath, gomp) copied to build/gpu-bundle/lib, found
# through an $ORIGIN rpath. cuBLAS comes from the GPU machine's toolkit (same major version, 13). The CUDA
# backend is linked into both programs (libcbcuda.a), so the bundle needs no libcbcuda.so.
# Carry build/gpu-bundle (< 64 MiB); scripts/gpu-check.sh uses it when `make cuda` fails there.
set -eu
cd "$(dirname "$0")/.."
if ! command -v "${NVCC:-nvcc}" >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
NVCC=${NVCC:-nvcc}
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v "$NVCC")")")}
B=build/gpu-bundle
rm -rf "$B"
mkdir -p "$B/obj" "$B/bin" "$B/lib"
PKGS="libczmq libzmq msgpack sqlite3 openblas libpcre2-8 libsodium libxxhash jansson"
CF="-std=c11 -D_GNU_SOURCE -O2 -g0 -march=x86-64-v3 -fopenmp -Ilibshared -Ikernels $(pkg-config --cflags $PKGS) -DCB_HAVE_CUDA=1 -I$CUDA_HOME/include"
echo "gpu-bundle: compiling libshared (x86-64-v3)" >&2
ls libshared/*/*.c kernels/cpu/*.c | xargs -P "$(nproc 2>/dev/null || echo 2)" -I{} sh -c \
  'cc '"$CF"' -c "$1" -o "'"$B"'/obj/$(echo "$1" | tr / _).o"' _ {}
ar rcs "$B/libshared.a" "$B"/obj/*.o
echo "gpu-bundle: building the CUDA library" >&2
make CB_CUDA=1 build/lib/libcbcuda.a >&2
LIBS="-Wl,--as-needed $(pkg-config --libs $PKGS) -lm -lpthread -fopenmp -L$CUDA_HOME/lib64 -L$CUDA_HOME/targets/x86_64-linux/lib -lcublasLt -lcublas -lcudart_static -ldl -lrt -lstdc++"
RP="-Wl,--disable-new-dtags -Wl,-rpath,\$ORIGIN/../lib -Wl,-rpath,/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/targets/x86_64-linux/lib"
# Both programs link the CUDA backend in and export it: backend_select (which would otherwise dlopen
# libcbcuda.so, absent from the bundle) then finds and uses this copy (Makefile: CUDA_STATIC).
LIBS="$LIBS -Wl,-u,cb_backend_cuda_new -Wl,-u,cb_cuda_device_count -Wl,--export-dynamic"
cc $CF -Itests tests/gpu/test_gpu.c "$B/libshared.a" build/lib/libcbcuda.a $LIBS $RP -o "$B/bin/test_gpu"
cc $CF tools/bench/cb-bench-gpu.c "$B/libshared.a" build/lib/libcbcuda.a $LIBS $RP -o "$B/bin/cb-bench-gpu"
for bin in "$B"/bin/*; do
  ldd "$bin" | awk '/=>/ {print $1, $3}' | while read -r name path; do
    case "$name" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*|libcuda.so*|libcublas*|libcudart*) ;;
      *) [ -e "$B/lib/$name" ] || cp -L "$path" "$B/lib/$name" ;;
    esac
  done
done
rm -rf "$B/obj" "$B/libshared.a"
glibc=$(objdump -T "$B"/bin/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
echo "gpu-bundle: $(du -sh "$B" | cut -f1) in $B (bin: $(ls "$B/bin" | tr '\n' ' '); lib: $(ls "$B/lib" | tr '\n' ' ')); needs $glibc or newer, libcublas.so.13, a CUDA 13 driver" >&2
