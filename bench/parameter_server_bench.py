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

    python3 bench/parameter_server_bench.py --lookahead 0,4,8,16,32   # ~2 min on 2 quiet cores
    python3 bench/parameter_server_bench.py --lookahead 0,2,4 --quick # seconds

--lookahead: what ParameterServer.prefetch costs with MEM-PS's lookahead window
of K batches (config lookahead, the pipeline's `upcoming`), and what the window
buys. Batches of 4096 x 26 keys (--quick 1024 x 26) drawn from Zipf(1.05) over
U = 1M keys (--quick 100k), every key pushed once and checkpointed first so
that misses read SSD-PS, and a MEM-PS of 128k rows (--quick 12k): fewer than a round's distinct
keys, so rows are evicted. A run opens the server on that store with MEM-PS
empty and times, per batch, prefetch(keys, upcoming=window) and the release of
its pins (no batch trains: MEM-PS's rows stay clean and the store stays as it
was for the next run), the window being the next K batches (fewer at the end
of the data, as in the pipeline):
  K = 0   no window (upcoming=None);
  slid    the pipeline's way: a deque of the batches' arrays shifted by one
          batch, so that prefetch slides MEM-PS's window (one batch in, one out);
  set     fresh copies of the next K batches each batch (made before the clock
          starts): prefetch sets the window anew, hashing every batch of it
          (what prefetch did before the window slid, and what MPI owners do).
Every variant runs once a round, in an order rotated each round, for R rounds
(default 5; --quick 2) of B batches (default 32; --quick 6). Reported per
variant: ms a batch, median (min-max) over every batch of every round, the
median of each round, MEM-PS's counters of each run (hits, misses, evictions,
lookahead_spared, lookahead_forced, lookahead_slides) and the rows it read from
SSD-PS (one a miss). Slid and set windows hold the same keys, so they evict
alike (mem_cache_test's SlidingLookahead): their counters are equal and only
the time differs. A set window slides once a run: at the end of the data, a
window of one batch followed by an empty one is popped, whichever arrays it held.
One JSON line with provenance on stdout (kept in bench/results/ unless --quick
or --no-save; bench/report.py --add files it under docs/results/ps_lookahead.jsonl).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _provenance import provenance, save_result, scratch_dir  # noqa: E402  (bench/ is sys.path[0])

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

# ------------------------------------------------------------------ --lookahead
LOOKAHEAD_FIELDS = 26
LOOKAHEAD_COUNTERS = ("hits", "misses", "evictions", "lookahead_spared", "lookahead_forced", "lookahead_slides")


def lookahead_batches(rng, universe, count, examples):
    """`count` batches of (examples, LOOKAHEAD_FIELDS) uint64 keys from Zipf(ZIPF_A)
    over `universe` keys (repeats kept: a batch's keys as the pipeline reads them)."""
    n = examples * LOOKAHEAD_FIELDS
    out = []
    for _ in range(count):
        ranks = rng.zipf(ZIPF_A, size=2 * n)
        ranks = ranks[ranks <= universe][:n]
        while len(ranks) < n:
            more = rng.zipf(ZIPF_A, size=n)
            ranks = np.concatenate([ranks, more[more <= universe]])[:n]
        keys = ((ranks.astype(np.uint64) - 1) * np.uint64(PERM)) % np.uint64(universe)
        out.append(keys.reshape(examples, LOOKAHEAD_FIELDS))
    return out


def lookahead_variants(ks):
    """(name, K, how) of each variant: K = 0 alone, every other K slid and set."""
    out = []
    for k in ks:
        if k == 0:
            out.append(("K=0", 0, None))
        else:
            out += [(f"K={k} slid", k, "slid"), (f"K={k} set", k, "set")]
    return out


def lookahead_run(cfg, batches, k, how):
    """One run of a variant on a server opened on cfg's store (MEM-PS empty):
    (ms of each batch's prefetch + release, MEM-PS's counters and the rows read
    from SSD-PS after)."""
    import hps
    ps = hps.ParameterServer(cfg)
    try:
        window = collections.deque(batches[1:1 + k])  # slid: the pipeline's read-ahead deque
        times = []
        for i, keys in enumerate(batches):
            if how is None:
                upcoming = None
            elif how == "slid":
                if i > 0:
                    window.popleft()
                    if i + k < len(batches):
                        window.append(batches[i + k])
                upcoming = list(window)
            else:  # set: new arrays, so prefetch cannot tell the window moved by one batch
                upcoming = [b.copy() for b in batches[i + 1:i + 1 + k]]
            t0 = time.perf_counter()
            ps.prefetch(keys, upcoming=upcoming).release()
            times.append(1e3 * (time.perf_counter() - t0))
        st = ps.stats()
        counts = {c: int(st["mem"][c]) for c in LOOKAHEAD_COUNTERS}
        counts["ssd_rows_read"] = int(st["ssd"]["rows_read"])
        return times, counts
    finally:
        ps.close()


def lookahead_main(a):
    import hps
    ks = sorted({int(x) for x in a.lookahead.split(",") if x.strip()})
    if not ks or ks[0] < 0:
        raise SystemExit(f"--lookahead: a list of batches >= 0 (as 0,4,8), got {a.lookahead!r}")
    universe, examples, rows = (100_000, 1024, 12_000) if a.quick else (1_000_000, 4096, 128_000)
    count = a.batches or (6 if a.quick else 32)
    rounds = a.rounds or (2 if a.quick else 5)
    row_cost = DIM * 2 * 4 + 112  # row bytes + MEM-PS bookkeeping (MemCache.capacity_for_budget)
    # The window's memory is inside mem_budget (lookahead_room): every variant gets
    # the same room on top of the rows', so K = 0 and each K hold the same rows.
    room = (8 if a.quick else 192) << 20
    workdir = a.dir or scratch_dir("ps-lookahead-")
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "store")
    cfg = hps.ParameterServerConfig(dim=DIM, path=path, optimizer=hps.AdaGrad(lr=0.05),
                                    mem_budget=rows * row_cost + room, lookahead_room=room)
    variants = lookahead_variants(ks)
    out = {"benchmark": "parameter_server prefetch lookahead", "dim": DIM, "optimizer": "adagrad", "zipf_a": ZIPF_A,
           "universe": universe, "batch": [examples, LOOKAHEAD_FIELDS], "batches": count, "rounds": rounds,
           "ks": ks, "lookahead_room": room, "quick": a.quick, "seed": a.seed, "variants": {}}
    t0 = time.time()
    try:
        ps = hps.ParameterServer(cfg)  # every key once: a miss reads SSD-PS, as in training past the warm-up
        keys, step = np.arange(universe, dtype=np.uint64), rows // 4  # a push's rows are pinned: a part of MEM-PS
        for s in range(0, universe, step):
            ps.push(keys[s:s + step], np.full((len(keys[s:s + step]), DIM), 0.01, np.float32))
        ps.checkpoint()  # what every run opens: a server that closes drops what no checkpoint holds
        out["mem_capacity_rows"] = int(ps.stats()["mem"]["capacity"])
        ps.close()
        batches = lookahead_batches(np.random.default_rng(a.seed), universe, count, examples)
        distinct = [len(np.unique(b)) for b in batches]
        out["distinct_keys"] = {"a_batch_median": int(statistics.median(distinct)),
                                "a_run": int(sum(distinct)),  # MEM-PS's hits + misses in a run
                                "a_round": int(len(np.unique(np.concatenate([b.reshape(-1) for b in batches]))))}
        runs = {name: {"times": [], "mem": []} for name, _, _ in variants}
        for r in range(rounds):
            for name, k, how in variants[r % len(variants):] + variants[:r % len(variants)]:
                times, mem = lookahead_run(cfg, batches, k, how)
                runs[name]["times"].append(times)
                runs[name]["mem"].append(mem)
                log(f"round {r + 1}/{rounds} {name}: {statistics.median(times):.1f} ms a batch, "
                    f"hits {mem['hits']:,}, evictions {mem['evictions']:,}, slides {mem['lookahead_slides']}")
    finally:
        if a.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    for name, k, how in variants:
        every = [t for times in runs[name]["times"] for t in times]
        out["variants"][name] = {"k": k, "window": how or "none", "ms_a_batch": summarize(every),
                                 "ms_a_batch_round_medians": [statistics.median(t) for t in runs[name]["times"]],
                                 "mem": runs[name]["mem"]}
    out["seconds"] = time.time() - t0
    log(f"{'variant':<12} {'ms a batch':>10} {'hits':>10} {'evictions':>10} {'spared':>8} {'forced':>8} {'slides':>6}")
    for name, v in out["variants"].items():
        m = v["mem"][0]
        log(f"{name:<12} {v['ms_a_batch']['median']:>10.1f} {m['hits']:>10,} {m['evictions']:>10,} "
            f"{m['lookahead_spared']:>8,} {m['lookahead_forced']:>8,} {m['lookahead_slides']:>6}")
    out["provenance"] = provenance()
    line = json.dumps(out)
    print(line, flush=True)
    if not a.quick and not a.no_save:
        log(f"parameter_server_bench: wrote {save_result(line, 'ps-lookahead')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", type=int, default=None)
    ap.add_argument("--batch-keys", type=int, default=100_000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--lookahead", default=None, metavar="K,K,...",
                    help="time prefetch with MEM-PS lookahead windows of these batches (0: none) instead")
    ap.add_argument("--rounds", type=int, default=None, help="--lookahead: rounds (default 5; --quick 2)")
    ap.add_argument("--no-save", action="store_true", help="--lookahead: do not keep the line in bench/results/")
    a = ap.parse_args()
    if a.lookahead is not None:
        return lookahead_main(a)
    batches = a.batches or (5 if a.quick else 20)
    batch_keys = 20_000 if a.quick else a.batch_keys
    u_mem, u_ssd = (100_000, 1_000_000) if a.quick else (1_000_000, 10_000_000)
    row_cost = DIM * 2 * 4 + 112  # row bytes + MEM-PS bookkeeping (MemCache.capacity_for_budget)
    # The window's memory is inside mem_budget (lookahead_room): every variant gets
    # the same room on top of the rows', so K = 0 and each K hold the same rows.
    room = (8 if a.quick else 192) << 20
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
