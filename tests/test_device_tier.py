"""The device tier's and the host batch's bindings: the widths Python passes are
checked against the tier's own, and a host batch's failed release is raised,
counted by MEM-PS, and written to stderr when only its destructor saw it."""
import numpy as np
import pytest

import hps
from hps import _core
from hps.optim import native_optimizer

DIM = 4


def make_tier():
    opt = native_optimizer(DIM, hps.AdaGrad(lr=0.1), hps.Uniform(0.5), seed=3)  # state beside the embedding
    return _core.DeviceTier(1, 64, opt, use_cuda=False), opt


def test_the_tier_gives_its_widths():
    tier, opt = make_tier()
    assert tier.dim == DIM
    assert tier.row_floats == opt.row_floats > DIM


def test_a_width_that_is_not_the_tiers_is_refused_before_any_row_moves():
    tier, opt = make_tier()
    rf = opt.row_floats
    keys = np.arange(1, 9, dtype=np.uint64)
    rows = np.arange(len(keys) * rf, dtype=np.float32).reshape(len(keys), rf)
    tier.insert(keys, rows, None, rf)
    # Wider than the tier: the native calls wrote (read) the tier's compact rows
    # into (from) these wider arrays, so every row after the first was shifted.
    with pytest.raises(ValueError, match=f"dim = {DIM + 1}, but the device tier's dim is {DIM}"):
        tier.get(0, keys, None, DIM + 1)
    with pytest.raises(ValueError, match=f"dim = {DIM + 1}, but the device tier's dim is {DIM}"):
        tier.accumulate(0, keys, np.ones((len(keys), DIM + 1), np.float32), None, DIM + 1)
    wide = np.zeros((len(keys), rf + 1), np.float32)
    message = f"row_floats = {rf + 1}, but the device tier's row_floats is {rf}"
    with pytest.raises(ValueError, match=message):
        tier.insert(keys, wide, None, rf + 1)
    with pytest.raises(ValueError, match=message):
        tier.assign(keys, wide, None, rf + 1)
    with pytest.raises(ValueError, match=message):
        tier.rows(keys, None, rf + 1)
    with pytest.raises(ValueError, match=message):
        tier.read_back(rf + 1)
    # Narrower: the native calls wrote past the end of the arrays.
    with pytest.raises(ValueError, match=f"dim = 1, but the device tier's dim is {DIM}"):
        tier.get(0, keys, None, 1)
    with pytest.raises(ValueError, match=f"row_floats = 1, but the device tier's row_floats is {rf}"):
        tier.rows(keys, None, 1)
    with pytest.raises(ValueError, match=f"row_floats = 1, but the device tier's row_floats is {rf}"):
        tier.read_back(1)
    # Nothing moved: the tier holds the rows inserted, and no gradient.
    np.testing.assert_array_equal(tier.rows(keys, None, rf), rows)
    np.testing.assert_array_equal(tier.get(0, keys, None, DIM), rows[:, :DIM])
    assert len(tier.apply()) == 0


@pytest.mark.parametrize("devices", [1, 2])
def test_an_accumulate_a_gradient_table_has_no_room_for_adds_nothing(devices):
    """Device `last`'s gradient table of 8 slots holds 6 keys' sums; a call that needs a
    slot for 3 or 4 keys more (8 twice) added the gradients of the keys that found one,
    and device 0 its key's, before TableFullError: a retry after making room added them
    twice, and the apply stepped keys the caller was told were refused. Refused whole
    now, before any device adds; the apply steps what the other calls sent."""
    opt = native_optimizer(DIM, hps.SGD(lr=0.5), hps.Uniform(0.5), seed=3)
    tier = _core.DeviceTier(devices, 64, opt, use_cuda=False, threads=1)
    last = devices - 1
    keys = np.arange(1, 12, dtype=np.uint64)
    owners = np.full(len(keys), last, np.int32)
    owners[0] = 0  # key 1 on device 0 (with one device, on the table that fills)
    rows = opt.initial_rows(keys)
    tier.insert(keys, rows, owners, DIM)
    tier.set_gradient_capacity(last, 8)
    tier.accumulate(0, keys[1:7], np.ones((6, DIM), np.float32), owners[1:7], DIM)
    lacking = 3 if devices == 2 else 4
    refused = np.array([1, 2, 8, 9, 8, 10], np.uint64)
    for _ in range(2):
        with pytest.raises(hps.TableFullError, match=rf"^device tier accumulate \(device {last}\): gradient table "
                           rf"full: the call needs a slot for each of {lacking} keys the table lacks, and 2 are free "
                           r"\(capacity 8, size 6\); no gradient was added$"):
            tier.accumulate(last, refused, np.ones((6, DIM), np.float32), owners[refused.astype(np.int64) - 1], DIM)
    assert sorted(tier.apply().tolist()) == list(range(2, 8))
    stepped = rows.copy()
    stepped[1:7] -= np.float32(0.5)
    np.testing.assert_array_equal(tier.rows(keys, owners, DIM), stepped)


def pinned_batch():
    opt = native_optimizer(2, hps.SGD(lr=0.5), hps.Uniform(0.5), seed=4)
    cache = hps.MemCache(4 * opt.row_floats, capacity=16,
                         loader=lambda k: (opt.initial_rows(k), np.zeros(len(k), bool)))
    keys = np.array([1, 2, 3], np.uint64)
    cache.pin(keys)
    batch = _core.HostBatch(cache, keys, opt)
    batch.accumulate(np.arange(3, dtype=np.int64), np.ones((3, 2), np.float32))
    batch.apply()
    return cache, keys, batch


def test_the_trained_bits_go_through_the_bindings_and_only_on_a_tier_that_tracks_them():
    tier, opt = make_tier()
    keys = np.arange(1, 5, dtype=np.uint64)
    for call in (lambda: tier.trained(keys, None), lambda: tier.set_trained(keys, None, True), tier.take_trained):
        with pytest.raises(RuntimeError, match="track_trained is off"):
            call()
    tier = _core.DeviceTier(2, 64, opt, use_cuda=False, track_trained=True)
    owners = np.array([0, 1, 1, 0], np.int32)
    tier.insert(keys, np.zeros((4, opt.row_floats), np.float32), owners, opt.row_floats)
    tier.set_trained(keys[1:3], owners[1:3], True)
    assert tier.trained(keys, owners).tolist() == [False, True, True, False]
    assert not tier.trained(keys[1:2], np.zeros(1, np.int32))[0]  # a bit is its copy's on the device named
    taken, on = tier.take_trained()
    assert sorted(zip(taken.tolist(), on.tolist())) == [(2, 1), (3, 1)] and on.dtype == np.int32
    assert len(tier.take_trained()[0]) == 0 and not tier.trained(keys, owners).any()
    with pytest.raises(TypeError, match="owners must be None or a 1-D int32 array"):
        tier.trained(keys, owners[:2])


def test_rows_trained_and_upsert_go_through_the_bindings_as_the_separate_calls():
    tier, opt = make_tier()
    keys = np.arange(1, 5, dtype=np.uint64)
    rows = np.arange(4 * opt.row_floats, dtype=np.float32).reshape(4, -1)
    with pytest.raises(RuntimeError, match="track_trained is off"):
        tier.rows_trained(keys, None, opt.row_floats)
    with pytest.raises(RuntimeError, match="track_trained is off"):
        tier.upsert(keys, rows, None, opt.row_floats, np.ones(4, bool))
    tier.upsert(keys, rows, None, opt.row_floats)  # without bits: assign, then insert
    np.testing.assert_array_equal(tier.rows(keys, None, opt.row_floats), rows)

    tier = _core.DeviceTier(2, 64, opt, use_cuda=False, track_trained=True)
    owners = np.array([0, 1, 1, 0], np.int32)
    tier.insert(keys[:2], np.zeros((2, opt.row_floats), np.float32), owners[:2], opt.row_floats)
    tier.set_trained(keys[:2], owners[:2], True)
    # 1 and 2 overwritten (1 clean now, 2 still trained), 3 and 4 inserted (3 trained)
    tier.upsert(keys, rows, owners, opt.row_floats, np.array([False, True, True, False]))
    got, trained = tier.rows_trained(keys[::-1].copy(), owners[::-1].copy(), opt.row_floats)
    np.testing.assert_array_equal(got, rows[::-1])
    assert trained.dtype == bool and trained.tolist() == [False, True, True, False][::-1]
    assert trained.tolist() == tier.trained(keys[::-1].copy(), owners[::-1].copy()).tolist()
    tier.upsert(keys, rows + 1, owners, opt.row_floats, None)  # None: every row clean
    assert not tier.rows_trained(keys, owners, opt.row_floats)[1].any()
    with pytest.raises(TypeError, match="trained must be None or a 1-D bool array"):
        tier.upsert(keys, rows, owners, opt.row_floats, np.ones(3, bool))
    with pytest.raises(TypeError, match="trained must be None or a 1-D bool array"):
        tier.upsert(keys, rows, owners, opt.row_floats, np.ones(4, np.uint8))
    with pytest.raises(ValueError, match="row_floats"):
        tier.rows_trained(keys, owners, opt.row_floats + 1)
    with pytest.raises(IndexError, match="is not loaded on device"):
        tier.rows_trained(np.array([99], np.uint64), np.zeros(1, np.int32), opt.row_floats)


def test_a_host_batch_release_that_fails_raises_and_is_counted():
    cache, keys, batch = pinned_batch()
    assert cache.stats()["failed_releases"] == 0
    cache.unpin(keys[1:2])  # something else takes the batch's pin of key 2
    with pytest.raises(RuntimeError,
                       match=r"1 of 3 keys were no longer pinned by this batch \(keys\[1\] = 2 \(updated\)\)"):
        batch.release()
    s = cache.stats()
    assert s["pinned"] == 0, "the other keys are released all the same"
    assert s["dirty"] == 3, "keys 1 and 3, stepped, and key 2's step, kept where its row lies"
    assert s["failed_releases"] == 1
    batch.release()  # released: nothing more happens
    assert cache.stats()["failed_releases"] == 1


def test_a_host_batch_dropped_unreleased_reports_a_failure_on_stderr(capfd):
    cache, keys, batch = pinned_batch()
    cache.unpin(keys[2:])
    del batch  # the destructor releases it and cannot raise
    err = capfd.readouterr().err
    assert "a host batch of 3 keys released by its destructor: host batch release: 1 of 3 keys" in err, err
    s = cache.stats()
    assert s["pinned"] == 0 and s["failed_releases"] == 1


def test_cuda_devices_must_name_a_gpu_for_each_endpoint():
    opt = native_optimizer(DIM, hps.SGD(lr=0.1), hps.Uniform(0.5), seed=3)
    with pytest.raises(ValueError, match="cuda_devices names 3 GPUs, but the tier has 2 endpoints"):
        _core.DeviceTier(2, 64, opt, use_cuda=True, cuda_devices=[0, 0, 0])
    if hps.cuda_device_count() == 0:  # GPUs the node lacks: host partitions, as without the list
        tier = _core.DeviceTier(2, 64, opt, use_cuda=True, cuda_devices=[0, 0])
        assert tier.kind == "cpu" and not tier.accepts_gpu_memory
