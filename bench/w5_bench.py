#!/usr/bin/env python3
"""W5 (BENCHMARKS.md): end-to-end training with a table 4x larger than the MEM-PS
budget, so that hps must use SSD-PS, against the same model reading and writing
its embeddings through RocksDB, inside the same memory cgroup, and against W4's
in-memory run of hps, in the same run.

    python3 bench/w5_bench.py --quick                 # 200k examples, one round, ~1-2 minutes
    python3 bench/w5_bench.py                         # 1M examples, two rounds, ~9 minutes
    python3 bench/w5_bench.py --mlp 16 --memory-limit 1.5GiB --repeat 3

On a shared machine: nice -n 19 flock /tmp/hps-bench.lock python3 bench/w5_bench.py

Model and data (every run): hps.data.SyntheticCriteo (seed 0, batch 4096, default
vocabularies). The driver generates the training examples once and writes them to
three flat files in the data directory (labels, dense, keys: 264 B an example);
every worker maps them and copies out one batch at a time, never holding the
whole stream (the cgroup is small). 26 fields, one key each, embeddings of dim
16 summed per field, concatenated with the 13 dense features, MLP (default
512-256-1) to a logit; embeddings by AdaGrad (lr 0.05, eps 1e-10, accumulator
from 0), the MLP by Adam (lr 1e-3, hps.tuning.dense_adam on every side), the MLP
initialised from the same seed (hps.torch.CtrModel's init);
evaluation on 50k held-out examples (the generator's "eval" part).

Sizing. As it writes the training examples, the driver counts the distinct keys
they touch (R rows). In MEM-PS a row costs 128 B (16 embedding +
16 AdaGrad floats) plus ~112 B of bookkeeping (hps.MemCache.capacity_for_budget),
so the table is R * 240 B there; the hps MEM budget is a quarter of that.

Runs, each a worker process that prints one JSON line (the driver prints the
final JSON line with every raw figure and the ratios):
  * hps_ssd: hps.train.train (the 4-stage pipeline, ParameterServer with the
    budget above); inside the memory cgroup.
  * rocksdb, rocksdb_rowcache: the same model in plain PyTorch, embeddings in
    RocksDB (rocksdict, raw mode, keys as 8-byte big-endian), pipelined like
    hps: while batch i trains (forward/backward, AdaGrad on (emb, acc) in numpy,
    Adam on the MLP), a prefetch process (the database's owner; rocksdict holds
    the GIL through a multi-get, so a thread would stall the trainer; see
    --rocks-prefetch) writes batch i-1's updated rows back in
    one WriteBatch (sync off, WAL off: like hps between checkpoints, a crash may
    lose recent batches) and multi-gets batch i+1's distinct keys (absent keys
    initialised uniform(-0.01, 0.01) from a hash of the key, accumulator 0);
    keys of batch i+1 that batch i updated then take batch i's rows, so the
    result is the serial loop's (--rocks-prefetch serial runs that loop). Tuned as W1's
    rocksdb_tuned (rocks_tuned.rocks_tuned_options: bloom filters, direct
    reads and direct flush/compaction I/O, no compression, every option set
    explicitly), with block cache + row cache + memtables equal to hps's memory
    for rows (MEM budget + write buffer), split per run (rocks_memory()); inside
    the same memory cgroup. The peer of the ratio is the best of the two in each
    round. Its examples/s counts the training loop only, not the copy of each
    batch out of the files (hps's pipeline copies them on its read thread,
    overlapped).
  * hps_mem: W4's in-memory run of hps (MEM budget for every row), run the
    same way but outside the cgroup (--in-memory-cgroup puts it inside).

Memory limit: 1 GiB by default (W1's), via W1's MemCgroup (cgroup v1 or v2).
Each limited worker charges ~0.5 GB at its peak, most of it torch,
so no limit that lets torch run can be below the table's bytes; what keeps the
page cache from serving table reads is that both stores read with O_DIRECT.

The runs go in rounds (--repeat, default 2; --quick 1), interleaved so that a
noisy neighbour hurts every run alike: examples/s is the median over rounds
with its min-max, and a ratio the median of the same-round ratios. A worker killed by SIGKILL (the OOM killer) is recorded as
"oom". Without root or a memory cgroup controller, everything runs without the
limit and the JSON says so. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ssd_store_bench import MemCgroup, du_bytes  # W1's memory cgroup, and du
from _provenance import provenance  # commit, date, machine, command of the JSON line

DIM = 16
ROW_FLOATS = 2 * DIM                 # embedding + AdaGrad accumulator
ROW_BYTES = 4 * ROW_FLOATS           # 128
MEM_OVERHEAD_PER_ROW = 112           # hps MEM-PS bookkeeping (src/cache/mem_cache.cc kOverheadPerRow)
FIELDS, DENSE = 26, 13
INIT_SCALE = 0.01
ADAGRAD_EPS = 1e-10
W4_MEM_ROWS = 2_000_000              # bench/train_bench.py's in-memory budget, in rows
GOLD = np.uint64(0x9E3779B97F4A7C15)
INIT_SALT = np.uint64(0x5EED_0005)
RUNS = ("hps_ssd", "rocksdb", "rocksdb_rowcache", "hps_mem")
ROCKS_RUNS = ("rocksdb", "rocksdb_rowcache")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


from hps.config import parse_bytes  # noqa: E402  sizes such as '1.5GiB', as every hps config reads them
from hps.data import mix64  # noqa: E402  splitmix64's finaliser: the RocksDB peer's row initialiser


def proc_io() -> dict:
    """This process's I/O counters (all threads): read_bytes/write_bytes are what
    reached the block layer, O_DIRECT included, so both stores are measured alike."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def io_delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in ("read_bytes", "write_bytes", "rchar", "wchar") if k in a and k in b}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_mlp(hidden, seed):
    """The MLP of hps.torch.CtrModel: same layers, same initialisation from `seed` alone."""
    from hps.torch import mlp
    return mlp(FIELDS * DIM + DENSE, hidden, seed)


# ------------------------------------------------------------------ sizing
STREAM_FILES = (("labels", np.float32, ()), ("dense", np.float32, (DENSE,)), ("keys", np.uint64, (FIELDS,)))


def write_stream_and_count_keys(directory: str, examples: int, eval_examples: int, batch_size: int,
                                seed: int) -> dict:
    """Writes the training examples to directory/{labels,dense,keys}.bin (read back by
    stream_batches) and counts the distinct keys of the training stream (and of train
    + eval): per-batch uniques are merged every 32 batches, so only the distinct keys
    are ever held."""
    from hps.data import SyntheticCriteo
    t0 = time.perf_counter()
    acc, pending = np.empty(0, np.uint64), []
    per_batch = []
    with contextlib.ExitStack() as stack:
        files = {name: stack.enter_context(open(os.path.join(directory, f"{name}.bin"), "wb"))
                 for name, _, _ in STREAM_FILES}
        for b in SyntheticCriteo(seed=seed, batch_size=batch_size, examples=examples):
            for name, dtype, _ in STREAM_FILES:
                files[name].write(np.ascontiguousarray(getattr(b, name), dtype).data)
            pending.append(np.unique(b.keys))
            per_batch.append(len(pending[-1]))
            if len(pending) >= 32:
                acc = np.unique(np.concatenate([acc] + pending))
                pending = []
    acc = np.unique(np.concatenate([acc] + pending))
    ev = [np.unique(b.keys) for b in SyntheticCriteo(seed=seed, batch_size=batch_size,
                                                    examples=eval_examples, part="eval")]
    ev = np.unique(np.concatenate(ev)) if ev else np.empty(0, np.uint64)
    return {"train_rows": len(acc), "eval_rows": len(ev), "union_rows": len(np.union1d(acc, ev)),
            "distinct_keys_per_batch_mean": float(np.mean(per_batch)) if per_batch else 0.0,
            "seconds": time.perf_counter() - t0}


def stream_batches(directory: str, examples: int, batch_size: int):
    """The training batches write_stream_and_count_keys wrote, each copied out of the
    mapped files (the copy is the whole cost of reading: the files were just written)."""
    from hps.data import Batch
    maps = {name: np.memmap(os.path.join(directory, f"{name}.bin"), dtype, "r", shape=(examples, *shape))
            for name, dtype, shape in STREAM_FILES}
    for i in range(0, examples, batch_size):
        yield Batch(*(np.array(maps[name][i:i + batch_size]) for name in ("labels", "dense", "keys")))


# How each RocksDB run splits its memory (fractions of the total): block cache, row
# cache, memtables (two write buffers, since a memtable also serves reads of recent
# writes). "rocksdb" favours the block cache; "rocksdb_rowcache" the row cache,
# which holds a row rather than its 4 KiB block (more hot rows in the same bytes).
ROCKS_SPLITS = {"rocksdb": (0.5, 0.25, 0.25), "rocksdb_rowcache": (0.125, 0.625, 0.25)}


def rocks_memory(total: int, run: str = "rocksdb") -> dict:
    """RocksDB's memory for caching, sized to `total` bytes (the hps MEM budget plus
    hps's write buffer by default), so that neither store holds more of the table in
    memory, split as ROCKS_SPLITS[run]. W1's rocksdb_tuned sizes (256 MiB + 64 MiB +
    3 x 64 MiB) would here hold the whole table in memory."""
    block, row, memtables = ROCKS_SPLITS[run]
    return {"split": run, "block_cache_bytes": max(1 << 20, int(total * block)),
            "row_cache_bytes": max(1 << 20, int(total * row)),
            "write_buffer_size": max(1 << 20, int(total * memtables) // 2), "max_write_buffer_number": 2}


def hps_write_buffer_bytes(rows: int) -> int:
    """What hps's BackingStore write buffer holds when full: a key (8 B) and a row
    per entry (include/hps/backing_store.h: keys_ and rows_), its index aside."""
    return rows * (8 + ROW_BYTES)


# ------------------------------------------------------------------ worker: hps
def worker_hps(cfg: dict) -> dict:
    import hps
    from hps.train import DataConfig, TrainConfig, Trainer, train

    # The PS and I/O counters at the end of training, before the final evaluation
    # (train() evaluates, then checkpoints: both would blur the training figures).
    at_train_end: dict = {}
    evaluate = Trainer.evaluate

    def evaluate_after_snapshot(self, batches):
        if not at_train_end:
            at_train_end["ps"] = self.ps.stats()
            at_train_end["io"] = proc_io()
        return evaluate(self, batches)

    Trainer.evaluate = evaluate_after_snapshot

    path = os.path.join(cfg["dir"], "ps")
    tc = TrainConfig(
        ps=hps.ParameterServerConfig(dim=DIM, path=path, optimizer=hps.AdaGrad(lr=cfg["lr_emb"], eps=ADAGRAD_EPS),
                                     initializer=hps.Uniform(INIT_SCALE), mem_budget=cfg["mem_budget"],
                                     write_buffer_rows=cfg["write_buffer_rows"], device_capacity=1 << 20),
        data=DataConfig(batch_size=cfg["batch_size"], train_examples=cfg["examples"],
                        eval_examples=cfg["eval_examples"], seed=cfg["seed"]),
        hidden=tuple(cfg["hidden"]), dense_lr=cfg["lr_dense"], seed=cfg["seed"],
        torch_threads=cfg["hps_threads"], pipelined=True)
    io0 = proc_io()
    summary = train(tc, progress=False,
                    train_batches=stream_batches(cfg["stream_dir"], cfg["examples"], cfg["batch_size"]))
    ps = at_train_end["ps"]
    counts, mem, ssd = ps["counts"], ps["mem"], ps["ssd"]
    return {
        "examples": summary["examples"], "seconds": summary["train_seconds"],
        "examples_per_s": summary["examples_per_s"],
        "auc": summary["final"]["auc"], "logloss": summary["final"]["logloss"],
        "mem_budget_bytes": cfg["mem_budget"], "mem_capacity_rows": mem["capacity"],
        "torch_threads": summary["torch_threads"],
        "pipeline": {k: summary["pipeline"][k] for k in
                     ("bound_by", "wall_over_slowest_stage", "busy_seconds", "mean_queue_depth", "prefetch_waits")},
        # at the end of training (before eval and the final checkpoint):
        "mem_hit_rate": mem["hits"] / max(1, mem["hits"] + mem["misses"]),
        "rows_initialised": counts["initialized"], "rows_from_ssd": counts["ssd_hits"],
        "rows_from_pending_writes": counts["pending_hits"],
        "ssd_bytes_read": ssd["bytes_read"], "ssd_bytes_written": ssd["bytes_written"],
        "ssd_rows_read": ssd["rows_read"], "ssd_rows_written": ssd["rows_written"],
        "ssd_compactions": ssd["compactions"], "ssd_io_path": ssd["io_path"],
        "mem_evictions": mem["evictions"], "mem_dirty_evictions": mem["dirty_evictions"],
        # Counted apart by MemCache, the backing store and SSD-PS, so that a test can
        # hold one against another: misses against rows loaded, rows cached against
        # the capacity the budget bought, rows sunk against rows put on SSD-PS.
        "mem_hits": mem["hits"], "mem_misses": mem["misses"], "rows_loaded": counts["mem_misses"],
        "mem_rows_cached": mem["size"], "mem_rows_flushed": mem["rows_flushed"],
        "ssd_rows_put": counts["ssd_rows_put"], "rows_pending_write": ps["pending_rows"],
        "process_io_in_training": io_delta(io0, at_train_end["io"]),
        # as train() left them (after eval and its final checkpoint):
        "final_eval_entry": {k: v for k, v in summary["final"].items() if k != "stages"},
        "ps_stats_end": summary["ps"],
        "disk_bytes_end": du_bytes(path),
    }


# ------------------------------------------------------------------ worker: RocksDB
class RocksRows:
    """Rows of 32 float32 (embedding, AdaGrad accumulator) per uint64 key in RocksDB."""

    def __init__(self, path: str, mem: dict, wal: bool):
        import rocksdict as r
        from rocks_tuned import rocks_tuned_options  # W1's tuned options, every one explicit
        self.r = r
        # Filters kept on every level: most keys of the first batches are new, and a
        # filter answers "absent" without a read.
        opt, self._caches, self.options = rocks_tuned_options(
            mem["block_cache_bytes"], mem["row_cache_bytes"], mem["write_buffer_size"],
            mem["max_write_buffer_number"], filters_for_hits=False)
        self.options.update({
            "split": mem["split"], "sync": False, "disable_wal": not wal,
            "get": "Rdict.get(list of 8-byte big-endian keys): one multi-get per batch (RowServer.step)",
            "put": "one WriteBatch per batch, db.write(wb, WriteOptions(sync=False, disable_wal="
                   + str(not wal) + ")) (RowServer.step)",
            "durability": "like hps between checkpoints: a crash may lose the last batches"})
        self.db = r.Rdict(path, options=opt)
        self.write_opts = r.WriteOptions()
        self.write_opts.sync = False
        self.write_opts.disable_wal = not wal
        self.zero_row = bytes(ROW_BYTES)

    @staticmethod
    def key_bytes(keys: np.ndarray) -> list:
        # One bytes object per key without a Python slice per key: a void view's
        # tolist() yields bytes (an 'S8' view would strip trailing zero bytes).
        return keys.astype(">u8").view("V8").tolist()

    def get(self, kb: list) -> tuple[np.ndarray, np.ndarray]:
        vals = self.db.get(kb)
        found = np.fromiter((v is not None for v in vals), bool, len(vals))
        buf = b"".join(v if v is not None else self.zero_row for v in vals)
        rows = np.frombuffer(buf, np.float32).reshape(len(vals), ROW_FLOATS).copy()  # writable
        return rows, found

    def put(self, kb: list, rows: np.ndarray) -> None:
        wb = self.r.WriteBatch(raw_mode=True)
        for k, v in zip(kb, np.ascontiguousarray(rows).view(f"V{ROW_BYTES}").ravel().tolist()):
            wb.put(k, v)
        self.db.write(wb, self.write_opts)

    def properties(self) -> dict:
        out = {}
        for p in ("rocksdb.estimate-num-keys", "rocksdb.total-sst-files-size", "rocksdb.live-sst-files-size",
                  "rocksdb.block-cache-usage", "rocksdb.cur-size-all-mem-tables",
                  "rocksdb.estimate-table-readers-mem", "rocksdb.num-running-compactions"):
            try:
                out[p] = self.db.property_int_value(p)
            except Exception:  # noqa: BLE001 - a property this build lacks
                pass
        return out

    def close(self):
        self.db.close()


def initial_rows(keys: np.ndarray) -> np.ndarray:
    """(n, 32) float32: embedding uniform in [-0.01, 0.01) as a pure function of the key
    (16 hashes of (key, j), top 53 bits as the uniform), accumulator 0 -- vectorised,
    so that a new row needs no per-key Python or RNG object."""
    with np.errstate(over="ignore"):
        h = mix64((keys ^ INIT_SALT)[:, None] + np.arange(1, DIM + 1, dtype=np.uint64) * GOLD)
    u = (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    rows = np.zeros((len(keys), ROW_FLOATS), np.float32)
    rows[:, :DIM] = (2.0 * u - 1.0) * INIT_SCALE
    return rows


class RowServer:
    """The RocksDB side of the peer. One step writes back the batch before (its rows
    final) in one WriteBatch, then reads the next batch's distinct keys in one
    multi-get, new keys getting their initial rows."""

    def __init__(self, path: str, mem: dict, wal: bool):
        self.store = RocksRows(path, mem, wal)
        self.options = self.store.options

    def step(self, prev_keys, prev_rows, next_keys):
        """-> ((distinct keys, their rows, index of each key in them, found mask) of
        next_keys or None, seconds writing, seconds reading)."""
        t0 = time.perf_counter()
        if prev_keys is not None:
            self.store.put(self.store.key_bytes(prev_keys), prev_rows)
        t1 = time.perf_counter()
        nxt = None
        if next_keys is not None:
            uniq, inverse = np.unique(next_keys, return_inverse=True)
            rows, found = self.store.get(self.store.key_bytes(uniq))
            if not found.all():
                rows[~found] = initial_rows(uniq[~found])
            nxt = (uniq, rows, inverse.reshape(-1), found)
        return nxt, t1 - t0, time.perf_counter() - t1

    def properties(self) -> dict:
        return self.store.properties()

    def close(self):
        self.store.close()


def row_server_main(conn, path: str, mem: dict, wal: bool):
    """The prefetch process: serves RowServer's steps over `conn` until "close".
    rocksdict holds the GIL through a multi-get, so a thread would stall the
    trainer's Python; a process runs beside it on its own core."""
    server = RowServer(path, mem, wal)
    conn.send(server.options)
    while True:
        msg = conn.recv()
        if msg[0] == "step":
            conn.send(server.step(*msg[1:]))
        elif msg[0] == "properties":
            conn.send(server.properties())
        else:
            server.close()
            conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            return


class RowClient:
    """The trainer's handle on the row server: submit() starts a step, result()
    waits for it. mode "process" (default): a prefetch process owns the database;
    "thread": a prefetch thread in this process; "serial": the step runs inside
    result(), on the trainer's thread."""

    def __init__(self, mode: str, path: str, mem: dict, wal: bool):
        self.mode, self._job, self.server_peak_rss_bytes = mode, None, None
        if mode == "process":
            import multiprocessing as mp
            ctx = mp.get_context("spawn")  # no fork of a process running torch's threads
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=row_server_main, args=(child, path, mem, wal), daemon=True)
            self._proc.start()
            child.close()
            self.options = self._conn.recv()
        else:
            self._server = RowServer(path, mem, wal)
            self.options = self._server.options
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if mode == "thread" else None
        self.options = {**self.options, "prefetch": mode}

    def submit(self, prev_keys, prev_rows, next_keys):
        args = (prev_keys, prev_rows, next_keys)
        if self.mode == "process":
            self._conn.send(("step", *args))
        elif self.mode == "thread":
            self._job = self._pool.submit(self._server.step, *args)
        else:
            self._job = args

    def result(self):
        if self.mode == "process":
            return self._conn.recv()
        if self.mode == "thread":
            return self._job.result()
        return self._server.step(*self._job)

    def properties(self) -> dict:
        if self.mode == "process":
            self._conn.send(("properties",))
            return self._conn.recv()
        return self._server.properties()

    def close(self):
        if self.mode == "process":
            self._conn.send(("close",))
            self.server_peak_rss_bytes = self._conn.recv()
            self._proc.join()
        else:
            if self._pool:
                self._pool.shutdown()
            self._server.close()


def worker_rocksdb(cfg: dict) -> dict:
    import torch
    import torch.nn.functional as F
    from hps.data import SyntheticCriteo
    from hps.metrics import auc, logloss
    from hps.tuning import dense_adam
    from torch import nn
    torch.set_num_threads(cfg["threads"])
    path = os.path.join(cfg["dir"], "rocksdb")
    store = RowClient(cfg["rocks_prefetch"], path, cfg["rocks_memory"], wal=cfg["rocks_wal"])
    mlp = build_mlp(cfg["hidden"], cfg["seed"])
    opt = dense_adam(mlp.parameters(), cfg["lr_dense"])  # the dense step of hps.train (hps.tuning)
    loss_fn = nn.BCEWithLogitsLoss()
    lr = cfg["lr_emb"]

    def lookup(keys2d):
        """(distinct keys, their rows, index of each key in them, found mask), after
        the write-back the step before asked for."""
        store.submit(None, None, keys2d)
        return store.result()[0]

    def forward(emb, inverse, dense, n):
        pooled = F.embedding(torch.from_numpy(inverse.astype(np.int64)), emb).reshape(n, FIELDS * DIM)
        return mlp(torch.cat([pooled, torch.from_numpy(dense)], 1)).squeeze(1)

    def patch(nxt, cur):
        """The next batch's rows were read while this batch trained: a key of both
        takes this batch's updated row (what a serial loop would have read)."""
        cu, crows = cur[0], cur[1]
        nu, nrows = nxt[0], nxt[1]
        pos = np.minimum(np.searchsorted(cu, nu), len(cu) - 1)  # both sorted (np.unique)
        hit = cu[pos] == nu
        nrows[hit] = crows[pos[hit]]
        return hit

    # Per-phase times: the trainer's (forward_backward, adagrad, adam, and its wait
    # for the prefetch thread) and the prefetch thread's (lookup, write), busy
    # beside the trainer when pipelined.
    phase = dict.fromkeys(("first_lookup", "forward_backward", "adagrad", "adam", "wait_prefetch",
                           "lookup", "write", "last_write"), 0.0)
    n_ex = n_batches = rows_found = rows_new = rows_written = rows_patched = 0
    read_seconds = 0.0
    io0 = proc_io()
    t_wall = time.perf_counter()
    batches = stream_batches(cfg["stream_dir"], cfg["examples"], cfg["batch_size"])
    # Reading a batch out of the example files is outside the timed region (hps
    # overlaps it on its read thread): read_seconds is subtracted.
    t0 = time.perf_counter()
    b = next(batches, None)
    read_seconds += time.perf_counter() - t0
    t_train0 = time.perf_counter()
    cur = lookup(b.keys) if b is not None else None
    phase["first_lookup"] = time.perf_counter() - t_train0
    rows_new = 0 if cur is None else int((~cur[3]).sum())
    # Pipelined, step i writes back batch i-1 and reads batch i+1 while batch i
    # trains; serial, it writes back batch i, then reads batch i+1, after training.
    pipelined = cfg["rocks_prefetch"] != "serial"
    prev = (None, None)
    while b is not None:
        t0 = time.perf_counter()
        nb = next(batches, None)
        t1 = time.perf_counter()
        read_seconds += t1 - t0
        uniq, rows, inverse, found = cur
        if pipelined:
            store.submit(*prev, None if nb is None else nb.keys)
        n = len(b.labels)
        emb = torch.from_numpy(np.ascontiguousarray(rows[:, :DIM])).requires_grad_()  # leaf
        loss = loss_fn(forward(emb, inverse, b.dense, n), torch.from_numpy(b.labels))
        opt.zero_grad()
        loss.backward()
        t2 = time.perf_counter()
        g = emb.grad.numpy()
        w, h = rows[:, :DIM], rows[:, DIM:]       # views: the update is in place on rows
        h += g * g
        w -= lr * g / (np.sqrt(h) + ADAGRAD_EPS)
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        if not pipelined:
            store.submit(uniq, rows, None if nb is None else nb.keys)
        nxt, t_write, t_lookup = store.result()
        t5 = time.perf_counter()
        for k, dt in zip(("forward_backward", "adagrad", "adam", "wait_prefetch"),
                         (t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            phase[k] += dt
        phase["write"] += t_write
        phase["lookup"] += t_lookup
        hit = np.zeros(0 if nxt is None else len(nxt[0]), bool)
        if nxt is not None and pipelined:
            hit = patch(nxt, cur)
            rows_patched += int(hit.sum())
        n_ex += n
        n_batches += 1
        rows_found += int(found.sum())
        rows_written += len(uniq)
        prev = (uniq, rows) if pipelined else (None, None)
        b, cur = nb, nxt
        if cur is not None:
            rows_new += int((~cur[3] & ~hit).sum())
    if prev[0] is not None:  # the last batch's write-back
        t0 = time.perf_counter()
        store.submit(*prev, None)
        store.result()
        phase["last_write"] = time.perf_counter() - t0
    train_seconds = time.perf_counter() - t_train0 - read_seconds
    wall = time.perf_counter() - t_wall
    io_train = io_delta(io0, proc_io())
    props = store.properties()

    labels, probs = [], []
    with torch.no_grad():
        for b in SyntheticCriteo(seed=cfg["seed"], batch_size=cfg["batch_size"], examples=cfg["eval_examples"],
                                 part="eval"):
            _, rows, inverse, _ = lookup(b.keys)  # read only: eval writes nothing back
            emb = torch.from_numpy(np.ascontiguousarray(rows[:, :DIM]))
            probs.append(torch.sigmoid(forward(emb, inverse, b.dense, len(b.labels))).numpy())
            labels.append(b.labels)
    y, p = np.concatenate(labels), np.concatenate(probs)
    store.close()
    return {"examples": n_ex, "batches": n_batches, "seconds": train_seconds,
            "examples_per_s": n_ex / train_seconds, "wall_seconds_with_generation": wall,
            "read_seconds_excluded": read_seconds, "prefetch": cfg["rocks_prefetch"],
            "row_server_peak_rss_bytes": store.server_peak_rss_bytes,
            "rows_patched_from_the_batch_before": rows_patched,
            "auc": auc(y, p), "logloss": logloss(y, p), "phase_seconds": phase,
            "rows_found": rows_found, "rows_initialised": rows_new, "rows_written": rows_written,
            "process_io_in_training": io_train, "rocksdb_options": store.options,
            "rocksdb_properties_at_train_end": props, "disk_bytes_end": du_bytes(path)}


def run_worker(kind: str, cfg: dict) -> dict:
    t0 = time.perf_counter()
    res = worker_rocksdb(cfg) if kind in ROCKS_RUNS else worker_hps(cfg)
    res["worker_seconds"] = time.perf_counter() - t0
    res["peak_rss_bytes"] = peak_rss_bytes()
    return res


# ------------------------------------------------------------------ driver
def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="200k examples (under ~2 minutes)")
    ap.add_argument("--examples", type=lambda s: int(float(s)), default=1_000_000)
    ap.add_argument("--eval-examples", type=lambda s: int(float(s)), default=50_000)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--mlp", default="512,256", help="hidden widths: 512,256 (W4) or 16 (W4s)")
    ap.add_argument("--lr-emb", type=float, default=0.05)
    ap.add_argument("--lr-dense", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch threads of the RocksDB peer")
    ap.add_argument("--hps-threads", type=int, default=0,
                    help="torch threads of hps (0: hps.train's ThreadTuner picks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-limit", type=parse_bytes, default=parse_bytes("1GiB"),
                    help="memory cgroup limit of the hps_ssd and rocksdb workers (default 1GiB, as W1; "
                         "each charges ~0.5 GB at its peak, most of it torch)")
    ap.add_argument("--no-cgroup", action="store_true")
    ap.add_argument("--in-memory-cgroup", action="store_true", help="run hps_mem inside the cgroup too")
    ap.add_argument("--rocks-memory", type=parse_bytes, default=None,
                    help="RocksDB block cache + row cache + memtables (default: the hps MEM budget "
                         "plus hps's write buffer)")
    ap.add_argument("--rocks-wal", action="store_true",
                    help="RocksDB writes the WAL (not synced); by default it writes none, as hps "
                         "between checkpoints")
    ap.add_argument("--rocks-prefetch", choices=("process", "thread", "serial"), default="process",
                    help="where the RocksDB peer writes back and reads rows: a prefetch process beside "
                         "the trainer (default), a prefetch thread (rocksdict holds the GIL in a "
                         "multi-get), or the trainer's thread")
    ap.add_argument("--repeat", type=int, default=None,
                    help="rounds of the runs, interleaved (default 2; --quick 1): median and min-max")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--dir", default=None, help="data directory (default: a new dir under bench/results/)")
    ap.add_argument("--keep-data", action="store_true", help="keep the data directory (the example files, in a --dir)")
    ap.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    ap.add_argument("--worker-config", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.examples = 200_000
    if a.repeat is None:
        a.repeat = 1 if a.quick else 2
    return a


def main():
    args = parse()
    if args.worker:
        print(json.dumps(run_worker(args.worker, json.loads(args.worker_config))), flush=True)
        return
    runs = [r for r in args.runs.split(",") if r]
    for r in runs:
        if r not in RUNS:
            raise SystemExit(f"unknown run {r}; choose from {','.join(RUNS)}")
    hidden = [int(h) for h in args.mlp.split(",") if h]
    t_start = time.time()

    made_dir = args.dir is None
    if made_dir:
        base = os.path.join(HERE, "results")
        os.makedirs(base, exist_ok=True)
        args.dir = tempfile.mkdtemp(prefix="w5-data-", dir=base)
    else:
        os.makedirs(args.dir, exist_ok=True)

    log(f"w5: writing {args.examples:,} training examples and counting their distinct keys ...")
    stream_dir = os.path.join(args.dir, "examples")
    os.makedirs(stream_dir, exist_ok=True)
    keys = write_stream_and_count_keys(stream_dir, args.examples, args.eval_examples, args.batch_size, args.seed)
    table_rows = keys["train_rows"]
    table_mem_bytes = table_rows * (ROW_BYTES + MEM_OVERHEAD_PER_ROW)
    mem_budget = table_mem_bytes // 4
    in_memory_budget = max(W4_MEM_ROWS, 2 * keys["union_rows"]) * (ROW_BYTES + MEM_OVERHEAD_PER_ROW)
    import hps
    write_buffer_rows = hps.ParameterServerConfig(dim=DIM, path="").write_buffer_rows  # hps's default
    hps_memory = mem_budget + hps_write_buffer_bytes(write_buffer_rows)
    rocks_total = args.rocks_memory if args.rocks_memory is not None else hps_memory
    log(f"w5: {table_rows:,} rows ({table_mem_bytes / 2**20:.0f} MiB in MEM-PS, "
        f"{table_rows * ROW_BYTES / 2**20:.0f} MiB of row data); hps MEM budget {mem_budget / 2**20:.1f} MiB")

    out = {"benchmark": "W5 train, table 4x the MEM-PS budget", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "quick": args.quick, "examples": args.examples, "eval_examples": args.eval_examples,
           "batch_size": args.batch_size, "mlp": hidden, "dim": DIM, "threads": args.threads, "seed": args.seed,
           "lr_emb": args.lr_emb, "lr_dense": args.lr_dense,
           "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release,
                       "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
           "distinct_keys": keys,
           "table": {"rows": table_rows, "row_bytes": ROW_BYTES, "mem_bytes_per_row": ROW_BYTES + MEM_OVERHEAD_PER_ROW,
                     "mem_ps_bytes": table_mem_bytes, "row_data_bytes": table_rows * ROW_BYTES},
           "hps_mem_budget_bytes": mem_budget, "table_over_budget": table_mem_bytes / mem_budget,
           "hps_in_memory_budget_bytes": in_memory_budget,
           "hps_write_buffer_rows": write_buffer_rows,
           "hps_write_buffer_bytes": hps_write_buffer_bytes(write_buffer_rows),
           "hps_memory_bytes": hps_memory,
           "rocksdb_memory_bytes": rocks_total,
           "rocksdb_memory": {r: rocks_memory(rocks_total, r) for r in ROCKS_RUNS if r in runs},
           "data_dir": args.dir, "provenance": provenance()}
    import importlib.metadata as md
    out["versions"] = {}
    for pkg in ("hps", "torch", "numpy", "rocksdict"):
        try:
            out["versions"][pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out["versions"][pkg] = None

    cg = None
    if args.no_cgroup:
        out["memory_limit"], out["memory_limit_note"] = None, "disabled by --no-cgroup"
    else:
        cg = MemCgroup(args.memory_limit)
        if cg.path is None:
            out["memory_limit"], out["memory_limit_note"] = None, f"ran WITHOUT a memory limit: {cg.error}"
            log(f"w5: running WITHOUT a memory limit: {cg.error}")
            cg = None
        else:
            out["memory_limit"] = args.memory_limit
            out["memory_cgroup"] = {"path": cg.path, "version": cg.version}

    base_cfg = {"examples": args.examples, "eval_examples": args.eval_examples, "batch_size": args.batch_size,
                "hidden": hidden, "lr_emb": args.lr_emb, "lr_dense": args.lr_dense, "threads": args.threads,
                "hps_threads": args.hps_threads, "seed": args.seed, "stream_dir": stream_dir}
    worker_cfg = {
        "hps_ssd": {**base_cfg, "mem_budget": mem_budget, "write_buffer_rows": write_buffer_rows},
        **{r: {**base_cfg, "rocks_memory": rocks_memory(rocks_total, r), "rocks_wal": args.rocks_wal,
               "rocks_prefetch": args.rocks_prefetch} for r in ROCKS_RUNS},
        "hps_mem": {**base_cfg, "mem_budget": in_memory_budget, "write_buffer_rows": write_buffer_rows},
    }
    # Rounds interleave the runs (hps_ssd, rocksdb, hps_mem, hps_ssd, ...), so that a
    # noisy neighbour on this shared machine hurts every run rather than one.
    rounds: dict = {r: [] for r in runs}
    try:
        for i in range(args.repeat):
            for r in runs:
                in_cgroup = cg is not None and (r != "hps_mem" or args.in_memory_cgroup)
                if args.repeat > 1:
                    log(f"-- round {i + 1} of {args.repeat}")
                rounds[r].append(run_one(r, {**worker_cfg[r], "dir": os.path.join(args.dir, r)},
                                         cg if in_cgroup else None))
    finally:
        if cg:
            cg.remove()
        if not args.keep_data:  # the example files too, in a --dir of the caller's
            shutil.rmtree(args.dir if made_dir else stream_dir, ignore_errors=True)
    out["repeat"] = args.repeat
    out["runs"] = {r: summarize_rounds(entries) for r, entries in rounds.items()}

    # A ratio is the median of the same-round ratios: a round's two runs ran close
    # in time, so the machine's drift cancels in each; the ratio of the medians
    # could pair a fast round of one run with a slow round of the other.
    h, m = (out["runs"].get(k, {}) for k in ("hps_ssd", "hps_mem"))

    def ok(e):
        return e.get("status") == "ok"

    # The peer is the best RocksDB run of each round (the best memory split there).
    rocks = {r: out["runs"][r] for r in ROCKS_RUNS if ok(out["runs"].get(r, {}))}
    best: dict = {}
    if rocks:
        per_round = []
        for i in range(args.repeat):
            done = {r: e["rounds"][i] for r, e in rocks.items() if ok(e["rounds"][i])}
            per_round.append(max(done.items(), key=lambda kv: kv[1]["examples_per_s"]) if done else (None, {}))
        top = max(rocks, key=lambda r: rocks[r]["examples_per_s"])
        best = {"status": "ok", "examples_per_s": rocks[top]["examples_per_s"], "auc": rocks[top]["auc"],
                "rounds": [e if name else {"status": "error"} for name, e in per_round]}
        out["rocksdb_best_per_round"] = [name for name, _ in per_round]
        out["rocksdb_best_of_the_medians"] = top

    ratios, targets = {}, {}
    pairs = [("hps_ssd_over_rocksdb", best, 5.0)]
    pairs += [(f"hps_ssd_over_{r}_only", e, None) for r, e in rocks.items()]
    pairs.append(("hps_ssd_over_hps_in_memory", m, 0.5))
    for name, peer, target in pairs:
        if not (ok(h) and ok(peer)):
            continue
        per_round = [a["examples_per_s"] / b["examples_per_s"] for a, b in zip(h["rounds"], peer["rounds"])
                     if ok(a) and ok(b)]
        ratios[name] = statistics.median(per_round)
        ratios[name + "_per_round"] = per_round
        ratios[name + "_of_the_medians"] = h["examples_per_s"] / peer["examples_per_s"]
        ratios["auc_" + name.replace("_over_", "_minus_")] = h["auc"] - peer["auc"]
        if target is not None:
            targets[f"{name} >= {target}"] = ratios[name] >= target
    out["ratios"], out["targets_met"] = ratios, targets
    out["notes"] = notes(args, out)
    out["wall_seconds"] = time.time() - t_start
    print(json.dumps(out), flush=True)
    log_table(out)
    if any(e.get("status") == "error" for e in out["runs"].values()):
        sys.exit(1)


def summarize_rounds(entries: list) -> dict:
    """One run's rounds: status, median examples/s with its min-max, the median
    round's AUC and figures at the top level, and every round's raw JSON."""
    statuses = [e["status"] for e in entries]
    if any(s != "ok" for s in statuses):
        return {"status": next(s for s in statuses if s != "ok"), "round_statuses": statuses, "rounds": entries}
    rates = [e["examples_per_s"] for e in entries]
    median_round = entries[sorted(range(len(rates)), key=rates.__getitem__)[(len(rates) - 1) // 2]]
    top = dict(median_round)
    top.update({"status": "ok", "examples_per_s": statistics.median(rates),
                "examples_per_s_range": {"min": min(rates), "max": max(rates)},
                "examples_per_s_rounds": rates, "auc_rounds": [e["auc"] for e in entries],
                "figures_from_round": entries.index(median_round), "rounds": entries})
    return top


def run_one(kind: str, cfg: dict, cg) -> dict:
    """Runs one worker (inside `cg` if given) and returns its JSON, with a status."""
    os.makedirs(cfg["dir"], exist_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--worker-config", json.dumps(cfg)]
    log(f"== {kind} ({'in the memory cgroup' if cg else 'no memory limit'}) ==")
    if cg:
        cg.reset()
    t0 = time.time()
    # preexec_fn (joining the cgroup before exec) is safe here: the driver runs no threads.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=cg.enter if cg else None)
    stdout, _ = p.communicate()
    wall = time.time() - t0
    if p.returncode == 0:
        try:
            entry = json.loads(stdout.strip().splitlines()[-1])
            entry["status"] = "ok"
        except (ValueError, IndexError):
            entry = {"status": "error", "error": "worker printed no JSON"}
    elif p.returncode == -signal.SIGKILL:
        entry = {"status": "oom", "note": "worker killed by SIGKILL (OOM killer inside the memory limit)"}
    else:
        entry = {"status": "error", "returncode": p.returncode}
    entry["wall_seconds"] = wall
    entry["in_memory_cgroup"] = cg is not None
    if cg:
        entry["cgroup"] = cg.snapshot()
        if entry["status"] == "oom" and not any(k.endswith("oom_kill") and v for k, v in entry["cgroup"].items()):
            entry["note"] += " (the cgroup did not count an oom_kill; check dmesg)"
    shutil.rmtree(cfg["dir"], ignore_errors=True)
    if entry["status"] == "ok":
        log(f"== {kind}: {entry['examples_per_s']:,.0f} examples/s, AUC {entry['auc']:.4f} "
            f"({wall:.0f} s in all) ==")
    else:
        log(f"== {kind}: {entry['status']} after {wall:.0f} s ==")
    return entry


def notes(args, out) -> list:
    n = [
        ("examples/s: hps = pipeline examples / pipeline wall time (each batch copied out of the example "
         "files on the read thread, overlapped); rocksdb = examples / time in its training loop, the copy of "
         "each batch excluded. Both read the same files, written once by the driver (before 2026-11-22 each "
         "worker generated its examples as it went)"),
        ("the RocksDB peer is " + ("serial: each batch's multi-get and write-back on the trainer's thread"
                                   if args.rocks_prefetch == "serial" else
                                   f"pipelined like hps: while a batch trains, a prefetch {args.rocks_prefetch} "
                                   "(the database's owner) writes back the "
                                   "batch before it (one WriteBatch) and multi-gets the next batch's rows; keys "
                                   "shared with the training batch then take its updated rows, so every batch "
                                   "trains on the rows a serial loop would read (same AUC)")),
        ("hps MEM budget = distinct training rows / 4 * (128 B row + 112 B MEM-PS bookkeeping); the eval "
         "examples touch a few more keys (distinct_keys.union_rows)"),
        ("RocksDB's caches and memtables together get hps's memory for rows: its MEM budget plus its "
         "BackingStore write buffer (hps_memory_bytes = hps_mem_budget_bytes + hps_write_buffer_bytes), "
         "unless --rocks-memory; each RocksDB run splits it its own way (rocksdb_memory: rocksdb favours "
         "the block cache, rocksdb_rowcache the row cache); W1's sizes (256+64 MiB caches, 3x64 MiB "
         "memtables) would hold the whole table"),
        ("hps_ssd_over_rocksdb is the median over rounds of hps_ssd / the best RocksDB run of that round "
         "(rocksdb_best_per_round); hps_ssd_over_<run>_only compares with one split"),
        ("both stores read with O_DIRECT (hps SSD-PS direct_io, RocksDB use_direct_reads), so the page "
         "cache cannot serve table reads even where the cgroup limit exceeds the table's bytes on disk; "
         "the limit bounds torch, the caches, the WAL and write-back pages"),
        ("RocksDB writes one WriteBatch per batch with sync=False"
         + (" (WAL written, not fsynced)" if args.rocks_wal else " and no WAL (disable_wal)")
         + "; hps writes nothing durable between checkpoints: neither is durable per batch"),
        ("hps PS figures (mem_hit_rate, ssd_*) are at the end of training, before the final eval and "
         "checkpoint; ps_stats_end is after both"),
        "hps_mem runs " + ("inside" if args.in_memory_cgroup else "outside") + " the memory cgroup",
        "the memory cgroup is ssd_store_bench.MemCgroup's (named hps-w1), created and removed by this run",
        ("rounds interleave the runs; examples_per_s is the median over rounds, other figures are the "
         "median round's (figures_from_round); every round's raw JSON is under rounds"),
    ]
    if out.get("memory_limit") is None:
        n.append("NO memory limit was applied: " + out.get("memory_limit_note", ""))
    return n


def log_table(out):
    log(f"{'run':8} {'examples/s (median, min-max)':>30} {'AUC':>7} {'peak RSS MiB':>13} {'cgroup peak MiB':>16}")
    for name, e in out["runs"].items():
        if e.get("status") != "ok":
            log(f"{name:8} {e.get('status')}")
            continue
        rng = e["examples_per_s_range"]
        cg_peak = e.get("cgroup", {}).get("memory.max_usage_in_bytes", e.get("cgroup", {}).get("memory.peak"))
        log(f"{name:8} {e['examples_per_s']:>12,.0f} ({rng['min']:>7,.0f}-{rng['max']:>7,.0f}) {e['auc']:>7.4f} "
            f"{e['peak_rss_bytes'] / 2**20:>13,.0f} {cg_peak / 2**20 if cg_peak else float('nan'):>16,.0f}")
    h = out["runs"].get("hps_ssd", {})
    if h.get("status") == "ok":
        log(f"hps_ssd: MEM hit rate {h['mem_hit_rate']:.3f}, SSD read {h['ssd_bytes_read'] / 1e6:,.0f} MB, "
            f"written {h['ssd_bytes_written'] / 1e6:,.0f} MB, bound by {h['pipeline']['bound_by']}, "
            f"wall/slowest stage {h['pipeline']['wall_over_slowest_stage']:.2f}")
    for k, v in out["ratios"].items():
        shown = [round(x, 4) for x in v] if isinstance(v, list) else v if isinstance(v, dict) else round(v, 4)
        log(f"{k}: {shown}")


if __name__ == "__main__":
    main()
