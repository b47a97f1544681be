#!/usr/bin/env python3
"""W7 in the system (issue 16): `hps train` on 8 host-partition devices, the sequential
schedule against Herald's, side by side in one run.

    python3 bench/herald_system.py            # 400k synthetic examples, 3 rounds; 8 devices, then 4 ranks
    python3 bench/herald_system.py --quick    # a few batches, 1 round, 2 ranks (the test's)

Both sides train the same batches (the Criteo-like generator, hps.data.SyntheticCriteo,
held in memory) through hps.train.train with [ps] devices = 8:
  sequential  schedule = "sequential": every batch's rows are loaded from MEM-PS onto
              the device tier (each key on the device its hash picks), pulled and
              pushed there by the devices that train its examples (examples split
              in order), and written back; the tier is emptied.
  herald      schedule = "herald" (hps.worker_caches): each device keeps up to
              --cache-fraction of the run's distinct keys between batches; examples go
              to the devices that hold their rows; rows a device lacks come from the
              peer that holds them or from MEM-PS.

Counted (the same batches, so the same on every round; the figures are the last round's):
  MEM-PS -> devices   rows loaded onto devices: sequential, every batch's distinct keys;
                      herald, the rows no cache held (ps_loads)
  devices -> MEM-PS   rows written back: sequential, every batch's distinct keys (each
                      got a gradient); herald, rows evicted from their last cache
                      trained since their last write (the others, the same as
                      below, are dropped unwritten: evict_clean_dropped), and the
                      rows the caches' flushes before each evaluation and
                      checkpoint write (those trained since their last write)
  between devices     rows and bytes of the transfer matrix off its diagonal: embeddings
                      pulled and gradients pushed (dim floats a row), and for herald the
                      whole rows (embedding and optimizer state) of peer fetches and
                      replica copies; and by device, the rows each sends and receives
                      (the matrix's rows and columns, the whole matrix in the JSON)
and timed: examples/s, median (min-max) over --rounds rounds, the two schedules
interleaved (A B, then B A, ...); eval AUC, which must agree within 0.001.

Then the same under `mpiexec -n --ranks` (hps.distributed; each rank a worker, one
device each; the global batch is --batch examples a rank): bytes between ranks by kind
(examples, keys, rows, gradients, Herald's plan parts from its leader rank, dense),
summed over ranks and by rank, and examples/s (the
slowest rank's), the schedules interleaved the same way. On this 2-core machine the
ranks share the cores, so examples/s there measures the work, not a cluster.

Prints a table and one JSON line (also written to bench/results/herald-system-*.json);
`python3 bench/report.py --add FILE` files it under docs/results/w7s.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import numpy as np

from _provenance import provenance, save_result  # bench/ is sys.path[0]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = ("sequential", "herald")


def run_one(schedule: str, batches, eval_batches, a, cache_rows: int, path: str) -> dict:
    from hps.train import TrainConfig, train
    cfg = TrainConfig.from_dict({
        "hidden": a.hidden, "dense_lr": 0.001, "torch_threads": a.torch_threads, "seed": 0,
        "eval_every": a.eval_every, "checkpoint_every": 0,
        "ps": {"dim": a.dim, "path": path, "mem_budget": "1GiB", "devices": a.devices, "schedule": schedule,
               "worker_cache_rows": cache_rows, "optimizer": {"kind": "adagrad", "lr": 0.05}},
        "data": {"batch_size": a.batch}}, source="herald_system")
    s = train(cfg, progress=False, train_batches=batches, eval_batches=eval_batches)
    dev = s["ps"]["device"]
    rows, moved = np.array(dev["transfer_rows"], np.int64), np.array(dev["transfer_bytes"], np.int64)
    off = ~np.eye(len(rows), dtype=bool)
    between = rows * off  # the matrix off its diagonal (a row: from, a column: to)
    out = {"schedule": schedule, "examples": s["examples"], "examples_per_s": s["examples_per_s"],
           "auc": s["final"].get("auc"), "logloss": s["final"].get("logloss"),
           "between_devices_rows": int(rows[off].sum()), "between_devices_bytes": int(moved[off].sum()),
           "device_out_rows": between.sum(axis=1).tolist(), "device_in_rows": between.sum(axis=0).tolist(),
           "transfer_rows": rows.tolist()}
    if "herald" in dev:
        h = dev["herald"]
        whole = np.array(h["moved_rows"], np.int64)
        out.update(mem_to_devices=h["ps_loads"], devices_to_mem=h["evict_pushes"] + h["flushed_rows"],
                   whole_rows_between_devices=int(whole.sum()), herald={k: v for k, v in h.items()
                                                                     if k not in ("moved_rows",)})
    return out


def mpi_rank(a) -> None:
    """One rank of `mpiexec -n N herald_system.py --mpi-rank SCHEDULE OUT`: trains its
    share; rank 0 writes the job's figures to OUT."""
    from hps.data import SyntheticCriteo
    from hps.distributed import Node
    from hps.train import TrainConfig, train
    node = Node()
    schedule, out = a.mpi_rank
    mine = list(SyntheticCriteo(seed=0, batch_size=a.batch, examples=a.examples * node.size,
                                rank=node.rank, world=node.size))
    ev = list(SyntheticCriteo(seed=0, batch_size=a.batch, examples=a.eval_examples, part="eval"))
    cfg = TrainConfig.from_dict({
        "hidden": a.hidden, "dense_lr": 0.001, "torch_threads": 1, "seed": 0, "eval_every": 0,
        "checkpoint_every": 0,
        "ps": {"dim": a.dim, "path": os.path.join(os.path.dirname(out), f"job-{schedule}"), "mem_budget": "512MiB",
               "devices": 1, "schedule": schedule, "worker_cache_rows": a.cache_rows,
               "optimizer": {"kind": "adagrad", "lr": 0.05}},
        "data": {"batch_size": a.batch}}, source="herald_system")
    s = train(cfg, progress=False, train_batches=mine, eval_batches=ev, node=node)
    if node.rank == 0:
        ranks = s["distributed"]["ranks"]
        sent = {k: sum(r["bytes_sent"][k] for r in ranks) for k in ranks[0]["bytes_sent"]}
        by_rank = [{k: v for k, v in r["bytes_sent"].items() if v} for r in ranks]
        with open(out, "w") as f:
            json.dump({"schedule": schedule, "examples": s["examples"], "examples_per_s": s["examples_per_s"],
                       "auc": s["final"].get("auc"), "bytes_sent": sent, "bytes_sent_by_rank": by_rank,
                       "fresh_rows_sent_as_bits": sum(r["fresh_rows_sent_as_bits"] for r in ranks),
                       "herald": s["ps"].get("herald")}, f)


def run_mpi(schedule: str, a, cache_rows: int, tmp: str, r: int) -> dict:
    import subprocess
    out = os.path.join(tmp, f"mpi-{schedule}-{r}", "result.json")
    os.makedirs(os.path.dirname(out))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    cmd = ["mpiexec", "-n", str(a.ranks), sys.executable, os.path.abspath(__file__), "--mpi-rank", schedule, out,
           "--examples", str(a.examples // a.ranks), "--eval-examples", str(a.eval_examples), "--batch",
           str(a.batch // a.ranks), "--dim", str(a.dim), "--cache-rows", str(cache_rows)]
    if a.quick:
        cmd.append("--quick-model")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few batches, one round (for the tests)")
    ap.add_argument("--examples", type=int, default=400_000, help="training examples a run")
    ap.add_argument("--eval-examples", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--cache-fraction", type=float, default=0.1,
                    help="each device's cache, as a fraction of the run's distinct keys (the paper's 10%%)")
    ap.add_argument("--eval-every", type=int, default=0, help="batches between evaluations (0: at the end)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=4, help="ranks of the MPI part (0: skip it)")
    ap.add_argument("--no-save", action="store_true", help="print only; do not write bench/results/")
    ap.add_argument("--mpi-rank", nargs=2, metavar=("SCHEDULE", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--cache-rows", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--quick-model", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.mpi_rank:
        a.hidden = [16] if a.quick_model else [512, 256]
        mpi_rank(a)
        return 0
    if min(a.examples, a.eval_examples, a.batch, a.devices, a.dim, a.rounds) < 1 or not 0 < a.cache_fraction <= 1:
        print("herald_system: counts must be >= 1 and --cache-fraction in (0, 1]", file=sys.stderr)
        return 2
    a.hidden = [512, 256]
    if a.quick:
        a.examples, a.eval_examples, a.batch, a.dim, a.rounds, a.hidden = 8192, 2048, 1024, 4, 1, [16]
        a.ranks = min(a.ranks, 2)
    from hps.data import SyntheticCriteo
    batches = list(SyntheticCriteo(seed=0, batch_size=a.batch, examples=a.examples))
    eval_batches = list(SyntheticCriteo(seed=0, batch_size=a.batch, examples=a.eval_examples, part="eval"))
    distinct = len(np.unique(np.concatenate([b.keys.ravel() for b in batches])))
    batch_distinct = sum(len(np.unique(b.keys)) for b in batches)
    cache_rows = max(1, int(a.cache_fraction * distinct))
    print(f"herald_system: {a.examples:,} examples in batches of {a.batch}, {distinct:,} distinct keys, "
          f"{a.devices} devices, caches of {cache_rows:,} rows", file=sys.stderr)
    runs = {s: [] for s in SCHEDULES}
    with tempfile.TemporaryDirectory(prefix="hps-herald-system-") as tmp:
        for r in range(a.rounds):
            order = SCHEDULES if r % 2 == 0 else SCHEDULES[::-1]
            for s in order:
                got = run_one(s, batches, eval_batches, a, cache_rows, os.path.join(tmp, f"{s}{r}"))
                runs[s].append(got)
                print(f"herald_system: round {r + 1} {s}: {got['examples_per_s']:,.0f} ex/s, AUC {got['auc']:.4f}",
                      file=sys.stderr)
        mpi_runs = {s: [] for s in SCHEDULES}
        for r in range(a.rounds if a.ranks else 0):
            order = SCHEDULES if r % 2 == 0 else SCHEDULES[::-1]
            for s in order:
                got = run_mpi(s, a, cache_rows, tmp, r)
                mpi_runs[s].append(got)
                print(f"herald_system: mpiexec -n {a.ranks} round {r + 1} {s}: {got['examples_per_s']:,.0f} ex/s, "
                      f"AUC {got['auc']:.4f}, {sum(got['bytes_sent'].values()) / 1e6:,.1f} MB between ranks",
                      file=sys.stderr)
    result = {}
    for s in SCHEDULES:
        last = dict(runs[s][-1])
        rates = [x["examples_per_s"] for x in runs[s]]
        last.update(examples_per_s=statistics.median(rates), examples_per_s_min=min(rates),
                    examples_per_s_max=max(rates), aucs=[x["auc"] for x in runs[s]])
        if s == "sequential":
            last.update(mem_to_devices=batch_distinct, devices_to_mem=batch_distinct)
        result[s] = last
    seq, her = result["sequential"], result["herald"]
    print(f"\n{'':28}{'sequential':>16}{'herald':>16}{'herald / seq':>14}", file=sys.stderr)
    for name, key in (("MEM-PS -> devices (rows)", "mem_to_devices"), ("devices -> MEM-PS (rows)", "devices_to_mem"),
                      ("between devices (rows)", "between_devices_rows"),
                      ("between devices (MB)", "between_devices_bytes"), ("examples/s", "examples_per_s"),
                      ("AUC", "auc")):
        x, y = seq[key], her[key]
        if key == "between_devices_bytes":
            x, y = x / 1e6, y / 1e6
        fmt = ".4f" if key == "auc" else ",.1f" if key == "between_devices_bytes" else ",.0f"
        print(f"{name:28}{x:>16{fmt}}{y:>16{fmt}}{(y / x if x else float('nan')):>14.3f}", file=sys.stderr)
    mpi = {}
    if a.ranks:
        for s in SCHEDULES:
            last = dict(mpi_runs[s][-1])
            rates = [x["examples_per_s"] for x in mpi_runs[s]]
            last.update(examples_per_s=statistics.median(rates), examples_per_s_min=min(rates),
                        examples_per_s_max=max(rates), aucs=[x["auc"] for x in mpi_runs[s]])
            mpi[s] = last
        ms, mh = mpi["sequential"], mpi["herald"]
        print(f"\nmpiexec -n {a.ranks}, bytes between ranks (MB){'sequential':>12}{'herald':>12}", file=sys.stderr)
        for kind in ms["bytes_sent"]:
            print(f"  {kind:<40}{ms['bytes_sent'][kind] / 1e6:>12,.2f}{mh['bytes_sent'][kind] / 1e6:>12,.2f}",
                  file=sys.stderr)
        print(f"  {'rows never trained, sent as a bit':<40}{ms['fresh_rows_sent_as_bits']:>12,}"
              f"{mh['fresh_rows_sent_as_bits']:>12,}", file=sys.stderr)
        print(f"  {'examples/s':<40}{ms['examples_per_s']:>12,.0f}{mh['examples_per_s']:>12,.0f}", file=sys.stderr)
        print(f"  {'AUC':<40}{ms['auc']:>12.4f}{mh['auc']:>12.4f}", file=sys.stderr)
    out = {"bench": "w7s", "benchmark": "W7s Herald in the system", "quick": a.quick,
           "config": {"examples": a.examples, "eval_examples": a.eval_examples, "batch_size": a.batch,
                      "devices": a.devices, "dim": a.dim, "mlp": a.hidden, "sparse_optimizer": "adagrad lr 0.05",
                      "cache_fraction": a.cache_fraction, "cache_rows": cache_rows, "distinct_keys": distinct,
                      "batch_distinct_keys": batch_distinct, "eval_every": a.eval_every, "rounds": a.rounds,
                      "torch_threads": a.torch_threads, "data": "hps.data.SyntheticCriteo(seed=0)"},
           "results": result, "auc_difference": abs(seq["auc"] - her["auc"]),
           "mpi": ({"ranks": a.ranks, "batch_per_rank": a.batch // a.ranks, "results": mpi,
                    "auc_difference": abs(mpi["sequential"]["auc"] - mpi["herald"]["auc"])} if mpi else None)}
    out["provenance"] = provenance()
    line = json.dumps(out)
    print(line)
    if not a.no_save and not a.quick:
        path = save_result(line, "herald-system")
        print(f"herald_system: wrote {os.path.relpath(path, ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
