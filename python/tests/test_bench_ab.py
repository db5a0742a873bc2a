"""tools/bench_ab.py: figures keyed by their fields, medians per side, speed new/base."""

import json
import os
import subprocess
import sys

from conftest import REPO

TOOL = os.path.join(REPO, "tools", "bench_ab.py")


def fig(codecs, batch, us, gbs, copy_gbs=3000.0):
    return json.dumps({"figure": "gpu_attend", "codecs": codecs, "batch": batch, "ctx": 4096, "attend_us": us,
                       "gbs": gbs, "copy_gbs": copy_gbs, "splits": 264})


def run(tmp_path, new, base, *extra):
    paths = {}
    for side, runs in (("new", new), ("base", base)):
        paths[side] = []
        for i, lines in enumerate(runs):
            p = tmp_path / f"{side}{i}.txt"
            p.write_text("a table line\n" + "\n".join(lines) + "\n")
            paths[side].append(str(p))
    return subprocess.run([sys.executable, TOOL, "--new", *paths["new"], "--base", *paths["base"], *extra],
                          capture_output=True, text=True)


def test_medians_and_speed(tmp_path):
    # base: 100, 120, 400 us (median 120); new: 60, 50, 70 (median 60): 2x faster
    base = [[fig("kv=fp8", 1, t, 10.0, copy_gbs=c)] for t, c in ((100, 2900), (120, 3000), (400, 3100))]
    new = [[fig("kv=fp8", 1, t, 20.0)] for t in (60, 50, 70)]
    r = run(tmp_path, new, base, "--json")
    assert r.returncode == 0, r.stderr
    rows = {o["measure"]: o for o in map(json.loads, r.stdout.splitlines())}
    # copy_gbs and splits change between runs without naming another figure: one key, not three
    assert set(rows) == {"attend_us", "gbs"}
    assert rows["attend_us"]["base"] == 120 and rows["attend_us"]["new"] == 60
    assert rows["attend_us"]["speed"] == 2.0
    assert rows["gbs"]["speed"] == 2.0  # a rate: larger is better
    assert rows["attend_us"]["runs"] == [3, 3]
    assert rows["attend_us"]["of"]["codecs"] == "kv=fp8"


def test_keys_of_one_side_are_listed(tmp_path):
    r = run(tmp_path, [[fig("kv=fp8", 1, 50, 1.0), fig("kv=nvfp4", 8, 70, 1.0)]],
            [[fig("kv=fp8", 1, 50, 1.0), fig("kv=int8", 8, 90, 1.0)]])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "codecs=kv=nvfp4" in out and "only in the new runs" in out
    assert "codecs=kv=int8" in out and "only in the base runs" in out
    assert sum(1 for line in out.splitlines() if line.startswith("{")) == 2  # fp8's time and rate


def test_no_figures_fails(tmp_path):
    r = run(tmp_path, [["not json"]], [[fig("kv=fp8", 1, 50, 1.0)]])
    assert r.returncode == 1
    assert "no figures in the new runs" in r.stderr
