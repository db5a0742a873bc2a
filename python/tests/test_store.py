"""The store tier through the binding: kvpool.Store, Pool.offload/restore and
prefix_publish/prefix_fetch, against a real redis-server started for the module
(on a unix socket in a temporary directory). Skips, saying why, when redis-server
is not installed or the library was built without hiredis."""

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

np = pytest.importorskip("numpy")
import kvpool  # noqa: E402

L, H, D = 2, 2, 64


@pytest.fixture(scope="module")
def url():
    exe = shutil.which("redis-server")
    if not exe:
        pytest.skip("redis-server is not installed (make deps installs it)")
    d = tempfile.mkdtemp(prefix="kvpool-py-store-")
    sock = os.path.join(d, "redis.sock")
    proc = subprocess.Popen([exe, "--port", "0", "--unixsocket", sock, "--save", "", "--appendonly", "no",
                             "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):
            if os.path.exists(sock):
                break
            time.sleep(0.01)
        u = f"unix://{sock}"
        try:
            kvpool.Store(u).close()
        except kvpool.NotSupportedError as e:
            pytest.skip(f"the library has no store tier: {e}")
        yield u
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def mkpool(**kw):
    return kvpool.Pool(layers=L, kv_heads=H, head_dim=D, k_dtype="fp16", v_dtype="fp16",
                       region_bytes=16 << 20, **kw)


def fill(pool, seq, n, seed):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, H, D)).astype(np.float16)
    v = rng.standard_normal((n, H, D)).astype(np.float16)
    with pool.step(seq, n):
        for layer in range(L):
            pool.append(seq, layer, k, v)


def reads(pool, seq):
    return [pool.read(seq, layer, h) for layer in range(L) for h in range(H)]


def same(a, b):
    assert len(a) == len(b)
    for (k1, v1, p1), (k2, v2, p2) in zip(a, b):
        assert np.array_equal(k1, k2) and np.array_equal(v1, v2) and np.array_equal(p1, p2)


def test_offload_restore_round_trip(url):
    with mkpool(codecs="k=int8,v=fp8") as pool, kvpool.Store(url + "?prefix=rt:") as st:
        pool.add(7)
        fill(pool, 7, 40, 1)
        fill(pool, 7, 1, 2)
        before = reads(pool, 7)
        full = pool.stats()["bytes.allocated"]["current"]
        pool.offload(7, st)
        pool.check()
        assert pool.stats()["bytes.allocated"]["current"] < full
        assert 7 not in pool.sequences
        with pytest.raises(kvpool.NotFoundError):
            pool.seq_info(7)
        sent, recv = st.traffic()
        assert sent > 0 and recv == 0
        pool.restore(7, st)
        pool.check()
        assert pool.seq_info(7)["n_positions"] == 41
        same(before, reads(pool, 7))
        assert st.traffic()[1] > 0
        fill(pool, 7, 1, 3)  # the restored sequence goes on
        with pytest.raises(kvpool.NotFoundError):  # restored: its keys are gone from the store
            pool.restore(8, st)


def test_prefix_shared_between_pools(url):
    prompt = [(i * 37 + 5) % 50000 for i in range(100)]
    with mkpool() as a, mkpool() as b, kvpool.Store(url + "?prefix=share:") as st:
        a.add(1, tokens=prompt)
        fill(a, 1, len(prompt), 4)
        published = a.prefix_publish(1, st)
        assert 0 < published <= len(prompt)
        b.add(2, tokens=prompt[:90])  # a shorter prompt with the same start
        got = b.prefix_fetch(2, st)
        assert 0 < got <= min(published, 90)
        assert b.seq_info(2)["n_positions"] == got
        b.check()
        for layer in range(L):
            for h in range(H):
                k1, v1, _ = a.read(1, layer, h)
                k2, v2, p2 = b.read(2, layer, h)
                assert np.array_equal(p2, np.arange(got, dtype=p2.dtype))
                assert np.array_equal(k1[:got], k2) and np.array_equal(v1[:got], v2)
        fill(b, 2, 90 - got, 5)  # the rest of the prompt is computed
        # a third pool that adds the same prompt attaches nothing by itself and fetches it all
        with mkpool() as c:
            c.add(3, tokens=prompt)
            assert c.seq_info(3)["n_positions"] == 0
            assert c.prefix_fetch(3, st) == published


def test_errors_name_the_culprit(url):
    with pytest.raises(kvpool.InvalidError):
        kvpool.Store("http://nowhere")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(kvpool.StoreIOError):
        kvpool.Store(f"redis://127.0.0.1:{port}?timeout_ms=200")
    with mkpool() as pool:
        pool.add(1)
        fill(pool, 1, 8, 6)
        with pytest.raises(kvpool.InvalidError):
            pool.offload(1, "not a store")
        st = kvpool.Store(url)
        st.set_stream(None)  # ignored by a host pool
        with pytest.raises(kvpool.InvalidError):
            st.set_stream("stream")
        pool.step_begin(1, 1)
        with pytest.raises(kvpool.BusyError):
            pool.offload(1, st)  # inside a step: nothing happens
        st.close()
        assert st.closed and "closed" in repr(st)
        with pytest.raises(kvpool.InvalidError):
            pool.restore(1, st)
        with pytest.raises(kvpool.InvalidError):
            st.traffic()
        pool.check()
