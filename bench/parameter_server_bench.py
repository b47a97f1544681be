#!/usr/bin/env python3
"""Pull and push throughput of the whole hps.ParameterServer (issue 4), with the
working set (a) in MEM-PS and (b) mostly on SSD-PS, beside the bare in-memory
hash table (hps.EmbeddingTable: the device tier alone, no cache and no disk) as
the limit, in the same run.

    python3 bench/parameter_server_bench.py --quick      # under a minute
    python3 bench/parameter_server_bench.py              # full

Workload: embeddings of dim 16 with AdaGrad (rows of 32 floats = 128 bytes);
batches of K keys drawn from Zipf(1.05) over a universe of U keys (ranks spread
over the key space by a multiplicative permutation), de-duplicated; every batch
is a timed pull of its keys, then a timed push of gradients for them (one
ParameterServer.push: pin in MEM-PS, load the device tier, step, write back).
  (a) in MEM: U = 1M (--quick 100k), MEM budget large enough for every row;
  (b) on SSD: U = 10M (--quick 1M), MEM budget for 5% of the rows, so most
      misses read SSD-PS and evictions write it.
Each scenario first warms up by pushing every key once (timed separately: it
is the bulk load), then runs B batches (default 20; --quick 5). Rates are
rows/s over the distinct keys of a batch, median and min-max over batches.
One JSON line on stdout; progress and a table on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _provenance import scratch_dir  # noqa: E402  (bench/results/ made where a fresh clone has none)

DIM = 16
ZIPF_A = 1.05
PERM = 2654435761


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def zipf_keys(rng, universe, size):
    ranks = rng.zipf(ZIPF_A, size=size * 2)
    ranks = ranks[ranks <= universe][:size]
    while len(ranks) < size:
        more = rng.zipf(ZIPF_A, size=size)
        ranks = np.concatenate([ranks, more[more <= universe]])[:size]
    return np.unique(((ranks.astype(np.uint64) - 1) * np.uint64(PERM)) % np.uint64(universe))


def summarize(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run_scenario(name, universe, budget, batches, batch_keys, workdir, seed):
    import hps
    path = os.path.join(workdir, name)
    cfg = hps.ParameterServerConfig(dim=DIM, path=path, optimizer=hps.AdaGrad(lr=0.05), mem_budget=budget,
                                    device_capacity=max(4 * batch_keys, 1 << 16))
    ps = hps.ParameterServer(cfg)
    table = hps.EmbeddingTable(universe + 1, DIM, optimizer=hps.AdaGrad(lr=0.05), seed=0)
    rng = np.random.default_rng(seed)
    res = {"universe": universe, "mem_budget": budget, "batches": batches, "batch_keys_drawn": batch_keys}
    # Warm-up: every key once, in batches (the bulk load through the whole path).
    all_keys = np.arange(universe, dtype=np.uint64)
    t_ps = t_table = 0.0
    step = max(batch_keys, 1)
    for s in range(0, universe, step):
        k = all_keys[s:s + step]
        g = np.full((len(k), DIM), 0.01, np.float32)
        t0 = time.perf_counter()
        ps.push(k, g)
        t_ps += time.perf_counter() - t0
        t0 = time.perf_counter()
        table.push(k, g)
        t_table += time.perf_counter() - t0
    res["warmup_rows_per_s"] = {"ps": universe / t_ps, "in_memory_table": universe / t_table}
    rates = {"ps_pull": [], "ps_push": [], "table_pull": [], "table_push": []}
    for b in range(batches):
        keys = zipf_keys(rng, universe, batch_keys)
        rng.shuffle(keys)
        grads = rng.standard_normal((len(keys), DIM)).astype(np.float32)
        t0 = time.perf_counter()
        got = ps.pull(keys)
        rates["ps_pull"].append(len(keys) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        ps.push(keys, grads)
        rates["ps_push"].append(len(keys) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        ref = table.pull(keys)
        rates["table_pull"].append(len(keys) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        table.push(keys, grads)
        rates["table_push"].append(len(keys) / (time.perf_counter() - t0))
        if not np.array_equal(got, ref):
            raise SystemExit(f"{name} batch {b}: the parameter server and the in-memory table disagree")
        log(f"{name} batch {b + 1}/{batches}: {len(keys)} keys, pull {rates['ps_pull'][-1]:,.0f} rows/s, "
            f"push {rates['ps_push'][-1]:,.0f} rows/s")
    res["rows_per_s"] = {k: summarize(v) for k, v in rates.items()}
    res["ps_over_table"] = {op: res["rows_per_s"][f"ps_{op}"]["median"] / res["rows_per_s"][f"table_{op}"]["median"]
                            for op in ("pull", "push")}
    st = ps.stats()
    res["stats"] = {"counts": st["counts"], "mem": st["mem"],
                    "ssd": {k: st["ssd"][k] for k in ("files", "live_records", "rows_read", "rows_written",
                                                      "bytes_read", "io_path")}}
    mem = st["mem"]
    res["mem_hit_rate"] = mem["hits"] / max(1, mem["hits"] + mem["misses"])
    ps.close()
    shutil.rmtree(path, ignore_errors=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", type=int, default=None)
    ap.add_argument("--batch-keys", type=int, default=100_000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    batches = a.batches or (5 if a.quick else 20)
    batch_keys = 20_000 if a.quick else a.batch_keys
    u_mem, u_ssd = (100_000, 1_000_000) if a.quick else (1_000_000, 10_000_000)
    row_cost = DIM * 2 * 4 + 112  # row bytes + MEM-PS bookkeeping (MemCache.capacity_for_budget)
    workdir = a.dir or scratch_dir("ps-bench-")
    os.makedirs(workdir, exist_ok=True)
    out = {"benchmark": "parameter_server throughput", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "dim": DIM, "optimizer": "adagrad", "zipf_a": ZIPF_A, "quick": a.quick, "machine": {"cpus": os.cpu_count()},
           "scenarios": {}}
    t0 = time.time()
    try:
        out["scenarios"]["in_mem"] = run_scenario("in_mem", u_mem, 2 * u_mem * row_cost, batches, batch_keys,
                                                  workdir, a.seed)
        out["scenarios"]["on_ssd"] = run_scenario("on_ssd", u_ssd, u_ssd * row_cost // 20, batches, batch_keys,
                                                  workdir, a.seed)
    finally:
        if a.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    out["seconds"] = time.time() - t0
    log(f"{'scenario':<8} {'op':<5} {'ps rows/s':>12} {'table rows/s':>13} {'ratio':>6}  MEM hit rate")
    for name, r in out["scenarios"].items():
        for op in ("pull", "push"):
            log(f"{name:<8} {op:<5} {r['rows_per_s']['ps_' + op]['median']:>12,.0f} "
                f"{r['rows_per_s']['table_' + op]['median']:>13,.0f} {r['ps_over_table'][op]:>6.2f}  "
                f"{r['mem_hit_rate']:.3f}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
