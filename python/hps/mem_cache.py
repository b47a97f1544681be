"""MEM-PS: the host-memory cache of rows between the device tier and SSD-PS."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import numpy as np

from hps import _core
from hps.config import parse_bytes  # (hps.mem_cache.parse_bytes, as before)

POLICIES: tuple[str, ...] = tuple(_core.CACHE_POLICIES)
CacheFullError = _core.CacheFullError

class MemCache(_core.MemCache):
    """Rows of ``row_bytes`` under uint64 keys, in ``capacity`` rows of host memory
    (or as many as ``budget`` bytes hold, bookkeeping included).

    ``pull(keys, pin)`` returns (rows, hit): cached rows are hits, the others come
    from ``loader(keys) -> (rows, dirty)`` in one call and enter the cache,
    evicting by ``policy`` (one of POLICIES); an evicted dirty row goes to
    ``sink(keys, rows)`` before the call returns (a ``_core.BackingStore`` may be
    both loader and sink: the parameter server's, native), as does a dirty row that
    an unpinned pull serves uncached, its shard's slots all pinned. Pinned rows stay until
    ``write_back(keys, rows)`` (which marks them dirty) or ``unpin(keys)``; a key
    not pinned makes either raise ValueError, changing nothing, and one that another
    thread unpinned during the call makes it raise RuntimeError naming it, once the
    other keys are released (``write_back`` keeps its row all the same).
    ``keep_updated(keys, rows)`` takes newer rows of keys kept elsewhere (pinned or
    not, cached or not) without a pin or a load, so it never needs a free slot.
    ``access(keys)`` replays a trace: hits are visits, misses enter with zero rows.
    ``set_lookahead(keys)`` tells the cache the keys of the coming batches, so
    that evictions spare them (Belady inside that window), and ``replay(trace,
    batch, lookahead=K)`` replays a trace in batches with such a window of K batches.
    ``push_lookahead(keys)``, ``pop_lookahead()`` and ``slide_lookahead(keys)``
    move that window batch by batch, at the cost of the batches entering and leaving.
    ``erase(keys)`` drops cached rows, clean or dirty, without the sink (keys that
    SSD-PS erased), and returns the count dropped; a pinned row stays pinned but gets
    what the loader gives for its key now (for a key SSD-PS erased, its initial row;
    without a loader it keeps its row, marked dirty).
    ``huge_pages=False`` keeps the rows' arena off transparent huge pages, so that
    its resident memory follows the rows cached (a 2 MiB page is resident once one
    row in it is written); True gives fewer TLB misses to a cache that fills.
    ``prefault=True`` writes every page of the arena when the cache is built: the
    whole budget is resident at once, and no pull waits on the kernel's first
    touch of a fresh page (``[ps] prefault`` in a ParameterServerConfig).
    ``lookahead_room``: bytes the lookahead window may hold (its tables, entries, the
    whole-shard list of its forced evictions and their scratch: ``stats()["lookahead_bytes"]``,
    never more than ``stats()["lookahead_room"]``). With ``budget`` it comes out of the
    budget (the rows get the rest) and defaults to 0: no window may be set. With
    ``capacity`` (rows, no byte bound) it defaults to no bound. A window that would pass
    its room raises CacheFullError naming both, and stays as it was.
    ``MemCache.lookahead_base_room(capacity)`` is what a window holds besides its keys, and
    ``MemCache.lookahead_window_room(batch_keys, batches, capacity)`` the most its keys hold
    in a window of that many batches of at most ``batch_keys`` keys each.
    A call that raises (``CacheFullError``, or what the loader or sink raised) holds
    no pin and loses no dirty row: its victims stay cached and dirty, so it can be
    retried; ``stats()["failed_releases"]`` counts host batches whose release failed.

    >>> import numpy as np, hps
    >>> cache = hps.MemCache(row_bytes=8, capacity=2, policy="lru")
    >>> cache.access(np.array([1, 2, 1, 3, 2], np.uint64)).tolist()
    [False, False, True, False, False]
    """

    POLICIES = POLICIES

    def __init__(self, row_bytes: int, capacity: Optional[int] = None, *,
                 budget: Union[int, str, None] = None, policy: str = "tinylfu-lfu", shards: int = 0,
                 lru_fraction: float = 0.5, loader: Optional[Callable] = None,
                 sink: Optional[Callable] = None, huge_pages: bool = True, prefault: bool = False,
                 lookahead_room: Union[int, str, None] = None):
        if (capacity is None) == (budget is None):
            raise ValueError("give exactly one of capacity (rows) and budget (bytes, e.g. '8GiB')")
        if lookahead_room is None:
            room = 0 if budget is not None else _core.MemCache.UNBOUNDED_ROOM
        else:
            room = parse_bytes(lookahead_room, "lookahead_room")
        if budget is not None:
            total = parse_bytes(budget, "budget")
            if room > total:
                raise ValueError(f"lookahead_room {lookahead_room!r} is more than the budget {budget!r}")
            capacity = _core.MemCache.capacity_for_budget(total - room, row_bytes)
            if capacity == 0:
                raise ValueError(f"budget {budget!r} holds no row of {row_bytes} bytes"
                                 + (f" besides a lookahead_room of {lookahead_room!r}" if room else ""))
        super().__init__(row_bytes, capacity, policy, shards, lru_fraction, loader, sink, huge_pages, prefault,
                         room)
        self._built = True

    def pull(self, keys: np.ndarray, pin: bool = False, dtype=np.uint8) -> tuple[np.ndarray, np.ndarray]:
        rows, hit = super().pull(keys, pin)
        return rows.view(dtype), hit

    def keep_updated(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Takes the newest rows (n, row_bytes bytes each, any dtype) of keys kept
        elsewhere, without a pin or a load: a cached key, pinned or not, gets its
        row, dirty (its pins stay); one not cached gives its row to ``sink`` (its
        only copy: a later pull loads it from there). So it needs no free slot and
        cannot raise CacheFullError. Raises what the sink raised (the rows it was
        given are not kept, the cached keys' are), and ValueError for the reserved
        key 2**64 - 1, changing nothing.

        >>> import numpy as np, hps
        >>> stored = {}
        >>> cache = hps.MemCache(row_bytes=8, capacity=2, policy="lru",
        ...                      sink=lambda k, r: stored.update(zip(k.tolist(), r.tolist())))
        >>> cache.access(np.array([1], np.uint64)).tolist()
        [False]
        >>> cache.keep_updated(np.array([1, 2], np.uint64), np.full((2, 8), 7, np.uint8))
        >>> cache.stats()["dirty"], list(stored)
        (1, [2])
        """
        super().keep_updated(keys, rows)

    def set_lookahead(self, keys: Union[np.ndarray, Sequence[np.ndarray]]) -> None:
        """Lookahead eviction: the keys of the batches coming next, in the order they
        will be needed (repeats allowed), replacing the window set before.

        ``keys``: a 1-D uint64 (or int64) array, or a sequence of them (batch i+1's
        keys, then i+2's, ...), concatenated in that order; empty when no batch comes.
        A pipeline calls it before pinning batch i, with the keys of batches
        i+1..i+K of its prefetch queue (batch i is kept by its pins). While a window
        is set, an eviction takes the policy's first candidate that is not in it; if
        the first ``LOOKAHEAD_SCAN`` candidates all are, a row of the shard that is
        not, else the shard's row needed latest (Belady's choice inside the window).
        ``access`` also counts the rest of its own keys as the window's head. Until
        the first call and after ``clear_lookahead()``, eviction is as without
        lookahead. Safe with concurrent pulls, pins and unpins (each shard swaps its
        window in under its lock).
        Raises ValueError for the reserved key 2**64 - 1 (the window stays as it
        was), TypeError for another dtype.

        >>> import numpy as np, hps
        >>> cache = hps.MemCache(row_bytes=8, capacity=2, policy="lru")
        >>> cache.set_lookahead(np.array([1], np.uint64))  # 1 is needed soon
        >>> cache.access(np.array([1, 2, 3], np.uint64)).tolist()  # 3 evicts 2, not 1
        [False, False, False]
        >>> 1 in cache, 2 in cache
        (True, False)
        """
        if not isinstance(keys, np.ndarray):
            parts = list(keys)
            keys = np.concatenate(parts) if parts else np.empty(0, np.uint64)
        super().set_lookahead(keys)

    def slide_lookahead(self, keys: np.ndarray) -> None:
        """Slides the lookahead window by one batch: ``keys`` (one batch's, 1-D;
        empty when no batch enters) join its end and its first batch leaves, as
        one change. The window is then the one ``set_lookahead`` of its batches'
        keys concatenated would give (the same evictions follow), but the call
        costs only the batches entering and leaving, not the whole window.
        ``push_lookahead(keys)`` appends a batch alone (after ``clear_lookahead()``:
        a window of that batch), ``pop_lookahead()`` drops the first batch alone; a
        window that ``set_lookahead`` gave is one batch. ``stats()["lookahead_slides"]``
        counts the slides and pops. Raises ValueError for the reserved key 2**64 - 1 or
        for a window with no batch to drop (the window stays as it was).

        >>> import numpy as np, hps
        >>> cache = hps.MemCache(row_bytes=8, capacity=2, policy="lru")
        >>> cache.push_lookahead(np.array([1], np.uint64))  # the next batch needs 1
        >>> cache.push_lookahead(np.array([2], np.uint64))  # the one after, 2
        >>> cache.slide_lookahead(np.array([], np.uint64))  # batch 1 goes: 2 is needed
        >>> cache.access(np.array([1, 2, 3], np.uint64)).tolist()  # 3 evicts 1, not 2
        [False, False, False]
        >>> 1 in cache, 2 in cache
        (False, True)
        """
        super().slide_lookahead(keys)

    def replay(self, trace: np.ndarray, batch: Union[int, Sequence[int]], lookahead: int = 0) -> np.ndarray:
        """Replays ``trace`` (n,) through ``access`` in batches, with a lookahead
        window of ``lookahead`` batches: before batch i's access, the window holds
        the keys of batches i+1..i+lookahead (fewer, then none, at the end), as
        a pipeline's prefetch stage would (set before batch 0, then slid batch by
        batch: ``slide_lookahead``); ``access`` counts the rest of batch i as
        the window's head (the pipeline pins its batch whole). Returns the (n,) hit
        mask. ``batch``: keys per batch (the last may be shorter), or the sizes of
        the batches (summing to n). ``lookahead=0``: ``access`` batch by batch
        without lookahead. Ends with ``clear_lookahead()``.

        >>> import numpy as np, hps
        >>> trace = np.array([1, 2, 3, 1], np.uint64)
        >>> hps.MemCache(row_bytes=8, capacity=2, policy="lru").replay(trace, 2).tolist()
        [False, False, False, False]
        >>> hps.MemCache(row_bytes=8, capacity=2, policy="lru").replay(trace, 2, lookahead=1).tolist()
        [False, False, False, True]
        """
        trace = np.asarray(trace)
        if trace.ndim != 1:
            raise ValueError(f"trace must be 1-D, got shape {trace.shape}")
        if isinstance(lookahead, bool) or not isinstance(lookahead, (int, np.integer)) or lookahead < 0:
            raise ValueError(f"lookahead must be an int >= 0 (batches), got {lookahead!r}")
        if isinstance(batch, (int, np.integer)) and not isinstance(batch, bool):
            if batch < 1:
                raise ValueError(f"batch must be >= 1 keys, got {batch}")
            bounds = np.append(np.arange(0, len(trace), int(batch)), len(trace))
        else:
            sizes = np.asarray(batch)
            if sizes.ndim != 1 or sizes.dtype.kind not in "iu" or (sizes < 0).any() \
                    or int(sizes.sum()) != len(trace):
                raise ValueError(f"batch sizes must be integers >= 0 that sum to the trace's {len(trace)} keys")
            bounds = np.concatenate([[0], np.cumsum(sizes)])
        bounds = [int(b) for b in bounds]
        batches = len(bounds) - 1
        hit = np.zeros(len(trace), dtype=bool)
        self.clear_lookahead()
        try:
            for i in range(batches):
                if lookahead and i == 0:  # batches 1..lookahead: the first alone, then each pushed
                    self.set_lookahead(trace[bounds[min(1, batches)]:bounds[min(2, batches)]])
                    for j in range(2, min(1 + lookahead, batches)):
                        self.push_lookahead(trace[bounds[j]:bounds[j + 1]])
                elif lookahead:  # batch i leaves, batch i + lookahead (or none, at the end) enters
                    entering = min(i + lookahead, batches)
                    self.slide_lookahead(trace[bounds[entering]:bounds[min(entering + 1, batches)]])
                hit[bounds[i]:bounds[i + 1]] = self.access(trace[bounds[i]:bounds[i + 1]])
        finally:
            self.clear_lookahead()
        return hit

    def __repr__(self) -> str:
        # A cache whose __init__ raised has no native object behind it, and its methods
        # raise ValueError saying so (the binding's ConstructedCaster); a traceback that
        # shows its frame's locals (pytest's, a debugger's) calls repr on it.
        if not getattr(self, "_built", False):
            return "MemCache(not built: its constructor raised)"
        s = self.stats()
        return f"MemCache(row_bytes={self.row_bytes}, size={s['size']}, capacity={s['capacity']})"
