"""`hps size` against a real run: its estimates beside what `hps train` measured.

    python3 bench/size_check.py            # 600k synthetic examples, sample 200k (~1 min on 2 cores)
    python3 bench/size_check.py --quick    # 40k examples, sample 10k (seconds; the tests run it)
    python3 bench/size_check.py --mem-budget 8MiB --checkpoint-every 10   # more evictions, compactions

The run: synthetic Criteo-like data (26 fields), dim 16 with AdaGrad (128-byte rows), a
MEM-PS budget far below the rows the run touches (so rows go to SSD-PS and back), a
checkpoint (an SSD-PS commit) every `checkpoint_every` batches, no held-out data (an
evaluation's pulls would count in the hit rate), `eval_every = 1` so that
train-summary.json's history has SSD-PS disk use after every batch.

It runs `hps size --config C --json` (the estimate from the sample), then `hps train
--config C`, and compares, each with its relative error (estimate - measured) / measured:
- rows stored: the distinct keys estimated vs SSD-PS's live records at the end;
- MEM-PS capacity: the rows the budget holds vs the run's cache capacity;
- MEM-PS hit rate: the estimate vs the run's hits / (hits + misses) (the prefetch's
  pins, one lookup per distinct key a batch);
- SSD-PS index memory: the estimate (at the estimated rows, and at the measured rows) vs
  the store's index_bytes;
- SSD-PS disk: the worst before a commit vs the largest disk use after any batch; the
  live estimate vs the store at the end (after its last commit's compaction);
- MEM-PS memory per cached row: what the budget charges (row + bookkeeping) vs the
  resident memory of an hps.MemCache of the run's capacity and policy, filled (RSS).
It also gives the hit rate estimated from a sample of the whole run (no extrapolation),
which separates the replay's error from the extrapolation's.

Prints a table on stderr and one JSON line on stdout (also written to
bench/results/size-check-DATE.json unless --no-save or --quick).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _provenance import ROOT, provenance  # noqa: E402

FULL = {"train_examples": 600_000, "batch_size": 4096, "mem_budget": "24MiB", "sample": 200_000,
        "checkpoint_every": 40}
QUICK = {"train_examples": 40_000, "batch_size": 512, "mem_budget": "3MiB", "sample": 10_000,
         "checkpoint_every": 10}

CONFIG = """\
hidden = [64, 32]
eval_every = 1
checkpoint_every = {checkpoint_every}
torch_threads = 1

[ps]
dim = 16
path = "{path}"
mem_budget = "{mem_budget}"

[ps.optimizer]
kind = "adagrad"
lr = 0.05

[data]
source = "synthetic"
batch_size = {batch_size}
train_examples = {train_examples}
eval_examples = 0
"""


def hps(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "hps.cli", *args], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"size_check: hps {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


RSS_PROBE = """
import sys, numpy as np, hps
row_bytes, capacity, policy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
def loader(keys):
    return np.ones((len(keys), row_bytes), np.uint8), np.zeros(len(keys), np.uint8)
keys = np.arange(1, 2 * capacity + 1, dtype=np.uint64)  # twice the capacity: the shards fill unevenly
before = rss()
cache = hps.MemCache(row_bytes, capacity, policy=policy, loader=loader)
for start in range(0, len(keys), 4096):
    cache.pin(keys[start:start + 4096])
    cache.unpin(keys[start:start + 4096])
assert cache.stats()["size"] == capacity
print((rss() - before) / capacity)
"""


def mem_cache_rss_per_row(row_bytes: int, capacity: int, policy: str) -> float:
    """Resident bytes per row of an hps.MemCache of `capacity` rows, filled by pinning
    and unpinning batches of new keys (as a run's prefetch and write-back do) until
    every shard is full; in a fresh process, so that no memory freed earlier is
    reused unseen."""
    done = subprocess.run([sys.executable, "-c", RSS_PROBE, str(row_bytes), str(capacity), policy],
                          capture_output=True, text=True, timeout=300, check=True)
    return float(done.stdout)


def job_disk(path: str) -> dict:
    """Bytes of the live store's parameter files, and of the whole job directory
    (each inode once: a checkpoint links the store's files)."""
    seen, total, store = set(), 0, 0
    for root, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
            if os.path.relpath(root, path) == "ssd" and name.endswith(".hpf"):
                store += st.st_size
    return {"store_bytes": store, "job_dir_bytes": total}


def rel(est, measured):
    return None if est is None or not measured else (est - measured) / measured


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a run of seconds (what the tests run)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/size-check-DATE.json")
    ap.add_argument("--keep", metavar="DIR", help="run in DIR (new or empty) and keep it; default: a temporary one")
    ap.add_argument("--mem-budget", help="MEM-PS budget instead of the mode's (24MiB; --quick 3MiB)")
    ap.add_argument("--checkpoint-every", type=int, metavar="N",
                    help="batches between checkpoints (SSD-PS commits) instead of the mode's (40; --quick 10)")
    a = ap.parse_args()
    p = dict(QUICK if a.quick else FULL)
    if a.mem_budget:
        p["mem_budget"] = a.mem_budget
    if a.checkpoint_every is not None:
        p["checkpoint_every"] = a.checkpoint_every
    work = a.keep or tempfile.mkdtemp(prefix="hps-size-check-")
    os.makedirs(work, exist_ok=True)
    job = os.path.join(work, "job")
    config = os.path.join(work, "size-check.toml")
    with open(config, "w") as f:
        f.write(CONFIG.format(path=job, **{k: v for k, v in p.items() if k != "sample"}))

    t0 = time.time()
    est = json.loads(hps("size", "--config", config, "--sample", str(p["sample"]), "--json").stdout)
    t_size = time.time() - t0
    from hps import sizing
    from hps.train import TrainConfig
    whole = sizing.estimate(TrainConfig.from_toml(config), sample=p["train_examples"])  # no extrapolation

    t0 = time.time()
    hps("train", "--config", config, "--no-progress")
    t_train = time.time() - t0
    with open(os.path.join(job, "train-summary.json")) as f:
        summary = json.load(f)
    mem, ssd = summary["ps"]["mem"], summary["ps"]["ssd"]
    measured_rows = ssd["live_records"]
    peak_disk = max(h["ssd_disk_bytes"] for h in summary["history"])
    disk = job_disk(job)
    row_bytes = est["mem"]["row_bytes"]
    rss_per_row = mem_cache_rss_per_row(row_bytes, mem["capacity"], est["mem"]["policy"])

    e_mem, e_ssd, e_hit = est["mem"], est["ssd"], est["hit"]
    hit_measured = mem["hits"] / max(1, mem["hits"] + mem["misses"])
    quantities = [
        ("rows stored (distinct keys)", est["run"]["rows"], measured_rows),
        ("MEM-PS capacity (rows)", e_mem["capacity_rows"], mem["capacity"]),
        ("MEM-PS hit rate", e_hit["hit_rate"], hit_measured),
        ("MEM-PS hit rate, sample = whole run", whole["hit"]["hit_rate"], hit_measured),
        ("SSD-PS index bytes", e_ssd["index_bytes"], ssd["index_bytes"]),
        ("SSD-PS index bytes at the measured rows", sizing.ssd_index_bytes(measured_rows), ssd["index_bytes"]),
        ("SSD-PS disk, worst before a commit (vs the peak)", e_ssd["disk_worst_bytes"], peak_disk),
        ("MEM-PS bytes per cached row (budget vs RSS)", e_mem["bytes_per_row"], rss_per_row),
    ]
    # The store at the end carries the stale records its last compaction left: between
    # live and trigger x live (the compaction aims halfway), so a bound, not an error.
    live_measured_rows = sizing.ssd_disk_bytes(measured_rows, row_bytes, e_ssd["file_records"])
    end = {"store_bytes": disk["store_bytes"], "live_estimate": e_ssd["disk_live_bytes"],
           "live_at_measured_rows": live_measured_rows, "over_live": disk["store_bytes"] / live_measured_rows,
           "within_trigger": live_measured_rows <= disk["store_bytes"] <= e_ssd["compaction_trigger"] *
           live_measured_rows}
    out = {"bench": "size_check", "quick": a.quick, "params": p, "size_seconds": t_size, "train_seconds": t_train,
           "quantities": [{"name": n, "estimate": e, "measured": m, "relative_error": rel(e, m)}
                          for n, e, m in quantities],
           "estimate": est, "measured": {"rows": measured_rows, "mem": mem, "ssd": ssd, "peak_disk_bytes": peak_disk,
                                         "disk": disk, "hit_rate": hit_measured, "rss_bytes_per_row": rss_per_row,
                                         "examples": summary["examples"], "batches": summary["batches"]},
           "disk_at_end": end, "whole_run_hit": whole["hit"], "provenance": provenance()}
    width = max(len(n) for n, _, _ in quantities)
    print(f"size_check: {p['train_examples']:,} examples, budget {p['mem_budget']}, sample {p['sample']:,}; "
          f"hps size {t_size:.1f} s, hps train {t_train:.1f} s", file=sys.stderr)
    print(f"  {'quantity':<{width}}  {'estimate':>14}  {'measured':>14}  {'error':>7}", file=sys.stderr)
    for n, e, m in quantities:
        fmt = (lambda v: f"{v:.4f}") if isinstance(m, float) and m < 1 else (lambda v: f"{v:,.0f}")
        r = rel(e, m)
        print(f"  {n:<{width}}  {fmt(e) if e is not None else '-':>14}  {fmt(m):>14}  "
              f"{'-' if r is None else f'{100 * r:+.1f}%':>7}", file=sys.stderr)
    print(f"  SSD-PS store at the end: {disk['store_bytes']:,} bytes, {end['over_live']:.2f} x the live size of its "
          f"{measured_rows:,} rows ({live_measured_rows:,}); the trigger is {e_ssd['compaction_trigger']:g} x; "
          f"the job directory, checkpoint links included: {disk['job_dir_bytes']:,} bytes", file=sys.stderr)
    line = json.dumps(out)
    print(line)
    if not (a.no_save or a.quick):
        os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
        name = os.path.join(ROOT, "bench", "results", f"size-check-{time.strftime('%Y%m%d-%H%M%S')}.json")
        with open(name, "w") as f:
            f.write(line + "\n")
        print(f"  written to {os.path.relpath(name, ROOT)}", file=sys.stderr)
    if not a.keep:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
