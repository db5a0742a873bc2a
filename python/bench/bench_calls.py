#!/usr/bin/env python3
"""Per-call overhead of the Python binding against the same calls from C, in the same run.

Runs build/kvpool-callbench (C) and then the same loop through kvpool.Pool on the same
library, geometry and data: decode steps of one token (step_begin, append per layer,
step_end) and reads of one head into fixed buffers (read_into, as C does) and through
read() (which allocates its arrays). Prints a table, then one JSON line per figure.
Figures are medians over the repetitions (C and Python alternate; ``--stat min`` takes the
fastest repetition instead, a steadier figure on a machine that others load), in nanoseconds per call;
the "per C call" column divides a step's overhead by the step_begin + appends + step_end
calls it makes.

    make bench-py
    python3 python/bench/bench_calls.py --layers 8 --kv-heads 8 --head-dim 128 --steps 2000

The target (issue 15): under 2 us of overhead per call on the host.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

import kvpool  # noqa: E402


def data(H, D):
    i = np.arange(H * D, dtype=np.uint64)
    x = ((i * np.uint64(2654435761)) % np.uint64(2001)).astype(np.float64) - 1000.0
    return (x / 1000.0).astype(np.float16).reshape(1, H, D)


def py_side(a):
    """One repetition, as the C tool's: a fresh pool, decode steps, then reads."""
    L, H, D = a.layers, a.kv_heads, a.head_dim
    x = data(H, D)
    pool = kvpool.Pool(layers=L, kv_heads=H, head_dim=D, k_dtype="f16", v_dtype="f16", region_bytes=1 << 30,
                       codecs=a.codecs or None)
    clock = time.perf_counter_ns
    append, step_begin, step_end = pool.append, pool.step_begin, pool.step_end
    seq = 100
    pool.add(seq)
    t_app = 0
    t0 = clock()
    for _ in range(a.steps):
        step_begin(seq, 1)
        t1 = clock()
        for layer in range(L):
            append(seq, layer, x, x)
        t_app += clock() - t1
        step_end(seq)
    out = {"step_ns": (clock() - t0) / a.steps, "append_ns": t_app / (a.steps * L)}
    pool.free(seq)
    pool.add(1)
    for _ in range(a.read_tokens):
        step_begin(1, 1)
        for layer in range(L):
            append(1, layer, x, x)
        step_end(1)
    ko = np.empty((a.read_tokens, D), np.float16)
    vo = np.empty((a.read_tokens, D), np.float16)
    po = np.empty(a.read_tokens, np.uint32)
    read_into, read = pool.read_into, pool.read
    t0 = clock()
    for i in range(a.read_iters):
        read_into(1, 0, i % H, ko, vo, po)
    out["read_ns"] = (clock() - t0) / a.read_iters
    t0 = clock()
    for i in range(a.read_iters):
        read(1, 0, i % H)
    out["read_alloc_ns"] = (clock() - t0) / a.read_iters
    pool.close()
    return out


def c_side(a, tool):
    """One repetition of the C tool (a process of its own)."""
    r = subprocess.run([tool, str(a.layers), str(a.kv_heads), str(a.head_dim), str(a.steps), "1",
                        str(a.read_tokens), str(a.read_iters), a.codecs], check=True, capture_output=True, text=True)
    j = json.loads(r.stdout)
    return {k: v[0] for k, v in j.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2000, help="decode steps per repetition")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--read-tokens", type=int, default=64, help="tokens of the sequence read")
    ap.add_argument("--read-iters", type=int, default=20000)
    ap.add_argument("--codecs", default="", help="codec spec (default raw)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="how repetitions combine (min: the least disturbed one, on a loaded machine)")
    a = ap.parse_args()
    tool = os.path.join(os.path.dirname(os.path.dirname(HERE)), "build", "kvpool-callbench")
    # C and Python repetitions alternate, so that load from other processes hits both alike
    c, py = {}, {}
    for _ in range(a.reps):
        for k, v in c_side(a, tool).items():
            c.setdefault(k, []).append(v)
        for k, v in py_side(a).items():
            py.setdefault(k, []).append(v)
    med = statistics.median if a.stat == "median" else min
    rows = [
        ("append", "kvp_append of 1 token, one layer", med(c["append_ns"]), med(py["append_ns"]), 1),
        ("step", f"a decode step: step_begin + {a.layers} appends + step_end", med(c["step_ns"]),
         med(py["step_ns"]), a.layers + 2),
        ("read_into", f"kvp_read of one head, {a.read_tokens} tokens, into fixed buffers", med(c["read_ns"]),
         med(py["read_ns"]), 1),
        ("read", f"read() of one head, {a.read_tokens} tokens, new arrays", med(c["read_ns"]),
         med(py["read_alloc_ns"]), 1),
    ]
    geo = f"L={a.layers} H={a.kv_heads} D={a.head_dim} fp16, codecs {a.codecs or 'raw'}, {a.stat} of {a.reps} reps"
    print(f"kvpool Python binding: per-call overhead against C, same run ({geo}; {platform.python_version()}, "
          f"{kvpool.library_path}, per-step calls through {kvpool._fast.backend})")
    print(f"{'op':10s} {'C ns':>9s} {'Python ns':>10s} {'overhead ns':>12s} {'per C call':>11s}  what")
    for op, what, cn, pn, calls in rows:
        print(f"{op:10s} {cn:9.0f} {pn:10.0f} {pn - cn:12.0f} {(pn - cn) / calls:11.0f}  {what}")
    for op, what, cn, pn, calls in rows:
        print(json.dumps({"bench": "python_call_overhead", "op": op, "c_ns": round(cn, 1), "python_ns": round(pn, 1),
                          "overhead_ns": round(pn - cn, 1), "overhead_ns_per_c_call": round((pn - cn) / calls, 1),
                          "layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
                          "codecs": a.codecs or "raw", "stat": a.stat, "python": platform.python_version(),
                          "backend": kvpool._fast.backend}))


if __name__ == "__main__":
    main()
