# mk/cuda.mk: build rules for the GPU test programs (tests/gpu/test_*.c -> build/gpu/test_*).
# Included by the Makefile (`-include mk/cuda.mk`), or used directly as
#   make -f Makefile -f mk/cuda.mk build/gpu/test_gpu
# Without CUDA (CB_CUDA=0 or no nvcc) the programs still build: they print a skip line and exit 0.
ifndef CB_CUDA_MK_INCLUDED
CB_CUDA_MK_INCLUDED := 1

GPU_TEST_SRC := $(wildcard tests/gpu/test_*.c)
GPU_TESTS    := $(patsubst tests/gpu/%.c,build/gpu/%,$(GPU_TEST_SRC))

# They call CUDA directly, so they link the backend in (CUDA_STATIC: libcbcuda.a and the CUDA libraries).
build/gpu/%: tests/gpu/%.c tests/test.h build/lib/libshared.a $(CUDA_LIB) $(LIB_HDR)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Itests $< build/lib/libshared.a $(CUDA_STATIC) $(LDLIBS) -o $@

.PHONY: gpu-tests
gpu-tests: $(GPU_TESTS)
endif
