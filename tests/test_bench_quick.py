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


def test_w6_quick_kstep_bytes_fall_as_1_over_k():
    pytest.importorskip("torch", reason="the W6 benchmark trains with torch")
    pytest.importorskip("mpi4py", reason="the W6 benchmark needs mpi4py (pip install '.[mpi]')")
    import shutil
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec on PATH (pip install mpich)")
    out = run_json("bench/w6_bench.py", "--quick", "--examples", "100000", "--eval-examples", "10000",
                   timeout=600)
    runs = {(r["dense_sync"], r["k"]): r for r in out["kstep"]}
    k1, k10, ar = runs[("kstep", 1)], runs[("kstep", 10)], runs[("allreduce", 1)]
    assert k1["examples"] == k10["examples"] == ar["examples"] == 100_000
    assert k10["dense_merges"] == -(-k1["dense_merges"] // 10)  # every 10 steps, and once at the end
    assert k10["dense_bytes_over_k1"] == pytest.approx(k10["dense_merges"] / k1["dense_merges"])
    assert ar["dense_bytes_over_k1"] == pytest.approx(0.5)  # gradients only, against x and v
    for r in out["kstep"]:
        assert r["auc"] > 0.7
        assert sum(r["sparse_bytes_per_rank_per_batch"].values()) > 0
