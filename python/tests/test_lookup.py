"""Finding the library: next to the package, then KVPOOL_LIB, then the system path."""

import os
import shutil
import subprocess
import sys

from conftest import PYDIR

import kvpool


def run(code, cwd, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("KVPOOL_LIB", "PYTHONPATH")}
    env.update(env_extra or {})
    env["PYTHONPATH"] = cwd
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def test_from_the_tree():
    assert os.path.exists(kvpool.library_path)
    r = run("import kvpool; print(kvpool.library_path)", PYDIR)
    assert r.returncode == 0, r.stderr
    assert os.path.samefile(r.stdout.strip(), kvpool.library_path)


def test_env_then_next_to_package(tmp_path):
    shutil.copytree(os.path.join(PYDIR, "kvpool"), tmp_path / "kvpool",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = "import kvpool; print(kvpool.library_path)"
    # a copied package finds nothing next to it: KVPOOL_LIB names the library
    r = run(code, str(tmp_path), {"KVPOOL_LIB": kvpool.library_path})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == kvpool.library_path
    # without it (and no libkvpool installed system-wide) the error says what to do
    r = run(code, str(tmp_path), {"KVPOOL_LIB": str(tmp_path / "nope.so")})
    if r.returncode != 0:
        assert "KVPOOL_LIB" in r.stderr and "make" in r.stderr
    # a copy next to the package wins over KVPOOL_LIB
    shutil.copy(kvpool.library_path, tmp_path / "kvpool" / "libkvpool.so.0")
    r = run(code, str(tmp_path), {"KVPOOL_LIB": "/nonexistent/libkvpool.so"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "kvpool" / "libkvpool.so.0")


def test_ctypes_backend_without_cffi():
    """KVPOOL_NO_CFFI=1 (or no cffi installed): the per-step calls go through ctypes."""
    code = ("import numpy as np, kvpool, kvpool._fast as f\n"
            "assert f.backend == 'ctypes', f.backend\n"
            "x = np.arange(2 * 64, dtype=np.float16).reshape(1, 2, 64)\n"
            "with kvpool.Pool(layers=1, kv_heads=2, head_dim=64, k_dtype='f16', v_dtype='f16') as p:\n"
            "    p.add(1)\n"
            "    for i in range(20):\n"
            "        p.step_begin(1, 1); p.append(1, 0, x + i, x - i); p.step_end(1)\n"
            "    k, v, pos = p.read(1, 0, 1)\n"
            "    assert len(pos) == 20 and (k[5] == x[0, 1] + 5).all() and (v[7] == x[0, 1] - 7).all()\n"
            "    p.check()\n"
            "print('ok')\n")
    r = run(code, PYDIR, {"KVPOOL_NO_CFFI": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
