"""The offline reference policies of the W3 benchmark (bench/cache_baselines.py)
against brute force and literal implementations.

The heap-based versions are fast but easy to get subtly wrong (lazy deletion,
tie-breaking, the "never used again" encoding), so each is compared with something
too simple to be wrong: an exhaustive search over every eviction choice for Belady,
and direct transcriptions of the definitions for LFU and LRU.
"""
import functools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import cache_baselines as cb  # noqa: E402

# Keys spread over the whole uint64 range (the top bit, and the value next to the
# all-ones sentinel), so nothing relies on small or signed keys.
KEY_POOL = np.array([0, 1, 7, 1 << 32, (1 << 63) + 5, 0x9E3779B97F4A7C15,
                     0xFFFFFFFFFFFFFFFE, 123456789, 42, 1 << 40], dtype=np.uint64)


def random_trace(rng, length, n_keys):
    return KEY_POOL[rng.integers(0, n_keys, size=length)]


def zipf_trace(rng, length, universe, a=1.05):
    p = 1.0 / np.arange(1, universe + 1) ** a
    ranks = rng.choice(universe, size=length, p=p / p.sum())
    return (ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(1 << 63)


# ---------------------------------------------------------------- literal models

def exhaustive_opt(trace, capacity, bypass=False):
    """Most hits over every sequence of eviction choices (and, with bypass, of
    declining to insert). Exponential; traces of length <= 10 only."""
    trace = [int(k) for k in trace]

    @functools.lru_cache(maxsize=None)
    def best(i, cache):
        if i == len(trace):
            return 0
        k = trace[i]
        if k in cache:
            return 1 + best(i + 1, cache)
        if len(cache) < capacity:
            return best(i + 1, cache | {k})
        options = [best(i + 1, (cache - {v}) | {k}) for v in cache]
        if bypass:
            options.append(best(i + 1, cache))
        return max(options)

    return best(0, frozenset()) if capacity > 0 else 0


def literal_belady(trace, capacity):
    """MIN by scanning forward for every cached key's next use at each eviction."""
    trace = [int(k) for k in trace]
    cache, hits = set(), 0
    for i, k in enumerate(trace):
        if k in cache:
            hits += 1
            continue
        if len(cache) == capacity:
            def next_use(v):
                for j in range(i + 1, len(trace)):
                    if trace[j] == v:
                        return j
                return len(trace)
            cache.remove(max(cache, key=next_use))
        cache.add(k)
    return hits if capacity > 0 else 0


def literal_lfu(trace, capacity):
    """Whole-history counts; victim = cached key with min (count, last access)."""
    count, last, hits = {}, {}, 0  # last: only for cached keys
    for i, k in enumerate(int(x) for x in trace):
        count[k] = count.get(k, 0) + 1
        if k in last:
            hits += 1
        elif len(last) == capacity:
            del last[min(last, key=lambda v: (count[v], last[v]))]
        last[k] = i
    return hits if capacity > 0 else 0


def literal_lru(trace, capacity):
    order, hits = [], 0  # least recent first
    for k in (int(x) for x in trace):
        if k in order:
            order.remove(k)
            hits += 1
        elif len(order) == capacity:
            order.pop(0)
        order.append(k)
    return hits if capacity > 0 else 0


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("capacity", [1, 2, 3])
@pytest.mark.parametrize("bypass", [False, True])
def test_belady_matches_exhaustive_search(capacity, bypass):
    rng = np.random.default_rng(100 + capacity)
    for _ in range(150):
        trace = random_trace(rng, int(rng.integers(1, 11)), int(rng.integers(2, 7)))
        assert cb.belady_hits(trace, capacity, bypass=bypass) == \
            exhaustive_opt(trace, capacity, bypass=bypass), trace


def test_bypass_can_beat_demand_paging():
    # C = 1: a, b, a. Demand paging must load b over a; bypass keeps a.
    trace = KEY_POOL[[0, 1, 0]]
    assert cb.belady_hits(trace, 1) == 0
    assert cb.belady_hits(trace, 1, bypass=True) == 1


@pytest.mark.parametrize("capacity", [1, 2, 5, 17])
def test_belady_matches_literal_on_longer_traces(capacity):
    # Long enough for the heap rebuild (> 2C + 64 entries) to run many times.
    rng = np.random.default_rng(capacity)
    for length, n_keys in [(400, 10), (1500, 10)]:
        trace = random_trace(rng, length, n_keys)
        assert cb.belady_hits(trace, capacity) == literal_belady(trace, capacity)
    trace = zipf_trace(rng, 1500, 200)
    assert cb.belady_hits(trace, capacity) == literal_belady(trace, capacity)


@pytest.mark.parametrize("capacity", [1, 2, 3, 5, 17])
def test_lfu_and_lru_match_literal(capacity):
    rng = np.random.default_rng(7 * capacity)
    traces = [random_trace(rng, int(rng.integers(1, 60)), int(rng.integers(2, 11)))
              for _ in range(100)]
    traces += [zipf_trace(rng, 2000, 300), random_trace(rng, 2000, 10)]
    for trace in traces:
        assert cb.ideal_lfu_hits(trace, capacity) == literal_lfu(trace, capacity), trace
        assert cb.lru_hits(trace, capacity) == literal_lru(trace, capacity), trace
        assert cb.lru_hit_mask(trace, capacity).sum() == literal_lru(trace, capacity)


def test_lfu_ties_go_to_least_recent():
    # C = 2. When c arrives, a and b both have count 1: a, the older, goes. b hits.
    # a comes back (count 2): c (count 1) goes although it is more recent than b.
    # c comes back: b and a tie at count 2, b is older and goes. One hit.
    a, b, c = KEY_POOL[:3]
    trace = np.array([a, b, c, b, a, c], dtype=np.uint64)
    assert cb.ideal_lfu_hits(trace, 2) == literal_lfu(trace, 2) == 1


def test_lfu_counts_keys_while_not_cached():
    # C = 2. a is evicted with count 2 (tie with b, older) and comes back with
    # count 3, so when b comes back the victim is c (count 3, older than a) and the
    # last a hits: 5 hits. An LFU that forgot a's count on eviction would evict a
    # (count 1) there instead and miss the last access (4 hits).
    a, b, c = KEY_POOL[:3]
    trace = np.array([a, a, b, b, c, c, c, a, b, a], dtype=np.uint64)
    assert cb.ideal_lfu_hits(trace, 2) == literal_lfu(trace, 2) == 5


@pytest.mark.parametrize("seed", range(4))
def test_belady_dominates_on_zipf(seed):
    rng = np.random.default_rng(seed)
    trace = zipf_trace(rng, 20_000, 5_000, a=1.05 + 0.1 * seed)
    unique = len(np.unique(trace))
    for capacity in (unique // 100, unique // 20, unique // 5):
        opt = cb.belady_hits(trace, capacity)
        assert opt >= cb.lru_hits(trace, capacity)
        assert opt >= cb.ideal_lfu_hits(trace, capacity)
        assert cb.belady_hits(trace, capacity, bypass=True) >= opt
        assert opt <= len(trace) - unique  # first accesses always miss


def test_capacity_edges():
    rng = np.random.default_rng(3)
    trace = zipf_trace(rng, 3000, 500)
    unique = len(np.unique(trace))
    compulsory_only = len(trace) - unique
    for f in (cb.belady_hits, cb.ideal_lfu_hits, cb.lru_hits,
              lambda t, c: int(cb.lru_hit_mask(t, c).sum())):
        assert f(trace, 0) == 0
        assert f(trace[:0], 5) == 0
        assert f(trace, unique) == compulsory_only
        assert f(trace, 10 * unique) == compulsory_only
    with pytest.raises(ValueError):
        cb.belady_hits(trace, -1)


def test_next_use():
    ids = np.array([0, 1, 0, 2, 1, 0])
    n = len(ids)
    assert cb.next_use(ids).tolist() == [2, 4, 5, n + 3, n + 4, n + 5]
