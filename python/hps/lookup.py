"""hps.Lookup: embedding rows of a job's last finished checkpoint, read-only,
through a memory budget of its own in front of the checkpoint's SSD-PS files
(docs/serving.md)."""
from __future__ import annotations

import collections
import os
import threading
from typing import Optional, Union

import numpy as np

from hps import jobdir
from hps.hash_table import EMPTY_KEY
from hps.mem_cache import MemCache, parse_bytes


class _Generation:
    """One pinned checkpoint: every rank's store (read only) and a cache of
    (embedding, found) rows in front of them. Freed once retired and idle."""

    def __init__(self, view: jobdir.View, budget: int, policy: str):
        self.view = view
        job = view.job
        self.dim = job.config.dim
        self.world = job.world
        self.checkpoint = view.checkpoint
        self.step = jobdir.step_of(job, view.checkpoint)
        row_bytes = job.row_bytes
        self.stores = [jobdir.open_store(rv, row_bytes) for rv in view.ranks]
        # A cached row: the embedding, then 1.0 if the key is stored (0.0: a cached miss).
        self.cache = MemCache(4 * (self.dim + 1), budget=budget, policy=policy, loader=self._load)
        self.capacity = self.cache.stats()["capacity"]
        self.active = 0
        self.retired = False

    def _load(self, keys: np.ndarray):
        out = np.zeros((len(keys), self.dim + 1), np.float32)
        if self.world == 1:
            parts = [(np.arange(len(keys)), 0)]
        else:
            from hps.distributed.sparse import owner_ranks
            owners = owner_ranks(keys, self.world)
            parts = [(np.flatnonzero(owners == r), r) for r in range(self.world)]
        for idx, r in parts:
            if len(idx):
                rows, found = self.stores[r].get(keys[idx], np.float32)
                out[idx, :self.dim] = rows[:, :self.dim]
                out[idx, self.dim] = found
        return out, np.zeros(len(keys), bool)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        uniq, inverse = np.unique(keys, return_inverse=True)
        rows = np.empty((len(uniq), self.dim + 1), np.float32)
        step = max(1, self.capacity // 2)  # a pull holds its rows in the cache until it returns
        for at in range(0, len(uniq), step):
            got, _ = self.cache.pull(uniq[at:at + step], dtype=np.float32)
            rows[at:at + step] = got
        rows = rows[inverse.ravel()]
        return np.ascontiguousarray(rows[:, :self.dim]), rows[:, self.dim] > 0

    def close(self) -> None:
        self.stores = []
        self.cache = None
        self.view.close()


class Lookup:
    """Rows of a job's last finished checkpoint (every rank's shard), read-only.

    ``lookup(keys)`` returns (rows (n, dim) float32, found (n,) bool) for uint64
    keys in any order, repeats allowed. A key the checkpoint does not hold (never
    updated by training) gets a zero row and found = False; the model itself would
    give it the initializer's row, a function of the seed and the key.

    ``memory_budget`` (bytes, or a string like "256MiB") bounds the cache of rows
    (embedding only, misses included) in front of the checkpoint's SSD-PS files,
    a MEM-PS (hps.MemCache, TinyLFU admission by default). The stores' key index
    (about 10 bytes a key) is beside it: ``stats()`` gives both.

    ``refresh()`` moves to the job's newer checkpoint, if any, while lookups go on:
    those under way finish on the old one, later ones use the new one, and the old
    one is freed when its last lookup returns (until then both caches are held).
    Before it serves, the new cache is filled with the rows of the keys looked up
    lately (up to half its capacity), read from the new checkpoint, so hot keys do
    not all miss at once after a refresh. Training may run at the same path meanwhile.

    Thread-safe: lookups run in parallel (the SSD-PS reads without the GIL).

    The checkpoint is pinned (hps.jobdir: hard links in <path>/.hps-readers), so
    training may prune it while it is served; ``close()`` releases it.
    """

    def __init__(self, path: Union[str, os.PathLike], memory_budget: Union[int, str] = "256MiB", *,
                 cache_policy: str = "tinylfu-lfu"):
        self.path = os.fspath(path)
        self._budget = parse_bytes(memory_budget, "memory_budget")
        self._policy = cache_policy
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._current: Optional[_Generation] = None
        self._lookups = 0
        self._refreshes = 0
        self._recent: collections.deque = collections.deque()  # the last batches' keys, to warm a refresh
        self._recent_keys = 0
        self._warmed = 0  # rows read into the cache by the last refresh
        self._current = self._open()

    def _open(self) -> _Generation:
        view = jobdir.pin(self.path)
        try:
            return _Generation(view, self._budget, self._policy)
        except BaseException:
            view.close()
            raise

    # ------------------------------------------------------------ generations
    def _acquire(self) -> _Generation:
        with self._lock:
            gen = self._current
            if gen is None:
                raise ValueError(f"hps.Lookup of {self.path} is closed")
            gen.active += 1
            return gen

    def _release(self, gen: _Generation) -> None:
        with self._lock:
            gen.active -= 1
            free = gen.retired and gen.active == 0
        if free:
            gen.close()

    def _retire(self, gen: _Generation) -> None:
        with self._lock:
            gen.retired = True
            free = gen.active == 0
        if free:
            gen.close()

    # ------------------------------------------------------------ API
    def lookup(self, keys) -> tuple[np.ndarray, np.ndarray]:
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
        gen = self._acquire()
        try:
            if len(keys) == 0:
                return np.empty((0, gen.dim), np.float32), np.empty(0, bool)
            result = gen.lookup(keys)
        finally:
            self._release(gen)
        with self._lock:
            self._lookups += 1
            self._recent.append(keys)
            self._recent_keys += len(keys)
            while self._recent_keys - len(self._recent[0]) >= gen.capacity // 2:
                self._recent_keys -= len(self._recent.popleft())
        return result

    __call__ = lookup

    def refresh(self) -> bool:
        """Moves to the job's last finished checkpoint if it is newer than the one
        served; returns whether it moved. Lookups go on meanwhile."""
        with self._refresh_lock:
            job = jobdir.read_job(self.path)
            with self._lock:
                current = self._current
            if current is None:
                raise ValueError(f"hps.Lookup of {self.path} is closed")
            if job.checkpoint is None or job.checkpoint <= current.checkpoint:
                return False
            new = self._open()
            with self._lock:
                recent = list(self._recent)
            if recent:  # warm the new cache with the keys looked up lately, before it serves
                warm = np.unique(np.concatenate(recent))[:new.capacity // 2]
                new.lookup(warm)
                self._warmed = len(warm)
            with self._lock:
                old, self._current = self._current, new
                self._refreshes += 1
            self._retire(old)
            return True

    def _served(self) -> _Generation:
        gen = self._current
        if gen is None:
            raise ValueError(f"hps.Lookup of {self.path} is closed")
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

    def stats(self) -> dict:
        gen = self._acquire()
        try:
            cache = gen.cache.stats()
            ssd = [s.stats() for s in gen.stores]
            return {"checkpoint": gen.checkpoint, "step": gen.step, "world": gen.world, "dim": gen.dim,
                    "memory_budget": self._budget, "cache": cache,
                    "rows": int(sum(len(s) for s in gen.stores)),
                    "index_bytes": int(sum(s["index_bytes"] for s in ssd)),
                    "ssd_bytes_read": int(sum(s["bytes_read"] for s in ssd)),
                    "lookups": self._lookups, "refreshes": self._refreshes, "warmed_rows": self._warmed}
        finally:
            self._release(gen)

    def close(self) -> None:
        with self._lock:
            gen, self._current = self._current, None
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
