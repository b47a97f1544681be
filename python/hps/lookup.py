"""hps.Lookup: embedding rows of a job's last finished checkpoint, read-only,
through a memory budget of its own in front of the checkpoint's SSD-PS files
(docs/serving.md).

The budget covers what the lookup holds, split when a checkpoint is opened:

  * the key index of every rank's store (SSD-PS stats' index_bytes: its slots
    and shard table, times INDEX_HEAP_FACTOR for what the allocator adds) and the files' metadata (block CRCs, 4 bytes a 4 KiB block
    of rows, and a small record per file);
  * read buffers: each concurrent SSD-PS read holds a BlockIo (io_uring ring and
    a scratch buffer kept between reads, src/util/block_io.h) and its rows on the
    way; reads are at most ``read_threads`` at once and ``READ_KEYS`` keys each, so
    a scratch never exceeds READ_KEYS x (the blocks a row touches) x 4 KiB, and
    every rank's store keeps one BlockIo per concurrent reader;
  * the refresh reserve: while refresh() opens the next checkpoint beside the one
    served, that checkpoint's index and metadata (up to REFRESH_HEADROOM x the
    current's), its read buffers and the rows it is warmed with (a quarter of the
    cache's rows);
  * the recently looked-up keys kept to warm that cache (8 bytes each);
  * calls' working memory: a call works on CALL_KEYS keys at a time (their
    distinct keys, the rows the cache gives, the rows read on a miss, the answer's
    part), and at most ``read_threads`` calls work at once, more waiting, plus
    the refresh warming its cache: (read_threads + 1) x CALL_KEYS x
    _CALL_BYTES_PER_KEY at the dim served;
  * the cache of rows (hps.MemCache, its bookkeeping included): what is left.

The lookup fixes glibc's mmap threshold (steady_heap): a call's temporaries of a
MiB or so would otherwise stay resident in the heap after they are freed, beside a
refresh the largest part of what W11 measured over the budget at 2d9dea2.

The answer of a call of more than CALL_KEYS keys (its rows and found mask beyond
the first CALL_KEYS) is the caller's memory, outside the budget.
"""
from __future__ import annotations

import ctypes
import math
import os
import threading
from typing import Optional, Union

import numpy as np

from hps import _core, jobdir
from hps.hash_table import EMPTY_KEY
from hps.mem_cache import MemCache, parse_bytes

READ_KEYS = 256             # keys per SSD-PS read: bounds each read's scratch buffer
# Keys a call works on at a time: bounds its working memory, some 1.6 MiB at dim 64;
# a batch of 4096 keys is two such parts, whose Python overhead is small beside their reads.
CALL_KEYS = 2048
# The next checkpoint's index may be this much larger and still open beside the served
# one; a job whose keys grow by more between two refreshes blocks its lookups for that
# refresh (counted). The reserve's unused part is idle memory, so it is kept small.
REFRESH_HEADROOM = 1.1
NEW_KEYS_CHUNK = 1 << 16    # keys of a new file read at a time to estimate the next index
WARM_FRACTION = 4           # a refresh warms the next cache with up to 1/4 of this cache's rows
BLOCK_BYTES = 4096          # SSD-PS reads whole 4 KiB blocks (docs/ssd_format.md)
_RING_BYTES = 64 << 10      # an io_uring of 512 entries: SQEs, CQEs and the rings' pages
_FILE_BYTES = 1024          # a parameter file's record beside its CRCs (object, path, entry)
_READ_BYTES_PER_KEY = 96    # a read's per-key bookkeeping (groups, requests, plan runs)
# The key index's resident bytes over its index_bytes: glibc's chunk headers on its
# 2^16 shard arrays and the holes their doublings leave while it is built (each shard
# frees its 16- and 32-slot arrays, which no later array fits). Opening a store in a
# fresh process measured 1.17x at 1M keys and 1.18x at 2M (less where the heap had free
# room before), 1.0x at 200k (the shards' first size holds them all);
# tests/test_serving.py checks the bound.
INDEX_HEAP_FACTOR = 1.2
# MemCache.stats() fields that count events (the others are the cache's state now):
# a retired checkpoint's are carried into the next one's, so that stats() counts them
# over the Lookup's life, as it does lookups and refreshes.
CACHE_COUNTERS = ("hits", "misses", "evictions", "dirty_evictions", "rows_loaded", "rows_flushed",
                  "failed_releases", "lookahead_spared", "lookahead_forced", "lookahead_visited",
                  "lookahead_skipped")
_M_MMAP_THRESHOLD = -3      # <malloc.h>
_MMAP_THRESHOLD = 128 << 10  # glibc's initial value, kept fixed
# hps::detail::CompactKeyIndex (src/format/key_index.h): 2^16 shards of 10-byte
# slots, at least 16 slots once used, doubled past 80% full; a 24-byte shard record.
_INDEX_SHARDS, _INDEX_SLOT, _INDEX_MIN, _INDEX_SHARD_BYTES = 1 << 16, 10, 16, 24


def index_bytes_estimate(keys: int) -> int:
    """The expected bytes of an SSD-PS key index holding `keys` keys: each of its
    2^16 shards gets a Poisson share of them and grows by the index's rule; 2%
    above the expectation (over 65,536 shards the sum barely varies)."""
    lam = keys / _INDEX_SHARDS
    slots, c, cap = 0.0, 0, _INDEX_MIN
    top = int(lam + 12 * math.sqrt(lam) + 40)
    log_lam = math.log(lam) if lam > 0 else 0.0
    while c <= top and lam > 0:
        while c * 5 > cap * 4:
            cap *= 2
        if c > 0:
            slots += math.exp(c * log_lam - lam - math.lgamma(c + 1)) * cap
        c += 1
    return int(_INDEX_SHARDS * (_INDEX_SHARD_BYTES + 1.02 * _INDEX_SLOT * slots))


def _meta_bytes(records: int, files: int, row_bytes: int) -> int:
    return 4 * -(-records * row_bytes // BLOCK_BYTES) + _FILE_BYTES * files


def _call_bytes(dim: int) -> int:
    """One call's working memory for CALL_KEYS keys: np.unique's sorted copy,
    permutation, distinct keys and inverse (8 bytes each); the cache's answer and
    the loader's rows on a miss ((dim + 1) float32 each); the answer's part (dim
    float32 and a found byte) and the found test's temporary (4 bytes)."""
    return CALL_KEYS * (4 * 8 + 2 * 4 * (dim + 1) + 4 * dim + 1 + 4)


def _read_slot_bytes(row_bytes: int, dim: int) -> int:
    """One concurrent read of one store: its ring, its scratch at most, its rows."""
    # Rows lie back to back from a block-aligned offset (docs/ssd_format.md), so a row
    # starts at a multiple of gcd(row_bytes, 4096) within its block: the most blocks it touches.
    blocks = (BLOCK_BYTES - math.gcd(row_bytes, BLOCK_BYTES) + row_bytes - 1) // BLOCK_BYTES + 1
    return (_RING_BYTES + READ_KEYS * blocks * BLOCK_BYTES
            + READ_KEYS * (2 * row_bytes + 4 * (dim + 1) + _READ_BYTES_PER_KEY))


def _read_buffer_bytes(job: jobdir.Job, read_threads: int) -> int:
    """The read buffers of job's checkpoint: every rank's store keeps a reader per concurrent read."""
    return job.world * read_threads * _read_slot_bytes(job.row_bytes, job.config.dim)


class _Plan:
    """A checkpoint's split of the budget (module docstring), in bytes."""

    def __init__(self, budget: int, index: int, meta: int, buffers: int, calls: int, row_cost: int):
        self.budget, self.index, self.meta, self.buffers, self.row_cost = budget, index, meta, buffers, row_cost
        self.calls = calls
        self.fixed = index + meta + buffers + calls
        self.next_fixed = math.ceil(REFRESH_HEADROOM * (index + meta)) + buffers
        left = budget - self.fixed - self.next_fixed
        # a cached row, its copy in the next cache warmed beside it (1/4), its key kept to warm (8 B / 4)
        self.cache_rows = max(0, int(left // (row_cost + row_cost / WARM_FRACTION + 8 / WARM_FRACTION)))
        self.warm_rows = self.cache_rows // WARM_FRACTION
        self.reserve = self.next_fixed + self.warm_rows * row_cost

    def refuse(self, path: str) -> None:
        mib = 1 << 20
        need = self.fixed + self.next_fixed + self.row_cost * 2
        raise ValueError(
            f"memory_budget {self.budget / mib:.1f} MiB holds no row cache for {path}: its key index "
            f"({self.index / mib:.1f} MiB), files' metadata ({self.meta / mib:.1f} MiB), read buffers "
            f"({self.buffers / mib:.1f} MiB) and calls' working memory ({self.calls / mib:.1f} MiB) take "
            f"{self.fixed / mib:.1f} MiB, and a refresh needs "
            f"{self.next_fixed / mib:.1f} MiB more beside them for the next checkpoint; give at least "
            f"{need / mib:.1f} MiB, and more for the cache")


class _Generation:
    """One pinned checkpoint: every rank's store (read only) and a cache of
    (embedding, found) rows in front of them. Freed once retired and idle."""

    def __init__(self, view: jobdir.View, budget: int, policy: str, read_threads: int,
                 reads: threading.Semaphore):
        self.view = view
        job = view.job
        self.dim = job.config.dim
        self.world = job.world
        self.checkpoint = view.checkpoint
        self.step = view.step()
        self.run = job.run  # None: a job written before runs had ids
        self._reads = reads
        row_bytes = job.row_bytes
        self.cached_row_bytes = 4 * (self.dim + 1)  # the embedding, then 1.0 if stored (0.0: a cached miss)
        row_cost = self.row_cost(self.cached_row_bytes)
        buffers = _read_buffer_bytes(job, read_threads)
        calls = (read_threads + 1) * _call_bytes(self.dim)  # + 1: the refresh warming its cache
        self.stores = [jobdir.open_store(rv, row_bytes) for rv in view.ranks]
        ssd = [s.stats() for s in self.stores]
        self.plan = _Plan(budget, math.ceil(INDEX_HEAP_FACTOR * sum(s["index_bytes"] for s in ssd)),
                          sum(_meta_bytes(sum(rv.files.values()), len(rv.files), row_bytes) for rv in view.ranks),
                          buffers, calls, row_cost)
        self.live = [int(s["live_records"]) for s in ssd]
        if self.plan.cache_rows < 1:
            self.stores = []
            self.plan.refuse(job.root)
        # No huge pages: the next checkpoint's cache, warmed with a quarter of its rows
        # beside the served one, would be resident whole (a 2 MiB page a shard's first row).
        self.cache = MemCache(self.cached_row_bytes, capacity=self.plan.cache_rows, policy=policy,
                              loader=self._load, huge_pages=False)
        self.capacity = self.plan.cache_rows
        self.active = 0
        self.retired = False
        # Stats are read between pulls, so that a snapshot never counts half a batch (and
        # before 11f629b MemCache.stats() held the GIL while waiting for a pull's locks).
        self._pulls = 0
        self._stats_wanted = 0
        self._between = threading.Condition()

    def served(self) -> dict:
        """Lookup.served() of this checkpoint."""
        return {"run": self.run, "checkpoint": self.checkpoint, "step": self.step, "world": self.world,
                "dim": self.dim}

    def older_than(self, run: Optional[str], checkpoint: Optional[int]) -> bool:
        """Whether checkpoint `checkpoint` of run `run` is newer than this one: a later
        one of the same run, or any of another run (a job started over in the same path
        numbers its checkpoints from 1 again)."""
        if checkpoint is None:
            return False
        return run != self.view.job.run or checkpoint > self.checkpoint

    @staticmethod
    def row_cost(row_bytes: int) -> int:
        """A cached row's bytes as MemCache counts them, bookkeeping included."""
        big = 1 << 40
        return -(-big // _core.MemCache.capacity_for_budget(big, row_bytes))

    def next_fixed_estimate(self, view: jobdir.View) -> int:
        """Index and metadata of `view`'s checkpoint, estimated before it is opened:
        its keys are at most those served now plus the keys of files added since
        that the served index lacks (and at most its records). A checkpoint of
        another run (the job resharded, or started over) numbers its files anew and
        may have other ranks: its records alone bound it."""
        same_run = view.job.run == self.view.job.run and view.job.world == self.world
        index = meta = 0
        for r, rv in enumerate(view.ranks):
            records = sum(rv.files.values())
            keys = records
            if same_run:
                now = self.view.ranks[r].files
                added = {seq: n for seq, n in rv.files.items() if seq not in now}
                keys = min(records, self.live[r] + self._unknown_keys(r, rv, added))
            index += math.ceil(INDEX_HEAP_FACTOR * index_bytes_estimate(keys))
            meta += _meta_bytes(records, len(rv.files), view.job.row_bytes)
        return index + meta

    def _unknown_keys(self, rank: int, rv: jobdir.RankView, added: dict) -> int:
        """How many keys of the files `added` ({sequence: records}) rank's served
        index lacks, counted a chunk at a time (a key in two chunks twice: a bound).
        A training job's new files hold mostly keys it had, so counting them all
        (as before) made a refresh look 5-15% larger than it was, and with a small
        reserve a refresh blocked lookups needlessly. Costs the added files' keys
        read once and an index probe each (no row read)."""
        unknown = 0
        for seq, records in added.items():
            path = os.path.join(rv.path, jobdir.file_name(seq))
            for at in range(0, records, NEW_KEYS_CHUNK):
                try:
                    keys = jobdir.read_keys(path, min(NEW_KEYS_CHUNK, records - at), first=at)
                except (OSError, ValueError):
                    return sum(added.values())  # unreadable here: the open says why; bound by records
                unknown += int(len(keys) - self.stores[rank].stamps(keys)[1].sum())
        return unknown

    def _load(self, keys: np.ndarray):
        out = np.zeros((len(keys), self.dim + 1), np.float32)
        if self.world == 1:
            parts = [(np.arange(len(keys)), 0)]
        else:
            from hps.distributed.sparse import owner_ranks
            owners = owner_ranks(keys, self.world)
            parts = [(np.flatnonzero(owners == r), r) for r in range(self.world)]
        for idx, r in parts:
            with self.view.ranks[r].source_names():  # a CRC failure names the checkpoint's file
                for at in range(0, len(idx), READ_KEYS):  # a read's scratch stays READ_KEYS rows' blocks
                    part = idx[at:at + READ_KEYS]
                    with self._reads:
                        rows, found = self.stores[r].get(keys[part], np.float32)
                    out[part, :self.dim] = rows[:, :self.dim]
                    out[part, self.dim] = found
        return out, np.zeros(len(keys), bool)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = np.empty((len(keys), self.dim), np.float32)
        found = np.empty(len(keys), bool)
        with self._between:
            while self._stats_wanted:
                self._between.wait()
            self._pulls += 1
        try:
            for at in range(0, len(keys), CALL_KEYS):  # the working memory stays CALL_KEYS keys' (_call_bytes)
                part = keys[at:at + CALL_KEYS]
                uniq, inverse = np.unique(part, return_inverse=True)
                got = self._pull(uniq)
                np.take(got[:, :self.dim], inverse, axis=0, out=rows[at:at + len(part)])
                found[at:at + len(part)] = got[inverse, self.dim] > 0
        finally:
            with self._between:
                self._pulls -= 1
                self._between.notify_all()
        return rows, found

    def _pull(self, uniq: np.ndarray) -> np.ndarray:
        step = max(1, self.capacity // 2)  # a pull holds its rows in the cache until it returns
        if len(uniq) <= step:
            return self.cache.pull(uniq, dtype=np.float32)[0]
        got = np.empty((len(uniq), self.dim + 1), np.float32)
        for at in range(0, len(uniq), step):
            got[at:at + step] = self.cache.pull(uniq[at:at + step], dtype=np.float32)[0]
        return got

    def cache_stats(self) -> dict:
        """The cache's stats, read between pulls (__init__)."""
        with self._between:
            self._stats_wanted += 1
            try:
                while self._pulls:
                    self._between.wait()
                return self.cache.stats()
            finally:
                self._stats_wanted -= 1
                self._between.notify_all()

    def held_bytes(self) -> int:
        """What this generation holds now: its fixed parts and its cache's rows (the
        calls' working memory is the Lookup's, counted once beside its generations)."""
        cache = self.cache_stats()["size"] if self.cache is not None else 0
        return self.plan.fixed - self.plan.calls + cache * self.plan.row_cost

    def close(self, keep_view: bool = False) -> None:
        self.stores = []
        self.cache = None
        if not keep_view:
            self.view.close()

    def abandon(self) -> None:
        """In a child of the process that opened it: drops this process's copies of the
        stores (their io_uring rings are the parent's too) and of the cache, and of the
        view's lock; the view itself, still the parent's, stays."""
        self.stores = []
        self.cache = None
        if self.view.lock >= 0:
            os.close(self.view.lock)  # (the flock stays the parent's: its descriptor holds it)
            self.view.lock = -1


# Forks of this process that this one is a child of (os.register_at_fork): a Lookup
# opened at another count was opened by an ancestor, whose readers it must not use
# (Lookup._here). _fork_lock is made anew in each child: a thread of the parent may
# have held it at the fork.
_forks = 0
_fork_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _forks, _fork_lock
    _forks += 1
    _fork_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def steady_heap() -> None:
    """Fixes glibc's mmap threshold at its initial 128 KiB. Left to itself, glibc
    raises the threshold to the size of each mmapped block freed, so the calls'
    temporaries (a MiB or so each: rows of CALL_KEYS keys, a read's scratch) come
    from the heap after the first few, and their pages stay resident once freed: in
    W11 (2M rows of dim 64) a refresh peaked 8.5% over the budget at 2d9dea2. A fixed
    threshold gives such blocks back to the kernel when freed, at the price of a fresh
    mapping (page faults) per block.
    Process-wide; elsewhere (another libc) a no-op."""
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass


def _return_freed_memory() -> None:
    """Hands the pages of a freed generation back to the kernel. Its key index is
    2^16 shard vectors and its cache's bookkeeping many more, so glibc's heaps keep
    their freed pages and the next generation grows the heap anew (at 200k keys of dim
    64 and a 41 MB budget, the resident set after three refreshes and lookups was 46-48
    MB above the process's start without this, 32-33 MB with it); malloc_trim returns
    the free pages inside the heaps too. Elsewhere (another libc) a no-op."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Lookup:
    """Rows of a job's last finished checkpoint (every rank's shard), read-only.

    ``lookup(keys)`` returns (rows (n, dim) float32, found (n,) bool) for uint64
    keys in any order, repeats allowed. A key the checkpoint does not hold (never
    updated by training) gets a zero row and found = False; the model itself would
    give it the initializer's row, a function of the seed and the key.
    ``lookup_with_checkpoint(keys)`` adds the checkpoint and step the answer was
    read from (the ``checkpoint`` property may have moved on by the time it returns).

    ``memory_budget`` (bytes, or a string like "256MiB") bounds all the lookup
    holds: the stores' key index and files' metadata, the read buffers of up to
    ``read_threads`` concurrent SSD-PS reads, the working memory of as many calls
    (a call works on CALL_KEYS keys at a time), the reserve a refresh opens the next
    checkpoint in, and the cache of rows (a MEM-PS, hps.MemCache, TinyLFU
    admission by default), which gets what is left (module docstring). A budget
    that leaves no row for the cache is refused, naming memory_budget and the
    sizes it needs. ``stats()["memory"]`` gives each part and the total held.

    ``refresh()`` moves to the job's newer checkpoint, if any, while lookups go on.
    The next checkpoint's stores are opened beside the served one's, in the
    reserve, and its cache is warmed with the rows of the keys looked up lately
    (up to a quarter of the cache's rows), read from the new checkpoint, so hot keys
    do not all miss at once; then lookups wait for those under way on the old one
    to return (one batch at most), the old one is freed, and the new one serves. A
    checkpoint whose estimated index does not fit the reserve (the job grew by
    more than REFRESH_HEADROOM) is opened after the old one is freed instead,
    lookups waiting meanwhile (``stats()["blocking_refreshes"]``). Either way each
    answer is one checkpoint's. Training may run at the same path meanwhile.

    Opening one fixes glibc's mmap threshold for the whole process (steady_heap),
    so that freed temporaries leave the resident set instead of the budget's margin.

    Thread-safe: up to ``read_threads`` lookups run in parallel (the SSD-PS reads
    without the GIL), more wait for one of them to return. Fork-safe: in a child of
    the process that opened it, the first call pins the job's last checkpoint anew,
    with readers and a cache of the child's own (_here).

    The checkpoint is pinned (hps.jobdir: hard links in <path>/.hps-readers), so
    training may prune it while it is served; ``close()`` releases it (once a refresh
    under way on another thread has finished).
    """

    def __init__(self, path: Union[str, os.PathLike], memory_budget: Union[int, str] = "256MiB", *,
                 cache_policy: str = "tinylfu-lfu", read_threads: int = 4):
        self.path = os.fspath(path)
        self._budget = parse_bytes(memory_budget, "memory_budget")
        if not isinstance(read_threads, int) or read_threads < 1:
            raise ValueError(f"read_threads: a positive number of concurrent SSD-PS reads, not {read_threads!r}")
        self._policy = cache_policy
        self._read_threads = read_threads
        steady_heap()
        self._fork = _forks  # the fork of this process that opened it (_here)
        self._start()
        self._current = self._open()
        self._new_ring(self._current)
        self._note(self._current)

    def _start(self) -> None:
        """The state of a Lookup serving nothing yet: its locks and counters."""
        self._reads = threading.BoundedSemaphore(self._read_threads)
        self._calls = threading.BoundedSemaphore(self._read_threads)  # calls working at once (_call_bytes each)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # a swap waits for the old generation's lookups
        self._swapping = False
        self._refresh_lock = threading.Lock()
        self._current: Optional[_Generation] = None
        # Why no checkpoint is served, when a refresh with no room beside the served one
        # could open neither the new checkpoint nor the served one again (None: one is
        # served, or the Lookup is closed). The next refresh() opens the job's last one.
        self._unserved: Optional[str] = None
        self._lookups = 0
        self._refreshes = 0
        self._blocking_refreshes = 0
        self._recent: Optional[np.ndarray] = None  # a ring of the keys looked up lately, to warm a refresh
        self._recent_at = self._recent_n = 0
        self._warmed = 0  # rows read into the cache by the last refresh
        # The counters of the checkpoints served before this one (CACHE_COUNTERS, and
        # the SSD-PS bytes read), added to the served one's by stats()
        self._carried_cache = dict.fromkeys(CACHE_COUNTERS, 0)
        self._carried_ssd_bytes = 0
        self._peak = 0    # the most held at once, by the split's accounting

    def _here(self, reopen: bool = True) -> None:
        """Makes the Lookup this process's before a call: one opened before os.fork
        (a pre-forking server's preload, multiprocessing's fork) left the child the
        parent's SSD-PS readers, whose io_uring rings the two processes then shared,
        failing each other's reads ("submission queue stays full", naming a checkpoint's
        file), and the parent's pinned view, which the child's close() removed. The
        child drops its copies of them (the view stays the parent's) and pins the job's
        last checkpoint anew, with readers, cache and counters of its own; not
        `reopen`: it serves nothing (close())."""
        if self._fork == _forks:
            return
        with _fork_lock:
            if self._fork == _forks:
                return
            inherited, unserved = self._current, self._unserved
            if inherited is not None:
                inherited.abandon()
            # (the parent's locks may have been held by threads the fork did not copy)
            self._start()
            try:
                if inherited is None or not reopen:  # closed stays closed; unserved, the next refresh() opens
                    self._unserved = unserved if reopen else None
                    return
                try:
                    self._current = self._open()
                except BaseException as e:  # serving nothing: the next refresh() opens the job's last one
                    self._unserved = (f"opening it in process {os.getpid()}, forked from the one that opened it, "
                                      f"failed ({type(e).__name__}: {e})")
                    raise
                self._new_ring(self._current)
                self._note(self._current)
            finally:  # (only now: the child's other threads wait above until it serves)
                self._fork = _forks

    def _open(self, view: Optional[jobdir.View] = None) -> _Generation:
        view = jobdir.pin(self.path) if view is None else view
        try:
            return _Generation(view, self._budget, self._policy, self._read_threads, self._reads)
        except BaseException:
            view.close()
            raise

    def _new_ring(self, gen: _Generation) -> None:
        with self._lock:
            old = self._recent
            self._recent = np.zeros(gen.plan.warm_rows, np.uint64)
            self._recent_at = self._recent_n = 0
            if old is not None and len(old) and len(self._recent):
                keep = old[:len(self._recent)]
                self._recent[:len(keep)] = keep
                self._recent_n = len(keep)

    def _ring_bytes(self) -> int:
        return 0 if self._recent is None else self._recent.nbytes

    def _note(self, *gens: _Generation) -> int:
        """What is held now with these generations open (the calls' working memory
        once, at the newest one's dim), noted toward the peak; returns it."""
        held = sum(g.held_bytes() for g in gens) + gens[-1].plan.calls + self._ring_bytes()
        with self._lock:
            self._peak = max(self._peak, held)
        return held

    # ------------------------------------------------------------ generations
    def _acquire(self) -> _Generation:
        self._here()
        with self._lock:
            while self._swapping:
                self._idle.wait()
            gen = self._current
            if gen is None:
                raise self._none_served()
            gen.active += 1
            return gen

    def _none_served(self) -> Exception:
        if self._unserved is not None:
            return RuntimeError(f"hps.Lookup of {self.path} serves no checkpoint: {self._unserved}; refresh() "
                                f"opens the job's last one")
        return ValueError(f"hps.Lookup of {self.path} is closed")

    def _release(self, gen: _Generation) -> None:
        with self._lock:
            gen.active -= 1
            free = gen.retired and gen.active == 0
            if gen.active == 0:
                self._idle.notify_all()
        if free:
            gen.close()

    def _retire(self, gen: _Generation) -> None:
        with self._lock:
            gen.retired = True
            free = gen.active == 0
        if free:
            gen.close()

    def _swap(self, new: Optional[_Generation]) -> _Generation:
        """Stops new lookups, waits for those under way, puts `new` in place (None:
        nothing yet, lookups keep waiting) and returns the old generation, idle."""
        with self._lock:
            self._swapping = True
            old = self._current
            while old.active:
                self._idle.wait()
            # before the new one serves: a stats() meanwhile waits (_swapping), so it never
            # sees the old one's counts twice or not at all
            self._carry_counters(old)
            if new is not None:
                self._current, self._swapping = new, False
                self._idle.notify_all()
            return old

    def _carry_counters(self, gen: _Generation) -> None:
        """Adds idle generation gen's counters to those carried (REQUIRES: self._lock held)."""
        cache = gen.cache_stats()
        for k in CACHE_COUNTERS:
            self._carried_cache[k] += int(cache[k])
        self._carried_ssd_bytes += int(sum(s.stats()["bytes_read"] for s in gen.stores))

    def _serve(self, new: _Generation) -> None:
        with self._lock:
            self._current, self._swapping = new, False
            self._idle.notify_all()

    def _unserve(self, why: str) -> None:
        with self._lock:
            self._current, self._swapping, self._unserved = None, False, why
            self._idle.notify_all()

    def _reopen(self) -> bool:
        """refresh() when no checkpoint is served (_unserved): opens the job's last one.
        REQUIRES: self._refresh_lock is held."""
        new = self._open()
        self._new_ring(new)
        with self._lock:
            self._current, self._unserved = new, None
            self._refreshes += 1
            self._blocking_refreshes += 1
            self._idle.notify_all()
        self._note(new)
        return True

    # ------------------------------------------------------------ API
    def lookup(self, keys) -> tuple[np.ndarray, np.ndarray]:
        rows, found, _, _ = self.lookup_with_checkpoint(keys)
        return rows, found

    def lookup_with_checkpoint(self, keys) -> tuple[np.ndarray, np.ndarray, int, Optional[int]]:
        """(rows, found, checkpoint, step): lookup()'s answer and the checkpoint it was
        read from. Read apart, a refresh finishing between the two would pair one
        checkpoint's rows with the next one's number."""
        rows, found, served = self.lookup_served(keys)
        return rows, found, served["checkpoint"], served["step"]

    def lookup_served(self, keys) -> tuple[np.ndarray, np.ndarray, dict]:
        """(rows, found, served): lookup()'s answer and served() of the checkpoint it was
        read from, its run included: a checkpoint's number alone does not name it, since
        a job started over in its path (or rolled back, or resharded) numbers them anew."""
        keys = np.asarray(keys)
        if keys.ndim != 1:
            raise ValueError(f"keys: a 1-D array, not of shape {keys.shape}")
        if keys.dtype != np.uint64:
            if keys.size and (keys.dtype.kind not in "iu" or (keys.dtype.kind == "i" and keys.min() < 0)):
                raise ValueError(f"keys: unsigned 64-bit integers, not {keys.dtype}"
                                 + (f" (key {keys.min()} at index {int(np.argmin(keys))})"
                                    if keys.dtype.kind == "i" else ""))
            keys = keys.astype(np.uint64)
        bad = np.flatnonzero(keys == np.uint64(EMPTY_KEY))
        if len(bad):
            raise ValueError(f"keys: index {int(bad[0])} holds the reserved key 2^64-1 (hps.EMPTY_KEY)")
        self._here()  # (before self._calls: in a child of the process that opened it, the parent's)
        with self._calls:
            gen = self._acquire()
            try:
                if len(keys) == 0:  # counted below like any other (it returned before, uncounted)
                    result = np.empty((0, gen.dim), np.float32), np.empty(0, bool), gen.served()
                else:
                    result = (*gen.lookup(keys), gen.served())
            finally:
                self._release(gen)
        with self._lock:
            self._lookups += 1
            ring = self._recent
            if len(ring):
                tail = keys[-len(ring):]
                at = self._recent_at
                first = min(len(tail), len(ring) - at)
                ring[at:at + first] = tail[:first]
                ring[:len(tail) - first] = tail[first:]
                self._recent_at = (at + len(tail)) % len(ring)
                self._recent_n = min(len(ring), self._recent_n + len(tail))
        return result

    __call__ = lookup

    def refresh(self) -> bool:
        """Moves to the job's last finished checkpoint if it is newer than the one
        served (a later one, or one of another run: the job started over in this
        path); returns whether it moved. Lookups go on meanwhile (class docstring)."""
        self._here()
        with self._refresh_lock:
            job = jobdir.read_job(self.path)
            with self._lock:
                current = self._current
            if current is None:
                if self._unserved is None:
                    raise self._none_served()
                return self._reopen()
            if not current.older_than(job.run, job.checkpoint):
                return False
            view = jobdir.pin(self.path)
            if not current.older_than(view.job.run, view.checkpoint):
                view.close()
                return False
            # A failure from here on (a row of the new checkpoint failing its CRC while
            # the cache is warmed, say) leaves the served checkpoint serving, and unpins
            # the new one: its view's links would otherwise keep its files on disk after
            # training prunes it, one more view each --refresh-every.
            try:
                with self._lock:
                    recent = np.unique(self._recent[:self._recent_n])
                # The new checkpoint's own read buffers, not the served one's: a job resharded
                # to more ranks has a store, and its readers, per rank (the reserve holds the
                # served one's, so the check let the difference pass the budget).
                fits = (current.next_fixed_estimate(view) + _read_buffer_bytes(view.job, self._read_threads)
                        <= current.plan.next_fixed)
            except BaseException:
                view.close()
                raise
            if fits:  # beside the served checkpoint, in its reserve
                new = self._open(view)
                try:
                    warm = self._warm(new, recent[:min(current.plan.warm_rows, new.capacity // 2)])
                except BaseException:
                    new.close()
                    raise
                self._note(current, new)
                old = self._swap(new)
                old.close()
                _return_freed_memory()
            else:  # no room for both: free the served one first, lookups waiting meanwhile
                old = self._swap(None)
                old.close(keep_view=True)
                try:
                    new = self._open(view)
                    _return_freed_memory()
                    try:
                        warm = self._warm(new, recent[:new.capacity // 2])
                    except BaseException:
                        new.close()
                        raise
                except BaseException as failed:
                    # back to the checkpoint served, still pinned: until _serve the lookups
                    # wait (_swapping), so leaving without it would block them for good
                    try:
                        back = self._open(old.view)
                    except BaseException as e:  # (its view is unpinned by _open)
                        # Nothing to serve: the lookups fail, naming both failures, until a
                        # refresh opens a checkpoint. (They waited for good, and so did a
                        # stopping hps serve, which waits for its lookups.)
                        self._unserve(f"a refresh to checkpoint {view.checkpoint} failed "
                                      f"({type(failed).__name__}: {failed}) after checkpoint {old.checkpoint} "
                                      f"was freed, which could not be opened again ({type(e).__name__}: {e})")
                        raise failed
                    self._serve(back)
                    raise
                old.view.close()
                self._serve(new)
                self._blocking_refreshes += 1
            self._warmed = len(warm)
            self._new_ring(new)
            with self._lock:
                self._refreshes += 1
            self._note(new)
            return True

    @staticmethod
    def _warm(new: _Generation, keys: np.ndarray) -> np.ndarray:
        """Reads keys (the ones looked up lately) into new's cache before it serves."""
        if len(keys):
            new.lookup(keys)
        return keys

    def _served(self) -> _Generation:
        self._here()
        gen = self._current
        if gen is None:
            raise self._none_served()
        return gen

    @property
    def checkpoint(self) -> int:
        return self._served().checkpoint

    @property
    def step(self) -> Optional[int]:
        return self._served().step

    @property
    def dim(self) -> int:
        return self._served().dim

    @property
    def world(self) -> int:
        return self._served().world

    def served(self) -> dict:
        """{"run", "checkpoint", "step", "world", "dim"} of the checkpoint served, all read
        from it: read one property after another, a refresh finishing in between paired one
        checkpoint's number with the next one's step and world. The run tells a checkpoint
        from another of the same number: a job started over in its path, rolled back or
        resharded numbers its checkpoints anew (None: a job written before runs had ids)."""
        return self._served().served()

    def stats(self) -> dict:
        """The checkpoint served, its rows, counters, and ``memory``: the budget's
        parts in bytes (index, files' metadata, read buffers, refresh reserve, the
        cache's budget and its rows held now, the warm keys), ``held_bytes`` (what
        is held now by that accounting), ``peak_held_bytes`` (the most held at once
        so far, a refresh's two checkpoints included) and ``within_budget``.

        The counters (``lookups``, ``refreshes``, ``blocking_refreshes``,
        ``ssd_bytes_read`` and ``cache``'s CACHE_COUNTERS: hits, misses, evictions, ...)
        count over the Lookup's life, the checkpoints served before included, so that
        they never drop at a refresh; ``cache``'s other fields (size, capacity, ...),
        ``rows``, ``memory`` and ``warmed_rows`` are the served checkpoint's."""
        gen = self._acquire()
        try:
            cache = gen.cache_stats()
            ssd = [s.stats() for s in gen.stores]
            with self._lock:
                carried_cache, carried_ssd_bytes = dict(self._carried_cache), self._carried_ssd_bytes
            plan = gen.plan
            held = self._note(gen)
            memory = {"budget_bytes": self._budget, "index_bytes": plan.index, "file_meta_bytes": plan.meta,
                      "read_buffer_bytes": plan.buffers, "read_threads": self._read_threads,
                      "call_bytes": plan.calls,
                      "refresh_reserve_bytes": plan.reserve, "warm_keys_bytes": self._ring_bytes(),
                      "cache_budget_bytes": plan.cache_rows * plan.row_cost,
                      "cache_bytes": cache["size"] * plan.row_cost, "cache_row_bytes": plan.row_cost,
                      "held_bytes": held, "peak_held_bytes": self._peak,
                      "total_bytes": plan.fixed + plan.reserve + self._ring_bytes()
                      + plan.cache_rows * plan.row_cost}
            memory["within_budget"] = memory["peak_held_bytes"] <= self._budget \
                and memory["total_bytes"] <= self._budget
            cache.update({k: int(cache[k]) + carried_cache[k] for k in CACHE_COUNTERS})
            return {**gen.served(), "memory_budget": self._budget, "memory": memory, "cache": cache,
                    "rows": int(sum(len(s) for s in gen.stores)),
                    "index_bytes": plan.index,
                    "ssd_bytes_read": carried_ssd_bytes + int(sum(s["bytes_read"] for s in ssd)),
                    "lookups": self._lookups, "refreshes": self._refreshes,
                    "blocking_refreshes": self._blocking_refreshes, "warmed_rows": self._warmed}
        finally:
            self._release(gen)

    def close(self) -> None:
        self._here(reopen=False)  # (a child closing the Lookup its parent opened leaves the parent's view)
        # After a refresh under way on another thread: it would otherwise swap its new
        # checkpoint into a closed Lookup and leave that checkpoint pinned.
        with self._refresh_lock:
            with self._lock:
                gen, self._current, self._unserved = self._current, None, None
        if gen is not None:
            self._retire(gen)

    def __enter__(self) -> "Lookup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        gen = self._current
        where = f"checkpoint {gen.checkpoint}" if gen is not None else "closed"
        return f"Lookup({self.path!r}, {where})"
