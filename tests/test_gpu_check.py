"""bench/gpu_check.sh and its table benchmark, on a machine without a GPU (CI's)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    run = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return run.returncode == 0 and run.stdout.strip() != ""


@pytest.mark.skipif(_has_nvidia_gpu(), reason="a GPU is present: bench/gpu_check.sh would build and run everything")
def test_gpu_check_without_a_gpu_says_so_and_succeeds(tmp_path):
    run = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh")], capture_output=True, text=True,
                         env={**os.environ, "OUT": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert "no NVIDIA GPU" in run.stdout
    assert not (tmp_path / "gpu_check").exists()  # nothing built, nothing written


def test_table_bench_quick_checks_its_results_and_reports_each_op(tmp_path):
    out = tmp_path / "gpu_table.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_table_bench.py"), "--quick",
                          "--keys", "20000", "--device", "none", "--out", str(out)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr
    line = json.loads(out.read_text())
    assert line["devices"] == ["cpu"] and line["keys"] == 20000
    cpu = line["widths"]["16"]["cpu"]
    assert set(cpu) == {"insert", "find_hit", "find_mix", "accumulate"}
    for op, fig in cpu.items():
        assert fig["mops"]["min"] <= fig["mops"]["median"] <= fig["mops"]["max"], op
        assert abs(fig["seconds"]["median"] * fig["mops"]["median"] * 1e6 - 20000) < 1, op
    assert "gpu_table_bench.py" in line["provenance"]["command"]


def test_table_bench_bytes_per_op_follow_the_row_width():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import gpu_table_bench
    finally:
        sys.path.pop(0)
    for op in ("insert", "find_hit", "find_mix", "accumulate"):
        link16, mem16 = gpu_table_bench.bytes_moved(op, 1000, 16)
        link64, mem64 = gpu_table_bench.bytes_moved(op, 1000, 64)
        assert link64 - link16 == 1000 * 4 * 48  # one row of 48 more floats crosses the host link
        assert mem64 > mem16 > 1000 * 8
    with pytest.raises(ValueError):
        gpu_table_bench.bytes_moved("erase", 1, 16)
