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


def test_w5_small_table_on_ssd_trains_as_in_memory():
    """W5 on 40k examples: the run with the table 4x its MEM budget reads rows back
    from SSD-PS and ends with the AUC of the in-memory run (one torch thread each,
    so both compute the same sums); both read the example files the driver wrote."""
    pytest.importorskip("torch", reason="the W5 benchmark trains with torch")
    runs = "hps_ssd,hps_mem"
    try:
        import rocksdict  # noqa: F401
        runs += ",rocksdb"
    except ImportError:
        pass
    out = run_json("bench/w5_bench.py", "--examples", "40000", "--eval-examples", "8000", "--repeat", "1",
                   "--no-cgroup", "--hps-threads", "1", "--threads", "1", "--runs", runs, timeout=600)
    ssd, mem = out["runs"]["hps_ssd"], out["runs"]["hps_mem"]
    assert ssd["status"] == mem["status"] == "ok"
    assert ssd["examples"] == mem["examples"] == 40_000
    assert out["table_over_budget"] == pytest.approx(4.0, rel=1e-3)
    assert ssd["rows_from_ssd"] > 0 and ssd["ssd_rows_read"] > 0 and mem["rows_from_ssd"] == 0
    assert ssd["auc"] == mem["auc"] and ssd["auc"] > 0.7
    if "rocksdb" in out["runs"]:
        rocks = out["runs"]["rocksdb"]
        assert rocks["status"] == "ok" and rocks["examples"] == 40_000
        assert abs(rocks["auc"] - ssd["auc"]) < 0.002  # the same model on the same examples
