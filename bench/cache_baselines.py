"""Offline reference cache policies for the W3 benchmark (BENCHMARKS.md).

Each function replays an access trace (a 1-D array of uint64 keys) against a cache
of C rows and returns the number of hits. The model is the one the native MEM-PS
cache is measured under:

  * cold start: the cache is empty before the first access;
  * demand paging: every miss inserts the missed key; when the cache already holds
    C keys, one of the *previously cached* keys is evicted to make room (the key
    being inserted is never its own victim) -- except in ``belady_hits(...,
    bypass=True)``, which may decline to insert;
  * the hit rate is hits / len(trace), so compulsory (first-access) misses count.

Functions:
  belady_hits     Belady's MIN, the offline optimum of that model (and, with
                  bypass=True, the optimum when a miss may skip insertion);
  ideal_lfu_hits  "perfect" LFU: access counts over the whole history, kept also for
                  keys that are not cached;
  lru_hits        plain LRU, used to cross-check the native LRU;
  lru_hit_mask    the same, access by access, to locate where a mismatch starts.

Implementation notes (why it looks the way it does):
  * keys are first renamed to dense ids 0..U-1 with np.unique, so the per-key state
    lives in Python lists indexed by id: list indexing is several times cheaper than
    dict lookups of uint64 keys or numpy scalar indexing inside a Python loop;
  * the loops are plain Python over lists (``.tolist()``), about 1-2 us per access,
    so a 2-5M access trace takes a few seconds per capacity;
  * the heaps hold plain ints, not tuples, and use lazy deletion: an entry is
    checked against the key's current state when it surfaces, and the heap is
    rebuilt from the live entries when stale ones make it more than twice the
    capacity (amortised O(1) per access, bounded memory).
"""
from __future__ import annotations

from collections import OrderedDict
from heapq import heapify, heappop, heappush

import numpy as np

__all__ = ["belady_hits", "ideal_lfu_hits", "lru_hits", "lru_hit_mask", "dense_ids", "next_use"]


def _check(trace, capacity: int) -> np.ndarray:
    trace = np.asarray(trace)
    if trace.ndim != 1:
        raise ValueError(f"trace must be 1-D, got shape {trace.shape}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    return trace


def dense_ids(trace) -> np.ndarray:
    """(n,) int64: the keys of ``trace`` renamed to 0..U-1 (U = number of unique keys)."""
    _, inverse = np.unique(np.asarray(trace), return_inverse=True)
    return inverse.reshape(-1).astype(np.int64, copy=False)


def next_use(ids: np.ndarray) -> np.ndarray:
    """(n,) int64: for each position i, the next position j > i with ids[j] == ids[i].

    A position whose key is never used again gets n + i instead of a shared
    "infinity": every value is then distinct (each position is the next use of at
    most one earlier position), which lets the Belady heap store bare ints and
    recover the key from the value. Values >= n all compare as "never again"
    relative to real positions, and among themselves in an arbitrary but fixed
    order, which does not change the hit count (evicting any never-again key is
    equally good).
    """
    n = len(ids)
    nxt = np.arange(n, 2 * n, dtype=np.int64)
    # A stable sort by id lists each key's positions in increasing order, so
    # neighbours with the same id are (position, next position of that key).
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_hits(trace, capacity: int, bypass: bool = False) -> int:
    """Hits of Belady's MIN policy on ``trace`` with ``capacity`` rows.

    Default (bypass=False): the classic demand-paging MIN. Every miss is inserted;
    with a full cache the victim is the cached key whose next use is farthest in the
    future (never again counts as farthest). This is optimal among policies that
    always insert on a miss, the model of the native cache, and it is the "Belady"
    of the W3 ratios.

    bypass=True: on a miss with a full cache, the missed key itself is also a
    candidate; if its next use is farther than every cached key's, it is not
    inserted. This is the optimum when a policy may refuse admission (as an
    admission filter such as W-TinyLFU's can), so it is >= the classic value, and a
    policy with admission can legitimately beat the classic MIN.

    O(n log C) with one heap (max-heap of next-use positions, stored negated).
    """
    trace = _check(trace, capacity)
    n = len(trace)
    if capacity == 0 or n == 0:
        return 0
    ids_np = dense_ids(trace)
    nxt = next_use(ids_np).tolist()
    ids = ids_np.tolist()
    n_keys = int(ids_np.max()) + 1
    # cur[k] = next use of key k while k is cached (the value its live heap entry
    # holds), -1 while it is not cached.
    cur = [-1] * n_keys
    heap: list[int] = []  # -next_use; the key is ids[v] (v < n) or ids[v - n]
    size = 0
    hits = 0
    limit = 2 * capacity + 64
    for i in range(n):
        k = ids[i]
        nu = nxt[i]
        if cur[k] >= 0:
            # Hit: cur[k] == i. Its old heap entry (-i) becomes stale; it is the
            # smallest next use in the heap, so it never reaches the top of the
            # max-heap before a rebuild drops it.
            hits += 1
        elif size < capacity:
            size += 1
        else:
            # Miss with a full cache: the top of the heap is the farthest next use.
            # Stale entries are all <= i and every live one is > i, so the loop
            # body runs once; the check keeps the code correct if that changes.
            while True:
                v = -heap[0]
                victim = ids[v] if v < n else ids[v - n]
                if cur[victim] == v:
                    break
                heappop(heap)
            if bypass and nu > v:
                continue  # the missed key is the farthest: do not insert it
            heappop(heap)
            cur[victim] = -1
        cur[k] = nu
        heappush(heap, -nu)
        if len(heap) > limit:
            # Drop the stale entries (hits leave one each; none is ever popped).
            live = []
            for e in heap:
                v = -e
                if cur[ids[v] if v < n else ids[v - n]] == v:
                    live.append(e)
            heap = live
            heapify(heap)
    return hits


def ideal_lfu_hits(trace, capacity: int) -> int:
    """Hits of an ideal ("perfect", whole-history) LFU on ``trace`` with ``capacity`` rows.

    Every access increments the key's count, whether or not the key is cached, and
    counts are never forgotten or aged. Every miss is inserted; with a full cache the
    victim is the cached key (other than the one being inserted) with the lowest
    count, ties broken by least recent access.

    Heap entries are the int count * n + t, where t is the position of the key's
    last access: the min-heap order is then (count, recency), and t identifies the
    key (ids[t]). An entry is live iff last[ids[t]] == t.
    """
    trace = _check(trace, capacity)
    n = len(trace)
    if capacity == 0 or n == 0:
        return 0
    ids_np = dense_ids(trace)
    ids = ids_np.tolist()
    n_keys = int(ids_np.max()) + 1
    count = [0] * n_keys
    last = [-1] * n_keys  # position of the last access while cached, -1 if not cached
    heap: list[int] = []
    size = 0
    hits = 0
    limit = 2 * capacity + 64
    for i in range(n):
        k = ids[i]
        c = count[k] + 1
        count[k] = c
        if last[k] >= 0:
            hits += 1  # the old entry becomes stale (last[k] changes below)
        elif size < capacity:
            size += 1
        else:
            # Pop until a live entry surfaces: stale entries carry an older
            # (count, t) of a key that was hit since, so they do reach the top.
            while True:
                t = heappop(heap) % n
                victim = ids[t]
                if last[victim] == t:
                    last[victim] = -1
                    break
        last[k] = i
        heappush(heap, c * n + i)
        if len(heap) > limit:
            heap = [e for e in heap if last[ids[e % n]] == e % n]
            heapify(heap)
    return hits


def lru_hits(trace, capacity: int) -> int:
    """Hits of LRU on ``trace`` with ``capacity`` rows (OrderedDict, oldest first)."""
    trace = _check(trace, capacity)
    if capacity == 0 or len(trace) == 0:
        return 0
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in dense_ids(trace).tolist():
        if k in cache:
            cache.move_to_end(k)
            hits += 1
        else:
            cache[k] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def lru_hit_mask(trace, capacity: int) -> np.ndarray:
    """(n,) bool: which accesses of ``trace`` hit an LRU of ``capacity`` rows.

    Slower than lru_hits (it records every access); used only to find the first
    access where another LRU disagrees.
    """
    trace = _check(trace, capacity)
    mask = np.zeros(len(trace), dtype=bool)
    if capacity == 0:
        return mask
    cache: OrderedDict[int, None] = OrderedDict()
    for i, k in enumerate(dense_ids(trace).tolist()):
        if k in cache:
            cache.move_to_end(k)
            mask[i] = True
        else:
            cache[k] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return mask
