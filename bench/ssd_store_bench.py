#!/usr/bin/env python3
"""W1 (BENCHMARKS.md): (a) hps.SsdStore and (b) the node store (MEM-PS cache + SSD-PS,
store "hps_node") against RocksDB (rocksdict) and LMDB, with fio as the device limit,
every store inside the same 1 GiB memory cgroup.

    python3 bench/ssd_store_bench.py --quick
    python3 bench/ssd_store_bench.py --rows 5000000 --batches 20 --batch-keys 100000
    python3 bench/ssd_store_bench.py --stores hps,lmdb --no-fio

Workload, per store, in a fresh directory:
  * keys: key(i) = splitmix64(i + seed) for i in [0, N): distinct (splitmix64 is a
    bijection of uint64) and random-looking; no key array needs to be kept;
  * rows: 128 bytes derived from (key, version), so every read can be checked;
  * bulk load of the N rows (timed: the store calls and the final commit/flush only,
    not the generation of the rows) -- hps and RocksDB defaults in index order
    (random key order), LMDB sorted by key with append=True (BENCHMARKS.md notes:
    random order rewrites most pages per commit), RocksDB tuned as its experts
    bulk-load: sorted, through SstFileWriter, then ingest_external_file (no
    compaction left to do);
  * then for each distribution (uniform, then Zipf(1.05), on the same store): B batches
    of K keys drawn with replacement and de-duplicated (a batch's unique keys, as a
    parameter server sees them; rates are over the unique keys); each batch is a
    timed get, then a timed put of the same keys with new values, made durable:
      - hps: put + commit() (fdatasync + manifest; compaction on a background thread);
      - RocksDB: one WriteBatch written with WriteOptions.sync = True;
      - LMDB: one write txn (LMDB syncs on commit by default);
    Zipf ranks come from numpy's zipf(1.05) truncated to N (rejection) and are mapped
    to indices by a multiplicative permutation, so the hot keys are spread over the
    key space and over the load order;
  * a sample of every get (--verify-sample rows, default 1000) is compared with the
    expected rows; a mismatch or a missing key raises.

RocksDB tuned (RocksTunedStore) is swept over variants after its one load: reader
processes (--rocksdb-readers; rocksdict holds the GIL through a multi-get, so
concurrent gets need processes, each a secondary instance serving one key range)
x the split of --rocksdb-memory between block cache, row cache and memtables
(--rocksdb-splits); it reports its best variant per figure, and every variant.

The stores run in --rounds rounds, interleaved, each store in a fresh worker
process per round; figures are medians over rounds with their min-max.
Each worker process (--worker --store X) is placed by the driver in a
memory cgroup (v1 memory.limit_in_bytes or v2 memory.max, default 1 GiB) so the page
cache cannot hold the data. A worker killed by SIGKILL (the OOM killer) is recorded
as "oom". Progress goes to stderr; one JSON line goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from hps.data import mix64  # splitmix64's finaliser, a bijection of uint64
from _provenance import provenance  # commit, date, machine, command of the JSON line (bench/ is sys.path[0])
from rocks_tuned import ROCKS_GET_CHUNK, ROW_BYTES, SortedIngest, rocks_tuned_options  # the tuned peer, its lean reader

SEED = 0x5EED_1234
ZIPF_A = 1.05
ZIPF_PERM = 2654435761  # prime; rank r -> index (r * P) mod N
HERE = os.path.dirname(os.path.abspath(__file__))
ALL_STORES = ("hps", "hps_node", "rocksdb", "rocksdb_tuned", "lmdb")
NODE_CACHE_BYTES = 320 << 20  # below RocksDB tuned's default 512 MiB of caches + memtables

GOLD = np.uint64(0x9E3779B97F4A7C15)


def log(*a):
    print(*a, file=sys.stderr, flush=True)




def keys_of(idx: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return mix64(idx.astype(np.uint64) + np.uint64(SEED))


def rows_of(keys: np.ndarray, versions) -> np.ndarray:
    """(n, 128) uint8 rows, a function of (key, version)."""
    n = len(keys)
    v = np.broadcast_to(np.asarray(versions, np.uint64), (n,))
    with np.errstate(over="ignore"):
        h = mix64(keys ^ (v * GOLD))
        words = h[:, None] * (np.arange(ROW_BYTES // 8, dtype=np.uint64) * np.uint64(2) + np.uint64(1))
        words ^= words >> np.uint64(29)
    return np.ascontiguousarray(words).view(np.uint8).reshape(n, ROW_BYTES)


def du_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def be_keys(keys: np.ndarray) -> list[bytes]:
    b = keys.astype(">u8").tobytes()
    return [b[i:i + 8] for i in range(0, len(b), 8)]


def rocks_put(r, db, keys: np.ndarray, rows: np.ndarray, sync: bool) -> None:
    """One WriteBatch of rows under big-endian keys: RocksDB's batched write."""
    wb = r.WriteBatch(raw_mode=True)
    rb = rows.tobytes()
    for i, k in enumerate(be_keys(keys)):
        wb.put(k, rb[i * ROW_BYTES:(i + 1) * ROW_BYTES])
    db.write(wb, sync)


# ------------------------------------------------------------------ stores
class HpsStore:
    name = "hps"

    def __init__(self, path):
        import hps
        self.s = hps.SsdStore(path, row_bytes=ROW_BYTES)
        self.options = {"row_bytes": ROW_BYTES, "file_records": 1 << 16, "compaction_trigger": 1.5,
                        "use_io_uring": True, "direct_io": True,
                        "background_compaction": True,
                        "durability": "put + commit() per batch (fdatasync + manifest; compaction on a background thread)"}

    def load_chunk(self, keys, rows):
        self.s.put(keys, rows)

    def load_done(self):
        self.s.commit()

    def get(self, keys):
        rows, found = self.s.get(keys)
        return rows, found

    def put(self, keys, rows):
        self.s.put(keys, rows)
        self.s.commit()

    def stats(self):
        return dict(self.s.stats())

    def close(self):
        del self.s


class HpsNodeStore(HpsStore):
    """W1 (b): the node store, MEM-PS cache in front of SSD-PS, as the parameter
    server uses them: a get pins the batch's rows (misses read SSD-PS in one
    batched get), the put writes them back into the cache, and durability per
    batch flushes the dirty rows to SSD-PS and commits."""

    name = "hps_node"

    def __init__(self, path, policy="tinylfu-lfu"):
        import hps
        super().__init__(path)
        self.cache = hps.MemCache(ROW_BYTES, budget=NODE_CACHE_BYTES, policy=policy,
                                  loader=self._load, sink=self.s.put)
        self.options.update({"mem_budget_bytes": NODE_CACHE_BYTES, "cache_policy": policy,
                             "durability": "write back into MEM-PS, then flush dirty rows + commit() per batch"})

    def _load(self, keys):
        rows, found = self.s.get(keys)
        if not found.all():
            raise SystemExit(f"hps_node: {int((~found).sum())} keys missing on SSD-PS")
        return rows, np.zeros(len(keys), bool)

    def get(self, keys):
        rows, _ = self.cache.pull(keys, pin=True)
        return rows, np.ones(len(keys), bool)

    def put(self, keys, rows):
        self.cache.write_back(keys, rows.view(np.uint8).reshape(len(keys), ROW_BYTES))
        self.cache.flush_dirty()
        self.s.commit()

    def stats(self):
        return {"ssd": dict(self.s.stats()), "mem": dict(self.cache.stats())}

    def close(self):
        del self.cache
        super().close()


class RocksStore:
    """RocksDB with its defaults (the tuned peer is RocksTunedStore)."""

    name = "rocksdb"

    def __init__(self, path):
        import rocksdict as r
        self.r = r
        opt = r.Options(raw_mode=True)
        opt.create_if_missing(True)
        self.options = {"raw_mode": True, "create_if_missing": True, "tuning": "rocksdb defaults",
                        "get": "Rdict.get(list of 8-byte big-endian keys) (multi-get)",
                        "put": "WriteBatch of the batch, db.write(wb, WriteOptions(sync=True))",
                        "load": "WriteBatch per chunk (no sync), then flush() + flush_wal(sync)"}
        self.db = r.Rdict(path, options=opt)
        self.sync = r.WriteOptions()
        self.sync.sync = True

    def load_chunk(self, keys, rows):
        wb = self.r.WriteBatch(raw_mode=True)
        rb = rows.tobytes()
        for i, k in enumerate(be_keys(keys)):
            wb.put(k, rb[i * ROW_BYTES:(i + 1) * ROW_BYTES])
        self.db.write(wb)

    def load_done(self):
        self.db.flush(True)
        self.db.flush_wal(True)

    def prepare_get(self, keys):
        return be_keys(keys)

    def get_prepared(self, kb):
        return self.db.get(kb)

    def finish_get(self, vals):
        n = len(vals)
        found = np.fromiter((v is not None for v in vals), bool, n)
        buf = b"".join(v if v is not None else bytes(ROW_BYTES) for v in vals)
        return np.frombuffer(buf, np.uint8).reshape(n, ROW_BYTES), found

    def put(self, keys, rows):
        rocks_put(self.r, self.db, keys, rows, self.sync)

    def stats(self):
        out = {}
        for p in ("rocksdb.estimate-num-keys", "rocksdb.total-sst-files-size",
                  "rocksdb.num-running-compactions", "rocksdb.block-cache-usage"):
            try:
                out[p] = self.db.property_int_value(p)
            except Exception:  # noqa: BLE001
                pass
        return out

    def close(self):
        self.db.close()


# How the tuned RocksDB splits its memory (fractions of --rocksdb-memory): block
# cache, row cache, memtables. A uniform get finds its row in a cached block as
# often as in the row cache of the same bytes, but a block holds ~28 rows, so the
# block cache wins there; under Zipf the row cache keeps more hot rows per byte.
ROCKS_SPLITS = {"block": (0.5, 0.125, 0.375), "row": (0.125, 0.5, 0.375), "cache": (0.625, 0.25, 0.125)}
ROCKS_PRIMARY_CACHE = 1 << 20  # the writer's block cache beside reader processes (it serves no gets)


def rocks_bulk_load(path: str, n: int, chunk: int, progress) -> float:
    """The expert's bulk load (rocks_tuned.SortedIngest) of the N rows into
    PATH/db. Returns the seconds in the store's calls (not the generation or
    the sort of the keys)."""
    order = np.sort(keys_of(np.arange(n, dtype=np.uint64)))
    load = SortedIngest(path, bloom=False)  # every W1 get finds its key
    pb = progress(n, "load")
    for s in range(0, n, chunk):
        k = order[s:s + chunk]
        load.add(k.astype(">u8").tobytes(), rows_of(k, 0).tobytes(), ROW_BYTES)
        pb.update(len(k))
    del order
    seconds = load.finish()
    pb.close()
    return seconds


def clone_db(src: str, dst: str) -> None:
    """A copy of a closed database in which the table files are hard links (they are
    immutable: the copy's compactions write new files and unlink its own names)."""
    os.makedirs(dst)
    for f in os.listdir(src):
        s = os.path.join(src, f)
        if f.endswith(".sst"):
            os.link(s, os.path.join(dst, f))
        elif os.path.isfile(s) and f != "LOCK":
            shutil.copy2(s, os.path.join(dst, f))


class RocksTunedStore:
    """RocksDB as its experts run it for this workload (W1, issue 14): loaded by
    rocks_bulk_load, every option explicit (rocks_tuned_options), the memory budget
    split as ROCKS_SPLITS[split] over every process, and gets issued by `readers`
    processes at once (1: the writer's own multi-get). With several readers, each
    is a secondary instance that always serves the same slice of the key space, so
    their caches partition the table rather than each caching the same rows; each
    batch's put is a synced WriteBatch on the writer, which the readers then replay
    from the WAL (catch_up, timed apart)."""

    name = "rocksdb_tuned"

    def __init__(self, path: str, readers: int, split: str, memory: int, max_keys: int):
        import rocksdict as r
        self.r, self.readers = r, readers
        fb, fr, fm = ROCKS_SPLITS[split]
        # Every reader replays the writer's memtables: (1 + readers) copies share fm.
        copies = 1 + (readers if readers > 1 else 0)
        wbuf = max(1 << 20, int(memory * fm) // copies // 2)
        if readers > 1:
            primary = {"block_cache_bytes": ROCKS_PRIMARY_CACHE, "row_cache_bytes": 0}
            reader = {"block_cache_bytes": int(memory * fb) // readers,
                      "row_cache_bytes": int(memory * fr) // readers}
        else:
            primary = {"block_cache_bytes": int(memory * fb), "row_cache_bytes": int(memory * fr)}
            reader = None
        common = {"write_buffer_size": wbuf, "max_write_buffer_number": 2, "filters_for_hits": True}
        opt, self._keep, popts = rocks_tuned_options(**primary, **common)
        self.db = r.Rdict(path, options=opt)
        self.sync = r.WriteOptions()
        self.sync.sync = True
        self.options = {
            "split": split, "split_fractions_block_row_memtables": list(ROCKS_SPLITS[split]),
            "memory_budget_bytes": memory, "readers": readers, "writer": popts,
            "load": "keys sorted, rows through SstFileWriter (one file per load chunk), one "
                    "ingest_external_file(move_files): non-overlapping files in the last level, nothing to compact",
            "get": ("the writer's Rdict.get(list of 8-byte big-endian keys) (one multi-get)" if readers == 1 else
                    f"{readers} reader processes (secondary instances), reader i serving key range i of "
                    f"{readers}, multi-gets of {ROCKS_GET_CHUNK} keys; rows returned through a shared file"),
            "put": "WriteBatch of the batch, db.write(wb, WriteOptions(sync=True))"}
        self.procs, self.conns, self.secondaries = [], [], []
        if readers > 1:
            import mmap
            import socket
            from multiprocessing.connection import Connection
            self.options["reader"] = rocks_tuned_options(**reader, **common)[2]
            self.options["reader_catch_up"] = "try_catch_up_with_primary() in every reader before each get"
            self.options["reader_process"] = "python3 bench/rocks_tuned.py: the standard library and rocksdict only"
            self.mmap_bytes = max(1, max_keys) * ROW_BYTES
            fd, self.mmap_path = tempfile.mkstemp(prefix="w1-rows-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                                  else os.path.dirname(path))
            os.ftruncate(fd, self.mmap_bytes)
            os.close(fd)
            with open(self.mmap_path, "r+b") as f:
                self.out = mmap.mmap(f.fileno(), self.mmap_bytes)
            for i in range(readers):
                mine, theirs = socket.socketpair()
                secondary = f"{path}.secondary{i}"
                self.secondaries.append(secondary)
                p = subprocess.Popen([sys.executable, os.path.join(HERE, "rocks_tuned.py"), str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()])
                theirs.close()
                conn = Connection(mine.detach())
                conn.send({"path": path, "secondary": secondary, "opts": {**reader, **common},
                           "mmap_path": self.mmap_path, "mmap_bytes": self.mmap_bytes})
                self.procs.append(p)
                self.conns.append(conn)
            for c in self.conns:
                if c.recv() != "ready":
                    raise SystemExit("rocksdb_tuned: a reader process did not start")

    def catch_up(self):
        for c in self.conns:
            c.send(("catch_up",))
        for c in self.conns:
            c.recv()

    def prepare_get(self, keys):
        if self.readers == 1:
            return be_keys(keys)
        part = ((keys >> np.uint64(32)) * np.uint64(self.readers)) >> np.uint64(32)
        order = np.argsort(part, kind="stable")
        counts = np.bincount(part.astype(np.int64), minlength=self.readers)
        return order, counts, keys[order].astype(">u8").tobytes()

    def get_prepared(self, token):
        """-> (rows (m, 128) uint8 in request order, found (m,) bool)."""
        if self.readers == 1:
            vals = self.db.get(token)
            n = len(vals)
            found = np.fromiter((v is not None for v in vals), bool, n)
            buf = b"".join(v if v is not None else bytes(ROW_BYTES) for v in vals)
            return np.frombuffer(buf, np.uint8).reshape(n, ROW_BYTES), found
        order, counts, kb = token
        m = len(order)
        start, busy = 0, []
        for c, cnt in zip(self.conns, counts):
            if cnt:
                c.send(("get", start, kb[start * 8:(start + cnt) * 8]))
                busy.append(c)
            start += cnt
        found_sorted = np.frombuffer(b"".join(c.recv_bytes() for c in busy), np.uint8).astype(bool)
        rows = np.empty((m, ROW_BYTES), np.uint8)
        rows[order] = np.frombuffer(self.out, np.uint8, m * ROW_BYTES).reshape(m, ROW_BYTES)
        found = np.empty(m, bool)
        found[order] = found_sorted
        return rows, found

    def put(self, keys, rows):
        rocks_put(self.r, self.db, keys, rows, self.sync)
        if self.readers > 1:
            # Each reader replays the WAL into memtables of its own: a 14 MB batch in
            # 1 + readers copies outgrew the 1 GiB cgroup (4 readers: ~220 MB each).
            # Flushed, the batch reaches them as a table file they share.
            self.db.flush(True)

    def stats(self):
        out = {}
        for p in ("rocksdb.estimate-num-keys", "rocksdb.total-sst-files-size", "rocksdb.live-sst-files-size",
                  "rocksdb.num-running-compactions", "rocksdb.block-cache-usage", "rocksdb.cur-size-all-mem-tables",
                  "rocksdb.estimate-table-readers-mem"):
            try:
                out[p] = self.db.property_int_value(p)
            except Exception:  # noqa: BLE001 - a property this build lacks
                pass
        try:
            out["rocksdb.levelstats"] = self.db.property_value("rocksdb.levelstats")
        except Exception:  # noqa: BLE001
            pass
        return out

    def close(self):
        for c in self.conns:
            c.send(("stop",))
        for c, p in zip(self.conns, self.procs):
            c.recv()
            p.wait()
        if self.procs:
            self.out.close()
            os.unlink(self.mmap_path)
        for d in self.secondaries:
            shutil.rmtree(d, ignore_errors=True)
        self.db.close()


class LmdbStore:
    name = "lmdb"

    def __init__(self, path, rows):
        import lmdb
        self.map_size = max(1 << 30, int(rows * (ROW_BYTES + 8) * 4))
        self.env = lmdb.open(path, map_size=self.map_size, subdir=True, readahead=False,
                             max_dbs=0)
        self.options = {"map_size": self.map_size, "readahead": False, "sync": True,
                        "metasync": True, "writemap": False,
                        "load": "sorted by key, Cursor.putmulti(append=True), one txn per chunk",
                        "get": "one read txn per batch, Cursor.getmulti",
                        "put": "one write txn per batch, Cursor.putmulti (commit syncs)"}

    def load_chunk(self, keys, rows):
        # keys arrive sorted (see load())
        rb = rows.tobytes()
        items = [(k, rb[i * ROW_BYTES:(i + 1) * ROW_BYTES]) for i, k in enumerate(be_keys(keys))]
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(items, append=True)

    def load_done(self):
        self.env.sync(True)

    def prepare_get(self, keys):
        return be_keys(keys)

    def get_prepared(self, kb):
        with self.env.begin(buffers=False) as txn:
            return txn.cursor().getmulti(kb)

    def finish_get(self, pairs):
        return pairs

    def put(self, keys, rows):
        rb = rows.tobytes()
        items = [(k, rb[i * ROW_BYTES:(i + 1) * ROW_BYTES]) for i, k in enumerate(be_keys(keys))]
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(items)

    def stats(self):
        return {k: int(v) for k, v in self.env.stat().items()}

    def close(self):
        self.env.close()


# ------------------------------------------------------------------ worker
def zipf_indices(rng, n_keys, size):
    out = np.empty(0, np.int64)
    while len(out) < size:
        z = rng.zipf(ZIPF_A, size=2 * size)
        z = z[z <= n_keys]
        out = np.concatenate([out, z[: size - len(out)]])
    r = (out - 1).astype(np.uint64)
    with np.errstate(over="ignore"):
        return ((r * np.uint64(ZIPF_PERM)) % np.uint64(n_keys)).astype(np.int64)


def summarize(xs):
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def make_progress(name):
    try:
        from tqdm import tqdm  # noqa: F401
        have_tqdm = True
    except ImportError:
        have_tqdm = False

    def progress(total, desc):
        if have_tqdm:
            from tqdm import tqdm
            return tqdm(total=total, desc=f"{name} {desc}", file=sys.stderr, mininterval=1.0)
        class Plain:
            def __init__(self):
                self.done, self.t0, self.last = 0, time.time(), 0.0
            def update(self, k):
                self.done += k
                if time.time() - self.last > 5 or self.done >= total:
                    self.last = time.time()
                    log(f"{name} {desc}: {self.done}/{total} ({self.last - self.t0:.1f} s)")
            def close(self):
                pass
        return Plain()
    return progress


def run_dists(st, name, args, n, path, progress) -> dict:
    """The batches of every distribution on a loaded store; the generators start
    from the same seeds on every call, so every store and every RocksDB variant
    serves the same batches."""
    B, K = args.batches, args.batch_keys
    versions = np.zeros(n, np.uint16)
    rng = np.random.default_rng(SEED)
    vrng = np.random.default_rng(SEED + 1)
    next_version = 1
    out = {}
    for dist in args.dists:
        get_rates, put_rates, get_s, put_s, uniq, catch_up_s = [], [], [], [], [], []
        pb = progress(B, dist)
        for b in range(B):
            if dist == "uniform":
                idx = rng.integers(0, n, size=K)
            else:
                idx = zipf_indices(rng, n, K)
            idx = np.unique(idx)
            vrng.shuffle(idx)  # request order is not key order
            keys = keys_of(idx.astype(np.uint64))
            m = len(keys)
            uniq.append(m)
            # ---- get
            if name in ("hps", "hps_node"):
                t0 = time.perf_counter()
                rows, found = st.get(keys)
                dt = time.perf_counter() - t0
                sample = vrng.choice(m, size=min(m, args.verify_sample), replace=False)
                got_rows, got_found = rows[sample], found[sample]
            elif name == "rocksdb_tuned":
                if st.readers > 1:  # the readers replay the last put from the WAL, timed apart
                    t0 = time.perf_counter()
                    st.catch_up()
                    catch_up_s.append(time.perf_counter() - t0)
                token = st.prepare_get(keys)
                t0 = time.perf_counter()
                rows, found = st.get_prepared(token)
                dt = time.perf_counter() - t0
                if len(rows) != m:
                    raise SystemExit(f"{name}: get returned {len(rows)} rows for {m} keys")
                sample = vrng.choice(m, size=min(m, args.verify_sample), replace=False)
                got_rows, got_found = rows[sample], found[sample]
            else:
                kb = st.prepare_get(keys)
                t0 = time.perf_counter()
                raw = st.get_prepared(kb)
                dt = time.perf_counter() - t0
                sample = vrng.choice(m, size=min(m, args.verify_sample), replace=False)
                if name == "lmdb":
                    d = dict(raw)
                    vals = [d.get(kb[i]) for i in sample]
                else:
                    vals = [raw[i] for i in sample]
                if len(raw) != m and name != "lmdb":
                    raise SystemExit(f"{name}: multi-get returned {len(raw)} values for {m} keys")
                got_found = np.array([v is not None for v in vals])
                got_rows = np.frombuffer(b"".join(v if v is not None else bytes(ROW_BYTES) for v in vals),
                                         np.uint8).reshape(len(sample), ROW_BYTES)
                if name == "lmdb" and len(raw) != m:
                    raise SystemExit(f"lmdb: getmulti returned {len(raw)} pairs for {m} keys")
            if not got_found.all():
                raise SystemExit(f"{name} {dist} batch {b}: {int((~got_found).sum())} of {len(sample)} "
                                 f"sampled keys not found")
            expect = rows_of(keys[sample], versions[idx[sample]])
            if not np.array_equal(got_rows, expect):
                bad = int((got_rows != expect).any(axis=1).sum())
                raise SystemExit(f"{name} {dist} batch {b}: {bad} of {len(sample)} sampled rows wrong")
            get_s.append(dt)
            get_rates.append(m / dt)
            # ---- put (new values for the same keys)
            v = next_version
            next_version += 1
            new_rows = rows_of(keys, v)
            t0 = time.perf_counter()
            st.put(keys, new_rows)
            dt = time.perf_counter() - t0
            versions[idx] = v
            put_s.append(dt)
            put_rates.append(m / dt)
            pb.update(1)
        pb.close()
        out[dist] = {
            "batches": B, "batch_keys_drawn": K, "unique_keys_per_batch_mean": statistics.mean(uniq),
            "get_rows_per_s": summarize(get_rates), "put_rows_per_s": summarize(put_rates),
            "get_seconds_total": sum(get_s), "put_seconds_total": sum(put_s),
            "get_rows_per_s_overall": sum(uniq) / sum(get_s), "put_rows_per_s_overall": sum(uniq) / sum(put_s),
            "disk_bytes_after": du_bytes(path)}
        if catch_up_s:
            out[dist]["reader_catch_up_seconds"] = summarize(catch_up_s)
            out[dist]["reader_catch_up_seconds_total"] = sum(catch_up_s)
        log(f"{name} {dist}: get {statistics.median(get_rates):,.0f} rows/s, "
            f"put {statistics.median(put_rates):,.0f} rows/s (medians)")
    return out


def rocks_tuned_paths(args) -> tuple[str, str]:
    """(the store's directory, the loaded database every variant copies)."""
    path = os.path.join(args.dir, "rocksdb_tuned")
    return path, os.path.join(path, "loaded")


def run_rocks_tuned_load(args) -> dict:
    """Worker: rocksdb_tuned's one bulk load, which every variant then copies."""
    n = args.rows
    path, base = rocks_tuned_paths(args)
    os.makedirs(path, exist_ok=True)
    t_wall0 = time.time()
    t_store = rocks_bulk_load(base, n, args.load_chunk, make_progress("rocksdb_tuned"))
    return {"load": {"rows": n, "seconds": t_store, "wall_seconds_with_generation": time.time() - t_wall0,
                     "rows_per_s": n / t_store, "MB_per_s": n * ROW_BYTES / t_store / 1e6,
                     "disk_bytes_after_load": du_bytes(os.path.join(base, "db"))}}


def run_rocks_tuned_variant(args) -> dict:
    """Worker: one variant (reader processes x memory split) on a hard-linked copy of
    the load, on the same batches as every other store and variant."""
    readers, split, memory = args.variant
    name, label = "rocksdb_tuned", variant_label(readers, split, memory)
    path, base = rocks_tuned_paths(args)
    vdir = os.path.join(path, f"r{readers}-{split}-{memory}")
    if os.environ.get("HPS_W1_KILL_VARIANT") == label:  # tests: a variant ended as the OOM killer ends one
        os.kill(os.getpid(), signal.SIGKILL)
    clone_db(os.path.join(base, "db"), vdir)
    st = RocksTunedStore(vdir, readers, split, memory, args.batch_keys)
    try:
        dists = run_dists(st, name, args, args.rows, vdir, make_progress(f"{name} {label}"))
        stats = st.stats()
    finally:
        st.close()
    disk = du_bytes(vdir)
    shutil.rmtree(vdir, ignore_errors=True)
    return {"readers": readers, "split": split, "memory_bytes": memory, "options": st.options,
            "distributions": dists, "store_stats": stats, "disk_bytes_end": disk}


def variant_label(readers: int, split: str, memory: int) -> str:
    return f"readers={readers},split={split},memory={memory / 2**20:g}MiB"


def run_rocks_tuned(args, cg) -> dict:
    """One round of rocksdb_tuned, each step a worker process of its own inside the
    cgroup: the bulk load, then every variant (reader processes x memory split) one
    after another. A variant killed by the OOM killer is recorded as such and takes
    no other variant's figures with it. Each distribution's get and put report the
    best variant's median for each; every variant's figures are under "variants"."""
    n, name = args.rows, "rocksdb_tuned"
    path, _base = rocks_tuned_paths(args)
    res = {"store": name, "path": path, "rocksdb_memory_bytes_swept": args.rocksdb_memory,
           "readers_swept": args.rocksdb_readers, "splits_swept": args.rocksdb_splits,
           "splits": {k: ROCKS_SPLITS[k] for k in args.rocksdb_splits},
           "variant_process": "each variant in a worker process of its own, one after another"}
    loaded = spawn_worker(["--store", name, "--phase", "load"], args, cg)
    if loaded["status"] != "ok":
        return {**res, **loaded, "failed_phase": "load"}
    res["load"] = loaded["load"]
    variants, failed = {}, {}
    for memory in args.rocksdb_memory:
        for split in args.rocksdb_splits:
            for readers in args.rocksdb_readers:
                label = variant_label(readers, split, memory)
                log(f"{name}: variant {label}")
                v = spawn_worker(["--store", name, "--phase", "variant", "--variant", f"{readers},{split},{memory}"],
                                 args, cg)
                if v["status"] == "ok":
                    variants[label] = v
                else:
                    failed[label] = v
                    log(f"{name}: variant {label} {v['status']}")
    res["variants"], res["variants_failed"] = variants, failed
    if not variants:
        return {**res, "status": next(iter(failed.values()))["status"] if failed else "error",
                "error": "no variant finished"}
    # The best variant per figure: a peer at its best on each.
    res["distributions"] = {}
    for d in args.dists:
        best_get = max(variants, key=lambda v: variants[v]["distributions"][d]["get_rows_per_s"]["median"])
        best_put = max(variants, key=lambda v: variants[v]["distributions"][d]["put_rows_per_s"]["median"])
        entry = dict(variants[best_get]["distributions"][d])
        for k in ("put_rows_per_s", "put_seconds_total", "put_rows_per_s_overall"):
            entry[k] = variants[best_put]["distributions"][d][k]
        entry.update({"get_best_variant": best_get, "put_best_variant": best_put,
                      "get_median_by_variant": {v: e["distributions"][d]["get_rows_per_s"]["median"]
                                                for v, e in variants.items()},
                      "put_median_by_variant": {v: e["distributions"][d]["put_rows_per_s"]["median"]
                                                for v, e in variants.items()}})
        res["distributions"][d] = entry
    first = args.dists[0]
    best = res["distributions"][first]["get_best_variant"]
    res["options"] = variants[best]["options"]
    res["options_of"] = f"{best} (the best {first} get; every variant's options are under variants)"
    res["disk_bytes_end"] = variants[best]["disk_bytes_end"]
    res["live_bytes"] = n * (ROW_BYTES + 8)
    res["space_amplification"] = res["disk_bytes_end"] / res["live_bytes"]
    res["status"] = "ok"
    return res


def run_worker(args) -> dict:
    n = args.rows
    name = args.store
    if name == "rocksdb_tuned":
        return run_rocks_tuned_load(args) if args.phase == "load" else run_rocks_tuned_variant(args)
    path = os.path.join(args.dir, name)
    os.makedirs(path, exist_ok=True)
    if name == "hps":
        st = HpsStore(path)
    elif name == "hps_node":
        st = HpsNodeStore(path)
    elif name == "rocksdb":
        st = RocksStore(path)
    elif name == "lmdb":
        st = LmdbStore(path, n)
    else:
        raise SystemExit(f"unknown store {name}")
    res = {"store": name, "options": st.options, "path": path}
    progress = make_progress(name)

    # ---- bulk load
    chunk = args.load_chunk
    t_store = 0.0
    t_wall0 = time.time()
    pb = progress(n, "load")
    if name == "lmdb":
        order = np.sort(keys_of(np.arange(n, dtype=np.uint64)))
        for s in range(0, n, chunk):
            k = order[s:s + chunk]
            rows = rows_of(k, 0)
            t0 = time.perf_counter()
            st.load_chunk(k, rows)
            t_store += time.perf_counter() - t0
            pb.update(len(k))
        del order
    else:
        for s in range(0, n, chunk):
            k = keys_of(np.arange(s, min(n, s + chunk), dtype=np.uint64))
            rows = rows_of(k, 0)
            t0 = time.perf_counter()
            st.load_chunk(k, rows)
            t_store += time.perf_counter() - t0
            pb.update(len(k))
    t0 = time.perf_counter()
    st.load_done()
    t_store += time.perf_counter() - t0
    pb.close()
    res["load"] = {"rows": n, "seconds": t_store, "wall_seconds_with_generation": time.time() - t_wall0,
                   "rows_per_s": n / t_store, "MB_per_s": n * ROW_BYTES / t_store / 1e6,
                   "disk_bytes_after_load": du_bytes(path)}
    if name in ("hps", "hps_node"):
        res["load"]["hps_stats"] = st.stats()

    res["distributions"] = run_dists(st, name, args, n, path, progress)
    res["store_stats"] = st.stats()
    st.close()
    res["disk_bytes_end"] = du_bytes(path)
    res["live_bytes"] = n * (ROW_BYTES + 8)
    res["space_amplification"] = res["disk_bytes_end"] / res["live_bytes"]
    return res


# ------------------------------------------------------------------ cgroup
class MemCgroup:
    """A memory cgroup (v1 or v2) named `name` with a hard limit; W12 uses it too."""

    def __init__(self, limit, name="hps-w1"):
        self.limit, self.path, self.version, self.error = limit, None, None, None
        v1 = "/sys/fs/cgroup/memory"
        try:
            if os.path.exists(os.path.join(v1, "memory.limit_in_bytes")):
                p = os.path.join(v1, name)
                os.makedirs(p, exist_ok=True)
                with open(os.path.join(p, "memory.limit_in_bytes"), "w") as f:
                    f.write(str(limit))
                self.path, self.version = p, 1
            elif os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
                p = os.path.join("/sys/fs/cgroup", name)
                try:
                    with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
                        f.write("+memory")
                except OSError:
                    pass
                os.makedirs(p, exist_ok=True)
                with open(os.path.join(p, "memory.max"), "w") as f:
                    f.write(str(limit))
                try:
                    with open(os.path.join(p, "memory.swap.max"), "w") as f:
                        f.write("0")
                except OSError:
                    pass
                self.path, self.version = p, 2
            else:
                self.error = "no memory cgroup controller mounted"
        except OSError as e:
            self.error = f"cannot create memory cgroup: {e}"
            self.path = None

    def _read(self, name):
        try:
            with open(os.path.join(self.path, name)) as f:
                return f.read()
        except OSError:
            return None

    def reset(self):
        if self.version == 1:
            for name in ("memory.max_usage_in_bytes", "memory.failcnt"):
                try:
                    with open(os.path.join(self.path, name), "w") as f:
                        f.write("0")
                except OSError:
                    pass
            try:  # drop what earlier workers left charged
                with open(os.path.join(self.path, "memory.force_empty"), "w") as f:
                    f.write("0")
            except OSError:
                pass

    # Per cgroup version: single-number files, and the "key value" file with the OOM counters.
    _COUNTERS = {1: (("memory.max_usage_in_bytes", "memory.failcnt"), "memory.oom_control", "oom_control"),
                 2: (("memory.peak",), "memory.events", "events")}

    def snapshot(self):
        out = {}
        if self.version not in self._COUNTERS:
            return out
        numbers, pairs_file, prefix = self._COUNTERS[self.version]
        for name in numbers:
            v = self._read(name)
            if v is not None:
                out[name] = int(v)
        pairs = self._read(pairs_file)
        for line in (pairs or "").splitlines():
            k, _, v = line.partition(" ")
            out[f"{prefix}.{k}"] = int(v)
        return out

    def enter(self):  # runs in the child before exec
        name = "tasks" if self.version == 1 else "cgroup.procs"
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(os.getpid()))

    def remove(self):
        if self.path:
            try:
                os.rmdir(self.path)
            except OSError:
                pass


# ------------------------------------------------------------------ fio
def run_fio(directory, quick):
    if shutil.which("fio") is None:
        return {"skipped": "fio not installed"}
    size = "512M" if quick else "2G"
    runtime = 3 if quick else 10
    fn = os.path.join(directory, "fio.dat")
    engine = "io_uring"
    jobs = [
        ("seq_write_1m", ["--rw=write", "--bs=1M", "--iodepth=8"]),
        ("rand_read_4k_qd64", ["--rw=randread", "--bs=4k", "--iodepth=64"]),
        ("seq_read_1m", ["--rw=read", "--bs=1M", "--iodepth=8"]),
    ]
    out = {"file_size": size, "runtime_s": runtime, "ioengine": engine, "direct": 1}
    for name, extra in jobs:
        base = ["fio", f"--name={name}", f"--filename={fn}", f"--size={size}", "--direct=1",
                f"--ioengine={engine}", "--output-format=json", "--numjobs=1", "--group_reporting"]
        if name != "seq_write_1m":
            base += ["--time_based", f"--runtime={runtime}"]
        cmd = base + extra
        log("fio:", " ".join(cmd[1:]))
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0 and engine == "io_uring":
            engine = "libaio"
            out["ioengine"] = engine
            cmd = [c.replace("--ioengine=io_uring", "--ioengine=libaio") for c in cmd]
            p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            out[name] = {"error": p.stderr[-500:]}
            continue
        j = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]
        side = j["write"] if "write" in name else j["read"]
        out[name] = {"iops": side["iops"], "MB_per_s": side["bw_bytes"] / 1e6,
                     "lat_mean_us": side.get("lat_ns", {}).get("mean", 0) / 1e3,
                     "cmd": " ".join(cmd)}
        log(f"fio {name}: {side['iops']:,.0f} IOPS, {side['bw_bytes'] / 1e6:,.1f} MB/s")
    try:
        os.unlink(fn)
    except FileNotFoundError:
        pass
    return out


# ------------------------------------------------------------------ driver
def parse_bytes(text: str, flag: str, ap) -> int:
    """'512MiB', '1GiB' or a number of bytes ('5.36e8')."""
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    try:
        for u, m in units.items():
            if text.endswith(u):
                return int(float(text[:-len(u)]) * m)
        return int(float(text))
    except ValueError:
        ap.error(f"{flag} {text!r}: a size such as 512MiB or a number of bytes")


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=lambda s: int(float(s)), default=20_000_000)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--batch-keys", type=lambda s: int(float(s)), default=100_000)
    ap.add_argument("--quick", action="store_true", help="N=1M, B=10, K=20k; under a minute")
    ap.add_argument("--stores", default=",".join(ALL_STORES))
    ap.add_argument("--dists", default="uniform,zipf")
    ap.add_argument("--dir", default=None, help="data directory (default: a new dir under bench/results/ssd-data)")
    ap.add_argument("--keep-data", action="store_true")
    ap.add_argument("--memory-limit", type=lambda s: int(float(s)), default=1 << 30)
    ap.add_argument("--no-cgroup", action="store_true")
    ap.add_argument("--no-fio", action="store_true")
    ap.add_argument("--verify-sample", type=int, default=1000)
    ap.add_argument("--load-chunk", type=int, default=250_000)
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of every store, interleaved (hps, ..., rocksdb_tuned, hps, ...): figures are "
                         "medians over rounds with their min-max (default 3; --quick 1)")
    ap.add_argument("--rocksdb-readers", default=None,
                    help="reader processes of rocksdb_tuned to sweep, e.g. 1,2,4,8 (1: the writer's own "
                         "multi-get; default 1,2,4,8; --quick 1,2)")
    ap.add_argument("--rocksdb-splits", default=None,
                    help=f"memory splits of rocksdb_tuned to sweep, of {','.join(ROCKS_SPLITS)} "
                         "(default all; --quick block,row)")
    ap.add_argument("--rocksdb-memory", default=None,
                    help="rocksdb_tuned's block caches + row caches + memtables over all its processes, "
                         "bytes or MiB, a list to sweep: e.g. 512MiB,256MiB (default 512MiB). Each reader "
                         "process also holds its table readers and an interpreter, outside this figure")
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=("load", "variant"), help=argparse.SUPPRESS)  # rocksdb_tuned's steps
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # READERS,SPLIT,MEMORY_BYTES
    a = ap.parse_args()
    if a.quick:
        a.rows, a.batches, a.batch_keys = 1_000_000, 10, 20_000
    if a.rounds is None:
        a.rounds = 1 if a.quick else 3
    if a.rocksdb_readers is None:
        a.rocksdb_readers = "1,2" if a.quick else "1,2,4,8"
    if a.rocksdb_splits is None:
        a.rocksdb_splits = "block,row" if a.quick else ",".join(ROCKS_SPLITS)
    try:
        a.rocksdb_readers = [int(x) for x in a.rocksdb_readers.split(",") if x]
    except ValueError:
        ap.error(f"--rocksdb-readers {a.rocksdb_readers!r}: a list of counts such as 1,2,4,8")
    if not a.rocksdb_readers or min(a.rocksdb_readers) < 1:
        ap.error(f"--rocksdb-readers {a.rocksdb_readers}: counts of at least 1")
    a.rocksdb_splits = [x for x in a.rocksdb_splits.split(",") if x]
    a.rocksdb_memory = [parse_bytes(x, "--rocksdb-memory", ap) for x in (a.rocksdb_memory or "512MiB").split(",") if x]
    for x in a.rocksdb_splits:
        if x not in ROCKS_SPLITS:
            ap.error(f"--rocksdb-splits: unknown split {x!r}; choose from {','.join(ROCKS_SPLITS)}")
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: at least 1")
    a.dists = [d for d in a.dists.split(",") if d]
    if a.variant:
        readers, split, memory = a.variant.split(",")
        a.variant = (int(readers), split, int(memory))
    for d in a.dists:
        if d not in ("uniform", "zipf"):
            ap.error(f"unknown distribution {d}")
    return a


def main():
    args = parse()
    if args.worker:
        print(json.dumps(run_worker(args)), flush=True)
        return
    stores = [s for s in args.stores.split(",") if s]
    for s in stores:
        if s not in ALL_STORES:
            raise SystemExit(f"unknown store {s}; choose from {','.join(ALL_STORES)}")
    made_dir = args.dir is None
    if made_dir:
        base = os.path.join(HERE, "results", "ssd-data")
        os.makedirs(base, exist_ok=True)
        args.dir = tempfile.mkdtemp(prefix="w1-", dir=base)
    else:
        os.makedirs(args.dir, exist_ok=True)
    t_start = time.time()
    out = {"benchmark": "W1a ssd_store", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "rows": args.rows, "row_bytes": ROW_BYTES, "batches": args.batches,
           "batch_keys": args.batch_keys, "quick": args.quick, "dists": args.dists,
           "zipf_a": ZIPF_A, "seed": SEED, "data_dir": args.dir, "provenance": provenance(), "machine": {
               "cpus": os.cpu_count(), "kernel": os.uname().release,
               "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
           "notes": ["batch keys are drawn with replacement and de-duplicated; rates are over unique keys",
                     "load timing covers the store calls and the final commit/flush, not row generation",
                     ("hps and RocksDB defaults load in random key order; LMDB loads sorted with append=True; "
                      "rocksdb_tuned loads sorted through SstFileWriter + ingest_external_file (its sort untimed)"),
                     ("rounds interleave the stores; a store's rates are the median over rounds of each round's "
                      "median over batches, min-max over rounds (batch_min/batch_max: over every batch); a ratio "
                      "is the median of the same-round ratios"),
                     ("rocksdb_tuned reports, per distribution, its best variant's get and its best variant's put "
                      "(get_best_variant, put_best_variant; all under variants): reader processes x memory split, "
                      "every variant on the same batches from a hard-linked copy of one load; a variant's block "
                      "caches + row caches + memtables over all its processes total its memory (memory_bytes)"),
                     ("rocksdb_tuned with several readers: before each get the readers replay the last put from "
                      "the WAL (try_catch_up_with_primary), timed apart (reader_catch_up_seconds), in neither "
                      "the get nor the put"),
                     "every put batch is durable when timed: hps commit(), RocksDB sync write, LMDB txn commit",
                     "RocksDB/LMDB timings include the Python binding's per-key work (key lists, WriteBatch.put)"]}
    try:
        import importlib.metadata as md
        out["versions"] = {p: md.version(p) for p in ("numpy", "rocksdict", "lmdb") if _has(md, p)}
    except Exception:  # noqa: BLE001
        pass

    cg = None
    if args.no_cgroup:
        out["memory_limit"] = None
        out["memory_limit_note"] = "disabled by --no-cgroup"
    else:
        cg = MemCgroup(args.memory_limit)
        if cg.path is None:
            out["memory_limit"] = None
            out["memory_limit_note"] = cg.error
            log(f"ssd_store_bench: running WITHOUT a memory limit: {cg.error}")
            cg = None
        else:
            out["memory_limit"] = args.memory_limit
            out["memory_cgroup"] = {"path": cg.path, "version": cg.version}

    if args.no_fio:
        out["fio"] = {"skipped": "--no-fio"}
    else:
        out["fio"] = run_fio(args.dir, args.quick)

    out["rounds"] = args.rounds
    rounds: dict = {st: [] for st in stores}
    for i in range(args.rounds):
        for st in stores:
            log(f"== round {i + 1} of {args.rounds}: {st} ==")
            rounds[st].append(run_store(st, args, cg))
    out["stores"] = {st: summarize_rounds(entries, args.dists) for st, entries in rounds.items()}

    # ---- ratios: the median over rounds of the same-round ratios (the two ran close
    # in time, so the machine's drift cancels in each)
    h, r = out["stores"].get("hps"), out["stores"].get("rocksdb_tuned")
    out["ratios_hps_over_rocksdb_tuned"] = round_ratios(rounds.get("hps"), rounds.get("rocksdb_tuned"),
                                                        args.dists, with_load=True)
    if out["ratios_hps_over_rocksdb_tuned"]:
        out["ratios_hps_over_rocksdb_tuned"]["space_hps"] = h["space_amplification"]
        out["ratios_hps_over_rocksdb_tuned"]["space_rocksdb_tuned"] = r["space_amplification"]
    out["ratios_hps_node_over_rocksdb_tuned"] = round_ratios(rounds.get("hps_node"), rounds.get("rocksdb_tuned"),
                                                             args.dists, with_load=False)
    # Issue 14's targets against the peer at its best (its best variant per figure).
    ra = out["ratios_hps_over_rocksdb_tuned"]
    if ra and "uniform" in ra:
        out["targets_met"] = {"uniform get >= 2x rocksdb_tuned": ra["uniform"]["get_median"] >= 2.0,
                              "uniform put >= 5x rocksdb_tuned": ra["uniform"]["put_median"] >= 5.0}
    fr = out["fio"].get("rand_read_4k_qd64") if isinstance(out["fio"], dict) else None
    if h and h.get("status") == "ok" and fr and "iops" in fr:
        out["hps_uniform_get_over_fio_randread_iops"] = \
            h["distributions"].get("uniform", {}).get("get_rows_per_s", {}).get("median", 0) / fr["iops"] \
            if "uniform" in h["distributions"] else None

    if cg:
        cg.remove()
    if made_dir and not args.keep_data:
        shutil.rmtree(args.dir, ignore_errors=True)
    out["wall_seconds"] = time.time() - t_start
    print(json.dumps(out), flush=True)
    failed = [s for s, e in out["stores"].items() if e["status"] == "error"]
    if failed:
        log(f"ssd_store_bench: workers failed: {failed}")
        sys.exit(1)


def run_store(s: str, args, cg) -> dict:
    """One round of store `s`: its JSON, with a status; its data is removed after."""
    t0 = time.time()
    entry = run_rocks_tuned(args, cg) if s == "rocksdb_tuned" else spawn_worker(["--store", s], args, cg)
    entry["wall_seconds"] = time.time() - t0
    shutil.rmtree(os.path.join(args.dir, s), ignore_errors=True)
    log(f"== {s}: {entry['status']} in {entry['wall_seconds']:.1f} s ==")
    return entry


def _oom_kills(snapshot: dict) -> int:
    return sum(v for k, v in snapshot.items() if k.endswith("oom_kill"))


def spawn_worker(extra: list, args, cg) -> dict:
    """One worker process (inside `cg` if given) running `extra` (--store X ...): its
    JSON, with a status: ok, oom (the OOM killer struck in the cgroup: the worker
    itself, or one of its reader processes, after which it failed), or error."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", *extra,
           "--rows", str(args.rows), "--batches", str(args.batches),
           "--batch-keys", str(args.batch_keys), "--dir", args.dir,
           "--dists", ",".join(args.dists), "--verify-sample", str(args.verify_sample),
           "--load-chunk", str(args.load_chunk),
           "--rocksdb-readers", ",".join(map(str, args.rocksdb_readers)),
           "--rocksdb-splits", ",".join(args.rocksdb_splits),
           "--rocksdb-memory", ",".join(map(str, args.rocksdb_memory))]
    kills_before = 0
    if cg:
        cg.reset()
        kills_before = _oom_kills(cg.snapshot())
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=(cg.enter if cg else None))
    stdout, _ = p.communicate()
    wall = time.time() - t0
    snap = cg.snapshot() if cg else {}
    oom_killed = cg is not None and _oom_kills(snap) > kills_before
    if p.returncode == 0:
        try:
            entry = json.loads(stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            entry = {"status": "error", "error": "worker printed no JSON"}
        else:
            entry["status"] = "ok"
    elif p.returncode == -signal.SIGKILL or oom_killed:
        entry = {"status": "oom", "note": "worker killed by SIGKILL (OOM killer inside the memory limit)"
                 if p.returncode == -signal.SIGKILL else
                 f"the OOM killer struck in the cgroup (a reader process); the worker exited {p.returncode}"}
        if p.returncode == -signal.SIGKILL and cg is not None and not oom_killed:
            entry["note"] += " (the cgroup did not count an oom_kill; check dmesg)"
    else:
        entry = {"status": "error", "returncode": p.returncode}
    entry["wall_seconds"] = wall
    if cg:
        entry["cgroup"] = snap
    return entry


def _over_rounds(xs) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rounds": xs}


def summarize_rounds(entries: list, dists: list) -> dict:
    """One store's rounds: the median round's JSON (by the first distribution's get),
    with the load rate and every distribution's get and put rates replaced by the
    median over rounds of each round's median, their min-max over rounds, and the
    per-batch extremes of all rounds (batch_min, batch_max); every round's JSON
    is under "rounds"."""
    bad = [e for e in entries if e.get("status") != "ok"]
    if bad:
        return {"status": bad[0]["status"], "round_statuses": [e.get("status") for e in entries],
                "rounds": entries}
    key = [e["distributions"][dists[0]]["get_rows_per_s"]["median"] for e in entries]
    mid = sorted(range(len(entries)), key=key.__getitem__)[(len(entries) - 1) // 2]
    top = json.loads(json.dumps(entries[mid]))  # a deep copy
    top.update({"status": "ok", "figures_from_round": mid, "rounds": entries})
    loads = [e["load"]["rows_per_s"] for e in entries]
    top["load"]["rows_per_s"] = statistics.median(loads)
    top["load"]["rows_per_s_over_rounds"] = _over_rounds(loads)
    for d in dists:
        for metric in ("get_rows_per_s", "put_rows_per_s"):
            per_round = [e["distributions"][d][metric] for e in entries]
            top["distributions"][d][metric] = {
                **_over_rounds([x["median"] for x in per_round]),
                "batch_min": min(x["min"] for x in per_round), "batch_max": max(x["max"] for x in per_round)}
    return top


def round_ratios(a_rounds, b_rounds, dists, with_load):
    """a / b per round (each round's medians), then the median and min-max over rounds."""
    if not a_rounds or not b_rounds:
        return None
    pairs = [(a, b) for a, b in zip(a_rounds, b_rounds) if a.get("status") == b.get("status") == "ok"]
    if not pairs:
        return None
    out = {"rounds_compared": len(pairs)}
    if with_load:
        out["load"] = statistics.median(a["load"]["rows_per_s"] / b["load"]["rows_per_s"] for a, b in pairs)
    for d in dists:
        ratios = {}
        for metric, name in (("get_rows_per_s", "get"), ("put_rows_per_s", "put")):
            xs = [a["distributions"][d][metric]["median"] / b["distributions"][d][metric]["median"]
                  for a, b in pairs]
            ratios[f"{name}_median"] = statistics.median(xs)
            ratios[f"{name}_min"], ratios[f"{name}_max"], ratios[f"{name}_per_round"] = min(xs), max(xs), xs
        out[d] = ratios
    return out


def _has(md, p):
    try:
        md.version(p)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
