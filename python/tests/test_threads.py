"""Readers on other threads beside the writer: every read is a consistent prefix of what
was appended (contiguous positions, exact values), never shrinking; the library releases
the GIL, and its readers are lock-free."""

import threading
import time

import numpy as np

import kvpool
from kvdata import kv_tokens

L, H, D, STEPS = 4, 2, 64, 600
KALL = kv_tokens(0, STEPS * 2, H, D, 0).astype(np.float16)
VALL = kv_tokens(0, STEPS * 2, H, D, 1).astype(np.float16)


def test_readers_beside_writer():
    errors, reads = [], [0]
    done = threading.Event()
    with kvpool.Pool(layers=L, kv_heads=H, head_dim=D, k_dtype="fp16", v_dtype="fp16", block_tokens=16,
                     region_bytes=64 << 20) as pool:
        pool.add(1)
        pool.extend(1, [KALL[:1]] * L, [VALL[:1]] * L)  # the readers find the sequence

        def reader(tid):
            last = 0
            rng = np.random.default_rng(tid)
            try:
                while not done.is_set():
                    layer, head = int(rng.integers(L)), int(rng.integers(H))
                    k, v, pos = pool.read(1, layer, head)
                    n = len(pos)
                    assert n >= 1 and np.array_equal(pos, np.arange(n, dtype=np.uint32)), pos[:8]
                    assert np.array_equal(k, KALL[:n, head]) and np.array_equal(v, VALL[:n, head])
                    if layer == 0:
                        assert n >= last
                        last = n
                    pool.stats()  # lock-free too
                    reads[0] += 1
            except Exception as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        pos = 1
        t0 = time.monotonic()
        while pos < STEPS and not errors:
            n = 1 if pos % 7 else 3  # decode steps and a few longer ones
            pool.step_begin(1, n)
            for layer in range(L):
                pool.append(1, layer, KALL[pos:pos + n], VALL[pos:pos + n])
            pool.step_end(1)
            pos += n
        done.set()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert reads[0] > 10, f"only {reads[0]} reads in {time.monotonic() - t0:.2f} s"
        k, _, p = pool.read(1, L - 1, 1)
        assert len(p) == pos and np.array_equal(k, KALL[:pos, 1])
        pool.check()
