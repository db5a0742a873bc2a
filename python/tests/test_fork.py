"""A process that used kvpool forks, and the child makes and uses pools of its own.

From Python the library loads jemalloc itself (when it can) for its metadata, so this is the
path where the order of the fork handlers matters (util/rcu.c): without urcu's handlers the
child's first pool close waits forever, and with them registered before jemalloc's the fork
itself deadlocks. Both would hang here; a child still running after 60 s is killed and the
test fails."""

import os
import signal
import time

import subprocess

import pytest

from conftest import build_tool

np = pytest.importorskip("numpy")
import kvpool  # noqa: E402


def use_pools() -> None:
    for _ in range(2):
        with kvpool.Pool(layers=2, kv_heads=2, head_dim=64, k_dtype="fp16", v_dtype="fp16",
                         region_bytes=8 << 20, codecs="kv=int8") as pool:
            k = np.ones((16, 2, 64), np.float16)
            for seq in range(4):
                pool.add(seq)
                with pool.step(seq, 16):
                    for layer in range(2):
                        pool.append(seq, layer, k, k)
                pool.free(seq)
            pool.check()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_pools_in_a_forked_child():
    use_pools()
    held = kvpool.Pool(layers=1, kv_heads=1, head_dim=64, region_bytes=4 << 20)  # alive across the fork
    pid = os.fork()
    if pid == 0:  # the child: any exception is a failure status
        code = 1
        try:
            use_pools()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung using its pools")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status:#x}"
    use_pools()  # the parent goes on
    held.check()
    held.close()


def test_c_process_that_loads_jemalloc_itself_forks():
    """build/kvpool-forkcheck: a C process without jemalloc of its own (libkvpool loads it)
    forks four times with a pool alive; every child makes and uses pools."""
    exe = build_tool("kvpool-forkcheck")
    if not os.path.exists(exe):
        pytest.skip(f"{exe} is not built (make pylib)")
    try:
        r = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("kvpool-forkcheck hung (a fork deadlocked)")
    assert r.returncode == 0, f"kvpool-forkcheck exit {r.returncode}: {r.stdout}{r.stderr}"
    assert r.stdout.startswith("allocator ")
