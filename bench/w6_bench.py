#!/usr/bin/env python3
"""W6 (BENCHMARKS.md): dense synchronisation over MPI ranks on one machine.

    python3 bench/w6_bench.py --quick          # 2 ranks, 200k examples, k in {1, 10}: ~1-2 minutes
    python3 bench/w6_bench.py                  # the spec: 4 ranks, k in {1, 10, 50, 200}, then scaling
    nice -n 19 flock /tmp/hps-bench.lock python3 bench/w6_bench.py

Each run is ``mpiexec -n N python -m hps.cli train`` (the README's command) over
synthetic Criteo-like data (hps.data.SyntheticCriteo, seed 0; rank r reads blocks
r, r + N, ... of 4096 examples), batches of --batch examples per rank, the
reference CTR model (embeddings of dim 16 by AdaGrad in the parameter server,
MLP 512-256-1 in torch), evaluation on --eval-examples held-out examples after
training. Every run trains the same examples.

Part 1, k-step Adam (4 ranks): dense_sync = "kstep" with k in --ks (Algorithm 2:
local Adam steps with beta1 = 0, x and v averaged every k steps, one last merge
at the end), plus the per-step gradient all-reduce with torch's Adam for
reference. Reported: eval AUC and its difference from k = 1, dense bytes each rank
handed to MPI (payload of each all-reduce), their ratio to k = 1, examples/s.

Part 2, scaling (--scaling, all-reduce): examples/s with 1, 2 and 4 ranks, and
the sparse bytes each rank sends per batch (keys to owners, rows back, gradients).

Prints one line per run and, last, one JSON line with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from _provenance import provenance  # commit, date, machine, command of the JSON line (bench/ is sys.path[0])

TOML = """
hidden = {hidden}
dense_lr = {lr}
torch_threads = {threads}

[ps]
dim = 16
path = "{path}"
mem_budget = "{budget}"

[ps.optimizer]
kind = "adagrad"
lr = 0.05

[data]
batch_size = {batch}
train_examples = {examples}
eval_examples = {eval_examples}

[distributed]
dense_sync = "{sync}"
k = {k}
hierarchical = {hierarchical}
timeout = 600
"""


def run(ranks: int, sync: str, k: int, a, workdir: str) -> dict:
    path = os.path.join(workdir, f"{sync}-k{k}-n{ranks}")
    cfg = os.path.join(workdir, f"{sync}-k{k}-n{ranks}.toml")
    threads = max(1, a.cores // ranks)
    with open(cfg, "w") as f:
        f.write(TOML.format(hidden=list(a.hidden), lr=a.lr, threads=threads, path=path, budget=a.mem_budget,
                            batch=a.batch, examples=a.examples, eval_examples=a.eval_examples, sync=sync, k=k,
                            hierarchical=str(a.hierarchical).lower()))
    cmd = [sys.executable, "-m", "hps.cli", "train", "--config", cfg, "--no-progress"]
    if ranks > 1:
        cmd = [shutil.which("mpiexec") or "mpiexec", "-n", str(ranks)] + cmd
    env = {k_: v for k_, v in os.environ.items() if not k_.startswith(("PMI_", "OMPI_", "PMIX_"))}
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        raise SystemExit(f"w6: {' '.join(cmd)} exited {p.returncode}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    summary_path = os.path.join(path, "rank0" if ranks > 1 else "", "train-summary.json")
    with open(summary_path) as f:
        summary = json.load(f)
    dist = summary.get("distributed")
    per_rank = [r["bytes_sent"] for r in dist["ranks"]] if dist else []
    batches = summary["batches"]
    row = {"ranks": ranks, "dense_sync": sync, "k": k, "auc": out["final"]["auc"],
           "logloss": out["final"]["logloss"], "examples": summary["examples"], "batches": batches,
           "examples_per_s": out["examples_per_s"], "wall_seconds": time.time() - t0,
           "dense_merges": dist["dense_merges"] if dist else 0}
    if per_rank:
        mean = {kind: sum(b[kind] for b in per_rank) / len(per_rank) for kind in per_rank[0]}
        row["dense_bytes_per_rank"] = mean["dense"]
        row["sparse_bytes_per_rank_per_batch"] = {kind: mean[kind] / batches for kind in
                                                  ("sparse_keys", "sparse_rows", "sparse_grads")}
    else:
        row["dense_bytes_per_rank"] = 0
    if not a.keep:
        shutil.rmtree(path, ignore_errors=True)
        os.remove(cfg)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 ranks, 200k examples, k in {1, 10}, no scaling")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 10, 50, 200])
    ap.add_argument("--examples", type=int, help="default 2M (--quick: 200k)")
    ap.add_argument("--eval-examples", type=int, help="default 100k (--quick: 20k)")
    ap.add_argument("--batch", type=int, default=1024, help="examples per rank per batch")
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 256])
    ap.add_argument("--lr", type=float, default=1e-3, help="dense learning rate")
    ap.add_argument("--mem-budget", default="256MiB", help="MEM-PS budget of each rank")
    ap.add_argument("--hierarchical", action="store_true")
    ap.add_argument("--no-scaling", dest="scaling", action="store_false")
    ap.add_argument("--no-allreduce", dest="allreduce", action="store_false",
                    help="skip the gradient all-reduce reference run")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--keep", action="store_true", help="keep the runs' directories")
    ap.add_argument("--workdir")
    a = ap.parse_args()
    if a.quick:
        a.ranks, a.ks, a.scaling, a.hidden = 2, [1, 10], False, [64]
    a.examples = a.examples or (200_000 if a.quick else 2_000_000)
    a.eval_examples = a.eval_examples or (20_000 if a.quick else 100_000)
    if shutil.which("mpiexec") is None:
        raise SystemExit("w6: no mpiexec on PATH; pip install '.[mpi]' (mpi4py and mpich)")
    workdir = a.workdir or tempfile.mkdtemp(prefix="hps-w6-")
    os.makedirs(workdir, exist_ok=True)
    try:
        measure(a, workdir)
    finally:
        if not a.keep and not a.workdir:  # the runs' own are gone: the directory made for them goes too
            shutil.rmtree(workdir, ignore_errors=True)


def measure(a, workdir: str) -> None:
    """Runs the k-step and scaling jobs in workdir and prints their table and JSON line."""
    print(f"w6: {a.ranks} ranks on {a.cores} cores, {a.examples:,} examples, batches of {a.batch} a rank, "
          f"MLP {a.hidden}, in {workdir}", file=sys.stderr)

    kstep = []
    for k in a.ks:
        kstep.append(run(a.ranks, "kstep", k, a, workdir))
    base = next((r for r in kstep if r["k"] == 1), kstep[0])
    for r in kstep:
        r["auc_minus_k1"] = r["auc"] - base["auc"]
        r["dense_bytes_over_k1"] = r["dense_bytes_per_rank"] / base["dense_bytes_per_rank"] \
            if base["dense_bytes_per_rank"] else None
    runs = list(kstep)
    if a.allreduce:
        ar = run(a.ranks, "allreduce", 1, a, workdir)
        ar["auc_minus_k1"] = ar["auc"] - base["auc"]
        ar["dense_bytes_over_k1"] = ar["dense_bytes_per_rank"] / base["dense_bytes_per_rank"]
        runs.append(ar)
    print(f"{'dense sync':<22}{'AUC':>8}{'- k=1':>9}{'dense MB/rank':>15}{'/ k=1':>8}{'merges':>8}{'ex/s':>10}")
    for r in runs:
        name = f"k-step Adam, k = {r['k']}" if r["dense_sync"] == "kstep" else "grad all-reduce, Adam"
        print(f"{name:<22}{r['auc']:>8.4f}{r['auc_minus_k1']:>+9.4f}{r['dense_bytes_per_rank'] / 1e6:>15.1f}"
              f"{r['dense_bytes_over_k1']:>8.3f}{r['dense_merges']:>8}{r['examples_per_s']:>10,.0f}")

    scaling = []
    if a.scaling:
        for n in (1, 2, 4):
            scaling.append(run(n, "allreduce", 1, a, workdir))
        one = scaling[0]["examples_per_s"]
        print(f"\n{'ranks':<8}{'ex/s':>10}{'vs 1':>7}{'AUC':>8}  sparse bytes/batch per rank (keys, rows, grads)")
        for r in scaling:
            sp = r.get("sparse_bytes_per_rank_per_batch")
            sparse = ", ".join(f"{v / 1e3:,.0f} kB" for v in sp.values()) if sp else "-"
            print(f"{r['ranks']:<8}{r['examples_per_s']:>10,.0f}{r['examples_per_s'] / one:>7.2f}"
                  f"{r['auc']:>8.4f}  {sparse}")
    print(json.dumps({"bench": "w6", "benchmark": "W6 distributed", "quick": a.quick,
                      "provenance": provenance(), "ranks": a.ranks, "cores": a.cores, "examples": a.examples,
                      "batch_per_rank": a.batch, "hidden": a.hidden, "kstep": runs, "scaling": scaling}))


if __name__ == "__main__":
    main()
