"""W8's bench in --quick mode: the modelled times on the Figure 1 node, the host
executor's schedules delivering what direct copies do, and bench/report.py's W8 table."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "w8_bench.py"), "--quick", "--no-save", *args],
                          capture_output=True, text=True, timeout=120)


def test_w8_quick():
    done = run()
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["bench"] == "w8" and line["provenance"]["command"] and line["quick"]
    assert line["topology"] == "examples/topologies/figure1.toml"
    # 1M rows of 64 floats over 8 x 8 pairs: 15,625 rows of 256 B a pair
    assert line["bytes_per_pair"] == 15_625 * 256
    for d in ("pull", "push"):
        m = line["model"][d]
        assert m["host"]["route_count"]["host"] == 56
        assert m["relay"]["route_count"]["relay"] > 0
        assert m["relay"]["seconds"] < m["direct"]["seconds"] < m["host"]["seconds"]
        assert line[f"{d}_reduction"] >= 0.75
    assert line["meets_target"] is True
    rules = line["fixed_rules"]["pull"]
    for name in ("paddle_(s+4)%8", "partner_(d+4)%8"):
        assert rules[name]["route_count"]["relay"] == 24
        assert rules[name]["seconds"] >= line["model"]["pull"]["relay"]["seconds"] * (1 - 1e-9)
    for s, x in line["executor"]["pull"].items():
        assert x["delivered_as_direct"] is True, s
    assert line["executor"]["pull"]["host"]["staged_bytes"] > line["executor"]["pull"]["relay"]["staged_bytes"] > 0
    # hps train's recorded matrix (8 host partitions routed through figure1): the pull
    # counted from the data, plus its transpose (the push), is what the tier recorded.
    t = line["train_matrices"]
    assert t["devices"] == 8 and t["batches"] == 8
    assert t["pull_plus_transpose_equals_recorded"] is True
    assert t["run_routes"]["executed"] is True and t["run_routes"]["relayed_rows"] > 0
    for d in ("pull", "push"):
        m = t["model_per_batch"][d]
        assert m["relay"]["seconds"] < m["direct"]["seconds"] < m["host"]["seconds"]
        assert line[f"train_{d}_reduction"] == m["relay"]["reduction_vs_host"]
    assert {"dgx1-hybrid-cube-mesh", "nvswitch", "pcie-only"} <= set(line["other_nodes"])
    bind = line["binding"]
    two, four = bind["fake_2_nodes"], bind["fake_4_nodes"]
    assert not two["noop"] and not four["noop"]
    stage = {x["stage"]: x for x in four["stages"]}
    assert stage["ssd_io"]["numa"] == 3 and stage["ssd_io"]["cores"] == list(range(24, 32))
    assert stage["reader"]["numa"] == 1 and stage["load:gpu5"]["numa"] == 2
    assert [x["numa"] for x in two["stages"]][:2] == [1, 1]
    spec = importlib.util.spec_from_file_location("hps_bench_report", ROOT / "bench" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert report.workload_of(line) == "w8"
    rows = [r for r in report.render_w8(line) if r.startswith("| ")]
    relay = line["model"]["pull"]["relay"]
    want = f"| pull | relay | {relay['seconds'] * 1e3:.3f} | {1 - relay['reduction_vs_host']:.3f} |"
    assert any(r.startswith(want) for r in rows), (want, rows)
    assert "| fake 4 nodes | ssd_io | 3 | 24-31 | nvme0 is on NUMA node 3 |" in rows


def test_w8_refuses_bad_arguments(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[device]]\nname = "g"\nkind = "tpu"\n')
    for args, message in ((["--rows", "0"], "--rows"), (["--file", str(bad)], f"{bad}:3: device[0].kind")):
        done = run(*args)
        assert done.returncode == 2 and message in done.stderr, done.stderr
