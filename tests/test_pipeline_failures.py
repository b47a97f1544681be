"""The pipeline's failure paths (hps.pipeline): a stage that fails at batch k
stops the run with its error, no stage left waiting, every pin let go. The
failures are injected at a chosen batch and the stages brought to the state
that matters by events, not by timing."""
import queue
import threading
from pathlib import Path

import numpy as np
import pytest

import hps.pipeline
from hps.parameter_server import ParameterServer, ParameterServerConfig
from hps.pipeline import Loaded, Pipeline

HANG = 60  # seconds: a run still going by then is waiting for good
TOPOLOGY = Path(__file__).resolve().parents[1] / "examples" / "topologies" / "pcie_only.toml"
# Device tiers on host partitions: bound to MEM-PS's rows, or (a topology's routes)
# holding copies of them, written back at the end of each batch.
TIERS = {"bound": dict(devices=2), "one-device": dict(devices=1),
         "copies": dict(devices=2, topology=str(TOPOLOGY))}


class Data:
    def __init__(self, i):
        self.keys = np.array([[i, 1000 + i], [7, 8]], np.uint64)  # keys 7 and 8 in every batch
        self.labels = np.zeros(2, np.float32)


def server(path, **kw):
    return ParameterServer(ParameterServerConfig(dim=4, path=str(path), mem_budget="1MiB", **kw))


def push_ones(loaded):
    b = loaded.batch
    for w, idx in enumerate(loaded.minibatches):
        k = loaded.data.keys[idx].reshape(-1)
        b.push(k, np.ones((len(k), 4), np.float32), worker=w)


def run_to_the_end(pipeline, source):
    """pipeline.run(source) on a thread: (finished, the exception it raised)."""
    raised = []

    def go():
        try:
            pipeline.run(source)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            raised.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(HANG)
    return not t.is_alive(), (raised[0] if raised else None)


def rows_after(path, batches, **kw):
    """The rows of every key of `batches` after training them, one after another."""
    ps = server(path, **kw)
    Pipeline(ps, push_ones).run(batches, pipelined=False)
    keys = np.unique(np.concatenate([b.keys.reshape(-1) for b in batches]))
    return keys, ps.pull(keys)


@pytest.mark.parametrize("tier", TIERS)
def test_a_failed_write_back_stops_the_run_while_the_next_batch_waits_to_be_written_back(tmp_path, tier):
    """Batch k's write-back fails once batch k+1 is queued behind it and the loader
    waits for k+1's device tier (to load k+3): that batch lets go of its tier while
    the stages stop. (It was let go of only after they had stopped: the loader
    waited for good.)"""
    k = 2
    kw = dict(TIERS[tier], host_in_place=False)  # on device tiers, which batches take turns on
    ps = server(tmp_path / "a", **kw)
    loading_k3, training_k2 = threading.Event(), threading.Event()
    made = [0]
    real_batch = ps.batch

    def batch(prefetched, overlap=False):
        made[0] += 1
        if made[0] == k + 4:  # batch k+3: its tier is k+1's
            loading_k3.set()
        return real_batch(prefetched, overlap=overlap)

    ps.batch = batch
    trained = [0]

    def step(loaded):
        push_ones(loaded)
        if trained[0] == k:
            b = loaded.batch
            real_write_back = b.write_back

            def write_back():
                real_write_back()  # frees k's tier: k+2 loads, and k+1 is queued for its write-back
                training_k2.wait(HANG)
                raise OSError("MEM-PS write-back of batch 2 failed")

            b.write_back = write_back
        if trained[0] == k + 2:  # k+1 is queued; the loader is in batch() for k+3
            loading_k3.wait(HANG)
            training_k2.set()
        trained[0] += 1

    data = [Data(i) for i in range(10)]
    finished, error = run_to_the_end(Pipeline(ps, step), data)
    assert finished, "the run waited for good after a write-back failed"
    assert loading_k3.is_set() and training_k2.is_set()  # the run went through the state this test is about
    assert isinstance(error, OSError) and "batch 2 failed" in str(error)
    assert ps.stats()["mem"]["pinned"] == 0
    assert all(slot.free.is_set() for slot in ps._slots)
    # Batches k+1 and k+2 trained (k+2 on k+1's rows of keys 7 and 8): their steps
    # are kept, in that order.
    keys, rows = rows_after(tmp_path / "ref", data[:k + 3], **kw)
    np.testing.assert_array_equal(ps.pull(keys), rows)


class _InterruptedHandOff:
    """hps.pipeline's queue module, but the train stage's hand-off of batch `at`
    to the write-back (a put from the main thread) raises KeyboardInterrupt, as a
    Ctrl-C arriving while the trainer waits for the writer does."""

    Full, Empty = queue.Full, queue.Empty

    def __init__(self, at):
        outer = self
        self.handed = 0

        class Queue(queue.Queue):
            def put(self, item, block=True, timeout=None):
                if isinstance(item, Loaded) and threading.current_thread() is threading.main_thread():
                    outer.handed += 1
                    if outer.handed == at + 1:
                        raise KeyboardInterrupt
                super().put(item, block, timeout)

        self.Queue = Queue


@pytest.mark.parametrize("tier", [*TIERS, "in-place"])
@pytest.mark.parametrize("pipelined", [True, False])
def test_an_interrupt_between_a_batchs_step_and_its_write_back_writes_it_back(tmp_path, monkeypatch, pipelined,
                                                                               tier):
    """Ctrl-C after batch k trained, before the write-back stage took it: batch k
    is written back all the same (its step is kept, as for every batch trained),
    and nothing stays pinned or holds a device tier, so a checkpoint after it
    does not wait for good. (The batch was dropped with its pins and its tier.)"""
    k = 3
    data = [Data(i) for i in range(8)]
    kw = dict(devices=1) if tier == "in-place" else dict(TIERS[tier], host_in_place=False)
    ps = server(tmp_path / "a", **kw)
    pipeline = Pipeline(ps, push_ones)
    if pipelined:
        monkeypatch.setattr(hps.pipeline, "queue", _InterruptedHandOff(k))
    else:
        real_timed, written = pipeline._timed, [0]

        def timed(stage, fn, *args, **kwargs):
            if stage == "write_back":
                written[0] += 1
                if written[0] == k + 1:
                    raise KeyboardInterrupt
            return real_timed(stage, fn, *args, **kwargs)

        pipeline._timed = timed
    with pytest.raises(KeyboardInterrupt):
        pipeline.run(data, pipelined=pipelined)
    assert ps.stats()["mem"]["pinned"] == 0
    checkpointed = threading.Thread(target=ps.checkpoint, daemon=True)
    checkpointed.start()
    checkpointed.join(HANG)
    assert not checkpointed.is_alive(), "the checkpoint waited for good for a batch dropped by the interrupt"
    keys, rows = rows_after(tmp_path / "ref", data[:k + 1], **kw)
    np.testing.assert_array_equal(ps.pull(keys), rows)


@pytest.mark.parametrize("tier", [*TIERS, "in-place", "herald"])
@pytest.mark.parametrize("pipelined", [True, False])
def test_an_abort_that_fails_in_the_cleanup_leaves_the_steps_error_and_the_cleanup_whole(
        tmp_path, monkeypatch, capfd, pipelined, tier):
    """Batch k's step fails; the cleanup aborts it (pipelined, the batches queued behind
    it too), and each abort fails after letting go of its batch (an unpin of a key
    something else unpinned, say). The run raises the step's error, the aborts' go to
    stderr, and the cleanup goes on: no stage is left running and nothing stays
    pinned. (The first abort's error took the step's place and, pipelined, cut the
    cleanup short: the stages went on running, the queued batches kept their pins.)"""
    from hps.parameter_server import Batch, HostBatch
    from hps.worker_caches import HeraldBatch
    k = 3
    kw = {"in-place": dict(devices=1), "herald": dict(devices=2, schedule="herald", worker_cache_rows=16)}.get(
        tier) or dict(TIERS[tier], host_in_place=False)
    ps = server(tmp_path / "a", **kw)

    def failing(abort):
        def wrapped(self):
            abort(self)
            raise RuntimeError("a key was unpinned by something else")
        return wrapped

    for cls in (Batch, HostBatch, HeraldBatch):
        monkeypatch.setattr(cls, "abort", failing(cls.abort))
    trained = [0]

    def step(loaded):
        if trained[0] == k:
            raise ValueError(f"the step of batch {k} failed")
        push_ones(loaded)
        trained[0] += 1

    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="the step of batch 3 failed"):
        Pipeline(ps, step).run([Data(i) for i in range(10)], pipelined=pipelined)
    assert "a key was unpinned by something else" in capfd.readouterr().err
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
    assert ps.stats()["mem"]["pinned"] == 0


class _Failing:
    """A batch's native part (or Herald's tier) whose optimizer step raises (a device
    lost mid-step) and whose release raises after releasing (an unpin of a key
    something else unpinned)."""

    def __init__(self, real, release):
        self._real = real
        self._release = release

    def __getattr__(self, name):
        if name == self._release:
            def released(*args):
                getattr(self._real, name)(*args)
                raise RuntimeError("a key was unpinned by something else")
            return released
        return getattr(self._real, name)

    def apply(self):
        raise OSError("device 2 lost")


def failing_batch(tmp_path, tier, monkeypatch):
    """A batch of `tier` that took its gradients, whose apply and release fail."""
    kw = {"in-place": dict(devices=1), "herald": dict(devices=2, schedule="herald", worker_cache_rows=16)}.get(
        tier) or dict(TIERS[tier], host_in_place=False)
    ps = server(tmp_path / "a", **kw)
    data = Data(1)
    b = ps.batch(ps.prefetch(data.keys))
    parts = b.partition() if tier == "herald" else np.array_split(np.arange(2), ps.config.devices)
    push_ones(Loaded(data, b, parts))
    if tier == "herald":
        ps._herald._tier = _Failing(ps._herald._tier, "")
        monkeypatch.setattr(ps, "_cache", _Failing(ps._cache, "unpin"))
    elif tier == "in-place":
        b._native = _Failing(b._native, "release")
    else:
        b._ws = _Failing(b._ws, "abort")
    return ps, b


@pytest.mark.parametrize("tier", [*TIERS, "in-place", "herald"])
def test_a_failed_apply_raises_its_error_when_the_release_after_it_fails_too(tmp_path, monkeypatch, capfd, tier):
    """apply() releases a batch whose step failed; a release that fails as well is
    written to stderr, and the step's error is the one raised (the release's took its
    place: the caller learnt that a key was unpinned, not that a device was lost)."""
    ps, b = failing_batch(tmp_path, tier, monkeypatch)
    with pytest.raises(OSError, match="device 2 lost"):
        b.apply()
    assert "a key was unpinned by something else" in capfd.readouterr().err
    assert ps.stats()["mem"]["pinned"] == 0


@pytest.mark.parametrize("tier", [*TIERS, "in-place", "herald"])
def test_a_with_block_that_fails_raises_its_error_when_the_abort_after_it_fails_too(tmp_path, monkeypatch, capfd,
                                                                                    tier):
    ps, b = failing_batch(tmp_path, tier, monkeypatch)
    with pytest.raises(ValueError, match="the step failed"):
        with b:
            raise ValueError("the step failed")
    assert "a key was unpinned by something else" in capfd.readouterr().err
    assert ps.stats()["mem"]["pinned"] == 0


@pytest.mark.parametrize("tier", ["bound", "in-place", "herald"])
def test_a_batch_whose_load_fails_raises_its_error_when_the_release_after_it_fails_too(tmp_path, monkeypatch, capfd,
                                                                                       tier):
    """ps.batch() lets go of a prefetch whose load failed (a device out of memory);
    a release that fails as well is written to stderr, and the load's error is the
    one raised (the release's took its place)."""
    import hps.parameter_server as hps_ps
    from hps.worker_caches import HeraldBatch
    kw = {"in-place": dict(devices=1), "herald": dict(devices=2, schedule="herald", worker_cache_rows=16)}.get(
        tier) or dict(TIERS[tier], host_in_place=False)
    ps = server(tmp_path / "a", **kw)

    def fails(*args, **kwargs):
        raise MemoryError("device 1 out of memory")

    pre = ps.prefetch(Data(1).keys)
    if tier == "herald":
        monkeypatch.setattr(HeraldBatch, "_copies_of", fails)  # after the snapshot took the batch
        monkeypatch.setattr(ps, "_cache", _Failing(ps._cache, "unpin"))
    elif tier == "in-place":
        monkeypatch.setattr(hps_ps.HostBatch, "__init__", fails)
        monkeypatch.setattr(ps, "_cache", _Failing(ps._cache, "unpin"))
    else:
        monkeypatch.setattr(ps, "_fit_tier", fails)
        pre.working_set = _Failing(pre.working_set, "abort")
    with pytest.raises(MemoryError, match="device 1 out of memory"):
        ps.batch(pre)
    assert "a key was unpinned by something else" in capfd.readouterr().err
    assert ps.stats()["mem"]["pinned"] == 0


@pytest.mark.parametrize("tier", ["bound", "copies", "in-place"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_a_batch_whose_load_fails_counts_neither_a_batch_nor_a_step(tmp_path, monkeypatch, pipelined, tier):
    """The server's step (batches made: what [ps] ttl_steps counts and a checkpoint
    keeps) and its count of batches name the batches trained after batch k's load
    failed (a device out of memory). The step was advanced before the load, and
    stayed one ahead of the batches for good."""
    import hps.parameter_server as hps_ps
    k = 3
    kw = dict(devices=1) if tier == "in-place" else dict(TIERS[tier], host_in_place=False)
    ps = server(tmp_path / "a", **kw)
    loads = [0]

    def failing(load):
        def wrapped(*args, **kwargs):
            loads[0] += 1
            if loads[0] == k + 1:
                raise MemoryError("device 1 out of memory")
            return load(*args, **kwargs)
        return wrapped

    if tier == "in-place":
        monkeypatch.setattr(hps_ps, "HostBatch", failing(hps_ps.HostBatch))
    else:
        monkeypatch.setattr(ps, "_fit_tier", failing(ps._fit_tier))
    with pytest.raises(MemoryError, match="device 1 out of memory"):
        Pipeline(ps, push_ones).run([Data(i) for i in range(8)], pipelined=pipelined)
    assert ps.stats()["counts"]["batches"] == k and ps.step == k
    assert ps.stats()["mem"]["pinned"] == 0
    ps.checkpoint()
    ps.close()
    assert ParameterServer.open(str(tmp_path / "a")).step == k
