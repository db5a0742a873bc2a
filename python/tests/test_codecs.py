"""numpy round trips through every built-in codec, in stream mode (prefill, then decode steps
that seal blocks one by one) and step mode, compared with the input: exactly for raw, within
each format's error otherwise (relative RMS over the sequence, bounds as in
tests/integration/check_codecs_pool.c on the same kind of data)."""

import numpy as np
import pytest

import kvpool
from kvdata import kv_tokens

L, H, D, N = 2, 2, 128, 256

# spec, max relative RMS error, block_tokens
CASES = [
    ("kv=bf16", 0.0, 32),
    ("kv=fp8", 0.05, 32),
    ("kv=fp8:scale=0.05", 0.08, 32),
    ("kv=int8", 0.02, 32),
    ("kv=kivi:bits=4:group=32", 0.08, 32),
    ("kv=kivi:bits=2:group=32:residual=128", 0.45, 32),
    ("kv=nvfp4", 0.15, 32),
    ("k=nvfp4:rule=4/6:ksmooth=store,v=nvfp4:rule=4/6", 0.15, 32),
    ("k=bf16,v=int8;layers=1:k=fp8", 0.05, 32),
    # uniform noise of amplitude 1.5 over small channel offsets: INT2 residuals, 16 centroids
    ("kv=qvg:k=16", 0.5, 256),
    ("kv=qvg-pro:k=16", 0.4, 256),
    # the synthetic calibration (fitted at create) was not fitted to this data
    ("kv=kvquant:bits=4", 0.3, 32),
    ("kv=kvquant:bits=3", 0.4, 32),
]

K = kvpool.f32_to_bf16(kv_tokens(0, N, H, D, 0))
V = kvpool.f32_to_bf16(kv_tokens(0, N, H, D, 1))


def fill(pool, seq, splits):
    pos = 0
    for n in splits:
        pool.step_begin(seq, n)
        for layer in range(L):
            pool.append(seq, layer, K[pos:pos + n], V[pos:pos + n])
        pool.step_end(seq)
        pos += n
    pool.check()


def rel_err(pool, seq):
    num = den = 0.0
    for layer in range(L):
        for head in range(H):
            k, v, pos = pool.read(seq, layer, head, dtype="f32")
            assert list(pos) == list(range(N))
            for got, src in ((k, K), (v, V)):
                want = kvpool.bf16_to_f32(src[:, head])
                assert np.isfinite(got).all()
                num += float(((got - want) ** 2).sum())
                den += float((want ** 2).sum())
    return (num / den) ** 0.5


@pytest.mark.parametrize("spec,bound,bt", CASES, ids=[c[0] for c in CASES])
def test_codec_round_trip(spec, bound, bt):
    with kvpool.Pool(layers=L, kv_heads=H, head_dim=D, k_dtype="bf16", v_dtype="bf16", codecs=spec,
                     block_tokens=bt, region_bytes=64 << 20) as pool:
        pool.add(1)  # stream: a prefill, then decode steps
        fill(pool, 1, [200] + [1] * (N - 200))
        pool.add(2, step_tokens=[100, 100, 56])  # step mode: blocks encoded at once
        fill(pool, 2, [100, 100, 56])
        e1, e2 = rel_err(pool, 1), rel_err(pool, 2)
        s = pool.stats()
        saving = s["savings.ratio"]
        print(f"{spec:48s} rel. error {e1:.4f} (stream) {e2:.4f} (step), {saving:.2f}x vs bf16")
        if bound == 0.0:
            assert e1 == 0.0 and e2 == 0.0
            k, _, _ = pool.read(1, 0, 1)  # raw bf16 comes back bit for bit
            assert np.array_equal(k.view(np.uint16), K[:, 1])
        else:
            assert 0 < e1 <= bound and 0 < e2 <= bound
            if "qvg" not in spec:  # qvg's centroids of a 256-token block cost more than they save
                assert saving > 1.2
        codec_bytes = sum(c["allocated_bytes"] for c in s["codecs"].values())
        assert codec_bytes == s["bytes.allocated"]["current"]
        names = {c.get("name") for c in s["codecs"].values()}
        for name in ("fp8", "int8", "kivi", "nvfp4", "qvg", "qvg-pro", "kvquant"):
            if f"={name}:" in spec + ":":
                assert name in names, names
