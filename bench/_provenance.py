"""Where a benchmark's JSON line came from: the commit, the date, the machine and the
command line, so that bench/report.py can say which code and command produced a table.

Python benchmarks add it themselves:

    from _provenance import provenance
    out["provenance"] = provenance()

A native benchmark's line is stamped on its way out (bench/hash_table.sh):

    hash_table_bench --quick | python3 bench/_provenance.py stamp -- bench/hash_table.sh --quick

Fields:
  commit   the checkout's HEAD (40 hex digits), or null outside a git checkout
  dirty    tracked files that differ from HEAD (sorted, at most 20, then "..."): a
           result measured on them was not measured at `commit` alone
  date     UTC, ISO 8601 to the second, when the line was made
  machine  CPU model, logical CPUs, kernel, memory
  command  the command line, run from the repository root
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_DIRTY = 20


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return {"cpu_model": _cpu_model(), "cpus": os.cpu_count(), "kernel": platform.release(), "mem_gib": mem}


def command_line(argv: list[str] | None = None) -> str:
    """`argv` (default sys.argv) as a shell command run from the repository root:
    a script under the root is named by its relative path, after python3."""
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(".py"):
        script = os.path.abspath(argv[0])
        if script.startswith(ROOT + os.sep):
            script = os.path.relpath(script, ROOT)
        argv = ["python3", script, *argv[1:]]
    return shlex.join(argv)


def provenance(argv: list[str] | None = None) -> dict:
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    dirty = None
    if status is not None:
        dirty = sorted(line[3:] for line in status.splitlines() if line.strip())
        if len(dirty) > MAX_DIRTY:
            dirty = dirty[:MAX_DIRTY] + ["..."]
    return {"commit": head.strip() if head else None, "dirty": dirty,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
            "command": command_line(argv)}


def scratch_dir(prefix: str) -> str:
    """A fresh directory under bench/results/ for a run's data (the caller removes it);
    bench/results/ is made first: a fresh clone has none (it is ignored by git)."""
    results = os.path.join(ROOT, "bench", "results")
    os.makedirs(results, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=results)


def save_result(line: str, name: str) -> str:
    """Writes a benchmark's JSON line to bench/results/<name>-<UTC time>.json (where
    `python3 bench/report.py --add` takes it from); returns the path."""
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    path = os.path.join(ROOT, "bench", "results", time.strftime(f"{name}-%Y%m%d-%H%M%S.json", time.gmtime()))
    with open(path, "w") as f:
        f.write(line + "\n")
    return path


def stamp(lines, command: list[str], out=sys.stdout) -> int:
    """Copies `lines` to `out`, adding "provenance" to each JSON object line
    (others pass unchanged); returns the number stamped."""
    stamped = 0
    for line in lines:
        text = line.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                obj["provenance"] = provenance(command)
                line = json.dumps(obj) + "\n"
                stamped += 1
        out.write(line)
    out.flush()
    return stamped


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "stamp" or sys.argv[2] != "--":
        sys.exit("usage: python3 bench/_provenance.py stamp -- COMMAND...  (JSON lines on stdin)")
    sys.exit(0 if stamp(sys.stdin, sys.argv[3:]) else 1)
