# cacheblend: one entry point.  make | make check | make test | make demo | make bench | make cuda
#
# Layout conventions (so new files need no Makefile edit):
#   libshared/<layer>/*.c, kernels/cpu/*.c -> build/lib/libshared.a (layers: scripts/check-layers)
#   services/<dir>/cb*.c                 -> one program each, build/bin/<file stem>;
#                                           the other .c files of <dir> link into each of them
#   tools/<dir>/cb*.c, tests/tools/cb*.c -> the same (tools/: engine, eval, bench, wire; tests/tools: the
#                                           test-only fault and fuzz clients); tools/common/*.c link into
#                                           every program under tools/
#   tests/unit/test_*.c                  -> build/tests/<stem> (and build/asan/tests/<stem>)
#   tests/fuzz/fuzz_*.c                  -> build/fuzz/<stem> (clang libFuzzer, `make fuzz`)
#   kernels/cuda/*.cu                    -> build/lib/libcbcuda.so (loaded at run time, only where a GPU is)
#                                           and build/lib/libcbcuda.a, when nvcc is found (or `make cuda`)

CC      ?= cc
ARCHFLAGS ?= -march=native
CSTD    := -std=c11 -D_GNU_SOURCE
WARN    := -Wall -Wextra -Werror
PKGS    := libczmq libzmq msgpack sqlite3 openblas libpcre2-8 libsodium libxxhash jansson hiredis
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CFLAGS  ?= -O2 -g
ALL_CFLAGS = $(CSTD) $(WARN) $(CFLAGS) $(ARCHFLAGS) -fopenmp -Ilibshared -Ikernels $(PKG_CFLAGS)
LDLIBS  := $(PKG_LIBS) -lm -lpthread -fopenmp
# Libraries only one program folder links (services/<dir>, tools/<dir> -> DIR_LIBS_<dir>).
DIR_LIBS_gateway := $(shell pkg-config --libs libmicrohttpd 2>/dev/null)
DIR_CFLAGS_gateway := $(shell pkg-config --cflags libmicrohttpd 2>/dev/null)

SAN_FLAGS := -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined

LIB_SRC  := $(wildcard libshared/*/*.c kernels/cpu/*.c)
LIB_HDR  := $(wildcard libshared/*/*.h kernels/cpu/*.h kernels/cuda/*.h)
SVC_DIRS := $(wildcard services/*)
TOOL_DIRS := $(filter-out tools/common,$(wildcard tools/*)) tests/tools
PROG_SRC := $(foreach d,$(SVC_DIRS) $(TOOL_DIRS),$(wildcard $(d)/cb*.c))
PROGS    := $(foreach s,$(PROG_SRC),build/bin/$(basename $(notdir $(s))))
TEST_SRC := $(wildcard tests/unit/test_*.c)
TESTS    := $(patsubst tests/unit/%.c,build/tests/%,$(TEST_SRC))
ASAN_TESTS := $(patsubst tests/unit/%.c,build/asan/tests/%,$(TEST_SRC))
FUZZ_SRC := $(wildcard tests/fuzz/fuzz_*.c)

# CUDA: built when nvcc is on PATH (CB_CUDA=0 turns it off, `make cuda` forces it).
NVCC    ?= nvcc
CB_CUDA ?= $(if $(shell command -v $(NVCC) 2>/dev/null),1,0)
CU_SRC  := $(wildcard kernels/cuda/*.cu)
NVFLAGS ?= -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 -Ilibshared -Ikernels -Xcompiler -fPIC
# The CUDA backend is the shared library build/lib/libcbcuda.so, which engine/backend_select.c opens with
# dlopen only when the driver reports a device (so a host without a GPU never maps cuBLAS; see
# backend_select.h). The programs link CUDA_DL: libdl, their symbols exported (the library resolves the
# libshared functions it calls against the program) and those functions forced in (build/lib/libcbcuda.needs,
# made from the library's undefined symbols). Programs that call CUDA themselves (cb-bench-gpu, tests/gpu)
# link CUDA_STATIC instead: libcbcuda.a and the CUDA libraries, as before, with the backend's entry points
# kept and exported so that backend_select uses that copy rather than loading a second one.
CUDA_DL :=
CUDA_STATIC :=
ifeq ($(CB_CUDA),1)
ifneq ($(CU_SRC),)
CUDA_LIB := build/lib/libcbcuda.a
CUDA_SO  := build/lib/libcbcuda.so
CUDA_NEEDS := build/lib/libcbcuda.needs
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(shell command -v $(NVCC)))
ALL_CFLAGS += -DCB_HAVE_CUDA=1 -I$(CUDA_HOME)/include
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/targets/x86_64-linux/lib -lcublasLt -lcublas -lcudart -lstdc++
CUDA_DL := -ldl -Wl,--export-dynamic @$(CUDA_NEEDS)
CUDA_STATIC := $(CUDA_LIB) -Wl,-u,cb_backend_cuda_new -Wl,-u,cb_cuda_device_count -ldl -Wl,--export-dynamic $(CUDA_LIBS)
endif
endif
# How each program gets the CUDA backend (default CUDA_DL).
CUDA_LINK_cb-bench-gpu = $(CUDA_STATIC)

.PHONY: all check test test-models test-faults test-faults-inproc test-gpu demo bench bench-engine bench-stack bench-serve bench-gateway bench-curve bench-redis cuda fuzz clean model check-layers
all: build/lib/libshared.a $(CUDA_LIB) $(CUDA_SO) $(PROGS)

build/obj/%.o: %.c $(LIB_HDR)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

build/asan/obj/%.o: %.c $(LIB_HDR)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(SAN_FLAGS) -c $< -o $@

build/obj/%.cu.o: %.cu $(LIB_HDR)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

build/lib/libshared.a: $(patsubst %.c,build/obj/%.o,$(LIB_SRC))
	@mkdir -p $(dir $@)
	ar rcs $@ $^

build/asan/lib/libshared.a: $(patsubst %.c,build/asan/obj/%.o,$(LIB_SRC))
	@mkdir -p $(dir $@)
	ar rcs $@ $^

build/lib/libcbcuda.a: $(patsubst %.cu,build/obj/%.cu.o,$(CU_SRC))
	@mkdir -p $(dir $@)
	ar rcs $@ $^

build/lib/libcbcuda.so: $(patsubst %.cu,build/obj/%.cu.o,$(CU_SRC))
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,libcbcuda.so $^ $(CUDA_LIBS) -o $@

# The libshared symbols libcbcuda.so expects from the program, as linker flags (-Wl,-u,name per line).
build/lib/libcbcuda.needs: build/lib/libcbcuda.so build/lib/libshared.a
	nm -D --undefined-only build/lib/libcbcuda.so | awk '{print $$NF}' | sort -u > $@.u
	nm -g --defined-only build/lib/libshared.a | awk 'NF == 3 {print $$3}' | sort -u > $@.d
	comm -12 $@.u $@.d | sed 's/^/-Wl,-u,/' > $@.tmp
	rm -f $@.u $@.d
	mv $@.tmp $@

# One program per services/<dir>/cb*.c (tools/<dir>/cb*.c, tests/tools/cb*.c), plus the folder's other
# sources; a program under tools/ also gets tools/common (its sources, its headers on the include path).
prog_common = $(if $(filter tools/%,$(1)),tools/common/)
prog_srcs = $(filter-out $(wildcard $(dir $(1))cb*.c),$(wildcard $(dir $(1))*.c)) $(if $(prog_common),$(wildcard $(prog_common)*.c))
prog_deps = $(wildcard $(dir $(1))*.h $(dir $(1))www/*) $(if $(prog_common),$(wildcard $(prog_common)*.h))
define prog_rule
build/bin/$(basename $(notdir $(1))): $(1) $(call prog_srcs,$(1)) $(call prog_deps,$(1)) build/lib/libshared.a $(CUDA_LIB) $(CUDA_NEEDS)
	@mkdir -p build/bin
	$$(CC) $$(ALL_CFLAGS) $$(DIR_CFLAGS_$(notdir $(patsubst %/,%,$(dir $(1))))) -I$(dir $(1)) $(if $(call prog_common,$(1)),-I$(call prog_common,$(1))) $(1) $(call prog_srcs,$(1)) build/lib/libshared.a $$(or $$(CUDA_LINK_$(basename $(notdir $(1)))),$$(CUDA_DL)) $$(LDLIBS) $$(DIR_LIBS_$(notdir $(patsubst %/,%,$(dir $(1))))) -o $$@
endef
$(foreach s,$(PROG_SRC),$(eval $(call prog_rule,$(s))))

# Some unit tests #include a service's sources (e.g. test_router_pool: services/router/pool.c): every test
# is rebuilt when a service source changes.
SVC_SRC := $(wildcard services/*/*.c services/*/*.h)
build/tests/%: tests/unit/%.c tests/test.h build/lib/libshared.a $(CUDA_NEEDS) $(SVC_SRC)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Itests $< build/lib/libshared.a $(CUDA_DL) $(LDLIBS) -o $@

# A fake CUDA driver reporting one device: test_backend_select loads the CUDA backend library through it.
ifneq ($(CUDA_SO),)
build/tests/fakecuda/libcuda.so.1: tests/unit/fake_libcuda.c
	@mkdir -p $(dir $@)
	$(CC) $(CSTD) $(WARN) -shared -fPIC $< -o $@
build/tests/test_backend_select: build/tests/fakecuda/libcuda.so.1 $(CUDA_SO)
endif

build/asan/tests/%: tests/unit/%.c tests/test.h build/asan/lib/libshared.a $(SVC_SRC)
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -DCB_HAVE_CUDA=1,$(ALL_CFLAGS)) $(SAN_FLAGS) -Itests $< build/asan/lib/libshared.a $(LDLIBS) -o $@

# The sanitizer build never links CUDA (ASan and the CUDA runtime do not mix well).
build/asan/obj/%.o: ALL_CFLAGS := $(filter-out -DCB_HAVE_CUDA=1,$(ALL_CFLAGS))

model:
	@scripts/fetch-model.sh
	@scripts/fetch-model.sh --vocab-only all

test: all $(TESTS) $(ASAN_TESTS) model
	@tests/run.sh

# The fast tier for the edit-compile-test loop: the plain unit binaries only (no ASan build, no
# integration scripts), about a minute; "N passed, N failed" like `make test`.
check: $(TESTS)
	@tests/run.sh --unit

# The include graph follows the layers (tests/integration/test_layers.sh runs it in `make test` too).
check-layers:
	@scripts/check-layers

# The stack in containers for real (podman, podman-compose; tests/integration/test_compose_run.sh): base
# image if missing, image build, up, ingest, a question, a blend restart, down. A skip (77: this machine
# cannot run containers) is not a failure.
.PHONY: test-compose
test-compose:
	@CB_TEST_COMPOSE=1 tests/integration/test_compose_run.sh; rc=$$?; [ $$rc -eq 77 ] || exit $$rc

# The real models against llama.cpp (scripts/compare-llamacpp: mean KL <= 0.01 and top-1 agreement >= 97 % over
# 2,048 tokens), each model that scripts/fetch-model.sh has fetched into models/; needs llama-cpp-python.
# Not part of `make test` (minutes per model on two cores); a model that is absent is skipped.
test-models: all model
	@tests/run-models.sh

test-gpu: all gpu-tests
	@tests/run-gpu.sh

# libFuzzer targets: libshared is compiled once with clang (ASan + UBSan, coverage), then each harness links it.
FUZZ_CC    ?= clang
FUZZ_FLAGS := $(CSTD) $(WARN) -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined -Ilibshared -Ikernels $(PKG_CFLAGS)
FUZZ_BINS  := $(patsubst tests/fuzz/%.c,build/fuzz/%,$(FUZZ_SRC))

build/fuzz/obj/%.o: %.c $(LIB_HDR)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_FLAGS) -fsanitize=fuzzer-no-link -c $< -o $@

build/fuzz/libshared.a: $(patsubst %.c,build/fuzz/obj/%.o,$(LIB_SRC))
	@mkdir -p $(dir $@)
	ar rcs $@ $^

build/fuzz/fuzz_%: tests/fuzz/fuzz_%.c build/fuzz/libshared.a
	$(FUZZ_CC) $(FUZZ_FLAGS) -fsanitize=fuzzer $< build/fuzz/libshared.a $(PKG_LIBS) -lm -lpthread -o $@

fuzz: $(FUZZ_BINS)

# The seed corpora's generator (tests/fuzz/make-corpora.sh): the real writers, so the seeds are valid files.
build/tests/gen_corpora: tests/fuzz/gen_corpora.c build/lib/libshared.a $(CUDA_NEEDS)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $< build/lib/libshared.a $(CUDA_DL) $(LDLIBS) -o $@

# The fault and load suite (tests/faults/run.sh; docs/reliability.md): kill -9, a full disk, SIGSTOP, slow
# clients, bounded load, fuzzing. Not part of `make test`; about 20 minutes on 2 cores. Needs root for tmpfs.
test-faults: all model build/fault/cb-faultpaths
	@tests/faults/run.sh

# The fault build: libshared and the job table compiled with -DCB_FAULT_INJECT (every allocation and every
# KV-file and config I/O call a failure point: base/fault.h) and the sanitizers; tests/faults/inproc drives it.
FAULT_FLAGS := $(SAN_FLAGS) -DCB_FAULT_INJECT
FAULT_SVC   := services/precompute/jobs.c
build/fault/obj/%.o: %.c $(LIB_HDR)
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -DCB_HAVE_CUDA=1,$(ALL_CFLAGS)) $(FAULT_FLAGS) -c $< -o $@

build/fault/libshared.a: $(patsubst %.c,build/fault/obj/%.o,$(LIB_SRC))
	@mkdir -p $(dir $@)
	ar rcs $@ $^

build/fault/cb-faultpaths: $(wildcard tests/faults/inproc/*.c tests/faults/inproc/*.h) $(FAULT_SVC) services/precompute/jobs.h build/fault/libshared.a
	$(CC) $(filter-out -DCB_HAVE_CUDA=1,$(ALL_CFLAGS)) $(FAULT_FLAGS) -Iservices/precompute -Itests/faults/inproc \
	    $(wildcard tests/faults/inproc/*.c) $(FAULT_SVC) build/fault/libshared.a $(LDLIBS) -o $@

# Only the in-process failure points (the fault suite's first scenario, tests/faults/inproc.sh), a few minutes.
test-faults-inproc: all model build/fault/cb-faultpaths
	@tests/faults/run.sh inproc

cuda:
	$(MAKE) CB_CUDA=1 all

demo:
	@scripts/demo.sh

bench: bench-engine

bench-engine: all model
	@scripts/bench-engine.sh

bench-stack: all model
	@scripts/bench-stack.sh

.PHONY: bench-router
bench-router: all model
	@scripts/bench-router.sh

bench-serve: all model
	@scripts/bench-serve.sh

bench-gateway: all model
	@scripts/bench-gateway.sh

bench-curve: all model
	@scripts/bench-curve.sh

# TTFT by where the chunks are: computed, local KV file, only in Redis (docs/kvremote.md). Needs redis-server.
bench-redis: all model
	@scripts/bench-redis.sh

clean:
	rm -rf build
-include mk/cuda.mk
