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

STEPS = ("positions", "gather", "accumulate", "apply")


def run_steps(current, keys):
    t = [time.perf_counter()]
    at = current.positions(keys)
    t.append(time.perf_counter())
    per_example = current.gather(at)
    t.append(time.perf_counter())
    current.accumulate(at, np.ones_like(per_example))
    t.append(time.perf_counter())
    current.apply()
    t.append(time.perf_counter())
    return t, len(current.keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=70)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--device-tier", action="store_true", help="copy rows through a device table")
    a = ap.parse_args()
    batches = list(SyntheticCriteo(seed=0, batch_size=a.batch_size, examples=a.batch_size * a.batches))
    ps = hps.ParameterServer(hps.ParameterServerConfig(dim=16, path=tempfile.mkdtemp(prefix="hps-steps-"),
                                                       optimizer=hps.AdaGrad(lr=0.05), mem_budget="1GiB",
                                                       host_in_place=not a.device_tier))
    total = dict.fromkeys(STEPS, 0.0)
    counted, distinct = 0, 0
    current = ps.batch(ps.prefetch(batches[0].keys), overlap=True)
    for i in range(1, len(batches) + 1):
        following = ps.batch(ps.prefetch(batches[i].keys), overlap=True) if i < len(batches) else None
        keys = np.ascontiguousarray(batches[i - 1].keys.ravel())
        t, n_distinct = run_steps(current, keys)
        current.write_back()
        if i > 10:
            counted += 1
            distinct += n_distinct
            for step, (a0, a1) in zip(STEPS, zip(t, t[1:])):
                total[step] += a1 - a0
        current = following
    ms = {step: 1e3 * v / counted for step, v in total.items()}
    for step, v in ms.items():
        print(f"{step:12s} {v:6.2f} ms")
    print(f"{'total':12s} {sum(ms.values()):6.2f} ms ({distinct // counted:,} distinct keys a batch)")
    print(json.dumps({"bench": "batch_steps", "path": "device tier" if a.device_tier else "host batch",
                      "batch_size": a.batch_size, "batches": counted,
                      "distinct_keys_per_batch": distinct // counted, "ms": ms}))
    ps.close()


if __name__ == "__main__":
    main()
