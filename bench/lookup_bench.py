#!/usr/bin/env python3
"""Lookups of batches of keys from a trained store 4x larger than the lookup's
memory: hps.Lookup (its MemCache in front of the checkpoint's SSD-PS files)
against RocksDB's multi_get at equal memory (issue 20).

    python3 bench/lookup_bench.py --quick
    python3 bench/lookup_bench.py --rows 8000000 --batches 400 --clients 4

Workload:
  * the store: a ParameterServer of --rows keys (key(i) = splitmix64's finaliser of
    i + seed, distinct), every row pushed once (SGD), one checkpoint; rows of
    --dim float32 (64 bytes at dim 16), and their embeddings are what is looked up;
  * memory: the lookup's budget is a quarter of the rows' bytes (--memory-ratio 4);
    RocksDB gets the same bytes as block cache (3/4) and row cache (1/4), split
    evenly over its client processes;
  * RocksDB as its experts run it for point reads (bench/rocks_tuned.py,
    rocks_tuned_options): the same rows bulk-loaded sorted through SstFileWriter
    and ingested (nothing left to compact), bloom filters, 4 KiB blocks, direct
    reads so the page cache does not act as a hidden cache, no compression, every
    table open; read-only instances, one per client process (rocksdict holds the
    GIL through a multi_get), each a multi_get of the batch's 4096 big-endian keys;
  * hps.Lookup: the same clients as threads of one process (its reads release
    the GIL) sharing one Lookup;
  * batches: --batches batches of --batch-keys keys for each distribution
    (uniform, Zipf(1.05) with the hot keys spread by a multiplicative
    permutation), the same batches for both stores, after --warmup batches;
    a batch's latency is its call's wall time in its client; keys/s is all keys
    over the wall time of all clients;
  * every answer of the first batches is checked against the other store's;
  * --repeats runs of each store per distribution, interleaved (hps then RocksDB,
    then RocksDB then hps, ...), each with a fresh reader (cold cache, then the
    warmup); keys/s, p50 and p99 are medians over the runs with their min-max, and
    the ratios are taken run by run (hps's run against the RocksDB run beside it).

  * --writer: a process reopens the job's parameter server and pushes batches of
    4096 uniform keys, checkpointing every --checkpoint-every pushes (the training
    side's disk and CPU load, and new checkpoints), during every run of both
    stores; hps.Lookup refreshes to each new checkpoint every --refresh-s seconds.
    It is a ParameterServer's pushes, not `hps train` with its model.

  * --cgroup LIMIT: every run in a memory cgroup of its own with that hard limit
    (bench/ssd_store_bench.py's MemCgroup, v1 or v2): hps's run in a forked process,
    each RocksDB client process too, so both stores answer under the same limit;
    each run records the cgroup's peak bytes and its OOM counters. A limit holds
    each side's interpreters too (one for hps, one a client for RocksDB).

One JSON line goes to stdout; progress to stderr.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

from _provenance import provenance  # (bench/ is sys.path[0])
from hps.data import mix64

SEED = 0x5EED_4321
ZIPF_A = 1.05
ZIPF_PERM = 2654435761  # prime; rank r -> index (r * P) mod N


def keys_of(idx: np.ndarray) -> np.ndarray:
    return mix64(idx.astype(np.uint64) + np.uint64(SEED))


def be_keys(keys: np.ndarray) -> list:
    """RocksDB's keys: 8 bytes big-endian (so that key order is numeric order)."""
    b = keys.astype(">u8").tobytes()
    return [b[i:i + 8] for i in range(0, len(b), 8)]


def batches_of(dist: str, n_rows: int, count: int, size: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        if dist == "uniform":
            idx = rng.integers(0, n_rows, size)
        else:
            r = np.empty(0, np.int64)
            while len(r) < size:
                z = rng.zipf(ZIPF_A, 2 * size)
                r = np.concatenate([r, z[z <= n_rows] - 1])
            idx = ((r[:size].astype(np.uint64) * np.uint64(ZIPF_PERM)) % np.uint64(n_rows)).astype(np.int64)
        out.append(keys_of(idx))
    return out


def log(msg: str) -> None:
    print(f"lookup_bench: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the store

def make_job(path: str, n: int, dim: int) -> float:
    import hps
    cfg = hps.ParameterServerConfig(dim=dim, path=path, optimizer=hps.SGD(lr=0.5), mem_budget="64MiB",
                                    write_buffer_rows=1 << 16)
    ps = hps.ParameterServer(cfg)
    t0 = time.perf_counter()
    chunk = 1 << 16
    for s in range(0, n, chunk):
        k = keys_of(np.arange(s, min(n, s + chunk)))
        ps.push(k, np.ones((len(k), dim), np.float32))
    ps.checkpoint()
    ps.close()
    return time.perf_counter() - t0


def load_rocksdb(job: str, path: str, dim: int) -> tuple[float, int]:
    """The job's embeddings, sorted by key, through SstFileWriter, then ingested."""
    from rocks_tuned import SortedIngest
    from hps import jobdir
    view = jobdir.pin(job)
    load = SortedIngest(path)
    try:
        rank = view.ranks[0]
        keys, _ = jobdir.latest_records(rank)  # sorted
        store = jobdir.open_store(rank, view.job.row_bytes)
        chunk = 1 << 20
        for s in range(0, len(keys), chunk):
            k = keys[s:s + chunk]
            rows, found = store.get(k, np.float32)
            assert found.all()
            load.add(k.astype(">u8").tobytes(), np.ascontiguousarray(rows[:, :dim]).tobytes(), 4 * dim)
        del store
    finally:
        view.close()
    return load.finish(), len(keys)


# ---------------------------------------------------------------- training meanwhile

def _writer(job: str, dim: int, n_rows: int, every: int, stop_evt, conn) -> None:
    """Training's writes: the job's parameter server reopened, a push of 4096 uniform
    keys at a time and a checkpoint every `every` pushes (each prunes the one before),
    until told to stop."""
    import hps
    ps = hps.ParameterServer.open(job, mem_budget="64MiB")
    conn.send("ready")
    rng = np.random.default_rng(7)
    pushes = checkpoints = 0
    while not stop_evt.is_set():
        k = np.unique(keys_of(rng.integers(0, n_rows, 4096)))
        ps.push(k, np.full((len(k), dim), 0.01, np.float32))
        pushes += 1
        if pushes % every == 0:
            ps.checkpoint()
            checkpoints += 1
    ps.close()
    conn.send({"pushes": pushes, "checkpoints": checkpoints})


class Writer:
    def __init__(self, job: str, dim: int, n_rows: int, every: int):
        ctx = mp.get_context("spawn")
        self.stop, (self.conn, child) = ctx.Event(), ctx.Pipe()
        self.proc = ctx.Process(target=_writer, args=(job, dim, n_rows, every, self.stop, child))
        self.proc.start()
        if self.conn.recv() != "ready":
            raise RuntimeError("the writer did not start")

    def finish(self) -> dict:
        self.stop.set()
        done = self.conn.recv()
        self.proc.join()
        return done


# ---------------------------------------------------------------- the runs

class RunCgroups:
    """A fresh memory cgroup for each run (--cgroup): a peak counter of its own,
    since cgroup v2's memory.peak cannot be reset."""

    def __init__(self, limit: int):
        from ssd_store_bench import MemCgroup  # the W1 cgroup code, v1 and v2
        self.limit, self.made = limit, 0
        self._make = MemCgroup

    def new(self):
        self.made += 1
        cg = self._make(self.limit, name=f"hps-w11-{os.getpid()}-{self.made}")
        if cg.path is None:
            raise SystemExit(f"lookup_bench: --cgroup: {cg.error}")
        return cg

    @staticmethod
    def result(cg) -> dict:
        snap = cg.snapshot()
        peak = snap.get("memory.max_usage_in_bytes", snap.get("memory.peak"))
        return {"limit_bytes": cg.limit, "peak_bytes": peak,
                "oom_kills": snap.get("oom_control.oom_kill", snap.get("events.oom_kill", 0)),
                "limit_hits": snap.get("memory.failcnt", snap.get("events.max", 0))}


def _in_cgroup_child(conn, cg, fn, args) -> None:
    try:
        cg.enter()
        conn.send(("ok", fn(*args)))
    except BaseException as e:  # the parent reports it
        conn.send(("error", f"{type(e).__name__}: {e}"))


def in_cgroup(cg, fn, *args) -> dict:
    """fn(*args) in a fresh (spawned) process that joins `cg` before it starts; its
    result comes back. Spawned, not forked: a forked child's Python touches the
    parent's whole heap (reference counts, the collector) and each page it writes
    is copied and charged to the child, which would count the bench's own memory
    as the store's. What the child loads before it joins (the interpreter, numpy,
    hps, the batches passed to it) is not charged: the cgroup measures the run."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_in_cgroup_child, args=(there, cg, fn, args))
    p.start()
    there.close()  # so that a child killed by the OOM killer reads as EOF here
    try:
        status, value = here.recv()
    except EOFError:
        p.join()
        raise SystemExit(f"lookup_bench: the hps run in the cgroup died (exit {p.exitcode}; the OOM killer "
                         f"if the limit was too low: {RunCgroups.result(cg)})") from None
    p.join()
    if status != "ok":
        raise SystemExit(f"lookup_bench: the hps run in the cgroup failed: {value}")
    return value


def run_hps(job: str, budget: int, batches: list, warmup: list, clients: int, refresh_s: float = 0.0) -> dict:
    import hps
    lk = hps.Lookup(job, memory_budget=budget)
    for b in warmup:
        lk.lookup(b)
    lat = [None] * len(batches)
    nxt = iter(range(len(batches)))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            t0 = time.perf_counter()
            lk.lookup(batches[i])
            lat[i] = time.perf_counter() - t0

    done = threading.Event()
    refresh_times = []

    def refresher():  # moves to the writer's newer checkpoints while the clients look up
        while not done.wait(refresh_s):
            t0 = time.perf_counter()
            if lk.refresh():
                refresh_times.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    helper = threading.Thread(target=refresher) if refresh_s else None
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    if helper:
        helper.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    if helper:
        helper.join()
    s = lk.stats()
    lk.close()
    cache = s["cache"]
    return {"wall_s": wall, "latency_s": lat, "cache_rows": cache["size"], "cache_capacity": cache["capacity"],
            "cache_hit_rate": cache.get("hits", 0) / max(1, cache.get("hits", 0) + cache.get("misses", 0)),
            "index_bytes": s["index_bytes"], "ssd_bytes_read": s["ssd_bytes_read"],
            "refreshes": len(refresh_times), "refresh_max_s": max(refresh_times, default=0.0)}


def _rocks_client(conn, path: str, block: int, row: int, batches: list, warmup: list, start_evt, cg=None) -> None:
    import rocksdict as r  # loaded before the client joins its cgroup, as hps is (in_cgroup)
    from rocks_tuned import rocks_tuned_options
    if cg is not None:
        cg.enter()
    opt, _keep, _ = rocks_tuned_options(block, row, 1 << 20, 2, filters_for_hits=True)
    db = r.Rdict(path, options=opt, access_type=r.AccessType.read_only())
    prep = be_keys
    for b in warmup:
        db.get(prep(b))
    kbs = [prep(b) for b in batches]
    conn.send("ready")
    start_evt.wait()
    lat = []
    for kb in kbs:
        t0 = time.perf_counter()
        db.get(kb)
        lat.append(time.perf_counter() - t0)
    db.close()
    conn.send(lat)


def run_rocks(path: str, budget: int, batches: list, warmup: list, clients: int, cg=None) -> dict:
    ctx = mp.get_context("spawn" if cg is not None else "fork")  # spawned in a cgroup: see in_cgroup
    per = budget // clients
    block, row = per * 3 // 4, per // 4
    start = ctx.Event()
    procs, conns = [], []
    for c in range(clients):
        a, b = ctx.Pipe()
        mine = batches[c::clients]
        p = ctx.Process(target=_rocks_client, args=(b, path, block, row, mine, warmup[c::clients], start, cg))
        p.start()
        b.close()  # so that a client killed (by the OOM killer under --cgroup) reads as EOF here
        procs.append(p)
        conns.append(a)

    def answer(c: int):
        try:
            return conns[c].recv()
        except EOFError:
            for p in procs:
                p.kill()
                p.join()
            why = f"; the OOM killer if the limit was too low: {RunCgroups.result(cg)}" if cg is not None else ""
            raise SystemExit(f"lookup_bench: RocksDB client {c} died (exit {procs[c].exitcode}{why})") from None

    for c in range(clients):
        assert answer(c) == "ready"
    t0 = time.perf_counter()
    start.set()
    lats = [answer(c) for c in range(clients)]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    return {"wall_s": wall, "latency_s": [x for lat in lats for x in lat], "block_cache_bytes": block * clients,
            "row_cache_bytes": row * clients}


def check_same(job: str, path: str, batches: list, dim: int) -> int:
    import hps
    import rocksdict as r
    db = r.Rdict(path, options=r.Options(raw_mode=True), access_type=r.AccessType.read_only())
    with hps.Lookup(job, memory_budget="8MiB") as lk:
        n = 0
        for b in batches:
            rows, found = lk.lookup(b)
            vals = db.get(be_keys(b))
            assert found.all() and all(v is not None for v in vals)
            theirs = np.frombuffer(b"".join(vals), np.float32).reshape(len(b), dim)
            if not np.array_equal(rows, theirs):
                raise AssertionError("hps.Lookup and RocksDB disagree on a row")
            n += len(b)
    db.close()
    return n


def summary(res: dict, n_keys: int) -> dict:
    lat = np.array(res.pop("latency_s"))
    return {**res, "keys_per_s": n_keys / res["wall_s"], "p50_ms": float(np.percentile(lat, 50) * 1e3),
            "p99_ms": float(np.percentile(lat, 99) * 1e3), "batches": len(lat)}


MEASURES = ("keys_per_s", "p50_ms", "p99_ms")


def over_runs(runs: list) -> dict:
    """A store's runs on one distribution: the last run's details, each measure's
    median with its min and max, and every run's measures."""
    out = dict(runs[-1])
    if all("cgroup" in r for r in runs):
        peaks = [r["cgroup"]["peak_bytes"] for r in runs]
        out.update(cgroup_peak_bytes=max(peaks), cgroup_oom_kills=sum(r["cgroup"]["oom_kills"] for r in runs))
    for m in MEASURES:
        vals = [r[m] for r in runs]
        out.update({m: float(np.median(vals)), f"{m}_min": min(vals), f"{m}_max": max(vals)})
    out["runs"] = [{m: r[m] for m in MEASURES} for r in runs]
    return out


def paired_ratios(h: dict, r: dict) -> dict:
    """hps over RocksDB, run by run (each pair ran side by side): medians, min-max."""
    out = {}
    for name, m in (("keys_per_s", "keys_per_s"), ("p99", "p99_ms")):
        per = [a[m] / b[m] for a, b in zip(h["runs"], r["runs"])]
        out.update({name: float(np.median(per)), f"{name}_min": min(per), f"{name}_max": max(per), f"{name}_runs": per})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch-keys", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--memory-ratio", type=float, default=4.0, help="the rows' bytes over the lookup's memory")
    ap.add_argument("--dists", default="uniform,zipf")
    ap.add_argument("--stores", default="hps,rocksdb")
    ap.add_argument("--dir", help="where the job and the database go (default: a temporary directory)")
    ap.add_argument("--writer", action="store_true",
                    help="a process pushes to the job and checkpoints meanwhile; the lookup refreshes")
    ap.add_argument("--checkpoint-every", type=int, default=20, help="the writer's pushes per checkpoint")
    ap.add_argument("--refresh-s", type=float, default=0.5, help="seconds between the lookup's refreshes (--writer)")
    ap.add_argument("--cgroup", metavar="LIMIT", help="run every store's runs in a memory cgroup with this hard "
                                                        "limit (e.g. 512MiB); needs root and a memory controller")
    ap.add_argument("--repeats", type=int, help="runs of each store per distribution, interleaved (default 3; "
                                                  "1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="a small run for CI: 100k rows, 20 batches, 1 run")
    a = ap.parse_args(argv)
    if a.quick:
        a.rows, a.batches, a.warmup, a.clients = 100_000, 20, 5, 2
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    cgroups = None
    if a.cgroup is not None:
        from hps.config import parse_bytes
        try:
            cgroups = RunCgroups(parse_bytes(a.cgroup, "--cgroup"))
        except ValueError as e:
            ap.error(str(e))
    if a.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {a.repeats}")
    stores = a.stores.split(",")
    for s in stores:
        if s not in ("hps", "rocksdb"):
            ap.error(f"--stores: unknown store {s!r} (hps, rocksdb)")
    dists = a.dists.split(",")
    for d in dists:
        if d not in ("uniform", "zipf"):
            ap.error(f"--dists: unknown distribution {d!r} (uniform, zipf)")
    root = tempfile.mkdtemp(prefix="hps-lookup-bench-", dir=a.dir)
    try:
        job, rdb = os.path.join(root, "job"), os.path.join(root, "rocks")
        log(f"{a.rows:,} rows of dim {a.dim} into a job at {job}")
        build_s = make_job(job, a.rows, a.dim)
        budget = int(a.rows * a.dim * 4 / a.memory_ratio)
        out = {"bench": "lookup", "benchmark": "W11 lookup", "quick": a.quick, "repeats": a.repeats, "rows": a.rows, "dim": a.dim, "batch_keys": a.batch_keys, "batches": a.batches,
               "clients": a.clients, "memory_budget_bytes": budget, "memory_ratio": a.memory_ratio,
               "build_s": build_s, "cgroup_limit_bytes": cgroups.limit if cgroups else None, "results": {}}
        if "rocksdb" in stores:
            log("RocksDB bulk load (SstFileWriter, ingest)")
            out["rocksdb_load_s"], _ = load_rocksdb(job, rdb, a.dim)
            rdb = os.path.join(rdb, "db")
        work = {dist: (batches_of(dist, a.rows, a.batches, a.batch_keys, 100 + d_i),
                       batches_of(dist, a.rows, a.warmup, a.batch_keys, 200 + d_i)) for d_i, dist in enumerate(dists)}
        if "rocksdb" in stores and "hps" in stores:  # before any writer changes the rows
            out["checked_keys"] = sum(check_same(job, rdb, batches[:3], a.dim) for batches, _ in work.values())
        writer = Writer(job, a.dim, a.rows, a.checkpoint_every) if a.writer else None
        try:
            for dist, (batches, warmup) in work.items():
                n_keys = sum(len(b) for b in batches)
                runs = {store: [] for store in stores}
                for rep in range(a.repeats):
                    for store in (stores if rep % 2 == 0 else stores[::-1]):
                        log(f"{store}, {dist}, run {rep + 1} of {a.repeats}: {a.batches} batches of {a.batch_keys} "
                            f"keys, {a.clients} clients" + (", a writer checkpointing meanwhile" if writer else ""))
                        cg = cgroups.new() if cgroups else None
                        try:
                            if store == "rocksdb":
                                res = run_rocks(rdb, budget, batches, warmup, a.clients, cg)
                            elif cg is not None:
                                res = in_cgroup(cg, run_hps, job, budget, batches, warmup, a.clients,
                                                a.refresh_s if writer else 0.0)
                            else:
                                res = run_hps(job, budget, batches, warmup, a.clients, a.refresh_s if writer else 0.0)
                            if cg is not None:
                                res["cgroup"] = RunCgroups.result(cg)
                        finally:
                            if cg is not None:
                                cg.remove()
                        runs[store].append(summary(res, n_keys))
                for store in stores:
                    out["results"][f"{store}/{dist}"] = over_runs(runs[store])
        finally:
            if writer:
                out["writer"] = writer.finish()
        for dist in dists:
            h, r = out["results"].get(f"hps/{dist}"), out["results"].get(f"rocksdb/{dist}")
            if h and r:
                out["results"][f"ratio/{dist}"] = paired_ratios(h, r)
        out["provenance"] = provenance()
        print(json.dumps(out))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
