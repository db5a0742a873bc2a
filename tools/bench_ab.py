#!/usr/bin/env python3
"""Compare the JSON lines of kvpool-bench-gpu (or kvpool-bench) from two
builds run alternately on one machine: this tree's runs against a base's.

    tools/bench_ab.py --new NEW1 [NEW2 ...] --base BASE1 [BASE2 ...]

Each file is one run's output (the table lines are ignored). A figure is
keyed by its "figure" name and every field that is not a measurement (the
codecs, batch, ctx, spec, ...); its measurements are the fields whose names
end in _us (times, smaller is better) or are "gbs" / "vs_copy" (larger is
better). For each key and measurement it prints the median over the runs of
each side and new/base (for a time: base/new, so > 1 is faster either
way), then one JSON line per row. Keys present on one side only are
listed apart. Used by tools/gpu-ab.sh; works on any saved outputs."""
import argparse
import json
import statistics
import sys

TIMES = ("_us",)
RATES = ("gbs", "vs_copy")
# fields that vary from run to run without naming a figure
NOISE = {"copy_gbs", "splits", "table_bytes", "bytes_read", "target_vs_copy", "ratio", "speedup"}


def is_measure(k, v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (k.endswith(TIMES) or k in RATES)


def load(paths):
    """{key: {measure: [values, one per run]}}"""
    out = {}
    for p in paths:
        with open(p) as f:
            for line in f:
                if not line.startswith("{"):
                    continue
                try:
                    o = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "figure" not in o:
                    continue
                key = tuple(sorted((k, v) for k, v in o.items()
                                   if not is_measure(k, v) and k not in NOISE and not isinstance(v, (dict, list))))
                for k, v in o.items():
                    if is_measure(k, v):
                        out.setdefault(key, {}).setdefault(k, []).append(float(v))
    return out


def label(key):
    d = dict(key)
    fig = d.pop("figure")
    return fig + " " + " ".join(f"{k}={v}" for k, v in sorted(d.items()) if k not in ("q_heads", "kv_heads", "head_dim"))


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new", nargs="+", required=True)
    ap.add_argument("--base", nargs="+", required=True)
    ap.add_argument("--json", action="store_true", help="the JSON lines only")
    a = ap.parse_args(argv)
    new, base = load(a.new), load(a.base)
    if not new or not base:
        print("bench_ab: no figures in " + ("the new runs" if not new else "the base runs"), file=sys.stderr)
        return 1
    if not a.json:
        print(f"{'figure':70s} {'measure':12s} {'base':>10s} {'new':>10s} {'speed':>7s}   "
              f"(medians of {len(a.base)} base, {len(a.new)} new runs; speed > 1: new faster)")
    rows = []
    for key in sorted(set(new) & set(base), key=label):
        for m in sorted(set(new[key]) & set(base[key])):
            b, n = statistics.median(base[key][m]), statistics.median(new[key][m])
            if b > 0 and n > 0:
                rows.append((key, m, b, n, b / n if m.endswith(TIMES) else n / b))
    if not a.json:
        for key, m, b, n, speed in rows:
            print(f"{label(key):70s} {m:12s} {b:10.2f} {n:10.2f} {speed:6.3f}x")
    for key, m, b, n, speed in rows:
        print(json.dumps({"figure": "ab", "of": dict(key), "measure": m, "base": round(b, 3), "new": round(n, 3),
                          "speed": round(speed, 4), "runs": [len(base[key][m]), len(new[key][m])]}))
    only = [(label(k), "new") for k in set(new) - set(base)] + [(label(k), "base") for k in set(base) - set(new)]
    for lab, side in sorted(only):
        if not a.json:
            print(f"{lab:70s} only in the {side} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
