"""W7 (a): Herald's replay in the paper's setting, for comparison with its Table 1.

    python3 bench/herald_replay.py                 # the Criteo sample and two Zipf traces
    python3 bench/herald_replay.py --quick         # a small run for the tests (seconds)
    python3 bench/herald_replay.py --trace PATH    # any Criteo-format TSV instead of the sample
    python3 bench/herald_replay.py --lookahead 0,2 # Herald's lookahead windows to replay (K batches)

8 workers, each with an LRU cache of 10% of the trace's distinct keys, take
mini-batches of 128 examples (a global batch of 1024) in trace order. Four
schedules replay the same trace through hps.herald.Herald:

  naive       sequential partition (example i to worker i // 128), write-through
  on_demand   sequential partition, on-demand synchronisation
  location    location-aware partition (Algorithm 1), write-through
  herald      both

Counted (the definitions the scheduler implements, include/hps/herald.h):
  pull   a worker trains on a key whose latest version its cache does not hold;
         one row moved, from the peer holding it or from the PS.
  push   write-through: every row trained in a batch is sent to the PS once at
         the batch's end (the workers that shared it summed their gradients).
         On demand: a dirty row is sent once when another worker needs it in
         the next batch, and once when it is evicted from the last cache that
         holds it (no other copy of that version is left).
  bytes  (pulls + pushes) x dim x 4 (float32 rows, dim 128 by default).
Not in the ratios, reported beside them: "shared", the gradient rows that
workers training the same key in one batch exchange (sum of trainers - 1),
which the partition changes but synchronisation does not.

Lookahead (--lookahead, default 0,1,2,4): Herald (both) again with the keys
of the next K global batches of the trace as each batch's window
(Herald.schedule(..., upcoming=...)): a cache that must evict drops the keys
it holds in the window last. K = 0 is the herald row (no window). Each K's
counts are reported as ratios of the same naive run. Beside them, what bounds
them: Herald with unbounded caches ("unbounded": no eviction, so about the most
an eviction order can save; not a bound, as the partition follows the caches) and the trace's distinct keys over naive's pulls
("pull_floor_ratio": every key is pulled from the PS at least once).

Floors that bind every schedule of these caches, whatever its partition,
synchronisation or eviction (each trace, "*_floor_ratio", ratios of naive):
  pull     the distinct keys: a key's first use is a pull (no cache holds it)
  push     the distinct keys less what all caches hold at once (workers x
           capacity): every key is trained when used, so some cache holds a
           dirty row of it, and a key no cache holds at the trace's end left
           its last cache by an eviction, which pushes it (write-through pushed
           it when it trained)
  overall  the two together, in bytes
A target below its floor ("targets_reachable": false) is met by no schedule on
that trace at that cache size.

Past the first uses: every run records its pulls batch by batch ("batch_pulls"),
and each trace the keys each batch is the first to have ("batch_first_uses").
A short trace's pulls are largely first uses, which every schedule makes and a
long trace (the paper's) has few of, so each run also gives its pulls less the
distinct keys over naive's less them ("past_first_uses_ratio"), and its pulls
over naive's in the trace's last quarter of batches ("last_quarter_pull_ratio",
with that quarter's first uses in "last_quarter").

Partition headroom (--headroom-batches, default 10): over each trace's first
batches, Herald's pulls against those of its partition after a local search
(swap_refined: swaps of two examples between two workers that lower the batch's
pulls, shares kept, the same caches), each batch's pulls recounted from its
partition apart from the scheduler (a disagreement stops the run): how far
the greedy is from a partition no such swap improves.

It also times Herald.schedule on batches of 4096 examples of 26 keys with 8
and 64 workers (caches of 100k keys each, one core): "schedule_cost".

Prints one JSON line (also written to bench/results/herald_replay-DATE.json)
with each trace's counts and ratios to naive, and the targets of issue 16:
pull <= 0.52x, push <= 0.42x, overall <= 0.46x.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from _provenance import provenance, save_result  # bench/ is sys.path[0]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACE = os.path.join(ROOT, "..", "shared", "data", "criteo-sample", "train_examples_10k.tsv")
MODES = {"naive": (False, False), "on_demand": (False, True), "location": (True, False), "herald": (True, True)}
TARGETS = {"pull": 0.52, "push": 0.42, "overall": 0.46}


def criteo_trace(path: str) -> np.ndarray:
    """(n_examples, 26) uint64 keys of a Criteo TSV, read by hps.data."""
    from hps.data import CriteoTsv
    parts = [b.keys for b in CriteoTsv(path, batch_size=65536)]
    if not parts:
        raise SystemExit(f"{path}: no examples")
    return np.concatenate(parts)


def zipf_trace(n: int, fields: int, vocab: int, a: float, seed: int) -> np.ndarray:
    """(n, fields) keys: field f draws rank r in [1, vocab] with p ~ r^-a, key = r * fields + f."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** a
    cdf = np.cumsum(p / p.sum())
    ranks = np.minimum(np.searchsorted(cdf, rng.random((n, fields))), vocab - 1).astype(np.uint64)
    # a permutation of ranks per field, so that hot keys are not the small numbers
    perm = rng.permutation(vocab).astype(np.uint64)
    return perm[ranks] * np.uint64(fields) + np.arange(fields, dtype=np.uint64)


def replay(keys: np.ndarray, workers: int, per_worker: int, cache_fraction: float, dim: int,
           lookahead=(0,), headroom_batches: int = 0) -> dict:
    from hps.herald import Herald
    distinct = int(len(np.unique(keys)))
    capacity = max(1, int(round(cache_fraction * distinct)))
    batch = workers * per_worker
    out = {"examples": int(len(keys)), "fields": int(keys.shape[1]), "distinct_keys": distinct,
           "capacity_per_worker": capacity, "batches": -(-len(keys) // batch), "modes": {}}
    def run(aware: bool, on_demand: bool, ahead: int, cap: int = capacity) -> dict:
        h = Herald(workers, cap, location_aware=aware, on_demand=on_demand)
        c = dict(pulls=0, peer_pulls=0, pushes=0, evict_pushes=0, shared=0)
        per_batch = []
        t0 = time.perf_counter()
        for start in range(0, len(keys), batch):
            # the next `ahead` batches of the trace, a view (rows are contiguous)
            window = keys[start + batch:start + batch * (1 + ahead)] if ahead else None
            plan = h.schedule(keys[start:start + batch], upcoming=window)
            for k in c:
                c[k] += getattr(plan, k)
            per_batch.append(plan.pulls)
        c["batch_pulls"] = per_batch
        c["bytes"] = (c["pulls"] + c["pushes"]) * dim * 4
        c["schedule_s"] = round(time.perf_counter() - t0, 3)
        return c

    for name, (aware, on_demand) in MODES.items():
        out["modes"][name] = run(aware, on_demand, 0)
    if any(k > 0 for k in lookahead):
        out["lookahead"] = {str(k): (dict(out["modes"]["herald"]) if k == 0 else run(True, True, k))
                            for k in lookahead}
        out["unbounded"] = run(True, True, 0, 0)
    naive = out["modes"]["naive"]
    # Each batch's first uses (keys no earlier batch had): pulls every schedule makes.
    _, first_at = np.unique(keys.reshape(-1), return_index=True)
    out["batch_first_uses"] = np.bincount(first_at // (batch * keys.shape[1]),
                                          minlength=out["batches"]).tolist()
    ratio = lambda x, y: round(x / y, 4) if y else None  # noqa: E731
    # The floors (the module docstring): first uses pull, and what the caches
    # cannot hold at the end was pushed on its way out.
    forced = max(0, distinct - workers * capacity)
    out["forced_pushes"] = forced
    out["pull_floor_ratio"] = ratio(distinct, naive["pulls"])
    out["push_floor_ratio"] = ratio(forced, naive["pushes"])
    out["overall_floor_ratio"] = ratio(distinct + forced, naive["pulls"] + naive["pushes"])
    out["targets_reachable"] = {what: out[f"{what}_floor_ratio"] is not None and
                                out[f"{what}_floor_ratio"] <= TARGETS[what] for what in TARGETS}

    def met(c: dict) -> dict:
        return {what: c[f"{what}_ratio"] is not None and c[f"{what}_ratio"] <= TARGETS[what] for what in TARGETS}

    extra = [*out.get("lookahead", {}).values(), *([out["unbounded"]] if "unbounded" in out else [])]
    for c in [*out["modes"].values(), *extra]:
        c["pull_ratio"] = ratio(c["pulls"], naive["pulls"])
        c["push_ratio"] = ratio(c["pushes"], naive["pushes"])
        c["overall_ratio"] = ratio(c["bytes"], naive["bytes"])
    for c in out.get("lookahead", {}).values():
        c["targets_met"] = met(c)
    # Past the first uses (the pull floor), which a short trace is mostly made of
    # and a long one hardly: each schedule's pulls beyond them over naive's, on the
    # whole trace and on its last quarter of batches.
    tail = out["batches"] - max(1, out["batches"] // 4)
    tail_first = sum(out["batch_first_uses"][tail:])
    for c in [*out["modes"].values(), *extra]:
        c["past_first_uses_ratio"] = ratio(c["pulls"] - distinct, naive["pulls"] - distinct)
        c["last_quarter_pull_ratio"] = ratio(sum(c["batch_pulls"][tail:]), sum(naive["batch_pulls"][tail:]))
    out["last_quarter"] = {"first_batch": tail, "first_uses": tail_first,
                           "first_uses_over_naive_pulls": ratio(tail_first, sum(naive["batch_pulls"][tail:]))}
    out["targets_met"] = met(out["modes"]["herald"])
    if headroom_batches:
        out["partition_headroom"] = partition_headroom(keys, workers, per_worker, capacity, headroom_batches)
    return out


def batch_pulls(examples: list, assignment, held: list) -> int:
    """Pulls of one batch under `assignment`: each worker's distinct keys its
    cache (held[w], a set) lacks. Computed apart from the scheduler, which must agree."""
    need = [set() for _ in held]
    for e, w in zip(examples, assignment):
        need[w].update(e)
    return sum(len(n - h) for n, h in zip(need, held))


def swap_refined(examples: list, assignment: list, held: list, candidates: int = 16) -> list:
    """A local search on one batch's partition, keeping every worker's share:
    swaps of two examples between two workers that lower the batch's pulls,
    until no swap among each pair's `candidates` most promising examples does.
    Not the scheduler's (far too slow for its budget): it measures how far the
    greedy is from a partition no such swap improves."""
    W = len(held)
    count = [dict() for _ in range(W)]  # worker -> key -> examples of the batch it has with the key
    for e, w in zip(examples, assignment):
        for k in e:
            count[w][k] = count[w].get(k, 0) + 1

    def leave(i: int, a: int) -> int:  # pulls a saves without example i
        return sum(1 for k in examples[i] if count[a][k] == 1 and k not in held[a])

    def enter(i: int, b: int) -> int:  # pulls b adds with example i
        return sum(1 for k in examples[i] if k not in count[b] and k not in held[b])

    def move(i: int, a: int, b: int) -> None:
        for k in examples[i]:
            count[a][k] -= 1
            if not count[a][k]:
                del count[a][k]
            count[b][k] = count[b].get(k, 0) + 1
        assignment[i] = b

    improved = True
    while improved:
        improved = False
        members = [[] for _ in range(W)]
        for i, w in enumerate(assignment):
            members[w].append(i)
        for a in range(W):
            for b in range(a + 1, W):
                ga = sorted(((leave(i, a) - enter(i, b), i) for i in members[a]), reverse=True)[:candidates]
                gb = sorted(((leave(j, b) - enter(j, a), j) for j in members[b]), reverse=True)[:candidates]
                for _, i in ga:
                    for _, j in gb:
                        if assignment[i] != a or assignment[j] != b:
                            continue
                        first = leave(i, a) - enter(i, b)
                        move(i, a, b)
                        if first + leave(j, b) - enter(j, a) > 0:  # exact, after i moved
                            move(j, b, a)
                            improved = True
                            break
                        move(i, b, a)
                members[a], members[b] = ([i for i in members[a] + members[b] if assignment[i] == w]
                                          for w in (a, b))
    return assignment


def partition_headroom(keys: np.ndarray, workers: int, per_worker: int, capacity: int, batches: int) -> dict:
    """Herald's replay (both, no window) over the trace's first `batches` batches:
    each batch's pulls as the scheduler plans them, recounted from its assignment
    and the caches before the batch (they must agree), and after swap_refined on
    the same caches. The snapshot follows Herald's own plans throughout."""
    from hps.herald import Herald
    h = Herald(workers, capacity)
    batch = workers * per_worker
    greedy = refined = 0
    for start in range(0, min(len(keys), batches * batch), batch):
        rows = keys[start:start + batch]
        held = [set(c.tolist()) for c in h.cached_by_worker()]
        plan = h.schedule(rows)
        examples = [list(set(r)) for r in rows.tolist()]
        recount = batch_pulls(examples, plan.assignment.tolist(), held)
        if recount != plan.pulls:
            raise SystemExit(f"batch at example {start}: the plan counts {plan.pulls} pulls, its partition {recount}")
        greedy += plan.pulls
        refined += batch_pulls(examples, swap_refined(examples, plan.assignment.tolist(), held), held)
    return {"batches": -(-min(len(keys), batches * batch) // batch), "herald_pulls": greedy,
            "swap_refined_pulls": refined, "refined_over_herald": round(refined / greedy, 4) if greedy else None}


def schedule_cost(workers_list, batch: int, fields: int, capacity: int, repeats: int) -> dict:
    """Milliseconds Herald.schedule takes a batch (the Python call included), after
    warming its caches over `repeats` batches of a Zipf(1.05) trace, over `repeats` more:
    wall time (median and min-max), the calling thread's CPU time (median), which
    leaves out the time another process had the core (this machine's 2 cores are shared),
    and the mean wall time: what a batch costs on average, the snapshot's compactions
    (a batch in three or four here, each rebuilding the key index) included, which the
    median leaves out."""
    from hps.herald import Herald
    keys = zipf_trace(batch * 2 * repeats, fields, 1_000_000, 1.05, seed=11)
    out = {}
    for w in workers_list:
        h = Herald(w, capacity)
        times, cpu = [], []
        for b in range(2 * repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            h.schedule(keys[b * batch:(b + 1) * batch])
            if b >= repeats:  # the first half fills the caches
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
        times.sort()
        cpu.sort()
        out[str(w)] = {"median_ms": round(1e3 * times[len(times) // 2], 3), "min_ms": round(1e3 * times[0], 3),
                       "max_ms": round(1e3 * times[-1], 3), "cpu_median_ms": round(1e3 * cpu[len(cpu) // 2], 3),
                       "mean_ms": round(1e3 * sum(times) / len(times), 3),
                       "snapshot_bytes": h.memory_bytes,
                       "cached_keys": sum(h.cached_count(i) for i in range(w))}
    return {"batch": batch, "fields": fields, "capacity_per_worker": capacity, "repeats": repeats, "workers": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="a Criteo-format TSV ('' to skip)")
    ap.add_argument("--quick", action="store_true", help="small synthetic traces and 2,048 Criteo rows")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--per-worker", type=int, default=128, help="examples per worker per batch")
    ap.add_argument("--cache", type=float, default=0.10, help="cache per worker, fraction of distinct keys")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--zipf", default="1.05,1.2", help="skews of the synthetic traces")
    ap.add_argument("--examples", type=int, default=200_000, help="examples of each synthetic trace")
    ap.add_argument("--lookahead", default="0,1,2,4",
                    help="windows of the next K batches to replay Herald with, comma-separated ('0': none)")
    ap.add_argument("--headroom-batches", type=int, default=10,
                    help="batches of each trace to measure the partition's headroom on (swap_refined; 0: none)")
    ap.add_argument("--no-save", action="store_true", help="print only; do not write bench/results/")
    a = ap.parse_args(argv)
    for name, v in (("--workers", a.workers), ("--per-worker", a.per_worker), ("--dim", a.dim),
                    ("--examples", a.examples)):
        if v < 1:
            ap.error(f"{name} must be >= 1, got {v}")
    if a.headroom_batches < 0:
        ap.error(f"--headroom-batches must be >= 0, got {a.headroom_batches}")
    headroom = min(a.headroom_batches, 2) if a.quick else a.headroom_batches
    if not 1 <= a.workers <= 64:
        ap.error(f"--workers must be in [1, 64], got {a.workers}")
    if not 0 < a.cache <= 1:
        ap.error(f"--cache must be in (0, 1], got {a.cache}")
    try:
        skews = [float(s) for s in a.zipf.split(",") if s]
    except ValueError:
        ap.error(f"--zipf must be comma-separated numbers, got {a.zipf!r}")
    try:
        lookahead = sorted({int(k) for k in a.lookahead.split(",") if k.strip()})
    except ValueError:
        ap.error(f"--lookahead must be comma-separated integers, got {a.lookahead!r}")
    if any(k < 0 for k in lookahead):
        ap.error(f"--lookahead must be >= 0, got {a.lookahead!r}")
    lookahead = lookahead or [0]
    examples = 8192 if a.quick else a.examples
    traces = {}
    if a.trace:
        if not os.path.isfile(a.trace):
            if a.trace != DEFAULT_TRACE:
                ap.error(f"--trace {a.trace}: no such file")
            traces["criteo"] = {"skipped": f"{a.trace} is absent"}
        else:
            keys = criteo_trace(a.trace)
            if a.quick:
                keys = keys[:2048]
            traces["criteo"] = {"path": os.path.relpath(a.trace, ROOT),
                                **replay(keys, a.workers, a.per_worker, a.cache, a.dim, lookahead, headroom)}
    for s in skews:
        keys = zipf_trace(examples, 26, 100_000 if not a.quick else 20_000, s, seed=7)
        traces[f"zipf{s:g}"] = {"zipf_a": s, "vocab_per_field": 100_000 if not a.quick else 20_000,
                               **replay(keys, a.workers, a.per_worker, a.cache, a.dim, lookahead, headroom)}
    for name, t in traces.items():
        if "modes" not in t:
            print(f"{name}: skipped ({t['skipped']})", file=sys.stderr)
            continue
        print(f"{name}: {t['examples']:,} examples, {t['distinct_keys']:,} keys, cache {t['capacity_per_worker']:,}",
              file=sys.stderr)
        for m, c in t["modes"].items():
            print(f"  {m:<10} pulls {c['pulls']:>10,} ({c['pull_ratio']})  pushes {c['pushes']:>10,} "
                  f"({c['push_ratio']})  overall {c['overall_ratio']}", file=sys.stderr)
        for k, c in t.get("lookahead", {}).items():
            print(f"  herald K={k:<3} pulls {c['pulls']:>10,} ({c['pull_ratio']})  pushes {c['pushes']:>10,} "
                  f"({c['push_ratio']})  overall {c['overall_ratio']}  {c['schedule_s']} s", file=sys.stderr)
        if "unbounded" in t:
            c = t["unbounded"]
            print(f"  unbounded  pulls {c['pulls']:>10,} ({c['pull_ratio']})  pushes {c['pushes']:>10,} "
                  f"({c['push_ratio']})  overall {c['overall_ratio']}", file=sys.stderr)
        if "partition_headroom" in t:
            p = t["partition_headroom"]
            print(f"  headroom   first {p['batches']} batches: herald pulls {p['herald_pulls']:,}, swap-refined "
                  f"{p['swap_refined_pulls']:,} ({p['refined_over_herald']}x)", file=sys.stderr)
        print(f"  floors     pulls {t['distinct_keys']:>10,} ({t['pull_floor_ratio']})  pushes "
              f"{t['forced_pushes']:>10,} ({t['push_floor_ratio']})  overall {t['overall_floor_ratio']}; "
              f"targets reachable: {t['targets_reachable']}", file=sys.stderr)
    cost = schedule_cost([8, 64], 4096, 26, 100_000 if not a.quick else 5_000, 60 if not a.quick else 3)
    for w, c in cost["workers"].items():
        print(f"schedule, {w} workers: {c['median_ms']} ms a batch of {cost['batch']} "
              f"({c['min_ms']}-{c['max_ms']}; mean {c['mean_ms']}), snapshot {c['snapshot_bytes'] / max(1, c['cached_keys']):.1f} "
              f"bytes a cached key", file=sys.stderr)
    line = json.dumps({"bench": "w7", "benchmark": "W7 Herald replay", "quick": a.quick,
                       "provenance": provenance(), "workers": a.workers, "per_worker": a.per_worker,
                       "cache_fraction": a.cache, "dim": a.dim, "lookahead": lookahead, "targets": TARGETS,
                       "traces": traces,
                       "schedule_cost": cost})
    print(line)
    if not a.no_save:
        save_result(line, "herald_replay")
    return 0


if __name__ == "__main__":
    sys.exit(main())
