"""The binding over host pools: the issue's example as written, sequences and steps,
errors with messages, nothing changed after a failed call, views, fork, eviction."""

import pydoc

import numpy as np
import pytest

import kvpool
from kvdata import kv_tokens

L, H, D = 2, 2, 64


def test_issue_example():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((16, 2, 64)).astype(np.float16)
    v = rng.standard_normal((16, 2, 64)).astype(np.float16)
    # --- as written in issue 15 ---
    with kvpool.Pool(layers=2, kv_heads=2, head_dim=64, k_dtype="fp16", v_dtype="fp16",
                     codecs="kv=int8", region_bytes=64 << 20, budget_bytes=32 << 20) as pool:
        pool.add(1)                                  # stream mode; pool.add(2, step_tokens=[1, 4, 16]) for steps
        pool.step_begin(1, 16)
        for layer in range(2):
            pool.append(1, layer, k, v)              # numpy [16][2][64] float16 (torch tensors too)
        pool.step_end(1)
        k1, v1, pos = pool.read(1, 0, head=1)        # numpy [n][64] (dtype= to choose), positions
        pool.stats()["bytes.allocated"]["current"]   # the keys of the JSON stats
        pool.check()
        # --- what it gave ---
        assert k1.shape == (16, 64) and k1.dtype == np.float16 and v1.shape == (16, 64)
        assert list(pos) == list(range(16))
        assert np.abs(k1.astype(np.float32) - k[:, 1]).max() < 0.03  # int8 of N(0,1): step <= 4.5/127
        assert np.abs(v1.astype(np.float32) - v[:, 1]).max() < 0.03
        assert pool.stats()["bytes.allocated"]["current"] > 0
        k32, _, _ = pool.read(1, 0, head=1, dtype="f32")
        assert k32.dtype == np.float32 and np.array_equal(k32.astype(np.float16), k1)
        pool.add(2, step_tokens=[1, 4, 16])
        assert pool.seq_info(2)["mode"] == "step"
    assert pool.closed


def mkpool(**kw):
    args = dict(layers=L, kv_heads=H, head_dim=D, k_dtype="fp16", v_dtype="fp16", region_bytes=16 << 20)
    args.update(kw)
    return kvpool.Pool(**args)


def f16(pos0, n, kv):
    return kv_tokens(pos0, n, H, D, kv).astype(np.float16)


def step(pool, seq, pos0, n):
    pool.step_begin(seq, n)
    for layer in range(pool.layers):
        pool.append(seq, layer, f16(pos0, n, 0), f16(pos0, n, 1))
    pool.step_end(seq)


def snapshot(pool, seqs):
    s = pool.stats_snapshot()
    for key in ("device.used_bytes", "device.total_bytes", "host.metadata_bytes"):
        s.pop(key)  # probes and metadata high-water marks, not pool contents
    return s, {q: pool.seq_info(q, per_stream=True) for q in seqs}


def test_help_is_a_manual():
    text = pydoc.render_doc(kvpool.Pool, renderer=pydoc.plaintext)
    for word in ("class Pool", "context manager", "append(", "read(", "evict(", "view(", "stats(", "BudgetError",
                 "step_tokens", "torch"):
        assert word in text, word
    assert kvpool.Pool.append.__doc__ and kvpool.Pool.read.__annotations__


def test_step_and_extend_and_positions():
    with mkpool() as pool:
        pool.add(7)
        step(pool, 7, 0, 5)
        with pool.step(7, 3):
            for layer in range(L):
                pool.append(7, layer, f16(5, 3, 0), f16(5, 3, 1))
        pool.extend(7, np.stack([f16(8, 2, 0)] * L), np.stack([f16(8, 2, 1)] * L))
        k, v, pos = pool.read(7, 1, head=0)
        assert list(pos) == list(range(10))
        assert np.array_equal(k, f16(0, 10, 0)[:, 0]) and np.array_equal(v, f16(0, 10, 1)[:, 0])
        info = pool.seq_info(7)
        assert info["n_steps"] == 3 and info["n_positions"] == 10 and not info["in_step"]
        assert info["tokens_retained"] == 10 * L * H
        k, v, pos = pool.read(7, 0, head=1, v=False)
        assert v is None and k.shape == (10, D)
        pool.check()


def test_raw_dtypes_exact():
    x = kv_tokens(0, 20, H, D, 0)
    for name, npdt in (("f32", np.float32), ("fp16", np.float16)):
        with mkpool(k_dtype=name, v_dtype=name) as pool:
            pool.add(1)
            pool.extend(1, np.stack([x.astype(npdt)] * L), np.stack([-x.astype(npdt)] * L))
            k, v, pos = pool.read(1, 1, head=1)
            assert k.dtype == npdt and np.array_equal(k, x.astype(npdt)[:, 1])
            assert np.array_equal(v, -x.astype(npdt)[:, 1])
            k32, _, _ = pool.read(1, 1, head=1, dtype="f32")
            assert np.array_equal(k32, x.astype(npdt).astype(np.float32)[:, 1])
    # bf16: uint16 bit patterns in and out; kvpool.f32_to_bf16 / bf16_to_f32 convert
    bits = kvpool.f32_to_bf16(x)
    assert bits.dtype == np.uint16 and np.abs(kvpool.bf16_to_f32(bits) - x).max() <= np.abs(x).max() / 128
    with mkpool(k_dtype="bf16", v_dtype="bf16") as pool:
        pool.add(1)
        pool.extend(1, np.stack([bits] * L), np.stack([bits] * L))
        k, _, _ = pool.read(1, 0, head=0)
        assert k.dtype.itemsize == 2 and np.array_equal(k.view(np.uint16), bits[:, 0])
        k32, _, _ = pool.read(1, 0, head=0, dtype="f32")
        assert np.array_equal(k32, kvpool.bf16_to_f32(bits[:, 0]))


def test_read_into_buffers():
    with mkpool() as pool:
        pool.add(3)
        step(pool, 3, 0, 12)
        ko = np.zeros((32, D), np.float16)
        vo = np.zeros((32, D), np.float32)
        with pytest.raises(kvpool.InvalidError, match="differ in dtype"):
            pool.read_into(3, 0, 1, ko, vo)
        vo = np.zeros((32, D), np.float16)
        po = np.zeros(32, np.uint32)
        n = pool.read_into(3, 0, 1, ko, vo, po)
        assert n == 12 and np.array_equal(ko[:12], f16(0, 12, 0)[:, 1]) and list(po[:12]) == list(range(12))
        small = np.zeros((4, D), np.float16)
        with pytest.raises(kvpool.RegionFullError) as ei:
            pool.read_into(3, 0, 1, small, None)
        assert ei.value.needed == 12 and "capacity_tokens is 4" in ei.value.message
        assert not small.any()  # nothing written


def test_read_into_fast_path_refusals():
    """The numpy fast path (cffi) leaves every buffer it cannot take to the checked path, which
    names the argument; a full-size positions buffer and RegionFullError work as in C."""
    with mkpool() as pool:
        pool.add(3)
        step(pool, 3, 0, 12)
        ko, vo, po = np.zeros((16, D), np.float16), np.zeros((16, D), np.float16), np.zeros(16, np.uint32)
        ro = ko.copy()
        ro.flags.writeable = False
        with pytest.raises(kvpool.InvalidError, match="k_out"):
            pool.read_into(3, 0, 1, ro, vo, po)
        strided = np.zeros((16, 2 * D), np.float16)[:, ::2]
        with pytest.raises(kvpool.InvalidError, match="v_out"):
            pool.read_into(3, 0, 1, ko, strided, po)
        with pytest.raises(kvpool.InvalidError, match="positions_out"):
            pool.read_into(3, 0, 1, ko, vo, np.zeros(16, np.int64))
        with pytest.raises(kvpool.InvalidError, match="positions_out"):
            pool.read_into(3, 0, 1, ko, vo, np.zeros(32, np.uint32)[::2])
        with pytest.raises(kvpool.InvalidError, match=f"expected a writable C-contiguous \\[capacity, {D}\\]"):
            pool.read_into(3, 0, 1, ko.reshape(16, D // 2, 2), vo, po)
        assert not ko.any() and not vo.any() and not po.any()  # nothing written by a refused call
        with pytest.raises(kvpool.RegionFullError) as ei:
            pool.read_into(3, 0, 1, ko[:5], vo, po)
        assert ei.value.needed == 12
        assert pool.read_into(3, 1, 0, ko, vo, po) == 12
        assert np.array_equal(vo[:12], f16(0, 12, 1)[:, 0]) and list(po[:12]) == list(range(12))
        # read() returns its buffers whole when nothing was evicted, sliced otherwise
        k, v, pos = pool.read(3, 1, 1)
        assert k.shape == (12, D) and np.array_equal(v, f16(0, 12, 1)[:, 1]) and list(pos) == list(range(12))
        pool.evict(3, 1, 1, 0)
        k, v, pos = pool.read(3, 1, 1)
        assert k.shape == (0, D) and len(pos) == 0


def test_pointer_paths_match_checked_ones():
    """Pool._append_ptrs and _read_ptrs (kvpool.hf's per-row calls, by address) store and read
    what append and read_into do, and fail the same way."""
    from kvpool import _lib
    with mkpool(codecs="kv=int8") as a, mkpool(codecs="kv=int8") as b:
        for p in (a, b):
            p.add(1)
        for pos0, n in ((0, 5), (5, 1), (6, 1)):
            k, v = f16(pos0, n, 0), f16(pos0, n, 1)
            a.step_begin(1, n)
            b.step_begin(1, n)
            for layer in range(L):
                a.append(1, layer, k, v)
                b._append_ptrs(1, layer, k.ctypes.data, v.ctypes.data, None)
            a.step_end(1)
            b.step_end(1)
        out = np.zeros((2, 8, D), np.float16)
        for layer in range(L):
            for h in range(H):
                ka, va, _ = a.read(1, layer, h)
                n = b._read_ptrs(1, layer, h, _lib.DTYPE_F16, 8, out.ctypes.data, out.ctypes.data + out[0].nbytes, None)
                assert n == 7 and np.array_equal(out[0, :7], ka) and np.array_equal(out[1, :7], va)
        with pytest.raises(kvpool.RegionFullError) as ei:
            b._read_ptrs(1, 0, 0, _lib.DTYPE_F16, 3, out.ctypes.data, out.ctypes.data + out[0].nbytes, None)
        assert ei.value.needed == 7
        with pytest.raises(kvpool.InvalidError, match="outside a step"):
            b._append_ptrs(1, 0, out.ctypes.data, out.ctypes.data, None)
        a.check()
        b.check()
    with pytest.raises(kvpool.InvalidError, match="closed"):
        b._read_ptrs(1, 0, 0, _lib.DTYPE_F16, 8, out.ctypes.data, out.ctypes.data, None)


def test_fast_paths_on_other_threads():
    """Appends and reads from a thread other than the pool's creator (which reuses one request
    struct) give the same results."""
    import threading
    out = {}
    with mkpool() as pool:
        pool.add(5)

        def work():
            step(pool, 5, 0, 3)
            ko, vo, po = np.zeros((8, D), np.float16), np.zeros((8, D), np.float16), np.zeros(8, np.uint32)
            out["n"] = pool.read_into(5, 1, 1, ko, vo, po)
            out["k"], out["pos"] = ko[:3].copy(), list(po[:3])
            out["read"] = pool.read(5, 0, 0)

        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert out["n"] == 3 and np.array_equal(out["k"], f16(0, 3, 0)[:, 1]) and out["pos"] == [0, 1, 2]
        k, v, pos = out["read"]
        assert np.array_equal(v, f16(0, 3, 1)[:, 0]) and list(pos) == [0, 1, 2]
        pool.check()


def test_errors_carry_messages():
    with pytest.raises(kvpool.InvalidError, match="colour") as ei:
        mkpool(codecs="k=fp8:colour=red")
    assert isinstance(ei.value, ValueError) and ei.value.call == "kvp_pool_create"
    assert ei.value.status == -1 and ei.value.name == "KVP_EINVAL" and "colour" in kvpool.last_error()
    with pytest.raises(kvpool.InvalidError, match="memory"):
        mkpool(memory="disk")
    with pytest.raises(kvpool.InvalidError, match="k_dtype"):
        mkpool(k_dtype="int4")
    with mkpool() as pool:
        pool.add(1)
        with pytest.raises(kvpool.ExistsError, match="1"):
            pool.add(1)
        with pytest.raises(kvpool.NotFoundError) as ei:
            pool.free(99)
        assert isinstance(ei.value, LookupError) and "99" in str(ei.value)
        with pytest.raises(kvpool.InvalidError, match="outside a step"):
            pool.append(1, 0, f16(0, 1, 0), f16(0, 1, 1))
        pool.step_begin(1, 4)
        with pytest.raises(kvpool.BusyError):
            pool.step_begin(1, 4)
        # checked by the binding before the call, naming the argument
        with pytest.raises(kvpool.InvalidError, match=r"k: shape \(3, 2, 64\), expected \(4, 2, 64\)"):
            pool.append(1, 0, f16(0, 3, 0), f16(0, 4, 1))
        with pytest.raises(kvpool.InvalidError, match="v: dtype float32 does not match"):
            pool.append(1, 0, f16(0, 4, 0), f16(0, 4, 1).astype(np.float32))
        with pytest.raises(kvpool.InvalidError, match="not C-contiguous"):
            pool.append(1, 0, np.asfortranarray(f16(0, 4, 0)), f16(0, 4, 1))
        with pytest.raises(kvpool.InvalidError, match="numpy array or a torch tensor"):
            pool.append(1, 0, [[0.0]], f16(0, 4, 1))
        with pytest.raises(kvpool.InvalidError, match="out of order"):
            pool.append(1, 1, f16(0, 4, 0), f16(0, 4, 1))
        nan = f16(0, 4, 1)
        nan[2, 1, 5] = np.nan
        with pytest.raises(kvpool.InvalidError, match="head 1, token 2"):
            pool.append(1, 0, f16(0, 4, 0), nan)
        pool.append(1, 0, f16(0, 4, 0), f16(0, 4, 1))  # the same layer again, after the failure
        with pytest.raises(kvpool.InvalidError, match="ended after 1 of 2 layers"):
            pool.step_end(1)
        pool.append(1, 1, f16(0, 4, 0), f16(0, 4, 1))
        pool.step_end(1)
        with pytest.raises(kvpool.NotFoundError, match="never begun"):
            pool.evict(1, 0, 0, 5)
        pool.evict(1, 0, 0, 0)
        with pytest.raises(kvpool.NotFoundError, match="not retained"):
            pool.evict(1, 0, 0, 0)
        pool.check()
    with pytest.raises(kvpool.InvalidError, match="closed"):
        pool.add(2)


def test_budget_error_changes_nothing():
    # raw fp16, block 16: one block of one (layer, head, side) is 16 x 64 x 2 = 2 KiB
    with mkpool(budget_bytes=40 << 10) as pool:
        pool.add(1)
        step(pool, 1, 0, 16)  # 8 pages of 2 KiB
        pool.add(2)
        step(pool, 2, 0, 8)  # 8 more (open blocks of 16 tokens)
        pool.step_begin(2, 16)  # fills the open blocks and starts new ones: more than the budget holds
        failed = None
        for layer in range(L):
            before = snapshot(pool, [1, 2])
            try:
                pool.append(2, layer, f16(8, 16, 0), f16(8, 16, 1))
            except kvpool.BudgetError as e:
                failed = layer
                assert "budget" in e.message and e.call == "kvp_append" and f"layer {layer}" in e.message
                break
        assert failed is not None, "the budget did not refuse"
        after = snapshot(pool, [1, 2])
        for s in (before, after):
            s[0].pop("ops.budget_refusals")  # may count the refusal itself
        assert after == before  # the ledger, every gauge and counter, each sequence's streams
        pool.check()
        k, _, pos = pool.read(2, L - 1, 0)
        assert len(pos) == 8 and np.array_equal(k, f16(0, 8, 0)[:, 0])
        # room made, the same layer goes in
        pool.free(1)
        for layer in range(failed, L):
            pool.append(2, layer, f16(8, 16, 0), f16(8, 16, 1))
        pool.step_end(2)
        k, _, pos = pool.read(2, L - 1, 0)
        assert len(pos) == 24 and np.array_equal(k, f16(0, 24, 0)[:, 0])
        pool.check()


def test_fork_and_free():
    with mkpool() as pool:
        pool.add(1)
        step(pool, 1, 0, 20)
        pool.fork(1, 2)
        step(pool, 2, 20, 3)
        step(pool, 1, 20, 1)
        pool.free(1)
        k, v, pos = pool.read(2, 1, 1)
        assert list(pos) == list(range(23)) and np.array_equal(k, f16(0, 23, 0)[:, 1])
        with pytest.raises(kvpool.NotFoundError):
            pool.read(1, 1, 1)
        assert pool.sequences == [2]
        pool.check()


def test_evict_and_window_policy():
    with mkpool() as pool:
        pool.add(1, mode="step")
        for s in range(4):
            step(pool, 1, 4 * s, 4)
        pool.evict(1, 0, 1, 2)  # layer 0, head 1, step 2 (positions 8..11)
        _, _, pos = pool.read(1, 0, 1)
        assert list(pos) == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]
        _, _, pos = pool.read(1, 0, 0)
        assert len(pos) == 16
        info = pool.seq_info(1, per_stream=True)
        assert info["retained_tokens"][0] == [16, 12] and info["evicted_tokens"][0] == [0, 4]
        assert pool.stats()["tokens.evicted"] == 4
        pool.check()
    with mkpool(policy="window:sink=1:recent=4") as pool:
        pool.add(1, mode="step")
        for s in range(10):
            step(pool, 1, s, 1)
        for layer in range(L):
            for head in range(H):
                k, _, pos = pool.read(1, layer, head)
                assert list(pos) == [0, 6, 7, 8, 9]
                assert np.array_equal(k, f16(0, 10, 0)[pos, head])
        pool.check()


def test_view_describes_pages():
    with mkpool(block_tokens=16) as pool:
        pool.add(1)
        step(pool, 1, 0, 20)
        with pool.view(1, 1) as view:
            assert view.seq == 1 and view.layer == 1
            heads = {}
            for i, b in enumerate(view.blocks):
                heads.setdefault(b.head, []).extend(b.positions)
                assert b.codecs[0] and b.codecs[1]
                addr, nbytes = b.pages[("k", "raw")]
                assert addr and nbytes >= b.n_tokens * D * 2
                row = np.frombuffer(view.page_bytes(i, "k", "raw"), np.float16)
                got = row[: (b.first + b.n_tokens) * D].reshape(-1, D)[b.first:]
                assert np.array_equal(got, f16(0, 20, 0)[list(b.positions), b.head])
            assert heads == {0: list(range(20)), 1: list(range(20))}
        with pytest.raises(kvpool.InvalidError, match="released"):
            view.page_bytes(0, "k", "raw")


def test_dry_pool_counts_without_payload():
    with mkpool(dry=True, codecs="kv=nvfp4") as pool:
        pool.add(1)
        step(pool, 1, 0, 32)
        assert pool.stats()["bytes.allocated"]["current"] > 0
        with pytest.raises(kvpool.NotSupportedError, match="dry"):
            pool.read(1, 0, 0)
        pool.check()


def test_layer_info_and_expansion():
    with kvpool.Pool(layers=2, kv_heads=1, head_dim=128, codecs="layers=1:kv=kivi:bits=2:group=32") as pool:
        raw, kivi = pool.layer_info(0), pool.layer_info(1)
        assert raw["k"]["codec"] == "raw" and raw["k"]["block_tokens"] == 16
        assert kivi["v"]["codec"] == "kivi" and kivi["k"]["block_tokens"] == kivi["v"]["block_tokens"] == 32
        assert kivi["k"]["bytes_per_token"] == 48.0 and kivi["k"]["source_bytes_per_token"] == 256.0
        with pytest.raises(kvpool.InvalidError, match="layer 2"):
            pool.layer_info(2)
    with pytest.raises(kvpool.InvalidError, match="qvg .*291.00 bytes per token"):
        kvpool.Pool(codecs="kv=qvg", block_tokens=16)
    with kvpool.Pool(codecs="kv=qvg", block_tokens=16, allow_expansion=True) as pool:
        assert pool.layer_info(0)["k"]["bytes_per_token"] == 291.0


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    with mkpool(k_dtype="bf16", v_dtype="bf16") as pool:
        pool.add(1)
        k = torch.randn(5, H, D, dtype=torch.bfloat16)
        v = torch.randn(5, H, D, dtype=torch.bfloat16)
        pool.step_begin(1, 5)
        with pytest.raises(kvpool.InvalidError, match="dtype"):
            pool.append(1, 0, k.float(), v)
        with pytest.raises(kvpool.InvalidError, match="contiguous"):
            pool.append(1, 0, k.transpose(0, 1).contiguous().transpose(0, 1), v)
        for layer in range(L):
            pool.append(1, layer, k, v)
        pool.step_end(1)
        k1, v1, pos = pool.read(1, 1, 1, as_torch=True)
        assert torch.equal(k1, k[:, 1]) and torch.equal(v1, v[:, 1]) and pos.tolist() == list(range(5))


def test_device_paths_refused_on_a_host_pool():
    """attend_decode and gather run on CUDA pools only: a host pool refuses by name (the
    library's message), before any torch is needed."""
    with kvpool.Pool(layers=1, kv_heads=2, head_dim=64) as pool:
        pool.add(1)
        with pytest.raises(kvpool.NotSupportedError, match="not a CUDA region"):
            pool.attend_decode(0, [1], None)
        with pytest.raises(kvpool.NotSupportedError, match="not a CUDA region"):
            pool.gather([(1, 0)])
        pool.check()
