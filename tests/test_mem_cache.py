"""MEM-PS: replacement policies, pinning, write-back through the sink, errors."""
import re
import threading
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hps

ROW = 8  # bytes: one uint64 value per row


def u64(values):
    return np.asarray(values, dtype=np.uint64)


def python_lru_hits(trace, capacity):
    cache, hits = OrderedDict(), []
    for k in trace:
        if k in cache:
            cache.move_to_end(k)
            hits.append(True)
            continue
        hits.append(False)
        if len(cache) == capacity:
            cache.popitem(last=False)
        cache[k] = None
    return hits


@settings(max_examples=40, deadline=None)
@given(trace=st.lists(st.integers(0, 30), min_size=1, max_size=300), capacity=st.integers(1, 12))
def test_lru_matches_a_reference(trace, capacity):
    cache = hps.MemCache(ROW, capacity, policy="lru", shards=1)
    assert cache.access(u64(trace)).tolist() == python_lru_hits(trace, capacity)


def test_lfu_keeps_the_frequent_and_breaks_ties_by_recency():
    cache = hps.MemCache(ROW, 2, policy="lfu", shards=1)
    cache.access(u64([1, 1, 1, 2, 3]))  # 3 evicts 2 (count 1, older than nothing else)
    assert 1 in cache and 3 in cache and 2 not in cache
    cache.access(u64([4]))  # 3 (count 1) goes, 1 (count 3) stays
    assert 1 in cache and 4 in cache and 3 not in cache


def test_lru_lfu_moves_lru_overflow_to_the_lfu():
    # 4 slots, LRU share 2: key 1, visited often, survives a scan that flushes an LRU.
    cache = hps.MemCache(ROW, 4, policy="lru+lfu", lru_fraction=0.5, shards=1)
    cache.access(u64([1, 1, 1, 1]))
    cache.access(u64([10, 11, 12, 13, 14, 15]))
    assert 1 in cache
    lru = hps.MemCache(ROW, 4, policy="lru", shards=1)
    lru.access(u64([1, 1, 1, 1, 10, 11, 12, 13, 14, 15]))
    assert 1 not in lru


@pytest.mark.parametrize("policy", ["lfu", "lru+lfu", "w-tinylfu", "tinylfu-lfu"])
def test_frequency_aware_policies_resist_scans(policy):
    """A hot set re-read between one-off keys: LRU loses it, the others keep most of it."""
    rng = np.random.default_rng(1)
    hot = np.arange(100, dtype=np.uint64)
    trace = []
    for r in range(200):
        trace.append(rng.choice(hot, 50))
        trace.append(np.arange(10**6 + r * 200, 10**6 + r * 200 + 200, dtype=np.uint64))  # scan
    trace = np.concatenate(trace)
    rates = {}
    for p in ("lru", policy):
        cache = hps.MemCache(ROW, 150, policy=p, shards=1)
        rates[p] = cache.access(trace).mean()
    assert rates[policy] > rates["lru"] + 0.05, rates


def test_every_policy_counts_hits_and_misses():
    trace = (np.random.default_rng(2).zipf(1.2, 20000) % 5000).astype(np.uint64)
    for policy in hps.MemCache.POLICIES:
        cache = hps.MemCache(ROW, 500, policy=policy)
        hits = cache.access(trace)
        s = cache.stats()
        assert s["hits"] == hits.sum() and s["misses"] == len(trace) - hits.sum()
        assert s["size"] == 500 and s["evictions"] == s["misses"] - 500


class Backing:
    """A dict standing in for SSD-PS: the loader reads it, the sink writes it."""

    def __init__(self):
        self.rows, self.loads, self.sunk = {}, 0, 0
        self.lock = threading.Lock()

    def loader(self, keys):
        with self.lock:
            self.loads += len(keys)
            rows = np.array([[self.rows.get(int(k), int(k) * 1000)] for k in keys], np.uint64)
            dirty = np.array([int(k) not in self.rows for k in keys])
        return rows, dirty

    def sink(self, keys, rows):
        with self.lock:
            self.sunk += len(keys)
            for k, r in zip(keys.tolist(), rows.view(np.uint64)[:, 0].tolist()):
                self.rows[k] = r


@pytest.mark.parametrize("policy", hps.MemCache.POLICIES)
def test_dirty_rows_are_never_lost(policy):
    """Random pinned pulls and write-backs through a cache far smaller than the keys."""
    backing = Backing()
    cache = hps.MemCache(ROW, 40, policy=policy, loader=backing.loader, sink=backing.sink)
    model = {}
    rng = np.random.default_rng(3)
    for step in range(300):
        keys = np.unique(rng.integers(0, 200, rng.integers(1, 20))).astype(np.uint64)
        rows, _ = cache.pull(keys, pin=True, dtype=np.uint64)
        expected = [model.get(int(k), int(k) * 1000) for k in keys]
        assert rows[:, 0].tolist() == expected, step
        new = (rows + 1).astype(np.uint64)
        cache.write_back(keys, new)
        for k, v in zip(keys.tolist(), new[:, 0].tolist()):
            model[k] = v
    assert cache.stats()["pinned"] == 0 and cache.stats()["dirty_evictions"] > 0
    cache.flush_dirty()
    assert cache.stats()["dirty"] == 0
    assert {k: backing.rows[k] for k in model} == model


def test_pinned_rows_stay_and_a_batch_too_big_fails_cleanly():
    backing = Backing()
    cache = hps.MemCache(ROW, 10, policy="lru", shards=1, loader=backing.loader, sink=backing.sink)
    pinned = u64(range(8))
    cache.pull(pinned, pin=True)
    cache.access(u64(range(100, 150)))  # churns only the 2 unpinned slots
    assert all(k in cache for k in range(8))
    with pytest.raises(hps.CacheFullError, match="budget too small: a shard of 10 rows has 8 pinned "
                                                 "and this call needs 3 more"):
        cache.pull(u64([0, 1, 200, 201, 202]), pin=True)
    s = cache.stats()
    assert s["pinned"] == 8  # the failed call's pins on 0 and 1 were undone
    cache.write_back(pinned, np.zeros((8, 1), np.uint64))
    assert cache.stats()["pinned"] == 0
    cache.pull(u64([200, 201, 202]), pin=True)  # fits now


def test_an_unpinned_pull_past_every_pinned_slot_stores_its_dirty_rows():
    """With every slot pinned, an unpinned pull serves its new rows uncached; a row
    the loader marked dirty (nowhere else yet) goes to the sink before the pull
    returns, so that no later pull loads another row for its key."""
    backing = Backing()
    backing.rows[4] = 44  # stored: loaded clean, not stored again
    cache = hps.MemCache(ROW, 2, policy="lru", shards=1, loader=backing.loader, sink=backing.sink)
    cache.pull(u64([1, 2]), pin=True)
    rows, hit = cache.pull(u64([3, 4]), dtype=np.uint64)
    assert rows[:, 0].tolist() == [3000, 44] and hit.tolist() == [False, False]
    assert 3 not in cache and 4 not in cache
    assert backing.rows[3] == 3000 and backing.sunk == 1
    cache.unpin(u64([1, 2]))
    cache.flush_dirty()
    assert sorted(backing.rows) == [1, 2, 3, 4]


def test_pin_without_copy_pins_hits_and_misses_alike():
    backing = Backing()
    cache = hps.MemCache(ROW, 10, policy="lru", shards=1, loader=backing.loader, sink=backing.sink)
    cache.pull(u64([1, 2]))  # cached, not pinned
    hit = cache.pin(u64([2, 3, 3, 4]))
    assert hit.tolist() == [True, False, False, False]
    assert cache.stats()["pinned"] == 3
    assert cache.read_pinned(u64([3, 4])).view(np.uint64)[:, 0].tolist() == [3000, 4000]
    # Key 3 was asked for twice: two pins, released by two unpins.
    cache.unpin(u64([2, 3, 4]))
    assert cache.stats()["pinned"] == 1
    cache.unpin(u64([3]))
    assert cache.stats()["pinned"] == 0
    cache.pin(u64(range(100, 110)))
    with pytest.raises(hps.CacheFullError, match="has 10 pinned and this call needs 1 more"):
        cache.pin(u64([500]))


def test_write_back_of_an_unpinned_key_is_refused():
    cache = hps.MemCache(ROW, 10, loader=Backing().loader, sink=Backing().sink)
    cache.pull(u64([1, 2]), pin=True)
    with pytest.raises(ValueError, match=r"MEM-PS write back: keys\[1\] = 7 is not pinned"):
        cache.write_back(u64([1, 7]), np.zeros((2, 1), np.uint64))
    assert cache.stats()["pinned"] == 2  # nothing changed
    with pytest.raises(ValueError, match=r"keys\[0\] is 0xffffffffffffffff"):
        cache.pull(u64([hps.EMPTY_KEY]))


def test_write_back_that_finds_a_key_unpinned_part_way_keeps_its_row_and_says_so():
    """A key named twice but pinned once passes the check that every key is pinned
    and is found unpinned at its second occurrence, as one that another thread
    unpinned during the call would be: its row (the last one given) is kept, the
    other keys are released, and RuntimeError names it."""
    backing = Backing()
    cache = hps.MemCache(ROW, 10, loader=backing.loader, sink=backing.sink)
    cache.pull(u64([1, 2]), pin=True)
    with pytest.raises(RuntimeError, match=r"MEM-PS write back: 1 of 3 keys were no longer pinned "
                                           r"when it came to release them \(keys\[2\] = 1\)"):
        cache.write_back(u64([1, 2, 1]), np.array([[10], [20], [11]], np.uint64))
    assert cache.stats()["pinned"] == 0
    rows, _ = cache.pull(u64([1, 2]), dtype=np.uint64)
    assert rows[:, 0].tolist() == [11, 20]
    cache.flush_dirty()
    assert backing.rows[1] == 11


def test_keep_updated_takes_rows_without_a_slot_or_a_load():
    """keep_updated (rows newer than MEM-PS's, kept elsewhere: Herald's caches): a
    key cached, pinned or not, gets its row, dirty (flushed later); one not cached
    gives its row to the sink, not loaded first, and a pull reads it from there.
    A cache whose slots are pinned takes them all the same, where a pin would
    need a free slot for each key not cached."""
    backing = Backing()
    cache = hps.MemCache(ROW, 4, policy="lru", shards=1, loader=backing.loader, sink=backing.sink)
    cache.pull(u64([1, 2, 3]), pin=True)  # a batch in flight
    cache.pull(u64([4]))  # cached, not pinned
    cache.flush_dirty()  # the new keys' first rows stored: clean in MEM-PS
    with pytest.raises(hps.CacheFullError, match="has 3 pinned and this call needs 2 more"):
        cache.pin(u64([7, 8]))
    loads, sunk = backing.loads, backing.sunk
    cache.keep_updated(u64([1, 4, 7, 8]), np.array([[11], [14], [17], [18]], np.uint64))
    assert backing.loads == loads and backing.sunk == sunk + 2  # only 7 and 8 went to the sink, unread
    assert (backing.rows[7], backing.rows[8]) == (17, 18) and 7 not in cache and 8 not in cache
    s = cache.stats()
    assert (s["dirty"], s["pinned"], s["size"]) == (2, 3, 4)  # 1 and 4; the pins stay
    assert cache.read_pinned(u64([1])).view(np.uint64)[0, 0] == 11  # the pin's holder reads the new row
    assert backing.rows[1] == 1000 and backing.rows[4] == 4000  # not stored yet: dirty in MEM-PS
    cache.unpin(u64([1, 2, 3]))
    cache.flush_dirty()
    assert (backing.rows[1], backing.rows[4]) == (11, 14) and cache.stats()["dirty"] == 0
    rows, hit = cache.pull(u64([7, 8]), dtype=np.uint64)
    assert rows[:, 0].tolist() == [17, 18] and hit.tolist() == [False, False]


def test_keep_updated_errors():
    """The reserved key and rows of the wrong shape are refused, changing nothing;
    a sink that raises keeps nothing of the rows it was given (their caller still
    holds them), while the cached keys have theirs, dirty."""
    backing = Backing()
    cache = hps.MemCache(ROW, 4, policy="lru", shards=1, loader=backing.loader, sink=backing.sink)
    cache.pull(u64([1]))
    cache.flush_dirty()
    with pytest.raises(ValueError, match=r"keys\[1\] is 0xffffffffffffffff"):
        cache.keep_updated(u64([1, hps.EMPTY_KEY]), np.zeros((2, 1), np.uint64))
    with pytest.raises(ValueError, match="rows must be a 2-D array of 2 rows of 8 bytes each"):
        cache.keep_updated(u64([1, 2]), np.zeros((1, 1), np.uint64))
    assert cache.stats()["dirty"] == 0

    def refusing_sink(keys, rows):
        raise OSError("SSD-PS full")

    cache = hps.MemCache(ROW, 4, policy="lru", shards=1, loader=backing.loader, sink=refusing_sink)
    cache.pull(u64([1]))
    with pytest.raises(OSError, match="SSD-PS full"):
        cache.keep_updated(u64([1, 9]), np.array([[11], [19]], np.uint64))
    assert 9 not in cache and cache.stats()["dirty"] == 1
    assert cache.pull(u64([1]), dtype=np.uint64)[0][0, 0] == 11


# A child process's code leaving `tb` at the frame of a MemCache whose constructor
# raised, its half-built self among the frame's locals (as pytest shows them).
REFUSED_CACHE = """
try:
    hps.MemCache(8, 2, policy="bogus")
except ValueError as e:
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
"""


def test_a_cache_whose_constructor_raised_has_a_repr():
    """pytest shows the locals of a failed test's frames, a refused MemCache's self
    among them (hps.Lookup with a cache_policy it does not know): its repr read the
    stats of a native object never built, and the test run died of a segfault.
    A child process, so that a segfault fails this test rather than the run."""
    import subprocess
    import sys
    code = "import hps\n" + REFUSED_CACHE + 'print(repr(tb.tb_frame.f_locals["self"]))\n'
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "MemCache(not built: its constructor raised)"
    assert repr(hps.MemCache(ROW, 2)) == "MemCache(row_bytes=8, size=0, capacity=2)"


UNBUILT = "was never built \\(its constructor raised, or only __new__ made it\\): make a new one"


def test_every_method_of_a_cache_whose_constructor_raised_raises():
    """A refused MemCache's self outlives its __init__ in the traceback's frame: every
    method and property read a native object never built (pybind11 handed them
    uninitialized memory), and the process died of a segfault. Each raises
    ValueError now. A child process, so that a segfault fails this test only."""
    import subprocess
    import sys
    code = "import numpy as np, hps\n" + REFUSED_CACHE + 'cache = tb.tb_frame.f_locals["self"]\n' + """
keys = np.array([1, 2], np.uint64)
for call in [lambda: cache.stats(), lambda: cache.row_bytes, lambda: cache.pull(keys), lambda: cache.pin(keys),
             lambda: cache.pin_rows(keys), lambda: cache.write_back(keys, np.zeros((2, 8), np.uint8)),
             lambda: cache.keep_updated(keys, np.zeros((2, 8), np.uint8)),
             lambda: cache.unpin(keys), lambda: cache.access(keys), lambda: cache.erase(keys),
             lambda: cache.flush_dirty(), lambda: cache.read_pinned(keys), lambda: cache.set_lookahead(keys),
             lambda: cache.clear_lookahead(), lambda: 1 in cache, lambda: cache.replay(keys, 1)]:
    try:
        call()
        print("no error")
    except ValueError as e:
        print(e, flush=True)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 16 and all(re.fullmatch(f"this hps.mem_cache.MemCache {UNBUILT}", x) for x in lines), lines


def test_the_reserved_key_is_never_cached_nor_erased():
    """The index marks empty buckets with the reserved key: `in` said True for it,
    and erase dropped whatever slot an empty bucket's stale value named."""
    cache = hps.MemCache(ROW, 64, loader=Backing().loader, sink=Backing().sink)
    cache.pull(u64(range(1, 40)))
    assert hps.EMPTY_KEY not in cache and 5 in cache
    before = cache.stats()
    with pytest.raises(ValueError, match=r"keys\[1\] is 0xffffffffffffffff"):
        cache.erase(u64([4, hps.EMPTY_KEY]))
    assert cache.stats()["size"] == before["size"] == 39 and 4 in cache  # nothing changed


def test_budgets_and_options():
    assert hps.parse_bytes("8GiB") == 8 << 30 and hps.parse_bytes("1.5 MB") == 1_500_000
    assert hps.parse_bytes(4096) == 4096
    with pytest.raises(ValueError, match="cannot read '8 parsecs' as a size"):
        hps.parse_bytes("8 parsecs", "budget")
    cache = hps.MemCache(64, budget="1MiB")
    assert cache.stats()["capacity"] == (1 << 20) // (64 + 112)
    with pytest.raises(ValueError, match="budget '10' holds no row of 64 bytes"):
        hps.MemCache(64, budget="10")
    with pytest.raises(ValueError, match="give exactly one of capacity"):
        hps.MemCache(64)
    with pytest.raises(ValueError, match="unknown cache policy 'arc'; choose one of lru, lfu, lru\\+lfu, w-tinylfu, tinylfu-lfu"):
        hps.MemCache(64, 10, policy="arc")


def test_pulls_from_several_threads():
    backing = Backing()
    cache = hps.MemCache(ROW, 300, policy="w-tinylfu", shards=4, loader=backing.loader, sink=backing.sink)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(200):
            keys = np.unique(rng.integers(0, 1000, 50)).astype(np.uint64)
            rows, _ = cache.pull(keys, pin=True, dtype=np.uint64)
            if (rows[:, 0] % 1000 != 0).any() or (rows[:, 0] // 1000 != keys).any():
                errors.append(keys)
            cache.unpin(keys)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = cache.stats()
    assert s["pinned"] == 0 and s["hits"] + s["misses"] > 0


_STATS_DURING_A_LOAD = """
import threading, time
import numpy as np
import hps
loading = threading.Event()

def loader(keys):  # sleeps inside the pull, the GIL released, as a slow SSD-PS read would
    loading.set()
    time.sleep(0.3)
    return np.asarray(keys, np.uint64).reshape(-1, 1) * 3, np.zeros(len(keys), bool)

cache = hps.MemCache(8, 100, shards=1, loader=loader)
puller = threading.Thread(target=lambda: cache.pull(np.arange(10, dtype=np.uint64), pin=False))
puller.start()
loading.wait()
during = cache.stats()["hits"] + cache.stats()["misses"], 5 in cache  # must return at all
puller.join()
print(cache.stats()["size"], 5 in cache)
"""


def test_stats_and_contains_answer_while_another_thread_loads():
    # The pull holds the cache's locks while its Python loader runs; stats() and `in`
    # take those locks, and once held the GIL while waiting for them: a deadlock.
    # A subprocess, so that a regression fails by timeout instead of hanging the suite.
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _STATS_DURING_A_LOAD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["10", "True"]


# ---- lookahead eviction (set_lookahead, replay)

def _belady_hits(trace, capacity):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import cache_baselines
    return cache_baselines.belady_hits(trace, capacity)


def test_a_key_in_the_window_survives_the_eviction_it_would_have_lost():
    # The control: without a window, LRU's victim for key 4 is key 1.
    no_window = hps.MemCache(ROW, 3, policy="lru", shards=1)
    no_window.access(u64([1, 2, 3, 4]))
    assert 1 not in no_window and 2 in no_window
    cache = hps.MemCache(ROW, 3, policy="lru", shards=1)
    cache.access(u64([1, 2, 3]))
    cache.set_lookahead([u64([5, 1]), u64([1])])  # two batches: 1 is needed soon
    assert cache.stats()["lookahead_keys"] == 2
    cache.access(u64([4]))
    assert 1 in cache and 2 not in cache  # with 1 in the window, the next victim went instead
    s = cache.stats()
    assert s["lookahead_spared"] == 1 and s["lookahead_forced"] == 0


def test_every_row_in_the_window_evicts_the_one_needed_latest():
    cache = hps.MemCache(ROW, 3, policy="tinylfu-lfu", shards=1)
    cache.access(u64([1, 2, 3]))
    cache.set_lookahead(u64([3, 1, 3, 2]))
    cache.access(u64([4]))
    assert 2 not in cache and {1, 3, 4} <= {k for k in range(5) if k in cache}
    assert cache.stats()["lookahead_forced"] == 1


def test_clear_lookahead_is_eviction_without_it():
    trace = (np.random.default_rng(5).zipf(1.1, 30000) % 4000).astype(np.uint64)
    for policy in hps.MemCache.POLICIES:
        plain = hps.MemCache(ROW, 200, policy=policy, shards=2)
        cleared = hps.MemCache(ROW, 200, policy=policy, shards=2)
        for start in range(0, len(trace), 1000):
            batch = trace[start:start + 1000]
            cleared.set_lookahead(batch)
            cleared.clear_lookahead()
            assert (cleared.access(batch) == plain.access(batch)).all(), (policy, start)
        assert cleared.stats()["lookahead_keys"] == 0
        assert cleared.stats()["lookahead_spared"] == 0


@settings(max_examples=80, deadline=None)
@given(trace=st.lists(st.integers(0, 40), min_size=1, max_size=300), capacity=st.integers(2, 24),
       windows=st.lists(st.lists(st.integers(0, 40), max_size=40), min_size=1, max_size=6),
       every=st.integers(1, 60), policy=st.sampled_from(hps.MemCache.POLICIES))
def test_pulls_whose_walks_skip_passed_runs_evict_as_accesses_that_walk_every_row(trace, capacity, windows,
                                                                                 every, policy):
    """A pull's lookahead walk skips the runs of the policy's order that an earlier
    walk under the same window passed over whole; an access's walks skip nothing
    (its own keys change as it goes: one key a call, none is left to come). Key by
    key, under the same windows (set anew every `every` keys), the two caches hit
    and hold the same keys."""
    backing = Backing()
    pulled = hps.MemCache(ROW, capacity, policy=policy, shards=1, loader=backing.loader, sink=backing.sink)
    accessed = hps.MemCache(ROW, capacity, policy=policy, shards=1)
    for i, key in enumerate(trace):
        if i % every == 0:
            window = u64(windows[i // every % len(windows)])
            pulled.set_lookahead(window)
            accessed.set_lookahead(window)
        _, hit = pulled.pull(u64([key]))
        assert hit.tolist() == accessed.access(u64([key])).tolist(), i
        assert [k in pulled for k in range(41)] == [k in accessed for k in range(41)], i
    a, b = pulled.stats(), accessed.stats()
    for name in ("hits", "evictions", "lookahead_spared", "lookahead_forced"):
        assert a[name] == b[name], name
    assert b["lookahead_skipped"] == 0


@pytest.mark.parametrize("policy", hps.MemCache.POLICIES)
def test_evictions_under_one_window_look_its_rows_up_once(policy):
    """mem_cache_test's EvictionsUnderOneWindowLookUpItsRowsOnce through hps.MemCache:
    the coldest rows (a, then d) are all in the window, b's (visited twice) go, 16
    evictions in one pull; a window row is looked up at most twice, not once an
    eviction (stats()["lookahead_visited"]), the walks skipping the runs passed."""
    backing = Backing()
    cache = hps.MemCache(ROW, 64, policy=policy, shards=1, loader=backing.loader, sink=backing.sink)
    a, b, d = u64(range(1, 17)), u64(range(101, 117)), u64(range(201, 233))
    for keys in (a, b, b, d):
        cache.pull(keys)
    window = np.concatenate([a, d])
    cache.set_lookahead(window)
    cache.pull(u64(range(301, 317)))
    s = cache.stats()
    assert s["evictions"] == 16
    assert all(k in cache for k in window.tolist()) and not any(k in cache for k in b.tolist())
    assert s["lookahead_visited"] <= 2 * (len(window) + 16)
    assert (s["lookahead_skipped"] == 0) if policy == "lru" else (s["lookahead_skipped"] >= 14 * len(a))


def test_set_lookahead_errors_change_nothing():
    cache = hps.MemCache(ROW, 4)
    cache.set_lookahead(u64([1, 2]))
    with pytest.raises(ValueError, match=r"keys\[1\] is 0xffffffffffffffff"):
        cache.set_lookahead(u64([3, hps.EMPTY_KEY]))
    with pytest.raises(ValueError, match=r"keys\[0\] is 0xffffffffffffffff"):
        cache.set_lookahead([u64([]), u64([hps.EMPTY_KEY])])
    assert cache.stats()["lookahead_keys"] == 2
    with pytest.raises(TypeError, match="keys must be an array of uint64 or int64"):
        cache.set_lookahead(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="must be 1-D"):
        cache.set_lookahead(u64([[1, 2]]))
    cache.set_lookahead([])  # no batch comes: an empty window
    assert cache.stats()["lookahead_keys"] == 0


def test_replay_without_lookahead_is_access_batch_by_batch():
    trace = (np.random.default_rng(6).zipf(1.1, 20000) % 3000).astype(np.uint64)
    for policy in hps.MemCache.POLICIES:
        want = hps.MemCache(ROW, 150, policy=policy, shards=1).access(trace)
        got = hps.MemCache(ROW, 150, policy=policy, shards=1).replay(trace, 512)
        assert (got == want).all(), policy


def test_replay_with_lookahead_gains_and_stays_under_belady():
    trace = (np.random.default_rng(7).zipf(1.05, 40000) % 20000).astype(np.uint64)
    capacity = 300
    belady = _belady_hits(trace, capacity)
    hits = [int(hps.MemCache(ROW, capacity, shards=1).replay(trace, 1000, lookahead=k).sum()) for k in (0, 1, 4)]
    assert hits[0] < hits[1] <= hits[2] <= belady, (hits, belady)
    cache = hps.MemCache(ROW, capacity, shards=1)
    assert int(cache.replay(trace, [1000] * 40, lookahead=4).sum()) == hits[2]  # batch sizes, the same batches
    assert cache.stats()["lookahead_keys"] == 0  # cleared at the end


@settings(max_examples=60, deadline=None)
@given(trace=st.lists(st.integers(0, 25), min_size=1, max_size=200), capacity=st.integers(1, 8),
       batch=st.integers(1, 20), lookahead=st.integers(0, 4),
       policy=st.sampled_from(hps.MemCache.POLICIES))
def test_replay_never_beats_belady(trace, capacity, batch, lookahead, policy):
    """Every lookahead replay inserts on a miss, so Belady's MIN bounds it."""
    cache = hps.MemCache(ROW, capacity, policy=policy, shards=1)
    hits = cache.replay(u64(trace), batch, lookahead=lookahead)
    assert int(hits.sum()) <= _belady_hits(u64(trace), capacity)
    assert cache.stats()["hits"] == int(hits.sum())


def _replay_setting_each_window(cache, trace, batch, lookahead):
    """replay() as before it slid its window: before batch i, set_lookahead of
    batches i+1..i+lookahead concatenated."""
    bounds = list(range(0, len(trace), batch)) + [len(trace)]
    hit = np.zeros(len(trace), bool)
    for i in range(len(bounds) - 1):
        cache.set_lookahead(trace[bounds[i + 1]:bounds[min(i + 1 + lookahead, len(bounds) - 1)]])
        hit[bounds[i]:bounds[i + 1]] = cache.access(trace[bounds[i]:bounds[i + 1]])
    cache.clear_lookahead()
    return hit


@pytest.mark.parametrize("policy", ["lru", "tinylfu-lfu"])
@pytest.mark.parametrize("shards", [1, 4])
def test_replay_slides_its_window_to_the_same_hits_as_setting_each(policy, shards):
    trace = (np.random.default_rng(8).zipf(1.05, 30000) % 6000).astype(np.uint64)
    for lookahead in (1, 3, 8):
        slid = hps.MemCache(ROW, 400, policy=policy, shards=shards)
        each = hps.MemCache(ROW, 400, policy=policy, shards=shards)
        got = slid.replay(trace, 700, lookahead=lookahead)
        want = _replay_setting_each_window(each, trace, 700, lookahead)
        assert (got == want).all(), lookahead
        a, b = slid.stats(), each.stats()
        for name in ("hits", "evictions", "lookahead_spared", "lookahead_forced"):
            assert a[name] == b[name], (lookahead, name)
        assert a["lookahead_slides"] == -(-len(trace) // 700) - 1 and b["lookahead_slides"] == 0


def test_slide_lookahead_errors_change_nothing():
    cache = hps.MemCache(ROW, 4, policy="lru")
    with pytest.raises(ValueError, match="no batch in the window to drop"):
        cache.pop_lookahead()
    with pytest.raises(ValueError, match="no batch in the window to drop"):
        cache.slide_lookahead(u64([1]))
    cache.push_lookahead(u64([1, 2]))
    with pytest.raises(ValueError, match=r"keys\[1\] is 0xffffffffffffffff"):
        cache.slide_lookahead(u64([3, hps.EMPTY_KEY]))
    with pytest.raises(ValueError, match=r"keys\[0\] is 0xffffffffffffffff"):
        cache.push_lookahead(u64([hps.EMPTY_KEY]))
    with pytest.raises(TypeError):
        cache.slide_lookahead(np.array([1.0]))
    assert cache.stats()["lookahead_keys"] == 2
    cache.pop_lookahead()
    assert cache.stats()["lookahead_keys"] == 0 and cache.stats()["lookahead_slides"] == 1


def test_replay_errors():
    cache = hps.MemCache(ROW, 4)
    trace = u64(range(10))
    with pytest.raises(ValueError, match="batch must be >= 1 keys"):
        cache.replay(trace, 0)
    with pytest.raises(ValueError, match="lookahead must be an int >= 0"):
        cache.replay(trace, 2, lookahead=-1)
    with pytest.raises(ValueError, match="sum to the trace's 10 keys"):
        cache.replay(trace, [4, 4], lookahead=1)
    with pytest.raises(ValueError, match="trace must be 1-D"):
        cache.replay(u64([[1, 2]]), 1)
    with pytest.raises(ValueError, match=r"keys\[0\] is 0xffffffffffffffff"):
        cache.replay(u64([hps.EMPTY_KEY, 1]), 1, lookahead=1)
    assert cache.stats()["lookahead_keys"] == 0  # cleared, also after a failure


def test_windows_set_while_other_threads_pull():
    backing = Backing()
    cache = hps.MemCache(ROW, 300, policy="tinylfu-lfu", shards=4, loader=backing.loader, sink=backing.sink)
    errors, done = [], threading.Event()

    def prefetch():
        rng = np.random.default_rng(9)
        while not done.is_set():
            cache.set_lookahead(rng.integers(0, 1000, 500).astype(np.uint64))

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(200):
            keys = np.unique(rng.integers(0, 1000, 50)).astype(np.uint64)
            rows, _ = cache.pull(keys, pin=True, dtype=np.uint64)
            if (rows[:, 0] // 1000 != keys).any():
                errors.append(keys)
            cache.write_back(keys, rows)

    setter = threading.Thread(target=prefetch)
    setter.start()
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    setter.join()
    assert not errors
    s = cache.stats()
    assert s["pinned"] == 0 and s["lookahead_spared"] + s["lookahead_forced"] > 0


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_without_huge_pages_the_arena_is_resident_as_far_as_rows_are_cached():
    """hps.Lookup counts a refresh's new cache by the rows it is warmed with; with
    huge pages (where THP is on), one row written makes a 2 MiB page resident, and
    a 24-shard arena of 25 MB was resident whole after 1,000 rows."""
    cache = hps.MemCache(row_bytes=256, capacity=100_000, policy="lru", huge_pages=False,
                         loader=lambda k: (np.ones((len(k), 256), np.uint8), np.zeros(len(k), bool)))
    assert cache.stats()["arena_bytes"] == 25_600_000
    before = _resident_bytes()
    rows, hit = cache.pull(np.arange(1, 1001, dtype=np.uint64))
    grown = _resident_bytes() - before
    assert rows.shape == (1000, 256) and not hit.any() and (rows == 1).all()
    assert grown < 4 << 20, f"{grown / 2**20:.1f} MiB resident for 1,000 rows of 256 B"


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_prefault_makes_the_rows_arena_resident_when_the_cache_opens(tmp_path):
    """prefault=True writes every page of the rows' arena at construction (its
    bytes are resident before any pull); without it they are not. The rows a
    ParameterServer trains are the same either way."""
    row_bytes, capacity = 128, 200_000
    arena = row_bytes * capacity
    grown = {}
    for prefault in (False, True):
        before = _resident_bytes()
        cache = hps.MemCache(row_bytes, capacity, prefault=prefault)
        grown[prefault] = _resident_bytes() - before
        del cache
    assert grown[True] >= arena and grown[False] < arena / 2, grown

    keys = np.arange(1, 301, dtype=np.uint64)
    rows = []
    for prefault in (False, True):
        ps = hps.ParameterServer(hps.ParameterServerConfig(path=str(tmp_path / f"ps{prefault}"), dim=4,
                                                           mem_budget="2MiB", prefault=prefault))
        for step in range(3):
            ps.push(keys, np.full((len(keys), 4), 0.1 * (step + 1), np.float32))
        rows.append(ps.pull(keys))
        ps.close()
    np.testing.assert_array_equal(rows[0], rows[1])
