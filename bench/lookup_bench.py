#!/usr/bin/env python3
"""Lookups of batches of keys from a trained store 4x larger than the lookup's
memory: hps.Lookup (its MemCache in front of the checkpoint's SSD-PS files)
against RocksDB's multi_get at equal memory (issue 20).

    python3 bench/lookup_bench.py --quick
    python3 bench/lookup_bench.py --rows 8000000 --batches 400 --clients 4

Workload:
  * the store: a ParameterServer of --rows keys (key(i) = splitmix64's finaliser of
    i + seed, distinct), every row pushed once (SGD), one checkpoint; rows of
    --dim float32 (256 bytes at dim 64), and their embeddings are what is looked up;
    with --writer train, the job of an `hps train` run instead (below);
  * memory: the lookup's budget is a quarter of the rows' bytes (--memory-ratio 4),
    and it covers all the lookup holds (hps.lookup's docstring): the key index and
    files' metadata, the read buffers of --clients concurrent reads, the reserve a
    refresh opens the next checkpoint in, and the row cache, which gets the rest.
    The index (10-byte slots in 2^16 shards, about 21 bytes a key at 4M keys) is
    why the default is dim 64: at dim 16 the index alone outgrows a quarter of the
    rows and hps.Lookup refuses the budget. RocksDB gets the same bytes as block
    cache (3/4) and row cache (1/4), split evenly over its client processes;
  * RocksDB as its experts run it for point reads (bench/rocks_tuned.py,
    rocks_tuned_options): the same rows bulk-loaded sorted through SstFileWriter
    and ingested (nothing left to compact), bloom filters, 4 KiB blocks, direct
    reads so the page cache does not act as a hidden cache, no compression, every
    table open; read-only instances, one per client process (rocksdict holds the
    GIL through a multi_get), each a multi_get of the batch's 4096 big-endian keys;
  * hps.Lookup: the same clients as threads of one process (its reads release
    the GIL) sharing one Lookup with read_threads = --clients;
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

  * the lookup's memory, measured: each hps run records its process's resident
    set just before it opens the Lookup (after its batches are in memory, and with
    the kernel's peak-RSS mark reset there, /proc/self/clear_refs) and the peak
    after the run: `measured_bytes` is the growth, `within_budget` whether it is at
    most the budget. With --cgroup it is the run's cgroup peak over the cgroup's
    usage at the same moment instead (page cache charged to the run included).
    It holds the clients' own arrays too (each batch's keys, rows returned and
    their temporaries, some 3 MiB a client at 4096 keys of dim 64) and the heap's
    slack: an upper bound of the lookup's own memory. torch, which the Lookup
    imports to read the step of a checkpoint older than trainer-step.json, is
    imported before the baseline (code, not the lookup's data). `memory` gives hps.Lookup's own split and the most
    it held by that accounting (stats()["memory"]).

  * --writer push: a process reopens the job's parameter server and pushes batches
    of 4096 uniform keys, checkpointing every --checkpoint-every pushes (the
    training side's disk and CPU load, and new checkpoints), during every run of
    both stores; hps.Lookup refreshes to each new checkpoint every --refresh-s
    seconds. (`--writer` alone is push.)
  * --writer train: `hps train` itself (python -m hps.cli train --resume) trains a
    CTR model on synthetic Criteo-like data whose 26 fields' vocabularies add up
    to --rows keys, at the job directory the lookups read, checkpointing every
    --checkpoint-every batches of --train-batch examples (SGD, so a row is its
    embedding as in the push store). The job is made by a first `hps train` run of
    one batch (its layout and dense state), then every key of the vocabularies is
    pushed once by the bench's loader and checkpointed with that dense state, so
    the store holds every key the data can draw; RocksDB is loaded from that
    checkpoint (the same rows at the start), and the lookups draw the same keys.
    Training then resumes and runs for the whole bench; the lookup refreshes to its
    checkpoints. `writer` reports its checkpoints, batches and examples trained, and
    each hps run its refreshes.
  * --min-refreshes N (with a writer; default 1 with --quick, else 0): an hps run's
    refresher goes on after its lookups until it has moved to a newer checkpoint N
    times (at most REFRESH_WAIT_S seconds, then the bench fails), so that a CI run
    shows a refresh however slowly a loaded machine's writer checkpoints; the
    lookups' figures are taken before that wait.

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
import subprocess
import threading
import time

import numpy as np

from _provenance import provenance  # (bench/ is sys.path[0])
from hps.data import mix64

SEED = 0x5EED_4321
ZIPF_A = 1.05
ZIPF_PERM = 2654435761  # prime; rank r -> index (r * P) mod N
REFRESH_WAIT_S = 120  # the longest an hps run waits for its --min-refreshes after its lookups


def keys_of(idx: np.ndarray) -> np.ndarray:
    return mix64(idx.astype(np.uint64) + np.uint64(SEED))


def be_keys(keys: np.ndarray) -> list:
    """RocksDB's keys: 8 bytes big-endian (so that key order is numeric order)."""
    b = keys.astype(">u8").tobytes()
    return [b[i:i + 8] for i in range(0, len(b), 8)]


def batches_of(dist: str, n_rows: int, count: int, size: int, seed: int, space=None) -> list:
    """Batches of keys: key(i), or space[i] when a key space is given (--writer train)."""
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
        out.append(keys_of(idx) if space is None else space[idx])
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
    conn.send({"mode": "push", "pushes": pushes, "checkpoints": checkpoints})


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


# ---------------------------------------------------------------- hps train meanwhile

FIELDS = 26


def train_vocab(rows: int) -> list:
    """26 fields' vocabularies adding up to `rows` keys, the missing-value key of
    each field included (the synthetic data draws it for 5% of values)."""
    ids = rows - FIELDS
    return [ids // FIELDS + (f < ids % FIELDS) for f in range(FIELDS)]


def train_keys(vocab: list) -> np.ndarray:
    """Every key the synthetic data of these vocabularies can draw (hps.data.keys)."""
    from hps.data.keys import _field_tag, _keys
    parts = []
    for f, v in enumerate(vocab):
        tag = _field_tag(f)
        parts.append(_keys(tag, np.arange(v, dtype=np.uint64), None))
        parts.append(_keys(tag, np.zeros(1, np.uint64), np.ones(1, bool)))
    keys = np.concatenate(parts)
    assert len(np.unique(keys)) == len(keys)
    return keys


TRAIN_TOML = """# written by bench/lookup_bench.py --writer train
hidden = [32]
torch_threads = 1
eval_every = 0
checkpoint_every = {every}

[ps]
dim = {dim}
path = "{path}"
mem_budget = "64MiB"
write_buffer_rows = 65536

[ps.optimizer]
kind = "sgd"
lr = 0.05

[data]
source = "synthetic"
batch_size = {batch}
train_examples = {examples}
eval_examples = {batch}
vocab_sizes = {vocab}
"""


def hps_train(config: str, *flags: str, **popen):
    cmd = [sys.executable, "-m", "hps.cli", "train", "--config", config, "--no-progress", *flags]
    return subprocess.Popen(cmd, **popen)


def make_train_job(root: str, job: str, rows: int, dim: int, batch: int, every: int) -> tuple[float, str, np.ndarray]:
    """The job `hps train` resumes: a first run of one batch (the layout, the dense
    state), then every key of the vocabularies pushed once and checkpointed with
    that run's dense state. Returns (seconds, the config, the keys)."""
    import hps
    from hps.train import TRAINER_STATE
    vocab = train_vocab(rows)
    config = os.path.join(root, "train.toml")
    with open(config, "w") as f:
        f.write(TRAIN_TOML.format(every=every, dim=dim, path=job, batch=batch, examples=10 ** 12, vocab=vocab))
    t0 = time.perf_counter()
    p = hps_train(config, "--examples", str(batch), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"lookup_bench: the first hps train run failed:\n{err[-3000:]}")
    keys = train_keys(vocab)
    ps = hps.ParameterServer.open(job, mem_budget="64MiB")
    with open(os.path.join(ps.checkpoint_dir(), TRAINER_STATE), "rb") as f:
        dense = f.read()
    chunk = 1 << 16
    for s in range(0, len(keys), chunk):
        k = keys[s:s + chunk]
        ps.push(k, np.ones((len(k), dim), np.float32))

    def save(directory: str) -> None:
        with open(os.path.join(directory, TRAINER_STATE), "wb") as f:
            f.write(dense)
            f.flush()
            os.fsync(f.fileno())

    ps.checkpoint(save)
    ps.close()
    return time.perf_counter() - t0, config, keys


class TrainWriter:
    """`hps train --resume` at the job, for the whole bench (--writer train)."""

    def __init__(self, job: str, config: str, batch: int):
        from hps import jobdir
        self.job, self.batch = job, batch
        first = jobdir.read_job(job)
        self.checkpoint0, self.step0 = first.checkpoint, jobdir.step_of(first)
        self.log = tempfile.TemporaryFile("w+")
        self.t0 = time.perf_counter()
        self.proc = hps_train(config, "--resume", stdout=self.log, stderr=subprocess.STDOUT, text=True)
        while jobdir.read_job(job).checkpoint == self.checkpoint0:  # training is under way: lookups start
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"lookup_bench: hps train --resume failed:\n{self.log.read()[-3000:]}")
            time.sleep(0.1)

    def finish(self) -> dict:
        from hps import jobdir
        wall = time.perf_counter() - self.t0
        exited = self.proc.poll()
        if exited is None:
            self.proc.terminate()  # mid-batch: the last finished checkpoint stands
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.seek(0)
        tail = self.log.read()[-3000:]
        self.log.close()
        if exited is not None:
            raise SystemExit(f"lookup_bench: hps train ended before the lookups did (exit {exited}):\n{tail}")
        last = jobdir.read_job(self.job)
        step = jobdir.step_of(last)
        return {"mode": "train", "wall_s": wall, "checkpoints": last.checkpoint - self.checkpoint0,
                "first_checkpoint": self.checkpoint0, "last_checkpoint": last.checkpoint,
                "batches_checkpointed": step - self.step0, "examples_checkpointed": (step - self.step0) * self.batch}


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


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _cgroup_bytes(cg, peak: bool) -> int:
    names = (("memory.max_usage_in_bytes", "memory.peak") if peak else ("memory.usage_in_bytes", "memory.current"))
    return int(cg._read(names[cg.version - 1]))


def run_hps(job: str, budget: int, batches: list, warmup: list, clients: int, refresh_s: float = 0.0,
            cg=None, min_refreshes: int = 0) -> dict:
    import gc
    import hps
    try:  # loaded by the Lookup to read hps train's step: code, loaded before the baseline (docstring)
        import torch  # noqa: F401
    except ImportError:
        pass
    gc.collect()
    try:  # the peak-RSS mark (VmHWM) starts again from the resident set now
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    rss0 = _status_bytes("VmRSS")
    cg0 = _cgroup_bytes(cg, peak=False) if cg is not None else None
    lk = hps.Lookup(job, memory_budget=budget, read_threads=clients)
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
    # (--min-refreshes: the writer's next checkpoint may come after the lookups ended)
    deadline = time.monotonic() + REFRESH_WAIT_S
    while helper and len(refresh_times) < min_refreshes and time.monotonic() < deadline:
        time.sleep(refresh_s)
    done.set()
    if helper:
        helper.join()
    if len(refresh_times) < min_refreshes:
        raise SystemExit(f"lookup_bench: the lookup refreshed to a newer checkpoint {len(refresh_times)} time(s), "
                         f"--min-refreshes is {min_refreshes}: the writer made none in {REFRESH_WAIT_S} s after "
                         f"the lookups")
    s = lk.stats()
    rss_growth = _status_bytes("VmHWM") - rss0 if hwm_reset else None
    cg_growth = _cgroup_bytes(cg, peak=True) - cg0 if cg is not None else None
    lk.close()
    measured = cg_growth if cg is not None else rss_growth
    cache = s["cache"]
    return {"measured_bytes": measured, "measured_by": "cgroup" if cg is not None else "rss",
            "rss_growth_bytes": rss_growth, "cgroup_growth_bytes": cg_growth,
            "within_budget": measured is not None and measured <= budget, "memory": s["memory"],
            "blocking_refreshes": s["blocking_refreshes"], "wall_s": wall, "latency_s": lat, "cache_rows": cache["size"], "cache_capacity": cache["capacity"],
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


def check_same(job: str, path: str, batches: list, dim: int, budget: int) -> int:
    import hps
    import rocksdict as r
    db = r.Rdict(path, options=r.Options(raw_mode=True), access_type=r.AccessType.read_only())
    with hps.Lookup(job, memory_budget=budget, read_threads=1) as lk:  # one client checks
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
    if all("measured_bytes" in r for r in runs):  # hps: its own memory, the most any run measured
        measured = [r["measured_bytes"] for r in runs]
        out.update(measured_bytes=None if None in measured else max(measured),
                   within_budget=all(r["within_budget"] for r in runs))
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
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch-keys", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--memory-ratio", type=float, default=4.0, help="the rows' bytes over the lookup's memory")
    ap.add_argument("--dists", default="uniform,zipf")
    ap.add_argument("--stores", default="hps,rocksdb")
    ap.add_argument("--dir", help="where the job and the database go (default: a temporary directory)")
    ap.add_argument("--writer", nargs="?", const="push", choices=("push", "train"),
                    help="push: a process pushes to the job and checkpoints meanwhile; train: `hps train` "
                         "trains at the job and checkpoints meanwhile; the lookup refreshes (--writer alone: push)")
    ap.add_argument("--checkpoint-every", type=int, default=20,
                    help="the writer's pushes (push) or batches (train) per checkpoint")
    ap.add_argument("--train-batch", type=int, default=1024, help="examples a batch of --writer train")
    ap.add_argument("--refresh-s", type=float, default=0.5, help="seconds between the lookup's refreshes (--writer)")
    ap.add_argument("--min-refreshes", type=int,
                    help="refreshes to a newer checkpoint an hps run waits for after its lookups (--writer; "
                         "default 1 with --quick, else 0)")
    ap.add_argument("--cgroup", metavar="LIMIT", help="run every store's runs in a memory cgroup with this hard "
                                                        "limit (e.g. 512MiB); needs root and a memory controller")
    ap.add_argument("--repeats", type=int, help="runs of each store per distribution, interleaved (default 3; "
                                                  "1 with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="a small run for CI: 200k rows, 20 batches, 1 run, memory equal to the rows' bytes (the "
                         "key index's 2^16 shards take some 12 MiB however few the keys, twice over for a refresh, "
                         "and calls' working memory some 1.6 MiB a client: a quarter of a small store leaves the "
                         "cache nothing)")
    a = ap.parse_args(argv)
    if a.quick:
        a.rows, a.batches, a.warmup, a.clients, a.memory_ratio = 200_000, 20, 5, 2, 1.0
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    if a.min_refreshes is None:
        a.min_refreshes = 1 if a.quick and a.writer else 0
    if a.min_refreshes < 0 or (a.min_refreshes and not a.writer):
        ap.error(f"--min-refreshes must be >= 0, and needs --writer (got {a.min_refreshes})")
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
        space = None
        if a.writer == "train":
            log(f"an hps train job of {a.rows:,} keys of dim {a.dim} at {job}")
            build_s, train_config, space = make_train_job(root, job, a.rows, a.dim, a.train_batch, a.checkpoint_every)
        else:
            log(f"{a.rows:,} rows of dim {a.dim} into a job at {job}")
            build_s = make_job(job, a.rows, a.dim)
        budget = int(a.rows * a.dim * 4 / a.memory_ratio)
        out = {"bench": "lookup", "benchmark": "W11 lookup", "quick": a.quick, "repeats": a.repeats, "rows": a.rows, "dim": a.dim, "batch_keys": a.batch_keys, "batches": a.batches,
               "clients": a.clients, "min_refreshes": a.min_refreshes, "memory_budget_bytes": budget, "memory_ratio": a.memory_ratio,
               "build_s": build_s, "cgroup_limit_bytes": cgroups.limit if cgroups else None, "results": {}}
        if "rocksdb" in stores:
            log("RocksDB bulk load (SstFileWriter, ingest)")
            out["rocksdb_load_s"], _ = load_rocksdb(job, rdb, a.dim)
            rdb = os.path.join(rdb, "db")
        work = {dist: (batches_of(dist, a.rows, a.batches, a.batch_keys, 100 + d_i, space),
                       batches_of(dist, a.rows, a.warmup, a.batch_keys, 200 + d_i, space))
                for d_i, dist in enumerate(dists)}
        del space
        if "rocksdb" in stores and "hps" in stores:  # before any writer changes the rows
            out["checked_keys"] = sum(check_same(job, rdb, batches[:3], a.dim, budget) for batches, _ in work.values())
        if a.writer == "train":
            writer = TrainWriter(job, train_config, a.train_batch)
        elif a.writer == "push":
            writer = Writer(job, a.dim, a.rows, a.checkpoint_every)
        else:
            writer = None
        try:
            for dist, (batches, warmup) in work.items():
                n_keys = sum(len(b) for b in batches)
                runs = {store: [] for store in stores}
                for rep in range(a.repeats):
                    for store in (stores if rep % 2 == 0 else stores[::-1]):
                        log(f"{store}, {dist}, run {rep + 1} of {a.repeats}: {a.batches} batches of {a.batch_keys} "
                            f"keys, {a.clients} clients" + (f", a {a.writer} writer checkpointing meanwhile" if writer else ""))
                        cg = cgroups.new() if cgroups else None
                        try:
                            if store == "rocksdb":
                                res = run_rocks(rdb, budget, batches, warmup, a.clients, cg)
                            elif cg is not None:
                                res = in_cgroup(cg, run_hps, job, budget, batches, warmup, a.clients,
                                                a.refresh_s if writer else 0.0, cg, a.min_refreshes)
                            else:
                                res = run_hps(job, budget, batches, warmup, a.clients, a.refresh_s if writer else 0.0,
                                              min_refreshes=a.min_refreshes)
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
