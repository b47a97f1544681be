"""The benchmarks' --quick modes still run and agree with their own checks."""
import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from mpi_scenarios import MPI_MISSING, MPI_READY  # tests/ is on pytest's sys.path

needs_mpi = pytest.mark.skipif(not MPI_READY, reason=MPI_MISSING)  # the W6 and W10 jobs launch ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_json(*args, timeout=300):
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_replays(trace):
    for cap in trace["capacities"]:
        hits = cap["hits"]
        assert cap["rows"] == max(1, round(cap["fraction"] * trace["unique_keys"]))
        assert hits["lru"] == hits["py_lru"]  # the native LRU is an exact LRU
        assert hits["belady_bypass"] >= max(hits.values())
        assert hits["lru+lfu"] >= hits["lru"]
        for policy, stats in cap["native_stats"].items():  # the cache's own counters agree with its masks
            assert stats["hits"] == hits[policy] and stats["hits"] + stats["misses"] == trace["accesses"]
            assert stats["size"] <= cap["rows"]


def test_cache_policy_quick():
    out = run_json("bench/cache_policy_bench.py", "--quick", "--criteo", "")
    assert out["ok"] and not out["problems"], out["problems"]
    zipf = out["traces"]["zipf"]
    check_replays(zipf)
    # The held-out trace is reported apart, was drawn with another skew and seed than
    # the trace the policies were tuned on, and replays as correctly.
    held = out["held_out"]["traces"]["zipf_heldout"]
    assert "zipf_heldout" not in out["traces"]
    assert held["zipf_a"] != zipf["zipf_a"] and held["seed"] != zipf["seed"]
    assert held["accesses"] == zipf["accesses"] and held["unique_keys"] != zipf["unique_keys"]
    check_replays(held)
    assert out["held_out"]["targets"]["native_lru_equals_python_lru"] is True
    assert "1.05" in out["tuned_on"] and "seed 1234" in out["tuned_on"]


def test_cache_policy_refuses_a_held_out_trace_equal_to_the_tuning_one():
    done = subprocess.run([sys.executable, "bench/cache_policy_bench.py", "--quick", "--heldout-a", "1.05"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "another exponent and seed" in done.stderr


def test_train_quick_against_pytorch():
    pytest.importorskip("torch", reason="the training benchmark needs torch")
    out = run_json("bench/train_bench.py", "--quick", "--no-torchrec", "--examples", "50000",
                   "--eval-examples", "20000", "--malloc-ab", "--first-layer-ab", timeout=600)
    assert out["hps"]["examples"] == out["torch"]["examples"] == 50_000
    assert abs(out["auc_difference"]) < 0.002  # same model, same data, same optimizers
    # W9's figures, from the pipeline's own counters and clocks: every batch went
    # through it, each stage (one thread) was busy for a part of the wall time, and
    # the reported bound and ratio are those of the busiest stage.
    p = out["hps"]["pipeline"]
    assert p["examples"] == 50_000 and p["batches"] == -(-50_000 // 4096)
    busy = p["busy_seconds"]
    assert set(busy) == {"read", "prefetch", "load", "train", "write_back"}
    for stage, seconds in busy.items():
        assert 0 < seconds <= p["wall_seconds"], (stage, seconds, p["wall_seconds"])
    assert p["bound_by"] == max(busy, key=busy.get)
    assert out["w9_wall_over_slowest_stage"] == pytest.approx(p["wall_seconds"] / max(busy.values()))
    assert out["hps"]["examples_per_s"] == pytest.approx(50_000 / out["hps"]["seconds"])
    # The bound: the MLP alone ran over the same batches, and each system is a
    # fraction of its rate, round by round.
    alone = out["mlp_alone"]
    assert alone["examples"] == 50_000 and "auc" not in alone
    for system in ("hps", "torch"):
        assert out["fraction_of_mlp_alone_per_round"][system] == [
            pytest.approx(out[system]["examples_per_s"] / alone["examples_per_s"])]
        assert out["fraction_of_mlp_alone"][system] == pytest.approx(
            out[system]["examples_per_s"] / alone["examples_per_s"])
    # --malloc-ab: hps again with glibc's malloc as it comes, the same model trained.
    plain = out["hps_glibc_malloc"]
    assert plain["examples"] == 50_000 and abs(plain["auc"] - out["hps"]["auc"]) < 0.001
    assert plain["malloc"] == {"kept": False, "reason": "keep_freed_memory = false"}
    assert out["hps"]["malloc"]["kept"] is (sys.platform == "linux" and platform.libc_ver()[0] == "glibc")
    assert out["ratio_keep_freed_memory_per_round"] == [
        pytest.approx(out["hps"]["examples_per_s"] / plain["examples_per_s"])]
    # --first-layer-ab: hps again with torch's nn.Linear as the first layer, the same model
    # trained (the gradients differ only in float rounding).
    linear = out["hps_torch_first_layer"]
    assert linear["examples"] == 50_000 and abs(linear["auc"] - out["hps"]["auc"]) < 0.001
    assert out["ratio_own_first_layer_per_round"] == [
        pytest.approx(out["hps"]["examples_per_s"] / linear["examples_per_s"])]


def test_train_quick_multi_hot_against_pytorch():
    pytest.importorskip("torch", reason="the training benchmark needs torch")
    out = run_json("bench/train_bench.py", "--quick", "--no-torchrec", "--examples", "40000",
                   "--eval-examples", "12000", "--multi-hot", "5000:4,800:8", timeout=600)
    assert out["benchmark"] == "W4m train" and out["multi_hot"] == [[5000, 4.0], [800, 8.0]]
    assert out["hps"]["examples"] == out["torch"]["examples"] == 40_000
    # The same model on both sides: the bags pooled by sum into the same MLP input.
    assert abs(out["auc_difference"]) < 0.003
    from hps.data import SyntheticCriteo
    kw = {"seed": 0, "batch_size": 4096, "multi_hot": [(5000, 4.0), (800, 8.0)]}
    data = list(SyntheticCriteo(examples=40_000, **kw)) + list(SyntheticCriteo(examples=12_000, part="eval", **kw))
    # The peer's table has a row for every key, the bags' keys included.
    assert out["torch"]["embedding_rows"] == len(np.unique(np.concatenate([b.all_keys().ravel() for b in data])))


@needs_mpi
def test_w6_quick_kstep_bytes_fall_as_1_over_k():
    pytest.importorskip("torch", reason="the W6 benchmark trains with torch")
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


@needs_mpi
def test_w10_quick_rounds_and_the_planners_model_against_the_jobs():
    """W10 in 2 interleaved rounds of the split job with and without bf16, and with 2
    Hogwild nets (the 2-rank jobs: the 4-rank ones would double the time;
    tests/test_ht_train.py holds one replica against all-reduce): examples/s a median
    over the rounds, the ratios paired by round, the quality repeated exactly (Hogwild's
    may move), and the planner's modelled step against the measured one per node (the
    bytes equal, the CPU time of the same order)."""
    pytest.importorskip("torch", reason="the W10 benchmark trains with torch")
    out = run_json("bench/w10_bench.py", "--quick", "--rounds", "2", "--only",
                   "codec:none/none,codec:bf16/bf16,hogwild:2", "--no-save", timeout=600)
    assert out["rounds"] == 2 and out["problems"] == []
    w = {x["workload"]: x for x in out["workloads"]}
    assert set(w) == {"codec:none/none", "codec:bf16/bf16", "hogwild:2"}
    for name, x in w.items():
        runs = x["examples_per_s_runs"]
        assert len(runs) == 2 and x["examples_per_s_min"] == min(runs) and x["examples_per_s_max"] == max(runs)
        assert min(runs) <= x["examples_per_s"] <= max(runs)
        if name != "hogwild:2":
            assert "auc_runs" not in x and "varies_across_rounds" not in x  # repeated exactly in both rounds
    # Hogwild: 2 nets on the split job's plan and bytes (each net sends its half-batch, so a
    # step moves the same bytes); only its quality may move between rounds, near the 1-net job's.
    hog, one = w["hogwild:2"], w["codec:none/none"]
    assert (hog["nets"], one["nets"]) == (2, 1) and hog["plan"] == one["plan"]
    assert hog["bytes_per_step"] == one["bytes_per_step"]
    assert set(hog.get("varies_across_rounds", [])) <= {"auc", "logloss"}
    assert abs(hog["auc"] - one["auc"]) < 0.02
    assert [(q["workload"], q["peer"]) for q in out["ratios"]] == [("codec:bf16/bf16", "codec:none/none"),
                                                                   ("hogwild:2", "codec:none/none")]
    for q in out["ratios"]:
        assert q["runs"] == pytest.approx([a / b for a, b in zip(w[q["workload"]]["examples_per_s_runs"],
                                                                 one["examples_per_s_runs"])], rel=1e-3)
        assert q["min"] <= q["median"] <= q["max"]
    rate = out["flops_per_cpu_second"]
    assert len(rate["runs"]) == 2 and rate["min"] > 1e8
    for name, value_bytes in (("codec:none/none", 4), ("codec:bf16/bf16", 2), ("hogwild:2", 4)):
        trainer, ps = w[name]["nodes"]
        assert (trainer["node"], trainer["layers"], ps["node"], ps["layers"]) == \
            ("trainer", ["fc2"], "ps0", ["fc0", "fc1"])
        # Modelled: the planner's FLOPs of the plan the job ran, at each round's measured rate.
        model = ps["modelled"]
        assert model["flops_per_step"] == 6 * 1024 * (429 * 512 + 512 * 256)
        assert model["cpu_s_per_step"]["runs"] == pytest.approx(
            [model["flops_per_step"] / r for r in rate["runs"]], rel=1e-3)
        # x (429) out, y (512) back, x (512) out, y (256) back, and the same widths backward.
        # The codec payloads the PS saw for training are the model's bytes.
        assert model["net_bytes_per_step"] == 1024 * value_bytes * 2 * (429 + 512 + 512 + 256)
        assert ps["measured"]["net_bytes_per_step"] == pytest.approx(model["net_bytes_per_step"], rel=1e-6)
        assert trainer["measured"]["net_bytes_per_step"] == ps["measured"]["net_bytes_per_step"]
        # Measured CPU: the PS's serving is part of its process; the ratio is paired by
        # round and of the model's order (the FLOPs, plus autograd, Adam and the codec).
        e = ps["measured"]
        for served, whole in zip(e["cpu_s_per_step"]["runs"], e["process_cpu_s_per_step"]["runs"]):
            assert 0 < served <= whole
        ratio = ps["cpu_measured_over_modelled"]
        assert ratio["runs"] == pytest.approx([m / d for m, d in zip(e["cpu_s_per_step"]["runs"],
                                                                       model["cpu_s_per_step"]["runs"])], rel=1e-3)
        assert 0.5 < ratio["median"] < 10
        # The trainer's whole process does far more than the one small layer the planner gives it.
        assert trainer["measured"]["cpu_is"] == "whole process" and trainer["cpu_measured_over_modelled"]["min"] > 10


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
    # The cache the budget bought holds a quarter of the rows the examples touch (as
    # counted by the driver), stays within its budget, and was full.
    capacity = ssd["mem_capacity_rows"]
    assert 3.9 <= out["distinct_keys"]["train_rows"] / capacity <= 4.1
    assert capacity * out["table"]["mem_bytes_per_row"] <= ssd["mem_budget_bytes"]
    assert ssd["mem_rows_cached"] <= capacity and ssd["mem_rows_cached"] > 0.9 * capacity
    # Every row the examples touch was created exactly once, in both runs: an evicted
    # row that SSD-PS lost would be created again. In memory, each was one miss and
    # one load; on SSD, rows came back from the write buffer and from SSD-PS, whose
    # own count of rows read agrees. (MemCache counts a miss per attempt: a prefetch
    # retried for room counts its misses again, so misses >= rows loaded.)
    train_rows = out["distinct_keys"]["train_rows"]
    assert mem["mem_misses"] == mem["rows_loaded"] == mem["rows_initialised"] == train_rows
    assert ssd["rows_initialised"] == train_rows
    assert ssd["mem_misses"] >= ssd["rows_loaded"] > train_rows
    assert ssd["rows_loaded"] == ssd["rows_from_ssd"] + ssd["rows_from_pending_writes"] + ssd["rows_initialised"]
    assert ssd["rows_from_ssd"] > 0 and ssd["ssd_rows_read"] == ssd["rows_from_ssd"]
    # Rows really went to SSD: evicted dirty rows reached SSD-PS's puts, or still
    # wait in the write buffer (a row evicted twice is buffered once).
    assert ssd["ssd_rows_written"] >= ssd["ssd_rows_put"] > 0
    assert ssd["ssd_rows_put"] + ssd["rows_pending_write"] <= ssd["mem_dirty_evictions"] + ssd["mem_rows_flushed"]
    assert mem["rows_from_ssd"] == 0 and mem["mem_dirty_evictions"] == 0
    assert ssd["auc"] == mem["auc"] and ssd["auc"] > 0.7
    if "rocksdb" in out["runs"]:
        rocks = out["runs"]["rocksdb"]
        assert rocks["status"] == "ok" and rocks["examples"] == 40_000
        assert abs(rocks["auc"] - ssd["auc"]) < 0.002  # the same model on the same examples


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "..", "shared", "data", "criteo-sample")),
                    reason="../shared/data/criteo-sample is absent")
def test_reader_quick_reads_every_format_whole_and_trains_the_tsv():
    pytest.importorskip("torch", reason="the reader benchmark's training side needs torch")
    pytest.importorskip("pyarrow", reason="the schema readers need pyarrow")
    out = run_json("bench/reader_bench.py", "--quick", "--no-save", timeout=600)
    # The sample twice, in every format; the dirty TSV's malformed lines skipped, not counted.
    assert out["examples"] == {k: 20_000 for k in ("criteo_tsv", "csv_schema", "parquet_schema", "libsvm",
                                                    "tsv_dirty", "tsv_dirty_python")}
    for v in out["read_examples_per_s"].values():
        assert 0 < v["min"] <= v["median"] <= v["max"]
    t = out["train"]
    assert t["examples"] == 20_000 and t["read_over_train"] == pytest.approx(t["read_busy_s"] / t["train_busy_s"])
    # The read thread's CPU time, over the train stage's busy time beside the wall-time
    # ratio: one thread's CPU time in a stage is never more than its wall time there.
    assert t["read_cpu_over_train_busy"] == pytest.approx(t["read_cpu_s"] / t["train_busy_s"])
    assert 0 < t["read_cpu_s"] <= t["read_busy_s"] * 1.01 + 0.01 and t["train_cpu_s"] > 0
    # Reading alone, the whole process's CPU (pyarrow's threads too); the TSV's over the
    # train stage's busy time.
    assert set(out["read_cpu_s"]) == set(out["examples"]) and all(v > 0 for v in out["read_cpu_s"].values())
    assert t["read_alone_cpu_over_train_busy"] == pytest.approx(out["read_cpu_s"]["criteo_tsv"] / t["train_busy_s"])


def test_herald_system_quick_moves_fewer_rows_and_learns_the_same():
    pytest.importorskip("torch", reason="hps train needs torch")
    out = run_json("bench/herald_system.py", "--quick", "--no-save", timeout=600)
    seq, her = out["results"]["sequential"], out["results"]["herald"]
    assert out["auc_difference"] < 1e-3
    assert seq["mem_to_devices"] == out["config"]["batch_distinct_keys"] == her["herald"]["distinct"]
    # Rows kept in the devices' caches between batches are not loaded again.
    assert her["mem_to_devices"] < seq["mem_to_devices"] and her["devices_to_mem"] < seq["devices_to_mem"]
    assert her["mem_to_devices"] + her["herald"]["peer_fetches"] == her["herald"]["plan_pulls"]
    mpi = out["mpi"]  # the same under mpiexec -n 2, the same AUC
    assert mpi["ranks"] == 2 and mpi["auc_difference"] < 1e-3
    # Examples move only where their rows are worth more than their bytes (26 keys, 13 dense
    # values and a label: 264 bytes, over a row's dim floats and AdaGrad's dim).
    assert mpi["results"]["herald"]["herald"]["example_cost"] == 264 / (4 * 2 * out["config"]["dim"])
    assert mpi["results"]["herald"]["bytes_sent"]["examples"] % 264 == 0
    assert mpi["results"]["sequential"]["bytes_sent"]["examples"] == 0
    # By device (the transfer matrix's rows and columns off its diagonal) and by rank, the totals split.
    for r in (seq, her):
        assert sum(r["device_out_rows"]) == sum(r["device_in_rows"]) == r["between_devices_rows"] > 0
        assert len(r["device_in_rows"]) == out["config"]["devices"]
    for r in mpi["results"].values():
        assert len(r["bytes_sent_by_rank"]) == 2
        # Every key's first pull (or fetch) finds its row untrained: sent as a bit, not floats.
        assert r["fresh_rows_sent_as_bits"] > 0
        assert {k: sum(b.get(k, 0) for b in r["bytes_sent_by_rank"]) for k in r["bytes_sent"]} == r["bytes_sent"]


def test_w7_plot_draws_every_trace_of_the_committed_replay(tmp_path, monkeypatch):
    """bench/plots.py w7 on docs/results/w7.jsonl: the latest line (with Herald's
    never-evicting caches and the pull floor) and the first (without them)."""
    pytest.importorskip("matplotlib", reason="the plots need matplotlib")
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import plots
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    monkeypatch.setattr(plots, "IMG", str(tmp_path))
    with open(os.path.join(ROOT, "docs", "results", "w7.jsonl")) as f:
        lines = f.read().splitlines()
    for i, line in enumerate((lines[0], lines[-1])):
        (tmp_path / f"w7-{i}.jsonl").write_text(line + "\n")
        plots.w7(str(tmp_path / f"w7-{i}.jsonl"))
        png = tmp_path / "w7.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
        png.unlink()


def test_first_layer_quick():
    out = run_json("bench/first_layer_bench.py", "--quick")
    row, wide = out["rows"]
    assert (row["threads"], row["k"]) == (1, 16) and out["embedding_columns"] == 416 and out["columns"] == 429
    for side in ("every_column", "embedding_columns", "hps_embedding_columns", "torch_forward", "hps_forward",
                 "torch_weight_grad", "hps_weight_grad"):
        assert 0 < row[side]["min_ms"] <= row[side]["median_ms"] <= row[side]["max_ms"]
    assert row["ratio"] == round(row["every_column"]["median_ms"] / row["embedding_columns"]["median_ms"], 2)
    assert row["hps_forward_ratio"] == round(row["torch_forward"]["median_ms"] / row["hps_forward"]["median_ms"], 2)
    assert row["hps_weight_grad_ratio"] == round(
        row["torch_weight_grad"]["median_ms"] / row["hps_weight_grad"]["median_ms"], 2)
    assert out["hps_kernel"] in ("avx512", "avx2", "portable")
    # At 64 units torch's products, the weight's gradient also over padded rows (each
    # checked against float64's by the benchmark, which exits otherwise).
    assert (wide["threads"], wide["k"]) == (1, 64) and "hps_forward" not in wide
    for side in ("torch_weight_grad", "padded_weight_grad"):
        assert 0 < wide[side]["min_ms"] <= wide[side]["median_ms"] <= wide[side]["max_ms"]
    assert wide["padded_weight_grad_ratio"] == round(
        wide["torch_weight_grad"]["median_ms"] / wide["padded_weight_grad"]["median_ms"], 2)


def test_parameter_server_lookahead_quick():
    """parameter_server_bench.py --lookahead: every variant ran every round over the
    same batches, and MEM-PS's counters show what each window did: none for K = 0,
    a slide a batch for the pipeline's slid window, one (the pop at the end of the
    data) for a window set anew, and the same evictions from both (they hold the
    same keys: mem_cache_test's SlidingLookahead)."""
    out = run_json("bench/parameter_server_bench.py", "--quick", "--lookahead", "0,2,4", timeout=120)
    assert out["benchmark"] == "parameter_server prefetch lookahead" and out["quick"] is True
    assert "--lookahead" in out["provenance"]["command"] and out["provenance"]["commit"]
    batches, rounds = out["batches"], out["rounds"]
    assert batches >= 2 and rounds >= 2 and out["ks"] == [0, 2, 4]
    assert list(out["variants"]) == ["K=0", "K=2 slid", "K=2 set", "K=4 slid", "K=4 set"]
    distinct = out["distinct_keys"]
    assert out["mem_capacity_rows"] < distinct["a_round"]  # MEM-PS cannot hold a round: it evicts
    for name, v in out["variants"].items():
        t = v["ms_a_batch"]
        assert 0 < t["min"] <= t["median"] <= t["max"], name
        assert len(v["ms_a_batch_round_medians"]) == len(v["mem"]) == rounds
        for m in v["mem"]:
            assert m["hits"] + m["misses"] == distinct["a_run"], name  # each batch's distinct keys pinned once
            assert m["ssd_rows_read"] == m["misses"], name  # the store holds every key: a miss reads it
            # Every key of the round was loaded, and at most the capacity stays cached.
            assert m["evictions"] >= distinct["a_round"] - out["mem_capacity_rows"], name
            assert m["lookahead_spared"] + m["lookahead_forced"] <= m["evictions"], name
            if v["k"] == 0:
                assert v["window"] == "none"
                assert m["lookahead_spared"] == m["lookahead_forced"] == m["lookahead_slides"] == 0
            elif v["window"] == "slid":
                assert m["lookahead_slides"] == batches - 1
            else:
                assert v["window"] == "set" and m["lookahead_slides"] == 1
    for k in (2, 4):
        slid, reset = out["variants"][f"K={k} slid"]["mem"], out["variants"][f"K={k} set"]["mem"]
        for a, b in zip(slid, reset):
            assert {c: n for c, n in a.items() if c != "lookahead_slides"} == \
                   {c: n for c, n in b.items() if c != "lookahead_slides"}
