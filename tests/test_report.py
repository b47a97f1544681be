"""bench/report.py: the generated tables of docs/benchmarks.md come from the JSON lines
in docs/results/, with their medians, ranges, per-round ratios and provenance, and
--check notices when the docs and the lines disagree."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import report  # noqa: E402
from _provenance import command_line, provenance  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def prov(date="2026-11-23T10:00:00Z", command="python3 bench/train_bench.py --rounds 3", dirty=()):
    return {"commit": COMMIT, "dirty": list(dirty), "date": date, "command": command,
            "machine": {"cpu_model": "Test CPU", "cpus": 2, "kernel": "6.1", "mem_gib": 24.0}}


def w4_line(rates_hps, rates_torch, date="2026-11-23T10:00:00Z", mlp=(512, 256)):
    def side(rates, auc):
        return {"examples": 1000, "examples_per_s": sorted(rates)[len(rates) // 2] if len(rates) % 2 else
                (sorted(rates)[len(rates) // 2 - 1] + sorted(rates)[len(rates) // 2]) / 2,
                "examples_per_s_runs": rates, "auc": auc, "logloss": 0.45,
                "pipeline": {"wall_over_slowest_stage": 1.07, "bound_by": "train"}}
    return {"benchmark": "W4s train" if list(mlp) == [16] else "W4 train", "examples": 2_000_000,
            "eval_examples": 200_000, "batch_size": 4096, "mlp": list(mlp), "rounds": len(rates_hps),
            "quick": False, "hps": side(rates_hps, 0.8101), "torch": side(rates_torch, 0.8099),
            "ratio_per_round": [h / t for h, t in zip(rates_hps, rates_torch)],
            "auc_difference": 0.0002, "provenance": prov(date)}


def w5_line(date="2026-11-23T11:00:00Z"):
    def run(rates, auc):
        return {"status": "ok", "examples_per_s": sorted(rates)[1], "examples_per_s_range":
                {"min": min(rates), "max": max(rates)}, "examples_per_s_rounds": rates, "auc": auc,
                "mem_hit_rate": 0.75, "rows_from_ssd": 123456, "pipeline": {"bound_by": "prefetch"}}
    ssd, rocks, mem = [40000.0, 44000.0, 42000.0], [8000.0, 8000.0, 9000.0], [50000.0, 50000.0, 52000.0]
    return {"benchmark": "W5 train, table 4x the MEM-PS budget", "examples": 1_000_000, "repeat": 3,
            "mlp": [512, 256], "table": {"rows": 941712}, "hps_mem_budget_bytes": 56_000_000,
            "memory_limit": 1 << 30, "quick": False,
            "runs": {"hps_ssd": run(ssd, 0.80), "rocksdb": run(rocks, 0.80), "hps_mem": run(mem, 0.80)},
            "ratios": {"hps_ssd_over_rocksdb": 5.0,
                       "hps_ssd_over_rocksdb_per_round": [a / b for a, b in zip(ssd, rocks)],
                       "hps_ssd_over_hps_in_memory": 0.84,
                       "hps_ssd_over_hps_in_memory_per_round": [a / b for a, b in zip(ssd, mem)]},
            "provenance": prov(date, "python3 bench/w5_bench.py --repeat 3")}


def w2_line():
    def stat(runs):
        s = sorted(runs)
        return {"median": s[1], "min": s[0], "max": s[2], "runs": runs}
    ops = {op: {"hps_t1": stat([10.0, 12.0, 11.0]), "hps_t2": stat([19.0, 22.0, 20.0]),
                "absl": stat([8.0, 9.0, 10.0]), "absl_pf": stat([12.0, 10.0, 11.0]), "boost": stat([9.0, 9.5, 8.5])}
           for op in report.W2_OPS}
    return {"benchmark": "W2", "name": "hash_table", "quick": False,
            "config": {"keys": 10_000_000, "repeats": 3, "hps_load": 0.8, "peer_hugepages": True, "peer_prefetch": 8,
                       "impls": ["hps_t1", "hps_t2", "absl", "absl_pf", "boost"]},
            "results": {"16": {"load": {"hps_t1": 0.8, "absl": 0.6}, "ops": ops}},
            "targets": {"rule": "r", "met": False, "misses": ["W=16 find_hit"]},
            "provenance": prov(command="bench/hash_table.sh --repeats 3")}


DOCS = """# Benchmarks

## W4
intro
<!-- report:w4 -->
stale text
<!-- /report:w4 -->

## W5
<!-- report:w5 -->
<!-- /report:w5 -->

## W2
<!-- report:w2 -->
<!-- /report:w2 -->

## W6
<!-- report:w6 -->
old hand-written figures
<!-- /report:w6 -->
tail
"""


@pytest.fixture
def tree(tmp_path):
    docs = tmp_path / "docs"
    (docs / "results").mkdir(parents=True)
    (docs / "benchmarks.md").write_text(DOCS)
    return docs


def write_lines(path, *lines):
    with open(path, "a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def run(tree, *args):
    return report.main(["--docs", str(tree / "benchmarks.md"), "--results", str(tree / "results"), *args])


def region(text, wid):
    start = text.index(f"<!-- report:{wid} -->")
    return text[start:text.index(f"<!-- /report:{wid} -->", start)]


def rendered(tree, wid, line):
    """The region of workload `wid` after report.py ran on `line` alone."""
    write_lines(tree / "results" / f"{wid}.jsonl", line)
    assert run(tree) == 0
    return region((tree / "benchmarks.md").read_text(), wid)


def test_w4_table_has_median_range_per_round_ratios_and_provenance(tree):
    # The latest line by date is reported, wherever it sits in the file.
    write_lines(tree / "results" / "w4.jsonl",
                w4_line([100.0, 130.0, 120.0], [100.0, 100.0, 100.0], date="2026-11-23T12:00:00Z"),
                w4_line([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], date="2026-11-22T12:00:00Z"))
    assert run(tree) == 0
    text = (tree / "benchmarks.md").read_text()
    w4 = region(text, "w4")
    assert "stale text" not in w4
    assert "| hps | 120 (100-130) | 3 | 0.8101 | 0.4500 |" in w4  # median (min-max) over rounds
    assert "| PyTorch | 100 | 3 |" in w4                           # one value: no range
    assert "hps / PyTorch, examples/s: 1.20 (rounds: 1.00, 1.30, 1.20)" in w4
    assert f"`{COMMIT[:12]}`" in w4 and "2026-11-23T12:00:00Z" in w4
    assert "`python3 bench/train_bench.py --rounds 3`" in w4
    assert "line 1, the latest of 2" in w4
    assert "Test CPU, 2 CPUs" in w4
    assert "wall time / slowest stage 1.07, bound by train" in w4
    # An old line, without the MLP alone, has no bound column.
    assert "the MLP alone" not in w4
    # Regions without lines say so, and replace what was written there by hand.
    w6 = region(text, "w6")
    assert "Not measured at this commit" in w6 and "old hand-written figures" not in w6
    assert text.endswith("tail\n") and text.startswith("# Benchmarks\n\n## W4\nintro\n")


def test_w4_reports_each_system_as_a_fraction_of_the_mlp_alone(tree):
    line = w4_line([100.0, 120.0], [80.0, 100.0])
    line["mlp_alone"] = {"examples": 1000, "examples_per_s": 200.0, "examples_per_s_runs": [160.0, 240.0]}
    line["fraction_of_mlp_alone_per_round"] = {"hps": [100 / 160, 120 / 240], "torch": [80 / 160, 100 / 240]}
    line["fraction_of_mlp_alone"] = {"hps": (100 / 160 + 120 / 240) / 2, "torch": (80 / 160 + 100 / 240) / 2}
    w4 = rendered(tree, "w4", line)
    assert "| system | examples/s | rounds | eval AUC | eval logloss | / the MLP alone |" in w4
    assert "| hps | 110 (100-120) | 2 | 0.8101 | 0.4500 | 0.56 |" in w4
    assert "| the MLP alone (the bound) | 200 (160-240) | 2 | - | - | 1 |" in w4
    # The ceiling of a ratio over PyTorch is the MLP alone over PyTorch, round by round.
    assert "the MLP alone / PyTorch, examples/s (the most over it for a system that runs the MLP as torch does): 2.20 " \
           "(rounds: 2.00, 2.40)" in w4
    assert "hps / the MLP alone: 0.56 (rounds: 0.62, 0.50)" in w4
    assert "device-tier" not in w4  # no --device-path in this run


def test_w4_reports_the_device_tier_path_beside_the_in_place_one(tree):
    line = w4_line([100.0, 120.0], [80.0, 100.0])
    line["device_path"] = 2
    line["hps_device"] = {"examples": 1000, "examples_per_s": 90.0, "examples_per_s_runs": [90.0, 96.0],
                          "auc": 0.8101, "logloss": 0.45}
    line["ratio_device_path_over_in_place_per_round"] = [0.9, 0.8]
    w4 = rendered(tree, "w4", line)
    assert "| hps, device-tier path (2 host partitions) | 90 (90-96) | 2 | 0.8101 | 0.4500 |" in w4
    assert "the device-tier path over 2 host partitions / the in-place path, examples/s: 0.85 " \
           "(rounds: 0.90, 0.80)" in w4


def test_ps_lookahead_prefetch_with_a_window_table(tree):
    """parameter_server_bench.py --lookahead: a row per variant, ms a batch with its
    range, each round's median over K = 0's, and MEM-PS's counters of one run (the
    one with the median hits: its counters add up); a --quick line is refused."""
    with open(tree / "benchmarks.md", "a") as f:
        f.write("<!-- report:ps_lookahead -->\n<!-- /report:ps_lookahead -->\n")

    def mem(hits, evictions, spared, forced, slides):
        return {"hits": hits, "misses": 1000 - hits, "evictions": evictions, "lookahead_spared": spared,
                "lookahead_forced": forced, "lookahead_slides": slides}

    def variant(k, window, ms, rounds, runs):
        return {"k": k, "window": window, "ms_a_batch": ms, "ms_a_batch_round_medians": rounds, "mem": runs}

    line = {"benchmark": "parameter_server prefetch lookahead", "quick": False, "dim": 16, "zipf_a": 1.05,
            "universe": 1_000_000, "batch": [4096, 26], "batches": 32, "rounds": 2, "ks": [0, 8],
            "distinct_keys": {"a_batch_median": 32003, "a_run": 1000, "a_round": 386837},
            "mem_capacity_rows": 128000,
            "variants": {
                "K=0": variant(0, "none", {"median": 10.0, "min": 8.0, "max": 20.0}, [10.0, 12.0],
                               [mem(500, 300, 0, 0, 0)] * 2),
                "K=8 slid": variant(8, "slid", {"median": 15.0, "min": 9.5, "max": 30.0}, [15.0, 18.0],
                                    [mem(600, 200, 90, 1, 31), mem(610, 190, 95, 1, 31)]),
                "K=8 set": variant(8, "set", {"median": 40.0, "min": 20.0, "max": 80.0}, [40.0, 36.0],
                                   [mem(600, 200, 90, 1, 1)] * 2)},
            "provenance": prov(command="python3 bench/parameter_server_bench.py --lookahead 0,8")}
    assert report.workload_of(line) == "ps_lookahead"
    out = rendered(tree, "ps_lookahead", line)
    assert "over 32 batches x 2 rounds; batches of 4,096 x 26 keys" in out
    assert "MEM-PS of 128,000 rows" in out and "`python3 bench/parameter_server_bench.py --lookahead 0,8`" in out
    assert "| 0 | none | 10.0 (8.0-20.0) | - | 500 | 500 | 300 | 0 | 0 | 0 |" in out
    assert "| 8 | slid | 15.0 (9.5-30.0) | 1.50 (rounds: 1.50, 1.50) | 600 | 400 | 200 | 90 | 1 | 31 |" in out
    assert "| 8 | set | 40.0 (20.0-80.0) | 3.50 (rounds: 4.00, 3.00) | 600 | 400 | 200 | 90 | 1 | 1 |" in out
    # A --quick line is refused: the docs report full runs only.
    quick = tree / "quick.json"
    quick.write_text(json.dumps({**line, "quick": True}) + "\n")
    assert run(tree, "--add", str(quick)) == 2


def test_w4f_and_w4l_the_first_layer_a_b_and_its_products(tree):
    with open(tree / "benchmarks.md", "a") as f:
        f.write("<!-- report:w4f -->\n<!-- /report:w4f -->\n<!-- report:w4l -->\n<!-- /report:w4l -->\n")
    line = w4_line([300.0, 320.0], [100.0, 100.0], mlp=(16,))
    line["first_layer_ab"] = True
    line["hps_torch_first_layer"] = {"examples": 1000, "examples_per_s": 250.0, "examples_per_s_runs": [250.0, 240.0],
                                     "auc": 0.8101, "logloss": 0.45}
    line["ratio_own_first_layer_per_round"] = [1.2, 1.4]
    assert report.workload_of(line) == "w4f"
    w4f = rendered(tree, "w4f", line)
    assert "| hps, torch's nn.Linear as the first layer | 250 (240-250) | 2 | 0.8101 | 0.4500 |" in w4f
    assert "hps (its own first layer, the default) / hps with torch's nn.Linear as the first layer, examples/s: " \
           "1.30 (rounds: 1.20, 1.40)" in w4f
    products = {"benchmark": "first layer's input gradient", "examples": 4096, "embedding_columns": 416,
                "columns": 429, "repeats": 15, "torch": "2.13.0+cpu", "torch_blas": "mkl", "quick": False,
                "rows": [{"threads": 1, "k": 16, "every_column": {"median_ms": 2.1, "min_ms": 1.6, "max_ms": 5.8},
                          "embedding_columns": {"median_ms": 1.4, "min_ms": 1.4, "max_ms": 1.6}, "ratio": 1.5}],
                "provenance": prov(command="python3 bench/first_layer_bench.py")}
    assert report.workload_of(products) == "w4l"
    w4l = rendered(tree, "w4l", products)
    assert "| 1 | 16 | 2.10 (1.60-5.80) | 1.40 (1.40-1.60) | 1.50x |" in w4l
    assert "every one of its 429 input columns" in w4l and "the 416 embedding columns" in w4l
    assert "hps's own kernels" not in w4l  # a line from before them: no table for them
    # With hps's kernels (k <= 16): their products beside torch's, ratios torch's over hps's.
    products["hps_kernel"] = "avx512"
    products["rows"][0].update({"hps_embedding_columns": {"median_ms": 0.7, "min_ms": 0.6, "max_ms": 0.9},
                                "torch_forward": {"median_ms": 0.9, "min_ms": 0.8, "max_ms": 1.0},
                                "hps_forward": {"median_ms": 0.5, "min_ms": 0.5, "max_ms": 0.6},
                                "hps_input_grad_ratio": 2.0, "hps_forward_ratio": 1.8})
    w4l = rendered(tree, "w4l", products)
    assert "hps's own kernels (hps/narrow_linear.h, the avx512 version here)" in w4l
    assert "| 1 | 16 | 1.40 (1.40-1.60) | 0.70 (0.60-0.90) | 2.00x | 0.90 (0.80-1.00) | 0.50 (0.50-0.60) | 1.80x |" \
        in w4l
    assert "weight's and bias's gradients" not in w4l  # a line from before its kernel
    products["rows"][0].update({"torch_weight_grad": {"median_ms": 1.6, "min_ms": 1.5, "max_ms": 1.8},
                                "hps_weight_grad": {"median_ms": 1.0, "min_ms": 0.9, "max_ms": 1.2},
                                "hps_weight_grad_ratio": 1.6})
    w4l = rendered(tree, "w4l", products)
    assert "| 1 | 16 | 1.40 (1.40-1.60) | 0.70 (0.60-0.90) | 2.00x | 0.90 (0.80-1.00) | 0.50 (0.50-0.60) | 1.80x | " \
           "1.60 (1.50-1.80) | 1.00 (0.90-1.20) | 1.60x |" in w4l


def test_w5_ratios_are_medians_of_the_same_round_ratios_and_w2_the_benchmarks(tree):
    write_lines(tree / "results" / "w5.jsonl", w5_line())
    write_lines(tree / "results" / "w2.jsonl", w2_line())
    assert run(tree) == 0
    text = (tree / "benchmarks.md").read_text()
    w5 = region(text, "w5")
    assert "| hps, table on SSD-PS | ok | 42,000 (40,000-44,000) | 3 | 0.8000 |" in w5
    assert "hps on SSD / RocksDB, examples/s: 5.00 (rounds: 5.00, 5.50, 4.67)" in w5
    assert "hps on SSD / hps in memory, examples/s: 0.81 (rounds: 0.80, 0.88, 0.81)" in w5
    w2 = region(text, "w2")
    # The line has no ratios: W2's definition, the median of hps_t1 (11) over the
    # best peer's by median, absl_pf (11); the repeats against that same peer.
    assert "1.00 vs absl_pf (rounds: 0.83, 1.20, 1.00)" in w2
    # Without the prefetching peer: absl and boost tie at 9, absl listed first.
    assert "1.22 vs absl (rounds: 1.25, 1.33, 1.10)" in w2
    assert "| insert | 11.00 (10.00-12.00) | 20.00 (19.00-22.00) |" in w2
    assert "1.82 (rounds: 1.90, 1.83, 1.82)" in w2  # hps_t2 / hps_t1: medians 20 / 11
    assert "`bench/hash_table.sh --repeats 3`" in w2
    assert "absl_pf prefetches 8 keys ahead" in w2


def test_w2_table_says_the_ratio_and_peer_the_lines_targets_judged(tree):
    # hash_table_bench writes W2's ratios and judges its targets on them; the
    # table shows those, not a figure of its own (it showed medians of per-repeat
    # ratios over a per-repeat best peer, 1.00 where the targets said 0.87).
    line = w2_line()
    line["results"]["16"]["ratios"] = {
        "hps_t1_over_best_peer": {op: {"ratio": 0.872, "best_peer": "boost"} for op in report.W2_OPS},
        "hps_t1_over_best_plain_peer": {op: {"ratio": 0.9, "best_peer": "boost"} for op in report.W2_OPS},
        "hps_t2_over_hps_t1": {op: 1.152 for op in report.W2_OPS}}
    w2 = rendered(tree, "w2", line)
    assert "| find_hit |" in w2
    # hps_t1 runs 10, 12, 11 over boost's 9, 9.5, 8.5
    assert "0.87 vs boost (rounds: 1.11, 1.26, 1.29)" in w2
    assert "0.90 vs boost (rounds: 1.11, 1.26, 1.29)" in w2
    assert "1.15 (rounds: 1.90, 1.83, 1.82)" in w2


def test_w2_definition_matches_the_committed_line():
    # report.py's own computation, for lines without ratios, is the bench's:
    # stripped of its ratios, the committed W2 line gives back the same figures.
    with open(os.path.join(ROOT, "docs", "results", "w2.jsonl")) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    assert lines
    for line in lines:
        for width, r in line["results"].items():
            bare = {k: v for k, v in r.items() if k != "ratios"}
            for key, peers in (("hps_t1_over_best_peer", report.W2_PEERS),
                               ("hps_t1_over_best_plain_peer", report.W2_PLAIN)):
                for op in report.W2_OPS:
                    ratio, best = report.w2_over_best(bare, op, key, peers)
                    given = r["ratios"][key][op]
                    assert best == given["best_peer"], (width, key, op)
                    assert ratio == pytest.approx(given["ratio"], abs=5e-4), (width, key, op)


def test_check_detects_drift_and_passes_once_rewritten(tree):
    results = tree / "results" / "w4.jsonl"
    write_lines(results, w4_line([100.0, 110.0, 120.0], [100.0, 100.0, 100.0]))
    assert run(tree, "--check") == 1          # the docs still hold "stale text"
    assert run(tree) == 0
    assert run(tree, "--check") == 0
    before = (tree / "benchmarks.md").read_text()
    # A newer line changes the table: the docs are out of date again, and --check
    # leaves them as they are.
    write_lines(results, w4_line([200.0, 210.0, 220.0], [100.0, 100.0, 100.0], date="2026-11-24T00:00:00Z"))
    assert run(tree, "--check") == 1
    assert (tree / "benchmarks.md").read_text() == before
    # So does a hand edit inside a region.
    assert run(tree) == 0
    edited = (tree / "benchmarks.md").read_text().replace("| hps | 210 (200-220)", "| hps | 250 (200-220)")
    (tree / "benchmarks.md").write_text(edited)
    assert run(tree, "--check") == 1


def test_check_of_the_repository_docs_runs_on_their_own_results():
    """The committed docs match the committed JSON lines."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "report.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_lines_without_provenance_or_of_another_workload_are_refused(tree, capsys):
    line = w4_line([1.0], [1.0])
    del line["provenance"]
    write_lines(tree / "results" / "w4.jsonl", line)
    assert run(tree) == 2
    err = capsys.readouterr().err
    assert "w4.jsonl:1" in err and "provenance" in err
    (tree / "results" / "w4.jsonl").write_text(json.dumps(w5_line()) + "\n")
    assert run(tree) == 2
    assert "w4.jsonl:1: a w5 line" in capsys.readouterr().err
    (tree / "results" / "w4.jsonl").write_text("{not json\n")
    assert run(tree) == 2
    assert "w4.jsonl:1: not a JSON line" in capsys.readouterr().err


def test_unbalanced_or_unknown_markers_are_named_by_line(tree, capsys):
    docs = tree / "benchmarks.md"
    docs.write_text("a\n<!-- report:w4 -->\nb\n")
    assert run(tree) == 2
    assert "benchmarks.md:2: report:w4 is never closed" in capsys.readouterr().err
    docs.write_text("a\n<!-- report:w9 -->\n<!-- /report:w9 -->\n")
    assert run(tree) == 2
    assert "benchmarks.md:2: unknown workload 'w9'" in capsys.readouterr().err


def test_add_files_full_runs_and_refuses_quick_ones(tree, tmp_path, capsys):
    full, w5 = tmp_path / "full.json", tmp_path / "w5.json"
    full.write_text("a table the benchmark printed before its JSON line\n")  # as W6 does
    write_lines(full, w4_line([1.0], [1.0], mlp=[16]))
    write_lines(w5, w5_line())
    assert run(tree, "--add", str(full), str(w5)) == 0
    assert [json.loads(x)["benchmark"] for x in (tree / "results" / "w4s.jsonl").read_text().splitlines()] == \
        ["W4s train"]
    assert len((tree / "results" / "w5.jsonl").read_text().splitlines()) == 1
    quick = tmp_path / "quick.json"
    write_lines(quick, {**w4_line([1.0], [1.0]), "quick": True})
    assert run(tree, "--add", str(quick), str(w5)) == 2
    assert "quick.json:1: a --quick line" in capsys.readouterr().err
    # Nothing of a refused batch was filed.
    assert not (tree / "results" / "w4.jsonl").exists()
    assert len((tree / "results" / "w5.jsonl").read_text().splitlines()) == 1
    empty = tmp_path / "empty.json"
    empty.write_text("the benchmark failed before its JSON line\n")
    assert run(tree, "--add", str(empty)) == 2
    assert "empty.json: no JSON line" in capsys.readouterr().err


def test_provenance_names_the_commit_and_the_command():
    p = provenance([os.path.join(ROOT, "bench", "w5_bench.py"), "--repeat", "3", "--mlp", "16 32"])
    assert p["command"] == "python3 bench/w5_bench.py --repeat 3 --mlp '16 32'"
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert p["commit"] == head.stdout.strip()
        assert isinstance(p["dirty"], list)
    assert p["date"].endswith("Z") and p["machine"]["cpus"] == os.cpu_count()
    assert command_line(["bench/hash_table.sh", "--quick"]) == "bench/hash_table.sh --quick"


def test_scratch_dir_makes_the_results_directory_a_fresh_clone_lacks(tmp_path, monkeypatch):
    import _provenance
    monkeypatch.setattr(_provenance, "ROOT", str(tmp_path))
    made = _provenance.scratch_dir("train-bench-")
    assert os.path.isdir(made) and os.path.dirname(made) == str(tmp_path / "bench" / "results")
    assert os.path.basename(made).startswith("train-bench-") and os.listdir(made) == []
    assert _provenance.scratch_dir("train-bench-") != made  # each run its own


def w3_trace(a, seed, lru_hits, best_ratio):
    return {"accesses": 1000, "unique_keys": 400, "zipf_a": a, "seed": seed, "universe": 500,
            "capacities": [{"fraction": 0.05, "rows": 20,
                            "hit_rate": {"lru": lru_hits / 1000, "tinylfu-lfu": 0.5, "py_lru": lru_hits / 1000,
                                         "belady": 0.6},
                            "checks": {"best_native": "tinylfu-lfu", "best_ratio_to_belady": best_ratio}}]}


def test_w1_w3_w6_tables(tree):
    docs = tree / "benchmarks.md"
    docs.write_text("<!-- report:w1 -->\n<!-- /report:w1 -->\n<!-- report:w3 -->\n<!-- /report:w3 -->\n"
                    "<!-- report:w6 -->\n<!-- /report:w6 -->\n")
    store = {"status": "ok", "load": {"rows_per_s": 1e6},
             "distributions": {"uniform": {"get_rows_per_s": {"median": 2e5, "min": 1e5, "max": 3e5},
                                           "put_rows_per_s": {"median": 5e4, "min": 5e4, "max": 5e4}}}}
    write_lines(tree / "results" / "w1.jsonl", {
        "benchmark": "W1a ssd_store", "rows": 20_000_000, "row_bytes": 128, "batches": 40, "batch_keys": 100_000,
        "dists": ["uniform"], "memory_limit": 1 << 30, "quick": False,
        "stores": {"hps": store, "lmdb": {"status": "oom"}},
        "ratios_hps_over_rocksdb_tuned": {"load": 2.5, "uniform": {"get_median": 3.25, "put_median": 1.5}},
        "provenance": prov(command="python3 bench/ssd_store_bench.py --batches 40")})
    write_lines(tree / "results" / "w3.jsonl", {
        "benchmark": "W3 cache_policy", "quick": False, "tuned_on": "zipf a = 1.05",
        "traces": {"zipf": w3_trace(1.05, 1234, 300, 0.95)},
        "held_out": {"traces": {"zipf_heldout": w3_trace(0.8, 99, 100, 0.75)},
                     "targets": {"min_best_ratio_to_belady": 0.75}},
        "provenance": prov(command="python3 bench/cache_policy_bench.py")})
    write_lines(tree / "results" / "w6.jsonl", {
        "bench": "w6", "benchmark": "W6 distributed", "quick": False, "ranks": 4, "cores": 2, "examples": 2_000_000,
        "batch_per_rank": 1024, "hidden": [512, 256],
        "kstep": [{"dense_sync": "kstep", "k": 1, "auc": 0.8168, "auc_minus_k1": 0.0, "dense_bytes_per_rank": 1.3788e9,
                   "dense_bytes_over_k1": 1.0, "dense_merges": 490, "examples_per_s": 24673.0}],
        "scaling": [], "provenance": prov(command="python3 bench/w6_bench.py")})
    assert run(tree) == 0
    text = docs.read_text()
    w1 = region(text, "w1")
    assert "| hps | ok | 1,000,000 | 200,000 (100,000-300,000) | 50,000 |" in w1
    assert "| lmdb | oom | - | - | - |" in w1
    assert ("hps / rocksdb_tuned (ratio of the batch medians): load 2.50; uniform get 3.25 (one run), "
            "put 1.50 (one run)") in w1
    w3 = region(text, "w3")
    tuned, held = w3.index("**zipf**"), w3.index("**Held out**")
    assert tuned < held < w3.index("**zipf_heldout**")  # the held-out trace in its own section, after
    assert "| 5% = 20 rows | 0.3000 | 0.5000 | 0.6000 | 0.9500 (tinylfu-lfu) |" in w3[:held]
    assert "| 5% = 20 rows | 0.1000 | 0.5000 | 0.6000 | 0.7500 (tinylfu-lfu) |" in w3[held:]
    assert "tuned on: zipf a = 1.05" in w3 and "Targets on the held-out trace: min_best_ratio_to_belady: 0.7500" in w3
    w6 = region(text, "w6")
    assert "| k-step Adam, k = 1 | 0.8168 | +0.0000 | 1,378.8 | 1.000 | 490 | 24,673 |" in w6
    assert "Scaling over ranks: not measured in this run." in w6


def test_w1_in_rounds_lists_each_rounds_ratio(tree):
    (tree / "benchmarks.md").write_text("<!-- report:w1 -->\n<!-- /report:w1 -->\n")
    rate = {"median": 2e5, "min": 1.5e5, "max": 2.5e5, "rounds": [1.5e5, 2e5, 2.5e5]}
    store = {"status": "ok", "load": {"rows_per_s": 1e6},
             "distributions": {"zipf": {"get_rows_per_s": rate, "put_rows_per_s": rate}}}
    write_lines(tree / "results" / "w1.jsonl", {
        "benchmark": "W1a ssd_store", "rows": 1000, "row_bytes": 128, "batches": 4, "batch_keys": 100,
        "dists": ["zipf"], "rounds": 3, "quick": False, "stores": {"hps": store},
        "ratios_hps_over_rocksdb_tuned": {"zipf": {"get_median": 2.0, "get_per_round": [1.5, 2.0, 2.5],
                                                   "put_median": 1.0, "put_per_round": [1.0, 0.9, 1.1]}},
        "provenance": prov(command="python3 bench/ssd_store_bench.py --rounds 3")})
    assert run(tree) == 0
    w1 = region((tree / "benchmarks.md").read_text(), "w1")
    assert "median (min-max) over the 3 rounds' batch medians" in w1
    assert "| hps | ok | 1,000,000 | 200,000 (150,000-250,000) | 200,000 (150,000-250,000) |" in w1
    assert ("hps / rocksdb_tuned (same-round ratios of the batch medians): zipf get 2.00 (rounds: 1.50, 2.00, "
            "2.50), put 1.00 (rounds: 1.00, 0.90, 1.10)") in w1


def test_w1_lists_the_peers_variants_and_those_that_did_not_finish(tree):
    (tree / "benchmarks.md").write_text("<!-- report:w1 -->\n<!-- /report:w1 -->\n")
    rate = {"median": 3e4, "min": 2e4, "max": 4e4}
    by_variant = {"get_median_by_variant": {"readers=1,split=row": 2.5e4, "readers=4,split=row": 3e4},
                  "put_median_by_variant": {"readers=1,split=row": 2e5, "readers=4,split=row": 1.5e5}}
    round_ = {"variants_failed": {"readers=8,split=row": {"status": "oom"}}}
    peer = {"status": "ok", "load": {"rows_per_s": 1e6}, "figures_from_round": 0, "rounds": [round_],
            "options_of": "readers=4,split=row (the best uniform get)",
            "distributions": {"uniform": {"get_rows_per_s": rate, "put_rows_per_s": rate, **by_variant}}}
    write_lines(tree / "results" / "w1.jsonl", {
        "benchmark": "W1a ssd_store", "rows": 1000, "row_bytes": 128, "batches": 4, "batch_keys": 100,
        "dists": ["uniform"], "rounds": 1, "quick": False, "stores": {"rocksdb_tuned": peer},
        "provenance": prov(command="python3 bench/ssd_store_bench.py --rounds 1")})
    assert run(tree) == 0
    w1 = region((tree / "benchmarks.md").read_text(), "w1")
    assert ("- rocksdb_tuned variants, uniform get / put rows/s (round 1): readers=1,split=row 25,000 / 200,000; "
            "readers=4,split=row 30,000 / 150,000") in w1
    assert "- rocksdb_tuned variants that did not finish: readers=8,split=row (oom)" in w1


def w12_line(finished=True):
    plan = {"keys_target": 200_000_000, "examples": 33_738_752, "batches": 8237, "zipf_a": 1.05,
            "vocab_per_field": 2_000_000_000, "fields": 26, "expected_distinct_keys": 202_000_000.4}
    return {"benchmark": "W12 train, a table larger than the machine's memory", "quick": False, "plan": plan,
            "mem_budget": "4GiB", "batch_size": 4096, "mlp": [512, 256], "dim": 16, "optimizer": "adagrad",
            "row_bytes": 128, "memory_limit": 8 << 30, "finished": finished, "killed": True,
            "phases": [{"phase": "first", "returncode": -9,
                        "killed": {"at_checkpoint": 6, "seconds": 1200.4,
                                   "moment": "inside checkpoint 6 (its snapshot being made)"}},
                       {"phase": "resumed", "returncode": 0 if finished else -9}],
            "examples_trained": 33_738_752, "distinct_keys": 202_100_000, "examples_at_resume": 18_800_640,
            "verify": {"returncode": 0, "from_ssd": 70_000, "first_batch_keys": 70_000, "initialized": 0},
            "space_amplification_max": 1.62, "space_amplification_end": 1.31, "within_memory_limit": True,
            "examples_per_s_overall": 14_000.4, "examples_per_s_resumed_run": 16_500.0,
            "mem_hit_rate_first_run": 0.612, "mem_hit_rate_resumed_run": 0.655, "wall_seconds": 2400.0,
            "pipeline": {"bound_by": "prefetch"},
            "cpu": {"job_cores_busy_mean": 1.71, "machine_cores_busy_mean": 1.95, "cores": 2},
            "io": {"read_MB_per_s_mean": 120.5, "read_MB_per_s_max_interval": 300.2,
                   "write_MB_per_s_mean": 200.0, "write_MB_per_s_max_interval": 900.0},
            "device_limits": {"seq_read_MB_per_s": 754.0, "rand_read_4k_MB_per_s": 311.296,
                              "seq_write_MB_per_s": 1340.0},
            "memory": {"mem_ps_budget_bytes": 4 << 30, "mem_ps_arena_bytes": 2 << 30,
                       "ssd_index_bytes": 2_700_000_000, "ssd_index_bytes_per_key": 13.36,
                       "process_rss_peak_bytes": 7 << 30, "cgroup_peak_bytes": 15 << 29},
            "provenance": prov(command="python3 bench/w12_bench.py")}


def test_w12_table_has_the_checks_rates_io_and_memory_by_component(tree):
    (tree / "benchmarks.md").write_text("## W12\n<!-- report:w12 -->\n<!-- /report:w12 -->\n")
    write_lines(tree / "results" / "w12.jsonl", w12_line())
    assert run(tree) == 0
    w12 = region((tree / "benchmarks.md").read_text(), "w12")
    assert "202,100,000 distinct keys (target 200,000,000, the plan expected 202,000,000)" in w12
    assert "the job in a 8.00 GiB memory cgroup" in w12
    assert "| finished | yes |" in w12
    assert ("| SIGKILL | inside checkpoint 6 (its snapshot being made), 1,200 s into the run; resumed from its "
            "last checkpoint (the killed run's last eval entry: 18,800,640 examples) |") in w12
    assert ("| final checkpoint reopened | 70,000 of the first batch's 70,000 keys from SSD-PS, 0 initialised "
            "anew |") in w12
    assert "| disk / live, max over the run (limit 2) | 1.62; at the end 1.31 |" in w12
    assert "| examples/s over the job (the kill, restart and skip included) | 14,000 |" in w12
    assert "| MEM-PS hit rate: first run (to its last checkpoint) / resumed run | 0.612 / 0.655 |" in w12
    assert "| read | 120.5 | 300.2 | 754 sequential, 311 random 4 KiB |" in w12
    assert "| cores busy: the job / the whole machine (of its cores) | 1.71 / 1.95 (of 2) |" in w12
    assert "| SSD-PS key index | 2.51 GiB | 13.4 B a key |" in w12
    assert "| cgroup peak (RSS + page cache) | 7.50 GiB | - |" in w12
    assert "`python3 bench/w12_bench.py`" in w12
    # A run that did not finish says so, and is not filed under W1 (whose prefix W12 shares).
    assert report.workload_of(w12_line()) == "w12"
    (tree / "results" / "w12.jsonl").unlink()
    write_lines(tree / "results" / "w12.jsonl", w12_line(finished=False))
    assert run(tree) == 0
    assert "| finished | NO |" in region((tree / "benchmarks.md").read_text(), "w12")
    # An OOM kill (a SIGKILL too) is named from the cgroup's counter, whatever the peaks say.
    # The cgroup's counter adds up over the job's processes: one kill, in the first.
    oom = w12_line()
    oom["killed"] = False
    oom["phases"][0].pop("killed")
    oom["phases"][0]["seconds"] = 1611.0
    oom["phases"][0]["cgroup"] = {"oom_control.oom_kill": 1}
    oom["phases"][1]["cgroup"] = {"oom_control.oom_kill": 1}
    write_lines(tree / "results" / "w12.jsonl", oom)
    assert run(tree) == 0
    text = region((tree / "benchmarks.md").read_text(), "w12")
    assert "| within the memory limit | NO: the kernel killed it for memory (first run: 1) |" in text
    assert ("| SIGKILL | not sent: the kernel killed the first run for memory 1,611 s in; resumed from its last "
            "checkpoint (the killed run's last eval entry: 18,800,640 examples) |") in text


# Quick lines as bench/ssd_store.sh --quick --stores hps,rocksdb_tuned and
# python3 bench/w6_bench.py --quick printed them (the W1 line without its per-variant
# and per-round detail, which the table does not read). --add refuses quick
# lines, so they go to the renderers directly.
LINES = os.path.join(ROOT, "tests", "report_lines")


def quick_line(name):
    with open(os.path.join(LINES, name)) as f:
        return json.loads(f.readline())


def test_w1_renders_the_line_ssd_store_sh_prints():
    o = quick_line("w1_quick.json")
    assert report.workload_of(o) == "w1" and o["quick"]
    w1 = "\n".join(report.render_w1(o))
    assert "| hps | ok | 493,614 | 42,667 | 329,225 | 101,331 | 810,428 |" in w1
    assert "| rocksdb_tuned | ok | 351,086 | 22,228 | 155,820 | 28,939 | 131,908 |" in w1
    assert "memory limit 1.00 GiB" in w1 and "over one round (its batch median)" in w1
    assert "uniform get 1.92 (one round), put 2.11 (one round)" in w1
    # What ran: the I/O path the store reported, the RocksDB variant that was the peer,
    # the targets the line judged, and hps against the device's own random reads.
    assert "- hps moved rows by io_uring+O_DIRECT" in w1
    assert "- rocksdb_tuned: readers=2,split=block (the best uniform get" in w1
    assert ("- Targets (issue 14, against rocksdb_tuned at its best): uniform get >= 2x rocksdb_tuned: missed; "
            "uniform put >= 5x rocksdb_tuned: missed") in w1
    assert "random-read IOPS (queue depth 64): 1.57" in w1
    prov_text = "\n".join(report.provenance_lines("docs/results/w1.jsonl", 1, 1, o, ROOT))
    assert "A --quick run" in prov_text and "`python3 bench/ssd_store_bench.py --quick --stores hps,rocksdb_tuned`" in prov_text


def test_w1_names_a_fallen_back_io_path_and_a_failed_store():
    o = quick_line("w1_quick.json")
    o["stores"]["hps"]["store_stats"].update(io_path="pread", io_fallback="io_uring_queue_init: Operation not permitted")
    o["stores"]["rocksdb_tuned"] = {"status": "error"}
    w1 = "\n".join(report.render_w1(o))
    assert "- hps moved rows by pread (fell back: io_uring_queue_init: Operation not permitted)" in w1
    assert "| rocksdb_tuned | error | - | - | - | - | - |" in w1


def test_w6_renders_the_line_w6_bench_prints():
    o = quick_line("w6_quick.json")
    assert report.workload_of(o) == "w6" and o["quick"]
    w6 = "\n".join(report.render_w6(o))
    assert "2 ranks on 2 cores, 200,000 examples, batches of 1024 a rank, MLP [64]" in w6
    assert "| k-step Adam, k = 1 | 0.8075 | +0.0000 | 22.1 | 1.000 | 100 | 11,287 |" in w6
    assert "| k-step Adam, k = 10 | 0.8079 | +0.0005 | 2.2 | 0.100 | 10 | 8,081 |" in w6
    assert "| gradient all-reduce, torch Adam | 0.8015 | -0.0060 | 11.0 | 0.500 | 0 | 11,204 |" in w6
    assert "Scaling over ranks: not measured in this run." in w6
    # A full run adds scaling entries, each a run of the same shape as the k-step ones.
    o["scaling"] = [o["kstep"][-1]]
    w6 = "\n".join(report.render_w6(o))
    assert "| 2 | 11,204 | 1.00 | 0.8015 | 46 kB, 256 kB, 232 kB |" in w6


def test_w10_renders_rounds_ratios_and_the_planners_model_against_the_jobs():
    # A --quick line bench/w10_bench.py printed (2 rounds of every job, under load).
    o = quick_line("w10_quick.json")
    assert report.workload_of(o) == "w10" and o["quick"] and o["rounds"] == 2 and not o["problems"]
    w10 = "\n".join(report.render_w10(o))
    assert "2 round(s), every job once a round, the order rotated each round" in w10
    # examples/s: median (min-max) over the rounds; the repeated AUC and logloss once.
    assert "| `reference` | 1 | - | - | 0.7832 | - | 0.4662 | 13,871 (9,309-18,433) |" in w10
    # The EASGD job's quality moved between rounds: its range, at a precision that shows it.
    assert "| 0.5939 (0.5938-0.5940) | -0.1893 | 0.55452 (0.55450-0.55454) | 9,140 (8,972-9,307) |" in w10
    # Ratios within a round, each round's listed.
    assert "- `replicas:1x4` / `allreduce:4`: 1.08 (rounds: 1.16, 0.99)" in w10
    assert "- `codec:bf16/bf16` / `codec:none/none`: 0.74 (rounds: 0.50, 0.99)" in w10
    # Modelled and measured per node, each said to be which; the rate the model used.
    assert "**Modelled** (the planner's `node_costs` for the plan the job ran)" in w10 and "**Measured**" in w10
    assert "CPU = FLOPs at 107.3 (103.9-110.8) GFLOP per CPU second" in w10
    assert ("| `codec:none/none` | ps0 (fc0, fc1) | 2.15 | 20.1 (19.4-20.7) | 25.5 (24.9-26.1) (training requests "
            "served) | 1.27 (1.26-1.28)x | 151 (130-172) | 350 (242-458) | 11.2 | 14.00 | 14.00 | 1.000x |") in w10
    assert "| `codec:int8/bf16` | trainer (fc2) | 0.00157 |" in w10 and "(whole process) | 6,381 (5,956-6,806)x |" in w10


def test_w10_renders_the_hogwild_job_with_its_nets_its_quality_range_and_its_ratio():
    # The quick line with a Hogwild job as bench/w10_bench.py summarises one: the split
    # job's plan and bytes, 2 nets, an AUC that moved between rounds, a same-round ratio.
    o = quick_line("w10_quick.json")
    one = next(w for w in o["workloads"] if w["workload"] == "codec:none/none")
    hog = {**{k: v for k, v in one.items() if k != "nodes"}, "workload": "hogwild:2", "nets": 2, "auc": 0.78371,
           "auc_runs": [0.78371, 0.78402], "logloss": 0.46553, "varies_across_rounds": ["auc"],
           "examples_per_s": 7204, "examples_per_s_min": 6550, "examples_per_s_max": 7858,
           "examples_per_s_runs": [7858, 6550], "auc_change_vs_reference": 0.00051}
    o["workloads"].append(hog)
    o["ratios"].append({"workload": "hogwild:2", "peer": "codec:none/none", "median": 0.99, "min": 0.98,
                        "max": 1.0, "runs": [1.0, 0.98]})
    w10 = "\n".join(report.render_w10(o))
    assert ("| `hogwild:2` | 2 | ps:vertical, ps:horizontal, trainer:none; 2 Hogwild nets | activations 5,018.7 -> "
            "5,018.7 kB; gradients 3,072.0 -> 3,072.0 kB | 0.7837 (0.7837-0.7840) | +0.0005 | 0.4655 | "
            "7,204 (6,550-7,858) |") in w10
    assert "- `hogwild:2` / `codec:none/none`: 0.99 (rounds: 1.00, 0.98)" in w10
    assert "Hogwild nets" not in "\n".join(report.render_w10(quick_line("w10_quick.json")))  # one net: as before


def test_w10_line_from_before_the_rounds_renders_as_it_did():
    # Lines filed before --rounds have one examples/s a job and no ratios or per-node figures.
    o = {"benchmark": "W10 hierarchical training", "quick": False, "examples": 200_000, "eval_examples": 50_000,
         "workloads": [{"workload": "reference", "ranks": 1, "auc": 0.80141, "logloss": 0.44721,
                        "examples_per_s": 41500},
                       {"workload": "codec:bf16/bf16", "ranks": 2, "plan": ["ps:vertical", "ps:horizontal"],
                        "bytes_per_step": {"gradients": {"before": 3134700, "after": 1567350}}, "auc": 0.8013,
                        "logloss": 0.4472, "examples_per_s": 18550, "auc_change_vs_reference": -0.0001}],
         "provenance": prov()}
    w10 = "\n".join(report.render_w10(o))
    assert "| `reference` | 1 | - | - | 0.8014 | - | 0.4472 | 41,500 |" in w10
    assert ("| `codec:bf16/bf16` | 2 | ps:vertical, ps:horizontal | gradients 3,134.7 -> 1,567.3 kB | 0.8013 | "
            "-0.0001 | 0.4472 | 18,550 |") in w10
    assert "round(s)" not in w10 and "Modelled" not in w10 and "ratios" not in w10


def test_w11_with_hps_train_as_the_writer_renders_its_training_and_the_lookups_memory():
    o = quick_line("w11_train_quick.json")
    assert report.workload_of(o) == "w11w"
    text = "\n".join(report.render_w11(o))
    w = o["writer"]
    assert f"`hps train` trained meanwhile ({w['batches_checkpointed']:,} batches" in text
    assert "pushed" not in text
    h = o["results"]["hps/uniform"]
    assert f"memory measured {h['measured_bytes'] / 2**20:,.1f} MiB (by rss)" in text
    assert ("**over** the budget" in text) == (not h["within_budget"] or not o["results"]["hps/zipf"]["within_budget"])
    assert "hit rate of the last checkpoint's cache" in text  # a refresh replaced the cache the rate is of
    fixed = dict(o, results={k: dict(v, within_budget=True) for k, v in o["results"].items()})
    assert "**over**" not in "\n".join(report.render_w11(fixed))
