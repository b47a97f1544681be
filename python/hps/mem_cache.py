"""MEM-PS: the host-memory cache of rows between the device tier and SSD-PS."""
from __future__ import annotations

from typing import Callable, Optional, Union

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
    both loader and sink: the parameter server's, native). Pinned rows stay until
    ``write_back(keys, rows)`` (which marks them dirty) or ``unpin(keys)``.
    ``access(keys)`` replays a trace: hits are visits, misses enter with zero rows.
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
                 sink: Optional[Callable] = None):
        if (capacity is None) == (budget is None):
            raise ValueError("give exactly one of capacity (rows) and budget (bytes, e.g. '8GiB')")
        if budget is not None:
            capacity = _core.MemCache.capacity_for_budget(parse_bytes(budget, "budget"), row_bytes)
            if capacity == 0:
                raise ValueError(f"budget {budget!r} holds no row of {row_bytes} bytes")
        super().__init__(row_bytes, capacity, policy, shards, lru_fraction, loader, sink)

    def pull(self, keys: np.ndarray, pin: bool = False, dtype=np.uint8) -> tuple[np.ndarray, np.ndarray]:
        rows, hit = super().pull(keys, pin)
        return rows.view(dtype), hit

    def __repr__(self) -> str:
        s = self.stats()
        return f"MemCache(row_bytes={self.row_bytes}, size={s['size']}, capacity={s['capacity']})"
