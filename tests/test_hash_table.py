"""The hash table against a dict model, its duplicate rules, and its errors."""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import hps

# Calls of at least 2 * 4096 keys run on two or more threads (src/util/parallel.h).
MULTI_THREAD_BATCH = 10_000


def u64(values):
    return np.asarray(values, dtype=np.uint64)


def rows_of(keys, width, salt=0.0):
    """Rows that encode their key, so a row in the wrong slot shows."""
    keys = np.asarray(keys, dtype=np.float64)
    return (keys[:, None] % 1000 + np.arange(width) * 0.5 + salt).astype(np.float32)


# ---------------------------------------------------------------- basics

def test_insert_find_roundtrip():
    t = hps.HashTable(1024, 4)
    keys = u64([5, 9, 1 << 63, 0])
    assert t.insert(keys, rows_of(keys, 4)).all()
    assert len(t) == 4 and t.size == 4
    rows, found = t.find(u64([9, 0, 77, 1 << 63]))
    assert found.tolist() == [True, True, False, True]
    np.testing.assert_array_equal(rows[[0, 1, 3]], rows_of(u64([9, 0, 1 << 63]), 4))
    np.testing.assert_array_equal(rows[2], np.zeros(4, np.float32))


def test_insert_keeps_existing_row_and_first_duplicate():
    t = hps.HashTable(64, 2, threads=1)
    t.insert(u64([3]), np.array([[1, 1]], np.float32))
    inserted = t.insert(u64([3, 4, 4]), np.array([[9, 9], [2, 2], [7, 7]], np.float32))
    assert inserted.tolist() == [False, True, False]
    rows, _ = t.find(u64([3, 4]))
    assert rows.tolist() == [[1, 1], [2, 2]]


def test_accumulate_sums_duplicates_and_starts_absent_keys_at_zero():
    t = hps.HashTable(64, 3)
    t.insert(u64([1]), np.full((1, 3), 10, np.float32))
    t.accumulate(u64([1, 2, 2, 1, 2]), np.ones((5, 3), np.float32))
    rows, found = t.find(u64([1, 2]))
    assert found.all()
    assert rows.tolist() == [[12] * 3, [3] * 3]
    assert len(t) == 2


def test_assign_overwrites_present_keys_only():
    t = hps.HashTable(64, 1)
    t.insert(u64([1, 2]), np.array([[1], [2]], np.float32))
    found = t.assign(u64([2, 3]), np.array([[20], [30]], np.float32))
    assert found.tolist() == [True, False]
    rows, found = t.find(u64([1, 2, 3]))
    assert rows[:, 0].tolist() == [1, 20, 0] and found.tolist() == [True, True, False]
    assert len(t) == 2


def test_export_and_clear():
    t = hps.HashTable(5000, 2)
    keys = np.random.default_rng(0).choice(1 << 40, 3000, replace=False).astype(np.uint64)
    t.insert(keys, rows_of(keys, 2))
    out_keys, out_rows = t.export()
    order = np.argsort(out_keys)
    np.testing.assert_array_equal(out_keys[order], np.sort(keys))
    np.testing.assert_array_equal(out_rows[order], rows_of(np.sort(keys), 2))
    t.clear()
    assert len(t) == 0
    assert t.export()[0].size == 0
    assert not t.find(keys)[1].any()
    # Cleared rows are zero again: accumulate starts from zero.
    t.accumulate(keys[:1], np.ones((1, 2), np.float32))
    assert t.find(keys[:1])[0].tolist() == [[1, 1]]


def test_int64_keys_are_reinterpreted():
    t = hps.HashTable(64, 1)
    t.insert(np.array([-2, 7], np.int64), np.array([[1], [2]], np.float32))
    _, found = t.find(u64([(1 << 64) - 2, 7]))
    assert found.all()


def test_empty_calls():
    t = hps.HashTable(8, 2)
    empty = u64([])
    assert t.insert(empty, np.zeros((0, 2), np.float32)).shape == (0,)
    rows, found = t.find(empty)
    assert rows.shape == (0, 2) and found.shape == (0,)
    t.accumulate(empty, np.zeros((0, 2), np.float32))
    assert len(t) == 0


def test_repr_and_properties():
    t = hps.HashTable(96, 8, threads=2)
    assert (t.capacity, t.row_floats, t.device) == (96, 8, "cpu")
    assert "capacity=96" in repr(t)
    # Slots come in buckets of 8 (one cache line of keys).
    assert hps.HashTable(100, 1).capacity == 104 and hps.HashTable(1, 1).capacity == 8


# ---------------------------------------------------------------- full table

def test_full_table_raises_and_keeps_what_fit():
    t = hps.HashTable(8, 1)
    keys = u64(range(100, 110))
    with pytest.raises(hps.TableFullError, match=r"2 key\(s\) found no free slot \(capacity 8"):
        t.insert(keys, rows_of(keys, 1))
    assert len(t) == 8
    stored, rows = t.export()
    assert set(stored.tolist()) < set(keys.tolist())
    np.testing.assert_array_equal(rows, rows_of(stored, 1))
    # Present keys are still found and updated in a full table.
    t.accumulate(stored[:2], np.ones((2, 1), np.float32))
    rows, found = t.find(stored[:2])
    assert found.all() and len(t) == 8
    np.testing.assert_array_equal(rows, rows_of(stored[:2], 1) + 1)
    assert isinstance(hps.TableFullError("x"), hps.HpsError)


@pytest.mark.parametrize("op, said, kept", [
    ("accumulate", r"4 key\(s\) found no free slot", 8),
    ("lookup_or_init", r"4 key\(s\) found no free slot", 8),
    # A step is all or nothing: the keys that found a slot are not kept either.
    ("apply_gradients", r"the step needs a slot for each of 12 keys the table lacks, and 8 are free \(capacity 8, "
                        r"size 0\); no row was stepped", 0),
])
def test_full_table_raises_for_every_claiming_op(op, said, kept):
    emb = hps.EmbeddingTable(8, 2, optimizer=hps.SGD())
    keys = u64(range(12))
    with pytest.raises(hps.TableFullError, match=said):
        if op == "accumulate":
            emb.table.accumulate(keys, np.ones((12, emb.table.row_floats), np.float32))
        elif op == "lookup_or_init":
            emb.pull(keys)
        else:
            emb.push(keys, np.ones((12, 2), np.float32))
    assert len(emb) == kept


# ---------------------------------------------------------------- bad input

EMPTY = hps.EMPTY_KEY


@pytest.mark.parametrize("op", ["insert", "find", "accumulate", "assign"])
def test_sentinel_key_rejected_before_any_change(op):
    t = hps.HashTable(64, 2)
    keys = u64([1, 2, EMPTY])
    rows = np.ones((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"keys\[2\] is 0xffffffffffffffff"):
        if op == "find":
            t.find(keys)
        else:
            getattr(t, op)(keys, rows)
    assert len(t) == 0


def test_wrong_key_dtype_shape_and_layout():
    t = hps.HashTable(64, 2)
    with pytest.raises(TypeError, match="keys must be an array of uint64 or int64, got float64"):
        t.find(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="got int32"):
        t.find(np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="keys must be 1-D, got 2 dimensions"):
        t.find(np.zeros((2, 2), np.uint64))
    with pytest.raises(ValueError, match="keys must be C-contiguous"):
        t.find(np.arange(10, dtype=np.uint64)[::2])


def test_wrong_row_dtype_shape_and_layout():
    t = hps.HashTable(64, 2)
    keys = u64([1, 2])
    with pytest.raises(TypeError, match="rows must be an array of float32, got float64"):
        t.insert(keys, np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"rows must have shape \(2, 2\), got \(2, 3\)"):
        t.insert(keys, np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"deltas must have shape \(2, 2\), got \(4,\)"):
        t.accumulate(keys, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="rows must be C-contiguous"):
        t.assign(keys, np.ones((2, 4), np.float32)[:, ::2])
    assert len(t) == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"capacity": 0, "row_floats": 4}, "capacity must be > 0"),
    ({"capacity": 8, "row_floats": 0}, "row_floats must be > 0"),
    ({"capacity": 8, "row_floats": 4, "threads": -1}, "threads must be >= 0"),
    ({"capacity": 8, "row_floats": 4, "device": "tpu"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
])
def test_bad_table_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hps.HashTable(**kwargs)


def test_negative_capacity_is_a_type_error():
    with pytest.raises(TypeError):
        hps.HashTable(-5, 4)


# ---------------------------------------------------------------- model-based

class TableMachine(RuleBasedStateMachine):
    """Random operation sequences against a dict, on 1, 2 and 3 threads.

    Keys come from a small universe so batches carry many duplicates, and the
    universe can exceed the capacity so the table fills up. Row values are
    small integers, so float sums are exact whatever the order of addition.
    """

    WIDTH = 3
    CAPACITY = 6000

    def __init__(self):
        super().__init__()
        self.model = {}
        self.table = None

    @rule(threads=st.sampled_from([1, 2, 3]))
    @precondition(lambda self: self.table is None)
    def create(self, threads):
        self.table = hps.HashTable(self.CAPACITY, self.WIDTH, threads=threads)

    def batch(self, seed, size, universe):
        rng = np.random.default_rng(seed)
        keys = rng.integers(0, universe, size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        rows = rng.integers(-4, 5, (size, self.WIDTH)).astype(np.float32)
        return keys, rows

    def check_full(self, would_be):
        """After TableFullError: the table is full, lost none of the keys it had,
        and every key it holds has the row it would have had had all keys fit."""
        stored, rows = self.table.export()
        assert len(self.table) == self.CAPACITY == stored.size
        assert set(self.model) <= set(stored.tolist()) <= set(would_be)
        for k, row in zip(stored.tolist(), rows):
            np.testing.assert_array_equal(row, would_be[k])
        self.model = {k: would_be[k] for k in stored.tolist()}

    sizes = st.sampled_from([0, 1, 7, 100, MULTI_THREAD_BATCH])
    universes = st.sampled_from([50, 3000, 7000])

    @rule(seed=st.integers(0, 2**32), size=sizes, universe=universes)
    @precondition(lambda self: self.table is not None)
    def insert(self, seed, size, universe):
        keys, rows = self.batch(seed, size, universe)
        would_be = dict(self.model)
        expected = np.zeros(size, bool)
        for i, k in enumerate(keys.tolist()):  # the first duplicate wins
            if k not in would_be:
                would_be[k] = rows[i].copy()
                expected[i] = True
        try:
            inserted = self.table.insert(keys, rows)
        except hps.TableFullError:
            self.check_full(would_be)
            return
        np.testing.assert_array_equal(inserted, expected)
        self.model = would_be

    @rule(seed=st.integers(0, 2**32), size=sizes, universe=universes)
    @precondition(lambda self: self.table is not None)
    def accumulate(self, seed, size, universe):
        keys, deltas = self.batch(seed, size, universe)
        would_be = dict(self.model)
        for i, k in enumerate(keys.tolist()):
            would_be[k] = would_be.get(k, np.zeros(self.WIDTH, np.float32)) + deltas[i]
        try:
            self.table.accumulate(keys, deltas)
        except hps.TableFullError:
            assert len(would_be) > self.CAPACITY
            self.check_full(would_be)
            return
        self.model = would_be

    @rule(seed=st.integers(0, 2**32), size=sizes, universe=universes)
    @precondition(lambda self: self.table is not None)
    def assign(self, seed, size, universe):
        keys, rows = self.batch(seed, size, universe)
        found = self.table.assign(keys, rows)
        expected = np.array([k in self.model for k in keys.tolist()], bool)
        np.testing.assert_array_equal(found, expected)
        for i, k in enumerate(keys.tolist()):  # the last duplicate wins
            if k in self.model:
                self.model[k] = rows[i].copy()

    @rule(seed=st.integers(0, 2**32), size=sizes, universe=universes)
    @precondition(lambda self: self.table is not None)
    def find(self, seed, size, universe):
        keys, _ = self.batch(seed, size, universe)
        rows, found = self.table.find(keys)
        for i, k in enumerate(keys.tolist()):
            assert found[i] == (k in self.model)
            expected = self.model.get(k, np.zeros(self.WIDTH, np.float32))
            np.testing.assert_array_equal(rows[i], expected)

    @rule()
    @precondition(lambda self: self.table is not None)
    def clear(self):
        self.table.clear()
        self.model.clear()

    @invariant()
    def size_matches(self):
        if self.table is not None:
            assert len(self.table) == len(self.model)

    @rule()
    @precondition(lambda self: self.table is not None)
    def export_matches(self):
        keys, rows = self.table.export()
        assert sorted(keys.tolist()) == sorted(self.model)
        for k, row in zip(keys.tolist(), rows):
            np.testing.assert_array_equal(row, self.model[k])


TableMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_table_against_dict_model = TableMachine.TestCase


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("op", ["insert", "accumulate"])
def test_the_model_s_full_table_step_in_a_built_sequence(op, threads):
    """The machine's steps into a full table (check_full), which its random
    sequences take or not by their draws: two batches of MULTI_THREAD_BATCH keys
    of a universe of 7000, about 5300 distinct keys the first, about 6600 both,
    past the table's 6000 slots."""
    m = TableMachine()
    m.create(threads=threads)
    m.insert(seed=1, size=MULTI_THREAD_BATCH, universe=7000)
    assert len(m.model) < TableMachine.CAPACITY
    getattr(m, op)(seed=2, size=MULTI_THREAD_BATCH, universe=7000)
    assert len(m.model) == TableMachine.CAPACITY  # the table filled up: check_full compared it
    m.size_matches()
    m.export_matches()
    m.find(seed=3, size=MULTI_THREAD_BATCH, universe=7000)


def test_unique_keys_and_sum_by_inverse_round_trip():
    from hps import _core
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 50, 1000).astype(np.uint64)
    uniq, inverse = _core.unique_keys(keys)
    assert len(set(uniq.tolist())) == len(uniq) == len(set(keys.tolist()))
    np.testing.assert_array_equal(uniq[inverse], keys)
    # The table starts at half as many slots as keys and grows: all distinct, few distinct, none
    for many in (rng.permutation(20_000).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15),
                 rng.integers(0, 5, 30_000).astype(np.uint64), np.empty(0, np.uint64)):
        u, inv = _core.unique_keys(many)
        _, first = np.unique(many, return_index=True)
        np.testing.assert_array_equal(u, many[np.sort(first)])  # in order of first appearance
        np.testing.assert_array_equal(u[inv], many)
    rows = rng.standard_normal((1000, 3)).astype(np.float32)
    summed = _core.sum_by_inverse(inverse, rows, len(uniq))
    expected = np.zeros((len(uniq), 3), np.float64)
    np.add.at(expected, inverse, rows)
    np.testing.assert_allclose(summed, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(IndexError, match=r"inverse\[1\] = 7 is outside \[0, 3\)"):
        _core.sum_by_inverse(np.array([0, 7], np.int64), rows[:2], 3)
    with pytest.raises(TypeError, match="inverse must be a 1-D array of int64"):
        _core.sum_by_inverse(np.array([0, 1], np.int32), rows[:2], 3)
    with pytest.raises(ValueError, match=r"rows must have shape \(2, 3\)"):
        _core.sum_by_inverse(np.array([0, 1], np.int64), rows[:3], 3)
