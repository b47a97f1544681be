"""The benchmarks' RocksDB peers (issue 14): W1's tuned RocksDB with reader processes
reads back every put, and W5's pipelined peer trains exactly as its serial loop."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("rocksdict", reason="the RocksDB peers need rocksdict")


def run_json(*args, timeout=300):
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_w1_rocksdb_tuned_readers_see_every_put(tmp_path):
    """Three reader processes serve each get; the worker checks a sample of every get
    against the rows last put (so a reader that missed the WAL's last batch fails the
    run), and every variant of the sweep keeps its explicit options."""
    out = run_json("bench/ssd_store_bench.py", "--rows", "20000", "--batches", "3", "--batch-keys", "4000",
                   "--stores", "rocksdb_tuned", "--rocksdb-readers", "1,3", "--rocksdb-splits", "row",
                   "--verify-sample", "4000", "--rounds", "2", "--no-fio", "--no-cgroup", "--dir", str(tmp_path))
    r = out["stores"]["rocksdb_tuned"]
    assert r["status"] == "ok" and len(r["rounds"]) == 2
    variants = r["rounds"][0]["variants"]
    assert set(variants) == {"readers=1,split=row,memory=512MiB", "readers=3,split=row,memory=512MiB"}
    three = variants["readers=3,split=row,memory=512MiB"]
    assert three["options"]["readers"] == 3 and three["options"]["reader"]["use_direct_reads"] is True
    assert three["distributions"]["uniform"]["reader_catch_up_seconds_total"] > 0
    # The readers' caches and the memtables (writer + 3 replicas) share the budget.
    opts = three["options"]
    caches = 3 * (opts["reader"]["block_cache_bytes"] + opts["reader"]["row_cache_bytes"])
    memtables = 4 * opts["writer"]["write_buffer_size"] * opts["writer"]["max_write_buffer_number"]
    assert caches + memtables <= opts["memory_budget_bytes"]
    for d in ("uniform", "zipf"):
        assert r["distributions"][d]["get_best_variant"] in variants
        assert len(r["distributions"][d]["get_rows_per_s"]["rounds"]) == 2
    # A load in key order through SstFileWriter leaves every file in the last level.
    levels = r["rounds"][0]["variants"]["readers=1,split=row,memory=512MiB"]["store_stats"]["rocksdb.levelstats"]
    assert "  6        1" in levels


def test_w1_sweep_keeps_the_variants_that_finish(tmp_path):
    """Each variant of the tuned RocksDB runs in a worker process of its own: one
    killed (as the OOM killer kills one in the memory cgroup) is recorded as such,
    and the variants that finished keep their figures and decide the peer's best."""
    env = {**os.environ, "HPS_W1_KILL_VARIANT": "readers=2,split=block,memory=64MiB"}
    done = subprocess.run([sys.executable, "bench/ssd_store_bench.py", "--rows", "20000", "--batches", "2",
                           "--batch-keys", "2000", "--stores", "rocksdb_tuned", "--rocksdb-readers", "1,2",
                           "--rocksdb-splits", "block", "--rocksdb-memory", "64MiB,32MiB", "--rounds", "1",
                           "--no-fio", "--no-cgroup", "--dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])["stores"]["rocksdb_tuned"]
    assert r["status"] == "ok"
    only = r["rounds"][0]
    finished = {"readers=1,split=block,memory=64MiB", "readers=1,split=block,memory=32MiB",
                "readers=2,split=block,memory=32MiB"}
    assert set(only["variants"]) == finished
    assert only["variants_failed"]["readers=2,split=block,memory=64MiB"]["status"] == "oom"
    opts = only["variants"]["readers=2,split=block,memory=32MiB"]["options"]
    assert opts["memory_budget_bytes"] == 32 << 20 and opts["reader"]["block_cache_bytes"] == (32 << 20) // 4
    for d in ("uniform", "zipf"):
        assert r["distributions"][d]["get_best_variant"] in finished
        assert r["distributions"][d]["get_rows_per_s"]["median"] > 0
    # Every variant ran after the load in a process of its own: none left data behind.
    assert not os.path.exists(tmp_path / "rocksdb_tuned")


def test_w5_pipelined_rocksdb_peer_trains_as_the_serial_loop():
    """The prefetch process reads batch i+1 before batch i's rows are written back;
    patching the shared keys must make the run identical to the serial loop."""
    pytest.importorskip("torch", reason="the W5 benchmark trains with torch")
    aucs = {}
    for mode in ("serial", "process"):
        out = run_json("bench/w5_bench.py", "--examples", "12288", "--eval-examples", "4096", "--repeat", "1",
                       "--no-cgroup", "--threads", "1", "--runs", "rocksdb", "--rocks-prefetch", mode)
        run = out["runs"]["rocksdb"]
        assert run["status"] == "ok" and run["prefetch"] == mode
        # Pipelined, the next batch's rows are read before this batch's are written:
        # the keys both share (batches do) take this batch's rows. Serial, none do.
        assert (run["rows_patched_from_the_batch_before"] > 0) == (mode == "process")
        assert run["rocksdb_options"]["disable_wal"] is True
        aucs[mode] = (run["auc"], run["logloss"])
    assert aucs["process"] == aucs["serial"]
