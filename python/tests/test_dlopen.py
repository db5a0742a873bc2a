"""libkvpool loads with dlopen in a process whose static TLS block is spent.

``import torch`` then ``import kvpool`` is such a process: torch's libraries take glibc's small
static TLS surplus (about 1.6 KiB by default), and a library that needs initial-exec TLS at load
(Debian's libjemalloc.so.2 needs 2.6 KiB of it) then fails with "cannot allocate memory in static
TLS block". The test spends the surplus the same way, with small libraries of initial-exec TLS
built here and loaded until glibc refuses one, then loads every libkvpool the package may pick
and uses it.
"""

import ctypes.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import PYDIR
from kvpool import _lib

JEMALLOC = ctypes.util.find_library("jemalloc")
HOG_BYTES = (1024, 256, 64, 16)  # initial-exec TLS of each hog library
HOG_COPIES = 6                   # distinct files of each size (a second dlopen of one file loads nothing)

CHILD = r"""
import ctypes, json, sys
import numpy as np  # what kvpool imports that is not kvpool's: loaded before the TLS is spent
try:
    import _cffi_backend
except ImportError:
    pass
out = {"hogs": 0, "refused": ""}
for group in json.loads(sys.argv[2]):  # largest first, until glibc refuses one of each size
    for path in group:
        try:
            ctypes.CDLL(path)
            out["hogs"] += 1
        except OSError as e:
            out["refused"] = str(e)
            break
out["libs"] = {}
for path in json.loads(sys.argv[3]):
    try:
        ctypes.CDLL(path)
        out["libs"][path] = "ok"
    except OSError as e:
        out["libs"][path] = str(e)
sys.path.insert(0, sys.argv[1])
import kvpool
with kvpool.Pool(layers=2, kv_heads=2, head_dim=16, k_dtype="f16", v_dtype="f16", codecs="kv=int8",
                 region_bytes=8 << 20) as pool:
    pool.add(1)
    x = np.linspace(-1, 1, 3 * 2 * 16).astype(np.float16).reshape(3, 2, 16)
    pool.extend(1, [x, x], [x, x])
    k, v, pos = pool.read(1, 1, head=1)
    pool.check()
    out["read"] = [int(k.shape[0]), [int(p) for p in pos]]
out["library"] = kvpool.library_path
out["allocator"] = kvpool.metadata_allocator()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hogs(tmp_path_factory):
    """Groups of shared libraries, each with HOG_BYTES of initial-exec TLS."""
    cc = os.environ.get("CC", "cc")
    if not shutil.which(cc):
        pytest.skip(f"no C compiler ({cc}) to build the TLS hogs")
    d = tmp_path_factory.mktemp("tlshog")
    groups = []
    for n in HOG_BYTES:
        src = d / f"hog{n}.c"
        src.write_text(f"__attribute__((tls_model(\"initial-exec\"))) __thread char kvp_hog[{n}];\n"
                       f"char *kvp_hog_addr(void) {{ return kvp_hog; }}\n")
        so = d / f"hog{n}_0.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(so), str(src)], check=True)
        group = [str(so)]
        for i in range(1, HOG_COPIES):
            copy = d / f"hog{n}_{i}.so"
            shutil.copyfile(so, copy)
            group.append(str(copy))
        groups.append(group)
    return groups


def run_child(env_extra, hog_groups=(), libs=()):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.pop("KVPOOL_META_MALLOC", None)
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-c", CHILD, PYDIR, json.dumps(list(hog_groups)), json.dumps(list(libs))],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_loads_with_the_static_tls_block_spent(hogs):
    libs = [p for p in _lib.candidates() if os.path.exists(p)]
    if JEMALLOC:
        libs.append(JEMALLOC)  # the control: refused like the hogs (its 2.6 KiB never fit a dlopen)
    out = run_child({}, hogs, libs)
    # the surplus really is spent: glibc refused a hog, after loading at least one
    assert out["hogs"] >= 1 and "static TLS" in out["refused"], out
    for path, status in out["libs"].items():
        if path == JEMALLOC:
            assert "static TLS" in status, status
        else:
            assert status == "ok", f"{path} cannot be dlopened here: {status}"
    assert out["read"] == [3, [0, 1, 2]]
    assert out["allocator"] == "libc"


def test_shared_library_needs_no_static_tls():
    """Nothing libkvpool brings in at load asks for initial-exec TLS (ELF flag STATIC_TLS),
    except libc and libm, which every python process has already."""
    readelf = "readelf"
    try:
        subprocess.run([readelf, "--version"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no readelf")
    ldd = subprocess.run(["ldd", _lib.path], capture_output=True, text=True)
    if ldd.returncode != 0:
        pytest.skip(f"ldd {_lib.path}: {ldd.stderr.strip()}")
    deps = [line.split("=>")[1].split()[0] for line in ldd.stdout.splitlines()
            if "=>" in line and "/" in line.split("=>")[1]]
    bad = []
    for path in [_lib.path] + deps:
        base = os.path.basename(path)
        if base.startswith(("libc.so", "libm.so", "ld-linux")):
            continue
        d = subprocess.run([readelf, "-dW", path], capture_output=True, text=True).stdout
        if "STATIC_TLS" in d:
            bad.append(path)
    assert not bad, f"libraries with initial-exec TLS among libkvpool's dependencies: {bad}"


@pytest.mark.skipif(not JEMALLOC, reason="libjemalloc.so.2 is not installed")
def test_metadata_allocator_follows_the_process():
    """A preloaded jemalloc is used for host metadata; KVPOOL_META_MALLOC=libc declines it."""
    out = run_child({"LD_PRELOAD": JEMALLOC})
    assert out["allocator"] == "jemalloc" and out["read"] == [3, [0, 1, 2]]
    out = run_child({"LD_PRELOAD": JEMALLOC, "KVPOOL_META_MALLOC": "libc"})
    assert out["allocator"] == "libc" and out["read"] == [3, [0, 1, 2]]
