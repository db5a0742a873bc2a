"""kvpool.hf.KvpoolCache in transformers generation on the GPU (make test-gpu).

A Llama-architecture model built locally from a LlamaConfig (no download: 4 layers, GQA
8 query / 2 KV heads, RoPE, random weights from a fixed seed, bf16 on cuda:0) generates
with DynamicCache and with KvpoolCache:
  - raw bf16 in a CUDA pool gives the same tokens and the same logits, bit for bit;
  - batched rows and beam search (rows forked in the pool) give DynamicCache's tokens;
  - fp8, int8, nvfp4 and kivi give logits whose error against DynamicCache's is reported
    per codec (teacher-forced on the reference tokens), from a CUDA pool when the library
    takes that codec on the device, else from a host pool with copies;
  - a window policy evicts for real during generation;
  - the pool's ledger is printed beside torch.cuda.memory_allocated().
Skipped without torch, CUDA or transformers. Runs under pytest, or as a script.
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

try:
    import pytest
except ImportError:  # run as a script
    pytest = None

try:
    import torch
    import transformers
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    HAVE = torch.cuda.is_available()
    WHY = "CUDA is not available"
except ImportError as e:
    HAVE, WHY = False, f"needs torch and transformers ({e})"

if pytest is not None:
    pytestmark = pytest.mark.skipif(not HAVE, reason=WHY)

import kvpool  # noqa: E402

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 4, 8, 2, 64
PROMPT, NEW = 32, 256
RESULTS = {}


def _model():
    if "model" not in RESULTS:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=1024, hidden_size=Q_HEADS * HEAD_DIM, intermediate_size=1024,
                          num_hidden_layers=LAYERS, num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS,
                          head_dim=HEAD_DIM, max_position_embeddings=4096, rope_theta=10000.0,
                          attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, cfg.vocab_size, (2, PROMPT), generator=g).to("cuda")
        RESULTS["model"] = (model, cfg, prompt)
    return RESULTS["model"]


def _pool(codecs=None, memory="cuda", policy=None, region=256 << 20):
    return kvpool.Pool(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, k_dtype="bf16", v_dtype="bf16",
                       memory=memory, region_bytes=region, block_tokens=64, codecs=codecs, policy=policy)


def _generate(model, ids, cache, **kw):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=0, **kw)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return out, ids.shape[0] * NEW / dt


def _reference():
    if "ref" not in RESULTS:
        model, cfg, prompt = _model()
        out, tps = _generate(model, prompt[:1], DynamicCache())
        RESULTS["ref"] = (out, tps)
    return RESULTS["ref"]


def _ledger(pool, label):
    s = pool.stats()
    by_type = {t: u["allocated_bytes"] for t, u in s["page_types"].items() if u["allocated_bytes"]}
    print(f"  [{label}] pool allocated {s['bytes.allocated']['current']} B (peak {s['bytes.allocated']['peak']}), "
          f"bf16-equivalent {s['bytes.bf16_equivalent']['current']} B, savings {s['savings.ratio']:.2f}x, "
          f"by page type {by_type}, evicted {s['tokens.evicted']} tokens; "
          f"torch.cuda.memory_allocated {torch.cuda.memory_allocated()} B")


def test_raw_bf16_identical():
    from kvpool.hf import KvpoolCache
    model, cfg, prompt = _model()
    ref, ref_tps = _reference()
    with _pool() as pool:
        cache = KvpoolCache(pool)
        out, tps = _generate(model, prompt[:1], cache)
        _ledger(pool, "raw bf16, cuda pool")
        assert torch.equal(out.sequences, ref.sequences), "tokens differ from DynamicCache"
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(out.logits, ref.logits))
        print(f"  raw bf16: {NEW} tokens identical, max |logit diff| {err:g}; "
              f"{tps:.1f} tok/s vs DynamicCache {ref_tps:.1f} tok/s")
        assert err == 0.0
        assert pool.seq_info(cache.seq_ids[0])["n_positions"] == PROMPT + NEW - 1
        pool.check()
        cache.close()


def test_batched_and_beam_search_rows_fork():
    from kvpool.hf import KvpoolCache
    model, cfg, prompt = _model()
    ref, _ = _generate(model, prompt, DynamicCache())
    with _pool() as pool:
        out, _ = _generate(model, prompt, KvpoolCache(pool))
        assert torch.equal(out.sequences, ref.sequences), "batched rows differ from DynamicCache"
    with torch.no_grad():
        kw = dict(max_new_tokens=32, num_beams=3, do_sample=False, pad_token_id=0, early_stopping=False)
        ref = model.generate(prompt[:1], past_key_values=DynamicCache(), **kw)
        with _pool() as pool:
            cache = KvpoolCache(pool)
            out = model.generate(prompt[:1], past_key_values=cache, **kw)
            s = pool.stats()
            print(f"  beam search (3 beams): {len(cache.seq_ids)} rows, sequences live {s['sequences.live']['current']}")
            assert torch.equal(out, ref), "beam search differs from DynamicCache"
            pool.check()


def _teacher_forced_logits(model, tokens, cache):
    """Logits of a manual forward loop feeding the reference tokens: the prompt, then one token per step."""
    logits = []
    with torch.no_grad():
        out = model(tokens[:, :PROMPT], past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        for t in range(PROMPT, tokens.shape[1] - 1):
            out = model(tokens[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return logits


CODECS = ["kv=fp8", "kv=int8", "kv=nvfp4", "kv=kivi:bits=4:group=32", "kv=kivi:bits=2:group=32"]


def test_codec_logit_error():
    from kvpool.hf import KvpoolCache
    model, cfg, prompt = _model()
    ref, _ = _reference()
    tokens = ref.sequences
    base = _teacher_forced_logits(model, tokens, DynamicCache())
    # the manual loop (no attention mask passed) against generate's logits: the same up to kernel choice
    loop_vs_generate = max((a.float() - b.float()).abs().max().item() for a, b in zip(base, ref.logits))
    print(f"  manual forward loop vs generate (both DynamicCache): max |logit diff| {loop_vs_generate:g}")
    scale = torch.stack([x.float() for x in base]).std().item()
    rows = []
    for spec in CODECS:
        where = "cuda"
        try:
            pool = _pool(spec, memory="cuda")
        except (kvpool.NotSupportedError, kvpool.InvalidError) as e:  # device codecs not built yet
            where = f"host ({e.name})"
            pool = _pool(spec, memory="host")
        with pool:
            cache = KvpoolCache(pool)
            got = _teacher_forced_logits(model, tokens, cache)
            _ledger(pool, spec)
            d = torch.stack([(a.float() - b.float()) for a, b in zip(got, base)])
            top1 = sum(int(a.argmax() == b.argmax()) for a, b in zip(got, base)) / len(base)
            rows.append((spec, where, d.abs().max().item(), d.abs().mean().item() / scale, top1,
                         pool.stats()["savings.ratio"]))
            assert torch.isfinite(d).all()
            pool.check()
            cache.close()
    print(f"  logits against DynamicCache, {len(base)} teacher-forced steps (logit std {scale:.3f}):")
    print(f"  {'codec':28s} {'pool':22s} {'max |diff|':>10s} {'mean/std':>9s} {'top-1 agree':>11s} {'savings':>8s}")
    for spec, where, mx, rel, top1, sav in rows:
        print(f"  {spec:28s} {where:22s} {mx:10.4f} {rel:9.4f} {top1:11.1%} {sav:7.2f}x")
    RESULTS["codecs"] = rows
    for spec, where, mx, rel, top1, sav in rows:
        assert rel < 0.5, f"{spec}: mean logit error {rel:.3f} of the logit std"


def _fused_model():
    """The same model (same weights) with attn_implementation="kvpool"."""
    if "fused_model" not in RESULTS:
        import kvpool.hf
        kvpool.hf.register()
        import copy
        model, cfg, prompt = _model()
        m2 = copy.deepcopy(model)
        m2.config._attn_implementation = "kvpool"
        RESULTS["fused_model"] = m2
    return RESULTS["fused_model"]


def test_fused_decode():
    """KvpoolCache(fused=True) on a model whose attention is "kvpool": decode steps go through
    kvp_attend_decode (counted), and their logits match the read-back path's (the same pool
    contents, attention by SDPA) within the kernel's rounding, per codec and with a policy."""
    from kvpool.hf import KvpoolCache
    fm = _fused_model()
    ref, _ = _reference()
    tokens = ref.sequences
    rows = []
    for spec, policy in [(None, None), ("kv=fp8", None), ("kv=int8", None), ("kv=nvfp4", None),
                         ("kv=kivi:bits=2:group=32", None), (None, "window:sink=4:recent=64")]:
        mode = "step" if policy else "stream"
        with _pool(spec, policy=policy) as pool:
            slow = KvpoolCache(pool, mode=mode)
            want = _teacher_forced_logits(fm, tokens, slow)  # fused=False: read back, then SDPA
            slow.close()
        with _pool(spec, policy=policy) as pool:
            cache = KvpoolCache(pool, mode=mode, fused=True)
            got = _teacher_forced_logits(fm, tokens, cache)
            steps = len(got) - 1
            assert cache.fused_calls == steps * LAYERS, f"{cache.fused_calls} fused layer steps, {steps * LAYERS} expected"
            pool.check()
            cache.close()
        scale = torch.stack([x.float() for x in want]).std().item()
        d = torch.stack([(a.float() - b.float()) for a, b in zip(got, want)])
        top1 = sum(int(a.argmax() == b.argmax()) for a, b in zip(got, want)) / len(want)
        rows.append((spec or "raw bf16", policy or "-", d.abs().max().item(), d.abs().mean().item() / scale, top1))
        assert torch.isfinite(d).all()
    print(f"  fused decode (kvp_attend_decode) against read-back + SDPA, {len(tokens[0]) - PROMPT} steps:")
    print(f"  {'codec':26s} {'policy':26s} {'max |diff|':>10s} {'mean/std':>9s} {'top-1 agree':>11s}")
    for spec, pol, mx, rel, top1 in rows:
        print(f"  {spec:26s} {pol:26s} {mx:10.4f} {rel:9.5f} {top1:11.1%}")
    for spec, pol, mx, rel, top1 in rows:
        assert rel < 0.02 and top1 >= 0.95, f"{spec} {pol}: mean logit diff {rel:.4f} of the std, top-1 {top1:.1%}"


def test_fused_generate_matches():
    """generate() with the fused cache: the tokens follow DynamicCache's (raw bf16) as long as
    bf16 rounding of the two attention kernels lets them; the fused path must be taken."""
    from kvpool.hf import KvpoolCache
    fm = _fused_model()
    model, cfg, prompt = _model()
    ref, ref_tps = _reference()
    with _pool() as pool:
        cache = KvpoolCache(pool, fused=True)
        out, tps = _generate(fm, prompt[:1], cache)
        same = int((out.sequences[0, PROMPT:] == ref.sequences[0, PROMPT:]).long().cumprod(0).sum())
        print(f"  fused generate: first {same} of {NEW} tokens equal DynamicCache's; {tps:.1f} tok/s vs "
              f"DynamicCache {ref_tps:.1f}; {cache.fused_calls} fused layer steps")
        assert cache.fused_calls >= (NEW - 1) * LAYERS
        assert same >= 16
        pool.check()
        cache.close()


def test_fused_heatkv_per_head():
    """HeatKV (synthetic orders) evicts per (layer, head) during generation; the fused decode
    attends each head over its own tokens (the read-back path cannot: ragged heads)."""
    from kvpool.hf import KvpoolCache
    fm = _fused_model()
    model, cfg, prompt = _model()
    with _pool(policy="heatkv:b=0.5:s=3:orders=synthetic") as pool:
        cache = KvpoolCache(pool, mode="step", fused=True, step_tokens=[PROMPT] + [1] * (NEW - 1))
        out, tps = _generate(fm, prompt[:1], cache)
        _ledger(pool, "heatkv b=0.5 synthetic, fused")
        info = pool.seq_info(cache.seq_ids[0], per_stream=True)
        kept = [n for row in info["retained_tokens"] for n in row]
        print(f"  heatkv fused: retained per (layer, head) {kept} of {info['n_positions']} positions, "
              f"{cache.fused_calls} fused layer steps, {tps:.1f} tok/s")
        assert out.sequences.shape[1] == PROMPT + NEW
        assert all(torch.isfinite(x.float()).all() for x in out.logits)
        assert cache.fused_calls >= (NEW - 1) * LAYERS
        assert pool.stats()["tokens.evicted"] > 0 and len(set(kept)) > 1, "no per-head eviction happened"
        pool.check()
        cache.close()


def test_window_policy_evicts():
    from kvpool.hf import KvpoolCache
    model, cfg, prompt = _model()
    with _pool(policy="window:sink=4:recent=64") as pool:
        cache = KvpoolCache(pool, mode="step")
        out, tps = _generate(model, prompt[:1], cache)
        _ledger(pool, "window sink=4 recent=64")
        s = pool.stats()
        assert out.sequences.shape[1] == PROMPT + NEW
        assert s["tokens.evicted"] > 0
        info = pool.seq_info(cache.seq_ids[0], per_stream=True)
        kept = {n for row in info["retained_tokens"] for n in row}
        print(f"  window: retained per (layer, head) {sorted(kept)} of {info['n_positions']} positions; {tps:.1f} tok/s")
        assert max(kept) <= 4 + 64 + PROMPT
        pool.check()


def main():
    if not HAVE:
        print(f"skip gpu_hf_test.py: {WHY}")
        return 0
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name(0)}, "
          f"kvpool {kvpool.__version__} ({kvpool.library_path})")
    failed = 0
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            print(name)
            try:
                fn()
                print(f"ok   {name}")
            except Exception as e:  # report and go on
                failed += 1
                import traceback
                traceback.print_exc()
                print(f"FAIL {name}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
