# kvpool - the only build entry point (GNU make).
#
#   make               libraries (build/libkvpool.so, build/libkvpool.a) and tools
#   make deps          install missing Debian packages (tools/deps.sh)
#   make run           kvpool-sim's embedded tour (build/kvpool-sim with no arguments)
#   make test          every Check suite (unit + integration + a 2 s stress run, the
#                      fault-injection sweep against build/fault/libkvpool.a), and pytest
#   make asan | tsan   the suites under ASan+UBSan | TSan
#   make stress        the reader/writer stress test for 30 s (stress-tsan: under TSan)
#   make valgrind      the suites under valgrind memcheck
#   make fuzz          each libFuzzer harness of tests/fuzz for FUZZ_S seconds (default 60; clang)
#   make bench         benchmarks: table + one JSON line per figure
#   make test-gpu      tests/gpu (needs CUDA and a GPU), and the Python GPU test
#   make bench-py      the Python binding's per-call overhead against C (python/python.mk)
#   make install PREFIX=/usr/local   (the Python package too: PYTHON_SITE=... to choose where)
#
# Options: CUDA=auto|0|1 (auto: on when nvcc is found), CUDA_HOME=<toolkit>,
#          HIREDIS=auto|0|1 (the Redis store tier; auto: on when libhiredis-dev is installed),
#          DEBUG=0|1|2 (assertion tier), O=<optimization flags>.

SHELL := /bin/bash
PREFIX ?= /usr/local
CC ?= cc
O ?= -O2
DEBUG ?= 1
CUDA ?= auto
VARIANT ?=
B := build$(if $(VARIANT),/$(VARIANT))

NVCC_PATH := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_HOME ?= $(if $(NVCC_PATH),$(patsubst %/bin/,%,$(dir $(NVCC_PATH))),)
ifeq ($(CUDA),auto)
  HAVE_CUDA := $(if $(and $(CUDA_HOME),$(wildcard $(CUDA_HOME)/include/cuda_runtime_api.h)),1,0)
else
  HAVE_CUDA := $(CUDA)
endif

SOVERSION := 0
VERSION := 0.1.0

WARN := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wno-unused-parameter
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE $(O) -g $(WARN) -fPIC -fvisibility=hidden -DKVP_BUILDING -DKVP_DEBUG=$(DEBUG) -Iinclude
# The library's own dependencies. jemalloc is not one of them: util/meta.c
# uses the libjemalloc.so.2 a program loads (host metadata in its arena) and
# libc malloc otherwise, so that libkvpool can be dlopened by any process
# (jemalloc's initial-exec TLS cannot be, once the static TLS block is spent).
# Programs built here link it (JEMALLOC_LIBS), as kvpool.pc's Libs do.
LIBS := -lurcu-bp -lurcu-cds -ljansson -lpthread -lm -ldl
JEMALLOC_LIBS := -Wl,--push-state,--no-as-needed -ljemalloc -Wl,--pop-state
SAN :=
ifeq ($(VARIANT),asan)
  SAN := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -DKVP_META_LIBC \
    -DKVP_RCU_OUTLINE
endif
ifeq ($(VARIANT),tsan)
  SAN := -fsanitize=thread -fno-omit-frame-pointer -DKVP_META_LIBC
  # die_after_fork=0: the library's fork handler starts urcu's worker again
  # in every child (util/rcu.c), also one that only execs (a test's
  # redis-server), and TSan otherwise ends such a child at once.
  export TSAN_OPTIONS := suppressions=$(CURDIR)/tools/tsan.supp die_after_fork=0 $(TSAN_OPTIONS)
endif
ifeq ($(VARIANT),valgrind)
  SAN := -DKVP_META_LIBC
endif

LIB_SRC := $(wildcard util/*.c alloc/*.c stats/*.c codecs/*.c pages/*.c store/*.c)
# The store tier's Redis backend needs hiredis; without it the library still
# builds, kvp_store_open refuses with KVP_ENOTSUP naming the package, and the
# store tests skip with a message.
HIREDIS ?= auto
ifeq ($(HIREDIS),auto)
  HAVE_HIREDIS := $(shell pkg-config --exists hiredis 2>/dev/null && echo 1 || echo 0)
else
  HAVE_HIREDIS := $(HIREDIS)
endif
ifeq ($(HAVE_HIREDIS),1)
  HIREDIS_CFLAGS := -DKVP_HAVE_HIREDIS $(shell pkg-config --cflags hiredis 2>/dev/null || echo -I/usr/include/hiredis)
  HIREDIS_LIBS := $(shell pkg-config --libs hiredis 2>/dev/null || echo -lhiredis)
  LIBS += $(HIREDIS_LIBS)
  CFLAGS_BASE += $(HIREDIS_CFLAGS)
endif
CUDA_CFLAGS := -DKVP_HAVE_CUDA -I$(CUDA_HOME)/include
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lstdc++
# Device kernels (kernels/*.cu): nvcc, no FMA contraction and no fast math, so
# the device numeric core rounds as the host's (bit-exact codecs). CUDA_ARCH:
# the SASS targets (default Hopper and Ampere); PTX of the newest rides along.
# The host sanitizer variants never run the device code (their suites use
# no GPU, and compute-sanitizer checks the normal build): one target there.
ifneq ($(filter asan tsan valgrind,$(VARIANT)),)
  CUDA_ARCH ?= 90
endif
CUDA_ARCH ?= 90 80
NVCC := $(CUDA_HOME)/bin/nvcc
NVCCFLAGS := -std=c++17 $(O) -g --fmad=false -Xcompiler -fPIC,-fvisibility=hidden -DKVP_BUILDING \
  -DKVP_HAVE_CUDA -Iinclude -Ikernels $(foreach a,$(CUDA_ARCH),-gencode arch=compute_$(a),code=sm_$(a)) \
  -gencode arch=compute_$(firstword $(CUDA_ARCH)),code=compute_$(firstword $(CUDA_ARCH))
KERN_SRC :=
ifeq ($(HAVE_CUDA),1)
  CFLAGS_BASE += $(CUDA_CFLAGS)
  LIBS += $(CUDA_LIBS)
  KERN_SRC := $(wildcard kernels/*.cu)
else
  LIB_SRC := $(filter-out %_cuda.c,$(LIB_SRC))
endif
CFLAGS := $(CFLAGS_BASE) $(SAN) $(EXTRA_CFLAGS)
LDFLAGS := $(SAN)

LIB_OBJ := $(LIB_SRC:%.c=$(B)/obj/%.o) $(KERN_SRC:%.cu=$(B)/obj/%.o)
SO := $(B)/libkvpool.so.$(VERSION)
A := $(B)/libkvpool.a

UNIT_SRC := $(wildcard tests/unit/check_*.c)
INTEG_SRC := $(wildcard tests/integration/check_*.c)
STRESS_SRC := $(wildcard tests/stress/check_*.c)
GPU_SRC := $(wildcard tests/gpu/check_*.c)
UNIT_BIN := $(UNIT_SRC:tests/unit/%.c=$(B)/tests/%)
INTEG_BIN := $(INTEG_SRC:tests/integration/%.c=$(B)/tests/%)
STRESS_BIN := $(STRESS_SRC:tests/stress/%.c=$(B)/tests/%)
GPU_BIN := $(GPU_SRC:tests/gpu/%.c=$(B)/tests/%)
TOOLS := $(B)/kvpool-demo $(B)/kvpool-bench $(B)/kvpool-calib $(B)/kvpool-stat $(B)/kvpool-sim $(B)/kvpool-prof-append $(B)/kvpool-prof-alloc \
  $(B)/kvpool-prof-attend $(if $(filter 1,$(HAVE_CUDA)),$(B)/kvpool-bench-gpu)
SIM_SRC := tools/kvpool-sim.c tools/sim_common.c tools/sim_llm.c tools/sim_var.c tools/sim_video.c tools/traces.c
SIM_HDRS := tools/sim.h tools/traces.h
CHECK_LIBS := $(shell pkg-config --libs check 2>/dev/null || echo -lcheck -lsubunit -lrt -lm)

.PHONY: all deps run test asan tsan valgrind bench test-gpu test-gpu-sanitize bench-gpu install clean lib check-exports stress stress-tsan fuzz
all: deps lib $(TOOLS)
lib: $(SO) $(A)

deps:
	@tools/deps.sh

$(B)/obj/%.o: %.c $(wildcard include/*.h */*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

# Kernels are built the same for every VARIANT (sanitizers instrument host code).
$(B)/obj/kernels/%.o: kernels/%.cu $(wildcard kernels/*.cuh kernels/*.h include/*.h)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(SO): $(LIB_OBJ) tools/exports.map
	$(CC) -shared -Wl,-soname,libkvpool.so.$(SOVERSION) -Wl,--version-script=tools/exports.map \
	  $(LDFLAGS) -o $@ $(LIB_OBJ) $(LIBS)
	ln -sf libkvpool.so.$(VERSION) $(B)/libkvpool.so.$(SOVERSION)
	ln -sf libkvpool.so.$(SOVERSION) $(B)/libkvpool.so

$(A): $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

# Unit tests see internals and link the static library.
$(B)/tests/check_%: tests/unit/check_%.c $(A) tests/unit/*.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fvisibility=default -o $@ $< $(A) $(CHECK_LIBS) $(LIBS) $(JEMALLOC_LIBS) $(LDFLAGS)

# Fault injection: the library again, with -DKVP_FAULT_INJECT and libc's
# allocation calls wrapped (util/fault.h), for tests/unit/check_fault, which
# fails each allocation of its scenarios in turn.
FAULT_OBJ := $(LIB_SRC:%.c=$(B)/fault/obj/%.o) $(KERN_SRC:%.cu=$(B)/obj/%.o)
FAULT_A := $(B)/fault/libkvpool.a
$(B)/fault/obj/%.o: %.c $(wildcard include/*.h */*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DKVP_FAULT_INJECT -include util/fault_wrap.h -c $< -o $@
$(FAULT_A): $(FAULT_OBJ)
	@rm -f $@
	ar rcs $@ $^
$(B)/tests/check_fault: tests/unit/check_fault.c $(FAULT_A) tests/unit/*.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DKVP_FAULT_INJECT -fvisibility=default -o $@ $< $(FAULT_A) $(CHECK_LIBS) $(LIBS) $(JEMALLOC_LIBS) $(LDFLAGS)

# libFuzzer harnesses (tests/fuzz/, clang): the library and tools/traces.c
# rebuilt with coverage, ASan and UBSan in build/fuzz/ (host only, libc
# metadata so ASan sees it). `make fuzz` runs each for FUZZ_S seconds from
# its seed corpus (tests/fuzz/corpus/<name>), growing build/fuzz/corpus/.
FUZZ_CC ?= clang
FUZZ_S ?= 60
FUZZ_NAMES := $(patsubst tests/fuzz/fuzz_%.c,%,$(wildcard tests/fuzz/fuzz_*.c))
FUZZ_BIN := $(FUZZ_NAMES:%=build/fuzz/fuzz_%)
FUZZ_CFLAGS := -std=c11 -D_GNU_SOURCE -O1 -g $(WARN) -DKVP_BUILDING -DKVP_DEBUG=1 -DKVP_META_LIBC -DKVP_RCU_OUTLINE -Iinclude \
  -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_OBJ := $(patsubst %.c,build/fuzz/obj/%.o,$(filter-out %_cuda.c,$(wildcard util/*.c alloc/*.c stats/*.c \
  codecs/*.c pages/*.c store/*.c)) tools/traces.c)
# The allocator, counters, page tables and numeric kernels are hot loops
# that parse nothing: compare tracing there only slows the op harness down.
FUZZ_NOCMP := $(addprefix build/fuzz/obj/,$(addsuffix .o,alloc/alloc alloc/extent alloc/ledger alloc/slab \
  alloc/sizeclass stats/stats stats/emit codecs/kernels codecs/numeric codecs/kmeans pages/seq pages/stream \
  pages/rowwise pages/fork pages/read pages/evict pages/block pages/rawpage))
$(FUZZ_NOCMP): FUZZ_COV := -fno-sanitize-coverage=trace-cmp
build/fuzz/obj/%.o: %.c $(wildcard include/*.h */*.h)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(HIREDIS_CFLAGS) -fsanitize=fuzzer-no-link $(FUZZ_COV) -c $< -o $@
build/fuzz/libkvpool-fuzz.a: $(FUZZ_OBJ)
	@rm -f $@
	ar rcs $@ $^
build/fuzz/fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/fuzz.h build/fuzz/libkvpool-fuzz.a
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -o $@ $< build/fuzz/libkvpool-fuzz.a -lurcu-bp -lurcu-cds -ljansson \
	  $(HIREDIS_LIBS) -lpthread -lm
fuzz: deps $(FUZZ_BIN)
	@tools/run-fuzz.sh $(FUZZ_S) $(FUZZ_NAMES)

# CUDA cross-check of codecs/numeric.c: CUDA's host-callable conversions
# (no GPU needed). C++, because cuda_bf16.h and cuda_fp16.h declare them only
# for C++. Built and run by `make test` when CUDA is on.
XCHECK_BIN := $(if $(filter 1,$(HAVE_CUDA)),$(B)/tests/xcheck_cuda_numeric)
$(B)/tests/xcheck_cuda_numeric: tests/unit/xcheck_cuda_numeric.cpp codecs/numeric.h $(A)
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 $(O) -g -Wall -Wextra -Wshadow -Iinclude -isystem $(CUDA_HOME)/include $(SAN) \
	  -o $@ $< $(A) $(LIBS) $(JEMALLOC_LIBS) $(LDFLAGS)

# KVQuant's device functions (kernels/kvquant.cuh) on the host, through a
# CPU emulation of a CTA (tests/unit/cuda_emu.h): no GPU and no CUDA
# headers, so built and run by `make test` in every build. Host C++ without
# FMA contraction, so its float operations round as the kernels' __f*_rn.
EMU_BIN := $(B)/tests/xcheck_kvquant_emu $(B)/tests/xcheck_qvg_emu
$(B)/tests/xcheck_kvquant_emu: tests/unit/xcheck_kvquant_emu.cpp tests/unit/cuda_emu.h tests/unit/emu_expect.h $(wildcard kernels/*.cuh kernels/*.h) \
  codecs/kvquant.h $(A)
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 $(O) -g -Wall -Wextra -Wshadow -Wno-unknown-pragmas -ffp-contract=off -Iinclude -Ikernels $(SAN) \
	  -o $@ $< $(A) $(LIBS) $(JEMALLOC_LIBS) $(LDFLAGS)
# QVG's too, and with CUDA its host launch path (codecs/qvg_cuda.c, linked
# from the library) over emulated launches and host stand-ins of the runtime.
$(B)/tests/xcheck_qvg_emu: tests/unit/xcheck_qvg_emu.cpp tests/unit/cuda_emu.h tests/unit/emu_expect.h $(wildcard kernels/*.cuh kernels/*.h) $(A)
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 $(O) -g -Wall -Wextra -Wshadow -Wno-unknown-pragmas -ffp-contract=off -Iinclude -Ikernels $(SAN) \
	  $(if $(filter 1,$(HAVE_CUDA)),-DKVP_HAVE_CUDA) \
	  -o $@ $< $(A) $(LIBS) $(JEMALLOC_LIBS) $(LDFLAGS)

# Integration tests and tools see only include/ and link the shared library.
PUB_CFLAGS = -std=c11 -D_GNU_SOURCE $(O) -g $(WARN) -Iinclude $(SAN)
# check_store damages blobs on its redis-server through hiredis directly.
$(B)/tests/check_store: PUB_CFLAGS += $(HIREDIS_CFLAGS)
$(B)/tests/check_store: CHECK_LIBS += $(HIREDIS_LIBS) -lpthread
# check_gpu_store too (a corrupt blob in the middle of a restore).
$(B)/tests/check_gpu_store: PUB_CFLAGS += $(HIREDIS_CFLAGS)
$(B)/tests/check_gpu_store: CHECK_LIBS += $(HIREDIS_LIBS)
PUB_HDRS := $(wildcard include/*.h)
$(INTEG_BIN): $(B)/tests/%: tests/integration/%.c $(SO) $(PUB_HDRS) $(wildcard tests/integration/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(PUB_CFLAGS) -o $@ $< $(filter %.c,$(filter-out $<,$^)) -L$(B) -Wl,-rpath,'$$ORIGIN/..' -lkvpool $(JEMALLOC_LIBS) \
	  $(CHECK_LIBS) -ljansson -lpthread -lm $(LDFLAGS)
# The trace parsers are tools code, tested through their own header; the
# simulator's suite runs the built binary.
$(B)/tests/check_traces: tools/traces.c tools/traces.h
$(B)/tests/check_sim: $(B)/kvpool-sim

# Stress tests: public header only, like integration tests; `make test` runs
# their short version (KVP_STRESS_SECONDS unset: 2 s).
$(STRESS_BIN): $(B)/tests/%: tests/stress/%.c tests/integration/kvgen.h $(SO) $(PUB_HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(PUB_CFLAGS) -o $@ $< -L$(B) -Wl,-rpath,'$$ORIGIN/..' -lkvpool $(JEMALLOC_LIBS) $(CHECK_LIBS) -lpthread $(LDFLAGS)

$(B)/kvpool-demo: tools/kvpool-demo.c tools/pagemix.h $(SO) $(PUB_HDRS)
	$(CC) $(PUB_CFLAGS) -o $@ $< -L$(B) -Wl,-rpath,'$$ORIGIN' -lkvpool $(JEMALLOC_LIBS) $(LDFLAGS)

# check_stat runs the tool; check_tools runs kvpool-demo and kvpool-bench.
$(B)/tests/check_stat: | $(B)/kvpool-stat
$(B)/tests/check_tools: | $(B)/kvpool-demo $(B)/kvpool-bench

# kvpool-stat reads files only: neither the library nor its header.
$(B)/kvpool-stat: tools/kvpool-stat.c
	@mkdir -p $(dir $@)
	$(CC) $(PUB_CFLAGS) -o $@ $< -ljansson -lm $(LDFLAGS)

# The bench links jemalloc directly for its baseline.
BENCH_PARTS := tools/bench_calib.c tools/bench_store.c
$(B)/kvpool-bench: tools/kvpool-bench.c $(BENCH_PARTS) $(BENCH_PARTS:.c=.h) tools/bench_util.h tools/pagemix.h \
  tools/redis_srv.h $(SO) $(PUB_HDRS)
	$(CC) $(PUB_CFLAGS) -o $@ $< $(BENCH_PARTS) -L$(B) -Wl,-rpath,'$$ORIGIN' -lkvpool $(JEMALLOC_LIBS) -lm $(LDFLAGS)

# Decode appends in a loop, for callgrind and perf (the instructions per append the notes give).
$(B)/kvpool-prof-append: tools/kvpool-prof-append.c $(SO) $(PUB_HDRS)
	$(CC) $(PUB_CFLAGS) -o $@ $< -L$(B) -Wl,-rpath,'$$ORIGIN' -lkvpool $(JEMALLOC_LIBS) $(LDFLAGS)

# The bench's page-mix alloc+free pairs in a loop, for callgrind (jemalloc linked for its baseline).
$(B)/kvpool-prof-alloc: tools/kvpool-prof-alloc.c tools/pagemix.h $(SO) $(PUB_HDRS)
	$(CC) $(PUB_CFLAGS) -o $@ $< -L$(B) -Wl,-rpath,'$$ORIGIN' -lkvpool $(JEMALLOC_LIBS) $(LDFLAGS)

# kvp_attend_decode's host part (the block table build, an internal call) in a loop, for callgrind:
# it links the static library like the unit tests.
$(B)/kvpool-prof-attend: tools/kvpool-prof-attend.c $(A)
	$(CC) $(CFLAGS) -fvisibility=default -o $@ $< $(A) $(LIBS) $(JEMALLOC_LIBS) $(LDFLAGS)

$(B)/kvpool-sim: $(SIM_SRC) $(SIM_HDRS) $(SO) $(PUB_HDRS)
	$(CC) $(PUB_CFLAGS) -o $@ $(SIM_SRC) -L$(B) -Wl,-rpath,'$$ORIGIN' -lkvpool $(JEMALLOC_LIBS) -ljansson -lm $(LDFLAGS)

# kvpool-calib works on the library's internals (planner, loaders, fitting):
# it links the static library like the unit tests do.
CALIB_SRC := tools/kvpool-calib.c $(wildcard tools/calib_*.c)
$(B)/kvpool-calib: $(CALIB_SRC) tools/calib.h $(A)
	$(CC) $(CFLAGS) -fvisibility=default -o $@ $(CALIB_SRC) $(A) $(LIBS) $(JEMALLOC_LIBS) $(LDFLAGS)

run: deps $(B)/kvpool-sim
	$(B)/kvpool-sim

test: deps lib $(TOOLS) $(UNIT_BIN) $(INTEG_BIN) $(STRESS_BIN) $(XCHECK_BIN) $(EMU_BIN) check-exports pylib
	@$(if $(XCHECK_BIN),:,echo "skip xcheck_cuda_numeric  skipped: no CUDA headers")
	@tools/run-tests.sh $(UNIT_BIN) $(INTEG_BIN) $(STRESS_BIN) $(XCHECK_BIN) $(EMU_BIN); c=$$?; $(PYTEST_CMD); exit $$(( c | $$? ))

check-exports: $(SO)
	@tools/check-exports.sh $(SO)

# Sanitizers run 2-20x slower: Check's per-test timeouts scale with them.
asan:
	CK_TIMEOUT_MULTIPLIER=10 $(MAKE) VARIANT=asan test
tsan:
	CK_TIMEOUT_MULTIPLIER=10 $(MAKE) VARIANT=tsan test

# The long stress run prints its counters.
stress: deps lib $(STRESS_BIN)
	@for t in $(STRESS_BIN); do KVP_STRESS_SECONDS=$${KVP_STRESS_SECONDS:-30} $$t || exit 1; done
stress-tsan:
	$(MAKE) VARIANT=tsan stress

valgrind:
	$(MAKE) VARIANT=valgrind lib $(patsubst build/%,build/valgrind/%,$(UNIT_BIN) $(INTEG_BIN))
	@CK_TIMEOUT_MULTIPLIER=20 KVP_TEST_WRAP="valgrind -q --error-exitcode=9 --leak-check=full --errors-for-leak-kinds=definite" \
	  CK_FORK=no tools/run-tests.sh $(patsubst build/%,build/valgrind/%,$(UNIT_BIN) $(INTEG_BIN))

bench: deps $(B)/kvpool-bench
	$(B)/kvpool-bench

# GPU benchmarks: the device codecs, the paged gather and the device append
# against a device copy in the same run, then the same quantizers in PyTorch
# on the same shapes (skipped, with a message, where torch or CUDA is absent).
$(B)/kvpool-bench-gpu: tools/kvpool-bench-gpu.c $(SO) $(PUB_HDRS)
	$(CC) $(PUB_CFLAGS) $(CUDA_CFLAGS) -o $@ $< -L$(B) -Wl,-rpath,'$$ORIGIN' -lkvpool $(JEMALLOC_LIBS) $(CUDA_LIBS) $(LDFLAGS)
ifeq ($(HAVE_CUDA),1)
bench-gpu: deps $(B)/kvpool-bench-gpu
	$(B)/kvpool-bench-gpu | tee $(B)/bench-gpu.txt
	@python3 tools/bench_torch.py $(B)/bench-gpu.txt || echo "bench-gpu: torch comparison skipped (python3 with torch and CUDA needed)"
else
bench-gpu:
	@echo "bench-gpu: skipped: built without CUDA"
endif

ifeq ($(HAVE_CUDA),1)
test-gpu: deps lib $(GPU_BIN) pylib
	@CK_FORK=no tools/run-tests.sh $(GPU_BIN); c=$$?; $(PYTEST_GPU_CMD); exit $$(( c | $$? ))
	@echo "test-gpu: under compute-sanitizer: make test-gpu-sanitize (memcheck, then racecheck)"
# KVP_GPU_SPEC narrows check_gpu_codecs' sweep (sanitizers run it 10-50x slower).
# check_gpu_region's refusals (device 999, a 16 TiB cudaMalloc) are CUDA API
# errors by intent: the sanitizer is told not to count them there.
test-gpu-sanitize: deps lib $(GPU_BIN)
	@for t in $(GPU_BIN); do for tool in memcheck racecheck; do \
	  echo "== compute-sanitizer --tool $$tool $$t"; extra=""; [ $$tool = memcheck ] && extra="--leak-check full"; \
	  case $$t in *check_gpu_region) extra="$$extra --report-api-errors no";; esac; \
	  KVP_GPU_SPEC=$${KVP_GPU_SPEC:-nvfp4:rule} CK_FORK=no $(CUDA_HOME)/bin/compute-sanitizer --tool $$tool \
	    --error-exitcode 9 $$extra $$t | tail -4; [ $${PIPESTATUS[0]} -eq 0 ] || exit 1; done; done
else
test-gpu:
	@echo "test-gpu: skipped: built without CUDA (no nvcc; set CUDA=1 CUDA_HOME=...)"
endif

$(GPU_BIN): $(B)/tests/%: tests/gpu/%.c $(SO) $(PUB_HDRS) $(wildcard tests/integration/*.h tests/gpu/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(PUB_CFLAGS) $(CUDA_CFLAGS) -o $@ $< -L$(B) -Wl,-rpath,'$$ORIGIN/..' -lkvpool $(JEMALLOC_LIBS) $(CHECK_LIBS) \
	  -lpthread $(CUDA_LIBS) $(LDFLAGS)

install: lib install-py
	install -d $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/include
	install -m 644 include/kvpool.h include/kvpool_codec.h $(DESTDIR)$(PREFIX)/include/
	install -m 755 $(SO) $(DESTDIR)$(PREFIX)/lib/
	install -m 644 $(A) $(DESTDIR)$(PREFIX)/lib/
	ln -sf libkvpool.so.$(VERSION) $(DESTDIR)$(PREFIX)/lib/libkvpool.so.$(SOVERSION)
	ln -sf libkvpool.so.$(SOVERSION) $(DESTDIR)$(PREFIX)/lib/libkvpool.so
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' \
	  -e 's|@LIBS_PRIVATE@|$(LIBS)|' -e 's|@JEMALLOC_LIBS@|$(JEMALLOC_LIBS)|' tools/kvpool.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/kvpool.pc
	@echo "installed kvpool $(VERSION) into $(DESTDIR)$(PREFIX)"

clean:
	rm -rf build

include python/python.mk

$(info kvpool: CUDA $(if $(filter 1,$(HAVE_CUDA)),on ($(CUDA_HOME)),off: building CPU-only), store tier $(if $(filter 1,$(HAVE_HIREDIS)),on (hiredis),off: no hiredis)$(if $(VARIANT), [$(VARIANT)]))
