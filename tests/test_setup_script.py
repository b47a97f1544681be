"""bench/setup.sh, which the README's two commands source: the Python they install
into. A Python pip may install into is used as it is; one whose distribution
manages its packages (PEP 668, Debian 12's /usr/bin/python3) gets a virtual
environment, made once, named, and reused."""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def choose(python, venv):
    """(PY, stderr) after `choose_python` with PYTHON=python and HPS_VENV=venv."""
    env = dict(os.environ, PYTHON=python, HPS_VENV=str(venv))
    p = subprocess.run(["bash", "-c", 'set -euo pipefail; source bench/setup.sh; choose_python; echo "$PY"'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip(), p.stderr


def managed_python():
    """A Python that refuses pip (an EXTERNALLY-MANAGED marker) and can make a
    virtual environment with its headers present, so no apt-get runs; or None."""
    for candidate in ("/usr/bin/python3", shutil.which("python3") or ""):
        if not candidate or not os.path.exists(candidate):
            continue
        probe = subprocess.run(
            [candidate, "-c", "import ensurepip, os, sys, sysconfig; "
                              "m = os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')); "
                              "h = os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')); "
                              "print(m and h and sys.prefix == sys.base_prefix)"],
            capture_output=True, text=True)
        if probe.stdout.strip() == "True":
            return candidate
    return None


def test_a_python_pip_may_install_into_is_used_as_it_is(tmp_path):
    if sys.prefix == sys.base_prefix and os.path.exists(
            os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")):
        pytest.skip("this interpreter refuses pip itself (PEP 668)")
    py, err = choose(sys.executable, tmp_path / "venv")
    assert py == sys.executable
    assert not (tmp_path / "venv").exists()
    assert "setup: Python" in err


def test_a_managed_python_gets_a_virtual_environment_made_once(tmp_path):
    base = managed_python()
    if base is None:
        pytest.skip("no Python here refuses pip (PEP 668) with venv and its headers installed")
    venv = tmp_path / "venv"
    py, err = choose(base, venv)
    assert py == str(venv / "bin" / "python")
    assert f"using the virtual environment {venv} (remove it with: rm -rf {venv})" in err
    prefix = subprocess.run([py, "-c", "import sys; print(sys.prefix, sys.base_prefix)"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert prefix[0] == str(venv) and prefix[1] != str(venv)
    # pip works there, which it does not for the base interpreter.
    assert subprocess.run([py, "-m", "pip", "--version"], capture_output=True).returncode == 0
    made = (venv / "pyvenv.cfg").stat().st_mtime_ns
    again, _ = choose(base, venv)
    assert again == py and (venv / "pyvenv.cfg").stat().st_mtime_ns == made  # reused, not made anew


def test_a_missing_interpreter_is_named(tmp_path):
    env = dict(os.environ, PYTHON=str(tmp_path / "no-python"))
    p = subprocess.run(["bash", "-c", "set -euo pipefail; source bench/setup.sh; choose_python"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert f"no Python at '{tmp_path / 'no-python'}' (PYTHON)" in p.stderr


def test_the_main_job_runs_at_a_small_size(tmp_path):
    """The README's main command, bench/demo.sh, end to end at a small size: it finds what it
    needs installed (the test command installed it), trains through all three tiers, prints
    its summary and JSON line, names its folder and writes the plots."""
    pytest.importorskip("torch", reason="the demo trains with torch")
    pytest.importorskip("matplotlib", reason="the demo writes plots")
    env = dict(os.environ, PYTHON=sys.executable)
    p = subprocess.run(["bash", "bench/demo.sh", "--path", str(tmp_path / "demo"), "--examples", "30000",
                        "--eval-examples", "4096", "--batch-size", "1024", "--mem-budget", "3MiB",
                        "--eval-every", "10", "--no-progress"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = __import__("json").loads(p.stdout.strip().splitlines()[-1])
    assert line["final"]["examples"] == 30000 and 0.5 < line["final"]["auc"] <= 1.0
    assert line["final"]["ssd_bytes_written"] > 0  # the budget sent rows to SSD-PS
    assert f"demo folder                     {tmp_path / 'demo'} (remove it with: rm -rf {tmp_path / 'demo'})" \
        in p.stderr
    names = sorted(os.path.basename(f) for f in line["report"])
    assert names == ["auc.png", "hit_rate.png", "ssd_traffic.png", "stages.png", "throughput.png"]
