# python/python.mk - the Python binding's targets, included by the Makefile.
#
#   make pylib      build/py/libkvpool.so: the library as the binding loads it (part of `make`)
#   make test-py    the pytest suite (part of `make test`; skips with a message without pytest/numpy)
#   make bench-py   per-call overhead of the binding against the same calls from C, same run
#   make test-gpu   also runs python/tests/gpu_hf_test.py (needs torch, CUDA, transformers)
#
# Why a second build: libjemalloc.so uses the initial-exec TLS model, so a
# process that did not link it at start (python loading libkvpool with
# dlopen) fails with "cannot allocate memory in static TLS block". The
# binding's copy is built with KVP_META_LIBC (host metadata from libc malloc,
# as in the sanitizer builds) and does not link jemalloc; everything else is
# the same code.

# Debian's packages (python3-numpy, python3-pytest) install for /usr/bin/python3.
PYTHON ?= $(if $(wildcard /usr/bin/python3),/usr/bin/python3,python3)
PY_B := $(B)/py
PY_OBJ := $(LIB_SRC:%.c=$(PY_B)/obj/%.o) $(KERN_SRC:%.cu=$(B)/obj/%.o)
PY_SO := $(PY_B)/libkvpool.so.$(VERSION)
PY_LIBS := $(filter-out -ljemalloc,$(LIBS))
PY_TOOLS := $(PY_B)/kvpool-pyabi $(PY_B)/kvpool-callbench
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
pylib: $(PY_SO) $(PY_TOOLS)

$(PY_B)/obj/%.o: %.c $(wildcard include/*.h */*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DKVP_META_LIBC -c $< -o $@

$(PY_SO): $(PY_OBJ) tools/exports.map
	$(CC) -shared -Wl,-soname,libkvpool.so.$(SOVERSION) -Wl,--version-script=tools/exports.map \
	  $(LDFLAGS) -o $@ $(PY_OBJ) $(PY_LIBS)
	ln -sf libkvpool.so.$(VERSION) $(PY_B)/libkvpool.so.$(SOVERSION)
	ln -sf libkvpool.so.$(SOVERSION) $(PY_B)/libkvpool.so

$(PY_B)/kvpool-%: python/bench/kvpool-%.c $(PY_SO) $(PUB_HDRS)
	$(CC) $(PUB_CFLAGS) -o $@ $< -L$(PY_B) -Wl,-rpath,'$$ORIGIN' -lkvpool $(LDFLAGS)

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
	install -m 755 $(PY_SO) $(DESTDIR)$(PYTHON_SITE)/kvpool/libkvpool.so.$(SOVERSION)
	@echo "installed the kvpool package into $(DESTDIR)$(PYTHON_SITE)"
