#!/usr/bin/env python3
"""W7 in the system (issue 16): `hps train` on 8 host-partition devices, the sequential
schedule against Herald's, side by side in one run.

    python3 bench/herald_system.py            # 400k synthetic examples, 3 rounds
    python3 bench/herald_system.py --quick    # a few batches, 1 round (the test's)

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
                      got a gradient); herald, rows evicted from their last cache and
                      the caches' flushes before each evaluation and checkpoint
  between devices     rows and bytes of the transfer matrix off its diagonal: embeddings
                      pulled and gradients pushed (dim floats a row), and for herald the
                      whole rows (embedding and optimizer state) of peer fetches and
                      replica copies
and timed: examples/s, median (min-max) over --rounds rounds, the two schedules
interleaved (A B, then B A, ...); eval AUC, which must agree within 0.001.

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
    out = {"schedule": schedule, "examples": s["examples"], "examples_per_s": s["examples_per_s"],
           "auc": s["final"].get("auc"), "logloss": s["final"].get("logloss"),
           "between_devices_rows": int(rows[off].sum()), "between_devices_bytes": int(moved[off].sum()),
           "transfer_rows": rows.tolist()}
    if "herald" in dev:
        h = dev["herald"]
        whole = np.array(h["moved_rows"], np.int64)
        out.update(mem_to_devices=h["ps_loads"], devices_to_mem=h["evict_pushes"] + h["flushed_rows"],
                   whole_rows_between_devices=int(whole.sum()), herald={k: v for k, v in h.items()
                                                                     if k not in ("moved_rows",)})
    return out


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
    ap.add_argument("--no-save", action="store_true", help="print only; do not write bench/results/")
    a = ap.parse_args(argv)
    if min(a.examples, a.eval_examples, a.batch, a.devices, a.dim, a.rounds) < 1 or not 0 < a.cache_fraction <= 1:
        print("herald_system: counts must be >= 1 and --cache-fraction in (0, 1]", file=sys.stderr)
        return 2
    a.hidden = [512, 256]
    if a.quick:
        a.examples, a.eval_examples, a.batch, a.dim, a.rounds, a.hidden = 8192, 2048, 1024, 4, 1, [16]
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
    out = {"bench": "w7s", "benchmark": "W7s Herald in the system", "quick": a.quick,
           "config": {"examples": a.examples, "eval_examples": a.eval_examples, "batch_size": a.batch,
                      "devices": a.devices, "dim": a.dim, "mlp": a.hidden, "sparse_optimizer": "adagrad lr 0.05",
                      "cache_fraction": a.cache_fraction, "cache_rows": cache_rows, "distinct_keys": distinct,
                      "batch_distinct_keys": batch_distinct, "eval_every": a.eval_every, "rounds": a.rounds,
                      "torch_threads": a.torch_threads, "data": "hps.data.SyntheticCriteo(seed=0)"},
           "results": result, "auc_difference": abs(seq["auc"] - her["auc"])}
    out["provenance"] = provenance()
    line = json.dumps(out)
    print(line)
    if not a.no_save and not a.quick:
        path = save_result(line, "herald-system")
        print(f"herald_system: wrote {os.path.relpath(path, ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
