# python/python.mk - the Python binding's targets, included by the Makefile.
#
#   make pylib      the library and the binding's helper programs (part of `make`)
#   make test-py    the pytest suite (part of `make test`; skips with a message without pytest/numpy)
#   make bench-py   per-call overhead of the binding against the same calls from C, same run
#   make test-gpu   also runs python/tests/gpu_hf_test.py (needs torch, CUDA, transformers)
#
# The binding loads build/libkvpool.so itself: the library does not link
# jemalloc (util/meta.c), so dlopen works in any process, python after torch
# included. Its host metadata then comes from libc malloc, unless the process
# has jemalloc (LD_PRELOAD=libjemalloc.so.2): kvpool.metadata_allocator() says.

# Debian's packages (python3-numpy, python3-pytest) install for /usr/bin/python3.
PYTHON ?= $(if $(wildcard /usr/bin/python3),/usr/bin/python3,python3)
# kvpool-pyabi: struct layouts for the ABI test; kvpool-callbench: the C side
# of bench-py, linked without jemalloc so it runs on the allocator python gets;
# kvpool-forkcheck: fork with pools, for test_fork.py (linked the same way).
PY_TOOLS := $(B)/kvpool-pyabi $(B)/kvpool-callbench $(B)/kvpool-forkcheck
# where `make install` puts the package: Debian's python looks in
# PREFIX/lib/python3/dist-packages (PREFIX /usr and /usr/local); others in
# PREFIX/lib/pythonX.Y/site-packages. Override with PYTHON_SITE=...
PYTHON_SITE ?= $(shell $(PYTHON) -c 'import sys, sysconfig; \
  deb = any(p.endswith("dist-packages") for p in sys.path); \
  print("$(PREFIX)/lib/python3/dist-packages" if deb else \
        "$(PREFIX)/lib/python%d.%d/site-packages" % sys.version_info[:2])' 2>/dev/null || \
  echo "$(PREFIX)/lib/python3/dist-packages")

.PHONY: pylib test-py bench-py test-gpu-py install-py
all: pylib
pylib: $(SO) $(PY_TOOLS)

$(PY_TOOLS): $(B)/kvpool-%: python/bench/kvpool-%.c $(SO) $(PUB_HDRS)
	$(CC) $(PUB_CFLAGS) -o $@ $< -L$(B) -Wl,-rpath,'$$ORIGIN' -lkvpool $(LDFLAGS)

# Sanitizer variants run the C suites only: their library cannot be dlopened
# by an uninstrumented python.
PYTEST_CMD = $(if $(VARIANT),echo "skip pytest python/tests                      skipped: VARIANT=$(VARIANT)",\
  tools/run-pytest.sh $(PYTHON) python/tests)
test-py: pylib
	@$(PYTEST_CMD)

bench-py: deps pylib
	@$(PYTHON) python/bench/bench_calls.py

# The GPU test needs a python with torch and transformers: the first of
# PYTHON_GPU, python3 on PATH and /usr/bin/python3 that imports both.
PYTEST_GPU_CMD = tools/run-pytest.sh --gpu "$(PYTHON_GPU) python3 /usr/bin/python3" python/tests/gpu_hf_test.py
test-gpu-py: pylib
	@$(PYTEST_GPU_CMD)

install-py: pylib
	install -d $(DESTDIR)$(PYTHON_SITE)/kvpool
	install -m 644 python/kvpool/*.py $(DESTDIR)$(PYTHON_SITE)/kvpool/
	install -m 755 $(SO) $(DESTDIR)$(PYTHON_SITE)/kvpool/libkvpool.so.$(SOVERSION)
	@echo "installed the kvpool package into $(DESTDIR)$(PYTHON_SITE)"
