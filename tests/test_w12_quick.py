"""W12 at a small size (bench/w12_bench.py --quick): `hps train` over a table
several times its MEM-PS budget, SIGKILLed inside a checkpoint, resumed, and
checked against the run's plan and the limits it ran under."""
import json
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "w12_bench.py")


@pytest.fixture(scope="module")
def w12(tmp_path_factory):
    work = tmp_path_factory.mktemp("w12")
    out = work / "w12.json"
    done = subprocess.run([sys.executable, BENCH, "--quick", "--dir", str(work / "run"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == line
    return line


def test_w12_quick_trains_every_example_through_a_kill_and_a_resume(w12):
    plan = w12["plan"]
    first, resumed = w12["phases"]
    # Killed once, inside the planned checkpoint, then resumed to the end.
    assert first["returncode"] == -signal.SIGKILL
    assert first["killed"]["at_checkpoint"] == plan["kill_in_checkpoint"]
    assert resumed["returncode"] == 0 and resumed["command"][-1] == "--resume"
    assert w12["killed"] and w12["finished"]
    assert 0 < w12["examples_at_resume"] < plan["examples"]
    assert w12["examples_trained"] == plan["examples"] == w12["examples_expected"]
    # The keys the plan promised: at least the target, and what the Zipf model
    # expects (the generator's draws agree with it to well under 1%).
    assert w12["distinct_keys"] >= plan["keys_target"]
    assert w12["distinct_keys"] == pytest.approx(plan["expected_distinct_keys"], rel=0.01)
    # The table outgrew MEM-PS: most keys live only on SSD-PS.
    assert w12["mem"]["capacity"] * 4 < w12["distinct_keys"]
    assert w12["ssd"]["live_records"] == w12["distinct_keys"]
    assert w12["ssd"]["rows_read"] > 0 and w12["ssd"]["rows_written"] > 0
    # The final checkpoint opens in a new process and serves the first batch's
    # keys from SSD-PS, none initialised anew.
    v = w12["verify"]
    assert v["returncode"] == 0, v.get("error")
    assert v["live_records"] == v["summary_live_records"] == w12["distinct_keys"]
    assert v["from_ssd"] == v["first_batch_keys"] > 0 and v["initialized"] == 0 and v["rows_finite"]


def test_w12_quick_keeps_disk_within_twice_the_live_rows(w12):
    assert w12["space_amplification_max_at"] is not None  # eval entries lined up with disk samples
    assert 1.0 <= w12["space_amplification_max"] <= 2.0
    assert 1.0 <= w12["space_amplification_end"] <= 2.0
    assert w12["disk_peak_bytes"] >= w12["live_bytes"]


def test_w12_quick_memory_by_component(w12):
    m = w12["memory"]
    # The SSD-PS index: 10 bytes a slot at loads of 0.4 to 0.8, plus its shard table.
    assert 10 <= m["ssd_index_bytes_per_key"] <= 10 / 0.4 + 2
    assert w12["mem"]["size"] == w12["mem"]["capacity"] > 0  # MEM-PS filled its budget
    assert 0 < w12["rss_peak_bytes"] <= (1 << 30)  # the quick run's limit, cgroup or not


def test_w12_quick_runs_inside_its_memory_cgroup(w12):
    if w12["memory_limit"] is None:
        pytest.skip(f"no memory cgroup: {w12['memory_limit_note']}")
    assert w12["memory_cgroup"]["path"]
    assert 0 < w12["cgroup_peak_bytes"] <= w12["memory_limit"]
    assert w12["within_memory_limit"]
    assert w12["oom_kills"] == 0
    for phase in w12["phases"]:
        assert not phase["cgroup"].get("oom_control.oom_kill") and not phase["cgroup"].get("events.oom_kill")
