"""The device-tier batch on the native working set (hps._core.WorkingSet) and the
batch protocol (hps.parameter_server.WorkingBatch) that every kind of batch
implements: the same results as the in-place path, no pin left by a failure,
and a pull/push-only batch served through the protocol's adapter."""
import numpy as np
import pytest

import hps
from hps import _core
from hps.parameter_server import Batch, HostBatch, WorkingBatch, working_batch

DIM = 4


def server(tmp_path, name, **kw):
    return hps.ParameterServer(hps.ParameterServerConfig(dim=DIM, path=str(tmp_path / name), mem_budget="1MiB",
                                                         optimizer=hps.AdaGrad(lr=0.1), **kw))


def steps(seed=0, n=4):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 300, size=(32, 3)).astype(np.uint64) for _ in range(n)]


def train(ps, batches, workers, overlap, views=False):
    """Each batch through the protocol: workers gather their share and accumulate
    a gradient that depends on the rows (so earlier steps matter). views: each
    share a view of the batch's keys (as hps.train reads them), else a copy."""
    for keys in batches:
        b = ps.batch(ps.prefetch(keys), overlap=overlap)
        assert isinstance(b, WorkingBatch)
        for worker, idx in enumerate(np.array_split(np.arange(len(keys)), workers)):
            pos = b.positions(keys[idx[0]:idx[-1] + 1] if views else keys[idx])
            rows = b.gather(pos, worker=worker)
            b.accumulate(pos, np.ascontiguousarray(np.sin(rows) + 0.1), worker=worker)
        b.finish()


def copying_tier(self, capacity):
    """ParameterServer._new_tier with copies of the rows in the host partitions'
    tables, as a GPU tier holds them (the default binds MEM-PS's rows)."""
    return _core.DeviceTier(self.config.devices, capacity, self._native_opt, threads=self.config.device_threads,
                            routes=self._routes, bind_host_rows=False)


@pytest.mark.parametrize("bind", [True, False], ids=["bound", "copying"])
@pytest.mark.parametrize("views", [False, True], ids=["copies", "views"])
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_the_device_tier_path_equals_the_in_place_path(tmp_path, monkeypatch, devices, views, bind):
    if not bind:
        monkeypatch.setattr(hps.ParameterServer, "_new_tier", copying_tier)
    batches = steps()
    in_place = server(tmp_path, "in_place")
    tier = server(tmp_path, "tier", devices=devices, host_in_place=False)
    assert tier._slots[0].tier.binds_host_rows is bind
    train(in_place, batches, 1, overlap=False)
    train(tier, batches, devices, overlap=True, views=views)
    keys = np.unique(np.concatenate([b.reshape(-1) for b in batches]))
    np.testing.assert_allclose(tier.pull(keys), in_place.pull(keys), rtol=1e-6, atol=1e-7)
    assert tier.stats()["device"]["kind"] == "cpu"
    assert tier.stats()["mem"]["pinned"] == 0
    assert tier.stats()["mem"]["dirty"] == in_place.stats()["mem"]["dirty"] > 0


def test_a_device_batch_knows_its_workers_shares_from_the_prefetch(tmp_path):
    ps = server(tmp_path, "ps", devices=2, host_in_place=False)
    keys = np.array([[5, 9], [7, 9], [3, 5], [11, 7]], np.uint64)
    pre = ps.prefetch(keys)
    b = ps.batch(pre)
    assert b.gathers_into_columns  # host partitions: the tier reads its rows in place
    assert b.positions(keys) is pre.inverse
    share = keys[2:]  # the second worker's examples, a view of the batch's keys
    np.testing.assert_array_equal(b.positions(share), pre.inverse[4:])
    np.testing.assert_array_equal(b.positions(share.view(np.int64)), pre.inverse[4:])
    np.testing.assert_array_equal(b.positions(share.copy()), pre.inverse[4:])  # looked up
    np.testing.assert_array_equal(b.keys[b.positions(np.array([11, 3], np.uint64))], [11, 3])
    with pytest.raises(IndexError, match=r"keys\[1\] = 4 is not in the batch"):
        b.positions(np.array([9, 4], np.uint64))
    with pytest.raises(IndexError, match=r"positions\[0\] = 6 is outside \[0, 5\)"):
        b.gather(np.array([6], np.int64), worker=1)
    b.abort()
    assert ps.stats()["mem"]["pinned"] == 0


def test_gather_into_the_columns_of_a_wider_matrix(tmp_path):
    ps = server(tmp_path, "ps", devices=2, host_in_place=False)
    keys = np.array([[1, 2], [3, 1]], np.uint64)
    b = ps.batch(keys)
    x = np.full((2, 2 * DIM + 3), 7.0, np.float32)
    pos = b.positions(keys)
    b.gather(pos, x[:, :2 * DIM])
    want = b.pull(keys.reshape(-1)).reshape(2, 2 * DIM)
    np.testing.assert_array_equal(x[:, :2 * DIM], want)
    assert (x[:, 2 * DIM:] == 7.0).all()
    b.accumulate(pos, np.ones((2, 2 * DIM + 3), np.float32)[:, :2 * DIM])
    b.finish()
    assert ps.stats()["mem"]["dirty"] == 3


def test_a_batch_too_big_for_a_device_is_refused_with_nothing_pinned(tmp_path):
    ps = server(tmp_path, "ps", devices=2, host_in_place=False, device_capacity=4)
    keys = np.arange(1, 41, dtype=np.uint64)
    with pytest.raises(ValueError, match="more than device_capacity = 4"):
        ps.prefetch(keys)
    assert ps.stats()["mem"]["pinned"] == 0
    with ps.batch(keys[:4]) as b:  # the server still works
        b.push(keys[:4], np.ones((4, DIM), np.float32))
    assert ps.stats()["mem"]["pinned"] == 0


def test_abort_before_apply_drops_the_gradients_and_every_pin(tmp_path):
    ps = server(tmp_path, "ps", devices=2, host_in_place=False)
    keys = np.arange(1, 9, dtype=np.uint64)
    before = ps.pull(keys)
    b = ps.batch(keys)
    b.push(keys, np.ones((8, DIM), np.float32))
    b.abort()
    assert ps.stats()["mem"]["pinned"] == 0
    np.testing.assert_array_equal(ps.pull(keys), before)
    with pytest.raises(RuntimeError, match="write_back before apply"):
        ps.batch(keys).write_back()


def test_a_released_prefetch_unpins_its_keys(tmp_path):
    ps = server(tmp_path, "ps", devices=2, host_in_place=False)
    pre = ps.prefetch(np.arange(1, 9, dtype=np.uint64))
    assert ps.stats()["mem"]["pinned"] == 8
    pre.release()
    assert ps.stats()["mem"]["pinned"] == 0


def test_the_working_set_refuses_calls_out_of_order(tmp_path):
    ps = server(tmp_path, "ps", devices=2, host_in_place=False)
    keys = np.array([5, 6, 5], np.uint64)
    ws, uniq, inverse, hits, most = _core.WorkingSet.pin(ps._cache, keys, ps._native_opt, 2)
    np.testing.assert_array_equal(uniq, [5, 6])
    np.testing.assert_array_equal(inverse, [0, 1, 0])
    assert hits == 0 and 1 <= most <= 2
    with pytest.raises(RuntimeError, match="before load"):
        ws.apply()
    with pytest.raises(TypeError, match="owners must be None or a 1-D int32 array"):
        ws.set_owners(np.zeros(3, np.int32))
    with pytest.raises(ValueError, match=r"owners\[0\] = 2 \(key 5\) is not a device in \[0, 2\)"):
        ws.set_owners(np.array([2, 0], np.int32))
    ws.abort()
    assert ws.released
    assert ps.stats()["mem"]["pinned"] == 0


class PullPushOnly:
    """A batch with pull and push by keys only (the distributed batch's shape)."""

    def __init__(self, inner):
        self.inner, self.keys, self.wait_seconds = inner, inner.keys, 0.0

    def pull(self, keys, worker=0):
        return self.inner.pull(keys, worker=worker)

    def push(self, keys, grads, worker=0):
        self.inner.push(keys, grads, worker=worker)

    def apply(self):
        self.inner.apply()

    def write_back(self):
        self.inner.write_back()

    def finish(self):
        self.inner.finish()

    def abort(self):
        self.inner.abort()


def test_every_batch_kind_is_a_working_batch_and_others_are_adapted(tmp_path):
    in_place, tier = server(tmp_path, "a"), server(tmp_path, "b", devices=2, host_in_place=False)
    keys = np.array([[1, 2], [2, 3]], np.uint64)
    hb, tb = in_place.batch(keys), tier.batch(keys)
    assert type(hb) is HostBatch and type(tb) is Batch
    assert working_batch(hb) is hb and working_batch(tb) is tb and working_batch(None) is None
    other = PullPushOnly(server(tmp_path, "c", devices=2, host_in_place=False).batch(keys))
    assert not isinstance(other, WorkingBatch)
    adapted = working_batch(other)
    assert isinstance(adapted, WorkingBatch)
    for b in (hb, tb, adapted):
        pos = b.positions(keys)
        b.accumulate(pos, np.ones((4, DIM), np.float32))
        b.finish()
    flat = np.array([1, 2, 3], np.uint64)
    np.testing.assert_allclose(tier.pull(flat), in_place.pull(flat), rtol=1e-6)
    np.testing.assert_allclose(other.inner._ps.pull(flat), in_place.pull(flat), rtol=1e-6)


@pytest.mark.parametrize("devices,in_place", [(1, False), (2, False), (1, True)])
def test_gather_and_accumulate_of_tensors_equal_the_arrays(tmp_path, devices, in_place):
    # A model on a GPU hands the batch torch tensors; on the host they take the
    # native path by address (one device tier) or the protocol's through numpy.
    torch = pytest.importorskip("torch")
    batches = steps(seed=3, n=2)
    by_array = server(tmp_path, "arrays", devices=devices, host_in_place=in_place)
    by_tensor = server(tmp_path, "tensors", devices=devices, host_in_place=in_place)
    for keys in batches:
        a, t = by_array.batch(keys), by_tensor.batch(keys)
        for worker, idx in enumerate(np.array_split(np.arange(len(keys)), devices)):
            pa, pt = a.positions(keys[idx]), t.positions(keys[idx])
            rows = a.gather(pa, worker=worker)
            out = torch.full((len(pt), DIM), 7.0)
            assert t.gather_tensor(pt, out, worker=worker) is out
            np.testing.assert_array_equal(out.numpy(), rows)
            grads = np.ascontiguousarray(np.cos(rows) - 0.2, dtype=np.float32)
            a.accumulate(pa, grads, worker=worker)
            t.accumulate_tensor(pt, torch.from_numpy(grads.copy()), worker=worker)
        a.finish()
        t.finish()
    keys = np.unique(np.concatenate([b.reshape(-1) for b in batches]))
    np.testing.assert_array_equal(by_tensor.pull(keys), by_array.pull(keys))


def test_a_tensor_of_the_wrong_shape_is_refused_not_overrun(tmp_path):
    torch = pytest.importorskip("torch")
    ps = server(tmp_path, "ps", devices=1, host_in_place=False)
    keys = np.array([[1, 2], [3, 4]], np.uint64)
    b = ps.batch(keys)
    pos = b.positions(keys)
    with pytest.raises(ValueError):
        b.gather_tensor(pos, torch.empty(3, DIM))  # 4 rows asked: the numpy way names the mismatch
    with pytest.raises(ValueError, match="takes host memory only; a GPU's memory needs a CUDA tier of one device"):
        b._ws.get_into(0, pos, torch.empty(4, DIM).data_ptr(), True)
    b.abort()
