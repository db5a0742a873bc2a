#!/usr/bin/env python3
"""Generation with kvpool as the transformers KV cache, with a chosen codec and policy.

Builds a small Llama from a LlamaConfig with random weights (no download, no network: runs
offline), or loads a local model with --model DIR, generates with DynamicCache and with
KvpoolCache (each after an untimed run of the same length; with --repeat the timed runs of the two
alternate), and prints tokens per second for both, the pool's
bytes by page type and its savings against the bf16 cache.

    python3 python/examples/generate.py                                   # raw bf16, CUDA pool
    python3 python/examples/generate.py --codecs kv=int8 --memory host    # any codec on a host pool
    python3 python/examples/generate.py --policy window:sink=4:recent=256 --new-tokens 1024

Needs torch and transformers (and a GPU for --memory cuda, the default).
"""

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvpool  # noqa: E402
from kvpool.hf import KvpoolCache  # noqa: E402
from kvpool.hf import register as register_kvpool_attention  # noqa: E402


def build_model(a, device):
    if a.model:
        return AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16).to(device).eval()
    torch.manual_seed(a.seed)
    hidden = a.q_heads * a.head_dim
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=getattr(a, "intermediate", 0) or 4 * hidden,
                      num_hidden_layers=a.layers, num_attention_heads=a.q_heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.head_dim, max_position_embeddings=max(4096, a.prompt_len + a.new_tokens),
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()


def host_timers():
    """Wrap each cache's per-layer calls with wall-clock timers: the update (append), the attention
    (kvp_attend_decode through KvpoolCache, or sdpa over DynamicCache's tensors) and the ctypes calls
    inside. Returns {name: [seconds per call]}; host time, the device's work runs on meanwhile."""
    import collections
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from kvpool import hf, pool as kpool
    times = collections.defaultdict(list)

    def timed(name, f):
        def w(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                times[name].append(time.perf_counter() - t)
        return w

    hf.KvpoolCache.update = timed("KvpoolCache.update", hf.KvpoolCache.update)
    kpool.Pool._append_ptrs = timed("  kvp_append (ctypes)", kpool.Pool._append_ptrs)
    hf.kvpool_attention = timed("kvpool attention", hf.kvpool_attention)  # what hf.register() registers
    AttentionInterface.register("kvpool", hf.kvpool_attention)
    kpool.Pool._attend_ptrs = timed("  kvp_attend_decode (ctypes)", kpool.Pool._attend_ptrs)
    DynamicCache.update = timed("DynamicCache.update", DynamicCache.update)
    AttentionInterface.register("sdpa", timed("sdpa attention", sdpa_attention_forward))
    return times


def run(model, ids, cache, new_tokens):
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out, ids.shape[0] * new_tokens / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a local transformers model directory (default: a random small Llama)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=0, help="MLP width (default 4 x q_heads x head_dim)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--codecs", default=None, help="codec spec, e.g. kv=int8 (default raw bf16)")
    ap.add_argument("--policy", default=None, help="policy spec, e.g. window:sink=4:recent=256")
    ap.add_argument("--memory", default="cuda" if torch.cuda.is_available() else "host", choices=("cuda", "host"))
    ap.add_argument("--region-mib", type=int, default=1024)
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs of each cache (the median is printed)")
    ap.add_argument("--device-async", action="store_true",
                    help="appends that do not wait for their stream (KVP_POOL_DEVICE_ASYNC; raw, fp8, int8, nvfp4)")
    ap.add_argument("--decode", action="store_true",
                    help="also time each cache on the prompt and one token, and print the decode's ms per token "
                         "(the prompt's time subtracted; medians)")
    ap.add_argument("--fused", action="store_true",
                    help="decode through kvp_attend_decode (attn_implementation \"kvpool\"; CUDA pool)")
    ap.add_argument("--host-times", action="store_true",
                    help="print the host time of each cache's per-layer calls (medians per call, all runs)")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(a, device)
    fused_model = None
    if a.fused:  # the same weights, attention "kvpool"
        register_kvpool_attention()
        fused_model = copy.deepcopy(model)
        fused_model.config._attn_implementation = "kvpool"
    times = host_timers() if a.host_times else None
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(a.seed + 1)
    # ids from 1: generate treats the pad id (0 here) in a prompt as padding and would mask it
    ids = torch.randint(1, cfg.vocab_size, (a.batch, a.prompt_len), generator=g).to(device)

    # each cache runs the whole generation once untimed first: the first run at each length pays
    # for CUDA kernels loaded and the allocator grown (DynamicCache measured 21 tok/s cold,
    # 122 warm on an H200 with the default model)
    run(model, ids, DynamicCache(), a.new_tokens)
    with kvpool.Pool(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                     k_dtype="bf16", v_dtype="bf16", memory=a.memory, region_bytes=a.region_mib << 20,
                     block_tokens=a.block_tokens, codecs=a.codecs, policy=a.policy,
                     device_async=a.device_async and a.memory == "cuda") as pool:
        m = fused_model or model
        warm = KvpoolCache(pool, mode="step" if a.policy else "stream", fused=a.fused)
        run(m, ids, warm, a.new_tokens)
        warm.close()
        # the two caches' timed runs alternate, so that a drift of the machine (clocks, other
        # work) falls on both medians alike
        tpss, ref_tpss, first, ref_first = [], [], [], []
        for _ in range(max(1, a.repeat)):
            if a.decode:  # the prompt and one token: seconds a run (run gives rows x tokens per second)
                ref_first.append(a.batch / run(model, ids, DynamicCache(), 1)[1])
                c1 = KvpoolCache(pool, mode="step" if a.policy else "stream", fused=a.fused)
                first.append(a.batch / run(m, ids, c1, 1)[1])
                c1.close()
            ref, t = run(model, ids, DynamicCache(), a.new_tokens)
            ref_tpss.append(t)
            cache = KvpoolCache(pool, mode="step" if a.policy else "stream", fused=a.fused)
            out, t = run(m, ids, cache, a.new_tokens)
            tpss.append(t)
            if len(tpss) < max(1, a.repeat):
                cache.close()
        tps, ref_tps = statistics.median(tpss), statistics.median(ref_tpss)
        s = pool.stats()
        same = int((out[:, a.prompt_len:] == ref[:, a.prompt_len:]).all(dim=0).long().cumprod(0).sum())
        print(f"model: {cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} KV heads of {head_dim}, "
              f"batch {a.batch}, prompt {a.prompt_len}, {a.new_tokens} new tokens; pool {a.memory}, "
              f"codecs {a.codecs or 'raw bf16'}, policy {a.policy or 'none'}"
              + (f", fused decode ({cache.fused_calls} layer steps by kvp_attend_decode)" if a.fused else ""))
        print(f"tokens/s{' (medians of %d runs)' % a.repeat if a.repeat > 1 else ''}: KvpoolCache {tps:.1f}, "
              f"DynamicCache {ref_tps:.1f} ({tps / ref_tps:.2f}x); "
              f"first {same} of {a.new_tokens} tokens identical to DynamicCache's")
        if a.decode and a.new_tokens > 1:
            n = a.batch * a.new_tokens  # run's tokens per second count every row

            def per_token(rates, ones):  # ms a decode step: a whole run's median seconds less the prompt's
                whole = statistics.median(n / r for r in rates)
                return (whole - statistics.median(ones)) / (a.new_tokens - 1) * 1e3

            dec, ref_dec = per_token(tpss, first), per_token(ref_tpss, ref_first)
            print(f"decode (prompt and first token subtracted): KvpoolCache {dec:.3f} ms a step, DynamicCache "
                  f"{ref_dec:.3f} ({ref_dec / dec:.2f}x); prompt and first token {statistics.median(first) * 1e3:.1f} "
                  f"vs {statistics.median(ref_first) * 1e3:.1f} ms")
        print(f"pool: allocated {s['bytes.allocated']['current']:,} B (peak {s['bytes.allocated']['peak']:,}), "
              f"requested {s['bytes.requested']['current']:,} B, bf16-equivalent "
              f"{s['bytes.bf16_equivalent']['current']:,} B: {s['savings.ratio']:.2f}x smaller, "
              f"{s['tokens.retained']['current']:,} tokens retained, {s['tokens.evicted']:,} evicted")
        for t, u in s["page_types"].items():
            if u["allocated_bytes"]:
                print(f"  {t:10s} {u['allocated_bytes']:>14,} B allocated in {u['pages']:,} pages")
        if device == "cuda":
            print(f"torch.cuda.memory_allocated: {torch.cuda.memory_allocated():,} B")
        if times:
            print("host time per call (medians; the prompt's calls among them):")
            for name, ts in times.items():
                print(f"  {name:30s} {statistics.median(ts) * 1e6:8.1f} us  ({len(ts):,} calls)")
        cache.close()


if __name__ == "__main__":
    main()
