"""Herald (APNet 2022): location-aware batch partition and on-demand synchronisation.

In synchronous training where each of W workers keeps an embedding cache, the
scheduler assigns each example of a batch to the worker whose cache holds most
of its keys (Algorithm 1) and plans which rows move: a worker *pulls* a key it
trains on whose latest version its cache lacks, from the peer holding it or
from the PS; a peer's dirty row is *pushed* once when another worker needs it,
and a dirty row evicted from its last holder is pushed. The native scheduler
(``include/hps/herald.h``) keeps a snapshot of every cache; the header states
the rules (shares of n // W with the first n % W workers taking one more,
ties to the lowest worker, LRU by the batch that last trained a key).

Lookahead: ``schedule(keys, upcoming=...)`` takes the keys of the next batches;
when a cache must evict, the keys of that window it holds go last::

    >>> h = Herald(workers=1, capacity=2)
    >>> _ = h.schedule(np.array([[5, 6]], dtype=np.uint64))
    >>> h.schedule(np.array([[7]], dtype=np.uint64), upcoming=np.array([5], dtype=np.uint64)).evicted.tolist()
    [6]

Example::

    >>> import numpy as np
    >>> from hps.herald import Herald
    >>> h = Herald(workers=2)
    >>> first = h.schedule(np.array([[1, 2], [10, 11]], dtype=np.uint64))
    >>> first.assignment.tolist(), first.pulls
    ([0, 1], 4)
    >>> second = h.schedule(np.array([[10, 11], [1, 2]], dtype=np.uint64))
    >>> second.assignment.tolist(), second.pulls   # each example goes where its keys are
    ([1, 0], 0)

Caveats: the scheduler models the caches; it moves no rows (the pipeline's
worker caches will follow its plans). Up to 64 workers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hps import _core

__all__ = ["Herald", "HeraldPlan"]


@dataclass(frozen=True)
class HeraldPlan:
    """One batch's plan.

    assignment (n_examples,) int32: the worker of each example.
    fetch_offsets (W + 1,), fetch_keys, fetch_from (int32, a worker or -1 for
    the PS): worker w fetches ``fetch_keys[fetch_offsets[w]:fetch_offsets[w + 1]]``.
    comm_offsets (W + 1,), comm_keys: comm_plan(w), the distinct keys peers
    fetch from w. evicted: keys some cache dropped after the batch (ascending).
    lost_keys, lost_from (int32): of them, those no cache holds any more, each with the
    worker whose eviction dropped the last copy (where an on-demand push reads it).
    Counts: pulls (all fetches), peer_pulls (of them, from a peer), pushes
    (rows sent to the PS, evict_pushes of them for evictions), shared (gradient
    rows exchanged for keys several workers train), distinct (keys in the batch),
    examples_moved (examples given an origin that go to another worker).
    """

    assignment: np.ndarray
    fetch_offsets: np.ndarray
    fetch_keys: np.ndarray
    fetch_from: np.ndarray
    comm_offsets: np.ndarray
    comm_keys: np.ndarray
    evicted: np.ndarray
    lost_keys: np.ndarray
    lost_from: np.ndarray
    pulls: int
    peer_pulls: int
    pushes: int
    evict_pushes: int
    shared: int
    distinct: int
    examples_moved: int

    def fetch(self, worker: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, sources) worker ``worker`` fetches this batch."""
        a, b = self.fetch_offsets[worker], self.fetch_offsets[worker + 1]
        return self.fetch_keys[a:b], self.fetch_from[a:b]

    def comm_plan(self, worker: int) -> np.ndarray:
        """The keys other workers fetch from ``worker``'s cache this batch."""
        return self.comm_keys[self.comm_offsets[worker]:self.comm_offsets[worker + 1]]


class Herald:
    """The scheduler over ``workers`` caches of ``capacity`` keys each (0: unbounded).

    ``location_aware=False`` gives the sequential split (example i to worker
    i // share) and ``on_demand=False`` write-through synchronisation (every
    trained row pushed at the batch's end): the baselines of the paper's Table 1.
    Deterministic: the same batches give the same plans on every rank.

    ``example_cost``: where examples were read on different workers (the ranks
    of an MPI job, ``schedule(..., origin=)``), what moving one costs in pulled
    rows (an example's bytes over a row's): the location-aware partition gives
    an example's origin worker that many keys of score, so an example moves
    only where that many more of its keys are cached elsewhere (or its origin
    is full). 0 (the default, the paper's partition): examples move for free.
    In steps of 1/256, up to 65,536.
    """

    def __init__(self, workers: int, capacity: int = 0, *, location_aware: bool = True,
                 on_demand: bool = True, example_cost: float = 0.0):
        if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or not 1 <= workers <= 64:
            raise ValueError(f"workers must be an int in [1, 64], got {workers!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0 (0: unbounded), got {capacity!r}")
        if isinstance(example_cost, bool) or not isinstance(example_cost, (int, float, np.integer, np.floating)) \
                or not 0 <= example_cost <= 65536:
            raise ValueError(f"example_cost must be a number of keys in [0, 65536], got {example_cost!r}")
        self.workers = int(workers)
        self.capacity = int(capacity)
        self.example_cost = float(example_cost)
        self._native = _core.Herald(int(workers), int(capacity), bool(location_aware), bool(on_demand),
                                    float(example_cost))

    def schedule(self, keys, offsets=None, upcoming=None, origin=None) -> HeraldPlan:
        """Plans a batch and updates the snapshot.

        ``keys``: (n_examples, fields) uint64/int64, one row an example; or, with
        ``offsets`` (n_examples + 1,), a flat array where example i has
        ``keys[offsets[i]:offsets[i + 1]]``. Raises ValueError for a bad shape or
        offsets (naming the index) and for the reserved key 2**64 - 1.

        ``upcoming``: the lookahead window, typically the keys of the next K
        batches; a uint64/int64 array of any shape (its keys in any order,
        repeats allowed). When a cache must evict after this batch, the window's
        keys it holds go last: it drops its keys of older batches first, then
        this batch's keys outside the window, then window keys, lowest key first
        within each (``include/hps/herald.h``, Lookahead). None or an empty
        array: no window. Raises TypeError for another dtype and ValueError for
        the reserved key 2**64 - 1 (naming its index).

        ``origin``: None, or (n_examples,) integers, the worker that read each
        example (-1: none), weighed by ``example_cost``; the plan counts the
        examples that move (``examples_moved``). Raises ValueError for another
        shape or a worker outside [-1, workers) (naming its index).
        """
        window = None if upcoming is None else self._check_upcoming(upcoming)
        keys = np.asarray(keys)
        if keys.dtype not in (np.uint64, np.int64):
            raise TypeError(f"keys must be uint64 or int64, got {keys.dtype}")
        if offsets is None:
            if keys.ndim != 2:
                raise ValueError(f"keys must be (n_examples, fields) without offsets, got shape {keys.shape}")
            n, fields = keys.shape
            offsets = np.arange(n + 1, dtype=np.uint64) * np.uint64(fields)
            flat = np.ascontiguousarray(keys).reshape(-1)
        else:
            offsets = np.asarray(offsets)
            if offsets.dtype not in (np.uint64, np.int64) or offsets.ndim != 1:
                raise ValueError(f"offsets must be a 1-D uint64/int64 array, got {offsets.dtype} {offsets.shape}")
            if offsets.dtype == np.int64 and len(offsets) and offsets.min() < 0:
                raise ValueError(f"offsets[{int(np.argmin(offsets))}] is negative")
            if keys.ndim != 1:
                raise ValueError(f"keys must be 1-D with offsets, got shape {keys.shape}")
            offsets = np.ascontiguousarray(offsets, dtype=np.uint64)
            flat = np.ascontiguousarray(keys)
        if origin is not None:
            origin = self._check_origin(origin, len(offsets) - 1)
        d = self._native.schedule(offsets, flat.view(np.uint64) if flat.dtype == np.int64 else flat, window, origin)
        return HeraldPlan(**d)

    def _check_origin(self, origin, n_examples: int) -> np.ndarray:
        """origin as a contiguous int32 array of n_examples workers in [-1, W)."""
        o = np.asarray(origin)
        if o.shape != (n_examples,) or not np.issubdtype(o.dtype, np.integer):
            raise ValueError(f"origin must be ({n_examples},) integers (a worker an example), "
                             f"got {o.dtype} {o.shape}")
        bad = np.flatnonzero((o < -1) | (o >= self.workers))
        if len(bad):
            raise ValueError(f"origin[{int(bad[0])}] = {int(o[bad[0]])} is outside [-1, {self.workers})")
        return np.ascontiguousarray(o, dtype=np.int32)

    @staticmethod
    def _check_upcoming(upcoming) -> np.ndarray | None:
        """The window as a flat contiguous uint64 array, or None where it is empty."""
        up = np.asarray(upcoming)
        if up.size == 0 and up.dtype not in (np.uint64, np.int64) and not isinstance(upcoming, np.ndarray):
            return None  # [] or (): no window
        if up.dtype not in (np.uint64, np.int64):
            raise TypeError(f"upcoming must be a uint64 or int64 array, got {up.dtype}")
        if up.size == 0:
            return None
        flat = np.ascontiguousarray(up).reshape(-1)
        if flat.dtype == np.int64:
            flat = flat.view(np.uint64)
        bad = np.flatnonzero(flat == np.uint64(2**64 - 1))
        if len(bad):
            at = int(bad[0]) if up.ndim == 1 else tuple(int(i) for i in np.unravel_index(int(bad[0]), up.shape))
            raise ValueError(f"upcoming[{at}] is the reserved key 2**64 - 1 (-1 as int64); hash or remap it")
        return flat

    def cached(self, worker: int) -> np.ndarray:
        """The keys whose latest version ``worker``'s cache holds, ascending."""
        self._check_worker(worker)
        return self._native.cached(int(worker))

    def cached_by_worker(self) -> list:
        """Every worker's cached keys (a list of W arrays), each least recently
        trained first: one pass over the snapshot, where ``cached`` makes one a
        worker (and sorts)."""
        keys, offsets = self._native.cached_by_worker()
        return [keys[offsets[w]:offsets[w + 1]] for w in range(self.workers)]

    def cached_count(self, worker: int) -> int:
        self._check_worker(worker)
        return self._native.cached_count(int(worker))

    @property
    def batches(self) -> int:
        """Batches scheduled so far."""
        return self._native.batches

    @property
    def memory_bytes(self) -> int:
        """Bytes the snapshot holds: a 9-byte log record per key (key and holders,
        with 1.25 to 1.4 x room for dead and spare records), an index of 4-byte slots
        at load 0.55 to 0.8, and for more than 8 workers the masks of keys two or
        more hold; about 19 bytes a cached key for 8 workers, 17 to 18 for 64
        (``include/hps/herald.h``, Memory)."""
        return self._native.memory_bytes

    def clear(self) -> None:
        """Forgets every cached copy (the PS holds all; nothing is pushed)."""
        self._native.clear()

    def _check_worker(self, worker) -> None:
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} is outside [0, {self.workers})")
