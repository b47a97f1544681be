"""The benchmarks' --quick modes still run and agree with their own checks."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_json(*args, timeout=300):
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cache_policy_quick():
    out = run_json("bench/cache_policy_bench.py", "--quick", "--criteo", "")
    assert out["ok"] and not out["problems"], out["problems"]
    for cap in out["traces"]["zipf"]["capacities"]:
        hits = cap["hits"]
        assert hits["lru"] == hits["py_lru"]  # the native LRU is an exact LRU
        assert hits["belady_bypass"] >= max(hits.values())
        assert hits["lru+lfu"] >= hits["lru"]


def test_train_quick_against_pytorch():
    pytest.importorskip("torch", reason="the training benchmark needs torch")
    out = run_json("bench/train_bench.py", "--quick", "--no-torchrec", "--examples", "100000",
                   "--eval-examples", "20000", timeout=600)
    assert out["hps"]["examples"] == out["torch"]["examples"] == 100_000
    assert abs(out["auc_difference"]) < 0.002  # same model, same data, same optimizers
    assert out["w9_wall_over_slowest_stage"] >= 1.0
