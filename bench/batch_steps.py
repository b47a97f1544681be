#!/usr/bin/env python3
"""Milliseconds per step of the parameter server's batch path, one step at a time
(no pipeline, no other threads), in the pipeline's overlapped order: batch i+1 is
loaded before batch i applies, so each batch catches up with the one before.

    python3 bench/batch_steps.py                 # W4's batches: 4096 synthetic examples, dim 16, AdaGrad
    python3 bench/batch_steps.py --batches 200

Steps, as hps.torch runs them on the train stage's critical path for one device,
through the batch protocol (hps.parameter_server.WorkingBatch): positions (of the
batch's keys), gather (one row per example), accumulate (gradients per example,
summed per key), apply (the optimizer step). By default the batch is a host batch on
MEM-PS's pinned rows (positions are known from the prefetch); with --device-tier a
device table holds a copy of the rows (the native working set: gather also takes the
previous batch's updated rows, apply also reads the updated rows back). The first
10 batches are not counted. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np

import hps
from hps.data import SyntheticCriteo

STEPS = ("positions", "gather", "accumulate", "apply", "write_back")


def run_steps(current, keys, devices):
    """Each step over every worker's share of the examples (consecutive, as the
    sequential schedule gives them); seconds a step."""
    shares = np.array_split(keys, devices)  # keys: (examples, fields)
    spent = dict.fromkeys(STEPS, 0.0)
    at, rows = [], []
    t0 = time.perf_counter()
    for share in shares:
        at.append(current.positions(np.ascontiguousarray(share).reshape(-1)))
    t1 = time.perf_counter()
    for worker, a in enumerate(at):
        rows.append(current.gather(a, worker=worker))
    t2 = time.perf_counter()
    for worker, (a, r) in enumerate(zip(at, rows)):
        current.accumulate(a, np.ones_like(r), worker=worker)
    t3 = time.perf_counter()
    current.apply()
    t4 = time.perf_counter()
    current.write_back()
    t5 = time.perf_counter()
    for step, (a0, a1) in zip(STEPS, zip((t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5))):
        spent[step] = a1 - a0
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=70)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--device-tier", action="store_true", help="copy rows through a device table")
    ap.add_argument("--devices", type=int, default=1, metavar="G",
                    help="with --device-tier: G host partitions, each worker a consecutive share of the examples")
    a = ap.parse_args()
    if a.devices < 1 or (a.devices > 1 and not a.device_tier):
        ap.error("--devices G: G >= 1, and above 1 only with --device-tier")
    batches = list(SyntheticCriteo(seed=0, batch_size=a.batch_size, examples=a.batch_size * a.batches))
    ps = hps.ParameterServer(hps.ParameterServerConfig(dim=16, path=tempfile.mkdtemp(prefix="hps-steps-"),
                                                       optimizer=hps.AdaGrad(lr=0.05), mem_budget="1GiB",
                                                       host_in_place=not a.device_tier, devices=a.devices))
    total = dict.fromkeys(STEPS, 0.0)
    counted, distinct = 0, 0
    current = ps.batch(ps.prefetch(batches[0].keys), overlap=True)
    for i in range(1, len(batches) + 1):
        following = ps.batch(ps.prefetch(batches[i].keys), overlap=True) if i < len(batches) else None
        keys = batches[i - 1].keys
        n_distinct = len(current.keys)
        spent = run_steps(current, keys, a.devices)
        if i > 10:
            counted += 1
            distinct += n_distinct
            for step, seconds in spent.items():
                total[step] += seconds
        current = following
    ms = {step: 1e3 * v / counted for step, v in total.items()}
    for step, v in ms.items():
        print(f"{step:12s} {v:6.2f} ms")
    print(f"{'total':12s} {sum(ms.values()):6.2f} ms ({distinct // counted:,} distinct keys a batch)")
    print(json.dumps({"bench": "batch_steps", "path": "device tier" if a.device_tier else "host batch",
                      "devices": a.devices,
                      "batch_size": a.batch_size, "batches": counted,
                      "distinct_keys_per_batch": distinct // counted, "ms": ms}))
    ps.close()


if __name__ == "__main__":
    main()
