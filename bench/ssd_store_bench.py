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
    not the generation of the rows) -- hps and RocksDB in index order (random key
    order), LMDB sorted by key with append=True (BENCHMARKS.md notes: random order
    rewrites most pages per commit);
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

Each store runs in a worker process (--worker --store X) that the driver places in a
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

ROW_BYTES = 128
SEED = 0x5EED_1234
ZIPF_A = 1.05
ZIPF_PERM = 2654435761  # prime; rank r -> index (r * P) mod N
HERE = os.path.dirname(os.path.abspath(__file__))
ALL_STORES = ("hps", "hps_node", "rocksdb", "rocksdb_tuned", "lmdb")
NODE_CACHE_BYTES = 320 << 20  # = RocksDB tuned's block cache (256 MiB) + row cache (64 MiB)

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
    def __init__(self, path, tuned):
        import rocksdict as r
        self.r = r
        self.name = "rocksdb_tuned" if tuned else "rocksdb"
        opt = r.Options(raw_mode=True)
        opt.create_if_missing(True)
        self.options = {"raw_mode": True, "create_if_missing": True,
                        "get": "Rdict.get(list of 8-byte big-endian keys) (multi-get)",
                        "put": "WriteBatch of the batch, db.write(wb, WriteOptions(sync=True))",
                        "load": "WriteBatch per chunk (no sync), then flush() + flush_wal(sync)"}
        if tuned:
            self.block_cache = r.Cache(256 << 20)
            self.row_cache = r.Cache(64 << 20)
            bbo = r.BlockBasedOptions()
            bbo.set_block_cache(self.block_cache)
            bbo.set_bloom_filter(10, False)
            bbo.set_block_size(4096)
            bbo.set_cache_index_and_filter_blocks(False)
            bbo.set_format_version(5)
            opt.set_block_based_table_factory(bbo)
            opt.set_row_cache(self.row_cache)
            opt.set_use_direct_reads(True)
            opt.set_use_direct_io_for_flush_and_compaction(True)
            opt.set_compression_type(r.DBCompressionType.none())
            opt.increase_parallelism(os.cpu_count() or 2)
            opt.set_max_background_jobs(max(2, os.cpu_count() or 2))
            opt.set_write_buffer_size(64 << 20)
            opt.set_max_write_buffer_number(3)
            self.options.update({
                "block_cache_bytes": 256 << 20, "row_cache_bytes": 64 << 20,
                "bloom_filter_bits_per_key": 10, "bloom_block_based": False,
                "block_size": 4096, "cache_index_and_filter_blocks": False, "format_version": 5,
                "use_direct_reads": True, "use_direct_io_for_flush_and_compaction": True,
                "compression": "none", "increase_parallelism": os.cpu_count() or 2,
                "max_background_jobs": max(2, os.cpu_count() or 2),
                "write_buffer_size": 64 << 20, "max_write_buffer_number": 3})
        else:
            self.options["tuning"] = "rocksdb defaults"
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
        wb = self.r.WriteBatch(raw_mode=True)
        rb = rows.tobytes()
        for i, k in enumerate(be_keys(keys)):
            wb.put(k, rb[i * ROW_BYTES:(i + 1) * ROW_BYTES])
        self.db.write(wb, self.sync)

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


def run_worker(args) -> dict:
    n, B, K = args.rows, args.batches, args.batch_keys
    name = args.store
    path = os.path.join(args.dir, name)
    os.makedirs(path, exist_ok=True)
    if name == "hps":
        st = HpsStore(path)
    elif name == "hps_node":
        st = HpsNodeStore(path)
    elif name in ("rocksdb", "rocksdb_tuned"):
        st = RocksStore(path, tuned=(name == "rocksdb_tuned"))
    elif name == "lmdb":
        st = LmdbStore(path, n)
    else:
        raise SystemExit(f"unknown store {name}")
    res = {"store": name, "options": st.options, "path": path}

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

    versions = np.zeros(n, np.uint16)
    rng = np.random.default_rng(SEED)
    vrng = np.random.default_rng(SEED + 1)
    next_version = 1
    res["distributions"] = {}
    for dist in args.dists:
        get_rates, put_rates, get_s, put_s, uniq = [], [], [], [], []
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
        res["distributions"][dist] = {
            "batches": B, "batch_keys_drawn": K, "unique_keys_per_batch_mean": statistics.mean(uniq),
            "get_rows_per_s": summarize(get_rates), "put_rows_per_s": summarize(put_rates),
            "get_seconds_total": sum(get_s), "put_seconds_total": sum(put_s),
            "get_rows_per_s_overall": sum(uniq) / sum(get_s), "put_rows_per_s_overall": sum(uniq) / sum(put_s),
            "disk_bytes_after": du_bytes(path)}
        log(f"{name} {dist}: get {statistics.median(get_rates):,.0f} rows/s, "
            f"put {statistics.median(put_rates):,.0f} rows/s (medians)")
    res["store_stats"] = st.stats()
    st.close()
    res["disk_bytes_end"] = du_bytes(path)
    res["live_bytes"] = n * (ROW_BYTES + 8)
    res["space_amplification"] = res["disk_bytes_end"] / res["live_bytes"]
    return res


# ------------------------------------------------------------------ cgroup
class MemCgroup:
    def __init__(self, limit):
        self.limit, self.path, self.version, self.error = limit, None, None, None
        v1 = "/sys/fs/cgroup/memory"
        try:
            if os.path.exists(os.path.join(v1, "memory.limit_in_bytes")):
                p = os.path.join(v1, "hps-w1")
                os.makedirs(p, exist_ok=True)
                with open(os.path.join(p, "memory.limit_in_bytes"), "w") as f:
                    f.write(str(limit))
                self.path, self.version = p, 1
            elif os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
                p = "/sys/fs/cgroup/hps-w1"
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
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.rows, a.batches, a.batch_keys = 1_000_000, 10, 20_000
    a.dists = [d for d in a.dists.split(",") if d]
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
                     "hps and RocksDB load in random key order; LMDB loads sorted with append=True",
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

    out["stores"] = {}
    for s in stores:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--store", s,
               "--rows", str(args.rows), "--batches", str(args.batches),
               "--batch-keys", str(args.batch_keys), "--dir", args.dir,
               "--dists", ",".join(args.dists), "--verify-sample", str(args.verify_sample),
               "--load-chunk", str(args.load_chunk)]
        log(f"== {s} ==")
        if cg:
            cg.reset()
        t0 = time.time()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                             preexec_fn=(cg.enter if cg else None))
        stdout, _ = p.communicate()
        wall = time.time() - t0
        entry = None
        if p.returncode == 0:
            try:
                entry = json.loads(stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                entry = {"status": "error", "error": "worker printed no JSON"}
            else:
                entry["status"] = "ok"
        elif p.returncode == -signal.SIGKILL:
            entry = {"status": "oom", "note": "worker killed by SIGKILL (OOM killer inside the memory limit)"}
        else:
            entry = {"status": "error", "returncode": p.returncode}
        entry["wall_seconds"] = wall
        if cg:
            entry["cgroup"] = cg.snapshot()
            if entry["status"] == "oom" and not any(
                    k.endswith("oom_kill") and v for k, v in entry["cgroup"].items()):
                entry["note"] += " (the cgroup did not count an oom_kill; check dmesg)"
        out["stores"][s] = entry
        shutil.rmtree(os.path.join(args.dir, s), ignore_errors=True)
        log(f"== {s}: {entry['status']} in {wall:.1f} s ==")

    # ---- ratios hps / rocksdb_tuned
    ratios = {}
    h, r = out["stores"].get("hps"), out["stores"].get("rocksdb_tuned")
    if h and r and h.get("status") == "ok" and r.get("status") == "ok":
        ratios["load"] = h["load"]["rows_per_s"] / r["load"]["rows_per_s"]
        for d in args.dists:
            hd, rd = h["distributions"][d], r["distributions"][d]
            ratios[d] = {"get_median": hd["get_rows_per_s"]["median"] / rd["get_rows_per_s"]["median"],
                         "put_median": hd["put_rows_per_s"]["median"] / rd["put_rows_per_s"]["median"]}
        ratios["space_hps"] = h["space_amplification"]
        ratios["space_rocksdb_tuned"] = r["space_amplification"]
    out["ratios_hps_over_rocksdb_tuned"] = ratios or None
    node = out["stores"].get("hps_node")
    if node and r and node.get("status") == "ok" and r.get("status") == "ok":
        out["ratios_hps_node_over_rocksdb_tuned"] = {
            d: {"get_median": node["distributions"][d]["get_rows_per_s"]["median"]
                / r["distributions"][d]["get_rows_per_s"]["median"],
                "put_median": node["distributions"][d]["put_rows_per_s"]["median"]
                / r["distributions"][d]["put_rows_per_s"]["median"]}
            for d in args.dists}
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


def _has(md, p):
    try:
        md.version(p)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
