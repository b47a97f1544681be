"""hps.distributed.FreshRows: rows never trained cross between ranks as a bit, and
arrive as the whole rows would have, through every codec (no MPI needed: the
blocks are what a rank sends and another receives)."""
from __future__ import annotations

import numpy as np
import pytest

from hps.distributed.sparse import FreshRows, RowCodec
from hps.optim import SGD, AdaGrad, Adam, Normal, RowWiseAdaGrad, Uniform, Zeros, native_optimizer

DIM = 8


def _optimizer():
    return native_optimizer(DIM, AdaGrad(lr=0.05), Uniform(0.01), seed=7)


def _blocks(opt, width):
    """Two blocks (to rank 0 and rank 1): rows of keys as their first use made
    them, but for the keys a step trained (every third), whose embeddings moved."""
    keys = [np.arange(0, 40, dtype=np.uint64), np.arange(100, 123, dtype=np.uint64)]
    rows, trained = [], []
    for k in keys:
        r = opt.initial_rows(k)[:, :width].copy()
        t = np.arange(len(k)) % 3 == 0
        r[t, 0] += 0.25
        rows.append(r)
        trained.append(t)
    return keys, rows, trained


@pytest.mark.parametrize("codec", [None, "none", "bf16", "int8"])
def test_rows_arrive_as_whole_rows_would_and_only_trained_ones_take_bytes(codec):
    opt = _optimizer()
    width = DIM if codec else opt.row_floats  # embeddings through a codec; whole rows (Herald's fetch) without
    c = RowCodec(codec, width) if codec else None
    fresh = FreshRows(opt, width, c)
    keys, rows, trained = _blocks(opt, width)
    sent = fresh.pack(keys, rows, me=0)
    got = fresh.unpack(keys, sent)
    for k, r, g in zip(keys, rows, got):
        want = r if c is None else c.roundtrip(r)  # what whole rows through the codec give
        assert g.dtype == np.float32 and g.shape == (len(k), width)
        assert np.array_equal(g.view(np.uint32), want.view(np.uint32))
    row_bytes = 4 * width if c is None else c.row_bytes
    for k, t, b in zip(keys, trained, sent):
        assert b.dtype == np.uint8 and len(b) == (len(k) + 7) // 8 + int(t.sum()) * row_bytes
    assert fresh.fresh == int((~trained[1]).sum())  # the block to rank 1; rank 0's stays here
    if codec in ("bf16", "int8"):
        assert not np.array_equal(got[1], rows[1])  # the made rows were rounded as sent ones are


def test_a_row_equal_to_its_initial_row_but_for_the_sign_of_a_zero_is_sent_whole():
    """Bits, not values: AdaGrad's accumulator starts at +0.0; a row whose state
    holds -0.0 is not the initial row, and arrives with its -0.0."""
    opt = _optimizer()
    fresh = FreshRows(opt, opt.row_floats)
    keys = [np.array([5, 6], np.uint64)]
    rows = opt.initial_rows(keys[0]).copy()
    assert rows[0, DIM] == 0.0
    rows[0, DIM] = -0.0
    sent = fresh.pack(keys, [rows], me=1)
    assert len(sent[0]) == 1 + 4 * opt.row_floats and fresh.fresh == 1
    got = fresh.unpack(keys, sent)[0]
    assert np.signbit(got[0, DIM]) and np.array_equal(got.view(np.uint32), rows.view(np.uint32))


def test_empty_blocks_and_all_fresh_blocks():
    opt = _optimizer()
    fresh = FreshRows(opt, DIM, RowCodec("none", DIM))
    keys = [np.empty(0, np.uint64), np.arange(9, dtype=np.uint64)]
    rows = [np.empty((0, DIM), np.float32), opt.initial_rows(keys[1])[:, :DIM]]
    sent = fresh.pack(keys, rows, me=0)
    assert [len(b) for b in sent] == [0, 2]  # 9 bits in 2 bytes, no rows
    got = fresh.unpack(keys, sent)
    assert got[0].shape == (0, DIM) and np.array_equal(got[1], rows[1])


def test_a_block_that_does_not_match_the_keys_asked_is_refused():
    opt = _optimizer()
    fresh = FreshRows(opt, DIM)
    keys = [np.arange(10, dtype=np.uint64)]
    rows = opt.initial_rows(keys[0])[:, :DIM].copy()
    rows[2] += 1.0
    sent = fresh.pack(keys, [rows], me=0)[0]
    with pytest.raises(RuntimeError, match="a block of 1 bytes cannot mark 10 rows"):
        fresh.unpack(keys, [sent[:1]])
    with pytest.raises(RuntimeError, match=r"a block that marks 1 of 10 rows as sent holds 31 bytes of rows, not 32"):
        fresh.unpack(keys, [sent[:-1]])
    with pytest.raises(RuntimeError, match="of 11 rows as sent"):  # asked for another key count
        fresh.unpack([np.arange(11, dtype=np.uint64)], [sent])
    # The rank whose block it is, named: blocks come from every rank at once.
    both = [keys[0], keys[0]]
    with pytest.raises(RuntimeError, match="^rank 1's rows: a block of 1 bytes cannot mark 10 rows"):
        fresh.unpack(both, [sent, sent[:1]])
    with pytest.raises(RuntimeError, match="^rank 1's rows: a block that marks 1 of 10 rows as sent holds 31 "):
        fresh.unpack(both, [sent, sent[:-1]])


@pytest.mark.parametrize("optimizer", [SGD(), AdaGrad(initial_accumulator_value=0.1), RowWiseAdaGrad(), Adam()],
                         ids=["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("initializer", [Uniform(0.05), Normal(0.2), Zeros()], ids=["uniform", "normal", "zeros"])
@pytest.mark.parametrize("dim", [1, 16, 33])
def test_initial_embeddings_are_the_initial_rows_first_dim_floats_bit_for_bit(optimizer, initializer, dim):
    keys = np.concatenate([np.array([0, 1, 2**63, 2**64 - 2], np.uint64),  # the key range's edges; -1 is reserved
                           np.random.default_rng(dim).integers(0, 2**64 - 1, 200, dtype=np.uint64)])
    for seed in (0, 7, 2**64 - 1):
        opt = native_optimizer(dim, optimizer, initializer, seed=seed)
        got = opt.initial_embeddings(keys)
        assert got.dtype == np.float32 and got.shape == (len(keys), dim) and got.flags.c_contiguous
        assert np.array_equal(got.view(np.uint32), opt.initial_rows(keys)[:, :dim].view(np.uint32)), seed
    assert opt.initial_embeddings(np.empty(0, np.uint64)).shape == (0, dim)


def test_initial_embeddings_refuse_the_reserved_key_by_its_index():
    with pytest.raises(ValueError, match=r"keys\[1\] is 0xffffffffffffffff"):
        _optimizer().initial_embeddings(np.array([3, 2**64 - 1], np.uint64))


class _EmbeddingsOnly:
    """A SparseOptimizer that refuses to make whole rows: what an embeddings-only
    FreshRows may ask of it."""

    def __init__(self, opt):
        self.opt, self.dim = opt, opt.dim

    def initial_embeddings(self, keys):
        return self.opt.initial_embeddings(keys)

    def initial_rows(self, keys):
        raise AssertionError("made whole rows, optimizer state included, for embeddings")


@pytest.mark.parametrize("codec", [None, "bf16"])
def test_embeddings_only_blocks_make_no_optimizer_state_on_either_side(codec):
    """The sequential job's pulls carry embeddings: neither the owner, marking the
    rows still initial, nor the asker, making them, builds the rows' state."""
    opt = _optimizer()
    c = RowCodec(codec, DIM) if codec else None
    fresh = FreshRows(_EmbeddingsOnly(opt), DIM, c)
    keys, rows, _ = _blocks(opt, DIM)
    got = fresh.unpack(keys, fresh.pack(keys, rows, me=0))
    for r, g in zip(rows, got):
        want = r if c is None else c.roundtrip(r)
        assert np.array_equal(g.view(np.uint32), want.view(np.uint32))
