"""Several Python threads calling one table at once (the GIL is released in
every bulk call), each call itself running on two threads."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import hps

THREADS = 4
ROUNDS = 8
N = 20_000  # per call: large enough that each call also splits across cores


def run_all(fn):
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(fn, range(THREADS)))


def test_concurrent_accumulate_on_overlapping_keys_sums_exactly():
    table = hps.HashTable(60_000, 4, threads=2)
    universe = np.arange(1, 30_001, dtype=np.uint64) * np.uint64(7919)

    def worker(w):
        rng = np.random.default_rng(w)
        for _ in range(ROUNDS):
            table.accumulate(rng.choice(universe, N), np.ones((N, 4), np.float32))

    run_all(worker)
    expected = {}
    for w in range(THREADS):
        rng = np.random.default_rng(w)
        for _ in range(ROUNDS):
            for k in rng.choice(universe, N).tolist():
                expected[k] = expected.get(k, 0) + 1
    keys, rows = table.export()
    assert len(table) == len(expected) == keys.size
    got = dict(zip(keys.tolist(), rows[:, 0].tolist()))
    assert got == expected
    assert (rows == rows[:, :1]).all()


def test_concurrent_inserts_of_the_same_keys_store_each_once():
    table = hps.HashTable(50_000, 2, threads=2)
    keys = np.random.default_rng(0).choice(2**40, 30_000, replace=False).astype(np.uint64)
    rows = np.stack([keys.astype(np.float32), -keys.astype(np.float32)], axis=1)
    inserted = [None] * THREADS

    def worker(w):
        order = np.random.default_rng(w).permutation(keys.size)
        inserted[w] = keys[order][table.insert(keys[order], rows[order])]

    run_all(worker)
    assert len(table) == keys.size
    winners = np.concatenate(inserted)
    assert np.array_equal(np.sort(winners), np.sort(keys))  # each key inserted by exactly one call
    got, found = table.find(keys)
    assert found.all() and np.array_equal(got, rows)


def test_concurrent_pushes_apply_every_gradient():
    emb = hps.EmbeddingTable(20_000, 2, optimizer=hps.SGD(lr=1.0), initializer=hps.Zeros(), threads=2)
    keys = np.arange(10_000, dtype=np.uint64)

    def worker(w):
        for _ in range(ROUNDS):
            emb.push(keys, np.ones((keys.size, 2), np.float32))

    run_all(worker)
    np.testing.assert_array_equal(emb.pull(keys), np.full((keys.size, 2), -THREADS * ROUNDS))


def test_finds_run_beside_writes_to_other_keys():
    table = hps.HashTable(100_000, 4, threads=2)
    stable = np.arange(1, 20_001, dtype=np.uint64)
    table.insert(stable, np.repeat(stable.astype(np.float32)[:, None], 4, axis=1))
    moving = np.arange(1_000_001, 1_040_001, dtype=np.uint64)

    def worker(w):
        for _ in range(ROUNDS):
            if w % 2:
                table.accumulate(moving, np.ones((moving.size, 4), np.float32))
            else:
                rows, found = table.find(stable)
                assert found.all()
                assert np.array_equal(rows[:, 0], stable.astype(np.float32))

    run_all(worker)
    rows, found = table.find(moving)
    assert found.all() and (rows == ROUNDS * (THREADS // 2)).all()
