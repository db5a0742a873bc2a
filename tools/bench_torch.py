#!/usr/bin/env python3
"""The torch side of `make bench-gpu`: SDPA (flash) over dense bf16 caches of the
same shapes as kvpool-bench-gpu's gpu_attend figures, and the same quantizers as kvpool's device
encoders, written in plain PyTorch ops, on tensors of the same shape and
distribution (65,536 token-heads of D = 128, bf16, on the GPU), timed with
CUDA events (median of 15 after warm-up). Reads kvpool's figures from the
JSON lines kvpool-bench-gpu printed (argument 1) and prints the ratio
torch time / kvpool time per codec (target: >= 2), as a table and as JSON.

Exit 0 with a message when torch or CUDA is missing (make prints it)."""
import json
import sys

try:
    import torch
except ImportError:
    print("bench_torch: skipped: no torch")
    sys.exit(1)
if not torch.cuda.is_available():
    print("bench_torch: skipped: no CUDA device")
    sys.exit(1)

N, D, BT = 65536, 128, 16
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(1)
X = (torch.randn(N, D, device=dev, generator=gen)).to(torch.bfloat16)


def fp8(x):
    xf = x.float()
    s = (xf.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(2.0 ** -126)
    q = (xf / s).to(torch.float8_e4m3fn)
    return q, s


def int8(x):
    xf = x.float()
    s = (xf.abs().amax(dim=1, keepdim=True) / 127.0).to(torch.bfloat16).float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(xf / s).clamp(-127, 127).to(torch.int8)
    return q, s.to(torch.bfloat16)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=dev)
MID = (E2M1[1:] + E2M1[:-1]) / 2


def nvfp4(x):
    xf = x.float().view(N // BT, BT, D // 16, 16)
    g = (xf.abs().amax(dim=(1, 2, 3), keepdim=True) / (6.0 * 448.0)).clamp_min(2.0 ** -126)
    u = xf / g
    s = (u.abs().amax(dim=3, keepdim=True) / 6.0).to(torch.float8_e4m3fn).float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    y = u / s
    code = torch.bucketize(y.abs(), MID).to(torch.uint8) | ((y < 0).to(torch.uint8) << 3)
    code = code.view(N, D // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    return packed, s.to(torch.float8_e4m3fn), g


def kivi_k2(x):  # K per channel over 16 tokens, 2 bits
    xf = x.float().view(N // BT, BT, D)
    mn = xf.amin(dim=1, keepdim=True).half().float()
    mx = xf.amax(dim=1, keepdim=True)
    s = ((mx - mn) / 3.0).half().float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round((xf - mn) / s).clamp(0, 3).to(torch.int32).view(N, D // 16, 16)
    sh = torch.arange(0, 32, 2, device=dev, dtype=torch.int32)
    packed = (q << sh).sum(dim=2, dtype=torch.int32)
    return packed, mn.half(), s.half()


KVQ_OFF = torch.zeros(D, device=dev)
KVQ_RNG = torch.full((D,), 2.5, device=dev)
KVQ_INV = 1.0 / KVQ_RNG
KVQ_LUT = torch.tensor([-1.0, -0.6, -0.3, -0.1, 0.1, 0.3, 0.6, 1.0], device=dev)
KVQ_MID = (KVQ_LUT[1:] + KVQ_LUT[:-1]) / 2
KVQ_BIT = torch.arange(D, device=dev, dtype=torch.int64) * 3


def kvquant_k3(x):  # K: per channel from a calibration, 3-bit nuq, the 2 largest of each token as fp16 residuals
    xf = x.float()
    n = (xf - KVQ_OFF) * KVQ_INV
    top = n.abs().topk(2, dim=1).indices.sort(dim=1).values
    code = torch.bucketize(n, KVQ_MID)  # nearest entry: the midpoints below
    dense = KVQ_LUT[code] * KVQ_RNG + KVQ_OFF
    res = (xf.gather(1, top) - dense.gather(1, top)).half()
    c = code.to(torch.int64)
    w, sh = KVQ_BIT // 32, KVQ_BIT % 32  # 3-bit codes LSB-first in 32-bit words, straddling ones split
    words = torch.zeros(N, (3 * D + 31) // 32 + 1, device=dev, dtype=torch.int64)
    words.scatter_add_(1, w.expand(N, D), (c << sh) & 0xFFFFFFFF)
    words.scatter_add_(1, (w + 1).expand(N, D), c >> (32 - sh))
    return words[:, :-1].to(torch.int32), top.to(torch.uint8), res


def timeit(fn):
    for _ in range(3):
        fn(X)
    t = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(X)
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b) * 1e3)
    t.sort()
    return t[len(t) // 2]


kv = {}
for line in open(sys.argv[1]):
    if line.startswith("{"):
        o = json.loads(line)
        if o.get("figure") == "gpu_codec":
            kv[o["codec"]] = o["encode_us"]
rows = [("fp8", fp8), ("int8", int8), ("nvfp4", nvfp4), ("kivi:bits=2:group=16", kivi_k2), ("kvquant", kvquant_k3)]
print(f"{'encode vs torch':24s} {'kvpool us':>10s} {'torch us':>10s} {'torch/kvpool':>13s}   (target >= 2)")
for name, fn in rows:
    tt = timeit(fn)
    k = kv.get(name)
    if k is None:
        continue
    print(f"{name:24s} {k:10.1f} {tt:10.1f} {tt / k:12.2f}x")
    print(json.dumps({"figure": "gpu_encode_vs_torch", "codec": name, "token_heads": N, "kvpool_us": k,
                      "torch_us": round(tt, 1), "speedup": round(tt / k, 2), "target": 2.0}))

# ---- qvg: the same k-means (k-means++ seeding, Lloyd's iterations), stages and final INT-b
# quantizer in PyTorch, batched over the 32 heads of kvpool-bench-gpu's gpu_qvg figure ----
QVG = {"qvg": (1, 64), "qvg-pro": (4, 16)}  # stages, group (bits 2, k 256, 8 iterations)


def qvg_torch(x, stages, group, K=256, iters=8, bits=2):
    H, n, d = x.shape
    r = x.float()
    heads = torch.arange(H, device=dev)
    g2 = torch.Generator(device=dev).manual_seed(2)
    outs = []
    for _ in range(stages):
        C = torch.empty(H, K, d, device=dev)
        C[:, 0] = r[heads, torch.randint(n, (H,), device=dev, generator=g2)]
        w = ((r - C[:, :1]) ** 2).sum(-1)
        for k in range(1, K):  # k-means++: D^2 sampling, one centroid at a time
            c = r[heads, torch.multinomial(w, 1, generator=g2).squeeze(1)]
            C[:, k] = c
            w = torch.minimum(w, ((r - c[:, None]) ** 2).sum(-1))
        ones = torch.ones(H, n, device=dev)
        for _ in range(iters):
            lab = ((C * C).sum(-1)[:, None, :] - 2 * torch.bmm(r, C.transpose(1, 2))).argmin(-1)
            sums = torch.zeros(H, K, d, device=dev).scatter_add_(1, lab[..., None].expand(H, n, d), r)
            cnt = torch.zeros(H, K, device=dev).scatter_add_(1, lab, ones)
            C = torch.where(cnt[..., None] > 0, sums / cnt.clamp_min(1)[..., None], C)
        C = C.to(torch.bfloat16).float()
        lab = ((C * C).sum(-1)[:, None, :] - 2 * torch.bmm(r, C.transpose(1, 2))).argmin(-1)
        r = r - C.gather(1, lab[..., None].expand(H, n, d))
        outs.append((C.to(torch.bfloat16), lab.to(torch.uint8)))
    qm = (1 << (bits - 1)) - 1
    rg = r.view(H, n, d // group, group)
    sc = (rg.abs().amax(-1, keepdim=True) / qm).to(torch.float8_e4m3fn)
    s32 = sc.float()
    q = (torch.where(s32 > 0, torch.round(rg / s32.clamp_min(2.0 ** -9)), torch.zeros_like(rg)).clamp(-qm, qm) + qm)
    q = q.to(torch.int32).view(H, n, d * bits // 8, 8 // bits)
    sh = torch.arange(8 - bits, -1, -bits, device=dev, dtype=torch.int32)
    packed = (q << sh).sum(-1).to(torch.uint8)
    return packed, sc, outs


qv = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"figure":"gpu_qvg"')]
if qv:
    print(f"{'qvg encode vs torch':24s} {'kvpool ms':>10s} {'torch ms':>10s} {'torch/kvpool':>13s}   (target > 1)")
for o in qv:
    stages, group = QVG[o["codec"]]
    xq = torch.randn(o["heads"], o["tokens"], o["head_dim"], device=dev, generator=gen).to(torch.bfloat16)
    qvg_torch(xq, stages, group)  # warm-up
    t = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        qvg_torch(xq, stages, group)
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b))
    t.sort()
    tt, k = t[1], o["encode_us"] / 1e3
    print(f"{o['codec']:24s} {k:10.2f} {tt:10.2f} {tt / k:12.2f}x   {'met' if tt > k else 'NOT met'}")
    print(json.dumps({"figure": "gpu_qvg_vs_torch", "codec": o["codec"], "heads": o["heads"], "tokens": o["tokens"],
                      "kvpool_ms": round(k, 3), "torch_ms": round(tt, 3), "speedup": round(tt / k, 2),
                      "met": tt > k}))
    del xq
    torch.cuda.empty_cache()

# ---- decode attention: kvp_attend_decode against torch's SDPA over a dense bf16 cache ----
att = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"figure":"gpu_attend"')]
gat = {(o["codecs"], o["batch"], o["ctx"]): o["gather_us"] for o in
       (json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"figure":"gpu_attend_gather"'))}
if att:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def sdpa_us(b, ctx, hq, hkv, d):
        q = torch.randn(b, hq, 1, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.bfloat16)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
            try:
                with sdpa_kernel(backend):
                    fn = lambda _: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    fn(None)
                    t = timeit(fn)
                del q, k, v
                torch.cuda.empty_cache()
                return t, backend.name.lower()
            except RuntimeError:
                continue
        return None, None

    base = {}
    for o in att:
        key = (o["batch"], o["ctx"])
        if key not in base:
            base[key] = sdpa_us(o["batch"], o["ctx"], o["q_heads"], o["kv_heads"], o["head_dim"])
    target = {"kv=bf16": None, "kv=fp8": 1.7, "kv=int8": 1.7, "kv=nvfp4": 2.5, "kv=kivi:bits=2:group=16": 2.5}
    print(f"{'attend vs sdpa':26s} {'B':>3s} {'ctx':>7s} {'kvpool us':>10s} {'sdpa us':>9s} {'sdpa/kvpool':>12s}"
          f" {'gather+sdpa us':>15s}   target")
    for o in att:
        t, backend = base[(o["batch"], o["ctx"])]
        if t is None:
            continue
        sp = t / o["attend_us"]
        g = gat.get((o["codecs"], o["batch"], o["ctx"]))
        tg = (g + t) if g is not None else None
        tgt = target.get(o["codecs"])
        if tgt is None:
            want, met = "time <= 1.15x sdpa", o["attend_us"] <= 1.15 * t
        elif o["ctx"] >= 32768:
            want, met = f">= {tgt}x faster", sp >= tgt
        else:
            want, met = "-", None
        print(f"{o['codecs']:26s} {o['batch']:3d} {o['ctx']:7d} {o['attend_us']:10.1f} {t:9.1f} {sp:11.2f}x"
              f" {tg if tg is not None else float('nan'):15.1f}   {want} {'' if met is None else ('met' if met else 'NOT met')}")
        print(json.dumps({"figure": "gpu_attend_vs_sdpa", "codecs": o["codecs"], "batch": o["batch"], "ctx": o["ctx"],
                          "kvpool_us": o["attend_us"], "sdpa_us": round(t, 2), "sdpa_backend": backend,
                          "speedup": round(sp, 3), "gather_then_sdpa_us": None if tg is None else round(tg, 2),
                          "target": want, "met": met}))
